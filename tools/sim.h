/*
 * kvf-sim's shared state, one struct sim for the whole run, and the four
 * parts that use it:
 *
 *   sim.c         main(): the options, then setup, run, report, in that order
 *   sim_engine.c  the engine: requests and block pools, admission, steps,
 *                 chunks, writing layers, publishing layer-dones, submitting
 *   sim_verify.c  content patterns, the events (completions, arrivals),
 *                 verification and each request's accounting
 *   sim_report.c  the progress line, the summary text and its JSON
 *   sim_gpu.cu    GPU mode (--gpu, tools/sim_gpu.h): layers as kernels, checks on the GPU
 *                 (sim_gpu_none.c in a build without CUDA)
 *   sim_tp.c      groups of different sizes or block sizes (mixed mode): the split, the
 *                 tasks per (prefill rank, decode rank), content per (head, token), checks
 *
 * Topologies: one or more prefill instances and one or more decode instances
 * (--prefill and --decode, each given once per instance; commas name the
 * ranks of one instance's tensor-parallel group). Each instance is one engine
 * session (one kvf_group). Request i is prefilled by prefill instance
 * i mod (number of prefill instances); the prefill engine sends it to the
 * decode instance with the most free blocks when it is admitted (ties: the
 * one after the last chosen). Each decode engine hands out its blocks from
 * one pool, whatever the source: blocks of different sources never overlap.
 *
 * Mixed mode: the prefill instances' groups and the decode instances' differ in size
 * (--prefill-tp, --decode-tp), in heads per rank or in block size (common/tpsplit.h). Each
 * prefill rank then submits one task per decode rank it sends heads to (id "r<seq>.d<j>"),
 * the simulator takes each rank's events itself (not through kvf_group_poll, which waits for
 * one event per rank and id) and a request is complete once every task's completion and
 * arrival came; every head of every token of every block is checked on every decode rank.
 *
 * Single-threaded: every function here runs on main()'s thread, except that
 * the SIGTERM/SIGINT handler sets `stop`.
 */
#ifndef KVF_SIM_H
#define KVF_SIM_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvferry.h"
#include "shm_layout.h"
#include "sim_keys.h"

#define KVF_SIM_PROG "kvf-sim"
#define KVF_SIM_MAX_RANKS 8
#define KVF_SIM_MAX_INSTANCES 16u /* per side */

/* What kvf-sim's thread is doing (struct sim's phase_ns; the JSON's sim_phase_s). */
enum sim_phase {
        SIM_PH_WRITE,      /* queueing or writing a layer's content */
        SIM_PH_LAYER,      /* layer-done calls (GPU mode: the layer's kernels and
                            * kvf_layer_done_on_stream, with the engine executor its copies) */
        SIM_PH_STEP_END,   /* GPU mode: waiting for a step's kernels */
        SIM_PH_SUBMIT,     /* task records */
        SIM_PH_POLL,       /* kvf_sim_poll_events: events, verification, their waits */
        SIM_PHASES
};

/* One request, prefill and decode side. Indexed by its number: its id is "r<seq>". */
struct sim_req {
        uint32_t seq;
        char id[48];
        uint32_t tokens, n_src, n_dst, first;
        uint32_t *src, *dst;
        unsigned pi, di; /* its prefill instance (fixed) and decode instance (at admission) */
        bool admitted;   /* its blocks were reserved (what counts after a stop) */
        uint32_t done_tokens;   /* prefilled so far */
        uint64_t last_layer_ns; /* publish time of its final layer */
        uint32_t last_blocks;   /* blocks its final step sends per layer and tensor */
        bool late_task;         /* submit the task after its layers are published */
        bool cancel;            /* cancel it halfway through its step */
        bool cancel_sent;       /* ... and did (counted once in cancels_sent) */
        bool submitted;
        int completion; /* -1 until known */
        int arrival;    /* -1 until known */
        bool verified;
        bool verify_pending; /* GPU mode: its blocks are queued for the next batch check */
        uint64_t verify_bytes; /* ... and what that check covers */
        /* mixed mode: the tasks (bit 8 i + j: prefill rank i -> decode rank j) whose completion
         * and arrival came, and the first status other than finished of each side */
        uint64_t cparts, aparts;
        int cstat, astat;
        uint64_t bytes, arrival_ns, completion_ns, completion_seen_ns;
        uint64_t sender_last_ns; /* the completion's last_layer_ns: when the sender saw its last layer */
        uint64_t notice_ns; /* the arrival's accept_ns (same host): the sender posted its notice */
        bool src_freed, dst_freed;
        char reason[240];
};

/* A cache's free block ids (a stack). */
struct sim_pool {
        uint32_t *free;
        uint32_t n, cap;
};

/* A side's instance: its ranks' names, and what tasks name as the peer (decode side). */
struct sim_inst_opts {
        const char *name[KVF_SIM_MAX_RANKS];
        const char *peer[KVF_SIM_MAX_RANKS]; /* default: the decode instance's name; --peer-map */
};

struct sim_opts {
        struct sim_inst_opts prefill[KVF_SIM_MAX_INSTANCES], decode[KVF_SIM_MAX_INSTANCES];
        unsigned nprefill, ndecode; /* instances per side */
        unsigned ranks;             /* ranks per prefill instance, the same for all */
        unsigned dranks;            /* ranks per decode instance, the same for all */
        unsigned prefill_tp, decode_tp; /* --prefill-tp, --decode-tp (0: not given) */
        unsigned requests;
        const char *trace;
        unsigned layer_us;
        uint64_t layer_ns_per_token; /* --layer-ns-per-token: more compute per token in the step */
        unsigned step_tokens;
        unsigned chunk_tokens;
        unsigned prefix_pct, late_pct, cancel_pct;
        unsigned max_tokens;
        unsigned timeout_s;
        int transport;
        uint64_t seed;
        const char *json;
        const char *timeline; /* --timeline FILE (GPU mode): one line per step of prefill instance 0 */
        const char *session_log;
        unsigned drain_previous_s;
        bool quiet;
        bool baseline;
        bool warm_caches; /* touch every page of the caches before the clock starts */
        /*
         * --verify full writes and checks every word of every block. --verify sample
         * does the first and last 64 bytes of each block only: every block still
         * carries its own key at both ends (a block sent to the wrong place, or too
         * early, or torn at either end, is caught) while the simulator stops eating
         * a core that a GPU engine would not use; benchmarks use it.
         */
        bool sample_only;
        bool scatter; /* --scatter: block ids in random order, so no two are contiguous */
        bool per_head; /* --per-head: mixed mode for equal groups too */
        bool gpu;     /* --gpu: GPU mode asked for (it is also chosen when the caches are on GPUs) */
        bool gpu_default_stream; /* --gpu-default-stream: the engine works on the legacy default stream */
        /* --strict: the run fails unless every request finished, verified (or ended 'cancelled'
         * after the simulator cancelled it); always so with more than one instance per side.
         * Otherwise a request that failed is accounted for and fails nothing (the fault tests
         * make requests fail on purpose). */
        bool strict;
};

/* Per finished request: its transfer tail, and what the tail had to carry. */
struct sim_tail {
        unsigned pi, di; /* its prefill and decode instances */
        uint64_t ns;   /* last layer-done -> arrival */
        uint64_t cns;  /* last layer-done -> completion (prefill side) */
        uint64_t left; /* bytes left to send at its last layer-done: its final step's share
                          of one layer, or all of it when its task came after the layers */
        bool late;     /* its task came after its last layer */
        int64_t seen_ns; /* last layer-done -> the sender saw it (its completion's last_layer_ns;
                          * GPU mode: from the kernel's end, so the signal's delay shows) */
        int64_t notice_ns; /* last layer-done -> the sender posted its notice (same host; 0 not
                            * known): the rest of the tail is the decode connector's */
        uint32_t seq;    /* the request (for the slowest tails' list) */
        uint64_t at_ns;  /* its last layer-done, from the run's start */
};

struct sim_gpu;

/* One instance as its engine sees it: one client session per rank (a group), its block pool
 * and the accounting of the requests it prefilled (prefill) or received (decode). */
struct sim_inst {
        const struct sim_inst_opts *o;
        struct kvf_group *g;
        struct kvf_layout_info L;
        /* prefill: its source blocks; decode: its destination blocks, for every source */
        struct sim_pool pool;
        uint64_t admitted, done, finished, failed, bytes;
        /* prefill: the sender's histograms at the start (sim_report.c) */
        struct kvf_histogram hist_before[KVF_HIST_COUNT];
};

struct sim {
        struct sim_opts o;
        /* GPU mode (tools/sim_gpu.h): the caches are on GPUs, each layer is a kernel, the
         * checks run on the GPU. NULL in host mode. */
        struct sim_gpu *sg;
        bool gpu_content_checked; /* mixed GPU mode: one block read back and checked on the host */
        FILE *timeline; /* --timeline, open while the run goes */
        struct sim_inst pre[KVF_SIM_MAX_INSTANCES], dec[KVF_SIM_MAX_INSTANCES];
        unsigned npre, ndec;
        struct kvf_layout_info L;  /* the (first) prefill instance's layout */
        struct kvf_layout_info Ld; /* the (first) decode instance's layout */
        uint32_t layers, tensors; /* tensors: every tensor of a layer, scale tensors included */
        /* Mixed mode (sim_tp.c): the groups differ in size, heads per rank or block size. */
        bool mixed;
        uint32_t heads;  /* the model's kv heads (kvf_tp_check) */
        uint32_t pfirst[KVF_SIM_MAX_RANKS], pcount[KVF_SIM_MAX_RANKS]; /* each rank's heads */
        uint32_t dfirst[KVF_SIM_MAX_RANKS], dcount[KVF_SIM_MAX_RANKS];
        bool sends[KVF_SIM_MAX_RANKS][KVF_SIM_MAX_RANKS]; /* prefill rank i -> decode rank j */
        unsigned ntasks; /* tasks per request: the pairs that send */
        uint32_t seg;    /* tokens of one piece: the smaller block size (--verify sample) */
        unsigned poll_turn; /* the rank whose doorbell the next wait sleeps on (sim_verify.c) */
        struct sim_req *reqs;
        unsigned nreq;     /* every request of the run */
        unsigned admitted; /* those whose blocks were reserved: after a stop, only these count */
        unsigned last_di;  /* the decode instance the last admitted request went to */
        unsigned oldest;   /* no request below it waits for its completion (sim_verify.c) */
        uint64_t rng_state;

        /* GPU mode: finished arrivals whose blocks wait for one batch check (sim_verify.c). */
        struct sim_req **vq;
        unsigned nvq, vcap;

        /* The accounting (sim_verify.c). */
        uint64_t corrupt, verified_bytes, moved_bytes, done_reqs, finished, failed,
            bad_status_pairs;
        uint64_t fail_by_status[KVF_STATUS_COUNT];
        /* Requests the engine cancelled (--cancel-pct): each ends 'cancelled', or 'finished'
         * when its bytes had all landed before the cancel was read. */
        uint64_t cancels_sent;
        /* Requests that failed other than 'cancelled' after the simulator cancelled them. */
        uint64_t unexpected_failures;
        uint64_t warm_bytes, warm_ns; /* --warm-caches */
        struct sim_tail *tails;
        unsigned ntails;
        uint64_t last_sweep; /* when kvf_sim_poll_events last looked for expired grace periods */

        uint64_t t_start;  /* the first step */
        double cpu_start_s; /* kvf_sim_cpu_s() at t_start */
        /* Where the run's time went besides the simulator's own work: waiting in kvf_poll or
         * kvf_group_poll for an event (a completion or an arrival: the transfer), and waiting
         * for the GPU (sim_gpu_wait_ns: the layer and check kernels, CUDA's copies) */
        uint64_t event_wait_ns, gpu_wait_start_ns;
        /* ... and where the simulator's thread spent the run, by what it was doing (wall time;
         * a phase includes the waits inside it: kvf_sim_poll_events its event waits, the step's
         * end its GPU wait) */
        uint64_t phase_ns[SIM_PHASES];
        double event_wait_s, gpu_wait_s; /* ... over the run (t_start to secs) */
        double secs;       /* t_start to the last request accounted for (or given up on) */
        int stop; /* SIGTERM/SIGINT (kvf_opt_signals: read with kvf_load_relaxed): admit no more,
                   * let what was admitted finish */
        bool stopped; /* the run admitted no more after a stop */
};

/* This process's CPU time so far, user + system, in seconds (sim_report.c). */
double kvf_sim_cpu_s(void);

/* The requests that count: all of them, or after a stop those admitted. */
static inline unsigned kvf_sim_counted(const struct sim *s)
{
        return s->stopped ? s->admitted : s->nreq;
}

/* sim_engine.c */
/* Attach every instance's group, read the layouts, make the pools, load the trace and lay out
 * every request. 0, or -1 after a message on stderr. */
int kvf_sim_setup(struct sim *s);
/* The step loop until every request is accounted for (or a stop, or no progress for
 * --timeout-s), then the stragglers; sets secs. 0, or -1 when a submission or (GPU mode) a
 * layer's kernel failed (after a message). */
int kvf_sim_run(struct sim *s);
/* Return n block ids to a pool (the last taken first). */
void kvf_sim_pool_give(struct sim_pool *p, const uint32_t *ids, uint32_t n);
/* Detach and free everything setup made. */
void kvf_sim_free(struct sim *s);

/* sim_verify.c */
/* (kvf_sim_block_key and kvf_sim_head_key: tools/sim_keys.h) */
/* Word k of a block (or, mixed mode, of a head's row of a token) stamped with key. */
static inline uint64_t kvf_sim_word(uint64_t key, uint64_t k)
{
        return key + k * 0x9e3779b97f4a7c15ull;
}
/* Stamp a block with key: every word, or with sample_only both ends. */
void kvf_sim_fill(uint8_t *p, uint64_t bytes, uint64_t key, bool sample_only);
/* Layout L's K/V tensors of a layer (scale tensors not counted), as layout.h counts them. */
static inline uint32_t kvf_sim_kv_tensors(const struct kvf_layout_info *L)
{
        return L->key_only ? 1u : 2u;
}

/* Bytes of one block of tensor t of layout L (K/V, then the scale tensors when it has them). */
static inline uint64_t kvf_sim_tensor_bytes(const struct kvf_layout_info *L, uint32_t t)
{
        return t < kvf_sim_kv_tensors(L) ? L->block_bytes : L->scale_bytes;
}

/* Bytes of one block across every tensor of a layer (its scales included). */
static inline uint64_t kvf_sim_layer_block_bytes(const struct kvf_layout_info *L)
{
        return (uint64_t)kvf_sim_kv_tensors(L) * (L->block_bytes + L->scale_bytes);
}
/* Whether p holds what kvf_sim_fill(p, bytes, key, sample_only) wrote. */
bool kvf_sim_check(const uint8_t *p, uint64_t bytes, uint64_t key, bool sample_only);
/* Take every completion and arrival there is, waiting up to timeout_ms for the first
 * completion; verify arrivals, free what is done, count it. */
void kvf_sim_poll_events(struct sim *s, int timeout_ms);

/* sim_tp.c (mixed mode) */
/* Decide whether the run is in mixed mode and, if so, check the split (kvf_tp_check) and work
 * out who sends to whom. 0, or -1 after a message. */
int kvf_sim_tp_setup(struct sim *s);
/* The task id of r towards decode rank j ("r<seq>.d<j>"). */
void kvf_sim_tp_task_id(const struct sim_req *r, unsigned j, char *buf, size_t n);
/* Write layer l, tensor t of r's source block j on prefill rank `rank` (base: that rank's
 * kvf_cache_tensor(l, t), looked up once per layer and tensor: the call checks the process,
 * a system call, too dear per block): each head's row of each token, stamped per (request,
 * head, token, layer, tensor); rows of tokens at or past `to` are stamped `partial` unless
 * `last`. */
void kvf_sim_tp_write(struct sim *s, const struct sim_req *r, unsigned rank, uint8_t *base, uint32_t l,
                      uint32_t t, uint32_t j, uint32_t to, bool last);
/* Check every head of every token of r's destination blocks on every decode rank; adds to
 * verified_bytes. True when all match (otherwise one message, the first that differs). */
bool kvf_sim_tp_verify(struct sim *s, const struct sim_req *r);
/* GPU mode: queue the rows of r's destination blocks on decode rank j's check queue (checked
 * by the next sim_gpu_check of j); their bytes. */
uint64_t kvf_sim_tp_expect_gpu(struct sim *s, const struct sim_req *r, unsigned j);
/* GPU mode, once a run: a verified request's first block read back and checked on the host
 * against the host's keys (false: it differs, said on stderr). */
bool kvf_sim_tp_gpu_content(struct sim *s, const struct sim_req *r);
/* The prefill rank of r's instance called `name`, or -1. */
int kvf_sim_tp_prefill_rank(const struct sim *s, const struct sim_req *r, const char *name);

/* sim_report.c */
/* Note the sender's histograms before the run, so the report shows this run's share. */
void kvf_sim_report_start(struct sim *s);
/* The progress line on stderr ("\r" before it unless final; a newline after it if final). */
void kvf_sim_progress_line(const struct sim *s, bool final);
/* Print the summary (and write --json); true when every request was accounted for and none
 * was corrupt (and, when strict, every request finished). */
bool kvf_sim_report(struct sim *s);

#endif

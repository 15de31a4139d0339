/*
 * Every struct that lives in the control segment, in one place.
 *
 * The control segment is a file under /dev/shm (mode 0600) created by the
 * allocator of one instance and mapped by its connector, its sender, the
 * engine's client library and the ring-dump tool. Everything in it is
 * addressed by offsets from the start of the segment, never by pointers.
 * All fields are fixed width with explicit padding; the static asserts at the
 * bottom pin sizes and offsets, so a change here is a change of the layout
 * version.
 *
 * Ownership (one writer per field, no locks in shared memory):
 *   header, ring constants ........ allocator, before `version` is stored
 *   role slot r ................... the process in role r
 *   ring producer line ............ the ring's producer; consumer line: its consumer
 *   doorbell ...................... `state` by producers and consumers (CAS), `sleeps` by consumers
 *   progress word ................. the engine (layer-done events)
 *   counters ...................... atomic adds by any role
 *   error log region r ............ role r only (seqlock per entry for readers)
 *   request table ................. sender only (engine and tools read)
 *   arrival journal ............... connector only
 *   sender area ................... sender only
 *   plan entries .................. the sender writes them; `ctl` by CAS (sender and engine),
 *                                   `err`/`why` by the engine (engine executor)
 *   exec, line 0 .................. the engine (engine executor); line 1: the sender
 *   connector info ................ connector only (seqlock)
 *   notice slot s, holder line .... the prefill sender holding it (claimed by CAS of `pid`)
 *   notice slot s, rings .......... notice ring: producer the holder, consumer this instance's
 *                                   connector; reply ring: the other way round
 */
#ifndef KVF_SHM_LAYOUT_H
#define KVF_SHM_LAYOUT_H

#include <stddef.h>
#include <stdint.h>

#define KVF_MAGIC 0x315952524546564bull /* "KVFERRY1" read little-endian */
/* Bumped by every change to what a segment holds, the list of counters (common/counters.h)
 * included: a segment of another build is then refused for its version, not as corrupt.
 * 5: the rdma counters and data_frames_sent_tcp. 6: notices_held_back, prewakes and
 * prewakes_met; a doorbell's expect_until. 8: notice slots (same-host notices in one hop).
 * 9: per-request histograms (bytes, descriptors, transfer time) and a request's xfer_start_ns and
 * descs; counters notices_failed and the peer gauges; prewakes and prewakes_met gone (the sender
 * no longer prewakes its connector); the engine's caches (backend "engine", the header's
 * reg_* fields, a request's own_reg_gen and peer_reg_gen); a request's n_dst. 10: the counter
 * bytes_resent_tcp. 11: the layout's scale tensors (scale_dtype, scale_bytes). 12: the counter
 * notice_prewakes. 13: the counter tasks_held_back. 14: the role slot's session_base. 15: the
 * journal's pending entries (ring_pos KVF_JOURNAL_PENDING) and its 16384 entries (was
 * 4096), the counters arrivals_withdrawn_waiting and connections_over_limit. 16: the counter
 * copy_batches_reused. 17: the counter notice_rehearsals. 18: a plan entry's own landed word. */
#define KVF_LAYOUT_VERSION 18u
#define KVF_CACHE_LINE 64u
#define KVF_HEADER_SIZE 4096u

#define KVF_INSTANCE_MAX 48u  /* instance name incl. NUL */
#define KVF_REQ_ID_MAX 128u   /* request id incl. NUL */
#define KVF_PEER_MAX 112u     /* peer (instance name or host:port) incl. NUL */
#define KVF_REASON_MAX 240u   /* error reason incl. NUL */
#define KVF_MAX_LAYERS 1024u  /* layers + extra layers */
#define KVF_CHUNKS_MAX 8u     /* chunk marks queued per request */

enum kvf_role_id {
        KVF_ROLE_ALLOCATOR = 0,
        KVF_ROLE_CONNECTOR = 1,
        KVF_ROLE_SENDER = 2,
        KVF_ROLE_ENGINE = 3,
        KVF_ROLE_COUNT = 4,
};

enum kvf_role_state {
        KVF_STATE_NONE = 0, /* never started */
        KVF_STATE_STARTING = 1,
        KVF_STATE_RUNNING = 2,
        KVF_STATE_STOPPING = 3,
        KVF_STATE_STOPPED = 4, /* exited cleanly */
};

/* Consumers each own one doorbell; every ring they consume rings it. */
enum kvf_bell_id {
        KVF_BELL_SENDER = 0,
        KVF_BELL_CONNECTOR = 1,
        KVF_BELL_ENGINE = 2,
        KVF_BELL_COUNT = 3,
};

enum kvf_ring_id {
        KVF_RING_ENGINE_TO_SENDER = 0,    /* tasks, chunk progress, cancels */
        KVF_RING_SENDER_TO_ENGINE = 1,    /* completions */
        KVF_RING_ENGINE_TO_CONNECTOR = 2, /* connect / disconnect tasks */
        KVF_RING_CONNECTOR_TO_ENGINE = 3, /* connect results, arrivals */
        KVF_RING_SENDER_TO_CONNECTOR = 4, /* write batches, finish notices */
        KVF_RING_CONNECTOR_TO_SENDER = 5, /* write results, peer state */
        KVF_RING_COUNT = 6,
        /* The rings of a notice slot (not in the array above: a slot holds one pair). */
        KVF_RING_NOTICE = 16,  /* a prefill sender -> this (decode) connector: finish notices,
                                * withdrawals, aborts */
        KVF_RING_REPLY = 17,   /* this connector -> that prefill sender: the notices' answers */
};

enum kvf_instance_role {
        KVF_IROLE_PREFILL = 1,
        KVF_IROLE_DECODE = 2,
        KVF_IROLE_MIXED = 3,
};

enum kvf_dtype {
        KVF_DTYPE_BF16 = 1,
        KVF_DTYPE_FP16 = 2,
        KVF_DTYPE_FP8 = 3,
        KVF_DTYPE_UINT8 = 4,
        KVF_DTYPE_FP32 = 5, /* scale tensors (FastDeploy's float32 default dtype) */
};

enum kvf_backend {
        KVF_BACKEND_HOST = 1,       /* caches in a shared-memory file */
        KVF_BACKEND_CUDA = 2,       /* caches in GPU memory, CUDA IPC handles below */
        KVF_BACKEND_HOST_ASYNC = 3, /* test backend: host memory, copies completed later */
        KVF_BACKEND_ENGINE = 4,     /* host memory the engine registered (cache_engine.c): the
                                     * allocator makes none; reg_* below say what is there */
};

#define KVF_DEVICE_NONE 0xffffffffu

/*
 * Where the same-host copies of a GPU cache run (the cuda backend): in the
 * sender's own CUDA context (fast beside a busy engine only under MPS), or
 * in the engine's context, enqueued by the client library on a side stream
 * when the engine signals a layer (kvf_layer_done_on_stream), following the
 * plan the sender keeps in the plan entries below.
 */
enum kvf_executor {
        KVF_EXEC_NONE = 0,   /* host backends: the sender copies with the CPU */
        KVF_EXEC_SENDER = 1, /* the sender's context (executor 1; MPS) */
        KVF_EXEC_ENGINE = 2, /* the engine's context (executor 2) */
};

/* The cache layout; also sent in the handshake (as msgpack, not as bytes). */
struct kvf_cache_layout {
        uint32_t num_layers;   /* model layers */
        uint32_t extra_layers; /* speculative-decoding (MTP) layers after them */
        uint32_t num_blocks;   /* blocks per layer tensor */
        uint32_t kv_heads;     /* this rank's share */
        uint32_t block_size;   /* tokens per block */
        uint32_t head_dim;
        uint32_t dtype; /* enum kvf_dtype */
        uint32_t key_only;     /* 1: one tensor per layer (MLA) */
        uint64_t block_bytes;  /* kv_heads * block_size * head_dim * elem */
        uint64_t cache_bytes;  /* whole cache: layers * tensors * blocks * (block_bytes + scale_bytes) */
        /* Per-block scale tensors (FastDeploy's block_wise_fp8): one per K/V tensor, [num_blocks,
         * kv_heads, block_size] of scale_dtype, stored after every layer's K/V (layout.h). */
        uint32_t scale_dtype; /* enum kvf_dtype; 0: none */
        uint32_t reserved;
        uint64_t scale_bytes; /* kv_heads * block_size * scale elem; 0: none */
};

/* One per role, on its own cache line. */
struct kvf_role_slot {
        int32_t pid;
        uint32_t state;           /* enum kvf_role_state */
        uint64_t generation;      /* bumped (by the role itself) on every start */
        uint64_t start_ns;        /* CLOCK_MONOTONIC */
        uint64_t heartbeat_ns;    /* CLOCK_MONOTONIC, refreshed at least every heartbeat period */
        uint64_t pid_starttime;   /* /proc/<pid>/stat field 22, to tell a reused pid apart */
        uint64_t restarts;        /* starts after the first */
        uint32_t slice_us;        /* the scheduler slice its threads asked for and got (sched_slice.h);
                                   * 0: the kernel's default */
        uint32_t pad;
        uint64_t session_base;    /* the engine's slot: the progress word when this session claimed
                                   * it (kvf_attach); steps up to its step were published by earlier
                                   * sessions, so none of this session's tasks may wait for them.
                                   * 0: none before. Other roles: 0 */
};

/* The futex word and the waiter count in one word, then a line of the consumers' own. */
struct kvf_doorbell {
        /* line 0: producers and consumers */
        uint64_t state;      /* one word, changed by CAS only (doorbell.c): the low 32 bits are
                              * seq, the futex word, armed (low bit) by a consumer about to
                              * sleep and moved by the producer that wakes it; the high 32 bits
                              * count the consumers announced as about to sleep */
        uint64_t wakes;      /* futex wakes issued (statistics) */
        uint32_t asymmetric; /* set at creation: membarrier(2) usable (doorbell.c) */
        uint32_t unfenced;   /* producers now ringing without a fence (dense traffic) */
        uint64_t expect_until; /* CLOCK_MONOTONIC ns: a producer expects to ring before then, and
                                * a consumer about to sleep polls instead (kvf_doorbell_expect);
                                * 0: nothing expected */
        uint8_t pad0[32];
        /* line 1: consumers only, so that a woken consumer touches no line a producer writes */
        uint64_t sleeps;     /* futex waits entered (statistics) */
        uint8_t pad1[56];
};

/*
 * Layer-done progress: one word, written by the engine with a release store,
 * never torn. (step << 16) | (layers_done), where layers_done counts the
 * layers of `step` whose cache writes are complete. Monotonic: a later step
 * or more layers of the same step only ever make it larger.
 */
struct kvf_progress {
        uint64_t word;
        uint64_t events;     /* layer-done events published (statistics) */
        uint64_t publish_ns; /* CLOCK_MONOTONIC of the latest publish, stored before `word` */
        /* The largest word an engine has queued on a CUDA stream to be written by the GPU
         * (kvf_layer_done_on_stream, stream-write method): no doorbell rings when the GPU
         * writes `word`, so while enqueued > word the sender polls instead of sleeping.
         * Monotonic (CAS max by the engine); 0 when the method is not in use. */
        uint64_t enqueued;
        uint8_t pad[32];
};
#define KVF_PROGRESS_LAYER_BITS 16u
#define KVF_PROGRESS_PACK(step, layers) (((uint64_t)(step) << KVF_PROGRESS_LAYER_BITS) | (layers))
#define KVF_PROGRESS_STEP(w) ((w) >> KVF_PROGRESS_LAYER_BITS)
#define KVF_PROGRESS_LAYERS(w) ((uint32_t)((w) & ((1u << KVF_PROGRESS_LAYER_BITS) - 1)))

/*
 * A single-producer single-consumer ring of variable-length records.
 * Constants (line 0) are set by the allocator; line 1 belongs to the
 * producer, line 2 to the consumer. Positions are byte positions that only
 * grow; the offset in the data area is pos & (capacity - 1).
 */
struct kvf_ring_hdr {
        /* line 0: constants */
        uint64_t capacity;  /* bytes, a power of two */
        uint64_t data_off;  /* from the segment start */
        uint32_t id;        /* enum kvf_ring_id */
        uint32_t producer;  /* enum kvf_role_id */
        uint32_t consumer;  /* enum kvf_role_id */
        uint32_t bell;      /* enum kvf_bell_id: the consumer's doorbell */
        uint8_t pad0[32];
        /* line 1: producer */
        uint64_t tail;          /* end of the last claimed record */
        uint64_t producer_gen;  /* generation of the producer now attached */
        uint64_t full_events;   /* writes refused with -EAGAIN */
        uint64_t records_written;
        uint8_t pad1[32];
        /* line 2: consumer */
        uint64_t head;          /* start of the first unconsumed record */
        uint64_t zeroing_to;    /* consumer intends head = zeroing_to (crash repair) */
        uint64_t abandoned_pos; /* position of the last abandoned record skipped, or ~0 */
        uint64_t abandoned;     /* abandoned records skipped */
        uint64_t records_read;
        uint8_t pad2[24];
};

/* Record header, 8 bytes, 8-byte aligned, stored as one 64-bit word. */
#define KVF_REC_HDR_SIZE 8u
#define KVF_REC_ALIGN 8u
/* length: bytes of header + payload; < 0 while being written; 0 never written */
#define KVF_REC_PACK(len, type, gen16)                                                             \
        ((uint64_t)(uint32_t)(int32_t)(len) | ((uint64_t)(uint16_t)(type) << 32) |                 \
         ((uint64_t)(uint16_t)(gen16) << 48))
#define KVF_REC_LEN(w) ((int32_t)(uint32_t)((w) & 0xffffffffu))
#define KVF_REC_TYPE(w) ((uint16_t)((w) >> 32))
#define KVF_REC_GEN(w) ((uint16_t)((w) >> 48))
#define KVF_REC_TYPE_PAD 0xffffu

/* Counters: one 64-bit value per cache line. */
struct kvf_counter {
        uint64_t value;
        uint8_t pad[56];
};

/*
 * De-duplicated error log: a region of entries per role, written only by
 * that role. Readers use the per-entry seqlock: seq is odd while an entry is
 * being written.
 */
#define KVF_ERRLOG_ENTRIES 32u
#define KVF_ERRLOG_TEXT 216u
struct kvf_errlog_entry {
        uint32_t seq;
        uint32_t pad;
        uint64_t hash; /* of the message template; 0 = unused */
        uint64_t count;
        uint64_t first_ns; /* CLOCK_REALTIME */
        uint64_t last_ns;  /* CLOCK_REALTIME */
        char text[KVF_ERRLOG_TEXT];
};

enum kvf_req_state {
        KVF_REQ_FREE = 0,
        KVF_REQ_ACTIVE = 1,      /* accepted: bytes still to hand over, or (ipc) copies of them
                                  * not yet seen landed (flags KVF_REQF_COPY_PENDING) */
        KVF_REQ_FINISHING = 2,   /* ipc: every byte landed in the peer's cache; the finish notice
                                  * is owed or out, the peer's answer decides */
        KVF_REQ_COMPLETING = 3,  /* decided (status, reason): completion being posted at
                                  * completion_pos */
        KVF_REQ_HANDED_OVER = 4, /* tcp, rdma: every write batch is in the connector's hands (it
                                  * writes them); the finish notice is owed or out, the peer's
                                  * answer decides whether every byte was written */
};
/* The sender's states of a request, with what is kept only in its process, are in sender/sender.h. */

struct kvf_chunk_mark {
        uint64_t step;      /* forward step that computes this chunk */
        uint32_t block_end; /* blocks [.., block_end) are complete after that step */
        uint32_t pad;
};

/*
 * The sender's request table: slots of fixed size, written only by the
 * sender, so a restarted sender adopts it. The block lists of slot i are in
 * the block arena at blocks_off + i * max_blocks * 8 (src then dst, u32).
 */
struct kvf_req_slot {
        uint32_t state;    /* enum kvf_req_state */
        uint32_t status;   /* enum kvf_status once decided */
        uint64_t incarnation; /* bumped each time the slot is taken; (slot, incarnation) = transfer key */
        uint64_t task_pos;    /* ring position of the task record (replay detection) */
        uint64_t completion_pos; /* ring position the completion was claimed at, or ~0 */
        uint64_t accept_ns;
        uint64_t session;        /* the engine session (engine role generation) that submitted it */
        uint64_t last_layer_ns;  /* when the request's last layer became ready */
        uint64_t deadline_ns;
        uint64_t bytes;          /* bytes written so far */
        uint64_t notice_gen;     /* connector generation the finish notice went to; 0 none */
        uint32_t transport;      /* enum kvf_transport */
        uint32_t n_src;          /* source blocks in the task */
        uint32_t n_send;         /* blocks to send = n_dst (the last n_dst source blocks) */
        uint32_t sent_full;      /* blocks [0, sent_full) sent for every layer */
        uint32_t cur_layers;     /* layers [0, cur_layers) sent for the front chunk */
        uint32_t chunk_head;     /* chunk marks [head, tail) modulo KVF_CHUNKS_MAX */
        uint32_t chunk_tail;
        uint32_t last_chunk_seen; /* a chunk mark covering every block was queued */
        uint32_t peer_idx;       /* sender-local peer slot, or ~0 */
        uint32_t flags;          /* KVF_REQF_* */
        struct kvf_chunk_mark chunks[KVF_CHUNKS_MAX];
        char request_id[KVF_REQ_ID_MAX];
        char peer[KVF_PEER_MAX];
        char reason[KVF_REASON_MAX];
        uint64_t peer_session;   /* ipc: the peer's engine session when the task was accepted, 0 none */
        uint64_t withdraw_ns;    /* FINISHING past its deadline: when the sender asked the connector
                                  * to withdraw the notice (it waits for the peer's answer), or 0 */
        uint64_t xfer_start_ns;  /* when its first bytes were handed to a copy or the connector, or 0 */
        uint64_t descs;          /* descriptors handed over so far: copy runs (ipc), frames (tcp),
                                  * write work requests (rdma); see sender/progress.c */
        /* Destination blocks when they are not n_send (a peer of another block size: the
         * request sends all n_src source blocks into n_dst blocks of the peer's size); 0: n_send. */
        uint32_t n_dst;
        uint32_t pad2;
        uint64_t own_reg_gen;    /* ipc, engine's caches: the registration generations its first */
        uint64_t peer_reg_gen;   /* copy went from and into (0: none yet, or not the engine's) */
        uint8_t pad1[240];
};
#define KVF_REQF_ID_BIN 1u       /* the request id came as msgpack bin: echo it as bin */
#define KVF_REQF_COPY_PENDING 2u /* ipc: copies of it gathered into a batch, not yet seen complete */
#define KVF_REQF_ENGINE_COPY 4u  /* engine executor: the engine's context may have copies of it queued */

/*
 * The decode-side connector's journal of published arrivals, so a notice
 * re-sent after a crash is acknowledged without a second arrival record.
 */
#define KVF_JOURNAL_ENTRIES 16384u
#define KVF_JOURNAL_PENDING (~0ull)
struct kvf_journal_entry {
        uint64_t key_hash; /* hash of (prefill instance, slot, incarnation); 0 = unused */
        uint64_t ring_pos; /* where the arrival record was claimed; KVF_JOURNAL_PENDING: decided,
                            * not yet published (a withdrawal answered while the ring was full) */
        uint32_t status;   /* the arrival's status: what a repeated or withdrawn notice is told */
        uint32_t pad;
        uint64_t session;  /* the decode engine session the arrival was published for */
};

/*
 * Histogram: bucket i counts values v with floor(log2(v)) * 8 +
 * (next 3 bits of v) == i, i.e. 8 sub-buckets per power of two (<= 12.5 %
 * error; every power of two is a bucket boundary). Values in nanoseconds for
 * the latencies, in bytes or descriptors for the per-request sizes. A size
 * histogram (kvf_hist_add_size) buckets v - 1 instead of v (0 with 1), so that
 * its buckets hold (low, high] and a power-of-two bound counts the values
 * equal to it. Written by one role with relaxed adds.
 */
#define KVF_HIST_BUCKETS 512u
struct kvf_histogram {
        uint64_t count;
        uint64_t sum;
        uint64_t max;
        uint64_t pad;
        uint64_t buckets[KVF_HIST_BUCKETS];
};

enum kvf_hist_id {
        KVF_HIST_LAYER_TO_COPY = 0, /* sender: layer-done published -> its copy starts */
        KVF_HIST_COPY = 1,          /* sender: one layer's copy batch, start to end */
        KVF_HIST_LAST_TO_DONE = 2,  /* sender: request's last layer ready -> completion */
        /* One observation per finished request (vLLM NIXL's meanings, per transfer): */
        KVF_HIST_REQ_BYTES = 3,     /* its bytes (a size histogram) */
        KVF_HIST_REQ_DESCS = 4,     /* its descriptors, kvf_req_slot.descs (a size histogram) */
        KVF_HIST_REQ_XFER = 5,      /* its first bytes handed over -> its completion, ns */
        KVF_HIST_COUNT = 6,
};

/*
 * Engine executor (KVF_EXEC_ENGINE): one plan entry per request slot. The
 * sender decides: it publishes, for an ipc request whose next step has not
 * started, which send-blocks move in every layer of that step and to which
 * peer. The engine's client library executes: when the engine signals layer
 * L of that step on its stream, it claims layer L of every open entry (a CAS
 * of `ctl` from exactly L to L + 1 claimed layers, so the engine's layers are
 * always [0, claimed)), and launches one copy kernel for all of them on a
 * side stream ordered after the engine's stream; exec.landed tells the sender
 * when they have landed. At a step's last layer each entry gets a kernel of
 * its own (up to 8 kernels: groups of neighbours in size beyond), the smallest
 * first, and its own `landed` word after it (written by
 * the GPU; not with host-function signals), so a request waits for its own
 * bytes, not for the whole step's. The sender closes an entry (an exchange that keeps
 * the claimed count) when the step is over or as soon as a layer is ready that
 * the engine did not claim (the plan came late, or the engine signals on the
 * host): from then on the sender copies the rest itself. An entry is
 * rewritten only while closed; `gen` changes with every publish, so an engine
 * that read the fields of an older publish fails its CAS (a seqlock whose
 * readers validate by CAS).
 */
#define KVF_PLAN_OPEN (1ull << 31)
#define KVF_PLAN_CLAIMED(ctl) ((uint32_t)((ctl) & 0xffffu))
#define KVF_PLAN_GEN(ctl) ((uint32_t)((ctl) >> 32))
#define KVF_PLAN_CTL(gen, open, claimed)                                                           \
        (((uint64_t)(uint32_t)(gen) << 32) | ((open) ? KVF_PLAN_OPEN : 0) | (uint64_t)(claimed))
struct kvf_plan_entry {
        uint64_t ctl;        /* gen << 32 | KVF_PLAN_OPEN | claimed: CAS only. The engine's
                              * layers of `step` are [first, claimed) */
        uint64_t step;       /* the forward step whose layers this entry moves */
        uint32_t b0, b1;     /* send-blocks [b0, b1) in every layer */
        uint32_t src_first;  /* send-block i is source block src list[src_first + i] */
        uint32_t first;      /* layers below this are the sender's (claimed starts here) */
        uint64_t peer_created_ns; /* identity of the peer instance's segment */
        uint64_t peer_session;    /* the peer engine session owning the blocks (0: unchecked) */
        uint32_t err;        /* the engine could not copy a layer it claimed: `why` says why */
        uint32_t pad;
        char peer[KVF_INSTANCE_MAX];
        /* The peer's caches are the engine's: the generation of its registration the
         * request's blocks were reserved in (0: its own caches). A copy into another fails. */
        uint64_t peer_reg_gen;
        /* KVF_PLAN_CTL(gen, 0, claimed), written (by the GPU, in stream order) once every copy of
         * the entry's claimed layers has landed, when the engine copied the step's last layer of
         * the entry in a batch of its own; exec.landed says the same later, for every entry. */
        uint64_t landed;
        char why[136];
};

/* The engine executor's shared words. */
struct kvf_exec {
        /* line 0: the engine */
        uint64_t landed;  /* PACK(step, layers): every copy the engine launched for a layer of
                           * an earlier step, or of this step below `layers`, has landed (monotonic) */
        uint64_t batches; /* copy kernels the engine launched (statistics) */
        uint64_t claims;  /* layers it claimed, summed over entries (statistics) */
        uint64_t errors;  /* claimed layers it could not copy (statistics) */
        uint8_t pad0[32];
        /* line 1: the sender */
        uint32_t hi;        /* entries [0, hi) may be open: the engine scans only those */
        uint32_t pad1;
        uint64_t published; /* entries published (statistics) */
        uint64_t taken_back; /* entries closed before their step ended: the sender copied the rest */
        uint8_t pad2[40];
};

/* The sender's own state that must survive its restart (besides the request table). */
struct kvf_sender_area {
        uint64_t reject_task_pos;       /* task record whose rejection was posted last */
        uint64_t reject_completion_pos; /* where that rejection's completion was claimed */
        uint64_t engine_session_ack;    /* the engine session whose predecessors' requests the
                                         * sender has ended (kvf_attach waits for it) */
        uint8_t pad[40];
        struct kvf_histogram hist[KVF_HIST_COUNT];
};

/*
 * How the host cache's pages are backed (header fields cache_backing, cache_page_kib,
 * cache_path, cache_note). A segment whose allocator did not record it has zeros there:
 * the cache is /dev/shm<cache_name> in 4 KiB pages.
 */
enum kvf_cache_backing {
        KVF_CACHE_SHM = 1,       /* /dev/shm<cache_name>, 4 KiB pages */
        KVF_CACHE_HUGETLBFS = 2, /* cache_path on a hugetlbfs mount of 2 MiB pages */
        KVF_CACHE_SHM_THP = 3,   /* /dev/shm<cache_name> in transparent huge pages */
};
#define KVF_CACHE_PATH_MAX 128u /* incl. NUL */
#define KVF_CACHE_NOTE_MAX 192u /* incl. NUL */

/*
 * Notice slots (same-host notices in one hop): a decode instance's segment
 * offers KVF_NOTICE_SLOTS pairs of rings, so that a prefill sender on this
 * host posts a finish notice straight to this instance's connector and reads
 * its answer without going through either connector's socket. A prefill
 * sender claims a slot like a role slot: a CAS of `pid` from 0 (free) or from
 * a dead holder's pid; then it writes the rest of the holder line and stores
 * `generation` (bumped) with a release store. `owner` + `owner_created_ns`
 * name the prefill instance and its incarnation, so a restarted sender of the
 * same instance re-finds its slot (and the notices it left in it).
 */
#define KVF_NOTICE_SLOTS 16u
#define KVF_NOTICE_RING_CAPACITY 65536u
struct kvf_notice_slot {
        /* line 0: the holder */
        int32_t pid;             /* holder's pid; 0: free. CAS only */
        uint32_t state;          /* enum kvf_role_state of the holder */
        uint64_t generation;     /* bumped by every claim; stamped on the notice ring's records */
        uint64_t pid_starttime;  /* /proc/<pid>/stat field 22 of the holder */
        uint64_t heartbeat_ns;   /* CLOCK_MONOTONIC, refreshed by the holder */
        uint64_t owner_created_ns; /* created_ns of the holder's own segment (its incarnation) */
        uint64_t claims;         /* claims of this slot (statistics) */
        uint8_t pad0[16];
        /* lines 1-2: the holder's instance name */
        char owner[KVF_INSTANCE_MAX];
        uint8_t pad1[80];
        /* rung with an answer only when the decode connector could not map the holder's own
         * segment (whose sender doorbell it rings otherwise): nobody sleeps on it, the holder
         * then finds answers on its loop's next turn */
        struct kvf_doorbell reply_bell;
        struct kvf_ring_hdr notice; /* producer: holder; consumer: this connector */
        struct kvf_ring_hdr reply;  /* producer: this connector; consumer: holder */
};

/* What the connector publishes about itself (seqlock: seq odd while writing). */
struct kvf_connector_info {
        uint32_t seq;
        uint32_t port;
        char listen_host[56];
};

struct kvf_ctl_header {
        uint64_t magic;
        uint32_t version; /* written last, with a release store; 0 = not ready */
        uint32_t header_size;
        uint64_t total_size;
        uint32_t owner_uid;
        uint32_t instance_role; /* enum kvf_instance_role */
        uint64_t created_ns;    /* CLOCK_REALTIME */
        uint64_t boot_id;       /* hash of /proc/sys/kernel/random/boot_id: same host+boot */
        char instance[KVF_INSTANCE_MAX];
        struct kvf_cache_layout layout;
        uint32_t backend; /* enum kvf_backend */
        uint32_t device;  /* CUDA device ordinal (host backend: a label), KVF_DEVICE_NONE if none */
        uint32_t rank;
        uint32_t nranks;
        char cache_name[64]; /* host backend: shm name of the cache file */
        /* regions */
        uint64_t roles_off;
        uint64_t bells_off;
        uint64_t progress_off;
        uint64_t rings_off;
        uint64_t counters_off;
        uint32_t counters_count;
        uint32_t errlog_entries; /* per role */
        uint64_t errlog_off;
        uint64_t reqtab_off;
        uint32_t reqtab_slots;
        uint32_t max_blocks; /* per request */
        uint64_t blocks_off;
        uint64_t journal_off;
        uint64_t connector_info_off;
        uint64_t cuda_handles_off; /* 64-byte cudaIpcMemHandle_t each (cuda backend: one, for
                                    * one allocation holding the whole cache, kvf_layout_offset order) */
        uint32_t cuda_handles_count;
        uint32_t heartbeat_ms; /* roles refresh their heartbeat at least this often */
        uint64_t ring_capacity[KVF_RING_COUNT];
        uint64_t sender_area_off;
        /* host backend: how the cache's pages are backed (enum kvf_cache_backing above) */
        uint32_t cache_backing;  /* 0: not recorded (KVF_CACHE_SHM) */
        uint32_t cache_page_kib; /* 4 or 2048: all of it is in pages of that size */
        char cache_path[KVF_CACHE_PATH_MAX]; /* the cache file, absolute */
        char cache_note[KVF_CACHE_NOTE_MAX]; /* why these pages: how huge pages were had, or the
                                              * reason for 4 KiB pages */
        uint8_t cuda_uuid[16]; /* cuda backend: the UUID of the GPU holding the cache (processes may
                                * number devices differently: CUDA_VISIBLE_DEVICES) */
        uint32_t executor;     /* enum kvf_executor */
        uint32_t plan_slots;   /* plan entries (= reqtab_slots) */
        uint64_t exec_off;     /* struct kvf_exec */
        uint64_t plan_off;     /* struct kvf_plan_entry[plan_slots] */
        uint64_t notice_off;   /* struct kvf_notice_slot[notice_slots] */
        uint32_t notice_slots; /* KVF_NOTICE_SLOTS */
        uint32_t notice_ring_capacity; /* bytes of each notice and reply ring */
        /* Backend engine: the registration the allocator holds (registration.h). The
         * allocator writes the other reg_* fields, then reg_generation with a release store
         * (readers: load-acquire reg_generation, read, re-check it); odd = registered, even =
         * waiting for the engine's caches. Bumped by every registration and every drop, so a
         * role's mapping of generation g is stale once the word differs from g. */
        uint64_t reg_generation;
        int32_t reg_pid;          /* the registering process */
        uint32_t reg_regions;     /* regions (shared files) it gave */
        uint64_t reg_bytes;       /* bytes of those regions */
        uint32_t reg_token_major; /* 1: a block is [block_size, heads, head_dim] */
        uint32_t reg_strided;     /* 1: some view's block stride is not block_bytes */
        /* 1: the engine's caches are GPU memory on the GPU cuda_uuid names (up --caches engine
         * --backend cuda), registered as CUDA IPC handles; 0: host memory. Set at creation. */
        uint32_t reg_gpu;
        uint32_t reg_pad;
        uint8_t reserved[3704 - 8 - KVF_CACHE_PATH_MAX - KVF_CACHE_NOTE_MAX - 40 - 16 - 32 - 8 - 16];
};

_Static_assert(sizeof(struct kvf_cache_layout) == 64, "layout size");
_Static_assert(sizeof(struct kvf_role_slot) == KVF_CACHE_LINE, "role slot size");
_Static_assert(sizeof(struct kvf_doorbell) == 2 * KVF_CACHE_LINE, "doorbell size");
_Static_assert(offsetof(struct kvf_doorbell, sleeps) == KVF_CACHE_LINE, "doorbell consumer line");
_Static_assert(sizeof(struct kvf_progress) == KVF_CACHE_LINE, "progress size");
_Static_assert(sizeof(struct kvf_ring_hdr) == 3 * KVF_CACHE_LINE, "ring header size");
_Static_assert(offsetof(struct kvf_ring_hdr, tail) == KVF_CACHE_LINE, "producer line");
_Static_assert(offsetof(struct kvf_ring_hdr, head) == 2 * KVF_CACHE_LINE, "consumer line");
_Static_assert(sizeof(struct kvf_counter) == KVF_CACHE_LINE, "counter size");
_Static_assert(sizeof(struct kvf_errlog_entry) == 256, "errlog entry size");
_Static_assert(sizeof(struct kvf_req_slot) == 1024, "request slot size");
_Static_assert(offsetof(struct kvf_req_slot, chunks) == 120, "request slot chunks");
_Static_assert(sizeof(struct kvf_journal_entry) == 32, "journal entry size");
_Static_assert(sizeof(struct kvf_connector_info) == 64, "connector info size");
_Static_assert(sizeof(struct kvf_histogram) == 32 + 8 * KVF_HIST_BUCKETS, "histogram size");
_Static_assert(offsetof(struct kvf_sender_area, hist) == 64, "sender area histograms");
_Static_assert(sizeof(struct kvf_plan_entry) == 256, "plan entry size");
_Static_assert(sizeof(struct kvf_exec) == 2 * KVF_CACHE_LINE, "exec size");
_Static_assert(offsetof(struct kvf_exec, hi) == KVF_CACHE_LINE, "exec sender line");
_Static_assert(sizeof(struct kvf_notice_slot) == 3 * KVF_CACHE_LINE + 2 * KVF_CACHE_LINE +
                               2 * 3 * KVF_CACHE_LINE, "notice slot size");
_Static_assert(offsetof(struct kvf_notice_slot, owner) == KVF_CACHE_LINE, "notice slot owner");
_Static_assert(offsetof(struct kvf_notice_slot, reply_bell) == 3 * KVF_CACHE_LINE, "notice slot bell");
_Static_assert(offsetof(struct kvf_ctl_header, notice_off) == 776, "notice offset");
_Static_assert(offsetof(struct kvf_ctl_header, version) == 8, "version offset");
_Static_assert(offsetof(struct kvf_ctl_header, instance) == 48, "instance offset");
_Static_assert(offsetof(struct kvf_ctl_header, layout) == 96, "layout offset");
_Static_assert(offsetof(struct kvf_ctl_header, cache_path) == 416, "cache path offset");
_Static_assert(offsetof(struct kvf_ctl_header, cuda_uuid) == 736, "cuda uuid offset");
_Static_assert(offsetof(struct kvf_ctl_header, exec_off) == 760, "exec offset");
_Static_assert(offsetof(struct kvf_ctl_header, reg_generation) == 792, "registration offset");
_Static_assert(sizeof(struct kvf_ctl_header) == KVF_HEADER_SIZE, "header size");

#endif

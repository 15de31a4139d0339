/*
 * gpu_latency_bench: from a layer's end on the GPU to its copy starting and
 * landing, per executor, with the engine idle or busy.
 *
 * The "engine" is this process's main thread with its own CUDA stream. For
 * each layer of each step it queues a layer kernel, then the layer-done
 * signal (a 64-bit word in shared memory takes the number of layers done):
 *   idle  the layer kernel is one block that only stamps the time; layers
 *         are --layer-us apart by the host's clock, the GPU idles between;
 *   busy  the layer kernel fills every SM (two 1024-thread blocks per SM,
 *         all 2048 thread slots) in waves of blocks that each spin
 *         --block-us, --layer-us in all, back to back: a GPU that is always
 *         computing, whose blocks retire every few microseconds the way a
 *         real engine's tiles do. At most two layers are queued ahead.
 * Every layer kernel records its end with atomicMax(%globaltimer) over its
 * blocks: "layer-done" below is that instant, in GPU time.
 *
 * Trials (each a row; the same per-layer batch of runs in all of them):
 *   signal  no copy: a host thread waits for the word, and the time it sees
 *           each value is taken. Methods: hostfn (cudaLaunchHostFunc stores
 *           the word; the waiter spins, or sleeps on a futex that the host
 *           function wakes: how kvferry's doorbell works), writevalue
 *           (cuStreamWriteValue64 into the mapped word; spin, or poll every
 *           --poll-us), kernel (a one-thread kernel stores it; spin).
 *   ref     the reference: a thread of the engine's process spins on the
 *           word and submits the layer's copy with kvf_gpu (own stream,
 *           highest priority) the moment it sees it;
 *   proc    executor (1): the same loop in a separate process (this program
 *           started again) that opened the engine's caches by IPC handle and
 *           launches in its own context; the label says "proc+mps" when MPS
 *           is on (the executor as designed) and "proc" without it (the
 *           2.3 ms problem MPS fixes);
 *   ctx     executor (2): the engine's thread itself queues the copy on a
 *           side stream of its own context when it signals the layer,
 *           ordered after the layer by an event (kvf_gpu_batch.after_stream),
 *           as the client library will for kvf_layer_done_on_stream.
 *
 * Figures per layer, p50 / p99 over --steps steps x layers (a warm-up step
 * before and a tail step after are not counted):
 *   start   first block of the copy kernel starts  - layer-done   (GPU clock)
 *   landed  last block of the copy kernel finished - layer-done   (GPU clock)
 *   wake    the waiter / sender saw the word      - layer-done   (host clock)
 *   issued  the copy's submit call returned        - layer-done   (host clock;
 *           negative for ctx: it is queued before the layer ends)
 *   known   the sender's poll saw the copy landed  - layer-done   (host clock)
 *   layer   GPU time between consecutive layer ends (the engine's pace, and
 *           what signalling and copies cost it)
 * start and landed use the copy kernel's own stamps (kvf_gpu_batch.stamps)
 * and the layer kernel's, both %globaltimer of one GPU: no clock conversion.
 * The host-clock figures convert layer-done to CLOCK_MONOTONIC with a
 * calibration before and after each trial (see bench_clock_measure: an
 * NTP-like ping through mapped memory, offset and drift; its error bound is
 * printed).
 *
 * Targets, judged per engine state against the reference of the
 * same run: copy start p50 under 20 us for each executor; landed p50, busy,
 * within 1.2 x the reference's.
 *
 * MPS: this program only detects it (cudaDevAttrMpsEnabled). Starting and
 * stopping it is the operator's job (bench/gpu_suite.sh does both):
 *     nvidia-cuda-mps-control -d            # start the control daemon
 *     echo quit | nvidia-cuda-mps-control   # stop it
 * Every process that should use MPS, this one and its children included,
 * must see the same CUDA_MPS_PIPE_DIRECTORY as the daemon.
 */
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <limits.h>
#include <linux/futex.h>
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "atomics.h"
#include "gpu_bench_common.h"
#include "gpu_shapes.h"

extern char **environ;

#define VERSION "1"
#define SENDER_TIMEOUT_NS (60ull * 1000000000ull)
#define CHILD_READY_TIMEOUT_NS (60ull * 1000000000ull)
#define CLOCK_ROUNDS 300
#define MAX_TRIALS 32

enum kind { K_SIGNAL, K_REF, K_PROC, K_CTX };
enum wait_mode { W_SPIN, W_FUTEX, W_SLEEP };

/* ---------------------------------------------------------------- shared memory */

/*
 * One memfd mapping, shared with the proc trial's child: the word, the
 * child's handshake, the configuration, the layer-0 runs and the results.
 * Fields the two processes both touch are published with release stores
 * and read with acquire loads (comments name the pairs).
 */
struct shared {
        uint64_t word; /* layers done; the engine's signal (one writer) */
        uint8_t pad0[56];
        uint32_t futex_seq; /* hostfn+futex: bumped by the host function */
        uint8_t pad1[60];
        uint32_t child_ready; /* child -> parent: caches open, copier warm */
        uint32_t child_done;  /* child -> parent: results written */
        int32_t child_rc;
        uint32_t pad2;
        char child_msg[256];
        uint8_t h_src[KVF_GPU_IPC_HANDLE_SIZE], h_dst[KVF_GPU_IPC_HANDLE_SIZE];
        uint32_t n_idx, layers, n_runs, desc_flags;
        int32_t device;
        uint32_t pad3;
        uint64_t layer_stride, src_bytes, dst_bytes;
        /* Byte offsets of the arrays from the start of this struct. */
        uint64_t off_runs, off_seen, off_issued, off_known, off_stamps;
};

#define SH_ARR(sh, type, off) ((type *)((char *)(sh) + (sh)->off))

struct options {
        int device;
        const char *model;
        unsigned tp;
        uint32_t layers, steps, layer_us, block_us, requests, tokens, poll_us;
        int signal;
        unsigned desc_flags; /* KVF_GPU_COPIER_*_DESC, 0: the copier as kvferry runs it */
        unsigned modes;   /* bit per kind */
        unsigned engines; /* bit 0 idle, bit 1 busy */
        const char *json;
};

struct trial {
        enum kind kind;
        int busy;
        int method;
        enum wait_mode wait;
        char label[48];
        /* results */
        int ok;
        char why[384];
        uint64_t wrong;
        struct bench_pct start, landed, wake, issued, known, layer;
        double clock_err_us;
};

/* ---------------------------------------------------------------- GPU kernels */

__device__ static inline unsigned long long gtimer(void)
{
        unsigned long long t;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
        return t;
}

/* Busy layer: every block spins block_ns, then the layer's end is stamped. */
__global__ void __launch_bounds__(1024, 2)
    busy_kernel(unsigned long long block_ns, unsigned long long *end)
{
        unsigned long long t0 = gtimer();
        while (gtimer() - t0 < block_ns) {
        }
        __syncthreads();
        if (threadIdx.x == 0)
                atomicMax(end, gtimer());
}

/* Idle layer: only the stamp. */
__global__ void stamp_kernel(unsigned long long *end)
{
        if (threadIdx.x == 0)
                atomicMax(end, gtimer());
}

/* ---------------------------------------------------------------- small helpers */

static void futex_wake_all(uint32_t *w)
{
        syscall(SYS_futex, w, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}

static void futex_wait(uint32_t *w, uint32_t val, uint64_t ns)
{
        struct timespec ts = {(time_t)(ns / 1000000000ull), (long)(ns % 1000000000ull)};
        syscall(SYS_futex, w, FUTEX_WAIT, val, &ts, NULL, 0);
}

static void hostfn_wake(void *arg)
{
        struct shared *sh = (struct shared *)arg;
        /* Release: pairs with the waiter's acquire load of futex_seq before it sleeps. */
        kvf_fetch_add_acq_rel(&sh->futex_seq, 1);
        futex_wake_all(&sh->futex_seq);
}

static void sleep_ns(uint64_t ns)
{
        struct timespec ts = {(time_t)(ns / 1000000000ull), (long)(ns % 1000000000ull)};
        nanosleep(&ts, NULL);
}

static void *xcalloc(size_t n, size_t s)
{
        void *p = calloc(n ? n : 1, s ? s : 1);
        if (!p)
                bench_die("out of memory");
        return p;
}

static const char *kind_name(enum kind k, int mps)
{
        switch (k) {
        case K_SIGNAL:
                return "signal";
        case K_REF:
                return "ref";
        case K_PROC:
                return mps ? "proc+mps" : "proc";
        case K_CTX:
                return "ctx";
        }
        return "?";
}

/* ---------------------------------------------------------------- the sender loop */

/*
 * Spin on the word; for every layer it shows done, submit that layer's copy
 * (stamped); meanwhile poll the oldest copy in flight. Runs in a thread of
 * the engine's process (ref) or in the child (proc). Returns 0 or -1 with
 * `why` filled.
 */
struct sender {
        struct shared *sh;
        struct kvf_gpu_copier *c;
        struct kvf_gpu_region src, dst;
        uint64_t *dstamps; /* device, 2 per layer index */
        char why[256];
        int rc;
};

static void layer_runs(const struct shared *sh, uint32_t layer, struct kvf_gpu_run *out)
{
        const struct kvf_gpu_run *r0 = SH_ARR(sh, const struct kvf_gpu_run, off_runs);
        for (uint32_t i = 0; i < sh->n_runs; i++) {
                out[i] = r0[i];
                out[i].src_off += (uint64_t)layer * sh->layer_stride;
                out[i].dst_off += (uint64_t)layer * sh->layer_stride;
        }
}

static void *sender_main(void *arg)
{
        struct sender *s = (struct sender *)arg;
        struct shared *sh = s->sh;
        uint32_t n = sh->n_idx;
        uint64_t *seen = SH_ARR(sh, uint64_t, off_seen), *issued = SH_ARR(sh, uint64_t, off_issued),
                 *known = SH_ARR(sh, uint64_t, off_known);
        uint64_t *tickets = (uint64_t *)xcalloc(n, sizeof(uint64_t));
        struct kvf_gpu_run *runs = (struct kvf_gpu_run *)xcalloc(sh->n_runs, sizeof(*runs));
        uint32_t next = 0, oldest = 0;
        uint64_t deadline = bench_now_ns() + SENDER_TIMEOUT_NS;

        s->rc = 0;
        while (oldest < n) {
                /* Acquire: pairs with the signal's release store (host function,
                 * stream write with its barrier, or the kernel's st.release.sys). */
                uint64_t w = kvf_load_acquire(&sh->word);
                if (w > n)
                        w = n;
                if (w > next) {
                        uint64_t t = bench_now_ns();
                        for (; next < w; next++) {
                                seen[next] = t;
                                layer_runs(sh, next % sh->layers, runs);
                                struct kvf_gpu_batch b = {
                                    runs,    sh->n_runs, &s->src, 1,
                                    &s->dst, 1,          NULL,    s->dstamps + 2 * (size_t)next};
                                int rc;
                                while ((rc = kvf_gpu_copy_submit(s->c, &b, &tickets[next])) ==
                                       -EAGAIN) {
                                        if (kvf_gpu_copy_poll(s->c, tickets[oldest]) < 0)
                                                break;
                                }
                                if (rc < 0) {
                                        snprintf(s->why, sizeof(s->why), "submit: %s",
                                                 kvf_gpu_err_msg());
                                        s->rc = -1;
                                        goto out;
                                }
                                issued[next] = bench_now_ns();
                        }
                        continue;
                }
                if (oldest < next) {
                        int rc = kvf_gpu_copy_poll(s->c, tickets[oldest]);
                        if (rc == 1) {
                                known[oldest++] = bench_now_ns();
                                continue;
                        }
                        if (rc < 0) {
                                snprintf(s->why, sizeof(s->why), "poll: %s", kvf_gpu_err_msg());
                                s->rc = -1;
                                goto out;
                        }
                }
                kvf_cpu_relax();
                if (bench_now_ns() > deadline) {
                        snprintf(s->why, sizeof(s->why),
                                 "sender: %u of %u layers seen, %u landed after 60 s", next, n,
                                 oldest);
                        s->rc = -1;
                        goto out;
                }
        }
out:
        free(tickets);
        free(runs);
        return NULL;
}

/* ---------------------------------------------------------------- the proc child */

static int child_main(int fd)
{
        struct stat st;
        if (fstat(fd, &st) < 0)
                return 2;
        struct shared *sh = (struct shared *)mmap(NULL, (size_t)st.st_size, PROT_READ | PROT_WRITE,
                                                  MAP_SHARED, fd, 0);
        if (sh == MAP_FAILED)
                return 2;
        struct sender s;
        memset(&s, 0, sizeof(s));
        s.sh = sh;
        void *src = NULL, *dst = NULL;
        int rc = 0;
        const char *step = "set device";
        if (cudaSetDevice(sh->device) != cudaSuccess)
                goto fail;
        step = "open the engine's cache";
        if ((rc = kvf_gpu_ipc_open(sh->device, sh->h_src, &src, NULL)) < 0)
                goto fail;
        step = "open the peer's cache";
        if ((rc = kvf_gpu_ipc_open(sh->device, sh->h_dst, &dst, NULL)) < 0)
                goto fail;
        s.src = (struct kvf_gpu_region){(uint64_t)(uintptr_t)src, sh->src_bytes};
        s.dst = (struct kvf_gpu_region){(uint64_t)(uintptr_t)dst, sh->dst_bytes};
        step = "create the copier";
        if ((rc = kvf_gpu_copier_create(
                 sh->device, sh->desc_flags, NULL, &s.c)) < 0)
                goto fail;
        {
                size_t sb = 2 * (size_t)sh->n_idx * sizeof(uint64_t);
                uint64_t *init = (uint64_t *)xcalloc(2 * sh->n_idx, sizeof(uint64_t));
                for (uint32_t i = 0; i < sh->n_idx; i++)
                        init[2 * i] = UINT64_MAX;
                step = "stamps";
                if (cudaMalloc((void **)&s.dstamps, sb) != cudaSuccess ||
                    cudaMemcpy(s.dstamps, init, sb, cudaMemcpyHostToDevice) != cudaSuccess ||
                    cudaDeviceSynchronize() != cudaSuccess) {
                        free(init);
                        goto fail;
                }
                free(init);
                /* Warm: load the kernel, touch the mappings. */
                struct kvf_gpu_run *runs =
                    (struct kvf_gpu_run *)xcalloc(sh->n_runs, sizeof(struct kvf_gpu_run));
                layer_runs(sh, 0, runs);
                struct kvf_gpu_batch b = {runs, sh->n_runs, &s.src, 1, &s.dst, 1, NULL, NULL};
                uint64_t t = 0;
                step = "warm-up copy";
                if ((rc = kvf_gpu_copy_submit(s.c, &b, &t)) < 0)
                        goto fail;
                while ((rc = kvf_gpu_copy_poll(s.c, t)) == 0) {
                }
                free(runs);
                if (rc < 0)
                        goto fail;
        }
        /* Release: pairs with the parent's acquire load before it starts the engine. */
        kvf_store_release(&sh->child_ready, 1u);
        sender_main(&s);
        if (s.rc < 0) {
                snprintf(sh->child_msg, sizeof(sh->child_msg), "%s", s.why);
                sh->child_rc = 1;
        } else {
                uint64_t *out = SH_ARR(sh, uint64_t, off_stamps);
                if (cudaMemcpy(out, s.dstamps, 2 * (size_t)sh->n_idx * sizeof(uint64_t),
                               cudaMemcpyDeviceToHost) != cudaSuccess) {
                        snprintf(sh->child_msg, sizeof(sh->child_msg), "reading the stamps");
                        sh->child_rc = 1;
                }
        }
        kvf_gpu_copier_destroy(s.c);
        kvf_gpu_ipc_close(sh->device, src);
        kvf_gpu_ipc_close(sh->device, dst);
        /* Release: results and child_msg before child_done. */
        kvf_store_release(&sh->child_done, 1u);
        return sh->child_rc;
fail:
        snprintf(sh->child_msg, sizeof(sh->child_msg), "child: %s: %s", step,
                 rc < 0 ? kvf_gpu_err_msg() : cudaGetErrorString(cudaGetLastError()));
        sh->child_rc = 1;
        kvf_store_release(&sh->child_done, 1u);
        return 1;
}

/* ---------------------------------------------------------------- the signal waiter */

struct waiter {
        struct shared *sh;
        enum wait_mode mode;
        uint64_t poll_ns;
        int rc;
};

static void *waiter_main(void *arg)
{
        struct waiter *wt = (struct waiter *)arg;
        struct shared *sh = wt->sh;
        uint64_t *seen = SH_ARR(sh, uint64_t, off_seen);
        uint32_t n = sh->n_idx, next = 0;
        uint64_t deadline = bench_now_ns() + SENDER_TIMEOUT_NS;
        wt->rc = 0;
        while (next < n) {
                /* Acquire: pairs with the signal's release store. */
                uint64_t w = kvf_load_acquire(&sh->word);
                if (w > n)
                        w = n;
                if (w > next) {
                        uint64_t t = bench_now_ns();
                        for (; next < w; next++)
                                seen[next] = t;
                        continue;
                }
                if (bench_now_ns() > deadline) {
                        wt->rc = -1;
                        break;
                }
                switch (wt->mode) {
                case W_SPIN:
                        kvf_cpu_relax();
                        break;
                case W_SLEEP:
                        sleep_ns(wt->poll_ns);
                        break;
                case W_FUTEX: {
                        /* Acquire: pairs with hostfn_wake's increment; checking the
                         * word after reading the sequence closes the lost-wake window. */
                        uint32_t seq = kvf_load_acquire(&sh->futex_seq);
                        if (kvf_load_acquire(&sh->word) > next)
                                break;
                        futex_wait(&sh->futex_seq, seq, 50000000ull);
                        break;
                }
                }
        }
        return NULL;
}

/* ---------------------------------------------------------------- the engine and a trial */

struct world {
        struct options o;
        int mps;
        int sms;
        struct bench_layout lay;
        void *src, *dst;
        struct kvf_gpu_region rs, rd;
        struct kvf_gpu_run *runs0;
        size_t n_runs;
        uint64_t batch_bytes;
        uint32_t n_idx;
        int memfd;
        struct shared *sh;
        size_t sh_bytes;
        cudaStream_t engine;
        struct kvf_gpu_copier *copier; /* ref and ctx, in this process */
        uint64_t *layer_end;           /* device, per layer index */
        uint64_t *dstamps;             /* device, 2 per layer index */
        const char *self;
};

static void shared_reset(struct world *w)
{
        struct shared *sh = w->sh;
        /* Nobody else maps it between trials: plain stores. */
        sh->word = 0;
        sh->futex_seq = 0;
        sh->child_ready = 0;
        sh->child_done = 0;
        sh->child_rc = 0;
        sh->child_msg[0] = 0;
        memset(SH_ARR(sh, uint64_t, off_seen), 0, (size_t)w->n_idx * 8);
        memset(SH_ARR(sh, uint64_t, off_issued), 0, (size_t)w->n_idx * 8);
        memset(SH_ARR(sh, uint64_t, off_known), 0, (size_t)w->n_idx * 8);
        uint64_t *st = SH_ARR(sh, uint64_t, off_stamps);
        for (uint32_t i = 0; i < w->n_idx; i++) {
                st[2 * i] = UINT64_MAX;
                st[2 * i + 1] = 0;
        }
}

static pid_t spawn_child(struct world *w)
{
        char fdbuf[16];
        snprintf(fdbuf, sizeof(fdbuf), "%d", w->memfd);
        char *argv[] = {(char *)w->self, (char *)"--child-sender", fdbuf, NULL};
        pid_t pid;
        int rc = posix_spawn(&pid, "/proc/self/exe", NULL, NULL, argv, environ);
        if (rc)
                bench_die("posix_spawn: %s", strerror(rc));
        return pid;
}

/* Wait for the child to exit; kill it (only it) if it outlives the deadline. */
static int reap_child(pid_t pid, uint64_t timeout_ns)
{
        uint64_t until = bench_now_ns() + timeout_ns;
        for (;;) {
                int status;
                pid_t r = waitpid(pid, &status, WNOHANG);
                if (r == pid)
                        return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
                if (bench_now_ns() > until) {
                        kill(pid, SIGKILL);
                        waitpid(pid, &status, 0);
                        return 124;
                }
                sleep_ns(1000000);
        }
}

/* Poll the oldest ctx copy; returns -1 on a failed copy. */
static int ctx_poll(struct world *w, const uint64_t *tickets, uint32_t *oldest, uint32_t queued,
                    char *why, size_t whylen)
{
        uint64_t *known = SH_ARR(w->sh, uint64_t, off_known);
        while (*oldest < queued) {
                int rc = kvf_gpu_copy_poll(w->copier, tickets[*oldest]);
                if (rc == 0)
                        return 0;
                if (rc < 0) {
                        snprintf(why, whylen, "ctx poll: %s", kvf_gpu_err_msg());
                        return -1;
                }
                known[(*oldest)++] = bench_now_ns();
        }
        return 0;
}

static void run_trial(struct world *w, struct trial *t)
{
        const struct options *o = &w->o;
        struct shared *sh = w->sh;
        uint32_t n = w->n_idx, L = o->layers;
        pid_t child = -1;
        pthread_t thr;
        int have_thr = 0;
        struct sender snd;
        struct waiter wt;
        struct kvf_gpu_signal *sig = NULL;
        uint64_t *tickets = NULL;
        uint32_t oldest = 0;

        t->ok = 0;
        t->why[0] = 0;
        shared_reset(w);
        uint64_t *init = (uint64_t *)xcalloc(2 * (size_t)n, sizeof(uint64_t));
        for (uint32_t i = 0; i < n; i++)
                init[2 * i] = UINT64_MAX;
        BENCH_CUDA(cudaMemcpy(w->dstamps, init, 2 * (size_t)n * 8, cudaMemcpyHostToDevice));
        free(init);
        BENCH_CUDA(cudaMemset(w->layer_end, 0, (size_t)n * 8));
        BENCH_CUDA(cudaMemset(w->dst, 0, w->rd.bytes));
        BENCH_CUDA(cudaDeviceSynchronize());

        int method = t->kind == K_SIGNAL ? t->method : o->signal;
        BENCH_KVF(kvf_gpu_signal_create(
            o->device, &sh->word, method,
            t->kind == K_SIGNAL && t->wait == W_FUTEX ? hostfn_wake : NULL, sh, &sig));

        /* The other side, ready before the engine starts. */
        if (t->kind == K_PROC) {
                child = spawn_child(w);
                uint64_t until = bench_now_ns() + CHILD_READY_TIMEOUT_NS;
                /* Acquire: pairs with the child's release of child_ready / child_done. */
                while (!kvf_load_acquire(&sh->child_ready)) {
                        if (kvf_load_acquire(&sh->child_done) || bench_now_ns() > until) {
                                int rc = reap_child(child, 5000000000ull);
                                snprintf(t->why, sizeof(t->why), "child not ready (exit %d): %s",
                                         rc, sh->child_msg);
                                kvf_gpu_signal_destroy(sig);
                                return;
                        }
                        sleep_ns(100000);
                }
        } else if (t->kind == K_REF || t->kind == K_CTX) {
                /* Warm this process's copier (kernel loaded, arena touched). */
                struct kvf_gpu_run *runs =
                    (struct kvf_gpu_run *)xcalloc(sh->n_runs, sizeof(struct kvf_gpu_run));
                layer_runs(sh, 0, runs);
                struct kvf_gpu_batch b = {runs, sh->n_runs, &w->rs, 1, &w->rd, 1, NULL, NULL};
                uint64_t tk = 0;
                int rc;
                BENCH_KVF(kvf_gpu_copy_submit(w->copier, &b, &tk));
                while ((rc = kvf_gpu_copy_poll(w->copier, tk)) == 0) {
                }
                BENCH_KVF(rc);
                free(runs);
        }
        if (t->kind == K_REF) {
                memset(&snd, 0, sizeof(snd));
                snd.sh = sh;
                snd.c = w->copier;
                snd.src = w->rs;
                snd.dst = w->rd;
                snd.dstamps = w->dstamps;
                if (pthread_create(&thr, NULL, sender_main, &snd))
                        bench_die("pthread_create failed");
                have_thr = 1;
        } else if (t->kind == K_SIGNAL) {
                wt.sh = sh;
                wt.mode = t->wait;
                wt.poll_ns = (uint64_t)o->poll_us * 1000;
                if (pthread_create(&thr, NULL, waiter_main, &wt))
                        bench_die("pthread_create failed");
                have_thr = 1;
        }

        struct bench_clock_map cm;
        cm.a = bench_clock_measure(CLOCK_ROUNDS);

        /* The engine. */
        uint64_t block_ns = (uint64_t)o->block_us * 1000;
        uint32_t waves = o->layer_us / o->block_us ? o->layer_us / o->block_us : 1;
        unsigned grid = (unsigned)w->sms * 2u * waves;
        struct kvf_gpu_run *runs =
            (struct kvf_gpu_run *)xcalloc(sh->n_runs, sizeof(struct kvf_gpu_run));
        uint64_t *issued = SH_ARR(sh, uint64_t, off_issued);
        if (t->kind == K_CTX)
                tickets = (uint64_t *)xcalloc(n, sizeof(uint64_t));
        uint64_t t0 = bench_now_ns() + 1000000;
        int failed = 0;
        for (uint32_t i = 0; i < n && !failed; i++) {
                /* Pace: busy keeps at most two layers queued; idle spaces them by the
                 * host clock. Either way, poll the ctx copies while waiting. */
                uint64_t until = t0 + (uint64_t)i * o->layer_us * 1000;
                uint64_t give_up = bench_now_ns() + SENDER_TIMEOUT_NS;
                for (;;) {
                        int ready =
                            t->busy ? kvf_load_acquire(&sh->word) + 2 > i : bench_now_ns() >= until;
                        if (ready)
                                break;
                        if (t->kind == K_CTX &&
                            ctx_poll(w, tickets, &oldest, i, t->why, sizeof(t->why)) < 0) {
                                failed = 1;
                                break;
                        }
                        if (bench_now_ns() > give_up) {
                                snprintf(t->why, sizeof(t->why), "engine stalled at layer %u", i);
                                failed = 1;
                                break;
                        }
                        kvf_cpu_relax();
                }
                if (failed)
                        break;
                unsigned long long *end = (unsigned long long *)(w->layer_end + i);
                if (t->busy)
                        busy_kernel<<<grid, 1024, 0, w->engine>>>(block_ns, end);
                else
                        stamp_kernel<<<1, 32, 0, w->engine>>>(end);
                BENCH_CUDA(cudaGetLastError());
                BENCH_KVF(kvf_gpu_signal_post(sig, w->engine, (uint64_t)i + 1));
                if (t->kind == K_CTX) {
                        layer_runs(sh, i % L, runs);
                        struct kvf_gpu_batch b = {
                            runs,   sh->n_runs, &w->rs,    1,
                            &w->rd, 1,          w->engine, w->dstamps + 2 * (size_t)i};
                        int rc;
                        while ((rc = kvf_gpu_copy_submit(w->copier, &b, &tickets[i])) == -EAGAIN)
                                if (ctx_poll(w, tickets, &oldest, i, t->why, sizeof(t->why)) < 0)
                                        break;
                        if (rc < 0) {
                                snprintf(t->why, sizeof(t->why), "ctx submit: %s",
                                         kvf_gpu_err_msg());
                                failed = 1;
                                break;
                        }
                        issued[i] = bench_now_ns();
                }
        }
        if (t->kind == K_CTX && !failed) {
                uint64_t give_up = bench_now_ns() + SENDER_TIMEOUT_NS;
                while (oldest < n && !failed) {
                        if (ctx_poll(w, tickets, &oldest, n, t->why, sizeof(t->why)) < 0)
                                failed = 1;
                        else if (bench_now_ns() > give_up) {
                                snprintf(t->why, sizeof(t->why), "ctx copies not landed");
                                failed = 1;
                        }
                }
        }
        free(runs);
        free(tickets);
        BENCH_CUDA(cudaStreamSynchronize(w->engine));

        /* The other side finishes. */
        if (have_thr) {
                pthread_join(thr, NULL);
                if (t->kind == K_REF && snd.rc < 0) {
                        snprintf(t->why, sizeof(t->why), "%s", snd.why);
                        failed = 1;
                }
                if (t->kind == K_SIGNAL && wt.rc < 0) {
                        snprintf(t->why, sizeof(t->why), "waiter: not every layer seen");
                        failed = 1;
                }
        }
        if (child > 0) {
                uint64_t until = bench_now_ns() + SENDER_TIMEOUT_NS;
                while (!kvf_load_acquire(&sh->child_done) && bench_now_ns() < until)
                        sleep_ns(200000);
                int rc = reap_child(child, 10000000000ull);
                if (rc != 0 || sh->child_rc) {
                        snprintf(t->why, sizeof(t->why), "child exit %d: %s", rc, sh->child_msg);
                        failed = 1;
                }
        }
        BENCH_CUDA(cudaDeviceSynchronize());
        cm.b = bench_clock_measure(CLOCK_ROUNDS);
        kvf_gpu_signal_destroy(sig);
        t->clock_err_us = (double)(cm.a.rtt > cm.b.rtt ? cm.a.rtt : cm.b.rtt) / 2e3;
        if (failed)
                return;

        /* Results. */
        uint64_t *lend = (uint64_t *)xcalloc(n, 8);
        uint64_t *cst = (uint64_t *)xcalloc(2 * (size_t)n, 8);
        BENCH_CUDA(cudaMemcpy(lend, w->layer_end, (size_t)n * 8, cudaMemcpyDeviceToHost));
        if (t->kind == K_PROC)
                memcpy(cst, SH_ARR(sh, uint64_t, off_stamps), 2 * (size_t)n * 8);
        else
                BENCH_CUDA(cudaMemcpy(cst, w->dstamps, 2 * (size_t)n * 8, cudaMemcpyDeviceToHost));
        uint64_t *seen = SH_ARR(sh, uint64_t, off_seen), *known = SH_ARR(sh, uint64_t, off_known);
        uint32_t m0 = L, m1 = n - L; /* the warm-up and tail steps are not counted */
        size_t m = m1 - m0;
        double *a[6];
        for (int k = 0; k < 6; k++)
                a[k] = (double *)xcalloc(m, sizeof(double));
        int copies = t->kind != K_SIGNAL;
        for (uint32_t i = m0; i < m1; i++) {
                size_t j = i - m0;
                double hend = bench_clock_to_host(&cm, lend[i]);
                a[0][j] = copies ? ((double)cst[2 * i] - (double)lend[i]) / 1e3 : NAN;
                a[1][j] = copies ? ((double)cst[2 * i + 1] - (double)lend[i]) / 1e3 : NAN;
                a[2][j] = (t->kind == K_CTX || !seen[i]) ? NAN : ((double)seen[i] - hend) / 1e3;
                a[3][j] = copies && issued[i] ? ((double)issued[i] - hend) / 1e3 : NAN;
                a[4][j] = copies && known[i] ? ((double)known[i] - hend) / 1e3 : NAN;
                a[5][j] = ((double)lend[i] - (double)lend[i - 1]) / 1e3;
        }
        struct bench_pct *out[6] = {&t->start,  &t->landed, &t->wake,
                                    &t->issued, &t->known,  &t->layer};
        for (int k = 0; k < 6; k++) {
                *out[k] = bench_percentiles(a[k], m);
                free(a[k]);
        }
        /* Every byte of every layer's runs landed (each layer copied once per step). */
        if (copies) {
                struct kvf_gpu_run *all =
                    (struct kvf_gpu_run *)xcalloc((size_t)L * sh->n_runs, sizeof(*all));
                for (uint32_t l = 0; l < L; l++)
                        layer_runs(sh, l, all + (size_t)l * sh->n_runs);
                t->wrong = bench_verify_runs(all, (size_t)L * sh->n_runs, &w->rs, 1, &w->rd, 1);
                free(all);
                for (uint32_t i = 0; i < n; i++)
                        if (cst[2 * i] == UINT64_MAX || cst[2 * i + 1] == 0) {
                                snprintf(t->why, sizeof(t->why), "layer %u's copy has no stamps",
                                         i);
                                t->wrong++;
                                break;
                        }
        }
        free(lend);
        free(cst);
        t->ok = t->wrong == 0;
        if (!t->ok && !t->why[0])
                snprintf(t->why, sizeof(t->why), "%llu bytes differ after the copies",
                         (unsigned long long)t->wrong);
}

/* ---------------------------------------------------------------- report */

static void pr2(char *buf, size_t len, const struct bench_pct *p)
{
        if (!p->n || isnan(p->p50))
                snprintf(buf, len, "%15s", "-");
        else
                snprintf(buf, len, "%7.1f %7.1f", p->p50, p->p99);
}

static void print_trial(const struct trial *t)
{
        char s[32], l[32], wk[32], is[32], kn[32], ly[32];
        pr2(s, sizeof(s), &t->start);
        pr2(l, sizeof(l), &t->landed);
        pr2(wk, sizeof(wk), &t->wake);
        pr2(is, sizeof(is), &t->issued);
        pr2(kn, sizeof(kn), &t->known);
        pr2(ly, sizeof(ly), &t->layer);
        if (!t->ok) {
                printf("%-28s %-4s  FAILED: %s\n", t->label, t->busy ? "busy" : "idle", t->why);
                return;
        }
        printf("%-28s %-4s %5zu  %s  %s  %s  %s  %s  %s  %5.1f\n", t->label,
               t->busy ? "busy" : "idle", t->layer.n, s, l, wk, is, kn, ly, t->clock_err_us);
}

static void json_pct(FILE *f, const char *name, const struct bench_pct *p, int last)
{
        if (!p->n || isnan(p->p50))
                fprintf(f, "\"%s\": null%s", name, last ? "" : ", ");
        else
                fprintf(f, "\"%s\": {\"n\": %zu, \"p50\": %.3f, \"p99\": %.3f, \"max\": %.3f}%s",
                        name, p->n, p->p50, p->p99, p->max, last ? "" : ", ");
}

static void usage(FILE *f)
{
        fprintf(f,
                "usage: gpu_latency_bench [options]\n"
                "Layer-done -> copy start / copy landed, p50 and p99, engine idle and busy,\n"
                "for the reference (a thread of the engine's process), executor (1) a\n"
                "separate process (with or without MPS: detected) and executor (2) the\n"
                "engine's own context; and layer-done signalling by host function, stream\n"
                "write and kernel, by the wake-up of a waiting thread.\n"
                "  --modes LIST      signal,ref,proc,ctx (default all)\n"
                "  --engine LIST     idle,busy (default both)\n"
                "  --model NAME      shape from data/model-shapes.json (default llama-3.1-8b)\n"
                "  --tp N            tensor-parallel degree: kv heads / N (default 1)\n"
                "  --layers N        layers per step (default 32)\n"
                "  --steps N         measured steps (default 10; plus a warm-up and a tail step)\n"
                "  --layer-us N      engine time per layer (default 200)\n"
                "  --block-us N      busy engine: lifetime of one of its blocks (default 10)\n"
                "  --requests N      requests in each layer's batch (default 4)\n"
                "  --tokens N        tokens per layer across those requests (default 4096)\n"
                "  --signal M        layer-done signal for ref/proc/ctx: hostfn, writevalue,\n"
                "                    kernel (default writevalue)\n"
                "  --desc D          copy descriptors: kept (as kvferry copies: a layer's\n"
                "                    first batch read from mapped host memory and kept on\n"
                "                    the device, the next layers run them again shifted),\n"
                "                    mapped (every batch read from host memory) or staged\n"
                "                    (copied to the device before each kernel) (default kept)\n"
                "  --poll-us N       writevalue+sleep waiter's poll period (default 20)\n"
                "  --device N        GPU (default 0)\n"
                "  --json PATH       also write the results as JSON\n"
                "  --mps-check       print whether MPS is on; exit 0 if on, 3 if off\n"
                "  --help, --version\n"
                "MPS is started and stopped by the operator (bench/gpu_suite.sh does):\n"
                "  nvidia-cuda-mps-control -d ; ... ; echo quit | nvidia-cuda-mps-control\n"
                "Exit: 0 done (targets missed are reported), 1 error, a failed trial or a\n"
                "wrong byte, 2 usage, 77 no GPU.\n");
}

static const char *desc_name(unsigned flags)
{
        return flags & KVF_GPU_COPIER_MAPPED_DESC   ? "mapped"
               : flags & KVF_GPU_COPIER_STAGED_DESC ? "staged"
                                                    : "kept";
}

static int parse_method(const char *s)
{
        if (!strcmp(s, "hostfn"))
                return KVF_GPU_SIGNAL_HOST_FN;
        if (!strcmp(s, "writevalue"))
                return KVF_GPU_SIGNAL_WRITE_VALUE;
        if (!strcmp(s, "kernel"))
                return KVF_GPU_SIGNAL_KERNEL;
        bench_die("--signal %s: hostfn, writevalue or kernel", s);
}

static unsigned parse_bits(const char *s, const char *const *names, unsigned n)
{
        unsigned bits = 0;
        char buf[128];
        snprintf(buf, sizeof(buf), "%s", s);
        for (char *save = NULL, *tok = strtok_r(buf, ",", &save); tok;
             tok = strtok_r(NULL, ",", &save)) {
                unsigned i;
                for (i = 0; i < n; i++)
                        if (!strcmp(tok, names[i]))
                                break;
                if (i == n)
                        bench_die("unknown name \"%s\" in \"%s\"", tok, s);
                bits |= 1u << i;
        }
        return bits;
}

int main(int argc, char **argv)
{
        if (argc == 3 && !strcmp(argv[1], "--child-sender")) {
                alarm(120);
                return child_main(atoi(argv[2]));
        }
        static const char *const mode_names[] = {"signal", "ref", "proc", "ctx"};
        static const char *const engine_names[] = {"idle", "busy"};
        struct options o;
        memset(&o, 0, sizeof(o));
        o.model = "llama-3.1-8b";
        o.tp = 1;
        o.layers = 32;
        o.steps = 10;
        o.layer_us = 200;
        o.block_us = 10;
        o.requests = 4;
        o.tokens = 4096;
        o.poll_us = 20;
        o.signal = KVF_GPU_SIGNAL_WRITE_VALUE;
        o.desc_flags = 0;
        o.modes = 0xf;
        o.engines = 3;
        int mps_check = 0;

        static const struct option lo[] = {{"modes", required_argument, NULL, 'm'},
                                           {"engine", required_argument, NULL, 'e'},
                                           {"model", required_argument, NULL, 'M'},
                                           {"tp", required_argument, NULL, 't'},
                                           {"layers", required_argument, NULL, 'L'},
                                           {"steps", required_argument, NULL, 'S'},
                                           {"layer-us", required_argument, NULL, 'u'},
                                           {"block-us", required_argument, NULL, 'b'},
                                           {"requests", required_argument, NULL, 'r'},
                                           {"tokens", required_argument, NULL, 'T'},
                                           {"signal", required_argument, NULL, 'g'},
                                           {"desc", required_argument, NULL, 'D'},
                                           {"poll-us", required_argument, NULL, 'p'},
                                           {"device", required_argument, NULL, 'd'},
                                           {"json", required_argument, NULL, 'j'},
                                           {"mps-check", no_argument, NULL, 'c'},
                                           {"help", no_argument, NULL, 'h'},
                                           {"version", no_argument, NULL, 'V'},
                                           {NULL, 0, NULL, 0}};
        int ch;
        while ((ch = getopt_long(argc, argv, "h", lo, NULL)) != -1) {
                switch (ch) {
                case 'm':
                        o.modes = parse_bits(optarg, mode_names, 4);
                        break;
                case 'e':
                        o.engines = parse_bits(optarg, engine_names, 2);
                        break;
                case 'M':
                        o.model = optarg;
                        break;
                case 't':
                        o.tp = (unsigned)atoi(optarg);
                        break;
                case 'L':
                        o.layers = (uint32_t)atoi(optarg);
                        break;
                case 'S':
                        o.steps = (uint32_t)atoi(optarg);
                        break;
                case 'u':
                        o.layer_us = (uint32_t)atoi(optarg);
                        break;
                case 'b':
                        o.block_us = (uint32_t)atoi(optarg);
                        break;
                case 'r':
                        o.requests = (uint32_t)atoi(optarg);
                        break;
                case 'T':
                        o.tokens = (uint32_t)atoi(optarg);
                        break;
                case 'g':
                        o.signal = parse_method(optarg);
                        break;
                case 'D':
                        if (!strcmp(optarg, "kept"))
                                o.desc_flags = 0;
                        else if (!strcmp(optarg, "mapped"))
                                o.desc_flags = KVF_GPU_COPIER_MAPPED_DESC;
                        else if (!strcmp(optarg, "staged"))
                                o.desc_flags = KVF_GPU_COPIER_STAGED_DESC;
                        else
                                bench_die("--desc: kept, mapped or staged");
                        break;
                case 'p':
                        o.poll_us = (uint32_t)atoi(optarg);
                        break;
                case 'd':
                        o.device = atoi(optarg);
                        break;
                case 'j':
                        o.json = optarg;
                        break;
                case 'c':
                        mps_check = 1;
                        break;
                case 'h':
                        usage(stdout);
                        return 0;
                case 'V':
                        printf("gpu_latency_bench %s\n", VERSION);
                        return 0;
                default:
                        usage(stderr);
                        return 2;
                }
        }
        if (optind != argc || !o.layers || !o.steps || !o.layer_us || !o.block_us || !o.tp ||
            !o.requests || !o.tokens) {
                usage(stderr);
                return 2;
        }
        setvbuf(stdout, NULL, _IOLBF, 0);
        alarm(300);

        int n_dev = bench_require_gpu("gpu_latency_bench");
        if (o.device >= n_dev)
                bench_die("--device %d: %d devices", o.device, n_dev);
        BENCH_CUDA(cudaSetDevice(o.device));
        struct world w;
        memset(&w, 0, sizeof(w));
        w.o = o;
        w.self = argv[0];
        w.mps = kvf_gpu_mps_enabled(o.device);
        if (w.mps < 0)
                bench_die("MPS check: %s", kvf_gpu_err_msg());
        if (mps_check) {
                printf("MPS: %s\n", w.mps ? "on" : "off");
                return w.mps ? 0 : 3;
        }
        w.sms = kvf_gpu_device_sms(o.device);
        if (w.sms <= 0)
                bench_die("SM count: %s", kvf_gpu_err_msg());

        /* The per-layer batch. */
        struct kvf_bench_model models[16];
        unsigned nm = kvf_bench_models(models, 16);
        const struct kvf_bench_model *md = NULL;
        for (unsigned i = 0; i < nm && i < 16; i++)
                if (!strcmp(models[i].name, o.model))
                        md = &models[i];
        if (!md)
                bench_die("--model %s: not in data/model-shapes.json", o.model);
        uint32_t heads = md->kv_heads / o.tp ? md->kv_heads / o.tp : 1;
        uint32_t blocks = (o.tokens + KVF_BENCH_BLOCK_TOKENS - 1) / KVF_BENCH_BLOCK_TOKENS;
        w.lay = (struct bench_layout){o.layers, md->key_only ? 1u : 2u, 2 * blocks + 16,
                                      (uint64_t)heads * KVF_BENCH_BLOCK_TOKENS * md->head_dim *
                                          md->elem_bytes};
        w.n_runs = bench_layer_runs(&w.lay, 0, o.requests, blocks, 0x1a7e, &w.runs0);
        w.batch_bytes = (uint64_t)blocks * w.lay.tensors * w.lay.block_bytes;
        w.n_idx = (o.steps + 2) * o.layers;
        uint64_t cache = bench_cache_bytes(&w.lay);
        BENCH_KVF(kvf_gpu_alloc(o.device, cache, &w.src));
        BENCH_KVF(kvf_gpu_alloc(o.device, cache, &w.dst));
        bench_fill(w.src, cache, 0xcafe, 0);
        BENCH_CUDA(cudaDeviceSynchronize());
        w.rs = (struct kvf_gpu_region){(uint64_t)(uintptr_t)w.src, cache};
        w.rd = (struct kvf_gpu_region){(uint64_t)(uintptr_t)w.dst, cache};
        BENCH_CUDA(cudaStreamCreateWithFlags(&w.engine, cudaStreamNonBlocking));
        BENCH_KVF(kvf_gpu_copier_create(o.device, o.desc_flags, NULL, &w.copier));
        BENCH_CUDA(cudaMalloc((void **)&w.layer_end, (size_t)w.n_idx * 8));
        BENCH_CUDA(cudaMalloc((void **)&w.dstamps, 2 * (size_t)w.n_idx * 8));

        /* Shared memory for the word, the child and the results. */
        size_t off = (sizeof(struct shared) + 63) & ~(size_t)63;
        size_t o_runs = off;
        off += (w.n_runs * sizeof(struct kvf_gpu_run) + 63) & ~(size_t)63;
        size_t o_seen = off;
        off += (size_t)w.n_idx * 8;
        size_t o_issued = off;
        off += (size_t)w.n_idx * 8;
        size_t o_known = off;
        off += (size_t)w.n_idx * 8;
        size_t o_stamps = off;
        off += 2 * (size_t)w.n_idx * 8;
        w.sh_bytes = (off + 4095) & ~(size_t)4095;
        w.memfd = (int)syscall(SYS_memfd_create, "kvf-latency-bench", 0);
        if (w.memfd < 0 || ftruncate(w.memfd, (off_t)w.sh_bytes) < 0)
                bench_die("memfd: %s", strerror(errno));
        w.sh =
            (struct shared *)mmap(NULL, w.sh_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, w.memfd, 0);
        if (w.sh == MAP_FAILED)
                bench_die("mmap: %s", strerror(errno));
        struct shared *sh = w.sh;
        sh->off_runs = o_runs;
        sh->off_seen = o_seen;
        sh->off_issued = o_issued;
        sh->off_known = o_known;
        sh->off_stamps = o_stamps;
        sh->n_idx = w.n_idx;
        sh->layers = o.layers;
        sh->n_runs = (uint32_t)w.n_runs;
        sh->desc_flags = o.desc_flags;
        sh->device = o.device;
        sh->layer_stride = (uint64_t)w.lay.tensors * w.lay.blocks * w.lay.block_bytes;
        sh->src_bytes = cache;
        sh->dst_bytes = cache;
        memcpy(SH_ARR(sh, struct kvf_gpu_run, off_runs), w.runs0,
               w.n_runs * sizeof(struct kvf_gpu_run));
        BENCH_KVF(kvf_gpu_ipc_export(w.src, sh->h_src));
        BENCH_KVF(kvf_gpu_ipc_export(w.dst, sh->h_dst));

        char desc[256];
        bench_describe_device(o.device, desc, sizeof(desc));
        uint64_t step = bench_globaltimer_step();
        struct bench_clock_point cp = bench_clock_measure(CLOCK_ROUNDS);
        printf("gpu_latency_bench %s: %s\n", VERSION, desc);
        printf("batch per layer: %s tp%u, %u requests, %u tokens: %u blocks x %u tensors x %llu "
               "KiB = %.1f MiB in %zu runs; %u layers x %u steps (+2 unmeasured), %u us per "
               "layer, busy blocks %u us (%u waves of %u)\n",
               o.model, o.tp, o.requests, o.tokens, blocks, w.lay.tensors,
               (unsigned long long)(w.lay.block_bytes >> 10), (double)w.batch_bytes / (1 << 20),
               w.n_runs, o.layers, o.steps, o.layer_us, o.block_us,
               o.layer_us / o.block_us ? o.layer_us / o.block_us : 1, w.sms * 2);
        printf("copies: descriptors %s; ref/proc/ctx layer-done by %s; globaltimer step %llu ns; "
               "clock calibration error <= %.1f us\n",
               desc_name(o.desc_flags), kvf_gpu_signal_method_name(o.signal),
               (unsigned long long)step, (double)cp.rtt / 2e3);
        if (!w.mps)
                printf("MPS is off: the proc rows show a separate process without MPS (the "
                       "problem); start MPS for executor (1)\n");

        /* The trials. */
        struct trial trials[MAX_TRIALS];
        unsigned nt = 0;
        static const struct {
                int method;
                enum wait_mode wait;
                const char *label;
        } sigs[] = {{KVF_GPU_SIGNAL_HOST_FN, W_SPIN, "signal hostfn+spin"},
                    {KVF_GPU_SIGNAL_HOST_FN, W_FUTEX, "signal hostfn+futex"},
                    {KVF_GPU_SIGNAL_WRITE_VALUE, W_SPIN, "signal writevalue+spin"},
                    {KVF_GPU_SIGNAL_WRITE_VALUE, W_SLEEP, "signal writevalue+poll"},
                    {KVF_GPU_SIGNAL_KERNEL, W_SPIN, "signal kernel+spin"}};
        for (int busy = 0; busy < 2; busy++) {
                if (!(o.engines & (1u << busy)))
                        continue;
                if (o.modes & 1u)
                        for (unsigned i = 0; i < sizeof(sigs) / sizeof(sigs[0]); i++) {
                                struct trial *t = &trials[nt++];
                                memset(t, 0, sizeof(*t));
                                t->kind = K_SIGNAL;
                                t->busy = busy;
                                t->method = sigs[i].method;
                                t->wait = sigs[i].wait;
                                if (sigs[i].wait == W_SLEEP)
                                        snprintf(t->label, sizeof(t->label), "%s%uus",
                                                 sigs[i].label, o.poll_us);
                                else
                                        snprintf(t->label, sizeof(t->label), "%s", sigs[i].label);
                        }
                for (int k = K_REF; k <= K_CTX; k++) {
                        if (!(o.modes & (1u << k)))
                                continue;
                        struct trial *t = &trials[nt++];
                        memset(t, 0, sizeof(*t));
                        t->kind = (enum kind)k;
                        t->busy = busy;
                        snprintf(t->label, sizeof(t->label), "%s", kind_name(t->kind, w.mps));
                }
        }

        printf("\n%-28s %-4s %5s  %15s  %15s  %15s  %15s  %15s  %15s  %5s\n", "trial", "eng", "n",
               "start", "landed", "wake", "issued", "known", "layer", "clock");
        printf("%-28s %-4s %5s  %15s  %15s  %15s  %15s  %15s  %15s  %5s\n", "", "", "",
               "p50 p99 us", "p50 p99 us", "p50 p99 us", "p50 p99 us", "p50 p99 us", "p50 p99 us",
               "+-us");
        uint64_t t_start = bench_now_ns();
        int failed = 0;
        for (unsigned i = 0; i < nt; i++) {
                run_trial(&w, &trials[i]);
                print_trial(&trials[i]);
                failed += !trials[i].ok;
        }

        /* Verdicts against the reference of the same engine state. */
        printf("\n");
        for (int busy = 0; busy < 2; busy++) {
                const struct trial *ref = NULL;
                for (unsigned i = 0; i < nt; i++)
                        if (trials[i].kind == K_REF && trials[i].busy == busy && trials[i].ok)
                                ref = &trials[i];
                for (unsigned i = 0; i < nt; i++) {
                        const struct trial *t = &trials[i];
                        if (!t->ok || t->busy != busy || (t->kind != K_PROC && t->kind != K_CTX))
                                continue;
                        const char *role = t->kind == K_CTX ? "executor (2)"
                                           : w.mps          ? "executor (1)"
                                                            : "no MPS, not an executor";
                        printf("%-9s %s [%s]: start p50 %.1f us (target < 20) %s", t->label,
                               busy ? "busy" : "idle", role, t->start.p50,
                               t->start.p50 < 20 ? "PASS" : "MISS");
                        if (ref)
                                printf("; landed p50 %.1f us = %.2f x ref %.1f, p99 %.2f x%s",
                                       t->landed.p50, t->landed.p50 / ref->landed.p50,
                                       ref->landed.p50, t->landed.p99 / ref->landed.p99,
                                       busy ? (t->landed.p50 <= 1.2 * ref->landed.p50
                                                   ? " (target <= 1.2 x) PASS"
                                                   : " (target <= 1.2 x) MISS")
                                            : "");
                        printf("\n");
                }
        }
        printf("%s; %.1f s\n",
               failed ? "FAILED trials above" : "every copy verified (every byte, every layer)",
               (double)(bench_now_ns() - t_start) / 1e9);

        if (o.json) {
                FILE *f = fopen(o.json, "w");
                if (!f)
                        bench_die("%s: %s", o.json, strerror(errno));
                fprintf(
                    f, "{\"bench\": \"gpu_latency_bench\", \"version\": %s, \"device\": ", VERSION);
                bench_json_str(f, desc);
                fprintf(f,
                        ", \"mps\": %s, \"model\": \"%s\", \"tp\": %u, \"batch_bytes\": %llu, "
                        "\"runs\": %zu, \"layers\": %u, \"steps\": %u, \"layer_us\": %u, "
                        "\"block_us\": %u, \"signal\": \"%s\", \"desc\": \"%s\", "
                        "\"globaltimer_step_ns\": %llu, \"trials\": [\n",
                        w.mps ? "true" : "false", o.model, o.tp, (unsigned long long)w.batch_bytes,
                        w.n_runs, o.layers, o.steps, o.layer_us, o.block_us,
                        kvf_gpu_signal_method_name(o.signal), desc_name(o.desc_flags),
                        (unsigned long long)step);
                for (unsigned i = 0; i < nt; i++) {
                        const struct trial *t = &trials[i];
                        fprintf(f, "  {\"trial\": \"%s\", \"engine\": \"%s\", \"ok\": %s, ",
                                t->label, t->busy ? "busy" : "idle", t->ok ? "true" : "false");
                        if (!t->ok) {
                                fprintf(f, "\"why\": ");
                                bench_json_str(f, t->why);
                                fprintf(f, "}%s\n", i + 1 < nt ? "," : "");
                                continue;
                        }
                        fprintf(f, "\"clock_err_us\": %.2f, ", t->clock_err_us);
                        json_pct(f, "start_us", &t->start, 0);
                        json_pct(f, "landed_us", &t->landed, 0);
                        json_pct(f, "wake_us", &t->wake, 0);
                        json_pct(f, "issued_us", &t->issued, 0);
                        json_pct(f, "known_us", &t->known, 0);
                        json_pct(f, "layer_us", &t->layer, 1);
                        fprintf(f, "}%s\n", i + 1 < nt ? "," : "");
                }
                fprintf(f, "]}\n");
                fclose(f);
                printf("json: %s\n", o.json);
        }

        kvf_gpu_copier_destroy(w.copier);
        cudaStreamDestroy(w.engine);
        cudaFree(w.layer_end);
        cudaFree(w.dstamps);
        kvf_gpu_free(o.device, w.src);
        kvf_gpu_free(o.device, w.dst);
        munmap(w.sh, w.sh_bytes);
        close(w.memfd);
        free(w.runs0);
        return failed ? 1 : 0;
}

/*
 * kvf-bench-ring: the kvferry ring against the kernel's own ways of moving
 * records between two processes, measured in the same run (STYLE habit 15:
 * every figure is printed next to its reference and as a ratio to it).
 *
 * Two processes (fork), pinned to two different CPUs when the affinity mask
 * allows it. For each record size (default 64 B and 4 KiB of payload):
 *
 *  throughput  the child produces records for --duration seconds (or exactly
 *              --count records), the parent consumes them; every record
 *              carries its sequence number in its first and last 8 bytes,
 *              and the consumer checks both and sums every 8-byte word of
 *              the payload, so every byte is read, in every mechanism.
 *  latency     ping-pong of one record where the receiver is asleep in the
 *              kernel when the message arrives (futex, read, recv); the
 *              initiator busy-waits --gap-us before each ping so that the
 *              responder has surely gone to sleep, and both sides count
 *              their voluntary context switches to prove it.
 *
 * Mechanisms (what each row does is printed under the table):
 *  ring        kvf_ring_claim + memcpy + kvf_ring_commit per record (the
 *              per-record API; commit rings the doorbell: a full fence and a
 *              load of `waiters`, a futex wake only for a consumer that has
 *              announced itself); the consumer reads with kvf_ring_read and,
 *              when it is empty, sleeps with kvf_doorbell_wait(kvf_ring_readable).
 *  ring-batch  kvf_ring_publish per record, kvf_ring_notify every --batch
 *              records (and when the ring is full); same consumer.
 *  pipe        write() per record, read() of exactly one record.
 *  pipe-bulk   write() per record, read() of up to 64 KiB (a pipe is a byte
 *              stream: the consumer cuts records out of what it got).
 *  eventfd     a simple SPSC ring of fixed-size slots in a MAP_SHARED
 *              mapping; the consumer spins as long as the ring consumer,
 *              then announces itself and blocks in read(eventfd); the
 *              producer writes the eventfd only when announced.
 *  unix        AF_UNIX SOCK_SEQPACKET socketpair, send()/recv() per record.
 *
 * Two latency-only diagnostic rows price the one thing the ring does that the
 * plain pipe does not: its waits always time out. ring-untimed is the ring
 * with a futex wait without a timeout; pipe-timed a pipe whose receiver waits
 * in poll() with the ring's timeout before it reads.
 */
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <inttypes.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/utsname.h>
#include <sys/wait.h>
#include <unistd.h>

#include "atomics.h"
#include "clock.h"
#include "ctl.h"
#include "doorbell.h"
#include "err.h"
#include "ring.h"
#include "sched_slice.h"

#define BENCH_VERSION "1"
#define REC_TYPE 7u
#define END_SEQ UINT64_MAX
/* The last word of a record is its sequence number xor this, so a record
 * whose two ends come from different writes (torn, or stale) is caught. */
#define TAIL_MAGIC 0x5a5a5a5a5a5a5a5aull
#define MAX_SIZES 8
#define BULK_READ (64u * 1024u)
#define MIN_SIZE 16u
#define MAX_SIZE (1u << 20)
#define SLEEP_NS 100000000ull /* doorbell sleeps: futex wakes are hints (habit 8) */
#define WATCHDOG_S 120u       /* a run that takes longer than this is stuck: SIGALRM ends it */

/* ------------------------------------------------------------------ */
/* options                                                             */

struct opts {
        double duration;   /* seconds per throughput row, when count == 0 */
        uint64_t count;    /* records per throughput row; 0 = use duration */
        unsigned rounds;   /* measured round trips per latency row */
        unsigned warmup;   /* round trips before measuring */
        unsigned gap_us;   /* initiator's busy wait before each ping */
        unsigned blocks;   /* latency rows are measured interleaved, in this many blocks */
        unsigned spins;    /* throughput consumers: polls before sleeping */
        unsigned batch;    /* ring-batch: records per notify */
        unsigned read_max; /* ring consumer: records per kvf_ring_read */
        uint64_t capacity; /* bytes of every ring / pipe / shm buffer */
        uint32_t sizes[MAX_SIZES];
        unsigned nsizes;
        int cpu[2]; /* [0] child (producer, responder), [1] parent; -1 = no pinning */
        bool json, no_tput, no_lat;
        unsigned slice_us; /* scheduler slice of both processes (sched_slice.h); 0 = default */
        unsigned hogs;     /* processes that spin beside the pair: a busy host */
        char only[256]; /* comma-separated mechanism names; "" = all */
};

static struct opts o = {
    .duration = 2.0,
    .rounds = 20000,
    .warmup = 1000,
    .gap_us = 20,
    .blocks = 20,
    .spins = 64, /* what the client library's kvf_poll() uses */
    .batch = 32,
    .read_max = 256,
    .capacity = 1u << 20, /* KVF_DEFAULT_RING_CAPACITY */
    .sizes = {64, 4096},
    .nsizes = 2,
    .cpu = {-2, -2}, /* -2: pick automatically */
};

/* ------------------------------------------------------------------ */
/* state shared by parent and child (an anonymous MAP_SHARED page)      */

struct shared {
        uint32_t go;      /* parent -> child: start now */
        uint32_t ready;   /* child -> parent: pinned and set up */
        uint64_t t_start; /* producer: just before its first record */
        uint64_t sent;    /* producer: records sent, end marker excluded */
        uint64_t nvcsw;   /* child: voluntary context switches during the run */
        uint64_t bad;     /* child: records that failed validation */
        char err[256];    /* child: why it failed */
};

static struct shared *sh;
static char inst[64];
static bool have_segment;

#define MAX_HOGS 64
static pid_t hog_pid[MAX_HOGS];

static char slice_note[32] = "the kernel's default";

static void cleanup(void)
{
        if (have_segment)
                kvf_ctl_unlink(inst);
        for (unsigned i = 0; i < MAX_HOGS; i++)
                if (hog_pid[i] > 0)
                        kill(hog_pid[i], SIGKILL);
}

/* --hogs: processes that only spin, at the kernel's default slice, unpinned. */
static int start_hogs(void)
{
        for (unsigned i = 0; i < o.hogs; i++) {
                pid_t p = fork();
                if (p < 0)
                        return -1;
                if (p == 0) {
                        prctl(PR_SET_PDEATHSIG, SIGKILL);
                        for (;;)
                                kvf_cpu_relax();
                }
                hog_pid[i] = p;
        }
        return 0;
}

static void on_signal(int sig)
{
        /* shm_unlink is all kvf_ctl_unlink does that matters here. */
        cleanup();
        signal(sig, SIG_DFL);
        raise(sig);
}

static uint64_t nvcsw_now(void)
{
        struct rusage ru;
        getrusage(RUSAGE_SELF, &ru);
        return (uint64_t)ru.ru_nvcsw;
}

static int pin(int cpu)
{
        if (cpu < 0)
                return 0;
        cpu_set_t set;
        CPU_ZERO(&set);
        CPU_SET(cpu, &set);
        if (sched_setaffinity(0, sizeof(set), &set) < 0)
                return kvf_err_set(-errno, "pin to CPU %d: %s", cpu, strerror(errno));
        return 0;
}

/* ------------------------------------------------------------------ */
/* records                                                             */

static inline void stamp(uint8_t *p, uint32_t size, uint64_t seq)
{
        uint64_t last = seq ^ TAIL_MAGIC;
        memcpy(p, &seq, 8);
        memcpy(p + size - 8, &last, 8);
}

struct sink {
        uint32_t size;
        uint64_t next; /* expected sequence number */
        uint64_t bad;
        uint64_t sum; /* of every payload word: makes the consumer read each byte */
        bool done;
};

/* Returns true for the end marker. */
static inline bool check(struct sink *s, const uint8_t *p, uint32_t len)
{
        uint64_t first, last;

        memcpy(&first, p, 8);
        if (first == END_SEQ)
                return s->done = true;
        memcpy(&last, p + len - 8, 8);
        if (len != s->size || first != s->next || last != (first ^ TAIL_MAGIC)) {
                if (s->bad++ < 3)
                        fprintf(stderr,
                                "kvf-bench-ring: record %" PRIu64 ": got seq %" PRIu64
                                " len %u tail %#" PRIx64 "\n",
                                s->next, first, len, last);
        }
        uint64_t sum = 0;
        for (uint32_t i = 0; i + 8 <= len; i += 8) {
                uint64_t w;
                memcpy(&w, p + i, 8);
                sum += w;
        }
        s->sum += sum;
        s->next = first + 1;
        return false;
}

/* ------------------------------------------------------------------ */
/* plain I/O helpers                                                   */

static int write_full(int fd, const void *buf, size_t n)
{
        const uint8_t *p = buf;
        while (n) {
                ssize_t w = write(fd, p, n);
                if (w < 0) {
                        if (errno == EINTR)
                                continue;
                        return -errno;
                }
                p += w;
                n -= (size_t)w;
        }
        return 0;
}

static int read_full(int fd, void *buf, size_t n)
{
        uint8_t *p = buf;
        while (n) {
                ssize_t r = read(fd, p, n);
                if (r < 0) {
                        if (errno == EINTR)
                                continue;
                        return -errno;
                }
                if (r == 0)
                        return -EPIPE;
                p += r;
                n -= (size_t)r;
        }
        return 0;
}

/* One record over a pipe (a byte stream: all of it) or a SEQPACKET socket (one send). */
static int fd_put(int fd, const void *p, uint32_t n, bool seqpacket)
{
        if (!seqpacket) {
                int rc = write_full(fd, p, n);
                return rc < 0 ? kvf_err_set(rc, "write: %s", strerror(-rc)) : 0;
        }
        ssize_t k;
        while ((k = send(fd, p, n, 0)) < 0 && errno == EINTR) {
        }
        if (k == (ssize_t)n)
                return 0;
        return kvf_err_set(k < 0 ? -errno : -EIO, "send: %s", k < 0 ? strerror(errno) : "short");
}

/* One record from a pipe (exactly n bytes) or a SEQPACKET socket (one recv of n bytes). */
static int fd_get(int fd, void *p, uint32_t n, bool seqpacket)
{
        if (!seqpacket) {
                int rc = read_full(fd, p, n);
                return rc < 0 ? kvf_err_set(rc, "read: %s", strerror(-rc)) : 0;
        }
        ssize_t k;
        while ((k = recv(fd, p, n, 0)) < 0 && errno == EINTR) {
        }
        if (k == (ssize_t)n)
                return 0;
        return kvf_err_set(k < 0 ? -errno : -EIO, "recv: %s", k < 0 ? strerror(errno) : "short record");
}

/* ------------------------------------------------------------------ */
/* the eventfd + shared-memory comparator                              */

/*
 * Fixed-size slots, one writer per index, the same announce-then-recheck
 * protocol as the kvferry doorbell (so the comparison is about the ring's
 * record format and API, not about a different sleeping discipline).
 */
struct shmq {
        uint64_t tail; /* producer's line */
        uint8_t pad0[56];
        uint64_t head;     /* consumer's line */
        uint32_t sleeping; /* consumer announced it is about to block */
        uint8_t pad1[52];
        uint8_t data[];
};
_Static_assert(sizeof(struct shmq) == 128, "shmq lines");

struct shmq_end {
        struct shmq *q;
        int efd;
        uint32_t slot;   /* bytes per slot = record size */
        uint64_t nslots; /* power of two */
        uint64_t head_cache;
};

static size_t shmq_bytes(uint32_t slot, uint64_t nslots)
{
        return sizeof(struct shmq) + (size_t)slot * nslots;
}

static int shmq_make(struct shmq_end *e, uint32_t slot, uint64_t capacity)
{
        uint64_t n = 1;
        while (n * 2 * slot <= capacity)
                n *= 2;
        memset(e, 0, sizeof(*e));
        e->slot = slot;
        e->nslots = n < 2 ? 2 : n;
        e->q = mmap(NULL, shmq_bytes(slot, e->nslots), PROT_READ | PROT_WRITE,
                    MAP_SHARED | MAP_ANONYMOUS, -1, 0);
        if (e->q == MAP_FAILED)
                return kvf_err_set(-errno, "map eventfd buffer: %s", strerror(errno));
        e->efd = eventfd(0, EFD_CLOEXEC);
        if (e->efd < 0) {
                int rc = -errno;
                munmap(e->q, shmq_bytes(slot, e->nslots));
                return kvf_err_set(rc, "eventfd: %s", strerror(-rc));
        }
        return 0;
}

static void shmq_free(struct shmq_end *e)
{
        close(e->efd);
        munmap(e->q, shmq_bytes(e->slot, e->nslots));
}

/* Producer: copy one record in; spins while full (as the ring producer does). */
static inline void shmq_put(struct shmq_end *e, const uint8_t *rec)
{
        struct shmq *q = e->q;
        uint64_t tail = kvf_load_relaxed(&q->tail); /* only we write it */

        while (tail - e->head_cache >= e->nslots) {
                /* Pairs with the release store of head in shmq_take(). */
                e->head_cache = kvf_load_acquire(&q->head);
                if (tail - e->head_cache >= e->nslots)
                        kvf_cpu_relax();
        }
        memcpy(q->data + (tail & (e->nslots - 1)) * e->slot, rec, e->slot);
        /* Pairs with the acquire load of tail in the consumer. */
        kvf_store_release(&q->tail, tail + 1);
        /* Pairs with the fence in shmq_sleep(): tail store before the load of
         * `sleeping` (Dekker), so either we see the announcement or the
         * consumer's re-check sees the record. */
        kvf_fence_seq_cst();
        if (kvf_load_relaxed(&q->sleeping) && kvf_exchange_acq_rel(&q->sleeping, 0)) {
                uint64_t one = 1;
                if (write(e->efd, &one, 8) != 8)
                        abort();
        }
}

/* Consumer: announce, re-check, block in read(eventfd). */
static int shmq_sleep(struct shmq_end *e, uint64_t head)
{
        struct shmq *q = e->q;
        uint64_t v;

        kvf_store_relaxed(&q->sleeping, 1);
        /* Pairs with the fence in shmq_put(). */
        kvf_fence_seq_cst();
        if (kvf_load_acquire(&q->tail) != head) {
                /* A stale eventfd count this may leave makes one later read
                 * return at once: a spurious wake, harmless. */
                kvf_store_relaxed(&q->sleeping, 0);
                return 0;
        }
        if (read(e->efd, &v, 8) != 8 && errno != EINTR)
                return -errno;
        return 0;
}

/* ------------------------------------------------------------------ */
/* one run = one fork                                                  */

struct run {
        int mech;
        uint32_t size;
        uint8_t *src; /* producer's staging record */
        uint8_t *buf; /* consumer's / responder's buffer */
        /* ring */
        struct kvf_ctl ctl;
        struct kvf_ring *ring, *ring_back;
        /* pipe, socket */
        int fd[2], fd_back[2];
        /* eventfd */
        struct shmq_end q, q_back;
        /* results (parent side) */
        uint64_t t_end, nvcsw;
        struct sink sink;
        /* latency: this run's round trips (one block), and where to put their times */
        unsigned rounds, warmup;
        uint64_t *lat;
        uint64_t *wake, *user; /* per round trip: the two wake-ups, the two receivers' own work */
        uint64_t *stamps;      /* shared with the responder: STAMPS per round trip */
        uint64_t woke_ns;      /* lat_recv: when the blocking call last returned */
};

/*
 * Where a round trip goes. Per round trip: [0] initiator starts sending, [1]
 * responder's blocking call returns (futex wait, read, recv), [2] responder
 * starts sending the echo, [3] initiator's blocking call returns; the trip
 * ends when the initiator has the record. wake = ([1]-[0]) + ([3]-[2]): send
 * call, kernel, wake-up, and for the kernel's mechanisms the copy out of the
 * kernel; user = ([2]-[1]) + (end-[3]): the receivers' own work after waking
 * (for the ring: reading the record from shared memory and zeroing it).
 */
#define STAMPS 4

enum {
        M_RING,
        M_RING_BATCH,
        M_RING_UNTIMED,
        M_PIPE,
        M_PIPE_BULK,
        M_PIPE_TIMED,
        M_EVENTFD,
        M_UNIX,
        M_COUNT
};

static const struct mech_desc {
        const char *name;
        const char *tput_what; /* NULL: no throughput row */
        const char *lat_what;  /* NULL: no latency row */
} mechs[M_COUNT] = {
    [M_RING] = {"ring",
                "kvf_ring_claim + memcpy + kvf_ring_commit per record; consumer kvf_ring_read "
                "(<= read-max per call), kvf_doorbell_wait(kvf_ring_readable) when empty",
                "claim + memcpy + commit; receiver kvf_doorbell_prepare / re-check / "
                "kvf_doorbell_sleep (no spinning)"},
    [M_RING_BATCH] = {"ring-batch",
                      "claim + memcpy + kvf_ring_publish per record, kvf_ring_notify per "
                      "batch (BATCHED); same consumer",
                      NULL},
    [M_RING_UNTIMED] = {"ring-untimed", NULL,
                        "as ring, but the receiver's futex wait has no timeout (a diagnostic: "
                        "kvferry's own waits always time out; the row prices that timer)"},
    [M_PIPE] = {"pipe", "write() per record, read() of exactly one record",
                "write(); receiver blocks in read()"},
    [M_PIPE_BULK] = {"pipe-bulk",
                     "write() per record, read() of up to 64 KiB, records cut from the stream",
                     NULL},
    [M_PIPE_TIMED] = {"pipe-timed", NULL,
                      "write(); receiver blocks in poll() with the ring's 100 ms timeout, then "
                      "read() (a diagnostic: a pipe wait that, like kvferry's, always times out)"},
    [M_EVENTFD] = {"eventfd",
                   "fixed-slot SPSC buffer in MAP_SHARED memory, eventfd write only when the "
                   "consumer announced it sleeps (same spins)",
                   "slot in shared memory + eventfd write; receiver blocks in read(eventfd)"},
    [M_UNIX] = {"unix", "AF_UNIX SOCK_SEQPACKET, send()/recv() per record",
                "send(); receiver blocks in recv()"},
};

static bool selected(int m)
{
        if (!o.only[0])
                return true;
        size_t n = strlen(mechs[m].name);
        for (const char *p = o.only; *p;) {
                const char *e = strchr(p, ',');
                size_t len = e ? (size_t)(e - p) : strlen(p);
                if (len == n && !strncmp(p, mechs[m].name, n))
                        return true;
                p += len + (e ? 1 : 0);
        }
        return false;
}

static int make_segment(struct run *r)
{
        struct kvf_ctl_params p = {.instance = inst,
                                   .instance_role = KVF_IROLE_MIXED,
                                   .backend = KVF_BACKEND_HOST,
                                   .reqtab_slots = 4,
                                   .max_blocks = 16};
        for (int i = 0; i < KVF_RING_COUNT; i++)
                p.ring_capacity[i] = o.capacity;
        kvf_ctl_unlink(inst);
        int rc = kvf_ctl_create(&p, &r->ctl);
        if (rc < 0)
                return kvf_err_ctx(rc, "create control segment %s", inst);
        have_segment = true;
        kvf_ctl_publish(&r->ctl);
        /* engine->sender rings the sender's bell, sender->engine the engine's:
         * two rings with two different doorbells, as in the real processes. */
        r->ring = &r->ctl.rings[KVF_RING_ENGINE_TO_SENDER];
        r->ring_back = &r->ctl.rings[KVF_RING_SENDER_TO_ENGINE];
        return 0;
}

static int set_pipe_size(int fd)
{
        /* Same buffer as the ring, so neither side wins on slack. */
        if (fcntl(fd, F_SETPIPE_SZ, (int)o.capacity) < 0)
                return kvf_err_set(-errno, "F_SETPIPE_SZ %" PRIu64 ": %s", o.capacity,
                                   strerror(errno));
        return 0;
}

static int setup(struct run *r, bool latency)
{
        int rc = 0;

        r->fd[0] = r->fd[1] = r->fd_back[0] = r->fd_back[1] = -1;
        r->src = aligned_alloc(64, MAX_SIZE + BULK_READ);
        r->buf = aligned_alloc(64, MAX_SIZE + BULK_READ);
        if (!r->src || !r->buf)
                return kvf_err_set(-ENOMEM, "buffers");
        /* Any constant filler: the consumer's sum only has to read it. */
        memset(r->src, 0xa5, r->size);
        memset(r->buf, 0, r->size);
        switch (r->mech) {
        case M_RING:
        case M_RING_BATCH:
        case M_RING_UNTIMED:
                rc = make_segment(r);
                break;
        case M_PIPE:
        case M_PIPE_BULK:
        case M_PIPE_TIMED:
                if (pipe2(r->fd, O_CLOEXEC) < 0 || (latency && pipe2(r->fd_back, O_CLOEXEC) < 0))
                        return kvf_err_set(-errno, "pipe: %s", strerror(errno));
                if ((rc = set_pipe_size(r->fd[1])) < 0)
                        return rc;
                if (latency)
                        rc = set_pipe_size(r->fd_back[1]);
                break;
        case M_EVENTFD:
                if ((rc = shmq_make(&r->q, r->size, o.capacity)) < 0)
                        return rc;
                if (latency)
                        rc = shmq_make(&r->q_back, r->size, o.capacity);
                break;
        case M_UNIX: {
                if (socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, r->fd) < 0)
                        return kvf_err_set(-errno, "socketpair: %s", strerror(errno));
                /* Asks for the same buffer as the ring; the kernel caps it at
                 * net.core.wmem_max and counts per-packet overhead in it. */
                int sz = (int)o.capacity;
                setsockopt(r->fd[0], SOL_SOCKET, SO_SNDBUF, &sz, sizeof(sz));
                setsockopt(r->fd[1], SOL_SOCKET, SO_SNDBUF, &sz, sizeof(sz));
                setsockopt(r->fd[0], SOL_SOCKET, SO_RCVBUF, &sz, sizeof(sz));
                setsockopt(r->fd[1], SOL_SOCKET, SO_RCVBUF, &sz, sizeof(sz));
                break;
        }
        }
        return rc;
}

static void teardown(struct run *r)
{
        switch (r->mech) {
        case M_RING:
        case M_RING_BATCH:
        case M_RING_UNTIMED:
                if (have_segment) {
                        kvf_ctl_detach(&r->ctl);
                        kvf_ctl_unlink(inst);
                        have_segment = false;
                }
                break;
        case M_EVENTFD:
                if (r->q.q)
                        shmq_free(&r->q);
                if (r->q_back.q)
                        shmq_free(&r->q_back);
                break;
        default:
                for (int i = 0; i < 2; i++) {
                        if (r->fd[i] >= 0)
                                close(r->fd[i]);
                        if (r->fd_back[i] >= 0)
                                close(r->fd_back[i]);
                }
        }
        free(r->src);
        free(r->buf);
}

/* ------------------------------------------------------------------ */
/* throughput                                                          */

static uint64_t t_stop;

static inline bool keep_going(uint64_t seq)
{
        if (o.count)
                return seq < o.count;
        /* The clock every 64 records: cheap next to any of the mechanisms. */
        return (seq & 63) || kvf_now_ns() < t_stop;
}

static void producer_start(void)
{
        uint64_t now = kvf_now_ns();
        sh->t_start = now;
        t_stop = now + (uint64_t)(o.duration * 1e9);
}

static int produce_ring(struct run *r, bool batched)
{
        struct kvf_ring *ring = r->ring;
        uint32_t size = r->size;
        uint64_t seq = 0;
        void *p;
        uint64_t pos;

        kvf_ring_producer_attach(ring, 1);
        producer_start();
        for (;; seq++) {
                bool end = !keep_going(seq);
                int rc;
                stamp(r->src, size, end ? END_SEQ : seq);
                while ((rc = kvf_ring_claim(ring, REC_TYPE, size, &p, &pos)) == -EAGAIN) {
                        /* Full: a batched producer must ring, or a consumer
                         * asleep since the last notify would never come back
                         * before its timeout. */
                        if (batched)
                                kvf_ring_notify(ring);
                        kvf_cpu_relax();
                }
                if (rc < 0)
                        return kvf_err_set(rc, "claim %u bytes: %s", size, strerror(-rc));
                memcpy(p, r->src, size);
                if (!batched || end) {
                        kvf_ring_commit(ring, pos);
                } else {
                        kvf_ring_publish(ring, pos);
                        if ((seq + 1) % o.batch == 0)
                                kvf_ring_notify(ring);
                }
                if (end)
                        break;
        }
        sh->sent = seq;
        return 0;
}

static int produce_fd(struct run *r, bool seqpacket)
{
        int fd = r->fd[1];
        uint64_t seq = 0;

        producer_start();
        for (;; seq++) {
                bool end = !keep_going(seq);
                stamp(r->src, r->size, end ? END_SEQ : seq);
                int rc = fd_put(fd, r->src, r->size, seqpacket);
                if (rc < 0)
                        return rc;
                if (end)
                        break;
        }
        sh->sent = seq;
        return 0;
}

static int produce_shmq(struct run *r)
{
        uint64_t seq = 0;

        producer_start();
        for (;; seq++) {
                bool end = !keep_going(seq);
                stamp(r->src, r->size, end ? END_SEQ : seq);
                shmq_put(&r->q, r->src);
                if (end)
                        break;
        }
        sh->sent = seq;
        return 0;
}

static int on_record(void *ctx, uint16_t type, const uint8_t *p, uint32_t len, uint64_t pos)
{
        (void)pos;
        struct sink *s = ctx;
        if (type != REC_TYPE)
                s->bad++;
        check(s, p, len);
        return 0;
}

static bool ring_has_work(void *ctx)
{
        return kvf_ring_readable(ctx);
}

static int consume_ring(struct run *r)
{
        struct kvf_ring *ring = r->ring;

        kvf_ring_consumer_attach(ring);
        while (!r->sink.done) {
                int n = kvf_ring_read(ring, on_record, &r->sink, o.read_max);
                if (n < 0)
                        return kvf_err_ctx(n, "ring read");
                if (n == 0)
                        kvf_doorbell_wait(ring->bell, ring_has_work, ring, o.spins, SLEEP_NS);
        }
        return 0;
}

static int consume_fd_each(struct run *r, bool seqpacket)
{
        int fd = r->fd[0];

        while (!r->sink.done) {
                int rc = fd_get(fd, r->buf, r->size, seqpacket);
                if (rc < 0)
                        return rc;
                check(&r->sink, r->buf, r->size);
        }
        return 0;
}

static int consume_pipe_bulk(struct run *r)
{
        int fd = r->fd[0];
        size_t have = 0;

        while (!r->sink.done) {
                ssize_t n = read(fd, r->buf + have, BULK_READ);
                if (n < 0 && errno == EINTR)
                        continue;
                if (n <= 0)
                        return kvf_err_set(n < 0 ? -errno : -EPIPE, "read: %s",
                                           n < 0 ? strerror(errno) : "end of file");
                have += (size_t)n;
                size_t off = 0;
                while (have - off >= r->size && !r->sink.done) {
                        check(&r->sink, r->buf + off, r->size);
                        off += r->size;
                }
                /* A record cut in two by the stream: keep its start. */
                memmove(r->buf, r->buf + off, have - off);
                have -= off;
        }
        return 0;
}

static int consume_shmq(struct run *r)
{
        struct shmq *q = r->q.q;
        uint64_t head = 0, mask = r->q.nslots - 1;

        while (!r->sink.done) {
                /* Pairs with the release store of tail in shmq_put(). */
                uint64_t tail = kvf_load_acquire(&q->tail);
                if (tail == head) {
                        for (unsigned i = 0; i < o.spins && tail == head; i++) {
                                kvf_cpu_relax();
                                tail = kvf_load_acquire(&q->tail);
                        }
                        if (tail == head) {
                                int rc = shmq_sleep(&r->q, head);
                                if (rc < 0)
                                        return kvf_err_set(rc, "read eventfd: %s", strerror(-rc));
                                continue;
                        }
                }
                /* Like kvf_ring_read: a batch, then one head store. */
                for (unsigned k = 0; head != tail && k < o.read_max && !r->sink.done; k++, head++)
                        check(&r->sink, q->data + (head & mask) * r->size, r->size);
                /* Pairs with the acquire load of head in shmq_put(). */
                kvf_store_release(&q->head, head);
        }
        return 0;
}

static int child_produce(struct run *r)
{
        switch (r->mech) {
        case M_RING:
                return produce_ring(r, false);
        case M_RING_BATCH:
                return produce_ring(r, true);
        case M_PIPE:
        case M_PIPE_BULK:
                return produce_fd(r, false);
        case M_UNIX:
                return produce_fd(r, true);
        case M_EVENTFD:
                return produce_shmq(r);
        }
        return -EINVAL;
}

static int parent_consume(struct run *r)
{
        switch (r->mech) {
        case M_RING:
        case M_RING_BATCH:
                return consume_ring(r);
        case M_PIPE:
                return consume_fd_each(r, false);
        case M_UNIX:
                return consume_fd_each(r, true);
        case M_PIPE_BULK:
                return consume_pipe_bulk(r);
        case M_EVENTFD:
                return consume_shmq(r);
        }
        return -EINVAL;
}

/* ------------------------------------------------------------------ */
/* latency                                                             */

static int copy_out(void *ctx, uint16_t type, const uint8_t *p, uint32_t len, uint64_t pos)
{
        (void)type, (void)pos;
        memcpy(ctx, p, len);
        return 0;
}

/* Blocking receive of one record into buf, asleep in the kernel while there is none. */
static int lat_recv(struct run *r, bool initiator, uint8_t *buf)
{
        switch (r->mech) {
        case M_RING:
        case M_RING_UNTIMED: {
                struct kvf_ring *rx = initiator ? r->ring_back : r->ring;
                for (;;) {
                        int n = kvf_ring_read(rx, copy_out, buf, 1);
                        if (n != 0)
                                return n < 0 ? kvf_err_ctx(n, "ring read") : 0;
                        /* No spinning: announce, re-check, sleep
                         * (kvf_doorbell_wait, spelled out to time the wake). */
                        uint32_t seq = kvf_doorbell_prepare(rx->bell);
                        if (kvf_ring_readable(rx)) {
                                kvf_doorbell_cancel(rx->bell, seq);
                        } else {
                                if (r->mech == M_RING)
                                        kvf_doorbell_sleep(rx->bell, seq, SLEEP_NS);
                                else
                                        kvf_doorbell_sleep_untimed(rx->bell, seq);
                                r->woke_ns = kvf_now_ns();
                        }
                }
        }
        case M_PIPE: {
                int rc = fd_get(initiator ? r->fd_back[0] : r->fd[0], buf, r->size, false);
                r->woke_ns = kvf_now_ns();
                return rc;
        }
        case M_PIPE_TIMED: {
                struct pollfd pfd = {.fd = initiator ? r->fd_back[0] : r->fd[0], .events = POLLIN};
                int n;
                while ((n = poll(&pfd, 1, (int)(SLEEP_NS / 1000000u))) <= 0)
                        if (n < 0 && errno != EINTR)
                                return kvf_err_set(-errno, "poll: %s", strerror(errno));
                r->woke_ns = kvf_now_ns();
                return fd_get(pfd.fd, buf, r->size, false);
        }
        case M_UNIX: {
                int rc = fd_get(r->fd[initiator ? 0 : 1], buf, r->size, true);
                r->woke_ns = kvf_now_ns();
                return rc;
        }
        case M_EVENTFD: {
                struct shmq_end *e = initiator ? &r->q_back : &r->q;
                uint64_t head = kvf_load_relaxed(&e->q->head); /* only we write it */
                for (;;) {
                        /* Pairs with the release store of tail in shmq_put(). */
                        if (kvf_load_acquire(&e->q->tail) != head)
                                break;
                        int rc = shmq_sleep(e, head);
                        r->woke_ns = kvf_now_ns();
                        if (rc < 0)
                                return kvf_err_set(rc, "read eventfd: %s", strerror(-rc));
                }
                memcpy(buf, e->q->data + (head & (e->nslots - 1)) * e->slot, r->size);
                /* Pairs with the acquire load of head in shmq_put(). */
                kvf_store_release(&e->q->head, head + 1);
                return 0;
        }
        }
        return -EINVAL;
}

static int lat_send(struct run *r, bool initiator, const uint8_t *rec)
{
        switch (r->mech) {
        case M_RING:
        case M_RING_UNTIMED: {
                struct kvf_ring *tx = initiator ? r->ring : r->ring_back;
                void *p;
                uint64_t pos;
                int rc;
                while ((rc = kvf_ring_claim(tx, REC_TYPE, r->size, &p, &pos)) == -EAGAIN)
                        kvf_cpu_relax();
                if (rc < 0)
                        return kvf_err_set(rc, "claim: %s", strerror(-rc));
                memcpy(p, rec, r->size);
                kvf_ring_commit(tx, pos);
                return 0;
        }
        case M_PIPE:
        case M_PIPE_TIMED:
                return fd_put(initiator ? r->fd[1] : r->fd_back[1], rec, r->size, false);
        case M_UNIX:
                return fd_put(r->fd[initiator ? 0 : 1], rec, r->size, true);
        case M_EVENTFD:
                shmq_put(initiator ? &r->q : &r->q_back, rec);
                return 0;
        }
        return -EINVAL;
}

static int child_respond(struct run *r)
{
        uint64_t total = (uint64_t)r->warmup + r->rounds;

        if (r->ring) /* the ring rows */
                kvf_ring_producer_attach(r->ring_back, 1);
        for (uint64_t i = 0; i < total; i++) {
                r->woke_ns = 0;
                int rc = lat_recv(r, false, r->buf);
                if (rc < 0)
                        return rc;
                uint64_t seq;
                memcpy(&seq, r->buf, 8);
                if (seq != i)
                        sh->bad++;
                uint64_t *st = r->stamps + i * STAMPS;
                st[1] = r->woke_ns;
                st[2] = kvf_now_ns();
                /* Echo what arrived: the reply costs the same copy as the ping. */
                if ((rc = lat_send(r, false, r->buf)) < 0)
                        return rc;
        }
        return 0;
}

static int parent_initiate(struct run *r)
{
        uint64_t total = (uint64_t)r->warmup + r->rounds;

        if (r->ring)
                kvf_ring_producer_attach(r->ring, 1);
        for (uint64_t i = 0; i < total; i++) {
                /* Busy, not asleep: the responder's CPU goes idle and the
                 * responder blocks; ours stays awake to time the trip. */
                uint64_t until = kvf_now_ns() + (uint64_t)o.gap_us * 1000u;
                while (kvf_now_ns() < until)
                        kvf_cpu_relax();
                stamp(r->src, r->size, i);
                uint64_t *st = r->stamps + i * STAMPS;
                r->woke_ns = 0;
                uint64_t t0 = kvf_now_ns();
                int rc = lat_send(r, true, r->src);
                if (rc < 0)
                        return rc;
                if ((rc = lat_recv(r, true, r->buf)) < 0)
                        return rc;
                uint64_t t1 = kvf_now_ns();
                if (memcmp(r->buf, r->src, r->size) != 0)
                        r->sink.bad++;
                st[0] = t0;
                st[3] = r->woke_ns;
                if (i >= r->warmup) {
                        uint64_t k = i - r->warmup;
                        r->lat[k] = t1 - t0;
                        /* A side that never slept (woke_ns 0) makes the split meaningless. */
                        bool slept = st[1] && st[3];
                        r->wake[k] = slept ? (st[1] - st[0]) + (st[3] - st[2]) : 0;
                        r->user[k] = slept ? (st[2] - st[1]) + (t1 - st[3]) : 0;
                }
        }
        return 0;
}

/* ------------------------------------------------------------------ */
/* fork, pin, run                                                      */

static int run_one(struct run *r, bool latency)
{
        int rc;

        memset(sh, 0, sizeof(*sh));
        r->sink = (struct sink){.size = r->size};
        pid_t pid = fork();
        if (pid < 0)
                return kvf_err_set(-errno, "fork: %s", strerror(errno));
        if (pid == 0) {
                alarm(WATCHDOG_S);
                (void)kvf_doorbell_register(); /* a child registers anew (doorbell.h) */
                if ((rc = pin(o.cpu[0])) < 0)
                        goto child_fail;
                /* Release: the parent starts us only once we are pinned. */
                kvf_store_release(&sh->ready, 1);
                while (!kvf_load_acquire(&sh->go))
                        kvf_cpu_relax();
                uint64_t cs = nvcsw_now();
                rc = latency ? child_respond(r) : child_produce(r);
                sh->nvcsw = nvcsw_now() - cs;
                if (rc < 0)
                        goto child_fail;
                _exit(0);
        child_fail:
                snprintf(sh->err, sizeof(sh->err), "%s", kvf_err_msg());
                _exit(1);
        }
        rc = pin(o.cpu[1]);
        /* Pairs with the release store of ready in the child. */
        while (rc == 0 && !kvf_load_acquire(&sh->ready))
                sched_yield();
        uint64_t cs = nvcsw_now();
        if (rc == 0) {
                alarm(WATCHDOG_S);
                /* Release: the child sees our setup. */
                kvf_store_release(&sh->go, 1);
                rc = latency ? parent_initiate(r) : parent_consume(r);
                r->t_end = kvf_now_ns();
                alarm(0);
        }
        r->nvcsw = nvcsw_now() - cs;
        if (rc < 0)
                kill(pid, SIGKILL); /* our own child, stuck without us */
        int st;
        if (waitpid(pid, &st, 0) != pid)
                return kvf_err_set(-ECHILD, "wait for child %d", (int)pid);
        if (rc < 0)
                return rc;
        if (!WIFEXITED(st) || WEXITSTATUS(st) != 0)
                return kvf_err_set(-EIO, "child %s: %s",
                                   WIFSIGNALED(st) ? strsignal(WTERMSIG(st)) : "failed",
                                   sh->err[0] ? sh->err : "no message");
        r->nvcsw += sh->nvcsw;
        r->sink.bad += sh->bad;
        if (r->sink.bad)
                return kvf_err_set(-EBADMSG, "%" PRIu64 " records failed validation", r->sink.bad);
        if (!latency && r->sink.next != sh->sent)
                return kvf_err_set(-EBADMSG, "sent %" PRIu64 " records, received %" PRIu64,
                                   sh->sent, r->sink.next);
        return 0;
}

/* ------------------------------------------------------------------ */
/* results                                                             */

struct tput_row {
        int mech;
        uint32_t size;
        double rps, gbps, csw_per_k;
        double wakes_per_k, sleeps_per_k; /* ring rows: doorbell futex wakes and waits */
        double full_per_k;                /* ring rows: claims refused, ring full */
        uint64_t records;
        double secs;
};

struct lat_row {
        int mech;
        uint32_t size;
        double p50, p99, mean, min; /* microseconds */
        double wake_p50, user_p50;  /* where a round trip goes (STAMPS), or -1 */
        double sleeps_per_rt;       /* voluntary context switches, both sides */
        double wakes_per_rt;        /* ring only: futex wakes issued */
};

static struct tput_row trows[M_COUNT * MAX_SIZES];
static struct lat_row lrows[M_COUNT * MAX_SIZES];
static unsigned ntrows, nlrows;

static int cmp_u64(const void *a, const void *b)
{
        uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
        return x < y ? -1 : x > y;
}

static const struct tput_row *find_t(int mech, uint32_t size)
{
        for (unsigned i = 0; i < ntrows; i++)
                if (trows[i].mech == mech && trows[i].size == size)
                        return &trows[i];
        return NULL;
}

static const struct lat_row *find_l(int mech, uint32_t size)
{
        for (unsigned i = 0; i < nlrows; i++)
                if (lrows[i].mech == mech && lrows[i].size == size)
                        return &lrows[i];
        return NULL;
}

static int bench_tput(int mech, uint32_t size)
{
        struct run r = {.mech = mech, .size = size};
        int rc = setup(&r, false);
        if (rc == 0)
                rc = run_one(&r, false);
        if (rc == 0) {
                struct tput_row *t = &trows[ntrows++];
                t->mech = mech;
                t->size = size;
                t->records = r.sink.next;
                t->secs = (double)(r.t_end - sh->t_start) / 1e9;
                t->rps = (double)t->records / t->secs;
                t->gbps = t->rps * size / 1e9;
                double k = (double)(t->records ? t->records : 1) / 1000.0;
                t->csw_per_k = (double)r.nvcsw / k;
                t->wakes_per_k = t->sleeps_per_k = t->full_per_k = -1;
                if (mech == M_RING || mech == M_RING_BATCH) {
                        t->wakes_per_k = (double)r.ring->bell->wakes / k;
                        t->sleeps_per_k = (double)r.ring->bell->sleeps / k;
                        t->full_per_k = (double)r.ring->hdr->full_events / k;
                }
        } else {
                kvf_err_ctx(rc, "throughput, %s, %u B", mechs[mech].name, size);
        }
        teardown(&r);
        return rc;
}

/*
 * Latency rows are measured interleaved: the round trips are split into
 * --blocks blocks, and in each block every selected mechanism runs its share
 * (a fresh fork, a short warm-up), starting from a different mechanism each
 * block. A shared, noisy machine drifts over seconds (another guest, the
 * host's frequency); run one after another, whole rows would each see a
 * different machine, and their ratio would mostly measure the drift.
 */
struct lat_acc {
        int mech;
        uint64_t *lat, *wake, *user; /* o.rounds samples each */
        unsigned n;
        uint64_t trips, nvcsw, wakes;
};

static int lat_block(struct lat_acc *a, uint32_t size, unsigned rounds, unsigned warmup)
{
        struct run r = {.mech = a->mech, .size = size, .rounds = rounds, .warmup = warmup};
        size_t stamp_bytes = ((size_t)rounds + warmup) * STAMPS * sizeof(uint64_t);
        r.lat = a->lat + a->n;
        r.wake = a->wake + a->n;
        r.user = a->user + a->n;
        r.stamps = mmap(NULL, stamp_bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
        if (r.stamps == MAP_FAILED)
                return kvf_err_set(-errno, "map time stamps: %s", strerror(errno));
        int rc = setup(&r, true);
        if (rc == 0)
                rc = run_one(&r, true);
        if (rc == 0) {
                a->n += rounds;
                a->trips += (uint64_t)rounds + warmup;
                a->nvcsw += r.nvcsw;
                if (r.ring)
                        a->wakes += r.ring->bell->wakes + r.ring_back->bell->wakes;
        } else {
                kvf_err_ctx(rc, "latency, %s, %u B", mechs[a->mech].name, size);
        }
        teardown(&r);
        munmap(r.stamps, stamp_bytes);
        return rc;
}

/* Median of the non-zero samples (zero: that round trip had a side that never slept). */
static double p50_nonzero(uint64_t *v, unsigned n)
{
        unsigned k = 0;
        for (unsigned i = 0; i < n; i++)
                if (v[i])
                        v[k++] = v[i];
        if (!k)
                return -1;
        qsort(v, k, sizeof(uint64_t), cmp_u64);
        return (double)v[k / 2] / 1e3;
}

static void lat_summarize(const struct lat_acc *a, uint32_t size)
{
        struct lat_row *l = &lrows[nlrows++];
        double sum = 0;

        for (unsigned i = 0; i < a->n; i++)
                sum += (double)a->lat[i];
        qsort(a->lat, a->n, sizeof(uint64_t), cmp_u64);
        l->mech = a->mech;
        l->size = size;
        l->min = (double)a->lat[0] / 1e3;
        l->p50 = (double)a->lat[a->n / 2] / 1e3;
        l->p99 = (double)a->lat[(size_t)((double)a->n * 0.99)] / 1e3;
        l->mean = sum / a->n / 1e3;
        l->wake_p50 = p50_nonzero(a->wake, a->n);
        l->user_p50 = p50_nonzero(a->user, a->n);
        l->sleeps_per_rt = (double)a->nvcsw / (double)a->trips;
        l->wakes_per_rt = a->mech == M_RING || a->mech == M_RING_UNTIMED
                              ? (double)a->wakes / (double)a->trips
                              : -1;
}

static int bench_lat(uint32_t size)
{
        struct lat_acc acc[M_COUNT];
        unsigned nacc = 0;
        unsigned blocks = o.blocks < o.rounds ? o.blocks : (o.rounds ? o.rounds : 1);
        int rc = 0;

        for (int m = 0; m < M_COUNT; m++) {
                if (!mechs[m].lat_what || !selected(m))
                        continue;
                size_t n = o.rounds ? o.rounds : 1;
                struct lat_acc *a = &acc[nacc++]; /* counted now: freed below whatever fails */
                *a = (struct lat_acc){.mech = m};
                a->lat = calloc(n, sizeof(uint64_t));
                a->wake = calloc(n, sizeof(uint64_t));
                a->user = calloc(n, sizeof(uint64_t));
                if (!a->lat || !a->wake || !a->user) {
                        rc = kvf_err_set(-ENOMEM, "latency samples");
                        goto out;
                }
        }
        for (unsigned b = 0; b < blocks && rc == 0; b++) {
                /* The last block takes the remainder. */
                unsigned rounds = o.rounds / blocks + (b == blocks - 1 ? o.rounds % blocks : 0);
                unsigned warmup = o.warmup / blocks;
                for (unsigned k = 0; k < nacc && rc == 0; k++)
                        rc = lat_block(&acc[(b + k) % nacc], size, rounds, warmup);
        }
        for (unsigned k = 0; k < nacc && rc == 0 && o.rounds; k++) {
                lat_summarize(&acc[k], size);
                if (!o.json)
                        fprintf(stderr, "  latency    %-12s %5u B: p50 %.2f us\n",
                                mechs[acc[k].mech].name, size, lrows[nlrows - 1].p50);
        }
out:
        for (unsigned k = 0; k < nacc; k++) {
                free(acc[k].lat);
                free(acc[k].wake);
                free(acc[k].user);
        }
        return rc;
}

static void size_name(uint32_t size, char *buf, size_t n)
{
        if (size >= 1024 && size % 1024 == 0)
                snprintf(buf, n, "%u KiB", size / 1024);
        else
                snprintf(buf, n, "%u B", size);
}

static void cpu_model(char *buf, size_t n)
{
        FILE *f = fopen("/proc/cpuinfo", "r");
        char line[512];

        snprintf(buf, n, "unknown");
        if (!f)
                return;
        while (fgets(line, sizeof(line), f)) {
                if (!strncmp(line, "model name", 10)) {
                        char *v = strchr(line, ':');
                        if (v) {
                                v += 1 + (v[1] == ' ');
                                v[strcspn(v, "\n")] = 0;
                                snprintf(buf, n, "%s", v);
                        }
                        break;
                }
        }
        fclose(f);
}

/* The 1-minute load average: says how busy the machine was while we measured. */
static double loadavg(void)
{
        double l = -1;
        FILE *f = fopen("/proc/loadavg", "r");
        if (f) {
                if (fscanf(f, "%lf", &l) != 1)
                        l = -1;
                fclose(f);
        }
        return l;
}

static double load_start;

static double ratio(double a, double b)
{
        return b > 0 ? a / b : 0;
}

/* "-" when the reference row was not measured in this run. */
static void fmt_ratio(char *buf, size_t n, double r)
{
        if (r < 0)
                snprintf(buf, n, "-");
        else
                snprintf(buf, n, "%.2fx", r);
}

static void print_text(const char *model, const struct utsname *u)
{
        char sz[16];

        printf("kvf-bench-ring %s: %ld CPUs online, %s, Linux %s; producer/responder on CPU %d, "
               "consumer/initiator on CPU %d\n",
               BENCH_VERSION, sysconf(_SC_NPROCESSORS_ONLN), model, u->release, o.cpu[0], o.cpu[1]);
        printf("buffers %" PRIu64 " bytes each; consumer spins %u; ring read-max %u; batch %u; "
               "load average %.2f before, %.2f after\n\n",
               o.capacity, o.spins, o.read_max, o.batch, load_start, loadavg());
        if (ntrows) {
                if (o.count)
                        printf("Throughput (%" PRIu64 " records per row; ratios against the rows "
                               "measured in this run)\n",
                               o.count);
                else
                        printf("Throughput (%.1f s per row; ratios against the rows measured in "
                               "this run)\n",
                               o.duration);
                printf("%-11s %-7s %14s %8s %9s %11s %9s %9s %9s %9s\n", "mechanism", "size",
                       "records/s", "GB/s", "x pipe", "x pipe-bulk", "ctxsw/1k", "wakes/1k",
                       "sleeps/1k", "full/1k");
                for (unsigned i = 0; i < ntrows; i++) {
                        const struct tput_row *t = &trows[i];
                        const struct tput_row *p = find_t(M_PIPE, t->size);
                        const struct tput_row *b = find_t(M_PIPE_BULK, t->size);
                        char xp[16], xb[16], wk[16] = "-", sl[16] = "-", fu[16] = "-";
                        fmt_ratio(xp, sizeof(xp), p ? ratio(t->rps, p->rps) : -1);
                        fmt_ratio(xb, sizeof(xb), b ? ratio(t->rps, b->rps) : -1);
                        if (t->wakes_per_k >= 0) {
                                snprintf(wk, sizeof(wk), "%.2f", t->wakes_per_k);
                                snprintf(sl, sizeof(sl), "%.2f", t->sleeps_per_k);
                                snprintf(fu, sizeof(fu), "%.1f", t->full_per_k);
                        }
                        size_name(t->size, sz, sizeof(sz));
                        printf("%-11s %-7s %14.0f %8.3f %9s %11s %9.2f %9s %9s %9s\n",
                               mechs[t->mech].name, sz, t->rps, t->gbps, xp, xb, t->csw_per_k, wk,
                               sl, fu);
                }
                printf("\n");
        }
        if (nlrows) {
                printf(
                    "Wake latency: round trip, receiver asleep (%u round trips after %u warm-up, "
                    "%u us busy gap before each ping; mechanisms interleaved in %u blocks; "
                    "scheduler slice %s; %u spinning processes beside)\n",
                    o.rounds, o.warmup, o.gap_us, o.blocks, slice_note, o.hogs);
                printf("%-13s %-7s %9s %9s %9s %9s %12s %9s %9s %9s %9s\n", "mechanism", "size",
                       "min us", "p50 us", "p99 us", "mean us", "p50/pipe p50", "wake us", "user us",
                       "sleeps/RT", "wakes/RT");
                for (unsigned i = 0; i < nlrows; i++) {
                        const struct lat_row *l = &lrows[i];
                        const struct lat_row *p = find_l(M_PIPE, l->size);
                        char wk[16] = "-";
                        if (l->wakes_per_rt >= 0)
                                snprintf(wk, sizeof(wk), "%.2f", l->wakes_per_rt);
                        size_name(l->size, sz, sizeof(sz));
                        char xp[16];
                        fmt_ratio(xp, sizeof(xp), p ? ratio(l->p50, p->p50) : -1);
                        printf("%-13s %-7s %9.2f %9.2f %9.2f %9.2f %12s %9.2f %9.2f %9.2f %9s\n",
                               mechs[l->mech].name, sz, l->min, l->p50, l->p99, l->mean, xp,
                               l->wake_p50, l->user_p50, l->sleeps_per_rt, wk);
                }
                printf("\n");
        }
        printf("What each row does:\n");
        for (int m = 0; m < M_COUNT; m++) {
                if (!selected(m))
                        continue;
                if (mechs[m].tput_what && !o.no_tput)
                        printf("  %-13s throughput: %s\n", mechs[m].name, mechs[m].tput_what);
                if (mechs[m].lat_what && !o.no_lat)
                        printf("  %-13s latency:    %s\n", mechs[m].name, mechs[m].lat_what);
        }
        printf("  consumers check the sequence number in the first and last 8 bytes of every "
               "record and sum every 8-byte word of it.\n");
        printf("  ctxsw/1k: voluntary context switches of both processes per 1000 records; "
               "wakes/1k, sleeps/1k: doorbell futex wakes and waits;\n"
               "  full/1k: claims refused because the ring was full (the consumer was the "
               "bottleneck when this is high).\n");
        printf("  sleeps/RT: voluntary context switches of both processes per round trip (2 = "
               "each side slept once); wakes/RT: futex wakes the doorbell issued.\n"
               "  wake us, user us: p50 over round trips of the two wake-ups (send call to the "
               "receiver's return from its\n"
               "  blocking call: futex wait, read, recv) and of the two receivers' own work "
               "after that return.\n\n");

        const struct tput_row *rt = find_t(M_RING, 64), *pt = find_t(M_PIPE, 64);
        const struct lat_row *rl = find_l(M_RING, 64), *pl = find_l(M_PIPE, 64);
        if (rt && pt)
                printf("target: 64 B ring (per-record commit) >= 20x pipe records/s: %.1fx, %s\n",
                       ratio(rt->rps, pt->rps), rt->rps >= 20 * pt->rps ? "met" : "MISSED");
        if (rl && pl)
                printf(
                    "target: 64 B ring wake round trip p50 <= pipe p50: %.2f us vs %.2f us, %s\n",
                    rl->p50, pl->p50, rl->p50 <= pl->p50 ? "met" : "MISSED");
}

static void print_json(const char *model, const struct utsname *u)
{
        printf(
            "{\"version\":\"%s\",\"nproc\":%ld,\"cpu\":\"%s\",\"kernel\":\"%s\",\"cpus\":[%d,%d],"
            "\"capacity\":%" PRIu64 ",\"spins\":%u,\"read_max\":%u,\"batch\":%u,"
            "\"duration_s\":%.3f,\"count\":%" PRIu64 ",\"loadavg_before\":%.2f,"
            "\"loadavg_after\":%.2f,\"slice_us\":%u,\"hogs\":%u,\n \"throughput\":[",
            BENCH_VERSION, sysconf(_SC_NPROCESSORS_ONLN), model, u->release, o.cpu[0], o.cpu[1],
            o.capacity, o.spins, o.read_max, o.batch, o.count ? 0.0 : o.duration, o.count,
            load_start, loadavg(), o.slice_us, o.hogs);
        for (unsigned i = 0; i < ntrows; i++) {
                const struct tput_row *t = &trows[i];
                const struct tput_row *p = find_t(M_PIPE, t->size);
                const struct tput_row *b = find_t(M_PIPE_BULK, t->size);
                printf("%s\n  {\"mechanism\":\"%s\",\"size\":%u,\"records\":%" PRIu64
                       ",\"seconds\":%.6f,\"records_per_s\":%.0f,\"gb_per_s\":%.4f,"
                       "\"x_pipe\":%.3f,\"x_pipe_bulk\":%.3f,\"ctxsw_per_1k\":%.3f,"
                       "\"wakes_per_1k\":%.3f,\"sleeps_per_1k\":%.3f,\"full_per_1k\":%.3f}",
                       i ? "," : "", mechs[t->mech].name, t->size, t->records, t->secs, t->rps,
                       t->gbps, p ? ratio(t->rps, p->rps) : 0, b ? ratio(t->rps, b->rps) : 0,
                       t->csw_per_k, t->wakes_per_k, t->sleeps_per_k, t->full_per_k);
        }
        printf("],\n \"latency\":[");
        for (unsigned i = 0; i < nlrows; i++) {
                const struct lat_row *l = &lrows[i];
                const struct lat_row *p = find_l(M_PIPE, l->size);
                printf("%s\n  {\"mechanism\":\"%s\",\"size\":%u,\"rounds\":%u,\"min_us\":%.3f,"
                       "\"p50_us\":%.3f,\"p99_us\":%.3f,\"mean_us\":%.3f,\"p50_x_pipe\":%.3f,"
                       "\"wake_p50_us\":%.3f,\"user_p50_us\":%.3f,"
                       "\"sleeps_per_rt\":%.3f,\"wakes_per_rt\":%.3f}",
                       i ? "," : "", mechs[l->mech].name, l->size, o.rounds, l->min, l->p50, l->p99,
                       l->mean, p ? ratio(l->p50, p->p50) : 0, l->wake_p50, l->user_p50,
                       l->sleeps_per_rt, l->wakes_per_rt);
        }
        printf("]}\n");
}

/* ------------------------------------------------------------------ */
/* command line                                                        */

static void usage(FILE *f)
{
        fprintf(
            f,
            "Usage: kvf-bench-ring [OPTION]...\n"
            "Measure the kvferry SPSC ring against a pipe, eventfd + shared memory and a Unix\n"
            "socket between two pinned processes: throughput and wake-up round trip.\n"
            "Every figure comes with the pipe measured in the same run, and the ratio.\n"
            "\n"
            "  --duration SEC      seconds per throughput row (default 2)\n"
            "  --count N           exactly N records per throughput row instead\n"
            "  --rounds N          measured round trips per latency row (default 20000)\n"
            "  --warmup N          round trips before measuring (default 1000, spread\n"
            "                      over the blocks)\n"
            "  --blocks N          latency rows run interleaved: each mechanism runs its\n"
            "                      share of the round trips in each of N blocks, a fresh\n"
            "                      pair of processes each time (default 20)\n"
            "  --gap-us N          initiator busy-waits N us before each ping, so the\n"
            "                      responder is asleep (default 20)\n"
            "  --sizes LIST        payload bytes, comma-separated, %u..%u (default 64,4096)\n"
            "  --only LIST         mechanisms: ring,ring-batch,ring-untimed,pipe,pipe-bulk,\n"
            "                      pipe-timed,eventfd,unix\n"
            "                      (ratios need pipe and pipe-bulk)\n"
            "  --spins N           throughput consumers poll N times before sleeping (default 64)\n"
            "  --batch N           ring-batch: records per notify (default 32)\n"
            "  --read-max N        ring consumer: records per kvf_ring_read (default 256)\n"
            "  --capacity BYTES    ring, pipe and shm buffer size, power of two (default 1048576)\n"
            "  --cpus A,B          CPU of the producer/responder and of the consumer/initiator\n"
            "                      (default: the first two allowed CPUs)\n"
            "  --no-pin            do not pin\n"
            "  --no-throughput     skip the throughput rows\n"
            "  --no-latency        skip the latency rows\n"
            "  --slice-us N        ask the scheduler for an N us slice for both processes, as\n"
            "                      kvferry's roles do (100 to 100000; default: the kernel's)\n"
            "  --hogs N            N processes spin beside the pair (a busy host; default 0)\n"
            "  --json              one JSON object on stdout instead of the table\n"
            "  --help, --version\n"
            "\n"
            "Exit status: 0 measured; 1 a run failed or a record was lost, torn or out of\n"
            "order; 2 bad usage.\n",
            MIN_SIZE, MAX_SIZE);
}

static bool parse_u64(const char *s, uint64_t *out)
{
        char *end;
        errno = 0;
        unsigned long long v = strtoull(s, &end, 0);
        if (errno || end == s || *end || s[0] == '-')
                return false;
        *out = v;
        return true;
}

static bool parse_uint(const char *s, unsigned max, unsigned *out)
{
        uint64_t v;
        if (!parse_u64(s, &v) || v > max)
                return false;
        *out = (unsigned)v;
        return true;
}

static int parse_args(int argc, char **argv)
{
        enum {
                O_DURATION = 256,
                O_COUNT,
                O_ROUNDS,
                O_WARMUP,
                O_GAP,
                O_BLOCKS,
                O_SIZES,
                O_ONLY,
                O_SPINS,
                O_BATCH,
                O_READMAX,
                O_CAPACITY,
                O_CPUS,
                O_NOPIN,
                O_NOTPUT,
                O_NOLAT,
                O_JSON,
                O_SLICE,
                O_HOGS,
                O_HELP,
                O_VERSION
        };
        static const struct option lo[] = {
            {"duration", required_argument, 0, O_DURATION},
            {"count", required_argument, 0, O_COUNT},
            {"rounds", required_argument, 0, O_ROUNDS},
            {"warmup", required_argument, 0, O_WARMUP},
            {"gap-us", required_argument, 0, O_GAP},
            {"blocks", required_argument, 0, O_BLOCKS},
            {"sizes", required_argument, 0, O_SIZES},
            {"only", required_argument, 0, O_ONLY},
            {"spins", required_argument, 0, O_SPINS},
            {"batch", required_argument, 0, O_BATCH},
            {"read-max", required_argument, 0, O_READMAX},
            {"capacity", required_argument, 0, O_CAPACITY},
            {"cpus", required_argument, 0, O_CPUS},
            {"no-pin", no_argument, 0, O_NOPIN},
            {"no-throughput", no_argument, 0, O_NOTPUT},
            {"no-latency", no_argument, 0, O_NOLAT},
            {"slice-us", required_argument, 0, O_SLICE},
            {"hogs", required_argument, 0, O_HOGS},
            {"json", no_argument, 0, O_JSON},
            {"help", no_argument, 0, O_HELP},
            {"version", no_argument, 0, O_VERSION},
            {0, 0, 0, 0},
        };
        int c;
        uint64_t v;

        while ((c = getopt_long(argc, argv, "h", lo, NULL)) != -1) {
                switch (c) {
                case O_DURATION: {
                        char *end;
                        o.duration = strtod(optarg, &end);
                        if (*end || !(o.duration > 0 && o.duration <= 600))
                                goto bad;
                        break;
                }
                case O_COUNT:
                        if (!parse_u64(optarg, &o.count) || o.count == 0 || o.count == END_SEQ)
                                goto bad;
                        break;
                case O_ROUNDS:
                        if (!parse_uint(optarg, 100000000u, &o.rounds))
                                goto bad;
                        break;
                case O_WARMUP:
                        if (!parse_uint(optarg, 100000000u, &o.warmup))
                                goto bad;
                        break;
                case O_GAP:
                        if (!parse_uint(optarg, 1000000u, &o.gap_us))
                                goto bad;
                        break;
                case O_SLICE:
                        if (!parse_uint(optarg, KVF_SLICE_US_MAX, &o.slice_us) ||
                            (o.slice_us && o.slice_us < KVF_SLICE_US_DEFAULT))
                                goto bad;
                        break;
                case O_HOGS:
                        if (!parse_uint(optarg, MAX_HOGS, &o.hogs))
                                goto bad;
                        break;
                case O_BLOCKS:
                        if (!parse_uint(optarg, 100000u, &o.blocks) || !o.blocks)
                                goto bad;
                        break;
                case O_SIZES: {
                        o.nsizes = 0;
                        char *s = optarg;
                        for (char *tok = strtok(s, ","); tok; tok = strtok(NULL, ",")) {
                                if (o.nsizes == MAX_SIZES || !parse_u64(tok, &v) || v < MIN_SIZE ||
                                    v > MAX_SIZE || v % 8)
                                        goto bad;
                                o.sizes[o.nsizes++] = (uint32_t)v;
                        }
                        if (!o.nsizes)
                                goto bad;
                        break;
                }
                case O_ONLY:
                        snprintf(o.only, sizeof(o.only), "%s", optarg);
                        break;
                case O_SPINS:
                        if (!parse_uint(optarg, 100000000u, &o.spins))
                                goto bad;
                        break;
                case O_BATCH:
                        if (!parse_uint(optarg, 1000000u, &o.batch) || !o.batch)
                                goto bad;
                        break;
                case O_READMAX:
                        if (!parse_uint(optarg, 1000000u, &o.read_max) || !o.read_max)
                                goto bad;
                        break;
                case O_CAPACITY:
                        if (!parse_u64(optarg, &o.capacity) || !kvf_ring_capacity_ok(o.capacity) ||
                            o.capacity > (1u << 26))
                                goto bad;
                        break;
                case O_CPUS: {
                        char *comma = strchr(optarg, ',');
                        unsigned a, b;
                        if (!comma)
                                goto bad;
                        *comma = 0;
                        if (!parse_uint(optarg, CPU_SETSIZE - 1, &a) ||
                            !parse_uint(comma + 1, CPU_SETSIZE - 1, &b))
                                goto bad;
                        o.cpu[0] = (int)a;
                        o.cpu[1] = (int)b;
                        break;
                }
                case O_NOPIN:
                        o.cpu[0] = o.cpu[1] = -1;
                        break;
                case O_NOTPUT:
                        o.no_tput = true;
                        break;
                case O_NOLAT:
                        o.no_lat = true;
                        break;
                case O_JSON:
                        o.json = true;
                        break;
                case 'h':
                case O_HELP:
                        usage(stdout);
                        exit(0);
                case O_VERSION:
                        printf("kvf-bench-ring %s\n", BENCH_VERSION);
                        exit(0);
                default:
                        goto usage;
                }
        }
        if (optind != argc)
                goto usage;
        for (unsigned i = 0; i < o.nsizes; i++)
                if (kvf_ring_align((uint64_t)KVF_REC_HDR_SIZE + o.sizes[i]) > o.capacity / 2) {
                        fprintf(stderr,
                                "kvf-bench-ring: --sizes %u does not fit twice in a "
                                "%" PRIu64 "-byte buffer; raise --capacity\n",
                                o.sizes[i], o.capacity);
                        return -EINVAL;
                }
        if (o.cpu[0] == -2) {
                /* The first two CPUs we may run on; one CPU: no pinning. */
                cpu_set_t set;
                o.cpu[0] = o.cpu[1] = -1;
                if (sched_getaffinity(0, sizeof(set), &set) == 0 && CPU_COUNT(&set) >= 2) {
                        for (int i = 0, k = 0; i < CPU_SETSIZE && k < 2; i++)
                                if (CPU_ISSET(i, &set))
                                        o.cpu[k++] = i;
                }
        }
        return 0;
bad:
        fprintf(stderr, "kvf-bench-ring: bad value '%s' for --%s\n", optarg,
                lo[c - O_DURATION].name);
        return -EINVAL;
usage:
        usage(stderr);
        return -EINVAL;
}

int main(int argc, char **argv)
{
        /* As kvferry's roles do: before any thread exists (dense mode needs it; doorbell.h). */
        (void)kvf_doorbell_register();
        struct utsname u;
        char model[128];
        int rc = 0;

        if (parse_args(argc, argv) < 0)
                return 2;
        uname(&u);
        cpu_model(model, sizeof(model));
        load_start = loadavg();
        sh = mmap(NULL, sizeof(*sh), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
        if (sh == MAP_FAILED) {
                fprintf(stderr, "kvf-bench-ring: map shared page: %s\n", strerror(errno));
                return 1;
        }
        snprintf(inst, sizeof(inst), "bench-ring-%d", (int)getpid());
        atexit(cleanup);
        signal(SIGINT, on_signal);
        signal(SIGTERM, on_signal);
        signal(SIGALRM, on_signal);
        signal(SIGPIPE, SIG_IGN);
        if (o.hogs && start_hogs() < 0) {
                fprintf(stderr, "kvf-bench-ring: fork: %s\n", strerror(errno));
                return 1;
        }
        if (o.slice_us) { /* after the hogs: they keep the kernel's default */
                int got = kvf_sched_slice(o.slice_us);
                if (got <= 0) {
                        fprintf(stderr, "kvf-bench-ring: --slice-us: %s\n",
                                got < 0 ? kvf_err_msg() : "not under SCHED_OTHER");
                        return 1;
                }
                snprintf(slice_note, sizeof(slice_note), "%d us", got);
        }

        for (unsigned s = 0; s < o.nsizes && rc == 0 && !o.no_tput; s++)
                for (int m = 0; m < M_COUNT && rc == 0; m++)
                        if (mechs[m].tput_what && selected(m)) {
                                rc = bench_tput(m, o.sizes[s]);
                                if (!o.json && rc == 0)
                                        fprintf(stderr,
                                                "  throughput %-10s %5u B: %.0f records/s\n",
                                                mechs[m].name, o.sizes[s], trows[ntrows - 1].rps);
                        }
        for (unsigned s = 0; s < o.nsizes && rc == 0 && !o.no_lat; s++)
                rc = bench_lat(o.sizes[s]);
        if (rc < 0) {
                fprintf(stderr, "kvf-bench-ring: %s\n", kvf_err_msg());
                return 1;
        }
        if (o.json)
                print_json(model, &u);
        else
                print_text(model, &u);
        return 0;
}

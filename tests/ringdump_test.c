/*
 * kvf-ringdump, the real binary (path in argv[1]), against real segments:
 * text and JSON output of a segment with records of every kind (decodable,
 * garbage, unknown type, claimed and uncommitted, behind a padding record),
 * role slots, the error log, counters and request slots; proof that it does
 * not write; copies that are truncated, corrupt or hostile (each must exit
 * with its code and a specific message, never crash); usage errors; --all
 * (in a /dev/shm of its own, so that its exit status is exact); --watch
 * until SIGINT.
 *
 * JSON is checked with /usr/bin/python3 and its json module: required, as
 * `tools/kvferry setup` installs it (without it this test fails, it does not
 * pass unchecked). Every child runs under a time limit and only children we
 * started are killed.
 */
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <sched.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>

#include "check.h"
#include "atomics.h"
#include "clock.h"
#include "ctl.h"
#include "records.h"
#include "ring.h"

#define PYTHON "/usr/bin/python3"
#define RUN_LIMIT_MS 20000

static const char *tool;
static char inst[64];
static char tmpdir[64];
static char segpath[128];

static void cleanup(void)
{
        kvf_ctl_unlink(inst);
        if (tmpdir[0]) {
                char cmd[128];
                snprintf(cmd, sizeof(cmd), "rm -rf '%s'", tmpdir);
                if (system(cmd) != 0)
                        fprintf(stderr, "could not remove %s\n", tmpdir);
        }
}

/* ---- running children ---- */

struct result {
        int code; /* exit status, or 128 + signal */
        char *out, *err;
        size_t outlen;
};

static char *slurp(const char *path, size_t *len)
{
        FILE *f = fopen(path, "rb");
        CHECK(f);
        char *buf = NULL;
        size_t n = 0, cap = 0;
        for (;;) {
                if (n + 4096 + 1 > cap) {
                        cap = cap ? cap * 2 : 65536;
                        char *nb = realloc(buf, cap);
                        CHECK(nb);
                        buf = nb;
                }
                size_t got = fread(buf + n, 1, cap - n - 1, f);
                n += got;
                if (got == 0)
                        break;
        }
        fclose(f);
        buf[n] = '\0';
        if (len)
                *len = n;
        return buf;
}

static void result_free(struct result *r)
{
        free(r->out);
        free(r->err);
        memset(r, 0, sizeof(*r));
}

/* Run before exec in a child (prep_arg is its argument); false: exit PREP_FAILED instead. */
typedef bool (*prep_fn)(const void *prep_arg);
#define PREP_FAILED 125 /* no exit status of kvf-ringdump or python */

/* Run argv with stdin from in_path (or /dev/null); SIGINT after sigint_ms if > 0. */
static struct result run_argv_prep(char *const argv[], const char *in_path, int sigint_ms,
                                   prep_fn prep, const void *prep_arg)
{
        char outp[128], errp[128];
        struct result r = {0};

        snprintf(outp, sizeof(outp), "%s/out.txt", tmpdir);
        snprintf(errp, sizeof(errp), "%s/err.txt", tmpdir);
        pid_t pid = fork();
        CHECK(pid >= 0);
        if (pid == 0) {
                int in = open(in_path ? in_path : "/dev/null", O_RDONLY);
                int out = open(outp, O_WRONLY | O_CREAT | O_TRUNC, 0600);
                int err = open(errp, O_WRONLY | O_CREAT | O_TRUNC, 0600);
                if (in < 0 || out < 0 || err < 0)
                        _exit(126);
                dup2(in, 0);
                dup2(out, 1);
                dup2(err, 2);
                if (prep && !prep(prep_arg))
                        _exit(PREP_FAILED);
                execv(argv[0], argv);
                _exit(127);
        }
        uint64_t start = kvf_now_ns();
        bool sent = false;
        int st;
        for (;;) {
                pid_t w = waitpid(pid, &st, WNOHANG);
                CHECK(w >= 0);
                if (w == pid)
                        break;
                uint64_t ms = (kvf_now_ns() - start) / 1000000;
                if (sigint_ms > 0 && !sent && ms >= (uint64_t)sigint_ms) {
                        kill(pid, SIGINT);
                        sent = true;
                }
                if (ms > RUN_LIMIT_MS) {
                        kill(pid, SIGKILL);
                        waitpid(pid, &st, 0);
                        fprintf(stderr, "%s ran over %d ms\n", argv[0], RUN_LIMIT_MS);
                        exit(1);
                }
                kvf_sleep_ns(2000000);
        }
        r.code = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
        r.out = slurp(outp, &r.outlen);
        r.err = slurp(errp, NULL);
        return r;
}

static struct result run_argv(char *const argv[], const char *in_path, int sigint_ms)
{
        return run_argv_prep(argv, in_path, sigint_ms, NULL, NULL);
}

static struct result ringdump_v(prep_fn prep, const void *prep_arg, int sigint_ms, va_list ap)
{
        char *argv[32];
        int n = 0;

        argv[n++] = (char *)tool;
        for (char *a; (a = va_arg(ap, char *)) && n < 31;)
                argv[n++] = a;
        argv[n] = NULL;
        struct result r = run_argv_prep(argv, NULL, sigint_ms, prep, prep_arg);
        /* Under -DKVF_SANITIZE a report exits 1, which is also a real exit code here. */
        if (strstr(r.err, "Sanitizer") || strstr(r.err, "runtime error:")) {
                fprintf(stderr, "sanitizer report from %s %s %s:\n%s\n", tool,
                        argv[1] ? argv[1] : "", argv[1] && argv[2] ? argv[2] : "", r.err);
                exit(1);
        }
        return r;
}

/* kvf-ringdump with the given arguments (NULL-terminated). */
static struct result ringdump(int sigint_ms, ...)
{
        va_list ap;
        va_start(ap, sigint_ms);
        struct result r = ringdump_v(NULL, NULL, sigint_ms, ap);
        va_end(ap);
        return r;
}

#define EXPECT_CODE(r, want)                                                                       \
        do {                                                                                       \
                if ((r).code != (want)) {                                                          \
                        fprintf(stderr, "%s:%d: exit %d, expected %d\nstdout:\n%s\nstderr:\n%s\n", \
                                __FILE__, __LINE__, (r).code, (want), (r).out, (r).err);           \
                        exit(1);                                                                   \
                }                                                                                  \
        } while (0)

#define EXPECT_HAS(text, needle)                                                                   \
        do {                                                                                       \
                if (!strstr((text), (needle))) {                                                   \
                        fprintf(stderr, "%s:%d: output lacks \"%s\":\n%s\n", __FILE__, __LINE__,   \
                                (needle), (text));                                                 \
                        exit(1);                                                                   \
                }                                                                                  \
        } while (0)

#define EXPECT_LACKS(text, needle)                                                                 \
        do {                                                                                       \
                if (strstr((text), (needle))) {                                                    \
                        fprintf(stderr, "%s:%d: output has \"%s\":\n%s\n", __FILE__, __LINE__,     \
                                (needle), (text));                                                 \
                        exit(1);                                                                   \
                }                                                                                  \
        } while (0)

/* Run a python check script on the last stdout (out.txt), with one or two arguments (arg2 may be
 * NULL); it exits non-zero on failure. */
static void python_check(const char *script, const char *arg, const char *arg2)
{
        char inp[128];
        char *argv[] = {PYTHON, "-c", (char *)script, (char *)arg, (char *)arg2, NULL};

        /* The result's stdout is out.txt, which the python run overwrites: copy it first. */
        snprintf(inp, sizeof(inp), "%s/json.txt", tmpdir);
        char src[128];
        snprintf(src, sizeof(src), "%s/out.txt", tmpdir);
        CHECK(rename(src, inp) == 0);
        struct result r = run_argv(argv, inp, 0);
        if (r.code != 0) {
                fprintf(stderr, "JSON check failed (exit %d):\n%s\n%s\n", r.code, r.out, r.err);
                exit(1);
        }
        result_free(&r);
}

/* The JSON checks need /usr/bin/python3 with its json module: a test that passed without them
 * would have checked nothing of the JSON output. */
static void require_python(void)
{
        char *argv[] = {PYTHON, "-c", "import json; assert json.loads('[1]') == [1]", NULL};

        struct result r = run_argv(argv, NULL, 0);
        if (r.code != 0) {
                char why[32];
                snprintf(why, sizeof(why), r.code == 127 ? "not found" : "exit %d", r.code);
                fprintf(stderr,
                        "ringdump_test: %s with its json module is required for the JSON checks "
                        "(%s); `tools/kvferry setup` installs python3\n%s",
                        PYTHON, why, r.err);
                exit(1);
        }
        result_free(&r);
}

/* ---- the segment ---- */

static void write_record(struct kvf_ring *r, const struct kvf_record *rec)
{
        uint8_t *buf;
        size_t len;
        CHECK(kvf_record_encode_alloc(rec, &buf, &len) == 0);
        CHECK_EQ(kvf_ring_write(r, rec->type, buf, (uint32_t)len, NULL), 0);
        free(buf);
}

static int drop(void *ctx, uint16_t type, const uint8_t *p, uint32_t len, uint64_t pos)
{
        (void)ctx, (void)type, (void)p, (void)len, (void)pos;
        return 0;
}

static void build_segment(struct kvf_ctl *c)
{
        struct kvf_ctl_params p = {
            .instance = inst,
            .instance_role = KVF_IROLE_PREFILL,
            .layout = {.num_layers = 4,
                       .extra_layers = 1,
                       .num_blocks = 64,
                       .kv_heads = 2,
                       .block_size = 16,
                       .head_dim = 64,
                       .dtype = KVF_DTYPE_BF16,
                       .block_bytes = 4096,
                       .cache_bytes = 5ull * 2 * 64 * 4096},
            .backend = KVF_BACKEND_HOST,
            .rank = 1,
            .nranks = 2,
            .reqtab_slots = 4,
            .max_blocks = 16,
            .heartbeat_ms = 10000, /* alive for 100 s: no flakes on a slow machine */
        };
        for (int i = 0; i < KVF_RING_COUNT; i++)
                p.ring_capacity[i] = 4096;
        kvf_ctl_unlink(inst);
        CHECK(kvf_ctl_create(&p, c) == 0);
        kvf_ctl_publish(c);

        kvf_role_begin(c, KVF_ROLE_ALLOCATOR);
        kvf_role_begin(c, KVF_ROLE_SENDER);
        kvf_role_begin(c, KVF_ROLE_SENDER); /* a restart */
        kvf_role_begin(c, KVF_ROLE_CONNECTOR);
        c->roles[KVF_ROLE_CONNECTOR].pid = 0x7ffffff0; /* no such process: not alive */
        kvf_connector_info_write(c, "127.0.0.1", 7301);
        c->progress->word = KVF_PROGRESS_PACK(7, 3);
        c->progress->events = 10;
        kvf_count(c, KVF_CTR_TASKS_ACCEPTED, 5);
        kvf_count(c, KVF_CTR_BYTES_TCP, 123456);
        /* the sender's histograms: 100 copy starts of 1..100 us, one tail of 5 ms (a quantile
         * is its bucket's value, 8 buckets to an octave, never above the maximum) */
        for (uint64_t v = 1; v <= 100; v++)
                kvf_hist_add(&c->sender->hist[KVF_HIST_LAYER_TO_COPY], v * 1000);
        kvf_hist_add(&c->sender->hist[KVF_HIST_LAST_TO_DONE], 5000000);
        for (int i = 0; i < 2; i++)
                kvf_errlog(c, KVF_ROLE_SENDER, "peer %s said \"no\"\x01 then \xff\xfe",
                           "10.0.0.2:7000");
        kvf_errlog(c, KVF_ROLE_CONNECTOR, "listen on %s: %s", "0.0.0.0:7301", "address in use");

        /* engine->sender: a task, garbage, a chunk, an unknown type, a claimed record. */
        struct kvf_ring *es = &c->rings[KVF_RING_ENGINE_TO_SENDER];
        kvf_ring_producer_attach(es, 1);
        uint32_t src[] = {1, 2, 3}, dst[] = {4, 5, 6};
        struct kvf_record task = {.type = KVF_REC_TASK,
                                  .src = src,
                                  .n_src = 3,
                                  .dst = dst,
                                  .n_dst = 3,
                                  .current_id = 42,
                                  .transport = KVF_TRANSPORT_TCP};
        strcpy(task.request_id, "req-1");
        strcpy(task.peer, "10.0.0.2:7000");
        write_record(es, &task);
        CHECK_EQ(kvf_ring_write(es, KVF_REC_TASK, "\xc1 garbage", 9, NULL), 0);
        struct kvf_record chunk = {
            .type = KVF_REC_CHUNK, .current_id = 43, .tokens = 48, .last = true};
        strcpy(chunk.request_id, "req-1");
        write_record(es, &chunk);
        CHECK_EQ(kvf_ring_write(es, 77, "hello", 5, NULL), 0);
        void *pl;
        uint64_t pos;
        CHECK_EQ(kvf_ring_claim(es, KVF_REC_CANCEL, 16, &pl, &pos), 0);

        /* sender->engine: a completion whose reason has quotes. */
        struct kvf_ring *se = &c->rings[KVF_RING_SENDER_TO_ENGINE];
        kvf_ring_producer_attach(se, 1);
        struct kvf_record comp = {.type = KVF_REC_COMPLETION, .status = KVF_STATUS_BAD_TASK};
        strcpy(comp.request_id, "req-0");
        strcpy(comp.reason, "src_block_ids[2] = 99 is \"out\" of range");
        write_record(se, &comp);

        /* connector->engine: consumed records up to near the end, then an
         * arrival that does not fit there: padding, then the record at 0. */
        struct kvf_ring *ce = &c->rings[KVF_RING_CONNECTOR_TO_ENGINE];
        kvf_ring_producer_attach(ce, 1);
        uint8_t fill[56] = {0};
        for (int i = 0; i < 60; i++)
                CHECK_EQ(kvf_ring_write(ce, 200, fill, sizeof(fill), NULL), 0);
        CHECK_EQ(kvf_ring_read(ce, drop, NULL, 1000), 60);
        struct kvf_record arr = {
            .type = KVF_REC_ARRIVAL, .status = KVF_STATUS_FINISHED, .bytes = 4096, .blocks = 1};
        strcpy(arr.request_id, "req-9");
        strcpy(arr.peer, "p-prefill");
        strcpy(arr.reason, "padding-before-me");
        memset(arr.reason + 17, 'x', 200);
        arr.reason[217] = '\0';
        write_record(ce, &arr);
        CHECK(ce->hdr->tail > 4096);

        /* The request table. */
        struct kvf_req_slot *s = &c->reqtab[0];
        s->state = KVF_REQ_ACTIVE;
        strcpy(s->request_id, "req-1");
        strcpy(s->peer, "10.0.0.2:7000");
        s->transport = KVF_TRANSPORT_TCP;
        s->n_src = s->n_send = 3;
        s->sent_full = 1;
        s->bytes = 8192;
        s->accept_ns = kvf_now_ns() - 1500000000ull;
        s->xfer_start_ns = s->accept_ns + 200000000ull;
        s->descs = 7;
        s->incarnation = 1;
        /* The sender's histograms: finished transfers of 64 KiB, 64 KiB and 1 MiB. */
        kvf_hist_add_size(&c->sender->hist[KVF_HIST_REQ_BYTES], 65536);
        kvf_hist_add_size(&c->sender->hist[KVF_HIST_REQ_BYTES], 65536);
        kvf_hist_add_size(&c->sender->hist[KVF_HIST_REQ_BYTES], 1048576);
        kvf_hist_add_size(&c->sender->hist[KVF_HIST_REQ_DESCS], 64);
        kvf_hist_add_size(&c->sender->hist[KVF_HIST_REQ_DESCS], 64);
        s = &c->reqtab[2];
        s->state = KVF_REQ_COMPLETING;
        s->status = KVF_STATUS_BAD_TASK;
        strcpy(s->request_id, "weird\"id\\\x1b[31m\xff"); /* a quote, a backslash, ESC, a byte not UTF-8 */
        s->flags = KVF_REQF_ID_BIN;
        strcpy(s->reason, "bad");
}

/* ---- copies ---- */

static uint8_t *seg_bytes(size_t *len)
{
        return (uint8_t *)slurp(segpath, len);
}

static const char *write_copy(const char *name, const uint8_t *b, size_t len)
{
        static char path[160];
        snprintf(path, sizeof(path), "%s/%s", tmpdir, name);
        FILE *f = fopen(path, "wb");
        CHECK(f);
        CHECK(fwrite(b, 1, len, f) == len);
        CHECK(fclose(f) == 0);
        return path;
}

#define HDR(b) ((struct kvf_ctl_header *)(void *)(b))

static struct kvf_ring_hdr *ring_hdr(uint8_t *b, int i)
{
        return (struct kvf_ring_hdr *)(void *)(b + HDR(b)->rings_off) + i;
}

static uint64_t rnd_state = 0x9e3779b97f4a7c15ull;
static uint8_t rnd(void)
{
        rnd_state ^= rnd_state << 13;
        rnd_state ^= rnd_state >> 7;
        rnd_state ^= rnd_state << 17;
        return (uint8_t)rnd_state;
}

static void random_ring_data(uint8_t *b)
{
        struct kvf_ring_hdr *rh = ring_hdr(b, 0);
        rh->head = 0;
        rh->tail = rh->capacity;
        for (uint64_t i = 0; i < rh->capacity; i++)
                b[rh->data_off + i] = rnd();
}

static void random_reqtab(uint8_t *b)
{
        for (size_t i = 0; i < 4 * sizeof(struct kvf_req_slot); i++)
                b[HDR(b)->reqtab_off + i] = rnd() | 1; /* odd state: never free */
}

static void random_errlog(uint8_t *b)
{
        struct kvf_errlog_entry *e = (struct kvf_errlog_entry *)(void *)(b + HDR(b)->errlog_off);
        for (size_t i = 0; i < KVF_ROLE_COUNT * KVF_ERRLOG_ENTRIES; i++) {
                for (size_t k = 0; k < sizeof(*e); k++)
                        ((uint8_t *)&e[i])[k] = rnd();
                e[i].seq &= ~1u; /* even: readable */
        }
}

static void random_roles(uint8_t *b)
{
        /* Role slots, doorbells and progress are adjacent, then the connector info. */
        uint64_t from = HDR(b)->roles_off, to = HDR(b)->connector_info_off + 64;
        for (uint64_t i = from; i < to; i++)
                b[i] = rnd();
        *(uint32_t *)(void *)(b + HDR(b)->connector_info_off) = 2; /* published */
}

/* A copy that must be refused with exit 1 and `msg` on stderr. */
static void expect_refused(const char *what, const uint8_t *b, size_t len, const char *msg)
{
        const char *path = write_copy("bad.bin", b, len);
        struct result r = ringdump(0, "--file", path, (char *)NULL);
        if (r.code != 1 || !strstr(r.err, msg) || !strstr(r.err, "kvf-ringdump: ") ||
            r.outlen != 0) {
                fprintf(stderr,
                        "%s: exit %d, stderr \"%s\" (wanted exit 1 and \"%s\"), %zu bytes "
                        "on stdout\n",
                        what, r.code, r.err, msg, r.outlen);
                exit(1);
        }
        result_free(&r);
        r = ringdump(0, "--file", path, "--json", (char *)NULL);
        EXPECT_CODE(r, 1);
        EXPECT_HAS(r.err, msg);
        result_free(&r);
}

/* A copy that is valid but holds hostile values: printed, exit 0, JSON valid. */
static void expect_survives(const char *what, const uint8_t *b, size_t len, const char *needle)
{
        const char *path = write_copy("hostile.bin", b, len);
        struct result r =
            ringdump(0, "--file", path, "--records", "1000", "--verbose", (char *)NULL);
        if (r.code != 0 || (needle && !strstr(r.out, needle))) {
                fprintf(stderr, "%s: exit %d (wanted 0 and \"%s\")\nstdout:\n%s\nstderr:\n%s\n",
                        what, r.code, needle ? needle : "", r.out, r.err);
                exit(1);
        }
        for (size_t i = 0; i < r.outlen; i++)
                if ((unsigned char)r.out[i] < 0x20 && r.out[i] != '\n') {
                        fprintf(stderr, "%s: control byte 0x%02x in text output\n", what,
                                (unsigned char)r.out[i]);
                        exit(1);
                }
        result_free(&r);
        r = ringdump(0, "--file", path, "--records", "1000", "--json", (char *)NULL);
        EXPECT_CODE(r, 0);
        result_free(&r);
        python_check("import json,sys\n"
                     "d=json.loads(sys.stdin.buffer.read().decode('utf-8'))\n"
                     "assert len(d['rings'])==6\n",
                     what, NULL);
}

static void test_corrupt(void)
{
        size_t len;
        uint8_t *orig = seg_bytes(&len);
        uint8_t *b = malloc(len);
        CHECK(b);

        expect_refused("100 bytes", orig, 100, "truncated control segment: 100 bytes");
        expect_refused("empty", orig, 0, "truncated control segment: 0 bytes");
        expect_refused("half", orig, len / 2, "truncated control segment: the file has");

#define MUTATE(what, stmt, msg)                                                                    \
        do {                                                                                       \
                memcpy(b, orig, len);                                                              \
                stmt;                                                                              \
                expect_refused(what, b, len, msg);                                                 \
        } while (0)

        MUTATE("magic", HDR(b)->magic ^= 1, "not a kvferry control segment");
        MUTATE("version 0", HDR(b)->version = 0, "control segment not ready");
        MUTATE("version 99", HDR(b)->version = 99, "layout version 99");
        MUTATE("header ring capacity", HDR(b)->ring_capacity[2] = 5000,
               "capacity 5000 is not a power of two");
        MUTATE("ring header capacity", ring_hdr(b, 3)->capacity = 6000,
               "ring connector->engine: capacity or data offset disagree");
        MUTATE("ring data offset", ring_hdr(b, 1)->data_off += 64,
               "ring sender->engine: capacity or data offset disagree");
        MUTATE("ring identity", ring_hdr(b, 4)->bell = 2, "ring 4 has the wrong identity");
        MUTATE("errlog offset", HDR(b)->errlog_off += 64, "error log at offset");
        MUTATE("request table offset", HDR(b)->reqtab_off = 0, "request table at offset 0");
        MUTATE("total size", HDR(b)->total_size += 4096, "its header says");
        MUTATE("counters", HDR(b)->counters_count = 3, "3 counters, this build has");
        MUTATE("layers", HDR(b)->layout.num_layers = 5000, "5000 + 1 layers");
        MUTATE("cache size", HDR(b)->layout.cache_bytes += 4096,
               "block or cache size does not follow from its shape");
        MUTATE("dtype", HDR(b)->layout.dtype = 77, "cache layout: unknown dtype 77");
        MUTATE("slots", HDR(b)->reqtab_slots = 0, "request table slots 0");
        MUTATE("instance name", memset(HDR(b)->instance, 'a', KVF_INSTANCE_MAX),
               "instance name is not a valid name");
        MUTATE("cache backing", HDR(b)->cache_backing = 9, "cache backing 9 is not one");
        MUTATE("cache page size", HDR(b)->cache_page_kib = 64, "cache page size 64 KiB");
        MUTATE("cache path", memset(HDR(b)->cache_path, '/', KVF_CACHE_PATH_MAX),
               "cache path or note is not terminated");
        MUTATE("garbage", for (size_t i = 0; i < len; i++) b[i] = rnd(),
               "not a kvferry control segment");

        /* Not a file. */
        struct result r = ringdump(0, "--file", tmpdir, (char *)NULL);
        EXPECT_CODE(r, 1);
        EXPECT_HAS(r.err, "not a regular file");
        result_free(&r);

        /* Valid, with hostile values: printed without a crash. */
        struct kvf_ring_hdr *rh;
#define HOSTILE(what, stmt, needle)                                                                \
        do {                                                                                       \
                memcpy(b, orig, len);                                                              \
                stmt;                                                                              \
                expect_survives(what, b, len, needle);                                             \
        } while (0)

        HOSTILE("head past tail", (rh = ring_hdr(b, 0), rh->head = rh->tail + 8),
                "walk stopped: tail is behind head");
        HOSTILE("unaligned head", ring_hdr(b, 0)->head = 3, "head is not 8-byte aligned");
        HOSTILE("huge tail", ring_hdr(b, 0)->tail = ~0ull - 7, "more than one capacity apart");
        HOSTILE("head near 2^64", (rh = ring_hdr(b, 0), rh->head = ~0ull - 7, rh->tail = ~0ull),
                "walk stopped");
        HOSTILE("huge record length",
                *(uint64_t *)(void *)(b + ring_hdr(b, 0)->data_off) =
                    KVF_REC_PACK(0x7fffffff, KVF_REC_TASK, 1),
                "corrupt record header");
        HOSTILE("huge claimed length",
                *(uint64_t *)(void *)(b + ring_hdr(b, 0)->data_off) =
                    KVF_REC_PACK(INT32_MIN, KVF_REC_TASK, 1),
                "corrupt claimed record");
        HOSTILE("pad past end",
                *(uint64_t *)(void *)(b + ring_hdr(b, 0)->data_off) =
                    KVF_REC_PACK(5000, KVF_REC_TYPE_PAD, 1),
                "corrupt padding record");
        HOSTILE("random ring data", random_ring_data(b), "engine->sender");
        HOSTILE("random request table", random_reqtab(b), "in an invalid state");
        HOSTILE("request slots all 0xff",
                memset(b + HDR(b)->reqtab_off, 0xff, 4 * sizeof(struct kvf_req_slot)),
                "requests: 4 slots, 4 in use");
        HOSTILE("random error log", random_errlog(b), "error log:");
        HOSTILE("random roles and connector info", random_roles(b), "roles:");
        free(b);
        free(orig);
}

/* ---- the main checks ---- */

static const char json_script[] =
    "import json,sys\n"
    "inst=sys.argv[1]\n"
    "d=json.loads(sys.stdin.buffer.read().decode('utf-8'))\n"
    "assert d['instance']==inst, d['instance']\n"
    "assert (d['role'],d['rank'],d['nranks'],d['backend'])==('prefill',1,2,'host')\n"
    "l=d['layout']\n"
    "assert (l['num_layers'],l['extra_layers'],l['num_blocks'],l['kv_heads'],l['block_size'],"
    "l['head_dim'],l['dtype'],l['key_only'],l['block_bytes'])==(4,1,64,2,16,64,'bf16',False,4096), "
    "l\n"
    "assert d['connector']=={'published':True,'host':'127.0.0.1','port':7301}, d['connector']\n"
    "assert (d['progress']['step'],d['progress']['layers_done'])==(7,3)\n"
    "roles={r['role']:r for r in d['roles']}\n"
    "assert roles['allocator']['alive'] is True and roles['allocator']['state']=='running'\n"
    "assert roles['sender']['restarts']==1 and roles['sender']['generation']==2\n"
    "assert roles['connector']['alive'] is False\n"
    "assert roles['engine']['state']=='none' and roles['engine']['heartbeat_age_ms'] is None\n"
    "rings=d['rings']\n"
    "assert [r['name'] for r in rings]==['engine->sender','sender->engine','engine->connector',"
    "'connector->engine','sender->connector','connector->sender']\n"
    "p=rings[0]['pending']\n"
    "assert len(p)==5, p\n"
    "assert p[0]['type']=='task' and p[0]['error'] is None\n"
    "t=p[0]['record']\n"
    "assert (t['request_id'],t['peer'],t['transport'],t['current_id'],t['src_blocks'],"
    "t['dst_blocks'])==('req-1','10.0.0.2:7000','tcp',42,3,3), t\n"
    "assert p[1]['record'] is None and p[1]['error'].startswith('undecodable: '), p[1]\n"
    "assert p[2]['record']=={'request_id':'req-1','step':43,'tokens_done':48,'last':True}\n"
    "assert p[3]['type_id']==77 and p[3]['error'].startswith('undecodable: unknown record type')\n"
    "assert p[4]['state']=='being-written' and p[4]['length']==-24\n"
    "assert rings[0]['records_written']==4 and rings[0]['used']==rings[0]['tail']\n"
    "c=rings[1]['pending'][0]['record']\n"
    "assert c['status']=='bad task' and c['reason']=='src_block_ids[2] = 99 is \"out\" of range'\n"
    "a=rings[3]['pending']\n"
    "assert len(a)==1 and a[0]['type']=='arrival' and a[0]['pos']==4096, a\n"
    "assert a[0]['record']['peer']=='p-prefill' and a[0]['record']['status']=='finished'\n"
    "assert rings[2]['pending']==[] and rings[2]['walk_stopped'] is None\n"
    "assert len(d['doorbells'])==3\n"
    "ctr=d['counters']\n"
    "assert len(ctr)==int(sys.argv[2]) and ctr['tasks_accepted']==5 and "
    "ctr['bytes_sent_tcp']==123456\n"
    "assert ctr['chunk_records']==0 and ctr['errors_logged']==3\n"
    "h=d['histograms']\n"
    "lc=h['layer_to_copy_ns']\n"
    "assert (lc['count'],lc['sum'],lc['max'])==(100,5050000,100000), lc\n"
    "assert (lc['p50'],lc['p99'])==(51200,100000), lc\n"
    "assert h['copy_batch_ns']=={'count':0,'sum':0,'max':0,'p50':0,'p99':0}, h['copy_batch_ns']\n"
    "assert (h['last_layer_to_done_ns']['count'],h['last_layer_to_done_ns']['p50'])==(1,4980736), h\n"
    "e=[x for x in d['errors'] if x['role']=='sender']\n"
    "assert len(e)==1 and e[0]['count']==2, e\n"
    "assert e[0]['text']=='peer 10.0.0.2:7000 said \"no\"\\x01 then \\ufffd\\ufffd', "
    "repr(e[0]['text'])\n"
    "assert e[0]['first'].endswith('Z') and 'T' in e[0]['first']\n"
    "rq=d['requests']\n"
    "assert (rq['slots'],rq['free'],rq['active'],rq['completing'])==(4,2,1,1), rq\n"
    "lst=rq['list']\n"
    "assert lst[0]['request_id']=='req-1' and lst[0]['state']=='active' and "
    "lst[0]['age_ms']>=1500\n"
    "assert lst[0]['descriptors']==7 and lst[0]['xfer_ms']>=1300, lst[0]\n"
    "assert lst[1]['descriptors']==0 and lst[1]['xfer_ms'] is None, lst[1]\n"
    "h=d['histograms']\n"
    "assert sorted(h)==sorted(['layer_to_copy_ns','copy_batch_ns','last_layer_to_done_ns',"
    "'request_bytes','request_descriptors','request_xfer_ns']), h\n"
    "b=h['request_bytes']\n"
    "assert (b['count'],b['sum'],b['max'])==(3,1179648,1048576), b\n"
    "assert 57344<b['p50']<=65536 and 917504<b['p99']<=1048576, b\n"
    "assert h['request_descriptors']['sum']==128 and 56<h['request_descriptors']['p50']<=64, h\n"
    "assert h['copy_batch_ns']['count']==0 and h['copy_batch_ns']['p99']==0\n"
    "assert lst[1]['request_id']=='weird\"id\\\\\\x1b[31m\\ufffd' and lst[1]['status']=='bad task'\n"
    "assert bytes.fromhex(lst[1]['request_id_hex'])==b'weird\"id\\\\\\x1b[31m\\xff', lst[1]\n"
    "assert lst[1]['request_id_bin'] is True and lst[0]['request_id_bin'] is False and 'request_id_hex' not in lst[0]\n";

static void test_output(void)
{
        size_t len;
        uint8_t *before = seg_bytes(&len);
        char counters[16], line[160];
        struct result r;

        /* Text. */
        r = ringdump(0, "--instance", inst, (char *)NULL);
        EXPECT_CODE(r, 0);
        snprintf(line, sizeof(line), "instance %s: prefill, rank 1/2, host backend", inst);
        EXPECT_HAS(r.out, line);
        EXPECT_HAS(r.out, "layout: 4 layers + 1 extra, 64 blocks, 2 kv heads, block size 16, "
                          "head dim 64, bf16, key+value");
        EXPECT_HAS(r.out, "connector: listening on 127.0.0.1:7301");
        EXPECT_HAS(r.out, "progress: step 7, 3 layers done (10 events)");
        EXPECT_HAS(r.out, "tasks_accepted");
        EXPECT_LACKS(r.out, "chunk_records"); /* zero: hidden without --verbose */
        EXPECT_HAS(r.out, "histograms (the sender's)");
        EXPECT_HAS(r.out, "request_bytes");
        EXPECT_LACKS(r.out, "copy_batch_ns"); /* empty: hidden without --verbose */
        EXPECT_HAS(r.out, "task           request_id=req-1 peer=10.0.0.2:7000 transport=tcp");
        EXPECT_HAS(r.out, "undecodable: task record is not a msgpack map");
        EXPECT_HAS(r.out, "chunk          request_id=req-1 step=43 tokens_done=48 last=yes");
        EXPECT_HAS(r.out, "(type 77)");
        EXPECT_HAS(r.out, "being-written (length -24, gen 1)");
        EXPECT_HAS(r.out, "status=\"bad task\"");
        EXPECT_HAS(r.out, "reason=\"src_block_ids[2] = 99 is \\\"out\\\" of range\"");
        EXPECT_HAS(r.out, "@4096     arrival");
        EXPECT_HAS(r.out, "said \"no\"\\x01 then \\xff\\xfe");
        EXPECT_HAS(r.out, "requests: 4 slots, 2 in use: 1 active, 0 finishing, 1 completing");
        EXPECT_HAS(r.out, "weird\\\"id\\\\\\x1b[31m\\xff"); /* quoted: the backslash doubled */
        for (size_t i = 0; i < r.outlen; i++)
                CHECK(r.out[i] != '\033' && r.out[i] != '\001');
        result_free(&r);

        /* It wrote nothing. */
        size_t len2;
        uint8_t *after = seg_bytes(&len2);
        CHECK_EQ(len, len2);
        CHECK(memcmp(before, after, len) == 0);
        free(after);

        r = ringdump(0, "--instance", inst, "--verbose", (char *)NULL);
        EXPECT_CODE(r, 0);
        EXPECT_HAS(r.out, "chunk_records");
        result_free(&r);

        r = ringdump(0, "--instance", inst, "--records", "0", (char *)NULL);
        EXPECT_CODE(r, 0);
        EXPECT_LACKS(r.out, "pending records");
        EXPECT_LACKS(r.out, "request_id=");
        result_free(&r);

        r = ringdump(0, "--instance", inst, "--records", "1", (char *)NULL);
        EXPECT_CODE(r, 0);
        EXPECT_HAS(r.out, "request_id=req-1");
        EXPECT_LACKS(r.out, "undecodable");
        EXPECT_HAS(r.out, "more bytes not shown");
        result_free(&r);

        /* The same through --file. */
        r = ringdump(0, "--file", segpath, (char *)NULL);
        EXPECT_CODE(r, 0);
        EXPECT_HAS(r.out, "request_id=req-1");
        result_free(&r);

        /* JSON. */
        r = ringdump(0, "--instance", inst, "--json", (char *)NULL);
        EXPECT_CODE(r, 0);
        CHECK(r.outlen > 0 && r.out[r.outlen - 1] == '\n');
        CHECK(memchr(r.out, '\n', r.outlen) == r.out + r.outlen - 1); /* one line */
        result_free(&r);
        snprintf(counters, sizeof(counters), "%d", KVF_COUNTER_COUNT);
        python_check(json_script, inst, counters);
        r = ringdump(0, "--instance", inst, "--json", "--records", "0", (char *)NULL);
        EXPECT_CODE(r, 0);
        result_free(&r);
        python_check("import json,sys\n"
                     "d=json.loads(sys.stdin.buffer.read().decode('utf-8'))\n"
                     "assert all(r['pending'] is None for r in d['rings'])\n",
                     inst, NULL);
        free(before);
}

static void test_usage(void)
{
        struct result r;

        r = ringdump(0, (char *)NULL);
        EXPECT_CODE(r, 2);
        EXPECT_HAS(r.err, "exactly one of --instance NAME, --file PATH or --all");
        result_free(&r);
        r = ringdump(0, "--bogus", (char *)NULL);
        EXPECT_CODE(r, 2);
        EXPECT_HAS(r.err, "--help");
        result_free(&r);
        r = ringdump(0, "--instance", "a", "--file", "b", (char *)NULL);
        EXPECT_CODE(r, 2);
        result_free(&r);
        r = ringdump(0, "--instance", "a/b", (char *)NULL);
        EXPECT_CODE(r, 2);
        EXPECT_HAS(r.err, "only letters, digits");
        result_free(&r);
        r = ringdump(0, "--instance", inst, "--records", "many", (char *)NULL);
        EXPECT_CODE(r, 2);
        EXPECT_HAS(r.err, "--records: 'many'");
        result_free(&r);
        r = ringdump(0, "--instance", inst, "--records", "-1", (char *)NULL);
        EXPECT_CODE(r, 2);
        result_free(&r);
        r = ringdump(0, "--instance", inst, "--watch=0", (char *)NULL);
        EXPECT_CODE(r, 2);
        EXPECT_HAS(r.err, "--watch: '0'");
        result_free(&r);
        r = ringdump(0, "--instance", inst, "--watch=nan", (char *)NULL);
        EXPECT_CODE(r, 2);
        result_free(&r);
        r = ringdump(0, "--instance", inst, "extra", (char *)NULL);
        EXPECT_CODE(r, 2);
        EXPECT_HAS(r.err, "unexpected argument 'extra'");
        result_free(&r);
        r = ringdump(0, "--help", (char *)NULL);
        EXPECT_CODE(r, 0);
        EXPECT_HAS(r.out, "Usage: kvf-ringdump --instance NAME");
        EXPECT_HAS(r.out, "Exit status");
        result_free(&r);
        r = ringdump(0, "--version", (char *)NULL);
        EXPECT_CODE(r, 0);
        EXPECT_HAS(r.out, KVFERRY_VERSION);
        result_free(&r);

        /* No such instance / file: 3. */
        r = ringdump(0, "--instance", "no-such-instance-rdt", (char *)NULL);
        EXPECT_CODE(r, 3);
        EXPECT_HAS(r.err, "no instance 'no-such-instance-rdt' on this host");
        EXPECT_HAS(r.err, "--all");
        result_free(&r);
        r = ringdump(0, "--file", "/nonexistent/kvferry.x", (char *)NULL);
        EXPECT_CODE(r, 3);
        EXPECT_HAS(r.err, "/nonexistent/kvferry.x does not exist");
        result_free(&r);
}

/* ---- --all, in a /dev/shm of its own ---- */

/* A file to put in the private /dev/shm. */
struct shm_file {
        const char *name;
        const uint8_t *bytes;
        size_t len;
};

struct shm_set {
        const struct shm_file *files;
        int n;
};

static bool write_text(const char *path, const char *text)
{
        int fd = open(path, O_WRONLY);
        bool ok = fd >= 0 && write(fd, text, strlen(text)) == (ssize_t)strlen(text);
        if (fd >= 0)
                close(fd);
        return ok;
}

/*
 * In the child, before exec: a mount namespace of its own whose /dev/shm is an
 * empty tmpfs holding exactly set->files, so that what --all finds, and so its
 * exit status, is what this test made (other tests' instances on this host may
 * be mid-creation or deliberately broken). Root needs only the mount
 * namespace; another user adds a user namespace that maps its own uid and gid
 * to themselves (the segment's owner checks then still hold).
 */
static bool private_shm(const void *arg)
{
        const struct shm_set *set = arg;
        uid_t uid = geteuid();
        gid_t gid = getegid();
        char map[64], path[160];

        if (uid == 0) {
                if (unshare(CLONE_NEWNS) != 0)
                        return false;
        } else {
                if (unshare(CLONE_NEWUSER | CLONE_NEWNS) != 0)
                        return false;
                snprintf(map, sizeof(map), "%u %u 1\n", (unsigned)uid, (unsigned)uid);
                if (!write_text("/proc/self/uid_map", map))
                        return false;
                write_text("/proc/self/setgroups", "deny");
                snprintf(map, sizeof(map), "%u %u 1\n", (unsigned)gid, (unsigned)gid);
                if (!write_text("/proc/self/gid_map", map))
                        return false;
        }
        /* Before the tmpfs: nothing mounted here may ever reach the host's /dev/shm. */
        if (mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) != 0)
                return false;
        if (mount("kvf-ringdump-test", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777") != 0)
                return false;
        for (int i = 0; i < set->n; i++) {
                snprintf(path, sizeof(path), "/dev/shm/%s", set->files[i].name);
                int fd = open(path, O_WRONLY | O_CREAT | O_EXCL, 0600);
                if (fd < 0 ||
                    write(fd, set->files[i].bytes, set->files[i].len) != (ssize_t)set->files[i].len)
                        return false;
                close(fd);
        }
        return true;
}

/* kvf-ringdump --all with the given arguments (NULL-terminated) where /dev/shm holds exactly
 * `set`; exit status PREP_FAILED if this host cannot make a private /dev/shm. */
static struct result ringdump_all(const struct shm_set *set, ...)
{
        va_list ap;
        va_start(ap, set);
        struct result r = ringdump_v(private_shm, set, 0, ap);
        va_end(ap);
        return r;
}

/* The exit status --all owes to its JSON: the first instance it could not read (not counting
 * one not ready or gone meanwhile) decides it, 1 for a corrupt one, 4 for the rest (ringdump.c
 * frame_all, exit_code_for); 3 when there are none. argv: [1] instance, [2] the exit status. */
static const char all_code_script[] =
    "import errno,json,sys\n"
    "d=json.loads(sys.stdin.buffer.read().decode('utf-8'))\n"
    "want=3 if not d['instances'] else 0\n"
    "for i in d['instances']:\n"
    "  if i.get('error') is not None and i['errno'] not in (errno.EAGAIN,errno.ENOENT):\n"
    "    want=1 if i['errno'] in (errno.EBADMSG,errno.EPROTO,errno.EINVAL) else 4\n"
    "    break\n"
    "assert int(sys.argv[2])==want, 'exit %s, want %d for %s' % (sys.argv[2],want,d)\n";

/* Our instance in --all's JSON, as build_segment() made it. */
static const char all_ours_script[] =
    "m=[i for i in d['instances'] if i['instance']==sys.argv[1]]\n"
    "assert len(m)==1 and m[0]['error'] is None and m[0]['role']=='prefill', m\n"
    "assert m[0]['roles']['allocator']['alive'] is True\n"
    "assert m[0]['requests_in_use']==2 and m[0]['errors_logged']==3\n";

/* Without a private /dev/shm: the host's instances, whatever they are; the exit status must be
 * the one the listing itself calls for. */
static void test_all_host(void)
{
        char code[16], script[2048];

        snprintf(script, sizeof(script), "%s%s", all_code_script, all_ours_script);
        for (int attempt = 1;; attempt++) {
                struct result t = ringdump(0, "--all", (char *)NULL);
                EXPECT_HAS(t.out, inst);
                struct result j = ringdump(0, "--all", "--json", (char *)NULL);
                snprintf(code, sizeof(code), "%d", j.code);
                python_check(script, inst, code);
                /* The two runs saw the same host unless an instance came or went between them. */
                bool same = t.code == j.code;
                if (!same && attempt == 3) {
                        fprintf(stderr, "--all: exit %d as text, %d as JSON, three times\n", t.code,
                                j.code);
                        exit(1);
                }
                result_free(&t);
                result_free(&j);
                if (same)
                        break;
        }
        fprintf(stderr, "note: no private /dev/shm here (needs root or user namespaces): "
                        "--all checked against this host's instances\n");
}

static void test_all(void)
{
        size_t len;
        uint8_t *seg = seg_bytes(&len);
        uint8_t *bad = malloc(len), *unready = malloc(len);
        static const uint8_t zeros[4096];
        char n_seg[96], n_cache[96], n_bad[96], n_new[96], line[160], script[1024];
        struct result r;

        CHECK(bad && unready);
        memcpy(bad, seg, len);
        HDR(bad)->magic ^= 1;
        memcpy(unready, seg, len);
        HDR(unready)->version = 0; /* sized, header not yet published: being created */
        snprintf(n_seg, sizeof(n_seg), "kvferry.%s", inst);
        snprintf(n_cache, sizeof(n_cache), "kvferry.%s.cache", inst);
        snprintf(n_bad, sizeof(n_bad), "kvferry.%s-bad", inst);
        snprintf(n_new, sizeof(n_new), "kvferry.%s-new", inst);
        const struct shm_file f_seg = {n_seg, seg, len}, f_cache = {n_cache, zeros, sizeof(zeros)},
                              f_bad = {n_bad, bad, len}, f_new = {n_new, unready, len};

        /* Ours and its cache file (not an instance): exit 0, one line. */
        const struct shm_file one[] = {f_seg, f_cache};
        const struct shm_set s_one = {one, 2};
        r = ringdump_all(&s_one, "--all", (char *)NULL);
        if (r.code == PREP_FAILED) {
                result_free(&r);
                test_all_host();
                goto out;
        }
        EXPECT_CODE(r, 0);
        EXPECT_HAS(r.out, "instance");
        snprintf(line, sizeof(line), "\n%s ", inst);
        EXPECT_HAS(r.out, line);
        EXPECT_HAS(r.out, "prefill");
        EXPECT_LACKS(r.out, ".cache");
        result_free(&r);
        r = ringdump_all(&s_one, "--all", "--json", (char *)NULL);
        EXPECT_CODE(r, 0);
        result_free(&r);
        snprintf(script, sizeof(script),
                 "import json,sys\n"
                 "d=json.loads(sys.stdin.buffer.read().decode('utf-8'))\n"
                 "assert len(d['instances'])==1, d\n%s",
                 all_ours_script);
        python_check(script, inst, NULL);

        /* And one being created: a normal moment of start-up, still 0. */
        const struct shm_file two[] = {f_seg, f_new};
        const struct shm_set s_two = {two, 2};
        r = ringdump_all(&s_two, "--all", (char *)NULL);
        EXPECT_CODE(r, 0);
        EXPECT_HAS(r.out, "control segment not ready");
        EXPECT_HAS(r.out, line);
        result_free(&r);
        r = ringdump_all(&s_two, "--all", "--json", (char *)NULL);
        EXPECT_CODE(r, 0);
        result_free(&r);
        python_check("import errno,json,sys\n"
                     "d=json.loads(sys.stdin.buffer.read().decode('utf-8'))\n"
                     "n=[i for i in d['instances'] if i['instance']==sys.argv[1]+'-new']\n"
                     "assert len(d['instances'])==2 and len(n)==1, d\n"
                     "assert n[0]['errno']==errno.EAGAIN and 'not ready' in n[0]['error'], n\n",
                     inst, NULL);

        /* And a corrupt one: 1, and the others are still listed. */
        const struct shm_file three[] = {f_seg, f_new, f_bad};
        const struct shm_set s_three = {three, 3};
        r = ringdump_all(&s_three, "--all", (char *)NULL);
        EXPECT_CODE(r, 1);
        EXPECT_HAS(r.out, "not a kvferry control segment");
        EXPECT_HAS(r.out, line);
        result_free(&r);
        r = ringdump_all(&s_three, "--all", "--json", (char *)NULL);
        EXPECT_CODE(r, 1);
        result_free(&r);
        python_check("import errno,json,sys\n"
                     "d=json.loads(sys.stdin.buffer.read().decode('utf-8'))\n"
                     "b=[i for i in d['instances'] if i['instance']==sys.argv[1]+'-bad']\n"
                     "assert len(d['instances'])==3 and len(b)==1, d\n"
                     "assert b[0]['errno']==errno.EPROTO and "
                     "'not a kvferry control segment' in b[0]['error'], b\n",
                     inst, NULL);

        /* None at all: 3. */
        const struct shm_set s_none = {NULL, 0};
        r = ringdump_all(&s_none, "--all", (char *)NULL);
        EXPECT_CODE(r, 3);
        EXPECT_HAS(r.err, "no kvferry instances on this host");
        CHECK_EQ(r.outlen, 0);
        result_free(&r);
        r = ringdump_all(&s_none, "--all", "--json", (char *)NULL);
        EXPECT_CODE(r, 3);
        CHECK(strcmp(r.out, "{\"instances\":[]}\n") == 0);
        result_free(&r);
out:
        free(unready);
        free(bad);
        free(seg);
}

static void test_watch(void)
{
        char needle[96];
        struct result r =
            ringdump(900, "--instance", inst, "--watch", "0.2", "--records", "0", (char *)NULL);
        EXPECT_CODE(r, 0);
        snprintf(needle, sizeof(needle), "instance %s:", inst);
        int frames = 0;
        for (const char *p = r.out; (p = strstr(p, needle)); p++)
                frames++;
        if (frames < 2) {
                fprintf(stderr, "--watch printed %d frames in 900 ms:\n%s\n", frames, r.out);
                exit(1);
        }
        EXPECT_LACKS(r.out, "\033["); /* not a terminal: no screen clearing */
        result_free(&r);

        r = ringdump(700, "--instance", inst, "--watch=0.1", "--json", (char *)NULL);
        EXPECT_CODE(r, 0);
        result_free(&r);
        python_check("import json,sys\n"
                     "ls=sys.stdin.buffer.read().decode('utf-8').splitlines()\n"
                     "assert len(ls)>=2, len(ls)\n"
                     "assert all(json.loads(l)['instance']==sys.argv[1] for l in ls)\n",
                     inst, NULL);

        /* Watching an instance that does not exist keeps going and says why. */
        r = ringdump(500, "--instance", "no-such-instance-rdt", "--watch", "0.1", (char *)NULL);
        EXPECT_CODE(r, 0);
        EXPECT_HAS(r.err, "no instance 'no-such-instance-rdt'");
        result_free(&r);
}

int main(int argc, char **argv)
{
        struct kvf_ctl c;

        if (argc < 2)
                SKIP("usage: ringdump_test PATH-TO-kvf-ringdump");
        tool = argv[1];
        if (access(tool, X_OK) != 0)
                SKIP("%s is not executable", tool);
        snprintf(inst, sizeof(inst), "t-rdump-%d", (int)getpid());
        snprintf(segpath, sizeof(segpath), "/dev/shm/kvferry.%s", inst);
        snprintf(tmpdir, sizeof(tmpdir), "/tmp/kvf-rdump-XXXXXX");
        CHECK(mkdtemp(tmpdir));
        atexit(cleanup);
        require_python();

        build_segment(&c);
        test_output();
        test_usage();
        test_corrupt();
        test_all();
        test_watch();
        kvf_ctl_detach(&c);
        printf("ringdump_test: ok\n");
        return 0;
}

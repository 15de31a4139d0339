/*
 * kvf-metrics: serves an instance's counters, rings, roles and latency
 * histograms as Prometheus text at /metrics.
 *
 *   kvf-metrics --instance NAME --listen HOST:PORT
 *
 * It maps the control segment read-only and writes nothing anywhere but its
 * socket: a slow, hostile or crashing scraper can cost this process, never a
 * role of the data path. HTTP is libmicrohttpd's, one internal thread, a
 * bounded number of connections and a per-connection timeout. The segment is
 * mapped again when the instance's file changes (the instance was started
 * afresh under the same name), and a scrape while there is none answers
 * kvferry_up 0. docs/OPERATIONS.md describes every series.
 *
 * A scrape is made cheap, since a scraper may ask hundreds of times a second
 * on the CPUs the data path uses: the page's fixed text is kept between
 * scrapes and only its numbers are read and written anew; the roles are
 * followed through pidfds and the segment's file through inotify, both asked
 * in one poll(); the page goes out in one sendmsg from a reused buffer.
 *
 * Exit codes: 0 stopped by SIGTERM/SIGINT, 1 cannot listen, 2 usage.
 */
#include <arpa/inet.h>
#include <errno.h>
#include <getopt.h>
#include <microhttpd.h>
#include <netdb.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/inotify.h>
#include <sys/pidfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include "atomics.h"
#include "clock.h"
#include "ctl.h"
#include "err.h"
#include "kvferry.h"
#include "opts.h"

static const char *prog = "kvf-metrics";

#define MAX_CONNECTIONS 64u
#define CONNECTION_TIMEOUT_S 10u
/* Per connection: a GET's headers and the answer's; libmicrohttpd clears the pool (32 KiB by
 * default) for each request, a cost paid per scrape. */
#define CONNECTION_MEMORY 8192u

static void usage(void)
{
        printf("Usage: %s --instance NAME --listen HOST:PORT\n"
               "Serve the instance's metrics as Prometheus text at http://HOST:PORT/metrics "
               "(read-only:\n"
               "the control segment is mapped read-only). HOST is an IPv4 or IPv6 address of this "
               "host;\n"
               "PORT 0 picks a free port (printed on stderr).\n"
               "  --instance NAME   the instance (as given to tools/kvferry up)\n"
               "  --listen HOST:PORT\n"
               "  --help, --version\n"
               "Exit: 0 stopped by a signal; 1 cannot listen; 2 usage.\n",
               prog);
}

/* ---- the segment: mapped read-only, mapped again when the file changes ---- */

/*
 * A role's process as last checked: a pidfd on it while (pid, starttime) in its slot stay the
 * same, so a scrape asks the kernel one poll() for every role instead of reading /proc/<pid>/stat
 * for each (which the kernel formats anew every time). The pidfd names the very process that
 * kvf_role_process_alive() judged once, so a pid reused later cannot pass for it; it turns
 * readable when that process exits.
 */
struct role_watch {
        int32_t pid;
        uint64_t starttime;
        int fd;    /* pidfd, or -1 */
        bool dead; /* (pid, starttime) was judged not to be the role's live process */
};

struct seg {
        const char *instance;
        char path[96];
        bool attached;
        dev_t dev;
        ino_t ino;
        struct kvf_ctl ctl;
        struct role_watch watch[KVF_ROLE_COUNT];
        bool no_pidfd; /* pidfd_open() is refused here: every check reads /proc */
        int ino_fd;    /* inotify on the file's directory, or -1: stat() every scrape */
        const char *file; /* the file's name in its directory */
        uint64_t attaches; /* attachments so far */
};

static struct seg seg;

static void page_forget(void);

static void watch_reset(struct role_watch *w)
{
        if (w->fd >= 0)
                close(w->fd);
        *w = (struct role_watch){.fd = -1};
}

/*
 * One poll() a scrape: the pidfds of the roles' processes and the inotify descriptor that says
 * whether the instance's segment file was removed or created since the last scrape (then, and
 * only then, it is looked at again with stat()).
 */
struct scan {
        struct pollfd pfd[1 + KVF_ROLE_COUNT];
        int at[KVF_ROLE_COUNT]; /* the role's pidfd in pfd; -1: not alive; -2: ask /proc */
        int n;
        int ino;   /* the inotify descriptor in pfd, or -1 */
        bool done; /* polled for this page */
};

/* The roles' slots as they are now: which to poll, which are down already. */
static void roles_scan(struct seg *s, struct scan *sc, bool with_ino)
{
        const struct kvf_ctl *c = &s->ctl;
        sc->n = 0;
        sc->ino = -1;
        sc->done = false;
        if (with_ino && s->ino_fd >= 0) {
                sc->ino = sc->n;
                sc->pfd[sc->n++] = (struct pollfd){.fd = s->ino_fd, .events = POLLIN};
        }
        for (int r = 0; r < KVF_ROLE_COUNT; r++) {
                const struct kvf_role_slot *sl = &c->roles[r];
                struct role_watch *w = &s->watch[r];
                sc->at[r] = -1;
                if (s->no_pidfd) {
                        sc->at[r] = -2;
                        continue;
                }
                int32_t pid = kvf_load_acquire(&sl->pid);
                uint32_t state = kvf_load_acquire(&sl->state);
                uint64_t st = kvf_load_relaxed(&sl->pid_starttime);
                if (pid <= 0 || (state != KVF_STATE_RUNNING && state != KVF_STATE_STARTING))
                        continue;
                if (pid != w->pid || st != w->starttime || (w->fd < 0 && !w->dead)) {
                        watch_reset(w);
                        w->pid = pid;
                        w->starttime = st;
                        /* The pidfd first, then the check: the process checked is then the
                         * one the pidfd follows (or the check fails). */
                        w->fd = pidfd_open(pid, 0);
                        if (w->fd < 0 && errno != ESRCH) {
                                s->no_pidfd = true; /* (kernel or sandbox without pidfds) */
                                sc->at[r] = -2;
                                continue;
                        }
                        if (w->fd < 0 || !kvf_role_process_alive(c, (enum kvf_role_id)r)) {
                                watch_reset(w);
                                w->pid = pid;
                                w->starttime = st;
                                w->dead = true;
                        }
                }
                if (w->dead)
                        continue;
                sc->at[r] = sc->n;
                sc->pfd[sc->n++] = (struct pollfd){.fd = w->fd, .events = POLLIN};
        }
}

static void scan_poll(struct scan *sc)
{
        sc->done = true;
        if (!sc->n || poll(sc->pfd, (nfds_t)sc->n, 0) >= 0)
                return;
        for (int r = 0; r < KVF_ROLE_COUNT; r++) /* (cannot happen: ask /proc) */
                if (sc->at[r] >= 0)
                        sc->at[r] = -2;
        if (sc->ino >= 0)
                sc->pfd[sc->ino].revents = POLLIN; /* and look at the file */
}

/*
 * kvf_role_alive() for every role, the process checks answered by the pidfds: the same
 * verdicts (state, same process, not exited, heartbeat fresh), a /proc read only when a slot
 * names a process not seen before.
 */
static void roles_alive(struct seg *s, struct scan *sc, uint64_t now, bool alive[KVF_ROLE_COUNT])
{
        const struct kvf_ctl *c = &s->ctl;
        if (!sc->done) {
                roles_scan(s, sc, false);
                scan_poll(sc);
        }
        uint64_t limit = kvf_ms(c->hdr->heartbeat_ms) * 10;
        for (int r = 0; r < KVF_ROLE_COUNT; r++) {
                alive[r] = false;
                if (sc->at[r] == -2) {
                        alive[r] = kvf_role_alive(c, (enum kvf_role_id)r, now);
                        continue;
                }
                if (sc->at[r] < 0)
                        continue;
                if (sc->pfd[sc->at[r]].revents) { /* exited (readable), or the pidfd broke */
                        struct role_watch *w = &s->watch[r];
                        int32_t pid = w->pid;
                        uint64_t st = w->starttime;
                        watch_reset(w);
                        *w = (struct role_watch){.pid = pid, .starttime = st, .fd = -1, .dead = true};
                        continue;
                }
                if (r == KVF_ROLE_ENGINE) {
                        alive[r] = true;
                        continue;
                }
                uint64_t hb = kvf_load_acquire(&c->roles[r].heartbeat_ns);
                alive[r] = now < hb || now - hb <= limit;
        }
}

static void seg_detach(struct seg *s)
{
        if (!s->attached)
                return;
        kvf_ctl_detach(&s->ctl);
        s->attached = false;
        for (int r = 0; r < KVF_ROLE_COUNT; r++)
                watch_reset(&s->watch[r]);
        page_forget();
}

static int seg_refresh(struct seg *s)
{
        struct stat st;
        if (stat(s->path, &st) < 0) {
                seg_detach(s);
                return -ENOENT;
        }
        if (s->attached && st.st_dev == s->dev && st.st_ino == s->ino)
                return 0;
        seg_detach(s);
        int rc = kvf_ctl_attach(s->instance, false, &s->ctl);
        if (rc < 0)
                return rc;
        s->attached = true;
        s->attaches++;
        s->dev = st.st_dev;
        s->ino = st.st_ino;
        return 0;
}

/* Removed or created since the last look: the segment's file (or the events overflowed). */
static bool ino_drain(struct seg *s)
{
        bool hit = false, lost = false;
        char buf[4096] __attribute__((aligned(__alignof__(struct inotify_event))));
        for (;;) {
                ssize_t n = read(s->ino_fd, buf, sizeof(buf));
                if (n <= 0 && (lost || (n < 0 && errno != EAGAIN && errno != EINTR))) {
                        close(s->ino_fd); /* (the watch is gone: stat() every scrape) */
                        s->ino_fd = -1;
                        return true;
                }
                if (n <= 0)
                        return hit;
                for (ssize_t off = 0; off + (ssize_t)sizeof(struct inotify_event) <= n;) {
                        const struct inotify_event *e = (const struct inotify_event *)(buf + off);
                        if ((e->mask & IN_Q_OVERFLOW) || (e->len && !strcmp(e->name, s->file)))
                                hit = true;
                        if (e->mask & IN_IGNORED)
                                lost = true;
                        off += (ssize_t)(sizeof(*e) + e->len);
                }
        }
}

/*
 * True when the instance's current segment is mapped. While one is, its file is looked at only
 * when inotify says it was removed or created; the same poll() asks the roles' pidfds, for
 * roles_alive() (sc->done).
 */
static bool seg_current(struct seg *s, struct scan *sc)
{
        if (!s->attached || s->ino_fd < 0)
                return seg_refresh(s) == 0;
        roles_scan(s, sc, true);
        scan_poll(sc);
        if (!sc->pfd[sc->ino].revents || !ino_drain(s))
                return true;
        uint64_t before = s->attaches;
        if (seg_refresh(s) < 0)
                return false;
        if (s->attaches != before)
                sc->done = false; /* (another segment: its roles are scanned afresh) */
        return true;
}

/* ---- the text ---- */

/*
 * A page's text is the same from scrape to scrape but for its numbers, so it is rendered in
 * full once per attachment and kept as a template: the fixed text between the numbers, and
 * where each number goes. Later scrapes run the same rendering code, which then copies the
 * template's pieces around freshly read numbers instead of putting names, labels and help
 * texts together again. The template belongs to one shape of page (the segment's header
 * fields that appear in labels or decide which series exist); a page of another shape, or one
 * whose numbers do not line up with the template's, is rendered in full and recorded anew.
 * Nothing is cached across scrapes but text that does not change: every number is read at the
 * scrape.
 */
struct page_shape {
        uint32_t instance_role, backend, rank, nranks, counters_count;
};

struct tmpl {
        bool valid;
        struct page_shape shape;
        char *text; /* the fixed pieces, one after the other */
        size_t len, cap;
        size_t *marks; /* marks[k]: where in text the k-th number goes */
        size_t nmarks, capmarks;
};

static struct tmpl tmpl;

enum out_mode { OUT_PLAIN, OUT_RECORD, OUT_REPLAY };

/* A page's buffer; given back to a small pool when libmicrohttpd has sent it. */
struct pagebuf {
        size_t cap;
        char text[];
};

struct out {
        struct pagebuf *pb;
        char *buf; /* pb->text */
        size_t len, cap;
        bool oom;
        enum out_mode mode;
        bool mismatch; /* replay: the numbers did not line up with the template */
        size_t k, pos; /* replay: next mark, and the text offset copied up to */
        const char *inst; /* the instance label's value, escaped */
};

static void page_forget(void)
{
        tmpl.valid = false;
        tmpl.len = 0;
        tmpl.nmarks = 0;
}

static bool grow(char **p, size_t *cap, size_t len, size_t n)
{
        if (*cap - len > n)
                return true;
        size_t c = *cap * 2 + n;
        char *b = realloc(*p, c);
        if (!b)
                return false;
        *p = b;
        *cap = c;
        return true;
}

static void put(struct out *o, const char *s, size_t n)
{
        if (o->oom)
                return;
        if (o->cap - o->len <= n) {
                size_t c = o->cap * 2 + n;
                struct pagebuf *pb = realloc(o->pb, sizeof(*pb) + c);
                if (!pb) {
                        o->oom = true;
                        return;
                }
                pb->cap = c;
                o->pb = pb;
                o->buf = pb->text;
                o->cap = c;
        }
        memcpy(o->buf + o->len, s, n);
        o->len += n;
}

/* Fixed text: written (and recorded), or in a replay already in the template. */
static void out_fixed(struct out *o, const char *s, size_t n)
{
        if (o->mode == OUT_REPLAY)
                return;
        put(o, s, n);
        if (o->mode == OUT_RECORD && !o->oom) {
                if (!grow(&tmpl.text, &tmpl.cap, tmpl.len, n)) {
                        o->oom = true;
                        return;
                }
                memcpy(tmpl.text + tmpl.len, s, n);
                tmpl.len += n;
        }
}

/* A number's text: in a replay, after the template's fixed text up to its mark. */
static void out_number(struct out *o, const char *s, size_t n)
{
        if (o->mode == OUT_REPLAY) {
                if (o->k >= tmpl.nmarks) {
                        o->mismatch = true;
                        return;
                }
                put(o, tmpl.text + o->pos, tmpl.marks[o->k] - o->pos);
                o->pos = tmpl.marks[o->k++];
        } else if (o->mode == OUT_RECORD) {
                if (tmpl.nmarks == tmpl.capmarks) {
                        size_t c = tmpl.capmarks ? tmpl.capmarks * 2 : 512;
                        size_t *m = realloc(tmpl.marks, c * sizeof(*m));
                        if (!m) {
                                o->oom = true;
                                return;
                        }
                        tmpl.marks = m;
                        tmpl.capmarks = c;
                }
                tmpl.marks[tmpl.nmarks++] = tmpl.len;
        }
        put(o, s, n);
}

/* The page is whole: a replay copies the template's last fixed text. */
static void out_end(struct out *o)
{
        if (o->mode != OUT_REPLAY)
                return;
        if (o->k != tmpl.nmarks) {
                o->mismatch = true;
                return;
        }
        put(o, tmpl.text + o->pos, tmpl.len - o->pos);
}

static void out_s(struct out *o, const char *str)
{
        if (o->mode != OUT_REPLAY)
                out_fixed(o, str, strlen(str));
}

static void out_u64(struct out *o, uint64_t v)
{
        char d[24];
        size_t n = 0;
        do {
                d[sizeof(d) - ++n] = (char)('0' + v % 10);
                v /= 10;
        } while (v);
        out_number(o, d + sizeof(d) - n, n);
}

/* A number printf formats (a float); a page holds a handful. */
/*
 * A time histogram's sum in seconds (%.9g of the nanoseconds / 1e9). printf's floating point was
 * a few per cent of a scrape; a sum changes far less often than it is scraped, so each
 * histogram's text is kept with the sum it was made from and made again only when that differs.
 */
static struct {
        uint64_t sum;
        bool valid;
        uint8_t len;
        char text[40];
} sum_text[KVF_HIST_COUNT];


static void out_seconds(struct out *o, enum kvf_hist_id hist, uint64_t sum, double unit)
{
        if (!sum_text[hist].valid || sum_text[hist].sum != sum) {
                int n = snprintf(sum_text[hist].text, sizeof(sum_text[hist].text), "%.9g",
                                 (double)sum / unit);
                if (n < 0 || (size_t)n >= sizeof(sum_text[hist].text)) {
                        o->oom = true;
                        return;
                }
                sum_text[hist].len = (uint8_t)n;
                sum_text[hist].sum = sum;
                sum_text[hist].valid = true;
        }
        out_number(o, sum_text[hist].text, sum_text[hist].len);
}

static void family(struct out *o, const char *name, const char *type, const char *help)
{
        if (o->mode == OUT_REPLAY)
                return;
        out_s(o, "# HELP ");
        out_s(o, name);
        out_s(o, " ");
        out_s(o, help);
        out_s(o, "\n# TYPE ");
        out_s(o, name);
        out_s(o, " ");
        out_s(o, type);
        out_s(o, "\n");
}

/* name{instance="..."[,extra]} value */
static void sample(struct out *o, const char *name, const char *labels, uint64_t v)
{
        out_s(o, name);
        out_s(o, "{instance=\"");
        out_s(o, o->inst);
        out_s(o, labels ? "\"," : "\"");
        if (labels)
                out_s(o, labels);
        out_s(o, "} ");
        out_u64(o, v);
        out_s(o, "\n");
}

/* name[suffix]{instance="...",key="value"} v, or without the key when key is NULL */
static void sample_kv(struct out *o, const char *name, const char *suffix, const char *key,
                      const char *value, uint64_t v)
{
        out_s(o, name);
        out_s(o, suffix);
        out_s(o, "{instance=\"");
        out_s(o, o->inst);
        if (key) {
                out_s(o, "\",");
                out_s(o, key);
                out_s(o, "=\"");
                out_s(o, value);
        }
        out_s(o, "\"} ");
        out_u64(o, v);
        out_s(o, "\n");
}

static uint64_t ctr(const struct kvf_ctl *c, enum kvf_counter_id id)
{
        return kvf_load_relaxed(&c->counters[id].value);
}

static void counter1(struct out *o, const struct kvf_ctl *c, const char *name,
                     enum kvf_counter_id id, const char *help)
{
        family(o, name, "counter", help);
        sample(o, name, NULL, ctr(c, id));
}

/* The lower bound of histogram bucket b (common/hist.c's bucketing): bucket b holds
 * [low(b), low(b + 1)). */
static uint64_t bucket_low(unsigned b)
{
        if (b < 8)
                return b;
        unsigned lg = b / 8 + 2;
        if (lg >= 64)
                return UINT64_MAX;
        return (1ull << lg) | ((uint64_t)(b % 8) << (lg - 3));
}

/*
 * Upper bounds of the exported buckets: seconds; bytes (powers of 4 from 64 KiB to 4 GiB);
 * descriptors (powers of 2 from 1 to 65536). Each as its `le` text and in the segment's unit
 * (ns, bytes, descriptors), so a scrape formats no floating-point bound.
 */
struct bound {
        const char *le;
        uint64_t raw;
};
static const struct bound le_s[] = {
    {"1e-06", 1000},          {"2.5e-06", 2500},        {"5e-06", 5000},
    {"1e-05", 10000},         {"2.5e-05", 25000},       {"5e-05", 50000},
    {"0.0001", 100000},       {"0.00025", 250000},      {"0.0005", 500000},
    {"0.001", 1000000},       {"0.0025", 2500000},      {"0.005", 5000000},
    {"0.01", 10000000},       {"0.025", 25000000},      {"0.05", 50000000},
    {"0.1", 100000000},       {"0.25", 250000000},      {"0.5", 500000000},
    {"1", 1000000000},        {"2.5", 2500000000},      {"5", 5000000000},
    {"10", 10000000000},      {"30", 30000000000},
};
static const struct bound le_bytes[] = {
    {"65536", 1ull << 16},    {"262144", 1ull << 18},   {"1048576", 1ull << 20},
    {"4194304", 1ull << 22},  {"16777216", 1ull << 24}, {"67108864", 1ull << 26},
    {"268435456", 1ull << 28}, {"1073741824", 1ull << 30}, {"4294967296", 1ull << 32},
};
static const struct bound le_descs[] = {
    {"1", 1},       {"2", 2},       {"4", 4},         {"8", 8},         {"16", 16},
    {"32", 32},     {"64", 64},     {"128", 128},     {"256", 256},     {"512", 512},
    {"1024", 1024}, {"2048", 2048}, {"4096", 4096},   {"8192", 8192},   {"16384", 16384},
    {"32768", 32768}, {"65536", 65536},
};

/* How a segment histogram is exported: its bounds, and the segment unit per exported unit. */
struct hist_kind {
        const struct bound *le;
        size_t nle;
        double unit; /* 1e9: nanoseconds exported as seconds; 1: bytes, descriptors */
        unsigned *upto; /* upto[j]: the segment buckets that lie wholly at or below le[j] */
};
static unsigned upto_s[sizeof(le_s) / sizeof(le_s[0])];
static unsigned upto_bytes[sizeof(le_bytes) / sizeof(le_bytes[0])];
static unsigned upto_descs[sizeof(le_descs) / sizeof(le_descs[0])];
static const struct hist_kind seconds = {le_s, sizeof(le_s) / sizeof(le_s[0]), 1e9, upto_s};
static const struct hist_kind sizes_bytes = {le_bytes, sizeof(le_bytes) / sizeof(le_bytes[0]), 1,
                                             upto_bytes};
static const struct hist_kind sizes_descs = {le_descs, sizeof(le_descs) / sizeof(le_descs[0]), 1,
                                             upto_descs};

/* Fills k->upto once, so that a scrape sums bucket ranges without computing bucket bounds. */
static void hist_kind_init(const struct hist_kind *k)
{
        unsigned i = 0;
        for (size_t j = 0; j < k->nle; j++) {
                while (i + 1 < KVF_HIST_BUCKETS && bucket_low(i + 1) <= k->le[j].raw)
                        i++;
                k->upto[j] = i;
        }
}

/*
 * A segment histogram (log buckets) as a Prometheus histogram: nanoseconds
 * in seconds, or a size histogram (bytes, descriptors) as it is. A segment
 * bucket counts under an exported bound only when all of it lies at or below
 * the bound, so each cumulative count is exact or an undercount by at most the
 * segment bucket straddling the bound (12.5 %); a size histogram's buckets are
 * (low, high] (common/hist.c), so its power-of-two bounds are exact. The count
 * is the buckets' sum (read at one time with them), not the separate count
 * word, so that +Inf equals _count.
 */
static void histogram(struct out *o, const char *name, const struct kvf_ctl *c,
                      enum kvf_hist_id id, const struct hist_kind *k, const char *help)
{
        const struct kvf_histogram *h = &c->sender->hist[id];
        uint64_t b[KVF_HIST_BUCKETS], total = 0;
        for (unsigned i = 0; i < KVF_HIST_BUCKETS; i++) {
                b[i] = kvf_load_relaxed(&h->buckets[i]);
                total += b[i];
        }
        uint64_t sum = kvf_load_relaxed(&h->sum);
        family(o, name, "histogram", help);
        unsigned i = 0;
        uint64_t cum = 0;
        for (size_t j = 0; j < k->nle; j++) {
                for (; i < k->upto[j]; i++)
                        cum += b[i];
                sample_kv(o, name, "_bucket", "le", k->le[j].le, cum);
        }
        sample_kv(o, name, "_bucket", "le", "+Inf", total);
        out_s(o, name);
        out_s(o, "_sum{instance=\"");
        out_s(o, o->inst);
        out_s(o, "\"} ");
        if (k->unit == 1)
                out_u64(o, sum);
        else
                out_seconds(o, id, sum, k->unit);
        out_s(o, "\n");
        sample_kv(o, name, "_count", NULL, NULL, total);
}

static const struct {
        enum kvf_counter_id id;
        const char *status;
} failed_by[] = {
    {KVF_CTR_FAILED_BAD_TASK, "bad_task"},
    {KVF_CTR_FAILED_BLOCK_RANGE, "block_range"},
    {KVF_CTR_FAILED_UNKNOWN_PEER, "unknown_peer"},
    {KVF_CTR_FAILED_CONNECTION, "connection"},
    {KVF_CTR_FAILED_LAYOUT, "layout_mismatch"},
    {KVF_CTR_FAILED_CANCELLED, "cancelled"},
    {KVF_CTR_FAILED_TIMEOUT, "timeout"},
    {KVF_CTR_FAILED_WRITE, "write"},
    {KVF_CTR_FAILED_AUTH, "auth"},
    {KVF_CTR_FAILED_ENGINE_GONE, "engine_gone"},
    {KVF_CTR_FAILED_PEER_ROLE, "peer_role"},
};

static void render(struct out *o, struct seg *s, struct scan *sc, bool up)
{
        const struct kvf_ctl *c = &s->ctl;
        family(o, "kvferry_up", "gauge",
               "1 when the instance's control segment is mapped and valid, else 0");
        sample(o, "kvferry_up", NULL, up);
        if (!up)
                return;
        const struct kvf_ctl_header *h = c->hdr;
        uint64_t now = kvf_now_ns();
        /* The histograms' 24 KiB are read last and are rarely in cache (another process writes
         * them, minutes apart from the scrapes): their loads are started here, all at once,
         * instead of one miss after another in histogram(). */
        for (unsigned i = 0; i < KVF_HIST_COUNT; i++) {
                const char *p = (const char *)c->sender->hist[i].buckets;
                for (size_t off = 0; off < sizeof(c->sender->hist[i].buckets); off += 64)
                        __builtin_prefetch(p + off);
        }
        char lbl[160];
        bool alive[KVF_ROLE_COUNT];

        family(o, "kvferry_info", "gauge",
               "Constant 1; the labels say what the instance is (role, backend, rank, layout "
               "version)");
        lbl[0] = 0; /* (fixed text: a replay has it in the template) */
        if (o->mode != OUT_REPLAY)
                snprintf(lbl, sizeof(lbl),
                 "role=\"%s\",backend=\"%s\",rank=\"%u\",nranks=\"%u\",version=\"%s\"",
                 kvf_irole_name(h->instance_role),
                 h->backend == KVF_BACKEND_CUDA         ? "cuda"
                 : h->backend == KVF_BACKEND_HOST_ASYNC ? "host-async"
                                                        : "host",
                 h->rank, h->nranks, KVFERRY_VERSION);
        sample(o, "kvferry_info", lbl, 1);

        /* Transfers by how they ended. */
        family(o, "kvferry_transfers_total", "counter",
               "Requests (transfers) ended, by status: finished, or the reason they failed");
        sample(o, "kvferry_transfers_total", "status=\"finished\"",
               ctr(c, KVF_CTR_REQUESTS_FINISHED));
        for (size_t i = 0; i < sizeof(failed_by) / sizeof(failed_by[0]); i++) {
                sample_kv(o, "kvferry_transfers_total", "", "status", failed_by[i].status,
                          ctr(c, failed_by[i].id));
        }
        counter1(o, c, "kvferry_num_failed_transfers_total", KVF_CTR_REQUESTS_FAILED,
                 "Requests (transfers) that failed, whatever the reason (vLLM NIXL: "
                 "nixl_num_failed_transfers)");
        counter1(o, c, "kvferry_num_failed_notifications_total", KVF_CTR_NOTICES_FAILED,
                 "Notices (finish, abort, withdrawal notices between the instances, and their "
                 "answers in notice rings) that could not be delivered: the peer was gone or "
                 "unreachable, a send failed, or the answer never came and the request failed "
                 "(vLLM NIXL: nixl_num_failed_notifications)");
        counter1(o, c, "kvferry_notices_reissued_total", KVF_CTR_NOTICES_REISSUED,
                 "Finish notices handed over again after a connector or sender restart (the peer "
                 "de-duplicates them)");
        counter1(o, c, "kvferry_num_kv_expired_reqs_total", KVF_CTR_FAILED_TIMEOUT,
                 "Requests ended 'timed out': not finished within --request-timeout-ms of their "
                 "task (vLLM NIXL: nixl_num_kv_expired_reqs)");
        counter1(o, c, "kvferry_tasks_accepted_total", KVF_CTR_TASKS_ACCEPTED,
                 "Tasks the sender accepted into its request table");
        counter1(o, c, "kvferry_tasks_rejected_total", KVF_CTR_TASKS_REJECTED,
                 "Tasks the sender refused at once (bad task, table full, ...)");
        counter1(o, c, "kvferry_arrivals_total", KVF_CTR_ARRIVALS,
                 "Arrivals published to the decode engine (decode side)");

        /* Bytes. */
        uint64_t b_ipc = ctr(c, KVF_CTR_BYTES_IPC), b_tcp = ctr(c, KVF_CTR_BYTES_TCP),
                 b_rdma = ctr(c, KVF_CTR_BYTES_RDMA);
        family(o, "kvferry_transport_bytes_total", "counter",
               "Bytes of KV cache moved by this instance's sender, by transport");
        sample(o, "kvferry_transport_bytes_total", "transport=\"ipc\"", b_ipc);
        sample(o, "kvferry_transport_bytes_total", "transport=\"tcp\"", b_tcp);
        sample(o, "kvferry_transport_bytes_total", "transport=\"rdma\"", b_rdma);
        counter1(o, c, "kvferry_received_bytes_total", KVF_CTR_BYTES_TCP_RECEIVED,
                 "Bytes of KV cache received over tcp (decode side)");
        histogram(o, "kvferry_bytes_transferred", c, KVF_HIST_REQ_BYTES,
                  &sizes_bytes,
                  "Bytes of each finished transfer (request), one observation per transfer (vLLM "
                  "NIXL: nixl_bytes_transferred)");
        /* Descriptors: the units handed to a transport. */
        uint64_t d_frames = ctr(c, KVF_CTR_FRAMES_TCP), d_wr = ctr(c, KVF_CTR_RDMA_WRITES),
                 d_copy = ctr(c, KVF_CTR_COPY_BATCHES);
        family(o, "kvferry_descriptors_total", "counter",
               "Units of work handed to a transport: tcp data frames, rdma write work requests, "
               "same-host copy batches");
        sample(o, "kvferry_descriptors_total", "kind=\"tcp_frame\"", d_frames);
        sample(o, "kvferry_descriptors_total", "kind=\"rdma_write\"", d_wr);
        sample(o, "kvferry_descriptors_total", "kind=\"copy_batch\"", d_copy);
        histogram(o, "kvferry_num_descriptors", c, KVF_HIST_REQ_DESCS, &sizes_descs,
                  "Descriptors of each finished transfer: copy runs (ipc), data frames (tcp), "
                  "write work requests (rdma) (vLLM NIXL: nixl_num_descriptors)");

        /* Latency (the sender's histograms). */
        histogram(o, "kvferry_xfer_time_seconds", c, KVF_HIST_REQ_XFER, &seconds,
                  "Time of each finished transfer, from its first bytes handed to a copy or the "
                  "connector to its completion (vLLM NIXL: nixl_xfer_time_seconds)");
        histogram(o, "kvferry_batch_time_seconds", c, KVF_HIST_COPY, &seconds,
                  "Time from posting one layer's batch of copies or writes to its completion");
        histogram(o, "kvferry_tail_seconds", c, KVF_HIST_LAST_TO_DONE, &seconds,
                  "Time from a request's last layer being ready to its completion");
        histogram(
            o, "kvferry_copy_start_seconds", c, KVF_HIST_LAYER_TO_COPY, &seconds,
            "Time from the engine publishing a layer-done event to the sender starting its copy");

        /* Rings. */
        family(o, "kvferry_ring_used_bytes", "gauge",
               "Bytes of records written and not yet consumed");
        for (int r = 0; r < KVF_RING_COUNT; r++) {
                sample_kv(o, "kvferry_ring_used_bytes", "", "ring", kvf_ring_name(r),
                          kvf_ring_used(&c->ring_hdrs[r]));
        }
        family(o, "kvferry_ring_capacity_bytes", "gauge", "Size of each ring");
        for (int r = 0; r < KVF_RING_COUNT; r++) {
                sample_kv(o, "kvferry_ring_capacity_bytes", "", "ring", kvf_ring_name(r),
                          h->ring_capacity[r]);
        }
        family(o, "kvferry_ring_full_events_total", "counter",
               "Writes refused because the ring was full (the writer retries or holds back)");
        for (int r = 0; r < KVF_RING_COUNT; r++) {
                sample_kv(o, "kvferry_ring_full_events_total", "", "ring", kvf_ring_name(r),
                          kvf_load_relaxed(&c->ring_hdrs[r].full_events));
        }

        /* Roles. */
        family(o, "kvferry_role_up", "gauge",
               "1 when the role's process is alive and its heartbeat fresh");
        roles_alive(s, sc, now, alive);
        for (int r = 0; r < KVF_ROLE_COUNT; r++) {
                sample_kv(o, "kvferry_role_up", "", "role", kvf_role_name(r), alive[r]);
        }
        family(o, "kvferry_role_restarts_total", "counter",
               "Starts of the role after its first (the supervisor restarted it; engine: "
               "re-attaches)");
        for (int r = 0; r < KVF_ROLE_COUNT; r++) {
                sample_kv(o, "kvferry_role_restarts_total", "", "role", kvf_role_name(r),
                          kvf_load_relaxed(&c->roles[r].restarts));
        }

        /* Peers and refusals. */
        counter1(o, c, "kvferry_peer_connects_total", KVF_CTR_PEER_CONNECTS,
                 "Peer connections established (handshake passed)");
        counter1(o, c, "kvferry_peer_failures_total", KVF_CTR_PEER_FAILURES,
                 "Peer connections that failed or were lost");
        /* The connector's gauges; nothing is connected while it is not running. */
        bool conn_alive = alive[KVF_ROLE_CONNECTOR];
        family(o, "kvferry_peers", "gauge",
               "The connector's peers by state: connected, connecting (a connect or handshake "
               "under way), failed (its last attempts failed; retried after a back-off)");
        sample(o, "kvferry_peers", "state=\"connected\"",
               conn_alive ? ctr(c, KVF_CTR_PEERS_CONNECTED) : 0);
        sample(o, "kvferry_peers", "state=\"connecting\"",
               conn_alive ? ctr(c, KVF_CTR_PEERS_CONNECTING) : 0);
        sample(o, "kvferry_peers", "state=\"failed\"",
               conn_alive ? ctr(c, KVF_CTR_PEERS_FAILED) : 0);
        counter1(o, c, "kvferry_peers_retired_total", KVF_CTR_PEERS_RETIRED,
                 "Peers closed after --peer-idle-ms without work");
        counter1(o, c, "kvferry_auth_failures_total", KVF_CTR_AUTH_FAILURES,
                 "Handshakes refused: the peer did not prove the shared token");
        counter1(o, c, "kvferry_bad_records_total", KVF_CTR_BAD_RECORDS,
                 "Ring records refused as malformed");
        counter1(o, c, "kvferry_frames_rejected_total", KVF_CTR_FRAMES_REJECTED,
                 "Network frames refused as malformed or out of bounds");
        counter1(o, c, "kvferry_errors_logged_total", KVF_CTR_ERRORS_LOGGED,
                 "Errors written to the instance's error log (kvf-ringdump shows them)");

        /* Every counter of the segment, by its ring-dump name. */
        family(o, "kvferry_segment_events_total", "counter",
               "Every counter of the control segment, by its name in kvf-ringdump "
               "(common/counters.h)");
        uint32_t n = h->counters_count < KVF_COUNTER_COUNT ? h->counters_count : KVF_COUNTER_COUNT;
        for (uint32_t i = 0; i < n; i++) {
                if (KVF_CTR_IS_GAUGE(i)) /* (kvferry_peers) */
                        continue;
                sample_kv(o, "kvferry_segment_events_total", "", "counter", kvf_counter_names[i],
                          ctr(c, (enum kvf_counter_id)i));
        }

        family(o, "kvferry_scrape_timestamp_seconds", "gauge",
               "CLOCK_REALTIME when this page was made");
        out_s(o, "kvferry_scrape_timestamp_seconds{instance=\"");
        out_s(o, o->inst);
        out_s(o, "\"} ");
        /* %.3f of the seconds, without printf's floating point (once a page) */
        uint64_t ms = (kvf_wall_ns() + 500000) / 1000000;
        char ts[32];
        int tn = snprintf(ts, sizeof(ts), "%llu.%03u", (unsigned long long)(ms / 1000),
                          (unsigned)(ms % 1000));
        out_number(o, ts, (size_t)tn);
        out_s(o, "\n");
}

/* ---- HTTP ---- */

static char inst_label[2 * KVF_INSTANCE_MAX];

static struct page_shape shape_of(const struct kvf_ctl_header *h)
{
        return (struct page_shape){.instance_role = h->instance_role,
                                   .backend = h->backend,
                                   .rank = h->rank,
                                   .nranks = h->nranks,
                                   .counters_count = h->counters_count};
}

/* The page into o: from the template when it fits this segment, else in full (recorded). */
static void render_page(struct out *o, struct seg *s, struct scan *sc, bool up)
{
        if (!up) {
                o->mode = OUT_PLAIN;
                render(o, s, sc, false);
                return;
        }
        struct page_shape shape = shape_of(s->ctl.hdr);
        if (tmpl.valid && !memcmp(&shape, &tmpl.shape, sizeof(shape))) {
                o->mode = OUT_REPLAY;
                render(o, s, sc, true);
                out_end(o);
                if (!o->mismatch || o->oom)
                        return;
                o->len = 0; /* (not seen: the template is per attachment) */
                o->mismatch = false;
        }
        page_forget();
        o->mode = OUT_RECORD;
        render(o, s, sc, true);
        if (!o->oom) {
                tmpl.valid = true;
                tmpl.shape = shape;
        } else {
                page_forget();
        }
}

/* Page buffers sent and given back, for the next scrapes (one per connection at most). */
static struct pagebuf *pool[MAX_CONNECTIONS];
static unsigned npool;

/* libmicrohttpd's thread, when a response is done with (or at MHD_stop_daemon). */
static void page_release(void *cls)
{
        if (npool < MAX_CONNECTIONS)
                pool[npool++] = cls;
        else
                free(cls);
}

static struct pagebuf *page_take(void)
{
        if (npool)
                return pool[--npool];
        struct pagebuf *pb = malloc(sizeof(*pb) + (64u << 10));
        if (pb)
                pb->cap = 64u << 10;
        return pb;
}

static enum MHD_Result reply(struct MHD_Connection *conn, unsigned status, const char *type,
                             char *body, size_t len)
{
        struct MHD_Response *r =
            MHD_create_response_from_buffer(len, body, MHD_RESPMEM_PERSISTENT);
        if (!r)
                return MHD_NO;
        MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE, type);
        enum MHD_Result ret = MHD_queue_response(conn, status, r);
        MHD_destroy_response(r);
        return ret;
}

static enum MHD_Result handle(void *cls, struct MHD_Connection *conn, const char *url,
                              const char *method, const char *version, const char *upload,
                              size_t *upload_len, void **con_cls)
{
        (void)cls, (void)version, (void)upload;
        static int first;
        if (*con_cls == NULL) { /* headers only so far: answer once the request is whole */
                *con_cls = &first;
                return MHD_YES;
        }
        static char not_found[] = "not found; the metrics are at /metrics\n";
        static char bad_method[] = "only GET and HEAD are served\n";
        static char oom[] = "out of memory\n";
        if (*upload_len) {
                *upload_len = 0; /* a body is read and dropped */
                return MHD_YES;
        }
        if (strcmp(method, "GET") && strcmp(method, "HEAD"))
                return reply(conn, MHD_HTTP_METHOD_NOT_ALLOWED, "text/plain", bad_method,
                             strlen(bad_method));
        if (strcmp(url, "/metrics"))
                return reply(conn, MHD_HTTP_NOT_FOUND, "text/plain", not_found,
                             strlen(not_found));
        struct out o = {.pb = page_take(), .inst = inst_label};
        if (!o.pb)
                return reply(conn, MHD_HTTP_INTERNAL_SERVER_ERROR, "text/plain", oom, strlen(oom));
        o.buf = o.pb->text;
        o.cap = o.pb->cap;
        struct scan sc = {.done = false};
        bool up = seg_current(&seg, &sc);
        render_page(&o, &seg, &sc, up);
        struct MHD_Response *r =
            o.oom ? NULL
                  : MHD_create_response_from_buffer_with_free_callback_cls(o.len, o.buf,
                                                                           page_release, o.pb);
        if (!r) {
                page_release(o.pb);
                return reply(conn, MHD_HTTP_INTERNAL_SERVER_ERROR, "text/plain", oom, strlen(oom));
        }
        MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE,
                                "text/plain; version=0.0.4; charset=utf-8");
        enum MHD_Result ret = MHD_queue_response(conn, MHD_HTTP_OK, r);
        MHD_destroy_response(r);
        return ret;
}

/* HOST:PORT or [HOST]:PORT to a socket address; -EINVAL with kvf_err. */
static int parse_listen(const char *s, struct sockaddr_storage *ss, socklen_t *sl)
{
        char host[64];
        const char *colon = strrchr(s, ':');
        if (!colon || colon == s || !colon[1])
                return kvf_err_set(-EINVAL, "--listen '%s': want HOST:PORT", s);
        size_t hl = (size_t)(colon - s);
        const char *h = s;
        if (s[0] == '[' && colon[-1] == ']') {
                h = s + 1;
                hl -= 2;
        }
        if (hl >= sizeof(host))
                return kvf_err_set(-EINVAL, "--listen '%s': host too long", s);
        memcpy(host, h, hl);
        host[hl] = 0;
        char *end;
        errno = 0;
        unsigned long port = strtoul(colon + 1, &end, 10);
        if (*end || errno || port > 65535)
                return kvf_err_set(-EINVAL, "--listen '%s': port must be 0 to 65535", s);
        struct addrinfo hints = {.ai_flags = AI_NUMERICHOST | AI_PASSIVE,
                                 .ai_socktype = SOCK_STREAM};
        struct addrinfo *ai = NULL;
        int g = getaddrinfo(host, NULL, &hints, &ai);
        if (g || !ai)
                return kvf_err_set(-EINVAL, "--listen '%s': '%s' is not an IP address (%s)", s,
                                   host, gai_strerror(g));
        memcpy(ss, ai->ai_addr, ai->ai_addrlen);
        *sl = ai->ai_addrlen;
        freeaddrinfo(ai);
        if (ss->ss_family == AF_INET)
                ((struct sockaddr_in *)ss)->sin_port = htons((uint16_t)port);
        else
                ((struct sockaddr_in6 *)ss)->sin6_port = htons((uint16_t)port);
        return 0;
}

int main(int argc, char **argv)
{
        const char *inst = NULL, *listen_at = NULL;
        enum { O_INST = 1, O_LISTEN, O_HELP, O_VERSION };
        static const struct option opts[] = {{"instance", required_argument, 0, O_INST},
                                             {"listen", required_argument, 0, O_LISTEN},
                                             {"help", no_argument, 0, O_HELP},
                                             {"version", no_argument, 0, O_VERSION},
                                             {0, 0, 0, 0}};
        int ch;
        while ((ch = getopt_long(argc, argv, "", opts, NULL)) != -1) {
                switch (ch) {
                case O_INST:
                        inst = optarg;
                        break;
                case O_LISTEN:
                        listen_at = optarg;
                        break;
                case O_HELP:
                        usage();
                        return 0;
                case O_VERSION:
                        printf("%s %s\n", prog, KVFERRY_VERSION);
                        return 0;
                default:
                        fprintf(stderr, "Try '%s --help'.\n", prog);
                        return 2;
                }
        }
        if (optind < argc)
                kvf_opt_die(prog, "unexpected argument '%s'", argv[optind]);
        if (!inst)
                kvf_opt_die(prog, "--instance is required");
        if (!listen_at)
                kvf_opt_die(prog, "--listen HOST:PORT is required");
        if (kvf_instance_name_check(inst) < 0)
                kvf_opt_die(prog, "%s", kvf_err_msg());
        struct sockaddr_storage ss;
        socklen_t sl;
        if (parse_listen(listen_at, &ss, &sl) < 0)
                kvf_opt_die(prog, "%s", kvf_err_msg());
        /* Instance names are [A-Za-z0-9_.-]: nothing to escape in a label value. */
        snprintf(inst_label, sizeof(inst_label), "%s", inst);
        hist_kind_init(&seconds);
        hist_kind_init(&sizes_bytes);
        hist_kind_init(&sizes_descs);
        seg.instance = inst;
        for (int r = 0; r < KVF_ROLE_COUNT; r++)
                seg.watch[r].fd = -1;
        snprintf(seg.path, sizeof(seg.path), "/dev/shm/kvferry.%s", inst);
        seg.file = strrchr(seg.path, '/') + 1;
        /* (Without inotify, every scrape looks at the file.) */
        seg.ino_fd = inotify_init1(IN_NONBLOCK | IN_CLOEXEC);
        if (seg.ino_fd >= 0 &&
            inotify_add_watch(seg.ino_fd, "/dev/shm",
                              IN_CREATE | IN_DELETE | IN_MOVED_FROM | IN_MOVED_TO | IN_DELETE_SELF |
                                  IN_MOVE_SELF) < 0) {
                close(seg.ino_fd);
                seg.ino_fd = -1;
        }

        int stop = 0;
        kvf_opt_signals(&stop);
        unsigned flags = MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_POLL;
        if (ss.ss_family == AF_INET6)
                flags |= MHD_USE_IPv6;
        errno = 0;
        struct MHD_Daemon *d =
            MHD_start_daemon(flags, 0, NULL, NULL, handle, NULL, MHD_OPTION_SOCK_ADDR,
                             (struct sockaddr *)&ss, MHD_OPTION_CONNECTION_LIMIT, MAX_CONNECTIONS,
                             MHD_OPTION_CONNECTION_TIMEOUT, CONNECTION_TIMEOUT_S,
                             MHD_OPTION_CONNECTION_MEMORY_LIMIT, (size_t)CONNECTION_MEMORY,
                             MHD_OPTION_END);
        if (!d) {
                fprintf(stderr, "%s: instance %s: cannot listen on %s: %s\n", prog, inst, listen_at,
                        errno ? strerror(errno) : "libmicrohttpd could not start its daemon");
                return 1;
        }
        const union MHD_DaemonInfo *di = MHD_get_daemon_info(d, MHD_DAEMON_INFO_BIND_PORT);
        fprintf(stderr, "%s: instance %s: serving http://%s/metrics (port %u)\n", prog, inst,
                listen_at, di ? (unsigned)di->port : 0u);
        fflush(stderr);
        while (!kvf_load_relaxed(&stop))
                kvf_sleep_ns(kvf_ms(200));
        MHD_stop_daemon(d);
        seg_detach(&seg);
        for (unsigned i = 0; i < npool; i++)
                free(pool[i]);
        free(tmpl.text);
        free(tmpl.marks);
        if (seg.ino_fd >= 0)
                close(seg.ino_fd);
        fprintf(stderr, "%s: instance %s: stopped\n", prog, inst);
        return 0;
}

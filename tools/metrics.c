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
 * Exit codes: 0 stopped by SIGTERM/SIGINT, 1 cannot listen, 2 usage.
 */
#include <arpa/inet.h>
#include <errno.h>
#include <getopt.h>
#include <microhttpd.h>
#include <netdb.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
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

struct seg {
        const char *instance;
        char path[96];
        bool attached;
        dev_t dev;
        ino_t ino;
        struct kvf_ctl ctl;
};

static struct seg seg;

/* 0: attached to the instance's current segment; <0: none (kvf_err says why). */
static int seg_refresh(struct seg *s)
{
        struct stat st;
        if (stat(s->path, &st) < 0) {
                if (s->attached) {
                        kvf_ctl_detach(&s->ctl);
                        s->attached = false;
                }
                return -ENOENT;
        }
        if (s->attached && st.st_dev == s->dev && st.st_ino == s->ino)
                return 0;
        if (s->attached) {
                kvf_ctl_detach(&s->ctl);
                s->attached = false;
        }
        int rc = kvf_ctl_attach(s->instance, false, &s->ctl);
        if (rc < 0)
                return rc;
        s->attached = true;
        s->dev = st.st_dev;
        s->ino = st.st_ino;
        return 0;
}

/* ---- the text ---- */

struct out {
        char *buf;
        size_t len, cap;
        bool oom;
        const char *inst; /* the instance label's value, escaped */
};

static void outf(struct out *o, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void outf(struct out *o, const char *fmt, ...)
{
        if (o->oom)
                return;
        for (;;) {
                va_list ap;
                va_start(ap, fmt);
                int n = vsnprintf(o->buf + o->len, o->cap - o->len, fmt, ap);
                va_end(ap);
                if (n < 0) {
                        o->oom = true;
                        return;
                }
                if ((size_t)n < o->cap - o->len) {
                        o->len += (size_t)n;
                        return;
                }
                size_t cap = o->cap * 2 + (size_t)n;
                char *b = realloc(o->buf, cap);
                if (!b) {
                        o->oom = true;
                        return;
                }
                o->buf = b;
                o->cap = cap;
        }
}

/*
 * The lines of a page are strings and integers put together without printf: a page is a few
 * hundred lines, and printf's format parsing was half of what a scrape cost (perf, 96 us a page).
 */
static bool out_room(struct out *o, size_t n)
{
        if (o->oom)
                return false;
        if (o->cap - o->len > n)
                return true;
        size_t cap = o->cap * 2 + n;
        char *b = realloc(o->buf, cap);
        if (!b) {
                o->oom = true;
                return false;
        }
        o->buf = b;
        o->cap = cap;
        return true;
}

static void out_s(struct out *o, const char *str)
{
        size_t n = strlen(str);
        if (!out_room(o, n))
                return;
        memcpy(o->buf + o->len, str, n);
        o->len += n;
}

static void out_u64(struct out *o, uint64_t v)
{
        char d[24];
        size_t n = 0;
        do {
                d[sizeof(d) - ++n] = (char)('0' + v % 10);
                v /= 10;
        } while (v);
        if (!out_room(o, n))
                return;
        memcpy(o->buf + o->len, d + sizeof(d) - n, n);
        o->len += n;
}

static void family(struct out *o, const char *name, const char *type, const char *help)
{
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
};
static const struct hist_kind seconds = {le_s, sizeof(le_s) / sizeof(le_s[0]), 1e9};
static const struct hist_kind sizes_bytes = {le_bytes, sizeof(le_bytes) / sizeof(le_bytes[0]), 1};
static const struct hist_kind sizes_descs = {le_descs, sizeof(le_descs) / sizeof(le_descs[0]), 1};

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
static void histogram(struct out *o, const char *name, const struct kvf_histogram *h,
                      const struct hist_kind *k, const char *help)
{
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
                while (i + 1 < KVF_HIST_BUCKETS && bucket_low(i + 1) <= k->le[j].raw) {
                        cum += b[i];
                        i++;
                }
                sample_kv(o, name, "_bucket", "le", k->le[j].le, cum);
        }
        sample_kv(o, name, "_bucket", "le", "+Inf", total);
        if (k->unit == 1)
                outf(o, "%s_sum{instance=\"%s\"} %llu\n", name, o->inst, (unsigned long long)sum);
        else
                outf(o, "%s_sum{instance=\"%s\"} %.9g\n", name, o->inst, (double)sum / k->unit);
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

static void render(struct out *o, const struct kvf_ctl *c, bool up)
{
        family(o, "kvferry_up", "gauge",
               "1 when the instance's control segment is mapped and valid, else 0");
        sample(o, "kvferry_up", NULL, up);
        if (!up)
                return;
        const struct kvf_ctl_header *h = c->hdr;
        uint64_t now = kvf_now_ns();
        char lbl[160];
        bool alive[KVF_ROLE_COUNT]; /* (each a read of /proc: once a page) */

        family(o, "kvferry_info", "gauge",
               "Constant 1; the labels say what the instance is (role, backend, rank, layout "
               "version)");
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
        histogram(o, "kvferry_bytes_transferred", &c->sender->hist[KVF_HIST_REQ_BYTES],
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
        histogram(o, "kvferry_num_descriptors", &c->sender->hist[KVF_HIST_REQ_DESCS], &sizes_descs,
                  "Descriptors of each finished transfer: copy runs (ipc), data frames (tcp), "
                  "write work requests (rdma) (vLLM NIXL: nixl_num_descriptors)");

        /* Latency (the sender's histograms). */
        histogram(o, "kvferry_xfer_time_seconds", &c->sender->hist[KVF_HIST_REQ_XFER], &seconds,
                  "Time of each finished transfer, from its first bytes handed to a copy or the "
                  "connector to its completion (vLLM NIXL: nixl_xfer_time_seconds)");
        histogram(o, "kvferry_batch_time_seconds", &c->sender->hist[KVF_HIST_COPY], &seconds,
                  "Time from posting one layer's batch of copies or writes to its completion");
        histogram(o, "kvferry_tail_seconds", &c->sender->hist[KVF_HIST_LAST_TO_DONE], &seconds,
                  "Time from a request's last layer being ready to its completion");
        histogram(
            o, "kvferry_copy_start_seconds", &c->sender->hist[KVF_HIST_LAYER_TO_COPY], &seconds,
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
        for (int r = 0; r < KVF_ROLE_COUNT; r++) {
                alive[r] = kvf_role_alive(c, (enum kvf_role_id)r, now);
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
        outf(o, "kvferry_scrape_timestamp_seconds{instance=\"%s\"} %.3f\n", o->inst,
             (double)kvf_wall_ns() / 1e9);
}

/* ---- HTTP ---- */

static char inst_label[2 * KVF_INSTANCE_MAX];

static enum MHD_Result reply(struct MHD_Connection *conn, unsigned status, const char *type,
                             char *body, size_t len, enum MHD_ResponseMemoryMode mode)
{
        struct MHD_Response *r = MHD_create_response_from_buffer(len, body, mode);
        if (!r) {
                if (mode == MHD_RESPMEM_MUST_FREE)
                        free(body);
                return MHD_NO;
        }
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
                             strlen(bad_method), MHD_RESPMEM_PERSISTENT);
        if (strcmp(url, "/metrics"))
                return reply(conn, MHD_HTTP_NOT_FOUND, "text/plain", not_found, strlen(not_found),
                             MHD_RESPMEM_PERSISTENT);
        struct out o = {.cap = 64 << 10, .inst = inst_label};
        o.buf = malloc(o.cap);
        if (!o.buf)
                return reply(conn, MHD_HTTP_INTERNAL_SERVER_ERROR, "text/plain", oom, strlen(oom),
                             MHD_RESPMEM_PERSISTENT);
        bool up = seg_refresh(&seg) == 0;
        render(&o, &seg.ctl, up);
        if (o.oom) {
                free(o.buf);
                return reply(conn, MHD_HTTP_INTERNAL_SERVER_ERROR, "text/plain", oom, strlen(oom),
                             MHD_RESPMEM_PERSISTENT);
        }
        return reply(conn, MHD_HTTP_OK, "text/plain; version=0.0.4; charset=utf-8", o.buf, o.len,
                     MHD_RESPMEM_MUST_FREE);
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
        seg.instance = inst;
        snprintf(seg.path, sizeof(seg.path), "/dev/shm/kvferry.%s", inst);

        int stop = 0;
        kvf_opt_signals(&stop);
        unsigned flags = MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_POLL;
        if (ss.ss_family == AF_INET6)
                flags |= MHD_USE_IPv6;
        errno = 0;
        struct MHD_Daemon *d =
            MHD_start_daemon(flags, 0, NULL, NULL, handle, NULL, MHD_OPTION_SOCK_ADDR,
                             (struct sockaddr *)&ss, MHD_OPTION_CONNECTION_LIMIT, MAX_CONNECTIONS,
                             MHD_OPTION_CONNECTION_TIMEOUT, CONNECTION_TIMEOUT_S, MHD_OPTION_END);
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
        if (seg.attached)
                kvf_ctl_detach(&seg.ctl);
        fprintf(stderr, "%s: instance %s: stopped\n", prog, inst);
        return 0;
}

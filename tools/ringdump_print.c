/*
 * kvf_dump(): print a control segment as text or JSON, reading only.
 *
 * The segment is hostile input (STYLE.md habit 7): it may be a live segment
 * that other processes write while we read, a corrupt copy, or fuzz bytes.
 * So: kvf_ctl_validate() first; then values that change at run time (ring
 * positions, slot states) are loaded once into locals, and every index, size
 * and string taken from them is checked against the segment and the arrays
 * before use. Ring records are walked here, never through kvf_ring_read(),
 * which writes (it zeroes and moves head).
 */
#include "ringdump_print.h"

#include "cache.h"

#include <errno.h>
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "atomics.h"
#include "clock.h"
#include "ctl.h"
#include "doorbell.h"
#include "err.h"
#include "layout.h"
#include "notice.h"
#include "kvferry.h"
#include "records.h"
#include "registration.h"

#define JSON_DEPTH 16

struct dump {
        FILE *f;
        bool json;
        const struct kvf_dump_opts *o;
        unsigned max_records;
        uint64_t now;
        uint8_t *base;
        uint64_t size;
        struct kvf_ctl c;        /* views filled by kvf_ctl_validate() */
        struct kvf_ctl_header h; /* a private copy of the header */
        /* JSON writer: whether the container at each depth has an element yet */
        int depth;
        bool nonempty[JSON_DEPTH];
        /* the pending-record entry being printed has a "record" / an "error" */
        bool rec_record, rec_error;
};

static const struct kvf_dump_opts default_opts = {.records = true, .check_pids = true};

/* ---- strings ---- */

void kvf_dump_json_str(FILE *out, const char *str, size_t n)
{
        const unsigned char *s = (const unsigned char *)str;

        for (size_t i = 0; i < n;) {
                unsigned c = s[i];
                size_t k = kvf_utf8_seq(s + i, n - i);
                if (k == 0) {
                        fputs("\\ufffd", out);
                        i++;
                        continue;
                }
                if (k > 1) {
                        fwrite(s + i, 1, k, out);
                        i += k;
                        continue;
                }
                i++;
                switch (c) {
                case '"':
                        fputs("\\\"", out);
                        break;
                case '\\':
                        fputs("\\\\", out);
                        break;
                case '\n':
                        fputs("\\n", out);
                        break;
                case '\r':
                        fputs("\\r", out);
                        break;
                case '\t':
                        fputs("\\t", out);
                        break;
                default:
                        if (c < 0x20 || c == 0x7f)
                                fprintf(out, "\\u%04x", c);
                        else
                                fputc((int)c, out);
                }
        }
}

/*
 * Text-mode escaping into buf: printable ASCII and valid UTF-8 pass (C1
 * controls do not: a terminal may act on them), everything else becomes
 * \xNN, so a hostile string cannot move the cursor or forge lines. With
 * `quote`, '"' and '\\' are escaped too, for a value printed in quotes. Cut
 * with "..." when buf is too small. Returns buf.
 */
static const char *esc_q(char *buf, size_t cap, const char *str, size_t n, bool quote)
{
        const unsigned char *s = (const unsigned char *)str;
        size_t o = 0;

        if (cap < 8) {
                if (cap)
                        buf[0] = '\0';
                return buf;
        }
        /* Invariant: o <= cap - 4, so "...\0" always fits after the output. */
        for (size_t i = 0; i < n;) {
                size_t k = kvf_utf8_seq(s + i, n - i);
                /* C1 controls, and the line and paragraph separators U+2028/2029 */
                bool c1 = (k == 2 && s[i] == 0xc2 && s[i + 1] < 0xa0) ||
                          (k == 3 && s[i] == 0xe2 && s[i + 1] == 0x80 && (s[i + 2] == 0xa8 || s[i + 2] == 0xa9));
                char tmp[16];
                size_t tn;
                if (quote && k == 1 && (s[i] == '"' || s[i] == '\\')) {
                        tmp[0] = '\\';
                        tmp[1] = (char)s[i];
                        tn = 2;
                } else if (k == 1 && s[i] >= 0x20 && s[i] < 0x7f) {
                        tmp[0] = (char)s[i];
                        tn = 1;
                } else if (k > 1 && !c1) {
                        memcpy(tmp, s + i, k);
                        tn = k;
                } else {
                        k = c1 ? k : 1; /* (a separator: its three bytes) */
                        tn = 0;
                        for (size_t j = 0; j < k; j++)
                                tn += (size_t)snprintf(tmp + tn, sizeof(tmp) - tn, "\\x%02x", s[i + j]);
                }
                if (o + tn > cap - 4) {
                        memcpy(buf + o, "...", 4);
                        return buf;
                }
                memcpy(buf + o, tmp, tn);
                o += tn;
                i += k;
        }
        buf[o] = '\0';
        return buf;
}

static const char *esc(char *buf, size_t cap, const char *str, size_t n)
{
        return esc_q(buf, cap, str, n, false);
}

/* The string in a fixed array that may lack its NUL. */
static size_t fixlen(const char *s, size_t cap)
{
        return strnlen(s, cap);
}

static const char *iso_time(char *buf, size_t cap, uint64_t ns)
{
        time_t sec = (time_t)(ns / 1000000000ull);
        struct tm tm;

        if (ns == 0 || !gmtime_r(&sec, &tm)) {
                snprintf(buf, cap, "-");
                return buf;
        }
        size_t n = strftime(buf, cap, "%Y-%m-%dT%H:%M:%S", &tm);
        snprintf(buf + n, cap - n, ".%03uZ", (unsigned)(ns / 1000000ull % 1000));
        return buf;
}

static const char *human_bytes(char *buf, size_t cap, uint64_t v)
{
        static const char *const units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
        double x = (double)v;
        unsigned u = 0;

        while (x >= 1024 && u + 1 < sizeof(units) / sizeof(units[0])) {
                x /= 1024;
                u++;
        }
        if (u == 0)
                snprintf(buf, cap, "%" PRIu64 " B", v);
        else
                snprintf(buf, cap, "%.1f %s", x, units[u]);
        return buf;
}

/* Signed age in ms of a CLOCK_MONOTONIC stamp (negative: in the future). */
static int64_t age_ms(uint64_t now, uint64_t then)
{
        if (then <= now)
                return (int64_t)((now - then) / 1000000ull);
        return -(int64_t)((then - now) / 1000000ull);
}

/* This boot's id, read once (it opens a /proc file). */
static uint64_t boot_id(void)
{
        static uint64_t id;
        uint64_t v = kvf_load_relaxed(&id);

        if (!v) {
                v = kvf_boot_id(); /* never 0 */
                kvf_store_relaxed(&id, v);
        }
        return v;
}

/* ---- names ---- */

static const char *backend_name(uint32_t b)
{
        const struct kvf_cache_backend *be = kvf_cache_backend(b);
        return be ? be->name : b == KVF_BACKEND_CUDA ? "cuda" : "unknown";
}

static const char *executor_name(uint32_t e)
{
        switch (e) {
        case KVF_EXEC_NONE:
                return "none";
        case KVF_EXEC_SENDER:
                return "sender";
        case KVF_EXEC_ENGINE:
                return "engine";
        }
        return "unknown";
}

/* How the host cache is backed; a segment that does not say is /dev/shm in 4 KiB pages. */
static const char *cache_backing_name(uint32_t b)
{
        switch (b) {
        case 0:
                return "not recorded";
        case KVF_CACHE_SHM:
                return "shm";
        case KVF_CACHE_HUGETLBFS:
                return "hugetlbfs";
        case KVF_CACHE_SHM_THP:
                return "shm-thp";
        }
        return "unknown";
}

static void hex(char *out, const uint8_t *b, size_t n)
{
        static const char digits[] = "0123456789abcdef";
        for (size_t i = 0; i < n; i++) {
                out[2 * i] = digits[b[i] >> 4];
                out[2 * i + 1] = digits[b[i] & 15];
        }
        out[2 * n] = '\0';
}

static void uuid_text(char *out, size_t len, const uint8_t *u)
{
        snprintf(out, len, "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", u[0], u[1],
                 u[2], u[3], u[4], u[5], u[6], u[7], u[8], u[9], u[10], u[11], u[12], u[13], u[14], u[15]);
}

/* The engine executor's plan entries open now. */
static unsigned open_entries(const struct dump *d)
{
        unsigned n = 0;
        for (uint32_t i = 0; i < d->h.plan_slots; i++)
                n += (kvf_load_relaxed(&d->c.plan[i].ctl) & KVF_PLAN_OPEN) != 0;
        return n;
}

static uint64_t cache_page_bytes(const struct kvf_ctl_header *h)
{
        return h->cache_page_kib ? (uint64_t)h->cache_page_kib * 1024 : 4096;
}

static const char *dtype_name(uint32_t t)
{
        return kvf_dtype_size(t) ? kvf_dtype_name(t) : "unknown";
}

static const char *state_name(uint32_t s)
{
        static const char *const n[] = {"none", "starting", "running", "stopping", "stopped"};
        return s < sizeof(n) / sizeof(n[0]) ? n[s] : "invalid";
}

static const char *req_state_name(uint32_t s)
{
        static const char *const n[] = {"free", "active", "finishing", "completing", "handed-over"};
        return s < sizeof(n) / sizeof(n[0]) ? n[s] : "invalid";
}

static const char *const bell_names[KVF_BELL_COUNT] = {"sender", "connector", "engine"};

/* ---- JSON writer (comma bookkeeping; depth bounded) ---- */

static void j_key(struct dump *d, const char *k)
{
        if (d->nonempty[d->depth])
                fputc(',', d->f);
        d->nonempty[d->depth] = true;
        if (k) {
                fputc('"', d->f);
                kvf_dump_json_str(d->f, k, strlen(k));
                fputs("\":", d->f);
        }
}

static void j_open(struct dump *d, const char *k, char ch)
{
        j_key(d, k);
        fputc(ch, d->f);
        if (d->depth + 1 < JSON_DEPTH)
                d->depth++;
        d->nonempty[d->depth] = false;
}

static void j_close(struct dump *d, char ch)
{
        fputc(ch, d->f);
        if (d->depth > 0)
                d->depth--;
}

static void j_str(struct dump *d, const char *k, const char *s, size_t n)
{
        j_key(d, k);
        fputc('"', d->f);
        kvf_dump_json_str(d->f, s, n);
        fputc('"', d->f);
}

/* The bytes as lowercase hex, as a JSON string. */
static void j_hex(struct dump *d, const char *k, const char *s, size_t n)
{
        j_key(d, k);
        fputc('"', d->f);
        for (size_t i = 0; i < n; i++)
                fprintf(d->f, "%02x", (unsigned char)s[i]);
        fputc('"', d->f);
}

/* Valid UTF-8 throughout. */
static bool ids_utf8(const char *s, size_t n)
{
        for (size_t i = 0, k; i < n; i += k)
                if (!(k = kvf_utf8_seq((const uint8_t *)s + i, n - i)))
                        return false;
        return true;
}

static void j_cstr(struct dump *d, const char *k, const char *s)
{
        j_str(d, k, s, strlen(s));
}

static void j_u64(struct dump *d, const char *k, uint64_t v)
{
        j_key(d, k);
        fprintf(d->f, "%" PRIu64, v);
}

static void j_i64(struct dump *d, const char *k, int64_t v)
{
        j_key(d, k);
        fprintf(d->f, "%" PRId64, v);
}

static void j_bool(struct dump *d, const char *k, bool v)
{
        j_key(d, k);
        fputs(v ? "true" : "false", d->f);
}

static void j_null(struct dump *d, const char *k)
{
        j_key(d, k);
        fputs("null", d->f);
}

/* ---- header ---- */

static void print_header(struct dump *d)
{
        const struct kvf_ctl_header *h = &d->h;
        const struct kvf_cache_layout *l = &h->layout;
        char host[64] = "", t1[64], b1[32], b2[32], e1[256], e2[256];
        uint32_t port = 0;
        bool cinfo = kvf_connector_info_read(&d->c, host, sizeof(host), &port) == 0;
        uint64_t pw = kvf_load_relaxed(&d->c.progress->word);
        uint64_t pev = kvf_load_relaxed(&d->c.progress->events);
        bool same_boot = h->boot_id == boot_id();
        size_t inl = fixlen(h->instance, sizeof(h->instance));
        size_t cnl = fixlen(h->cache_name, sizeof(h->cache_name));

        if (d->json) {
                j_str(d, "instance", h->instance, inl);
                j_u64(d, "layout_version", h->version);
                j_cstr(d, "role", kvf_irole_name(h->instance_role));
                j_u64(d, "role_id", h->instance_role);
                j_u64(d, "rank", h->rank);
                j_u64(d, "nranks", h->nranks);
                j_cstr(d, "backend", backend_name(h->backend));
                j_u64(d, "backend_id", h->backend);
                if (h->device == KVF_DEVICE_NONE) /* no device: a host cache without --device */
                        j_null(d, "device");
                else
                        j_u64(d, "device", h->device);
                j_str(d, "cache_name", h->cache_name, cnl);
                j_cstr(d, "executor", executor_name(h->executor));
                if (h->backend == KVF_BACKEND_CUDA) {
                        char u[48], hx[2 * 64 + 1];
                        uuid_text(u, sizeof(u), h->cuda_uuid);
                        j_open(d, "cuda", '{');
                        j_cstr(d, "device_uuid", u);
                        j_cstr(d, "handle_type", "cudaIpcMemHandle_t");
                        j_cstr(d, "handles_cover", "the whole cache, one allocation, in layout order");
                        j_open(d, "handles", '[');
                        for (uint32_t i = 0; i < h->cuda_handles_count; i++) {
                                hex(hx, d->c.cuda_handles + (uint64_t)i * 64, 64);
                                j_cstr(d, NULL, hx);
                        }
                        j_close(d, ']');
                        j_close(d, '}');
                }
                if (h->executor == KVF_EXEC_ENGINE) {
                        const struct kvf_exec *x = d->c.exec;
                        uint64_t lw = kvf_load_relaxed(&x->landed);
                        j_open(d, "engine_executor", '{');
                        j_u64(d, "landed_step", KVF_PROGRESS_STEP(lw));
                        j_u64(d, "landed_layers", KVF_PROGRESS_LAYERS(lw));
                        j_u64(d, "copy_kernels", kvf_load_relaxed(&x->batches));
                        j_u64(d, "layers_claimed", kvf_load_relaxed(&x->claims));
                        j_u64(d, "copy_errors", kvf_load_relaxed(&x->errors));
                        j_u64(d, "plans_published", kvf_load_relaxed(&x->published));
                        j_u64(d, "plans_taken_back", kvf_load_relaxed(&x->taken_back));
                        j_u64(d, "plans_open", open_entries(d));
                        j_close(d, '}');
                }
                j_u64(d, "segment_bytes", d->size);
                j_u64(d, "owner_uid", h->owner_uid);
                j_u64(d, "created_ns", h->created_ns);
                j_cstr(d, "created", iso_time(t1, sizeof(t1), h->created_ns));
                j_bool(d, "same_boot", same_boot);
                j_u64(d, "heartbeat_ms", h->heartbeat_ms);
                j_open(d, "layout", '{');
                j_u64(d, "num_layers", l->num_layers);
                j_u64(d, "extra_layers", l->extra_layers);
                j_u64(d, "num_blocks", l->num_blocks);
                j_u64(d, "kv_heads", l->kv_heads);
                j_u64(d, "block_size", l->block_size);
                j_u64(d, "head_dim", l->head_dim);
                j_cstr(d, "dtype", dtype_name(l->dtype));
                j_u64(d, "dtype_id", l->dtype);
                j_bool(d, "key_only", l->key_only != 0);
                j_u64(d, "block_bytes", l->block_bytes);
                j_u64(d, "cache_bytes", l->cache_bytes);
                j_cstr(d, "scale_dtype", l->scale_dtype ? dtype_name(l->scale_dtype) : "none");
                j_u64(d, "scale_bytes", l->scale_bytes);
                j_close(d, '}');
                if (h->backend == KVF_BACKEND_HOST) {
                        j_open(d, "cache", '{');
                        j_cstr(d, "backing", cache_backing_name(h->cache_backing));
                        j_u64(d, "backing_id", h->cache_backing);
                        j_u64(d, "page_bytes", cache_page_bytes(h));
                        if (h->cache_backing)
                                j_str(d, "path", h->cache_path,
                                      fixlen(h->cache_path, sizeof(h->cache_path)));
                        else
                                j_null(d, "path");
                        j_str(d, "note", h->cache_note,
                              fixlen(h->cache_note, sizeof(h->cache_note)));
                        j_close(d, '}');
                }
                if (h->backend == KVF_BACKEND_ENGINE) {
                        uint64_t g = kvf_load_acquire(&h->reg_generation);
                        j_open(d, "engine_caches", '{');
                        j_bool(d, "registered", (g & 1) != 0);
                        j_u64(d, "generation", g);
                        j_u64(d, "pid", (uint64_t)(uint32_t)h->reg_pid);
                        j_u64(d, "regions", h->reg_regions);
                        j_u64(d, "bytes", h->reg_bytes);
                        j_bool(d, "token_major", h->reg_token_major != 0);
                        j_bool(d, "strided", h->reg_strided != 0);
                        j_cstr(d, "memory", h->reg_gpu ? "gpu" : "host");
                        if (h->reg_gpu) {
                                char u[48];
                                kvf_reg_uuid_str(h->cuda_uuid, u, sizeof(u));
                                j_cstr(d, "gpu", u);
                        }
                        j_close(d, '}');
                }
                j_open(d, "connector", '{');
                j_bool(d, "published", cinfo);
                if (cinfo) {
                        j_str(d, "host", host, fixlen(host, sizeof(host)));
                        j_u64(d, "port", port);
                } else {
                        j_null(d, "host");
                        j_null(d, "port");
                }
                j_close(d, '}');
                j_open(d, "progress", '{');
                j_u64(d, "word", pw);
                j_u64(d, "step", KVF_PROGRESS_STEP(pw));
                j_u64(d, "layers_done", KVF_PROGRESS_LAYERS(pw));
                j_u64(d, "events", pev);
                j_u64(d, "enqueued", kvf_load_relaxed(&d->c.progress->enqueued));
                j_close(d, '}');
                return;
        }
        fprintf(d->f, "instance %s: %s, rank %u/%u, %s backend",
                esc(e1, sizeof(e1), h->instance, inl), kvf_irole_name(h->instance_role), h->rank,
                h->nranks, backend_name(h->backend));
        if (h->backend == KVF_BACKEND_CUDA)
                fprintf(d->f, " (GPU %u, copies in the %s's context)", h->device, executor_name(h->executor));
        else if (cnl)
                fprintf(d->f, " (cache %s)", esc(e2, sizeof(e2), h->cache_name, cnl));
        fprintf(d->f, "\n  segment %s, created %s%s, heartbeat every %u ms\n",
                human_bytes(b1, sizeof(b1), d->size), iso_time(t1, sizeof(t1), h->created_ns),
                same_boot ? "" : " on another boot (heartbeat ages are meaningless)",
                h->heartbeat_ms);
        fprintf(
            d->f,
            "  layout: %u layers + %u extra, %u blocks, %u kv heads, block size %u, head dim %u, "
            "%s, %s\n"
            "          block %" PRIu64 " bytes, cache %" PRIu64 " bytes (%s)\n",
            l->num_layers, l->extra_layers, l->num_blocks, l->kv_heads, l->block_size, l->head_dim,
            dtype_name(l->dtype), l->key_only ? "key only" : "key+value", l->block_bytes,
            l->cache_bytes, human_bytes(b2, sizeof(b2), l->cache_bytes));
        if (l->scale_bytes)
                fprintf(d->f, "          scale tensors: %s, %" PRIu64 " bytes a block, after every layer's K/V\n",
                        dtype_name(l->scale_dtype), l->scale_bytes);
        if (h->backend == KVF_BACKEND_CUDA) {
                char u[48], hx[2 * 64 + 1];
                uuid_text(u, sizeof(u), h->cuda_uuid);
                fprintf(d->f, "  cuda: %s, %u IPC handle(s) (cudaIpcMemHandle_t, hex; one allocation, the whole "
                              "cache in layout order)\n", u, h->cuda_handles_count);
                for (uint32_t i = 0; i < h->cuda_handles_count; i++) {
                        hex(hx, d->c.cuda_handles + (uint64_t)i * 64, 64);
                        fprintf(d->f, "    handle %u: %s\n", i, hx);
                }
        }
        if (h->executor == KVF_EXEC_ENGINE) {
                const struct kvf_exec *x = d->c.exec;
                uint64_t lw = kvf_load_relaxed(&x->landed);
                fprintf(d->f,
                        "  engine executor: landed step %" PRIu64 " layer %u; %" PRIu64 " batches, %" PRIu64
                        " layers claimed, %" PRIu64 " errors; plans %" PRIu64 " published, %" PRIu64
                        " taken back, %u open\n",
                        KVF_PROGRESS_STEP(lw), KVF_PROGRESS_LAYERS(lw), kvf_load_relaxed(&x->batches),
                        kvf_load_relaxed(&x->claims), kvf_load_relaxed(&x->errors),
                        kvf_load_relaxed(&x->published), kvf_load_relaxed(&x->taken_back), open_entries(d));
        }
        if (h->backend == KVF_BACKEND_HOST) {
                size_t pl = fixlen(h->cache_path, sizeof(h->cache_path));
                size_t nl = fixlen(h->cache_note, sizeof(h->cache_note));
                const char *kind = h->cache_backing == KVF_CACHE_HUGETLBFS ? "hugetlbfs "
                                   : h->cache_backing == KVF_CACHE_SHM_THP ? "shmem THP "
                                                                           : "";
                fprintf(d->f, "  cache: %s in %s pages (",
                        human_bytes(b2, sizeof(b2), l->cache_bytes),
                        cache_page_bytes(h) == 2097152 ? "2 MiB" : "4 KiB");
                if (h->cache_backing)
                        fprintf(d->f, "%s%s)", kind, esc(e1, sizeof(e1), h->cache_path, pl));
                else
                        fprintf(d->f, "/dev/shm%s; page size not recorded)",
                                esc(e1, sizeof(e1), h->cache_name, cnl));
                if (nl)
                        fprintf(d->f, ": %s", esc(e2, sizeof(e2), h->cache_note, nl));
                fputc('\n', d->f);
        }
        if (h->backend == KVF_BACKEND_ENGINE) {
                uint64_t g = kvf_load_acquire(&h->reg_generation);
                char u[48] = "";
                if (h->reg_gpu)
                        kvf_reg_uuid_str(h->cuda_uuid, u, sizeof(u));
                if (g & 1)
                        fprintf(d->f, "  engine caches: registered by pid %d: %u %s, %s%s%s%s%s, generation %" PRIu64 "\n",
                                (int)h->reg_pid, h->reg_regions, h->reg_gpu ? "GPU allocations" : "regions",
                                human_bytes(b2, sizeof(b2), h->reg_bytes), h->reg_gpu ? " on " : "", u,
                                h->reg_strided ? ", strided blocks" : "",
                                h->reg_token_major ? ", token-major blocks" : "", g);
                else if (h->reg_gpu)
                        fprintf(d->f, "  engine caches: waiting for the engine's caches (GPU memory on %s; generation %" PRIu64
                                "): tasks are refused until it registers them\n", u, g);
                else
                        fprintf(d->f, "  engine caches: waiting for the engine's caches (generation %" PRIu64
                                "): tasks are refused until it registers them\n", g);
        }
        if (cinfo)
                fprintf(d->f, "  connector: listening on %s:%u\n",
                        esc(e1, sizeof(e1), host, fixlen(host, sizeof(host))), port);
        else
                fprintf(d->f, "  connector: no listen address published\n");
        fprintf(d->f, "  progress: step %" PRIu64 ", %u layers done (%" PRIu64 " events)\n",
                KVF_PROGRESS_STEP(pw), KVF_PROGRESS_LAYERS(pw), pev);
}

/* ---- roles ---- */

struct role_view {
        int32_t pid;
        uint32_t state;
        uint64_t generation, start_ns, heartbeat_ns, restarts;
        uint32_t slice_us; /* 0: the kernel's default */
        int alive; /* 1, 0, or -1 not checked */
};

static void load_role(struct dump *d, int r, struct role_view *v)
{
        const struct kvf_role_slot *s = &d->c.roles[r];

        v->pid = kvf_load_relaxed(&s->pid);
        v->state = kvf_load_relaxed(&s->state);
        v->generation = kvf_load_relaxed(&s->generation);
        v->start_ns = kvf_load_relaxed(&s->start_ns);
        v->heartbeat_ns = kvf_load_relaxed(&s->heartbeat_ns);
        v->restarts = kvf_load_relaxed(&s->restarts);
        v->slice_us = kvf_load_relaxed(&s->slice_us);
        v->alive = d->o->check_pids ? kvf_role_alive(&d->c, (enum kvf_role_id)r, d->now) : -1;
}

static void print_roles(struct dump *d)
{
        if (d->json)
                j_open(d, "roles", '[');
        else
                fprintf(d->f, "\nroles:\n  %-10s %10s %-6s %-9s %6s %8s %8s  %s\n", "role", "pid",
                        "alive", "state", "gen", "restarts", "slice", "heartbeat");
        for (int r = 0; r < KVF_ROLE_COUNT; r++) {
                struct role_view v;
                load_role(d, r, &v);
                const char *alive = v.alive < 0 ? "?" : v.alive ? "yes" : "no";
                if (d->json) {
                        j_open(d, NULL, '{');
                        j_cstr(d, "role", kvf_role_name(r));
                        j_i64(d, "pid", v.pid);
                        if (v.alive < 0)
                                j_null(d, "alive");
                        else
                                j_bool(d, "alive", v.alive);
                        j_cstr(d, "state", state_name(v.state));
                        j_u64(d, "state_id", v.state);
                        j_u64(d, "generation", v.generation);
                        j_u64(d, "restarts", v.restarts);
                        j_u64(d, "slice_us", v.slice_us); /* 0: the kernel's default */
                        j_u64(d, "start_ns", v.start_ns);
                        if (v.heartbeat_ns)
                                j_i64(d, "heartbeat_age_ms", age_ms(d->now, v.heartbeat_ns));
                        else
                                j_null(d, "heartbeat_age_ms");
                        j_close(d, '}');
                        continue;
                }
                char hb[48], slice[16];
                if (v.slice_us)
                        snprintf(slice, sizeof(slice), "%" PRIu32 " us", v.slice_us);
                else
                        snprintf(slice, sizeof(slice), "default");
                if (v.heartbeat_ns)
                        snprintf(hb, sizeof(hb), "%" PRId64 " ms ago",
                                 age_ms(d->now, v.heartbeat_ns));
                else
                        snprintf(hb, sizeof(hb), "never");
                fprintf(d->f, "  %-10s %10" PRId32 " %-6s %-9s %6" PRIu64 " %8" PRIu64 " %8s  %s\n",
                        kvf_role_name(r), v.pid, v.state == KVF_STATE_NONE ? "-" : alive,
                        state_name(v.state), v.generation, v.restarts, slice, hb);
        }
        if (d->json)
                j_close(d, ']');
}

/* ---- pending records ---- */

static void f_str(struct dump *d, const char *k, const char *s, size_t cap)
{
        size_t n = fixlen(s, cap);
        char e[1024];

        if (d->json) {
                j_str(d, k, s, n);
                return;
        }
        if (n == 0)
                return; /* decoded strings are never empty: an absent optional field */
        bool quote = false;
        for (size_t i = 0; i < n && !quote; i++)
                quote = s[i] == ' ' || s[i] == '"' || s[i] == '=' || s[i] == '\\';
        /* Quoted values escape quotes and backslashes: a value stays one token. */
        esc_q(e, sizeof(e), s, n, quote);
        fprintf(d->f, quote ? " %s=\"%s\"" : " %s=%s", k, e);
}

static void f_u64(struct dump *d, const char *k, uint64_t v)
{
        if (d->json)
                j_u64(d, k, v);
        else
                fprintf(d->f, " %s=%" PRIu64, k, v);
}

static void f_bool(struct dump *d, const char *k, bool v)
{
        if (d->json)
                j_bool(d, k, v);
        else
                fprintf(d->f, " %s=%s", k, v ? "yes" : "no");
}

static void f_cname(struct dump *d, const char *k, const char *name)
{
        f_str(d, k, name, strlen(name) + 1);
}

/* The main fields of a decoded record, by type. */
static void print_record_fields(struct dump *d, const struct kvf_record *r)
{
        bool reason = false;

        switch (r->type) {
        case KVF_REC_TASK:
                f_str(d, "request_id", r->request_id, sizeof(r->request_id));
                f_str(d, "peer", r->peer, sizeof(r->peer));
                f_cname(d, "transport", kvf_transport_name(r->transport));
                f_u64(d, "current_id", r->current_id);
                f_u64(d, "src_blocks", r->n_src);
                f_u64(d, "dst_blocks", r->n_dst);
                f_bool(d, "chunked", r->chunked);
                break;
        case KVF_REC_CHUNK:
                f_str(d, "request_id", r->request_id, sizeof(r->request_id));
                f_u64(d, "step", r->current_id);
                f_u64(d, "tokens_done", r->tokens);
                f_bool(d, "last", r->last);
                break;
        case KVF_REC_CANCEL:
                f_str(d, "request_id", r->request_id, sizeof(r->request_id));
                break;
        case KVF_REC_COMPLETION:
        case KVF_REC_ARRIVAL:
                f_str(d, "request_id", r->request_id, sizeof(r->request_id));
                f_cname(d, "status", kvf_status_name(r->status));
                f_str(d, "peer", r->peer, sizeof(r->peer));
                f_u64(d, "bytes", r->bytes);
                f_u64(d, "blocks", r->blocks);
                if (r->type == KVF_REC_ARRIVAL)
                        f_u64(d, "dst_blocks", r->n_dst);
                reason = true;
                break;
        case KVF_REC_CONNECT:
                f_str(d, "task_id", r->request_id, sizeof(r->request_id));
                f_str(d, "peer", r->peer, sizeof(r->peer));
                f_cname(d, "transport", kvf_transport_name(r->transport));
                break;
        case KVF_REC_CONNECT_RESULT:
                f_str(d, "task_id", r->request_id, sizeof(r->request_id));
                f_str(d, "peer", r->peer, sizeof(r->peer));
                f_cname(d, "status", kvf_status_name(r->status));
                reason = true;
                break;
        case KVF_RT_WRITE_BATCH:
                f_u64(d, "key", r->key);
                f_str(d, "request_id", r->request_id, sizeof(r->request_id));
                f_str(d, "peer", r->peer, sizeof(r->peer));
                f_u64(d, "layer", r->layer);
                f_u64(d, "runs", r->n_runs / 3);
                f_cname(d, "transport", kvf_transport_name(r->transport));
                break;
        case KVF_RT_FINISH:
                f_u64(d, "key", r->key);
                f_str(d, "request_id", r->request_id, sizeof(r->request_id));
                f_str(d, "peer", r->peer, sizeof(r->peer));
                f_cname(d, "transport", kvf_transport_name(r->transport));
                f_cname(d, "status", kvf_status_name(r->status));
                f_u64(d, "dst_blocks", r->n_dst);
                f_u64(d, "bytes", r->bytes);
                f_u64(d, "blocks", r->blocks);
                f_u64(d, "generation", r->generation);
                reason = true;
                break;
        case KVF_RT_WRITE_RESULT:
                f_u64(d, "key", r->key);
                f_str(d, "request_id", r->request_id, sizeof(r->request_id));
                f_cname(d, "status", kvf_status_name(r->status));
                f_u64(d, "bytes", r->bytes);
                reason = true;
                break;
        case KVF_RT_PEER_STATE:
                f_str(d, "peer", r->peer, sizeof(r->peer));
                f_bool(d, "up", r->up);
                f_u64(d, "generation", r->generation);
                reason = true;
                break;
        case KVF_RT_DISCONNECT:
                f_str(d, "peer", r->peer, sizeof(r->peer));
                break;
        }
        if (reason && (d->json || r->reason[0]))
                f_str(d, "reason", r->reason, sizeof(r->reason));
}

/* Start one entry of the pending list: position, type, length, generation. */
static void rec_begin(struct dump *d, uint64_t pos, uint64_t w, const char *state)
{
        uint16_t type = KVF_REC_TYPE(w);

        d->rec_record = d->rec_error = false;
        if (d->json) {
                j_open(d, NULL, '{');
                j_u64(d, "pos", pos);
                j_cstr(d, "state", state);
                j_u64(d, "type_id", type);
                j_cstr(d, "type", kvf_rec_type_name(type));
                j_i64(d, "length", KVF_REC_LEN(w));
                j_u64(d, "gen", KVF_REC_GEN(w));
                return;
        }
        fprintf(d->f, "    @%-8" PRIu64 " %-14s", pos, kvf_rec_type_name(type));
        if (strcmp(kvf_rec_type_name(type), "unknown") == 0)
                fprintf(d->f, " (type %u)", type);
        if (strcmp(state, "committed") != 0)
                fprintf(d->f, " %s (length %" PRId32 ", gen %u)", state, KVF_REC_LEN(w),
                        KVF_REC_GEN(w));
}

static void rec_end(struct dump *d)
{
        if (!d->json) {
                fputc('\n', d->f);
                return;
        }
        /* Stable keys: every entry has both. */
        if (!d->rec_record)
                j_null(d, "record");
        if (!d->rec_error)
                j_null(d, "error");
        j_close(d, '}');
}

static void rec_error(struct dump *d, const char *msg)
{
        d->rec_error = true;
        if (d->json) {
                j_str(d, "error", msg, strlen(msg));
        } else {
                char e[KVF_ERR_MAX * 4 + 8];
                fprintf(d->f, " %s", esc(e, sizeof(e), msg, strlen(msg)));
        }
}

static void print_committed(struct dump *d, const uint8_t *src, uint32_t plen, uint16_t type)
{
        struct kvf_record rec;
        /* A private copy: the producer may reuse the bytes while we decode. */
        uint8_t *buf = malloc(plen ? plen : 1);

        if (!buf) {
                rec_error(d, "undecodable: out of memory for a copy");
                return;
        }
        memcpy(buf, src, plen);
        int rc = kvf_record_decode(type, buf, plen, d->h.rank, &rec);
        if (rc < 0) {
                char msg[KVF_ERR_MAX + 32];
                snprintf(msg, sizeof(msg), "undecodable: %s", kvf_err_msg());
                rec_error(d, msg);
        } else {
                d->rec_record = true;
                if (d->json)
                        j_open(d, "record", '{');
                print_record_fields(d, &rec);
                if (d->json)
                        j_close(d, '}');
        }
        kvf_record_free(&rec);
        free(buf);
}

/*
 * Walk ring i from head towards tail without writing: at most one capacity
 * of bytes, at most max_records records shown, every header checked before
 * its length is used. Positions are handled as distances from head, so a
 * hostile head near 2^64 cannot wrap a bound.
 */
struct walk {
        uint64_t not_shown; /* bytes before tail not walked */
        const char *why;    /* why the walk stopped early, or NULL */
        bool clamped;       /* head and tail were more than one capacity apart */
};

static void walk_ring(struct dump *d, int i, struct walk *wk)
{
        const struct kvf_ring *r = &d->c.rings[i];
        const struct kvf_ring_hdr *rh = r->hdr;
        uint64_t cap = r->capacity, mask = r->mask;
        uint64_t head = kvf_load_acquire(&rh->head);
        /* Pairs with the release store of tail in kvf_ring_claim(): the
         * headers of records below tail are written. */
        uint64_t tail = kvf_load_acquire(&rh->tail);
        uint64_t pgen = kvf_load_acquire(&rh->producer_gen);
        uint64_t span, done = 0;
        unsigned shown = 0;

        memset(wk, 0, sizeof(*wk));
        if (head % KVF_REC_ALIGN) {
                wk->why = "head is not 8-byte aligned";
                return;
        }
        if (tail < head) {
                wk->why = "tail is behind head";
                return;
        }
        span = tail - head;
        if (span > cap) {
                wk->clamped = true;
                span = cap;
        }
        while (done < span) {
                uint64_t pos = head + done;
                uint64_t off = pos & mask;
                /* off is 8-aligned and cap a multiple of 8: the word is inside the data. */
                uint64_t w = kvf_load_acquire((const uint64_t *)(const void *)(r->data + off));
                int32_t len = KVF_REC_LEN(w);
                uint16_t type = KVF_REC_TYPE(w);
                uint64_t size, left = span - done;

                if (len == 0) {
                        wk->why = "a zero header before tail (consumed meanwhile, or corrupt)";
                        break;
                }
                if (len > 0 && type == KVF_REC_TYPE_PAD) {
                        size = kvf_ring_align((uint64_t)len);
                        if ((uint32_t)len < KVF_REC_HDR_SIZE || off + size > cap || size > left) {
                                if (shown < d->max_records) {
                                        rec_begin(d, pos, w, "corrupt");
                                        rec_error(d, "padding record runs past the ring or tail");
                                        rec_end(d);
                                }
                                wk->why = "corrupt padding record";
                                break;
                        }
                        done += size;
                        continue;
                }
                if (shown >= d->max_records)
                        break;
                shown++;
                if (len < 0) {
                        size = kvf_ring_align((uint64_t)(-(int64_t)len));
                        bool abandoned = KVF_REC_GEN(w) != (uint16_t)pgen;
                        rec_begin(d, pos, w, abandoned ? "abandoned" : "being-written");
                        if (size < KVF_REC_HDR_SIZE || off + size > cap || size > left) {
                                rec_error(d, "claimed length runs past the ring or tail");
                                rec_end(d);
                                wk->why = "corrupt claimed record";
                                break;
                        }
                        rec_end(d);
                        done += size;
                        continue;
                }
                size = kvf_ring_align((uint64_t)len);
                if ((uint32_t)len < KVF_REC_HDR_SIZE || off + size > cap || size > left) {
                        char m[96];
                        rec_begin(d, pos, w, "corrupt");
                        snprintf(m, sizeof(m), "length %" PRId32 " runs past the ring or tail",
                                 len);
                        rec_error(d, m);
                        rec_end(d);
                        wk->why = "corrupt record header";
                        break;
                }
                rec_begin(d, pos, w, "committed");
                print_committed(d, r->data + off + KVF_REC_HDR_SIZE,
                                (uint32_t)len - KVF_REC_HDR_SIZE, type);
                rec_end(d);
                done += size;
        }
        wk->not_shown = span - done;
}

/* ---- rings and doorbells ---- */

struct ring_view {
        uint64_t head, tail, used, cap, written, read, full, abandoned, abandoned_pos, pgen;
        uint32_t waiters;
};

static void load_ring(struct dump *d, int i, struct ring_view *v)
{
        const struct kvf_ring *r = &d->c.rings[i];
        const struct kvf_ring_hdr *rh = r->hdr;

        v->head = kvf_load_relaxed(&rh->head);
        v->tail = kvf_load_relaxed(&rh->tail);
        v->used = v->tail > v->head ? v->tail - v->head : 0;
        v->cap = r->capacity;
        v->written = kvf_load_relaxed(&rh->records_written);
        v->read = kvf_load_relaxed(&rh->records_read);
        v->full = kvf_load_relaxed(&rh->full_events);
        v->abandoned = kvf_load_relaxed(&rh->abandoned);
        v->abandoned_pos = kvf_load_relaxed(&rh->abandoned_pos);
        v->pgen = kvf_load_relaxed(&rh->producer_gen);
        /* The doorbell pointer was bound from the validated bell index. */
        v->waiters = kvf_doorbell_waiters(kvf_load_relaxed(&r->bell->state));
}

static void print_rings(struct dump *d)
{
        if (d->json)
                j_open(d, "rings", '[');
        else
                fprintf(d->f, "\nrings:\n  %-18s %10s %10s %8s %9s %6s %7s %9s %9s %6s %9s\n",
                        "ring", "head", "tail", "used", "capacity", "fill", "waiters", "written",
                        "read", "full", "abandoned");
        for (int i = 0; i < KVF_RING_COUNT; i++) {
                struct ring_view v;
                load_ring(d, i, &v);
                double fill = (double)v.used * 100.0 / (double)v.cap;
                if (!d->json) {
                        fprintf(d->f,
                                "  %-18s %10" PRIu64 " %10" PRIu64 " %8" PRIu64 " %9" PRIu64
                                " %5.1f%% %7u %9" PRIu64 " %9" PRIu64 " %6" PRIu64 " %9" PRIu64
                                "\n",
                                kvf_ring_name(i), v.head, v.tail, v.used, v.cap, fill, v.waiters,
                                v.written, v.read, v.full, v.abandoned);
                        continue;
                }
                j_open(d, NULL, '{');
                j_cstr(d, "name", kvf_ring_name(i));
                j_u64(d, "id", (uint64_t)i);
                j_cstr(d, "producer", kvf_role_name((int)d->c.rings[i].hdr->producer));
                j_cstr(d, "consumer", kvf_role_name((int)d->c.rings[i].hdr->consumer));
                j_u64(d, "head", v.head);
                j_u64(d, "tail", v.tail);
                j_u64(d, "used", v.used);
                j_u64(d, "capacity", v.cap);
                j_key(d, "fill_pct");
                fprintf(d->f, "%.1f", fill);
                j_u64(d, "waiters", v.waiters);
                j_u64(d, "records_written", v.written);
                j_u64(d, "records_read", v.read);
                j_u64(d, "full_events", v.full);
                j_u64(d, "abandoned", v.abandoned);
                if (v.abandoned_pos == ~0ull)
                        j_null(d, "abandoned_pos");
                else
                        j_u64(d, "abandoned_pos", v.abandoned_pos);
                j_u64(d, "producer_gen", v.pgen);
                if (d->max_records) {
                        struct walk wk;
                        j_open(d, "pending", '[');
                        walk_ring(d, i, &wk);
                        j_close(d, ']');
                        j_u64(d, "pending_bytes_not_shown", wk.not_shown);
                        if (wk.why)
                                j_cstr(d, "walk_stopped", wk.why);
                        else
                                j_null(d, "walk_stopped");
                        j_bool(d, "walk_clamped", wk.clamped);
                } else {
                        j_null(d, "pending");
                        j_null(d, "pending_bytes_not_shown");
                        j_null(d, "walk_stopped");
                        j_null(d, "walk_clamped");
                }
                j_close(d, '}');
        }
        if (d->json)
                j_close(d, ']');
}

/* Notice slots: which prefill sender holds each (ever claimed) one, and its rings' fill. */
static void print_notices(struct dump *d)
{
        unsigned shown = 0;

        if (d->json)
                j_open(d, "notice_slots", '[');
        for (uint32_t s = 0; s < KVF_NOTICE_SLOTS; s++) {
                const struct kvf_notice_slot *ns = &d->c.notices[s];
                uint64_t gen = kvf_load_relaxed(&ns->generation);
                if (gen == 0)
                        continue;
                int32_t pid = kvf_load_relaxed(&ns->pid);
                uint32_t state = kvf_load_relaxed(&ns->state);
                uint64_t hb = kvf_load_relaxed(&ns->heartbeat_ns);
                int alive = d->o->check_pids ? kvf_notice_holder_alive(&d->c, s, d->now) : -1;
                const struct kvf_ring_hdr *rh[2] = {&ns->notice, &ns->reply};
                uint64_t used[2], cap[2];
                for (int k = 0; k < 2; k++) {
                        uint64_t head = kvf_load_relaxed(&rh[k]->head);
                        uint64_t tail = kvf_load_relaxed(&rh[k]->tail);
                        used[k] = tail > head ? tail - head : 0;
                        cap[k] = KVF_NOTICE_RING_CAPACITY; /* validated */
                }
                size_t on = fixlen(ns->owner, sizeof(ns->owner));
                if (d->json) {
                        j_open(d, NULL, '{');
                        j_u64(d, "slot", s);
                        j_str(d, "owner", ns->owner, on);
                        j_u64(d, "owner_created_ns", kvf_load_relaxed(&ns->owner_created_ns));
                        j_i64(d, "pid", pid);
                        if (alive < 0)
                                j_null(d, "alive");
                        else
                                j_bool(d, "alive", alive);
                        j_cstr(d, "state", state_name(state));
                        j_u64(d, "generation", gen);
                        j_u64(d, "claims", kvf_load_relaxed(&ns->claims));
                        if (hb)
                                j_i64(d, "heartbeat_age_ms", age_ms(d->now, hb));
                        else
                                j_null(d, "heartbeat_age_ms");
                        j_u64(d, "notice_used", used[0]);
                        j_u64(d, "notice_written", kvf_load_relaxed(&ns->notice.records_written));
                        j_u64(d, "notice_read", kvf_load_relaxed(&ns->notice.records_read));
                        j_u64(d, "reply_used", used[1]);
                        j_u64(d, "reply_written", kvf_load_relaxed(&ns->reply.records_written));
                        j_u64(d, "reply_read", kvf_load_relaxed(&ns->reply.records_read));
                        j_u64(d, "ring_capacity", cap[0]);
                        j_close(d, '}');
                        continue;
                }
                if (shown++ == 0)
                        fprintf(d->f, "\nnotice slots (same-host notices; %u slots):\n"
                                      "  %4s %-24s %10s %-6s %-9s %6s %8s %8s  %s\n",
                                KVF_NOTICE_SLOTS, "slot", "holder", "pid", "alive", "state", "gen",
                                "notices", "replies", "heartbeat");
                char ob[4 * KVF_INSTANCE_MAX + 8], hbt[48];
                if (hb)
                        snprintf(hbt, sizeof(hbt), "%" PRId64 " ms ago", age_ms(d->now, hb));
                else
                        snprintf(hbt, sizeof(hbt), "never");
                fprintf(d->f,
                        "  %4" PRIu32 " %-24s %10" PRId32 " %-6s %-9s %6" PRIu64 " %7.1f%% %7.1f%%  %s\n",
                        s, esc(ob, sizeof(ob), ns->owner, on), pid,
                        alive < 0 ? "?" : alive ? "yes" : "no", state_name(state), gen,
                        (double)used[0] * 100.0 / (double)cap[0],
                        (double)used[1] * 100.0 / (double)cap[1], hbt);
        }
        if (d->json)
                j_close(d, ']');
        else if (shown == 0)
                fprintf(d->f, "\nnotice slots: none claimed (%u free; same-host prefill senders "
                              "post their notices through the connectors' sockets)\n",
                        KVF_NOTICE_SLOTS);
}

static void print_bells(struct dump *d)
{
        if (d->json)
                j_open(d, "doorbells", '[');
        else
                fprintf(d->f, "\ndoorbells:\n  %-10s %10s %7s %12s %12s\n", "consumer", "seq",
                        "waiters", "wakes", "sleeps");
        for (int b = 0; b < KVF_BELL_COUNT; b++) {
                const struct kvf_doorbell *bell = &d->c.bells[b];
                uint64_t state = kvf_load_relaxed(&bell->state);
                uint32_t seq = kvf_doorbell_seq(state), waiters = kvf_doorbell_waiters(state);
                uint64_t wakes = kvf_load_relaxed(&bell->wakes);
                uint64_t sleeps = kvf_load_relaxed(&bell->sleeps);
                if (d->json) {
                        j_open(d, NULL, '{');
                        j_cstr(d, "name", bell_names[b]);
                        j_u64(d, "seq", seq);
                        j_u64(d, "waiters", waiters);
                        j_u64(d, "wakes", wakes);
                        j_u64(d, "sleeps", sleeps);
                        /* a producer's deadline for a record it said is coming (0: none) */
                        j_u64(d, "expect_until_ns", kvf_load_relaxed(&bell->expect_until));
                        j_close(d, '}');
                } else {
                        fprintf(d->f, "  %-10s %10u %7u %12" PRIu64 " %12" PRIu64 "\n",
                                bell_names[b], seq, waiters, wakes, sleeps);
                }
        }
        if (d->json)
                j_close(d, ']');
}

/* ---- counters ---- */

static void print_counters(struct dump *d)
{
        unsigned shown = 0;

        if (d->json)
                j_open(d, "counters", '{');
        else
                fprintf(d->f, "\ncounters:\n");
        for (unsigned i = 0; i < KVF_COUNTER_COUNT; i++) {
                uint64_t v = kvf_load_relaxed(&d->c.counters[i].value);
                if (d->json) {
                        j_u64(d, kvf_counter_names[i], v);
                } else if (v || d->o->verbose) {
                        fprintf(d->f, "  %-24s %" PRIu64 "\n", kvf_counter_names[i], v);
                        shown++;
                }
        }
        if (d->json)
                j_close(d, '}');
        else if (!shown)
                fprintf(d->f, "  (all zero)\n");
}

/* ---- the sender's histograms ---- */

static const struct {
        const char *name;
        bool size; /* a size histogram (kvf_hist_add_size): bytes or descriptors, not ns */
} hist_info[KVF_HIST_COUNT] = {
    [KVF_HIST_LAYER_TO_COPY] = {"layer_to_copy_ns", false},
    [KVF_HIST_COPY] = {"copy_batch_ns", false},
    [KVF_HIST_LAST_TO_DONE] = {"last_layer_to_done_ns", false},
    [KVF_HIST_REQ_BYTES] = {"request_bytes", true},
    [KVF_HIST_REQ_DESCS] = {"request_descriptors", true},
    [KVF_HIST_REQ_XFER] = {"request_xfer_ns", false},
};

static void print_histograms(struct dump *d)
{
        unsigned shown = 0;
        if (d->json)
                j_open(d, "histograms", '{');
        else
                fprintf(d->f, "\nhistograms (the sender's):  %-22s %10s %14s %12s %12s\n", "", "count",
                        "sum", "p50", "p99");
        for (unsigned i = 0; i < KVF_HIST_COUNT && d->c.sender; i++) {
                /* A private copy: the sender adds to it meanwhile. */
                struct kvf_histogram h;
                memcpy(&h, &d->c.sender->hist[i], sizeof(h));
                /* A size histogram keeps v - 1: its quantiles are one more. */
                uint64_t adj = hist_info[i].size ? 1 : 0;
                uint64_t p50 = h.count ? kvf_hist_quantile(&h, 0.50) + adj : 0;
                uint64_t p99 = h.count ? kvf_hist_quantile(&h, 0.99) + adj : 0;
                /* A quantile is its bucket's value; the maximum is exact: none above it. */
                if (p50 > h.max)
                        p50 = h.max;
                if (p99 > h.max)
                        p99 = h.max;
                if (d->json) {
                        j_open(d, hist_info[i].name, '{');
                        j_u64(d, "count", h.count);
                        j_u64(d, "sum", h.sum);
                        j_u64(d, "max", h.max);
                        j_u64(d, "p50", p50);
                        j_u64(d, "p99", p99);
                        j_close(d, '}');
                } else if (h.count || d->o->verbose) {
                        fprintf(d->f, "  %-48s %10" PRIu64 " %14" PRIu64 " %12" PRIu64 " %12" PRIu64 "\n",
                                hist_info[i].name, h.count, h.sum, p50, p99);
                        shown++;
                }
        }
        if (d->json)
                j_close(d, '}');
        else if (!shown)
                fprintf(d->f, "  (all empty)\n");
}

/* ---- error log ---- */

static void print_errlog(struct dump *d)
{
        unsigned shown = 0;

        if (d->json)
                j_open(d, "errors", '[');
        else
                fprintf(d->f, "\nerror log:\n");
        for (int r = 0; r < KVF_ROLE_COUNT; r++) {
                for (unsigned i = 0; i < KVF_ERRLOG_ENTRIES; i++) {
                        struct kvf_errlog_entry e;
                        char t1[64], t2[64], txt[KVF_ERRLOG_TEXT * 4 + 8];
                        if (kvf_errlog_read(&d->c, r, i, &e) != 1)
                                continue;
                        size_t n = fixlen(e.text, sizeof(e.text));
                        iso_time(t1, sizeof(t1), e.first_ns);
                        iso_time(t2, sizeof(t2), e.last_ns);
                        shown++;
                        if (d->json) {
                                j_open(d, NULL, '{');
                                j_cstr(d, "role", kvf_role_name(r));
                                j_u64(d, "count", e.count);
                                j_cstr(d, "first", t1);
                                j_cstr(d, "last", t2);
                                j_u64(d, "first_ns", e.first_ns);
                                j_u64(d, "last_ns", e.last_ns);
                                j_str(d, "text", e.text, n);
                                j_close(d, '}');
                        } else {
                                fprintf(d->f, "  %-10s %6" PRIu64 "x  first %s  last %s  %s\n",
                                        kvf_role_name(r), e.count, t1, t2,
                                        esc(txt, sizeof(txt), e.text, n));
                        }
                }
        }
        if (d->json)
                j_close(d, ']');
        else if (!shown)
                fprintf(d->f, "  (empty)\n");
}

/* ---- request table ---- */

/* Slots that fit the segment: the count comes from our header copy, the
 * region start from the validated plan. */
static uint32_t usable_slots(const struct dump *d)
{
        uint64_t off = (uint64_t)((const uint8_t *)d->c.reqtab - d->base);
        uint64_t n = d->h.reqtab_slots;

        if (off > d->size)
                return 0;
        if (n > (d->size - off) / sizeof(struct kvf_req_slot))
                n = (d->size - off) / sizeof(struct kvf_req_slot);
        return (uint32_t)n;
}

static void print_request(struct dump *d, uint32_t i, const struct kvf_req_slot *s)
{
        int64_t age = s->accept_ns ? age_ms(d->now, s->accept_ns) : 0;
        size_t idn = fixlen(s->request_id, sizeof(s->request_id));
        size_t pn = fixlen(s->peer, sizeof(s->peer));
        size_t rn = fixlen(s->reason, sizeof(s->reason));

        if (d->json) {
                j_open(d, NULL, '{');
                j_u64(d, "slot", i);
                j_str(d, "request_id", s->request_id, idn);
                /* JSON cannot carry bytes that are not UTF-8 (request_id shows each as U+FFFD):
                 * the exact id as hex, and whether it came as bytes, to match an engine's id. */
                j_bool(d, "request_id_bin", (s->flags & KVF_REQF_ID_BIN) != 0);
                if (!s->request_id[0] || !ids_utf8(s->request_id, idn) || (s->flags & KVF_REQF_ID_BIN))
                        j_hex(d, "request_id_hex", s->request_id, idn);
                j_cstr(d, "state", req_state_name(s->state));
                j_u64(d, "state_id", s->state);
                j_str(d, "peer", s->peer, pn);
                j_cstr(d, "transport", kvf_transport_name((int)s->transport));
                j_u64(d, "incarnation", s->incarnation);
                j_u64(d, "src_blocks", s->n_src);
                j_u64(d, "send_blocks", s->n_send);
                j_u64(d, "sent_full", s->sent_full);
                j_u64(d, "cur_layers", s->cur_layers);
                j_u64(d, "bytes", s->bytes);
                j_u64(d, "descriptors", s->descs);
                if (s->xfer_start_ns)
                        j_i64(d, "xfer_ms", age_ms(d->now, s->xfer_start_ns));
                else
                        j_null(d, "xfer_ms");
                if (s->accept_ns)
                        j_i64(d, "age_ms", age);
                else
                        j_null(d, "age_ms");
                if (s->state == KVF_REQ_COMPLETING)
                        j_cstr(d, "status", kvf_status_name((int)s->status));
                else
                        j_null(d, "status");
                j_str(d, "reason", s->reason, rn);
                j_close(d, '}');
                return;
        }
        char id[600], peer[500], reason[1000], blocks[48], agebuf[32];
        snprintf(blocks, sizeof(blocks), "%u/%u", s->sent_full, s->n_send);
        if (s->accept_ns)
                snprintf(agebuf, sizeof(agebuf), "%" PRId64 " ms", age);
        else
                snprintf(agebuf, sizeof(agebuf), "-");
        /* (quoted escaping: the bytes 0xff and the text "\\xff" print apart) */
        fprintf(d->f, "  %5u %-24s %-10s %-22s %-4s %11s %12" PRIu64 " %10s", i,
                esc_q(id, sizeof(id), s->request_id, idn, true), req_state_name(s->state),
                esc(peer, sizeof(peer), s->peer, pn), kvf_transport_name((int)s->transport), blocks,
                s->bytes, agebuf);
        if (s->state == KVF_REQ_COMPLETING)
                fprintf(d->f, "  status \"%s\"", kvf_status_name((int)s->status));
        if (rn)
                fprintf(d->f, "  reason \"%s\"", esc(reason, sizeof(reason), s->reason, rn));
        fputc('\n', d->f);
}

static void print_requests(struct dump *d)
{
        uint32_t n = usable_slots(d);
        uint64_t count[6] = {0}; /* by state; [5]: invalid */
        unsigned listed = 0, limit = d->json ? UINT32_MAX : KVF_DUMP_TEXT_REQUESTS;

        for (uint32_t i = 0; i < n; i++) {
                uint32_t st = kvf_load_relaxed(&d->c.reqtab[i].state);
                count[st <= KVF_REQ_HANDED_OVER ? st : 5]++;
        }
        uint64_t in_use = n - count[KVF_REQ_FREE];
        if (d->json) {
                j_open(d, "requests", '{');
                j_u64(d, "slots", d->h.reqtab_slots);
                j_u64(d, "max_blocks", d->h.max_blocks);
                j_u64(d, "free", count[KVF_REQ_FREE]);
                j_u64(d, "active", count[KVF_REQ_ACTIVE]);
                j_u64(d, "finishing", count[KVF_REQ_FINISHING]);
                j_u64(d, "completing", count[KVF_REQ_COMPLETING]);
                j_u64(d, "handed_over", count[KVF_REQ_HANDED_OVER]);
                j_u64(d, "invalid", count[5]);
                j_open(d, "list", '[');
        } else {
                fprintf(d->f,
                        "\nrequests: %u slots, %" PRIu64 " in use: %" PRIu64 " active, %" PRIu64
                        " finishing, %" PRIu64 " completing",
                        d->h.reqtab_slots, in_use, count[KVF_REQ_ACTIVE], count[KVF_REQ_FINISHING],
                        count[KVF_REQ_COMPLETING]);
                if (count[KVF_REQ_HANDED_OVER])
                        fprintf(d->f, ", %" PRIu64 " handed over", count[KVF_REQ_HANDED_OVER]);
                if (count[5])
                        fprintf(d->f, ", %" PRIu64 " in an invalid state", count[5]);
                fputc('\n', d->f);
                if (in_use)
                        fprintf(d->f, "  %5s %-24s %-10s %-22s %-4s %11s %12s %10s\n", "slot",
                                "request id", "state", "peer", "via", "blocks sent", "bytes",
                                "age");
        }
        for (uint32_t i = 0; i < n && listed < limit; i++) {
                if (kvf_load_relaxed(&d->c.reqtab[i].state) == KVF_REQ_FREE)
                        continue;
                /* A private copy: the sender may rewrite the slot meanwhile. */
                struct kvf_req_slot s;
                memcpy(&s, &d->c.reqtab[i], sizeof(s));
                print_request(d, i, &s);
                listed++;
        }
        if (d->json) {
                j_close(d, ']');
                j_close(d, '}');
        } else if (listed < in_use) {
                fprintf(d->f, "  ... and %" PRIu64 " more (--json lists them all)\n",
                        in_use - listed);
        }
}

static void print_pending_text(struct dump *d)
{
        fprintf(d->f, "\npending records (up to %u per ring):\n", d->max_records);
        for (int i = 0; i < KVF_RING_COUNT; i++) {
                struct ring_view v;
                struct walk wk;
                load_ring(d, i, &v);
                fprintf(d->f, "  %s: %" PRIu64 " bytes pending\n", kvf_ring_name(i), v.used);
                walk_ring(d, i, &wk);
                if (wk.clamped)
                        fprintf(d->f, "    (head and tail are more than one capacity apart: "
                                      "walking one capacity)\n");
                if (wk.why)
                        fprintf(d->f, "    (walk stopped: %s)\n", wk.why);
                if (wk.not_shown)
                        fprintf(d->f, "    ... %" PRIu64 " more bytes not shown\n", wk.not_shown);
        }
}

/* ---- entry points ---- */

static int setup(struct dump *d, void *base, uint64_t size, FILE *out,
                 const struct kvf_dump_opts *o)
{
        memset(d, 0, sizeof(*d));
        d->o = o ? o : &default_opts;
        d->f = out;
        d->json = d->o->json;
        d->base = base;
        d->size = size;
        d->max_records = !d->o->records      ? 0
                         : d->o->max_records ? d->o->max_records
                                             : KVF_DUMP_DEFAULT_RECORDS;
        d->now = d->o->now_ns ? d->o->now_ns : kvf_now_ns();
        int rc = kvf_ctl_validate(base, size, (uid_t)-1, &d->c);
        if (rc < 0)
                return rc;
        /* One copy of the header: the values below are then the validated
         * ones, whatever a writer does to the segment meanwhile. Fields are
         * re-checked where they size a loop (usable_slots). */
        memcpy(&d->h, base, sizeof(d->h));
        return 0;
}

int kvf_dump(void *base, uint64_t size, FILE *out, const struct kvf_dump_opts *o)
{
        struct dump d;
        int rc = setup(&d, base, size, out, o);

        if (rc < 0)
                return rc;
        if (d.json)
                j_open(&d, NULL, '{');
        print_header(&d);
        print_roles(&d);
        print_rings(&d);
        print_notices(&d);
        print_bells(&d);
        print_counters(&d);
        print_histograms(&d);
        print_errlog(&d);
        print_requests(&d);
        if (d.json) {
                j_close(&d, '}');
                fputc('\n', d.f);
        } else if (d.max_records) {
                print_pending_text(&d);
        }
        return 0;
}

void kvf_dump_brief_title(FILE *out)
{
        fprintf(out, "%-24s %-8s %-6s %-6s %-6s %-6s %-6s %10s %9s %7s\n", "instance", "role",
                "rank", "alloc", "conn", "sender", "engine", "pending", "requests", "errors");
}

int kvf_dump_brief(void *base, uint64_t size, FILE *out, const struct kvf_dump_opts *o)
{
        struct dump d;
        int rc = setup(&d, base, size, out, o);
        uint64_t pending = 0, errors = 0, in_use = 0;
        const char *alive[KVF_ROLE_COUNT];
        struct role_view rv[KVF_ROLE_COUNT];

        if (rc < 0)
                return rc;
        for (int i = 0; i < KVF_RING_COUNT; i++) {
                struct ring_view v;
                load_ring(&d, i, &v);
                pending += v.used;
        }
        errors = kvf_load_relaxed(&d.c.counters[KVF_CTR_ERRORS_LOGGED].value);
        uint32_t n = usable_slots(&d);
        for (uint32_t i = 0; i < n; i++)
                in_use += kvf_load_relaxed(&d.c.reqtab[i].state) != KVF_REQ_FREE;
        for (int r = 0; r < KVF_ROLE_COUNT; r++) {
                load_role(&d, r, &rv[r]);
                alive[r] = rv[r].state == KVF_STATE_NONE ? "-"
                           : rv[r].alive < 0             ? "?"
                           : rv[r].alive                 ? "up"
                                                         : "down";
        }
        size_t inl = fixlen(d.h.instance, sizeof(d.h.instance));
        if (d.json) {
                j_open(&d, NULL, '{');
                j_str(&d, "instance", d.h.instance, inl);
                j_null(&d, "error");
                j_cstr(&d, "role", kvf_irole_name(d.h.instance_role));
                j_u64(&d, "rank", d.h.rank);
                j_u64(&d, "nranks", d.h.nranks);
                j_open(&d, "roles", '{');
                for (int r = 0; r < KVF_ROLE_COUNT; r++) {
                        j_open(&d, kvf_role_name(r), '{');
                        j_cstr(&d, "state", state_name(rv[r].state));
                        if (rv[r].alive < 0)
                                j_null(&d, "alive");
                        else
                                j_bool(&d, "alive", rv[r].alive);
                        j_close(&d, '}');
                }
                j_close(&d, '}');
                j_u64(&d, "pending_bytes", pending);
                j_u64(&d, "requests_in_use", in_use);
                j_u64(&d, "errors_logged", errors);
                j_close(&d, '}');
                return 0;
        }
        char e[256], rank[32], pb[32];
        snprintf(rank, sizeof(rank), "%u/%u", d.h.rank, d.h.nranks);
        fprintf(out, "%-24s %-8s %-6s %-6s %-6s %-6s %-6s %10s %9" PRIu64 " %7" PRIu64 "\n",
                esc(e, sizeof(e), d.h.instance, inl), kvf_irole_name(d.h.instance_role), rank, alive[0],
                alive[1], alive[2], alive[3], human_bytes(pb, sizeof(pb), pending), in_use, errors);
        return 0;
}

void kvf_dump_brief_error(FILE *out, const char *name, int rc, const char *msg,
                          const struct kvf_dump_opts *o)
{
        struct dump d = {.f = out};
        char e1[256], e2[KVF_ERR_MAX * 4 + 8];

        if (o && o->json) {
                j_open(&d, NULL, '{');
                j_cstr(&d, "instance", name);
                j_cstr(&d, "error", msg);
                j_i64(&d, "errno", -rc);
                j_close(&d, '}');
                return;
        }
        fprintf(out, "%-24s %s\n", esc(e1, sizeof(e1), name, strlen(name)),
                esc(e2, sizeof(e2), msg, strlen(msg)));
}

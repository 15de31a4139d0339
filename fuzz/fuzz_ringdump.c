/*
 * libFuzzer target for kvf_dump() and kvf_dump_brief(), text and JSON.
 *
 * Random bytes almost never pass kvf_ctl_validate(), so most inputs are
 * patches over a valid segment image instead: at start-up a real segment is
 * created (kvf_ctl_create on a temporary instance), filled with records of
 * every type on their rings (one behind a padding record, one claimed and
 * never committed), role slots, connector info, error-log entries, counters
 * and request slots, copied, and unlinked. Input format:
 *
 *   0xff, bytes...                  raw mode: the bytes are the whole segment
 *   { region, off_lo, off_hi, n, n bytes }...   patches, applied in order
 *
 * A patch writes its bytes at region start + (off % region length), cut at
 * the end of the segment. Regions: see enum region below. Fewer than 4 bytes
 * left end the patch list (so an empty input dumps the pristine image).
 *
 * The patched image lies in a read-only mapping between two inaccessible
 * pages: a write, or a read outside the segment, faults at once. Raw-mode
 * input goes to an exact-size heap copy, where ASan sees every byte past it.
 *
 * Seeds: fuzz/corpus/ringdump/. To see what an input prints, run it with
 * FUZZ_RINGDUMP_STDOUT=1 in the environment (output goes to /dev/null otherwise).
 */
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "clock.h"
#include "ctl.h"
#include "err.h"
#include "records.h"
#include "ringdump_print.h"

enum region {
        R_HEADER,
        R_CONTROL, /* role slots, doorbells, progress, connector info */
        R_RING_HDRS,
        R_COUNTERS,
        R_ERRLOG,
        R_REQTAB,     /* request slots and the block arena */
        R_NOTICES,    /* the notice slots (holder lines and their rings' headers) */
        R_RING_DATA0, /* ... R_RING_DATA0 + 5 */
        R_COUNT = R_RING_DATA0 + KVF_RING_COUNT,
};

static struct {
        uint64_t off, len;
} regions[R_COUNT];
static uint8_t *image; /* the pristine segment */
static size_t image_size;
static uint8_t *guarded; /* image_size bytes between two PROT_NONE pages */
static size_t page;
static FILE *devnull;
static uint64_t now_ns;

static void die(const char *what)
{
        fprintf(stderr, "fuzz_ringdump: %s: %s\n", what, kvf_err_msg());
        abort();
}

static void put(struct kvf_ctl *c, int ring, struct kvf_record *r)
{
        uint8_t *buf;
        size_t len;
        if (kvf_record_encode_alloc(r, &buf, &len) < 0)
                die("encode a seed record");
        if (kvf_ring_write(&c->rings[ring], r->type, buf, (uint32_t)len, NULL) < 0)
                die("write a seed record");
        free(buf);
}

static int drop(void *ctx, uint16_t type, const uint8_t *p, uint32_t len, uint64_t pos)
{
        (void)ctx, (void)type, (void)p, (void)len, (void)pos;
        return 0;
}

static void fill(struct kvf_ctl *c)
{
        static uint32_t src[] = {1, 2, 3, 4}, dst[] = {7, 8}, runs[] = {1, 7, 2};
        struct kvf_record r;

        for (int i = 0; i < KVF_ROLE_COUNT; i++)
                kvf_role_begin(c, (enum kvf_role_id)i);
        kvf_role_begin(c, KVF_ROLE_SENDER);
        kvf_role_end(c, KVF_ROLE_ENGINE);
        kvf_connector_info_write(c, "10.1.2.3", 7100);
        c->progress->word = KVF_PROGRESS_PACK(12, 5);
        for (int i = 0; i < KVF_COUNTER_COUNT; i += 3)
                kvf_count(c, (enum kvf_counter_id)i, (uint64_t)i * 1000 + 1);
        kvf_errlog(c, KVF_ROLE_SENDER, "fuzz seed: peer %s refused", "p1");
        kvf_errlog(c, KVF_ROLE_CONNECTOR, "fuzz seed: %d", 7);
        for (int i = 0; i < KVF_RING_COUNT; i++)
                kvf_ring_producer_attach(&c->rings[i], 1);

        /* engine->sender: a padding record first, then task, chunk, cancel, a claim. */
        uint8_t pad[56] = {0}; /* 64-byte records: the task below needs padding */
        for (int i = 0; i < 63; i++)
                kvf_ring_write(&c->rings[KVF_RING_ENGINE_TO_SENDER], 200, pad, sizeof(pad), NULL);
        kvf_ring_read(&c->rings[KVF_RING_ENGINE_TO_SENDER], drop, NULL, 1000);
        memset(&r, 0, sizeof(r));
        r.type = KVF_REC_TASK;
        strcpy(r.request_id, "req-\"1\"");
        strcpy(r.peer, "10.9.9.9:7000");
        r.src = src, r.n_src = 4, r.dst = dst, r.n_dst = 2;
        r.current_id = 9, r.transport = KVF_TRANSPORT_TCP, r.chunked = true;
        put(c, KVF_RING_ENGINE_TO_SENDER, &r);
        memset(&r, 0, sizeof(r));
        r.type = KVF_REC_CHUNK;
        strcpy(r.request_id, "req-1");
        r.current_id = 10, r.tokens = 32, r.last = true;
        put(c, KVF_RING_ENGINE_TO_SENDER, &r);
        memset(&r, 0, sizeof(r));
        r.type = KVF_REC_CANCEL;
        strcpy(r.request_id, "req-2");
        put(c, KVF_RING_ENGINE_TO_SENDER, &r);
        void *p;
        uint64_t pos;
        kvf_ring_claim(&c->rings[KVF_RING_ENGINE_TO_SENDER], KVF_REC_CANCEL, 20, &p, &pos);

        memset(&r, 0, sizeof(r));
        r.type = KVF_REC_COMPLETION;
        strcpy(r.request_id, "req-0");
        strcpy(r.reason, "bad \x01 reason");
        r.status = KVF_STATUS_BAD_TASK;
        put(c, KVF_RING_SENDER_TO_ENGINE, &r);

        memset(&r, 0, sizeof(r));
        r.type = KVF_REC_CONNECT;
        strcpy(r.request_id, "conn-1");
        strcpy(r.peer, "p-decode");
        r.transport = KVF_TRANSPORT_IPC;
        put(c, KVF_RING_ENGINE_TO_CONNECTOR, &r);
        memset(&r, 0, sizeof(r));
        r.type = KVF_RT_DISCONNECT;
        strcpy(r.peer, "p-decode");
        put(c, KVF_RING_ENGINE_TO_CONNECTOR, &r);

        memset(&r, 0, sizeof(r));
        r.type = KVF_REC_CONNECT_RESULT;
        strcpy(r.request_id, "conn-1");
        strcpy(r.peer, "p-decode");
        put(c, KVF_RING_CONNECTOR_TO_ENGINE, &r);
        memset(&r, 0, sizeof(r));
        r.type = KVF_REC_ARRIVAL;
        strcpy(r.request_id, "req-5");
        strcpy(r.peer, "p-prefill");
        r.dst = dst, r.n_dst = 2, r.bytes = 100, r.blocks = 2;
        put(c, KVF_RING_CONNECTOR_TO_ENGINE, &r);

        memset(&r, 0, sizeof(r));
        r.type = KVF_RT_WRITE_BATCH;
        strcpy(r.request_id, "req-1");
        strcpy(r.peer, "10.9.9.9:7000");
        r.key = 77, r.layer = 3, r.runs = runs, r.n_runs = 3, r.transport = KVF_TRANSPORT_TCP;
        put(c, KVF_RING_SENDER_TO_CONNECTOR, &r);
        memset(&r, 0, sizeof(r));
        r.type = KVF_RT_FINISH;
        strcpy(r.request_id, "req-1");
        strcpy(r.peer, "10.9.9.9:7000");
        r.key = 77, r.dst = dst, r.n_dst = 2, r.transport = KVF_TRANSPORT_TCP;
        put(c, KVF_RING_SENDER_TO_CONNECTOR, &r);

        memset(&r, 0, sizeof(r));
        r.type = KVF_RT_WRITE_RESULT;
        strcpy(r.request_id, "req-1");
        r.key = 77, r.bytes = 4096;
        put(c, KVF_RING_CONNECTOR_TO_SENDER, &r);
        memset(&r, 0, sizeof(r));
        r.type = KVF_RT_PEER_STATE;
        strcpy(r.peer, "10.9.9.9:7000");
        r.up = true, r.generation = 3;
        put(c, KVF_RING_CONNECTOR_TO_SENDER, &r);

        for (uint32_t i = 0; i < c->hdr->reqtab_slots; i++) {
                struct kvf_req_slot *s = &c->reqtab[i];
                s->state = i % 4;
                s->status = i;
                snprintf(s->request_id, sizeof(s->request_id), "req-%u", i);
                snprintf(s->peer, sizeof(s->peer), "peer-%u", i);
                snprintf(s->reason, sizeof(s->reason), "reason %u", i);
                s->transport = KVF_TRANSPORT_IPC;
                s->accept_ns = kvf_now_ns();
                s->n_src = s->n_send = 4;
        }
}

static void init(void)
{
        char name[64];
        struct kvf_ctl c;
        struct kvf_ctl_params p = {
            .instance = name,
            .instance_role = KVF_IROLE_PREFILL,
            .layout = {.num_layers = 2,
                       .num_blocks = 8,
                       .kv_heads = 1,
                       .block_size = 4,
                       .head_dim = 8,
                       .dtype = KVF_DTYPE_FP16,
                       .block_bytes = 64,
                       .cache_bytes = 2 * 2 * 8 * 64},
            .backend = KVF_BACKEND_HOST,
            .nranks = 1,
            .reqtab_slots = 4,
            .max_blocks = 4,
        };

        for (int i = 0; i < KVF_RING_COUNT; i++)
                p.ring_capacity[i] = 4096;
        snprintf(name, sizeof(name), "fuzz-rdump-%d", (int)getpid());
        kvf_ctl_unlink(name);
        if (kvf_ctl_create(&p, &c) < 0)
                die("create the seed segment");
        kvf_ctl_publish(&c);
        fill(&c);
        /* a notice slot held (by init: a live pid that is never ours) */
        c.notices[3].pid = 1;
        c.notices[3].state = KVF_STATE_RUNNING;
        c.notices[3].generation = 2;
        c.notices[3].heartbeat_ns = kvf_now_ns();
        snprintf(c.notices[3].owner, sizeof(c.notices[3].owner), "fuzz-prefill");
        now_ns = kvf_now_ns() + 1000000000ull;

        const struct kvf_ctl_header *h = c.hdr;
        regions[R_HEADER].off = 0;
        regions[R_HEADER].len = KVF_HEADER_SIZE;
        regions[R_CONTROL].off = h->roles_off;
        regions[R_CONTROL].len = h->rings_off - h->roles_off;
        regions[R_RING_HDRS].off = h->rings_off;
        regions[R_RING_HDRS].len = h->counters_off - h->rings_off;
        regions[R_COUNTERS].off = h->counters_off;
        regions[R_COUNTERS].len = h->errlog_off - h->counters_off;
        regions[R_ERRLOG].off = h->errlog_off;
        regions[R_ERRLOG].len = h->journal_off - h->errlog_off;
        regions[R_REQTAB].off = h->reqtab_off;
        regions[R_REQTAB].len = c.ring_hdrs[0].data_off - h->reqtab_off;
        regions[R_NOTICES].off = h->notice_off;
        regions[R_NOTICES].len = (uint64_t)KVF_NOTICE_SLOTS * sizeof(struct kvf_notice_slot);
        for (int i = 0; i < KVF_RING_COUNT; i++) {
                regions[R_RING_DATA0 + i].off = c.ring_hdrs[i].data_off;
                regions[R_RING_DATA0 + i].len = c.ring_hdrs[i].capacity;
        }
        image_size = c.size;
        image = malloc(image_size);
        if (!image)
                die("allocate the seed image");
        memcpy(image, c.base, image_size);
        kvf_ctl_detach(&c);
        kvf_ctl_unlink(name);

        page = (size_t)sysconf(_SC_PAGESIZE);
        uint8_t *m =
            mmap(NULL, image_size + 2 * page, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (m == MAP_FAILED)
                die("map the guarded image");
        guarded = m + page;
        devnull = getenv("FUZZ_RINGDUMP_STDOUT") ? stdout : fopen("/dev/null", "w");
        if (!devnull)
                die("open /dev/null");
}

static void dump_all(void *base, uint64_t size)
{
        struct kvf_dump_opts o = {.records = true, .max_records = 64, .now_ns = now_ns};

        for (int json = 0; json < 2; json++) {
                o.json = json;
                o.verbose = !json;
                int rc = kvf_dump(base, size, devnull, &o);
                if (rc < 0 && kvf_err_msg()[0] == '\0')
                        die("kvf_dump failed without a message");
                if (rc < 0 && devnull == stdout)
                        printf("kvf_dump: %d: %s\n", rc, kvf_err_msg());
                kvf_dump_brief(base, size, devnull, &o);
        }
}

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
        (void)argc, (void)argv;
        init();
        return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
        kvf_err_clear();
        if (size >= 1 && data[0] == 0xff) {
                /* Raw: exact-size heap copy; 8-byte aligned as kvf_dump requires. */
                size_t n = size - 1;
                uint8_t *b = malloc(n ? n : 1);
                if (!b)
                        return 0;
                memcpy(b, data + 1, n);
                dump_all(b, n);
                free(b);
                return 0;
        }
        if (mprotect(guarded, image_size, PROT_READ | PROT_WRITE) < 0)
                die("unprotect the image");
        memcpy(guarded, image, image_size);
        while (size >= 4) {
                unsigned reg = data[0] % R_COUNT;
                uint64_t off =
                    regions[reg].off + (data[1] | (unsigned)data[2] << 8) % regions[reg].len;
                size_t n = data[3];
                data += 4;
                size -= 4;
                if (n > size)
                        n = size;
                if (n > image_size - off)
                        n = image_size - off;
                memcpy(guarded + off, data, n);
                data += n;
                size -= n;
        }
        /* Read-only from here: kvf_dump must never write. */
        if (mprotect(guarded, image_size, PROT_READ) < 0)
                die("protect the image");
        dump_all(guarded, image_size);
        return 0;
}

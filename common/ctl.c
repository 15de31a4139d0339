#include "ctl.h"

#include <errno.h>
#include <fcntl.h>
#include <pwd.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "atomics.h"
#include "clock.h"
#include "doorbell.h"
#include "err.h"
#include "hugepages.h"
#include "layout.h"
#include "log.h"

const char *const kvf_counter_names[KVF_COUNTER_COUNT] = {
#define KVF_COUNTER_NAME(id, name) name,
        KVF_COUNTER_LIST(KVF_COUNTER_NAME)
#undef KVF_COUNTER_NAME
};

static const char *const role_names[KVF_ROLE_COUNT] = {"allocator", "connector", "sender",
                                                       "engine"};
static const char *const ring_names[KVF_RING_COUNT] = {
        "engine->sender",    "sender->engine",    "engine->connector",
        "connector->engine", "sender->connector", "connector->sender"};
/* producer, consumer, consumer's doorbell */
static const uint32_t ring_roles[KVF_RING_COUNT][3] = {
        {KVF_ROLE_ENGINE, KVF_ROLE_SENDER, KVF_BELL_SENDER},
        {KVF_ROLE_SENDER, KVF_ROLE_ENGINE, KVF_BELL_ENGINE},
        {KVF_ROLE_ENGINE, KVF_ROLE_CONNECTOR, KVF_BELL_CONNECTOR},
        {KVF_ROLE_CONNECTOR, KVF_ROLE_ENGINE, KVF_BELL_ENGINE},
        {KVF_ROLE_SENDER, KVF_ROLE_CONNECTOR, KVF_BELL_CONNECTOR},
        {KVF_ROLE_CONNECTOR, KVF_ROLE_SENDER, KVF_BELL_SENDER},
};

const char *kvf_role_name(int role)
{
        return role >= 0 && role < KVF_ROLE_COUNT ? role_names[role] : "?";
}

const char *kvf_irole_name(uint32_t r)
{
        switch (r) {
        case KVF_IROLE_PREFILL:
                return "prefill";
        case KVF_IROLE_DECODE:
                return "decode";
        case KVF_IROLE_MIXED:
                return "mixed";
        }
        return "unknown";
}

const char *kvf_ring_name(int ring)
{
        return ring >= 0 && ring < KVF_RING_COUNT ? ring_names[ring] : "?";
}

uint64_t kvf_hash64(const void *p, size_t n, uint64_t seed)
{
        /* FNV-1a, then a final mix; for de-duplication keys, not security. */
        const uint8_t *b = p;
        uint64_t h = 0xcbf29ce484222325ull ^ seed;
        for (size_t i = 0; i < n; i++)
                h = (h ^ b[i]) * 0x100000001b3ull;
        h ^= h >> 33;
        h *= 0xff51afd7ed558ccdull;
        h ^= h >> 33;
        return h ? h : 1;
}

uint64_t kvf_boot_id(void)
{
        char buf[64] = {0};
        int fd = open("/proc/sys/kernel/random/boot_id", O_RDONLY | O_CLOEXEC);
        if (fd >= 0) {
                ssize_t n = read(fd, buf, sizeof(buf) - 1);
                close(fd);
                if (n > 0)
                        return kvf_hash64(buf, (size_t)n, 0);
        }
        char host[256] = {0};
        gethostname(host, sizeof(host) - 1);
        return kvf_hash64(host, strlen(host), 1);
}

int kvf_instance_name_check(const char *name)
{
        size_t n = name ? strlen(name) : 0;

        if (n == 0 || n >= KVF_INSTANCE_MAX)
                return kvf_err_set(-EINVAL, "instance name must be 1 to %u characters, got %zu",
                                   KVF_INSTANCE_MAX - 1, n);
        for (size_t i = 0; i < n; i++) {
                char ch = name[i];
                if (!((ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') ||
                      (ch >= '0' && ch <= '9') || ch == '_' || ch == '-' || ch == '.'))
                        return kvf_err_set(-EINVAL,
                                           "instance name '%s': only letters, digits, '_', '-' and '.' are allowed",
                                           name);
        }
        if (name[0] == '.')
                return kvf_err_set(-EINVAL, "instance name '%s' must not start with '.'", name);
        return 0;
}

void kvf_ctl_shm_name(const char *instance, char *buf, size_t len)
{
        snprintf(buf, len, "/kvferry.%s", instance);
}

void kvf_cache_shm_name(const char *instance, char *buf, size_t len)
{
        snprintf(buf, len, "/kvferry.%s.cache", instance);
}

/* Where every region goes, derived from a few parameters only. */
struct plan {
        uint64_t roles, bells, progress, cinfo, rings, counters, errlog, journal, sender_area,
                reqtab, blocks, cuda, exec, plan, notice, notice_data, ring_data[KVF_RING_COUNT], total;
};

static uint64_t align_up(uint64_t v, uint64_t a)
{
        return (v + a - 1) / a * a;
}

static int make_plan(uint32_t slots, uint32_t max_blocks, uint32_t cuda_handles,
                     const uint64_t cap[KVF_RING_COUNT], struct plan *p)
{
        uint64_t off = KVF_HEADER_SIZE;

        if (slots == 0 || slots > 65536)
                return kvf_err_set(-EINVAL, "request table slots %u not in [1, 65536]", slots);
        if (max_blocks == 0 || max_blocks > (1u << 20))
                return kvf_err_set(-EINVAL, "max blocks per request %u not in [1, 1048576]",
                                   max_blocks);
        if (cuda_handles > 4 * KVF_MAX_LAYERS)
                return kvf_err_set(-EINVAL, "%u CUDA handles is more than %u", cuda_handles,
                                   4 * KVF_MAX_LAYERS);
        p->roles = off;
        off += KVF_ROLE_COUNT * sizeof(struct kvf_role_slot);
        p->bells = off;
        off += KVF_BELL_COUNT * sizeof(struct kvf_doorbell);
        p->progress = off;
        off += sizeof(struct kvf_progress);
        p->cinfo = off;
        off += sizeof(struct kvf_connector_info);
        p->rings = off;
        off += KVF_RING_COUNT * sizeof(struct kvf_ring_hdr);
        p->counters = off;
        off += KVF_COUNTER_COUNT * sizeof(struct kvf_counter);
        p->errlog = off;
        off += (uint64_t)KVF_ROLE_COUNT * KVF_ERRLOG_ENTRIES * sizeof(struct kvf_errlog_entry);
        p->journal = off;
        off += KVF_JOURNAL_ENTRIES * sizeof(struct kvf_journal_entry);
        p->sender_area = off;
        off += sizeof(struct kvf_sender_area);
        p->cuda = off;
        off += (uint64_t)cuda_handles * 64;
        p->exec = off = align_up(off, KVF_CACHE_LINE);
        off += sizeof(struct kvf_exec);
        p->plan = off;
        off += (uint64_t)slots * sizeof(struct kvf_plan_entry);
        p->notice = off = align_up(off, KVF_CACHE_LINE);
        off += (uint64_t)KVF_NOTICE_SLOTS * sizeof(struct kvf_notice_slot);
        p->reqtab = off = align_up(off, 4096);
        off += (uint64_t)slots * sizeof(struct kvf_req_slot);
        p->blocks = off = align_up(off, 4096);
        off += (uint64_t)slots * max_blocks * 2 * sizeof(uint32_t);
        for (int i = 0; i < KVF_RING_COUNT; i++) {
                if (!kvf_ring_capacity_ok(cap[i]))
                        return kvf_err_set(-EINVAL,
                                           "ring %s: capacity %llu is not a power of two in [%u, %u]",
                                           ring_names[i], (unsigned long long)cap[i],
                                           KVF_RING_MIN_CAPACITY, KVF_RING_MAX_CAPACITY);
                p->ring_data[i] = off = align_up(off, 4096);
                off += cap[i];
        }
        /* the notice slots' rings: slot s's notice ring, then its reply ring */
        p->notice_data = off = align_up(off, 4096);
        off += (uint64_t)KVF_NOTICE_SLOTS * 2 * KVF_NOTICE_RING_CAPACITY;
        p->total = align_up(off, 4096);
        return 0;
}

static void bind_views(struct kvf_ctl *c, const struct plan *p)
{
        uint8_t *b = c->base;

        c->hdr = (struct kvf_ctl_header *)(void *)b;
        c->roles = (struct kvf_role_slot *)(void *)(b + p->roles);
        c->bells = (struct kvf_doorbell *)(void *)(b + p->bells);
        c->progress = (struct kvf_progress *)(void *)(b + p->progress);
        c->cinfo = (struct kvf_connector_info *)(void *)(b + p->cinfo);
        c->ring_hdrs = (struct kvf_ring_hdr *)(void *)(b + p->rings);
        c->counters = (struct kvf_counter *)(void *)(b + p->counters);
        c->errlog = (struct kvf_errlog_entry *)(void *)(b + p->errlog);
        c->journal = (struct kvf_journal_entry *)(void *)(b + p->journal);
        c->sender = (struct kvf_sender_area *)(void *)(b + p->sender_area);
        c->reqtab = (struct kvf_req_slot *)(void *)(b + p->reqtab);
        c->blocks = (uint32_t *)(void *)(b + p->blocks);
        c->exec = (struct kvf_exec *)(void *)(b + p->exec);
        c->plan = (struct kvf_plan_entry *)(void *)(b + p->plan);
        c->notices = (struct kvf_notice_slot *)(void *)(b + p->notice);
        c->cuda_handles = b + p->cuda;
}

static void c_init_sender_area(struct kvf_sender_area *a)
{
        a->reject_task_pos = ~0ull;
        a->reject_completion_pos = ~0ull;
}

int kvf_ctl_exists_err(const char *instance, const char *shm)
{
        char path[128];

        snprintf(path, sizeof(path), "/dev/shm%s", shm);
        return kvf_ctl_exists_path_err(instance, path);
}

int kvf_ctl_exists_path_err(const char *instance, const char *path)
{
        char who[320], buf[1024];
        struct passwd pw, *res = NULL;
        struct stat st;

        /* Whose it is, asked of the file: open() proves nothing, root opens anyone's. lstat:
         * a symlink planted under the name is its planter's. */
        if (lstat(path, &st) < 0 || st.st_uid == geteuid())
                return kvf_err_set(-EEXIST,
                                   "instance '%s' already exists (%s): is it running? "
                                   "stop it with `tools/kvferry down --instance %s`",
                                   instance, path, instance);
        if (getpwuid_r(st.st_uid, &pw, buf, sizeof(buf), &res) == 0 && res)
                snprintf(who, sizeof(who), "user %s (uid %u)", res->pw_name, (unsigned)st.st_uid);
        else
                snprintf(who, sizeof(who), "uid %u", (unsigned)st.st_uid);
        return kvf_err_set(-EEXIST,
                           "%s exists and belongs to %s: another user holds this instance name; "
                           "pick another --instance or ask them to remove it",
                           path, who);
}

int kvf_ctl_create(const struct kvf_ctl_params *prm, struct kvf_ctl *out)
{
        char name[96];
        uint64_t cap[KVF_RING_COUNT];
        struct plan p;
        int rc;

        memset(out, 0, sizeof(*out));
        out->fd = -1;
        if ((rc = kvf_instance_name_check(prm->instance)) < 0)
                return rc;
        for (int i = 0; i < KVF_RING_COUNT; i++)
                cap[i] = prm->ring_capacity[i] ? prm->ring_capacity[i] : KVF_DEFAULT_RING_CAPACITY;
        uint32_t slots = prm->reqtab_slots ? prm->reqtab_slots : KVF_DEFAULT_REQTAB_SLOTS;
        uint32_t maxb = prm->max_blocks ? prm->max_blocks : KVF_DEFAULT_MAX_BLOCKS;
        if ((rc = make_plan(slots, maxb, prm->cuda_handles, cap, &p)) < 0)
                return rc;

        kvf_ctl_shm_name(prm->instance, name, sizeof(name));
        int fd = shm_open(name, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
        if (fd < 0) {
                rc = -errno;
                if (rc == -EEXIST)
                        return kvf_ctl_exists_err(prm->instance, name);
                return kvf_err_set(rc, "create /dev/shm%s: %s", name, strerror(-rc));
        }
        /* fchmod: the umask must not widen or narrow 0600. */
        if (fchmod(fd, 0600) < 0 || ftruncate(fd, (off_t)p.total) < 0) {
                rc = -errno;
                kvf_err_set(rc, "size /dev/shm%s to %llu bytes: %s", name,
                            (unsigned long long)p.total, strerror(-rc));
                goto fail_unlink;
        }
        /* Every page now, not at first touch: a request's first use of its table slot
         * (block lists, kilobytes) would otherwise take page faults on the sender's path
         * between a layer-done and the finish notice (tens of microseconds, measured
         * with kvf-sim), and a /dev/shm too small for the segment fails here, with a
         * message, instead of as SIGBUS in whichever process touches the page. */
        rc = -posix_fallocate(fd, 0, (off_t)p.total);
        if (rc < 0) {
                kvf_err_set(rc, "reserve %llu bytes for /dev/shm%s: %s (is /dev/shm full?)",
                            (unsigned long long)p.total, name, strerror(-rc));
                goto fail_unlink;
        }
        void *base = mmap(NULL, p.total, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
        if (base == MAP_FAILED) {
                rc = -errno;
                kvf_err_set(rc, "map /dev/shm%s: %s", name, strerror(-rc));
                goto fail_unlink;
        }
        out->fd = fd;
        out->base = base;
        out->size = p.total;
        out->writable = true;
        bind_views(out, &p);

        struct kvf_ctl_header *h = out->hdr;
        h->magic = KVF_MAGIC;
        h->header_size = KVF_HEADER_SIZE;
        h->total_size = p.total;
        h->owner_uid = (uint32_t)geteuid();
        h->instance_role = prm->instance_role;
        h->created_ns = kvf_wall_ns();
        h->boot_id = kvf_boot_id();
        snprintf(h->instance, sizeof(h->instance), "%s", prm->instance);
        h->layout = prm->layout;
        h->backend = prm->backend;
        h->device = prm->device;
        h->rank = prm->rank;
        h->nranks = prm->nranks ? prm->nranks : 1;
        kvf_cache_shm_name(prm->instance, h->cache_name, sizeof(h->cache_name));
        c_init_sender_area(out->sender);
        h->roles_off = p.roles;
        h->bells_off = p.bells;
        h->progress_off = p.progress;
        h->connector_info_off = p.cinfo;
        h->rings_off = p.rings;
        h->counters_off = p.counters;
        h->counters_count = KVF_COUNTER_COUNT;
        h->errlog_off = p.errlog;
        h->errlog_entries = KVF_ERRLOG_ENTRIES;
        h->journal_off = p.journal;
        h->sender_area_off = p.sender_area;
        h->reqtab_off = p.reqtab;
        h->reqtab_slots = slots;
        h->max_blocks = maxb;
        h->blocks_off = p.blocks;
        h->cuda_handles_off = p.cuda;
        h->cuda_handles_count = prm->cuda_handles;
        h->executor = prm->executor;
        h->exec_off = p.exec;
        h->plan_off = p.plan;
        h->plan_slots = slots;
        h->notice_off = p.notice;
        h->notice_slots = KVF_NOTICE_SLOTS;
        h->notice_ring_capacity = KVF_NOTICE_RING_CAPACITY;
        for (uint32_t s = 0; s < KVF_NOTICE_SLOTS; s++) {
                struct kvf_notice_slot *ns = &out->notices[s];
                uint64_t d = p.notice_data + (uint64_t)s * 2 * KVF_NOTICE_RING_CAPACITY;
                ns->reply_bell.asymmetric = kvf_doorbell_asymmetric_supported();
                kvf_ring_format(&ns->notice, KVF_RING_NOTICE, KVF_ROLE_SENDER, KVF_ROLE_CONNECTOR,
                                KVF_BELL_CONNECTOR, d, KVF_NOTICE_RING_CAPACITY);
                kvf_ring_format(&ns->reply, KVF_RING_REPLY, KVF_ROLE_CONNECTOR, KVF_ROLE_SENDER,
                                KVF_BELL_SENDER, d + KVF_NOTICE_RING_CAPACITY,
                                KVF_NOTICE_RING_CAPACITY);
        }
        h->heartbeat_ms = prm->heartbeat_ms ? prm->heartbeat_ms : KVF_DEFAULT_HEARTBEAT_MS;
        bool asym = kvf_doorbell_asymmetric_supported();
        for (int i = 0; i < KVF_BELL_COUNT; i++)
                out->bells[i].asymmetric = asym;
        for (int i = 0; i < KVF_RING_COUNT; i++) {
                h->ring_capacity[i] = cap[i];
                kvf_ring_format(&out->ring_hdrs[i], (uint32_t)i, ring_roles[i][0], ring_roles[i][1],
                                ring_roles[i][2], p.ring_data[i], cap[i]);
                kvf_ring_bind(&out->rings[i], base, p.total, &out->ring_hdrs[i],
                              &out->bells[ring_roles[i][2]]);
                out->rings[i].full_ctr = &out->counters[KVF_CTR_RING_FULL].value;
        }
        return 0;

fail_unlink:
        shm_unlink(name);
        close(fd);
        out->fd = -1;
        return rc;
}

void kvf_ctl_publish(struct kvf_ctl *c)
{
        /* Pairs with the acquire load of version in kvf_ctl_validate(): all
         * of the header and the formatted regions are visible before it. */
        kvf_store_release(&c->hdr->version, KVF_LAYOUT_VERSION);
}

static int bad(const char *what, ...) __attribute__((format(printf, 1, 2)));
static int bad(const char *what, ...)
{
        char m[KVF_ERR_MAX];
        va_list ap;
        va_start(ap, what);
        vsnprintf(m, sizeof(m), what, ap);
        va_end(ap);
        return kvf_err_set(-EBADMSG, "corrupt control segment: %s", m);
}

int kvf_ctl_validate(void *base, uint64_t size, uid_t uid, struct kvf_ctl *out)
{
        const struct kvf_ctl_header *h = base;
        uint64_t cap[KVF_RING_COUNT];
        struct plan p;

        memset(out, 0, sizeof(*out));
        out->fd = -1;
        if (size < KVF_HEADER_SIZE)
                return kvf_err_set(-EBADMSG,
                                   "truncated control segment: %llu bytes, the header alone needs %u",
                                   (unsigned long long)size, KVF_HEADER_SIZE);
        /* Its creator sized the file (and reserves its pages) before it writes the
         * header: a header still zero is a segment being created, like version 0. */
        if (h->magic == 0 && kvf_load_acquire(&h->version) == 0)
                return kvf_err_set(-EAGAIN,
                                   "control segment not ready: its header is still zero (being created)");
        if (h->magic != KVF_MAGIC)
                return kvf_err_set(-EPROTO,
                                   "not a kvferry control segment: magic 0x%016llx, expected 0x%016llx",
                                   (unsigned long long)h->magic, (unsigned long long)KVF_MAGIC);
        /* Pairs with the release store in kvf_ctl_publish(). */
        uint32_t version = kvf_load_acquire(&h->version);
        if (version == 0)
                return kvf_err_set(-EAGAIN,
                                   "control segment not ready: its allocator has not finished creating it");
        if (version != KVF_LAYOUT_VERSION)
                return kvf_err_set(-EPROTO,
                                   "control segment layout version %u, this build speaks version %u "
                                   "(another build of kvferry made it: stop that instance with that "
                                   "build's tools/kvferry down)",
                                   version, KVF_LAYOUT_VERSION);
        if (uid != (uid_t)-1 && (h->owner_uid != (uint32_t)uid || uid != geteuid()))
                return kvf_err_set(-EPERM,
                                   "control segment owned by uid %u (header says %u), we run as uid %u",
                                   (unsigned)uid, h->owner_uid, (unsigned)geteuid());
        if (h->header_size != KVF_HEADER_SIZE)
                return bad("header size %u, expected %u", h->header_size, KVF_HEADER_SIZE);
        if (h->total_size != size)
                return kvf_err_set(-EBADMSG,
                                   "truncated control segment: the file has %llu bytes, its header says %llu",
                                   (unsigned long long)size, (unsigned long long)h->total_size);
        if (memchr(h->instance, 0, sizeof(h->instance)) == NULL ||
            kvf_instance_name_check(h->instance) < 0)
                return bad("instance name is not a valid name");
        if (memchr(h->cache_name, 0, sizeof(h->cache_name)) == NULL)
                return bad("cache name is not terminated");
        if (h->cache_backing > KVF_CACHE_SHM_THP)
                return bad("cache backing %u is not one this build knows", h->cache_backing);
        if (h->cache_page_kib != 0 && h->cache_page_kib != 4 && h->cache_page_kib != 2048)
                return bad("cache page size %u KiB, expected 4 or 2048", h->cache_page_kib);
        if (memchr(h->cache_path, 0, sizeof(h->cache_path)) == NULL ||
            memchr(h->cache_note, 0, sizeof(h->cache_note)) == NULL)
                return bad("cache path or note is not terminated");
        if (h->counters_count != KVF_COUNTER_COUNT)
                return bad("%u counters, this build has %u", h->counters_count, KVF_COUNTER_COUNT);
        if (h->errlog_entries != KVF_ERRLOG_ENTRIES)
                return bad("%u error-log entries per role, expected %u", h->errlog_entries,
                           KVF_ERRLOG_ENTRIES);
        if (h->layout.num_layers + (uint64_t)h->layout.extra_layers > KVF_MAX_LAYERS)
                return bad("%u + %u layers is more than %u", h->layout.num_layers,
                           h->layout.extra_layers, KVF_MAX_LAYERS);
        if (h->layout.num_layers != 0) {
                /* Block and cache sizes must follow from the shape: the sender copies at
                 * offsets computed from the one into a mapping as long as the other. */
                const struct kvf_cache_layout *l = &h->layout;
                struct kvf_cache_layout want;
                if (kvf_layout_make(&want, l->num_layers, l->extra_layers, l->num_blocks, l->kv_heads,
                                    l->block_size, l->head_dim, l->dtype, l->key_only) < 0 ||
                    kvf_layout_set_scales(&want, l->scale_dtype) < 0)
                        return bad("cache layout: %s", kvf_err_msg());
                if (memcmp(&want, l, sizeof(want)))
                        return bad("cache layout: block or cache size does not follow from its shape");
        }
        for (int i = 0; i < KVF_RING_COUNT; i++)
                cap[i] = h->ring_capacity[i];
        if (make_plan(h->reqtab_slots, h->max_blocks, h->cuda_handles_count, cap, &p) < 0)
                return kvf_err_ctx(-EBADMSG, "corrupt control segment");
        if (h->notice_slots != KVF_NOTICE_SLOTS || h->notice_ring_capacity != KVF_NOTICE_RING_CAPACITY)
                return bad("%u notice slots of %u-byte rings, expected %u of %u", h->notice_slots,
                           h->notice_ring_capacity, KVF_NOTICE_SLOTS, KVF_NOTICE_RING_CAPACITY);
        if (h->plan_slots != h->reqtab_slots)
                return bad("%u plan entries for %u request slots", h->plan_slots, h->reqtab_slots);
        if (p.total != h->total_size)
                return bad("regions need %llu bytes, the segment has %llu",
                           (unsigned long long)p.total, (unsigned long long)h->total_size);
        const struct {
                const char *name;
                uint64_t have, want;
        } offs[] = {
                {"roles", h->roles_off, p.roles},       {"doorbells", h->bells_off, p.bells},
                {"progress", h->progress_off, p.progress}, {"connector info", h->connector_info_off, p.cinfo},
                {"rings", h->rings_off, p.rings},       {"counters", h->counters_off, p.counters},
                {"error log", h->errlog_off, p.errlog}, {"journal", h->journal_off, p.journal},
                {"sender area", h->sender_area_off, p.sender_area},
                {"request table", h->reqtab_off, p.reqtab}, {"block arena", h->blocks_off, p.blocks},
                {"CUDA handles", h->cuda_handles_off, p.cuda},
                {"executor words", h->exec_off, p.exec}, {"plan entries", h->plan_off, p.plan},
                {"notice slots", h->notice_off, p.notice},
        };
        for (size_t i = 0; i < sizeof(offs) / sizeof(offs[0]); i++)
                if (offs[i].have != offs[i].want)
                        return bad("%s at offset %llu, expected %llu", offs[i].name,
                                   (unsigned long long)offs[i].have,
                                   (unsigned long long)offs[i].want);

        out->base = base;
        out->size = size;
        bind_views(out, &p);
        for (int i = 0; i < KVF_RING_COUNT; i++) {
                struct kvf_ring_hdr *rh = &out->ring_hdrs[i];
                if (rh->id != (uint32_t)i || rh->producer != ring_roles[i][0] ||
                    rh->consumer != ring_roles[i][1] || rh->bell != ring_roles[i][2])
                        return bad("ring %d has the wrong identity", i);
                if (rh->capacity != cap[i] || rh->data_off != p.ring_data[i])
                        return bad("ring %s: capacity or data offset disagree with the header",
                                   ring_names[i]);
                if (kvf_ring_bind(&out->rings[i], base, size, rh, &out->bells[rh->bell]) < 0)
                        return kvf_err_ctx(-EBADMSG, "corrupt control segment");
                out->rings[i].full_ctr = &out->counters[KVF_CTR_RING_FULL].value;
        }
        for (uint32_t s = 0; s < KVF_NOTICE_SLOTS; s++) {
                const struct kvf_notice_slot *ns = &out->notices[s];
                uint64_t d = p.notice_data + (uint64_t)s * 2 * KVF_NOTICE_RING_CAPACITY;
                if (ns->notice.id != KVF_RING_NOTICE || ns->reply.id != KVF_RING_REPLY ||
                    ns->notice.capacity != KVF_NOTICE_RING_CAPACITY ||
                    ns->reply.capacity != KVF_NOTICE_RING_CAPACITY || ns->notice.data_off != d ||
                    ns->reply.data_off != d + KVF_NOTICE_RING_CAPACITY)
                        return bad("notice slot %u: its rings have the wrong identity, capacity or offset", s);
        }
        return 0;
}

static int attach_path(const char *path, bool writable, bool populate, bool nofollow,
                       struct kvf_ctl *out);

int kvf_ctl_attach_path(const char *path, bool writable, struct kvf_ctl *out)
{
        return attach_path(path, writable, writable, false, out);
}

static int attach_path(const char *path, bool writable, bool populate, bool nofollow,
                       struct kvf_ctl *out)
{
        struct stat st;
        int rc;
        /* O_NONBLOCK: a FIFO at this path must not hang us (it is refused below). */
        int fd = open(path, (writable ? O_RDWR : O_RDONLY) | O_CLOEXEC | O_NONBLOCK |
                                (nofollow ? O_NOFOLLOW : 0));

        memset(out, 0, sizeof(*out));
        out->fd = -1;
        if (fd < 0) {
                rc = -errno;
                if (rc == -ENOENT)
                        return kvf_err_set(rc, "%s does not exist", path);
                if (rc == -ELOOP && nofollow)
                        return kvf_err_set(-EPERM, "%s is a symbolic link: refusing it (an instance's "
                                           "segment is a file of its own)", path);
                return kvf_err_set(rc, "open %s: %s", path, strerror(-rc));
        }
        if (fstat(fd, &st) < 0) {
                rc = -errno;
                close(fd);
                return kvf_err_set(rc, "stat %s: %s", path, strerror(-rc));
        }
        if (!S_ISREG(st.st_mode)) {
                close(fd);
                return kvf_err_set(-EINVAL, "%s is not a regular file", path);
        }
        if (st.st_uid != geteuid()) {
                close(fd);
                return kvf_err_set(-EPERM, "%s is owned by uid %u, we run as uid %u: refusing it",
                                   path, (unsigned)st.st_uid, (unsigned)geteuid());
        }
        if ((uint64_t)st.st_size < KVF_HEADER_SIZE) {
                close(fd);
                return kvf_err_set(st.st_size == 0 ? -EAGAIN : -EBADMSG,
                                   "%s: truncated control segment: %lld bytes, the header alone needs %u",
                                   path, (long long)st.st_size, KVF_HEADER_SIZE);
        }
        /* A role or an engine (writable) takes its page-table entries now, not on its hot
         * path (see kvf_ctl_create); a reader (ringdump, a peer's lookup, wait-ready's
         * polling) or a peer's role (its notice slots, a doorbell) touches a few fields and
         * does not pay for the whole segment. */
        void *base = mmap(NULL, (size_t)st.st_size, PROT_READ | (writable ? PROT_WRITE : 0),
                          MAP_SHARED | (populate ? MAP_POPULATE : 0), fd, 0);
        if (base == MAP_FAILED) {
                rc = -errno;
                close(fd);
                return kvf_err_set(rc, "map %s: %s", path, strerror(-rc));
        }
        rc = kvf_ctl_validate(base, (uint64_t)st.st_size, st.st_uid, out);
        if (rc < 0) {
                kvf_err_ctx(rc, "%s", path);
                munmap(base, (size_t)st.st_size);
                close(fd);
                memset(out, 0, sizeof(*out));
                out->fd = -1;
                return rc;
        }
        out->fd = fd;
        out->writable = writable;
        return 0;
}

static int attach_name(const char *name, bool writable, bool populate, struct kvf_ctl *out)
{
        char shm[96], path[128];
        int rc;

        if ((rc = kvf_instance_name_check(name)) < 0)
                return rc;
        kvf_ctl_shm_name(name, shm, sizeof(shm));
        snprintf(path, sizeof(path), "/dev/shm%s", shm);
        /* Never through a link, and only the segment of that name: a link (or a copy)
         * under another name would make this name reach another instance. */
        rc = attach_path(path, writable, populate, true, out);
        if (rc == -ENOENT)
                return kvf_err_set(rc, "no instance '%s' on this host (%s does not exist)", name,
                                   path);
        if (rc == 0 && strncmp(out->hdr->instance, name, sizeof(out->hdr->instance))) {
                char was[sizeof(out->hdr->instance) + 1];
                snprintf(was, sizeof(was), "%.*s", (int)sizeof(out->hdr->instance), out->hdr->instance);
                kvf_ctl_detach(out);
                return kvf_err_set(-EPERM, "%s is the segment of instance '%s', not of '%s': refusing it",
                                   path, was, name);
        }
        return rc;
}

int kvf_ctl_attach(const char *name, bool writable, struct kvf_ctl *out)
{
        return attach_name(name, writable, writable, out);
}

int kvf_ctl_attach_peer(const char *name, bool writable, struct kvf_ctl *out)
{
        return attach_name(name, writable, false, out);
}

int kvf_ctl_attach_wait(const char *name, bool writable, unsigned wait_ms, struct kvf_ctl *out)
{
        uint64_t end = kvf_now_ns() + kvf_ms(wait_ms);

        for (;;) {
                int rc = kvf_ctl_attach(name, writable, out);
                if ((rc != -ENOENT && rc != -EAGAIN) || kvf_now_ns() >= end)
                        return rc;
                kvf_sleep_ns(5000000);
        }
}

void kvf_ctl_detach(struct kvf_ctl *c)
{
        if (c->base && c->fd >= 0)
                munmap(c->base, c->size);
        if (c->fd >= 0)
                close(c->fd);
        memset(c, 0, sizeof(*c));
        c->fd = -1;
}

struct unlink_huge {
        const char *base; /* "/kvferry.<instance>.cache" */
        int removed;
};

/* The instance's cache on one hugetlbfs mount, removed if it is ours (root may remove
 * anyone's file, so another user's is never removed for a name). */
static void unlink_huge_cache(const char *dir, void *arg)
{
        struct unlink_huge *u = arg;
        char path[512];
        struct stat st;
        if ((size_t)snprintf(path, sizeof(path), "%s%s", dir, u->base) >= sizeof(path))
                return;
        if (lstat(path, &st) == 0 && S_ISREG(st.st_mode) && st.st_uid == geteuid() &&
            unlink(path) == 0)
                u->removed = 0;
}

int kvf_ctl_unlink(const char *instance)
{
        char name[96];
        int removed = -ENOENT;

        if (kvf_instance_name_check(instance) < 0)
                return -EINVAL;
        kvf_cache_shm_name(instance, name, sizeof(name));
        struct unlink_huge u = {.base = name, .removed = -ENOENT};
        kvf_huge_for_each_mount(unlink_huge_cache, &u);
        removed = u.removed;
        if (shm_unlink(name) == 0)
                removed = 0;
        kvf_ctl_shm_name(instance, name, sizeof(name));
        if (shm_unlink(name) == 0)
                removed = 0;
        return removed;
}

/* Field 22 of /proc/<pid>/stat, or 0; *zombie says whether the process has exited unreaped. */
int kvf_connector_info_read(const struct kvf_ctl *c, char *host, size_t hostlen, uint32_t *port)
{
        const struct kvf_connector_info *ci = c->cinfo;

        for (int tries = 0; tries < 1000; tries++) {
                uint32_t s1 = kvf_load_acquire(&ci->seq);
                if (s1 == 0)
                        return -EAGAIN;
                if (s1 & 1)
                        continue;
                char h[sizeof(ci->listen_host)];
                memcpy(h, ci->listen_host, sizeof(h));
                uint32_t p = kvf_load_relaxed(&ci->port);
                __atomic_thread_fence(__ATOMIC_ACQUIRE);
                if (kvf_load_relaxed(&ci->seq) != s1)
                        continue;
                h[sizeof(h) - 1] = '\0';
                snprintf(host, hostlen, "%s", h);
                *port = p;
                return 0;
        }
        return -EAGAIN;
}

void kvf_connector_info_write(struct kvf_ctl *c, const char *host, uint32_t port)
{
        struct kvf_connector_info *ci = c->cinfo;
        uint32_t seq = kvf_load_relaxed(&ci->seq);

        if (seq & 1)
                seq++; /* a writer died mid-update */
        kvf_store_relaxed(&ci->seq, seq + 1);
        __atomic_thread_fence(__ATOMIC_RELEASE);
        snprintf(ci->listen_host, sizeof(ci->listen_host), "%s", host);
        kvf_store_relaxed(&ci->port, port);
        kvf_store_release(&ci->seq, seq + 2);
}


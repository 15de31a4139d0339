/*
 * The control segment of an instance: creation (allocator), attachment
 * (everyone else), names, the connector's published address (ctl.c); role
 * slots and engine sessions (roles.c); counters; the error log (errlog.c);
 * latency histograms (hist.c). The caches are behind cache.h.
 *
 * Names: the segment is /dev/shm/kvferry.<instance>, the host cache file
 * /dev/shm/kvferry.<instance>.cache, or <hugetlbfs mount>/kvferry.<instance>.cache
 * when it is in 2 MiB pages (the header's cache_path). Instance names are 1-47
 * characters of [A-Za-z0-9_.-].
 */
#ifndef KVF_CTL_H
#define KVF_CTL_H

#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>

#include "atomics.h"
#include "counters.h"
#include "ring.h"
#include "shm_layout.h"

struct kvf_ctl_params {
        const char *instance;
        uint32_t instance_role; /* enum kvf_instance_role */
        struct kvf_cache_layout layout;
        uint32_t backend;
        uint32_t device;
        uint32_t rank, nranks;
        uint64_t ring_capacity[KVF_RING_COUNT]; /* 0 = default */
        uint32_t reqtab_slots;                  /* 0 = default */
        uint32_t max_blocks;                    /* 0 = default */
        uint32_t cuda_handles;  /* the backend's IPC handles (cuda: 1) */
        uint32_t executor;      /* enum kvf_executor */
        uint32_t heartbeat_ms; /* 0 = default */
};

#define KVF_DEFAULT_RING_CAPACITY (1u << 20)
#define KVF_DEFAULT_REQTAB_SLOTS 1024u
#define KVF_DEFAULT_MAX_BLOCKS 4096u
#define KVF_DEFAULT_HEARTBEAT_MS 100u

/* A process's view of a segment. */
struct kvf_ctl {
        int fd;
        bool writable;
        void *base;
        uint64_t size;
        struct kvf_ctl_header *hdr;
        struct kvf_role_slot *roles;
        struct kvf_doorbell *bells;
        struct kvf_progress *progress;
        struct kvf_connector_info *cinfo;
        struct kvf_ring_hdr *ring_hdrs;
        struct kvf_ring rings[KVF_RING_COUNT];
        struct kvf_counter *counters;
        struct kvf_errlog_entry *errlog; /* KVF_ROLE_COUNT regions of errlog_entries */
        struct kvf_journal_entry *journal;
        struct kvf_sender_area *sender;
        struct kvf_req_slot *reqtab;
        uint32_t *blocks;
        struct kvf_exec *exec;        /* engine executor's words */
        struct kvf_plan_entry *plan;  /* hdr->plan_slots entries, one per request slot */
        uint8_t *cuda_handles;        /* hdr->cuda_handles_count x 64 bytes */
        struct kvf_notice_slot *notices; /* KVF_NOTICE_SLOTS (common/notice.h) */
};

/* Check a name; fills kvf_err and returns -EINVAL when it is not one. */
int kvf_instance_name_check(const char *name);
/* "/kvferry.<name>" and "/kvferry.<name>.cache" (shm_open names). */
void kvf_ctl_shm_name(const char *instance, char *buf, size_t len);
void kvf_cache_shm_name(const char *instance, char *buf, size_t len);

/*
 * Create a new segment (fails with -EEXIST if the instance exists) and format
 * it. It is not visible as ready until kvf_ctl_publish().
 */
int kvf_ctl_create(const struct kvf_ctl_params *p, struct kvf_ctl *out);
/*
 * An exclusive create of shm name `shm` (kvf_ctl_shm_name, kvf_cache_shm_name)
 * of `instance` failed with EEXIST: returns -EEXIST with kvf_err saying whose
 * file it is (ours: a running or leftover instance; another user's: a name
 * that user holds, never to be reused).
 */
int kvf_ctl_exists_err(const char *instance, const char *shm);
/* The same for a file named by its path (a cache on a hugetlbfs mount). */
int kvf_ctl_exists_path_err(const char *instance, const char *path);
/* Store the layout version, last, with a release store. */
void kvf_ctl_publish(struct kvf_ctl *c);

/*
 * Attach to instance `name`. Returns -ENOENT (no such instance), -EAGAIN
 * (exists, not ready yet), -EPROTO (not a segment of this version),
 * -EPERM (owned by another user), -EBADMSG (truncated or inconsistent);
 * kvf_err says exactly what is wrong.
 */
int kvf_ctl_attach(const char *name, bool writable, struct kvf_ctl *out);
/* The same for another instance's segment that a role uses only in part (a peer's notice
 * slots, a doorbell): writable or not, its pages are faulted in as they are touched, not
 * all of them first (a writable attach does that, and it is milliseconds on the path of the
 * first task to a peer). */
int kvf_ctl_attach_peer(const char *name, bool writable, struct kvf_ctl *out);
/* Same, waiting up to wait_ms while it is missing or not ready. */
int kvf_ctl_attach_wait(const char *name, bool writable, unsigned wait_ms, struct kvf_ctl *out);
/* Attach to a file by path (tools, tests). */
int kvf_ctl_attach_path(const char *path, bool writable, struct kvf_ctl *out);
/*
 * Validate the bytes of a segment (the heart of attach; also what the fuzzer
 * drives). `uid` is the file owner, or (uid_t)-1 to skip the owner check.
 * On success fills the pointers of *out (fd -1, nothing mapped by us).
 */
int kvf_ctl_validate(void *base, uint64_t size, uid_t uid, struct kvf_ctl *out);
void kvf_ctl_detach(struct kvf_ctl *c);

/*
 * Remove the instance's segment and cache file (in /dev/shm, and on any
 * hugetlbfs mount if it is ours); 0 if anything was removed.
 */
int kvf_ctl_unlink(const char *instance);

/*
 * Take a role for this process: refused (-EBUSY, kvf_err says who holds it)
 * while another live process holds it; the pid is swapped in with a CAS, so
 * of two processes starting at once only one gets it. Then as
 * kvf_role_begin(), and takes the role's ring ends (producer under the new
 * generation; consumer, repairing a predecessor's interrupted consume).
 * Returns the new generation (> 0) or -EBUSY.
 */
int64_t kvf_role_claim(struct kvf_ctl *c, enum kvf_role_id role);
/*
 * True when this process no longer holds the role (a successor claimed it
 * while we were stuck): the caller must stop at once, touching nothing.
 */
bool kvf_role_fenced(const struct kvf_ctl *c, enum kvf_role_id role);
/* Role slots. kvf_role_begin() bumps the generation and returns it. */
uint64_t kvf_role_begin(struct kvf_ctl *c, enum kvf_role_id role);
void kvf_role_heartbeat(struct kvf_ctl *c, enum kvf_role_id role);
void kvf_role_end(struct kvf_ctl *c, enum kvf_role_id role);
/*
 * Alive: the pid exists, is the same process (start time) and beats. The
 * engine role is alive while its process is (an engine beats only while it
 * polls, and a long compute without polling is not death).
 */
bool kvf_role_alive(const struct kvf_ctl *c, enum kvf_role_id role, uint64_t now_ns);
/* The role's process exists, is the same one and has not ended the role (no heartbeat check). */
bool kvf_role_process_alive(const struct kvf_ctl *c, enum kvf_role_id role);

/*
 * Engine sessions. A session is one attachment of an engine client: its
 * number is the engine role's generation. It ends when the engine detaches
 * (state STOPPED), when another engine attaches (the generation moves) or
 * when its process is gone. kvf_engine_session() returns the session that is
 * live now, or 0 for none; with check_process false it skips the /proc read
 * (a dead process is then noticed by the next call that checks).
 */
uint64_t kvf_engine_session(const struct kvf_ctl *c, bool check_process);
/*
 * kvf_engine_session(c, true), and in *ended the session this call found over
 * (detached, or its process gone), 0 if none: never a session that began
 * during the call. Remember *ended, not the generation read afterwards: that
 * may already be the next engine's.
 */
uint64_t kvf_engine_session_checked(const struct kvf_ctl *c, uint64_t *ended);
const char *kvf_role_name(int role);
/* "prefill", "decode", "mixed" (enum kvf_instance_role), or "unknown". */
const char *kvf_irole_name(uint32_t instance_role);
const char *kvf_ring_name(int ring);
uint64_t kvf_pid_starttime(int pid);

static inline void kvf_count(struct kvf_ctl *c, enum kvf_counter_id id, uint64_t n)
{
        kvf_fetch_add_relaxed(&c->counters[id].value, n);
}

/*
 * Error log: record a message for `role`, de-duplicated by its format string
 * (count and last time grow; the text is the latest). Also logged to stderr.
 */
void kvf_errlog(struct kvf_ctl *c, enum kvf_role_id role, const char *fmt, ...)
        __attribute__((format(printf, 3, 4)));
/* Read entry i of role's region consistently; 1 if used, 0 if empty. */
int kvf_errlog_read(const struct kvf_ctl *c, int role, unsigned i, struct kvf_errlog_entry *out);

/* Block arena of request slot i: src at [0, max_blocks), dst at [max_blocks, 2*max_blocks). */
static inline uint32_t *kvf_slot_blocks(const struct kvf_ctl *c, uint32_t i)
{
        return c->blocks + (uint64_t)i * c->hdr->max_blocks * 2u;
}

/* The connector's published listen address: 0 and filled, or -EAGAIN. */
int kvf_connector_info_read(const struct kvf_ctl *c, char *host, size_t hostlen, uint32_t *port);
void kvf_connector_info_write(struct kvf_ctl *c, const char *host, uint32_t port);

/* Histograms (nanoseconds): add a value; estimate quantile q in [0, 1]. */
void kvf_hist_add(struct kvf_histogram *h, uint64_t v);
void kvf_hist_add_size(struct kvf_histogram *h, uint64_t v); /* bytes, descriptors */
uint64_t kvf_hist_quantile(const struct kvf_histogram *h, double q);

/* A hash of this boot (same host, same boot: same value). */
uint64_t kvf_boot_id(void);
uint64_t kvf_hash64(const void *p, size_t n, uint64_t seed);

#endif

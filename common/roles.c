/*
 * Role slots of the control segment: who holds each role (a CAS of the pid),
 * its generation, heartbeat and liveness; engine sessions (ctl.h).
 */
#include "ctl.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "atomics.h"
#include "clock.h"
#include "err.h"
#include "log.h"

static uint64_t pid_stat(int pid, bool *zombie);

uint64_t kvf_pid_starttime(int pid)
{
        bool z;
        return pid_stat(pid, &z);
}

static uint64_t pid_stat(int pid, bool *zombie)
{
        char path[64], buf[1024];
        snprintf(path, sizeof(path), "/proc/%d/stat", pid);
        int fd = open(path, O_RDONLY | O_CLOEXEC);
        if (fd < 0)
                return 0;
        ssize_t n = read(fd, buf, sizeof(buf) - 1);
        close(fd);
        if (n <= 0)
                return 0;
        buf[n] = '\0';
        /* Field 22; the command name (field 2) may hold spaces, so count from its ')'. */
        char *p = strrchr(buf, ')');
        if (!p)
                return 0;
        *zombie = p[1] == ' ' && (p[2] == 'Z' || p[2] == 'X');
        unsigned long long v = 0;
        int field = 2;
        for (p++; *p && field < 22; p++)
                if (*p == ' ')
                        field++;
        if (sscanf(p, "%llu", &v) != 1)
                return 0;
        return v;
}

uint64_t kvf_role_begin(struct kvf_ctl *c, enum kvf_role_id role)
{
        struct kvf_role_slot *s = &c->roles[role];
        uint64_t gen = kvf_load_acquire(&s->generation) + 1;

        kvf_store_relaxed(&s->state, KVF_STATE_STARTING);
        kvf_store_relaxed(&s->pid, (int32_t)getpid());
        kvf_store_relaxed(&s->pid_starttime, kvf_pid_starttime(getpid()));
        kvf_store_relaxed(&s->start_ns, kvf_now_ns());
        kvf_store_relaxed(&s->heartbeat_ns, kvf_now_ns());
        if (gen > 1) {
                kvf_fetch_add_relaxed(&s->restarts, 1);
                /* an engine attaching again is routine, not a crash */
                if (role != KVF_ROLE_ENGINE)
                        kvf_count(c, KVF_CTR_RESTARTS, 1);
        }
        /* An engine session's steps start above the last one published before it
         * (kvf_client_layer_check, the sender's task check). */
        kvf_store_relaxed(&s->session_base,
                          role == KVF_ROLE_ENGINE ? kvf_load_acquire(&c->progress->word) : 0);
        /* Release: peers that see the new generation see the new pid (and base) too. */
        kvf_store_release(&s->generation, gen);
        kvf_store_release(&s->state, KVF_STATE_RUNNING);
        return gen;
}

int64_t kvf_role_claim(struct kvf_ctl *c, enum kvf_role_id role)
{
        struct kvf_role_slot *s = &c->roles[role];
        int32_t cur = kvf_load_acquire(&s->pid);
        int32_t me = (int32_t)getpid();

        if (cur > 0 && cur != me && kvf_role_alive(c, role, kvf_now_ns()))
                return kvf_err_set(-EBUSY, "instance '%s' already has a running %s (pid %d)",
                                   c->hdr->instance, kvf_role_name(role), cur);
        if (!kvf_cas_acq_rel(&s->pid, &cur, me))
                return kvf_err_set(-EBUSY, "instance '%s': another %s (pid %d) started at the same time",
                                   c->hdr->instance, kvf_role_name(role), cur);
        uint64_t gen = kvf_role_begin(c, role);
        /* The role's ring ends: produce under the new generation (a predecessor's
         * unfinished claim is then skipped), and finish a predecessor's consume. */
        for (int r = 0; r < KVF_RING_COUNT; r++) {
                if (c->ring_hdrs[r].producer == (uint32_t)role)
                        kvf_ring_producer_attach(&c->rings[r], gen);
                if (c->ring_hdrs[r].consumer == (uint32_t)role && kvf_ring_consumer_attach(&c->rings[r]) > 0) {
                        kvf_count(c, KVF_CTR_RING_REPAIRS, 1);
                        kvf_warn("repaired ring %s after a crash", kvf_ring_name(r));
                }
        }
        return (int64_t)gen;
}

bool kvf_role_fenced(const struct kvf_ctl *c, enum kvf_role_id role)
{
        return kvf_load_acquire(&c->roles[role].pid) != (int32_t)getpid();
}

void kvf_role_heartbeat(struct kvf_ctl *c, enum kvf_role_id role)
{
        kvf_store_release(&c->roles[role].heartbeat_ns, kvf_now_ns());
}

void kvf_role_end(struct kvf_ctl *c, enum kvf_role_id role)
{
        kvf_store_release(&c->roles[role].state, KVF_STATE_STOPPED);
}

bool kvf_role_process_alive(const struct kvf_ctl *c, enum kvf_role_id role)
{
        const struct kvf_role_slot *s = &c->roles[role];
        int32_t pid = kvf_load_acquire(&s->pid);
        uint32_t state = kvf_load_acquire(&s->state);

        if (pid <= 0 || (state != KVF_STATE_RUNNING && state != KVF_STATE_STARTING))
                return false;
        if (kill(pid, 0) < 0 && errno == ESRCH)
                return false;
        uint64_t st = kvf_load_relaxed(&s->pid_starttime);
        bool zombie = false;
        uint64_t now_st = pid_stat(pid, &zombie);
        /* exited (not yet reaped), or the pid belongs to someone else */
        return !zombie && !(st && now_st != st);
}

uint64_t kvf_engine_session(const struct kvf_ctl *c, bool check_process)
{
        const struct kvf_role_slot *s = &c->roles[KVF_ROLE_ENGINE];
        uint64_t gen = kvf_load_acquire(&s->generation);
        uint32_t state = kvf_load_acquire(&s->state);
        if (state != KVF_STATE_RUNNING && state != KVF_STATE_STARTING)
                return 0;
        if (check_process && !kvf_role_process_alive(c, KVF_ROLE_ENGINE))
                return 0;
        /* Read again: an engine that attached meanwhile is another session. */
        return kvf_load_acquire(&s->generation) == gen ? gen : 0;
}

uint64_t kvf_engine_session_checked(const struct kvf_ctl *c, uint64_t *ended)
{
        const struct kvf_role_slot *s = &c->roles[KVF_ROLE_ENGINE];
        uint64_t gen = kvf_load_acquire(&s->generation);
        uint64_t live = kvf_engine_session(c, true);
        /* Over only if no engine attached during the check: an attaching engine stores its
         * pid before its generation, so the check may have judged the new pid against the old
         * session's start time; the new session is then not the one found dead. */
        *ended = !live && gen && kvf_load_acquire(&s->generation) == gen ? gen : 0;
        return live;
}

bool kvf_role_alive(const struct kvf_ctl *c, enum kvf_role_id role, uint64_t now_ns)
{
        const struct kvf_role_slot *s = &c->roles[role];

        if (!kvf_role_process_alive(c, role))
                return false;
        if (role == KVF_ROLE_ENGINE)
                return true;
        uint64_t hb = kvf_load_acquire(&s->heartbeat_ns);
        uint64_t limit = kvf_ms(c->hdr->heartbeat_ms) * 10;
        return now_ns < hb || now_ns - hb <= limit;
}


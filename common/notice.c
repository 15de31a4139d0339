/*
 * Notice slots: claiming (a CAS of the holder's pid, as for role slots) and
 * the views of their rings (notice.h).
 */
#include "notice.h"

#include <errno.h>
#include <stdint.h>
#include <signal.h>
#include <string.h>
#include <unistd.h>

#include "atomics.h"
#include "clock.h"
#include "err.h"
#include "log.h"

static bool pid_alive(int32_t pid, uint64_t starttime)
{
        if (pid <= 0)
                return false;
        if (kill(pid, 0) < 0 && errno == ESRCH)
                return false;
        uint64_t now_st = kvf_pid_starttime(pid);
        /* the pid now belongs to someone else */
        return !(starttime && now_st && now_st != starttime);
}

bool kvf_notice_holder_alive(const struct kvf_ctl *c, uint32_t s, uint64_t now_ns)
{
        if (s >= KVF_NOTICE_SLOTS)
                return false;
        const struct kvf_notice_slot *ns = &c->notices[s];
        int32_t pid = kvf_load_acquire(&ns->pid);
        /* -pid: that process is between its CAS and its first heartbeat (take()) */
        if (pid < 0)
                return pid != INT32_MIN && pid_alive(-pid, 0);
        if (pid == 0)
                return false;
        if (!pid_alive(pid, kvf_load_relaxed(&ns->pid_starttime)))
                return false;
        uint64_t hb = kvf_load_acquire(&ns->heartbeat_ns);
        uint64_t limit = kvf_ms(c->hdr->heartbeat_ms) * 10;
        return now_ns < hb || now_ns - hb <= limit;
}

int kvf_notice_bind(struct kvf_ctl *c, uint32_t s, struct kvf_ring *notice, struct kvf_ring *reply)
{
        if (s >= KVF_NOTICE_SLOTS)
                return kvf_err_set(-EINVAL, "notice slot %u: there are %u", s, KVF_NOTICE_SLOTS);
        struct kvf_notice_slot *ns = &c->notices[s];
        int rc = kvf_ring_bind(notice, c->base, c->size, &ns->notice, &c->bells[KVF_BELL_CONNECTOR]);
        if (rc < 0)
                return kvf_err_ctx(rc, "notice slot %u", s);
        rc = kvf_ring_bind(reply, c->base, c->size, &ns->reply, &ns->reply_bell);
        if (rc < 0)
                return kvf_err_ctx(rc, "notice slot %u", s);
        notice->full_ctr = reply->full_ctr = &c->counters[KVF_CTR_RING_FULL].value;
        return 0;
}

/* Take slot s whose holder pid was `cur` (0 or a dead process). */
static int drop_reply(void *ctx, uint16_t type, const uint8_t *pl, uint32_t len, uint64_t pos)
{
        (void)ctx, (void)type, (void)pl, (void)len, (void)pos;
        return 0;
}

static int take(struct kvf_ctl *c, uint32_t s, int32_t cur, const char *owner,
                uint64_t owner_created_ns, struct kvf_notice_end *out)
{
        struct kvf_notice_slot *ns = &c->notices[s];
        int32_t me = (int32_t)getpid();
        int rc;

        /* Two steps, so that a third claimant never judges us by our predecessor's start
         * time or heartbeat: -me while those are rewritten (kvf_notice_holder_alive asks
         * only whether that process lives), then me. */
        if (cur != me && !kvf_cas_acq_rel(&ns->pid, &cur, -me))
                return -EAGAIN;
        uint64_t gen = kvf_load_acquire(&ns->generation) + 1;
        bool same = strncmp(ns->owner, owner, sizeof(ns->owner)) == 0 &&
                    kvf_load_relaxed(&ns->owner_created_ns) == owner_created_ns;
        kvf_store_relaxed(&ns->state, KVF_STATE_STARTING);
        kvf_store_relaxed(&ns->pid_starttime, kvf_pid_starttime(getpid()));
        kvf_store_relaxed(&ns->heartbeat_ns, kvf_now_ns());
        kvf_store_relaxed(&ns->owner_created_ns, owner_created_ns);
        /* owner is read by other claimants only after they saw a generation: it is written
         * before the release store of the generation below, and read after its acquire. */
        memset(ns->owner, 0, sizeof(ns->owner));
        strncpy(ns->owner, owner, sizeof(ns->owner) - 1);
        kvf_fetch_add_relaxed(&ns->claims, 1);
        /* Pairs with the acquire load of pid in kvf_notice_holder_alive(). */
        kvf_store_release(&ns->pid, me);
        memset(out, 0, sizeof(*out));
        out->peer = c;
        if ((rc = kvf_notice_bind(c, s, &out->notice, &out->reply)) < 0) {
                kvf_store_release(&ns->state, KVF_STATE_STOPPED);
                kvf_store_release(&ns->pid, 0);
                return rc;
        }
        /* Release: who sees the new generation sees pid, owner and the start time too. */
        kvf_store_release(&ns->generation, gen);
        /* A predecessor's unfinished claim in the notice ring is skipped under the new
         * generation; a predecessor's half-done consume of the reply ring is finished. */
        kvf_ring_producer_attach(&out->notice, gen);
        if (kvf_ring_consumer_attach(&out->reply) > 0)
                kvf_warn("notice slot %u of '%s': repaired its reply ring after a crash", s,
                         c->hdr->instance);
        /* Answers to another instance's requests: not ours to read (keys would collide). */
        if (!same)
                while (kvf_ring_read(&out->reply, drop_reply, NULL, 256) > 0)
                        ;
        kvf_store_release(&ns->state, KVF_STATE_RUNNING);
        out->slot = ns;
        out->idx = s;
        out->pid = me;
        out->generation = gen;
        out->peer_created_ns = c->hdr->created_ns;
        return (int)s;
}

int kvf_notice_claim(struct kvf_ctl *peer, const char *owner, uint64_t owner_created_ns,
                     struct kvf_notice_end *out)
{
        uint64_t now = kvf_now_ns();
        int32_t me = (int32_t)getpid();

        memset(out, 0, sizeof(*out));
        if (!peer->writable)
                return kvf_err_set(-EINVAL, "notice slots of '%s': its segment is mapped read-only",
                                   peer->hdr->instance);
        if (kvf_instance_name_check(owner) < 0)
                return kvf_err_ctx(-EINVAL, "notice slot owner");
        /* First our own instance's slot (a restarted sender re-finds the notices it left),
         * then a free one, then one whose holder died. */
        for (int pass = 0; pass < 3; pass++) {
                for (uint32_t s = 0; s < KVF_NOTICE_SLOTS; s++) {
                        struct kvf_notice_slot *ns = &peer->notices[s];
                        int32_t cur = kvf_load_acquire(&ns->pid);
                        if (kvf_load_acquire(&ns->generation) == 0 && pass == 0)
                                continue;
                        bool mine = strncmp(ns->owner, owner, sizeof(ns->owner)) == 0 &&
                                    kvf_load_relaxed(&ns->owner_created_ns) == owner_created_ns;
                        bool alive = cur == me || kvf_notice_holder_alive(peer, s, now);
                        /* Notices left by another instance's sender stay its own: its
                                         * connector reads them as the holder's (connectors name a
                                         * notice's source by the slot), so the slot waits until
                                         * they are read. */
                        bool left = kvf_load_acquire(&ns->notice.tail) != kvf_load_acquire(&ns->notice.head);
                        bool ok = pass == 0   ? mine && (!alive || cur == me)
                                  : pass == 1 ? cur == 0 && !left
                                              : !alive && !left;
                        if (!ok)
                                continue;
                        int rc = take(peer, s, cur, owner, owner_created_ns, out);
                        if (rc != -EAGAIN)
                                return rc;
                }
        }
        return kvf_err_set(-EBUSY, "instance '%s': all %u notice slots are held by live senders",
                           peer->hdr->instance, KVF_NOTICE_SLOTS);
}

void kvf_notice_heartbeat(struct kvf_notice_end *e)
{
        if (e->slot)
                kvf_store_release(&e->slot->heartbeat_ns, kvf_now_ns());
}

bool kvf_notice_held(const struct kvf_notice_end *e)
{
        return e->slot && kvf_load_acquire(&e->slot->pid) == e->pid &&
               kvf_load_acquire(&e->slot->generation) == e->generation &&
               e->peer->hdr->created_ns == e->peer_created_ns;
}

void kvf_notice_release(struct kvf_notice_end *e)
{
        if (!kvf_notice_held(e)) {
                e->slot = NULL;
                return;
        }
        int32_t me = e->pid;
        kvf_store_release(&e->slot->state, KVF_STATE_STOPPED);
        kvf_cas_acq_rel(&e->slot->pid, &me, 0);
        e->slot = NULL;
}

int kvf_notice_connector_attach(struct kvf_ctl *c, struct kvf_ring notice[KVF_NOTICE_SLOTS],
                                struct kvf_ring reply[KVF_NOTICE_SLOTS], uint64_t generation)
{
        int repaired = 0, rc;

        for (uint32_t s = 0; s < KVF_NOTICE_SLOTS; s++) {
                if ((rc = kvf_notice_bind(c, s, &notice[s], &reply[s])) < 0)
                        return rc;
                kvf_ring_producer_attach(&reply[s], generation);
                if (kvf_ring_consumer_attach(&notice[s]) > 0)
                        repaired++;
        }
        return repaired;
}

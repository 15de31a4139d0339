/*
 * Engine sessions, prefill side (see ctl.h, kvf_engine_session): which
 * session is live, and how one ended. request.c ends the requests of an
 * ended session (sender_sessions_check).
 *
 * A request belongs to the engine session that submitted it (the task
 * record's producer generation). When that session ends (the engine
 * detaches, its process dies, or another engine attaches) its requests that
 * are still moving end with "engine gone": nothing a dead engine half-wrote
 * may be reported finished to anyone, and steps numbered by a new engine
 * must never complete an old engine's request. Requests already FINISHING
 * (every byte copied from a layer the old engine published) are left to
 * finish. Their completions carry the old session's number, and the new
 * engine's client library keeps them apart from its own (kvferry.h).
 *
 * The check is cheap on the hot path (two atomic loads of the engine's role
 * slot, before each progress word is applied: a new engine's generation is
 * stored before its first layer-done, so a word of the new session is never
 * applied to the old session's requests) and reads /proc once a heartbeat
 * to notice a process that died without detaching.
 */
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>

#include "atomics.h"
#include "clock.h"
#include "log.h"
#include "sender.h"

uint64_t sender_record_session(struct sender *s, uint64_t pos)
{
        const struct kvf_ring *in = &s->ctl.rings[KVF_RING_ENGINE_TO_SENDER];
        uint64_t cur = kvf_load_acquire(&s->ctl.roles[KVF_ROLE_ENGINE].generation);
        return kvf_gen_from16(cur, kvf_ring_record_gen(in, pos));
}

void sender_session_why_ended(struct sender *s, uint64_t old, uint64_t live, char *buf, size_t len)
{
        const struct kvf_role_slot *e = &s->ctl.roles[KVF_ROLE_ENGINE];
        if (live)
                snprintf(buf, len, "engine session %llu ended: another engine attached (session %llu)",
                         (unsigned long long)old, (unsigned long long)live);
        else if (kvf_load_acquire(&e->state) == KVF_STATE_STOPPED)
                snprintf(buf, len, "engine session %llu ended: the engine detached",
                         (unsigned long long)old);
        else
                snprintf(buf, len, "engine session %llu ended: the engine's process (pid %d) is gone",
                         (unsigned long long)old, kvf_load_acquire(&e->pid));
}

uint64_t sender_session_live(struct sender *s, bool check_process)
{
        uint64_t live, over = 0;
        if (check_process) {
                live = kvf_engine_session_checked(&s->ctl, &over);
                if (over)
                        s->dead_session = over;
        } else {
                live = kvf_engine_session(&s->ctl, false);
                if (live && live == s->dead_session)
                        live = 0; /* found dead by an earlier check: the slot still says running */
        }
        return live;
}

uint64_t sender_session_base(struct sender *s, uint64_t session)
{
        const struct kvf_role_slot *e = &s->ctl.roles[KVF_ROLE_ENGINE];
        if (kvf_load_acquire(&e->generation) != session)
                return 0; /* ended, or not begun: the session check answers for its records */
        uint64_t base = kvf_load_acquire(&e->session_base);
        /* The base read is the session's only if no other session began meanwhile. */
        return kvf_load_acquire(&e->generation) == session ? base : 0;
}

static struct net_peer *net_peer_slot(struct sender *s, const char *peer)
{
        struct net_peer *slot = &s->net_peers[0];
        for (uint32_t i = 0; i < SENDER_NET_PEERS; i++) {
                struct net_peer *p = &s->net_peers[i];
                if (p->seen_ns && !strcmp(p->name, peer))
                        return p;
                if (p->seen_ns < slot->seen_ns)
                        slot = p; /* the longest unheard of: replaced when the table is full */
        }
        if (slot->mapped)
                kvf_ctl_detach(&slot->ctl);
        memset(slot, 0, sizeof(*slot));
        snprintf(slot->name, sizeof(slot->name), "%s", peer);
        return slot;
}

void sender_net_peer_note(struct sender *s, const char *peer, bool up, uint64_t session, uint32_t block_size)
{
        struct net_peer *p = net_peer_slot(s, peer);
        if (!up) {
                /* What comes back at its address may be another instance, of another block
                 * size: unknown until its connector reaches it again. */
                p->block_size = 0;
                return;
        }
        p->session = session;
        if (block_size)
                p->block_size = block_size;
        p->seen_ns = kvf_now_ns();
}

uint64_t sender_net_peer_session(struct sender *s, const char *peer)
{
        struct net_peer *p = net_peer_slot(s, peer);
        if (!p->seen_ns)
                p->seen_ns = 1; /* known from now on, session unknown */
        if (strchr(peer, ':'))
                return p->session; /* on another host: what its connector last told */
        /* Same host: ask its segment (mapped once; a re-created instance is another file). */
        struct stat st;
        char path[128];
        snprintf(path, sizeof(path), "/dev/shm/kvferry.%s", peer);
        if (p->mapped && (stat(path, &st) < 0 || st.st_ino != p->ino)) {
                kvf_ctl_detach(&p->ctl);
                p->mapped = false;
        }
        if (!p->mapped && kvf_ctl_attach(peer, false, &p->ctl) == 0) {
                p->mapped = true;
                p->ino = fstat(p->ctl.fd, &st) == 0 ? st.st_ino : 0;
        }
        return p->mapped ? kvf_engine_session(&p->ctl, false) : p->session;
}

uint32_t sender_net_peer_block_size(struct sender *s, const char *peer)
{
        sender_net_peer_session(s, peer); /* maps its segment (a peer on this host) */
        struct net_peer *p = net_peer_slot(s, peer);
        return p->mapped ? p->ctl.hdr->layout.block_size : p->block_size;
}

void sender_net_peers_close(struct sender *s)
{
        for (uint32_t i = 0; i < SENDER_NET_PEERS; i++)
                if (s->net_peers[i].mapped) {
                        kvf_ctl_detach(&s->net_peers[i].ctl);
                        s->net_peers[i].mapped = false;
                }
}

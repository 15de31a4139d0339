/*
 * Same-host (ipc) peers: the sender attaches the peer instance's control
 * segment read-only (layout, identity) and maps its host cache read-write.
 *
 * A peer that restarts gets a new segment file: the mapping we hold then
 * points at a file nobody reads any more. sender_peer_check() notices
 * (inode changed or gone); request.c then fails the requests still moving to
 * it with "connection error" and drops the mapping, and the decode connector
 * independently refuses a finish notice that names another segment
 * incarnation.
 */
#include <arpa/inet.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <netdb.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "clock.h"
#include "err.h"
#include "layout.h"
#include "log.h"
#include "sender.h"

static void drop(struct ipc_peer *p)
{
        /* Notices still in the ring stay there: the peer's connector answers them into the
         * reply ring, where our successor in this slot (a restart of ours) finds them. */
        kvf_notice_release(&p->nend);
        kvf_tp_plan_free(&p->plan);
        kvf_cache_unmap(&p->cache);
        kvf_ctl_detach(&p->ctl);
        memset(p, 0, sizeof(*p));
        p->ctl.fd = -1;
}

/*
 * May this instance copy into peer p (attached, not yet mapped)? Equal layouts and groups move
 * whole blocks. A peer of another tensor-parallel group size (the instances' --nranks) gets a
 * plan of head slices (common/tpsplit.h): this rank sends only the heads the split says it
 * sends to that rank, and a task towards a rank it sends nothing is refused. Block sizes that
 * divide one another regroup tokens (the plan's groups; tasks.c counts the blocks). 0, or -EXDEV with
 * both layouts in `why`.
 */
static int check_split(struct sender *s, struct ipc_peer *p, const char *name, char *why,
                       size_t whylen)
{
        const struct kvf_ctl_header *me = s->ctl.hdr, *h = p->ctl.hdr;
        char diff[400];
        int rc = kvf_tp_pair_plan(s->layout, me->nranks, me->rank, &h->layout, h->nranks, h->rank,
                                  &p->plan, diff, sizeof(diff));
        if (rc == -EXDEV) {
                snprintf(why, whylen, "peer layout mismatch with '%s': %s", name, diff);
                return -EXDEV;
        }
        if (rc < 0) {
                snprintf(why, whylen, "peer '%s': %s", name, diff);
                return -EXDEV;
        }
        if (!p->plan.npieces && me->nranks == h->nranks &&
            kvf_layout_compatible(s->layout, &h->layout, diff, sizeof(diff)) == 0)
                return 0;
        kvf_info("peer '%s' is rank %u of %u, this is rank %u of %u, %u tokens/block "
                 "there, %u here: %u piece(s) per group of %u source block(s)",
                 name, h->rank, h->nranks, me->rank, me->nranks, h->layout.block_size,
                 s->layout->block_size, p->plan.npieces ? p->plan.npieces : 1,
                 p->plan.npieces ? p->plan.src_per_group : 1);
        return 0;
}

/* Does any of the instance's own roles run (not its engine: nobody would answer a notice)?
 * Killed whole, its supervisor too, its segment stays in /dev/shm; a role its supervisor
 * restarts leaves the others running. */
static bool roles_running(const struct kvf_ctl *c)
{
        return kvf_role_process_alive(c, KVF_ROLE_ALLOCATOR) || kvf_role_process_alive(c, KVF_ROLE_CONNECTOR) ||
               kvf_role_process_alive(c, KVF_ROLE_SENDER);
}

static int open_peer(struct sender *s, struct ipc_peer *p, const char *name, char *why,
                     size_t whylen)
{
        struct stat st;
        /* Read-write only for the notice slots (same user, mode 0600, as for the cache). */
        int rc = kvf_ctl_attach_peer(name, s->notice_rings, &p->ctl);

        if (rc < 0) {
                snprintf(why, whylen, "%s", kvf_err_msg());
                /* (a name no instance can have is no instance of this host: unknown, as over
                 * tcp, not a connection error an engine would retry) */
                return rc == -ENOENT || rc == -EAGAIN || rc == -EINVAL ? -ENOENT : -EPROTO;
        }
        const struct kvf_ctl_header *h = p->ctl.hdr;
        if (!roles_running(&p->ctl)) {
                snprintf(why, whylen,
                         "instance '%s' is not running (none of its roles is alive; its shared memory is "
                         "left from a kill: 'tools/kvferry down --instance %s' removes it)",
                         name, name);
                rc = -ENOENT;
                goto fail;
        }
        if (h->instance_role != KVF_IROLE_DECODE && h->instance_role != KVF_IROLE_MIXED) {
                snprintf(why, whylen,
                         "peer '%s' is a %s instance: only a decode or mixed instance receives KV caches",
                         name, kvf_irole_name(h->instance_role));
                rc = -EPERM;
                goto fail;
        }
        if (!kvf_cache_backends_compatible(h->backend, s->own.be->id)) {
                const struct kvf_cache_backend *pb = kvf_cache_backend(h->backend);
                snprintf(why, whylen, "instance '%s' keeps its cache in '%s' memory, this one in '%s': "
                         "same-host copies need the same backend",
                         name, pb ? pb->name : "unknown", s->own.be->name);
                rc = -EPROTO;
                goto fail;
        }
        /* The engine's caches are host or GPU memory under one backend id: the kinds must match. */
        const struct kvf_ctl_header *me = s->ctl.hdr;
        bool own_gpu = me->backend == KVF_BACKEND_ENGINE ? me->reg_gpu != 0 : me->backend == KVF_BACKEND_CUDA;
        bool peer_gpu = h->backend == KVF_BACKEND_ENGINE ? h->reg_gpu != 0 : h->backend == KVF_BACKEND_CUDA;
        if (own_gpu != peer_gpu) {
                snprintf(why, whylen, "instance '%s' keeps its engine's caches in %s memory, this one in %s "
                         "memory: same-host copies need one kind",
                         name, peer_gpu ? "GPU" : "host", own_gpu ? "GPU" : "host");
                rc = -EPROTO;
                goto fail;
        }
        if ((rc = check_split(s, p, name, why, whylen)) < 0)
                goto fail;
        if ((rc = kvf_cache_map_peer(h, true, &s->own, &p->cache)) < 0) {
                snprintf(why, whylen, "peer '%s': %s", name, kvf_err_msg());
                goto fail;
        }
        p->created_ns = h->created_ns;
        if (fstat(p->ctl.fd, &st) == 0)
                p->ino = st.st_ino;
        snprintf(p->name, sizeof(p->name), "%s", name);
        p->in_use = true;
        kvf_info("mapped peer '%s': %u blocks", name, h->layout.num_blocks);
        if (s->notice_rings) {
                int sl = kvf_notice_claim(&p->ctl, s->ctl.hdr->instance, s->ctl.hdr->created_ns, &p->nend);
                if (sl >= 0)
                        kvf_info("peer '%s': notice slot %d: finish notices go to its connector in one hop",
                                 name, sl);
                else
                        kvf_warn("peer '%s': no notice slot (%s): finish notices go through the connectors' sockets",
                                 name, kvf_err_msg());
        }
        return 0;
fail:
        kvf_tp_plan_free(&p->plan);
        kvf_ctl_detach(&p->ctl);
        return rc;
}

/*
 * Find or open peer `name`. Returns 0 and its index, or: -ENOENT (no such
 * instance), -EXDEV (layout mismatch), -EPERM (not an instance that receives),
 * -EPROTO/-ENOMEM (cannot use it), -ENOSPC (too many peers); `why` says it in
 * words.
 */
int sender_peer_get(struct sender *s, const char *name, uint32_t *idx, char *why, size_t whylen)
{
        struct ipc_peer *freep = NULL;

        for (uint32_t i = 0; i < SENDER_MAX_PEERS; i++) {
                struct ipc_peer *p = &s->peers[i];
                if (p->in_use && !strcmp(p->name, name)) {
                        *idx = i;
                        return 0;
                }
                if (!p->in_use && !freep)
                        freep = p;
        }
        if (!freep) {
                snprintf(why, whylen, "more than %u same-host peers", SENDER_MAX_PEERS);
                return -ENOSPC;
        }
        int rc = open_peer(s, freep, name, why, whylen);
        if (rc < 0)
                return rc;
        *idx = (uint32_t)(freep - s->peers);
        return 0;
}

/* Each heartbeat: keep the notice slot, or find one again (a slot was taken from us after a
 * stall, or none was free when the peer was mapped). */
static void notice_slot_tick(struct sender *s, struct ipc_peer *p)
{
        if (p->nend.slot && !kvf_notice_held(&p->nend)) {
                kvf_warn("peer '%s': notice slot %u was taken over: finish notices go through the connectors' sockets",
                         p->name, p->nend.idx);
                p->nend.slot = NULL;
        }
        if (p->nend.slot) {
                kvf_notice_heartbeat(&p->nend);
                return;
        }
        if (kvf_notice_claim(&p->ctl, s->ctl.hdr->instance, s->ctl.hdr->created_ns, &p->nend) >= 0)
                kvf_info("peer '%s': notice slot %u: finish notices go to its connector in one hop",
                         p->name, p->nend.idx);
}

static int on_reply(void *ctx, uint16_t type, const uint8_t *pl, uint32_t len, uint64_t pos)
{
        struct sender *s = ctx;
        struct kvf_record r;
        (void)pos;
        if (type != KVF_RT_ACK || kvf_record_decode(type, pl, len, 0, &r) < 0) {
                kvf_count(&s->ctl, KVF_CTR_BAD_RECORDS, 1);
                kvf_errlog(&s->ctl, KVF_ROLE_SENDER, "bad %s record in a reply ring: %s",
                           kvf_rec_type_name(type), type == KVF_RT_ACK ? kvf_err_msg() : "unexpected type");
                if (type == KVF_RT_ACK)
                        kvf_record_free(&r);
                return 0;
        }
        /* The same event as a write result from our connector: the key names the slot and
         * its incarnation, so an answer for a request no longer here is dropped. */
        uint32_t slot = (uint32_t)(r.key >> 40);
        if (slot < s->ctl.hdr->reqtab_slots && sender_key(slot, s->ctl.reqtab[slot].incarnation) == r.key) {
                /* A withdrawn notice answered: counted as our connector counts it on the socket path. */
                if (s->ctl.reqtab[slot].withdraw_ns && s->ctl.reqtab[slot].state == KVF_REQ_FINISHING)
                        kvf_count(&s->ctl, KVF_CTR_NOTICES_IN_DOUBT, 1);
                sender_req_event(s, slot,
                                 &(struct sender_ev){.type = SENDER_EV_WRITE_RESULT, .status = r.status,
                                                     .reason = r.reason});
        }
        kvf_record_free(&r);
        return 0;
}

bool sender_read_replies(struct sender *s)
{
        bool worked = false;
        for (uint32_t i = 0; i < SENDER_MAX_PEERS; i++) {
                struct ipc_peer *p = &s->peers[i];
                if (!p->in_use || !p->nend.slot)
                        continue;
                int n = kvf_ring_read(&p->nend.reply, on_reply, s, 64);
                if (n > 0)
                        worked = true;
                else if (n < 0)
                        kvf_errlog(&s->ctl, KVF_ROLE_SENDER, "reply ring of '%s': %s", p->name, kvf_err_msg());
        }
        return worked;
}

bool sender_replies_readable(struct sender *s)
{
        for (uint32_t i = 0; i < SENDER_MAX_PEERS; i++)
                if (s->peers[i].in_use && s->peers[i].nend.slot && kvf_ring_readable(&s->peers[i].nend.reply))
                        return true;
        return false;
}

int sender_peer_check(struct sender *s, uint32_t i, uint64_t *live)
{
        struct ipc_peer *p = &s->peers[i];
        char path[128];
        struct stat st;
        if (!p->in_use)
                return 0;
        snprintf(path, sizeof(path), "/dev/shm/kvferry.%s", p->name);
        if (stat(path, &st) == 0 && st.st_ino == p->ino) {
                /* Killed whole: nobody answers a notice; its requests would each wait out their
                 * timeout, and new tasks would go on copying into it. */
                if (!roles_running(&p->ctl))
                        return -ESRCH;
                *live = kvf_engine_session(&p->ctl, true);
                if (s->notice_rings)
                        notice_slot_tick(s, p);
                return 1;
        }
        return -ENOENT;
}

void sender_peer_drop(struct sender *s, uint32_t i)
{
        if (s->peers[i].in_use)
                drop(&s->peers[i]);
}

void sender_peers_close(struct sender *s)
{
        for (uint32_t i = 0; i < SENDER_MAX_PEERS; i++)
                if (s->peers[i].in_use)
                        drop(&s->peers[i]);
}

/* ---- naming an ipc peer the way FastDeploy does: by device, or by ip and port ---- */

/* Is `ip` one of this host's addresses (or a wildcard/loopback name for it)? */
static bool local_address(const char *ip)
{
        char host[64];
        size_t n = strlen(ip);
        if (n >= 2 && ip[0] == '[' && ip[n - 1] == ']') { /* [v6] as records.md asks */
                snprintf(host, sizeof(host), "%.*s", (int)(n - 2), ip + 1);
                ip = host;
        }
        if (!strcmp(ip, "localhost"))
                return true;
        struct in6_addr a6;
        struct in_addr a4;
        bool v4 = inet_pton(AF_INET, ip, &a4) == 1, v6 = !v4 && inet_pton(AF_INET6, ip, &a6) == 1;
        if (!v4 && !v6)
                return false;
        if ((v4 && (ntohl(a4.s_addr) >> 24) == 127) || (v6 && IN6_IS_ADDR_LOOPBACK(&a6)))
                return true;
        struct ifaddrs *ifa, *i;
        bool found = false;
        if (getifaddrs(&ifa) < 0)
                return false;
        for (i = ifa; i && !found; i = i->ifa_next) {
                if (!i->ifa_addr)
                        continue;
                if (v4 && i->ifa_addr->sa_family == AF_INET)
                        found = !memcmp(&((struct sockaddr_in *)(void *)i->ifa_addr)->sin_addr, &a4,
                                        sizeof(a4));
                else if (v6 && i->ifa_addr->sa_family == AF_INET6)
                        found = !memcmp(&((struct sockaddr_in6 *)(void *)i->ifa_addr)->sin6_addr, &a6,
                                        sizeof(a6));
        }
        freeifaddrs(ifa);
        return found;
}

/* Does any of the instance's roles run? A segment outlives its processes when they are killed. */
static bool instance_running(const struct kvf_ctl *c)
{
        for (int r = 0; r < KVF_ROLE_COUNT; r++)
                if (kvf_role_process_alive(c, (enum kvf_role_id)r))
                        return true;
        return false;
}

/*
 * The same-host receiving instances (decode or mixed, ours, not this one)
 * that match: by device when by_device, else by the connector's port (the
 * address being one of this host's). Names of the first matches go in
 * names[]; returns how many matched. A match none of whose roles runs is
 * left out, its name in dead[] (KVF_INSTANCE_MAX bytes; "" when none) so the
 * caller can say why nothing matched.
 */
static unsigned scan_local(struct sender *s, bool by_device, uint64_t want, char names[][KVF_INSTANCE_MAX],
                           unsigned cap, char *dead)
{
        DIR *d = opendir("/dev/shm");
        struct dirent *e;
        unsigned n = 0;
        dead[0] = '\0';
        if (!d)
                return 0;
        while ((e = readdir(d))) {
                const char *nm = e->d_name;
                size_t len = strlen(nm);
                if (strncmp(nm, "kvferry.", 8) || (len > 6 && !strcmp(nm + len - 6, ".cache")))
                        continue;
                nm += 8;
                if (!strcmp(nm, s->ctl.hdr->instance) || kvf_instance_name_check(nm) < 0)
                        continue;
                struct kvf_ctl c;
                if (kvf_ctl_attach(nm, false, &c) < 0)
                        continue;
                const struct kvf_ctl_header *h = c.hdr;
                bool match = h->instance_role == KVF_IROLE_DECODE || h->instance_role == KVF_IROLE_MIXED;
                if (match && by_device) {
                        match = h->device == want;
                } else if (match) {
                        char host[64];
                        uint32_t port;
                        match = kvf_connector_info_read(&c, host, sizeof(host), &port) == 0 && port == want;
                }
                bool running = match && instance_running(&c);
                kvf_ctl_detach(&c);
                if (match && !running && !dead[0])
                        snprintf(dead, KVF_INSTANCE_MAX, "%s", nm);
                if (!running)
                        continue;
                if (n < cap)
                        snprintf(names[n], KVF_INSTANCE_MAX, "%s", nm);
                n++;
        }
        closedir(d);
        return n;
}

int sender_peer_resolve(struct sender *s, struct kvf_record *t, char *why, size_t whylen)
{
        bool by_device = t->device_given && (t->peer_formed || !t->peer[0]);
        char host[64] = "";
        unsigned long port = 0;
        if (!by_device) {
                const char *colon = strrchr(t->peer, ':');
                if (!colon)
                        return 0; /* an instance name */
                char *end;
                port = strtoul(colon + 1, &end, 10);
                if (colon == t->peer || *end || port == 0 || port > 65535 ||
                    (size_t)(colon - t->peer) >= sizeof(host)) {
                        snprintf(why, whylen, "peer '%s' is neither an instance name nor host:port", t->peer);
                        return -EINVAL;
                }
                snprintf(host, sizeof(host), "%.*s", (int)(colon - t->peer), t->peer);
                if (!local_address(host)) {
                        snprintf(why, whylen,
                                 "transfer_protocol ipc needs a same-host peer: %s is not an address of this host",
                                 host);
                        return -ENOENT;
                }
        }
        char names[4][KVF_INSTANCE_MAX], dead[KVF_INSTANCE_MAX], also[KVF_INSTANCE_MAX + 48] = "";
        uint64_t want = by_device ? t->device : port;
        unsigned n = scan_local(s, by_device, want, names, 4, dead);
        if (n == 0) {
                if (dead[0])
                        snprintf(also, sizeof(also), " (instance '%s' does, but it is not running)",
                                 dead);
                if (by_device)
                        snprintf(why, whylen, "no decode instance on this host uses device %llu%s",
                                 (unsigned long long)want, also);
                else
                        snprintf(why, whylen,
                                 "transfer_protocol ipc needs a same-host instance: no decode instance of this host listens on %s%s",
                                 t->peer, also);
                return -ENOENT;
        }
        if (n > 1) {
                snprintf(why, whylen, "%u decode instances on this host use %s %llu (%s, %s%s): name the peer",
                         n, by_device ? "device" : "port", (unsigned long long)want, names[0], names[1],
                         n > 2 ? ", ..." : "");
                return -EINVAL;
        }
        snprintf(t->peer, sizeof(t->peer), "%s", names[0]);
        return 0;
}

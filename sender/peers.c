/*
 * Same-host (ipc) peers: the sender attaches the peer instance's control
 * segment read-only (layout, identity) and maps its host cache read-write.
 *
 * A peer that restarts gets a new segment file: the mapping we hold then
 * points at a file nobody reads any more. sender_peers_check() notices
 * (inode changed or gone) and drops the mapping; requests still moving to it
 * fail with "connection error", and the decode connector independently
 * refuses a finish notice that names another segment incarnation.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "err.h"
#include "layout.h"
#include "log.h"
#include "sender.h"

static void drop(struct ipc_peer *p)
{
        if (p->cache)
                munmap(p->cache, p->cache_size);
        kvf_ctl_detach(&p->ctl);
        memset(p, 0, sizeof(*p));
        p->ctl.fd = -1;
}

static int open_peer(struct sender *s, struct ipc_peer *p, const char *name, char *why,
                     size_t whylen)
{
        struct stat st;
        int rc = kvf_ctl_attach(name, false, &p->ctl);

        if (rc < 0) {
                snprintf(why, whylen, "%s", kvf_err_msg());
                return rc == -ENOENT || rc == -EAGAIN ? -ENOENT : -EPROTO;
        }
        const struct kvf_ctl_header *h = p->ctl.hdr;
        if (h->backend != KVF_BACKEND_HOST) {
                snprintf(why, whylen, "instance '%s' keeps its caches on a GPU; this sender copies host caches only",
                         name);
                rc = -EPROTO;
                goto fail;
        }
        char diff[160];
        if (kvf_layout_compatible(s->layout, &h->layout, diff, sizeof(diff)) < 0) {
                snprintf(why, whylen, "peer layout mismatch with '%s': %s", name, diff);
                rc = -EXDEV;
                goto fail;
        }
        if ((rc = kvf_cache_map(h, true, &p->cache)) < 0) {
                snprintf(why, whylen, "peer '%s': %s", name, kvf_err_msg());
                goto fail;
        }
        p->cache_size = h->layout.cache_bytes;
        p->created_ns = h->created_ns;
        if (fstat(p->ctl.fd, &st) == 0)
                p->ino = st.st_ino;
        snprintf(p->name, sizeof(p->name), "%s", name);
        p->in_use = true;
        kvf_info("mapped peer '%s': %u blocks", name, h->layout.num_blocks);
        return 0;
fail:
        kvf_ctl_detach(&p->ctl);
        return rc;
}

/*
 * Find or open peer `name`. Returns 0 and its index, or: -ENOENT (no such
 * instance), -EXDEV (layout mismatch), -EPROTO/-ENOMEM (cannot use it),
 * -ENOSPC (too many peers); `why` says it in words.
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

/* Drop peers whose segment was removed or replaced; fail what still moves to them. */
void sender_peers_check(struct sender *s)
{
        char path[128];
        struct stat st;

        for (uint32_t i = 0; i < SENDER_MAX_PEERS; i++) {
                struct ipc_peer *p = &s->peers[i];
                if (!p->in_use)
                        continue;
                snprintf(path, sizeof(path), "/dev/shm/kvferry.%s", p->name);
                if (stat(path, &st) == 0 && st.st_ino == p->ino)
                        continue;
                kvf_warn("peer '%s' went away or was restarted: dropping its mapping", p->name);
                for (uint32_t k = 0; k < s->ctl.hdr->reqtab_slots; k++) {
                        struct kvf_req_slot *r = &s->ctl.reqtab[k];
                        if (r->state == KVF_REQ_ACTIVE && r->peer_idx == i &&
                            r->transport == KVF_TRANSPORT_IPC)
                                sender_fail(s, k, KVF_STATUS_CONNECTION,
                                            "peer instance '%s' went away or was restarted during the transfer",
                                            p->name);
                }
                drop(p);
        }
}

void sender_peers_close(struct sender *s)
{
        for (uint32_t i = 0; i < SENDER_MAX_PEERS; i++)
                if (s->peers[i].in_use)
                        drop(&s->peers[i]);
}

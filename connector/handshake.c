/*
 * The handshake both connectors run on a new connection (see auth.h for the
 * challenge-response). Nothing about this instance (name, layout) is sent
 * before the other side has proven it holds the token; a refused peer gets a
 * REFUSE record with the reason, and both sides log it.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "atomics.h"
#include "clock.h"
#include "connector.h"
#include "err.h"
#include "layout.h"
#include "tpsplit.h"
#include "log.h"
#include "transport.h"

/* 2: tcp data connections may carry gathered frames (KVF_RT_DATAV, connector/tcp.h).
 * 3: and regrouped frames (KVF_RT_DATAR) to a rank of another block size; OPEN and XOPEN carry
 *    the source block count of such a transfer (`blocks`).
 * 4: the welcome of an rdma data connection to a cache in parts carries its table (`rdma_parts`). */
#define PROTO_VERSION 4u

int conn_send_record(int fd, const struct kvf_record *r, unsigned timeout_ms)
{
        uint8_t *buf;
        size_t len;
        int rc = kvf_record_encode_alloc(r, &buf, &len);
        if (rc < 0)
                return kvf_err_set(rc, "encode %s: %s", kvf_rec_type_name(r->type), strerror(-rc));
        rc = kvf_net_send_frame(fd, r->type, buf, (uint32_t)len, timeout_ms);
        free(buf);
        if (rc < 0)
                return kvf_err_set(rc, "send %s: %s", kvf_rec_type_name(r->type),
                                   rc == -ETIMEDOUT ? "timed out" : strerror(-rc));
        return 0;
}

/* Receive a record of type `want`; a REFUSE becomes -EACCES with its reason and *status. */
static int recv_record(int fd, int want, struct kvf_record *r, unsigned timeout_ms, int *status)
{
        static _Thread_local uint8_t buf[65536]; /* (an rdma welcome's table: 25 bytes a tensor) */
        struct kvf_frame_hdr h;
        int rc = kvf_net_recv_frame(fd, &h, buf, sizeof(buf), timeout_ms);
        memset(r, 0, sizeof(*r));
        if (rc == -EMSGSIZE)
                return kvf_err_set(-EPROTO, "handshake frame of %u bytes is too large", h.len);
        if (rc < 0)
                return kvf_err_set(rc, "%s", rc == -ETIMEDOUT ? "no answer within the handshake timeout"
                                                             : rc == -ECONNRESET ? "connection closed by the peer"
                                                                                 : strerror(-rc));
        if (h.type == KVF_RT_REFUSE) {
                if (kvf_record_decode(KVF_RT_REFUSE, buf, h.len, 0, r) < 0)
                        return kvf_err_set(-EACCES, "refused (unreadable reason)");
                if (status)
                        *status = r->status;
                return kvf_err_set(-EACCES, "refused: %s", r->reason);
        }
        if (h.type != want)
                return kvf_err_set(-EPROTO, "expected a %s record, got type %u", kvf_rec_type_name(want),
                                   h.type);
        if (kvf_record_decode(want, buf, h.len, 0, r) < 0)
                return kvf_err_ctx(-EPROTO, "malformed %s", kvf_rec_type_name(want));
        return 0;
}

/* 1 when the engine registered caches whose blocks are [block_size, heads, head_dim]. */
static uint32_t token_major(const struct kvf_ctl_header *h)
{
        return h->backend == KVF_BACKEND_ENGINE && kvf_load_acquire(&h->reg_token_major) ? 1u : 0u;
}

/* A record of `type` that names this instance: who it is, which incarnation, its layout. */
static void identity_rec(struct kvf_record *r, uint32_t type, const struct kvf_ctl_header *h)
{
        memset(r, 0, sizeof(*r));
        r->type = type;
        snprintf(r->instance, sizeof(r->instance), "%s", h->instance);
        r->role = h->instance_role;
        r->generation = h->created_ns;
        r->boot_id = h->boot_id;
        kvf_layout_to_record(&h->layout, r);
        r->lay_rank = h->rank;
        r->lay_nranks = h->nranks;
        r->lay_token_major = token_major(h);
}

/* The peer's place in its group, as its record gives it (64-bit fields): a rank of the group,
 * whose size `up` allows (1 to 65536; 0 is an older peer's "one"). */
static int check_rank(const struct kvf_record *r, const char *peer, char *why, size_t whylen)
{
        uint64_t n = r->lay_nranks ? r->lay_nranks : 1;
        if (n <= 65536 && r->lay_rank < n)
                return 0;
        snprintf(why, whylen, "peer layout mismatch with '%s': it says it is rank %llu of a group of %llu, "
                 "which is no rank of a group (1 to 65536 ranks)", peer, (unsigned long long)r->lay_rank,
                 (unsigned long long)r->lay_nranks);
        return -EXDEV;
}

/* Peers move whole blocks as they lie: both lay a block out the same way, or neither may send. */
static int check_token_order(const struct kvf_ctl_header *h, uint64_t theirs, const char *peer, char *why,
                             size_t whylen)
{
        uint32_t ours = token_major(h);
        if ((theirs != 0) == (ours != 0))
                return 0;
        snprintf(why, whylen, "peer layout mismatch with '%s': its blocks are %s, here %s (the engines' "
                 "token_major): both sides must lay blocks out the same way", peer,
                 theirs ? "token-major [block_size, heads, head_dim]" : "head-major [heads, block_size, head_dim]",
                 ours ? "token-major" : "head-major");
        return -EXDEV;
}

/*
 * May a prefill instance of layout `pl` (rank pr of p) send to a decode instance of layout `dl`
 * (rank dr of d)? Equal layouts and groups: yes. Another tensor-parallel split of the same
 * model (common/tpsplit.h): on a control connection (same-host copies, whose notices it
 * carries), on a tcp data connection (frames of head slices; block sizes that divide one
 * another: frames of the plan's pieces) and on an rdma one (a work request per head slice, or
 * per piece of the plan), when the prefill rank sends that decode rank some heads.
 * 0, or -EXDEV with `why`.
 */
static int check_split(const struct kvf_cache_layout *pl, uint32_t pr, uint32_t p,
                       const struct kvf_cache_layout *dl, uint32_t dr, uint32_t d,
                       const char *purpose, bool token_major, char *why, size_t whylen)
{
        char diff[400];
        uint32_t heads;
        p = p ? p : 1;
        d = d ? d : 1;
        if (p == d && kvf_layout_compatible(pl, dl, why, whylen) == 0)
                /* (the control connection carries every rank's notices) */
                return strcmp(purpose, "control") ? kvf_tp_equal_pair(pl, p, pr, dr, why, whylen) : 0;
        /* Head slices and regrouped tokens are cut from [heads, block_size, head_dim] blocks;
         * in token-major blocks ([block_size, heads, head_dim]) those bytes lie elsewhere. One
         * head a block is the same either way. */
        if (token_major && (pl->kv_heads > 1 || dl->kv_heads > 1) && strcmp(purpose, "control")) {
                snprintf(why, whylen, "token-major blocks [block_size, heads, head_dim] (the engines' "
                         "token_major) move between equal layouts only: prefill %u kv head(s) x tp %u, "
                         "%u tokens/block; decode %u kv head(s) x tp %u, %u tokens/block",
                         pl->kv_heads, p, pl->block_size, dl->kv_heads, d, dl->block_size);
                return -EXDEV;
        }
        if (kvf_tp_check(pl, p, dl, d, 0, &heads, diff, sizeof(diff)) < 0) {
                snprintf(why, whylen, "%s", diff);
                return -EXDEV;
        }
        bool ctl = !strcmp(purpose, "control"), rdma = !strcmp(purpose, "rdma");
        if (pl->block_size != dl->block_size && !ctl && !rdma && strcmp(purpose, "data")) {
                snprintf(why, whylen, "%u tokens/block here, %u there: this connection carries whole "
                         "blocks; tokens are regrouped into other block sizes over ipc, tcp and rdma only",
                         pl->block_size, dl->block_size);
                return -EXDEV;
        }
        if (!ctl && !rdma && strcmp(purpose, "data")) {
                snprintf(why, whylen,
                         "prefill %u kv head(s) x tp %u, %u tokens/block; decode %u kv head(s) x tp %u, "
                         "%u tokens/block: a '%s' connection moves whole blocks of equal layouts; "
                         "other splits move over ipc, tcp and rdma only", pl->kv_heads, p, pl->block_size,
                         dl->kv_heads, d, dl->block_size, purpose);
                return -EXDEV;
        }
        if (pr >= p || dr >= d || kvf_tp_sources(heads, p, d, dr) == 0) {
                snprintf(why, whylen, "rank %u of %u to rank %u of %u", pr, p, dr, d);
                return -EXDEV;
        }
        if (!ctl) {
                /* Frames and work requests carry the heads this prefill rank sends; a rank that
                 * sends none has nothing to carry (the control connection still carries other
                 * ranks' notices). */
                uint32_t f, n, h, sends = 0;
                if (kvf_tp_heads(heads, d, dr, &f, &n) == 0)
                        for (h = f; h < f + n; h++)
                                sends |= kvf_tp_source(heads, p, d, dr, h) == pr;
                if (!sends) {
                        snprintf(why, whylen,
                                 "decode rank %u of %u: prefill rank %u of %u sends it none of its "
                                 "heads (%u kv heads)", dr, d, pr, p, heads);
                        return -EXDEV;
                }
        }
        return 0;
}

/*
 * What a step of the server handshake may take before the peer has proven the token: the
 * connect timeout, and no more than is left of the whole (conn_handshake_server's `until`).
 * 0 past it: a step then takes only what the socket holds already.
 */
static unsigned step_ms(uint64_t until, unsigned to)
{
        uint64_t now = kvf_now_ns();
        if (now >= until)
                return 0;
        uint64_t left = (until - now + KVF_NS_PER_MS - 1) / KVF_NS_PER_MS;
        return left < to ? (unsigned)left : to;
}

static void refuse(int fd, int status, const char *reason, unsigned timeout_ms)
{
        struct kvf_record r = {.type = KVF_RT_REFUSE, .status = status};
        snprintf(r.reason, sizeof(r.reason), "%s", reason);
        conn_send_record(fd, &r, timeout_ms);
}

/* The handshake failed after the welcome came: its arrays go (the caller gets none). */
static int welcome_fail(struct kvf_record *welcome, int rc)
{
        if (welcome)
                kvf_record_free(welcome);
        return rc;
}

int conn_handshake_client(struct connector *cn, int fd, const char *purpose,
                          struct peer_identity *out, struct kvf_record *welcome, int *status)
{
        const struct kvf_ctl_header *h = cn->ctl.hdr;
        unsigned to = cn->cfg.connect_timeout_ms;
        uint8_t nonce_c[KVF_NONCE_LEN], want[KVF_SHA256_LEN];
        struct kvf_record r = {.type = KVF_RT_HELLO, .proto = PROTO_VERSION};
        char why[480];
        int rc;

        *status = KVF_STATUS_CONNECTION;
        kvf_random(nonce_c, sizeof(nonce_c));
        memcpy(r.nonce, nonce_c, sizeof(nonce_c));
        snprintf(r.purpose, sizeof(r.purpose), "%s", purpose);
        if ((rc = conn_send_record(fd, &r, to)) < 0)
                return kvf_err_ctx(rc, "handshake");
        if ((rc = recv_record(fd, KVF_RT_CHALLENGE, &r, to, status)) < 0)
                return kvf_err_ctx(rc, "handshake");
        uint8_t nonce_s[KVF_NONCE_LEN];
        memcpy(nonce_s, r.nonce, sizeof(nonce_s));
        kvf_auth_proof(cn->cfg.token, cn->cfg.token_len, "kvferry-server", nonce_c, nonce_s, want);
        if (!kvf_auth_equal(want, r.proof, KVF_SHA256_LEN)) {
                *status = KVF_STATUS_AUTH;
                kvf_count(&cn->ctl, KVF_CTR_AUTH_FAILURES, 1);
                /* Say so before closing, so the other side's operator sees why. */
                refuse(fd, KVF_STATUS_AUTH, "authentication failed: the client holds another token", to);
                return kvf_err_set(-EACCES,
                                   "handshake: authentication failed: the peer does not hold our token");
        }
        identity_rec(&r, KVF_RT_AUTH, h);
        kvf_auth_proof(cn->cfg.token, cn->cfg.token_len, "kvferry-client", nonce_s, nonce_c, r.proof);
        if ((rc = conn_send_record(fd, &r, to)) < 0)
                return kvf_err_ctx(rc, "handshake");
        if ((rc = recv_record(fd, KVF_RT_WELCOME, &r, to, status)) < 0)
                return kvf_err_ctx(rc, "handshake");
        if (welcome)
                *welcome = r; /* (its arrays, rdma's table, are the caller's: kvf_record_free) */
        else
                kvf_record_free(&r);
        snprintf(out->instance, sizeof(out->instance), "%s", r.instance);
        out->created_ns = r.generation;
        if (check_rank(&r, out->instance, why, sizeof(why)) < 0) {
                *status = KVF_STATUS_LAYOUT_MISMATCH;
                return welcome_fail(welcome, kvf_err_set(-EXDEV, "handshake: %s", why));
        }
        out->rank = (uint32_t)r.lay_rank;
        out->nranks = r.lay_nranks ? (uint32_t)r.lay_nranks : 1;
        /* Only an instance that receives may be written into (the server refuses
         * too; this holds against a server that does not). */
        if (r.role != KVF_IROLE_DECODE && r.role != KVF_IROLE_MIXED) {
                *status = KVF_STATUS_PEER_ROLE;
                return welcome_fail(welcome, kvf_err_set(-EPERM,
                                   "handshake: peer '%s' is a %s instance: only a decode or mixed instance receives KV caches",
                                   out->instance, kvf_irole_name((uint32_t)r.role)));
        }
        if ((rc = kvf_layout_from_record(&out->layout, &r)) < 0)
                return welcome_fail(welcome, kvf_err_ctx(rc, "handshake"));
        if (check_split(&h->layout, h->rank, h->nranks, &out->layout, (uint32_t)r.lay_rank,
                        (uint32_t)r.lay_nranks, purpose, token_major(h) || r.lay_token_major, why,
                        sizeof(why)) < 0) {
                *status = KVF_STATUS_LAYOUT_MISMATCH;
                return welcome_fail(welcome, kvf_err_set(-EXDEV, "handshake: peer layout mismatch with '%s': %s",
                                                         out->instance, why));
        }
        if (check_token_order(h, r.lay_token_major, out->instance, why, sizeof(why)) < 0) {
                *status = KVF_STATUS_LAYOUT_MISMATCH;
                return welcome_fail(welcome, kvf_err_set(-EXDEV, "handshake: %s", why));
        }
        *status = KVF_STATUS_FINISHED;
        return 0;
}

int conn_handshake_server(struct connector *cn, int fd, struct peer_identity *out, char *purpose,
                          size_t purposelen, void **tstate)
{
        const struct kvf_ctl_header *h = cn->ctl.hdr;
        unsigned to = cn->cfg.connect_timeout_ms;
        uint8_t nonce_c[KVF_NONCE_LEN], nonce_s[KVF_NONCE_LEN], want[KVF_SHA256_LEN];
        struct kvf_record r;
        char why[480], reason[KVF_REASON_MAX];
        int rc;
        /* Until the peer proves the token it holds a session slot (--max-sessions) on our
         * word alone: the hello and the proof come within twice the connect timeout, however
         * slowly their bytes trickle in, or the connection ends. The client allows itself
         * the connect timeout for each of the two. */
        uint64_t until = kvf_now_ns() + 2 * kvf_ms(to);

        if ((rc = recv_record(fd, KVF_RT_HELLO, &r, step_ms(until, to), NULL)) < 0)
                return kvf_err_ctx(rc, "handshake");
        if (r.proto != PROTO_VERSION) {
                snprintf(reason, sizeof(reason), "protocol version %llu, this connector speaks %u",
                         (unsigned long long)r.proto, PROTO_VERSION);
                refuse(fd, KVF_STATUS_CONNECTION, reason, step_ms(until, to));
                return kvf_err_set(-EPROTO, "handshake: %s", reason);
        }
        *tstate = NULL;
        const struct conn_transport *t = conn_transport_by_purpose(r.purpose);
        if (strcmp(r.purpose, "control") && !t) {
                char no[160];
                snprintf(no, sizeof(no), "this connector has no transport for connection purpose '%.15s' (not built in)",
                         r.purpose);
                refuse(fd, KVF_STATUS_CONNECTION, no, step_ms(until, to));
                return kvf_err_set(-EPROTO, "handshake: unknown connection purpose '%s'", r.purpose);
        }
        snprintf(purpose, purposelen, "%s", r.purpose);
        memcpy(nonce_c, r.nonce, sizeof(nonce_c));
        kvf_random(nonce_s, sizeof(nonce_s));
        memset(&r, 0, sizeof(r));
        r.type = KVF_RT_CHALLENGE;
        memcpy(r.nonce, nonce_s, sizeof(nonce_s));
        kvf_auth_proof(cn->cfg.token, cn->cfg.token_len, "kvferry-server", nonce_c, nonce_s, r.proof);
        if ((rc = conn_send_record(fd, &r, step_ms(until, to))) < 0)
                return kvf_err_ctx(rc, "handshake");
        int st = KVF_STATUS_CONNECTION;
        if ((rc = recv_record(fd, KVF_RT_AUTH, &r, step_ms(until, to), &st)) < 0) {
                if (st == KVF_STATUS_AUTH)
                        kvf_count(&cn->ctl, KVF_CTR_AUTH_FAILURES, 1);
                return kvf_err_ctx(rc, "handshake");
        }
        kvf_auth_proof(cn->cfg.token, cn->cfg.token_len, "kvferry-client", nonce_s, nonce_c, want);
        if (!kvf_auth_equal(want, r.proof, KVF_SHA256_LEN)) {
                kvf_count(&cn->ctl, KVF_CTR_AUTH_FAILURES, 1);
                refuse(fd, KVF_STATUS_AUTH, "authentication failed: wrong token", step_ms(until, to));
                return kvf_err_set(-EACCES, "handshake: authentication failed: the peer sent a wrong proof (wrong token)");
        }
        snprintf(out->instance, sizeof(out->instance), "%s", r.instance);
        out->created_ns = r.generation;
        if (check_rank(&r, out->instance, why, sizeof(why)) < 0) {
                snprintf(reason, sizeof(reason), "%s (as seen by '%s')", why, h->instance);
                refuse(fd, KVF_STATUS_LAYOUT_MISMATCH, reason, to);
                return kvf_err_set(-EXDEV, "handshake with '%s': %s", out->instance, reason);
        }
        out->rank = (uint32_t)r.lay_rank;
        out->nranks = r.lay_nranks ? (uint32_t)r.lay_nranks : 1;
        if (h->instance_role != KVF_IROLE_DECODE && h->instance_role != KVF_IROLE_MIXED) {
                snprintf(reason, sizeof(reason),
                         "peer '%s' is a %s instance: only a decode or mixed instance receives KV caches",
                         h->instance, kvf_irole_name(h->instance_role));
                refuse(fd, KVF_STATUS_PEER_ROLE, reason, to);
                return kvf_err_set(-EPERM, "handshake with '%s': refused: %s", out->instance, reason);
        }
        if ((rc = kvf_layout_from_record(&out->layout, &r)) < 0) {
                refuse(fd, KVF_STATUS_LAYOUT_MISMATCH, kvf_err_msg(), to);
                return kvf_err_ctx(rc, "handshake with '%s'", out->instance);
        }
        if (check_split(&out->layout, (uint32_t)r.lay_rank, (uint32_t)r.lay_nranks, &h->layout,
                        h->rank, h->nranks, purpose, token_major(h) || r.lay_token_major, why,
                        sizeof(why)) < 0) {
                snprintf(reason, sizeof(reason), "peer layout mismatch (as seen by '%s'): %s",
                         h->instance, why);
                refuse(fd, KVF_STATUS_LAYOUT_MISMATCH, reason, to);
                return kvf_err_set(-EXDEV, "handshake with '%s': %s", out->instance, reason);
        }
        if (check_token_order(h, r.lay_token_major, out->instance, why, sizeof(why)) < 0) {
                snprintf(reason, sizeof(reason), "%s (as seen by '%s')", why, h->instance);
                refuse(fd, KVF_STATUS_LAYOUT_MISMATCH, reason, to);
                return kvf_err_set(-EXDEV, "handshake with '%s': %s", out->instance, reason);
        }
        identity_rec(&r, KVF_RT_WELCOME, h);
        /* The transport's own fields (rdma: where its writes go, and the key). */
        if (t && t->welcome && (rc = t->welcome(cn, out, &r, tstate)) < 0) {
                kvf_record_free(&r);
                snprintf(reason, sizeof(reason), "%s", kvf_err_msg());
                refuse(fd, rc == -ENODATA ? KVF_STATUS_ENGINE_GONE : KVF_STATUS_CONNECTION, reason, to);
                return kvf_err_set(rc, "handshake with '%s': %s", out->instance, reason);
        }
        rc = conn_send_record(fd, &r, to);
        kvf_record_free(&r); /* (the transport's tables) */
        if (rc < 0) {
                if (*tstate && t->welcome_undo)
                        t->welcome_undo(cn, *tstate);
                *tstate = NULL;
                return kvf_err_ctx(rc, "handshake");
        }
        return 0;
}

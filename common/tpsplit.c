#include "tpsplit.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "err.h"
#include "layout.h"

int kvf_tp_heads(uint32_t heads, uint32_t tp, uint32_t rank, uint32_t *first, uint32_t *count)
{
        if (heads == 0 || tp == 0 || rank >= tp)
                return kvf_err_set(-EINVAL, "rank %u of a group of %u, %u kv heads", rank, tp,
                                   heads);
        if (tp <= heads) {
                if (heads % tp)
                        return kvf_err_set(-EINVAL, "tp %u does not divide %u kv heads", tp, heads);
                *count = heads / tp;
                *first = rank * *count;
                return 0;
        }
        if (tp % heads)
                return kvf_err_set(-EINVAL, "%u kv heads do not divide tp %u", heads, tp);
        *first = rank / (tp / heads);
        *count = 1;
        return 0;
}

uint32_t kvf_tp_source(uint32_t heads, uint32_t p, uint32_t d, uint32_t drank, uint32_t head)
{
        (void)d;
        if (p <= heads)
                return head / (heads / p);
        uint32_t rp = p / heads; /* prefill replicas of each head */
        return head * rp + drank % rp;
}

uint32_t kvf_tp_sources(uint32_t heads, uint32_t p, uint32_t d, uint32_t drank)
{
        uint32_t first, count, n = 0, last = UINT32_MAX;
        if (kvf_tp_heads(heads, d, drank, &first, &count) < 0)
                return 0;
        /* a head's source is monotonic in the head, so distinct sources are runs */
        for (uint32_t h = first; h < first + count; h++) {
                uint32_t s = kvf_tp_source(heads, p, d, drank, h);
                if (s != last)
                        n++;
                last = s;
        }
        return n;
}

/* The heads a side of tp ranks with kv heads each can be the split of: kv * tp when not
 * replicated; any divisor of tp when kv == 1 and replicated. */
int kvf_tp_total_heads(uint32_t kv_p, uint32_t p, uint32_t kv_d, uint32_t d, uint32_t given,
                       uint32_t *heads, char *why, size_t whylen)
{
        uint32_t h = given;
        if (!h) {
                if (kv_p > 1 || p == 1)
                        h = kv_p * p;
                else if (kv_d > 1 || d == 1)
                        h = kv_d * d;
                else if (p == d)
                        h = p; /* the same split on both sides whatever the total */
                else {
                        snprintf(why, whylen,
                                 "one kv head per rank on both sides (tp %u and %u): the model's "
                                 "kv heads "
                                 "cannot be told from these",
                                 p, d);
                        return -EINVAL;
                }
        }
        uint32_t f, n;
        if (!h || kvf_tp_heads(h, p, 0, &f, &n) < 0 || n != kv_p ||
            kvf_tp_heads(h, d, 0, &f, &n) < 0 || n != kv_d) {
                snprintf(why, whylen, "these are not one split of %u kv heads", h);
                return -EINVAL;
        }
        *heads = h;
        return 0;
}

int kvf_tp_check(const struct kvf_cache_layout *pl, uint32_t p, const struct kvf_cache_layout *dl,
                 uint32_t d, uint32_t given_heads, uint32_t *heads, char *why, size_t whylen)
{
        char what[192], sub[256];
        snprintf(what, sizeof(what),
                 "prefill %u kv head(s) x tp %u, %u tokens/block; decode %u kv head(s) x tp %u, %u "
                 "tokens/block",
                 pl->kv_heads, p, pl->block_size, dl->kv_heads, d, dl->block_size);
#define DIFF(field, name)                                                                          \
        if (pl->field != dl->field) {                                                              \
                snprintf(why, whylen, "%s: %u " name " here, %u there", what, pl->field,           \
                         dl->field);                                                               \
                return -EPROTO;                                                                    \
        }
        DIFF(num_layers, "layers");
        DIFF(extra_layers, "extra (speculative) layers");
        DIFF(head_dim, "head dim");
        DIFF(key_only, "key-only flag");
        DIFF(dtype, "dtype");
#undef DIFF
        if (pl->scale_dtype != dl->scale_dtype) {
                /* (first and short: the split does not matter to it, and reasons are cut at 240) */
                snprintf(why, whylen, "scale tensors: %s on prefill, %s on decode",
                         pl->scale_dtype ? kvf_dtype_name(pl->scale_dtype) : "none",
                         dl->scale_dtype ? kvf_dtype_name(dl->scale_dtype) : "none");
                return -EPROTO;
        }
        if (pl->scale_dtype) {
                snprintf(why, whylen, "%s: caches with scale tensors move between equal tensor-parallel "
                         "splits and block sizes only", what);
                return -EPROTO;
        }
        if (p == 0 || d == 0) {
                snprintf(why, whylen, "%s: a group of 0 ranks", what);
                return -EPROTO;
        }
        if (pl->key_only && (pl->kv_heads != 1 || dl->kv_heads != 1)) {
                snprintf(why, whylen, "%s: a key-only (MLA) cache has one replicated latent head",
                         what);
                return -EPROTO;
        }
        if (pl->key_only)
                given_heads = 1; /* MLA: the latent is the same on every rank */
        if (kvf_tp_total_heads(pl->kv_heads, p, dl->kv_heads, d, given_heads, heads, sub,
                               sizeof(sub)) < 0) {
                snprintf(why, whylen, "%s: %s", what, sub);
                return -EPROTO;
        }
        if (pl->block_size % dl->block_size && dl->block_size % pl->block_size) {
                snprintf(why, whylen, "%s: block sizes %u and %u do not divide one another", what,
                         pl->block_size, dl->block_size);
                return -EPROTO;
        }
        if (why && whylen)
                why[0] = '\0';
        return 0;
}

int kvf_tp_plan(const struct kvf_cache_layout *pl, uint32_t p, uint32_t prank,
                const struct kvf_cache_layout *dl, uint32_t d, uint32_t drank, uint32_t heads,
                struct kvf_tp_plan *out)
{
        uint32_t pf, pn, df, dn;
        memset(out, 0, sizeof(*out));
        if (kvf_tp_heads(heads, p, prank, &pf, &pn) < 0 ||
            kvf_tp_heads(heads, d, drank, &df, &dn) < 0)
                return -EINVAL;
        if (pn != pl->kv_heads || dn != dl->kv_heads || pl->head_dim != dl->head_dim ||
            pl->dtype != dl->dtype)
                return kvf_err_set(-EINVAL, "layouts are not a split of %u kv heads", heads);
        const uint32_t bs = pl->block_size, bd = dl->block_size;
        if (bs % bd && bd % bs)
                return kvf_err_set(-EINVAL, "block sizes %u and %u do not divide one another", bs,
                                   bd);
        const uint32_t g = bs > bd ? bs : bd, seg = bs < bd ? bs : bd;
        const uint64_t tok =
            (uint64_t)pl->head_dim * kvf_dtype_size(pl->dtype); /* one token of one head */
        out->src_per_group = g / bs;
        out->dst_per_group = g / bd;

        uint32_t cap = dn * (g / seg), n = 0;
        struct kvf_tp_piece *pc = calloc(cap ? cap : 1, sizeof(*pc));
        if (!pc)
                return kvf_err_set(-ENOMEM, "out of memory for a transfer plan");
        for (uint32_t h = df; h < df + dn; h++) {
                if (h < pf || h >= pf + pn || kvf_tp_source(heads, p, d, drank, h) != prank)
                        continue;
                for (uint32_t t = 0; t < g; t += seg) {
                        struct kvf_tp_piece x = {
                            .sblk = t / bs,
                            .dblk = t / bd,
                            .soff = (uint32_t)(((uint64_t)(h - pf) * bs + t % bs) * tok),
                            .doff = (uint32_t)(((uint64_t)(h - df) * bd + t % bd) * tok),
                            .bytes = (uint32_t)(seg * tok)};
                        /* With equal block sizes, consecutive heads of a block follow one another
                         * on both sides: one piece for the shared head range. */
                        struct kvf_tp_piece *l = n ? &pc[n - 1] : NULL;
                        if (l && l->sblk == x.sblk && l->dblk == x.dblk &&
                            l->soff + l->bytes == x.soff && l->doff + l->bytes == x.doff)
                                l->bytes += x.bytes;
                        else
                                pc[n++] = x;
                }
        }
        out->pieces = pc;
        out->npieces = n;
        return 0;
}

void kvf_tp_plan_free(struct kvf_tp_plan *plan)
{
        free(plan->pieces);
        memset(plan, 0, sizeof(*plan));
}

int kvf_tp_equal_pair(const struct kvf_cache_layout *l, uint32_t n, uint32_t prank, uint32_t drank,
                      char *why, size_t whylen)
{
        n = n ? n : 1;
        if (prank < n && drank < n && (prank == drank || l->key_only))
                return 0;
        const uint32_t k = l->kv_heads;
        if (prank >= n || drank >= n)
                snprintf(why, whylen, "prefill rank %u and decode rank %u of groups of %u", prank, drank, n);
        else
                snprintf(why, whylen,
                         "prefill rank %u of %u holds kv heads %u to %u, decode rank %u of %u heads %u "
                         "to %u: between equal groups rank r sends to rank r",
                         prank, n, prank * k, prank * k + k - 1, drank, n, drank * k, drank * k + k - 1);
        return -EXDEV;
}

int kvf_tp_pair_plan(const struct kvf_cache_layout *me, uint32_t nranks, uint32_t rank,
                     const struct kvf_cache_layout *peer, uint32_t pnranks, uint32_t prank,
                     struct kvf_tp_plan *out, char *why, size_t whylen)
{
        uint32_t heads;
        char diff[400];
        memset(out, 0, sizeof(*out));
        nranks = nranks ? nranks : 1;
        pnranks = pnranks ? pnranks : 1;
        if (nranks == pnranks && kvf_layout_compatible(me, peer, diff, sizeof(diff)) == 0)
                return kvf_tp_equal_pair(me, nranks, rank, prank, why, whylen);
        if (kvf_tp_check(me, nranks, peer, pnranks, 0, &heads, diff, sizeof(diff)) < 0) {
                snprintf(why, whylen, "%s", diff);
                return -EXDEV;
        }
        int rc = kvf_tp_plan(me, nranks, rank, peer, pnranks, prank, heads, out);
        if (rc < 0) {
                snprintf(why, whylen, "%s", kvf_err_msg());
                return rc;
        }
        if (out->npieces == 0) {
                snprintf(why, whylen,
                         "it is decode rank %u of %u: prefill rank %u of %u sends it none of its "
                         "heads (%u kv heads; decode rank j gets each head from the prefill rank "
                         "that holds it, the (j mod replicas)-th where it is replicated)",
                         prank, pnranks, rank, nranks, heads);
                kvf_tp_plan_free(out);
                return -ENOENT;
        }
        const struct kvf_tp_piece *w = out->pieces;
        if (out->npieces == 1 && w->soff == 0 && w->doff == 0 && w->bytes == me->block_bytes &&
            w->bytes == peer->block_bytes)
                kvf_tp_plan_free(out); /* whole blocks after all (a replicated head, MLA) */
        return 0;
}

bool kvf_tp_piece_next(const struct kvf_tp_plan *pl, uint32_t pos, uint32_t ndst, uint32_t *x,
                       uint32_t *dpos)
{
        if (!pl->npieces)
                return false;
        const uint32_t sb = pos % pl->src_per_group;
        const uint32_t d0 = pos / pl->src_per_group * pl->dst_per_group;
        for (; *x < pl->npieces; (*x)++) {
                const struct kvf_tp_piece *c = &pl->pieces[*x];
                if (c->sblk != sb || d0 + c->dblk >= ndst)
                        continue;
                *dpos = d0 + c->dblk;
                return true;
        }
        return false;
}

uint64_t kvf_tp_dst_blocks(uint32_t n_src, uint32_t src_bsize, uint32_t dst_bsize)
{
        uint64_t tokens = (uint64_t)n_src * src_bsize;
        return (tokens + dst_bsize - 1) / dst_bsize;
}

uint64_t kvf_tp_dst_blocks_min(uint32_t n_src, uint32_t src_bsize, uint32_t dst_bsize)
{
        return n_src ? (uint64_t)(n_src - 1) * src_bsize / dst_bsize + 1 : 0;
}

int kvf_tp_slice(const struct kvf_cache_layout *pl, uint32_t p, uint32_t prank,
                 const struct kvf_cache_layout *dl, uint32_t d, uint32_t drank, uint32_t *soff,
                 uint32_t *doff, uint32_t *len)
{
        char why[400];
        uint32_t heads;
        struct kvf_tp_plan plan;
        *soff = *doff = *len = 0;
        p = p ? p : 1;
        d = d ? d : 1;
        if (p == d && kvf_layout_compatible(pl, dl, why, sizeof(why)) == 0)
                return kvf_tp_equal_pair(pl, p, prank, drank, why, sizeof(why)) < 0
                           ? kvf_err_set(-EXDEV, "%s", why)
                           : 0;
        if (kvf_tp_check(pl, p, dl, d, 0, &heads, why, sizeof(why)) < 0)
                return kvf_err_set(-EXDEV, "%s", why);
        if (pl->block_size != dl->block_size)
                return kvf_err_set(-EXDEV, "%u tokens/block and %u: not one slice per block",
                                   pl->block_size, dl->block_size);
        if (kvf_tp_plan(pl, p, prank, dl, d, drank, heads, &plan) < 0)
                return kvf_err_set(-EXDEV, "%s", kvf_err_msg());
        int rc = 0;
        if (plan.npieces != 1)
                rc = kvf_err_set(-EXDEV,
                                 "prefill rank %u of %u sends decode rank %u of %u %s (%u kv heads)",
                                 prank, p, drank, d,
                                 plan.npieces ? "more than one slice a block" : "none of its heads",
                                 heads);
        else if (plan.pieces[0].bytes != pl->block_bytes || plan.pieces[0].bytes != dl->block_bytes) {
                *soff = plan.pieces[0].soff;
                *doff = plan.pieces[0].doff;
                *len = plan.pieces[0].bytes;
        }
        kvf_tp_plan_free(&plan);
        return rc;
}

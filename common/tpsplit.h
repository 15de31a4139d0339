/*
 * Moving a KV cache between tensor-parallel groups of different sizes, and
 * between caches of different block sizes: which rank holds which heads, who
 * sends what to whom, and the byte pieces of one transfer.
 *
 * Head split (the rule vLLM and FastDeploy shard KV heads by). A model has H
 * KV heads; a group of tp ranks:
 *   tp <= H (tp divides H): rank r holds the contiguous heads [r*H/tp, (r+1)*H/tp);
 *   tp >  H (H divides tp): rank r holds the one head r / (tp/H), so each head is
 *                           replicated on tp/H consecutive ranks.
 * An MLA cache (key-only latent, one "head", the same on every rank) is H = 1:
 * every rank holds it whole.
 *
 * Who sends. Prefill group of p ranks, decode group of d ranks. Decode rank j
 * needs its heads; each head h it needs comes from exactly one prefill rank:
 * the one that holds h when p <= H, or, when h is replicated on rp = p/H
 * prefill ranks, the (j mod rp)-th of them (for MLA: prefill rank j mod p), so
 * replicated sources share the load. A prefill rank therefore sends to every
 * decode rank j for which kvf_tp_source names it, and only the heads it names.
 * When p > d a decode rank gathers its heads from several prefill ranks
 * (kvf_tp_sources counts them): its arrival waits for all of them.
 *
 * Blocks. Each tensor's block is [heads][tokens][head_dim] (common/layout.h),
 * so a head range of a block is contiguous. With equal block sizes a transfer
 * is one piece per block: the head range the two ranks share. With block sizes
 * Bs (source) and Bd (destination), one dividing the other, tokens are
 * regrouped: a group of G = max(Bs, Bd) tokens is G/Bs source blocks and G/Bd
 * destination blocks, and for each shared head a piece of min(Bs, Bd) tokens.
 * The pieces of every group are the same, relative to the group's blocks, so
 * a plan is computed once per (prefill rank, decode rank) and applied to each
 * group (kvf_tp_plan).
 *
 * Pure functions; any thread.
 */
#ifndef KVF_TPSPLIT_H
#define KVF_TPSPLIT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "shm_layout.h"

/* Heads of rank `rank` of a group of `tp`, out of `heads` (all ranks together):
 * *first (global index) and *count. 0, or -EINVAL when tp and heads do not
 * divide one another or rank >= tp. */
int kvf_tp_heads(uint32_t heads, uint32_t tp, uint32_t rank, uint32_t *first, uint32_t *count);

/* The prefill rank (group p) that sends global head `head` to decode rank
 * `drank` (group d). Arguments must have passed kvf_tp_check. */
uint32_t kvf_tp_source(uint32_t heads, uint32_t p, uint32_t d, uint32_t drank, uint32_t head);

/* How many distinct prefill ranks send to decode rank `drank`: the number of
 * parts its arrival waits for. */
uint32_t kvf_tp_sources(uint32_t heads, uint32_t p, uint32_t d, uint32_t drank);

/* The model's KV heads from the per-rank heads of both sides (kv_p on each of
 * p ranks, kv_d on each of d): `given` when not 0 (a caller that knows the
 * model), checked against both sides; otherwise inferred. 0 and *heads, or
 * -EINVAL with `why` (both sides hold one head per rank and their groups
 * differ: the total cannot be told; or the sides disagree). */
int kvf_tp_total_heads(uint32_t kv_p, uint32_t p, uint32_t kv_d, uint32_t d, uint32_t given,
                       uint32_t *heads, char *why, size_t whylen);

/*
 * May a prefill rank of layout `pl` in a group of p send to a decode rank of
 * layout `dl` in a group of d? Layers, head dim, dtype and key-only must be
 * equal; the heads must be one model's split over p and d (see above); the
 * block sizes must divide one another. 0 and *heads (the model's), or -EPROTO
 * with `why` naming both layouts, as
 *   "prefill 4 kv heads x tp 2, 64 tokens/block; decode 1 kv head x tp 8, 48
 *    tokens/block: block sizes 64 and 48 do not divide one another".
 */
int kvf_tp_check(const struct kvf_cache_layout *pl, uint32_t p, const struct kvf_cache_layout *dl,
                 uint32_t d, uint32_t given_heads, uint32_t *heads, char *why, size_t whylen);

/* One piece of a group: bytes from source block sblk (of the group's G/Bs) at
 * byte soff within that block to destination block dblk at doff, in every
 * tensor of every layer. */
struct kvf_tp_piece {
        uint32_t sblk, dblk;
        uint32_t soff, doff, bytes;
};

struct kvf_tp_plan {
        uint32_t src_per_group; /* G / Bs */
        uint32_t dst_per_group; /* G / Bd */
        uint32_t npieces;       /* 0: this prefill rank sends nothing to this decode rank */
        struct kvf_tp_piece *pieces;
};

/* The plan of prefill rank `prank` (layout pl, group p) towards decode rank
 * `drank` (layout dl, group d) for a model of `heads` KV heads (kvf_tp_check's).
 * Adjacent pieces contiguous on both sides are merged. 0, -EINVAL or -ENOMEM.
 * The caller frees with kvf_tp_plan_free. */
int kvf_tp_plan(const struct kvf_cache_layout *pl, uint32_t p, uint32_t prank,
                const struct kvf_cache_layout *dl, uint32_t d, uint32_t drank, uint32_t heads,
                struct kvf_tp_plan *out);
void kvf_tp_plan_free(struct kvf_tp_plan *plan);

/*
 * Between equal groups with equal layouts (layout l, n ranks each), may prefill rank `prank`
 * send its whole blocks to decode rank `drank`? Only to the rank that holds the same heads:
 * rank r's heads go to rank r (whatever the model's total, which equal layouts do not tell);
 * a key-only (MLA) latent is the same on every rank, so any pair. 0, or -EXDEV with `why`
 * naming both ranks and their heads: another pair would land one rank's heads in another's
 * cache.
 */
int kvf_tp_equal_pair(const struct kvf_cache_layout *l, uint32_t n, uint32_t prank, uint32_t drank,
                      char *why, size_t whylen);

/*
 * The plan between this rank (layout `me`, rank `rank` of a group of `nranks`) as prefill and a
 * peer rank (layout `peer`, rank `prank` of `pnranks`) as decode, as both executors of same-host
 * copies use it (the sender's copies, sender/peers.c; the engine's, client/stream.c): 0 with
 * out->npieces 0 for whole blocks (equal layouts and groups, rank to its like:
 * kvf_tp_equal_pair, else -EXDEV; or a plan whose one piece is the
 * whole block: a replicated head, MLA); 0 with the plan's pieces; -EXDEV with `why` when the
 * layouts are not one split of one model (both named, kvf_tp_check's text); -ENOENT with `why`
 * when this rank sends the peer none of its heads; -ENOMEM.
 */
int kvf_tp_pair_plan(const struct kvf_cache_layout *me, uint32_t nranks, uint32_t rank,
                     const struct kvf_cache_layout *peer, uint32_t pnranks, uint32_t prank,
                     struct kvf_tp_plan *out, char *why, size_t whylen);

/*
 * The piece walk of a request: its send position `pos` (the pos-th block it sends; one source
 * block) with plan `pl` (npieces > 0) gives the pieces x with pieces[x].sblk == pos %
 * src_per_group, each into destination position *dpos = pos / src_per_group * dst_per_group +
 * dblk (an index into the request's destination blocks); a piece whose destination position is
 * `ndst` or beyond (tokens past the request's, in the receiver's last block group) is left out.
 * Start with *x = 0; true with the next piece's index in *x (then call again with *x + 1), false
 * when none is left. Both executors build their copy runs with it, so they move the same bytes.
 */
bool kvf_tp_piece_next(const struct kvf_tp_plan *pl, uint32_t pos, uint32_t ndst, uint32_t *x,
                       uint32_t *dpos);

/*
 * The one head slice of each block prefill rank `prank` (layout pl, group p) sends decode rank
 * `drank` (layout dl, group d), for transports that move one contiguous range per block (tcp
 * frames): equal block sizes. 0 with *len 0: whole blocks (equal layouts and groups, rank to its like, else
 * -EXDEV; or a slice that is the whole block: a replicated head, MLA); 0 with *soff, *doff, *len: that
 * slice; -EXDEV (kvf_err says why): not one split of one model, different block sizes, or
 * this prefill rank sends that decode rank no head.
 */
int kvf_tp_slice(const struct kvf_cache_layout *pl, uint32_t p, uint32_t prank,
                 const struct kvf_cache_layout *dl, uint32_t d, uint32_t drank, uint32_t *soff,
                 uint32_t *doff, uint32_t *len);

/* Destination blocks a request of n_src source blocks fills (n_src * Bs / Bd,
 * rounded up when the last source block is partly used by the receiver's): at most, and at
 * least (the last source block holding one token). 64 bits: 65536 source blocks of 65536
 * tokens into blocks of one fill more than 2^32. */
uint64_t kvf_tp_dst_blocks(uint32_t n_src, uint32_t src_bsize, uint32_t dst_bsize);
uint64_t kvf_tp_dst_blocks_min(uint32_t n_src, uint32_t src_bsize, uint32_t dst_bsize);

#endif

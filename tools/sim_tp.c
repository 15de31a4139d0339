/*
 * kvf-sim's mixed mode (sim.h): prefill and decode groups of different
 * sizes, heads per rank or block sizes. The split and who sends what are
 * common/tpsplit.h's; this file applies them to the simulator: which
 * (prefill rank, decode rank) pairs get a task, the content each prefill
 * rank writes (a row per head and token, keyed by the request, the model's
 * head index, the token's position in the prompt, the layer and the tensor,
 * so the content does not depend on which rank holds it or on the block
 * size), and the check of every head of every token on every decode rank.
 * GPU mode (s->sg): the same rows, written by the prefill ranks' layer kernels
 * and checked by the decode ranks' check kernels, one queue entry per head of
 * a block (its rows' keys follow the token: tools/sim_gpu.h).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "layout.h"
#include "sim.h"
#include "sim_gpu.h"
#include "tpsplit.h"

#define head_key kvf_sim_head_key /* (sim_keys.h) */

static inline uint64_t row_key(uint64_t hk, uint32_t token)
{
        return hk + (uint64_t)token * SIM_GPU_ROW_STEP;
}

/*
 * --verify sample in mixed mode: the rows of the first and the last token of each piece (each
 * run of `seg` tokens, the smaller block size: what a transfer moves as one piece of a head),
 * and of the prompt's last token, and of those only the first and the last word. Each piece
 * then carries its key at both ends, as each block does in the same-layout check.
 */
static bool sampled(const struct sim *s, const struct sim_req *r, uint32_t token)
{
        uint32_t x = token % s->seg;
        return x == 0 || x == s->seg - 1 || token + 1 == r->tokens;
}

/* One row: every word, or with sample_only the first and the last (each row carries its key
 * at both ends: a row of another token, head or request, or a torn one, is caught). */
static void row_fill(uint8_t *p, uint64_t words, uint64_t key, bool sample_only)
{
        uint64_t *w = (uint64_t *)(void *)p;
        for (uint64_t k = 0; k < words; k = sample_only && k == 0 && words > 2 ? words - 1 : k + 1)
                w[k] = kvf_sim_word(key, k);
}

static bool row_check(const uint8_t *p, uint64_t words, uint64_t key, bool sample_only)
{
        const uint64_t *w = (const uint64_t *)(const void *)p;
        for (uint64_t k = 0; k < words; k = sample_only && k == 0 && words > 2 ? words - 1 : k + 1)
                if (w[k] != kvf_sim_word(key, k))
                        return false;
        return true;
}

static int cache_layout(const struct kvf_layout_info *L, struct kvf_cache_layout *c)
{
        return kvf_layout_make(c, L->num_layers, L->extra_layers, 1, L->kv_heads, L->block_size,
                               L->head_dim, L->dtype, L->key_only);
}

/* The bytes of one head's row of one token. */
static uint64_t row_bytes(const struct kvf_layout_info *L)
{
        return L->block_bytes / ((uint64_t)L->kv_heads * L->block_size);
}

int kvf_sim_tp_setup(struct sim *s)
{
        const struct kvf_layout_info *P = &s->L, *D = &s->Ld;
        const unsigned p = s->o.ranks, d = s->o.dranks;
        s->mixed = s->o.per_head || p != d || P->kv_heads != D->kv_heads || P->block_size != D->block_size;
        if (!s->mixed)
                return 0;
        struct kvf_cache_layout pl, dl;
        char why[512];
        if (cache_layout(P, &pl) < 0 || cache_layout(D, &dl) < 0) {
                fprintf(stderr, "%s: the instances' layouts: %s\n", KVF_SIM_PROG, kvf_last_error());
                return -1;
        }
        if (kvf_tp_check(&pl, p, &dl, d, 0, &s->heads, why, sizeof(why)) < 0) {
                fprintf(stderr, "%s: prefill tp %u into decode tp %u: %s\n", KVF_SIM_PROG, p, d,
                        why);
                return -1;
        }
        uint64_t row = row_bytes(P);
        if (row % 8) {
                fprintf(stderr,
                        "%s: prefill tp %u into decode tp %u: a head's row of one token is %llu "
                        "bytes; the checks of different splits need a multiple of 8\n",
                        KVF_SIM_PROG, p, d, (unsigned long long)row);
                return -1;
        }
        s->seg = P->block_size < D->block_size ? P->block_size : D->block_size;
        for (unsigned i = 0; i < p; i++)
                if (kvf_tp_heads(s->heads, p, i, &s->pfirst[i], &s->pcount[i]) < 0)
                        return -1;
        for (unsigned j = 0; j < d; j++) {
                if (kvf_tp_heads(s->heads, d, j, &s->dfirst[j], &s->dcount[j]) < 0)
                        return -1;
                for (uint32_t h = s->dfirst[j]; h < s->dfirst[j] + s->dcount[j]; h++) {
                        uint32_t i = kvf_tp_source(s->heads, p, d, j, h);
                        s->ntasks += !s->sends[i][j];
                        s->sends[i][j] = true;
                }
        }
        return 0;
}

void kvf_sim_tp_task_id(const struct sim_req *r, unsigned j, char *buf, size_t n)
{
        snprintf(buf, n, "%s.d%u", r->id, j);
}

void kvf_sim_tp_write(struct sim *s, const struct sim_req *r, unsigned rank, uint8_t *base, uint32_t l,
                      uint32_t t, uint32_t j, uint32_t to, bool last)
{
        const struct kvf_layout_info *L = &s->L;
        const uint64_t rb = row_bytes(L);
        uint8_t *block = base + (uint64_t)r->src[j] * L->block_bytes;
        if (s->sg) {
                /* GPU mode: the rank's heads of the block in one entry, the chunk's tokens with
                 * each head's key and (a block the chunk leaves incomplete) the rest with its
                 * partial key, every word */
                uint32_t t0 = j * L->block_size, x1 = L->block_size;
                if (!last && to < t0 + L->block_size)
                        x1 = to > t0 ? to - t0 : 0;
                struct sim_gpu_heads hd = {.seq = r->seq, .head0 = s->pfirst[rank], .heads = s->pcount[rank],
                                           .layer = l, .tensor = t, .rows = L->block_size, .split = x1,
                                           .t0 = t0, .row_bytes = rb};
                sim_gpu_fill_heads(s->sg, rank, block, &hd);
                return;
        }
        for (uint32_t h = 0; h < s->pcount[rank]; h++) {
                uint64_t hk = head_key(r->seq, s->pfirst[rank] + h, l, t, false),
                         hp = head_key(r->seq, s->pfirst[rank] + h, l, t, true);
                for (uint32_t x = 0; x < L->block_size; x++) {
                        uint32_t token = j * L->block_size + x;
                        if (s->o.sample_only && !sampled(s, r, token))
                                continue;
                        uint64_t key = row_key(!last && token >= to ? hp : hk, token);
                        row_fill(block + ((uint64_t)h * L->block_size + x) * rb, rb / 8, key,
                                 s->o.sample_only);
                }
        }
}

/* GPU mode: every row of every head of every destination block, on each decode rank's GPU. */
uint64_t kvf_sim_tp_expect_gpu(struct sim *s, const struct sim_req *r, unsigned j)
{
        const struct kvf_layout_info *L = &s->Ld;
        const uint64_t rb = row_bytes(L);
        struct kvf_client *c = kvf_group_member(s->dec[r->di].g, j);
        uint64_t bytes = 0;
        for (uint32_t l = 0; l < s->layers; l++)
                for (uint32_t t = 0; t < s->tensors; t++) {
                        const uint8_t *base = kvf_cache_tensor(c, l, (int)t);
                        for (uint32_t b = 0; b < r->n_dst; b++) {
                                uint32_t t0 = (r->first + b) * L->block_size;
                                if (t0 >= r->tokens)
                                        break;
                                uint32_t rows = r->tokens - t0 < L->block_size ? r->tokens - t0
                                                                                : L->block_size;
                                /* the rank's heads of the block, each head's rows of the tokens
                                 * it holds (a head's rows are block_size apart) */
                                for (uint32_t h = 0; h < s->dcount[j] && rows < L->block_size; h++) {
                                        struct sim_gpu_heads hd = {
                                            .seq = r->seq, .head0 = s->dfirst[j] + h, .heads = 1, .layer = l,
                                            .tensor = t, .rows = rows, .split = rows, .t0 = t0, .row_bytes = rb};
                                        sim_gpu_expect_heads(s->sg, j,
                                                             base + (uint64_t)r->dst[b] * L->block_bytes +
                                                                 (uint64_t)h * L->block_size * rb,
                                                             &hd);
                                }
                                if (rows == L->block_size) {
                                        struct sim_gpu_heads hd = {
                                            .seq = r->seq, .head0 = s->dfirst[j], .heads = s->dcount[j],
                                            .layer = l, .tensor = t, .rows = rows, .split = rows, .t0 = t0,
                                            .row_bytes = rb};
                                        sim_gpu_expect_heads(s->sg, j, base + (uint64_t)r->dst[b] * L->block_bytes,
                                                             &hd);
                                }
                                bytes += (uint64_t)rows * rb * s->dcount[j];
                        }
                }
        return bytes;
}

/*
 * Once a run, after a request verified on the GPU: its first destination block of layer 0,
 * tensor 0 on decode rank 0, read back and checked on the host, every word of every head's rows,
 * against the host's keys (row_key, kvf_sim_word). The GPU's fill and check kernels agree with
 * each other by construction; this says they also agree with host mixed mode's content. True
 * when it holds (or could not be read: said on stderr, not counted against the request).
 */
bool kvf_sim_tp_gpu_content(struct sim *s, const struct sim_req *r)
{
        const struct kvf_layout_info *L = &s->Ld;
        const uint64_t rb = row_bytes(L);
        const uint32_t t0 = r->first * L->block_size;
        if (s->gpu_content_checked || !r->n_dst || t0 >= r->tokens)
                return true;
        s->gpu_content_checked = true;
        uint32_t rows = r->tokens - t0 < L->block_size ? r->tokens - t0 : L->block_size;
        uint8_t *buf = malloc(L->block_bytes);
        const uint8_t *src = (const uint8_t *)kvf_cache_tensor(kvf_group_member(s->dec[r->di].g, 0), 0, 0) +
                             (uint64_t)r->dst[0] * L->block_bytes;
        if (!buf || sim_gpu_read(s->sg, 0, src, L->block_bytes, buf) < 0) {
                fprintf(stderr, "%s: GPU mode: could not read a block back to check it on the host\n", KVF_SIM_PROG);
                free(buf);
                return true;
        }
        for (uint32_t h = 0; h < s->dcount[0]; h++) {
                uint64_t hk = head_key(r->seq, s->dfirst[0] + h, 0, 0, false);
                for (uint32_t x = 0; x < rows; x++)
                        if (!row_check(buf + ((uint64_t)h * L->block_size + x) * rb, rb / 8, row_key(hk, t0 + x),
                                       false)) {
                                fprintf(stderr,
                                        "%s: request %s: decode rank 0 layer 0 tensor 0 dest block %u head %u "
                                        "token %u: the GPU's content differs from the host's keys\n",
                                        KVF_SIM_PROG, r->id, r->dst[0], s->dfirst[0] + h, t0 + x);
                                free(buf);
                                return false;
                        }
        }
        free(buf);
        return true;
}

/* Which entry of kvf_sim_tp_expect_gpu's queue index `k` is (the order it queues them in). */
struct expect_at {
        uint32_t l, t, b, h;
        bool one_head; /* a partial block's entry: head h alone; else the rank's heads from h */
};

static struct expect_at expect_entry(const struct sim *s, const struct sim_req *r, unsigned j, uint64_t k)
{
        const uint32_t bs = s->Ld.block_size;
        struct expect_at at = {0};
        for (at.l = 0; at.l < s->layers; at.l++)
                for (at.t = 0; at.t < s->tensors; at.t++)
                        for (at.b = 0; at.b < r->n_dst && (r->first + at.b) * bs < r->tokens; at.b++) {
                                bool partial = r->tokens - (r->first + at.b) * bs < bs;
                                uint64_t n = partial ? s->dcount[j] : 1;
                                if (k < n) {
                                        at.one_head = partial;
                                        at.h = s->dfirst[j] + (uint32_t)k;
                                        return at;
                                }
                                k -= n;
                        }
        return (struct expect_at){0}; /* (not an index it queued) */
}

static bool verify_gpu(struct sim *s, const struct sim_req *r)
{
        for (unsigned j = 0; j < s->o.dranks; j++) {
                uint64_t bytes = kvf_sim_tp_expect_gpu(s, r, j);
                uint64_t first = 0;
                long bad = sim_gpu_check(s->sg, j, &first);
                if (bad != 0) {
                        struct expect_at at = expect_entry(s, r, j, first);
                        fprintf(stderr,
                                "%s: request %s: decode rank %u: %ld block(s) differ, the first layer %u "
                                "tensor %u dest block %u (#%u) %s %u%s\n",
                                KVF_SIM_PROG, r->id, j, bad, at.l, at.t, r->dst[at.b], at.b,
                                at.one_head ? "head" : "heads from", at.h,
                                bad < 0 ? " (the check itself failed)" : "");
                        return false;
                }
                s->verified_bytes += bytes;
        }
        return kvf_sim_tp_gpu_content(s, r);
}

bool kvf_sim_tp_verify(struct sim *s, const struct sim_req *r)
{
        if (s->sg)
                return verify_gpu(s, r);
        const struct kvf_layout_info *L = &s->Ld;
        const uint64_t rb = row_bytes(L);
        /* r->first counts destination blocks the peer already held (equal block sizes only) */
        for (unsigned j = 0; j < s->o.dranks; j++) {
                struct kvf_client *c = kvf_group_member(s->dec[r->di].g, j);
                for (uint32_t l = 0; l < s->layers; l++)
                        for (uint32_t t = 0; t < s->tensors; t++) {
                                const uint8_t *base = kvf_cache_tensor(c, l, (int)t);
                                for (uint32_t b = 0; b < r->n_dst; b++)
                                        for (uint32_t h = 0; h < s->dcount[j]; h++) {
                                                uint64_t hk = head_key(r->seq, s->dfirst[j] + h,
                                                                       l, t, false);
                                                for (uint32_t x = 0; x < L->block_size; x++) {
                                                        uint32_t token =
                                                            (r->first + b) * L->block_size + x;
                                                        if (token >= r->tokens)
                                                                break;
                                                        /* (sample: the bytes its samples cover) */
                                                        s->verified_bytes += rb;
                                                        if (s->o.sample_only &&
                                                            !sampled(s, r, token))
                                                                continue;
                                                        const uint8_t *o =
                                                            base +
                                                            (uint64_t)r->dst[b] * L->block_bytes +
                                                            ((uint64_t)h * L->block_size + x) * rb;
                                                        if (!row_check(o, rb / 8,
                                                                       row_key(hk, token),
                                                                       s->o.sample_only)) {
                                                                fprintf(stderr,
                                                                        "%s: request %s: decode "
                                                                        "rank %u layer %u tensor "
                                                                        "%u dest block %u (#%u) "
                                                                        "head %u token %u "
                                                                        "differs\n",
                                                                        KVF_SIM_PROG, r->id, j, l,
                                                                        t, r->dst[b], b,
                                                                        s->dfirst[j] + h, token);
                                                                return false;
                                                        }
                                                }
                                        }
                        }
        }
        return true;
}

int kvf_sim_tp_prefill_rank(const struct sim *s, const struct sim_req *r, const char *name)
{
        for (unsigned i = 0; i < s->o.ranks; i++)
                if (!strcmp(s->pre[r->pi].o->name[i], name))
                        return (int)i;
        return -1;
}

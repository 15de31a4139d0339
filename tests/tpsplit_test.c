/*
 * Mixed tensor parallelism and block sizes (common/tpsplit.*): for each case a
 * request's whole KV content is defined per (head, token, byte); every prefill
 * rank's cache is filled with its heads in its block size, every (prefill
 * rank, decode rank) plan is applied byte by byte, and every decode rank must
 * then hold exactly its heads, every byte written exactly once (walked with
 * kvf_tp_piece_next, as both executors of same-host copies walk it). Refusals
 * name both layouts; kvf_tp_pair_plan gives whole blocks, pieces or its refusal.
 */
#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "err.h"
#include "layout.h"
#include "tpsplit.h"

static uint8_t content(uint32_t head, uint32_t token, uint32_t byte)
{
        uint32_t x = head * 2654435761u ^ token * 40503u ^ byte * 97u;
        return (uint8_t)(x ^ x >> 13);
}

struct rank {
        struct kvf_cache_layout L;
        uint32_t first, count, nblocks;
        uint8_t *mem;
        uint8_t *writes; /* decode side: how often each byte was written */
};

/* Block ids are scattered (b * 3 + 1 of a pool three times larger), as real ones are. */
static uint32_t block_id(uint32_t b)
{
        return b * 3 + 1;
}

static void make_side(struct rank *r, uint32_t tp, uint32_t heads, uint32_t bsize, uint32_t hdim,
                      uint32_t key_only, uint32_t tokens, int fill)
{
        for (uint32_t k = 0; k < tp; k++) {
                CHECK(kvf_tp_heads(heads, tp, k, &r[k].first, &r[k].count) == 0);
                r[k].nblocks = (tokens + bsize - 1) / bsize;
                CHECK(kvf_layout_make(&r[k].L, 2, 0, r[k].nblocks * 3 + 1, r[k].count, bsize, hdim,
                                      KVF_DTYPE_FP8, key_only) == 0);
                r[k].mem = calloc(1, r[k].L.cache_bytes);
                r[k].writes = calloc(1, r[k].L.cache_bytes);
                CHECK(r[k].mem && r[k].writes);
                if (!fill)
                        continue;
                for (uint32_t b = 0; b < r[k].nblocks; b++)
                        for (uint32_t h = 0; h < r[k].count; h++)
                                for (uint32_t t = 0; t < bsize; t++)
                                        for (uint32_t y = 0; y < hdim; y++)
                                                for (uint32_t l = 0; l < 2; l++)
                                                        for (uint32_t z = 0;
                                                             z < kvf_layout_tensors(&r[k].L); z++)
                                                                r[k].mem[kvf_layout_offset(
                                                                             &r[k].L, l, z,
                                                                             block_id(b)) +
                                                                         ((uint64_t)h * bsize + t) *
                                                                             hdim +
                                                                         y] =
                                                                    content(r[k].first + h +
                                                                                100 * l + 1000 * z,
                                                                            b * bsize + t, y);
        }
}

static void free_side(struct rank *r, uint32_t tp)
{
        for (uint32_t k = 0; k < tp; k++) {
                free(r[k].mem);
                free(r[k].writes);
        }
}

/* Move `tokens` tokens of a model of `heads` kv heads from a group of p ranks (blocks of bs
 * tokens) to one of d (blocks of bd) and check every byte; returns the pieces per request. */
static uint64_t run_case(uint32_t heads, uint32_t key_only, uint32_t p, uint32_t bs, uint32_t d,
                         uint32_t bd, uint32_t tokens)
{
        const uint32_t hdim = 8;
        struct rank P[16], D[16];
        uint64_t pieces = 0;
        make_side(P, p, heads, bs, hdim, key_only, tokens, 1);
        make_side(D, d, heads, bd, hdim, key_only, tokens, 0);
        for (uint32_t j = 0; j < d; j++) {
                uint32_t h;
                char why[512];
                CHECK(kvf_tp_check(&P[0].L, p, &D[j].L, d, heads, &h, why, sizeof(why)) == 0 ||
                      (fprintf(stderr, "%s\n", why), 0));
                CHECK_EQ(h, key_only ? 1 : heads);
                uint32_t senders = 0;
                for (uint32_t i = 0; i < p; i++) {
                        struct kvf_tp_plan pl;
                        CHECK(kvf_tp_plan(&P[i].L, p, i, &D[j].L, d, j, h, &pl) == 0);
                        senders += pl.npieces > 0;
                        uint32_t nsrc = P[i].nblocks;
                        /* the decode engine reserves blocks for the tokens; the last source
                         * block may hold tokens of no destination block */
                        uint32_t ndst = D[j].nblocks;
                        CHECK(ndst <= kvf_tp_dst_blocks(nsrc, bs, bd));
                        /* the walk both executors make (kvf_tp_piece_next): each source block's
                         * pieces into the request's destination blocks */
                        for (uint32_t sb = 0; sb < nsrc; sb++)
                                for (uint32_t x = 0, db; kvf_tp_piece_next(&pl, sb, ndst, &x, &db);
                                     x++) {
                                        const struct kvf_tp_piece *c = &pl.pieces[x];
                                        CHECK(c->sblk == sb % pl.src_per_group && db < ndst &&
                                              db == sb / pl.src_per_group * pl.dst_per_group +
                                                        c->dblk);
                                        pieces++;
                                        for (uint32_t l = 0; l < 2; l++)
                                                for (uint32_t z = 0;
                                                     z < kvf_layout_tensors(&P[i].L); z++) {
                                                        uint64_t so =
                                                            kvf_layout_offset(&P[i].L, l, z,
                                                                              block_id(sb)) +
                                                            c->soff;
                                                        uint64_t dof =
                                                            kvf_layout_offset(&D[j].L, l, z,
                                                                              block_id(db)) +
                                                            c->doff;
                                                        CHECK(c->soff + c->bytes <=
                                                              P[i].L.block_bytes);
                                                        CHECK(c->doff + c->bytes <=
                                                              D[j].L.block_bytes);
                                                        memcpy(D[j].mem + dof, P[i].mem + so,
                                                               c->bytes);
                                                        for (uint32_t y = 0; y < c->bytes; y++)
                                                                D[j].writes[dof + y]++;
                                                }
                                }
                        kvf_tp_plan_free(&pl);
                }
                CHECK_EQ(senders, kvf_tp_sources(h, p, d, j));
                /* every byte of every token of every head, once */
                for (uint32_t tk = 0; tk < tokens; tk++)
                        for (uint32_t hh = 0; hh < D[j].count; hh++)
                                for (uint32_t y = 0; y < hdim; y++)
                                        for (uint32_t l = 0; l < 2; l++)
                                                for (uint32_t z = 0;
                                                     z < kvf_layout_tensors(&D[j].L); z++) {
                                                        uint64_t o =
                                                            kvf_layout_offset(&D[j].L, l, z,
                                                                              block_id(tk / bd)) +
                                                            ((uint64_t)hh * bd + tk % bd) * hdim +
                                                            y;
                                                        if (D[j].writes[o] != 1 ||
                                                            D[j].mem[o] !=
                                                                content(D[j].first + hh + 100 * l +
                                                                            1000 * z,
                                                                        tk, y)) {
                                                                fprintf(stderr,
                                                                        "heads %u %u->%u bs "
                                                                        "%u->%u: decode rank %u "
                                                                        "head %u token %u byte %u: "
                                                                        "written %u times, %s\n",
                                                                        heads, p, d, bs, bd, j,
                                                                        D[j].first + hh, tk, y,
                                                                        D[j].writes[o],
                                                                        D[j].writes[o]
                                                                            ? "wrong content"
                                                                            : "never");
                                                                exit(1);
                                                        }
                                                }
        }
        free_side(P, p);
        free_side(D, d);
        return pieces;
}

static void refused(uint32_t ph, uint32_t p, uint32_t pbs, uint32_t dh, uint32_t d, uint32_t dbs,
                    uint32_t dlayers, uint32_t given, const char *needle)
{
        struct kvf_cache_layout a, b;
        uint32_t h;
        char why[512];
        CHECK(kvf_layout_make(&a, 4, 0, 16, ph, pbs, 128, KVF_DTYPE_BF16, 0) == 0);
        CHECK(kvf_layout_make(&b, dlayers, 0, 16, dh, dbs, 128, KVF_DTYPE_BF16, 0) == 0);
        CHECK_EQ(kvf_tp_check(&a, p, &b, d, given, &h, why, sizeof(why)), -EPROTO);
        if (!strstr(why, needle) || !strstr(why, "prefill") || !strstr(why, "decode")) {
                fprintf(stderr, "refusal \"%s\" lacks \"%s\" or a side\n", why, needle);
                exit(1);
        }
}

int main(void)
{
        /* the split rule */
        uint32_t f, n;
        CHECK(kvf_tp_heads(8, 2, 1, &f, &n) == 0 && f == 4 && n == 4);
        CHECK(kvf_tp_heads(2, 8, 5, &f, &n) == 0 && f == 1 && n == 1);
        CHECK(kvf_tp_heads(8, 3, 0, &f, &n) == -EINVAL);
        CHECK_EQ(kvf_tp_source(1, 4, 8, 6, 0), 2); /* MLA: decode rank j from prefill j mod p */
        CHECK_EQ(kvf_tp_sources(8, 8, 2, 1), 4);   /* 8 -> 2: four parts per decode rank */

        /* a pair as the executors plan it from the two segments' headers */
        {
                struct kvf_cache_layout a, b;
                struct kvf_tp_plan pl;
                char why[512];
                CHECK_EQ(kvf_layout_make(&a, 2, 0, 64, 4, 16, 8, KVF_DTYPE_BF16, 0), 0);
                CHECK_EQ(kvf_layout_make(&b, 2, 0, 64, 4, 16, 8, KVF_DTYPE_BF16, 0), 0);
                CHECK_EQ(kvf_tp_pair_plan(&a, 2, 1, &b, 2, 1, &pl, why, sizeof(why)), 0);
                CHECK_EQ(pl.npieces, 0); /* equal: whole blocks */
                /* equal groups, another rank: rank 0's heads would land in rank 1's cache */
                CHECK_EQ(kvf_tp_pair_plan(&a, 2, 0, &b, 2, 1, &pl, why, sizeof(why)), -EXDEV);
                CHECK(strstr(why, "prefill rank 0 of 2 holds kv heads 0 to 3, decode rank 1 of 2 heads 4 to 7") &&
                      !pl.npieces);
                CHECK_EQ(kvf_tp_pair_plan(&a, 2, 1, &b, 2, 2, &pl, why, sizeof(why)), -EXDEV);
                CHECK(strstr(why, "groups of 2"));
                CHECK_EQ(kvf_layout_make(&b, 2, 0, 64, 1, 16, 8, KVF_DTYPE_BF16, 0), 0);
                CHECK_EQ(kvf_tp_pair_plan(&a, 2, 1, &b, 8, 5, &pl, why, sizeof(why)), 0);
                CHECK(pl.npieces == 1 && pl.pieces[0].soff == 1 * 16 * 8 * 2 &&
                      pl.pieces[0].doff == 0 && pl.pieces[0].bytes == b.block_bytes);
                uint32_t x = 0, db = 0;
                CHECK(kvf_tp_piece_next(&pl, 3, 4, &x, &db) && x == 0 && db == 3);
                x = 1;
                CHECK(!kvf_tp_piece_next(&pl, 3, 4, &x, &db));
                x = 0;
                CHECK(!kvf_tp_piece_next(&pl, 4, 4, &x, &db)); /* past the destination blocks */
                kvf_tp_plan_free(&pl);
                CHECK_EQ(kvf_tp_pair_plan(&a, 2, 1, &b, 8, 1, &pl, why, sizeof(why)), -ENOENT);
                CHECK(strstr(why, "sends it none of its heads") && !pl.npieces);
                CHECK_EQ(kvf_layout_make(&b, 2, 0, 64, 3, 16, 8, KVF_DTYPE_BF16, 0), 0);
                CHECK_EQ(kvf_tp_pair_plan(&a, 2, 1, &b, 2, 1, &pl, why, sizeof(why)), -EXDEV);
                CHECK(strstr(why, "prefill 4 kv head(s) x tp 2") && !pl.npieces);
                /* MLA, 2 -> 8: the latent whole, whole blocks */
                CHECK_EQ(kvf_layout_make(&a, 2, 0, 64, 1, 16, 8, KVF_DTYPE_BF16, 1), 0);
                CHECK_EQ(kvf_layout_make(&b, 2, 0, 64, 1, 16, 8, KVF_DTYPE_BF16, 1), 0);
                CHECK_EQ(kvf_tp_pair_plan(&a, 2, 1, &b, 8, 3, &pl, why, sizeof(why)), 0);
                CHECK_EQ(pl.npieces, 0);
                /* MLA between equal groups: the same latent on every rank, any pair */
                CHECK_EQ(kvf_tp_pair_plan(&a, 2, 1, &b, 2, 0, &pl, why, sizeof(why)), 0);
                CHECK_EQ(pl.npieces, 0);
        }

        static const struct {
                uint32_t heads, key_only, p, bs, d, bd;
        } cases[] = {
            {8, 0, 1, 16, 2, 16}, {8, 0, 2, 16, 8, 16}, {8, 0, 8, 16, 2, 16}, {8, 0, 4, 64, 4, 16},
            {8, 0, 4, 16, 4, 64}, {8, 0, 2, 64, 8, 16}, {8, 0, 8, 16, 2, 32}, {2, 0, 1, 16, 2, 16},
            {2, 0, 2, 16, 8, 16}, {2, 0, 8, 16, 2, 16}, {2, 0, 4, 32, 4, 16}, {2, 0, 8, 16, 4, 16},
            {1, 1, 1, 16, 2, 16}, {1, 1, 2, 16, 8, 16}, {1, 1, 8, 16, 2, 16}, {1, 1, 4, 64, 4, 16},
            {1, 1, 4, 16, 4, 64}, {8, 0, 1, 16, 1, 16},
        };
        for (size_t c = 0; c < sizeof(cases) / sizeof(cases[0]); c++)
                for (uint32_t tokens = 1; tokens <= 200; tokens += 67) {
                        uint64_t pc = run_case(cases[c].heads, cases[c].key_only, cases[c].p,
                                               cases[c].bs, cases[c].d, cases[c].bd, tokens);
                        if (tokens == 135)
                                printf("heads %u%s tp %u->%u, %u->%u tokens/block, %u tokens: %llu "
                                       "pieces per layer and tensor\n",
                                       cases[c].heads, cases[c].key_only ? " (mla)" : "",
                                       cases[c].p, cases[c].d, cases[c].bs, cases[c].bd, tokens,
                                       (unsigned long long)pc);
                }

        /* equal block sizes: one piece per (block, decode rank, source) */
        CHECK_EQ(run_case(8, 0, 2, 16, 8, 16, 64), 4 * 8);

        refused(4, 2, 64, 1, 8, 48, 4, 0, "block sizes 64 and 48 do not divide one another");
        refused(4, 2, 16, 2, 8, 16, 4, 0, "not one split");
        refused(4, 2, 16, 1, 8, 16, 5, 0, "4 layers here, 5 there");
        refused(1, 8, 16, 1, 4, 16, 4, 0, "cannot be told");
        refused(1, 8, 16, 1, 4, 16, 4, 3, "not one split");
        /* the same case with the heads named is accepted */
        {
                struct kvf_cache_layout a, b;
                uint32_t h;
                char why[256];
                CHECK(kvf_layout_make(&a, 4, 0, 16, 1, 16, 128, KVF_DTYPE_BF16, 0) == 0);
                CHECK(kvf_layout_make(&b, 4, 0, 16, 1, 16, 128, KVF_DTYPE_BF16, 0) == 0);
                CHECK(kvf_tp_check(&a, 8, &b, 4, 2, &h, why, sizeof(why)) == 0 && h == 2);
        }
        /* the one slice per block a tcp frame carries (kvf_tp_slice) */
        {
                struct kvf_cache_layout p8, d4, d1, d4b, m;
                uint32_t so, dof, len;
                const uint32_t head = 16 * 128 * 2; /* one head of a 16-token bf16 block */
                CHECK(kvf_layout_make(&p8, 4, 0, 16, 8, 16, 128, KVF_DTYPE_BF16, 0) == 0);
                CHECK(kvf_layout_make(&d4, 4, 0, 99, 4, 16, 128, KVF_DTYPE_BF16, 0) == 0);
                CHECK(kvf_layout_make(&d1, 4, 0, 16, 1, 16, 128, KVF_DTYPE_BF16, 0) == 0);
                CHECK(kvf_layout_make(&d4b, 4, 0, 16, 4, 32, 128, KVF_DTYPE_BF16, 0) == 0);
                CHECK(kvf_layout_make(&m, 4, 0, 16, 1, 16, 512, KVF_DTYPE_BF16, 1) == 0);
                /* equal layouts and groups (block counts aside): whole blocks */
                CHECK(kvf_tp_slice(&p8, 1, 0, &p8, 1, 0, &so, &dof, &len) == 0 && len == 0);
                CHECK(kvf_tp_slice(&p8, 2, 1, &p8, 2, 1, &so, &dof, &len) == 0 && len == 0);
                CHECK(kvf_tp_slice(&p8, 2, 1, &p8, 2, 0, &so, &dof, &len) == -EXDEV);
                CHECK(strstr(kvf_err_msg(), "between equal groups rank r sends to rank r"));
                CHECK(kvf_tp_slice(&m, 2, 1, &m, 2, 0, &so, &dof, &len) == 0 && len == 0);
                /* 1 -> 2 over 8 heads: rank 1 gets heads 4..7, at 0 of its blocks */
                CHECK(kvf_tp_slice(&p8, 1, 0, &d4, 2, 1, &so, &dof, &len) == 0);
                CHECK(so == 4 * head && dof == 0 && len == 4 * head);
                /* 2 -> 8 (4 heads a prefill rank, 1 a decode rank): decode rank 6, head 6, is
                 * head 2 of prefill rank 1 */
                struct kvf_cache_layout p4;
                CHECK(kvf_layout_make(&p4, 4, 0, 16, 4, 16, 128, KVF_DTYPE_BF16, 0) == 0);
                CHECK(kvf_tp_slice(&p4, 2, 1, &d1, 8, 6, &so, &dof, &len) == 0);
                CHECK(so == 2 * head && dof == 0 && len == head);
                CHECK(kvf_tp_slice(&p4, 2, 0, &d1, 8, 6, &so, &dof, &len) == -EXDEV);
                CHECK(strstr(kvf_err_msg(), "none of its heads"));
                /* 8 -> 2: prefill rank 5 (head 5) into decode rank 1 (heads 4..7) at head 1 */
                CHECK(kvf_tp_slice(&d1, 8, 5, &d4, 2, 1, &so, &dof, &len) == 0);
                CHECK(so == 0 && dof == head && len == head);
                /* MLA: the latent replicated, whole blocks */
                CHECK(kvf_tp_slice(&m, 2, 1, &m, 8, 3, &so, &dof, &len) == 0 && len == 0);
                /* another block size: not one slice per block */
                CHECK(kvf_tp_slice(&p4, 2, 0, &d4b, 2, 0, &so, &dof, &len) == -EXDEV);
                CHECK(strstr(kvf_err_msg(), "not one slice per block"));
        }
        printf("ok\n");
        return 0;
}

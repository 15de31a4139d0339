/*
 * The layout's math (common/layout.*) with and without scale tensors: every
 * (layer, tensor, block) has its own bytes (no two overlap, none outside the
 * cache, K/V offsets the same as without scales), kvf_layout_part finds the
 * tensor of every byte and the offset in it, sizes add up to cache_bytes, and
 * the layout survives the trip through the engine's and the handshake's shapes
 * (an msgpack record) with its scales; layouts that differ in their scales are
 * refused with the reason.
 */
#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "kvferry.h"
#include "layout.h"
#include "records.h"
#include "tpsplit.h"

/* Walk every byte's owner: each (layer, tensor, block) claims its bytes once. */
static void walk(const struct kvf_cache_layout *l)
{
        uint8_t *own = calloc(l->cache_bytes, 1);
        CHECK(own);
        uint32_t nt = kvf_layout_all_tensors(l), parts = kvf_layout_parts(l);
        CHECK_EQ(parts, kvf_layout_layers(l) * nt);
        uint64_t sum = 0;
        for (uint32_t i = 0; i < parts; i++)
                sum += kvf_layout_part_bytes(l, i);
        CHECK_EQ(sum, l->cache_bytes);
        for (uint32_t layer = 0; layer < kvf_layout_layers(l); layer++)
                for (uint32_t t = 0; t < nt; t++) {
                        uint64_t bb = kvf_layout_tensor_bytes(l, t);
                        CHECK_EQ(bb, t < kvf_layout_tensors(l) ? l->block_bytes : l->scale_bytes);
                        for (uint32_t b = 0; b < l->num_blocks; b++) {
                                uint64_t off = kvf_layout_offset(l, layer, t, b), rest;
                                CHECK(off + bb <= l->cache_bytes);
                                for (uint64_t k = 0; k < bb; k++) {
                                        CHECK_EQ(own[off + k], 0);
                                        own[off + k] = 1;
                                }
                                /* its part: (layer, tensor) in kvf_layout_offset order */
                                uint32_t want = t < kvf_layout_tensors(l)
                                                        ? layer * kvf_layout_tensors(l) + t
                                                        : kvf_layout_layers(l) * kvf_layout_tensors(l) +
                                                                  layer * kvf_layout_tensors(l) +
                                                                  (t - kvf_layout_tensors(l));
                                CHECK_EQ(kvf_layout_part(l, off, &rest), want);
                                CHECK_EQ(rest, (uint64_t)b * bb);
                                CHECK_EQ(kvf_layout_part(l, off + bb - 1, &rest), want);
                                CHECK_EQ(rest, (uint64_t)b * bb + bb - 1);
                                CHECK_EQ(kvf_layout_part_block_bytes(l, want), bb);
                        }
                }
        for (uint64_t k = 0; k < l->cache_bytes; k++)
                CHECK_EQ(own[k], 1);
        uint64_t rest;
        CHECK_EQ(kvf_layout_part(l, l->cache_bytes, &rest), parts); /* past the end */
        CHECK_EQ(kvf_layout_part(l, UINT64_MAX, &rest), parts);
        free(own);
}

static void round_trip(const struct kvf_cache_layout *l)
{
        struct kvf_layout_info li;
        struct kvf_cache_layout back;
        kvf_layout_to_info(l, &li);
        CHECK_EQ(li.scale_dtype, l->scale_dtype);
        CHECK_EQ(li.scale_bytes, l->scale_bytes);
        CHECK_EQ(kvf_layout_from_info(&back, &li), 0);
        CHECK(memcmp(&back, l, sizeof(back)) == 0);

        /* the handshake's shape, through msgpack */
        struct kvf_record r = {.type = KVF_RT_AUTH}, d;
        kvf_layout_to_record(l, &r);
        snprintf(r.instance, sizeof(r.instance), "layout-test");
        snprintf(r.purpose, sizeof(r.purpose), "data");
        uint8_t buf[4096];
        int n = kvf_record_encode(&r, buf, sizeof(buf));
        CHECK(n > 0);
        CHECK_EQ(kvf_record_decode(KVF_RT_AUTH, buf, (size_t)n, 0, &d), 0);
        CHECK_EQ(d.lay_scale_dtype, l->scale_dtype);
        CHECK_EQ(kvf_layout_from_record(&back, &d), 0);
        CHECK(memcmp(&back, l, sizeof(back)) == 0);
        kvf_record_free(&d);
}

int main(void)
{
        struct kvf_cache_layout plain, sc, mla;
        char why[256];

        /* block_wise_fp8 as FastDeploy lays it out: uint8 K/V, bf16 scales [blocks, heads, tokens] */
        CHECK_EQ(kvf_layout_make(&plain, 3, 1, 7, 2, 16, 32, KVF_DTYPE_UINT8, 0), 0);
        sc = plain;
        CHECK_EQ(kvf_layout_set_scales(&sc, KVF_DTYPE_BF16), 0);
        CHECK_EQ(sc.scale_bytes, 2 * 16 * 2);
        CHECK_EQ(sc.cache_bytes, plain.cache_bytes + 4ull * 2 * 7 * sc.scale_bytes);
        CHECK_EQ(kvf_layout_all_tensors(&sc), 4);
        CHECK_EQ(kvf_layout_layer_block_bytes(&sc), 2 * (sc.block_bytes + sc.scale_bytes));
        CHECK_EQ(kvf_layout_kv_bytes(&sc), plain.cache_bytes);
        /* K/V where a layout without scales has them: engines that compute K/V offsets from
         * block_bytes alone stay right */
        for (uint32_t layer = 0; layer < 4; layer++)
                for (uint32_t t = 0; t < 2; t++)
                        CHECK_EQ(kvf_layout_offset(&sc, layer, t, 5), kvf_layout_offset(&plain, layer, t, 5));
        /* the scales follow every K/V: layer 0 K's scales first */
        CHECK_EQ(kvf_layout_offset(&sc, 0, 2, 0), plain.cache_bytes);
        CHECK_EQ(kvf_layout_offset(&sc, 1, 3, 2), plain.cache_bytes + ((1ull * 2 + 1) * 7 + 2) * sc.scale_bytes);
        walk(&plain);
        walk(&sc);
        round_trip(&plain);
        round_trip(&sc);

        /* MLA (K only) with fp32 scales */
        CHECK_EQ(kvf_layout_make(&mla, 2, 0, 5, 1, 64, 576, KVF_DTYPE_UINT8, 1), 0);
        CHECK_EQ(kvf_layout_set_scales(&mla, KVF_DTYPE_FP32), 0);
        CHECK_EQ(kvf_layout_all_tensors(&mla), 2);
        CHECK_EQ(mla.scale_bytes, 64 * 4);
        walk(&mla);
        round_trip(&mla);

        /* removing them gives the plain layout back; an unknown dtype is refused */
        struct kvf_cache_layout x = sc;
        CHECK_EQ(kvf_layout_set_scales(&x, 0), 0);
        CHECK(memcmp(&x, &plain, sizeof(x)) == 0);
        CHECK_EQ(kvf_layout_set_scales(&x, 99), -EINVAL);
        CHECK(strstr(kvf_err_msg(), "unknown scale dtype 99"));

        /* two instances must agree on their scales */
        CHECK_EQ(kvf_layout_compatible(&sc, &sc, why, sizeof(why)), 0);
        CHECK_EQ(kvf_layout_compatible(&plain, &sc, why, sizeof(why)), -EPROTO);
        CHECK(strstr(why, "no scale tensors here, bf16 there")); /* (kvf_layout_compatible) */
        x = plain;
        CHECK_EQ(kvf_layout_set_scales(&x, KVF_DTYPE_FP32), 0);
        CHECK_EQ(kvf_layout_compatible(&x, &sc, why, sizeof(why)), -EPROTO);
        CHECK(strstr(why, "fp32 scale tensors here, bf16 there"));

        /* ... and move between equal splits only */
        uint32_t heads;
        struct kvf_cache_layout half;
        CHECK_EQ(kvf_layout_make(&half, 3, 1, 7, 1, 16, 32, KVF_DTYPE_UINT8, 0), 0);
        CHECK_EQ(kvf_layout_set_scales(&half, KVF_DTYPE_BF16), 0);
        CHECK_EQ(kvf_tp_check(&sc, 1, &half, 2, 0, &heads, why, sizeof(why)), -EPROTO);
        CHECK(strstr(why, "scale tensors move between equal tensor-parallel splits"));
        CHECK_EQ(kvf_tp_check(&plain, 1, &half, 2, 0, &heads, why, sizeof(why)), -EPROTO);
        CHECK(strstr(why, "scale tensors: none on prefill, bf16 on decode"));
        struct kvf_tp_plan plan;
        CHECK_EQ(kvf_tp_pair_plan(&sc, 1, 0, &sc, 1, 0, &plan, why, sizeof(why)), 0);
        CHECK_EQ(plan.npieces, 0); /* equal layouts: whole blocks */
        printf("ok: layouts with and without scale tensors: offsets, parts, sizes, round trips, refusals\n");
        return 0;
}

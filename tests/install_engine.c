/*
 * A small engine built only from an installed kvferry (pkg-config --cflags
 * --libs kvferry): attaches to a prefill and a decode instance on this host
 * (host caches), moves a few requests over ipc and checks every byte that
 * arrives. tests/install_test.sh builds and runs it.
 *
 *   install_engine PREFILL DECODE [REQUESTS]
 *
 * Exit: 0 every request finished and verified, 1 otherwise, 2 usage.
 */
#include <kvferry.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define BLOCKS_PER_REQ 2u

static unsigned char byte_of(unsigned req, unsigned layer, unsigned v, unsigned blk, uint64_t i)
{
        return (unsigned char)(req * 131u + layer * 31u + v * 17u + blk * 7u +
                               (unsigned)(i % 251u));
}

static int wait_events(struct kvf_client *c, unsigned want, int type, const char *what)
{
        unsigned got = 0;
        struct kvf_event ev;
        for (int tries = 0; got < want && tries < 150; tries++) {
                int rc = kvf_poll(c, &ev, 100);
                if (rc < 0) {
                        fprintf(stderr, "install_engine: poll (%s): %s\n", what, kvf_last_error());
                        return -1;
                }
                if (rc == 0 || ev.type != type)
                        continue;
                if (ev.status != KVF_STATUS_FINISHED) {
                        fprintf(stderr, "install_engine: %s of %s: %s (%s)\n", what, ev.request_id,
                                kvf_status_name(ev.status), ev.reason);
                        return -1;
                }
                got++;
        }
        if (got < want) {
                fprintf(stderr, "install_engine: %u of %u %ss within 15 s\n", got, want, what);
                return -1;
        }
        return 0;
}

int main(int argc, char **argv)
{
        if (argc < 3 || argc > 4) {
                fprintf(stderr, "Usage: %s PREFILL DECODE [REQUESTS]\n", argv[0]);
                return 2;
        }
        unsigned n = argc == 4 ? (unsigned)strtoul(argv[3], NULL, 10) : 4u;
        struct kvf_client *pre = NULL, *dec = NULL;
        int ret = 1;
        if (kvf_attach(argv[2], 5000, &dec) < 0 || kvf_attach(argv[1], 5000, &pre) < 0) {
                fprintf(stderr, "install_engine: attach: %s\n", kvf_last_error());
                goto out;
        }
        struct kvf_layout_info lo;
        if (kvf_get_layout(pre, &lo) < 0) {
                fprintf(stderr, "install_engine: layout: %s\n", kvf_last_error());
                goto out;
        }
        unsigned layers = lo.num_layers + lo.extra_layers, tensors = lo.key_only ? 1u : 2u;
        if (lo.num_blocks < 2 * n * BLOCKS_PER_REQ) {
                fprintf(stderr, "install_engine: %u blocks hold fewer than %u requests\n",
                        lo.num_blocks, n);
                goto out;
        }
        uint64_t step = kvf_last_step(pre) + 1;
        for (unsigned r = 0; r < n; r++) {
                uint32_t src[BLOCKS_PER_REQ], dst[BLOCKS_PER_REQ];
                for (unsigned b = 0; b < BLOCKS_PER_REQ; b++) {
                        src[b] = r * BLOCKS_PER_REQ + b;
                        dst[b] = lo.num_blocks - 1 - (r * BLOCKS_PER_REQ + b);
                }
                char id[64];
                snprintf(id, sizeof(id), "install-%u", r);
                struct kvf_task t = {.request_id = id,
                                     .src_block_ids = src,
                                     .n_src = BLOCKS_PER_REQ,
                                     .dest_block_ids = dst,
                                     .n_dest = BLOCKS_PER_REQ,
                                     .current_id = step + r,
                                     .transport = KVF_TRANSPORT_IPC,
                                     .peer = argv[2],
                                     .peer_session = kvf_session(dec)};
                if (kvf_submit_task(pre, &t) < 0) {
                        fprintf(stderr, "install_engine: submit %s: %s\n", id, kvf_last_error());
                        goto out;
                }
                for (unsigned l = 0; l < layers; l++) {
                        for (unsigned v = 0; v < tensors; v++) {
                                unsigned char *base = kvf_cache_tensor(pre, l, (int)v);
                                for (unsigned b = 0; b < BLOCKS_PER_REQ; b++)
                                        for (uint64_t i = 0; i < lo.block_bytes; i++)
                                                base[src[b] * lo.block_bytes + i] =
                                                    byte_of(r, l, v, b, i);
                        }
                        if (kvf_layer_done(pre, step + r, l) < 0) {
                                fprintf(stderr, "install_engine: layer done: %s\n",
                                        kvf_last_error());
                                goto out;
                        }
                }
        }
        if (wait_events(pre, n, KVF_EVENT_COMPLETION, "completion") < 0 ||
            wait_events(dec, n, KVF_EVENT_ARRIVAL, "arrival") < 0)
                goto out;
        for (unsigned r = 0; r < n; r++)
                for (unsigned l = 0; l < layers; l++)
                        for (unsigned v = 0; v < tensors; v++) {
                                const unsigned char *base = kvf_cache_tensor(dec, l, (int)v);
                                for (unsigned b = 0; b < BLOCKS_PER_REQ; b++) {
                                        uint64_t d = lo.num_blocks - 1 - (r * BLOCKS_PER_REQ + b);
                                        for (uint64_t i = 0; i < lo.block_bytes; i++)
                                                if (base[d * lo.block_bytes + i] !=
                                                    byte_of(r, l, v, b, i)) {
                                                        fprintf(stderr,
                                                                "install_engine: request %u layer "
                                                                "%u tensor %u block %u byte %llu "
                                                                "differs\n",
                                                                r, l, v, b, (unsigned long long)i);
                                                        goto out;
                                                }
                                }
                        }
        printf(
            "install_engine: %u requests over ipc, %u layers, every byte verified (kvferry %s)\n",
            n, layers, KVFERRY_VERSION);
        ret = 0;
out:
        if (pre)
                kvf_detach(pre);
        if (dec)
                kvf_detach(dec);
        return ret;
}

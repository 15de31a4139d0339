/*
 * The caller-declared sizes of kvferry.h's structs (docs/ARCHITECTURE.md,
 * section 2c), against real instances: a size below the ABI 1 struct is
 * refused with nothing written; a larger caller struct (a newer header) gets
 * what this library has and zeros after it; a task whose bytes past this
 * library's struct are not zero is refused (-E2BIG), with zeros it moves.
 * kvf_abi_info reports the library's sizes and refuses names it does not know.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "check.h"
#include "instances.h"
#include "kvferry.h"

#define PAD 64
#define CANARY 0xA5

static int all(const unsigned char *p, size_t n, unsigned char v)
{
        for (size_t i = 0; i < n; i++)
                if (p[i] != v)
                        return 0;
        return 1;
}

int main(void)
{
        char P[64], D[64];
        struct kvf_client *c;
        snprintf(P, sizeof(P), "as%d-p", (int)getpid());
        snprintf(D, sizeof(D), "as%d-d", (int)getpid());
        t_up(D, "--role decode --layers 2 --kv-heads 1 --head-dim 64 --blocks 16");
        t_up(P, "--role prefill --layers 2 --kv-heads 1 --head-dim 64 --blocks 16");
        CHECK_EQ(kvf_attach(P, 5000, &c), 0);

        CHECK_EQ(kvf_abi_info("abi"), KVFERRY_ABI);
        CHECK_EQ(kvf_abi_info("sizeof kvf_event"), (int64_t)sizeof(struct kvf_event));
        CHECK_EQ(kvf_abi_info("offsetof kvf_event.flags"), (int64_t)offsetof(struct kvf_event, flags));
        CHECK_EQ(kvf_abi_info("sizeof kvf_event.reason"), 240);
        CHECK_EQ(kvf_abi_info("KVF_STATUS_COUNT"), KVF_STATUS_COUNT);
        CHECK_EQ(kvf_abi_info("no such thing"), -ENOENT);
        CHECK(!strcmp(kvf_version(), KVFERRY_VERSION));

        /* Layout: too small, exact, larger. */
        _Alignas(struct kvf_event) unsigned char buf[sizeof(struct kvf_event) + PAD];
        struct kvf_layout_info li;
        CHECK_EQ(kvf_get_layout(c, &li), 0);
        memset(buf, CANARY, sizeof(buf));
        CHECK_EQ(kvf_get_layout_sized(c, (struct kvf_layout_info *)(void *)buf, 40), -EINVAL);
        CHECK(strstr(kvf_last_error(), "struct kvf_layout_info of 40 bytes") != NULL);
        CHECK(all(buf, sizeof(buf), CANARY));
        /* An engine built before the scale fields: the 48 bytes it knows, nothing after them. */
        CHECK_EQ(kvf_get_layout_sized(c, (struct kvf_layout_info *)(void *)buf, 48), 0);
        CHECK(!memcmp(buf, &li, 48));
        CHECK(all(buf + 48, sizeof(buf) - 48, CANARY));
        memset(buf, CANARY, sizeof(buf));
        CHECK_EQ(kvf_get_layout_sized(c, (struct kvf_layout_info *)(void *)buf, sizeof(li) + PAD / 2), 0);
        CHECK(!memcmp(buf, &li, sizeof(li)));
        CHECK(all(buf + sizeof(li), PAD / 2, 0));
        CHECK(all(buf + sizeof(li) + PAD / 2, sizeof(buf) - sizeof(li) - PAD / 2, CANARY));

        /* Events: too small is refused before anything is read. */
        CHECK_EQ(kvf_poll_sized(c, (struct kvf_event *)(void *)buf, 528, 0), -EINVAL);
        CHECK_EQ(kvf_poll_previous_sized(c, (struct kvf_event *)(void *)buf, 100), -EINVAL);

        /* Tasks: a newer header's task with a field this library does not know set, then zero. */
        uint32_t src[2] = {1, 2}, dst[2] = {3, 4};
        uint64_t step = kvf_last_step(c) + 1;
        struct {
                struct kvf_task t;
                uint64_t newer;
        } big = {.t = {.request_id = "sized", .src_block_ids = src, .n_src = 2, .dest_block_ids = dst,
                       .n_dest = 2, .current_id = step, .transport = KVF_TRANSPORT_IPC, .peer = D},
                 .newer = 7};
        CHECK_EQ(kvf_submit_task_sized(c, &big.t, sizeof(big)), -E2BIG);
        CHECK(strstr(kvf_last_error(), "does not know") != NULL);
        CHECK_EQ(kvf_submit_task_sized(c, &big.t, 60), -EINVAL);
        big.newer = 0;
        CHECK_EQ(kvf_submit_task_sized(c, &big.t, sizeof(big)), 0);
        for (uint32_t l = 0; l < 2; l++)
                CHECK_EQ(kvf_layer_done(c, step, l), 0);

        /* Its completion into a larger event: this library's fields, then zeros. */
        int got = 0;
        for (int i = 0; i < 100 && !got; i++) {
                memset(buf, CANARY, sizeof(buf));
                int rc = kvf_poll_sized(c, (struct kvf_event *)(void *)buf, sizeof(struct kvf_event) + PAD / 2, 100);
                CHECK(rc >= 0);
                if (rc == 0)
                        continue;
                struct kvf_event ev;
                memcpy(&ev, buf, sizeof(ev));
                CHECK_EQ(ev.type, KVF_EVENT_COMPLETION);
                CHECK(!strcmp(ev.request_id, "sized"));
                CHECK_EQ(ev.status, KVF_STATUS_FINISHED);
                CHECK(all(buf + sizeof(ev), PAD / 2, 0));
                CHECK(all(buf + sizeof(ev) + PAD / 2, PAD / 2, CANARY));
                got = 1;
        }
        CHECK(got);
        /* The engine's caches: a struct shorter than this library's is refused; an instance
         * of its own caches takes none. */
        struct kvf_registration reg = {0};
        CHECK_EQ(kvf_register_caches_sized(c, &reg, sizeof(reg) - 8), -EINVAL);
        CHECK_ERR_HAS("struct kvf_registration");
        CHECK_EQ(kvf_register_caches_sized(c, &reg, sizeof(reg)), -ENOTSUP);
        CHECK_ERR_HAS("--caches engine");
        kvf_detach(c);
        printf("abi_sizes_test: short sizes refused, longer ones zero-filled, unknown task fields refused\n");
        return 0;
}

/*
 * kvf-allocator: creates an instance's control segment and its caches,
 * publishes "ready", and keeps them alive while the engine and the other
 * roles map them. Kept trivially simple on purpose: on GPUs the caches die
 * with this process.
 *
 * Host backend: the caches are one file, in 2 MiB pages where they can be had
 * (cache.h says from where), reserved up front (fallocate) so a cache that
 * does not fit fails here, with a clear message, instead of as a SIGBUS in the
 * engine later.
 * CUDA backend: one device allocation on --device, its IPC handle in the
 * segment; it lives exactly as long as this process (so a restarted
 * allocator cannot adopt it: the instance must be started again).
 */
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "atomics.h"
#include "cache.h"
#include "cache_host_alloc.h"
#include "clock.h"
#include "kvferry.h"
#include "ctl.h"
#include "err.h"
#include "fastdeploy_publish.h"
#include "hugepages.h"
#include "layout.h"
#include "log.h"
#include "opts.h"
#include "registry.h"
#ifdef KVF_HAVE_CUDA
#include "kvf_gpu.h"
#endif

static const char *prog = "kvf-allocator";
static int stop; /* set by a signal (kvf_opt_signals): read with kvf_load_relaxed */

static void usage(void)
{
        printf("Usage: %s --instance NAME [options]\n"
               "Create the control segment and KV caches of one kvferry instance and keep them alive.\n\n"
               "  --instance NAME        instance name (letters, digits, _ - .)\n"
               "  --role ROLE            prefill, decode or mixed (default mixed)\n"
               "  --model NAME           take layers, kv heads, head dim, dtype from a known model:\n"
               "                         llama-3.1-8b, llama-3.1-70b, qwen2.5-72b, deepseek-v3-mla\n"
               "  --tp N                 tensor-parallel degree: this rank holds kv_heads/N heads (min 1)\n"
               "  --layers N             model layers\n"
               "  --extra-layers N       speculative-decoding (MTP) layers (default 0)\n"
               "  --kv-heads N           kv heads of this rank\n"
               "  --head-dim N           head dimension\n"
               "  --dtype T              bf16, fp16, fp8 or uint8 (default bf16)\n"
               "  --key-only             one tensor per layer (MLA)\n"
               "  --scale-dtype T        per-block scale tensors of T beside K and V, [blocks, kv heads,\n"
               "                         block size] each (FastDeploy's block_wise_fp8; default none)\n"
               "  --block-size N         tokens per block (default 64)\n"
               "  --blocks N             blocks per layer tensor\n"
               "  --cache-mib N          or: size the cache to N MiB and derive --blocks\n"
               "  --rank N, --nranks N   this instance's rank among its engine's ranks\n"
               "  --backend NAME         where the cache lives: host (default; a shared-memory file),\n"
               "                         cuda (GPU memory on --device), auto (cuda when a GPU is\n"
               "                         visible, else host), host-async (a test backend whose copies\n"
               "                         complete later)\n"
               "  --device N             the GPU this instance serves (cuda: where the cache lives,\n"
               "                         default 0); FastDeploy's ipc tasks name a same-host peer by\n"
               "                         it (device_ids). Default: none\n"
               "  --fastdeploy           cuda: one allocation per tensor, each published as FastDeploy's\n"
               "                         record (key_caches_{layer}_rank{rank}.device{device}) for its\n"
               "                         workers; removed when the allocator stops (docs/FASTDEPLOY.md)\n"
               "  --executor E           cuda: where same-host copies run: sender (the sender's own\n"
               "                         context; fast beside a busy engine only under MPS), engine\n"
               "                         (the engine's context, enqueued by kvf_layer_done_on_stream),\n"
               "                         auto (default: engine; sender with --fastdeploy)\n"
               "  --max-requests N       request table slots (default %u)\n"
               "  --max-blocks-per-request N  (default %u)\n"
               "  --ring-kib N           capacity of each ring in KiB, a power of two (default %u)\n"
               "  --heartbeat-ms N       heartbeat period of every role (default %u)\n"
               "  --huge-pages MODE      a host cache's pages: auto (2 MiB pages if they can be had, else\n"
               "                         4 KiB pages and the reason in the log), on (2 MiB pages or\n"
               "                         fail), off (4 KiB pages). Default auto: free pages of the\n"
               "                         pool there is. As root, on mounts hugetlbfs on /dev/hugepages\n"
               "                         if none is mounted and raises nr_hugepages by what the cache\n"
               "                         needs (never lowers it)\n"
               "  --caches MODE          own (default: the allocator makes the caches) or engine (the\n"
               "                         engine allocates them and registers them, kvf_register_caches;\n"
               "                         host memory; until then the instance refuses tasks)\n"
               "  --adopt                take over an existing segment whose allocator died\n"
               "  --help, --version\n",
               prog, KVF_DEFAULT_REQTAB_SLOTS, KVF_DEFAULT_MAX_BLOCKS,
               KVF_DEFAULT_RING_CAPACITY / 1024, KVF_DEFAULT_HEARTBEAT_MS);
}

/* Which pages the cache has, with one fixed prefix ("cache: "): `tools/kvferry up` shows
 * this line, so it is logged before the segment is published. */
static void log_cache(const struct kvf_ctl *ctl, uint8_t *cache)
{
        char what[KVF_CACHE_PATH_MAX + KVF_CACHE_NOTE_MAX + 64];
        int64_t huge_bytes = cache ? kvf_huge_mapped_bytes(cache) : -1;

        if (ctl->hdr->backend != KVF_BACKEND_HOST && ctl->hdr->backend != KVF_BACKEND_HOST_ASYNC)
                return;
        kvf_host_cache_describe(ctl->hdr, what, sizeof(what));
        kvf_info("cache: %s; mapped here with 2 MiB pages: %lld MiB", what,
                 (long long)(huge_bytes > 0 ? huge_bytes >> 20 : 0));
}

/* --NAME's dtype (kvf_dtype_from_name), or exit with the ones it takes. */
static uint32_t dtype_opt(const char *name, const char *takes, const char *arg)
{
        int d = kvf_dtype_from_name(arg);
        if (d < 0)
                kvf_opt_die(prog, "--%s is %s, not '%s'", name, takes, arg);
        return (uint32_t)d;
}

/* The cuda backend's parameters: the device, one IPC handle, where copies run. With
 * --fastdeploy (one allocation per tensor) copies run in the sender's context: the engine
 * executor's plans address one allocation. */
static int setup_cuda(struct kvf_ctl_params *p, const char *executor, bool fastdeploy)
{
        int n = kvf_cache_gpus();
        if (n <= 0)
                return kvf_err_ctx(-ENODEV, "--backend cuda");
        if (p->device == KVF_DEVICE_NONE)
                p->device = 0;
        if (p->device >= (uint32_t)n)
                return kvf_err_set(-ENODEV, "--device %u: only %d GPU%s visible (0 to %d)", p->device, n,
                                   n > 1 ? "s are" : " is", n - 1);
        p->cuda_handles = 1;
#ifdef KVF_HAVE_CUDA
        int mps = kvf_gpu_mps_enabled((int)p->device);
#else
        int mps = 0;
#endif
        if (fastdeploy && !strcmp(executor, "engine"))
                return kvf_err_set(-EINVAL, "--executor engine: with --fastdeploy (one allocation per tensor) "
                                   "copies run in the sender's context");
        if (!strcmp(executor, "sender") || fastdeploy)
                p->executor = KVF_EXEC_SENDER;
        else /* engine, and auto: the shorter tail with MPS or without (docs/GPU.md, "Choices") */
                p->executor = KVF_EXEC_ENGINE;
        if (p->executor == KVF_EXEC_SENDER && mps <= 0)
                kvf_warn("copies run in the sender's own context without MPS: while the engine computes, "
                         "each waits for a time slice (milliseconds); start MPS (tools/kvferry up --mps) "
                         "or use --executor engine");
        kvf_info("executor %s (%s): MPS is %s on GPU %u", p->executor == KVF_EXEC_ENGINE ? "engine" : "sender",
                 !strcmp(executor, "auto") ? "auto" : "chosen", mps > 0 ? "on" : "off", p->device);
        return 0;
}

int main(int argc, char **argv)
{
        enum { O_ROLE = 1000, O_MODEL, O_TP, O_LAYERS, O_EXTRA, O_HEADS, O_HDIM, O_DTYPE, O_KEYONLY,
               O_BSIZE, O_BLOCKS, O_MIB, O_RANK, O_NRANKS, O_DEVICE, O_MAXREQ, O_MAXBLK, O_RING, O_HB,
               O_ADOPT, O_HUGE, O_VERSION, O_BACKEND, O_EXECUTOR, O_FASTDEPLOY, O_CACHES, O_SCALE };
        static const struct option opts[] = {
                {"instance", required_argument, 0, 'i'},  {"role", required_argument, 0, O_ROLE},
                {"model", required_argument, 0, O_MODEL}, {"tp", required_argument, 0, O_TP},
                {"layers", required_argument, 0, O_LAYERS},
                {"extra-layers", required_argument, 0, O_EXTRA},
                {"kv-heads", required_argument, 0, O_HEADS},
                {"head-dim", required_argument, 0, O_HDIM}, {"dtype", required_argument, 0, O_DTYPE},
                {"key-only", no_argument, 0, O_KEYONLY},
                {"scale-dtype", required_argument, 0, O_SCALE},
                {"block-size", required_argument, 0, O_BSIZE},
                {"blocks", required_argument, 0, O_BLOCKS},
                {"cache-mib", required_argument, 0, O_MIB}, {"rank", required_argument, 0, O_RANK},
                {"nranks", required_argument, 0, O_NRANKS},
                {"device", required_argument, 0, O_DEVICE},
                {"backend", required_argument, 0, O_BACKEND},
                {"executor", required_argument, 0, O_EXECUTOR},
                {"max-requests", required_argument, 0, O_MAXREQ},
                {"max-blocks-per-request", required_argument, 0, O_MAXBLK},
                {"ring-kib", required_argument, 0, O_RING},
                {"heartbeat-ms", required_argument, 0, O_HB}, {"adopt", no_argument, 0, O_ADOPT},
                {"huge-pages", required_argument, 0, O_HUGE},
                {"fastdeploy", no_argument, 0, O_FASTDEPLOY},
                {"caches", required_argument, 0, O_CACHES},
                {"help", no_argument, 0, 'h'},            {"version", no_argument, 0, O_VERSION},
                {0, 0, 0, 0}};
        struct kvf_ctl_params p = {.backend = KVF_BACKEND_HOST, .instance_role = KVF_IROLE_MIXED,
                                   .nranks = 1, .device = KVF_DEVICE_NONE};
        uint32_t layers = 0, extra = 0, heads = 0, hdim = 0, dtype = KVF_DTYPE_BF16, key_only = 0, sdtype = 0;
        uint32_t bsize = 64, blocks = 0, tp = 1;
        uint64_t mib = 0;
        struct kvf_ctl ctl;
        int rc;
        bool adopt = false, backend_auto = false, fastdeploy = false, published = false, engine = false;
        const char *executor = "auto";
        enum kvf_huge_mode huge = KVF_HUGE_AUTO;
        uint8_t *cache = NULL;
        int c;

        while ((c = getopt_long(argc, argv, "i:h", opts, NULL)) != -1) {
                switch (c) {
                case 'i': p.instance = optarg; break;
                case O_ROLE:
                        if (!strcmp(optarg, "prefill"))
                                p.instance_role = KVF_IROLE_PREFILL;
                        else if (!strcmp(optarg, "decode"))
                                p.instance_role = KVF_IROLE_DECODE;
                        else if (!strcmp(optarg, "mixed"))
                                p.instance_role = KVF_IROLE_MIXED;
                        else
                                kvf_opt_die(prog, "--role is prefill, decode or mixed, not '%s'", optarg);
                        break;
                case O_MODEL: {
                        const struct kvf_model *m = kvf_model_find(optarg);
                        if (!m)
                                kvf_opt_die(prog, "unknown model '%s'", optarg);
                        layers = m->layers, heads = m->kv_heads, hdim = m->head_dim;
                        key_only = m->key_only, dtype = m->dtype;
                        break;
                }
                case O_TP: tp = (uint32_t)kvf_opt_u64("tp", optarg, 1, 1024); break;
                case O_LAYERS: layers = (uint32_t)kvf_opt_u64("layers", optarg, 1, KVF_MAX_LAYERS); break;
                case O_EXTRA: extra = (uint32_t)kvf_opt_u64("extra-layers", optarg, 0, KVF_MAX_LAYERS); break;
                case O_HEADS: heads = (uint32_t)kvf_opt_u64("kv-heads", optarg, 1, 65536); break;
                case O_HDIM: hdim = (uint32_t)kvf_opt_u64("head-dim", optarg, 1, 65536); break;
                case O_DTYPE: dtype = dtype_opt("dtype", "bf16, fp16, fp8 or uint8", optarg); break;
                case O_KEYONLY: key_only = 1; break;
                case O_SCALE: sdtype = dtype_opt("scale-dtype", "bf16, fp16, fp32, fp8 or uint8", optarg); break;
                case O_BSIZE: bsize = (uint32_t)kvf_opt_u64("block-size", optarg, 1, 65536); break;
                case O_BLOCKS: blocks = (uint32_t)kvf_opt_u64("blocks", optarg, 1, 1u << 30); break;
                case O_MIB: mib = kvf_opt_u64("cache-mib", optarg, 1, 1ull << 30); break;
                case O_RANK: p.rank = (uint32_t)kvf_opt_u64("rank", optarg, 0, 65535); break;
                case O_NRANKS: p.nranks = (uint32_t)kvf_opt_u64("nranks", optarg, 1, 65536); break;
                case O_DEVICE: p.device = (uint32_t)kvf_opt_u64("device", optarg, 0, 65535); break;
                case O_BACKEND: {
                        if (!strcmp(optarg, "auto")) {
                                backend_auto = true;
                                break;
                        }
                        backend_auto = false;
                        const struct kvf_cache_backend *be = kvf_cache_backend_named(optarg);
                        if (!be)
                                kvf_opt_die(prog, "--backend: %s", kvf_err_msg());
                        p.backend = be->id;
                        break;
                }
                case O_EXECUTOR:
                        if (strcmp(optarg, "auto") && strcmp(optarg, "sender") && strcmp(optarg, "engine"))
                                kvf_opt_die(prog, "--executor is sender, engine or auto, not '%s'", optarg);
                        executor = optarg;
                        break;
                case O_MAXREQ: p.reqtab_slots = (uint32_t)kvf_opt_u64("max-requests", optarg, 1, 65536); break;
                case O_MAXBLK: p.max_blocks = (uint32_t)kvf_opt_u64("max-blocks-per-request", optarg, 1, 1u << 20); break;
                case O_RING: {
                        uint64_t kib = kvf_opt_u64("ring-kib", optarg, 4, 1u << 20);
                        if (kib & (kib - 1))
                                kvf_opt_die(prog, "--ring-kib must be a power of two, not %llu",
                                            (unsigned long long)kib);
                        for (int i = 0; i < KVF_RING_COUNT; i++)
                                p.ring_capacity[i] = kib * 1024;
                        break;
                }
                case O_HB: p.heartbeat_ms = (uint32_t)kvf_opt_u64("heartbeat-ms", optarg, 1, 60000); break;
                case O_ADOPT: adopt = true; break;
                case O_FASTDEPLOY: fastdeploy = true; break;
                case O_CACHES:
                        if (!strcmp(optarg, "engine"))
                                engine = true;
                        else if (strcmp(optarg, "own"))
                                kvf_opt_die(prog, "--caches is own or engine, not '%s'", optarg);
                        break;
                case O_HUGE:
                        if (!strcmp(optarg, "auto"))
                                huge = KVF_HUGE_AUTO;
                        else if (!strcmp(optarg, "on"))
                                huge = KVF_HUGE_ON;
                        else if (!strcmp(optarg, "off"))
                                huge = KVF_HUGE_OFF;
                        else
                                kvf_opt_die(prog, "--huge-pages is auto, on or off, not '%s'", optarg);
                        break;
                case 'h': usage(); return 0;
                case O_VERSION: printf("%s %s\n", prog, KVFERRY_VERSION); return 0;
                default: kvf_opt_die(prog, "unknown option");
                }
        }
        if (optind < argc)
                kvf_opt_die(prog, "unexpected argument '%s'", argv[optind]);
        if (!p.instance)
                kvf_opt_die(prog, "--instance is required");
        if (kvf_instance_name_check(p.instance) < 0)
                kvf_opt_die(prog, "%s", kvf_err_msg());
        kvf_log_setup(p.instance, "allocator");
        kvf_opt_signals(&stop);
        if (backend_auto && !engine) {
                int n = kvf_cache_gpus();
                p.backend = n > 0 ? KVF_BACKEND_CUDA : KVF_BACKEND_HOST;
                if (n > 0)
                        kvf_info("backend auto: %d GPU%s visible: cuda (GPU %u)", n, n > 1 ? "s" : "",
                                 p.device == KVF_DEVICE_NONE ? 0 : p.device);
                else
                        kvf_info("backend auto: host (%s)", kvf_err_msg());
        }
        bool engine_gpu = false;
        if (engine) {
                /* (--backend auto, the supervisor's default, means the engine's host memory here;
                 * --backend cuda: the engine's GPU memory, registered as CUDA IPC handles) */
                engine_gpu = !backend_auto && p.backend == KVF_BACKEND_CUDA;
                if ((!backend_auto && p.backend != KVF_BACKEND_HOST && !engine_gpu) || fastdeploy)
                        kvf_opt_die(prog, "--caches engine: the engine's caches are host memory (--backend "
                                    "host or auto) or GPU memory (--backend cuda), and no --fastdeploy");
                if (sdtype)
                        kvf_opt_die(prog, "--caches engine: the engine registers its K/V tensors only; "
                                    "--scale-dtype is for kvferry's own caches");
                if (engine_gpu && kvf_cache_gpus() <= 0) {
                        kvf_error("--caches engine --backend cuda: %s", kvf_err_msg());
                        return 1;
                }
                if (engine_gpu && p.device == KVF_DEVICE_NONE)
                        p.device = 0;
                /* The engine's GPU caches: copies run in the sender's context unless the engine
                 * executor is asked for (kvf_layer_done_on_stream copies from the engine's own
                 * views into the peers' caches). */
                if (!strcmp(executor, "engine") && !engine_gpu)
                        kvf_opt_die(prog, "--executor engine runs copies in the engine's GPU context: the "
                                    "engine's caches must be GPU memory (--backend cuda); host caches are "
                                    "copied by the sender");
                p.executor = !strcmp(executor, "engine") ? KVF_EXEC_ENGINE
                                                        : engine_gpu ? KVF_EXEC_SENDER : KVF_EXEC_NONE;
                backend_auto = false;
                p.backend = KVF_BACKEND_ENGINE;
        }
        if (p.backend == KVF_BACKEND_ENGINE && !engine)
                kvf_opt_die(prog, "--backend engine: say --caches engine");
        if (p.backend == KVF_BACKEND_CUDA && (rc = setup_cuda(&p, executor, fastdeploy)) < 0) {
                kvf_error("%s", kvf_err_msg());
                return 1;
        }

        if (adopt && kvf_ctl_attach(p.instance, true, &ctl) == 0) {
                if (ctl.hdr->backend == KVF_BACKEND_CUDA) {
                        /* Its GPU memory died with the allocator that made it. */
                        kvf_error("cannot adopt instance %s: its cache was GPU memory of the allocator that "
                                  "died (pid %d); stop the instance and start it again",
                                  p.instance, ctl.roles[KVF_ROLE_ALLOCATOR].pid);
                        return 1;
                }
                if ((ctl.hdr->backend == KVF_BACKEND_HOST || ctl.hdr->backend == KVF_BACKEND_HOST_ASYNC) &&
                    (rc = kvf_host_cache_map_raw(ctl.hdr, false, &cache)) < 0) {
                        kvf_error("cannot adopt instance %s: %s", p.instance, kvf_err_msg());
                        return 1;
                }
                if (kvf_role_claim(&ctl, KVF_ROLE_ALLOCATOR) < 0) {
                        kvf_error("%s", kvf_err_msg());
                        return 1;
                }
                if (ctl.hdr->backend == KVF_BACKEND_ENGINE) {
                        /* The registration died with the allocator that held its descriptors:
                         * the engine registers again (the roles' mappings of it are stale now). */
                        if (kvf_load_acquire(&ctl.hdr->reg_generation) & 1) {
                                ctl.hdr->reg_pid = 0;
                                kvf_store_release(&ctl.hdr->reg_generation, ctl.hdr->reg_generation + 1);
                                kvf_warn("the engine's caches were registered with the allocator that died: "
                                         "the engine registers them again");
                        }
                        if (kvf_registry_start(&ctl) < 0) {
                                kvf_error("%s", kvf_err_msg());
                                return 1;
                        }
                }
                kvf_info("adopted existing instance (generation %llu)",
                         (unsigned long long)ctl.roles[KVF_ROLE_ALLOCATOR].generation);
                log_cache(&ctl, cache);
        } else {
                if (layers == 0 || heads == 0 || hdim == 0)
                        kvf_opt_die(prog, "give --model, or --layers, --kv-heads and --head-dim");
                heads = heads / tp ? heads / tp : 1;
                if (!blocks && mib) {
                        struct kvf_cache_layout one;
                        if (kvf_layout_make(&one, layers, extra, 1, heads, bsize, hdim, dtype, key_only) < 0 ||
                            kvf_layout_set_scales(&one, sdtype) < 0)
                                kvf_opt_die(prog, "%s", kvf_err_msg());
                        blocks = (uint32_t)((mib << 20) / one.cache_bytes);
                        if (!blocks)
                                kvf_opt_die(prog, "--cache-mib %llu holds no block of %llu bytes x %u layers",
                                            (unsigned long long)mib, (unsigned long long)one.block_bytes,
                                            kvf_layout_layers(&one));
                }
                if (!blocks)
                        kvf_opt_die(prog, "give --blocks or --cache-mib");
                if (kvf_layout_make(&p.layout, layers, extra, blocks, heads, bsize, hdim, dtype,
                                    key_only) < 0 ||
                    kvf_layout_set_scales(&p.layout, sdtype) < 0)
                        kvf_opt_die(prog, "%s", kvf_err_msg());
                if (fastdeploy && p.backend == KVF_BACKEND_CUDA)
                        p.cuda_handles = kvf_layout_parts(&p.layout);
                if ((rc = kvf_ctl_create(&p, &ctl)) < 0) {
                        kvf_error("%s", kvf_err_msg());
                        return 1;
                }
                ctl.hdr->reg_gpu = engine_gpu; /* (read by the engine backend's create) */
                if ((rc = kvf_cache_create(ctl.hdr, &(struct kvf_cache_opts){.huge_pages = (int)huge,
                                                                             .keep_map = &cache})) < 0) {
                        char seg[96];
                        kvf_error("%s", kvf_err_msg());
                        kvf_ctl_detach(&ctl);
                        /* Only the segment just made is ours to remove: a cache name that was
                         * there already may be another user's (and root could unlink it). */
                        kvf_ctl_shm_name(p.instance, seg, sizeof(seg));
                        shm_unlink(seg);
                        return 1;
                }
                if (fastdeploy && p.backend == KVF_BACKEND_CUDA) {
                        if ((rc = kvf_fd_publish(ctl.hdr)) < 0) {
                                char seg[96];
                                kvf_error("%s", kvf_err_msg());
                                kvf_fd_unpublish(ctl.hdr);
                                kvf_ctl_detach(&ctl);
                                kvf_ctl_shm_name(p.instance, seg, sizeof(seg));
                                shm_unlink(seg);
                                return 1;
                        }
                        published = true;
                        kvf_info("fastdeploy: %u tensors, one allocation each, published as "
                                 "key_caches_*_rank%u.device%u / value_caches_*", ctl.hdr->cuda_handles_count,
                                 p.rank, p.device);
                } else if (fastdeploy) {
                        kvf_info("fastdeploy: a %s cache is published by its messager "
                                 "(python3 -m kvferry.fastdeploy)", kvf_cache_backend(p.backend)->name);
                }
                if (p.backend == KVF_BACKEND_ENGINE && (rc = kvf_registry_start(&ctl)) < 0) {
                        char seg[96];
                        kvf_error("%s", kvf_err_msg());
                        kvf_ctl_detach(&ctl);
                        kvf_ctl_shm_name(p.instance, seg, sizeof(seg));
                        shm_unlink(seg);
                        return 1;
                }
                log_cache(&ctl, cache);
                kvf_role_begin(&ctl, KVF_ROLE_ALLOCATOR);
                kvf_ctl_publish(&ctl);
                char sz[32];
                const struct kvf_cache_layout *l = &ctl.hdr->layout;
                char where[96];
                if (p.backend == KVF_BACKEND_ENGINE)
                        snprintf(where, sizeof(where), "of the engine's caches (waiting for the engine to "
                                 "register them)");
                else if (p.backend == KVF_BACKEND_CUDA)
                        snprintf(where, sizeof(where), "GPU %u cache (copies in the %s's context)", p.device,
                                 p.executor == KVF_EXEC_ENGINE ? "engine" : "sender");
                else
                        snprintf(where, sizeof(where), "%s cache", kvf_cache_backend(p.backend)->name);
                char scales[96] = "";
                if (l->scale_bytes)
                        snprintf(scales, sizeof(scales), " + as many scale tensors of %llu-byte blocks (%s)",
                                 (unsigned long long)l->scale_bytes, kvf_dtype_name(l->scale_dtype));
                kvf_info("ready: %u+%u layers x %u tensors x %u blocks x %llu bytes%s = %s %s, "
                         "%u kv heads, block size %u, head dim %u, %s%s",
                         l->num_layers, l->extra_layers, kvf_layout_tensors(l), l->num_blocks,
                         (unsigned long long)l->block_bytes, scales,
                         kvf_fmt_bytes(l->cache_bytes, sz, sizeof(sz)), where, l->kv_heads, l->block_size,
                         l->head_dim, kvf_dtype_name(l->dtype), l->key_only ? ", key only" : "");
        }
        uint64_t beat = kvf_ms(ctl.hdr->heartbeat_ms);
        while (!kvf_load_relaxed(&stop)) {
                if (kvf_role_fenced(&ctl, KVF_ROLE_ALLOCATOR)) {
                        kvf_error("another allocator holds this instance now: exiting");
                        return 1;
                }
                kvf_role_heartbeat(&ctl, KVF_ROLE_ALLOCATOR);
                kvf_sleep_ns(beat / 2);
        }
        kvf_registry_stop();
        kvf_role_end(&ctl, KVF_ROLE_ALLOCATOR);
        kvf_info("stopping");
        if (published)
                kvf_fd_unpublish(ctl.hdr);
        if (cache)
                kvf_host_cache_unmap_raw(cache, ctl.hdr->layout.cache_bytes);
        kvf_ctl_detach(&ctl);
        return 0;
}

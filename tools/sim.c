/*
 * kvf-sim: an inference-engine simulator for both roles, so the whole
 * pipeline runs and is verified byte for byte without an engine.
 *
 * This file is main() and its options; sim.h says where the rest is: the
 * engine (sim_engine.c), the events and verification (sim_verify.c), the
 * report (sim_report.c), the session log (sim_sessions.c).
 */
#include <errno.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "opts.h"
#include "sim.h"
#include "sim_gpu.h" /* GPU mode */

static const char *prog = KVF_SIM_PROG;

static void split_list(const char *s, const char **out, unsigned *n)
{
        char *dup = strdup(s);
        *n = 0;
        for (char *save = NULL, *p = strtok_r(dup, ",", &save); p && *n < KVF_SIM_MAX_RANKS;
             p = strtok_r(NULL, ",", &save))
                out[(*n)++] = p;
}

/* One more --prefill or --decode: an instance whose ranks the commas name. */
static void add_instance(const char *opt, const char *arg, struct sim_inst_opts *side, unsigned *n,
                         unsigned *ranks)
{
        unsigned nr;
        if (*n == KVF_SIM_MAX_INSTANCES)
                kvf_opt_die(prog, "--%s: at most %u instances per side", opt, KVF_SIM_MAX_INSTANCES);
        split_list(arg, side[*n].name, &nr);
        if (!nr)
                kvf_opt_die(prog, "--%s wants an instance name (ranks separated by commas), not '%s'",
                            opt, arg);
        if (*ranks && nr != *ranks)
                kvf_opt_die(prog, "--%s %s: %u rank(s), but the %s instances before have %u: "
                            "every %s instance needs the same number of ranks", opt, arg, nr, opt,
                            *ranks, opt);
        *ranks = nr;
        (*n)++;
}

/* The default trace, from the source tree this binary was built from, else from data/ next to
 * the binary (a copy installed with it): a relative path would work from the repository's
 * root only. NULL, with a message, when neither has it. */
static const char *default_trace(void)
{
        static const char file[] = "mooncake-conversation-2000.jsonl";
        static char path[4200];
        char exe[4096] = "(unknown)";
        const char *src = "(not built from a source tree)";

#ifdef KVF_SOURCE_DIR
        src = KVF_SOURCE_DIR;
        snprintf(path, sizeof(path), "%s/data/%s", src, file);
        if (access(path, R_OK) == 0)
                return path;
#endif
        ssize_t n = readlink("/proc/self/exe", exe, sizeof(exe) - 1);
        if (n > 0) {
                exe[n] = '\0';
                char *slash = strrchr(exe, '/');
                if (slash)
                        *slash = '\0';
                snprintf(path, sizeof(path), "%s/data/%s", exe, file);
                if (access(path, R_OK) == 0)
                        return path;
        }
        fprintf(stderr, "%s: the default trace %s is neither in %s/data nor in %s/data; give --trace FILE\n",
                prog, file, src, exe);
        return NULL;
}

static void usage(void)
{
        printf("Usage: %s --prefill P0[,P1..] [--prefill ..] --decode D0[,D1..] [--decode ..] [options]\n"
               "Drive prefill and decode instances like inference engines and verify every byte.\n"
               "Commas name the ranks of one instance (a tensor-parallel group, one rank per name);\n"
               "each --prefill or --decode is another instance (at most %u per side, all with the same\n"
               "number of ranks on its side). Several prefill instances into one decode instance (fan-in): request i\n"
               "is prefilled by prefill instance i mod N, and the one decode engine hands out blocks for\n"
               "all of them. One prefill instance into several decode instances (fan-out): the prefill\n"
               "engine sends each request to the decode instance with the most free blocks when it is\n"
               "admitted (ties: the next in turn). The summary shows each instance and the aggregate.\n"
               "The two sides' groups may differ in size, heads per rank and block size (one dividing\n"
               "the other): each prefill rank then sends each decode rank the heads the split gives it\n"
               "(one task per pair, id r<N>.d<rank>), tokens regrouped into the decode side's blocks,\n"
               "and every head of every token is checked on every decode rank.\n\n"
               "  --prefill-tp N      the prefill instances' tensor-parallel size: N rank names each\n"
               "  --decode-tp N       the decode instances' (both default to the names given)\n"
               "  --requests N        requests to move (default 100)\n"
               "  --trace FILE        JSON lines with input_length (default data/mooncake-conversation-2000.jsonl\n"
               "                      of the source tree)\n"
               "  --max-tokens N      clip prompts to N tokens (default: what the caches allow)\n"
               "  --layer-us N        compute time per layer, microseconds (default 200)\n"
               "  --layer-ns-per-token N  and N ns more per layer for each token the step prefills, as a\n"
               "                      real engine's layer takes longer for more tokens (default 0: every step's\n"
               "                      layer takes --layer-us, however long its prompts)\n"
               "  --step-tokens N     tokens prefilled per forward step (default 16384)\n"
               "  --chunk-tokens N    chunked prefill: at most N tokens of a request per step (default off)\n"
               "  --prefix-pct P      P%% of requests hit a decode-side prefix (fewer dest blocks) (default 20)\n"
               "  --late-pct P        P%% of tasks arrive after their layers are done (default 10)\n"
               "  --cancel-pct P      P%% of requests are cancelled mid-step (default 0)\n"
               "  --transport T       ipc, tcp or rdma (default ipc)\n"
               "  --peer-map D=ADDR   name decode instance D in tasks as host:port ADDR (tcp, rdma across hosts)\n"
               "  --seed N            (default 1)\n"
               "  --timeout-s N       give up after N seconds without progress (default 60)\n"
               "  --baseline          also time one plain memcpy of the same number of bytes, for the ratio\n"
               "  --warm-caches       before the clock starts, touch every 4 KiB page of the caches through\n"
               "                      this process's mappings, as a long-running engine has (timed, reported)\n"
               "  --verify MODE       full (every byte, default) or sample (both ends of every block)\n"
               "  --scatter           hand out blocks in random order: no contiguous runs\n"
               "  --per-head          mixed mode's way even for equal groups: a task per rank pair and content\n"
               "                      per head and token, written and checked as for other splits (the\n"
               "                      like-for-like reference for them: the same simulator work per byte)\n"
               "  --json FILE         write the summary as JSON too\n"
               "  --session-log FILE  log submissions, completions, arrivals, and the events of earlier\n"
               "                      engine sessions (tools/sim_sessions.h; the fault test reads it)\n"
               "  --drain-previous-s N  at the end, keep taking earlier sessions' events until none came\n"
               "                      for N seconds (default 0)\n"
               "  --strict            fail unless every request finished, every byte verified (or ended\n"
               "                      'cancelled' after --cancel-pct cancelled it); the default with more than\n"
               "                      one instance per side. Without it a failed request that is accounted\n"
               "                      for fails nothing\n"
               "  --quiet             no progress line\n"
               "  --gpu               GPU mode: the caches must be on GPUs (--backend cuda); each layer is a kernel\n"
               "                      that writes the blocks and keeps every SM busy for --layer-us, signalled with\n"
               "                      kvf_layer_done_on_stream; arrivals are verified on the GPU. Chosen by itself\n"
               "                      when the instances' caches are on GPUs\n"
               "  --gpu-default-stream  GPU mode: the prefill engine's kernels and layer-done calls go on the legacy\n"
               "                      default stream (stream 0, PyTorch's current stream unless it made its own)\n"
               "                      instead of a non-blocking stream of its own\n"
               "  --timeline FILE     GPU mode: a line per step of the first prefill instance, times in ns from\n"
               "                      the run's start: step, requests, tokens, its last layer launched (host),\n"
               "                      that layer's end (GPU), a host function queued after it ran (CUDA's\n"
               "                      callback thread), the step's end seen by the engine\n"
               "  --check-options     check the options (and the trace's presence), run nothing\n"
               "Exit: 0 all requests accounted for and nothing corrupt (and, strict, all finished); 1\n"
               "otherwise; 2 usage.\n",
               prog, KVF_SIM_MAX_INSTANCES);
}

/* Fill o from the command line; exits 0 after --help or --version and 2 on a usage error.
 * True with --check-options. */
static bool parse_opts(int argc, char **argv, struct sim_opts *o)
{
        enum { O_P = 1000, O_D, O_N, O_TRACE, O_MAXTOK, O_LUS, O_STEP, O_CHUNK, O_PREFIX, O_LATE,
               O_CANCEL, O_TRANSPORT, O_SEED, O_TO, O_BASE, O_JSON, O_QUIET, O_VERSION, O_PEERMAP, O_VERIFY, O_SCATTER, O_PER_HEAD, O_CHECK, O_WARM,
               O_SLOG, O_DRAIN, O_GPU, O_STRICT, O_GPUDEF, O_LNPT, O_TIMELINE, O_PTP, O_DTP };
        static const struct option lo[] = {
                {"prefill", required_argument, 0, O_P},  {"decode", required_argument, 0, O_D},
                {"requests", required_argument, 0, O_N}, {"trace", required_argument, 0, O_TRACE},
                {"max-tokens", required_argument, 0, O_MAXTOK},
                {"layer-us", required_argument, 0, O_LUS},
                {"layer-ns-per-token", required_argument, 0, O_LNPT},
                {"step-tokens", required_argument, 0, O_STEP},
                {"chunk-tokens", required_argument, 0, O_CHUNK},
                {"prefix-pct", required_argument, 0, O_PREFIX},
                {"late-pct", required_argument, 0, O_LATE},
                {"cancel-pct", required_argument, 0, O_CANCEL},
                {"transport", required_argument, 0, O_TRANSPORT},
                {"peer-map", required_argument, 0, O_PEERMAP},
                {"verify", required_argument, 0, O_VERIFY},
                {"scatter", no_argument, 0, O_SCATTER},
                {"per-head", no_argument, 0, O_PER_HEAD},
                {"seed", required_argument, 0, O_SEED}, {"timeout-s", required_argument, 0, O_TO},
                {"baseline", no_argument, 0, O_BASE},    {"json", required_argument, 0, O_JSON},
                {"warm-caches", no_argument, 0, O_WARM},
                {"quiet", no_argument, 0, O_QUIET},      {"help", no_argument, 0, 'h'},
                {"check-options", no_argument, 0, O_CHECK},
                {"session-log", required_argument, 0, O_SLOG},
                {"drain-previous-s", required_argument, 0, O_DRAIN},
                {"gpu", no_argument, 0, O_GPU},
                {"gpu-default-stream", no_argument, 0, O_GPUDEF},
                {"timeline", required_argument, 0, O_TIMELINE},
                {"strict", no_argument, 0, O_STRICT},
                {"prefill-tp", required_argument, 0, O_PTP},
                {"decode-tp", required_argument, 0, O_DTP},
                {"version", no_argument, 0, O_VERSION},  {0, 0, 0, 0}};
        const char *peermap = NULL;
        bool check_only = false;
        int c;

        o->requests = 100;
        o->layer_us = 200;
        o->step_tokens = 16384;
        o->prefix_pct = 20;
        o->late_pct = 10;
        o->transport = KVF_TRANSPORT_IPC;
        o->seed = 1;
        o->timeout_s = 60;
        while ((c = getopt_long(argc, argv, "h", lo, NULL)) != -1) {
                switch (c) {
                case O_P: add_instance("prefill", optarg, o->prefill, &o->nprefill, &o->ranks); break;
                case O_D: add_instance("decode", optarg, o->decode, &o->ndecode, &o->dranks); break;
                case O_PTP: o->prefill_tp = (unsigned)kvf_opt_u64("prefill-tp", optarg, 1, KVF_SIM_MAX_RANKS); break;
                case O_DTP: o->decode_tp = (unsigned)kvf_opt_u64("decode-tp", optarg, 1, KVF_SIM_MAX_RANKS); break;
                case O_N: o->requests = (unsigned)kvf_opt_u64("requests", optarg, 1, 10000000); break;
                case O_TRACE: o->trace = optarg; break;
                case O_MAXTOK: o->max_tokens = (unsigned)kvf_opt_u64("max-tokens", optarg, 1, 1u << 30); break;
                case O_LUS: o->layer_us = (unsigned)kvf_opt_u64("layer-us", optarg, 0, 10000000); break;
                case O_LNPT: o->layer_ns_per_token = kvf_opt_u64("layer-ns-per-token", optarg, 0, 1000000); break;
                case O_STEP: o->step_tokens = (unsigned)kvf_opt_u64("step-tokens", optarg, 1, 1u << 30); break;
                case O_CHUNK: o->chunk_tokens = (unsigned)kvf_opt_u64("chunk-tokens", optarg, 1, 1u << 30); break;
                case O_PREFIX: o->prefix_pct = (unsigned)kvf_opt_u64("prefix-pct", optarg, 0, 100); break;
                case O_LATE: o->late_pct = (unsigned)kvf_opt_u64("late-pct", optarg, 0, 100); break;
                case O_CANCEL: o->cancel_pct = (unsigned)kvf_opt_u64("cancel-pct", optarg, 0, 100); break;
                case O_TRANSPORT:
                        if (!strcmp(optarg, "ipc"))
                                o->transport = KVF_TRANSPORT_IPC;
                        else if (!strcmp(optarg, "tcp"))
                                o->transport = KVF_TRANSPORT_TCP;
                        else if (!strcmp(optarg, "rdma"))
                                o->transport = KVF_TRANSPORT_RDMA;
                        else
                                kvf_opt_die(prog, "--transport is ipc, tcp or rdma");
                        break;
                case O_SEED: o->seed = kvf_opt_u64("seed", optarg, 0, UINT64_MAX); break;
                case O_PEERMAP: peermap = optarg; break;
                case O_SCATTER: o->scatter = true; break;
                case O_PER_HEAD: o->per_head = true; break;
                case O_VERIFY:
                        if (strcmp(optarg, "full") && strcmp(optarg, "sample"))
                                kvf_opt_die(prog, "--verify is full or sample");
                        o->sample_only = !strcmp(optarg, "sample");
                        break;
                case O_TO: o->timeout_s = (unsigned)kvf_opt_u64("timeout-s", optarg, 1, 86400); break;
                case O_BASE: o->baseline = true; break;
                case O_WARM: o->warm_caches = true; break;
                case O_JSON: o->json = optarg; break;
                case O_QUIET: o->quiet = true; break;
                case O_CHECK: check_only = true; break;
                case O_SLOG: o->session_log = optarg; break;
                case O_DRAIN: o->drain_previous_s = (unsigned)kvf_opt_u64("drain-previous-s", optarg, 0, 3600); break;
                case O_GPU: o->gpu = true; break;
                case O_GPUDEF: o->gpu_default_stream = true; break;
                case O_TIMELINE: o->timeline = optarg; break;
                case O_STRICT: o->strict = true; break;
                case 'h': usage(); exit(0);
                case O_VERSION: printf("%s %s\n", prog, KVFERRY_VERSION); exit(0);
                default: kvf_opt_die(prog, "unknown option");
                }
        }
        if (!o->nprefill || !o->ndecode)
                kvf_opt_die(prog, "give --prefill and --decode (each once per instance)");
        if (o->prefill_tp && o->prefill_tp != o->ranks)
                kvf_opt_die(prog, "--prefill-tp %u: the prefill instance %s names %u rank(s); give "
                            "%u names separated by commas", o->prefill_tp, o->prefill[0].name[0],
                            o->ranks, o->prefill_tp);
        if (o->decode_tp && o->decode_tp != o->dranks)
                kvf_opt_die(prog, "--decode-tp %u: the decode instance %s names %u rank(s); give "
                            "%u names separated by commas", o->decode_tp, o->decode[0].name[0],
                            o->dranks, o->decode_tp);
        if (o->session_log && (o->nprefill > 1 || o->ndecode > 1))
                kvf_opt_die(prog, "--session-log takes one prefill and one decode instance");
        for (unsigned i = 0; i < o->ndecode; i++)
                for (unsigned k = 0; k < o->dranks; k++)
                        o->decode[i].peer[k] = o->decode[i].name[k];
        if (peermap) {
                const char *m[KVF_SIM_MAX_RANKS];
                unsigned nm;
                split_list(peermap, m, &nm);
                for (unsigned i = 0; i < nm; i++) {
                        char *eq = strchr(m[i], '=');
                        if (!eq)
                                kvf_opt_die(prog, "--peer-map wants DECODE=HOST:PORT, not '%s'", m[i]);
                        *eq = '\0';
                        for (unsigned d = 0; d < o->ndecode; d++)
                                for (unsigned k = 0; k < o->dranks; k++)
                                        if (!strcmp(o->decode[d].name[k], m[i]))
                                                o->decode[d].peer[k] = eq + 1;
                }
        }
        return check_only;
}

/* GPU mode: when asked, or when the caches are on GPUs (the CPU cannot touch them). 0, or -1
 * after a message. */
static int gpu_setup(struct sim *s)
{
        int pdev[KVF_SIM_MAX_RANKS], ddev[KVF_SIM_MAX_RANKS], ngpu = 0;
        for (unsigned i = 0; i < s->npre + s->ndec; i++)
                for (unsigned k = 0; k < (i < s->npre ? s->o.ranks : s->o.dranks); k++) {
                        const struct sim_inst *in = i < s->npre ? &s->pre[i] : &s->dec[i - s->npre];
                        int dev = kvf_cache_device(kvf_group_member(in->g, k));
                        ngpu += dev >= 0;
                        if (i == 0)
                                pdev[k] = dev;
                        else if (i == s->npre)
                                ddev[k] = dev;
                }
        if ((s->o.gpu || ngpu) && (s->npre > 1 || s->ndec > 1)) {
                fprintf(stderr, "%s: %s runs one prefill and one decode instance, not %u and %u\n",
                        prog, s->o.gpu ? "--gpu" : "GPU mode (the caches are on GPUs)", s->npre,
                        s->ndec);
                return -1;
        }
        if ((s->o.gpu || ngpu) && ngpu != (int)(s->o.ranks + s->o.dranks)) {
                fprintf(stderr,
                        "%s: %s: every instance's cache must be on a GPU (start them with "
                        "--backend cuda)\n",
                        prog, s->o.gpu ? "--gpu" : "GPU mode");
                return -1;
        }
        if (ngpu && sim_gpu_open(&s->sg, s->o.ranks, s->o.dranks, pdev, ddev, s->o.layer_us,
                                 s->o.gpu_default_stream, !!s->o.timeline) < 0)
                return -1;
        if (s->sg && !s->o.quiet)
                fprintf(stderr, "%s: GPU mode: prefill on GPU %d, decode on GPU %d\n", prog, pdev[0],
                        ddev[0]);
        return 0;
}

int main(int argc, char **argv)
{
        static struct sim s; /* (its histogram is large) */
        struct sim_opts *o = &s.o;
        bool ok;

        bool check_only = parse_opts(argc, argv, o);
        if (!o->trace && !(o->trace = default_trace()))
                return 1;
        if (check_only) {
                if (access(o->trace, R_OK) == 0)
                        return 0;
                fprintf(stderr, "%s: trace %s: %s\n", prog, o->trace, strerror(errno));
                return 1;
        }
        if (kvf_sim_setup(&s) < 0)
                return 1;
        if (gpu_setup(&s) < 0) {
                kvf_sim_free(&s);
                return 1;
        }
        kvf_sim_report_start(&s);
        ok = kvf_sim_run(&s) == 0 && kvf_sim_report(&s);
        sim_gpu_close(s.sg); /* (its streams are synchronised before the clients detach) */
        s.sg = NULL;
        kvf_sim_free(&s);
        return ok ? 0 : 1;
}


/*
 * kvf-ctl: small operations on an instance's control segment for the
 * supervisor script and for operators.
 *
 *   kvf-ctl wait-ready --instance NAME [--roles allocator,connector,sender] [--timeout-ms N]
 *   kvf-ctl unlink --instance NAME [--force]
 *   kvf-ctl alive --instance NAME --role ROLE
 *   kvf-ctl gpus      (how many GPUs this build sees: tests skip on 0; --backend auto decides so)
 *
 * Exit codes: 0 yes/done, 1 no/failed (message on stderr), 2 usage.
 */
#include <errno.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cache.h"
#include "clock.h"
#include "ctl.h"
#include "err.h"
#include "kvferry.h"
#include "opts.h"

static const char *prog = "kvf-ctl";

static void usage(void)
{
        printf("Usage:\n"
               "  %s wait-ready --instance NAME [--roles allocator,connector,sender] [--timeout-ms N] [--pid P]\n"
               "      wait until the segment is ready and the listed roles are alive (held by pid P)\n"
               "  %s unlink --instance NAME [--force]\n"
               "      remove the instance's shared memory (refused while a role is alive, unless --force)\n"
               "  %s alive --instance NAME --role ROLE\n"
               "      exit 0 if the role is alive\n"
               "  %s gpus\n"
               "      print how many GPUs are visible to this build (0 without CUDA or a driver; stderr\n"
               "      says why), exit 0\n",
               prog, prog, prog, prog);
}

static int role_id(const char *name)
{
        for (int r = 0; r < KVF_ROLE_COUNT; r++)
                if (!strcmp(kvf_role_name(r), name))
                        return r;
        return -1;
}

static int want_pid; /* --pid: the role must be held by this process */

static int wait_ready(const char *inst, const char *roles, unsigned timeout_ms)
{
        uint64_t end = kvf_now_ns() + kvf_ms(timeout_ms);
        struct kvf_ctl c;
        int rc = kvf_ctl_attach_wait(inst, false, timeout_ms, &c);
        if (rc < 0) {
                fprintf(stderr, "%s: %s\n", prog, kvf_err_msg());
                return 1;
        }
        char buf[128];
        snprintf(buf, sizeof(buf), "%s", roles);
        for (char *save = NULL, *r = strtok_r(buf, ",", &save); r; r = strtok_r(NULL, ",", &save)) {
                int id = role_id(r);
                if (id < 0) {
                        fprintf(stderr, "%s: unknown role '%s'\n", prog, r);
                        kvf_ctl_detach(&c);
                        return 2;
                }
                for (;;) {
                        bool ok = kvf_role_alive(&c, (enum kvf_role_id)id, kvf_now_ns()) &&
                                  (!want_pid || c.roles[id].pid == want_pid);
                        if (ok && id == KVF_ROLE_CONNECTOR) {
                                char host[64];
                                uint32_t port;
                                ok = kvf_connector_info_read(&c, host, sizeof(host), &port) == 0 &&
                                     c.roles[id].state == KVF_STATE_RUNNING;
                        }
                        if (ok)
                                break;
                        if (kvf_now_ns() > end) {
                                fprintf(stderr, "%s: instance '%s': the %s is not running after %u ms\n",
                                        prog, inst, r, timeout_ms);
                                kvf_ctl_detach(&c);
                                return 1;
                        }
                        kvf_sleep_ns(10000000);
                }
        }
        kvf_ctl_detach(&c);
        return 0;
}

int main(int argc, char **argv)
{
        static const struct option opts[] = {{"instance", required_argument, 0, 'i'},
                                             {"roles", required_argument, 0, 'r'},
                                             {"role", required_argument, 0, 'R'},
                                             {"timeout-ms", required_argument, 0, 't'},
                                             {"force", no_argument, 0, 'f'},
                                             {"pid", required_argument, 0, 'p'},
                                             {"help", no_argument, 0, 'h'},
                                             {"version", no_argument, 0, 'V'},
                                             {0, 0, 0, 0}};
        const char *inst = NULL, *roles = "allocator", *role = NULL;
        unsigned timeout_ms = 10000;
        bool force = false;
        int c;

        if (argc < 2 || !strcmp(argv[1], "--help") || !strcmp(argv[1], "-h")) {
                usage();
                return argc < 2 ? 2 : 0;
        }
        if (!strcmp(argv[1], "--version")) {
                printf("%s %s\n", prog, KVFERRY_VERSION);
                return 0;
        }
        const char *cmd = argv[1];
        if (strcmp(cmd, "wait-ready") && strcmp(cmd, "unlink") && strcmp(cmd, "alive") &&
            strcmp(cmd, "gpus")) {
                fprintf(stderr, "%s: unknown command '%s'; the commands are wait-ready, unlink, alive and gpus (%s --help)\n",
                        prog, cmd, prog);
                return 2;
        }
        if (!strcmp(cmd, "gpus")) {
                int n = kvf_cache_gpus();
                if (n <= 0)
                        fprintf(stderr, "%s: %s\n", prog, kvf_err_msg());
                printf("%d\n", n);
                return 0;
        }
        optind = 2;
        while ((c = getopt_long(argc, argv, "h", opts, NULL)) != -1) {
                switch (c) {
                case 'i': inst = optarg; break;
                case 'r': roles = optarg; break;
                case 'R': role = optarg; break;
                case 't': timeout_ms = (unsigned)kvf_opt_u64("timeout-ms", optarg, 0, 3600000); break;
                case 'f': force = true; break;
                case 'p': want_pid = (int)kvf_opt_u64("pid", optarg, 1, 1u << 30); break;
                case 'h': usage(); return 0;
                case 'V': printf("%s %s\n", prog, KVFERRY_VERSION); return 0;
                default: kvf_opt_die(prog, "unknown option");
                }
        }
        if (!inst)
                kvf_opt_die(prog, "--instance is required");
        if (kvf_instance_name_check(inst) < 0)
                kvf_opt_die(prog, "%s", kvf_err_msg());
        if (!strcmp(cmd, "wait-ready"))
                return wait_ready(inst, roles, timeout_ms);
        if (!strcmp(cmd, "alive")) {
                struct kvf_ctl ctl;
                int id = role ? role_id(role) : -1;
                if (id < 0)
                        kvf_opt_die(prog, "--role is allocator, connector, sender or engine");
                if (kvf_ctl_attach(inst, false, &ctl) < 0)
                        return 1;
                bool ok = kvf_role_alive(&ctl, (enum kvf_role_id)id, kvf_now_ns());
                kvf_ctl_detach(&ctl);
                return ok ? 0 : 1;
        }
        if (!strcmp(cmd, "unlink")) {
                struct kvf_ctl ctl;
                if (!force && kvf_ctl_attach(inst, false, &ctl) == 0) {
                        for (int r = 0; r < KVF_ROLE_COUNT; r++)
                                if (r != KVF_ROLE_ENGINE && kvf_role_alive(&ctl, (enum kvf_role_id)r, kvf_now_ns())) {
                                        fprintf(stderr, "%s: instance '%s' still has a live %s (pid %d); stop it first or use --force\n",
                                                prog, inst, kvf_role_name(r), ctl.roles[r].pid);
                                        kvf_ctl_detach(&ctl);
                                        return 1;
                                }
                        kvf_ctl_detach(&ctl);
                }
                return kvf_ctl_unlink(inst) == 0 ? 0 : 1;
        }
        kvf_opt_die(prog, "unknown command '%s'", cmd);
}

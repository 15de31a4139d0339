/*
 * kvf-bench-peers: what the connector of a prefill instance costs for N
 * outgoing peers: its threads and its private memory (RssAnon), at most,
 * while tcp tasks to N distinct peers are pending, until every one has
 * completed (they all fail: the peers cannot be reached, or accept and never
 * answer). bench/peers_bench.sh runs it for 1 and for 1000 peers of each
 * kind, each against a fresh instance, and prints the ratios.
 *
 * Usage: kvf-bench-peers --instance NAME --peers N --addr PREFIX:PORT
 *   peer i is PREFIX.<i/200>.<1+i%200>:PORT (PREFIX: two octets, e.g. 127.1)
 * Prints one line: peers, threads, RssAnon KiB and open descriptors, each
 * before and at most, then completions and seconds.
 */
#include <dirent.h>
#include <errno.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "clock.h"
#include "ctl.h"
#include "err.h"
#include "kvferry.h"

static long status_field(int pid, const char *field)
{
        char path[64], line[256];
        snprintf(path, sizeof(path), "/proc/%d/status", pid);
        FILE *f = fopen(path, "r");
        long v = -1;
        size_t fl = strlen(field);
        if (!f)
                return -1;
        while (fgets(line, sizeof(line), f))
                if (!strncmp(line, field, fl) && line[fl] == ':') {
                        v = strtol(line + fl + 1, NULL, 10);
                        break;
                }
        fclose(f);
        return v;
}

static long fds_of(int pid)
{
        char path[64];
        snprintf(path, sizeof(path), "/proc/%d/fd", pid);
        DIR *d = opendir(path);
        long n = 0;
        if (!d)
                return -1;
        for (struct dirent *e; (e = readdir(d));)
                n += e->d_name[0] != '.';
        closedir(d);
        return n;
}

int main(int argc, char **argv)
{
        static const struct option opts[] = {{"instance", required_argument, 0, 'i'},
                                             {"peers", required_argument, 0, 'n'},
                                             {"addr", required_argument, 0, 'a'},
                                             {"help", no_argument, 0, 'h'},
                                             {0, 0, 0, 0}};
        const char *inst = NULL, *addr = NULL;
        int n = 0, c;
        while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
                switch (c) {
                case 'i': inst = optarg; break;
                case 'n': n = atoi(optarg); break;
                case 'a': addr = optarg; break;
                case 'h':
                        printf("Usage: kvf-bench-peers --instance NAME --peers N --addr PREFIX:PORT\n");
                        return 0;
                default: return 2;
                }
        }
        const char *colon = addr ? strchr(addr, ':') : NULL;
        if (!inst || n < 1 || n > 40000 || !colon) {
                fprintf(stderr, "kvf-bench-peers: --instance, --peers (1..40000) and --addr PREFIX:PORT are required\n");
                return 2;
        }
        struct kvf_ctl ctl;
        if (kvf_ctl_attach(inst, false, &ctl) < 0) {
                fprintf(stderr, "kvf-bench-peers: instance '%s': %s\n", inst, kvf_err_msg());
                return 1;
        }
        int pid = ctl.roles[KVF_ROLE_CONNECTOR].pid;
        kvf_ctl_detach(&ctl);
        struct kvf_client *cl;
        if (kvf_attach(inst, 5000, &cl) < 0) {
                fprintf(stderr, "kvf-bench-peers: attach: %s\n", kvf_err_msg());
                return 1;
        }
        struct kvf_layout_info L;
        kvf_get_layout(cl, &L);
        long th0 = status_field(pid, "Threads"), rss0 = status_field(pid, "RssAnon");
        long fd0 = fds_of(pid), thmax = th0, rssmax = rss0, fdmax = fd0;
        uint64_t t0 = kvf_now_ns(), step = kvf_last_step(cl) + 1;
        for (int i = 0; i < n; i++) {
                char id[32], peer[96];
                snprintf(id, sizeof(id), "b%d", i);
                snprintf(peer, sizeof(peer), "%.*s.%d.%d%s", (int)(colon - addr), addr, i / 200, 1 + i % 200,
                         colon);
                uint32_t blk = (uint32_t)(i % L.num_blocks);
                struct kvf_task t = {.request_id = id, .src_block_ids = &blk, .n_src = 1,
                                     .dest_block_ids = &blk, .n_dest = 1, .current_id = step,
                                     .transport = KVF_TRANSPORT_TCP, .peer = peer};
                int rc;
                while ((rc = kvf_submit_task(cl, &t)) == -EAGAIN)
                        usleep(1000);
                if (rc < 0) {
                        fprintf(stderr, "kvf-bench-peers: submit: %s\n", kvf_err_msg());
                        return 1;
                }
        }
        for (uint32_t l = 0; l < L.num_layers; l++)
                kvf_layer_done(cl, step, l);
        int got = 0;
        uint64_t end = t0 + 120000000000ull;
        while (got < n && kvf_now_ns() < end) {
                long th = status_field(pid, "Threads"), rss = status_field(pid, "RssAnon");
                thmax = th > thmax ? th : thmax;
                rssmax = rss > rssmax ? rss : rssmax;
                long fds = fds_of(pid);
                fdmax = fds > fdmax ? fds : fdmax;
                struct kvf_event ev;
                while (kvf_poll(cl, &ev, 20) == 1)
                        got += ev.type == KVF_EVENT_COMPLETION;
        }
        printf("peers %d threads %ld -> %ld rss_anon_kib %ld -> %ld fds %ld -> %ld completed %d seconds %.1f\n",
               n, th0, thmax, rss0, rssmax, fd0, fdmax, got, (double)(kvf_now_ns() - t0) / 1e9);
        kvf_detach(cl);
        return got == n ? 0 : 1;
}

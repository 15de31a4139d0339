/*
 * kvf-connector: the network side of an instance (see connector.h).
 * This file holds the options, the control thread and its event queue.
 */
#include <errno.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "atomics.h"
#include "clock.h"
#include "connector.h"
#include "doorbell.h"
#include "err.h"
#include "kvferry.h"
#include "log.h"
#include "opts.h"
#include "landing.h"
#include "sched_slice.h"
#include "transport.h"
#include "xfer.h"

static const char *prog = "kvf-connector";
static int stop; /* set by a signal (kvf_opt_signals): read with kvf_load_relaxed */

static void usage(void)
{
        printf("Usage: %s --instance NAME [options]\n"
               "Run the connector of a kvferry instance (started by tools/kvferry up).\n\n"
               "  --instance NAME          the instance (its allocator must be running)\n"
               "  --listen HOST:PORT       where peers connect (default 127.0.0.1:0 = any free port)\n"
               "  --token-file PATH        shared secret of the peers (default $KVFERRY_TOKEN_FILE,\n"
               "                           else ~/.config/kvferry/token)\n"
               "  --connect-timeout-ms N   a connect, and each step of a handshake; an incoming\n"
               "                           connection has twice this to prove the token (default 2000)\n"
               "  --keepalive-ms N         ping a quiet peer this often (default 500)\n"
               "  --peer-timeout-ms N      a peer silent or unreachable this long is dead (default 5000)\n"
               "  --streams N              tcp data connections per peer (default 2)\n"
               "  --peer-idle-ms N         close a peer without work for this long (default 60000)\n"
               "  --peer-threads N         threads for every outgoing peer's control connection (default 2)\n"
               "  --handshake-threads N    threads running outgoing handshakes (default 2)\n"
               "  --max-sessions N         incoming connections served at once, handshakes included;\n"
               "                           more are closed at once and counted (default 1024)\n"
               "  --zerocopy               send data frames with zero-copy sends (io_uring send_zc)\n"
               "  --rdma-device NAME       the rdma device (its interface's address); default: the device\n"
               "                           of the listen address (decode), of the route (prefill)\n"
               "  --rdma-sq-depth N        rdma work requests outstanding per peer (default 256)\n"
               "  --rdma-signal-every N    one rdma work request signalled in N (default 32)\n"
               "  --rdma-ack-timeout N     wait 4.096 us x 2^N for an rdma ACK before resending\n"
               "                           (1..31; default: rdma_cm's own, about 0.5 s on RoCE)\n"
               "  --rdma-test-dereg        tests only: SIGUSR2 deregisters every peer's rdma region\n"
               KVF_SLICE_USAGE
               "  --help, --version\n",
               prog);
}

/* A finish, abort or withdraw notice from the sender: hand it to the peer. */
static void on_finish(struct connector *cn, struct kvf_record *f)
{
        char why[KVF_REASON_MAX];
        struct peer *p = conn_peer_get(cn, f->peer, why, sizeof(why));
        struct notice *n = p ? calloc(1, sizeof(*n)) : NULL;
        struct kvf_record w = *f;
        size_t len;
        bool aborting = f->status != KVF_STATUS_FINISHED && !f->withdraw;

        if (!n) {
                if (p)
                        snprintf(why, sizeof(why), "the connector is out of memory");
                if (!aborting) /* nobody waits for an abort notice */
                        conn_post_write_result(cn, f->key, f->request_id, f->id_bin, KVF_STATUS_CONNECTION, why);
                kvf_errlog(&cn->ctl, KVF_ROLE_CONNECTOR, "req %s: notice for '%s' dropped: %s",
                           f->request_id, f->peer, why);
                return;
        }
        /* The incarnation of the peer its blocks were reserved in: the notice goes to no other. */
        uint64_t gen = conn_transport_of(f->transport) ? conn_xfer_gen(p, f->key) : 0;
        /* An abort: stop sending the transfer's blocks now (the notice fences off, on
         * the decode side, those already in flight). */
        if (aborting && conn_transport_of(f->transport))
                conn_xfer_forget(p, f->key);
        if (!aborting && !f->withdraw && conn_transport_of(f->transport)) {
                /* Its fate is the notice's from now on; unless this connector failed it
                 * already (its data path, the peer timeout) and told the sender so before
                 * this notice was read: then the peer hears of that failure instead, as an
                 * abort, and publishes the same status. */
                int st = conn_xfer_noticed(p, f->key, w.reason, sizeof(w.reason));
                if (st != KVF_STATUS_FINISHED) {
                        w.status = st;
                        aborting = true;
                }
        }
        /* On the wire the notice names its source, not its destination. */
        w.type = KVF_RT_NOTICE;
        snprintf(w.peer, sizeof(w.peer), "%s", cn->ctl.hdr->instance);
        if (kvf_record_encode_alloc(&w, &n->frame, &len) < 0) {
                free(n);
                if (!aborting)
                        conn_post_write_result(cn, f->key, f->request_id, f->id_bin, KVF_STATUS_CONNECTION,
                                          "the connector could not encode the finish notice");
                kvf_errlog(&cn->ctl, KVF_ROLE_CONNECTOR, "req %s: could not encode its notice",
                           f->request_id);
                return;
        }
        n->len = (uint32_t)len;
        n->key = f->key;
        n->abort_notice = aborting;
        n->peer_gen = gen;
        n->withdraw = f->withdraw;
        n->first_ns = kvf_now_ns();
        snprintf(n->request_id, sizeof(n->request_id), "%s", f->request_id);
        n->id_bin = f->id_bin;
        if (f->withdraw) {
                conn_peer_withdraw(p, n);
        } else {
                conn_peer_enqueue(p, n);
        }
}

static int on_sender_record(void *ctx, uint16_t type, const uint8_t *pl, uint32_t len, uint64_t pos)
{
        struct connector *cn = ctx;
        struct kvf_record r;
        int rc = 0;
        (void)pos;
        bool known = type == KVF_RT_FINISH || type == KVF_RT_OPEN || type == KVF_RT_WRITE_BATCH;
        if (!known || kvf_record_decode(type, pl, len, 0, &r) < 0) {
                kvf_count(&cn->ctl, KVF_CTR_BAD_RECORDS, 1);
                kvf_errlog(&cn->ctl, KVF_ROLE_CONNECTOR, "bad %s record from the sender: %s",
                           kvf_rec_type_name(type), known ? kvf_err_msg() : "unexpected type");
                if (known)
                        kvf_record_free(&r);
                return 0;
        }
        switch (type) {
        case KVF_RT_FINISH:
                on_finish(cn, &r);
                break;
        case KVF_RT_OPEN: {
                char why[KVF_REASON_MAX];
                int status = KVF_STATUS_CONNECTION;
                struct peer *p = conn_peer_get(cn, r.peer, why, sizeof(why));
                if (!p || conn_xfer_open(p, &r, &status, why, sizeof(why)) < 0)
                        conn_post_write_result(cn, r.key, r.request_id, r.id_bin, status, why);
                else
                        conn_peer_kick(p); /* its control connection carries the notice later */
                break;
        }
        case KVF_RT_WRITE_BATCH: {
                char why[KVF_REASON_MAX];
                struct peer *p = conn_peer_get(cn, r.peer, why, sizeof(why));
                rc = p ? conn_xfer_batch(p, &r) : -ENOMEM;
                if (rc == -EAGAIN) {
                        /* back-pressure: leave it in the ring until the queue drains */
                        kvf_store_release(&cn->tx_blocked, 1);
                        break;
                }
                if (rc == -ENOENT)
                        rc = 0; /* the transfer failed already; its result went out */
                else if (rc < 0) {
                        conn_post_write_result(cn, r.key, r.request_id, r.id_bin, KVF_STATUS_WRITE,
                                               "the connector could not queue a write batch");
                        rc = 0;
                }
                break;
        }
        }
        kvf_record_free(&r);
        return rc;
}

static int on_engine_record(void *ctx, uint16_t type, const uint8_t *pl, uint32_t len, uint64_t pos)
{
        struct connector *cn = ctx;
        struct kvf_ring *in = &cn->ctl.rings[KVF_RING_ENGINE_TO_CONNECTOR];
        struct kvf_record r;
        struct connect_wait w = {
                .session = kvf_gen_from16(kvf_load_acquire(&cn->ctl.roles[KVF_ROLE_ENGINE].generation),
                                          kvf_ring_record_gen(in, pos))};

        if (type != KVF_RT_CONNECT && type != KVF_RT_DISCONNECT) {
                kvf_count(&cn->ctl, KVF_CTR_BAD_RECORDS, 1);
                kvf_errlog(&cn->ctl, KVF_ROLE_CONNECTOR,
                           "record type %u (%s) does not belong on ring engine->connector: dropped", type,
                           kvf_rec_type_name(type));
                return 0;
        }
        if (kvf_record_decode(type, pl, len, cn->ctl.hdr->rank, &r) < 0) {
                char why[KVF_ERR_MAX];
                snprintf(why, sizeof(why), "%s", kvf_err_msg());
                kvf_count(&cn->ctl, KVF_CTR_BAD_RECORDS, 1);
                if (type == KVF_RT_CONNECT) { /* answer a malformed connect task, if it had an id */
                        if (!r.request_id[0])
                                snprintf(r.request_id, sizeof(r.request_id), "<unknown>");
                        w.task_id = r.request_id;
                        w.id_bin = r.id_bin;
                        conn_post_connect_result(cn, &w, NULL, KVF_STATUS_BAD_TASK, why);
                }
                kvf_errlog(&cn->ctl, KVF_ROLE_CONNECTOR, "bad %s record from the engine: %s",
                           kvf_rec_type_name(type), why);
                kvf_record_free(&r);
                return 0;
        }
        if (type == KVF_RT_CONNECT) {
                char why[KVF_REASON_MAX];
                w.task_id = r.request_id;
                w.id_bin = r.id_bin;
                struct peer *p = conn_peer_get(cn, r.peer, why, sizeof(why));
                if (p)
                        conn_peer_connect_task(p, &w);
                else
                        conn_post_connect_result(cn, &w, r.peer, KVF_STATUS_CONNECTION, why);
        }
        /* DISCONNECT: peers are closed when the connector stops or after --peer-idle-ms
         * without work; an idle connection costs one ping per keepalive period. */
        kvf_record_free(&r);
        return 0;
}

static bool has_work(void *arg)
{
        struct connector *cn = arg;
        /* (also what the thread runs while it polls: a notice expected is rehearsed meanwhile) */
        conn_notices_rehearse(cn);
        /* A write batch held back by a full send queue is no work until the data
         * threads make room (they ring us), or we would spin on it. */
        return kvf_load_acquire(&cn->nevents) > 0 ||
               kvf_load_acquire(&cn->ctl.roles[KVF_ROLE_ENGINE].generation) != cn->eng_gen_seen ||
               (!kvf_load_acquire(&cn->tx_blocked) &&
                kvf_ring_readable(&cn->ctl.rings[KVF_RING_SENDER_TO_CONNECTOR])) ||
               kvf_ring_readable(&cn->ctl.rings[KVF_RING_ENGINE_TO_CONNECTOR]) ||
               (!cn->notices_blocked && conn_notices_readable(cn));
}

static void control_loop(struct connector *cn)
{
        uint64_t beat = kvf_ms(cn->ctl.hdr->heartbeat_ms);
        uint64_t next = 0;
        while (!kvf_load_relaxed(&stop)) {
                bool worked = false;
                /* A decode engine attached: bind new transfers to it from now on. */
                uint64_t eg = kvf_load_acquire(&cn->ctl.roles[KVF_ROLE_ENGINE].generation);
                if (eg != cn->eng_gen_seen) {
                        cn->eng_gen_seen = eg;
                        conn_engine_check(cn);
                }
                /* Retried at least every millisecond while blocked (the wait below). */
                kvf_store_release(&cn->tx_blocked, 0);
                /* Each batch's records are rung for as it ends (kvf_bells_ring), so that an
                 * arrival waits for nothing but the notices read with it. */
                int n = kvf_ring_read(&cn->ctl.rings[KVF_RING_SENDER_TO_CONNECTOR], on_sender_record, cn, 256);
                worked |= n > 0;
                n = kvf_ring_read(&cn->ctl.rings[KVF_RING_ENGINE_TO_CONNECTOR], on_engine_record, cn, 64);
                worked |= n > 0;
                kvf_bells_ring(&cn->bells);
                worked |= conn_notices_read(cn);
                kvf_bells_ring(&cn->bells);
                if (kvf_load_acquire(&cn->nevents) > 0 || cn->deferred) {
                        conn_events_run(cn);
                        worked = true;
                }
                uint64_t now = kvf_now_ns();
                if (now >= next) {
                        if (kvf_role_fenced(&cn->ctl, KVF_ROLE_CONNECTOR)) {
                                kvf_error("another connector (pid %d) holds this instance now: exiting",
                                          cn->ctl.roles[KVF_ROLE_CONNECTOR].pid);
                                _exit(1);
                        }
                        kvf_role_heartbeat(&cn->ctl, KVF_ROLE_CONNECTOR);
                        conn_engine_check(cn);
                        /* The engine's caches: a dropped registration's memory is let go within
                         * a heartbeat, not only at the next transfer (the staged copies' lock). */
                        if (kvf_cache_refresh(&cn->cache) < 0)
                                kvf_errlog(&cn->ctl, KVF_ROLE_CONNECTOR, "the engine's caches: %s", kvf_err_msg());
                        conn_peers_tick(cn, now);
                        kvf_log_flush(); /* suppressed lines of every thread, once their window is over */
                        /* A transfer whose sender went silent for a long while is not coming. */
                        conn_landing_expire(cn, LANDING_OPEN_MAX_NS, LANDING_CLOSED_KEEP_NS);
                        next = now + beat;
                }
                kvf_bells_ring(&cn->bells);
                if (worked && !cn->deferred && !kvf_load_acquire(&cn->tx_blocked) && !cn->notices_blocked)
                        continue;
                kvf_count(&cn->ctl, KVF_CTR_WAKEUPS_CONNECTOR, 1);
                uint64_t wait = cn->deferred || kvf_load_acquire(&cn->tx_blocked) || cn->notices_blocked ? kvf_ms(1) : beat;
                kvf_doorbell_wait(&cn->ctl.bells[KVF_BELL_CONNECTOR], has_work, cn, 256, wait);
        }
}

/* The transports read (prefill) and write (decode) the instance's own cache. A cache
 * this connector cannot map is a failure at start, never a connector without a cache. */
static int map_cache(struct connector *cn)
{
        return kvf_cache_map(cn->ctl.hdr, true, &cn->cache);
}

int main(int argc, char **argv)
{
        /* Before any thread exists, where it costs nothing (doorbell.h). */
        (void)kvf_doorbell_register();
        enum { O_LISTEN = 1000, O_TOKEN, O_CTO, O_KEEP, O_PTO, O_STREAMS, O_ZC, O_VERSION, O_IDLE,
               O_RDEV, O_RSQ, O_RSIG, O_RACK, O_RDEREG, O_SLICE, O_PTHREADS, O_HSTHREADS,
               O_MAXSESS };
        static const struct option opts[] = {{"instance", required_argument, 0, 'i'},
                                             {"listen", required_argument, 0, O_LISTEN},
                                             {"token-file", required_argument, 0, O_TOKEN},
                                             {"connect-timeout-ms", required_argument, 0, O_CTO},
                                             {"keepalive-ms", required_argument, 0, O_KEEP},
                                             {"peer-timeout-ms", required_argument, 0, O_PTO},
                                             {"streams", required_argument, 0, O_STREAMS},
                                             {"peer-idle-ms", required_argument, 0, O_IDLE},
                                             {"peer-threads", required_argument, 0, O_PTHREADS},
                                             {"handshake-threads", required_argument, 0, O_HSTHREADS},
                                             {"max-sessions", required_argument, 0, O_MAXSESS},
                                             {"zerocopy", no_argument, 0, O_ZC},
                                             {"rdma-device", required_argument, 0, O_RDEV},
                                             {"rdma-sq-depth", required_argument, 0, O_RSQ},
                                             {"rdma-signal-every", required_argument, 0, O_RSIG},
                                             {"rdma-ack-timeout", required_argument, 0, O_RACK},
                                             {"rdma-test-dereg", no_argument, 0, O_RDEREG},
                                             {"slice-us", required_argument, 0, O_SLICE},
                                             {"help", no_argument, 0, 'h'},
                                             {"version", no_argument, 0, O_VERSION},
                                             {0, 0, 0, 0}};
        static struct connector cn;
        const char *instance = NULL, *listen_at = "127.0.0.1:0";
        char token_path[512];
        uint32_t slice_us = KVF_SLICE_US_DEFAULT;
        int c;

        kvf_token_default_path(token_path, sizeof(token_path));
        cn.cfg.connect_timeout_ms = 2000;
        cn.cfg.keepalive_ms = 500;
        cn.cfg.peer_timeout_ms = 5000;
        cn.cfg.tcp.streams = 2;
        cn.cfg.peer_idle_ms = 60000;
        cn.cfg.peer_threads = 2;
        cn.cfg.handshake_threads = 2;
        cn.cfg.max_sessions = CONN_MAX_SESSIONS_DEFAULT;
        cn.cfg.rdma.sq_depth = 256;
        cn.cfg.rdma.signal_every = 32;
        while ((c = getopt_long(argc, argv, "i:h", opts, NULL)) != -1) {
                switch (c) {
                case 'i': instance = optarg; break;
                case O_LISTEN: listen_at = optarg; break;
                case O_TOKEN: snprintf(token_path, sizeof(token_path), "%s", optarg); break;
                case O_CTO: cn.cfg.connect_timeout_ms = (unsigned)kvf_opt_u64("connect-timeout-ms", optarg, 1, 600000); break;
                case O_KEEP: cn.cfg.keepalive_ms = (unsigned)kvf_opt_u64("keepalive-ms", optarg, 1, 600000); break;
                case O_PTO: cn.cfg.peer_timeout_ms = (unsigned)kvf_opt_u64("peer-timeout-ms", optarg, 10, 3600000); break;
                case O_STREAMS: cn.cfg.tcp.streams = (unsigned)kvf_opt_u64("streams", optarg, 1, 16); break;
                case O_ZC: cn.cfg.tcp.zerocopy = true; break;
                case O_RDEV:
                        if (strlen(optarg) >= sizeof(cn.cfg.rdma.device))
                                kvf_opt_die(prog, "--rdma-device: name too long");
                        snprintf(cn.cfg.rdma.device, sizeof(cn.cfg.rdma.device), "%s", optarg);
                        break;
                case O_RSQ: cn.cfg.rdma.sq_depth = (unsigned)kvf_opt_u64("rdma-sq-depth", optarg, 2, 65536); break;
                case O_RSIG: cn.cfg.rdma.signal_every = (unsigned)kvf_opt_u64("rdma-signal-every", optarg, 1, 65536); break;
                case O_RACK: cn.cfg.rdma.ack_timeout = (unsigned)kvf_opt_u64("rdma-ack-timeout", optarg, 1, 31); break;
                case O_RDEREG: cn.cfg.rdma.test_dereg = true; break;
                case O_SLICE: slice_us = kvf_sched_slice_opt(prog, optarg); break;
                case O_IDLE: cn.cfg.peer_idle_ms = (unsigned)kvf_opt_u64("peer-idle-ms", optarg, 100, 86400000); break;
                case O_PTHREADS: cn.cfg.peer_threads = (unsigned)kvf_opt_u64("peer-threads", optarg, 1, 16); break;
                case O_HSTHREADS: cn.cfg.handshake_threads = (unsigned)kvf_opt_u64("handshake-threads", optarg, 1, 16); break;
                case O_MAXSESS: cn.cfg.max_sessions = (unsigned)kvf_opt_u64("max-sessions", optarg, 1, 65536); break;
                case 'h': usage(); return 0;
                case O_VERSION: printf("%s %s\n", prog, KVFERRY_VERSION); return 0;
                default: kvf_opt_die(prog, "unknown option");
                }
        }
#ifndef KVF_HAVE_RDMA
        if (cn.cfg.rdma.device[0])
                kvf_opt_die(prog, "--rdma-device %s: this connector is built without rdma", cn.cfg.rdma.device);
#endif
        if (!instance)
                kvf_opt_die(prog, "--instance is required");
        if (kvf_net_parse(listen_at, cn.cfg.listen_host, sizeof(cn.cfg.listen_host), &cn.cfg.listen_port) < 0)
                kvf_opt_die(prog, "--listen: %s", kvf_err_msg());
        kvf_log_setup(instance, "connector");
        kvf_opt_signals(&stop);
        slice_us = kvf_sched_slice_start(slice_us); /* before any thread: they inherit it */
        if (kvf_token_load(token_path, cn.cfg.token, &cn.cfg.token_len) < 0) {
                kvf_error("%s", kvf_err_msg());
                return 1;
        }
        if (kvf_ctl_attach_wait(instance, true, 10000, &cn.ctl) < 0) {
                kvf_error("%s", kvf_err_msg());
                return 1;
        }
        if (conn_evq_init(&cn, 0) < 0) {
                kvf_error("cannot set up the event queue");
                return 1;
        }
        pthread_mutex_init(&cn.smu, NULL);
        pthread_condattr_t ca;
        pthread_condattr_init(&ca);
        pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
        pthread_cond_init(&cn.threads_cv, &ca);
        pthread_condattr_destroy(&ca);
        pthread_mutex_init(&cn.rxmu, NULL);
        if (map_cache(&cn) < 0) {
                kvf_error("%s", kvf_err_msg());
                return 1;
        }
        int64_t gen = kvf_role_claim(&cn.ctl, KVF_ROLE_CONNECTOR);
        if (gen < 0) {
                kvf_error("%s", kvf_err_msg());
                return 1;
        }
        cn.gen = (uint64_t)gen;
        kvf_store_relaxed(&cn.ctl.roles[KVF_ROLE_CONNECTOR].slice_us, slice_us);
        /* The peer gauges count this connector's peers: a predecessor's went with it. */
        kvf_store_relaxed(&cn.ctl.counters[KVF_CTR_PEERS_CONNECTED].value, 0);
        kvf_store_relaxed(&cn.ctl.counters[KVF_CTR_PEERS_CONNECTING].value, 0);
        kvf_store_relaxed(&cn.ctl.counters[KVF_CTR_PEERS_FAILED].value, 0);
        conn_journal_init(&cn);
        if (conn_notices_init(&cn) < 0) {
                kvf_error("%s", kvf_err_msg());
                kvf_role_end(&cn.ctl, KVF_ROLE_CONNECTOR);
                return 1;
        }
        if (conn_transports_init(&cn) < 0) {
                kvf_error("%s", kvf_err_msg());
                kvf_role_end(&cn.ctl, KVF_ROLE_CONNECTOR);
                return 1;
        }
        if (conn_peers_start(&cn) < 0) {
                kvf_error("%s", kvf_err_msg());
                kvf_role_end(&cn.ctl, KVF_ROLE_CONNECTOR);
                return 1;
        }
        uint16_t port;
        cn.listen_fd = kvf_net_listen(cn.cfg.listen_host, cn.cfg.listen_port, 128, &port);
        if (cn.listen_fd < 0) {
                kvf_error("%s", kvf_err_msg());
                kvf_role_end(&cn.ctl, KVF_ROLE_CONNECTOR);
                return 1;
        }
        kvf_connector_info_write(&cn.ctl, cn.cfg.listen_host, port);
        struct kvf_unix_listener ul;
        cn.unix_fd = kvf_net_listen_unix(cn.ctl.hdr->instance, &ul);
        if (cn.unix_fd < 0)
                kvf_warn("%s: same-host peers will connect over tcp", kvf_err_msg());
        pthread_t listener;
        if (pthread_create(&listener, NULL, conn_listener_main, &cn) != 0) {
                kvf_error("cannot start the listener thread");
                return 1;
        }
        kvf_info("listening on %s:%u%s (generation %llu)", cn.cfg.listen_host, port,
                 cn.unix_fd >= 0 ? " and on a unix socket for same-host peers" : "",
                 (unsigned long long)cn.gen);
        control_loop(&cn);
        kvf_info("stopping");
        kvf_store_release(&cn.stop, 1);
        pthread_join(listener, NULL);
        /* Session threads use the segment and the peers: they end first. */
        bool sessions_ended = conn_sessions_stop(&cn, STOP_WAIT_MS);
        if (!sessions_ended)
                kvf_warn("a session thread did not end within %u ms of the stop: exiting with the "
                         "control segment still mapped", STOP_WAIT_MS);
        conn_peers_stop(&cn);
        conn_transports_fini(&cn);
        close(cn.listen_fd);
        kvf_net_close_unix(&ul);
        kvf_role_end(&cn.ctl, KVF_ROLE_CONNECTOR);
        if (sessions_ended)
                kvf_ctl_detach(&cn.ctl);
        return 0;
}

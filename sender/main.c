/*
 * kvf-sender: the process that turns layer-done events into copies and
 * writes (see sender.h). One thread, one loop:
 *   progress word -> engine records -> connector records -> pending posts
 *   -> housekeeping every heartbeat -> sleep on the doorbell when idle.
 */
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <unistd.h>

#include "atomics.h"
#include "clock.h"
#include "cpus.h"
#include "doorbell.h"
#include "err.h"
#include "kvferry.h"
#include "layout.h"
#include "log.h"
#include "opts.h"
#include "sched_slice.h"
#include "sender.h"
#ifdef KVF_HAVE_CUDA
#include "kvf_gpu.h"
#endif

static const char *prog = "kvf-sender";

#define EXPECT_MAX_GAP 20000000ull /* ns: slower than this is not a pace worth polling for */
#define EXPECT_LEAD 300000ull      /* ns: wake this long before the next layer is due */
static int stop; /* set by a signal (kvf_opt_signals): read with kvf_load_relaxed */

static void usage(void)
{
        printf("Usage: %s --instance NAME [options]\n"
               "Run the sender of a kvferry instance (started by tools/kvferry up).\n\n"
               "  --instance NAME           the instance (its allocator must be running)\n"
               "  --request-timeout-ms N    fail a request not finished N ms after its task (default 60000)\n"
               "  --spin-us N               busy-wait this long for work before sleeping (default 50)\n"
               "  --notice-rings            same-host (ipc) finish notices go straight into a notice slot\n"
               "                            of the decode instance's segment, answered there, instead of\n"
               "                            through both connectors (the default)\n"
               "  --no-notice-rings         same-host finish notices go through both connectors' sockets\n"
               "  --notice-prewake MODE     on, off or auto (on from 4 CPUs, and 2 per rank): wake a same-host\n"
               "                            decode connector while a request's last copies run (default auto)\n"
               "  --stop-drain-ms N         on SIGTERM or SIGINT (tools/kvferry down): refuse new tasks, give the\n"
               "                            requests in flight up to N ms to finish, then end those left with a\n"
               "                            completion saying so (0 to %u, default %u)\n"
               "  --layer-wait MODE         while requests wait for the engine's layers: spin (poll without\n"
               "                            sleeping until 20 ms pass without a layer or a new task), paced\n"
               "                            (sleep, waking ahead of the engine's pace), or auto (default):\n"
               "                            spin, for same-host requests, while holding one of the host's\n"
               "                            spin seats, one per 2 CPUs\n"
               "                            (its affinity, or a cgroup's CPU quota) shared by this user's\n"
               "                            senders ($KVFERRY_SPIN_SEATS, default /dev/shm/kvferry-spin-UID),\n"
               "                            else paced\n"
               KVF_SLICE_USAGE
               "  --help, --version\n",
               prog, SENDER_STOP_DRAIN_MS_MAX, SENDER_STOP_DRAIN_MS_DEFAULT);
}

static bool has_work(void *arg)
{
        struct sender *s = arg;
        /* A task held back (table full, or no room for its rejection) is no work
         * until a slot is freed; the loop also retries it every millisecond. */
        uint64_t w = kvf_load_acquire(&s->ctl.progress->word);
        /* A word queued on the engine's GPU stream and not yet written (no doorbell comes
         * with it): work to wait for by polling (run()). */
        return w != s->progress || kvf_load_relaxed(&s->ctl.progress->enqueued) > w ||
               kvf_load_acquire(&s->ctl.roles[KVF_ROLE_ENGINE].generation) != s->engine_gen_seen ||
               (s->session && kvf_load_acquire(&s->ctl.roles[KVF_ROLE_ENGINE].state) == KVF_STATE_STOPPED) ||
               (!s->engine_blocked && kvf_ring_readable(&s->ctl.rings[KVF_RING_ENGINE_TO_SENDER])) ||
               kvf_ring_readable(&s->ctl.rings[KVF_RING_CONNECTOR_TO_SENDER]) ||
               (s->notice_rings && sender_replies_readable(s));
}

/* Where this instance's GPU copies run, and whether that is fast beside a busy engine. */
static void log_gpu(struct sender *s)
{
        if (s->ctl.hdr->executor == KVF_EXEC_ENGINE) {
                kvf_info("GPU %d: same-host copies run in the engine's context (executor engine), enqueued by "
                         "kvf_layer_done_on_stream; the sender copies what the engine did not take",
                         s->own.device);
                return;
        }
#ifdef KVF_HAVE_CUDA
        int mps = kvf_gpu_mps_enabled(s->own.device);
#else
        int mps = 0;
#endif
        if (mps > 0)
                kvf_info("GPU %d: same-host copies run in the sender's context, under MPS", s->own.device);
        else
                kvf_warn("GPU %d: same-host copies run in the sender's context without MPS: while the engine "
                         "computes, each copy waits for a time slice (milliseconds); start MPS "
                         "(tools/kvferry up --mps) or use --executor engine",
                         s->own.device);
}

/*
 * The engine's pace (see idle_wait): layer events come steadily within a step, with
 * longer gaps now and then (a step's end, a slow layer). The last PACE_GAPS gaps between
 * publish times are kept; the next event is expected no sooner than the shortest of them
 * but one, and polled for until the longest (at most twice the shortest). An average
 * would put the wake-up late after every long gap: late by 300 us, a sleeping sender's
 * copy starts a wake-up later.
 */
#define PACE_GAPS 8
struct pace {
        uint64_t last_event, poll_until;
        uint64_t gaps[PACE_GAPS];
        unsigned ngaps;       /* gaps kept so far (the ring's next is ngaps % PACE_GAPS) */
        uint64_t seen_ns;     /* --layer-wait spin: when this process saw the last layer, */
        uint64_t waiting_ns;  /* when a task came or the set of awaited steps changed last, */
        uint64_t tasks;       /* and the tasks accepted, */
        uint32_t nbuckets;    /* and the awaited steps then */
};

static void pace_event(struct pace *pc, uint64_t at)
{
        if (pc->last_event && at > pc->last_event && at - pc->last_event < EXPECT_MAX_GAP)
                pc->gaps[pc->ngaps++ % PACE_GAPS] = at - pc->last_event;
        if (at > pc->last_event)
                pc->last_event = at;
}

/* The window to poll in after the last event: [last + *lo, last + *hi). false: no pace yet. */
static bool pace_window(const struct pace *pc, uint64_t *lo, uint64_t *hi)
{
        unsigned n = pc->ngaps < PACE_GAPS ? pc->ngaps : PACE_GAPS;
        if (n < 2)
                return false;
        uint64_t min1 = UINT64_MAX, min2 = UINT64_MAX, max = 0;
        for (unsigned i = 0; i < n; i++) {
                uint64_t g = pc->gaps[i];
                if (g < min1) {
                        min2 = min1;
                        min1 = g;
                } else if (g < min2) {
                        min2 = g;
                }
                max = g > max ? g : max;
        }
        /* one odd short gap (two words close together) does not make the sender spin */
        *lo = min2;
        *hi = max + min2 / 8 < 2 * min2 ? max + min2 / 8 : 2 * min2;
        return true;
}

/* An engine attached or detached: end its predecessors' requests now (its kvf_attach waits). */
static bool check_engine(struct sender *s)
{
        uint64_t eg = kvf_load_acquire(&s->ctl.roles[KVF_ROLE_ENGINE].generation);
        if (eg == s->engine_gen_seen &&
            !(s->session && kvf_load_acquire(&s->ctl.roles[KVF_ROLE_ENGINE].state) == KVF_STATE_STOPPED))
                return false;
        s->engine_gen_seen = eg;
        sender_sessions_check(s, true);
        return true;
}

/* A new progress word: move what it makes ready, then post the notices it made possible. */
static bool handle_progress(struct sender *s, struct pace *pc)
{
        /* Pairs with the engine's release CAS: its cache writes for the layers in
         * this word are visible. */
        uint64_t w = kvf_load_acquire(&s->ctl.progress->word);
        if (w == s->progress)
                return false;
        uint64_t pub = kvf_load_relaxed(&s->ctl.progress->publish_ns);
        uint64_t t = kvf_now_ns();
        /* Written by the GPU (kvf_layer_done_on_stream's stream write): nobody stored a
         * publish time; the nearest we know is now. */
        if (kvf_load_relaxed(&s->ctl.progress->enqueued) >= w)
                pub = t;
        pace_event(pc, pub < t ? pub : t); /* (an engine's clock is ours: never later than now) */
        uint64_t lo, hi;
        bool paced = pace_window(pc, &lo, &hi);
        s->layer_gap_ns = paced ? hi : 0; /* (progress.c's early prewake) */
        s->layer_gap_lo_ns = paced ? lo : 0;
        s->layer_event_ns = pc->last_event;
        pc->seen_ns = t;
        /* After the word's acquire load: an engine's generation is stored before its
         * first layer-done, so a word of a new engine session is never applied to
         * requests of the one before (sessions.c). */
        sender_sessions_check(s, false);
        /* Its copies as one batch, then the finish notices it made possible, before new
         * tasks are read (request.c). */
        sender_req_progress(s, w, pub);
        return true;
}

/* Layer-done words the engine queued on its GPU stream to be written there: no doorbell
 * rings when they land, so poll until they have. */
static bool stream_words_due(struct sender *s)
{
        return kvf_load_relaxed(&s->ctl.progress->enqueued) >
               kvf_load_relaxed(&s->ctl.progress->word);
}

/*
 * --layer-wait spin: requests wait for layers, and a layer or a new task came in the last
 * EXPECT_MAX_GAP: poll until then. A sleeping sender gives up its CPU: the scheduler
 * places the engine's and the other roles' threads there, and the woken sender then
 * waits for them (milliseconds when they run out a default slice, as measured).
 * A polling one keeps its CPU, and the others go to the other CPUs.
 */
static bool spin_for_layers(struct sender *s, struct pace *pc, uint64_t now)
{
        if (!s->nbuckets) {
                pc->nbuckets = 0;
                return false;
        }
        uint64_t tasks = kvf_load_relaxed(&s->ctl.counters[KVF_CTR_TASKS_ACCEPTED].value);
        if (s->nbuckets != pc->nbuckets || tasks != pc->tasks) {
                pc->nbuckets = s->nbuckets;
                pc->tasks = tasks;
                pc->waiting_ns = now;
        }
        /* Our own clock, not the engine's publish times: an engine whose clock lagged could
         * otherwise end the spinning early, and one that ran ahead prolong it. */
        uint64_t from = pc->seen_ns > pc->waiting_ns ? pc->seen_ns : pc->waiting_ns;
        if (now >= from + EXPECT_MAX_GAP)
                return false;
        pc->poll_until = from + EXPECT_MAX_GAP;
        return true;
}

/* --layer-wait auto: same-host requests wait for layers (their bytes are this sender's to copy;
 * over tcp and rdma the connector moves them, and a spinning sender would only take its CPU) and
 * no spin seat is held: take a free one (one try per SENDER_SEAT_RETRY_NS at most, so that a host
 * whose seats are all held costs each of its seatless senders a few system calls a period, not a
 * few a layer). */
static void seat_want(struct sender *s, uint64_t now)
{
        if (!s->seat_auto || s->seat.held || !s->armed_copies || now - s->seat_try_ns < SENDER_SEAT_RETRY_NS)
                return;
        s->seat_try_ns = now;
        if (kvf_spin_seat_take(&s->seat, s->seats) == 1) {
                kvf_debug("layer wait: spin (spin seat %d taken)", s->seat.seat);
                s->spin_layers = true;
        }
}

/* --layer-wait auto, each heartbeat: give the seat back to the host's other senders after
 * SENDER_SEAT_IDLE_NS with no same-host request waiting for layers; take one if they wait. */
static void seat_tick(struct sender *s, uint64_t now)
{
        if (!s->seat_auto)
                return;
        if (s->armed_copies)
                s->seat_busy_ns = now;
        if (s->seat.held && now - s->seat_busy_ns > SENDER_SEAT_IDLE_NS) {
                kvf_debug("layer wait: paced (idle: spin seat %d given back)", s->seat.seat);
                kvf_spin_seat_drop(&s->seat);
                s->spin_layers = false;
        }
        seat_want(s, now);
}

/* A sleep of `wait` ns from `now`, ended no later than `due`. */
static uint64_t wait_until(uint64_t wait, uint64_t now, uint64_t due)
{
        uint64_t left = due > now ? due - now : 0;
        return left < wait ? left : wait;
}

/*
 * Nothing to do: sleep on the doorbell until the next heartbeat, or less.
 * Requests wait for layers: with --layer-wait spin, poll (spin_for_layers);
 * with paced, when the engine has a pace, wake EXPECT_LEAD before the next
 * layer is due and poll until the window's end (pace_window). Waking from a
 * futex costs tens of microseconds on an idle core (more in a VM); this costs
 * the poll window's CPU time per layer. Returns false to poll instead.
 */
static bool idle_wait(struct sender *s, struct pace *pc, uint64_t now, uint64_t next_tick)
{
        uint64_t wait = next_tick > now ? next_tick - now : 0, lo, hi;
        if ((s->pending || s->engine_blocked) && wait > 1000000)
                wait = 1000000; /* a full ring drains on the engine's time, poll it */
        pc->poll_until = 0;
        seat_want(s, now);
        /* (auto with a seat, and only tcp or rdma requests waiting: paced, as without one) */
        const bool spin = s->spin_layers && (!s->seat_auto || s->armed_copies);
        if (spin) {
                if (spin_for_layers(s, pc, now))
                        return false;
        } else if (s->nbuckets && pace_window(pc, &lo, &hi)) {
                uint64_t due = pc->last_event + lo, end = pc->last_event + hi;
                if (due > now + EXPECT_LEAD && due - EXPECT_LEAD - now < wait) {
                        wait = due - EXPECT_LEAD - now;
                        pc->poll_until = end;
                } else if (end > now) {
                        pc->poll_until = end; /* due now: poll right away */
                        return false;
                }
        }
        /* (after the pace's choice: these only shorten the sleep) */
        if (s->prewake_due_ns) /* a prewake to start */
                wait = wait_until(wait, now, s->prewake_due_ns);
        if (s->stop.at) /* stopping: the window's end (or the next bound) is acted on in time */
                wait = wait_until(wait, now, sender_stop_due(s));
        kvf_count(&s->ctl, KVF_CTR_WAKEUPS_SENDER, 1);
        kvf_doorbell_wait(&s->ctl.bells[KVF_BELL_SENDER], has_work, s, 0, wait);
        return true;
}

/*
 * SIGTERM or SIGINT: the loop goes on, refusing new tasks, until every request in flight has
 * had its completion or the stop's bounds have passed (sender.h, struct sender_stop). The
 * engine reads those completions after we exit: each is committed to the ring as it is posted
 * (kvf_bells_publish), and run() rings the engine's doorbell before it returns.
 */
static void stop_begin(struct sender *s, uint64_t drain_ns)
{
        char why[KVF_REASON_MAX];
        /* Short: it is also the reason of a withdrawn finish notice (outbox.c). */
        snprintf(why, sizeof(why), "instance '%s' is stopping (tools/kvferry down)", s->ctl.hdr->instance);
        sender_stop_begin(s, kvf_now_ns(), drain_ns, why);
}

static int run(struct sender *s, uint64_t spin_ns, uint64_t drain_ns)
{
        uint64_t beat = kvf_ms(s->ctl.hdr->heartbeat_ms);
        uint64_t next_tick = 0, idle_since = 0;
        struct pace pc = {0};

        for (;;) {
                if (kvf_load_relaxed(&stop) && !s->stop.at)
                        stop_begin(s, drain_ns);
                if (s->stop.at && sender_stop_step(s, kvf_now_ns())) {
                        /* The tasks in the ring now are answered too, not left unread. */
                        sender_read_engine(s, beat);
                        if (s->pending)
                                sender_flush_pending(s);
                        break;
                }
                bool worked = check_engine(s);
                worked |= handle_progress(s, &pc);
                kvf_bells_ring(&s->bells); /* (the notices of this turn's copies, at once) */
                /* The connector's records first: a peer's state (its block size) posted before
                 * the engine heard the peer is connected is known to the task that follows. */
                worked |= sender_read_connector(s);
                kvf_bells_ring(&s->bells);
                worked |= sender_read_engine(s, beat);
                worked |= stream_words_due(s);
                kvf_bells_ring(&s->bells);

                uint64_t now = kvf_now_ns();
                sender_prewake_fire(s, now);
                if (now >= next_tick) {
                        if (kvf_role_fenced(&s->ctl, KVF_ROLE_SENDER)) {
                                /* A successor took over while we were stuck: touch nothing more. */
                                kvf_error("another sender (pid %d) holds this instance now: exiting",
                                          s->ctl.roles[KVF_ROLE_SENDER].pid);
                                _exit(1);
                        }
                        sender_tick(s, now);
                        seat_tick(s, now);
                        next_tick = now + beat;
                }
                if (worked) {
                        idle_since = 0;
                        continue;
                }
                /* Spin a little (a layer event is often microseconds away), then sleep. */
                if (!idle_since)
                        idle_since = now;
                /* (the poll window is for requests waiting for layers: none left, none) */
                if (now - idle_since < spin_ns || (now < pc.poll_until && s->nbuckets)) {
                        kvf_cpu_relax();
                        continue;
                }
                if (idle_wait(s, &pc, now, next_tick))
                        idle_since = 0;
        }
        /* Every completion is committed (kvf_ring_publish in kvf_bells_publish) as it is
         * posted: the engine reads them after we are gone. Its doorbell, now. */
        kvf_bells_ring(&s->bells);
        sender_stop_report(s, kvf_now_ns());
        return 0;
}

/* What the CPUs this sender may use allow: --layer-wait (spin_for_layers on or off) and
 * --notice-prewake, each said in the log with why. */
static void cpu_modes(struct sender *s, const char *mode, const char *prewake)
{
        const char *why;
        unsigned cpus = kvf_usable_cpus(&why);
        unsigned ranks = s->ctl.hdr->nranks ? s->ctl.hdr->nranks : 1;
        /* The notice prewake (sender.h) has a decode connector poll beside this sender and
         * the engine: auto from 4 CPUs, and 2 per rank. */
        s->prewake = strcmp(prewake, "auto") ? !strcmp(prewake, "on") : cpus >= 4 && cpus >= 2 * ranks;
        kvf_info("notice prewake: %s (--notice-prewake %s; %u CPUs for a group of %u ranks, auto: on from "
                 "4, and 2 per rank)",
                 s->prewake ? "on" : "off", prewake, cpus, ranks);
        if (strcmp(mode, "auto")) {
                s->spin_layers = !strcmp(mode, "spin");
                kvf_info("layer wait: %s (--layer-wait %s)", mode, mode);
                return;
        }
        /* One spin seat per 2 CPUs, shared by every sender of this host (common/cpus.h): where
         * eight prefill instances of one rank each share 2 CPUs, one spins, not eight. */
        s->seats = cpus / 2;
        /* A decode instance's sender never waits for layers: it takes none unless it must */
        int rc = s->ctl.hdr->instance_role == KVF_IROLE_DECODE ? 0 : kvf_spin_seat_take(&s->seat, s->seats);
        if (rc < 0) { /* no seats here: the group's own count, as if its ranks were all there are */
                s->spin_layers = cpus >= 2 * ranks;
                kvf_warn("layer wait: %s (--layer-wait auto without spin seats: %s; %u CPUs for a group of %u "
                         "ranks, spin from 2 per rank)",
                         s->spin_layers ? "spin" : "paced", kvf_err_msg(), cpus, ranks);
                return;
        }
        s->seat_auto = true;
        s->spin_layers = rc == 1;
        s->seat_busy_ns = kvf_now_ns();
        if (rc == 1)
                kvf_info("layer wait: spin (--layer-wait auto: spin seat %d of %u: one per 2 of %u CPUs (by %s), "
                         "shared by this host's senders)",
                         s->seat.seat, s->seats, cpus, why);
        else
                kvf_info("layer wait: paced (--layer-wait auto: %u CPUs (by %s) make %u spin seats; %s)", cpus, why,
                         s->seats,
                         !s->seats ? "fewer than 2 CPUs"
                         : s->ctl.hdr->instance_role == KVF_IROLE_DECODE
                             ? "a decode instance takes one only when requests wait for layers"
                             : "all held by other senders of this host: one is taken when requests wait for "
                               "layers and one is free");
}

int main(int argc, char **argv)
{
        /* Before any thread exists, where it costs nothing (doorbell.h). */
        (void)kvf_doorbell_register();
        enum { O_TIMEOUT = 1000, O_SPIN, O_SLICE, O_LAYER_WAIT, O_NOTICE_RINGS, O_NO_NOTICE_RINGS, O_VERSION,
               O_PREWAKE, O_STOP_DRAIN };
        static const struct option opts[] = {{"instance", required_argument, 0, 'i'},
                                             {"request-timeout-ms", required_argument, 0, O_TIMEOUT},
                                             {"spin-us", required_argument, 0, O_SPIN},
                                             {"notice-rings", no_argument, 0, O_NOTICE_RINGS},
                                             {"no-notice-rings", no_argument, 0, O_NO_NOTICE_RINGS},
                                             {"slice-us", required_argument, 0, O_SLICE},
                                             {"layer-wait", required_argument, 0, O_LAYER_WAIT},
                                             {"notice-prewake", required_argument, 0, O_PREWAKE},
                                             {"stop-drain-ms", required_argument, 0, O_STOP_DRAIN},
                                             {"help", no_argument, 0, 'h'},
                                             {"version", no_argument, 0, O_VERSION},
                                             {0, 0, 0, 0}};
        const char *instance = NULL;
        uint64_t timeout_ms = 60000, spin_us = 50, drain_ms = SENDER_STOP_DRAIN_MS_DEFAULT;
        bool notice_rings = true;
        uint32_t slice_us = KVF_SLICE_US_DEFAULT;
        const char *layer_wait = "auto", *prewake = "auto";
        int c;

        while ((c = getopt_long(argc, argv, "i:h", opts, NULL)) != -1) {
                switch (c) {
                case 'i': instance = optarg; break;
                case O_TIMEOUT: timeout_ms = kvf_opt_u64("request-timeout-ms", optarg, 1, 86400000); break;
                case O_SPIN: spin_us = kvf_opt_u64("spin-us", optarg, 0, 1000000); break;
                case O_STOP_DRAIN: drain_ms = kvf_opt_u64("stop-drain-ms", optarg, 0, SENDER_STOP_DRAIN_MS_MAX); break;
                case O_NOTICE_RINGS: notice_rings = true; break;
                case O_NO_NOTICE_RINGS: notice_rings = false; break;
                case O_SLICE: slice_us = kvf_sched_slice_opt(prog, optarg); break;
                case O_LAYER_WAIT:
                        if (strcmp(optarg, "auto") && strcmp(optarg, "spin") && strcmp(optarg, "paced"))
                                kvf_opt_die(prog, "--layer-wait is auto, spin or paced");
                        layer_wait = optarg;
                        break;
                case O_PREWAKE:
                        if (strcmp(optarg, "auto") && strcmp(optarg, "on") && strcmp(optarg, "off"))
                                kvf_opt_die(prog, "--notice-prewake is auto, on or off");
                        prewake = optarg;
                        break;
                case 'h': usage(); return 0;
                case O_VERSION: printf("%s %s\n", prog, KVFERRY_VERSION); return 0;
                default: kvf_opt_die(prog, "unknown option");
                }
        }
        if (!instance)
                kvf_opt_die(prog, "--instance is required");
        kvf_log_setup(instance, "sender");
        kvf_opt_signals(&stop);
        slice_us = kvf_sched_slice_start(slice_us); /* before any thread: they inherit it */
        /* Timed wake-ups ahead of the next layer (run()) want to be on time, not
         * batched with others: no timer slack. */
        prctl(PR_SET_TIMERSLACK, 1UL, 0, 0, 0);

        static struct sender s;
        const struct sender_opts so = {.request_timeout_ns = kvf_ms(timeout_ms),
                                       .notice_rings = notice_rings,
                                       .attach_wait_ms = 10000};
        if (sender_open(&s, instance, &so) < 0) {
                kvf_error("%s", kvf_err_msg());
                return 1;
        }
        cpu_modes(&s, layer_wait, prewake); /* before the claim: up returns once we are claimed */
        if (sender_start(&s) < 0) {
                kvf_error("%s", kvf_err_msg());
                return 1;
        }
        kvf_store_relaxed(&s.ctl.roles[KVF_ROLE_SENDER].slice_us, slice_us);
        if (s.own.be->id == KVF_BACKEND_CUDA)
                log_gpu(&s);
        kvf_info("running (generation %llu)", (unsigned long long)s.gen);
        run(&s, spin_us * 1000, kvf_ms(drain_ms));
        sender_close(&s);
        return 0;
}

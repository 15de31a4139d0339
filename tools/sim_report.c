/*
 * kvf-sim's report (sim.h): the progress line while it runs, then the
 * summary text and its JSON. The tests/ scripts read the JSON's fields (some
 * with sed, taking a key's last match on the line), the benchmarks the JSON's
 * fields and its rows per instance, people the text: keep the shapes.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>

#include "clock.h"
#include "ctl.h"
#include "layout.h"
#include "sim.h"
#include "sim_gpu.h" /* GPU mode */

void kvf_sim_progress_line(const struct sim *s, bool final)
{
        double t = (double)(kvf_now_ns() - s->t_start) / 1e9;
        fprintf(stderr,
                "%s[%6.1fs] %llu/%u requests done (finished %llu, failed %llu), %.2f GiB moved, "
                "%.2f GiB/s%s",
                final ? "" : "\r", t, (unsigned long long)s->done_reqs, kvf_sim_counted(s),
                (unsigned long long)s->finished, (unsigned long long)s->failed,
                (double)s->moved_bytes / (1 << 30),
                t > 0 ? (double)s->moved_bytes / (1 << 30) / t : 0.0, final ? "\n" : "   ");
}

struct spread {
        unsigned n;
        double p50, p99, max;
};

static int cmp_double(const void *a, const void *b)
{
        double x = *(const double *)a, y = *(const double *)b;
        return x < y ? -1 : x > y;
}

/* Percentiles of v[0..n), which this sorts. */
static struct spread spread_of(double *v, unsigned n)
{
        if (!n)
                return (struct spread){0};
        qsort(v, n, sizeof(*v), cmp_double);
        return (struct spread){.n = n,
                               .p50 = v[(unsigned)(0.5 * (n - 1) + 0.5)],
                               .p99 = v[(unsigned)(0.99 * (n - 1) + 0.5)],
                               .max = v[n - 1]};
}

struct tail_figures {
        struct spread all, in_time, late, completion;
        struct spread seen; /* in time: last layer-done -> the sender saw it (negative as 0) */
        struct spread notice; /* in time, same host: last layer-done -> the notice posted */
        struct spread published; /* the same requests: the notice posted -> the arrival published */
        unsigned notice_bad; /* notices stamped after their arrival's publication (never: one clock) */
        struct spread
            norm; /* tail / (2 x its bytes left at memcpy rate + 50 us); with a baseline */
};

/*
 * The tail figures. A late task's tail carries its whole request (the task
 * came after every layer was done), so it is shown apart from the tails of
 * requests whose task came in time; the ratio puts each request's tail next
 * to what it had left to send.
 */
static struct tail_figures tail_figures(const struct sim *s, double memcpy_bps)
{
        struct tail_figures f = {0};
        unsigned m = s->ntails ? s->ntails : 1;
        double *all = calloc(m, sizeof(double)), *in_time = calloc(m, sizeof(double));
        double *late = calloc(m, sizeof(double)), *comp = calloc(m, sizeof(double));
        double *norm = calloc(m, sizeof(double)), *seen = calloc(m, sizeof(double));
        double *notice = calloc(m, sizeof(double)), *published = calloc(m, sizeof(double));

        if (all && in_time && late && comp && norm && seen && notice && published) {
                unsigned n_in = 0, n_late = 0, n_notice = 0;
                for (unsigned i = 0; i < s->ntails; i++) {
                        const struct sim_tail *t = &s->tails[i];
                        all[i] = (double)t->ns;
                        comp[i] = (double)t->cns;
                        if (t->late) {
                                late[n_late++] = (double)t->ns;
                        } else {
                                seen[n_in] = t->seen_ns > 0 ? (double)t->seen_ns : 0;
                                if (t->notice_ns > 0) {
                                        published[n_notice] = (double)t->ns - (double)t->notice_ns;
                                        notice[n_notice++] = (double)t->notice_ns;
                                }
                                f.notice_bad += t->notice_ns > 0 && (uint64_t)t->notice_ns > t->ns;
                                in_time[n_in++] = (double)t->ns;
                        }
                        if (memcpy_bps > 0)
                                norm[i] =
                                    (double)t->ns / (2e9 * (double)t->left / memcpy_bps + 50e3);
                }
                f.all = spread_of(all, s->ntails);
                f.in_time = spread_of(in_time, n_in);
                f.late = spread_of(late, n_late);
                f.completion = spread_of(comp, s->ntails);
                f.seen = spread_of(seen, n_in); /* a late task's layers were ready before it */
                f.notice = spread_of(notice, n_notice);
                f.published = spread_of(published, n_notice);
                if (memcpy_bps > 0)
                        f.norm = spread_of(norm, s->ntails);
        }
        free(all);
        free(in_time);
        free(late);
        free(comp);
        free(norm);
        free(seen);
        free(notice);
        free(published);
        return f;
}

/*
 * The reference: one plain memcpy of the same number of bytes, 256 MiB at a
 * time between two buffers touched beforehand. Contiguous, so it is the
 * upper bound for copying these bytes on this machine, not a model of
 * kvferry's block-wise copies.
 */
static double memcpy_rate(uint64_t bytes)
{
        uint64_t buf = 256ull << 20;
        uint8_t *a = malloc(buf), *b = malloc(buf);
        if (!a || !b) {
                free(a);
                free(b);
                return 0;
        }
        memset(a, 1, buf);
        memset(b, 2, buf);
        uint64_t done = 0, t0 = kvf_now_ns();
        while (done < bytes) {
                uint64_t n = bytes - done < buf ? bytes - done : buf;
                memcpy(b, a, n);
                /* b is never read again: without this the copies are dead stores */
                __asm__ volatile("" : : "r"(b) : "memory");
                done += n;
        }
        double dt = (double)(kvf_now_ns() - t0) / 1e9;
        free(a);
        free(b);
        return (double)done / dt;
}

/* The sender's histograms live as long as the instance: this run's share is what they
 * hold at the end less what they hold now (each prefill instance's first rank). */
void kvf_sim_report_start(struct sim *s)
{
        for (unsigned i = 0; i < s->npre; i++) {
                struct kvf_ctl pc;
                if (kvf_ctl_attach(s->pre[i].o->name[0], false, &pc) == 0) {
                        memcpy(s->pre[i].hist_before, pc.sender->hist, sizeof(s->pre[i].hist_before));
                        kvf_ctl_detach(&pc);
                }
        }
}

/* This run's p50 and p99 of the sender's histograms (enum kvf_hist_id; 0 when no instance
 * can be read), those of every prefill instance's first rank together: layer-done -> copy
 * start, one layer's copy, a request's last layer -> its completion. */
static void sender_hists(const struct sim *s, uint64_t p50[KVF_HIST_COUNT], uint64_t p99[KVF_HIST_COUNT])
{
        static struct kvf_histogram run[KVF_HIST_COUNT];
        bool any = false;
        memset(p50, 0, KVF_HIST_COUNT * sizeof(*p50));
        memset(p99, 0, KVF_HIST_COUNT * sizeof(*p99));
        memset(run, 0, sizeof(run));
        for (unsigned p = 0; p < s->npre; p++) {
                struct kvf_ctl pc;
                if (kvf_ctl_attach(s->pre[p].o->name[0], false, &pc) < 0)
                        continue;
                any = true;
                for (unsigned h = 0; h < KVF_HIST_COUNT; h++) {
                        const struct kvf_histogram *now = &pc.sender->hist[h];
                        const struct kvf_histogram *was = &s->pre[p].hist_before[h];
                        for (unsigned i = 0; i < KVF_HIST_BUCKETS; i++) /* (a re-created instance starts at 0) */
                                run[h].buckets[i] += now->buckets[i] >= was->buckets[i]
                                                             ? now->buckets[i] - was->buckets[i]
                                                             : now->buckets[i];
                }
                kvf_ctl_detach(&pc);
        }
        for (unsigned h = 0; any && h < KVF_HIST_COUNT; h++) {
                p50[h] = kvf_hist_quantile(&run[h], 0.50);
                p99[h] = kvf_hist_quantile(&run[h], 0.99);
        }
}

/* One instance's figures: its requests (prefilled or received), and the tails of those that
 * finished. */
struct inst_figures {
        const char *role;
        const struct sim_inst *in;
        double rps, rate;
        struct spread tail;
};

static struct inst_figures inst_figures(const struct sim *s, bool decode, unsigned idx, double secs)
{
        const struct sim_inst *in = decode ? &s->dec[idx] : &s->pre[idx];
        struct inst_figures f = {.role = decode ? "decode" : "prefill", .in = in};
        double *v = calloc(s->ntails ? s->ntails : 1, sizeof(double));
        unsigned n = 0;
        for (unsigned i = 0; v && i < s->ntails; i++)
                if ((decode ? s->tails[i].di : s->tails[i].pi) == idx)
                        v[n++] = (double)s->tails[i].ns;
        f.tail = spread_of(v, n);
        free(v);
        f.rps = secs > 0 ? (double)in->finished / secs : 0;
        f.rate = secs > 0 ? (double)in->bytes / secs : 0;
        return f;
}

/* Everything the text and the JSON show. */
struct figures {
        double secs, rate, rps, base, layer_bytes;
        struct tail_figures tf;
        uint64_t h50[KVF_HIST_COUNT], h99[KVF_HIST_COUNT]; /* sender_hists */
        unsigned unaccounted;
        bool strict; /* ok only when every request finished (sim_opts.strict) */
        bool ok;
};

/* Fan-in, fan-out: a row per instance (what it prefilled, or received), then all of them. */
static void print_instances(const struct sim *s, const struct figures *g)
{
        printf("  instances    %u prefill, %u decode: request i prefilled by prefill instance i mod %u, "
               "sent to the decode instance with the most free blocks\n",
               s->npre, s->ndec, s->npre);
        printf("               %-8s %-20s %8s %8s %6s %10s %10s %8s %12s %12s\n", "role", "instance",
               "requests", "finished", "failed", "GiB", "requests/s", "GiB/s", "tail p50 us",
               "tail p99 us");
        for (unsigned i = 0; i < s->npre + s->ndec; i++) {
                bool decode = i >= s->npre;
                struct inst_figures f = inst_figures(s, decode, decode ? i - s->npre : i, g->secs);
                printf("               %-8s %-20s %8llu %8llu %6llu %10.2f %10.1f %8.2f %12.1f %12.1f\n",
                       f.role, f.in->o->name[0], (unsigned long long)f.in->admitted,
                       (unsigned long long)f.in->finished, (unsigned long long)f.in->failed,
                       (double)f.in->bytes / (1 << 30), f.rps, f.rate / (1 << 30), f.tail.p50 / 1e3,
                       f.tail.p99 / 1e3);
        }
        printf("               %-8s %-20s %8u %8llu %6llu %10.2f %10.1f %8.2f %12.1f %12.1f\n", "all",
               "", kvf_sim_counted(s), (unsigned long long)s->finished,
               (unsigned long long)s->failed, (double)s->moved_bytes / (1 << 30), g->rps,
               g->rate / (1 << 30), g->tf.all.p50 / 1e3, g->tf.all.p99 / 1e3);
}

static void print_text(const struct sim *s, const struct figures *g)
{
        const struct kvf_layout_info *L = &s->L;
        const struct tail_figures *tf = &g->tf;
        char gib[32];

        printf("kvferry simulation summary\n");
        printf("  layout       %u+%u layers x %u tensor(s), "
               "%u kv head(s) x %u tokens x %u dims %s = %s per block, %u rank(s)\n",
               L->num_layers, L->extra_layers, s->tensors, L->kv_heads, L->block_size, L->head_dim,
               kvf_dtype_name(L->dtype), kvf_fmt_bytes(L->block_bytes, gib, sizeof(gib)),
               s->o.ranks);
        if (L->scale_bytes)
                printf("  scales       a %s scale tensor per K/V tensor, %llu bytes a block, every block "
                       "verified with its scales\n",
                       kvf_dtype_name(L->scale_dtype), (unsigned long long)L->scale_bytes);
        if (s->mixed)
                printf("  tp           prefill tp %u (%u kv head(s), %u tokens/block) -> decode tp %u "
                       "(%u kv head(s), %u tokens/block) of %u kv heads: %u tasks per request; "
                       "every head of every token checked on every decode rank\n",
                       s->o.ranks, s->L.kv_heads, s->L.block_size, s->o.dranks, s->Ld.kv_heads,
                       s->Ld.block_size, s->heads, s->ntasks);
        if (s->sg) /* GPU mode */
                printf("  GPU          caches on GPUs (prefill GPU %d, decode GPU %d): layers are "
                       "kernels (%u us, every SM), signalled on the stream; every byte verified on "
                       "the GPU\n",
                       kvf_cache_device(kvf_group_member(s->pre[0].g, 0)),
                       kvf_cache_device(kvf_group_member(s->dec[0].g, 0)), s->o.layer_us);
        printf("  requests     %u: %llu finished, %llu failed, %u unaccounted, %llu corrupt\n",
               kvf_sim_counted(s), (unsigned long long)s->finished, (unsigned long long)s->failed,
               g->unaccounted, (unsigned long long)s->corrupt);
        for (int st = 1; st < KVF_STATUS_COUNT; st++)
                if (s->fail_by_status[st])
                        printf("               %llu %s\n",
                               (unsigned long long)s->fail_by_status[st], kvf_status_name(st));
        printf("  moved        %s in %.2f s = %.2f GiB/s (%.1f requests/s); %s verified %s\n",
               kvf_fmt_bytes(s->moved_bytes, gib, sizeof(gib)), g->secs, g->rate / (1 << 30), g->rps,
               kvf_fmt_bytes(s->verified_bytes, (char[32]){0}, 32),
               s->o.sample_only && !s->sg ? "at both ends of every block (--verify sample)"
                                          : "byte for byte");
        printf("  tail         last layer-done -> arrival: p50 %.1f us, p99 %.1f us "
               "(one layer of an average request: %s)\n",
               tf->all.p50 / 1e3, tf->all.p99 / 1e3,
               kvf_fmt_bytes((uint64_t)g->layer_bytes, (char[32]){0}, 32));
        printf("               %u with the task in time: p50 %.1f us, p99 %.1f us; "
               "%u late tasks (every layer left to send): p50 %.1f us, p99 %.1f us\n",
               tf->in_time.n, tf->in_time.p50 / 1e3, tf->in_time.p99 / 1e3, tf->late.n,
               tf->late.p50 / 1e3, tf->late.p99 / 1e3);
        if (g->base > 0)
                printf("               per request, tail / (2 x its bytes left at memcpy rate + 50 us): "
                       "p50 %.2f, p99 %.2f, max %.2f\n",
                       tf->norm.p50, tf->norm.p99, tf->norm.max);
        printf("               last layer-done -> completion (prefill side): "
               "p50 %.1f us, p99 %.1f us\n",
               tf->completion.p50 / 1e3, tf->completion.p99 / 1e3);
        printf("               last layer-done -> the sender saw it: p50 %.1f us, p99 %.1f us\n",
               tf->seen.p50 / 1e3, tf->seen.p99 / 1e3);
        if (tf->notice.n)
                printf("               last layer-done -> the sender posted its notice (same host, %u "
                       "requests): p50 %.1f us, p99 %.1f us\n",
                       tf->notice.n, tf->notice.p50 / 1e3, tf->notice.p99 / 1e3);
        if (tf->notice.n)
                printf("               the notice posted -> the decode connector published the arrival: "
                       "p50 %.1f us, p99 %.1f us\n",
                       tf->published.p50 / 1e3, tf->published.p99 / 1e3);
        printf("  copy start   layer-done -> copy start: p50 %.1f us, p99 %.1f us\n",
               (double)g->h50[KVF_HIST_LAYER_TO_COPY] / 1e3, (double)g->h99[KVF_HIST_LAYER_TO_COPY] / 1e3);
        if (s->o.warm_caches)
                printf("  warm-up      touched %s of the caches through this process's mappings in %.3f s "
                       "(%.2f us per 4 KiB page), before the clock started\n",
                       kvf_fmt_bytes(s->warm_bytes, gib, sizeof(gib)), (double)s->warm_ns / 1e9,
                       s->warm_bytes ? (double)s->warm_ns / 1e3 / (double)(s->warm_bytes / 4096) : 0);
        if (s->o.baseline && s->sg) /* GPU mode */
                printf("  baseline     one bulk cudaMemcpy (device to device) of an average "
                       "request's layer: %.2f GiB/s; one layer of an average request at that rate "
                       "= %.1f us\n",
                       g->base / (1 << 30), g->base > 0 ? g->layer_bytes / g->base * 1e6 : 0);
        else if (s->o.baseline)
                printf("  baseline     memcpy of the same bytes: %.2f GiB/s; kvferry/memcpy = %.2f; "
                       "one layer at memcpy rate = %.1f us\n",
                       g->base / (1 << 30), g->base > 0 ? g->rate / g->base : 0,
                       g->base > 0 ? g->layer_bytes / g->base * 1e6 : 0);
        if (s->npre > 1 || s->ndec > 1)
                print_instances(s, g);
        printf("  result       %s\n",
               !g->ok ? "FAILED"
               : g->strict
                   ? "OK: every request finished and verified (or cancelled by the simulator)"
                   : "OK: every finished request verified, every request accounted for");
        if (!g->ok && g->strict && s->unexpected_failures)
                printf("               (%llu request(s) failed: with more than one instance per "
                       "side, or --strict, every request must finish)\n",
                       (unsigned long long)s->unexpected_failures);
}

/* The same as one JSON line; the tests read its fields by name. */

/* The 10 slowest tails (of the requests whose task came in time, or of all), each split into
 * its stages (ns): [seq, tail, completion, seen, late, its last layer-done from the run's
 * start, bytes left to send at its last layer-done, the sender posted its notice (same host;
 * 0: not known)]. */
static void slowest_json(const struct sim *s, FILE *f, bool in_time)
{
        unsigned pick[10], n = 0;
        for (; n < 10; n++) {
                unsigned best = UINT32_MAX;
                for (unsigned i = 0; i < s->ntails; i++) {
                        bool used = in_time && s->tails[i].late;
                        for (unsigned k = 0; k < n; k++)
                                used |= pick[k] == i;
                        if (!used && (best == UINT32_MAX || s->tails[i].ns > s->tails[best].ns))
                                best = i;
                }
                if (best == UINT32_MAX)
                        break;
                pick[n] = best;
        }
        for (unsigned k = 0; k < n; k++) {
                const struct sim_tail *t = &s->tails[pick[k]];
                fprintf(f, "%s[%u,%llu,%llu,%lld,%d,%llu,%llu,%lld]", k ? "," : "", t->seq,
                        (unsigned long long)t->ns, (unsigned long long)t->cns, (long long)t->seen_ns,
                        t->late ? 1 : 0, (unsigned long long)t->at_ns, (unsigned long long)t->left,
                        (long long)t->notice_ns);
        }
}

/* This process's CPU time so far (user + system). The JSON's sim_cpu_s is the run's share
 * (from its first step to the report): how much of the run the simulator, which drives every
 * rank of every instance from one thread, kept a CPU busy. */
double kvf_sim_cpu_s(void)
{
        struct rusage ru;
        if (getrusage(RUSAGE_SELF, &ru) < 0)
                return 0;
        return (double)(ru.ru_utime.tv_sec + ru.ru_stime.tv_sec) +
               (double)(ru.ru_utime.tv_usec + ru.ru_stime.tv_usec) / 1e6;
}

static void write_json(const struct sim *s, const struct figures *g, const char *path)
{
        const struct tail_figures *tf = &g->tf;
        FILE *f = fopen(path, "w");
        if (!f)
                return;
        /* The instances first: shell readers that take a key's last match on the line (sed's
         * greedy .*) then still read the run's own figures. */
        fprintf(f, "{\"prefill_instances\":%u,\"decode_instances\":%u,\"instances\":[", s->npre,
                s->ndec);
        for (unsigned i = 0; i < s->npre + s->ndec; i++) {
                bool decode = i >= s->npre;
                struct inst_figures x = inst_figures(s, decode, decode ? i - s->npre : i, g->secs);
                fprintf(f,
                        "%s{\"role\":\"%s\",\"name\":\"%s\",\"requests\":%llu,\"finished\":%llu,"
                        "\"failed\":%llu,\"unaccounted\":%llu,\"bytes\":%llu,\"requests_per_s\":%.1f,"
                        "\"rate_bps\":%.1f,\"tail_p50_ns\":%.0f,\"tail_p99_ns\":%.0f}",
                        i ? "," : "", x.role, x.in->o->name[0], (unsigned long long)x.in->admitted,
                        (unsigned long long)x.in->finished, (unsigned long long)x.in->failed,
                        (unsigned long long)(x.in->admitted - x.in->done),
                        (unsigned long long)x.in->bytes, x.rps, x.rate, x.tail.p50, x.tail.p99);
        }
        fprintf(f,
                "],\"requests\":%u,\"finished\":%llu,\"failed\":%llu,\"unaccounted\":%u,"
                "\"corrupt\":%llu,\"bytes\":%llu,\"verified_bytes\":%llu,\"seconds\":%.6f,"
                "\"rate_bps\":%.1f,\"tail_p50_ns\":%.0f,\"tail_p99_ns\":%.0f,"
                "\"tail_in_time_p50_ns\":%.0f,\"tail_in_time_p99_ns\":%.0f,\"late_tasks\":%u,"
                "\"tail_late_p50_ns\":%.0f,\"tail_late_p99_ns\":%.0f,\"tail_norm_p50\":%.3f,"
                "\"tail_norm_p99\":%.3f,\"tail_norm_max\":%.3f,\"completion_tail_p50_ns\":%.0f,"
                "\"completion_tail_p99_ns\":%.0f,\"layer_to_copy_p50_ns\":%llu,"
                "\"layer_to_copy_p99_ns\":%llu,\"copy_p50_ns\":%llu,\"copy_p99_ns\":%llu,"
                "\"last_to_done_p50_ns\":%llu,\"last_to_done_p99_ns\":%llu,"
                "\"memcpy_bps\":%.1f,\"avg_layer_bytes\":%.1f,"
                "\"ok\":%s,\"cancelled\":%llu,\"cancels_sent\":%llu,\"timed_out\":%llu,"
                "\"connection_errors\":%llu,\"finished_but_failed_pairs\":%llu,\"warm_bytes\":%llu,"
                "\"warm_ns\":%llu,\"gpu\":%s,\"requests_per_s\":%.1f,\"unexpected_failures\":%llu,"
                "\"strict\":%s,\"seen_p50_ns\":%.0f,\"seen_p99_ns\":%.0f,\"notice_p50_ns\":%.0f,"
                "\"notice_p99_ns\":%.0f,\"notice_n\":%u,\"notice_bad\":%u,\"published_p50_ns\":%.0f,"
                "\"published_p99_ns\":%.0f,\"slowest\":[",
                kvf_sim_counted(s), (unsigned long long)s->finished, (unsigned long long)s->failed,
                g->unaccounted, (unsigned long long)s->corrupt, (unsigned long long)s->moved_bytes,
                (unsigned long long)s->verified_bytes, g->secs, g->rate, tf->all.p50, tf->all.p99,
                tf->in_time.p50, tf->in_time.p99, tf->late.n, tf->late.p50, tf->late.p99,
                tf->norm.p50, tf->norm.p99, tf->norm.max, tf->completion.p50, tf->completion.p99,
                (unsigned long long)g->h50[KVF_HIST_LAYER_TO_COPY], (unsigned long long)g->h99[KVF_HIST_LAYER_TO_COPY],
                (unsigned long long)g->h50[KVF_HIST_COPY], (unsigned long long)g->h99[KVF_HIST_COPY],
                (unsigned long long)g->h50[KVF_HIST_LAST_TO_DONE],
                (unsigned long long)g->h99[KVF_HIST_LAST_TO_DONE], g->base,
                g->layer_bytes, g->ok ? "true" : "false",
                (unsigned long long)s->fail_by_status[KVF_STATUS_CANCELLED],
                (unsigned long long)s->cancels_sent,
                (unsigned long long)s->fail_by_status[KVF_STATUS_TIMEOUT],
                (unsigned long long)s->fail_by_status[KVF_STATUS_CONNECTION],
                (unsigned long long)s->bad_status_pairs, (unsigned long long)s->warm_bytes,
                (unsigned long long)s->warm_ns, s->sg ? "true" : "false", g->rps,
                (unsigned long long)s->unexpected_failures, g->strict ? "true" : "false", tf->seen.p50,
                tf->seen.p99, tf->notice.p50, tf->notice.p99, tf->notice.n, tf->notice_bad,
                tf->published.p50, tf->published.p99);
        slowest_json(s, f, false);
        fprintf(f, "],\"slowest_in_time\":[");
        slowest_json(s, f, true);
        fprintf(f,
                "],\"gpu_clock_drift_max_ns\":%llu,\"prefill_tp\":%u,\"decode_tp\":%u,"
                "\"prefill_block_tokens\":%u,\"decode_block_tokens\":%u,\"tasks_per_request\":%u,"
                "\"sim_cpu_s\":%.3f,\"sim_event_wait_s\":%.3f,\"sim_gpu_wait_s\":%.3f,"
                "\"sim_phase_s\":{\"write\":%.3f,\"layer\":%.3f,\"step_end\":%.3f,\"submit\":%.3f,"
                "\"poll\":%.3f}}\n",
                s->sg ? (unsigned long long)sim_gpu_clock_drift(s->sg) : 0ull, s->o.ranks,
                s->o.dranks, s->L.block_size, s->Ld.block_size, s->mixed ? s->ntasks : s->o.ranks,
                kvf_sim_cpu_s() - s->cpu_start_s, s->event_wait_s, s->gpu_wait_s,
                (double)s->phase_ns[SIM_PH_WRITE] / 1e9, (double)s->phase_ns[SIM_PH_LAYER] / 1e9,
                (double)s->phase_ns[SIM_PH_STEP_END] / 1e9, (double)s->phase_ns[SIM_PH_SUBMIT] / 1e9,
                (double)s->phase_ns[SIM_PH_POLL] / 1e9);
        fclose(f);
}

bool kvf_sim_report(struct sim *s)
{
        struct figures g = {.secs = s->secs};

        sender_hists(s, g.h50, g.h99);
        g.rate = g.secs > 0 ? (double)s->moved_bytes / g.secs : 0;
        /* GPU mode: one bulk device-to-device copy of an average request's layer. */
        g.base = !s->o.baseline ? 0
                 : s->sg ? sim_gpu_copy_rate(s->sg, s->moved_bytes / (s->nreq ? s->nreq : 1) /
                                                        (s->layers ? s->layers : 1))
                         : memcpy_rate(s->moved_bytes ? s->moved_bytes : (1ull << 30));
        /* One layer of an average request, at the memcpy rate (or the run's rate). */
        double avg_send = 0;
        unsigned n = 0;
        for (unsigned i = 0; i < s->nreq; i++)
                if (s->reqs[i].admitted || !s->stopped) {
                        avg_send += s->reqs[i].n_dst;
                        n++;
                }
        avg_send /= n ? n : 1;
        g.layer_bytes = avg_send * (double)kvf_sim_layer_block_bytes(&s->L) * s->o.ranks;
        g.tf = tail_figures(s, g.base);
        g.rps = g.secs > 0 ? (double)s->finished / g.secs : 0;
        g.unaccounted = kvf_sim_counted(s) - (unsigned)s->done_reqs;
        g.strict = s->o.strict || s->npre > 1 || s->ndec > 1;
        g.ok = s->corrupt == 0 && g.unaccounted == 0 && (!g.strict || s->unexpected_failures == 0);

        print_text(s, &g);
        if (s->o.json)
                write_json(s, &g, s->o.json);
        return g.ok;
}

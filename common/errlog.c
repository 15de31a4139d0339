/*
 * The de-duplicated error log of each role in the control segment (ctl.h):
 * one entry per message template, with its latest text, count and times,
 * under a seqlock for readers.
 */
#include "ctl.h"

#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "atomics.h"
#include "clock.h"
#include "log.h"

void kvf_errlog(struct kvf_ctl *c, enum kvf_role_id role, const char *fmt, ...)
{
        char text[KVF_ERRLOG_TEXT];
        va_list ap;

        va_start(ap, fmt);
        vsnprintf(text, sizeof(text), fmt, ap);
        va_end(ap);
        /* Rate-limited per template, as the entries below are kept per template. */
        kvf_log_keyed(KVF_LOG_ERROR, fmt, "%s", text);
        if (!c || !c->errlog || !c->writable)
                return;
        kvf_count(c, KVF_CTR_ERRORS_LOGGED, 1);

        /* One writer at a time: the seqlock below admits one, and a role's threads (the
         * connector's session threads) report concurrently; a racing count++ undercounts. */
        static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
        pthread_mutex_lock(&mu);

        struct kvf_errlog_entry *region = c->errlog + (size_t)role * KVF_ERRLOG_ENTRIES;
        uint64_t hash = kvf_hash64(fmt, strlen(fmt), (uint64_t)role);
        struct kvf_errlog_entry *e = NULL, *oldest = &region[0];
        for (unsigned i = 0; i < KVF_ERRLOG_ENTRIES; i++) {
                if (region[i].hash == hash || region[i].hash == 0) {
                        e = &region[i];
                        break;
                }
                if (region[i].last_ns < oldest->last_ns)
                        oldest = &region[i];
        }
        if (!e) {
                e = oldest;
                e->hash = 0; /* reused below as a new entry */
        }
        uint32_t seq = kvf_load_relaxed(&e->seq);
        if (seq & 1)
                seq++; /* our predecessor died mid-update */
        /* Seqlock: odd while writing; the release fence keeps the data stores
         * after the odd store, the release store of the even value after them. */
        kvf_store_relaxed(&e->seq, seq + 1);
        __atomic_thread_fence(__ATOMIC_RELEASE);
        uint64_t now = kvf_wall_ns();
        if (e->hash != hash) {
                e->hash = hash;
                e->count = 0;
                e->first_ns = now;
        }
        e->count++;
        e->last_ns = now;
        memcpy(e->text, text, sizeof(text));
        kvf_store_release(&e->seq, seq + 2);
        pthread_mutex_unlock(&mu);
}

int kvf_errlog_read(const struct kvf_ctl *c, int role, unsigned i, struct kvf_errlog_entry *out)
{
        const struct kvf_errlog_entry *e = c->errlog + (size_t)role * KVF_ERRLOG_ENTRIES + i;

        for (int tries = 0; tries < 1000; tries++) {
                uint32_t s1 = kvf_load_acquire(&e->seq);
                if (s1 & 1)
                        continue;
                memcpy(out, e, sizeof(*out));
                __atomic_thread_fence(__ATOMIC_ACQUIRE);
                if (kvf_load_relaxed(&e->seq) == s1) {
                        out->text[KVF_ERRLOG_TEXT - 1] = '\0';
                        return out->hash != 0;
                }
        }
        return 0;
}


/* Time: CLOCK_MONOTONIC nanoseconds, comparable across the processes of one boot. */
#ifndef KVF_CLOCK_H
#define KVF_CLOCK_H

#include <stdint.h>
#include <time.h>

#define KVF_NS_PER_MS 1000000ull
#define KVF_NS_PER_S 1000000000ull

/* Milliseconds (an option, a header field) as nanoseconds, the unit of every clock here. */
static inline uint64_t kvf_ms(uint64_t ms)
{
        return ms * KVF_NS_PER_MS;
}

/* The heartbeat period of the segment whose header says heartbeat_ms. */
#define kvf_heartbeat_ns(hdr) kvf_ms((hdr)->heartbeat_ms)

static inline uint64_t kvf_now_ns(void)
{
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        return (uint64_t)ts.tv_sec * KVF_NS_PER_S + (uint64_t)ts.tv_nsec;
}

/* The absolute time `ns` from now on `clock` (CLOCK_MONOTONIC or CLOCK_REALTIME): the
 * deadline pthread_cond_timedwait and sem_timedwait take. */
static inline struct timespec kvf_ts_after(clockid_t clock, uint64_t ns)
{
        struct timespec ts;
        clock_gettime(clock, &ts);
        ns += (uint64_t)ts.tv_nsec;
        ts.tv_sec += (time_t)(ns / KVF_NS_PER_S);
        ts.tv_nsec = (long)(ns % KVF_NS_PER_S);
        return ts;
}

static inline uint64_t kvf_wall_ns(void)
{
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        return (uint64_t)ts.tv_sec * KVF_NS_PER_S + (uint64_t)ts.tv_nsec;
}

/*
 * Time since `then`, never negative: `then` may have been stamped by another
 * thread after our `now` was read, and a wrapped difference would look like
 * an age of centuries.
 */
static inline uint64_t kvf_elapsed(uint64_t now, uint64_t then)
{
        return now > then ? now - then : 0;
}

static inline void kvf_sleep_ns(uint64_t ns)
{
        struct timespec ts = {.tv_sec = (time_t)(ns / KVF_NS_PER_S), .tv_nsec = (long)(ns % KVF_NS_PER_S)};
        while (nanosleep(&ts, &ts) != 0) {
        }
}

#endif

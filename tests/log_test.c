/*
 * The log rate limit on its own (common/log.c): a cause prints at most 10
 * lines per 10 s; the rest are counted and reported on the cause's next line
 * once the window is over, or by kvf_log_flush(); kvf_log_keyed() groups
 * messages by the cause it is given; causes are independent; debug lines are
 * not limited; four threads logging one cause at once lose no count.
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "check.h"
#include "log.h"

static char path[] = "/tmp/kvf-log-test.XXXXXX";

static void *flood_a(void *arg)
{
        for (int i = 0; i < 25; i++)
                kvf_error("cause A, thread %d line %d", (int)(long)arg, i);
        return NULL;
}

/* Lines of the log with `needle`; *sum: the N of their "N similar lines" summaries. */
static int lines_with(const char *needle, const char *also, unsigned long long *sum)
{
        FILE *f = fopen(path, "r");
        char line[2048];
        int n = 0;
        CHECK(f != NULL);
        if (sum)
                *sum = 0;
        while (fgets(line, sizeof(line), f)) {
                if (!strstr(line, needle) || (also && !strstr(line, also)))
                        continue;
                n++;
                char *s = strstr(line, " similar line");
                if (s && sum) {
                        while (s > line && s[-1] >= '0' && s[-1] <= '9')
                                s--;
                        *sum += strtoull(s, NULL, 10);
                }
        }
        fclose(f);
        return n;
}

int main(void)
{
        int fd = mkstemp(path), saved = dup(2);
        unsigned long long sum;
        pthread_t t[4];

        CHECK(fd >= 0 && saved >= 0);
        printf("log_test: the log goes to %s (removed if the test passes)\n", path);
        fflush(stdout);
        setenv("KVFERRY_LOG", "debug", 1);
        kvf_log_setup("logtest", "test");
        CHECK(dup2(fd, 2) == 2); /* the log goes to stderr */

        for (long i = 0; i < 4; i++)
                CHECK(pthread_create(&t[i], NULL, flood_a, (void *)i) == 0);
        for (int i = 0; i < 4; i++)
                pthread_join(t[i], NULL);
        for (int i = 0; i < 50; i++) {
                char text[64];
                snprintf(text, sizeof(text), "cause B, message %d", i); /* a different text each time */
                kvf_log_keyed(KVF_LOG_ERROR, "cause B: %d", "%s", text);
        }
        for (int i = 0; i < 30; i++)
                kvf_warn("cause C %d", i);
        for (int i = 0; i < 50; i++)
                kvf_debug("cause D %d", i);
        /* What a message quotes stays one line of text: a request id with a newline and a forged
         * line after it, a terminal escape, bytes that are not UTF-8, a C1 control; UTF-8 kept. */
        kvf_info("req %s: task rejected", "id\n2099-01-01T00:00:00.000Z logtest/test INFO forged\x1b[2J\xff\xc2\x9b\xc3\xa9");
        kvf_log_flush(); /* the window is not over: nothing to report yet */
        int early = lines_with("similar line", NULL, NULL);
        sleep(10);
        usleep(200000);
        kvf_error("cause A, thread %d line %d", 9, 99); /* the window is over: A's count comes with it */
        kvf_log_flush();                                  /* and B's and C's, with their last line */
        kvf_log_flush();                                  /* nothing twice */
        CHECK(dup2(saved, 2) == 2);

        CHECK_EQ(early, 0);
        CHECK_EQ(lines_with("cause A", NULL, NULL), 11);
        CHECK_EQ(lines_with("cause A", "similar line", &sum), 1);
        CHECK_EQ(sum, 90);
        CHECK_EQ(lines_with("thread 9 line 99 (90 similar lines suppressed in the last 10 s)", NULL, NULL), 1);
        CHECK_EQ(lines_with("cause B", NULL, NULL), 11);
        CHECK_EQ(lines_with("cause B", "similar line", &sum), 1);
        CHECK_EQ(sum, 40);
        CHECK_EQ(lines_with("cause B, message 49 (at ", ", the last of 40 similar lines suppressed in the last 10 s)",
                            NULL),
                 1);
        CHECK_EQ(lines_with("test WARN cause C", NULL, NULL), 11);
        CHECK_EQ(lines_with("cause C 29 (at ", "the last of 20 similar lines", NULL), 1);
        CHECK_EQ(lines_with("test DEBUG cause D", NULL, NULL), 50);
        CHECK_EQ(lines_with("forged", NULL, NULL), 1);
        CHECK_EQ(lines_with("INFO req id\\x0a2099-01-01T00:00:00.000Z logtest/test INFO forged\\x1b[2J\\xff\\xc2\\x9b\xc3\xa9: task "
                            "rejected",
                            NULL, NULL),
                 1);
        printf("log_test: 100 lines of A from 4 threads -> 10 + a summary of 90 on its next line; 50 of B "
               "(one cause, 50 texts) -> 10 + a flushed summary of 40; 30 of C -> 10 + 20; 50 debug lines "
               "-> 50\n");
        unlink(path);
        return 0;
}

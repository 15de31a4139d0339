/*
 * Control segment attach: every way a file can be wrong is refused with its
 * own message (wrong magic, not ready, wrong version, truncated, foreign
 * owner, inconsistent regions), and a good one attaches. Also role
 * liveness, the error log's de-duplication, and the counters' names.
 */
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdint.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "check.h"
#include "clock.h"
#include "ctl.h"

static char inst[64], path[128], copy[160];

static void cleanup(void)
{
        kvf_ctl_unlink(inst);
        unlink(copy);
}

/* Copy the good segment to `copy`, changed by `edit` (or not, when NULL). */
static void copy_segment(void (*edit)(uint8_t *b, size_t *n))
{
        int in = open(path, O_RDONLY);
        struct stat st;
        CHECK(in >= 0 && fstat(in, &st) == 0);
        size_t n = (size_t)st.st_size;
        uint8_t *b = malloc(n);
        CHECK(b && read(in, b, n) == (ssize_t)n);
        close(in);
        if (edit)
                edit(b, &n);
        int out = open(copy, O_WRONLY | O_CREAT | O_TRUNC, 0600);
        CHECK(out >= 0 && write(out, b, n) == (ssize_t)n);
        close(out);
        free(b);
}

/* Copy the good segment, let `edit` change it, attach and expect rc and a message. */
static void expect_refused(const char *what, void (*edit)(uint8_t *b, size_t *n), int rc,
                           const char *needle)
{
        copy_segment(edit);
        struct kvf_ctl c;
        int got = kvf_ctl_attach_path(copy, false, &c);
        if (got != rc || !strstr(kvf_err_msg(), needle)) {
                fprintf(stderr, "%s: got %d \"%s\", want %d with \"%s\"\n", what, got, kvf_err_msg(), rc,
                        needle);
                exit(1);
        }
        printf("  %-28s -> %s\n", what, kvf_err_msg());
}

static void bad_magic(uint8_t *b, size_t *n)
{
        (void)n;
        b[0] ^= 0xff;
}
static void not_ready(uint8_t *b, size_t *n)
{
        (void)n;
        memset(b + 8, 0, 4);
}
static void zero_header(uint8_t *b, size_t *n)
{
        (void)n;
        memset(b, 0, 4096);
}
static void bad_version(uint8_t *b, size_t *n)
{
        (void)n;
        uint32_t v = 99;
        memcpy(b + 8, &v, 4);
}
static void truncated(uint8_t *b, size_t *n)
{
        (void)b;
        *n /= 2;
}
static void tiny(uint8_t *b, size_t *n)
{
        (void)b;
        *n = 100;
}
static void moved_region(uint8_t *b, size_t *n)
{
        (void)n;
        struct kvf_ctl_header *h = (struct kvf_ctl_header *)(void *)b;
        h->counters_off += 64;
}
static void odd_ring(uint8_t *b, size_t *n)
{
        (void)n;
        struct kvf_ctl_header *h = (struct kvf_ctl_header *)(void *)b;
        h->ring_capacity[2] = 5000;
}

int main(void)
{
        snprintf(inst, sizeof(inst), "t-ctl-%d", (int)getpid());
        snprintf(path, sizeof(path), "/dev/shm/kvferry.%s", inst);
        snprintf(copy, sizeof(copy), "/dev/shm/kvferry.%s-copy", inst);
        atexit(cleanup);

        /* Names */
        CHECK(kvf_instance_name_check("p0") == 0);
        CHECK(kvf_instance_name_check("") == -EINVAL);
        CHECK(kvf_instance_name_check("../etc") == -EINVAL);
        CHECK_ERR_HAS("only letters, digits");
        CHECK(kvf_instance_name_check(".hidden") == -EINVAL);

        struct kvf_ctl_params p = {.instance = inst, .instance_role = KVF_IROLE_PREFILL,
                                   .backend = KVF_BACKEND_HOST, .reqtab_slots = 8, .max_blocks = 16};
        struct kvf_ctl c, c2;
        CHECK_EQ(kvf_ctl_create(&p, &c), 0);
        struct stat st;
        CHECK(stat(path, &st) == 0 && (st.st_mode & 0777) == 0600);
        /* Not published yet: "not ready", distinct from everything else. */
        CHECK_EQ(kvf_ctl_attach(inst, false, &c2), -EAGAIN);
        CHECK_ERR_HAS("not ready");
        kvf_ctl_publish(&c);
        CHECK_EQ(kvf_ctl_attach(inst, false, &c2), 0);
        CHECK(!strcmp(c2.hdr->instance, inst));
        kvf_ctl_detach(&c2);
        CHECK_EQ(kvf_ctl_create(&p, &c2), -EEXIST);
        CHECK_ERR_HAS("already exists");
        CHECK_EQ(kvf_ctl_attach("t-ctl-nosuch", false, &c2), -ENOENT);
        CHECK_ERR_HAS("no instance 't-ctl-nosuch' on this host");
        /* Another name for this segment (a link anyone may make in /dev/shm, or a copy) reaches
         * nothing: attaching by name is to that instance's own segment only. */
        {
                char alias[64], apath[128];
                snprintf(alias, sizeof(alias), "%s-alias", inst);
                snprintf(apath, sizeof(apath), "/dev/shm/kvferry.%s", alias);
                unlink(apath);
                CHECK(symlink(path, apath) == 0);
                CHECK_EQ(kvf_ctl_attach(alias, false, &c2), -EPERM);
                CHECK_ERR_HAS("is a symbolic link: refusing it");
                printf("  %-28s -> %s\n", "a link to a segment", kvf_err_msg());
                CHECK_EQ(kvf_ctl_attach_peer(alias, false, &c2), -EPERM);
                unlink(apath);
                CHECK(link(path, apath) == 0);
                CHECK_EQ(kvf_ctl_attach(alias, false, &c2), -EPERM);
                CHECK_ERR_HAS("is the segment of instance 't-ctl-");
                printf("  %-28s -> %s\n", "another name for a segment", kvf_err_msg());
                unlink(apath);
        }

        printf("refused segments:\n");
        expect_refused("wrong magic", bad_magic, -EPROTO, "not a kvferry control segment");
        expect_refused("version 0 (being created)", not_ready, -EAGAIN, "not ready");
        expect_refused("header all zero (being created)", zero_header, -EAGAIN, "header is still zero");
        char want_version[64];
        snprintf(want_version, sizeof(want_version), "layout version 99, this build speaks version %u",
                 KVF_LAYOUT_VERSION);
        expect_refused("wrong version", bad_version, -EPROTO, want_version);
        expect_refused("truncated to half", truncated, -EBADMSG, "truncated control segment: the file has");
        expect_refused("truncated to 100 bytes", tiny, -EBADMSG, "header alone needs 4096");
        expect_refused("region offset moved", moved_region, -EBADMSG, "corrupt control segment: counters at offset");
        expect_refused("ring capacity not 2^n", odd_ring, -EBADMSG, "is not a power of two");

        /* Foreign owner: a file we did not create is refused even if we could read it. */
        if (geteuid() == 0) {
                CHECK(chown(copy, 12345, 12345) == 0);
                int out = open(copy, O_WRONLY);
                CHECK(out >= 0);
                close(out);
                CHECK_EQ(kvf_ctl_attach_path(path, false, &c2), 0);
                kvf_ctl_detach(&c2);
                /* restore a good copy, then give it away */
                copy_segment(NULL);
                CHECK(chown(copy, 12345, 12345) == 0);
                CHECK_EQ(kvf_ctl_attach_path(copy, false, &c2), -EPERM);
                CHECK_ERR_HAS("is owned by uid 12345, we run as uid 0: refusing it");
                printf("  %-28s -> %s\n", "foreign owner", kvf_err_msg());
        } else {
                printf("  foreign owner: not root, cannot give a file away; checked by CI (root)\n");
        }
        /* A FIFO at the path is refused, not waited on. */
        unlink(copy);
        CHECK(mkfifo(copy, 0600) == 0);
        CHECK(kvf_ctl_attach_path(copy, false, &c2) == -EINVAL);
        CHECK_ERR_HAS("not a regular file");

        /* Roles: alive while the process runs, dead after, and a zombie is dead. */
        pid_t pid = fork();
        if (pid == 0) {
                struct kvf_ctl cc;
                if (kvf_ctl_attach(inst, true, &cc) < 0)
                        _exit(3);
                kvf_role_begin(&cc, KVF_ROLE_SENDER);
                pause();
                _exit(0);
        }
        uint64_t t0 = kvf_now_ns();
        while (!kvf_role_alive(&c, KVF_ROLE_SENDER, kvf_now_ns()) && kvf_now_ns() - t0 < 5000000000ull)
                usleep(1000);
        CHECK(kvf_role_alive(&c, KVF_ROLE_SENDER, kvf_now_ns()));
        CHECK_EQ(c.roles[KVF_ROLE_SENDER].generation, 1);
        kill(pid, SIGKILL);
        siginfo_t si;
        CHECK(waitid(P_PID, (id_t)pid, &si, WEXITED | WNOWAIT) == 0); /* a zombie now: not reaped yet */
        CHECK(!kvf_role_alive(&c, KVF_ROLE_SENDER, kvf_now_ns()));
        waitpid(pid, NULL, 0);
        CHECK(!kvf_role_alive(&c, KVF_ROLE_SENDER, kvf_now_ns()));
        CHECK_EQ(kvf_role_begin(&c, KVF_ROLE_SENDER), 2);
        CHECK_EQ(c.counters[KVF_CTR_RESTARTS].value, 1);
        CHECK_EQ(kvf_role_begin(&c, KVF_ROLE_ENGINE), 1);
        CHECK_EQ(kvf_role_begin(&c, KVF_ROLE_ENGINE), 2);
        CHECK_EQ(c.counters[KVF_CTR_RESTARTS].value, 1); /* an engine re-attaching is no crash */

        /* Error log: same template de-duplicated, counted, latest text kept. */
        for (int i = 0; i < 5; i++)
                kvf_errlog(&c, KVF_ROLE_SENDER, "req r%d: peer %s unreachable", i, "d0");
        kvf_errlog(&c, KVF_ROLE_SENDER, "something else %d", 1);
        struct kvf_errlog_entry e;
        int used = 0;
        for (unsigned i = 0; i < KVF_ERRLOG_ENTRIES; i++)
                if (kvf_errlog_read(&c, KVF_ROLE_SENDER, i, &e) == 1) {
                        used++;
                        if (strstr(e.text, "unreachable")) {
                                CHECK_EQ(e.count, 5);
                                CHECK(strstr(e.text, "req r4:"));
                        }
                }
        CHECK_EQ(used, 2);
        for (int i = 0; i < KVF_COUNTER_COUNT; i++)
                CHECK(kvf_counter_names[i] && kvf_counter_names[i][0]);
        kvf_ctl_detach(&c);
        printf("ctl_test: all passed\n");
        return 0;
}

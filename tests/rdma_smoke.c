/* rdma_smoke: verbs over librdmacm RC, end to end, with a server and a client process.
 *
 * The client (this process) connects to the server (a child) and:
 *   1. posts a chain of RDMA WRITEs in one ibv_post_send, only every --signal-every'th signalled,
 *      then a WRITE_WITH_IMM; the server sees the immediate on its receive completion, checks
 *      every byte of its buffer and SENDs its verdict back;
 *   2. optionally (--bw-mib) writes that many MiB and reports the throughput next to a memcpy of
 *      the same bytes in the same run (under qemu with rdma_rxe: an emulated figure, meaningless
 *      for a real NIC);
 *   3. writes with a wrong rkey and expects IBV_WC_REM_ACCESS_ERR, then one more write that the
 *      errored QP must flush (IBV_WC_WR_FLUSH_ERR); the server checks its buffer is untouched.
 * Every completion's status, opcode, wr_id and length is checked; every wait has a time limit.
 *
 * Meant to run inside tests/vm/run.sh (addresses from KVF_VM_SERVER_IP, KVF_VM_CLIENT_IP), and
 * as a template for the RDMA transport: setup and teardown in the rdma-core examples' style.
 *
 * Exit codes: 0 pass, 1 fail, 2 usage, 77 no RDMA device here.
 */
#include <arpa/inet.h>
#include <endian.h>
#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <netdb.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <infiniband/verbs.h>
#include <rdma/rdma_cma.h>

#define SMOKE_MAGIC 0x6b766652u /* "kvfR" */
#define IMM_CHAIN 0xc0ffee01u
#define IMM_BW 0xc0ffee02u
#define QUEUE_DEPTH 64
#define RECVS 4 /* receives the server posts before it accepts: an immediate per phase, spare */

/* The server's buffer, in the accept's private data (big-endian on the wire). */
struct conn_info {
        uint32_t magic;
        uint32_t rkey;
        uint64_t addr;
        uint64_t len;
};
_Static_assert(sizeof(struct conn_info) == 24, "conn_info is a wire format");

/* The server's answer to each immediate, SENT back (big-endian on the wire). */
struct verdict {
        uint32_t magic;
        uint32_t imm;
        uint32_t bad_bytes; /* 0: every byte as expected */
        uint32_t first_bad; /* offset of the first wrong byte when bad_bytes > 0 */
};
_Static_assert(sizeof(struct verdict) == 16, "verdict is a wire format");

struct opts {
        const char *server_ip;
        const char *client_ip; /* source address; NULL: the route's */
        const char *port;
        size_t size;
        unsigned writes;
        unsigned signal_every;
        unsigned bw_mib;
        int timeout_ms;
};

/* One side's verbs objects, released by peer_close in reverse order of creation. */
struct peer {
        const char *role;
        struct rdma_event_channel *ec;
        struct rdma_cm_id *listen_id; /* server only */
        struct rdma_cm_id *id;
        struct ibv_pd *pd;
        struct ibv_comp_channel *cc;
        struct ibv_cq *cq;
        unsigned cq_events; /* received, acked at close (ibv_destroy_cq waits for the acks) */
        uint8_t *buf;
        struct ibv_mr *mr;
        struct verdict *msg; /* RECVS + 1 slots: receives (client), the send (server) */
        struct ibv_mr *msg_mr;
        int timeout_ms;
};

static void vsay(const struct peer *p, const char *fmt, va_list ap)
{
        char line[512];
        vsnprintf(line, sizeof(line), fmt, ap);
        fprintf(stderr, "rdma_smoke: %s: %s\n", p->role, line);
}

__attribute__((format(printf, 2, 3))) static void say(const struct peer *p, const char *fmt, ...)
{
        va_list ap;
        va_start(ap, fmt);
        vsay(p, fmt, ap);
        va_end(ap);
}

/* Prints "rdma_smoke: role: what failed: why" where the failure is known and returns -1; the
 * callers pass the -1 up without printing again. */
__attribute__((format(printf, 2, 3))) static int fail(const struct peer *p, const char *fmt, ...)
{
        va_list ap;
        va_start(ap, fmt);
        vsay(p, fmt, ap);
        va_end(ap);
        return -1;
}

static double now_s(void)
{
        struct timespec t;
        clock_gettime(CLOCK_MONOTONIC, &t);
        return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

/* The expected byte at each offset: no short period, so a chunk written to the wrong place or
 * twice shows up. */
static uint8_t pattern(size_t off)
{
        uint64_t x = (uint64_t)off * 0x9e3779b97f4a7c15ull + 0x5bd1e995u;
        x ^= x >> 31;
        x *= 0xbf58476d1ce4e5b9ull;
        x ^= x >> 29;
        return (uint8_t)(x >> 56);
}

/* Returns the number of wrong bytes; *first gets the first one's offset. */
static uint32_t verify(const uint8_t *b, size_t n, uint32_t *first)
{
        uint32_t bad = 0;
        *first = 0;
        for (size_t i = 0; i < n; i++) {
                if (b[i] != pattern(i)) {
                        if (!bad)
                                *first = (uint32_t)i;
                        bad++;
                }
        }
        return bad;
}

/* ---- connection manager events ---- */

/* Waits for the next event on the peer's channel; it must be `want`. Returns 0 and the event
 * (the caller acks it), or -1 with a message. */
static int cm_wait(struct peer *p, enum rdma_cm_event_type want, struct rdma_cm_event **out)
{
        struct pollfd pfd = {.fd = p->ec->fd, .events = POLLIN};
        int rc = poll(&pfd, 1, p->timeout_ms);
        if (rc < 0)
                return fail(p, "waiting for %s: poll: %s", rdma_event_str(want), strerror(errno));
        if (rc == 0)
                return fail(p, "no %s within %d ms", rdma_event_str(want), p->timeout_ms);
        struct rdma_cm_event *ev;
        if (rdma_get_cm_event(p->ec, &ev))
                return fail(p, "rdma_get_cm_event: %s", strerror(errno));
        if (ev->event != want) {
                say(p, "expected %s, got %s (status %d%s%s)", rdma_event_str(want),
                    rdma_event_str(ev->event), ev->status, ev->status < 0 ? ": " : "",
                    ev->status < 0 ? strerror(-ev->status) : "");
                rdma_ack_cm_event(ev);
                return -1;
        }
        *out = ev;
        return 0;
}

static int cm_expect(struct peer *p, enum rdma_cm_event_type want)
{
        struct rdma_cm_event *ev;
        if (cm_wait(p, want, &ev))
                return -1;
        rdma_ack_cm_event(ev);
        return 0;
}

/* ---- completions ---- */

/* Waits for one completion: polls, arms the channel, polls again (a completion that arrived
 * between the first poll and the arming raises no event), then sleeps on the channel's fd. */
static int cq_wait(struct peer *p, struct ibv_wc *wc)
{
        double deadline = now_s() + p->timeout_ms / 1000.0;
        int armed = 0;
        for (;;) {
                int n = ibv_poll_cq(p->cq, 1, wc);
                if (n < 0)
                        return fail(p, "ibv_poll_cq failed (%d)", n);
                if (n == 1)
                        return 0;
                if (!armed) {
                        if (ibv_req_notify_cq(p->cq, 0))
                                return fail(p, "ibv_req_notify_cq: %s", strerror(errno));
                        armed = 1;
                        continue;
                }
                int left = (int)((deadline - now_s()) * 1000.0);
                if (left <= 0)
                        return fail(p, "no completion within %d ms", p->timeout_ms);
                struct pollfd pfd = {.fd = p->cc->fd, .events = POLLIN};
                int rc = poll(&pfd, 1, left);
                if (rc < 0 && errno != EINTR)
                        return fail(p, "poll on the completion channel: %s", strerror(errno));
                if (rc > 0) {
                        struct ibv_cq *cq;
                        void *ctx;
                        if (ibv_get_cq_event(p->cc, &cq, &ctx))
                                return fail(p, "ibv_get_cq_event: %s", strerror(errno));
                        p->cq_events++;
                        armed = 0;
                }
        }
}

static const char *opcode_str(enum ibv_wc_opcode op)
{
        switch (op) {
        case IBV_WC_SEND:
                return "SEND";
        case IBV_WC_RDMA_WRITE:
                return "RDMA_WRITE";
        case IBV_WC_RDMA_READ:
                return "RDMA_READ";
        case IBV_WC_RECV:
                return "RECV";
        case IBV_WC_RECV_RDMA_WITH_IMM:
                return "RECV_RDMA_WITH_IMM";
        default:
                return "other";
        }
}

/* One completion, which must be successful, of opcode `op` and for work request `wr_id`. */
static int cq_expect(struct peer *p, const char *what, enum ibv_wc_opcode op, uint64_t wr_id,
                     struct ibv_wc *wc)
{
        if (cq_wait(p, wc))
                return fail(p, "%s: no completion", what);
        if (wc->status != IBV_WC_SUCCESS)
                return fail(p, "%s: completion of wr %" PRIu64 ": %s (vendor error 0x%x)", what,
                            wc->wr_id, ibv_wc_status_str(wc->status), wc->vendor_err);
        if (wc->opcode != op || wc->wr_id != wr_id)
                return fail(p, "%s: completion %s of wr %" PRIu64 ", expected %s of wr %" PRIu64,
                            what, opcode_str(wc->opcode), wc->wr_id, opcode_str(op), wr_id);
        return 0;
}

/* ---- setup and teardown ---- */

/* The protection domain, completion channel and queue, QP and both memory regions on p->id's
 * device. */
static int peer_setup(struct peer *p, size_t size, int remote_write)
{
        struct ibv_context *verbs = p->id->verbs;
        p->pd = ibv_alloc_pd(verbs);
        if (!p->pd)
                return fail(p, "ibv_alloc_pd: %s", strerror(errno));
        p->cc = ibv_create_comp_channel(verbs);
        if (!p->cc)
                return fail(p, "ibv_create_comp_channel: %s", strerror(errno));
        p->cq = ibv_create_cq(verbs, 2 * QUEUE_DEPTH, NULL, p->cc, 0);
        if (!p->cq)
                return fail(p, "ibv_create_cq: %s", strerror(errno));
        struct ibv_qp_init_attr qa = {
            .send_cq = p->cq,
            .recv_cq = p->cq,
            .cap = {.max_send_wr = QUEUE_DEPTH,
                    .max_recv_wr = QUEUE_DEPTH,
                    .max_send_sge = 1,
                    .max_recv_sge = 1},
            .qp_type = IBV_QPT_RC,
            .sq_sig_all = 0, /* selective signalling: only WRs flagged IBV_SEND_SIGNALED */
        };
        if (rdma_create_qp(p->id, p->pd, &qa))
                return fail(p, "rdma_create_qp: %s", strerror(errno));
        if (posix_memalign((void **)&p->buf, 4096, size))
                return fail(p, "cannot allocate %zu bytes", size);
        memset(p->buf, 0, size);
        int access = IBV_ACCESS_LOCAL_WRITE | (remote_write ? IBV_ACCESS_REMOTE_WRITE : 0);
        p->mr = ibv_reg_mr(p->pd, p->buf, size, access);
        if (!p->mr)
                return fail(p, "ibv_reg_mr of %zu bytes: %s", size, strerror(errno));
        p->msg = calloc(RECVS + 1, sizeof(*p->msg));
        if (!p->msg)
                return fail(p, "out of memory");
        p->msg_mr =
            ibv_reg_mr(p->pd, p->msg, (RECVS + 1) * sizeof(*p->msg), IBV_ACCESS_LOCAL_WRITE);
        if (!p->msg_mr)
                return fail(p, "ibv_reg_mr of the message slots: %s", strerror(errno));
        return 0;
}

/* Releases whatever was created, in reverse order; safe on a partly set up peer. */
static void peer_close(struct peer *p)
{
        if (p->msg_mr)
                ibv_dereg_mr(p->msg_mr);
        free(p->msg);
        if (p->mr)
                ibv_dereg_mr(p->mr);
        free(p->buf);
        if (p->id && p->id->qp)
                rdma_destroy_qp(p->id);
        if (p->cq) {
                ibv_ack_cq_events(p->cq, p->cq_events);
                ibv_destroy_cq(p->cq);
        }
        if (p->cc)
                ibv_destroy_comp_channel(p->cc);
        if (p->pd)
                ibv_dealloc_pd(p->pd);
        if (p->id)
                rdma_destroy_id(p->id);
        if (p->listen_id)
                rdma_destroy_id(p->listen_id);
        if (p->ec)
                rdma_destroy_event_channel(p->ec);
}

static int post_recv(struct peer *p, unsigned slot, int with_buffer)
{
        struct ibv_sge sge = {.addr = (uintptr_t)&p->msg[slot],
                              .length = sizeof(struct verdict),
                              .lkey = p->msg_mr->lkey};
        struct ibv_recv_wr wr = {
            .wr_id = 100 + slot, .sg_list = &sge, .num_sge = with_buffer ? 1 : 0};
        struct ibv_recv_wr *bad;
        int rc = ibv_post_recv(p->id->qp, &wr, &bad);
        if (rc)
                return fail(p, "ibv_post_recv: %s", strerror(rc));
        return 0;
}

static int addr_of(const char *ip, const char *port, struct sockaddr_storage *ss,
                   const struct peer *p)
{
        struct addrinfo hints = {.ai_flags = AI_NUMERICHOST | AI_NUMERICSERV}, *ai;
        int rc = getaddrinfo(ip, port, &hints, &ai);
        if (rc)
                return fail(p, "address %s port %s: %s", ip, port, gai_strerror(rc));
        memcpy(ss, ai->ai_addr, ai->ai_addrlen);
        freeaddrinfo(ai);
        return 0;
}

/* ---- server ---- */

/* Waits for the immediate `imm` on receive `slot` (its write carried `len` bytes), checks the
 * whole buffer and SENDs the verdict; returns 0 when every byte was right. */
static int server_check(struct peer *p, unsigned slot, uint32_t imm, uint32_t len, size_t size)
{
        struct ibv_wc wc;
        if (cq_expect(p, "immediate", IBV_WC_RECV_RDMA_WITH_IMM, 100 + slot, &wc))
                return -1;
        if (!(wc.wc_flags & IBV_WC_WITH_IMM) || ntohl(wc.imm_data) != imm)
                return fail(p,
                            "receive completion without the immediate 0x%x (flags 0x%x, imm 0x%x)",
                            imm, wc.wc_flags, ntohl(wc.imm_data));
        if (wc.byte_len != len)
                return fail(p, "the write with immediate 0x%x carried %u bytes, expected %u", imm,
                            wc.byte_len, len);
        uint32_t first;
        uint32_t bad = verify(p->buf, size, &first);
        say(p, "immediate 0x%x on %s; %zu bytes checked: %s", imm,
            ibv_get_device_name(p->id->verbs->device), size, bad ? "WRONG" : "all as written");
        struct verdict *v = &p->msg[RECVS];
        *v = (struct verdict){.magic = htonl(SMOKE_MAGIC),
                              .imm = htonl(imm),
                              .bad_bytes = htonl(bad),
                              .first_bad = htonl(first)};
        struct ibv_sge sge = {.addr = (uintptr_t)v, .length = sizeof(*v), .lkey = p->msg_mr->lkey};
        struct ibv_send_wr wr = {.wr_id = 200,
                                 .sg_list = &sge,
                                 .num_sge = 1,
                                 .opcode = IBV_WR_SEND,
                                 .send_flags = IBV_SEND_SIGNALED};
        struct ibv_send_wr *badwr;
        int rc = ibv_post_send(p->id->qp, &wr, &badwr);
        if (rc)
                return fail(p, "ibv_post_send of the verdict: %s", strerror(rc));
        if (cq_expect(p, "verdict send", IBV_WC_SEND, 200, &wc))
                return -1;
        if (bad)
                return fail(p, "%u wrong bytes, the first at offset %u: 0x%02x, expected 0x%02x",
                            bad, first, p->buf[first], pattern(first));
        return 0;
}

static int server(const struct opts *o, int ready_fd)
{
        struct peer p = {.role = "server", .timeout_ms = o->timeout_ms};
        struct sockaddr_storage ss;
        struct rdma_cm_event *ev;
        int ok = -1;

        if (addr_of(o->server_ip, o->port, &ss, &p))
                goto out;
        p.ec = rdma_create_event_channel();
        if (!p.ec) {
                fail(&p, "rdma_create_event_channel: %s", strerror(errno));
                goto out;
        }
        if (rdma_create_id(p.ec, &p.listen_id, NULL, RDMA_PS_TCP)) {
                fail(&p, "rdma_create_id: %s", strerror(errno));
                goto out;
        }
        if (rdma_bind_addr(p.listen_id, (struct sockaddr *)&ss)) {
                fail(&p, "bind %s:%s: %s (no RDMA device with that address?)", o->server_ip,
                     o->port, strerror(errno));
                goto out;
        }
        if (rdma_listen(p.listen_id, 1)) {
                fail(&p, "listen on %s:%s: %s", o->server_ip, o->port, strerror(errno));
                goto out;
        }
        if (write(ready_fd, "r", 1) != 1) {
                fail(&p, "cannot tell the client we listen: %s", strerror(errno));
                goto out;
        }
        close(ready_fd);
        ready_fd = -1;

        if (cm_wait(&p, RDMA_CM_EVENT_CONNECT_REQUEST, &ev))
                goto out;
        p.id = ev->id;
        rdma_ack_cm_event(ev);
        if (peer_setup(&p, o->size, 1))
                goto out;
        /* WRITE_WITH_IMM consumes a receive (no buffer needed): post them before accepting, or
         * the client's first immediate meets an RNR NAK. */
        for (unsigned i = 0; i < RECVS; i++)
                if (post_recv(&p, i, 0))
                        goto out;
        struct conn_info ci = {.magic = htonl(SMOKE_MAGIC),
                               .rkey = htonl(p.mr->rkey),
                               .addr = htobe64((uintptr_t)p.buf),
                               .len = htobe64(o->size)};
        struct rdma_conn_param cp = {.private_data = &ci,
                                     .private_data_len = sizeof(ci),
                                     .responder_resources = 1,
                                     .initiator_depth = 1,
                                     .rnr_retry_count = 7};
        if (rdma_accept(p.id, &cp)) {
                fail(&p, "rdma_accept: %s", strerror(errno));
                goto out;
        }
        if (cm_expect(&p, RDMA_CM_EVENT_ESTABLISHED))
                goto out;
        say(&p, "connected on %s", ibv_get_device_name(p.id->verbs->device));

        /* The chain's last chunk carries the immediate (client_chain); the bw pass's, all of it. */
        uint32_t last = (uint32_t)(o->size - o->writes * (o->size / (o->writes + 1)));
        if (server_check(&p, 0, IMM_CHAIN, last, o->size))
                goto out;
        if (o->bw_mib && server_check(&p, 1, IMM_BW, (uint32_t)o->size, o->size))
                goto out;
        /* The client now writes with a wrong rkey and disconnects. */
        if (cm_expect(&p, RDMA_CM_EVENT_DISCONNECTED))
                goto out;
        /* What is left on the queue must be flushed receives, nothing else. */
        struct ibv_wc wc;
        int n;
        while ((n = ibv_poll_cq(p.cq, 1, &wc)) == 1) {
                if (wc.status != IBV_WC_WR_FLUSH_ERR || wc.wr_id < 100 || wc.wr_id >= 100 + RECVS) {
                        fail(&p, "unexpected completion after the disconnect: wr %" PRIu64 " %s %s",
                             wc.wr_id, opcode_str(wc.opcode), ibv_wc_status_str(wc.status));
                        goto out;
                }
        }
        uint32_t first, bad = verify(p.buf, o->size, &first);
        if (bad) {
                fail(&p, "the rejected write changed the buffer: %u bytes from offset %u", bad,
                     first);
                goto out;
        }
        say(&p, "the write with the wrong rkey left the buffer untouched");
        ok = 0;
out:
        if (ready_fd >= 0)
                close(ready_fd);
        peer_close(&p);
        return ok;
}

/* ---- client ---- */

static int client_verdict(struct peer *p, unsigned slot, uint32_t imm)
{
        struct ibv_wc wc;
        if (cq_expect(p, "verdict", IBV_WC_RECV, 100 + slot, &wc))
                return -1;
        const struct verdict *v = &p->msg[slot];
        if (wc.byte_len != sizeof(*v) || ntohl(v->magic) != SMOKE_MAGIC || ntohl(v->imm) != imm)
                return fail(p, "malformed verdict (%u bytes, magic 0x%x, imm 0x%x)", wc.byte_len,
                            ntohl(v->magic), ntohl(v->imm));
        if (v->bad_bytes)
                return fail(p, "the server found %u wrong bytes, the first at offset %u",
                            ntohl(v->bad_bytes), ntohl(v->first_bad));
        return 0;
}

/* Phase 1: a chain of writes in one post, every signal_every'th and the last signalled, then a
 * WRITE_WITH_IMM; the server then checks every byte. */
static int client_chain(struct peer *p, const struct opts *o, const struct conn_info *ci)
{
        unsigned n = o->writes;
        size_t chunk = o->size / (n + 1);
        struct ibv_sge sge[QUEUE_DEPTH];
        struct ibv_send_wr wr[QUEUE_DEPTH], *bad;
        unsigned signalled = 0;
        for (unsigned i = 0; i <= n; i++) {
                size_t off = i * chunk, len = i == n ? o->size - off : chunk;
                sge[i] = (struct ibv_sge){
                    .addr = (uintptr_t)p->buf + off, .length = (uint32_t)len, .lkey = p->mr->lkey};
                wr[i] = (struct ibv_send_wr){
                    .wr_id = i, .sg_list = &sge[i], .num_sge = 1, .opcode = IBV_WR_RDMA_WRITE};
                wr[i].wr.rdma.remote_addr = ci->addr + off;
                wr[i].wr.rdma.rkey = ci->rkey;
                wr[i].next = i + 1 < n ? &wr[i + 1] : NULL;
                if ((i + 1) % o->signal_every == 0 || i + 1 == n)
                        wr[i].send_flags = IBV_SEND_SIGNALED;
        }
        /* The last chunk carries the immediate, posted on its own right behind the chain: RC
         * executes a QP's writes in order, so when the server sees the immediate, the chain's
         * bytes are in its memory too. */
        wr[n].opcode = IBV_WR_RDMA_WRITE_WITH_IMM;
        wr[n].imm_data = htonl(IMM_CHAIN);
        wr[n].send_flags = IBV_SEND_SIGNALED;
        int rc = ibv_post_send(p->id->qp, &wr[0], &bad);
        if (rc)
                return fail(p, "ibv_post_send of %u chained writes: %s (at wr %" PRIu64 ")", n,
                            strerror(rc), bad->wr_id);
        rc = ibv_post_send(p->id->qp, &wr[n], &bad);
        if (rc)
                return fail(p, "ibv_post_send of the write with immediate: %s", strerror(rc));
        struct ibv_wc wc;
        for (unsigned i = 0; i < n; i++) {
                if (!(wr[i].send_flags & IBV_SEND_SIGNALED))
                        continue;
                if (cq_expect(p, "chained write", IBV_WC_RDMA_WRITE, i, &wc))
                        return -1;
                signalled++;
        }
        if (cq_expect(p, "write with immediate", IBV_WC_RDMA_WRITE, n, &wc))
                return -1;
        if (client_verdict(p, 0, IMM_CHAIN))
                return -1;
        say(p,
            "%u chained writes (%u signalled) and a write with immediate, %zu bytes: server "
            "verified every byte",
            n, signalled, o->size);
        return 0;
}

/* Phase 2: bw_mib MiB of 64 KiB writes over the buffer, at most QUEUE_DEPTH outstanding, every
 * 16th signalled; against a memcpy of as many bytes in the same run. */
static int client_bw(struct peer *p, const struct opts *o, const struct conn_info *ci)
{
        const size_t chunk = o->size < 65536 ? o->size : 65536;
        const unsigned batch = 16;
        uint64_t total = (uint64_t)o->bw_mib << 20, posted = 0, done = 0;
        unsigned outstanding = 0, k = 0;
        struct ibv_wc wc;
        double t0 = now_s();
        while (done < total) {
                while (posted < total && outstanding + batch <= QUEUE_DEPTH) {
                        /* batch WRs, the last signalled: its completion frees all of them. */
                        struct ibv_sge sge[16];
                        struct ibv_send_wr wr[16], *bad;
                        for (unsigned i = 0; i < batch; i++) {
                                size_t off = ((k + i) * chunk) % (o->size - o->size % chunk);
                                sge[i] = (struct ibv_sge){.addr = (uintptr_t)p->buf + off,
                                                          .length = (uint32_t)chunk,
                                                          .lkey = p->mr->lkey};
                                wr[i] = (struct ibv_send_wr){.wr_id = 1000 + k + i,
                                                             .sg_list = &sge[i],
                                                             .num_sge = 1,
                                                             .opcode = IBV_WR_RDMA_WRITE};
                                wr[i].wr.rdma.remote_addr = ci->addr + off;
                                wr[i].wr.rdma.rkey = ci->rkey;
                                wr[i].next = i + 1 < batch ? &wr[i + 1] : NULL;
                        }
                        wr[batch - 1].send_flags = IBV_SEND_SIGNALED;
                        int rc = ibv_post_send(p->id->qp, wr, &bad);
                        if (rc)
                                return fail(p, "bw: ibv_post_send: %s", strerror(rc));
                        k += batch;
                        outstanding += batch;
                        posted += (uint64_t)batch * chunk;
                }
                if (cq_wait(p, &wc))
                        return fail(p, "bw: no completion");
                if (wc.status != IBV_WC_SUCCESS || wc.opcode != IBV_WC_RDMA_WRITE)
                        return fail(p, "bw: completion of wr %" PRIu64 ": %s, opcode %s", wc.wr_id,
                                    ibv_wc_status_str(wc.status), opcode_str(wc.opcode));
                outstanding -= batch;
                done += (uint64_t)batch * chunk;
        }
        double rdma_s = now_s() - t0;
        /* The immediate again, so that the server checks the buffer after all of it. */
        struct ibv_sge sge = {
            .addr = (uintptr_t)p->buf, .length = (uint32_t)o->size, .lkey = p->mr->lkey};
        struct ibv_send_wr wr = {.wr_id = 2,
                                 .sg_list = &sge,
                                 .num_sge = 1,
                                 .opcode = IBV_WR_RDMA_WRITE_WITH_IMM,
                                 .send_flags = IBV_SEND_SIGNALED,
                                 .imm_data = htonl(IMM_BW)};
        wr.wr.rdma.remote_addr = ci->addr;
        wr.wr.rdma.rkey = ci->rkey;
        struct ibv_send_wr *bad;
        int rc = ibv_post_send(p->id->qp, &wr, &bad);
        if (rc)
                return fail(p, "bw: ibv_post_send of the write with immediate: %s", strerror(rc));
        if (cq_expect(p, "bw write with immediate", IBV_WC_RDMA_WRITE, 2, &wc) ||
            client_verdict(p, 1, IMM_BW))
                return -1;

        uint8_t *dst = malloc(o->size);
        if (!dst)
                return fail(p, "out of memory");
        double m0 = now_s();
        for (uint64_t c = 0; c < total; c += o->size) {
                memcpy(dst, p->buf, o->size);
                __asm__ volatile("" ::"r"(dst) : "memory"); /* keep every copy */
        }
        double copy_s = now_s() - m0;
        free(dst);
        double mib = (double)total / (1 << 20);
        say(p,
            "bw: %.0f MiB in %.3f s: %.1f MiB/s over rxe; memcpy of the same bytes: %.1f MiB/s; "
            "ratio %.3f (EMULATED: qemu TCG + soft-RoCE, meaningless for a real NIC)",
            mib, rdma_s, mib / rdma_s, mib / copy_s, copy_s / rdma_s);
        return 0;
}

/* After the QP went to the error state: the completion of send `wr_id`, skipping the receives
 * that the error flushed (they may come first: the queue pairs' two queues are not ordered). */
static int cq_wait_send_after_error(struct peer *p, uint64_t wr_id, struct ibv_wc *wc)
{
        for (;;) {
                if (cq_wait(p, wc))
                        return -1;
                if (wc->wr_id == wr_id)
                        return 0;
                if (wc->status != IBV_WC_WR_FLUSH_ERR || wc->wr_id < 100 ||
                    wc->wr_id >= 100 + RECVS)
                        return fail(p, "unexpected completion: wr %" PRIu64 ", %s", wc->wr_id,
                                    ibv_wc_status_str(wc->status));
        }
}

/* Phase 3: a write with a wrong rkey must fail with a remote access error and move the QP to
 * the error state, where the next write is flushed. */
static int client_bad_rkey(struct peer *p, const struct conn_info *ci)
{
        struct ibv_sge sge = {.addr = (uintptr_t)p->buf, .length = 4096, .lkey = p->mr->lkey};
        memset(p->buf, 0xee, 4096); /* never the server's pattern: the server checks */
        struct ibv_send_wr wr = {.wr_id = 3,
                                 .sg_list = &sge,
                                 .num_sge = 1,
                                 .opcode = IBV_WR_RDMA_WRITE,
                                 .send_flags = IBV_SEND_SIGNALED};
        wr.wr.rdma.remote_addr = ci->addr;
        wr.wr.rdma.rkey = ci->rkey ^ 0x00ffff00u; /* another key index: not the server's */
        struct ibv_send_wr *bad;
        int rc = ibv_post_send(p->id->qp, &wr, &bad);
        if (rc)
                return fail(p, "ibv_post_send of the bad-rkey write: %s", strerror(rc));
        struct ibv_wc wc;
        if (cq_wait_send_after_error(p, 3, &wc))
                return fail(p, "the bad-rkey write never completed");
        if (wc.status != IBV_WC_REM_ACCESS_ERR)
                return fail(p, "the bad-rkey write completed with %s, expected %s",
                            ibv_wc_status_str(wc.status), ibv_wc_status_str(IBV_WC_REM_ACCESS_ERR));
        say(p, "write with a wrong rkey: %s, as expected", ibv_wc_status_str(wc.status));

        wr.wr_id = 4;
        wr.wr.rdma.rkey = ci->rkey;
        rc = ibv_post_send(p->id->qp, &wr, &bad);
        if (rc)
                return fail(p, "ibv_post_send after the error: %s", strerror(rc));
        if (cq_wait_send_after_error(p, 4, &wc))
                return fail(p, "the write after the error never completed");
        if (wc.status != IBV_WC_WR_FLUSH_ERR)
                return fail(p, "the write after the error completed with %s, expected %s",
                            ibv_wc_status_str(wc.status), ibv_wc_status_str(IBV_WC_WR_FLUSH_ERR));
        say(p, "the next write on the errored QP: %s, as expected", ibv_wc_status_str(wc.status));
        return 0;
}

static int client(const struct opts *o)
{
        struct peer p = {.role = "client", .timeout_ms = o->timeout_ms};
        struct sockaddr_storage dst, src;
        struct rdma_cm_event *ev;
        int ok = -1;

        if (addr_of(o->server_ip, o->port, &dst, &p) ||
            (o->client_ip && addr_of(o->client_ip, "0", &src, &p)))
                goto out;
        p.ec = rdma_create_event_channel();
        if (!p.ec) {
                fail(&p, "rdma_create_event_channel: %s", strerror(errno));
                goto out;
        }
        if (rdma_create_id(p.ec, &p.id, NULL, RDMA_PS_TCP)) {
                fail(&p, "rdma_create_id: %s", strerror(errno));
                goto out;
        }
        if (rdma_resolve_addr(p.id, o->client_ip ? (struct sockaddr *)&src : NULL,
                              (struct sockaddr *)&dst, o->timeout_ms / 2)) {
                fail(&p, "rdma_resolve_addr %s: %s", o->server_ip, strerror(errno));
                goto out;
        }
        if (cm_expect(&p, RDMA_CM_EVENT_ADDR_RESOLVED))
                goto out;
        /* Half our wait: the kernel's own timeout then arrives as an event, with its status. */
        if (rdma_resolve_route(p.id, o->timeout_ms / 2)) {
                fail(&p, "rdma_resolve_route: %s", strerror(errno));
                goto out;
        }
        if (cm_expect(&p, RDMA_CM_EVENT_ROUTE_RESOLVED))
                goto out;
        if (peer_setup(&p, o->size, 0))
                goto out;
        for (size_t i = 0; i < o->size; i++)
                p.buf[i] = pattern(i);
        for (unsigned i = 0; i < 2; i++)
                if (post_recv(&p, i, 1))
                        goto out;
        struct rdma_conn_param cp = {
            .responder_resources = 1, .initiator_depth = 1, .retry_count = 7, .rnr_retry_count = 7};
        if (rdma_connect(p.id, &cp)) {
                fail(&p, "rdma_connect: %s", strerror(errno));
                goto out;
        }
        if (cm_wait(&p, RDMA_CM_EVENT_ESTABLISHED, &ev))
                goto out;
        /* The peer's private data is input from the network: check its length and contents. */
        struct conn_info ci;
        if (ev->param.conn.private_data_len < sizeof(ci) || !ev->param.conn.private_data) {
                fail(&p, "the accept carries %u bytes of private data, expected %zu",
                     ev->param.conn.private_data_len, sizeof(ci));
                rdma_ack_cm_event(ev);
                goto out;
        }
        memcpy(&ci, ev->param.conn.private_data, sizeof(ci));
        rdma_ack_cm_event(ev);
        ci = (struct conn_info){.magic = ntohl(ci.magic),
                                .rkey = ntohl(ci.rkey),
                                .addr = be64toh(ci.addr),
                                .len = be64toh(ci.len)};
        if (ci.magic != SMOKE_MAGIC || ci.len != o->size) {
                fail(&p, "bad private data: magic 0x%x, length %" PRIu64 " (expected %zu)",
                     ci.magic, ci.len, o->size);
                goto out;
        }
        char sa[INET6_ADDRSTRLEN] = "?", da[INET6_ADDRSTRLEN] = "?";
        struct sockaddr_in *s4 = (struct sockaddr_in *)rdma_get_local_addr(p.id),
                           *d4 = (struct sockaddr_in *)rdma_get_peer_addr(p.id);
        if (s4->sin_family == AF_INET)
                inet_ntop(AF_INET, &s4->sin_addr, sa, sizeof(sa));
        if (d4->sin_family == AF_INET)
                inet_ntop(AF_INET, &d4->sin_addr, da, sizeof(da));
        say(&p, "connected on %s: %s -> %s port %s, RC", ibv_get_device_name(p.id->verbs->device),
            sa, da, o->port);

        if (client_chain(&p, o, &ci))
                goto out;
        if (o->bw_mib && client_bw(&p, o, &ci))
                goto out;
        if (client_bad_rkey(&p, &ci))
                goto out;
        if (rdma_disconnect(p.id)) {
                fail(&p, "rdma_disconnect: %s", strerror(errno));
                goto out;
        }
        if (cm_expect(&p, RDMA_CM_EVENT_DISCONNECTED))
                goto out;
        ok = 0;
out:
        peer_close(&p);
        return ok;
}

/* ---- main ---- */

static void usage(FILE *f)
{
        fprintf(f,
                "usage: rdma_smoke [options]\n"
                "  --server-ip IP      the server's address (default $KVF_VM_SERVER_IP)\n"
                "  --client-ip IP      the client's source address (default $KVF_VM_CLIENT_IP;\n"
                "                      unset: the route's)\n"
                "  --port N            rdma_cm port (default 18515)\n"
                "  --size BYTES        the registered buffer (default 1048576)\n"
                "  --writes N          writes in the chain, 1 to %d (default 16)\n"
                "  --signal-every K    signal every K-th write of the chain (default 4)\n"
                "  --bw-mib N          also write N MiB and report the throughput (default 0)\n"
                "  --timeout-ms MS     limit for each wait (default 10000)\n"
                "  --help, --version\n"
                "Exit codes: 0 pass, 1 fail, 2 usage, 77 no RDMA device here.\n",
                QUEUE_DEPTH - 1);
}

static long number(const char *opt, const char *s, long lo, long hi)
{
        char *end;
        errno = 0;
        long v = strtol(s, &end, 10);
        if (errno || *end || end == s || v < lo || v > hi) {
                fprintf(stderr, "rdma_smoke: %s wants a number from %ld to %ld, not '%s'\n", opt,
                        lo, hi, s);
                exit(2);
        }
        return v;
}

/* Waits up to timeout_ms for the child; kills it (and says so) when it does not end. */
static int reap(pid_t pid, int timeout_ms)
{
        int st;
        for (int waited = 0;; waited += 10) {
                pid_t r = waitpid(pid, &st, WNOHANG);
                if (r == pid)
                        break;
                if (r < 0) {
                        fprintf(stderr, "rdma_smoke: waitpid: %s\n", strerror(errno));
                        return -1;
                }
                if (waited >= timeout_ms) {
                        fprintf(stderr,
                                "rdma_smoke: the server did not exit within %d ms: killed\n",
                                timeout_ms);
                        kill(pid, SIGKILL);
                        waitpid(pid, &st, 0);
                        return -1;
                }
                usleep(10000);
        }
        if (WIFEXITED(st) && WEXITSTATUS(st) == 0)
                return 0;
        if (WIFEXITED(st))
                fprintf(stderr, "rdma_smoke: the server failed (exit %d)\n", WEXITSTATUS(st));
        else
                fprintf(stderr, "rdma_smoke: the server was killed by signal %d\n", WTERMSIG(st));
        return -1;
}

int main(int argc, char **argv)
{
        struct opts o = {.server_ip = getenv("KVF_VM_SERVER_IP"),
                         .client_ip = getenv("KVF_VM_CLIENT_IP"),
                         .port = "18515",
                         .size = 1 << 20,
                         .writes = 16,
                         .signal_every = 4,
                         .timeout_ms = 10000};
        static const struct option lo[] = {{"server-ip", required_argument, 0, 's'},
                                           {"client-ip", required_argument, 0, 'c'},
                                           {"port", required_argument, 0, 'p'},
                                           {"size", required_argument, 0, 'z'},
                                           {"writes", required_argument, 0, 'w'},
                                           {"signal-every", required_argument, 0, 'k'},
                                           {"bw-mib", required_argument, 0, 'b'},
                                           {"timeout-ms", required_argument, 0, 't'},
                                           {"help", no_argument, 0, 'h'},
                                           {"version", no_argument, 0, 'V'},
                                           {0, 0, 0, 0}};
        int c;
        static char port[8];
        while ((c = getopt_long(argc, argv, "", lo, NULL)) != -1) {
                switch (c) {
                case 's':
                        o.server_ip = optarg;
                        break;
                case 'c':
                        o.client_ip = optarg;
                        break;
                case 'p':
                        snprintf(port, sizeof(port), "%ld", number("--port", optarg, 1, 65535));
                        o.port = port;
                        break;
                case 'z':
                        o.size = (size_t)number("--size", optarg, 65536, 1L << 30);
                        break;
                case 'w':
                        o.writes = (unsigned)number("--writes", optarg, 1, QUEUE_DEPTH - 1);
                        break;
                case 'k':
                        o.signal_every = (unsigned)number("--signal-every", optarg, 1, 1000);
                        break;
                case 'b':
                        o.bw_mib = (unsigned)number("--bw-mib", optarg, 0, 1 << 20);
                        break;
                case 't':
                        o.timeout_ms = (int)number("--timeout-ms", optarg, 100, 600000);
                        break;
                case 'h':
                        usage(stdout);
                        return 0;
                case 'V':
                        printf("rdma_smoke (kvferry tests)\n");
                        return 0;
                default:
                        usage(stderr);
                        return 2;
                }
        }
        if (optind < argc) {
                fprintf(stderr, "rdma_smoke: unexpected argument '%s'\n", argv[optind]);
                return 2;
        }
        if (o.client_ip && !*o.client_ip)
                o.client_ip = NULL;
        if (!o.server_ip || !*o.server_ip) {
                fprintf(stderr, "rdma_smoke: no server address: pass --server-ip, or run inside "
                                "tests/vm/run.sh (which sets KVF_VM_SERVER_IP)\n");
                return 2;
        }

        int ndev = 0;
        struct ibv_device **devs = ibv_get_device_list(&ndev);
        if (devs)
                ibv_free_device_list(devs);
        if (ndev == 0) {
                fprintf(stderr, "SKIP: rdma_smoke: no RDMA device here (run it inside "
                                "tests/vm/run.sh, or on a host with rdma_rxe or a NIC)\n");
                return 77;
        }

        /* Nothing registered yet: forking now needs no ibv_fork_init. Both sides end by
         * themselves within their waits; the alarm is the backstop. */
        int pfd[2];
        if (pipe(pfd)) {
                perror("rdma_smoke: pipe");
                return 1;
        }
        fflush(NULL);
        pid_t pid = fork();
        if (pid < 0) {
                perror("rdma_smoke: fork");
                return 1;
        }
        unsigned limit = (unsigned)(o.timeout_ms / 1000) * 8 + 30 + o.bw_mib / 4;
        if (pid == 0) {
                close(pfd[0]);
                alarm(limit);
                _exit(server(&o, pfd[1]) ? 1 : 0);
        }
        close(pfd[1]);
        alarm(limit + 10);
        int rc = 0;
        struct pollfd rp = {.fd = pfd[0], .events = POLLIN};
        char b;
        if (poll(&rp, 1, o.timeout_ms) != 1 || read(pfd[0], &b, 1) != 1) {
                fprintf(stderr, "rdma_smoke: the server did not start listening\n");
                rc = -1;
        }
        close(pfd[0]);
        if (rc == 0)
                rc = client(&o);
        if (rc)
                kill(pid, SIGTERM); /* it would wait out its timeouts otherwise */
        if (reap(pid, o.timeout_ms * 2))
                rc = -1;
        printf("rdma_smoke: %s\n", rc ? "FAIL" : "PASS");
        return rc ? 1 : 0;
}

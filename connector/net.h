/*
 * Sockets and frames for the connector.
 *
 * A frame on a connection between two connectors is an 8-byte header
 * {u32 length, u16 type, u16 flags} in network byte order followed by
 * `length` payload bytes. Control frames carry one msgpack record (the
 * types of records.h, wire section); data frames carry block bytes.
 */
#ifndef KVF_NET_H
#define KVF_NET_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/socket.h>
#include <sys/types.h>

#define KVF_FRAME_HDR 8u
#define KVF_FRAME_MAX (16u << 20) /* control frames; data frames have their own limit */

struct kvf_frame_hdr {
        uint32_t len;
        uint16_t type;
        uint16_t flags;
};

/* Write / read a frame header (KVF_FRAME_HDR bytes, network byte order). */
void kvf_net_put_hdr(uint8_t *b, uint32_t len, uint16_t type, uint16_t flags);
void kvf_net_get_hdr(const uint8_t *b, struct kvf_frame_hdr *h);
/* Parse "host:port" (IPv4 dotted, [IPv6], or a name); port 0 allowed when listening. */
int kvf_net_parse(const char *s, char *host, size_t hostlen, uint16_t *port);
/* Listen on host:port (SO_REUSEADDR); *bound_port receives the port actually bound. */
int kvf_net_listen(const char *host, uint16_t port, int backlog, uint16_t *bound_port);
/* Accept one connection: a blocking socket (tcp: with TCP_NODELAY and keepalive set), or -errno. */
int kvf_net_accept(int listen_fd, bool tcp);
/* Connect with a timeout; returns a blocking socket with TCP_NODELAY and keepalive set. */
int kvf_net_connect(const char *host, uint16_t port, unsigned timeout_ms);
/*
 * A connect that never blocks, for a caller that waits on many sockets at once:
 * start it (host must be a numeric address: -EINVAL, kvf_err not set, for a
 * name, whose resolution may block), then, once the socket polls writable,
 * finish it. start returns a non-blocking socket, *done saying whether it is
 * connected already, or -errno with kvf_err set; finish returns 0 with the
 * socket tuned as kvf_net_connect's (still non-blocking), or -errno with
 * kvf_err set ("connect to HOST:PORT: Connection refused").
 */
int kvf_net_connect_start(const char *host, uint16_t port, bool *done);
int kvf_net_connect_finish(int fd, const char *host, uint16_t port);
/*
 * Same-host control connections: a unix socket file per instance,
 * /dev/shm/kvferry-sock.<uid>/<instance>.ctl, listened on beside the tcp port.
 * The directory is ours only if it is a real directory owned by us with mode
 * 0700 (checked with lstat before every listen and connect): then no other
 * user can take the name, fill the backlog or connect. Anything else (another
 * user made it first, a symlink) and unix sockets are refused with the reason
 * in kvf_err, and the caller uses tcp. A loopback tcp send of a notice cost
 * about 70 us of kernel work on its own path (docs/BENCHMARKS.md). Both ends
 * also check that the other runs as the same user (SO_PEERCRED).
 */
struct kvf_unix_listener {
        int fd;         /* -1: none */
        char path[108]; /* sizeof(sun_path) */
        dev_t dev;      /* of the socket file we bound: a clean stop removes */
        ino_t ino;      /* that file and nothing that replaced it */
};
/* "<dir>/<instance>.ctl" into buf; 0, or -EINVAL / -ENAMETOOLONG with kvf_err set. */
int kvf_net_unix_path(const char *instance, char *buf, size_t len);
/* Make or check the directory, remove a stale socket of ours, bind and listen:
 * the listening socket (also in ul->fd), or -errno with kvf_err saying why. */
int kvf_net_listen_unix(const char *instance, struct kvf_unix_listener *ul);
/* Close the listener and remove its socket file (if it is still the one we bound). */
void kvf_net_close_unix(struct kvf_unix_listener *ul);
/*
 * Connect without ever blocking past timeout_ms (a full backlog is retried
 * until then): a blocking connected socket, or -errno with kvf_err set:
 * -ENOENT / -ECONNREFUSED nobody listens there; -EPERM the directory is not
 * ours; -ETIMEDOUT the backlog stayed full.
 */
int kvf_net_connect_unix(const char *instance, unsigned timeout_ms);
/* The other end of a unix socket runs as our user: 0, or -EPERM with kvf_err set. */
int kvf_net_unix_same_user(int fd);
/* Send/receive exactly n bytes within timeout_ms (fd may be blocking or not). 0 or -errno. */
int kvf_net_write_all(int fd, const void *p, size_t n, unsigned timeout_ms);
int kvf_net_read_all(int fd, void *p, size_t n, unsigned timeout_ms);
/* Write one frame (header + payload) within timeout_ms. */
int kvf_net_send_frame(int fd, uint16_t type, const void *payload, uint32_t len, unsigned timeout_ms);
/*
 * As kvf_net_send_frame, but 0 without sending a byte when the socket has no
 * room now; 1 once the whole frame is sent (a frame the socket took in part
 * is finished with blocking writes: never left half-sent); < 0 on error.
 */
int kvf_net_try_send_frame(int fd, uint16_t type, const void *payload, uint32_t len, unsigned timeout_ms);
/* Read one whole frame into buf (cap bytes) within timeout_ms; -EMSGSIZE if longer than cap. */
int kvf_net_recv_frame(int fd, struct kvf_frame_hdr *h, void *buf, uint32_t cap, unsigned timeout_ms);
/* "a.b.c.d:port" of the other end. */
void kvf_net_peer_name(int fd, char *buf, size_t len);

/*
 * Incremental frame reader for a non-blocking socket: feed it readable
 * bytes with kvf_reader_fill(), then take whole frames with kvf_reader_next().
 */
struct kvf_reader {
        uint8_t *buf;
        uint32_t cap, len, off;
};
int kvf_reader_init(struct kvf_reader *r, uint32_t cap);
void kvf_reader_free(struct kvf_reader *r);
/* Read what the socket has: >0 bytes read, 0 EOF, -EAGAIN nothing now, other -errno. */
int kvf_reader_fill(struct kvf_reader *r, int fd);
/* 1 and a frame (payload points into the reader, valid until the next fill), 0 if incomplete,
 * -EMSGSIZE if the announced frame is larger than the reader can hold. */
int kvf_reader_next(struct kvf_reader *r, struct kvf_frame_hdr *h, const uint8_t **payload);

#endif

/*
 * Descriptors handed between processes of one user over abstract unix
 * sockets (SOCK_SEQPACKET, SCM_RIGHTS). The names are guessable, so both
 * ends check the other's credentials (SO_PEERCRED): a descriptor is never
 * given to, or taken from, another user. Abstract names leave nothing in the
 * file system to clean up or squat. Used by the engine's caches
 * (registration.c); every call returns >= 0 or -errno with kvf_err set.
 */
#ifndef KVF_FDPASS_H
#define KVF_FDPASS_H

#include <stddef.h>
#include <sys/types.h>

/* Descriptors one message carries at most (the kernel's SCM_MAX_FD is 253). */
#define KVF_FDPASS_MAX 250u

/* A listening socket on abstract name `name` (without the leading NUL). */
int kvf_fdpass_listen(const char *name);
/* Connected to `name`, whose listener is the same user; receives time out after timeout_ms. */
int kvf_fdpass_connect(const char *name, int timeout_ms);
/* The peer's pid, when it is the same user; -EPERM when another user. */
int kvf_fdpass_peer(int s, pid_t *pid);
/* One message of len bytes with nfds descriptors (duplicated into the receiver). */
int kvf_fdpass_send(int s, const void *buf, size_t len, const int *fds, unsigned nfds);
/* One message into buf (at most cap bytes): its length; its descriptors (at most maxfds, close-
 * on-exec) into fds and their count into *nfds. A message cut short is -EMSGSIZE, with every
 * descriptor it carried closed. 0: the peer closed. */
ssize_t kvf_fdpass_recv(int s, void *buf, size_t cap, int *fds, unsigned maxfds, unsigned *nfds);

#endif

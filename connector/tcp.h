/*
 * The tcp transport (transfer_protocol "tcp"): io_uring over tcp data connections.
 *
 * Prefill side (tcp_tx.c): `streams` data connections per peer, each with its
 * own thread and io_uring, take frames from the peer's queue (xfer.h) and
 * send them as linked sendmsg chains. Before a transfer's first frame on a
 * connection goes its XOPEN (the destination block ids).
 *
 * Decode side (tcp_rx.c): each data connection has a receiver (its session
 * thread) with its own io_uring. An XOPEN registers a transfer (landing.h); a
 * DATA frame's header is checked against it before its payload is received
 * straight into the cache; anything else disconnects the peer.
 *
 * Wire: the 8-byte frame header of net.h, then for DATA a 24-byte
 * kvf_data_hdr (network byte order) and nblocks * block_bytes of payload.
 * Consecutive runs of one transfer in one send batch are gathered into one
 * DATAV frame (up to KVF_DATAV_RUNS_MAX runs and KVF_DATA_FRAME_MAX bytes):
 * a 16-byte kvf_datav_hdr, nruns 16-byte kvf_datav_run entries, then the
 * runs' payloads in the same order. The receiver checks every run before
 * a byte of payload is read and receives them all with one recvmsg.
 *
 * To a decode rank of another tensor-parallel split (common/tpsplit.h) a
 * block's bytes are not all sent: only the slice of its heads this prefill
 * rank sends that rank, one contiguous range of each block (heads-major
 * [heads][tokens][head_dim]), at `src` in the source block and `dst` in the
 * destination block. Such frames are DATAS: a 24-byte kvf_datas_hdr (the
 * slice's destination offset and length, the same for every block), nruns
 * kvf_datav_run entries, then for each run's blocks in order the slice's
 * bytes (nblocks * len per run; at most KVF_DATAS_BLOCKS_MAX blocks a frame).
 * The receiver writes each slice at offset `dst` of its block.
 *
 * To a decode rank of another block size (one dividing the other) tokens are
 * regrouped (kvf_tp_plan): the transfer's XOPEN carries its source block
 * count (`blocks`), every source block goes, and frames are indexed by source
 * position. Such frames are DATAR: a 24-byte kvf_datas_hdr (nruns 1; `dst`
 * the plan's pieces per group, `len` their bytes, both checked against the
 * receiver's own plan), one kvf_datav_run (layer, tensor, first source
 * position, source blocks), then for each source block in order its plan
 * pieces whose destination position is below the transfer's destination
 * count, each piece's bytes (at most KVF_DATAR_PIECES_MAX pieces a frame).
 * Both sides derive every piece's offsets from the plan: nothing on the wire
 * says where a byte goes but the run.
 */
#ifndef KVF_TCP_H
#define KVF_TCP_H

#include <stdbool.h>
#include <stdint.h>

#include "tcp_config.h"
#include "transport.h"

struct kvf_data_hdr {
        uint64_t key;
        uint32_t layer;
        uint16_t tensor;
        uint16_t pad;
        uint32_t index;   /* first block's position in the transfer's destination list */
        uint32_t nblocks; /* contiguous destination blocks */
};
_Static_assert(sizeof(struct kvf_data_hdr) == 24, "data header size");

/* A gathered frame (KVF_RT_DATAV): several runs of one transfer. */
struct kvf_datav_hdr {
        uint64_t key;
        uint32_t nruns; /* 1 to KVF_DATAV_RUNS_MAX */
        uint32_t pad;
};
struct kvf_datav_run {
        uint32_t layer;
        uint16_t tensor;
        uint16_t pad;
        uint32_t index;
        uint32_t nblocks;
};
_Static_assert(sizeof(struct kvf_datav_hdr) == 16 && sizeof(struct kvf_datav_run) == 16, "datav sizes");

/* A frame of head slices (KVF_RT_DATAS). */
struct kvf_datas_hdr {
        uint64_t key;
        uint32_t nruns; /* 1 to KVF_DATAV_RUNS_MAX */
        uint32_t dst;   /* the slice's offset in each destination block */
        uint32_t len;   /* its bytes (1 to the block's) */
        uint32_t pad;
};
_Static_assert(sizeof(struct kvf_datas_hdr) == 24, "datas header size");

#define KVF_DATA_FRAME_MAX KVF_FRAME_MAX_TCP /* payload bytes per frame (a run is split above it) */
#define KVF_DATAV_RUNS_MAX 64u        /* runs in one gathered frame */
#define KVF_DATAS_BLOCKS_MAX 64u      /* blocks of one DATAS frame (one receive vector each) */
#define KVF_XOPEN_MAX (1u << 20)      /* bytes of an XOPEN record */
#define KVF_DATAR_PIECES_MAX 1024u    /* pieces of one DATAR frame (one vector each; IOV_MAX) */

/* tcp_tx.c: the prefill side's ops */
int tcp_peer_init(struct xfer_peer *xp);
void tcp_start(struct xfer_peer *xp);
void tcp_stop(struct xfer_peer *xp);
void tcp_peer_free(struct xfer_peer *xp);
int tcp_xfer_open(struct xfer_peer *xp, struct xfer *x);
void tcp_xfer_free(struct xfer_peer *xp, struct xfer *x);

/* tcp_rx.c: an accepted tcp data connection (session thread) */
void tcp_serve(struct connector *cn, int fd, const struct peer_identity *id, const char *remote,
               void *state);

#endif

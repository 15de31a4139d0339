/*
 * The counters of an instance: one 64-bit value per cache line in the
 * control segment, added to by any role, read by tools. The list is the
 * contract with ring-dump's JSON output: append, never reorder.
 *
 * The PEERS_* slots are gauges, not counters: the connector's peers by state
 * (connector/peer.c), moved up and down as peers change state and set to 0 by
 * every connector start. KVF_CTR_IS_GAUGE tells them apart.
 */
#ifndef KVF_COUNTERS_H
#define KVF_COUNTERS_H

#define KVF_COUNTER_LIST(X)                                                                        \
        X(TASKS_ACCEPTED, "tasks_accepted")                                                        \
        X(TASKS_REJECTED, "tasks_rejected")                                                        \
        X(CHUNK_RECORDS, "chunk_records")                                                          \
        X(CANCEL_RECORDS, "cancel_records")                                                        \
        X(REQUESTS_FINISHED, "requests_finished")                                                  \
        X(REQUESTS_FAILED, "requests_failed")                                                      \
        X(FAILED_BAD_TASK, "failed_bad_task")                                                      \
        X(FAILED_BLOCK_RANGE, "failed_block_range")                                                \
        X(FAILED_UNKNOWN_PEER, "failed_unknown_peer")                                              \
        X(FAILED_CONNECTION, "failed_connection")                                                  \
        X(FAILED_LAYOUT, "failed_layout_mismatch")                                                 \
        X(FAILED_CANCELLED, "failed_cancelled")                                                    \
        X(FAILED_TIMEOUT, "failed_timeout")                                                        \
        X(FAILED_WRITE, "failed_write")                                                            \
        X(FAILED_AUTH, "failed_auth")                                                              \
        X(LAYERS_SENT, "layers_sent")                                                              \
        X(COPY_BATCHES, "copy_batches")                                                            \
        X(BLOCKS_IPC, "blocks_moved_ipc")                                                          \
        X(BYTES_IPC, "bytes_moved_ipc")                                                            \
        X(BLOCKS_TCP, "blocks_sent_tcp")                                                           \
        X(BYTES_TCP, "bytes_sent_tcp")                                                             \
        X(BYTES_TCP_RECEIVED, "bytes_received_tcp")                                                \
        X(ARRIVALS, "arrivals")                                                                    \
        X(ARRIVALS_DEDUPED, "arrivals_deduplicated")                                               \
        X(RING_FULL, "ring_full_events")                                                           \
        X(RESTARTS, "restarts")                                                                    \
        X(WAKEUPS_SENDER, "wakeups_sender")                                                        \
        X(WAKEUPS_CONNECTOR, "wakeups_connector")                                                  \
        X(RING_REPAIRS, "ring_repairs")                                                            \
        X(REQUESTS_ADOPTED, "requests_adopted")                                                    \
        X(NOTICES_REISSUED, "notices_reissued")                                                    \
        X(PEER_CONNECTS, "peer_connects")                                                          \
        X(PEER_FAILURES, "peer_failures")                                                          \
        X(AUTH_FAILURES, "auth_failures")                                                          \
        X(FRAMES_REJECTED, "frames_rejected")                                                      \
        X(BAD_RECORDS, "bad_records")                                                              \
        X(ERRORS_LOGGED, "errors_logged")                                                          \
        X(FAILED_ENGINE_GONE, "failed_engine_gone")                                                \
        X(FAILED_PEER_ROLE, "failed_peer_role")                                                    \
        X(SESSIONS_ENDED, "engine_sessions_ended")                                                 \
        X(ARRIVALS_STALE, "arrivals_for_ended_sessions")                                           \
        X(PEERS_RETIRED, "peers_retired")                                                          \
        X(NOTICES_IN_DOUBT, "notices_in_doubt_resolved")                                           \
        X(COPY_SLICES, "backlog_slices")                                                           \
        X(RDMA_WRITES, "rdma_write_requests")                                                      \
        X(RDMA_SENDS, "rdma_done_messages_sent")                                                   \
        X(RDMA_POSTS, "rdma_post_calls")                                                           \
        X(RDMA_SIGNALLED, "rdma_signalled_requests")                                               \
        X(BYTES_RDMA, "bytes_sent_rdma")                                                           \
        X(BLOCKS_RDMA, "blocks_sent_rdma")                                                         \
        X(RDMA_COMPLETION_ERRORS, "rdma_completion_errors")                                        \
        X(RDMA_POST_ERRORS, "rdma_post_errors")                                                    \
        X(RDMA_DONE_RECEIVED, "rdma_done_messages_received")                                       \
        X(FRAMES_TCP, "data_frames_sent_tcp")                                                      \
        X(NOTICES_HELD_BACK, "notices_held_back")                                                  \
        X(NOTICES_FAILED, "notices_failed")                                                        \
        X(PEERS_CONNECTED, "peers_connected")                                                      \
        X(PEERS_CONNECTING, "peers_connecting")                                                    \
        X(PEERS_FAILED, "peers_failed")                                                            \
        X(BYTES_TCP_RESENT, "bytes_resent_tcp")                                                    \
        X(NOTICE_PREWAKES, "notice_prewakes")                                                      \
        X(TASKS_HELD_BACK, "tasks_held_back")                                                      \
        X(ARRIVALS_PENDING, "arrivals_withdrawn_waiting")                                          \
        X(CONNECTIONS_OVER_LIMIT, "connections_over_limit")                                        \
        X(COPY_BATCHES_REUSED, "copy_batches_reused")                                              \
        X(NOTICE_REHEARSALS, "notice_rehearsals")

enum kvf_counter_id {
#define KVF_COUNTER_ENUM(id, name) KVF_CTR_##id,
        KVF_COUNTER_LIST(KVF_COUNTER_ENUM)
#undef KVF_COUNTER_ENUM
                KVF_COUNTER_COUNT
};

#define KVF_CTR_IS_GAUGE(id)                                                                       \
        ((id) == KVF_CTR_PEERS_CONNECTED || (id) == KVF_CTR_PEERS_CONNECTING ||                    \
         (id) == KVF_CTR_PEERS_FAILED)

extern const char *const kvf_counter_names[KVF_COUNTER_COUNT];

#endif

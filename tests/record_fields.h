/*
 * Every field of struct kvf_record that the encoder carries, once, for the
 * tests and fuzzers that compare a record with its decoded round trip (ip,
 * port, device, peer_formed and present exist on the decode side only). A field added to the
 * codec is added here, and every comparison then covers it.
 *
 *   KVF_RECORD_FIELDS(NUM, STR, BIN, IDS)
 *     NUM(f)             an integer field
 *     STR(f)             a NUL-terminated string field
 *     BIN(f)             a fixed-size byte array
 *     IDS(p, n, name)    an id array p of n entries, named as on the wire
 */
#ifndef KVF_TEST_RECORD_FIELDS_H
#define KVF_TEST_RECORD_FIELDS_H

#define KVF_RECORD_FIELDS(NUM, STR, BIN, IDS)                                                      \
        NUM(type)                                                                                  \
        STR(request_id)                                                                            \
        STR(peer)                                                                                  \
        STR(reason)                                                                                \
        NUM(current_id)                                                                            \
        NUM(tokens)                                                                                \
        NUM(key)                                                                                   \
        NUM(bytes)                                                                                 \
        NUM(accept_ns)                                                                             \
        NUM(last_layer_ns)                                                                         \
        NUM(done_ns)                                                                               \
        NUM(generation)                                                                            \
        NUM(session)                                                                               \
        NUM(peer_session)                                                                          \
        NUM(withdraw)                                                                              \
        NUM(id_bin)                                                                                \
        NUM(layer)                                                                                 \
        NUM(layer_count)                                                                           \
        NUM(blocks)                                                                                \
        NUM(status)                                                                                \
        NUM(transport)                                                                             \
        NUM(last)                                                                                  \
        NUM(chunked)                                                                               \
        NUM(up)                                                                                    \
        STR(instance)                                                                              \
        STR(purpose)                                                                               \
        NUM(role)                                                                                  \
        NUM(proto)                                                                                 \
        NUM(boot_id)                                                                               \
        BIN(nonce)                                                                                 \
        BIN(proof)                                                                                 \
        NUM(lay_layers)                                                                            \
        NUM(lay_extra)                                                                             \
        NUM(lay_blocks)                                                                            \
        NUM(lay_heads)                                                                             \
        NUM(lay_bsize)                                                                             \
        NUM(lay_hdim)                                                                              \
        NUM(lay_dtype)                                                                             \
        NUM(lay_keyonly)                                                                           \
        NUM(rdma_port)                                                                             \
        NUM(rdma_addr)                                                                             \
        NUM(rdma_len)                                                                              \
        NUM(rdma_rkey)                                                                             \
        BIN(rdma_ticket)                                                                           \
        IDS(src, n_src, "src_block_ids")                                                           \
        IDS(dst, n_dst, "dest_block_ids")                                                          \
        IDS(runs, n_runs, "runs")                                                                  \
        IDS(rdma_parts, n_rdma_parts, "rdma_parts")

#endif

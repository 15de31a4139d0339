#!/usr/bin/python3
"""Records as a Python engine writes and reads them, with Debian's python3-msgpack.

  records_python.py write FILE    records a FastDeploy-style engine submits
  records_python.py check FILE    records kvferry writes (completion, arrival, connect result)
  records_python.py corpus DIR    seed corpus for fuzz/fuzz_records.c

FILE holds frames: 4-byte little-endian record type, 4-byte little-endian length, msgpack bytes.
tests/records_test.c (--python) runs this and checks each record, in order; change both together.
Run with /usr/bin/python3: that is the interpreter python3-msgpack installs into.
"""
import os
import struct
import sys

try:
    import msgpack
except ImportError:
    sys.exit("records_python.py: %s has no msgpack module; install python3-msgpack "
             "(tools/kvferry setup does, as root)" % sys.executable)

TASK, CHUNK, CANCEL, COMPLETION, CONNECT, CONNECT_RESULT, ARRIVAL = 1, 2, 3, 4, 5, 6, 7


def fastdeploy_tasks():
    # FastDeploy's task dict after the cache messager merges the prefill half
    # (request_id, src_block_ids, current_id) with the decode half (ip, rdma_ports,
    # device_ids, transfer_protocol, dest_block_ids, decode_tp_size); the runtime
    # keys it adds (status, layer_idx) and anything else must be ignored.
    rdma = {
        "request_id": "fd-rdma-1",
        "src_block_ids": [100, 101, 102, 103],
        "current_id": 17,
        "need_prefill_tokens": 250,
        "device_ids": [0, 1],
        "transfer_protocol": "rdma",
        "dest_block_ids": [7, 8, 300],
        "ip": "10.0.0.2",
        "rdma_ports": [7100, 7101],
        "decode_tp_size": 2,
        "status": "init",
        "layer_idx": 0,
        "error_msg": None,
        "sampling": {"temperature": 0.7, "stop": ["</s>", b"\x00bin"], "nested": [[1, [2, [3]]]]},
    }
    tcp = {
        "request_id": "fd-tcp-2",
        "src_block_ids": [],
        "dest_block_ids": [],
        "current_id": 0,
        "transfer_protocol": "tcp",
        "ip": "192.168.1.20",
        "port": 7200,
        "chunked": True,
    }
    ipc = {
        "request_id": "fd-ipc-3-\u00e9",
        "src_block_ids": [i * 65537 for i in range(5000)],
        "dest_block_ids": list(range(4999, -1, -1)),
        "current_id": (1 << 40) + 5,
        "transfer_protocol": "ipc",
        "peer": "d0",
        "device_ids": [3],
        "chunked": 1,
    }
    return [(TASK, rdma), (TASK, rdma), (TASK, tcp), (TASK, ipc)]


def engine_records():
    return fastdeploy_tasks() + [
        (CHUNK, {"request_id": "fd-tcp-2", "current_id": 18, "tokens_done": 2048, "last": False}),
        (CHUNK, {"request_id": "fd-tcp-2", "current_id": 19, "tokens_done": 4000, "last": True}),
        (CANCEL, {"request_id": "fd-rdma-1", "why": "client went away"}),
        # FastDeploy's RDMA pre-connect task.
        (CONNECT, {"task_id": "conn-1", "ip": "10.0.0.3", "rdma_ports": [7300, 7301],
                   "transfer_protocol": "rdma"}),
        (CONNECT, {"task_id": "conn-2", "peer": "d1"}),
        # As FastDeploy really builds them: an ipc task naming its peer only by
        # device_ids[rank], ids as bytes, ports and devices as decimal strings.
        (TASK, {"request_id": b"fd-bytes-4", "src_block_ids": [1], "dest_block_ids": [2],
                "current_id": 3, "transfer_protocol": "ipc", "device_ids": ["6", 7]}),
        (TASK, {"request_id": "fd-rdma-5", "src_block_ids": [1], "dest_block_ids": [2],
                "current_id": 3, "transfer_protocol": "rdma", "ip": "10.0.0.2",
                "rdma_ports": ["7100", "7101"]}),
        (CONNECT, {"task_id": b"conn-3", "ip": "10.0.0.3", "port": "7300"}),
    ]


def write_frames(path, records):
    with open(path, "wb") as f:
        for rtype, rec in records:
            body = msgpack.packb(rec, use_bin_type=True)
            f.write(struct.pack("<II", rtype, len(body)))
            f.write(body)


def read_frames(path):
    with open(path, "rb") as f:
        data = f.read()
    off, out = 0, []
    while off < len(data):
        rtype, n = struct.unpack_from("<II", data, off)
        off += 8
        # strict_map_key: kvferry's keys are strings; raw=False: its strings are UTF-8.
        out.append((rtype, msgpack.unpackb(data[off:off + n], raw=False, strict_map_key=True)))
        off += n
    return out


# What records_test.c writes, exactly: keys with empty values (reason when finished) are left out.
EXPECTED_FROM_C = [
    (COMPLETION, {"request_id": "fd-rdma-1", "status": "finished", "peer": "10.0.0.2:7100",
                  "bytes": 1 << 33, "blocks": 12, "accept_ns": 1, "last_layer_ns": 2, "done_ns": 3,
                  "session": 0}),
    (ARRIVAL, {"request_id": "fd-tcp-2", "status": "timed out", "reason": "no layer for 30000 ms",
               "peer": "p0", "bytes": 4096, "blocks": 2, "dest_block_ids": [5, 4294967295],
               "done_ns": (1 << 64) - 1, "session": 0}),
    (CONNECT_RESULT, {"task_id": "conn-1", "peer": "10.0.0.3:7300", "status": "connection error",
                      "reason": "connect to 10.0.0.3:7300: Connection refused", "session": 0}),
    # An id that came as bytes goes back as bytes, so the engine's dict lookup matches.
    (COMPLETION, {"request_id": b"fd-bytes-4", "status": "engine gone", "reason": "engine session 5 ended",
                  "bytes": 0, "blocks": 1, "accept_ns": 0, "last_layer_ns": 0, "done_ns": 9,
                  "session": 5}),
]


def check(path):
    got = read_frames(path)
    if got != EXPECTED_FROM_C:
        for i, (g, w) in enumerate(zip(got, EXPECTED_FROM_C)):
            if g != w:
                print("record #%d differs:\n  got  %r\n  want %r" % (i, g, w), file=sys.stderr)
        if len(got) != len(EXPECTED_FROM_C):
            print("%d records, want %d" % (len(got), len(EXPECTED_FROM_C)), file=sys.stderr)
        sys.exit(1)


def corpus(directory):
    # One file per record: byte 0 = type, byte 1 = rank (what fuzz_records.c reads).
    os.makedirs(directory, exist_ok=True)
    recs = [r for r in engine_records() if r[0] != TASK or len(r[1]["src_block_ids"]) < 100]
    recs += EXPECTED_FROM_C + [
        (8, {"key": 9, "request_id": "r", "peer": "10.0.0.2:7100", "layer": 3, "runs": [0, 10, 4],
             "transfer_protocol": "tcp"}),
        (9, {"key": 9, "request_id": "r", "peer": "d0", "transfer_protocol": "ipc",
             "dest_block_ids": [1, 2], "status": "write error", "reason": "x", "bytes": 1, "blocks": 2}),
        (10, {"key": 9, "request_id": "r", "status": "finished", "bytes": 4096}),
        (11, {"peer": "10.0.0.9:7100", "up": False, "generation": 4, "reason": "heartbeat lost"}),
        (12, {"peer": "10.0.0.9:7100"}),
        # Connector-to-connector records (types 32 and up): they arrive from the network.
        (32, {"proto": 1, "nonce": bytes(range(32)), "purpose": "data"}),
        (33, {"nonce": bytes(32), "proof": b"\xff" * 32}),
        (34, {"proof": bytes(32), "instance": "d0", "role": 2, "generation": 3, "boot_id": 4,
              "layers": 32, "extra_layers": 0, "num_blocks": 1024, "kv_heads": 8,
              "block_size": 64, "head_dim": 128, "dtype": 1, "key_only": 0}),
        (36, {"status": "authentication failed", "reason": "bad proof"}),
        (37, {"key": 9, "request_id": "r", "peer": "p0", "transfer_protocol": "tcp",
              "dest_block_ids": [3], "status": "finished", "generation": 5}),
        (38, {"key": 9, "request_id": "r", "status": "finished"}),
        (39, {}),
    ]
    seen = set()
    for rtype, rec in recs:
        body = msgpack.packb(rec, use_bin_type=True)
        if body in seen:
            continue
        seen.add(body)
        rank = 1 if rec.get("rdma_ports") else 0
        name = "seed-%02d-type%d" % (len(seen), rtype)
        with open(os.path.join(directory, name), "wb") as f:
            f.write(bytes([rtype, rank]) + body)


def main():
    if len(sys.argv) != 3 or sys.argv[1] not in ("write", "check", "corpus"):
        sys.exit(__doc__)
    mode, path = sys.argv[1], sys.argv[2]
    if mode == "write":
        write_frames(path, engine_records())
    elif mode == "check":
        check(path)
    else:
        corpus(path)


if __name__ == "__main__":
    main()

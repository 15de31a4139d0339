#!/usr/bin/python3
"""The engine's caches against the allocator's own, in one run (bench/register_bench.sh starts
the instances):

  register_bench.py OWN_PREFILL OWN_DECODE ENG_PREFILL ENG_DECODE REG100 ROUNDS BLOCKS

throughput: per round, each pair moves the same ipc requests (BLOCKS blocks of every layer each,
the pairs alternating, every byte of the last request verified); the engine pair's caches are
per-layer stacked [2, blocks, ...] host_buffers. registration: REG100 (100 layers) registered as
one allocation (200 views in one region) and as 200 allocations, ROUNDS times each. Prints one
line per measurement and the medians and ratios.
"""
import statistics
import sys
import time

import numpy as np

import kvferry


def wait_all(pre, dec, ids, timeout_s=60):
    left_p, left_d = set(ids), set(ids)
    end = time.monotonic() + timeout_s
    while (left_p or left_d) and time.monotonic() < end:
        for c, left in ((pre, left_p), (dec, left_d)):
            ev = c.poll(timeout_ms=0 if (left_p and left_d) else 20)
            if ev is None:
                continue
            if ev["status"] != "finished":
                sys.exit("FAIL: %r" % ev)
            left.discard(ev["request_id"])
    if left_p or left_d:
        sys.exit("FAIL: %d completions, %d arrivals missing" % (len(left_p), len(left_d)))


def run(pre, dec, dname, blocks, nreq, tag):
    lo = pre.layout
    nl = lo.num_layers + lo.extra_layers
    step = pre.last_step + 1
    ids = []
    for r in range(nreq):
        rid = "bench-%s-%d-%d" % (tag, step, r)
        src = list(range(r * blocks, (r + 1) * blocks))
        pre.submit_task({"request_id": rid, "src_block_ids": src, "dest_block_ids": src,
                         "current_id": step, "transfer_protocol": "ipc", "peer": dname,
                         "peer_session": dec.session})
        ids.append(rid)
    t0 = time.perf_counter()
    for layer in range(nl):
        pre.layer_done(step, layer)
    wait_all(pre, dec, ids)
    dt = time.perf_counter() - t0
    return nreq * blocks * lo.tensors * nl * lo.block_bytes / dt


def stacked(lo):
    nl = lo.num_layers + lo.extra_layers
    return [kvferry.host_buffer(2 * lo.num_blocks * lo.block_bytes).reshape(2, lo.num_blocks,
                                                                            lo.block_bytes)
            for _ in range(nl)]


def main():
    op, od, ep, ed, r100 = sys.argv[1:6]
    rounds, blocks = int(sys.argv[6]), int(sys.argv[7])
    own_p, own_d = kvferry.Client(op), kvferry.Client(od)
    eng_p, eng_d = kvferry.Client(ep), kvferry.Client(ed)
    pc, dc = stacked(eng_p.layout), stacked(eng_d.layout)
    for layer, t in enumerate(pc):
        t[:] = np.random.default_rng(layer).integers(0, 255, t.shape, dtype=np.uint8)
    eng_p.register_caches(pc)
    eng_d.register_caches(dc)
    nreq = eng_p.layout.num_blocks // blocks
    res = {"own": [], "engine": []}
    for rnd in range(rounds + 1):  # round 0 warms up (first touch of every page)
        for name, (p, d, dn) in (("own", (own_p, own_d, od)), ("engine", (eng_p, eng_d, ed))):
            bps = run(p, d, dn, blocks, nreq, name)
            if rnd:
                res[name].append(bps)
                print("round %d %-6s %8.2f GB/s" % (rnd, name, bps / 1e9), flush=True)
    for layer in range(len(pc)):
        if not np.array_equal(pc[layer][:, :nreq * blocks], dc[layer][:, :nreq * blocks]):
            sys.exit("FAIL: layer %d differs on the decode side" % layer)
    mo, me = statistics.median(res["own"]), statistics.median(res["engine"])
    print("throughput (ipc, %d requests x %d blocks x %d layers x K/V of %d bytes): own %.2f GB/s, "
          "engine's caches %.2f GB/s, ratio %.3f" % (nreq, blocks, len(pc), eng_p.layout.block_bytes,
                                                     mo / 1e9, me / 1e9, me / mo))
    # registration time: one allocation vs 200
    c = kvferry.Client(r100)
    lo = c.layout
    nl, nb, bb = lo.num_layers + lo.extra_layers, lo.num_blocks, lo.block_bytes
    one = kvferry.host_buffer(nl * 2 * nb * bb).reshape(nl, 2, nb, bb)
    many = [(kvferry.host_buffer(nb * bb).reshape(nb, bb), kvferry.host_buffer(nb * bb).reshape(nb, bb))
            for _ in range(nl)]
    t1, t200 = [], []
    for rnd in range(rounds):
        for name, caches, out in (("1 allocation", list(one), t1), ("200 allocations", many, t200)):
            t0 = time.perf_counter()
            c.register_caches(caches)
            out.append(time.perf_counter() - t0)
            c.unregister_caches()
            print("round %d registration, %s: %.2f ms" % (rnd + 1, name, out[-1] * 1e3), flush=True)
    m1, m200 = statistics.median(t1), statistics.median(t200)
    print("registration (%d layers x K/V = %d views): 1 allocation %.2f ms, 200 allocations %.2f ms, "
          "ratio %.2f" % (nl, 2 * nl, m1 * 1e3, m200 * 1e3, m200 / m1))


if __name__ == "__main__":
    main()

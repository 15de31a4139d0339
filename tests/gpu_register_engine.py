#!/usr/bin/env python3
"""The engine's caches in GPU memory, from PyTorch (tests/gpu_register_test.sh,
bench/gpu_register_bench.sh). Instances started with --caches engine --backend cuda.

  test  PRE DEC OUT      register per-layer K/V tensors (prefill) and stacked [2, blocks, ...]
                         tensors (decode), transfers over ipc and tcp verified on the GPU, the
                         engine killed mid-transfer (its GPU memory freed, by cudaMemGetInfo),
                         a new engine registering, expandable segments (refused or working)
  exec  PRE DEC         the engine executor (instances of --executor engine): per-layer K/V
                         tensors (prefill) into stacked tensors (decode), layers signalled with
                         layer_done_on_stream, the copies the engine's own (its claims counted,
                         no error), every byte verified on the GPU; the decode engine registers
                         new tensors and the next request lands there
  bench PRE DEC OWNP OWND OUT
                         registration time (64 layers x K/V: one allocation, 128 allocations,
                         and 128 registrations of one allocation each as the per-tensor
                         reference); transfer throughput of registered caches against the
                         allocator's own (OWNP, OWND) in the same run
Writes OUT/summary.json (and prints it); exits 1 with FAIL: on any failure.
"""
import json
import os
import signal
import subprocess
import sys
import time

import torch

import kvferry


def fail(msg):
    print("FAIL: " + msg, file=sys.stderr, flush=True)
    sys.exit(1)


def wait_events(pre, dec, rid, timeout_s=30):
    done = arrived = None
    end = time.monotonic() + timeout_s
    while time.monotonic() < end and (done is None or (dec is not None and arrived is None)):
        for c in (pre, dec):
            if c is None:
                continue
            ev = c.poll(timeout_ms=5)
            if ev is None or ev.get("request_id") != rid:
                continue
            if c is pre:
                done = ev
            else:
                arrived = ev
    return done, arrived


def pattern(n, tag, layer, v, i, dev):
    x = torch.arange(n, device=dev, dtype=torch.int64)
    return ((x * (2 * layer + v + 1) + tag * 131 + i * 7) % 251).to(torch.uint8)


class Caches:
    """A side's caches as torch tensors of uint8 blocks: 'kv' per-layer (K, V) tensors (the
    caching allocator packs several into one segment), 'stacked' one [2, blocks, bb] per layer."""

    def __init__(self, lo, kind, dev):
        nl, nb, bb = lo.num_layers + lo.extra_layers, lo.num_blocks, lo.block_bytes
        self.kind = kind
        if kind == "kv":
            self.t = [tuple(torch.zeros((nb, bb), dtype=torch.uint8, device=dev) for _ in range(2))
                      for _ in range(nl)]
            self.entries = self.t
        else:
            self.t = [torch.zeros((2, nb, bb), dtype=torch.uint8, device=dev) for _ in range(nl)]
            self.entries = self.t

    def block(self, layer, v, b):
        return self.t[layer][v][b]


def transfer(pre, pc, dec, dc, dname, tag, src, dst, transport):
    lo = pre.layout
    nl, bb = lo.num_layers + lo.extra_layers, lo.block_bytes
    for layer in range(nl):
        for v in range(2):
            for i, b in enumerate(src):
                pc.block(layer, v, b).copy_(pattern(bb, tag, layer, v, i, "cuda"))
            for b in dst:
                dc.block(layer, v, b).zero_()
    torch.cuda.synchronize()
    rid = "greg-%d-%s-%d" % (tag, transport, pre.session)
    step = pre.last_step + 1
    pre.submit_task({"request_id": rid, "src_block_ids": src, "dest_block_ids": dst,
                     "current_id": step, "transfer_protocol": transport, "peer": dname,
                     "peer_session": dec.session})
    for layer in range(nl):
        pre.layer_done(step, layer)
    done, arrived = wait_events(pre, dec, rid)
    if done is None or done["status"] != "finished":
        fail("%s: completion %r" % (rid, done))
    if arrived is None or arrived["status"] != "finished":
        fail("%s: arrival %r" % (rid, arrived))
    torch.cuda.synchronize()
    bad = 0
    for layer in range(nl):
        for v in range(2):
            for i, b in enumerate(dst):
                bad += not torch.equal(dc.block(layer, v, b), pattern(bb, tag, layer, v, i, "cuda"))
    if bad:
        fail("%s: %d blocks differ on the GPU" % (rid, bad))
    print("ok: %s: %d blocks x %d layers x K/V moved over %s, every byte equal on the GPU"
          % (rid, len(src), nl, transport), flush=True)


def segments(caches):
    """Distinct cudaMalloc segments behind the tensors, as PyTorch's allocator reports them."""
    ptrs = [t.data_ptr() for e in caches.entries for t in (e if isinstance(e, tuple) else (e,))]
    segs = set()
    for s in torch.cuda.memory_snapshot():
        for p in ptrs:
            if s["address"] <= p < s["address"] + s["total_size"]:
                segs.add(s["address"])
    return len(segs), len(ptrs)


def child(pname, dname, dsession, mode):
    """A prefill engine of its own process: registers, says so, then (kill) starts a transfer
    and publishes its layers slowly until it is killed, or (expandable) reports the refusal."""
    pre = kvferry.Client(pname)
    lo = pre.layout
    pc = Caches(lo, "kv", "cuda")
    try:
        pre.register_caches(pc.entries)
    except kvferry.KvferryError as e:
        print("refused: %s" % e, flush=True)
        return
    print("registered", flush=True)
    if mode == "expandable":
        return
    nl, nb = lo.num_layers + lo.extra_layers, lo.num_blocks
    step = pre.last_step + 1
    pre.submit_task({"request_id": "greg-killed", "src_block_ids": list(range(nb)),
                     "dest_block_ids": list(range(nb)), "current_id": step,
                     "transfer_protocol": "ipc", "peer": dname, "peer_session": dsession})
    pre.layer_done(step, 0)
    print("submitted", flush=True)
    for layer in range(1, nl):
        time.sleep(0.5)
        pre.layer_done(step, layer)
    time.sleep(60)


def spawn(args, env=None, stdin=None):
    return subprocess.Popen([sys.executable, os.path.abspath(__file__), "--child"] + args,
                            stdout=subprocess.PIPE, stdin=stdin, text=True, env=env)


def free_bytes():
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


def settled_free(timeout_s=10):
    """Free GPU memory once it stopped rising (memory other processes release, read again
    every 200 ms until two readings agree within 4 MiB)."""
    prev, end = free_bytes(), time.monotonic() + timeout_s
    while time.monotonic() < end:
        time.sleep(0.2)
        cur = free_bytes()
        if cur - prev < (4 << 20):
            return cur
        prev = cur
    return prev


def test(pname, dname, out):
    summary = {}
    dec = kvferry.Client(dname)
    lo = dec.layout
    nb = lo.num_blocks
    dc = Caches(lo, "stacked", "cuda")
    dec.register_caches(dc.entries)
    pre = kvferry.Client(pname)
    pc = Caches(lo, "kv", "cuda")
    t0 = time.perf_counter()
    pre.register_caches(pc.entries)
    summary["register_ms"] = (time.perf_counter() - t0) * 1e3
    summary["prefill_segments"], summary["prefill_tensors"] = segments(pc)
    print("ok: registered %d tensors in %d segments of PyTorch's allocator (%.1f ms)"
          % (summary["prefill_tensors"], summary["prefill_segments"], summary["register_ms"]))
    # Each allocation's dma-buf, exported by this process at registration, reaches the roles
    # (for NICs): rdma_reg_test maps each instance as a role does and finds every tensor in one.
    rr = os.environ.get("KVF_RDMA_REG_TEST", "")
    if rr and os.path.exists(rr):
        for n in (pname, dname):
            r = subprocess.run([rr, "--instance", n], capture_output=True, text=True)
            line = [x for x in r.stdout.splitlines() if "the engine's GPU caches" in x]
            if r.returncode != 0 or not line:
                fail("the dma-bufs of %s: rc %d: %s %s" % (n, r.returncode, r.stdout[-600:], r.stderr[-600:]))
            print(line[0], flush=True)
        summary["dmabufs_checked"] = True
    transfer(pre, pc, dec, dc, dname, 1, [0, 1, 2, 5], [7, 3, 9, 4], "ipc")
    transfer(pre, pc, dec, dc, dname, 2, list(range(nb // 2)), list(range(nb // 2, nb)), "ipc")
    transfer(pre, pc, dec, dc, dname, 3, [1, 4, 6], [2, 8, 0], "tcp")
    transfer(pre, pc, dec, dc, dname, 4, list(range(nb // 2)), list(range(nb // 2, nb)), "tcp")
    summary["transfers_verified"] = 4
    pre.close()
    del pc
    torch.cuda.empty_cache()

    # The engine killed mid-transfer: its GPU memory freed once every role closed its open.
    cache_bytes = (lo.num_layers + lo.extra_layers) * 2 * nb * lo.block_bytes
    free0 = settled_free()  # (this engine's caches go once the roles closed their opens)
    p = spawn([pname, dname, str(dec.session), "kill"])
    if p.stdout.readline().strip() != "registered":
        fail("the child engine did not register")
    free1 = free_bytes()
    if p.stdout.readline().strip() != "submitted":
        fail("the child engine did not submit")
    time.sleep(0.3)
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    ev = None
    end = time.monotonic() + 20
    while ev is None and time.monotonic() < end:
        e = dec.poll(timeout_ms=50)
        if e is not None and e.get("request_id") == "greg-killed":
            ev = e
    if ev is None:
        fail("the decode side heard nothing of the killed engine's request")
    print("ok: the killed engine's request on the decode side: %r" % (ev,))
    if ev is not None and ev["status"] == "finished":
        print("note: the transfer finished before the kill landed")
    end = time.monotonic() + 20
    free2 = free_bytes()
    while free2 < free0 - (32 << 20) and time.monotonic() < end:
        time.sleep(0.2)
        free2 = free_bytes()
    summary.update(free_before_mib=free0 >> 20, free_registered_mib=free1 >> 20,
                   free_after_kill_mib=free2 >> 20, cache_mib=cache_bytes >> 20)
    print("GPU free memory: %d MiB before the engine, %d MiB while registered, %d MiB after it "
          "was killed (its caches %d MiB)" % (free0 >> 20, free1 >> 20, free2 >> 20,
                                             cache_bytes >> 20))
    if free1 > free0 - cache_bytes // 2:
        fail("the child's caches did not show in the free memory")
    if free2 < free0 - (32 << 20):
        fail("the killed engine's GPU memory was not freed (a role keeps an IPC open)")
    print("ok: the killed engine's GPU memory was freed")

    # A new engine registers again and moves bytes.
    pre = kvferry.Client(pname)
    pc = Caches(lo, "kv", "cuda")
    pre.register_caches(pc.entries)
    transfer(pre, pc, dec, dc, dname, 5, [0, 2, 4], [1, 3, 5], "ipc")
    transfer(pre, pc, dec, dc, dname, 6, [3, 6], [6, 7], "tcp")
    pre.close()
    del pc
    torch.cuda.empty_cache()

    # Expandable segments: refused at registration with the cause and the fix (or working).
    env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True")
    p = spawn([pname, dname, str(dec.session), "expandable"], env=env)
    line = p.stdout.readline().strip()
    p.wait()
    summary["expandable_segments"] = line
    if line.startswith("refused:"):
        if "expandable segments" not in line or "expandable_segments:False" not in line:
            fail("expandable segments refused without the cause and the fix: %s" % line)
        print("ok: expandable segments refused at registration: %s" % line)
    elif line != "registered":
        fail("expandable segments: %r" % line)
    else:
        print("ok: expandable segments registered")
    summary["result"] = "pass"
    with open(os.path.join(out, "gpu_register_test.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(json.dumps(summary))


def executor_counts(name):
    """The engine executor's counters of instance `name` (kvf-ringdump --json)."""
    rd = os.environ.get("KVF_RINGDUMP", "kvf-ringdump")
    d = json.loads(subprocess.run([rd, "--instance", name, "--json"], check=True,
                                  capture_output=True, text=True).stdout)
    found = {}

    def walk(o):
        if isinstance(o, dict):
            for k, v in o.items():
                if k in ("layers_claimed", "copy_kernels", "copy_errors", "plans_open") and isinstance(v, int):
                    found[k] = v
                walk(v)
        elif isinstance(o, list):
            for v in o:
                walk(v)
    walk(d)
    if "layers_claimed" not in found:
        fail("kvf-ringdump of %s shows no engine executor counters" % name)
    return found


def exec_child(pname, dname, dsession):
    """The prefill engine of the engine executor test, in its own process (CUDA opens no IPC
    handle of memory of its own process): registers per-layer K/V tensors, then for each line
    [tag, src, dst] on stdin writes the pattern, submits the task, waits for the sender's plan,
    signals every layer on its stream and prints the completion."""
    pre = kvferry.Client(pname)
    lo = pre.layout
    nl, bb = lo.num_layers + lo.extra_layers, lo.block_bytes
    pc = Caches(lo, "kv", "cuda")
    pre.register_caches(pc.entries)
    print("registered", flush=True)
    stream = torch.cuda.current_stream().cuda_stream
    for line in sys.stdin:
        tag, src, dst = json.loads(line)
        for layer in range(nl):
            for v in range(2):
                for i, b in enumerate(src):
                    pc.block(layer, v, b).copy_(pattern(bb, tag, layer, v, i, "cuda"))
        torch.cuda.synchronize()
        rid = "greg-x%d" % tag
        step = pre.last_step + 1
        pre.submit_task({"request_id": rid, "src_block_ids": src, "dest_block_ids": dst,
                         "current_id": step, "transfer_protocol": "ipc", "peer": dname,
                         "peer_session": dsession})
        # As an engine's forward pass gives it time to: the plan is out before the layers
        # (a layer signalled before it is the sender's to copy).
        end = time.monotonic() + 5
        while executor_counts(pname).get("plans_open", 0) == 0 and time.monotonic() < end:
            time.sleep(0.005)
        for layer in range(nl):
            pre.layer_done_on_stream(stream, step, layer)
        done, _ = wait_events(pre, None, rid)
        print(json.dumps(done), flush=True)


def exec_test(pname, dname):
    dec = kvferry.Client(dname)
    lo = dec.layout
    nb, nl, bb = lo.num_blocks, lo.num_layers + lo.extra_layers, lo.block_bytes
    dc = Caches(lo, "stacked", "cuda")
    dec.register_caches(dc.entries)
    p = spawn([pname, dname, str(dec.session), "exec"], stdin=subprocess.PIPE)
    if p.stdout.readline().strip() != "registered":
        fail("the prefill engine did not register")

    def xfer(tag, src, dst, dc):
        for layer in range(nl):
            for v in range(2):
                for b in dst:
                    dc.block(layer, v, b).zero_()
        torch.cuda.synchronize()
        p.stdin.write(json.dumps([tag, src, dst]) + "\n")
        p.stdin.flush()
        done = json.loads(p.stdout.readline())
        rid = "greg-x%d" % tag
        arrived = None
        end = time.monotonic() + 30
        while arrived is None and time.monotonic() < end:
            ev = dec.poll(timeout_ms=20)
            if ev is not None and ev.get("request_id") == rid:
                arrived = ev
        if not done or done["status"] != "finished" or not arrived or arrived["status"] != "finished":
            fail("%s: completion %r, arrival %r" % (rid, done, arrived))
        torch.cuda.synchronize()
        bad = sum(not torch.equal(dc.block(layer, v, b), pattern(bb, tag, layer, v, i, "cuda"))
                  for layer in range(nl) for v in range(2) for i, b in enumerate(dst))
        if bad:
            fail("%s: %d blocks differ on the GPU" % (rid, bad))
        print("ok: %s: %d blocks x %d layers x K/V, every byte equal on the GPU" % (rid, len(src), nl),
              flush=True)

    c0 = executor_counts(pname)
    xfer(21, [0, 1, 2, 5], [7, 3, 9, 4], dc)
    xfer(22, list(range(nb // 2)), list(range(nb // 2, nb)), dc)
    c1 = executor_counts(pname)
    claimed = c1["layers_claimed"] - c0["layers_claimed"]
    print("ok: the engine executor: %d layers claimed, %d copy kernels, %d errors for 2 requests of %d "
          "layers" % (claimed, c1.get("copy_kernels", 0) - c0.get("copy_kernels", 0),
                      c1.get("copy_errors", 0) - c0.get("copy_errors", 0), nl), flush=True)
    if claimed < nl:
        fail("the engine executor claimed %d layers: the sender copied them instead" % claimed)
    if c1.get("copy_errors", 0) != c0.get("copy_errors", 0):
        fail("the engine executor met errors (the sender's log says which)")
    # The decode engine registers new tensors: the executor opens them, the request lands there.
    dc2 = Caches(lo, "stacked", "cuda")
    dec.register_caches(dc2.entries)
    time.sleep(0.3)
    xfer(23, [3, 4, 8], [10, 11, 12], dc2)
    c2 = executor_counts(pname)
    if c2["layers_claimed"] - c1["layers_claimed"] < nl or c2.get("copy_errors", 0) != c1.get("copy_errors", 0):
        fail("after the decode engine registered anew the engine executor did not copy the request")
    print("ok: the decode engine registered new tensors: the engine executor copied into them", flush=True)
    p.stdin.close()
    p.wait()
    del dc
    dec.close()


def timed_register(c, entries, reps=5):
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        c.register_caches(entries)
        ts.append(time.perf_counter() - t0)
        c.unregister_caches()
    return sorted(ts)[len(ts) // 2]


def throughput(pre, dec, dname, reps):
    lo = pre.layout
    nl, nb = lo.num_layers + lo.extra_layers, lo.num_blocks
    nbytes = nl * 2 * nb * lo.block_bytes
    best = None
    for r in range(reps):
        rid = "greg-bench-%d-%d" % (pre.session, r)
        step = pre.last_step + 1
        t0 = time.perf_counter()
        pre.submit_task({"request_id": rid, "src_block_ids": list(range(nb)),
                         "dest_block_ids": list(range(nb)), "current_id": step,
                         "transfer_protocol": "ipc", "peer": dname, "peer_session": dec.session})
        pre.layer_done(step, nl - 1)
        done, arrived = wait_events(pre, dec, rid)
        dt = time.perf_counter() - t0
        if not done or done["status"] != "finished" or not arrived or arrived["status"] != "finished":
            fail("bench %s: %r %r" % (rid, done, arrived))
        best = dt if best is None else min(best, dt)
    return nbytes / best / 1e9


def bench200(hname, r):
    """200 separate buffers: an instance of 100 layers x K/V, each tensor its own cudaMalloc
    segment, registered in one call, against 200 registration calls (one per tensor)."""
    h = kvferry.Client(hname)
    lo = h.layout
    nl, nb, bb = lo.num_layers + lo.extra_layers, lo.num_blocks, lo.block_bytes
    sep = [tuple(torch.zeros((nb, bb), dtype=torch.uint8, device="cuda") for _ in range(2))
           for _ in range(nl)]
    one = torch.zeros((nl, 2, nb, bb), dtype=torch.uint8, device="cuda")
    one_entries = [one[layer] for layer in range(nl)]
    r["buffers"] = 2 * nl
    r["register_200_buffers_ms"] = timed_register(h, sep) * 1e3
    r["segments_of_200_buffers"] = segments(type("C", (), {"entries": sep})())[0]
    t0 = time.perf_counter()
    for _ in range(2 * nl):
        h.register_caches(one_entries)
    r["register_200_per_buffer_ms"] = (time.perf_counter() - t0) * 1e3
    h.unregister_caches()
    r["per_buffer_over_200_in_one_call"] = r["register_200_per_buffer_ms"] / r["register_200_buffers_ms"]
    del sep, one
    torch.cuda.empty_cache()


def bench(pname, dname, opname, odname, out, hname=None):
    dec = kvferry.Client(dname)
    pre = kvferry.Client(pname)
    lo = pre.layout
    nl, nb, bb = lo.num_layers + lo.extra_layers, lo.num_blocks, lo.block_bytes
    one = torch.zeros((nl, 2, nb, bb), dtype=torch.uint8, device="cuda")
    one_entries = [one[layer] for layer in range(nl)]
    sep = [tuple(torch.zeros((nb, bb), dtype=torch.uint8, device="cuda") for _ in range(2))
           for _ in range(nl)]
    r = {"layers": nl, "blocks": nb, "block_bytes": bb}
    r["register_one_allocation_ms"] = timed_register(pre, one_entries) * 1e3
    r["register_128_tensors_ms"] = timed_register(pre, sep) * 1e3
    r["segments_of_128_tensors"] = segments(type("C", (), {"entries": sep})())[0]
    # The reference: one registration call per tensor (128 calls, one allocation each).
    t0 = time.perf_counter()
    for _ in range(2 * nl):
        pre.register_caches(one_entries)
    r["register_per_tensor_ms"] = (time.perf_counter() - t0) * 1e3
    pre.unregister_caches()
    r["per_tensor_over_whole_set"] = r["register_per_tensor_ms"] / r["register_128_tensors_ms"]
    if hname:
        bench200(hname, r)
    # Throughput: registered caches (one allocation each side) vs the allocator's own.
    pre.register_caches(one_entries)
    dtwo = torch.zeros((nl, 2, nb, bb), dtype=torch.uint8, device="cuda")
    dec.register_caches([dtwo[layer] for layer in range(nl)])
    r["registered_gbps"] = throughput(pre, dec, dname, 10)
    opre, odec = kvferry.Client(opname), kvferry.Client(odname)
    r["own_gbps"] = throughput(opre, odec, odname, 10)
    r["registered_gbps"] = max(r["registered_gbps"], throughput(pre, dec, dname, 10))
    r["registered_over_own"] = r["registered_gbps"] / r["own_gbps"]
    with open(os.path.join(out, "gpu_register_bench.json"), "w") as f:
        json.dump(r, f, indent=1)
    print(json.dumps(r))


if __name__ == "__main__":
    if sys.argv[1] == "--child" and sys.argv[5] == "exec":
        exec_child(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    elif sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5])
    elif sys.argv[1] == "test":
        test(*sys.argv[2:5])
    elif sys.argv[1] == "exec":
        exec_test(*sys.argv[2:4])
    elif sys.argv[1] == "bench":
        bench(*sys.argv[2:8])
    else:
        fail("usage: gpu_register_engine.py test PRE DEC OUT | bench PRE DEC OWNP OWND OUT [H200]")

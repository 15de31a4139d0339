"""kvferry as FastDeploy's cache messager, against an emulated FastDeploy deployment
(tests/fastdeploy_emu): prefill and decode instances of TP ranks, requests of the conversation
trace moved through FastDeploy's interfaces alone and verified byte for byte on the decode
side; failures with FastDeploy's statuses; connect tasks; bad input that the messager survives.

    fastdeploy_test.py --mode per_chunk|per_query --protocol ipc|tcp --requests N [--faults]
"""
import argparse
import os
import random
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "fastdeploy_emu"))
import deployment as dep  # noqa: E402

M = 100003


def fail(msg, *insts):
    for i in insts:
        sys.stderr.write(i.log_tail())
    sys.stderr.write("\nFAIL: %s\n" % msg)
    sys.exit(1)


class Run:
    def __init__(self, a):
        self.a = a
        self.shape = dep.Shape(extra=1 if a.older else 0, scales=a.scales)
        tag = "kvfemu%d%s" % (os.getpid(), a.mode[4])
        base = 1000 + (os.getpid() % 500) * 8  # device labels no other run on this host uses
        pdev = [base + r for r in range(a.tp)]
        ddev = [base + 4 + r for r in range(a.tp)]
        if a.gpu:  # real GPUs: prefill on the first tp, decode on the next tp (or the same)
            ngpu = int(os.environ.get("KVF_TEST_GPUS", "1"))
            pdev = list(range(a.tp))
            ddev = list(range(a.tp, 2 * a.tp)) if ngpu >= 2 * a.tp else pdev
        logdir = os.environ.get("KVFERRY_RUN_DIR", "/tmp")
        self.dec = dep.Instance("decode", a.tp, self.shape, ddev, a.mode, a.protocol, tag, logdir,
                                older=a.older, gpu=a.gpu)
        self.pre = dep.Instance("prefill", a.tp, self.shape, pdev, a.mode, a.protocol, tag, logdir,
                                older=a.older, gpu=a.gpu)
        self.insts = (self.pre, self.dec)
        self.rng = random.Random(7)
        self.free_p = list(range(self.shape.blocks))
        self.free_d = list(range(self.shape.blocks))
        self.fd_step = None
        self.slots_free = list(range(64))
        self.hook = None  # called once, mid-batch, after layer 1 is signalled
        self.step_stall_s = 0.0  # per_query: a stall between a step's two stores (stalled_steps)
        self.writers = []  # GPU caches: prefill rank r's stream (worker.GpuLayerWriter)
        self.host_fired = {}

    def start_writers(self):
        """GPU caches: each prefill rank writes on a stream of its own and raises its layer
        signals from host functions queued after the writes, as FastDeploy's worker does."""
        if self.a.gpu:
            self.writers = [dep.worker.GpuLayerWriter(d) for d in self.pre.devices]

    def write(self, r, t, off, data):
        if self.writers:
            self.writers[r].write(t, off, data)
        else:
            t[off:off + len(data)] = data

    def raise_signal(self, r, fn, tag=None):
        """fn raises a layer signal of prefill rank r: at once on host caches, else from a host
        function after rank r's writes queued so far. A tag notes when it was raised."""
        if self.writers:
            self.writers[r].signal_after(fn, tag)
        else:
            t = time.perf_counter()
            fn()
            if tag is not None:
                self.host_fired[tag] = t

    def fired_at(self, r, tag):
        return (self.writers[r].fired_at if self.writers else self.host_fired).pop(tag)

    def drain(self):
        try:
            for w in self.writers:
                w.drain()
        except dep.worker.AttachError as e:
            fail(str(e), *self.insts)

    def ready(self):
        self.dec.wait_ready()
        self.pre.wait_ready()
        if self.a.mode == "per_query":
            # the engine's step counter near its wrap, so that this run crosses it
            for s in self.pre.signals:
                s.m["step"][:4] = (M - 5).to_bytes(4, "little")
                s.layer(-1)
            time.sleep(0.05)

    def decode_half(self, rid, dest, protocol=None, devices=None, ports=None):
        return {"request_id": rid, "device_ids": [str(d) for d in (devices or self.dec.devices)],
                "ip": "127.0.0.1", "rdma_ports": [str(p) for p in (ports or self.dec.rdma_ports)],
                "transfer_protocol": protocol or self.a.protocol, "dest_block_ids": dest,
                "decode_tp_size": self.a.tp}

    def finished(self, want, timeout=30):
        """get_finished_req until every id in want was answered: {rid: (status, per-rank)}."""
        got = {}
        end = time.monotonic() + timeout
        while len(got) < len(want) and time.monotonic() < end:
            r, items = self.pre.engine.get_finished_req()
            if not r:
                time.sleep(0.002)
                continue
            rid, st = r[0]
            ranks = set(i[0] for i in items)
            if ranks != {rid}:
                fail("ranks answered different requests in one round: %r" % items, *self.insts)
            if rid in got:
                fail("request %s answered twice" % rid, *self.insts)
            got[rid] = (st, items)
        if len(got) < len(want):
            fail("no status within %d s for %s" % (timeout, sorted(set(want) - set(got))[:5]),
                 *self.insts)
        extra = set(got) - set(want)
        if extra:
            fail("statuses for requests never sent: %s" % extra, *self.insts)
        return got

    # -- a batch of requests through one or two forward steps --

    def batch(self, reqs, late_decode=False):
        """reqs: [(rid, tokens, held_blocks)]. Returns the FastDeploy statuses. late_decode:
        decode's halves come after the forward pass (the layers' signals before the tasks)."""
        sh = self.shape
        bs = sh.block_size
        plan = []
        for rid, tokens, held in reqs:
            nb = -(-tokens // bs)
            src = [self.free_p.pop(self.rng.randrange(len(self.free_p))) for _ in range(nb)]
            dst = [self.free_d.pop(self.rng.randrange(len(self.free_d))) for _ in range(nb - held)]
            slot = self.slots_free.pop(0)
            plan.append(dict(rid=rid, tokens=tokens, held=held, src=src, dst=dst, slot=slot))
        # decode: the blocks it reserved hold a filler, so that untouched bytes show
        for r in range(self.a.tp):
            for q in plan:
                for layer in range(sh.all_layers):
                    for v, bb in sh.tensors():
                        t = self.dec.caches[r].tensor(layer, v)
                        for d in q["dst"]:
                            t[d * bb:(d + 1) * bb] = b"\xa5" * bb
        per_chunk = self.a.mode == "per_chunk"
        self.drain()
        if not per_chunk:
            first_step = (self.pre.signals[0].step() + 1) % M
        # the prefill engine's halves, then decode's (the splitwise connector's order for ipc)
        halves = []
        for q in plan:
            halves.append({"request_id": q["rid"], "src_block_ids": q["src"],
                           "current_id": q["slot"] if per_chunk else first_step,
                           "need_prefill_tokens": q["tokens"]})
        self.pre.engine.put_cache_info(halves)
        dec = []
        for q in plan:
            dest = ([-1] * q["held"] + q["dst"]) if per_chunk else q["dst"]
            dec.append(self.decode_half(q["rid"], dest))
        if not late_decode:
            self.pre.engine.put_cache_info(dec)
        # the forward pass: chunks of at most 96 tokens, every layer written then signalled
        done = {q["rid"]: 0 for q in plan}
        while any(done[q["rid"]] < q["tokens"] for q in plan):
            chunk = []
            for q in plan:
                b = done[q["rid"]]
                if b < q["tokens"]:
                    n = min(96, q["tokens"] - b) if per_chunk else q["tokens"] - b
                    chunk.append((q, b, n))
            if not per_chunk:
                for r, s in enumerate(self.pre.signals):
                    self.raise_signal(r, lambda s=s: s.begin_step(self.step_stall_s))
            for layer in range(sh.all_layers):
                for r in range(self.a.tp):
                    for v, bb in sh.tensors():
                        t = self.pre.caches[r].tensor(layer, v)
                        for q, b, n in chunk:
                            for bi in range(b // bs, -(-(b + n) // bs)):
                                blk = q["src"][bi]
                                self.write(r, t, blk * bb,
                                           dep.pattern(q["rid"], layer, v, bi, r, bb))
                    sg = self.pre.signals[r]
                    if per_chunk:
                        trip = [(q["slot"], b, n) for q, b, n in chunk]
                        self.raise_signal(r, lambda sg=sg, layer=layer, trip=trip: sg.send(layer, trip))
                    else:
                        self.raise_signal(r, lambda sg=sg, layer=layer: sg.layer(layer))
                if layer == 1 and self.hook:
                    self.hook()
                    self.hook = None
            for q, b, n in chunk:
                done[q["rid"]] = b + n
        self.drain()
        if late_decode:
            time.sleep(0.01)
            self.pre.engine.put_cache_info(dec)
        got = self.finished([q["rid"] for q in plan])
        # verify every finished request on every decode rank, byte for byte
        for q in plan:
            st = got[q["rid"]][0]
            if st != "finished":
                continue
            for r in range(self.a.tp):
                for layer in range(sh.all_layers):
                    for v, bb in sh.tensors():
                        t = self.dec.caches[r].tensor(layer, v)
                        for i, d in enumerate(q["dst"]):
                            want = dep.pattern(q["rid"], layer, v, i + q["held"], r, bb)
                            got_b = t[d * bb:(d + 1) * bb]
                            if got_b != want:
                                # Whose bytes are there (the pattern names its request, layer,
                                # tensor, block and rank), or none: what went wrong, at a glance.
                                fail("%s: rank %d layer %d tensor %d block %d (dest %d) differs: holds %r, "
                                     "wants %r; the batch: %s; %s"
                                     % (q["rid"], r, layer, v, i, d, bytes(got_b[:40]), bytes(want[:40]),
                                        {x["rid"]: got[x["rid"]][0] for x in plan}, self.wrong(q)),
                                     *self.insts)
        for q in plan:
            self.free_p += q["src"]
            self.free_d += q["dst"]
            self.slots_free.append(q["slot"])
        return {rid: v[0] for rid, v in got.items()}, sum(len(q["dst"]) for q in plan)

    def wrong(self, q):
        """Every block of q that differs at the decode side, by (rank, layer): how many of its
        blocks hold another request's bytes, and how many still the filler (never written)."""
        sh = self.shape
        out = []
        for r in range(self.a.tp):
            for layer in range(sh.all_layers):
                other = filler = 0
                for v, bb in sh.tensors():
                    t = self.dec.caches[r].tensor(layer, v)
                    for i, d in enumerate(q["dst"]):
                        b = bytes(t[d * bb:(d + 1) * bb])
                        if b != dep.pattern(q["rid"], layer, v, i + q["held"], r, bb):
                            if b == b"\xa5" * bb:
                                filler += 1
                            else:
                                other += 1
                if other or filler:
                    out.append("rank %d layer %d: %d foreign, %d unwritten" % (r, layer, other, filler))
        return "of %d blocks a layer and tensor: %s" % (len(q["dst"]), ", ".join(out))

    def trace(self, n, per_batch=4):
        lengths = dep.trace_lengths(n)
        t0 = time.monotonic()
        blocks = lates = 0
        for i in range(0, n, per_batch):
            reqs = []
            for j, ln in enumerate(lengths[i:i + per_batch]):
                tokens = max(1, min(ln // 24, 40 * self.shape.block_size))
                held = 2 if (i + j) % 5 == 3 and tokens > 3 * self.shape.block_size else 0
                reqs.append(("req-%d" % (i + j), tokens, held))
            late = (i // per_batch) % 3 == 2
            st, nb = self.batch(reqs, late_decode=late)
            lates += late
            blocks += nb
            bad = {k: v for k, v in st.items() if v != "finished"}
            if bad:
                fail("trace requests failed: %r" % bad, *self.insts)
        print("ok: %d trace requests (%s, %s, %d ranks) finished and verified byte for byte on "
              "every decode rank: %d blocks x %d layers x %s, %d batches with decode's "
              "halves after the layers, %.1f s"
              % (n, self.a.mode, self.a.protocol, self.a.tp, blocks, self.shape.all_layers,
                 "(K, V, K scales, V scales)" if self.shape.scale_bytes else "2 tensors", lates,
                 time.monotonic() - t0))

    # -- failures, bad input, connect tasks --

    def faults(self):
        sh = self.shape
        pc = self.a.mode == "per_chunk"
        cur = lambda slot: slot if pc else (self.pre.signals[0].step() + 1) % M  # noqa: E731
        ids = {}

        def put(rid, p_half, d_half):
            self.pre.engine.put_cache_info([p_half])
            if d_half is not None:
                self.pre.engine.put_cache_info([d_half])
            ids[rid] = None

        # an unknown peer: decode devices no instance serves
        put("bad-peer", {"request_id": "bad-peer", "src_block_ids": [1], "current_id": cur(50),
                         "need_prefill_tokens": 16},
            self.decode_half("bad-peer", [2], protocol="ipc", devices=[60001, 60002]))
        # a dead peer: nobody listens at decode's address any more
        dead = [dep.free_port() for _ in range(self.a.tp)]
        put("dead-peer", {"request_id": "dead-peer", "src_block_ids": [7], "current_id": cur(54),
                          "need_prefill_tokens": 16},
            self.decode_half("dead-peer", [8], protocol="tcp", ports=dead))
        # a block id out of range
        put("bad-range", {"request_id": "bad-range", "src_block_ids": [sh.blocks + 7],
                          "current_id": cur(51), "need_prefill_tokens": 16},
            self.decode_half("bad-range", [3]))
        # a malformed half: dest_block_ids is not a list of ids
        put("bad-dict", {"request_id": "bad-dict", "src_block_ids": [4], "current_id": cur(52),
                         "need_prefill_tokens": 16},
            dict(self.decode_half("bad-dict", [5]), dest_block_ids="oops"))
        # decode could not take it: its half is an error_msg
        put("dec-error", {"request_id": "dec-error", "src_block_ids": [6], "current_id": cur(53),
                          "need_prefill_tokens": 16},
            {"request_id": "dec-error", "error_msg": "decode has no free blocks"})
        # garbage in the list: no request id at all (logged, nothing answered)
        self.pre.engine.put_cache_info([{"no": "request id"}, "not a dict"])
        want = {"bad-peer": "connection error" if pc else "connect error",
                "dead-peer": "connection error" if pc else "connect error",
                "bad-range": "write cache error", "bad-dict": "write cache error",
                "dec-error": "write cache error"}
        if pc:
            # signals for slots no task holds, and a message kvferry refuses: both logged
            for r in range(self.a.tp):
                for layer in range(sh.all_layers):
                    self.pre.signals[r].send(layer, [(200, 0, 16), (201, 16, 16)])
                self.pre.signals[r].send(0, [], count=9999)
        got = self.finished(list(want))
        for rid, st in want.items():
            if got[rid][0] != st:
                fail("%s: %r, expected %r" % (rid, got[rid], st), *self.insts)
        print("ok: unknown and dead peers -> %r, bad block id, malformed dict and decode's error_msg -> %r; "
              "a list with no request ids, signals of unknown slots and a bad message refused"
              % (want["bad-peer"], "write cache error"))
        # connect tasks: the decode ranks' ports (connected), and a port nobody listens on
        for tid, ports, ok in (("c-ok", self.dec.rdma_ports, True),
                               ("c-bad", [dep.free_port() for _ in range(self.a.tp)], False)):
            self.pre.engine.put_connect_rdma_task({"task_id": tid, "ip": "127.0.0.1",
                                                   "rdma_ports": ports})
            end = time.monotonic() + 40
            resp = None
            while resp is None and time.monotonic() < end:
                resp = self.pre.engine.get_connect_rdma_task_response()
                time.sleep(0.005)
            if not resp or resp["task_id"] != tid or resp["success"] != ok:
                fail("connect task %s: %r" % (tid, resp), *self.insts)
        print("ok: connect tasks answered: success for the decode ranks, failure for a dead port")
        # the messagers still serve
        self.trace(8)
        # the prefill engine's queue server goes away and comes back: the messagers say so,
        # stay up, connect again and serve
        try:
            self.pre.restart_queue()
        except RuntimeError as e:
            fail(str(e), *self.insts)
        self.trace(8)
        print("ok: the queue server went away and came back: the messagers reconnected and served")

    def stalled_steps(self, n=12, stall_s=0.15):
        """per_query: the engine held up between writing a new step and its -1, for longer than
        the bridge's polls, with the old step's last layer still in the layer value. That value
        must not be taken for the new step's: its requests would be sent before their layers
        are written, and the byte-for-byte check says so."""
        self.step_stall_s = stall_s
        try:
            self.trace(n)
        finally:
            self.step_stall_s = 0.0
        print("ok: per_query: a %d ms stall between a step's value and its -1 (the old step's last "
              "layer standing beside the new step): no layer sent early, every byte verified"
              % int(stall_s * 1000))

    def latency(self, n=30):
        """From a layer's signal to its bytes in the decode cache (rank 0, host caches): the
        bridge, the sender and the copy, with no Python of the messager in between."""
        sh = self.shape
        pc = self.a.mode == "per_chunk"
        bb = sh.block_bytes
        got = []
        for i in range(n):
            rid = "lat-%d-%d" % (os.getpid(), i)
            src, dst = [self.free_p.pop()], [self.free_d.pop()]
            slot = self.slots_free.pop(0)
            if not pc:
                for sg in self.pre.signals:
                    step = sg.begin_step()
            for r in range(self.a.tp):
                for layer in range(sh.all_layers):
                    self.dec.caches[r].tensor(layer, 1)[dst[0] * bb:(dst[0] + 1) * bb] = b"\0" * bb
            self.pre.engine.put_cache_info([{"request_id": rid, "src_block_ids": src,
                                             "current_id": slot if pc else step,
                                             "need_prefill_tokens": sh.block_size}])
            self.pre.engine.put_cache_info([self.decode_half(rid, dst)])
            time.sleep(0.02)  # the task is in kvferry before its layers come
            last = sh.all_layers - 1
            want = None
            for layer in range(sh.all_layers):
                for r in range(self.a.tp):
                    for v in (0, 1):
                        pat = dep.pattern(rid, layer, v, 0, r, bb)
                        self.pre.caches[r].tensor(layer, v)[src[0] * bb:(src[0] + 1) * bb] = pat
                        if r == 0 and layer == last and v == 1:
                            want = pat
                t = self.dec.caches[0].tensor(last, 1)
                for r in range(self.a.tp):
                    t0 = time.perf_counter()
                    if pc:
                        self.pre.signals[r].send(layer, [(slot, 0, sh.block_size)])
                    else:
                        self.pre.signals[r].layer(layer)
                    if r == 0 and layer == last:
                        end = t0 + 1.0
                        while t[dst[0] * bb:(dst[0] + 1) * bb] != want and time.perf_counter() < end:
                            pass
                        got.append(time.perf_counter() - t0)
            self.finished([rid])
            self.free_p += src
            self.free_d += dst
            self.slots_free.append(slot)
        got.sort()
        p50, p90 = got[len(got) // 2] * 1e6, got[int(len(got) * 0.9)] * 1e6
        if got[len(got) // 2] > 0.05:
            fail("last layer's signal -> bytes on decode: p50 %.0f us" % p50, *self.insts)
        print("ok: last layer's signal -> its bytes in the decode cache (%s, %s): p50 %.0f us, "
              "p90 %.0f us, max %.0f us over %d requests (a Python spin reading the block)"
              % (self.a.mode, self.a.protocol, p50, p90, got[-1] * 1e6, n))

    def bench(self, n, blocks=8):
        """n requests of `blocks` blocks, one at a time, every layer written then signalled (on
        GPU caches from host functions after the writes): the last layer's signal -> the last
        block in decode rank 0's cache (this driver's clock), then the prefill rank 0 sender's
        histograms from kvf-ringdump --json (layer-done -> copy start; last layer -> done)."""
        import json
        import subprocess
        sh = self.shape
        pc = self.a.mode == "per_chunk"
        bb, last, bs = sh.block_bytes, sh.all_layers - 1, sh.block_size
        sys.setswitchinterval(0.0002)  # the host functions take the GIL from a spinning driver
        tails = []
        t_start = time.monotonic()
        for i in range(n):
            rid = "bench-%d-%d" % (os.getpid(), i)
            src = [self.free_p.pop(self.rng.randrange(len(self.free_p))) for _ in range(blocks)]
            dst = [self.free_d.pop(self.rng.randrange(len(self.free_d))) for _ in range(blocks)]
            slot = self.slots_free.pop(0)
            self.drain()
            step = None if pc else (self.pre.signals[0].step() + 1) % M
            self.pre.engine.put_cache_info([{"request_id": rid, "src_block_ids": src,
                                             "current_id": slot if pc else step,
                                             "need_prefill_tokens": blocks * bs}])
            self.pre.engine.put_cache_info([self.decode_half(rid, dst)])
            time.sleep(0.005)  # the task reaches kvferry before its layers (FastDeploy's order)
            if not pc:
                for r, sg in enumerate(self.pre.signals):
                    self.raise_signal(r, sg.begin_step)
            for layer in range(sh.all_layers):
                for r in range(self.a.tp):
                    for v in (0, 1):
                        t = self.pre.caches[r].tensor(layer, v)
                        for bi, blk in enumerate(src):
                            self.write(r, t, blk * bb, dep.pattern(rid, layer, v, bi, r, bb))
                    sg = self.pre.signals[r]
                    tag = (rid, r) if layer == last else None
                    if pc:
                        trip = [(slot, 0, blocks * bs)]
                        self.raise_signal(r, lambda sg=sg, layer=layer, trip=trip: sg.send(layer, trip),
                                          tag)
                    else:
                        self.raise_signal(r, lambda sg=sg, layer=layer: sg.layer(layer), tag)
            want = dep.pattern(rid, last, 1, blocks - 1, 0, bb)
            t = self.dec.caches[0].tensor(last, 1)
            end = time.perf_counter() + 10
            while t[dst[-1] * bb:(dst[-1] + 1) * bb] != want and time.perf_counter() < end:
                pass
            seen = time.perf_counter()
            self.drain()
            if seen >= end:
                fail("%s: the last block never reached decode rank 0" % rid, *self.insts)
            tails.append(seen - self.fired_at(0, (rid, 0)))
            for r in range(1, self.a.tp):
                self.fired_at(r, (rid, r))
            got = self.finished([rid])
            if got[rid][0] != "finished":
                fail("%s: %r" % (rid, got[rid]), *self.insts)
            for r in range(self.a.tp):
                for layer in range(sh.all_layers):
                    for v in (0, 1):
                        tt = self.dec.caches[r].tensor(layer, v)
                        for bi, d in enumerate(dst):
                            if tt[d * bb:(d + 1) * bb] != dep.pattern(rid, layer, v, bi, r, bb):
                                fail("%s: rank %d layer %d tensor %d block %d differs"
                                     % (rid, r, layer, v, bi), *self.insts)
            self.free_p += src
            self.free_d += dst
            self.slots_free.append(slot)
        tails.sort()
        q = lambda xs, f: xs[min(len(xs) - 1, int(len(xs) * f))] * 1e6  # noqa: E731
        build = os.environ.get("KVFERRY_BUILD", os.path.join(dep.ROOT, "build"))
        inst = "fd%s-prefill-0" % self.pre.suffix
        out = subprocess.run([os.path.join(build, "kvf-ringdump"), "--instance", inst, "--json",
                              "--records", "0"], capture_output=True, text=True)
        if out.returncode != 0:
            fail("kvf-ringdump %s: %s" % (inst, out.stderr.strip()), *self.insts)
        h = json.loads(out.stdout)["histograms"]
        res = {"mode": self.a.mode, "protocol": self.a.protocol, "gpu": bool(self.a.gpu),
               "requests": n, "blocks": blocks, "layers": sh.all_layers, "block_bytes": bb,
               "signal_to_copy_p50_us": h["layer_to_copy_ns"]["p50"] / 1e3,
               "signal_to_copy_p99_us": h["layer_to_copy_ns"]["p99"] / 1e3,
               "signal_to_copy_count": h["layer_to_copy_ns"]["count"],
               "last_to_done_p50_us": h["last_layer_to_done_ns"]["p50"] / 1e3,
               "last_to_done_p99_us": h["last_layer_to_done_ns"]["p99"] / 1e3,
               "tail_p50_us": q(tails, 0.5), "tail_p99_us": q(tails, 0.99),
               "fastdeploy_poll_us": 1000.0}
        res["fastdeploy_poll_over_signal_to_copy_p50"] = \
            1000.0 / max(res["signal_to_copy_p50_us"], 1e-3)
        res["fastdeploy_poll_over_tail_p50"] = 1000.0 / max(res["tail_p50_us"], 1e-3)
        print("ok: bench %s over %s (%s caches), %d requests x %d blocks x %d layers in %.1f s:\n"
              "  layer signal -> copy start (prefill rank 0 sender): p50 %.1f us, p99 %.1f us "
              "(%d copy starts)\n"
              "  last layer's signal -> its last block in decode rank 0 (driver): p50 %.1f us, "
              "p99 %.1f us\n"
              "  sender's last layer -> done: p50 %.1f us, p99 %.1f us\n"
              "  FastDeploy's messager polls its layer signal every 1000 us (its per_chunk send "
              "loop sleeps 10 ms): 1000 us / kvferry's signal->copy p50 = %.1fx, "
              "/ kvferry's tail p50 = %.1fx"
              % (self.a.mode, self.a.protocol, "GPU" if self.a.gpu else "host", n, blocks,
                 sh.all_layers, time.monotonic() - t_start,
                 res["signal_to_copy_p50_us"], res["signal_to_copy_p99_us"],
                 res["signal_to_copy_count"], res["tail_p50_us"], res["tail_p99_us"],
                 res["last_to_done_p50_us"], res["last_to_done_p99_us"],
                 res["fastdeploy_poll_over_signal_to_copy_p50"], res["fastdeploy_poll_over_tail_p50"]))
        print("BENCH " + json.dumps(res))

    def kill_role(self):
        """A kvferry role of prefill rank 1 killed while a batch moves: every request gets one
        status, on every rank, and no rank hangs at a barrier."""
        inst = "fd%s-prefill-1" % self.pre.suffix
        pid = None
        for d in os.listdir("/proc"):
            if d.isdigit():
                try:
                    argv = open("/proc/%s/cmdline" % d, "rb").read().split(b"\0")
                except OSError:
                    continue
                if argv and argv[0].endswith(b"kvf-sender") and inst.encode() in argv:
                    pid = int(d)
        if pid is None:
            fail("no kvf-sender of %s running" % inst, *self.insts)
        t0 = time.monotonic()
        self.hook = lambda: os.kill(pid, 9)
        self.trace_any(8)
        print("ok: a prefill rank's sender killed mid-batch: every request answered once on every rank "
              "(%.1f s)" % (time.monotonic() - t0))

    def trace_any(self, n):
        reqs = [("kill-%d" % i, 64, 0) for i in range(n)]
        st, _ = self.batch(reqs)
        if set(st) != set(r[0] for r in reqs):
            fail("statuses %r" % st, *self.insts)


def refused_scale_dtype():
    """A block_wise_fp8 cache whose scales would be of a dtype FastDeploy does not give them:
    refused with status 2, with the reason, before anything starts."""
    import subprocess
    argv = [sys.executable, "-m", "kvferry.fastdeploy", "--splitwise_role", "prefill",
            "--rank", "1", "--mp_num", "2", "--device_id", "7", "--num_layers", "3",
            "--key_cache_shape", "64,2,16,128", "--value_cache_shape", "64,2,16,128",
            "--cache_dtype", "block_wise_fp8", "--default_dtype", "int8",
            "--speculative_config", '{"method": "mtp"}', "--kvf-instance", "never-started"]
    env = dict(os.environ, PYTHONPATH=os.path.join(dep.ROOT, "python"))
    p = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=30)
    want = "--default_dtype int8: the scale tensors of block_wise_fp8 are bfloat16, float16 or float32"
    if p.returncode != 2 or want not in p.stderr:
        fail("block_wise_fp8 with int8 scales: exit %d, %r" % (p.returncode, p.stderr[-600:]))
    print("ok: block_wise_fp8 with --default_dtype int8 refused with status 2: %s" % want)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--mode", default="per_chunk", choices=["per_chunk", "per_query"])
    p.add_argument("--protocol", default="ipc", choices=["ipc", "tcp"])
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--requests", type=int, default=40)
    p.add_argument("--faults", action="store_true")
    p.add_argument("--kill", action="store_true")
    p.add_argument("--gpu", action="store_true",
                   help="GPU caches (2 x tp GPUs): FastDeploy's cudaIpcMemHandle records")
    p.add_argument("--bench", type=int, default=0, metavar="N",
                   help="only N one-at-a-time requests, timed (bench/fastdeploy_gpu_bench.sh)")
    p.add_argument("--bench-blocks", type=int, default=8)
    p.add_argument("--scales", action="store_true",
                   help="block_wise_fp8 caches: uint8 K/V and a bfloat16 scale tensor beside each, "
                        "written, moved and verified like the caches")
    p.add_argument("--older", action="store_true",
                   help="the older argv (--engine_pid, --num_hidden_layers, --num_gpu_blocks ...), "
                        "the queue on a unix socket, and an MTP layer (--speculative_config)")
    a = p.parse_args()
    if not a.bench:
        refused_scale_dtype()
    r = Run(a)
    try:
        r.ready()
        print("ok: %s: prefill and decode up, %d ranks each%s, caches attached from the records"
              % (a.mode, a.tp, " (older argv, queue on a unix socket, an MTP layer)"
                 if a.older else ""))
        r.start_writers()
        if a.bench:
            r.bench(a.bench, a.bench_blocks)
        else:
            r.trace(a.requests)
            if not a.gpu:
                r.latency()
            if a.mode == "per_query":
                r.stalled_steps()
            if a.faults:
                r.faults()
            if a.kill:
                r.kill_role()
        r.drain()
    finally:
        for w in r.writers:
            try:
                w.close()
            except dep.worker.AttachError as e:
                sys.stderr.write("closing a GPU writer: %s\n" % e)
        t0 = time.monotonic()
        codes = [r.pre.stop(), r.dec.stop()]
    ends = tuple(".device%d%s" % (d, s) for d in r.pre.devices + r.dec.devices for s in ("", ".d"))
    left = [n for n in os.listdir("/dev/shm") if n.endswith(ends) and n.startswith(("key_", "value_"))]
    for name in r.pre.logs + r.dec.logs:  # a sanitizer build's reports fail the test
        with open(name, errors="replace") as f:
            text = f.read()
        if "runtime error:" in text or "Sanitizer" in text:
            fail("a sanitizer report in %s" % name, *r.insts)
    if any(c != 0 for cs in codes for c in cs):
        fail("messagers' exit codes on SIGTERM: %r" % codes, *r.insts)
    if left:
        fail("records left after the messagers stopped: %s" % left[:4])
    print("ok: SIGTERM stopped every messager (%.1f s), their instances and records gone"
          % (time.monotonic() - t0))


if __name__ == "__main__":
    main()

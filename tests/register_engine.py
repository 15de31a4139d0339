#!/usr/bin/python3
"""The engine's own caches (instances started with --caches engine), through the kvferry package.

  register_engine.py PREFILL DECODE OWN_DECODE

PREFILL and DECODE keep the engine's caches, OWN_DECODE its allocator's. Checks, in order: an
instance waiting for the engine's caches refuses tasks with that reason; bad registrations are
refused with their messages and the instance keeps working; per-layer (K, V) tensors, stacked
[2, blocks, ...], blocks-first [blocks, 2, ...] (strided) and several layers in one allocation,
as NumPy arrays and torch tensors, move prefill -> decode over ipc byte for byte, and to and
from an instance of its own caches; an engine SIGKILLed mid-transfer ends its requests "engine
gone" on both sides, its registration is dropped, and a new engine registers and moves again.
Exit 0 when all holds; tests/register_test.sh starts the instances.
"""
import errno
import os
import types
import signal
import subprocess
import sys
import time

import numpy as np

import kvferry


def fail(msg):
    sys.exit("FAIL: " + msg)


def pattern(tag, layer, v, block, bb):
    """A block's bytes: words naming the transfer, layer, tensor and block, then a counter."""
    head = np.array([tag, layer, v, block], dtype=np.uint32)
    body = np.arange(bb // 4, dtype=np.uint32) * 2654435761 + tag * 7 + layer * 131 + v * 17 + block
    body[:4] = head
    return body.view(np.uint8)


class Caches:
    """The engine's caches of one layout, in one of the shapes engines use; block(l, v, b) is a
    writable uint8 view of one block."""

    def __init__(self, lo, kind, use_torch=False):
        self.lo, self.kind = lo, kind
        nl, nb, bb = lo.num_layers + lo.extra_layers, lo.num_blocks, lo.block_bytes
        shape_blk = (lo.kv_heads, lo.block_size, lo.head_dim)  # fp16 instance
        self._blocks = {}
        entries = []
        if kind == "shared":  # every layer in one allocation: [layers, 2, blocks, ...]
            buf = kvferry.host_buffer(nl * 2 * nb * bb)
            all_ = buf.view(np.float16).reshape((nl, 2, nb) + shape_blk)
        for layer in range(nl):
            if kind == "pair":
                kv = [kvferry.host_buffer(nb * bb).view(np.float16).reshape((nb,) + shape_blk)
                      for _ in range(2)]
                entry = tuple(kv)
                get = lambda v, b, kv=kv: kv[v][b]
            elif kind == "stacked":
                t = kvferry.host_buffer(2 * nb * bb).view(np.float16).reshape((2, nb) + shape_blk)
                entry = t
                get = lambda v, b, t=t: t[v, b]
            elif kind == "blocks_first":
                t = kvferry.host_buffer(2 * nb * bb).view(np.float16).reshape((nb, 2) + shape_blk)
                entry = t
                get = lambda v, b, t=t: t[b, v]
            elif kind == "key_only":  # one [blocks, ...] tensor a layer (MLA's latent)
                k = kvferry.host_buffer(nb * bb).view(np.float16).reshape((nb,) + shape_blk)
                entry = (k,)
                get = lambda v, b, k=k: k[b]
            elif kind == "shared":
                entry = all_[layer]
                get = lambda v, b, t=all_[layer]: t[v, b]
            else:
                raise ValueError(kind)
            self._blocks[layer] = get
            entries.append(entry)
        if use_torch:
            import torch
            def tt(a):
                return torch.frombuffer(a, dtype=torch.float16).view(a.shape) if a.size else a
            entries = [tuple(tt(x) for x in e) if isinstance(e, tuple) else
                       torch.frombuffer(e, dtype=torch.float16).view(*e.shape) for e in entries]
        self.entries = entries

    def block(self, layer, v, b):
        return self._blocks[layer](v, b).reshape(-1).view(np.uint8)


class OwnCaches:
    """An instance's own caches (the allocator's), through the package's views."""

    def __init__(self, client):
        self.c = client

    def block(self, layer, v, b):
        return np.frombuffer(self.c.block(layer, v, b), dtype=np.uint8)


def transfer(pre, pc, dec, dc, dname, tag, src, dst, transport="ipc", timeout_s=15):
    """Fill src blocks in pre's caches, move them to dst, wait for both events, verify."""
    lo = pre.layout
    nl = lo.num_layers + lo.extra_layers
    for layer in range(nl):
        for v in range(lo.tensors):
            for i, b in enumerate(src):
                pc.block(layer, v, b)[:] = pattern(tag, layer, v, i, lo.block_bytes)
            for b in dst:
                dc.block(layer, v, b)[:] = 0
    rid = "reg-%d-%d" % (tag, pre.session)
    step = pre.last_step + 1
    pre.submit_task({"request_id": rid, "src_block_ids": src, "dest_block_ids": dst,
                     "current_id": step, "transfer_protocol": transport, "peer": dname,
                     "peer_session": dec.session})
    for layer in range(nl):
        pre.layer_done(step, layer)
    done = arrived = None
    end = time.monotonic() + timeout_s
    while time.monotonic() < end and (done is None or arrived is None):
        for c in (pre, dec):
            ev = c.poll(timeout_ms=50)
            if ev is None:
                continue
            if ev["request_id"] != rid:
                fail("%s: an event of another request: %r" % (rid, ev))
            if c is pre:
                done = ev
            else:
                arrived = ev
    if done is None or done["status"] != "finished":
        fail("%s: completion %r" % (rid, done))
    if arrived is None or arrived["status"] != "finished":
        fail("%s: arrival %r" % (rid, arrived))
    for layer in range(nl):
        for v in range(lo.tensors):
            for i, b in enumerate(dst):
                if not np.array_equal(dc.block(layer, v, b), pattern(tag, layer, v, i,
                                                                     lo.block_bytes)):
                    fail("%s: layer %d tensor %d block %d differs" % (rid, layer, v, b))
    return done


def refused(pre, dname, dsession, want, transport="ipc"):
    rid = "reg-refused-%d-%d" % (pre.session, time.monotonic_ns())
    step = pre.last_step + 1
    pre.submit_task({"request_id": rid, "src_block_ids": [1], "dest_block_ids": [1],
                     "current_id": step, "transfer_protocol": transport, "peer": dname,
                     "peer_session": dsession})
    if transport != "ipc":
        for layer in range(pre.layout.num_layers + pre.layout.extra_layers):
            pre.layer_done(step, layer)
    end = time.monotonic() + 10
    while time.monotonic() < end:
        ev = pre.poll(timeout_ms=100)
        if ev is None:
            continue
        if ev["request_id"] != rid or want not in ev["reason"]:
            fail("refused task: %r, want a reason with %r" % (ev, want))
        return ev
    fail("no completion for a task to refuse")


def expect_error(fn, want, what):
    try:
        fn()
    except kvferry.KvferryError as e:
        if want not in str(e):
            fail("%s: %r, want %r in it" % (what, str(e), want))
        print("ok: refused %s: %s" % (what, e))
        return
    fail("%s: accepted" % what)


def bad_registrations(pre):
    lo = pre.layout
    nl, nb, bb = lo.num_layers + lo.extra_layers, lo.num_blocks, lo.block_bytes
    good = Caches(lo, "shared")
    base = good.entries[0].__array_interface__["data"][0]
    fd = [fd for a, (fd, n) in kvferry._host_buffers.items() if a == base][0]
    total = nl * 2 * nb * bb
    views = [(l, v, base + (l * 2 + v) * nb * bb, bb) for l in range(nl) for v in range(2)]
    region = [(base, total, fd, 0)]
    # Python's checks
    expect_error(lambda: pre.register_caches([np.zeros((2, nb, bb), np.uint8)] * nl),
                 "foreign memory", "memory not from host_buffer")
    small = [kvferry.host_buffer(2 * (nb - 1) * bb).reshape(2, nb - 1, bb) for _ in range(nl)]
    expect_error(lambda: pre.register_caches(small), "has shape", "a layout that does not fit "
                 "(blocks)")
    wrongbb = [kvferry.host_buffer(2 * nb * (bb // 2)).reshape(2, nb, bb // 2) for _ in range(nl)]
    expect_error(lambda: pre.register_caches(wrongbb), "the layout does not fit",
                 "a block of the wrong size")
    # The allocator's checks (raw pointers)
    expect_error(lambda: pre.register_raw(views[:-1], region), "views, but the instance has",
                 "a missing (layer, tensor)")
    expect_error(lambda: pre.register_raw(views[:-1] + [views[0]], region), "given twice",
                 "a (layer, tensor) given twice")
    ov = views[:]
    ov[1] = (0, 1, base + bb, bb)  # V of layer 0 one block after K's start: overlapping
    expect_error(lambda: pre.register_raw(ov, region), "overlap", "overlapping views")
    expect_error(lambda: pre.register_raw([(l, v, a, bb // 2) for l, v, a, _ in views], region),
                 "less than a block", "a stride < block_bytes")
    expect_error(lambda: pre.register_raw(views, [(base, total - bb, fd, 0)]),
                 "not inside one region", "a region not covering its views")
    other = os.memfd_create("wrong-size")
    os.ftruncate(other, total // 2)
    expect_error(lambda: pre.register_raw(views, [(base, total, other, 0)]),
                 "foreign memory, or the wrong size", "an fd of the wrong size")
    os.close(other)
    pipe_r, pipe_w = os.pipe()
    expect_error(lambda: pre.register_raw(views, [(base, total, pipe_r, 0)]),
                 "not a file of shared memory", "a descriptor that is not shared memory")
    os.close(pipe_r)
    os.close(pipe_w)
    expect_error(lambda: pre.register_raw(views, [(base, total, -1, 0)]), "foreign memory",
                 "a region without a descriptor")
    # GPU memory (CuPy's array interface, no GPU needed to be refused): to an instance of host
    # caches, mixed with host memory, over two GPUs, without a device
    gpu = [FakeCuda((2, nb, bb), 0, 0x7f0000000000 + l * 2 * nb * bb) for l in range(nl)]
    expect_error(lambda: pre.register_caches(gpu), "GPU memory (device 0) given to instance",
                 "GPU memory on an instance of host caches")
    expect_error(lambda: pre.register_raw(views, [], device=0), "whose engine caches are host "
                 "memory", "raw GPU views on an instance of host caches")
    expect_error(lambda: pre.register_caches([good.entries[0]] + gpu[1:]),
                 "layer 1 is in GPU 0, the tensors before it in host memory",
                 "host and GPU memory mixed")
    expect_error(lambda: pre.register_caches(gpu[:1] + [FakeCuda((2, nb, bb), 1, 0x7f1000000000)]
                                             + gpu[2:]),
                 "layer 1 is in GPU 1, the tensors before it in GPU 0", "tensors on two GPUs")
    nodev = FakeCuda((2, nb, bb), 0, 0x7f0000000000)
    nodev.device = None
    expect_error(lambda: pre.register_caches([nodev] * nl), "gives no device",
                 "a CUDA array without a device")
    return good


class FakeCuda:
    """Something that speaks CUDA's array interface as CuPy does (a device pointer, .device.id):
    enough for the Python checks, which run before any CUDA call."""

    def __init__(self, shape, dev, ptr):
        self.device = types.SimpleNamespace(id=dev)
        self.__cuda_array_interface__ = {"shape": shape, "typestr": "|u1", "data": (ptr, False),
                                         "strides": None, "version": 3}


def child(pname, dname, dsession, n):
    """An engine that registers, submits n requests, publishes half their layers, says so, and
    waits to be killed."""
    pre = kvferry.Client(pname)
    pc = Caches(pre.layout, "stacked")
    pre.register_caches(pc.entries)
    step = pre.last_step + 1
    for r in range(n):
        pre.submit_task({"request_id": "reg-killed-%d" % r, "src_block_ids": [r],
                         "dest_block_ids": [r], "current_id": step, "transfer_protocol": "ipc",
                         "peer": dname, "peer_session": dsession})
    pre.layer_done(step, pre.layout.num_layers // 2 - 1)
    print("session %d ready" % pre.session, flush=True)
    time.sleep(60)


def reg_generation(name):
    out = subprocess.run([os.environ["KVF_RINGDUMP"], "--instance", name], capture_output=True,
                         text=True, timeout=20).stdout
    for line in out.splitlines():
        if line.strip().startswith("engine caches:"):
            return line.strip()
    fail("kvf-ringdump of %s shows no 'engine caches:' line:\n%s" % (name, out[:2000]))


def role_pids(name):
    import json
    out = subprocess.run([os.environ["KVF_RINGDUMP"], "--instance", name, "--json"],
                         capture_output=True, text=True, timeout=20).stdout
    doc = json.loads(out.splitlines()[0])
    return {r["role"]: r["pid"] for r in doc["roles"]}


def engine_maps(pid):
    """Mappings of host_buffer memory (memfds named kvferry-engine-caches) in process pid."""
    try:
        with open("/proc/%d/maps" % pid) as f:
            return sum("kvferry-engine-caches" in line for line in f)
    except OSError:
        return 0


def outcome(pre, dec, dname, tag, src, dst, transport, timeout_s=15):
    """Submit one request and wait for its completion (and its arrival, if one comes)."""
    lo = pre.layout
    rid = "reg-%d-%d" % (tag, pre.session)
    step = pre.last_step + 1
    pre.submit_task({"request_id": rid, "src_block_ids": src, "dest_block_ids": dst,
                     "current_id": step, "transfer_protocol": transport, "peer": dname,
                     "peer_session": dec.session})
    for layer in range(lo.num_layers + lo.extra_layers):
        pre.layer_done(step, layer)
    done = arrived = None
    end = time.monotonic() + timeout_s
    while time.monotonic() < end and (done is None or (arrived is None and
                                                       time.monotonic() < end - timeout_s / 2)):
        for c in (pre, dec):
            ev = c.poll(timeout_ms=50)
            if ev is not None and ev["request_id"] == rid:
                if c is pre:
                    done = ev
                else:
                    arrived = ev
    return done, arrived


class RawCaches(Caches):
    """Caches in one memfd made without MFD_ALLOW_SEALING (so nobody can seal it), registered
    with register_raw: [layers, 2, blocks, block]."""

    def __init__(self, client):
        import mmap
        lo = client.layout
        nl, nb, bb = lo.num_layers + lo.extra_layers, lo.num_blocks, lo.block_bytes
        self.lo, self.nbytes = lo, nl * 2 * nb * bb
        self.fd = os.memfd_create("kvferry-test-unsealed", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, self.nbytes)
        self.mm = mmap.mmap(self.fd, self.nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self.arr = np.frombuffer(self.mm, dtype=np.uint8).reshape((nl, 2, nb, bb))
        addr = self.arr.__array_interface__["data"][0]
        self.views = [(layer, v, addr + ((layer * 2 + v) * nb) * bb, bb)
                      for layer in range(nl) for v in range(2)]
        self.regions = [(addr, self.nbytes, self.fd, 0)]

    def block(self, layer, v, b):
        return self.arr[layer, v, b]


def shrunk_files(pre, pc, dec, dc, pname, dname):
    """A region file shrunk under the roles' mappings: each copy through it fails with the
    cause, and no role dies (a SIGBUS would kill it)."""
    # kvferry.host_buffer's memory is sealed against shrinking
    fd = next(iter(kvferry._host_buffers.values()))[0]
    try:
        os.ftruncate(fd, 0)
        fail("a host_buffer's memfd could be shrunk")
    except PermissionError:
        pass
    print("ok: kvferry.host_buffer's memory cannot shrink (F_SEAL_SHRINK)")
    before = {n: role_pids(n) for n in (pname, dname)}
    raw = RawCaches(dec)
    dec.register_raw(raw.views, raw.regions)
    transfer(pre, pc, dec, raw, dname, 50, [1, 2], [3, 4])  # it works before
    os.ftruncate(raw.fd, 0)
    done, arrived = outcome(pre, dec, dname, 51, [1, 2], [3, 4], "ipc")
    if done is None or done["status"] == "finished" or "shrank" not in done["reason"]:
        fail("ipc into a shrunk region file: completion %r" % done)
    if arrived is not None and arrived["status"] == "finished":
        fail("ipc into a shrunk region file: arrival %r" % arrived)
    print("ok: ipc into the decode engine's region file shrunk after registering: %r: %s"
          % (done["status"], done["reason"]))
    done, arrived = outcome(pre, dec, dname, 52, [1, 2], [3, 4], "tcp")
    if done is None or done["status"] == "finished":
        fail("tcp into a shrunk region file: completion %r" % done)
    if arrived is not None and arrived["status"] == "finished":
        fail("tcp into a shrunk region file: arrival %r" % arrived)
    print("ok: tcp into it: %r: %s" % (done["status"], done["reason"]))
    # the prefill engine's file shrunk: the sender (ipc) and the connector (tcp) read it
    praw = RawCaches(pre)
    pre.register_raw(praw.views, praw.regions)
    dec.register_caches(dc.entries)
    os.ftruncate(praw.fd, 0)
    for tag, transport in ((53, "ipc"), (54, "tcp")):
        done, arrived = outcome(pre, dec, dname, tag, [1, 2], [3, 4], transport)
        if done is None or done["status"] == "finished":
            fail("%s from a shrunk region file: completion %r" % (transport, done))
        if arrived is not None and arrived["status"] == "finished":
            fail("%s from a shrunk region file: arrival %r" % (transport, arrived))
        print("ok: %s from the prefill engine's shrunk region file: %r: %s"
              % (transport, done["status"], done["reason"]))
    after = {n: role_pids(n) for n in (pname, dname)}
    if after != before:
        fail("a role was restarted: %r before, %r after" % (before, after))
    pre.register_caches(pc.entries)
    transfer(pre, pc, dec, dc, dname, 55, [1, 2], [3, 4])
    transfer(pre, pc, dec, dc, dname, 56, [1, 2], [3, 4], transport="tcp")
    print("ok: no role died (pids %r); registered again, ipc and tcp finished" % after)


def key_only(pname, dname):
    """Key-only caches (one tensor a layer) registered on both sides, moved over ipc and tcp."""
    dec = kvferry.Client(dname)
    pre = kvferry.Client(pname)
    if not pre.layout.key_only or pre.layout.tensors != 1:
        fail("%s is not a key-only instance: %r" % (pname, pre.layout))
    pc, dc = Caches(pre.layout, "key_only"), Caches(dec.layout, "key_only")
    pre.register_caches(pc.entries)
    dec.register_caches(dc.entries)
    for tag, transport in ((40, "ipc"), (41, "tcp")):
        transfer(pre, pc, dec, dc, dname, tag, [3, 4, 9, 5], [7, 8, 20, 2], transport=transport)
        transfer(pre, pc, dec, dc, dname, tag + 10, list(range(10, 26)), list(range(0, 16)),
                 transport=transport)
        print("ok: key-only %s: 4 scattered and 16 contiguous blocks x %d layers verified"
              % (transport, pre.layout.num_layers))
    pre.close()
    dec.close()


def token_split(pname, dname):
    """Token-major blocks between another tensor-parallel split (its head slices are cut from
    head-major blocks): refused at the data connection's handshake over tcp, naming it."""
    dec = kvferry.Client(dname)
    pre = kvferry.Client(pname)
    if pre.layout.kv_heads == dec.layout.kv_heads:
        fail("%s and %s are not of another split: %r %r" % (pname, dname, pre.layout, dec.layout))
    pc, dc = Caches(pre.layout, "pair"), Caches(dec.layout, "pair")
    pre.register_caches(pc.entries, token_major=True)
    dec.register_caches(dc.entries, token_major=True)
    ev = refused(pre, dname, dec.session, "token-major blocks", transport="tcp")
    if ev["status"] != "peer layout mismatch":
        fail("token-major blocks to another split: %r" % ev)
    print("ok: token-major blocks to another split over tcp ended %r: %s" % (ev["status"], ev["reason"]))
    pre.close()
    dec.close()


def main():
    if sys.argv[1] == "--token-split":
        token_split(sys.argv[2], sys.argv[3])
        return
    if sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
        return
    if sys.argv[1] == "--key-only":
        key_only(sys.argv[2], sys.argv[3])
        return
    pname, dname, oname = sys.argv[1:4]
    dec = kvferry.Client(dname)
    pre = kvferry.Client(pname)
    lo = pre.layout
    if "waiting" not in reg_generation(pname):
        fail("before registering: %s" % reg_generation(pname))
    ev = refused(pre, dname, dec.session, "waiting for the engine's caches")
    print("ok: a task before registering ended %r: %s" % (ev["status"], ev["reason"]))

    expect_error(lambda: pre.tensor(0, 0), "keeps the engine's own caches",
                 "Client.tensor() on an instance of the engine's caches")
    good = bad_registrations(pre)
    # the prefill side registered, the decode side not yet: refused for the peer
    pre.register_caches(good.entries)
    ev = refused(pre, dname, dec.session, "waiting for its engine's caches")
    print("ok: a task to a peer that waits for its caches ended %r: %s" % (ev["status"],
                                                                          ev["reason"]))
    t0 = time.monotonic()
    n = 0
    kinds = [("pair", "stacked", False), ("stacked", "blocks_first", False),
             ("blocks_first", "shared", True), ("shared", "pair", True)]
    for tag, (pk, dk, use_torch) in enumerate(kinds, start=1):
        pc = Caches(lo, pk, use_torch=use_torch)
        dc = Caches(dec.layout, dk, use_torch=use_torch)
        pre.register_caches(pc.entries)
        dec.register_caches(dc.entries)
        transfer(pre, pc, dec, dc, dname, tag, [3, 4, 9, 5], [7, 8, 20, 2])
        n += 1
        print("ok: ipc %s -> %s%s: 4 blocks x %d layers verified" % (pk, dk, " (torch)" if use_torch
                                                                     else "", lo.num_layers))
    # over tcp: both sides registered, one of them strided
    transfer(pre, pc, dec, dc, dname, 10, [3, 4, 9, 5], [7, 8, 20, 2], transport="tcp")
    print("ok: tcp %s -> %s verified" % (pk, dk))
    pc = Caches(lo, "blocks_first")
    pre.register_caches(pc.entries)
    transfer(pre, pc, dec, dc, dname, 11, list(range(10, 26)), list(range(0, 16)), transport="tcp")
    print("ok: tcp blocks_first -> %s: 16 blocks verified" % dk)
    # registered <-> own, over ipc and tcp
    with kvferry.Client(oname) as own:
        oc = OwnCaches(own)
        for tag, transport in ((20, "ipc"), (21, "tcp")):
            transfer(pre, pc, own, oc, oname, tag, [1, 2, 3], [4, 5, 6], transport=transport)
            transfer(own, oc, dec, dc, dname, tag + 10, [7, 8], [9, 10], transport=transport)
            print("ok: %s registered -> own caches and own -> registered verified" % transport)
    # blocks laid out another way on one side: refused
    pc2 = Caches(lo, "stacked")
    pre.register_caches(pc2.entries, token_major=True)
    if "token-major" not in reg_generation(pname):
        fail("token_major registration: %s" % reg_generation(pname))
    ev = refused(pre, dname, dec.session, "token-major")
    if ev["status"] != "peer layout mismatch":
        fail("token order mismatch: %r" % ev)
    print("ok: token-major blocks to a head-major peer ended %r: %s" % (ev["status"], ev["reason"]))
    pre.register_caches(pc.entries)
    print("ok: %d layouts and the mixed cases moved in %.2f s" % (n, time.monotonic() - t0))
    shrunk_files(pre, pc, dec, dc, pname, dname)
    gen_before = reg_generation(pname)

    # unregister: refused again, then registered again
    pre.unregister_caches()
    ev = refused(pre, dname, dec.session, "waiting for the engine's caches")
    print("ok: after unregister_caches a task ended %r: %s" % (ev["status"], ev["reason"]))
    pre.close()

    # the engine killed mid-transfer
    nkill = 4
    kid = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--child", pname, dname,
                            str(dec.session), str(nkill)], stdout=subprocess.PIPE, text=True)
    line = kid.stdout.readline()
    if "ready" not in line:
        kid.kill()
        fail("the engine to kill did not get ready: %r" % line)
    killed = int(line.split()[1])
    if "registered by pid %d" % kid.pid not in reg_generation(pname):
        fail("the child's registration: %s" % reg_generation(pname))
    kid.send_signal(signal.SIGKILL)
    kid.wait()
    pre = kvferry.Client(pname)
    gone = {}
    end = time.monotonic() + 15
    while len(gone) < nkill and time.monotonic() < end:
        ev = pre.poll_previous()
        if ev is None:
            # The dead session's completions may still be in the ring (the sender ended them
            # after this attach returned): poll() moves them to poll_previous(); this new
            # session has nothing of its own yet.
            if pre.poll(timeout_ms=100) is not None:
                fail("the new engine was told of a request it never submitted")
            continue
        if ev["session"] != killed or ev["status"] != "engine gone":
            fail("poll_previous: %r (the killed session was %d)" % (ev, killed))
        gone[ev["request_id"]] = ev
    if len(gone) != nkill:
        fail("poll_previous told %d of the killed engine's %d requests" % (len(gone), nkill))
    got = 0
    end = time.monotonic() + 15
    while got < nkill and time.monotonic() < end:
        ev = dec.poll(timeout_ms=100)
        if ev is None:
            continue
        if ev["status"] != "engine gone":
            fail("decode side of a killed engine's request: %r" % ev)
        got += 1
    if got != nkill:
        fail("decode side: %d of %d requests ended" % (got, nkill))
    end = time.monotonic() + 10
    while "waiting" not in reg_generation(pname) and time.monotonic() < end:
        time.sleep(0.05)
    if "waiting" not in reg_generation(pname):
        fail("the killed engine's registration was not dropped: %s" % reg_generation(pname))
    # The prefill allocator and connector map this instance's registration only: both let the
    # dead engine's memory go (the connector within a heartbeat).
    pids = role_pids(pname)
    end = time.monotonic() + 10
    while time.monotonic() < end and any(engine_maps(pids[r]) for r in ("allocator", "connector")):
        time.sleep(0.05)
    left = {r: engine_maps(pids[r]) for r in ("allocator", "connector")}
    if any(left.values()):
        fail("the dead engine's memory is still mapped: %r" % left)
    print("ok: an engine SIGKILLed mid-transfer: %d requests 'engine gone' on both sides, its "
          "registration dropped (%s), its memory unmapped by the allocator and the connector"
          % (nkill, reg_generation(pname)))
    pc = Caches(lo, "blocks_first")
    pre.register_caches(pc.entries)
    transfer(pre, pc, dec, dc, dname, 40, [0, 1], [30, 31])
    print("ok: a new engine registered and moved again (%s; before: %s)"
          % (reg_generation(pname), gen_before))

    # The allocator SIGKILLed: its supervisor starts another (--adopt), which marks the
    # registration dropped (the descriptors died with it); the engine registers again.
    old = role_pids(pname)["allocator"]
    os.kill(old, signal.SIGKILL)
    end = time.monotonic() + 20
    while time.monotonic() < end:
        pid = role_pids(pname).get("allocator")
        if pid and pid != old and engine_maps(pid) == 0 and "waiting" in reg_generation(pname):
            try:
                pre.register_caches(pc.entries)
                break
            except kvferry.KvferryError:  # not answering yet
                pass
        time.sleep(0.1)
    else:
        fail("no new allocator took the registration: %s" % reg_generation(pname))
    transfer(pre, pc, dec, dc, dname, 41, [2, 3], [28, 29])
    print("ok: the allocator SIGKILLed and restarted: the registration was dropped, the engine "
          "registered again and moved (%s)" % reg_generation(pname))
    pre.close()
    dec.close()


if __name__ == "__main__":
    main()

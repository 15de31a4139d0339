#!/usr/bin/python3
"""A Python engine on both sides of a transfer, through the kvferry package (python/kvferry).

  python_engine.py PREFILL DECODE

Attaches to two running host-memory instances, writes every layer of its requests' blocks
through the package's zero-copy views, submits FastDeploy task dicts, publishes layer-done
events, and checks: every good request "finished" on the prefill side and arrived on the decode
side with every byte of its blocks as written (a prefix hit's held blocks untouched); each bad
task ends with its own status; the package's own errors raise with kvferry's message; a Python
engine SIGKILLed mid-transfer ends its requests "engine gone" on both sides, told to the next
engine by poll_previous(). Exit 0
when all holds; tests/python_engine_test.sh starts the instances. Run with /usr/bin/python3
(python3-msgpack).
"""
import errno
import gc
import os
import random
import signal
import struct
import subprocess
import sys
import threading
import time

import kvferry


def fail(msg):
    sys.exit("FAIL: " + msg)


def pattern(req, layer, v, block, bb):
    """A block's bytes: 16-byte words naming request, layer, tensor, block and the word."""
    head = struct.pack("<IHHI", req, layer, v, block)
    return b"".join(head + struct.pack("<I", w) for w in range(bb // 16))


def wait_events(client, want, what, timeout_s=30):
    got = {}
    end = time.monotonic() + timeout_s
    while len(got) < want:
        left = end - time.monotonic()
        if left <= 0:
            fail("%s: %d of %d events after %d s: %s" % (what, len(got), want, timeout_s,
                                                         sorted(got)))
        ev = client.poll(timeout_ms=int(min(left, 1.0) * 1000))
        if ev is None:
            continue
        if ev["request_id"] in got:
            fail("%s: two events for %s: %r and %r" % (what, ev["request_id"],
                                                       got[ev["request_id"]], ev))
        got[ev["request_id"]] = ev
    return got


def child(pname, dname, dsession, n):
    """An engine that submits n requests, publishes half their layers, says so, and waits to be
    killed."""
    pre = kvferry.Client(pname)
    step = pre.last_step + 1
    for r in range(n):
        pre.submit_task({"request_id": "py-killed-%d" % r, "src_block_ids": [r],
                         "dest_block_ids": [r], "current_id": step, "transfer_protocol": "ipc",
                         "peer": dname, "peer_session": dsession})
    pre.layer_done(step, pre.layout.num_layers // 2 - 1)
    print("session %d ready" % pre.session, flush=True)
    time.sleep(60)


def killed_engine(pname, dname):
    n = 4
    dec = kvferry.Client(dname)
    kid = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--child", pname, dname,
                            str(dec.session), str(n)], stdout=subprocess.PIPE, text=True)
    line = kid.stdout.readline()
    if "ready" not in line:
        kid.kill()
        fail("the engine to kill did not get ready: %r" % line)
    killed = int(line.split()[1])
    kid.send_signal(signal.SIGKILL)
    kid.wait()
    pre = kvferry.Client(pname)  # waits for the sender to end the dead session's requests
    gone = {}
    end = time.monotonic() + 15
    while len(gone) < n and time.monotonic() < end:
        ev = pre.poll_previous()
        if ev is None:
            if pre.poll(timeout_ms=100) is not None:
                fail("the new engine was told of a request it never submitted")
            continue
        if ev["session"] != killed or ev["status"] != "engine gone":
            fail("poll_previous: %r (the killed session was %d)" % (ev, killed))
        gone[ev["request_id"]] = ev
    if len(gone) != n:
        fail("poll_previous told %d of the killed engine's %d requests" % (len(gone), n))
    arrived = wait_events(dec, n, "decode side of the killed engine's requests", timeout_s=15)
    for rid, ev in arrived.items():
        if ev["status"] != "engine gone":
            fail("decode side: %s %r" % (rid, ev))
    pre.close()
    dec.close()
    print("ok: a Python engine SIGKILLed with %d requests half sent: every one 'engine gone' on "
          "both sides, told to the next engine by poll_previous()" % n)


def chunk_cancel_connect(pname, dname):
    """submit_chunk, cancel and connect, each through to its event."""
    with kvferry.Client(dname) as dec, kvferry.Client(pname) as pre:
        lo, bb = pre.layout, pre.layout.block_bytes
        layers = lo.num_layers + lo.extra_layers
        tok = lo.block_size
        # A chunked request of 4 blocks: two chunks, two steps.
        src, dst = [40, 41, 42, 43], [50, 51, 52, 53]
        rid = "py-chunked-%d" % pre.session
        s1 = pre.last_step + 1
        pre.submit_task({"request_id": rid, "src_block_ids": src, "dest_block_ids": dst,
                         "current_id": s1, "transfer_protocol": "ipc", "peer": dname,
                         "peer_session": dec.session, "chunked": True})
        for step, first, n_done, last in ((s1, 0, 2, False), (s1 + 1, 2, 4, True)):
            for layer in range(layers):
                for v in range(lo.tensors):
                    t = pre.tensor(layer, v)
                    for bi in range(first, n_done):
                        t[src[bi] * bb:(src[bi] + 1) * bb] = pattern(900 + step - s1, layer, v,
                                                                      bi, bb)
                pre.layer_done(step, layer)
            pre.submit_chunk(rid, step, n_done * tok, last=last)
        # A request whose layers never come, cancelled.
        cid = "py-cancelled-%d" % pre.session
        pre.submit_task({"request_id": cid, "src_block_ids": [44], "dest_block_ids": [54],
                         "current_id": s1 + 100, "transfer_protocol": "ipc", "peer": dname,
                         "peer_session": dec.session})
        pre.cancel(cid)
        done = wait_events(pre, 2, "chunked and cancelled completions")
        if done[rid]["status"] != "finished" or done[cid]["status"] != "cancelled":
            fail("chunked %r, cancelled %r" % (done[rid], done[cid]))
        arrived = {}
        end = time.monotonic() + 15
        while rid not in arrived and time.monotonic() < end:
            ev = dec.poll(timeout_ms=200)
            if ev:
                arrived[ev["request_id"]] = ev
        if arrived.get(rid, {}).get("status") != "finished":
            fail("chunked request's arrival: %r" % arrived)
        for layer in range(layers):
            for v in range(lo.tensors):
                t = dec.tensor(layer, v)
                for bi, d in enumerate(dst):
                    if t[d * bb:(d + 1) * bb] != pattern(900 + (bi >= 2), layer, v, bi, bb):
                        fail("chunked request: layer %d tensor %d block %d differs" % (layer, v, bi))
        # Connect: a known peer and an unknown one, each answered.
        pre.connect("py-connect-ok", dname)
        pre.connect("py-connect-bad", "nobody-here")
        res = wait_events(pre, 2, "connect results")
        if res["py-connect-ok"]["type"] != "connect result" or \
                res["py-connect-ok"]["status"] != "finished" or \
                res["py-connect-bad"]["status"] != "unknown peer":
            fail("connect results: %r" % res)
        print("ok: a chunked request (two chunks, two steps) finished and verified; a cancelled "
              "one ended 'cancelled'; connect answered 'finished' and 'unknown peer' (%s)"
              % res["py-connect-bad"]["reason"])


def one_request(pre, dec, rid, transport, dname, src, dst, timeout_s=10):
    """Submit one request of blocks src -> dst, publish all its layers at a new step, and return
    (its completion, its arrival or None when none came within timeout_s). Every event of
    either client must be this request's."""
    lo = pre.layout
    step = pre.last_step + 1
    pre.submit_task({"request_id": rid, "src_block_ids": src, "dest_block_ids": dst,
                     "current_id": step, "transfer_protocol": transport, "peer": dname,
                     "peer_session": dec.session})
    for layer in range(lo.num_layers + lo.extra_layers):
        pre.layer_done(step, layer)
    end = time.monotonic() + timeout_s
    done = arrived = None
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
    if done is None:
        fail("%r over %s: no completion after %d s" % (rid, transport, timeout_s))
    return done, arrived


def bytes_ids(pname, dname):
    """Request ids as bytes that are not UTF-8 (msgpack bin) and as str, over ipc and tcp: the
    completion and the arrival both finish, at once, and carry the id back as it was given
    (bytes as the same bytes, str as str)."""
    with kvferry.Client(dname) as dec, kvferry.Client(pname) as pre:
        for i, (transport, rid) in enumerate((("ipc", b"\xff\xfe-req-ipc"),
                                               ("tcp", b"\xff\xfe-req-tcp"),
                                               ("ipc", "py-str-id-ipc-%d" % pre.session),
                                               ("tcp", "py-str-id-tcp-%d" % pre.session))):
            t0 = time.monotonic()
            done, arrived = one_request(pre, dec, rid, transport, dname, [56 + i], [60 + i])
            took = time.monotonic() - t0
            if arrived is None:
                fail("%r over %s: no arrival on the decode side (completion %r)"
                     % (rid, transport, done))
            for what, ev in (("completion", done), ("arrival", arrived)):
                if ev["status"] != "finished" or type(ev["request_id"]) is not type(rid) or \
                        ev["request_id"] != rid:
                    fail("%r over %s: %s %r" % (rid, transport, what, ev))
            if took > 5:
                fail("%r over %s: took %.1f s" % (rid, transport, took))
            print("ok: request id %r over %s: completion and arrival finished with the id as "
                  "given (%s), in %.2f s" % (rid, transport, type(rid).__name__, took))


def rdma_refused(pname, dname):
    """An rdma task where rdma cannot be had (this test's host has no rdma device; or the
    decode side takes none): it fails at once, not at its timeout, with a reason naming rdma,
    on both sides (the decode engine is told, to free its blocks); the instances go on working
    (a tcp request then finishes). Several in a row: the connector's refusal may come before
    or after the sender's finish notice."""
    with kvferry.Client(dname) as dec, kvferry.Client(pname) as pre:
        for i in range(4):
            rid = "py-rdma-%d-%d" % (pre.session, i)
            t0 = time.monotonic()
            done, arrived = one_request(pre, dec, rid, "rdma", dname, [48 + i], [48 + i],
                                        timeout_s=3)
            took = time.monotonic() - t0
            if done["status"] == "finished":
                print("skipped: rdma works between these instances: %r" % done)
                return
            if "rdma" not in done["reason"] or took > 3:
                fail("rdma task: completion after %.1f s: %r" % (took, done))
            if arrived is None or arrived["status"] == "finished" or \
                    "rdma" not in arrived["reason"]:
                fail("rdma task: the decode side's arrival: %r (completion %r)" % (arrived, done))
            print("ok: an rdma task without rdma: '%s' after %.2f s (%s); decode side: %s (%s)"
                  % (done["status"], took, done["reason"], arrived["status"], arrived["reason"]))
        rid = "py-after-rdma-%d" % pre.session
        done, arrived = one_request(pre, dec, rid, "tcp", dname, [52], [52], timeout_s=10)
        if done["status"] != "finished" or not arrived or arrived["status"] != "finished":
            fail("a tcp request after the rdma ones: %r, %r" % (done, arrived))
        print("ok: a tcp request after them finished on both sides")


def forked(pname, dname):
    """A client used in a child after fork(): every call raises with the message naming the
    pid that attached; the parent's session goes on (a request of it finishes)."""
    with kvferry.Client(dname) as dec, kvferry.Client(pname) as pre:
        parent = os.getpid()
        r, w = os.pipe()
        kid = os.fork()
        if kid == 0:
            os.close(r)
            bad = []
            want = "this client was attached by pid %d; after fork() attach anew in the child" \
                % parent
            calls = (("submit_task", lambda: pre.submit_task(
                          {"request_id": "py-forked", "src_block_ids": [1], "dest_block_ids": [1],
                           "current_id": 1 << 30, "transfer_protocol": "ipc", "peer": dname})),
                     ("layer_done", lambda: pre.layer_done(1 << 30, 0)),
                     ("poll", lambda: pre.poll(timeout_ms=10)),
                     ("cancel", lambda: pre.cancel("py-forked")),
                     ("last_step", lambda: pre.last_step),
                     ("tensor", lambda: pre.tensor(0, 0)))
            for what, call in calls:
                try:
                    call()
                    bad.append("%s: no error" % what)
                except kvferry.KvferryError as e:
                    if e.errno != errno.EBADF or want not in str(e):
                        bad.append("%s: %r" % (what, e))
            pre.close()  # ends nothing of the parent's
            os.write(w, ("\n".join(bad) or "ok").encode())
            os._exit(0)
        os.close(w)
        with os.fdopen(r) as f:
            report = f.read()
        os.waitpid(kid, 0)
        if report != "ok":
            fail("a client used after fork(): %s" % report)
        done, arrived = one_request(pre, dec, "py-after-fork-%d" % pre.session, "ipc", dname,
                                    [53], [53])
        if done["status"] != "finished" or not arrived or arrived["status"] != "finished":
            fail("the parent's request after the fork: %r, %r" % (done, arrived))
        print("ok: a client used in a child after fork(): every call raised (naming pid %d); "
              "the parent's request then finished on both sides" % parent)


def main():
    if len(sys.argv) == 6 and sys.argv[1] == "--child":
        return child(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    pname, dname = sys.argv[1], sys.argv[2]
    rng = random.Random(1234)

    # Errors a user makes with the package itself: clear, and nothing breaks.
    try:
        kvferry.Client("no-such-instance-%d" % rng.randrange(1 << 30), wait_ms=100)
        fail("attaching to an instance that does not exist did not raise")
    except kvferry.KvferryError as e:
        if not str(e):
            fail("attach error without a message")
        print("ok: attach to a missing instance raises: %s" % e)

    with kvferry.Client(dname) as dec, kvferry.Client(pname) as pre:
        lo = pre.layout
        if (dec.layout.num_layers, dec.layout.block_bytes) != (lo.num_layers, lo.block_bytes):
            fail("the instances' layouts differ: %r, %r" % (lo, dec.layout))
        if pre.device is not None:
            fail("this test wants host-memory instances; %s is on GPU %d" % (pname, pre.device))
        layers = lo.num_layers + lo.extra_layers
        bb = lo.block_bytes
        for bad in ((layers, 0), (0, 2), (-1, 0)):
            try:
                pre.tensor(*bad)
                fail("tensor%r did not raise" % (bad,))
            except kvferry.KvferryError:
                pass
        print("ok: %s: %r, session %d; decode session %d" % (pname, lo, pre.session, dec.session))

        # Requests: scattered blocks on both sides, one a prefix hit (the decode side already
        # holds its first blocks: they must stay as they are).
        n_req = 12
        src_pool = rng.sample(range(lo.num_blocks), lo.num_blocks)
        dst_pool = rng.sample(range(dec.layout.num_blocks), dec.layout.num_blocks)
        reqs = []
        for r in range(n_req):
            n = rng.randint(3, 6) if r == 3 else rng.randint(1, 6)
            src = [src_pool.pop() for _ in range(n)]
            held = 2 if r == 3 else 0
            dst = [dst_pool.pop() for _ in range(n - held)]
            reqs.append({"id": "py-%d-%d" % (pre.session, r), "src": src, "dst": dst,
                         "held": held})
        # The decode side's blocks: a known filler, so untouched bytes can be told apart.
        filler = b"\xa5" * bb
        for q in reqs:
            for layer in range(layers):
                for v in range(lo.tensors):
                    t = dec.tensor(layer, v)
                    for d in q["dst"]:
                        t[d * bb:(d + 1) * bb] = filler

        step = pre.last_step + 1
        for i, q in enumerate(reqs):
            task = {"request_id": q["id"], "src_block_ids": q["src"], "dest_block_ids": q["dst"],
                    "current_id": step, "transfer_protocol": "ipc", "peer": dname,
                    "peer_session": dec.session,
                    # FastDeploy's runtime keys ride along and are ignored
                    "status": "init", "layer_idx": 0}
            pre.submit_task(task)
        # Bad tasks: each ends with its own status, nothing else happens.
        bad = {
            "py-bad-range": ({"src_block_ids": [lo.num_blocks + 5]}, "block id out of range"),
            "py-bad-peer": ({"peer": "nobody-here"}, "unknown peer"),
            "py-bad-field": ({"src_block_ids": "not a list"}, "bad task"),
        }
        for rid, (over, _) in bad.items():
            task = {"request_id": rid, "src_block_ids": [src_pool[0]],
                    "dest_block_ids": [dst_pool[0]], "current_id": step,
                    "transfer_protocol": "ipc", "peer": dname}
            task.update(over)
            pre.submit_task(task)

        # The "forward pass": each layer's blocks written through the views, then published.
        for layer in range(layers):
            for v in range(lo.tensors):
                t = pre.tensor(layer, v)
                for ri, q in enumerate(reqs):
                    for bi, s in enumerate(q["src"]):
                        t[s * bb:(s + 1) * bb] = pattern(ri, layer, v, bi, bb)
            pre.layer_done(step, layer)

        done = wait_events(pre, n_req + len(bad), "prefill completions")
        for q in reqs:
            ev = done[q["id"]]
            if ev["type"] != "completion" or ev["status"] != "finished":
                fail("%s: %r" % (q["id"], ev))
            if ev["blocks"] != len(q["dst"]):
                fail("%s: %d blocks written, %d expected" % (q["id"], ev["blocks"], len(q["dst"])))
        for rid, (_, status) in bad.items():
            ev = done[rid]
            if ev["status"] != status or not ev["reason"]:
                fail("%s: status %r (%r), expected %r" % (rid, ev["status"], ev["reason"], status))
            print("ok: %s: %s (%s)" % (rid, ev["status"], ev["reason"]))

        arrived = wait_events(dec, n_req, "decode arrivals")
        words = 0
        for ri, q in enumerate(reqs):
            ev = arrived[q["id"]]
            if ev["type"] != "arrival" or ev["status"] != "finished":
                fail("%s: arrival %r" % (q["id"], ev))
            if ev["dest_block_ids"] != q["dst"]:
                fail("%s: arrival names blocks %r, the task %r" % (q["id"], ev["dest_block_ids"],
                                                                   q["dst"]))
            for layer in range(layers):
                for v in range(lo.tensors):
                    t = dec.tensor(layer, v)
                    for bi, d in enumerate(q["dst"]):
                        want = pattern(ri, layer, v, bi + q["held"], bb)
                        if t[d * bb:(d + 1) * bb] != want:
                            fail("%s: layer %d tensor %d block %d (dest %d) differs"
                                 % (q["id"], layer, v, bi, d))
                        words += bb // 16
        print("ok: %d requests finished and arrived, %d blocks x %d layers verified byte for "
              "byte (%d words), one a prefix hit of 2 held blocks"
              % (n_req, sum(len(q["dst"]) for q in reqs), layers, words))

        # A step below the last one published is an engine bug: refused, nothing published.
        try:
            pre.layer_done(step - 1, 0)
            fail("layer_done of step %d after step %d did not raise" % (step - 1, step))
        except kvferry.KvferryError as e:
            print("ok: a step going backwards raises: %s" % e)

        # numpy views: the layer's shape, bf16 as int16, and the same memory as the views.
        import numpy
        a = pre.numpy(0, 0)
        if a.shape != lo.shape or a.nbytes != lo.tensor_bytes or a.dtype != numpy.int16:
            fail("numpy view: shape %r, %d bytes, %s" % (a.shape, a.nbytes, a.dtype))
        blk = pre.block(0, 0, 7)
        a[7, 0, 0, 0] = 0x1234
        if bytes(blk[:2]) != b"\x34\x12":
            fail("a write through the numpy view did not reach the cache's bytes")
        blk[2:4] = b"\x78\x56"
        if a[7, 0, 0, 1] != 0x5678:
            fail("a write through the memoryview did not show in the numpy view")
        del a, blk
        print("ok: numpy view of a layer: %r int16, the same memory as the memoryviews"
              % (lo.shape,))

    # A view outlives close(): the session ends when the last view is gone, never before.
    c = kvferry.Client(dname)
    view = c.block(0, 0, 0)
    first = bytes(view[:16])
    c.close()
    if c.closed:
        fail("close() unmapped the caches while a view was alive")
    try:
        c.poll()
        fail("poll() on a closed client did not raise")
    except kvferry.KvferryError:
        pass
    if bytes(view[:16]) != first:
        fail("a view changed after close()")
    del view
    gc.collect()
    if not c.closed:
        fail("the session did not end when the last view was dropped")
    print("ok: a view kept the caches mapped after close(); dropping it ended the session")

    # close() from one thread while another waits in poll(): takes effect when the poll
    # returns; the poller's next call raises; nothing crashes.
    c = kvferry.Client(dname)
    errors = []

    def poller():
        try:
            while True:
                c.poll(timeout_ms=300)
        except kvferry.KvferryError as e:
            errors.append(e)

    th = threading.Thread(target=poller)
    th.start()
    time.sleep(0.1)
    c.close()
    th.join(timeout=5)
    if th.is_alive() or len(errors) != 1 or errors[0].errno != errno.EBADF or not c.closed:
        fail("close() beside a polling thread: alive %s, errors %r, closed %s"
             % (th.is_alive(), errors, c.closed))
    print("ok: close() beside a thread waiting in poll(): the session ended when the poll "
          "returned, the thread's next call raised (%s)" % errors[0])
    chunk_cancel_connect(pname, dname)
    bytes_ids(pname, dname)
    rdma_refused(pname, dname)
    forked(pname, dname)
    killed_engine(pname, dname)
    print("ok: python engine: all passed")


if __name__ == "__main__":
    main()

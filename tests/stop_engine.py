#!/usr/bin/python3
"""An engine on both sides while `tools/kvferry down` stops the prefill instance under it.

  stop_engine.py PREFILL DECODE

Attaches to two running host-memory instances (started by tests/supervisor_test.sh), submits
requests over ipc and tcp, and publishes their step's layers slowly (LAYER_S apart); a second
group's step never comes. Once the first layers are out it runs
`tools/kvferry down --instance PREFILL` ($KVFERRY_RUN_DIR, $KVFERRY_BUILD as the test set them),
and once the prefill sender's log says it is stopping it submits one more task. Then it checks:
down returned within the supervisor's grace (5 s between TERM and KILL); every task got exactly
one completion, read after the sender had exited; the slow group finished during the drain
window, each with every byte in the decode cache as written and a finished arrival; the stuck
group failed 'connection error' with the stopping reason, and each ipc one's arrival on the
decode side says the same (its engine can free the blocks), none finished; the task submitted
after the stop began was refused at once with the stopping reason. Exit 0 when all holds.
Run with /usr/bin/python3 (python3-msgpack).
"""
import os
import subprocess
import sys
import time

import kvferry

LAYER_S = 0.025   # the slow group's layers: 32 layers in 0.8 s, well inside the 2 s window
GRACE_S = 5.0     # tools/kvferry stop_all: TERM, then KILL after 5 s
STOPPING = "is stopping (tools/kvferry down)"


def fail(msg):
    sys.exit("FAIL: " + msg)


def fill(req, layer, v, bb):
    """A block's bytes for request number req, layer and tensor: 8-byte words naming them."""
    word = bytes([req & 0xff, layer & 0xff, v & 0xff, 0x5a])
    return (word + (req * 131 + layer * 7 + v).to_bytes(4, "little")) * (bb // 8)


def main():
    pname, dname = sys.argv[1], sys.argv[2]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    log = os.path.join(os.environ["KVFERRY_RUN_DIR"], pname, "sender.log")
    dec = kvferry.Client(dname)
    pre = kvferry.Client(pname)
    lo, bb = pre.layout, pre.layout.block_bytes
    layers = lo.num_layers + lo.extra_layers
    if lo.num_blocks < 41 or dec.layout.num_blocks < 41:
        fail("the caches hold %d and %d blocks; this test uses ids up to 40"
             % (lo.num_blocks, dec.layout.num_blocks))
    step = pre.last_step + 1
    # (name, transport, source blocks, destination blocks, step); ids below 41 (a 64 MiB cache of
    # llama-3.1-8b at tp 8 has 64 blocks)
    slow, stuck = [], []
    for i in range(6):
        slow.append(("slow-%d" % i, "tcp" if i >= 4 else "ipc", [2 * i, 2 * i + 1],
                     [20 + 2 * i, 21 + 2 * i], step))
    for i in range(4):
        stuck.append(("stuck-%d" % i, "tcp" if i >= 3 else "ipc", [12 + i], [32 + i], step + 1))
    for n, (rid, tr, src, dst, st) in enumerate(slow + stuck):
        pre.submit_task({"request_id": rid, "src_block_ids": src, "dest_block_ids": dst,
                         "current_id": st, "transfer_protocol": tr, "peer": dname,
                         "peer_session": dec.session})
    data = {(n, layer, v): fill(n, layer, v, bb) for n in range(len(slow))
            for layer in range(layers) for v in range(lo.tensors)}

    done = {}

    def take(ev):
        if ev["type"] != "completion":
            fail("prefill side: an event that is no completion: %r" % ev)
        if ev["request_id"] in done:
            fail("two completions for %s: %r and %r" % (ev["request_id"], done[ev["request_id"]], ev))
        done[ev["request_id"]] = ev

    # One thread: the slow group's layers as they fall due, down once the first few are out, the
    # late task once the sender says it is stopping. No completion is read before down returns.
    down = late_at = None
    layer, due = 0, time.monotonic()
    while layer < layers or down.poll() is None:
        now = time.monotonic()
        if layer < layers and now >= due:
            for v in range(lo.tensors):
                t = pre.tensor(layer, v)
                for n, (_, _, src, _, _) in enumerate(slow):
                    for b in src:
                        t[b * bb:(b + 1) * bb] = data[(n, layer, v)]
            pre.layer_done(step, layer)
            layer += 1
            due += LAYER_S
        if layer == 4 and down is None:
            t0 = time.monotonic()
            down = subprocess.Popen([os.path.join(root, "tools", "kvferry"), "down", "--instance", pname],
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if down is not None and late_at is None:
            # the sender says so in its log as its stop begins
            if "stopping: " in open(log).read():
                late_at = time.monotonic_ns()  # (CLOCK_MONOTONIC, as the completion's done_ns)
                pre.submit_task({"request_id": "late", "src_block_ids": [16], "dest_block_ids": [40],
                                 "current_id": step + 2, "transfer_protocol": "ipc", "peer": dname,
                                 "peer_session": dec.session})
            elif now - t0 > 3:
                fail("the prefill sender did not say it was stopping in 3 s:\n" + open(log).read()[-2000:])
        time.sleep(0.002)
    out, _ = down.communicate(timeout=30)
    took = time.monotonic() - t0
    if down.returncode != 0:
        fail("down exited %d: %s" % (down.returncode, out))
    if took >= GRACE_S:
        fail("down took %.2f s, not within the supervisor's %.0f s grace" % (took, GRACE_S))
    # The sender has exited, and the instance's shared memory is unlinked: what the sender
    # posted is in the ring, committed, and this engine's mapping still holds it.
    ids = [r[0] for r in slow + stuck] + (["late"] if late_at is not None else [])
    end = time.monotonic() + 5
    while len(done) < len(ids) and time.monotonic() < end:
        ev = pre.poll(timeout_ms=100)
        if ev:
            take(ev)
    ev = pre.poll(timeout_ms=200)
    if ev:
        take(ev)  # (a second completion fails there)
    missing = [i for i in ids if i not in done]
    if missing:
        fail("no completion for %s after down (got %r)" % (missing, sorted(done)))
    if late_at is None:
        fail("down returned before the prefill sender said it was stopping:\n" + open(log).read()[-2000:])
    late = done["late"]
    if late["status"] != "connection error" or STOPPING not in late["reason"] or \
            "takes no new tasks" not in late["reason"] or late["done_ns"] - late_at > 1e9:
        fail("the task submitted after the stop began: %r, %.2f s after it"
             % (late, (late["done_ns"] - late_at) / 1e9))
    arrivals = {}
    end = time.monotonic() + 5
    want = {r[0] for r in slow} | {r[0] for r in stuck if r[1] == "ipc"}
    while not want <= set(arrivals) and time.monotonic() < end:
        ev = dec.poll(timeout_ms=100)
        if ev:
            if ev["request_id"] in arrivals:
                fail("two arrivals for %s: %r and %r" % (ev["request_id"], arrivals[ev["request_id"]], ev))
            arrivals[ev["request_id"]] = ev
    for n, (rid, tr, src, dst, _) in enumerate(slow):
        c, a = done[rid], arrivals.get(rid)
        if c["status"] != "finished":
            fail("%s (%s), its layers all out %.1f s before the drain window's end, did not finish: %r"
                 % (rid, tr, 2.0 - LAYER_S * layers, c))
        if not a or a["status"] != "finished":
            fail("%s finished, but its arrival is %r" % (rid, a))
        for layer in range(layers):
            for v in range(lo.tensors):
                t = dec.tensor(layer, v)
                for b in dst:
                    if t[b * bb:(b + 1) * bb] != data[(n, layer, v)]:
                        fail("%s finished, but block %d of layer %d tensor %d differs at the decode side"
                             % (rid, b, layer, v))
    for rid, tr, _, _, _ in stuck:
        c, a = done[rid], arrivals.get(rid)
        if c["status"] != "connection error" or STOPPING not in c["reason"] or \
                "drain window" not in c["reason"]:
            fail("%s (%s), its step never published: %r" % (rid, tr, c))
        if a and a["status"] == "finished":
            fail("%s failed on the prefill side, but arrived finished: %r" % (rid, a))
        if tr == "ipc" and (not a or a["status"] != c["status"] or STOPPING not in a["reason"]):
            fail("%s: the decode side's arrival %r, the completion %r" % (rid, a, c))
    print("ok: down of the prefill instance in %.2f s with %d requests in flight: %d finished during the "
          "drain (bytes verified at the decode side), %d ended '%s' (%s), the ipc ones' arrivals the same; "
          "a task after the stop began refused at once; every completion read after the sender exited"
          % (took, len(slow) + len(stuck), len(slow), len(stuck), done[stuck[0][0]]["status"],
             done[stuck[0][0]]["reason"]))
    pre.close()
    dec.close()


if __name__ == "__main__":
    main()

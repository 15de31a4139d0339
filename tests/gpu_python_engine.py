#!/usr/bin/env python3
"""A Python engine on GPU caches, through the kvferry package and PyTorch.

  gpu_python_engine.py PREFILL DECODE

Both instances run with --backend cuda. The caches are taken as torch tensors without a copy
(the package's CUDA array interface); the "forward pass" writes each layer's blocks with torch
on the current stream and publishes the layer with layer_done_on_stream on that stream (the
engine never synchronises for it). Checks: every request "finished" and arrived, every
destination block equal to what was written (a prefix hit's held blocks excepted), compared on
the GPU. tests/gpu_e2e_test.sh runs it for both executors where python3 has torch and msgpack.
"""
import random
import sys

import torch

import kvferry
from python_engine import fail, wait_events  # this folder's host test: the same helpers


def main():
    pname, dname = sys.argv[1], sys.argv[2]
    rng = random.Random(99)
    dec, pre = kvferry.Client(dname), kvferry.Client(pname)
    if pre.device is None or dec.device is None:
        fail("both instances must have GPU caches (--backend cuda)")
    dev = torch.device("cuda", pre.device)
    torch.cuda.set_device(dev)
    lo = pre.layout
    layers, n_el = lo.num_layers + lo.extra_layers, lo.block_bytes // 2
    if lo.itemsize != 2:
        fail("this check writes 16-bit words; layout %r" % lo)

    def view(c, layer, v):
        t = torch.as_tensor(c.tensor(layer, v), device=dev)
        if tuple(t.shape) != lo.shape or t.data_ptr() != c.tensor(layer, v).ptr:
            fail("tensor of layer %d: shape %r at 0x%x, not a view of the cache"
                 % (layer, tuple(t.shape), t.data_ptr()))
        return t.view(-1, n_el)  # one row per block

    base = torch.arange(n_el, device=dev, dtype=torch.int32)

    def pattern(r, layer, v, bi):
        key = ((r * 131 + layer) * 7 + v) * 1009 + bi
        return ((base * 31 + key) % 32749).to(torch.int16)

    src_pool = rng.sample(range(lo.num_blocks), lo.num_blocks)
    dst_pool = rng.sample(range(dec.layout.num_blocks), dec.layout.num_blocks)
    reqs = []
    for r in range(16):
        n = rng.randint(3, 8)
        held = 2 if r == 5 else 0
        reqs.append({"id": "gpy-%d-%d" % (pre.session, r), "src": [src_pool.pop() for _ in range(n)],
                     "dst": [dst_pool.pop() for _ in range(n - held)], "held": held})
    for layer in range(layers):
        for v in range(lo.tensors):
            td = view(dec, layer, v)
            for q in reqs:
                td[q["dst"]] = 0x5a5a
    torch.cuda.synchronize()

    step = pre.last_step + 1
    for q in reqs:
        pre.submit_task({"request_id": q["id"], "src_block_ids": q["src"],
                         "dest_block_ids": q["dst"], "current_id": step,
                         "transfer_protocol": "ipc", "peer": dname, "peer_session": dec.session})
    stream = torch.cuda.current_stream()
    for layer in range(layers):
        for v in range(lo.tensors):
            ts = view(pre, layer, v)
            for r, q in enumerate(reqs):
                for bi, s in enumerate(q["src"]):
                    ts[s] = pattern(r, layer, v, bi)
        pre.layer_done_on_stream(stream.cuda_stream, step, layer)

    done = wait_events(pre, len(reqs), "completions", timeout_s=60)
    for q in reqs:
        if done[q["id"]]["status"] != "finished":
            fail("%s: %r" % (q["id"], done[q["id"]]))
    arrived = wait_events(dec, len(reqs), "arrivals", timeout_s=60)
    checked = 0
    for r, q in enumerate(reqs):
        if arrived[q["id"]]["status"] != "finished":
            fail("%s: arrival %r" % (q["id"], arrived[q["id"]]))
        for layer in range(layers):
            for v in range(lo.tensors):
                td = view(dec, layer, v)
                for bi, d in enumerate(q["dst"]):
                    if not torch.equal(td[d], pattern(r, layer, v, bi + q["held"])):
                        fail("%s: layer %d tensor %d dest block %d differs" % (q["id"], layer, v, d))
                    checked += 1
    torch.cuda.synchronize()  # the stream's signals are done before the session ends
    pre.close()
    dec.close()
    print("ok: python engine on GPU %d: %d requests finished and arrived, %d blocks verified on "
          "the GPU (torch %s, layer-done on torch's stream)" % (pre.device, len(reqs), checked,
                                                               torch.__version__))


if __name__ == "__main__":
    main()

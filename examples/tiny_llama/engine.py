#!/usr/bin/python3
"""A prefill or a decode engine of the tiny Llama over one kvferry instance.

    engine.py --role prefill|decode --instance NAME [--caches own|engine]

Commands come on stdin and answers go to stdout, one JSON object a line (run.py drives both
engines). Every answer carries "ok": an error in a command is answered {"ok": false, "error":
...} and the engine goes on with the next one.

The model's paged cache is the instance's cache: with --caches own the instance's allocator
owns it and the engine uses Client.numpy() as its tensors; with --caches engine the engine
allocates it (kvferry.host_buffer) and registers it (Client.register_caches), for an instance
started with `tools/kvferry up ... --caches engine`.

prefill {rid, tokens, dest, peer, peer_session, transport, chunk, prefix, keep}
    submits the task, runs the prompt (in chunks of `chunk` tokens when chunk > 0: a chunked
    task, one forward step and one chunk record per chunk) and publishes each layer as soon as
    its K and V are in the cache (layer_done), then waits for the completion. prefix {rid,
    blocks}: the first blocks of the prompt are those of an earlier request kept with `keep`
    (a prefix-cache hit on this side too: only the rest is computed, all blocks are the task's
    source blocks, the decode side asks for the last ones). Answers the first generated token
    and the completion.
reserve {rid, prompt_len, prefix}
    the decode side's blocks for the prompt, less the prefix blocks it already holds
    (prefix {rid, blocks}), and its session: the task's dest_block_ids and peer_session.
decode {rid, first_token, n_gen, keep}
    waits for the request's arrival, builds its block table (held prefix blocks, then the
    received ones), digests the attention state and generates n_gen tokens greedily.
drop {rid}
    releases the blocks kept for a request (`keep` blocks of its prompt).
"""
import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kvferry  # noqa: E402
from model import Config, Engine  # noqa: E402


class Fail(Exception):
    pass


def cache_tensors(client, cfg, mode):
    """The paged cache as torch tensors over the instance's memory: per layer (K, V)."""
    lo = client.layout
    want = (cfg.layers, cfg.kv_heads, cfg.block_size, cfg.head_dim, cfg.cache_dtype)
    have = (lo.num_layers, lo.kv_heads, lo.block_size, lo.head_dim, lo.dtype_name)
    if want != have or lo.key_only or lo.extra_layers:
        raise Fail("instance %s has %r; the model wants %d layers x K and V of %d heads x %d "
                   "tokens x %d %s: start it with %s" % (client.instance, lo, *want,
                                                         cfg.instance_flags()))
    dt = cfg.torch_cache_dtype
    if mode == "own":
        # numpy gives fp16 as float16 and bf16 as int16: the bits, viewed as the cache dtype
        return [tuple(torch.from_numpy(client.numpy(layer, v)).view(dt) for v in (0, 1))
                for layer in range(lo.num_layers)], None
    if not hasattr(kvferry, "host_buffer"):
        raise Fail("--caches engine needs kvferry.host_buffer and Client.register_caches, "
                   "which this kvferry package does not have")
    bufs, caches = [], []
    for _ in range(lo.num_layers):
        pair = []
        for _v in (0, 1):
            buf = kvferry.host_buffer(lo.tensor_bytes)
            try:
                t = torch.frombuffer(buf, dtype=dt)
            except TypeError:  # a buffer that only offers .numpy()
                t = torch.from_numpy(buf.numpy().view("int16")).view(dt)
            bufs.append(buf)
            pair.append(t.view(lo.shape))
        caches.append(tuple(pair))
    client.register_caches(caches, token_major=False)
    return caches, bufs


class Side:
    def __init__(self, role, instance, mode):
        torch.set_num_threads(1)  # the same kernels, hence the same bits, as the reference
        self.role, self.cfg = role, Config()
        self.client = kvferry.Client(instance)
        caches, self._bufs = cache_tensors(self.client, self.cfg, mode)
        self.eng = Engine(self.cfg, caches)
        self.kept = {}  # rid -> the blocks of its prompt kept for a later prefix hit
        self.tables = {}  # decode side: rid -> (held, dest) between reserve and decode
        self.early = {}  # events of requests not yet waited for
        self.step = self.client.last_step

    def wait_event(self, rid, timeout_s=30.0):
        if rid in self.early:
            return self.early.pop(rid)
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            ev = self.client.poll(timeout_ms=200)
            if ev is None:
                continue
            if ev["request_id"] == rid:
                return ev
            self.early[ev["request_id"]] = ev
        raise Fail("%s: no %s after %.0f s" % (rid, "completion" if self.role == "prefill"
                                                else "arrival", timeout_s))

    def held(self, prefix):
        if not prefix:
            return []
        kept = self.kept.get(prefix["rid"])
        if kept is None or len(kept) < prefix["blocks"]:
            raise Fail("prefix of %d blocks of %s: not kept here" % (prefix["blocks"],
                                                                    prefix["rid"]))
        return kept[: prefix["blocks"]]

    def keep(self, rid, table, n, own_from):
        """Keep the first n blocks of `table` for rid; release this request's own blocks
        (table[own_from:]) beyond them."""
        if n:
            self.kept[rid] = table[:n]
        self.eng.release(table[max(n, own_from):])

    # -- prefill ---------------------------------------------------------------------------

    def prefill(self, rid, tokens, dest, peer, peer_session, transport, chunk=0, prefix=None,
                keep=0):
        eng, bs = self.eng, self.cfg.block_size
        held = self.held(prefix)
        start = len(held) * bs
        if start >= len(tokens):
            raise Fail("%s: a prefix of %d tokens leaves nothing of its %d to compute"
                       % (rid, start, len(tokens)))
        table = held + eng.alloc(eng.blocks_for(len(tokens)) - len(held))
        pieces = [(lo, min(lo + chunk, len(tokens))) for lo in range(start, len(tokens), chunk)] \
            if chunk else [(start, len(tokens))]
        first_step = self.step + 1
        task = {"request_id": rid, "src_block_ids": table, "dest_block_ids": dest,
                "current_id": first_step, "transfer_protocol": transport, "peer": peer,
                "peer_session": peer_session}
        if chunk:
            task["chunked"] = True
        try:
            self.client.submit_task(task)
        except BaseException:
            self.eng.release(table[len(held):])
            raise
        try:
            for lo, hi in pieces:
                self.step += 1
                step = self.step
                if chunk:  # before the step: its layers move as they are published
                    self.client.submit_chunk(rid, step, hi, last=hi == len(tokens))
                logits = eng.forward(tokens[lo:hi], lo, table,
                                     on_layer=lambda layer: self.client.layer_done(step, layer))
        except BaseException:
            self.client.cancel(rid)  # its blocks are reused only once it has ended
            self.wait_event(rid)
            self.keep(rid, table, 0, len(held))
            raise
        done = self.wait_event(rid)
        self.keep(rid, table, keep, len(held))
        return {"first_token": int(torch.argmax(logits)), "status": done["status"],
                "reason": done["reason"], "blocks": done["blocks"], "bytes": done["bytes"],
                "steps": len(pieces)}

    # -- decode ----------------------------------------------------------------------------

    def reserve(self, rid, prompt_len, prefix=None):
        held = self.held(prefix)
        dest = self.eng.alloc(self.eng.blocks_for(prompt_len) - len(held))
        self.tables[rid] = (held, dest, prompt_len)
        return {"dest": dest, "session": self.client.session}

    def decode(self, rid, first_token, n_gen, keep=0):
        if rid not in self.tables:
            raise Fail("%s: no blocks reserved for it (reserve comes first)" % rid)
        held, dest, prompt_len = self.tables.pop(rid)
        table = held + dest
        ev = self.wait_event(rid)
        try:
            if ev["status"] != "finished":
                raise Fail("%s: arrival %s (%s)" % (rid, ev["status"], ev["reason"]))
            if ev["dest_block_ids"] != dest:
                raise Fail("%s: arrival names blocks %r, reserved %r"
                           % (rid, ev["dest_block_ids"], dest))
            table += self.eng.alloc(self.eng.blocks_for(prompt_len + n_gen - 1) - len(table))
            digest = self.eng.cache_digest(table, prompt_len)
            tokens = self.eng.generate(first_token, prompt_len, table, n_gen)
        finally:
            self.keep(rid, table, keep, len(held))
        return {"tokens": tokens, "digest": digest, "held": len(held)}

    def drop(self, rid):
        self.eng.release(self.kept.pop(rid, []))
        return {}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--role", choices=("prefill", "decode"), required=True)
    ap.add_argument("--instance", required=True)
    ap.add_argument("--caches", choices=("own", "engine"), default="own")
    a = ap.parse_args()
    try:
        side = Side(a.role, a.instance, a.caches)
    except (Fail, kvferry.KvferryError, ValueError) as e:
        print(json.dumps({"ok": False, "error": str(e)}), flush=True)
        return 1
    ops = {"prefill": side.prefill} if a.role == "prefill" else \
        {"reserve": side.reserve, "decode": side.decode}
    ops["drop"] = side.drop
    print(json.dumps({"ok": True, "session": side.client.session,
                      "layout": repr(side.client.layout)}), flush=True)
    for line in sys.stdin:
        try:
            cmd = json.loads(line)
            op = ops.get(cmd.pop("op", None))
            if op is None:
                raise Fail("unknown command %r for a %s engine" % (line.strip(), a.role))
            out = dict(op(**cmd), ok=True)
        except (Fail, kvferry.KvferryError, RuntimeError, ValueError, TypeError) as e:
            out = {"ok": False, "error": "%s: %s" % (type(e).__name__, e)}
        print(json.dumps(out), flush=True)
    side.client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

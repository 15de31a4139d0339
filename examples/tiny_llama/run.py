#!/usr/bin/python3
"""The tiny Llama's KV cache carried by kvferry, token-exact: a reference and a disaggregated run.

    run.py --prefill P --decode D [--transports ipc,tcp] [--prompts 20] [--gen 12]
           [--caches own|engine]
    run.py --instance-flags      the `tools/kvferry up` shape flags of the model's cache

P and D are running instances (`tools/kvferry up --role prefill|decode` with the flags
--instance-flags prints, and --caches engine for --caches engine). This process runs every
request in one process first, the model over a cache of its own memory (the reference); then
starts a prefill engine on P and a decode engine on D (engine.py) and runs each request through
them over each transport: the decode engine reserves blocks, the prefill engine runs the prompt,
publishing each layer as it is written, and returns the first token; the decode engine takes the
arrival and generates the rest. For every request the tokens must equal the reference's, and the
decode side's K and V of the prompt (its digest) must equal the reference's bit for bit.

The requests: `--prompts` prompts of varied lengths (some a multiple of the block size, most
not); a decode-side prefix hit (a prompt that begins with the first full blocks of an earlier
one, which both sides kept: the task's dest_block_ids are fewer than its src_block_ids); and two
chunked prefills (chunks of a block-size multiple and not). Exit 0 when every request matches,
1 with each mismatch named.
"""
import argparse
import json
import os
import subprocess
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from model import Config, Engine, Weights, local_caches  # noqa: E402

LENGTHS = (1, 7, 16, 17, 31, 32, 33, 48, 50, 64, 65, 79, 96, 100, 111, 127, 128, 5, 40, 90)


def requests(cfg, n_prompts, n_gen, seed):
    """The schedule, the same for the reference and every transport."""
    g = torch.Generator().manual_seed(seed)

    def prompt(n):
        return torch.randint(0, cfg.vocab, (n,), generator=g).tolist()

    bs = cfg.block_size
    reqs = []
    for i in range(n_prompts):
        n = LENGTHS[i % len(LENGTHS)] + (i // len(LENGTHS)) * 3
        reqs.append({"name": "p%d" % i, "tokens": prompt(n), "n_gen": n_gen, "chunk": 0,
                     "prefix": None, "keep": 0})
    # A prefix hit: the longest prompt with at least two full blocks keeps them on both sides;
    # a later prompt begins with those blocks' tokens.
    a = max(reqs, key=lambda r: len(r["tokens"]) if len(r["tokens"]) < 4 * bs else 0)
    held = len(a["tokens"]) // bs
    if held >= 1:
        a["keep"] = held
        reqs.append({"name": "prefix-hit", "tokens": a["tokens"][: held * bs] + prompt(bs + 5),
                     "n_gen": n_gen, "chunk": 0, "prefix": {"rid": a["name"], "blocks": held},
                     "keep": 0, "drop": a["name"]})
    reqs.append({"name": "chunked-odd", "tokens": prompt(5 * bs + 4), "n_gen": n_gen,
                 "chunk": 2 * bs + 8, "prefix": None, "keep": 0})
    reqs.append({"name": "chunked-blocks", "tokens": prompt(4 * bs + 13), "n_gen": n_gen,
                 "chunk": bs, "prefix": None, "keep": 0})
    return reqs


def reference(cfg, weights, reqs):
    """Every request in this one process: its own cache, the same schedule (chunks, kept
    prefix blocks). Returns name -> (tokens, digest)."""
    eng = Engine(cfg, local_caches(cfg, 512), weights)
    kept, out = {}, {}
    for r in reqs:
        toks, n = r["tokens"], len(r["tokens"])
        held = kept[r["prefix"]["rid"]][: r["prefix"]["blocks"]] if r["prefix"] else []
        table = held + eng.alloc(eng.blocks_for(n + r["n_gen"] - 1) - len(held))
        start = len(held) * cfg.block_size
        step = r["chunk"] or n
        for lo in range(start, n, step):
            logits = eng.forward(toks[lo:min(lo + step, n)], lo, table)
        digest = eng.cache_digest(table, n)
        out[r["name"]] = (eng.generate(int(torch.argmax(logits)), n, table, r["n_gen"]), digest)
        if r["keep"]:
            kept[r["name"]] = table[: r["keep"]]
        eng.release(table[max(r["keep"], len(held)):])
        if r.get("drop"):
            eng.release(kept.pop(r["drop"]))
    return out


class EngineProc:
    """engine.py as a child process: one JSON command a line in, one answer a line out."""

    def __init__(self, role, instance, caches):
        self.role = role
        self.p = subprocess.Popen([sys.executable, os.path.join(HERE, "engine.py"), "--role",
                                   role, "--instance", instance, "--caches", caches],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.hello = self._answer()

    def _answer(self):
        line = self.p.stdout.readline()
        if not line:
            raise SystemExit("FAIL: the %s engine ended (exit %s)" % (self.role, self.p.wait()))
        ans = json.loads(line)
        if not ans.get("ok"):
            raise RuntimeError("%s engine: %s" % (self.role, ans.get("error")))
        return ans

    def call(self, op, **kw):
        self.p.stdin.write(json.dumps(dict(kw, op=op)) + "\n")
        self.p.stdin.flush()
        return self._answer()

    def close(self):
        self.p.stdin.close()
        if self.p.wait(timeout=30) != 0:
            raise SystemExit("FAIL: the %s engine exited %d" % (self.role, self.p.returncode))


def disaggregated(reqs, transport, pre, dec, decode_instance, tag):
    """Every request through the two engines over `transport`. name -> (tokens, digest, info)."""
    out = {}
    rid = lambda name: "%s-%s-%s" % (tag, transport, name)  # noqa: E731
    for r in reqs:
        prefix = dict(r["prefix"], rid=rid(r["prefix"]["rid"])) if r["prefix"] else None
        res = dec.call("reserve", rid=rid(r["name"]), prompt_len=len(r["tokens"]), prefix=prefix)
        p = pre.call("prefill", rid=rid(r["name"]), tokens=r["tokens"], dest=res["dest"],
                     peer=decode_instance, peer_session=res["session"], transport=transport,
                     chunk=r["chunk"], prefix=prefix, keep=r["keep"])
        if p["status"] != "finished":
            raise RuntimeError("%s over %s: completion %s (%s)" % (r["name"], transport,
                                                                   p["status"], p["reason"]))
        d = dec.call("decode", rid=rid(r["name"]), first_token=p["first_token"],
                     n_gen=r["n_gen"], keep=r["keep"])
        if r.get("drop"):
            pre.call("drop", rid=rid(r["drop"]))
            dec.call("drop", rid=rid(r["drop"]))
        out[r["name"]] = (d["tokens"], d["digest"],
                          {"dest": len(res["dest"]),
                           "bytes": p["bytes"], "steps": p["steps"], "held": d["held"]})
    return out


def user_errors(pre, dec, decode_instance):
    """Commands an engine must refuse with a message, going on working after them."""
    cases = ((dec, "decode", {"rid": "never-reserved", "first_token": 0, "n_gen": 2},
              "no blocks reserved"),
             (pre, "prefill", {"rid": "bad-prefix", "tokens": [1, 2, 3], "dest": [0],
                               "peer": decode_instance, "peer_session": 0, "transport": "ipc",
                               "prefix": {"rid": "nobody", "blocks": 1}}, "not kept here"),
             (dec, "reserve", {"rid": "too-long", "prompt_len": 1 << 30}, "cache full"))
    for proc, op, kw, want in cases:
        try:
            proc.call(op, **kw)
        except RuntimeError as e:
            if want not in str(e):
                raise SystemExit("FAIL: %s %r: %s, not '%s'" % (op, kw["rid"], e, want))
            continue
        raise SystemExit("FAIL: %s %r was not refused" % (op, kw["rid"]))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prefill")
    ap.add_argument("--decode")
    ap.add_argument("--transports", default="ipc,tcp")
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--gen", type=int, default=12, help="tokens generated per request")
    ap.add_argument("--caches", choices=("own", "engine"), default="own")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--instance-flags", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(1)  # deterministic kernels, the same as the engines'
    cfg = Config()
    if a.instance_flags:
        print(cfg.instance_flags())
        return 0
    if not a.prefill or not a.decode:
        ap.error("--prefill and --decode name the instances")
    if a.prompts < 1 or a.gen < 1:
        ap.error("--prompts and --gen must be at least 1")
    reqs = requests(cfg, a.prompts, a.gen, a.seed)
    t0 = time.monotonic()
    ref = reference(cfg, Weights(cfg), reqs)
    t_ref = time.monotonic() - t0
    distinct = len({tuple(t) for t, _ in ref.values()})
    try:
        pre = EngineProc("prefill", a.prefill, a.caches)
        dec = EngineProc("decode", a.decode, a.caches)
    except RuntimeError as e:
        print("FAIL: %s" % e)
        return 1
    user_errors(pre, dec, a.decode)
    bad, moved, t_dis = [], 0, {}
    transports = [t for t in a.transports.split(",") if t]
    for transport in transports:
        t0 = time.monotonic()
        got = disaggregated(reqs, transport, pre, dec, a.decode, "tl%d" % os.getpid())
        t_dis[transport] = time.monotonic() - t0
        for r in reqs:
            tokens, digest, info = got[r["name"]]
            want_tokens, want_digest = ref[r["name"]]
            moved += info["bytes"]
            if tokens != want_tokens:
                bad.append("%s over %s (%d tokens): tokens %r, the single process %r"
                           % (r["name"], transport, len(r["tokens"]), tokens, want_tokens))
            if digest != want_digest:
                bad.append("%s over %s: the decode side's K/V of the prompt differ from the "
                           "single process's" % (r["name"], transport))
            if r["prefix"] and info["held"] != r["prefix"]["blocks"]:
                bad.append("%s over %s: %d blocks held, %d expected" % (
                    r["name"], transport, info["held"], r["prefix"]["blocks"]))
    pre.close()
    dec.close()
    for b in bad:
        print("FAIL: " + b)
    if bad:
        return 1
    n = len(reqs)
    lens = [len(r["tokens"]) for r in reqs[: a.prompts]]
    print("ok: tiny_llama (%d layers, %d/%d heads, caches %s): %d requests x %s = %d: tokens "
          "equal to the single process's and the prompt's K/V bit-equal, every one (%d prompts "
          "of %d-%d tokens, a decode-side prefix hit of %d blocks, 2 chunked prefills; %d "
          "tokens each, %d distinct sequences); 3 bad commands refused; %.1f MiB moved; "
          "reference %.1f s, %s"
          % (cfg.layers, cfg.heads, cfg.kv_heads, a.caches, n, "{%s}" % ",".join(transports),
             n * len(transports), a.prompts, min(lens), max(lens),
             next((r["prefix"]["blocks"] for r in reqs if r["prefix"]), 0), a.gen, distinct,
             moved / 2**20, t_ref, ", ".join("%s %.1f s" % kv for kv in t_dis.items())))
    return 0


if __name__ == "__main__":
    sys.exit(main())

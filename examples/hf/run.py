#!/usr/bin/env python3
"""Hugging Face transformers models' KV caches carried by kvferry on GPU caches, token-exact.

    python3 examples/hf/run.py --model llama|qwen2|deepseek-v3 [--transport ipc|tcp]
                               [--prompts 20] [--gen 16]

Builds a small model of the family from its config with seeded random weights (no download),
bf16 on CUDA, attention "eager". Starts a prefill and a decode kvferry instance on GPU caches
(`tools/kvferry up --backend cuda`, the model's cache layout; or uses --prefill/--decode
instances already up), a prefill engine and a decode engine (this script with --serve), and
for each prompt:

  - the decode engine reserves blocks of its paged cache and hands them over with its session;
  - the prefill engine submits the task and runs the prompt through the model with a
    DynamicCache; a forward hook on each decoder layer copies that layer's K and V from the
    DynamicCache into its blocks of kvferry's paged cache (torch, on the current stream) and
    publishes the layer with layer_done_on_stream(); the first token is the argmax of the
    prompt's last logits;
  - the decode engine takes the arrival, builds a DynamicCache from the received blocks and
    generates greedily from the first token.

The reference is this process: the same model (same seed), model.generate(do_sample=False) per
prompt. Every prompt's tokens must equal the reference's, and the decode side's K and V of the
prompt must equal bit for bit those of a prefill in this process; exit 1 naming each mismatch,
77 (skipped) without torch, transformers or a GPU.

What is moved is what the model's DynamicCache holds, read from a one-token forward pass
(class Geometry). DeepSeek-V3 (MLA): transformers 5 caches per layer the compressed latent
(the normalised kv_lora_rank vector, as "keys") and the rotary key (qk_rope_head_dim, as
"values") of a single head; these travel in one key-only tensor, each token's latent and rotary
key side by side, as kvferry's deepseek-v3-mla layout holds MLA's cache (`--key-only`), and the
decode side splits them again. transformers 4.x cached the up-projected per-head K
(qk_nope_head_dim + qk_rope_head_dim) and V (v_head_dim) instead: those travel as K and V of
num_attention_heads heads, V zero-padded to K's head dim and cut back on the decode side.
"""
import argparse
import hashlib
import json
import os
import subprocess
import sys
import time

# Deterministic cuBLAS (must be set before CUDA starts): the engines and the reference must
# compute the same bits from the same inputs.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.normpath(os.path.join(HERE, "..", ".."))
MODELS = ("llama", "qwen2", "deepseek-v3")
BLOCK_SIZE = 16
LENGTHS = (1, 7, 16, 17, 31, 32, 33, 48, 50, 64, 65, 79, 96, 100, 111, 127, 128, 5, 40, 90)


def need_torch():
    try:
        import kvferry  # noqa: F401
    except ImportError:
        sys.path.insert(0, os.path.join(ROOT, "python"))  # the repository's package
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as e:
        print("skipped: %s (this script needs PyTorch and transformers)" % e)
        sys.exit(77)


def build_config(name):
    import transformers as tf
    common = dict(vocab_size=1024, hidden_size=256, intermediate_size=512,
                  max_position_embeddings=2048, initializer_range=0.1, tie_word_embeddings=False,
                  bos_token_id=None, eos_token_id=None, pad_token_id=None)
    if name == "llama":
        cfg = tf.LlamaConfig(num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                             head_dim=32, **common)
    elif name == "qwen2":
        cfg = tf.Qwen2Config(num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                             use_sliding_window=False, **common)
    elif name == "deepseek-v3":
        cfg = tf.DeepseekV3Config(num_hidden_layers=3, num_attention_heads=8,
                                  num_key_value_heads=8, moe_intermediate_size=128,
                                  n_shared_experts=1, n_routed_experts=8, num_experts_per_tok=2,
                                  n_group=2, topk_group=1, first_k_dense_replace=1,
                                  q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=32,
                                  qk_rope_head_dim=16, v_head_dim=32, **common)
    else:
        raise SystemExit("--model: one of %s" % ", ".join(MODELS))
    return cfg


class Geometry:
    """What the model's DynamicCache holds per layer, read from the cache of a one-token
    forward pass (it differs between transformers releases: DeepSeek-V3's MLA caches the
    up-projected per-head K and V in 4.x, the compressed latent in 5.x), and kvferry's layout
    for it:

    - K and V of `heads` heads (Llama, Qwen2; DeepSeek-V3 up-projected): two tensors per layer,
      head_dim the larger of K's and V's (the narrower one zero-padded, cut back on decode);
    - a single-head latent (DeepSeek-V3 in transformers 5: "keys" the normalised kv_lora_rank
      latent, "values" the rotary key of qk_rope_head_dim): one key-only tensor per layer, each
      token's latent and rotary key side by side (kv_lora_rank + qk_rope_head_dim), as
      kvferry's deepseek-v3-mla layout holds MLA's cache."""

    def __init__(self, model):
        import torch
        from transformers import DynamicCache
        cache = DynamicCache()
        dev = next(model.parameters()).device
        with torch.no_grad():
            model(input_ids=torch.tensor([[1]], device=dev), past_key_values=cache,
                  use_cache=True)
        k, v = layer_kv(cache, 0)
        if k.shape[1] != v.shape[1]:
            raise RuntimeError("the cache holds K of %d heads and V of %d" % (k.shape[1],
                                                                              v.shape[1]))
        self.layers, self.heads = len(cache.layers) if hasattr(cache, "layers") else \
            len(cache.key_cache), k.shape[1]
        self.kd, self.vd = k.shape[-1], v.shape[-1]
        self.key_only = self.heads == 1 and self.kd != self.vd
        self.head_dim = self.kd + self.vd if self.key_only else max(self.kd, self.vd)
        self.tensors = 1 if self.key_only else 2

    def flags(self):
        """`tools/kvferry up` flags of this layout."""
        return ["--layers", str(self.layers), "--kv-heads", str(self.heads), "--head-dim",
                str(self.head_dim), "--dtype", "bf16", "--block-size", str(BLOCK_SIZE)] + \
            (["--key-only"] if self.key_only else [])

    def __repr__(self):
        return "%d layers: %s" % (self.layers, (
            "a latent of %d + %d per token (key-only)" % (self.kd, self.vd) if self.key_only
            else "K of %d x %d, V of %d x %d" % (self.heads, self.kd, self.heads, self.vd)))


def build_model(name, seed):
    """The model, the same weights in every process: seeded init on the CPU in float32, then
    bf16 on the GPU."""
    import torch
    import transformers as tf
    torch.use_deterministic_algorithms(True, warn_only=True)
    cfg = build_config(name)
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    model = model.to(device="cuda", dtype=torch.bfloat16).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return cfg, model


def layer_kv(cache, layer):
    """One layer's (K, V) [batch, heads, seq, dim] of a DynamicCache (transformers 5: .layers;
    4.x: .key_cache / .value_cache)."""
    if hasattr(cache, "layers"):
        return cache.layers[layer].keys, cache.layers[layer].values
    return cache.key_cache[layer], cache.value_cache[layer]


def prefill_forward(model, tokens, on_layer=None):
    """The prompt through the model with a fresh DynamicCache, as generate() runs it (an
    attention mask of ones, logits of the last token only). on_layer(layer, cache) runs as each
    decoder layer returns. Returns (first token, cache)."""
    import torch
    from transformers import DynamicCache
    cache = DynamicCache()
    ids = torch.tensor([tokens], device="cuda")
    hooks = []
    if on_layer is not None:
        for i, layer in enumerate(model.model.layers):
            hooks.append(layer.register_forward_hook(
                lambda mod, args, out, i=i: on_layer(i, cache)))
    try:
        with torch.no_grad():
            out = model(input_ids=ids, attention_mask=torch.ones_like(ids),
                        past_key_values=cache, use_cache=True, logits_to_keep=1)
    finally:
        for h in hooks:
            h.remove()
    return int(torch.argmax(out.logits[0, -1].float())), cache


def decode_greedy(model, cache, first, prompt_len, n):
    """n tokens greedily from `first` at position prompt_len, as generate() steps (one token,
    the attention mask of every position so far, its cache position)."""
    import torch
    out = [first]
    with torch.no_grad():
        for i in range(n - 1):
            pos = prompt_len + i
            ids = torch.tensor([[out[-1]]], device="cuda")
            o = model(input_ids=ids, attention_mask=torch.ones(1, pos + 1, dtype=torch.long,
                                                               device="cuda"),
                      past_key_values=cache, use_cache=True, logits_to_keep=1,
                      cache_position=torch.tensor([pos], device="cuda"))
            out.append(int(torch.argmax(o.logits[0, -1].float())))
    return out


def digest(kvs, prompt_len):
    """sha256 of every layer's K and V of positions [0, prompt_len) (bf16 bits)."""
    import torch
    h = hashlib.sha256()
    for k, v in kvs:
        for t in (k, v):
            h.update(t[..., :prompt_len, :].contiguous().view(torch.int16).cpu().numpy()
                     .tobytes())
    return h.hexdigest()


def write_layer(paged, kv, blk, off):
    """One layer's K and V [1, heads, n, dim] (a DynamicCache's) into its paged tensors
    [blocks, heads, block_size, head_dim] at blocks blk, offsets off (one each per position):
    (K, V), the narrower zero-padded; or (latent,) key-only, K and V side by side."""
    import torch
    k, v = kv
    if len(paged) == 1:
        paged[0][blk, :, off] = torch.cat((k, v), dim=-1)[0].transpose(0, 1)
        return
    for t, x in zip(paged, (k, v)):
        if x.shape[-1] < t.shape[-1]:
            x = torch.nn.functional.pad(x, (0, t.shape[-1] - x.shape[-1]))
        t[blk, :, off] = x[0].transpose(0, 1)


def cache_from_blocks(paged, table, n, geo):
    """A DynamicCache of positions [0, n) from the blocks `table` of the paged cache (a copy),
    K and V cut back to what the model caches. Returns (cache, [(K, V) per layer])."""
    import torch
    from transformers import DynamicCache
    tab = torch.tensor(table, device="cuda")
    cache, kvs = DynamicCache(), []

    def seq(t):  # [blocks, heads, bs, dim] -> [1, heads, n, dim]
        return t[tab].permute(1, 0, 2, 3).reshape(t.shape[1], -1, t.shape[3])[:, :n]

    for layer, tensors in enumerate(paged):
        if geo.key_only:
            x = seq(tensors[0])
            k, v = x[..., :geo.kd], x[..., geo.kd:geo.kd + geo.vd]
        else:
            k, v = seq(tensors[0])[..., :geo.kd], seq(tensors[1])[..., :geo.vd]
        k, v = k.unsqueeze(0).contiguous(), v.unsqueeze(0).contiguous()
        cache.update(k, v, layer)
        kvs.append((k, v))
    return cache, kvs


def local_run(cfg, model, name, prompts, gen):
    """The engines' path without kvferry, in this process: prefill into a paged cache of this
    process's GPU memory through the same hooks, a DynamicCache from its blocks, the same
    greedy loop. Returns [(tokens, digest)] per prompt."""
    import torch
    geo = Geometry(model)
    nb = max(-(-len(p) // BLOCK_SIZE) for p in prompts) + 3
    paged = [tuple(torch.zeros((nb, geo.heads, BLOCK_SIZE, geo.head_dim), dtype=torch.bfloat16,
                               device="cuda") for _ in range(geo.tensors))
             for _ in range(geo.layers)]
    out = []
    for p in prompts:
        n = len(p)
        table = list(range(nb - 1, nb - 1 - -(-n // BLOCK_SIZE), -1))  # scattered: reversed
        tab = torch.tensor(table, device="cuda")
        pos = torch.arange(n, device="cuda")
        blk, off = tab[pos // BLOCK_SIZE], pos % BLOCK_SIZE
        first, _ = prefill_forward(model, p, lambda layer, c: write_layer(
            paged[layer], layer_kv(c, layer), blk, off))
        cache, kvs = cache_from_blocks(paged, table, n, geo)
        out.append((decode_greedy(model, cache, first, n, gen), digest(kvs, n)))
    return out


# -- the engines (--serve) -------------------------------------------------------------------

class Served:
    def __init__(self, role, instance, name, seed, caches="own"):
        import torch
        import kvferry
        self.kvferry, self.role, self.name = kvferry, role, name
        self.cfg, self.model = build_model(name, seed)
        self.client = kvferry.Client(instance)
        lo = self.client.layout
        self.geo = geo = Geometry(self.model)
        want = (geo.layers, geo.heads, BLOCK_SIZE, geo.head_dim, "bf16", geo.key_only)
        have = (lo.num_layers, lo.kv_heads, lo.block_size, lo.head_dim, lo.dtype_name,
                bool(lo.key_only))
        own = caches == "own"
        if want != have or lo.extra_layers or (own and self.client.device is None):
            raise RuntimeError("instance %s has %r on %s; %s caches %r: start it with "
                               "--backend cuda %s" % (
                                   instance, lo, "host memory" if self.client.device is None
                                   else "GPU %d" % self.client.device, name, geo,
                                   " ".join(geo.flags())))
        if own:
            dev = torch.device("cuda", self.client.device)
            self.paged = [tuple(torch.as_tensor(self.client.tensor(layer, v), device=dev)
                                .view(torch.bfloat16) for v in range(geo.tensors))
                          for layer in range(lo.num_layers)]
        else:
            # The engine's own caches (an instance started with --caches engine): tensors of
            # PyTorch's caching allocator, handed to kvferry, which moves blocks out of and into
            # them where they are.
            dev = torch.device("cuda", torch.cuda.current_device())
            self.paged = [tuple(torch.zeros(lo.shape, dtype=torch.bfloat16, device=dev)
                                for _ in range(geo.tensors)) for _ in range(lo.num_layers)]
            self.client.register_caches(self.paged)
        self.free = list(range(lo.num_blocks))
        self.reserved = {}
        self.early = {}
        self.step = self.client.last_step

    def alloc(self, n):
        if n > len(self.free):
            raise RuntimeError("cache full: %d blocks wanted, %d free" % (n, len(self.free)))
        got, self.free = self.free[:n], self.free[n:]
        return got

    def wait_event(self, rid, timeout_s=60.0):
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
        raise RuntimeError("%s: no event after %.0f s" % (rid, timeout_s))

    def prefill(self, rid, tokens, dest, peer, peer_session, transport):
        import torch
        n = len(tokens)
        table = self.alloc(-(-n // BLOCK_SIZE))
        tab = torch.tensor(table, device="cuda")
        pos = torch.arange(n, device="cuda")
        blk, off = tab[pos // BLOCK_SIZE], pos % BLOCK_SIZE
        self.step += 1
        step = self.step
        self.client.submit_task({"request_id": rid, "src_block_ids": table,
                                 "dest_block_ids": dest, "current_id": step,
                                 "transfer_protocol": transport, "peer": peer,
                                 "peer_session": peer_session})
        stream = torch.cuda.current_stream()

        def on_layer(layer, cache):
            write_layer(self.paged[layer], layer_kv(cache, layer), blk, off)
            self.client.layer_done_on_stream(stream.cuda_stream, step, layer)

        try:
            first, _ = prefill_forward(self.model, tokens, on_layer)
        except BaseException:
            self.client.cancel(rid)
            self.wait_event(rid)
            self.free.extend(table)
            raise
        done = self.wait_event(rid)
        self.free.extend(table)
        return {"first_token": first, "status": done["status"], "reason": done["reason"],
                "bytes": done["bytes"]}

    def reserve(self, rid, prompt_len):
        dest = self.alloc(-(-prompt_len // BLOCK_SIZE))
        self.reserved[rid] = (dest, prompt_len)
        return {"dest": dest, "session": self.client.session}

    def decode(self, rid, first_token, n_gen):
        if rid not in self.reserved:
            raise RuntimeError("%s: no blocks reserved for it" % rid)
        dest, n = self.reserved.pop(rid)
        try:
            ev = self.wait_event(rid)
            if ev["status"] != "finished" or ev["dest_block_ids"] != dest:
                raise RuntimeError("%s: arrival %s (%s), blocks %r for %r" % (
                    rid, ev["status"], ev["reason"], ev["dest_block_ids"], dest))
            cache, kvs = cache_from_blocks(self.paged, dest, n, self.geo)
            d = digest(kvs, n)
            tokens = decode_greedy(self.model, cache, first_token, n, n_gen)
        finally:
            self.free.extend(dest)
        return {"tokens": tokens, "digest": d}


def serve(a):
    try:
        s = Served(a.serve, a.instance, a.model, a.seed, a.caches)
    except Exception as e:  # noqa: BLE001 - told to the driver, which names it
        print(json.dumps({"ok": False, "error": "%s: %s" % (type(e).__name__, e)}), flush=True)
        return 1
    ops = {"prefill": s.prefill} if a.serve == "prefill" else \
        {"reserve": s.reserve, "decode": s.decode}
    print(json.dumps({"ok": True, "session": s.client.session}), flush=True)
    for line in sys.stdin:
        try:
            cmd = json.loads(line)
            op = ops.get(cmd.pop("op", None))
            if op is None:
                raise RuntimeError("unknown command %r" % line.strip())
            out = dict(op(**cmd), ok=True)
        except Exception as e:  # noqa: BLE001 - the engine answers and goes on
            out = {"ok": False, "error": "%s: %s" % (type(e).__name__, e)}
        print(json.dumps(out), flush=True)
    import torch
    torch.cuda.synchronize()  # the stream's layer signals have run before the session ends
    s.client.close()
    return 0


# -- the driver ------------------------------------------------------------------------------

class EngineProc:
    def __init__(self, role, instance, a):
        self.role = role
        self.p = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--serve", role,
                                   "--instance", instance, "--model", a.model, "--seed",
                                   str(a.seed), "--caches", a.caches], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  text=True)
        self._answer()

    def _answer(self):
        line = self.p.stdout.readline()
        if not line:
            raise SystemExit("FAIL: the %s engine ended (exit %s)" % (self.role, self.p.wait()))
        ans = json.loads(line)
        if not ans.get("ok"):
            raise SystemExit("FAIL: %s engine: %s" % (self.role, ans.get("error")))
        return ans

    def call(self, op, **kw):
        self.p.stdin.write(json.dumps(dict(kw, op=op)) + "\n")
        self.p.stdin.flush()
        return self._answer()

    def close(self):
        if self.p.poll() is None:
            self.p.stdin.close()
            self.p.wait(timeout=60)


def kvferry_cli(*args):
    r = subprocess.run([os.path.join(ROOT, "tools", "kvferry")] + list(args),
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if r.returncode:
        raise SystemExit("FAIL: tools/kvferry %s: %s" % (" ".join(args), r.stderr.strip()))


def drive(a):
    import torch
    cfg, model = build_model(a.model, a.seed)
    g = torch.Generator().manual_seed(a.seed + 1)
    prompts = [torch.randint(0, cfg.vocab_size, (LENGTHS[i % len(LENGTHS)] + i // len(LENGTHS),),
                             generator=g).tolist() for i in range(a.prompts)]
    # The reference: model.generate in this process, and the prompt's K/V of a prefill here.
    t0 = time.monotonic()
    ref = []
    for p in prompts:
        ids = torch.tensor([p], device="cuda")
        with torch.no_grad():
            seq = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                 max_new_tokens=a.gen, do_sample=False)
        first, cache = prefill_forward(model, p)
        dg = digest([layer_kv(cache, i) for i in range(cfg.num_hidden_layers)], len(p))
        # the engines' own loop in this process: tells a transport problem from a difference
        # between that loop and generate()
        ref.append((seq[0, len(p):].tolist(), dg, decode_greedy(model, cache, first, len(p),
                                                                a.gen)))
    t_ref = time.monotonic() - t0
    geo = Geometry(model)
    if a.local:
        bad = []
        for i, (tokens, dg) in enumerate(local_run(cfg, model, a.model, prompts, a.gen)):
            if tokens != ref[i][0] or dg != ref[i][1]:
                bad.append("prompt %d (%d tokens): paged path %r %s, generate %r, loop %r" % (
                    i, len(prompts[i]), tokens, "K/V equal" if dg == ref[i][1] else
                    "K/V differ", ref[i][0], ref[i][2]))
        for b in bad:
            print("FAIL: %s local: %s" % (a.model, b))
        if not bad:
            print("ok: %s local (no kvferry): %d prompts through a paged cache of this "
                  "process's memory equal to model.generate, K/V bit-equal (torch %s, "
                  "transformers %s)" % (a.model, len(prompts), torch.__version__,
                                        __import__("transformers").__version__))
        return 1 if bad else 0
    del model
    torch.cuda.empty_cache()

    started = []
    pname, dname = a.prefill, a.decode
    try:
        if not pname or not dname:
            tag = "hf%d" % os.getpid()
            pname, dname = tag + "-p", tag + "-d"
            flags = geo.flags() + ["--backend", "cuda", "--blocks", "512", "--caches", a.caches]
            for name, role in ((dname, "decode"), (pname, "prefill")):
                kvferry_cli("up", "--instance", name, "--role", role, *flags)
                started.append(name)
        pre, dec = EngineProc("prefill", pname, a), EngineProc("decode", dname, a)
        bad, moved = [], 0
        t0 = time.monotonic()
        for i, p in enumerate(prompts):
            rid = "hf-%d-%s-%s-%d" % (os.getpid(), a.model, a.transport, i)
            res = dec.call("reserve", rid=rid, prompt_len=len(p))
            pr = pre.call("prefill", rid=rid, tokens=p, dest=res["dest"], peer=dname,
                          peer_session=res["session"], transport=a.transport)
            if pr["status"] != "finished":
                bad.append("prompt %d: completion %s (%s)" % (i, pr["status"], pr["reason"]))
                continue
            d = dec.call("decode", rid=rid, first_token=pr["first_token"], n_gen=a.gen)
            moved += pr["bytes"]
            if d["tokens"] != ref[i][0]:
                bad.append("prompt %d (%d tokens): tokens %r, model.generate %r (%s)"
                           % (i, len(p), d["tokens"], ref[i][0],
                              "and the same prefill-and-decode loop in one process gave "
                              "the engines' tokens: not a transport problem"
                              if d["tokens"] == ref[i][2] else
                              "the loop in one process gave %r" % (ref[i][2],)))
            if d["digest"] != ref[i][1]:
                bad.append("prompt %d: the decode side's K/V differ from a prefill in one "
                           "process" % i)
        t_dis = time.monotonic() - t0
        pre.close()
        dec.close()
    finally:
        for name in started:
            kvferry_cli("down", "--instance", name)
    for b in bad:
        print("FAIL: %s %s: %s" % (a.model, a.transport, b))
    if bad:
        return 1
    print("ok: %s over %s: %d prompts of %d-%d tokens, %d tokens each: equal to model.generate "
          "in one process, the prompt's K/V bit-equal (%.1f MiB moved; reference %.1f s, "
          "disaggregated %.1f s; torch %s, transformers %s)"
          % (a.model, a.transport, len(prompts), min(map(len, prompts)),
             max(map(len, prompts)), a.gen, moved / 2**20, t_ref, t_dis, torch.__version__,
             __import__("transformers").__version__))
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=MODELS, default="llama")
    ap.add_argument("--transport", choices=("ipc", "tcp"), default="ipc")
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--gen", type=int, default=16)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--prefill", help="a running prefill instance (default: start one)")
    ap.add_argument("--decode", help="a running decode instance (default: start one)")
    ap.add_argument("--local", action="store_true",
                    help="no kvferry: the engines' path (hooks into a paged cache, a "
                    "DynamicCache from its blocks) in this process, against model.generate")
    ap.add_argument("--instance-flags", action="store_true",
                    help="print the `tools/kvferry up` shape flags of --model's cache and exit")
    ap.add_argument("--caches", choices=("own", "engine"), default="own",
                    help="engine: the engines allocate their caches with PyTorch and register "
                    "them (instances started with --caches engine); own: kvferry's caches")
    ap.add_argument("--serve", choices=("prefill", "decode"), help=argparse.SUPPRESS)
    ap.add_argument("--instance", help=argparse.SUPPRESS)
    a = ap.parse_args()
    need_torch()
    if a.instance_flags:
        import transformers as tf
        # the cache's shapes only: a float32 model on the CPU, no GPU needed
        print(" ".join(Geometry(tf.AutoModelForCausalLM.from_config(
            build_config(a.model), attn_implementation="eager")).flags()))
        return 0
    if a.serve:
        return serve(a)
    if a.prompts < 1 or a.gen < 1:
        ap.error("--prompts and --gen must be at least 1")
    import torch
    if not torch.cuda.is_available():
        print("skipped: no GPU visible to torch")
        return 77
    return drive(a)


if __name__ == "__main__":
    sys.exit(main())

"""A small Llama-like decoder with a paged KV cache, in plain PyTorch (1.13 and 2.x).

RMSNorm, rotary position embeddings, grouped-query attention, SwiGLU MLP; seeded random weights,
float32 on CPU, one thread: every run of the same schedule gives the same bits. The KV cache is
paged: per layer a K and a V tensor [num_blocks, kv_heads, block_size, head_dim] (kvferry's
heads-major block layout) in the cache dtype (fp16 by default), so one layer's cache of one
request is a list of blocks, which is what kvferry moves.

Every forward pass goes through `Engine.forward(tokens, start, table, on_layer)`: the tokens at
positions [start, start + len(tokens)) of a sequence whose blocks are `table`. It writes their
K and V into the cache, then attends over positions [0, start + len(tokens)) read back from the
cache. Prefill (start 0), a chunk of a chunked prefill, a prefill after a prefix-cache hit
(start > 0, the prefix's blocks already in the cache) and a decode step (one token) are that
one function; a disaggregated run and a single process therefore compute the same bits as long
as the cache's blocks hold the same bytes.
"""
import hashlib
import math

import torch


class Config:
    """The model's shape. block_size and the cache dtype are the cache's, not the model's."""

    def __init__(self, vocab=512, hidden=256, layers=4, heads=8, kv_heads=2, head_dim=32,
                 intermediate=512, rope_theta=10000.0, eps=1e-5, block_size=16,
                 cache_dtype="fp16", seed=20261202):
        self.vocab, self.hidden, self.layers = vocab, hidden, layers
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.intermediate, self.rope_theta, self.eps = intermediate, rope_theta, eps
        self.block_size, self.cache_dtype, self.seed = block_size, cache_dtype, seed
        if heads % kv_heads:
            raise ValueError("heads (%d) must be a multiple of kv_heads (%d)" % (heads, kv_heads))

    @property
    def torch_cache_dtype(self):
        return {"fp16": torch.float16, "bf16": torch.bfloat16}[self.cache_dtype]

    def instance_flags(self):
        """`tools/kvferry up` flags giving an instance this model's cache layout."""
        return "--layers %d --kv-heads %d --head-dim %d --dtype %s --block-size %d" % (
            self.layers, self.kv_heads, self.head_dim, self.cache_dtype, self.block_size)


class Weights:
    """Seeded random weights: the same on every process that builds them from one Config."""

    def __init__(self, cfg):
        g = torch.Generator().manual_seed(cfg.seed)

        def w(rows, cols):  # [in, out], scaled so activations stay of order one
            return torch.randn(rows, cols, generator=g) / math.sqrt(rows)

        h, q, kv = cfg.hidden, cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
        self.embed = torch.randn(cfg.vocab, h, generator=g)
        self.layers = []
        for _ in range(cfg.layers):
            self.layers.append({
                "attn_norm": 1.0 + 0.1 * torch.randn(h, generator=g),
                "wq": w(h, q), "wk": w(h, kv), "wv": w(h, kv), "wo": w(q, h),
                "mlp_norm": 1.0 + 0.1 * torch.randn(h, generator=g),
                "w_gate": w(h, cfg.intermediate), "w_up": w(h, cfg.intermediate),
                "w_down": w(cfg.intermediate, h),
            })
        self.norm = 1.0 + 0.1 * torch.randn(h, generator=g)
        self.lm_head = w(h, cfg.vocab)


def rms_norm(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rope(x, positions, theta):
    """Rotary embedding of x [T, heads, head_dim] at positions [T] (the halves convention)."""
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    ang = positions.to(torch.float32)[:, None] * inv[None, :]  # [T, d/2]
    cos, sin = torch.cos(ang)[:, None, :], torch.sin(ang)[:, None, :]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def local_caches(cfg, num_blocks):
    """A cache of the process's own memory: per layer (K, V), zeroed."""
    shape = (num_blocks, cfg.kv_heads, cfg.block_size, cfg.head_dim)
    return [(torch.zeros(shape, dtype=cfg.torch_cache_dtype),
             torch.zeros(shape, dtype=cfg.torch_cache_dtype)) for _ in range(cfg.layers)]


class Engine:
    """The model over one paged cache, with the cache's free-block list."""

    def __init__(self, cfg, caches, weights=None):
        self.cfg = cfg
        self.w = weights or Weights(cfg)
        self.caches = caches
        want = (cfg.kv_heads, cfg.block_size, cfg.head_dim)
        for layer, (k, v) in enumerate(caches):
            for t in (k, v):
                if tuple(t.shape[1:]) != want or t.dtype != cfg.torch_cache_dtype:
                    raise ValueError("layer %d's cache is %s %s; the model wants [blocks, %d, %d, "
                                     "%d] %s" % (layer, tuple(t.shape), t.dtype, *want,
                                                 cfg.torch_cache_dtype))
        if len(caches) != cfg.layers:
            raise ValueError("%d cache layers for a model of %d" % (len(caches), cfg.layers))
        self.num_blocks = caches[0][0].shape[0]
        self.free = list(range(self.num_blocks))

    # -- blocks ----------------------------------------------------------------------------

    def alloc(self, n):
        if n > len(self.free):
            raise RuntimeError("cache full: %d blocks wanted, %d free" % (n, len(self.free)))
        got, self.free = self.free[:n], self.free[n:]
        return got

    def release(self, blocks):
        self.free.extend(blocks)

    def blocks_for(self, tokens):
        return -(-tokens // self.cfg.block_size)

    # -- the model -------------------------------------------------------------------------

    @torch.no_grad()
    def forward(self, tokens, start, table, on_layer=None):
        """Run tokens (a list of ids) at positions [start, start + len(tokens)) of the sequence
        whose blocks are `table`; writes their K and V into the cache and calls on_layer(layer)
        once a layer's K and V are in it. Returns the logits of the last token [vocab]."""
        cfg, w = self.cfg, self.w
        n, bs = len(tokens), cfg.block_size
        end = start + n
        if self.blocks_for(end) > len(table):
            raise ValueError("%d tokens need %d blocks; the table has %d"
                             % (end, self.blocks_for(end), len(table)))
        pos = torch.arange(start, end)
        blk = torch.tensor([table[p // bs] for p in range(start, end)])
        off = pos % bs
        seq_blocks = torch.tensor(table[: self.blocks_for(end)])
        group = cfg.heads // cfg.kv_heads
        # query t (position start + t) sees keys [0, start + t]
        mask = torch.arange(end)[None, :] > pos[:, None]  # [n, end]
        x = w.embed[torch.tensor(tokens)]
        for layer, lw in enumerate(w.layers):
            h = rms_norm(x, lw["attn_norm"], cfg.eps)
            q = rope((h @ lw["wq"]).view(n, cfg.heads, cfg.head_dim), pos, cfg.rope_theta)
            k = rope((h @ lw["wk"]).view(n, cfg.kv_heads, cfg.head_dim), pos, cfg.rope_theta)
            v = (h @ lw["wv"]).view(n, cfg.kv_heads, cfg.head_dim)
            kc, vc = self.caches[layer]
            kc[blk, :, off] = k.to(kc.dtype)
            vc[blk, :, off] = v.to(vc.dtype)
            if on_layer is not None:
                on_layer(layer)
            # The sequence's K and V, read back from the cache: [kv_heads, end, head_dim]
            keys = kc[seq_blocks].permute(1, 0, 2, 3).reshape(cfg.kv_heads, -1, cfg.head_dim)
            vals = vc[seq_blocks].permute(1, 0, 2, 3).reshape(cfg.kv_heads, -1, cfg.head_dim)
            keys = keys[:, :end].float().repeat_interleave(group, dim=0)  # [heads, end, hd]
            vals = vals[:, :end].float().repeat_interleave(group, dim=0)
            scores = q.transpose(0, 1) @ keys.transpose(1, 2) / math.sqrt(cfg.head_dim)
            scores = scores.masked_fill(mask[None], float("-inf"))
            att = torch.softmax(scores, dim=-1) @ vals  # [heads, n, hd]
            x = x + att.transpose(0, 1).reshape(n, -1) @ lw["wo"]
            h = rms_norm(x, lw["mlp_norm"], cfg.eps)
            gate = h @ lw["w_gate"]
            x = x + (gate * torch.sigmoid(gate) * (h @ lw["w_up"])) @ lw["w_down"]
        return (rms_norm(x[-1:], w.norm, cfg.eps) @ w.lm_head)[0]

    def generate(self, first_token, length, table, n):
        """Greedy decoding: first_token sits at position `length` (the cache holds [0, length));
        returns n tokens, first_token included. `table` must have room for length + n - 1."""
        out = [first_token]
        for i in range(n - 1):
            logits = self.forward([out[-1]], length + i, table)
            out.append(int(torch.argmax(logits)))
        return out

    def cache_digest(self, table, length):
        """sha256 of the K and V bytes of positions [0, length) of the sequence in `table`,
        every layer: equal digests mean the same attention state."""
        hsh = hashlib.sha256()
        idx = torch.tensor(table[: self.blocks_for(length)])
        for kc, vc in self.caches:
            for c in (kc, vc):
                s = c[idx].permute(1, 0, 2, 3).reshape(self.cfg.kv_heads, -1, self.cfg.head_dim)
                hsh.update(s[:, :length].contiguous().view(torch.int16).numpy().tobytes())
        return hsh.hexdigest()

"""Prune-at-prefill baseline (SnapKV / TokenGate style), as a variant of the full-attention layer.

What such systems do: prefill the prompt with full attention, score every prompt token by the attention it gets
from an observation window (the last W prompt tokens: the question), keep the first sinks, the top tokens by
that score and the recent window, and **drop the rest of the prompt's KV for good**; everything generated or
appended afterwards is kept. Follow-up questions then only see what the first question found relevant.

How it runs here, without touching the engine: `install_prune(llm, ...)` swaps each full-attention core of a
dense engine for a `PruneAttention` that shares its KV cache. Every row stays physically in the paged cache (so
prefix caching and GDN snapshots behave as usual), but once armed with the prune point P (the first turn's
prompt length) and the window W (the first question's tokens), the layer

* attends densely for queries at positions < P (the prompt prefill, exactly as SnapKV: the prompt is
  prefilled in full before compression), capturing the post-RoPE queries of positions P-W .. P-1;
* when the prefill reaches P, scores keys 0..P-1 with those queries (softmax attention weights summed over the
  window and over the query heads of each KV head, max-pooled over `pool` neighbouring positions as SnapKV
  does), and keeps per KV head (or per layer with `shared`) the first `sinks` tokens, the `top_k` best of the
  rest and the last `recent` prompt tokens: the same sinks + top-k + recent budget that sparse decode reads
  per step;
* for every query at position >= P (the answer to the first question and every later turn, whether decoded
  or prefilled when the conversation is re-sent), attends only to kept prompt tokens plus all tokens >= P,
  causally, with the original positions (RoPE was applied before the cache, so positions are untouched).

Gated DeltaNet layers of hybrid models still see every token (their state is O(1), nothing to prune), as in a
pruned hybrid deployment. One sequence at a time (the evaluation runs conversations one by one); CUDA graphs
must be off (`enforce_eager=True`), since the decode graphs would have captured the dense layers.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from sketchkv.engine.context import get_context
from sketchkv.layers.attention import Attention
from sketchkv.ops.paged_attention import gather_kv
from sketchkv.ops.prefill_attention import prefix_causal_attention
from sketchkv.ops.topk import topk


def snapkv_scores(q_obs: torch.Tensor, q_pos: torch.Tensor, keys: torch.Tensor, scale: float,
                  max_bytes: int = 1 << 30) -> torch.Tensor:
    """Attention weight each key gets from the observation queries.

    q_obs [W, Hq, D] at absolute positions q_pos [W]; keys [P, Hkv, D] at positions 0..P-1 -> [Hkv, P] fp32:
    causal softmax weights summed over the W queries and over the query heads of each KV head's group."""
    W, Hq, D = q_obs.shape
    P, Hkv, _ = keys.shape
    G = Hq // Hkv
    kf = keys.float()
    out = torch.zeros(Hkv, P, device=keys.device)
    key_pos = torch.arange(P, device=keys.device)
    step = max(1, max_bytes // max(1, Hq * P * 4))
    for i in range(0, W, step):
        qc = q_obs[i:i + step].float().view(-1, Hkv, G, D)
        s = torch.einsum("whgd,khd->hgwk", qc, kf) * scale
        s.masked_fill_(key_pos[None, :] > q_pos[i:i + step, None].to(keys.device), float("-inf"))
        out += s.softmax(-1).sum((1, 2))
    return out


def select_keep(scores: torch.Tensor, sinks: int, top_k: int, recent: int, pool: int = 7,
                shared: bool = False) -> torch.Tensor:
    """scores [Hkv, P] -> kept-token mask [Hkv, P]: first `sinks`, last `recent`, and the `top_k` best (after
    max-pooling over `pool` positions) of the tokens between them; ties go to the earlier position."""
    Hkv, P = scores.shape
    s = scores.float()
    if shared:
        s = s.sum(0, keepdim=True)
    if pool > 1:
        pool = pool | 1  # odd, so the pooled score stays centred
        s = F.max_pool1d(s[:, None], pool, stride=1, padding=pool // 2)[:, 0]
    keep = torch.zeros(s.shape, dtype=torch.bool, device=s.device)
    lo = min(sinks, P)
    hi = max(P - recent, lo)
    keep[:, :lo] = True
    keep[:, hi:] = True
    if hi > lo and top_k > 0:
        _, picks = topk(s[:, lo:hi].contiguous(), min(top_k, hi - lo))
        keep.scatter_(1, picks + lo, True)
    return keep.expand(Hkv, P).clone() if shared else keep


class PruneAttention(Attention):
    def __init__(self, dense: Attention, sinks: int, top_k: int, recent: int, pool: int = 7, shared: bool = False):
        super().__init__(dense.num_heads, dense.num_kv_heads, dense.head_dim, dense.scale)
        self.k_cache, self.v_cache = dense.k_cache, dense.v_cache   # the same paged cache
        self.sinks, self.top_k, self.recent, self.pool, self.shared = sinks, top_k, recent, pool, shared
        self.arm(None)

    def arm(self, prune_at: int | None, window: int | None = None) -> None:
        """Prune at prompt length `prune_at` (None: plain dense), scoring with its last `window` queries."""
        self.prune_at = prune_at
        self.window = max(1, window or 32)
        self.keep: torch.Tensor | None = None      # [Hkv, prune_at] bool, once the prefill reached prune_at
        self._obs: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._union = self._union_mask = None

    def kept_fraction(self, lo: int, hi: int) -> float | None:
        """Fraction of prompt positions [lo, hi) kept (mean over KV heads)."""
        if self.keep is None or hi <= lo:
            return None
        return float(self.keep[:, lo:hi].float().mean())

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.prune_at is None:
            return super().forward(q, k, v)
        ctx = get_context()
        if ctx.num_seqs != 1:
            raise RuntimeError("the prune-at-prefill baseline runs one sequence at a time")
        self.store_kv(k, v)
        P = self.prune_at
        start, n = ctx.context_lens[0], ctx.query_lens[0]
        table = ctx.block_tables[0]
        m = max(0, min(n, P - start))          # this step's queries before the prune point: dense
        outs = []
        if m:
            kb, vb = gather_kv(self.k_cache, self.v_cache, table, start + m)
            outs.append(prefix_causal_attention(q[:m], kb.to(q.dtype), vb.to(q.dtype), self.scale))
            if self.keep is None:
                lo = max(start, P - self.window)
                if lo < start + m:
                    self._obs.append((torch.arange(lo, start + m, device=q.device), q[lo - start:m].float()))
                if start + m == P:
                    self._compute_keep(kb)
        if m < n:
            if self.keep is None:
                raise RuntimeError("prune baseline: tokens past the prune point before the prompt was prefilled")
            outs.append(self._pruned(q[m:], start + m, start + n, table))
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def _compute_keep(self, keys: torch.Tensor) -> None:
        pos = torch.cat([p for p, _ in self._obs])
        qo = torch.cat([x for _, x in self._obs])
        scores = snapkv_scores(qo, pos, keys, self.scale)
        self.keep = select_keep(scores, self.sinks, self.top_k, self.recent, self.pool, self.shared)
        self._union = self.keep.any(0).nonzero()[:, 0]
        self._union_mask = self.keep[:, self._union]
        self._obs = []

    def _pruned(self, q: torch.Tensor, p0: int, p1: int, table: torch.Tensor, chunk: int = 256) -> torch.Tensor:
        """Queries at positions p0..p1-1 (>= P) over kept prompt tokens + every token from P on, causal."""
        P, dev = self.prune_at, q.device
        Hq, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        G = Hq // Hkv
        idx = torch.cat([self._union, torch.arange(P, p1, device=dev)])
        bs = self.k_cache.shape[1]
        slots = table[idx // bs].long() * bs + idx % bs
        K = self.k_cache.view(-1, Hkv, D)[slots].float()
        V = self.v_cache.view(-1, Hkv, D)[slots].float()
        allow = torch.cat([self._union_mask, torch.ones(Hkv, p1 - P, dtype=torch.bool, device=dev)], 1)
        qpos = torch.arange(p0, p1, device=dev)
        out = torch.empty_like(q)
        for i in range(0, p1 - p0, chunk):
            qc = q[i:i + chunk].float().view(-1, Hkv, G, D)
            s = torch.einsum("qhgd,khd->hgqk", qc, K) * self.scale
            mask = allow[:, None, None, :] & (idx[None, :] <= qpos[i:i + chunk, None])[None, None]
            s = s.masked_fill(~mask, float("-inf"))
            o = torch.einsum("hgqk,khd->qhgd", s.softmax(-1), V)
            out[i:i + chunk] = o.reshape(-1, Hq, D).to(q.dtype)
        return out


def install_prune(llm, sinks: int, top_k: int, recent: int, pool: int = 7, shared: bool = False) \
        -> list[PruneAttention]:
    """Swap every (non-MTP) dense full-attention core of `llm` for a PruneAttention sharing its cache."""
    runner = llm.engine.runner
    if runner.graphs:
        raise RuntimeError("install_prune needs an engine without CUDA graphs (enforce_eager=True)")
    if runner.sparse_layers:
        raise RuntimeError("install_prune needs a dense engine")
    layers = []
    for name, mod in list(llm.engine.model.named_modules()):
        if name.startswith("mtp"):
            continue
        for child_name, child in list(mod.named_children()):
            if type(child) is Attention:
                new = PruneAttention(child, sinks, top_k, recent, pool, shared)
                setattr(mod, child_name, new)
                layers.append(new)
                runner.attn_layers = [new if m is child else m for m in runner.attn_layers]
    if not layers:
        raise RuntimeError("no full-attention layer to prune")
    return layers

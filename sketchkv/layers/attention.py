"""Full-attention core over the paged KV cache (dense path).

The projections, norms and RoPE live in the model's attention module; this layer only stores
the new K/V rows in the cache and attends. Sparse decode is a second implementation of this
same interface (q, k, v in -> attention output), swapped in per layer.
"""
import torch
from torch import nn

from sketchkv.engine.context import get_context
from sketchkv.ops.paged_attention import gather_kv, paged_attention_decode
from sketchkv.ops.prefill_attention import prefix_causal_attention


class Attention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim, self.scale = num_heads, num_kv_heads, head_dim, scale
        # Bound by the model runner: [num_blocks, block_size, num_kv_heads, head_dim]
        self.k_cache = self.v_cache = torch.tensor([])

    def store_kv(self, k: torch.Tensor, v: torch.Tensor) -> None:
        slots = get_context().slot_mapping
        self.k_cache.view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, slots, k.to(self.k_cache.dtype))
        self.v_cache.view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, slots, v.to(self.v_cache.dtype))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] for the step's new tokens -> [T, Hq, D]."""
        ctx = get_context()
        self.store_kv(k, v)
        kc, vc = self.k_cache, self.v_cache
        if ctx.is_decode:
            return paged_attention_decode(q, kc, vc, ctx.block_tables, ctx.seq_lens, self.scale)
        out, start = [], 0
        for b, (qlen, cached) in enumerate(zip(ctx.query_lens, ctx.context_lens)):
            qb = q[start:start + qlen]
            if cached == 0:  # fresh prompt: its K/V are exactly this step's rows
                kb, vb = k[start:start + qlen], v[start:start + qlen]
            else:
                kb, vb = gather_kv(kc, vc, ctx.block_tables[b], cached + qlen)
            out.append(prefix_causal_attention(qb, kb.to(q.dtype), vb.to(q.dtype), self.scale))
            start += qlen
        return torch.cat(out)

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
        if ctx.is_decode:
            return self.decode(q, ctx.block_tables, ctx.seq_lens, ctx.sparse, ctx.graph, ctx.max_seq_len)
        # Mixed step: one-token rows of running sequences take the decode path as a sub-batch (so
        # continuous batching never turns a long decode into a full prefill-style gather), prompt
        # chunks attend over their cached prefix. Draft rows under verification are decode rows too,
        # each with its own length (causal), so sparse layers select per position.
        out = torch.empty_like(q)
        if ctx.decode_rows is not None:
            sub = ctx.decode_seqs
            lens = ctx.decode_lens if ctx.decode_lens is not None else ctx.seq_lens[sub]
            out[ctx.decode_rows] = self.decode(q[ctx.decode_rows], ctx.block_tables[sub], lens,
                                               ctx.decode_max_len > self.dense_threshold, False, ctx.decode_max_len)
        end = 0
        for b, (n, cached) in enumerate(zip(ctx.query_lens, ctx.context_lens)):
            start, end = end, end + n
            if ctx.decodes(b):  # decoded above
                continue
            out[start:end] = self.prefill(q[start:end], k[start:end], v[start:end], ctx.block_tables[b], cached,
                                          slice(start, end))
        return out

    def prefill(self, q, k, v, block_table, cached: int, rows: slice) -> torch.Tensor:
        """One prompt chunk (rows `rows` of the step) over its cached prefix and itself, causal."""
        if cached == 0:  # fresh prompt: its K/V are exactly this step's rows
            kb, vb = k, v
        else:
            kb, vb = self.context_kv(block_table, cached, k, v)
        return prefix_causal_attention(q, kb.to(q.dtype), vb.to(q.dtype), self.scale, self.prefill_backend)

    prefill_backend = "cudnn"  # EngineConfig.prefill_attention, set by the model runner

    def context_kv(self, block_table, cached: int, k, v) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of a prompt chunk's whole context (cached prefix + the chunk's k, v): [cached + n, Hkv, D]."""
        return gather_kv(self.k_cache, self.v_cache, block_table, cached + k.shape[0])

    dense_threshold = float("inf")  # the sparse layer sets its own

    def decode(self, q, block_tables, seq_lens, sparse: bool, graph: bool, max_seq_len: int) -> torch.Tensor:
        """One query per sequence over its whole cached context (dense)."""
        return paged_attention_decode(q, self.k_cache, self.v_cache, block_tables, seq_lens, self.scale)

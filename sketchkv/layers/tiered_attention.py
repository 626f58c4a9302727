"""Sparse decode over the host tier: the same interface as `Attention`, with the K/V in host RAM.

What the layer keeps on the GPU is the int4 key sketch (paged like before); K/V rows go to the
host tier (sketchkv.kv.host_tier): every forward writes its new rows there (quantised on the
device, written asynchronously into pinned memory) and into the sequence's sinks / recent ring.

Decode (every step, any context length: with k >= context the picks are every token, so this is
also the dense path): select (sketch scores + top-k, as SparseAttention) -> tier.gather (sinks and
tail from the resident rows, picks from the hot buffer or, on a miss, straight from pinned host
memory) into a compact K/V scratch -> the paged decode kernel over that scratch -> admit the misses
to the hot buffer. Fixed shapes and no host sync: CUDA-graph capturable.

Prefill: chunks of a sequence with cached tokens attend over the prefix read back from the tier.
"""
import torch

from sketchkv.engine.context import get_context
from sketchkv.kv.host_tier import ATTN_BLOCK
from sketchkv.layers.sparse_attention import SparseAttention
from sketchkv.ops.paged_attention import paged_attention_decode


class TieredAttention(SparseAttention):
    def __init__(self, sparse: SparseAttention, layer: int):
        super().__init__(sparse, sparse.cfg, sparse.basis, sparse.mean, sparse.dense_threshold)
        self.layer = layer   # index among the tier's layers
        self.tier = None     # HostTier, bound by the model runner (k_cache / v_cache stay empty)

    def store_kv(self, k: torch.Tensor, v: torch.Tensor) -> None:
        ctx = get_context()
        self.tier.write(self.layer, ctx.slot_mapping, ctx.resident_rows, k, v)

    def context_kv(self, block_table, cached: int, k, v):
        kp, vp = self.tier.read_prefix(self.layer, block_table, cached, k.dtype)
        return torch.cat([kp, k]), torch.cat([vp, v])

    def decode(self, q, block_tables, seq_lens, sparse: bool, graph: bool, max_seq_len: int) -> torch.Tensor:
        ctx = get_context()
        sub = None if ctx.is_decode else ctx.decode_seqs  # mixed step: the decode rows' sequences
        state_slots = ctx.state_slots if sub is None else ctx.state_slots[sub]
        pids = ctx.hot_pids if sub is None else ctx.hot_pids[sub]
        max_len = block_tables.shape[1] * self.tier.block_size if graph else max_seq_len
        idx, counts = self.select(q, block_tables, seq_lens, max_len)
        self.last_indices = (idx, counts)
        k, v, miss = self.tier.gather(self.layer, idx[:, 0], counts, block_tables, seq_lens, state_slots)
        B, Np = miss.shape
        nb = Np // ATTN_BLOCK
        tables = (torch.arange(B, device=q.device, dtype=torch.int32)[:, None] * nb
                  + torch.arange(nb, device=q.device, dtype=torch.int32)[None])
        out = paged_attention_decode(q, k.view(B * nb, ATTN_BLOCK, self.num_kv_heads, self.head_dim),
                                     v.view(B * nb, ATTN_BLOCK, self.num_kv_heads, self.head_dim),
                                     tables, counts, self.scale)
        self.tier.hot.admit(self.layer, pids, miss, k, v, max_cap=self.tier.max_part_rows if graph else None)
        return out

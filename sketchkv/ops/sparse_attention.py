"""Exact attention over a selected set of cached tokens (sparse decode).

indices [B, Hsel, N] int32: token positions, ascending, padded at the end; only the first
counts[b] entries of each row are read (every head of a sequence selects the same number of
tokens: the masked positions do not depend on the head). Hsel = 1 when all KV heads share one
pick, else Hkv. The Triton
path is the paged flash-decoding kernel in its indexed mode: each tile's rows come from the index
list instead of a contiguous range, so the dense and sparse paths share one kernel.
"""
import os

import torch

from sketchkv.ops import paged_attention as pa


def sparse_attention_ref(q, k_cache, v_cache, block_tables, indices, counts, scale):
    """q [B, Hq, D] -> [B, Hq, D]; fp32 math."""
    B, Hq, D = q.shape
    bs, Hkv = k_cache.shape[1], k_cache.shape[2]
    G = Hq // Hkv
    out = torch.zeros_like(q)
    for b in range(B):
        for h in range(Hkv):
            hs = h if indices.shape[1] > 1 else 0
            pos = indices[b, hs, : int(counts[b])].long()
            if pos.numel() == 0:
                continue
            blk = block_tables[b].long()[pos // bs]
            k = k_cache[blk, pos % bs, h].float()
            v = v_cache[blk, pos % bs, h].float()
            qh = q[b, h * G:(h + 1) * G].float()
            p = torch.softmax(qh @ k.T * scale, dim=-1)
            out[b, h * G:(h + 1) * G] = (p @ v).to(q.dtype)
    return out


def sparse_attention(q, k_cache, v_cache, block_tables, indices, counts, scale, row_groups=None):
    """row_groups: see paged_attention_decode_triton (block_tables and indices then have a row per group)."""
    if pa.triton is not None and (q.is_cuda or (pa._INTERPRETED and os.environ.get("TRITON_INTERPRET") == "1")):
        return pa.paged_attention_decode_triton(q, k_cache, v_cache, block_tables, counts, scale, indices=indices,
                                                row_groups=row_groups)
    if row_groups is not None:
        block_tables, indices = (pa.expand_row_groups(x, row_groups) for x in (block_tables, indices))
    return sparse_attention_ref(q, k_cache, v_cache, block_tables, indices, counts, scale)

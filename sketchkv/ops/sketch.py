"""Key sketches: int4 quantisation of basis-projected keys, and scoring every cached token
through them. PyTorch reference + Triton kernel + one dispatch.

Sketch layout, paged like the KV cache so prefix blocks can be shared:
  sketch [num_blocks, block_size, Hkv, r // 2] uint8 — two signed int4 values per byte
         (low nibble = even dim, high nibble = odd dim, stored as v + 8, v in [-7, 7])
  scale  [num_blocks, block_size, Hkv] float16 — per token and head: max|x| / 7
Scores: s[b, h, t] = sum over the query heads g of KV head h of (P_h^T q_g) . dequant(sketch[t, h]),
which is linear in q, so callers pass the group sum qs[b, h] = sum_g P_h^T q_g ([B, Hkv, r]). Summed
over KV heads too when the selection is shared (output head dim 1); -inf outside
[sinks, seq_len - recent), the rows that are always attended anyway.
"""
import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None


def quantize_int4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., r] -> (packed uint8 [..., r // 2], scale fp16 [...])."""
    scale = x.abs().amax(-1).float().clamp_min(1e-8) / 7.0
    v = torch.round(x.float() / scale[..., None]).clamp_(-7, 7).to(torch.int16) + 8
    packed = (v[..., 0::2] | (v[..., 1::2] << 4)).to(torch.uint8)
    return packed, scale.to(torch.float16)


def dequantize_int4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    lo = (packed & 0xF).to(torch.int16) - 8
    hi = (packed >> 4).to(torch.int16) - 8
    v = torch.stack([lo, hi], dim=-1).flatten(-2).float()
    return v * scale.float()[..., None]


def sketch_score_ref(qp, sketch, scale, block_tables, seq_lens, sinks: int, recent: int, max_len: int,
                     shared: bool = True) -> torch.Tensor:
    """qp [B, Hkv, r] group-summed projected queries -> scores [B, 1 or Hkv, max_len] fp32."""
    B, Hkv, r = qp.shape
    bs = sketch.shape[1]
    out = torch.full((B, 1 if shared else Hkv, max_len), float("-inf"), device=qp.device)
    for b, n in enumerate(seq_lens.tolist()):
        lo, hi = sinks, n - recent
        if hi <= lo:
            continue
        blocks = block_tables[b, : (n + bs - 1) // bs].long()
        s = dequantize_int4(sketch[blocks].flatten(0, 1)[:n], scale[blocks].flatten(0, 1)[:n])  # [n, Hkv, r]
        per_head = torch.einsum("hr,thr->ht", qp[b].float(), s)
        sc = per_head.sum(0, keepdim=True) if shared else per_head
        out[b, :, lo:hi] = sc[:, lo:hi]
    return out


if triton is not None:

    @triton.jit
    def _sketch_score_kernel(qp_ptr, sk_ptr, sc_ptr, bt_ptr, lens_ptr, out_ptr,
                             sinks, recent, max_len, num_blocks,
                             stride_qb, stride_qh, stride_skb, stride_scb, stride_btb, stride_ob, stride_oh,
                             HKV: tl.constexpr, R: tl.constexpr, BS: tl.constexpr, BPP: tl.constexpr,
                             SHARED: tl.constexpr):
        # One program per (sequence, BPP consecutive KV blocks). A block's sketch rows for all heads
        # are one contiguous [BS, HKV * R/2] byte tile, loaded whole (coalesced), and the score is a
        # dot over the flattened (head, dim) axis, scaled per (token, head).
        b = tl.program_id(0)
        n = tl.load(lens_ptr + b)
        C: tl.constexpr = HKV * (R // 2)
        c = tl.arange(0, C)
        qbase = qp_ptr + b * stride_qb + (c // (R // 2)) * stride_qh + 2 * (c % (R // 2))
        qe = tl.load(qbase).to(tl.float32)          # even dims of every head, flattened [C]
        qo = tl.load(qbase + 1).to(tl.float32)      # odd dims
        rows = tl.arange(0, BS)
        heads = tl.arange(0, HKV)
        for i in tl.static_range(BPP):
            j = tl.program_id(1) * BPP + i
            t = j * BS + rows
            valid = (t >= sinks) & (t < n - recent)
            live = (j * BS < n) & (j < num_blocks)
            blk = tl.load(bt_ptr + b * stride_btb + j, mask=live, other=0).to(tl.int64)
            packed = tl.load(sk_ptr + blk * stride_skb + rows[:, None] * C + c[None, :],
                             mask=live & valid[:, None], other=0).to(tl.int32)
            prod = ((packed & 15) - 8).to(tl.float32) * qe[None, :] + ((packed >> 4) - 8).to(tl.float32) * qo[None, :]
            per_head = tl.sum(tl.reshape(prod, (BS, HKV, R // 2)), axis=2)          # [BS, HKV]
            scale = tl.load(sc_ptr + blk * stride_scb + rows[:, None] * HKV + heads[None, :],
                            mask=live & valid[:, None], other=0.0).to(tl.float32)
            per_head = per_head * scale
            if SHARED:
                score = tl.where(valid & live, tl.sum(per_head, axis=1), float("-inf"))
                tl.store(out_ptr + b * stride_ob + t, score, mask=t < max_len)
            else:
                score = tl.where((valid & live)[:, None], per_head, float("-inf"))
                tl.store(out_ptr + b * stride_ob + heads[None, :] * stride_oh + t[:, None], score,
                         mask=(t < max_len)[:, None])


def sketch_score_triton(qp, sketch, scale, block_tables, seq_lens, sinks: int, recent: int, max_len: int,
                        shared: bool = True) -> torch.Tensor:
    B, Hkv, r = qp.shape
    bs = sketch.shape[1]
    # each block's rows must be one contiguous [bs, Hkv * r/2] tile (how the runner allocates them)
    assert sketch.stride(1) == Hkv * (r // 2) and sketch.stride(2) == r // 2 and sketch.stride(3) == 1
    assert scale.stride(1) == Hkv and scale.stride(2) == 1
    qp = qp.contiguous()
    out = torch.empty(B, 1 if shared else Hkv, max_len, dtype=torch.float32, device=qp.device)
    nblk = triton.cdiv(max_len, bs)
    bpp = 4  # blocks per program: more bytes in flight per program
    _sketch_score_kernel[(B, triton.cdiv(nblk, bpp))](
        qp, sketch, scale, block_tables, seq_lens, out, sinks, recent, max_len, min(nblk, block_tables.shape[1]),
        qp.stride(0), qp.stride(1), sketch.stride(0), scale.stride(0), block_tables.stride(0),
        out.stride(0), out.stride(1), HKV=Hkv, R=r, BS=bs, BPP=bpp, SHARED=shared)
    return out


def sketch_score(qp, sketch, scale, block_tables, seq_lens, sinks: int, recent: int, max_len: int,
                 shared: bool = True) -> torch.Tensor:
    if triton is not None and (qp.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"):
        return sketch_score_triton(qp, sketch, scale, block_tables, seq_lens, sinks, recent, max_len, shared)
    return sketch_score_ref(qp, sketch, scale, block_tables, seq_lens, sinks, recent, max_len, shared)

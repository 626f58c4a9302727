"""Key sketches: int4 quantisation of basis-projected keys, and scoring every cached token
through them. PyTorch reference + Triton kernel + one dispatch.

Sketch layout, paged like the KV cache so prefix blocks can be shared:
  sketch [num_blocks, block_size, Hkv, r // 2] uint8 — two signed int4 values per byte
         (low nibble = even dim, high nibble = odd dim, stored as v + 8, v in [-7, 7])
  scale  [num_blocks, block_size, Hkv] float16 — per token and head: max|x| / 7
Per query head g of KV head h: s_g[b, t] = (P_h^T q_g) . dequant(sketch[t, h]) (P_h: the key basis).
The G heads of a group (and the KV heads when the selection is shared, output head dim 1) combine by
`combine`: "sum" (linear in q, so callers may pass the group sum [B, Hkv, r] and pay one dot per KV
head), "max", or "softmax" (sum of per-head softmax probabilities: ranks by estimated attention mass).
-inf outside [sinks, seq_len - recent), the rows that are always attended anyway.
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


COMBINES = ("sum", "max", "softmax")


def softmax_combine(s: torch.Tensor, num_kv_heads: int, shared: bool, sm_scale: float) -> torch.Tensor:
    """Per-query-head scores s [B, Hq, T] (-inf = masked) -> log of the summed estimated attention
    probabilities, [B, 1 or Hkv, T]: each head's scores go through its own softmax over the candidates
    (temperature `sm_scale`, the attention scale), then add up over the heads of a KV group (and over
    the KV heads when shared). Ranks tokens by estimated attention mass, so a head with one sharp
    target is not drowned by another head's broad, large raw scores. Masked positions stay -inf."""
    B, Hq, T = s.shape
    s = s.float() * sm_scale
    lse = torch.logsumexp(s, -1, keepdim=True)
    logp = s - torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    logp = logp.view(B, num_kv_heads, Hq // num_kv_heads, T)
    return torch.logsumexp(logp.flatten(1, 2), 1, keepdim=True) if shared else torch.logsumexp(logp, 2)


def _as_groups(qp: torch.Tensor) -> torch.Tensor:
    return qp.unsqueeze(2) if qp.dim() == 3 else qp


def sketch_score_ref(qp, sketch, scale, block_tables, seq_lens, sinks: int, recent: int, max_len: int,
                     shared: bool = True, combine: str = "sum", sm_scale: float = 1.0) -> torch.Tensor:
    """qp [B, Hkv, G, r] projected query heads ([B, Hkv, r]: G = 1, e.g. the group sum) -> scores
    [B, 1 or Hkv, max_len] fp32, combining the G heads of a KV group (and the KV heads when shared) by
    `combine`: sum of scores, max of scores, or softmax (see softmax_combine)."""
    qp = _as_groups(qp)
    B, Hkv, G, r = qp.shape
    bs = sketch.shape[1]
    per_q = torch.full((B, Hkv, G, max_len), float("-inf"), device=qp.device)
    for b, n in enumerate(seq_lens.tolist()):
        lo, hi = sinks, n - recent
        if hi <= lo:
            continue
        blocks = block_tables[b, : (n + bs - 1) // bs].long()
        s = dequantize_int4(sketch[blocks].flatten(0, 1)[:n], scale[blocks].flatten(0, 1)[:n])  # [n, Hkv, r]
        per_q[b, :, :, lo:hi] = torch.einsum("hgr,thr->hgt", qp[b].float(), s)[:, :, lo:hi]
    if combine == "softmax":
        return softmax_combine(per_q.flatten(1, 2), Hkv, shared, sm_scale)
    if combine == "sum":
        per_head = per_q.sum(2)
        return per_head.sum(1, keepdim=True) if shared else per_head
    if combine == "max":
        per_head = per_q.amax(2)
        return per_head.amax(1, keepdim=True) if shared else per_head
    raise ValueError(f"combine must be one of {COMBINES}, got {combine!r}")


if triton is not None:

    @triton.jit
    def _sketch_score_kernel(qp_ptr, sk_ptr, sc_ptr, bt_ptr, lens_ptr, out_ptr,
                             sinks, recent, max_len, num_blocks,
                             stride_qb, stride_qh, stride_qg, stride_skb, stride_scb, stride_btb, stride_ob,
                             stride_oh, HKV: tl.constexpr, R: tl.constexpr, BS: tl.constexpr, BPP: tl.constexpr,
                             G: tl.constexpr, MODE: tl.constexpr, SHARED: tl.constexpr):
        # One program per (sequence, BPP consecutive KV blocks). A block's sketch rows for all heads
        # are one contiguous [BS, HKV * R/2] byte tile, loaded whole (coalesced) and read once for all
        # G query heads of each KV head; a score is a dot over the flattened (head, dim) axis, scaled
        # per (token, head). MODE 0: sum over the G heads, 1: max, 2: every query head stored
        # (out row h * G + g; SHARED ignored).
        b = tl.program_id(0)
        n = tl.load(lens_ptr + b)
        C: tl.constexpr = HKV * (R // 2)
        c = tl.arange(0, C)
        qbase = qp_ptr + b * stride_qb + (c // (R // 2)) * stride_qh + 2 * (c % (R // 2))
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
            lo = ((packed & 15) - 8).to(tl.float32)
            hi = ((packed >> 4) - 8).to(tl.float32)
            scale = tl.load(sc_ptr + blk * stride_scb + rows[:, None] * HKV + heads[None, :],
                            mask=live & valid[:, None], other=0.0).to(tl.float32)
            acc = tl.full((BS, HKV), float("-inf") if MODE == 1 else 0.0, tl.float32)
            for g in tl.static_range(G):
                qe = tl.load(qbase + g * stride_qg).to(tl.float32)      # even dims of every head [C]
                qo = tl.load(qbase + g * stride_qg + 1).to(tl.float32)  # odd dims
                per_head = tl.sum(tl.reshape(lo * qe[None, :] + hi * qo[None, :], (BS, HKV, R // 2)), axis=2)
                per_head = per_head * scale                                       # [BS, HKV]
                if MODE == 2:
                    score = tl.where((valid & live)[:, None], per_head, float("-inf"))
                    tl.store(out_ptr + b * stride_ob + (heads[None, :] * G + g) * stride_oh + t[:, None], score,
                             mask=(t < max_len)[:, None])
                elif MODE == 0:
                    acc = acc + per_head
                else:
                    acc = tl.maximum(acc, per_head)
            if MODE != 2:
                if SHARED:
                    comb = tl.sum(acc, axis=1) if MODE == 0 else tl.max(acc, axis=1)
                    score = tl.where(valid & live, comb, float("-inf"))
                    tl.store(out_ptr + b * stride_ob + t, score, mask=t < max_len)
                else:
                    score = tl.where((valid & live)[:, None], acc, float("-inf"))
                    tl.store(out_ptr + b * stride_ob + heads[None, :] * stride_oh + t[:, None], score,
                             mask=(t < max_len)[:, None])


def sketch_score_triton(qp, sketch, scale, block_tables, seq_lens, sinks: int, recent: int, max_len: int,
                        shared: bool = True, combine: str = "sum", sm_scale: float = 1.0) -> torch.Tensor:
    qp = _as_groups(qp).contiguous()
    B, Hkv, G, r = qp.shape
    bs = sketch.shape[1]
    # each block's rows must be one contiguous [bs, Hkv * r/2] tile (how the runner allocates them)
    assert sketch.stride(1) == Hkv * (r // 2) and sketch.stride(2) == r // 2 and sketch.stride(3) == 1
    assert scale.stride(1) == Hkv and scale.stride(2) == 1
    mode = COMBINES.index(combine)
    rows = Hkv * G if mode == 2 else (1 if shared else Hkv)
    out = torch.empty(B, rows, max_len, dtype=torch.float32, device=qp.device)
    nblk = triton.cdiv(max_len, bs)
    bpp = 4  # blocks per program: more bytes in flight per program
    _sketch_score_kernel[(B, triton.cdiv(nblk, bpp))](
        qp, sketch, scale, block_tables, seq_lens, out, sinks, recent, max_len, min(nblk, block_tables.shape[1]),
        qp.stride(0), qp.stride(1), qp.stride(2), sketch.stride(0), scale.stride(0), block_tables.stride(0),
        out.stride(0), out.stride(1), HKV=Hkv, R=r, BS=bs, BPP=bpp, G=G, MODE=mode, SHARED=shared)
    return softmax_combine(out, Hkv, shared, sm_scale) if mode == 2 else out


def sketch_score(qp, sketch, scale, block_tables, seq_lens, sinks: int, recent: int, max_len: int,
                 shared: bool = True, combine: str = "sum", sm_scale: float = 1.0) -> torch.Tensor:
    if combine not in COMBINES:
        raise ValueError(f"combine must be one of {COMBINES}, got {combine!r}")
    if triton is not None and (qp.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"):
        return sketch_score_triton(qp, sketch, scale, block_tables, seq_lens, sinks, recent, max_len, shared,
                                   combine, sm_scale)
    return sketch_score_ref(qp, sketch, scale, block_tables, seq_lens, sinks, recent, max_len, shared, combine,
                            sm_scale)

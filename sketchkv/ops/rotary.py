"""Rotary embedding applied in one kernel (neox layout: rotate halves; partial rotary: the first
`rotary_dim` dims of each head turn, the rest pass through).

Unfused, applying RoPE to q and k is ~14 small kernels per attention layer and step. The kernel takes
the cos / sin rows that torch computed (fp32 [T, rotary_dim], once per forward for all layers, see
layers/rotary.py: torch's cos/sin, not Triton's approximations, which lose accuracy at the angles of
250K-token positions) and rounds where transformers rounds: cos and sin cast to the activation dtype
first, then (x * cos) and (rotate(x) * sin) each rounded to it, then their sum.
"""
import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None


def apply_rotary_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rd: int) -> torch.Tensor:
    """x [T, H, D], cos / sin [T, rd] fp32 -> x with the first rd dims of each head rotated."""
    cos, sin = cos[:, None].to(x.dtype), sin[:, None].to(x.dtype)
    x_rot, x_pass = x[..., :rd], x[..., rd:]
    x1, x2 = x_rot[..., : rd // 2], x_rot[..., rd // 2:]
    out = x_rot * cos + torch.cat((-x2, x1), dim=-1) * sin
    return torch.cat((out, x_pass), dim=-1) if rd < x.shape[-1] else out


if triton is not None:

    @triton.jit
    def _round(x, dt: tl.constexpr):
        """fp32 x rounded to dt (nearest, ties to even), kept in fp32. For bf16 by integer arithmetic: the
        compiler folds a cast to bf16 and back, which left 1-ulp differences from torch (H200 run 39)."""
        if dt == tl.bfloat16:
            u = x.to(tl.uint32, bitcast=True)
            return ((u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
        return x.to(dt).to(tl.float32)

    @triton.jit
    def _rotate_row(x_ptr, o_ptr, c, s, j, partner, turn, in_row, RD: tl.constexpr):
        x = tl.load(x_ptr + j, mask=in_row, other=0.0)
        dt: tl.constexpr = x.dtype
        p = tl.load(x_ptr + partner, mask=turn, other=0.0).to(tl.float32)
        p = tl.where(j < RD // 2, -p, p)                                     # cat(-x2, x1), exact
        a = _round(x.to(tl.float32) * c, dt)
        b = _round(p * s, dt)
        tl.store(o_ptr + j, tl.where(turn, _round(a + b, dt).to(dt), x), mask=in_row)   # exact: already rounded

    @triton.jit
    def _rotary_kernel(q_ptr, k_ptr, qo_ptr, ko_ptr, cos_ptr, sin_ptr, stride_qt, stride_qh, stride_kt, stride_kh,
                       stride_c, HQ, D, RD: tl.constexpr, BLOCK: tl.constexpr):
        # one program per (token, head of q then of k): one head vector, rotated into a new contiguous row
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        HK = tl.num_programs(1) - HQ
        j = tl.arange(0, BLOCK)
        in_row = j < D
        turn = j < RD
        partner = tl.where(j < RD // 2, j + RD // 2, j - RD // 2)
        dt: tl.constexpr = qo_ptr.dtype.element_ty
        c = _round(tl.load(cos_ptr + t * stride_c + j, mask=turn, other=0.0), dt)
        s = _round(tl.load(sin_ptr + t * stride_c + j, mask=turn, other=0.0), dt)
        if h < HQ:
            _rotate_row(q_ptr + t * stride_qt + h * stride_qh, qo_ptr + (t * HQ + h) * D, c, s, j, partner, turn,
                        in_row, RD)
        else:
            _rotate_row(k_ptr + t * stride_kt + (h - HQ) * stride_kh, ko_ptr + (t * HK + h - HQ) * D, c, s, j,
                        partner, turn, in_row, RD)


def apply_rotary_triton(q, k, cos, sin, rd: int):
    T, HQ, D = q.shape
    assert q.stride(-1) == 1 and cos.stride(-1) == 1 and sin.stride() == cos.stride() and rd % 2 == 0
    qo = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if k is None:
        k, ko, HK = q, qo, 0
    else:
        assert k.stride(-1) == 1 and k.dtype == q.dtype
        ko, HK = torch.empty(k.shape, dtype=k.dtype, device=k.device), k.shape[1]
    if T:
        _rotary_kernel[(T, HQ + HK)](q, k, qo, ko, cos, sin, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
                                     cos.stride(0), HQ, D, RD=rd, BLOCK=triton.next_power_of_2(D), num_warps=1)
    return qo, (ko if HK else None)


def apply_rotary(q, k, cos, sin, rd: int):
    """q [T, Hq, D] and k [T, Hk, D] (or None) rotated by cos / sin [T, rd] (fp32) -> (q', k'), new tensors.
    Triton on CUDA and under TRITON_INTERPRET=1 (one launch for both), the reference otherwise."""
    if triton is not None and (q.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"):
        return apply_rotary_triton(q, k, cos, sin, rd)
    return apply_rotary_ref(q, cos, sin, rd), (apply_rotary_ref(k, cos, sin, rd) if k is not None else None)

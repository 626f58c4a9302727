"""RMSNorm in one kernel: the decode step runs ~300 of them, and unfused each is ~7 small kernels.

Three variants, each rounding exactly where transformers' implementation rounds:
  zero-centred (Qwen3-Next/3.5):  (norm(x) * (1 + w)).to(dtype)            -- one rounding
  plain (Llama/Qwen3):            w * norm(x).to(dtype)                     -- norm rounded, then product
  gated (Gated DeltaNet output):  (w * norm(x).to(dtype)) * silu(gate)      -- plus the gate, in fp32
"""
import os

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

ZERO_CENTERED, PLAIN, GATED = 0, 1, 2


def rms_norm_ref(x, weight, eps: float, kind: int, gate=None):
    dtype = x.dtype
    n = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    if kind == ZERO_CENTERED:
        return (n * (1.0 + weight.float())).to(dtype)
    y = weight * n.to(dtype)
    if kind == PLAIN:
        return y
    return (y * F.silu(gate.float())).to(dtype)


if triton is not None:

    @triton.jit
    def _rms_norm_kernel(x_ptr, w_ptr, g_ptr, out_ptr, N, eps, stride_x, stride_g, stride_o,
                         KIND: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        mask = offs < N
        x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        n = x * tl.rsqrt(tl.sum(x * x, 0) / N + eps)
        odt = out_ptr.dtype.element_ty
        if KIND == 0:
            y = n * (1.0 + w)
        else:
            y = (w * n.to(odt).to(tl.float32)).to(odt).to(tl.float32)  # rounds like w * norm(x).to(dtype)
            if KIND == 2:
                g = tl.load(g_ptr + row * stride_g + offs, mask=mask, other=0.0).to(tl.float32)
                y = y * (g * tl.sigmoid(g))
        tl.store(out_ptr + row * stride_o + offs, y.to(odt), mask=mask)


def rms_norm(x, weight, eps: float, kind: int, gate=None):
    """Normalise over the last dim. Triton on CUDA or under TRITON_INTERPRET=1, reference otherwise."""
    if triton is None or not (x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"):
        return rms_norm_ref(x, weight, eps, kind, gate)
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    g2 = gate.reshape(-1, shape[-1]) if gate is not None else x2
    if g2.stride(-1) != 1:
        g2 = g2.contiguous()
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    N = shape[-1]
    _rms_norm_kernel[(x2.shape[0],)](x2, weight, g2, out, N, eps, x2.stride(0), g2.stride(0), out.stride(0),
                                     KIND=kind, BLOCK=triton.next_power_of_2(N), num_warps=4 if N <= 2048 else 8)
    return out.view(shape)

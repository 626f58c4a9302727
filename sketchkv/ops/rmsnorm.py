"""RMSNorm in one kernel: the decode step runs ~300 of them, and unfused each is ~7 small kernels.

Three variants, each rounding exactly where transformers' implementation rounds:
  zero-centred (Qwen3-Next/3.5):  (norm(x) * (1 + w)).to(dtype)            -- one rounding
  plain (Llama/Qwen3):            w * norm(x).to(dtype)                     -- norm rounded, then product
  gated (Gated DeltaNet output):  (w * norm(x).to(dtype)) * silu(gate)      -- plus the gate, in fp32
With `residual` (zero-centred and plain), the decoder layer's residual add goes in the same kernel, as
vLLM's fused_add_rms_norm: s = (x + residual).to(dtype), then the norm of s; returns (norm, s). The sum is
rounded to the model dtype before the norm reads it, exactly as `x = x + h; norm(x)` (128 fewer kernels
per 27B decode step).
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


def rms_norm_ref(x, weight, eps: float, kind: int, gate=None, residual=None):
    if residual is not None:
        s = x + residual
        return rms_norm_ref(s, weight, eps, kind, gate), s
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
    def _rms_norm_kernel(x_ptr, w_ptr, g_ptr, out_ptr, r_ptr, s_ptr, N, eps, stride_x, stride_xh, XH, stride_g,
                         stride_gh, GH, stride_o, stride_r, stride_s, KIND: tl.constexpr, RESIDUAL: tl.constexpr,
                         BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        mask = offs < N
        odt = out_ptr.dtype.element_ty
        x_row = x_ptr + (row // XH) * stride_x + (row % XH) * stride_xh   # row (t, h) of x, see _head_rows
        x = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
        if RESIDUAL:  # s = x + residual rounded to the model dtype (as torch's add), stored, then normed
            x = (x + tl.load(r_ptr + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)).to(odt)
            tl.store(s_ptr + row * stride_s + offs, x, mask=mask)
            x = x.to(tl.float32)
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        n = x * tl.rsqrt(tl.sum(x * x, 0) / N + eps)
        if KIND == 0:
            y = n * (1.0 + w)
        else:
            y = (w * n.to(odt).to(tl.float32)).to(odt).to(tl.float32)  # rounds like w * norm(x).to(dtype)
            if KIND == 2:
                g_row = g_ptr + (row // GH) * stride_g + (row % GH) * stride_gh   # gate row (t, h), see _head_rows
                g = tl.load(g_row + offs, mask=mask, other=0.0).to(tl.float32)
                y = y * (g * tl.sigmoid(g))
        tl.store(out_ptr + row * stride_o + offs, y.to(odt), mask=mask)


def _rows(t, N):
    t = t.reshape(-1, N)
    return t if t.stride(-1) == 1 else t.contiguous()


def _head_rows(t, N):
    """The rows of x or of the gate without a copy where one is avoidable -> (tensor, stride of t, stride of h, H):
    row r reads row (t, h) = divmod(r, H). A [T, H, N] view of a fused projection's output (rows of T padded by
    the other projections' columns: attention's q and k in the qkv output, the GDN output gate z) is not a
    [T * H, N] view: reshaping would copy it (a kernel per layer and step)."""
    if t.dim() >= 3 and t.stride(-1) == 1:
        g = t.flatten(0, -3)   # a view where the leading dims allow it
        return g, g.stride(0), g.stride(1), g.shape[1]
    g = _rows(t, N)
    return g, g.stride(0), 0, 1


def rms_norm(x, weight, eps: float, kind: int, gate=None, residual=None):
    """Normalise over the last dim (-> out; with residual: (out, x + residual)). Triton on CUDA or under
    TRITON_INTERPRET=1, reference otherwise."""
    if triton is None or not (x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"):
        return rms_norm_ref(x, weight, eps, kind, gate, residual)
    assert residual is None or kind != GATED
    shape, N = x.shape, x.shape[-1]
    x2, stride_x, stride_xh, xh = _head_rows(x, N)
    rows = x2.shape[0] * xh
    g2, stride_g, stride_gh, gh = _head_rows(gate, N) if gate is not None else (x2, 0, 0, 1)
    assert gate is None or g2.shape[0] * gh == rows, "the gate's rows are not x's"
    r2 = _rows(residual, N) if residual is not None else x2
    out = torch.empty(rows, N, dtype=x.dtype, device=x.device)
    s = torch.empty_like(out) if residual is not None else out
    _rms_norm_kernel[(rows,)](x2, weight, g2, out, r2, s, N, eps, stride_x, stride_xh, xh, stride_g, stride_gh, gh,
                              out.stride(0), r2.stride(0), s.stride(0), KIND=kind, RESIDUAL=residual is not None,
                              BLOCK=triton.next_power_of_2(N), num_warps=4 if N <= 2048 else 8)
    return out.view(shape) if residual is None else (out.view(shape), s.view(shape))

"""The MLP's silu(gate) * up in one kernel (vLLM's silu_and_mul), from the fused gate_up projection's
output [T, 2 * I] (gate first): unfused it is a silu and a mul per layer and step, plus their temporaries.
Rounds as torch does: silu(gate) in fp32, rounded to the model dtype, then the product, rounded."""
import os

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


if triton is not None:

    @triton.jit
    def _silu_and_mul_kernel(x_ptr, o_ptr, I, stride_x, stride_o, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = j < I
        g = tl.load(x_ptr + row * stride_x + j, mask=m, other=0.0)
        dt = g.dtype
        u = tl.load(x_ptr + row * stride_x + I + j, mask=m, other=0.0).to(tl.float32)
        g = g.to(tl.float32)
        s = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)     # torch's silu: x / (1 + exp(-x)) in fp32
        tl.store(o_ptr + row * stride_o + j, (s * u).to(dt), mask=m)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2 * I] -> silu(x[..., :I]) * x[..., I:], [..., I]. Triton on CUDA and under TRITON_INTERPRET=1."""
    if triton is None or not (x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"):
        return silu_and_mul_ref(x)
    shape, I = x.shape, x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * I)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape[0], I, dtype=x.dtype, device=x.device)
    BLOCK = 1024
    if x2.shape[0]:
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(I, BLOCK))](x2, out, I, x2.stride(0), out.stride(0),
                                                                  BLOCK=BLOCK, num_warps=4)
    return out.view(*shape[:-1], I)

"""Gated attention's output gate, o * sigmoid(gate), in one kernel (Qwen3.5 / Qwen3-Next full-attention layers:
the gate is the second half of each head's q projection, a strided view). Unfused it is a sigmoid and a mul per
layer and step (2 launches, ~4.4 us at batch 1 on an H200, run 70). Rounds as torch does: sigmoid in fp32,
rounded to the model dtype, then the product, rounded."""
import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None


def sigmoid_gate_ref(o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    return o * torch.sigmoid(gate)


if triton is not None:

    @triton.jit
    def _sigmoid_gate_kernel(o_ptr, g_ptr, out_ptr, H, stride_ot, stride_oh, stride_gt, stride_gh,
                             D: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        d = tl.arange(0, D)
        g = tl.load(g_ptr + t * stride_gt + h * stride_gh + d)
        dt = g.dtype
        o = tl.load(o_ptr + t * stride_ot + h * stride_oh + d).to(tl.float32)
        s = (1.0 / (1.0 + tl.exp(-g.to(tl.float32)))).to(dt).to(tl.float32)
        tl.store(out_ptr + (t * H + h) * D + d, (o * s).to(dt))


def sigmoid_gate(o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """o, gate [T, H, D] (head dims contiguous, any other strides; D a power of two) -> o * sigmoid(gate),
    [T, H, D] contiguous. Triton on CUDA and under TRITON_INTERPRET=1, the reference otherwise."""
    T, H, D = o.shape
    if (triton is None or not (o.is_cuda or os.environ.get("TRITON_INTERPRET") == "1") or D & (D - 1)
            or o.stride(2) != 1 or gate.stride(2) != 1 or gate.shape != o.shape or gate.dtype != o.dtype):
        return sigmoid_gate_ref(o, gate)
    out = torch.empty(T, H, D, dtype=o.dtype, device=o.device)
    if T:
        _sigmoid_gate_kernel[(T, H)](o, gate, out, H, o.stride(0), o.stride(1), gate.stride(0), gate.stride(1), D=D,
                                     num_warps=1 if D <= 128 else 2)
    return out

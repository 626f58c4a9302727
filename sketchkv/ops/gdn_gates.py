"""Gated DeltaNet gates in one kernel: beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias).

Unfused this is ~7 small kernels per GDN layer and decode step (48 layers in the 27B shape).
Outputs in fp32 for g (the decay lives in log space), input dtype for beta, as transformers does.
Plain decode does not launch this: the recurrence kernel computes the same gates from a, b itself, with
the same ops (gated_delta_rule_rows' `gates=`); prefill and speculative verification still call it.
"""
import os

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None


def gdn_gates_ref(a, b, A_log, dt_bias):
    beta = torch.sigmoid(b)
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    return g, beta


if triton is not None:

    @triton.jit
    def _gdn_gates_kernel(a_ptr, b_ptr, alog_ptr, dt_ptr, g_ptr, beta_ptr, H, stride_a, stride_b,
                          BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        h = tl.arange(0, BLOCK)
        m = h < H
        a = tl.load(a_ptr + row * stride_a + h, mask=m, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + row * stride_b + h, mask=m, other=0.0).to(tl.float32)
        x = a + tl.load(dt_ptr + h, mask=m, other=0.0).to(tl.float32)
        softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(x)))  # torch's threshold
        g = -tl.exp(tl.load(alog_ptr + h, mask=m, other=0.0).to(tl.float32)) * softplus
        tl.store(g_ptr + row * H + h, g, mask=m)
        tl.store(beta_ptr + row * H + h, tl.sigmoid(b).to(beta_ptr.dtype.element_ty), mask=m)


def gdn_gates(a, b, A_log, dt_bias):
    """a, b [T, H] -> (g [T, H] fp32, beta [T, H] in b.dtype)."""
    if triton is None or not (a.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"):
        return gdn_gates_ref(a, b, A_log, dt_bias)
    T, H = a.shape
    assert a.stride(-1) == 1 and b.stride(-1) == 1
    g = torch.empty(T, H, dtype=torch.float32, device=a.device)
    beta = torch.empty(T, H, dtype=b.dtype, device=a.device)
    _gdn_gates_kernel[(T,)](a, b, A_log, dt_bias, g, beta, H, a.stride(0), b.stride(0),
                            BLOCK=triton.next_power_of_2(H), num_warps=1)
    return g, beta

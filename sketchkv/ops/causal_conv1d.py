"""Depthwise causal conv1d + SiLU over the concatenated qkv channels of a Gated DeltaNet layer.

Token-major flat batch: x [T, D], sequence n is rows cu_seqlens[n]:cu_seqlens[n+1]; weight [D, W].
Per-slot state is fla's layout [D, W]: the last W inputs of the sequence, oldest first, zero-padded
on the left for sequences shorter than W. Only columns 1..W-1 feed the next output; column 0 is kept
because fla's kernels read and write W columns, so the GPU path needs no relayout (transformers'
Qwen3-Next cache also keeps W columns).

Fast path (CUDA): prefill through fla's varlen kernel (it indexes states by batch row, not by slot, so
we gather states[state_slots] in and scatter the result back). Decode and speculative verification through
our kernel over state slots (`causal_conv1d_rows`): T positions per sequence from strided input rows (the
fused in_proj's output as it is), the state read in place and optionally written after a chosen position;
it replaces fla's update kernel plus the copies, gathers and scatters around it (9 kernels per GDN layer of
a verification step at n = 7 became 1).
Reference (CPU): fp32 math, cast to x.dtype at the end, like fla's fp32 accumulation.
"""
import os

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None


def conv_state_shape(dim, width):
    return (dim, width)


def causal_conv1d_varlen_ref(x, weight, bias, states, state_slots, cu_seqlens):
    """x [T, D] -> y [T, D]; reads and writes states[state_slots[n]] ([D, W]) per sequence."""
    W = weight.shape[1]
    w = weight.float()
    y = torch.empty_like(x)
    bounds = cu_seqlens.tolist()
    for n, slot in enumerate(state_slots.tolist()):
        s, e = bounds[n], bounds[n + 1]
        xs = torch.cat([states[slot].T.float(), x[s:e].float()])  # [W + L, D]: state then new inputs
        win = xs.unfold(0, W, 1)[1:]                              # [L, D, W]: window ending at each token
        out = (win * w).sum(-1)
        if bias is not None:
            out = out + bias.float()
        y[s:e] = F.silu(out).to(x.dtype)
        states[slot] = xs[-W:].T.to(states.dtype)
    return y


def causal_conv1d_decode_ref(x, weight, bias, states, state_slots):
    """One token per sequence: x [N, D] -> y [N, D]; shifts x into states[state_slots] in place."""
    new = torch.cat([states[state_slots][..., 1:], x[..., None].to(states.dtype)], -1)  # [N, D, W]
    out = (new.float() * weight.float()).sum(-1)
    if bias is not None:
        out = out + bias.float()
    states[state_slots] = new
    return F.silu(out).to(x.dtype)


def causal_conv1d_varlen_fla(x, weight, bias, states, state_slots, cu_seqlens):
    from fla.modules.causal_conv1d import causal_conv1d
    y, final = causal_conv1d(x[None], weight, bias, initial_state=states[state_slots], output_final_state=True,
                             activation="silu", cu_seqlens=cu_seqlens)
    states[state_slots] = final.to(states.dtype)
    return y[0]


def causal_conv1d_rows_ref(x, weight, bias, states, slots, rows0, T: int, kept=None, write: bool = False):
    """See causal_conv1d_rows."""
    N = slots.shape[0]
    if rows0 is None:
        rows0 = torch.arange(N, device=x.device) * T
    work = states[slots].clone()
    local = torch.arange(N, device=x.device)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    last = kept if kept is not None else torch.full((N,), T - 1, device=x.device)
    keep = work.clone()
    for t in range(T):
        rows = rows0 + t
        live = t <= last if kept is not None else torch.ones(N, dtype=torch.bool, device=x.device)
        r = rows[live] if kept is not None else rows
        if r.numel():
            y[r] = causal_conv1d_decode_ref(x[r], weight, bias, work, local[live])
            hit = last == t
            keep[hit] = work[hit]
    if write:
        states[slots] = keep
    return y


if triton is not None:

    @triton.jit
    def _conv_rows_kernel(x_ptr, w_ptr, b_ptr, s_ptr, slots_ptr, rows0_ptr, kept_ptr, y_ptr, T, D, stride_x, stride_y,
                          W: tl.constexpr, WP: tl.constexpr, BD: tl.constexpr, HAS_BIAS: tl.constexpr,
                          WRITE: tl.constexpr, HAS_KEPT: tl.constexpr, STORE_Y: tl.constexpr,
                          HAS_ROWS0: tl.constexpr):
        # program (sequence n, BD channels): positions t = 0..T-1 are rows rows0[n] + t (no rows0: n * T + t).
        # The window of position t is inputs t-W+1 .. t: rows of x for i >= 0, columns W+i of the slot's state
        # (its last inputs) for i < 0.
        # WRITE: the state after position `last` (kept[n], or T - 1) replaces the slot's, after a barrier (every
        # read of the old state first; this program owns these channels of this slot).
        n = tl.program_id(0)
        od = tl.program_id(1) * BD + tl.arange(0, BD)
        md = od < D
        ow = tl.arange(0, WP)
        mw = ow < W
        slot = tl.load(slots_ptr + n).to(tl.int64)
        if HAS_ROWS0:
            row0 = tl.load(rows0_ptr + n).to(tl.int64)
        else:
            row0 = n.to(tl.int64) * T
        p_s = s_ptr + (slot * D + od[:, None]) * W
        w = tl.load(w_ptr + od[:, None] * W + ow[None, :], mask=md[:, None] & mw[None, :], other=0.0).to(tl.float32)
        if HAS_BIAS:
            bias = tl.load(b_ptr + od, mask=md, other=0.0).to(tl.float32)
        last = T - 1
        if HAS_KEPT:
            last = tl.load(kept_ptr + n)
        steps = T
        if not STORE_Y:
            steps = 0
        for t in range(0, steps):
            i = t - W + 1 + ow
            xs = tl.load(x_ptr + (row0 + i[None, :]) * stride_x + od[:, None], mask=md[:, None] & (mw & (i >= 0))[None, :],
                         other=0.0)
            ss = tl.load(p_s + (W + i)[None, :], mask=md[:, None] & (mw & (i < 0))[None, :], other=0.0)
            win = tl.where((i >= 0)[None, :], xs.to(tl.float32), ss.to(tl.float32))
            y = tl.sum(win * w, 1)
            if HAS_BIAS:
                y += bias
            y = y * tl.sigmoid(y)
            live = True
            if HAS_KEPT:
                live = t <= last
            tl.store(y_ptr + (row0 + t) * stride_y + od, y.to(y_ptr.dtype.element_ty), mask=md & live)
        if WRITE:
            i = last - W + 1 + ow
            xs = tl.load(x_ptr + (row0 + i[None, :]) * stride_x + od[:, None], mask=md[:, None] & (mw & (i >= 0))[None, :],
                         other=0.0)
            ss = tl.load(p_s + (W + i)[None, :], mask=md[:, None] & (mw & (i < 0))[None, :], other=0.0)
            new = tl.where((i >= 0)[None, :], xs.to(s_ptr.dtype.element_ty), ss)
            tl.debug_barrier()
            tl.store(p_s + ow[None, :], new, mask=md[:, None] & mw[None, :])


def causal_conv1d_rows(x, weight, bias, states, slots, rows0, T: int, kept=None, write: bool = False,
                       store_y: bool = True):
    """T positions of N sequences over their state slots, without touching other slots: sequence n's positions
    are rows rows0[n] + t (rows0 None: n * T + t) of x [R, D] (rows may be strided; channels contiguous) -> y [R, D]
    at the same rows (rows no sequence covers are left unset; None with store_y=False). write: the slot's state
    becomes the one after position kept[n] (None: T - 1), i.e. its last W inputs; with kept, outputs past it are not
    written.
    Decode (T = 1, write), verification (T = 1 + n, no write) and the commit's replay (write, kept, no y) run this
    one kernel, so their arithmetic is the same. CUDA-graph capturable."""
    if not (x.is_cuda or (triton is not None and os.environ.get("TRITON_INTERPRET") == "1")):
        y = causal_conv1d_rows_ref(x, weight, bias, states, slots, rows0, T, kept, write)
        return y if store_y else None
    R, D = x.shape
    W = weight.shape[1]
    assert x.stride(1) == 1 and weight.is_contiguous() and states.is_contiguous() and states.shape[1:] == (D, W)
    y = torch.empty(R, D, dtype=x.dtype, device=x.device) if store_y else x
    N = slots.shape[0]
    BD = 256
    if N:
        _conv_rows_kernel[(N, triton.cdiv(D, BD))](
            x, weight, bias if bias is not None else weight, states, slots, rows0 if rows0 is not None else slots,
            kept if kept is not None else slots, y, T, D, x.stride(0), y.stride(0), W=W, WP=triton.next_power_of_2(W),
            BD=BD, HAS_BIAS=bias is not None, WRITE=write, HAS_KEPT=kept is not None, STORE_Y=store_y,
            HAS_ROWS0=rows0 is not None, num_warps=4)
    return y if store_y else None


def causal_conv1d_varlen(x, weight, bias, states, state_slots, cu_seqlens):
    """x [T, D], weight [D, W], bias [D] or None, states [S, D, W], state_slots [N] int64,
    cu_seqlens [N+1] int32 -> silu(causal conv) [T, D] in x.dtype; final states written to the slots."""
    if x.is_cuda:
        return causal_conv1d_varlen_fla(x, weight, bias, states, state_slots, cu_seqlens)
    return causal_conv1d_varlen_ref(x, weight, bias, states, state_slots, cu_seqlens)


def causal_conv1d_decode(x, weight, bias, states, state_slots):
    """x [N, D] (rows may be strided), one token per sequence -> [N, D]; each slot's state advanced in place.
    CUDA-graph capturable."""
    if x.is_cuda:
        return causal_conv1d_rows(x, weight, bias, states, state_slots, None, 1, write=True)
    return causal_conv1d_decode_ref(x, weight, bias, states, state_slots)

"""Depthwise causal conv1d + SiLU over the concatenated qkv channels of a Gated DeltaNet layer.

Token-major flat batch: x [T, D], sequence n is rows cu_seqlens[n]:cu_seqlens[n+1]; weight [D, W].
Per-slot state is fla's layout [D, W]: the last W inputs of the sequence, oldest first, zero-padded
on the left for sequences shorter than W. Only columns 1..W-1 feed the next output; column 0 is kept
because fla's kernels read and write W columns, so the GPU path needs no relayout (transformers'
Qwen3-Next cache also keeps W columns).

Fast path (CUDA): fla's Triton kernels. fla indexes states by batch row, not by slot, so we gather
states[state_slots] in and scatter the result back (a few KB per sequence; graph-safe index ops).
Reference (CPU): fp32 math, cast to x.dtype at the end, like fla's fp32 accumulation.
"""
import torch
import torch.nn.functional as F


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


def causal_conv1d_decode_fla(x, weight, bias, states, state_slots):
    cache = states[state_slots]  # fla updates batch row n of its cache in place
    y = causal_conv1d_decode_rows(x, weight, bias, cache)
    states[state_slots] = cache
    return y


def causal_conv1d_varlen(x, weight, bias, states, state_slots, cu_seqlens):
    """x [T, D], weight [D, W], bias [D] or None, states [S, D, W], state_slots [N] int64,
    cu_seqlens [N+1] int32 -> silu(causal conv) [T, D] in x.dtype; final states written to the slots."""
    if x.is_cuda:
        return causal_conv1d_varlen_fla(x, weight, bias, states, state_slots, cu_seqlens)
    return causal_conv1d_varlen_ref(x, weight, bias, states, state_slots, cu_seqlens)


def causal_conv1d_decode_rows(x, weight, bias, cache):
    """causal_conv1d_decode with the states in batch order: x [N, D] (rows may be strided), cache [N, D, W]
    updated in place (no gather / scatter through slots)."""
    if x.is_cuda:
        from fla.modules.causal_conv1d import causal_conv1d_update
        return causal_conv1d_update(x, cache, weight=weight, bias=bias, activation="silu")[0]
    return causal_conv1d_decode_ref(x, weight, bias, cache, torch.arange(x.shape[0], device=x.device))


def causal_conv1d_decode(x, weight, bias, states, state_slots):
    """x [N, D], one token per sequence -> [N, D]. CUDA-graph capturable (after one warm-up call,
    which runs fla's autotuning)."""
    if x.is_cuda:
        return causal_conv1d_decode_fla(x, weight, bias, states, state_slots)
    return causal_conv1d_decode_ref(x, weight, bias, states, state_slots)

"""Gated DeltaNet ops: causal conv1d and the gated delta rule (references, fla fast paths, dispatch).

- References vs transformers' Qwen3-Next torch functions. transformers swaps those names for fla's
  kernels when fla is installed, so we take the original torch functions with inspect.unwrap.
- fla on CPU: its decode kernels and conv kernels run under TRITON_INTERPRET=1 (the chunk kernel does
  not). Triton picks the interpreter when a kernel is decorated, i.e. at fla's import, so the
  `test_interp_*` tests run only in a child `python -m pytest -k interp_` started with the variable
  set (test_fla_interpreter_child, which then compiles our kernels' launches for sm_90 on the CPU:
  tests/triton_compile_check.py). The child patches two triton-3.6 interpreter gaps: int() of a
  1-element array (an error from numpy 2.4 on) and autotuning, which needs a GPU to time configs.
- `gpu` tests: real sizes, bf16, fla vs the fp32 references, and CUDA-graph capture of the decode ops.
"""
import importlib.metadata
import inspect
import os
import sys

import pytest
import torch
import torch.nn.functional as F

from sketchkv.ops.causal_conv1d import (causal_conv1d_decode, causal_conv1d_decode_ref, causal_conv1d_rows,
                                        causal_conv1d_rows_ref, causal_conv1d_varlen, causal_conv1d_varlen_fla,
                                        causal_conv1d_varlen_ref, conv_state_shape)
from sketchkv.ops.gated_delta_rule import (gated_delta_rule_decode, gated_delta_rule_decode_ref,
                                           gated_delta_rule_rows,
                                           gated_delta_rule_rows_ref, gated_delta_rule_varlen,
                                           gated_delta_rule_varlen_ref)
from sketchkv.ops.gdn_gates import gdn_gates, gdn_gates_ref
from conftest import run_interpreter_tests

INTERP = os.environ.get("TRITON_INTERPRET") == "1"
try:
    HAS_FLA = bool(importlib.metadata.version("fla-core"))
except importlib.metadata.PackageNotFoundError:
    HAS_FLA = False
needs_interp = pytest.mark.skipif(not INTERP, 
                                  reason="runs in the TRITON_INTERPRET=1 child (test_fla_interpreter_child)")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

if INTERP:
    # conftest hides fla on CPU (sys.modules["fla"] = None) so transformers keeps its torch paths;
    # this child runs fla itself and never imports transformers
    if "fla" in sys.modules and sys.modules["fla"] is None:
        del sys.modules["fla"]
    import triton.runtime.autotuner as _autotuner
    import triton.runtime.interpreter as _interp

    _patch_tensor = _interp._patch_lang_tensor

    def _patch_lang_tensor(tensor, scope):
        _patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    _interp._patch_lang_tensor = _patch_lang_tensor
    _autotuner.Autotuner._bench = lambda self, *args, config, **kw: [0.0, 0.0, 0.0]  # no timer: take the first config

LENS = [1, 5, 70]      # one token, short, across the 64-token chunk
SLOTS = [3, 0, 5]      # in S = 6 slots; 1, 2, 4 must stay untouched
S = 6


@pytest.fixture(scope="module")
def hf():
    """transformers' torch reference functions (imported lazily: the interpreter child doesn't need them)."""
    from transformers.models.qwen3_next import modeling_qwen3_next as m
    names = ["causal_conv1d_fn", "causal_conv1d_update",
             "torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"]
    fns = {n: inspect.unwrap(getattr(m, n)) for n in names}
    assert all(f.__module__ == m.__name__ for f in fns.values())
    return fns


def cu_of(lens, device="cpu"):
    return torch.tensor([0] + lens, dtype=torch.int32).cumsum(0, dtype=torch.int32).to(device)


def conv_inputs(lens, D, W, dtype=torch.float32, device="cpu", seed=0, num_slots=S, bias=True):
    g = torch.Generator().manual_seed(seed)
    # x is a column slice of a wider projection, as in the model (qkv split from one matmul)
    x = torch.randn(sum(lens), D + 7, generator=g)[:, 3:3 + D]
    w = torch.randn(D, W, generator=g) * 0.5
    b = torch.randn(D, generator=g) if bias else None
    states = torch.randn(num_slots, *conv_state_shape(D, W), generator=g)
    to = lambda t: None if t is None else t.to(device=device, dtype=dtype)
    return to(x), to(w), to(b), to(states)


def gdn_inputs(T, Hk, Hv, Dk, Dv, dtype=torch.float32, device="cpu", seed=0, num_slots=S):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(T, Hk, Dk, generator=g)
    k = torch.randn(T, Hk, Dk, generator=g)
    v = torch.randn(T, Hv, Dv, generator=g)
    gate = F.logsigmoid(torch.randn(T, Hv, generator=g) * 2 + 3)  # decays from ~0.5 to ~1, as trained models
    beta = torch.randn(T, Hv, generator=g).sigmoid()
    states = torch.randn(num_slots, Hv, Dk, Dv, generator=g) * 0.5
    to = lambda t: t.to(device=device, dtype=dtype)
    return to(q), to(k), to(v), gate.to(device), to(beta), states.to(device)


def raw_gates(T, Hv, dtype=torch.float32, device="cpu", seed=0):
    """The layer's raw gates: a, b [T, Hv] strided column views of one wider in_proj output (linear_split),
    A_log [Hv] in fp32, dt_bias [Hv] in the model dtype; head 0's a + dt_bias above softplus's threshold (20)."""
    gen = torch.Generator().manual_seed(seed)
    out = torch.randn(T, 2 * Hv + 9, generator=gen) * 3
    out[:, 5 + Hv] = 25.0
    out = out.to(device=device, dtype=dtype)
    A_log = torch.empty(Hv).uniform_(0.01, 16, generator=gen).log().to(device)
    dt_bias = torch.randn(Hv, generator=gen).to(device=device, dtype=dtype)
    return out[:, 5 + Hv:5 + 2 * Hv], out[:, 5:5 + Hv], A_log, dt_bias


def untouched(states, before, slots):
    rest = [i for i in range(states.shape[0]) if i not in slots]
    return torch.equal(states[rest], before[rest])


# --- references vs transformers -------------------------------------------------------------------

@pytest.mark.parametrize("bias", [True, False])
def test_conv_varlen_ref_vs_transformers(hf, bias):
    D, W = 24, 4
    x, w, b, states = conv_inputs(LENS, D, W, bias=bias)
    before = states.clone()
    cu = cu_of(LENS)
    y = causal_conv1d_varlen_ref(x, w, b, states, torch.tensor(SLOTS), cu)
    for n, slot in enumerate(SLOTS):
        xs = torch.cat([before[slot], x[cu[n]:cu[n + 1]].T], -1)  # [D, W + L]: state, then the sequence
        ref = hf["causal_conv1d_fn"](xs[None, :, 1:], w, b, activation="silu")[0, :, W - 1:]  # drop the state's outputs
        torch.testing.assert_close(y[cu[n]:cu[n + 1]], ref.T, atol=1e-5, rtol=1e-5)
        assert torch.equal(states[slot], xs[:, -W:])
    assert untouched(states, before, SLOTS)


def test_conv_decode_ref_vs_transformers(hf):
    D, W = 24, 4
    x, w, b, states = conv_inputs([1, 1, 1], D, W)
    before = states.clone()
    slots = torch.tensor(SLOTS)
    y = causal_conv1d_decode_ref(x, w, b, states, slots)
    cache = before[slots].clone()
    ref = hf["causal_conv1d_update"](x[..., None], cache, w, b, activation="silu")[..., 0]
    torch.testing.assert_close(y, ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(states[slots], cache)
    assert untouched(states, before, SLOTS)


def test_gdn_varlen_ref_vs_transformers(hf):
    Hk, Hv, Dk, Dv = 2, 4, 16, 8  # GQA 2x, Dk != Dv
    q, k, v, g, beta, states = gdn_inputs(sum(LENS), Hk, Hv, Dk, Dv)
    before = states.clone()
    cu = cu_of(LENS)
    o = gated_delta_rule_varlen_ref(q, k, v, g, beta, states, torch.tensor(SLOTS), cu)
    # older transformers (5.17, on the GPU image) want Hk == Hv here
    qe, ke = q.repeat_interleave(Hv // Hk, 1), k.repeat_interleave(Hv // Hk, 1)
    for n, slot in enumerate(SLOTS):
        s, e = cu[n], cu[n + 1]
        args = (qe[None, s:e], ke[None, s:e], v[None, s:e], g[None, s:e], beta[None, s:e])
        kw = dict(initial_state=before[slot][None], output_final_state=True, use_qk_l2norm_in_kernel=True)
        ref_o, ref_h = hf["torch_chunk_gated_delta_rule"](*args, **kw)
        torch.testing.assert_close(o[s:e], ref_o[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(states[slot], ref_h[0], atol=1e-5, rtol=1e-5)
        # and the plain token loop: the chunked form is exact in fp32
        rec_o, rec_h = hf["torch_recurrent_gated_delta_rule"](*args, **kw)
        torch.testing.assert_close(o[s:e], rec_o[0], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(states[slot], rec_h[0], atol=1e-4, rtol=1e-4)
    assert untouched(states, before, SLOTS)


def test_gdn_decode_ref_vs_transformers(hf):
    Hk, Hv, Dk, Dv = 2, 4, 16, 8
    q, k, v, g, beta, states = gdn_inputs(3, Hk, Hv, Dk, Dv)
    before = states.clone()
    slots = torch.tensor(SLOTS)
    o = gated_delta_rule_decode_ref(q, k, v, g, beta, states, slots)
    # older transformers (5.17, on the GPU image) want Hk == Hv here
    qe, ke = q.repeat_interleave(Hv // Hk, 1), k.repeat_interleave(Hv // Hk, 1)
    ref_o, ref_h = hf["torch_recurrent_gated_delta_rule"](
        qe[:, None], ke[:, None], v[:, None], g[:, None], beta[:, None],
        initial_state=before[slots], output_final_state=True, use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(o, ref_o[:, 0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(states[slots], ref_h, atol=1e-5, rtol=1e-5)
    assert untouched(states, before, SLOTS)


def test_gdn_ref_bf16_inputs_keep_fp32_state():
    q, k, v, g, beta, states = gdn_inputs(sum(LENS), 2, 4, 16, 8)
    bf = lambda t: t.bfloat16()
    st_bf = states.clone()
    o_bf = gated_delta_rule_varlen_ref(bf(q), bf(k), bf(v), g, bf(beta), st_bf, torch.tensor(SLOTS), cu_of(LENS))
    o = gated_delta_rule_varlen_ref(bf(q).float(), bf(k).float(), bf(v).float(), g, bf(beta).float(), states,
                                    torch.tensor(SLOTS), cu_of(LENS))
    assert o_bf.dtype == torch.bfloat16 and st_bf.dtype == torch.float32
    assert torch.equal(st_bf, states) and torch.equal(o_bf, o.bfloat16())


# --- prefill then decode through the slots --------------------------------------------------------

def test_prefill_then_decode_consistency():
    """Varlen over all tokens == varlen over a prefix + token-by-token decode, for conv and GDN chained
    like the layer does (conv output feeds q/k/v). Dispatch functions, so on CUDA this is the fla path."""
    prefix, steps = [1, 66, 3], 4   # prefix 66 + 4 decode tokens crosses the 64 chunk mid-decode
    lens = [p + steps for p in prefix]
    Hk, Hv, Dk, Dv, W = 2, 4, 16, 8, 4
    D = 2 * Hk * Dk + Hv * Dv
    slots = torch.tensor(SLOTS)
    x, w, b, conv_states = conv_inputs(lens, D, W, seed=1)
    _, _, _, g, beta, rec_states = gdn_inputs(sum(lens), Hk, Hv, Dk, Dv, seed=2)

    def layer(xx, gg, bb, conv_st, rec_st, cu=None):
        if cu is None:
            y = causal_conv1d_decode(xx, w, b, conv_st, slots)
        else:
            y = causal_conv1d_varlen(xx, w, b, conv_st, slots, cu)
        q, k, v = y.split([Hk * Dk, Hk * Dk, Hv * Dv], -1)
        q, k, v = q.view(-1, Hk, Dk), k.view(-1, Hk, Dk), v.view(-1, Hv, Dv)
        if cu is None:
            return gated_delta_rule_decode(q, k, v, gg, bb, rec_st, slots)
        return gated_delta_rule_varlen(q, k, v, gg, bb, rec_st, slots, cu)

    full_conv, full_rec = conv_states.clone(), rec_states.clone()
    o_full = layer(x, g, beta, full_conv, full_rec, cu_of(lens))

    cu = cu_of(lens).tolist()
    pre_rows = torch.cat([torch.arange(cu[n], cu[n] + p) for n, p in enumerate(prefix)])
    o_pre = layer(x[pre_rows], g[pre_rows], beta[pre_rows], conv_states, rec_states, cu_of(prefix))
    torch.testing.assert_close(o_pre, o_full[pre_rows], atol=1e-5, rtol=1e-5)
    for t in range(steps):
        rows = torch.tensor([cu[n] + p + t for n, p in enumerate(prefix)])
        o_t = layer(x[rows], g[rows], beta[rows], conv_states, rec_states)
        torch.testing.assert_close(o_t, o_full[rows], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(conv_states, full_conv, atol=0, rtol=0)
    torch.testing.assert_close(rec_states, full_rec, atol=1e-5, rtol=1e-5)


def test_conv_short_sequences_keep_old_state():
    """Sequences shorter than W-1 shift their tokens into the state and keep its older columns."""
    D, W = 8, 4
    x, w, b, states = conv_inputs([1, 2], D, W)
    before = states.clone()
    causal_conv1d_varlen_ref(x, w, b, states, torch.tensor([4, 1]), cu_of([1, 2]))
    assert torch.equal(states[4], torch.cat([before[4][:, 1:], x[0:1].T], -1))
    assert torch.equal(states[1], torch.cat([before[1][:, 2:], x[1:3].T], -1))


def gated_delta_rule_positions(q, k, v, g, beta, states, slots, kept=None):
    """gated_delta_rule_rows over [N, T, ...] inputs (sequence n's positions are rows n * T + t): the layout of
    a verification step; kept None = verification (no state written), else the replay up to kept[n]."""
    N, T = g.shape[:2]
    rows0 = torch.arange(N, device=q.device) * T
    o = gated_delta_rule_rows(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), g.flatten(0, 1), beta.flatten(0, 1),
                              states, slots, rows0, T, kept, write=kept is not None)
    return o.view(v.shape)


def positions_case(N, T, Hk, Hv, Dk, Dv, dtype=torch.float32, device="cpu", num_slots=S, seed=0):
    """Inputs [N, T, ...] for gated_delta_rule_positions, N slots to start from, and the position each
    sequence keeps (the replay)."""
    q, k, v, g, beta, states = gdn_inputs(N * T, Hk, Hv, Dk, Dv, dtype, device, seed=seed, num_slots=num_slots)
    q, k, v, g, beta = (x.view(N, T, *x.shape[1:]) for x in (q, k, v, g, beta))
    slots = torch.randperm(num_slots, generator=torch.Generator().manual_seed(seed))[:N].to(device)
    kept = torch.randint(0, T, (N,), generator=torch.Generator().manual_seed(seed + 1)).to(device)
    return q, k, v, g, beta, states, slots, kept


def stepwise_positions(decode, q, k, v, g, beta, states, slots, kept):
    """T one-token calls on a copy of the states (what gated_delta_rule_positions replaces): outputs and
    each sequence's state after its kept position."""
    N, T = q.shape[:2]
    work = states[slots].clone()
    local = torch.arange(N, device=q.device)
    outs, want = [], states.clone()
    for t in range(T):
        outs.append(decode(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], work, local))
        hit = kept == t
        want[slots[hit]] = work[hit]
    return torch.stack(outs, 1), want


def assert_positions_are_stepwise(positions, decode, case):
    """positions(...) == decode one position at a time, bitwise: outputs (up to each sequence's kept position;
    all of them when nothing is kept), kept states, and no other slot written. -> (outputs, states before)."""
    q, k, v, g, beta, states, slots, kept = case
    o_want, st_want = stepwise_positions(decode, q, k, v, g, beta, states, slots, kept)
    before = states.clone()
    assert torch.equal(positions(q, k, v, g, beta, states, slots), o_want)     # verification: nothing written
    assert torch.equal(states, before)
    o = positions(q, k, v, g, beta, states, slots, kept)
    upto = torch.arange(q.shape[1], device=q.device)[None] <= kept[:, None]
    assert torch.equal(o[upto], o_want[upto])
    assert torch.equal(states[slots], st_want[slots])
    assert untouched(states, before, slots.tolist())
    return o, before


def test_gdn_positions_ref_is_stepwise_decode():
    assert_positions_are_stepwise(gated_delta_rule_positions, gated_delta_rule_decode_ref,
                                  positions_case(3, 4, 2, 4, 16, 8))


# --- fla under the triton interpreter (CPU) -------------------------------------------------------

@pytest.mark.skipif(INTERP, reason="already inside the interpreter child")
@pytest.mark.skipif(not HAS_FLA, reason="fla-core is not installed: the fla fast paths cannot be checked on CPU")
def test_fla_interpreter_child():
    # also compiles our kernels' logged launches for sm_90 (fla's are not logged)
    run_interpreter_tests(__file__, INTERP)


def rows_decode(q, k, v, g, beta, states, slots):
    """One-token decode through the rows kernel (the engine's decode call on CUDA)."""
    return gated_delta_rule_rows(q, k, v, g, beta, states, slots, torch.arange(q.shape[0], device=q.device), 1,
                                 write=True)


def conv_rows_case(N, T, D, W, dtype=torch.float32, device="cpu", num_slots=S, seed=0):
    """Pre-conv rows of N sequences x T positions inside a wider buffer (strided, as the fused in_proj's
    output), the slots they start from and the position each keeps."""
    x, w, b, states = conv_inputs([T] * N, D, W, dtype, device, num_slots=num_slots, seed=seed)
    x = torch.cat([x, torch.randn_like(x)[:, :5]], 1)[:, :D]
    slots = torch.randperm(num_slots, generator=torch.Generator().manual_seed(seed))[:N].to(device)
    kept = torch.randint(0, T, (N,), generator=torch.Generator().manual_seed(seed + 1)).to(device)
    return x, w, b, states, slots, torch.arange(N, device=device) * T, kept


def assert_conv_rows_are_stepwise(case, T):
    """causal_conv1d_rows over T positions == T one-position calls, bitwise: outputs (verification writes no
    state), and with kept the slot's state after the kept position, other slots untouched."""
    x, w, b, states, slots, rows0, kept = case
    before = states.clone()
    work, want = states.clone(), states.clone()
    y_want = torch.empty_like(x)
    for t in range(T):
        y_want[rows0 + t] = causal_conv1d_rows(x, w, b, work, slots, rows0 + t, 1, write=True)[rows0 + t]
        hit = kept == t
        want[slots[hit]] = work[slots[hit]]
    rows = (rows0[:, None] + torch.arange(T, device=x.device)).flatten()
    assert torch.equal(causal_conv1d_rows(x, w, b, states, slots, rows0, T)[rows], y_want[rows])
    assert torch.equal(states, before)
    assert causal_conv1d_rows(x, w, b, states, slots, rows0, T, kept, write=True, store_y=False) is None
    assert torch.equal(states, want)
    return before


@needs_interp
def test_interp_conv_rows_kernel():
    """Our conv kernel: decode (one position, strided rows, state in place) against the reference, and T
    positions in one call against T one-position calls (bitwise) and the reference."""
    D, W = 24, 4
    x, w, b, states = conv_inputs([1, 1, 1], D, W)
    x = torch.cat([x, x], 1)[:, :D]
    st_ref, slots = states.clone(), torch.tensor(SLOTS)
    y = causal_conv1d_rows(x, w, b, states, slots, torch.arange(3), 1, write=True)
    torch.testing.assert_close(y, causal_conv1d_decode_ref(x, w, b, st_ref, slots), atol=1e-5, rtol=1e-5)
    assert torch.equal(states, st_ref)
    case = conv_rows_case(3, 5, D, W)
    before = assert_conv_rows_are_stepwise(case, 5)
    x, w, b, _, slots, rows0, kept = case
    st_ref = before.clone()
    y_ref = causal_conv1d_rows_ref(x, w, b, st_ref, slots, rows0, 5, kept, write=True)
    y = causal_conv1d_rows(x, w, b, before, slots, rows0, 5, kept, write=True)
    upto = (rows0[:, None] + torch.arange(5)[None])[torch.arange(5)[None] <= kept[:, None]]
    torch.testing.assert_close(y[upto], y_ref[upto], atol=1e-5, rtol=1e-5)
    assert torch.equal(before, st_ref)
    # rows0=None (the decode and verification layout, rows n * T + t, without an index tensor): the same bits
    x, w, b, states, slots, rows0, kept = conv_rows_case(3, 5, D, W, seed=3)
    st_none = states.clone()
    y_rows = causal_conv1d_rows(x, w, b, states, slots, rows0, 5, kept, write=True)
    y_none = causal_conv1d_rows(x, w, b, st_none, slots, None, 5, kept, write=True)
    upto = (rows0[:, None] + torch.arange(5)[None])[torch.arange(5)[None] <= kept[:, None]]
    assert torch.equal(y_rows[upto], y_none[upto]) and torch.equal(states, st_none)


@needs_interp
def test_interp_conv_varlen_fla():
    D, W = 24, 4
    lens = [1, 2, 70]  # shorter than W - 1 (state kernel mixes old state in), and across fla's 64 block
    x, w, b, states = conv_inputs(lens, D, W)
    st_ref, slots, cu = states.clone(), torch.tensor(SLOTS), cu_of(lens)
    y = causal_conv1d_varlen_fla(x, w, b, states, slots, cu)
    y_ref = causal_conv1d_varlen_ref(x, w, b, st_ref, slots, cu)
    torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(states, st_ref)


@needs_interp
def test_interp_gdn_rows_kernel():
    """Our recurrence kernel: decode (strided q, state in place) against the reference; all positions in one
    call == one token at a time, bitwise (outputs and kept states), and close to the reference."""
    Hk, Hv, Dk, Dv = 2, 4, 16, 8
    q, k, v, g, beta, states = gdn_inputs(3, Hk, Hv, Dk, Dv)
    q = torch.cat([q, k], -1)[..., :Dk]  # a strided view, like the engine's qkv split
    st_ref, slots = states.clone(), torch.tensor(SLOTS)
    o = rows_decode(q, k, v, g, beta, states, slots)
    o_ref = gated_delta_rule_decode_ref(q, k, v, g, beta, st_ref, slots)
    torch.testing.assert_close(o, o_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(states, st_ref, atol=1e-5, rtol=1e-5)
    assert untouched(states, st_ref, SLOTS)
    case = positions_case(3, 4, 2, 4, 16, 8)
    _, before = assert_positions_are_stepwise(gated_delta_rule_positions, rows_decode, case)
    q, k, v, g, beta, _, slots, _ = case
    flat = [t.flatten(0, 1) for t in (q, k, v, g, beta)]
    rows0 = torch.arange(3) * 4
    torch.testing.assert_close(gated_delta_rule_positions(q, k, v, g, beta, before, slots).flatten(0, 1),
                               gated_delta_rule_rows_ref(*flat, before.clone(), slots, rows0, 4), atol=1e-5, rtol=1e-5)
    # rows0=None (rows n * T + t without an index tensor, as decode and verification call it): the same bits
    st_rows, st_none = before.clone(), before.clone()
    kept = torch.tensor([1, 3, 0])
    o_rows = gated_delta_rule_rows(*flat, st_rows, slots, rows0, 4, kept, write=True)
    o_none = gated_delta_rule_rows(*flat, st_none, slots, None, 4, kept, write=True)
    upto = (rows0[:, None] + torch.arange(4)[None])[torch.arange(4)[None] <= kept[:, None]]
    assert torch.equal(o_rows[upto], o_none[upto]) and torch.equal(st_rows, st_none)


@needs_interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_interp_gdn_decode_raw_gates(dtype):
    """Plain decode with the gates computed inside the recurrence from a, b (strided views of in_proj's output):
    bitwise gdn_gates + the unfused kernel (outputs and states), and close to the references."""
    Hk, Hv, Dk, Dv = 2, 4, 16, 8
    q, k, v, _, _, states = gdn_inputs(3, Hk, Hv, Dk, Dv, dtype)
    gates = raw_gates(3, Hv, dtype)
    slots = torch.tensor(SLOTS)
    before, st_unfused, st_ref = states.clone(), states.clone(), states.clone()
    # the launch gated_delta_rule_decode makes on CUDA (with CPU tensors it takes the reference path)
    o = gated_delta_rule_rows(q, k, v, None, None, states, slots, None, 1, write=True, gates=gates)
    g, beta = gdn_gates(*gates)
    assert g.dtype == torch.float32 and beta.dtype == dtype
    o_unfused = gated_delta_rule_rows(q, k, v, g, beta, st_unfused, slots, None, 1, write=True)
    assert torch.equal(o, o_unfused) and torch.equal(states, st_unfused)
    assert untouched(states, before, SLOTS)
    # the CPU reference path: gdn_gates_ref, then the reference step
    o_ref = gated_delta_rule_decode(q, k, v, None, None, st_ref, slots, gates=gates)
    assert torch.equal(o_ref, gated_delta_rule_decode_ref(q, k, v, *gdn_gates_ref(*gates), before, slots))
    assert torch.equal(st_ref, before)  # decode_ref stepped `before` in place
    # bf16: the interpreter rounds beta to bf16 by truncation (the reference to nearest): one bf16 step apart
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 1e-2, "rtol": 1e-2}
    torch.testing.assert_close(o, o_ref, **tol)
    torch.testing.assert_close(states, st_ref, **tol)


# --- GPU, real sizes ------------------------------------------------------------------------------
# Qwen3-Next-80B GDN layer: Hk=16, Hv=48, Dk=Dv=128, conv over q|k|v = 2*16*128 + 48*128 channels, W=4.

GPU_LENS = [8192, 1, 2, 63, 64, 65, 1500, 4000]
GPU_SLOTS = [9, 0, 15, 3, 7, 12, 1, 4]  # of 16; the other 8 stay untouched
HK, HV, DK, DV, CW = 16, 48, 128, 128, 4
CD = 2 * HK * DK + HV * DV


def errs(out, ref):
    """(global relative L2 error, worst row's error / median row norm), rows = last dim. A per-row
    relative error is meaningless for rows that nearly cancel (seen: 60x below the median norm, where
    a bf16-level error reads as 17%), so rows are scaled by the median. bf16 rounding alone ~3e-3."""
    out, ref = out.float().flatten(0, -2), ref.float().flatten(0, -2)
    d, n = (out - ref).norm(dim=-1), ref.norm(dim=-1)
    return (d.norm() / n.norm()).item(), (d.max() / n.median()).item()


@pytest.mark.gpu
@needs_cuda
def test_gpu_conv_varlen():
    x, w, b, states = conv_inputs(GPU_LENS, CD, CW, torch.bfloat16, "cuda", num_slots=16)
    st_ref, slots, cu = states.clone(), torch.tensor(GPU_SLOTS, device="cuda"), cu_of(GPU_LENS, "cuda")
    y = causal_conv1d_varlen(x, w, b, states, slots, cu)
    y_ref = causal_conv1d_varlen_ref(x, w, b, st_ref, slots, cu)
    # both accumulate in fp32 and round once to bf16: at most one bf16 ulp apart
    torch.testing.assert_close(y, y_ref, atol=2e-2, rtol=1e-2)
    assert torch.equal(states, st_ref)  # the state is a copy of inputs


@pytest.mark.gpu
@needs_cuda
def test_gpu_conv_decode():
    x, w, b, states = conv_inputs([1] * 8, CD, CW, torch.bfloat16, "cuda", num_slots=16)
    st_ref, slots = states.clone(), torch.tensor(GPU_SLOTS, device="cuda")
    y = causal_conv1d_decode(x, w, b, states, slots)
    y_ref = causal_conv1d_decode_ref(x, w, b, st_ref, slots)
    torch.testing.assert_close(y, y_ref, atol=2e-2, rtol=1e-2)
    assert torch.equal(states, st_ref)


@pytest.mark.gpu
@needs_cuda
def test_gpu_gdn_varlen():
    q, k, v, g, beta, states = gdn_inputs(sum(GPU_LENS), HK, HV, DK, DV, torch.bfloat16, "cuda", num_slots=16)
    st_ref, slots, cu = states.clone(), torch.tensor(GPU_SLOTS, device="cuda"), cu_of(GPU_LENS, "cuda")
    o = gated_delta_rule_varlen(q, k, v, g, beta, states, slots, cu)
    o_ref = gated_delta_rule_varlen_ref(q, k, v, g, beta, st_ref, slots, cu)
    # fla keeps the running state in fp32 but feeds bf16 copies of normalised q/k, chunk states and
    # corrected values to its tensor-core matmuls: bf16-level error (seen on H200: o global 4.5e-3,
    # worst row 2.4e-2 of the median norm; same at 1 and 8192 tokens, so no drift with length)
    assert o.dtype == torch.bfloat16 and states.dtype == torch.float32
    e_glob, e_row = errs(o, o_ref)
    assert e_glob < 1e-2 and e_row < 5e-2, (e_glob, e_row)
    e_glob, e_row = errs(states[slots], st_ref[slots])
    assert e_glob < 1e-2 and e_row < 5e-2, (e_glob, e_row)
    assert untouched(states, st_ref, GPU_SLOTS)


@pytest.mark.gpu
@needs_cuda
def test_gpu_gdn_decode():
    q, k, v, g, beta, states = gdn_inputs(8, HK, HV, DK, DV, torch.bfloat16, "cuda", num_slots=16)
    st_ref, slots = states.clone(), torch.tensor(GPU_SLOTS, device="cuda")
    o = gated_delta_rule_decode(q, k, v, g, beta, states, slots)
    o_ref = gated_delta_rule_decode_ref(q, k, v, g, beta, st_ref, slots)
    # one fp32 step from the same bf16 inputs: only summation order differs, then o rounds to bf16
    e_glob, e_row = errs(o, o_ref)
    assert e_glob < 5e-3 and e_row < 1e-2, (e_glob, e_row)
    torch.testing.assert_close(states, st_ref, atol=1e-4, rtol=1e-4)
    assert untouched(states, st_ref, GPU_SLOTS)


@pytest.mark.gpu
@needs_cuda
def test_gpu_gdn_decode_raw_gates_is_unfused():
    """Decode with the gates computed in the recurrence == gdn_gates + decode, bitwise, at the real shape (bf16)."""
    q, k, v, _, _, states = gdn_inputs(8, HK, HV, DK, DV, torch.bfloat16, "cuda", num_slots=16)
    gates = raw_gates(8, HV, torch.bfloat16, "cuda")
    st_unfused, slots = states.clone(), torch.tensor(GPU_SLOTS, device="cuda")
    o = gated_delta_rule_decode(q, k, v, None, None, states, slots, gates=gates)
    o_unfused = gated_delta_rule_decode(q, k, v, *gdn_gates(*gates), st_unfused, slots)
    assert torch.equal(o, o_unfused) and torch.equal(states, st_unfused)


@pytest.mark.gpu
@needs_cuda
def test_gpu_gdn_positions_is_stepwise_decode():
    """8 positions x 8 sequences in one call of our kernel == 8 one-token calls, bitwise, at real head sizes (bf16)."""
    assert_positions_are_stepwise(gated_delta_rule_positions, gated_delta_rule_decode,
                                  positions_case(8, 8, HK, HV, DK, DV, torch.bfloat16, "cuda", num_slots=16))


@pytest.mark.gpu
@needs_cuda
def test_gpu_conv_rows_is_stepwise():
    """8 positions x 8 sequences of our conv kernel in one call == 8 one-position calls, bitwise, at real sizes."""
    assert_conv_rows_are_stepwise(conv_rows_case(8, 8, CD, CW, torch.bfloat16, "cuda", num_slots=16), 8)


@pytest.mark.gpu
@needs_cuda
def test_gpu_decode_cuda_graph():
    """Conv + GDN decode captured once, replayed on new inputs and slots: same as eager references."""
    N = 8
    x, w, b, conv_states = conv_inputs([1] * N, CD, CW, torch.bfloat16, "cuda", num_slots=16)
    x = x.contiguous()
    _, _, _, g, beta, rec_states = gdn_inputs(N, HK, HV, DK, DV, torch.bfloat16, "cuda", num_slots=16)
    slots = torch.tensor(GPU_SLOTS, device="cuda")

    def step():
        y = causal_conv1d_decode(x, w, b, conv_states, slots)
        q, k, v = y.split([HK * DK, HK * DK, HV * DV], -1)
        q, k, v = q.view(N, HK, DK), k.view(N, HK, DK), v.view(N, HV, DV)
        return gated_delta_rule_decode(q, k, v, g, beta, rec_states, slots)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()  # warm-up: compiles and autotunes outside the capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()

    for seed in (5, 6):
        x2, _, _, _ = conv_inputs([1] * N, CD, CW, torch.bfloat16, "cuda", seed=seed)
        _, _, _, g2, beta2, _ = gdn_inputs(N, HK, HV, DK, DV, torch.bfloat16, "cuda", seed=seed)
        x.copy_(x2), g.copy_(g2), beta.copy_(beta2)
        slots.copy_(torch.randperm(16, generator=torch.Generator().manual_seed(seed))[:N])
        conv_ref, rec_ref = conv_states.clone(), rec_states.clone()
        graph.replay()
        y = causal_conv1d_decode_ref(x, w, b, conv_ref, slots)
        q, k, v = y.split([HK * DK, HK * DK, HV * DV], -1)
        o_ref = gated_delta_rule_decode_ref(q.view(N, HK, DK), k.view(N, HK, DK), v.view(N, HV, DV), g, beta,
                                            rec_ref, slots)
        assert torch.equal(conv_states, conv_ref)
        e_glob, e_row = errs(out, o_ref)
        assert e_glob < 5e-3 and e_row < 1e-2, (e_glob, e_row)
        torch.testing.assert_close(rec_states, rec_ref, atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
@needs_cuda
def test_gpu_prefill_then_decode():
    """fla chunk prefill + fla decode steps == fla chunk over everything, at real head sizes."""
    prefix, steps = [4000, 1, 63, 700], 3
    lens = [p + steps for p in prefix]
    q, k, v, g, beta, st_full = gdn_inputs(sum(lens), HK, HV, DK, DV, torch.bfloat16, "cuda", num_slots=16)
    slots = torch.tensor(GPU_SLOTS[:4], device="cuda")
    st = st_full.clone()
    cu = cu_of(lens).tolist()
    o_full = gated_delta_rule_varlen(q, k, v, g, beta, st_full, slots, cu_of(lens, "cuda"))
    pre = torch.cat([torch.arange(cu[n], cu[n] + p, device="cuda") for n, p in enumerate(prefix)])
    o_pre = gated_delta_rule_varlen(q[pre], k[pre], v[pre], g[pre], beta[pre], st, slots, cu_of(prefix, "cuda"))
    # both sides are fla at bf16 level (see test_gpu_gdn_varlen); the prefix run is the same kernel
    e_glob, e_row = errs(o_pre, o_full[pre])
    assert e_glob < 1e-2 and e_row < 5e-2, (e_glob, e_row)
    for t in range(steps):
        rows = torch.tensor([cu[n] + p + t for n, p in enumerate(prefix)], device="cuda")
        o_t = gated_delta_rule_decode(q[rows], k[rows], v[rows], g[rows], beta[rows], st, slots)
        e_glob, e_row = errs(o_t, o_full[rows])
        assert e_glob < 1e-2 and e_row < 5e-2, (e_glob, e_row)
    e_glob, e_row = errs(st[slots], st_full[slots])
    assert e_glob < 1e-2 and e_row < 5e-2, (e_glob, e_row)

"""Gated delta rule (the Gated DeltaNet recurrence), token-major flat batch with per-slot states.

Per value head, with a_t = exp(g_t) and q, k L2-normalised (eps 1e-6) and q scaled by Dk^-0.5:
    h_t = a_t h_{t-1} + k_t (beta_t (v_t - a_t h_{t-1}^T k_t))^T        h [Dk, Dv], fp32
    o_t = h_t^T q_t
q, k [T, Hk, Dk]; v [T, Hv, Dv] with value head h reading key head h // (Hv // Hk); g, beta [T, Hv];
states [S, Hv, Dk, Dv] fp32 holding every slot (fla's default [K, V] layout, so the slots go to fla as is).
Plain decode may pass in_proj's raw gate columns instead (`gates=(a, b, A_log, dt_bias)`): the kernel then
computes g and beta as gdn_gates does, bit for bit, and the step saves gdn_gates' launch (one per GDN layer).

Fast path (CUDA):
- varlen (prefill), fla-core 0.6.0: chunk_gated_delta_rule over the flat batch with cu_seqlens; it takes [N, ...] initial states
  and returns new final states, so we gather states[state_slots] and scatter back.
- decode, speculative verification and its replay: our kernel (`gated_delta_rule_rows`), T positions per
  sequence from strided q / k / v rows (views of the conv output, no copies) with the scalar decay, the state
  read from and (optionally) written back to its slot in place, kept in registers over the positions. fla
  0.6.0's GDN recurrent kernel has no slot option and its KDA kernel (which does) wants the decay expanded
  over Dk and contiguous inputs: 5 copies per layer and step, and in verification its slot mode writes the
  state after every position (H200 runs 35, 37). Ours: 14 us per 27B layer in decode (fla 16 us + copies),
  29 us per call on average over verification + replay at 8 x 8 positions (fla batch mode: 55), H200 runs 38-39.
Reference (CPU): fp32, per sequence; varlen in the chunked (UT transform) form, decode one step.
"""
import os

import torch

from sketchkv.ops.gdn_gates import gdn_gates_ref

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None


def _l2norm(x, eps=1e-6):
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _prep_qk(q, k, Hv):
    """fp32, L2-normalised, expanded to the Hv value heads; q also scaled by Dk^-0.5."""
    G = Hv // q.shape[-2]
    q = _l2norm(q.float()).repeat_interleave(G, -2) * q.shape[-1] ** -0.5
    k = _l2norm(k.float()).repeat_interleave(G, -2)
    return q, k


def _chunked_seq(q, k, v, g, beta, h, chunk=64):
    """One sequence, heads first, fp32: q (scaled), k [H, L, Dk], v [H, L, Dv], g, beta [H, L],
    h [H, Dk, Dv] -> (o [H, L, Dv], final h). Same math as transformers' torch_chunk_gated_delta_rule."""
    o = torch.empty_like(v)
    for s in range(0, q.shape[1], chunk):
        qc, kc, vc, gc, bc = (t[:, s:s + chunk] for t in (q, k, v, g, beta))
        C = qc.shape[1]
        c = gc.cumsum(-1)  # log decay since the chunk start
        upper = torch.ones(C, C, dtype=torch.bool, device=q.device).triu(1)
        decay = (c[..., :, None] - c[..., None, :]).masked_fill(upper, float("-inf")).exp()  # [H, C, C]
        kb = kc * bc[..., None]
        # unit lower-triangular system: token i's delta depends on the earlier deltas in the chunk
        A = kb @ kc.mT * decay
        u = torch.linalg.solve_triangular(A, vc * bc[..., None], upper=False, unitriangular=True)
        w = torch.linalg.solve_triangular(A, kb * c.exp()[..., None], upper=False, unitriangular=True)
        v_new = u - w @ h
        o[:, s:s + C] = (qc * c.exp()[..., None]) @ h + (qc @ kc.mT * decay) @ v_new
        h = h * c[:, -1:, None].exp() + (kc * (c[:, -1:] - c).exp()[..., None]).mT @ v_new
    return o, h


def gated_delta_rule_varlen_ref(q, k, v, g, beta, states, state_slots, cu_seqlens):
    qf, kf = _prep_qk(q, k, v.shape[1])
    o = torch.empty_like(v)
    bounds = cu_seqlens.tolist()
    for n, slot in enumerate(state_slots.tolist()):
        s, e = bounds[n], bounds[n + 1]
        hf = lambda t: t[s:e].float().transpose(0, 1)  # heads first
        on, h = _chunked_seq(hf(qf), hf(kf), hf(v), hf(g), hf(beta), states[slot].float())
        o[s:e] = on.transpose(0, 1).to(o.dtype)
        states[slot] = h.to(states.dtype)
    return o


def gated_delta_rule_decode_ref(q, k, v, g, beta, states, state_slots):
    qf, kf = _prep_qk(q, k, v.shape[1])  # [N, Hv, Dk]
    h = states[state_slots].float() * g.float().exp()[..., None, None]  # [N, Hv, Dk, Dv]
    delta = (v.float() - torch.einsum("nhkv,nhk->nhv", h, kf)) * beta.float()[..., None]
    h = h + kf[..., None] * delta[..., None, :]
    states[state_slots] = h.to(states.dtype)
    return torch.einsum("nhkv,nhk->nhv", h, qf).to(v.dtype)


def gated_delta_rule_varlen_fla(q, k, v, g, beta, states, state_slots, cu_seqlens):
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    o, final = chunk_gated_delta_rule(q[None], k[None], v[None], g[None], beta[None], initial_state=states[state_slots],
                                      output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=cu_seqlens)
    states[state_slots] = final.to(states.dtype)
    return o[0].to(v.dtype)


if triton is not None:

    @triton.jit
    def _gdn_rows_kernel(q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, alog_ptr, dt_ptr, o_ptr, h_ptr, slots_ptr, rows0_ptr,
                         kept_ptr, T, scale, sq_r, sq_h, sk_r, sk_h, sv_r, sv_h, sg_r, sb_r,
                         HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr,
                         BV: tl.constexpr, WRITE: tl.constexpr, HAS_KEPT: tl.constexpr, STORE_O: tl.constexpr,
                         HAS_ROWS0: tl.constexpr, RAW_GATES: tl.constexpr):
        # program (sequence n, value head hv, BV value dims): the [Dk, BV] state tile in registers over the
        # positions t (rows rows0[n] + t; no rows0: n * T + t), read from the slot once and written at most once.
        # HAS_KEPT: positions 0..kept[n] only (the commit's replay: the state after the kept position, no outputs
        # needed). RAW_GATES: g_ptr, b_ptr are in_proj's a, b columns, and g, beta are computed here with
        # _gdn_gates_kernel's fp32 ops in its order (beta rounded to b's dtype as it stores it): the same bits.
        n = tl.program_id(0)
        hv = tl.program_id(1)
        ov = tl.program_id(2) * BV + tl.arange(0, BV)
        ok = tl.arange(0, BK)
        mk, mv = ok < DK, ov < DV
        hk = hv // (HV // HK)
        slot = tl.load(slots_ptr + n).to(tl.int64)
        if HAS_ROWS0:
            row0 = tl.load(rows0_ptr + n).to(tl.int64)
        else:
            row0 = n.to(tl.int64) * T
        p_h = h_ptr + ((slot * HV + hv) * DK + ok[:, None]) * DV + ov[None, :]
        h = tl.load(p_h, mask=mk[:, None] & mv[None, :], other=0.0)
        steps = T
        if HAS_KEPT:
            steps = tl.load(kept_ptr + n).to(tl.int32) + 1
        for t in range(0, steps):
            r = row0 + t
            q = tl.load(q_ptr + r * sq_r + hk * sq_h + ok, mask=mk, other=0.0).to(tl.float32)
            k = tl.load(k_ptr + r * sk_r + hk * sk_h + ok, mask=mk, other=0.0).to(tl.float32)
            v = tl.load(v_ptr + r * sv_r + hv * sv_h + ov, mask=mv, other=0.0).to(tl.float32)
            q = q / tl.sqrt(tl.sum(q * q) + 1e-6) * scale
            k = k / tl.sqrt(tl.sum(k * k) + 1e-6)
            if RAW_GATES:
                x = tl.load(g_ptr + r * sg_r + hv).to(tl.float32) + tl.load(dt_ptr + hv).to(tl.float32)
                softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(x)))  # torch's threshold
                g = -tl.exp(tl.load(alog_ptr + hv).to(tl.float32)) * softplus
                b = tl.load(b_ptr + r * sb_r + hv).to(tl.float32)
                beta = tl.sigmoid(b).to(b_ptr.dtype.element_ty).to(tl.float32)
            else:
                g = tl.load(g_ptr + r * sg_r + hv).to(tl.float32)
                beta = tl.load(b_ptr + r * sb_r + hv).to(tl.float32)
            h *= tl.exp(g)
            v = (v - tl.sum(h * k[:, None], 0)) * beta
            h += k[:, None] * v[None, :]
            if STORE_O:
                o = tl.sum(h * q[:, None], 0)
                tl.store(o_ptr + (r * HV + hv) * DV + ov, o.to(o_ptr.dtype.element_ty), mask=mv)
        if WRITE:
            tl.store(p_h, h, mask=mk[:, None] & mv[None, :])


def gated_delta_rule_rows_ref(q, k, v, g, beta, states, slots, rows0, T: int, kept=None, write: bool = False):
    """See gated_delta_rule_rows (one-token reference steps over a copy of the states)."""
    work = states[slots].clone()
    N = slots.shape[0]
    if rows0 is None:
        rows0 = torch.arange(N, device=q.device) * T
    o = torch.zeros(v.shape, dtype=v.dtype, device=v.device)
    last = kept if kept is not None else torch.full((N,), T - 1, device=q.device)
    keep = work.clone()
    for t in range(T):
        live = t <= last
        r = (rows0 + t)[live]
        if r.numel():
            sub = work[live]
            o[r] = gated_delta_rule_decode_ref(q[r], k[r], v[r], g[r], beta[r], sub, torch.arange(r.numel(), device=q.device))
            work[live] = sub
        hit = last == t
        keep[hit] = work[hit]
    if write:
        states[slots] = keep
    return o


def gated_delta_rule_rows(q, k, v, g, beta, states, slots, rows0, T: int, kept=None, write: bool = False,
                          store_o: bool = True, gates=None):
    """T positions of N sequences: sequence n's positions are rows rows0[n] + t (rows0 None: n * T + t) of
    q, k [R, Hk, Dk], v [R, Hv, Dv] (strided rows and heads are fine; the head dims contiguous), g, beta [R, Hv];
    it starts from states[slots[n]] -> o [R, Hv, Dv] at the same rows (others left unset; None with store_o=False).
    write: the slot's state becomes the one after position kept[n] (None: T - 1); with kept, only positions up to
    it run.
    Decode (T = 1, write), verification (T = 1 + n, no write) and the commit's replay (kept, write, no
    outputs) run the same kernel, so a replayed state is bitwise the one verification computed.
    gates=(a, b, A_log, dt_bias) with g = beta = None: a, b [R, Hv] are in_proj's raw gate columns (strided rows
    fine), A_log, dt_bias [Hv]; the kernel computes g, beta bitwise as gdn_gates would (plain decode: one
    launch fewer).
    CUDA-graph capturable."""
    assert (gates is None) == (g is not None and beta is not None), "pass either g, beta or gates"
    if not (q.is_cuda or (triton is not None and os.environ.get("TRITON_INTERPRET") == "1")):
        if gates is not None:
            g, beta = gdn_gates_ref(*gates)
        o = gated_delta_rule_rows_ref(q, k, v, g, beta, states, slots, rows0, T, kept, write)
        return o if store_o else None
    R, HK, DK = q.shape
    HV, DV = v.shape[1], v.shape[2]
    A_log = dt_bias = slots  # unused placeholders without raw gates
    if gates is not None:
        g, beta, A_log, dt_bias = gates  # the kernel reads a, b through the g, beta pointers
        assert A_log.is_contiguous() and dt_bias.is_contiguous()
    assert q.stride(2) == k.stride(2) == v.stride(2) == 1 and g.stride(1) == beta.stride(1) == 1
    assert states.is_contiguous() and states.dtype == torch.float32
    o = torch.empty(R, HV, DV, dtype=v.dtype, device=v.device) if store_o else v
    N = slots.shape[0]
    BV = 32
    if N:
        _gdn_rows_kernel[(N, HV, triton.cdiv(DV, BV))](
            q, k, v, g, beta, A_log, dt_bias, o, states, slots, rows0 if rows0 is not None else slots,
            kept if kept is not None else slots, T, DK ** -0.5,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), beta.stride(0),
            HK=HK, HV=HV, DK=DK, DV=DV, BK=triton.next_power_of_2(DK), BV=BV, WRITE=write, HAS_KEPT=kept is not None,
            STORE_O=store_o, HAS_ROWS0=rows0 is not None, RAW_GATES=gates is not None, num_warps=4)
    return o if store_o else None


def gated_delta_rule_varlen(q, k, v, g, beta, states, state_slots, cu_seqlens):
    """q, k [T, Hk, Dk], v [T, Hv, Dv], g [T, Hv] fp32 log-decay (<= 0), beta [T, Hv] (post-sigmoid),
    states [S, Hv, Dk, Dv] fp32, state_slots [N] int64, cu_seqlens [N+1] int32 -> o [T, Hv, Dv] in v.dtype.
    Each sequence starts from states[state_slots[n]] and its final state is written back there."""
    if q.is_cuda:
        return gated_delta_rule_varlen_fla(q, k, v, g, beta, states, state_slots, cu_seqlens)
    return gated_delta_rule_varlen_ref(q, k, v, g, beta, states, state_slots, cu_seqlens)


def gated_delta_rule_decode(q, k, v, g, beta, states, state_slots, gates=None):
    """One token per sequence: q, k [N, Hk, Dk], v [N, Hv, Dv] (strided rows fine), g, beta [N, Hv] ->
    o [N, Hv, Dv]. States updated in place. CUDA-graph capturable; states must be contiguous.
    gates=(a, b, A_log, dt_bias) instead of g, beta (None): the raw gates, see gated_delta_rule_rows."""
    if q.is_cuda:
        return gated_delta_rule_rows(q, k, v, g, beta, states, state_slots, None, 1, write=True, gates=gates)
    if gates is not None:
        assert g is None and beta is None, "pass either g, beta or gates"
        g, beta = gdn_gates_ref(*gates)
    return gated_delta_rule_decode_ref(q, k, v, g, beta, states, state_slots)

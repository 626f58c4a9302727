"""Gated delta rule (the Gated DeltaNet recurrence), token-major flat batch with per-slot states.

Per value head, with a_t = exp(g_t) and q, k L2-normalised (eps 1e-6) and q scaled by Dk^-0.5:
    h_t = a_t h_{t-1} + k_t (beta_t (v_t - a_t h_{t-1}^T k_t))^T        h [Dk, Dv], fp32
    o_t = h_t^T q_t
q, k [T, Hk, Dk]; v [T, Hv, Dv] with value head h reading key head h // (Hv // Hk); g, beta [T, Hv];
states [S, Hv, Dk, Dv] fp32 holding every slot (fla's default [K, V] layout, so the slots go to fla as is).

Fast path (CUDA), fla-core 0.6.0 kernels:
- varlen: chunk_gated_delta_rule over the flat batch with cu_seqlens; it takes [N, ...] initial states
  and returns new final states, so we gather states[state_slots] and scatter back.
- decode: fla's GDN fused-recurrent kernel has no state-index option, but its KDA decode kernel (taken
  from vLLM) has one: it reads and writes states[ssm_state_indices[n]] in place. GDN is KDA with the
  same decay on every key channel, so we pass g expanded over Dk; no gather/scatter of the ~3 MB per
  sequence state, and no host sync, so it is CUDA-graph capturable.
Reference (CPU): fp32, per sequence; varlen in the chunked (UT transform) form, decode one step.
"""
import torch


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


def gated_delta_rule_decode_fla(q, k, v, g, beta, states, state_slots):
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd
    N, Hv = g.shape
    gk = g.float()[:, None, :, None].expand(N, 1, Hv, q.shape[-1]).contiguous()  # same decay on every key channel
    # this internal entry point has no input_guard: its pointer math wants contiguous [N, 1, H, D]
    q, k, v, beta = (t[:, None].contiguous() for t in (q, k, v, beta))
    o, _ = fused_recurrent_kda_fwd(q, k, v, gk, beta, initial_state=states, inplace_final_state=True,
                                   ssm_state_indices=state_slots, use_qk_l2norm_in_kernel=True)
    return o[:, 0]


def gated_delta_rule_positions_ref(q, k, v, g, beta, states, slots, kept=None):
    work = states[slots].clone()
    local = torch.arange(q.shape[0], device=q.device)
    o = torch.empty_like(v)
    for t in range(q.shape[1]):
        o[:, t] = gated_delta_rule_decode_ref(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], work, local)
        if kept is not None:
            hit = kept == t
            states[slots[hit]] = work[hit]
    return o


def gated_delta_rule_positions_fla(q, k, v, g, beta, states, slots, kept=None):
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd
    N, T, Hv = g.shape
    if kept is not None:
        # positions after a sequence's kept one become identity steps (decay exp(0) = 1, beta = 0: the state
        # is multiplied by 1 and gets + 0, exactly), so the final state is the one after the kept position
        live = (torch.arange(T, device=q.device)[None] <= kept[:, None])[..., None]
        g, beta = torch.where(live, g, 0.0), torch.where(live, beta, 0.0)
    gk = g.float()[..., None].expand(N, T, Hv, q.shape[-1]).contiguous()
    q, k, v, beta = (t.contiguous() for t in (q, k, v, beta))
    # a copy of the states in batch order (fla's non-slot mode): the kernel then keeps the state in registers
    # over the T positions and writes only the final one (its slot mode writes it after every position)
    o, final = fused_recurrent_kda_fwd(q, k, v, gk, beta, initial_state=states[slots], inplace_final_state=False,
                                       output_final_state=kept is not None, use_qk_l2norm_in_kernel=True)
    if kept is not None:
        states[slots] = final
    return o


def gated_delta_rule_positions(q, k, v, g, beta, states, slots, kept=None):
    """T positions of N sequences in one call (speculative verification and its replay): q, k [N, T, Hk, Dk],
    v [N, T, Hv, Dv], g, beta [N, T, Hv]; sequence n starts from states[slots[n]] -> o [N, T, Hv, Dv]. kept [N]
    (or None: no state is written): states[slots[n]] becomes the state after position kept[n] (outputs past
    it are not meaningful). The decode kernel's arithmetic step by step, so outputs and kept states are bitwise
    those of one-token calls; each state is read once and written at most once (T calls read and write every
    slot T times). CUDA-graph capturable."""
    if q.is_cuda:
        return gated_delta_rule_positions_fla(q, k, v, g, beta, states, slots, kept)
    return gated_delta_rule_positions_ref(q, k, v, g, beta, states, slots, kept)


def gated_delta_rule_varlen(q, k, v, g, beta, states, state_slots, cu_seqlens):
    """q, k [T, Hk, Dk], v [T, Hv, Dv], g [T, Hv] fp32 log-decay (<= 0), beta [T, Hv] (post-sigmoid),
    states [S, Hv, Dk, Dv] fp32, state_slots [N] int64, cu_seqlens [N+1] int32 -> o [T, Hv, Dv] in v.dtype.
    Each sequence starts from states[state_slots[n]] and its final state is written back there."""
    if q.is_cuda:
        return gated_delta_rule_varlen_fla(q, k, v, g, beta, states, state_slots, cu_seqlens)
    return gated_delta_rule_varlen_ref(q, k, v, g, beta, states, state_slots, cu_seqlens)


def gated_delta_rule_decode(q, k, v, g, beta, states, state_slots):
    """One token per sequence: q, k [N, Hk, Dk], v [N, Hv, Dv], g, beta [N, Hv] -> o [N, Hv, Dv].
    States updated in place. CUDA-graph capturable; states must be contiguous."""
    if q.is_cuda:
        return gated_delta_rule_decode_fla(q, k, v, g, beta, states, state_slots)
    return gated_delta_rule_decode_ref(q, k, v, g, beta, states, state_slots)

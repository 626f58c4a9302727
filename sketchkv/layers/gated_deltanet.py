"""Gated DeltaNet token mixer (Qwen3-Next / Qwen3.5 linear-attention layers) over per-sequence state slots."""
import torch
from torch import nn

from sketchkv.engine.context import get_context
from sketchkv.layers.norms import GatedRMSNorm
from sketchkv.models.fuse import fuse_linears, linear_split
from sketchkv.ops.causal_conv1d import causal_conv1d_decode, causal_conv1d_rows, causal_conv1d_varlen, conv_state_shape
from sketchkv.ops.gated_delta_rule import gated_delta_rule_decode, gated_delta_rule_rows, gated_delta_rule_varlen
from sketchkv.ops.gdn_gates import gdn_gates


class GatedDeltaNet(nn.Module):
    def __init__(self, hidden: int, num_k_heads: int, num_v_heads: int, head_k_dim: int, head_v_dim: int,
                 conv_kernel: int, eps: float, gate_act: str = "silu"):
        super().__init__()
        self.num_k_heads, self.num_v_heads = num_k_heads, num_v_heads
        self.head_k_dim, self.head_v_dim = head_k_dim, head_v_dim
        self.key_dim, self.value_dim = num_k_heads * head_k_dim, num_v_heads * head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.conv_kernel = conv_kernel
        self.in_proj_qkv = nn.Linear(hidden, self.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(hidden, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(hidden, num_v_heads, bias=False)
        self.in_proj_a = nn.Linear(hidden, num_v_heads, bias=False)
        self.conv1d = nn.Module()  # keeps the checkpoint name conv1d.weight [conv_dim, 1, kernel]
        self.conv1d.weight = nn.Parameter(torch.empty(self.conv_dim, 1, conv_kernel))
        self.dt_bias = nn.Parameter(torch.ones(num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(num_v_heads))
        self.norm = GatedRMSNorm(head_v_dim, eps=eps, activation=gate_act)
        self.out_proj = nn.Linear(self.value_dim, hidden, bias=False)
        # Bound by the model runner: one row per sequence slot
        self.conv_state = self.ssm_state = torch.tensor([])
        # Speculative decoding: the verification step's inputs, kept for `replay_verified` (see forward_verify):
        # [rows, conv_dim] pre- and post-conv rows, [rows, Hv] gates; allocated by the runner (allocate_verify)
        self.verify_x = self.verify_y = self.verify_g = self.verify_beta = torch.tensor([])
        self._kept = None          # an eager step's own tensors when it has more rows than the buffers
        self.snapshots: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self.in_proj = None  # fused [qkv; z; b; a] weight, see models/fuse.py

    def fuse_projections(self) -> None:
        self.in_proj = fuse_linears([self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a])

    def allocate_verify(self, rows: int, dtype, device) -> None:
        """Buffers for the inputs of verification steps of up to `rows` rows (the verification graphs' bound);
        larger (eager) steps keep their own tensors until the commit."""
        self.verify_x = torch.zeros(rows, self.conv_dim, dtype=dtype, device=device)
        self.verify_y = torch.zeros(rows, self.conv_dim, dtype=dtype, device=device)
        self.verify_g = torch.zeros(rows, self.num_v_heads, dtype=torch.float32, device=device)
        self.verify_beta = torch.zeros(rows, self.num_v_heads, dtype=dtype, device=device)

    def verify_buffer_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.verify_x, self.verify_y, self.verify_g, self.verify_beta))

    def state_shapes(self) -> tuple[tuple, tuple]:
        """Per-slot (conv, recurrent) state shapes; the recurrent state is kept in fp32."""
        return conv_state_shape(self.conv_dim, self.conv_kernel), \
            (self.num_v_heads, self.head_k_dim, self.head_v_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ctx = get_context()
        T = x.shape[0]
        if self.in_proj is not None:
            qkv, z, b, a = linear_split(x, self.in_proj,
                                        [self.conv_dim, self.value_dim, self.num_v_heads, self.num_v_heads])
        else:
            qkv, z, b, a = self.in_proj_qkv(x), self.in_proj_z(x), self.in_proj_b(x), self.in_proj_a(x)
        w = self.conv1d.weight.squeeze(1)
        if ctx.verify is not None:
            g, beta = gdn_gates(a, b, self.A_log, self.dt_bias)
            return self.out_proj(self.forward_verify(qkv, z, g, beta, w, ctx).reshape(T, self.value_dim))
        if ctx.is_decode:
            qkv = causal_conv1d_decode(qkv, w, None, self.conv_state, ctx.state_slots)
        else:  # fla's varlen conv takes dense rows (the decode kernels read the strided in_proj output)
            qkv = causal_conv1d_varlen(qkv.contiguous(), w, None, self.conv_state, ctx.state_slots, ctx.cu_seqlens_q)
        q, k, v = torch.split(qkv, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.reshape(T, self.num_k_heads, self.head_k_dim)
        k = k.reshape(T, self.num_k_heads, self.head_k_dim)
        v = v.reshape(T, self.num_v_heads, self.head_v_dim)
        if ctx.is_decode:  # the recurrence computes the gates from a, b itself (no gdn_gates launch)
            o = gated_delta_rule_decode(q, k, v, None, None, self.ssm_state, ctx.state_slots,
                                        gates=(a, b, self.A_log, self.dt_bias))
        else:
            g, beta = gdn_gates(a, b, self.A_log, self.dt_bias)
            o = gated_delta_rule_varlen(q, k, v, g, beta, self.ssm_state, ctx.state_slots, ctx.cu_seqlens_q)
        o = self._gated_norm(o, z)
        return self.out_proj(o.reshape(T, self.value_dim))

    def forward_verify(self, qkv, z, g, beta, w, ctx) -> torch.Tensor:
        """A step with draft tokens. Decoding sequences advance through their positions (the decode kernels,
        as plain decoding) without touching their slots, which keep the state from before the
        step; the step's inputs (pre- and post-conv rows, gates) are kept, and `replay_verified` then advances
        each sequence's slot through its accepted positions from them: the same arithmetic on the same inputs,
        so the state is bitwise the one the verification computed, and no per-position states are stored
        (they cost n x the state per sequence: 1.08 GB per agent for the 27B shape at n = 7). Other sequences
        (prompt chunks) run varlen in place, as usual. -> gated output [T * Hv, Dv]."""
        vr, T = ctx.verify, qkv.shape[0]
        seq_slots = vr.steps[0][1]          # every decoding sequence has a row at position 0
        if vr.regular:  # [N, Q] rows: the conv and the recurrence over all positions, one kernel each, no writes
            Q = vr.regular
            y = causal_conv1d_rows(qkv, w, None, self.conv_state, seq_slots, None, Q)   # rows n * Q + t
            self._keep(qkv, y, g, beta)
            o = gated_delta_rule_rows(*self._qkv_heads(y), g, beta, self.ssm_state, seq_slots, None, Q)
            return self._gated_norm(o, z)
        qkv = qkv.contiguous()
        conv_work = self.conv_state[seq_slots]      # transient copy (the recurrent state is read in place)
        y = torch.empty_like(qkv)
        if vr.other_rows is not None:
            y[vr.other_rows] = causal_conv1d_varlen(qkv[vr.other_rows], w, None, self.conv_state, vr.other_slots,
                                                    vr.other_cu)
        ssm_work = self.ssm_state[seq_slots]
        for rows, _, local in vr.steps:
            y[rows] = causal_conv1d_decode(qkv[rows], w, None, conv_work, local)
        self._keep(qkv, y, g, beta)
        q, k, v = torch.split(y, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.reshape(T, self.num_k_heads, self.head_k_dim)
        k = k.reshape(T, self.num_k_heads, self.head_k_dim)
        v = v.reshape(T, self.num_v_heads, self.head_v_dim)
        o = torch.empty_like(v)
        if vr.other_rows is not None:
            r = vr.other_rows
            o[r] = gated_delta_rule_varlen(q[r], k[r], v[r], g[r], beta[r], self.ssm_state, vr.other_slots, vr.other_cu)
        for rows, _, local in vr.steps:
            o[rows] = gated_delta_rule_decode(q[rows], k[rows], v[rows], g[rows], beta[rows], ssm_work, local)
        return self._gated_norm(o, z)

    def _gated_norm(self, o: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """o [T, Hv, Dv], z [T, value_dim] (a strided split of in_proj's output: read in place, no copy)
        -> the norm's output [T, Hv, Dv]."""
        return self.norm(o.reshape(z.shape[0], self.num_v_heads, self.head_v_dim),
                         z.unflatten(-1, (self.num_v_heads, self.head_v_dim)))

    def _keep(self, x, y, g, beta) -> None:
        T = x.shape[0]
        if T <= self.verify_x.shape[0]:
            for buf, t in zip((self.verify_x, self.verify_y, self.verify_g, self.verify_beta), (x, y, g, beta)):
                buf[:T].copy_(t)
        else:  # an eager step larger than the graphs' bound
            assert not (x.is_cuda and torch.cuda.is_current_stream_capturing())
            self._kept = (x, y, g, beta)

    def replay_verified(self, rows0: torch.Tensor, slots: torch.Tensor, accepted: torch.Tensor, positions: int,
                        total_rows: int, scratch_slot: int, snapshots: dict[int, list[int]] | None = None) -> None:
        """After a verification step: advance each decoding sequence's slot through its kept positions
        0..accepted[i] (its token + the accepted drafts) from the step's kept inputs. rows0 [B]: the
        sequence's first row in the step; positions: max(accepted) + 1 (or more). Fixed shapes: positions past
        a sequence's last kept one leave its state alone. The verification's two kernels run again over the kept
        inputs, up to each sequence's kept position, and write each slot once (the conv state: its last W
        inputs; the recurrent state after the kept position, bitwise the one verification computed).
        snapshots {t: [slots]}: keep copies of those slots' states after position t (prefix-cache snapshots
        inside the verified run) in `self.snapshots`: the step-by-step replay."""
        x, y, g, beta = (self.verify_x, self.verify_y, self.verify_g, self.verify_beta) \
            if total_rows <= self.verify_x.shape[0] else self._kept
        self._kept = None
        self.snapshots = {}
        if snapshots:
            return self._replay_stepwise(x, g, beta, rows0, slots, accepted, positions, scratch_slot, snapshots)
        w = self.conv1d.weight.squeeze(1)
        causal_conv1d_rows(x, w, None, self.conv_state, slots, rows0, positions, accepted, write=True, store_y=False)
        gated_delta_rule_rows(*self._qkv_heads(y), g, beta, self.ssm_state, slots, rows0, positions, accepted,
                              write=True, store_o=False)

    def _qkv_heads(self, y):
        """Post-conv rows [R, conv_dim] -> q, k [R, Hk, Dk], v [R, Hv, Dv] (views)."""
        q, k, v = torch.split(y, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        heads = (self.num_k_heads, self.head_k_dim)
        return q.unflatten(-1, heads), k.unflatten(-1, heads), v.unflatten(-1, (self.num_v_heads, self.head_v_dim))

    def _replay_stepwise(self, x, g, beta, rows0, slots, accepted, positions, scratch_slot, snapshots) -> None:
        w = self.conv1d.weight.squeeze(1)
        for t in range(positions):
            rows = rows0 + accepted.clamp(max=t)
            s = torch.where(accepted >= t, slots, scratch_slot)
            y = causal_conv1d_decode(x[rows], w, None, self.conv_state, s)
            q, k, v = torch.split(y, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
            n = rows.shape[0]
            gated_delta_rule_decode(q.reshape(n, self.num_k_heads, self.head_k_dim),
                                    k.reshape(n, self.num_k_heads, self.head_k_dim),
                                    v.reshape(n, self.num_v_heads, self.head_v_dim), g[rows], beta[rows],
                                    self.ssm_state, s)
            for slot in snapshots.get(t, []):
                self.snapshots[(slot, t)] = (self.conv_state[slot].clone(), self.ssm_state[slot].clone())

"""Gated DeltaNet token mixer (Qwen3-Next / Qwen3.5 linear-attention layers) over per-sequence state slots."""
import torch
from torch import nn
import torch.nn.functional as F

from sketchkv.engine.context import get_context
from sketchkv.layers.norms import GatedRMSNorm
from sketchkv.models.fuse import fuse_linears
from sketchkv.ops.causal_conv1d import causal_conv1d_decode, causal_conv1d_varlen, conv_state_shape
from sketchkv.ops.gated_delta_rule import gated_delta_rule_decode, gated_delta_rule_varlen
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
        # Speculative decoding: [slot, t] = state after verified position t (t < num drafts), see forward_verify
        self.conv_spec = self.ssm_spec = torch.tensor([])
        self.in_proj = None  # fused [qkv; z; b; a] weight, see models/fuse.py

    def fuse_projections(self) -> None:
        self.in_proj = fuse_linears([self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a])

    def state_shapes(self) -> tuple[tuple, tuple]:
        """Per-slot (conv, recurrent) state shapes; the recurrent state is kept in fp32."""
        return conv_state_shape(self.conv_dim, self.conv_kernel), \
            (self.num_v_heads, self.head_k_dim, self.head_v_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ctx = get_context()
        T = x.shape[0]
        if self.in_proj is not None:
            qkv, z, b, a = F.linear(x, self.in_proj).split(
                [self.conv_dim, self.value_dim, self.num_v_heads, self.num_v_heads], dim=-1)
            qkv = qkv.contiguous()  # the conv kernels take dense rows
        else:
            qkv, z, b, a = self.in_proj_qkv(x), self.in_proj_z(x), self.in_proj_b(x), self.in_proj_a(x)
        g, beta = gdn_gates(a, b, self.A_log, self.dt_bias)
        w = self.conv1d.weight.squeeze(1)
        if ctx.verify is not None:
            return self.out_proj(self.forward_verify(qkv, z, g, beta, w, ctx).reshape(T, self.value_dim))
        if ctx.is_decode:
            qkv = causal_conv1d_decode(qkv, w, None, self.conv_state, ctx.state_slots)
        else:
            qkv = causal_conv1d_varlen(qkv, w, None, self.conv_state, ctx.state_slots, ctx.cu_seqlens_q)
        q, k, v = torch.split(qkv, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.reshape(T, self.num_k_heads, self.head_k_dim)
        k = k.reshape(T, self.num_k_heads, self.head_k_dim)
        v = v.reshape(T, self.num_v_heads, self.head_v_dim)
        if ctx.is_decode:
            o = gated_delta_rule_decode(q, k, v, g, beta, self.ssm_state, ctx.state_slots)
        else:
            o = gated_delta_rule_varlen(q, k, v, g, beta, self.ssm_state, ctx.state_slots, ctx.cu_seqlens_q)
        o = self.norm(o.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))
        return self.out_proj(o.reshape(T, self.value_dim))

    def forward_verify(self, qkv, z, g, beta, w, ctx) -> torch.Tensor:
        """A step with draft tokens: decoding sequences advance one position at a time (decode kernels)
        and the state after each position but their last is kept in conv_spec / ssm_spec [slot, t];
        `commit_verified` then rolls each back to its last accepted position, with no recomputation.
        Other sequences (prompt chunks) run varlen as usual. -> gated output [T * Hv, Dv]."""
        vr, T = ctx.verify, qkv.shape[0]
        y = torch.empty_like(qkv)
        if vr.other_rows is not None:
            y[vr.other_rows] = causal_conv1d_varlen(qkv[vr.other_rows], w, None, self.conv_state, vr.other_slots,
                                                    vr.other_cu)
        for t, (rows, slots) in enumerate(vr.steps):
            y[rows] = causal_conv1d_decode(qkv[rows], w, None, self.conv_state, slots)
            if t + 1 < len(vr.steps):
                keep = vr.steps[t + 1][1]
                self.conv_spec[keep, t] = self.conv_state[keep]
        q, k, v = torch.split(y, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.reshape(T, self.num_k_heads, self.head_k_dim)
        k = k.reshape(T, self.num_k_heads, self.head_k_dim)
        v = v.reshape(T, self.num_v_heads, self.head_v_dim)
        o = torch.empty_like(v)
        if vr.other_rows is not None:
            r = vr.other_rows
            o[r] = gated_delta_rule_varlen(q[r], k[r], v[r], g[r], beta[r], self.ssm_state, vr.other_slots, vr.other_cu)
        for t, (rows, slots) in enumerate(vr.steps):
            o[rows] = gated_delta_rule_decode(q[rows], k[rows], v[rows], g[rows], beta[rows], self.ssm_state, slots)
            if t + 1 < len(vr.steps):
                keep = vr.steps[t + 1][1]
                self.ssm_spec[keep, t] = self.ssm_state[keep]
        return self.norm(o.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))

    def commit_verified(self, slots: torch.Tensor, accepted: torch.Tensor) -> None:
        """Roll slots back to the state after verified position accepted[i] (< that sequence's number of
        drafts; a sequence that accepted all its drafts already holds its final state)."""
        self.conv_state[slots] = self.conv_spec[slots, accepted]
        self.ssm_state[slots] = self.ssm_spec[slots, accepted]

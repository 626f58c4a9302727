"""Feed-forward blocks: SwiGLU MLP and the Qwen3-Next sparse MoE with a gated shared expert."""
import torch
from torch import nn
import torch.nn.functional as F

from sketchkv.models.fuse import fuse_linears, linear
from sketchkv.ops.silu_and_mul import silu_and_mul


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)
        self.gate_up = None  # fused [gate; up] weight, see models/fuse.py

    def fuse_projections(self) -> None:
        self.gate_up = fuse_linears([self.gate_proj, self.up_proj])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up is not None:
            return self.down_proj(silu_and_mul(linear(x, self.gate_up)))
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class SparseMoE(nn.Module):
    """Routed top-k experts (softmax router, optional renormalisation) + sigmoid-gated shared expert.

    Expert weights are stacked [E, 2I, H] / [E, H, I] (transformers 5 layout); the loader also
    accepts per-expert `experts.{e}.{gate,up,down}_proj.weight` tensors and stacks them.
    """

    # batches up to this many tokens (decode, CUDA-graph buckets) take the static path: its cost is one
    # read of every expert's weights, the compute on a few hundred tokens is small beside it
    STATIC_MAX_TOKENS = 256

    def __init__(self, hidden: int, moe_intermediate: int, num_experts: int, top_k: int,
                 norm_topk_prob: bool, shared_intermediate: int):
        super().__init__()
        self.top_k, self.norm_topk_prob, self.num_experts = top_k, norm_topk_prob, num_experts
        self.gate = nn.Linear(hidden, num_experts, bias=False)
        self.experts = nn.Module()
        self.experts.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * moe_intermediate, hidden))
        self.experts.down_proj = nn.Parameter(torch.empty(num_experts, hidden, moe_intermediate))
        self.shared_expert = MLP(hidden, shared_intermediate) if shared_intermediate else None
        self.shared_expert_gate = nn.Linear(hidden, 1, bias=False) if shared_intermediate else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        weights = weights.to(x.dtype)
        if x.shape[0] <= self.STATIC_MAX_TOKENS or torch.cuda.is_current_stream_capturing():
            out = self._all_experts(x, weights, experts)
        else:
            out = self._experts_with_tokens(x, weights, experts)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out

    def _all_experts(self, x, weights, experts):
        """Every expert over every token (batched GEMMs), weighted by the routing (0 for experts not
        picked): fixed shapes and no host sync, so decode steps can be CUDA graphs. Reads each
        expert's weights once per step, which a decode step of a few tokens reads anyway."""
        w = torch.zeros(x.shape[0], self.num_experts, dtype=x.dtype, device=x.device).scatter_(1, experts, weights)
        xe = x.unsqueeze(0).expand(self.num_experts, -1, -1)                    # [E, T, H]
        gate, up = torch.bmm(xe, self.experts.gate_up_proj.transpose(1, 2)).chunk(2, dim=-1)
        y = torch.bmm(F.silu(gate) * up, self.experts.down_proj.transpose(1, 2))   # [E, T, H]
        return torch.einsum("eth,te->th", y, w)

    def _experts_with_tokens(self, x, weights, experts):
        """Loop over the experts that got tokens (the expert list is read on the host): prefill."""
        out = torch.zeros_like(x)
        for e in torch.unique(experts).tolist():
            tok, slot = torch.where(experts == e)
            gate, up = F.linear(x[tok], self.experts.gate_up_proj[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.experts.down_proj[e])
            out.index_add_(0, tok, (y * weights[tok, slot, None]).to(out.dtype))
        return out

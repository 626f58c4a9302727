"""Hyper-connections (qwen4_exp): hc_count residual streams, mixed into one block input by a low-rank
learned mixer, with the block output injected back into every stream with its own weight.

x [T, hc * H] -> normed = GroupRMSNorm(x) (per stream), mix = sigmoid(up(silu(down(normed) / hc))),
input = mean over streams of (mix * normed) [T, H]; injection = 2 sigmoid(inject(normed) / hc) [T, hc];
after the block: x + out[:, None, :] * injection[:, :, None] (flattened). The final mixer has no
injection and yields the hidden state that the LM head reads (there is no separate final norm).
"""
import torch
import torch.nn.functional as F
from torch import nn


class GroupRMSNorm(nn.Module):
    """Zero-centred RMSNorm applied per group of `group` features (one group per residual stream)."""

    def __init__(self, dim: int, group: int, eps: float):
        super().__init__()
        self.group, self.eps = group, eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float().unflatten(-1, (-1, self.group))
        n = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).flatten(-2)
        return (n * (1.0 + self.weight.float())).to(x.dtype)


class HyperConnection(nn.Module):
    def __init__(self, hidden: int, hc: int, lowrank: int, eps: float, inject: bool = True):
        super().__init__()
        self.hc, self.hidden = hc, hidden
        self.hc_norm = GroupRMSNorm(hc * hidden, hidden, eps)
        self.input_mix_weight_down = nn.Linear(hc * hidden, lowrank, bias=False)
        self.input_mix_weight_up = nn.Linear(lowrank, hc * hidden, bias=False)
        self.block_inject_weight = nn.Linear(hc * hidden, hc, bias=False) if inject else None

    def forward(self, x: torch.Tensor):
        """x [T, hc*H] -> block input [T, H] (and injection weights [T, hc] unless this is the final mixer)."""
        normed = self.hc_norm(x)
        mix = F.silu(self.input_mix_weight_down(normed) / self.hc)
        mix = torch.sigmoid(self.input_mix_weight_up(mix)).unflatten(-1, (self.hc, self.hidden))
        h = (mix * normed.unflatten(-1, (self.hc, self.hidden))).mean(dim=-2)
        if self.block_inject_weight is None:
            return h
        return h, 2 * torch.sigmoid(self.block_inject_weight(normed) / self.hc)


def inject(x: torch.Tensor, out: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Add the block output to every stream: x [T, hc*H] + out [T, H] x weights [T, hc]."""
    return x + (out.unsqueeze(-2) * weights.unsqueeze(-1)).flatten(-2)

"""RMSNorm variants used by the supported architectures (one fused kernel each on the GPU)."""
import torch
from torch import nn

from sketchkv.ops.rmsnorm import GATED, PLAIN, ZERO_CENTERED, rms_norm


class RMSNorm(nn.Module):
    """Llama/Qwen3 RMSNorm: x / rms(x) * w, with the cast back to the input dtype *before* the weight."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """-> norm(x); with residual: (norm(x + residual), x + residual), one kernel on the GPU."""
        return rms_norm(x, self.weight, self.eps, PLAIN, residual=residual)


class ZeroCenteredRMSNorm(nn.Module):
    """Qwen3-Next/Qwen3.5 RMSNorm: weight stored as an offset from 1, applied in fp32."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """-> norm(x); with residual: (norm(x + residual), x + residual), one kernel on the GPU."""
        return rms_norm(x, self.weight, self.eps, ZERO_CENTERED, residual=residual)


class GatedRMSNorm(nn.Module):
    """Gated DeltaNet output norm: RMSNorm(x) * w * act(gate), per value head (act: silu, or sigmoid
    for qwen4_exp checkpoints with output_gate_type=sigmoid)."""

    def __init__(self, dim: int, eps: float = 1e-6, activation: str = "silu"):
        super().__init__()
        self.eps, self.activation = eps, activation
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        if self.activation == "silu":
            return rms_norm(x, self.weight, self.eps, GATED, gate)
        y = rms_norm(x, self.weight, self.eps, PLAIN)  # w * norm(x).to(dtype), as transformers rounds
        return (y * torch.sigmoid(gate.float())).to(x.dtype)

"""Merge the projections that read the same input into one GEMM each (gpt-fast style: a transform
of the loaded model, not a flag threaded through it).

At decode time every projection is a memory-bound GEMV plus a launch; q/k/v, gate/up and the four
Gated DeltaNet input projections each become one. The original parameters stay (as views into the
fused weight), so names, checkpoints and fingerprints are unchanged and no memory is duplicated.
"""
import torch
from torch import nn


def fuse_linears(linears: list[nn.Linear]) -> torch.Tensor | None:
    """Concatenate the weights (rows) of bias-free linears; re-point each at its slice."""
    if any(lin.bias is not None for lin in linears):
        return None
    fused = torch.cat([lin.weight.data for lin in linears])
    start = 0
    for lin in linears:
        n = lin.weight.shape[0]
        lin.weight.data = fused[start:start + n]
        start += n
    return fused


def fuse_projections(model: nn.Module) -> None:
    for m in model.modules():
        if hasattr(m, "fuse_projections"):
            m.fuse_projections()

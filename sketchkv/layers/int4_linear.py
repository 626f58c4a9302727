"""A linear layer with int4 weights and activations in the model dtype (W4A16).

Holds the packed tensors of ops/w4a16_gemm.py as parameters (so memory accounting, `.to()` and
`named_parameters` see them, as for bf16 weights): `qweight` int32 [K // 8, N], `scales` and `zeros`
[K // G, N] in the model dtype, w = (q - zeros) * scales. The loader fills them in the canonical layout
(models/quantized.py converts each checkpoint format); `prepare()` then builds the kernel's Int4Weight and the
parameters become its tensors (the kernel's own word order), so no second copy stays. Fused projections
(models/fuse.py) prepare their concatenation instead, and each member's parameters become views of it.
"""
import torch
from torch import nn

from sketchkv.ops.w4a16_gemm import (Int4Weight, canonical_words, default_block_k, dequantize_prepared,
                                     prepare_int4_weight, w4a16_matmul)


def _frozen(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


class Int4Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, group_size: int, bias: bool = False,
                 dtype: torch.dtype | None = None, device=None):
        super().__init__()
        assert in_features % group_size == 0 and group_size % 8 == 0 and out_features % 8 == 0, \
            f"int4 linear {in_features} -> {out_features}, group {group_size}"
        self.in_features, self.out_features, self.group_size = in_features, out_features, group_size
        groups = in_features // group_size
        self.qweight = _frozen(torch.empty(in_features // 8, out_features, dtype=torch.int32, device=device))
        self.scales = _frozen(torch.empty(groups, out_features, dtype=dtype, device=device))
        self.zeros = _frozen(torch.empty(groups, out_features, dtype=dtype, device=device))
        self.bias = _frozen(torch.empty(out_features, dtype=dtype, device=device)) if bias else None
        self.int4: Int4Weight | None = None   # built by prepare()
        self.fused = False                    # a parent runs it as part of a fused projection (models/fuse.py)

    def prepare(self) -> None:
        w = prepare_int4_weight(self.qweight, self.scales, self.zeros, self.group_size)
        self.adopt(w, slice(None))
        self.int4 = w

    def adopt(self, w: Int4Weight, cols: slice) -> None:
        """Point the parameters at output columns `cols` of a prepared weight (freeing the canonical ones)."""
        self.qweight.data, self.scales.data, self.zeros.data = w.packed[:, cols], w.scales[:, cols], w.zeros[:, cols]

    def unprepare(self) -> None:
        """Back to canonical tensors in their own storage (prepare() or a fusion made the parameters views of a
        prepared weight, its words in the kernel's order with the default block_k), to be cut (tensor parallelism)
        and fused or prepared again."""
        own = lambda t: nn.Parameter(t.contiguous().clone(), requires_grad=False)  # noqa: E731
        self.qweight = own(canonical_words(self.qweight.data, default_block_k(self.group_size)))
        self.scales, self.zeros = own(self.scales.data), own(self.zeros.data)
        self.int4, self.fused = None, False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert self.int4 is not None, "Int4Linear used before prepare() or after fusion"
        y = w4a16_matmul(x, self.int4)
        return y if self.bias is None else y + self.bias

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The weight [N, K] as the GEMM sees it (an unfused, prepared layer)."""
        return dequantize_prepared(self.int4, dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, group_size={self.group_size}, " \
               f"bias={self.bias is not None}"


def prepare_int4(model: nn.Module) -> None:
    """Build the kernel weight of every Int4Linear not prepared or fused yet (after loading and fusing)."""
    for m in model.modules():
        if isinstance(m, Int4Linear) and m.int4 is None and not m.fused:
            m.prepare()

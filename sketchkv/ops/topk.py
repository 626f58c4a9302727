"""Deterministic top-k over selection scores: same input, same picks; ties go to the earlier position.

Scores are packed with their position into unique int64 keys (order-preserving float bits in the
high word, inverted position in the low word), so the select has no ties to break arbitrarily.
On CUDA torch.topk runs a radix select over those keys; the reference is a stable sort.
"""
import torch


def _keys(scores: torch.Tensor) -> torch.Tensor:
    bits = scores.float().contiguous().view(torch.int32).to(torch.int64)
    # IEEE float -> monotone integer: flip all bits of negatives, the sign bit of positives.
    ordered = torch.where(bits < 0, ~bits & 0xFFFFFFFF, bits | 0x80000000)
    pos = torch.arange(scores.shape[-1], device=scores.device, dtype=torch.int64)
    return ((ordered - (1 << 31)) << 32) | (0xFFFFFFFF - pos)


def topk_ref(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """scores [..., N] -> (values, positions) of the k best, best first, ties by lower position."""
    order = torch.sort(-scores.float(), dim=-1, stable=True).indices[..., :k]
    return scores.gather(-1, order), order


def topk(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    keys = _keys(scores)
    top = torch.topk(keys, k, dim=-1, sorted=True).values
    pos = 0xFFFFFFFF - (top & 0xFFFFFFFF)
    return scores.gather(-1, pos), pos

"""The collectives a tensor-parallel model calls, on torch.distributed's default group (NCCL on
GPUs, gloo on CPU). Plain functions: with one process (no group) each is the identity."""
import torch
import torch.distributed as dist


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def all_reduce_sum(x: torch.Tensor) -> torch.Tensor:
    """In place; returns x. Row-parallel layers add up their partial outputs with it."""
    if world_size() > 1:
        dist.all_reduce(x)
    return x


def gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """[..., n] on every rank -> [..., world * n], rank r's part at columns r*n:(r+1)*n (vocab shards)."""
    n = world_size()
    if n == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(n)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)


def reduce_selection_scores(scores: torch.Tensor, combine: str) -> torch.Tensor:
    """Per-token selection scores combined over this rank's query heads -> combined over all ranks'
    heads, so one shared pick per layer equals the single-device pick. sum: partial sums add up;
    max: max of maxima; softmax: scores are log(sum of the heads' probabilities), so the total is
    log(sum over ranks of exp(score)) (probabilities are <= the number of heads: exp cannot overflow;
    -inf, masked, stays -inf)."""
    if world_size() == 1:
        return scores
    if combine == "max":
        dist.all_reduce(scores, op=dist.ReduceOp.MAX)
        return scores
    if combine == "softmax":
        p = scores.exp()
        dist.all_reduce(p)
        return p.log()
    dist.all_reduce(scores)
    return scores


def agree_min(n: int) -> int:
    """The smallest of every rank's n (cache sizes measured per device must agree)."""
    if world_size() == 1:
        return n
    t = torch.tensor([n], dtype=torch.int64)
    if dist.get_backend() == "nccl":
        t = t.cuda()
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())

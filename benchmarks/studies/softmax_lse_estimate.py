"""Study: the softmax head combine with each head's normalizer estimated from a sample of the candidates.

The softmax combine ranks token t by log sum_h exp(s_h(t) - lse_h), lse_h = logsumexp of head h's scores over all
candidates. On the GPU that normalizer is why scoring stores every head's score (48 B per token at the 27B shape)
and reads them twice (per-head totals, then the combine): ~140 us per 4 x 250K call against the sum combine's one
pass (H200 run 131). With lse_h estimated first from every STRIDE-th block of BLOCK candidates (a pass over
1 / STRIDE of the sketch), the combine could run in the scoring pass itself (the dot kernel's MODE 3 takes a given
lse), storing nothing. This patches `sketchkv.ops.sketch.softmax_combine` (the CPU path of the sketch and the
oracle) with that estimate, lse_h ~ logsumexp(sampled scores) + log(STRIDE), and runs `sketchkv.eval.sweep` with
the remaining arguments, so its KL can be paired token by token with an unpatched sweep of the same samples.

    python benchmarks/studies/softmax_lse_estimate.py --stride 16 --block 1 -- DATA... --model M --basis 32=B ...
"""
import argparse
import math
import sys

import torch

import sketchkv.ops.sketch as sketch
from sketchkv.eval import sweep


def estimated_softmax_combine(stride: int, block: int):
    def combine(s: torch.Tensor, num_kv_heads: int, shared: bool, sm_scale: float) -> torch.Tensor:
        B, Hq, T = s.shape
        s = s.float() * sm_scale
        sampled = (torch.arange(T, device=s.device) // block) % stride == 0
        lse = torch.logsumexp(s[..., sampled], -1, keepdim=True) + math.log(stride)
        # a head whose sample holds no candidate: the exact normalizer (what a kernel would fall back to)
        exact = torch.logsumexp(s, -1, keepdim=True)
        lse = torch.where(torch.isfinite(lse), lse, exact)
        logp = s - torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
        logp = logp.view(B, num_kv_heads, Hq // num_kv_heads, T)
        return torch.logsumexp(logp.flatten(1, 2), 1, keepdim=True) if shared else torch.logsumexp(logp, 2)
    return combine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stride", type=int, default=16, help="one block of every STRIDE is scored for the normalizer")
    ap.add_argument("--block", type=int, default=1,
                    help="tokens per sampled block (1: strided tokens; 64, whole KV blocks, sampled worse on SmolLM2)")
    args, rest = ap.parse_known_args()
    sketch.softmax_combine = estimated_softmax_combine(args.stride, args.block)
    sweep.main([a for a in rest if a != "--"])


if __name__ == "__main__":
    sys.exit(main())

# int4 tier KL to tier-off on the reference model over held-out code: absmax int4 as today, against the same int4
# format applied after a fixed orthonormal rotation of each head's K and V (normalised Walsh-Hadamard, QuaRot-style:
# spreads outlier dims over the group before the shared scale is taken) and rotated back on dequantisation.
# Usage: python int4_rotation_kl.py N   (N = prompt tokens; 2 documents, 128 teacher-forced tokens each)
import sys

import torch

from sketchkv import LLM
from sketchkv.config import default_model
from study_documents import held_out_documents
import sketchkv.ops.quant_kv as Q

n = int(sys.argv[1])   # prompt tokens; 128 teacher-forced tokens follow each
prompts, conts, opts = held_out_documents(n)
q_orig, dq_orig = Q.quantize_int4, Q.dequantize_int4


def hadamard(d: int) -> torch.Tensor:
    h = torch.ones(1, 1)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / d ** 0.5


def rotated(x, group=None):
    return q_orig(x.float() @ hadamard(x.shape[-1]), group)


def rotated_back(packed, scale):
    y = dq_orig(packed, scale)
    return y @ hadamard(y.shape[-1])   # H is symmetric and orthonormal: its own inverse


ref = LLM(default_model(), **opts).teacher_force(prompts, conts)
for variant in ("absmax", "hadamard"):
    Q.quantize_int4, Q.dequantize_int4 = (q_orig, dq_orig) if variant == "absmax" else (rotated, rotated_back)
    llm = LLM(default_model(), **opts, sparse_host_tier=True, sparse_host_format="int4")
    got = llm.teacher_force(prompts, conts)
    kl = torch.cat([(a.exp() * (a - b)).sum(-1) for a, b in zip(ref, got)]).mean().item()
    top1 = torch.cat([(a.argmax(-1) == b.argmax(-1)).float() for a, b in zip(ref, got)]).mean().item()
    print(f"n={n} {variant:9s} KL {kl:.5f} top-1 {top1:.4f}", flush=True)

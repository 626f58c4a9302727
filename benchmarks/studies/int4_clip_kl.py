# int4 tier KL to tier-off on the reference model over held-out code: absmax scales vs per-group MSE-optimal clipping
import torch, sys
from sketchkv import LLM
from sketchkv.config import default_model
from study_documents import held_out_documents
import sketchkv.ops.quant_kv as Q
n = int(sys.argv[1])   # prompt tokens; 128 teacher-forced tokens follow each
prompts, conts, opts = held_out_documents(n)
orig = Q.quantize_int4

def clipped(x, group=None, cs=(1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7)):
    D = x.shape[-1]; G = group or Q.group_size(D)
    xg = x.float().reshape(*x.shape[:-1], D // G, G)
    amax = xg.abs().amax(-1)
    best_s, best_e = None, None
    for c in cs:
        s = (amax * c / 7.0).clamp(Q._FP16_MIN, Q._FP16_MAX).to(torch.float16)
        q = torch.round(xg / s.float()[..., None]).clamp(-7, 7)
        e = ((q * s.float()[..., None] - xg) ** 2).sum(-1)
        if best_s is None:
            best_s, best_e = s, e
        else:
            m = e < best_e
            best_s, best_e = torch.where(m, s, best_s), torch.where(m, e, best_e)
    q = torch.round(xg / best_s.float()[..., None]).clamp_(-7, 7).to(torch.int16) + 8
    q = q.reshape(*x.shape[:-1], D)
    return (q[..., 0::2] | (q[..., 1::2] << 4)).to(torch.uint8), best_s

ref = LLM(default_model(), **opts).teacher_force(prompts, conts)
for variant in ("absmax", "mse-clip"):
    Q.quantize_int4 = orig if variant == "absmax" else clipped
    llm = LLM(default_model(), **opts, sparse_host_tier=True, sparse_host_format="int4")
    got = llm.teacher_force(prompts, conts)
    kl = torch.cat([(a.exp() * (a - b)).sum(-1) for a, b in zip(ref, got)]).mean().item()
    top1 = torch.cat([(a.argmax(-1) == b.argmax(-1)).float() for a, b in zip(ref, got)]).mean().item()
    print(f"n={n} {variant:9s} KL {kl:.5f} top-1 {top1:.4f}", flush=True)

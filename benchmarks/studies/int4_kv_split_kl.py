# Where the int4 host rows' KL comes from, on the reference model over held-out code: K or V, and whether
# KIVI-style keys (one int4 scale per channel over 64 consecutive tokens, instead of per token over 64 dims; the
# same bytes) would help. Simulated through bf16 host rows whose K / V went through an int4 round trip when
# written (prompt rows are written in prefill chunks; the 128 forced tokens stay in the recent window, so only
# prompt rows are read back from the host). "(real format)": the built formats (int4; k8v4 since session 19).
# And uneven bit splits of the same bytes (K int5 + V int3, K int6 + V int2: scales as int4's, packing not built).
# Usage: python int4_kv_split_kl.py N   (N = prompt tokens; 2 documents, 128 teacher-forced tokens each)
import sys

import torch

from sketchkv import LLM
from sketchkv.config import default_model
from study_documents import held_out_documents
import sketchkv.kv.host_store as HS
import sketchkv.ops.quant_kv as Q

n = int(sys.argv[1])   # prompt tokens; 128 teacher-forced tokens follow each
prompts, conts, opts = held_out_documents(n)
pack_orig = HS.pack_kv


def per_token(x):       # today's int4: per token and head, groups of 64 dims, absmax scale
    return Q.dequantize_int4(*Q.quantize_int4(x)).to(x.dtype)


def per_channel(x, T=64):   # KIVI keys: per channel and head over T consecutive rows (rows past a multiple: alone)
    rows = x.shape[0] // T * T
    if rows == 0:
        return per_token(x)
    xt = x[:rows].float().unflatten(0, (-1, T)).transpose(1, -1)        # [groups, Hkv, D, T]: T along the last dim
    y = Q.dequantize_int4(*Q.quantize_int4(xt, T)).transpose(1, -1).flatten(0, 1)
    return torch.cat([y.to(x.dtype), per_token(x[rows:])])


def bits(b, G=64):        # symmetric b-bit round trip, absmax scale per token over G dims (int4 = bits(4))
    def rt(x):
        qmax = 2 ** (b - 1) - 1
        xg = x.float().unflatten(-1, (-1, G))
        scale = (xg.abs().amax(-1, keepdim=True) / qmax).clamp_min(1e-8).half().float()
        return (torch.round(xg / scale).clamp(-qmax, qmax) * scale).flatten(-2).to(x.dtype)
    return rt


VARIANTS = {"int4 K+V (real format)": "int4", "k8v4 (real format)": "k8v4", "int4 K+V (simulated)": (per_token, per_token),
            "int4 K only": (per_token, lambda v: v), "int4 V only": (lambda k: k, per_token),
            "KIVI K + int4 V": (per_channel, per_token), "KIVI K only": (per_channel, lambda v: v),
            # the same 272 B per token and head (4.25 bits per value with the scales), split unevenly:
            "int5 K + int3 V": (bits(5), bits(3)), "int6 K + int2 V": (bits(6), bits(2)),
            "int8 K + int4 V (400 B)": (bits(8), per_token)}
ref = LLM(default_model(), **opts).teacher_force(prompts, conts)
for name, fns in VARIANTS.items():
    if isinstance(fns, str):     # a built format
        HS.pack_kv, fmt = pack_orig, fns
    else:
        HS.pack_kv, fmt = (lambda k, v, f, fk=fns[0], fv=fns[1]: pack_orig(fk(k), fv(v), f)), "bf16"
    llm = LLM(default_model(), **opts, sparse_host_tier=True, sparse_host_format=fmt)
    got = llm.teacher_force(prompts, conts)
    kl = torch.cat([(a.exp() * (a - b)).sum(-1) for a, b in zip(ref, got)]).mean().item()
    top1 = torch.cat([(a.argmax(-1) == b.argmax(-1)).float() for a, b in zip(ref, got)]).mean().item()
    print(f"n={n} {name:24s} KL {kl:.5f} top-1 {top1:.4f}", flush=True)
HS.pack_kv = pack_orig

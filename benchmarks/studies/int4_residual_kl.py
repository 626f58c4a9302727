# Residual keys: could int4 host keys reach int8's quality at int4's bytes by storing only what the GPU sketch
# does not already hold? Every token's key has a rank-r int4 sketch on the GPU (its coefficients s^ on the frozen
# basis B, after subtracting the basis mean m). A host key record could hold int4(r), r = k - m - B s^, and the
# key be rebuilt as m + B s^ + r^: r is the part outside the basis plus the sketch's own rounding, much smaller
# than k, so int4's error (proportional to the largest |value| of a group) shrinks with it. Same bytes as int4.
# Simulated here through bf16 host rows whose K went through that round trip when written (as in
# ../int4-kv-split-cpu-2026-12-03/); the tier against tier-off sparse decode, KL and top-1 over 128 forced tokens.
# Usage: python int4_residual_kl.py N   (N = prompt tokens; 2 held-out documents)
import sys

import torch

from sketchkv import LLM
from sketchkv.config import default_model
from study_documents import held_out_documents
from sketchkv.kv.basis import KeyBasis
import sketchkv.kv.host_store as HS
import sketchkv.ops.quant_kv as Q
from sketchkv.ops.sketch import dequantize_int4 as sketch_dequant, sketch_keys_ref

n = int(sys.argv[1])   # prompt tokens; 128 teacher-forced tokens follow each
prompts, conts, opts = held_out_documents(n)
basis = KeyBasis.load(f"{default_model()}/key_basis.safetensors")
write_orig = HS.HostKVStore.write


def int4(x):
    return Q.dequantize_int4(*Q.quantize_int4(x)).to(x.dtype)


def residual_keys(quantized_sketch: bool, rank: int | None = None):
    # rank: the first `rank` basis columns only (largest variance first), as a narrower sketch would hold
    def rt(layer, k):
        B, m = basis.bases[layer][..., :rank], basis.means[layer]           # [Hkv, D, r], [Hkv, D]
        if quantized_sketch:                                                 # what the GPU sketch holds
            s = sketch_dequant(*sketch_keys_ref(k, m, B))
        else:
            s = torch.einsum("thd,hdr->thr", k.float() - m, B)
        base = m + torch.einsum("thr,hdr->thd", s, B)
        return (base + Q.dequantize_int4(*Q.quantize_int4(k.float() - base))).to(k.dtype)
    return rt


VARIANTS = {"int4 K+V (real format)": "int4", "k8v4 (real format)": "k8v4",
            "residual int4 K + int4 V": (residual_keys(True), int4),
            "residual int4 K, exact V": (residual_keys(True), lambda v: v),
            "residual over exact coefficients + int4 V": (residual_keys(False), int4),
            # the 27B shape's sketch is rank 64 of 256 dims (D/4); this model's is 32 of 64 (D/2)
            "residual on rank 16 (= D/4) + int4 V": (residual_keys(True, 16), int4)}
ev = basis.meta.get("explained_variance")
print(f"n={n} basis rank {basis.rank} of {basis.bases.shape[2]} dims, explained variance {ev}", flush=True)
ref = LLM(default_model(), **opts).teacher_force(prompts, conts)
for name, fns in VARIANTS.items():
    if isinstance(fns, str):     # a built format
        HS.HostKVStore.write, fmt = write_orig, fns
    else:
        def write(self, layer, slots, k, v, fk=fns[0], fv=fns[1]):
            return write_orig(self, layer, slots, fk(layer, k), fv(v))
        HS.HostKVStore.write, fmt = write, "bf16"
    llm = LLM(default_model(), **opts, sparse_host_tier=True, sparse_host_format=fmt)
    got = llm.teacher_force(prompts, conts)
    kl = torch.cat([(a.exp() * (a - b)).sum(-1) for a, b in zip(ref, got)]).mean().item()
    top1 = torch.cat([(a.argmax(-1) == b.argmax(-1)).float() for a, b in zip(ref, got)]).mean().item()
    print(f"n={n} {name:42s} KL {kl:.5f} top-1 {top1:.4f}", flush=True)
HS.HostKVStore.write = write_orig

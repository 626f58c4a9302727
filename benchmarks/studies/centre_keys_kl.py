# int4 tier KL to tier-off on the reference model over held-out code: keys raw / centred on all dims / on non-rotary dims
import torch, sys
from sketchkv import LLM
from sketchkv.config import default_model
from study_documents import held_out_documents
n = int(sys.argv[1])   # prompt tokens; 128 teacher-forced tokens follow each
prompts, conts, opts = held_out_documents(n)
ref = LLM(default_model(), **opts).teacher_force(prompts, conts)
for variant in ("raw", "all-dims", "non-rotary"):
    llm = LLM(default_model(), **opts, sparse_host_tier=True, sparse_host_format="int4")
    r = llm.engine.runner
    for m in r.tier_layers:
        m.key_offset = None if variant == "raw" else m.mean.clone()
        if variant == "non-rotary":
            m.key_offset[:, :r.model_cfg.rotary_dim] = 0
    got = llm.teacher_force(prompts, conts)
    kl = torch.cat([(a.exp() * (a - b)).sum(-1) for a, b in zip(ref, got)]).mean().item()
    top1 = torch.cat([(a.argmax(-1) == b.argmax(-1)).float() for a, b in zip(ref, got)]).mean().item()
    print(f"n={n} {variant:10s} KL {kl:.5f} top-1 {top1:.4f}", flush=True)

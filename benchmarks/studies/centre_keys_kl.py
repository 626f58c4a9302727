# int4 tier KL to tier-off on the reference model over held-out code: keys raw / centred on all dims / on non-rotary dims
import torch, sys
from sketchkv import LLM
from sketchkv.config import default_model
from sketchkv.eval.common import heldout_token_ids
n, C = int(sys.argv[1]), 128
ids = heldout_token_ids(default_model(), 2 * (n + C))
prompts = [ids[:n], ids[n + C:2 * n + C]]
conts = [ids[n:n + C], ids[2 * n + C:2 * n + 2 * C]]
opts = dict(device="cpu", block_size=16, max_num_seqs=2, max_num_batched_tokens=4096, sparse=True,
            sparse_top_k=max(128, n // 64), sparse_sink_tokens=64, sparse_recent_tokens=256, sparse_dense_threshold=0)
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

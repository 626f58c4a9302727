"""Session-21 debug (not committed): residual keys with bf16 rows on the GPU, by path."""
import gc, os, sys, torch
sys.path.insert(0, "tests")
from conftest import make_checkpoint
from sketchkv import LLM
from sketchkv.kv.fit_basis import fit_basis
import sketchkv.ops.sketch_base as sb
path = "/tmp/dbg/qwen3"
make_checkpoint(path, "qwen3", hidden_size=256, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                num_hidden_layers=3, max_position_embeddings=8192)
g = torch.Generator().manual_seed(5)
open("/tmp/dbg/calib.txt", "w").write("".join(chr(c) for c in torch.randint(32, 127, (20000,), generator=g).tolist()))
fit = LLM(path, device="cuda", enforce_eager=True, max_num_seqs=2, max_model_len=8192, gpu_memory_utilization=0.3)
fit_basis(fit, ["/tmp/dbg/calib.txt"], rank=16, max_tokens=8000, seq_len=2048, out=path + "/key_basis.safetensors")
del fit
gc.collect(); torch.cuda.empty_cache()
g = torch.Generator().manual_seed(6)
prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (6000, 3000, 900)]
conts = [torch.randint(3, 500, (64,), generator=g).tolist() for _ in prompts]
opts = dict(device="cuda", max_num_seqs=4, max_model_len=8192, max_num_batched_tokens=2048, sparse=True,
            sparse_top_k=256, sparse_sink_tokens=64, sparse_recent_tokens=128, sparse_dense_threshold=0,
            gpu_memory_utilization=0.3, sparse_prefill_selection="dense")
T = dict(sparse_host_tier=True, sparse_host_format="bf16")
R = dict(T, sparse_host_residual_keys=True)
cases = [("off", {}), ("bf16", T), ("bf16r", R), ("bf16r eager", dict(R, enforce_eager=True)),
         ("bf16r no-side", dict(R, sparse_admit_stream=False)), ("bf16r torch-tier", dict(R, sparse_tier_kernel="torch")),
         ("bf16r torch-base", R), ("bf16r eager no-side torch-base", dict(R, enforce_eager=True, sparse_admit_stream=False)),
         ("bf16r one-seq", R)]
ref = None
tr = sb.triton
llm = None
for name, kw in cases:
    llm = None
    gc.collect(); torch.cuda.empty_cache()
    sb.triton = None if "torch-base" in name else tr
    ps, cs = (prompts[:1], conts[:1]) if "one-seq" in name else (prompts, conts)
    llm = LLM(path, **opts, **kw)
    got = llm.teacher_force(ps, cs)
    if ref is None:
        ref = got; refd = {len(p): r for p, r in zip(prompts, got)}
        continue
    rr = [refd[len(p)] for p in ps]
    kl = [(a.exp() * (a - b)).sum(-1) for a, b in zip(rr, got)]
    print(f"{name:32s} KL mean {torch.cat(kl).mean().item():.2e} per seq " + " ".join(f"{x.mean().item():.1e}" for x in kl)
          + f"  first-token KL {' '.join(f'{x[0].item():.1e}' for x in kl)}", flush=True)
    del llm

"""GPU check of sparse_read_groups on the bundled reference model: greedy tokens and hot-buffer hits / misses with
the batch's reads in 2 groups (read stream, CUDA graphs) against one group, fp32 and bf16."""
import gc
import sys

import torch

from sketchkv import LLM, SamplingParams

g = torch.Generator().manual_seed(9)
prompts = [torch.randint(3, 4000, (n,), generator=g).tolist() for n in (6000, 4000, 2500, 900)]
sp = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
ok = True
for dtype in sys.argv[1:] or ["float32"]:
    out = {}
    for groups in (1, 2):
        llm = None
        gc.collect()
        torch.cuda.empty_cache()
        llm = LLM(device="cuda", dtype=dtype, max_num_seqs=4, max_model_len=8192, sparse=True, sparse_top_k=256,
                  sparse_sink_tokens=64, sparse_recent_tokens=128, sparse_dense_threshold=0, sparse_host_tier=True,
                  sparse_host_format="int4", sparse_read_groups=groups, gpu_memory_utilization=0.3)
        assert llm.engine.runner.graphs and (llm.engine.runner.tier.read_stream is not None) == (groups > 1)
        toks = [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=sp)]
        s = llm.tier_stats()
        out[groups] = (toks, s.hits, s.misses)
    same = out[1] == out[2]
    ok &= same
    diff = sum(a != b for x, y in zip(out[1][0], out[2][0]) for a, b in zip(x, y))
    print(f"{dtype}: read groups 2 vs 1: tokens {'identical' if same else f'{diff} differ'}; hits {out[1][1]} / "
          f"{out[2][1]}, misses {out[1][2]} / {out[2][2]}", flush=True)
sys.exit(0 if ok else 1)

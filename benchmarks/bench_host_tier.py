"""The host tier in the engine: hit rate, misses and PCIe bytes per decode step over a continuation of
a long prompt, step time, and GPU / host bytes per sequence (measured, and projected to 250K tokens).

    python benchmarks/bench_host_tier.py --model random:qwen3.5-27b --context 131072 --continuation 1024 \
        --formats int4 bf16 --out benchmarks/results/host-tier-27b.json
    python benchmarks/bench_host_tier.py --smoke --out /tmp/host-tier.json      # CPU dry run (tiny model)

A random-weight model with a random key basis exercises the mechanism (picks, misses, traffic) but its
picks are not those of a trained model: run it on the reference model (--model DIR, its fitted basis)
for the hit rate that matters. Prompt: random token ids, or --prompt-file (text, tokenized, repeated
to --context tokens). Per step: hits / misses / PCIe read bytes are deltas of the tier's counters
(one host sync per step, outside the timed region); step time is one engine.step() (CUDA graph).
"""
import argparse
import json
import platform
import statistics
import sys
import time

import torch

sys.path.insert(0, ".")
from sketchkv import LLM, SamplingParams  # noqa: E402
from sketchkv.kv.host_store import HostKVStore  # noqa: E402
from sketchkv.kv.host_tier import hot_row_bytes  # noqa: E402


def projected_bytes(llm: LLM, tokens: int) -> dict:
    """GPU and host bytes of one sequence of `tokens` tokens under this engine's tier settings
    (the same terms as HostTier.seq_stats)."""
    r, c, sp = llm.engine.runner, llm.engine.model_config, llm.engine.cfg.sparse
    L = len(r.tier_layers)
    sketch = r.sketch_bytes_per_block / r.block_size * tokens
    slot_map = 4 * L * tokens
    resident = (sp.sink_tokens + sp.recent_tokens) * L * 2 * c.num_kv_heads * c.head_dim * r.dtype.itemsize
    hot = max(64, int(sp.hot_fraction * tokens + 0.999)) * hot_row_bytes(L, c.num_kv_heads, c.head_dim, sp.host_format)
    host = tokens * HostKVStore.bytes_per_token(L, c.num_kv_heads, c.head_dim, sp.host_format)
    return {"tokens": tokens, "gpu_bytes": int(sketch + slot_map + resident + hot), "gpu_sketch": int(sketch),
            "gpu_slot_map": slot_map, "gpu_resident": resident, "gpu_hot": hot, "host_bytes": host}


def prompt_ids(llm: LLM, n: int, path: str | None, seed: int) -> list[int]:
    if path:
        ids = llm.tokenizer.encode(open(path).read())
        return (ids * (n // max(1, len(ids)) + 1))[:n]
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, min(llm.engine.model_config.vocab_size, 32000), (n,), generator=g).tolist()


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run(args, fmt: str) -> dict:
    llm = LLM(args.model, sparse=True, sparse_host_tier=True, sparse_host_format=fmt, sparse_top_k=args.top_k,
              sparse_sink_tokens=args.sinks, sparse_recent_tokens=args.recent, sparse_hot_fraction=args.hot_fraction,
              max_num_seqs=1, max_model_len=args.context + args.continuation + 64,
              max_num_batched_tokens=args.prefill_chunk, **({"device": "cpu"} if args.smoke else {}))
    eng = llm.engine
    tier = eng.runner.tier
    ids = prompt_ids(llm, args.context, args.prompt_file, args.seed)
    seq = eng.add_request(ids, SamplingParams(temperature=0, max_tokens=args.continuation, ignore_eos=True))
    sync()
    t0 = time.perf_counter()
    while not seq.output_token_ids:
        eng.step()
    sync()
    prefill_s = time.perf_counter() - t0
    before = tier.stats()
    seq_stats = eng.tier_sequence_stats()[seq.request_id]
    steps, prev = [], before
    while eng.has_unfinished:
        sync()
        t = time.perf_counter()
        eng.step()
        sync()
        dt = time.perf_counter() - t
        s = tier.stats()
        steps.append({"ms": dt * 1e3, "hits": s.hits - prev.hits, "misses": s.misses - prev.misses,
                      "pcie_read_bytes": s.pcie_read_bytes - prev.pcie_read_bytes,
                      "pcie_write_bytes": s.pcie_write_bytes - prev.pcie_write_bytes})
        prev = s
    after = tier.stats()

    def summary(key, rows):
        v = [r[key] for r in rows]
        return {"mean": statistics.fmean(v), "p50": statistics.median(v), "max": max(v)} if v else {}
    tail = steps[len(steps) // 2:]
    hits, misses = after.hits - before.hits, after.misses - before.misses
    out = {
        "format": fmt, "context": args.context, "continuation": len(steps), "prefill_s": prefill_s,
        "hit_rate": hits / max(1, hits + misses),
        "hit_rate_second_half": sum(r["hits"] for r in tail) / max(1, sum(r["hits"] + r["misses"] for r in tail)),
        "per_step": {k: summary(k, steps) for k in ("ms", "hits", "misses", "pcie_read_bytes", "pcie_write_bytes")},
        "per_step_second_half": {k: summary(k, tail) for k in ("ms", "misses", "pcie_read_bytes")},
        "seq_gpu_bytes": seq_stats.gpu_bytes, "seq_host_bytes": seq_stats.host_bytes,
        "tier_gpu_bytes_allocated": after.gpu_bytes, "tier_host_bytes_allocated": after.host_bytes,
        "hot_rows": tier.hot._parts[seq.tier_pid][1] if seq.tier_pid >= 0 else None,
        "projected_250k": projected_bytes(llm, 250_000),
        "steps": steps if args.all_steps else None,
    }
    del llm, eng, tier
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="random:qwen3.5-27b")
    p.add_argument("--context", type=int, default=131072)
    p.add_argument("--continuation", type=int, default=1024)
    p.add_argument("--formats", nargs="+", default=["int4"])
    p.add_argument("--top-k", type=int, default=2048)
    p.add_argument("--sinks", type=int, default=64)
    p.add_argument("--recent", type=int, default=1024)
    p.add_argument("--hot-fraction", type=float, default=0.025)
    p.add_argument("--prefill-chunk", type=int, default=16384)
    p.add_argument("--prompt-file", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--all-steps", action="store_true", help="keep every step's numbers in the output")
    p.add_argument("--smoke", action="store_true", help="CPU dry run: tiny model, short context")
    p.add_argument("--out", default="benchmarks/results/host-tier.json")
    args = p.parse_args()
    if args.smoke:
        args.model, args.context, args.continuation = "random:tiny-hybrid", 2048, 16
        args.top_k, args.sinks, args.recent, args.prefill_chunk = 128, 16, 64, 1024
    dev = torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu"
    res = {"device": dev, "command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d"),
           "runs": [run(args, fmt) for fmt in args.formats]}
    for r in res["runs"]:
        ps = r["per_step"]
        print(f"{r['format']}: hit rate {r['hit_rate']:.3f} (2nd half {r['hit_rate_second_half']:.3f}), "
              f"misses/step {ps['misses']['mean']:.0f}, PCIe read/step {ps['pcie_read_bytes']['mean'] / 2**20:.2f} MiB, "
              f"step {ps['ms']['p50']:.2f} ms; per seq GPU {r['seq_gpu_bytes'] / 2**30:.3f} GiB, host "
              f"{r['seq_host_bytes'] / 2**30:.3f} GiB; at 250K: GPU {r['projected_250k']['gpu_bytes'] / 2**30:.3f} GiB, "
              f"host {r['projected_250k']['host_bytes'] / 2**30:.3f} GiB")
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()

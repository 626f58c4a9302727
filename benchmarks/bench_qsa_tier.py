"""qwen4_exp over the host KV tier (issue 10's H200 goal): decode tok/s as the context grows, PCIe bytes per
step, GPU bytes per token per indexed layer, and prefill tok/s.

    python benchmarks/bench_qsa_tier.py --out benchmarks/results/qsa-tier-h200.json     # H200 (defaults)
    python benchmarks/bench_qsa_tier.py --smoke --out /tmp/qsa-tier.json               # CPU dry run

Model: random:qwen4-exp-h200 (sketchkv/models/presets.py): 48 layers = 36 Gated DeltaNet + 12 QSA layers
of 16 query / 2 KV heads x 256, indexer 16 heads x 128, budget 2048, compress ratio 4 (the seed's
attention side exactly), hidden 2048, MoE 64 experts top-8 x 512 + shared expert, 4 hyper-connection
streams, PLE on 4 layers; ~14.7B params, 27.3 GiB bf16, random weights (its picks are arbitrary, the
traffic is the real model's). Host rows bf16 by default: the seed's arithmetic (2 KV heads x 256 x K+V
x 2 B = 2 KiB per token per layer; 2048 picks x 12 layers = 48 MiB per token) is in bf16.

Decode points (--contexts): one sequence per point. Contexts of 512K-1M cannot be prefilled for real in a
10-minute device call, so, as `sketchkv bench agents --fill random` does, all but the last --tail tokens
get random K/V written through the tier's own write, random QSA block keys and random GDN state
(sketchkv.bench.agents.fill_random); the --tail tokens are prefilled for real (reading the prefix back
from the tier), then --warmup steps, then --decode-tokens timed steps (one engine.step() each, synced).
PCIe bytes per step: deltas of the tier's counters (rows read on hot-buffer misses + rows written).
Flatness: max / min decode tok/s - 1 over the points at or beyond the budget point (context >= budget).

Prefill (--prefill-context, 0 = skip): a fresh sequence of that many tokens prefilled for real in
--prefill-chunk token chunks (QSA prefill: past 8K tokens each query reads only its picks; later
chunks read their prefix back from the tier).
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
from sketchkv.bench.agents import fill_random  # noqa: E402

SEED_MIB_PER_TOKEN = 48  # seed 002: 2048 picks x 2 heads x 256 x (K, V) x 2 B x 12 layers


def parse_tokens(s: str) -> int:
    """8K -> 8192, 1M -> 1048576, 1000 -> 1000."""
    mult = {"K": 2**10, "M": 2**20}.get(s[-1].upper(), 1)
    return int(float(s[:-1] if mult > 1 else s) * mult)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def decode_point(llm: LLM, L: int, args, gen) -> dict:
    eng, r = llm.engine, llm.engine.runner
    bs, tier = r.block_size, r.tier
    filled = max(0, (L - max(args.tail, bs)) // bs * bs)
    steps = 1 + args.warmup + args.decode_tokens + (1 + args.breakdown if args.breakdown else 0)
    ids = torch.randint(3, min(eng.model_config.vocab_size, 32000), (L,), generator=torch.Generator().manual_seed(L))
    seq = eng.add_request(ids.tolist(), SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True))
    sync()
    t0 = time.perf_counter()
    if filled:
        fill_random(eng, seq, filled, gen)
    sync()
    fill_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    while not seq.output_token_ids:  # the real tail prefill
        eng.step()
    sync()
    tail_s = time.perf_counter() - t0
    for _ in range(args.warmup):
        eng.step()
    rows, prev = [], tier.stats()
    for _ in range(args.decode_tokens):
        sync()
        t = time.perf_counter()
        eng.step()
        sync()
        dt = time.perf_counter() - t
        s = tier.stats()  # one host sync, outside the timed region
        rows.append({"ms": dt * 1e3, "hits": s.hits - prev.hits, "misses": s.misses - prev.misses,
                     "pcie_read": s.pcie_read_bytes - prev.pcie_read_bytes,
                     "pcie_write": s.pcie_write_bytes - prev.pcie_write_bytes})
        prev = s
    bd = None
    if args.breakdown and torch.cuda.is_available():  # kernel time per step by kind: what grows with context
        from sketchkv.bench.breakdown import profile_kernels
        bd = profile_kernels(eng, args.breakdown, top=15)
    while eng.has_unfinished:
        eng.step()
    _, counts = r.tier_layers[0].last_indices
    med = {k: statistics.median(x[k] for x in rows) for k in rows[0]}
    hits, misses = sum(x["hits"] for x in rows), sum(x["misses"] for x in rows)
    return {"context": L, "filled": filled, "fill_s": fill_s, "tail_prefill_s": tail_s,
            "step_ms_p50": med["ms"], "decode_tok_s": 1e3 / med["ms"],
            "pcie_read_bytes_per_step": med["pcie_read"], "pcie_write_bytes_per_step": med["pcie_write"],
            "hit_rate": hits / max(1, hits + misses), "selected_per_layer": int(counts.max()),
            "steps": len(rows), **({"breakdown": bd} if bd else {})}


def prefill_point(llm: LLM, L: int) -> dict:
    eng = llm.engine
    ids = torch.randint(3, min(eng.model_config.vocab_size, 32000), (L,), generator=torch.Generator().manual_seed(7))
    seq = eng.add_request(ids.tolist(), SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    before = eng.runner.tier.stats()
    sync()
    t0 = time.perf_counter()
    while not seq.output_token_ids:
        eng.step()
    sync()
    s = time.perf_counter() - t0
    while eng.has_unfinished:
        eng.step()
    after = eng.runner.tier.stats()
    return {"context": L, "seconds": s, "tok_s": L / s, "pcie_read_bytes": after.pcie_read_bytes - before.pcie_read_bytes,
            "pcie_write_bytes": after.pcie_write_bytes - before.pcie_write_bytes}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="random:qwen4-exp-h200")
    p.add_argument("--contexts", nargs="+", default=["8K", "32K", "128K", "512K", "1M"])
    p.add_argument("--tail", type=int, default=64, help="tokens per point prefilled for real (>= one block)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--decode-tokens", type=int, default=16)
    p.add_argument("--prefill-context", default="128K", help="0: no prefill point")
    p.add_argument("--prefill-chunk", type=int, default=8192)
    p.add_argument("--host-format", default="bf16")
    p.add_argument("--hot-fraction", type=float, default=0.025)
    p.add_argument("--sinks", type=int, default=64)
    p.add_argument("--recent", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--breakdown", type=int, default=0, metavar="STEPS",
                   help="GPU: profile STEPS more graph steps per point (kernel ms per step by kind, in the JSON)")
    p.add_argument("--smoke", action="store_true", help="CPU dry run: tiny qwen4_exp, short contexts")
    p.add_argument("--out", default="benchmarks/results/qsa-tier.json")
    args = p.parse_args()
    device = {}
    if args.smoke:
        if args.contexts == p.get_default("contexts"):
            args.contexts = ["256", "1K", "2K"]
        args.model, args.prefill_context, args.prefill_chunk = "random:tiny-qwen4-exp", "1K", 256
        args.decode_tokens, args.warmup, args.sinks, args.recent = 4, 1, 16, 64
        device = dict(device="cpu", dtype="float32")
    contexts = [parse_tokens(c) for c in args.contexts]
    prefill_L = parse_tokens(args.prefill_context)
    extra = 1 + args.warmup + args.decode_tokens + 64
    max_len = max(contexts + [prefill_L]) + extra
    t0 = time.perf_counter()
    llm = LLM(args.model, sparse_host_tier=True, sparse_host_format=args.host_format, sparse_hot_fraction=args.hot_fraction,
              sparse_sink_tokens=args.sinks, sparse_recent_tokens=args.recent, max_num_seqs=1,
              max_model_len=max_len, max_num_batched_tokens=args.prefill_chunk, enable_prefix_caching=False, **device)
    load_s = time.perf_counter() - t0
    r, c = llm.engine.runner, llm.engine.model_config
    # the engine caps max_model_len at max_position_embeddings (1M = 2^20 for qwen4-exp-h200): a point at the
    # cap runs at the largest context that leaves room for its decode steps (the JSON has the exact number)
    limit = llm.engine.cfg.scheduler.max_model_len - extra
    contexts, prefill_L = [min(L, limit) for L in contexts], min(prefill_L, limit)
    qsa = r.qsa_layers[0]
    gen = torch.Generator(device=llm.engine.device).manual_seed(args.seed)
    print(f"engine built in {load_s:.0f} s, {len(r.graphs)} CUDA graphs: {r.tier!r}", flush=True)
    points = []
    for L in contexts:   # printed as they come: a run cut short still says what it measured
        points.append(decode_point(llm, L, args, gen))
        x = points[-1]
        print(f"context {x['context']}: {x['decode_tok_s']:.1f} tok/s, {x['step_ms_p50']:.2f} ms/step", flush=True)
        if "breakdown" in x:
            b = x["breakdown"]
            print(f"  kernels {b['total_ms']:.2f} ms/step ({b['kernels_per_step']:.0f}): "
                  + ", ".join(f"{k} {v:.2f}" for k, v in list(b["ms"].items())[:8]), flush=True)
    prefill = prefill_point(llm, prefill_L) if prefill_L else None
    beyond = [x["decode_tok_s"] for x in points if x["context"] >= qsa.budget]
    flat = max(beyond) / min(beyond) - 1 if beyond else None
    mem = llm.qsa_memory()
    dev = torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu"
    shape = {k: getattr(c, k) for k in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim",
                                        "num_experts", "num_experts_per_tok", "indexer_n_heads", "indexer_head_dim",
                                        "indexer_budget", "indexer_compress_ratio") if hasattr(c, k)}
    shape["qsa_layers"] = len(r.qsa_layers)
    shape["params"] = sum(p.numel() for p in r.model.parameters())
    res = {"device": dev, "command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d"), "model": args.model,
           "shape": shape, "host_format": args.host_format, "hot_fraction": args.hot_fraction, "load_s": load_s, "cuda_graphs": len(r.graphs),
           "tier": repr(r.tier), "qsa_memory": mem, "points": points, "prefill": prefill,
           "flatness_beyond_budget": flat, "flat_within_10pct": flat is not None and flat <= 0.10,
           "seed_pcie_mib_per_token": SEED_MIB_PER_TOKEN}
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    print(f"{args.model}: {shape['params'] / 1e9:.2f}B params, {len(r.qsa_layers)} QSA layers; GPU bytes per token "
          f"per QSA layer {mem['gpu_bytes_per_token']:.1f} (block keys {mem['index_bytes_per_token']:.0f} + slot map "
          f"{mem['slot_map_bytes_per_token']:.0f}); {r.tier!r}")
    if prefill:
        print(f"prefill {prefill['context']} tokens: {prefill['tok_s']:.0f} tok/s ({prefill['seconds']:.1f} s)")
    print(f"{'context':>9} | {'tok/s':>7} | {'step ms':>7} | {'PCIe read MiB/step':>18} | {'hit rate':>8} | "
          f"{'picks/layer':>11} | fill s")
    for x in points:
        print(f"{x['context']:>9} | {x['decode_tok_s']:>7.1f} | {x['step_ms_p50']:>7.2f} | "
              f"{x['pcie_read_bytes_per_step'] / 2**20:>18.2f} | {x['hit_rate']:>8.3f} | {x['selected_per_layer']:>11} | "
              f"{x['fill_s']:.1f}")
    print(f"flat beyond the budget point: {flat:+.1%} max/min (goal <= 10%); seed: {SEED_MIB_PER_TOKEN} MiB PCIe "
          f"per token without a hot buffer" if flat is not None else "no point beyond the budget")


if __name__ == "__main__":
    main()

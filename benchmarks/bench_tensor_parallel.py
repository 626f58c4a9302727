"""Tensor parallelism on N GPUs (default 2): greedy parity with one GPU, decode step time of the
27B shape at TP=1 and TP=N against its floor, and the cost of sharing one sparse pick per layer
across ranks (all-reduce of the per-token scores vs all-gather of each rank's top-k picks).

    python benchmarks/bench_tensor_parallel.py --out benchmarks/results/tensor-parallel-2xh200.json

(a) parity: the reference model, bf16 and fp32, a batch of held-out prompts of different lengths,
    greedy; tokens of TP=N vs TP=1 (fp32 should match exactly; bf16 may drift after a near-tie,
    since the row-parallel sums round in another order).
(b) decode: random-weight `--preset` (qwen3.5-27b), CUDA graphs, KV and GDN state filled with random
    values for `--context` tokens (what a prefill would leave), `--steps` timed engine steps.
    Floor per rank = (weights + KV + GDN state bytes of one shard) / HBM bandwidth + the step's
    all-reduces (2 per layer + the embedding) at the measured latency of one [B, hidden] all-reduce.
(c) selection: one shared pick per layer needs either the per-token scores all-reduced ([B, L] fp32)
    or each rank's top-k (positions + scores, [B, k]) all-gathered and merged; both timed in a CUDA
    graph (what a decode step would see). The engine all-reduces the scores: exact for every
    head_combine (the top-k merge is exact only for max).
`--device cpu --tiny` runs all three on CPU with gloo and tiny shapes (a check of the script).
"""
import argparse
import gc
import json
import math
import os
import sys
import time

for var, value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(var, value)  # NVLink multicast stays off (shared machines, see the device notes)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, ".")
from sketchkv import LLM, SamplingParams  # noqa: E402
from sketchkv.bench.floor import hbm_bandwidth  # noqa: E402
from sketchkv.config import default_model  # noqa: E402
from bench_engine import fill_sequences, time_decode  # noqa: E402  (benchmarks/, the script's directory)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def release() -> None:
    """After the caller dropped its last reference to an LLM: its GPU memory back before the next one."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ---- (a) parity ------------------------------------------------------------------------------------
def parity(args) -> list[dict]:
    from sketchkv.eval.common import heldout_token_ids
    lengths = [40, 300, 1200] if not args.tiny else [20, 70]
    ids = heldout_token_ids(default_model(), sum(lengths))
    prompts, start = [], 0
    for n in lengths:
        prompts.append(ids[start:start + n])
        start += n
    sp = SamplingParams(temperature=0, max_tokens=args.parity_tokens, ignore_eos=True)
    rows = []
    for dtype in args.parity_dtypes:
        outs = {}
        for tp in (1, args.tp):
            llm = LLM(default_model(), device=args.device, dtype=dtype, tensor_parallel_size=tp, max_num_seqs=4,
                      max_model_len=4096, num_kv_blocks=256)  # a fixed cache: no warm-up prefill to size it
            outs[tp] = [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=sp)]
            llm.shutdown()
            del llm
            release()
        for p, a, b in zip(prompts, outs[1], outs[args.tp]):
            same = sum(x == y for x, y in zip(a, b))
            first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
            rows.append(dict(part="parity", dtype=dtype, prompt_tokens=len(p), tokens=len(a), matching=same,
                             identical=a == b, first_divergence=first))
            print(f"parity {dtype} prompt {len(p)}: {same}/{len(a)} tokens equal, first divergence {first}", flush=True)
    return rows


# ---- (b) decode step time --------------------------------------------------------------------------
def shard_bytes(llm: LLM, batch: int, ctx: int) -> dict:
    """Bytes one rank reads in a decode step: its weights (the embedding only for B rows), its KV
    heads, its GDN state (read + write)."""
    r = llm.engine.runner
    c = r.model_cfg  # per-rank heads
    model = llm.engine.model
    weights = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if not n.startswith("mtp."))
    emb = model.model.embed_tokens.weight
    if emb.data_ptr() != model.lm_head.weight.data_ptr():
        weights -= emb.numel() * emb.element_size()
    kv = batch * ctx * 2 * len(r.attn_layers) * c.num_kv_heads * c.head_dim * r.dtype.itemsize
    state = batch * r.state_bytes_per_seq * 2
    return {"weights": weights, "kv": kv, "gdn_state": state, "total": weights + kv + state}


def decode(args, bw: float, allreduce_us: dict) -> list[dict]:
    rows = []
    max_b = max(args.batches)
    blocks = max_b * math.ceil((args.context + 512) / 64) + 1
    for tp in (1, args.tp):
        llm = LLM(f"random:{args.preset}", device=args.device, tensor_parallel_size=tp, max_num_seqs=max_b,
                  max_model_len=args.context + 512, num_kv_blocks=blocks, enable_prefix_caching=False)
        layers = len(llm.engine.model.model.layers)
        for b in args.batches:
            # random caches on rank 0 (the workers keep what their allocation held: a step's time does not
            # depend on the values)
            fill_sequences(llm, b, args.context, args.steps + 3)
            dt = time_decode(llm, args.steps)
            fb = shard_bytes(llm, b, args.context)
            comm = (2 * layers + 1) * allreduce_us.get(b, 0.0) / 1e6 if tp > 1 else 0.0
            floor = fb["total"] / bw + comm
            rows.append(dict(part="decode", preset=args.preset, tp=tp, batch=b, context=args.context, step_ms=dt * 1e3,
                             tok_s=b / dt, floor_ms=floor * 1e3, allreduce_ms=comm * 1e3, floor_fraction=floor / dt,
                             bytes_per_rank=fb))
            print(f"decode TP={tp} b={b} ctx={args.context}: {dt * 1e3:.2f} ms/step, floor {floor * 1e3:.2f} ms "
                  f"(all-reduces {comm * 1e3:.2f} ms), {floor / dt:.0%} of floor", flush=True)
            for rid in list(llm.engine.requests):
                llm.engine.abort(rid)
        llm.shutdown()
        del llm
        release()
    return rows


# ---- (c) collectives, run on every rank through TensorParallelRunner.on_every_rank -------------------
def _timed(fn, device: str, iters: int) -> float:
    """Seconds per call of fn: captured `iters` times in a CUDA graph and replayed (no launch
    overhead, as inside the decode graph); eager on a CPU."""
    fn()
    sync(device)
    if device == "cuda":
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(iters):
                fn()
        graph.replay()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(5):
            graph.replay()
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / (5 * iters)
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters


def time_collectives(runner, batches, hidden: int, contexts, top_k: int, iters: int) -> list[dict]:
    dev, dtype = runner.device, runner.dtype
    kind, world = dev.type, dist.get_world_size()
    rows = []
    for b in batches:
        x = torch.randn(b, hidden, dtype=dtype, device=dev)
        rows.append(dict(part="collective", op="all_reduce hidden", batch=b, shape=[b, hidden],
                         us=_timed(lambda: dist.all_reduce(x), kind, iters) * 1e6))
        for ctx in contexts:
            scores = torch.randn(b, ctx, device=dev)
            k = min(top_k, ctx)
            picks = torch.randint(0, ctx, (b, 2 * k), dtype=torch.int32, device=dev)  # positions + score bits
            gathered = torch.empty(world * b, 2 * k, dtype=torch.int32, device=dev)
            rows.append(dict(part="collective", op="all_reduce scores", batch=b, context=ctx, shape=[b, ctx],
                             us=_timed(lambda: dist.all_reduce(scores), kind, iters) * 1e6))
            rows.append(dict(part="collective", op="all_gather picks", batch=b, context=ctx, shape=[b, 2 * k],
                             us=_timed(lambda: dist.all_gather_into_tensor(gathered, picks), kind, iters) * 1e6))
            # the merge after the gather: top-k over world * k candidates
            merge = lambda: torch.topk(torch.randn(b, world * k, device=dev), k, dim=-1)  # noqa: E731
            rows.append(dict(part="collective", op="merge picks (top-k of world*k)", batch=b, context=ctx,
                             us=_timed(merge, kind, iters) * 1e6))
    return rows


def collectives(args) -> list[dict]:
    from sketchkv.models.presets import PRESETS
    # any TP engine gives us the ranks; a tiny one with no graphs and a fixed cache starts in seconds
    llm = LLM("random:tiny-hybrid", device=args.device, dtype="bfloat16" if args.device == "cuda" else "float32",
              tensor_parallel_size=args.tp, max_num_seqs=max(args.batches), num_kv_blocks=16, enforce_eager=True)
    rows = llm.engine.runner.on_every_rank(time_collectives, args.batches, PRESETS[args.preset]["hidden_size"],
                                           args.collective_contexts, args.top_k, args.collective_iters)
    llm.shutdown()
    del llm
    release()
    for r in rows:
        print(f"{r['op']:32s} b={r['batch']} ctx={r.get('context', '-')}: {r['us']:.1f} us", flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--preset", default="qwen3.5-27b")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--context", type=int, default=8192)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--parity-dtypes", nargs="+", default=["bfloat16", "float32"])
    p.add_argument("--parity-tokens", type=int, default=64)
    p.add_argument("--collective-contexts", type=int, nargs="+", default=[8192, 131072, 262144])
    p.add_argument("--collective-iters", type=int, default=50)
    p.add_argument("--top-k", type=int, default=2048)
    p.add_argument("--skip", nargs="*", default=[], choices=["parity", "decode", "collectives"])
    p.add_argument("--tiny", action="store_true", help="CPU check of the script: tiny shapes")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.tiny:
        args.preset, args.context, args.batches, args.steps = "tiny-hybrid", 256, [1, 2], 4
        args.parity_dtypes, args.parity_tokens, args.collective_contexts = ["float32"], 8, [1024]
        args.collective_iters, args.top_k = 5, 64
    rows = []

    def save() -> None:  # after every part: a run cut short keeps what it measured
        if args.out:
            os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
            devices = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
            with open(args.out, "w") as f:
                json.dump({"args": vars(args), "devices": devices, "rows": rows}, f, indent=1)

    # collectives first: the decode floor uses their all-reduce latency; parity last (fla autotunes
    # the reference model's prefill shapes on first use)
    if "collectives" not in args.skip:
        rows += collectives(args)
        save()
    allreduce_us = {r["batch"]: r["us"] for r in rows if r.get("op") == "all_reduce hidden"}
    if "decode" not in args.skip:
        bw = hbm_bandwidth(torch.device(args.device), 0.25 if args.tiny else 4)
        rows += decode(args, bw, allreduce_us)
        save()
    if "parity" not in args.skip:
        rows += parity(args)
        save()
    print("\n| part | config | result |\n|---|---|---|")
    for r in rows:
        if r["part"] == "parity":
            print(f"| parity | {r['dtype']}, prompt {r['prompt_tokens']} | {r['matching']}/{r['tokens']} tokens equal |")
        elif r["part"] == "decode":
            print(f"| decode | TP={r['tp']} b={r['batch']} ctx={r['context']} | {r['step_ms']:.2f} ms/step, "
                  f"floor {r['floor_ms']:.2f} ms ({r['floor_fraction']:.0%}) |")
        else:
            print(f"| collective | {r['op']} b={r['batch']} ctx={r.get('context', '-')} | {r['us']:.1f} us |")
    if args.out:
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

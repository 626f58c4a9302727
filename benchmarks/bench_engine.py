"""Decode and prefill speed of sketchkv on a random-weight model, side by side with Hugging Face
transformers on the same config, against the bytes-moved floor measured in the same run.

    python benchmarks/bench_engine.py --preset qwen3.5-27b --contexts 8192 131072 --batches 1 8 \
        --out benchmarks/results/engine-27b.json

Decode at context L: each sequence's KV cache and Gated DeltaNet state are filled with random
values for L tokens (what a prefill would leave; the speed of a decode step depends only on the
bytes it reads), then N steps are timed. Prefill is timed for real (TTFT of one L-token prompt).
"""
import argparse
import gc
import json
import math
import platform
import sys
import time

import torch

sys.path.insert(0, ".")
from sketchkv import LLM, SamplingParams  # noqa: E402
from sketchkv.engine.sequence import Status  # noqa: E402
from sketchkv.bench.floor import hbm_bandwidth  # noqa: E402


DEV = "cuda" if torch.cuda.is_available() else "cpu"


def sync():
    if DEV == "cuda":
        torch.cuda.synchronize()


def decode_floor_bytes(llm: LLM, batch: int, ctx: int) -> dict:
    r, c = llm.engine.runner, llm.engine.model_config
    weights = sum(p.numel() * p.element_size() for n, p in llm.engine.model.named_parameters()
                  if not n.startswith("mtp."))
    # the embedding table is read for B rows only; the lm_head in full
    emb = llm.engine.model.model.embed_tokens.weight
    if emb.data_ptr() != llm.engine.model.lm_head.weight.data_ptr():
        weights -= emb.numel() * emb.element_size()
    kv = batch * ctx * 2 * len(r.attn_layers) * c.num_kv_heads * c.head_dim * r.dtype.itemsize
    state = batch * r.state_bytes_per_seq * 2  # read + write
    return {"weights": weights, "kv": kv, "gdn_state": state, "total": weights + kv + state}


def sparse_floor_bytes(llm: LLM, batch: int, ctx: int, dense: dict) -> dict:
    """Sparse step: the sketch of every token plus only the selected K/V rows, instead of all K/V."""
    r, c, sp = llm.engine.runner, llm.engine.model_config, llm.engine.cfg.sparse
    layers = len(r.sparse_layers)
    sketch = batch * ctx * layers * c.num_kv_heads * (r.sparse_layers[0].rank // 2 + 2)
    rows = min(ctx, sp.sink_tokens + sp.top_k + sp.recent_tokens)
    kv = batch * rows * 2 * layers * c.num_kv_heads * c.head_dim * r.dtype.itemsize
    out = dict(dense, kv=kv, sketch=sketch)
    out["total"] = out["weights"] + kv + sketch + out["gdn_state"]
    return out


def fill_sequences(llm: LLM, batch: int, ctx: int, steps: int):
    """Put `batch` sequences of `ctx` tokens in the running set with random KV and GDN state."""
    eng = llm.engine
    g = torch.Generator(device=DEV).manual_seed(0)
    for m in eng.runner.attn_layers:
        m.k_cache.normal_(0, 1, generator=g)
        m.v_cache.normal_(0, 1, generator=g)
    for m in eng.runner.sparse_layers:
        m.sketch.random_(0, 256, generator=g)
        m.sketch_scale.uniform_(0.01, 0.1, generator=g)
    for m in eng.runner.gdn_layers:
        m.conv_state.normal_(0, 0.1, generator=g)
        m.ssm_state.normal_(0, 0.01, generator=g)
    seqs = []
    for b in range(batch):
        ids = torch.randint(0, eng.model_config.vocab_size, (ctx,)).tolist()
        seq = eng.add_request(ids, SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True))
        eng.scheduler.waiting.remove(seq)
        seq.state_slot = eng.scheduler.free_slots.popleft()
        eng.blocks.grow(seq, ctx)
        seq.num_cached = ctx - 1
        seq.status = Status.RUNNING
        eng.scheduler.running.append(seq)
        seqs.append(seq)
    return seqs


def time_decode(llm: LLM, steps: int) -> float:
    eng = llm.engine
    for _ in range(3):
        eng.step()
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        eng.step()
    sync()
    return (time.perf_counter() - t0) / steps


def decode_during_prefill(args) -> dict:
    """`--interference-batch` agents decode at the first `--contexts` length while one more prompt of
    `--interference-prefill` tokens prefills (chunks of `--prefill-chunk` tokens, which the scheduler shares
    with the decode rows every step): their tok/s before and during that prefill, whether any step left
    them without a token (issue 6: their decode must not stop), and the prefill's own tok/s under load."""
    b, ctx, pre = args.interference_batch, args.contexts[0], args.interference_prefill
    # the agents decode through the whole prefill: with decode/prefill time sharing that is about
    # share / (1 - share) x the prefill's time in decode-only steps (~20 ms each on the 27B shape)
    max_tokens = args.steps + 20000
    blocks = b * math.ceil((ctx + max_tokens) / 64) + math.ceil(pre / 64) + 2 * args.prefill_chunk // 64 + 8
    llm = LLM(f"random:{args.preset}", max_num_seqs=b + 2, max_model_len=max(ctx + max_tokens, pre + 64),
              num_kv_blocks=blocks, max_num_batched_tokens=args.prefill_chunk)
    eng, vocab = llm.engine, llm.engine.model_config.vocab_size
    sched = eng.cfg.scheduler
    sp1 = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    seqs = fill_sequences(llm, b, ctx, max_tokens)
    # compile / autotune the chunk shapes of a prefill beside decoding agents first (another prompt: no
    # prefix-cache hit later)
    warm = eng.add_request(torch.randint(0, vocab, (2 * sched.max_prefill_tokens_while_decoding,)).tolist(), sp1)
    while warm.first_token_time is None:
        eng.step()
    before = b / time_decode(llm, args.steps)
    new = eng.add_request(torch.randint(0, vocab, (pre,)).tolist(), sp1)
    sync()
    t0 = time.perf_counter()
    got, starved, steps, gaps = [len(s.output_token_ids) for s in seqs], 0, 0, []
    start = sum(got)
    while new.first_token_time is None:
        t = time.perf_counter()
        eng.step()
        sync()
        gaps.append(time.perf_counter() - t)   # every agent gets a token per step: the gap between tokens
        steps += 1
        now = [len(s.output_token_ids) for s in seqs]
        starved += any(n == g for n, g in zip(now, got))
        got = now
    sync()
    dt = time.perf_counter() - t0
    tokens = sum(got) - start
    row = dict(engine="sketchkv", phase="decode_during_prefill", context=ctx, batch=b, prefill_context=pre,
               chunk=args.prefill_chunk, steps=steps, seconds=dt, tok_s=tokens / dt, tok_s_before=before,
               prefill_tok_s=pre / dt, steps_without_decode_token=starved, max_token_gap_s=max(gaps),
               median_token_gap_s=sorted(gaps)[len(gaps) // 2],
               decode_time_share=llm.engine.cfg.scheduler.decode_time_share)
    print(f"sketchkv {b} agents at ctx={ctx} while a {pre}-token prompt prefills (chunk {args.prefill_chunk}): "
          f"{tokens / dt:.1f} tok/s (before: {before:.1f}); prefill {pre / dt:.0f} tok/s over {steps} steps; "
          f"steps without a token for some agent: {starved}; gap between tokens max {max(gaps):.2f} s, "
          f"median {sorted(gaps)[len(gaps) // 2] * 1e3:.0f} ms (decode_time_share "
          f"{llm.engine.cfg.scheduler.decode_time_share})", flush=True)
    clear(llm)
    del llm
    gc.collect()
    return row


def clear(llm: LLM) -> None:
    eng = llm.engine
    for rid in list(eng.requests):
        eng.abort(rid)


def bench_sketchkv(args, bw: float) -> list[dict]:
    rows = []
    max_b = max(args.batches)
    # room for the decode points (batch x context) and for the longest prefill (one sequence)
    max_ctx = max(args.contexts + list(args.prefill_contexts or []))
    blocks = max(max_b * math.ceil((max(args.contexts) + 512) / 64), math.ceil((max_ctx + 512) / 64)) + 1
    modes = args.modes or (["dense"] + (["dense-eager"] if args.eager_too else []) + (["sparse"] if args.sparse else []))
    for name in modes:
        mode, eager = name.split("-")[0], name == "dense-eager"
        combine = {"sparse-sum": {"sparse_head_combine": "sum"}, "sparse-max": {"sparse_head_combine": "max"},
                   "sparse-softmax": {"sparse_head_combine": "softmax"}}.get(name, {})  # sparse: the default
        llm = LLM(f"random:{args.preset}", max_num_seqs=max_b, max_model_len=max_ctx + 512,
                  num_kv_blocks=blocks, max_num_batched_tokens=args.prefill_chunk, enforce_eager=eager,
                  sparse=mode == "sparse", **combine)
        for ctx in args.contexts:
            for b in args.batches:
                fill_sequences(llm, b, ctx, args.steps + 8)
                dt = time_decode(llm, args.steps)
                fb = decode_floor_bytes(llm, b, ctx)
                floor = fb["total"] / bw
                if mode == "sparse":
                    fb = sparse_floor_bytes(llm, b, ctx, fb)
                    floor = fb["total"] / bw
                rows.append(dict(engine="sketchkv", mode=name.removesuffix("-eager"), graphs=not eager, phase="decode", context=ctx, batch=b,
                                 step_ms=dt * 1e3, tok_s=b / dt, floor_ms=floor * 1e3,
                                 floor_fraction=floor / dt, bytes=fb))
                print(f"sketchkv {name} {'eager' if eager else 'graphs'} decode ctx={ctx} b={b}: {dt*1e3:.2f} ms/step "
                      f"{b/dt:.1f} tok/s, floor {floor*1e3:.2f} ms ({floor/dt:.0%})", flush=True)
                clear(llm)
        if not eager and mode == "dense":
            for ctx in args.prefill_contexts:
                ids = torch.randint(0, llm.engine.model_config.vocab_size, (ctx,)).tolist()
                sp = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
                # warm every chunk shape (fla autotunes on first use) with other tokens: no prefix-cache hit
                warm = torch.randint(0, llm.engine.model_config.vocab_size, (min(ctx, 2 * args.prefill_chunk),))
                llm.generate(prompt_token_ids=[warm.tolist()], sampling_params=sp)
                sync()
                t0 = time.perf_counter()
                llm.generate(prompt_token_ids=[ids], sampling_params=sp)
                sync()
                dt = time.perf_counter() - t0
                rows.append(dict(engine="sketchkv", phase="prefill", context=ctx, batch=1, seconds=dt,
                                 tok_s=ctx / dt, chunk=args.prefill_chunk))
                print(f"sketchkv prefill ctx={ctx}: {dt:.2f} s, {ctx/dt:.0f} tok/s", flush=True)
            if args.profile_prefill:
                rows.append(profile_prefill(llm, args.profile_prefill))
        del llm
        gc.collect()
        if DEV == "cuda":
            torch.cuda.empty_cache()
    return rows


KERNEL_GROUPS = (("attention", ("flash", "fmha", "attention", "sdpa", "cudnn")),
                 ("gated deltanet (fla)", ("chunk", "fused_recurrent", "gated_delta", "solve_tril", "l2norm",
                                           "causal_conv", "wy_fast", "cumsum")),
                 ("gemm", ("gemm", "cutlass", "sm90_xmma", "nvjet", "cublas")),
                 ("copy / gather", ("copy", "gather", "index", "cat", "scatter")),
                 ("norm / activation / rope", ("norm", "silu", "sigmoid", "softplus", "exp", "rotary", "mul", "add")))


def profile_prefill(llm: LLM, ctx: int) -> dict:
    """CUDA time of one ctx-token prefill by kernel group (torch.profiler): where prefill time goes."""
    from torch.profiler import ProfilerActivity, profile
    ids = torch.randint(0, llm.engine.model_config.vocab_size, (ctx,)).tolist()
    sp = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    llm.generate(prompt_token_ids=[ids], sampling_params=sp)  # warm: every chunk shape compiled/tuned
    clear(llm)
    sync()
    t0 = time.perf_counter()
    cuda = DEV == "cuda"  # on CPU: self time of the aten ops instead of kernels
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        llm.generate(prompt_token_ids=[ids], sampling_params=sp)
        sync()
    wall = time.perf_counter() - t0
    kernels = [(e.key, e.device_time_total if cuda else e.self_cpu_time_total) for e in prof.key_averages()]
    kernels = [(n, us) for n, us in kernels if us > 0]
    groups: dict[str, float] = {}
    for name, us in kernels:
        low = name.lower()
        g = next((g for g, keys in KERNEL_GROUPS if any(k in low for k in keys)), "other")
        groups[g] = groups.get(g, 0.0) + us / 1e6
    top = sorted(kernels, key=lambda x: -x[1])[:20]
    print(f"prefill profile ctx={ctx}: wall {wall:.2f} s (profiled), GPU kernel time by group:", flush=True)
    for g, sec in sorted(groups.items(), key=lambda x: -x[1]):
        print(f"  {g:28s} {sec:7.2f} s", flush=True)
    for name, us in top:
        print(f"  {us / 1e6:7.3f} s  {name[:110]}", flush=True)
    return dict(engine="sketchkv", phase="prefill_profile", context=ctx, batch=1, seconds=wall, tok_s=ctx / wall,
                groups_s=groups, top_kernels=[dict(name=n, seconds=us / 1e6) for n, us in top])


def bench_hf(args, bw: float) -> list[dict]:
    import transformers
    from sketchkv.models.presets import PRESETS
    raw = dict(PRESETS[args.preset])
    raw.pop("model_type")
    cfg = transformers.Qwen3_5TextConfig(**raw)
    with torch.device("cuda"):
        torch.set_default_dtype(torch.bfloat16)
        model = transformers.Qwen3_5ForCausalLM(cfg).eval()
        torch.set_default_dtype(torch.float32)
    rows = []
    with torch.inference_mode():  # warm: fla autotunes each new shape on first use (minutes), not ours to time
        model(torch.randint(0, cfg.vocab_size, (1, 4096), device="cuda"), use_cache=False, logits_to_keep=1)
    for ctx in args.hf_contexts:
        for b in args.hf_batches:
            ids = torch.randint(0, cfg.vocab_size, (b, ctx), device="cuda")
            try:
                with torch.inference_mode():
                    sync(); t0 = time.perf_counter()
                    out = model(ids, use_cache=True, logits_to_keep=1)
                    sync(); pre = time.perf_counter() - t0
                    cache, tok = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
                    times = []
                    for i in range(args.hf_steps + 2):
                        sync(); t0 = time.perf_counter()
                        out = model(tok, past_key_values=cache, use_cache=True)
                        tok = out.logits[:, -1].argmax(-1, keepdim=True)
                        sync()
                        if i >= 2:
                            times.append(time.perf_counter() - t0)
                dt = sorted(times)[len(times) // 2]
                rows.append(dict(engine="transformers", phase="decode", context=ctx, batch=b, step_ms=dt * 1e3,
                                 tok_s=b / dt))
                rows.append(dict(engine="transformers", phase="prefill", context=ctx, batch=b, seconds=pre,
                                 tok_s=b * ctx / pre))
                print(f"transformers ctx={ctx} b={b}: decode {dt*1e3:.1f} ms/step {b/dt:.1f} tok/s; "
                      f"prefill {b*ctx/pre:.0f} tok/s", flush=True)
                del out, cache
            except torch.OutOfMemoryError:
                rows.append(dict(engine="transformers", context=ctx, batch=b, error="out of memory"))
                print(f"transformers ctx={ctx} b={b}: OOM", flush=True)
            gc.collect(); torch.cuda.empty_cache()
    del model
    gc.collect(); torch.cuda.empty_cache()
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="qwen3.5-27b")
    p.add_argument("--contexts", type=int, nargs="+", default=[8192, 131072])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--prefill-contexts", type=int, nargs="*", default=[8192, 131072])
    p.add_argument("--prefill-chunk", type=int, default=16384)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--eager-too", action="store_true", help="also time decode without CUDA graphs")
    p.add_argument("--sparse", action="store_true", help="also time sparse decode (random basis: speed only)")
    p.add_argument("--modes", nargs="+",
                   choices=["dense", "dense-eager", "sparse", "sparse-sum", "sparse-max", "sparse-softmax"],
                   help="engine modes to time (overrides --sparse/--eager-too); sparse = the engine's default head "
                        "combine, sparse-sum / -max / -softmax a given one; prefill runs with dense")
    p.add_argument("--hf", action="store_true", help="also run transformers on the same config")
    p.add_argument("--hf-contexts", type=int, nargs="*", default=[8192, 131072])
    p.add_argument("--hf-batches", type=int, nargs="*", default=[1])
    p.add_argument("--hf-steps", type=int, default=8)
    p.add_argument("--profile-prefill", type=int, default=0, metavar="CTX",
                   help="also profile one CTX-token prefill (torch.profiler) and print GPU time by kernel group")
    p.add_argument("--interference-prefill", type=int, default=0, metavar="TOKENS",
                   help="also time --interference-batch agents decoding (at the first --contexts length) while "
                        "one TOKENS-token prompt prefills alongside (issue 6: 4 agents while a fifth prefills 250K)")
    p.add_argument("--interference-batch", type=int, default=4)
    p.add_argument("--out", default="benchmarks/results/engine.json")
    args = p.parse_args()
    bw = hbm_bandwidth(torch.device(DEV), 4.0 if DEV == "cuda" else 0.03)
    print(f"HBM copy bandwidth: {bw/1e12:.2f} TB/s", flush=True)
    result = dict(date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), device=torch.cuda.get_device_name() if DEV == "cuda" else platform.processor(),
                  torch=torch.__version__, python=platform.python_version(), command=" ".join(sys.argv),
                  hbm_copy_bytes_per_s=bw, rows=[])
    try:
        result["rows"] += bench_sketchkv(args, bw)
        if args.interference_prefill:
            result["rows"].append(decode_during_prefill(args))
        if args.hf:
            result["rows"] += bench_hf(args, bw)
    finally:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    print("\n| engine | phase | context | batch | ms/step or s | tok/s | floor fraction |")
    print("|---|---|---|---|---|---|---|")
    for r in result["rows"]:
        if "error" in r:
            print(f"| {r['engine']} | - | {r['context']} | {r['batch']} | {r['error']} | | |")
            continue
        t = f"{r['step_ms']:.2f} ms" if r["phase"] == "decode" else f"{r['seconds']:.2f} s"
        ff = f"{r['floor_fraction']:.0%}" if "floor_fraction" in r else ""
        tag = r["engine"] + (f" {r['mode']}" if "mode" in r else "") + ("" if r.get("graphs", True) else " (eager)")
        print(f"| {tag} | {r['phase']} | {r['context']} | {r['batch']} | {t} | {r['tok_s']:.1f} | {ff} |")


if __name__ == "__main__":
    main()

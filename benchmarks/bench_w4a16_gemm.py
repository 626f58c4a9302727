"""W4A16 GEMM (sketchkv/ops/w4a16_gemm.py) at the Qwen3.5-27B shapes against bf16 cuBLAS and the int4 floor.

    python benchmarks/bench_w4a16_gemm.py --out benchmarks/results/DATE-w4a16           # timings
    python benchmarks/bench_w4a16_gemm.py --sweep --out benchmarks/results/DATE-w4a16   # + config search

For each shape (K -> N, calls per 27B decode step) and rows M: bf16 cuBLAS (F.linear), our w4a16_matmul (the
dispatch: Triton kernel below LARGE_M rows, dequantize + cuBLAS from there), the Triton kernel forced at
M >= LARGE_M and dequantize + cuBLAS at every M >= LARGE_M. Each is timed as a CUDA-graph replay over enough weight
copies that none stays in L2, after its output is checked against x @ (bf16 of the dequantized weight).
Int4 floor = max(int4 bytes (packed + scales + zeros) / HBM copy bandwidth, 2 M N K / bf16 tensor-core rate),
both measured in the run. Prints us, GB/s of the method's weight bytes, % of the int4 floor, and per-step sums
(gate_up x64, down x64, gdn_in x48, attn_qkv x16, o/out x64; no lm_head) against bf16.

    python benchmarks/bench_w4a16_gemm.py --gemv --out benchmarks/results/DATE-w4a16-gemv  # small-M kernels

--gemv: per shape and M in --gemv-rows (default 1 2 4 8): the tensor-core kernel (config_for / TUNED), the
small-M CUDA-core kernel (_gemv_kernel) in a few GemvConfigs, and the load-only probe (the same grid and
word loads, xor-reduced) with the best one's config; % of the int4 floor for the kernels, % of the words'
copy-bandwidth time for the probe. Prints a GEMV_TUNED table and the M up to which the CUDA-core kernel
wins on every shape (GEMV_MAX_M). Writes gemv.json / gemv.md into --out.

--sweep: per (shape, M in --sweep-rows) a coordinate search over kernel configs (BLOCK_M,
then BLOCK_N x SPLIT_K, then num_warps x num_stages), starting from config_for's rule (each stage keeps the
best so far; ~27 configs per point; each stage's new kernels are compiled first by --workers processes into
Triton's disk cache); prints the best
and a TUNED table to paste into sketchkv/ops/w4a16_gemm.py. Writes results.json / results.md (and sweep.json)
into --out.
"""
import argparse
import itertools
import json
import os
import sys
from dataclasses import replace

import torch
import torch.nn.functional as F

sys.path.insert(0, ".")
from benchmarks.bench_sparse_ops import graphed  # noqa: E402
from benchmarks.bench_weight_gemms import replay_us  # noqa: E402
from sketchkv.bench.floor import hbm_bandwidth  # noqa: E402
from sketchkv.ops import w4a16_gemm as wg  # noqa: E402
from sketchkv.ops.w4a16_gemm import (Config, GemvConfig, config_for, dequantize_int4_t, gemv_config_for,  # noqa: E402
                                     pack_int4, prepare_int4_weight)

SHAPES = {"gate_up": (5120, 34816, 64), "down": (17408, 5120, 64), "gdn_in": (5120, 16384, 48),
          "attn_qkv": (5120, 14336, 16), "o/out": (6144, 5120, 64)}  # name: (K, N, calls per 27B step)


def time_us(fn, copies: list, inner: int) -> float:
    """Per call of fn(copy), replayed from a CUDA graph of `inner` passes over all copies (outputs not kept)."""
    def run():
        for _ in range(inner):
            for c in copies:
                fn(c)
    return replay_us(graphed(run)) / (inner * len(copies))


def tensor_core_rate() -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    return 2 * 8192 ** 3 / (time_us(lambda b: a @ b, [a], 5) * 1e-6)


def make_weight(K, N, G, block_k=None, seed=0):
    """Random asymmetric int4 weight (canonical tensors -> Int4Weight) and its bf16 dequantization [N, K]."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randint(0, 16, (N, K), generator=g, device="cuda", dtype=torch.uint8)
    s = ((torch.rand(K // G, N, generator=g, device="cuda") + 0.5) / (4 * K ** 0.5)).bfloat16()
    z = torch.randint(0, 16, (K // G, N), generator=g, device="cuda").bfloat16()
    w = prepare_int4_weight(pack_int4(q), s, z, G, block_k)
    return w, wg.dequantize_int4(pack_int4(q), s, z, G)


def int4_bytes(w) -> int:
    return sum(t.numel() * t.element_size() for t in (w.packed, w.scales, w.zeros))


def check(out, ref, what: str) -> None:
    """Against x @ bf16(W): one bf16 output rounding (2^-9 relative) and, for the fused kernel, the weights'
    bf16 rounding that it skips (~2^-9 / sqrt(3) per term: ~1.1e-3 of the output's rms, one sigma); a wrong
    nibble, group or split is off by O(rms)."""
    err = (out.float() - ref).abs()
    bound = ref.abs() * 2 ** -7 + 1e-2 * ref.pow(2).mean().sqrt()
    assert (err <= bound).all(), f"{what}: wrong output, max excess {(err - bound).max().item():.3g}"


def clones(w, n):
    return [w] + [replace(w, packed=w.packed.clone(), scales=w.scales.clone(), zeros=w.zeros.clone(),
                          counters=w.counters.clone()) for _ in range(n - 1)]


def candidates(M, N, K, block_k, stage, base: Config):
    """Stage 0: BLOCK_M; 1: BLOCK_N x SPLIT_K; 2: num_warps x num_stages."""
    bm = wg.m_bucket(M)
    tiles = lambda bn: -(-N // bn) * -(-M // base.block_m)  # noqa: E731
    if stage == 0:
        for block_m in (8, 16) if bm <= 8 else (bm,):
            yield replace(base, block_m=block_m)
    elif stage == 1:
        for bn, sk in itertools.product((64, 128, 256), (1, 2, 4, 8, 16)):
            if tiles(bn) * sk <= 16 * 132 and K // block_k >= 2 * sk:
                yield replace(base, block_n=bn, split_k=sk)
    else:
        for nw, ns in itertools.product((4, 8), (2, 3, 4, 5)):
            yield replace(base, num_warps=nw, num_stages=ns)


def _spec(v: int) -> int:
    """How Triton specialises an integer argument (part of a compiled kernel's key)."""
    return 1 if v == 1 else 16 if v % 16 == 0 else 0


def _compile_one(job) -> str:
    """Run one config once on zero tensors of the point's shapes (a worker process): Triton compiles it into
    its on-disk cache, where the timing process finds it."""
    K, N, M, G, block_k, cfg = job
    try:
        dev = torch.device("cuda")
        w = wg.Int4Weight(torch.zeros(K // 8, N, dtype=torch.int32, device=dev),
                          torch.zeros(K // G, N, dtype=torch.bfloat16, device=dev),
                          torch.zeros(K // G, N, dtype=torch.bfloat16, device=dev), G, block_k,
                          torch.zeros(N, dtype=torch.int32, device=dev))
        wg.w4a16_matmul(torch.zeros(M, K, dtype=torch.bfloat16, device=dev), w, cfg)
        if isinstance(cfg, GemvConfig):
            wg.gemv_load_probe(w, cfg)
        torch.cuda.synchronize()
        return ""
    except Exception as e:  # the timing process reports it
        return str(e).splitlines()[0][:120] if str(e) else type(e).__name__


def precompile(jobs, workers: int) -> None:
    """Compile the distinct kernels of jobs [(K, N, M, G, block_k, cfg)] in parallel processes."""
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor
    todo = {}
    for K, N, M, G, bk, cfg in jobs:
        split = min(cfg.split_k, K // bk)
        key = (cfg, _spec(M), _spec(-(-(K // bk) // split)), split == 1, _spec(K), _spec(N))
        todo.setdefault(key, (K, N, M, G, bk, cfg))
    if workers > 1 and len(todo) > 1:
        with ProcessPoolExecutor(max_workers=min(workers, len(todo)), mp_context=mp.get_context("spawn")) as ex:
            list(ex.map(_compile_one, todo.values()))


def sweep(points, workers):
    """Coordinate search per point (name, K, N, M, copies, x, ref, floor), stage by stage over all points
    (each stage's kernels compiled in parallel first); each stage keeps the best so far."""
    best = {p[:4]: config_for(p[3], p[2], p[1], p[5].device) for p in points}
    best_us = {p[:4]: None for p in points}
    for stage in range(3):
        cands = {p[:4]: list(dict.fromkeys(candidates(p[3], p[2], p[1], p[4][0].block_k, stage, best[p[:4]])))
                 for p in points}
        precompile([(p[1], p[2], p[3], p[4][0].group_size, p[4][0].block_k, c) for p in points for c in cands[p[:4]]],
                   workers)
        for name, K, N, M, copies, x, ref, floor in points:
            key = (name, K, N, M)
            for cfg in cands[key]:
                try:
                    check(wg.w4a16_matmul(x, copies[0], cfg), ref, f"{name} M={M} {cfg}")
                    us = time_us(lambda w: wg.w4a16_matmul(x, w, cfg), copies, 2)
                except Exception as e:  # a config that does not compile (shared memory) or computes wrongly
                    print(f"  {name} M={M} {cfg}: {str(e).splitlines()[0][:120]}")
                    if "illegal" in str(e) or "CUDA error" in str(e):  # the context is lost: nothing more runs
                        print(f"sweep stopped in stage {stage}: the bests so far stand", flush=True)
                        return best, best_us
                    continue
                if best_us[key] is None or us < best_us[key]:
                    best[key], best_us[key] = cfg, us
            if stage == 2:
                assert best_us[key] is not None, f"no config ran for {name} M={M}"
                us = best_us[key]
                print(f"sweep {name:8s} M={M:<5d} best {us:8.1f} us ({floor / us:4.0%} of int4 floor)"
                      f" {best[key]}", flush=True)
        print(f"sweep stage {stage} done: " + "; ".join(
            f"{k[0]} M={k[3]} {best_us[k]:.1f} us" for k in best if best_us[k] is not None), flush=True)
    return best, best_us


def gemv_candidates(M, N, K, dev):
    """The default GemvConfig and a few around it (all spill-free on sm_90 at M <= 4): half the splits, half
    the columns per program (same per thread: more programs), and at M = 1 8 columns per thread with 4-row
    chunks (135 registers: more programs per SM)."""
    base = gemv_config_for(M, N, K, dev)
    cands = [base, replace(base, split_k=max(1, base.split_k // 2))]
    if base.num_warps > 1:
        cands.append(replace(base, block_n=base.block_n // 2, num_warps=base.num_warps // 2))
    if M == 1:
        cands.append(GemvConfig(block_n=512, rows=4, split_k=base.split_k, num_warps=2))
    return list(dict.fromkeys(cands))


def gemv_main(args, bw):
    """--gemv: tensor-core kernel vs the small-M CUDA-core kernel vs its load-only probe."""
    dev = torch.device("cuda")
    rows, best_cfg = [], {}
    jobs = []  # every kernel variant, compiled first by --workers processes into Triton's disk cache
    for name in args.shapes:
        K, N, _ = SHAPES[name]
        G = args.group if args.group > 0 else K
        bk = args.block_k or wg.default_block_k(G)
        for M in args.gemv_rows:
            jobs += [(K, N, M, G, bk, c) for c in [config_for(M, N, K, dev)] + (
                gemv_candidates(M, N, K, dev) if 16 <= bk <= G else [])]
    if args.workers > 1:
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor
        with ProcessPoolExecutor(max_workers=min(args.workers, len(jobs)), mp_context=mp.get_context("spawn")) as ex:
            errs = [e for e in ex.map(_compile_one, jobs) if e]
        print(f"compiled {len(jobs)} variants" + (f"; errors: {errs[:3]}" if errs else ""), flush=True)
    for name in args.shapes:
        K, N, calls = SHAPES[name]
        G = args.group if args.group > 0 else K
        w, wbf = make_weight(K, N, G, args.block_k)
        copies = clones(w, max(2, int(args.l2_bytes // int4_bytes(w))))
        floor_us = int4_bytes(w) / bw * 1e6
        words_us = w.packed.numel() * 4 / bw * 1e6
        for M in args.gemv_rows:
            x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
            ref = x.float() @ wbf.float().t()
            tc_cfg = config_for(M, N, K, dev)
            check(wg.w4a16_matmul(x, w, tc_cfg), ref, f"{name} M={M} tc")
            tc = time_us(lambda W: wg.w4a16_matmul(x, W, tc_cfg), copies, 5)
            gv = {}
            if wg.gemv_supported(w):
                for cfg in gemv_candidates(M, N, K, dev):
                    try:
                        check(wg.w4a16_matmul(x, w, cfg), ref, f"{name} M={M} {cfg}")
                        gv[cfg] = time_us(lambda W: wg.w4a16_matmul(x, W, cfg), copies, 5)
                    except Exception as e:  # report, keep going (a failed check is a wrong kernel: say so loudly)
                        print(f"  {name} M={M} {cfg}: FAILED {str(e).splitlines()[0][:160]}", flush=True)
                        if "illegal" in str(e) or "CUDA error" in str(e):
                            raise
            row = dict(shape=name, K=K, N=N, calls=calls, M=M, floor_us=floor_us, words_floor_us=words_us,
                       tc=dict(us=tc, of_floor=floor_us / tc, config=tc_cfg.__dict__),
                       gemv=[dict(us=us, of_floor=floor_us / us, config=c.__dict__) for c, us in gv.items()])
            if gv:
                cfg, us = min(gv.items(), key=lambda kv: kv[1])
                best_cfg[(M, N, K)] = (cfg, us, tc)
                probe_us = time_us(lambda W: wg.gemv_load_probe(W, cfg), copies, 5)
                row.update(best=dict(us=us, of_floor=floor_us / us, config=cfg.__dict__),
                           probe=dict(us=probe_us, of_words_floor=words_us / probe_us))
            rows.append(row)
            b, pr = row.get("best"), row.get("probe")
            print(f"{name:8s} {K:5d}->{N:<5d} M={M:<3d} floor {floor_us:6.1f} us | tc {tc:6.1f} us {floor_us / tc:4.0%}"
                  + (f" | gemv {b['us']:6.1f} us {b['of_floor']:4.0%} | probe {pr['us']:6.1f} us "
                     f"{pr['of_words_floor']:4.0%} of words/copy-bw | {cfg}" if b else " | gemv n/a"), flush=True)
        del copies
        torch.cuda.empty_cache()
    wins = {M: all(r["best"]["us"] < r["tc"]["us"] for r in rows if r["M"] == M and "best" in r) for M in args.gemv_rows}
    max_m = 0
    for M in sorted(args.gemv_rows):
        if not wins[M]:
            break
        max_m = M
    md = [f"# W4A16 small-M kernels, {torch.cuda.get_device_name()}, group {args.group}; HBM copy {bw / 1e9:.0f} GB/s",
          "us (% of int4 floor = packed + scales + zeros at copy bandwidth); probe: % of packed words at copy bandwidth",
          "", "| shape | M | floor | tensor-core | gemv best | probe | gemv config |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        b, pr = r.get("best"), r.get("probe")
        md.append(f"| {r['shape']} | {r['M']} | {r['floor_us']:.1f} | {r['tc']['us']:.1f} ({r['tc']['of_floor']:.0%}) | "
                  + (f"{b['us']:.1f} ({b['of_floor']:.0%}) | {pr['us']:.1f} ({pr['of_words_floor']:.0%}) | "
                     f"{GemvConfig(**b['config'])} |" if b else "- | - | - |"))
    md += ["", f"CUDA-core kernel faster on every shape for M <= {max_m} (GEMV_MAX_M = {max_m})"]
    print("\nGEMV_TUNED = {\n" + "".join(f"    {k}: {c},\n" for k, (c, us, tc) in best_cfg.items() if us < tc) + "}")
    print("\n" + "\n".join(md))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        json.dump({"device": torch.cuda.get_device_name(), "copy_bw": bw, "group": args.group, "rows": rows,
                   "gemv_max_m": max_m}, open(os.path.join(args.out, "gemv.json"), "w"), indent=1)
        open(os.path.join(args.out, "gemv.md"), "w").write("\n".join(md) + "\n")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64, 512, 2048], help="activation rows M")
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--group", type=int, default=128, help="quantization group size (0: per channel, G = K)")
    p.add_argument("--block-k", type=int, default=None,
                   help="the prepared weights' K tile (default min(128, G); 256 / 512: 2 / 4 groups per tile)")
    p.add_argument("--l2-bytes", type=float, default=2e9, help="weight copies per method cover this many bytes")
    p.add_argument("--sweep", action="store_true", help="search kernel configs per (shape, M in --sweep-rows)")
    p.add_argument("--sweep-rows", type=int, nargs="+", default=[1, 8, 64])
    p.add_argument("--workers", type=int, default=max(1, min(14, (os.cpu_count() or 2) - 2)),
                   help="processes compiling each sweep stage's kernels in parallel")
    p.add_argument("--gemv", action="store_true", help="only: tensor-core vs small-M CUDA-core kernel vs load probe")
    p.add_argument("--gemv-rows", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--out", default=None, help="directory for results.json, results.md (and sweep.json)")
    args = p.parse_args()
    torch.manual_seed(0)
    dev = torch.device("cuda")
    if args.gemv:
        if args.l2_bytes == 2e9:
            args.l2_bytes = 1e9  # 20x the L2 is enough, and halves the setup
        bw = hbm_bandwidth(dev, 1.0)
        print(f"{torch.cuda.get_device_name()}: HBM copy {bw / 1e9:.0f} GB/s", flush=True)
        return gemv_main(args, bw)
    bw, tc = hbm_bandwidth(dev, 1.0), tensor_core_rate()
    print(f"{torch.cuda.get_device_name()}: HBM copy {bw / 1e9:.0f} GB/s, bf16 tensor cores {tc / 1e12:.0f} TFLOP/s",
          flush=True)
    rows, tuned, sums, points = [], {}, {}, []
    for name in args.shapes:
        K, N, calls = SHAPES[name]
        G = args.group if args.group > 0 else K
        w, wbf = make_weight(K, N, G, args.block_k)
        q_copies = clones(w, max(2, int(args.l2_bytes // int4_bytes(w))))
        b_copies = [wbf] + [wbf.clone() for _ in range(max(2, int(args.l2_bytes // (N * K * 2))) - 1)]
        for M in args.rows:
            x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
            ref = x.float() @ wbf.float().t()
            floor = max(int4_bytes(w) / bw, 2 * M * N * K / tc) * 1e6
            meths = {"bf16": (lambda W: F.linear(x, W), b_copies, N * K * 2),
                     "w4a16": (lambda W: wg.w4a16_matmul(x, W), q_copies, int4_bytes(w))}
            if M >= wg.LARGE_M:
                meths["kernel"] = (lambda W: wg.w4a16_matmul(x, W, config_for(M, N, K, dev)), q_copies, int4_bytes(w))
                meths["dequant+cublas"] = (lambda W: x @ dequantize_int4_t(W, x.dtype), q_copies, int4_bytes(w))
            t = {}
            for meth, (fn, copies, nbytes) in meths.items():
                check(fn(copies[0]), ref, f"{name} M={M} {meth}")
                us = time_us(fn, copies, 1 if M >= wg.LARGE_M else 5)
                t[meth] = dict(us=us, gbps=nbytes / us / 1e3, of_floor=floor / us)
            if args.sweep and M in args.sweep_rows:
                points.append((name, K, N, M, q_copies, x, ref, floor))
            rows.append(dict(shape=name, K=K, N=N, calls=calls, M=M, floor_us=floor, methods=t))
            s = sums.setdefault(M, {"floor": 0.0})
            s["floor"] += calls * floor / 1e3
            for meth, r in t.items():
                s[meth] = s.get(meth, 0.0) + calls * r["us"] / 1e3
            print(f"{name:8s} {K:5d}->{N:<5d} M={M:<5d} floor {floor:7.1f} us | " + " | ".join(
                f"{m} {r['us']:7.1f} us {r['gbps']:5.0f} GB/s {r['of_floor']:4.0%}" for m, r in t.items()), flush=True)
        del q_copies, b_copies
        torch.cuda.empty_cache()
    if points:
        best, best_us = sweep(points, args.workers)
        for row in rows:
            key = (row["shape"], row["K"], row["N"], row["M"])
            if best_us.get(key) is not None:
                cfg, us, p = best[key], best_us[key], next(p for p in points if p[:4] == key)
                tuned[(wg.m_bucket(row["M"]), row["N"], row["K"])] = cfg
                row["methods"]["swept"] = dict(us=us, gbps=int4_bytes(p[4][0]) / us / 1e3, of_floor=p[7] / us,
                                               config=cfg.__dict__)
                sums[row["M"]]["swept"] = sums[row["M"]].get("swept", 0.0) + row["calls"] * us / 1e3
        for M in {p[3] for p in points if best_us.get(p[:4]) is None}:  # a stopped sweep: no partial sums
            sums[M].pop("swept", None)
    meth_names = list(dict.fromkeys(m for s in sums.values() for m in s if m != "floor"))
    md = [f"# W4A16 GEMM, {torch.cuda.get_device_name()}, group {args.group}, block_k {args.block_k or 'default'}",
          f"HBM copy {bw / 1e9:.0f} GB/s, bf16 tensor cores {tc / 1e12:.0f} TFLOP/s; per 27B step "
          f"({'+'.join(args.shapes)}), ms; (x) = int4 floor / time", "",
          "| M | int4 floor | " + " | ".join(meth_names) + " | bf16 / w4a16 |", "|---" * (3 + len(meth_names)) + "|"]
    for M, s in sums.items():
        md.append(f"| {M} | {s['floor']:.2f} | " + " | ".join(
            f"{s[m]:.2f} ({s['floor'] / s[m]:.0%})" if m in s else "-" for m in meth_names)
            + f" | {s['bf16'] / s['w4a16']:.2f}x |")
    print("\n" + "\n".join(md))
    if tuned:
        print("\nTUNED = {\n" + "".join(f"    {k}: {v},\n" for k, v in tuned.items()) + "}")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        json.dump({"device": torch.cuda.get_device_name(), "copy_bw": bw, "tensor_core_flops": tc, "group": args.group,
                   "block_k": args.block_k,
                   "rows": rows, "per_step_ms": sums}, open(os.path.join(args.out, "results.json"), "w"), indent=1)
        open(os.path.join(args.out, "results.md"), "w").write("\n".join(md) + "\n")
        if tuned:
            json.dump([dict(m_bucket=k[0], N=k[1], K=k[2], **v.__dict__) for k, v in tuned.items()],
                      open(os.path.join(args.out, "sweep.json"), "w"), indent=1)


if __name__ == "__main__":
    main()

"""Study (issue 39): the W4A16 GEMM with its words' K tiles loaded by TMA (Config.tma: a host tensor descriptor,
cp.async.bulk.tensor into shared memory) against the shipped pointer loads (4-byte cp.async), at the 27B shapes.

    python benchmarks/studies/w4a16_tma.py --out benchmarks/results/DATE-w4a16-tma

Per shape and M in --rows: the shipped config (TUNED / config_for), the same with tma=True, and tma=True over
num_stages 2-6 and (M <= 16) BLOCK_N x SPLIT_K neighbours; each checked against x @ bf16(W) then timed as a
CUDA-graph replay over weight copies that do not fit L2 (benchmarks/bench_w4a16_gemm.py's helpers). Prints
us and % of the int4 floor per variant, and the 27B step sums (no lm_head) of shipped vs the best TMA variant.
"""
import argparse
import json
import os
import sys
from dataclasses import asdict, replace

import torch

sys.path.insert(0, ".")
from benchmarks.bench_w4a16_gemm import SHAPES, check, clones, int4_bytes, make_weight, precompile, time_us  # noqa: E402
from sketchkv.bench.floor import hbm_bandwidth  # noqa: E402
from sketchkv.ops import w4a16_gemm as wg  # noqa: E402


def variants(M, N, K, dev, quick=False):
    base = wg.config_for(M, N, K, dev)
    out = [base, replace(base, tma=True)] + [replace(base, tma=True, num_stages=s) for s in ((5,) if quick else (2, 4, 5, 6))]
    if M <= 16 and not quick:
        for bn, sk in ((64, base.split_k * 2), (128, base.split_k), (128, base.split_k * 2), (256, base.split_k)):
            if K // 128 >= 2 * sk:
                out += [replace(base, tma=True, block_n=bn, split_k=sk, num_stages=s) for s in (3, 5)]
    return list(dict.fromkeys(out))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--l2-bytes", type=float, default=2e9)
    p.add_argument("--workers", type=int, default=max(1, min(14, (os.cpu_count() or 2) - 2)))
    p.add_argument("--quick", action="store_true", help="only the shipped config, it with TMA, and with TMA + 5 stages")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    dev = torch.device("cuda")
    bw = hbm_bandwidth(dev, 1.0)
    precompile([(SHAPES[n][0], SHAPES[n][1], M, 128, 128, c) for n in args.shapes for M in args.rows
                for c in variants(M, SHAPES[n][1], SHAPES[n][0], dev, args.quick)], args.workers)
    rows = []
    for name in args.shapes:
        K, N, calls = SHAPES[name]
        w, wbf = make_weight(K, N, 128)
        copies = clones(w, max(2, int(args.l2_bytes // int4_bytes(w))))
        floor_us = int4_bytes(w) / bw * 1e6
        for M in args.rows:
            x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
            ref = x.float() @ wbf.float().t()
            res = []
            for cfg in variants(M, N, K, dev, args.quick):
                try:
                    check(wg.w4a16_matmul(x, w, cfg), ref, f"{name} M={M} {cfg}")
                    us = time_us(lambda W: wg.w4a16_matmul(x, W, cfg), copies, 3)
                except Exception as e:
                    print(f"  {name} M={M} {cfg}: FAILED {str(e).splitlines()[0][:160]}", flush=True)
                    if "illegal" in str(e) or "CUDA error" in str(e):
                        raise
                    continue
                res.append(dict(config=asdict(cfg), us=us, of_floor=floor_us / us))
            shipped = res[0]
            best = min((r for r in res if r["config"]["tma"]), key=lambda r: r["us"])
            rows.append(dict(shape=name, K=K, N=N, calls=calls, M=M, floor_us=floor_us, shipped=shipped, best_tma=best,
                             variants=res))
            print(f"{name:8s} M={M:<3d} floor {floor_us:6.1f} us | shipped {shipped['us']:6.1f} ({shipped['of_floor']:4.0%})"
                  f" | tma same cfg {res[1]['us']:6.1f} | best tma {best['us']:6.1f} ({best['of_floor']:4.0%}) "
                  f"{wg.Config(**best['config'])}", flush=True)
        del copies
        torch.cuda.empty_cache()
    md = [f"# W4A16 GEMM, words by TMA vs pointer loads: {torch.cuda.get_device_name()}, G = 128, "
          f"HBM copy {bw / 1e9:.0f} GB/s", "",
          "| shape | M | floor us | shipped us (% floor) | TMA, same config | best TMA us (% floor) | best TMA config |",
          "|---|---|---|---|---|---|---|"]
    for r in rows:
        s, b = r["shipped"], r["best_tma"]
        same = next(v for v in r["variants"] if v["config"] == {**s["config"], "tma": True})
        md.append(f"| {r['shape']} | {r['M']} | {r['floor_us']:.1f} | {s['us']:.1f} ({s['of_floor']:.0%}) | "
                  f"{same['us']:.1f} | {b['us']:.1f} ({b['of_floor']:.0%}) | {wg.Config(**b['config'])} |")
    md += ["", "| M | 27B step: floor ms | shipped ms | best TMA ms |", "|---|---|---|---|"]
    for M in args.rows:
        rs = [r for r in rows if r["M"] == M]
        f = sum(r["calls"] * r["floor_us"] for r in rs) / 1e3
        s = sum(r["calls"] * r["shipped"]["us"] for r in rs) / 1e3
        b = sum(r["calls"] * r["best_tma"]["us"] for r in rs) / 1e3
        md.append(f"| {M} | {f:.2f} | {s:.2f} ({f / s:.0%}) | {b:.2f} ({f / b:.0%}) |")
    print("\n" + "\n".join(md))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        json.dump({"device": torch.cuda.get_device_name(), "copy_bw": bw, "rows": rows},
                  open(os.path.join(args.out, "tma.json"), "w"), indent=1)
        open(os.path.join(args.out, "tma.md"), "w").write("\n".join(md) + "\n")


if __name__ == "__main__":
    main()

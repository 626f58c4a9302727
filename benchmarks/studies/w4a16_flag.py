"""Study (issue 39): the W4A16 GEMM with one boolean Config field flipped against the shipped config, at the
27B shapes.

    python benchmarks/studies/w4a16_flag.py --flag tma --out benchmarks/results/DATE-w4a16-tma
    python benchmarks/studies/w4a16_flag.py --flag magic --rows 1 8 64 --out benchmarks/results/DATE-w4a16-magic

--flag tma: the words' K tiles loaded by TMA (a host tensor descriptor, cp.async.bulk.tensor into shared memory)
instead of pointer loads (4-byte cp.async). --flag magic: the nibble -> float conversion by mantissa OR (Marlin's
trick) against an integer conversion. --flag takes any boolean Config field.

Measured and removed from the kernel (see ops/w4a16_gemm.py's "Tried and slower"): --flag xsum (rowsum(x) by one
torch reduction before the launch; H100 run 126), --flag x_major (the x rows on the MMA's M side; run 130) and
--flag persistent (1-3 programs per SM looping over the (tile, K split) items; run 130).

Per shape and M in --rows: the shipped config (TUNED / config_for), the same with the flag flipped, and the
flipped one over num_stages 2-6 and BLOCK_N x SPLIT_K / num_warps neighbours; each checked against x @ bf16(W)
then timed as a CUDA-graph replay over weight copies that do not fit L2 (benchmarks/bench_w4a16_gemm.py's
helpers). Prints us and % of the int4 floor per variant, and the 27B step sums (no lm_head) of shipped vs the
best flipped variant.
"""
import argparse
import json
import os
import sys
from dataclasses import asdict, fields, replace

import torch

sys.path.insert(0, ".")
from benchmarks.bench_w4a16_gemm import SHAPES, check, clones, int4_bytes, make_weight, precompile, time_us  # noqa: E402
from sketchkv.bench.floor import hbm_bandwidth  # noqa: E402
from sketchkv.ops import w4a16_gemm as wg  # noqa: E402


FLAGS = [f.name for f in fields(wg.Config) if f.type in (bool, "bool")]


def variants(M, N, K, dev, flag, quick=False):
    base = wg.config_for(M, N, K, dev)
    on = not getattr(base, flag)
    flip = lambda c, **kw: replace(c, **{flag: on}, **kw)  # noqa: E731
    out = [base, flip(base)] + [flip(base, num_stages=s) for s in ((5,) if quick else (2, 3, 4, 5, 6))]
    if not quick:
        neighbours = ((64, base.split_k * 2), (128, base.split_k), (128, base.split_k * 2), (256, base.split_k))
        for bn, sk in neighbours if M <= 16 else ((64, 1), (64, 2), (128, 1), (128, 2), (128, 4)):
            if K // 128 >= 2 * sk:
                out += [flip(base, block_n=bn, split_k=sk, num_stages=s) for s in (3, 5)]
        if M > 16:
            out += [flip(base, num_warps=8, block_n=128, split_k=sk, num_stages=4) for sk in (1, 2)]
    return list(dict.fromkeys(out))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--flag", choices=FLAGS, default="tma", help="the boolean Config field to flip")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--l2-bytes", type=float, default=2e9)
    p.add_argument("--workers", type=int, default=max(1, min(14, (os.cpu_count() or 2) - 2)))
    p.add_argument("--quick", action="store_true", help="only the shipped config, it flipped, and flipped + 5 stages")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    dev = torch.device("cuda")
    bw = hbm_bandwidth(dev, 1.0)
    flag = args.flag
    precompile([(SHAPES[n][0], SHAPES[n][1], M, 128, 128, c) for n in args.shapes for M in args.rows
                for c in variants(M, SHAPES[n][1], SHAPES[n][0], dev, flag, args.quick)], args.workers)
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
            for cfg in variants(M, N, K, dev, flag, args.quick):
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
            flipped = [r for r in res if r["config"][flag] != shipped["config"][flag]]
            best = min(flipped, key=lambda r: r["us"])
            rows.append(dict(shape=name, K=K, N=N, calls=calls, M=M, floor_us=floor_us, shipped=shipped, best=best,
                             variants=res))
            print(f"{name:8s} M={M:<3d} floor {floor_us:6.1f} us | shipped {shipped['us']:6.1f} ({shipped['of_floor']:4.0%})"
                  f" | {flag} flipped, same cfg {flipped[0]['us']:6.1f} | best flipped {best['us']:6.1f} "
                  f"({best['of_floor']:4.0%}) {wg.Config(**best['config'])}", flush=True)
        del copies
        torch.cuda.empty_cache()
    md = [f"# W4A16 GEMM, `{flag}` flipped vs shipped: {torch.cuda.get_device_name()}, G = 128, "
          f"HBM copy {bw / 1e9:.0f} GB/s", "",
          f"| shape | M | floor us | shipped us (% floor) | {flag} flipped, same config | best flipped us (% floor) | "
          "best flipped config |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        s, b = r["shipped"], r["best"]
        same = next(v for v in r["variants"] if v["config"] == {**s["config"], flag: not s["config"][flag]})
        md.append(f"| {r['shape']} | {r['M']} | {r['floor_us']:.1f} | {s['us']:.1f} ({s['of_floor']:.0%}) | "
                  f"{same['us']:.1f} | {b['us']:.1f} ({b['of_floor']:.0%}) | {wg.Config(**b['config'])} |")
    md += ["", "| M | 27B step: floor ms | shipped ms | best flipped ms |", "|---|---|---|---|"]
    for M in args.rows:
        rs = [r for r in rows if r["M"] == M]
        f = sum(r["calls"] * r["floor_us"] for r in rs) / 1e3
        s = sum(r["calls"] * r["shipped"]["us"] for r in rs) / 1e3
        b = sum(r["calls"] * r["best"]["us"] for r in rs) / 1e3
        md.append(f"| {M} | {f:.2f} | {s:.2f} ({f / s:.0%}) | {b:.2f} ({f / b:.0%}) |")
    print("\n" + "\n".join(md))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        json.dump({"device": torch.cuda.get_device_name(), "copy_bw": bw, "flag": flag, "rows": rows},
                  open(os.path.join(args.out, f"{flag}.json"), "w"), indent=1)
        open(os.path.join(args.out, f"{flag}.md"), "w").write("\n".join(md) + "\n")


if __name__ == "__main__":
    main()

"""Study (issue 39, prefill "no slower than bf16"): the W4A16 prefill GEMM (M >= LARGE_M: dequantize + cuBLAS)
against bf16 cuBLAS at the 27B shapes, with the dequantize in column slices on a side stream that overlap the
previous slice's GEMM (ops/w4a16_gemm.dequant_mm, DEQUANT_PARTS).

    python benchmarks/studies/w4a16_prefill.py --out benchmarks/results/DATE-w4a16-prefill [--rows 8192]

Per shape and M: us per call of bf16 x @ W^T, of dequant_mm with 1 part (dequantize all, then one GEMM) and with
2 / 4 / 8 parts, each checked against the bf16 product first; then the sums over one 27B forward (the calls per
layer set of bench_w4a16_gemm.SHAPES, no lm_head) and W4A16 / bf16. Timed with torch.cuda events over repeats
(no CUDA graph: the side stream's events are what is measured), the weights cycled over copies beyond L2.
"""
import argparse
import json
import os
import sys

import torch

sys.path.insert(0, ".")
from benchmarks.bench_w4a16_gemm import SHAPES, make_weight  # noqa: E402
from sketchkv.ops import w4a16_gemm as wg  # noqa: E402


def time_us(fn, reps=20):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) * 1e3 / reps


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[8192])
    p.add_argument("--parts", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--out", default=None)
    a = p.parse_args()
    dev = torch.device("cuda")
    rows = []
    for name, (K, N, calls) in SHAPES.items():
        w, wbf = make_weight(K, N, 128)
        wt = wbf.t().contiguous()        # [K, N]: what cuBLAS multiplies for bf16 weights (F.linear's layout)
        for M in a.rows:
            x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
            ref = (x @ wt).float()
            r = {"shape": name, "K": K, "N": N, "M": M, "calls": calls, "bf16_us": time_us(lambda: x @ wt)}
            for parts in a.parts:
                got = wg.dequant_mm(x, w, parts).float()
                err = (got - ref).abs().max().item() / ref.abs().max().item()
                assert err < 2e-2, f"{name} M={M} parts={parts}: relative error {err:.3g}"
                r[f"parts{parts}_us"] = time_us(lambda: wg.dequant_mm(x, w, parts))
            rows.append(r)
            print(f"{name:8s} M={M} bf16 {r['bf16_us']:8.1f} us | " + " | ".join(
                f"{q} parts {r[f'parts{q}_us']:8.1f} ({r['bf16_us'] / r[f'parts{q}_us']:.3f}x)" for q in a.parts),
                flush=True)
        torch.cuda.empty_cache()
    md = [f"# W4A16 prefill GEMM (dequantize in slices + cuBLAS) vs bf16: {torch.cuda.get_device_name()}", "",
          "| M | bf16 ms per 27B forward | " + " | ".join(f"{q} parts ms (bf16 / it)" for q in a.parts) + " |",
          "|---|---|" + "---|" * len(a.parts)]
    for M in a.rows:
        rs = [r for r in rows if r["M"] == M]
        bf = sum(r["calls"] * r["bf16_us"] for r in rs) / 1e3
        cells = [sum(r["calls"] * r[f"parts{q}_us"] for r in rs) / 1e3 for q in a.parts]
        md.append(f"| {M} | {bf:.1f} | " + " | ".join(f"{c:.1f} ({bf / c:.3f})" for c in cells) + " |")
    print("\n" + "\n".join(md))
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "prefill.json"), "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
        with open(os.path.join(a.out, "prefill.md"), "w") as f:
            f.write("\n".join(md) + "\n")


if __name__ == "__main__":
    main()

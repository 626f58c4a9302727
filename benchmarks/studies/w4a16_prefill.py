"""Study (issue 39, prefill "no slower than bf16"): the W4A16 prefill GEMM (M >= LARGE_M: the Triton dequantize of
the whole weight to bf16, then one cuBLAS GEMM; ops/w4a16_gemm.dequant_mm) against bf16 cuBLAS at the 27B shapes,
and the dequantize alone against the HBM copy bandwidth (what W4A16 pays on top of bf16's GEMM).

    python benchmarks/studies/w4a16_prefill.py --out benchmarks/results/DATE-w4a16-prefill [--rows 8192]

Per shape and M: us per call of bf16 x @ W^T and of dequant_mm, the latter checked against the bf16 product first;
per shape: us of dequantize_int4_t alone (checked against the reference dequantization) and its GB/s = (packed
int32 words + scales + zeros + bf16 output bytes) / time, as a fraction of a device copy's bytes read + written per
second. Then the sums over one 27B forward (the calls per layer set of bench_w4a16_gemm.SHAPES, no lm_head) and
bf16 / W4A16. Timed with torch.cuda events over repeats, the int4 weights cycled over copies beyond L2.
H100 run 130 (with the dequantize in column slices on a side stream, since removed): M = 8192, bf16 535.5 ms,
one dequantize + GEMM 570.2 (0.939), 2 / 4 / 8 slices 599.7 / 598.5 / 613.9.
"""
import argparse
import itertools
import json
import os
import sys

import torch

sys.path.insert(0, ".")
from benchmarks.bench_w4a16_gemm import SHAPES, clones, int4_bytes, make_weight  # noqa: E402
from sketchkv.bench.floor import hbm_bandwidth  # noqa: E402
from sketchkv.ops import w4a16_gemm as wg  # noqa: E402


def time_us(fn, copies, reps=20):
    """Per call of fn(copy), the copies taken in turn (3 warm calls first)."""
    it = itertools.cycle(copies)
    for _ in range(3):
        fn(next(it))
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        fn(next(it))
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) * 1e3 / reps


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[8192])
    p.add_argument("--l2-bytes", type=float, default=4e8, help="int4 bytes to cycle over (beyond L2)")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    dev = torch.device("cuda")
    bw = hbm_bandwidth(dev, 1.0)
    rows, deq = [], []
    for name, (K, N, calls) in SHAPES.items():
        w, wbf = make_weight(K, N, 128)
        wt = wbf.t().contiguous()        # [K, N]: what cuBLAS multiplies for bf16 weights (F.linear's layout)
        copies = clones(w, max(2, int(a.l2_bytes // int4_bytes(w))))
        got = wg.dequantize_int4_t(w, torch.bfloat16)
        torch.testing.assert_close(got.float(), wt.float(), rtol=2 ** -7, atol=0)
        del got
        nbytes = int4_bytes(w) + K * N * 2
        us = time_us(lambda W: wg.dequantize_int4_t(W, torch.bfloat16), copies)
        d = {"shape": name, "K": K, "N": N, "calls": calls, "dequant_us": us, "bytes": nbytes,
             "gbps": nbytes / us / 1e3, "of_copy_bw": nbytes / (us * 1e-6) / bw}
        deq.append(d)
        print(f"{name:8s} dequantize {us:8.1f} us, {d['gbps']:6.0f} GB/s ({d['of_copy_bw']:.0%} of copy)", flush=True)
        for M in a.rows:
            x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
            ref = (x @ wt).float()
            err = (wg.dequant_mm(x, w).float() - ref).abs().max().item() / ref.abs().max().item()
            assert err < 2e-2, f"{name} M={M}: relative error {err:.3g}"
            r = {"shape": name, "K": K, "N": N, "M": M, "calls": calls, "bf16_us": time_us(lambda _: x @ wt, [wt]),
                 "w4a16_us": time_us(lambda W: wg.dequant_mm(x, W), copies)}
            rows.append(r)
            print(f"{name:8s} M={M} bf16 {r['bf16_us']:8.1f} us | dequantize + GEMM {r['w4a16_us']:8.1f} us "
                  f"({r['bf16_us'] / r['w4a16_us']:.3f}x)", flush=True)
        del copies
        torch.cuda.empty_cache()
    md = [f"# W4A16 prefill GEMM (dequantize + cuBLAS) vs bf16: {torch.cuda.get_device_name()}, "
          f"HBM copy {bw / 1e9:.0f} GB/s", "",
          "| M | bf16 ms per 27B forward | dequantize + GEMM ms (bf16 / it) | of which dequantize ms |", "|---|---|---|---|"]
    dq_ms = sum(d["calls"] * d["dequant_us"] for d in deq) / 1e3
    for M in a.rows:
        rs = [r for r in rows if r["M"] == M]
        bf = sum(r["calls"] * r["bf16_us"] for r in rs) / 1e3
        q = sum(r["calls"] * r["w4a16_us"] for r in rs) / 1e3
        md.append(f"| {M} | {bf:.1f} | {q:.1f} ({bf / q:.3f}) | {dq_ms:.1f} |")
    md += ["", "| shape | K | N | dequantize us | MB moved | GB/s | of copy bandwidth |", "|---|---|---|---|---|---|---|"]
    for d in deq:
        md.append(f"| {d['shape']} | {d['K']} | {d['N']} | {d['dequant_us']:.1f} | {d['bytes'] / 1e6:.1f} | "
                  f"{d['gbps']:.0f} | {d['of_copy_bw']:.0%} |")
    print("\n" + "\n".join(md))
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "prefill.json"), "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "copy_bw": bw, "rows": rows, "dequantize": deq}, f,
                      indent=1)
        with open(os.path.join(a.out, "prefill.md"), "w") as f:
            f.write("\n".join(md) + "\n")


if __name__ == "__main__":
    main()

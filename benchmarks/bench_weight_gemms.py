"""The weight GEMMs of one decode step, alone, against the bytes they read (HBM copy bandwidth measured in the
same run): what the step's largest part could take if nothing ran beside it.

    python benchmarks/bench_weight_gemms.py --out benchmarks/results/weight-gemms.json [--preset qwen3.5-27b] [--rows 1 8]

Each distinct weight of a dense hybrid preset (the engine's fused projections: attention q+gate/k/v, o_proj,
the GDN input projections, GDN out, MLP gate+up, down, lm_head) is timed as F.linear over `rows` activation rows,
replayed from a CUDA graph over enough copies of the weight that none stays in L2, under cuBLAS and cuBLASLt, and
with the weight stored transposed (x @ W^T with W^T contiguous). Per step = calls x time. H200 run 93: 13.09 ms
for the 27B shape at 8 rows against 12.36 ms of bytes (94%); the engine's own step spends 13.5-14.0 ms in them.
"""
import argparse
import json
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, ".")
from benchmarks.bench_sparse_ops import graphed  # noqa: E402
from sketchkv.bench.floor import hbm_bandwidth  # noqa: E402
from sketchkv.models.presets import preset_config  # noqa: E402


def step_weights(cfg) -> dict[str, tuple[int, int, int]]:
    """name -> (K, N, calls per decode step) of a dense hybrid (qwen3_5_text) config, as the engine fuses them."""
    attn = cfg.layer_types.count("full_attention")
    gdn = cfg.layer_types.count("linear_attention")
    H, Hkv, D, hid = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size
    kd = cfg.linear_num_key_heads * cfg.linear_key_head_dim
    vd = cfg.linear_num_value_heads * cfg.linear_value_head_dim
    w = {"attention q+gate/k/v": (hid, H * D * (2 if cfg.gated_attention else 1) + 2 * Hkv * D, attn),
         "attention o_proj": (H * D, hid, attn),
         "GDN in (qkv, z, b, a)": (hid, 2 * kd + 2 * vd + 2 * cfg.linear_num_value_heads, gdn),
         "GDN out": (vd, hid, gdn),
         "MLP gate+up": (hid, 2 * cfg.intermediate_size, cfg.num_layers),
         "MLP down": (cfg.intermediate_size, hid, cfg.num_layers),
         "lm_head": (hid, cfg.vocab_size, 1)}
    return {k: v for k, v in w.items() if v[2]}


def replay_us(replay, reps: int = 20) -> float:
    """Median time of `reps` calls of replay (a CUDA graph's replay), in us."""
    ts = []
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(True), torch.cuda.Event(True)
        e0.record()
        replay()
        e1.record()
        torch.cuda.synchronize()
        ts.append(e0.elapsed_time(e1) * 1e3)
    return sorted(ts)[reps // 2]


def time_us(fn, inner: int) -> float:
    """Per call of fn, replayed from a CUDA graph of `inner` calls."""
    return replay_us(graphed(lambda: [fn() for _ in range(inner)])) / inner


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="qwen3.5-27b", help="a dense hybrid preset of sketchkv/models/presets.py")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8], help="activation rows (agents in the batch)")
    p.add_argument("--l2-bytes", type=float, default=2e9, help="weight copies per GEMM cover this many bytes")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    cfg, _ = preset_config(args.preset)
    torch.manual_seed(0)
    bw = hbm_bandwidth(torch.device("cuda"), 1.0)
    rows, per_step = [], {}
    for name, (K, N, calls) in step_weights(cfg).items():
        copies = max(2, int(args.l2_bytes // (K * N * 2)))
        Ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
        Wts = [W.t().contiguous() for W in Ws]
        floor = K * N * 2 / bw * 1e6
        for M in args.rows:
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            t = {}
            for lib in ("cublas", "cublaslt"):
                torch.backends.cuda.preferred_blas_library(lib)
                t[lib] = time_us(lambda: [F.linear(x, W) for W in Ws], 10) / copies
            torch.backends.cuda.preferred_blas_library("cublas")
            t["transposed"] = time_us(lambda: [x @ Wt for Wt in Wts], 10) / copies
            rows.append(dict(weight=name, K=K, N=N, calls=calls, rows=M, floor_us=floor, us=t))
            acc = per_step.setdefault(M, {"floor_ms": 0.0, "cublas_ms": 0.0})
            acc["floor_ms"] += calls * floor / 1e3
            acc["cublas_ms"] += calls * t["cublas"] / 1e3
            print(f"{name:22s} {K:6d} x {N:6d} x{calls:3d}  M={M:<3d} floor {floor:7.1f} us | "
                  + " | ".join(f"{k} {v:7.1f} ({floor / v:4.0%})" for k, v in t.items()), flush=True)
        Ws = Wts = None   # free before the next shape (not del: the lambdas above close over them)
        torch.cuda.empty_cache()
    print(f"\ncopy bandwidth {bw / 1e9:.0f} GB/s")
    print("| rows | GEMMs per step, cuBLAS (ms) | bytes floor (ms) | of floor |\n|---|---|---|---|")
    for M, a in per_step.items():
        print(f"| {M} | {a['cublas_ms']:.2f} | {a['floor_ms']:.2f} | {a['floor_ms'] / a['cublas_ms']:.0%} |")
    if args.out:
        json.dump({"preset": args.preset, "device": torch.cuda.get_device_name(), "copy_bw": bw, "rows": rows,
                   "per_step": per_step}, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()

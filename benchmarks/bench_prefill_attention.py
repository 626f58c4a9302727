"""Prefill attention backends on a GPU at the 27B shape (24 query / 4 KV heads x 256, bf16): one chunk of
Lq new queries over a cached prefix of P tokens, as chunked prefill runs it. Each backend is checked
against the flash path and timed; TFLOP/s counts the causal work
(4 x Lq x (P + Lq / 2) x Hq x D).

    python benchmarks/bench_prefill_attention.py --out benchmarks/results/prefill-attention.json

Backends of sketchkv/ops/prefill_attention.py (EngineConfig.prefill_attention): flash (SDPA's
FlashAttention-2 op; two calls + log-sum-exp merge when there is a prefix) and cudnn (SDPA's cuDNN op,
same split; with the KV heads as they are (GQA) and expanded to the query heads), compared with the
flash output (relative error). A cuDNN refusal is reported, not timed.
"""
import argparse
import json
import sys
import time

import torch
import triton

sys.path.insert(0, ".")
from sketchkv.ops import prefill_attention as pa  # noqa: E402


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=3, rep=20, return_mode="median") / 1e3


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--chunk", type=int, default=16384)
    p.add_argument("--prefixes", type=int, nargs="+", default=[0, 65536, 114688, 229376])
    p.add_argument("--out", default="benchmarks/results/prefill-attention.json")
    a = p.parse_args()
    Hq, Hkv, D = 24, 4, 256
    scale = D ** -0.5
    torch.manual_seed(0)
    rows = []
    for P in a.prefixes:
        Lq, Lk = a.chunk, P + a.chunk
        q = torch.randn(Lq, Hq, D, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(Lk, Hkv, D, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        flops = 4 * Lq * (P + Lq / 2) * Hq * D
        ref = pa.prefix_causal_attention(q, k, v, scale)
        ke, ve = (x.repeat_interleave(Hq // Hkv, 1) for x in (k, v))
        cands = {"flash": lambda: pa.prefix_causal_attention(q, k, v, scale, "flash"),
                 "cudnn gqa": lambda: pa.prefix_causal_attention(q, k, v, scale, "cudnn"),
                 "cudnn expanded": lambda: pa.prefix_causal_attention(q, ke, ve, scale, "cudnn")}
        for name, fn in cands.items():
            try:
                pa._cudnn_refused.clear()
                out = fn()
                if name != "flash" and pa._cudnn_refused:   # it fell back to flash: not a cuDNN figure
                    raise RuntimeError(f"cuDNN refused: {next(iter(pa._cudnn_refused.values()))}")
                err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
                t = bench(fn)
                rows.append(dict(backend=name, prefix=P, chunk=Lq, ms=t * 1e3, tflops=flops / t / 1e12, rel_err_vs_flash=err))
                print(f"P={P:7d} Lq={Lq}: {name:15s} {t * 1e3:8.2f} ms  {flops / t / 1e12:6.0f} TFLOP/s  err vs flash {err:.1e}")
            except Exception as e:
                rows.append(dict(backend=name, prefix=P, chunk=Lq, error=str(e).split("\n")[0][:300]))
                print(f"P={P:7d} Lq={Lq}: {name:15s} failed: {rows[-1]['error']}")
        q = k = v = ke = ve = None   # free before the next prefix (del: ruff reads the lambdas as using deleted names)
        torch.cuda.empty_cache()
    res = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, cudnn=torch.backends.cudnn.version(),
               date=time.strftime("%Y-%m-%d %H:%M"), command=" ".join(sys.argv), shape=dict(Hq=Hq, Hkv=Hkv, D=D),
               rows=rows)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()

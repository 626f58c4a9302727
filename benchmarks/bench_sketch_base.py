"""GPU micro-benchmark: the residual keys' add-back (ops/sketch_base.py) at the tier gather's shape, against the
bytes it must move and the device-to-device copy bandwidth measured in the same run.

The shape is one 27B layer's decode scratch at 8 x 250K: B x Np rows (sinks + top-k + recent, rounded to 16) of
Hkv x D bf16 keys, of which the picked rows (from host records or hot rows) get mean + basis x int4 coefficients
added in place; the resident rows (sinks and recent tail) have no slot and are left alone. Bytes floor: those
rows' keys read and written + their sketches read. Timed as CUDA-graph replays; the torch reference (what the
tier ran before the kernel) is the peer. The kernel's result is checked against the reference first.

    python benchmarks/bench_sketch_base.py --out benchmarks/results/sketch_base.json
"""
import argparse
import json
import sys
import time
from pathlib import Path

import torch
from triton.testing import do_bench_cudagraph

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.bench_attention_ops import copy_bandwidth  # noqa: E402
from sketchkv.ops.sketch import sketch_keys_ref  # noqa: E402
from sketchkv.ops.sketch_base import apply_sketch_base, sketch_base_ref  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--picks", type=int, default=2048, help="top-k rows per sequence (with a slot)")
    p.add_argument("--resident", type=int, default=64 + 1024, help="sinks + recent rows per sequence (no slot)")
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=256)
    p.add_argument("--rank", type=int, default=64)
    p.add_argument("--context", type=int, default=256000, help="cache slots the picks are drawn from")
    p.add_argument("--block-rows", type=int, nargs="+", default=[32, 64, 128])
    p.add_argument("--out", default=None, help="JSON file for the results")
    a = p.parse_args()
    torch.manual_seed(0)
    H, D, r = a.kv_heads, a.head_dim, a.rank
    n_seq = -(-(a.picks + a.resident) // 16) * 16
    N = a.batch * n_seq
    basis = torch.linalg.qr(torch.randn(H, D, D, device="cuda"))[0][..., :r].contiguous()
    mean = torch.randn(H, D, device="cuda")
    sketch = torch.empty(a.context // 64, 64, H, r // 2, dtype=torch.uint8, device="cuda")
    scale = torch.empty(a.context // 64, 64, H, dtype=torch.float16, device="cuda")
    for i in range(0, a.context, 65536):   # real sketches of random keys
        k = torch.randn(min(65536, a.context - i), H, D, device="cuda") * 3 + mean
        pk, sc = sketch_keys_ref(k, mean, basis)
        sketch.view(-1, H, r // 2)[i:i + len(k)], scale.view(-1, H)[i:i + len(k)] = pk, sc
    slots = torch.full((a.batch, n_seq), -1, dtype=torch.int64, device="cuda")
    slots[:, :a.picks] = torch.randint(0, a.context, (a.batch, a.picks), device="cuda").sort(-1).values
    slots = slots.flatten()
    x = torch.randn(N, H, D, device="cuda").to(torch.bfloat16)
    has = int((slots >= 0).sum())
    nbytes = has * H * (2 * D * 2 + r // 2 + 2)
    want = (x.float() + sketch_base_ref(slots, sketch, scale, mean, basis)).to(torch.bfloat16)
    copy_gbs = copy_bandwidth()
    rows = []
    for br in a.block_rows:
        got = apply_sketch_base(x, slots, sketch, scale, mean, basis, 1, block_rows=br)
        err = ((got.float() - want.float()).abs().amax() / want.float().abs().amax()).item()
        y = x.clone()
        ms = do_bench_cudagraph(lambda: apply_sketch_base(y, slots, sketch, scale, mean, basis, 1, out=y,
                                                          block_rows=br), rep=200)
        rows.append({"impl": f"kernel BN={br}", "us": 1e3 * ms, "max_rel_err": err})
    y = x.clone()
    ms = do_bench_cudagraph(lambda: y.copy_(x.float() + sketch_base_ref(slots, sketch, scale, mean, basis)), rep=50)
    rows.append({"impl": "torch reference", "us": 1e3 * ms, "max_rel_err": 0.0})
    for row in rows:
        row["gbs"] = nbytes / row["us"] / 1e3
        row["frac_copy"] = row["gbs"] / copy_gbs
    res = {"date": time.strftime("%Y-%m-%d %H:%M"), "device": torch.cuda.get_device_name(), "args": vars(a),
           "rows_total": N, "rows_with_slot": has, "bytes": nbytes, "copy_gbs": copy_gbs, "results": rows}
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))
    print(f"{N} rows ({has} with a slot), {nbytes / 1e6:.1f} MB floor, copy {copy_gbs:.0f} GB/s")
    print(f"{'impl':18s} {'us':>8s} {'GB/s':>8s} {'of copy':>8s} {'max rel err':>12s}")
    for row in rows:
        print(f"{row['impl']:18s} {row['us']:8.1f} {row['gbs']:8.0f} {row['frac_copy']:8.0%} {row['max_rel_err']:12.2e}")


if __name__ == "__main__":
    main()

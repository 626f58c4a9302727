"""GPU micro-benchmark: paged decode attention kernel vs device-to-device copy bandwidth.

Achieved bandwidth = bytes of K/V read (sum(seq_lens) * Hkv * D * 2 bytes * 2) / time of one call,
split and reduce kernels included; q, out and the split buffers are not counted. Calls are timed as
CUDA-graph replays (how the engine runs decode; eager time with launch overhead is shown beside),
with L2 flushed before each replay and short contexts rotated over several cache copies. The copy
reference is a 4 GB torch copy_ timed in the same run, counting bytes read + written.

    python benchmarks/bench_attention_ops.py --out benchmarks/results/attn_ops.json [--sweep]
"""
import argparse
import json
import sys
from pathlib import Path

import torch
import triton
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from sketchkv.ops.paged_attention import paged_attention_decode_ref, paged_attention_decode_triton  # noqa: E402


def make_cache(seq_lens, Hkv, D, bs):
    nblk = [triton.cdiv(n, bs) for n in seq_lens]
    num_blocks = sum(nblk)
    k_cache = torch.randn(num_blocks, bs, Hkv, D, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    perm = torch.randperm(num_blocks, device="cuda").int()  # scattered blocks, like a real cache
    bt = torch.full((len(seq_lens), max(nblk)), -1, dtype=torch.int32, device="cuda")
    i = 0
    for b, n in enumerate(nblk):
        bt[b, :n] = perm[i:i + n]
        i += n
    return k_cache, v_cache, bt, torch.tensor(seq_lens, dtype=torch.int32, device="cuda")


def copy_bandwidth(nbytes=4 << 30):
    src = torch.randn(nbytes // 4, device="cuda")
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=50, rep=300, return_mode="median")
    return 2 * nbytes / ms / 1e6  # GB/s, read + write


def bench_decode(seq_lens, Hq, Hkv, D, bs, check=True, **kw):
    """Median time of one decode call, replayed from a CUDA graph (as the engine runs it). Short
    contexts rotate over several cache copies (>= 512 MB in all) so L2 can't serve them."""
    nbytes = sum(seq_lens) * Hkv * D * 2 * 2
    copies = max(1, min(32, triton.cdiv(512 << 20, nbytes)))
    caches = [make_cache(seq_lens, Hkv, D, bs) for _ in range(copies)]
    q = torch.randn(len(seq_lens), Hq, D, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q)
    calls = [lambda c=c: paged_attention_decode_triton(q, *c, D ** -0.5, out=out, **kw) for c in caches]
    calls[0]()  # compile outside capture
    err = None
    if check:  # a fast wrong kernel is worth nothing: relative L2 error vs the fp32 reference
        ref = paged_attention_decode_ref(q, *caches[0], D ** -0.5).float()
        err = ((out.float() - ref).norm() / ref.norm()).item()
    eager_ms = do_bench(calls[0], warmup=25, rep=100, return_mode="median")  # includes launch overhead
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in calls:
            c()
    ms = do_bench(g.replay, warmup=25, rep=200, return_mode="median") / copies
    del caches, calls, g
    torch.cuda.empty_cache()
    return {"ms": ms, "eager_ms": eager_ms, "kv_bytes": nbytes, "gbps": nbytes / ms / 1e6, "rel_err": err}


def kernel_resources():
    """Registers / spills / shared memory of every compiled variant of the split kernel."""
    from sketchkv.ops.paged_attention import _decode_split_kernel
    res = []
    for dev_cache in _decode_split_kernel.device_caches.values():
        for k in dev_cache[0].values():
            md = k.metadata
            res.append({"name": md.name, "num_warps": md.num_warps, "num_stages": md.num_stages,
                        "n_regs": k.n_regs, "n_spills": k.n_spills, "shared": md.shared})
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--hq", type=int, default=24)
    ap.add_argument("--hkv", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=256)
    ap.add_argument("--block-size", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--sweep", action="store_true", help="also try tile / warp / stage / split settings")
    args = ap.parse_args()
    Hq, Hkv, D = args.hq, args.hkv, args.head_dim

    copy_gbps = copy_bandwidth()
    cases = [  # (name, seq_lens)
        ("B1 4K", [4096]), ("B1 32K", [32768]), ("B1 128K", [131072]),
        ("B8 4K", [4096] * 8), ("B8 32K", [32768] * 8), ("B8 128K", [131072] * 8),
        ("B32 8K", [8192] * 32),
        ("B8 mixed", [1, 100, 4097, 16000, 33333, 65537, 100003, 131072]),
    ]
    rows = []
    for bs in args.block_size:
        for name, lens in cases:
            r = bench_decode(lens, Hq, Hkv, D, bs)
            rows.append({"case": name, "block_size": bs, "seq_lens": lens, **r})
    sweep = []
    if args.sweep:
        big, mixed = [131072] * 8, cases[-1][1]
        for block_n in (16, 32, 64):
            for num_warps in (2, 4, 8):
                for num_stages in (2, 3):
                    try:
                        r = bench_decode(big, Hq, Hkv, D, 16, check=False, block_n=block_n,
                                         num_warps=num_warps, num_stages=num_stages)
                    except Exception as e:  # e.g. out of shared memory for big tiles x stages
                        r = {"error": repr(e)[:200]}
                    sweep.append({"case": "B8 128K", "block_n": block_n, "num_warps": num_warps,
                                  "num_stages": num_stages, **r})
        for name, lens in (("B1 4K", [4096]), ("B1 32K", [32768]), ("B8 mixed", mixed)):
            for mst in (32, 64, 256, 512):
                r = bench_decode(lens, Hq, Hkv, D, 16, check=False, min_split_tokens=mst)
                sweep.append({"case": name, "min_split_tokens": mst, **r})
        wave = 4 * torch.cuda.get_device_properties(0).multi_processor_count // Hkv
        for name, lens in (("B1 32K", [32768]), ("B8 128K", big), ("B8 mixed", mixed), ("B32 8K", [8192] * 32)):
            for f in (0.5, 2, 4):  # split_target as a multiple of one wave (default: wave - B)
                r = bench_decode(lens, Hq, Hkv, D, 16, check=False, max_splits=4 * wave,
                                 split_target=int(f * wave))
                sweep.append({"case": name, "split_target": int(f * wave), **r})
    resources = kernel_resources()

    props = torch.cuda.get_device_properties(0)
    print(f"{props.name}: copy {copy_gbps:.0f} GB/s (read+write). Hq={Hq} Hkv={Hkv} D={D} bf16")
    print(f"{'case':<10} {'bs':>3} {'graph ms':>9} {'GB/s':>7} {'% copy':>7} {'eager ms':>9} {'rel err':>8}")
    for r in rows:
        print(f"{r['case']:<10} {r['block_size']:>3} {r['ms']:>9.4f} {r['gbps']:>7.0f} "
              f"{100 * r['gbps'] / copy_gbps:>6.1f}% {r['eager_ms']:>9.4f} {r['rel_err']:>8.1e}")
    if sweep:
        print("sweep (block size 16):")
        for r in sweep:
            cfg = {k: v for k, v in r.items() if k not in ("ms", "eager_ms", "kv_bytes", "gbps", "rel_err", "error")}
            print(" ", cfg, f"{r['gbps']:.0f} GB/s {r['ms']:.3f} ms" if "gbps" in r else r["error"])
    for r in resources:
        print(" ", r)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({
        "device": props.name, "torch": torch.__version__, "triton": triton.__version__,
        "Hq": Hq, "Hkv": Hkv, "D": D, "copy_gbps": copy_gbps, "rows": rows, "sweep": sweep,
        "kernels": resources}, indent=1))


if __name__ == "__main__":
    main()

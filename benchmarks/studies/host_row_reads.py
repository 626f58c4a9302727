"""Study (issue 41): is the host tier's miss gather held by how it reads a row, or by the host?

The zero-copy miss gather (ops/host_gather.py) reads each picked 1,088-byte int4 row (4 KV heads x 272-byte records)
as 12 field loads (K codes, V codes, scales per head), dequantises and writes K/V plus the raw record. On some hosts
it reads 27-30% of the pinned copy bandwidth (H100 run 112) against 83-90% elsewhere (H200 run 23). Here, for the
picks a 27B layer's step makes at 8 x 250K (16K rows of 1,088 B, and 131K), in the tier's "blocks" order:

    fields   the shipped kernel (host_gather with raw=): dequantised K/V + the raw records
    raw      host_copy_rows: each row's bytes as two contiguous loads (1,024 + 64 B) into the raw records only
             (rows per program 8, and 4 / 16)
    raw+deq  raw, then the shipped kernel on the copied records (GPU memory): the two-phase miss path
    capN     the grid capped at N programs looping over their tiles, as the host tier runs the gather beside the next
             read group's scoring (N = half the SMs: 66 on an H100 / H200): fields with its tile (rows per program,
             warps), and raw. (H100 run 134 also timed each capped program prefetching its next tile, commit
             c5440a4: 4-7% faster alone; inside the step the gathers took 7% longer and the step 1.5%; removed.)
    1152     raw over 1,152-byte rows (128-byte aligned; reads 1,152 B per row, GB/s counts the 1,088 a row holds)

GB/s = picked row bytes / time, against the H2D copy bandwidth measured in the same run. Every variant is checked
against the reference on fresh random rows first.

    python benchmarks/studies/host_row_reads.py --out /tmp/rows.json [--gib 4] [--picks 8192 16384] [--cap 66]
    TRITON_INTERPRET=1 python benchmarks/studies/host_row_reads.py --smoke     # CPU dry run
"""
import argparse
import json
import sys
import time

import torch
import triton

sys.path.insert(0, ".")
from sketchkv.kv.host_store import alloc_host  # noqa: E402
from sketchkv.ops.host_gather import host_copy_rows, host_gather, host_gather_ref  # noqa: E402
from sketchkv.ops.quant_kv import pack_kv  # noqa: E402

HKV, D, ROW = 4, 256, 1088


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gib", type=float, default=4.0)
    p.add_argument("--picks", type=int, nargs="+", default=[16384, 131072])
    p.add_argument("--cap", type=int, default=0, help="also time the gather on this many looping programs (0: no)")
    p.add_argument("--out", default=None)
    p.add_argument("--smoke", action="store_true")
    a = p.parse_args()
    smoke = a.smoke
    dev = torch.device("cpu" if smoke else "cuda")
    if smoke:
        a.gib, a.picks, a.cap = 0.001, [64], a.cap and 2

    def bench(fn):
        if smoke:
            fn()
            t0 = time.perf_counter()
            fn()
            return time.perf_counter() - t0
        return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median") / 1e3

    torch.manual_seed(0)
    nbytes = int(a.gib * 2**30) // 4096 * 4096
    host = alloc_host(nbytes, not smoke)
    host.view(torch.int32)[:] = torch.randint(-2**31, 2**31 - 1, (nbytes // 4,), dtype=torch.int32)
    res = {"device": "cpu (smoke)" if smoke else torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d %H:%M"),
           "command": " ".join(sys.argv), "gib": a.gib, "rows": []}
    if not smoke:
        chunk = torch.empty(2**30, dtype=torch.uint8, device=dev)
        res["h2d_GBps"] = 2**30 / bench(lambda: chunk.copy_(host[:2**30], non_blocking=True)) / 1e9
        del chunk
    h2d = res.get("h2d_GBps", float("nan"))
    print(f"{res['device']}: H2D copy {h2d:.1f} GB/s", flush=True)

    layouts = {"1088": 1088, "1152": 1152}
    for N in a.picks:
        for name, stride in layouts.items():
            R = nbytes // stride
            src = host[:R * stride].view(R, stride)
            # fresh valid records (random K/V packed) at the rows the check reads; the rest stays random words
            picks = torch.randperm(R, device=dev)[:N]
            rank = torch.randperm(R // 64 + 1, device=dev)[picks // 64]                 # blocks order (see bench_host_gather)
            picks = picks.gather(0, torch.sort(rank * 64 + picks % 64, stable=True).indices).to(torch.int32)
            k = torch.randn(N, HKV, D, device=dev)
            rec = pack_kv(k, torch.randn_like(k), "int4").reshape(N, ROW)
            src[picks.long().cpu(), :ROW] = rec.cpu()
            raw = torch.empty(N, stride, dtype=torch.uint8, device=dev)
            host_copy_rows(src, picks, raw)
            assert torch.equal(raw[:, :ROW].cpu(), rec.cpu()), f"host_copy_rows {name}: rows differ"
            t = {"raw": bench(lambda: host_copy_rows(src, picks, raw))}
            for rpp in (4, 16):
                t[f"raw rpp{rpp}"] = bench(lambda: host_copy_rows(src, picks, raw, rows_per_program=rpp))
            if stride == ROW:
                # checked in fp32 (exact: both compute q * s in fp32), timed into bf16 (the engine's)
                dk = torch.empty(N, HKV, D, device=dev)
                dv = torch.empty_like(dk)
                rk, rv = torch.empty(N, HKV, D), torch.empty(N, HKV, D)
                host_gather_ref(src, picks.cpu(), rk, rv, "int4")
                host_gather(src, picks, dk, dv, "int4", raw=raw)
                assert torch.equal(dk.cpu(), rk) and torch.equal(raw.cpu(), rec.cpu()), "fields: K or records differ"
                local = torch.arange(N, device=dev, dtype=torch.int32)
                dk.zero_(), dv.zero_()
                host_gather(raw, local, dk, dv, "int4")
                assert torch.equal(dk.cpu(), rk) and torch.equal(dv.cpu(), rv), "raw+deq: K/V differ"
                dk, dv = dk.to(torch.bfloat16), dv.to(torch.bfloat16)
                t["fields"] = bench(lambda: host_gather(src, picks, dk, dv, "int4", raw=raw))
                t["raw+deq"] = bench(lambda: (host_copy_rows(src, picks, raw),
                                              host_gather(raw, local, dk, dv, "int4")))
                t["deq only (GPU)"] = bench(lambda: host_gather(raw, local, dk, dv, "int4"))
                for rpp, warps in ((4, 4), (8, 8), (16, 16)) if a.cap else ():   # rpp 4, 4 warps: the shipped tile
                    kw = dict(raw=raw, rows_per_program=rpp, num_warps=warps, max_programs=a.cap)
                    ck = torch.zeros(N, HKV, D, device=dev)
                    host_gather(src, picks, ck, torch.zeros_like(ck), "int4", **kw)
                    assert torch.equal(ck.cpu(), rk), f"cap {a.cap} rpp {rpp}: K differs"
                    t[f"cap{a.cap} rpp{rpp} w{warps}"] = bench(lambda: host_gather(src, picks, dk, dv, "int4", **kw))
                if a.cap:
                    t[f"raw cap{a.cap}"] = bench(lambda: host_copy_rows(src, picks, raw, max_programs=a.cap))
            for variant, s in t.items():
                gbps = N * ROW / s / 1e9
                res["rows"].append({"picks": N, "stride": stride, "variant": variant, "us": s * 1e6, "GBps": gbps,
                                    "frac_h2d": gbps / h2d})
                print(f"N={N:6d} stride {stride} {variant:26s} {s * 1e6:8.1f} us {gbps:6.1f} GB/s "
                      f"({100 * gbps / h2d:3.0f}% of copy)", flush=True)
    if a.out:
        json.dump(res, open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()

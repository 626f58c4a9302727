"""Zero-copy gather from pinned host memory (the host tier's miss path) on a GPU, against the pinned
host->device copy bandwidth measured in the same run. Also: the UVA write path (GPU rows scattered
into pinned memory) against device->host copy, gather-on-CPU-then-copy, and one hot-buffer step.

    python benchmarks/bench_host_gather.py --out benchmarks/results/host-gather.json [--gib 8] [--quick]
    TRITON_INTERPRET=1 python benchmarks/bench_host_gather.py --smoke --out /tmp/x.json   # CPU dry run

Rows: 272 B (int4, 1 KV head x 256), 512 B (bf16, 1 x 128), 528 B (int8, 1 x 256), 1 KB (bf16,
1 x 256), 1088 B (int4, 4 x 256: the 27B shape, one pick shared by the KV heads) and per-KV-head picks
of 272-B records inside 1088-B rows. For 16K and 131K random picks over the whole buffer, unsorted, sorted by
address, and in "blocks" order (ascending within 64-row blocks, blocks shuffled: the host tier's decode
order over a fragmented block table), the kernel's rows-per-program and warps are swept; GB/s = picked bytes / time
(L2 flushed between runs by triton's do_bench). Goal (issue 5): >= 70% of the copy bandwidth at 512 B.
"""
import argparse
import json
import mmap
import platform
import sys
import time

import torch
import triton

sys.path.insert(0, ".")
from sketchkv.kv.host_store import alloc_host  # noqa: E402
from sketchkv.kv.hot_buffer import HotBuffer  # noqa: E402
from sketchkv.ops.host_gather import (default_rows_per_program, host_gather, host_gather_ref,  # noqa: E402
                                      host_scatter_rows)
from sketchkv.ops.quant_kv import head_record_bytes, pack_kv  # noqa: E402

CASES = [  # (name, fmt, Hkv, D, per_head)
    ("272B int4 1x256", "int4", 1, 256, False),
    ("512B bf16 1x128", "bf16", 1, 128, False),
    ("528B int8 1x256", "int8", 1, 256, False),
    ("1KB bf16 1x256", "bf16", 1, 256, False),
    ("1088B int4 4x256 shared", "int4", 4, 256, False),
    ("272B int4 4x256 per-head", "int4", 4, 256, True),
]


SMOKE = False
BLOCK = 64   # the engine's KV block (rows)


def bench(fn) -> float:
    if SMOKE:  # CPU dry run of the script's logic (interpreter): one timed call
        fn()
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
    return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median") / 1e3


def sync():
    if not SMOKE:
        torch.cuda.synchronize()


def alloc_thp(nbytes: int) -> tuple[torch.Tensor, object]:
    """uint8 [nbytes] anonymous memory on a 2 MiB boundary, madvise(MADV_HUGEPAGE), touched, then
    cudaHostRegister'd: does the GPU's zero-copy path care how the host pages are backed? Returns
    (tensor, mmap keep-alive)."""
    m = mmap.mmap(-1, nbytes + 2**21, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        m.madvise(mmap.MADV_HUGEPAGE)
    whole = torch.frombuffer(m, dtype=torch.uint8)
    off = (-whole.data_ptr()) % 2**21
    buf = whole[off:off + nbytes]
    buf.fill_(1)  # fault the pages in (huge ones where the kernel grants them)
    if not SMOKE:
        err = torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), nbytes, 1 | 2)
        assert err == torch.cuda.cudart().cudaError.success, f"cudaHostRegister failed: {int(err)}"
    return buf, m


def anon_huge_mib() -> float:
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def copy_bandwidth(host: torch.Tensor, nbytes: int) -> tuple[float, float]:
    """(H2D, D2H) GB/s: one nbytes copy between the pinned buffer and the device."""
    src = host[:nbytes]
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cpu" if SMOKE else "cuda")
    h2d = nbytes / bench(lambda: dev.copy_(src, non_blocking=True))
    d2h = nbytes / bench(lambda: src.copy_(dev, non_blocking=True))
    return h2d / 1e9, d2h / 1e9


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gib", type=float, default=8.0, help="pinned host buffer size")
    p.add_argument("--picks", type=int, nargs="+", default=[16384, 131072])
    p.add_argument("--quick", action="store_true", help="default tile only, no sweep")
    p.add_argument("--footprints-mib", type=float, nargs="*", default=[16, 256, 2048, 8192],
                   help="locality probe: 16K random picks confined to the first F MiB of the buffer, per "
                        "allocation below (512 B and 1088 B rows, each case's best tile); none: skip")
    p.add_argument("--allocs", nargs="+", default=["register", "thp"], choices=["register", "torch", "thp"],
                   help="host allocations for the locality probe: malloc + cudaHostRegister (the engine's), "
                        "cudaHostAlloc via torch pin_memory, 2 MiB-aligned madvise(MADV_HUGEPAGE) + register")
    p.add_argument("--out", default="benchmarks/results/host-gather.json")
    p.add_argument("--smoke", action="store_true", help="CPU dry run (TRITON_INTERPRET=1): tiny sizes, no GPU")
    a = p.parse_args()
    global SMOKE
    SMOKE = a.smoke
    if SMOKE:
        a.gib, a.picks, a.quick = 0.002, [64], True
    torch.manual_seed(0)
    dev = torch.device("cpu" if SMOKE else "cuda")
    res = {"device": "cpu (smoke)" if SMOKE else torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "host": platform.node(), "date": time.strftime("%Y-%m-%d %H:%M"), "gib": a.gib, "command": " ".join(sys.argv)}

    t0 = time.perf_counter()
    nbytes = int(a.gib * 2**30) // 4096 * 4096
    host = alloc_host(nbytes, not SMOKE)
    res["pin_seconds"] = round(time.perf_counter() - t0, 2)
    h2d, d2h = copy_bandwidth(host, min(2**30, nbytes))
    res["h2d_copy_GBps"], res["d2h_copy_GBps"] = h2d, d2h
    print(f"{res['device']}: pinned {a.gib} GiB in {res['pin_seconds']} s; "
          f"copy H2D {h2d:.1f} GB/s, D2H {d2h:.1f} GB/s")

    rows_out = []
    for name, fmt, Hkv, D, per_head in CASES:
        hb = head_record_bytes(fmt, D)
        rb = Hkv * hb
        R = nbytes // rb
        src = host[:R * rb].view(R, rb)
        # correctness on real rows: write NW packed rows at random slots through the UVA scatter
        NW, NC = (256, 128) if SMOKE else (4096, 2048)
        slots = torch.randperm(R, device=dev)[:NW]
        k = torch.randn(NW, Hkv, D, device=dev)
        v = torch.randn_like(k)
        host_scatter_rows(src, slots, pack_kv(k, v, fmt).reshape(NW, rb))
        sync()
        chk = slots[torch.randint(0, NW, (NC,), device=dev)]
        chk = torch.stack([chk.roll(h) for h in range(Hkv)]) if per_head else chk
        ok_k = torch.zeros(NC, Hkv, D, device=dev)
        ok_v = torch.zeros_like(ok_k)
        rk, rv = torch.zeros(NC, Hkv, D), torch.zeros(NC, Hkv, D)
        host_gather(src, chk, ok_k, ok_v, fmt)
        host_gather_ref(src, chk.cpu(), rk, rv, fmt)
        exact = bool(torch.equal(ok_k.cpu(), rk) and torch.equal(ok_v.cpu(), rv))

        HP = 1 if per_head else triton.next_power_of_2(Hkv)
        default_rpp = default_rows_per_program(HP, D)
        tiles = [(default_rpp, 4)] if a.quick else \
            [(r, w) for r in (1, 2, 4, 8, 16, 32) for w in (4, 8) if r * HP * D <= 16384]
        for N in a.picks:
            picks = torch.stack([torch.randperm(R, device=dev)[:N] for _ in range(Hkv)]) if per_head \
                else torch.randperm(R, device=dev)[:N]
            picked_bytes = picks.numel() * (hb if per_head else rb)
            dk = torch.empty(N, Hkv, D, device=dev, dtype=torch.bfloat16)
            dvv = torch.empty_like(dk)
            for order in ("random", "sorted", "blocks"):
                sort = order == "sorted"
                pk = torch.sort(picks, dim=-1).values if order != "random" else picks
                if order == "blocks":  # the host tier's decode order: position order = ascending within each
                    # 64-row block, blocks in block-table order (here shuffled: a fragmented free list)
                    rank = torch.randperm(R // BLOCK + 1, device=dev)[pk // BLOCK]
                    pk = pk.gather(-1, torch.sort(rank * BLOCK + pk % BLOCK, dim=-1, stable=True).indices)
                runs = []
                for rpp, nw in tiles:
                    t = bench(lambda: host_gather(src, pk, dk, dvv, fmt, rows_per_program=rpp, num_warps=nw))
                    runs.append({"rows_per_program": rpp, "num_warps": nw, "us": t * 1e6,
                                 "GBps": picked_bytes / t / 1e9})
                best = max(runs, key=lambda r: r["GBps"])
                row = {"case": name, "fmt": fmt, "kv_heads": Hkv, "head_dim": D, "per_head": per_head,
                       "bytes_per_pick": hb if per_head else rb, "picks": picks.numel(), "sorted": sort, "order": order,
                       "best_GBps": best["GBps"], "best_us": best["us"], "frac_of_h2d": best["GBps"] / h2d,
                       "best_tile": [best["rows_per_program"], best["num_warps"]],
                       "default_tile_GBps": next((r["GBps"] for r in runs if (r["rows_per_program"], r["num_warps"]) == (default_rpp, 4)), None),
                       "one_row_per_program_GBps": max((r["GBps"] for r in runs if r["rows_per_program"] == 1), default=None),
                       "exact_vs_ref": exact, "sweep": runs}
                rows_out.append(row)
                print(f"{name:28s} N={picks.numel():7d} {order:8s} "
                      f"{best['GBps']:6.1f} GB/s ({100 * best['GBps'] / h2d:4.0f}% of copy) "
                      f"tile {best['rows_per_program']}x{best['num_warps']}w, {best['us']:.0f} us, exact={exact}")
        if not SMOKE:
            torch.cuda.empty_cache()
    res["gather"] = rows_out

    # locality: is a pick's cost per row (address translation) or per byte (PCIe)? Same picks count,
    # confined to F MiB, under each host allocation (THP-backed pages map with fewer entries)
    loc = []
    best_tile = {r["case"]: r["best_tile"] for r in rows_out if r["picks"] == a.picks[0] and r["order"] == "random"}
    for alloc in a.allocs if a.footprints_mib else []:
        keep = None
        if alloc == "register":
            buf = host
        elif alloc == "torch":
            buf = alloc_host(nbytes, "torch")[:nbytes] if not SMOKE else host
        else:
            huge0 = anon_huge_mib()
            buf, keep = alloc_thp(nbytes)
            res["thp_anon_huge_mib_added"] = anon_huge_mib() - huge0
        for name, fmt, Hkv, D, per_head in CASES:
            if per_head or name not in best_tile or Hkv * head_record_bytes(fmt, D) not in (512, 1088):
                continue
            rb = Hkv * head_record_bytes(fmt, D)
            rpp, nw = best_tile[name]
            for F in a.footprints_mib:
                R = min(int(F * 2**20), nbytes) // rb
                N = min(16384, R)
                picks = torch.randperm(R, device=dev)[:N]
                dk = torch.empty(N, Hkv, D, device=dev, dtype=torch.bfloat16)
                dvv = torch.empty_like(dk)
                src = buf[:R * rb].view(R, rb)
                t = bench(lambda: host_gather(src, picks, dk, dvv, fmt, rows_per_program=rpp, num_warps=nw))
                loc.append({"alloc": alloc, "case": name, "footprint_mib": F, "picks": N, "us": t * 1e6,
                            "GBps": N * rb / t / 1e9, "frac_of_h2d": N * rb / t / 1e9 / h2d})
                print(f"locality {alloc:8s} {name:24s} {F:7.0f} MiB: {loc[-1]['GBps']:5.1f} GB/s "
                      f"({100 * loc[-1]['frac_of_h2d']:.0f}% of copy)")
        if alloc == "thp" and not SMOKE:
            torch.cuda.cudart().cudaHostUnregister(buf.data_ptr())
        del buf, keep
    res["locality"] = loc
    at512 = [r for r in rows_out if r["bytes_per_pick"] == 512 and r["sorted"]]
    res["goal_512B_70pct"] = bool(at512) and min(r["frac_of_h2d"] for r in at512) >= 0.70

    # gather on the CPU, then copy: the path the zero-copy kernel replaces
    R = nbytes // 1088
    src = host[:R * 1088].view(R, 1088)
    nc = min(16384, R)
    picks = torch.sort(torch.randperm(R)[:nc]).values
    out = torch.empty(nc, 1088, dtype=torch.uint8, device=dev)
    t0 = time.perf_counter()
    for _ in range(5):
        out.copy_(src[picks])
    sync()
    t = (time.perf_counter() - t0) / 5
    res["cpu_gather_then_copy_1088B_16K_GBps"] = nc * 1088 / t / 1e9

    # write path: new rows scattered into pinned memory by the UVA kernel (a prefill chunk / decode batch)
    writes = []
    for T in ((8, 64) if SMOKE else (8, 8192)):
        rows = torch.randint(0, 255, (T, 1088), dtype=torch.uint8, device=dev)
        slots = torch.randperm(R, device=dev)[:T]
        t = bench(lambda: host_scatter_rows(src, slots, rows))
        writes.append({"rows": T, "row_bytes": 1088, "us": t * 1e6, "GBps": T * 1088 / t / 1e9})
    res["scatter_write"] = writes

    # one hot-buffer step (lookup + admit), 27B shape: B=8 x 250K tokens -> 6250 rows each, 2048 picks
    B, cap, N, Hkv, D = (2, 40, 16, 1, 16) if SMOKE else (8, 6250, 2048, 4, 256)
    hbuf = HotBuffer(1, R, B * cap, (Hkv, D), torch.bfloat16, dev, window=16)
    pids = torch.tensor([hbuf.add_sequence(rows=cap) for _ in range(B)], device=dev)
    universe = torch.stack([torch.randperm(R // B, device=dev)[:3 * cap] + b * (R // B) for b in range(B)])
    src_k = torch.zeros(B, N, Hkv, D, device=dev, dtype=torch.bfloat16)

    def step():
        picks = universe.gather(1, torch.randint(0, 3 * cap, (B, N), device=dev))
        rows = hbuf.lookup(0, picks)
        miss = torch.where(rows < 0, picks, -1)
        hbuf.admit(0, pids, miss, src_k, max_cap=cap)
    for _ in range(20):
        step()
    sync()
    hbuf.counters.reset()
    t = bench(step)
    st = hbuf.stats()
    res["hot_buffer_step"] = {"batch": B, "capacity": cap, "picks": N, "us": t * 1e6,
                              "hit_rate": st.hit_rate, "note": "random picks over 3x capacity (~1/3 hits)"}

    print(f"CPU gather + copy (1088 B, 16K): {res['cpu_gather_then_copy_1088B_16K_GBps']:.1f} GB/s")
    for w in writes:
        print(f"UVA scatter write {w['rows']} x 1088 B: {w['GBps']:.1f} GB/s ({w['us']:.0f} us; D2H copy {d2h:.1f})")
    print(f"hot buffer lookup+admit, B={B} x {N} picks, cap {cap}: {t * 1e6:.0f} us per layer")
    print(f"goal >= 70% of copy at 512 B (sorted): {res['goal_512B_70pct']}")
    print("\n| rows | picks | order | GB/s | % of copy | tile (rows x warps) |\n|---|---|---|---|---|---|")
    for r in rows_out:
        print(f"| {r['case']} | {r['picks']} | {r['order']} | {r['best_GBps']:.1f} | "
              f"{100 * r['frac_of_h2d']:.0f}% | {r['best_tile'][0]} x {r['best_tile'][1]} |")
    if loc:
        print("\n| allocation | rows | footprint MiB | GB/s | % of copy |\n|---|---|---|---|---|")
        for r in loc:
            print(f"| {r['alloc']} | {r['case']} | {r['footprint_mib']:.0f} | {r['GBps']:.1f} | {100 * r['frac_of_h2d']:.0f}% |")
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()

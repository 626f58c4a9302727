"""Sparse-decode kernels at real sizes on a GPU, each against its bytes-moved floor (HBM copy
bandwidth measured in the same run) and against dense paged attention over the whole context.

    python benchmarks/bench_sparse_ops.py --out benchmarks/results/sparse-ops.json

Shape: Qwen3.5-27B full-attention layer (24 query / 4 KV heads x 256), rank-64 int4 sketch,
batch 8 x 250K tokens, top_k 2048 + 64 sinks + 1024 recent, block size 64.
"""
import argparse
import json
import sys
import time

import torch
import triton

sys.path.insert(0, ".")
from sketchkv.ops.paged_attention import paged_attention_decode  # noqa: E402
from sketchkv.ops.sketch import quantize_int4, sketch_score, sketch_score_dot, sketch_score_ref  # noqa: E402
from sketchkv.ops.sparse_attention import sparse_attention, sparse_attention_ref  # noqa: E402
from sketchkv.ops.topk import topk, topk_positions, topk_positions_torch, topk_ref  # noqa: E402


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") / 1e3


def graphed(fn):
    """fn captured in a CUDA graph (after a warm-up that compiles its kernels): the replay, to time."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def copy_bw() -> float:
    a = torch.empty(2**30, dtype=torch.uint8, device="cuda").random_()
    b = torch.empty_like(a)
    return 2 * a.numel() / bench(lambda: b.copy_(a))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--context", type=int, default=250_000)
    p.add_argument("--top-k", type=int, default=2048)
    p.add_argument("--sinks", type=int, default=64)
    p.add_argument("--recent", type=int, default=1024)
    p.add_argument("--rank", type=int, default=64)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--out", default="benchmarks/results/sparse-ops.json")
    a = p.parse_args()
    B, L, Hq, Hkv, D, r, bs = a.batch, a.context, 24, 4, 256, a.rank, 64
    torch.manual_seed(0)
    bw = copy_bw()
    nblk = B * triton.cdiv(L, bs) + 1
    tables = (torch.randperm(nblk - 1, device="cuda")[: B * triton.cdiv(L, bs)] + 1).int().view(B, -1)
    lens = torch.full((B,), L, dtype=torch.int32, device="cuda")
    kc = torch.randn(nblk, bs, Hkv, D, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    sk, sc = quantize_int4(torch.randn(nblk, bs, Hkv, r, device="cuda"))
    q = torch.randn(B, Hq, D, device="cuda", dtype=torch.bfloat16)
    qp = torch.randn(B, Hkv, r, device="cuda")
    max_len = tables.shape[1] * bs
    rows = {}

    # correctness at full size (fresh random inputs), against the references
    s = sketch_score(qp, sk, sc, tables, lens, a.sinks, a.recent, max_len)
    s_ref = sketch_score_ref(qp[:1], sk, sc, tables[:1], lens[:1], a.sinks, a.recent, max_len)
    fin = torch.isfinite(s_ref)
    rows["sketch_score_max_abs_err"] = (s[:1][fin] - s_ref[fin]).abs().max().item()
    vals, picks = topk(s, a.top_k)
    rv, rp = topk_ref(s, a.top_k)
    rows["topk_equal_reference"] = bool(torch.equal(picks, rp))
    n = lens.long()[:, None, None]
    sinks = torch.arange(a.sinks, device="cuda").expand(B, 1, -1)
    recent = (n - a.recent + torch.arange(a.recent, device="cuda")).expand(B, 1, -1)
    idx = torch.sort(torch.cat([sinks, picks, recent], -1), -1).values.int()
    counts = torch.full((B,), idx.shape[-1], dtype=torch.int32, device="cuda")
    out = sparse_attention(q, kc, vc, tables, idx, counts, D ** -0.5)
    ref = sparse_attention_ref(q[:2], kc, vc, tables[:2], idx[:2], counts[:2], D ** -0.5)
    rows["sparse_attention_rel_err"] = ((out[:2].float() - ref.float()).norm() / ref.float().norm()).item()

    t_score = bench(lambda: sketch_score(qp, sk, sc, tables, lens, a.sinks, a.recent, max_len))
    score_bytes = B * L * Hkv * (r // 2 + 2) + B * max_len * 4
    # the engine's default head combine (softmax over each query head's scores, summed): two launches, each
    # reading the sketch once for all G query heads (per-block log-sum-exp per head, then the combined score)
    G = Hq // Hkv
    qph = torch.randn(B, Hkv, G, r, device="cuda")
    s_sm = sketch_score(qph, sk, sc, tables, lens, a.sinks, a.recent, max_len, True, "softmax", D ** -0.5)
    s_sm_ref = sketch_score_ref(qph[:1], sk, sc, tables[:1], lens[:1], a.sinks, a.recent, max_len, True, "softmax",
                                D ** -0.5)
    rows["sketch_score_softmax_max_abs_err"] = (s_sm[:1][fin] - s_sm_ref[fin]).abs().max().item()
    rows["sketch_score_softmax_us"] = bench(lambda: sketch_score(qph, sk, sc, tables, lens, a.sinks, a.recent,
                                                                 max_len, True, "softmax", D ** -0.5)) * 1e6
    # bytes: the sketch read twice + one score per token written
    rows["sketch_score_softmax_bytes"] = 2 * B * L * Hkv * (r // 2 + 2) + B * max_len * 4
    # tensor-core kernel (sketch_score_dot: tl.dot, fp16 q) on the same inputs, next to the fp32 fma kernel:
    # differences, top-k set overlap with the fma kernel's picks, and a small (blocks per program, warps) sweep.
    # (The auto scores above are the integer kernel's for sum and the dot kernel's for softmax.)
    sm_ = D ** -0.5
    s_f = sketch_score(qp, sk, sc, tables, lens, a.sinks, a.recent, max_len, kernel="fma")
    s_sm_f = sketch_score(qph, sk, sc, tables, lens, a.sinks, a.recent, max_len, True, "softmax", sm_, kernel="fma")

    def overlap(x, y):  # fraction of x's top-k positions also in y's
        px, py = topk_positions(x, a.top_k, -1), topk_positions(y, a.top_k, -1)
        return min(torch.isin(px[b], py[b]).float().mean().item() for b in range(B))
    s_dot = sketch_score_dot(qp, sk, sc, tables, lens, a.sinks, a.recent, max_len)
    s_sm_dot = sketch_score_dot(qph, sk, sc, tables, lens, a.sinks, a.recent, max_len, True, "softmax", sm_)
    rows["dot_inf_pattern_equal_fma"] = bool(torch.equal(torch.isinf(s_dot), torch.isinf(s_f))
                                             and torch.equal(torch.isinf(s_sm_dot), torch.isinf(s_sm_f)))
    fin_all = torch.isfinite(s_f)
    rows["dot_sum_max_abs_diff_vs_fma"] = (s_dot - s_f)[fin_all].abs().max().item()
    rows["dot_sum_max_abs_err_vs_ref"] = (s_dot[:1][fin] - s_ref[fin]).abs().max().item()
    rows["dot_softmax_max_abs_diff_vs_fma"] = (s_sm_dot - s_sm_f)[fin_all].abs().max().item()
    rows["dot_softmax_max_abs_err_vs_ref"] = (s_sm_dot[:1][fin] - s_sm_ref[fin]).abs().max().item()
    rows["dot_sum_topk_overlap_with_fma"] = overlap(s_f, s_dot)           # min over sequences
    rows["dot_softmax_topk_overlap_with_fma"] = overlap(s_sm_f, s_sm_dot)
    rows["sketch_score_fma_us"] = bench(lambda: sketch_score(qp, sk, sc, tables, lens, a.sinks, a.recent,
                                                             max_len, kernel="fma")) * 1e6
    rows["sketch_score_dot_us"] = bench(lambda: sketch_score_dot(qp, sk, sc, tables, lens, a.sinks, a.recent,
                                                                 max_len)) * 1e6
    rows["sketch_score_dot_sum_24_heads_us"] = bench(lambda: sketch_score_dot(
        qph, sk, sc, tables, lens, a.sinks, a.recent, max_len)) * 1e6   # G = 6 summed in-kernel, not pre-summed
    rows["sketch_score_dot_max_us"] = bench(lambda: sketch_score_dot(
        qph, sk, sc, tables, lens, a.sinks, a.recent, max_len, True, "max")) * 1e6
    rows["sketch_score_dot_softmax_us"] = bench(lambda: sketch_score_dot(
        qph, sk, sc, tables, lens, a.sinks, a.recent, max_len, True, "softmax", sm_)) * 1e6
    sweep = {}
    for bpp, nw in ((1, 4), (2, 4), (4, 4), (2, 8), (4, 8), (8, 8)):
        sweep[f"bpp{bpp}_w{nw}"] = dict(
            sum_us=bench(lambda: sketch_score_dot(qp, sk, sc, tables, lens, a.sinks, a.recent, max_len,
                                                  bpp=bpp, num_warps=nw)) * 1e6,
            softmax_us=bench(lambda: sketch_score_dot(qph, sk, sc, tables, lens, a.sinks, a.recent, max_len, True,
                                                      "softmax", sm_, bpp=bpp, num_warps=nw)) * 1e6)
    rows["sketch_score_dot_sweep"] = sweep
    t_topk = bench(lambda: topk(s, a.top_k))
    # candidate: plain fp32 torch.topk (is its set identical to the tie-breaking reference?)
    fv, fp_ = torch.topk(s, a.top_k, dim=-1)
    rows["fp32_topk_same_set_as_reference"] = bool(torch.equal(torch.sort(fp_, -1).values, torch.sort(rp, -1).values))
    rows["fp32_topk_us"] = bench(lambda: torch.topk(s, a.top_k, dim=-1)) * 1e6
    # what the engine uses: k-th value by fp32 top-k, then ties by position (exact reference set)
    tp = topk_positions(s, a.top_k, 2**31 - 1)
    rows["topk_positions_equal_reference"] = bool(torch.equal(tp.long(), torch.sort(rp, -1).values))
    rows["topk_positions_us"] = bench(lambda: topk_positions(s, a.top_k, 2**31 - 1)) * 1e6
    # peer: the same positions by PyTorch elementwise passes (the engine's path before the Triton compaction)
    rows["topk_positions_torch_equal"] = bool(torch.equal(topk_positions_torch(s, a.top_k, 2**31 - 1), tp))
    rows["topk_positions_torch_us"] = bench(lambda: topk_positions_torch(s, a.top_k, 2**31 - 1)) * 1e6
    t_attn = bench(lambda: sparse_attention(q, kc, vc, tables, idx, counts, D ** -0.5))
    attn_bytes = B * idx.shape[-1] * Hkv * D * 2 * 2
    t_dense = bench(lambda: paged_attention_decode(q, kc, vc, tables, lens, D ** -0.5))
    dense_bytes = B * L * Hkv * D * 2 * 2

    def step():  # the engine's default selection (softmax head combine) + attention
        sc_ = sketch_score(qph, sk, sc, tables, lens, a.sinks, a.recent, max_len, True, "softmax", D ** -0.5)
        p_ = topk_positions(sc_, a.top_k, 2**31 - 1)
        i_ = torch.sort(torch.cat([sinks.int(), p_, recent.int()], -1), -1).values
        return sparse_attention(q, kc, vc, tables, i_, counts, D ** -0.5)
    t_step = bench(step)

    def step_dot():  # the same with the tensor-core scoring kernel
        sc_ = sketch_score_dot(qph, sk, sc, tables, lens, a.sinks, a.recent, max_len, True, "softmax", D ** -0.5)
        p_ = topk_positions(sc_, a.top_k, 2**31 - 1)
        i_ = torch.sort(torch.cat([sinks.int(), p_, recent.int()], -1), -1).values
        return sparse_attention(q, kc, vc, tables, i_, counts, D ** -0.5)
    rows["select_plus_attention_dot_us"] = bench(step_dot) * 1e6

    # each combine's selection + attention replayed from a CUDA graph (how the engine runs a step), against its
    # bytes (for both: the sketch read once + one score per token, what a one-pass scorer moves, + the picked rows):
    # sum (group-summed query: the integer kernel) and softmax (every query head: the tensor-core kernel)
    def select_attend(qq, combine):
        sc_ = sketch_score(qq, sk, sc, tables, lens, a.sinks, a.recent, max_len, True, combine, D ** -0.5)
        p_ = topk_positions(sc_, a.top_k, 2**31 - 1)
        i_ = torch.sort(torch.cat([sinks.int(), p_, recent.int()], -1), -1).values
        return sparse_attention(q, kc, vc, tables, i_, counts, D ** -0.5)
    for combine, qq, sbytes in (("sum", qp, score_bytes), ("softmax", qph, score_bytes)):
        t = bench(graphed(lambda qq=qq, combine=combine: select_attend(qq, combine)))
        rows[f"select_{combine}_plus_attention_graph_us"] = t * 1e6
        rows[f"select_{combine}_plus_attention_floor_us"] = (sbytes + attn_bytes) / bw * 1e6
    rows.update(dict(
        date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), device=torch.cuda.get_device_name(),
        command=" ".join(sys.argv), shape=dict(batch=B, context=L, Hq=Hq, Hkv=Hkv, D=D, rank=r, block=bs,
                                               top_k=a.top_k, sinks=a.sinks, recent=a.recent),
        hbm_copy_GBps=bw / 1e9,
        sketch_score_us=t_score * 1e6, sketch_score_GBps=score_bytes / t_score / 1e9,
        sketch_score_fraction_of_copy=score_bytes / t_score / bw,
        topk_us=t_topk * 1e6, topk_all_layers_ms=t_topk * a.layers * 1e3,
        sparse_attention_us=t_attn * 1e6, sparse_attention_floor_us=attn_bytes / bw * 1e6,
        dense_attention_us=t_dense * 1e6, dense_attention_floor_us=dense_bytes / bw * 1e6,
        select_plus_attention_us=t_step * 1e6,
        select_plus_attention_floor_us=(rows["sketch_score_softmax_bytes"] + attn_bytes) / bw * 1e6,
        speedup_vs_dense=t_dense / t_step))
    json.dump(rows, open(a.out, "w"), indent=1)
    print(f"\nHBM copy {bw/1e9:.0f} GB/s; B={B} x {L} tokens, rank {r}, top-k {a.top_k}")
    print("| kernel (one layer) | time | floor | fraction |")
    print("|---|---|---|---|")
    print(f"| sketch score, sum (auto) | {t_score*1e6:.0f} us | {score_bytes/bw*1e6:.0f} us | {score_bytes/bw/t_score:.0%} |")
    sm_floor = rows['sketch_score_softmax_bytes'] / bw * 1e6
    print(f"| sketch score, softmax combine ({Hq} query heads) | {rows['sketch_score_softmax_us']:.0f} us | "
          f"{sm_floor:.0f} us | {sm_floor / rows['sketch_score_softmax_us']:.0%} |")
    for name, key, floor in (("sum, group-summed q", "sketch_score_dot_us", score_bytes / bw * 1e6),
                             ("sum, 24 query heads", "sketch_score_dot_sum_24_heads_us", score_bytes / bw * 1e6),
                             ("max, 24 query heads", "sketch_score_dot_max_us", score_bytes / bw * 1e6),
                             ("softmax, 24 query heads", "sketch_score_dot_softmax_us", sm_floor)):
        print(f"| sketch score, tensor cores, {name} | {rows[key]:.0f} us | {floor:.0f} us | {floor / rows[key]:.0%} |")
    print(f"| top-k packed keys (x{a.layers} layers: {t_topk*a.layers*1e3:.2f} ms) | {t_topk*1e6:.0f} us | | |")
    print(f"| top-k positions (engine, Triton compaction) | {rows['topk_positions_us']:.0f} us | | same set: "
          f"{rows['topk_positions_equal_reference']} |")
    print(f"| top-k positions (PyTorch passes) | {rows['topk_positions_torch_us']:.0f} us | | same tensor: "
          f"{rows['topk_positions_torch_equal']} |")
    print(f"| sparse attention | {t_attn*1e6:.0f} us | {attn_bytes/bw*1e6:.0f} us | {attn_bytes/bw/t_attn:.0%} |")
    fl = rows["select_plus_attention_floor_us"]
    print(f"| select (softmax combine) + attention | {t_step*1e6:.0f} us | {fl:.0f} us | {fl/1e6/t_step:.0%} |")
    fl_dot = rows["select_plus_attention_dot_us"]
    print(f"| select (softmax combine, tensor-core scoring) + attention | {fl_dot:.0f} us | {fl:.0f} us | "
          f"{fl / fl_dot:.0%} |")
    for combine in ("sum", "softmax"):
        t, fl = rows[f"select_{combine}_plus_attention_graph_us"], rows[f"select_{combine}_plus_attention_floor_us"]
        print(f"| select ({combine} combine) + attention, CUDA graph | {t:.0f} us | {fl:.0f} us | {fl / t:.0%} |")
    print(f"| dense paged attention | {t_dense*1e6:.0f} us | {dense_bytes/bw*1e6:.0f} us | {dense_bytes/bw/t_dense:.0%} |")
    print(f"errors: score (sum, auto: int8 query codes) {rows['sketch_score_max_abs_err']:.2e}, "
          f"topk==ref {rows['topk_equal_reference']}, "
          f"attn rel {rows['sparse_attention_rel_err']:.2e}")
    print(f"tensor-core vs fma scoring (same inputs): -inf pattern equal {rows['dot_inf_pattern_equal_fma']}; "
          f"sum max |diff| {rows['dot_sum_max_abs_diff_vs_fma']:.2e} "
          f"(vs ref {rows['dot_sum_max_abs_err_vs_ref']:.2e}), "
          f"top-k overlap {rows['dot_sum_topk_overlap_with_fma']:.4f}; softmax max |diff| "
          f"{rows['dot_softmax_max_abs_diff_vs_fma']:.2e} (vs ref {rows['dot_softmax_max_abs_err_vs_ref']:.2e}), "
          f"top-k overlap {rows['dot_softmax_topk_overlap_with_fma']:.4f}; fma sum "
          f"{rows['sketch_score_fma_us']:.0f} us")
    sweep = rows["sketch_score_dot_sweep"]
    print("dot sweep (blocks per program, warps): " + ", ".join(
        f"{k} sum {v['sum_us']:.0f} / softmax {v['softmax_us']:.0f} us" for k, v in sweep.items()))


if __name__ == "__main__":
    main()

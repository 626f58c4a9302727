"""Where a decode step's time goes.

On a GPU (`profile_kernels`): the CUDA-graph decode steps themselves under torch.profiler (CUPTI
records every kernel a graph replay runs), kernel time per step summed by kernel name and by kind
(GEMMs = weight reads, fla's GDN kernels, each of our Triton kernels, torch's small index /
elementwise / sort / scan kernels, copies). Nothing is timed eagerly: an eager step's time is
launch latency, not GPU time (the region method below gave ~180 ms eager against a 32 ms graph step).

On a CPU (`measure`): timed regions around the layer groups, over a few eager steps.

The engine's own functions are wrapped for the duration of the measurement (nothing in the engine knows):

    gdn          the Gated DeltaNet state kernels (causal conv update + gated delta rule decode)
    selection    sparse layers' select(): query projection, sketch scores, top-k, sinks + recent
    tier_gather  the host tier's gather: hot-buffer lookups and composing the compact K/V (self time)
    pcie_misses  inside it, the zero-copy read of missed rows from pinned host memory
    attention    the attention kernels (paged decode; sparse attention over the picks)
    tier_write   new rows to the host tier (+ hot-buffer invalidation) and admitting misses to the hot buffer
    lm_head      the logits GEMM
    weights      the rest of the forward: projections, MLPs, norms, embedding (the weight reads)

On a GPU the regions are CUDA events; before each step's forward the stream is held by a sleep kernel
long enough for the host to enqueue the whole eager step, so the GPU then runs it back to back and an
event interval is GPU time, not the host's launch latency. Region times are self times (a nested
region's time is subtracted from its parent's). Eager steps are slower than the CUDA-graph steps the
benchmark times: compare the sums with the graph step time, or use the fractions. On a CPU: wall time.
"""
from __future__ import annotations

import functools
import time
from contextlib import contextmanager

import torch

GROUPS = ("weights", "gdn", "selection", "tier_gather", "pcie_misses", "attention", "tier_write", "lm_head")


class Regions:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.records: list[list] = []   # [group, start, end, parent index]
        self.stack: list[int] = []

    def _mark(self):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def wrap(self, fn, group: str):
        @functools.wraps(fn)
        def inner(*a, **kw):
            i = len(self.records)
            self.records.append([group, self._mark(), None, self.stack[-1] if self.stack else None])
            self.stack.append(i)
            try:
                return fn(*a, **kw)
            finally:
                self.stack.pop()
                self.records[i][2] = self._mark()
        return inner

    def self_times(self) -> dict[str, float]:
        """Seconds per group (self time), over everything recorded; clears the records."""
        if self.cuda:
            torch.cuda.synchronize()
            el = [r[1].elapsed_time(r[2]) / 1e3 for r in self.records]
        else:
            el = [r[2] - r[1] for r in self.records]
        own = list(el)
        for i, r in enumerate(self.records):
            if r[3] is not None:
                own[r[3]] -= el[i]
        out = {g: 0.0 for g in GROUPS}
        for r, t in zip(self.records, own):
            out[r[0]] += t
        self.records.clear()
        return out


@contextmanager
def _patched(pairs):
    """pairs: (object, attribute, replacement); restored afterwards (instance attributes deleted)."""
    saved = []
    try:
        for obj, name, new in pairs:
            saved.append((obj, name, obj.__dict__.get(name, _MISSING) if hasattr(obj, "__dict__") else _MISSING))
            setattr(obj, name, new)
        yield
    finally:
        for obj, name, old in reversed(saved):
            if old is _MISSING:
                delattr(obj, name)
            else:
                setattr(obj, name, old)


_MISSING = object()


def _sleep_cycles(seconds: float) -> int:
    try:
        khz = torch.cuda.get_device_properties(torch.cuda.current_device()).clock_rate
    except AttributeError:
        khz = 2_000_000
    return int(seconds * khz * 1e3)


KERNEL_KINDS = (  # (kind, substrings of the kernel name), first match wins
    ("gdn (fla)", ("gated_delta", "chunk_", "recurrent", "causal_conv", "_gdn_gates", "l2norm")),
    ("sketch score", ("_sketch_score", "_query_words", "_head_lse", "_lse_finish", "_softmax_combine")),
    ("top-k", ("_count_kernel", "_compact_kernel", "_radix_", "topk", "radixSort", "RadixSort", "bitonic")),
    ("attention", ("_decode_split", "_decode_reduce", "sparse_attention", "flash")),
    ("host gather (PCIe)", ("_host_gather",)),
    ("scatter rows", ("_scatter_rows",)),
    ("rmsnorm", ("_rms_norm",)),
    ("gemm (weights)", ("gemm", "gemv", "nvjet", "cutlass", "xmma", "cublas", "splitKreduce", "_w4a16", "_dequant_kernel")),
    ("memcpy / memset", ("memcpy", "Memcpy", "memset", "Memset")),
    ("sort / scan (torch)", ("sort", "Sort", "scan", "Scan", "cumsum", "cub::")),
    ("index / gather (torch)", ("index", "gather", "scatter", "Index")),
    ("reduce (torch)", ("reduce", "Reduce")),
    ("elementwise (torch)", ("elementwise", "Elementwise")),
)


def kernel_kind(name: str) -> str:
    for kind, keys in KERNEL_KINDS:
        if any(k in name for k in keys):
            return kind
    return "other"


def profile_kernels(engine, steps: int, top: int = 300) -> dict:
    """`steps` decode steps as the benchmark runs them (CUDA graphs) under torch.profiler.
    -> {"ms": {kind: ms per step}, "total_ms", "steps", "kernels": [{name, kind, calls, us} per step]}."""
    from torch.profiler import ProfilerActivity, profile
    engine.step()                       # warm: the profiled steps replay captured graphs
    torch.cuda.synchronize()
    done = 0
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            if not engine.scheduler.running:
                break
            engine.step()
            done += 1
        torch.cuda.synchronize()
    per, spans = {}, []
    for ev in prof.events():
        # record_function ranges (llm_engine.step's phases) show up on the GPU timeline too: not kernels
        if ev.device_type != torch.autograd.DeviceType.CUDA or getattr(ev, "is_user_annotation", False) \
                or ev.name.startswith(("runner.", "spec.")):
            continue
        t = ev.time_range.elapsed_us()
        c, u = per.get(ev.name, (0, 0.0))
        per[ev.name] = (c + 1, u + t)
        spans.append((ev.device_resource_id, ev.time_range.start, ev.time_range.end))
    n = max(1, done)
    streams = stream_times(spans, n)
    kernels = sorted(({"name": k[:120], "kind": kernel_kind(k), "calls": c / n, "us": u / n}
                      for k, (c, u) in per.items()), key=lambda r: -r["us"])
    ms: dict[str, float] = {}
    for r in kernels:
        ms[r["kind"]] = ms.get(r["kind"], 0.0) + r["us"] / 1e3
    return {"ms": dict(sorted(ms.items(), key=lambda kv: -kv[1])), "total_ms": sum(ms.values()), "steps": done,
            "kernels": kernels[:top], "kernels_per_step": sum(r["calls"] for r in kernels), **streams,
            "method": "torch.profiler kernel times over CUDA-graph decode steps"}


def busy_us(spans) -> float:
    """Length of the union of (start, end) intervals: time at least one of them runs."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def stream_times(spans, steps: int) -> dict:
    """spans [(stream, start us, end us)] of every GPU kernel over `steps` steps -> per step: each stream's busy
    ms (most first: the step's own stream, then the side streams whose work overlaps it) and the GPU's busy ms
    (any stream running). A graph step minus its main stream's busy time is the time that stream waits: launch
    gaps between dependent kernels, and joins on the side streams."""
    by = {}
    for s, a, b in spans:
        by.setdefault(s, []).append((a, b))
    per = sorted(((busy_us(v) / steps / 1e3, len(v) / steps) for v in by.values()), reverse=True)
    return {"stream_ms": [round(ms, 4) for ms, _ in per], "stream_kernels": [round(k, 1) for _, k in per],
            "gpu_busy_ms": busy_us([(a, b) for _, a, b in spans]) / steps / 1e3}


def measure(engine, steps: int) -> dict:
    """Run `steps` eager decode steps of the engine's running sequences with timed regions.
    -> {"ms": {group: ms per step}, "total_ms": sum, "steps": n}."""
    import sketchkv.layers.attention as attn_mod
    import sketchkv.layers.gated_deltanet as gdn_mod
    import sketchkv.layers.sparse_attention as sparse_mod
    import sketchkv.layers.tiered_attention as tiered_mod
    runner = engine.runner
    reg = Regions(runner.device)
    model = runner.model
    fwd = model.forward
    hold = {"s": 0.0}

    def forward(*a, **kw):
        if reg.cuda and hold["s"] > 0:
            torch.cuda._sleep(_sleep_cycles(hold["s"]))
        return reg.wrap(fwd, "weights")(*a, **kw)

    pairs = [(gdn_mod, "causal_conv1d_decode", reg.wrap(gdn_mod.causal_conv1d_decode, "gdn")),
             (gdn_mod, "gated_delta_rule_decode", reg.wrap(gdn_mod.gated_delta_rule_decode, "gdn")),
             (attn_mod, "paged_attention_decode", reg.wrap(attn_mod.paged_attention_decode, "attention")),
             (tiered_mod, "paged_attention_decode", reg.wrap(tiered_mod.paged_attention_decode, "attention")),
             (sparse_mod, "sparse_attention", reg.wrap(sparse_mod.sparse_attention, "attention")),
             (model, "forward", forward),
             (model, "compute_logits", reg.wrap(model.compute_logits, "lm_head"))]
    for m in runner.sparse_layers:
        pairs.append((m, "select", reg.wrap(m.select, "selection")))
    tier = runner.tier
    if tier is not None:
        pairs += [(tier, "gather", reg.wrap(tier.gather, "tier_gather")),
                  (tier.store, "gather", reg.wrap(tier.store.gather, "pcie_misses")),
                  (tier, "write", reg.wrap(tier.write, "tier_write")),
                  (tier.hot, "admit", reg.wrap(tier.hot.admit, "tier_write"))]
    graphs = dict(runner.graphs)
    runner.graphs.clear()   # eager steps
    totals = {g: 0.0 for g in GROUPS}
    done = 0
    try:
        with _patched(pairs):
            t0 = time.perf_counter()
            engine.step()            # warm (also: how long the host takes to enqueue one eager step)
            if reg.cuda:
                torch.cuda.synchronize()
            hold["s"] = min(1.0, 2 * (time.perf_counter() - t0))
            reg.self_times()
            for _ in range(steps):
                if not engine.scheduler.running:
                    break
                engine.step()
                for g, t in reg.self_times().items():
                    totals[g] += t
                done += 1
    finally:
        runner.graphs.update(graphs)
    ms = {g: 1e3 * t / max(1, done) for g, t in totals.items()}
    return {"ms": ms, "total_ms": sum(ms.values()), "steps": done,
            "method": "cuda events behind a sleep kernel (eager steps)" if reg.cuda else "wall time (eager steps)"}

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

import bisect
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
    ("host gather (PCIe)", ("_host_gather", "_host_copy_rows")),
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


def profile_steps(engine, steps: int) -> dict:
    """`steps` decode steps as the benchmark runs them (CUDA graphs) under torch.profiler, each step in a
    `bench.step` range that ends with a device sync (as the timed steps do).
    -> {"spans": [(stream, start us, end us, name, launched by a graph replay)] of every kernel, "per_step":
    those spans split by step (split_steps), "windows": each step's host (start, end) in us on the kernels'
    clock, "launches": the host (start, end) of every cudaGraphLaunch call, "steps": n}."""
    from torch.profiler import ProfilerActivity, profile, record_function
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)   # (CPU: no kernels, windows only)
    engine.step()                       # warm: the profiled steps replay captured graphs
    sync()
    done = 0
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            if not engine.scheduler.running:
                break
            with record_function("bench.step"):
                engine.step()
                sync()
            done += 1
    spans, windows, launches, launch_ranges = [], [], set(), []
    events = prof.events()
    for ev in events:   # a graph replay's kernels carry the correlation id of its cudaGraphLaunch call
        if ev.device_type != torch.autograd.DeviceType.CUDA and ev.name.startswith("cudaGraphLaunch"):
            launches.add(ev.id)
            launch_ranges.append((ev.time_range.start, ev.time_range.end))
    for ev in events:
        if ev.device_type != torch.autograd.DeviceType.CUDA:
            if ev.name == "bench.step":
                windows.append((ev.time_range.start, ev.time_range.end))
            continue
        # record_function ranges (llm_engine.step's phases) show up on the GPU timeline too: not kernels
        if getattr(ev, "is_user_annotation", False) or ev.name.startswith(("runner.", "spec.", "bench.")):
            continue
        spans.append((ev.device_resource_id, ev.time_range.start, ev.time_range.end, ev.name, ev.id in launches))
    windows.sort()
    return {"spans": spans, "per_step": split_steps(spans, [w[0] for w in windows]), "windows": windows,
            "launches": sorted(launch_ranges), "steps": done}


def kernel_summary(spans, steps: int, top: int = 300) -> dict:
    """spans [(stream, start us, end us, name)] of `steps` steps -> per step: kernel time by kind and by name,
    kernels per step, each stream's busy time and the GPU's (stream_times)."""
    per = {}
    for _, a, b, name, *_ in spans:
        c, u = per.get(name, (0, 0.0))
        per[name] = (c + 1, u + (b - a))
    n = max(1, steps)
    streams = stream_times([s[:3] for s in spans], n)
    kernels = sorted(({"name": k[:120], "kind": kernel_kind(k), "calls": c / n, "us": u / n}
                      for k, (c, u) in per.items()), key=lambda r: -r["us"])
    ms: dict[str, float] = {}
    for r in kernels:
        ms[r["kind"]] = ms.get(r["kind"], 0.0) + r["us"] / 1e3
    return {"ms": dict(sorted(ms.items(), key=lambda kv: -kv[1])), "total_ms": sum(ms.values()), "steps": steps,
            "kernels": kernels[:top], "kernels_per_step": sum(r["calls"] for r in kernels), **streams,
            "method": "torch.profiler kernel times over CUDA-graph decode steps"}


def profile_kernels(engine, steps: int, top: int = 300) -> dict:
    """`steps` decode steps as the benchmark runs them (CUDA graphs) under torch.profiler.
    -> {"ms": {kind: ms per step}, "total_ms", "steps", "kernels": [{name, kind, calls, us} per step]}."""
    p = profile_steps(engine, steps)
    return kernel_summary(p["spans"], p["steps"], top)


# ----------------------------------------------------------------------------------------------------------
# One step's timeline (`sketchkv bench step --profile`); pure functions of kernel spans
# ----------------------------------------------------------------------------------------------------------
def split_steps(spans, starts) -> list[list]:
    """spans [(stream, start us, end us, ...)] -> one list per step, each ordered by start: step i holds the
    spans that start in [starts[i], starts[i + 1]) (the last step: from starts[-1] on). Kernels before the
    first step are dropped. Exact when each step ends with a device sync: its kernels start inside it."""
    out = [[] for _ in starts]
    for sp in sorted(spans, key=lambda s: (s[1], s[2])):
        i = bisect.bisect_right(starts, sp[1]) - 1
        if i >= 0:
            out[i].append(sp)
    return out


def step_timeline(spans, window: tuple | None = None, top_gaps: int = 20, launches=()) -> dict:
    """One step's kernel spans [(stream, start us, end us, name[, in_graph])] -> its timeline, in start order.

    Each kernel: start_us (from the step's first kernel), us, gap_us = the GPU's idle time before it (no kernel
    of any stream running; a CUDA graph replay spreads one step's kernels over several hardware streams, so a
    gap on one stream is not the GPU waiting), kind, stream (0 = the busiest), graph (launched by the graph
    replay; False without the flag). Totals: kernel_ms (sum of kernel times; overlapping kernels counted twice),
    busy_ms (union of kernels: GPU busy), span_ms (first kernel start to last kernel end), gap_ms = span_ms -
    busy_ms (the sum of the gaps); with window (the step's host start, end on the same clock): host_ms, lead_ms
    (host work before the first kernel), tail_ms (after the last one), launch_ms (the host's time inside
    cudaGraphLaunch calls, `launches` [(start, end)] on the same clock, within the window). main_stream: the busiest stream's busy
    ms, kernels and gaps (its span - its busy time). graph (when any kernel is a graph's): the same from its
    first kernel's start to its last one's end; what lies outside is the step's eager work (inputs, sampling)
    and the host's launch. Per kind: ms and count. The `top_gaps` largest gaps (top_graph_gaps: those inside the
    graph) with the kernel that ended last before each and the kernel after it."""
    sp = sorted(spans, key=lambda s: (s[1], s[2]))
    if not sp:
        return {"kernels": [], "totals": {"kernels": 0, "kernel_ms": 0.0, "busy_ms": 0.0, "span_ms": 0.0,
                                          "gap_ms": 0.0, "gaps": 0, "streams": 0}, "by_kind": {}, "top_gaps": [],
                "top_graph_gaps": [], "gap_ms_before_kind": {}}
    busy_by = {}
    for s, a, b, *_ in sp:
        busy_by.setdefault(s, []).append((a, b))
    order = sorted(busy_by, key=lambda s: -busy_us(busy_by[s]))
    idx = {s: i for i, s in enumerate(order)}
    t0 = sp[0][1]
    graph = [len(x) > 4 and bool(x[4]) for x in sp]
    g0 = min((x[1] for x, g in zip(sp, graph) if g), default=None)
    g1 = max((x[2] for x, g in zip(sp, graph) if g), default=None)
    kernels, gaps, by_kind, gap_kind = [], [], {}, {}
    end, last = float("-inf"), None   # the latest end so far and the kernel that has it
    for i, (s, a, b, name, *_) in enumerate(sp):
        kind = kernel_kind(name)
        gap = max(0.0, a - end) if i else 0.0
        kernels.append({"start_us": a - t0, "us": b - a, "gap_us": gap, "kind": kind, "stream": idx[s],
                        "graph": graph[i], "name": name[:120]})
        if gap > 0:
            gaps.append((gap, i, last, g0 is not None and g0 < a <= g1))
            gap_kind[kind] = gap_kind.get(kind, 0.0) + gap / 1e3
        c, ms = by_kind.get(kind, (0, 0.0))
        by_kind[kind] = (c + 1, ms + (b - a) / 1e3)
        if b > end:
            end, last = b, i
    busy = busy_us([x[1:3] for x in sp])
    span = end - t0
    main = busy_by[order[0]]
    main_busy = busy_us(main)
    totals = {"kernels": len(sp), "kernel_ms": sum(x[2] - x[1] for x in sp) / 1e3, "busy_ms": busy / 1e3,
              "span_ms": span / 1e3, "gap_ms": (span - busy) / 1e3, "gaps": len(gaps),
              "streams": len(order),
              "main_stream": {"kernels": len(main), "busy_ms": main_busy / 1e3,
                              "gap_ms": (max(b for _, b in main) - min(a for a, _ in main) - main_busy) / 1e3}}
    if g0 is not None:
        inside = [g for g in gaps if g[3]]
        gap_in = sum(g[0] for g in inside)
        totals["graph"] = {"kernels": sum(graph), "start_ms": (g0 - t0) / 1e3, "span_ms": (g1 - g0) / 1e3,
                           "busy_ms": (g1 - g0 - gap_in) / 1e3, "gap_ms": gap_in / 1e3, "gaps": len(inside)}
    if window is not None:
        totals.update(host_ms=(window[1] - window[0]) / 1e3, lead_ms=(t0 - window[0]) / 1e3,
                      tail_ms=(window[1] - end) / 1e3,
                      launch_ms=sum(b - a for a, b in launches if window[0] <= a < window[1]) / 1e3)

    def top(gs):
        return [{"gap_us": gap, "at_us": kernels[i]["start_us"] - gap, "index": i, "in_graph": ing,
                 "before": {k: kernels[j][k] for k in ("name", "kind", "us")},
                 "after": {k: kernels[i][k] for k in ("name", "kind", "us")}}
                for gap, i, j, ing in sorted(gs, key=lambda g: -g[0])[:top_gaps]]
    return {"kernels": kernels, "totals": totals,
            "by_kind": {k: {"ms": ms, "count": c} for k, (c, ms) in sorted(by_kind.items(), key=lambda kv: -kv[1][1])},
            "top_gaps": top(gaps), "top_graph_gaps": top([g for g in gaps if g[3]]),
            "gap_ms_before_kind": dict(sorted(gap_kind.items(), key=lambda kv: -kv[1]))}


def attention_layers(kernels: list[dict]) -> dict:
    """A step's timeline kernels (step_timeline's, in start order) -> each host-tier attention layer's critical
    section, from its rotary kernel (the layer's queries and keys are ready) to its last attention kernel's end, in us:
    lead (before the first host gather starts: the first read group's selection; PCIe idle), pcie_busy (host gather
    kernels running: the misses over PCIe and the hot hits' short gathers), pcie_idle (inside the span from the first
    gather's start to the last one's end, none running: the read groups' composes, waiting for a selection), tail
    (after the last gather ends: the last group's key base and attention) and layer (= the four). -> {"layers": [..],
    "mean_us": per layer, "sum_ms": per step}; {} where the step has no host gathers (no tier)."""
    starts = [i for i, k in enumerate(kernels) if "rotary" in k["name"]]
    layers = []
    for i, j in zip(starts, starts[1:] + [len(kernels)]):
        ks = kernels[i:j]
        t0 = ks[0]["start_us"]
        pcie = [(k["start_us"], k["start_us"] + k["us"]) for k in ks if k["kind"] == "host gather (PCIe)"]
        att = [k["start_us"] + k["us"] for k in ks if k["kind"] == "attention"]
        if not pcie or not att:
            continue
        g0, g1 = min(a for a, _ in pcie), max(b for _, b in pcie)
        end = max(att)
        busy = busy_us(pcie)
        layers.append({"lead": g0 - t0, "pcie_busy": busy, "pcie_idle": g1 - g0 - busy,
                       "tail": max(0.0, end - g1), "layer": max(end, g1) - t0})
    if not layers:
        return {}
    keys = list(layers[0])
    return {"layers": layers, "mean_us": {k: sum(x[k] for x in layers) / len(layers) for k in keys},
            "sum_ms": {k: sum(x[k] for x in layers) / 1e3 for k in keys}}


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
        pairs += [(tier, "compose", reg.wrap(tier.compose, "tier_gather")),
                  (tier, "fill_hits", reg.wrap(tier.fill_hits, "tier_gather")),
                  (tier.store, "gather", reg.wrap(tier.store.gather, "pcie_misses")),
                  (tier.store, "copy_rows", reg.wrap(tier.store.copy_rows, "pcie_misses")),
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

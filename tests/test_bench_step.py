"""`sketchkv bench step`: the per-step timeline arithmetic on synthetic kernel spans (how a profile becomes steps,
gaps and kinds), the report written from it, and the command end to end on a CPU (the bundled reference model,
timed regions) and on a GPU (the kernel timeline; `gpu` marker)."""
import json
import os
import random
import subprocess
import sys
import warnings
from types import SimpleNamespace

import pytest
import torch

from sketchkv.bench.breakdown import (attention_layers, busy_us, kernel_summary, profile_steps, split_steps,
                                      step_timeline)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["--sparse-top-k", "128", "--sparse-sink-tokens", "16", "--sparse-recent-tokens", "128", "--hbm-gib", "0.05",
         "--quiet"]


def bench_step(args: list[str], timeout: int = 300) -> str:
    """The CLI in a child process, one thread (the CI machine's 2 cores are shared); -> its stdout."""
    env = {**os.environ, "OMP_NUM_THREADS": "1",   # this checkout first, then whatever the caller put on the path
           "PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)}
    r = subprocess.run([sys.executable, "-m", "sketchkv", "bench", "step", *args], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    return r.stdout


def test_split_steps_assigns_each_kernel_to_the_step_it_starts_in():
    starts = [100.0, 200.0, 300.0]
    spans = [(7, 50, 60, "warm"),                       # before the first step: dropped
             (7, 210, 230, "b1"), (7, 110, 120, "a1"), (9, 115, 190, "a_side"), (7, 130, 150, "a2"),
             (7, 200, 205, "b0"),                       # exactly at a step's start: that step
             (9, 199.5, 260, "a_late"),                 # starts before step 1 begins: step 0, however long it runs
             (7, 305, 310, "c0"), (7, 900, 910, "c1")]  # the last step is open-ended
    steps = split_steps(spans, starts)
    assert [[s[3] for s in st] for st in steps] == [["a1", "a_side", "a2", "a_late"], ["b0", "b1"], ["c0", "c1"]]
    assert split_steps([], starts) == [[], [], []]


def test_step_timeline_gaps_are_gpu_idle_time_across_streams():
    """Gaps are measured against the latest end of any earlier kernel (a side-stream kernel that covers a main-stream
    pause leaves no gap); busy is the union; span = busy + gaps; kinds counted; the largest gaps name the kernel that
    ended last before them and the one after."""
    spans = [(1, 1000, 1010, "nvjet_tst_gemm"),          # 0: gemm, first kernel: no gap
             (1, 1012, 1014, "_rms_norm_kernel"),        # 1: 2 us gap
             (2, 1013, 1030, "_host_gather_kernel"),     # 2: side stream, starts inside kernel 1: no gap
             (1, 1020, 1022, "_sketch_score_kernel"),    # 3: inside kernel 2: no gap
             (1, 1040, 1050, "nvjet_tst_gemm"),          # 4: 10 us gap after kernel 2 (which ended last)
             (1, 1055, 1056, "something new")]           # 5: 5 us gap
    launches = [(980, 985), (995, 999), (1060, 1061.5)]   # the first is before the window: not this step's
    tl = step_timeline(list(reversed(spans)), window=(990, 1070), top_gaps=2, launches=launches)
    ks, t = tl["kernels"], tl["totals"]
    assert [k["gap_us"] for k in ks] == [0, 2, 0, 0, 10, 5]
    assert [k["start_us"] for k in ks] == [0, 12, 13, 20, 40, 55]
    assert [k["us"] for k in ks] == [10, 2, 17, 2, 10, 1]
    assert [k["stream"] for k in ks] == [0, 0, 1, 0, 0, 0]    # stream 1 is the busier (25 us vs 17 us)
    assert t["kernels"] == 6 and t["gaps"] == 3 and t["streams"] == 2
    assert t["kernel_ms"] == pytest.approx(42e-3) and t["busy_ms"] == pytest.approx(39e-3)
    assert t["span_ms"] == pytest.approx(56e-3) and t["gap_ms"] == pytest.approx(17e-3)
    assert t["host_ms"] == pytest.approx(80e-3) and t["lead_ms"] == pytest.approx(10e-3)
    assert t["tail_ms"] == pytest.approx(14e-3) and t["launch_ms"] == pytest.approx(5.5e-3)
    assert t["main_stream"] == {"kernels": 5, "busy_ms": pytest.approx(25e-3), "gap_ms": pytest.approx(31e-3)}
    assert {k: (v["count"], round(v["ms"] * 1e3, 6)) for k, v in tl["by_kind"].items()} == {
        "gemm (weights)": (2, 20), "host gather (PCIe)": (1, 17), "rmsnorm": (1, 2), "sketch score": (1, 2),
        "other": (1, 1)}
    assert list(tl["by_kind"])[0] == "gemm (weights)"         # most time first
    g10, g5 = tl["top_gaps"]
    assert (g10["gap_us"], g10["at_us"], g10["index"]) == (10, 30, 4)
    assert g10["before"]["name"] == "_host_gather_kernel" and g10["after"]["kind"] == "gemm (weights)"
    assert (g5["gap_us"], g5["before"]["name"], g5["after"]["name"]) == (5, "nvjet_tst_gemm", "something new")
    assert tl["gap_ms_before_kind"] == {"gemm (weights)": pytest.approx(10e-3), "other": pytest.approx(5e-3),
                                        "rmsnorm": pytest.approx(2e-3)}
    empty = step_timeline([])
    assert empty["totals"]["kernels"] == 0 and empty["kernels"] == [] and empty["top_gaps"] == []


def test_step_timeline_separates_the_graph_replay():
    """Kernels flagged as launched by the graph replay bound the graph's part of the step: its gaps are the ones
    between its first and last kernel; the eager work around it (inputs before, sampling after) and the wait for
    the launch are outside."""
    spans = [(1, 0, 1, "Memcpy HtoD", False), (1, 30, 31, "Memcpy HtoD", False),   # inputs: 29 us host gap
             (2, 1000, 1100, "nvjet_a", True),                                   # 969 us: the launch
             (2, 1103, 1110, "_rms_norm_kernel", True), (3, 1105, 1120, "_host_gather_kernel", True),
             (2, 1121, 1200, "nvjet_b", True),
             (1, 1250, 1251, "elementwise_sample", False)]                       # sampling: 50 us after
    tl = step_timeline(spans, top_gaps=5)
    g, t = tl["totals"]["graph"], tl["totals"]
    assert [k["graph"] for k in tl["kernels"]] == [False, False, True, True, True, True, False]
    assert g == {"kernels": 4, "start_ms": pytest.approx(1.0), "span_ms": pytest.approx(0.2),
                 "busy_ms": pytest.approx(0.196), "gap_ms": pytest.approx(0.004), "gaps": 2}
    assert t["gap_ms"] == pytest.approx((29 + 969 + 3 + 1 + 50) / 1e3)
    assert [x["gap_us"] for x in tl["top_graph_gaps"]] == [3, 1] and all(x["in_graph"] for x in tl["top_graph_gaps"])
    assert [x["gap_us"] for x in tl["top_gaps"]] == [969, 50, 29, 3, 1]
    assert not step_timeline(spans[:2])["totals"].get("graph")   # eager steps: no graph part
    assert "graph" not in step_timeline([s[:4] for s in spans])["totals"]   # spans without the flag


def test_attention_layers_split_each_layer_at_its_reads():
    """Each attention layer (rotary kernel to its last attention kernel): the lead before its first host gather,
    the gathers' busy time and the idle time between them, the tail after the last; a GDN layer between two attention
    layers and an attention layer without host gathers (no tier) add nothing."""
    g = lambda a, b: (0, a, b, "_host_gather_kernel")   # noqa: E731
    spans = [(1, 0, 2, "_rotary_kernel"), (1, 5, 100, "_sketch_score_dot_kernel"), (1, 100, 120, "_compact_kernel"),
             g(130, 300), (1, 150, 250, "_sketch_score_dot_kernel"), g(300, 310), g(320, 500),
             (0, 500, 530, "_decode_split_kernel"), (0, 530, 540, "_decode_reduce_kernel"),
             (1, 541, 700, "nvjet_gemm"), (1, 700, 720, "_gdn_rows_kernel"),            # the GDN layers after it
             (1, 1000, 1002, "_rotary_kernel"), (1, 1010, 1050, "_sketch_score_dot_kernel"), g(1060, 1160),
             (0, 1160, 1180, "_decode_split_kernel"), (1, 1200, 1300, "nvjet_gemm"),
             (1, 2000, 2002, "_rotary_kernel"), (1, 2005, 2050, "_decode_split_kernel")]   # dense: no reads
    a = attention_layers(step_timeline(spans)["kernels"])
    assert a["layers"] == [{"lead": 130, "pcie_busy": 360, "pcie_idle": 10, "tail": 40, "layer": 540},
                           {"lead": 60, "pcie_busy": 100, "pcie_idle": 0, "tail": 20, "layer": 180}]
    assert a["mean_us"]["lead"] == 95 and a["sum_ms"]["layer"] == pytest.approx(0.72)
    for x in a["layers"]:
        assert x["lead"] + x["pcie_busy"] + x["pcie_idle"] + x["tail"] == x["layer"]
    assert attention_layers(step_timeline(spans[-2:])["kernels"]) == {}


def test_step_timeline_sums_on_random_spans():
    """On any spans: the gaps add up to span - busy, the kernel times to the kernel sum, the kinds to the count."""
    rng = random.Random()
    for _ in range(20):
        spans = []
        for _ in range(rng.randint(1, 60)):
            a = rng.uniform(0, 500)
            spans.append((rng.choice([3, 4, 5]), a, a + rng.uniform(0, 20), rng.choice(["gemm", "x", "_rms_norm"])))
        tl = step_timeline(spans)
        t, ks = tl["totals"], tl["kernels"]
        assert sum(k["gap_us"] for k in ks) / 1e3 == pytest.approx(t["gap_ms"], abs=1e-9)
        assert t["busy_ms"] == pytest.approx(busy_us([s[1:3] for s in spans]) / 1e3)
        assert t["span_ms"] == pytest.approx(t["busy_ms"] + t["gap_ms"])
        assert sum(k["us"] for k in ks) / 1e3 == pytest.approx(t["kernel_ms"])
        assert sum(v["count"] for v in tl["by_kind"].values()) == len(spans) == t["kernels"]
        assert sum(v["ms"] for v in tl["by_kind"].values()) == pytest.approx(t["kernel_ms"])
        assert [k["start_us"] for k in ks] == sorted(k["start_us"] for k in ks) and ks[0]["start_us"] == 0


def test_profile_steps_finds_one_window_per_step():
    """The profiler pass: one `bench.step` window per step run (in order, disjoint), stopping when no agent is left;
    on a CPU there are no kernels, so no spans."""
    running = [1]
    calls = []

    def step():
        calls.append(1)
        torch.randn(256, 256).sum()
        if len(calls) == 4:   # the warm step + 3 profiled steps, then the agent finishes
            running.clear()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # "CUDA is not available, disabling CUDA profiling"
        p = profile_steps(SimpleNamespace(step=step, scheduler=SimpleNamespace(running=running)), steps=10)
    assert p["steps"] == 3 and len(calls) == 4 and len(p["windows"]) == 3
    w = p["windows"]
    assert all(a < b for a, b in w) and all(w[i][1] <= w[i + 1][0] for i in range(2))
    if not torch.cuda.is_available():
        assert p["spans"] == [] and p["per_step"] == [[], [], []]


def test_kernel_summary_per_step_means():
    """bench agents --breakdown's table from spans: calls and us per step by kernel name, ms by kind."""
    spans = [(1, 0, 10, "nvjet_a"), (1, 12, 14, "_rms_norm_kernel"), (2, 5, 9, "nvjet_a"),
             (1, 100, 110, "nvjet_a"), (1, 112, 114, "_rms_norm_kernel"), (2, 105, 109, "nvjet_a")]
    s = kernel_summary(spans, steps=2)
    assert s["kernels_per_step"] == 3 and s["steps"] == 2
    assert s["kernels"][0] == {"name": "nvjet_a", "kind": "gemm (weights)", "calls": 2.0, "us": 14.0}
    assert s["ms"] == {"gemm (weights)": pytest.approx(0.014), "rmsnorm": pytest.approx(0.002)}
    assert s["stream_ms"] == [0.012, 0.004] and s["gpu_busy_ms"] == pytest.approx(0.012)


def test_report_of_a_kernel_timeline(tmp_path):
    """The GPU report's Markdown and plot, from a synthetic profile (no GPU needed to draw one)."""
    from sketchkv.bench import step
    spans = [(1, 1000 + 20 * i, 1010 + 20 * i, ["nvjet_tst", "_rms_norm_kernel", "_host_gather_kernel"][i % 3], i > 2)
             for i in range(30)] + [(2, 1005, 1300, "_scatter_rows_kernel", True)]
    per = [step_timeline(spans, (990, 1700))]
    r = {"info": {"command": "sketchkv bench step --profile", "date": "2026-12-05T00:00:00", "device": "NVIDIA X",
                  "torch": "2"},
         "model": "random:x", "config": "sparse", "agents": 2, "context": 4096, "text": "random token ids",
         "bandwidth": {"hbm": 3e12, "pcie": 5e10}, "sparse": {"top_k": 8, "sink_tokens": 1, "recent_tokens": 2,
                                                             "host_format": "int4", "head_combine": "softmax"},
         "prefill": {"mode": "random", "filled_tokens_per_agent": 3072},
         "decode": {"steps": 4, "step_ms_mean": 0.8, "step_ms_p50": 0.8, "step_ms_min": 0.7, "step_ms_max": 0.9,
                    "tok_s": 2500.0, "graphs": True},
         "tier": {"hit_rate": 0.5}, "bytes_per_step": {"hbm": 1e9, "weights": 9e8, "gdn_state": 1e7, "kv": 1e7,
                                                       "sketch": 1e6, "pcie": 1e6},
         "floor": {"ms": 0.4, "fraction": 0.5},
         "profile": {"method": "torch.profiler", "steps": 1, "step": 0, "timeline": per[0],
                     "per_step": [p["totals"] for p in per], "mean": kernel_summary(spans, 1), "step_ms_mean": 0.8}}
    paths = step.write(r, str(tmp_path), "t")
    assert set(paths) == {"json", "md", "png"} and os.path.getsize(paths["png"]) > 10_000
    md = open(paths["md"]).read()
    assert "## One step, kernel by kernel" in md and "![the step's kernels along time, by kind](t.png)" in md
    t = per[0]["totals"]
    assert f"| {t['kernels']} | {t['kernel_ms']:.3f} | {t['busy_ms']:.3f} | {t['gap_ms']:.3f} ({t['gaps']}) |" in md
    assert md.count("| 10.0 |") >= 1 and "largest gaps inside the graph:" in md
    # the graph: from the side-stream kernel at 5 us to the last kernel's end at 590 us; 0.8 ms step - 0.585 outside
    assert "The graph replay: 28 kernels from 0.005 ms, span 0.585 ms = busy 0.445 + gaps 0.140 ms (14 gaps)" in md
    assert "spent 0.215 ms outside the graph" in md
    assert json.load(open(paths["json"]))["profile"]["timeline"]["totals"]["kernels"] == 31
    out = step.table(r)
    assert "kernels / step" in out and "31" in out and "50.0%" in out and "attention layers" not in out
    layer = {"lead": 130.0, "pcie_busy": 360.0, "pcie_idle": 10.0, "tail": 40.0, "layer": 540.0}
    r["profile"]["attention_layers"] = {"layers": [layer], "mean_us": layer,
                                        "sum_ms": {k: v / 1e3 for k, v in layer.items()}}
    assert "| mean us per layer | 130.0 | 360.0 | 10.0 | 40.0 | 540.0 |" in step.markdown(r)
    assert "0.13 / 0.36 / 0.01 / 0.04 = 0.54" in step.table(r)
    r["decode"].update(graph_replay_ms_mean=0.6, outside_graph_ms_mean=0.2)
    assert "CUDA-graph replays (CUDA events around each, no profiler): 0.600 ms; outside them 0.200" in step.markdown(r)
    assert "0.600 / 0.200" in step.table(r)


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("step")
    stdout = bench_step(["--device", "cpu", "--agents", "2", "--context", "1K", "--fill", "random", "--tail", "256",
                         "--steps", "3", "--warmup-steps", "1", "--profile", "--sparse-host-format", "int4",
                         "--out-dir", str(out), "--name", "cpu", *SMALL])
    return out, json.load(open(out / "cpu.json")), stdout


def test_speculative_step_reports_accepted_length_and_projection(tmp_path):
    """--num-speculative-tokens on a random-weight model with an MTP layer: every timed step verifies each agent's
    drafts, which are rejected (accepted length ~1); the report adds agents x reference length / step time."""
    stdout = bench_step(["--model", "random:tiny-hybrid+mtp", "--agents", "2", "--context", "1K", "--fill", "random",
                         "--tail", "256", "--steps", "2", "--warmup-steps", "1", "--num-speculative-tokens", "3",
                         "--reference-accepted-length", "3.3", "--out-dir", str(tmp_path), "--name", "spec", *SMALL])
    r = json.load(open(tmp_path / "spec.json"))
    d, s = r["decode"], r["decode"]["speculative"]
    assert s["num_speculative_tokens"] == 3 and 1.0 <= s["mean_accepted_length"] < 1.5
    assert s["mean_accepted_length"] == pytest.approx(d["tok_s"] * d["step_ms_mean"] / 1e3 / 2)
    assert s["projected_tok_s"] == pytest.approx(2 * 3.3 / (d["step_ms_mean"] / 1e3))
    assert "MTP-3: accepted length" in stdout and "at accepted length 3.30" in (tmp_path / "spec.md").read_text()


def test_cpu_run_writes_the_step_and_its_floor(cpu_run):
    out, r, stdout = cpu_run
    d, f, b = r["decode"], r["floor"], r["bytes_per_step"]
    assert r["info"]["device"].startswith("cpu") and r["info"]["command"].startswith("sketchkv bench step ")
    assert "--context 1K" in r["info"]["command"] and r["info"]["date"]
    assert (r["agents"], r["context"], r["config"]) == (2, 1024, "sparse")
    assert r["prefill"]["filled_tokens_per_agent"] == 768 and r["prefill"]["tokens"] == 2 * 256
    assert d["steps"] == 3 and not d["graphs"]
    assert d["step_ms_min"] <= d["step_ms_p50"] <= d["step_ms_max"]
    assert d["tok_s"] == pytest.approx(2 * 1e3 / d["step_ms_mean"])     # one token per agent per step
    assert 1024 < d["context_mean"] < 1024 + 16
    assert b["hbm"] == pytest.approx(b["weights"] + b["gdn_state"] + b["kv"] + b["sketch"]) and b["weights"] > 0
    assert f["ms"] == pytest.approx(1e3 * (b["hbm"] + b["pcie"]) / r["bandwidth"]["hbm"])   # CPU: one bandwidth
    assert f["fraction"] == pytest.approx(f["ms"] / d["step_ms_mean"]) and 0 < f["fraction"] < 1.2
    assert r["tier"]["misses_per_step"] > 0 and b["pcie"] == pytest.approx(r["tier"]["pcie_read_bytes_per_step"])
    p = r["profile"]   # no CUDA: timed regions by layer group, and the report says so
    assert "no CUDA device" in p["note"] and p["steps"] == 3 and "timeline" not in p
    assert p["ms"]["gdn"] > 0 and p["ms"]["selection"] > 0 and p["total_ms"] == pytest.approx(sum(p["ms"].values()))
    assert set(r["outputs"]) == {"json", "md"} and not list(out.glob("*.png"))
    md = (out / "cpu.md").read_text()
    assert "## Step" in md and "no CUDA device" in md and r["info"]["command"] in md
    assert f"| {d['step_ms_mean']:.3f} |" in md
    assert stdout.splitlines()[0].startswith("reference-model, sparse, 2 x 1K on cpu")
    assert f"{d['step_ms_mean']:.3f}" in stdout and "(eager, timed region)" in stdout


def test_help_and_default_name():
    from sketchkv.bench.step import default_name
    from sketchkv.cli import build_parser
    a = build_parser().parse_args(["bench", "step", "--model", "random:qwen3.5-27b-w4a16", "--agents", "8",
                                   "--context", "250K"])
    assert (a.agents, a.context, a.config, a.profile) == (8, 256000, "sparse", False)
    assert default_name(a).startswith("step-qwen3.5-27b-w4a16-sparse-8x250K-20")
    env = {**os.environ, "PYTHONPATH": ROOT}
    h = subprocess.run([sys.executable, "-m", "sketchkv", "bench", "step", "--help"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120).stdout
    assert "--profile" in h and "--sparse-host-format" in h and "examples:" in h and "floor" in h


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_profile_timeline(tmp_path):
    """On CUDA, --profile traces the graph steps: every profiled step runs the same kernels, and the picked step's
    timeline adds up (kernel times, gaps = span - busy, kinds) and sits inside its host window."""
    bench_step(["--device", "cuda", "--agents", "2", "--context", "4K",   # the bundled reference model
                "--fill", "random", "--tail", "256", "--steps", "4", "--profile", "--out-dir", str(tmp_path),
                "--name", "gpu", *SMALL])
    r = json.load(open(tmp_path / "gpu.json"))
    p = r["profile"]
    tl, t = p["timeline"], p["timeline"]["totals"]
    assert r["decode"]["graphs"] and p["steps"] == 4 and len(p["per_step"]) == 4
    assert p["mean"]["kernels_per_step"] > 0 and t["kernels"] == len(tl["kernels"]) > 0
    assert {s["kernels"] for s in p["per_step"]} == {t["kernels"]}        # graph replays: the same kernels each step
    assert p["mean"]["kernels_per_step"] == pytest.approx(t["kernels"])
    assert sum(k["us"] for k in tl["kernels"]) / 1e3 == pytest.approx(t["kernel_ms"])
    assert sum(k["gap_us"] for k in tl["kernels"]) / 1e3 == pytest.approx(t["gap_ms"], abs=1e-6)
    assert t["span_ms"] == pytest.approx(t["busy_ms"] + t["gap_ms"]) and t["busy_ms"] <= t["kernel_ms"] + 1e-9
    assert sum(v["count"] for v in tl["by_kind"].values()) == t["kernels"]
    g = t["graph"]   # the replay's kernels, found by their cudaGraphLaunch's correlation id
    assert 0 < g["kernels"] <= t["kernels"] and g["gap_ms"] <= t["gap_ms"] + 1e-9 and g["span_ms"] <= t["span_ms"]
    assert sum(k["graph"] for k in tl["kernels"]) == g["kernels"]
    assert -0.05 < t["lead_ms"] and -0.05 < t["tail_ms"] and t["span_ms"] <= t["host_ms"] + 0.1
    assert t["span_ms"] <= r["decode"]["step_ms_max"] * 2
    assert (tmp_path / "gpu.png").stat().st_size > 10_000
    assert "## One step, kernel by kernel" in (tmp_path / "gpu.md").read_text()
    d = r["decode"]   # every timed step replayed one decode graph, timed by CUDA events
    assert 0 < d["graph_replay_ms_mean"] < d["step_ms_mean"]
    assert d["outside_graph_ms_mean"] == pytest.approx(d["step_ms_mean"] - d["graph_replay_ms_mean"])

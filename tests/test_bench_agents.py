"""`sketchkv bench agents` end to end on a CPU at tiny scale (the bundled reference model, 1-2 agents x 1K-2K
tokens): the report's structure, and its arithmetic checked against an independent computation from the
checkpoint's files (weights from the safetensors header, state and row sizes from config.json)."""
import json
import math
import os
import shlex
import subprocess
import sys

import pytest

from sketchkv.bench.agents import (argv_without, distinct_knobs, engine_knobs, goals, host_rows, label, parse_agents,
                                   parse_tokens, point_command, row_head_combine, row_host_rows)
from sketchkv.cli import build_parser
from sketchkv.cli import main as cli_main
from sketchkv.config import default_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = default_model()
# int4 host rows pinned: the byte arithmetic below is int4's (the default is k8v4 since issue 40)
SMALL = ["--device", "cpu", "--sparse-host-format", "int4", "--sparse-top-k", "128", "--sparse-sink-tokens", "16",
         "--sparse-recent-tokens", "128",
         "--decode-tokens", "6", "--followup-tokens", "32", "--followup-decode", "1", "--hbm-gib", "0.05", "--quiet"]


def bench(args: list[str]) -> None:
    """The CLI in a child process, one thread (the CI machine's 2 cores are shared)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    r = subprocess.run([sys.executable, "-m", "sketchkv", "bench", "agents", *args], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]


def independent_sizes() -> dict:
    """Bytes of the reference model from its files alone (fp32 on a CPU)."""
    from safetensors import safe_open
    cfg = json.load(open(os.path.join(MODEL, "config.json")))
    with safe_open(os.path.join(MODEL, "model.safetensors"), "pt") as f:
        params = sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys()
                     if not k.startswith("mtp.") and not (k == "lm_head.weight" and cfg["tie_word_embeddings"]))
    with safe_open(os.path.join(MODEL, "key_basis.safetensors"), "pt") as f:
        rank = f.get_slice("bases").get_shape()[-1]
    n_lin = cfg["layer_types"].count("linear_attention")
    n_attn = cfg["layer_types"].count("full_attention")
    conv_dim = 2 * cfg["linear_num_key_heads"] * cfg["linear_key_head_dim"] + \
        cfg["linear_num_value_heads"] * cfg["linear_value_head_dim"]
    state = n_lin * 4 * (conv_dim * cfg["linear_conv_kernel_dim"] + cfg["linear_num_value_heads"]
                         * cfg["linear_key_head_dim"] * cfg["linear_value_head_dim"])
    hkv, d = cfg["num_key_value_heads"], cfg["head_dim"]
    assert cfg["tie_word_embeddings"]  # else one embedding row per agent instead of the table
    return {"weights": 4 * params, "state": state, "kv_token": 2 * n_attn * hkv * d * 4,
            "sketch_token": n_attn * hkv * (rank // 2 + 2), "attn_layers": n_attn,
            # int4 host row per layer, per KV head: K and V at D/2 bytes each + an fp16 scale per 64 dims each, 16-B padded
            "host_row": hkv * -(-(d + 4 * (d // min(64, d))) // 16) * 16}


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("agents")
    # 1,536-token steps: the 2K prompts prefill in two chunks (the progress check must count cached tokens,
    # not outputs; H200 run 43 failed every real 128K prefill on it)
    bench(["--agents", "1", "2", "--contexts", "1K", "2K", "--configs", "sparse", "dense", "--breakdown",
           "--breakdown-steps", "1", "--max-num-batched-tokens", "1536", "--out-dir", str(out), "--name", "grid", *SMALL])
    return out, json.load(open(out / "grid.json"))


def test_report_structure_and_commands(report):
    out, r = report
    rows = r["rows"]
    assert [(x["config"], x["agents"], x["context"]) for x in rows] == \
        [(c, n, L) for c in ("sparse", "dense") for L in (1024, 2048) for n in (1, 2)]
    assert all(x["status"] == "ok" for x in rows), [x.get("reason") for x in rows]
    md = (out / "grid.md").read_text()
    assert "| config | agents x context | tok/s combined" in md and "## Step time by layer group" in md
    assert "![tok/s vs agents and vs context](grid.png)" in md
    assert (out / "grid.png").stat().st_size > 10_000
    parser = build_parser()
    for i, x in enumerate(rows):   # each row names a command that reruns exactly that point
        assert f"{i + 1}. `{x['command']}`" in md
        a = parser.parse_args(shlex.split(x["command"])[1:])
        assert (a.configs, a.agents, a.contexts, a.model) == ([x["config"]], [x["agents"]], [x["context"]], MODEL)
    assert {(c["config"], c["context"]) for c in r["capacity"]} == {(c, L) for c in ("sparse", "dense")
                                                                   for L in (1024, 2048)}
    assert all(c["max_agents"] >= 2 for c in r["capacity"])


def test_bytes_and_floor_arithmetic(report):
    _, r = report
    ind = independent_sizes()
    hbm_bw = r["bandwidth"]["hbm"]
    assert r["bandwidth"]["pcie"] is None and hbm_bw > 0
    for x in r["rows"]:
        n, b, d, fl = x["agents"], x["bytes_per_step"], x["decode"], x["floor"]
        ctx = d["context_mean"]
        assert x["context"] + 1 <= ctx <= x["context"] + 64
        assert b["weights"] == ind["weights"]
        assert b["gdn_state"] == 2 * n * ind["state"]
        if x["config"] == "sparse":  # sinks + recent in the model dtype, the picks as int4 host records (hot pool)
            rows = min(ctx, 16 + 128 + 128)
            res = min(rows, 16 + 128)
            kv = n * (res * ind["kv_token"] + (rows - res) * ind["attn_layers"] * ind["host_row"])
        else:
            kv = n * ctx * ind["kv_token"]
        assert b["kv"] == pytest.approx(kv)
        assert b["sketch"] == pytest.approx(n * ctx * ind["sketch_token"] if x["config"] == "sparse" else 0)
        assert b["hbm"] == pytest.approx(b["weights"] + b["gdn_state"] + b["kv"] + b["sketch"])
        assert fl["total_s"] == pytest.approx(b["hbm"] / hbm_bw + b["pcie"] / hbm_bw)
        assert d["tok_s"] > 0 and d["tok_s"] == pytest.approx(n * 1e3 / d["step_ms_mean"])
        assert d["per_agent_tok_s"] == pytest.approx(d["tok_s"] / n)
        assert 0 < fl["fraction"] <= 1.2 and fl["fraction"] == pytest.approx(fl["total_s"] * 1e3 / d["step_ms_mean"])
        assert d["steps"] == 6 and x["prefill"]["tok_s"] > 0 and x["prefill"]["tokens"] == n * x["context"]


def test_tier_counters_memory_and_follow_up(report):
    _, r = report
    ind = independent_sizes()
    for x in r["rows"]:
        m, t, fu = x["memory"], x["tier"], x["followup"]
        blocks = math.ceil(m["tokens_per_agent"] / 64)
        if x["config"] == "sparse":
            assert t["host_row_bytes"] == ind["host_row"]
            assert t["pcie_read_bytes_per_step"] == pytest.approx(t["misses_per_step"] * ind["host_row"])
            assert x["bytes_per_step"]["pcie"] == pytest.approx(t["pcie_read_bytes_per_step"])
            assert 0 <= t["hit_rate"] <= 1 and t["misses_per_step"] > 0
            assert m["host_bytes_per_agent"] == blocks * 64 * ind["attn_layers"] * ind["host_row"]
            assert m["gpu_bytes_per_agent"] == m["gpu_bytes_per_agent_arith"]
        else:
            assert t is None and x["bytes_per_step"]["pcie"] == 0
            assert m["gpu_bytes_per_agent"] == blocks * 64 * ind["kv_token"] + ind["state"]
        # the follow-up re-sends the conversation: served from the prefix cache up to the prompt's last block
        assert fu["cached_tokens_mean"] == x["context"] // 64 * 64
        assert fu["ttft_s"] > 0 and (fu["ttft_concurrent_max_s"] is None) == (x["agents"] == 1)
        bd = x["breakdown"]
        assert bd["steps"] == 1 and all(v >= 0 for v in bd["ms"].values()) and bd["ms"]["gdn"] > 0
        assert (bd["ms"]["selection"] > 0) == (x["config"] == "sparse")


def test_random_fill_then_merge(report, tmp_path):
    """--fill random: the first L - tail tokens come from random caches, the tail is prefilled, and the
    follow-up still finds the whole prompt in the prefix cache. Then two runs merge into one report."""
    out, _ = report
    bench(["--agents", "1", "--contexts", "2K", "--configs", "sparse", "--fill", "random", "--tail", "256",
           "--out-dir", str(tmp_path), "--name", "fill", *SMALL])
    r = json.load(open(tmp_path / "fill.json"))
    (x,) = r["rows"]
    assert x["status"] == "ok", x.get("reason")
    assert x["prefill"]["filled_tokens_per_agent"] == 1792 and x["prefill"]["tokens"] == 256
    assert x["followup"]["cached_tokens_mean"] == 2048
    assert x["tier"]["misses_per_step"] > 0
    assert cli_main(["bench", "agents", "--from-json", str(out / "grid.json"), str(tmp_path / "fill.json"),
                     "--out-dir", str(tmp_path), "--name", "merged", "--quiet"]) == 0
    m = json.load(open(tmp_path / "merged.json"))
    assert len(m["rows"]) == 8 and len(m["sources"]) == 2   # the 1 x 2K sparse point: the later file's
    assert [y for y in m["rows"] if y["config"] == "sparse" and y["agents"] == 1 and y["context"] == 2048][0][
        "prefill"]["mode"] == "random"
    assert "merged from" in (tmp_path / "merged.md").read_text()
    # sparse points spell out their prefill selection (the default's, resolved): a command means the same after a
    # default changes
    assert all("--sparse-prefill-selection chunk" in y["command"] for y in m["rows"] if y["config"] == "sparse")
    # and their residual keys (int4 rows: on unless turned off), in the command and the label
    assert all("--sparse-host-residual-keys" in y["command"] and y["label"].endswith("(int4 residual-key rows)")
               for y in m["rows"] if y["config"] == "sparse")
    assert "host rows int4 residual-key" in (tmp_path / "merged.md").read_text()
    old = {"sparse": {"host_format": "int4"}}   # a file from before session 21: residual keys only where the command says
    assert row_host_rows(old, {"command": "sketchkv bench agents --sparse-host-residual-keys"}) == "int4 residual-key"
    assert row_host_rows(old, {"command": "sketchkv bench agents --configs sparse"}) == "int4"
    # the same point with another engine knob: a row of its own
    bench(["--agents", "1", "--contexts", "2K", "--configs", "sparse", "--fill", "random", "--tail", "256",
           "--sparse-prefill-selection", "dense", "--out-dir", str(tmp_path), "--name", "chunk", *SMALL])
    assert cli_main(["bench", "agents", "--from-json", str(tmp_path / "merged.json"), str(tmp_path / "chunk.json"),
                     "--out-dir", str(tmp_path), "--name", "merged2", "--quiet"]) == 0
    m2 = json.load(open(tmp_path / "merged2.json"))
    assert len(m2["rows"]) == 9
    assert sum("--sparse-prefill-selection dense" in y["command"] for y in m2["rows"]) == 1


def test_max_agents_all_decode(tmp_path):
    """--agents max: as many agents as the budgets hold (here the host budget), every one of them prefilled and
    decoding through the timed window. The tails' prefill takes several steps at this many agents; agents done
    with theirs must not run ahead and finish turn 1 early (H200 run 43: 14 x 250K failed so)."""
    bench(["--agents", "max", "--contexts", "4K", "--configs", "sparse", "--fill", "random", "--tail", "1024",
           "--sparse-host-budget-gb", "0.02", "--max-num-batched-tokens", "4096", "--out-dir", str(tmp_path),
           "--name", "max", *SMALL])
    r = json.load(open(tmp_path / "max.json"))
    (row,) = r["rows"]
    cap = {c["config"]: c["max_agents"] for c in r["capacity"]}
    assert row["status"] == "ok", row.get("reason")
    assert row["agents"] == cap["sparse"] >= 8 and row["decode"]["steps"] == 6


def test_point_flags():
    assert parse_tokens("250K") == 256000 and parse_tokens("4096") == 4096 and parse_agents("max") == "max"
    argv = ["--agents", "1", "8", "--contexts", "32K", "--fill", "random", "--configs", "sparse", "dense"]
    assert argv_without(argv) == ["--fill", "random"]
    assert point_command(argv, "dense", 8, 32768) == ("sketchkv bench agents --fill random --configs dense "
                                                      "--agents 8 --contexts 32768")
    assert point_command(argv, "sparse", 8, 32768, "chunk") == (
        "sketchkv bench agents --fill random --sparse-prefill-selection chunk --configs sparse --agents 8 --contexts 32768")
    given = argv + ["--sparse-prefill-selection=dense"]
    assert point_command(given, "sparse", 8, 32768, "dense").count("--sparse-prefill-selection") == 1
    # residual keys (auto: on for int4 rows) likewise: spelled out unless given either way
    assert point_command(argv, "sparse", 8, 32768, "chunk", True).endswith(
        "--sparse-prefill-selection chunk --sparse-host-residual-keys --configs sparse --agents 8 --contexts 32768")
    assert "--no-sparse-host-residual-keys" in point_command(argv, "sparse", 8, 32768, "chunk", False)
    off = argv + ["--no-sparse-host-residual-keys"]
    assert point_command(off, "sparse", 8, 32768, "chunk", False).count("residual-keys") == 1
    assert label("sparse", host_rows("int4", True)) == "sketchkv sparse + host tier (int4 residual-key rows)"
    assert label("sparse", host_rows("k8v4", False)) == "sketchkv sparse + host tier (k8v4 rows)"
    assert label("sparse", host_rows("int4", True), "sum") == (
        "sketchkv sparse + host tier (int4 residual-key rows, sum combine)")
    # a merged report names the knobs that tell its sparse rows apart (not those every row shares, nor those the
    # label says in words)
    cmds = ["sketchkv bench agents --sparse-top-k 128 --sparse-head-combine sum --sparse-hot-fraction 0.1",
            "sketchkv bench agents --sparse-top-k 128 --no-sparse-admit-stream --sparse-prefill-selection chunk"]
    knobs = distinct_knobs(cmds)
    assert knobs == [(("--sparse-hot-fraction", "0.1"),), (("--no-sparse-admit-stream", ""),)]
    assert label("sparse", "int4", "sum", knobs[0]) == (
        "sketchkv sparse + host tier (int4 rows, sum combine, --sparse-hot-fraction 0.1)")
    assert label("sparse", "int4", "softmax", knobs[1]) == (
        "sketchkv sparse + host tier (int4 rows, --no-sparse-admit-stream)")
    assert label("dense", "int4", "sum", knobs[0]) == "sketchkv dense"
    # a saved row's combine: its file's, else its command's flag (files before session 23), else the default
    assert row_head_combine({"sparse": {"head_combine": "max"}}, {"command": ""}) == "max"
    assert row_head_combine({"sparse": {}}, {"command": "sketchkv bench agents --sparse-head-combine sum"}) == "sum"
    assert row_head_combine({"sparse": {}}, {"command": "sketchkv bench agents --configs sparse"}) == "softmax"
    # engine knobs keep two runs of a point apart in a merged report; on/off switches take no value
    assert engine_knobs("sketchkv bench agents --no-sparse-admit-stream --configs sparse --sparse-top-k 256") == (
        ("--no-sparse-admit-stream", ""), ("--sparse-top-k", "256"))
    assert engine_knobs("sketchkv bench agents --sparse-host-format=k8v4 --configs sparse") == (
        ("--sparse-host-format=k8v4", ""),)


def test_data_parallel_places_replicas_with_the_parsed_memory_cap():
    """--gpu-memory-gb reaches replica placement as a number (a string crashed H100 run 2026-12-05 before any
    replica started), and several capped replicas share one card only when their caps fit."""
    from sketchkv.bench.data_parallel import replica_config
    from sketchkv.server.replica import gpus_for_replicas
    args = build_parser().parse_args(["bench", "agents", "--data-parallel", "2", "--gpu-memory-gb", "23.5"])
    cap = replica_config(args).cache.gpu_memory_gb
    assert cap == 23.5 and isinstance(cap, float)
    assert gpus_for_replicas(2, ["0"], cap, 79.2) == ["0", "0"]
    assert replica_config(build_parser().parse_args(["bench", "agents"])).cache.gpu_memory_gb is None


def test_data_parallel_replicas_and_ratio(tmp_path):
    """--data-parallel 1 2: one replica process alone, then two at once (CPU: sharing the cores), windows started
    together at a barrier; combined tok/s over the common window, and the ratio to one replica. Then the ratio
    again from a single-replica run merged in with --from-json."""
    bench(["--agents", "1", "--contexts", "1K", "--configs", "sparse", "--fill", "random", "--tail", "256",
           "--data-parallel", "1", "2", "--out-dir", str(tmp_path), "--name", "dp", *SMALL])
    r = json.load(open(tmp_path / "dp.json"))
    one, two = r["dp_rows"]
    assert (one["data_parallel"], one["agents"], two["data_parallel"], two["agents"]) == (1, 1, 2, 2)
    assert one["status"] == two["status"] == "ok" and one["ratio_vs_1"] == 1.0
    assert [x["replica"] for x in two["replicas"]] == [0, 1] and len(two["replica_rows"]) == 2
    (w0s, w0e), (w1s, w1e) = (x["window"] for x in two["replicas"])
    d = two["decode"]
    assert d["tokens"] == 2 * 6 and math.isclose(d["window_s"], max(w0e, w1e) - min(w0s, w1s))
    assert math.isclose(d["tok_s"], 12 / d["window_s"]) and 0 < d["overlap"] <= 1
    assert math.isclose(two["ratio_vs_1"], d["tok_s"] / one["decode"]["tok_s"])
    (single,) = r["rows"]   # the one-replica run is an ordinary single-engine row
    assert math.isclose(single["decode"]["tok_s"], one["decode"]["tok_s"], rel_tol=0.2)   # mean step vs window
    assert "--data-parallel" not in single["command"]
    assert two["command"].endswith("--agents 1 --contexts 1024 --data-parallel 2")
    md = (tmp_path / "dp.md").read_text()
    assert "## Data-parallel replicas" in md and "| 2 x 1 x 1K |" in md
    gpu, host = (two["replicas"][0][k] for k in ("gpu_bytes_per_agent", "host_bytes_per_agent"))
    assert f"{gpu / 1e9:.3f} / {host / 1e9:.2f}" in md   # memory per agent of each replica
    # the ratio from a separate single-GPU file
    with open(tmp_path / "only-dp2.json", "w") as f:
        json.dump({**r, "rows": [], "dp_rows": [two]}, f)
    with open(tmp_path / "single.json", "w") as f:
        json.dump({**r, "dp_rows": []}, f)
    assert cli_main(["bench", "agents", "--from-json", str(tmp_path / "single.json"), str(tmp_path / "only-dp2.json"),
                     "--out-dir", str(tmp_path), "--name", "merged-dp", "--quiet"]) == 0
    (m,) = json.load(open(tmp_path / "merged-dp.json"))["dp_rows"]
    assert math.isclose(m["ratio_vs_1"], d["tok_s"] / single["decode"]["tok_s"])


def test_kernel_kinds_of_the_gpu_breakdown():
    from sketchkv.bench.breakdown import kernel_kind
    assert kernel_kind("_sketch_score_kernel") == "sketch score"
    for k in ("_sketch_score_dp4a_kernel", "_query_words_kernel", "_head_lse_kernel", "_softmax_combine_kernel"):
        assert kernel_kind(k) == "sketch score"   # every kernel of a scoring call
    assert kernel_kind("_radix_hist_kernel") == "top-k"
    assert kernel_kind("chunk_gated_delta_rule_fwd_kernel_h") == "gdn (fla)"
    assert kernel_kind("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTN") == "gemm (weights)"
    assert kernel_kind("void at::native::index_elementwise_kernel<128, 4>") == "index / gather (torch)"
    assert kernel_kind("_host_gather_kernel") == kernel_kind("_host_copy_rows_kernel") == "host gather (PCIe)"
    assert kernel_kind("_copy_rows_kernel") == "other"   # the hot-buffer admit's row copies (GPU to GPU)
    assert kernel_kind("something new") == "other"


def test_stream_accounting_of_the_gpu_breakdown():
    """Per-stream busy time is the union of its kernels' intervals (overlaps counted once), streams sorted busiest
    first; the GPU's busy time is the union over all streams; the table shows the main stream's waiting time."""
    from sketchkv.bench.agents import _streams_table
    from sketchkv.bench.breakdown import busy_us, stream_times
    assert busy_us([]) == 0.0
    assert busy_us([(0, 10), (5, 12), (20, 25), (21, 22)]) == 17.0
    # two steps: main stream 7 (two steps: 2 x (10 + 4) us of kernels), side stream 9, overlapping the main one
    spans = [(7, 0, 10), (7, 12, 16), (9, 5, 14), (7, 100, 110), (7, 112, 116), (9, 105, 114)]
    st = stream_times(spans, steps=2)
    assert st["stream_ms"] == [0.014, 0.009] and st["stream_kernels"] == [2.0, 1.0]
    assert abs(st["gpu_busy_ms"] - 0.016) < 1e-12
    row = {"label": "x", "agents": 2, "context": 2048, "command": "c",
           "breakdown": {"graph_step_ms": 0.020, **st}}
    line = _streams_table([row], {"c": 1})[-1]
    assert line == "| x | 2 x 2K | 0.02 | 0.01 (2) | 0.01 (1) | 0.02 | 0.01 | [1] |"
    assert _streams_table([], {}) == []


def test_speculative_rows_measure_verification_steps(tmp_path):
    """A random-weight model with an MTP layer (`random:PRESET+mtp`): its drafts are rejected, so every
    timed step verifies n drafts and keeps one token; the report gives the measured step and the
    projection agents x reference accepted length / step time."""
    bench(["--model", "random:tiny-hybrid+mtp", "--agents", "2", "--contexts", "1K", "--configs", "sparse",
           "--fill", "random", "--tail", "256", "--num-speculative-tokens", "3", "--reference-accepted-length", "3.3",
           "--out-dir", str(tmp_path), "--name", "spec", *SMALL])
    res = json.load(open(tmp_path / "spec.json"))
    (x,) = res["rows"]
    assert x["status"] == "ok", x.get("reason")
    d, s = x["decode"], x["decode"]["speculative"]
    assert s["num_speculative_tokens"] == 3 and s["verifications"] >= 2 * d["steps"]   # every agent, every step
    assert 1.0 <= s["mean_accepted_length"] < 1.5                                       # random drafts
    assert s["projected_tok_s"] == pytest.approx(2 * 3.3 / (d["step_ms_mean"] / 1e3))
    assert "## Speculative decoding (MTP)" in (tmp_path / "spec.md").read_text()
    # the arithmetic counts what speculation keeps per agent: the drafter's K/V ring (64 + 4,096 + 4 rows -> 66
    # blocks of 64) and n more rows in the tier's recent ring, as the engine's accounting does
    m = x["memory"]
    assert m["gpu_bytes_per_agent"] == m["gpu_bytes_per_agent_arith"]
    sh = res["shape"]
    assert s["extra_gpu_bytes_per_agent"]["mtp_kv"] == 66 * 64 * 2 * sh["kv_heads"] * sh["head_dim"] * sh["itemsize"]


def test_goal_rows_name_the_engine_knobs_of_their_point():
    """A merged report holding a point twice (default knobs and another prefill selection) tells the goal rows apart."""
    row = dict(status="ok", config="sparse", agents=1, context=249856, prefill={"mode": "real", "tok_s": 5679.0},
               followup={"ttft_s": 0.67}, command="sketchkv bench agents --agents 1 --contexts 244K --fill real")
    chunk = {**row, "prefill": {"mode": "real", "tok_s": 8185.0},
             "command": row["command"] + " --sparse-prefill-selection chunk"}
    cold = [g for g in goals([row, chunk]) if g["goal"].startswith("cold prefill")]
    assert [(g["goal"].endswith("[--sparse-prefill-selection chunk]"), g["met"]) for g in cold] == [(False, False),
                                                                                                   (True, True)]

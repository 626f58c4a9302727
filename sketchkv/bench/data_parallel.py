"""`sketchkv bench agents --data-parallel N [N ...]`: the same points on N replica processes at once.

Each replica is a process of its own with its own engine on its own GPU (replica i on GPU i; on a CPU,
N processes sharing the cores), running every point of the run exactly as a single-GPU run does (its
agents, its contexts, `--fill`). Right before each point's timed decode window the replicas meet at a
barrier, so the windows overlap; each reports its window's start and end (wall clock). Per point:

    combined tok/s = sum over replicas of (agents x timed steps) / (latest window end - earliest start)

next to each replica's own tok/s and the windows' overlap (shared time / span). With several N in one run
(`--data-parallel 1 2`: first one replica alone, then two together), or a single-GPU run of the same
per-replica point merged in with --from-json, each point also gets its ratio to one replica.

    sketchkv bench agents --model random:qwen3.5-27b --configs sparse --agents 8 --contexts 250K \\
        --fill random --data-parallel 1 2 --sparse-host-budget-gb 48    # 16 x 250K on 2 GPUs vs 8 x 250K on 1

Owns the replica processes, the barrier that starts their windows together, and the combined rows. It does not
import the benchmark it runs: `run(args, name, bench)` gets the benchmark module's name (`sketchkv.bench.agents`
passes its own), imports it in each replica and calls its `run`, `goals`, `markdown`, `plot`, `argv_without` and
`point_command`; the benchmark imports this module (one direction, no cycle).
"""
from __future__ import annotations

import importlib
import os
import shlex
import sys

from sketchkv.eval import common as C

BARRIER_TIMEOUT_S = 900
HOOK = {"barrier": None, "prefix": ""}   # set inside a replica process; read by agents.run_point / run


def window_barrier() -> None:
    """In a replica process: wait until every replica is about to start its timed window."""
    if HOOK["barrier"] is not None:
        HOOK["barrier"].wait(BARRIER_TIMEOUT_S)


def abort_barrier() -> None:
    """A replica's point failed before its window: release the others at once (their point fails too)."""
    if HOOK["barrier"] is not None:
        HOOK["barrier"].abort()


def _replica(args, bench: str, index: int, gpu: str | None, threads: int, barrier, conn) -> None:
    if gpu is not None:   # before torch starts CUDA: the replica sees its one GPU as cuda:0
        os.environ["CUDA_VISIBLE_DEVICES"] = gpu
    import torch
    if threads:   # a share of the cores, never more than OMP_NUM_THREADS asks for
        torch.set_num_threads(min(threads, torch.get_num_threads()))
    HOOK.update(barrier=barrier, prefix=f"replica {index}: ")
    try:
        conn.send(("ok", importlib.import_module(bench).run(args, f"replica{index}", write=False)))
    except BaseException as e:  # noqa: BLE001 - reported by the parent
        abort_barrier()
        conn.send(("error", f"{type(e).__name__}: {e}"))


def replica_config(args):
    """The engine settings that place replicas on GPUs: device and the per-engine memory cap (flags parsed
    the way every configuration's engine gets them)."""
    from sketchkv.config import EngineConfig
    from sketchkv.eval.common import base_options
    cfg = EngineConfig(model=args.model, device=getattr(args, "device", None) or "auto")
    cfg.cache.gpu_memory_gb = base_options(args).get("gpu_memory_gb")   # capped replicas may share a GPU
    return cfg


def run_replicas(args, n: int, bench: str) -> list[dict]:
    """Run the points on n replica processes at once; each one's results dict, in replica order."""
    import multiprocessing as mp

    from sketchkv.errors import SketchKVError
    from sketchkv.server.replica import plan_replicas
    plans = plan_replicas(replica_config(args), n)
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(n)
    wargs = type(args)(**{**vars(args), "data_parallel": None})
    if getattr(args, "sparse_host_budget_gb", None) is None:   # the tier's default (half the RAM), split
        from sketchkv.kv.host_tier import default_host_budget
        wargs.sparse_host_budget_gb = default_host_budget() / n / 2**30
    procs = []
    for p in plans:
        recv, send = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_replica, args=(wargs, bench, p.index, p.gpu, p.threads, barrier, send), daemon=True,
                           name=f"sketchkv-bench-replica-{p.index}")
        proc.start()
        send.close()
        procs.append((proc, recv))
    out, errors = [], []
    for i, (proc, recv) in enumerate(procs):
        try:
            kind, payload = recv.recv()
        except EOFError:
            proc.join()
            kind, payload = "error", f"exited with code {proc.exitcode}"
        proc.join()
        if kind == "error":
            errors.append(f"replica {i}: {payload}")
        out.append(payload)
    if errors:
        raise SketchKVError("; ".join(errors))
    return out


def combine(replicas: list[dict], n: int, argv: list[str], bench) -> list[dict]:
    """One row per point: the replicas' timed windows combined (bench: the benchmark module, for its commands)."""
    argv_without, point_command = bench.argv_without, bench.point_command
    rest = argv_without(argv, ("--data-parallel",))
    rows = []
    sp = replicas[0]["sparse"]
    for reps in zip(*(r["rows"] for r in replicas)):
        r0 = reps[0]
        row = {"config": r0["config"], "label": r0["label"], "data_parallel": n,
               "agents": n * r0["agents"], "agents_per_replica": r0["agents"], "context": r0["context"],
               "command": point_command(rest, r0["config"], r0["agents"], r0["context"],
                                        *((sp["prefill_selection"], sp.get("residual_keys")) if r0["config"] == "sparse"
                                          else ())) + f" --data-parallel {n}"}
        bad = [f"replica {i}: {x['status']}: {x.get('reason')}" for i, x in enumerate(reps) if x["status"] != "ok"]
        if bad:
            rows.append({**row, "status": "error" if any(x["status"] == "error" for x in reps) else "skipped",
                         "reason": "; ".join(bad)})
            continue
        wins = [x["decode"]["window"] for x in reps]
        start, end = min(w[0] for w in wins), max(w[1] for w in wins)
        shared = max(0.0, min(w[1] for w in wins) - max(w[0] for w in wins))
        tokens = sum(x["agents"] * x["decode"]["steps"] for x in reps)
        rows.append({**row, "status": "ok",
                     "decode": {"tok_s": tokens / (end - start), "tokens": tokens, "window_s": end - start,
                                "overlap": shared / (end - start)},
                     "replicas": [{"replica": i, "tok_s": x["decode"]["tok_s"], "step_ms_mean": x["decode"]["step_ms_mean"],
                                   "window": x["decode"]["window"], "floor_fraction": x["floor"]["fraction"],
                                   "host_bytes_per_agent": x["memory"].get("host_bytes_per_agent"),
                                   "gpu_bytes_per_agent": x["memory"].get("gpu_bytes_per_agent"),
                                   "gpu_bytes_peak_process": x["memory"].get("gpu_bytes_peak_process")}
                                  for i, x in enumerate(reps)],
                     "replica_rows": list(reps)})
    return rows


def add_ratios(dp_rows: list[dict], rows: list[dict]) -> None:
    """ratio_vs_1: combined tok/s over one replica's at the same per-replica point (a data_parallel 1 row
    of this run, else a single-GPU row of a merged run)."""
    ones = {(r["config"], r["agents_per_replica"], r["context"]): r["decode"]["tok_s"]
            for r in dp_rows if r["status"] == "ok" and r["data_parallel"] == 1}
    for r in rows:
        if r.get("status") == "ok":
            ones.setdefault((r["config"], r["agents"], r["context"]), r["decode"]["tok_s"])
    for r in dp_rows:
        base = ones.get((r["config"], r["agents_per_replica"], r["context"]))
        r["ratio_vs_1"] = r["decode"]["tok_s"] / base if r["status"] == "ok" and base else None


def goals(dp_rows: list[dict], long: int) -> list[dict]:
    out = []
    for r in dp_rows:
        if r["status"] == "ok" and r["data_parallel"] > 1 and r["config"] == "sparse" and r["context"] >= long \
                and r.get("ratio_vs_1") is not None:
            need = 0.95 * r["data_parallel"]
            out.append({"goal": f"{r['agents']} x {C.fmt_len(r['context'])} over {r['data_parallel']} GPUs (DP) >= "
                                f"{need:.3g}x one GPU's {r['agents_per_replica']} x {C.fmt_len(r['context'])}",
                        "value": f"{r['ratio_vs_1']:.2f}x ({r['decode']['tok_s']:.0f} tok/s)",
                        "met": r["ratio_vs_1"] >= need})
    return out


def run(args, name: str, bench: str) -> dict:
    """Every point of `args` on each replica count of args.data_parallel; bench: the benchmark module's name."""
    agents = importlib.import_module(bench)
    argv = sys.argv[sys.argv.index("agents") + 1:] if "agents" in sys.argv else []
    results, dp_rows = None, []
    for n in args.data_parallel:
        C.log(f"data-parallel: {n} replica(s)", args.quiet)
        replicas = run_replicas(args, n, bench)
        if results is None:
            results = dict(replicas[0], rows=[])
        if n == 1:   # the one-replica run is an ordinary single-GPU run: its full rows
            results["rows"] = replicas[0]["rows"]
        dp_rows += combine(replicas, n, argv, agents)
    results["info"] = dict(results["info"], data_parallel=list(args.data_parallel),
                           command="sketchkv bench agents " + " ".join(shlex.quote(a) for a in argv))
    results["dp_rows"] = dp_rows
    add_ratios(dp_rows, results["rows"])
    results["goals"] = agents.goals(results["rows"], dp_rows)
    for r in dp_rows:
        if r["status"] == "ok":
            per = ", ".join(f"{x['tok_s']:.1f}" for x in r["replicas"])
            ratio = f", {r['ratio_vs_1']:.2f}x one replica" if r.get("ratio_vs_1") else ""
            C.log(f"{r['config']} {r['data_parallel']} x {r['agents_per_replica']} x {r['context']}: "
                  f"{r['decode']['tok_s']:.1f} tok/s combined (replicas {per}; overlap {r['decode']['overlap']:.0%})"
                  f"{ratio}", args.quiet)
    paths = C.write_outputs(results, args.out_dir, name, agents.markdown, agents.plot)
    C.log(f"wrote {paths['md']}, {paths['json']}", args.quiet)
    return results


def markdown(r: dict, ref: dict) -> list[str]:
    if not r.get("dp_rows"):
        return []
    L = ["", "## Data-parallel replicas (one engine per GPU, windows started together)", "",
         "Combined tok/s = all replicas' timed tokens / (latest window end - earliest window start); overlap = "
         "time every replica was inside its window / that span. vs 1 replica: combined / one replica's tok/s at the "
         "same per-replica point.", "",
         "| config | replicas x agents x context | tok/s combined | per replica tok/s (ms/step) | window s | overlap | "
         "vs 1 replica | per replica GPU / host GB per agent (GPU peak GB) | cmd |", "|" + "---|" * 9]
    for row in r["dp_rows"]:
        tag = f"{row['data_parallel']} x {row['agents_per_replica']} x {C.fmt_len(row['context'])}"
        if row["status"] != "ok":
            L.append(f"| {row['label']} | {tag} | {row['status']}: {row['reason']} | | | | | | [{ref[row['command']]}] |")
            continue
        d = row["decode"]
        per = "; ".join(f"{x['tok_s']:.1f} ({x['step_ms_mean']:.2f})" for x in row["replicas"])
        ratio = "–" if row.get("ratio_vs_1") is None else f"{row['ratio_vs_1']:.2f}x"
        mem = "; ".join(_memory_cell(x) for x in row["replicas"])
        L.append(f"| {row['label']} | {tag} | {d['tok_s']:.1f} | {per} | {d['window_s']:.2f} | {d['overlap']:.0%} | "
                 f"{ratio} | {mem} | [{ref[row['command']]}] |")
    return L



def _memory_cell(x: dict) -> str:
    """'GPU / host GB per agent (peak GB of the process's allocator)'; '-' for what a replica did not report."""
    gb = lambda v, f: "-" if v is None else format(v / 1e9, f)   # noqa: E731
    return (f"{gb(x.get('gpu_bytes_per_agent'), '.3f')} / {gb(x.get('host_bytes_per_agent'), '.2f')} "
            f"({gb(x.get('gpu_bytes_peak_process'), '.1f')})")

"""List what benchmarks/results/ holds, and write its index (benchmarks/results/README.md).

    python benchmarks/results_index.py --list                          # every result folder and its files
    python benchmarks/results_index.py > benchmarks/results/README.md  # the index: one line per result folder
    python benchmarks/results_index.py --check                         # folders without README / with raw logs

A result folder holds one published result: README.md (what was measured, the numbers, the command, device and
date), the command (`call.json` / `call.sh` for device runs), the numbers (`*.json`, `*.md`) and, where the tool
draws one, the plot (`*.png`). Raw logs, stdout captures, patches and debug scripts stay out of the tree; a script
that reproduces a number lives under benchmarks/ (benchmarks/studies/ for one-off studies).

Each index line takes its date and device from the folder (name, call.json, README) and its description from the
README's title, or its first paragraph where the title names only the run; `WHAT` overrides both.
"""
import argparse
import json
import os
import re
import sys

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
RAW = re.compile(r"\.(log|diff|patch)$|output[_-]tail\.txt$|^dbg_.*\.py$")

# Descriptions for folders whose README title says only which run it was.
WHAT = {
    "2026-11-29-h200": "first H200 session: 27B-shape engine timings and sparse-op timings (JSON only)",
    "2026-11-29-h200-run2": "27B-shape engine timings, GPU parity against transformers, sparse ops (JSON only)",
    "2026-11-29-h200-run3": "GPU tests: fused kernels, paged decode and CUDA graphs, parity with transformers (four families), zero-copy gather",
    "2026-11-29-h200-run4": "dense decode against its bytes floor (27B shape, 8K / 128K, batch 1 / 8); CUDA graphs vs eager",
    "2026-11-29-h200x2-run5": "2 x H200: data-parallel agents, tensor-parallel parity and step time, KL at k = 256, recall by selection",
    "2026-11-29-h200x4-run9": "4 x H200 lanes: agents 1-8 x 32K-250K (sparse), KL by context, QSA tier",
    "2026-11-29-h200x2-run12": "2 x H200: Triton tier at 8 x 250K, softmax-combine KL, decode/prefill interference, TP=2 parity, QSA tier graphs",
    "2026-12-01-h200-run16": "GPU tests (speculative greedy = plain); agents 1 / 8 x 32K / 250K with the torch tier kernels",
    "2026-12-01-h200-run17": "fma vs Triton tier at 8 x 250K; sketch-scoring kernels",
    "2026-12-01-h200-run18": "agents 8 x 250K with the Triton tier (47.9 ms per step); MTP speed",
    "2026-12-01-h200-run19": "prefill attention (cuDNN vs flash), QSA tier on qwen4-exp-h200, sketch scoring",
    "2026-12-01-h200-run20": "27B dense decode at 8K in CUDA graphs (77% of its floor), 8K prefill 9.7K tok/s, QSA decode by context",
    "2026-12-01-h200-run21": "prefill 9.6K tok/s at 8K, 7.56K at 128K (1.74x transformers); QSA and MTP",
    "2026-12-01-h200-run22": "qwen4_exp QSA decode flat from 8K to 1M (42.8 / 40.2 / 39.0 tok/s); GPU tests",
    "2026-12-01-h200-run23": "zero-copy host gather: 83-90% of the pinned copy bandwidth at 512 B rows",
    "2026-12-01-h200-run24": "the hot pool holds host records: 8 x 250K 180.9 tok/s, 0.91 GB GPU per agent",
    "2026-12-01-h200-run25": "KL by top-k and host rows on the reference model (H200); MTP verification at 8 x 250K, per-row selection",
    "2026-12-01-h200-run26": "eval agents: prune-at-prefill fails follow-ups that per-step selection answers; shared verification",
    "2026-12-01-h200-run27": "GDN verification without per-position states; GPU tests",
    "2026-12-01-h200-run28": "one-pass softmax scoring, radix-select top-k (kernel bench)",
    "2026-12-01-h200-run29": "softmax scoring storing per-head scores; agents 8 x 250K",
    "2026-12-01-h200-run30": "shared-verification tier read; MTP at 16K",
    "2026-12-01-h200-run31": "MTP-7 at 8 x 250K with shared selection",
    "2026-12-01-h200-run32": "speculative commit's GDN replay in CUDA graphs",
    "2026-12-01-h200-run33": "softmax scoring without per-tile reductions; GDN verification over all positions",
    "2026-12-01-h200-run34": "agents 8 x 250K plain and MTP-7 shared",
    "2026-12-01-h200-run35": "combine kernel one head row at a time; agents plain and MTP-7",
    "2026-12-01-h200-run36": "GDN positions on fla's batch mode (cut short)",
    "2026-12-01-h200-run37": "MTP drafter window W = 4096 at 8 x 250K",
    "2026-12-01-h200-run38": "fewer kernels per decode step: 34.6 ms at 8 x 250K (55% of the floor)",
    "2026-12-01-h200-run39": "radix select with more programs; MTP drafter W = 0 vs 4096",
    "2026-12-01-h200-run40": "MTP acceptance at 64K, windowed vs dense drafter",
    "2026-12-01-h200-run41": "MTP acceptance at 64K (explain), parity tests",
    "2026-12-01-h200-run42": "int8 scoring experiment (dot8, removed)",
    "2026-12-01-h200-run43": "1 x 128K transformers 7.06 tok/s (sparse and dense failed here, fixed for run 44); batched-heads scoring (removed)",
    "2026-12-01-h200-run44": "1 x 128K: sparse 46.2, dense 54.9, transformers 7.1 tok/s",
    "2026-12-02-h200-run45": "14 x 250K agents, the most 128 GB of host RAM holds: 295.6 tok/s",
    "2026-12-02-h200-run46": "MTP drafter K/V ring",
    "2026-12-02-h200-run47": "MTP-7 at 8 x 250K, shared selection: 53.0 ms per verification step (612.7 tok/s projected)",
    "2026-12-02-h200-run48": "int4 unpacking by PTX in the tensor-core scoring kernel; agents 8 x 250K",
    "2026-12-02-h200-run49": "cold prefill of 244K tokens 5,679 tok/s (dense prefill over the tier), follow-up TTFT 0.67 s",
    "2026-12-02-h200-run50": "MTP-7 verification at 8 x 128K: 629 tok/s projected, 2.63x plain",
    "2026-12-02-h200-run51": "chunk selection (timed out)",
    "2026-12-02-h200-run52": "follow-up TTFT 0.37 s at 8 x 250K with chunk selection",
    "2026-12-02-h200-run53": "GPU tests of chunk selection",
    "2026-12-02-h200-run54": "KL of chunk-selected prefill on the reference model",
    "2026-12-02-h200-run55": "cold 244K prefill 8,185 tok/s with chunk selection; MTP acceptance at 128K over the tier",
    "2026-12-02-h200-run56": "GPU tests of chunk selection",
    "2026-12-02-h200-run57": "KL by host format (bf16 / int8 / int4 rows); MTP acceptance at 248K (2.80 tokens)",
    "2026-12-02-h200-run58": "centred host keys (KL)",
    "2026-12-02-h200-run59": "MTP decode timing on the reference model at 128K, prompts cached",
    "2026-12-02-h200-run60": "MTP decode timing on the reference model at 8 x 248K",
    "2026-12-02-h200-run61": "where an MTP-7 step goes on the reference model (profile)",
    "2026-12-02-h200-run62": "run 59 again with repeats on a warm cache",
    "2026-12-03-h200-run63": "MTP-7 step phases at 8 x 128K on the reference model",
    "2026-12-03-h200-run64": "drafter catch-up in a CUDA graph",
    "2026-12-03-h200-run65": "verification graphs per length bucket",
    "2026-12-03-h200-run66": "MTP-7 vs plain decoding on the reference model at 8 x 128K / 250K (1.21x / 1.13x shared)",
    "2026-12-03-h200-run67": "tier step without the misses' sort; host gather order",
    "2026-12-03-h200-run68": "admit candidates by Triton claims; 1 x 128K 20.2 ms",
    "2026-12-03-h200-run69": "admit on a side stream; 1 x 128K and 8 x 250K",
    "2026-12-03-h200-run70": "~250 fewer launches per step: 8 x 250K 30.1 ms (63%), 1 x 128K 17.9 ms (72%)",
    "2026-12-03-h200-run71": "GPU tests",
    "2026-12-03-h200-run72": "GPU tests at real sizes",
    "2026-12-03-h200-run73": "1 x 128K: sparse 57.3 tok/s, 8.03x transformers, 1.00x sketchkv dense",
    "2026-12-03-h200-run74": "k8v4 host rows on the GPU: agents 8 x 250K, KL",
    "2026-12-03-h200-run75": "software-pipelined scoring tiles (slower; reverted)",
    "2026-12-03-h200-run76": "k8v4 packing kernel; agents 8 x 250K int4 / k8v4",
    "2026-12-03-h200-run86": "integer scoring kernel, variant 3 vs 4 (see run 85)",
    "2026-12-03-h200-run87": "integer scoring kernel, variant 4 under ncu (see run 85)",
    "2026-12-03-h200-run88": "sum vs softmax combine at 8 x 250K: 274.9 vs 240.9 tok/s (see run 85)",
    "2026-12-03-h200-run89": "dp4a sum scoring 77 us per 27B layer, 80% of the HBM copy bandwidth (see run 85)",
    "agents-2026-12-01": "bench agents report, 27B shape, 8 x 250K (merged runs)",
    "agents-2026-12-02": "bench agents report, 27B shape: 1 x 128K vs transformers, 8 x 128K / 250K, 14 x 250K (merged runs)",
    "agents-2026-12-03": "bench agents report, 27B shape: 1 x 128K sparse / dense / transformers, 8 x 250K (merged runs)",
    "agents-2026-12-04": "bench agents report, 27B shape: 1 x 128K (run 73) and 8 x 250K (runs 93, 94, 96) - the headline numbers",
    "agents-reference-2026-12-04": "bench agents on the reference model, real text: hot-buffer hit rates 0.59 / 0.73 / 0.98",
    "reference-model": "the bundled reference model: training and held-out evaluation (perplexity, lookup / copy recall)",
    "selection-study-2026-11-29": "how the sketch selects: basis rank, int4, head combine (sum / softmax / max) on the reference model",
    "cpu-reference-2026-11-29": "reference model decode speed on 2 CPU cores (JSON)",
    "engine-h200-2026-11-29": "first engine timings on the H200 (27B shape)",
    "quality-2026-11-29": "lookup / copy recall of sparse selection on the reference model (H200)",
}


def folders() -> list[str]:
    return sorted(d for d in os.listdir(RESULTS) if os.path.isdir(os.path.join(RESULTS, d)))


def files(d: str) -> list[str]:
    out = []
    for root, _, names in os.walk(os.path.join(RESULTS, d)):
        out += [os.path.relpath(os.path.join(root, n), os.path.join(RESULTS, d)) for n in names]
    return sorted(out)


def _readme(d: str) -> str:
    p = os.path.join(RESULTS, d, "README.md")
    return open(p).read() if os.path.exists(p) else ""


def date_of(d: str) -> str:
    m = re.search(r"(\d{4}-\d{2}-\d{2})", d)
    return m.group(1) if m else ""


def device_of(d: str) -> str:
    """From the folder's name (h200, h200x2, h100, cpu), else call.json, else the README's first lines."""
    for pat, name in ((r"h200x8", "8 x H200"), (r"h200x4", "4 x H200"), (r"h200x2", "2 x H200"), (r"h200", "H200"),
                      (r"h100", "H100"), (r"cpu", "CPU")):
        if re.search(pat, d):
            return name
    text = ""
    p = os.path.join(RESULTS, d, "call.json")
    if os.path.exists(p):
        try:
            text = str(json.load(open(p)).get("device", ""))
        except (ValueError, AttributeError):
            text = ""
    text += " " + _readme(d)[:400]
    for pat, name in ((r"[Dd]evice: CPU|CPU \(|, CPU", "CPU"), (r"8 x (NVIDIA )?H200", "8 x H200"),
                      (r"4 x (NVIDIA )?H200", "4 x H200"), (r"2 x (NVIDIA )?H200", "2 x H200"), (r"H200", "H200"),
                      (r"CPU|cpu", "CPU")):
        if re.search(pat, text):
            return name
    return "?"


def what_of(d: str) -> str:
    if d in WHAT:
        return WHAT[d]
    text = _readme(d)
    title = text.split("\n", 1)[0].lstrip("# ").strip()
    title = re.sub(r"\s+—\s+\d{4}-\d{2}-\d{2}.*$", "", title)   # "... — 2026-12-02 (session 15), CPU"
    m = re.search(r"\)\s*:\s*(.+)$", title) or re.search(r"^[^:]*run \d+[^:]*:\s*(.+)$", title)
    return m.group(1).strip() if m else (title or "(no README.md)")


def index() -> str:
    rows = ["# Results", "",
            "One folder per published result: its README.md says what was measured, the numbers, the command, the "
            "device and the date; the JSON / Markdown / PNG files are the tool's own output. H200 runs are numbered "
            "in the order they ran; `call.json` / `call.sh` hold the exact command. Raw logs, stdout captures, "
            "patches and debug scripts were taken out of the tree on 2026-12-04 (issue 42): `git log -- "
            "benchmarks/results/FOLDER` finds them; scripts that reproduce a number are under "
            "[`benchmarks/`](..) and [`benchmarks/studies/`](../studies).", "",
            "Where to start: the headline numbers and their provenance are in the [README](../../README.md#headline-"
            "numbers); the performance report is [docs/performance.md](../../docs/performance.md), the quality "
            "report [docs/quality.md](../../docs/quality.md).", "",
            "Regenerate this page with `python benchmarks/results_index.py > benchmarks/results/README.md` after "
            "adding a folder.", "",
            "| result | date | device | what |", "|---|---|---|---|"]
    for d in sorted(folders(), key=lambda x: (date_of(x), x)):
        rows.append(f"| [{d}]({d}/) | {date_of(d)} | {device_of(d)} | {what_of(d).replace('|', '/')} |")
    return "\n".join(rows) + "\n"


def check() -> list[str]:
    problems = [f"{f}: a loose file (put it in a result folder with a README.md)" for f in sorted(os.listdir(RESULTS))
                if os.path.isfile(os.path.join(RESULTS, f)) and f != "README.md"]
    for d in folders():
        if not os.path.exists(os.path.join(RESULTS, d, "README.md")):
            problems.append(f"{d}: no README.md")
        for f in files(d):
            if RAW.search(os.path.basename(f)):
                problems.append(f"{d}/{f}: a raw log / patch / debug script")
    return problems


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--list", action="store_true", help="print every folder and its files")
    p.add_argument("--check", action="store_true", help="report folders without README.md or with raw files")
    a = p.parse_args(argv)
    if a.list:
        for d in folders():
            print(f"{d}: {' '.join(files(d))}")
        return 0
    if a.check:
        problems = check()
        print("\n".join(problems) or "ok")
        return 1 if problems else 0
    sys.stdout.write(index())
    return 0


if __name__ == "__main__":
    sys.exit(main())

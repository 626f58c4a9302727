"""Quality evaluations of sparse decode against dense (project issue 7): `sketchkv eval {kld,recall,agents}`.

- `kld`: teacher-forced KL(dense || candidate) and top-1 agreement on held-out code at chosen context lengths,
  against the dense noise floor (dense through another equally valid numeric path) -> JSON + Markdown + PNG.
- `recall`: lookup / copy needle tasks built from held-out code (scripts/reference_data.py's generators), greedy
  exact match, dense vs each candidate, per length.
- `agents`: multi-turn recall over one long document (several far-apart questions, the whole conversation
  re-sent each turn, so the prefix cache is used): dense vs sparse vs a prune-at-prefill baseline
  (SnapKV / TokenGate style, `sketchkv.eval.prune`).

Each module has `add_args(parser)` / `main(args)` for the CLI and a `run_*` function for Python use.

Not a subcommand: `python -m sketchkv.eval.sweep` (issue 40) runs many selection configurations (oracle, sketch ranks,
budgets, per-KV-head picks, host-row formats, the prune baseline) against dense with one prefill per sample and
engine, for CPU-bound studies; its output is the same kind of JSON / Markdown / PNG.
"""

COMMANDS = ("kld", "recall", "agents")


def module(name: str):
    import importlib
    if name not in COMMANDS:
        raise ValueError(name)
    return importlib.import_module(f"sketchkv.eval.{name}")

"""Speed benchmarks as subcommands (`sketchkv bench agents`), each against the bytes-moved floor measured in the
same run. Each module has `add_args(parser)` / `main(args)` for the CLI.

- `agents`: N agents x L tokens of context decoding concurrently, then a follow-up turn: sketchkv sparse + host
  tier, sketchkv dense where it fits, transformers (optional) -> JSON + Markdown + PNG.
- `step`: one decode step of N agents x L tokens against its bytes floor; with --profile, kernel by kernel (the
  step's timeline: each kernel's start, duration, the gap before it, its kind) -> JSON + Markdown + PNG.
- `floor` (library): bytes a decode step must move, bandwidths, memory per agent and capacity.
- `breakdown` (library): where a step's time goes: on a GPU the CUDA-graph steps under torch.profiler, by kernel
  kind and by CUDA stream; on a CPU timed regions by layer group.
- `data_parallel` (library): `bench agents --data-parallel N`: the points on N replica processes at once.
"""

COMMANDS = ("agents", "step")


def module(name: str):
    import importlib
    if name not in COMMANDS:
        raise ValueError(name)
    return importlib.import_module(f"sketchkv.bench.{name}")

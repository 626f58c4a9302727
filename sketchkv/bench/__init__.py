"""Speed benchmarks as subcommands (`sketchkv bench agents`), each against the bytes-moved floor measured in the
same run. Each module has `add_args(parser)` / `main(args)` for the CLI.

- `agents`: N agents x L tokens of context decoding concurrently, then a follow-up turn: sketchkv sparse + host
  tier, sketchkv dense where it fits, transformers (optional) -> JSON + Markdown + PNG.
- `floor` (library): bytes a decode step must move, bandwidths, memory per agent and capacity.
- `breakdown` (library): step time by layer group over a few eager steps.
"""

COMMANDS = ("agents",)


def module(name: str):
    import importlib
    if name not in COMMANDS:
        raise ValueError(name)
    return importlib.import_module(f"sketchkv.bench.{name}")

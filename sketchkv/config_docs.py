"""The configuration reference (docs/configuration.md), generated from the dataclasses of sketchkv/config.py.

    python -m sketchkv.config_docs > docs/configuration.md      # regenerate after changing a knob
    python -m sketchkv.config_docs --check docs/configuration.md   # exit 1 if the file is stale

Owns only the rendering: every knob's name, flag, environment variable, Python keyword, default and help text
come from `config.flat_fields()`, so the page cannot drift from what the CLI accepts (tests/test_config_docs.py
compares the committed page with this output)."""
import argparse
import dataclasses
import sys

from sketchkv import config as C

SECTIONS = {
    None: ("Engine", "`EngineConfig`: the model, the device and the engine-wide switches."),
    "cache": ("KV cache", "`CacheConfig`: paged KV blocks, prefix caching and the hybrid models' state snapshots."),
    "scheduler": ("Scheduler", "`SchedulerConfig`: who runs in a step, and how prompts and decode share the GPU."),
    "sparse": ("Sparse decode and the host tier", "`SparseConfig`: selection (sketch or QSA indexer), the exact "
               "attention over the picks, and the host-RAM KV tier. Every flag carries the `sparse` prefix."),
}


def _default(f) -> str:
    if f.default is not dataclasses.MISSING:
        return f"`{f.default!r}`" if f.default is not None else "`None`"
    if f.name == "model":
        return "the bundled reference model"
    return "(computed)"


def _type(f) -> str:
    return str(f.type).replace("typing.", "").replace("<class '", "").replace("'>", "")


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def markdown() -> str:
    out = ["# Configuration reference", "",
           "Generated from `sketchkv/config.py` by `python -m sketchkv.config_docs`; do not edit by hand "
           "(`tests/test_config_docs.py` fails when this page is stale).", "",
           "Every knob is set the same way in three places, and later ones win: the environment variable "
           "`SKETCHKV_<NAME>`, the CLI flag of `sketchkv generate` / `sketchkv serve` (`--<name>`, booleans also "
           "`--no-<name>`), and the keyword of `LLM(...)` (`LLM(model, sparse_top_k=256)`, or a whole section: "
           "`LLM(model, sparse=SparseConfig(top_k=256))`). Defaults are what you get with nothing set.", ""]
    by_section: dict = {}
    for name, section, f in C.flat_fields():
        by_section.setdefault(section, []).append((name, f))
    for section, rows in by_section.items():
        title, blurb = SECTIONS.get(section, (str(section), ""))
        out += [f"## {title}", "", blurb, "", "| flag / env / keyword | type | default | what it does, and why |",
                "|---|---|---|---|"]
        for name, f in rows:
            flag = "(positional / `--model`)" if name == "model" else f"`--{name.replace('_', '-')}`"
            aliases = " ".join(f"`{a}`" for a in C.ALIASES.get(name, []))
            where = f"{flag}{' ' + aliases if aliases else ''}<br>`SKETCHKV_{name.upper()}`<br>`{name}=`"
            out.append(f"| {where} | `{_cell(_type(f))}` | {_default(f)} | {_cell(f.metadata.get('help', ''))} |")
        out.append("")
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m sketchkv.config_docs", description=__doc__.split("\n")[0])
    p.add_argument("--check", metavar="FILE", help="compare FILE with the generated page; exit 1 if they differ")
    args = p.parse_args(argv)
    text = markdown()
    if args.check:
        with open(args.check) as fh:
            if fh.read() != text:
                print(f"{args.check} is stale: run `python -m sketchkv.config_docs > {args.check}`", file=sys.stderr)
                return 1
        return 0
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

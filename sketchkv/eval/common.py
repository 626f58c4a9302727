"""Shared pieces of the quality evaluations: candidate configurations, engines, held-out documents, outputs.

Nothing here imports torch at module level, so `sketchkv --help` stays fast.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import importlib.util
import json
import math
import os
import platform
import shlex
import sys
from dataclasses import dataclass, field

from sketchkv.errors import SketchKVError

# The seed's production knobs (sinks, top-k picks, recent window) were set for ~250K-token contexts.
SEED_CONTEXT = 262144
SEED_SPARSE = {"sparse_top_k": 2048, "sparse_sink_tokens": 64, "sparse_recent_tokens": 1024}

# Engine knobs that apply to every configuration of an evaluation run (flags of `sketchkv eval ...`).
BASE_OPTIONS = ("dtype", "device", "block_size", "max_num_batched_tokens", "max_num_seqs", "enforce_eager",
                "gpu_memory_utilization", "gpu_memory_gb", "cpu_kv_cache_gb", "num_kv_blocks", "state_cache_gb")


# ----------------------------------------------------------------------------------------------------------
# Candidate configurations
# ----------------------------------------------------------------------------------------------------------
@dataclass
class Candidate:
    name: str
    options: dict = field(default_factory=dict)   # flat engine options (LLM(..., **options))
    note: str = ""

    def describe(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.options.items()) or "(engine defaults)"

    @property
    def is_sparse(self) -> bool:
        return bool(self.options.get("sparse"))

    def sparse_budget(self) -> tuple[int, int, int]:
        """(sinks, top_k, recent) of this candidate, engine defaults filled in."""
        from sketchkv.config import SparseConfig
        d = SparseConfig()
        return (int(self.options.get("sparse_sink_tokens", d.sink_tokens)),
                int(self.options.get("sparse_top_k", d.top_k)),
                int(self.options.get("sparse_recent_tokens", d.recent_tokens)))


def _flat_fields() -> dict:
    from sketchkv.config import flat_fields
    return {name: f for name, _, f in flat_fields()}


def _parse_value(value: str, f):
    typ = str(f.type)
    v = value.strip()
    try:
        if "bool" in typ:
            if v.lower() not in ("1", "0", "true", "false", "yes", "no", "on", "off"):
                raise ValueError(v)
            return v.lower() in ("1", "true", "yes", "on")
        if v.lower() == "none" and "None" in typ:
            return None
        if "int" in typ:
            return int(v)
        if "float" in typ:
            return float(v)
    except ValueError:
        raise SketchKVError(f"bad value {value!r} for {f.name} ({typ})") from None
    return v


def normalize_option(key: str) -> str:
    """`--sparse-top-k`, `sparse_top_k` and `top_k` all name the flat engine option `sparse_top_k`."""
    fields = _flat_fields()
    k = key.strip().lstrip("-").replace("-", "_")
    if k in fields:
        return k
    if "sparse_" + k in fields:
        return "sparse_" + k
    raise SketchKVError(f"unknown engine option {key!r} (options: {', '.join(sorted(fields))})")


def parse_options(text: str) -> dict:
    """'sparse=true,sparse_top_k=256' -> {'sparse': True, 'sparse_top_k': 256}."""
    fields = _flat_fields()
    out = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        if "=" not in item:
            raise SketchKVError(f"candidate option {item!r} is not KEY=VALUE")
        k, v = item.split("=", 1)
        name = normalize_option(k)
        if name == "model":
            raise SketchKVError("a candidate cannot change the model (use --model)")
        out[name] = _parse_value(v, fields[name])
    return out


def seed_default_candidate(max_len: int, name: str = "sparse") -> Candidate:
    """Sparse decode with the seed's knobs (64 sinks + top-2048 + 1024 recent at ~250K context, ~1% picks),
    scaled by the model's context length when it is shorter than the seed's (never below 4/16/16)."""
    f = min(1.0, max_len / SEED_CONTEXT)
    opts = {"sparse": True,
            "sparse_top_k": max(16, round(SEED_SPARSE["sparse_top_k"] * f)),
            "sparse_sink_tokens": max(4, round(SEED_SPARSE["sparse_sink_tokens"] * f)),
            "sparse_recent_tokens": max(16, round(SEED_SPARSE["sparse_recent_tokens"] * f))}
    note = "the seed's defaults" + ("" if f == 1.0 else f" scaled by {f:.4g} (model context {max_len})")
    return Candidate(name, opts, note)


def parse_candidates(specs: list[str] | None, max_len: int) -> list[Candidate]:
    """`NAME:KEY=VALUE,...` specs; `default` (or none given) is the seed's sparse config scaled to the model."""
    if not specs:
        return [seed_default_candidate(max_len)]
    out, names = [], set()
    for spec in specs:
        if spec.strip() in ("default", "sparse-default"):
            c = seed_default_candidate(max_len, "sparse" if "sparse" not in names else "sparse-default")
        else:
            if ":" not in spec:
                raise SketchKVError(f"candidate {spec!r}: expected NAME:KEY=VALUE,... "
                                    "(e.g. 'k256:sparse=true,sparse_top_k=256')")
            name, opts = spec.split(":", 1)
            name = name.strip()
            if not name or name in ("dense-reference",) or name.startswith("floor"):
                raise SketchKVError(f"candidate name {name!r} is reserved or empty")
            c = Candidate(name, parse_options(opts))
        if c.name in names:
            raise SketchKVError(f"candidate name {c.name!r} given twice")
        names.add(c.name)
        out.append(c)
    return out


# ----------------------------------------------------------------------------------------------------------
# Engine flags shared by every configuration of a run
# ----------------------------------------------------------------------------------------------------------
def add_engine_args(parser: argparse.ArgumentParser) -> None:
    from sketchkv.config import add_dataclass_args, flat_fields
    skip = tuple(name for name, _, _ in flat_fields() if name not in BASE_OPTIONS)
    g = parser.add_argument_group("engine options applied to every configuration")
    add_dataclass_args(g, skip=skip)


def base_options(args: argparse.Namespace) -> dict:
    fields = _flat_fields()
    out = {}
    for name in BASE_OPTIONS:
        v = getattr(args, name, None)
        if v is None:
            continue
        out[name] = _parse_value(v, fields[name]) if isinstance(v, str) else v
    return out


def add_common_args(p: argparse.ArgumentParser, default_name: str) -> None:
    from sketchkv.config import default_model
    p.add_argument("data", nargs="*", help="held-out files/dirs (.py files under dirs); default: the reference "
                                          "model's held-out packages listed in MODEL/heldout.json")
    p.add_argument("--model", default=default_model(), help="Hugging Face model directory (default: bundled "
                                                           "reference model)")
    p.add_argument("--candidate", action="append", metavar="NAME:KEY=VALUE,...",
                   help="a configuration to compare with dense, e.g. 'k256:sparse=true,sparse_top_k=256' (keys: any "
                        "engine option, `sparse_` prefix optional; repeatable; 'default' = the seed's sparse knobs "
                        "scaled to the model, which is also what runs when no --candidate is given)")
    p.add_argument("--seed", type=int, default=0, help="seed of the document sampling (same seed, same documents)")
    p.add_argument("--out-dir", default=None, help="where NAME.json / NAME.md / NAME.png go (default: eval-results; "
                                                  "with --from-json, beside that file)")
    p.add_argument("--name", default=default_name, help=f"output file stem (default: {default_name})")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument("--from-json", metavar="NAME.json", help="run nothing: rewrite NAME.md / NAME.png from a saved "
                                                           "result file (e.g. one produced on a GPU machine)")


def make_llm(model: str, options: dict):
    from sketchkv.llm import LLM
    return LLM(model, **options)


def release(llm) -> None:
    """Drop an engine and give its memory back before the next configuration allocates its own."""
    import torch
    try:
        llm.engine.runner.graphs.clear()
    except AttributeError:
        pass
    llm.engine = None
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def check_no_preemption(llm, before: int) -> None:
    """Teacher forcing assumes no sequence was preempted (recompute would realign its rows)."""
    if llm.engine.scheduler.num_preemptions != before:
        raise SketchKVError("a sequence was preempted during teacher forcing: the KV cache is too small for this "
                            "batch (lower --floor-batch / --max-num-seqs or raise the KV budget)")


# ----------------------------------------------------------------------------------------------------------
# Model and held-out data
# ----------------------------------------------------------------------------------------------------------
def resolve_model(path: str) -> tuple[str, int]:
    """-> (model dir, context limit). A clear error when the directory is missing."""
    if path.startswith("random:"):
        raise SketchKVError("the evaluations need a model with a tokenizer (a Hugging Face directory)")
    if not os.path.isfile(os.path.join(path, "config.json")):
        from sketchkv.config import default_model
        hint = (" (the bundled reference model is not there yet: pass --model DIR)"
                if os.path.abspath(path) == os.path.abspath(default_model()) else "")
        raise SketchKVError(f"{path}: no config.json{hint}")
    from sketchkv.models.loader import load_config
    return path, load_config(path).max_position_embeddings


def load_tokenizer(model: str):
    """The model's Hugging Face `tokenizers.Tokenizer` (what scripts/reference_data works with)."""
    from sketchkv.models.tokenizer import Tokenizer
    return Tokenizer(model).tok


_RD = None


def reference_data():
    """scripts/reference_data.py (the training data's synthetic lookup/copy generators), imported from the
    source checkout this package lives in, or from sys.path. None when neither has it."""
    global _RD
    if _RD is not None:
        return _RD
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    # the checkout this package lives in, else the current directory (a wheel installed elsewhere, run from a
    # checkout, as on the GPU machines)
    for path in (os.path.join(here, "scripts", "reference_data.py"),
                 os.path.join(os.getcwd(), "scripts", "reference_data.py")):
        if os.path.isfile(path):
            break
    if os.path.isfile(path):
        spec = importlib.util.spec_from_file_location("reference_data", path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules.setdefault("reference_data", mod)
        spec.loader.exec_module(mod)
        _RD = mod
        return mod
    try:
        import reference_data as mod  # noqa: F401  (e.g. scripts/ on PYTHONPATH)
    except ImportError:
        return None
    _RD = mod
    return mod


def require_reference_data():
    rd = reference_data()
    if rd is None:
        raise SketchKVError("this evaluation builds its documents with scripts/reference_data.py (the reference "
                            "model's task generators): run it from a sketchkv source checkout or put scripts/ on "
                            "PYTHONPATH")
    return rd


@dataclass
class Doc:
    rel: str        # path shown in the `# file:` header
    package: str    # top-level package (for grouping)
    text: str


def _read(path: str) -> str | None:
    try:
        with open(path, "rb") as f:
            text = f.read().decode("utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    text = text.replace("\r\n", "\n").replace("\r", "\n").replace("\x00", "")
    if not text.strip():
        return None
    return text if text.endswith("\n") else text + "\n"


def read_documents(paths: list[str]) -> list[Doc]:
    """Files as given; directories: every .py file under them (sorted). Relative names keep the directory's
    own name as first component (its 'package')."""
    docs = []
    for p in paths:
        if os.path.isdir(p):
            base = os.path.dirname(os.path.abspath(p).rstrip(os.sep))
            for dirpath, dirnames, filenames in os.walk(p):
                dirnames[:] = sorted(d for d in dirnames if d not in ("__pycache__", ".git"))
                for fn in sorted(filenames):
                    if fn.endswith(".py"):
                        full = os.path.join(dirpath, fn)
                        text = _read(full)
                        if text is not None:
                            rel = os.path.relpath(os.path.abspath(full), base)
                            docs.append(Doc(rel, rel.split(os.sep)[0], text))
        elif os.path.isfile(p):
            text = _read(p)
            if text is not None:
                docs.append(Doc(os.path.basename(p), os.path.splitext(os.path.basename(p))[0], text))
        else:
            raise SketchKVError(f"{p}: no such file or directory")
    if not docs:
        raise SketchKVError(f"no readable text in {', '.join(paths)}")
    return docs


def heldout_documents(model: str) -> tuple[list[Doc], dict]:
    """The held-out packages listed in MODEL/heldout.json (written by scripts/train_reference.py), read from its
    corpus root, or from this interpreter's site-packages when that root is not on this machine."""
    f = os.path.join(model, "heldout.json")
    if not os.path.isfile(f):
        raise SketchKVError(f"{f} not found: give held-out files/directories as arguments")
    with open(f) as fh:
        info = json.load(fh)
    files = [x["path"] for x in info.get("files", [])]
    if not files:
        raise SketchKVError(f"{f} lists no files")
    import site
    import sysconfig
    roots = [info.get("corpus_root"), sysconfig.get_paths()["purelib"]] + list(site.getsitepackages())
    best, best_n = None, 0
    for r in dict.fromkeys(x for x in roots if x and os.path.isdir(x)):
        n = sum(os.path.isfile(os.path.join(r, p)) for p in files[:200])
        if n > best_n:
            best, best_n = r, n
    if best is None:
        raise SketchKVError(f"none of the held-out files of {f} ({', '.join(info.get('packages', []))}) were found "
                            f"under {info.get('corpus_root')} or this Python's site-packages: give them as arguments")
    docs = []
    for p in files:
        text = _read(os.path.join(best, p))
        if text is not None:
            pkg = p.split("/")[0].split(os.sep)[0]
            docs.append(Doc(p, pkg[:-3] if pkg.endswith(".py") else pkg, text))
    source = {"heldout_json": f, "root": best, "packages": info.get("packages"), "files_listed": len(files),
              "files_read": len(docs)}
    return docs, source


def heldout_token_ids(model: str, n_tokens: int) -> list[int]:
    """The first n_tokens of the model's held-out files, tokenized file after file (a realistic prompt)."""
    docs, _ = heldout_documents(model)
    tok = load_tokenizer(model)
    ids: list[int] = []
    for d in docs:
        ids += tok.encode(d.text).ids
        if len(ids) >= n_tokens:
            return ids[:n_tokens]
    raise SketchKVError(f"only {len(ids)} tokens of held-out code found, need {n_tokens}")


def load_documents(paths: list[str], model: str) -> tuple[list[Doc], dict]:
    if paths:
        docs = read_documents(paths)
        return docs, {"paths": [os.path.abspath(p) for p in paths], "files_read": len(docs)}
    return heldout_documents(model)


FILE_HEADER = "# file: {rel}\n"   # as in training (scripts/reference_data.py)


def concat_documents(docs: list[Doc]) -> tuple[str, list[int]]:
    """Package by package in path order, each file behind its `# file:` header (as the training data)."""
    parts, starts, pos = [], [], 0
    for d in sorted(docs, key=lambda d: (d.package, d.rel)):
        s = FILE_HEADER.format(rel=d.rel) + d.text
        starts.append(pos)
        parts.append(s)
        pos += len(s)
    return "".join(parts), starts


def answer_span(offsets, a: int, b: int) -> tuple[int, int]:
    """Token range [k0, k1) covering the answer characters [a, b) (also used by scripts/eval_reference.py)."""
    k0 = next(i for i, (s, e) in enumerate(offsets) if e > a)
    k1 = k0
    while k1 < len(offsets) and offsets[k1][0] < b:
        k1 += 1
    return k0, k1


# ----------------------------------------------------------------------------------------------------------
# Statistics and outputs
# ----------------------------------------------------------------------------------------------------------
def report_header(title: str, r: dict) -> list[str]:
    """The first Markdown lines of every eval report: title, command, machine, data."""
    info, d = r["info"], r["data"]
    if "heldout_json" in d:
        data = (f"held-out packages {', '.join(d.get('packages') or [])} per {d['heldout_json']} "
                f"({d['files_read']} files under {d['root']})")
    else:
        data = f"{d['files_read']} files from {', '.join(d['paths'])}"
    return [f"# {title} ({os.path.basename(info['model'].rstrip('/'))})", "",
            f"- command: `{info['command']}`",
            f"- date {info['date']}; device {info['device']}; torch {info['torch']}; engine options "
            f"{info['base_options'] or '(defaults)'}",
            f"- data: {data}"]


def quantile(values, q: float) -> float | None:
    import numpy as np
    v = np.asarray(values, dtype=np.float64)
    return float(np.quantile(v, q)) if v.size else None


def finite_or_none(x):
    if x is None:
        return None
    x = float(x)
    return x if math.isfinite(x) else None


def run_info(model: str, base: dict) -> dict:
    import torch
    from sketchkv.engine.llm_engine import resolve_device
    dev = resolve_device(base.get("device", "auto"))
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"cpu ({os.cpu_count()} cores, " \
                                                                      f"{torch.get_num_threads()} threads)"
    return {"date": datetime.datetime.now().isoformat(timespec="seconds"),
            "command": "sketchkv " + " ".join(shlex.quote(a) for a in sys.argv[1:])
            if os.path.basename(sys.argv[0]) in ("sketchkv", "__main__.py") else " ".join(map(shlex.quote, sys.argv)),
            "model": os.path.abspath(model), "device": name, "torch": torch.__version__,
            "python": platform.python_version(), "base_options": base}


def write_json(path: str, obj) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(obj, f, indent=1, default=lambda o: o.item() if hasattr(o, "item") else str(o))


def write_text(path: str, text: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)) or ".", exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


def write_outputs(results: dict, out_dir: str, name: str, markdown_fn, plot_fn) -> dict:
    """NAME.json first (the numbers survive a plotting failure), then NAME.png and NAME.md."""
    base = os.path.join(out_dir, name)
    paths = {"json": base + ".json", "md": base + ".md", "png": base + ".png"}
    results["outputs"] = paths
    write_json(paths["json"], results)
    try:
        plot_fn(results, paths["png"])
    except Exception as e:  # e.g. no matplotlib on this machine: replot elsewhere with --from-json
        log(f"no plot written ({type(e).__name__}: {e}); redo it with --from-json {paths['json']}")
    write_text(paths["md"], markdown_fn(results, os.path.basename(paths["png"])))
    return paths


def save_partial(results: dict, out_dir: str, name: str) -> None:
    """NAME.json with the configurations finished so far (marked partial): a run cut short keeps its numbers."""
    write_json(os.path.join(out_dir, name + ".json"), {**results, "partial": True})


def replot(json_path: str, markdown_fn, plot_fn, out_dir: str | None = None) -> dict:
    """Rewrite NAME.md and NAME.png (and NAME.json) in out_dir, default beside the saved NAME.json (no model run)."""
    if not os.path.isfile(json_path):
        raise SketchKVError(f"{json_path}: no such file")
    with open(json_path) as f:
        results = json.load(f)
    results.pop("partial", None)
    out_dir = out_dir or os.path.dirname(os.path.abspath(json_path))
    name = os.path.splitext(os.path.basename(json_path))[0]
    paths = write_outputs(results, out_dir, name, markdown_fn, plot_fn)
    log(f"rewrote {paths['md']} and {paths['png']} from {json_path}")
    return results


def pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def save_figure(fig, path: str) -> None:
    """Lay out, write (creating the folder) and close a matplotlib figure."""
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)) or ".", exist_ok=True)
    fig.savefig(path, dpi=110)
    pyplot().close(fig)


def fmt(x, spec: str = ".4f") -> str:
    return "–" if x is None else format(x, spec)


def fmt_len(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def log(msg: str, quiet: bool = False) -> None:
    if not quiet:
        print(f"[{datetime.datetime.now().strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)

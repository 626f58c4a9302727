"""Corpus, tokenizer and synthetic long-range tasks for the sketchkv reference model (project issue 3).

Used by scripts/train_reference.py (training) and scripts/eval_reference.py (evaluation). Everything here runs
on CPU; nothing is downloaded. The corpus is the Python source of a site-packages directory:

* files are grouped by top-level package (``torch``, ``numpy``, ...); a package's files are concatenated in path
  order, each preceded by a ``# file: <relpath>`` line, and packages are separated by ``<|endoftext|>``, so a
  training window mostly lies inside one package and long-range references (imports, class names, helpers) are
  real;
* a fixed list of whole packages is held out (never trained on) and used for evaluation. A file is held out
  when its top-level package is in the list; a file that sits *under* a directory named like a held-out
  package elsewhere (vendored copies such as ``pip/_vendor/rich``) is dropped from both sides;
* synthetic long-range retrieval tasks are written as code and spliced into real code at line boundaries:
  (a) registries / constants with random keys and random values defined early and asserted much later
  (``assert REGISTRY["k_83af"] == 0x5e1d2c``), (b) a function repeated verbatim far later (copy).
"""
from __future__ import annotations

import ast
import hashlib
import json
import os
import random
import re
import sysconfig
import textwrap
from dataclasses import dataclass, field

import numpy as np

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
EOT = "<|endoftext|>"
# Qwen2/Qwen3 pre-tokenizer: digits are single tokens, newlines split from indentation. Values such as
# `0x5e1d2c` tokenize identically wherever they appear after a space, which keeps copies token-exact.
PRETOKENIZE_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
                       r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# Mid-size pure-Python packages present both in this repo's venv and in the H200 image (/opt/torch/.venv).
DEFAULT_HELDOUT = ("networkx", "rich", "jinja2", "click")
FILE_HEADER = "# file: {rel}\n"


def default_corpus_root() -> str:
    return sysconfig.get_paths()["purelib"]


# ----------------------------------------------------------------------------------------------------------
# Corpus discovery / reading
# ----------------------------------------------------------------------------------------------------------
@dataclass
class SourceFile:
    rel: str
    package: str
    size: int


@dataclass
class CorpusSplit:
    root: str
    train: list[SourceFile]
    heldout: list[SourceFile]
    heldout_packages: list[str]
    excluded_vendored: int = 0
    skipped_large: int = 0
    train_bytes_available: int = 0
    info: dict = field(default_factory=dict)


_SKIP_DIRS = {"__pycache__", ".git", "node_modules"}


def discover_corpus(root: str, heldout: list[str], packages: list[str] | None = None,
                    max_file_kb: int = 512, corpus_mb: float = 400.0, seed: int = 0) -> CorpusSplit:
    """List the .py files under `root`, split them into train / held-out, cap the train bytes (seeded)."""
    root = os.path.abspath(root)
    if not os.path.isdir(root):
        raise FileNotFoundError(f"corpus root {root} is not a directory")
    heldout_set = set(heldout)
    pkg_filter = set(packages) if packages else None
    train, held = [], []
    vendored = large = 0
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.endswith((".dist-info", ".egg-info")))
        rel_dir = os.path.relpath(dirpath, root)
        parts = [] if rel_dir == "." else rel_dir.split(os.sep)
        for fn in sorted(filenames):
            if not fn.endswith(".py"):
                continue
            pkg = parts[0] if parts else fn[:-3]
            if pkg_filter is not None and pkg not in pkg_filter and pkg not in heldout_set:
                continue
            full = os.path.join(dirpath, fn)
            try:
                st = os.stat(full)
            except OSError:
                continue
            if st.st_size == 0:
                continue
            if st.st_size > max_file_kb * 1024:
                large += 1
                continue
            rel = os.path.relpath(full, root)
            if pkg in heldout_set:
                held.append(SourceFile(rel, pkg, st.st_size))
            elif any(p in heldout_set for p in parts[1:]):
                vendored += 1  # e.g. pip/_vendor/rich: a copy of a held-out package, kept out of training
            else:
                train.append(SourceFile(rel, pkg, st.st_size))
    avail = sum(f.size for f in train)
    cap = int(corpus_mb * 1e6)
    if avail > cap:
        order = list(range(len(train)))
        random.Random(seed).shuffle(order)
        keep, total = [], 0
        for i in order:
            if total >= cap:
                break
            keep.append(i)
            total += train[i].size
        train = [train[i] for i in sorted(keep)]
    return CorpusSplit(root, train, held, sorted(heldout_set), vendored, large, avail)


def _read_one(args) -> tuple[str, str | None]:
    root, rel = args
    try:
        with open(os.path.join(root, rel), "rb") as f:
            raw = f.read()
        text = raw.decode("utf-8")
    except (OSError, UnicodeDecodeError):
        return rel, None
    text = text.replace("\r\n", "\n").replace("\r", "\n").replace("\x00", "")
    if not text.strip():
        return rel, None
    if not text.endswith("\n"):
        text += "\n"
    return rel, text


def read_files(root: str, files: list[SourceFile], workers: int) -> dict[str, str]:
    """Read (utf-8) the given files, in parallel when there are many; undecodable files are dropped."""
    jobs = [(root, f.rel) for f in files]
    out: dict[str, str] = {}
    if workers > 1 and len(jobs) > 256:
        import multiprocessing as mp
        ctx = mp.get_context("fork")
        with ctx.Pool(workers) as pool:
            for rel, text in pool.imap_unordered(_read_one, jobs, chunksize=64):
                if text is not None:
                    out[rel] = text
    else:
        for job in jobs:
            rel, text = _read_one(job)
            if text is not None:
                out[rel] = text
    return out


# ----------------------------------------------------------------------------------------------------------
# Functions (for the copy task)
# ----------------------------------------------------------------------------------------------------------
def extract_functions(text: str, max_per_file: int = 3, min_body_lines: int = 3, max_body_lines: int = 40,
                      max_chars: int = 2400, seed: int = 0) -> list[tuple[str, int]]:
    """Functions of a source file, dedented: list of (source, char offset where the body starts).

    The "signature" is everything up to and including the line that ends the ``def`` header; the body is the
    rest. Decorators are not included. Functions whose dedented source still starts with whitespace are skipped.
    """
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return []
    lines = text.splitlines(keepends=True)
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or not node.body:
            continue
        start, end = node.lineno - 1, node.end_lineno
        body_line = node.body[0].lineno - 1
        if end is None or body_line <= start:
            continue
        header_end = body_line - 1  # last header line: skip blank / comment-only lines before the body
        while header_end > start and (not lines[header_end].strip() or lines[header_end].lstrip().startswith("#")):
            header_end -= 1
        n_body = end - (header_end + 1)
        if not (min_body_lines <= n_body <= max_body_lines):
            continue
        seg = lines[start:end]
        src = textwrap.dedent("".join(seg))
        if not src.startswith(("def ", "async def ")) or len(src) > max_chars:
            continue
        if not src.endswith("\n"):
            src += "\n"
        sig_len = len("".join(src.splitlines(keepends=True)[: header_end + 1 - start]))
        if sig_len >= len(src) - 2:
            continue
        found.append((src, sig_len))
    if len(found) > max_per_file:
        found = random.Random(seed).sample(found, max_per_file)
    return found


def _extract_job(args):
    rel, text, max_per_file = args
    seed = int(hashlib.md5(rel.encode()).hexdigest()[:8], 16)
    return extract_functions(text, max_per_file=max_per_file, seed=seed)


def function_pool(texts: dict[str, str], workers: int, max_functions: int, seed: int,
                  max_per_file: int = 3, max_source_mb: float = 60.0) -> list[tuple[str, int]]:
    """Up to `max_functions` functions (see extract_functions) from a seeded sample of at most `max_source_mb` of
    the given files."""
    rels = sorted(texts)
    random.Random(seed).shuffle(rels)
    picked, total = [], 0
    for r in rels:
        if total >= max_source_mb * 1e6:
            break
        picked.append(r)
        total += len(texts[r])
    jobs = [(r, texts[r], max_per_file) for r in sorted(picked)]
    pool_out: list[tuple[str, int]] = []
    if workers > 1 and len(jobs) > 256:
        import multiprocessing as mp
        with mp.get_context("fork").Pool(workers) as pool:
            for funcs in pool.imap(_extract_job, jobs, chunksize=32):
                pool_out.extend(funcs)
    else:
        for job in jobs:
            pool_out.extend(_extract_job(job))
    if len(pool_out) > max_functions:
        pool_out = random.Random(seed).sample(pool_out, max_functions)
    return pool_out


# ----------------------------------------------------------------------------------------------------------
# Tokenizer
# ----------------------------------------------------------------------------------------------------------
def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer, length=len(texts))
    return tok


def save_tokenizer(tok, out_dir: str, model_max_length: int) -> None:
    os.makedirs(out_dir, exist_ok=True)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    added = {}
    for t in SPECIAL_TOKENS:
        added[str(tok.token_to_id(t))] = {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                          "single_word": False, "special": True}
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": model_max_length,
        "bos_token": None,
        "eos_token": EOT,
        "pad_token": EOT,
        "unk_token": None,
        "add_bos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "added_tokens_decoder": added,
        "extra_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "chat_template": CHAT_TEMPLATE,
    }
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f, indent=2)


def load_tokenizer(path: str):
    from tokenizers import Tokenizer
    return Tokenizer.from_file(os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path)


def _bytes_to_unicode() -> dict[int, str]:
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def token_tables(tok) -> tuple[np.ndarray, np.ndarray]:
    """(bytes per token, token ends with a newline byte) for every id of a byte-level BPE tokenizer."""
    vocab = tok.get_vocab(with_added_tokens=True)
    n = max(vocab.values()) + 1
    nbytes = np.zeros(n, dtype=np.int32)
    ends_nl = np.zeros(n, dtype=bool)
    nl_char = _bytes_to_unicode()[10]
    specials = set(SPECIAL_TOKENS)
    for s, i in vocab.items():
        if s in specials:
            nbytes[i] = len(s.encode())
            ends_nl[i] = False
        else:
            nbytes[i] = len(s)
            ends_nl[i] = s.endswith(nl_char)
    return nbytes, ends_nl


def encode_with_offsets(tok, text: str, starts: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Token ids and token start characters of `text`, encoded file by file (in parallel); `starts` are the
    character offsets at which `text` is cut (file starts)."""
    bounds = list(starts) + [len(text)]
    pieces = [text[a:b] for a, b in zip(bounds[:-1], bounds[1:])]
    ids, tstarts = [], []
    for a, e in zip(bounds[:-1], tok.encode_batch(pieces, add_special_tokens=False)):
        ids.append(np.asarray(e.ids, dtype=np.int64))
        tstarts.append(np.asarray([o[0] for o in e.offsets], dtype=np.int64) + a)
    return np.concatenate(ids), np.concatenate(tstarts)


def encode_texts(tok, texts: list[str], chunk_chars: int = 8_000_000) -> list[np.ndarray]:
    """Token ids (uint16/uint32) of each text, encoded in parallel by the Rust tokenizer, chunk by chunk."""
    dtype = np.uint16 if tok.get_vocab_size(with_added_tokens=True) <= 65535 else np.uint32
    enc_fn = getattr(tok, "encode_batch_fast", tok.encode_batch)
    out: list[np.ndarray] = []
    i = 0
    while i < len(texts):
        j, size = i, 0
        while j < len(texts) and (size < chunk_chars or j == i):
            size += len(texts[j])
            j += 1
        for e in enc_fn(texts[i:j], add_special_tokens=False):
            out.append(np.asarray(e.ids, dtype=dtype))
        i = j
    return out


def build_package_streams(tok, files: list[SourceFile], texts: dict[str, str]) -> tuple[list[str], list[np.ndarray]]:
    """Per package: its files in path order, each behind a `# file:` header line, encoded; EOT appended."""
    by_pkg: dict[str, list[str]] = {}
    for f in files:
        if f.rel in texts:
            by_pkg.setdefault(f.package, []).append(f.rel)
    pkgs = sorted(by_pkg)
    flat, owners = [], []
    for p in pkgs:
        for rel in sorted(by_pkg[p]):
            flat.append(FILE_HEADER.format(rel=rel) + texts[rel])
            owners.append(p)
    ids = encode_texts(tok, flat)
    eot = tok.token_to_id(EOT)
    dtype = ids[0].dtype if ids else np.uint16
    streams: dict[str, list[np.ndarray]] = {p: [] for p in pkgs}
    for p, arr in zip(owners, ids):
        streams[p].append(arr)
    return pkgs, [np.concatenate(streams[p] + [np.array([eot], dtype=dtype)]) for p in pkgs]


def heldout_text(files: list[SourceFile], texts: dict[str, str]) -> tuple[str, list[int]]:
    """Held-out packages concatenated in path order, each file behind its `# file:` header (as in training, no
    EOT); also each file's start offset."""
    parts, starts, pos = [], [], 0
    for f in sorted(files, key=lambda f: (f.package, f.rel)):
        if f.rel not in texts:
            continue
        s = FILE_HEADER.format(rel=f.rel) + texts[f.rel]
        starts.append(pos)
        parts.append(s)
        pos += len(s)
    return "".join(parts), starts


# ----------------------------------------------------------------------------------------------------------
# Synthetic retrieval snippets (shared by training and evaluation)
# ----------------------------------------------------------------------------------------------------------
REGISTRY_NAMES = ["REGISTRY", "_REGISTRY", "CONFIG", "_TABLE", "HANDLERS", "_CACHE", "SETTINGS", "LOOKUP",
                  "_CONSTANTS", "DEFAULTS", "OPCODES", "_SYMBOLS"]
KEY_PREFIXES = ["k_", "key_", "item_", "op_", "node_", "cfg_", "id_", "_x"]
_HEX = "0123456789abcdef"
_ALNUM = "abcdefghijklmnopqrstuvwxyz0123456789"


def rand_key(rng: random.Random, style: int | None = None) -> str:
    style = rng.randrange(4) if style is None else style
    if style == 0:
        return "k_" + "".join(rng.choice(_HEX) for _ in range(4))
    if style == 1:
        return rng.choice(KEY_PREFIXES) + "".join(rng.choice(_HEX) for _ in range(rng.randint(3, 6)))
    if style == 2:
        return rng.choice("abcdefghijklmnopqrstuvwxyz") + "".join(rng.choice(_ALNUM) for _ in range(rng.randint(3, 7)))
    return rng.choice(KEY_PREFIXES) + str(rng.randint(0, 99999))


def rand_value(rng: random.Random, style: int | None = None) -> str:
    style = (0 if rng.random() < 0.6 else rng.randrange(1, 3)) if style is None else style
    if style == 0:
        return "0x" + "".join(rng.choice(_HEX) for _ in range(6))
    if style == 1:
        return str(rng.randint(100000, 99999999))
    return '"' + "".join(rng.choice(_ALNUM) for _ in range(rng.randint(5, 8))) + '"'


@dataclass
class Registry:
    name: str            # dict name, or None-like "" for module-level constants
    entries: list[tuple[str, str]]  # (key, value)
    constants: bool = False

    def definition(self) -> str:
        if self.constants:
            return "".join(f"{k} = {v}\n" for k, v in self.entries)
        return f"{self.name} = {{\n" + "".join(f'    "{k}": {v},\n' for k, v in self.entries) + "}\n"

    def lookup(self, i: int) -> tuple[str, int, int]:
        """An assertion line that reads entry i back: (text, value start, value end) in characters."""
        k, v = self.entries[i]
        prefix = f"assert {k} ==" if self.constants else f'assert {self.name}["{k}"] =='
        return f"{prefix} {v}\n", len(prefix), len(prefix) + 1 + len(v)


def make_registry(rng: random.Random, n: int, constants: bool = False, key_style: int | None = None,
                  value_style: int | None = None) -> Registry:
    keys: set[str] = set()
    entries = []
    vstyle = value_style if value_style is not None else (0 if rng.random() < 0.6 else rng.randrange(1, 3))
    while len(entries) < n:
        k = rand_key(rng, key_style)
        if constants:
            k = k.upper().lstrip("_") or "K"
            if k[0].isdigit():
                k = "K_" + k
        if k in keys:
            continue
        keys.add(k)
        entries.append((k, rand_value(rng, vstyle)))
    return Registry(rng.choice(REGISTRY_NAMES), entries, constants)


# ----------------------------------------------------------------------------------------------------------
# Training batches
# ----------------------------------------------------------------------------------------------------------
class _DoesNotFit(Exception):
    pass


class BatchBuilder:
    """Deterministic (seed, step) -> batch of token rows and answer masks.

    A row is either a random window of the real token stream or, with probability `synth_frac`, a synthetic
    retrieval row: a real window of code with registries / constants spliced in near the start (first 15%), their
    assertions scattered over the rest, and functions from the training pool copied early and repeated verbatim
    later. `answer` marks the tokens whose prediction needs the retrieval (asserted values; copied bodies).
    """

    def __init__(self, tok, stream: np.ndarray, funcs: list[tuple[np.ndarray, int]], ends_nl: np.ndarray,
                 seed: int, synth_frac: float):
        self.tok = tok
        self.stream = stream
        self.funcs = funcs
        self.ends_nl = ends_nl
        self.seed = seed
        self.synth_frac = synth_frac

    def _window(self, rng: np.random.Generator, n: int) -> np.ndarray:
        if len(self.stream) <= n:
            reps = n // len(self.stream) + 2
            src = np.tile(self.stream, reps)
            start = int(rng.integers(0, len(self.stream)))
            return src[start:start + n].copy()
        start = int(rng.integers(0, len(self.stream) - n))
        return self.stream[start:start + n].copy()

    def batch(self, step: int, rows: int, length: int) -> tuple[np.ndarray, np.ndarray, int]:
        """Rows of `length + 1` tokens (inputs + shifted targets) and the answer mask; also #synthetic rows."""
        rng = np.random.default_rng([self.seed, step, 7919])
        ids = np.zeros((rows, length + 1), dtype=np.int64)
        ans = np.zeros((rows, length + 1), dtype=bool)
        n_syn = 0
        for r in range(rows):
            if self.synth_frac > 0 and rng.random() < self.synth_frac:
                row, mask = self.synthetic_row(rng, length + 1)
                n_syn += 1
            else:
                row, mask = self._window(rng, length + 1), None
            ids[r] = row
            if mask is not None:
                ans[r] = mask
        return ids, ans, n_syn

    def synthetic_row(self, rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
        seed = int(rng.integers(0, 2**62))
        for shrink in (1.0, 0.5, 0.25, 0.1):  # short rows: fewer / smaller snippets until they fit
            try:
                return self._synthetic_row(rng, n, random.Random(seed), shrink)
            except _DoesNotFit:
                continue
        return self._window(rng, n), np.zeros(n, dtype=bool)

    def _synthetic_row(self, rng: np.random.Generator, n: int, prng: random.Random,
                       shrink: float) -> tuple[np.ndarray, np.ndarray]:
        pieces: list[tuple[float, str, list[tuple[int, int]] | None]] = []  # (position in [0,1], text, answer spans)
        func_pieces: list[tuple[float, int, bool]] = []  # (position, pool index, is_second_copy)
        scale = n / 16384 * shrink
        max_entries = max(2, int(64 * min(scale, 1.0)))
        n_reg = prng.randint(1, 3) if scale >= 0.125 else 1
        n_local = prng.randint(0, 3) if scale >= 0.125 else 0
        regs = []  # (registry, position, local)
        for r in range(n_reg + n_local):
            local = r >= n_reg
            reg = make_registry(prng, prng.randint(min(4, max_entries), max_entries), constants=prng.random() < 0.3)
            # global registries near the start, asserted anywhere later (long range); local ones anywhere,
            # asserted within the next ~10% of the row (short range: the same mechanism, easier to pick up)
            pos = prng.uniform(0.15, 0.85) if local else prng.uniform(0.0, 0.15)
            regs.append((reg, pos, local))
            pieces.append((pos, reg.definition(), None))
        # lookups: every entry at most once until all were asked (long-range pressure: an earlier assertion of
        # the same key would be a shorter path), then again
        entries = [(ri, ei) for ri, (reg, _, _) in enumerate(regs) for ei in range(len(reg.entries))]
        prng.shuffle(entries)
        n_look = max(2, int(prng.randint(32, 160) * min(scale, 2.0)))
        for li in range(n_look + 1):
            if li == n_look:  # one assertion of a global registry at the very end of the row
                ri = prng.randrange(n_reg)
                ei = prng.randrange(len(regs[ri][0].entries))
            else:
                ri, ei = entries[li % len(entries)]
            reg, rpos, local = regs[ri]
            line, a, b = reg.lookup(ei)
            if li == n_look:
                pos = 1.0
            elif local:
                pos = min(rpos + prng.uniform(0.002, 0.1), 0.999)
            elif prng.random() < 0.5:  # half anywhere after the definition, half in the second half of the row
                pos = min(prng.uniform(rpos + 0.01, 1.0), 0.999)
            else:
                pos = min(prng.uniform(max(rpos, 0.5), 1.0), 0.999)
            pieces.append((pos, line, [(a, b)]))
        if self.funcs:
            for _ in range(prng.randint(0, 3)):
                fi = prng.randrange(len(self.funcs))
                if 2 * len(self.funcs[fi][0]) > n // 4:
                    continue
                p1 = prng.uniform(0.0, 0.3)
                p2 = prng.uniform(p1 + 0.1, 1.0)
                func_pieces.append((p1, fi, False))
                func_pieces.append((p2, fi, True))
        texts = [t for _, t, _ in pieces]
        encs = self.tok.encode_batch(texts, add_special_tokens=False)
        snippets = []  # (position, ids, answer mask)
        for (pos, _, spans), e in zip(pieces, encs):
            ids = np.asarray(e.ids, dtype=np.int64)
            m = np.zeros(len(ids), dtype=bool)
            if spans:
                for a, b in spans:
                    for j, (s, t) in enumerate(e.offsets):
                        if s >= a and t <= b and t > s:
                            m[j] = True
            snippets.append((pos, ids, m))
        for pos, fi, second in func_pieces:
            fids, sig_ntok = self.funcs[fi]
            m = np.zeros(len(fids), dtype=bool)
            if second:
                m[sig_ntok:] = True
            snippets.append((pos, fids.astype(np.int64), m))
        # keep the snippets within half of the row (matters for short rows only): drop lookups, never the
        # definitions or the final assertion
        snippets.sort(key=lambda s: s[0])
        total = sum(len(s[1]) for s in snippets)
        while total > n // 2:
            cand = [i for i, s in enumerate(snippets[:-1]) if s[2].any() and s[0] < 1.0]
            if not cand:
                break
            i = cand[int(rng.integers(0, len(cand)))]
            total -= len(snippets[i][1])
            snippets.pop(i)
        if total > n // 2:
            raise _DoesNotFit
        need = n - total
        extra = min(1024, max(16, need // 4))
        win = self._window(rng, need + extra).astype(np.int64)
        ends = np.flatnonzero(self.ends_nl[win[need - 1:]]) + need  # filler must end at a line end
        end = int(ends[0]) if len(ends) else need
        filler = win[end - need:end]
        nl = np.flatnonzero(self.ends_nl[filler]) + 1  # insertion points: right after a newline token
        if len(nl) == 0:
            nl = np.array([len(filler)])
        out_ids, out_mask, cur = [], [], 0
        for pos, ids, m in snippets:
            want = int(pos * len(filler))
            k = int(np.searchsorted(nl, want))
            cut = len(filler) if pos >= 1.0 else int(nl[min(k, len(nl) - 1)])
            cut = max(cut, cur)
            out_ids.append(filler[cur:cut])
            out_mask.append(np.zeros(cut - cur, dtype=bool))
            out_ids.append(ids)
            out_mask.append(m)
            cur = cut
        out_ids.append(filler[cur:])
        out_mask.append(np.zeros(len(filler) - cur, dtype=bool))
        row = np.concatenate(out_ids)
        mask = np.concatenate(out_mask)
        if len(row) >= n:  # the final assertion sits at the very end: keep the row's tail
            row, mask = row[len(row) - n:], mask[len(mask) - n:]
        else:
            pad = n - len(row)
            row = np.concatenate([filler[:pad], row])
            mask = np.concatenate([np.zeros(pad, dtype=bool), mask])
        return row, mask


# ----------------------------------------------------------------------------------------------------------
# Evaluation documents
# ----------------------------------------------------------------------------------------------------------
@dataclass
class EvalDoc:
    kind: str        # "lookup" or "copy"
    text: str
    answer_start: int  # characters: the answer (value / body) is text[answer_start:answer_end]
    answer_end: int
    meta: dict


class HeldoutDocs:
    """Builds lookup / copy documents of a given token length from held-out code.

    `text` is the held-out text (see heldout_text), `file_starts` the character offset of each file in it and
    `tok_starts` the character offset of each of its tokens (only used to cut filler of about the right length).
    """

    def __init__(self, tok, text: str, file_starts: list[int], funcs: list[tuple[str, int]], tok_starts=None):
        self.tok = tok
        self.text = text
        self.file_starts = file_starts
        self.funcs = funcs
        if tok_starts is None:
            tok_starts = [o[0] for o in tok.encode(text, add_special_tokens=False).offsets]
        self.tok_starts = np.asarray(tok_starts, dtype=np.int64)
        # line starts, for cutting filler at line boundaries
        self.line_starts = np.array([0] + [m.end() for m in re.finditer("\n", text)][:-1], dtype=np.int64)

    def _filler(self, rng: random.Random, n_tokens: int) -> str:
        """About `n_tokens` tokens of held-out code from the start of a random file on, cut at line boundaries
        and wrapping around at the end of the held-out text."""
        T = len(self.tok_starts)
        t0 = int(np.searchsorted(self.tok_starts, self.file_starts[rng.randrange(len(self.file_starts))]))
        parts, need = [], n_tokens
        while need > 0:
            t1 = min(t0 + need, T)
            c0 = int(self.tok_starts[t0])
            if t1 < T:
                c1 = int(self.tok_starts[t1])
                li = int(np.searchsorted(self.line_starts, c1, side="right")) - 1
                if int(self.line_starts[li]) > c0:
                    c1 = int(self.line_starts[li])
                    t1 = int(np.searchsorted(self.tok_starts, c1))
            else:
                c1 = len(self.text)
            if t1 <= t0:  # a single line longer than what is left: take it whole
                li = int(np.searchsorted(self.line_starts, c0, side="right"))
                c1 = int(self.line_starts[li]) if li < len(self.line_starts) else len(self.text)
                t1 = int(np.searchsorted(self.tok_starts, c1))
            parts.append(self.text[c0:c1])
            need -= t1 - t0
            t0 = t1 if t1 < T else 0
        return "".join(parts)

    @staticmethod
    def _insert_at_line(filler: str, frac: float, snippet: str) -> tuple[str, int]:
        pos = int(len(filler) * frac)
        nl = filler.rfind("\n", 0, pos)
        pos = nl + 1 if nl >= 0 else 0
        return filler[:pos] + snippet + filler[pos:], pos

    def _count(self, s: str) -> int:
        return len(self.tok.encode(s, add_special_tokens=False).ids)

    def lookup_doc(self, rng: random.Random, length: int, n_entries: int = 8) -> EvalDoc:
        reg = make_registry(rng, n_entries, constants=False, key_style=0, value_style=0)
        reg.name = "REGISTRY"
        qi = rng.randrange(n_entries)
        query, a, b = reg.lookup(qi)
        defn = reg.definition()
        overhead = self._count(defn) + self._count(query) + 8
        filler = self._filler(rng, max(length - overhead, 16))
        depth = rng.uniform(0.01, 0.05)
        body, at = self._insert_at_line(filler, depth, defn)
        text = body + query
        base = len(body)
        return EvalDoc("lookup", text, base + a, base + b,
                       {"key": reg.entries[qi][0], "value": reg.entries[qi][1], "depth": depth,
                        "def_char": at, "n_entries": n_entries})

    def copy_doc(self, rng: random.Random, length: int, max_tries: int = 50) -> EvalDoc:
        for _ in range(max_tries):
            src, sig_len = self.funcs[rng.randrange(len(self.funcs))]
            sig = src[:sig_len]
            overhead = 2 * self._count(src) + 8
            if overhead > length // 2:
                continue
            filler = self._filler(rng, length - overhead)
            first_line = sig.splitlines()[0]
            if first_line in filler:
                continue  # the signature must identify the function uniquely
            depth = rng.uniform(0.01, 0.05)
            body, at = self._insert_at_line(filler, depth, src)
            text = body + src
            base = len(body)
            return EvalDoc("copy", text, base + sig_len, base + len(src),
                           {"signature": first_line, "depth": depth, "def_char": at,
                            "body_chars": len(src) - sig_len})
        raise RuntimeError("could not build a copy document (functions too long for this length?)")

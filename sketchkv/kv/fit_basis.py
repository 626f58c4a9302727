"""`sketchkv fit-basis`: collect post-RoPE keys of every full-attention layer over calibration text
and fit the per-layer, per-KV-head rank-r PCA basis that sparse decode sketches keys with.

Streamed: files are read and tokenized one at a time, cut into sequences of `seq_len` tokens and
prefilled one sequence at a time on the engine's device (a GPU when there is one); each layer's keys are
folded into running moments on that device as they are computed (`KeyStats`), so memory stays at one
sequence whatever `max_tokens` is. A progress bar counts tokens and gives the rate and an ETA.
"""
import glob
import os
import time
from typing import Iterator

from tqdm import tqdm

from sketchkv.errors import SketchKVError
from sketchkv.kv.basis import KeyBasis, KeyStats, model_fingerprint
from sketchkv.layers.attention import Attention


def default_calibration() -> str:
    """Calibration text shipped with the reference model (code from its training split)."""
    from sketchkv.config import default_model
    return os.path.join(default_model(), "calibration")


def calibration_files(paths: list[str]) -> list[str]:
    """Files as given; directories: every file under them, sorted (byte-compiled files skipped)."""
    files = []
    for p in paths:
        if os.path.isdir(p):
            files += sorted(f for f in glob.glob(os.path.join(p, "**", "*"), recursive=True)
                            if os.path.isfile(f) and not f.endswith((".pyc", ".pyo")))
        elif os.path.isfile(p):
            files.append(p)
        else:
            raise SketchKVError(f"{p}: calibration file or directory not found")
    return files


def _read_text(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as fh:
            return fh.read()
    except (UnicodeDecodeError, OSError):
        return None


def calibration_texts(paths: list[str]) -> list[tuple[str, str]]:
    """(path, text) of every readable calibration file (all read at once; fit_basis streams instead)."""
    out = [(f, t) for f in calibration_files(paths) if (t := _read_text(f)) is not None]
    if not out:
        raise SketchKVError(f"no readable text in {', '.join(paths)}")
    return out


def token_sequences(encode, paths: list[str], max_tokens: int, seq_len: int) -> Iterator[list[int]]:
    """The calibration files' tokens, file after file, in sequences of seq_len (the last one may be shorter),
    max_tokens in all. Files are read and tokenized only as the sequences are consumed."""
    buf: list[int] = []
    total, any_text = 0, False
    for f in calibration_files(paths):
        text = _read_text(f)
        if text is None:
            continue
        any_text = True
        buf += encode(text)
        while len(buf) >= seq_len and total < max_tokens:
            n = min(seq_len, max_tokens - total)
            yield buf[:n]
            buf, total = buf[n:], total + n
        if total >= max_tokens:
            return
    if not any_text:
        raise SketchKVError(f"no readable text in {', '.join(paths)}")
    if buf and total < max_tokens:
        yield buf[:max_tokens - total]


def default_rank(head_dim: int) -> int:
    """max(32, head_dim / 4), at most head_dim: the seed's rank 64 for 256-dim heads; 32 for 64-dim heads, where
    rank 16 (head_dim / 4) made SmolLM2-135M's sketch picks 3.2x the exact-key oracle's KL at 2K and 8K against
    1.15-1.5x at rank 32 and 1.02-1.07x at rank 64 (benchmarks/results/2026-12-04-smollm2-quality)."""
    return min(head_dim, max(32, head_dim // 4))


def fit_basis(llm, paths: list[str], rank: int | None = None, max_tokens: int = 262144,
              seq_len: int = 8192, out: str | None = None, progress: bool = True) -> KeyBasis:
    eng = llm.engine
    cfg, model = eng.model_config, eng.model
    if eng.tokenizer is None:
        raise SketchKVError("fit-basis needs a model with a tokenizer")
    rank = rank or default_rank(cfg.head_dim)
    if not 0 < rank <= cfg.head_dim or rank % 2:
        raise SketchKVError(f"rank must be even and in (0, {cfg.head_dim}], got {rank}")
    # a prompt must leave room for the one token generate() produces
    seq_len = max(2, min(seq_len, eng.cfg.scheduler.max_model_len - 1))
    attn = [m for n, m in model.named_modules() if isinstance(m, Attention) and not n.startswith("mtp.")]
    stats = KeyStats(len(attn), cfg.num_kv_heads, cfg.head_dim, eng.device)
    hooks = [m.register_forward_pre_hook(lambda mod, args, j=j: stats.add(j, args[1])) for j, m in enumerate(attn)]
    from sketchkv.sampling_params import SamplingParams
    sp = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    t0 = time.time()
    bar = tqdm(total=max_tokens, desc=f"fit-basis: keys on {eng.device}", unit="tok", unit_scale=True,
               disable=not progress, smoothing=0.3)
    try:
        for chunk in token_sequences(eng.tokenizer.encode, paths, max_tokens, seq_len):
            if len(chunk) > 1:
                llm.generate(prompt_token_ids=[chunk], sampling_params=sp)
            bar.update(len(chunk))
        bar.total = bar.n   # the text may run out before max_tokens
        bar.refresh()
    finally:
        bar.close()
        for h in hooks:
            h.remove()
    if stats.n < 2:
        raise SketchKVError("fit-basis: too little calibration text (need at least 2 tokens)")
    bases, means, explained = stats.fit(rank)
    basis = KeyBasis(cfg.full_attention_layers, bases.cpu(), means.cpu(), model_fingerprint(cfg, model),
                     {"source": [os.path.relpath(p) for p in paths], "tokens": stats.n,
                      "explained_variance": [[round(x, 4) for x in row] for row in explained.tolist()],
                      "date": time.strftime("%Y-%m-%d"), "seconds": round(time.time() - t0, 1),
                      "device": str(eng.device)})
    if out:
        basis.save(out)
    return basis

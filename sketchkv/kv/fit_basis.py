"""`sketchkv fit-basis`: collect post-RoPE keys of every full-attention layer over calibration text
and fit the per-layer, per-KV-head rank-r PCA basis that sparse decode sketches keys with."""
import glob
import os
import time

from tqdm import tqdm

from sketchkv.errors import SketchKVError
from sketchkv.kv.basis import KeyBasis, KeyStats, model_fingerprint
from sketchkv.layers.attention import Attention


def default_calibration() -> str:
    """Calibration text shipped with the reference model (code from its training split)."""
    from sketchkv.config import default_model
    return os.path.join(default_model(), "calibration")


def calibration_texts(paths: list[str]) -> list[tuple[str, str]]:
    files = []
    for p in paths:
        if os.path.isdir(p):
            files += sorted(f for f in glob.glob(os.path.join(p, "**", "*"), recursive=True) if os.path.isfile(f))
        elif os.path.isfile(p):
            files.append(p)
        else:
            raise SketchKVError(f"{p}: calibration file or directory not found")
    out = []
    for f in files:
        try:
            with open(f, encoding="utf-8") as fh:
                out.append((f, fh.read()))
        except UnicodeDecodeError:
            continue
    if not out:
        raise SketchKVError(f"no readable text in {', '.join(paths)}")
    return out


def fit_basis(llm, paths: list[str], rank: int | None = None, max_tokens: int = 262144,
              seq_len: int = 8192, out: str | None = None) -> KeyBasis:
    eng = llm.engine
    cfg, model = eng.model_config, eng.model
    if eng.tokenizer is None:
        raise SketchKVError("fit-basis needs a model with a tokenizer")
    rank = rank or cfg.head_dim // 4
    if not 0 < rank <= cfg.head_dim or rank % 2:
        raise SketchKVError(f"rank must be even and in (0, {cfg.head_dim}], got {rank}")
    attn = [m for n, m in model.named_modules() if isinstance(m, Attention) and not n.startswith("mtp.")]
    stats = KeyStats(len(attn), cfg.num_kv_heads, cfg.head_dim, eng.device)
    hooks = [m.register_forward_pre_hook(lambda mod, args, j=j: stats.add(j, args[1])) for j, m in enumerate(attn)]
    # Concatenate the files and cut sequences of seq_len tokens: keys at many positions, as in use.
    ids: list[int] = []
    for _, text in calibration_texts(paths):
        ids += eng.tokenizer.encode(text)
        if len(ids) >= max_tokens:
            break
    ids = ids[:max_tokens]
    from sketchkv.sampling_params import SamplingParams
    sp = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    try:
        for start in tqdm(range(0, len(ids), seq_len), desc="fit-basis: collecting keys", unit="seq"):
            chunk = ids[start:start + seq_len]
            if len(chunk) > 1:
                llm.generate(prompt_token_ids=[chunk], sampling_params=sp)
    finally:
        for h in hooks:
            h.remove()
    bases, means, explained = stats.fit(rank)
    basis = KeyBasis(cfg.full_attention_layers, bases.cpu(), means.cpu(), model_fingerprint(cfg, model),
                     {"source": [os.path.relpath(p) for p in paths], "tokens": stats.n,
                      "explained_variance": [[round(x, 4) for x in row] for row in explained.tolist()],
                      "date": time.strftime("%Y-%m-%d")})
    if out:
        basis.save(out)
    return basis

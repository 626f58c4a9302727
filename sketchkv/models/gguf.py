"""GGUF checkpoints (llama.cpp's one-file format) -> (ModelConfig, model on the target device and dtype).

A `.gguf` path works wherever a Hugging Face directory does. The file's metadata becomes the
config.json fields ModelConfig.from_hf reads; each tensor is dequantized by the `gguf` package's own
numpy code, renamed to our parameter name (llama.cpp's `blk.N.attn_q` -> `model.layers.N.self_attn.q_proj`)
and copied into a parameter allocated on the target device, one tensor at a time. llama-arch files
store q/k rows permuted for llama.cpp's rotary layout; that is undone here (as transformers does).
The tokenizer from the same metadata is gguf_tokenizer.py.
"""
import functools
import os

import numpy as np
import torch

from sketchkv.errors import CheckpointError
from sketchkv.layers.rotary import RotaryEmbedding
from sketchkv.models.build import build_model
from sketchkv.models.fuse import fuse_projections
from sketchkv.models.model_config import ModelConfig

ARCHITECTURES = ("llama", "qwen2", "qwen3")
TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1")
TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
BLOCK_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_REQUIRED = object()


def is_gguf(path: str) -> bool:
    return path.lower().endswith(".gguf")


def open_gguf(path: str):
    """The file's GGUFReader (cached: parsing a 50K-token vocabulary takes seconds, and the config, the
    weights and the tokenizer each need the file). Any damage is a one-line CheckpointError."""
    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: GGUF file not found")
    st = os.stat(path)
    return _open(os.path.abspath(path), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=2)
def _open(path: str, size: int, mtime_ns: int):
    from gguf import GGUFReader
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise CheckpointError(f"{path}: not a GGUF file (no GGUF magic)")
    try:
        reader = GGUFReader(path)
    except Exception as e:  # gguf raises ValueError / KeyError / IndexError on damaged headers
        raise CheckpointError(f"{path}: corrupt or truncated GGUF ({type(e).__name__}: {e})") from None
    end = max((t.data_offset + t.n_bytes for t in reader.tensors), default=0)
    if end > size:  # the reader maps tensor data lazily: a short file would fail mid-load
        raise CheckpointError(f"{path}: truncated ({size} bytes, its tensors end at {end})")
    return reader


def field(reader, key: str, default=_REQUIRED):
    """One metadata value as Python (str, int, float, bool or list of them)."""
    from gguf import GGUFValueType
    f = reader.fields.get(key)
    if f is None:
        if default is _REQUIRED:
            raise CheckpointError(f"{reader.data.filename}: metadata key {key!r} missing")
        return default
    def one(i, t):
        return bytes(f.parts[i]).decode("utf-8") if t == GGUFValueType.STRING else f.parts[i][0].item()
    if f.types[0] == GGUFValueType.ARRAY:
        return [one(i, f.types[-1]) for i in f.data]
    return one(f.data[0], f.types[0])


def gguf_config(path: str) -> ModelConfig:
    """The ModelConfig a GGUF file describes, through the same ModelConfig.from_hf as a config.json."""
    r = open_gguf(path)
    arch = field(r, "general.architecture")
    if arch not in ARCHITECTURES:
        raise CheckpointError(f"{path}: unsupported GGUF architecture {arch!r} (supported: {', '.join(ARCHITECTURES)})")
    a = lambda key, default=_REQUIRED: field(r, f"{arch}.{key}", default)
    names = {t.name: t for t in r.tensors}
    if "token_embd.weight" not in names:
        raise CheckpointError(f"{path}: no token_embd.weight tensor")
    hidden, heads = a("embedding_length"), a("attention.head_count")
    scaling = a("rope.scaling.type", "none")
    if scaling not in ("none", None):
        raise CheckpointError(f"{path}: rope scaling {scaling!r} is not supported (plain RoPE, or Llama 3's "
                              "rope_freqs.weight)")
    eos = [field(r, f"tokenizer.ggml.{k}", None) for k in ("eos_token_id", "eot_token_id", "eom_token_id")]
    raw = {
        "model_type": arch,
        "vocab_size": int(names["token_embd.weight"].shape[-1]),  # gguf lists dims innermost first
        "hidden_size": hidden,
        "num_hidden_layers": a("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": a("attention.head_count_kv", heads),
        "head_dim": a("attention.key_length", None) or hidden // heads,
        "rope_theta": a("rope.freq_base", 10000.0),
        "rms_norm_eps": a("attention.layer_norm_rms_epsilon", 1e-6),
        "intermediate_size": a("feed_forward_length"),
        "max_position_embeddings": a("context_length", 32768),
        "tie_word_embeddings": "output.weight" not in names,
        # llama's attention_bias puts a bias on all four projections (qwen2's q/k/v bias is implied by its type)
        "attention_bias": arch == "llama" and "blk.0.attn_output.bias" in names,
        "eos_token_id": list(dict.fromkeys(e for e in eos if e is not None)),
        "bos_token_id": field(r, "tokenizer.ggml.bos_token_id", None),
    }
    return ModelConfig.from_hf(raw, path)


def our_name(name: str) -> str | None:
    """llama.cpp tensor name -> our parameter name (None: not a tensor we know)."""
    stem, _, suffix = name.rpartition(".")
    if stem in TOP_NAMES:
        return f"{TOP_NAMES[stem]}.{suffix}"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in BLOCK_NAMES:
        return f"model.layers.{parts[1]}.{BLOCK_NAMES[parts[2]]}.{suffix}"
    return None


def dequantize(tensor) -> torch.Tensor:
    """One ReaderTensor as fp32 in PyTorch's [out, in] layout (gguf lists dims innermost first)."""
    from gguf import dequantize as gguf_dequantize
    w = gguf_dequantize(tensor.data, tensor.tensor_type)
    return torch.from_numpy(w if w.flags.writeable else np.array(w))  # F32 comes back as a read-only view


def unpermute_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo convert_hf_to_gguf's LlamaModel.permute: per head, rows (pairs, 2) -> (2, pairs) back."""
    return w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def load_gguf_model(path: str, dtype: torch.dtype, device: torch.device) -> tuple[ModelConfig, torch.nn.Module]:
    cfg = gguf_config(path)
    r = open_gguf(path)
    bad = [t for t in r.tensors if t.tensor_type.name not in TENSOR_TYPES]
    if bad:
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        raise CheckpointError(f"{path}: tensor {bad[0].name!r}{more} is {bad[0].tensor_type.name}; sketchkv reads "
                              f"{', '.join(TENSOR_TYPES)} GGUF tensors")
    model = build_model(cfg, dtype, device)
    params = dict(model.named_parameters(remove_duplicate=False))
    filled: set[str] = set()
    rope_freqs = None
    for t in r.tensors:
        if t.name == "rope_freqs.weight":  # Llama 3 rope scaling, stored as per-frequency divisors
            rope_freqs = dequantize(t)
            continue
        name = our_name(t.name)
        if name is None:
            raise CheckpointError(f"{path}: unexpected tensor {t.name!r} for a {cfg.model_type} model")
        w = dequantize(t)
        if cfg.model_type == "llama" and (".q_proj." in name or ".k_proj." in name):
            w = unpermute_rows(w, cfg.num_heads if ".q_proj." in name else cfg.num_kv_heads)
        try:
            filled.update(model.load_weight(name, w.to(device=device, dtype=dtype), params))
        except CheckpointError as e:
            raise CheckpointError(f"{path}: {t.name}: {e}") from None
    missing = [n for n in params if n not in filled and not (cfg.tie_word_embeddings and n == "lm_head.weight")]
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise CheckpointError(f"{path}: missing tensor(s) {', '.join(missing[:3])}{more}")
    if rope_freqs is not None:
        for m in model.modules():
            if isinstance(m, RotaryEmbedding):
                if m.inv_freq.numel() != rope_freqs.numel():
                    raise CheckpointError(f"{path}: rope_freqs.weight has {rope_freqs.numel()} entries, the "
                                          f"rotary dims need {m.inv_freq.numel()}")
                m.inv_freq.div_(rope_freqs.to(m.inv_freq.device))
                m.key = m.key + ("rope_freqs",)
    fuse_projections(model)
    return cfg, model.eval()

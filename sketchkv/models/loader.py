"""Hugging Face checkpoint directory -> (ModelConfig, model on the target device and dtype).
(A `.gguf` file goes to gguf.py.)

Tensors are read one at a time from safetensors straight onto the target device and copied
into parameters that were allocated there, so the weights never exist twice in host RAM.
Every problem with the directory is a CheckpointError naming the file or tensor.
"""
import json
import os
import struct

import torch
from safetensors import safe_open

from sketchkv.errors import CheckpointError
from sketchkv.layers.int4_linear import prepare_int4
from sketchkv.models.build import build_model
from sketchkv.models.fuse import fuse_projections
from sketchkv.models.gguf import gguf_config, is_gguf, load_gguf_model
from sketchkv.models.model_config import ModelConfig
from sketchkv.models.presets import preset_config, preset_int4_layers, randomize
from sketchkv.models.quantized import Int4Reader, int4_format, int4_layers
from sketchkv.models.weights import expert_slices

SKIPPED_PREFIXES = ("model.visual.", "visual.", "model.vision_tower.")


def load_config(path: str) -> ModelConfig:
    if is_gguf(path):
        return gguf_config(path)
    if not os.path.isdir(path):
        from sketchkv.config import default_model
        if os.path.abspath(path) == os.path.abspath(default_model()):
            raise CheckpointError(f"{path}: the bundled reference model is not in this install yet; pass --model DIR "
                                  "(`sketchkv random-model tiny-hybrid DIR` writes a random stand-in)")
        raise CheckpointError(f"{path}: model directory not found")
    cfg_file = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_file):
        raise CheckpointError(f"{cfg_file}: missing (a Hugging Face model directory needs config.json)")
    try:
        with open(cfg_file) as f:
            raw = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{cfg_file}: not valid JSON ({e})") from None
    return ModelConfig.from_hf(raw, cfg_file)


def load_model_config(path: str) -> ModelConfig:
    """The ModelConfig of a checkpoint directory, `.gguf` file or `random:PRESET`, without loading weights."""
    return preset_config(path[len("random:"):])[0] if path.startswith("random:") else load_config(path)


def weight_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        try:
            with open(index) as f:
                shards = sorted(set(json.load(f)["weight_map"].values()))
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index}: malformed index ({e})") from None
        files = [os.path.join(path, s) for s in shards]
        for f in files:
            if not os.path.isfile(f):
                raise CheckpointError(f"{f}: shard listed in model.safetensors.index.json is missing")
        return files
    if os.path.isfile(os.path.join(path, "model.safetensors")):
        return [os.path.join(path, "model.safetensors")]
    # other *.safetensors, minus sketchkv's own side files (the key basis)
    files = sorted(os.path.join(path, f) for f in os.listdir(path)
                   if f.endswith(".safetensors") and not f.startswith("key_basis"))
    if not files:
        raise CheckpointError(f"{path}: no *.safetensors weights found")
    return files


def _check_file(file: str) -> None:
    """safetensors opens a truncated file lazily; check header and data size up front."""
    size = os.path.getsize(file)
    try:
        with open(file, "rb") as f:
            n = struct.unpack("<Q", f.read(8))[0]
            header = json.loads(f.read(n)) if 0 < n <= size - 8 else None
    except (struct.error, json.JSONDecodeError, UnicodeDecodeError):
        header = None
    if header is None:
        raise CheckpointError(f"{file}: corrupt safetensors header")
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if 8 + n + end > size:
        raise CheckpointError(f"{file}: truncated ({size} bytes, header describes {8 + n + end})")


def normalize_name(name: str) -> str | None:
    """Checkpoint tensor name -> our parameter name, or None to skip (vision tower)."""
    if name.startswith(SKIPPED_PREFIXES):
        return None
    if name.startswith("model.language_model."):
        return "model." + name[len("model.language_model."):]
    return name


def int4_layers_of(path: str, cfg: ModelConfig) -> dict[str, int] | None:
    """{layer: group size} of the int4 (W4A16) layers of a checkpoint directory or preset; None if it has none."""
    if path.startswith("random:"):
        return preset_int4_layers(cfg)
    if not cfg.quantization_config or not os.path.isdir(path):
        return None
    fmt = int4_format(cfg.quantization_config, os.path.join(path, "config.json"))
    return int4_layers(weight_files(path), fmt, normalize_name)


def load_model(path: str, dtype: torch.dtype, device: torch.device) -> tuple[ModelConfig, torch.nn.Module]:
    """A checkpoint directory, a `.gguf` file, or `random:PRESET` for a random-weight model of a named shape."""
    if path.startswith("random:"):
        cfg, _ = preset_config(path[len("random:"):])
        model = build_model(cfg, dtype, device, preset_int4_layers(cfg))
        randomize(model)
        fuse_projections(model)
        prepare_int4(model)
        return cfg, model.eval()
    if is_gguf(path):
        return load_gguf_model(path, dtype, device)
    cfg = load_config(path)
    files = weight_files(path)
    for f in files:
        _check_file(f)
    fmt = int4_format(cfg.quantization_config, os.path.join(path, "config.json")) if cfg.quantization_config else None
    model = build_model(cfg, dtype, device, int4_layers(files, fmt, normalize_name) if fmt else None)
    params = dict(model.named_parameters(remove_duplicate=False))
    int4 = Int4Reader(fmt, files, normalize_name, model, params, model.load_weight, dtype) if fmt else None
    filled: set[str] = set()
    has_mtp = any(n.startswith("mtp.") for n in params)
    dev = "cpu" if device.type == "cpu" else f"{device.type}:{device.index or 0}"
    for file in files:
        try:
            with safe_open(file, framework="pt", device=dev) as f:
                for key in f.keys():
                    name = normalize_name(key)
                    if name is None or (name.startswith("mtp.") and not has_mtp):
                        continue
                    if name == "lm_head.weight" and cfg.tie_word_embeddings:
                        continue
                    try:
                        if int4 is not None and int4.owns(name):  # int4 layers: models/quantized.py
                            filled.update(int4.load(name, f.get_tensor(key)))
                        else:
                            filled.update(model.load_weight(name, f.get_tensor(key), params))
                    except CheckpointError as e:
                        raise CheckpointError(f"{file}: {e}") from None
        except CheckpointError:
            raise
        except Exception as e:  # safetensors raises its own error types for damaged files
            raise CheckpointError(f"{file}: cannot read safetensors ({type(e).__name__}: {e})") from None
    if int4 is not None:
        int4.finish()
    missing = [n for n in params if n not in filled and not _filled_by_slices(n, params, filled)
               and not (cfg.tie_word_embeddings and n == "lm_head.weight")]
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise CheckpointError(f"{path}: missing tensor(s) {', '.join(missing[:3])}{more}")
    fuse_projections(model)
    prepare_int4(model)
    model.eval()
    return cfg, model


def _filled_by_slices(name: str, params: dict, filled: set[str]) -> bool:
    if not (name.endswith(".experts.gate_up_proj") or name.endswith(".experts.down_proj")):
        return False
    return expert_slices(name, params[name].shape[0]) <= filled

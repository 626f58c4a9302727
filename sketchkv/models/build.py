"""The architecture table, and a model's modules built on a device without loading any weights.

With int4 layers (W4A16, models/quantized.py) the model is built with its parameters on the meta device,
those nn.Linear become Int4Linear and every other parameter is then allocated on the device: the dense weights
of the int4 layers never exist (a 27B model would need 51 GB for them).
"""
import contextlib

import torch
from torch import nn

from sketchkv.layers.int4_linear import Int4Linear
from sketchkv.models.llama import LlamaForCausalLM
from sketchkv.models.model_config import ModelConfig
from sketchkv.models.qwen3_5 import Qwen3_5ForCausalLM
from sketchkv.models.qwen4_exp import Qwen4ExpForCausalLM

ARCHITECTURES = {"hybrid": Qwen3_5ForCausalLM, "dense": LlamaForCausalLM, "qwen4_exp": Qwen4ExpForCausalLM}


def build_model(cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
                int4: dict[str, int] | None = None) -> nn.Module:
    """Parameters allocated (uninitialised) directly on the target device in the target dtype.
    int4: {name: group size} of nn.Linear layers to build as Int4Linear (names that are no nn.Linear are left)."""
    with torch.device(device), _default_dtype(dtype):
        if not int4:
            return ARCHITECTURES[cfg.family](cfg)
        with _parameters_on_meta():
            model = ARCHITECTURES[cfg.family](cfg)
    for name, group in int4.items():
        try:
            lin = model.get_submodule(name)
        except AttributeError:
            continue
        if type(lin) is nn.Linear:
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent), attr, Int4Linear(lin.in_features, lin.out_features, group,
                                                                  lin.bias is not None, dtype, device))
    _materialize(model, device)
    return model


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(prev)


@contextlib.contextmanager
def _parameters_on_meta():
    """Parameters move to the meta device as modules register them, while buffers (RoPE frequencies, n-gram
    tables) are computed on the real device (accelerate's init_empty_weights(include_buffers=False))."""
    register = nn.Module.register_parameter

    def on_meta(module, name, param):
        if param is not None and not param.is_meta:
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def _materialize(model: nn.Module, device: torch.device) -> None:
    """Allocate every meta parameter on the device (uninitialised), keeping tied parameters tied."""
    made: dict[nn.Parameter, nn.Parameter] = {}
    for m in model.modules():
        for name, p in m._parameters.items():
            if p is not None and p.is_meta:
                if p not in made:
                    made[p] = nn.Parameter(torch.empty_like(p, device=device), requires_grad=p.requires_grad)
                m._parameters[name] = made[p]

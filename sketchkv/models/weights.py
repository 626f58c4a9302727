"""Copying checkpoint tensors into model parameters, with shape checks that name the tensor."""
import re

import torch

from sketchkv.errors import CheckpointError


def default_load_weight(name: str, tensor: torch.Tensor, params: dict, source: str | None = None) -> list[str]:
    if re.search(r"\.experts\.\d+\.", name):
        return _load_expert_slice(name, tensor, params)
    if name not in params:
        raise CheckpointError(f"unexpected tensor {source or name!r}: no such parameter in the model")
    p = params[name]
    if tuple(p.shape) != tuple(tensor.shape):
        raise CheckpointError(f"tensor {source or name!r} has shape {tuple(tensor.shape)}, "
                              f"the config implies {tuple(p.shape)}")
    with torch.no_grad():
        p.copy_(tensor)
    return [name]


def _load_expert_slice(name: str, tensor: torch.Tensor, params: dict) -> list[str]:
    """Per-expert tensors (`experts.{e}.{gate,up,down}_proj.weight`, the Hub layout) into the stacked
    parameters. Returns `{stacked}#{e}.{proj}` so the loader can tell when every slice arrived."""
    head, rest = name.split(".experts.")
    e, proj = int(rest.split(".")[0]), rest.split(".")[1]
    stacked_name = f"{head}.experts.{'down_proj' if proj == 'down_proj' else 'gate_up_proj'}"
    stacked = params.get(stacked_name)
    if stacked is None or e >= stacked.shape[0] or proj not in ("gate_proj", "up_proj", "down_proj"):
        raise CheckpointError(f"unexpected tensor {name!r}: no such expert in the model")
    inter = stacked.shape[1] // 2
    rows = {"gate_proj": slice(0, inter), "up_proj": slice(inter, 2 * inter), "down_proj": slice(None)}[proj]
    target = stacked[e, rows]
    if tuple(target.shape) != tuple(tensor.shape):
        raise CheckpointError(f"tensor {name!r} has shape {tuple(tensor.shape)}, the config implies "
                              f"{tuple(target.shape)}")
    with torch.no_grad():
        target.copy_(tensor)
    return [f"{stacked_name}#{e}.{proj}"]


def expert_slices(stacked_name: str, num_experts: int) -> set[str]:
    """The slice keys that together fill one stacked expert parameter."""
    projs = ("down_proj",) if stacked_name.endswith("down_proj") else ("gate_proj", "up_proj")
    return {f"{stacked_name}#{e}.{p}" for e in range(num_experts) for p in projs}

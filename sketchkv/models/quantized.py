"""Int4 (W4A16) checkpoints: config.json's `quantization_config` and each format's packed tensors -> the
canonical layout of ops/w4a16_gemm.py (qweight int32 [K/8, N], scales and zeros [K/G, N], w = (q - zeros) * scales).

Formats, by `quant_method` (and AutoRound's `packing_format`):
- `gptq` (GPTQModel, AutoGPTQ, AutoRound's `auto_gptq` export) and `auto-round` packed `auto_round:auto_gptq`
  (AutoRound's default for sym): `qweight` [K/8, N] is canonical already; `qzeros` int32 [K/G, N/8] packed
  along N, stored as zero - 1 (GPTQ's v1 convention; `checkpoint_format: gptq_v2` stores the zero itself);
  `scales` [K/G, N]; `g_idx` [K] only when trivial (k // G; act-order layouts fail).
- `auto-round` packed `auto_round:auto_awq` (AutoRound's asym export) and `awq` (GEMM): `qweight` [K, N/8] and
  `qzeros` [K/G, N/8] packed along N in AWQ's nibble order, `scales` [K/G, N].
- `compressed-tensors` `pack-quantized` (llm-compressor, `sketchkv quantize`): `weight_packed` [N, K/8] (q + 8,
  our nibbles transposed), `weight_scale` [N, K/G], `weight_zero_point` [N/8, K/G] packed along N (asym),
  `weight_shape`; strategies group and channel.
Anything else (bits != 4, quantized activations, act-order, other packings) fails at load with one line.

Which layers are int4 is read from the tensor names in the files (the config's ignore lists are not needed): a
layer that is an nn.Linear in our model becomes an Int4Linear (layers/int4_linear.py); int4 tensors of anything
else (stacked MoE experts, Qwen3-Next's interleaved GDN projections) are dequantized into the model dtype.
"""
from dataclasses import dataclass

import torch
from safetensors import safe_open
from torch import nn

from sketchkv.errors import CheckpointError
from sketchkv.layers.int4_linear import Int4Linear
from sketchkv.ops.w4a16_gemm import dequantize_int4, pack_int4

PARTS = {"gptq": ("qweight", "qzeros", "scales", "g_idx"), "awq": ("qweight", "qzeros", "scales"),
         "ct": ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx")}
REQUIRED = {"gptq": {"qweight", "qzeros", "scales"}, "awq": {"qweight", "qzeros", "scales"},
            "ct": {"weight_packed", "weight_scale"}}
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)        # AWQ packs column 8c + AWQ_ORDER[j] into nibble j
# The projections `sketchkv quantize` and the -w4a16 presets make int4 (as AutoRound / llm-compressor leave
# lm_head, embeddings, GDN gates b/a, MoE routers and the MTP head in bf16).
INT4_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "in_proj_qkv",
                "in_proj_z", "out_proj")


@dataclass
class Int4Format:
    layout: str           # gptq | awq | ct
    zero_offset: int = 0  # added to stored zeros (GPTQ v1 stores zero - 1)


def int4_format(qcfg: dict, source: str) -> Int4Format:
    """config.json's quantization_config -> the packing to read; one-line CheckpointError for what we do not run."""
    method = str(qcfg.get("quant_method", "")).lower().replace("_", "-")

    def bad(setting: str, why: str = "sketchkv runs 4-bit integer weights with bf16 activations (W4A16)"):
        return CheckpointError(f"{source}: quantization_config {setting} is not supported ({why})")

    if method == "compressed-tensors":
        return _compressed_tensors_format(qcfg, bad)
    bits = qcfg.get("bits", qcfg.get("w_bit"))
    if bits != 4:
        raise bad(f"bits={bits}")
    if method == "gptq":
        fmt = qcfg.get("checkpoint_format", qcfg.get("format", "gptq"))
        if fmt not in ("gptq", "gptq_v2"):
            raise bad(f"checkpoint_format={fmt!r}", "gptq and gptq_v2 are read")
        return Int4Format("gptq", 1 if fmt == "gptq" else 0)
    if method == "auto-round":
        if qcfg.get("data_type", "int") != "int" or qcfg.get("act_bits", 16) < 16:
            raise bad(f"data_type={qcfg.get('data_type')!r} act_bits={qcfg.get('act_bits')}")
        for layer, extra in (qcfg.get("extra_config") or {}).items():  # per-layer overrides; >= 16 bits: dense
            bits = extra.get("bits", 4)
            if bits < 16 and (bits != 4 or extra.get("data_type", "int") != "int"):
                raise bad(f"extra_config[{layer!r}] bits={bits} data_type={extra.get('data_type', 'int')!r}")
        packing = qcfg.get("packing_format") or ("auto_round:auto_gptq" if qcfg.get("sym", True) else None)
        if packing in ("auto_round:auto_gptq", "auto_round:gptq", "auto_gptq"):
            return Int4Format("gptq", 1)
        if packing in ("auto_round:auto_awq", "auto_awq"):
            return Int4Format("awq")
        raise bad(f"packing_format={packing!r}", "auto_round:auto_gptq and auto_round:auto_awq are read")
    if method == "awq":
        version = str(qcfg.get("version", "gemm")).lower()
        if version != "gemm":
            raise bad(f"version={version!r}", "AWQ's GEMM packing is read")
        return Int4Format("awq")
    raise bad(f"quant_method={qcfg.get('quant_method')!r}",
              "int4 checkpoints of gptq, auto-round, awq and compressed-tensors pack-quantized are read")


def _compressed_tensors_format(qcfg: dict, bad) -> Int4Format:
    if qcfg.get("format", "pack-quantized") != "pack-quantized":
        raise bad(f"format={qcfg.get('format')!r}", "pack-quantized is read")
    for key in ("sparsity_config", "transform_config", "kv_cache_scheme"):
        if qcfg.get(key):
            raise bad(key)
    for name, group in (qcfg.get("config_groups") or {}).items():
        if group.get("format", "pack-quantized") not in ("pack-quantized", None):
            raise bad(f"config_groups.{name}.format={group.get('format')!r}", "pack-quantized is read")
        if group.get("input_activations") or group.get("output_activations"):
            raise bad(f"config_groups.{name} activation quantization")
        w = group.get("weights") or {}
        setting = {"num_bits": w.get("num_bits"), "type": w.get("type"), "strategy": w.get("strategy"),
                   "dynamic": w.get("dynamic", False)}
        if setting["num_bits"] != 4 or setting["type"] != "int" or setting["dynamic"] \
                or setting["strategy"] not in ("group", "channel"):
            raise bad(f"config_groups.{name}.weights {setting}", "4-bit int weights, group or channel strategy")
    return Int4Format("ct")


# ---- which layers are int4 --------------------------------------------------------------------------------

def int4_parts(files: list[str], fmt: Int4Format, normalize) -> dict[str, dict[str, list[int]]]:
    """{layer name (ours): {part: shape}} from the safetensors headers, without reading any data."""
    parts = PARTS[fmt.layout]
    out: dict[str, dict[str, list[int]]] = {}
    for file in files:
        with safe_open(file, framework="pt") as f:
            for key in f.keys():
                name = normalize(key)
                if name is None or "." not in name:
                    continue
                layer, part = name.rsplit(".", 1)
                if part in parts:
                    out.setdefault(layer, {})[part] = list(f.get_slice(key).get_shape())
    return {layer: p for layer, p in out.items() if REQUIRED[fmt.layout] <= p.keys()}


def layer_shape(fmt: Int4Format, parts: dict[str, list[int]]) -> tuple[int, int, int]:
    """(K, N, group size) of an int4 layer from its tensor shapes (4-bit packing)."""
    if fmt.layout == "gptq":
        (k8, n), groups = parts["qweight"], parts["scales"][0]
        k = k8 * 8
    elif fmt.layout == "awq":
        (k, n8), groups = parts["qweight"], parts["scales"][0]
        n = n8 * 8
    else:
        (n, k8), groups = parts["weight_packed"], parts["weight_scale"][1]
        k = k8 * 8
    return k, n, k // max(groups, 1)


def int4_layers(files: list[str], fmt: Int4Format, normalize) -> dict[str, int]:
    """{layer name: group size} of the checkpoint's int4 layers that the Int4Linear kernel can run."""
    layers = {}
    for layer, parts in int4_parts(files, fmt, normalize).items():
        k, n, g = layer_shape(fmt, parts)
        if g and k % g == 0 and g % 8 == 0 and n % 8 == 0:
            layers[layer] = g
    return layers


def default_int4_layers(model: nn.Module, group_size: int) -> dict[str, int]:
    """{name: group size} of the projections a W4A16 conversion makes int4 (INT4_TARGETS outside the MTP head,
    where K divides into groups and N into packed words): `sketchkv quantize` and the -w4a16 presets."""
    return {name: group_size for name, m in model.named_modules()
            if isinstance(m, nn.Linear) and name.rsplit(".", 1)[-1] in INT4_TARGETS and not name.startswith("mtp.")
            and m.in_features % group_size == 0 and m.out_features % 8 == 0}


# ---- format -> canonical ----------------------------------------------------------------------------------

def _unpack_cols(packed: torch.Tensor, order=tuple(range(8))) -> torch.Tensor:
    """int32 [R, C] with 8 nibbles per word along the columns -> [R, 8C] (column 8c + order[j] = nibble j)."""
    shifts = 4 * torch.arange(8, dtype=torch.int32, device=packed.device)
    nib = (packed.unsqueeze(-1) >> shifts) & 0xF                     # [R, C, 8], nibble j
    inv = [order.index(i) for i in range(8)]                          # column offset i comes from nibble inv[i]
    return nib[..., inv].reshape(packed.shape[0], -1)


def canonical(fmt: Int4Format, t: dict[str, torch.Tensor], dtype: torch.dtype,
              name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """One layer's checkpoint tensors (part -> tensor) -> (qweight, scales, zeros, group size), canonical."""
    if fmt.layout == "gptq":
        qweight, scales = t["qweight"], t["scales"]
        zeros = _unpack_cols(t["qzeros"]) + fmt.zero_offset
    elif fmt.layout == "awq":
        q = _unpack_cols(t["qweight"], AWQ_ORDER)                     # [K, N]
        qweight, scales = pack_int4(q.t()), t["scales"]
        zeros = _unpack_cols(t["qzeros"], AWQ_ORDER)
    else:
        qweight, scales = t["weight_packed"].t(), t["weight_scale"].t()
        zp = t.get("weight_zero_point")
        zeros = torch.full_like(scales, 8) if zp is None else _unpack_cols(zp.t())[:, :scales.shape[1]]
        if "weight_shape" in t and [int(v) for v in t["weight_shape"]] != [qweight.shape[1], qweight.shape[0] * 8]:
            raise CheckpointError(f"{name}.weight_shape {t['weight_shape'].tolist()} does not match weight_packed "
                                  f"{tuple(t['weight_packed'].shape)} (4-bit packing)")
    if qweight.dtype != torch.int32:
        raise CheckpointError(f"{name}: packed weight is {qweight.dtype}, int32 expected")
    K, N = qweight.shape[0] * 8, qweight.shape[1]
    G = K // scales.shape[0]
    if scales.shape != (K // G, N) or zeros.shape != scales.shape or K % G:
        raise CheckpointError(f"{name}: scales {tuple(scales.shape)} / zeros {tuple(zeros.shape)} do not fit a "
                              f"4-bit weight of {K} x {N} (bits != 4?)")
    g_idx = t.get("g_idx", t.get("weight_g_idx"))
    if g_idx is not None and not torch.equal(g_idx.long(), torch.arange(K, device=g_idx.device) // G):
        raise CheckpointError(f"{name}: act-order g_idx (desc_act / actorder) is not supported: quantize with "
                              "desc_act=False or static groups")
    return qweight.contiguous(), scales.to(dtype).contiguous(), zeros.to(dtype).contiguous(), G


class Int4Reader:
    """Collects each int4 layer's tensors as the loader streams them; once a layer's parts are all in, converts
    them and fills its Int4Linear (or dequantizes into the dense parameter the model has under that name)."""

    def __init__(self, fmt: Int4Format, files: list[str], normalize, model: nn.Module, params: dict, load_weight,
                 dtype: torch.dtype):
        self.fmt, self.model, self.params, self.load_weight, self.dtype = fmt, model, params, load_weight, dtype
        self.expected = {layer: set(p) for layer, p in int4_parts(files, fmt, normalize).items()}
        self.pending: dict[str, dict[str, torch.Tensor]] = {}

    def owns(self, name: str) -> bool:
        layer, _, part = name.rpartition(".")
        return part in self.expected.get(layer, ())

    def load(self, name: str, tensor: torch.Tensor) -> list[str]:
        layer, _, part = name.rpartition(".")
        got = self.pending.setdefault(layer, {})
        got[part] = tensor
        if got.keys() < self.expected[layer]:
            return []
        del self.pending[layer]
        module = self.model.get_submodule(layer) if f"{layer}.qweight" in self.params else None
        if not isinstance(module, Int4Linear):  # no int4 layer of ours here: dense weight (scales kept in fp32)
            w = dequantize_int4(*canonical(self.fmt, got, torch.float32, layer), self.dtype)
            return self.load_weight(f"{layer}.weight", w, self.params)
        qweight, scales, zeros, G = canonical(self.fmt, got, self.dtype, layer)
        if (qweight.shape, scales.shape) != (module.qweight.shape, module.scales.shape):
            raise CheckpointError(f"{layer}: int4 weight of {qweight.shape[0] * 8} x {qweight.shape[1]} in groups "
                                  f"of {G}, the config implies {module.in_features} x {module.out_features}")
        with torch.no_grad():
            module.qweight.copy_(qweight)
            module.scales.copy_(scales)
            module.zeros.copy_(zeros)
        return [f"{layer}.qweight", f"{layer}.scales", f"{layer}.zeros"]

    def finish(self) -> None:
        if self.pending:
            layer, got = next(iter(self.pending.items()))
            raise CheckpointError(f"{layer}: int4 tensors {sorted(self.expected[layer] - got.keys())} missing")

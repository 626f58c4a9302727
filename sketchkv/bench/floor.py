"""What a decode step must move, the bandwidths that bound it, and what fits in memory.

The bytes come from the model's shape and the engine's knobs (not from a measurement), except the host
tier's PCIe misses, which depend on the hit rate and are taken from the tier's counters:

    weights   every parameter once (all but the embedding table when it is not tied to the LM head:
              then one embedding row per agent); MTP layers excluded
    gdn_state each agent's Gated DeltaNet state (conv in the model dtype + recurrent in fp32), read
              and written
    kv        dense: every cached K and V row of every full-attention layer; sparse: the selected rows
              only, min(context, sinks + top_k + recent) per layer, in the model dtype
    sketch    sparse: the int4 key sketch (+ its fp16 scale) of every cached token, per KV head
    pcie      host tier: the missed rows read from pinned host memory (measured)

floor seconds = (weights + gdn_state + kv + sketch) / HBM bandwidth + pcie / PCIe bandwidth, the
bandwidths measured in the same run (a large device-to-device copy, read + write; a pinned
host-to-device copy). The PCIe term is added, not overlapped: in this engine a layer's misses are read
inside that layer's step. Writes of the new token's row (K/V, sketch) are a few KB and left out.
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass

import torch


@dataclass
class Shape:
    """The numbers of a model + engine configuration that the byte arithmetic needs."""
    weights: int          # bytes read per step independent of the batch (see module docstring)
    param_bytes: int      # bytes of all parameters (resident in memory, MTP included)
    embed_row: int        # bytes per agent for its embedding row (0 when the table is read in full)
    hidden: int
    intermediate: int
    attn_layers: int      # full-attention layers (the KV cache / host tier / sketch layers)
    kv_heads: int
    head_dim: int
    itemsize: int         # model dtype bytes
    gdn_state: int        # one agent's GDN state bytes (conv + recurrent)
    rank: int             # sketch rank (sparse)
    block_size: int

    @property
    def kv_per_token(self) -> int:
        return 2 * self.attn_layers * self.kv_heads * self.head_dim * self.itemsize

    @property
    def sketch_per_token(self) -> int:
        return self.attn_layers * self.kv_heads * (self.rank // 2 + 2)

    def host_per_token(self, fmt: str) -> int:
        from sketchkv.kv.host_store import HostKVStore
        return HostKVStore.bytes_per_token(self.attn_layers, self.kv_heads, self.head_dim, fmt)

    def hot_row(self, fmt: str) -> int:
        """GPU bytes of one hot-pool row (a host record of format fmt, over all layers)."""
        from sketchkv.kv.host_tier import hot_row_bytes
        return hot_row_bytes(self.attn_layers, self.kv_heads, self.head_dim, fmt)

    def to_dict(self) -> dict:
        return asdict(self)


def weight_bytes(model: torch.nn.Module) -> tuple[int, int]:
    """(bytes read per step besides embedding rows, bytes of one embedding row read per agent)."""
    params = {n: p for n, p in model.named_parameters() if not n.startswith("mtp.")}  # shared ones once
    total = sum(p.numel() * p.element_size() for p in params.values())
    emb = model.model.embed_tokens.weight
    lm = getattr(model, "lm_head", None)
    if lm is not None and getattr(lm, "weight", None) is emb:  # tied: the LM head reads the whole table
        return total, 0
    return total - emb.numel() * emb.element_size(), emb.shape[1] * emb.element_size()


def gdn_state_bytes(model: torch.nn.Module, itemsize: int) -> int:
    from sketchkv.layers.gated_deltanet import GatedDeltaNet
    total = 0
    for m in model.modules():
        if isinstance(m, GatedDeltaNet):
            conv, rec = m.state_shapes()
            total += math.prod(conv) * itemsize + math.prod(rec) * 4
    return total


def basis_rank(model_path: str, head_dim: int, basis: str | None = None) -> int:
    """Rank of the key basis the sparse engine will load (random models: head_dim / 4, as the runner)."""
    import os
    if model_path.startswith("random:"):
        return head_dim // 4
    from sketchkv.kv.basis import default_basis_path
    path = basis or default_basis_path(model_path)
    if not os.path.isfile(path):
        return head_dim // 4
    from safetensors import safe_open
    with safe_open(path, "pt") as f:
        return int(f.get_slice("bases").get_shape()[-1])


def shape_of(model_path: str, dtype: torch.dtype, block_size: int, basis: str | None = None,
             model: torch.nn.Module | None = None) -> Shape:
    """The Shape of a model, from its config alone (a parameter-free copy on the meta device) unless the
    built model is given."""
    from sketchkv.models.loader import build_model, int4_layers_of, load_config
    from sketchkv.models.presets import preset_config
    cfg = preset_config(model_path[len("random:"):])[0] if model_path.startswith("random:") else load_config(model_path)
    if model is None:  # int4 layers (W4A16) built as such: their bytes are the int4 tensors
        model = build_model(cfg, dtype, torch.device("meta"), int4_layers_of(model_path, cfg))
    itemsize = torch.empty((), dtype=dtype).element_size()
    w, row = weight_bytes(model)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    return Shape(weights=w, param_bytes=params, embed_row=row, hidden=cfg.hidden_size, intermediate=cfg.intermediate_size,
                 attn_layers=len(cfg.full_attention_layers), kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                 itemsize=itemsize, gdn_state=gdn_state_bytes(model, itemsize),
                 rank=basis_rank(model_path, cfg.head_dim, basis), block_size=block_size)


# ----------------------------------------------------------------------------------------------------------
# Bytes per decode step and the floor
# ----------------------------------------------------------------------------------------------------------
def step_bytes(shape: Shape, sparse: bool, agents: int, context: float, selected: int = 0,
               pcie: float = 0.0, resident: int | None = None, host_format: str | None = None) -> dict:
    """Bytes one decode step of `agents` agents at `context` cached tokens each must move.
    selected: sinks + top_k + recent (sparse). pcie: measured host-tier miss bytes per step.
    With the host tier (host_format given), the picks beyond the `resident` sinks + recent rows (model
    dtype) are read from the hot buffer in the host format (misses: PCIe, counted in pcie)."""
    kv_rows = min(context, selected) if sparse else context
    kv = agents * kv_rows * shape.kv_per_token
    if sparse and host_format is not None and resident is not None:
        res = min(kv_rows, resident)
        kv = agents * (res * shape.kv_per_token + (kv_rows - res) * shape.host_per_token(host_format))
    out = {"weights": shape.weights + agents * shape.embed_row,
           "gdn_state": 2 * agents * shape.gdn_state,
           "kv": kv,
           "sketch": agents * context * shape.sketch_per_token if sparse else 0}
    out["hbm"] = sum(out.values())
    out["pcie"] = pcie
    return out


def floor_seconds(b: dict, hbm_bw: float, pcie_bw: float) -> dict:
    hbm = b["hbm"] / hbm_bw
    pcie = b["pcie"] / pcie_bw if b["pcie"] else 0.0
    return {"hbm_s": hbm, "pcie_s": pcie, "total_s": hbm + pcie}


# ----------------------------------------------------------------------------------------------------------
# Bandwidths, measured in the run
# ----------------------------------------------------------------------------------------------------------
def _median_time(fn, device: torch.device, reps: int = 10) -> float:
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def hbm_bandwidth(device: torch.device, gib: float) -> float:
    """Device-to-device copy of `gib` GiB: bytes read + written per second (median of 10). On a CPU:
    the same over main memory."""
    n = max(1, int(gib * 2**30) // 2)
    a = torch.empty(n, dtype=torch.bfloat16, device=device).normal_()
    b = torch.empty_like(a)
    t = _median_time(lambda: b.copy_(a), device)
    return 2 * n * 2 / t


def pcie_bandwidth(device: torch.device, gib: float) -> float | None:
    """Pinned host -> device copy bytes per second (None on a CPU: there the host tier is main memory)."""
    if device.type != "cuda":
        return None
    n = max(1, int(gib * 2**30))
    src = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(n, dtype=torch.uint8, device=device)
    t = _median_time(lambda: dst.copy_(src, non_blocking=True), device)
    return n / t


# ----------------------------------------------------------------------------------------------------------
# Memory per agent and capacity (arithmetic before building an engine)
# ----------------------------------------------------------------------------------------------------------
def agent_bytes(shape: Shape, config: str, tokens: int, sinks: int = 0, recent: int = 0, hot_fraction: float = 0.0,
                host_format: str = "int4", hot_tokens: int | None = None, slot_bytes: int = 4,
                mtp_rows: int = 0, num_speculative_tokens: int = 0) -> dict:
    """GPU and host bytes one agent of `tokens` tokens holds. config: sparse (sparse decode + host tier),
    dense (sketchkv paged KV), hf (transformers' cache: K/V of every token + GDN state). slot_bytes: the hot
    buffer's map entry per host token and layer (2 while the whole pool has <= 32767 rows, else 4). mtp_rows:
    K/V rows of the MTP drafter's one attention layer with speculation on (`mtp_kv_rows`); with n drafts the
    tier's recent ring holds n more rows (a verification row reads its own last R tokens)."""
    bs = shape.block_size
    padded = -(-tokens // bs) * bs
    if config == "sparse":
        hot = max(64, math.ceil(hot_fraction * (hot_tokens if hot_tokens is not None else tokens)))
        # slot map: every layer's entry + the hot buffer's admit scratch (4 B per host slot, all layers)
        gpu = {"sketch": padded * shape.sketch_per_token, "slot_map": (slot_bytes * shape.attn_layers + 4) * padded,
               "resident": (sinks + max(recent, 1) + num_speculative_tokens) * shape.kv_per_token,
               "hot": hot * shape.hot_row(host_format),
               "gdn_state": shape.gdn_state}
        host = padded * shape.host_per_token(host_format)
    elif config == "dense":
        gpu = {"kv": padded * shape.kv_per_token, "gdn_state": shape.gdn_state}
        host = 0
    else:
        gpu = {"kv": tokens * shape.kv_per_token, "gdn_state": shape.gdn_state}
        host = 0
    if mtp_rows:
        gpu["mtp_kv"] = mtp_rows * shape.kv_per_token // shape.attn_layers
    return {"gpu": sum(gpu.values()), "gpu_parts": gpu, "host": host}


def mtp_kv_rows(tokens: int, num_speculative_tokens: int, window: int, block_size: int) -> int:
    """The drafter's K/V rows per agent: none without speculation, its ring with the windowed drafter
    (window > 0), every token with the dense one."""
    from sketchkv.layers.windowed_attention import MTP_WINDOW_SINKS, ring_width
    if not num_speculative_tokens:
        return 0
    return ring_width(MTP_WINDOW_SINKS, window, num_speculative_tokens, block_size) if window > 0 else tokens


def activation_estimate(shape: Shape, tokens: int) -> int:
    """Rough transient bytes of one forward over `tokens` tokens (MLP up/gate/act + a few hidden-size
    buffers): for the fit check only; the engine measures its own peak when it starts."""
    return tokens * (4 * shape.intermediate + 16 * shape.hidden) * shape.itemsize


def available_host_bytes() -> int:
    from sketchkv.kv.host_tier import available_host_bytes as avail
    return avail()


def budgets(device: torch.device, shape: Shape, opts: dict) -> dict:
    """Memory an engine of this run may use for per-agent state, before it is built.
    gpu: device memory (or its gpu_memory_gb cap) x utilisation - weights - a prefill chunk's activations - 2 GiB (graphs, slack);
    on a CPU the dense KV budget (cpu_kv_cache_gb). host: the host tier's budget (its default: half of
    MemAvailable)."""
    chunk = int(opts.get("max_num_batched_tokens") or 8192)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        if opts.get("gpu_memory_gb") is not None:   # the engine treats its cap as the card (cap_gpu_memory)
            total = min(total, int(float(opts["gpu_memory_gb"]) * 2**30))
        util = float(opts.get("gpu_memory_utilization") or 0.9)
        gpu = min(total * util, free) - shape.param_bytes - activation_estimate(shape, chunk) - 2 * 2**30
        total_gpu = total
    else:
        gpu = float(opts.get("cpu_kv_cache_gb") or 4.0) * 2**30
        total_gpu = None
    hb = opts.get("sparse_host_budget_gb")
    host = float(hb) * 2**30 if hb is not None else available_host_bytes() // 2
    gb = opts.get("sparse_gpu_budget_gb")
    return {"gpu": int(gpu), "host": int(host), "gpu_total": total_gpu,
            "tier_gpu": int(float(gb) * 2**30) if gb is not None else (int(gpu) if device.type == "cuda" else None)}


def max_agents(per_agent: dict, budget: dict, config: str) -> int:
    """Largest number of agents whose per-agent bytes fit the budgets."""
    if config == "sparse":
        n_host = budget["host"] // max(1, per_agent["host"])
        gpu = budget["tier_gpu"]
        n_gpu = gpu // max(1, per_agent["gpu"]) if gpu is not None else n_host
        return int(max(0, min(n_host, n_gpu)))
    return int(max(0, budget["gpu"] // max(1, per_agent["gpu"])))

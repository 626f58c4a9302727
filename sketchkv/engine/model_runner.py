"""Turns a scheduled batch into tensors, runs the model, samples. Owns the KV cache, the Gated
DeltaNet state slots and the decode CUDA graphs."""
import dataclasses
import gc
import itertools
import logging
import math

import numpy as np
import torch
from tqdm import tqdm

from sketchkv.config import EngineConfig, resolved_host_residual_keys, resolved_prefill_selection
from sketchkv.engine.context import Context, VerifyRows, set_context
from sketchkv.engine.graph_inputs import copy_event, host_views, send, staged, write_tables
from sketchkv.engine.phase_timer import PhaseTimer
from sketchkv.engine.sequence import Sequence, block_tables
from sketchkv.errors import CapacityError, RequestError
from sketchkv.layers.attention import Attention
from sketchkv.layers.gated_deltanet import GatedDeltaNet
from sketchkv.layers.indexed_attention import IndexedAttention
from sketchkv.layers.sampler import SampleOutput, sample
from sketchkv.kv.state_cache import StateCache
from sketchkv.layers.sparse_attention import SparseAttention
from sketchkv.layers.tiered_attention import TieredAttention, TieredIndexedAttention, TieredKV
from sketchkv.layers.windowed_attention import MTP_WINDOW_SINKS, WindowedAttention
from sketchkv.models.model_config import ModelConfig
from sketchkv.ops import prefill_attention, sketch as sketch_ops
from sketchkv.parallel.comm import agree_min

logger = logging.getLogger("sketchkv")

# Speculative verification graphs hold bucket x (1 + drafts) rows; above this many rows per step the
# verification runs eagerly (its per-row selection scratch over max_model_len grows with the rows).
VERIFY_GRAPH_MAX_ROWS = 128
# Decode and verification graphs of sparse / QSA models: one per length bucket, this many tokens, twice that, ...
FIRST_LENGTH_BUCKET = 16384


def capture_graph(fn, pool):
    """fn() captured into a CUDA graph sharing `pool` -> (graph, pool). Module level so that CPU tests
    can replace it with an eager stand-in and run the static-buffer steps without a GPU."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        fn()
    return graph, graph.pool()


def cap_gpu_memory(device: torch.device, gb: float | None) -> None:
    """gpu_memory_gb: this process's allocator refuses past `gb` GiB of the card, and the runner sizes its caches
    against that instead of the card (_free_gpu_bytes). Before the weights load, so they count too."""
    if gb is None or device.type != "cuda":
        return
    index = torch.cuda.current_device() if device.index is None else device.index   # the call wants an index
    total = torch.cuda.get_device_properties(index).total_memory
    if not 0 < gb * 2**30 <= total:
        raise RequestError(f"gpu_memory_gb={gb} must be above 0 and at most this card's {total / 2**30:.1f} GiB")
    torch.cuda.set_per_process_memory_fraction(gb * 2**30 / total, index)


def load_capped_model(cfg: EngineConfig, dtype: torch.dtype, device: torch.device):
    """cap_gpu_memory, then the model's weights -> (ModelConfig, model). Weights that do not fit the GPU (or
    its gpu_memory_gb cap) are a CapacityError of one line, not an out-of-memory trace."""
    from sketchkv.models.loader import load_model
    cap_gpu_memory(device, cfg.cache.gpu_memory_gb)
    try:
        return load_model(cfg.model, dtype, device)
    except torch.cuda.OutOfMemoryError:
        pass   # outside the handler, so the traceback's tensors are freed before we report
    gc.collect()
    torch.cuda.empty_cache()
    cap = f"gpu_memory_gb={cfg.cache.gpu_memory_gb}" if cfg.cache.gpu_memory_gb is not None else \
        f"{torch.cuda.get_device_properties(device).total_memory / 2**30:.1f} GiB card"
    raise CapacityError(f"the weights of {cfg.model} do not fit this GPU ({cap}); use a smaller or int4 (W4A16) "
                        f"checkpoint, or --tensor-parallel-size")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class ModelRunner:
    def __init__(self, cfg: EngineConfig, model_cfg: ModelConfig, model: torch.nn.Module,
                 device: torch.device, dtype: torch.dtype):
        self.cfg, self.model_cfg, self.model = cfg, model_cfg, model
        self.device, self.dtype = device, dtype
        self.block_size = cfg.cache.block_size
        self.max_model_len = cfg.scheduler.max_model_len
        self.max_blocks_per_seq = math.ceil(self.max_model_len / self.block_size)
        sp = cfg.sparse
        self.dense_threshold = sp.dense_threshold if sp.dense_threshold is not None else \
            sp.sink_tokens + sp.top_k + sp.recent_tokens
        # qwen4_exp: the model's QSA indexer is the selector, so the host tier needs no sketch (sparse=False)
        qsa = any(isinstance(m, IndexedAttention) for m in model.modules())
        if sp.host_tier and not sp.sparse and not qsa:
            raise RequestError("sparse_host_tier needs sparse decode (sparse=True): the tier serves the sparse picks")
        if sp.head_combine not in ("sum", "max", "softmax"):
            raise RequestError(f"sparse_head_combine must be sum, max or softmax, got {sp.head_combine!r}")
        if sp.selector not in ("sketch", "exact"):
            raise RequestError(f"sparse_selector must be sketch or exact, got {sp.selector!r}")
        if sp.prefill_selection not in ("auto", "dense", "chunk"):
            raise RequestError(f"sparse_prefill_selection must be auto, dense or chunk, got {sp.prefill_selection!r}")
        sp = cfg.sparse = dataclasses.replace(sp, prefill_selection=resolved_prefill_selection(sp))
        if sp.prefill_selection == "chunk" and not sp.shared_selection:
            raise RequestError("sparse_prefill_selection=chunk needs sparse_shared_selection=True (one pick set per chunk)")
        if sp.verify_selection not in ("per_row", "shared"):
            raise RequestError(f"sparse_verify_selection must be per_row or shared, got {sp.verify_selection!r}")
        if cfg.mtp_attention_window < 0:
            raise RequestError(f"mtp_attention_window must be >= 0 (0: the drafter attends densely), got "
                               f"{cfg.mtp_attention_window}")
        if sp.score_kernel not in sketch_ops.KERNELS:
            raise RequestError(f"sparse_score_kernel must be one of {', '.join(sketch_ops.KERNELS)}, got {sp.score_kernel!r}")
        if sp.softmax_lse_stride < 0:
            raise RequestError(f"sparse_softmax_lse_stride must be >= 0 (0: exact normalizers), got {sp.softmax_lse_stride}")
        if sp.softmax_lse_min_samples < 1:
            raise RequestError(f"sparse_softmax_lse_min_samples must be >= 1, got {sp.softmax_lse_min_samples}")
        if sp.softmax_lse_stride > 1 and sp.head_combine == "softmax" and sp.score_kernel not in ("auto", "dot"):
            raise RequestError(f"sparse_softmax_lse_stride needs sparse_score_kernel auto or dot, got {sp.score_kernel!r}")
        if sp.tier_kernel not in ("torch", "triton"):
            raise RequestError(f"sparse_tier_kernel must be torch or triton, got {sp.tier_kernel!r}")
        if sp.read_groups < 1:
            raise RequestError(f"sparse_read_groups must be >= 1, got {sp.read_groups}")
        if sp.miss_read not in ("fields", "rows"):
            raise RequestError(f"sparse_miss_read must be fields or rows, got {sp.miss_read!r}")
        if sp.selector == "exact" and sp.host_tier:
            raise RequestError("sparse_selector=exact scores the full keys in GPU memory: not with sparse_host_tier")
        if sp.host_tier and not sp.shared_selection and not qsa:
            raise RequestError("sparse_host_tier needs sparse_shared_selection=True (one pick per token for all KV heads)")
        if qsa and (sp.sparse or cfg.num_speculative_tokens):
            raise RequestError("qwen4_exp layers select with their own QSA indexer: sketch sparse decode (sparse=True) "
                               "and speculative decoding are not supported with them; the host tier needs only "
                               "sparse_host_tier=True")
        if sp.sparse:
            self._install_sparse_attention()
        if qsa and sp.host_tier:
            self._install_qsa_tier()
        if cfg.tensor_parallel_size > 1:  # after the sparse install, which checks the basis against the whole model
            import torch.distributed as dist
            from sketchkv.parallel.tensor_parallel import shard_model
            self.model_cfg = model_cfg = shard_model(model, model_cfg, dist.get_rank(), dist.get_world_size())
        # MTP layers get caches only when speculative decoding is on.
        self.attn_layers = [m for n, m in model.named_modules() if isinstance(m, Attention) and not n.startswith("mtp.")]
        if cfg.prefill_attention not in prefill_attention.BACKENDS:
            raise RequestError(f"prefill_attention must be one of {', '.join(prefill_attention.BACKENDS)}, "
                               f"got {cfg.prefill_attention!r}")
        for m in model.modules():
            if isinstance(m, Attention):
                m.prefill_backend = cfg.prefill_attention
        self.sparse_layers = [m for m in self.attn_layers if isinstance(m, SparseAttention)]
        self.tier_layers = [m for m in self.attn_layers if isinstance(m, TieredKV)]
        odd = [m.rank for m in self.sparse_layers if m.rank % 32]
        if sp.softmax_lse_stride > 1 and sp.head_combine == "softmax" and self.device.type == "cuda" and odd:
            raise RequestError(f"sparse_softmax_lse_stride needs a sketch rank that is a multiple of 32 (the dot kernel), "
                               f"got rank {odd[0]}")
        sketch_tier = bool(self.tier_layers) and all(isinstance(m, SparseAttention) for m in self.tier_layers)
        self.residual_keys = resolved_host_residual_keys(cfg.sparse, sketch_tier)
        if self.residual_keys and not sketch_tier:
            raise RequestError("sparse_host_residual_keys needs the host tier (sparse_host_tier) with the key sketch "
                               "selector (a qwen4_exp model's QSA indexer keeps no sketch to rebuild keys from)")
        self.qsa_layers = [m for m in self.attn_layers if isinstance(m, IndexedAttention)]
        for m in self.qsa_layers:
            if self.block_size % m.ratio:
                raise RequestError(f"block_size {self.block_size} must be a multiple of indexer_compress_ratio "
                                   f"{m.ratio} (QSA index blocks may not straddle KV blocks)")
        # other per-sequence state (qwen4_exp PLE): allocate_state / reset_state / slot_state
        self.state_layers = [m for m in model.modules() if hasattr(m, "allocate_state")]
        self.tier = None  # HostTier (sketchkv.kv.host_tier), bound with the caches
        self.gdn_layers = [m for m in model.modules() if isinstance(m, GatedDeltaNet)]
        self.num_spec = cfg.num_speculative_tokens
        self.phase = PhaseTimer(device)   # the engine's, once it owns this runner
        self.spec = None  # speculative decoding (engine/speculative.py)
        self.verify_graph_bucket: tuple[int, int] | None = None   # (batch bucket, blocks per row) of the last step's
        # verification graph; None: it verified eagerly
        self.mtp_attn_layers = []
        if self.num_spec:
            from sketchkv.engine.speculative import Speculator
            if cfg.mtp_attention_window > 0:
                self._window_mtp_attention(model, cfg.mtp_attention_window)
            self.mtp_attn_layers = Speculator.mtp_layers(model)
            self.spec = Speculator(self, self.num_spec)
        # the windowed drafter keeps its K/V in a ring per state slot, the dense one in the paged blocks
        self.mtp_ring_layers = [m for m in self.mtp_attn_layers if isinstance(m, WindowedAttention)]
        self.mtp_paged_layers = [m for m in self.mtp_attn_layers if not isinstance(m, WindowedAttention)]
        # (sparse family, batch bucket, blocks per sequence or row): decode and verification graphs
        self.graphs: dict[tuple[bool, int, int], torch.cuda.CUDAGraph] = {}
        self.replay_events: list | None = None   # a list: each decode graph replay's CUDA events appended (bench step)
        self.verify_graphs: dict[tuple[bool, int, int], torch.cuda.CUDAGraph] = {}   # (sparse, batch, blocks per row)
        self.replay_graphs: dict[int, torch.cuda.CUDAGraph] = {}   # the commit's GDN replay, per bucket
        self.state_cache = StateCache(int(cfg.cache.state_cache_gb * 2**30), pin=device.type == "cuda") \
            if self.gdn_layers and cfg.cache.enable_prefix_caching else None
        self.num_state_slots = cfg.scheduler.max_num_seqs + 1  # last slot: scratch for graph padding
        self.scratch_slot = self.num_state_slots - 1
        self._allocate_states()
        if self.tier_layers:
            self.num_blocks, pool_rows = self._tier_sizes()
            self._allocate_kv(self.num_blocks, pool_rows)
        else:
            # every rank sizes its own device; the block manager on rank 0 must fit them all
            self.num_blocks = cfg.cache.num_kv_blocks or agree_min(self._blocks_from_budget())
            self._allocate_kv(self.num_blocks)
        # (MoE blocks route decode-sized batches through every expert with fixed shapes: capturable)
        if device.type == "cuda" and not cfg.enforce_eager:
            try:
                self._capture_graphs()
            except RuntimeError as e:  # a decode path that cannot be captured: eager, and say so
                self.graphs.clear()
                self.verify_graphs.clear()
                self.replay_graphs.clear()
                torch.cuda.synchronize(device)
                logger.warning("CUDA graph capture failed, decoding eagerly (enforce_eager=True hides this): %s",
                               str(e).splitlines()[0] if str(e) else type(e).__name__)

    def _install_sparse_attention(self) -> None:
        """Swap each full-attention layer's dense core for the sparse one, with its slice of the basis."""
        from sketchkv.kv.basis import KeyBasis, default_basis_path, model_fingerprint, random_basis
        c, sp = self.model_cfg, self.cfg.sparse
        if self.cfg.model.startswith("random:"):
            basis = random_basis(c, c.head_dim // 4)
        else:
            path = sp.basis or default_basis_path(self.cfg.model)
            basis = KeyBasis.load(path, c, model_fingerprint(c, self.model))
        for j, i in enumerate(c.full_attention_layers):
            owner = self.model.model.layers[i].self_attn
            owner.attn = SparseAttention(owner.attn, sp, basis.bases[j].to(self.device),
                                         basis.means[j].to(self.device), self.dense_threshold)
            if sp.host_tier:
                owner.attn = TieredAttention(owner.attn, j)
            owner.attn.layer = j   # its index among the full-attention layers (the tier's layer, dense_layers)
            if sp.verify_selection == "shared":  # verification rows read the first row's picks + their own tokens
                owner.attn.verify_extra = self.cfg.num_speculative_tokens

    def _window_mtp_attention(self, model, window: int) -> None:
        for owner in model.mtp.modules():
            if isinstance(getattr(owner, "attn", None), Attention):
                owner.attn = WindowedAttention(owner.attn, MTP_WINDOW_SINKS, window, self.num_spec, self.block_size)

    def _install_qsa_tier(self) -> None:
        """qwen4_exp: each indexed_attention layer keeps its QSA indexer as the selector and moves its
        main K/V to the host tier (tier layers numbered in model order)."""
        owners = [m for m in self.model.modules() if isinstance(getattr(m, "attn", None), IndexedAttention)]
        for j, owner in enumerate(owners):
            owner.attn = TieredIndexedAttention(owner.attn, j)

    # ---- memory -------------------------------------------------------------------------------
    @property
    def kv_bytes_per_block(self) -> int:
        """GPU bytes per block of tokens: K + V rows (layers not in the host tier), plus the int4
        sketch and its scale for sparse layers and the hot buffer's slot map for tiered ones (4 B per slot and
        layer, + 4 B per slot of the admit's claim scratch)."""
        c = self.model_cfg
        layers = len(self.attn_layers) - len(self.tier_layers) + len(self.mtp_paged_layers)  # dense MTP KV: same blocks
        kv = 2 * layers * self.block_size * c.num_kv_heads * c.head_dim * self.dtype.itemsize
        slot_map = 4 * (len(self.tier_layers) + 1) * self.block_size if self.tier_layers else 0
        return kv + self.selector_bytes_per_block + slot_map

    @property
    def qsa_index_bytes_per_token(self) -> int:
        """GPU bytes per token of one QSA layer's block keys (D x dtype / compress ratio: 64 B at D = 128,
        c = 4, bf16), on top of its K/V rows; the tail of raw index keys is per-sequence state."""
        m = self.qsa_layers[0] if self.qsa_layers else None
        return m.index_dim * self.dtype.itemsize // m.ratio if m else 0

    def qsa_memory(self) -> dict:
        """Measured from the allocated buffers, {} without QSA layers. Per cached token and QSA layer: GPU
        bytes of the block keys, of main K/V kept on the GPU (0 with the host tier), of the hot buffer's
        slot map, and their sum (`gpu_bytes_per_token`: the seed's 64 + 2 = 66 B at D = 128, c = 4, bf16,
        with the tier). Per sequence and layer (state): the raw index tail and, with the tier, the resident
        rows (sinks + recent ring). The hot pool is a cache sized by sparse_hot_fraction, reported apart."""
        if not self.qsa_layers:
            return {}
        m, tokens = self.qsa_layers[0], self.num_blocks * self.block_size
        index = (m.index_keys.numel() - m.index_keys.shape[-1]) * m.index_keys.element_size() / tokens  # minus dump row
        kv = (m.k_cache.numel() + m.v_cache.numel()) * m.k_cache.element_size() / tokens
        tail = m.index_tail[0].numel() * m.index_tail.element_size()
        out = {"index_bytes_per_token": index, "kv_bytes_per_token": kv, "slot_map_bytes_per_token": 0.0,
               "tail_state_bytes_per_seq": tail, "resident_state_bytes_per_seq": 0, "hot_pool_bytes": 0,
               "layers": len(self.qsa_layers)}
        if self.tier is not None:
            hot, t = self.tier.hot, self.tier
            out["slot_map_bytes_per_token"] = (hot.map.shape[1] - 1) * hot.map.element_size() / tokens  # minus dump
            out["resident_state_bytes_per_seq"] = t.width * t.resident_row_bytes // t.L
            out["hot_pool_bytes"] = hot.P * hot.row_bytes // t.L
        out["gpu_bytes_per_token"] = index + kv + out["slot_map_bytes_per_token"]
        return out

    @property
    def selector_bytes_per_block(self) -> int:
        """GPU bytes per block of the selectors' state: int4 sketches (sparse layers), QSA block keys."""
        return self.sketch_bytes_per_block + len(self.qsa_layers) * self.qsa_index_bytes_per_token * self.block_size

    @property
    def sketch_bytes_per_block(self) -> int:
        return sum(self.block_size * self.model_cfg.num_kv_heads * (m.rank // 2 + 2) for m in self.sparse_layers)

    @property
    def state_bytes_per_seq(self) -> int:
        total = 0
        for m in self.gdn_layers:
            conv, rec = m.state_shapes()
            total += math.prod(conv) * self.dtype.itemsize + math.prod(rec) * 4
        total += sum(m.state_bytes(self.dtype) for m in self.state_layers)
        total += sum(m.ratio * m.index_dim * self.dtype.itemsize for m in self.qsa_layers)
        total += sum(m.ring_bytes(self.dtype) for m in self.mtp_ring_layers)
        return total

    def _allocate_states(self) -> None:
        for m in self.state_layers:
            m.allocate_state(self.num_state_slots, self.dtype, self.device)
        for m in self.mtp_ring_layers:
            m.allocate_ring(self.num_state_slots, self.dtype, self.device)
        for m in self.qsa_layers:
            m.index_tail = torch.zeros(self.num_state_slots, m.ratio, m.index_dim, dtype=self.dtype, device=self.device)
        for m in self.gdn_layers:
            conv, rec = m.state_shapes()
            m.conv_state = torch.zeros(self.num_state_slots, *conv, dtype=self.dtype, device=self.device)
            m.ssm_state = torch.zeros(self.num_state_slots, *rec, dtype=torch.float32, device=self.device)
            if self.num_spec:  # a verification step's inputs, replayed up to the accepted position
                m.allocate_verify(max(VERIFY_GRAPH_MAX_ROWS, self.num_spec + 1), self.dtype, self.device)

    def _allocate_kv(self, num_blocks: int, pool_rows: int = 0) -> None:
        c = self.model_cfg
        for m in self.attn_layers:
            shape = (0 if m in self.tier_layers else num_blocks, self.block_size, c.num_kv_heads, c.head_dim)
            m.k_cache = torch.empty(shape, dtype=self.dtype, device=self.device)
            m.v_cache = torch.empty(shape, dtype=self.dtype, device=self.device)
        for m in self.mtp_paged_layers:  # zeros: blocks cached without a drafter pass must not hold NaNs
            shape = (num_blocks, self.block_size, c.num_kv_heads, c.head_dim)
            m.k_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
            m.v_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        if self.tier_layers:
            from sketchkv.kv.host_tier import HostTier
            sp = self.cfg.sparse
            self.tier = None  # free the old one first
            self.tier = HostTier(len(self.tier_layers), num_blocks, self.block_size, c.num_kv_heads, c.head_dim,
                                 fmt=sp.host_format, sinks=sp.sink_tokens, recent=sp.recent_tokens,
                                 hot_fraction=sp.hot_fraction, num_state_slots=self.num_state_slots,
                                 max_model_len=self.max_model_len, pool_rows=pool_rows, dtype=self.dtype,
                                 device=self.device, selector_bytes_per_block=self.selector_bytes_per_block,
                                 kernel=sp.tier_kernel, ring_extra=self.cfg.num_speculative_tokens,
                                 admit_stream=sp.admit_stream, read_groups=sp.read_groups,
                                 miss_read=sp.miss_read)
            for m in self.tier_layers:
                m.tier = self.tier
            if self.residual_keys:   # the sketch layers rebuild their part of each key (checked in __init__)
                self.tier.key_base = [m.with_sketch_base for m in sorted(self.tier_layers, key=lambda m: m.layer)]
        for m in self.qsa_layers:  # block keys, paged like the KV; one extra (dump) row
            m.block_size = self.block_size
            m.index_keys = torch.zeros(num_blocks * (self.block_size // m.ratio) + 1, m.index_dim, dtype=self.dtype,
                                       device=self.device)
        for m in self.sparse_layers:
            m.sketch = torch.zeros(num_blocks, self.block_size, c.num_kv_heads, m.rank // 2, dtype=torch.uint8,
                                   device=self.device)
            m.sketch_scale = torch.zeros(num_blocks, self.block_size, c.num_kv_heads, dtype=torch.float16,
                                         device=self.device)

    def _tier_sizes(self) -> tuple[int, int]:
        """(host blocks, hot-pool rows) from the tier's budgets (sketchkv.kv.host_tier)."""
        from sketchkv.kv.host_store import HostKVStore
        from sketchkv.kv.host_tier import HostTier, default_host_budget, hot_row_bytes
        from sketchkv.kv.hot_buffer import MAX_INT16_ROWS
        c, sp, sc = self.model_cfg, self.cfg.sparse, self.cfg.scheduler
        L = len(self.tier_layers)
        host_per_block = HostKVStore.bytes_per_token(L, c.num_kv_heads, c.head_dim, sp.host_format) * self.block_size
        host_budget = int(sp.host_budget_gb * 2**30) if sp.host_budget_gb is not None else default_host_budget()
        want = self.max_blocks_per_seq * sc.max_num_seqs + 1
        num_blocks = self.cfg.cache.num_kv_blocks or min(want, host_budget // host_per_block)
        if num_blocks < 2:
            raise CapacityError(f"host tier budget {host_budget / 2**30:.3f} GiB holds no KV block "
                                f"({host_per_block} B per block of {self.block_size} tokens; raise sparse_host_budget_gb)")
        row = hot_row_bytes(L, c.num_kv_heads, c.head_dim, sp.host_format)
        ring = sp.recent_tokens + self.cfg.num_speculative_tokens  # HostTier.ring: verification rows read back
        fixed = HostTier.fixed_gpu_bytes(L, num_blocks, self.block_size, c.num_kv_heads, c.head_dim, self.dtype,
                                         sp.sink_tokens, ring, self.num_state_slots) \
            + num_blocks * self.selector_bytes_per_block
        budget = None
        if sp.gpu_budget_gb is not None:
            budget = int(sp.gpu_budget_gb * 2**30)
        elif self.device.type == "cuda":
            budget = self._free_gpu_bytes() - self._decode_scratch_bytes()
            if sp.host_budget_gb is None and not self.cfg.cache.num_kv_blocks:
                # both budgets defaulted: let the per-block GPU part (sketches, slot map) take at most
                # 3/4 of the GPU budget, so a large host RAM does not crowd out the hot pool
                res = fixed - num_blocks * self.kv_bytes_per_block
                cap = int(0.75 * (budget - res)) // self.kv_bytes_per_block
                if 2 <= cap < num_blocks:
                    num_blocks, fixed = cap, res + cap * self.kv_bytes_per_block
        per_seq = max(64, math.ceil(sp.hot_fraction * self.max_model_len))  # the largest partition
        if budget is None:  # CPU: enough for every sequence at full length
            budget = fixed + sc.max_num_seqs * per_seq * row
        # `fixed` charges the hot slot map at 4 B per slot; a pool of at most MAX_INT16_ROWS rows gets the
        # int16 map (2 B) and may use the difference
        int16_saving = 2 * L * (num_blocks * self.block_size + 1)
        pool = (budget - fixed + int16_saving) // row
        if pool > MAX_INT16_ROWS:
            pool = max(MAX_INT16_ROWS, (budget - fixed) // row)
        pool = min(pool, sc.max_num_seqs * per_seq)  # more rows could never be used
        if pool < 1:
            raise CapacityError(f"GPU budget {budget / 2**30:.3f} GiB is below the host tier's fixed part "
                                f"{fixed / 2**30:.3f} GiB (sketches of {num_blocks} host blocks, sinks + recent rows "
                                f"of {self.num_state_slots} sequences): raise sparse_gpu_budget_gb or lower "
                                f"sparse_host_budget_gb / max_num_seqs")
        return num_blocks, int(pool)

    def _decode_scratch_bytes(self) -> int:
        """Transient GPU bytes of a tiered decode step at full batch (compact K/V scratch and its
        temporaries: ~3 copies of [B, S + k + R, Hkv, D] for K and V)."""
        sp, c = self.cfg.sparse, self.model_cfg
        n = sp.sink_tokens + sp.top_k + sp.recent_tokens
        if self.qsa_layers:  # QSA: at most budget + c - 1 positions per step
            n = self.qsa_layers[0].budget + self.qsa_layers[0].ratio - 1
        rows = self.cfg.scheduler.max_num_seqs
        if self.num_spec:  # verification steps: every row of a sequence gathers its own scratch
            rows = max(rows, min(rows * (self.num_spec + 1), VERIFY_GRAPH_MAX_ROWS))
        return 6 * rows * n * c.num_kv_heads * c.head_dim * self.dtype.itemsize

    def _blocks_from_budget(self) -> int:
        if not self.attn_layers:
            return 2
        if self.device.type != "cuda":
            budget = int(self.cfg.cache.cpu_kv_cache_gb * 2**30)
            want = self.max_blocks_per_seq * self.cfg.scheduler.max_num_seqs + 1
            return max(2, min(want, budget // self.kv_bytes_per_block))
        free = self._free_gpu_bytes()
        blocks = int(free // self.kv_bytes_per_block)
        if blocks < 2:
            raise CapacityError(f"no GPU memory left for the KV cache ({free / 2**30:.1f} GiB free after weights and "
                                f"activations at gpu_memory_utilization={self.cfg.cache.gpu_memory_utilization}; "
                                f"{self.memory_report})")
        return blocks

    def _free_gpu_bytes(self) -> int:
        """GPU bytes left for caches: total x utilization - (weights + the activation peak of a
        full-budget prefill, measured with a small temporary cache), at most what is free now."""
        n_tok = min(self.cfg.scheduler.max_num_batched_tokens, self.max_model_len)
        warm_blocks = math.ceil(n_tok / self.block_size) + 1
        self._allocate_kv(warm_blocks)
        torch.cuda.reset_peak_memory_stats(self.device)
        seq = Sequence([0] * n_tok, params=None)
        seq.block_table = list(range(1, warm_blocks))
        seq.state_slot = self.scratch_slot
        self.run([(seq, n_tok)], sample_now=False)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        warm_bytes = warm_blocks * self.kv_bytes_per_block + (self.tier.gpu_bytes if self.tier else 0)
        self._allocate_kv(0)
        self.tier = None
        torch.cuda.empty_cache()
        free_now, total = torch.cuda.mem_get_info(self.device)
        if self.cfg.cache.gpu_memory_gb is not None:   # the card this engine was given (cap_gpu_memory)
            total = min(total, int(self.cfg.cache.gpu_memory_gb * 2**30))
        held = torch.cuda.memory_allocated(self.device)
        activations = peak - warm_bytes - held
        share = total * self.cfg.cache.gpu_memory_utilization - (peak - warm_bytes)
        # Our share of the card, but never more than is free now: another process (or another engine in
        # this one) may hold part of it. 1 GiB stays free for CUDA graphs and the allocator's slack.
        left = min(free_now, total - held) - activations - 2**30
        G = 2**30
        self.memory_report = (f"card {total / G:.1f} GiB, {free_now / G:.1f} free; this engine holds {held / G:.2f} "
                              f"(weights), its warm-up prefill of {n_tok} tokens peaked at {activations / G:.2f} "
                              f"above that: share {share / G:.1f}, free after activations {left / G:.1f}")
        return int(min(share, left))

    # ---- batch -> tensors ----------------------------------------------------------------------
    def _context(self, batch: list[tuple[Sequence, int]]):
        ids, pos, slots = [], [], []
        for seq, n in batch:
            start = seq.num_cached
            ids += seq.step_token_ids(n)
            pos += range(start, start + n)
            for p in range(start, start + n):
                slots.append(seq.block_table[p // self.block_size] * self.block_size + p % self.block_size)
        qlens = [n for _, n in batch]
        cached = [seq.num_cached for seq, _ in batch]
        tables = block_tables([seq for seq, _ in batch])
        cu = [0]
        for n in qlens:
            cu.append(cu[-1] + n)
        t = lambda x, dt: torch.tensor(x, dtype=dt, device=self.device)
        ctx = Context(
            cu_seqlens_q=t(cu, torch.int32), seq_lens=t([c + n for c, n in zip(cached, qlens)], torch.int32),
            slot_mapping=t(slots, torch.int64), block_tables=tables.to(self.device),
            state_slots=t([seq.state_slot for seq, _ in batch], torch.int64),
            query_lens=qlens, context_lens=cached, is_decode=all(n == 1 and c > 0 for n, c in zip(qlens, cached)),
            max_seq_len=max(c + n for c, n in zip(cached, qlens)))
        ctx.sparse = self._sparse_step(ctx.max_seq_len)
        if self.tier is not None:
            rows = [self.tier.resident_row(seq.state_slot, p, seq.num_cached + n)
                    for seq, n in batch for p in range(seq.num_cached, seq.num_cached + n)]
            ctx.resident_rows = t(rows, torch.int64)
            ctx.hot_pids = t([seq.tier_pid if seq.tier_pid >= 0 else self.tier.pad_pid for seq, _ in batch],
                             torch.int64)
        drafts = [seq.num_drafts(n) for seq, n in batch]
        ctx.num_drafts = drafts if any(drafts) else None
        dec = [b for b in range(len(batch)) if ctx.decodes(b)]
        if dec and not ctx.is_decode:  # every row of a decoding sequence (1 + drafts) is a decode row
            ctx.decode_rows = t([cu[b] + i for b in dec for i in range(qlens[b])], torch.int64)
            ctx.decode_seqs = t([b for b in dec for _ in range(qlens[b])], torch.int64)
            ctx.decode_max_len = max(cached[b] + qlens[b] for b in dec)
            if ctx.num_drafts:
                ctx.decode_lens = t([cached[b] + i + 1 for b in dec for i in range(qlens[b])], torch.int32)
                firsts = list(itertools.accumulate([0] + [qlens[b] for b in dec[:-1]]))   # in decode-row order
                ctx.verify_leaders = t(firsts, torch.int64)
                ctx.verify_group = t([i for i, b in enumerate(dec) for _ in range(qlens[b])], torch.int64)
                ctx.verify_lasts = t([f + qlens[b] - 1 for f, b in zip(firsts, dec)], torch.int64)
        if ctx.num_drafts:
            from sketchkv.engine.speculative import verify_rows
            ctx.verify = verify_rows(qlens, cu, [seq.state_slot for seq, _ in batch],
                                     [ctx.decodes(b) for b in range(len(batch))], self.device)
        return t(ids, torch.int64), t(pos, torch.int64), ctx

    def _sparse_step(self, max_seq_len: int) -> bool:
        """Sparse layers decode sparsely this step; with the host tier every decode takes the tier path (it is
        exact when k >= context)."""
        return bool(self.sparse_layers) and (self.tier is not None or max_seq_len > self.dense_threshold)

    def _zero_fresh_slots(self, batch) -> None:
        """A new sequence starts from zero state, or from a prefix-cache snapshot."""
        fresh = [seq.state_slot for seq, _ in batch if seq.num_cached == 0]
        if fresh:
            idx = torch.tensor(fresh, device=self.device)
            for m in self.gdn_layers:
                m.conv_state.index_fill_(0, idx, 0)
                m.ssm_state.index_fill_(0, idx, 0)
            for m in self.state_layers:
                m.reset_state(idx)
        for seq, _ in batch:
            if seq.restore_hash is not None:
                self.state_cache.restore(seq.restore_hash, self.slot_states(seq.state_slot))
                seq.restore_hash = None
        if self.tier is not None:
            self.tier.prepare(batch)

    def save_state(self, block_hash: int, slot: int) -> None:
        """Snapshot one slot's GDN state into the prefix cache's state store (each rank saves its heads' share)."""
        self.state_cache.save(block_hash, self.slot_states(slot))

    def slot_states(self, slot: int) -> list[torch.Tensor]:
        """Views of one slot's state in every GDN layer (conv, recurrent, conv, ...), then the other
        per-slot state (qwen4_exp PLE, the windowed MTP drafter's K/V ring)."""
        return [t for m in self.gdn_layers for t in (m.conv_state[slot], m.ssm_state[slot])] + self.extra_slot_states(slot)

    def extra_slot_states(self, slot: int) -> list[torch.Tensor]:
        return [t for m in self.state_layers + self.mtp_ring_layers for t in m.slot_state(slot)]

    # ---- forward -------------------------------------------------------------------------------
    @torch.inference_mode()
    def run(self, batch: list[tuple[Sequence, int]], sample_now: bool = True) -> SampleOutput | torch.Tensor:
        """One model step. Returns samples for the sequences whose last token was computed
        (decodes, and prefills that reached the end of their tokens)."""
        hidden, ctx = self._forward(batch, graphs=True)
        if self.spec is not None and sample_now:  # -> VerifyOutput (accepted drafts + one token)
            with self.phase("spec.verify"):
                return self.spec.verify(batch, hidden)
        last = [i for i, (seq, n) in enumerate(batch) if seq.num_cached + n == len(seq)]
        if not ctx.is_decode:  # only the final row of each sequence that completed its tokens
            ends = list(itertools.accumulate(ctx.query_lens))
            hidden = hidden[torch.tensor([ends[i] - 1 for i in last], dtype=torch.long, device=self.device)]
        logits = self.model.compute_logits(hidden)
        if not sample_now:
            return logits
        seqs = [batch[i][0] for i in last]
        return sample(logits, [s.params for s in seqs], [s.generator for s in seqs])

    @torch.inference_mode()
    def logits_for(self, batch: list[tuple[Sequence, int]]) -> torch.Tensor:
        """Logits at every new token of the step (teacher-forced evaluation), [T, vocab]."""
        return self.model.compute_logits(self._forward(batch, graphs=False)[0])

    def _forward(self, batch, graphs: bool) -> tuple[torch.Tensor, Context]:
        """Hidden states of the step's new tokens; pure decode steps replay a CUDA graph."""
        self.verify_graph_bucket = None   # set when this step verifies in a graph (MTPDrafter.catch_up reads it)
        with self.phase("runner.prepare"):
            self._zero_fresh_slots(batch)
            key = self._graph_key(batch) if graphs else None
            vkey = self._verify_key(batch) if graphs and key is None else None
            if key is not None:   # graph steps' inputs go straight to the graph's static buffers
                ctx = self._stage_decode(batch, key)
            elif vkey is not None:
                ctx = self._stage_verify(batch, vkey)
            else:
                input_ids, positions, ctx = self._context(batch)
        if key is not None:
            return self._replay(ctx, key), ctx
        if vkey is not None:
            return self._replay_verify(ctx, vkey), ctx
        set_context(ctx)
        try:
            return self._model(input_ids, positions), ctx
        finally:
            set_context(None)

    def _model(self, input_ids, positions) -> torch.Tensor:
        """The model's forward; with the host tier the step ends by joining its admit stream (also in a capture)."""
        hidden = self.model(input_ids, positions)
        if self.tier is not None:
            self.tier.join()
        return hidden

    # ---- CUDA graphs for decode ----------------------------------------------------------------
    def _graph_key(self, batch) -> tuple[bool, int, int] | None:
        """For a pure decode step (one new token per sequence, after cached ones), the smallest captured batch
        bucket and length bucket that hold it; else None."""
        if not self.graphs or not all(n == 1 and seq.num_cached > 0 for seq, n in batch):
            return None
        max_len = max(seq.num_cached + 1 for seq, _ in batch)
        need = self._blocks_needed(batch, max_len)
        sparse = self._sparse_step(max_len)
        fits = [k for k in self.graphs if k[0] == sparse and k[1] >= len(batch) and k[2] >= need]
        return min(fits, key=lambda k: (k[1], k[2]), default=None)

    def _blocks_needed(self, batch, max_len: int) -> int:
        """Blocks per row a graph must hold for this step: the widest table, or the longest row's blocks."""
        return max(max(len(seq.block_table) for seq, _ in batch), -(-max_len // self.block_size))

    def _length_buckets(self) -> list[int]:
        """Blocks per sequence of the decode graphs. Selection (sketch scores, top-k; QSA block scores) in a
        graph spans the whole block table, so one graph for max_model_len makes a 32K step cost what a 256K
        step costs: sparse and QSA models get graphs for 16K, 32K, 64K, ... up to max_model_len."""
        full = self.max_blocks_per_seq
        if not (self.sparse_layers or self.qsa_layers):
            return [full]
        out, n = [], FIRST_LENGTH_BUCKET
        while -(-n // self.block_size) < full:
            out.append(-(-n // self.block_size))
            n *= 2
        return out + [full]

    def _capture_graphs(self) -> None:
        max_bs = self.cfg.scheduler.max_num_seqs
        sizes = sorted({b for b in [1, 2, 4, 8] + list(range(16, max_bs + 1, 16)) if b <= max_bs} | {max_bs})
        dev = self.device
        # The graphs' integer inputs are views of device buffers that _stage_decode fills from host twins (staged)
        # in two copies: int64 rows (token ids, positions, KV slots, state slots; with the tier resident rows
        # and hot partitions), and per length bucket nb an int32 [seq_lens | tables [max_bs, nb]] (_int32_buffers).
        # A padded row attends to one token of the scratch block (slot 0) and steps the scratch state slot; with
        # the tier its resident row is the dump row and its hot partition an empty one.
        self.h_pad = np.array([0, 0, 0, self.scratch_slot] + ([self.tier.dump_row, self.tier.pad_pid]
                                                              if self.tier is not None else []), dtype=np.int64)
        self.h_int64, self.g_int64 = staged((len(self.h_pad), max_bs), torch.int64, dev, self.h_pad[:, None])
        self.g_ids, self.g_pos, self.g_slot_mapping, self.g_state_slots = self.g_int64[:4]
        if self.tier is not None:
            self.g_resident_rows, self.g_hot_pids = self.g_int64[4:]
        self.h_int32, self.g_int32, self.g_seq_lens, self.g_tables = self._int32_buffers(max_bs)
        self.h_copied = copy_event(dev)   # the last copy out of the host twins
        self.g_out = torch.zeros(max_bs, self.model_cfg.hidden_size, dtype=self.dtype, device=dev)
        self.g_cu = torch.arange(max_bs + 1, dtype=torch.int32, device=dev)
        pool = None
        # the values ctx.sparse takes at decode (see _context): dense and sparse graphs; with the host tier
        # every sketch decode is sparse; QSA layers (no sketch layers) select inside the "dense" family
        families = ([True] if self.tier is not None else [False, True]) if self.sparse_layers else [False]
        shapes = [(f, b, n) for f in families for b in reversed(sizes) for n in reversed(self.g_tables)]
        # 163 s on a fresh H100 for the 27B W4A16 engine (run 129); later starts read Triton's cache
        logger.info("capturing %d decode CUDA graphs (a machine's first start also compiles the kernels)", len(shapes))
        quiet = not logger.isEnabledFor(logging.INFO)
        for sparse, bs, nb in tqdm(shapes, desc="CUDA graphs", unit="graph", disable=quiet):
            ctx = self._graph_context(bs, nb)
            ctx.sparse = sparse
            step = lambda bs=bs: self.g_out[:bs].copy_(self._model(self.g_ids[:bs], self.g_pos[:bs]))
            self.graphs[(sparse, bs, nb)], pool = self._capture(ctx, step, pool)
        if self.spec is not None and not self.state_layers:
            try:
                pool = self._capture_verify_graphs(families, sizes, pool)
            except Exception as e:  # out of memory for the rows, a kernel that cannot compile: verification stays eager
                self.verify_graphs.clear()
                self.replay_graphs.clear()
                _sync(dev)
                logger.warning("CUDA graphs for speculative verification failed, verifying eagerly: %s",
                               str(e).splitlines()[0] if str(e) else type(e).__name__)
        if self.spec is not None:
            try:
                self.spec.drafter.capture_graphs(sizes, pool)
            except Exception as e:
                self.spec.drafter.graphs.clear()
                _sync(dev)
                logger.warning("CUDA graphs for MTP drafting failed, drafting eagerly: %s",
                               str(e).splitlines()[0] if str(e) else type(e).__name__)
        _sync(dev)

    def _capture(self, ctx: Context, step, pool):
        set_context(ctx)
        try:
            with torch.inference_mode():
                for _ in range(2):  # warm up: Triton compiles and autotunes outside the capture
                    step()
                _sync(self.device)
                return capture_graph(step, pool)
        finally:
            set_context(None)

    def _graph_context(self, bs: int, nb: int) -> Context:
        ctx = Context(cu_seqlens_q=self.g_cu[:bs + 1], seq_lens=self.g_seq_lens[nb][:bs],
                      slot_mapping=self.g_slot_mapping[:bs], block_tables=self.g_tables[nb][:bs],
                      state_slots=self.g_state_slots[:bs], query_lens=[1] * bs, context_lens=[1] * bs,
                      is_decode=True, max_seq_len=min(self.max_model_len, nb * self.block_size), graph=True)
        if self.tier is not None:
            ctx.resident_rows, ctx.hot_pids = self.g_resident_rows[:bs], self.g_hot_pids[:bs]
        return ctx

    def _int32_buffers(self, rows: int):
        """Per length bucket nb an int32 device buffer [lens [rows] | block tables [rows, nb]] (lens 1, tables 0:
        what padded rows read), and one host twin for all: a step's lens and its bucket's table rows are one copy
        of a prefix. -> (host twin, {nb: buffer}, {nb: lens}, {nb: tables})"""
        nbs = self._length_buckets()
        host = torch.empty(rows * (max(nbs) + 1), dtype=torch.int32, pin_memory=self.device.type == "cuda")
        bufs = {nb: torch.zeros(rows * (nb + 1), dtype=torch.int32, device=self.device) for nb in nbs}
        return (host, bufs, {nb: buf[:rows].fill_(1) for nb, buf in bufs.items()},
                {nb: buf[rows:].view(rows, nb) for nb, buf in bufs.items()})

    def _stage_rows(self, seqs: list[Sequence], q: int, bucket: int, nb: int, h: np.ndarray, h32: np.ndarray) -> int:
        """A graph step's rows on the host, `q` per sequence (its last token, then its drafts), bucket x q in all:
        into `h` the int64 rows of h_pad's layout (padded rows: h_pad), into `h32` [lens (position + 1; padded
        rows 1) | tables [rows, nb]]. -> the end of the int32 prefix to copy"""
        B, tier, n, rb = self.block_size, self.tier, len(seqs) * q, bucket * q
        rows = [(seq, p) for seq in seqs for p in range(seq.num_cached, seq.num_cached + q)]
        pos = np.array([p for _, p in rows], dtype=np.int64)
        h[0, :n] = [t for seq in seqs for t in seq.step_token_ids(q)]
        h[1, :n] = pos
        h[2, :n] = np.array([seq.block_table[p // B] for seq, p in rows]) * B + pos % B
        h[3, :n] = np.repeat([seq.state_slot for seq in seqs], q)
        if tier is not None:
            h[4, :n] = [tier.resident_row(seq.state_slot, p, seq.num_cached + q) for seq, p in rows]
            h[5, :n] = np.repeat([seq.tier_pid if seq.tier_pid >= 0 else tier.pad_pid for seq in seqs], q)
        h[:len(self.h_pad), n:rb] = self.h_pad[:, None]
        m = h.shape[1]   # h32: [lens [m] | tables [m, nb]]
        h32[:n] = pos + 1
        h32[n:rb] = 1
        write_tables(h32[m:m + rb * nb].reshape(bucket, q, nb), seqs)
        return m + rb * nb

    def _stage_decode(self, batch, key: tuple[bool, int, int]) -> Context:
        """A graph decode step's inputs, written on the host into the host twins of the static buffers (padded rows
        included) and copied in two transfers (graph_inputs.py says why). -> the step's context, over the static
        buffers."""
        seqs, (_, bucket, nb) = [seq for seq, _ in batch], key
        h, h32 = host_views(self.h_copied, self.h_int64, self.h_int32)
        end = self._stage_rows(seqs, 1, bucket, nb, h, h32)
        send([(self.g_int64, self.h_int64), (self.g_int32[nb][:end], self.h_int32[:end])], self.h_copied)
        cached = [seq.num_cached for seq in seqs]
        ctx = self._graph_context(len(seqs), nb)
        ctx.sparse, ctx.context_lens, ctx.max_seq_len = key[0], cached, max(cached) + 1
        return ctx

    def _replay(self, ctx: Context, key: tuple[bool, int, int]) -> torch.Tensor:
        if self.tier is not None:
            self.tier.store.wait()  # host writes of eager steps (side stream) land before the graph reads
        if self.replay_events is None:
            self.graphs[key].replay()
        else:   # the replay's own GPU time, no sync (what a step spends outside it: bench step)
            ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
            ev[0].record()
            self.graphs[key].replay()
            ev[1].record()
            self.replay_events.append(ev)
        return self.g_out[:ctx.num_seqs]

    # ---- CUDA graphs for speculative verification ----------------------------------------------
    # A verification step where every sequence decodes its last token + exactly n drafts (the steady
    # state) runs as a decode graph over bucket x (1 + n) rows: each row is attended as a decode row of
    # its own length (as the eager path does), Gated DeltaNet layers step through a sequence's rows and
    # keep the state after each (`forward_verify`, static row lists), the host tier admits only each
    # sequence's first row's misses. Other verification steps (fewer drafts near max_tokens, prompt
    # chunks beside them) run eagerly. Like the decode graphs, one per length bucket (16K, 32K, ...,
    # max_model_len): per-row selection over max_model_len cost a 128K step twice its scoring and top-k.
    def _capture_verify_graphs(self, families, sizes, pool):
        Q, dev = self.num_spec + 1, self.device
        sizes = [b for b in sizes if b * Q <= max(VERIFY_GRAPH_MAX_ROWS, Q)]
        if not sizes:
            return pool
        R = max(sizes) * Q
        # inputs staged as the decode graphs' (_capture_graphs), one entry per verification row (a sequence's Q rows
        # in turn; lens: each row's position + 1), and a last int64 buffer row: each sequence's state slot (the GDN
        # layers' row lists)
        v_pad = np.append(self.h_pad, self.scratch_slot)
        self.hv_int64, self.v_int64 = staged((len(v_pad), R), torch.int64, dev, v_pad[:, None])
        self.v_ids, self.v_pos, self.v_slot_mapping, self.v_row_slots = self.v_int64[:4]
        if self.tier is not None:
            self.v_resident_rows, self.v_hot_pids = self.v_int64[4:6]
        self.v_seq_slots = self.v_int64[-1, :max(sizes)]
        self.hv_int32, self.v_int32, self.v_lens, self.v_tables = self._int32_buffers(R)
        self.v_copied = copy_event(dev)
        self.v_cu = torch.arange(R + 1, dtype=torch.int32, device=dev)
        self.v_out = torch.zeros(R, self.model_cfg.hidden_size, dtype=self.dtype, device=dev)
        self.v_leaders = torch.arange(max(sizes), device=dev) * Q
        self.v_lasts = self.v_leaders + Q - 1
        self.v_group = torch.arange(R, device=dev) // Q
        self.v_steps = {bs: VerifyRows([(torch.arange(bs, device=dev) * Q + t, self.v_seq_slots[:bs],
                                         torch.arange(bs, device=dev)) for t in range(Q)], regular=Q)
                        for bs in sizes}   # static row lists, alive as long as the graphs
        contexts = {}   # (batch bucket, blocks per row) -> context: the commit's replay and the drafter's catch-up graphs
        for sparse, bs, nb in [(f, b, n) for f in families for b in reversed(sizes) for n in reversed(self.v_tables)]:
            r, ctx = bs * Q, self._verify_context(sparse, bs, nb)
            step = lambda r=r: self.v_out[:r].copy_(self._model(self.v_ids[:r], self.v_pos[:r]))
            self.verify_graphs[(sparse, bs, nb)], pool = self._capture(ctx, step, pool)
            contexts[(bs, nb)] = ctx
        try:
            full = max(self.v_tables)   # the commit's replay reads no context
            pool = self._capture_replay_graphs(sizes, {bs: contexts[(bs, full)] for bs in sizes}, pool)
        except Exception as e:  # the verification graphs stay; the commit replays eagerly
            self.replay_graphs.clear()
            _sync(dev)
            logger.warning("CUDA graphs for the speculative commit's GDN replay failed, replaying eagerly: %s",
                           str(e).splitlines()[0] if str(e) else type(e).__name__)
        try:
            pool = self.spec.drafter.capture_catch_up_graphs(contexts, pool)
        except Exception as e:  # the drafter catches up eagerly
            self.spec.drafter.catch_up_graphs.clear()
            _sync(dev)
            logger.warning("CUDA graphs for the MTP drafter's catch-up failed, catching up eagerly: %s",
                           str(e).splitlines()[0] if str(e) else type(e).__name__)
        return pool

    def _capture_replay_graphs(self, sizes, contexts, pool):
        # The commit's GDN replay (GatedDeltaNet.replay_verified) after a graph verification step: its inputs
        # are in the layers' static buffers; each sequence up to its kept position, one graph per bucket (eagerly
        # the replay's launches were mostly gaps, H200 run 31).
        Q, dev = self.num_spec + 1, self.device
        # staged (padded sequences: row 0, the scratch slot, 0 accepted)
        self.c_pad = np.array([[0], [self.scratch_slot], [0]], dtype=np.int64)
        self.hc_int64, self.c_int64 = staged((3, max(sizes)), torch.int64, dev, self.c_pad)
        self.c_rows0, self.c_slots, self.c_accepted = self.c_int64
        self.c_copied = copy_event(dev)
        for bs in reversed(sizes):
            step = lambda bs=bs: [m.replay_verified(self.c_rows0[:bs], self.c_slots[:bs], self.c_accepted[:bs], Q,
                                                    bs * Q, self.scratch_slot) for m in self.gdn_layers]
            self.replay_graphs[bs], pool = self._capture(contexts[bs], step, pool)   # (the replay reads no context)
        return pool

    def replay_commit(self, rows0: list[int], slots: list[int], accepted: list[int], total_rows: int) -> bool:
        """The commit's GDN replay from a CUDA graph, when the verification step kept its inputs in the static
        buffers (a graph-sized step) and a bucket holds the sequences; False: replay eagerly."""
        bucket = min((b for b in self.replay_graphs if b >= len(slots)), default=None)
        if bucket is None or not self.gdn_layers or total_rows > self.gdn_layers[0].verify_x.shape[0]:
            return False
        n = len(slots)
        h, = host_views(self.c_copied, self.hc_int64)
        h[:, :n] = rows0, slots, accepted
        h[:, n:bucket] = self.c_pad
        send([(self.c_int64, self.hc_int64)], self.c_copied)
        for m in self.gdn_layers:  # what the eager replay resets on the host side
            m._kept, m.snapshots = None, {}
        self.replay_graphs[bucket].replay()
        return True

    def _verify_key(self, batch) -> tuple[bool, int, int] | None:
        """For a steady-state verification step (every sequence: its last token + exactly n drafts, after cached
        ones), the smallest verification graph that holds it: (sparse family, batch bucket, blocks per row);
        else None."""
        Q = self.num_spec + 1
        if not self.verify_graphs or not all(n == Q and seq.num_cached > 0 and seq.num_drafts(n) > 0
                                             for seq, n in batch):
            return None
        max_len = max(seq.num_cached for seq, _ in batch) + Q
        need = self._blocks_needed(batch, max_len)
        fits = [(b, nb) for _, b, nb in self.verify_graphs if b >= len(batch) and nb >= need]
        bucket = min(fits, default=None)
        return None if bucket is None else (self._sparse_step(max_len), *bucket)

    def _verify_context(self, sparse: bool, bs: int, nb: int) -> Context:
        """The verification graph's context: bs x Q rows, each a decode row of its own length."""
        r = bs * (self.num_spec + 1)
        ctx = Context(cu_seqlens_q=self.v_cu[:r + 1], seq_lens=self.v_lens[nb][:r], slot_mapping=self.v_slot_mapping[:r],
                      block_tables=self.v_tables[nb][:r], state_slots=self.v_row_slots[:r], query_lens=[1] * r,
                      context_lens=[1] * r, is_decode=True, max_seq_len=min(self.max_model_len, nb * self.block_size),
                      graph=True, sparse=sparse, verify=self.v_steps[bs], verify_leaders=self.v_leaders[:bs],
                      verify_group=self.v_group[:r], verify_lasts=self.v_lasts[:bs])
        if self.tier is not None:
            ctx.resident_rows, ctx.hot_pids = self.v_resident_rows[:r], self.v_hot_pids[:r]
        return ctx

    def _stage_verify(self, batch, key: tuple[bool, int, int]) -> Context:
        """A verification graph step's inputs, staged as a decode step's (_stage_decode) over bucket x Q rows, and
        each sequence's state slot. (Built by _context and written in piece by piece they were ~30 small device ops,
        13-15 of them pageable copies.) -> the graph's context (its bucket's rows) with the step's per-sequence
        facts (query_lens, context_lens, num_drafts: what run() reads)"""
        (sparse, bucket, nb), seqs, Q = key, [seq for seq, _ in batch], self.num_spec + 1
        h, h32 = host_views(self.v_copied, self.hv_int64, self.hv_int32)
        end = self._stage_rows(seqs, Q, bucket, nb, h, h32)
        h[-1, :len(seqs)] = [seq.state_slot for seq in seqs]
        h[-1, len(seqs):bucket] = self.scratch_slot   # padded sequences step the scratch slot
        send([(self.v_int64, self.hv_int64), (self.v_int32[nb][:end], self.hv_int32[:end])], self.v_copied)
        cached = [seq.num_cached for seq in seqs]
        ctx = self._verify_context(sparse, bucket, nb)
        ctx.query_lens, ctx.context_lens, ctx.is_decode = [Q] * len(seqs), cached, False
        ctx.max_seq_len, ctx.num_drafts = max(cached) + Q, [seq.num_drafts(Q) for seq in seqs]
        return ctx

    def _replay_verify(self, ctx: Context, key: tuple[bool, int, int]) -> torch.Tensor:
        if self.tier is not None:
            self.tier.store.wait()
        self.verify_graphs[key].replay()
        self.verify_graph_bucket = key[1:]
        return self.v_out[:ctx.num_seqs * (self.num_spec + 1)]

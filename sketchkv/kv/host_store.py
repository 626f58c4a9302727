"""Host-RAM tier of the full-attention KV cache: every layer's K/V, quantised, paged like the GPU cache.

Layout: one uint8 buffer [num_layers, num_blocks * block_size, row_bytes]; row `slot` of a layer is
token `offset` of block `block` (slot = block * block_size + offset: the GPU cache's slot_mapping
and block tables address it unchanged, so prefix-cache blocks are shared here too). A row holds the
token's K and V for all KV heads (head records, sketchkv.ops.quant_kv): a pick shared by the KV
heads reads one contiguous row (1088 B at int4 for 4 heads x 256), a per-head pick one 272-B record.

Memory: pinned on CUDA machines so the GPU reads rows in place (zero-copy, UVA). Not through
torch.empty(pin_memory=True): PyTorch's caching host allocator rounds every pinned allocation up to a
power of two (ATen CachingHostAllocator: PowerOf2Ceil before cudaHostAlloc), so a 40 GiB tier would
pin 64 GiB. Instead an ordinary CPU tensor of the exact size is page-locked and mapped with
cudaHostRegister(Portable | Mapped) and unregistered when the store is collected; pin="torch" takes
the allocator path anyway.

Write path: k/v are quantised where they live (the GPU in production) and a kernel stores the packed
rows straight into the pinned buffer at their (scattered) slots: posted PCIe writes, no staging copy,
no host sync, fixed shapes (CUDA-graph capturable). Outside graph capture it runs on a side stream
that first waits for the current one; `wait(layer)` makes the current stream wait for the layer's
writes (GPU-side) and `synchronize()` blocks the host. Without CUDA: a synchronous index copy.
"""
import weakref
from dataclasses import dataclass, fields

import torch

from sketchkv.ops.host_gather import host_copy_rows, host_gather, host_scatter_rows
from sketchkv.ops.quant_kv import FORMATS, head_record_bytes, pack_kv, unpack_kv


@dataclass
class TierStats:
    """Host-tier accounting. hits/misses: picks found in / missing from the hot buffer;
    pcie_read_bytes: host bytes read by the miss path; pcie_write_bytes: rows written to host;
    host_bytes / gpu_bytes: memory held by the tier (buffers, not per-step traffic)."""
    hits: int = 0
    misses: int = 0
    pcie_read_bytes: int = 0
    pcie_write_bytes: int = 0
    host_bytes: int = 0
    gpu_bytes: int = 0

    @property
    def pcie_bytes(self) -> int:
        return self.pcie_read_bytes + self.pcie_write_bytes

    @property
    def hit_rate(self) -> float:
        n = self.hits + self.misses
        return self.hits / n if n else 0.0

    def __add__(self, other: "TierStats") -> "TierStats":
        return TierStats(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))


class TierCounters:
    """Event counters of TierStats kept on the device: adding a device scalar never syncs the host;
    snapshot() does (once)."""
    NAMES = ("hits", "misses", "pcie_read_bytes", "pcie_write_bytes")

    def __init__(self, device):
        self.t = torch.zeros(len(self.NAMES), dtype=torch.int64, device=device)

    def cell(self, name: str) -> torch.Tensor:
        """The counter as an int64 [1] view, for kernels that count as they go."""
        i = self.NAMES.index(name)
        return self.t[i:i + 1]

    def add(self, name: str, value) -> None:
        i = self.NAMES.index(name)
        if isinstance(value, torch.Tensor):
            self.t[i] += value.to(self.t.device, torch.int64)
        else:
            self.t[i] += int(value)

    def snapshot(self) -> dict:
        return dict(zip(self.NAMES, self.t.tolist()))

    def reset(self) -> None:
        self.t.zero_()


def alloc_host(nbytes: int, pin: bool | str) -> torch.Tensor:
    """uint8 [nbytes] host buffer. pin: False (pageable), True (exact-size, cudaHostRegister'd), or
    "torch" (torch.empty(pin_memory=True): rounded up to a power of two)."""
    if not pin:
        return torch.empty(nbytes, dtype=torch.uint8)
    if pin == "torch":
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    buf = torch.empty(nbytes, dtype=torch.uint8)
    if nbytes:
        cudart = torch.cuda.cudart()
        torch.cuda.init()
        err = cudart.cudaHostRegister(buf.data_ptr(), nbytes, 1 | 2)  # cudaHostRegisterPortable | Mapped
        if err != cudart.cudaError.success:
            raise RuntimeError(f"cudaHostRegister of {nbytes / 2**30:.2f} GiB failed: error {int(err)}")
    return buf


def _unregister(ptr: int, buf: torch.Tensor) -> None:  # buf: kept alive until unregistered
    try:
        torch.cuda.cudart().cudaHostUnregister(ptr)
    except Exception:  # interpreter shutdown
        pass


def positions_to_slots(block_tables: torch.Tensor, positions: torch.Tensor, block_size: int,
                       valid: torch.Tensor | None = None) -> torch.Tensor:
    """Token positions [B, ...] -> host/GPU slots (int64, -1 where invalid: position < 0, >= 2^31 - 1
    (the selector's SENTINEL), past the block table, a -1 block, or ~valid). No host sync."""
    B = block_tables.shape[0]
    pos = positions.long()
    flat = pos.reshape(B, -1)
    width = block_tables.shape[1]
    ok = (flat >= 0) & (flat < width * block_size)
    blk = block_tables.long().gather(1, torch.where(ok, flat // block_size, 0))
    ok &= blk >= 0
    slots = torch.where(ok, blk * block_size + flat % block_size, -1).view_as(pos)
    if valid is not None:
        slots = torch.where(valid, slots, -1)
    return slots


class HostKVStore:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 fmt: str = "int4", pin: bool | str | None = None, device: torch.device | str | None = None):
        """device: where counters live and writes come from (default: cuda if available, else cpu).
        pin: default True when CUDA is available (see alloc_host)."""
        if fmt not in FORMATS:
            raise ValueError(f"host KV format must be one of {FORMATS}, got {fmt!r}")
        self.num_layers, self.num_blocks, self.block_size = num_layers, num_blocks, block_size
        self.num_kv_heads, self.head_dim, self.fmt = num_kv_heads, head_dim, fmt
        self.head_bytes = head_record_bytes(fmt, head_dim)
        self.row_bytes = num_kv_heads * self.head_bytes
        self.num_slots = num_blocks * block_size
        cuda = torch.cuda.is_available()
        self.pin = cuda if pin is None else pin
        self.device = torch.device(device) if device is not None else torch.device("cuda" if cuda else "cpu")
        buf = alloc_host(num_layers * self.num_slots * self.row_bytes, self.pin)
        if self.pin is True and buf.numel():
            self._finalizer = weakref.finalize(self, _unregister, buf.data_ptr(), buf)
        self.buf = buf.view(num_layers, self.num_slots, self.row_bytes)
        self.counters = TierCounters(self.device)
        self._stream = None
        self._events: list = [None] * num_layers

    # ---- sizes ------------------------------------------------------------------------------------
    @property
    def total_bytes(self) -> int:
        return self.buf.numel()

    @property
    def bytes_per_block(self) -> int:
        """Host bytes one KV block costs over all layers (per-sequence accounting: blocks x this)."""
        return self.num_layers * self.block_size * self.row_bytes

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, fmt: str) -> int:
        return num_layers * num_kv_heads * head_record_bytes(fmt, head_dim)

    def rows(self, layer: int) -> torch.Tensor:
        """One layer's rows, uint8 [num_slots, row_bytes] (a view: must not outlive the store)."""
        return self.buf[layer]

    # ---- write ------------------------------------------------------------------------------------
    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store tokens' K/V: slots [T] int64 (entries < 0 skipped), k/v [T, Hkv, D] on any device.
        Asynchronous on CUDA with a pinned store (see the module docstring); synchronous otherwise."""
        T = slots.shape[0]
        if T == 0:
            return
        packed = pack_kv(k, v, self.fmt).reshape(T, self.row_bytes)
        dst = self.rows(layer)
        written = self.counters.cell("pcie_write_bytes")   # counted by the scatter itself
        if not packed.is_cuda:
            host_scatter_rows(dst, slots, packed, written)
        elif self.pin:
            slots = slots.to(packed.device).contiguous()
            if torch.cuda.is_current_stream_capturing():
                host_scatter_rows(dst, slots, packed, written)  # in the captured stream: no fork to join
            else:
                cur = torch.cuda.current_stream(packed.device)
                if self._stream is None:
                    self._stream = torch.cuda.Stream(packed.device)
                self._stream.wait_stream(cur)
                with torch.cuda.stream(self._stream):
                    host_scatter_rows(dst, slots, packed, written)
                    ev = self._events[layer] or torch.cuda.Event()
                    ev.record(self._stream)
                self._events[layer] = ev
                packed.record_stream(self._stream)
                slots.record_stream(self._stream)
        else:  # CUDA tensors into a pageable store: stage through the host (syncs)
            host_scatter_rows(dst, slots.cpu(), packed.cpu())
            self.counters.add("pcie_write_bytes", (slots >= 0).sum() * self.row_bytes)

    def wait(self, layer: int | None = None, stream=None) -> None:
        """Make `stream` (default: current) wait for pending writes of `layer` (all if None). GPU-side."""
        evs = self._events if layer is None else [self._events[layer]]
        for ev in evs:
            if ev is not None:
                (stream or torch.cuda.current_stream()).wait_event(ev)

    def synchronize(self) -> None:
        """Block the host until every pending write has landed."""
        for ev in self._events:
            if ev is not None:
                ev.synchronize()

    # ---- read -------------------------------------------------------------------------------------
    def read_rows_ref(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantised K/V fp32 [*slots.shape, Hkv, D] on the CPU (reference; waits for writes)."""
        self.synchronize()
        rec = self.rows(layer)[slots.long().cpu()].view(*slots.shape, self.num_kv_heads, self.head_bytes)
        return unpack_kv(rec, self.fmt, self.head_dim)

    def gather(self, layer: int, rows: torch.Tensor, dst_k: torch.Tensor, dst_v: torch.Tensor,
               dst_rows: torch.Tensor | None = None, *, sort: bool = False, segments: int = 1, count: bool = True,
               **kw):
        """The miss path: host_gather from this layer's rows (after its pending writes, GPU-side),
        counting the bytes read (rows [N]: a full row per pick; [Hkv, N]: a head record). count=False: the
        caller counts them (the tier's decode step: its misses, already counted by the hot lookup)."""
        self._after_writes(layer, dst_k)
        host_gather(self.rows(layer), rows, dst_k, dst_v, self.fmt, dst_rows, sort=sort, segments=segments, **kw)
        if count:
            per_pick = self.head_bytes if rows.dim() == 2 else self.row_bytes
            self.counters.add("pcie_read_bytes", (rows >= 0).sum() * per_pick)
        return dst_k, dst_v

    def _after_writes(self, layer: int, dst: torch.Tensor) -> None:
        """A read into dst (on a GPU) waits for the layer's pending host writes (inside a graph capture they are on
        the captured stream: already ordered)."""
        if dst.is_cuda and self._events[layer] is not None and not torch.cuda.is_current_stream_capturing():
            self.wait(layer)

    def copy_rows(self, layer: int, rows: torch.Tensor, dst: torch.Tensor, **kw) -> torch.Tensor:
        """This layer's rows `rows` [N] (< 0 skipped) as stored into dst uint8 [N, row_bytes] (host_copy_rows, after
        the layer's pending writes); not counted (the tier's decode step counts its misses)."""
        self._after_writes(layer, dst)
        return host_copy_rows(self.rows(layer), rows, dst, **kw)

    def stats(self) -> TierStats:
        """Counters so far (one host sync, after the pending writes: their stream counts them) plus the bytes
        held."""
        self.synchronize()
        return TierStats(**self.counters.snapshot(), host_bytes=self.total_bytes)

    def __repr__(self) -> str:
        return (f"HostKVStore({self.num_layers} layers x {self.num_slots} slots x {self.row_bytes} B {self.fmt}, "
                f"{self.total_bytes / 2**30:.2f} GiB, pin={self.pin})")


def host_store_bytes(num_layers: int, num_tokens: int, num_kv_heads: int, head_dim: int, fmt: str) -> int:
    """Host bytes for num_tokens tokens (budget arithmetic)."""
    return num_tokens * HostKVStore.bytes_per_token(num_layers, num_kv_heads, head_dim, fmt)


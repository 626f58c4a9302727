"""The host tier as the engine runs it: full-attention K/V in host RAM, the GPU keeps what a step needs.

Owns, for the tiered layers (every full-attention layer, numbered 0..L-1 in model order; sketch-selected
(TieredAttention) or, on qwen4_exp, QSA-selected indexed_attention layers (TieredIndexedAttention)):
  store     HostKVStore: every token's K/V, quantised (int4 | int8 | bf16), in pinned host RAM,
            at the paged slot (block * block_size + offset). The block manager's blocks *are* host
            blocks: the GPU holds no paged K/V for these layers, only the selector's state per block
            (int4 key sketch, or QSA pooled block keys).
  resident  per GDN/state slot, the sink rows and a ring of the recent rows, in the model dtype:
            res_k / res_v [L, num_state_slots * (S + Rr) + 1, Hkv, D] (the last row absorbs masked
            writes). Token p of the sequence in state slot s lives at row s*(S+Rr) + p (p < S) or
            s*(S+Rr) + S + p % Rr (the recent ring; only the last Rr tokens of a step are written).
            Rr = R + ring_extra: with n draft rows per sequence in a verification step, row i reads
            its own last R tokens, which reach n positions below the step's last R (ring_extra = n).
  hot       HotBuffer: picked rows, one partition per sequence (hot_fraction of its tokens),
            windowed CLOCK; keyed by host slot, so prefix-shared blocks hit across sequences. Its
            rows are host records (the store's format and row layout): at int4 a hot row costs 1,088 B
            per layer instead of 4 KiB of bf16 K/V (27B shape), and hits and misses dequantise alike.

One decode step of layer l (`gather`, then attention, then `admit`; no host sync, fixed shapes):
  selected positions -> sinks / recent tail from `resident`, picks -> host slots -> hot lookup ->
  hits read from the hot pool, misses from pinned host memory by the zero-copy gather (in position
  order; it also keeps their records for the admit), both dequantised by the same kernel -> one
  compact [B, N, Hkv, D] K/V scratch in selection order, which the existing paged decode kernel
  reads as a paged cache (block size 16, seq_len = count).

Prefill: a chunk whose sequence has cached tokens (chunked prefill, prefix-cache hit) reads those
tokens back from the host tier into a transient GPU buffer (one layer at a time), i.e. attends over
host-format K/V for the earlier part (exact with bf16 rows and a bf16 model). A sequence that
starts from a shared prefix gets its sinks and recent ring filled from the host rows (at most S + R
rows per layer). Its decode steps then move only picked rows; with sparse prefill_selection=dense the
follow-up's own prompt chunk still reads the whole prefix once: 4.35 GB over PCIe at 250K for the 27B
shape, ~0.7 s of follow-up TTFT alone, and concurrent follow-ups queue behind each other (H200 run 45:
14 at once, 10.1 s mean). With prefill_selection=chunk (the default over the tier) a chunk reads only the rows
one selection per chunk and layer picked (`read_rows`: sinks + top-k + recent, ~3K rows instead of 250K).

Budgets: host_budget_gb sizes the store (hence the number of KV blocks); gpu_budget_gb covers the
selector state (sketches | QSA block keys) of all host blocks, the slot map, the resident rows of
every state slot and the hot pool, which gets the rest. A request whose prompt cannot fit (host blocks, or its minimum hot partition)
is refused at add_request (CapacityError); one that fits but finds no free hot rows waits.
"""
import contextlib
import math

import torch

from sketchkv.errors import CapacityError
from sketchkv.kv.host_store import HostKVStore, TierStats, positions_to_slots
from sketchkv.kv.hot_buffer import HotBuffer
from sketchkv.ops.host_gather import host_gather
from sketchkv.ops.quant_kv import head_record_bytes
from sketchkv.ops.tier_gather import compose_rows, write_resident

SENTINEL = torch.iinfo(torch.int32).max
ATTN_BLOCK = 16  # the compact scratch is read by the paged decode kernel as blocks of this many rows


def available_host_bytes() -> int:
    """MemAvailable from /proc/meminfo (Linux), else 8 GiB."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 * 2**30


def hot_row_bytes(num_layers: int, num_kv_heads: int, head_dim: int, fmt: str) -> int:
    """GPU bytes of one hot-pool row over all layers (a host record of format fmt + key + bit)."""
    return HotBuffer.bytes_per_row(num_layers, num_kv_heads * head_record_bytes(fmt, head_dim))


# The read stream's CUDA priority (lower is higher; the main stream's is 0; see HostTier.__init__)
READ_STREAM_PRIORITY = -1
# Read groups: a group's hits, key base and attention on their own stream (HostTier.attending; False: on the read
# stream after its reads). Built in session 44 without a GPU: off until run 135 tests and times it.
ATTEND_STREAM = False
# Read groups: a group's compose (scratch, hit / miss lists; GPU memory, ~18 us for 4 agents at 27B x 250K) on the
# main stream right after its selection (False), instead of on the read stream before its gather (True): PCIe then
# idles only for launch gaps between two groups' gathers, where the compose between them cost ~18 us each (H100
# run 134), while the next group's selection starts that much later. Session 45, CPU only: run 135 times it.
COMPOSE_ON_READ_STREAM = True


class HostTier:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, *,
                 fmt: str, sinks: int, recent: int, hot_fraction: float, num_state_slots: int,
                 max_model_len: int, pool_rows: int, dtype: torch.dtype, device: torch.device,
                 selector_bytes_per_block: int = 0, kernel: str = "torch", ring_extra: int = 0,
                 admit_stream: bool = False, read_groups: int = 1, miss_read: str = "fields"):
        self.L, self.block_size, self.Hkv, self.D, self.dtype = num_layers, block_size, num_kv_heads, head_dim, dtype
        self.kernel = kernel                            # "torch" | "triton": ops/tier_gather.py, ops/clock_admit.py
        self.sinks, self.recent = sinks, max(recent, 1)
        self.ring = self.recent + ring_extra            # the recent ring's rows (>= the tail window R)
        self.width = sinks + self.ring                  # resident rows per state slot
        self.max_model_len = max_model_len
        self.store = HostKVStore(num_layers, num_blocks, block_size, num_kv_heads, head_dim, fmt,
                                 pin=device.type == "cuda", device=device)
        n_res = num_state_slots * self.width + 1
        self.dump_row = n_res - 1
        self.hot = HotBuffer(num_layers, self.store.num_slots, pool_rows, (self.store.row_bytes,), torch.uint8, device,
                             fraction=hot_fraction, min_rows=min(64, pool_rows), max_seqs=num_state_slots + 1,
                             kernel=kernel)
        self.res_k = torch.zeros(num_layers, n_res, num_kv_heads, head_dim, dtype=dtype, device=device)
        self.res_v = torch.zeros_like(self.res_k)
        self.pad_pid = self.hot.add_sequence(rows=0)    # CUDA-graph padding rows: an empty partition
        self.max_part_rows = max(1, min(pool_rows, self.hot.rows_for(max_model_len)))
        self.selector_bytes_per_block = selector_bytes_per_block  # the layers' selector state (sketch | QSA keys)
        self._unfilled: set[int] = set()                # sequences whose resident rows are not set up yet
        # a side stream (CUDA) for work nothing reads before the step ends: the admits, and in plain decode steps
        # the new tokens' host rows and sketches; joined at the step's end (join). _pending keeps the step's
        # tensors the side stream reads alive until then (no reuse by the main stream's allocations)
        self.admit_stream = torch.cuda.Stream(device) if admit_stream and device.type == "cuda" else None
        self._pending: list = []
        # plain decode in groups of sequences (sparse read_groups, TieredKV.decode_in_groups): each group's rows are
        # read and attended on this stream while the current one scores the next group's selection
        self.read_groups = read_groups if device.type == "cuda" else 1
        # at a higher priority than the main stream: at priority 0 a group's gather, launched while the next group's
        # scoring kernel still had blocks queued, waited ~80 us per layer for them to drain (H200 run 131: 1.2 ms
        # of a 30 ms step); a high-priority stream's blocks go first (CUDA graphs keep the priority: PyTorch
        # instantiates them with cudaGraphInstantiateFlagUseNodePriority). H100 run 134: the wait gone, bf16
        # 8 x 250K 34.68 vs 35.12 ms per step
        self.read_stream = (torch.cuda.Stream(device, priority=READ_STREAM_PRIORITY) if self.read_groups > 1
                            else None)
        # and each group's hits, key base and attention on a third stream once its reads are done, so the read stream
        # goes on to the next group's PCIe reads meanwhile (they were queued behind that work: ~56 us per layer)
        self.attend_stream = (torch.cuda.Stream(device, priority=READ_STREAM_PRIORITY) if self.read_stream is not None
                              and ATTEND_STREAM else None)
        # then the miss gather runs on at most this many programs, each looping over its tiles: its programs mostly
        # wait on PCIe, and one program per tile held the SM slots the next group's scoring needed (H100 run 116)
        self.gather_programs = (torch.cuda.get_device_properties(device).multi_processor_count // 2
                                if self.read_stream is not None else None)
        self.miss_read = miss_read    # "fields" | "rows" (sparse miss_read): how gather reads the misses' host rows
        # residual keys (sparse host_residual_keys): per layer, (x, slots, sign, out) -> x +/- what the GPU sketches
        # at those slots rebuild of their keys; host K rows hold k minus it, every read adds it back (one kernel on
        # CUDA, ops/sketch_base.py). Bound by the model runner to each layer's SparseAttention.with_sketch_base.
        self.key_base: list | None = None

    # ---- sizes ------------------------------------------------------------------------------------
    @staticmethod
    def fixed_gpu_bytes(num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype, sinks, recent,
                        num_state_slots) -> int:
        """GPU bytes besides the hot pool and the selector state: resident rows + the hot slot map (sized
        at 4 B per slot; the map is int16, 2 B, when the pool ends up with at most 32767 rows) + the admit's
        claim scratch (4 B per slot, one for all layers)."""
        res = num_layers * (num_state_slots * (sinks + max(recent, 1)) + 1) * 2 * num_kv_heads * head_dim * dtype.itemsize
        return res + (num_layers + 1) * (num_blocks * block_size + 1) * 4

    @property
    def resident_row_bytes(self) -> int:
        return self.L * 2 * self.Hkv * self.D * self.dtype.itemsize

    @property
    def gpu_bytes(self) -> int:
        res = (self.res_k.numel() + self.res_v.numel()) * self.res_k.element_size()
        return res + self.hot.gpu_bytes + self.store.num_blocks * self.selector_bytes_per_block

    # ---- per sequence (scheduling time, host side) ----------------------------------------------------
    def target_tokens(self, seq) -> int:
        """Tokens the sequence is expected to reach: prompt + max_tokens (prompt only when unbounded)."""
        extra = seq.params.max_tokens if seq.params is not None and seq.params.max_tokens else 0
        return min(self.max_model_len, len(seq) + extra)

    def rows_for(self, seq) -> int:
        return min(self.hot.rows_for(self.target_tokens(seq)), self.max_part_rows)

    def check(self, seq) -> None:
        """Refuse (CapacityError) a request that can never fit: its prompt exceeds the host tier, or
        its hot partition exceeds the whole GPU pool. Anything smaller waits for room."""
        n = len(seq) + 1
        blocks = math.ceil(n / self.block_size)
        if blocks > self.store.num_blocks - 1:
            per_tok = self.store.bytes_per_block / self.block_size
            raise CapacityError(
                f"request {seq.request_id}: {n} tokens need {n * per_tok / 2**30:.3f} GiB of host KV "
                f"({self.store.fmt}), the host tier holds {(self.store.num_blocks - 1) * self.store.bytes_per_block / 2**30:.3f} GiB "
                f"(raise sparse_host_budget_gb)")
        rows = self.hot.rows_for(n)
        if rows > self.hot.P:
            raise CapacityError(
                f"request {seq.request_id}: {n} tokens need {rows} hot-buffer rows "
                f"({rows * self.hot.row_bytes / 2**30:.3f} GiB of GPU), the GPU budget leaves {self.hot.P} "
                f"(raise sparse_gpu_budget_gb or lower sparse_hot_fraction)")

    def can_add(self, seq) -> bool:
        return self.hot.can_add(rows=self.rows_for(seq))

    def add(self, seq) -> None:
        seq.tier_pid = self.hot.add_sequence(rows=self.rows_for(seq))
        self._unfilled.add(seq.seq_id)

    def remove(self, seq) -> None:
        if seq.tier_pid >= 0:
            self.hot.remove_sequence(seq.tier_pid)
            seq.tier_pid = -1
        self._unfilled.discard(seq.seq_id)

    def resident_row(self, state_slot: int, pos: int, end: int) -> int:
        """Row of token `pos` in `resident` when a step ends at `end` tokens (dump: not kept)."""
        if pos < self.sinks:
            return state_slot * self.width + pos
        if pos >= end - self.ring:
            return state_slot * self.width + self.sinks + pos % self.ring
        return self.dump_row

    def prepare(self, batch) -> None:
        """Before a sequence's first step: if it starts from a shared prefix, copy the prefix's sink
        and recent rows from the host into its resident rows (at most S + R rows per layer)."""
        for seq, _ in batch:
            if seq.seq_id not in self._unfilled:
                continue
            self._unfilled.discard(seq.seq_id)
            c = seq.num_cached
            if c == 0:
                continue
            pos = sorted(set(range(min(self.sinks, c))) | set(range(max(self.sinks, c - self.recent), c)))
            slots = [seq.block_table[p // self.block_size] * self.block_size + p % self.block_size for p in pos]
            rows = [self.resident_row(seq.state_slot, p, c) for p in pos]
            dev = self.res_k.device
            slots_t = torch.tensor(slots, dtype=torch.int64, device=dev)
            rows_t = torch.tensor(rows, dtype=torch.int64, device=dev)
            for layer in range(self.L):
                self.store.gather(layer, slots_t, self.res_k[layer], self.res_v[layer], rows_t)
                if self.key_base is not None:
                    k = self.res_k[layer]
                    k.index_copy_(0, rows_t, self.key_base[layer](k[rows_t], slots_t, +1))

    # ---- one step of one layer (device side, no host sync) ------------------------------------------
    def write(self, layer: int, slots: torch.Tensor, resident_rows: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor, off_path: bool = False) -> None:
        """New tokens: K/V to the host rows (async), to the resident rows (sinks, recent ring), and
        forget any hot row held for a slot that now gets new content. off_path (decode steps): the host rows on
        the side stream: no row of the step's tokens is read from the host before the step ends (the tokens
        are in the recent window, read from the resident rows)."""
        with self.side(slots, k, v, on=off_path):
            # (residual keys: after the sketches of these slots, written earlier on this stream or before the fork)
            self.store.write(layer, slots, self.host_keys(layer, slots, k), v)
        if layer == 0:  # every layer's hot rows of these slots at once (no layer picks a new token: it is recent)
            self.hot.invalidate(slots)
        write_resident(self.res_k[layer], self.res_v[layer], resident_rows, k, v)

    def read_prefix(self, layer: int, block_table: torch.Tensor, n: int, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of tokens 0..n-1 of one sequence, read back from the host rows: [n, Hkv, D] each."""
        return self.read_rows(layer, block_table, torch.arange(n, device=self.res_k.device), dtype)

    def read_rows(self, layer: int, block_table: torch.Tensor, pos: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of one sequence's tokens at positions `pos` [N], read from the host rows: [N, Hkv, D] each."""
        slots = positions_to_slots(block_table[None], pos[None], self.block_size)[0]
        k = torch.empty(pos.shape[0], self.Hkv, self.D, dtype=dtype, device=self.res_k.device)
        v = torch.empty_like(k)
        self.store.gather(layer, slots, k, v)
        if self.key_base is not None:
            self.key_base[layer](k, slots, +1, out=k)
        return k, v

    def host_keys(self, layer: int, slots: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """The keys [T, Hkv, D] as the host rows hold them: themselves, or with residual keys minus their sketch's
        part (the sketches of these slots must be written already)."""
        if self.key_base is None:
            return k
        return self.key_base[layer](k, slots, -1, out=torch.empty(k.shape, dtype=torch.float32, device=k.device))

    def compose(self, layer: int, pos: torch.Tensor, counts: torch.Tensor, block_tables: torch.Tensor,
                seq_lens: torch.Tensor, state_slots: torch.Tensor, miss_out: torch.Tensor | None = None):
        """Reading a selection, step 1 (GPU memory): pos [B, N] selected positions (ascending, SENTINEL-padded; the
        first counts[b] valid) -> k, v [B, Np, Hkv, D] (Np = N rounded up to ATTN_BLOCK; row j: position pos[b, j])
        with the resident rows filled, miss keys [B, Np] (host slot of each row to read from host memory, -1
        elsewhere: what to admit) and hit rows [B, Np] (the hot-buffer row of each hit, -1 elsewhere). Then
        read_misses (PCIe) and fill_hits; gather does all three. miss_out: a contiguous [B, Np] tensor to write the
        miss keys into (TieredKV.decode_in_groups: a group's rows of a whole-batch buffer)."""
        Np = -(-pos.shape[1] // ATTN_BLOCK) * ATTN_BLOCK
        return compose_rows(pos, counts, seq_lens, state_slots, block_tables, self.hot.map[layer], self.hot.ref[layer],
                            self.res_k[layer], self.res_v[layer], self.hot.counters.t, kernel=self.kernel,
                            sinks=self.sinks, recent=self.recent, ring=self.ring, width=self.width,
                            block_size=self.block_size, dump_row=self.dump_row, Np=Np, miss=miss_out)

    def read_misses(self, layer: int, k: torch.Tensor, v: torch.Tensor, miss: torch.Tensor,
                    rec_out: torch.Tensor | None = None) -> torch.Tensor:
        """Step 2 (PCIe): the misses read from host memory into k, v (miss_read "fields"; "rows": their records only,
        dequantised by fill_hits) -> their host records [B, Np, row_bytes] (written into rec_out if given)."""
        B, Np = miss.shape
        if rec_out is None:
            rec = torch.empty(B * Np, self.store.row_bytes, dtype=torch.uint8, device=k.device)
        else:
            rec = rec_out.view(B * Np, self.store.row_bytes)
        # No sort by address: the picks are in position order, i.e. ascending within each 64-row block, the
        # order the block table gives across blocks (ascending for a sequence's fresh blocks). The segmented
        # sort and its permutation cost ~25 us per layer at 8 x 250K (H200 run 48); what order across blocks
        # costs is bench_host_gather.py's "blocks" order. The misses' bytes are counted by stats() from the
        # lookup's miss count (the same rows), not by a reduction here.
        if self.miss_read == "rows":
            self.store.copy_rows(layer, miss.flatten(), rec, max_programs=self.gather_programs)
        else:
            self.store.gather(layer, miss.flatten(), k.view(B * Np, self.Hkv, self.D),
                              v.view(B * Np, self.Hkv, self.D), raw=rec, count=False, max_programs=self.gather_programs)
        return rec.view(B, Np, -1)

    def fill_hits(self, layer: int, k: torch.Tensor, v: torch.Tensor, miss: torch.Tensor, hit: torch.Tensor,
                  records: torch.Tensor, add_base: bool = True) -> None:
        """Step 3 (GPU memory): the hot-buffer hits (and with miss_read "rows" the misses' records) dequantised into
        k, v, then the residual keys' base added back (unless add_base is False: the decode kernel adds it to the
        scores, tiered_attention.KEY_BASE_IN_ATTENTION)."""
        B, Np = miss.shape
        kf, vf = k.view(B * Np, self.Hkv, self.D), v.view(B * Np, self.Hkv, self.D)
        if self.miss_read == "rows":
            m = miss.flatten()
            local = torch.where(m >= 0, torch.arange(m.numel(), device=m.device, dtype=torch.int32), -1)
            host_gather(records.view(B * Np, -1), local, kf, vf, self.store.fmt)
        host_gather(self.hot.rows[layer], hit.flatten(), kf, vf, self.store.fmt)
        if self.key_base is not None and add_base:   # rows from host records (misses, hot hits); resident rows: -1
            self.key_base[layer](kf, miss.flatten(), +1, out=kf, hits=hit.flatten(), pool_slots=self.hot.key[layer])

    def gather(self, layer: int, pos: torch.Tensor, counts: torch.Tensor, block_tables: torch.Tensor,
               seq_lens: torch.Tensor, state_slots: torch.Tensor, miss_out: torch.Tensor | None = None,
               rec_out: torch.Tensor | None = None):
        """A whole read of a selection on the current stream (compose, read_misses, fill_hits) -> k, v
        [B, Np, Hkv, D], miss keys [B, Np] and the misses' host records [B, Np, row_bytes]."""
        k, v, miss, hit = self.compose(layer, pos, counts, block_tables, seq_lens, state_slots, miss_out)
        rec = self.read_misses(layer, k, v, miss, rec_out)
        self.fill_hits(layer, k, v, miss, hit, rec)
        return k, v, miss, rec

    def admit(self, layer: int, pids, miss: torch.Tensor, records: torch.Tensor, graph: bool = False) -> torch.Tensor:
        """After the step's attention: the misses (gather's miss keys [B, Np] and records [B, Np, row_bytes]) into the
        hot buffer. With the admit stream the work is only enqueued there; the pool rows returned are valid after
        join()."""
        cap = self.max_part_rows if graph else None
        with self.side(pids, miss, records) as keep:
            rows = self.hot.admit(layer, pids, miss, records, max_cap=cap)
            keep.append(rows)
        return rows

    @contextlib.contextmanager
    def side(self, *tensors, on: bool = True):
        """Run the enclosed work on the side stream (CUDA, admit_stream and `on`; else where it is): it forks from
        the current stream here and is joined at the step's end (join). The tensors it reads (and what it appends
        to the yielded list) are kept alive until then, so the main stream's allocations cannot reuse them."""
        keep = list(tensors)
        if self.admit_stream is None or not on:
            yield keep
            return
        self.admit_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.admit_stream):
            yield keep
        self._pending.append(keep)

    @contextlib.contextmanager
    def reading(self, on: bool = True):
        """Run the enclosed work (one group's PCIe reads: read_misses) on the read stream, after the current
        stream's work so far (CUDA with read_groups > 1, and on; else where it is). join_reads() brings it back."""
        if self.read_stream is None or not on:
            yield
            return
        self.read_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.read_stream):
            yield

    @contextlib.contextmanager
    def attending(self, on: bool = True):
        """Run the enclosed work (one group's hits, key base and attention) on the attend stream, after the read
        stream's work so far (that group's reads), so the next group's reads queued on the read stream go on
        meanwhile (ATTEND_STREAM off: on the read stream; no read stream, or not on: where it is)."""
        if self.read_stream is None or not on:
            yield
            return
        if self.attend_stream is None:   # ATTEND_STREAM off: on the read stream, after the reads
            with torch.cuda.stream(self.read_stream):
                yield
            return
        self.attend_stream.wait_stream(self.read_stream)
        with torch.cuda.stream(self.attend_stream):
            yield

    def join_reads(self) -> None:
        for stream in (self.read_stream, self.attend_stream):
            if stream is not None:
                torch.cuda.current_stream().wait_stream(stream)

    def join(self) -> None:
        """End of a step: the current stream waits for the work enqueued on the side stream (admits: the next
        step's lookups and the layer-0 invalidation read every layer's hot buffer; host rows and sketches: read
        once their tokens leave the recent window). Also inside a CUDA-graph capture, which must join every stream
        it forked."""
        if self._pending:
            torch.cuda.current_stream().wait_stream(self.admit_stream)
            self._pending.clear()

    # ---- accounting ---------------------------------------------------------------------------------
    def stats(self) -> TierStats:
        """Totals since start: hits, misses, PCIe bytes (one host sync); host/GPU bytes allocated. PCIe reads:
        the store's own (prefix reads, resident fills) + one row per decode miss (gather reads exactly those)."""
        s = self.store.stats() + self.hot.stats()
        return TierStats(s.hits, s.misses, s.pcie_read_bytes + s.misses * self.store.row_bytes, s.pcie_write_bytes,
                         self.store.total_bytes, self.gpu_bytes)

    def seq_stats(self, seq) -> TierStats:
        """Memory one sequence holds: host rows of its blocks (shared prefix blocks counted in full),
        and on the GPU its resident rows, hot partition, selector state (sketches | QSA block keys) and
        slot-map entries (every layer's map + the admit's claim scratch)."""
        blocks = len(seq.block_table)
        part = self.hot._parts.get(seq.tier_pid, (0, 0))[1] if seq.tier_pid >= 0 else 0
        per_slot = self.L * self.hot.map.element_size() + self.hot.claim_bytes_per_slot
        gpu = (self.width * self.resident_row_bytes + part * self.hot.row_bytes
               + blocks * (self.selector_bytes_per_block + self.block_size * per_slot))
        return TierStats(host_bytes=blocks * self.store.bytes_per_block, gpu_bytes=gpu)

    def __repr__(self) -> str:
        return (f"HostTier({self.store!r}, hot pool {self.hot.P} rows, resident {self.width} rows/seq, "
                f"GPU {self.gpu_bytes / 2**30:.2f} GiB)")


def default_host_budget() -> int:
    """Half of the host RAM available now."""
    return available_host_bytes() // 2

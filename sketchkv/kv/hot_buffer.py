"""GPU hot buffer of the host tier: recently picked K/V rows, per sequence, windowed CLOCK replacement.

Pool: rows [num_layers, P + 1, *row_shape] on the GPU (row P is a dump row that absorbs masked writes).
The host tier keeps its rows there as stored in host RAM (uint8 records of the host format: 1,088 B per
token and layer at int4 for 4 KV heads x 256, a quarter of the bf16 K/V), so a hit is read and
dequantised by the same gather kernel as a miss, and admitting a miss copies its record.
Each sequence owns a contiguous *partition* of the P rows, sized as a fraction of its tokens
(default 2.5%), the same in every layer. Rows are keyed by host slot (block * block_size + offset,
the HostKVStore / GPU-cache slot): `map[layer, slot]` -> pool row or -1, so one fixed-shape GPU
table serves the whole batch and prefix-shared blocks are found by every sequence that shares them
(a hit may land in another sequence's partition; rows are only *placed* into one's own).

GPU memory: the pool rows (row_shape x dtype per layer and row), plus the map, 2 B per layer and
host slot while the pool has at most 32767 rows (int16), else 4 B (64 B per host token for 16 layers:
~16 MB per 250K-token agent).

Per layer and pool row: `key` (host slot or -1) and a reference bit; per layer and partition: a
clock `hand` and `used` (rows filled so far; a partition fills in row order before it evicts).

One decode step of one layer (batched over sequences, no host sync, fixed shapes):
  lookup(layer, keys [B, N])           -> pool rows [B, N] (-1: miss); sets the reference bit of hits
  admit(layer, pids, keys, src)        places misses, copies their rows in, returns the rows
Semantics of admit, for each sequence (its misses in order, deduplicated over the batch):
  1. the first (capacity - used) misses fill the free rows in row order;
  2. the rest go through windowed CLOCK over the rows that were resident when the step began,
     starting at the hand: a referenced row is skipped and its bit cleared; the first unreferenced
     row is evicted, or, when W rows in a row were all referenced, the W-th (the window's end);
     the hand moves past the victim. A new row enters with its bit clear (a hit sets it).
  3. the hand advances at most one lap per step: misses left when it comes round are not admitted
     (slot -1; the caller still has their rows in its scratch), so a step never evicts a row it
     admitted itself.
Rows hit in this step may be evicted by this step's admits (the window's end): call admit after the
attention of the step has read the hot rows (stream order is enough), with misses read from the
scratch the gather wrote. `SequentialClock` in tests/test_host_tier.py spells 1-3 out one miss at a time.

This is the PyTorch formulation: CLOCK's scan is a prefix computation over the partition's bits
(runs of referenced rows -> candidates at every W-th position and at each unreferenced row;
victims = the first M candidates), ~30 small kernels per layer and step. With kernel="triton"
steps 2-3 and the installs run as one program per sequence instead, the admitted rows' copies as a
parallel kernel (sketchkv/ops/clock_admit.py); the deduplication over the batch stays here.
"""
import math
import os

import torch

from sketchkv.errors import CapacityError
from sketchkv.kv.host_store import TierCounters, TierStats
from sketchkv.ops import clock_admit

MAX_INT16_ROWS = torch.iinfo(torch.int16).max  # pools up to this many rows map host slots in 2 B


class HotBuffer:
    def __init__(self, num_layers: int, num_host_slots: int, capacity_rows: int, row_shape: tuple[int, ...],
                 dtype=torch.uint8, device="cpu", *, fraction: float = 0.025, window: int = 16,
                 min_rows: int = 64, max_seqs: int = 256, kernel: str = "torch"):
        """num_host_slots: HostKVStore.num_slots (keys are < this). capacity_rows: P, the pool size
        shared by all sequences. row_shape / dtype: one pool row (the host tier: (row_bytes,) uint8,
        a host record). fraction / min_rows: a sequence of n tokens gets max(min_rows, ceil(fraction * n))
        rows. window: W of windowed CLOCK."""
        assert window >= 1
        self.L, self.S, self.P = num_layers, num_host_slots, capacity_rows
        self.row_shape, self.dtype = tuple(row_shape), dtype
        self.device = torch.device(device)
        self.fraction, self.window, self.min_rows = fraction, window, min_rows
        self.kernel = kernel  # admit: "torch" (this file) | "triton" (sketchkv/ops/clock_admit.py, one kernel)
        dev, L, P = self.device, num_layers, capacity_rows
        self.rows = torch.zeros(L, P + 1, *self.row_shape, dtype=dtype, device=dev)
        # 2 B per host slot while pool rows fit int16 (the seed's "2-byte slot"), else 4 B
        map_dtype = torch.int16 if P <= MAX_INT16_ROWS else torch.int32
        self.map = torch.full((L, num_host_slots + 1), -1, dtype=map_dtype, device=dev)  # [.., S]: dump
        self.key = torch.full((L, P + 1), -1, dtype=torch.int64, device=dev)
        self.ref = torch.zeros(L, P + 1, dtype=torch.uint8, device=dev)
        # admit's scratch: per host slot, the first batch row that picked it (int32 max: none; shared by layers)
        self._claim = torch.full((num_host_slots + 1,), torch.iinfo(torch.int32).max, dtype=torch.int32, device=dev)
        # partitions (host-side mirror for allocation; device copies for the step)
        self.max_seqs = max_seqs
        self.part_base = torch.zeros(max_seqs, dtype=torch.int64, device=dev)
        self.part_cap = torch.zeros(max_seqs, dtype=torch.int64, device=dev)
        self.hand = torch.zeros(L, max_seqs, dtype=torch.int64, device=dev)
        self.used = torch.zeros(L, max_seqs, dtype=torch.int64, device=dev)
        self._parts: dict[int, tuple[int, int]] = {}         # pid -> (base, cap)
        self._free_pids = list(range(max_seqs - 1, -1, -1))
        self._free_ranges: list[tuple[int, int]] = [(0, P)]  # (start, length), sorted by start
        self.counters = TierCounters(dev)

    # ---- sizes ------------------------------------------------------------------------------------
    @property
    def dump_row(self) -> int:
        return self.P

    @property
    def dump_key(self) -> int:
        return self.S

    def rows_for(self, num_tokens: int) -> int:
        return max(self.min_rows, math.ceil(self.fraction * num_tokens))

    @staticmethod
    def bytes_per_row(num_layers: int, row_bytes: int) -> int:
        """GPU bytes of one pool row over all layers: its data, key (8 B) and reference bit (1 B)."""
        return num_layers * (row_bytes + 8 + 1)

    @property
    def row_bytes(self) -> int:
        return self.bytes_per_row(self.L, self.rows[0, 0].numel() * self.rows.element_size())

    @property
    def gpu_bytes(self) -> int:
        t = (self.rows, self.map, self.key, self.ref, self.hand, self.used, self.part_base, self.part_cap, self._claim)
        return sum(x.numel() * x.element_size() for x in t)

    @property
    def claim_bytes_per_slot(self) -> int:
        return self._claim.element_size()

    def seq_bytes(self, pid: int) -> int:
        """GPU bytes of one sequence's partition (its share of the pool)."""
        return self._parts[pid][1] * self.row_bytes

    @property
    def free_rows(self) -> int:
        return sum(n for _, n in self._free_ranges)

    # ---- partitions (scheduling time, host side) ---------------------------------------------------
    def can_add(self, num_tokens: int | None = None, rows: int | None = None) -> bool:
        """Whether add_sequence would succeed now (for the scheduler: wait instead of failing)."""
        cap = rows if rows is not None else self.rows_for(num_tokens or 0)
        return bool(self._free_pids) and any(n >= cap for _, n in self._free_ranges)

    def add_sequence(self, num_tokens: int | None = None, rows: int | None = None) -> int:
        """Reserve a partition (rows, default rows_for(num_tokens)); returns its id. CapacityError
        when the pool has no contiguous range that large or all ids are taken."""
        cap = rows if rows is not None else self.rows_for(num_tokens or 0)
        i = next((i for i, (_, n) in enumerate(self._free_ranges) if n >= cap), None)
        if i is None or not self._free_pids:
            raise CapacityError(f"hot buffer full: {cap} rows wanted, {self.free_rows} of {self.P} free "
                                f"(largest range {max((n for _, n in self._free_ranges), default=0)})")
        start, n = self._free_ranges[i]
        if n == cap:
            self._free_ranges.pop(i)
        else:
            self._free_ranges[i] = (start + cap, n - cap)
        pid = self._free_pids.pop()
        self._parts[pid] = (start, cap)
        self.part_base[pid] = start
        self.part_cap[pid] = cap
        self.hand[:, pid] = 0
        self.used[:, pid] = 0
        return pid

    def remove_sequence(self, pid: int) -> None:
        """Drop a partition: its rows leave the map (all layers) and return to the pool."""
        start, cap = self._parts.pop(pid)
        if cap:
            rows = torch.arange(start, start + cap, device=self.device)
            old = self.key[:, rows]                                                   # [L, cap]
            lidx = torch.arange(self.L, device=self.device)[:, None]
            cur = self.map[lidx, torch.where(old >= 0, old, self.dump_key)]
            self.map[lidx, torch.where((old >= 0) & (cur == rows), old, self.dump_key)] = -1
            self.key.index_fill_(1, rows, -1)
            self.ref.index_fill_(1, rows, 0)
        self.hand[:, pid] = 0
        self.used[:, pid] = 0
        self.part_cap[pid] = 0
        self._free_pids.append(pid)
        self._free_ranges.append((start, cap))
        self._free_ranges.sort()
        merged = []
        for s, n in self._free_ranges:  # coalesce neighbours
            if merged and merged[-1][0] + merged[-1][1] == s:
                merged[-1] = (merged[-1][0], merged[-1][1] + n)
            elif n:
                merged.append((s, n))
        self._free_ranges = merged

    def invalidate(self, keys: torch.Tensor) -> None:
        """Host slots whose content changes (a block reused for new tokens): forget their hot rows, in every
        layer. (The rows stay as orphans until evicted; lookups no longer return them.)"""
        keys = keys.to(self.device).long().flatten()
        keys = torch.where(keys >= 0, keys, self.dump_key)
        self.map.index_fill_(1, keys, -1)
        self.map.narrow(1, self.dump_key, 1).fill_(-1)

    # ---- one decode step ---------------------------------------------------------------------------
    def lookup(self, layer: int, keys: torch.Tensor) -> torch.Tensor:
        """keys [...] host slots (int, < 0 = no pick) -> pool rows int64 (-1: miss or no pick).
        Sets the reference bit of every hit; counts hits and misses."""
        keys = keys.long()
        valid = keys >= 0
        rows = self.map[layer, torch.where(valid, keys, self.dump_key)].long()
        rows = torch.where(valid, rows, -1)
        hit = rows >= 0
        # index_fill_, not `ref[layer, idx] = 1`: a Python scalar assigned through an index tensor is
        # copied host->device first, a synchronising copy (caught by cuda sync debug mode on the H200)
        self.ref[layer].index_fill_(0, torch.where(hit, rows, self.dump_row).flatten(), 1)
        self.counters.add("hits", hit.sum())
        self.counters.add("misses", (valid & ~hit).sum())
        return rows

    def admit(self, layer: int, pids, keys: torch.Tensor, src: torch.Tensor,
              max_cap: int | None = None) -> torch.Tensor:
        """Place the misses keys [B, N] (host slots, < 0 = nothing) of sequences pids [B] (list or
        device tensor) and copy their rows src [B, N, *row_shape] in. Returns pool rows [B, N]
        (-1: not admitted: no pick, already resident, a duplicate, or no room this step).
        max_cap: bound on the partitions' capacity for the PyTorch admit's shapes (default: the largest live
        one; pass a constant when capturing a graph)."""
        dev = self.device
        B, N = keys.shape
        if isinstance(pids, torch.Tensor):
            pid_t = pids.to(dev, torch.int64)
        else:
            pid_t = torch.tensor(pids, dtype=torch.int64, device=dev)
        keys = keys.to(dev).long()
        # 1. which keys to admit: picks, not resident, first occurrence in the batch (row-major order)
        triton_ok = self.kernel == "triton" and clock_admit.triton is not None and (
            dev.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1")
        candidates = clock_admit.admit_candidates_triton if triton_ok else clock_admit.admit_candidates_ref
        keys = candidates(keys, self.map[layer], self._claim)
        if triton_ok:  # steps 2-5 below in one kernel (+ the rows' copy)
            return clock_admit.clock_admit_triton(keys, pid_t, self.part_base, self.part_cap, self.hand[layer],
                                                  self.used[layer], self.ref[layer], self.key[layer],
                                                  self.map[layer], src.to(dev, self.dtype), self.rows[layer],
                                                  self.window)
        valid = keys >= 0
        # the lap's static width (the Triton kernel's lap ends at `used` instead)
        if max_cap is not None:
            C = max_cap
        elif isinstance(pids, torch.Tensor):
            C = max((c for _, c in self._parts.values()), default=0)
        else:
            C = max((self._parts[p][1] for p in pids), default=0)
        C = max(C, 1)
        rank = valid.long().cumsum(1) - 1                  # the admit's index within its sequence
        M = valid.sum(1)
        base, cap = self.part_base[pid_t], self.part_cap[pid_t]
        hand, used = self.hand[layer, pid_t], self.used[layer, pid_t]
        n_free = cap - used
        # 2. CLOCK candidates over one lap of the rows resident at the step's start, from the hand
        lap = used.clamp_min(1)[:, None]                   # == cap once full; hand == 0 before that
        j = torch.arange(C, device=dev)
        jm = j[None] < used[:, None]
        row_j = base[:, None] + (hand[:, None] + j[None]) % lap
        refj = (self.ref[layer, torch.where(jm, row_j, self.dump_row)] != 0) & jm
        last_unref = torch.where(refj, -1, j[None]).cummax(1).values
        prev = torch.nn.functional.pad(last_unref[:, :-1], (1, 0), value=-1)
        run_pos = j[None] - prev                           # 1-based position in a run of referenced rows
        cand = jm & (~refj | (run_pos % self.window == 0))
        crank = cand.long().cumsum(1) - 1
        n_cand = cand.sum(1)
        jt = torch.full((B, C + 1), -1, dtype=torch.int64, device=dev)   # c-th candidate -> j
        jt.scatter_(1, torch.where(cand, crank, C), j[None].expand(B, C).contiguous())
        jt[:, C] = -1
        # 3. victims
        kc = rank - n_free[:, None]
        to_free = valid & (kc < 0)
        to_clock = valid & (kc >= 0) & (kc < n_cand[:, None])
        jv = jt.gather(1, kc.clamp(0, C))
        rows = torch.where(to_free, base[:, None] + used[:, None] + rank,
                           torch.where(to_clock, base[:, None] + (hand[:, None] + jv) % lap, -1))
        placed = to_free | to_clock
        # 4. hand, used, cleared bits
        n_clock = (M - n_free).clamp_min(0)
        n_placed = torch.minimum(n_clock, n_cand)
        dropped = n_clock > n_cand
        last_j = torch.where(n_placed > 0, jt.gather(1, (n_placed - 1).clamp_min(0)[:, None])[:, 0], -1)
        upto = torch.where(dropped, used - 1, last_j)
        clear = refj & (j[None] <= upto[:, None])
        self.ref[layer].index_fill_(0, torch.where(clear, row_j, self.dump_row).flatten(), 0)
        capc = cap.clamp_min(1)
        new_hand = torch.where(dropped, (hand + used) % capc,
                               torch.where(n_placed > 0, (hand + last_j + 1) % capc, hand))
        self.hand[layer, pid_t] = new_hand
        self.used[layer, pid_t] = used + torch.minimum(M, n_free)
        # 5. evict the victims' old keys (only where the map still points at the victim), install
        r = torch.where(placed, rows, self.dump_row).flatten()
        old = self.key[layer, r]
        okey = torch.where(old >= 0, old, self.dump_key)
        cur = self.map[layer, okey].long()
        self.map[layer].index_fill_(0, torch.where((old >= 0) & (cur == r), okey, self.dump_key).flatten(), -1)
        self.map[layer, torch.where(placed.flatten(), keys.flatten(), self.dump_key)] = r.to(self.map.dtype)
        # narrow().fill_(): `map[layer, i] = -1` copies a CPU scalar into a 0-d view (a sync; illegal in a capture)
        self.map[layer].narrow(0, self.dump_key, 1).fill_(-1)
        self.key[layer, r] = torch.where(placed.flatten(), keys.flatten(), -1)
        self.ref[layer].index_fill_(0, r.flatten(), 0)
        self.rows[layer, r] = src.reshape(B * N, *self.row_shape).to(dev, self.dtype)
        return rows

    def stats(self) -> TierStats:
        c = self.counters.snapshot()
        return TierStats(hits=c["hits"], misses=c["misses"], gpu_bytes=self.gpu_bytes)

    # ---- introspection (tests, debugging) ----------------------------------------------------------
    def resident(self, layer: int, pid: int) -> dict[int, int]:
        """{key: pool row} of one partition's rows that the map points at (host sync)."""
        start, cap = self._parts[pid]
        keys = self.key[layer, start:start + cap].tolist()
        out = {}
        for i, kk in enumerate(keys):
            if kk >= 0 and int(self.map[layer, kk]) == start + i:
                out[kk] = start + i
        return out

"""Decode over the host tier: the same interface as `Attention`, with the K/V in host RAM.

`TieredKV` is the tier half of a layer, mixed into a layer that owns a selector (`select` +
`selection_query`: token positions + counts, SENTINEL-padded, shared by all KV heads):
  - `TieredAttention`        = TieredKV + SparseAttention  (int4 key sketch + top-k, sinks, recent),
  - `TieredIndexedAttention` = TieredKV + IndexedAttention (qwen4_exp: the model's own QSA indexer).
The tier, prefix caching, the scheduler and the server see the same layer either way.

What the layer keeps on the GPU is its selector's state (the sketch, or QSA block keys + raw index
tail); K/V rows go to the host tier (sketchkv.kv.host_tier): every forward writes its new rows there
(quantised on the device, written asynchronously into pinned memory) and into the sequence's sinks /
recent ring.

Decode (every step, any context length: when the selection covers the context the picks are every
token, so this is also the dense path): select -> tier.compose, read_misses, fill_hits (sinks and tail from the
resident rows, picks from the hot buffer or, on a miss, straight from pinned host memory) into a compact K/V
scratch -> the paged decode kernel over that scratch -> admit the misses' host records to the hot buffer. Fixed
shapes and no host sync: CUDA-graph capturable. In a speculative verification step each row of a
sequence (its token and its drafts) selects and reads for its own position; with one selection per
sequence (sparse verify_selection=shared) the sequence's rows are read once, for all of them.

With sparse read_groups > 1 (CUDA) a plain decode step does this per group of sequences, each group's reads on a
second stream while the next group's selection is scored, its attention after them (decode_in_groups).

Prefill: chunks of a sequence with cached tokens attend over the prefix read back from the tier (or, with
prefill_selection=chunk, over the rows one selection per chunk picked: only those are read).
"""
import functools

import torch

from sketchkv.engine.context import get_context
from sketchkv.kv import host_tier
from sketchkv.kv.host_tier import ATTN_BLOCK
from sketchkv.layers.indexed_attention import IndexedAttention
from sketchkv.layers.sparse_attention import SparseAttention
from sketchkv.ops.paged_attention import paged_attention_decode

# The residual keys' base (sparse host_residual_keys) added inside the decode kernel's scores (q . mean +
# (basis^T q) . coefficients per row read from host records) instead of rewritten into the K scratch by one
# apply_sketch_base kernel per read (2 per layer and step with read groups: ~17 us each at 8 x 250K, H100 run
# 134's profile). Off until a GPU run times it (benchmarks/next/).
KEY_BASE_IN_ATTENTION = False


def plain_decode(ctx) -> bool:
    """One new token per sequence and no drafts: the step reads none of its own tokens from the host rows (they
    are in the resident recent ring), so their host rows (and, with a recent window, sketches) may be written
    off the critical path. (A verification step's later rows could pick an earlier row's draft.)"""
    return ctx.is_decode and ctx.verify is None and ctx.verify_leaders is None


class TieredKV:
    """Mixin (before the selector layer in the bases): K/V storage and decode through the host tier."""
    layer: int      # index among the tier's layers
    tier = None     # HostTier, bound by the model runner (k_cache / v_cache stay empty)

    @property
    def last_indices(self):
        """(idx, counts) of the last decode step (tests and stats); after a step in groups its parts are joined here,
        when read, not by two concatenations per layer in every step (they would be CUDA-graph kernels)."""
        picks = self._last_picks
        return tuple(torch.cat(x) for x in zip(*picks)) if isinstance(picks, list) else picks

    @last_indices.setter
    def last_indices(self, value):   # (idx, counts), a list of per-group (idx, counts), or None
        self._last_picks = value

    def store_kv(self, k: torch.Tensor, v: torch.Tensor) -> None:
        ctx = get_context()
        self.tier.write(self.layer, ctx.slot_mapping, ctx.resident_rows, k, v, off_path=plain_decode(ctx))

    def context_kv(self, block_table, cached: int, k, v):
        kp, vp = self.tier.read_prefix(self.layer, block_table, cached, k.dtype)
        return torch.cat([kp, k]), torch.cat([vp, v])

    def prefix_rows(self, block_table, pos, dtype):
        """prefill_selection=chunk: only the chosen prefix rows, read from the host tier."""
        return self.tier.read_rows(self.layer, block_table, pos, dtype)

    def decode(self, q, block_tables, seq_lens, sparse: bool, graph: bool, max_seq_len: int) -> torch.Tensor:
        ctx = get_context()
        sub = None if ctx.is_decode else ctx.decode_seqs  # mixed step: the decode rows' sequences
        state_slots = ctx.state_slots if sub is None else ctx.state_slots[sub]
        pids = ctx.hot_pids if sub is None else ctx.hot_pids[sub]
        max_len = block_tables.shape[1] * self.tier.block_size if graph else max_seq_len
        sq = self.selection_query(q)
        parts = min(self.tier.read_groups, q.shape[0])
        # not in verification steps, nor with miss_estimate (its buffer takes one select call per step; QSA: no cfg)
        miss_estimate = getattr(self, "cfg", None) is not None and self.cfg.miss_estimate
        if parts > 1 and ctx.verify_leaders is None and not miss_estimate:
            return self.decode_in_groups(parts, q, sq, block_tables, seq_lens, state_slots, pids, max_len, graph)
        idx, counts = self.select(sq, block_tables, seq_lens, max_len)
        self.last_indices = (idx, counts)
        # verification with one selection per sequence: its rows' positions are nested (each row's are a prefix
        # of its last row's, ascending), so the tier reads the last row's once and every row of the sequence
        # attends over the first `count` of them (the decode kernel reads each K/V tile once for all of a
        # sequence's rows: row_groups). Otherwise each row reads its own; the first row of a
        # sequence admits its misses (the hot buffer's CLOCK places one row's misses per partition).
        groups = self.verify_groups(ctx) if self.verify_shared else None   # (QSA layers never share)
        lasts = None if groups is None else groups[1]
        read = slice(None) if lasts is None else lasts   # the rows whose positions the tier reads
        out, miss, records = self.read_and_attend(q, idx[read], counts, block_tables[read], seq_lens[read],
                                                  state_slots[read], groups)
        if lasts is not None:
            pids = pids[lasts]
        elif ctx.verify_leaders is not None:
            # index_fill_, not `first[leaders] = True`: a Python scalar through an index tensor is a host-to-device
            # copy, which a CUDA-graph capture refuses (H200 run 17: verification graphs fell back to eager)
            first = torch.zeros(q.shape[0], dtype=torch.bool, device=q.device).index_fill_(0, ctx.verify_leaders, True)
            miss = torch.where(first[:, None], miss, -1)
        self.tier.admit(self.layer, pids, miss, records, graph)
        return out

    def read_and_attend(self, q, idx, counts, block_tables, seq_lens, state_slots, groups=None, out=None, miss=None,
                        records=None, keep=None):
        """The picks idx [B', 1, N] of the rows the tier reads (resident rows, hot buffer, host misses) into a K/V
        scratch, attended by q (row_groups: see decode) -> output, miss keys [B', Np] and their host records
        [B', Np, row_bytes]; out / miss / records: where to write them (a group's slices of whole-batch buffers).
        keep (a list: decode_in_groups): the PCIe reads go on the tier's read stream and what follows them on its
        attend stream (see HostTier.attending), and the tensors they share are appended to keep, to stay referenced
        until join_reads."""
        split = keep is not None
        compose = functools.partial(self.tier.compose, self.layer, idx[:, 0],
                                    counts if groups is None else counts[groups[1]], block_tables, seq_lens,
                                    state_slots, miss_out=miss)
        # the compose on the read stream (the next group's selection need not wait for it) or, with
        # host_tier.COMPOSE_ON_READ_STREAM False, before the reads on this one (they then wait for nothing but PCIe)
        early = split and not host_tier.COMPOSE_ON_READ_STREAM
        if early:
            k, v, miss, hit = compose()
        with self.tier.reading(split):
            if not early:
                k, v, miss, hit = compose()
            records = self.tier.read_misses(self.layer, k, v, miss, rec_out=records)
        fold = KEY_BASE_IN_ATTENTION and self.tier.key_base is not None
        with self.tier.attending(split):
            self.tier.fill_hits(self.layer, k, v, miss, hit, records, add_base=not fold)
            B, Np = miss.shape
            nb = Np // ATTN_BLOCK
            kb = (miss.view(-1), hit.view(-1), self.tier.hot.key[self.layer], *self.sketch_base_args()) if fold else None
            out = paged_attention_decode(q, k.view(B * nb, ATTN_BLOCK, self.num_kv_heads, self.head_dim),
                                         v.view(B * nb, ATTN_BLOCK, self.num_kv_heads, self.head_dim),
                                         None, counts, self.scale, out=out, row_groups=groups,
                                         key_base=kb)   # row b: its nb blocks
        if split:
            keep.append((k, v, hit))
        return out, miss, records

    def decode_in_groups(self, parts, q, sq, block_tables, seq_lens, state_slots, pids, max_len, graph):
        """Decode (no verification) with the batch's sequences in `parts` groups: each group's selection is scored on
        the current stream right after the previous group's, its K/V scratch is composed and its misses read on the
        tier's read stream as soon as its picks exist, so one group's PCIe reads overlap the next group's scoring;
        its hits and attention run after its reads (on the tier's attend stream with host_tier.ATTEND_STREAM, so
        the next group's reads need not wait for them; else on the read stream). Each group writes its output, miss
        keys and records into its rows of whole-batch buffers (no concatenation kernels), and one admit after the
        join takes every group's misses (one CLOCK kernel for the batch, as without groups).
        The buffers are allocated on the current stream, and what a group's reads allocate is kept here, all
        referenced until the join (then the admit's side stream keeps miss and records), so no allocation of another
        stream can reuse them early."""
        B = q.shape[0]
        cuts = [B * i // parts for i in range(parts + 1)]
        out = q.new_empty(q.shape)
        miss = records = None
        picks, keep = [], []
        for a, b in zip(cuts, cuts[1:]):
            idx, counts = self.select(sq[a:b], block_tables[a:b], seq_lens[a:b], max_len)
            if miss is None:   # the picks' width depends on max_len only: every group's is the first's
                Np = -(-idx.shape[-1] // ATTN_BLOCK) * ATTN_BLOCK
                miss = torch.empty(B, Np, dtype=torch.int64, device=q.device)
                records = torch.empty(B, Np, self.tier.store.row_bytes, dtype=torch.uint8, device=q.device)
            self.read_and_attend(q[a:b], idx, counts, block_tables[a:b], seq_lens[a:b], state_slots[a:b],
                                 out=out[a:b], miss=miss[a:b], records=records[a:b], keep=keep)
            picks.append((idx, counts))
        self.tier.join_reads()
        self.last_indices = picks
        self.tier.admit(self.layer, pids, miss, records, graph)
        return out


class TieredAttention(TieredKV, SparseAttention):
    """Sketch selection over the host tier."""

    def __init__(self, sparse: SparseAttention, layer: int):
        SparseAttention.__init__(self, sparse, sparse.cfg, sparse.basis, sparse.mean, sparse.dense_threshold)
        self.layer = layer

    def write_sketches(self, k: torch.Tensor) -> None:
        ctx = get_context()
        # a decode step never scores its own tokens (they are in the recent window): their sketches are written on
        # the tier's side stream, off the step's critical path (with no recent window, before the scoring)
        off_path = plain_decode(ctx) and self.cfg.recent_tokens > 0
        with self.tier.side(k, ctx.slot_mapping, on=off_path):
            SparseAttention.write_sketches(self, k)


class TieredIndexedAttention(TieredKV, IndexedAttention):
    """QSA selection over the host tier (qwen4_exp `indexed_attention` layers). The GPU keeps the block
    keys and raw index tail (as IndexedAttention), the tier's sinks / recent ring and hot buffer; a
    step reads at most budget + c - 1 rows per layer whatever the context, so decode stays flat."""

    def __init__(self, indexed: IndexedAttention, layer: int):
        IndexedAttention.__init__(self, indexed.num_heads, indexed.num_kv_heads, indexed.head_dim, indexed.scale,
                                  indexed.index_dim, indexed.budget, indexed.ratio, indexed.finish_block_keys)
        self.layer = layer

    def selected_kv_source(self, block_table, cached: int, k, v):
        """No paged cache here: the chunk's context read back from the tier (as the dense prefix read),
        laid out as ATTN_BLOCK-row blocks for the indexed kernel. The chunk's own rows are padded to
        the block multiple before the concatenation, so the context is copied once."""
        pad = -(cached + k.shape[0]) % ATTN_BLOCK
        k, v = (torch.nn.functional.pad(x, (0, 0, 0, 0, 0, pad)) for x in (k, v))
        kb, vb = self.context_kv(block_table, cached, k, v) if cached else (k, v)
        nb = kb.shape[0] // ATTN_BLOCK
        table = torch.arange(nb, dtype=torch.int32, device=k.device)
        return (kb.view(nb, ATTN_BLOCK, *kb.shape[1:]), vb.view(nb, ATTN_BLOCK, *vb.shape[1:]), table)

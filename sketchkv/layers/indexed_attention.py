"""QSA attention core (qwen4_exp `indexed_attention` layers): the model's own indexer picks the tokens.

Same interface as `Attention` plus the step's index queries / raw index keys. Memory per layer:
  - main K/V: paged like `Attention`; with sparse_host_tier=True in host RAM instead
    (`TieredIndexedAttention`, sketchkv/layers/tiered_attention.py: this selector + the tier's gather),
  - `index_keys`: the block keys (pooled, normed, RoPE'd), paged like the KV cache: block_size / c
    rows of D per KV block, written once when a block of c tokens completes (plus one dump row),
  - `index_tail`: per state slot, the raw index keys of the incomplete block (< c rows of D).
With block_size a multiple of c a KV block boundary is also an index block boundary, so prefix
caching needs no extra state: the tail is empty at every cached boundary.

Selection (ops/qsa.py) yields token positions + counts in the sparse-attention layout, the same
contract as the sketch selector (`SparseAttention.select`): decode runs the indexed paged-attention
kernel over exactly those rows. Queries whose complete blocks fit the budget attend densely through
the dense kernels.

Prefill selects per query, in query chunks, and keeps its memory proportional to the selection:
  - scoring: at most SCORE_BYTES (128 MiB) of [queries, blocks] fp32 scores per chunk (the chunk
    shrinks as the context grows) and as much again of per-head products (`block_scores` slices
    the blocks); top-k adds one masked copy of the scores. At the H200 shape (indexer 16 x 128,
    c = 4) and 1M tokens: 128 queries per chunk, 16K-block slices, ~350 MiB at peak with the
    gathered block keys (64 MiB); the one-shot einsum of a 512-query chunk was 8 GiB.
  - attention over contexts above GATHER_MIN_CONTEXT: each query reads its own <= budget + c - 1
    selected rows straight from the paged cache (store_kv already wrote the chunk's rows) through the
    indexed decode kernel, one query per row (`sparse_attention`; CPU: its reference). Its split
    buffers are [queries, Hq, <= 17, D] fp32 at budget 2048: <= 136 MiB for 512 queries at 16 x 256.
    Over the host tier the context is read back once ([L, Hkv, D], 2 GiB at 1M tokens for K + V) as
    the dense prefix read always was; the masked path repeated it over the query group (16 GiB).
  - shorter contexts keep `masked_attention` (SDPA with a [queries, context] mask and K/V repeated
    over the query group: <= 128 MiB at 8K tokens, one fused call).
What remains: a fused block-sparse prefill kernel on GPU (scores + top-k + attention over the picked
blocks in one pass, sharing a block's K/V tile across the queries that picked it), and reading only
the picked rows back from the host tier instead of the whole prefix.
"""
import torch

from sketchkv.engine.context import get_context
from sketchkv.layers.attention import Attention
from sketchkv.ops.qsa import (SCORE_BYTES, block_scores, masked_attention, pool_raw_keys, positions_to_mask,
                               select_blocks, select_positions)
from sketchkv.ops.qsa_score import qsa_block_scores, use_kernel
from sketchkv.ops.sparse_attention import sparse_attention

PREFILL_QUERY_CHUNK = 512  # queries selected (and attended) together in sparse prefill, at most
# Above this context a prefill chunk gathers each query's selected rows instead of masking the whole
# context: below it the masked path's temporaries (K/V repeated over the query group, 16 KiB per token
# at 16 x 256 bf16) stay <= 128 MiB and SDPA is one call; above it they grow with the context.
GATHER_MIN_CONTEXT = 8192


class IndexedAttention(Attention):
    verify_shared = False   # every verification row selects for its own position

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, index_dim: int,
                 budget: int, ratio: int, finish_block_keys):
        super().__init__(num_heads, num_kv_heads, head_dim, scale)
        self.index_dim, self.budget, self.ratio = index_dim, budget, ratio
        self.block_topk = budget // ratio
        # Every query with at most block_topk complete blocks selects every token: dense.
        self.dense_threshold = budget + ratio - 1
        self.finish_block_keys = finish_block_keys  # (pooled [G, D], first positions [G]) -> block keys
        # Bound by the model runner:
        self.block_size = 0
        self.index_keys = torch.tensor([])  # [num_blocks * block_size // c + 1, D]; last row: dump
        self.index_tail = torch.tensor([])  # [num_state_slots, c, D] raw keys of the incomplete block
        self.last_indices = None            # picks of the last sparse decode (tests, stats)
        self._index_q = self._sel_q = None  # this step's index queries (all rows / decode rows)

    # ---- index keys ----------------------------------------------------------------------------
    def key_rows(self, block_tables: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
        """Row in `index_keys` of the block starting at token `first` (block_tables [B, W], first [B, G])."""
        bs, c = self.block_size, self.ratio
        blk = block_tables.long().clamp_min(0).gather(1, torch.div(first, bs, rounding_mode="floor"))
        return blk * (bs // c) + torch.div(first % bs, c, rounding_mode="floor")

    def write_index_keys(self, index_k: torch.Tensor, ctx) -> None:
        c, dt = self.ratio, self.index_tail.dtype
        index_k = index_k.to(dt)
        if ctx.is_decode:  # vectorised, no host sync
            slots, p = ctx.state_slots, ctx.seq_lens.long() - 1
            self.index_tail[slots, p % c] = index_k
            first = (p - c + 1).clamp_min(0)
            keys = self.finish_block_keys(pool_raw_keys(self.index_tail[slots]), first)
            done = (p + 1) % c == 0
            rows = self.key_rows(ctx.block_tables, first[:, None])[:, 0]
            rows = torch.where(done, rows, self.index_keys.shape[0] - 1)
            self.index_keys.index_copy_(0, rows, keys.to(dt))
            return
        end = 0
        for b, (n, cached) in enumerate(zip(ctx.query_lens, ctx.context_lens)):
            start, end = end, end + n
            slot = ctx.state_slots[b]
            r = cached % c
            raw = torch.cat([self.index_tail[slot, :r], index_k[start:end]]) if r else index_k[start:end]
            G = raw.shape[0] // c
            if G:
                first = cached - r + c * torch.arange(G, device=raw.device)
                keys = self.finish_block_keys(pool_raw_keys(raw[:G * c].view(G, c, -1)), first)
                rows = self.key_rows(ctx.block_tables[b:b + 1], first[None])[0]
                self.index_keys.index_copy_(0, rows, keys.to(dt))
            rem = raw[G * c:]
            if rem.shape[0]:
                self.index_tail[slot, :rem.shape[0]] = rem

    # ---- forward -------------------------------------------------------------------------------
    def forward(self, q, k, v, index_q=None, index_k=None) -> torch.Tensor:
        """q [T, Hq, D], k / v [T, Hkv, D]; index_q [T, Hi, Di] (normed, RoPE'd), index_k [T, Di] raw."""
        ctx = get_context()
        self.write_index_keys(index_k, ctx)  # before selection: a query's own block may be complete
        self._index_q = index_q
        self._sel_q = index_q if ctx.is_decode else (index_q[ctx.decode_rows] if ctx.decode_rows is not None
                                                     else None)
        try:
            return super().forward(q, k, v)
        finally:
            self._index_q = self._sel_q = None

    def selection_query(self, q: torch.Tensor) -> torch.Tensor:
        """The query the selector scores with, for the decode rows `q` belongs to: the index queries."""
        return self._sel_q

    def select(self, q, block_tables, seq_lens, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The selector interface (as `SparseAttention.select`): q = index queries of the decode rows
        [B, Hi, Di] -> positions [B, 1, N] (ascending, SENTINEL-padded; shared by all KV heads) and
        counts [B]. Shapes depend on max_len only (CUDA-graph friendly). GPU: one kernel scores the blocks
        straight from `index_keys` and the deterministic top-k picks (same picks up to exact ties); CPU:
        the PyTorch reference, bitwise transformers' indexer (tests/test_qwen4_exp.py)."""
        c = self.ratio
        G = max_len // c
        if use_kernel(q):
            scores = qsa_block_scores(q, self.index_keys, block_tables, seq_lens, G, c, self.block_size)
            idx, counts = select_blocks(scores, seq_lens, self.block_topk, c)
            return idx[:, None], counts
        first = c * torch.arange(G, device=q.device)
        rows = self.key_rows(block_tables, first[None].expand(block_tables.shape[0], -1))
        scores = block_scores(q, self.index_keys[rows])
        idx, counts = select_positions(scores, seq_lens, self.block_topk, c)
        return idx[:, None], counts

    def decode(self, q, block_tables, seq_lens, sparse: bool, graph: bool, max_seq_len: int) -> torch.Tensor:
        if not graph and max_seq_len <= self.dense_threshold:  # every row selects every token
            return super().decode(q, block_tables, seq_lens, sparse, graph, max_seq_len)
        max_len = block_tables.shape[1] * self.block_size if graph else max_seq_len
        idx, counts = self.select(self.selection_query(q), block_tables, seq_lens, max_len)
        self.last_indices = (idx, counts)
        return sparse_attention(q, self.k_cache, self.v_cache, block_tables, idx, counts, self.scale)

    def prefill(self, q, k, v, block_table, cached: int, rows: slice) -> torch.Tensor:
        n, c = q.shape[0], self.ratio
        L = cached + n
        if L // c <= self.block_topk:
            return super().prefill(q, k, v, block_table, cached, rows)
        gather = L > GATHER_MIN_CONTEXT
        if gather:
            k_src, v_src, table = self.selected_kv_source(block_table, cached, k, v)
        else:
            kb, vb = (k, v) if cached == 0 else self.context_kv(block_table, cached, k, v)
        iq = self._index_q[rows]
        G = L // c
        first = c * torch.arange(G, device=q.device)
        keys = self.index_keys[self.key_rows(block_table[None], first[None])[0]]  # [G, Di]
        # [chunk, G] fp32 scores within SCORE_BYTES: fewer queries per chunk past 64K blocks (256K tokens)
        chunk = max(1, min(PREFILL_QUERY_CHUNK, SCORE_BYTES // (4 * G)))
        out = torch.empty_like(q)
        for i in range(0, n, chunk):
            j = min(n, i + chunk)
            visible = cached + torch.arange(i, j, device=q.device) + 1
            scores = block_scores(iq[i:j], keys, max_bytes=SCORE_BYTES)
            idx, counts = select_positions(scores, visible, self.block_topk, c)
            del scores
            if gather:  # each query is its own row with its own picks (all visible: causal by selection)
                out[i:j] = sparse_attention(q[i:j], k_src, v_src, table.expand(j - i, -1), idx[:, None], counts,
                                            self.scale)
            else:  # keys beyond the chunk's last query are never visible: mask over the prefix that matters
                Lc = cached + j
                out[i:j] = masked_attention(q[i:j], kb[:Lc], vb[:Lc], positions_to_mask(idx, Lc), self.scale)
        return out

    def selected_kv_source(self, block_table, cached: int, k, v):
        """Paged (k_cache, v_cache, block_table [W]) that holds a prefill chunk's whole context, for the
        gather path: the paged cache itself, no copy (store_kv wrote the chunk's own rows first)."""
        return self.k_cache, self.v_cache, block_table

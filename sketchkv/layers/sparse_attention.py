"""Sparse decode attention: the same interface as `Attention`, reading only the rows that matter.

Each decode step: project the queries through the frozen key basis, score every cached token
through its int4 sketch, combine the query heads (`head_combine`: by default the sum of each head's
softmax over the candidates, i.e. estimated attention mass, which scores every query head; or the
seed's sum of raw scores, one dot per KV head with the summed query group), take the top k
(deterministic), add the first `sink_tokens` and the last
`recent_tokens`, and run exact softmax attention over exactly those rows. Prefill is dense
(and writes the sketches), except with `prefill_selection=chunk` (`auto` over the host tier): a prompt chunk over a cached prefix
longer than the dense threshold selects once for the whole chunk (up to CHUNK_SELECT_ROWS of its rows'
queries, evenly spaced and the last one included, scored as extra query heads of one row: with the softmax
combine a token scores by the attention mass those rows would give it) and attends the sinks, those picks,
the recent tokens before the chunk and the chunk itself (causal); only those prefix rows are read (over
the host tier: picked rows instead of the whole prefix). A sequence whose context fits in sinks + top_k +
recent selects all of its tokens, so the sparse path then gives the dense result. The first `dense_layers`
full-attention layers decode densely (over the host tier: their selection is every token); with `miss_estimate`
each layer keeps, per step, the share of the candidates' estimated attention mass its picks left out.
"""
import torch

from sketchkv.config import SparseConfig
from sketchkv.engine.context import get_context
from sketchkv.layers.attention import Attention
from sketchkv.ops.selection import SENTINEL, compose_selection, select_top_k
from sketchkv.ops.sketch import exact_key_scores, project_queries, sketch_score, sketch_write
from sketchkv.ops.sketch_base import apply_sketch_base
from sketchkv.ops.prefill_attention import prefix_causal_attention
from sketchkv.ops.sparse_attention import sparse_attention
from sketchkv.ops.topk import radix_hist_buffer, topk_positions
from sketchkv.parallel.comm import reduce_selection_scores

CHUNK_SELECT_ROWS = 16   # prefill_selection=chunk: rows of a prompt chunk whose queries choose its picks


def missed_mass_estimate(log_mass: torch.Tensor, picks: torch.Tensor) -> torch.Tensor:
    """The share of the candidates' estimated attention mass the picks leave out, per row: log_mass [B, H, N] (the
    softmax combine's log of the summed per-head probabilities; -inf = not a candidate), picks [B, H, k] ->
    [B] fp32 in [0, 1], mean over the selection heads. Sinks and the recent window are not candidates, so this
    is the missed share of the candidates' mass, an upper bound on the missed share of the whole attention."""
    N = log_mass.shape[-1]
    lm = log_mass.float()
    total = torch.logsumexp(lm, -1)
    got = lm.gather(-1, picks.long().clamp(max=N - 1)).masked_fill(picks == SENTINEL, float("-inf"))
    miss = 1 - torch.exp(torch.logsumexp(got, -1) - total)
    return torch.nan_to_num(miss, nan=0.0).clamp(0, 1).mean(-1)


class SparseAttention(Attention):
    def __init__(self, dense: Attention, cfg: SparseConfig, basis: torch.Tensor, mean: torch.Tensor,
                 dense_threshold: int):
        super().__init__(dense.num_heads, dense.num_kv_heads, dense.head_dim, dense.scale)
        self.cfg = cfg
        self.dense_threshold = dense_threshold  # contexts up to this decode dense
        self.basis = basis            # [Hkv, D, r]
        self.mean = mean              # [Hkv, D]
        self.rank = basis.shape[-1]
        # Bound by the model runner, paged like the KV cache:
        self.sketch = torch.tensor([])        # [num_blocks, block_size, Hkv, r // 2] uint8
        self.sketch_scale = torch.tensor([])  # [num_blocks, block_size, Hkv] fp16
        self.last_indices = None              # picks of the last decode step (for tests and stats)
        self.last_miss_estimate = None        # [B] (sparse miss_estimate): the candidates' mass the picks missed
        # miss_estimate: the last decode step's estimate per decode row, -1 where the layer read every token. Persistent
        # (written with copy_), so a CUDA graph's replay updates it; the engine reads it after the step's sampling.
        self.miss_rows = torch.empty(0)
        self.layer = -1                       # index among the full-attention layers (set by the model runner)
        self.tensor_parallel = False          # our heads are one rank's share (parallel/tensor_parallel.py)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.write_sketches(k)
        return super().forward(q, k, v)

    def write_sketches(self, k: torch.Tensor) -> None:
        """The new tokens' sketches at their cache slots."""
        sketch_write(k, self.mean, self.basis, self.sketch, self.sketch_scale, get_context().slot_mapping)

    def with_sketch_base(self, x: torch.Tensor, slots: torch.Tensor, sign: int, out=None, hits=None,
                         pool_slots=None) -> torch.Tensor:
        """x [N, Hkv, D] +/- what the sketches at cache slots [N] rebuild of their keys (mean + basis x dequantised
        coefficients; rows without a slot unchanged; hits / pool_slots: see ops.sketch_base.row_slots). The host
        tier's residual keys (sparse host_residual_keys) store k - that (sign -1) and add it back when read (+1)."""
        return apply_sketch_base(x, slots, *self.sketch_base_args(), sign, out, hits, pool_slots)

    def sketch_base_args(self) -> tuple:
        """(sketch, scale, mean, basis): what the decode kernel takes to add the keys' sketch base to its scores."""
        return self.sketch, self.sketch_scale, self.mean, self.basis

    @property
    def dense_layer(self) -> bool:
        """One of the first `dense_layers` full-attention layers: decodes over every token."""
        return 0 <= self.layer < self.cfg.dense_layers

    def decode(self, q, block_tables, seq_lens, sparse: bool, graph: bool, max_seq_len: int) -> torch.Tensor:
        if not sparse or self.dense_layer:
            if self.cfg.miss_estimate and get_context().verify is None:
                self.record_miss(None, q.shape[0])
            return super().decode(q, block_tables, seq_lens, sparse, graph, max_seq_len)
        # in a CUDA graph the shapes must not depend on this step's lengths
        max_len = block_tables.shape[1] * self.k_cache.shape[1] if graph else max_seq_len
        idx, counts = self.select(q, block_tables, seq_lens, max_len)
        self.last_indices = (idx, counts)
        groups = self.verify_groups(get_context())
        if groups is not None:  # one read of each sequence's rows for all of its verification rows
            block_tables, idx = block_tables[groups[1]], idx[groups[1]]
        return sparse_attention(q, self.k_cache, self.v_cache, block_tables, idx, counts, self.scale, groups)

    def selection_query(self, q: torch.Tensor) -> torch.Tensor:
        """The query the selector scores with (the selector interface; QSA layers use their index queries)."""
        return q

    def pick(self, q, block_tables, seq_lens, max_len: int) -> torch.Tensor:
        """The top-k positions by the selector's scores (sinks and recent excluded): [B, Hsel, k]."""
        B = q.shape[0]
        G = self.num_heads // self.num_kv_heads
        return self.pick_grouped(q.view(B, self.num_kv_heads, G, self.head_dim), block_tables, seq_lens, max_len)

    def pick_grouped(self, qg, block_tables, seq_lens, max_len: int) -> torch.Tensor:
        """pick for queries grouped by KV head, [B, Hkv, G, D] (G: any number of query vectors per KV head).
        With the sum combine, scores are linear in q: one dot per KV head with the group's sum."""
        c = self.cfg
        if self.dense_layer:   # every candidate (over the host tier: a dense layer reads all of its rows)
            B, Hsel = qg.shape[0], 1 if c.shared_selection else self.num_kv_heads
            t = c.sink_tokens + torch.arange(max_len, dtype=torch.int32, device=qg.device)   # compacted, ascending
            cand = t[None] < seq_lens[:, None].to(torch.int32) - c.recent_tokens
            return torch.where(cand, t, SENTINEL)[:, None].expand(B, Hsel, max_len).contiguous()
        scores, hist = self.selection_scores(qg, block_tables, seq_lens, max_len)
        picks = topk_positions(scores, min(c.top_k, max_len), SENTINEL, hist=hist)
        if c.miss_estimate:
            self.last_miss_estimate = missed_mass_estimate(scores if c.head_combine == "softmax" else scores * self.scale,
                                                           picks)
        return picks

    def selection_scores(self, qg, block_tables, seq_lens, max_len: int):
        """The selector's scores of every position for queries grouped by KV head [B, Hkv, G, D] -> (scores
        [B, Hsel, max_len], -inf at sinks, recent and beyond the sequence; top-k's first radix round counted by
        the scoring kernels, or None)."""
        c = self.cfg
        hist = None   # top-k's first radix round, counted by the scoring kernels as they write the scores
        if c.selector == "exact":  # the oracle: full keys instead of the sketch (evaluation)
            qg = qg.float()
            if c.head_combine == "sum":
                qg = qg.sum(2, keepdim=True)
            scores = exact_key_scores(qg, self.k_cache, block_tables, seq_lens, c.sink_tokens, c.recent_tokens,
                                      max_len, c.shared_selection, c.head_combine, self.scale)
        else:
            if not (self.tensor_parallel and c.shared_selection):   # (reduced across ranks after the kernels: no count)
                hist = radix_hist_buffer(qg.shape[0] * (1 if c.shared_selection else self.num_kv_heads), qg.device)
            qp = project_queries(qg, self.basis, c.head_combine == "sum")
            # the sampled normalizer: decode rows (a prompt chunk's selection scores hundreds of query heads per KV
            # head: too many for the one-pass kernel's registers; it stores them and combines exactly)
            lse_stride = c.softmax_lse_stride if qg.shape[2] <= 32 else 0
            scores = sketch_score(qp, self.sketch, self.sketch_scale, block_tables, seq_lens, c.sink_tokens,
                                  c.recent_tokens, max_len, c.shared_selection, c.head_combine, self.scale,
                                  kernel=c.score_kernel, radix_hist=hist, lse_stride=lse_stride,
                                  lse_min_samples=c.softmax_lse_min_samples)
        if self.tensor_parallel and c.shared_selection:  # one pick for all KV heads: add in the other ranks' heads
            scores = reduce_selection_scores(scores, c.head_combine)
        return scores, hist

    # ---- prefill_selection=chunk ------------------------------------------------------------------------
    def prefill(self, q, k, v, block_table, cached: int, rows: slice) -> torch.Tensor:
        if self.cfg.prefill_selection != "chunk" or cached <= self.dense_threshold:
            return super().prefill(q, k, v, block_table, cached, rows)
        pos = self.chunk_selection(q, block_table, cached)
        kp, vp = self.prefix_rows(block_table, pos, k.dtype)
        return prefix_causal_attention(q, torch.cat([kp, k]).to(q.dtype), torch.cat([vp, v]).to(q.dtype), self.scale,
                                       self.prefill_backend)

    def chunk_selection(self, q, block_table, cached: int) -> torch.Tensor:
        """Positions (ascending, all < cached) a prompt chunk attends in its prefix: sinks, the top-k picks of
        up to CHUNK_SELECT_ROWS of its rows' queries taken as query heads of one row, the recent tokens."""
        c, n = self.cfg, q.shape[0]
        G = self.num_heads // self.num_kv_heads
        rows = torch.linspace(0, n - 1, min(n, CHUNK_SELECT_ROWS), device=q.device).round().long()
        qg = q[rows].float().view(-1, self.num_kv_heads, G, self.head_dim).transpose(0, 1)
        qg = qg.reshape(1, self.num_kv_heads, -1, self.head_dim)                  # [1, Hkv, rows x G, D]
        bs = self.sketch.shape[1]
        tables, lens = block_table[None], torch.tensor([cached], dtype=torch.int32, device=q.device)
        picks = self.pick_grouped(qg, tables, lens, -(-cached // bs) * bs)
        idx, counts = compose_selection(picks, lens, lens, c.sink_tokens, c.recent_tokens)   # one set: shared selection
        return idx[0, 0, :int(counts[0])].long()

    def prefix_rows(self, block_table, pos, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of the sequence's tokens at `pos`, [N, Hkv, D] each (from the paged cache; the host tier reads its rows)."""
        bs = self.k_cache.shape[1]
        blk = block_table.long()[pos // bs]
        return self.k_cache[blk, pos % bs].to(dtype), self.v_cache[blk, pos % bs].to(dtype)

    verify_extra = 0  # drafts per verification step, with verify_selection=shared (set by the model runner)

    @property
    def verify_shared(self) -> bool:
        """Verification rows of a sequence attend to nested sets (see select): the host tier reads them once."""
        return self.cfg.verify_selection == "shared"

    def verify_groups(self, ctx):
        """The decode kernel's row_groups in a verification step with one selection per sequence (its rows
        attend to prefixes of its last row's list), else None."""
        if ctx.verify_leaders is None or not self.verify_shared:
            return None
        return ctx.verify_leaders, ctx.verify_lasts, ctx.verify_group, self.verify_extra + 1

    def select(self, q, block_tables, seq_lens, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """-> token positions [B, Hsel, S + k + R] sorted ascending (SENTINEL-padded) and counts [B]. In a
        verification step with verify_selection=shared, only each sequence's first row scores and picks; every
        row of the sequence takes those picks, the sinks and the tokens from the first row's recent window up
        to its own position ([B, Hsel, S + k + R + n])."""
        c, ctx = self.cfg, get_context()
        group = ctx.verify_group if c.verify_selection == "shared" else None
        if group is not None:
            lead = ctx.verify_leaders
            picks = self.pick(q[lead], block_tables[lead], seq_lens[lead], max_len)[group]
            return compose_selection(picks, seq_lens, seq_lens[lead][group], c.sink_tokens, c.recent_tokens,
                                     self.verify_extra)
        if not c.miss_estimate and not self.dense_layer:   # top-k's compaction writes the composed rows
            B, G = q.shape[0], self.num_heads // self.num_kv_heads
            scores, hist = self.selection_scores(q.view(B, self.num_kv_heads, G, self.head_dim),
                                                 block_tables, seq_lens, max_len)
            return select_top_k(scores, min(c.top_k, max_len), seq_lens, c.sink_tokens, c.recent_tokens, hist)
        picks = self.pick(q, block_tables, seq_lens, max_len)
        if c.miss_estimate and ctx.verify is None:   # (verification steps are not recorded)
            self.record_miss(None if self.dense_layer else self.last_miss_estimate, q.shape[0])
        return compose_selection(picks, seq_lens, seq_lens, c.sink_tokens, c.recent_tokens)

    def record_miss(self, est: torch.Tensor | None, rows: int) -> None:
        """This decode step's missed-mass estimate [rows] into `miss_rows` (None: every token read, -1). The buffer
        grows only outside a CUDA-graph capture: graphs captured before a growth would write the old one (the runner
        captures its largest decode batch first, eagerly warmed up, so that growth happens before any capture)."""
        if self.miss_rows.shape[0] < rows or self.miss_rows.device != self.basis.device:
            if self.basis.is_cuda and torch.cuda.is_current_stream_capturing():
                raise RuntimeError("sparse miss_estimate: the estimate buffer would grow inside a CUDA-graph capture")
            self.miss_rows = torch.full((rows,), -1.0, device=self.basis.device)
        if est is None:
            self.miss_rows[:rows].fill_(-1.0)
        else:
            self.miss_rows[:rows].copy_(est)

"""The MTP drafter's attention over a window of its context, with its K/V in a ring per state slot
(EngineConfig.mtp_attention_window = W > 0; 0 keeps the trained dense attention over paged K/V).

The drafter's one attention layer read its whole KV on every draft step (8 GB per draft step at 8 x 250K
agents of the 27B shape, ~14 ms of H200 run 35's 76 ms verification step) and kept 1.05 GB of K/V per
250K-token agent, more than the host tier leaves of the target's. Drafts only propose: the verification
decides every token, so a narrower drafter changes the acceptance rate, never the output.

Keys a drafter row at position p attends:
  decode rows (drafting, the catch-up after verification): the first S tokens and the last W, p included
    (positions max(S, p + 1 - W) .. p), as a decode row of the target would with no picks;
  prompt-chunk rows (the catch-up over a prompt chunk starting at c0): the first S, the W - 1 tokens before
    the chunk and the chunk up to p (causal), i.e. a window of at least W.
So the layer keeps only sinks + a ring of the recent rows per state slot, like the host tier's resident rows:
  k_cache / v_cache [num_state_slots * width + block_size, Hkv, D] viewed as blocks of block_size rows,
  width = S + ring (a multiple of the block size), the last block a dump for rows not kept. Token p of the
  sequence in slot s lives at row s * width + p (p < S) or s * width + S + p % ring. ring >= W + n + 1 (n
  drafts): a verification step's drafts write up to n rows past the accepted length, which must not reach
  the window of the next step's rows. 17 MB per slot at W = 4,096 for the 27B shape, whatever the context.
Prompt rows attend before they are stored (a chunk longer than the ring would overwrite its own window);
decode rows are stored first (their own K/V are in their window). The ring is per-sequence state: it goes
into the prefix cache's snapshots with the GDN state (ModelRunner.slot_states), so a follow-up turn that
starts from a cached prefix drafts from the same window as the turn that wrote it.
"""
import torch

from sketchkv.engine.context import get_context
from sketchkv.layers.attention import Attention
from sketchkv.ops.prefill_attention import prefix_causal_attention
from sketchkv.ops.selection import compose_selection
from sketchkv.ops.sparse_attention import sparse_attention


MTP_WINDOW_SINKS = 64   # first tokens a windowed MTP drafter always attends (EngineConfig.mtp_attention_window)


def ring_width(sinks: int, window: int, num_drafts: int, block_size: int) -> int:
    """Rows one state slot's ring holds (sinks included): sinks + W + n + 1, rounded up to blocks."""
    return -(-(sinks + window + num_drafts + 1) // block_size) * block_size


class WindowedAttention(Attention):
    def __init__(self, dense: Attention, sinks: int, window: int, num_drafts: int, block_size: int):
        super().__init__(dense.num_heads, dense.num_kv_heads, dense.head_dim, dense.scale)
        self.sinks, self.window, self.block_size = sinks, window, block_size
        self.width = ring_width(sinks, window, num_drafts, block_size)
        self.ring = self.width - sinks
        self.prefill_backend = dense.prefill_backend

    # ---- per-slot state (ModelRunner: allocation, accounting, prefix-cache snapshots) -----------------
    def allocate_ring(self, num_slots: int, dtype: torch.dtype, device) -> None:
        shape = (num_slots * self.width + self.block_size, self.num_kv_heads, self.head_dim)
        self.k_cache = torch.zeros(shape, dtype=dtype, device=device)   # zeros: never NaN, even where unwritten
        self.v_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.dump_row = num_slots * self.width

    def ring_bytes(self, dtype: torch.dtype) -> int:
        """GPU bytes per state slot (K and V)."""
        return 2 * self.width * self.num_kv_heads * self.head_dim * dtype.itemsize

    def slot_state(self, slot: int) -> list[torch.Tensor]:
        rows = slice(slot * self.width, (slot + 1) * self.width)
        return [self.k_cache[rows], self.v_cache[rows]]

    def rows(self, slots: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Ring row of token `pos` of the sequence in state slot `slots` (elementwise, device tensors)."""
        pos = pos.long()
        return slots.long() * self.width + torch.where(pos < self.sinks, pos, self.sinks + pos % self.ring)

    # ---- forward ----------------------------------------------------------------------------------------
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        ctx = get_context()
        if ctx.is_decode:
            return self._decode_rows(q, k, v, ctx.state_slots, ctx.seq_lens)
        out = torch.empty_like(q)
        if ctx.decode_rows is not None:
            r = ctx.decode_rows
            lens = ctx.decode_lens if ctx.decode_lens is not None else ctx.seq_lens[ctx.decode_seqs]
            out[r] = self._decode_rows(q[r], k[r], v[r], ctx.state_slots[ctx.decode_seqs], lens)
        end = 0
        for b, (n, c0) in enumerate(zip(ctx.query_lens, ctx.context_lens)):
            start, end = end, end + n
            if not ctx.decodes(b):
                out[start:end] = self._prompt_chunk(q[start:end], k[start:end], v[start:end], ctx.state_slots[b], c0)
        return out

    def _decode_rows(self, q, k, v, slots, lens) -> torch.Tensor:
        """One row per entry of `slots` / `lens` (row at position lens - 1): store, then attend."""
        self._store(self.rows(slots, lens - 1), k, v)
        no_picks = torch.empty(q.shape[0], 1, 0, dtype=torch.int32, device=q.device)
        idx, counts = compose_selection(no_picks, lens, lens, self.sinks, self.window)
        idx = torch.where(idx < self.sinks, idx, self.sinks + idx % self.ring).to(torch.int32)
        nb = self.width // self.block_size
        tables = (slots[:, None] * nb + torch.arange(nb, device=q.device)).to(torch.int32)
        blocks = self.k_cache.view(-1, self.block_size, self.num_kv_heads, self.head_dim)
        return sparse_attention(q, blocks, self.v_cache.view_as(blocks), tables, idx, counts, self.scale)

    def _prompt_chunk(self, q, k, v, slot, c0: int) -> torch.Tensor:
        """Rows c0 .. c0 + n - 1 of the sequence in `slot` (a 0-dim device tensor): attend, then store."""
        n, dev = q.shape[0], q.device
        before = torch.cat([torch.arange(min(self.sinks, c0), device=dev),
                            torch.arange(min(c0, max(self.sinks, c0 + 1 - self.window)), c0, device=dev)])
        rows = self.rows(slot, before)
        kb = torch.cat([self.k_cache[rows], k.to(self.k_cache.dtype)])
        vb = torch.cat([self.v_cache[rows], v.to(self.v_cache.dtype)])
        out = prefix_causal_attention(q, kb.to(q.dtype), vb.to(q.dtype), self.scale, self.prefill_backend)
        pos = torch.arange(c0, c0 + n, device=dev)
        keep = (pos < self.sinks) | (pos >= c0 + n - self.ring)   # a longer chunk keeps its last `ring` rows
        self._store(torch.where(keep, self.rows(slot, pos), self.dump_row), k, v)
        return out

    def _store(self, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k_cache.index_copy_(0, rows, k.to(self.k_cache.dtype))
        self.v_cache.index_copy_(0, rows, v.to(self.v_cache.dtype))

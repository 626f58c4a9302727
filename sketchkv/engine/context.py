"""Per-step batch metadata, set by the model runner before a forward and read by the layers.

Models never see paging: a forward takes flat `input_ids` / `positions` of all sequences in the
step (T tokens in total) and the attention and Gated DeltaNet layers find here where each
sequence's tokens, KV blocks and recurrent-state slot are. Every sequence contributes
`query_len >= 1` new tokens (prefill chunk, one decode token, or several draft tokens to verify).
"""
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch


@dataclass
class VerifyRows:
    """A step with draft tokens to verify: Gated DeltaNet layers advance the decoding sequences one
    position at a time on copies of their states, then replay the accepted positions (forward_verify)."""
    # position t: (flat row, state slot, index among the decoding sequences) of each decoding sequence with > t rows;
    # eager regular steps (below) carry only position 0's slots (rows and indices None): their layers need no more
    steps: list[tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | None]]
    other_rows: torch.Tensor | None = None          # rows of the other sequences (prefill chunks), varlen as usual
    other_slots: torch.Tensor | None = None
    other_cu: torch.Tensor | None = None
    # every row belongs to a decoding sequence with exactly `regular` rows, sequence-major (the verification
    # graphs' layout): the layers may view the rows as [sequences, regular] and step all positions at once
    regular: int = 0


@dataclass
class Context:
    cu_seqlens_q: torch.Tensor        # [B+1] int32: sequence b's new tokens are rows cu[b]:cu[b+1]
    seq_lens: torch.Tensor            # [B] int32: tokens in the cache after this step (cached + new)
    slot_mapping: torch.Tensor        # [T] int64: KV-cache slot (block * block_size + offset) per new token
    block_tables: torch.Tensor        # [B, max_blocks] int32, padded with -1
    state_slots: torch.Tensor         # [B] int64: Gated DeltaNet state slot per sequence
    query_lens: list[int]             # host copies, for loops and shapes
    context_lens: list[int]           # tokens already cached before this step, per sequence
    is_decode: bool                   # every sequence has exactly one new token
    max_seq_len: int
    sparse: bool = False              # decode runs sparse attention layers in sparse mode this step
    # Mixed steps only: the one-token rows of running sequences, decoded as a sub-batch
    decode_rows: torch.Tensor | None = None   # [Bd] row of each such sequence's token in the flat batch
    decode_seqs: torch.Tensor | None = None   # [Bd] its index in the batch
    decode_max_len: int = 0
    decode_lens: torch.Tensor | None = None   # [Bd] tokens visible to each decode row (its position + 1); None: seq_lens
    graph: bool = False               # captured in a CUDA graph: shapes must not depend on values
    # Speculative steps: a decoding sequence's draft tokens follow its last token; all its rows are
    # decode rows (causal: row t sees the cache up to its own position)
    num_drafts: list[int] | None = None       # per sequence
    verify: VerifyRows | None = None
    # Verification steps, indexing the rows a layer's decode call gets: each sequence's first row (the host
    # tier admits its misses; with sparse_verify_selection=shared it selects for the sequence), and per row
    # the index of its sequence in verify_leaders
    verify_leaders: torch.Tensor | None = None
    verify_group: torch.Tensor | None = None
    verify_lasts: torch.Tensor | None = None   # each sequence's last row (its positions cover the others')
    # Host tier only
    resident_rows: torch.Tensor | None = None  # [T] int64: row of each new token in the tier's sinks/recent ring
    hot_pids: torch.Tensor | None = None       # [B] int64: hot-buffer partition of each sequence
    # Values of this forward that every layer would otherwise recompute (RoPE cos / sin, layers/rotary.py)
    cache: dict = field(default_factory=dict)

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    def decodes(self, b: int) -> bool:
        """Sequence b's rows are decode rows (one token, or one token plus drafts), not a prompt chunk."""
        return decode_rows(self.context_lens[b], self.query_lens[b], self.num_drafts[b] if self.num_drafts else 0)


def decode_rows(cached: int, query_len: int, drafts: int) -> bool:
    """A sequence's rows in a step are decode rows (one token, or one token plus drafts), not a prompt chunk."""
    return cached > 0 and (query_len == 1 or drafts > 0)


_CONTEXT: Context | None = None


def set_context(ctx: Context | None) -> None:
    global _CONTEXT
    _CONTEXT = ctx


def current_context() -> Context | None:
    """The forward context, or None outside a forward (a model called directly, as the parity tests do)."""
    return _CONTEXT


def get_context() -> Context:
    assert _CONTEXT is not None, "no forward context: the model runner sets it before each forward"
    return _CONTEXT


@contextmanager
def forward_context(ctx: Context):
    """`ctx` for the block, then the context before it again (the drafter's passes run inside steps
    that have their own: a CUDA-graph capture, the runner's forward)."""
    global _CONTEXT
    prev, _CONTEXT = _CONTEXT, ctx
    try:
        yield
    finally:
        _CONTEXT = prev

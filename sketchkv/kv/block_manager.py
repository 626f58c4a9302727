"""Owns the paged KV blocks: a free list and each sequence's block table.

Block 0 is reserved as a scratch block: padded rows of a CUDA-graph decode batch write there.
"""
from collections import deque

from sketchkv.engine.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        assert num_blocks >= 2, "need at least one usable KV block besides the scratch block"
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.free: deque[int] = deque(range(1, num_blocks))

    @property
    def num_free(self) -> int:
        return len(self.free)

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """Extra blocks for `seq` to hold `num_tokens` tokens in total."""
        return max(0, -(-num_tokens // self.block_size) - len(seq.block_table))

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        return self.blocks_needed(seq, num_tokens) <= len(self.free)

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        for _ in range(self.blocks_needed(seq, num_tokens)):
            seq.block_table.append(self.free.popleft())

    def release(self, seq: Sequence) -> None:
        self.free.extend(seq.block_table)
        seq.block_table = []

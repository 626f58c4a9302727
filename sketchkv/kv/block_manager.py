"""Owns the paged KV blocks: free list, reference counts, and the prefix cache.

A full block is identified by a hash chained from the previous block's hash and its token ids
(nano-vllm's scheme); blocks with the same hash chain hold the same K/V (and sketch rows), so
requests and turns that re-send a conversation share them. Freed blocks keep their hash and sit in
an LRU free list: they can be revived by a later match until they are reused for new tokens.
Block 0 is reserved as a scratch block: padded rows of a CUDA-graph decode batch write there.
"""
from collections import OrderedDict

from sketchkv.engine.sequence import Sequence


def chain_hash(prev: int | None, tokens: tuple[int, ...]) -> int:
    return hash((prev, tokens))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        assert num_blocks >= 2, "need at least one usable KV block besides the scratch block"
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(1, num_blocks))  # LRU first
        self.ref = [0] * num_blocks
        self.hash_of: list[int | None] = [None] * num_blocks
        self.tokens_of: dict[int, tuple] = {}        # block -> its tokens, to rule out hash collisions
        self.block_of: dict[int, int] = {}           # hash -> block

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
            b, _ = self.free.popitem(last=False)
            h = self.hash_of[b]
            if h is not None:  # reused for new tokens: its cached content is gone
                del self.block_of[h]
                del self.tokens_of[b]
                self.hash_of[b] = None
            self.ref[b] = 1
            seq.block_table.append(b)

    def shrink(self, seq: Sequence, num_tokens: int) -> None:
        """Free the tail blocks `seq` no longer needs to hold `num_tokens` tokens (blocks grown for
        draft tokens that were rejected; never hashed, so they go to the front of the free list)."""
        keep = -(-num_tokens // self.block_size)
        while len(seq.block_table) > keep:
            b = seq.block_table.pop()
            self.ref[b] -= 1
            if self.ref[b] == 0:
                self.free[b] = None
                self.free.move_to_end(b, last=False)
        seq.table_truncated()

    def release(self, seq: Sequence) -> None:
        for b in reversed(seq.block_table):  # the tail first: prefixes are more likely reused
            self.ref[b] -= 1
            if self.ref[b] == 0:
                self.free[b] = None
        seq.block_table = []
        seq.block_hashes = []

    # ---- prefix cache --------------------------------------------------------------------------
    def register(self, seq: Sequence) -> None:
        """Hash every block of `seq` that is full of computed tokens and not hashed yet."""
        bs = self.block_size
        while len(seq.block_hashes) < seq.num_cached // bs:
            i = len(seq.block_hashes)
            tokens = tuple(seq.token_ids[i * bs:(i + 1) * bs])
            h = chain_hash(seq.block_hashes[-1] if seq.block_hashes else None, tokens)
            seq.block_hashes.append(h)
            b = seq.block_table[i]
            if h not in self.block_of and self.hash_of[b] is None:
                self.block_of[h], self.hash_of[b], self.tokens_of[b] = b, h, tokens

    def match(self, tokens: list[int]) -> list[tuple[int, int]]:
        """(block, hash) of the longest chain of cached full blocks that prefixes `tokens`."""
        bs, out, prev = self.block_size, [], None
        for i in range(len(tokens) // bs):   # one tuple per block, hashed and compared (a 248K prompt: 15.5K)
            chunk = tuple(tokens[i * bs:(i + 1) * bs])
            h = chain_hash(prev, chunk)
            b = self.block_of.get(h)
            if b is None or self.tokens_of[b] != chunk:
                break
            out.append((b, h))
            prev = h
        return out

    def share(self, seq: Sequence, matched: list[tuple[int, int]]) -> None:
        """Give `seq` the matched blocks (as its first blocks) and count them as cached."""
        for b, h in matched:
            if self.ref[b] == 0:
                del self.free[b]
            self.ref[b] += 1
            seq.block_table.append(b)
            seq.block_hashes.append(h)
        seq.num_cached = len(matched) * self.block_size

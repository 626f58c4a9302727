"""Snapshots of a sequence's Gated DeltaNet state at block boundaries, kept in host RAM.

GDN state cannot be rebuilt from KV, so a prefix-cache hit on a hybrid model is usable only up to
a boundary where the state was saved. Keyed by the hash of the block that ends at the boundary;
LRU under a byte budget. Pinned on CUDA machines, so save and restore are plain async copies.
"""
from collections import OrderedDict

import torch


class StateCache:
    def __init__(self, budget_bytes: int, pin: bool):
        self.budget, self.pin = budget_bytes, pin
        self.entries: OrderedDict[int, list[torch.Tensor]] = OrderedDict()
        self.bytes = 0

    def __contains__(self, h: int) -> bool:
        return h in self.entries

    def save(self, h: int, states: list[torch.Tensor]) -> None:
        """states: one sequence's per-layer state rows (on the device); copied to host."""
        if h in self.entries:
            self.entries.move_to_end(h)
            return
        size = sum(s.numel() * s.element_size() for s in states)
        if size > self.budget:
            return
        while self.bytes + size > self.budget:
            _, old = self.entries.popitem(last=False)
            self.bytes -= sum(s.numel() * s.element_size() for s in old)
        host = [torch.empty(s.shape, dtype=s.dtype, pin_memory=self.pin) for s in states]
        for d, s in zip(host, states):
            d.copy_(s, non_blocking=self.pin)
        self.entries[h] = host
        self.bytes += size

    def restore(self, h: int, targets: list[torch.Tensor]) -> None:
        self.entries.move_to_end(h)
        for t, s in zip(targets, self.entries[h]):
            t.copy_(s, non_blocking=self.pin)

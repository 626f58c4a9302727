"""Which data-parallel replica serves a request: session affinity first, then load.

A conversation's later turns re-send everything said so far, and the replica that served the earlier
turns holds that prefix in its prefix cache (and, with the host tier, its K/V in that replica's host
RAM); any other replica would prefill it again from scratch. So, in order:

1. Explicit session key (the `X-Session-ID` header, else the OpenAI `user` field): the replica this
   key went to last time, if that replica is alive.
2. Prefix affinity: the replica that already served the longest prefix of the request's token ids,
   counted in whole `block_size` blocks and identified by chained block hashes (the engine's own
   prefix-cache scheme, `kv.block_manager.chain_hash`). The match must cover at least
   `min_match_tokens` tokens and at least `min_match_fraction` of the prompt: a shared system prompt
   in front of a new document is not a reason to pile every conversation onto one replica.
   Equal matches go to the less loaded replica.
3. Otherwise the least-loaded replica: fewest requests in flight, then fewest prompt tokens waiting
   for prefill, then fewest remembered blocks (a proxy for the cache it holds), then lowest index.

Affinity wins over load on purpose: a missed 250K-token prefix costs a full prefill, far more than an
uneven batch. The router remembers, per replica, at most `max_blocks` block hashes (LRU: the blocks of
recent requests stay) and at most `max_sessions` session keys overall. It is not thread-safe by
itself: callers hold `lock` (the HTTP loop routes; replica reader threads record finished outputs).
"""
import threading
from collections import OrderedDict
from dataclasses import dataclass

from sketchkv.kv.block_manager import chain_hash


@dataclass(frozen=True)
class Load:
    in_flight: int = 0          # requests submitted and not finished
    queued_tokens: int = 0      # prompt tokens of requests that have no output yet
    alive: bool = True


def block_hashes(ids: list[int], block_size: int) -> list[int]:
    """Chained hashes of the full blocks of `ids` (a partial last block has none)."""
    out, prev = [], None
    for i in range(0, len(ids) // block_size * block_size, block_size):
        prev = chain_hash(prev, tuple(ids[i:i + block_size]))
        out.append(prev)
    return out


class Router:
    def __init__(self, num_replicas: int, block_size: int, min_match_tokens: int = 256,
                 min_match_fraction: float = 0.5, max_blocks: int = 1 << 17, max_sessions: int = 1 << 16):
        self.block_size = block_size
        self.min_match_tokens = min_match_tokens
        self.min_match_fraction = min_match_fraction
        self.max_blocks = max_blocks
        self.max_sessions = max_sessions
        self.blocks: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(num_replicas)]
        self.sessions: OrderedDict[str, int] = OrderedDict()
        self.lock = threading.Lock()

    def route(self, ids: list[int], session: str | None, loads: list[Load]) -> tuple[int, str]:
        """(replica index, why: "session" | "prefix" | "load") for a request, and remember it there (so
        the next turn follows even while this one is still running)."""
        hashes = block_hashes(ids, self.block_size)
        i, why = self._choose(hashes, len(ids), session, loads)
        self._remember(i, hashes, session)
        return i, why

    def match(self, replica: int, ids: list[int]) -> int:
        """Tokens of the longest prefix of `ids` (whole blocks) that `replica` has served."""
        return self._matched(replica, block_hashes(ids, self.block_size))

    def record(self, replica: int, ids: list[int], session: str | None = None) -> None:
        """`replica` holds the blocks of `ids` (e.g. a finished request's prompt + output)."""
        self._remember(replica, block_hashes(ids, self.block_size), session)

    def _choose(self, hashes: list[int], num_tokens: int, session: str | None, loads: list[Load]) -> tuple[int, str]:
        alive = [i for i, ld in enumerate(loads) if ld.alive]
        if not alive:
            return 0, "load"     # every replica is down: the caller reports it
        if session is not None and self.sessions.get(session) in alive:
            return self.sessions[session], "session"
        matched = {i: self._matched(i, hashes) for i in alive}
        best = max(matched.values())
        if best and best >= self.min_match_tokens and best >= self.min_match_fraction * num_tokens:
            return self._least_loaded([i for i in alive if matched[i] == best], loads), "prefix"
        return self._least_loaded(alive, loads), "load"

    def _matched(self, replica: int, hashes: list[int]) -> int:
        seen, n = self.blocks[replica], 0
        for h in hashes:
            if h not in seen:
                break
            n += 1
        return n * self.block_size

    def _remember(self, replica: int, hashes: list[int], session: str | None) -> None:
        seen = self.blocks[replica]
        for h in reversed(hashes):   # touched last, a prefix's first blocks are evicted last
            seen[h] = None
            seen.move_to_end(h)
        while len(seen) > self.max_blocks:
            seen.popitem(last=False)
        if session is not None:
            self.sessions[session] = replica
            self.sessions.move_to_end(session)
            while len(self.sessions) > self.max_sessions:
                self.sessions.popitem(last=False)

    def _least_loaded(self, candidates: list[int], loads: list[Load]) -> int:
        return min(candidates, key=lambda i: (loads[i].in_flight, loads[i].queued_tokens, len(self.blocks[i]), i))

"""Data-parallel router (sketchkv/server/router.py): pure Python, no model."""
from sketchkv.server.router import Load, Router, block_hashes

BS = 4


def ids(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 1000 for i in range(n)]


def idle(n: int = 2) -> list[Load]:
    return [Load() for _ in range(n)]


def choose(r: Router, ids: list[int], session, loads) -> tuple[int, str]:
    """Where `ids` would go, without remembering it."""
    return r._choose(block_hashes(ids, r.block_size), len(ids), session, loads)


def test_block_hashes_are_chained_over_full_blocks():
    a = ids(1, 10)
    h = block_hashes(a, BS)
    assert len(h) == 2 and h == block_hashes(a[:8], BS)
    b = list(a)
    b[0] += 1   # a change in block 0 changes every later hash
    assert all(x != y for x, y in zip(h, block_hashes(b, BS)))


def test_next_turn_follows_its_prefix_even_when_that_replica_is_busier():
    r = Router(2, BS, min_match_tokens=8)
    turn1 = ids(1, 40)
    r.record(1, turn1)
    turn2 = turn1 + ids(2, 12)
    assert r.match(1, turn2) == 40 and r.match(0, turn2) == 0
    assert choose(r, turn2, None, [Load(), Load(in_flight=5, queued_tokens=1000)]) == (1, "prefix")


def test_longest_prefix_wins():
    r = Router(2, BS, min_match_tokens=8)
    base = ids(3, 32)
    r.record(0, base[:16])
    r.record(1, base)
    assert choose(r, base + ids(4, 4), None, idle()) == (1, "prefix")


def test_short_or_minor_shared_prefix_goes_by_load():
    r = Router(2, BS, min_match_tokens=16, min_match_fraction=0.5)
    system = ids(5, 12)                     # a shared system prompt shorter than the threshold
    r.record(0, system + ids(6, 40))
    assert choose(r, system + ids(7, 40), None, [Load(in_flight=1), Load()]) == (1, "load")
    long_system = ids(8, 20)                # long enough, but a small part of a new long prompt
    r.record(0, long_system + ids(9, 40))
    assert choose(r, long_system + ids(10, 80), None, [Load(in_flight=1), Load()]) == (1, "load")


def test_explicit_session_key_takes_precedence_over_prefix_and_load():
    r = Router(2, BS, min_match_tokens=8)
    conv = ids(11, 40)
    r.record(0, conv)
    r.record(1, ids(12, 8), session="agent-7")
    assert choose(r, conv + ids(13, 4), "agent-7", [Load(), Load(in_flight=3)]) == (1, "session")
    assert choose(r, conv, "someone-new", idle()) == (0, "prefix")   # unknown key: the usual rules


def test_dead_replica_is_never_chosen():
    r = Router(2, BS, min_match_tokens=8)
    conv = ids(14, 40)
    r.record(1, conv, session="s")
    loads = [Load(in_flight=9), Load(alive=False)]
    assert choose(r, conv, "s", loads) == (0, "load")
    assert choose(r, conv, None, loads) == (0, "load")


def test_least_load_tie_break_order():
    r = Router(3, BS)
    assert choose(r, ids(15, 8), None, [Load(in_flight=2), Load(in_flight=1), Load(in_flight=1)]) == (1, "load")
    assert choose(r, ids(15, 8), None, [Load(1, 500), Load(1, 100), Load(1, 300)]) == (1, "load")
    r.record(0, ids(16, 16))                # equal load: the replica remembering fewer blocks
    assert r.route(ids(17, 8), None, [Load(), Load(), Load()]) == (1, "load")
    assert r.route(ids(18, 8), None, [Load(), Load(), Load()]) == (2, "load")   # route remembers: 1 holds more


def test_route_remembers_so_a_concurrent_next_turn_follows():
    r = Router(2, BS, min_match_tokens=8)
    turn1 = ids(21, 40)
    assert r.route(turn1, None, [Load(in_flight=1), Load()]) == (1, "load")
    assert r.route(turn1 + ids(22, 8), None, [Load(), Load(in_flight=1)]) == (1, "prefix")
    assert r.route(ids(23, 8), "k", idle()) == (0, "load") and r.sessions["k"] == 0


def test_equal_prefix_matches_go_to_the_less_loaded():
    r = Router(2, BS, min_match_tokens=8)
    conv = ids(18, 40)
    r.record(0, conv)
    r.record(1, conv)
    assert choose(r, conv + [1], None, [Load(in_flight=2), Load(in_flight=1)]) == (1, "prefix")


def test_memory_is_bounded_lru_and_keeps_the_prefix_start():
    r = Router(1, BS, min_match_tokens=4, max_blocks=6, max_sessions=2)
    a = ids(19, 40)                         # 10 blocks: only 6 kept, the first ones
    r.record(0, a)
    assert len(r.blocks[0]) == 6 and r.match(0, a) == 24
    for s in ("x", "y", "z"):
        r.record(0, [], session=s)
    assert list(r.sessions) == ["y", "z"]
    b = ids(20, 24)                         # newer blocks push out older ones
    r.record(0, b)
    assert len(r.blocks[0]) == 6 and r.match(0, b) == 24 and r.match(0, a) == 0

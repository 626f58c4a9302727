"""A graph decode step's inputs (ModelRunner._stage_decode): built on the host in the pinned twins of the graph's
static buffers and copied in two transfers. On CPU the graphs run eagerly (the eager_graphs fixture): the tokens equal
eager decoding, and the static buffers hold what the per-tensor writes of the old _replay held, padded rows included."""
import random

import pytest
import torch

from sketchkv import LLM, SamplingParams
from sketchkv.engine import model_runner
from sketchkv.engine.sequence import Sequence

MODES = {"dense": {},
         "sparse": dict(sparse=True, sparse_top_k=16, sparse_sink_tokens=4, sparse_recent_tokens=8,
                        sparse_dense_threshold=0),
         "tier": dict(sparse=True, sparse_top_k=16, sparse_sink_tokens=4, sparse_recent_tokens=8,
                      sparse_dense_threshold=0, sparse_host_tier=True, sparse_host_format="bf16")}


def _llm(mode: str, **kw) -> LLM:
    return LLM("random:tiny-hybrid", device="cpu", block_size=16, max_num_seqs=8, max_model_len=2048,
               **MODES[mode], **kw)


@pytest.fixture
def short_length_buckets(monkeypatch):
    """Decode graphs of sparse models for 256, 512, 1024 and 2048 tokens (16 ... 128 blocks of 16)."""
    monkeypatch.setattr(model_runner, "FIRST_LENGTH_BUCKET", 256)


@pytest.mark.parametrize("mode", list(MODES))
def test_graph_decode_gives_the_eager_tokens(mode, eager_graphs, short_length_buckets):
    """Five sequences of different lengths (a batch bucket of 8: three padded rows; for sparse models the length
    bucket grows as they decode past 256 tokens): greedy tokens equal eager decoding."""
    rng = random.Random(list(MODES).index(mode))
    prompts = [[rng.randrange(3, 1000) for _ in range(n)] for n in (250, 37, 120, 5, 241)]
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    ref = [o.token_ids for o in _llm(mode, enforce_eager=True).generate(prompt_token_ids=prompts, sampling_params=sp)]
    llm = _llm(mode)
    r = eager_graphs(llm.engine.runner)
    got = [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=sp)]
    assert got == ref
    used = {k for k, g in r.graphs.items() if type(g).count}
    assert 8 in {b for _, b, _ in used}, used   # five sequences in the bucket of 8
    if mode != "dense":   # the 256-token graphs, then the 512-token ones once the longest prompts pass 256
        assert {nb for _, _, nb in used} == {16, 32}, used


def _old_replay_writes(r, batch, key):
    """What the per-tensor writes of the former ModelRunner._replay left in the static buffers' first `bucket` rows:
    padded rows, then the eager context's tensors (block tables: -1 padding clamped to 0). -> (those, the key the
    former _graph_key chose, the eager context)"""
    ids, pos, ctx = r._context(batch)
    bs, bucket, nb = len(batch), key[1], key[2]
    full = lambda v, dt=torch.int64: torch.full((bucket,), v, dtype=dt)
    want = {"ids": full(0), "pos": full(0), "slot_mapping": full(0), "tables": torch.zeros(bucket, nb, dtype=torch.int32),
            "seq_lens": full(1, torch.int32), "state_slots": full(r.scratch_slot)}
    want["ids"][:bs], want["pos"][:bs], want["slot_mapping"][:bs] = ids, pos, ctx.slot_mapping
    want["tables"][:bs, :ctx.block_tables.shape[1]] = ctx.block_tables.clamp_min(0)
    want["seq_lens"][:bs], want["state_slots"][:bs] = ctx.seq_lens, ctx.state_slots
    if r.tier is not None:
        want["resident_rows"], want["hot_pids"] = full(r.tier.dump_row), full(r.tier.pad_pid)
        want["resident_rows"][:bs], want["hot_pids"][:bs] = ctx.resident_rows, ctx.hot_pids
    # the key the former _graph_key chose from the eager context
    need = max(ctx.block_tables.shape[1], -(-ctx.max_seq_len // r.block_size))
    old_key = min([k for k in r.graphs if k[0] == ctx.sparse and k[1] >= ctx.num_seqs and k[2] >= need],
                  key=lambda k: (k[1], k[2]))
    return want, old_key, ctx


def _static(r, key) -> dict[str, torch.Tensor]:
    bucket, nb = key[1], key[2]
    got = {"ids": r.g_ids, "pos": r.g_pos, "slot_mapping": r.g_slot_mapping, "tables": r.g_tables[nb],
           "seq_lens": r.g_seq_lens[nb], "state_slots": r.g_state_slots}
    if r.tier is not None:
        got["resident_rows"], got["hot_pids"] = r.g_resident_rows, r.g_hot_pids
    return {k: v[:bucket].clone() for k, v in got.items()}


@pytest.mark.parametrize("mode", ["dense", "tier"])
def test_staged_inputs_equal_the_former_per_tensor_writes(mode, eager_graphs, short_length_buckets):
    """Steps of 7, then 5 (the rows they left become padding), then 2 decoding sequences (a smaller batch and
    length bucket), with garbage in every static buffer before each: the first `bucket` rows of each buffer equal
    the former writes, the graph key the former key, the returned context the eager one's step facts."""
    llm = _llm(mode)
    r = llm.engine.runner
    if r.tier is not None:   # padded rows' empty partition is the tier's first (0): one that a zero pad would miss
        r.tier.pad_pid = r.tier.hot.add_sequence(rows=0)
    eager_graphs(r)
    rng = random.Random(7)
    seqs = []
    for i, c in enumerate([1999, 700, 1200, 15, 1023, 200, 64]):   # 16 and 1024 tokens: tables end on a block's end
        seq = Sequence([rng.randrange(3, 1000) for _ in range(c + 1)], SamplingParams())
        seq.num_cached, seq.state_slot = c, 6 - i
        seq.block_table = rng.sample(range(1, r.num_blocks), -(-(c + 1) // r.block_size))
        if r.tier is not None and i != 2:   # sequence 2 has no hot partition: pad_pid
            seq.tier_pid = r.tier.hot.add_sequence(rows=4)
        seqs.append(seq)
    with torch.inference_mode():
        for batch in ([(s, 1) for s in seqs], [(s, 1) for s in seqs[:5]], [(seqs[3], 1), (seqs[5], 1)]):
            for buf in [r.g_int64, *r.g_int32.values()]:
                buf.fill_(-7)
            key = r._graph_key(batch)
            want, old_key, ectx = _old_replay_writes(r, batch, key)
            assert key == old_key
            ctx = r._stage_decode(batch, key)
            got = _static(r, key)
            assert got.keys() == want.keys()
            for name in want:
                assert torch.equal(got[name], want[name]), (name, key, got[name], want[name])
            assert (ctx.is_decode, ctx.query_lens, ctx.context_lens, ctx.max_seq_len, ctx.sparse) == \
                (ectx.is_decode, ectx.query_lens, ectx.context_lens, ectx.max_seq_len, ectx.sparse)
            assert torch.equal(ctx.seq_lens, ectx.seq_lens) and torch.equal(ctx.slot_mapping, ectx.slot_mapping)


def test_prefill_and_mixed_steps_take_no_decode_graph(eager_graphs):
    """Only pure decode steps (one new token per sequence, after cached ones) have a graph key."""
    llm = _llm("dense")
    r = eager_graphs(llm.engine.runner)
    a, b = Sequence(list(range(3, 40)), SamplingParams()), Sequence(list(range(3, 20)), SamplingParams())
    a.block_table, b.block_table = [1, 2, 3], [4, 5]
    a.num_cached, b.num_cached = 36, 0
    assert r._graph_key([(a, 1)]) is not None
    assert r._graph_key([(a, 1), (b, 17)]) is None and r._graph_key([(b, 1)]) is None

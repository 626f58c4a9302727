"""The speculative graph steps' inputs (ModelRunner._stage_verify, replay_commit; MTPDrafter._replay,
_catch_up_graph): built on the host in the twins of the graphs' static buffers and copied in one or two transfers, as
plain decode steps' are (tests/test_decode_inputs.py). On CPU the graphs run eagerly (the eager_graphs fixture): the
tokens equal eager speculative decoding, and the static buffers hold what the former per-tensor writes held, padded
rows included."""
import random

import pytest
import torch

from sketchkv import LLM, SamplingParams
from sketchkv.engine import model_runner
from sketchkv.engine.sequence import Sequence, Status, block_tables
from test_decode_inputs import MODES
from test_speculative import assert_speculation_keeps_tokens

N = 3   # drafts per step: graphs of bucket x 4 rows


@pytest.fixture
def short_length_buckets(monkeypatch):
    """Graphs of sparse models for 256, 512, 1024 and 2048 tokens (16 ... 128 blocks of 16)."""
    monkeypatch.setattr(model_runner, "FIRST_LENGTH_BUCKET", 256)


def _llm(mode: str, **kw) -> LLM:
    return LLM("random:tiny-hybrid+mtp", device="cpu", dtype="float32", block_size=16, max_num_seqs=8,
               max_model_len=2048, num_speculative_tokens=N, **MODES[mode], **kw)


@pytest.mark.parametrize("mode,drafter", [("dense", "mtp"), ("tier", "mtp"), ("tier", "oracle")])
def test_graph_verification_gives_the_eager_tokens(mode, drafter, eager_graphs, short_length_buckets):
    """Five sequences of different lengths (batch bucket 8: three padded sequences, 12 padded rows): greedy tokens
    equal eager speculative decoding, through the verification, commit, drafter and catch-up graphs (the MTP
    drafter: all graphs; the oracle drafter: multi-token acceptance, so commits and rollbacks of several rows)."""
    rng = random.Random(len(mode) + len(drafter))
    prompts = [[rng.randrange(3, 1000) for _ in range(n)] for n in (250, 37, 120, 5, 241)]
    sp = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
    ref = [o.token_ids for o in _llm(mode, enforce_eager=True).generate(prompt_token_ids=prompts, sampling_params=sp)]
    llm = _llm(mode)
    r = eager_graphs(llm.engine.runner)
    assert_speculation_keeps_tokens(llm, prompts, sp, ref, drafter)
    used = lambda graphs: {k for k, g in graphs.items() if type(g).count}
    assert 8 in {b for _, b, _ in used(r.verify_graphs)}, used(r.verify_graphs)
    assert 8 in used(r.replay_graphs)
    if drafter == "mtp":
        assert 8 in used(r.spec.drafter.graphs) and 8 in {b for b, _ in used(r.spec.drafter.catch_up_graphs)}


class Stub:
    """A graph that does nothing on replay: the checks below read the inputs only."""
    def replay(self):
        pass


def _sequences(r, lengths, seed=7):
    rng, Q = random.Random(seed), r.num_spec + 1
    seqs = []
    for i, c in enumerate(lengths):
        seq = Sequence([rng.randrange(3, 1000) for _ in range(c + 1)], SamplingParams(temperature=0))
        seq.num_cached, seq.state_slot = c, 6 - i
        seq.block_table = rng.sample(range(1, r.num_blocks), -(-(c + Q) // r.block_size))
        seq.draft_token_ids = [rng.randrange(3, 1000) for _ in range(Q - 1)]
        seq.mtp_hidden = torch.randn(r.model_cfg.hidden_size)
        if r.tier is not None and i != 2:   # sequence 2 has no hot partition: pad_pid
            seq.tier_pid = r.tier.hot.add_sequence(rows=4)
        seqs.append(seq)
    return seqs


def _former_verify_writes(r, batch):
    """What the former _verify_bucket chose from the eager context and its _replay_verify's per-tensor writes left in
    the static buffers' first bucket x Q rows (the sequences' slots: first bucket). -> (key, those)"""
    ids, pos, ctx = r._context(batch)
    Q, bs = r.num_spec + 1, len(batch)
    if ctx.verify is None or ctx.verify.other_rows is not None or any(q != Q for q in ctx.query_lens):
        return None, None
    need = max(ctx.block_tables.shape[1], -(-ctx.max_seq_len // r.block_size))
    fits = [(b, nb) for _, b, nb in r.verify_graphs if b >= bs and nb >= need]
    if not fits:
        return None, None
    bucket, nb = min(fits)
    n, rb = bs * Q, bucket * Q
    full = lambda k, v, dt=torch.int64: torch.full((k,), v, dtype=dt)
    want = {"ids": full(rb, 0), "pos": full(rb, 0), "slot_mapping": full(rb, 0), "lens": full(rb, 1, torch.int32),
            "tables": torch.zeros(rb, nb, dtype=torch.int32), "row_slots": full(rb, r.scratch_slot),
            "seq_slots": full(bucket, r.scratch_slot)}
    want["ids"][:n], want["pos"][:n], want["slot_mapping"][:n] = ids, pos, ctx.slot_mapping
    want["tables"][:n, :ctx.block_tables.shape[1]] = ctx.block_tables.clamp_min(0).repeat_interleave(Q, 0)
    want["lens"][:n], want["row_slots"][:n] = ctx.decode_lens, ctx.state_slots.repeat_interleave(Q)
    want["seq_slots"][:bs] = ctx.state_slots
    if r.tier is not None:
        want["resident_rows"], want["hot_pids"] = full(rb, r.tier.dump_row), full(rb, r.tier.pad_pid)
        want["resident_rows"][:n], want["hot_pids"][:n] = ctx.resident_rows, ctx.hot_pids.repeat_interleave(Q)
    return (ctx.sparse, bucket, nb), want


def _verify_buffers(r, key) -> dict[str, torch.Tensor]:
    Q, (_, bucket, nb) = r.num_spec + 1, key
    got = {"ids": r.v_ids, "pos": r.v_pos, "slot_mapping": r.v_slot_mapping, "lens": r.v_lens[nb],
           "tables": r.v_tables[nb], "row_slots": r.v_row_slots}
    if r.tier is not None:
        got["resident_rows"], got["hot_pids"] = r.v_resident_rows, r.v_hot_pids
    got = {k: v[:bucket * Q].clone() for k, v in got.items()}
    got["seq_slots"] = r.v_seq_slots[:bucket].clone()
    return got


def _garbage(*bufs):
    for b in bufs:
        b.fill_(-7)


def _assert_equal(got: dict, want: dict, what):
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), (name, what, got[name], want[name])


@pytest.mark.parametrize("mode", ["dense", "tier"])
def test_staged_inputs_equal_the_former_per_tensor_writes(mode, eager_graphs, short_length_buckets):
    """Steps of 7, then 5 (the rows they left become padding), then 2 sequences (a smaller batch and length bucket),
    with garbage (-7) in every static buffer and host twin before each: the first rows of each static buffer that
    the verification, commit, drafter and catch-up graphs read equal the former writes; the verification graph key
    the former key; the returned context has the eager context's step facts."""
    llm = _llm(mode)
    r = llm.engine.runner
    if r.tier is not None:   # padded rows' empty partition is the tier's first (0): one that a zero pad would miss
        r.tier.pad_pid = r.tier.hot.add_sequence(rows=0)
    eager_graphs(r)
    d, Q = r.spec.drafter, r.num_spec + 1
    for graphs in (r.verify_graphs, r.replay_graphs, d.graphs, d.catch_up_graphs):
        graphs.update({k: Stub() for k in graphs})
    # 15 and 1023 cached tokens: the verified rows end on a block's end; 1999 + 4 rows: the longest table
    seqs = _sequences(r, [1999, 700, 1200, 15, 1023, 200, 64])
    rng = random.Random(3)
    with torch.inference_mode():
        for group in (seqs, seqs[:5], [seqs[3], seqs[5]]):
            bs, batch = len(group), [(s, Q) for s in group]
            # verification
            _garbage(r.v_int64, r.hv_int64, r.hv_int32, *r.v_int32.values())
            key, want = _former_verify_writes(r, batch)
            assert key is not None and r._verify_key(batch) == key
            ctx = r._stage_verify(batch, key)
            _assert_equal(_verify_buffers(r, key), want, key)
            ectx = r._context(batch)[2]
            assert (ctx.num_seqs, ctx.is_decode, ctx.query_lens, ctx.context_lens, ctx.max_seq_len, ctx.sparse,
                    ctx.num_drafts) == (ectx.num_seqs, ectx.is_decode, ectx.query_lens, ectx.context_lens,
                                        ectx.max_seq_len, ectx.sparse, ectx.num_drafts)
            bucket = key[1]
            # the commit's GDN replay
            _garbage(r.c_int64, r.hc_int64)
            rows0, slots, acc = [i * Q for i in range(bs)], [s.state_slot for s in group], [rng.randrange(Q) for _ in group]
            assert r.replay_commit(rows0, slots, acc, bs * Q)
            want = torch.tensor([[0] * bucket, [r.scratch_slot] * bucket, [0] * bucket])
            want[:, :bs] = torch.tensor([rows0, slots, acc])
            assert torch.equal(r.c_int64[:, :bucket], want), (r.c_int64, want)
            # the drafter: n greedy drafts for every sequence
            _garbage(d.g_int64, d.h_int64, d.g_tables, d.h_tables, d.g_hidden)
            assert d._graph_bucket(group, [N] * bs) == bucket
            d._replay(group, bucket)
            tables = torch.zeros(bucket, r.max_blocks_per_seq, dtype=torch.int32)
            t = block_tables(group, pad=0)
            tables[:bs, :t.shape[1]] = t
            hidden = torch.zeros(bucket, r.model_cfg.hidden_size, dtype=r.dtype)
            hidden[:bs] = torch.stack([s.mtp_hidden for s in group])
            want = {"pos": torch.tensor([s.num_cached for s in group] + [0] * (bucket - bs)),
                    "slots": torch.tensor([s.state_slot for s in group] + [r.scratch_slot] * (bucket - bs)),
                    "tables": tables, "hidden": hidden}
            _assert_equal({"pos": d.g_pos[:bucket], "slots": d.g_slots[:bucket], "tables": d.g_tables[:bucket],
                           "hidden": d.g_hidden[:bucket]}, want, "drafter")
            # the catch-up after the verification graph: each sequence's accepted rows at the start of its Q rows
            _garbage(d.c_int64, d.hc_int64)
            d.c_out.copy_(torch.arange(d.c_out.shape[0], dtype=d.c_out.dtype)[:, None])   # row i holds i
            ns = [a + 1 for a in acc]
            for s, n in zip(group, ns):   # the accepted tokens and the next one, as the engine appends them
                s.token_ids += [rng.randrange(3, 1000) for _ in range(n)]
                s.status, s.spec_ready = Status.RUNNING, False
            r.verify_graph_bucket = key[1:]
            assert d._catch_up_graph([(s, s.num_cached, n, i * Q) for i, (s, n) in enumerate(zip(group, ns))])
            ids = [0] * (bucket * Q)   # rows past a sequence's accepted ones: filler 0
            for i, (s, n) in enumerate(zip(group, ns)):
                ids[i * Q:i * Q + n] = s.token_ids[s.num_cached + 1:]
                assert s.spec_ready and s.mtp_hidden[0].item() == i * Q + n - 1   # its last accepted row's output
                del s.token_ids[s.num_cached + 1:]
            assert d.c_ids[:bucket * Q].tolist() == ids

def test_other_steps_take_no_verification_graph(eager_graphs):
    """Only steady-state verification steps (every sequence: its last token + exactly n drafts, after cached ones)
    have a verification key, the one the former choice from the eager context gave: not prompt chunks beside them,
    nor fewer drafts (near max_tokens), nor a longer remainder of a prompt."""
    llm = _llm("dense")
    r = eager_graphs(llm.engine.runner)
    Q = r.num_spec + 1
    a, b, c = _sequences(r, [36, 100, 17])
    b.num_cached = 96   # 5 uncached tokens: a prompt chunk
    for batch in ([(a, Q)], [(a, Q), (c, Q)], [(a, Q), (b, Q)], [(a, Q), (b, 2)], [(a, Q - 1)], [(a, 1)]):
        key, _ = _former_verify_writes(r, batch)
        assert r._verify_key(batch) == key, batch
    assert r._verify_key([(a, Q), (c, Q)]) is not None and r._verify_key([(a, Q), (b, Q)]) is None

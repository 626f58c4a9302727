"""Decode / prefill time sharing: while a long prompt prefills, the running sequences keep decoding
every step and get their share of wall time in decode-only steps (a fake clock: prefill steps cost 3 s,
decode-only steps 1 s, so the counts say exactly what the scheduler decided)."""
import pytest

from sketchkv import LLM, SamplingParams
from sketchkv.engine import scheduler as scheduler_module


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def perf_counter(self):
        return self.now


def _run(monkeypatch, share: float, cap: int = 32):
    clock = FakeClock()
    monkeypatch.setattr(scheduler_module, "time", clock)
    llm = LLM("random:tiny-hybrid", device="cpu", max_model_len=1024, max_num_seqs=4, block_size=16,
              max_num_batched_tokens=128, decode_time_share=share, max_prefill_tokens_while_decoding=cap)
    eng = llm.engine
    run = eng.runner.run

    kinds = []

    def timed_run(batch):  # a step's cost: 3 s with prompt tokens in it, else 1 s
        prefill = [n for seq, n in batch if seq is long]
        if prefill:
            assert prefill[0] <= (cap if share else 128)
        kinds.append("p" if prefill else "d")
        clock.now += 3.0 if any(n > 1 for _, n in batch) else 1.0
        return run(batch)
    eng.runner.run = timed_run
    decoding = [eng.add_request([5 + i] * 20, SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
                for i in range(2)]
    long = None
    while any(s.first_token_time is None for s in decoding):
        eng.step()
    kinds.clear()
    long = eng.add_request(list(range(3, 3 + 400)), SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    got = [len(s.output_token_ids) for s in decoding]
    while long.first_token_time is None:
        eng.step()
        now = [len(s.output_token_ids) for s in decoding]
        assert all(n == g + 1 for n, g in zip(now, got)), "a decoding sequence got no token this step"
        got = now
    return "".join(kinds)


@pytest.mark.parametrize("share", [0.0, 0.5, 0.75])
def test_decode_keeps_its_share_while_a_prompt_prefills(monkeypatch, share):
    kinds = _run(monkeypatch, share)
    n_p, n_d = kinds.count("p"), kinds.count("d")
    assert n_p == -(-400 // (32 if share else 126)) or n_p == -(-400 // (32 if share else 126)) + 1
    if share == 0:
        assert n_d == 0
    else:  # decode-only seconds / all seconds of the prefill's span, within one step
        frac = n_d / (n_d + 3 * n_p)
        assert abs(frac - share) < 3 / (n_d + 3 * n_p) + 1e-9, (kinds, frac)


def test_block_table_tensor_follows_appends_pops_and_resets():
    """Sequence.block_table_tensor converts only new entries; shrink (rejected drafts' blocks), regrowth
    with other blocks, a released table and inference mode on either side keep it equal to the list."""
    import torch

    from sketchkv.engine.sequence import Sequence, block_tables
    from sketchkv.kv.block_manager import BlockManager
    from sketchkv.sampling_params import SamplingParams
    bm = BlockManager(num_blocks=400, block_size=4)
    seq = Sequence(list(range(10)), SamplingParams())
    for n, mode in [(10, False), (200, True), (133, False), (300, True), (41, True), (600, False)]:
        if n < len(seq.block_table) * 4:
            bm.shrink(seq, n)
        else:
            bm.grow(seq, n)
        with torch.inference_mode(mode):
            assert seq.block_table_tensor().tolist() == seq.block_table
    bm.release(seq)
    bm.grow(seq, 9)
    assert seq.block_table_tensor().tolist() == seq.block_table and len(seq.block_table) == 3
    other = Sequence([1], SamplingParams())
    bm.grow(other, 1)
    assert block_tables([seq, other]).tolist() == [seq.block_table, other.block_table + [-1, -1]]


def test_admitted_prompts_leave_the_python_gc_until_a_sequence_finishes():
    """A new request's token lists go to Python's permanent GC generation (every collection that meets a list
    walks all its elements: tens of ms with agents of 250K tokens); they return to the collected generations
    when a sequence finishes, so nothing stays frozen for good."""
    import gc
    gc.unfreeze()
    eng = LLM("random:tiny-hybrid", device="cpu", max_model_len=1024, block_size=16, max_num_batched_tokens=128).engine
    seq = eng.add_request(list(range(3, 300)), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert gc.get_freeze_count() > 0
    assert not any(o is seq.token_ids for o in gc.get_objects())   # not in any collected generation
    while eng.has_unfinished:
        eng.step()
    assert gc.get_freeze_count() == 0
    assert any(o is seq.token_ids for o in gc.get_objects())

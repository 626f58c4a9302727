"""Sampling knobs, stop conditions, logprobs, seeds and preemption through the real engine (CPU)."""
import pytest
import torch

from sketchkv import LLM, SamplingParams
from sketchkv.errors import RequestError
from sketchkv.layers.sampler import _filter, sample


def test_filter_top_k_top_p_min_p():
    logits = torch.log(torch.tensor([0.5, 0.25, 0.15, 0.1]))
    keep = lambda **kw: torch.isfinite(_filter(logits, SamplingParams(**kw))).tolist()
    assert keep(top_k=2) == [True, True, False, False]
    assert keep(top_p=0.7) == [True, True, False, False]      # 0.5 < 0.7 <= 0.75
    assert keep(top_p=0.45) == [True, False, False, False]
    assert keep(min_p=0.3) == [True, True, True, False]       # 0.15 >= 0.3*0.5
    assert keep() == [True] * 4


def test_sampling_distribution_follows_temperature():
    logits = torch.log(torch.tensor([[0.6, 0.3, 0.1]])).repeat(4000, 1)
    g = [torch.Generator().manual_seed(i) for i in range(4000)]
    toks = torch.tensor(sample(logits, [SamplingParams(temperature=1.0)] * 4000, g).tokens)
    freq = torch.bincount(toks, minlength=3).float() / 4000
    assert torch.allclose(freq, torch.tensor([0.6, 0.3, 0.1]), atol=0.03)


def test_bad_params_rejected():
    for kw in (dict(temperature=-1), dict(top_p=0), dict(max_tokens=0), dict(min_p=2), dict(logprobs=99)):
        with pytest.raises(RequestError):
            SamplingParams(**kw)


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    from conftest import make_checkpoint
    path = str(tmp_path_factory.mktemp("m") / "q")
    make_checkpoint(path, "qwen3_5_text")
    return LLM(path, device="cpu", block_size=16)


def _ids(n, seed):
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_seed_reproducible_whatever_the_batch(llm):
    sp = SamplingParams(temperature=1.0, seed=7, max_tokens=16, ignore_eos=True)
    alone = llm.generate(prompt_token_ids=[_ids(20, 0)], sampling_params=sp)[0].token_ids
    other = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    mixed = llm.generate(prompt_token_ids=[_ids(30, 1), _ids(20, 0)], sampling_params=[other, sp])
    assert mixed[1].token_ids == alone


def test_max_tokens_stop_ids_and_logprobs(llm):
    greedy = llm.generate(prompt_token_ids=[_ids(10, 2)],
                          sampling_params=SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                         logprobs=3))[0]
    assert len(greedy.token_ids) == 12 and greedy.finish_reason == "length"
    assert len(greedy.logprobs) == 12 and all(lp <= 0 for lp in greedy.logprobs)
    # greedy picks the most likely token: its logprob equals the top-1 entry
    assert all(abs(lp - top[0][1]) < 1e-5 and top[0][0] == t
               for lp, top, t in zip(greedy.logprobs, greedy.top_logprobs, greedy.token_ids))
    stop_tok = greedy.token_ids[5]
    first = greedy.token_ids.index(stop_tok)
    out = llm.generate(prompt_token_ids=[_ids(10, 2)],
                       sampling_params=SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                      stop_token_ids=[stop_tok]))[0]
    assert out.token_ids == greedy.token_ids[:first + 1] and out.finish_reason == "stop"


def test_stop_string_truncates_text(llm):
    full = llm.generate(["def f(x):"], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0]
    assert len(full.text) >= 4, "the test needs some text to cut"
    stop = full.text[2:4]
    out = llm.generate(["def f(x):"], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop=[stop]))[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == full.text[:full.text.find(stop)]


def test_preemption_loses_nothing(tmp_path):
    """A KV cache too small for all sequences at once: some get preempted and recomputed; greedy
    outputs equal those of running each alone."""
    from conftest import make_checkpoint
    path = str(tmp_path / "q")
    make_checkpoint(path, "qwen3")
    prompts = [_ids(40, s) for s in range(4)]
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    small = LLM(path, device="cpu", block_size=16, num_kv_blocks=16, max_num_batched_tokens=64)
    together = [o.token_ids for o in small.generate(prompt_token_ids=prompts, sampling_params=sp)]
    assert small.engine.scheduler.num_preemptions > 0
    big = LLM(path, device="cpu", block_size=16)
    alone = [big.generate(prompt_token_ids=[p], sampling_params=sp)[0].token_ids for p in prompts]
    assert together == alone


def test_prompt_too_long_is_refused(llm):
    with pytest.raises(RequestError, match="context limit"):
        llm.generate(prompt_token_ids=[[5] * 5000], sampling_params=SamplingParams(max_tokens=1))
    assert llm.generate(prompt_token_ids=[[5] * 10], sampling_params=SamplingParams(max_tokens=2))[0].token_ids


def test_teacher_force_matches_full_forward(llm):
    """Decode-step log-probs of a forced continuation equal a single prefill over prompt + continuation."""
    prompt, cont = _ids(50, 7), _ids(12, 8)
    lp = llm.teacher_force([prompt, _ids(20, 9)], [cont, _ids(5, 10)])
    assert lp[0].shape == (12, llm.engine.model_config.vocab_size) and lp[1].shape[0] == 5
    eng = LLM(llm.engine.cfg.model, device="cpu", block_size=16, enable_prefix_caching=False).engine
    full = prompt + cont
    eng.add_request(full, SamplingParams(max_tokens=1))
    batch = eng.scheduler.schedule()
    ref = torch.log_softmax(eng.runner.logits_for(batch).float(), -1)[len(prompt) - 1:len(full) - 1]
    torch.testing.assert_close(lp[0], ref, rtol=1e-4, atol=1e-4)


def test_text_prompts_and_stop_strings_need_a_tokenizer():
    llm = LLM("random:tiny-hybrid", device="cpu", max_model_len=256)   # random presets have no tokenizer
    with pytest.raises(RequestError, match="no tokenizer"):
        llm.generate(["hello"], SamplingParams(max_tokens=1))
    with pytest.raises(RequestError, match="stop strings need one"):
        llm.generate(prompt_token_ids=[[5, 6]], sampling_params=SamplingParams(max_tokens=2, stop=["x"]))
    assert llm.generate(prompt_token_ids=[[5, 6]], sampling_params=SamplingParams(max_tokens=2))[0].token_ids

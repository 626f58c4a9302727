"""Incremental detokenization (engine/detokenizer.py) against full decodes, stop strings across token
boundaries through the engine, and the per-token cost staying flat as the output grows."""
import random
import statistics
import time

import pytest

from sketchkv import SamplingParams
from sketchkv.config import default_model
from sketchkv.engine.detokenizer import IncrementalDetokenizer
from sketchkv.models.tokenizer import Tokenizer

TEXT = ("Grüße aus Zürich! 你好，世界。これは日本語のテキストです。한국어도 있어요. "
        "Emoji: 😀👍🏽 👨‍👩‍👧‍👦 🇨🇭 — café naïve Ωμέγα Привет мир. \n"
        "def f(x):\n    return x ** 2  # ∑ ∫ ≤ ≥ ≠ ∞\n\t€100 £5 ¥300 ₿\U0001f9ea\U0001d54f\n")


@pytest.fixture(scope="module")
def tok():
    return Tokenizer(default_model())


def _byte_tokens(tok: Tokenizer, text: str) -> list[int]:
    """One token per UTF-8 byte: every multi-byte character spans 2-4 tokens."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):  # GPT-2's byte-to-character table, which byte-level BPE vocabularies spell bytes in
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b], extra = chr(256 + extra), extra + 1
    return [tok.tok.token_to_id(chars[b]) for b in text.encode("utf-8")]


def _streams(tok: Tokenizer) -> dict[str, list[int]]:
    rng = random.Random(0)
    special = sorted(tok.special_ids)
    realistic = tok.encode(TEXT)
    with_special = list(realistic)
    for _ in range(8):
        with_special.insert(rng.randrange(len(with_special) + 1), rng.choice(special))
    streams = {"realistic": realistic, "bytes": _byte_tokens(tok, TEXT), "realistic+special": with_special,
               "special-only": [0] * 20, "trailing-partial": _byte_tokens(tok, "ok 😀")[:-2]}
    for seed in range(4):  # random ids: invalid and truncated UTF-8, specials anywhere
        r = random.Random(seed)
        streams[f"random{seed}"] = [r.choice(special) if r.random() < 0.05 else r.randrange(tok.vocab_size)
                                    for _ in range(300)]
    return streams


@pytest.mark.parametrize("skip", [True, False])
def test_incremental_text_equals_full_decode(tok, skip):
    for name, ids in _streams(tok).items():
        final = tok.decode(ids, skip_special_tokens=skip)
        d = IncrementalDetokenizer(tok, skip_special_tokens=skip)
        deltas = []
        for k, t in enumerate(ids):
            deltas.append(d.add(t))
            # After every token: stable + pending is exactly a full decode, and the stable text never
            # takes back a character (a prefix of the final text, never ending in a partial one).
            assert d.text + d.pending == tok.decode(ids[:k + 1], skip_special_tokens=skip), (name, k)
            assert final.startswith(d.text), (name, k)
        assert "".join(deltas) == d.text
        assert d.finish() == final, name
        assert len(d.window) <= 16, (name, len(d.window))  # the window stays short


def test_multibyte_characters_wait_for_their_last_byte(tok):
    d = IncrementalDetokenizer(tok)
    got = [d.add(t) for t in _byte_tokens(tok, "a😀b")]
    assert got == ["a", "", "", "", "😀", "b"]
    assert d.pending == ""
    d = IncrementalDetokenizer(tok)
    for t in _byte_tokens(tok, "x世")[:-1]:  # the sequence ends inside a character
        d.add(t)
    assert d.text == "x" and d.pending == "\ufffd" and d.finish() == "x\ufffd"


def test_find_stop_across_token_boundaries(tok):
    ids = _byte_tokens(tok, "say 你好 then stop")
    d = IncrementalDetokenizer(tok)
    hits = []
    for t in ids:
        d.add(t)
        hits.append(d.find_stop(["好 t", "zzz"]))
    first = next(i for i, h in enumerate(hits) if h)
    # found at the token that completes it (the 't'), not before, and only once
    assert tok.decode(ids[:first + 1]).endswith("好 t") and hits[first] == "好 t"
    assert hits[first + 1:] == [None] * (len(ids) - first - 1)


# ---- through the engine (tiny random checkpoint: its byte tokens make plenty of broken UTF-8) ------------
@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    from conftest import make_checkpoint

    from sketchkv import LLM
    path = str(tmp_path_factory.mktemp("m") / "q")
    make_checkpoint(path, "qwen3_5_text")
    return LLM(path, device="cpu", block_size=16)


def _run(llm, prompt, params):
    eng = llm.engine
    seq = eng.add_request(prompt, params)
    texts = []
    while eng.has_unfinished:
        for out in eng.step():
            if out.request_id == seq.request_id:
                texts.append(out.text)
    return out, texts


def test_engine_streamed_text_is_a_prefix_of_the_final(llm):
    for seed in range(3):
        out, texts = _run(llm, "hello world", SamplingParams(temperature=1.0, seed=seed, max_tokens=64,
                                                             ignore_eos=True))
        assert out.text == llm.tokenizer.decode(out.token_ids)
        assert all(out.text.startswith(t) for t in texts)


def test_engine_stop_string_across_token_boundary(llm):
    prompt = "def f(x):"
    full = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0]
    ids, text = full.token_ids, full.text
    cases = []
    for k in range(1, len(ids)):  # a two-character stop string: last char of token k-1 + first of token k
        b = len(llm.tokenizer.decode(ids[:k]))
        stop = text[b - 1:b + 1]
        if 0 < b < len(text) and len(stop) == 2 and "\ufffd" not in stop and text.find(stop) == b - 1:
            cases.append((stop, b - 1))
    assert cases, "the greedy text needs a character pair split across tokens"
    for stop, at in cases[:3]:
        for include in (False, True):
            out, _ = _run(llm, prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop],
                                                      include_stop_str_in_output=include))
            n = next(j for j in range(1, len(ids) + 1) if stop in llm.tokenizer.decode(ids[:j]))
            assert out.finish_reason == "stop" and out.stop_reason == stop
            assert out.token_ids == ids[:n]  # stopped at the token that completed it
            assert out.text == text[:at + (len(stop) if include else 0)]


# ---- cost ---------------------------------------------------------------------------------------------
def _step_times(step, ids) -> list[float]:
    times = []
    for t in ids:
        t0 = time.perf_counter()
        step(t)
        times.append(time.perf_counter() - t0)
    return times


def test_per_token_cost_does_not_grow(tok):
    """4096 generated tokens: median cost of the last 100 steps vs the first 100 (printed: run with -s)."""
    ids = (tok.encode(TEXT) * 100)[:4096]
    d = IncrementalDetokenizer(tok)
    inc = _step_times(lambda t: (d.add(t), d.find_stop(["</answer>"])), ids)
    seen = []
    full = _step_times(lambda t: (seen.append(t), tok.decode(seen)), ids)  # the old way: decode everything
    us = lambda xs: statistics.median(xs) * 1e6
    print(f"\nincremental: first 100 {us(inc[:100]):.1f} us/token, last 100 {us(inc[-100:]):.1f} us/token; "
          f"full re-decode: first 100 {us(full[:100]):.1f} us/token, last 100 {us(full[-100:]):.1f} us/token")
    assert d.finish() == tok.decode(ids)
    assert us(inc[-100:]) < 3 * us(inc[:100]) + 20


def test_a_raw_prompt_gets_the_tokenizers_bos_and_a_chat_template_writes_its_own(tmp_path):
    """A Llama-style tokenizer.json whose post-processor prepends BOS: a raw prompt (LLM.generate, /v1/completions)
    gets it, as transformers and vLLM give it; a rendered chat template (which writes its own special tokens)
    is encoded without it (the server's chat path), so BOS is never doubled."""
    from conftest import make_checkpoint
    from tokenizers import Tokenizer as HFTokenizer, processors
    from sketchkv import LLM
    path = str(tmp_path / "m")
    make_checkpoint(path, "qwen3")
    tj = f"{path}/tokenizer.json"
    hf = HFTokenizer.from_file(tj)
    bos = hf.token_to_id("<|im_start|>")
    hf.post_processor = processors.TemplateProcessing(single="<|im_start|> $A", special_tokens=[("<|im_start|>", bos)])
    hf.save(tj)
    t = Tokenizer(path)
    assert t.encode("hi there") == [bos] + t.encode("hi there", add_special_tokens=False) == hf.encode("hi there").ids
    out = LLM(path, device="cpu", dtype="float32").generate("hi there", SamplingParams(max_tokens=1))
    assert out[0].prompt_token_ids == [bos] + t.encode("hi there", add_special_tokens=False)

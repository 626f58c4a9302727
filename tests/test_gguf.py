"""GGUF checkpoints: our loader and tokenizer against transformers' own GGUF loader (fp32, CPU), on tiny
files written here with the `gguf` package (llama / qwen2 / qwen3, every tensor type we read) and on the
real SmolLM2-135M-Instruct file (`sketchkv fetch smollm2`; skipped when it is not in the cache)."""
import functools
import inspect
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from conftest import last_logits
from sketchkv import LLM, SamplingParams
from sketchkv.errors import CheckpointError
from sketchkv.fetch import cached
from sketchkv.models.loader import load_config, load_model
from sketchkv.models.tokenizer import Tokenizer

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

SMOLLM2 = cached("smollm2")
needs_smollm2 = pytest.mark.skipif(SMOLLM2 is None,
                                   reason="SmolLM2 GGUF not in the cache: run `sketchkv fetch smollm2`")
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# transformers' GGUF reader takes head_dim from hidden / heads for llama and qwen2 and leaves Qwen3's default
# (128), so the tiny qwen3 uses 128
TINY = {
    "llama": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=2048, rope_theta=10000.0, rms_norm_eps=1e-5),
    "qwen2": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=2048, rope_theta=1e6, rms_norm_eps=1e-6),
    "qwen3": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=128, max_position_embeddings=2048, rope_theta=1e6,
                  rms_norm_eps=1e-6),
}
HF_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
            "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
            "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
            "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


# ---- writing tiny GGUF files (as llama.cpp's convert_hf_to_gguf.py would) ------------------------------------
def _hf_model(arch: str, seed: int = 0, **overrides):
    cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
           "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
           "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM)}[arch]
    torch.manual_seed(seed)
    model = cls[1](cls[0](**{**TINY[arch], **overrides})).eval()
    with torch.no_grad():  # non-trivial norms and biases, so a misplaced one shows
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                p.add_(torch.randn_like(p) * 0.1)
    return model


def _gguf_name(hf: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if hf in top:
        return top[hf]
    _, _, layer, rest = hf.split(".", 3)
    stem, suffix = rest.rsplit(".", 1)
    return f"blk.{layer}.{HF_NAMES[stem]}.{suffix}"


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute (HF rotary layout -> llama.cpp's interleaved pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _tokenizer_json():
    from tokenizers import Tokenizer as HFTok, decoders, models, pre_tokenizers, trainers
    tok = HFTok(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    text = ["def f(x):\n    return x + 1\n", "import torch\nclass A:\n    pass\n", "hello world, the quick brown fox",
            "year 2024: 123456 items"] * 50
    tok.train_from_iterator(text, trainer)
    return json.loads(tok.to_str())["model"]


_TOKENIZER = None


def write_gguf(path: str, model, arch: str, qtype: str = "F32", *, pre: str = "default", add_bos: bool = False,
               drop: tuple[str, ...] = (), extra: dict | None = None, rope_freqs: np.ndarray | None = None) -> str:
    """`model` (transformers) as a GGUF of `arch`: 2-D weights in `qtype`, norms and biases in F32."""
    global _TOKENIZER
    _TOKENIZER = _TOKENIZER or _tokenizer_json()
    cfg = model.config
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    vocab = _TOKENIZER["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([3 if t.startswith("<|") else 1 for t in tokens])
    w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in _TOKENIZER["merges"]])
    w.add_bos_token_id(vocab["<|im_start|>"])
    w.add_eos_token_id(vocab["<|im_end|>"])
    w.add_add_bos_token(add_bos)
    w.add_chat_template(TEMPLATE)
    for key, value in (extra or {}).items():
        w.add_string(key, value) if isinstance(value, str) else w.add_uint32(key, value)
    q = gguf.GGMLQuantizationType[qtype]
    for hf_name, t in model.state_dict().items():
        if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        name = _gguf_name(hf_name)
        if name in drop:
            continue
        a = t.float().numpy()
        if arch == "llama" and (".attn_q." in name or ".attn_k." in name):
            a = _permute(a, cfg.num_attention_heads if ".attn_q." in name else cfg.num_key_value_heads)
        if a.ndim == 2 and q != gguf.GGMLQuantizationType.F32:
            w.add_tensor(name, gguf.quants.quantize(a, q), raw_dtype=q)
        else:
            w.add_tensor(name, np.ascontiguousarray(a, dtype=np.float32))
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# ---- references: transformers' own GGUF loader ----------------------------------------------------------------
@pytest.fixture(scope="module", autouse=True)
def _faster_transformers_gguf():
    """transformers parses the whole file once for the config and again for the tensors, and rebuilds gguf's
    tensor-name map for every submodule (12 s for SmolLM2's 30 layers): memoize both, same results."""
    mp = pytest.MonkeyPatch()
    mp.setattr(gguf, "GGUFReader", functools.lru_cache(maxsize=2)(gguf.GGUFReader))
    mp.setattr(gguf, "get_tensor_name_map", functools.lru_cache(maxsize=8)(gguf.get_tensor_name_map))
    yield
    mp.undo()


def hf_from_gguf(path: str):
    """What `from_pretrained(gguf_file=...)` builds for llama / qwen2 / qwen3 (its legacy GGUF path: config,
    dequantization, q/k un-permutation, names), without accelerate."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
    folder, name = os.path.split(path)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder, gguf_file=name), dtype=torch.float32)
    state = load_gguf_checkpoint(path, return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= ({"lm_head.weight"} if model.config.tie_word_embeddings else set())
    model.tie_weights()
    return model.eval()


def hf_tokenizer(path: str):
    from transformers import AutoTokenizer
    folder, name = os.path.split(path)
    return AutoTokenizer.from_pretrained(folder, gguf_file=name)


def _greedy(llm, hf, ids: list[int], n: int) -> tuple[list[int], list[int]]:
    sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    ours = llm.generate(prompt_token_ids=[ids], sampling_params=sp)[0].token_ids
    ref = hf.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False)[0, len(ids):]
    return ours, ref.tolist()


# ---- tiny files: every architecture and tensor type, in CI always ----------------------------------------------
CASES = [("llama", "F32", {}), ("llama", "F16", {}), ("llama", "Q8_0", {}), ("llama", "Q4_0", {}),
         ("llama", "Q4_1", dict(tie_word_embeddings=True)), ("qwen2", "Q4_0", {}), ("qwen3", "Q8_0", {}),
         ("qwen3", "BF16", dict(tie_word_embeddings=True))]


@pytest.mark.parametrize("arch,qtype,overrides", CASES, ids=[f"{a}-{q}-{i}" for i, (a, q, _) in enumerate(CASES)])
def test_logits_and_greedy_match_transformers_gguf_loader(tmp_path, arch, qtype, overrides):
    path = write_gguf(str(tmp_path / f"{arch}.gguf"), _hf_model(arch, **overrides), arch, qtype)
    hf = hf_from_gguf(path)
    llm = LLM(path, device="cpu", dtype="float32", block_size=16, max_num_batched_tokens=64)
    assert llm.engine.model_config.tie_word_embeddings == bool(overrides.get("tie_word_embeddings"))
    ids = torch.randint(3, 512, (100,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0, -1]
    # same dequantized weights, same fp32 arithmetic up to summation order (measured: <= 2.4e-7 at logits ~0.5-1.2)
    torch.testing.assert_close(last_logits(llm, ids), ref, rtol=1e-4, atol=1e-5)
    ours, theirs = _greedy(llm, hf, ids, 8)
    assert ours == theirs


def test_llama3_rope_freqs_match_rope_scaling(tmp_path):
    """Llama 3.x files store their rope scaling as per-frequency divisors (rope_freqs.weight), which
    transformers' GGUF loader ignores: compare with the transformers model the file was written from."""
    rope = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    hf = _hf_model("llama", rope_parameters=rope)
    d = 64 // 4
    inv = 1.0 / (5e5 ** (np.arange(0, d, 2) / d))
    wavelen = 2 * np.pi / inv
    smooth = (64 / wavelen - 1.0) / (4.0 - 1.0)  # convert_hf_to_gguf.py's rope_factors
    factors = np.where(wavelen < 64 / 4.0, 1.0, np.where(wavelen > 64, 8.0, 1 / ((1 - smooth) / 8.0 + smooth)))
    path = write_gguf(str(tmp_path / "llama3.gguf"), hf, "llama", "F32", rope_freqs=factors)
    llm = LLM(path, device="cpu", dtype="float32", block_size=16, max_num_batched_tokens=64)
    ids = torch.randint(3, 512, (200,), generator=torch.Generator().manual_seed(2)).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0, -1]
    torch.testing.assert_close(last_logits(llm, ids), ref, rtol=1e-4, atol=1e-4)


TEXT = (inspect.getsource(json)[:3000] + "\nHéllo wörld — ünïcödé 日本語 🙂 year 2024: 123456 items\n"
        "<|im_start|>user\nhi<|im_end|>\n  two spaces\t\ttabs\n\n\nend")


@pytest.mark.parametrize("pre", ["default", "qwen2", "llama-bpe"])
def test_tokenizer_matches_transformers(tmp_path, pre):
    path = write_gguf(str(tmp_path / "t.gguf"), _hf_model("llama"), "llama", "Q8_0", pre=pre, add_bos=True)
    ours, ref = Tokenizer(path), hf_tokenizer(path)
    ids = ours.encode(TEXT, add_special_tokens=False)
    assert ids == ref.encode(TEXT, add_special_tokens=False)
    assert ours.encode(TEXT) == ref.encode(TEXT)  # add_bos_token: BOS first, as transformers
    assert ours.encode(TEXT)[0] == ours.tok.token_to_id("<|im_start|>")
    assert ours.decode(ids, skip_special_tokens=False) == TEXT == ref.decode(ids)
    assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True)
    assert (ours.bos_token, ours.eos_token, ours.eos_token_id) == ("<|im_start|>", "<|im_end|>", 2)
    assert ours.special_ids == {0, 1, 2}
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "Bye"}]
    assert ours.apply_chat_template(msgs) == ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)


def test_config_from_metadata(tmp_path):
    path = write_gguf(str(tmp_path / "q.gguf"), _hf_model("qwen3"), "qwen3", "Q8_0")
    cfg = load_config(path)
    assert (cfg.model_type, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == ("qwen3", 2, 2, 1, 128)
    assert cfg.qk_norm and cfg.rope_theta == 1e6 and cfg.eos_token_ids == [2] and cfg.max_position_embeddings == 2048
    from sketchkv.kv.basis import default_basis_path  # fit-basis writes beside the file
    assert default_basis_path(path) == str(tmp_path / "q.key_basis.safetensors")


# ---- clear errors ---------------------------------------------------------------------------------------------
def _load(path):
    return load_model(path, torch.float32, torch.device("cpu"))


def test_unsupported_architecture(tmp_path):
    path = str(tmp_path / "g.gguf")
    model = _hf_model("llama")
    w = gguf.GGUFWriter(path, "gemma2")
    w.add_tensor("token_embd.weight", model.model.embed_tokens.weight.detach().numpy())
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    with pytest.raises(CheckpointError, match=r"unsupported GGUF architecture 'gemma2' \(supported: llama"):
        _load(path)


def test_unsupported_tensor_type(tmp_path):
    path = write_gguf(str(tmp_path / "q5.gguf"), _hf_model("llama"), "llama", "Q5_0")
    with pytest.raises(CheckpointError, match=r"tensor 'token_embd.weight' \(and \d+ more\) is Q5_0; sketchkv reads"):
        _load(path)


def test_truncated_file(tmp_path):
    path = write_gguf(str(tmp_path / "t.gguf"), _hf_model("llama"), "llama", "Q8_0")
    size = os.path.getsize(path)
    for keep in (size - 100, 2000, 10):
        with open(path, "r+b") as f:
            f.truncate(keep)
        with pytest.raises(CheckpointError, match=r"t\.gguf: (truncated|corrupt or truncated GGUF)"):
            _load(path)


def test_not_a_gguf_and_missing_file(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"PK\x03\x04" + b"\0" * 100)
    with pytest.raises(CheckpointError, match="not a GGUF file"):
        _load(str(bad))
    with pytest.raises(CheckpointError, match="GGUF file not found"):
        _load(str(tmp_path / "none.gguf"))


def test_missing_tensor(tmp_path):
    path = write_gguf(str(tmp_path / "m.gguf"), _hf_model("llama"), "llama", "F16", drop=("blk.1.ffn_up.weight",))
    with pytest.raises(CheckpointError, match=r"missing tensor\(s\) model.layers.1.mlp.up_proj.weight"):
        _load(path)


def test_cli_reports_one_line(tmp_path, capsys):
    from sketchkv.cli import main
    path = write_gguf(str(tmp_path / "q5.gguf"), _hf_model("llama"), "llama", "Q5_1")
    assert main(["generate", "--model", path, "--device", "cpu", "--max-tokens", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is Q5_1; sketchkv reads" in err[0]


# ---- the real model: SmolLM2-135M-Instruct, Q4_1 / Q8_0 ------------------------------------------------------
@pytest.fixture(scope="module")
def smollm2():
    return LLM(SMOLLM2, device="cpu", dtype="float32", block_size=16, max_num_batched_tokens=256, max_model_len=1024)


@needs_smollm2
def test_smollm2_matches_transformers(smollm2):
    cfg = smollm2.engine.model_config
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.max_position_embeddings) == \
        (30, 9, 3, 64, 8192)
    hf = hf_from_gguf(SMOLLM2)
    ids = smollm2.tokenizer.encode("The capital of France is Paris. The capital of Germany is")
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0, -1]
    torch.testing.assert_close(last_logits(smollm2, ids), ref, rtol=1e-4, atol=2e-4)  # measured 1.6e-5 at |logit| 27.5
    ours, theirs = _greedy(smollm2, hf, ids, 8)
    assert ours == theirs and smollm2.tokenizer.decode(ours).startswith(" Berlin")


@needs_smollm2
def test_smollm2_tokenizer_matches_transformers():
    ours, ref = Tokenizer(SMOLLM2), hf_tokenizer(SMOLLM2)
    text = inspect.getsource(inspect)[:20000] + TEXT
    ids = ours.encode(text, add_special_tokens=False)
    assert ids == ref.encode(text, add_special_tokens=False) and ours.decode(ids, skip_special_tokens=False) == text
    assert ours.encode(text) == ref.encode(text) == ids   # the file says add_bos_token = False: no BOS added
    assert ours.encode("<|im_start|>user", add_special_tokens=False) == [1, 4093]
    assert ours.encode("2024", add_special_tokens=False) == [34, 32, 34, 36]  # digit by digit
    assert (ours.bos_token, ours.eos_token, ours.eos_token_id) == ("<|im_start|>", "<|im_end|>", 2)
    for msgs in ([{"role": "user", "content": "What is 2+2?"}],
                 [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                  {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}]):
        assert ours.apply_chat_template(msgs) == ref.apply_chat_template(msgs, tokenize=False,
                                                                         add_generation_prompt=True)


@needs_smollm2
def test_smollm2_cli_generate_chat(capsys):
    from sketchkv.cli import main
    assert main(["generate", "--model", SMOLLM2, "--device", "cpu", "--chat", "--temperature", "0",
                 "--max-tokens", "24", "--max-model-len", "1024", "--prompt", "What is the capital of France?"]) == 0
    out, err = capsys.readouterr()
    assert "Paris" in out and "finish: stop" in err  # stops at <|im_end|>


@needs_smollm2
def test_smollm2_serves_chat(tmp_path):
    openai = pytest.importorskip("openai")
    from conftest import free_port, stop_process, wait_healthy
    port, log_path = free_port(), str(tmp_path / "server.log")
    cmd = [sys.executable, "-m", "sketchkv", "serve", SMOLLM2, "--port", str(port), "--device", "cpu",
           "--max-model-len", "1024"]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        wait_healthy(f"http://127.0.0.1:{port}", proc, 120, lambda: open(log_path).read())
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=60)
        r = client.chat.completions.create(model=client.models.list().data[0].id, temperature=0, max_tokens=24,
                                           messages=[{"role": "user", "content": "What is the capital of France?"}])
        assert "Paris" in r.choices[0].message.content
    finally:
        stop_process(proc, 15)

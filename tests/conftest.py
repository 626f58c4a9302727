"""Shared fixtures: tiny random Hugging Face checkpoints written with transformers' save_pretrained."""
import json
import os
import sys

import pytest
import torch

# transformers binds fla's kernels at import time when fla is installed, and they cannot run on CPU
# tensors. Without a GPU, hide fla from this process so transformers uses its PyTorch reference;
# tests of fla itself run it in a subprocess under TRITON_INTERPRET=1.
if not torch.cuda.is_available():
    sys.modules["fla"] = None

# In the TRITON_INTERPRET=1 children (run_interpreter_tests), every launch of one of our kernels is logged,
# to be compiled for an H200 afterwards: the interpreter does not check what the compiler checks.
if os.environ.get("TRITON_INTERPRET") == "1" and os.environ.get("SKETCHKV_KERNEL_LAUNCHES"):
    import triton_compile_check
    triton_compile_check.record(os.environ["SKETCHKV_KERNEL_LAUNCHES"])

VOCAB = 512


def _tokenizer_files(path: str, vocab: int = VOCAB) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    text = ["def f(x):\n    return x + 1\n", "import torch\nclass A:\n    pass\n", "hello world, the quick brown fox"] * 50
    tok.train_from_iterator(text, trainer)
    tok.save(os.path.join(path, "tokenizer.json"))
    template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "<|endoftext|>", "chat_template": template}, f)


TINY = {
    "qwen3_5_text": dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_num_key_heads=2,
                         linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                         max_position_embeddings=4096),
    "qwen3_next": dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_num_key_heads=2,
                       linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                       num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                       shared_expert_intermediate_size=48, max_position_embeddings=4096),
    # QSA budget 32 tokens (8 blocks of 4): a 300-token context really prunes; PLE on two GDN layers,
    # two hyper-connection streams, MoE with a shared expert.
    "qwen4_exp_text": dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
                           linear_key_head_dim=16, linear_value_head_dim=16, num_experts=4, num_experts_per_tok=2,
                           moe_intermediate_size=32, shared_expert_intermediate_size=48, hc_count=2, hc_lowrank=16,
                           ple_layer_ids=[1, 3], ple_embed_dim=32, ngram_size=3, heads_per_ngram=2,
                           ngram_vocab_size_base=101, make_ngram_vocab_size_divisible_by=8, split_ngram_parts=4,
                           indexer_n_heads=8, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=32,
                           indexer_compress_ratio=4, max_position_embeddings=4096,
                           layer_types=["linear_attention", "indexed_attention", "linear_attention",
                                        "indexed_attention"],
                           rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                            "partial_rotary_factor": 0.25}),
    "qwen3": dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096),
    "llama": dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096),
}


def hf_classes(model_type: str):
    import transformers as tf
    return {"qwen3_5_text": (tf.Qwen3_5TextConfig, tf.Qwen3_5ForCausalLM),
            "qwen3_next": (tf.Qwen3NextConfig, tf.Qwen3NextForCausalLM),
            "qwen4_exp_text": (tf.Qwen4ExpTextConfig, tf.Qwen4ExpForCausalLM),
            "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM),
            "llama": (tf.LlamaConfig, tf.LlamaForCausalLM)}[model_type]


def make_checkpoint(path: str, model_type: str, seed: int = 0, **overrides):
    """Save a tiny random model of `model_type` to `path`; returns the transformers model (fp32, eval)."""
    cfg_cls, model_cls = hf_classes(model_type)
    kw = {**TINY[model_type], **overrides}
    kw.setdefault("eos_token_id", 0)
    torch.manual_seed(seed)
    model = model_cls(cfg_cls(**kw)).eval()
    with torch.no_grad():  # zero-init norms would hide norm bugs: give every parameter some spread
        for name, p in model.named_parameters():
            if "norm" in name or "dt_bias" in name:
                p.add_(torch.randn_like(p) * 0.1)
            elif "ple.conv1d" in name:  # transformers starts the PLE convolution at zero
                p.normal_(0.0, 0.1)
    model.save_pretrained(path)
    _tokenizer_files(path, kw["vocab_size"])
    return model


def add_mtp(path: str, seed: int = 0, std: float = 0.05) -> None:
    """Give a saved qwen3_5 / qwen3_next checkpoint a random MTP layer (mtp.* tensors, as real
    checkpoints and scripts/train_reference.py store them; transformers drops them)."""
    from safetensors.torch import load_file, save_file
    from sketchkv.models.loader import build_model, load_config
    cfg_file = os.path.join(path, "config.json")
    raw = json.load(open(cfg_file))
    raw["mtp_num_hidden_layers"] = 1
    json.dump(raw, open(cfg_file, "w"))
    model = build_model(load_config(path), torch.float32, torch.device("cpu"))
    g = torch.Generator().manual_seed(seed)
    weights = os.path.join(path, "model.safetensors")
    tensors = load_file(weights)
    for name, p in model.named_parameters():
        if name.startswith("mtp."):
            spread = 0.1 if "norm" in name else std
            tensors[name] = (torch.randn(p.shape, generator=g) * spread).to(p.dtype).contiguous()
    save_file(tensors, weights, metadata={"format": "pt"})


@pytest.fixture
def ckpt_with_basis_and_mtp(ckpt_with_basis, tmp_path):
    """A copy of ckpt_with_basis with an MTP layer (the basis fingerprint covers the main model only)."""
    import shutil
    path = str(tmp_path / "with_mtp")
    shutil.copytree(ckpt_with_basis, path)
    add_mtp(path)
    return path


@pytest.fixture
def tiny_checkpoint(tmp_path):
    def make(model_type: str, **overrides):
        path = str(tmp_path / model_type)
        return path, make_checkpoint(path, model_type, **overrides)
    return make


@pytest.fixture(scope="session")
def ckpt_with_basis(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("sp") / "q35")
    make_checkpoint(path, "qwen3_5_text", num_hidden_layers=8, max_position_embeddings=8192)
    calib = os.path.join(path, "calib.txt")
    g = torch.Generator().manual_seed(5)
    with open(calib, "w") as f:
        f.write("".join(chr(c) for c in torch.randint(32, 127, (6000,), generator=g).tolist()))
    from sketchkv import LLM
    from sketchkv.kv.fit_basis import fit_basis
    llm = LLM(path, device="cpu", block_size=16)
    fit_basis(llm, [calib], rank=8, max_tokens=3000, seq_len=1024, out=os.path.join(path, "key_basis.safetensors"))
    return path


def run_interpreter_tests(test_file: str, already_interpreted: bool) -> None:
    """Run `test_file`'s `test_interp_*` tests in a fresh process with TRITON_INTERPRET=1, then compile
    every kernel launch they made for an H200 in another (tests/triton_compile_check.py).

    Triton picks interpreter or compiler when a kernel is defined (at import), so flipping the
    variable inside a shared pytest process is unreliable; the main run skips those tests (with
    that reason) and this child runs them."""
    import subprocess
    if already_interpreted:
        pytest.skip("kernels already interpreted in this process; test_interp_* ran directly")
    pytest.importorskip("triton")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cmd = [sys.executable, "-m", "pytest", test_file, "-q", "-k", "test_interp_", "-p", "no:cacheprovider"]
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        launches = os.path.join(tmp, "launches.jsonl")
        r = subprocess.run(cmd, env={**os.environ, "TRITON_INTERPRET": "1", "SKETCHKV_KERNEL_LAUNCHES": launches},
                           cwd=root, capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-3000:]
        last = r.stdout.strip().split("\n")[-1]
        assert " passed" in last and "skipped" not in last, r.stdout[-3000:]
        if os.path.exists(launches):  # fla's own kernels (test_ops_gdn.py) are not logged
            env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
            # the script's own directory (tests/) comes first on its path, not the checkout: without this, an
            # installed sketchkv of another checkout would be compiled against this one's launches
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
            c = subprocess.run([sys.executable, os.path.join(root, "tests", "triton_compile_check.py"), launches],
                               env=env, cwd=root, capture_output=True, text=True, timeout=900)
            print(c.stdout)
            assert c.returncode == 0, c.stdout[-6000:] + c.stderr[-3000:]


@pytest.fixture(autouse=True)
def _schedules_without_wall_time(monkeypatch):
    """Engines in tests schedule by tokens alone (decode_time_share=0, vLLM's chunked prefill): with
    wall-time sharing, which steps mix prompt chunks with decode rows depends on the machine's speed,
    and the tests that compare two engines token for token would compare different batchings.
    tests/test_scheduler.py sets the share explicitly (an explicit value wins)."""
    import functools
    from sketchkv.config import SchedulerConfig
    monkeypatch.setattr(SchedulerConfig, "__init__",
                        functools.partialmethod(SchedulerConfig.__init__, decode_time_share=0.0))


@pytest.fixture(autouse=True)
def _free_gpu_memory_after_test(request):
    """An engine sizes its KV cache from the free GPU memory: free the last test's engines (reference
    cycles, CUDA-graph pools) before the next test builds its own or allocates real-size tensors."""
    yield
    if request.node.get_closest_marker("gpu") is not None and torch.cuda.is_available():
        import gc
        gc.collect()
        torch.cuda.empty_cache()


# ---- real server processes (test_server*.py, test_serve_shutdown.py) --------------------------------------

def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc, timeout: float, log=lambda: "") -> None:
    """Poll `url`/health until it answers 200; fail with the server's log if it exits or times out."""
    import time

    import httpx
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            pytest.fail(f"server exited with {proc.returncode}:\n{log()}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            pytest.fail(f"server did not come up:\n{log()}")
        time.sleep(0.3)


def stop_process(proc, timeout: float = 20) -> None:
    import subprocess
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# ---- CUDA graphs without a GPU ----------------------------------------------------------------------

@pytest.fixture
def eager_graphs(monkeypatch):
    """Replaces CUDA-graph capture with an eager stand-in that re-runs the captured step (with the context
    it was captured under) on every replay, so CPU tests run the runner's static-buffer graph steps
    (padding, row layout, replay bookkeeping). Returns capture(runner): captures the runner's graphs and
    gives a dict counting replays per graph key."""
    from sketchkv.engine import context, model_runner

    def capture_graph(fn, pool):
        ctx = context.get_context()

        class Replay:
            def replay(self):
                Replay.count += 1
                context.set_context(ctx)
                try:
                    fn()
                finally:
                    context.set_context(None)
        Replay.count = 0
        return Replay(), pool

    monkeypatch.setattr(model_runner, "capture_graph", capture_graph)

    def capture(runner):
        runner._capture_graphs()
        return runner
    return capture


def last_logits(llm, ids: list[int]) -> torch.Tensor:
    """Final-position logits of a prompt through the engine (chunked prefill as configured)."""
    from sketchkv import SamplingParams
    runner, eng = llm.engine.runner, llm.engine
    seq = eng.add_request(ids, SamplingParams(max_tokens=1))
    batch, logits = eng.scheduler.schedule(), None
    while batch:
        logits = runner.run(batch, sample_now=False)
        eng.scheduler.after_step(batch)
        batch = eng.scheduler.schedule() if seq.num_uncached else []
    eng.scheduler.finish(seq)
    return logits[-1]

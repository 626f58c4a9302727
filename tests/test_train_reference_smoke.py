"""CPU smoke test of the reference-model pipeline (scripts/train_reference.py, project issue 3).

A tiny config (hidden 64, vocab ~600, 512-token rows, a few steps) on a tiny corpus taken from a few small
packages of the local site-packages: the script runs in a child process (there fla is importable, as on the
GPU machine, and the script must route CPU tensors to transformers' PyTorch Gated DeltaNet), trains, saves,
evaluates at a tiny length and resumes. The checkpoint is then checked here: it loads with
transformers' AutoModelForCausalLM, carries the mtp.* tensors under the names/shapes of real Qwen3.5 checkpoints,
its tokenizer round-trips, and the evaluation's teacher-forced exact match agrees with cached greedy generation.
"""
import json
import os
import re
import subprocess
import sys
import sysconfig

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(REPO, "scripts")
SITE = sysconfig.get_paths()["purelib"]
TRAIN_CANDIDATES = ["packaging", "yaml", "tqdm", "filelock", "idna", "pluggy", "iniconfig", "markupsafe"]
HELDOUT = "jinja2"  # a dependency of sketchkv, so always installed

TINY = ["--vocab", "600", "--hidden", "64", "--layers", "4", "--intermediate", "128", "--heads", "2", "--kv-heads",
        "2", "--head-dim", "32", "--linear-key-heads", "1", "--linear-value-heads", "1", "--linear-key-dim", "128",
        "--linear-value-dim", "64", "--seq-len", "512", "--batch-size", "2", "--long-seq-len", "1024",
        "--long-every", "3", "--warmup-steps", "2", "--log-every", "2", "--workers", "2", "--synth-frac", "0.5"]


def _train_packages():
    have = [p for p in TRAIN_CANDIDATES if os.path.isdir(os.path.join(SITE, p))]
    size = sum(os.path.getsize(os.path.join(dp, f)) for p in have for dp, _, fs in os.walk(os.path.join(SITE, p))
               for f in fs if f.endswith(".py"))
    return have, size


def _run(args, timeout=300):
    env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    r = subprocess.run([sys.executable, os.path.join(SCRIPTS, "train_reference.py"), *args], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"exit {r.returncode}\n--- stdout\n{r.stdout[-6000:]}\n--- stderr\n{r.stderr[-6000:]}"
    return r.stdout + r.stderr


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    pkgs, size = _train_packages()
    if size < 150_000 or not os.path.isdir(os.path.join(SITE, HELDOUT)):
        pytest.skip("not enough small packages in site-packages for the tiny corpus")
    d = tmp_path_factory.mktemp("refmodel")
    paths = {k: str(d / k) for k in ("ckpt", "state", "export")}
    paths["report"] = str(d / "report" / "reference-model.md")
    common = ["--out", paths["ckpt"], "--state-dir", paths["state"], "--corpus-root", SITE,
              "--packages", ",".join(pkgs), "--heldout", HELDOUT, "--corpus-mb", "1", "--tokenizer-mb", "0.5", *TINY]
    log1 = _run([*common, "--max-steps", "3", "--report", paths["report"], "--export", paths["export"],
                 "--eval-lengths", "512", "--eval-samples", "2", "--eval-ppl-tokens", "1024",
                 "--eval-ppl-seq", "512", "--eval-generate-check", "1"])
    with open(os.path.join(paths["ckpt"], "trainer_state.json")) as f:
        state1 = json.load(f)
    with open(os.path.splitext(paths["report"])[0] + ".json") as f:
        report = json.load(f)
    log2 = _run(["--resume", paths["ckpt"], "--out", paths["ckpt"], "--state-dir", paths["state"], "--max-steps", "4",
                 "--no-eval", "--report", paths["report"]])
    with open(os.path.join(paths["ckpt"], "trainer_state.json")) as f:
        state2 = json.load(f)
    return {"paths": paths, "log1": log1, "log2": log2, "state1": state1, "state2": state2, "report": report}


def test_trains_on_cpu_with_torch_gdn(run):
    st = run["state1"]
    assert st["step"] == 3 and st["tokens_seen"] > 0
    used = st["gdn_used"]["torch_chunk_gated_delta_rule"]
    assert "PyTorch reference" in used and "fla" not in used  # fla may be installed: CPU tensors must not reach it
    assert all(h["lm_loss"] > 0 and h["lm_loss"] < 20 for h in st["history"])
    assert "first step" in run["log1"]


def test_resume_continues_with_optimizer_state(run):
    st = run["state2"]
    assert st["step"] == 4 and st["run_id"] == run["state1"]["run_id"]
    assert "restored fp32 weights and AdamW state" in run["log2"]
    assert len(st["commands"]) == 2 and st["tokens_seen"] > run["state1"]["tokens_seen"]


def test_checkpoint_loads_with_transformers_and_has_mtp(run):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM
    ckpt = run["paths"]["ckpt"]
    with open(os.path.join(ckpt, "config.json")) as f:
        cfg = json.load(f)
    assert cfg["model_type"] == "qwen3_5_text" and cfg["mtp_num_hidden_layers"] == 1
    assert cfg["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    assert cfg["linear_key_head_dim"] == 128 and cfg["max_position_embeddings"] >= 262144
    for name in ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "heldout.json"):
        assert os.path.exists(os.path.join(ckpt, name)), name
    model, info = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32, output_loading_info=True)
    assert type(model).__name__ == "Qwen3_5ForCausalLM"
    assert not info["missing_keys"] and not info["mismatched_keys"]
    H, I, hd, nq, nkv = 64, 128, 32, 2, 2
    want = {
        "mtp.pre_fc_norm_embedding.weight": (H,), "mtp.pre_fc_norm_hidden.weight": (H,), "mtp.fc.weight": (H, 2 * H),
        "mtp.layers.0.input_layernorm.weight": (H,), "mtp.layers.0.post_attention_layernorm.weight": (H,),
        "mtp.layers.0.self_attn.q_proj.weight": (2 * nq * hd, H), "mtp.layers.0.self_attn.k_proj.weight": (nkv * hd, H),
        "mtp.layers.0.self_attn.v_proj.weight": (nkv * hd, H), "mtp.layers.0.self_attn.o_proj.weight": (H, nq * hd),
        "mtp.layers.0.self_attn.q_norm.weight": (hd,), "mtp.layers.0.self_attn.k_norm.weight": (hd,),
        "mtp.layers.0.mlp.gate_proj.weight": (I, H), "mtp.layers.0.mlp.up_proj.weight": (I, H),
        "mtp.layers.0.mlp.down_proj.weight": (H, I), "mtp.norm.weight": (H,),
    }
    with safe_open(os.path.join(ckpt, "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        got = {k: tuple(f.get_slice(k).get_shape()) for k in keys if k.startswith("mtp.")}
        dtypes = {f.get_slice(k).get_dtype() for k in keys}
    assert got == want
    assert dtypes == {"BF16"}
    main = {k for k in keys if not k.startswith("mtp.")}
    assert main == {k for k in model.state_dict() if k != "lm_head.weight"}  # tied head stored once
    ids = torch.tensor([[5, 17, 42, 99, 7]])
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.shape == (1, 5, cfg["vocab_size"]) and torch.isfinite(logits).all()


def test_tokenizer_round_trip_and_chat_template(run):
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer
    ckpt = run["paths"]["ckpt"]
    tok = Tokenizer.from_file(os.path.join(ckpt, "tokenizer.json"))
    text = 'def f(x):\n    return REGISTRY["k_83af"] == 0x5e1d2c  # naïve ✓\n\tpass\r\n'
    ids = tok.encode(text, add_special_tokens=False).ids
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert [tok.token_to_id(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")] == [0, 1, 2]
    assert 500 <= tok.get_vocab_size() <= 600
    hf = AutoTokenizer.from_pretrained(ckpt)
    assert hf.decode(hf(text)["input_ids"]) == text and hf.eos_token == "<|endoftext|>"
    chat = hf.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_eval_report_and_heldout_manifest(run):
    rep = run["report"]
    p = rep["perplexity"]
    assert p["tokens"] > 0 and 0 < p["bits_per_byte"] < 20 and "mtp_top1_t_plus_2" in p
    r = rep["recall"]["by_length"]["512"]
    assert r["lookup"]["n"] == 2 and r["copy"]["n"] == 2
    assert all(g.get("agree") for g in rep["recall"]["generate_check"]), rep["recall"]["generate_check"]
    base = os.path.splitext(run["paths"]["report"])[0]
    md = open(base + ".md").read()
    assert "| 512 |" in md and "train_reference.py" in md
    with open(os.path.join(run["paths"]["ckpt"], "heldout.json")) as f:
        held = json.load(f)
    assert held["packages"] == [HELDOUT] and held["files"]
    assert all(e["path"].startswith(HELDOUT + "/") for e in held["files"])
    exported = os.listdir(run["paths"]["export"])
    assert "ckpt.tar.00" in exported and "reference-model.md" in exported


def test_teacher_forced_exact_match_equals_greedy_generation(run):
    sys.path.insert(0, SCRIPTS)
    import eval_reference as ev
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(run["paths"]["ckpt"], dtype=torch.float32).eval()
    prompt = list(range(40, 140))
    gen = ev.greedy_generate(model, prompt, len(prompt), 12, torch.device("cpu"))
    ids = prompt + gen
    assert ev.teacher_forced(model, ids, len(prompt), len(ids), torch.device("cpu")) == gen


def test_synthetic_rows_and_eval_documents(run):
    sys.path.insert(0, SCRIPTS)
    import numpy as np
    import reference_data as rd
    tok = rd.load_tokenizer(run["paths"]["ckpt"])
    _, ends_nl = rd.token_tables(tok)
    code = "".join(f"def f{i}(x):\n    y = x + {i}\n    z = y * 2\n    return z - 1\n\n" for i in range(300))
    stream = np.asarray(tok.encode(code, add_special_tokens=False).ids, dtype=np.uint16)
    funcs = []
    for src, sig in rd.extract_functions(code, max_per_file=5):
        e = tok.encode(src, add_special_tokens=False)
        funcs.append((np.asarray(e.ids), sum(1 for _, t in e.offsets if t <= sig)))
    b = rd.BatchBuilder(tok, stream, funcs, ends_nl, seed=0, synth_frac=1.0)
    ids, ans, n_syn = b.batch(step=1, rows=2, length=1024)
    assert ids.shape == (2, 1025) and n_syn == 2
    for row, m in zip(ids, ans):
        text = tok.decode(row.tolist())
        for val in re.findall(r"assert [^\n]*== ([^\n]+)\n", text):
            assert re.fullmatch(r'0x[0-9a-f]{6}|\d+|"[a-z0-9]+"', val), val
        edges = np.flatnonzero(np.diff(np.concatenate([[0], m.astype(np.int8), [0]])))
        for a, c in zip(edges[::2], edges[1::2]):
            piece = tok.decode(row[a:c].tolist())
            prev = tok.decode(row[max(0, a - 3):a].tolist())
            assert prev.endswith("==") and re.fullmatch(r' (0x[0-9a-f]{6}|\d+|"[a-z0-9]+")', piece) or \
                piece.startswith("    "), (prev, piece)
        assert text.rstrip("\n").split("\n")[-1].startswith("assert ")  # a lookup at the very end of the row
    text, starts = rd.heldout_text([rd.SourceFile("pkg/a.py", "pkg", len(code))], {"pkg/a.py": code})
    docs = rd.HeldoutDocs(tok, text, starts, rd.extract_functions(code.replace("def f1(", "def g1("), max_per_file=3))
    import random
    d = docs.lookup_doc(random.Random(0), 600, n_entries=8)
    assert re.fullmatch(r" 0x[0-9a-f]{6}", d.text[d.answer_start:d.answer_end]) and d.text.endswith("\n")
    assert d.text[:d.answer_start].endswith(f'assert REGISTRY["{d.meta["key"]}"] ==')
    assert d.text.index(f'"{d.meta["key"]}": {d.meta["value"]},') < len(d.text) * 0.2
    n = len(tok.encode(d.text, add_special_tokens=False).ids)
    assert 500 <= n <= 620
    fn = "def unique_fn(a, b):\n    c = a + b\n    d = c * 3\n    return d - a\n"
    docs.funcs = rd.extract_functions(fn)
    d = docs.copy_doc(random.Random(1), 600)
    assert d.text.endswith(fn) and d.text.count(fn) == 2
    assert d.text[d.answer_start:d.answer_end] == fn[len("def unique_fn(a, b):\n"):]


def test_gdn_gradient_check_code_path_on_cpu():
    """The start-of-run check (fla vs transformers' fp32 reference, fwd + bwd) exercised with the reference on both
    sides: only bf16 rounding of the gradients separates them."""
    sys.path.insert(0, SCRIPTS)
    import inspect
    import train_reference as tr
    from transformers.models.qwen3_5 import modeling_qwen3_5 as M
    args = tr.parse_args(TINY)
    cfg = tr.build_config(args, 600, 0, 2)
    ref = inspect.unwrap(M.torch_chunk_gated_delta_rule)
    assert ref.__module__ == M.__name__
    out = tr.gdn_grad_check(ref, ref, cfg, torch.device("cpu"), B=1, T=128)
    assert set(out["rel_err"]) == {"o", "dq", "dk", "dv", "dg", "dbeta"}
    assert out["max_rel_err"] < 0.02, out

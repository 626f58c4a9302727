"""Bad checkpoints fail at load with one line naming the file or tensor; the CLI exits non-zero without a traceback."""
import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from sketchkv.errors import CheckpointError
from sketchkv.models.loader import load_model


def _load(path):
    return load_model(path, torch.float32, torch.device("cpu"))


@pytest.fixture
def ckpt(tiny_checkpoint):
    path, _ = tiny_checkpoint("qwen3_5_text")
    return path


def _weights(path):
    return os.path.join(path, "model.safetensors")


def test_good_checkpoint_loads(ckpt):
    cfg, model = _load(ckpt)
    assert cfg.model_type == "qwen3_5_text" and cfg.full_attention_layers == [3]


def test_missing_directory(tmp_path):
    with pytest.raises(CheckpointError, match="model directory not found"):
        _load(str(tmp_path / "nope"))


def test_missing_config(ckpt):
    os.remove(os.path.join(ckpt, "config.json"))
    with pytest.raises(CheckpointError, match=r"config\.json: missing"):
        _load(ckpt)


def test_missing_weights(ckpt):
    os.remove(_weights(ckpt))
    with pytest.raises(CheckpointError, match="no \\*.safetensors weights"):
        _load(ckpt)


def test_unknown_model_type(ckpt):
    f = os.path.join(ckpt, "config.json")
    cfg = json.load(open(f))
    cfg["model_type"] = "mamba9"
    json.dump(cfg, open(f, "w"))
    with pytest.raises(CheckpointError, match="unsupported model_type 'mamba9'"):
        _load(ckpt)


def test_truncated_safetensors(ckpt):
    f = _weights(ckpt)
    data = open(f, "rb").read()
    open(f, "wb").write(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated"):
        _load(ckpt)


def test_corrupt_header(ckpt):
    f = _weights(ckpt)
    data = bytearray(open(f, "rb").read())
    data[8:40] = b"\xff" * 32
    open(f, "wb").write(bytes(data))
    with pytest.raises(CheckpointError, match="corrupt safetensors header"):
        _load(ckpt)


def test_wrong_shape_names_tensor(ckpt):
    t = load_file(_weights(ckpt))
    name = "model.layers.3.self_attn.k_proj.weight"
    t[name] = torch.randn(t[name].shape[0] + 1, t[name].shape[1])
    save_file(t, _weights(ckpt), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"k_proj\.weight' has shape"):
        _load(ckpt)


def test_missing_tensor_named(ckpt):
    t = load_file(_weights(ckpt))
    del t["model.layers.0.linear_attn.A_log"]
    save_file(t, _weights(ckpt), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"missing tensor\(s\) model\.layers\.0\.linear_attn\.A_log"):
        _load(ckpt)


def test_sharded_checkpoint_and_vision_and_mtp_names(ckpt):
    """Real Qwen3.5 checkpoints: model.language_model.* names, visual.* tensors to skip, shards + index."""
    t = load_file(_weights(ckpt))
    os.remove(_weights(ckpt))
    renamed = {k.replace("model.", "model.language_model.", 1): v for k, v in t.items()}
    renamed["model.visual.patch_embed.weight"] = torch.randn(4, 4)
    keys = sorted(renamed)
    shards = {"model-00001-of-00002.safetensors": keys[: len(keys) // 2],
              "model-00002-of-00002.safetensors": keys[len(keys) // 2:]}
    for fname, ks in shards.items():
        save_file({k: renamed[k] for k in ks}, os.path.join(ckpt, fname), metadata={"format": "pt"})
    json.dump({"weight_map": {k: f for f, ks in shards.items() for k in ks}},
              open(os.path.join(ckpt, "model.safetensors.index.json"), "w"))
    cfg, model = _load(ckpt)
    assert torch.equal(model.model.embed_tokens.weight, t["model.embed_tokens.weight"])


def test_cli_bad_checkpoint_one_line_exit_code(ckpt):
    os.remove(os.path.join(ckpt, "config.json"))
    r = subprocess.run([sys.executable, "-m", "sketchkv", "generate", "--model", ckpt, "--device", "cpu"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and "config.json: missing" in r.stderr
    assert "Traceback" not in r.stderr


def test_cli_generates_text(ckpt):
    r = subprocess.run([sys.executable, "-m", "sketchkv", "generate", "--model", ckpt, "--device", "cpu",
                        "--prompt", "def f(x):", "--max-tokens", "8", "--temperature", "0"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("def f(x):") and "8 generated" in r.stderr


def test_readme_main_job_random_stand_in(tmp_path):
    """The README's first command: write a random tiny hybrid, then generate from it."""
    d = str(tmp_path / "tiny")
    r = subprocess.run([sys.executable, "-m", "sketchkv", "random-model", "tiny-hybrid", d],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    r = subprocess.run([sys.executable, "-m", "sketchkv", "generate", "--model", d, "--max-tokens", "8",
                        "--device", "cpu"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "generated" in r.stderr


def test_missing_bundled_model_explains_itself(monkeypatch):
    import sketchkv.config as config
    monkeypatch.setattr(config, "default_model", lambda: "/nonexistent/reference-model")
    with pytest.raises(CheckpointError, match="bundled reference model is not in this install"):
        _load("/nonexistent/reference-model")


def test_random_presets_and_the_mtp_suffix():
    from sketchkv.models.presets import preset_config
    cfg, _ = preset_config("tiny-hybrid+mtp")
    assert cfg.mtp_num_layers == 1 and preset_config("tiny-hybrid")[0].mtp_num_layers == 0
    _, model = load_model("random:tiny-hybrid+mtp", torch.float32, torch.device("cpu"))
    assert model.mtp is not None
    with pytest.raises(CheckpointError, match="unknown random model preset 'nope'"):
        preset_config("nope")
    with pytest.raises(CheckpointError, match="MTP layers exist for qwen3_5_text / qwen3_next presets only"):
        preset_config("qwen4-exp-h200+mtp")

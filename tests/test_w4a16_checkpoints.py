"""Int4 (W4A16) checkpoints written by the format libraries (compressed-tensors' ModelCompressor, auto-round) load
to the weights their own readers dequantize and to the logits of transformers on the same file (fp32, CPU)."""
import json
import os
import shutil

import pytest
import torch

from conftest import _tokenizer_files, last_logits, make_checkpoint
from sketchkv import LLM, SamplingParams
from sketchkv.errors import CheckpointError
from sketchkv.models.quantized import Int4Format, canonical, int4_format, int4_parts
from sketchkv.ops.w4a16_gemm import Int4Weight, MixedWeight, dequantize_int4

transformers = pytest.importorskip("transformers")

CT_CASES = {  # name: (model_type, symmetric, group (0: per channel), config overrides)
    "llama-sym-g32": ("llama", True, 32, {}),
    "qwen3-asym-g64": ("qwen3", False, 64, {}),
    "qwen3_5-sym-g128": ("qwen3_5_text", True, 128, dict(hidden_size=128, intermediate_size=256,
                                                           linear_value_head_dim=32)),
    "llama-sym-channel": ("llama", True, 0, {}),
}
AR_CASES = {  # name: (model_type, symmetric, group, AutoRound export format, config overrides)
    "llama-gptq-sym-g32": ("llama", True, 32, "auto_gptq", {}),
    "qwen3-autoround-sym-g64": ("qwen3", True, 64, "auto_round", {}),
    "qwen3_5-autoround-asym-g64": ("qwen3_5_text", False, 64, "auto_round", {}),
}


def _normalize(name):
    return name[len("model.language_model."):] if name.startswith("model.language_model.") else name


def _ct_checkpoint(root: str, model_type: str, sym: bool, group: int, **overrides) -> tuple[str, str]:
    """A tiny random model quantized RTN and saved by compressed-tensors (llm-compressor's saving path)."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig, QuantizationScheme,
                                                 apply_quantization_config)
    from compressed_tensors.quantization.utils.helpers import calculate_qparams
    src, dst = os.path.join(root, "bf16"), os.path.join(root, "int4")
    hf = make_checkpoint(src, model_type, **overrides)
    args = QuantizationArgs(num_bits=4, type="int", symmetric=sym, strategy="group" if group else "channel",
                            group_size=group or None)
    apply_quantization_config(hf, QuantizationConfig(
        config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=args)}, ignore=["lm_head"]))
    for m in hf.modules():
        if hasattr(m, "weight_scale"):
            w = m.weight.detach()
            g = w.reshape(w.shape[0], -1, group or w.shape[1])
            scale, zp = calculate_qparams(g.amin(-1), g.amax(-1), args)
            m.weight_scale.data.copy_(scale.reshape(m.weight_scale.shape))
            if hasattr(m, "weight_zero_point"):
                m.weight_zero_point.data.copy_(zp.reshape(m.weight_zero_point.shape))
    compressor = ModelCompressor.from_pretrained_model(hf, quantization_format="pack-quantized")
    compressor.compress_model(hf)
    hf.save_pretrained(dst)
    compressor.update_config(dst)
    _tokenizer_files(dst)
    return src, dst


def _ar_checkpoint(root: str, model_type: str, sym: bool, group: int, fmt: str, **overrides) -> tuple[str, str]:
    """A tiny random model quantized by AutoRound (RTN mode, iters=0) in one of its export formats."""
    auto_round = pytest.importorskip("auto_round")
    src = os.path.join(root, "bf16")
    make_checkpoint(src, model_type, **overrides)
    ar = auto_round.AutoRound(src, bits=4, group_size=group, sym=sym, iters=0, nsamples=2, seqlen=32,
                              dataset=["def f(x):\n    return x + 1\n" * 20, "import torch\nclass A: pass\n" * 20],
                              device_map="cpu")
    out = os.path.join(root, "export")
    ar.quantize_and_save(out, format=fmt)
    dst = os.path.join(root, "int4")
    inner = [d for d in os.listdir(out) if os.path.isdir(os.path.join(out, d))]
    shutil.move(os.path.join(out, inner[0]) if inner else out, dst)
    return src, dst


@pytest.fixture(scope="module")
def ct_ckpt(tmp_path_factory):
    made = {}

    def get(name):
        pytest.importorskip("compressed_tensors")  # a test extra; the GPU machine may lack it
        if name not in made:
            model_type, sym, group, over = CT_CASES[name]
            made[name] = _ct_checkpoint(str(tmp_path_factory.mktemp(name)), model_type, sym, group, **over)
        return made[name]
    return get


@pytest.fixture(scope="module")
def ar_ckpt(tmp_path_factory):
    made = {}

    def get(name):
        if name not in made:
            model_type, sym, group, fmt, over = AR_CASES[name]
            made[name] = _ar_checkpoint(str(tmp_path_factory.mktemp(name)), model_type, sym, group, fmt, **over)
        return made[name]
    return get


# ---- the libraries' own dequantization -----------------------------------------------------------------------

def _layers(path: str) -> tuple[Int4Format, dict, dict]:
    """(format, {layer: {part: tensor}}, quantization_config) of a checkpoint directory."""
    from safetensors.torch import load_file
    qcfg = json.load(open(os.path.join(path, "config.json")))["quantization_config"]
    fmt = int4_format(qcfg, path)
    files = [os.path.join(path, "model.safetensors")]
    tensors = {_normalize(k): v for k, v in load_file(files[0]).items()}
    layers = {layer: {p: tensors[f"{layer}.{p}"] for p in parts} for layer, parts in
              int4_parts(files, fmt, _normalize).items()}
    return fmt, layers, qcfg


def _library_weight(fmt: Int4Format, parts: dict, qcfg: dict) -> torch.Tensor:
    """W [N, K] in fp32 as the format's library dequantizes it (scales in fp32, so its arithmetic is exact too)."""
    if fmt.layout == "ct":
        from compressed_tensors.compressors import PackedQuantizationCompressor
        from compressed_tensors.quantization import QuantizationScheme
        scheme = QuantizationScheme.model_validate(qcfg["config_groups"]["group_0"])
        return PackedQuantizationCompressor.decompress(dict(parts), scheme)["weight"].float()
    K = parts["qweight"].shape[0] * (8 if fmt.layout == "gptq" else 1)
    G = K // parts["scales"].shape[0]
    if fmt.layout == "awq":
        from auto_round.export.export_to_awq.utils import dequantize_gemm
        return dequantize_gemm(parts["qweight"], parts["qzeros"], parts["scales"].float(), 4, G).t()
    from auto_round_extension.torch.qlinear_torch_zp import QuantLinear  # GPTQ's zero - 1 convention
    N = parts["qweight"].shape[1]
    lin = QuantLinear(4, G, K, N, bias=False)  # (its g_idx path mixes up K and N when N > K; ours is k // G)
    for p in ("qweight", "qzeros", "scales"):
        setattr(lin, p, parts[p].float() if p == "scales" else parts[p])
    with torch.no_grad():
        return lin(torch.eye(K)).t()


def _ours(fmt: Int4Format, parts: dict, name: str) -> torch.Tensor:
    return dequantize_int4(*canonical(fmt, parts, torch.float32, name), torch.float32)


@pytest.mark.parametrize("case", CT_CASES)
def test_compressed_tensors_weights_equal_the_library_dequantization(ct_ckpt, case):
    fmt, layers, qcfg = _layers(ct_ckpt(case)[1])
    assert fmt.layout == "ct" and len(layers) >= 7
    for name, parts in layers.items():
        assert torch.equal(_ours(fmt, parts, name), _library_weight(fmt, parts, qcfg)), name


@pytest.mark.slow
@pytest.mark.parametrize("case", AR_CASES)
def test_auto_round_weights_equal_the_library_dequantization(ar_ckpt, case):
    fmt, layers, qcfg = _layers(ar_ckpt(case)[1])
    assert fmt.layout == ("awq" if "asym" in case else "gptq")
    assert len(layers) >= 7
    for name, parts in layers.items():
        assert torch.equal(_ours(fmt, parts, name), _library_weight(fmt, parts, qcfg)), name


# ---- logits against transformers -----------------------------------------------------------------------------


def _reference(src: str, dst: str, direct: bool):
    """transformers on the int4 file (direct), else transformers' bf16 model with every int4 layer's weight
    replaced by the library's dequantization of the file (where transformers cannot read the file on a CPU)."""
    if direct:
        return transformers.AutoModelForCausalLM.from_pretrained(dst, dtype=torch.float32).eval()
    hf = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    fmt, layers, qcfg = _layers(dst)
    with torch.no_grad():
        for name, parts in layers.items():
            hf.get_submodule(name).weight.copy_(_library_weight(fmt, parts, qcfg))
    return hf


def _check_logits(src, dst, direct, tol=1e-4):
    llm = LLM(dst, device="cpu", dtype="float32", block_size=16, max_num_batched_tokens=64)
    hf = _reference(src, dst, direct)
    ids = torch.randint(3, 500, (150,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0, -1].float()
    torch.testing.assert_close(last_logits(llm, ids), ref, rtol=tol, atol=tol)
    ours = llm.generate(prompt_token_ids=[ids], sampling_params=SamplingParams(temperature=0, max_tokens=12,
                                                                               ignore_eos=True))[0].token_ids
    theirs = hf.generate(torch.tensor([ids]), max_new_tokens=12, min_new_tokens=12, do_sample=False)[0, len(ids):]
    assert ours == theirs.tolist()


@pytest.mark.parametrize("case", CT_CASES)
def test_compressed_tensors_logits_match_transformers(ct_ckpt, case):
    # transformers 5.24 + compressed-tensors 0.20 cannot load asym pack-quantized files (zero-point shape mismatch)
    _check_logits(*ct_ckpt(case), direct=CT_CASES[case][1])


@pytest.mark.slow
@pytest.mark.parametrize("case", AR_CASES)
def test_auto_round_logits_match_transformers(ar_ckpt, case):
    # transformers reads auto-round's GPTQ packing on a CPU (auto-round's torch kernel); `gptq` files need
    # gptqmodel (CUDA torch) and AWQ packing auto-round-lib: those compare with the library's dequantization
    # (transformers' auto-round path dequantizes with fp16 scales and runs its int4 layers in fp16: 3e-3)
    direct = case == "qwen3-autoround-sym-g64"
    _check_logits(*ar_ckpt(case), direct=direct, tol=3e-3 if direct else 1e-4)


@pytest.mark.parametrize("one_launch", [True, False])
def test_int4_layers_are_int4_and_the_rest_stays_dense(ct_ckpt, monkeypatch, one_launch):
    from sketchkv.layers.int4_linear import Int4Linear
    from sketchkv.models import fuse
    monkeypatch.setattr(fuse, "MIXED_ONE_LAUNCH", one_launch)
    llm = LLM(ct_ckpt("qwen3_5-sym-g128")[1], device="cpu", dtype="float32", block_size=16)
    m = llm.engine.runner.model
    gdn, attn = m.model.layers[0].linear_attn, m.model.layers[3].self_attn
    assert isinstance(gdn.in_proj_qkv, Int4Linear) and isinstance(m.model.layers[0].mlp.down_proj, Int4Linear)
    assert isinstance(attn.q_proj, Int4Linear) and attn.q_proj.fused and attn.o_proj.int4 is not None
    assert type(m.lm_head) is torch.nn.Linear and type(gdn.in_proj_b) is torch.nn.Linear  # b: N=4 (< 8) -> dense
    # int4 [qkv; z] + dense [b; a]: one weight for one launch, else a tuple of the two
    assert (isinstance(gdn.in_proj, MixedWeight) if one_launch
            else [type(w) for w in gdn.in_proj] == [Int4Weight, torch.Tensor])
    # on a CPU either runs as two GEMMs split on their own: the same pieces as the concatenation's split
    from sketchkv.models.fuse import linear, linear_split
    x = torch.randn(3, gdn.in_proj_qkv.in_features)
    sizes = [gdn.conv_dim, gdn.value_dim, gdn.num_v_heads, gdn.num_v_heads]
    for got, want in zip(linear_split(x, gdn.in_proj, sizes), linear(x, gdn.in_proj).split(sizes, dim=-1)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    with pytest.raises(AssertionError, match="straddles"):
        linear_split(x, gdn.in_proj, [gdn.conv_dim + gdn.value_dim + 1, 2 * gdn.num_v_heads - 1])


# ---- what fails at load --------------------------------------------------------------------------------------

def _with_config(src: str, dst: str, **changes) -> str:
    shutil.copytree(src, dst)
    cfg = json.load(open(os.path.join(dst, "config.json")))
    cfg["quantization_config"].update(changes)
    json.dump(cfg, open(os.path.join(dst, "config.json"), "w"))
    return dst


@pytest.mark.parametrize("changes,needle", [
    (dict(quant_method="gptq", bits=8), "bits=8"),
    (dict(quant_method="gptq", bits=4, checkpoint_format="marlin"), "checkpoint_format='marlin'"),
    (dict(quant_method="awq", bits=4, version="gemv"), "version='gemv'"),
    (dict(quant_method="auto-round", bits=4, packing_format="auto_round:auto_awq", data_type="fp"), "data_type='fp'"),
    (dict(quant_method="bitsandbytes", bits=4), "quant_method='bitsandbytes'"),
    (dict(format="naive-quantized"), "format='naive-quantized'"),
    (dict(kv_cache_scheme={"num_bits": 8}), "kv_cache_scheme"),
])
def test_unsupported_settings_fail_at_load_with_one_line(ct_ckpt, tmp_path, changes, needle):
    path = _with_config(ct_ckpt("llama-sym-g32")[1], str(tmp_path / "bad"), **changes)
    with pytest.raises(CheckpointError) as e:
        LLM(path, device="cpu", dtype="float32")
    msg = str(e.value)
    assert needle in msg and "\n" not in msg and "not supported" in msg


def test_compressed_tensors_activation_quantization_fails_at_load(ct_ckpt, tmp_path):
    path = str(tmp_path / "w4a8")
    _with_config(ct_ckpt("llama-sym-g32")[1], path)
    cfg = json.load(open(os.path.join(path, "config.json")))
    cfg["quantization_config"]["config_groups"]["group_0"]["input_activations"] = {"num_bits": 8, "type": "int"}
    json.dump(cfg, open(os.path.join(path, "config.json"), "w"))
    with pytest.raises(CheckpointError, match="activation quantization"):
        LLM(path, device="cpu", dtype="float32")


def test_act_order_g_idx_fails_at_load_and_trivial_g_idx_loads(ct_ckpt):
    fmt, layers, _ = _layers(ct_ckpt("llama-sym-g32")[1])
    name, parts = next(iter(layers.items()))
    K = parts["weight_packed"].shape[1] * 8
    trivial = torch.arange(K, dtype=torch.int32) // 32
    canonical(fmt, {**parts, "weight_g_idx": trivial}, torch.float32, name)
    with pytest.raises(CheckpointError, match="act-order"):
        canonical(fmt, {**parts, "weight_g_idx": trivial.flip(0)}, torch.float32, name)


def test_gptq_zero_conventions():
    """v1 (GPTQ, AutoRound's auto_gptq) stores zero - 1, gptq_v2 the zero: both give w = (q - zero) * scale."""
    from sketchkv.ops.w4a16_gemm import pack_int4
    g = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (16, 64), generator=g)
    zero = torch.randint(1, 16, (2, 16), generator=g)  # [K/G, N]
    scales = torch.rand(2, 16, generator=g) + 0.5
    w = (q - zero.t().repeat_interleave(32, 1)) * scales.t().repeat_interleave(32, 1)
    for fmt, stored in ((int4_format({"quant_method": "gptq", "bits": 4}, "x"), zero - 1),
                        (int4_format({"quant_method": "gptq", "bits": 4, "checkpoint_format": "gptq_v2"}, "x"), zero)):
        qzeros = pack_int4(stored).t().contiguous()  # packed along N: [K/G, N/8]
        parts = {"qweight": pack_int4(q), "qzeros": qzeros, "scales": scales}
        assert torch.equal(_ours(fmt, parts, "x"), w)


# ---- `sketchkv quantize` ---------------------------------------------------------------------------------------

def test_quantize_writes_compressed_tensors_that_transformers_loads(tmp_path, capsys):
    from sketchkv.cli import main
    src = str(tmp_path / "bf16")
    make_checkpoint(src, "qwen3_5_text", hidden_size=128, intermediate_size=256, linear_value_head_dim=32)
    dst = str(tmp_path / "int4")
    assert main(["quantize", src, dst, "--kl-samples", "0", "--group-size", "64"]) == 0
    assert "int4 layers (rtn, group 64, sym)" in capsys.readouterr().out
    qcfg = json.load(open(os.path.join(dst, "config.json")))["quantization_config"]
    assert qcfg["quant_method"] == "compressed-tensors" and qcfg["format"] == "pack-quantized"
    assert "lm_head" in qcfg["ignore"] and any(n.endswith("in_proj_b") for n in qcfg["ignore"])
    _check_logits(src, dst, direct=True)
    # RTN: every weight within half a step of its group's grid
    from safetensors.torch import load_file
    bf16 = load_file(os.path.join(src, "model.safetensors"))
    fmt, layers, qcfg = _layers(dst)
    for name, parts in layers.items():
        w, wq = bf16[name + ".weight"].float(), _ours(fmt, parts, name)
        step = parts["weight_scale"].float().repeat_interleave(64, 1)
        assert ((w - wq).abs() <= step * 0.5 + 1e-6).all(), name


@pytest.mark.slow
def test_quantize_autoround_on_a_hybrid_model(tmp_path):
    """`quantize --method autoround` (2 iterations) on a GDN + full-attention model with an MTP head: auto-round 0.16
    given strings crashed in the first full-attention block (block 0's cached 2-D GDN mask; quantize._token_samples),
    and it exports the MTP head itself (int4), which a second, bf16 copy made unloadable. The export is auto-round's
    GPTQ packing, loads in sketchkv (MTP drafts give plain decoding's tokens) and gives the logits of transformers'
    bf16 model carrying the library's own dequantization of every int4 layer."""
    import inspect
    import json as json_
    from conftest import add_mtp
    from sketchkv.quantize import quantize
    src, dst = str(tmp_path / "bf16"), str(tmp_path / "ar")
    make_checkpoint(src, "qwen3_5_text", hidden_size=128, intermediate_size=256, linear_value_head_dim=32)
    add_mtp(src)
    cal = tmp_path / "calibration.txt"
    cal.write_text(inspect.getsource(json_) * 4)   # real text nobody here wrote: the stdlib's json package
    out = quantize(src, dst, method="autoround", group_size=64, calibration=[str(cal)], iters=2, quiet=True)
    assert out["method"] == "autoround" and out["layers"] >= 7
    fmt, layers, qcfg = _layers(dst)
    assert qcfg["quant_method"] == "auto-round" and fmt.layout == "gptq" and len(layers) >= 7
    _check_logits(src, dst, direct=False)
    ids = torch.randint(3, 500, (40,), generator=torch.Generator().manual_seed(2)).tolist()
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    plain, drafted = (LLM(dst, device="cpu", dtype="float32", num_speculative_tokens=n).generate(
        prompt_token_ids=[ids], sampling_params=sp)[0].token_ids for n in (0, 2))
    assert plain == drafted


def test_weight_kl_is_small_for_int4_and_zero_for_the_same_model(tmp_path):
    from sketchkv.models.presets import save_random_checkpoint
    from sketchkv.quantize import quantize, weight_kl
    src = str(tmp_path / "bf16")
    save_random_checkpoint("tiny-hybrid", src)
    os.makedirs(os.path.join(src, "calibration"))
    with open(os.path.join(src, "calibration", "a.txt"), "w") as f:
        f.write("def f(x):\n    return x + 1\n" * 400)
    quantize(src, str(tmp_path / "int4"), quiet=True)
    same = weight_kl(src, src, samples=1, prompt=64, continuation=16, device="cpu", dtype="float32")
    kl = weight_kl(src, str(tmp_path / "int4"), samples=1, prompt=64, continuation=16, device="cpu", dtype="float32")
    assert same["kl_mean"] < 1e-9 and same["top1"] == 1.0
    assert 0 < kl["kl_mean"] < 0.5 and kl["tokens"] == 16
    assert kl["calibration"] and kl["text"] == "the calibration text"
    # held-out text of its own (what a calibrated method must be scored on): other tokens, another KL
    other = tmp_path / "other.txt"
    other.write_text("for i in range(10):\n    print(i * i, end=' ')\n" * 300)
    held = weight_kl(src, str(tmp_path / "int4"), samples=1, prompt=64, continuation=16, device="cpu",
                     dtype="float32", eval_texts=[str(other)])
    assert not held["calibration"] and held["text"] == "1 held-out text file(s)" and held["kl_mean"] != kl["kl_mean"]


# ---- the -w4a16 presets ---------------------------------------------------------------------------------------

def test_w4a16_preset_builds_int4_without_the_dense_weights():
    """The 27B shape on the meta device: int4 projections (+ bf16 embeddings, lm_head, gates) come to ~1/3.5 of
    the bf16 bytes, and what the floor / memory accounting count are the int4 tensors."""
    from sketchkv.bench.floor import weight_bytes
    from sketchkv.models.build import build_model
    from sketchkv.models.presets import preset_config, preset_int4_layers
    sizes = {}
    for name in ("qwen3.5-27b", "qwen3.5-27b-w4a16"):
        cfg, _ = preset_config(name)
        model = build_model(cfg, torch.bfloat16, torch.device("meta"), preset_int4_layers(cfg))
        sizes[name] = sum(p.numel() * p.element_size() for p in model.parameters())
        if name.endswith("w4a16"):
            assert weight_bytes(model)[0] < sizes[name]
    assert 0.25 < sizes["qwen3.5-27b-w4a16"] / sizes["qwen3.5-27b"] < 0.35


def test_w4a16_preset_generates_on_cpu():
    llm = LLM("random:tiny-hybrid-w4a16", device="cpu", dtype="float32", block_size=16, max_model_len=256)
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    a = llm.generate(prompt_token_ids=[[1, 2, 3, 4]], sampling_params=sp)[0].token_ids
    assert len(a) == 6 and a == llm.generate(prompt_token_ids=[[1, 2, 3, 4]], sampling_params=sp)[0].token_ids


# ---- CUDA (run on the H200) -------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("model", ["random:tiny-hybrid-w4a16", "ct"])
def test_gpu_int4_model_matches_its_dequantized_bf16_twin(ct_ckpt, model):
    """Triton GEMM, CUDA graphs: greedy tokens and logits against the same weights dequantized to bf16 nn.Linear
    layers (the dense path the engine has always run), eager."""
    from sketchkv.layers.int4_linear import Int4Linear
    from sketchkv.models.fuse import fuse_projections
    if model == "ct":
        model = ct_ckpt("qwen3_5-sym-g128")[1]
    ids = torch.randint(3, 500, (300,), generator=torch.Generator().manual_seed(1)).tolist()
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    int4 = LLM(model, device="cuda", dtype="bfloat16", block_size=16, gpu_memory_utilization=0.4)
    out = int4.generate(prompt_token_ids=[ids], sampling_params=sp)[0].token_ids
    logits4 = last_logits(int4, ids).float()
    dense = LLM(model, device="cuda", dtype="bfloat16", block_size=16, enforce_eager=True,
                gpu_memory_utilization=0.4)
    md = dense.engine.runner.model
    with torch.no_grad():  # the twin: every int4 layer as a dense linear of its dequantized weight
        weights = {n: _fused_slice_weight(md, n, m) for n, m in md.named_modules() if isinstance(m, Int4Linear)}
        for name, w in weights.items():
            old = md.get_submodule(name)
            lin = torch.nn.Linear(old.in_features, old.out_features, bias=old.bias is not None, device="cuda",
                                  dtype=torch.bfloat16)
            lin.weight.copy_(w)
            if old.bias is not None:
                lin.bias.copy_(old.bias)
            parent, _, attr = name.rpartition(".")
            setattr(md.get_submodule(parent), attr, lin)
        for mod in md.modules():
            for attr in ("qkv", "gate_up", "in_proj"):
                if getattr(mod, attr, None) is not None:
                    setattr(mod, attr, None)
        fuse_projections(md)
    assert not any(isinstance(m, Int4Linear) for m in md.modules())
    logits_d = last_logits(dense, ids).float()
    # bf16 activations with fp32 accumulation in both; the GEMMs sum in different orders
    torch.testing.assert_close(logits4, logits_d, rtol=0.03, atol=0.03)
    # greedy tokens: a random-weight model's logits are nearly flat, so the two runs may part at a near-tie
    # (H200 run 100: 6 of 24 equal, then apart). Teacher-forced instead: the twin, fed the int4 model's
    # tokens, ranks each of them within bf16 noise of its own top-1.
    for i, tok in enumerate(out):
        twin = last_logits(dense, ids + list(out[:i])).float()
        assert twin.max() - twin[tok] <= 0.05, (i, tok, (twin.max() - twin[tok]).item())


def _fused_slice_weight(model, name, lin):
    """W [N, K] of an Int4Linear, unfused or a member of its parent's fused projection."""
    from sketchkv.ops.w4a16_gemm import dequantize_prepared
    if lin.int4 is not None:
        return lin.dequantize(torch.bfloat16)
    parent = model.get_submodule(name.rpartition(".")[0])
    for attr, members in (("qkv", ("q_proj", "k_proj", "v_proj")), ("gate_up", ("gate_proj", "up_proj")),
                          ("in_proj", ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"))):
        fused = getattr(parent, attr, None)
        if fused is None or name.rpartition(".")[2] not in members:
            continue
        w = fused.int4 if isinstance(fused, MixedWeight) else fused
        full = dequantize_prepared(w, torch.bfloat16)
        start = 0
        for m in members:
            sub = getattr(parent, m)
            if m == name.rpartition(".")[2]:
                return full[start:start + sub.out_features]
            start += sub.out_features
    raise AssertionError(name)


@pytest.mark.gpu
def test_gpu_27b_w4a16_preset_is_packed_on_the_device_without_the_bf16_weights():
    """random:qwen3.5-27b-w4a16 holds 16.8 GiB (int4 projections + bf16 embeddings, lm_head, gates; bf16: 50.1) and
    its load never comes near the bf16 weights: one dense layer at a time exists while the modules are built."""
    from sketchkv.models.loader import load_model
    torch.cuda.reset_peak_memory_stats()
    cfg, model = load_model("random:qwen3.5-27b-w4a16", torch.bfloat16, torch.device("cuda"))
    peak = torch.cuda.max_memory_allocated() / 2**30
    held = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**30
    assert held < 17.5 and peak < held + 3, (held, peak)
    x = torch.randint(0, 1000, (8,), device="cuda")
    assert torch.isfinite(model.compute_logits(model.model.embed_tokens(x))).all()

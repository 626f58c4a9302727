"""`sketchkv quantize SRC DST`: a bf16 checkpoint -> W4A16 (int4 weights in groups, activations in the model dtype),
then the KL of the int4 model's next-token distributions from the bf16 model's.

- `rtn` (always available): round-to-nearest per group (scale and zero point from each group's min / max, as
  compressed-tensors computes them), written as compressed-tensors `pack-quantized` by that library's own
  compressor: the format llm-compressor writes, which transformers and vLLM load. Tensors are streamed one at a
  time, shard by shard (a 27B model never sits in memory whole).
- `autoround`: AutoRound (the auto-round library, when installed) with calibration text; its default export
  (GPTQ packing for sym, AWQ packing for asym), which transformers and vLLM also load. Reference model, KL(bf16 ||
  W4A16) over 512 held-out tokens (CPU, 2026-12-06): RTN 0.0253 nats/token (top-1 0.932), AutoRound 200 iterations
  0.0169 (0.924; 19 minutes on 2 cores); SmolLM2-135M (asym, group 32): RTN 0.253, AutoRound 60 iterations 0.064
  (48 minutes). Score held-out text (--kl-text): the calibration text flatters autoround.
The int4 layers are the projections of models/quantized.py's INT4_TARGETS; lm_head, embeddings, norms, GDN gates
stay as they are, and so does the MTP head with rtn (what production AutoRound checkpoints do); auto-round 0.16.1
quantizes the MTP head's projections too (its extra-tensors export), which sketchkv loads and drafts with.
"""
import json
import os
import shutil

import torch

from sketchkv.errors import SketchKVError

METHODS = ("rtn", "autoround")


def quantize(src: str, dst: str, method: str = "rtn", group_size: int = 128, sym: bool = True,
             calibration: list[str] | None = None, iters: int = 200, quiet: bool = False) -> dict:
    """Write the W4A16 checkpoint of `src` to `dst`. -> {"method", "layers", "bytes_in", "bytes_out"}."""
    if os.path.abspath(src) == os.path.abspath(dst):
        raise SketchKVError("quantize: DST must differ from SRC")
    if group_size not in (32, 64, 128):
        raise SketchKVError(f"quantize: --group-size must be 32, 64 or 128, got {group_size}")
    if method == "rtn":
        return _rtn(src, dst, group_size, sym, quiet)
    if method == "autoround":
        return _autoround(src, dst, group_size, sym, calibration, iters)
    raise SketchKVError(f"quantize: unknown method {method!r} (choose from {', '.join(METHODS)})")


def _targets(src: str, group_size: int) -> tuple[dict, set[str]]:
    """(raw config.json, names of our layers to make int4)."""
    from sketchkv.models.build import build_model
    from sketchkv.models.loader import load_config
    from sketchkv.models.quantized import default_int4_layers
    cfg = load_config(src)
    if cfg.quantization_config:
        raise SketchKVError(f"{src}: already quantized ({cfg.quantization_config.get('quant_method')})")
    with open(os.path.join(src, "config.json")) as f:
        raw = json.load(f)
    return raw, set(default_int4_layers(build_model(cfg, torch.float32, torch.device("meta")), group_size))


def _rtn(src: str, dst: str, group_size: int, sym: bool, quiet: bool) -> dict:
    try:
        from compressed_tensors.compressors import PackedQuantizationCompressor
    except ImportError:
        raise SketchKVError("quantize needs the compressed-tensors package: pip install 'sketchkv[quantize]'") \
            from None
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme
    from compressed_tensors.quantization.utils.helpers import calculate_qparams
    from safetensors import safe_open
    from safetensors.torch import save_file
    from tqdm import tqdm

    from sketchkv.models.loader import normalize_name, weight_files
    raw, targets = _targets(src, group_size)
    args = QuantizationArgs(num_bits=4, type="int", symmetric=sym, strategy="group", group_size=group_size)
    scheme = QuantizationScheme(targets=["Linear"], weights=args, format="pack-quantized")
    files = weight_files(src)
    os.makedirs(dst, exist_ok=True)
    keys = {}
    for file in files:
        with safe_open(file, framework="pt") as f:
            keys[file] = list(f.keys())
    done, kept, weight_map = [], [], {}
    bytes_in = bytes_out = 0
    bar = tqdm(total=sum(len(k) for k in keys.values()), desc="quantize (rtn)", unit="tensor", disable=quiet)
    for file in files:
        out = {}
        with safe_open(file, framework="pt") as f:
            for key in keys[file]:
                t = f.get_tensor(key)
                bytes_in += t.numel() * t.element_size()
                name = normalize_name(key)
                layer = key[:-len(".weight")]
                if name is not None and key.endswith(".weight") and name[:-len(".weight")] in targets \
                        and t.shape[1] % group_size == 0 and t.shape[0] % 8 == 0:
                    w = t.float()
                    groups = w.reshape(w.shape[0], -1, group_size)
                    scale, zp = calculate_qparams(groups.amin(-1), groups.amax(-1), args)
                    # the stored (model-dtype) scale is the one the codes are rounded against
                    parts = PackedQuantizationCompressor.compress(
                        {"weight": w, "weight_scale": scale.to(t.dtype).float(), "weight_zero_point": zp}, scheme)
                    for part, v in parts.items():
                        v = v.to(t.dtype) if part == "weight_scale" else v
                        out[f"{layer}.{part}"] = v.contiguous()
                    done.append(layer)
                else:
                    out[key] = t
                    if t.dim() == 2 and key.endswith(".weight"):
                        kept.append(layer)
                bar.update()
        name = os.path.basename(file)
        save_file(out, os.path.join(dst, name), metadata={"format": "pt"})
        bytes_out += sum(v.numel() * v.element_size() for v in out.values())
        weight_map.update({k: name for k in out})
    bar.close()
    if len(files) > 1:
        with open(os.path.join(dst, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": bytes_out}, "weight_map": weight_map}, f, indent=1)
    qcfg = QuantizationConfig(config_groups={"group_0": scheme}, ignore=sorted(kept), format="pack-quantized",
                              quantization_status="compressed")
    import compressed_tensors
    raw["quantization_config"] = {"version": compressed_tensors.__version__, "quant_method": "compressed-tensors",
                                  "sparsity_config": {}, "transform_config": {},
                                  **qcfg.model_dump(exclude=["quant_method"])}
    _write_config_and_side_files(src, dst, raw)
    return {"method": "rtn", "layers": len(done), "bytes_in": bytes_in, "bytes_out": bytes_out}


def _write_config_and_side_files(src: str, dst: str, raw: dict) -> None:
    """config.json with its quantization_config; tokenizer and other small files copied (not the weights, nor
    the key basis, whose fingerprint is the bf16 model's: `sketchkv fit-basis --model DST` fits the int4 one)."""
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(raw, f, indent=2)
    for name in os.listdir(src):
        path = os.path.join(src, name)
        if os.path.isfile(path) and not name.endswith(".safetensors") and name not in (
                "config.json", "model.safetensors.index.json"):
            shutil.copy2(path, os.path.join(dst, name))


def _autoround(src: str, dst: str, group_size: int, sym: bool, calibration: list[str] | None, iters: int) -> dict:
    if not torch.cuda.is_available():  # transformers binds fla's GDN kernels when fla is installed: GPU only
        import sys
        sys.modules.setdefault("fla", None)
    try:
        from auto_round import AutoRound
    except ImportError:
        raise SketchKVError("quantize --method autoround needs the auto-round package (pip install auto-round)") \
            from None
    texts = _calibration_texts(src, calibration)
    raw, targets = _targets(src, group_size)
    layer_config = {}  # AutoRound quantizes every Linear in the blocks by default: keep the others at 16 bits
    from sketchkv.models.build import build_model
    from sketchkv.models.loader import load_config
    for name, m in build_model(load_config(src), torch.float32, torch.device("meta")).named_modules():
        if isinstance(m, torch.nn.Linear) and name not in targets and not name.startswith("mtp."):
            layer_config[name] = {"bits": 16}
    samples = _token_samples(src, texts)
    ar = AutoRound(src, bits=4, group_size=group_size, sym=sym, iters=iters, dataset=samples, nsamples=len(samples),
                   seqlen=samples[0]["input_ids"].shape[-1], device_map="cpu"
                   if not torch.cuda.is_available() else 0, layer_config=layer_config)
    tmp = dst + ".autoround"
    ar.quantize_and_save(tmp, format="auto_round")
    inner = [os.path.join(tmp, d) for d in os.listdir(tmp) if os.path.isdir(os.path.join(tmp, d))]
    out = inner[0] if len(inner) == 1 and not os.path.isfile(os.path.join(tmp, "config.json")) else tmp
    shutil.move(out, dst)
    shutil.rmtree(tmp, ignore_errors=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        if os.path.isfile(os.path.join(src, name)) and not os.path.isfile(os.path.join(dst, name)):
            shutil.copy2(os.path.join(src, name), os.path.join(dst, name))
    _carry_mtp(src, dst)
    return {"method": "autoround", "layers": len(targets), "iters": iters}


def _carry_mtp(src: str, dst: str) -> None:
    """Where the export has no MTP head (mtp.*: transformers drops it, and auto-round before 0.16 with it), copy it
    over as it is, in a shard of its own listed in the index (written if the export has none). auto-round 0.16.1
    quantizes and exports it itself (model_extra_tensors.safetensors): kept (a second copy fails the load)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from sketchkv.models.loader import weight_files
    for file in weight_files(dst):
        with safe_open(file, framework="pt") as f:
            if any(k.startswith("mtp.") for k in f.keys()):
                return
    mtp = {}
    for file in weight_files(src):
        with safe_open(file, framework="pt") as f:
            mtp.update({k: f.get_tensor(k) for k in f.keys() if k.startswith("mtp.")})
    if not mtp:
        return
    save_file(mtp, os.path.join(dst, "model-mtp.safetensors"), metadata={"format": "pt"})
    index_file = os.path.join(dst, "model.safetensors.index.json")
    if os.path.isfile(index_file):
        with open(index_file) as f:
            index = json.load(f)
    else:
        with safe_open(os.path.join(dst, "model.safetensors"), framework="pt") as f:
            index = {"metadata": {}, "weight_map": {k: "model.safetensors" for k in f.keys()}}
    index["weight_map"].update({k: "model-mtp.safetensors" for k in mtp})
    with open(index_file, "w") as f:
        json.dump(index, f, indent=1)


def _token_samples(model: str, texts: list[str], max_len: int = 2048) -> list[dict]:
    """The calibration texts, tokenized and concatenated, as len(texts) whole samples of one length (at most
    max_len), each {"input_ids": [1, L], "attention_mask": None}. Why no mask: given strings, auto-round 0.16 masks
    every sample's last token and replays each block with block 0's cached inputs, so a hybrid model's first (GDN)
    block caches a 2-D padding mask that its full-attention blocks then receive (SDPA refuses it: the crash on
    qwen3_5). Unpadded samples need none; every block builds its causal mask itself."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model)
    ids = torch.tensor([i for t in texts for i in tok(t)["input_ids"]], dtype=torch.long)
    length = min(max_len, ids.numel() // len(texts))
    if length < 32:
        raise SketchKVError(f"calibration text too short: {ids.numel()} tokens for {len(texts)} samples "
                            "(need >= 32 tokens per sample)")
    return [{"input_ids": ids[i * length:(i + 1) * length][None], "attention_mask": None} for i in range(len(texts))]


def _calibration_texts(model: str, paths: list[str] | None, n: int = 64) -> list[str]:
    """Calibration documents: the given files, else the model's calibration/ folder (the bundled reference model)."""
    if not paths:
        folder = os.path.join(model, "calibration")
        if not os.path.isdir(folder):
            raise SketchKVError(f"{model} has no calibration/ folder: pass text files with --calibration FILE ... "
                                "(or --kl-samples 0 to skip the KL report)")
        paths = sorted(os.path.join(folder, f) for f in os.listdir(folder))
    texts = []
    for p in paths[:n]:
        with open(p, errors="replace") as f:
            texts.append(f.read())
    return texts


# ---- the KL report ----------------------------------------------------------------------------------------

def weight_kl(bf16: str, int4: str, samples: int = 4, prompt: int = 448, continuation: int = 64,
              device: str = "auto", dtype: str = "auto", texts: list[str] | None = None,
              eval_texts: list[str] | None = None) -> dict:
    """Mean KL(bf16 || W4A16) in nats per token and top-1 agreement, teacher-forced over the same held-out tokens
    (the `eval_texts` files, else the bf16 model's heldout.json files, else the `texts` files, else its
    calibration/ folder): `samples` windows of `prompt` tokens, the next `continuation` tokens scored (eval/kld.py's
    arithmetic). The result's "text" names the source; "calibration" is True when it was the calibration text (for
    a calibrated method such as autoround, an in-sample score)."""
    import numpy as np

    from sketchkv.eval import common as C
    from sketchkv.eval.kld import compare
    from sketchkv.llm import LLM
    n = samples * (prompt + continuation + 1)
    ids, calibration = None, False
    if not eval_texts:
        try:
            ids = C.heldout_token_ids(bf16, n)
            source = f"{bf16}/heldout.json"
        except SketchKVError:
            pass
    if ids is None:
        tok = C.load_tokenizer(bf16)
        ids = []
        for text in _calibration_texts(bf16, eval_texts or texts):
            ids += tok.encode(text).ids
        calibration = not eval_texts
        source = "the calibration text" if calibration else f"{len(eval_texts)} held-out text file(s)"
        if len(ids) < n:
            raise SketchKVError(f"only {len(ids)} tokens of text for the KL, need {n}")
    step = prompt + continuation + 1
    windows = [ids[i * step:(i + 1) * step] for i in range(samples)]
    prompts = [w[:prompt] for w in windows]
    conts = [w[prompt:] for w in windows]
    opts = dict(device=device, dtype=dtype, max_model_len=step + 16, max_num_seqs=samples, enable_prefix_caching=False)
    rows = {}
    for name, path in (("bf16", bf16), ("int4", int4)):
        llm = LLM(path, **opts)
        rows[name] = [r[1:] for r in llm.teacher_force(prompts, conts)]
        C.release(llm)
    kls, top1 = [], []
    for ref, cand in zip(rows["bf16"], rows["int4"]):
        kl, t1, _ = compare(ref, cand, [0] * ref.shape[0])  # (the NLL of compare is not reported)
        kls.append(kl)
        top1.append(t1)
    kl_all = np.concatenate(kls)
    return {"kl_mean": float(kl_all.mean()), "kl_p99": float(np.quantile(kl_all, 0.99)),
            "top1": float(np.concatenate(top1).mean()), "tokens": int(kl_all.size), "samples": samples,
            "text": source, "calibration": calibration}

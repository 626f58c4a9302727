"""Named model shapes with random weights, built without a checkpoint (`model="random:NAME"`).

Benchmarks use them: a random-weight Qwen3.5-27B has the real memory traffic of the model, so
speed is measured without downloading 54 GB (its attention picks are meaningless, though).
"""
import torch

from sketchkv.errors import CheckpointError
from sketchkv.layers.int4_linear import Int4Linear
from sketchkv.models.build import build_model
from sketchkv.models.model_config import ModelConfig
from sketchkv.models.quantized import default_int4_layers

PRESETS = {
    # Qwen3.5-27B / Qwen3.8-27B shape: 64 layers (48 GDN + 16 gated attention), 24/4 heads x 256.
    "qwen3.5-27b": dict(model_type="qwen3_5_text", vocab_size=248320, hidden_size=5120, num_hidden_layers=64,
                        num_attention_heads=24, num_key_value_heads=4, head_dim=256, intermediate_size=17408,
                        linear_num_key_heads=16, linear_num_value_heads=48, linear_key_head_dim=128,
                        linear_value_head_dim=128, linear_conv_kernel_dim=4, max_position_embeddings=262144,
                        rope_parameters={"rope_type": "default", "rope_theta": 10000000.0,
                                         "partial_rotary_factor": 0.25}, rms_norm_eps=1e-6,
                        tie_word_embeddings=False, eos_token_id=248044),
    # Reduced qwen4_exp (Qwen3.8-Flash-Next family) for one H200: the seed's attention side exactly
    # (48 layers = 36 GDN + 12 QSA layers of 2 KV heads x 256, indexer 16 x 128, budget 2048, ratio 4),
    # a smaller MoE (64 experts, top 8, 512 wide; the real model has 512 experts) and small n-gram tables
    # (4 PLE layers, base 200K rows per head instead of 20M). ~14.7B params, 27.3 GiB in bf16.
    "qwen4-exp-h200": dict(model_type="qwen4_exp_text", vocab_size=248320, hidden_size=2048, num_hidden_layers=48,
                           num_attention_heads=16, num_key_value_heads=2, head_dim=256, linear_num_key_heads=16,
                           linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
                           linear_conv_kernel_dim=4, num_experts=64, num_experts_per_tok=8, moe_intermediate_size=512,
                           shared_expert_intermediate_size=512, hc_count=4, hc_lowrank=320,
                           ple_layer_ids=[1, 5, 9, 13], ple_embed_dim=2048, ngram_size=3, heads_per_ngram=8,
                           ngram_vocab_size_base=200_000, make_ngram_vocab_size_divisible_by=128,
                           indexer_n_heads=16, indexer_kv_heads=1, indexer_head_dim=128, indexer_budget=2048,
                           indexer_compress_ratio=4, max_position_embeddings=1048576,
                           rope_parameters={"rope_type": "default", "rope_theta": 10000000.0,
                                            "partial_rotary_factor": 0.25}, rms_norm_eps=1e-6,
                           tie_word_embeddings=False, eos_token_id=248044),
    # A small qwen4_exp for CPU smoke runs (QSA budget 64 tokens).
    "tiny-qwen4-exp": dict(model_type="qwen4_exp_text", vocab_size=1024, hidden_size=128, num_hidden_layers=4,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=64, linear_num_key_heads=2,
                           linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32,
                           num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                           shared_expert_intermediate_size=64, hc_count=2, hc_lowrank=32, ple_layer_ids=[1],
                           ple_embed_dim=64, heads_per_ngram=2, ngram_vocab_size_base=1000,
                           indexer_n_heads=4, indexer_head_dim=32, indexer_budget=64, indexer_compress_ratio=4,
                           max_position_embeddings=32768, eos_token_id=0),
    # A small hybrid for smoke tests on CPU.
    "tiny-hybrid": dict(model_type="qwen3_5_text", vocab_size=1024, hidden_size=128, num_hidden_layers=4,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=64, intermediate_size=256,
                        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
                        linear_value_head_dim=32, max_position_embeddings=32768, eos_token_id=0),
}


W4A16 = {"quant_method": "random", "bits": 4, "group_size": 128, "sym": True}  # the -w4a16 suffix


def preset_config(name: str) -> tuple[ModelConfig, dict]:
    """A preset's config; the suffix `+mtp` (e.g. `random:qwen3.5-27b+mtp`) adds one MTP layer (hybrid
    presets), for speculative-decoding speed runs (random drafts are rejected: every step verifies); `-w4a16`
    (before it: `random:qwen3.5-27b-w4a16+mtp`) makes the projections int4 in groups of 128 (the production
    AutoRound checkpoint's layout: lm_head, embeddings, GDN gates and the MTP head stay in the model dtype)."""
    base, mtp = (name[:-len("+mtp")], True) if name.endswith("+mtp") else (name, False)
    base, w4a16 = (base[:-len("-w4a16")], True) if base.endswith("-w4a16") else (base, False)
    if base not in PRESETS:
        raise CheckpointError(f"unknown random model preset {name!r} (choose from {', '.join(PRESETS)}; "
                              "append -w4a16 for int4 weights, +mtp for an MTP layer)")
    raw = dict(PRESETS[base])
    if w4a16:
        raw["quantization_config"] = dict(W4A16)
    if mtp:
        if raw["model_type"] not in ("qwen3_5_text", "qwen3_next"):
            raise CheckpointError(f"random:{name}: MTP layers exist for qwen3_5_text / qwen3_next presets only")
        raw["mtp_num_hidden_layers"] = 1
    return ModelConfig.from_hf(raw, f"random:{name}"), raw


def preset_int4_layers(cfg: ModelConfig) -> dict[str, int] | None:
    """{layer: group size} of a -w4a16 preset's int4 layers (None for bf16 presets)."""
    if not cfg.quantization_config:
        return None
    return default_int4_layers(build_model(cfg, torch.float32, torch.device("meta")),
                               cfg.quantization_config["group_size"])


@torch.no_grad()
def randomize(model: torch.nn.Module, seed: int = 0, std: float = 0.02) -> None:
    """Initialise like transformers' Qwen3.5: normal weights, zero-centred norms at 0, GDN decay in range.
    Int4 layers: uniform random codes, zero 7.5 (codes 0..15 centred: mean 0), scales giving the same std, drawn on
    the device. A zero of 8 (the symmetric checkpoints' value) would give every weight a mean of -scale / 2: one
    shared direction in every projection's output, near-constant queries, and top-k picks that barely move from
    step to step (H200 run 99: 98% hot-buffer hits against bf16's 3%, which flattered W4A16 in that comparison)."""
    g = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    int4 = set()
    for m in model.modules():
        if isinstance(m, Int4Linear):
            m.qweight.random_(-2**31, 2**31 - 1, generator=g)  # every nibble uniform in 0..15
            m.scales.fill_(std / 4.61)                          # std of 16 uniform levels is 4.61
            m.zeros.fill_(7.5)
            int4.update(id(t) for t in (m.qweight, m.scales, m.zeros))
    for name, p in model.named_parameters():
        if id(p) in int4:
            continue
        if name.endswith("A_log"):
            p.copy_(torch.empty_like(p, dtype=torch.float32).uniform_(0.01, 16, generator=g).log())
        elif name.endswith("dt_bias") or (name.endswith("norm.weight") and "linear_attn" in name):
            p.fill_(1.0)
        elif "norm" in name:
            p.zero_() if getattr(model.config, "zero_centered_norm", False) else p.fill_(1.0)
        else:
            p.normal_(0.0, std, generator=g)


def byte_tokenizer_files(path: str) -> None:
    """A byte-level BPE tokenizer with no merges (256 byte tokens + specials) and a ChatML template."""
    import json
    import os
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    tok.save(os.path.join(path, "tokenizer.json"))
    template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "<|endoftext|>", "chat_template": template}, f, indent=1)


def save_random_checkpoint(name: str, path: str, seed: int = 0, mtp_layers: int = 0) -> None:
    """Write a Hugging Face directory (config.json, model.safetensors, tokenizer) for a preset with
    random weights: a stand-in model for smoke runs until a trained one is at hand. mtp_layers > 0
    adds an MTP head (mtp.* tensors) for speculative decoding (hybrid presets)."""
    import json
    import os
    from safetensors.torch import save_file
    cfg, raw = preset_config(name)
    if cfg.quantization_config:
        raise CheckpointError(f"{name}: write the bf16 preset, then `sketchkv quantize` it for an int4 checkpoint")
    if mtp_layers:
        raw["mtp_num_hidden_layers"] = mtp_layers
        cfg = ModelConfig.from_hf(raw, f"random:{name}")
    os.makedirs(path, exist_ok=True)
    model = build_model(cfg, torch.float32, torch.device("cpu"))
    randomize(model, seed)
    tensors = {n: p.detach().to(torch.bfloat16).contiguous() for n, p in model.named_parameters()}
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    byte_tokenizer_files(path)
    with open(os.path.join(path, "tokenizer.json")) as f:
        eos = json.load(f)["added_tokens"][0]["id"]  # <|endoftext|>
    arch = {"qwen3_5_text": "Qwen3_5ForCausalLM"}.get(raw["model_type"], "LlamaForCausalLM")
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({**raw, "eos_token_id": eos, "architectures": [arch], "torch_dtype": "bfloat16"}, f, indent=1)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": eos}, f)

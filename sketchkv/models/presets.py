"""Named model shapes with random weights, built without a checkpoint (`model="random:NAME"`).

Benchmarks use them: a random-weight Qwen3.5-27B has the real memory traffic of the model, so
speed is measured without downloading 54 GB (its attention picks are meaningless, though).
"""
import torch

from sketchkv.errors import CheckpointError
from sketchkv.models.model_config import ModelConfig

PRESETS = {
    # Qwen3.5-27B / Qwen3.8-27B shape: 64 layers (48 GDN + 16 gated attention), 24/4 heads x 256.
    "qwen3.5-27b": dict(model_type="qwen3_5_text", vocab_size=248320, hidden_size=5120, num_hidden_layers=64,
                        num_attention_heads=24, num_key_value_heads=4, head_dim=256, intermediate_size=17408,
                        linear_num_key_heads=16, linear_num_value_heads=48, linear_key_head_dim=128,
                        linear_value_head_dim=128, linear_conv_kernel_dim=4, max_position_embeddings=262144,
                        rope_parameters={"rope_type": "default", "rope_theta": 10000000.0,
                                         "partial_rotary_factor": 0.25}, rms_norm_eps=1e-6,
                        tie_word_embeddings=False, eos_token_id=248044),
    # A small hybrid for smoke tests on CPU.
    "tiny-hybrid": dict(model_type="qwen3_5_text", vocab_size=1024, hidden_size=128, num_hidden_layers=4,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=64, intermediate_size=256,
                        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
                        linear_value_head_dim=32, max_position_embeddings=32768, eos_token_id=0),
}


def preset_config(name: str) -> tuple[ModelConfig, dict]:
    if name not in PRESETS:
        raise CheckpointError(f"unknown random model preset {name!r} (choose from {', '.join(PRESETS)})")
    raw = dict(PRESETS[name])
    return ModelConfig.from_hf(raw, f"random:{name}"), raw


@torch.no_grad()
def randomize(model: torch.nn.Module, seed: int = 0, std: float = 0.02) -> None:
    """Initialise like transformers' Qwen3.5: normal weights, zero-centred norms at 0, GDN decay in range."""
    g = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("A_log"):
            p.copy_(torch.empty_like(p, dtype=torch.float32).uniform_(0.01, 16, generator=g).log())
        elif name.endswith("dt_bias") or (name.endswith("norm.weight") and "linear_attn" in name):
            p.fill_(1.0)
        elif "norm" in name:
            p.zero_() if getattr(model.config, "zero_centered_norm", False) else p.fill_(1.0)
        else:
            p.normal_(0.0, std, generator=g)

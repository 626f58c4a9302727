"""One normalised view of a Hugging Face config.json for every supported architecture."""
from dataclasses import dataclass, field

from sketchkv.errors import CheckpointError

# model_type -> architecture family implemented in sketchkv.models
SUPPORTED = {
    "qwen3_5": "hybrid", "qwen3_5_text": "hybrid", "qwen3_next": "hybrid",
    "qwen3": "dense", "llama": "dense",
}


@dataclass
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    layer_types: list[str]            # "full_attention" | "linear_attention" per layer
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int
    rope_theta: float
    rope_scaling: dict | None
    rms_norm_eps: float
    intermediate_size: int
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False             # per-head q/k RMSNorm (qwen3, hybrids)
    gated_attention: bool = False     # q_proj also yields a per-head sigmoid output gate (hybrids)
    zero_centered_norm: bool = False  # norms store w - 1 (hybrids)
    # Gated DeltaNet
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 4
    interleaved_gdn_proj: bool = False  # qwen3_next checkpoints store in_proj_qkvz / in_proj_ba
    # MoE (qwen3_next)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    mtp_num_layers: int = 0
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None

    @property
    def family(self) -> str:
        return SUPPORTED[self.model_type]

    @property
    def full_attention_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "full_attention"]

    @property
    def linear_attention_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "linear_attention"]

    def is_moe_layer(self, i: int) -> bool:
        return (self.num_experts > 0 and i not in self.mlp_only_layers
                and (i + 1) % self.decoder_sparse_step == 0)

    @classmethod
    def from_hf(cls, raw: dict, where: str = "config.json") -> "ModelConfig":
        top_type = raw.get("model_type")
        cfg = raw.get("text_config") or raw if top_type == "qwen3_5" else raw
        model_type = cfg.get("model_type", top_type)
        if model_type == "qwen3_5":
            model_type = "qwen3_5_text"
        if model_type not in SUPPORTED:
            raise CheckpointError(f"{where}: unsupported model_type {model_type!r} "
                                  f"(supported: {', '.join(sorted(SUPPORTED))})")
        try:
            return cls._parse(cfg, raw, model_type)
        except KeyError as e:
            raise CheckpointError(f"{where}: missing required field {e.args[0]!r} for {model_type}") from None

    @classmethod
    def _parse(cls, cfg: dict, raw: dict, model_type: str) -> "ModelConfig":
        hybrid = SUPPORTED[model_type] == "hybrid"
        n_layers = cfg["num_hidden_layers"]
        n_heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // n_heads
        rope = dict(cfg.get("rope_parameters") or {})
        theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
        partial = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25 if hybrid else 1.0))
        scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        if hybrid:
            layer_types = cfg.get("layer_types") or [
                "full_attention" if (i + 1) % cfg.get("full_attention_interval", 4) == 0 else "linear_attention"
                for i in range(n_layers)]
        else:
            layer_types = ["full_attention"] * n_layers
        if len(layer_types) != n_layers or set(layer_types) - {"full_attention", "linear_attention"}:
            raise CheckpointError(f"config.json: layer_types must list {n_layers} entries of "
                                  f"full_attention/linear_attention, got {layer_types}")
        eos = raw.get("eos_token_id", cfg.get("eos_token_id"))
        eos = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        return cls(
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            num_layers=n_layers,
            layer_types=layer_types,
            num_heads=n_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or n_heads,
            head_dim=head_dim,
            rotary_dim=int(head_dim * partial),
            rope_theta=float(theta),
            rope_scaling=scaling,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            intermediate_size=cfg["intermediate_size"],
            max_position_embeddings=cfg.get("max_position_embeddings", 32768),
            tie_word_embeddings=raw.get("tie_word_embeddings", cfg.get("tie_word_embeddings", False)),
            attention_bias=cfg.get("attention_bias", False),
            mlp_bias=cfg.get("mlp_bias", False),
            qk_norm=model_type != "llama",
            gated_attention=hybrid,
            zero_centered_norm=hybrid,
            linear_num_key_heads=cfg.get("linear_num_key_heads", 0) if hybrid else 0,
            linear_num_value_heads=cfg.get("linear_num_value_heads", 0) if hybrid else 0,
            linear_key_head_dim=cfg.get("linear_key_head_dim", 0) if hybrid else 0,
            linear_value_head_dim=cfg.get("linear_value_head_dim", 0) if hybrid else 0,
            linear_conv_kernel_dim=cfg.get("linear_conv_kernel_dim", 4),
            interleaved_gdn_proj=model_type == "qwen3_next",
            num_experts=cfg.get("num_experts", 0) if model_type == "qwen3_next" else 0,
            num_experts_per_tok=cfg.get("num_experts_per_tok", 0),
            moe_intermediate_size=cfg.get("moe_intermediate_size", 0),
            shared_expert_intermediate_size=cfg.get("shared_expert_intermediate_size", 0),
            norm_topk_prob=cfg.get("norm_topk_prob", True),
            decoder_sparse_step=cfg.get("decoder_sparse_step", 1) or 1,
            mlp_only_layers=list(cfg.get("mlp_only_layers") or []),
            mtp_num_layers=cfg.get("mtp_num_hidden_layers", 0) or 0,
            eos_token_ids=eos,
            bos_token_id=raw.get("bos_token_id", cfg.get("bos_token_id")),
        )

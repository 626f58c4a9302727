"""One normalised view of a Hugging Face config.json for every supported architecture."""
from dataclasses import dataclass, field

from sketchkv.errors import CheckpointError

# model_type -> architecture family implemented in sketchkv.models
SUPPORTED = {
    "qwen3_5": "hybrid", "qwen3_5_text": "hybrid", "qwen3_next": "hybrid",
    "qwen3": "dense", "qwen2": "dense", "llama": "dense",
    "qwen4_exp_text": "qwen4_exp",
}
# multimodal wrappers whose text_config holds the language model
WRAPPERS = {"qwen3_5": "qwen3_5_text", "qwen4_exp": "qwen4_exp_text"}


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
    qkv_bias: bool = False            # q/k/v projections carry a bias, o_proj none (qwen2)
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
    quantization_config: dict | None = None  # config.json's as is: int4 checkpoints (models/quantized.py)
    gdn_gate_act: str = "silu"        # Gated DeltaNet output gate activation (qwen4_exp: output_gate_type)
    # qwen4_exp: QSA indexer on the attention layers ("indexed_attention", listed here as full_attention)
    indexer_n_heads: int = 0
    indexer_kv_heads: int = 1         # must be 1 (one index key per token)
    indexer_head_dim: int = 0
    indexer_budget: int = 0           # tokens selected from complete blocks per query
    indexer_compress_ratio: int = 0   # tokens mean-pooled into one index block
    # qwen4_exp: hyper-connections (hc_count residual streams) and Per-Layer n-gram Embeddings
    hc_count: int = 0
    hc_lowrank: int = 0
    ple_layer_ids: list[int] = field(default_factory=list)  # one-indexed
    ple_embed_dim: int = 0
    ple_conv_kernel_size: int = 4
    ngram_size: int = 3
    heads_per_ngram: int = 8
    ngram_vocab_size_base: int = 20_000_000
    ngram_vocab_divisor: int = 128
    ngram_seed: int = 1234
    split_ngram_parts: int = 512

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
        cfg = raw.get("text_config") or raw if top_type in WRAPPERS else raw
        model_type = cfg.get("model_type", top_type)
        model_type = WRAPPERS.get(model_type, model_type)
        if model_type not in SUPPORTED:
            raise CheckpointError(f"{where}: unsupported model_type {model_type!r} "
                                  f"(supported: {', '.join(sorted(SUPPORTED))})")
        try:
            parsed = cls._parse(cfg, raw, model_type)
        except KeyError as e:
            raise CheckpointError(f"{where}: missing required field {e.args[0]!r} for {model_type}") from None
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"{where}: malformed field for {model_type} ({e})") from None
        if parsed.family == "qwen4_exp":
            problem = parsed.qwen4_problem()
            if problem:
                raise CheckpointError(f"{where}: {problem}")
        return parsed

    def qwen4_problem(self) -> str | None:
        """transformers' Qwen4ExpTextConfig.validate_architecture, plus what sketchkv needs (QSA present)."""
        if self.gdn_gate_act not in ("silu", "sigmoid"):
            return f"unsupported output_gate_type {self.gdn_gate_act!r} (silu or sigmoid)"
        if self.hc_count <= 1:
            return f"qwen4_exp needs hc_count > 1, got {self.hc_count}"
        if self.hc_lowrank <= 0:
            return f"hc_lowrank must be > 0, got {self.hc_lowrank}"
        if self.num_experts <= 0 or not 0 < self.num_experts_per_tok <= self.num_experts:
            return (f"num_experts_per_tok must be in [1, num_experts], got {self.num_experts_per_tok} and "
                    f"{self.num_experts}")
        if self.moe_intermediate_size <= 0 or self.shared_expert_intermediate_size <= 0:
            return "moe_intermediate_size and shared_expert_intermediate_size must be > 0"
        qsa = dict(indexer_n_heads=self.indexer_n_heads, indexer_head_dim=self.indexer_head_dim,
                   indexer_budget=self.indexer_budget, indexer_compress_ratio=self.indexer_compress_ratio)
        if any(v <= 0 for v in qsa.values()):
            return f"QSA indexer fields must all be set and positive, got {qsa}"
        if self.indexer_kv_heads != 1:
            return f"QSA needs indexer_kv_heads=1, got {self.indexer_kv_heads}"
        if self.indexer_budget % self.indexer_compress_ratio:
            return (f"indexer_budget ({self.indexer_budget}) must be divisible by indexer_compress_ratio "
                    f"({self.indexer_compress_ratio})")
        if self.rotary_dim > self.indexer_head_dim:
            return f"rotary_dim={self.rotary_dim} must fit the QSA index head (indexer_head_dim={self.indexer_head_dim})"
        if self.ple_layer_ids:
            heads = (self.ngram_size - 1) * self.heads_per_ngram
            if heads <= 0 or self.ple_embed_dim <= 0 or self.ple_embed_dim % heads:
                return f"ple_embed_dim ({self.ple_embed_dim}) must be a positive multiple of the n-gram heads ({heads})"
            bad = [i for i in self.ple_layer_ids if not 1 <= i <= self.num_layers
                   or self.layer_types[i - 1] != "linear_attention"]
            if bad:
                return f"ple_layer_ids must be one-indexed linear_attention layers, got {bad}"
            if not self.eos_token_ids:
                return "eos_token_id must be set when PLE layers are enabled"
        return None

    @classmethod
    def _parse(cls, cfg: dict, raw: dict, model_type: str) -> "ModelConfig":
        q4 = SUPPORTED[model_type] == "qwen4_exp"
        hybrid = SUPPORTED[model_type] == "hybrid" or q4
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
        if q4:  # QSA layers: "indexed_attention" (older checkpoints say full_attention); both carry the indexer
            layer_types = ["full_attention" if t == "indexed_attention" else t for t in layer_types]
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
            intermediate_size=cfg.get("intermediate_size", 0) if q4 else cfg["intermediate_size"],
            max_position_embeddings=cfg.get("max_position_embeddings", 32768),
            tie_word_embeddings=raw.get("tie_word_embeddings", cfg.get("tie_word_embeddings", False)),
            attention_bias=cfg.get("attention_bias", False),
            mlp_bias=cfg.get("mlp_bias", False),
            qkv_bias=model_type == "qwen2",
            qk_norm=model_type not in ("llama", "qwen2"),
            gated_attention=hybrid,
            zero_centered_norm=hybrid,
            linear_num_key_heads=cfg.get("linear_num_key_heads", 0) if hybrid else 0,
            linear_num_value_heads=cfg.get("linear_num_value_heads", 0) if hybrid else 0,
            linear_key_head_dim=cfg.get("linear_key_head_dim", 0) if hybrid else 0,
            linear_value_head_dim=cfg.get("linear_value_head_dim", 0) if hybrid else 0,
            linear_conv_kernel_dim=cfg.get("linear_conv_kernel_dim", 4),
            interleaved_gdn_proj=model_type == "qwen3_next",
            num_experts=cfg.get("num_experts", 512 if q4 else 0) if model_type in ("qwen3_next", "qwen4_exp_text") else 0,
            num_experts_per_tok=cfg.get("num_experts_per_tok", 10 if q4 else 0),
            moe_intermediate_size=cfg.get("moe_intermediate_size", 0),
            shared_expert_intermediate_size=cfg.get("shared_expert_intermediate_size", 0),
            norm_topk_prob=cfg.get("norm_topk_prob", True),
            decoder_sparse_step=cfg.get("decoder_sparse_step", 1) or 1,
            mlp_only_layers=list(cfg.get("mlp_only_layers") or []),
            mtp_num_layers=cfg.get("mtp_num_hidden_layers", 0) or 0,
            eos_token_ids=eos,
            bos_token_id=raw.get("bos_token_id", cfg.get("bos_token_id")),
            quantization_config=raw.get("quantization_config", cfg.get("quantization_config")),
            **(cls._qwen4_fields(cfg) if q4 else {}),
        )

    @staticmethod
    def _qwen4_fields(cfg: dict) -> dict:
        g = lambda k, d=0: d if cfg.get(k) is None else cfg[k]
        return dict(
            gdn_gate_act=cfg.get("output_gate_type") or cfg.get("hidden_act", "silu"),
            indexer_n_heads=int(g("indexer_n_heads")), indexer_kv_heads=int(g("indexer_kv_heads", 1)),
            indexer_head_dim=int(g("indexer_head_dim")),
            indexer_budget=int(g("indexer_budget")), indexer_compress_ratio=int(g("indexer_compress_ratio")),
            hc_count=int(g("hc_count", 4)), hc_lowrank=int(g("hc_lowrank", 320)),
            ple_layer_ids=sorted(set(g("ple_layer_ids", []))),
            ple_embed_dim=int(g("ple_embed_dim", cfg["hidden_size"])),
            ple_conv_kernel_size=int(g("ple_conv_kernel_size", 4)), ngram_size=int(g("ngram_size", 3)),
            heads_per_ngram=int(g("heads_per_ngram", 8)),
            ngram_vocab_size_base=int(g("ngram_vocab_size_base", 20_000_000)),
            ngram_vocab_divisor=int(g("make_ngram_vocab_size_divisible_by", 128)),
            ngram_seed=int(g("seed", 1234)), split_ngram_parts=int(g("split_ngram_parts", 512)),
        )

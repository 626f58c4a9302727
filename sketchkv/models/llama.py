"""Dense decoder-only models: Llama (`llama`), Qwen2 (`qwen2`, q/k/v biases) and Qwen3 (`qwen3`, per-head
q/k RMSNorm).

Every layer is full attention; same runtime as the hybrids, with no Gated DeltaNet state.
"""
import torch
from torch import nn

from sketchkv.layers.attention import Attention
from sketchkv.layers.mlp import MLP
from sketchkv.layers.norms import RMSNorm
from sketchkv.layers.rotary import RotaryEmbedding
from sketchkv.models.fuse import fuse_linears, linear
from sketchkv.models.model_config import ModelConfig
from sketchkv.models.weights import default_load_weight


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        H, Hkv, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = H, Hkv, D
        qkv_bias = cfg.attention_bias or cfg.qkv_bias
        self.q_proj = nn.Linear(cfg.hidden_size, H * D, bias=qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, Hkv * D, bias=qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, Hkv * D, bias=qkv_bias)
        self.o_proj = nn.Linear(H * D, cfg.hidden_size, bias=cfg.attention_bias)
        self.q_norm = RMSNorm(D, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(D, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.rotary = RotaryEmbedding(D, cfg.rotary_dim, cfg.rope_theta, cfg.rope_scaling)
        self.attn = Attention(H, Hkv, D, D ** -0.5)
        self.qkv = None  # fused [q; k; v] weight (bias-free models), see models/fuse.py

    def fuse_projections(self) -> None:
        self.qkv = fuse_linears([self.q_proj, self.k_proj, self.v_proj])

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        T, H, Hkv, D = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        if self.qkv is not None:
            q, k, v = linear(x, self.qkv).split([H * D, Hkv * D, Hkv * D], dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q, k, v = q.reshape(T, H, D), k.reshape(T, Hkv, D), v.reshape(T, Hkv, D)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        return self.o_proj(self.attn(q, k, v).reshape(T, -1))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.self_attn = LlamaAttention(cfg)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None = None):
        """(MLP output, residual stream before it), as qwen3_5.DecoderLayer: the adds ride in the norms."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h, residual = self.post_attention_layernorm(self.self_attn(positions, h), residual)
        return self.mlp(h), residual


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.model.layers = nn.ModuleList([DecoderLayer(cfg) for _ in range(cfg.num_layers)])
        self.model.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x, residual = self.model.embed_tokens(input_ids), None
        for layer in self.model.layers:
            x, residual = layer(positions, x, residual)
        return self.model.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def load_weight(self, name: str, tensor: torch.Tensor, params: dict) -> list[str]:
        return default_load_weight(name, tensor, params)

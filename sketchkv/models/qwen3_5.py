"""Qwen3.5 / Qwen3.8 (`qwen3_5`, `qwen3_5_text`) and Qwen3-Next (`qwen3_next`) hybrid models.

Layers are Gated DeltaNet (linear attention, fixed-size state) or gated full attention (q_proj
also yields a per-head sigmoid output gate; q/k RMSNorm; partial RoPE). Qwen3-Next adds a
sparse MoE and stores the GDN projections interleaved per key head; the loader de-interleaves
them so one GDN module serves both.
"""
import torch
from torch import nn

from sketchkv.layers.attention import Attention
from sketchkv.layers.gated_deltanet import GatedDeltaNet
from sketchkv.layers.mlp import MLP, SparseMoE
from sketchkv.layers.norms import ZeroCenteredRMSNorm
from sketchkv.layers.rotary import RotaryEmbedding
from sketchkv.models.fuse import fuse_linears, linear
from sketchkv.models.model_config import ModelConfig
from sketchkv.models.weights import default_load_weight
from sketchkv.ops.sigmoid_gate import sigmoid_gate


class GatedAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        H, Hkv, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = H, Hkv, D
        self.q_proj = nn.Linear(cfg.hidden_size, H * D * 2, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, Hkv * D, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, Hkv * D, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(H * D, cfg.hidden_size, bias=cfg.attention_bias)
        self.q_norm = ZeroCenteredRMSNorm(D, cfg.rms_norm_eps)
        self.k_norm = ZeroCenteredRMSNorm(D, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(D, cfg.rotary_dim, cfg.rope_theta, cfg.rope_scaling)
        self.attn = Attention(H, Hkv, D, D ** -0.5)
        self.qkv = None  # fused [q+gate; k; v] weight, see models/fuse.py

    def fuse_projections(self) -> None:
        self.qkv = fuse_linears([self.q_proj, self.k_proj, self.v_proj])

    def core_inputs(self, positions: torch.Tensor, x: torch.Tensor) -> dict:
        """Extra inputs of the attention core (qwen4_exp: the QSA indexer's queries and keys)."""
        return {}

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        T, H, Hkv, D = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        if self.qkv is not None:
            qg, k, v = linear(x, self.qkv).split([2 * H * D, Hkv * D, Hkv * D], dim=-1)
        else:
            qg, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q, gate = qg.view(T, H, 2 * D).chunk(2, dim=-1)
        q = self.q_norm(q)
        k = self.k_norm(k.view(T, Hkv, D))
        v = v.reshape(T, Hkv, D)
        q, k = self.rotary(positions, q, k)
        o = self.attn(q, k, v, **self.core_inputs(positions, x)).reshape(T, -1)
        return self.o_proj(sigmoid_gate(o.view(T, H, D), gate).view(T, -1))   # gate: a strided view, no copy


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_type: str, moe: bool):
        super().__init__()
        self.layer_type = layer_type
        if layer_type == "linear_attention":
            self.linear_attn = GatedDeltaNet(cfg.hidden_size, cfg.linear_num_key_heads, cfg.linear_num_value_heads,
                                             cfg.linear_key_head_dim, cfg.linear_value_head_dim,
                                             cfg.linear_conv_kernel_dim, cfg.rms_norm_eps)
        else:
            self.self_attn = GatedAttention(cfg)
        if moe:
            self.mlp = SparseMoE(cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts,
                                 cfg.num_experts_per_tok, cfg.norm_topk_prob, cfg.shared_expert_intermediate_size)
        else:
            self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None = None):
        """x: the previous layer's MLP output (the embeddings for the first layer, residual None), residual:
        the stream before it -> (this layer's MLP output, the stream before it). The residual adds ride in
        the norms' kernels (vLLM's layout); the stream after the layer is the sum of the two."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.linear_attn(h) if self.layer_type == "linear_attention" else self.self_attn(positions, h)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class MTP(nn.Module):
    """Multi-token-prediction head as stored in Qwen3.5/Qwen3-Next checkpoints (`mtp.*`).

    Predicts token t+2 from the final-normed hidden state h_t and the embedding of token t+1, at
    position t (vLLM's convention and scripts/train_reference.py's). Its attention layer gets a KV
    cache (paged like the model's, same block tables) only when speculative decoding is on.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.pre_fc_norm_embedding = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.pre_fc_norm_hidden = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.fc = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.layers = nn.ModuleList([DecoderLayer(cfg, "full_attention", cfg.num_experts > 0)
                                     for _ in range(cfg.mtp_num_layers)])
        self.norm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, next_embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Flat batch: embeddings of tokens t+1 and hidden states at t, [T, hidden] -> normed hidden [T, hidden]."""
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(next_embeds), self.pre_fc_norm_hidden(hidden)], dim=-1))
        residual = None
        for layer in self.layers:
            x, residual = layer(positions, x, residual)
        return self.norm(x, residual)[0]


class Qwen3_5ForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.model.layers = nn.ModuleList([DecoderLayer(cfg, t, cfg.is_moe_layer(i))
                                           for i, t in enumerate(cfg.layer_types)])
        self.model.norm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.mtp = MTP(cfg) if cfg.mtp_num_layers else None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Flat batch: input_ids/positions [T] -> final-normed hidden states [T, hidden]."""
        x, residual = self.model.embed_tokens(input_ids), None
        for layer in self.model.layers:
            x, residual = layer(positions, x, residual)
        return self.model.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def load_weight(self, name: str, tensor: torch.Tensor, params: dict) -> list[str]:
        """Copy one checkpoint tensor into the model; returns the parameter names it filled."""
        if self.config.interleaved_gdn_proj and (name.endswith("in_proj_qkvz.weight")
                                                 or name.endswith("in_proj_ba.weight")):
            return self._load_interleaved_gdn(name, tensor, params)
        return default_load_weight(name, tensor, params)

    def _load_interleaved_gdn(self, name: str, w: torch.Tensor, params: dict) -> list[str]:
        # Qwen3-Next groups rows per key head: [q(dk) k(dk) v(r*dv) z(r*dv)] and [b(r) a(r)], r = Hv/Hk.
        c = self.config
        hk, dk, dv, r = c.linear_num_key_heads, c.linear_key_head_dim, c.linear_value_head_dim, \
            c.linear_num_value_heads // c.linear_num_key_heads
        prefix = name.rsplit(".", 2)[0]
        if name.endswith("in_proj_qkvz.weight"):
            g = w.view(hk, 2 * dk + 2 * r * dv, -1)
            q, k, v, z = torch.split(g, [dk, dk, r * dv, r * dv], dim=1)
            parts = {"in_proj_qkv": torch.cat([q.reshape(-1, w.shape[1]), k.reshape(-1, w.shape[1]),
                                               v.reshape(-1, w.shape[1])]),
                     "in_proj_z": z.reshape(-1, w.shape[1])}
        else:
            g = w.view(hk, 2 * r, -1)
            b, a = torch.split(g, [r, r], dim=1)
            parts = {"in_proj_b": b.reshape(-1, w.shape[1]), "in_proj_a": a.reshape(-1, w.shape[1])}
        filled = []
        for sub, t in parts.items():
            filled += default_load_weight(f"{prefix}.{sub}.weight", t, params, source=name)
        return filled

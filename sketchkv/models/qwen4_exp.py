"""Qwen4-Exp text model (`qwen4_exp`, `qwen4_exp_text`; e.g. Qwen3.8-Flash-Next), after transformers'
models/qwen4_exp (vision tower ignored).

Layers are Gated DeltaNet or `indexed_attention`: Qwen3.5's gated attention whose core attends only
over the tokens its QSA indexer selects (layers/indexed_attention.py). Every layer has a sparse MoE
with a gated shared expert. The residual is hc_count streams (layers/hyper_connection.py): each
block reads a learned mix of the streams and writes back into each with its own weight; there are
no per-layer input norms and no final norm (the final mixer feeds the LM head). Some GDN layers add
Per-Layer n-gram Embeddings first (layers/ple.py).
"""
import math

import torch
from torch import nn

from sketchkv.errors import CheckpointError
from sketchkv.layers.gated_deltanet import GatedDeltaNet
from sketchkv.layers.hyper_connection import HyperConnection, inject
from sketchkv.layers.indexed_attention import IndexedAttention
from sketchkv.layers.mlp import SparseMoE
from sketchkv.layers.norms import ZeroCenteredRMSNorm
from sketchkv.layers.ple import PerLayerEmbedding
from sketchkv.models.model_config import ModelConfig
from sketchkv.models.qwen3_5 import GatedAttention
from sketchkv.models.weights import default_load_weight

PLE_BUFFERS = ("layer_multipliers", "ngram_heads_vocab_sizes", "ngram_heads_offsets")


class QSAIndexer(nn.Module):
    """Index queries (indexer_n_heads x D, RMSNorm, RoPE) and raw index keys (one head) of each token."""

    def __init__(self, cfg: ModelConfig, rotary):
        super().__init__()
        self.n_heads, self.dim = cfg.indexer_n_heads, cfg.indexer_head_dim
        self.index_qk_proj = nn.Linear(cfg.hidden_size, (self.n_heads + 1) * self.dim, bias=False)
        self.q_layernorm = ZeroCenteredRMSNorm(self.dim, cfg.rms_norm_eps)
        self.k_layernorm = ZeroCenteredRMSNorm(self.dim, cfg.rms_norm_eps)
        self._rotary = [rotary]  # the attention's RoPE (not a submodule here: no duplicate names)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> dict:
        q, k = self.index_qk_proj(x).split([self.n_heads * self.dim, self.dim], dim=-1)
        q = self._rotary[0].rotate(positions, self.q_layernorm(q.view(-1, self.n_heads, self.dim)))
        return {"index_q": q, "index_k": k}

    def block_keys(self, pooled: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
        """Pooled block keys [G, D] -> normed, RoPE'd at each block's first position [G, D]."""
        return self._rotary[0].rotate(first, self.k_layernorm(pooled)[:, None])[:, 0]


class IndexedGatedAttention(GatedAttention):
    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.indexer = QSAIndexer(cfg, self.rotary)
        D = cfg.head_dim
        self.attn = IndexedAttention(cfg.num_heads, cfg.num_kv_heads, D, D ** -0.5, cfg.indexer_head_dim,
                                     cfg.indexer_budget, cfg.indexer_compress_ratio, self.indexer.block_keys)

    def core_inputs(self, positions: torch.Tensor, x: torch.Tensor) -> dict:
        return self.indexer(positions, x)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, i: int):
        super().__init__()
        self.layer_type = cfg.layer_types[i]
        if self.layer_type == "linear_attention":
            self.linear_attn = GatedDeltaNet(cfg.hidden_size, cfg.linear_num_key_heads, cfg.linear_num_value_heads,
                                             cfg.linear_key_head_dim, cfg.linear_value_head_dim,
                                             cfg.linear_conv_kernel_dim, cfg.rms_norm_eps, cfg.gdn_gate_act)
        else:
            self.self_attn = IndexedGatedAttention(cfg)
        self.mlp = SparseMoE(cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.num_experts_per_tok,
                             cfg.norm_topk_prob, cfg.shared_expert_intermediate_size)
        self.ple = PerLayerEmbedding(cfg, cfg.ple_layer_ids.index(i + 1)) if i + 1 in cfg.ple_layer_ids else None
        hc = (cfg.hidden_size, cfg.hc_count, cfg.hc_lowrank, cfg.rms_norm_eps)
        self.attn_hyper_connection = HyperConnection(*hc)
        self.mlp_hyper_connection = HyperConnection(*hc)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """x [T, hc*H] residual streams."""
        if self.ple is not None:
            x = x + self.ple(x, input_ids)
        h, w = self.attn_hyper_connection(x)
        h = self.linear_attn(h) if self.layer_type == "linear_attention" else self.self_attn(positions, h)
        x = inject(x, h, w)
        h, w = self.mlp_hyper_connection(x)
        return inject(x, self.mlp(h), w)


class Qwen4ExpForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.model.layers = nn.ModuleList([DecoderLayer(cfg, i) for i in range(cfg.num_layers)])
        self.model.hyper_connection_mixer = HyperConnection(cfg.hidden_size, cfg.hc_count, cfg.hc_lowrank,
                                                            cfg.rms_norm_eps, inject=False)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.mtp = None
        self._ple_rows: dict[str, int] = {}  # rows of each split n-gram table loaded so far

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Flat batch: input_ids/positions [T] -> hidden states for the LM head [T, hidden]."""
        x = self.model.embed_tokens(input_ids).repeat(1, self.config.hc_count)
        for layer in self.model.layers:
            x = layer(positions, x, input_ids)
        return self.model.hyper_connection_mixer(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def load_weight(self, name: str, tensor: torch.Tensor, params: dict) -> list[str]:
        """Copy one checkpoint tensor in; returns the parameter names it completed. PLE n-gram tables
        may arrive split (`ngram_embedding.shard_{i}.weight`, torch.chunk rows, possibly in different
        files); their hash constants arrive as buffers and must match what the config implies."""
        if name.rsplit(".", 1)[-1] in PLE_BUFFERS:
            ours = dict(self.named_buffers()).get(name)
            if ours is None:
                raise CheckpointError(f"unexpected tensor {name!r}: no such PLE buffer in the model")
            if ours.shape != tensor.shape or not torch.equal(ours.cpu(), tensor.cpu().to(ours.dtype)):
                raise CheckpointError(f"tensor {name!r} does not match the PLE hash constants the config implies "
                                      "(vocab_size, ngram_*, seed, ple_layer_ids)")
            return []
        if ".ngram_embedding.shard_" in name:
            head, rest = name.split(".ngram_embedding.shard_")
            part = int(rest.split(".")[0])
            target = f"{head}.ngram_embedding.weight"
            p = params.get(target)
            if p is None:
                raise CheckpointError(f"unexpected tensor {name!r}: no such PLE table in the model")
            rows = math.ceil(p.shape[0] / self.config.split_ngram_parts)
            lo = part * rows
            want = (max(0, min(rows, p.shape[0] - lo)), p.shape[1])
            if tuple(tensor.shape) != want:
                raise CheckpointError(f"tensor {name!r} has shape {tuple(tensor.shape)}, the config implies {want} "
                                      f"(split_ngram_parts={self.config.split_ngram_parts})")
            with torch.no_grad():
                p[lo:lo + want[0]].copy_(tensor)
            self._ple_rows[target] = self._ple_rows.get(target, 0) + want[0]
            return [target] if self._ple_rows[target] == p.shape[0] else []
        return default_load_weight(name, tensor, params)

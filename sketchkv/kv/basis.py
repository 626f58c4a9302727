"""The frozen low-rank key basis: per full-attention layer and KV head, the top-r principal
directions of real post-RoPE keys (and their mean), fitted once per model from calibration text.

It never changes per request, so a token's sketch is a function of its key alone and prefix
caching keeps working. Saved as safetensors with a fingerprint of the model; loading checks it.
"""
import hashlib
import json
import os
from dataclasses import dataclass

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from sketchkv.errors import CheckpointError
from sketchkv.models.model_config import ModelConfig


def default_basis_path(model: str) -> str:
    """MODEL_DIR/key_basis.safetensors; beside a .gguf file, FILE.key_basis.safetensors (FILE minus .gguf)."""
    if model.lower().endswith(".gguf"):
        return model[:-len(".gguf")] + ".key_basis.safetensors"
    return os.path.join(model, "key_basis.safetensors")


def model_fingerprint(cfg: ModelConfig, model: torch.nn.Module) -> dict:
    """model_type + attention shapes + a hash of the full-attention K projections' weights."""
    h = hashlib.sha256()
    for name, p in sorted(model.named_parameters()):
        # int4 layers: their scales, which keep the checkpoint's order (the packed words take the GEMM kernel's)
        if name.endswith(("k_proj.weight", "k_proj.scales")) and not name.startswith("mtp."):
            # the first 256K weights of each (cheap, unique), rounded to bf16 so that a basis fitted with the
            # model loaded in fp32 also fits it loaded in bf16 (and the other way round)
            w = p.detach().reshape(-1)[:1 << 18].to(torch.bfloat16).float()
            h.update(w.cpu().numpy().tobytes())
    return {"model_type": cfg.model_type, "num_layers": cfg.num_layers, "num_kv_heads": cfg.num_kv_heads,
            "head_dim": cfg.head_dim, "hidden_size": cfg.hidden_size, "k_proj_sha256": h.hexdigest()[:16]}


@dataclass
class KeyBasis:
    layers: list[int]            # model layer index of each full-attention layer
    bases: torch.Tensor          # [L, Hkv, D, r] orthonormal columns
    means: torch.Tensor          # [L, Hkv, D]
    fingerprint: dict
    meta: dict                   # calibration source, token count, explained variance

    @property
    def rank(self) -> int:
        return self.bases.shape[-1]

    def truncated(self, rank: int) -> "KeyBasis":
        """The same fit at a lower rank: PCA directions are nested (sorted by explained variance), so the first
        `rank` columns are exactly what a fit at that rank gives."""
        if not 0 < rank <= self.rank or rank % 2:
            raise CheckpointError(f"rank must be even and in (0, {self.rank}], got {rank}")
        meta = dict(self.meta)
        meta.pop("explained_variance", None)   # per rank; the fit's eigenvalues are not kept
        return KeyBasis(self.layers, self.bases[..., :rank].contiguous(), self.means, self.fingerprint,
                        {**meta, "truncated_from": self.rank})

    def save(self, path: str) -> None:
        meta = {"fingerprint": json.dumps(self.fingerprint), "layers": json.dumps(self.layers),
                "rank": str(self.rank), **{k: json.dumps(v) for k, v in self.meta.items()}}
        save_file({"bases": self.bases.contiguous(), "means": self.means.contiguous()}, path, metadata=meta)

    @classmethod
    def load(cls, path: str, cfg: ModelConfig | None = None, fingerprint: dict | None = None) -> "KeyBasis":
        try:
            with safe_open(path, "pt") as f:
                meta = f.metadata() or {}
                bases, means = f.get_tensor("bases"), f.get_tensor("means")
        except FileNotFoundError:
            raise CheckpointError(f"{path}: key basis file not found (run `sketchkv fit-basis`)") from None
        except Exception as e:
            raise CheckpointError(f"{path}: not a sketchkv key basis ({type(e).__name__}: {e})") from None
        if "fingerprint" not in meta:
            raise CheckpointError(f"{path}: not a sketchkv key basis (no fingerprint metadata)")
        fp = json.loads(meta.pop("fingerprint"))
        layers = json.loads(meta.pop("layers"))
        meta.pop("rank", None)
        basis = cls(layers, bases, means, fp, {k: json.loads(v) for k, v in meta.items()})
        if fingerprint is not None and fp != fingerprint:
            diff = sorted(k for k in set(fp) | set(fingerprint) if fp.get(k) != fingerprint.get(k))
            raise CheckpointError(f"{path}: key basis was fitted for another model (differs in {', '.join(diff)})")
        if cfg is not None and (layers != cfg.full_attention_layers
                                or tuple(bases.shape[1:3]) != (cfg.num_kv_heads, cfg.head_dim)):
            raise CheckpointError(f"{path}: key basis shape {tuple(bases.shape)} for layers {layers} does not match "
                                  f"the model ({cfg.num_kv_heads} KV heads x {cfg.head_dim}, layers "
                                  f"{cfg.full_attention_layers})")
        return basis


def random_basis(cfg: ModelConfig, rank: int, seed: int = 0) -> KeyBasis:
    """Random orthonormal bases, for random-weight models whose keys carry no structure to fit
    (speed benchmarks only: their picks are meaningless either way)."""
    g = torch.Generator().manual_seed(seed)
    L, H, D = len(cfg.full_attention_layers), cfg.num_kv_heads, cfg.head_dim
    bases = torch.linalg.qr(torch.randn(L, H, D, rank, generator=g)).Q
    return KeyBasis(cfg.full_attention_layers, bases.contiguous(), torch.zeros(L, H, D), {"random": True},
                    {"source": "random orthonormal", "tokens": 0})


class KeyStats:
    """Running first and second moments of keys per (layer, KV head), in fp64."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, device):
        self.n = 0
        self.sum = torch.zeros(num_layers, num_kv_heads, head_dim, dtype=torch.float64, device=device)
        self.outer = torch.zeros(num_layers, num_kv_heads, head_dim, head_dim, dtype=torch.float64, device=device)

    def add(self, layer: int, k: torch.Tensor) -> None:
        """k [T, Hkv, D] post-RoPE keys."""
        k = k.double()
        self.sum[layer] += k.sum(0)
        self.outer[layer] += torch.einsum("thd,the->hde", k, k)
        if layer == 0:
            self.n += k.shape[0]

    def fit(self, rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> bases [L, Hkv, D, r], means [L, Hkv, D], explained variance fraction [L, Hkv]."""
        mean = self.sum / self.n
        cov = self.outer / self.n - torch.einsum("lhd,lhe->lhde", mean, mean)
        evals, evecs = torch.linalg.eigh(cov)                # ascending
        evals, evecs = evals.flip(-1), evecs.flip(-1)
        explained = evals[..., :rank].sum(-1) / evals.sum(-1).clamp_min(1e-30)
        return evecs[..., :rank].float().contiguous(), mean.float(), explained.float()

"""Engine knobs, one dataclass per concern. CLI flags and SKETCHKV_* environment variables map onto
the fields mechanically (see `add_dataclass_args` / `from_env`)."""
import argparse
import dataclasses
import os
from dataclasses import dataclass, field, fields


def default_model() -> str:
    """The bundled reference model (sketchkv/assets/reference-model) is every command's default."""
    return os.path.join(os.path.dirname(__file__), "assets", "reference-model")


@dataclass
class CacheConfig:
    block_size: int = field(default=64, metadata={"help": "tokens per KV block (power of two)"})
    num_kv_blocks: int | None = field(default=None, metadata={"help": "None: size from memory (GPU) or from max_model_len x max_num_seqs (CPU)"})
    gpu_memory_utilization: float = field(default=0.90, metadata={"help": "fraction of GPU memory the engine may use in total"})
    gpu_memory_gb: float | None = field(default=None, metadata={"help": "GiB of GPU memory this engine treats as the whole card (gpu_memory_utilization applies to it), enforced with torch.cuda.set_per_process_memory_fraction: several engines share one GPU as smaller cards (`serve --data-parallel N` puts replicas N at a time on each GPU when their caps fit), or a 24 GB card is emulated on a larger one. None: the whole card"})
    cpu_kv_cache_gb: float = field(default=4.0, metadata={"help": "KV budget on CPU"})
    enable_prefix_caching: bool = field(default=True, metadata={"help": "share KV blocks (and GDN state snapshots) across requests with a common prefix"})
    snapshot_interval_blocks: int = field(default=256, metadata={"help": "hybrid models: save GDN state every N blocks (and at each prompt's last block boundary)"})
    state_cache_gb: float = field(default=8.0, metadata={"help": "host RAM for GDN state snapshots (LRU)"})


@dataclass
class SchedulerConfig:
    max_num_seqs: int = field(default=64, metadata={"help": "sequences running at once (also the number of GDN state slots)"})
    max_num_batched_tokens: int = field(default=8192, metadata={"help": "tokens per step: prefill chunks + decode tokens"})
    max_model_len: int | None = field(default=None, metadata={"help": "default: the model's max_position_embeddings"})
    decode_time_share: float = field(default=0.5, metadata={"help": "while prompts prefill and other sequences decode: the share of wall time kept for decode-only steps (CUDA graphs), so a long prefill slows the others' decode instead of stalling it; 0 = every step mixes a prefill chunk in (vLLM's chunked prefill)"})
    max_prefill_tokens_while_decoding: int = field(default=4096, metadata={"help": "prompt tokens per step while other sequences decode (shorter steps: shorter gaps between their tokens)"})


@dataclass
class SparseConfig:
    sparse: bool = field(default=False, metadata={"help": "sparse decode: each attention layer reads sinks + top-k picks + recent tokens"})
    top_k: int = field(default=2048, metadata={"help": "tokens picked per layer per step through the key sketch"})
    sink_tokens: int = field(default=64, metadata={"help": "first tokens always attended"})
    recent_tokens: int = field(default=1024, metadata={"help": "last tokens always attended"})
    dense_threshold: int | None = field(default=None, metadata={"help": "contexts up to this run dense (default: sink+top_k+recent)"})
    dense_layers: int = field(default=0, metadata={"help": "the first N full-attention layers decode densely (every token, every step; over the host tier they read every row); the others select. SmolLM2-135M's first layer attends almost uniformly (the exact-key top-64 of 2K misses 62% of its attention mass, layers 3-29 ~10%), yet a dense layer 0 cut the KL only 10-14% for 3% more rows read, where raising top-k by the same rows halved it (docs/quality-real-model.md): off by default"})
    miss_estimate: bool = field(default=False, metadata={"help": "per decode step and layer, estimate from the selection scores the share of the candidates' attention mass the picks miss (SparseAttention.last_miss_estimate, [batch]; a few small kernels per layer). SmolLM2-135M, 2K: Pearson 0.53-0.68 with the true missed mass per layer and step, but ~0 with the step's KL; it ranks configurations, not steps (docs/quality-real-model.md). The server exports it as the sketchkv_sparse_missed_mass histogram (per sequence and step, mean over layers) and sketchkv_sparse_missed_mass_last"})
    shared_selection: bool = field(default=True, metadata={"help": "one pick per layer shared by all KV heads (else per KV head)"})
    head_combine: str = field(default="softmax", metadata={"help": "how the query heads' sketch scores combine into one pick: softmax (sum of per-head softmax probabilities, i.e. estimated attention mass; on the reference model it halves the KL divergence to dense at 128K-256K against sum, H200 run 13; on SmolLM2 on real text 1.6-2.0x lower KL than sum or max at 2K-8K, CPU 2026-12-07; one scoring pass on tensor cores storing every head's score, then per-head totals and a combine: 3.2x the sum's scoring time, ~+4 ms per 27B step at 8 x 250K, H200 runs 33 and 35) | sum (the seed's sum of raw scores; one dot per KV head: the fastest) | max"})
    softmax_lse_stride: int = field(default=0, metadata={"help": "softmax head combine: each query head's normalizer (its log-sum-exp over the candidates) estimated from every N-th position at most (see softmax_lse_min_samples), which lets the GPU score and combine in one pass over the sketch instead of storing every head's score and reading them twice (0: exact, over all candidates; needs the dot scoring kernel: sketch rank a multiple of 32). SmolLM2-135M at 8K: KL to dense +3-4% from ~500 sampled positions per head, +14% from ~125, within noise (+1%) from ~1,100 on (CPU 2026-12-07). H100 run 134: a 27B layer's scoring -10%, the bf16 8 x 250K step -0.5% (inside the noise: most scoring overlaps the read groups' gathers)"})
    softmax_lse_min_samples: int = field(default=4096, metadata={"help": "with softmax_lse_stride: a sequence's stride is min(softmax_lse_stride, its length // this), so no normalizer comes from fewer positions (sequences shorter than twice this: exact; at 250K and stride 16: ~15,600 positions)"})
    score_kernel: str = field(default="auto", metadata={"help": "the sketch-scoring kernel on a GPU: auto (the faster one measured on an H200, see sketchkv/ops/sketch.py) | fma (CUDA cores, fp32) | dot (tensor cores) | dp4a (int8 query codes against the nibbles in integer dot products; slower than dot for softmax: 254 vs 242 us per 27B layer at 8 x 250K, H200 run 92)"})
    prefill_selection: str = field(default="auto", metadata={"help": "prompt chunks over a prefix longer than the dense threshold (a follow-up turn, the later chunks of a long prompt): auto (chunk with the host tier, dense without) | dense (attend the whole prefix; over the host tier it is read back in bulk: 4.35 GB per chunk at 250K of the 27B shape) | chunk (one selection per chunk and layer, the chunk's queries scored as extra heads: the chunk attends the sinks, those top-k picks, the recent tokens before it and itself; only those rows move). H200, 27B shape over the tier: follow-up TTFT at 8 x 250K 0.37 s alone, 2.3 s for 7 at once (dense: 0.73 / 9.0 s, run 52); cold 244K prefill 8,185 tok/s (dense: 5,679, run 55). Reference model, KL to dense over 256 decode steps after a whole prompt prefilled this way, 3 documents: 64K 0.0069 vs 0.0057 for sparse decode alone, 128K 0.0267 vs 0.0270, 256K 0.0309 vs 0.0302 (run 54)"})
    verify_selection: str = field(default="per_row", metadata={"help": "speculative verification steps (num_speculative_tokens > 0): per_row (each row, the token and each draft, scores and selects for its own position: greedy output identical to plain decoding; scoring and top-k cost x (1 + n)) | shared (a sequence's first row selects; every row reads those picks, the sinks and all tokens from the first row's recent window up to itself: the selection cost of one row, approximate)"})
    selector: str = field(default="sketch", metadata={"help": "what scores the candidates: sketch (the int4 low-rank key sketch) | exact (every full key: dense cost; the oracle the sketch approximates, for quality evaluation; not with the host tier)"})
    basis: str | None = field(default=None, metadata={"help": "key basis file (default: MODEL/key_basis.safetensors; for FILE.gguf, FILE.key_basis.safetensors)"})
    host_tier: bool = field(default=False, metadata={"help": "full-attention K/V live in host RAM; the GPU keeps the selector's state (sketch, or on qwen4_exp the QSA block keys), sinks, recent tail and a hot buffer (needs sparse, except on qwen4_exp: its QSA indexer selects)"})
    host_format: str = field(default="k8v4", metadata={"help": "host rows: k8v4 (int8 keys, int4 values) | int4 | int8 | bf16 (bytes per token, layer and KV head of 256 dims: 400 / 272 / 528 / 1024). Default k8v4 since issue 40: on SmolLM2-135M (stdlib text, 2K / 4K / 8K, same picks, paired on the same tokens) int4 rows (with residual keys) added 2.9x / 2.8x / 1.2x the dense bf16-vs-fp32 floor to the KL, k8v4 0.5x (2K) / 0.6x (8K), int8 <= 0.2x (two samples at 2K and 8K) (docs/quality-real-model.md); reference model at 64K / 128K, H200 run 57: int8 within the floor, int4 +0.002 nats/token"})
    hot_fraction: float = field(default=0.025, metadata={"help": "GPU hot-buffer rows per sequence, as a fraction of its tokens"})
    host_budget_gb: float | None = field(default=None, metadata={"help": "host RAM for the tier (default: half of the available RAM)"})
    tier_kernel: str = field(default="triton", metadata={"help": "the host tier's per-step kernels: triton (fused kernels per layer: the K/V scratch composition, the CLOCK admit and its row copies; H200 run 17, 27B shape at 8 x 250K: ~5,400 instead of ~8,300 kernels per step, the tier's torch index/elementwise time 15.0 -> 5.1 ms) | torch (the PyTorch reference: the same result, ~50 small kernels per layer and step)"})
    gpu_budget_gb: float | None = field(default=None, metadata={"help": "GPU memory for the tier: sketches, sinks + tails, hot buffer (default: what is free after weights and activations)"})
    admit_stream: bool = field(default=True, metadata={"help": "on CUDA, each layer's hot-buffer admit (CLOCK placement, row copies) and, in plain decode steps, the new tokens' host rows and sketches run on a side stream, overlapped with the next layers; the step joins it at its end (nothing reads them before the next step)"})
    read_groups: int = field(default=2, metadata={"help": "plain decode steps over the host tier on CUDA: the batch's sequences in this many groups; each group's picked rows are read (hot buffer, host misses over PCIe) and attended on a second stream while the next group's selection is scored, so the PCIe reads overlap the scoring (1: one group, no overlap; off with miss_estimate). The miss gather then runs on at most half the SMs' count of programs: 27B W4A16 at 8 x 250K, H200 run 117: 2 groups 23.44 ms per step against 24.56 for one (-4.6%), 4 groups 23.78 (more, smaller top-k and attention launches); uncapped, H100 run 116: 2 / 4 groups 3% / 7% slower (the gather's programs, waiting on PCIe, held the SMs the scoring needed). On a GPU the groups give the same tokens and hot-buffer hits as one group (H100 run 118, reference model, fp32 and bf16). The second stream runs at a higher CUDA priority, so a group's gather does not queue behind the next group's scoring blocks (H100 run 134: bf16 8 x 250K -1.3%)"})
    miss_read: str = field(default="fields", metadata={"help": "how a decode step's misses are read from host RAM (zero-copy, over PCIe): fields (one kernel loads each row's K codes, V codes and scales head by head and dequantises them on the way) | rows (each row read whole, as stored, into the step's record buffer, then dequantised from GPU memory: two kernels; for hosts whose zero-copy reads are slow at small requests, benchmarks/studies/host_row_reads.py)"})
    host_residual_keys: bool | None = field(default=None, metadata={"help": "host K rows hold each key minus what its GPU sketch rebuilds (mean + basis x int4 coefficients), quantised in the host format and added back when read (one kernel per layer and step): the same bytes, a smaller error. None (auto): on with int4 rows and the key sketch, off otherwise (bf16 rows need no help; qwen4_exp QSA keeps no sketch). H200 run 78, reference model, KL over bf16 rows at 64K / 128K: int4 +0.0023 / +0.0020 -> +0.0013 / +0.0002; 27B shape at 8 x 250K: +0.4 ms per step (31.08 vs 30.68 ms, within the run-to-run spread)"})


def resolved_host_residual_keys(sp: SparseConfig, sketch_selector: bool) -> bool:
    """host_residual_keys=None (auto) -> on for int4 host rows under the key sketch (measured: issue 5's int4 error
    roughly halved), off otherwise; an explicit value stands (the runner refuses True without a sketch)."""
    if sp.host_residual_keys is not None:
        return sp.host_residual_keys
    return bool(sp.sparse and sp.host_tier and sp.host_format == "int4" and sketch_selector)


def resolved_prefill_selection(sp: SparseConfig) -> str:
    """prefill_selection=auto -> chunk over the host tier (a dense prefill would read its whole prefix back over
    PCIe), dense otherwise (the paged cache's prefix read is HBM)."""
    if sp.prefill_selection != "auto":
        return sp.prefill_selection
    return "chunk" if sp.sparse and sp.host_tier else "dense"


@dataclass
class EngineConfig:
    model: str = field(default_factory=default_model, metadata={"help": "what to load: a Hugging Face checkpoint directory, a .gguf file, or random:PRESET (random weights of a named shape, for speed runs); default: the bundled reference model"})
    dtype: str = field(default="auto", metadata={"help": "auto: bfloat16 on GPU, float32 on CPU"})
    device: str = field(default="auto", metadata={"help": "auto: cuda if available else cpu"})
    seed: int = field(default=0, metadata={"help": "seed of the engine's random state (random:PRESET weights, sampling without a per-request seed)"})
    enforce_eager: bool = field(default=False, metadata={"help": "no CUDA graphs for decode"})
    tensor_parallel_size: int = field(default=1, metadata={"help": (
        "shard the model over N devices (attention and Gated DeltaNet heads, MLPs, vocab; all-reduce through "
        "torch.distributed: NCCL on cuda:0..N-1, gloo on CPU); also --tensor-parallel. Rank 0 runs in this "
        "process, ranks 1..N-1 are spawned (a script needs an `if __name__ == '__main__':` guard). Not with MoE, "
        "qwen4_exp, the host tier or speculative decoding yet")})
    prefill_attention: str = field(default="cudnn", metadata={"help": "prefill attention kernel on a GPU: cudnn (SDPA's cuDNN op, 2x flash on an H200 for chunks after a cached prefix; a shape it refuses falls back to flash with a warning) | flash (SDPA's FlashAttention-2 op)"})
    num_speculative_tokens: int = field(default=0, metadata={"help": "MTP speculative decoding: tokens drafted per step by the checkpoint's mtp.* layer, verified in one target step (0 = off)"})
    mtp_attention_window: int = field(default=4096, metadata={"help": "MTP drafter: W > 0 = its attention reads the first 64 tokens and the last W only, and keeps only those (+ n + 1 rows) in a K/V ring per sequence (17 MB at W = 4096 for the 27B shape, whatever the context); 0 = the whole context, as trained (its K/V paged like the model's: 1.05 GB per 250K-token agent of the 27B shape, all read every draft step: 8 GB per step at 8 x 250K, about a fifth of a verification step, H200 run 39). Drafts only: the output is unchanged. Accepted length at W = 4096, reference model, n = 7 (windowed / dense): 8K explain 2.05 / 2.08 (CPU, session 12); 64K explain 2.41 / 2.28, copy 4.59 / 4.52 (H200 runs 40-41); W = 1024 at 8K lost a sixth on explain"})
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    sparse: SparseConfig = field(default_factory=SparseConfig)


FLAT_SECTIONS = ("cache", "scheduler", "sparse")


def flat_fields(cfg_cls=EngineConfig):
    """(flat name, section-or-None, field) for every knob, sections flattened. Sparse knobs carry a
    `sparse_` prefix (--sparse-top-k, SKETCHKV_SPARSE_TOP_K) so they never clash with sampling flags."""
    for f in fields(cfg_cls):
        if f.name in FLAT_SECTIONS:
            prefix = "sparse_" if f.name == "sparse" else ""
            for g in fields(f.default_factory):
                yield (g.name if g.name == "sparse" or g.name.startswith(prefix) else prefix + g.name), f.name, g
        else:
            yield f.name, None, f


def _parse(value: str, typ):
    typ = str(typ)
    if "None" in typ and value.lower() == "none":
        return None
    if "bool" in typ:
        return value.lower() in ("1", "true", "yes", "on")
    if "int" in typ:
        return None if value.lower() == "none" else int(value)
    if "float" in typ:
        return float(value)
    return value


ALIASES = {"tensor_parallel_size": ["--tensor-parallel"]}  # short spellings of a few flags


def add_dataclass_args(parser: argparse.ArgumentParser, skip=("model",)) -> None:
    for name, _, f in flat_fields():
        if name in skip:
            continue
        flags = ["--" + name.replace("_", "-")] + ALIASES.get(name, [])
        if "bool" in str(f.type):
            parser.add_argument(*flags, action=argparse.BooleanOptionalAction, default=None, help=_help(name, f))
        else:
            parser.add_argument(*flags, default=None, help=_help(name, f))


def _help(name: str, f) -> str:
    default = f.default if f.default is not dataclasses.MISSING else "(see docs)"
    text = f"{f.metadata.get('help', '')} [default: {default}; env SKETCHKV_{name.upper()}]".strip()
    return text.replace("%", "%%")   # argparse %-formats help strings: "62%" would break --help


def build_config(args: argparse.Namespace | None = None, **overrides) -> EngineConfig:
    """Defaults < SKETCHKV_* environment < CLI flags < keyword overrides.

    A whole section may be given as its dataclass, e.g. `sparse=SparseConfig(top_k=256)`."""
    cfg = EngineConfig()
    for section in FLAT_SECTIONS:
        if isinstance(overrides.get(section), (CacheConfig, SchedulerConfig, SparseConfig)):
            setattr(cfg, section, overrides.pop(section))
    for name, section, f in flat_fields():
        value = os.environ.get(f"SKETCHKV_{name.upper()}")
        value = _parse(value, f.type) if value is not None else None
        if args is not None and getattr(args, name, None) is not None:
            v = getattr(args, name)
            value = _parse(v, f.type) if isinstance(v, str) else v
        if name in overrides:
            value = overrides.pop(name)
        if value is not None:
            target = getattr(cfg, section) if section else cfg
            setattr(target, f.name, value)
    if overrides:
        raise TypeError(f"unknown engine option(s): {', '.join(overrides)}")
    return cfg


def to_dict(cfg: EngineConfig) -> dict:
    return dataclasses.asdict(cfg)

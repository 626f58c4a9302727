"""W4A16 GEMM: x [M, K] (bf16 / fp16 / fp32) times int4 weights with per-group scales and zero points.

Canonical packed weight (GPTQ layout; every checkpoint format is converted to it at load):
  qweight int32 [K // 8, N]: nibble j (bits 4j..4j+3) of qweight[i, n] holds q[n, 8i + j] in 0..15;
  scales, zeros [K // G, N] in the activation dtype; w[n, k] = (q[n, k] - zeros[k // G, n]) * scales[k // G, n]
  (symmetric: zeros = 8). G in {32, 64, 128} or G = K (per channel).

CUDA: M < LARGE_M -> one Triton kernel (below); M >= LARGE_M (prefill) -> a Triton dequantize of the whole weight
to bf16, then one cuBLAS GEMM (dequant_mm). CPU -> the reference. prepare_int4_weight (once, at load) shuffles the
nibbles within each K tile of BLOCK_K = min(128, G) rows (KW = BLOCK_K / 8 words) Marlin-style: nibbles s and s + 4
of word i hold the k pair (2c, 2c + 1), c = s KW + i. One 32-bit lop3 on the word shifted by 4 s,
(w >> 4s) & 0x000F000F | 0x43004300, is then the bf16 pair (128 + q[2c], 128 + q[2c + 1]), which is exactly the
register the MMA operand wants for that k pair (0.875 instructions per weight for the unpacking); the 4 shifts of a
[BLOCK_N, KW] word tile (loaded coalesced along N, pipelined through shared memory) give its [BLOCK_N, BLOCK_K]
weights in k order, so x's columns are contiguous and one dot (K = BLOCK_K) covers the tile. The weight is the MMA's
M side (out^T = W x^T: wgmma / mma.sync take it from registers, the few x rows are the N side, >= 8). A tile is one
group (or holds 2 or 4 whole groups, a dot each), so a group's zero and scale apply to the fp32 product, not to
every weight (rowsum(x) by a second dot against ones; scales and zeros prefetched a tile ahead):
  acc += (dot(x, q + OFF) - rowsum(x) * (zero + OFF)) * scale
OFF = 128 (bf16) / 1024 (fp16) builds the float by OR-ing the nibble into the mantissa of 128.0 / 1024.0
(Marlin's trick: no conversion instruction); OFF = 0 converts (fp32 activations).
Split-K: SPLIT_K programs per output tile write fp32 partials; the last to finish (a per-tile counter, reset
by that program, so the kernel is graph-capturable) sums them in split order and writes the output.
The 4-byte copies are not what holds the kernel at ~50% of the floor: words stored K-major ([N, K / 8], the
shared tile's order; every copy 16 bytes in the sm_90 PTX) measured on an H100 on 2026-12-05 (runs 106 vs 105,
run 98's TUNED configs) gate_up 18% slower, the other shapes 5-11% faster, the 27B step's GEMMs 8.59 ms vs
8.29 ms at M = 8, and the same 8 x 250K engine ratio to bf16 (1.36x); so the layout stays N-major. Nor are
the MMA's waits: H100 ncu (run 107) found ptxas serializing the 32 wgmmas of a BLOCK_N 128 x 4-warp K tile (a
WARPGROUP.DEPBAR after every HGMMA; barrier stalls 32%, DRAM 52%), yet subtracting integer zeros from the 16-bit
weights (one dot per group: 16 HGMMAs and one DEPBAR per tile in the SASS) left gate_up at the same 54 us and
slowed the BLOCK_N 64 shapes 2x (run 109), and mma.sync (DISABLE_MMA_V3=1) was 10-30% slower at M <= 8 even
with its own configs (run 108). What helped: the words' tiles by TMA (Config.tma: a host tensor descriptor
of the packed words, each [KW, BLOCK_N] tile one cp.async.bulk.tensor into shared memory, read back transposed):
H100 run 113 (benchmarks/studies/w4a16_flag.py --flag tma) 54% -> 60% of the int4 floor at M = 1, 8 (slower at M = 64), so
config_for turns it on up to 16 rows on sm_90+. Not tried: a per-tile contiguous layout, a warp-specialized kernel.

Tried and slower, so removed (H100; "the step" = the 27B decode step's GEMMs, no lm_head; studies
`benchmarks/studies/w4a16_flag.py --flag x_major / persistent / xsum` before the removal, and w4a16_prefill.py):
x rows on the MMA's M side (out = x W^T, the weights its N side through shared memory), H100 run 130 (2026-12-07):
at M = 64 the shipped config flipped is 2x slower on every shape (gate_up 245.9 vs 115.6 us, down 130.7 vs 66.4,
gdn_in 136.1 vs 48.7, attn_qkv 135.2 vs 47.5, o/out 55.0 vs 31.4), the best flipped config per shape 1.75-2.2x,
the step 33.00 vs 16.76 ms. A persistent grid (1-3 programs per SM looping over the (tile, split) items), run 130:
at M = 8 the same config 3x slower (gate_up 152.9 vs 51.2 us), the best persistent config per shape 25-48% slower,
the step 9.99 vs 7.41 ms. rowsum(x) by one torch reduction before the launch instead of the ones dot (which doubles
the tensor cores' work at M = 64), run 126: the step 7.47 -> 7.44 ms at M = 8, 16.30 -> 16.78 at M = 64 (per shape
-7% to +17%): the ones dot is not what holds M = 64 at a quarter of its floor. Prefill's dequantize in column
slices on a side stream, to overlap the previous slice's GEMM, run 130, one 27B forward at M = 8192: bf16 535.5 ms,
one dequantize + GEMM 570.2 (0.939 of bf16's speed), 2 / 4 / 8 slices 599.7 / 598.5 / 613.9 (0.893 / 0.895 /
0.872): cuBLAS occupies every SM, so the dequantize does not overlap, it competes.

Small M (decode), _gemv_kernel: CUDA cores, built for bandwidth. H200 run 98 had the tensor-core kernel at
38-42% of the int4 floor at M = 1, 8: its words reach shared memory by 4-byte cp.async (Triton orders the
shared tile along K for the MMA operand). The same packed words serve both kernels (no second copy, no new
layout): shuffle_int4 only permutes nibbles within a word's column, so the words stay [K / 8, N] with N
contiguous, and the small-M kernel loads them 16 bytes (4 columns) per thread and row and gathers x at each
nibble's k instead (x is tiny and L1-resident). Per byte one prmt puts it under the fp32 exponent of 2^15
(f = 2^15 + lo + 16 hi), one and clears lo (g = 2^15 + 16 hi), and two FFMAs per x row take
f x_lo + g (x_hi / 16 - x_lo) = lo x_lo + hi x_hi + 2^11 x_hi: 2 instructions per weight at M = 1, the
offsets and the group's zero and scale applied once per K tile to the fp32 sums,
(sum - 2^11 sum(x_hi) - z sum(x)) s (precision: lo's 2^-15 below the leading bit costs ~2e-4 of the output's
rms, a tenth of the bf16 output rounding). sm_90 SASS of the loop (CPU compile): 2.5 instructions per
weight at M = 1 (16 columns per thread, 255 registers, no spills, no shared memory or barriers), one FFMA
per weight per further x row. An SM must take ~33 weights per cycle to keep up with 4.25 TB/s and issues
at most 128 lane-instructions per cycle, so the kernel can reach the floor at M = 1 (~65% issue) and
perhaps M = 2, not at M >= 4 (the tensor cores stay there). Off by default: GEMV_MAX_M = 0 until an H200
run of `benchmarks/bench_w4a16_gemm.py --gemv` decides (1) the threshold (the M up to which it beats the
tensor-core kernel on every shape), (2) GEMV_TUNED configs, (3) from its load-only probe (the same grid and
word loads, xor-reduced), whether the access pattern itself reaches the copy bandwidth, i.e. whether what
is left is issue (instructions) or bytes in flight (then: more columns per program, a register prefetch
of the next tile). Weights with K tiles of several groups (block_k > G) stay on the tensor-core kernel.
"""
import os
from dataclasses import dataclass, replace

import torch

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None
try:   # host TMA descriptors (Config.tma)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:
    TensorDescriptor = None

LARGE_M = 512  # from here on dequantize + cuBLAS (a bf16 GEMM is compute-bound there)


# ---- packing and the reference --------------------------------------------------------------------------

def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """q [N, K] integers in 0..15 -> qweight int32 [K // 8, N] (nibble j of word i holds column 8i + j)."""
    N, K = q.shape
    assert K % 8 == 0, f"K = {K} is not a multiple of 8"
    q = q.to(torch.int32).t().reshape(K // 8, 8, N)
    shifts = (4 * torch.arange(8, dtype=torch.int32, device=q.device)).view(1, 8, 1)
    # the OR over nibbles equals their sum (disjoint bits); int32 wraps on the top nibble as the bits say
    return (q << shifts).sum(1, dtype=torch.int32)


def unpack_int4(qweight: torch.Tensor) -> torch.Tensor:
    """qweight int32 [K // 8, N] -> q uint8 [N, K] in 0..15."""
    K8, N = qweight.shape
    shifts = (4 * torch.arange(8, dtype=torch.int32, device=qweight.device)).view(1, 8, 1)
    q = (qweight.view(K8, 1, N) >> shifts) & 0xF
    return q.reshape(K8 * 8, N).t().to(torch.uint8).contiguous()


def dequantize_int4(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                    dtype: torch.dtype | None = None) -> torch.Tensor:
    """The PyTorch reference: W [N, K] = (q - zeros) * scales, computed in fp32, rounded to `dtype`
    (default: the scales' dtype)."""
    q = unpack_int4(qweight).float()
    N, K = q.shape
    s = scales.float().t().repeat_interleave(group_size, dim=1)
    z = zeros.float().t().repeat_interleave(group_size, dim=1)
    assert s.shape == (N, K), f"scales {tuple(scales.shape)} do not fit K = {K}, N = {N}, group {group_size}"
    return ((q - z) * s).to(dtype or scales.dtype)


def w4a16_matmul_reference(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                           group_size: int) -> torch.Tensor:
    """x [..., K] @ dequantize(...).T -> [..., N] in x's dtype (fp32 accumulation)."""
    w = dequantize_int4(qweight, scales, zeros, group_size, x.dtype)
    return (x.float() @ w.float().t()).to(x.dtype)


# ---- the prepared weight --------------------------------------------------------------------------------

def shuffle_int4(qweight: torch.Tensor, block_k: int) -> torch.Tensor:
    """Canonical qweight -> the kernel's order: within each K tile of block_k rows (KW = block_k / 8 words),
    nibble j of word i holds k = tile * block_k + 2 (s KW + i) + h with s = j % 4, h = j // 4: one 32-bit op
    on the word shifted by 4 s gives nibbles s and s + 4 = the k pair (2c, 2c + 1), c = s KW + i, so the
    shifts s of a tile's words, concatenated, are its k in order (x columns contiguous)."""
    out = torch.empty_like(qweight)
    for c in range(0, qweight.shape[1], 4096):  # column chunks: the temporaries take ~12 bytes per weight
        q = unpack_int4(qweight[:, c:c + 4096])
        N, K = q.shape
        out[:, c:c + 4096] = pack_int4(q.view(N, K // block_k, 4, block_k // 8, 2).permute(0, 1, 3, 4, 2).reshape(N, K))
    return out


def unshuffle_q(packed: torch.Tensor, block_k: int) -> torch.Tensor:
    """shuffle_int4's packed words -> q uint8 [N, K] in natural order."""
    qs = unpack_int4(packed)
    N, K = qs.shape
    return qs.view(N, K // block_k, block_k // 8, 2, 4).permute(0, 1, 4, 2, 3).reshape(N, K)


@dataclass
class Int4Weight:
    """A weight as the GEMM runs it, built once at load by prepare_int4_weight: the packed words in the
    kernel's order (shuffle_int4 with block_k; `qweight` gives the canonical words back), scales and zeros
    as they are, and the split-K tiles' arrival counters (zero between calls)."""
    packed: torch.Tensor       # int32 [K // 8, N], shuffled in K tiles of block_k
    scales: torch.Tensor       # [K // G, N]
    zeros: torch.Tensor        # [K // G, N]
    group_size: int
    block_k: int               # the kernel's K tile (default min(128, G)); 8 = canonical order
    counters: torch.Tensor     # int32 [N] (>= output tiles of any split-K launch with M < LARGE_M)

    @property
    def qweight(self) -> torch.Tensor:
        """The canonical qweight (recomputed: for loaders and checks, not per step)."""
        return canonical_words(self.packed, self.block_k)

    @property
    def in_features(self) -> int:
        return self.packed.shape[0] * 8

    @property
    def out_features(self) -> int:
        return self.packed.shape[1]


def default_block_k(group_size: int) -> int:
    """The kernel's K tile for a group size when none is asked for: the largest of 128..16 inside one group."""
    return next((b for b in (128, 64, 32, 16) if group_size % b == 0), 8)


def canonical_words(packed: torch.Tensor, block_k: int) -> torch.Tensor:
    """Words in the kernel's order (shuffle_int4 with block_k; any column slice of them) -> canonical qweight."""
    return pack_int4(unshuffle_q(packed.contiguous(), block_k)) if block_k > 8 else packed


def prepare_int4_weight(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                        block_k: int | None = None) -> Int4Weight:
    """Canonical tensors (after any concatenation along N) -> Int4Weight, on their device. block_k: the
    kernel's K tile (default min(128, G)); larger tiles (256, 512 with G = 128) hold 2, 4 groups (at most 4)."""
    K8, N = qweight.shape
    K = K8 * 8
    assert qweight.dtype == torch.int32, f"qweight must be int32, got {qweight.dtype}"
    assert K % group_size == 0 and N % 8 == 0, f"K = {K}, N = {N}, group {group_size}"
    assert scales.shape == zeros.shape == (K // group_size, N), \
        f"scales {tuple(scales.shape)} / zeros {tuple(zeros.shape)} != {(K // group_size, N)}"
    if block_k is None:
        block_k = default_block_k(group_size)
    assert K % block_k == 0 and (group_size % block_k == 0 or
                                 (block_k % group_size == 0 and group_size % (block_k // 4) == 0)), \
        f"block_k {block_k} does not fit K = {K}, group {group_size}"
    packed = shuffle_int4(qweight, block_k) if block_k > 8 else qweight.contiguous()
    return Int4Weight(packed, scales.contiguous(), zeros.to(scales.dtype).contiguous(), group_size, block_k,
                      torch.zeros(N, dtype=torch.int32, device=qweight.device))


def dequantize_prepared(w: Int4Weight, dtype: torch.dtype | None = None) -> torch.Tensor:
    """dequantize_int4 of a prepared weight, W [N, K] (PyTorch)."""
    q = unshuffle_q(w.packed, w.block_k).float()
    s = w.scales.float().t().repeat_interleave(w.group_size, dim=1)
    z = w.zeros.float().t().repeat_interleave(w.group_size, dim=1)
    return ((q - z) * s).to(dtype or w.scales.dtype)


# ---- the kernels ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Config:
    """One launch configuration of the GEMM kernel (BLOCK_K is the weight's block_k)."""
    block_m: int = 16
    block_n: int = 128
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4
    magic: bool = True       # nibble -> float by mantissa OR (bf16 / fp16 activations only)
    tma: bool = False        # the words' K tiles by TMA (a host tensor descriptor) instead of cp.async


# (M bucket, N, K) -> Config, from `benchmarks/bench_w4a16_gemm.py --sweep` on an H200; else config_for's rule
TUNED: dict[tuple[int, int, int], Config] = {
    # H200 run 98 (benchmarks/results/2026-12-04-h200-run98-w4a16-gemm/sweep-final/), block_k 128, bf16,
    # G = 128; bucket 8 = the M = 8 winner (M = 1's is the same but for attn_qkv: block_n 64, 25.3 us);
    # stages x warps and (attn_qkv M = 8, 64; o/out) BLOCK_N x SPLIT_K were not searched (see the README)
    (8, 34816, 5120): Config(block_m=16, block_n=128, split_k=4, num_warps=4, num_stages=3),
    (64, 34816, 5120): Config(block_m=64, block_n=64, split_k=1, num_warps=4, num_stages=4),
    (8, 5120, 17408): Config(block_m=16, block_n=64, split_k=8, num_warps=4, num_stages=3),
    (64, 5120, 17408): Config(block_m=64, block_n=64, split_k=8, num_warps=4, num_stages=3),
    (8, 16384, 5120): Config(block_m=8, block_n=128, split_k=4, num_warps=4, num_stages=3),
    (64, 16384, 5120): Config(block_m=64, block_n=128, split_k=1, num_warps=8, num_stages=5),
    (8, 14336, 5120): Config(block_m=16, block_n=128, split_k=4, num_warps=4, num_stages=3),
    (64, 14336, 5120): Config(block_m=64, block_n=128, split_k=1, num_warps=8, num_stages=4),
    (8, 5120, 6144): Config(block_m=16, block_n=64, split_k=8, num_warps=4, num_stages=2),
    (64, 5120, 6144): Config(block_m=64, block_n=64, split_k=8, num_warps=4, num_stages=4),
}


def m_bucket(M: int) -> int:
    return 8 if M <= 8 else 16 if M <= 16 else 32 if M <= 32 else 64 if M <= 64 else 128


_SMS: dict = {}


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 132
    if device.index not in _SMS:
        _SMS[device.index] = torch.cuda.get_device_properties(device).multi_processor_count
    return _SMS[device.index]


_CAPABILITY: dict = {}


def _tma_ok(N: int, device: torch.device) -> bool:
    """TMA needs sm_90+, Triton's host descriptors and 16-byte rows of words (N % 4 == 0)."""
    if device.type != "cuda" or TensorDescriptor is None or N % 4:
        return False
    if device.index not in _CAPABILITY:
        _CAPABILITY[device.index] = torch.cuda.get_device_capability(device)
    return _CAPABILITY[device.index] >= (9, 0)


def config_for(M: int, N: int, K: int, device: torch.device) -> Config:
    """The tuned config of (M bucket, N, K), else (the shape of the H200 sweeps' winners): the weight on the
    MMA's M side, BLOCK_M 16 up to 16 rows (then the M bucket), BLOCK_N 64 up to 16 rows (else 128), and
    split-K until the output tiles x splits cover the SMs 4 times (each split keeping >= 4 K tiles of 128).
    Words by TMA up to 16 rows on sm_90+: H100 run 113 had the 27B step's GEMMs 8.06 -> 7.25 ms at M = 1 and
    8.13 -> 7.35 at M = 8 with the same configs, but 16.69 -> 17.68 ms at M = 64."""
    bm = m_bucket(M)
    if (bm, N, K) in TUNED:
        cfg = TUNED[(bm, N, K)]
    else:
        bm = max(bm, 16)
        bn = 64 if bm <= 16 else 128
        tiles = -(-N // bn) * -(-M // bm)
        split = 1
        while tiles * split < 4 * _num_sms(device) and K // 128 >= 8 * split:
            split *= 2
        cfg = Config(block_m=bm, block_n=bn, split_k=split, num_warps=4 if bm <= 64 else 8,
                     num_stages=3 if bm <= 16 else 4)
    if M <= 16 and _tma_ok(N, device):
        cfg = replace(cfg, tma=True)
    return cfg


@dataclass(frozen=True)
class GemvConfig:
    """One launch configuration of the small-M CUDA-core kernel (_gemv_kernel)."""
    block_n: int = 1024      # columns per program: 4 consecutive per thread and 16-byte load, block_n / (32 warps) per thread
    rows: int = 2            # word rows (16 k) per unrolled chunk of a K tile, all in each thread
    split_k: int = 0         # programs along K; 0: enough for ~4 programs per SM (gemv_config_for)
    num_warps: int = 2
    num_stages: int = 1


# The small-M kernel serves M <= GEMV_MAX_M (no tensor cores: 2 lane-instructions per weight and row at M = 1, one
# FFMA per extra row, so it can only win at the smallest M). 0 = off until an H200 run picks the threshold and
# GEMV_TUNED entries ((M, N, K) -> GemvConfig) with `benchmarks/bench_w4a16_gemm.py --gemv`. H100 run 105
# (2026-12-05): it wins only gate_up at M = 1 (42.6 vs 54.6 us), loses the other 19 (shape, M <= 8) points.
GEMV_MAX_M = 0
GEMV_TUNED: dict[tuple[int, int, int], GemvConfig] = {}


def gemv_config_for(M: int, N: int, K: int, device: torch.device) -> GemvConfig:
    """The tuned config, else (from sm_90 SASS, not yet timed): columns per thread 16 at M = 1 (2 rows per
    chunk: 255 registers, no spills; ~2.5 instructions per weight), 8 at M = 2, 4 above (the x rows multiply
    the FFMAs and the registers); block_n 1024 (512 for N < 8192: more column tiles); split-K over K tiles
    until the programs cover the SMs 4 times."""
    if (M, N, K) in GEMV_TUNED:
        return GEMV_TUNED[(M, N, K)]
    bn = 1024 if N >= 8192 else 512
    cols = {1: 16, 2: 8}.get(M, 4)
    split = max(1, min(K // 128, -(-4 * _num_sms(device) // -(-N // bn))))
    return GemvConfig(block_n=bn, rows=2, split_k=split, num_warps=max(1, bn // (32 * cols)))


if triton is not None:

    @triton.jit
    def _unpack(words, S0: tl.constexpr, NS: tl.constexpr, OFF: tl.constexpr, MAGIC_BITS: tl.constexpr,
                UPCAST: tl.constexpr, dtype: tl.constexpr):
        """Shifts S0 .. S0 + NS - 1 (NS in 1, 2, 4) of words int32 [R, KW] (shuffle_int4's order) -> the
        weights [R, 2 NS KW] in k order (column 2 ((s - S0) KW + i) + h = nibble s + 4h of word i), as floats
        OFF + q. Marlin's conversion: (w >> 4s) & 0x000F000F | MAGIC:MAGIC (one lop3) is the float pair
        (OFF + nibble s, OFF + nibble s + 4) in one 32-bit register, the pair of k that the MMA operand holds
        in one register; the joins and reshapes only name the registers. OFF = 0: integer halves converted."""
        R: tl.constexpr = words.shape[0]
        KW: tl.constexpr = words.shape[1]
        if NS == 4:
            p = tl.join(tl.join(words >> (4 * S0), words >> (4 * S0 + 4)),
                        tl.join(words >> (4 * S0 + 8), words >> (4 * S0 + 12)))          # [R, KW, b, a]: s = 2a + b
            p = tl.reshape(tl.permute(p, (0, 3, 2, 1)), [R, 4 * KW])
        elif NS == 2:
            p = tl.join(words >> (4 * S0), words >> (4 * S0 + 4))                           # [R, KW, 2]
            p = tl.reshape(tl.permute(p, (0, 2, 1)), [R, 2 * KW])
        else:
            p = words >> (4 * S0)
        if OFF == 0:
            p = p & 0x000F000F
            qf = tl.reshape(tl.join(p & 0xFFFF, p >> 16), [R, 2 * NS * KW]).to(tl.float32 if UPCAST else dtype)
        else:
            if UPCAST:  # the interpreter runs no inline asm
                p = (p & 0x000F000F) | (MAGIC_BITS * 65537)
            else:       # one lop3 (the compiler emits an and and an or)
                p = tl.inline_asm_elementwise(f"lop3.b32 $0, $1, 0x000F000F, {MAGIC_BITS * 65537}, 0xEA;", "=r,r",
                                              [p], dtype=tl.int32, is_pure=True, pack=1)
            qf = tl.reshape(tl.join(p.to(tl.int16), (p >> 16).to(tl.int16)), [R, 2 * NS * KW]).to(dtype, bitcast=True)
            if UPCAST:  # numpy has no bf16 matmul
                qf = qf.to(tl.float32)
        return qf

    @triton.jit
    def _load_groups(ptr, g0, N, rn, n_ok, GROUPS: tl.constexpr):
        """Rows g0 .. g0 + GROUPS - 1 of a [K / G, N] tensor at columns rn, in fp32: [BLOCK_N] (GROUPS = 1),
        [BLOCK_N, 2] or [BLOCK_N, 2, 2] (group g0 + 2a + b at [:, a, b]); _group takes one out."""
        if GROUPS == 1:
            v = tl.load(ptr + g0 * N + rn, mask=n_ok, other=0.0)
        elif GROUPS == 2:
            v = tl.load(ptr + (g0 + tl.arange(0, 2))[None, :] * N + rn[:, None], mask=n_ok[:, None], other=0.0)
        else:
            a = tl.arange(0, 2)
            v = tl.load(ptr + (g0 + 2 * a[None, :, None] + a[None, None, :]) * N + rn[:, None, None],
                        mask=n_ok[:, None, None], other=0.0)
        return v.to(tl.float32)

    @triton.jit
    def _group(v, g: tl.constexpr, GROUPS: tl.constexpr):
        """Group g of _load_groups's result: [BLOCK_N]."""
        if GROUPS == 1:
            r = v
        else:
            v0, v1 = tl.split(v)          # GROUPS 2: g = 0, 1; GROUPS 4: b = 0, 1
            if g % 2 == 0:
                r = v0
            else:
                r = v1
            if GROUPS == 4:
                r0, r1 = tl.split(r)      # a = 0, 1
                if g // 2 == 0:
                    r = r0
                else:
                    r = r1
        return r

    @triton.jit
    def _mma(a, b, acc, IEEE: tl.constexpr):
        if IEEE:
            return tl.dot(a, b, acc, input_precision="ieee")
        return tl.dot(a, b, acc)

    @triton.jit
    def _w4a16_kernel(x_ptr, qw_ptr, qw_desc, s_ptr, z_ptr, d_ptr, out_ptr, ws_ptr, cnt_ptr,
                      M, N, N_D, K, G, stride_xm, stride_om, TILES_PER_SPLIT, GRID_NQ, GRID_N,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
                      GROUPS: tl.constexpr, OFF: tl.constexpr, MAGIC_BITS: tl.constexpr,
                      UPCAST: tl.constexpr, IEEE: tl.constexpr, TMA: tl.constexpr = False,
                      DENSE: tl.constexpr = False):
        """Grid (GRID_N, M tiles, SPLIT_K): one (output tile, K split) per program. The int4 columns' (_int4_acc)
        or, with DENSE, for tiles from GRID_NQ on, the bf16 tail's (_dense_acc: d_ptr [N_D, K], output columns N..;
        a mixed fused weight's unquantized rows, e.g. the GDN gates b / a next to int4 q/k/v/z, in the same launch
        instead of a cuBLAS GEMM and its split-K reduction); then the output or the split-K partial.
        Split-K: fp32 partial to ws[pid_k] ([SPLIT_K, M, N + N_D]); the last of the tile's SPLIT_K programs sums
        them in split order (deterministic bits) and resets the tile's counter to 0 for the next call."""
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        pid_k = tl.program_id(2)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        m_ok = rm < M
        t0 = pid_k * TILES_PER_SPLIT
        t1 = tl.minimum(t0 + TILES_PER_SPLIT, K // BLOCK_K)
        if not DENSE or pid_n < GRID_NQ:
            rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            n_ok = rn < N
            acc = _int4_acc(x_ptr, qw_ptr, qw_desc, s_ptr, z_ptr, rm, rn, m_ok, n_ok, N, G, stride_xm, t0, t1, pid_n,
                            BLOCK_M, BLOCK_N, BLOCK_K, GROUPS, OFF, MAGIC_BITS, UPCAST, IEEE, TMA)
            col = rn
        else:
            rn = (pid_n - GRID_NQ) * BLOCK_N + tl.arange(0, BLOCK_N)
            n_ok = rn < N_D
            acc = _dense_acc(x_ptr, d_ptr, rm, rn, m_ok, n_ok, K, stride_xm, t0, t1, BLOCK_M, BLOCK_N, BLOCK_K,
                             UPCAST, IEEE)
            col = N + rn
        mask = m_ok[:, None] & n_ok[None, :]
        out = out_ptr + rm[:, None] * stride_om + col[None, :]
        if SPLIT_K == 1:
            tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)
        else:
            NO = N + N_D
            part = ws_ptr + rm[:, None] * NO + col[None, :]
            tl.store(part + pid_k * M * NO, acc, mask=mask)
            tl.debug_barrier()
            tile = pid_m * GRID_N + pid_n
            arrived = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel")
            if arrived == SPLIT_K - 1:
                total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
                for sk in range(SPLIT_K):
                    other = tl.load(part + sk * M * NO, mask=mask & (sk != pid_k), other=0.0, cache_modifier=".cg")
                    total += tl.where(sk == pid_k, acc, other)
                tl.store(out, total.to(out_ptr.dtype.element_ty), mask=mask)
                tl.atomic_xchg(cnt_ptr + tile, 0)

    @triton.jit
    def _int4_acc(x_ptr, qw_ptr, qw_desc, s_ptr, z_ptr, rm, rn, m_ok, n_ok, N, G, stride_xm, t0, t1, pid_n,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUPS: tl.constexpr,
                  OFF: tl.constexpr, MAGIC_BITS: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
                  TMA: tl.constexpr):
        """x [rm] times the int4 columns rn over K tiles t0 .. t1 -> fp32 [BLOCK_M, BLOCK_N]. Words in shuffle_int4's
        order (BLOCK_K = the weight's block_k). Per K tile: the [BLOCK_N, KW] words (pipelined through shared memory,
        coalesced along N), then per group of the tile (GROUPS = BLOCK_K / G, else 1) its 4 / GROUPS shifts
        unpacked to [BLOCK_N, BLOCK_K / GROUPS] weights in k order and one dot, out^T = W x^T: the weight is the
        MMA's M side (the wgmma / mma.sync A operand straight from the unpacking registers), the few x rows (x^T
        pipelined through shared memory) its N side. Zero and scale apply to the fp32 product of a group:
        acc += (dot(q + OFF, x^T) - (zero + OFF) rowsum(x)) * scale, rowsum(x) being a second dot with a ones
        operand (the tensor cores are idle at M <= 16)."""
        dtype = x_ptr.dtype.element_ty
        KW: tl.constexpr = BLOCK_K // 8
        KG: tl.constexpr = BLOCK_K // GROUPS
        NS: tl.constexpr = 4 // GROUPS
        i = tl.arange(0, KW)
        kk = tl.arange(0, KG)
        x_rows = x_ptr + rm.to(tl.int64) * stride_xm
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)  # out^T
        # scales and zeros are loaded a tile ahead (the compiler pipelines only the words and x, through
        # shared memory): their DRAM latency would otherwise stall every tile
        t_nx = tl.minimum(t0, t1 - 1)  # an empty split (t0 >= t1 = K / BLOCK_K) reads a valid row, unused
        s_nx = _load_groups(s_ptr, (t_nx * BLOCK_K) // G, N, rn, n_ok, GROUPS)
        z_nx = _load_groups(z_ptr, (t_nx * BLOCK_K) // G, N, rn, n_ok, GROUPS)
        for t in range(t0, t1):
            k0 = t * BLOCK_K
            s_cur, z_cur = s_nx, z_nx
            t_nx = tl.minimum(t + 1, t1 - 1)  # clamped: the last tile reloads, harmlessly
            s_nx = _load_groups(s_ptr, (t_nx * BLOCK_K) // G, N, rn, n_ok, GROUPS)
            z_nx = _load_groups(z_ptr, (t_nx * BLOCK_K) // G, N, rn, n_ok, GROUPS)
            if TMA:  # the [KW, BLOCK_N] tile as stored (one bulk copy; out-of-range columns read 0), transposed
                words = tl.trans(qw_desc.load([k0 // 8, pid_n * BLOCK_N]))
            else:
                words = tl.load(qw_ptr + (k0 // 8 + i)[None, :] * N + rn[:, None], mask=n_ok[:, None], other=0)
            for g in tl.static_range(GROUPS):
                kg = k0 + g * KG
                s = _group(s_cur, g, GROUPS)
                z = _group(z_cur, g, GROUPS) + OFF
                qf = _unpack(words, g * NS, NS, OFF, MAGIC_BITS, UPCAST, dtype)     # [BLOCK_N, KG]: k = kg + col
                xv = tl.load(x_rows[None, :] + (kg + kk)[:, None], mask=m_ok[None, :], other=0.0)   # x^T [KG, BLOCK_M]
                if UPCAST:
                    xv = xv.to(tl.float32)
                d = _mma(qf, xv, tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32), IEEE)
                # rowsum(x) by the idle tensor cores, in d's layout (no cross-thread reduction, no barrier)
                xs = _mma(tl.full([BLOCK_N, KG], 1.0, qf.dtype), xv,
                          tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32), IEEE)
                acc += (d - z[:, None] * xs) * s[:, None]
        return tl.trans(acc)

    @triton.jit
    def _dense_acc(x_ptr, d_ptr, rm, rn, m_ok, n_ok, K, stride_xm, t0, t1, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr):
        """x [rm] times the bf16 rows rn of d_ptr [N_D, K] over K tiles t0 .. t1 -> fp32 [BLOCK_M, BLOCK_N], in steps
        of 32 k (out^T = W x^T, as _int4_acc): its pipelined [BLOCK_N, 32] tiles (8 KB at BLOCK_N 128) need no more
        shared memory than the int4 path's (the compiler lays both branches' buffers over each other), so the int4
        programs keep their occupancy."""
        DK: tl.constexpr = 32
        k = tl.arange(0, DK)
        x_rows = x_ptr + rm.to(tl.int64) * stride_xm
        w_rows = d_ptr + rn.to(tl.int64) * K
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        for k0 in range(t0 * BLOCK_K, t1 * BLOCK_K, DK):
            kt = k0 + k
            w = tl.load(w_rows[:, None] + kt[None, :], mask=n_ok[:, None], other=0.0)             # [BLOCK_N, DK]
            xv = tl.load(x_rows[None, :] + kt[:, None], mask=m_ok[None, :], other=0.0)            # x^T [DK, BLOCK_M]
            if UPCAST:
                w = w.to(tl.float32)
                xv = xv.to(tl.float32)
            acc = _mma(w, xv, acc, IEEE)
        return tl.trans(acc)

    @triton.jit
    def _bytes_to_f32(words, ASM: tl.constexpr):
        """int32 words -> per byte b (nibbles 2b = lo, 2b + 1 = hi) the fp32 f_b = 2^15 + lo + 16 hi (the byte
        moved under the exponent bits 0x47: one prmt) and g_b = 2^15 + 16 hi (f_b with lo cleared: one and);
        returns f0, g0, f1, g1, f2, g2, f3, g3. The interpreter runs no PTX: Triton ops with the same bits."""
        if ASM:
            f0, g0, f1, g1, f2, g2, f3, g3 = tl.inline_asm_elementwise(
                "prmt.b32 $0, $8, 0x47000000, 0x7404; and.b32 $1, $0, 0xFFFFF000; "
                "prmt.b32 $2, $8, 0x47000000, 0x7414; and.b32 $3, $2, 0xFFFFF000; "
                "prmt.b32 $4, $8, 0x47000000, 0x7424; and.b32 $5, $4, 0xFFFFF000; "
                "prmt.b32 $6, $8, 0x47000000, 0x7434; and.b32 $7, $6, 0xFFFFF000;",
                "=r,=r,=r,=r,=r,=r,=r,=r,r", [words], dtype=(tl.int32,) * 8, is_pure=True, pack=1)
        else:
            f0 = ((words << 8) & 0xFF00) | 0x47000000
            f1 = (words & 0xFF00) | 0x47000000
            f2 = ((words >> 8) & 0xFF00) | 0x47000000
            f3 = ((words >> 16) & 0xFF00) | 0x47000000
            g0, g1, g2, g3 = f0 & -4096, f1 & -4096, f2 & -4096, f3 & -4096
        return (f0.to(tl.float32, bitcast=True), g0.to(tl.float32, bitcast=True),
                f1.to(tl.float32, bitcast=True), g1.to(tl.float32, bitcast=True),
                f2.to(tl.float32, bitcast=True), g2.to(tl.float32, bitcast=True),
                f3.to(tl.float32, bitcast=True), g3.to(tl.float32, bitcast=True))

    @triton.jit
    def _gemv_x(x_rows, k, m_ok, X_PAIR: tl.constexpr):
        """x [BM, ROWS] at k and k + 1 (k even) in fp32: one 32-bit load of the pair for 16-bit x (X_PAIR 1:
        bf16, whose fp32 is its bits << 16; 2: fp16), two loads for fp32 x (X_PAIR 0; k counts x elements)."""
        if X_PAIR == 0:
            a = tl.load(x_rows + k, mask=m_ok, other=0.0)
            b = tl.load(x_rows + k + 1, mask=m_ok, other=0.0)
        else:
            p = tl.load(x_rows + k // 2, mask=m_ok, other=0)
            if X_PAIR == 1:
                a = (p << 16).to(tl.float32, bitcast=True)
                b = (p & -65536).to(tl.float32, bitcast=True)
            else:
                a = p.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
                b = (p >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        return a, b

    @triton.jit
    def _gemv_bytes(part, xs, xh, fa, ga, fb, gb, x_rows, k_lo, m_ok, KW: tl.constexpr, X_PAIR: tl.constexpr,
                    FIRST: tl.constexpr):
        """Bytes b and b + 2 (b = 0, 1) of the words [1, ROWS, BLOCK_N] (f, g of _bytes_to_f32) into part
        [BLOCK_M, ROWS, BLOCK_N] (FIRST: part starts here, no zero-fill). Byte b's lo nibble is at k_lo
        [BM, ROWS] (even), its hi nibble at k_lo + 2 KW, byte b + 2's at k_lo + 1 and k_lo + 2 KW + 1: x pairs.
        Per byte f x_lo + g (x_hi / 16 - x_lo) = lo x_lo + hi x_hi + 2^11 x_hi, two FFMAs per x row;
        xs += x_lo + x_hi, xh += x_hi (the offsets, taken out per tile). x is [BM, ROWS] (a slice of part's
        layout: one load per element and thread), expanded along n."""
        la, lb = _gemv_x(x_rows, k_lo, m_ok, X_PAIR)
        ua, ub = _gemv_x(x_rows, k_lo + 2 * KW, m_ok, X_PAIR)
        if FIRST:
            part = fa * la[:, :, None]
            xs = (la + ua) + (lb + ub)
            xh = ua + ub
        else:
            part += fa * la[:, :, None]  # one statement per product: FFMAs (one expression adds the products first)
            xs += (la + ua) + (lb + ub)
            xh += ua + ub
        part += ga * (ua * 0.0625 - la)[:, :, None]
        part += fb * lb[:, :, None]
        part += gb * (ub * 0.0625 - lb)[:, :, None]
        return part, xs, xh

    @triton.jit
    def _gemv_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, out_ptr, ws_ptr, cnt_ptr,
                     M, N, stride_xm, stride_om, KTILES, TILES_PER_SPLIT,
                     G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     ROWS: tl.constexpr, SPLIT_K: tl.constexpr, X_PAIR: tl.constexpr, ASM: tl.constexpr):
        """Small M on CUDA cores, for bandwidth: words in shuffle_int4's order (BLOCK_K = the weight's block_k
        <= G: a K tile is in one group), ROWS word rows x BLOCK_N columns per iteration, loaded along N (16
        bytes per thread and row), every row in each thread (no cross-thread sums in the loop); a K tile's row
        chunks are unrolled (the tile's sums stay in registers, its loads are all issued early). Nibble j of
        word i of tile t is k = t BLOCK_K + 2 ((j % 4) KW + i) + j // 4 (shuffle_int4), so byte b holds
        (lo, hi) at k_lo = t BLOCK_K + 2 ((2b % 4) KW + i) + b // 2 and k_lo + 2 KW; x is gathered at those
        (L1 hits, shared by the thread's columns). Per K tile, the group's zero and scale apply to the
        fp32 sums: acc += (sum(part) - 2^11 sum(x_hi) - z sum(x)) * s. The words, part, scales and acc are
        3-D [m, row, n] in one blocked layout (4 consecutive n per thread, from the words' 16-byte loads), x a
        2-D slice of it: no layout conversion (shared memory, barriers) in the loop. x_ptr: x, or its int32
        view (X_PAIR > 0; stride_xm then counts pairs). Split-K as _w4a16_kernel."""
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        KW: tl.constexpr = BLOCK_K // 8
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rn = tl.max_contiguous(tl.multiple_of(rn, 4), 4)[None, None, :]    # scales: 4 per load, as the words
        n_ok = rn < N
        rm = tl.arange(0, BLOCK_M)
        m_ok = rm[:, None] < M                                                                  # [BM, 1]
        r = tl.arange(0, ROWS)
        x_rows = x_ptr + rm[:, None].to(tl.int64) * stride_xm                                   # [BM, 1]
        acc = tl.zeros([BLOCK_M, 1, BLOCK_N], dtype=tl.float32)
        part = tl.zeros([BLOCK_M, ROWS, BLOCK_N], dtype=tl.float32)  # (each tile starts it afresh)
        xs = tl.zeros([BLOCK_M, ROWS], dtype=tl.float32)
        xh = tl.zeros([BLOCK_M, ROWS], dtype=tl.float32)
        t0 = pid_k * TILES_PER_SPLIT
        t1 = tl.minimum(t0 + TILES_PER_SPLIT, KTILES)
        for t in range(t0, t1):
            grp = (t * BLOCK_K) // G
            s = tl.load(s_ptr + grp * N + rn, mask=n_ok, other=0.0).to(tl.float32)             # [1, 1, BN]
            z = tl.load(z_ptr + grp * N + rn, mask=n_ok, other=0.0).to(tl.float32)
            for c in tl.static_range(KW // ROWS):  # row chunks: the tile's sums carried in registers
                row = t * KW + c * ROWS
                words = tl.load(qw_ptr + (row + r)[None, :, None] * N + rn, mask=n_ok, other=0)  # [1, ROWS, BN]
                kb = t * BLOCK_K + 2 * (c * ROWS + r)[None, :]                                   # [1, ROWS]
                f0, g0, f1, g1, f2, g2, f3, g3 = _bytes_to_f32(words, ASM)
                part, xs, xh = _gemv_bytes(part, xs, xh, f0, g0, f2, g2, x_rows, kb, m_ok, KW, X_PAIR, c == 0)  # 0 1 4 5
                part, xs, xh = _gemv_bytes(part, xs, xh, f1, g1, f3, g3, x_rows, kb + 4 * KW, m_ok, KW, X_PAIR, False)
            xsum = tl.sum(xs, 1)[:, None, None]
            xhi = tl.sum(xh, 1)[:, None, None]
            acc += (tl.sum(part, 1, keep_dims=True) - (2048.0 * xhi + z * xsum)) * s            # [BM, 1, BN]
        mask = (rm[:, None, None] < M) & n_ok
        out = out_ptr + rm[:, None, None] * stride_om + rn                                       # [BM, 1, BN]
        if SPLIT_K == 1:
            tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)
        else:
            # as _w4a16_kernel: fp32 partial, the last arriver sums the splits in order and resets the counter
            part_out = ws_ptr + rm[:, None, None] * N + rn
            tl.store(part_out + pid_k * M * N, acc, mask=mask)
            tl.debug_barrier()
            arrived = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel")
            if arrived == SPLIT_K - 1:
                total = tl.zeros([BLOCK_M, 1, BLOCK_N], dtype=tl.float32)
                for sk in range(SPLIT_K):
                    other = tl.load(part_out + sk * M * N, mask=mask & (sk != pid_k), other=0.0, cache_modifier=".cg")
                    total += tl.where(sk == pid_k, acc, other)
                tl.store(out, total.to(out_ptr.dtype.element_ty), mask=mask)
                tl.atomic_xchg(cnt_ptr + pid_n, 0)

    @triton.jit
    def _gemv_load_probe_kernel(qw_ptr, out_ptr, N, KTILES, TILES_PER_SPLIT,
                                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ROWS: tl.constexpr):
        """The bandwidth ceiling of _gemv_kernel's access pattern (benchmarks only): the same grid, loop and
        word loads, xor-ed into one int per program."""
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        KW: tl.constexpr = BLOCK_K // 8
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rn = tl.max_contiguous(tl.multiple_of(rn, 4), 4)[None, None, :]
        n_ok = rn < N
        r = tl.arange(0, ROWS)[None, :, None]
        acc = tl.zeros([1, ROWS, BLOCK_N], dtype=tl.int32)
        t0 = pid_k * TILES_PER_SPLIT
        t1 = tl.minimum(t0 + TILES_PER_SPLIT, KTILES)
        for t in range(t0, t1):
            for c in tl.static_range(KW // ROWS):
                acc ^= tl.load(qw_ptr + (t * KW + c * ROWS + r) * N + rn, mask=n_ok, other=0)
        tl.store(out_ptr + pid_k * tl.num_programs(0) + pid_n, tl.xor_sum(tl.reshape(acc, [ROWS * BLOCK_N]), 0))

    @triton.jit
    def _dequant_kernel(qw_ptr, s_ptr, z_ptr, out_ptr, N, G, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
        """W^T [K, N] = (q - z) * s in fp32, rounded to out's dtype (the reference's arithmetic); one K tile
        of the shuffled words and BLOCK_N columns per program."""
        KW: tl.constexpr = BLOCK_K // 8
        k0 = tl.program_id(0) * BLOCK_K
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = rn < N
        i = tl.arange(0, KW)
        words = tl.load(qw_ptr + (k0 // 8 + i)[:, None] * N + rn[None, :], mask=n_ok[None, :], other=0)
        j = tl.arange(0, 8)[:, None, None]
        q = ((words[None, :, :] >> (4 * j)) & 0xF).to(tl.float32)           # [8, KW, BLOCK_N]
        k = k0 + 2 * ((j % 4) * KW + i[None, :, None]) + j // 4             # [8, KW, 1]
        g = (k0 + 2 * (j % 4) * KW) // G                                    # [8, 1, 1]: a nibble is in one group
        s = tl.load(s_ptr + g * N + rn[None, None, :], mask=n_ok[None, None, :], other=0.0).to(tl.float32)
        z = tl.load(z_ptr + g * N + rn[None, None, :], mask=n_ok[None, None, :], other=0.0).to(tl.float32)
        tl.store(out_ptr + k.to(tl.int64) * N + rn[None, None, :], ((q - z) * s).to(out_ptr.dtype.element_ty),
                 mask=(k >= 0) & n_ok[None, None, :])

    _INTERPRETED = not isinstance(_w4a16_kernel, triton.runtime.JITFunction)
else:
    _INTERPRETED = False


def _use_triton(t: torch.Tensor) -> bool:
    return triton is not None and (t.is_cuda or (_INTERPRETED and os.environ.get("TRITON_INTERPRET") == "1"))


def dequantize_int4_t(w: Int4Weight, dtype: torch.dtype) -> torch.Tensor:
    """W^T [K, N] in `dtype` by the Triton kernel (equal to dequantize_int4(...).t())."""
    K, N = w.in_features, w.out_features
    out = torch.empty(K, N, dtype=dtype, device=w.packed.device)
    _dequant_kernel[(K // w.block_k, triton.cdiv(N, 128))](w.packed, w.scales, w.zeros, out, N, w.group_size,
                                                           BLOCK_K=w.block_k, BLOCK_N=128, num_warps=4)
    return out


# Prefill (M >= LARGE_M): dequantize all, then one GEMM; column slices on a side stream measured slower (H100 run 130)
def dequant_mm(x2: torch.Tensor, w: Int4Weight) -> torch.Tensor:
    """x2 [M, K] @ W^T by the Triton dequantize to x2's dtype and one cuBLAS GEMM."""
    return x2 @ dequantize_int4_t(w, x2.dtype)


def w4a16_gemm_triton(x2: torch.Tensor, w: Int4Weight, cfg: Config, dense: torch.Tensor | None = None) -> torch.Tensor:
    """The GEMM kernel on a 2-D, row-contiguous x [M, K] with config cfg; dense [N_D, K] (x's dtype, contiguous):
    a mixed weight's bf16 rows, output columns N.. of the same launch."""
    M, K = x2.shape
    N, G, bk = w.out_features, w.group_size, w.block_k
    n_d = 0 if dense is None else dense.shape[0]
    groups = max(1, bk // G)
    magic = cfg.magic and x2.dtype in (torch.bfloat16, torch.float16)
    grid_nq, grid_m = triton.cdiv(N, cfg.block_n), triton.cdiv(M, cfg.block_m)
    grid_n = grid_nq + triton.cdiv(n_d, cfg.block_n)
    split = min(cfg.split_k, K // bk)
    if grid_n * grid_m > w.counters.numel():
        split = 1
    tiles = triton.cdiv(K // bk, split)
    out = torch.empty(M, N + n_d, dtype=x2.dtype, device=x2.device)
    ws = torch.empty(split, M, N + n_d, dtype=torch.float32, device=x2.device) if split > 1 else out
    off, bits = ((128, 0x4300) if x2.dtype == torch.bfloat16 else (1024, 0x6400)) if magic else (0, 0)
    if cfg.tma and TensorDescriptor is None:
        raise RuntimeError(f"Config.tma needs triton.tools.tensor_descriptor (Triton >= 3.4), not in Triton {triton.__version__}")
    desc = TensorDescriptor.from_tensor(w.packed, [bk // 8, cfg.block_n]) if cfg.tma else None
    if dense is not None:
        assert dense.dtype == x2.dtype and dense.is_contiguous() and dense.shape[1] == K, (dense.dtype, dense.shape)
    _w4a16_kernel[(grid_n, grid_m, split)](
        x2, w.packed, desc, w.scales, w.zeros, out if dense is None else dense, out, ws, w.counters, M, N, n_d, K,
        G, x2.stride(0), out.stride(0), tiles, grid_nq, grid_n, DENSE=dense is not None,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=bk, SPLIT_K=split, GROUPS=groups, OFF=off,
        MAGIC_BITS=bits, UPCAST=_INTERPRETED, IEEE=x2.dtype == torch.float32, TMA=cfg.tma,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out


def gemv_supported(w: Int4Weight) -> bool:
    """_gemv_kernel needs shuffled words (block_k >= 16) and K tiles inside one group (block_k <= G)."""
    return 16 <= w.block_k <= w.group_size


def _gemv_split(w: Int4Weight, cfg: GemvConfig, device) -> tuple[int, int, int]:
    """-> (split_k, K tiles per split (the last split possibly short or empty), rows per chunk)."""
    tiles = w.in_features // w.block_k
    split = cfg.split_k or gemv_config_for(1, w.out_features, w.in_features, device).split_k
    split = max(1, min(split, tiles))
    if triton.cdiv(w.out_features, cfg.block_n) > w.counters.numel():
        split = 1
    return split, triton.cdiv(tiles, split), min(cfg.rows, w.block_k // 8)


def w4a16_gemv_triton(x2: torch.Tensor, w: Int4Weight, cfg: GemvConfig) -> torch.Tensor:
    """The small-M kernel on a 2-D, row-contiguous x [M, K] (M <= 16) with config cfg."""
    M, K = x2.shape
    N = w.out_features
    assert gemv_supported(w) and M <= 16, (w.block_k, w.group_size, M)
    split, tiles_per_split, rows = _gemv_split(w, cfg, x2.device)
    out = torch.empty(M, N, dtype=x2.dtype, device=x2.device)
    ws = torch.empty(split, M, N, dtype=torch.float32, device=x2.device) if split > 1 else out
    pair = {torch.bfloat16: 1, torch.float16: 2}.get(x2.dtype, 0)
    if pair and (x2.data_ptr() % 4 or x2.stride(0) % 2):
        x2 = x2.contiguous().clone()
    xv = x2.view(torch.int32) if pair else x2  # 16-bit x read as pairs (K is a multiple of 8)
    _gemv_kernel[(triton.cdiv(N, cfg.block_n), split)](
        xv, w.packed, w.scales, w.zeros, out, ws, w.counters, M, N, xv.stride(0), out.stride(0),
        K // w.block_k, tiles_per_split, G=w.group_size, BLOCK_M=triton.next_power_of_2(M), BLOCK_N=cfg.block_n,
        BLOCK_K=w.block_k, ROWS=rows, SPLIT_K=split, X_PAIR=pair, ASM=not _INTERPRETED,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out


def gemv_load_probe(w: Int4Weight, cfg: GemvConfig) -> torch.Tensor:
    """_gemv_load_probe_kernel on w's words with cfg's grid and loop: one int32 per program (its words' xor)."""
    N = w.out_features
    split, tiles_per_split, rows = _gemv_split(w, cfg, w.packed.device)
    grid = (triton.cdiv(N, cfg.block_n), split)
    out = torch.empty(grid[0] * grid[1], dtype=torch.int32, device=w.packed.device)
    _gemv_load_probe_kernel[grid](w.packed, out, N, w.in_features // w.block_k, tiles_per_split,
                                  BLOCK_N=cfg.block_n, BLOCK_K=w.block_k, ROWS=rows, num_warps=cfg.num_warps,
                                  num_stages=cfg.num_stages)
    return out


@dataclass
class MixedWeight:
    """A fused weight whose first columns are int4 and the rest bf16 (a checkpoint that quantizes the GDN layers'
    q/k/v/z projections but keeps the gates b / a unquantized): one GEMM launch for both on the GPU."""
    int4: Int4Weight
    dense: torch.Tensor        # [N_D, K] in the activation dtype

    @property
    def out_features(self) -> int:
        return self.int4.out_features + self.dense.shape[0]


def mixed_in_one_launch(x: torch.Tensor, w: MixedWeight, config=None) -> bool:
    """Whether w4a16_matmul runs a MixedWeight as one launch of the tensor-core kernel (decode sizes on the GPU) rather
    than the int4 GEMM and a bf16 one (models/fuse.linear_split then splits each output on its own: no concatenation)."""
    M = x.numel() // x.shape[-1]
    return (_use_triton(x) and w.int4.block_k >= 16 and 0 < M < (LARGE_M if config is None else 1 << 62)
            and not isinstance(config, GemvConfig) and w.dense.dtype == x.dtype
            and not (config is None and M <= GEMV_MAX_M and gemv_supported(w.int4)))


def w4a16_matmul(x: torch.Tensor, w: Int4Weight | MixedWeight, config: Config | GemvConfig | None = None) -> torch.Tensor:
    """x [..., K] -> x @ W.T [..., N] in x's dtype. CUDA: the small-M CUDA-core kernel for M <= GEMV_MAX_M (off
    by default) or when config is a GemvConfig, the tensor-core kernel for M < LARGE_M rows, the Triton
    dequantize + cuBLAS from there; CPU: the reference. Graph-capturable: no host syncs, branches on
    shapes only (M's config comes from its bucket). A MixedWeight's bf16 columns come from the same launch on the
    tensor-core kernel's path (decode), from a separate GEMM on the others."""
    K = x.shape[-1]
    if isinstance(w, MixedWeight):
        if not mixed_in_one_launch(x, w, config):
            return torch.cat([w4a16_matmul(x, w.int4, config), torch.nn.functional.linear(x, w.dense.to(x.dtype))], -1)
        x2 = x.reshape(-1, K)
        x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
        out = w4a16_gemm_triton(x2, w.int4, config or config_for(x2.shape[0], w.int4.out_features, K, x.device), w.dense)
        return out.view(*x.shape[:-1], w.out_features)
    if not _use_triton(x) or w.block_k < 16:
        return (x.float() @ dequantize_prepared(w, x.dtype).float().t()).to(x.dtype)
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M = x2.shape[0]
    if M == 0:
        return x.new_empty(*x.shape[:-1], w.out_features)
    if isinstance(config, GemvConfig) or (config is None and M <= GEMV_MAX_M and gemv_supported(w)):
        out = w4a16_gemv_triton(x2, w, config or gemv_config_for(M, w.out_features, K, x.device))
    elif M >= LARGE_M and config is None:
        out = dequant_mm(x2, w)
    else:
        out = w4a16_gemm_triton(x2, w, config or config_for(M, w.out_features, K, x.device))
    return out.view(*x.shape[:-1], w.out_features)

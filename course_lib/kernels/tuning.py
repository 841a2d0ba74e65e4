"""Block sizes, warps and pipeline stages for the attention kernels.

Two regimes, as chapter 06 explains:

- **Interpreter (CPU).** ``triton.autotune`` with more than one config fails there ("0 active
  drivers", FACTS.md), and the interpreter runs every program in Python, so bigger tiles mean
  fewer programs and a faster run. The launchers call the plain ``@triton.jit`` kernels with the
  one fixed config below (tests pass smaller tiles explicitly to exercise many tiles).
- **GPU.** The launchers use a small table of configs measured on an H100 (:func:`gpu_default`,
  numbers in ``course_lib/data/benchmarks/NOTES.md``): by kernel, head dim, dtype size, and for
  short causal sequences. We measured the alternative, Triton's autotuner over the short
  candidate lists below, on the whole benchmark grid: it picked a config 8-20% slower than the
  table's in several cells, and at short sequences (N = 1k, where one call takes ~0.1 ms and
  timing noise is large) it twice kept a config that made us slower than FlashAttention-2
  (0.92x forward, 0.80x forward+backward), while the table was >= 1.06x FlashAttention-2 in
  every cell. It also spends seconds per new shape. Set ``COURSE_LIB_AUTOTUNE=1`` to autotune
  anyway (over the pruned candidates: :func:`prune_forward`, :func:`prune_dkdv`, :func:`prune_dq`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import triton

# Set COURSE_LIB_AUTOTUNE=1 to let Triton's autotuner pick among the candidates below on the GPU
# instead of the measured table of gpu_default().
AUTOTUNE_ENV = "COURSE_LIB_AUTOTUNE"


@dataclass(frozen=True)
class Blocks:
    """One launch config: tile sizes, warps per program, software-pipelining depth."""

    block_m: int  # query rows per tile (the paper's B_r)
    block_n: int  # key/value rows per tile (the paper's B_c)
    num_warps: int = 4
    num_stages: int = 1


def parse_blocks(text: str) -> Blocks:
    """``"BLOCK_M/BLOCK_N/warps/stages"`` (the sweep tools' command-line form) as :class:`Blocks`."""
    parts = text.split("/")
    if len(parts) != 4 or not all(p.isdigit() for p in parts):
        raise ValueError(f"a config must read BLOCK_M/BLOCK_N/warps/stages, e.g. 64/64/4/3, got {text!r}")
    return Blocks(*map(int, parts))


# Interpreter: fewest programs for notebook sizes (N <= 512), still several tiles per row.
INTERPRETER_FORWARD = Blocks(block_m=64, block_n=64)
INTERPRETER_BACKWARD = Blocks(block_m=64, block_n=64)

# Causal attention over at most this many keys counts as "short": there, smaller owned tiles win
# (more programs for the same work, and less time in the masked diagonal band).
SHORT_CAUSAL_SEQ_LEN = 1024


# The one-pass backward (dK, dV and dQ in one kernel, dQ by fp32 atomic adds) is the default where
# it was faster on an H100 (NOTES.md, "One-pass backward", the bench grid, backward alone): at
# d <= 64, 1.08-1.23x the two-kernel backward, except causal N = 1k (0.91-0.93x: the atomics' and
# the fp32 dQ buffer's traffic are a larger share of a short backward). At d = 128 it was within
# noise of the two-kernel backward (0.93-1.06x): its tiles need more registers than a thread has
# (the dK, dV accumulators alone take 128 per thread) and spill; the tiles that do not spill are
# 20-45% slower. There the two-kernel backward stays: as fast, bit-for-bit reproducible, and no
# fp32 dQ buffer.
ONE_PASS_MAX_HEAD_DIM = 64


def one_pass_pays(seq_len: int, head_dim: int, causal: bool, small: bool = False) -> bool:
    """Whether the library's default backward is the one-pass one: padded ``head_dim`` at most
    :data:`ONE_PASS_MAX_HEAD_DIM`, not a short causal sequence, and not a ``small`` problem
    (:func:`small_problem`: there the two-kernel backward has the fewest launches)."""
    short_causal = causal and seq_len <= SHORT_CAUSAL_SEQ_LEN
    return head_dim <= ONE_PASS_MAX_HEAD_DIM and not short_causal and not small


# Small problems take chapter 06's and 07's Triton kernels, not chapter 09's Gluon or TMA ones,
# and the two-kernel backward. A problem is small when it has fewer query tiles of
# SMALL_PROBLEM_TILE_ROWS rows (the Gluon kernels' tile) than the GPU has SMs: every kernel is then
# one partial wave of a few µs, and the call's time is host time (issue 33: on an H100, B=1, H=4,
# N=128, one eager call of the library cost 2.2x SDPA's FlashAttention-2 backend, forward and
# forward+backward; tools/profile_overhead.py there: Triton's tensor-descriptor packing,
# make_tensordesc_arg + fill_tma_descriptor, was 59 of 649 µs of a profiled fwd+bwd call at d=128,
# 10 descriptors per call). The Triton kernels take pointers and strides: no descriptors. The
# two-kernel backward launches Δ, dK/dV and dQ (3 launches) where the one-pass backwards (Gluon's
# and Triton's) launch Δ, dQ's fp32 zero fill, the kernel and dQ's cast (4), and its bits repeat.
# The Gluon kernels stay wherever the GPU is full: every cell of the recorded benchmark grid
# (course_lib/data/benchmarks/h100*.json: N = 1k-16k, B·N = 16k tokens, H·d = 2048) has at least
# 2048 query tiles, 15x an H100's 132 SMs, so those numbers still describe what the library runs.
SMALL_PROBLEM_TILE_ROWS = 128


def small_problem(batch_heads: int, n_q: int, sm_count: int) -> bool:
    """Whether ``batch_heads`` (B·H) heads of ``n_q`` queries make fewer query tiles of
    :data:`SMALL_PROBLEM_TILE_ROWS` rows than ``sm_count`` SMs (see above)."""
    return batch_heads * -(-n_q // SMALL_PROBLEM_TILE_ROWS) < sm_count


def small_problem_on_gpu(q) -> bool:
    """:func:`small_problem` for the ``(B, H, N_q, d)`` CUDA tensor ``q`` on its GPU (False off a GPU)."""
    if not q.is_cuda:
        return False
    import torch

    batch, heads, n_q = q.shape[0], q.shape[1], q.shape[2]
    return small_problem(batch * heads, n_q, torch.cuda.get_device_properties(q.device).multi_processor_count)


# The order of a causal forward's programs (kernels/tiles.py: 0 head by head, first tile first; 1
# each head's last tile first; 2 every head's last tile first). Measured on an H100 (CUDA graphs,
# tools/sweep_forward.py, the table's configs): 1 is +9% at N = 16k, d = 128 (the programs that
# start last are short, so the SMs finish together) and within ±1% elsewhere; 2 is 35% slower at
# N = 1k (running programs read the K/V of many heads at once: the L2 cache no longer holds them).
CAUSAL_ORDER = 1


def causal_order() -> int:
    """The program order of the causal forward kernels (:data:`CAUSAL_ORDER`)."""
    return CAUSAL_ORDER


def autotune_enabled() -> bool:
    """True when ``COURSE_LIB_AUTOTUNE=1`` asks for Triton's autotuner instead of the table."""
    return os.environ.get(AUTOTUNE_ENV, "0") == "1"


def _small_tiles(head_dim: int, element_size: int) -> bool:
    """fp32 tiles, or a head dim above 128, need smaller tiles to fit in shared memory."""
    return element_size >= 4 or head_dim > 128


# fp32 above head dim 128 (padded: 256). There the backward keeps plain fp32 ("ieee") dots, which
# Triton unrolls into FMAs per thread (forward.fp32_dot_precision): the work per thread, and with
# it the compile time, grows with the tile sizes, and the tiles fp32 used before (dK/dV 32x64 and
# dQ 64x32 on 4 warps) spilled 2-18 KB per thread and compiled for about a minute each on an H100.
# Cross-compiled for sm_90 (NOTES.md, "fp32 dots"): these tiles compile in about 5 s on our CPU
# (~11 s on the H100 machine's) with no spills. The forward uses tf32x3 dots, whose tensor-core
# operands need shared memory: 32x32 tiles, one stage (96 KiB, every target). Measured on an H100
# with tools/fp32_dots.py (NOTES.md).
FP32_WIDE_HEAD_DIM = 128
FP32_WIDE = {"forward": Blocks(32, 32, 4, 1), "dkdv": Blocks(16, 32, 8, 2), "dq": Blocks(32, 16, 4, 2)}


def gpu_default(kernel: str, head_dim: int, element_size: int, seq_len: int | None = None,
                causal: bool = False) -> Blocks:
    """The measured GPU config for ``kernel`` ("forward", "dkdv", "dq" or "fused", the one-pass
    backward: dK/dV with dQ's atomic adds).

    Args:
        head_dim: the padded head dim (a power of two); element_size: bytes per input element.
        seq_len: the longer of N_q and N_k (None: treat as long); causal: the mask.

    Measured on an H100 (NOTES.md, sweeps at N = 1k, 4k, 16k, fp16): at d=128, 4 warps spill a
    128-row fp32 accumulator and run at half speed, 8 warps do not; at d=64, 8 warps are 1-7%
    faster in the forward; for causal N <= 1k, 64-row forward tiles are 8% faster, and at d=64
    (32, 64) dK/dV tiles 9% faster, than the long-sequence choice.
    """
    if kernel not in ("forward", "dkdv", "dq", "fused"):
        raise ValueError(f"kernel must be 'forward', 'dkdv', 'dq' or 'fused', got {kernel!r}")
    if kernel == "fused" and not _small_tiles(head_dim, element_size):
        # one-pass backward, measured on an H100 (NOTES.md, "One-pass backward"): at d=128 the
        # dK/dV table's tiles win although they spill ~100 bytes; the tiles that do not spill run
        # 20-45% slower. At d=64, 64x64 tiles on 4 warps.
        return Blocks(64, 128, 8, 3) if head_dim > 64 else Blocks(64, 64, 4, 3)
    if kernel == "fused":
        kernel = "dkdv"
    if element_size >= 4 and head_dim > FP32_WIDE_HEAD_DIM and kernel in FP32_WIDE:
        return FP32_WIDE[kernel]
    if _small_tiles(head_dim, element_size):
        return Blocks(32, 64, 4, 2) if kernel == "dkdv" else Blocks(64, 32, 4, 2)
    short_causal = causal and seq_len is not None and seq_len <= SHORT_CAUSAL_SEQ_LEN
    wide = head_dim > 64
    if kernel == "forward":
        return Blocks(64, 64, 4, 3) if short_causal else Blocks(128, 64, 8, 3)
    if wide:
        return Blocks(64, 128, 8, 3) if kernel == "dkdv" else Blocks(128, 64, 8, 3)
    if short_causal:
        return Blocks(32, 64, 4, 3) if kernel == "dkdv" else Blocks(64, 32, 4, 3)
    return Blocks(32, 128, 4, 3) if kernel == "dkdv" else Blocks(128, 32, 4, 3)


# Smaller configs to fall back on, in order of preference, when the table's choice does not fit
# a GPU with less shared memory than an H100 or spills registers there (kernels/fit.py chooses,
# `python -m course_lib.measure.reach` shows the choice per GPU). Fewer pipeline stages first (same tiles,
# one K/V tile pair less in flight), then smaller tiles. The owned tile (BLOCK_M of forward and dQ,
# BLOCK_N of dK/dV) shrinks last: it sets how often K and V (or Q and dO) are re-read. Last, 8 warps
# on small tiles: half the registers per thread (the fp32 masked backward at d = 32 and 64 spilled
# 8 B on sm_80/86/89 with every 4-warp tile; with 8 warps, none; `reach --check`, 2026-11-27).
# The very last dK/dV entry has one stage *more* than fp32 d = 256's table config (FP32_WIDE), on the
# same tiles: sm_80's ptxas holds the 2-stage masked dK/dV kernel to 128 registers and spills 16 B,
# and every smaller entry above spills too; with 3 stages it gives it 176 registers and spills nothing
# (130 KiB: the A100 has 163; `reach --targets 80`, triton 3.7.1, ptxas 12.8, 2026-11-27; triton
# 3.9.0's ptxas does not spill the table's config there). Being last, it is only tried where every
# config before it spills or does not fit.
_FALLBACKS = {
    "forward": [Blocks(128, 64, 8, 2), Blocks(64, 64, 4, 2), Blocks(64, 32, 4, 2), Blocks(64, 32, 4, 1),
                Blocks(32, 32, 4, 1)],
    "dkdv": [Blocks(64, 128, 8, 2), Blocks(32, 128, 4, 2), Blocks(32, 64, 4, 3), Blocks(32, 64, 4, 2),
             Blocks(32, 64, 4, 1), Blocks(32, 32, 4, 1), Blocks(16, 32, 4, 1), Blocks(32, 32, 8, 1),
             Blocks(16, 32, 8, 1), Blocks(16, 32, 8, 3)],
    "dq": [Blocks(128, 64, 8, 2), Blocks(128, 32, 4, 2), Blocks(64, 32, 4, 3), Blocks(64, 32, 4, 2),
           Blocks(64, 32, 4, 1), Blocks(32, 32, 4, 1), Blocks(32, 16, 4, 1), Blocks(32, 32, 8, 1),
           Blocks(32, 16, 8, 1)],
    "fused": [Blocks(64, 128, 8, 2), Blocks(64, 64, 8, 2), Blocks(64, 64, 4, 2), Blocks(32, 64, 4, 3),
              Blocks(32, 64, 4, 2), Blocks(32, 64, 4, 1), Blocks(32, 32, 4, 1), Blocks(16, 32, 4, 1)],
}
_OWNED = {"forward": "block_m", "dq": "block_m", "dkdv": "block_n", "fused": "block_n"}
# The tables above were measured on an H100: compute capability 9.0, Triton's target 90.
TABLE_ARCH = 90


def gpu_candidates(kernel: str, head_dim: int, element_size: int, seq_len: int | None = None,
                   causal: bool = False) -> list[Blocks]:
    """The configs :func:`course_lib.kernels.fit.choose` tries, in order: the H100 table's
    (:func:`gpu_default`), then :data:`_FALLBACKS` whose accumulators fit the registers
    (:data:`MAX_ACC_VALUES_PER_THREAD`) and whose tiles are no larger than the table's."""
    first = gpu_default(kernel, head_dim, element_size, seq_len, causal)
    owned = _OWNED[kernel]
    smaller = [b for b in _FALLBACKS[kernel]
               if b.block_m <= first.block_m and b.block_n <= first.block_n
               and acc_values_per_thread(getattr(b, owned), head_dim, b.num_warps) <= MAX_ACC_VALUES_PER_THREAD]
    return [first] + [b for b in smaller if b != first]


# The backward's preprocess kernel (backward.preprocess_kernel, Δ = rowsum(dO ∘ O)): one (block_m,
# HEAD_DIM) tile of O and of dO per program, no loop. First Triton's default launch options, 4 warps
# and 3 stages: what the H100 ran in every recorded benchmark. Then 8 warps, half the values per
# thread. Blackwell's ptxas spills the 4-warp kernel on sm_100: 8 B at fp16 d = 128 and fp32 d = 64
# with triton 3.7.1 (ptxas 13.1; the same PTX and cubin in 10 compiles from an empty cache), 8-32 B
# at fp16 d = 64 and bf16 d = 128 (and sm_120 bf16 d = 256) with triton 3.9.0; the 8-warp kernel
# spills nothing on sm_80-sm_120 at any dtype and padded head dim 16-256 with either (cross-compiled,
# 2026-11-27).
PREPROCESS_WARPS = (4, 8)
PREPROCESS_STAGES = 3  # Triton's default: the kernel has no loop to pipeline


def preprocess_candidates(block_m: int, head_dim: int) -> list[Blocks]:
    """The preprocess kernel's configs for :func:`course_lib.kernels.fit.choose`, in order: its
    ``(block_m, head_dim)`` tile (``block_n`` holds the padded head dim) on each of
    :data:`PREPROCESS_WARPS`."""
    return [Blocks(block_m, head_dim, warps, PREPROCESS_STAGES) for warps in PREPROCESS_WARPS]


# Decoding (kernels/decoding.py): the split kernel's tile is fixed by the query rows it owns and by
# the caller's block_n; what can give is the pipeline depth and, with the default block_n, the
# key tile.
DECODE_WARPS = 4
DECODE_STAGES = 3


def decode_candidates(block_m: int, block_n: int, shrink_block_n: bool) -> list[Blocks]:
    """The split kernel's configs in order: ``block_n`` with 3, 2, 1 stages; then, when
    ``shrink_block_n``, halved key tiles down to 16 rows."""
    tiles = [block_n]
    while shrink_block_n and tiles[-1] > 16:
        tiles.append(tiles[-1] // 2)
    return [Blocks(block_m, n, DECODE_WARPS, stages) for n in tiles for stages in (DECODE_STAGES, 2, 1)]


# The descriptor (TMA) forward of chapter 09 on Hopper: where it pays and with which config.
# Measured on an H100 (NOTES.md, "Chapter 09"): at HEAD_DIM=128 it is 4-15% faster than the
# pointer kernel (TMA frees the registers that made 128x128 tiles lose with pointer loads); at
# HEAD_DIM=64 it is within noise, so the pointer kernel stays.
TMA_HEAD_DIMS = (128,)
# Set COURSE_LIB_TMA=0 to keep the pointer kernel on Hopper too.
TMA_ENV = "COURSE_LIB_TMA"


def tma_enabled() -> bool:
    return os.environ.get(TMA_ENV, "1") != "0"


# The Gluon forward of chapter 09 (kernels/gluon_hopper.py, its ping-pong variant) on Hopper:
# measured on an H100 (NOTES.md, "Gluon forward"), 1.07-1.15x the TMA forward at head dim 128 in
# every cell of the grid. COURSE_LIB_GLUON=0 keeps the TMA forward (for comparisons).
GLUON_ENV = "COURSE_LIB_GLUON"
GLUON_HEAD_DIMS = (128,)
GLUON_VARIANT = "pingpong"


def gluon_enabled() -> bool:
    return os.environ.get(GLUON_ENV, "1") != "0"


# The Gluon one-pass backward (kernels/gluon_backward.py) on Hopper, for the non-deterministic
# backward at these head dims. COURSE_LIB_GLUON_BACKWARD=0 (or COURSE_LIB_GLUON=0) keeps the
# Triton backward of chapter 07.
GLUON_BACKWARD_ENV = "COURSE_LIB_GLUON_BACKWARD"
GLUON_BACKWARD_HEAD_DIMS = (64, 128)


def gluon_backward_enabled() -> bool:
    return gluon_enabled() and os.environ.get(GLUON_BACKWARD_ENV, "1") != "0"


def hopper_forward(seq_len: int, causal: bool) -> Blocks:
    """The TMA forward's config at HEAD_DIM=128, from the CUDA-graph sweep on an H100
    (``tools/sweep_forward.py``, NOTES.md "2026-11-24: forward sweep"): 128x64 tiles on 4 warps
    with 2 stages, 2-8% faster than 128x128 on 8 warps with 3 stages wherever it was tried first,
    except short causal sequences (64x64 on 4 warps: more programs, less time in the diagonal
    band) and long causal ones, where 128x128 on 8 warps with the longest tiles first
    (:data:`CAUSAL_ORDER`) ran 4-7% faster than 128x64 in the order it was timed in."""
    if causal and seq_len <= SHORT_CAUSAL_SEQ_LEN:
        return Blocks(64, 64, 4, 3)
    if causal and seq_len > 4 * SHORT_CAUSAL_SEQ_LEN:
        return Blocks(128, 128, 8, 3)
    return Blocks(128, 64, 4, 2)


# GPU candidates: (BLOCK_M, BLOCK_N, num_warps, num_stages).
_FORWARD_CANDIDATES = [
    (128, 64, 4, 3),
    (128, 64, 8, 3),
    (128, 128, 8, 3),
    (64, 64, 4, 3),
]
# Backward kernels: dK/dV programs own BLOCK_N keys and loop over BLOCK_M queries; dQ programs own
# BLOCK_M queries and loop over BLOCK_N keys. The tile the program owns is the big one.
_DKDV_CANDIDATES = [
    (32, 128, 4, 3),
    (64, 128, 8, 3),
    (32, 64, 4, 3),
]
_DQ_CANDIDATES = [
    (128, 32, 4, 3),
    (128, 64, 8, 3),
    (64, 32, 4, 3),
]


def _configs(candidates) -> list[triton.Config]:
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s)
            for m, n, w, s in candidates]


def forward_configs() -> list[triton.Config]:
    return _configs(_FORWARD_CANDIDATES)


def dkdv_configs() -> list[triton.Config]:
    return _configs(_DKDV_CANDIDATES)


def dq_configs() -> list[triton.Config]:
    return _configs(_DQ_CANDIDATES)


# A program's fp32 accumulator must fit in its threads' registers with room to spare. Measured on
# an H100 (NOTES.md, block-size sweep): at d=128 a 128-row tile on 4 warps (128 accumulator values
# per thread) spills and runs at half speed or worse, and the autotuner sometimes kept it anyway
# (timing noise on short sequences: 0.84x FlashAttention-2 at fp16 d=128 N=1k causal). Every
# config at or under 64 values per thread ran without spilling.
MAX_ACC_VALUES_PER_THREAD = 64
THREADS_PER_WARP = 32


def acc_values_per_thread(owned_rows: int, head_dim: int, num_warps: int) -> float:
    """fp32 accumulator values each thread holds: the (owned_rows, head_dim) tile over the threads.

    ``owned_rows`` is the tile a program keeps for its whole life: BLOCK_M for the forward and dQ
    kernels, BLOCK_N for dK/dV (whose two accumulators, dK and dV, are each that size).
    """
    return owned_rows * head_dim / (num_warps * THREADS_PER_WARP)


def _prune(configs, named_args, kwargs, owned: str):
    """Drop configs that spill registers or overflow shared memory for this call's head dim/dtype.

    - registers: see :data:`MAX_ACC_VALUES_PER_THREAD`;
    - shared memory: Q, K and V tiles in flight (num_stages copies of K and V): at HEAD_DIM=256,
      or in fp32, a 128x128 tile pair overflows the 228 KB of shared memory per H100 SM, so keep
      tiles <= 64 there.
    Two configs sized for small tiles are added there (and whenever nothing else is left): a
    64-row owned tile on 8 warps (64 accumulator values per thread even at d=256) and 32x32 tiles
    on 4 warps, which always fit.
    """
    head_dim = kwargs.get("HEAD_DIM", named_args.get("HEAD_DIM"))  # constexprs arrive as kwargs
    small = _small_tiles(head_dim, named_args["Q"].element_size())
    kept = [c for c in configs
            if acc_values_per_thread(c.kwargs[owned], head_dim, c.num_warps) <= MAX_ACC_VALUES_PER_THREAD
            and not (small and (c.kwargs["BLOCK_M"] > 64 or c.kwargs["BLOCK_N"] > 64))]
    if small or not kept:
        other = "BLOCK_N" if owned == "BLOCK_M" else "BLOCK_M"
        kept.append(triton.Config({owned: 64, other: 32}, num_warps=8, num_stages=2))
        kept.append(triton.Config({"BLOCK_M": 32, "BLOCK_N": 32}, num_warps=4, num_stages=1))
    return kept


def prune_forward(configs, named_args, **kwargs):
    """``early_config_prune`` for the forward kernel (a program owns BLOCK_M query rows)."""
    return _prune(configs, named_args, kwargs, "BLOCK_M")


def prune_dq(configs, named_args, **kwargs):
    """``early_config_prune`` for the dQ kernel (a program owns BLOCK_M query rows)."""
    return _prune(configs, named_args, kwargs, "BLOCK_M")


def prune_dkdv(configs, named_args, **kwargs):
    """``early_config_prune`` for the dK/dV kernel (a program owns BLOCK_N key rows)."""
    return _prune(configs, named_args, kwargs, "BLOCK_N")

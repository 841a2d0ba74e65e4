"""Block sizes, warps and pipeline stages for the attention kernels.

Two regimes, as chapter 06 explains:

- **Interpreter (CPU).** ``triton.autotune`` with more than one config fails there ("0 active
  drivers", FACTS.md), and the interpreter runs every program in Python, so bigger tiles mean
  fewer programs and a faster run. The launchers call the plain ``@triton.jit`` kernels with the
  one fixed config below (tests pass smaller tiles explicitly to exercise many tiles).
- **GPU.** The launchers call the autotuned kernels: the autotuner times every config in the
  short lists below once per key (sequence lengths, head dim, causal, dtypes) and keeps the
  fastest. The lists are short on purpose: each config is a compile (about a second) and a
  timing, per key. They come from the tuning runs recorded in
  ``course_lib/data/benchmarks/NOTES.md``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import triton

# Set COURSE_LIB_AUTOTUNE=0 to skip autotuning on the GPU and launch the fixed defaults below
# (the GPU test suite does this: autotuning every shape it tries would take minutes).
AUTOTUNE_ENV = "COURSE_LIB_AUTOTUNE"


@dataclass(frozen=True)
class Blocks:
    """One launch config: tile sizes, warps per program, software-pipelining depth."""

    block_m: int  # query rows per tile (the paper's B_r)
    block_n: int  # key/value rows per tile (the paper's B_c)
    num_warps: int = 4
    num_stages: int = 1


# Interpreter: fewest programs for notebook sizes (N <= 512), still several tiles per row.
INTERPRETER_FORWARD = Blocks(block_m=64, block_n=64)
INTERPRETER_BACKWARD = Blocks(block_m=64, block_n=64)



def autotune_enabled() -> bool:
    return os.environ.get(AUTOTUNE_ENV, "1") != "0"


def _small_tiles(head_dim: int, element_size: int) -> bool:
    """fp32 tiles, or a head dim above 128, need smaller tiles to fit in shared memory."""
    return element_size >= 4 or head_dim > 128


def gpu_default(kernel: str, head_dim: int, element_size: int) -> Blocks:
    """The fixed GPU config used when autotuning is off ("forward", "dkdv" or "dq")."""
    # Measured on an H100 (NOTES.md): at d=128, 4 warps spill the (128, 128) fp32 accumulator and
    # run at half speed; 8 warps do not.
    small = _small_tiles(head_dim, element_size)
    wide = head_dim > 64
    if kernel == "forward":
        return Blocks(64, 32, 4, 2) if small else Blocks(128, 64, 8 if wide else 4, 3)
    if kernel == "dkdv":
        return Blocks(32, 64, 4, 2) if small else (Blocks(64, 128, 8, 3) if wide else Blocks(32, 128, 4, 3))
    if kernel == "dq":
        return Blocks(64, 32, 4, 2) if small else (Blocks(128, 64, 8, 3) if wide else Blocks(128, 32, 4, 3))
    raise ValueError(f"kernel must be 'forward', 'dkdv' or 'dq', got {kernel!r}")


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


def prune_for_head_dim(configs, named_args, **kwargs):
    """Drop configs whose tiles cannot fit in shared memory / registers.

    Q, K and V tiles in flight (num_stages copies of K and V): at HEAD_DIM=256, or in fp32, a
    128x128 tile pair overflows the 228 KB of shared memory per H100 SM, so keep tiles <= 64 there.
    """
    head_dim = kwargs.get("HEAD_DIM", named_args.get("HEAD_DIM"))  # constexprs arrive as kwargs
    if not _small_tiles(head_dim, named_args["Q"].element_size()):
        return configs
    kept = [c for c in configs if c.kwargs["BLOCK_M"] <= 64 and c.kwargs["BLOCK_N"] <= 64]
    # a config that always fits, in case every candidate above runs out of shared memory
    kept.append(triton.Config({"BLOCK_M": 32, "BLOCK_N": 32}, num_warps=4, num_stages=1))
    return kept

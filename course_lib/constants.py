"""Numbers the whole course shares, each named once with where it comes from.

Kernels, NumPy code, checks and notebooks import these instead of retyping them. Numbers that
belong to one concept stay with the module that owns it (tolerances by dtype in
:data:`course_lib.teaching.checks.TOLERANCES`, hardware figures in :mod:`course_lib.platform.hardware`, block sizes
in :mod:`course_lib.kernels.tuning`).
"""

from __future__ import annotations

import math

# exp(x) = exp2(x · LOG2_E) and log(x) = log2(x) · LN_2. GPUs have a fast exp2 instruction, so
# the kernels fold LOG2_E into the score scale and work in log2 units (chapter 06).
LOG2_E = math.log2(math.e)  # 1.4426950408889634
LN_2 = math.log(2.0)  # 0.6931471805599453

# The score of a masked (query, key) pair. -inf, so that exp/exp2 turn it into an exact 0 (a
# finite stand-in like -1e9 leaks weight once scores are large). No row is ever fully masked:
# with the top-left causal alignment every query sees key 0, so the running max stays finite.
MASK_VALUE = float("-inf")

# Head dims the Triton kernels take: tl.dot needs tiles at least 16 wide, and a (BLOCK_M, 256)
# fp32 accumulator already fills a program's registers.
MIN_HEAD_DIM = 16
MAX_HEAD_DIM = 256

# How closely two float64 computations of the same exact quantity agree (about 1e4 ulps of 1.0):
# used where a notebook or test shows that a rewrite of an algorithm gives the same numbers.
FP64_ATOL = 1e-12

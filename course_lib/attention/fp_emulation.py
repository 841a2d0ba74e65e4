"""exp2 without the special-function unit: FlashAttention-4's software exponential, in NumPy float32.

An H100 SM computes 16 ``ex2`` a clock on its special-function unit (MUFU) but 128 fp32 FMAs. At
head dim 64 one score costs about as many MUFU cycles (1/16) as tensor-core cycles (4·d FLOPs at
~4096 FLOPs a clock), so FlashAttention-4 moves part of its exponentials onto the FMA units
(chapter 09). The recipe is Cody–Waite range reduction:

    2^x = 2^n · 2^f,   n = floor(x),   f = x - n in [0, 1)

``2^f`` is a short polynomial (Horner: three FMAs for degree 3), and multiplying by ``2^n`` is an
*integer* add of ``n`` to the float's exponent field (``bits(2^f) + (n << 23)``). ``floor`` itself
costs no conversion instruction: adding :data:`EXP2_FLOOR_MAGIC` = 1.5·2^23 rounded toward -inf
leaves ``floor(x)`` in the low mantissa bits, and shifting those bits left by 23 drops the magic
number's own bits (they leave the 32-bit word) and keeps ``n << 23``.

:func:`exp2_emulated` runs exactly these steps in float32. The Gluon forward
(:mod:`course_lib.kernels.gluon_hopper`, ``EXP2_EMULATED``) runs them in PTX with the same
constants, imported from here: :data:`EXP2_POLYS`, :data:`EXP2_CLAMP`, :data:`EXP2_FLOOR_MAGIC`.
:func:`fit_exp2_polynomial` is how the coefficients were found (a Remez exchange for the smallest
maximum *relative* error on [0, 1] with ``c0 = 1``); :func:`ulps_from_correctly_rounded` measures the
result after the kernel's rounding of P to fp16 or bf16.
"""

from __future__ import annotations

from numbers import Integral

import numpy as np

# Inputs at or below this come out as exactly +0.0: at x = -127, f = 0 and 2^f = c0 = 1.0 (bits
# 127 << 23), and adding n << 23 = -127 << 23 leaves 0. -inf (a masked score) and NaN are clamped
# here too (max picks the number). Between -127 and -126 the result is a subnormal below 2^-126
# (inexact, far below what fp16/bf16 P or the fp32 row sum can notice).
EXP2_CLAMP = -127.0
# floor(x) = (x + 1.5·2^23 rounded toward -inf) - 1.5·2^23, exact for |x| < 2^22: in [2^23, 2^24)
# the float spacing is 1, and the 1.5 keeps negative x in that binade.
EXP2_FLOOR_MAGIC = 1.5 * 2**23
EXP2_EXPONENT_SHIFT = 23  # the fp32 exponent field starts at bit 23
# The largest input taken: 2^x stays a finite float32 below 128 (the kernel feeds x <= its rescale
# threshold, at most 8; see gluon_hopper.MAX_RESCALE_TAU).
EXP2_MAX_INPUT = 127.0

# 2^f ≈ c0 + c1 f + ... + c_deg f^deg on [0, 1), lowest degree first, by degree: fit_exp2_polynomial
# rounded to float32 (tests/test_fp_emulation.py refits them). c0 = 1 exactly: 2^0 = 1 exactly (the
# row's max score gives p = 1, and the clamp gives exact zeros). Degree 3 is FlashAttention-4's
# choice (three FMAs; enough for P rounded to bf16's 8 or fp16's 11 bits); degree 5 (two FMAs more)
# is as accurate as the hardware's ex2.approx.f32 (2^-22), for the fp32 row sum behind lse.
EXP2_POLYS = {
    3: (1.0, 0.6951167583465576, 0.22764499485492706, 0.07706703990697861),
    5: (1.0, 0.6931512951850891, 0.24016444385051727, 0.05579991266131401, 0.009017030708491802,
        0.0018671300495043397),
}
EXP2_POLY_DEGREE = 3  # the kernel's default
EXP2_POLY = EXP2_POLYS[EXP2_POLY_DEGREE]
# Each polynomial's maximum relative error on [0, 1] in exact arithmetic (the fit's, 2026-11-27);
# float32 Horner adds a few float32 roundings (each at most 2^-24 relative).
EXP2_POLY_MAX_REL_ERRORS = {3: 8.56e-5, 5: 8.23e-8}

# Remez settings: the error is sampled on this many points of (0, 1]; exchanges until the
# levelled error stops changing (5-6 exchanges for degrees 3-5). Above degree 7 the best error
# (~1e-12 at degree 8) drowns in float64 rounding and the exchange finds no alternation.
MAX_FIT_DEGREE = 7
FIT_GRID_POINTS = 100_001
FIT_MAX_ITERATIONS = 50
FIT_REL_TOL = 1e-9

# (significand bits including the implicit one, exponent of the smallest normal number)
FLOAT_FORMATS = {"float32": (24, -126), "bfloat16": (8, -126), "float16": (11, -14)}


def fit_exp2_polynomial(degree: int = EXP2_POLY_DEGREE, grid_points: int = FIT_GRID_POINTS) -> tuple[tuple, float]:
    """The polynomial ``1 + c1 f + ... + c_deg f^deg`` with the smallest maximum relative error
    against ``2^f`` on [0, 1] (Remez exchange, float64).

    The relative error ``e(f) = p(f)/2^f - 1 = Σ c_k f^k 2^-f - (1 - 2^-f)`` is linear in the
    coefficients; it is 0 at f = 0 (c0 = 1), so the ``degree + 1`` points where the best ``e``
    alternates in sign with equal size lie in (0, 1].

    Args:
        degree: polynomial degree, 1 to :data:`MAX_FIT_DEGREE`.
        grid_points: points of (0, 1] the error is sampled on.

    Returns:
        ``((1.0, c1, ..., c_deg), max_rel_error)``, float64.
    """
    if isinstance(degree, bool) or not isinstance(degree, Integral) or not 1 <= degree <= MAX_FIT_DEGREE:
        raise ValueError(f"degree must be an integer from 1 to {MAX_FIT_DEGREE}, got {degree!r}")
    if isinstance(grid_points, bool) or not isinstance(grid_points, Integral) or grid_points < 100 * (degree + 1):
        raise ValueError(f"grid_points must be an integer of at least {100 * (degree + 1)}, got {grid_points!r}")
    f = np.linspace(0.0, 1.0, grid_points)[1:]  # (G,)
    basis = np.stack([f**k * np.exp2(-f) for k in range(1, degree + 1)], axis=1)  # (G, degree)
    target = 1.0 - np.exp2(-f)  # (G,)
    n_ref = degree + 1
    ref = np.round(np.linspace(0.05, 1.0, n_ref) * (len(f) - 1)).astype(int)  # first guess of the points
    levelled = np.nan
    for _ in range(FIT_MAX_ITERATIONS):
        # c and E with e(f_i) = (-1)^i E at the reference points
        system = np.column_stack([basis[ref], (-1.0) ** np.arange(n_ref)])
        *coeffs, levelled_new = np.linalg.solve(system, target[ref])
        err = basis @ np.array(coeffs) - target
        ref = _alternating_extrema(err, n_ref)
        if abs(abs(levelled_new) - abs(levelled)) <= FIT_REL_TOL * abs(levelled_new):
            break
        levelled = levelled_new
    return (1.0, *map(float, coeffs)), float(np.abs(err).max())


def _alternating_extrema(err: np.ndarray, count: int) -> np.ndarray:
    """Indices of ``count`` extrema of ``err`` that alternate in sign, largest kept (Remez exchange)."""
    sign = np.where(err >= 0, 1, -1)
    runs = np.split(np.arange(len(err)), np.flatnonzero(np.diff(sign)) + 1)  # same-sign stretches
    peaks = [run[np.argmax(np.abs(err[run]))] for run in runs]
    while len(peaks) > count:  # drop the smaller of the two ends: the rest still alternate
        peaks = peaks[1:] if abs(err[peaks[0]]) < abs(err[peaks[-1]]) else peaks[:-1]
    if len(peaks) < count:
        raise RuntimeError(f"the error alternates in sign over {len(peaks)} stretches, a degree-{count - 1} "
                           f"fit needs {count}")
    return np.array(peaks)


def _fma32(a: np.ndarray, b: np.ndarray, c: float) -> np.ndarray:
    """``a·b + c`` rounded to float32, as the GPU's ``fma.rn.f32``: the product of two float32 is exact
    in float64; the sum is rounded to float64 and then to float32 (that double rounding can differ
    from the GPU's single rounding in the last bit, rarely; the tests allow for it)."""
    return (a.astype(np.float64) * b.astype(np.float64) + np.float64(np.float32(c))).astype(np.float32)


def exp2_emulated(x, degree: int = EXP2_POLY_DEGREE) -> np.ndarray:
    """``2^x`` in float32 by range reduction and a polynomial, step for step as the kernel's PTX.

    Args:
        x: array-like of scores in log2 units, at most :data:`EXP2_MAX_INPUT` (any shape; -inf
            and values at or below :data:`EXP2_CLAMP` give exactly 0).
        degree: which polynomial of :data:`EXP2_POLYS`.

    Returns:
        float32 array of ``x``'s shape.
    """
    if degree not in EXP2_POLYS:
        raise ValueError(f"degree must be one of {sorted(EXP2_POLYS)}, got {degree!r}")
    poly = EXP2_POLYS[degree]
    x = np.asarray(x, dtype=np.float32)
    if np.any(x > EXP2_MAX_INPUT):
        raise ValueError(f"x must be at most {EXP2_MAX_INPUT} (2^x leaves float32's range at 128), "
                         f"got max {float(np.nanmax(x))}")
    x = np.fmax(x, np.float32(EXP2_CLAMP))  # max.f32: the number wins over NaN; -inf becomes the clamp
    n = np.floor(x)  # the kernel: (x + EXP2_FLOOR_MAGIC rounded toward -inf) - EXP2_FLOOR_MAGIC, as exact
    frac = x - n  # exact: the fraction of a float32 is a float32, in [0, 1)
    p = np.full(x.shape, poly[-1], dtype=np.float32)
    for c in reversed(poly[:-1]):  # Horner: one FMA per coefficient
        p = _fma32(p, frac, c)
    bits = p.view(np.int32) + (n.astype(np.int32) << EXP2_EXPONENT_SHIFT)  # times 2^n: add n to the exponent
    return bits.view(np.float32)


def round_to_format(x, fmt: str) -> np.ndarray:
    """``x`` rounded to the nearest value of a binary float format (ties to even), as float64.

    Args:
        x: array-like of finite non-negative numbers (float64 keeps them exactly).
        fmt: a key of :data:`FLOAT_FORMATS` ("float16", "bfloat16", "float32"); no overflow handling.

    Returns:
        float64 array of ``x``'s shape holding values of ``fmt`` (subnormals included).
    """
    step = ulp(x, fmt)
    return np.round(np.asarray(x, dtype=np.float64) / step) * step  # np.round: ties to even


def ulp(x, fmt: str) -> np.ndarray:
    """The spacing of ``fmt``'s values around each ``x`` (the subnormal spacing below the normals).

    Args:
        x: array-like of finite non-negative numbers. fmt: a key of :data:`FLOAT_FORMATS`.

    Returns:
        float64 array of ``x``'s shape.
    """
    if fmt not in FLOAT_FORMATS:
        raise ValueError(f"fmt must be one of {sorted(FLOAT_FORMATS)}, got {fmt!r}")
    bits, min_exp = FLOAT_FORMATS[fmt]
    x = np.asarray(x, dtype=np.float64)
    if np.any(~np.isfinite(x)) or np.any(x < 0):
        raise ValueError("x must be finite and non-negative")
    _, exp = np.frexp(x)  # x = m·2^exp, m in [0.5, 1): the binade [2^(exp-1), 2^exp); 0 gives exp = 0
    binade = np.where(x > 0, exp - 1, min_exp)
    return np.ldexp(1.0, np.maximum(binade, min_exp) - (bits - 1))


def ulps_from_correctly_rounded(approx, exact, fmt: str) -> np.ndarray:
    """How many ``fmt`` ulps ``approx`` rounded to ``fmt`` lies from ``exact`` rounded to ``fmt``.

    The kernel rounds its float32 P to fp16/bf16 before the P·V product; a result within 1 ulp of
    the correctly rounded value is as good as the exact exponential gives after one more rounding.

    Args:
        approx, exact: array-likes of one shape, finite and non-negative (``exact`` in float64).
        fmt: a key of :data:`FLOAT_FORMATS`.

    Returns:
        float64 array: ``|round(approx) - round(exact)| / ulp(round(exact))``.
    """
    rounded_exact = round_to_format(exact, fmt)
    return np.abs(round_to_format(np.asarray(approx, dtype=np.float64), fmt) - rounded_exact) / ulp(rounded_exact, fmt)


__all__ = ["EXP2_CLAMP", "EXP2_FLOOR_MAGIC", "EXP2_EXPONENT_SHIFT", "EXP2_MAX_INPUT", "EXP2_POLYS",
           "EXP2_POLY_DEGREE", "EXP2_POLY", "EXP2_POLY_MAX_REL_ERRORS", "MAX_FIT_DEGREE", "FLOAT_FORMATS",
           "fit_exp2_polynomial", "exp2_emulated", "round_to_format", "ulp", "ulps_from_correctly_rounded"]

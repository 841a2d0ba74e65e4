"""Tests of course_lib.attention.fp_emulation: FlashAttention-4's software exp2, emulated in NumPy float32 (chapter 09).

The Gluon forward runs the same steps in PTX with the same constants (``EXP2_EMULATED``;
tests/test_gluon_hopper.py reads them from the compiled kernel); these tests check the numbers.
"""

from __future__ import annotations

import numpy as np
import pytest

from course_lib.attention import fp_emulation as fe

pytestmark = pytest.mark.ch09

# x in [-126, 0]: the exponent of every p = exp2(s - m) of a row (s <= m) whose result is a normal
# float32; up to 8 (the kernel's largest rescale threshold) when the max is allowed to lag.
X_LOW, X_HIGH, X_LAGGING_MAX = -126.0, 0.0, 8.0
SAMPLES = 1_000_001
F32_ROUNDING = 2.0**-24  # one float32 rounding, relative
HORNER_ROUNDINGS = 4  # the FMAs of degree 3 and the exponent add's exactness: a few roundings at most
SEED = 0


def _inputs(low: float, high: float) -> np.ndarray:
    """Float32 points of [low, high]: evenly spaced, random ones, and the integers with their
    float32 neighbours (where f jumps from ~1 back to 0)."""
    rng = np.random.default_rng(SEED)
    integers = np.arange(np.ceil(low), np.floor(high) + 1, dtype=np.float32)
    points = [np.linspace(low, high, SAMPLES, dtype=np.float32), rng.uniform(low, high, SAMPLES).astype(np.float32),
              integers, np.nextafter(integers, np.float32(-np.inf)), np.nextafter(integers, np.float32(np.inf))]
    x = np.concatenate(points)
    return x[(x >= low) & (x <= high)]


@pytest.mark.parametrize("degree", sorted(fe.EXP2_POLYS))
def test_stored_coefficients_are_the_fit(degree):
    """The constants the kernel uses are the Remez fit, rounded to float32, c0 = 1 exactly."""
    fitted, max_rel = fe.fit_exp2_polynomial(degree)
    stored = fe.EXP2_POLYS[degree]
    assert stored[0] == 1.0 and fitted[0] == 1.0
    assert len(stored) == degree + 1
    for c_stored, c_fit in zip(stored, fitted):
        assert np.float32(c_stored) == c_stored  # a float32 value: the PTX immediate is exactly it
        assert abs(c_stored - c_fit) <= 2 * np.spacing(np.float32(c_fit)), (stored, fitted)
    assert max_rel == pytest.approx(fe.EXP2_POLY_MAX_REL_ERRORS[degree], rel=1e-2)


def test_the_fit_equioscillates():
    """Minimax: the error reaches its maximum size degree + 1 times, alternating in sign (checked
    on the fitted polynomial in float64)."""
    coeffs, max_rel = fe.fit_exp2_polynomial(3)
    f = np.linspace(0.0, 1.0, 200_001)[1:]
    err = np.polyval(coeffs[::-1], f) / np.exp2(f) - 1.0
    near_max = np.abs(err) > 0.999 * max_rel
    signs = np.sign(err[near_max])
    assert np.count_nonzero(np.diff(signs)) >= 3, signs  # 4 alternating extrema


@pytest.mark.parametrize("degree", sorted(fe.EXP2_POLYS))
def test_emulated_exp2_relative_error(degree):
    x = _inputs(X_LOW, X_LAGGING_MAX)
    exact = np.exp2(x.astype(np.float64))
    rel = np.abs(fe.exp2_emulated(x, degree).astype(np.float64) / exact - 1.0)
    bound = fe.EXP2_POLY_MAX_REL_ERRORS[degree] + HORNER_ROUNDINGS * F32_ROUNDING
    assert rel.max() <= bound, (rel.max(), x[rel.argmax()])
    in_range = (x >= X_LOW) & (x <= X_HIGH)
    assert rel[in_range].max() <= bound


@pytest.mark.parametrize("fmt", ["float16", "bfloat16"])
def test_rounded_to_half_precision_within_one_ulp(fmt):
    """P is rounded to the input dtype before P·V: the emulated value, rounded, is the correctly
    rounded exp2 or its neighbour, over the whole range (fp16 subnormals included)."""
    x = _inputs(X_LOW, X_LAGGING_MAX)
    exact = np.exp2(x.astype(np.float64))
    ulps = fe.ulps_from_correctly_rounded(fe.exp2_emulated(x), exact, fmt)
    assert ulps.max() <= 1.0, (ulps.max(), x[ulps.argmax()])
    assert np.mean(ulps == 0) > 0.9  # mostly the correctly rounded value itself


def test_exact_where_the_kernel_needs_it():
    """2^0 = 1 (a row's max score), powers of two exactly, and a clean 0 for masked scores (-inf),
    NaN and everything at or below the clamp."""
    ints = np.arange(-126, 9, dtype=np.float32)
    assert np.array_equal(fe.exp2_emulated(ints), np.exp2(ints))
    zeros = fe.exp2_emulated(np.array([-np.inf, np.nan, fe.EXP2_CLAMP, -127.5, -1e30, -3e38], dtype=np.float32))
    assert np.array_equal(zeros, np.zeros(6, np.float32)) and not np.signbit(zeros).any()
    below_normal = fe.exp2_emulated(np.float32(-126.5))
    assert 0 < below_normal < np.finfo(np.float32).tiny  # between the clamp and -126: a subnormal, not garbage


def test_same_steps_as_the_kernel():
    """The float trick the kernel uses for floor (add 1.5·2^23 rounding down, shift the bits left by
    23) gives floor(x) << 23, checked here with integer arithmetic on the magic sum's bits."""
    x = _inputs(fe.EXP2_CLAMP, X_LAGGING_MAX)
    floor = np.floor(x).astype(np.int64)
    magic_sum = np.float32(fe.EXP2_FLOOR_MAGIC) + floor.astype(np.float32)  # exact: spacing 1 in [2^23, 2^24)
    assert np.array_equal(magic_sum.astype(np.int64) - int(fe.EXP2_FLOOR_MAGIC), floor)
    shifted = (magic_sum.view(np.uint32).astype(np.uint64) << fe.EXP2_EXPONENT_SHIFT) & 0xFFFFFFFF
    assert np.array_equal(shifted.astype(np.uint32).view(np.int32), (floor << fe.EXP2_EXPONENT_SHIFT).astype(np.int32))


def test_round_to_format_matches_numpy_float16():
    rng = np.random.default_rng(SEED)
    x = np.concatenate([rng.uniform(0, 2.0, 10_000), np.exp2(rng.uniform(-30, 15, 10_000))])
    assert np.array_equal(fe.round_to_format(x, "float16"), x.astype(np.float16).astype(np.float64))
    assert np.array_equal(fe.round_to_format(x, "float32"), x.astype(np.float32).astype(np.float64))


def test_ulp_of_zero_is_the_smallest_subnormal():
    assert fe.ulp([0.0], "float16")[0] == 2.0**-24 and fe.ulp([0.0], "bfloat16")[0] == 2.0**-133
    assert fe.ulps_from_correctly_rounded([2.0**-25], [0.0], "float16")[0] == 0  # rounds to 0 (tie to even)
    assert fe.ulps_from_correctly_rounded([2.0**-24], [0.0], "float16")[0] == 1


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="x must be at most"):
        fe.exp2_emulated([200.0])
    with pytest.raises(ValueError, match="degree must be one of"):
        fe.exp2_emulated([0.0], degree=4)
    with pytest.raises(ValueError, match="degree must be an integer from 1 to"):
        fe.fit_exp2_polynomial(0)
    with pytest.raises(ValueError, match="degree must be an integer from 1 to"):
        fe.fit_exp2_polynomial(fe.MAX_FIT_DEGREE + 1)
    with pytest.raises(ValueError, match="grid_points must be an integer"):
        fe.fit_exp2_polynomial(3, grid_points=10)
    with pytest.raises(ValueError, match="fmt must be one of"):
        fe.ulp([1.0], "float8")
    with pytest.raises(ValueError, match="finite and non-negative"):
        fe.round_to_format([-1.0], "float16")

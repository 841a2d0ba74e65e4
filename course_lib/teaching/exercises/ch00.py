"""Checks for chapter 00's warm-up exercise.

Exercise 0.1 — ``scaled_scores(q, k)``: ``q kᵀ / √d`` for ``q (N_q, d)`` and ``k (N_k, d)``.

The cases keep ``N_q``, ``N_k`` and ``d`` distinct (a scale taken from the wrong dimension shows),
use head dims that are not perfect squares (a square root rounded to an integer shows), scores from
small to thousands of both signs, and inputs that are views (a transposed ``q``, a strided ``k``).
Every mistake model is the mistaken formula itself, so it reproduces that answer on every case.
"""

from __future__ import annotations

import math

import numpy as np

from course_lib.teaching.checks import learner_check
from course_lib.teaching.checks import Case, check_function
from course_lib.attention.reference import default_scale


def scaled_scores(q: np.ndarray, k: np.ndarray) -> np.ndarray:
    """Reference for Exercise 0.1: ``q kᵀ / sqrt(d)``; q ``(N_q, d)``, k ``(N_k, d)`` → ``(N_q, N_k)``."""
    return (q @ k.T) * default_scale(q.shape[-1])


def _cases(seed: int = 0):
    """(N_q, N_k, d, size of the entries, layout) per case; non-integer float64 entries."""
    rng = np.random.default_rng(seed)
    shapes = [(3, 5, 4, 1.0, "plain"), (17, 29, 24, 1.0, "plain"), (6, 2, 7, 1.0, "views"),
              (1, 1, 8, 1.0, "plain"), (9, 11, 80, 12.0, "views")]
    cases = []
    for n_q, n_k, d, size, layout in shapes:
        if layout == "views":  # q a transposed (d, N_q) array, k every other row of a (2·N_k, d)
            q = size * rng.standard_normal((d, n_q)).T
            k = size * rng.standard_normal((2 * n_k, d))[::2]
        else:
            q, k = size * rng.standard_normal((n_q, d)), size * rng.standard_normal((n_k, d))
        label = f"N_q={n_q}, N_k={n_k}, d={d}"
        if size > 1:
            label += f", scores up to ±{np.abs(scaled_scores(q, k)).max():.0f}"
        if layout == "views":
            label += ", q and k are strided views"
        cases.append(Case((q, k), label=label))
    return cases


MISTAKES = {
    "divided by d instead of sqrt(d)": lambda q, k: (q @ k.T) / q.shape[-1],
    "forgot the 1/sqrt(d) scale": lambda q, k: q @ k.T,
    "multiplied by sqrt(d) instead of dividing": lambda q, k: (q @ k.T) * np.sqrt(q.shape[-1]),
    "computed kᵀq-style (N_k, N_q) scores: transpose the other operand":
        lambda q, k: (k @ q.T) * default_scale(q.shape[-1]),
    "`(d ** 1/2)` is `(d ** 1) / 2 = d/2` (a power binds tighter than /): write `d ** 0.5` or "
    "`np.sqrt(d)`": lambda q, k: (q @ k.T) / (q.shape[-1] / 2),
    "`s / d ** 1/2` is `(s / d) / 2` (a power binds tighter than /, and the divisions go left to "
    "right): write `s / d ** 0.5` or `s / np.sqrt(d)`": lambda q, k: (q @ k.T) / q.shape[-1] / 2,
    "the square root was rounded to a whole number (int(...) or math.isqrt): 1/sqrt(d) is not a "
    "whole number's inverse for most d": lambda q, k: (q @ k.T) / math.isqrt(q.shape[-1]),
    "the scale used q.shape[0], the number of queries N_q; d is q.shape[-1]":
        lambda q, k: (q @ k.T) / np.sqrt(q.shape[0]),
    "the scale used k.shape[0], the number of keys N_k; d is q.shape[-1]":
        lambda q, k: (q @ k.T) / np.sqrt(k.shape[0]),
}


@learner_check
def check_scaled_scores(fn):
    """Exercise 0.1: check the learner's ``scaled_scores(q, k)``; returns the function to use."""
    return check_function("Exercise 0.1", fn, scaled_scores, _cases(), mistakes=MISTAKES)

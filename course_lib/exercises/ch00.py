"""Checks for chapter 00's warm-up exercise."""

from __future__ import annotations

import numpy as np

from course_lib.checks import learner_check
from course_lib.checks import Case, check_function
from course_lib.reference import default_scale


def scaled_scores(q: np.ndarray, k: np.ndarray) -> np.ndarray:
    """Reference for Exercise 0.1: ``q kᵀ / sqrt(d)``; q ``(N_q, d)``, k ``(N_k, d)`` → ``(N_q, N_k)``."""
    return (q @ k.T) * default_scale(q.shape[-1])


def _cases(seed: int = 0):
    rng = np.random.default_rng(seed)
    shapes = [(3, 5, 4), (17, 29, 64), (1, 1, 8)]
    return [Case((rng.standard_normal((n_q, d)), rng.standard_normal((n_k, d))),
                 label=f"N_q={n_q}, N_k={n_k}, d={d}") for n_q, n_k, d in shapes]


MISTAKES = {
    "divided by d instead of sqrt(d)": lambda q, k: (q @ k.T) / q.shape[-1],
    "forgot the 1/sqrt(d) scale": lambda q, k: q @ k.T,
    "multiplied by sqrt(d) instead of dividing": lambda q, k: (q @ k.T) * np.sqrt(q.shape[-1]),
    "computed kᵀq-style (N_k, N_q) scores: transpose the other operand": lambda q, k: (k @ q.T) * default_scale(q.shape[-1]),
}


@learner_check
def check_scaled_scores(fn):
    """Exercise 0.1: check the learner's ``scaled_scores(q, k)``; returns the function to use."""
    return check_function("Exercise 0.1", fn, scaled_scores, _cases(), mistakes=MISTAKES)

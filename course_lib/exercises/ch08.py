"""Checks for chapter 08 (beyond): exercise 8.1, the KV-cache size; 8.2, combining the partial
results of split-KV decoding; 8.3, the GQA head mapping (numbered in the notebook's order).

Each check runs the learner's function on prepared cases and compares with
:mod:`course_lib.kvcache`, :mod:`course_lib.decoding` and :mod:`course_lib.gqa`. When the answer
is wrong, the known mistakes below are replayed on the failing case; the one that reproduces the
learner's output is named. The mistake models are public (``COMBINE_MISTAKES``,
``CACHE_MISTAKES``, ``HEAD_MISTAKES``) so that tests and instructors can see what is recognised.
"""

from __future__ import annotations

import numpy as np

from course_lib import decoding, gqa, kvcache
from course_lib.checks import Case, check_function

# ----------------------------------------------------------------------------------------------
# Exercise 8.2: combine_splits(m, l, o) -> o, the output of split-KV decoding
# ----------------------------------------------------------------------------------------------

def _weighted(weights, o, denominator):
    """``Σ_s w_s o_s / denominator`` with ``w (S, ...)`` and ``o (S, ..., d)``."""
    return (weights[..., None] * o).sum(axis=0) / denominator[..., None]


def _combine_no_max_correction(m, l, o):
    return _weighted(l, o, l.sum(axis=0))


def _combine_outputs_rescaled_not_sum(m, l, o):
    c = np.exp(m - m.max(axis=0))
    return _weighted(l * c, o, l.sum(axis=0))


def _combine_average(m, l, o):
    return o.mean(axis=0)


def _combine_without_l(m, l, o):
    c = np.exp(m - m.max(axis=0))
    return _weighted(c, o, c.sum(axis=0))


def _combine_wrong_sign(m, l, o):
    with np.errstate(over="ignore", invalid="ignore"):
        w = l * np.exp(m.max(axis=0) - m)
        w = np.where(l > 0, w, 0)  # exp(+inf) of an empty chunk times l = 0
        return _weighted(w, o, w.sum(axis=0))


def _combine_not_normalised(m, l, o):
    w = l * np.exp(m - m.max(axis=0))
    return (w[..., None] * o).sum(axis=0)


def _combine_largest_max_only(m, l, o):
    best = np.argmax(m, axis=0)  # (...,) the chunk holding the largest score
    return np.take_along_axis(o, best[None, ..., None], axis=0)[0]


COMBINE_MISTAKES = {
    "the chunk outputs are weighted by l_s without the max correction: each l_s is relative to "
    "its own max m_s, so bring it to the global max first, w_s = l_s · exp(m_s − m)":
        _combine_no_max_correction,
    "the outputs are rescaled by exp(m_s − m) but the total is not: divide by "
    "Σ_s l_s · exp(m_s − m), the rescaled sum": _combine_outputs_rescaled_not_sum,
    "the chunk outputs are simply averaged: weight each by its share of the softmax sum, "
    "l_s · exp(m_s − m) / Σ_t l_t · exp(m_t − m)": _combine_average,
    "the outputs are weighted by exp(m_s − m) alone: also multiply by the chunk's sum l_s "
    "(a chunk with more keys carries more weight)": _combine_without_l,
    "the correction has the wrong sign: use exp(m_s − m) (≤ 1, m the largest m_s), not "
    "exp(m − m_s)": _combine_wrong_sign,
    "the weighted sum is not divided by the total weight Σ_s l_s · exp(m_s − m)":
        _combine_not_normalised,
    "only the chunk with the largest max is kept: every chunk contributes, weighted by "
    "l_s · exp(m_s − m)": _combine_largest_max_only,
}


def _partials(rng, lead, n, splits, d=5, offset=0.0, dtype=np.float64):
    """Real split-KV states of a random decoding problem: (m, l, o) with a split axis first."""
    q = rng.normal(size=lead + (d,))
    k = rng.normal(size=lead[:-1] + (lead[-1], n, d)) * 2.0
    v = rng.normal(size=lead[:-1] + (lead[-1], n, d))
    m, l, o = decoding.split_kv_partials(q.astype(dtype), k.astype(dtype), v.astype(dtype),
                                         splits)
    return m + dtype(offset), l, o


def _combine_cases() -> list[Case]:
    rng = np.random.default_rng(801)
    big = _partials(rng, (3,), 40, 4)
    big = (big[0] + 1000.0, big[1], big[2])  # every score shifted by 1000: exp(m) overflows
    return [
        Case(_partials(rng, (2, 3), 29, 4),
             label="4 uneven chunks of 29 keys, leading dims (2, 3)"),
        Case(_partials(rng, (4,), 23, [1, 9, 2, 11]), label="chunks of 1, 9, 2 and 11 keys"),
        Case(_partials(rng, (2,), 5, 7),
             label="7 chunks for 5 keys: two chunks are empty (m = -inf, l = 0, o = 0)"),
        Case(big, label="scores around 1000"),
        Case(_partials(rng, (3,), 17, 1), label="one chunk (no split)"),
        Case(_partials(rng, (2, 2), 31, 3, dtype=np.float32), label="float32"),
    ]


def check_combine_splits(fn):
    """Check exercise 8.2, ``combine_splits(m, l, o) -> o`` with ``m, l (S, ...)``,
    ``o (S, ..., d)``; return the function to continue with."""
    return check_function("Exercise 8.2", fn, reference=decoding.combine_splits,
                          cases=_combine_cases(), mistakes=COMBINE_MISTAKES)


# ----------------------------------------------------------------------------------------------
# Exercise 8.1: kv_cache_bytes(layers, n_heads, n_kv_heads, head_dim, seq_len, batch, bytes)
# ----------------------------------------------------------------------------------------------

def cache_bytes_reference(layers, n_heads, n_kv_heads, head_dim, seq_len, batch,
                          bytes_per_element):
    """The KV-cache size in bytes (``n_heads`` is not in the formula: only K/V heads are cached)."""
    return (kvcache.KV_TENSORS * layers * n_kv_heads * head_dim * seq_len * batch
            * bytes_per_element)


CACHE_MISTAKES = {
    "the factor 2 is missing: the cache holds two tensors per layer and head, K and V":
        lambda layers, n_heads, n_kv_heads, head_dim, seq_len, batch, nbytes:
            layers * n_kv_heads * head_dim * seq_len * batch * nbytes,
    "n_heads is used instead of n_kv_heads: with GQA/MQA only the K/V heads are cached, so the "
    "query heads do not count":
        lambda layers, n_heads, n_kv_heads, head_dim, seq_len, batch, nbytes:
            2 * layers * n_heads * head_dim * seq_len * batch * nbytes,
    "the result counts elements, not bytes: multiply by bytes_per_element":
        lambda layers, n_heads, n_kv_heads, head_dim, seq_len, batch, nbytes:
            2 * layers * n_kv_heads * head_dim * seq_len * batch,
    "the number of layers is missing: every layer keeps its own cache":
        lambda layers, n_heads, n_kv_heads, head_dim, seq_len, batch, nbytes:
            2 * n_kv_heads * head_dim * seq_len * batch * nbytes,
    "the batch is missing: every sequence in the batch has its own cache":
        lambda layers, n_heads, n_kv_heads, head_dim, seq_len, batch, nbytes:
            2 * layers * n_kv_heads * head_dim * seq_len * nbytes,
    "n_heads and n_kv_heads are both multiplied in: only the K/V heads are cached":
        lambda layers, n_heads, n_kv_heads, head_dim, seq_len, batch, nbytes:
            2 * layers * n_heads * n_kv_heads * head_dim * seq_len * batch * nbytes,
}


def _cache_cases() -> list[Case]:
    return [
        Case((32, 32, 8, 128, 4096, 3, 4), label="GQA 32/8 heads, fp32, batch 3"),
        Case((80, 64, 8, 128, 2048, 5, 2), label="70B shape, fp16, batch 5"),
        Case((32, 32, 32, 128, 4096, 1, 2), label="7B multi-head, fp16"),
        Case((24, 16, 1, 64, 1000, 7, 1), label="MQA, 8-bit cache"),
    ]


def check_kv_cache_bytes(fn):
    """Check exercise 8.1, ``kv_cache_bytes(layers, n_heads, n_kv_heads, head_dim, seq_len,
    batch, bytes_per_element) -> int``; return the function to continue with."""
    return check_function("Exercise 8.1", fn, reference=cache_bytes_reference,
                          cases=_cache_cases(), mistakes=CACHE_MISTAKES, tolerance=(0.5, 0.0))


# ----------------------------------------------------------------------------------------------
# Exercise 8.3: kv_head_for(h, n_heads, n_kv_heads) -> the K/V head query head h reads
# ----------------------------------------------------------------------------------------------

def head_reference(h, n_heads, n_kv_heads):
    """``h // (n_heads // n_kv_heads)`` on an integer array of query heads."""
    return gqa.kv_head_index(h, n_heads, n_kv_heads)


HEAD_MISTAKES = {
    "h % n_kv_heads interleaves the heads (0, 1, …, 7, 0, 1, …): GQA groups consecutive query "
    "heads, so use h // group with group = n_heads // n_kv_heads":
        lambda h, n_heads, n_kv_heads: h % n_kv_heads,
    "h // n_kv_heads divides by the wrong number: divide by the group size "
    "n_heads // n_kv_heads": lambda h, n_heads, n_kv_heads: h // n_kv_heads,
    "h % group gives the position inside the group, not the group: use h // group":
        lambda h, n_heads, n_kv_heads: h % (n_heads // n_kv_heads),
    "h * group maps past the last K/V head: use h // group":
        lambda h, n_heads, n_kv_heads: h * (n_heads // n_kv_heads),
}


def _head_cases() -> list[Case]:
    return [
        Case((np.arange(12), 12, 3), label="12 query heads, 3 K/V heads (groups of 4)"),
        Case((np.arange(32), 32, 8), label="32 query heads, 8 K/V heads"),
        Case((np.array([[5, 0], [7, 2]]), 8, 2), label="a 2-D array of head indices"),
        Case((np.arange(8), 8, 8), label="multi-head: n_kv_heads = n_heads"),
        Case((np.arange(8), 8, 1), label="MQA: one K/V head"),
    ]


def check_kv_head_for(fn):
    """Check exercise 8.3, ``kv_head_for(h, n_heads, n_kv_heads)`` on integer arrays ``h``;
    return the function to continue with."""
    return check_function("Exercise 8.3", fn, reference=head_reference, cases=_head_cases(),
                          mistakes=HEAD_MISTAKES, tolerance=(0.0, 0.0))

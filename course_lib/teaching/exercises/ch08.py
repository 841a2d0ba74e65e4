"""Checks for chapter 08 (beyond): exercise 8.1, the KV-cache size; 8.2, combining the partial
results of split-KV decoding; 8.3, the GQA head mapping; 8.4, the split kernel of flash-decoding
in Triton; 8.5, its combine kernel (numbered in the notebook's order).

Each check runs the learner's function on every prepared case and compares with
:mod:`course_lib.attention.kvcache`, :mod:`course_lib.attention.decoding` and
:mod:`course_lib.attention.gqa`. The cases vary what a mistake can depend on: leading dims, chunk
maxima hundreds apart (and query rows 1200 apart), empty chunks, GQA groups of 1, 2 and 4 and MQA,
an explicit scale, tensors stored in other layouts (interleaved heads, a cache stored
(B, N, H_kv, d) or with its head dim not last).
When the answer is wrong, a "likely cause" is named only if exactly one of the known mistakes
below reproduces the learner's output on every case; otherwise the diagnosis says what was seen.
The mistake models are public (``COMBINE_MISTAKES``, ``CACHE_MISTAKES``, ``HEAD_MISTAKES``,
``SPLIT_KERNEL_MISTAKES``, ``COMBINE_KERNEL_MISTAKES``) so that tests and instructors can see
what is recognised, and each computes exactly what that mistaken code computes, NaN included.

Exercise 8.4 is a Triton kernel: its check runs it on guarded tensors
(:func:`course_lib.teaching.kernel_checks.check_kernel`: in the interpreter every load and store is
checked before it happens) and compares the partial states it writes with a float64 model of the
same tiles (:func:`split_states`); the mistakes are that model with one thing done wrong.
Exercise 8.5, the combine kernel, is checked the same way against a float64 merge of the
workspace (:func:`combine_reference`), its mistakes modelled by :func:`merged_output`.
"""

from __future__ import annotations

import math
import numbers

import numpy as np

import torch

from course_lib.teaching import checks
from course_lib import constants
from course_lib.attention import decoding, gqa, kvcache
from course_lib.platform import runtime
from course_lib.teaching.checks import Case, check_function, learner_check
from course_lib.attention.reference import default_scale

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
    with np.errstate(over="ignore", invalid="ignore"):  # an empty chunk: 0 · exp(+inf) = NaN
        w = l * np.exp(m.max(axis=0) - m)
        return _weighted(w, o, w.sum(axis=0))


def _combine_global_max(m, l, o):
    with np.errstate(invalid="ignore"):  # rows far below the global max: 0 / 0
        w = l * np.exp(m - m.max())
        return _weighted(w, o, w.sum(axis=0))


def _combine_max_over_last_axis(m, l, o):
    with np.errstate(invalid="ignore"):  # a chunk empty on every row: -inf - (-inf) = NaN
        w = l * np.exp(m - m.max(axis=-1, keepdims=True))
        return _weighted(w, o, w.sum(axis=0))


def _combine_no_max(m, l, o):
    with np.errstate(over="ignore", invalid="ignore"):  # exp(1000) = inf, inf / inf = NaN
        w = l * np.exp(m)
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
    "the max is taken over the whole array (m.max() with no axis), not per query row over the "
    "chunks: a row whose scores are far below another row's then gets weights exp(-1000) = 0 "
    "and 0 / 0 — take m.max(axis=0)": _combine_global_max,
    "the max is taken over the last axis (m.max(axis=-1)), within each chunk, not over the "
    "chunks: m has the chunk axis first, (S, ...), so the common max of a query row is "
    "m.max(axis=0)": _combine_max_over_last_axis,
    "the weights are l_s · exp(m_s) with no max subtracted: exp overflows (to inf, and inf / inf "
    "is NaN) once m_s passes ~709 — subtract the max over the chunks first": _combine_no_max,
}


def _partials(rng, lead, n, splits, d=5, offset=0.0, dtype=np.float64):
    """Real split-KV states of a random decoding problem: (m, l, o) with a split axis first."""
    q = rng.normal(size=lead + (d,))
    k = rng.normal(size=lead[:-1] + (lead[-1], n, d)) * 2.0
    v = rng.normal(size=lead[:-1] + (lead[-1], n, d))
    m, l, o = decoding.split_kv_partials(q.astype(dtype), k.astype(dtype), v.astype(dtype),
                                         splits)
    return m + dtype(offset), l, o


def _spread_partials(rng):
    """States of 3 chunks for 2 query rows (d = 6) whose maxima are hundreds apart within a row
    and 1200 apart between the rows; l in [1, 9], o non-integer."""
    m = np.array([[600.25, -600.5], [250.75, -300.125], [580.5, -650.0]])  # (S, rows)
    l = 1 + 8 * rng.random((3, 2))
    o = rng.normal(size=(3, 2, 6))
    return m, l, o


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
        Case(_spread_partials(rng), label="two query rows 1200 apart (row 0's maxima near "
                                          "+600, row 1's near -600), chunk maxima hundreds "
                                          "apart within each row"),
    ]


@learner_check
def check_combine_splits(fn):
    """Check exercise 8.2, ``combine_splits(m, l, o) -> o`` with ``m, l (S, ...)``,
    ``o (S, ..., d)``; return the function to continue with."""
    def in_input_precision(m, l, o):
        # An accumulator made with np.zeros (float64) turns a float32 answer into float64: the
        # merge is what the exercise asks, not the dtype, so a float result is judged in the
        # inputs' precision.
        out = fn(m, l, o)
        if isinstance(out, np.ndarray) and out.dtype.kind == "f" and out.dtype != o.dtype:
            return out.astype(o.dtype)
        return out

    result = check_function("Exercise 8.2", in_input_precision, reference=decoding.combine_splits,
                            cases=_combine_cases(), mistakes=COMBINE_MISTAKES)
    return fn if result is in_input_precision else result


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


@learner_check
def check_kv_cache_bytes(fn):
    """Check exercise 8.1, ``kv_cache_bytes(layers, n_heads, n_kv_heads, head_dim, seq_len,
    batch, bytes_per_element) -> int``; return the function to continue with."""
    cases = _cache_cases()
    try:
        first = fn(*cases[0].args)
    except Exception:  # noqa: BLE001 - not done yet, or broken: check_function says which
        first = None
    if (isinstance(first, numbers.Real) and not isinstance(first, (numbers.Integral, bool))
            and callable(fn)):
        right = cache_bytes_reference(*cases[0].args)
        raise checks.failed_with("Exercise 8.1", (
            f"✗ Exercise 8.1: kv_cache_bytes returned {first!r} ({type(first).__name__}) on case 1 "
            f"of {len(cases)} — {cases[0].label}; a size in bytes is a whole number, an int "
            f"({right:,} here): multiply integers only (no `/`, which gives a float even when it "
            f"divides exactly, and no float factors such as 2.0 or 0.5)"))
    return check_function("Exercise 8.1", fn, reference=cache_bytes_reference,
                          cases=cases, mistakes=CACHE_MISTAKES, tolerance=(0.5, 0.0))


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
    "the group is rounded to the nearest (np.round): query heads in the upper half of a group "
    "land on the next K/V head — round down, h // group":
        lambda h, n_heads, n_kv_heads:
            np.round(h / (n_heads // n_kv_heads)).astype(np.asarray(h).dtype),
    "(h + 1) // group is one head ahead: the last query head of each group lands on the next "
    "K/V head — query heads count from 0, so h // group":
        lambda h, n_heads, n_kv_heads: (h + 1) // (n_heads // n_kv_heads),
}


def _head_cases() -> list[Case]:
    return [
        Case((np.arange(12), 12, 3), label="12 query heads, 3 K/V heads (groups of 4)"),
        Case((np.arange(32), 32, 8), label="32 query heads, 8 K/V heads"),
        Case((np.array([[5, 0], [7, 2]]), 8, 2), label="a 2-D array of head indices"),
        Case((np.arange(8), 8, 8), label="multi-head: n_kv_heads = n_heads"),
        Case((np.arange(8), 8, 1), label="MQA: one K/V head"),
    ]


@learner_check
def check_kv_head_for(fn):
    """Check exercise 8.3, ``kv_head_for(h, n_heads, n_kv_heads)`` on integer arrays ``h``;
    return the function to continue with."""
    return check_function("Exercise 8.3", fn, reference=head_reference, cases=_head_cases(),
                          mistakes=HEAD_MISTAKES, tolerance=(0.0, 0.0))


# ----------------------------------------------------------------------------------------------
# Exercise 8.4: split_kv_kernel, one chunk of the cache -> a partial state (m, l, o), in Triton
# ----------------------------------------------------------------------------------------------

# 16 is the smallest tile tl.dot accepts: the checks' short caches span several tiles per split.
SPLIT_CHECK_BLOCK_N = 16
# Margins of the guarded tensors, per logical dim (B, H, N, d), a different set for each input so
# that no two share a stride: a tile's worth of NaN rows after each head's keys (for the GPU, where
# nothing stops an unmasked tile past the end before it reads), and gaps after each row and head.
SPLIT_ROW_MARGIN = 32
SPLIT_COL_MARGIN = 8
SPLIT_INPUT_MARGINS = {"q": (0, 1, 2, 3), "k": (1, 1, SPLIT_ROW_MARGIN, 5),
                       "v": (0, 2, SPLIT_ROW_MARGIN, SPLIT_COL_MARGIN)}
# The workspace's margins: m and l (B, H, S, n_q) share theirs (one set of launch strides).
SPLIT_STATE_MARGIN = (1, 1, 1, 2)
SPLIT_PART_MARGIN = (1, 1, 1, 2, 4)
# An empty chunk's state is (m = -inf, l = 0, o = 0). A kernel may start m_i at a very negative
# finite number instead of -inf (e.g. -1e30): any m at most this, with l = 0, weighs exactly 0
# in the combine, so it is reported as the empty state too.
EMPTY_CHUNK_M_AT_MOST = -1e20


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def split_states(q, k, v, splits, block_n=SPLIT_CHECK_BLOCK_N, *, kv_head="group", scale=None,
                 m_units=1.0, bounds="cdiv", tile_mask="split", rescale=True, m_init=-math.inf,
                 batch="own"):
    """float64 model of the split kernel's partial states, tile by tile.

    The defaults are the right kernel; each keyword does one thing differently (the mistakes).
    Probabilities and correction factors are rounded to float32 as the kernel's are, so that a
    mistake whose exponentials underflow there (a max started at 0 over scores of -500) is
    modelled faithfully.

    Args:
        q: ``(B, H, n_q, d)``; k, v: ``(B, H_kv, N, d)``. splits: S. block_n: key rows per tile.
        kv_head: "group" (``h // (H // H_kv)``), "modulo" (``h % H_kv``) or "divide"
            (``h // H_kv``).
        scale: score scale (None: ``1/sqrt(d)``); the kernel's exponentials use ``scale``
            throughout. m_units: factor on the stored m.
        bounds: "cdiv" (chunks of ``cdiv(N, S)`` keys), "floor" (``N // S``: the tail is lost)
            or "heads" (``cdiv(N, H)``: the count of grid axis 0, the query heads, for S).
        tile_mask: "split" (keys < the chunk's end), "cache" (keys < N: into the next chunk) or
            "scores" (loads masked, scores not: padding keys score 0).
        rescale: whether ``acc`` is rescaled by ``exp(m_old − m_new)``.
        m_init: the running max before the first tile (-inf; 0 is a mistake).
        batch: "own" (each batch reads its own q, k, v) or "first" (every batch reads batch 0's:
            the batch offset is missing).

    Returns:
        ``(o, m, l)``: ``o`` ``(B, H, S, n_q, d)`` in q's dtype, ``m``, ``l`` ``(B, H, S, n_q)``
        float32 (m in natural-log units times ``m_units``).
    """
    n_batch, heads, n_q, d = q.shape
    n_kv_heads, n = k.shape[1], k.shape[2]
    scale = default_scale(d) if scale is None else scale
    h = torch.arange(heads)
    kv = {"group": h // (heads // n_kv_heads), "modulo": h % n_kv_heads,
          "divide": h // n_kv_heads}[kv_head]
    if (kv >= n_kv_heads).any():
        raise ValueError("that head map reads past the last K/V head (the check stops it)")
    q64, k64, v64 = (x.double().cpu() for x in (q, k, v))
    if batch == "first":
        q64, k64, v64 = (x[:1].expand(n_batch, *x.shape[1:]) for x in (q64, k64, v64))
    k64, v64 = k64[:, kv], v64[:, kv]  # (B, H, N, d)
    s_all = scale * q64 @ k64.transpose(-1, -2)  # (B, H, n_q, N)
    keys_per_split = {"cdiv": _cdiv(n, splits), "floor": n // splits,
                      "heads": _cdiv(n, heads)}[bounds]
    ms, ls, os_ = [], [], []
    for split in range(splits):
        start = split * keys_per_split
        end = min(start + keys_per_split, n)
        m = torch.full((n_batch, heads, n_q), m_init, dtype=torch.float64)
        l = torch.zeros_like(m)
        acc = torch.zeros((n_batch, heads, n_q, d), dtype=torch.float64)
        for tile in range(start, end, block_n):
            inside = min(tile + block_n, n) - tile  # keys of the tile inside the cache
            live = min(tile + block_n, n if tile_mask == "cache" else end) - tile
            s = torch.zeros((n_batch, heads, n_q, block_n), dtype=torch.float64)
            s[..., :inside] = s_all[..., tile:tile + inside]
            vt = torch.zeros((n_batch, heads, block_n, d), dtype=torch.float64)
            vt[..., :live, :] = v64[..., tile:tile + live, :]
            # masked loads: padding keys are 0, so their score is 0; else they are masked out
            s[..., live:] = 0 if tile_mask == "scores" else -math.inf
            m_new = torch.maximum(m, s.max(dim=-1).values)
            p = torch.exp(s - m_new[..., None]).float().double()  # float32, as the kernel's
            alpha = torch.exp(m - m_new).float().double()
            l = l * alpha + p.sum(dim=-1)
            acc = (acc * alpha[..., None] if rescale else acc) + p @ vt
            m = m_new
        o = torch.where(l[..., None] > 0, acc / torch.where(l > 0, l, 1)[..., None], 0)
        ms.append(m * m_units)
        ls.append(l)
        os_.append(o)
    device = q.device
    return (torch.stack(os_, dim=2).to(device=device, dtype=q.dtype),
            torch.stack(ms, dim=2).to(device=device, dtype=torch.float32),
            torch.stack(ls, dim=2).to(device=device, dtype=torch.float32))


# The guarded run rejects any inf in an output, but an empty chunk's m is -inf by design (the
# empty state of chapter 03). The check's runner reports it as this finite stand-in instead, and
# so do the reference and the mistake models.
EMPTY_CHUNK_M_REPORTED = torch.finfo(torch.float32).min


def _report_empty(m: torch.Tensor, l: torch.Tensor | None = None) -> torch.Tensor:
    """m with an empty chunk's -inf (or, where ``l`` is 0, any m ≤ EMPTY_CHUNK_M_AT_MOST) as the
    finite stand-in."""
    empty = m == -torch.inf
    if l is not None:
        empty |= (l == 0) & (m <= EMPTY_CHUNK_M_AT_MOST)
    return m.masked_fill(empty, EMPTY_CHUNK_M_REPORTED)


def _checked_states(q, k, v, splits, scale=None, block_n=SPLIT_CHECK_BLOCK_N, **wrong):
    """:func:`split_states` as the check compares it (an empty chunk's m reported finite)."""
    o, m, l = split_states(q, k, v, splits, block_n, scale=scale, **wrong)
    return o, _report_empty(m, l), l


def _state_mistake(**wrong):
    def mistaken(q, k, v, splits, scale=None, block_n=SPLIT_CHECK_BLOCK_N):
        if "scale" in wrong or "scale_factor" in wrong:  # a scale the kernel made of its own
            factor = wrong.get("scale_factor", 1.0)
            given = default_scale(q.shape[-1]) if scale is None else scale
            kw = {key: val for key, val in wrong.items() if key not in ("scale", "scale_factor")}
            used = wrong["scale"] if "scale" in wrong else given * factor
            return _checked_states(q, k, v, splits, used, block_n, **kw)
        return _checked_states(q, k, v, splits, scale, block_n, **wrong)
    return mistaken


SPLIT_KERNEL_MISTAKES = {
    "the K/V head is h % n_kv_heads, which interleaves the groups: GQA groups consecutive query "
    "heads, so query head h reads K/V head h // (n_heads // n_kv_heads)":
        _state_mistake(kv_head="modulo"),
    "the K/V head is h // n_kv_heads: divide by the group size, h // (n_heads // n_kv_heads) "
    "(the number of query heads per K/V head)": _state_mistake(kv_head="divide"),
    "acc is not rescaled when the running max grows: multiply acc (like l_i) by "
    "alpha = exp2(m_old - m_new) before adding p @ v": _state_mistake(rescale=False),
    "m is stored in log2 units (the kernel's m_i): the combine merges natural-log states like "
    "chapter 03's, so store m_i * LN_2": _state_mistake(m_units=constants.LOG2_E),
    "the ragged last tile of the chunk is loaded with a mask but its scores are not masked: the "
    "padding keys score 0 and take softmax weight — set s to MASK_VALUE where keys >= split_end":
        _state_mistake(tile_mask="scores"),
    "the last tile of a chunk runs into the next chunk (keys masked with n_k instead of the "
    "chunk's end): those keys are counted twice — mask with keys < split_end, "
    "split_end = min(split_start + keys_per_split, n_k)": _state_mistake(tile_mask="cache"),
    "the chunks are n_k // SPLITS keys long, so the last n_k % SPLITS keys are never counted: "
    "use keys_per_split = tl.cdiv(n_k, SPLITS)": _state_mistake(bounds="floor"),
    "keys_per_split divides n_k by the number of query heads (tl.num_programs(0), grid axis 0 "
    "of (H, S, B)): the splits are grid axis 1, keys_per_split = tl.cdiv(n_k, "
    "tl.num_programs(1))": _state_mistake(bounds="heads"),
    "the scores are not scaled: multiply q·kᵀ by qk_scale_log2 (= scale · LOG2_E), not by "
    "LOG2_E alone": _state_mistake(scale=1.0),
    "the scores are in log2 units (qk_scale_log2) but go through tl.exp, the natural "
    "exponential: use tl.math.exp2 with log2-unit scores (or tl.exp with scale alone)":
        _state_mistake(scale_factor=constants.LOG2_E, m_units=constants.LN_2),
    "the running max starts at 0 instead of -inf (MASK_VALUE): a chunk whose scores are all far "
    "below 0 then has exp2(s - 0) = 0 for every key, so l = 0 and o = 0 — start m_i at "
    "MASK_VALUE": _state_mistake(m_init=0.0),
    "the batch offset is missing: every batch reads batch 0's q, k and v — add b * stride_qb "
    "(and b * stride_kb, b * stride_vb) to the pointers": _state_mistake(batch="first"),
}


def _split_kernel_cases(device: str) -> list[Case]:
    """The cases of exercise 8.4 (see the comments for what each one varies)."""
    gen = torch.Generator().manual_seed(8_4)

    def layout(x, order):
        """``x`` stored in the physical order ``order`` of its dims, seen in its own order."""
        inverse = [order.index(i) for i in range(len(order))]
        return x.permute(order).contiguous().permute(inverse)

    cases = []
    # 1. GQA, groups of 2; d = 24 (HEAD_DIM 32); ragged chunks of 24, 24, 22 keys, two tiles
    #    each; an explicit scale; chunk maxima ~ +245, -355, +35 (a bias on one column of k, per
    #    chunk: a spread of hundreds); q stored (B, n_q, H, d) (interleaved heads), k stored
    #    (B, N, H_kv, d), v stored (B, H_kv, d, N) (column stride ≠ 1). float16: scores of
    #    hundreds carry a float32 rounding error of ~|s|·2⁻²⁴ each, which exp turns into errors of
    #    ~3e-5 in o, beyond float32's tolerance but far inside float16's.
    q = torch.randn(1, 4, 3, 24, generator=gen)
    k, v = (torch.randn(1, 2, 70, 24, generator=gen) for _ in range(2))
    q[..., 0] = 12.0
    k[..., 0] = torch.tensor([40.0] * 24 + [-60.0] * 24 + [5.0] * 22)
    cases.append(((layout(q, (0, 2, 1, 3)), layout(k, (0, 2, 1, 3)), layout(v, (0, 1, 3, 2))),
                  3, 0.5, SPLIT_CHECK_BLOCK_N, "float16",
                  "GQA 4 query heads / 2 K/V heads, chunk maxima ~ +245, -355, +35; q stored "
                  "(B, n_q, H, d), k (B, N, H_kv, d), v (B, H_kv, d, N)"))
    # 2. two batches, no grouping (H = H_kv); 5 keys in 4 splits of cdiv(5, 4) = 2: the last
    #    chunk is empty; BLOCK_N = 32 ≠ BLOCK_M = 16; a scale larger than 1/√d; k stored
    #    (B, H_kv, d, N), v (B, N, H_kv, d).
    q = torch.randn(2, 2, 1, 16, generator=gen)
    k, v = (torch.randn(2, 2, 5, 16, generator=gen) for _ in range(2))
    cases.append(((q, layout(k, (0, 1, 3, 2)), layout(v, (0, 2, 1, 3))), 4, 1.3, 32, "float32",
                  "B=2, H = H_kv = 2, 5 keys in 4 splits (the last chunk is empty); k stored "
                  "(B, H_kv, d, N), v (B, N, H_kv, d)"))
    # 3. MQA: 4 query heads read one K/V head (a group of 4); two chunks of 20 keys, two tiles
    #    each; float32; the default scale.
    q = torch.randn(1, 4, 2, 32, generator=gen)
    k, v = (torch.randn(1, 1, 40, 32, generator=gen) for _ in range(2))
    cases.append(((q, k, v), 2, None, SPLIT_CHECK_BLOCK_N, "float32",
                  "MQA 4 query heads / 1 K/V head"))
    out = []
    for (q, k, v), splits, scale, block_n, dtype, what in cases:
        dt = getattr(torch, dtype)
        q, k, v = (x.to(device=device, dtype=dt) for x in (q, k, v))
        batch, heads, n_q, d = q.shape
        shown = "1/√d" if scale is None else f"{scale:g}"
        label = (f"{what}: B={batch}, H={heads}, H_kv={k.shape[1]}, n_q={n_q}, N={k.shape[2]}, "
                 f"d={d}, SPLITS={splits}, scale={shown}, BLOCK_N={block_n}, {dtype}; outputs "
                 f"(o, m, l) indexed [b, h, split, row(, col)]")
        out.append(Case((q, k, v), {"splits": splits, "scale": scale, "block_n": block_n},
                        label=label))
    return out


def _physical(x: torch.Tensor):
    """``(x in its storage order, contiguous; the order)``: the order of x's dims from the
    largest stride to the smallest, so that ``physical.permute(inverse)`` is x's layout again."""
    order = sorted(range(x.ndim), key=lambda i: (-x.stride(i), i))
    return x.permute(order).contiguous(), order


def split_kernel_runner(kernel, splits: int, scale=None, block_n: int = SPLIT_CHECK_BLOCK_N):
    """A guarded run of a split kernel: ``run(q, k, v) -> (o in q's dtype, m, l)``.

    q, k, v may have any strides: each is handed to the guarded run in its storage order (with
    margins of its own) and to the kernel as a view in its logical order, so a kernel that
    assumes a layout (unit column stride, contiguous heads) reads the wrong elements.
    """
    from course_lib.teaching import kernel_checks
    from course_lib.kernels.decoding import launch_split_kv

    def state_shape(q, k, v):
        return (shape[0][0], shape[0][1], splits, shape[0][2]), torch.float32

    def part_shape(q, k, v):
        return (shape[0][0], shape[0][1], splits, shape[0][2], shape[0][3]), torch.float32

    shape, orders = [], []

    def logical(x, order):
        return x.permute([order.index(i) for i in range(len(order))])

    def launch(q, k, v, m, l, o):
        q, k, v = (logical(x, order) for x, order in zip((q, k, v), orders))
        used = default_scale(q.shape[-1]) if scale is None else scale
        launch_split_kv(kernel, q, k, v, m, l, o, used, block_n)
        m.copy_(_report_empty(m, l))

    def run(q, k, v):
        physical = [_physical(x) for x in (q, k, v)]
        orders[:] = [order for _, order in physical]
        shape[:] = [tuple(q.shape)]
        margins = [tuple(SPLIT_INPUT_MARGINS[name][i] for i in order)
                   for name, (_, order) in zip("qkv", physical)]
        guarded = kernel_checks.GuardedRun(
            launch=launch, margins=margins,
            # m and l share their strides (one launch argument set): the same margin for both
            outputs=(kernel_checks.Output("m", SPLIT_STATE_MARGIN, state_shape),
                     kernel_checks.Output("l", SPLIT_STATE_MARGIN, state_shape),
                     kernel_checks.Output("o", SPLIT_PART_MARGIN, part_shape)),
            store_hint="mask the stores with offs_m < n_q (the padded query rows) and, for o, "
                       "the real head-dim columns",
            coverage_hint="each program stores its whole state — m, l and o of its (b, h, split) "
                          "rows, an empty chunk too (m = -inf, l = 0, o = 0) — at b * stride_mb "
                          "+ h * stride_mh + split * stride_ms + offs_m * stride_mm",
            load_hint="a tile reads keys past the end of the cache: the last tile of a chunk is "
                      "ragged — load K and V with the mask keys < split_end (tiles.load_tile_at "
                      "does it) and set the scores of those keys to MASK_VALUE")
        # NaN/inf from the kernel's own arithmetic is handed on, and judged on every case
        m, l, o = guarded(*(x for x, _ in physical))
        return o.to(q.dtype), m, l
    return run


@learner_check
def check_split_kv_kernel(kernel):
    """Check exercise 8.4, the split kernel of flash-decoding (signature of
    :func:`course_lib.kernels.decoding.split_kv_kernel`); return the learner's kernel or, when it
    is not done yet, the library's."""
    from course_lib.teaching import kernel_checks
    from course_lib.kernels import decoding as kernels_decoding

    first_wrong = {}  # the cache length and splits of the first case answered wrong
    computed = {}  # the reference of each case, by a digest of its inputs (the runs get copies)

    def reference(q, k, v, splits, scale=None, block_n=SPLIT_CHECK_BLOCK_N):
        key = (tuple(float(x.double().sum()) for x in (q, k, v)), splits, scale, block_n)
        if key not in computed:
            computed[key] = _checked_states(q, k, v, splits, scale, block_n)
        return computed[key]

    def run(q, k, v, splits, scale=None, block_n=SPLIT_CHECK_BLOCK_N):
        got = split_kernel_runner(kernel, splits, scale, block_n)(q, k, v)
        if "case" not in first_wrong:
            want = reference(q, k, v, splits, scale, block_n)
            if checks.compare(got, want, *checks._default_tolerance(want)) is not None:
                first_wrong["case"] = (k.shape[2], splits)
        return got

    def locate(index):
        """Which chunk of the cache the first bad [b, h, split, row(, col)] belongs to."""
        if "case" not in first_wrong or len(index) < 3:
            return ""
        n_keys, splits = first_wrong["case"]
        split, chunk = index[2], _cdiv(n_keys, splits)
        start, end = split * chunk, min((split + 1) * chunk, n_keys)
        if start >= n_keys:
            return (f"split {split} is an empty chunk: {n_keys} keys in {splits} splits of "
                    f"{chunk} leave it none, so its state is m = -inf, l = 0, o = 0")
        return f"split {split} holds keys {start} to {end - 1} of the {n_keys}"

    return kernel_checks.check_kernel("Exercise 8.4", kernel, run, reference,
                                      _split_kernel_cases(runtime.current().device),
                                      fallback=kernels_decoding.split_kv_kernel,
                                      mistakes=SPLIT_KERNEL_MISTAKES, locate=locate,
                                      output_names=("o", "m", "l"))


SPLIT_KERNEL_HINTS = [
    "Start from who you are: <code>h, split, b = tl.program_id(0), tl.program_id(1), "
    "tl.program_id(2)</code>; SPLITS is <code>tl.num_programs(1)</code>. Your query head reads "
    "K/V head <code>h // (n_heads // n_kv_heads)</code> (exercise 8.3).",
    "Your chunk: <code>keys_per_split = tl.cdiv(n_k, tl.num_programs(1))</code>, "
    "<code>split_start = split * keys_per_split</code>, <code>split_end = "
    "tl.minimum(split_start + keys_per_split, n_k)</code>. An empty chunk (more splits than "
    "keys) simply skips the loop.",
    "Load the query rows once with <code>tiles.load_tile</code> and the mask "
    "<code>tiles.row_mask(offs_m, n_q, d_mask)</code>; point at the first K and V tiles with "
    "<code>tiles.tile_ptrs(K, b, kv_h, offs_n, offs_d, ...)</code>.",
    "The loop is chapter 06's: <code>for start_n in range(split_start, split_end, BLOCK_N)</code>, "
    "<code>tiles.load_tile_at(k_ptrs, start_n, offs_n, split_end, d_mask, stride_kn)</code>, "
    "<code>tiles.scores_log2</code>, then <code>tl.where(keys[None, :] &lt; split_end, s, "
    "MASK_VALUE)</code> and <code>tiles.online_softmax_step</code>.",
    "Store the state of the real rows (<code>offs_m &lt; n_q</code>): <code>m_i * LN_2</code> "
    "(natural-log units, as the combine expects), <code>l_i</code>, and <code>o = acc / l_i</code> "
    "with <code>l_i</code> replaced by 1 where it is 0 (an empty chunk).",
]

SPLIT_KERNEL_SKELETON = '''\
h, split, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
kv_h = ...                                    # the K/V head of query head h
keys_per_split = ...                          # tl.cdiv(n_k, number of splits)
split_start, split_end = ...                  # this program's chunk [start, end)
offs_m, offs_n, offs_d = tl.arange(0, BLOCK_M), tl.arange(0, BLOCK_N), tl.arange(0, HEAD_DIM)
d_mask = offs_d < HEAD_DIM_REAL
q = ...                                       # (BLOCK_M, HEAD_DIM), rows >= n_q are 0
k_ptrs, v_ptrs = ...                          # the first K and V tiles of head kv_h
m_i, l_i, acc = ...                           # -inf (MASK_VALUE), 0, 0 in float32
for start_n in range(split_start, split_end, BLOCK_N):
    keys, kv_mask, k = ...                    # tiles.load_tile_at, masked at split_end
    s = ...                                   # scores in log2 units, MASK_VALUE past split_end
    m_i, l_i, acc = ...                       # tiles.online_softmax_step
o = ...                                       # acc / l_i, 0 for an empty chunk
...                                           # store m_i * LN_2, l_i and o for rows < n_q'''


# ----------------------------------------------------------------------------------------------
# Exercise 8.5: combine_kernel, the S partial states of a query row -> (o, lse), in Triton
# ----------------------------------------------------------------------------------------------

# Margins of the guarded workspace and outputs, per logical dim ((B, H, S, n_q) for m and l,
# (B, H, S, n_q, d) for the partial outputs, (B, H, n_q, d) for out, (B, H, n_q) for lse): room
# past the last split (a load of the padded split lanes s >= n_splits without a mask reads there),
# a gap after each row and head, a different set per tensor so that no two share a stride.
COMBINE_SPLIT_MARGIN = 8
COMBINE_COL_MARGIN = 8
COMBINE_STATE_MARGIN = (1, 1, COMBINE_SPLIT_MARGIN, 1)
COMBINE_PART_MARGIN = (1, 0, COMBINE_SPLIT_MARGIN, 2, COMBINE_COL_MARGIN)
COMBINE_OUT_MARGIN = (1, 1, 1, COMBINE_COL_MARGIN)
COMBINE_LSE_MARGIN = (1, 1, 2)
# A non-empty split's l is at least 1 (its max term is exp(0)) and at most 1 + this.
COMBINE_MAX_EXTRA_L = 20.0


def merged_output(m, l, o, out_dtype, *, m_ref="max", rescale=True, sign=1.0, weigh_o=True,
                  divide_by="weights", lse_with_m=True, lse_units=1.0, pad_m=None, with_l=True,
                  exp2=False):
    """float64 model of the combine kernel: ``(out, lse)`` from the workspace, and its mistakes.

    The defaults are the right kernel; each keyword does one thing differently. The weights are
    rounded to float32 as the kernel's are (an exp that overflows float32 is inf here too).

    Args:
        m, l: ``(B, H, S, n_q)`` (m natural-log, -inf for an empty split); o:
            ``(B, H, S, n_q, d)``. out_dtype: the dtype of ``out``.
        m_ref: the m the weights are relative to: "max" (over the splits), "first" (split 0's)
            or "zero" (none: exp(m_s)).
        rescale: weights ``l_s · exp(sign · (m_s − m))`` (True) or plain ``l_s``.
        with_l: the weights carry ``l_s`` (True) or are ``exp(m_s − m)`` alone.
        exp2: the correction is ``exp2(m_s − m)`` on these natural-log maxima (base 2 for e).
        sign: -1 for the correction with the wrong sign, exp(m − m_s).
        weigh_o: weigh each ``o_s`` (True) or average them.
        divide_by: "weights" (``Σ w_s``), "splits" (S), "l" (``Σ l_s``, not rescaled) or
            "nothing" (``Σ w_s o_s`` stored as it is).
        lse_with_m: ``lse = m + log Σ w_s`` (True) or ``log Σ w_s``.
        lse_units: factor on the stored lse (``LOG2_E``: log2 units).
        pad_m: the m of the padded split lanes (S rounded up to a power of two) when it is not
            -inf (a load with ``other=0.0``): it joins the max.

    Returns:
        ``(out, lse)``: ``(B, H, n_q, d)`` in ``out_dtype`` and ``(B, H, n_q)`` float32.
    """
    m64, l64, o64 = (x.double().cpu().numpy() for x in (m, l, o))
    splits = m64.shape[2]
    # the kernel's padded lanes (S rounded up to BLOCK_S): l = 0, o = 0, m = -inf or pad_m
    extra = (1 << (splits - 1).bit_length()) - splits
    pad = [(0, 0)] * 2 + [(0, extra)] + [(0, 0)]
    m64 = np.pad(m64, pad, constant_values=-np.inf if pad_m is None else pad_m)
    l64 = np.pad(l64, pad)
    o64 = np.pad(o64, pad + [(0, 0)])
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):  # NaN of a mistake
        if m_ref == "first":
            m_max = m64[:, :, :1]
        elif m_ref == "zero":
            m_max = np.zeros_like(m64[:, :, :1])
        else:
            m_max = m64.max(axis=2, keepdims=True)  # (B, H, 1, n_q)
        correction = (np.exp2 if exp2 else np.exp)(sign * (m64 - m_max))
        w = ((l64 if with_l else 1.0) * correction if rescale else l64)  # (B, H, S, n_q)
        w = w.astype(np.float32).astype(np.float64)
        w_sum = w.sum(axis=2)  # (B, H, n_q)
        if weigh_o:
            total = (w[..., None] * o64).sum(axis=2)  # (B, H, n_q, d)
            denominator = {"weights": w_sum[..., None], "splits": splits,
                           "l": l64.sum(axis=2)[..., None], "nothing": 1.0}[divide_by]
            out = total / denominator
        else:
            out = o64.sum(axis=2) / splits
        lse = (m_max[:, :, 0] if lse_with_m else 0.0) + np.log(w_sum)
    return (torch.from_numpy(out).to(device=m.device, dtype=out_dtype),
            torch.from_numpy(lse * lse_units).to(device=m.device, dtype=torch.float32))


def combine_reference(m, l, o, out_dtype):
    """``(out, lse)`` of the workspace by chapter 03's merge, float64
    (:func:`course_lib.attention.decoding.merge_splits` over the split axis)."""
    from course_lib.attention.tiled import state_lse

    split_first = [np.moveaxis(x.double().cpu().numpy(), 2, 0) for x in (m, l, o)]  # (S, B, H, ...)
    m_all, l_all, out = decoding.merge_splits(*split_first)
    return (torch.from_numpy(out).to(device=m.device, dtype=out_dtype),
            torch.from_numpy(state_lse(m_all, l_all)).to(device=m.device, dtype=torch.float32))


def _merge_mistake(**wrong):
    def mistaken(m, l, o, out_dtype):
        return merged_output(m, l, o, out_dtype, **wrong)
    return mistaken


COMBINE_KERNEL_MISTAKES = {
    "the weights are the plain l_s: each l_s is a sum relative to its own split's max m_s, so "
    "bring it to the common max first, w_s = l_s · exp(m_s − m) with m = max_s m_s":
        _merge_mistake(rescale=False),
    "the o_s are averaged: each split counts in proportion to its share of the softmax sum, "
    "o = Σ w_s o_s / Σ w_s with w_s = l_s · exp(m_s − m)": _merge_mistake(weigh_o=False),
    "lse is log Σ w_s without the max: the weights are relative to m, so lse = m + log Σ w_s":
        _merge_mistake(lse_with_m=False),
    "m is split 0's m instead of the max over the splits: when split 0 is empty (m_0 = -inf, "
    "l_0 = 0), exp(m_0 − m_0) = exp(-inf + inf) is NaN and the other splits' exp(m_s − m_0) "
    "overflow — take m = tl.max(m_s, axis=0) over all splits (the real ones are never all "
    "empty)": _merge_mistake(m_ref="first"),
    "the weights are l_s · exp(m_s) with no max subtracted: exp overflows float32 past m ≈ 88 "
    "(and underflows to 0 below ≈ -103) — subtract m = max_s m_s first, w_s = l_s · exp(m_s − m)":
        _merge_mistake(m_ref="zero"),
    "the correction has the wrong sign, exp(m − m_s): it is ≥ 1 and overflows for a split far "
    "below the max — use exp(m_s − m), at most 1": _merge_mistake(sign=-1.0),
    "Σ w_s o_s is divided by the number of splits: divide by the total weight Σ w_s (the o_s "
    "are normalised per split, the weights are not)": _merge_mistake(divide_by="splits"),
    "Σ w_s o_s is divided by Σ l_s: the weights were rescaled by exp(m_s − m), so divide by the "
    "rescaled total Σ w_s": _merge_mistake(divide_by="l"),
    "the weights leave out l_s, w_s = exp(m_s − m): o_s is normalised by its own l_s, so a "
    "split counts in proportion to its softmax sum, w_s = l_s · exp(m_s − m)":
        _merge_mistake(with_l=False),
    "the correction is exp2(m_s − m) on natural-log maxima: m and l here are in natural-log "
    "units, so the weights are l_s · exp(m_s − m) (exp2 belongs to maxima kept in log2 units)":
        _merge_mistake(exp2=True),
    "Σ w_s o_s is not divided by Σ w_s: the weights are not normalised (each o_s already is), "
    "so out = Σ w_s o_s / Σ w_s": _merge_mistake(divide_by="nothing"),
    "lse is stored in log2 units (m · LOG2_E + log2 Σ w_s): the output lse is natural-log, "
    "lse = m + log Σ w_s (multiply a log2 value by LN_2)":
        _merge_mistake(lse_units=constants.LOG2_E),
    "the padded split lanes load m with other=0.0: when every real m_s is below 0, the max is "
    "then 0 — load m with other=MASK_VALUE (-inf), so that a padded lane never wins the max":
        _merge_mistake(pad_m=0.0),
}


def _layout(x: torch.Tensor, order) -> torch.Tensor:
    """``x`` stored in the physical order ``order`` of its dims, seen in its own order."""
    inverse = [order.index(i) for i in range(len(order))]
    return x.permute(order).contiguous().permute(inverse)


def _combine_kernel_cases(device: str) -> list[Case]:
    gen = torch.Generator().manual_seed(8_5)
    # (B, H, n_q, d, S, empty splits, m centre, m spread, out dtype, layouts of m/l and o):
    # 1. split 0 empty (as when a sliding window masks the oldest chunk), S = 5 (BLOCK_S = 8:
    #    three padded lanes), split maxima hundreds apart, d = 24 (HEAD_DIM 32); m and l stored
    #    (B, n_q, H, S), o (B, S, n_q, H, d);
    # 2. every m far below 0 (a padded lane's m = 0 would win the max), S = 3, float16 out, o
    #    stored with its head dim not last (column stride ≠ 1);
    # 3. S = 8 (no padded lane) with the last two splits empty (a cache shorter than the splits
    #    × the chunk), d = 40 (HEAD_DIM 64), maxima hundreds apart;
    # 4. one split (nothing to merge).
    specs = [(2, 2, 3, 24, 5, (0,), 0.0, 200.0, torch.float32, (0, 3, 1, 2), (0, 2, 3, 1, 4)),
             (1, 3, 2, 16, 3, (), -300.0, 20.0, torch.float16, (0, 1, 2, 3), (0, 1, 2, 4, 3)),
             (1, 1, 2, 40, 8, (6, 7), 50.0, 150.0, torch.float32, (2, 0, 1, 3), (0, 1, 2, 3, 4)),
             (1, 2, 1, 16, 1, (), 3.0, 1.0, torch.float32, (0, 1, 2, 3), (0, 1, 2, 3, 4))]
    cases = []
    for b, h, n_q, d, splits, empty, centre, spread, out_dtype, ml_order, o_order in specs:
        m = centre + spread * torch.randn(b, h, splits, n_q, generator=gen)
        l = 1 + COMBINE_MAX_EXTRA_L * torch.rand(b, h, splits, n_q, generator=gen)
        o = torch.randn(b, h, splits, n_q, d, generator=gen)
        for s in empty:  # the empty state of chapter 03
            m[:, :, s], l[:, :, s], o[:, :, s] = -torch.inf, 0.0, 0.0
        m, l, o = _layout(m, ml_order), _layout(l, ml_order), _layout(o, o_order)
        name = str(out_dtype).replace("torch.", "")
        label = (f"B={b}, H={h}, n_q={n_q}, d={d}, S={splits}"
                 + (f", split(s) {', '.join(map(str, empty))} empty (m = -inf, l = 0)"
                    if empty else "")
                 + f", m ~ {centre:g} ± {spread:g}, out {name}; outputs (out [b, h, row, col], "
                   f"lse [b, h, row])")
        cases.append(Case(tuple(x.to(device) for x in (m, l, o)), {"out_dtype": out_dtype},
                          label=label))
    return cases


def _restore_empty(m: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`_report_empty`: the stand-in back to -inf."""
    return m.masked_fill(m == EMPTY_CHUNK_M_REPORTED, -torch.inf)


def combine_kernel_runner(kernel, out_dtype):
    """A guarded run of a combine kernel: ``run(m, l, o) -> (out in out_dtype, lse)``.

    m, l and o may have any strides (m and l the same): each is handed to the guarded run in its
    storage order with margins of its own, and to the kernel as a view in its logical order. The
    guarded run diagnoses NaN only when every input is finite, so an empty split's m = -inf
    travels to it as :data:`EMPTY_CHUNK_M_REPORTED` and is put back to -inf just for the launch.
    """
    from course_lib.teaching import kernel_checks
    from course_lib.kernels import decoding as kernels_decoding

    orders = []
    out_order, lse_order = (0, 2, 1, 3), (2, 0, 1)  # out stored (B, n_q, H, d), lse (n_q, B, H)

    def logical(x, order):
        return x.permute([order.index(i) for i in range(len(order))])

    def physical_shape(shape, order):
        return tuple(shape[i] for i in order)

    def out_shape(m, l, o):
        logical_o = logical(o, orders[2])
        shape = tuple(logical_o.shape[:2]) + tuple(logical_o.shape[3:])
        return physical_shape(shape, out_order), out_dtype

    def lse_shape(m, l, o):
        lm = logical(m, orders[0])
        return physical_shape((lm.shape[0], lm.shape[1], lm.shape[3]), lse_order), torch.float32

    def launch(m, l, o, out, lse):
        m, l, o = (logical(x, order) for x, order in zip((m, l, o), orders))
        empty = m == EMPTY_CHUNK_M_REPORTED
        m.masked_fill_(empty, -torch.inf)
        try:
            kernels_decoding.launch_combine(m, l, o, logical(out, out_order),
                                            logical(lse, lse_order), kernel=kernel)
        finally:
            m.masked_fill_(empty, EMPTY_CHUNK_M_REPORTED)

    def run(m, l, o):
        physical = [_physical(x) for x in (m, l, o)]
        physical[0] = (_report_empty(physical[0][0]), physical[0][1])
        orders[:] = [order for _, order in physical]
        margins = [tuple(margin[i] for i in order) for margin, (_, order) in
                   zip((COMBINE_STATE_MARGIN, COMBINE_STATE_MARGIN, COMBINE_PART_MARGIN),
                       physical)]
        guarded = kernel_checks.GuardedRun(
            launch=launch, margins=margins,
            outputs=(kernel_checks.Output("out", physical_shape(COMBINE_OUT_MARGIN, out_order),
                                          out_shape),
                     kernel_checks.Output("lse", physical_shape(COMBINE_LSE_MARGIN, lse_order),
                                          lse_shape)),
            store_hint="store one row: out at b * stride_ob + h * stride_oh + row * stride_om + "
                       "offs_d * stride_od masked with offs_d < HEAD_DIM_REAL, and one lse",
            coverage_hint="program (row, h, b) = (tl.program_id(0), tl.program_id(1), "
                          "tl.program_id(2)) stores its row of out and its lse",
            load_hint="a load reads past the last split: BLOCK_S is S rounded up to a power of "
                      "two, so mask the loads with offs_s < n_splits — m with other=-inf "
                      "(MASK_VALUE), l and o with other=0.0 — so that the padded lanes weigh 0")
        # NaN/inf from the kernel's own arithmetic is handed on, and judged on every case
        out, lse = guarded(*(x for x, _ in physical))
        return logical(out, out_order), logical(lse, lse_order)
    return run


@learner_check
def check_combine_kernel(kernel):
    """Check exercise 8.5, the combine kernel of flash-decoding (signature of
    :func:`course_lib.kernels.decoding.combine_kernel`); return the learner's kernel or, when it
    is not done yet, the library's."""
    from course_lib.teaching import kernel_checks
    from course_lib.kernels import decoding as kernels_decoding

    def run(m, l, o, out_dtype):
        return combine_kernel_runner(kernel, out_dtype)(m, l, o)

    return kernel_checks.check_kernel("Exercise 8.5", kernel, run, combine_reference,
                                      _combine_kernel_cases(runtime.current().device),
                                      fallback=kernels_decoding.combine_kernel,
                                      mistakes=COMBINE_KERNEL_MISTAKES, output_names=("out", "lse"))


COMBINE_KERNEL_HINTS = [
    "Who you are: <code>row, h, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)</code>. "
    "Your row's S states sit at <code>b * stride_mb + h * stride_mh + offs_s * stride_ms + row * "
    "stride_mm</code> with <code>offs_s = tl.arange(0, BLOCK_S)</code>.",
    "BLOCK_S is S rounded up to a power of two: load with the mask <code>offs_s &lt; "
    "n_splits</code>, m with <code>other=MASK_VALUE</code> and l with <code>other=0.0</code>, so "
    "that a padded lane has weight 0. o is a <code>(BLOCK_S, HEAD_DIM)</code> tile: "
    "<code>offs_s[:, None] * stride_ps + offs_d[None, :] * stride_pd</code>.",
    "Exercise 8.2 on registers: <code>m_max = tl.max(m, axis=0)</code>, <code>w = l * tl.exp(m - "
    "m_max)</code> (an empty split: l = 0, exp(-inf) = 0, so w = 0), <code>out = tl.sum(w[:, None] "
    "* o, axis=0) / tl.sum(w, axis=0)</code>.",
    "Store <code>out.to(Out.dtype.element_ty)</code> masked with <code>offs_d &lt; "
    "HEAD_DIM_REAL</code>, and <code>lse = m_max + tl.log(tl.sum(w, axis=0))</code> — natural "
    "log, with the max added back.",
]

COMBINE_KERNEL_SKELETON = '''\
row, h, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
offs_s, offs_d = tl.arange(0, BLOCK_S), tl.arange(0, HEAD_DIM)
s_mask, d_mask = offs_s < n_splits, offs_d < HEAD_DIM_REAL
m = ...                                       # (BLOCK_S,) MASK_VALUE in the padded lanes
l = ...                                       # (BLOCK_S,) 0 in the padded lanes
o = ...                                       # (BLOCK_S, HEAD_DIM) the normalised o_s
m_max = ...                                   # the max over the splits
w = ...                                       # (BLOCK_S,) l_s · exp(m_s − m_max)
out = ...                                     # (HEAD_DIM,) Σ w_s o_s / Σ w_s
...                                           # store out in Out's dtype, masked with d_mask
...                                           # store lse = m_max + log Σ w_s'''

"""Checks for chapter 04 (tiled attention in NumPy).

* Exercise 4.1 — the inner loop of the FA2 forward (the online-softmax update of one tile) and
  its epilogue: ``fa2_forward(q, k, v, causal=False, scale=None, block_m=..., block_n=...)``
  returning ``(o, lse)``, checked against :func:`course_lib.tiled.flash_attention_numpy`.
* Exercise 4.2 — the causal tile-skip condition: ``causal_skip_grid(n_q, n_k, block_m, block_n)``
  returning a boolean ``(T_r, T_c)`` grid, checked against :func:`course_lib.iomodel.causal_skip_grid`.
* Exercise 4.3 — why FA2's loop order moves less data than FA1's, answered by code:
  ``olm_traffic(n, d, block_m, block_n)`` returning the ``(fa1, fa2)`` elements of ``o``, ``l``,
  ``m`` and ``lse`` moved through HBM, checked against :func:`course_lib.iomodel.output_traffic`.

Cases use ragged sizes (N not a multiple of the tile sizes), N_q ≠ N_k, leading dims and
causal masks, so that each classic mistake changes the answer. The mistake models are public
(``FORWARD_MISTAKES``, ``SKIP_MISTAKES``, ``TRAFFIC_MISTAKES``) so tests and instructors can see
what is recognised; when a wrong answer equals one of them, the check names the cause.
"""

from __future__ import annotations

import numpy as np

from course_lib import iomodel, tiled
from course_lib.checks import Case, check_function
from course_lib.reference import default_scale

# ----------------------------------------------------------------------------------------------
# Exercise 4.1: the FA2 forward's inner loop
# ----------------------------------------------------------------------------------------------


# Not modelled: the other off-by-one, ``k_idx < q_idx``, hides query 0's only key, so its row is
# 0/0 = NaN; the check reports the NaN (checks.compare) instead of naming this cause.

def _fa2_with_mistake(q, k, v, causal=False, scale=None, block_m=tiled.DEFAULT_BLOCK_M,
                      block_n=tiled.DEFAULT_BLOCK_N, *, mistake: str):
    """The FA2 forward with one classic mistake switched on (a model of a wrong answer)."""
    d = q.shape[-1]
    scale = default_scale(d) if scale is None else scale
    if mistake == "scale_1_over_d":
        scale = 1.0 / d
    n_q, n_k = q.shape[-2], k.shape[-2]
    lead, dtype = q.shape[:-2], q.dtype
    o = np.empty(lead + (n_q, v.shape[-1]), dtype=dtype)
    lse = np.empty(lead + (n_q,), dtype=dtype)
    for i in range(iomodel.num_blocks(n_q, block_m)):
        q_start, rows = i * block_m, iomodel.block_rows(i, n_q, block_m)
        q_tile = tiled.load_tile(q, q_start, block_m)
        m_i = np.full(lead + (block_m,), -np.inf)
        l_i = np.zeros(lead + (block_m,))
        acc = np.zeros(lead + (block_m, v.shape[-1]))
        q_idx = q_start + np.arange(block_m)[:, None]
        for j in range(iomodel.num_blocks(n_k, block_n)):
            k_start = j * block_n
            k_tile, v_tile = tiled.load_tile(k, k_start, block_n), tiled.load_tile(v, k_start, block_n)
            k_idx = k_start + np.arange(block_n)[None, :]
            s = scale * (q_tile @ np.swapaxes(k_tile, -1, -2))
            in_bounds = k_idx < n_k if mistake != "ragged_not_masked" else np.ones_like(k_idx, bool)
            if not causal:
                visible = in_bounds
            elif mistake == "causal_sees_next_key":
                visible = in_bounds & (k_idx <= q_idx + 1)
            else:
                visible = in_bounds & (k_idx <= q_idx)
            if mistake == "mask_after_softmax":  # statistics from the unmasked causal scores
                s = np.where(in_bounds, s, -np.inf)
                m_new = np.maximum(m_i, s.max(-1))
                p_all = np.exp(s - m_new[..., None])
                alpha = np.exp(m_i - m_new)
                l_i = alpha * l_i + p_all.sum(-1)
                acc = alpha[..., None] * acc + np.where(visible, p_all, 0) @ v_tile
                m_i = m_new
                continue
            s = np.where(visible, s, -np.inf)
            m_new = np.maximum(m_i, s.max(-1))
            m_safe = np.where(np.isfinite(m_new), m_new, 0)
            alpha = np.exp(m_i - m_safe)
            p = np.exp(s - m_safe[..., None])
            l_i = (l_i if mistake == "sum_not_rescaled" else alpha * l_i) + p.sum(-1)
            acc = (acc if mistake == "acc_not_rescaled" else alpha[..., None] * acc) + p @ v_tile
            m_i = m_new
        out = acc if mistake == "no_final_division" else acc / l_i[..., None]
        row_lse = np.log(l_i) if mistake == "lse_without_max" else m_i + np.log(l_i)
        o[..., q_start:q_start + rows, :] = out[..., :rows, :]
        lse[..., q_start:q_start + rows] = row_lse[..., :rows]
    return o, lse


def _forward_mistake(name):
    def wrong(q, k, v, causal=False, scale=None, block_m=tiled.DEFAULT_BLOCK_M,
              block_n=tiled.DEFAULT_BLOCK_N):
        return _fa2_with_mistake(q, k, v, causal, scale, block_m, block_n, mistake=name)
    wrong.__name__ = f"fa2_forward_{name}"
    return wrong


FORWARD_MISTAKES = {
    "the causal mask is off by one: query i may see keys 0..i, not key i + 1 (keep k_idx <= q_idx)":
        _forward_mistake("causal_sees_next_key"),
    "the padded key columns of the ragged last K/V tile are not masked (mask k_idx >= N_k to "
    "-inf before the max and the exp)": _forward_mistake("ragged_not_masked"),
    "the causal mask is applied after the softmax statistics: masked scores still count in the "
    "running sum l (mask s to -inf before computing m, p and l)": _forward_mistake("mask_after_softmax"),
    "the running sum l is not rescaled by alpha = exp(m_old - m_new) when the max grows":
        _forward_mistake("sum_not_rescaled"),
    "the accumulator (O) is not rescaled by alpha = exp(m_old - m_new) when the max grows — "
    "the FA2 version of FA1's 'O not rescaled on reload'": _forward_mistake("acc_not_rescaled"),
    "the final division by l is missing: o = acc / l at the end of the K/V loop":
        _forward_mistake("no_final_division"),
    "the scale is 1/d instead of 1/sqrt(d)": _forward_mistake("scale_1_over_d"),
    "lse is log(l) without adding back the running max m (lse = m + log l)":
        _forward_mistake("lse_without_max"),
}


def _forward_cases(seed: int = 4):
    rng = np.random.default_rng(seed)
    # (leading dims, N_q, N_k, d, block_m, block_n, causal): all ragged (N not a multiple of the
    # tiles), unequal tile sizes, N_q != N_k, and one case with large scores (spread = 4).
    specs = [((), 37, 45, 8, 16, 8, False, 1.0),
             ((), 45, 45, 8, 16, 8, True, 1.0),
             ((2,), 29, 50, 4, 8, 16, True, 1.0),
             ((2, 3), 19, 19, 4, 8, 5, True, 4.0)]
    cases = []
    for lead, n_q, n_k, d, bm, bn, causal, spread in specs:
        q, k, v = (spread * rng.standard_normal(lead + (n, d)) for n in (n_q, n_k, n_k))
        cases.append(Case((q, k, v), {"causal": causal, "block_m": bm, "block_n": bn},
                          label=f"N_q={n_q}, N_k={n_k}, d={d}, BLOCK_M={bm}, BLOCK_N={bn}, "
                                f"causal={causal}"))
    return cases


def _reference_forward(q, k, v, causal=False, scale=None, block_m=tiled.DEFAULT_BLOCK_M,
                       block_n=tiled.DEFAULT_BLOCK_N):
    return tiled.flash_attention_numpy(q, k, v, causal, scale, block_m, block_n)


def check_fa2_forward(fn):
    """Exercise 4.1: check ``fa2_forward(q, k, v, causal, scale, block_m, block_n) -> (o, lse)``.

    Returns the learner's function when right, the library's when not done yet.
    """
    return check_function("Exercise 4.1", fn, _reference_forward, _forward_cases(),
                          fallback=tiled.flash_attention_numpy, mistakes=FORWARD_MISTAKES)


# ----------------------------------------------------------------------------------------------
# Exercise 4.2: which tiles does a causal run skip?
# ----------------------------------------------------------------------------------------------

def _grid(n_q, n_k, block_m, block_n, skip):
    t_r, t_c = iomodel.num_blocks(n_q, block_m), iomodel.num_blocks(n_k, block_n)
    return np.array([[bool(skip(i, j)) for j in range(t_c)] for i in range(t_r)],
                    dtype=bool).reshape(t_r, t_c)


SKIP_MISTAKES = {
    "off by one: `>=` skips a tile whose first key is exactly the last query row, which that "
    "query must see (use `>`)":
        lambda n_q, n_k, bm, bn: _grid(n_q, n_k, bm, bn,
                                       lambda i, j: j * bn >= min((i + 1) * bm, n_q) - 1),
    "the ragged last Q tile: its last real row is min((i+1)·BLOCK_M, N_q) − 1, not "
    "(i+1)·BLOCK_M − 1":
        lambda n_q, n_k, bm, bn: _grid(n_q, n_k, bm, bn, lambda i, j: j * bn > (i + 1) * bm - 1),
    "compared tile indices (j > i) instead of positions; that is only right when BLOCK_M == "
    "BLOCK_N":
        lambda n_q, n_k, bm, bn: _grid(n_q, n_k, bm, bn, lambda i, j: j > i),
    "used the tile's first query row instead of its last: a tile is skipped only when even its "
    "last query cannot see its first key":
        lambda n_q, n_k, bm, bn: _grid(n_q, n_k, bm, bn, lambda i, j: j * bn > i * bm),
    "swapped BLOCK_M and BLOCK_N (BLOCK_M is the query tile, BLOCK_N the key tile)":
        lambda n_q, n_k, bm, bn: _grid(n_q, n_k, bm, bn,
                                       lambda i, j: j * bm > min((i + 1) * bn, n_q) - 1),
}


def _skip_cases():
    specs = [(100, 100, 32, 16), (70, 90, 16, 24), (45, 64, 20, 8), (33, 40, 8, 8), (5, 9, 4, 2)]
    return [Case((n_q, n_k, bm, bn), label=f"N_q={n_q}, N_k={n_k}, BLOCK_M={bm}, BLOCK_N={bn}")
            for n_q, n_k, bm, bn in specs]


def check_causal_skip_grid(fn):
    """Exercise 4.2: check ``causal_skip_grid(n_q, n_k, block_m, block_n) -> bool (T_r, T_c)``."""
    return check_function("Exercise 4.2", fn, iomodel.causal_skip_grid, _skip_cases(),
                          mistakes=SKIP_MISTAKES)


# ----------------------------------------------------------------------------------------------
# Exercise 4.3: the o/l/m traffic of FA1 and FA2
# ----------------------------------------------------------------------------------------------

def olm_traffic(n, d, block_m, block_n):
    """Reference for Exercise 4.3: ``(fa1, fa2)`` elements of o, l, m, lse moved, non-causal,
    one head, N_q = N_k = n."""
    return (iomodel.output_traffic("fa1", n, n, d, block_m, block_n),
            iomodel.output_traffic("fa2", n, n, d, block_m, block_n))


def _t_c(n, bn):
    return iomodel.num_blocks(n, bn)


TRAFFIC_MISTAKES = {
    "FA1 counted only the reads of o, l, m: every computed tile also writes them back":
        lambda n, d, bm, bn: (n * (d + 2) + _t_c(n, bn) * n * (d + 2) + 3 * n, n * (d + 1)),
    "forgot l and m: each row of o travels with its l and m (d + 2 elements per row)":
        lambda n, d, bm, bn: (n * d + 2 * _t_c(n, bn) * n * d + 3 * n, n * (d + 1)),
    "used T_r (the number of Q tiles) for FA1's round trips: the inner Q loop runs once per "
    "K/V tile, T_c = ⌈N / BLOCK_N⌉ times":
        lambda n, d, bm, bn: (n * (d + 2) + 2 * iomodel.num_blocks(n, bm) * n * (d + 2) + 3 * n,
                              n * (d + 1)),
    "left out FA1's initial writes of o, l, m and its final pass that reads l, m and writes lse":
        lambda n, d, bm, bn: (2 * _t_c(n, bn) * n * (d + 2), n * (d + 1)),
    "FA2 also writes lse (one element per row): n·(d + 1), not n·d":
        lambda n, d, bm, bn: olm_traffic(n, d, bm, bn)[:1] + (n * d,),
}

# exact integer counts: any difference is a wrong answer
_EXACT = (0.5, 0.0)


def _traffic_cases():
    specs = [(1000, 64, 48, 32), (257, 128, 32, 48), (100, 16, 10, 7)]
    return [Case((n, d, bm, bn), label=f"N={n}, d={d}, BLOCK_M={bm}, BLOCK_N={bn}")
            for n, d, bm, bn in specs]


def check_olm_traffic(fn):
    """Exercise 4.3: check ``olm_traffic(n, d, block_m, block_n) -> (fa1, fa2)``."""
    return check_function("Exercise 4.3", fn, olm_traffic, _traffic_cases(), tolerance=_EXACT,
                          mistakes=TRAFFIC_MISTAKES)

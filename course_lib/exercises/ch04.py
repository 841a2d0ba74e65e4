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
from course_lib.softmax import correction_factor

# ----------------------------------------------------------------------------------------------
# Exercise 4.1: the FA2 forward's inner loop
# ----------------------------------------------------------------------------------------------

# Each mistake model is the library's loop (tiled.flash_attention_numpy) with one of its parts
# swapped for a mistaken one: the mask (a TileRule), the online-softmax update (`step`), the
# epilogue (`finish`) or the scale. Not modelled: the other off-by-one, ``k_idx < q_idx``, hides
# query 0's only key, so its row is 0/0 = NaN; the check reports the NaN (checks.compare)
# instead of naming this cause.

class _ExerciseMask(tiled.TileRule):
    """The exercise's mask, built the way the notebook's loop builds it: no tile skipped, every
    tile masked — with a mistake switched on (``sees_next_key``, or ``mask_padding=False``)."""

    def __init__(self, causal: bool, *, sees_next_key: bool = False, mask_padding: bool = True):
        self.base = tiled.CAUSAL if causal else tiled.DENSE
        self.shift = 1 if sees_next_key else 0  # query i treated as query i + 1
        self.mask_padding = mask_padding

    def visible(self, q_idx, k_idx):
        return self.base.visible(q_idx + self.shift, k_idx)

    def tile_classes(self, n_q, n_k, block_m, block_n):
        return np.full((iomodel.num_blocks(n_q, block_m), iomodel.num_blocks(n_k, block_n)),
                       tiled.PARTIAL)

    def tile_mask(self, q_idx, k_idx, n_k):
        if self.mask_padding:
            return super().tile_mask(q_idx, k_idx, n_k)
        return self.visible(q_idx, k_idx)  # the padded keys are not masked out


def _step_sum_not_rescaled(m_i, l_i, acc, s, v_tile):
    """The right update with the rescale of ``l`` undone: ``l = l_old + rowsum(p)``."""
    m_new, l_new, acc_new = tiled.online_softmax_step(m_i, l_i, acc, s, v_tile)
    return m_new, l_new + (1 - correction_factor(m_i, m_new)) * l_i, acc_new


def _step_acc_not_rescaled(m_i, l_i, acc, s, v_tile):
    """The right update with the rescale of ``acc`` undone: ``acc = acc_old + p v``."""
    m_new, l_new, acc_new = tiled.online_softmax_step(m_i, l_i, acc, s, v_tile)
    return m_new, l_new, acc_new + (1 - correction_factor(m_i, m_new))[..., None] * acc


def _finish_no_division(m_i, l_i, acc):
    return acc, tiled.state_lse(m_i, l_i)


def _finish_lse_without_max(m_i, l_i, acc):
    return tiled.finish_tile(m_i, l_i, acc)[0], tiled.state_lse(np.zeros_like(m_i), l_i)


def _forward_mistake(name, *, rule=None, step=tiled.online_softmax_step,
                     finish=tiled.finish_tile, wrong_scale=None):
    """A model of a wrong answer: the library's FA2 loop with the given parts swapped.

    ``rule(causal)`` builds the mistaken mask; ``wrong_scale(d)`` the mistaken scale.
    """
    def wrong(q, k, v, causal=False, scale=None, block_m=tiled.DEFAULT_BLOCK_M,
              block_n=tiled.DEFAULT_BLOCK_N):
        if wrong_scale is not None:
            scale = wrong_scale(q.shape[-1])
        mask = {"causal": causal} if rule is None else {"rule": rule(causal)}
        return tiled.flash_attention_numpy(q, k, v, scale=scale, block_m=block_m,
                                           block_n=block_n, step=step, finish=finish, **mask)
    wrong.__name__ = f"fa2_forward_{name}"
    return wrong


def _fa2_forward_mask_after_softmax(q, k, v, causal=False, scale=None,
                                    block_m=tiled.DEFAULT_BLOCK_M, block_n=tiled.DEFAULT_BLOCK_N):
    """The causal mask applied after the statistics: m and l count every key, the weights only
    the visible ones — the right causal output reweighted by ``exp(lse_causal - lse_all)``."""
    o, lse = tiled.flash_attention_numpy(q, k, v, causal, scale, block_m, block_n)
    _, lse_all = tiled.flash_attention_numpy(q, k, v, False, scale, block_m, block_n)
    return o * np.exp(lse - lse_all)[..., None], lse_all


FORWARD_MISTAKES = {
    "the causal mask is off by one: query i may see keys 0..i, not key i + 1 (keep k_idx <= q_idx)":
        _forward_mistake("causal_sees_next_key",
                         rule=lambda causal: _ExerciseMask(causal, sees_next_key=True)),
    "the padded key columns of the ragged last K/V tile are not masked (mask k_idx >= N_k to "
    "-inf before the max and the exp)":
        _forward_mistake("ragged_not_masked",
                         rule=lambda causal: _ExerciseMask(causal, mask_padding=False)),
    "the causal mask is applied after the softmax statistics: masked scores still count in the "
    "running sum l (mask s to -inf before computing m, p and l)": _fa2_forward_mask_after_softmax,
    "the running sum l is not rescaled by alpha = exp(m_old - m_new) when the max grows":
        _forward_mistake("sum_not_rescaled", step=_step_sum_not_rescaled),
    "the accumulator (O) is not rescaled by alpha = exp(m_old - m_new) when the max grows — "
    "the FA2 version of FA1's 'O not rescaled on reload'":
        _forward_mistake("acc_not_rescaled", step=_step_acc_not_rescaled),
    "the final division by l is missing: o = acc / l at the end of the K/V loop":
        _forward_mistake("no_final_division", finish=_finish_no_division),
    "the scale is 1/d instead of 1/sqrt(d)":
        _forward_mistake("scale_1_over_d", wrong_scale=lambda d: 1.0 / d),
    "lse is log(l) without adding back the running max m (lse = m + log l)":
        _forward_mistake("lse_without_max", finish=_finish_lse_without_max),
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

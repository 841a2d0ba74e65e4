"""Checks for chapter 03 (online softmax): exercise 3.1, the running update; 3.2, the merge of
two ``(m, l, o)`` states; 3.3, the whole row tile by tile (``online_softmax(x, block_size)``,
with a hint ladder: ``SOFTMAX_HINTS``, ``SOFTMAX_SKELETON``).

Each check runs the learner's function on prepared cases (float64 unless a case says otherwise;
irregular tile widths; leading batch dims; scores in the thousands; masked ``-inf`` scores) and
compares with :mod:`course_lib.attention.softmax`. When the answer is wrong, the known mistakes below are
replayed on the failing case; the one that reproduces the learner's output is named.

The mistake models are public (``UPDATE_MISTAKES``, ``MERGE_MISTAKES``,
``ONLINE_SOFTMAX_MISTAKES``) so that tests and instructors can see what is recognised.
"""

from __future__ import annotations

import numpy as np

from course_lib.teaching.checks import learner_check
from course_lib.attention import softmax
from course_lib.teaching.checks import Case, check_function


def _quiet(model):
    """A mistake model that computes its NaN/inf without NumPy warnings (the check replays models
    after the learner's run: their warnings would only clutter the notebook)."""
    def quiet(*args, **kwargs):
        with np.errstate(all="ignore"):
            return model(*args, **kwargs)
    quiet.__name__ = getattr(model, "__name__", "mistake")
    return quiet

# ----------------------------------------------------------------------------------------------
# Exercise 3.1: online_update(m, l, x_tile) -> (m_new, l_new)
# ----------------------------------------------------------------------------------------------

def _tile_max(x_tile):
    return np.max(x_tile, axis=-1)


def _update_no_rescale(m, l, x_tile):
    m_new = np.maximum(m, _tile_max(x_tile))
    return m_new, l + np.exp(x_tile - m_new[..., None]).sum(-1)


def _update_no_max(m, l, x_tile):
    with np.errstate(over="ignore", invalid="ignore"):
        return np.maximum(m, _tile_max(x_tile)), l + np.exp(x_tile).sum(-1)


def _update_no_max_rescaled(m, l, x_tile):
    m_new = np.maximum(m, _tile_max(x_tile))
    with np.errstate(over="ignore", invalid="ignore"):
        return m_new, l * np.exp(m - m_new) + np.exp(x_tile).sum(-1)


def _update_wrong_sign(m, l, x_tile):
    m_new = np.maximum(m, _tile_max(x_tile))
    with np.errstate(over="ignore", invalid="ignore"):
        return m_new, l * np.exp(m_new - m) + np.exp(x_tile - m_new[..., None]).sum(-1)


def _update_tile_own_max(m, l, x_tile):
    m_new = np.maximum(m, _tile_max(x_tile))
    tile = np.exp(x_tile - _tile_max(x_tile)[..., None]).sum(-1)
    return m_new, l * np.exp(m - m_new) + tile


def _update_old_max_for_tile(m, l, x_tile):
    m_new = np.maximum(m, _tile_max(x_tile))
    with np.errstate(over="ignore", invalid="ignore"):
        return m_new, l * np.exp(m - m_new) + np.exp(x_tile - m[..., None]).sum(-1)


def _update_max_not_returned(m, l, x_tile):
    return m, softmax.online_update(m, l, x_tile)[1]


def _update_global_max(m, l, x_tile):
    m_new = np.maximum(m, np.max(x_tile))  # one max for every row
    return m_new, l * np.exp(m - m_new) + np.exp(x_tile - m_new[..., None]).sum(-1)


def _update_tile_sum_rescaled(m, l, x_tile):
    m_new = np.maximum(m, _tile_max(x_tile))
    return m_new, (l + np.exp(x_tile - m_new[..., None]).sum(-1)) * np.exp(m - m_new)


NO_RESCALE = ("the running sum is not rescaled: when the max grows from m to m_new, the old l "
              "(a sum of exp(x - m)) must be multiplied by the correction exp(m - m_new)")
NO_MAX = ("the max is not subtracted: exp(x) overflows to inf for large scores (fp32 near 89) — "
          "exponentiate exp(x - m_new) and keep l relative to the running max")
WRONG_SIGN = ("the correction has the wrong sign: use exp(m_old - m_new) (a number <= 1 that "
              "shrinks the old sum), not exp(m_new - m_old)")

UPDATE_MISTAKES = {
    NO_RESCALE: _update_no_rescale,
    NO_MAX: _update_no_max,
    NO_MAX + " (the old sum was rescaled, but the tile's exp(x) was not shifted)":
        _update_no_max_rescaled,
    WRONG_SIGN: _update_wrong_sign,
    "the tile is exponentiated relative to its own max; it must use the new running max "
    "m_new = max(m, max(x_tile)), the same reference as the rescaled old sum":
        _update_tile_own_max,
    "the tile is exponentiated relative to the old max m; use the new max m_new":
        _update_old_max_for_tile,
    "the running max is returned unchanged: return m_new = max(m, max(x_tile))":
        _update_max_not_returned,
    "the tile's max is taken over the whole tile (np.max(x_tile) without axis): each row needs "
    "its own, np.max(x_tile, axis=-1)": _update_global_max,
    "the correction exp(m - m_new) also multiplies the tile's sum: the tile is already relative "
    "to m_new; only the old l needs it": _update_tile_sum_rescaled,
}
UPDATE_MISTAKES = {cause: _quiet(model) for cause, model in UPDATE_MISTAKES.items()}


def _update_cases() -> list[Case]:
    rng = np.random.default_rng(303)
    # rows 0 and 1: the tile holds a new max; row 2: it does not (correction = 1)
    m = np.array([0.5, -1.0, 2.0])  # (3,)
    l = np.array([1.7, 2.3, 1.0])  # (3,)
    x = np.array([[0.1, 1.9, -0.4, 0.7, 1.2],
                  [0.3, -2.0, 1.5, 0.0, 0.9],
                  [1.0, -0.5, 0.2, 1.8, 0.6]])  # (3, 5)
    empty_m = np.full(2, -np.inf)
    masked = rng.normal(size=(3, 4))
    masked[:, [1, 3]] = -np.inf
    big_m = np.array([995.0, 1003.0, 1001.5, 998.0])
    # a square tile (4 rows, 4 scores) of rows near +1000 and -1000: an axis slip does not crash
    # here, and a max shared by all rows underflows the rows far below it
    signs = np.array([1.0, -1.0, 1.0, -1.0])
    square_m = signs * 1000.0 + rng.normal(size=4)
    square_x = (signs * 1000.0)[:, None] + 2.0 * rng.normal(size=(4, 4))
    # row 0: a finite state and a tile of all -inf; row 1: the empty state and a partly masked
    # tile; row 2: an ordinary row. The tile is a strided view (every other column).
    wide = rng.normal(size=(3, 10))
    wide[0] = -np.inf
    wide[1, [0, 4, 6]] = -np.inf
    # float32, leading dims (2, 2): states and scores near ±300 (beyond exp's float32 range)
    f32_sign = np.array([[1.0, -1.0], [-1.0, 1.0]])
    f32_m = (f32_sign * 300.0 + rng.normal(size=(2, 2))).astype(np.float32)
    f32_x = ((f32_sign * 300.0)[..., None] + 1.5 * rng.normal(size=(2, 2, 5))).astype(np.float32)
    return [
        Case((m, l, x), label="the tile raises the max in rows 0 and 1"),
        Case((empty_m, np.zeros(2), rng.normal(size=(2, 7))),
             label="first tile: empty state m = -inf, l = 0"),
        Case((big_m, np.array([1.2, 3.4, 2.0, 1.0]), 1000.0 + 3.0 * rng.normal(size=(4, 3))),
             label="scores around 1000"),
        Case((np.array([0.2, 1.1, -0.3]), np.array([2.0, 1.0, 3.0]), masked),
             label="masked scores (-inf) in the tile"),
        Case((rng.normal(size=(2, 3)), 1.0 + rng.random((2, 3)), rng.normal(size=(2, 3, 1))),
             label="leading dims (2, 3), a ragged tile of width 1"),
        Case(tuple(a.astype(np.float32) for a in (m, l, x)), label="float32"),
        Case((square_m, 0.5 + rng.random(4), square_x),
             label="a square tile (4 rows, 4 scores), rows near +1000 and -1000"),
        Case((np.array([0.4, -np.inf, 1.3]), np.array([2.5, 0.0, 1.1]), wide[:, ::2]),
             label="row 0: a tile of all -inf; row 1: the empty state, a partly masked tile"),
        Case((f32_m, (1.0 + rng.random((2, 2))).astype(np.float32), f32_x),
             label="float32, leading dims (2, 2), scores near +300 and -300"),
    ]


@learner_check
def check_online_update(fn):
    """Check exercise 3.1, ``online_update(m, l, x_tile) -> (m_new, l_new)``; return the function
    to continue with (the learner's on a pass, the library's when not done yet)."""
    return check_function("Exercise 3.1", fn, reference=softmax.online_update,
                          cases=_update_cases(), mistakes=UPDATE_MISTAKES)


# ----------------------------------------------------------------------------------------------
# Exercise 3.2: merge(m_a, l_a, o_a, m_b, l_b, o_b) -> (m, l, o)
# ----------------------------------------------------------------------------------------------

def _factors(m_a, m_b):
    m = np.maximum(m_a, m_b)
    return m, np.exp(m_a - m), np.exp(m_b - m)


def _merge_from(m, l, w_a, w_b, o_a, o_b):
    """The output merge given the weights a mistake model chose for each part."""
    return m, l, (w_a[..., None] * o_a + w_b[..., None] * o_b) / l[..., None]


def _merge_no_rescale(m_a, l_a, o_a, m_b, l_b, o_b):
    m = np.maximum(m_a, m_b)
    return _merge_from(m, l_a + l_b, l_a, l_b, o_a, o_b)


def _merge_wrong_sign(m_a, l_a, o_a, m_b, l_b, o_b):
    m = np.maximum(m_a, m_b)
    w_a, w_b = l_a * np.exp(m - m_a), l_b * np.exp(m - m_b)
    return _merge_from(m, w_a + w_b, w_a, w_b, o_a, o_b)


def _merge_same_factor(m_a, l_a, o_a, m_b, l_b, o_b):
    m, c_a, _ = _factors(m_a, m_b)
    w_a, w_b = l_a * c_a, l_b * c_a
    return _merge_from(m, w_a + w_b, w_a, w_b, o_a, o_b)


def _merge_rescaled_twice(m_a, l_a, o_a, m_b, l_b, o_b):
    m, c_a, c_b = _factors(m_a, m_b)
    w_a, w_b = l_a * c_a, l_b * c_b
    return _merge_from(m, w_a + w_b, w_a * c_a, w_b * c_b, o_a, o_b)


def _merge_without_l(m_a, l_a, o_a, m_b, l_b, o_b):
    m, c_a, c_b = _factors(m_a, m_b)
    l = l_a * c_a + l_b * c_b
    return m, l, (c_a[..., None] * o_a + c_b[..., None] * o_b) / (c_a + c_b)[..., None]


def _merge_not_normalised(m_a, l_a, o_a, m_b, l_b, o_b):
    m, c_a, c_b = _factors(m_a, m_b)
    w_a, w_b = l_a * c_a, l_b * c_b
    return m, w_a + w_b, w_a[..., None] * o_a + w_b[..., None] * o_b


def _merge_plain_average(m_a, l_a, o_a, m_b, l_b, o_b):
    m, l, _ = softmax.merge_states_with_output(m_a, l_a, o_a, m_b, l_b, o_b)
    return m, l, (o_a + o_b) / 2


def _merge_weights_swapped(m_a, l_a, o_a, m_b, l_b, o_b):
    m, c_a, c_b = _factors(m_a, m_b)
    w_a, w_b = l_a * c_a, l_b * c_b
    return _merge_from(m, w_a + w_b, w_b, w_a, o_a, o_b)


def _merge_corrections_only(m_a, l_a, o_a, m_b, l_b, o_b):
    m, c_a, c_b = _factors(m_a, m_b)
    return m, l_a * c_a + l_b * c_b, c_a[..., None] * o_a + c_b[..., None] * o_b


def _merge_minimum(m_a, l_a, o_a, m_b, l_b, o_b):
    m = np.minimum(m_a, m_b)
    w_a, w_b = l_a * np.exp(m_a - m), l_b * np.exp(m_b - m)
    return _merge_from(m, w_a + w_b, w_a, w_b, o_a, o_b)


def _merge_l_not_rescaled(m_a, l_a, o_a, m_b, l_b, o_b):
    m, _, o = _merge_from(*_merge_parts(m_a, l_a, m_b, l_b), o_a, o_b)
    return m, l_a + l_b, o


def _merge_parts(m_a, l_a, m_b, l_b):
    m, c_a, c_b = _factors(m_a, m_b)
    w_a, w_b = l_a * c_a, l_b * c_b
    return m, w_a + w_b, w_a, w_b


MERGE_MISTAKES = {
    "the sums are not rescaled to the common max: each l is relative to its own m, so "
    "l = l_a exp(m_a - m) + l_b exp(m_b - m)": _merge_no_rescale,
    "the correction has the wrong sign: use exp(m_a - m) and exp(m_b - m) (each <= 1), "
    "not exp(m - m_a)": _merge_wrong_sign,
    "the same correction exp(m_a - m) is used for both parts: part b needs its own "
    "exp(m_b - m)": _merge_same_factor,
    "the correction is applied twice: o_a must be weighted by l_a exp(m_a - m) once, not by the "
    "already rescaled sum times exp(m_a - m) again": _merge_rescaled_twice,
    "the outputs are weighted by the corrections alone: each o must be weighted by its share of "
    "the sum, l_a exp(m_a - m) / l": _merge_without_l,
    "the merged output is not divided by the merged sum l": _merge_not_normalised,
    "o_a and o_b are simply averaged: weight each by its share of the merged sum": _merge_plain_average,
    "the two parts' weights are swapped: o_a is weighted by part a's share, "
    "l_a exp(m_a - m) / l": _merge_weights_swapped,
    "the outputs are weighted by the corrections exp(m_a - m), exp(m_b - m) alone, and not "
    "divided: each o needs its share of the merged sum, l_a exp(m_a - m) / l":
        _merge_corrections_only,
    "the merged max is the smaller one (np.minimum): it is the larger, m = max(m_a, m_b), so that "
    "every correction exp(m_part - m) is at most 1": _merge_minimum,
    "the merged l is l_a + l_b: each part's sum must be rescaled to the common max first, "
    "l = l_a exp(m_a - m) + l_b exp(m_b - m) (o was merged right)": _merge_l_not_rescaled,
}
MERGE_MISTAKES = {cause: _quiet(model) for cause, model in MERGE_MISTAKES.items()}


def _merge_cases() -> list[Case]:
    rng = np.random.default_rng(304)
    d = 5  # value width (HEAD_DIM): odd on purpose

    def part(m, size):
        m = np.asarray(m, dtype=np.float64)
        return m, 0.5 + 3.0 * rng.random(m.shape), rng.normal(size=m.shape + (size,))

    def case(m_a, m_b, label, size=d):
        return Case(part(m_a, size) + part(m_b, size), label=label)

    empty = (np.array([-np.inf, 0.7]), np.array([0.0, 1.5]), np.array([[0.0] * d, [0.3] * d]))
    mixed = rng.normal(size=(2, 3))
    # part b empty (m = -inf, l = 0, o = 0) in rows 0 and 2; maxima thousands apart, both signs;
    # o_a a strided view (a transposed (d, rows) array)
    m_a, l_a, _ = part([1500.0, -2000.0, 900.0, -700.0], d)
    o_a = rng.normal(size=(d, 4)).T
    m_b, l_b, o_b = part([0.0, -1990.5, 0.0, 2100.0], d)
    m_b[[0, 2]], l_b[[0, 2]], o_b[[0, 2]] = -np.inf, 0.0, 0.0
    # float32, leading dims (2, 2), maxima near ±300 (beyond exp's float32 range when subtracted
    # the wrong way round)
    sign = np.array([[1.0, -1.0], [-1.0, 1.0]])
    f32 = part(300.0 * sign + rng.normal(size=(2, 2)), 3) + part(
        -300.0 * sign + rng.normal(size=(2, 2)), 3)
    return [
        case([0.5, 1.0, -0.2], [2.0, 3.5, 0.1], "part b has the larger max"),
        case([4.0, 1.0, 0.0, 2.5], [1.0, 1.0, -3.0, 0.5], "part a has the larger max (row 1 ties)"),
        Case(empty + part([1.2, -0.4], d), label="part a is empty in row 0 (m = -inf, l = 0)"),
        case([1000.0, 998.5], [1002.0, 1000.5], "maxima around 1000"),
        case(mixed, mixed + rng.normal(size=(2, 3)), "leading dims (2, 3)", size=3),
        Case(tuple(a.astype(np.float32)
                   for a in part([0.5, 2.0], d) + part([1.5, -1.0], d)), label="float32"),
        Case((m_a, l_a, o_a, m_b, l_b, o_b),
             label="part b is empty in rows 0 and 2; maxima thousands apart, both signs"),
        Case(tuple(a.astype(np.float32) for a in f32),
             label="float32, leading dims (2, 2), maxima near +300 and -300"),
    ]


@learner_check
def check_merge(fn):
    """Check exercise 3.2, ``merge(m_a, l_a, o_a, m_b, l_b, o_b) -> (m, l, o)`` with normalised
    outputs ``o``; return the function to continue with."""
    return check_function("Exercise 3.2", fn, reference=softmax.merge_states_with_output,
                          cases=_merge_cases(), mistakes=MERGE_MISTAKES)


# ----------------------------------------------------------------------------------------------
# Exercise 3.3: online_softmax(x, block_size), the whole row tile by tile
# ----------------------------------------------------------------------------------------------

def _skeleton_softmax(x, block_size, *, rescale=True, sign=1.0, tile_ref="running",
                      every_tile=True, slice_short=False, guard_tile=True, guard_row=True,
                      normalise_at_end=True, accumulate=True, row_max=True):
    """The notebook's answer to 3.3, line for line (float64 state, the guards of the hints),
    with one knob turned the wrong way: what a learner who followed the skeleton computes with
    that one mistake, on every case (including masked rows and ragged tiles).

    ``tile_ref``: what the tile is exponentiated against, "running" (m_new), "own" (the tile's own
    max) or "old" (m before the tile); ``sign=-1``: the correction exp(m_new - m);
    ``every_tile=False``: range(N // block_size) tiles; ``slice_short``: tiles
    ``start:start + block_size - 1``; ``accumulate=False``: l replaced by each tile's sum;
    ``row_max=False``: one max over the whole tile (np.max without axis)."""
    m = np.full(x.shape[:-1], -np.inf)  # (...,)
    l = np.zeros(x.shape[:-1])  # (...,)
    out = np.zeros(x.shape)
    n = x.shape[-1] if every_tile else x.shape[-1] // block_size * block_size
    with np.errstate(all="ignore"):
        for start in range(0, n, block_size):
            tile = x[..., start:start + block_size - (1 if slice_short else 0)]  # (..., B)
            tile_max = tile.max(axis=-1) if row_max else np.full(m.shape, tile.max())
            m_new = np.maximum(m, tile_max)
            shift = np.where(np.isfinite(m_new), m_new, 0.0) if guard_tile else m_new
            ref = {"running": shift, "own": tile_max,
                   "old": np.where(np.isfinite(m), m, 0.0) if guard_tile else m}[tile_ref]
            tile_sum = np.exp(tile - ref[..., None]).sum(axis=-1)
            if not accumulate:
                l = tile_sum
            elif rescale:
                l = l * np.exp(sign * (m - shift)) + tile_sum
            else:
                l = l + tile_sum
            m = m_new
            if not normalise_at_end:  # this tile's weights, with the max and sum so far
                out[..., start:start + tile.shape[-1]] = np.exp(tile - m[..., None]) / l[..., None]
        if not normalise_at_end:
            return out.astype(x.dtype)
        p = np.exp(x - np.where(np.isfinite(m), m, 0.0)[..., None])  # (..., N)
        if guard_row:
            p = np.divide(p, l[..., None], out=np.zeros_like(p), where=l[..., None] > 0)
        else:
            p = p / l[..., None]
    return p.astype(x.dtype)


def _skeleton(**knobs):
    def wrong(x, block_size):
        return _skeleton_softmax(x, block_size, **knobs)
    return wrong


def _textbook_softmax(x, block_size):
    """No max anywhere: ``exp(x) / sum(exp(x))``, whatever the tiles (in x's dtype)."""
    with np.errstate(all="ignore"):
        return softmax.naive_softmax(x)


ALL_MASKED_ROW_NAN = ("a row of all -inf (a query that sees no key) gives NaN: its l is 0, and "
                      "0/0 = NaN. Return zeros where l = 0, as the library does")
MASKED_FIRST_TILE_NAN = ("a tile of all -inf while the running max is still -inf gives "
                         "exp(-inf - (-inf)) = exp(NaN), and the row's l stays NaN: subtract 0 "
                         "instead of m while m is -inf (only the empty state has m = -inf)")

ONLINE_SOFTMAX_MISTAKES = {
    ALL_MASKED_ROW_NAN: _skeleton(guard_row=False),
    MASKED_FIRST_TILE_NAN: _skeleton(guard_tile=False, guard_row=False),
    MASKED_FIRST_TILE_NAN + " (then a guard `where l > 0` turned the NaN row into zeros)":
        _skeleton(guard_tile=False),
    NO_RESCALE: _skeleton(rescale=False),
    NO_MAX + " (this is the textbook exp(x) / sum(exp(x)))": _textbook_softmax,
    WRONG_SIGN: _skeleton(sign=-1.0),
    "each tile is exponentiated relative to its own max; use the running max m_new, the same "
    "reference as the rescaled old sum": _skeleton(tile_ref="own"),
    "each tile is exponentiated relative to the max before it (the old m); use the new running "
    "max m_new": _skeleton(tile_ref="old"),
    "the short last tile is dropped (range(N // block_size)): loop over range(0, N, block_size) "
    "so the statistics see every score": _skeleton(every_tile=False),
    "each tile misses its last score (x[..., start:start + block_size - 1]): a slice's end is "
    "already excluded, so take x[..., start:start + block_size]": _skeleton(slice_short=True),
    "the running sum is replaced by each tile's sum (l = Σ exp(tile - m_new)): add the tile's "
    "sum to the rescaled old l": _skeleton(accumulate=False),
    "the tile's max is taken over the whole tile (tile.max() without axis): each row needs its "
    "own, tile.max(axis=-1)": _skeleton(row_max=False),
    "the weights are written during the first pass, with the max and sum of the tiles seen so "
    "far: normalise after the last tile, with the final m and l": _skeleton(normalise_at_end=False),
}
ONLINE_SOFTMAX_MISTAKES = {cause: _quiet(model) for cause, model in ONLINE_SOFTMAX_MISTAKES.items()}


def _online_softmax_cases() -> list[Case]:
    rng = np.random.default_rng(305)
    masked = rng.normal(size=(4, 10))  # (rows, N) in tiles of 3: 3 + 3 + 3 + 1
    masked[0, [1, 4, 9]] = -np.inf  # some scores masked
    masked[1] = -np.inf  # a query that sees no key
    masked[2, :4] = -np.inf  # the first tile all -inf, later ones not
    masked[3] = np.linspace(-3.0, 6.0, 10)  # the max grows in every tile
    # rows near +1000 and -1000 by turns (float32: beyond exp's range either way)
    signs = np.where(np.arange(4) % 2 == 0, 1.0, -1.0)[:, None]
    far32 = (1000.0 * signs + 3.0 * rng.normal(size=(4, 13))).astype(np.float32)
    # one tile exactly the row's width; rows near ±1000, one row all -inf, one partly masked
    exact = 1000.0 * np.array([1.0, -1.0])[:, None] + 4.0 * rng.normal(size=(2, 2, 12))
    exact[1, 0] = -np.inf
    exact[0, 1, 5:] = -np.inf
    # a strided view (every other column), scores of both signs in the hundreds and thousands
    wide = 300.0 * rng.normal(size=(5, 34))
    wide[:, ::2] += 1500.0 * np.array([1.0, -1.0, 0.2, -0.6, 1.0])[:, None]
    return [
        Case((4.0 * rng.normal(size=(3, 37)), 5), label="N = 37 in tiles of 5 (the last has 2)"),
        Case((rng.normal(size=(2, 3, 11)), 4), label="leading dims (2, 3), N = 11, tiles of 4"),
        Case((far32, 6), label="float32 scores near +1000 and -1000, N = 13, tiles of 6"),
        Case((masked, 3), label="masked scores: a row of all -inf, a row whose first tile is -inf"),
        Case((rng.normal(size=(2, 7)), 16), label="one tile, wider than the row"),
        Case((rng.normal(size=(3, 6)), 1), label="tiles of one score"),
        Case((exact, 12), label="leading dims (2, 2), one tile of exactly N = 12, rows near ±1000, "
                                "a row of all -inf"),
        Case((wide[:, ::2], 5), label="a strided view, N = 17 in tiles of 5, rows near ±1500"),
    ]


SOFTMAX_HINTS = [
    "Two passes. The first walks over the tiles <code>x[..., start:start + block_size]</code> for "
    "<code>start</code> in <code>range(0, N, block_size)</code> (the last tile may be shorter) and "
    "keeps only <code>m</code> and <code>l</code> per row; the second writes the weights.",
    "Start from the empty state, <code>m = -inf</code>, <code>l = 0</code>, one per row (shape "
    "<code>x.shape[:-1]</code>).",
    "Each tile: <code>m_new = max(m, max(tile))</code>, <code>l = l·exp(m - m_new) + "
    "Σ exp(tile - m_new)</code>, then <code>m = m_new</code> (exercise 3.1's update).",
    "Masked scores: while a row has seen only -inf, <code>m_new</code> is -inf and "
    "<code>tile - m_new</code> is NaN. Subtract <code>where(isfinite(m_new), m_new, 0)</code> "
    "instead.",
    "After the last tile: <code>exp(x - m) / l</code> (with the same guard on <code>m</code>), "
    "zeros where <code>l = 0</code>, in <code>x</code>'s dtype.",
]

SOFTMAX_SKELETON = '''\
m = ...                                        # (...,) -inf: the empty state
l = ...                                        # (...,) 0
for start in range(0, x.shape[-1], block_size):
    tile = x[..., start:start + block_size]    # (..., B), the last may be shorter
    m_new = ...
    shift = ...                                # m_new, or 0 where it is still -inf
    l = ...                                    # rescale the old sum, add the tile's
    m = m_new
p = ...                                        # exp(x - m), guarded like shift
return ...                                     # p / l, zeros where l = 0, x's dtype'''


@learner_check
def check_online_softmax(fn):
    """Check exercise 3.3, ``online_softmax(x, block_size) -> weights`` over the last axis, tile
    by tile; return the function to continue with (the library's when not done yet)."""
    return check_function("Exercise 3.3", fn, reference=softmax.online_softmax,
                          cases=_online_softmax_cases(), mistakes=ONLINE_SOFTMAX_MISTAKES)

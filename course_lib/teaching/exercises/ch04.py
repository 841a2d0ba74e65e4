"""Checks for chapter 04 (tiled attention in NumPy).

* Exercise 4.1 — the inner loop of the FA2 forward (the online-softmax update of one tile) and
  its epilogue: ``fa2_forward(q, k, v, causal=False, scale=None, block_m=..., block_n=...)``
  returning ``(o, lse)``, checked against :func:`course_lib.attention.tiled.flash_attention_numpy`.
* Exercise 4.2 — the causal tile-skip condition: ``causal_skip_grid(n_q, n_k, block_m, block_n)``
  returning a boolean ``(T_r, T_c)`` grid, checked against :func:`course_lib.attention.iomodel.causal_skip_grid`.
* Exercise 4.3 — why FA2's loop order moves less data than FA1's, answered by code:
  ``olm_traffic(n, d, block_m, block_n)`` returning the ``(fa1, fa2)`` elements of ``o``, ``l``,
  ``m`` and ``lse`` moved through HBM, checked against :func:`course_lib.attention.iomodel.output_traffic`.

* Exercise 4.4 — the whole FA2 forward from its signature: ``flash_forward(q, k, v, causal,
  scale, block_m, block_n) -> (o, lse)``, both loops, tile loads, online softmax, epilogue and
  the causal tile skip, checked against :func:`course_lib.attention.tiled.flash_attention_numpy`.
* Exercise 4.5 — the same forward in FA1's loop order (outer K/V tiles, inner Q tiles, each Q
  tile's state kept in HBM arrays), checked against
  :func:`course_lib.attention.tiled.flash_attention_numpy_fa1`.
  Both whole-forward checks also count the elements the learner's function reads from q, k and
  v (:mod:`course_lib.teaching.read_watch`), so that a causal forward that loads the hidden tiles
  and masks them (right numbers, wasted work) is caught; a wrong answer's diagnosis adds the first bad query row
  and its Q tile. Hint ladders and skeletons: ``FA2_HINTS``/``FA2_SKELETON``,
  ``FA1_HINTS``/``FA1_SKELETON``.

Cases use ragged sizes (N not a multiple of the tile sizes), N_q ≠ N_k, leading dims and
causal masks, so that each classic mistake changes the answer. The mistake models are public
(``FORWARD_MISTAKES``, ``SKIP_MISTAKES``, ``TRAFFIC_MISTAKES``,
``WHOLE_FORWARD_MISTAKES``, ``FA1_MISTAKES``) so tests and instructors can see
what is recognised; when a wrong answer equals one of them, the check names the cause.
"""

from __future__ import annotations

import numpy as np

from course_lib.teaching.checks import learner_check
from course_lib.teaching import checks, grade_channel
from course_lib.attention import iomodel, tiled
from course_lib.teaching.checks import Case, check_function
from course_lib.attention.softmax import correction_factor
# the read watcher is check machinery (chapter 07 uses it too); here under the names this file used
from course_lib.teaching.read_watch import LoadLog as _LoadLog, line_text as _line_text
from course_lib.teaching.read_watch import missing_loads, plain as _plain, watch as _watch, watched_call

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

    def __init__(self, causal: bool, *, sees_next_key: bool = False, mask_padding: bool = True,
                 skip: bool = False):
        self.base = tiled.CAUSAL if causal else tiled.DENSE
        self.skip = skip  # skip the tiles the right causal mask skips (exercises 4.4, 4.5)
        self.shift = 1 if sees_next_key else 0  # query i treated as query i + 1
        self.mask_padding = mask_padding

    def visible(self, q_idx, k_idx):
        return self.base.visible(q_idx + self.shift, k_idx)

    def tile_classes(self, n_q, n_k, block_m, block_n):
        if self.skip:
            right = self.base.tile_classes(n_q, n_k, block_m, block_n)  # (T_r, T_c)
            return np.where(right == tiled.SKIP, tiled.SKIP, tiled.PARTIAL)
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
                     finish=tiled.finish_tile, wrong_scale=None,
                     forward=tiled.flash_attention_numpy):
    """A model of a wrong answer: the library's loop (``forward``: FA2 order, or FA1 order for
    exercise 4.5) with the given parts swapped.

    ``rule(causal)`` builds the mistaken mask; ``wrong_scale(d, scale)`` the mistaken scale from
    the head dim and the scale argument.
    """
    def wrong(q, k, v, causal=False, scale=None, block_m=tiled.DEFAULT_BLOCK_M,
              block_n=tiled.DEFAULT_BLOCK_N):
        if wrong_scale is not None:
            scale = wrong_scale(q.shape[-1], scale)
        mask = {"causal": causal} if rule is None else {"rule": rule(causal)}
        return forward(q, k, v, scale=scale, block_m=block_m, block_n=block_n, step=step,
                       finish=finish, **mask)
    wrong.__name__ = f"{forward.__name__}_{name}"
    return wrong


class _SkipOnly(tiled.TileRule):
    """Every key visible, but the tiles the causal mask hides skipped (``skip``) or not."""

    def __init__(self, skip: bool):
        self.skip = skip

    def visible(self, q_idx, k_idx):
        return np.ones(np.broadcast_shapes(np.shape(q_idx), np.shape(k_idx)), dtype=bool)

    def tile_classes(self, n_q, n_k, block_m, block_n):
        classes = tiled.CAUSAL.tile_classes(n_q, n_k, block_m, block_n)
        return np.where((classes == tiled.SKIP) & self.skip, tiled.SKIP, tiled.PARTIAL)


def _mask_after_softmax(skip: bool):
    """The causal mask applied after the statistics: m and l count every key of every tile the
    loop computes (all tiles, or with ``skip`` the tiles left of the diagonal), the weights only
    the visible keys — the right causal output reweighted by ``exp(lse_causal - lse_computed)``."""
    def wrong(q, k, v, causal=False, scale=None, block_m=tiled.DEFAULT_BLOCK_M,
              block_n=tiled.DEFAULT_BLOCK_N):
        o, lse = tiled.flash_attention_numpy(q, k, v, causal, scale, block_m, block_n)
        if not causal:
            return o, lse
        _, lse_all = tiled.flash_attention_numpy(q, k, v, False, scale, block_m, block_n,
                                                 rule=_SkipOnly(skip))
        return (o * np.exp(lse - lse_all)[..., None]).astype(o.dtype), lse_all
    wrong.__name__ = f"flash_attention_numpy_mask_after_softmax{'_skipping' if skip else ''}"
    return wrong


_fa2_forward_mask_after_softmax = _mask_after_softmax(skip=False)


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
    "the scale is 1/d instead of 1/sqrt(d), and the scale argument is ignored":
        _forward_mistake("scale_1_over_d", wrong_scale=lambda d, scale: 1.0 / d),
    "the scale argument is ignored: scores are always scaled by 1/sqrt(d) (use the scale "
    "given, 1/sqrt(d) only when it is None)":
        _forward_mistake("scale_ignored", wrong_scale=lambda d, scale: d ** -0.5),
    "lse is log(l) without adding back the running max m (lse = m + log l)":
        _forward_mistake("lse_without_max", finish=_finish_lse_without_max),
}


def _forward_cases(seed: int = 4):
    """Exercise 4.1's cases (see _CASE_SPECS)."""
    return _cases("4.1", seed)


def _reference_forward(q, k, v, causal=False, scale=None, block_m=tiled.DEFAULT_BLOCK_M,
                       block_n=tiled.DEFAULT_BLOCK_N):
    return tiled.flash_attention_numpy(q, k, v, causal, scale, block_m, block_n)


@learner_check
def check_fa2_forward(fn):
    """Exercise 4.1: check ``fa2_forward(q, k, v, causal, scale, block_m, block_n) -> (o, lse)``.

    Returns the learner's function when right, the library's when not done yet.
    """
    return check_function("Exercise 4.1", fn, _reference_forward, _forward_cases(),
                          fallback=tiled.flash_attention_numpy, mistakes=FORWARD_MISTAKES,
                          output_names=("o", "lse"))


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


@learner_check
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


@learner_check
def check_olm_traffic(fn):
    """Exercise 4.3: check ``olm_traffic(n, d, block_m, block_n) -> (fa1, fa2)``."""
    return check_function("Exercise 4.3", fn, olm_traffic, _traffic_cases(), tolerance=_EXACT,
                          mistakes=TRAFFIC_MISTAKES)


# ----------------------------------------------------------------------------------------------
# Exercises 4.4 and 4.5: the whole forward, FA2 order and FA1 order
# ----------------------------------------------------------------------------------------------

# These checks look at two things: the numbers (o and lse on irregular cases, as exercise 4.1)
# and the work. A causal forward that computes the tiles right of the diagonal and masks them
# gets the right numbers; only its loads show the missing skip. So q, k and v reach the learner's
# function as Watched arrays (course_lib.teaching.read_watch): each records, in order and with the
# learner's line, which of its elements the function loads (LOAD_RULES says what counts), and
# _judge_loads compares that record with what the algorithm needs.

LOAD_RULES = """\
What the checks of exercises 4.4 and 4.5 count as a load of q, k or v:
* An operation that copies the values or computes with them loads every element it touches,
  once: tiled.load_tile(x, ...), a slice x[..., a:b, :] assigned into another array or used in
  arithmetic, x.copy(), np.copy(x), np.array(x), np.asarray(x), np.ascontiguousarray(x),
  x.astype(...), x * scale, x @ y, np.einsum, sums and maxima, fancy indexing x[..., [0, 2], :].
* So an operation on a whole input loads all of it: k.astype(np.float64) loads every K/V tile,
  the hidden ones too.
* A slice x[..., a:b, :] (and its .T, swapaxes, reshape) is a view: it loads nothing until its
  values are used. Once used, it holds them, like a tile in SRAM: using the same slice again
  loads nothing more (a new slice of the same rows loads them again).
* The result of an element-wise operation on an input (q * scale, q.astype(...), q.copy()) is
  your own copy: using it is not another load of q, but the check still sees which of its rows
  you use. np.asarray(x) and np.array(x) hand you a plain array: what you do with it is not seen.
* Shapes, dtype, ndim, size, len(), np.empty_like / zeros_like / ones_like / full_like, and
  printing load nothing.
The loop is "on" the Q tile whose rows of q (or of your copy of q) it used last (FA2 order), on
the K/V tile whose rows of k or v it used last (FA1 order).
"""


_QKV = ("q", "k", "v")


def _tiles(rows: np.ndarray, block: int) -> list[int]:
    return sorted({int(r) // block for r in rows})


def _span(tile: int, block: int, n: int) -> str:
    first, last = tile * block, min((tile + 1) * block, n) - 1
    return f"{first}–{last}" if last > first else f"{first}"


def _judge_loads(log: _LoadLog, case: Case, order: str) -> list[str]:
    """What the learner's loads on ``case`` did that the algorithm does not: [] when nothing.

    ``order`` "fa2": one program per Q tile (the outer loop); it loads its Q tile once and each
    K/V tile it sees once. "fa1": one K/V tile at a time (the outer loop); each K/V tile that a
    query sees is loaded once, and each Q tile once per K/V tile it sees. In a causal run no
    operation may use a K/V tile that no query sees, nor (while the loop is on one tile) a tile
    hidden from it. Then no element may be loaded more often than the algorithm loads it.
    """
    q = case.args[0]
    n_q, n_k = q.shape[-2], case.args[1].shape[-2]
    bm, bn = case.kwargs["block_m"], case.kwargs["block_n"]
    causal = bool(case.kwargs.get("causal"))
    t_r, t_c = iomodel.num_blocks(n_q, bm), iomodel.num_blocks(n_k, bn)
    skip = (iomodel.causal_skip_grid(n_q, n_k, bm, bn) if causal
            else np.zeros((t_r, t_c), dtype=bool))  # (T_r, T_c)
    seen_by_some = (~skip).any(axis=0)  # (T_c,)
    q_tile_txt = lambda i: f"Q tile {i} (queries {_span(i, bm, n_q)})"  # noqa: E731
    kv_tile_txt = lambda j: f"K/V tile {j} (keys {_span(j, bn, n_k)})"  # noqa: E731
    fix_fa2 = ("stop the K/V loop at the first tile whose first key k_start is after the Q "
               "tile's last real query min(q_start + BLOCK_M, N_q) - 1, before loading it")
    fix_fa1 = ("skip a (K/V tile, Q tile) pair whose k_start is after the Q tile's last real "
               "query min(q_start + BLOCK_M, N_q) - 1, before loading the Q tile")
    on_tiles = None  # the tiles of the outer loop's input the function used last
    for touch in log.touches:
        line = _line_text(touch.where)
        if touch.name == "q":
            tiles = _tiles(touch.rows, bm)
            if order == "fa2":
                on_tiles = tiles
                continue
            if causal and on_tiles is not None and len(on_tiles) == 1:
                j = on_tiles[0]
                hidden = [i for i in tiles if skip[i, j]]
                if hidden:
                    return [f"  hidden tile used: while your loop was on {kv_tile_txt(j)}, "
                            f"{line} used rows of q in {q_tile_txt(hidden[0])}, which does not "
                            f"see that K/V tile (its first key {j * bn} comes after the Q "
                            f"tile's last query {min((hidden[0] + 1) * bm, n_q) - 1})",
                            f"  what to change: {fix_fa1}"]
            continue
        tiles = _tiles(touch.rows, bn)
        unseen = [j for j in tiles if not seen_by_some[j]]
        if causal and unseen:
            j = unseen[0]
            how = (f" — it uses the whole of {touch.name}, so it loads every K/V tile, the "
                   f"hidden ones too; load K/V tiles one at a time, inside the loop"
                   if touch.whole else "")
            fix = fix_fa2 if order == "fa2" else (
                "stop the outer loop once k_start >= N_q: no query sees those keys")
            return [f"  hidden tile loaded: {line} used {touch.name} in {kv_tile_txt(j)}, "
                    f"which no query sees (its first key {j * bn} comes after the last query, "
                    f"N_q - 1 = {n_q - 1}){how}",
                    *([] if touch.whole else [f"  what to change: {fix}"])]
        if order == "fa1":
            on_tiles = tiles
            continue
        if causal and on_tiles is not None and len(on_tiles) == 1:
            i = on_tiles[0]
            hidden = [j for j in tiles if skip[i, j]]
            if hidden:
                j = hidden[0]
                return [f"  hidden tile loaded: while your loop was on {q_tile_txt(i)} (the "
                        f"rows of q it used last), {line} used {touch.name} in "
                        f"{kv_tile_txt(j)}, which that Q tile does not see (its first key "
                        f"{j * bn} comes after the Q tile's last query "
                        f"{min((i + 1) * bm, n_q) - 1})",
                        f"  what to change: {fix_fa2}"]
    # no hidden tile: now the number of loads of each element
    sees = (~skip).sum(axis=0)  # (T_c,) Q tiles that see each K/V tile
    budget = {"fa2": {"q": lambda i: 1, "k": lambda j: sees[j]},
              "fa1": {"q": lambda i: (~skip[i]).sum(), "k": lambda j: 1}}[order]
    for name in _QKV:
        block, n = (bm, n_q) if name == "q" else (bn, n_k)
        per_row = log.loads_per_row(name)  # (N,)
        rule = budget["q" if name == "q" else "k"]
        for t in range(iomodel.num_blocks(n, block)):
            got = int(per_row[t * block:(t + 1) * block].max())
            want = int(rule(t))
            if got <= want:
                continue
            tile = q_tile_txt(t) if name == "q" else kv_tile_txt(t)
            lines = sorted({touch.where for touch in log.touches if touch.name == name
                            and touch.loaded and t in _tiles(touch.rows, block)},
                           key=lambda w: (w is None, w))
            if order == "fa2" and name == "q":
                need = ("FA2 loads each Q tile once, before its K/V loop (keep it in a "
                        "variable, or use the same slice, for the whole inner loop)")
            elif order == "fa2":
                need = (f"FA2 loads it {want} time{'s' if want != 1 else ''}, once for each "
                        f"Q tile that sees it")
                blind = [i for i in range(t_r) if skip[i, t]]
                if blind:
                    need += (f"; Q tile{'s' if len(blind) > 1 else ''} "
                             f"{', '.join(map(str, blind))} do{'es' if len(blind) == 1 else ''} "
                             f"not see it, so must not load it")
            elif name == "q":
                need = (f"FA1 loads it {want} time{'s' if want != 1 else ''}, once for each "
                        f"K/V tile it sees")
            else:
                need = ("FA1 loads each K/V tile once, in its outer loop (keep it in a "
                        "variable for the whole inner loop)")
            return [f"  too many loads: the elements of {name} in {tile} were loaded "
                    f"{got} times; {need}",
                    f"  loaded at {', '.join(_line_text(w) for w in lines[:3])}"
                    + (" (a whole-array operation loads all of the array, a new slice whose "
                       "values are used loads its rows again: see ch04.LOAD_RULES)")]
    return []


NO_SKIP = ("the tiles right of the causal diagonal are loaded, then masked away: right numbers, "
           "wasted work")
RAGGED_Q_DROPPED = ("the ragged last Q tile is dropped: only the rows past the last full tile "
                    "are wrong, on every case. Loop over num_blocks(N_q, BLOCK_M) = "
                    "ceil(N_q / BLOCK_M) tiles and store its `rows` real rows")


def _bad_rows(got, want, n_q: int) -> dict | None:
    """{"o": (N_q,) bool, "lse": (N_q,) bool}: the query rows wrong in each output (for any
    leading index); None when ``got`` cannot be compared row by row."""
    if not (isinstance(got, (tuple, list)) and len(got) == 2):
        return None
    atol, rtol = checks.TOLERANCES[str(want[0].dtype)]
    bad = {}
    for name, g, w in (("o", got[0], want[0]), ("lse", got[1], want[1])):
        try:
            g, w = checks.to_numpy64(g), checks.to_numpy64(w)
        except (TypeError, ValueError):
            return None
        if g.shape != w.shape:
            return None
        wrong = ~np.isclose(g, w, atol=atol, rtol=rtol) | (np.isnan(g) & ~np.isnan(w))
        if name == "o":
            wrong = wrong.any(axis=-1)
        bad[name] = wrong.reshape(-1, n_q).any(axis=0)
    return bad


def _row_diagnosis(got, want, case: Case) -> str:
    """Where the wrong rows of one case are: first bad query row, its Q tile, how many."""
    n_q, block_m = case.args[0].shape[-2], case.kwargs["block_m"]
    bad_rows = _bad_rows(got, want, n_q)
    if bad_rows is None:
        return ""  # the check's own message says what is wrong with the output
    bad = bad_rows["o"] | bad_rows["lse"]  # (N_q,)
    if not bad.any():
        return ""
    row = int(np.argmax(bad))
    where = " and ".join(name for name, rows in bad_rows.items() if rows[row])
    tile = row // block_m
    return (f"  first bad query row: {row} (wrong in {where}), in Q tile {tile} = rows "
            f"{_span(tile, block_m, n_q)} of N_q={n_q}; {int(bad.sum())} of {n_q} rows are wrong")


def _only_ragged_rows_wrong(outputs, cases, library) -> bool:
    """True when, on every case, exactly the rows of the ragged last Q tile are wrong (and the
    cases without a ragged Q tile are right): the evidence of a dropped last tile."""
    seen_ragged = False
    for got, case in zip(outputs, cases):
        n_q, block_m = case.args[0].shape[-2], case.kwargs["block_m"]
        bad_rows = _bad_rows(got, library(*case.args, **case.kwargs), n_q)
        if bad_rows is None:
            return False
        bad = bad_rows["o"] | bad_rows["lse"]
        ragged = n_q % block_m
        expected = np.zeros(n_q, dtype=bool)
        if ragged:
            expected[n_q - ragged:] = True
            seen_ragged = True
        if not np.array_equal(bad, expected):
            return False
    return seen_ragged


def _check_whole_forward(exercise, fn, library, cases, mistakes, order):
    """Check a whole tiled forward ``fn(q, k, v, causal, scale, block_m, block_n) -> (o, lse)``:
    its numbers on every case, then its loads of q, k, v on every case (:func:`_judge_loads`,
    in loop order ``order``: "fa2" or "fa1"). Returns ``fn`` on a pass, ``library`` when not
    done yet."""
    calls = []  # per call of fn, in order: [load log, output]; call n is case n
    output = checks.CapturedOutput()

    def watched_fn(q, k, v, **kwargs):
        calls.append([None, None])
        out, record = grade_channel.run_with(fn, watched_call, _QKV, q, k, v, **kwargs)
        calls[-1] = [_LoadLog.from_data(record, {n: x.shape for n, x in zip(_QKV, (q, k, v))}), out]
        return out

    def reference(q, k, v, **kwargs):
        return library(q, k, v, **kwargs)

    try:
        result = check_function(exercise, watched_fn, reference, cases, fallback=library,
                                mistakes=mistakes, quiet=True, output=output,
                                output_names=("o", "lse"))
    except checks.ExerciseFailed as failure:
        lines = str(failure).split("\n")
        head = lines[0]
        if "wrong answer on case" not in head:
            raise
        n = int(head.split("wrong answer on case ")[1].split()[0])
        case = cases[n - 1]
        extra = [_row_diagnosis(calls[n - 1][1], reference(*case.args, **case.kwargs), case)]
        named = any(text.startswith(("  likely cause:", "  two known mistakes")) for text in lines)
        outputs = [out for _, out in calls[:len(cases)]]
        if not named and len(outputs) == len(cases) \
                and _only_ragged_rows_wrong(outputs, cases, reference):
            extra.append(f"  likely cause: {RAGGED_Q_DROPPED}")
        at = next((i for i, text in enumerate(lines)
                   if text.startswith(("  likely cause:", "  two known mistakes", "  evidence:",
                                       "  (also wrong", "  your function printed"))), len(lines))
        message = "\n".join(lines[:at] + [e for e in extra if e] + lines[at:])
        raise checks.failed_with(exercise, message) from None
    if result is not watched_fn:  # not done yet (on some case): let the check say so
        def not_done(*args, **kwargs):
            raise NotImplementedError(exercise)
        return check_function(exercise, not_done, reference, cases[:1], fallback=library,
                              output=output)
    for n, (case, (log, _)) in enumerate(zip(cases, calls), 1):
        problem = _judge_loads(log, case, order) or missing_loads(
            log, case.args[0].shape[-2], bool(case.kwargs.get("causal")))
        if problem:
            raise checks.failed_with(exercise, "\n".join(
                [f"✗ {exercise}: right numbers, wrong loads on case {n} of {len(cases)}",
                 f"  inputs: {case.describe()}", *problem, *output.excerpt()]))
    checks.passed(exercise, "\n".join([
        f"✓ {exercise}: passed ({len(cases)} cases; no hidden tile loaded, no tile loaded more "
        f"often than the algorithm needs).", *output.excerpt()]))
    return fn


def _array(rng, lead: tuple, n: int, d: int, layout: str, spread: float, dtype) -> np.ndarray:
    """A ``lead + (n, d)`` array of ``spread``·N(0, 1) values in one of these memory layouts:
    "contiguous"; "heads" (allocated (B, n, H, d), handed over as (B, H, n, d): interleaved
    heads); "columns" (every other column of a (..., n, 2d) array: column stride 2);
    "transposed" (allocated (..., d, n))."""
    if layout == "heads":
        b, h = lead
        x = np.swapaxes(rng.standard_normal((b, n, h, d)), 1, 2)
    elif layout == "columns":
        x = rng.standard_normal(lead + (n, 2 * d))[..., ::2]
    elif layout == "transposed":
        x = np.swapaxes(rng.standard_normal(lead + (d, n)), -1, -2)
    else:
        x = rng.standard_normal(lead + (n, d))
    return (spread * x).astype(dtype, copy=False)


# (leading dims, N_q, N_k, d, d_v, BLOCK_M, BLOCK_N, causal, scale, spread, dtype, layouts of
# q, k, v). All ragged and BLOCK_M != BLOCK_N; N_q < N_k and N_q > N_k; d_v != d; an explicit
# scale; non-contiguous inputs (interleaved heads, column stride 2, transposed), each tensor its
# own; logits of several hundred (spread 12: scale·q·k has a standard deviation of 144), in
# float32 too. In the causal cases with N_q < N_k a K/V tile starts between the last query and
# the end of the last (padded) Q tile, so that the ragged skip bound decides whether it is loaded.
_CASE_SPECS = {
    "4.1": [((), 37, 45, 8, 5, 16, 8, False, None, 1.0, np.float64, ("contiguous",) * 3),
            ((2,), 29, 40, 6, 4, 8, 6, True, 0.3, 1.0, np.float64,
             ("columns", "transposed", "contiguous")),
            ((2, 3), 45, 45, 5, 7, 16, 8, True, None, 12.0, np.float64,
             ("heads", "contiguous", "columns")),
            ((3,), 50, 23, 6, 3, 12, 8, True, 0.25, 10.0, np.float32,
             ("contiguous", "columns", "transposed"))],
    "whole": [((2,), 37, 45, 8, 5, 16, 8, False, None, 1.0, np.float64,
               ("contiguous", "columns", "transposed")),
              ((2,), 29, 40, 6, 4, 8, 6, True, 0.3, 1.0, np.float64,
               ("columns", "transposed", "contiguous")),
              ((2, 3), 45, 45, 5, 7, 16, 8, True, None, 12.0, np.float64,
               ("heads", "contiguous", "columns")),
              ((3,), 50, 23, 6, 3, 12, 8, True, 0.25, 10.0, np.float32,
               ("contiguous", "columns", "transposed")),
              ((), 22, 33, 3, 2, 4, 11, True, None, 1.0, np.float64,
               ("transposed", "contiguous", "columns"))],
}


def _cases(which: str, seed: int) -> list[Case]:
    rng = np.random.default_rng(seed)
    cases = []
    for lead, n_q, n_k, d, d_v, bm, bn, causal, scale, spread, dtype, layouts in _CASE_SPECS[which]:
        q, k, v = (_array(rng, lead, n, width, layout, spread, dtype)
                   for n, width, layout in zip((n_q, n_k, n_k), (d, d, d_v), layouts))
        kwargs = {"causal": causal, "block_m": bm, "block_n": bn}
        if scale is not None:
            kwargs["scale"] = scale
        shown = [name for name, layout in zip(_QKV, layouts) if layout != "contiguous"]
        cases.append(Case((q, k, v), kwargs, label=(
            f"{np.dtype(dtype).name}, N_q={n_q}, N_k={n_k}, d={d}, d_v={d_v}, BLOCK_M={bm}, "
            f"BLOCK_N={bn}, causal={causal}, scale={'1/sqrt(d)' if scale is None else scale}"
            + (", logits of several hundred" if spread > 1 else "")
            + (f", non-contiguous {', '.join(shown)}" if shown else ""))))
    return cases


def _whole_cases():
    """The cases of exercises 4.4 and 4.5 (see _CASE_SPECS), and one whose query row
    UNDERFLOW_ROW sees only scores below UNDERFLOW_SCORE (:func:`_underflow_case`)."""
    return _cases("whole", 44) + [_underflow_case(np.random.default_rng(45))]


# exp(s) underflows to 0 in float64 below about -745: a running max started at 0 instead of -inf
# gives every key of a row whose scores are all below this a weight exp(s - 0) = 0, so l = 0 and
# the row is 0/0. The contract allows such rows (any finite q, k); a right answer subtracts the
# row's own max.
UNDERFLOW_SCORE = -750.0
UNDERFLOW_ROW = 5


def _underflow_case(rng) -> Case:
    """Causal, N_q=20, N_k=27, d=4, d_v=3, BLOCK_M=8, BLOCK_N=6: q row UNDERFLOW_ROW points away
    from every key (k's first column is 30–40, the row's is -60), so its scores lie between
    about -1200 and -900, all below UNDERFLOW_SCORE; the other rows are N(0, 1)."""
    n_q, n_k, d, d_v = 20, 27, 4, 3
    q, k, v = rng.standard_normal((n_q, d)), rng.standard_normal((n_k, d)), rng.standard_normal((n_k, d_v))
    k[:, 0] = rng.uniform(30.0, 40.0, n_k)
    q[UNDERFLOW_ROW] = 0.0
    q[UNDERFLOW_ROW, 0] = -60.0
    scores = q[UNDERFLOW_ROW] @ k[:UNDERFLOW_ROW + 1].T / np.sqrt(d)  # the keys the row sees
    assert scores.max() < UNDERFLOW_SCORE
    return Case((q, k, v), {"causal": True, "block_m": 8, "block_n": 6}, label=(
        f"float64, N_q={n_q}, N_k={n_k}, d={d}, d_v={d_v}, BLOCK_M=8, BLOCK_N=6, causal=True, "
        f"scale=1/sqrt(d), query row {UNDERFLOW_ROW}'s visible scores all below "
        f"{UNDERFLOW_SCORE:g}"), features={f"a row whose visible scores are all below "
                                          f"{UNDERFLOW_SCORE:g}": True})


def _step_state_reset(m_i, l_i, acc, s, v_tile):
    """Every K/V step starts from the empty state: only the last tile seen counts. Unguarded, as
    the exercise's update is written: a row whose scores in that tile are all masked is NaN."""
    return _step_unguarded(*tiled.empty_state(m_i.shape, acc.shape[-1], acc.dtype), s, v_tile)


def _step_divides_inside(m_i, l_i, acc, s, v_tile):
    """``acc`` normalised by ``l`` at every step, then used as if it were still a sum."""
    m_new, l_new, acc_new = tiled.online_softmax_step(m_i, l_i, acc, s, v_tile)
    return m_new, l_new, tiled.finish_tile(m_new, l_new, acc_new)[0]


def _step_reload_normalised(m_i, l_i, acc, s, v_tile):
    """FA1: the normalised ``o`` read back from HBM is folded in as if it were ``l·o``."""
    has_keys = (l_i > 0)[..., None]
    o_old = np.where(has_keys, acc / np.where(has_keys, l_i[..., None], 1), 0)
    return tiled.online_softmax_step(m_i, l_i, o_old, s, v_tile)


def _kv_tiles_counted_with_block_m(q, k, v, causal=False, scale=None,
                                   block_m=tiled.DEFAULT_BLOCK_M, block_n=tiled.DEFAULT_BLOCK_N):
    """The K/V loop runs num_blocks(N_k, BLOCK_M) times with tiles of BLOCK_N keys: when
    BLOCK_M > BLOCK_N the keys past that many tiles are never seen."""
    seen = min(k.shape[-2], iomodel.num_blocks(k.shape[-2], block_m) * block_n)
    return tiled.flash_attention_numpy(q, k[..., :seen, :], v[..., :seen, :], causal, scale,
                                       block_m, block_n)


def _cause(words: str) -> str:
    """The cause of exercise 4.1's mistakes that contains ``words`` (shared with 4.4 and 4.5)."""
    return next(cause for cause in FORWARD_MISTAKES if words in cause)


def _sees_next_key_skipping(causal):
    """The off-by-one causal mask, in a loop that skips the hidden tiles (4.4, 4.5)."""
    return _ExerciseMask(causal, sees_next_key=True, skip=True)


_CAUSAL_OFF_BY_ONE = _cause("off by one")


class _CausalRuleMistake(tiled.TileRule):
    """A learner's causal loop with one mistake in its mask or its skip test: ``strict`` hides
    the diagonal (``k_idx < q_idx``); ``skip_ge`` skips with ``k_start >= last query`` (one tile
    too many). Every computed tile is masked, as the exercise's loop masks it."""

    def __init__(self, causal: bool, *, strict: bool = False, skip_ge: bool = False,
                 skip: bool = True):
        self.causal, self.strict, self.skip_ge, self.skip = causal, strict, skip_ge, skip

    def visible(self, q_idx, k_idx):
        if not self.causal:
            return tiled.DENSE.visible(q_idx, k_idx)
        return k_idx < q_idx if self.strict else k_idx <= q_idx

    def tile_classes(self, n_q, n_k, block_m, block_n):
        if not self.causal:
            return tiled.DENSE.tile_classes(n_q, n_k, block_m, block_n)
        (_, r1), (c0, _) = tiled.tile_bounds(n_q, n_k, block_m, block_n)
        skip = (c0 >= r1) if self.skip_ge else (c0 > r1)
        return np.where(skip & self.skip, tiled.SKIP, tiled.PARTIAL)


def _step_unguarded(m_i, l_i, acc, s, v_tile):
    """The update as the exercise writes it, with no guard for a row whose scores are all -inf:
    ``exp(s - m_new)`` is (-inf) - (-inf) = NaN there, and the NaN spreads to l and acc."""
    with np.errstate(invalid="ignore"):
        m_new = np.maximum(m_i, s.max(axis=-1))
        alpha = np.exp(m_i - m_new)
        p = np.exp(s - m_new[..., None])
        return m_new, alpha * l_i + p.sum(axis=-1), alpha[..., None] * acc + p @ v_tile


def _finish_unguarded(m_i, l_i, acc):
    """``o = acc / l``, ``lse = m + log l`` with no guard (NaN in, NaN out)."""
    with np.errstate(invalid="ignore", divide="ignore"):
        return acc / l_i[..., None], m_i + np.log(l_i)


_SKIP_GE = ("the skip test is off by one: `k_start >= last query` skips a tile whose first key "
            "is exactly the Q tile's last query, which that query must see (use `>`)")
_DIAGONAL_HIDDEN = ("the causal mask hides the diagonal (`k_idx < q_idx`): query i must see "
                    "key i too (`k_idx <= q_idx`); query 0 then sees no key, and its row is "
                    "(-inf) - (-inf) = NaN")
_DEFAULT_SCALE_1_OVER_D = "the default scale is 1/d instead of 1/sqrt(d)"


def _causal_rule_mistake(name, forward=tiled.flash_attention_numpy, **mistake):
    unguarded = mistake.get("strict", False)
    return _forward_mistake(name, forward=forward,
                            rule=lambda causal: _CausalRuleMistake(causal, **mistake),
                            **({"step": _step_unguarded, "finish": _finish_unguarded}
                               if unguarded else {}))


# exercise 4.1's loop computes every tile (no skip)
FORWARD_MISTAKES[_DIAGONAL_HIDDEN] = _causal_rule_mistake("diagonal_hidden", strict=True,
                                                          skip=False)

WHOLE_FORWARD_MISTAKES = {
    **FORWARD_MISTAKES,
    # with the tile skip of this exercise, the off-by-one mask does not reach the skipped tiles
    _CAUSAL_OFF_BY_ONE: _forward_mistake("causal_sees_next_key", rule=_sees_next_key_skipping),
    "m_i, l_i and acc are reset inside the K/V loop: only the last K/V tile counts. Start them "
    "(m = -inf, l = 0, acc = 0) once per Q tile, before the inner loop":
        _forward_mistake("state_reset", step=_step_state_reset, finish=_finish_unguarded),
    "acc is divided by l inside the K/V loop: keep acc unnormalised (the sum of p·v) and divide "
    "once, after the last K/V tile":
        _forward_mistake("divides_inside", step=_step_divides_inside),
    "BLOCK_M is used where BLOCK_N belongs: the K/V loop runs num_blocks(N_k, BLOCK_N) times, "
    "stepping BLOCK_N keys":
        _kv_tiles_counted_with_block_m,
    # with the tile skip, masking after the statistics counts only the keys of computed tiles
    _cause("after the softmax"): _mask_after_softmax(skip=True),
    _DEFAULT_SCALE_1_OVER_D:
        _forward_mistake("default_scale_1_over_d",
                         wrong_scale=lambda d, scale: 1.0 / d if scale is None else scale),
    _SKIP_GE: _causal_rule_mistake("skip_ge", skip_ge=True),
    _DIAGONAL_HIDDEN: _causal_rule_mistake("diagonal_hidden", strict=True),
}

# (cause, name, the parts of the library's FA1 loop swapped for mistaken ones)
_FA1_MISTAKE_PARTS = [
    ("the Q tile's state is not read back from HBM: each K/V step starts from m = -inf, l = 0, "
     "o = 0, so only the last K/V tile counts. Read this Q tile's rows of m, l and o before the "
     "update, write them back after it", "state_not_reloaded",
     {"step": _step_state_reset, "finish": _finish_unguarded}),
    ("o is kept normalised in HBM but not un-normalised on reload: fold in l_old·o_old (times "
     "exp(m_old - m_new)), not o_old", "reload_normalised", {"step": _step_reload_normalised}),
    ("on reload l_old·o_old is not rescaled by exp(m_old - m_new) when the max grows (the "
     "paper's O_i update multiplies it by that factor)", "o_not_rescaled",
     {"step": _step_acc_not_rescaled}),
    ("the running sum l is not rescaled by exp(m_old - m_new) when the max grows",
     "sum_not_rescaled", {"step": _step_sum_not_rescaled}),
    ("o is written back without dividing by l_new: FA1 keeps o normalised in HBM (o = acc / "
     "l_new at every K/V step), which is how it is read back", "no_division",
     {"finish": _finish_no_division}),
    (_CAUSAL_OFF_BY_ONE, "causal_sees_next_key", {"rule": _sees_next_key_skipping}),
    (_cause("padded key columns"), "ragged_not_masked",
     {"rule": lambda causal: _ExerciseMask(causal, mask_padding=False)}),
]

def _nan_rows_keep_nan_lse(forward):
    """``forward`` with lse NaN wherever a row of o is NaN: FA1's last pass computes lse = m +
    log l from the state in HBM, and an unguarded NaN in l reaches lse too."""
    def wrong(*args, **kwargs):
        o, lse = forward(*args, **kwargs)
        return o, np.where(np.isnan(o).any(axis=-1), np.nan, lse).astype(lse.dtype)
    wrong.__name__ = forward.__name__
    return wrong


def _fa1_lse_without_max(q, k, v, causal=False, scale=None, block_m=tiled.DEFAULT_BLOCK_M,
                         block_n=tiled.DEFAULT_BLOCK_N):
    """FA1's last pass writes lse = log l: the right lse minus each row's final max m (the max
    of the row's visible scaled scores, which the FA1 state in HBM holds at the end)."""
    o, lse = tiled.flash_attention_numpy_fa1(q, k, v, causal, scale, block_m, block_n)
    scale = tiled.resolve_scale(scale, q.shape[-1])
    s = scale * (q @ np.swapaxes(k, -1, -2))  # (..., N_q, N_k)
    if causal:
        s = np.where(tiled.causal_mask(q.shape[-2], k.shape[-2]), s, -np.inf)
    return o, (lse - s.max(axis=-1)).astype(lse.dtype)


FA1_MISTAKES = {cause: _forward_mistake(name, forward=tiled.flash_attention_numpy_fa1, **parts)
                for cause, name, parts in _FA1_MISTAKE_PARTS}
FA1_MISTAKES[_FA1_MISTAKE_PARTS[0][0]] = _nan_rows_keep_nan_lse(
    FA1_MISTAKES[_FA1_MISTAKE_PARTS[0][0]])
FA1_MISTAKES.update({
    _cause("lse is log(l)"): _fa1_lse_without_max,
    _cause("always scaled by 1/sqrt(d)"):
        _forward_mistake("scale_ignored", wrong_scale=lambda d, scale: d ** -0.5,
                         forward=tiled.flash_attention_numpy_fa1),
    _DEFAULT_SCALE_1_OVER_D:
        _forward_mistake("default_scale_1_over_d", forward=tiled.flash_attention_numpy_fa1,
                         wrong_scale=lambda d, scale: 1.0 / d if scale is None else scale),
    _SKIP_GE: _causal_rule_mistake("skip_ge", forward=tiled.flash_attention_numpy_fa1,
                                   skip_ge=True),
    _DIAGONAL_HIDDEN: _nan_rows_keep_nan_lse(_causal_rule_mistake(
        "diagonal_hidden", forward=tiled.flash_attention_numpy_fa1, strict=True)),
})


FA2_HINTS = [
    "Two loops: the outer one over Q tiles (<code>q_start</code> = 0, BLOCK_M, 2·BLOCK_M, …), "
    "the inner one over K/V tiles. Everything a Q tile needs (<code>m_i</code>, <code>l_i</code>, "
    "<code>acc</code>) lives between the two loops.",
    "Load tiles with <code>tiled.load_tile(x, start, block)</code>: always a full tile, zeros "
    "past the end. The last Q tile has <code>rows = min(BLOCK_M, N_q - q_start)</code> real rows; "
    "store only those.",
    "Mask before anything touches the scores: <code>k_idx &gt;= N_k</code> (padding) and, if "
    "causal, <code>k_idx &gt; q_idx</code> become <code>-inf</code>.",
    "Causal skip: stop the inner loop at the first K/V tile whose <code>k_start</code> is greater "
    "than the Q tile's last real row, <code>q_start + rows - 1</code>; all tiles to its right are "
    "hidden too. Check before loading it.",
    "The update: <code>m_new = max(m_i, rowmax(s))</code>, <code>alpha = exp(m_i - m_new)</code>, "
    "<code>p = exp(s - m_new)</code>, <code>l_i = alpha·l_i + rowsum(p)</code>, "
    "<code>acc = alpha·acc + p @ v_tile</code>, <code>m_i = m_new</code>.",
    "After the inner loop: <code>o = acc / l_i</code> and <code>lse = m_i + log(l_i)</code> "
    "(natural log), rows <code>:rows</code> into <code>o[..., q_start:q_start + rows, :]</code> "
    "and <code>lse[..., q_start:q_start + rows]</code>.",
]

FA2_SKELETON = '''\
n_q, n_k, d_v = q.shape[-2], k.shape[-2], v.shape[-1]
scale = ...                                   # 1/sqrt(d) when None
o = ...                                       # (..., N_q, d_v), q's dtype
lse = ...                                     # (..., N_q)
for q_start in range(0, n_q, block_m):
    rows = ...                                # real rows in this Q tile
    q_tile = tiled.load_tile(q, q_start, block_m)           # (..., BLOCK_M, d)
    q_idx = q_start + np.arange(block_m)[:, None]           # (BLOCK_M, 1)
    m_i, l_i, acc = ...                       # -inf, 0, 0: (..., BLOCK_M), (..., BLOCK_M, d_v)
    for k_start in range(0, n_k, block_n):
        if ...:                               # causal and the tile is right of the diagonal
            break
        k_tile, v_tile = ...                  # load_tile, BLOCK_N rows each
        k_idx = k_start + np.arange(block_n)[None, :]       # (1, BLOCK_N)
        s = ...                               # scaled scores, -inf where masked
        ...                                   # the online-softmax update of m_i, l_i, acc
    ...                                       # o and lse of the real rows
return o, lse'''

FA1_HINTS = [
    "Swap the loops: the outer one over K/V tiles, the inner one over Q tiles. A Q tile's state "
    "cannot stay in local variables between its visits: keep it in arrays the size of the whole "
    "output (they play HBM): <code>o</code> (normalised), <code>l</code> and <code>m</code>, "
    "started at 0, 0 and -inf.",
    "In the inner loop, read this Q tile's rows of <code>m</code>, <code>l</code> and "
    "<code>o</code>, fold the K/V tile in, and write the three back.",
    "The stored <code>o</code> is divided by <code>l_old</code>: the running sum it stands for is "
    "<code>l_old·o_old</code>, which needs the same <code>alpha = exp(m_old - m_new)</code> as "
    "<code>l_old</code>: <code>o_new = (alpha·l_old·o_old + p @ v_tile) / l_new</code>.",
    "Causal: skip a (K/V tile, Q tile) pair whose <code>k_start</code> is after the Q tile's last "
    "real row (load nothing for it), and stop the outer loop once <code>k_start &gt;= N_q</code>: "
    "no query sees those keys.",
    "After both loops: <code>lse = m + log(l)</code>, and return <code>o</code> and "
    "<code>lse</code> in q's dtype.",
]

FA1_SKELETON = '''\
o, l_hbm, m_hbm = ...                        # (..., N_q, d_v) zeros, (..., N_q) zeros, -inf
for k_start in range(0, n_k, block_n):
    if ...:                                  # causal and no query sees this K/V tile
        break
    k_tile, v_tile = ...                     # load_tile, BLOCK_N rows each
    for q_start in range(0, n_q, block_m):
        rows = ...
        if ...:                              # causal and the pair is right of the diagonal
            continue
        here = slice(q_start, q_start + rows)
        q_tile = ...                         # (..., rows, d)
        s = ...                              # scaled scores (..., rows, BLOCK_N), -inf masked
        m_old, l_old, o_old = ...            # read this Q tile's state from "HBM"
        ...                                  # m_new, alpha, p, l_new, o_new
        ...                                  # write m_new, l_new, o_new back
lse = ...
return ...'''


@learner_check
def check_flash_forward(fn):
    """Exercise 4.4: check the whole FA2 forward
    ``flash_forward(q, k, v, causal, scale, block_m, block_n) -> (o, lse)``: its numbers on
    irregular cases and, on the causal ones, that it loads no tile right of the diagonal.

    Returns the learner's function when right, :func:`course_lib.attention.tiled.flash_attention_numpy`
    when not done yet.
    """
    return _check_whole_forward("Exercise 4.4", fn, tiled.flash_attention_numpy, _whole_cases(),
                                WHOLE_FORWARD_MISTAKES, order="fa2")


@learner_check
def check_flash_forward_fa1(fn):
    """Exercise 4.5: check the whole FA1-order forward
    ``flash_forward_fa1(q, k, v, causal, scale, block_m, block_n) -> (o, lse)``, as exercise 4.4.

    Returns the learner's function when right, :func:`course_lib.attention.tiled.flash_attention_numpy_fa1`
    when not done yet.
    """
    return _check_whole_forward("Exercise 4.5", fn, tiled.flash_attention_numpy_fa1,
                                _whole_cases(), FA1_MISTAKES, order="fa1")

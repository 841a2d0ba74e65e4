"""Checks for chapter 04 (tiled attention in NumPy).

* Exercise 4.1 — the inner loop of the FA2 forward (the online-softmax update of one tile) and
  its epilogue: ``fa2_forward(q, k, v, causal=False, scale=None, block_m=..., block_n=...)``
  returning ``(o, lse)``, checked against :func:`course_lib.tiled.flash_attention_numpy`.
* Exercise 4.2 — the causal tile-skip condition: ``causal_skip_grid(n_q, n_k, block_m, block_n)``
  returning a boolean ``(T_r, T_c)`` grid, checked against :func:`course_lib.iomodel.causal_skip_grid`.
* Exercise 4.3 — why FA2's loop order moves less data than FA1's, answered by code:
  ``olm_traffic(n, d, block_m, block_n)`` returning the ``(fa1, fa2)`` elements of ``o``, ``l``,
  ``m`` and ``lse`` moved through HBM, checked against :func:`course_lib.iomodel.output_traffic`.

* Exercise 4.4 — the whole FA2 forward from its signature: ``flash_forward(q, k, v, causal,
  scale, block_m, block_n) -> (o, lse)``, both loops, tile loads, online softmax, epilogue and
  the causal tile skip, checked against :func:`course_lib.tiled.flash_attention_numpy`.
* Exercise 4.5 — the same forward in FA1's loop order (outer K/V tiles, inner Q tiles, each Q
  tile's state kept in HBM arrays), checked against
  :func:`course_lib.tiled.flash_attention_numpy_fa1`.
  Both whole-forward checks also count the elements the learner's function reads from q, k and
  v (:class:`_CountedArray`), so that a causal forward that loads the hidden tiles and masks them
  (right numbers, wasted work) is caught; a wrong answer's diagnosis adds the first bad query row
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

from course_lib.checks import learner_check
from course_lib import checks, iomodel, tiled
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

    ``rule(causal)`` builds the mistaken mask; ``wrong_scale(d)`` the mistaken scale.
    """
    def wrong(q, k, v, causal=False, scale=None, block_m=tiled.DEFAULT_BLOCK_M,
              block_n=tiled.DEFAULT_BLOCK_N):
        if wrong_scale is not None:
            scale = wrong_scale(q.shape[-1])
        mask = {"causal": causal} if rule is None else {"rule": rule(causal)}
        return forward(q, k, v, scale=scale, block_m=block_m, block_n=block_n, step=step,
                       finish=finish, **mask)
    wrong.__name__ = f"{forward.__name__}_{name}"
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


@learner_check
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
# and the work. A forward that computes the tiles right of the causal diagonal and masks them
# gets the right numbers; only the traffic shows the missing skip. So q, k and v reach the
# learner's function as _CountedArray views that count every element read out of them (a tile
# load `x[..., a:b, :]`, or a whole-array operation), and the counts are compared with what the
# library's loop reads (tiled.IOCounter) on the same case.

class _CountedArray(np.ndarray):
    """An input array that counts the elements read out of it, as HBM reads.

    Indexing (``load_tile``'s ``x[..., start:stop, :]``, or a slice of the learner's own) counts
    the elements it returns, a ufunc on the whole array (``q @ k.T``, ``scale * q``) counts the
    whole array; both return plain arrays. Views (``swapaxes``, ``.T``) share the count; copies
    and new arrays (``astype``, ``zeros_like``) do not count.
    """

    def __array_finalize__(self, obj):
        self.reads = getattr(obj, "reads", None) if self.base is not None else None

    def _count(self, elements: int) -> None:
        if self.reads is not None:
            self.reads[0] += int(elements)

    def __getitem__(self, key):
        out = np.asarray(self)[key]
        self._count(np.size(out))
        return out

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        plain = []
        for x in inputs:
            if isinstance(x, _CountedArray):
                x._count(x.size)
                x = np.asarray(x)
            plain.append(x)
        if "out" in kwargs:
            kwargs["out"] = tuple(np.asarray(x) for x in kwargs["out"])
        return getattr(ufunc, method)(*plain, **kwargs)


def _counted(x: np.ndarray) -> _CountedArray:
    view = x.view(_CountedArray)
    view.reads = [0]
    return view


_QKV = ("q", "k", "v")


def _library_reads(forward, case: Case, rule=None) -> dict:
    """Elements of q, k, v the library's ``forward`` reads on ``case`` (with ``rule`` if given)."""
    counter = tiled.IOCounter(record_events=False)
    kwargs = dict(case.kwargs or {})
    if rule is not None:
        kwargs["rule"] = rule(kwargs.pop("causal"))
    forward(*case.args, counter=counter, **kwargs)
    return {name: counter.reads_by.get(name, 0) for name in _QKV}


NO_SKIP = ("the tiles right of the causal diagonal are loaded and computed, then masked away: "
           "right numbers, wasted work. Skip them before loading anything: a K/V tile whose "
           "first key k_start comes after the Q tile's last real query row "
           "min(q_start + BLOCK_M, N_q) - 1 is hidden (exercise 4.2's test)")
RAGGED_Q_DROPPED = ("the ragged last Q tile is dropped: only the rows past the last full tile "
                    "are wrong. Loop over num_blocks(N_q, BLOCK_M) = ceil(N_q / BLOCK_M) tiles "
                    "and store its `rows` real rows")
EXTRA_LOADS = ("a tile is loaded more often than the algorithm needs: the FA2 order loads each "
               "Q tile once and each K/V tile once per Q tile that sees it; the FA1 order each "
               "K/V tile once and each Q tile once per K/V tile it sees (a K/V tile that no "
               "query sees is not loaded at all)")


def _row_diagnosis(got, want, case: Case) -> tuple[str, str | None]:
    """Where the wrong rows are: ``(line, cause)``; cause names a row pattern or is None."""
    if not (isinstance(got, (tuple, list)) and len(got) == 2):
        return "", None  # the check's own message says what is wrong with the output
    block_m = case.kwargs["block_m"]
    n_q = case.args[0].shape[-2]
    atol, rtol = checks.TOLERANCES[str(want[0].dtype)]
    bad_rows = {}  # output name -> (N_q,) rows wrong in it, for any leading index
    for name, g, w in (("o", got[0], want[0]), ("lse", got[1], want[1])):
        try:
            g, w = checks.to_numpy64(g), checks.to_numpy64(w)
        except (TypeError, ValueError):
            return "", None
        if g.shape != w.shape:
            return "", None
        wrong = ~np.isclose(g, w, atol=atol, rtol=rtol) | (np.isnan(g) & ~np.isnan(w))
        if name == "o":
            wrong = wrong.any(axis=-1)
        bad_rows[name] = wrong.reshape(-1, n_q).any(axis=0)
    bad = bad_rows["o"] | bad_rows["lse"]  # (N_q,)
    if not bad.any():
        return "", None
    row = int(np.argmax(bad))
    where = " and ".join(name for name, rows in bad_rows.items() if rows[row])
    tile = row // block_m
    first, last = tile * block_m, min((tile + 1) * block_m, n_q) - 1
    ragged = n_q % block_m
    line = (f"  first bad query row: {row} (wrong in {where}), in Q tile {tile} = rows "
            f"{first}–{last} of N_q={n_q}; {int(bad.sum())} of {n_q} rows are wrong")
    cause = None
    if ragged and bad[n_q - ragged:].all() and not bad[: n_q - ragged].any():
        cause = RAGGED_Q_DROPPED
    return line, cause


def _read_diagnosis(exercise, case, n, n_cases, got, want, no_skip, skip_arrays):
    """The diagnosis of a right answer that reads more of q, k, v than the library does."""
    counts = ", ".join(f"{name} {got[name]:,}" for name in _QKV)
    expected = ", ".join(f"{name} {want[name]:,}" for name in _QKV)
    lines = [f"✗ {exercise}: right numbers, too much work on case {n} of {n_cases}",
             f"  inputs: {case.describe()}",
             f"  elements read by your function: {counts}",
             f"  the algorithm needs only:        {expected}"]
    if all(got[name] >= no_skip[name] > want[name] for name in skip_arrays):
        lines.append(f"  likely cause: {NO_SKIP}")
    else:
        lines.append(f"  likely cause: {EXTRA_LOADS}")
    return lines


def _check_whole_forward(exercise, fn, library, cases, mistakes, skip_arrays):
    """Check a whole tiled forward ``fn(q, k, v, causal, scale, block_m, block_n) -> (o, lse)``:
    its numbers on every case, then, on the causal cases, the elements of q, k, v it reads.

    ``skip_arrays`` are the inputs whose reads show a missing causal skip (k, v in the FA2
    order, q in the FA1 order). One diagnosis, the first problem found; returns ``fn`` on a
    pass, ``library`` when not done yet.
    """
    reads, last = [], {}
    output = checks.CapturedOutput()

    def counted_fn(q, k, v, **kwargs):
        inputs = [_counted(x) for x in (q, k, v)]
        try:
            out = fn(*inputs, **kwargs)
        except NotImplementedError:
            last["not_done"] = True
            raise
        reads.append({name: x.reads[0] for name, x in zip(_QKV, inputs)})
        last["out"] = out
        return out

    def reference(q, k, v, **kwargs):
        return library(q, k, v, **kwargs)

    try:
        result = check_function(exercise, counted_fn, reference, cases, fallback=library,
                                mistakes=mistakes, quiet=True, output=output)
    except checks.ExerciseFailed as failure:
        message = str(failure)
        head = message.split("\n")[0]
        if "wrong answer on case" not in head or "out" not in last:
            raise
        n = int(head.split("wrong answer on case ")[1].split()[0])
        case = cases[n - 1]
        line, cause = _row_diagnosis(last["out"], reference(*case.args, **case.kwargs), case)
        lines = message.split("\n")
        at = next((i for i, text in enumerate(lines) if text.startswith("  likely cause:")),
                  next((i for i, text in enumerate(lines) if text.startswith("  your function "
                                                                             "printed")),
                       len(lines)))
        extra = [line] if line else []
        if cause and not any(text.startswith("  likely cause:") for text in lines):
            extra.append(f"  likely cause: {cause}")
        raise checks.failed_with(exercise, "\n".join(lines[:at] + extra + lines[at:])) from None
    if last.get("not_done"):  # not done yet (on some case): let the check say so, in its words
        def not_done(*args, **kwargs):
            raise NotImplementedError(exercise)
        return check_function(exercise, not_done, reference, cases[:1], fallback=library,
                              output=output)
    for n, (case, got) in enumerate(zip(cases, reads), 1):
        if not case.kwargs.get("causal"):
            continue
        want = _library_reads(library, case)
        if sum(got.values()) > sum(want.values()):
            no_skip = _library_reads(library, case, rule=lambda causal: _ExerciseMask(causal))
            raise checks.failed_with(exercise, "\n".join(
                _read_diagnosis(exercise, case, n, len(cases), got, want, no_skip, skip_arrays)
                + output.excerpt()))
    checks.passed(exercise, "\n".join([f"✓ {exercise}: passed ({len(cases)} cases; the causal "
                                       f"ones load no hidden tile).", *output.excerpt()]))
    return fn


def _whole_cases():
    """Exercise 4.1's cases (ragged, N_q ≠ N_k, leading dims, causal and not, large scores) and a
    float32 one with more queries than keys (every row past N_k sees all keys)."""
    rng = np.random.default_rng(44)
    q = rng.standard_normal((3, 50, 6)).astype(np.float32)
    k, v = (rng.standard_normal((3, 23, 6)).astype(np.float32) for _ in range(2))
    return _forward_cases() + [
        Case((q, k, v), {"causal": True, "block_m": 12, "block_n": 8},
             label="float32, N_q=50, N_k=23, d=6, BLOCK_M=12, BLOCK_N=8, causal=True")]


def _step_state_reset(m_i, l_i, acc, s, v_tile):
    """Every K/V step starts from the empty state: only the last tile seen counts."""
    return tiled.online_softmax_step(*tiled.empty_state(m_i.shape, acc.shape[-1], acc.dtype),
                                     s, v_tile)


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

WHOLE_FORWARD_MISTAKES = {
    **FORWARD_MISTAKES,
    # with the tile skip of this exercise, the off-by-one mask does not reach the skipped tiles
    _CAUSAL_OFF_BY_ONE: _forward_mistake("causal_sees_next_key", rule=_sees_next_key_skipping),
    "m_i, l_i and acc are reset inside the K/V loop: only the last K/V tile counts. Start them "
    "(m = -inf, l = 0, acc = 0) once per Q tile, before the inner loop":
        _forward_mistake("state_reset", step=_step_state_reset),
    "acc is divided by l inside the K/V loop: keep acc unnormalised (the sum of p·v) and divide "
    "once, after the last K/V tile":
        _forward_mistake("divides_inside", step=_step_divides_inside),
    "BLOCK_M is used where BLOCK_N belongs: the K/V loop runs num_blocks(N_k, BLOCK_N) times, "
    "stepping BLOCK_N keys":
        _kv_tiles_counted_with_block_m,
}

# (cause, name, the parts of the library's FA1 loop swapped for mistaken ones)
_FA1_MISTAKE_PARTS = [
    ("the Q tile's state is not read back from HBM: each K/V step starts from m = -inf, l = 0, "
     "o = 0, so only the last K/V tile counts. Read this Q tile's rows of m, l and o before the "
     "update, write them back after it", "state_not_reloaded", {"step": _step_state_reset}),
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

FA1_MISTAKES = {cause: _forward_mistake(name, forward=tiled.flash_attention_numpy_fa1, **parts)
                for cause, name, parts in _FA1_MISTAKE_PARTS}


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

    Returns the learner's function when right, :func:`course_lib.tiled.flash_attention_numpy`
    when not done yet.
    """
    return _check_whole_forward("Exercise 4.4", fn, tiled.flash_attention_numpy, _whole_cases(),
                                WHOLE_FORWARD_MISTAKES, skip_arrays=("k", "v"))


@learner_check
def check_flash_forward_fa1(fn):
    """Exercise 4.5: check the whole FA1-order forward
    ``flash_forward_fa1(q, k, v, causal, scale, block_m, block_n) -> (o, lse)``, as exercise 4.4.

    Returns the learner's function when right, :func:`course_lib.tiled.flash_attention_numpy_fa1`
    when not done yet.
    """
    return _check_whole_forward("Exercise 4.5", fn, tiled.flash_attention_numpy_fa1,
                                _whole_cases(), FA1_MISTAKES, skip_arrays=("q",))

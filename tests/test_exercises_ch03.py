"""Exercise checks of chapter 03: correct answers pass, stubs fall back, realistic wrong answers
are rejected with their likely cause named (issue 9's corpus for online softmax)."""

from __future__ import annotations

import numpy as np
import pytest

from course_lib.attention import softmax
from course_lib.teaching.checks import ExerciseFailed
from course_lib.teaching.exercises import ch03

pytestmark = pytest.mark.ch03


def named_cause(message: str) -> str:
    """The text after "likely cause: " in a check's diagnosis ("" when none is named)."""
    return message.partition("likely cause: ")[2]


def stub(*args):
    raise NotImplementedError("Exercise 3.x")


def assert_rejected(check, wrong, cause):
    """``wrong`` is rejected; the cause named contains ``cause``, or none is named (cause None)."""
    with pytest.raises(ExerciseFailed) as failure:
        check(wrong)
    message = str(failure.value)
    assert message.startswith("✗ Exercise 3.")
    if cause:
        assert cause in named_cause(message), message
    else:
        assert "likely cause" not in message and "two known mistakes" not in message, message
    return message


# ---- Exercise 3.1: online_update(m, l, x_tile) -> (m_new, l_new) -----------------------------

def update_loop(m, l, x_tile):
    """A correct answer written differently from the library (explicit loop over tile columns)."""
    m_new = np.maximum(m, x_tile.max(axis=-1))
    l_new = l * np.exp(m - m_new)
    for j in range(x_tile.shape[-1]):
        l_new = l_new + np.exp(x_tile[..., j] - m_new)
    return m_new, l_new


def update_forgot_rescale(m, l, x_tile):
    m_new = np.maximum(m, np.max(x_tile, axis=-1))
    l_new = l.copy()
    for j in range(x_tile.shape[-1]):
        l_new += np.exp(x_tile[..., j] - m_new)
    return m_new, l_new


def update_no_max_subtraction(m, l, x_tile):
    m_new = np.maximum(m, x_tile.max(-1))
    return m_new, l + np.sum(np.exp(x_tile), axis=-1)


def update_flipped_sign(m, l, x_tile):
    m_new = np.maximum(m, x_tile.max(-1))
    scale = np.exp(m_new - m)
    return m_new, scale * l + np.exp(x_tile - m_new[..., None]).sum(-1)


def update_tile_own_max(m, l, x_tile):
    tile_m = x_tile.max(-1)
    m_new = np.maximum(m, tile_m)
    tile_l = np.exp(x_tile - tile_m[..., None]).sum(-1)
    return m_new, l * np.exp(m - m_new) + tile_l


def update_returns_old_max(m, l, x_tile):
    m_new = np.maximum(m, x_tile.max(-1))
    return m, l * np.exp(m - m_new) + np.exp(x_tile - m_new[..., None]).sum(-1)


def update_logaddexp(m, l, x_tile):
    """A correct answer through log-sum-exps: log(l) + m is the state's lse."""
    m_new = np.maximum(m, x_tile.max(axis=-1))
    with np.errstate(divide="ignore", invalid="ignore"):
        lse = np.logaddexp(np.log(l) + m, np.logaddexp.reduce(x_tile, axis=-1))
        return m_new, np.where(np.isfinite(lse), np.exp(lse - m_new), 0.0).astype(l.dtype)


def update_guarded(m, l, x_tile):
    """A correct answer with the library's guard written out (np.isneginf)."""
    m_new = np.maximum(m, np.amax(x_tile, axis=-1))
    ref = np.where(np.isneginf(m_new), 0, m_new)
    return m_new, l * np.exp(m - ref) + np.sum(np.exp(x_tile - ref[..., np.newaxis]), axis=-1)


def update_global_max(m, l, x_tile):
    m_new = np.maximum(m, np.max(x_tile))
    return m_new, l * np.exp(m - m_new) + np.exp(x_tile - m_new[..., None]).sum(-1)


def update_rescales_tile_too(m, l, x_tile):
    m_new = np.maximum(m, x_tile.max(-1))
    total = l + np.exp(x_tile - np.expand_dims(m_new, -1)).sum(-1)
    return m_new, total * np.exp(m - m_new)


def update_old_max_for_tile(m, l, x_tile):
    m_new = np.maximum(m, x_tile.max(-1))
    return m_new, l * np.exp(m - m_new) + np.exp(x_tile - m[..., None]).sum(-1)


def update_axis0(m, l, x_tile):
    m_new = np.maximum(m, x_tile.max(axis=0))
    return m_new, l * np.exp(m - m_new) + np.exp(x_tile - m_new[..., None]).sum(-1)


def update_no_newaxis(m, l, x_tile):
    m_new = np.maximum(m, x_tile.max(-1))
    return m_new, l * np.exp(m - m_new) + np.exp(x_tile - m_new).sum(-1)


def update_in_place(m, l, x_tile):
    m_new = np.maximum(m, x_tile.max(-1))
    l *= np.exp(m - m_new)
    l += np.exp(x_tile - m_new[..., None]).sum(-1)
    return m_new, l


def update_mean_not_sum(m, l, x_tile):
    m_new = np.maximum(m, x_tile.max(-1))
    return m_new, l * np.exp(m - m_new) + np.exp(x_tile - m_new[..., None]).mean(-1)


def update_returns_none(m, l, x_tile):
    np.maximum(m, x_tile.max(-1))


def update_crashes(m, l, x_tile):
    return m, l + x_tile.sum(axis=3)


@pytest.mark.parametrize("right", [softmax.online_update, update_loop, update_logaddexp,
                                   update_guarded])
def test_update_correct_answers_pass(right, capsys):
    assert ch03.check_online_update(right) is right
    assert "Exercise 3.1: passed (9 cases)" in capsys.readouterr().out


def test_update_stub_falls_back(capsys):
    assert ch03.check_online_update(stub) is softmax.online_update
    assert "not done yet" in capsys.readouterr().out


UPDATE_CORPUS = [
    (update_forgot_rescale, ch03.NO_RESCALE),
    (update_no_max_subtraction, ch03.NO_MAX),
    (update_flipped_sign, ch03.WRONG_SIGN),
    (update_tile_own_max, "exponentiated relative to its own max"),
    (update_returns_old_max, "the running max is returned unchanged"),
    (update_global_max, "taken over the whole tile"),
    (update_rescales_tile_too, "also multiplies the tile's sum"),
    (update_old_max_for_tile, "relative to the old max m"),
    (update_mean_not_sum, None),
    (update_axis0, None),
    (update_no_newaxis, None),
    (update_in_place, None),
]


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("wrong, cause", UPDATE_CORPUS, ids=[f.__name__ for f, _ in UPDATE_CORPUS])
def test_update_mistakes_rejected_and_named(wrong, cause):
    assert_rejected(ch03.check_online_update, wrong, cause)


def test_update_in_place_edit_is_named():
    with pytest.raises(ExerciseFailed, match="changed its input `l` in place"):
        ch03.check_online_update(update_in_place)


@pytest.mark.filterwarnings("ignore:overflow encountered")
def test_no_max_subtraction_is_caught_as_overflow_on_large_scores():
    """Even if small scores happened to pass, scores around 1000 overflow: the message says so."""
    def only_large_wrong(m, l, x_tile):
        if np.max(x_tile) > 500:
            return update_no_max_subtraction(m, l, x_tile)
        return softmax.online_update(m, l, x_tile)

    with pytest.raises(ExerciseFailed) as failure:
        ch03.check_online_update(only_large_wrong)
    message = str(failure.value)
    assert "scores around 1000" in message
    assert "NaN/inf where the answer is finite" in message
    assert "exp() overflowed" in message  # the evidence: NumPy saw the overflow, at the learner's line


@pytest.mark.parametrize("wrong, expected", [
    (update_returns_none, "returned None"),
    (update_crashes, "your function raised"),
])
def test_update_broken_code_gets_one_clear_message(wrong, expected):
    with pytest.raises(ExerciseFailed, match=expected):
        ch03.check_online_update(wrong)


# ---- Exercise 3.2: merge(m_a, l_a, o_a, m_b, l_b, o_b) -> (m, l, o) --------------------------

def merge_written_out(m_a, l_a, o_a, m_b, l_b, o_b):
    """A correct answer in the reading's form: o = (l_a c_a o_a + l_b c_b o_b) / l."""
    m = np.maximum(m_a, m_b)
    c_a, c_b = np.exp(m_a - m), np.exp(m_b - m)
    l = l_a * c_a + l_b * c_b
    o = (l_a * c_a)[..., None] / l[..., None] * o_a + (l_b * c_b)[..., None] / l[..., None] * o_b
    return m, l, o


def merge_no_rescale(m_a, l_a, o_a, m_b, l_b, o_b):
    m = np.maximum(m_a, m_b)
    l = l_a + l_b
    o = (l_a[..., None] * o_a + l_b[..., None] * o_b) / l[..., None]
    return m, l, o


def merge_flipped_sign(m_a, l_a, o_a, m_b, l_b, o_b):
    m = np.maximum(m_a, m_b)
    a = l_a * np.exp(m - m_a)
    b = l_b * np.exp(m - m_b)
    return m, a + b, (a[..., None] * o_a + b[..., None] * o_b) / (a + b)[..., None]


def merge_old_factor_for_both(m_a, l_a, o_a, m_b, l_b, o_b):
    m_new = np.maximum(m_a, m_b)
    alpha = np.exp(m_a - m_new)  # "the correction", applied to everything
    l = alpha * (l_a + l_b)
    o = alpha[..., None] * (l_a[..., None] * o_a + l_b[..., None] * o_b) / l[..., None]
    return m_new, l, o


def merge_rescales_twice(m_a, l_a, o_a, m_b, l_b, o_b):
    m = np.maximum(m_a, m_b)
    l_a = l_a * np.exp(m_a - m)  # rescale the sums in place ...
    l_b = l_b * np.exp(m_b - m)
    l = l_a + l_b
    o = ((l_a * np.exp(m_a - m))[..., None] * o_a  # ... and then once more
         + (l_b * np.exp(m_b - m))[..., None] * o_b) / l[..., None]
    return m, l, o


def merge_forgot_divide(m_a, l_a, o_a, m_b, l_b, o_b):
    m = np.maximum(m_a, m_b)
    w_a, w_b = l_a * np.exp(m_a - m), l_b * np.exp(m_b - m)
    return m, w_a + w_b, w_a[..., None] * o_a + w_b[..., None] * o_b


def merge_average(m_a, l_a, o_a, m_b, l_b, o_b):
    m = np.maximum(m_a, m_b)
    return m, l_a * np.exp(m_a - m) + l_b * np.exp(m_b - m), 0.5 * (o_a + o_b)


def merge_lse(m_a, l_a, o_a, m_b, l_b, o_b):
    """A correct answer through the parts' log-sum-exps."""
    with np.errstate(divide="ignore"):
        lse_a, lse_b = m_a + np.log(l_a), m_b + np.log(l_b)
    lse = np.logaddexp(lse_a, lse_b)
    m = np.maximum(m_a, m_b)
    o = np.exp(lse_a - lse)[..., None] * o_a + np.exp(lse_b - lse)[..., None] * o_b
    return m, np.exp(lse - m), o


def merge_acc(m_a, l_a, o_a, m_b, l_b, o_b):
    """A correct answer in FlashAttention-2's form: unnormalised accumulators, one division."""
    m = np.fmax(m_a, m_b)
    alpha, beta = np.exp(m_a - m), np.exp(m_b - m)
    acc = (l_a * alpha)[..., None] * o_a + (l_b * beta)[..., None] * o_b
    l = l_a * alpha + l_b * beta
    return m, l, acc / l[..., None]


def merge_rows_loop(m_a, l_a, o_a, m_b, l_b, o_b):
    """A correct answer one row at a time, with Python's math."""
    import math

    m, l, o = np.empty_like(m_a), np.empty_like(l_a), np.empty_like(o_a)
    for idx in np.ndindex(m_a.shape):
        top = max(m_a[idx], m_b[idx])
        wa = l_a[idx] * math.exp(m_a[idx] - top)
        wb = l_b[idx] * math.exp(m_b[idx] - top)
        m[idx], l[idx] = top, wa + wb
        o[idx] = (wa * o_a[idx] + wb * o_b[idx]) / (wa + wb)
    return m, l, o


def merge_swapped_weights(m_a, l_a, o_a, m_b, l_b, o_b):
    m = np.maximum(m_a, m_b)
    w_a, w_b = l_a * np.exp(m_a - m), l_b * np.exp(m_b - m)
    return m, w_a + w_b, (w_b[..., None] * o_a + w_a[..., None] * o_b) / (w_a + w_b)[..., None]


def merge_corrections_only(m_a, l_a, o_a, m_b, l_b, o_b):
    m = np.maximum(m_a, m_b)
    alpha, beta = np.exp(m_a - m), np.exp(m_b - m)
    return m, alpha * l_a + beta * l_b, alpha[..., None] * o_a + beta[..., None] * o_b


def merge_minimum(m_a, l_a, o_a, m_b, l_b, o_b):
    m = np.minimum(m_a, m_b)
    w_a, w_b = l_a * np.exp(m_a - m), l_b * np.exp(m_b - m)
    l = w_a + w_b
    return m, l, (w_a / l)[..., None] * o_a + (w_b / l)[..., None] * o_b


def merge_l_not_rescaled(m_a, l_a, o_a, m_b, l_b, o_b):
    m = np.maximum(m_a, m_b)
    w_a, w_b = l_a * np.exp(m_a - m), l_b * np.exp(m_b - m)
    return m, l_a + l_b, (w_a[..., None] * o_a + w_b[..., None] * o_b) / (w_a + w_b)[..., None]


def merge_in_place(m_a, l_a, o_a, m_b, l_b, o_b):
    m = np.maximum(m_a, m_b)
    l_a *= np.exp(m_a - m)
    l_b *= np.exp(m_b - m)
    l = l_a + l_b
    return m, l, (l_a[..., None] * o_a + l_b[..., None] * o_b) / l[..., None]


def merge_max_of_sums(m_a, l_a, o_a, m_b, l_b, o_b):  # the larger part wins
    m = np.maximum(m_a, m_b)
    a_wins = (m_a >= m_b)[..., None]
    return m, np.maximum(l_a, l_b), np.where(a_wins, o_a, o_b)


def merge_wrong_shape(m_a, l_a, o_a, m_b, l_b, o_b):
    m, l, o = softmax.merge_states_with_output(m_a, l_a, o_a, m_b, l_b, o_b)
    return m, l, o.sum(-1)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("right", [merge_written_out, merge_lse, merge_acc, merge_rows_loop])
def test_merge_correct_answers_pass(right, capsys):
    assert ch03.check_merge(right) is right
    assert "Exercise 3.2: passed (8 cases)" in capsys.readouterr().out


def test_merge_stub_falls_back(capsys):
    assert ch03.check_merge(stub) is softmax.merge_states_with_output
    assert "not done yet" in capsys.readouterr().out


MERGE_CORPUS = [
    (merge_no_rescale, "the sums are not rescaled to the common max"),
    (merge_flipped_sign, "the correction has the wrong sign"),
    (merge_old_factor_for_both, "the same correction exp(m_a - m) is used for both parts"),
    (merge_rescales_twice, "the correction is applied twice"),
    (merge_forgot_divide, "not divided by the merged sum"),
    (merge_average, "simply averaged"),
    (merge_swapped_weights, "weights are swapped"),
    (merge_corrections_only, "corrections exp(m_a - m), exp(m_b - m) alone"),
    (merge_minimum, "the smaller one (np.minimum)"),
    (merge_l_not_rescaled, "the merged l is l_a + l_b"),
    (merge_in_place, None),
    (merge_max_of_sums, None),
]


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("wrong, cause", MERGE_CORPUS, ids=[f.__name__ for f, _ in MERGE_CORPUS])
def test_merge_mistakes_rejected_and_named(wrong, cause):
    assert_rejected(ch03.check_merge, wrong, cause)


def test_merge_wrong_shape_named():
    with pytest.raises(ExerciseFailed, match=r"output \[2\]: shape \(3,\) but expected \(3, 5\)"):
        ch03.check_merge(merge_wrong_shape)


def test_every_mistake_model_is_distinguishable():
    """Each recognised mistake, given as the answer, is named as itself (not as another)."""
    for check, mistakes in ((ch03.check_online_update, ch03.UPDATE_MISTAKES),
                            (ch03.check_merge, ch03.MERGE_MISTAKES),
                            (ch03.check_online_softmax, ch03.ONLINE_SOFTMAX_MISTAKES)):
        for cause, wrong in mistakes.items():
            with pytest.raises(ExerciseFailed) as failure:
                check(wrong)
            assert "likely cause: " + cause in str(failure.value)


# ---- Exercise 3.3: online_softmax(x, block_size), the whole row ------------------------------

def learner_softmax(x, block_size, *, rescale=True, every_tile=True, guard_masked_tile=True,
                    guard_empty_row=True, normalise_at_end=True, flip_sign=False, tile_ref="new",
                    short_slice=False, accumulate=True, per_row_max=True):
    """A learner's answer written out (a while loop), with switches for the lines learners get
    wrong: each switch turned is one realistic wrong answer (the defaults: a right one)."""
    m = np.full(x.shape[:-1], -np.inf)  # (...,)
    l = np.zeros(x.shape[:-1])
    out = np.zeros(x.shape)
    n = x.shape[-1] if every_tile else x.shape[-1] // block_size * block_size
    start = 0
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        while start < n:
            stop = start + block_size - 1 if short_slice else start + block_size
            tile = x[..., start:stop]  # (..., B)
            tile_max = np.max(tile, axis=-1) if per_row_max else np.max(tile)
            m_new = np.maximum(m, tile_max)
            shift = np.where(np.isneginf(m_new), 0.0, m_new) if guard_masked_tile else m_new
            if tile_ref == "own":
                e = np.exp(tile - np.expand_dims(tile_max, -1))
            elif tile_ref == "old":
                e = np.exp(tile - np.expand_dims(np.where(np.isneginf(m), 0.0, m), -1))
            else:
                e = np.exp(tile - np.expand_dims(shift, -1))
            corr = np.exp(shift - m) if flip_sign else np.exp(m - shift)
            if not accumulate:
                l = e.sum(-1)
            else:
                l = (l * corr if rescale else l) + e.sum(-1)
            m = m_new
            if not normalise_at_end:  # weights of this tile, with the sums so far
                out[..., start:stop] = np.exp(tile - m[..., None]) / l[..., None]
            start += block_size
        if not normalise_at_end:
            return out.astype(x.dtype)
        p = np.exp(x - np.where(np.isfinite(m), m, 0.0)[..., None])  # (..., N)
        if guard_empty_row:
            return np.divide(p, l[..., None], out=out, where=l[..., None] > 0).astype(x.dtype)
        return (p / l[..., None]).astype(x.dtype)


def softmax_rows_loop(x, block_size):
    """A correct answer one row at a time with Python's math (no NumPy broadcasting)."""
    import math

    out = np.zeros(x.shape, dtype=x.dtype)
    for idx in np.ndindex(x.shape[:-1]):
        row = x[idx]
        m, l = -math.inf, 0.0
        for start in range(0, len(row), block_size):
            tile = [float(v) for v in row[start:start + block_size]]
            m_new = max(m, max(tile))
            if m_new == -math.inf:
                continue  # nothing but -inf so far
            l = l * math.exp(m - m_new) + sum(math.exp(v - m_new) for v in tile)
            m = m_new
        if l > 0:
            out[idx] = [math.exp(float(v) - m) / l for v in row]
    return out


def softmax_exp2_merge(x, block_size):
    """A correct answer that merges per-tile states and uses exp2, as chapter 06's kernel does."""
    log2e = 1.4426950408889634
    m = np.full(x.shape[:-1], -np.inf)
    l = np.zeros(x.shape[:-1])
    for tile in np.split(x, range(block_size, x.shape[-1], block_size), axis=-1):
        m_t = tile.max(-1)
        ref = np.where(np.isfinite(m_t), m_t, 0.0)
        l_t = np.exp2((tile - ref[..., None]) * log2e).sum(-1)
        m_new = np.fmax(m, m_t)
        safe = np.where(np.isfinite(m_new), m_new, 0.0)
        l = l * np.exp2((m - safe) * log2e) + l_t * np.exp2((ref - safe) * log2e)
        m = m_new
    p = np.exp2((x - np.where(np.isfinite(m), m, 0.0)[..., None]) * log2e)
    l = l[..., None]
    return np.where(l > 0, p / np.where(l > 0, l, 1.0), 0.0).astype(x.dtype)


def softmax_safe_then_tiles(x, block_size):
    """A correct answer with another tiling: np.array_split into ceil(N / block_size) parts."""
    parts = max(1, -(-x.shape[-1] // block_size))
    m = np.full(x.shape[:-1], -np.inf)
    l = np.zeros(x.shape[:-1])
    for tile in np.array_split(x.astype(np.float64), parts, axis=-1):
        m_new = np.maximum(m, tile.max(-1))
        shift = np.nan_to_num(m_new, neginf=0.0)
        l = l * np.exp(m - shift) + np.exp(tile - shift[..., None]).sum(-1)
        m = m_new
    w = np.exp(x - np.nan_to_num(m, neginf=0.0)[..., None])
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.nan_to_num(w / l[..., None], nan=0.0).astype(x.dtype)


def textbook_softmax(x, block_size):
    e = np.exp(x)
    return e / e.sum(axis=-1, keepdims=True)


def rows_loop_drops_last_tile(x, block_size):
    """The per-row loop, with range(len(row) // block_size) tiles."""
    import math

    out = np.zeros(x.shape, dtype=x.dtype)
    for idx in np.ndindex(x.shape[:-1]):
        row = x[idx]
        m, l = -math.inf, 0.0
        for t in range(len(row) // block_size):
            tile = [float(v) for v in row[t * block_size:(t + 1) * block_size]]
            m_new = max(m, max(tile))
            if m_new == -math.inf:
                continue
            l = l * math.exp(m - m_new) + sum(math.exp(v - m_new) for v in tile)
            m = m_new
        if l > 0:
            out[idx] = [math.exp(float(v) - m) / l for v in row]
    return out


def safe_softmax_untiled_wrong_axis(x, block_size):
    e = np.exp(x - x.max(axis=0, keepdims=True))
    return e / e.sum(axis=0, keepdims=True)


def tiles_in_float32(x, block_size):
    return learner_softmax(x.astype(np.float32), block_size).astype(x.dtype)


def sorts_the_row(x, block_size):  # "the max first": sorting changes which weight goes where
    return learner_softmax(np.sort(x, axis=-1), block_size)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("right", [learner_softmax, softmax.online_softmax, softmax_rows_loop,
                                   softmax_exp2_merge, softmax_safe_then_tiles])
def test_online_softmax_right_answers_pass(right, capsys):
    assert ch03.check_online_softmax(right) is right
    assert "Exercise 3.3: passed (8 cases)" in capsys.readouterr().out


def test_online_softmax_stub_falls_back(capsys):
    assert ch03.check_online_softmax(stub) is softmax.online_softmax
    assert "not done yet" in capsys.readouterr().out


ONLINE_SOFTMAX_CORPUS = [
    ({"rescale": False}, ch03.NO_RESCALE),
    ({"every_tile": False}, "the short last tile is dropped"),
    ({"guard_empty_row": False}, ch03.ALL_MASKED_ROW_NAN),
    ({"guard_masked_tile": False}, ch03.MASKED_FIRST_TILE_NAN + " (then a guard"),
    ({"guard_masked_tile": False, "guard_empty_row": False}, ch03.MASKED_FIRST_TILE_NAN),
    ({"normalise_at_end": False}, "the weights are written during the first pass"),
    ({"flip_sign": True}, ch03.WRONG_SIGN),
    ({"tile_ref": "own"}, "relative to its own max"),
    ({"tile_ref": "old"}, "relative to the max before it"),
    ({"short_slice": True}, "each tile misses its last score"),
    ({"accumulate": False}, "replaced by each tile's sum"),
    ({"per_row_max": False}, "taken over the whole tile"),
    ({"rescale": False, "every_tile": False}, None),
    (textbook_softmax, ch03.NO_MAX),
    (rows_loop_drops_last_tile, "the short last tile is dropped"),
    (safe_softmax_untiled_wrong_axis, None),
    (tiles_in_float32, None),
    (sorts_the_row, None),
]


def _as_answer(wrong):
    if not isinstance(wrong, dict):
        return wrong
    switches = wrong

    def answer(x, block_size):
        return learner_softmax(x, block_size, **switches)
    return answer


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("wrong, cause", ONLINE_SOFTMAX_CORPUS,
                         ids=[str(w) if isinstance(w, dict) else w.__name__
                              for w, _ in ONLINE_SOFTMAX_CORPUS])
def test_online_softmax_mistakes_rejected_and_named(wrong, cause):
    message = assert_rejected(ch03.check_online_softmax, _as_answer(wrong), cause)
    assert message.startswith("✗ Exercise 3.3: wrong answer on case")
    assert message.count("likely cause: ") <= 1


def test_online_softmax_cases_vary_what_the_mistakes_depend_on():
    cases = ch03._online_softmax_cases()
    widths = [(c.args[0].shape[-1], c.args[1]) for c in cases]
    assert any(b == 1 for _, b in widths) and any(b == n for n, b in widths)
    assert any(b > n for n, b in widths) and any(n % b for n, b in widths if b < n)
    xs = [c.args[0] for c in cases]
    assert any(np.isneginf(x).all(axis=-1).any() for x in xs)  # a fully masked row
    assert any(x.dtype == np.float32 for x in xs)
    row_max = [np.max(np.where(np.isneginf(x), np.nan, x), axis=-1, initial=-np.inf) for x in xs]
    assert any((r > 700).any() and (r < -700).any() for r in row_max)  # both signs, thousands
    assert any(not x.flags.c_contiguous for x in xs)
    assert any(x.ndim > 2 for x in xs)


def test_online_softmax_has_at_least_five_mistakes():
    assert len(ch03.ONLINE_SOFTMAX_MISTAKES) >= 5


def test_online_softmax_library_hook_is_the_default():
    x = np.random.default_rng(0).normal(size=(2, 9))
    assert np.array_equal(softmax.online_softmax(x, 4, update=softmax.online_update),
                          softmax.online_softmax(x, 4))

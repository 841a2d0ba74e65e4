"""Exercise checks of chapter 03: correct answers pass, stubs fall back, realistic wrong answers
are rejected with their likely cause named (issue 9's corpus for online softmax)."""

from __future__ import annotations

import numpy as np
import pytest

from course_lib import softmax
from course_lib.checks import ExerciseFailed
from course_lib.exercises import ch03

pytestmark = pytest.mark.ch03


def named_cause(message: str) -> str:
    """The text after "likely cause: " in a check's diagnosis ("" when none is named)."""
    return message.partition("likely cause: ")[2]


def stub(*args):
    raise NotImplementedError("Exercise 3.x")


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


def update_returns_none(m, l, x_tile):
    np.maximum(m, x_tile.max(-1))


def update_crashes(m, l, x_tile):
    return m, l + x_tile.sum(axis=3)


def test_update_correct_answers_pass(capsys):
    assert ch03.check_online_update(softmax.online_update) is softmax.online_update
    assert ch03.check_online_update(update_loop) is update_loop
    assert "Exercise 3.1: passed" in capsys.readouterr().out


def test_update_stub_falls_back(capsys):
    assert ch03.check_online_update(stub) is softmax.online_update
    assert "not done yet" in capsys.readouterr().out


@pytest.mark.parametrize("wrong, cause", [
    (update_forgot_rescale, ch03.NO_RESCALE),
    (update_no_max_subtraction, ch03.NO_MAX),
    (update_flipped_sign, ch03.WRONG_SIGN),
    (update_tile_own_max, "exponentiated relative to its own max"),
    (update_returns_old_max, "the running max is returned unchanged"),
])
def test_update_mistakes_rejected_and_named(wrong, cause):
    with pytest.raises(ExerciseFailed) as failure:
        ch03.check_online_update(wrong)
    message = str(failure.value)
    assert message.startswith("✗ Exercise 3.1: wrong answer on case 1")
    assert cause in named_cause(message)


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


def merge_wrong_shape(m_a, l_a, o_a, m_b, l_b, o_b):
    m, l, o = softmax.merge_states_with_output(m_a, l_a, o_a, m_b, l_b, o_b)
    return m, l, o.sum(-1)


def test_merge_correct_answers_pass(capsys):
    assert ch03.check_merge(merge_written_out) is merge_written_out
    assert "Exercise 3.2: passed" in capsys.readouterr().out


def test_merge_stub_falls_back(capsys):
    assert ch03.check_merge(stub) is softmax.merge_states_with_output
    assert "not done yet" in capsys.readouterr().out


@pytest.mark.parametrize("wrong, cause", [
    (merge_no_rescale, "the sums are not rescaled to the common max"),
    (merge_flipped_sign, "the correction has the wrong sign"),
    (merge_old_factor_for_both, "the same correction exp(m_a - m) is used for both parts"),
    (merge_rescales_twice, "the correction is applied twice"),
    (merge_forgot_divide, "not divided by the merged sum"),
    (merge_average, "simply averaged"),
])
def test_merge_mistakes_rejected_and_named(wrong, cause):
    with pytest.raises(ExerciseFailed) as failure:
        ch03.check_merge(wrong)
    message = str(failure.value)
    assert message.startswith("✗ Exercise 3.2: wrong answer")
    assert cause in named_cause(message)


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
                    guard_empty_row=True, normalise_at_end=True):
    """A learner's answer written out, with switches for the lines learners get wrong: each
    switch off is one realistic wrong answer (all on: a right one)."""
    m = np.full(x.shape[:-1], -np.inf)  # (...,)
    l = np.zeros(x.shape[:-1])
    out = np.zeros(x.shape)
    n = x.shape[-1] if every_tile else x.shape[-1] // block_size * block_size
    with np.errstate(invalid="ignore", divide="ignore"):
        for start in range(0, n, block_size):
            tile = x[..., start:start + block_size]  # (..., B)
            m_new = np.maximum(m, tile.max(axis=-1))
            shift = np.where(np.isfinite(m_new), m_new, 0.0) if guard_masked_tile else m_new
            l = (l * np.exp(m - shift) if rescale else l) + np.exp(tile - shift[..., None]).sum(-1)
            m = m_new
            if not normalise_at_end:  # weights of this tile, with the sums so far
                out[..., start:start + block_size] = np.exp(tile - m[..., None]) / l[..., None]
        if not normalise_at_end:
            return out.astype(x.dtype)
        p = np.exp(x - np.where(np.isfinite(m), m, 0.0)[..., None])  # (..., N)
        if guard_empty_row:
            return np.divide(p, l[..., None], out=out, where=l[..., None] > 0).astype(x.dtype)
        return (p / l[..., None]).astype(x.dtype)


def textbook_softmax(x, block_size):
    e = np.exp(x)
    return e / e.sum(axis=-1, keepdims=True)


def test_online_softmax_right_answers_pass(capsys):
    assert ch03.check_online_softmax(learner_softmax) is learner_softmax
    assert ch03.check_online_softmax(softmax.online_softmax) is softmax.online_softmax
    assert "Exercise 3.3: passed (6 cases)" in capsys.readouterr().out


def test_online_softmax_stub_falls_back(capsys):
    assert ch03.check_online_softmax(stub) is softmax.online_softmax
    assert "not done yet" in capsys.readouterr().out


@pytest.mark.filterwarnings("ignore:overflow encountered", "ignore:invalid value encountered")
@pytest.mark.parametrize("wrong, cause", [
    ({"rescale": False}, ch03.NO_RESCALE),
    ({"every_tile": False}, "the short last tile is dropped"),
    ({"guard_empty_row": False}, ch03.ALL_MASKED_ROW_NAN),
    ({"guard_masked_tile": False}, ch03.MASKED_FIRST_TILE_NAN + " (then a guard"),
    ({"guard_masked_tile": False, "guard_empty_row": False}, ch03.MASKED_FIRST_TILE_NAN),
    ({"normalise_at_end": False}, "the weights are written during the first pass"),
    (textbook_softmax, ch03.NO_MAX),
])
def test_online_softmax_mistakes_rejected_and_named(wrong, cause):
    if isinstance(wrong, dict):
        switches = wrong

        def wrong(x, block_size):
            return learner_softmax(x, block_size, **switches)
    with pytest.raises(ExerciseFailed) as failure:
        ch03.check_online_softmax(wrong)
    message = str(failure.value)
    assert message.startswith("✗ Exercise 3.3: wrong answer on case")
    assert message.count("likely cause: ") == 1
    assert cause in named_cause(message)


def test_online_softmax_has_at_least_five_mistakes():
    assert len(ch03.ONLINE_SOFTMAX_MISTAKES) >= 5


def test_online_softmax_library_hook_is_the_default():
    x = np.random.default_rng(0).normal(size=(2, 9))
    assert np.array_equal(softmax.online_softmax(x, 4, update=softmax.online_update),
                          softmax.online_softmax(x, 4))

"""Exercise 0.1: valid answers in several styles pass; wrong answers written as a learner would
are rejected, each with the right cause or with no cause named (never a wrong one)."""

import math

import numpy as np
import pytest

from course_lib.teaching.checks import ExerciseFailed
from course_lib.teaching.exercises import ch00

pytestmark = pytest.mark.ch00


def named_cause(message: str) -> str:
    return message.partition("likely cause: ")[2]


# ---- valid answers, several styles ----------------------------------------------------------

def valid_notebook(q, k):
    d = q.shape[-1]
    return (q @ k.T) / np.sqrt(d)


def valid_einsum(q, k):
    return np.einsum("id,jd->ij", q, k) * (1.0 / math.sqrt(k.shape[1]))


def valid_loops(q, k):
    out = np.zeros((len(q), len(k)))
    for i in range(len(q)):
        for j in range(len(k)):
            out[i, j] = sum(q[i, c] * k[j, c] for c in range(q.shape[1])) / q.shape[1] ** 0.5
    return out


def valid_scale_first(q, k):
    return np.dot(q / np.sqrt(q.shape[1]), np.transpose(k))


@pytest.mark.parametrize("answer", [valid_notebook, valid_einsum, valid_loops, valid_scale_first])
def test_valid_answers_pass(answer, capsys):
    assert ch00.check_scaled_scores(answer) is answer
    assert "Exercise 0.1: passed" in capsys.readouterr().out


# ---- wrong answers, as a learner would write them --------------------------------------------

def by_d(q, k):
    return np.dot(q, k.T) / q.shape[1]


def no_scale(q, k):
    return np.einsum("id,jd->ij", q, k)


def times_sqrt_d(q, k):
    return q @ k.T * math.sqrt(q.shape[-1])


def power_precedence(q, k):
    d = q.shape[-1]
    return q @ k.T / d ** 1/2


def power_precedence_parenthesised(q, k):
    return q @ k.T / (q.shape[1] ** 1/2)


def rounded_root(q, k):
    return q @ k.T / int(np.sqrt(q.shape[-1]))


def len_of_q(q, k):
    return q @ k.T / np.sqrt(len(q))


def keys_count(q, k):
    return q @ k.T / math.sqrt(k.shape[0])


def kq_order(q, k):
    return k @ q.T / np.sqrt(q.shape[1])


def hard_coded_d(q, k):
    return q @ k.T / 8.0  # √64, the d of an example


def rows_only_loop(q, k):  # an off-by-one in a loop: the last key is never scored
    out = np.zeros((q.shape[0], k.shape[0]))
    for j in range(k.shape[0] - 1):
        out[:, j] = q @ k[j] / np.sqrt(q.shape[1])
    return out


def float32_result(q, k):
    return ((q @ k.T) / np.sqrt(q.shape[1])).astype(np.float32)


def square_root_of_scores(q, k):
    return np.sqrt(np.abs(q @ k.T)) * np.sign(q @ k.T)


CORPUS = [
    (by_d, "divided by d instead of sqrt(d)"),
    (no_scale, "forgot the 1/sqrt(d) scale"),
    (times_sqrt_d, "multiplied by sqrt(d)"),
    (power_precedence, "`s / d ** 1/2` is `(s / d) / 2`"),
    (power_precedence_parenthesised, "`(d ** 1/2)` is `(d ** 1) / 2 = d/2`"),
    (rounded_root, "rounded to a whole number"),
    (len_of_q, "q.shape[0], the number of queries"),
    (keys_count, "k.shape[0], the number of keys"),
    (kq_order, "kᵀq-style"),
    (hard_coded_d, None),
    (rows_only_loop, None),
    (float32_result, None),
    (square_root_of_scores, None),
]


@pytest.mark.parametrize("wrong, cause", CORPUS, ids=[f.__name__ for f, _ in CORPUS])
def test_wrong_answers_rejected_with_the_right_cause_or_none(wrong, cause):
    with pytest.raises(ExerciseFailed) as failure:
        ch00.check_scaled_scores(wrong)
    message = str(failure.value)
    assert message.startswith("✗ Exercise 0.1: wrong answer on case")
    if cause:
        assert cause in named_cause(message)
    else:
        assert "likely cause" not in message


def test_every_mistake_model_is_named_as_itself():
    for cause, model in ch00.MISTAKES.items():
        with pytest.raises(ExerciseFailed) as failure:
            ch00.check_scaled_scores(model)
        assert "likely cause: " + cause in str(failure.value)


def test_stub_falls_back(capsys):
    def stub(q, k):
        raise NotImplementedError

    assert ch00.check_scaled_scores(stub) is ch00.scaled_scores
    assert "Exercise 0.1: not done yet" in capsys.readouterr().out


@pytest.mark.library_answers_refused
def test_rerun_with_the_library_version_is_not_a_pass(capsys):
    """The check cell run twice: the name now holds the library's fallback, never a ✓."""
    out = ch00.check_scaled_scores(ch00.scaled_scores)
    assert out is ch00.scaled_scores
    text = capsys.readouterr().out
    assert "not done yet" in text and "✓" not in text


def test_cases_vary_what_the_mistakes_depend_on():
    cases = ch00._cases()
    dims = [(q.shape[0], k.shape[0], q.shape[1]) for q, k in (c.args for c in cases)]
    assert any(math.isqrt(d) ** 2 != d for _, _, d in dims)  # d not a perfect square
    assert all(len({n_q, n_k, d}) == 3 for n_q, n_k, d in dims if n_q > 1)
    assert any(not q.flags.c_contiguous for q, _ in (c.args for c in cases))
    assert max(np.abs(ch00.scaled_scores(*c.args)).max() for c in cases) > 100
    assert all(not np.array_equal(q, np.round(q)) for q, _ in (c.args for c in cases))

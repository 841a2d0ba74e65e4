"""The exercise-check machinery: three outcomes, and survival of any learner code."""

import time

import numpy as np
import pytest
import torch

from course_lib import checks
from course_lib.checks import Case, ExerciseFailed, check_function, check_value

pytestmark = pytest.mark.ch00


def ref(x):
    return np.exp(x - x.max(axis=-1, keepdims=True))


def cases():
    rng = np.random.default_rng(1)
    return [Case((rng.standard_normal((3, 7)),), label="small"),
            Case((rng.standard_normal((5, 13)),), label="ragged")]


def test_pass_prints_one_line_and_returns_learner_fn(capsys):
    fn = lambda x: ref(x)  # noqa: E731
    assert check_function("Exercise 9.9", fn, ref, cases()) is fn
    out = capsys.readouterr().out.strip().splitlines()
    assert out == ["✓ Exercise 9.9: passed (2 cases)."]


def test_not_done_prints_one_line_and_returns_fallback(capsys):
    def stub(x):
        raise NotImplementedError("Exercise 9.9: write it")
    fallback = object()
    assert check_function("Exercise 9.9", stub, ref, cases(), fallback=fallback) is fallback
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and "not done yet" in out[0] and "Exercise 9.9" in out[0]


def test_not_done_defaults_to_reference():
    def stub(x):
        raise NotImplementedError
    assert check_function("Exercise 9.9", stub, ref, cases(), quiet=True) is ref


def test_wrong_answer_diagnosis_has_id_shapes_error_index():
    wrong = lambda x: np.exp(x)  # noqa: E731  forgot the max
    with pytest.raises(ExerciseFailed) as info:
        check_function("Exercise 9.9", wrong, ref, cases())
    msg = str(info.value)
    assert "Exercise 9.9" in msg and "case 1 of 2" in msg
    assert "ndarray(3, 7) float64" in msg
    assert "max abs error" in msg and "first bad element at index (" in msg


def test_wrong_answer_names_recognised_mistake():
    wrong = lambda x: np.exp(x)  # noqa: E731
    with pytest.raises(ExerciseFailed, match="likely cause: forgot to subtract the max"):
        check_function("Exercise 9.9", wrong, ref, cases(),
                       mistakes={"off by two": lambda x: ref(x) * 2,
                                 "forgot to subtract the max": lambda x: np.exp(x)})


def test_unrecognised_mistake_has_no_cause_line():
    with pytest.raises(ExerciseFailed) as info:
        check_function("Exercise 9.9", lambda x: ref(x) + 1, ref, cases(),
                       mistakes={"forgot the max": lambda x: np.exp(x)})
    assert "likely cause" not in str(info.value)


@pytest.mark.parametrize("learner, expected", [
    (lambda x: None, "returned None"),
    (lambda x: ref(x)[:, :-1], "shape (3, 6) but expected (3, 7)"),
    (lambda x: ref(x).astype(np.float32), "dtype float32 but expected float64"),
    (lambda x: torch.from_numpy(ref(x)), "torch.Tensor where a NumPy array is expected"),
    (lambda x: ref(x) * np.nan, "NaN/inf where the answer is finite"),
    (lambda x: (ref(x), ref(x)), "expected an array"),
])
def test_bad_returns_get_one_clear_message(learner, expected):
    with pytest.raises(ExerciseFailed, match=expected.replace("(", r"\(").replace(")", r"\)")):
        check_function("Exercise 9.9", learner, ref, cases())


def test_numpy_where_tensor_expected():
    tref = lambda x: torch.softmax(x, -1)  # noqa: E731
    tcases = [Case((torch.randn(4, 5),))]
    with pytest.raises(ExerciseFailed, match="NumPy array where a torch.Tensor is expected"):
        check_function("Exercise 9.9", lambda x: torch.softmax(x, -1).numpy(), tref, tcases)


def test_learner_exception_is_one_line_not_a_traceback():
    def broken(x):
        return x @ np.ones((99, 1))
    with pytest.raises(ExerciseFailed) as info:
        check_function("Exercise 9.9", broken, ref, cases())
    msg = str(info.value)
    assert "your function raised on case 1" in msg and "ValueError" in msg
    assert "line" in msg and "Traceback" not in msg
    assert len(msg.splitlines()) == 2


def test_infinite_loop_is_stopped_by_time_limit():
    def forever(x):
        while True:
            pass
    start = time.perf_counter()
    with pytest.raises(ExerciseFailed, match="stopped after 0.5 s"):
        check_function("Exercise 9.9", forever, ref, cases(), time_limit=0.5)
    assert time.perf_counter() - start < 5


def test_ipython_renders_only_the_diagnosis():
    err = ExerciseFailed("✗ Exercise 1.1: wrong\n  detail")
    lines = err._render_traceback_()
    assert len(lines) == 2 and "Exercise 1.1" in lines[0] and lines[1] == "  detail"


def test_tolerances_follow_dtype():
    assert checks._default_tolerance(np.zeros(2, np.float32)) == checks.TOLERANCES["float32"]
    assert checks._default_tolerance(torch.zeros(2, dtype=torch.bfloat16)) == checks.TOLERANCES["bfloat16"]
    # float32 rounding passes at the float32 tolerance; a 1e-3 relative error does not
    x = np.linspace(1, 2, 50).astype(np.float32)
    assert checks.compare(x * np.float32(1 + 1e-7), x, *checks.TOLERANCES["float32"]) is None
    assert checks.compare(x * np.float32(1 + 1e-3), x, *checks.TOLERANCES["float32"]) is not None


def test_check_value_outcomes(capsys):
    assert check_value("Exercise 2.1", 1.25, 1.25) == 1.25
    assert "passed" in capsys.readouterr().out

    def todo():
        raise NotImplementedError
    assert check_value("Exercise 2.1", todo, 1.25) == 1.25
    assert "not done yet" in capsys.readouterr().out
    with pytest.raises(ExerciseFailed, match="got 2.5, expected 1.25"):
        check_value("Exercise 2.1", 2.5, 1.25, hint="count bytes, not bits")
    with pytest.raises(ExerciseFailed, match="expected a number"):
        check_value("Exercise 2.1", "1.25", 1.25)
    with pytest.raises(ExerciseFailed, match="expected a number"):
        check_value("Exercise 2.1", None, 1.25)


def test_mistake_that_produces_nan_is_still_named():
    def nan_rows(x):
        out = ref(x)
        out[0] = np.nan
        return out
    with pytest.raises(ExerciseFailed) as info:
        check_function("Exercise 9.9", nan_rows, ref, cases(),
                       mistakes={"query 0 sees no key (mask off by one)": nan_rows})
    msg = str(info.value)
    assert "NaN/inf where the answer is finite" in msg  # never accepted as right
    assert "likely cause: query 0 sees no key" in msg

"""The exercise-check machinery: three outcomes, and survival of any learner code."""

import io
import os
import signal
import sys
import time

import numpy as np
import pytest
import torch

from course_lib.teaching import checks
from course_lib.teaching.checks import Case, ExerciseFailed, check_function, check_value

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
    # the error in one line, then the other cases' outcome (every case ran: evidence)
    assert msg.splitlines()[2:] == ["  (also crashes on case 2; right on 0 of 2)"], msg


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


# ----------------------------------------------------------------------------------------------
# Learner code that exits, interrupts, changes its inputs or prints a flood: one diagnosis each,
# and the next check in the same process works as if nothing happened.

MAX_MESSAGE_CHARS = 5_000  # a diagnosis is a few lines, whatever the learner printed
FLOOD_CHARS = 10**7  # what the flooding learners print (10 MB), far above OUTPUT_KEEP_CHARS


def _assert_next_check_passes(capsys):
    """A correct answer checked right after passes, prints only its line, and the process is
    back as it was: stdout, the time limit's signal handlers and timer."""
    alarm_handler = signal.getsignal(signal.SIGALRM)
    int_handler = signal.getsignal(signal.SIGINT)
    assert not isinstance(sys.stdout, checks.CapturedOutput)
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    assert check_function("Exercise 9.9", lambda x: ref(x), ref, cases()) is not None
    assert capsys.readouterr().out.splitlines() == ["✓ Exercise 9.9: passed (2 cases)."]
    assert signal.getsignal(signal.SIGALRM) is alarm_handler
    assert signal.getsignal(signal.SIGINT) is int_handler
    with pytest.raises(ExerciseFailed, match="stopped after 0.2 s"):  # the time limit still bites
        check_function("Exercise 9.9", _forever, ref, cases(), time_limit=0.2)


def _forever(x):
    while True:
        pass


@pytest.mark.parametrize("code, shown", [(None, "SystemExit (line"), (0, "SystemExit: 0"),
                                         (3, "SystemExit: 3"), ("bye", "SystemExit: bye")])
def test_sys_exit_is_a_diagnosis_not_the_end(code, shown, capsys):
    def exits(x):
        sys.exit(code)
    with pytest.raises(ExerciseFailed) as info:
        check_function("Exercise 9.9", exits, ref, cases())
    msg = str(info.value)
    assert msg.startswith("✗ Exercise 9.9: your function called sys.exit() on case 1"), msg
    assert shown in msg and "sys.exit(code)" in msg and "return its result" in msg
    assert len(msg.splitlines()) == 3
    _assert_next_check_passes(capsys)


def test_keyboard_interrupt_raised_by_the_learner_is_a_diagnosis(capsys):
    def interrupts(x):
        raise KeyboardInterrupt
    with pytest.raises(ExerciseFailed) as info:
        check_function("Exercise 9.9", interrupts, ref, cases())
    msg = str(info.value)
    assert msg.startswith("✗ Exercise 9.9: your function raised KeyboardInterrupt on case 1"), msg
    assert "raise KeyboardInterrupt" in msg and "raise an ordinary exception" in msg
    _assert_next_check_passes(capsys)


def test_a_real_interrupt_still_stops_the_check(capsys):
    # A kernel's SIGINT handler is Python's default one; a test that ran earlier in this pytest
    # worker (a library that installs its own) must not decide what this test sees.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)

    def pressed_interrupt(x):  # what Jupyter's Interrupt button does: SIGINT to the process
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(5)  # the handler runs before this ends
    try:
        with pytest.raises(KeyboardInterrupt) as info:
            check_function("Exercise 9.9", pressed_interrupt, ref, cases())
    finally:
        signal.signal(signal.SIGINT, previous)
    assert not isinstance(info.value, ExerciseFailed)
    _assert_next_check_passes(capsys)


def test_global_settings_changed_by_the_learner_are_restored(capsys):
    errors, dtype = np.geterr(), torch.get_default_dtype()

    def meddles(x):
        np.seterr(all="raise")
        torch.set_default_dtype(torch.float64 if dtype != torch.float64 else torch.float32)
        torch.set_grad_enabled(False)
        sys.stdout = sys.stderr = io.StringIO()
        sys.exit(0)
    with pytest.raises(ExerciseFailed, match="called sys.exit"):
        check_function("Exercise 9.9", meddles, ref, cases())
    assert np.geterr() == errors and torch.get_default_dtype() == dtype
    assert torch.is_grad_enabled()
    _assert_next_check_passes(capsys)


def _halve_in_place(x):
    x *= 0.5  # the classic: an in-place update of an input
    return ref(2 * x)


def test_in_place_change_of_a_numpy_input_is_named(capsys):
    inputs = cases()
    before = [c.args[0].copy() for c in inputs]
    with pytest.raises(ExerciseFailed) as info:
        check_function("Exercise 9.9", _halve_in_place, ref, inputs)
    msg = str(info.value)
    assert msg.startswith("✗ Exercise 9.9: your function changed its input `x` in place on case 1"), msg
    assert "`x = x * s` rather than `x *= s`" in msg and len(msg.splitlines()) == 2
    assert all(np.array_equal(c.args[0], b) for c, b in zip(inputs, before))  # not poisoned
    _assert_next_check_passes(capsys)


def tref_attention(q, k, v):
    return torch.softmax(q @ k.transpose(-2, -1), dim=-1) @ v


def tcases():
    gen = torch.Generator().manual_seed(9)
    return [Case(tuple(torch.randn(n, 4, generator=gen) for n in (5, 7, 7)), label="5×7")]


def test_in_place_change_of_a_tensor_input_is_named(capsys):
    def zeroes_v(q, k, v):
        out = tref_attention(q, k, v)
        v[0] = 0  # correct output, but v is changed
        return out
    inputs = tcases()
    v_before = inputs[0].args[2].clone()
    with pytest.raises(ExerciseFailed, match="your function changed its input `v` in place"):
        check_function("Exercise 9.9", zeroes_v, tref_attention, inputs)
    assert torch.equal(inputs[0].args[2], v_before)
    _assert_next_check_passes(capsys)


def test_arguments_the_exercise_may_update_are_exempt(capsys):
    def accumulate(acc, x):
        return acc + x

    def learner(acc, x):
        acc += x  # allowed: the contract lets acc be updated
        return acc
    acc = np.zeros(3)
    inputs = [Case((acc, np.arange(3.0))), Case((acc, np.ones(3)))]
    assert check_function("Exercise 9.9", learner, accumulate, inputs, writable=("acc",)) is learner
    assert not acc.any()  # still the original zeros: each call got its own copy
    with pytest.raises(ExerciseFailed, match="changed its input `acc` in place"):
        check_function("Exercise 9.9", learner, accumulate, inputs)
    capsys.readouterr()
    _assert_next_check_passes(capsys)


def test_a_flood_of_output_on_a_wrong_answer_is_cut_to_an_excerpt(capsys):
    def floods(x):
        print("x" * FLOOD_CHARS)
        print("never shown", file=sys.stderr)
        return np.exp(x)
    with pytest.raises(ExerciseFailed) as info:
        check_function("Exercise 9.9", floods, ref, cases())
    msg = str(info.value)
    assert len(msg) < MAX_MESSAGE_CHARS
    assert "wrong answer on case 1" in msg and "your function printed 20.0 MB:" in msg  # both cases run (evidence)
    assert "  | xxxx" in msg and "… 20.0 MB more output hidden" in msg
    captured = capsys.readouterr()
    assert "xxxx" not in captured.out + captured.err and "never shown" not in captured.err
    _assert_next_check_passes(capsys)


def test_a_flood_of_output_on_a_pass_is_cut_to_an_excerpt(capsys):
    def chatty(x):
        for i in range(FLOOD_CHARS // 100):
            print(f"{i:>6} " + "." * 93)  # 100-character lines
        return ref(x)
    assert check_function("Exercise 9.9", chatty, ref, cases()) is chatty
    out = capsys.readouterr().out
    assert len(out) < MAX_MESSAGE_CHARS
    lines = out.splitlines()
    assert lines[0] == "✓ Exercise 9.9: passed (2 cases)."
    assert lines[1] == "  your function printed 20.2 MB:" and lines[2].startswith("  |      0 ....")
    assert lines[-1].startswith("  … ") and lines[-1].endswith(" MB more output hidden")
    assert len(lines) == 2 + checks.OUTPUT_EXCERPT_LINES + 1
    _assert_next_check_passes(capsys)


def test_a_short_print_is_shown_in_full(capsys):
    def prints_shape(x):
        print(x.shape)
        return ref(x)
    check_function("Exercise 9.9", prints_shape, ref, cases())
    assert capsys.readouterr().out.splitlines() == [
        "✓ Exercise 9.9: passed (2 cases).", "  your function printed:", "  | (3, 7)", "  | (5, 13)"]


# ---- issue 19: causes from evidence -----------------------------------------------------------

def _softmax_rows(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _evidence_cases():
    rng = np.random.default_rng(19)
    big = 800.0 + rng.normal(size=(3, 6))
    masked = rng.normal(size=(4, 5))
    masked[1] = -np.inf
    return [Case((rng.normal(size=(2, 7)),), label="small"), Case((big,), label="scores near 800"),
            Case((masked,), label="row 1 fully masked")]


def _safe_softmax(x):
    m = x.max(-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.exp(x - m)
    s = e.sum(-1, keepdims=True)
    return np.where(s > 0, e / np.where(s > 0, s, 1.0), 0.0)


def test_a_crash_names_the_learners_line_not_numpys():
    def crashes(x):
        w = np.ones((3, 3))
        return x @ w  # shapes do not line up
    with pytest.raises(ExerciseFailed) as info:
        check_function("Exercise 9.9", crashes, _safe_softmax, _evidence_cases())
    msg = str(info.value)
    assert "`return x @ w  # shapes do not line up`" in msg
    assert "numpy" not in msg.split("raised", 1)[1].lower().replace("numpy operations", "")


def test_nan_from_a_fully_masked_row_is_traced_to_the_subtraction():
    def no_guard(x):
        m = x.max(-1, keepdims=True)
        e = np.exp(x - m)
        return e / e.sum(-1, keepdims=True)
    with pytest.raises(ExerciseFailed) as info:
        check_function("Exercise 9.9", no_guard, _safe_softmax, _evidence_cases())
    msg = str(info.value)
    assert "row 1 fully masked" in msg
    assert "invalid value encountered in subtract" in msg and "`e = np.exp(x - m)`" in msg
    assert "likely cause" not in msg  # no mistake models given: nothing guessed


def test_overflow_is_traced_to_the_exp():
    def no_max(x):
        e = np.exp(x)
        return e / e.sum(-1, keepdims=True)
    with pytest.raises(ExerciseFailed) as info:
        check_function("Exercise 9.9", no_max, _safe_softmax, _evidence_cases()[:2])
    msg = str(info.value)
    assert "overflow encountered in exp" in msg and "`e = np.exp(x)`" in msg


def test_torch_nan_is_traced_to_its_first_operation():
    import torch

    def ref(x):
        return torch.softmax(x, -1)

    def no_max(x):
        e = torch.exp(x)
        return e / e.sum(-1, keepdim=True)
    cases = [Case((torch.randn(3, 4, dtype=torch.float64) + 900,), label="near 900")]
    with pytest.raises(ExerciseFailed) as info:
        check_function("Exercise 9.9", no_max, ref, cases)
    msg = str(info.value)
    assert "the first inf came from torch's exp" in msg and "`e = torch.exp(x)`" in msg
    assert "then the first NaN came from torch's" in msg


def test_a_cause_is_named_only_when_one_model_fits_every_case():
    def no_rescale_like(x):  # wrong only by a factor of 2 on every row
        return _safe_softmax(x) * 2

    models = {"times two": lambda x: _safe_softmax(x) * 2,
              "times two on the first case only, right elsewhere":
                  lambda x: _safe_softmax(x) * (2 if x.shape == (2, 7) else 1)}
    with pytest.raises(ExerciseFailed) as info:
        check_function("Exercise 9.9", no_rescale_like, _safe_softmax, _evidence_cases(),
                       mistakes=models)
    msg = str(info.value)
    assert "likely cause: times two" in msg and "first case only" not in msg
    twins = {"A": lambda x: _safe_softmax(x) * 2, "B": lambda x: 2 * _safe_softmax(x)}
    with pytest.raises(ExerciseFailed) as info:
        check_function("Exercise 9.9", no_rescale_like, _safe_softmax, _evidence_cases(),
                       mistakes=twins)
    msg = str(info.value)
    assert "likely cause" not in msg and "does not tell them apart" in msg


def test_numpy_broadcasting_error_of_a_missing_trailing_axis_gets_its_hint():
    cases = [Case((np.ones((2, 3)), np.ones((2, 3, 4))))]

    def reference(w, o):
        return w[..., None] * o

    with pytest.raises(ExerciseFailed) as info:
        check_function("Exercise 0.0", lambda w, o: w * o, reference, cases)
    assert ("hint: shape (2, 3) is shape (2, 3, 4) without its last axis: NumPy lines shapes up "
            "from the right, so 3 meets 4 — give the (2, 3) operand a trailing axis of 1 "
            "([..., None], shape (2, 3, 1))") in str(info.value), str(info.value)
    # shapes that differ otherwise: NumPy's error alone, no hint
    with pytest.raises(ExerciseFailed) as info:
        check_function("Exercise 0.0", lambda w, o: w.T * o, reference, cases)
    assert "hint: shape" not in str(info.value)


def test_a_mistake_models_outputs_are_remembered_for_the_next_check_of_the_same_cases():
    """A check rebuilds its cases from a seed every time it runs: the second wrong answer's check
    (or the learner's next attempt) reuses each model's outputs instead of running the model again,
    names the same cause, and a model that raised raises again."""
    calls = {"halved": 0, "broken": 0}

    def halved(x):
        calls["halved"] += 1
        return x / 2

    def broken(x):
        calls["broken"] += 1
        raise ValueError("this model cannot run here")

    def cases():  # rebuilt from the seed each time, as a check does
        rng = np.random.default_rng(5)
        return [Case((rng.standard_normal(7),)), Case((torch.from_numpy(rng.standard_normal((3, 4))),))]

    mistakes = {"halves": halved, "breaks": broken}
    for attempt in range(2):
        runs = [checks.CaseRun(n, c, c.args[0], c.args[0] / 2, "wrong", (1e-9, 1e-9))
                for n, c in enumerate(cases(), 1)]
        assert checks.consistent_causes(runs, mistakes) == ["halves"], attempt
    assert calls == {"halved": 2, "broken": 1}  # each (model, case) ran once over both attempts
    other = [Case((np.arange(3.0),))]  # other inputs: run again
    runs = [checks.CaseRun(1, other[0], other[0].args[0], other[0].args[0] / 2, "wrong", (1e-9, 1e-9))]
    assert checks.consistent_causes(runs, mistakes) == ["halves"] and calls["halved"] == 3
    # a strided view is not its contiguous copy: strides are part of what a kernel model reads
    x = torch.arange(12.0).reshape(3, 4)
    assert checks._fingerprint(x.t()) != checks._fingerprint(x.t().contiguous())
    assert checks._fingerprint((x, lambda: 0)) is None  # a function: not remembered
    # a dataclass (a case's memory layout) by its fields
    from course_lib.teaching.kernel_checks import Layout
    a, b = Layout((0, 2, 1, 3), (0, 0, 1, 4)), Layout((0, 1, 2, 3), (0, 0, 1, 4))
    assert checks._fingerprint(a) == checks._fingerprint(Layout((0, 2, 1, 3), (0, 0, 1, 4)))
    assert checks._fingerprint(a) not in (None, checks._fingerprint(b))

"""Exercises 2.1 (softmax intensity) and 2.2 (QKᵀ intensity): right answers pass, a corpus of
realistic wrong ones is rejected and diagnosed by name."""

import pytest

from course_lib.teaching.checks import ExerciseFailed
from course_lib.teaching.exercises import ch02

pytestmark = pytest.mark.ch02


def softmax_right(seq_len, head_dim, bytes_per_elem):
    flops = 5 * seq_len**2
    return flops / (2 * seq_len**2 * bytes_per_elem)


def softmax_read_only(seq_len, head_dim, bytes_per_elem):
    return 5 * seq_len**2 / (seq_len**2 * bytes_per_elem)


def softmax_bits(seq_len, head_dim, bytes_per_elem):
    return 5 * seq_len**2 / (2 * seq_len**2 * bytes_per_elem * 8)


def softmax_four_flops(seq_len, head_dim, bytes_per_elem):
    return 4 * seq_len**2 / (2 * seq_len**2 * bytes_per_elem)


def softmax_inverted(seq_len, head_dim, bytes_per_elem):
    return (2 * seq_len**2 * bytes_per_elem) / (5 * seq_len**2)


def softmax_times_d(seq_len, head_dim, bytes_per_elem):
    return 5 * seq_len**2 * head_dim / (2 * seq_len**2 * bytes_per_elem)


def softmax_hardcoded_fp16(seq_len, head_dim, bytes_per_elem):
    return 1.25


def softmax_elements_not_bytes(seq_len, head_dim, bytes_per_elem):
    n2 = seq_len * seq_len
    return 5 * n2 / (n2 + n2)


def softmax_floor_division(seq_len, head_dim, bytes_per_elem):
    return (5 * seq_len**2) // (2 * seq_len**2 * bytes_per_elem)


def softmax_reads_three_times(seq_len, head_dim, bytes_per_elem):  # one read per pass
    return 5 * seq_len**2 / (4 * seq_len**2 * bytes_per_elem)


def softmax_valid_constants(seq_len, head_dim, bytes_per_elem):
    from course_lib.attention import costmodel

    elements = seq_len**2
    return costmodel.SOFTMAX_FLOPS_PER_ELEMENT * elements / (2 * elements * bytes_per_elem)


def qk_right(seq_len, head_dim, bytes_per_elem):
    flops = 2 * seq_len * seq_len * head_dim
    return flops / ((2 * seq_len * head_dim + seq_len * seq_len) * bytes_per_elem)


def qk_no_write(seq_len, head_dim, bytes_per_elem):
    return 2 * seq_len**2 * head_dim / (2 * seq_len * head_dim * bytes_per_elem)


def qk_bits(seq_len, head_dim, bytes_per_elem):
    return qk_right(seq_len, head_dim, bytes_per_elem) / 8


def qk_one_flop_per_mac(seq_len, head_dim, bytes_per_elem):
    return qk_right(seq_len, head_dim, bytes_per_elem) / 2


def qk_forgot_k(seq_len, head_dim, bytes_per_elem):
    return 2 * seq_len**2 * head_dim / ((seq_len * head_dim + seq_len**2) * bytes_per_elem)


def qk_inverted(seq_len, head_dim, bytes_per_elem):
    return 1 / qk_right(seq_len, head_dim, bytes_per_elem)


def qk_square_matmul_formula(seq_len, head_dim, bytes_per_elem):  # treats it as N×N×N
    return 2 * seq_len**3 / (3 * seq_len**2 * bytes_per_elem)


def qk_three_squares(seq_len, head_dim, bytes_per_elem):  # Q, K, S each N² elements
    return 2 * seq_len**2 * head_dim / (3 * seq_len**2 * bytes_per_elem)


def qk_floor_division(seq_len, head_dim, bytes_per_elem):
    return 2 * seq_len**2 * head_dim // ((2 * seq_len * head_dim + seq_len**2) * bytes_per_elem)


def qk_elements_not_bytes(seq_len, head_dim, bytes_per_elem):
    return 2 * seq_len**2 * head_dim / (2 * seq_len * head_dim + seq_len**2)


def qk_reads_s_too(seq_len, head_dim, bytes_per_elem):  # "S is read back": not in this kernel
    return 2 * seq_len**2 * head_dim / ((2 * seq_len * head_dim + 2 * seq_len**2) * bytes_per_elem)


def qk_valid_bytes_first(seq_len, head_dim, bytes_per_elem):
    bytes_q = bytes_k = seq_len * head_dim * bytes_per_elem
    bytes_s = seq_len * seq_len * bytes_per_elem
    return 2.0 * seq_len * seq_len * head_dim / (bytes_q + bytes_k + bytes_s)


SOFTMAX_CORPUS = [
    (softmax_read_only, "also writes P"),
    (softmax_bits, "bits instead of bytes"),
    (softmax_four_flops, "4 FLOPs per element"),
    (softmax_inverted, "not bytes ÷ FLOPs"),
    (softmax_times_d, "does not multiply by d"),
    (softmax_hardcoded_fp16, None),
    (softmax_elements_not_bytes, "bytes_per_elem is not used"),
    (softmax_floor_division, "integer division"),
    (softmax_reads_three_times, None),
]
QK_CORPUS = [
    (qk_no_write, "write of S"),
    (qk_bits, "bits instead of bytes"),
    (qk_one_flop_per_mac, "a multiply-add is 2 FLOPs"),
    (qk_forgot_k, "only Q is read"),
    (qk_inverted, "not bytes ÷ FLOPs"),
    (qk_square_matmul_formula, None),
    (qk_three_squares, "each counted as N² elements"),
    (qk_floor_division, "integer division"),
    (qk_elements_not_bytes, "bytes_per_elem is not used"),
    (qk_reads_s_too, None),
]


def test_right_answers_pass(capsys):
    for fn in (softmax_right, softmax_valid_constants):
        assert ch02.check_softmax_intensity(fn) is fn
    for fn in (qk_right, qk_valid_bytes_first):
        assert ch02.check_qk_intensity(fn) is fn
    out = capsys.readouterr().out
    assert out.count("Exercise 2.1: passed (6 cases)") == 2
    assert out.count("Exercise 2.2: passed (6 cases)") == 2


def _assert_cause(message, cause):
    """The named cause contains ``cause``, or (cause None) no cause is named."""
    if cause:
        assert cause in message.partition("likely cause: ")[2], message
    else:
        assert "likely cause" not in message and "two known mistakes" not in message, message


@pytest.mark.parametrize("wrong,cause", SOFTMAX_CORPUS, ids=[f.__name__ for f, _ in SOFTMAX_CORPUS])
def test_wrong_softmax_intensity(wrong, cause):
    with pytest.raises(ExerciseFailed) as info:
        ch02.check_softmax_intensity(wrong)
    assert str(info.value).startswith("✗ Exercise 2.1")
    _assert_cause(str(info.value), cause)


@pytest.mark.parametrize("wrong,cause", QK_CORPUS, ids=[f.__name__ for f, _ in QK_CORPUS])
def test_wrong_qk_intensity(wrong, cause):
    with pytest.raises(ExerciseFailed) as info:
        ch02.check_qk_intensity(wrong)
    assert str(info.value).startswith("✗ Exercise 2.2")
    _assert_cause(str(info.value), cause)


def test_not_done_and_garbage():
    def stub(seq_len, head_dim, bytes_per_elem):
        raise NotImplementedError

    from course_lib.attention import costmodel

    assert ch02.check_qk_intensity(stub, quiet=True) is costmodel.qk_intensity
    with pytest.raises(ExerciseFailed, match="returned None"):
        ch02.check_softmax_intensity(lambda n, d, b: None)
    with pytest.raises(ExerciseFailed, match="your function raised"):
        ch02.check_softmax_intensity(lambda n, d, b: 1 / 0)


# ---- Exercise 2.3: the whole cost table ------------------------------------------------------

from course_lib.attention import costmodel  # noqa: E402
from course_lib.platform import hardware


def _learner_table(seq_len, head_dim, dtype, copies, gpu_name, causal=True, dropout=True, *,
                   macs=2, write_s=True, read_v=True, b=None, heads=True, invert=False,
                   peak=None, gb_units=False, flip=False, half=False, softmax=5,
                   gb_per_s=False, read_only=False, copies_bytes=True, pv_writes_nn=False):
    """A learner's table written out plainly, with one thing done its own (wrong) way."""
    n, d = seq_len, head_dim
    b = costmodel.bytes_per_element(dtype) if b is None else b
    gpu = hardware.get_gpu(gpu_name)
    if gb_units:
        balance = gpu.peak_tflops(dtype) / gpu.bandwidth_gb_s
    elif gb_per_s:
        balance = gpu.peak_flops(dtype) / gpu.bandwidth_gb_s
    else:
        balance = gpu.peak_flops(peak or dtype) / gpu.bandwidth_bytes_per_s
    matmul = macs * n * n * d * (0.5 if half and causal else 1)
    per_head = {"qk": (matmul, 2 * n * d, n * n if write_s else 0),
                "mask": (n * n, n * n, n * n),
                "softmax": (softmax * n * n, n * n, n * n),
                "dropout": (2 * n * n, n * n, n * n),
                "pv": (matmul, n * n + (n * d if read_v else 0), n * n if pv_writes_nn else n * d)}
    c = copies if heads else 1
    table = []
    for step in ("qk", "mask", "softmax", "dropout", "pv"):
        if (step == "mask" and not causal) or (step == "dropout" and not dropout):
            continue
        flops, read, written = per_head[step]
        cb = c if copies_bytes else 1
        flops, read, written = c * flops, cb * read * b, cb * written * b
        moved = read if read_only else read + written
        intensity = moved / flops if invert else flops / moved
        memory = intensity < balance
        table.append((step, flops, read, written, intensity,
                      "memory" if memory != flip else "compute"))
    return table


def table_right(*args, **kwargs):
    return _learner_table(*args, **kwargs)


def _wrong(name, **knobs):
    def fn(*args, **kwargs):
        return _learner_table(*args, **kwargs, **knobs)
    fn.__name__ = name
    return fn


def table_always_all_steps(seq_len, head_dim, dtype, copies, gpu_name, causal=True, dropout=True):
    return _learner_table(seq_len, head_dim, dtype, copies, gpu_name, True, True)


def table_dict(*args, **kwargs):
    return {row[0]: row[1:] for row in _learner_table(*args, **kwargs)}


def table_valid_from_library(seq_len, head_dim, dtype, copies, gpu_name, causal=True,
                             dropout=True):
    """A valid answer built on costmodel.step_costs and hardware.balance_point, rows as lists."""
    costs = costmodel.step_costs(seq_len, head_dim, dtype, batch=copies)
    balance = hardware.balance_point(gpu_name, dtype)
    steps = [s for s in costmodel.STEPS if not (s == "mask" and not causal)
             and not (s == "dropout" and not dropout)]
    return [[s, costs[s].flops, costs[s].bytes_read, costs[s].bytes_written, costs[s].intensity,
             "compute" if costs[s].intensity >= balance else "memory"] for s in steps]


def table_valid_numpy(seq_len, head_dim, dtype, copies, gpu_name, causal=True, dropout=True):
    """A valid answer with NumPy integers and a per-step loop of if/elif."""
    import numpy as np

    n, d, c = np.int64(seq_len), np.int64(head_dim), np.int64(copies)
    b = np.int64(4 if dtype == "float32" else 2)
    gpu = hardware.get_gpu(gpu_name)
    balance = gpu.peak_tflops(dtype) * 1e12 / (gpu.bandwidth_gb_s * 1e9)
    rows = []
    for step in ("qk", "mask", "softmax", "dropout", "pv"):
        if step == "qk":
            f, r, w = 2 * n * n * d, 2 * n * d, n * n
        elif step == "mask":
            if not causal:
                continue
            f, r, w = n * n, n * n, n * n
        elif step == "softmax":
            f, r, w = 5 * n * n, n * n, n * n
        elif step == "dropout":
            if not dropout:
                continue
            f, r, w = 2 * n * n, n * n, n * n
        else:
            f, r, w = 2 * n * n * d, n * n + n * d, n * d
        f, r, w = f * c, r * c * b, w * c * b
        rows.append((step, f, r, w, f / (r + w), "memory" if f / (r + w) < balance else "compute"))
    return rows


def table_returns_none(*args, **kwargs):
    _learner_table(*args, **kwargs)


def table_crashes_after_case_one(seq_len, *args, **kwargs):
    if seq_len != 3001:
        raise KeyError("gpu")
    return _learner_table(seq_len, *args, **kwargs, macs=1)


TABLE_CORPUS = [
    (_wrong("one_flop_per_mac", macs=1), "a multiply-add is 2 FLOPs", "'qk' (S = QKᵀ), flops"),
    (_wrong("forgot_write_of_s", write_s=False), "write of S", "'qk' (S = QKᵀ), bytes_written"),
    (_wrong("pv_reads_only_p", read_v=False), "PV reads V as well as P",
     "'pv' (O = PV), bytes_read"),
    (_wrong("dtype_bytes_ignored", b=1), "bytes per element ignored",
     "'qk' (S = QKᵀ), bytes_read"),
    (_wrong("heads_ignored", heads=False), "batch·heads ignored", "case 1 of 7"),
    (_wrong("intensity_inverted", invert=True), "not bytes ÷ FLOPs",
     "'qk' (S = QKᵀ), intensity"),
    (_wrong("softmax_four_flops", softmax=4), "not 4", "'softmax' (softmax), flops"),
    (_wrong("causal_halves_matmuls", half=True), "halved for causal", "case 2 of 7"),
    (_wrong("balance_in_tflops_per_gb", gb_units=True), "without converting units",
     "'softmax' (softmax), bound: got 'compute', expected 'memory'"),
    (_wrong("balance_from_fp16_peak", peak="float16"), "fp16 tensor-core peak", "case 4 of 7"),
    (_wrong("bound_swapped", flip=True), "softmax is memory-bound",
     "'qk' (S = QKᵀ), bound: got 'memory', expected 'compute'"),
    (table_always_all_steps, None, "the kernels that run here are ['qk', 'softmax', 'pv']"),
    (table_dict, None, "expected a list of rows"),
    (_wrong("balance_per_gb", gb_per_s=True), "FLOP/s ÷ GB/s", "bound: got 'memory'"),
    (_wrong("intensity_from_reads", read_only=True), "only the bytes read",
     "'qk' (S = QKᵀ), intensity"),
    (_wrong("copies_on_flops_only", copies_bytes=False), "multiplies the FLOPs but not the bytes",
     "case 1 of 7"),
    (_wrong("pv_writes_n_squared", pv_writes_nn=True), None, "'pv' (O = PV), bytes_written"),
    (table_returns_none, None, "expected a list of rows"),
    (table_crashes_after_case_one, "a multiply-add is 2 FLOPs", "case 1 of 7"),
]


@pytest.mark.parametrize("right", [table_right, table_valid_from_library, table_valid_numpy])
def test_right_table_passes(right, capsys):
    assert ch02.check_cost_table(right) is right
    assert "Exercise 2.3: passed (7 cases)" in capsys.readouterr().out


def test_every_table_mistake_model_is_named_as_itself():
    for cause, model in ch02.MISTAKES_TABLE.items():
        with pytest.raises(ExerciseFailed) as info:
            ch02.check_cost_table(model)
        assert "likely cause: " + cause in str(info.value)
    for check, mistakes in ((ch02.check_softmax_intensity, ch02.MISTAKES_SOFTMAX),
                            (ch02.check_qk_intensity, ch02.MISTAKES_QK)):
        for cause, model in mistakes.items():
            with pytest.raises(ExerciseFailed) as info:
                check(model)
            assert "likely cause: " + cause in str(info.value)


@pytest.mark.parametrize("wrong,cause,where", TABLE_CORPUS,
                         ids=[f.__name__ for f, _, _ in TABLE_CORPUS])
def test_wrong_table_is_rejected_and_diagnosed(wrong, cause, where):
    with pytest.raises(ExerciseFailed) as info:
        ch02.check_cost_table(wrong)
    message = str(info.value)
    assert message.startswith("✗ Exercise 2.3: wrong answer on case")
    assert where in message
    _assert_cause(message, cause)


def test_table_not_done_crash_and_print(capsys):
    def stub(seq_len, head_dim, dtype, copies, gpu_name, causal=True, dropout=True):
        raise NotImplementedError

    assert ch02.check_cost_table(stub) is ch02.reference_cost_table
    assert "Exercise 2.3: not done yet" in capsys.readouterr().out
    with pytest.raises(ExerciseFailed, match="your function raised"):
        ch02.check_cost_table(lambda *args, **kwargs: 1 / 0)

    def chatty_wrong(*args, **kwargs):
        print("debugging the table")
        return _learner_table(*args, **kwargs, macs=1)

    with pytest.raises(ExerciseFailed, match="debugging the table"):
        ch02.check_cost_table(chatty_wrong)


def test_reference_table_is_the_cost_model():
    table = ch02.reference_cost_table(1024, 64, "float16", 1, "A100 80GB")
    costs = costmodel.step_costs(1024, 64, "float16")
    assert [row[0] for row in table] == list(costmodel.STEPS)
    for step, flops, read, written, intensity, bound in table:
        assert (flops, read, written) == (costs[step].flops, costs[step].bytes_read,
                                          costs[step].bytes_written)
        assert bound == ("memory" if intensity < hardware.balance_point("A100 80GB") else "compute")
    bounds = {row[5] for case in ch02.TABLE_CASES for row in ch02.reference_cost_table(
        *case.args, **case.kwargs)}
    assert bounds == {"memory", "compute"}  # the cases include a compute-bound step
    assert len(ch02.MISTAKES_TABLE) >= 5


def test_table_hints_and_skeleton():
    from course_lib.teaching.widgets.hints import HintLadder

    ladder = HintLadder("Exercise 2.3", ch02.TABLE_HINTS, skeleton=ch02.TABLE_SKELETON)
    assert ladder.next_hint() == ch02.TABLE_HINTS[0]
    assert "balance = ..." in ladder.show_skeleton()


def test_a_case_that_quotes_the_reading_names_its_article():
    """Issue 32: "the reading's N=1024" in a check message did not say which article."""
    import re

    for case in [*ch02.CASES, *ch02.TABLE_CASES]:
        if re.search(r"\bthe reading\b|reading's", case.label):
            raise AssertionError(f"a case label quotes the reading without its article: {case.label}")
    assert any("the CS 229s notes'" in case.label for case in ch02.TABLE_CASES)

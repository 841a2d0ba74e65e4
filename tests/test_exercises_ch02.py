"""Exercises 2.1 (softmax intensity) and 2.2 (QKᵀ intensity): right answers pass, a corpus of
realistic wrong ones is rejected and diagnosed by name."""

import pytest

from course_lib.checks import ExerciseFailed
from course_lib.exercises import ch02

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


SOFTMAX_CORPUS = [
    (softmax_read_only, "also writes P"),
    (softmax_bits, "bits instead of bytes"),
    (softmax_four_flops, "4 FLOPs per element"),
    (softmax_inverted, "not bytes ÷ FLOPs"),
    (softmax_times_d, "does not multiply by d"),
    (softmax_hardcoded_fp16, None),
]
QK_CORPUS = [
    (qk_no_write, "write of S"),
    (qk_bits, "bits instead of bytes"),
    (qk_one_flop_per_mac, "a multiply-add is 2 FLOPs"),
    (qk_forgot_k, "only Q is read"),
    (qk_inverted, "not bytes ÷ FLOPs"),
    (qk_square_matmul_formula, None),
]


def test_right_answers_pass(capsys):
    assert ch02.check_softmax_intensity(softmax_right) is softmax_right
    assert ch02.check_qk_intensity(qk_right) is qk_right
    out = capsys.readouterr().out
    assert "Exercise 2.1: passed" in out and "Exercise 2.2: passed" in out


@pytest.mark.parametrize("wrong,cause", SOFTMAX_CORPUS, ids=[f.__name__ for f, _ in SOFTMAX_CORPUS])
def test_wrong_softmax_intensity(wrong, cause):
    with pytest.raises(ExerciseFailed) as info:
        ch02.check_softmax_intensity(wrong)
    assert str(info.value).startswith("✗ Exercise 2.1")
    if cause:
        assert "likely cause" in str(info.value) and cause in str(info.value)


@pytest.mark.parametrize("wrong,cause", QK_CORPUS, ids=[f.__name__ for f, _ in QK_CORPUS])
def test_wrong_qk_intensity(wrong, cause):
    with pytest.raises(ExerciseFailed) as info:
        ch02.check_qk_intensity(wrong)
    assert str(info.value).startswith("✗ Exercise 2.2")
    if cause:
        assert "likely cause" in str(info.value) and cause in str(info.value)


def test_not_done_and_garbage():
    def stub(seq_len, head_dim, bytes_per_elem):
        raise NotImplementedError

    from course_lib import costmodel

    assert ch02.check_qk_intensity(stub, quiet=True) is costmodel.qk_intensity
    with pytest.raises(ExerciseFailed, match="returned None"):
        ch02.check_softmax_intensity(lambda n, d, b: None)
    with pytest.raises(ExerciseFailed, match="your function raised"):
        ch02.check_softmax_intensity(lambda n, d, b: 1 / 0)


# ---- Exercise 2.3: the whole cost table ------------------------------------------------------

from course_lib import costmodel, hardware  # noqa: E402


def _learner_table(seq_len, head_dim, dtype, copies, gpu_name, causal=True, dropout=True, *,
                   macs=2, write_s=True, read_v=True, b=None, heads=True, invert=False,
                   peak=None, gb_units=False, flip=False, half=False, softmax=5):
    """A learner's table written out plainly, with one thing done its own (wrong) way."""
    n, d = seq_len, head_dim
    b = costmodel.bytes_per_element(dtype) if b is None else b
    gpu = hardware.get_gpu(gpu_name)
    if gb_units:
        balance = gpu.peak_tflops(dtype) / gpu.bandwidth_gb_s
    else:
        balance = gpu.peak_flops(peak or dtype) / gpu.bandwidth_bytes_per_s
    matmul = macs * n * n * d * (0.5 if half and causal else 1)
    per_head = {"qk": (matmul, 2 * n * d, n * n if write_s else 0),
                "mask": (n * n, n * n, n * n),
                "softmax": (softmax * n * n, n * n, n * n),
                "dropout": (2 * n * n, n * n, n * n),
                "pv": (matmul, n * n + (n * d if read_v else 0), n * d)}
    c = copies if heads else 1
    table = []
    for step in ("qk", "mask", "softmax", "dropout", "pv"):
        if (step == "mask" and not causal) or (step == "dropout" and not dropout):
            continue
        flops, read, written = per_head[step]
        flops, read, written = c * flops, c * read * b, c * written * b
        intensity = (read + written) / flops if invert else flops / (read + written)
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


TABLE_CORPUS = [
    (_wrong("one_flop_per_mac", macs=1), "a multiply-add is 2 FLOPs", "'qk' (S = QKᵀ), flops"),
    (_wrong("forgot_write_of_s", write_s=False), "write of S", "'qk' (S = QKᵀ), bytes_written"),
    (_wrong("pv_reads_only_p", read_v=False), "PV reads V as well as P",
     "'pv' (O = PV), bytes_read"),
    (_wrong("dtype_bytes_ignored", b=1), "bytes per element ignored",
     "'qk' (S = QKᵀ), bytes_read"),
    (_wrong("heads_ignored", heads=False), "batch·heads ignored", "case 1 of 5"),
    (_wrong("intensity_inverted", invert=True), "not bytes ÷ FLOPs",
     "'qk' (S = QKᵀ), intensity"),
    (_wrong("softmax_four_flops", softmax=4), "not 4", "'softmax' (softmax), flops"),
    (_wrong("causal_halves_matmuls", half=True), "halved for causal", "case 2 of 5"),
    (_wrong("balance_in_tflops_per_gb", gb_units=True), "without converting units",
     "'softmax' (softmax), bound: got 'compute', expected 'memory'"),
    (_wrong("balance_from_fp16_peak", peak="float16"), "fp16 tensor-core peak", "case 4 of 5"),
    (_wrong("bound_swapped", flip=True), "softmax is memory-bound",
     "'qk' (S = QKᵀ), bound: got 'memory', expected 'compute'"),
    (table_always_all_steps, None, "the kernels that run here are ['qk', 'softmax', 'pv']"),
    (table_dict, None, "expected a list of rows"),
]


def test_right_table_passes(capsys):
    assert ch02.check_cost_table(table_right) is table_right
    assert "Exercise 2.3: passed (5 cases)" in capsys.readouterr().out


@pytest.mark.parametrize("wrong,cause,where", TABLE_CORPUS,
                         ids=[f.__name__ for f, _, _ in TABLE_CORPUS])
def test_wrong_table_is_rejected_and_diagnosed(wrong, cause, where):
    with pytest.raises(ExerciseFailed) as info:
        ch02.check_cost_table(wrong)
    message = str(info.value)
    assert message.startswith("✗ Exercise 2.3: wrong answer on case")
    assert where in message
    if cause:
        assert "likely cause: " in message and cause in message.partition("likely cause: ")[2]
    else:
        assert "likely cause" not in message


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
    from course_lib.widgets.hints import HintLadder

    ladder = HintLadder("Exercise 2.3", ch02.TABLE_HINTS, skeleton=ch02.TABLE_SKELETON)
    assert ladder.next_hint() == ch02.TABLE_HINTS[0]
    assert "balance = ..." in ladder.show_skeleton()

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

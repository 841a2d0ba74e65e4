"""Checks for chapter 02 (the memory wall).

* Exercise 2.1 — ``softmax_intensity(seq_len, head_dim, bytes_per_elem)``: FLOP per HBM byte of
  the softmax kernel (reads S, writes P; 5 FLOPs per element).
* Exercise 2.2 — ``qk_intensity(seq_len, head_dim, bytes_per_elem)``: FLOP per HBM byte of
  ``S = QKᵀ`` (reads Q and K, writes S; 2 FLOPs per multiply-add).

The answers are :func:`course_lib.costmodel.softmax_intensity` and
:func:`course_lib.costmodel.qk_intensity`; the cases mix sizes, head dims and dtypes so that a
formula which happens to be right for one of them is still caught.
"""

from __future__ import annotations

from course_lib import costmodel
from course_lib.checks import Case, check_function

__all__ = ["CASES", "check_softmax_intensity", "check_qk_intensity", "MISTAKES_SOFTMAX",
           "MISTAKES_QK"]

BITS_PER_BYTE = 8

# (seq_len, head_dim, bytes per element): fp16 at the reading's N=1024, fp32, irregular sizes.
CASES = [
    Case((1024, 64, 2), label="N=1024, d=64, fp16"),
    Case((4096, 128, 4), label="N=4096, d=128, fp32"),
    Case((1000, 80, 2), label="N=1000, d=80, bf16"),
    Case((333, 48, 8), label="N=333, d=48, fp64"),
]


def _softmax_parts(n, d, b):
    return costmodel.SOFTMAX_FLOPS_PER_ELEMENT * n * n, n * n * b, n * n * b  # flops, read, write


def _qk_parts(n, d, b):
    return costmodel.FLOPS_PER_MULTIPLY_ADD * n * n * d, 2 * n * d * b, n * n * b


MISTAKES_SOFTMAX = {
    "only the read of S is counted; the kernel also writes P (N² more elements)":
        lambda n, d, b: _softmax_parts(n, d, b)[0] / _softmax_parts(n, d, b)[1],
    "bits instead of bytes: an element is bytes_per_elem bytes, not 8× that":
        lambda n, d, b: _softmax_parts(n, d, b)[0] / (BITS_PER_BYTE * sum(_softmax_parts(n, d, b)[1:])),
    "4 FLOPs per element: the running sum is an operation too (max, subtract, exp, sum, divide = 5)":
        lambda n, d, b: 4 * n * n / sum(_softmax_parts(n, d, b)[1:]),
    "intensity is FLOPs ÷ bytes, not bytes ÷ FLOPs":
        lambda n, d, b: sum(_softmax_parts(n, d, b)[1:]) / _softmax_parts(n, d, b)[0],
    "softmax does not multiply by d: it touches each of the N² scores a fixed number of times":
        lambda n, d, b: d * _softmax_parts(n, d, b)[0] / sum(_softmax_parts(n, d, b)[1:]),
}

MISTAKES_QK = {
    "the write of S (N² elements) is not counted — that write is what makes QKᵀ memory-bound":
        lambda n, d, b: _qk_parts(n, d, b)[0] / _qk_parts(n, d, b)[1],
    "bits instead of bytes: an element is bytes_per_elem bytes, not 8× that":
        lambda n, d, b: _qk_parts(n, d, b)[0] / (BITS_PER_BYTE * sum(_qk_parts(n, d, b)[1:])),
    "a multiply-add is 2 FLOPs: QKᵀ costs 2·N²·d, not N²·d":
        lambda n, d, b: n * n * d / sum(_qk_parts(n, d, b)[1:]),
    "only Q is read: K (another N·d elements) has to come from HBM too":
        lambda n, d, b: _qk_parts(n, d, b)[0] / ((n * d + n * n) * b),
    "intensity is FLOPs ÷ bytes, not bytes ÷ FLOPs":
        lambda n, d, b: sum(_qk_parts(n, d, b)[1:]) / _qk_parts(n, d, b)[0],
}


def check_softmax_intensity(fn, **kwargs):
    """Check Exercise 2.1 against :func:`course_lib.costmodel.softmax_intensity`."""
    return check_function("Exercise 2.1", fn, costmodel.softmax_intensity, CASES,
                          mistakes=MISTAKES_SOFTMAX, **kwargs)


def check_qk_intensity(fn, **kwargs):
    """Check Exercise 2.2 against :func:`course_lib.costmodel.qk_intensity`."""
    return check_function("Exercise 2.2", fn, costmodel.qk_intensity, CASES,
                          mistakes=MISTAKES_QK, **kwargs)

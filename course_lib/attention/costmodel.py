"""The cost model of standard (materialised) attention: memory, FLOPs, HBM bytes, intensity.

Chapter 01 uses the memory side: the ``N × N`` score matrix against ``Q``, ``K``, ``V``.
Chapter 02 uses the traffic side: for each of the five kernels standard attention launches, how
many floating-point operations it does and how many bytes it moves between HBM and the chip:

====  =========  ===============================  =======================================
step  name       reads (elements, per head)        writes (elements, per head)
====  =========  ===============================  =======================================
1     ``qk``     Q, K: ``2·N·d``                    S: ``N²``
2     ``mask``   S: ``N²``                           S: ``N²``
3     ``softmax`` S: ``N²``                          P: ``N²``
4     ``dropout`` P: ``N²``                          P: ``N²``
5     ``pv``     P, V: ``N² + N·d``                 O: ``N·d``
====  =========  ===============================  =======================================

A kernel's **arithmetic intensity** is FLOPs ÷ bytes; the **roofline** says it cannot run faster
than ``min(peak FLOP/s, intensity × bandwidth)``. The FlashAttention HBM-access formulas are
chapter 04's (``course_lib.attention.iomodel``), not this module's.

Counting conventions (named constants below, so every chapter counts the same way):

* a multiply-add is 2 FLOPs, so ``(N×d)·(d×N)`` costs ``2·N²·d``;
* softmax costs 5 FLOPs per element: compare for the max, subtract it, exp, add to the sum,
  divide. (One reading counts 4 — it leaves out the sum — and gets 1 FLOP/byte instead of 1.25.)
* the mask is one select per element, computed from indices (no mask tensor is read);
* dropout is 2 FLOPs per element (compare a random number with p, rescale by 1/(1-p)); the
  random-number generation is not counted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from course_lib.platform.hardware import dtype_name, get_gpu, normalize_dtype

__all__ = [
    "BYTES_PER_ELEMENT", "SOFTMAX_FLOPS_PER_ELEMENT", "MASK_FLOPS_PER_ELEMENT",
    "DROPOUT_FLOPS_PER_ELEMENT", "FLOPS_PER_MULTIPLY_ADD", "STEPS", "FA_BACKWARD_FLOP_RATIO",
    "bytes_per_element", "score_matrix_entries", "MemoryBreakdown", "attention_memory",
    "max_seq_len", "StepCost", "step_costs", "total_cost", "softmax_intensity", "qk_intensity",
    "matmul_cost", "attainable_flops", "attention_flops", "format_bytes",
]

# Bytes per element of each dtype (the sizes NumPy/torch store).
BYTES_PER_ELEMENT = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2}

FLOPS_PER_MULTIPLY_ADD = 2
SOFTMAX_FLOPS_PER_ELEMENT = 5  # max-compare, subtract, exp, sum, divide
MASK_FLOPS_PER_ELEMENT = 1  # one select
DROPOUT_FLOPS_PER_ELEMENT = 2  # compare with p, rescale by 1/(1-p)

# The five kernels of standard attention, in order (the reading's steps 1-5).
STEPS = ("qk", "mask", "softmax", "dropout", "pv")
STEP_LABELS = {"qk": "S = QKᵀ", "mask": "mask", "softmax": "softmax", "dropout": "dropout",
               "pv": "O = PV"}

# FlashAttention papers' benchmark convention: the backward does 2.5× the forward's FLOPs
# (five matmuls instead of two: dV, dP, dQ, dK, plus recomputing S), so fwd+bwd is 3.5×.
FA_BACKWARD_FLOP_RATIO = 2.5
_PASS_FACTORS = {"fwd": 1.0, "bwd": FA_BACKWARD_FLOP_RATIO, "fwd_bwd": 1.0 + FA_BACKWARD_FLOP_RATIO}
_CAUSAL_FACTOR = 0.5  # a causal mask keeps (about) half of the N×N scores


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise TypeError(f"{name} must be a positive integer, got {value!r}")
    value = int(value)
    if value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value}")
    return value


def bytes_per_element(dtype) -> int:
    """Bytes one element of ``dtype`` takes (str like ``"fp16"``, NumPy or torch dtype).

    >>> bytes_per_element("bf16"), bytes_per_element("float32")
    (2, 4)
    """
    if dtype_name(dtype) in ("float64", "fp64", "double"):
        return BYTES_PER_ELEMENT["float64"]
    try:
        return BYTES_PER_ELEMENT[normalize_dtype(dtype)]
    except ValueError:
        raise ValueError(f"dtype must be one of float64, float32, float16, bfloat16, got {dtype!r}"
                         ) from None


def _bytes(dtype_or_bytes) -> int:
    """Accept a dtype or a bytes-per-element count."""
    if isinstance(dtype_or_bytes, (int, float)) and not isinstance(dtype_or_bytes, bool):
        if dtype_or_bytes <= 0:
            raise ValueError(f"bytes per element must be positive, got {dtype_or_bytes}")
        return dtype_or_bytes
    return bytes_per_element(dtype_or_bytes)


def format_bytes(n: float) -> str:
    """Human-readable binary size: ``format_bytes(2**31) == '2.00 GiB'``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


# ---------------------------------------------------------------- memory (chapter 01)

def score_matrix_entries(seq_len: int) -> int:
    """Entries of one head's score matrix: ``N²`` (1,048,576 at N=1,024)."""
    seq_len = _positive_int("seq_len", seq_len)
    return seq_len * seq_len


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes naive attention keeps in device memory (all heads, batch entries and layers).

    ``qkv_bytes`` and ``output_bytes`` grow linearly with N; ``score_bytes`` (the ``N × N``
    matrices) quadratically.
    """

    qkv_bytes: int  # Q, K, V: 3 · B · H · N · d elements
    output_bytes: int  # O: B · H · N · d
    score_bytes: int  # score_matrices · B · H · N² elements

    @property
    def linear_bytes(self) -> int:
        return self.qkv_bytes + self.output_bytes

    @property
    def total_bytes(self) -> int:
        return self.linear_bytes + self.score_bytes


def attention_memory(seq_len: int, head_dim: int, dtype="float16", *, batch: int = 1,
                     heads: int = 1, layers: int = 1, score_matrices: int = 1) -> MemoryBreakdown:
    """Memory of standard attention's tensors.

    Args:
        seq_len: N. head_dim: d. dtype: element type (or bytes per element).
        batch, heads, layers: how many independent attentions are held at once.
        score_matrices: how many ``N × N`` matrices are alive together (1 = just S; a forward
            that keeps S and P both alive is 2; training keeps P for the backward).

    Returns:
        :class:`MemoryBreakdown` in bytes.
    """
    n = _positive_int("seq_len", seq_len)
    d = _positive_int("head_dim", head_dim)
    copies = (_positive_int("batch", batch) * _positive_int("heads", heads)
              * _positive_int("layers", layers))
    b = _bytes(dtype)
    return MemoryBreakdown(
        qkv_bytes=3 * copies * n * d * b,
        output_bytes=copies * n * d * b,
        score_bytes=_positive_int("score_matrices", score_matrices) * copies * n * n * b,
    )


def max_seq_len(memory_bytes: float, head_dim: int, dtype="float16", *, batch: int = 1,
                heads: int = 1, layers: int = 1, score_matrices: int = 1) -> int:
    """Largest N whose :func:`attention_memory` total fits in ``memory_bytes``.

    Solves ``a·N² + c·N ≤ memory`` for the quadratic (a) and linear (c) coefficients.
    """
    if not memory_bytes > 0:
        raise ValueError(f"memory_bytes must be positive, got {memory_bytes!r}")
    one = attention_memory(1, head_dim, dtype, batch=batch, heads=heads, layers=layers,
                           score_matrices=score_matrices)
    a, c = one.score_bytes, one.linear_bytes  # bytes per N² and per N
    n = int((-c + math.sqrt(c * c + 4 * a * memory_bytes)) / (2 * a))
    # guard against rounding at the boundary
    while n > 0 and a * n * n + c * n > memory_bytes:
        n -= 1
    while a * (n + 1) ** 2 + c * (n + 1) <= memory_bytes:
        n += 1
    return n


# ---------------------------------------------------------------- traffic (chapter 02)

@dataclass(frozen=True)
class StepCost:
    """FLOPs and HBM traffic of one kernel."""

    name: str
    flops: float
    bytes_read: float
    bytes_written: float

    @property
    def bytes(self) -> float:
        return self.bytes_read + self.bytes_written

    @property
    def intensity(self) -> float:
        """FLOP per byte of HBM traffic."""
        return self.flops / self.bytes

    @property
    def label(self) -> str:
        return STEP_LABELS.get(self.name, self.name)


def step_costs(seq_len: int, head_dim: int, dtype="float16", *, batch: int = 1,
               heads: int = 1) -> dict[str, StepCost]:
    """FLOPs and HBM bytes of each of the five kernels of standard attention (see module doc).

    Args:
        seq_len: N (queries = keys). head_dim: d. dtype: element type (or bytes per element).
        batch, heads: multiply FLOPs and bytes alike (the intensity does not change).

    Returns:
        ``{"qk": StepCost, "mask": ..., "softmax": ..., "dropout": ..., "pv": ...}``.
    """
    n = _positive_int("seq_len", seq_len)
    d = _positive_int("head_dim", head_dim)
    copies = _positive_int("batch", batch) * _positive_int("heads", heads)
    b = _bytes(dtype)
    nn, nd = n * n, n * d
    matmul_flops = FLOPS_PER_MULTIPLY_ADD * nn * d
    per_head = [
        # name, flops, elements read, elements written
        ("qk", matmul_flops, 2 * nd, nn),
        ("mask", MASK_FLOPS_PER_ELEMENT * nn, nn, nn),
        ("softmax", SOFTMAX_FLOPS_PER_ELEMENT * nn, nn, nn),
        ("dropout", DROPOUT_FLOPS_PER_ELEMENT * nn, nn, nn),
        ("pv", matmul_flops, nn + nd, nd),
    ]
    return {name: StepCost(name, copies * flops, copies * read * b, copies * written * b)
            for name, flops, read, written in per_head}


def total_cost(seq_len: int, head_dim: int, dtype="float16", *, batch: int = 1,
               heads: int = 1) -> StepCost:
    """The five kernels of standard attention added up."""
    steps = step_costs(seq_len, head_dim, dtype, batch=batch, heads=heads).values()
    return StepCost("standard attention", sum(s.flops for s in steps),
                    sum(s.bytes_read for s in steps), sum(s.bytes_written for s in steps))


def softmax_intensity(seq_len: int, head_dim: int, bytes_per_elem: float) -> float:
    """Arithmetic intensity of the softmax kernel: ``5N² / (2N²·bytes)`` — no N or d left."""
    return step_costs(seq_len, head_dim, bytes_per_elem)["softmax"].intensity


def qk_intensity(seq_len: int, head_dim: int, bytes_per_elem: float) -> float:
    """Arithmetic intensity of ``S = QKᵀ``: ``2N²d / ((2Nd + N²)·bytes)``."""
    return step_costs(seq_len, head_dim, bytes_per_elem)["qk"].intensity


def matmul_cost(m: int, k: int, n: int, dtype="float16") -> StepCost:
    """An ``(m×k)·(k×n)`` matmul that reads both inputs and writes its output once."""
    m, k, n = (_positive_int(name, x) for name, x in (("m", m), ("k", k), ("n", n)))
    b = _bytes(dtype)
    return StepCost("matmul", FLOPS_PER_MULTIPLY_ADD * m * k * n, (m * k + k * n) * b, m * n * b)


def attainable_flops(intensity, gpu, dtype="float16"):
    """Roofline: the fastest a kernel of this intensity can run, ``min(peak, intensity × BW)``.

    Args:
        intensity: FLOP per byte (a number or a NumPy array).
        gpu: a name from :data:`course_lib.platform.hardware.GPUS` or a :class:`~course_lib.platform.hardware.GPU`.
        dtype: which peak to use (float16/bfloat16 tensor cores, or float32).

    Returns:
        FLOP/s, same shape as ``intensity``.
    """
    import numpy as np

    spec = get_gpu(gpu)
    x = np.asarray(intensity, dtype=float)
    if np.any(~(x >= 0)):
        raise ValueError(f"intensity must be non-negative, got {intensity!r}")
    out = np.minimum(spec.peak_flops(dtype), x * spec.bandwidth_bytes_per_s)
    return float(out) if out.ndim == 0 else out


def attention_flops(batch: int, heads: int, seq_len: int, head_dim: int, causal: bool = False,
                    pass_: str = "fwd") -> float:
    """FLOPs of attention as the FlashAttention papers count them for TFLOP/s figures.

    Forward: the two matmuls, ``4·B·H·N²·d`` (softmax and the rest are not counted); halved when
    ``causal``. The backward counts 2.5× the forward, so forward+backward is 3.5×.

    Args:
        pass_: ``"fwd"``, ``"bwd"`` or ``"fwd_bwd"``.
    """
    if pass_ not in _PASS_FACTORS:
        raise ValueError(f"pass_ must be one of {', '.join(_PASS_FACTORS)}, got {pass_!r}")
    b, h, n, d = (_positive_int(name, x) for name, x in
                  (("batch", batch), ("heads", heads), ("seq_len", seq_len), ("head_dim", head_dim)))
    forward = 2 * FLOPS_PER_MULTIPLY_ADD * b * h * n * n * d
    if causal:
        forward *= _CAUSAL_FACTOR
    return forward * _PASS_FACTORS[pass_]

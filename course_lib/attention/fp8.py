"""FP8 (e4m3) attention with FlashAttention-3's "incoherent processing", emulated (chapter 09).

Hopper's tensor cores multiply 8-bit floats at twice the FP16 rate, but e4m3 keeps only 3
mantissa bits and a range of ±448, so each tensor is first divided by a **scale**,
``amax(|x|) / E4M3_MAX``, that maps its largest magnitude onto the largest e4m3 value
(:func:`quantize_e4m3`; one scale per (batch, head), or per block of rows). The reading (FA3
section) names the problem: "naive FP8 attention has high quantization error due to outliers",
and the fix: "apply Hadamard transforms (structured orthogonal matrices that redistribute values
across dimensions) to Q and K before quantization. This spreads outliers across dimensions".

The rotation is ``R = diag(s) · H`` (:func:`random_rotation`): ``H`` the normalised Sylvester
Hadamard matrix (:func:`hadamard`), ``s`` random signs. It is orthogonal, so rotating q and k by
the same ``R`` leaves every score unchanged, ``(qR)(kR)ᵀ = q R Rᵀ kᵀ = qkᵀ``; V is not rotated.
Rows are vectors and ``x @ R`` flips the signs of ``x``'s columns first, then mixes them: an
outlier in one column is spread evenly over all ``d`` columns (a one-hot row comes out with
every entry ``±|x|/√d``). The signs must come first: with ``H · diag(s)`` they would only flip
the signs of ``x @ H``, a fixed rotation that turns some spread-out rows (the rows of ``H``)
into one-hot outliers.

:func:`fp8_attention_emulated` runs attention the way an FP8 kernel rounds it (q, k, v through
e4m3, scores and softmax in float32, P through e4m3 for the second matmul) and
:func:`fp8_error_table` measures the error on FA3's outlier inputs (:func:`outlier_inputs`).
Everything is torch on the CPU (``torch.float8_e4m3fn`` casts work there); the kernel that does
it on the GPU is :func:`course_lib.kernels.hopper.fp8_attention_forward`.
"""

from __future__ import annotations

import math
from numbers import Integral

import torch

from course_lib.attention.iomodel import validate_block_size
from course_lib.attention.reference import default_scale, naive_attention_torch

__all__ = [
    "E4M3_MAX", "E4M3_DTYPE", "DEFAULT_FP8_BLOCK", "OUTLIER_FRACTION", "OUTLIER_STD",
    "hadamard", "random_rotation", "quantize_e4m3", "dequantize_e4m3", "outlier_inputs",
    "fp8_attention_emulated", "rmse", "fp8_error_table",
]

# The FP8 format of attention's inputs: 4 exponent bits, 3 mantissa bits, "fn" = finite (no
# infinity; only S.1111.111 is NaN, so S.1111.110 = 1.75 · 2⁸ = 448 is the largest value). From
# the OCP 8-bit floating point specification (OFP8, 2023), Table 1, and torch.finfo(E4M3_DTYPE).max.
E4M3_DTYPE = torch.float8_e4m3fn
E4M3_MAX = 448.0

# Rows per scale when quantizing by blocks: one scale per tile of 64 rows, the tile height of the
# course's kernels in the interpreter (kernels/tuning.py, INTERPRETER_FORWARD).
DEFAULT_FP8_BLOCK = 64

# FA3's accuracy experiment (Shah et al. 2024, FlashAttention-3, §4.3): entries N(0, 1) plus, on
# 0.1 % of them, N(0, 100) — standard deviation 10 — to imitate the outlier features of LLMs.
OUTLIER_FRACTION = 0.001
OUTLIER_STD = 10.0


def hadamard(d: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """The normalised Sylvester Hadamard matrix: ``H Hᵀ = I``, every entry ``±1/√d``.

    Built by doubling, ``H_2n = [[H_n, H_n], [H_n, -H_n]]`` from ``H_1 = [1]``, then divided by √d.

    Args:
        d: the size, a power of two (1, 2, 4, …).
        dtype: the result's dtype.

    Returns:
        ``(d, d)`` tensor, symmetric and orthogonal.

    Raises:
        ValueError: naming ``d`` when it is not a power of two.
    """
    if isinstance(d, bool) or not isinstance(d, Integral) or d < 1 or d & (d - 1):
        raise ValueError(f"d must be a power of two (1, 2, 4, 8, …), got {d!r}")
    h = torch.ones((1, 1), dtype=torch.float64)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], dim=1), torch.cat([h, -h], dim=1)], dim=0)
    return (h / math.sqrt(d)).to(dtype)


def random_rotation(d: int, seed: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """FA3's random orthogonal matrix ``R = diag(s) · H`` with random signs ``s = ±1``.

    Applied as ``x @ R`` on the last axis: the signs of x's columns are flipped, then the
    Hadamard matrix spreads each column over all ``d``. The same ``seed`` gives the same ``R``
    (q and k must be rotated by the same matrix).

    Args:
        d: head dim, a power of two. seed: seeds the ``torch.Generator`` that draws ``s``.
        dtype: the result's dtype.

    Returns:
        ``(d, d)`` orthogonal tensor, ``R Rᵀ = I``.

    Raises:
        ValueError: naming ``d`` when it is not a power of two.
    """
    h = hadamard(d)
    generator = torch.Generator().manual_seed(seed)
    signs = torch.randint(0, 2, (d,), generator=generator) * 2 - 1  # (d,) ±1
    return (signs[:, None] * h).to(dtype)  # row c of H times s_c


def _check_tensor(name: str, x) -> None:
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        got = f"Tensor {x.dtype}" if isinstance(x, torch.Tensor) else type(x).__name__
        raise TypeError(f"{name} must be a floating-point torch.Tensor, got {got}")
    if x.ndim < 2 or x.shape[-2] < 1:
        raise ValueError(f"{name} must have shape (..., N, d) with N >= 1, got {tuple(x.shape)}")


def _block_rows(n: int, block) -> tuple[int, int]:
    """``(block, n_blocks)``: rows per scale (all ``n`` when ``block`` is None) and their count."""
    block = n if block is None else validate_block_size("block", block)
    return block, -(-n // block)


def _scale_per_row(scale: torch.Tensor, block: int, n: int) -> torch.Tensor:
    """``(..., n_blocks, 1)`` scales -> ``(..., n, 1)``: each block's scale on each of its rows."""
    return scale.repeat_interleave(block, dim=-2)[..., :n, :]


def quantize_e4m3(x: torch.Tensor, block: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric scaling to e4m3: ``x ≈ x_fp8 · scale``, one scale per block of rows.

    Each block of ``block`` rows of the last two axes (all ``d`` columns; the last block may be
    shorter) gets ``scale = amax(|x|) / E4M3_MAX``, so its largest magnitude lands on ±448.
    A block of zeros gets scale 1 (not 0: 0/0 would be NaN). The scaled values are clamped to
    ±E4M3_MAX before the cast: torch's cast does not saturate everywhere (measured: torch 2.11
    turns 464 and above into NaN, CPU and CUDA; torch 2.13's CPU cast saturates to 448).

    Args:
        x: ``(..., N, d)`` floating point, any device.
        block: rows per scale; None for one scale per (…) matrix (per (batch, head)).

    Returns:
        ``(x_fp8, scale)``: ``x_fp8`` ``(..., N, d)`` ``torch.float8_e4m3fn``; ``scale``
        ``(..., n_blocks, 1)`` float32 with ``n_blocks = ceil(N / block)`` (1 when ``block`` is
        None, so ``x_fp8.float() * scale`` broadcasts back).

    Raises:
        TypeError, ValueError: naming ``x`` or ``block``.
    """
    _check_tensor("x", x)
    n = x.shape[-2]
    block, n_blocks = _block_rows(n, block)
    x32 = x.to(torch.float32)
    padded = torch.nn.functional.pad(x32, (0, 0, 0, n_blocks * block - n))  # zero rows: no amax
    amax = padded.abs().unflatten(-2, (n_blocks, block)).amax(dim=(-2, -1))  # (..., n_blocks)
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))[..., None]
    scaled = x32 / _scale_per_row(scale, block, n)  # (..., N, d), |scaled| <= 448
    return scaled.clamp(-E4M3_MAX, E4M3_MAX).to(E4M3_DTYPE), scale


def dequantize_e4m3(x_fp8: torch.Tensor, scale: torch.Tensor,
                    block: int | None = None) -> torch.Tensor:
    """The values ``x_fp8`` stands for: ``x_fp8 · scale``, each block's scale on its rows.

    Args:
        x_fp8: ``(..., N, d)`` e4m3. scale: ``(..., n_blocks, 1)`` from :func:`quantize_e4m3`.
        block: the ``block`` given to :func:`quantize_e4m3`.

    Returns:
        ``(..., N, d)`` float32.

    Raises:
        ValueError: naming ``scale`` when its shape does not fit ``x_fp8`` and ``block``.
    """
    n = x_fp8.shape[-2]
    block, n_blocks = _block_rows(n, block)
    if scale.ndim != x_fp8.ndim or scale.shape[-2:] != (n_blocks, 1):
        raise ValueError(f"scale must have shape (..., {n_blocks}, 1) for x_fp8 of shape "
                         f"{tuple(x_fp8.shape)} and block={block}, got {tuple(scale.shape)}")
    return x_fp8.to(torch.float32) * _scale_per_row(scale.to(torch.float32), block, n)


def _through_e4m3(x: torch.Tensor, block: int | None) -> torch.Tensor:
    """``x`` as an FP8 kernel sees it: quantized, then scaled back (float32)."""
    return dequantize_e4m3(*quantize_e4m3(x, block), block)


def outlier_inputs(shape, seed: int, outlier_fraction: float = OUTLIER_FRACTION,
                   outlier_std: float = OUTLIER_STD) -> torch.Tensor:
    """Random attention inputs with outliers, as in FA3's accuracy experiment.

    Entries are N(0, 1) plus, on a random ``outlier_fraction`` of them, an extra
    N(0, ``outlier_std``²): with the defaults, the paper's N(0, 1) + N(0, 100)·Bernoulli(0.001).

    Args:
        shape: e.g. ``(B, H, N, d)``. seed: seeds the ``torch.Generator``.
        outlier_fraction: probability that an entry is an outlier, in [0, 1].
        outlier_std: standard deviation of an outlier's extra term.

    Returns:
        float64 tensor of ``shape`` on the CPU.
    """
    if not 0.0 <= outlier_fraction <= 1.0:
        raise ValueError(f"outlier_fraction must be in [0, 1], got {outlier_fraction!r}")
    if not (math.isfinite(outlier_std) and outlier_std >= 0):
        raise ValueError(f"outlier_std must be finite and >= 0, got {outlier_std!r}")
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=generator, dtype=torch.float64)
    extra = outlier_std * torch.randn(shape, generator=generator, dtype=torch.float64)
    hit = torch.rand(shape, generator=generator, dtype=torch.float64) < outlier_fraction
    return x + extra * hit


def fp8_attention_emulated(q, k, v, causal: bool = False, rotate: bool = False,
                           block: int | None = None, seed: int = 0) -> torch.Tensor:
    """Attention rounded the way an FP8 FlashAttention forward rounds it, on any device.

    Steps: q and k rotated by the same :func:`random_rotation` (when ``rotate``); q, k, v through
    e4m3 (:func:`quantize_e4m3`, then scaled back); scores ``scale · q kᵀ`` and softmax in
    float32; the probabilities ``p = exp(s − m)`` (in [0, 1]) through e4m3, as FA3 feeds them to
    the second matmul, and the row sums taken before that rounding; ``o = p v / l``.

    Args:
        q: ``(..., N_q, d)``; k, v: ``(..., N_k, d)``. causal: mask key ``j > i`` (top-left).
        rotate: apply the random Hadamard rotation to q and k (d a power of two).
        block: rows per scale (None: one scale per (…) matrix). seed: the rotation's seed.

    Returns:
        ``o`` ``(..., N_q, d)`` float32.
    """
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_tensor(name, x)
    if q.shape[-1] != k.shape[-1] or k.shape[-2] != v.shape[-2]:
        raise ValueError(f"q, k, v must be (..., N_q, d), (..., N_k, d), (..., N_k, d_v), got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    d = q.shape[-1]
    if rotate:
        rotation = random_rotation(d, seed).to(q.device)  # (d, d) float64
        q, k = q.double() @ rotation, k.double() @ rotation  # scores unchanged: R Rᵀ = I
    q8, k8, v8 = (_through_e4m3(x, block) for x in (q, k, v))  # float32
    s = default_scale(d) * (q8 @ k8.transpose(-1, -2))  # (..., N_q, N_k)
    if causal:
        visible = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril()
        s = s.masked_fill(~visible, float("-inf"))
    m = s.amax(dim=-1, keepdim=True)  # (..., N_q, 1)
    p = torch.exp(s - m)  # (..., N_q, N_k) in [0, 1]
    l = p.sum(dim=-1, keepdim=True)  # (..., N_q, 1)
    p8 = p.to(E4M3_DTYPE).to(torch.float32)  # no scale: [0, 1] fits e4m3's range
    return (p8 @ v8) / l


def rmse(got: torch.Tensor, want: torch.Tensor) -> float:
    """Root-mean-square error ``sqrt(mean((got − want)²))``, computed in float64."""
    return float((got.double() - want.double()).pow(2).mean().sqrt())


def fp8_error_table(shape=(1, 4, 1024, 128), seed: int = 0, block: int = DEFAULT_FP8_BLOCK,
                    causal: bool = False) -> list[dict]:
    """RMSE of FP16 and FP8 attention against float64 on FA3's outlier inputs.

    Rows (``method``, ``rmse``):

    - fp16 inputs: q, k, v rounded to float16, attention in float32 (the reference code);
    - fp8, one scale per (batch, head) — the "naive FP8" of the reading;
    - fp8, one scale per block of ``block`` rows;
    - fp8, per block, q and k rotated first (FA3's block quantization + incoherent processing).

    The reading reports that the rotation reduces FA3's quantization error 2.6×; this table
    measures our emulation's factor instead (the kernels differ in details). Takes about 0.4 s
    on a 2-core CPU at the default shape.

    Args:
        shape: ``(B, H, N, d)``, d a power of two. seed: seeds the inputs and the rotation.
        block: rows per scale of the per-block rows. causal: causal attention.

    Returns:
        A list of ``{"method": str, "rmse": float}``, in the order above.
    """
    q, k, v = outlier_inputs((3, *shape), seed).unbind(0)  # (B, H, N, d) each, float64
    want, _ = naive_attention_torch(q, k, v, causal=causal)  # float64
    o16, _ = naive_attention_torch(*(x.to(torch.float16).to(torch.float32) for x in (q, k, v)),
                                   causal=causal)
    rows = [("fp16 inputs, float32 attention", o16)]
    for method, rotate, rows_per_scale in (
            ("fp8, one scale per (batch, head)", False, None),
            (f"fp8, one scale per {block} rows", False, block),
            (f"fp8, one scale per {block} rows, q and k rotated", True, block)):
        rows.append((method, fp8_attention_emulated(q, k, v, causal, rotate, rows_per_scale, seed)))
    return [{"method": method, "rmse": rmse(o, want)} for method, o in rows]

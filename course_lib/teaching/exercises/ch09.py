"""Checks for chapter 09 (FlashAttention-3 ideas on Hopper): exercise 9.1, the random Hadamard
rotation of q and k; 9.2, e4m3 quantization with a scale per block of rows; 9.3, a Triton kernel
that loads its tiles through tensor descriptors (what Hopper's TMA copies).

9.1 has many right answers (any way of drawing the random signs), so its check does not compare
the rotated tensors with the library's. It runs the learner's ``rotate_qk`` on prepared inputs
and compares what every right answer shares (:func:`rotation_probe`): the scores and the row
norms are unchanged, a one-hot row comes out spread evenly over ``d``, the seed decides the
rotation, and a perfectly spread row (a row of ``H``) does not come out one-hot. The known
mistakes (``ROTATE_MISTAKES``) draw their signs as the skeleton does,
``torch.randint(0, 2, (d,), generator=torch.Generator().manual_seed(seed)) * 2 - 1``, so a learner
who draws them that way gets the cause named.

9.2 is compared with :func:`course_lib.attention.fp8.quantize_e4m3` up to one e4m3 rounding step
(``QUANTIZE_MISTAKES``). 9.3 runs on guarded tensors (:func:`course_lib.teaching.kernel_checks.check_kernel`:
every load and store checked before it happens in the interpreter) and its mistakes are a float64
model of the kernel's tiles with one thing done wrong (:func:`scores_tiles`,
``SCORES_KERNEL_MISTAKES``), as chapter 08's kernel checks do. The answer kernel itself, its
launcher and :func:`~course_lib.kernels.hopper.ensure_descriptor_allocator` (on a GPU, a kernel that
builds descriptors with ``tl.make_tensor_descriptor`` needs scratch memory from an allocator
Triton is given) live in :mod:`course_lib.kernels.hopper` and are re-exported here.

A "likely cause" is named only when exactly one mistake model reproduces the learner's output on
every case (:func:`course_lib.teaching.checks.cause_lines`); otherwise the diagnosis says what was seen.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from course_lib.teaching import checks
from course_lib import constants
from course_lib.attention import fp8
from course_lib.platform import runtime
from course_lib.teaching.checks import Case, check_function, learner_check
from course_lib.kernels import hopper
from course_lib.kernels.hopper import ensure_descriptor_allocator, launch_scores, scores_kernel
from course_lib.attention.reference import default_scale

_rt = runtime.ensure_configured()  # interpreter or GPU: decided before the first @triton.jit

__all__ = [
    "rotate_qk_reference", "rotation_probe", "ROTATE_MISTAKES", "check_rotate_qk", "ROTATE_HINTS",
    "ROTATE_SKELETON",
    "quantize_reference", "quantize_model", "QUANTIZE_MISTAKES", "check_quantize_e4m3",
    "QUANTIZE_HINTS", "QUANTIZE_SKELETON",
    "ensure_descriptor_allocator", "scores_kernel", "launch_scores", "scores_reference",
    "scores_tiles", "SCORES_KERNEL_MISTAKES", "check_scores_kernel", "SCORES_KERNEL_HINTS",
    "SCORES_KERNEL_SKELETON",
]


# ----------------------------------------------------------------------------------------------
# Exercise 9.1: rotate_qk(q, k, seed) -> (q_rot, k_rot), FA3's incoherent processing
# ----------------------------------------------------------------------------------------------

# The probes compare float64 quantities computed from float32 answers: float32 rounding of a
# rotation (~1e-7 relative per operation, d ≤ 128 terms) stays far below this, and every mistake
# is off by O(1).
ROTATION_TOLERANCE = (1e-4, 1e-4)
# A row "came out one-hot" when one entry holds more than this share of its norm. A right answer
# gives a ±1 row of d = 64 entries a largest entry of ~0.4 of its norm (the max of 64 normal
# draws, ~3 standard deviations, over √64 = 8); a share of 0.9 is ~7 standard deviations away.
ONE_HOT_SHARE = 0.9
# What each case of the check looks at (the ``probe`` of :func:`rotation_probe`).
PROBE_SCORES, PROBE_ONE_HOT = "scores", "one-hot rows"
PROBE_SEED, PROBE_H_ROWS = "seed", "rows of H"


def rotate_qk_reference(q: torch.Tensor, k: torch.Tensor, seed: int):
    """q and k rotated by the same :func:`course_lib.attention.fp8.random_rotation`, in their dtypes.

    Args:
        q: ``(..., N_q, d)``; k: ``(..., N_k, d)``, d a power of two. seed: the rotation's seed.

    Returns:
        ``(q_rot, k_rot)``: ``q @ R`` and ``k @ R`` with ``R = diag(s) · H``.
    """
    r = fp8.random_rotation(q.shape[-1], seed).to(q.device)  # (d, d) float64
    return (q.double() @ r).to(q.dtype), (k.double() @ r).to(k.dtype)


def _rotated(rotate, q, k, seed):
    """``rotate(q, k, seed)``, checked to be two tensors shaped like q and k."""
    out = rotate(q, k, seed)
    if not (isinstance(out, (tuple, list)) and len(out) == 2
            and all(isinstance(x, torch.Tensor) for x in out)):
        raise TypeError(f"rotate_qk must return two tensors (q_rot, k_rot), got "
                        f"{type(out).__name__}")
    q_rot, k_rot = out
    if q_rot.shape != q.shape or k_rot.shape != k.shape:
        raise ValueError(f"q_rot and k_rot must have the shapes of q and k, {tuple(q.shape)} and "
                         f"{tuple(k.shape)}; got {tuple(q_rot.shape)} and {tuple(k_rot.shape)}")
    if q_rot.dtype != q.dtype or k_rot.dtype != k.dtype:
        raise TypeError(f"q_rot and k_rot must have the dtypes of q and k, {q.dtype} and "
                        f"{k.dtype}; got {q_rot.dtype} and {k_rot.dtype} — convert with "
                        f".to(q.dtype)")
    return q_rot.detach().double().cpu(), k_rot.detach().double().cpu()


# The parts of the "scores" probe, as messages name them.
PROBE_SCORE_NAMES = ("the scores q_rot k_rotᵀ / √d", "the row norms of q_rot",
                     "the row norms of k_rot")


def rotation_probe(rotate, q, k, seed, probe):
    """What every right ``rotate_qk`` gives on these inputs, whatever its random signs.

    Args:
        rotate: a ``rotate_qk(q, k, seed)``.
        q: ``(..., N_q, d)``; k: ``(..., N_k, d)``. seed: passed on.
        probe: what to look at —
            ``"scores"``: ``(q_rot k_rotᵀ / √d, |q_rot| per row, |k_rot| per row)``, float64;
            ``"one-hot rows"``: ``max |q_rot| · √d / |q_rot|`` per row (1 when spread evenly);
            ``"seed"``: ``[same seed gives the same q_rot, seed + 1 gives another]`` as 1/0;
            ``"rows of H"``: per row of q, 1 if q_rot's row came out one-hot (a new outlier).

    Returns:
        The probe's float64 tensors (a tuple for ``"scores"``).
    """
    d = q.shape[-1]
    q_rot, k_rot = _rotated(rotate, q, k, seed)
    if probe == PROBE_SCORES:
        return (q_rot @ k_rot.transpose(-1, -2) / math.sqrt(d), q_rot.norm(dim=-1),
                k_rot.norm(dim=-1))
    # Shares of q_rot's own norm: these probes look at the spreading alone, not at the scale.
    peak_share = q_rot.abs().amax(dim=-1) / q_rot.norm(dim=-1)  # (..., N_q)
    if probe == PROBE_ONE_HOT:
        return peak_share * math.sqrt(d)
    if probe == PROBE_SEED:
        again, _ = _rotated(rotate, q, k, seed)
        other, _ = _rotated(rotate, q, k, seed + 1)
        atol, rtol = ROTATION_TOLERANCE
        return torch.tensor([float(torch.equal(q_rot, again)),
                             float(not torch.allclose(q_rot, other, rtol=rtol, atol=atol))],
                            dtype=torch.float64)
    if probe == PROBE_H_ROWS:
        return (peak_share > ONE_HOT_SHARE).double()
    raise ValueError(f"probe must be one of {PROBE_SCORES!r}, {PROBE_ONE_HOT!r}, {PROBE_SEED!r}, "
                     f"{PROBE_H_ROWS!r}, got {probe!r}")


# The mistakes, each a wrong rotate_qk(q, k, seed). Their signs are drawn as the skeleton draws
# them, so that a learner's output can be matched. The first mistake whose output matches is
# named, so "signs after H" comes before "no signs": both turn a row of H into a one-hot (the
# last case), but only "no signs" also ignores the seed (the case before, where it is caught).

def _signs(d, seed, generator=None):
    generator = torch.Generator().manual_seed(seed) if generator is None else generator
    return torch.randint(0, 2, (d,), generator=generator) * 2 - 1  # (d,) ±1


def _sylvester(d, minus=True):
    """The unnormalised Sylvester matrix (entries ±1); ``minus=False``: [[H, H], [H, H]]."""
    h = torch.ones((1, 1), dtype=torch.float64)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], dim=1), torch.cat([h, -h if minus else h], dim=1)], dim=0)
    return h


def _apply(q, k, r_q, r_k=None):
    r_k = r_q if r_k is None else r_k
    return (q.double() @ r_q).to(q.dtype), (k.double() @ r_k).to(k.dtype)


def _rotate_unnormalised(q, k, seed):
    d = q.shape[-1]
    return _apply(q, k, _signs(d, seed)[:, None] * _sylvester(d))


def _rotate_zero_one_signs(q, k, seed):
    d = q.shape[-1]
    bits = torch.randint(0, 2, (d,), generator=torch.Generator().manual_seed(seed))  # 0/1
    return _apply(q, k, bits[:, None] * _sylvester(d) / math.sqrt(d))


def _rotate_separate_signs(q, k, seed):
    d = q.shape[-1]
    generator = torch.Generator().manual_seed(seed)
    h = _sylvester(d) / math.sqrt(d)
    s_q, s_k = _signs(d, seed, generator), _signs(d, seed, generator)  # two draws
    return _apply(q, k, s_q[:, None] * h, s_k[:, None] * h)


def _rotate_only_q(q, k, seed):
    d = q.shape[-1]
    r = _signs(d, seed)[:, None] * _sylvester(d) / math.sqrt(d)
    return _apply(q, k, r, torch.eye(d, dtype=torch.float64))


def _rotate_random_matrix(q, k, seed):
    d = q.shape[-1]
    generator = torch.Generator().manual_seed(seed)
    r = (torch.randint(0, 2, (d, d), generator=generator) * 2 - 1) / math.sqrt(d)
    return _apply(q, k, r.double())


def _rotate_no_minus(q, k, seed):
    d = q.shape[-1]
    return _apply(q, k, _signs(d, seed)[:, None] * _sylvester(d, minus=False) / math.sqrt(d))


def _rotate_along_n(q, k, seed):
    def along_rows(x):
        n = x.shape[-2]
        r = _signs(n, seed)[:, None] * _sylvester(n) / math.sqrt(n)  # (N, N)
        return (r @ x.double()).to(x.dtype)
    return along_rows(q), along_rows(k)


def _rotate_signs_only(q, k, seed):
    d = q.shape[-1]
    return _apply(q, k, torch.diag(_signs(d, seed)).double())


def _rotate_no_signs(q, k, seed):
    d = q.shape[-1]
    return _apply(q, k, _sylvester(d) / math.sqrt(d))


def _rotate_global_rng(q, k, seed):
    d = q.shape[-1]
    signs = torch.randint(0, 2, (d,)) * 2 - 1  # torch's global generator: seed unused
    return _apply(q, k, signs[:, None] * _sylvester(d) / math.sqrt(d))


def _rotate_signs_after(q, k, seed):
    d = q.shape[-1]
    return _apply(q, k, _sylvester(d) / math.sqrt(d) * _signs(d, seed)[None, :])  # H · diag(s)


ROTATE_MISTAKES = {
    "H is not normalised: the ±1 Sylvester matrix has H Hᵀ = d·I, so every score is d times too "
    "large — divide H by √d": _rotate_unnormalised,
    "the random signs are 0 or 1 (torch.randint(0, 2, ...)), which zeroes some columns: map them "
    "to ±1 with * 2 - 1": _rotate_zero_one_signs,
    "q and k get different random signs (two draws): rotate both by the same R = diag(s) · H, or "
    "the scores change — draw s once": _rotate_separate_signs,
    "only q is rotated: (qR)kᵀ ≠ qkᵀ — rotate k by the same R, (qR)(kR)ᵀ = q R Rᵀ kᵀ = qkᵀ":
        _rotate_only_q,
    "R is a random ±1/√d matrix: its rows are not orthogonal, so the scores change — use the "
    "Sylvester Hadamard matrix (doubling [[H, H], [H, −H]]) with random signs":
        _rotate_random_matrix,
    "the doubling step is [[H, H], [H, H]]: the bottom-right block must be −H, or the rows are "
    "not orthogonal": _rotate_no_minus,
    "the rotation acts on the sequence axis (R of size N applied to the rows): rotate the head "
    "dim, the last axis — q @ R with R of size d": _rotate_along_n,
    "R = diag(s) has random signs but no Hadamard matrix: it is orthogonal but moves nothing, so "
    "an outlier stays an outlier — use diag(s) · H": _rotate_signs_only,
    "the signs are applied after H (x @ H @ diag(s)): that only flips the signs of x @ H, a fixed "
    "rotation that turns a row of H into a one-hot outlier — flip x's columns first, "
    "R = diag(s) · H": _rotate_signs_after,
    "R = H with no random signs: the seed changes nothing, and a row of H comes out one-hot — "
    "flip the signs of the columns first, R = diag(s) · H": _rotate_no_signs,
    "the signs come from torch's global generator, so the same seed gives another rotation on "
    "each call — draw them from torch.Generator().manual_seed(seed)": _rotate_global_rng,
}


def _probe_of(rotate):
    def probed(q, k, seed, probe):
        return rotation_probe(rotate, q, k, seed, probe)
    return probed


def _rotation_cases() -> list[Case]:
    gen = torch.Generator().manual_seed(9_1)
    one_hot = torch.zeros(3, 4, 64)
    for i in range(3):
        for j in range(4):  # a different column and size in each row, some negative
            one_hot[i, j, (17 * i + 5 * j) % 64] = (-1) ** j * (1.0 + 3 * i + j)
    h_rows = _sylvester(64)[[1, 6, 21, 63]].float()  # (4, 64) ±1 rows: spread out already
    cases = [
        # (q, k, seed, probe, what): powers of two N first (the "rotation along N" mistake can run)
        (torch.randn(2, 3, 8, 16, generator=gen), torch.randn(2, 3, 32, 16, generator=gen), 0,
         PROBE_SCORES, "d=16, q (2, 3, 8, 16), k (2, 3, 32, 16), float32"),
        (torch.randn(5, 64, generator=gen, dtype=torch.float64),
         torch.randn(7, 64, generator=gen, dtype=torch.float64), 1, PROBE_SCORES,
         "d=64, q (5, 64), k (7, 64), float64"),
        (fp8.outlier_inputs((1, 2, 9, 128), 91).float(),
         fp8.outlier_inputs((1, 2, 11, 128), 92).float(), 2, PROBE_SCORES,
         "d=128 with outliers, q (1, 2, 9, 128), k (1, 2, 11, 128), float32"),
        (one_hot, torch.randn(3, 5, 64, generator=gen), 3, PROBE_ONE_HOT,
         "d=64, each row of q one-hot (an outlier); output: max |q_rot| · √d / |q_rot| per "
         "row, 1 when the outlier is spread evenly over the d columns"),
        (torch.randn(2, 6, 64, generator=gen), torch.randn(2, 6, 64, generator=gen), 4, PROBE_SEED,
         "d=64; output: [the same seed gives the same q_rot, seed + 1 gives another], 1 = yes"),
        (h_rows, torch.randn(3, 64, generator=gen), 5, PROBE_H_ROWS,
         "d=64, the rows of q are rows of the ±1 Hadamard matrix (spread evenly already); output: "
         "1 where q_rot's row came out one-hot, a new outlier"),
    ]
    return [Case((q, k, seed), {"probe": probe},
                 label=f"{what}" + ("; outputs (q_rot·k_rotᵀ/√d, |q_rot| per row, |k_rot| per "
                                    "row)" if probe == PROBE_SCORES else ""))
            for q, k, seed, probe, what in cases]


@learner_check
def check_rotate_qk(fn):
    """Check exercise 9.1, ``rotate_qk(q, k, seed) -> (q_rot, k_rot)``; return the learner's
    function, or the library's (:func:`rotate_qk_reference`) when it is not done yet."""
    probed = _probe_of(fn)
    mistakes = {cause: _probe_of(wrong) for cause, wrong in ROTATE_MISTAKES.items()}
    result = check_function("Exercise 9.1", probed, reference=_probe_of(rotate_qk_reference),
                            cases=_rotation_cases(), fallback=rotate_qk_reference,
                            tolerance=ROTATION_TOLERANCE, mistakes=mistakes,
                            output_names=PROBE_SCORE_NAMES)
    return fn if result is probed else result


ROTATE_HINTS = [
    "Build the ±1 Sylvester matrix by doubling: start from <code>h = torch.ones(1, 1)</code> and "
    "repeat <code>h = [[h, h], [h, -h]]</code> (two <code>torch.cat</code>) until it is d × d.",
    "Normalise it: <code>h / math.sqrt(d)</code>. Now <code>h @ h.T</code> is the identity, so "
    "<code>x @ h</code> keeps every norm and every dot product.",
    "Draw one ±1 per column from a generator seeded with <code>seed</code>: <code>gen = "
    "torch.Generator().manual_seed(seed)</code>, <code>signs = torch.randint(0, 2, (d,), "
    "generator=gen) * 2 - 1</code>.",
    "<code>R = signs[:, None] * h</code> is diag(s) · H: <code>x @ R</code> flips x's columns "
    "first, then mixes them. Rotate q and k by the same R, and return them in their own dtype "
    "(<code>(q.double() @ R).to(q.dtype)</code>).",
]

ROTATE_SKELETON = '''\
d = q.shape[-1]
h = torch.ones(1, 1, dtype=torch.float64)
while h.shape[0] < d:
    h = ...                                   # [[h, h], [h, -h]]
h = ...                                       # normalised: h @ h.T is the identity
gen = torch.Generator().manual_seed(seed)
signs = ...                                   # (d,) random ±1 drawn from gen
r = ...                                       # diag(signs) · h: the signs first
q_rot, k_rot = ...                            # q @ r and k @ r, each in its own dtype
return q_rot, k_rot'''


# ----------------------------------------------------------------------------------------------
# Exercise 9.2: quantize_e4m3(x, block) -> (x_fp8, scale), one scale per block of rows
# ----------------------------------------------------------------------------------------------

# Two right answers may round a value differently: x / scale and x · (1 / scale) differ in the
# last float32 bit, which moves a value sitting on an e4m3 tie to the neighbouring e4m3 number.
# So values are compared up to one e4m3 step: 2⁻³ relative (3 mantissa bits) and, for the
# subnormals, their spacing 2⁻⁹. Every mistake below is off by far more.
E4M3_STEP = 2.0**-3
E4M3_SUBNORMAL_STEP = 2.0**-9
QUANTIZE_TOLERANCE = (E4M3_SUBNORMAL_STEP, E4M3_STEP)
# The largest magnitudes of two other 8-bit formats, which the mistakes below use instead of 448:
INT8_MAX = 127.0  # int8 quantization
E4M3_IEEE_MAX = 240.0  # e4m3 with IEEE-style inf/NaN (top exponent reserved), as in e4m3fnuz


def quantize_reference(x: torch.Tensor, block: int | None):
    """:func:`course_lib.attention.fp8.quantize_e4m3` (the right answer of exercise 9.2)."""
    return fp8.quantize_e4m3(x, block)


def quantize_model(x, block, *, scope="block", peak="abs", fp8_max=fp8.E4M3_MAX,
                   zero_guard=True, inverted=False, multiplied=False, interleaved=False,
                   rounded=False):
    """A model of ``quantize_e4m3``; the defaults are right, each keyword does one thing wrong.

    Args:
        x: ``(..., N, d)``. block: rows per scale (None: all N).
        scope: "block" (one amax per block), "tensor" (one amax for all of x), "row" (one
            scale per row: shape ``(..., N, 1)``) or "matrix" (``block`` ignored: one scale
            per matrix, shape ``(..., 1, 1)``).
        peak: "abs" (``amax(|x|)``) or "signed" (``amax(x)``).
        fp8_max: the value the peak is mapped to.
        zero_guard: a zero block gets scale 1 (else 0, and 0/0 = NaN).
        inverted: scale = fp8_max / amax and ``x_fp8 = x · scale``; "divided": that scale
            with ``x_fp8 = x / scale`` (= x · amax / fp8_max, far below the fp8 range).
        multiplied: ``x_fp8 = x · scale`` with the right scale.
        interleaved: the amax of block j taken over the rows ``r ≡ j (mod n_blocks)`` (the
            reshape to ``(block, n_blocks)`` instead of ``(n_blocks, block)``); the scales are
            then applied to the blocks of consecutive rows, as the skeleton does.
        rounded: ``torch.round`` before the cast (int8's habit).

    Returns:
        ``(x_fp8, scale)`` as :func:`course_lib.attention.fp8.quantize_e4m3`.
    """
    n = x.shape[-2]
    block = n if block is None or scope == "matrix" else block
    n_blocks = -(-n // block)
    x32 = x.to(torch.float32)
    padded = torch.nn.functional.pad(x32, (0, 0, 0, n_blocks * block - n))
    values = padded.abs() if peak == "abs" else padded
    if peak != "abs":  # the zero rows of the padding must not win a signed max
        pad_rows = torch.arange(n_blocks * block, device=x.device) >= n
        values = values.masked_fill(pad_rows[:, None], -torch.inf)
    if scope == "row":
        amax = values[..., :n, :].amax(dim=-1)  # (..., N)
    elif scope == "tensor":
        amax = values.amax().expand(x.shape[:-2] + (n_blocks,))
    elif interleaved:
        # row r lands in block r % n_blocks
        amax = values.unflatten(-2, (block, n_blocks)).amax(dim=(-3, -1))
    else:
        amax = values.unflatten(-2, (n_blocks, block)).amax(dim=(-2, -1))  # (..., n_blocks)
    scale = fp8_max / amax if inverted else amax / fp8_max
    if zero_guard:
        scale = torch.where(amax == 0, torch.ones_like(scale), scale)
    scale = scale[..., None]  # (..., n_blocks, 1) or (..., N, 1)
    if scope == "row":
        per_row = scale
    else:  # each row divided by the scale of block row // block (the skeleton's repeat_interleave)
        per_row = scale.repeat_interleave(block, dim=-2)[..., :n, :]
    scaled = x32 * per_row if (inverted is True or multiplied) else x32 / per_row
    if rounded:
        scaled = torch.round(scaled)
    return scaled.clamp(-fp8.E4M3_MAX, fp8.E4M3_MAX).to(fp8.E4M3_DTYPE), scale


def _quantize_mistake(**wrong):
    def mistaken(x, block):
        return quantize_model(x, block, **wrong)
    return mistaken


QUANTIZE_MISTAKES = {
    "the scale is inverted (E4M3_MAX / amax): the scale is what x_fp8 is multiplied by to get x "
    "back, x ≈ x_fp8 · scale, so scale = amax / E4M3_MAX": _quantize_mistake(inverted=True),
    "x is divided by an inverted scale (E4M3_MAX / amax): x_fp8 = x · amax / E4M3_MAX then "
    "sits far below the fp8 range — scale = amax / E4M3_MAX, and x_fp8 = x / scale "
    "maps the block's largest magnitude to E4M3_MAX": _quantize_mistake(inverted="divided"),
    "x is multiplied by the scale: divide, x_fp8 = x / scale, so that the block's largest "
    "magnitude lands on E4M3_MAX = 448": _quantize_mistake(multiplied=True),
    "one amax for the whole tensor: each block of rows (each (batch, head) matrix when block is "
    "None) gets its own amax, over its rows and all d columns": _quantize_mistake(scope="tensor"),
    "the amax is max(x), not max(|x|): a block whose largest magnitude is negative overflows — "
    "take x.abs().amax(...)": _quantize_mistake(peak="signed"),
    "the peak is mapped to 127, int8's largest value: e4m3fn's is 448 (E4M3_MAX), so 3.5× of the "
    "range is unused": _quantize_mistake(fp8_max=INT8_MAX),
    "the peak is mapped to 240, the largest e4m3 value when the top exponent is reserved for "
    "inf/NaN (IEEE-style, e4m3fnuz): torch.float8_e4m3fn has no inf and reaches 448 (E4M3_MAX)":
        _quantize_mistake(fp8_max=E4M3_IEEE_MAX),
    "a block of zeros gets scale 0, and 0 / 0 is NaN: give it scale 1 "
    "(torch.where(amax > 0, amax / E4M3_MAX, 1))": _quantize_mistake(zero_guard=False),
    "the blocks interleave the rows (x.unflatten(-2, (block, n_blocks))): block j is rows "
    "j·block to (j+1)·block − 1, so unflatten to (n_blocks, block)":
        _quantize_mistake(interleaved=True),
    "the block argument is not used: one scale per matrix (amax over all its N rows), where "
    "each block of `block` rows needs its own — scale has shape (..., ceil(N / block), 1)":
        _quantize_mistake(scope="matrix"),
    "one scale per row (amax over d only): one scale per block of `block` rows, over all their "
    "columns — scale has shape (..., ceil(N / block), 1)": _quantize_mistake(scope="row"),
    "the scaled values are rounded to integers (int8's habit): e4m3 is a floating-point format, "
    "the cast .to(torch.float8_e4m3fn) rounds to its nearest value":
        _quantize_mistake(rounded=True),
}


# Blocks of the check's inputs grow by this factor, so that a scale taken over the wrong rows is
# off by at least 4×; each block's largest magnitude is a negative entry this many times its
# block's standard deviation (the max of a block's normal draws is ~3), so max(x) ≠ max(|x|).
BLOCK_GROWTH = 4.0
NEGATIVE_PEAK = 8.0


def _blocky(gen, lead, n, d, block):
    """``(*lead, n, d)`` float32 whose blocks of ``block`` rows (and leading matrices) differ in
    size and whose largest magnitude in each block is negative."""
    x = torch.randn(*lead, n, d, generator=gen)
    size = BLOCK_GROWTH ** (torch.arange(n) // block).float()  # (n,)
    matrices = math.prod(lead)
    size_lead = BLOCK_GROWTH ** torch.arange(matrices).float().reshape(*lead, 1, 1) if lead else 1.0
    x = x * size[:, None] * size_lead
    peak = x.new_zeros(x.shape)
    peak[..., ::block, 0] = -NEGATIVE_PEAK
    return torch.where(peak != 0, peak * size[:, None] * size_lead, x)


def _small_last_block(gen):
    """``(2, 20, 16)`` float32 whose last block (4 of its 8 rows: ragged) holds values below 0.01,
    its peak negative: padding with anything but zeros would change its amax."""
    x = _blocky(gen, (2,), 20, 16, 8)
    x[..., 16:, :] = x[..., 16:, :] * 1e-3 / BLOCK_GROWTH ** 2
    return x


def _quantize_cases() -> list[Case]:
    gen = torch.Generator().manual_seed(9_2)
    zero_block = _blocky(gen, (1, 2), 48, 16, 16)
    zero_block[..., 16:32, :] = 0.0
    return [
        Case((_blocky(gen, (2, 3), 40, 16, 16), 16), label="(2, 3, 40, 16), blocks of 16 rows, the "
             "last one 8 rows; outputs (x_fp8, scale (..., 3, 1))"),
        Case((_blocky(gen, (3,), 37, 32, 37), None), label="(3, 37, 32), block=None: one scale per "
             "matrix; outputs (x_fp8, scale (3, 1, 1))"),
        Case((zero_block, 16),
             label="(1, 2, 48, 16), rows 16 to 31 all zero; outputs (x_fp8, scale)"),
        Case((_blocky(gen, (2,), 33, 16, 8).to(torch.float16), 8), label="float16 (2, 33, 16), "
             "blocks of 8; outputs (x_fp8, scale float32)"),
        Case((_blocky(gen, (2,), 10, 16, 64), 64), label="(2, 10, 16), block 64 > N: one block; "
             "outputs (x_fp8, scale)"),
        Case((_small_last_block(gen), 8), label="(2, 20, 16), blocks of 8: the last block (4 "
             "rows) holds values below 0.01; outputs (x_fp8, scale)"),
    ]


@learner_check
def check_quantize_e4m3(fn):
    """Check exercise 9.2, ``quantize_e4m3(x, block) -> (x_fp8, scale)`` (as
    :func:`course_lib.attention.fp8.quantize_e4m3`); return the function to continue with."""
    return check_function("Exercise 9.2", fn, reference=quantize_reference,
                          cases=_quantize_cases(), fallback=fp8.quantize_e4m3,
                          tolerance=QUANTIZE_TOLERANCE, mistakes=QUANTIZE_MISTAKES,
                          output_names=("x_fp8", "scale"))


QUANTIZE_HINTS = [
    "Work in float32 (<code>x = x.float()</code>) and split the N rows into "
    "<code>n_blocks = -(-N // block)</code> blocks (<code>block = N</code> when it is None); pad "
    "the rows with zeros to <code>n_blocks · block</code> "
    "(<code>torch.nn.functional.pad(x, (0, 0, 0, extra))</code>): zeros never change an amax.",
    "<code>amax = padded.abs().unflatten(-2, (n_blocks, block)).amax(dim=(-2, -1))</code> gives "
    "<code>(..., n_blocks)</code>: each block's largest magnitude, over its rows and all columns.",
    "<code>scale = amax / E4M3_MAX</code> (448, the largest <code>float8_e4m3fn</code>), but 1 "
    "where amax is 0: <code>torch.where(amax > 0, amax / E4M3_MAX, 1.0)</code>; keep it as "
    "<code>(..., n_blocks, 1)</code>.",
    "Give each row its block's scale with <code>scale.repeat_interleave(block, dim=-2)[..., :N, "
    ":]</code>, divide, clamp to ±E4M3_MAX and cast: "
    "<code>(x / rows).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)</code>.",
]

QUANTIZE_SKELETON = '''\
x = x.float()
n = x.shape[-2]
block = n if block is None else block
n_blocks = ...                                # ceil(n / block)
padded = ...                                  # (..., n_blocks * block, d), zero rows added
amax = ...                                    # (..., n_blocks): max |x| over each block
scale = ...                                   # (..., n_blocks, 1) amax / E4M3_MAX, or 1
rows = ...                                    # (..., n, 1): each row's block scale
x_fp8 = ...                                   # x / rows, clamped to ±E4M3_MAX, cast to e4m3
return x_fp8, scale'''


# ----------------------------------------------------------------------------------------------
# Exercise 9.3: scores_kernel, one tile of S = scale · Q Kᵀ with tiles loaded by tensor descriptors
# ----------------------------------------------------------------------------------------------

# The kernel, its launcher and the allocator live in the library (:mod:`course_lib.kernels.hopper`);
# this module keeps the check's cases and mistakes.
SCORES_BLOCK_M, SCORES_BLOCK_N = hopper.SCORES_BLOCK_M, hopper.SCORES_BLOCK_N
# Margins of the guarded inputs: a tile's worth of NaN rows after the last row (a descriptor
# whose shape has too many rows reads them) and NaN columns after each row, a different number
# for Q and for K so that their row strides differ (a stride of one used for the other shows).
# Both keep the row stride a multiple of 16 bytes (8 fp16 elements) for d a multiple of 8:
# TMA's rule for strides.
SCORES_ROW_MARGIN = 2 * max(SCORES_BLOCK_M, SCORES_BLOCK_N)
SCORES_Q_COL_MARGIN = 8
SCORES_K_COL_MARGIN = 24
# S's margin: a whole tile of rows and of columns (for the GPU, where nothing checks a store
# before it happens: an unmasked store of the ragged last tiles lands in the margin and is
# reported).
S_MARGIN = (SCORES_ROW_MARGIN, SCORES_ROW_MARGIN)
# The inputs are fp16. An answer may fold the scale into q before the dot and round it back to
# fp16 (Triton's own attention tutorial does), which moves each score by ~2⁻¹¹ of
# Σ|q_i k_i|·scale: up to ~1e-2 on these inputs. Every mistake below is off by O(1).
SCORES_TOLERANCE = (2e-2, 1e-2)


def scores_tiles(q, k, block_m=SCORES_BLOCK_M, block_n=SCORES_BLOCK_N, *, scale=None,
                 q_start="rows", k_start="rows", q_rows="n_q", k_rows="n_k",
                 scale_mode="scale"):
    """float64 model of the scores kernel, tile by tile; the defaults are the right kernel.

    Args:
        q: ``(n_q, d)``; k: ``(n_k, d)``. block_m, block_n: the tile. scale: the kernel's
            ``scale`` argument (None: ``1/sqrt(d)``).
        q_start, k_start: where tile ``(i, j)`` starts reading: "rows" (``i · BLOCK_M``,
            ``j · BLOCK_N``), "tiles" (``i``, ``j``); for K also "block_m" (``j · BLOCK_M``) and
            "fixed" (0 for every j).
        q_rows, k_rows: the row count each descriptor is given: its own ("n_q", "n_k") or the
            other's; rows past it read 0 (a count larger than the tensor's reads past it, which
            the check stops before it happens, so the model is then only right where it stays
            inside).
        scale_mode: "scale" (``scale``), "none" (1), "log2" (``scale · LOG2_E``), or the scale
            recomputed in the kernel instead of read: "1/sqrt(d)" or "1/sqrt(HEAD_DIM)" (d
            padded to a power of two).

    Returns:
        ``S`` ``(n_q, n_k)`` float32 on q's device.
    """
    n_q, d = q.shape
    n_k = k.shape[0]
    q64, k64 = q.double().cpu(), k.double().cpu()
    scale = default_scale(d) if scale is None else scale
    q_bound = min(n_q, n_k if q_rows == "n_k" else n_q)
    k_bound = min(n_k, n_q if k_rows == "n_q" else n_k)
    factor = {"scale": scale, "none": 1.0, "log2": scale * constants.LOG2_E,
              "1/sqrt(d)": default_scale(d),
              "1/sqrt(HEAD_DIM)": default_scale(hopper.padded_head_dim(d))}[scale_mode]

    def rows_of(x, start, count, bound):
        tile = torch.zeros((count, d), dtype=torch.float64)
        inside = range(max(start, 0), min(start + count, bound))
        if len(inside):
            tile[inside.start - start:inside.stop - start] = x[inside.start:inside.stop]
        return tile

    s = torch.empty((n_q, n_k), dtype=torch.float64)
    for i in range(triton.cdiv(n_q, block_m)):
        q_tile = rows_of(q64, i * block_m if q_start == "rows" else i, block_m, q_bound)
        for j in range(triton.cdiv(n_k, block_n)):
            start = {"rows": j * block_n, "tiles": j, "block_m": j * block_m, "fixed": 0}[k_start]
            k_tile = rows_of(k64, start, block_n, k_bound)
            tile = factor * q_tile @ k_tile.T  # (BLOCK_M, BLOCK_N)
            rows = slice(i * block_m, (i + 1) * block_m)
            cols = slice(j * block_n, (j + 1) * block_n)
            s[rows, cols] = tile[:len(range(n_q)[rows]), :len(range(n_k)[cols])]
    return s.to(device=q.device, dtype=torch.float32)


def scores_reference(q, k, scale=None, block_m=SCORES_BLOCK_M, block_n=SCORES_BLOCK_N):
    """``S = scale · q kᵀ`` in float64, returned as float32 (what the kernel writes); the tile
    sizes change nothing."""
    scale = default_scale(q.shape[-1]) if scale is None else scale
    return (scale * q.double() @ k.double().T).to(torch.float32)


def _scores_mistake(**wrong):
    def mistaken(q, k, scale=None, block_m=SCORES_BLOCK_M, block_n=SCORES_BLOCK_N):
        return scores_tiles(q, k, block_m, block_n, scale=scale, **wrong)
    return mistaken


SCORES_KERNEL_MISTAKES = {
    "the descriptor offsets count tiles ([pid_m, 0]): desc.load takes element offsets, the "
    "first row of the tile — [pid_m * BLOCK_M, 0] and [pid_n * BLOCK_N, 0]":
        _scores_mistake(q_start="tiles", k_start="tiles"),
    "K's tiles start at pid_n * BLOCK_M: a K tile is BLOCK_N rows tall, so it starts at "
    "pid_n * BLOCK_N": _scores_mistake(k_start="block_m"),
    "every program loads the same K tile ([0, 0]): the tile of program (pid_m, pid_n) starts at "
    "key pid_n * BLOCK_N": _scores_mistake(k_start="fixed"),
    "K's descriptor has n_q rows: its shape is K's own, [n_k, HEAD_DIM_REAL] — the descriptor "
    "reads rows past its shape as 0": _scores_mistake(k_rows="n_q"),
    "Q's descriptor has n_k rows: its shape is Q's own, [n_q, HEAD_DIM_REAL] — the descriptor "
    "reads rows past its shape as 0": _scores_mistake(q_rows="n_k"),
    "the scores are not scaled: multiply q·kᵀ by scale": _scores_mistake(scale_mode="none"),
    "the scores are in log2 units (scale · LOG2_E, the forward kernel's qk_scale_log2): this "
    "kernel writes S = scale · q·kᵀ": _scores_mistake(scale_mode="log2"),
    "the scale is recomputed in the kernel as 1/√d: use the `scale` argument (the caller may "
    "pass another scale than the default)": _scores_mistake(scale_mode="1/sqrt(d)"),
    "the scale is recomputed in the kernel as 1/√HEAD_DIM, with the padded head dim: use the "
    "`scale` argument (HEAD_DIM is d rounded up to a power of two, not d)":
        _scores_mistake(scale_mode="1/sqrt(HEAD_DIM)"),
}


def _scores_cases(device: str) -> list[Case]:
    gen = torch.Generator().manual_seed(9_3)
    # (n_q, n_k, d, scale, BLOCK_M, BLOCK_N): ragged rows and keys with n_k > n_q (a descriptor
    # given n_q rows for K reads zeros); a head dim that is not a power of two (HEAD_DIM 64 >
    # d = 48: columns past d read as 0) and an explicit scale; n_q > n_k with BLOCK_M > BLOCK_N
    # (the mix-ups of the two tiles show) and d = 24; whole tiles. (The size of the scores does
    # not matter to this kernel: no exp.)
    specs = [(37, 45, 16, None, 16, 32), (20, 70, 48, 0.3, 16, 32), (50, 19, 24, 0.45, 32, 16),
             (32, 64, 32, 0.8, 16, 32)]
    cases = []
    for n_q, n_k, d, scale, block_m, block_n in specs:
        q = torch.randn(n_q, d, generator=gen).to(device=device, dtype=torch.float16)
        k = torch.randn(n_k, d, generator=gen).to(device=device, dtype=torch.float16)
        shown = "1/√d" if scale is None else f"{scale:g}"
        cases.append(Case((q, k), {"scale": scale, "block_m": block_m, "block_n": block_n},
                          label=f"n_q={n_q}, n_k={n_k}, d={d}, scale={shown}, float16, "
                                f"BLOCK_M={block_m}, BLOCK_N={block_n}; output S [row, col] "
                                f"float32"))
    return cases


def scores_kernel_runner(kernel, scale=None, block_m=SCORES_BLOCK_M, block_n=SCORES_BLOCK_N):
    """A guarded run of a scores kernel: ``run(q, k) -> S`` (float32)."""
    from course_lib.teaching import kernel_checks

    def s_shape(q, k):
        return (q.shape[0], k.shape[0]), torch.float32

    def launch(q, k, s):
        hopper.launch_scores(kernel, q, k, s, scale, block_m, block_n)

    return kernel_checks.GuardedRun(
        launch=launch, margins=((SCORES_ROW_MARGIN, SCORES_Q_COL_MARGIN),
                                (SCORES_ROW_MARGIN, SCORES_K_COL_MARGIN)),
        outputs=(kernel_checks.Output("S", S_MARGIN, s_shape),),
        store_hint="mask the store with rows < n_q and cols < n_k: the last tiles of S are ragged",
        coverage_hint=f"program (pid_m, pid_n) = (tl.program_id(0), tl.program_id(1)) writes the "
                      f"tile S[pid_m·BLOCK_M : (pid_m+1)·BLOCK_M, pid_n·BLOCK_N : "
                      f"(pid_n+1)·BLOCK_N] (here BLOCK_M = {block_m}, BLOCK_N = {block_n})",
        load_hint="a descriptor reads outside its tensor: check the shape and strides it was "
                  "made with — the shape must be the tensor's real one ([n_q, HEAD_DIM_REAL] for "
                  "Q, [n_k, HEAD_DIM_REAL] for K, not padded to whole tiles or to HEAD_DIM: the "
                  "descriptor fills the rest of a tile with zeros) and the strides the tensor's own "
                  "[stride_row, 1]")


@learner_check
def check_scores_kernel(kernel):
    """Check exercise 9.3, the descriptor scores kernel (signature of
    :func:`course_lib.kernels.hopper.scores_kernel`); return the learner's kernel or, when it is
    not done yet, the library's."""
    from course_lib.teaching import kernel_checks

    shown = {}  # the tile sizes of the first case answered wrong, to locate its bad element

    def run(q, k, scale=None, block_m=SCORES_BLOCK_M, block_n=SCORES_BLOCK_N):
        s = scores_kernel_runner(kernel, scale, block_m, block_n)(q, k)
        if "blocks" not in shown and checks.compare(s, scores_reference(q, k, scale),
                                                    *SCORES_TOLERANCE) is not None:
            shown["blocks"] = (block_m, block_n)
        return s

    def locate(index):
        block_m, block_n = shown.get("blocks", (SCORES_BLOCK_M, SCORES_BLOCK_N))
        row, col = index[:2]
        return (f"S[{row}, {col}] is written by program (pid_m, pid_n) = ({row // block_m}, "
                f"{col // block_n}) of that case (BLOCK_M = {block_m}, BLOCK_N = {block_n})")

    return kernel_checks.check_kernel("Exercise 9.3", kernel, run, scores_reference,
                                      _scores_cases(runtime.current().device),
                                      fallback=hopper.scores_kernel,
                                      mistakes=SCORES_KERNEL_MISTAKES,
                                      tolerance=SCORES_TOLERANCE, locate=locate)


SCORES_KERNEL_HINTS = [
    "Who you are: <code>pid_m, pid_n = tl.program_id(0), tl.program_id(1)</code>; your tile of S "
    "is rows <code>pid_m * BLOCK_M</code> to <code>+ BLOCK_M</code>, columns <code>pid_n * "
    "BLOCK_N</code> to <code>+ BLOCK_N</code>.",
    "A descriptor describes the whole tensor and the tile you will load: <code>q_desc = "
    "tl.make_tensor_descriptor(Q, shape=[n_q, HEAD_DIM_REAL], strides=[stride_qm, 1], "
    "block_shape=[BLOCK_M, HEAD_DIM])</code>; K's the same with n_k, stride_kn and BLOCK_N.",
    "<code>q_desc.load([pid_m * BLOCK_M, 0])</code> returns a <code>(BLOCK_M, HEAD_DIM)</code> "
    "tile: the offsets are elements (the tile's first row and column), and rows past n_q or "
    "columns past d come back as zeros — no mask.",
    "<code>s = tl.dot(q, tl.trans(k)) * scale</code>, then a pointer store: <code>S + rows[:, "
    "None] * stride_sm + cols[None, :]</code> with the mask <code>(rows[:, None] &lt; n_q) &amp; "
    "(cols[None, :] &lt; n_k)</code>.",
]

SCORES_KERNEL_SKELETON = '''\
pid_m, pid_n = tl.program_id(0), tl.program_id(1)
q_desc = ...                                  # make_tensor_descriptor(Q, shape, strides, block)
k_desc = ...                                  # K's: [n_k, HEAD_DIM_REAL], block [BLOCK_N, HEAD_DIM]
q = ...                                       # (BLOCK_M, HEAD_DIM) from row pid_m * BLOCK_M
k = ...                                       # (BLOCK_N, HEAD_DIM) from row pid_n * BLOCK_N
s = ...                                       # (BLOCK_M, BLOCK_N) scale · q kᵀ
rows = ...                                    # (BLOCK_M,) the rows of S this tile covers
cols = ...                                    # (BLOCK_N,) its columns
...                                           # store s, masked to rows < n_q and cols < n_k'''

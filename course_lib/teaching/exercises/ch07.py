"""Checks for chapter 07 (the backward pass).

* Exercise 7.1 — ``compute_d(o, do)``: the preprocessing step ``D = rowsum(dO ∘ O)``,
  ``(..., N_q, d_v)`` → ``(..., N_q)``.
* Exercise 7.2 — ``ds_tile(p, dp, d)``: the softmax backward on one tile,
  ``dS = P ∘ (dP − D)``, with ``D`` broadcast along each row.
* Exercise 7.3 — ``dk_dv_step(q_i, do_i, lse_i, d_i, k_j, v_j, dk_j, dv_j, scale, mask=None)``:
  the body of the dK/dV loop, returning the updated ``(dk_j, dv_j)``.

The answers are the functions of the same names in :mod:`course_lib.attention.tiled_backward`. Every case
is cut from a real attention problem (random q, k, v, dO; ``o`` and ``lse`` from the float64
reference), so ``P`` tiles hold real probabilities and ``D`` is the true row sum — a tile holds
only part of a row, which is what tells "D from this tile's P ∘ dP" apart from the right ``D``.
Tiles are ragged and unequal (BLOCK_M ≠ BLOCK_N, d ≠ d_v) except the first case of 7.2 and 7.3,
which is square on purpose: there a transposition or broadcasting mistake gives a wrong answer
of the right shape, so the check can name it instead of just reporting a shape error.

The large exercises (each with hints and a skeleton for :class:`course_lib.teaching.widgets.hints.HintLadder`):

* Exercise 7.4 — ``flash_backward(q, k, v, o, lse, do, causal, scale, block_m, block_n)``: the
  whole tiled backward of one head in NumPy (outer loop over K/V tiles, inner over Q tiles, dQ
  added into a full array), checked against :func:`tiled_backward.flash_attention_numpy_backward`.
* Exercise 7.5 — ``dkdv_kernel`` and ``dq_kernel``: the Triton backward, two kernels with the
  library's argument names; ``DELTA`` (the paper's D) is the library's ``preprocess_kernel``, run
  by :func:`launch_backward`. Checked against float64 autograd with each of q, k, v, o, dO in its
  own memory layout, every access checked by the memory guard (interpreter), on guarded buffers
  (GPU). The mistake models are the library's kernels (:mod:`course_lib.kernels.backward`) with
  their ``MISTAKE`` hook switched on, and they are the fallback too.
* Exercise 7.6 — a ``torch.autograd.Function`` around the library's forward kernel and the
  learner's backward kernels: o and gradients against float64 autograd, then a few training
  steps of :mod:`course_lib.integrations.tinylm` against SDPA.

A wrong gradient gets one diagnosis (:func:`_check_gradients`): the case, which of dq/dk/dv is
wrong, its first bad row and the tile that row belongs to, the max error, and a likely cause only
when exactly one mistake model reproduces the answer on every case.
"""

from __future__ import annotations

import functools
import re
import warnings

import numpy as np

from course_lib.teaching.checks import learner_check
from course_lib.teaching.checks import Diagnosed as _Diagnosed  # the runners' named causes (7.6)
from course_lib.teaching import checks, grade_channel
from course_lib.platform import runtime
from course_lib.attention import tiled_backward as tb
from course_lib.teaching.checks import (Case, ExerciseFailed, _default_tolerance, check_function, compare,
                                        describe_value, to_numpy64)
from course_lib.attention.reference import default_scale, naive_attention_numpy, naive_attention_torch

_rt = runtime.ensure_configured()  # interpreter or GPU: decided before the first @triton.jit

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from course_lib.teaching import kernel_checks  # noqa: E402
from course_lib.kernels import backward  # noqa: E402
from course_lib.kernels import forward as forward_kernel  # noqa: E402
from course_lib.kernels import tuning  # noqa: E402

__all__ = ["D_MISTAKES", "DS_MISTAKES", "DK_DV_MISTAKES", "d_cases", "ds_cases", "dk_dv_cases",
           "check_compute_d", "check_ds_tile", "check_dk_dv_step",
           "BACKWARD_MISTAKES", "BACKWARD_HINTS", "BACKWARD_SKELETON", "backward_cases",
           "check_flash_backward",
           "KERNEL_MISTAKES", "KERNEL_HINTS", "KERNEL_SKELETON", "kernel_cases", "launch_backward",
           "reference_gradients", "check_backward_kernels",
           "FUNCTION_MISTAKES", "FUNCTION_HINTS", "FUNCTION_SKELETON", "function_cases",
           "run_function", "function_reference", "check_autograd_function"]

_SEED = 707


def _check(exercise, fn, reference, cases, mistakes, writable=(), output_names=None):
    """check_function with the library's version as fallback; returns the learner's own function
    on a pass. ``check_function`` already gives the learner copies of the inputs and names an
    input changed in place, except those listed in ``writable``."""
    chosen = check_function(exercise, fn, reference, cases, fallback=reference, mistakes=mistakes,
                            writable=writable, output_names=output_names)
    return reference if chosen is reference else fn


# ----------------------------------------------------------------------------------------------
# one real attention problem, cut into tiles
# ----------------------------------------------------------------------------------------------

def _problem(rng, lead, n_q, n_k, d, d_v, causal, dtype=np.float64, scale=None, spread=1.0):
    """Random q, k, v, dO and the forward's o, lse and D = rowsum(dO ∘ O), all in ``dtype``;
    ``spread`` scales q and k (scores in the hundreds for spread ≈ 5)."""
    q = (rng.standard_normal(lead + (n_q, d)) * spread).astype(dtype)
    k = (rng.standard_normal(lead + (n_k, d)) * spread).astype(dtype)
    v = rng.standard_normal(lead + (n_k, d_v)).astype(dtype)
    do = rng.standard_normal(lead + (n_q, d_v)).astype(dtype)
    scale = default_scale(d) if scale is None else scale
    o, lse = naive_attention_numpy(q, k, v, causal, scale)
    o, lse = o.astype(dtype), lse.astype(dtype)
    return dict(q=q, k=k, v=v, do=do, o=o, lse=lse, d=tb.compute_d(o, do), causal=causal,
                scale=scale)


def _tile(prob, q_start, block_m, k_start, block_n):
    """The tile arguments of the dK/dV loop body for Q tile at ``q_start`` and K/V tile at
    ``k_start`` (2-D, one head), with ``mask`` None when the tile needs none."""
    n_q, n_k = prob["q"].shape[-2], prob["k"].shape[-2]
    q_end, k_end = min(q_start + block_m, n_q), min(k_start + block_n, n_k)
    rows, cols = slice(q_start, q_end), slice(k_start, k_end)
    return dict(q_i=prob["q"][rows], do_i=prob["do"][rows], lse_i=prob["lse"][rows],
                d_i=prob["d"][rows], k_j=prob["k"][cols], v_j=prob["v"][cols],
                mask=tb.tile_mask(q_start, q_end, k_start, k_end, prob["causal"]))


# ----------------------------------------------------------------------------------------------
# Exercise 7.1: D = rowsum(dO ∘ O)
# ----------------------------------------------------------------------------------------------

D_MISTAKES = {
    "D is missing O: it is rowsum(dO ∘ O), the row-wise dot product of dO with O":
        lambda o, do: np.sum(do, axis=-1),
    "averaged instead of summed: D is a sum over the last axis, not a mean":
        lambda o, do: np.mean(do * o, axis=-1),
    "the sign is flipped: D = +rowsum(dO ∘ O)": lambda o, do: -np.sum(do * o, axis=-1),
    "multiplied O by itself: D = rowsum(dO ∘ O), not rowsum(O ∘ O)":
        lambda o, do: np.sum(o * o, axis=-1),
    "multiplied dO by itself: D = rowsum(dO ∘ O), not rowsum(dO ∘ dO)":
        lambda o, do: np.sum(do * do, axis=-1),
    "D is the product of two row sums, rowsum(dO) · rowsum(O): it is the sum of the products, "
    "rowsum(dO ∘ O)": lambda o, do: np.sum(do, axis=-1) * np.sum(o, axis=-1),
    "every row of O was paired with every row of dO (o @ doᵀ, summed): D_i pairs row i of dO "
    "with row i of O only, rowsum(dO ∘ O)":
        lambda o, do: np.sum(o @ np.swapaxes(do, -1, -2), axis=-1),
}


def d_cases(seed: int = _SEED) -> list[Case]:
    """(o, do) pairs: 2-D, batched with heads, d_v not a power of two, one float32, and
    non-contiguous arrays (column-major, every other column of a wider array)."""
    rng = np.random.default_rng(seed)
    specs = [((), 37, 29, 24, False, np.float64, None), ((2, 3), 45, 31, 20, True, np.float64, "gaps"),
             ((3,), 19, 19, 8, True, np.float32, "F")]
    cases = []
    for lead, n_q, n_k, d_v, causal, dtype, layout in specs:
        p = _problem(rng, lead, n_q, n_k, 16, d_v, causal, dtype)
        o, do = _strided(p["o"], layout), _strided(p["do"], "T" if layout else None)
        cases.append(Case((o, do), label=f"o, do of shape {lead + (n_q, d_v)}"
                          + (", non-contiguous" if layout else "")))
    return cases


@learner_check
def check_compute_d(fn):
    """Exercise 7.1: check the learner's ``compute_d(o, do)``; returns the function to use."""
    return _check("Exercise 7.1", fn, tb.compute_d, d_cases(), D_MISTAKES)


# ----------------------------------------------------------------------------------------------
# Exercise 7.2: dS = P ∘ (dP − D)
# ----------------------------------------------------------------------------------------------

DS_MISTAKES = {
    "the sign is wrong: dS = P ∘ (dP − D), not P ∘ (D − dP)":
        lambda p, dp, d: p * (d[:, None] - dp),
    "the D term is missing: dS = P ∘ (dP − D), not P ∘ dP": lambda p, dp, d: p * dp,
    "D was recomputed from this tile's P ∘ dP: a tile holds only BLOCK_N of the row's N_k "
    "columns, so that is a partial sum — use the d passed in (rowsum(dO ∘ O) over the whole row)":
        lambda p, dp, d: p * (dp - np.sum(p * dp, axis=-1, keepdims=True)),
    "D is broadcast along the wrong axis: it holds one value per query row, so subtract "
    "d[:, None] (a column), not d (a row)": lambda p, dp, d: p * (dp - d[None, :]),
    "the product with P is missing: dS = P ∘ (dP − D)": lambda p, dp, d: dp - d[:, None],
    "used a matrix product (@) where dS needs the elementwise product (*)":
        lambda p, dp, d: p @ (dp - d[:, None]),
    "the parentheses are missing: P ∘ dP − D subtracts D after the product; dS = P ∘ (dP − D)":
        lambda p, dp, d: p * dp - d[:, None],
    "P and dP swapped places: dS = P ∘ (dP − D), not dP ∘ (P − D)":
        lambda p, dp, d: dp * (p - d[:, None]),
}


def _ds_args(prob, q_start, block_m, k_start, block_n):
    t = _tile(prob, q_start, block_m, k_start, block_n)
    p = tb.recompute_p(t["q_i"], t["k_j"], t["lse_i"], prob["scale"], t["mask"])
    return p, t["do_i"] @ t["v_j"].T, t["d_i"]


def ds_cases(seed: int = _SEED + 1) -> list[Case]:
    """(p, dp, d) tiles: square first, then BLOCK_M ≠ BLOCK_N, a causal diagonal tile, float32."""
    rng = np.random.default_rng(seed)
    wide = _problem(rng, (), 40, 50, 16, 12, False)
    causal = _problem(rng, (), 45, 45, 8, 8, True)
    single = _problem(rng, (), 30, 35, 16, 16, False, np.float32)
    p, dp, d = _ds_args(wide, 32, 8, 0, 20)
    return [Case(_ds_args(wide, 16, 16, 32, 16), label="16×16 tile"),
            Case((_strided(p, "T"), _strided(dp, "F"), _strided(d[:, None], "gaps")[:, 0]),
                 label="8×20 tile, non-contiguous arrays"),
            Case(_ds_args(causal, 16, 16, 16, 16), label="causal 16×16 diagonal tile"),
            Case(_ds_args(causal, 40, 16, 32, 16), label="causal ragged 5×13 tile"),
            Case(_ds_args(single, 0, 12, 10, 9), label="12×9 tile, float32")]


@learner_check
def check_ds_tile(fn):
    """Exercise 7.2: check the learner's ``ds_tile(p, dp, d)``; returns the function to use."""
    return _check("Exercise 7.2", fn, tb.ds_tile, ds_cases(), DS_MISTAKES)


# ----------------------------------------------------------------------------------------------
# Exercise 7.3: the body of the dK/dV loop
# ----------------------------------------------------------------------------------------------

def _dk_dv_variant(q_i, do_i, lse_i, d_i, k_j, v_j, dk_j, dv_j, scale, mask=None, *, mistake,
                   with_ds=False):
    """:func:`course_lib.attention.tiled_backward.dk_dv_step` with one classic mistake switched on (also
    the tile step of Exercise 7.4's models, which need ``ds`` too: ``with_ds``)."""
    s = (1.0 if mistake == "s_no_scale" else scale) * (q_i @ k_j.T)  # (BLOCK_M, BLOCK_N)
    if mask is not None and mistake not in ("no_mask", "mask_inverted"):
        s = np.where(mask, s, -np.inf)
    elif mask is not None and mistake == "mask_inverted":  # the visible entries hidden
        s = np.where(mask, -np.inf, s)
    if mistake.startswith("tile_softmax"):
        p = np.exp(s - s.max(axis=-1, keepdims=True))
        p = p / p.sum(axis=-1, keepdims=True)
        if mistake == "tile_softmax_zeroed":  # rows with every key hidden: NaN made 0
            p = np.nan_to_num(p)
    elif mistake == "no_lse":
        p = np.exp(s)
    else:
        p = np.exp(s - lse_i[:, None])
    dp = do_i @ v_j.T  # (BLOCK_M, BLOCK_N)
    if mistake == "d_from_tile":
        d_i = np.sum(p * dp, axis=-1)
    ds = {"ds_sign": p * (d_i[:, None] - dp), "no_d": p * dp}.get(mistake, p * (dp - d_i[:, None]))
    dv_new = p @ do_i if mistake == "dv_p_not_pt" else p.T @ do_i
    dk_scale = 1.0 if mistake == "dk_no_scale" else scale
    dk_new = dk_scale * (ds @ q_i if mistake == "dk_ds_not_dst" else
                         dp.T @ q_i if mistake == "dk_dp" else ds.T @ q_i)
    if mistake == "dv_overwrite":
        dk_new = dk_j + dk_new
    elif mistake != "overwrite":
        dk_new, dv_new = dk_j + dk_new, dv_j + dv_new
    return (dk_new, dv_new, ds) if with_ds else (dk_new, dv_new)


def _dk_dv_mistake(name):
    def wrong(q_i, do_i, lse_i, d_i, k_j, v_j, dk_j, dv_j, scale, mask=None):
        if name in _BLOWS_UP and _score_max(q_i, k_j, scale) > UNSTABLE_SCORE:
            raise FloatingPointError("rounding decides this mistake's result here")
        with np.errstate(all="ignore"):  # the mistakes' own overflows and NaN
            return _dk_dv_variant(q_i, do_i, lse_i, d_i, k_j, v_j, dk_j, dv_j, scale, mask,
                                  mistake=name)
    wrong.__name__ = f"dk_dv_step_{name}"
    return wrong


DK_DV_MISTAKES = {
    "dV uses P instead of Pᵀ: dv_j += Pᵀ dO_i (keys along the rows of the result)":
        _dk_dv_mistake("dv_p_not_pt"),
    "dK uses dS instead of dSᵀ: dk_j += scale · dSᵀ q_i": _dk_dv_mistake("dk_ds_not_dst"),
    "the scale is missing from dK: dk_j += scale · dSᵀ q_i (S = scale · q kᵀ, so the chain "
    "rule brings the scale back)": _dk_dv_mistake("dk_no_scale"),
    "the scores are not scaled when P is rebuilt: p = exp(scale · q_i k_jᵀ − lse_i)":
        _dk_dv_mistake("s_no_scale"),
    "the sign is wrong in dS: dS = P ∘ (dP − D), not P ∘ (D − dP)": _dk_dv_mistake("ds_sign"),
    "the D term is missing: dS = P ∘ (dP − D), not P ∘ dP": _dk_dv_mistake("no_d"),
    "D was recomputed from this tile's P ∘ dP, which sums only part of each row — use d_i "
    "(rowsum(dO ∘ O), computed once before the loop)": _dk_dv_mistake("d_from_tile"),
    "P was rebuilt with a softmax over this tile alone: the tile holds only part of each row; "
    "use the saved statistics, P = exp(S − lse)": _dk_dv_mistake("tile_softmax"),
    "P was rebuilt with a softmax over this tile alone (rows that see none of the tile's keys "
    "set to 0): use the saved statistics, P = exp(S − lse)": _dk_dv_mistake("tile_softmax_zeroed"),
    "P = exp(S) without subtracting the saved lse (P = exp(S − lse_i[:, None]))":
        _dk_dv_mistake("no_lse"),
    "the causal mask is not applied when P is rebuilt: hidden keys (mask False) must get P = 0":
        _dk_dv_mistake("no_mask"),
    "the mask is applied the other way round: np.where(mask, -inf, s) hides the visible "
    "entries and keeps the hidden ones — mask True means visible, np.where(mask, s, -inf)":
        _dk_dv_mistake("mask_inverted"),
    "the accumulators are overwritten, not added to: return dk_j + …, dv_j + …":
        _dk_dv_mistake("overwrite"),
    "dv_j is overwritten, not added to: dv_j + Pᵀ dO_i keeps the earlier tiles' sum":
        _dk_dv_mistake("dv_overwrite"),
    "dK uses dP where dS belongs: dk_j += scale · dSᵀ q_i with dS = P ∘ (dP − D)":
        _dk_dv_mistake("dk_dp"),
}


def _dk_dv_args(prob, q_start, block_m, k_start, block_n, rng, layout=None):
    """Arguments of one loop step, with accumulators that already hold earlier tiles' sums."""
    t = _tile(prob, q_start, block_m, k_start, block_n)
    dtype = prob["q"].dtype
    dk_j = rng.standard_normal(t["k_j"].shape).astype(dtype)  # (BLOCK_N, d)
    dv_j = rng.standard_normal(t["v_j"].shape).astype(dtype)  # (BLOCK_N, d_v)
    q_i, k_j = _strided(t["q_i"], layout), _strided(t["k_j"], "T" if layout else None)
    return (q_i, t["do_i"], t["lse_i"], t["d_i"], k_j, t["v_j"], dk_j, dv_j, prob["scale"],
            t["mask"])


def dk_dv_cases(seed: int = _SEED + 2) -> list[Case]:
    """Loop steps: a square unmasked tile first, then causal diagonal tiles (square and ragged,
    d ≠ d_v, BLOCK_M ≠ BLOCK_N, rows that see none of the tile's keys), explicit scales, scores
    in the hundreds, non-contiguous arrays and a float32 one."""
    rng = np.random.default_rng(seed)
    plain = _problem(rng, (), 40, 48, 16, 16, False)
    causal = _problem(rng, (), 45, 38, 12, 8, True, scale=0.45)
    hot = _problem(rng, (), 30, 30, 10, 6, True, scale=1.0, spread=5.0)
    single = _problem(rng, (), 33, 33, 16, 16, True, np.float32)
    return [Case(_dk_dv_args(plain, 16, 16, 32, 16, rng), label="16×16 tile, no mask"),
            Case(_dk_dv_args(causal, 16, 16, 16, 16, rng, "F"),
                 label="causal 16×16 diagonal tile, scale 0.45, non-contiguous q_i, k_j"),
            Case(_dk_dv_args(causal, 26, 13, 21, 7, rng), label="causal 13×7 tile, d=12, d_v=8"),
            Case(_dk_dv_args(causal, 39, 8, 32, 16, rng), label="causal ragged 6×6 last tile"),
            Case(_dk_dv_args(hot, 8, 12, 14, 10, rng),
                 label="causal 12×10 tile, rows 8..13 see none of its keys, scores in the hundreds"),
            Case(_dk_dv_args(single, 16, 17, 10, 9, rng), label="causal 17×9 tile, float32")]


@learner_check
def check_dk_dv_step(fn):
    """Exercise 7.3: check the learner's ``dk_dv_step(...)``; returns the function to use."""
    return _check("Exercise 7.3", fn, tb.dk_dv_step, dk_dv_cases(), DK_DV_MISTAKES,
                  writable=("dk_j", "dv_j"),  # an in-place `dk_j += ...` is a fine answer
                  output_names=("dk_j", "dv_j"))


# ----------------------------------------------------------------------------------------------
# One diagnosis for a wrong gradient (Exercises 7.4 – 7.6)
# ----------------------------------------------------------------------------------------------

# Which tiles each output's rows belong to: dq (and o) rows are query rows, cut into BLOCK_M
# tiles; dk and dv rows are key rows, cut into BLOCK_N tiles.
_ROW_TILES = {"o": ("Q tile", "block_m"), "dq": ("Q tile", "block_m"),
              "dk": ("K/V tile", "block_n"), "dv": ("K/V tile", "block_n")}


def _first_bad(got, want, atol, rtol):
    """(index, max abs error, got, want) of the first element of ``got`` outside tolerance, or
    None."""
    g, w = to_numpy64(got), to_numpy64(want)
    bad = ~np.isclose(g, w, atol=atol, rtol=rtol) | (np.isnan(g) & ~np.isnan(w))
    if not bad.any():
        return None
    idx = tuple(int(i) for i in np.argwhere(bad)[0])
    diff = np.abs(g - w)
    err = float(np.nanmax(diff)) if np.isfinite(diff).any() else float("nan")
    return idx, (float("inf") if not np.isfinite(g).all() else err), g[idx], w[idx]


def _same_layout(got, want) -> bool:
    """``got`` is a tuple of arrays/tensors with ``want``'s types, shapes and dtypes (so the
    answer is wrong in its values only, which is what :func:`_gradient_diagnosis` explains)."""
    if not isinstance(got, (tuple, list)) or len(got) != len(want):
        return False
    return all(type(g) is type(w) and tuple(g.shape) == tuple(w.shape)
               and str(g.dtype) == str(w.dtype) for g, w in zip(got, want))


def _wrong_outputs(got, want, names, tolerance) -> set:
    """The names of the outputs of ``got`` that are not within ``tolerance`` of ``want``."""
    return {name for name, g, w in zip(names, got, want)
            if compare(g, w, *tolerance) is not None}


def _gradient_diagnosis(exercise, n, n_cases, case, got, want, names, blocks, tolerance):
    """The head of one diagnosis: which case, which output is wrong, its first bad row and the
    tile that row belongs to, the max error, and which outputs are right."""
    atol, rtol = tolerance
    wrong = [(name, _first_bad(g, w, atol, rtol)) for name, g, w in zip(names, got, want)]
    wrong = [(name, bad) for name, bad in wrong if bad is not None]
    lines = [f"✗ {exercise}: wrong answer on case {n} of {n_cases} — {case.label}"]
    name, (idx, err, g, w) = wrong[0]
    row, col = idx[-2], idx[-1]
    what, block_name = _ROW_TILES[name]
    block = blocks[block_name]
    n_rows = np.shape(got[names.index(name)])[-2]
    tile = row // block
    head = (f" (batch {idx[0]}, head {idx[1]})" if len(idx) == 4
            else f" (leading index {idx[:-2]})" if len(idx) > 2 else "")
    got_text = "NaN" if np.isnan(g) else f"{g:.6g}"
    lines.append(f"  {name} is wrong: max abs error {err:.3g} (tolerance atol={atol:g}, "
                 f"rtol={rtol:g}); first bad row {row}{head}, column {col}: got {got_text}, "
                 f"expected {w:.6g}")
    lines.append(f"  row {row} lies in {what} {tile} (rows {tile * block}.."
                 f"{min((tile + 1) * block, n_rows) - 1}, {block_name}={block})")
    others = [other for other, _ in wrong[1:]]
    right = [x for x in names if x not in {nm for nm, _ in wrong}]
    lines.append("  " + "; ".join(part for part in (
        f"also wrong: {', '.join(others)}" if others else "",
        f"right: {', '.join(right)}" if right else "") if part))
    return [line for line in lines if line.strip()]


_WRONG_CASE = re.compile(r"^✗ [^:]+: wrong answer on case (\d+) of")


def _check_gradients(exercise, fn, reference, cases, *, fallback, mistakes, names, blocks_of,
                     tolerance=None, kernel_check=None, answer=None, quiet=False):
    """Run ``fn`` through :func:`check_function` (or ``kernel_check``,
    :func:`course_lib.teaching.kernel_checks.check_kernel`) and, for a wrong value, replace the head of
    its message by one gradient diagnosis (which output, first bad row and its tile), keeping
    what it found out: the NaN's origin and the cause, named only when exactly one mistake
    model reproduces the answer on every case (:func:`checks.consistent_causes`).

    ``mistakes``: ``{cause: model}`` or ``{cause: (model, outputs it can change)}``: a model
    that leaves dq right cannot reproduce a wrong dq, so it is not even run on that case.
    ``blocks_of(case) -> {"block_m": .., "block_n": ..}``; ``tolerance``: ``(atol, rtol)``,
    default by the outputs' dtype (``checks.TOLERANCES``).
    """
    cases = list(cases)
    state = {"n": 0}
    got_of, wrong_of = {}, {}  # case number -> what fn returned, which outputs were wrong
    problems = {}  # case number -> the runner's own diagnosis (_Diagnosed) on that case
    number = {id(case.args[0]): n for n, case in enumerate(cases, 1)}

    @functools.wraps(reference)  # its argument names name the inputs in the diagnosis
    def tracked_reference(*args, **kwargs):
        state["n"] += 1
        state["want"] = reference(*args, **kwargs)
        return state["want"]

    def recorded(*args, **kwargs):
        n = number.get(id(args[0]) if args else None, state["n"])  # a re-run gets the case's own
        try:
            out = fn(*args, **kwargs)
        except _Diagnosed as exc:  # the runner named the cause: that is the whole diagnosis
            problems.setdefault(n, str(exc))
            raise
        got_of[n] = out
        want = state["want"]
        if n == state["n"] and _same_layout(out, want):
            wrong_of[n] = _wrong_outputs(out, want, names, tolerance or _default_tolerance(want))
        return out

    def screened(model, affected):
        def wrong(*args, **kwargs):
            seen = wrong_of.get(number.get(id(args[0]) if args else None))
            if seen is not None and not seen <= affected:
                return None  # it leaves right an output the answer has wrong: no match
            return model(*args, **kwargs)
        return wrong

    models = {cause: (screened(*m) if isinstance(m, tuple) else m) for cause, m in mistakes.items()}
    try:
        if kernel_check is not None:
            return kernel_check(exercise, answer, recorded, tracked_reference, cases,
                                fallback=fallback, tolerance=tolerance, mistakes=models,
                                output_names=names)
        chosen = check_function(exercise, recorded, tracked_reference, cases, fallback=fallback,
                                tolerance=tolerance, quiet=quiet, mistakes=models,
                                output_names=names)
        return fn if chosen is recorded else chosen
    except ExerciseFailed as failure:
        message = str(failure)
        shown = re.search(r"case (\d+)", message.split("\n")[0])  # the case the message is about
        if shown and int(shown.group(1)) in problems:
            n = int(shown.group(1))
            raise checks.failed_with(exercise, "\n".join(
                [f"✗ {exercise}: {problems[n]}", f"  on case {n} of {len(cases)} — "
                                                 f"{cases[n - 1].label}", *failure.evidence])) from None
        lines = message.splitlines()
        found = _WRONG_CASE.match(lines[0]) if lines else None
        if not found:
            raise
        n = int(found.group(1))
        case, got = cases[n - 1], got_of.get(n)
        want = reference(*case.args, **(case.kwargs or {}))
        if got is None or not _same_layout(got, want):
            raise
        tol = tolerance or _default_tolerance(want)
        head = _gradient_diagnosis(exercise, n, len(cases), case, got, want, names,
                                   blocks_of(case), tol)
        # check_function's lines after the inputs/output/problem: NaN evidence, the cause,
        # the other cases, what fn printed
        raise checks.failed_with(exercise, "\n".join(head + lines[4:])) from None


# ----------------------------------------------------------------------------------------------
# Exercise 7.4: the whole tiled backward in NumPy
# ----------------------------------------------------------------------------------------------

def _backward_variant(q, k, v, o, lse, do, causal, scale, block_m, block_n, *, mistake=""):
    """The one-pass tiled backward (outer loop over K/V tiles, inner over Q tiles, dQ added into
    the full array) with one classic mistake switched on; ``mistake=""`` is the answer. The
    tile step is Exercise 7.3's model; the mistakes of the loops are added here."""
    n_q, n_k = q.shape[0], k.shape[0]
    d_all = np.sum(do * o, axis=-1)  # (N_q,)
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    kv_end = (n_k // block_n) * block_n if mistake == "drop_tail" else n_k
    for k_start in range(0, kv_end, block_n):
        k_end = min(k_start + block_n, n_k)
        k_j, v_j = k[k_start:k_end], v[k_start:k_end]  # (BLOCK_N, d), (BLOCK_N, d_v)
        dk_j, dv_j = np.zeros_like(k_j), np.zeros_like(v_j)
        for q_start in range(0, n_q, block_m):
            q_end = min(q_start + block_m, n_q)
            if causal and (k_start // block_n > q_start // block_m if mistake == "tile_index_skip"
                           else q_start < k_start if mistake == "skip_straddling"
                           else q_end - 1 < k_start):  # tile numbers: right if block_m == block_n
                continue  # every query of this tile comes before every key: fully masked
            rows, mask = slice(q_start, q_end), None
            if causal:  # "local_tril": the tile's own corner, not the global indices
                mask = (np.tril(np.ones((q_end - q_start, k_end - k_start), dtype=bool))
                        if mistake == "local_tril"
                        else np.arange(k_start, k_end)[None, :] <= np.arange(q_start, q_end)[:, None])
            dk_j, dv_j, ds = _dk_dv_variant(q[rows], do[rows], lse[rows], d_all[rows], k_j, v_j,
                                            dk_j, dv_j, scale, mask, mistake=mistake, with_ds=True)
            dq_new = (1.0 if mistake == "dq_no_scale" else scale) * (ds @ k_j)
            if mistake == "dq_overwrite":
                dq[rows] = dq_new
            else:
                dq[rows] += dq_new
        dk[k_start:k_end], dv[k_start:k_end] = dk_j, dv_j
    return dq, dk, dv


# Mistakes that leave exp(S) unnormalised blow P up to exp(max S): past that many units of
# score, their gradients are sums of huge terms that cancel, and what comes out depends on the
# order of the additions — another learner's code would differ. No evidence on such a case.
UNSTABLE_SCORE = 10.0
_BLOWS_UP = ("no_lse",)


def _score_max(q, k, scale) -> float:
    return float(np.max(np.abs(np.asarray(q, np.float64) @ np.asarray(k, np.float64).T))) * abs(scale)


def _backward_mistake(name):
    def wrong(q, k, v, o, lse, do, causal, scale, block_m, block_n):
        if name in _BLOWS_UP and _score_max(q, k, scale) > UNSTABLE_SCORE:
            raise FloatingPointError("rounding decides this mistake's result here")
        with np.errstate(all="ignore"):  # the mistakes' own overflows and NaN
            return _backward_variant(q, k, v, o, lse, do, causal, scale, block_m, block_n,
                                     mistake=name)
    wrong.__name__ = f"flash_backward_{name}"
    return wrong


BACKWARD_MISTAKES = {
    "the scale is missing from dK: dk_j += scale · dSᵀ q_i (S = scale · q kᵀ, so the chain "
    "rule brings the scale back)": _backward_mistake("dk_no_scale"),
    "the scale is missing from dQ: dq[rows] += scale · dS k_j": _backward_mistake("dq_no_scale"),
    "the scores are not scaled when P is rebuilt: P = exp(scale · q_i k_jᵀ − lse_i)":
        _backward_mistake("s_no_scale"),
    "D was computed from this tile's P ∘ dP, which sums only BLOCK_N of each row's N_k columns "
    "— compute D = rowsum(dO ∘ O) once, before the loops": _backward_mistake("d_from_tile"),
    "P was rebuilt with a softmax over this tile alone: the tile holds only part of each row; "
    "use the saved statistics, P = exp(S − lse)": _backward_mistake("tile_softmax"),
    "P was rebuilt with a softmax over this tile alone (rows that see none of the tile's keys "
    "set to 0): the tile holds only part of each row; use the saved statistics, "
    "P = exp(S − lse)": _backward_mistake("tile_softmax_zeroed"),
    "P = exp(S) without subtracting the saved lse (P = exp(S − lse_i[:, None]))":
        _backward_mistake("no_lse"),
    "dV uses P instead of Pᵀ: dv_j += Pᵀ dO_i (keys along the rows of the result)":
        _backward_mistake("dv_p_not_pt"),
    "the sign of dS is flipped: dS = P ∘ (dP − D), not P ∘ (D − dP)": _backward_mistake("ds_sign"),
    "the causal mask is not applied when P is rebuilt: in tiles that straddle the diagonal, "
    "keys j > i must get P = 0 (set their scores to -inf before the exp)":
        _backward_mistake("no_mask"),
    "the causal mask is the tile's own lower triangle (np.tril of the tile) — it must use the "
    "global indices: key k_start + c is visible to query q_start + r when k_start + c <= "
    "q_start + r": _backward_mistake("local_tril"),
    "tiles are skipped by comparing tile numbers (k_start // block_n > q_start // block_m), "
    "which is right only when block_m == block_n — skip when the tile's last query, q_end − 1, "
    "comes before its first key, k_start": _backward_mistake("tile_index_skip"),
    "tiles that straddle the diagonal are skipped too (q_start < k_start): such a tile's later "
    "queries see its first keys — skip only when the tile's last query, q_end − 1, comes before "
    "its first key, k_start": _backward_mistake("skip_straddling"),
    "dQ is overwritten, not accumulated: each K/V tile adds its part, dq[rows] += scale · dS k_j "
    "(with the K/V loop outside, dQ's sum runs across the outer loop)":
        _backward_mistake("dq_overwrite"),
    "dk_j, dv_j are overwritten in the Q loop, not accumulated: dk_j = dk_j + …, dv_j = dv_j + …":
        _backward_mistake("overwrite"),
    "the last, shorter K/V tile is dropped: range(0, n_k // block_n * block_n, block_n) stops "
    "before the ragged tail — loop over range(0, n_k, block_n) and slice to min(k_start + "
    "block_n, n_k)": _backward_mistake("drop_tail"),
}


def _reference_backward(q, k, v, o, lse, do, causal, scale, block_m, block_n):
    return tb.flash_attention_numpy_backward(q, k, v, o, lse, do, causal, scale, block_m, block_n)


def _strided(x, how: str):
    """``x`` with the same values in another memory layout: 'F' column-major, 'gaps' every
    other column of a wider array, 'T' the transpose of a contiguous transpose."""
    if how == "F":
        return np.asfortranarray(x)
    if how == "gaps":
        wide = np.full(x.shape[:-1] + (2 * x.shape[-1],), np.nan, dtype=x.dtype)
        wide[..., ::2] = x
        return wide[..., ::2]
    if how == "T":
        return np.ascontiguousarray(x.T).T
    return x


def backward_cases(seed: int = _SEED + 4) -> list[Case]:
    """Whole problems, one head: square tiles first (a transposition mistake then has the right
    shape and can be named), then ragged N, N_q ≠ N_k both ways, d ≠ d_v (neither a power of
    two), BLOCK_M ≠ BLOCK_N both ways (some rows of a diagonal tile see none of its keys),
    causal and not, explicit scales, scores in the hundreds, float32, non-contiguous arrays."""
    rng = np.random.default_rng(seed)
    specs = [  # (n_q, n_k, d, d_v, causal, block_m, block_n, scale, spread, dtype, layout)
        (32, 32, 16, 16, False, 16, 16, None, 1.0, np.float64, None),
        (48, 48, 8, 8, True, 16, 16, None, 1.0, np.float64, "F"),
        (45, 38, 12, 10, True, 16, 12, 0.3, 1.0, np.float64, "gaps"),
        (29, 53, 20, 12, False, 8, 16, None, 1.0, np.float64, "T"),
        (40, 33, 20, 20, True, 12, 16, 1.0, 5.0, np.float64, None),
        (37, 37, 16, 16, True, 10, 7, None, 1.0, np.float32, "F"),
    ]
    cases = []
    for n_q, n_k, d, d_v, causal, block_m, block_n, scale, spread, dtype, layout in specs:
        scale = default_scale(d) if scale is None else scale
        q = (rng.standard_normal((n_q, d)) * spread).astype(dtype)
        k = (rng.standard_normal((n_k, d)) * spread).astype(dtype)
        v = rng.standard_normal((n_k, d_v)).astype(dtype)
        do = rng.standard_normal((n_q, d_v)).astype(dtype)
        o, lse = naive_attention_numpy(q.astype(np.float64), k.astype(np.float64),
                                       v.astype(np.float64), causal, scale)
        q, k, do = (_strided(x, layout) for x in (q, k, do))
        label = (f"{'causal' if causal else 'non-causal'}, N_q={n_q}, N_k={n_k}, d={d}, "
                 f"d_v={d_v}, block_m={block_m}, block_n={block_n}, scale={scale:.3g}, "
                 f"{np.dtype(dtype).name}" + (", scores up to the hundreds" if spread > 1 else "")
                 + (", non-contiguous q, k, do" if layout else ""))
        cases.append(Case((q, k, v, o.astype(dtype), lse.astype(dtype), do, causal, scale,
                           block_m, block_n), label=label))
    return cases


def _numpy_blocks(case):
    return {"block_m": case.args[8], "block_n": case.args[9]}


BACKWARD_HINTS = [
    "Three outputs, one pass over tiles: an outer loop over K/V tiles j (k_j, v_j and their "
    "accumulators dk_j, dv_j stay put), an inner loop over Q tiles i. dQ needs a sum over K/V "
    "tiles, which here is the <i>outer</i> loop: keep dq as a full (N_q, d) array of zeros and "
    "add into dq[rows] from inside the inner loop.",
    "Before the loops: D = rowsum(dO ∘ O), one number per query row (Exercise 7.1). Never "
    "rebuild it from a tile: a tile holds only part of a row.",
    "Inside: rebuild P from the saved lse, p = exp(scale · q_i k_jᵀ − lse_i[:, None]); no "
    "softmax, lse already holds the row's max and sum. Causal: set the scores of keys j > i to "
    "-inf before the exp, and skip a tile when its last query row q_end − 1 is before k_start.",
    "Then the five lines of section 1, on tiles: dv_j += pᵀ do_i; dp = do_i v_jᵀ; "
    "ds = p ∘ (dp − D_i) (Exercise 7.2); dk_j += scale · dsᵀ q_i; dq[rows] += scale · ds k_j.",
    "Ragged N: loop over range(0, n, block) and slice to min(start + block, n); the last tile "
    "is simply shorter. Write dk_j, dv_j into dk, dv once, after the inner loop.",
]

BACKWARD_SKELETON = '''\
def flash_backward(q, k, v, o, lse, do, causal, scale, block_m, block_n):
    n_q, n_k = q.shape[0], k.shape[0]
    d_all = ...                                   # (N_q,)  D = rowsum(dO ∘ O)
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    for k_start in range(0, n_k, block_n):        # outer: one K/V tile, kept "on chip"
        k_end = min(k_start + block_n, n_k)
        k_j, v_j = k[k_start:k_end], v[k_start:k_end]
        dk_j, dv_j = np.zeros_like(k_j), np.zeros_like(v_j)
        for q_start in range(0, n_q, block_m):    # inner: the Q tiles stream past
            q_end = min(q_start + block_m, n_q)
            if causal and ...:                    # whole tile above the diagonal?
                continue
            rows = slice(q_start, q_end)
            s = ...                               # (BLOCK_M, BLOCK_N) scale · q_i k_jᵀ, masked
            p = ...                               # P rebuilt from lse
            dv_j = ...
            dp = ...
            ds = ...
            dk_j = ...
            dq[rows] += ...
        dk[k_start:k_end], dv[k_start:k_end] = dk_j, dv_j
    return dq, dk, dv
'''


@learner_check
def check_flash_backward(fn):
    """Exercise 7.4: check the learner's ``flash_backward(q, k, v, o, lse, do, causal, scale,
    block_m, block_n) -> (dq, dk, dv)`` (one head, 2-D arrays); returns the function to use
    (the library's :func:`course_lib.attention.tiled_backward.flash_attention_numpy_backward` when not
    done yet)."""
    from course_lib.teaching import read_watch  # the watched arrays that count what is computed

    exercise, cases, logs = "Exercise 7.4", backward_cases(), []

    def watched(q, k, v, o, lse, do, causal, scale, block_m, block_n):
        logs.append(None)
        out, record = grade_channel.run_with(fn, read_watch.watched_call, ("q", "k"), q, k, v, o,
                                             lse, do, causal, scale, block_m, block_n)
        logs[-1] = read_watch.LoadLog.from_data(record, {"q": q.shape, "k": k.shape})
        return out

    chosen = _check_gradients(exercise, watched, _reference_backward, cases,
                              fallback=tb.flash_attention_numpy_backward,
                              mistakes=BACKWARD_MISTAKES, names=("dq", "dk", "dv"),
                              blocks_of=_numpy_blocks, quiet=True)
    if chosen is not watched:  # not done yet (quiet: say it here)
        return checks.not_done(exercise, chosen)
    for n, (case, log) in enumerate(zip(cases, logs), 1):
        hidden = hidden_tiles_computed(log, case)
        problem = hidden or read_watch.missing_loads(log, case.args[0].shape[-2], bool(case.args[6]))
        if problem:
            what = "hidden tiles computed" if hidden else "a record of its loads that leaves some out"
            raise checks.failed_with(exercise, "\n".join(
                [f"✗ {exercise}: right numbers, but {what} on case {n} of {len(cases)} — "
                 f"{case.label}", *problem]))
    checks.passed(exercise, f"✓ {exercise}: passed ({len(cases)} cases; no tile the causal mask "
                            f"hides was computed).")
    return fn


def hidden_tiles_computed(log, case: Case) -> list[str]:
    """Lines saying which operation of the learner's backward multiplied rows of q with rows of
    k that the causal mask hides from each other entirely (a (Q tile, K/V tile) pair the
    algorithm skips), or [] when none did. ``log``: the q and k touches of one call
    (:func:`course_lib.teaching.read_watch.watch`)."""
    from course_lib.attention import iomodel
    from course_lib.teaching import read_watch

    q, k = case.args[0], case.args[1]
    causal, block_m, block_n = case.args[6], case.args[8], case.args[9]
    if not causal:
        return []
    n_q, n_k = q.shape[-2], k.shape[-2]
    skip = iomodel.causal_skip_grid(n_q, n_k, block_m, block_n)  # (T_r, T_c)
    by_op: dict = {}
    for touch in log.touches:
        by_op.setdefault(touch.op, []).append(touch)
    for touches in by_op.values():
        rows = {t.name: t for t in touches}
        if set(rows) != {"q", "k"}:
            continue
        q_tiles = sorted({int(r) // block_m for r in rows["q"].rows})
        k_tiles = sorted({int(r) // block_n for r in rows["k"].rows})
        hidden = [(i, j) for i in q_tiles for j in k_tiles if skip[i, j]]
        if hidden:
            i, j = hidden[0]
            return [f"  {read_watch.line_text(rows['q'].where)} multiplies rows "
                    f"{rows['q'].rows[0]}–{rows['q'].rows[-1]} of q with keys "
                    f"{rows['k'].rows[0]}–{rows['k'].rows[-1]} of k: that includes Q tile {i} × "
                    f"K/V tile {j}, which the causal mask hides entirely (its first key "
                    f"{j * block_n} comes after the Q tile's last query "
                    f"{min((i + 1) * block_m, n_q) - 1})",
                    "  its gradients are 0, so the numbers come out right, but the work is the "
                    "dense backward's: skip a pair before computing it, when q_end − 1 < k_start"]
    return []


# ----------------------------------------------------------------------------------------------
# Exercise 7.5: the Triton backward — a dK/dV kernel and a dQ kernel
# ----------------------------------------------------------------------------------------------
# The learner writes two kernels with the library's argument names (a simpler signature than
# course_lib.kernels.backward's: no head-dim padding, natural exp, fp32 accumulators); D (the
# code's DELTA) comes from the library's preprocess kernel, launched by launch_backward. The
# mistake models are the library's own kernels with one classic mistake switched on
# (``backward.MISTAKES``): no second copy of the kernels lives here.

# 16 is the smallest tile tl.dot accepts on a GPU; launch_backward's default tile.
CHECK_BLOCK = 16


def _library_pair(dkdv, dq_kern) -> bool:
    """True for the library's kernels (the fallback), which take the library's signature."""
    return dkdv is backward.dkdv_kernel and dq_kern is backward.dq_kernel


def _check_backward_shapes(q, k, v, o, lse, do) -> None:
    """ValueError naming the argument of :func:`launch_backward` whose shape does not fit q's
    ``(B, H, N_q, d)`` and k's ``(B, H, N_k, d)`` (and saying so when o and lse, or q and k,
    look swapped: a call's arguments in the wrong order)."""
    if q.dim() != 4:
        raise ValueError(f"launch_backward: q must be (B, H, N_q, d), got shape {tuple(q.shape)}")
    expected = {"k": (*q.shape[:2], k.shape[2] if k.dim() == 4 else -1, q.shape[3]), "v": tuple(k.shape),
                "o": tuple(q.shape), "lse": tuple(q.shape[:3]), "do": tuple(q.shape)}
    given = {"k": k, "v": v, "o": o, "lse": lse, "do": do}
    for name, shape in expected.items():
        if tuple(given[name].shape) != shape:
            swapped = {"o": "lse", "lse": "o"}.get(name)
            hint = (f" — it has the shape `{swapped}` should have: are `o` and `lse` passed in each other's "
                    f"places? launch_backward takes (…, q, k, v, o, lse, do, …)"
                    if swapped and tuple(given[swapped].shape) == shape and
                    tuple(given[name].shape) == expected[swapped] else "")
            raise ValueError(f"launch_backward: `{name}` has shape {tuple(given[name].shape)}, expected "
                             f"{shape} from q {tuple(q.shape)} and k {tuple(k.shape)}{hint}")


def launch_backward(dkdv, dq_kern, q, k, v, o, lse, do, causal: bool, scale: float,
                    block_m: int = CHECK_BLOCK, block_n: int = CHECK_BLOCK,
                    dq=None, dk=None, dv=None):
    """Run the backward with two kernels of Exercise 7.5's signatures (or the library's pair).

    Args:
        q, o, do: ``(B, H, N_q, d)``; k, v: ``(B, H, N_k, d)``; any strides, one dtype;
            ``d`` a power of two ≥ 16. lse: ``(B, H, N_q)`` contiguous fp32, as
            :func:`course_lib.kernels.forward.attention_forward` returns it.
        dq, dk, dv: where to write (default: new tensors shaped like q, k, v); dk and dv share
            one layout. dq is zeroed first, so a dQ kernel may also add its tiles with atomics.

    Returns:
        ``(dq, dk, dv)``. ``DELTA = rowsum(dO ∘ O)`` (the paper's D) comes from the library's
        ``preprocess_kernel``. In the interpreter every load and store is checked against these
        tensors before it happens (:func:`course_lib.teaching.kernel_checks.memory_guard`).
    """
    _check_backward_shapes(q, k, v, o, lse, do)
    batch, heads, n_q, d = q.shape
    n_k = k.shape[2]
    dq = torch.empty_like(q, memory_format=torch.contiguous_format) if dq is None else dq
    dk = torch.empty_like(k, memory_format=torch.contiguous_format) if dk is None else dk
    dv = torch.empty_like(v, memory_format=torch.contiguous_format) if dv is None else dv
    if dk.stride() != dv.stride():
        raise ValueError(f"dk and dv must share one layout, got strides {dk.stride()} and {dv.stride()}")
    if _library_pair(dkdv, dq_kern):  # the fallback: the library's signature and launcher
        blocks = tuning.Blocks(block_m, block_n)
        return backward.attention_backward(do, q, k, v, o, lse, causal, scale, blocks, blocks,
                                           out=(dq, dk, dv))
    dq.zero_()
    delta = torch.empty((batch, heads, n_q), dtype=torch.float32, device=q.device)  # (B, H, N_q)
    strides = (*q.stride(), *k.stride(), *v.stride(), *do.stride())
    meta = dict(HEAD_DIM=d, CAUSAL=bool(causal), BLOCK_M=block_m, BLOCK_N=block_n)
    with kernel_checks.memory_guard() as guard:
        for name, x in (("Q", q), ("K", k), ("V", v), ("O", o), ("DO", do), ("LSE", lse)):
            guard.allow(name, x)
        for name, x in (("DELTA", delta), ("DQ", dq), ("DK", dk), ("DV", dv)):
            guard.allow(name, x, write=True)
        backward.preprocess_kernel[(triton.cdiv(n_q, backward.PREPROCESS_BLOCK_M) * batch * heads,)](
            o, do, delta, *o.stride(), *do.stride(), heads, n_q, HEAD_DIM_REAL=d, HEAD_DIM=d,
            ACC_DTYPE=tl.float32, BLOCK_M=backward.PREPROCESS_BLOCK_M)
        dkdv[(triton.cdiv(n_k, block_n), batch * heads)](
            q, k, v, do, lse, delta, dk, dv, *strides, *dk.stride(), heads, n_q, n_k, float(scale), **meta)
        dq_kern[(triton.cdiv(n_q, block_m), batch * heads)](
            q, k, v, do, lse, delta, dq, *strides, *dq.stride(), heads, n_q, n_k, float(scale), **meta)
    return dq, dk, dv


def reference_gradients(q, k, v, o, lse, do, causal: bool, scale: float, **launch):
    """float64 autograd of the naive attention, rounded to the inputs' dtype: ``(dq, dk, dv)``
    (``launch``: the case's tile sizes and layouts, which do not change the answer)."""
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    out, _ = naive_attention_torch(q64, k64, v64, causal, scale)
    out.backward(do.double())
    return tuple(x.grad.to(q.dtype) for x in (q64, k64, v64))


def _kernel_case_dtypes():
    # fp32 is exact only in the interpreter (TF32 products on a GPU); bf16 only on a GPU.
    return (torch.float32, torch.float16) if _rt.interpreted else (torch.float16, torch.bfloat16)


def _attention_problem(gen, batch, heads, n_q, n_k, d, dtype, causal, scale, device, spread=1.0):
    """(q, k, v, o, lse, do): random inputs; o and lse from the float64 forward (lse fp32).
    ``spread`` scales q and k: scores reach about ±spread²·scale·d (hundreds for spread 6)."""
    q = torch.randn(batch, heads, n_q, d, generator=gen) * spread
    k = torch.randn(batch, heads, n_k, d, generator=gen) * spread
    v = torch.randn(batch, heads, n_k, d, generator=gen)
    do = torch.randn(batch, heads, n_q, d, generator=gen)
    to = dict(device=device, dtype=dtype)
    q, k, v, do = (x.to(**to) for x in (q, k, v, do))
    o, lse = naive_attention_torch(q.double(), k.double(), v.double(), causal, scale)
    return (q, k, v, o.to(**to), lse.float().to(device), do)


# Memory layouts of the check's tensors: the order of the (B, H, N, d) dims in memory, outermost
# first, and the step between columns (2: a column stride of 2, the gaps filled like margins).
# Every tensor of a case gets its own, so a stride of one tensor used for another shows.
LAYOUTS = {
    "bhnd": ("bhnd", 1),     # contiguous (B, H, N, d)
    "bnhd": ("bnhd", 1),     # heads interleaved: a (B, N, H, d) tensor seen as (B, H, N, d)
    "hbnd": ("hbnd", 2),     # heads outermost, column stride 2
    "bhnd2": ("bhnd", 2),    # column stride 2
    "nbhd": ("nbhd", 1),     # sequence outermost
}
# Rows past N in every tensor's buffer (margins of NaN for inputs, of a sentinel for outputs).
ROW_MARGIN = CHECK_BLOCK


def _place(x, layout: str, fill: float):
    """A copy of ``x`` ``(B, H, N, d)`` in ``LAYOUTS[layout]``, inside a buffer holding ``fill``
    everywhere else: ``(view, buffer)``."""
    order, step = LAYOUTS[layout]
    size = dict(zip("bhnd", x.shape))
    size["n"] += ROW_MARGIN
    size["d"] *= step
    buffer = torch.full([size[c] for c in order], fill, dtype=x.dtype, device=x.device)
    view = buffer.permute([order.index(c) for c in "bhnd"])[:, :, :x.shape[2], ::step]
    view.copy_(x)
    return view, buffer


# (batch, heads, n_q, n_k, d, causal, scale, block_m, block_n, spread, fast dtype, layouts of
# q, k, v, o, do, then dq and dk/dv). Square tiles first (a P-for-Pᵀ mistake keeps its shape
# there and can be named); then BLOCK_M ≠ BLOCK_N both ways so the causal loop bounds matter
# (BLOCK_M > BLOCK_N: some rows of a diagonal tile see none of its keys), N_q > N_k causal,
# N_q < N_k, spare batch and heads, explicit scales, scores up to ±80 (a correct fp32 kernel
# loses about |s|·2⁻²⁴ in every exponent: at ±100 that nears the fp32 tolerance), and fp16.
KERNEL_SPECS = (
    (1, 2, 32, 32, 16, False, None, 16, 16, 1.0, False,
     ("bhnd", "bnhd", "hbnd", "bhnd2", "nbhd", "bnhd", "bhnd")),
    (2, 1, 45, 45, 32, True, 0.3, 32, 16, 1.0, False,
     ("bnhd", "bhnd2", "bhnd", "nbhd", "hbnd", "bhnd", "nbhd")),
    (1, 2, 23, 40, 16, False, 0.6, 16, 16, 3.0, False,
     ("bhnd2", "hbnd", "bnhd", "bhnd", "nbhd", "bhnd", "bhnd")),
    (2, 2, 50, 29, 16, True, None, 16, 32, 1.0, True,
     ("bhnd", "hbnd", "nbhd", "bnhd", "bhnd2", "hbnd", "bnhd")),
)


def kernel_cases(seed: int = 7_5) -> list[Case]:
    """Exercise 7.5's cases (``KERNEL_SPECS``): args ``(q, k, v, o, lse, do)``, kwargs causal,
    scale, the tile sizes and the layouts the kernels see."""
    gen = torch.Generator().manual_seed(seed)
    exact, fast = _kernel_case_dtypes()
    cases = []
    for (batch, heads, n_q, n_k, d, causal, scale, block_m, block_n, spread, is_fast,
         layouts) in KERNEL_SPECS:
        dtype = fast if is_fast else exact
        scale = default_scale(d) if scale is None else scale
        if not _rt.interpreted:  # fp16 is the exact dtype there: scores of ±80 in fp16 lose
            spread = min(spread, 1.5)  # more than its tolerance in a correct kernel; keep ±20
        args = _attention_problem(gen, batch, heads, n_q, n_k, d, dtype, causal, scale,
                                  _rt.device, spread)
        largest = float((args[0].double() @ args[1].double().transpose(-1, -2)).abs().max()
                        * scale)
        label = (f"{'causal' if causal else 'non-causal'}, (B, H)=({batch}, {heads}), N_q={n_q}, "
                 f"N_k={n_k}, d={d}, scale={scale:.3g}, {str(dtype).replace('torch.', '')}, "
                 f"BLOCK_M={block_m}, BLOCK_N={block_n}"
                 + (f", scores up to ±{largest:.0f}" if spread > 1 else "")
                 + "; q, k, v, o, do each with its own strides")
        cases.append(Case(args, {"causal": causal, "scale": scale, "block_m": block_m,
                                 "block_n": block_n, "layouts": layouts}, label=label))
    return cases


def kernel_runner(dkdv, dq_kern):
    """``run(q, k, v, o, lse, do, causal, scale, block_m, block_n, layouts) -> (dq, dk, dv)``:
    the learner's kernels on copies of the inputs placed in the case's layouts, inside buffers
    whose margins (and column gaps) hold NaN, writing into outputs pre-filled with a sentinel.
    Raises :class:`kernel_checks.KernelProblem` for what only the run can see: an access
    outside the tensors (the memory guard, in the interpreter), a store into an input or past
    an output, elements never written, NaN that came from outside the inputs (GPU)."""
    def launch(args, layouts, block_m, block_n, causal, scale, fill):
        q, k, v, o, lse, do = args
        placed = [_place(x, lay, fill) for x, lay in zip((q, k, v, o, do), layouts)]
        pristine = [buffer.clone() for _, buffer in placed]
        outs = [_place(torch.full_like(x, OUTPUT_SENTINEL), lay, OUTPUT_SENTINEL)
                for x, lay in ((q, layouts[5]), (k, layouts[6]), (v, layouts[6]))]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # NumPy's overflow warnings
            launch_backward(dkdv, dq_kern, *(view for view, _ in placed[:4]), lse.clone(),
                            placed[4][0], causal, scale, block_m, block_n,
                            *(view for view, _ in outs))
        if q.device.type == "cuda":
            torch.cuda.synchronize()
        for name, (_, buffer), before in zip(("q", "k", "v", "o", "do"), placed, pristine):
            if not checks.same_value(before, buffer):
                raise kernel_checks.KernelProblem(
                    f"your kernel wrote into its input `{name}` — inputs are read-only: tl.store "
                    f"only to DK, DV (dkdv_kernel) and DQ (dq_kernel)")
        for name, (view, buffer), owner in zip(("dq", "dk", "dv"), outs, ("dQ", "dK/dV", "dK/dV")):
            written = int((buffer != OUTPUT_SENTINEL).sum() - (view != OUTPUT_SENTINEL).sum())
            if written:
                raise kernel_checks.KernelProblem(
                    f"your kernel wrote {written} value(s) outside {name} {tuple(view.shape)} — "
                    f"the last, ragged tile sticks out past N: mask every tl.store with "
                    f"rows < n_q (dq) or cols < n_k (dk, dv)")
            never = torch.nonzero(view == OUTPUT_SENTINEL)
            if len(never):
                b, h, row, _ = (int(i) for i in never[0])
                raise kernel_checks.KernelProblem(
                    f"{len(never)} element(s) of {name} {tuple(view.shape)} were never written, "
                    f"the first in row {row} of batch {b}, head {h} — the {owner} programs must "
                    f"cover every tile of rows of every (batch, head) = program_id(1)")
        return tuple(view.clone() for view, _ in outs)

    def run(q, k, v, o, lse, do, causal, scale, block_m, block_n, layouts):
        args = (q, k, v, o, lse, do)
        grads = launch(args, layouts, block_m, block_n, causal, scale, kernel_checks.INPUT_MARGIN_FILL)
        # On a GPU nothing stops a stray read: NaN that turns finite when the margins hold 0
        # came from them. (In the interpreter the memory guard stopped such a read already.)
        if not _rt.interpreted and all(bool(torch.isfinite(x).all()) for x in args) and not all(
                bool(torch.isfinite(g).all()) for g in grads):
            again = launch(args, layouts, block_m, block_n, causal, scale,
                           kernel_checks.INPUT_MARGIN_REFILL)
            if all(bool(torch.isfinite(g).all()) for g in again):
                raise kernel_checks.KernelProblem(
                    "the output depends on memory outside the inputs (their margins hold NaN, and "
                    "NaN came out): a tl.load reads past the ragged end or with a wrong stride — "
                    "mask the rows of the last tile (rows[:, None] < n_q or cols < n_k, "
                    "other=0.0) and use each tensor's own strides")
        return grads  # NaN/inf from the arithmetic is judged (and explained) like any value

    return run


OUTPUT_SENTINEL = kernel_checks.OUTPUT_SENTINEL


_BLOWS_UP_KERNEL = ("no_lse", "exp2_lse_natural")


def _library_with(mistake: str | None):
    """The library's kernels with one classic mistake switched on, on a case's inputs."""
    def wrong(q, k, v, o, lse, do, causal, scale, block_m, block_n, layouts=None):
        if mistake in _BLOWS_UP_KERNEL and float(
                (q.double() @ k.double().transpose(-1, -2)).abs().max()) * abs(scale) > 2 * UNSTABLE_SCORE:
            raise FloatingPointError("rounding decides this mistake's result here")
        blocks = tuning.Blocks(block_m, block_n)
        with warnings.catch_warnings():  # NumPy's overflow warnings from the interpreter
            warnings.simplefilter("ignore", RuntimeWarning)
            return backward.attention_backward(do, q, k, v, o, lse, causal, scale, blocks, blocks,
                                               mistake=mistake)
    wrong.__name__ = f"backward_{mistake}"
    return wrong


def _library_default_scale(q, k, v, o, lse, do, causal, scale, block_m, block_n, layouts=None):
    """The library's kernels run with 1/√d instead of the scale they were given."""
    return _library_with(None)(q, k, v, o, lse, do, causal, default_scale(q.shape[-1]),
                                 block_m, block_n)


# cause -> (mistake model, the gradients it can change: the others it leaves right)
_KERNEL_MODELS = {
    "the scale is missing from dK: dk = scale · dSᵀ Q (multiply once, after the loop)":
        ("dk_no_scale", {"dk"}),
    "the scale is missing from dQ: dq = scale · dS K (multiply once, after the loop)":
        ("dq_no_scale", {"dq"}),
    "DELTA was recomputed from this tile's P ∘ dP (tl.sum(p * dp, axis=1)), a partial row "
    "sum — load DELTA, the row's full rowsum(dO ∘ O)": ("d_from_tile", {"dq", "dk"}),
    "P was rebuilt with a softmax over this tile alone: use the saved statistics, "
    "p = exp(scale · q kᵀ − lse[:, None])": ("tile_softmax", {"dq", "dk", "dv"}),
    "the causal mask is missing in the backward: in tiles that straddle the diagonal, keys "
    "j > i must get p = 0 (tl.where(cols[None, :] <= rows[:, None], p, 0.0))":
        ("no_causal_mask", {"dq", "dk", "dv"}),
    "dV uses P instead of Pᵀ: dv += tl.dot(tl.trans(p), do) (keys along the rows)":
        ("dv_p_not_pt", {"dv"}),
    "dK uses dS instead of dSᵀ: dk += tl.dot(tl.trans(ds), q) (keys along the rows)":
        ("dk_ds_not_dst", {"dk"}),
    "the sign of dS is flipped: ds = p · (dp − delta[:, None]), not p · (delta − dp)":
        ("ds_sign", {"dq", "dk"}),
    "dq is overwritten in the K/V loop, not accumulated: dq += tl.dot(ds, k)":
        ("dq_overwrite", {"dq"}),
    "exp2 with the scores in log2 units but lse in natural-log units: subtract lse · LOG2_E "
    "(or use tl.exp with natural units throughout)": ("exp2_lse_natural", {"dq", "dk", "dv"}),
    "P = exp(S) without subtracting the saved lse: p = exp(S − lse[:, None])":
        ("no_lse", {"dq", "dk", "dv"}),
    "the causal K/V loop of dq_kernel stops at start_m + BLOCK_N: the tile's last query, "
    "start_m + BLOCK_M − 1, sees keys up to itself — stop at min(n_k, start_m + BLOCK_M)":
        ("kv_end_block_n", {"dq"}),
    "LSE and DELTA are read without the head's offset: row r of head bh = b · n_heads + h is "
    "at LSE + bh · n_q + r": ("rowstats_no_head", {"dq", "dk", "dv"}),
}


def _kernel_mistakes():
    models = {cause: (_library_with(name), affected) for cause, (name, affected)
              in _KERNEL_MODELS.items()}
    models["the kernels use 1/√d instead of the scale argument: p = exp(scale · q kᵀ − lse) "
           "and dk, dq · scale with the `scale` the launcher passes"] = (
        _library_default_scale, {"dq", "dk", "dv"})
    return models


KERNEL_MISTAKES = {cause: model for cause, (model, _) in _kernel_mistakes().items()}


def _kernel_blocks(case):
    kw = case.kwargs or {}
    return {"block_m": kw.get("block_m", CHECK_BLOCK), "block_n": kw.get("block_n", CHECK_BLOCK)}


@learner_check
def check_backward_kernels(dkdv, dq_kern):
    """Exercise 7.5: check the learner's ``dkdv_kernel`` and ``dq_kernel`` together; returns the
    pair to use (the library's :func:`course_lib.kernels.backward.dkdv_kernel` and
    :func:`~course_lib.kernels.backward.dq_kernel` when not done yet, which
    :func:`launch_backward` also runs)."""
    return _check_gradients("Exercise 7.5", kernel_runner(dkdv, dq_kern), reference_gradients,
                            kernel_cases(), fallback=(backward.dkdv_kernel, backward.dq_kernel),
                            mistakes=_kernel_mistakes(), names=("dq", "dk", "dv"),
                            blocks_of=_kernel_blocks, kernel_check=kernel_checks.check_kernel,
                            answer=(dkdv, dq_kern), tolerance=_kernel_tolerance())


def _kernel_tolerance():
    """None (by dtype) in the interpreter; on a GPU the cases are fp16/bf16, where a correct
    backward (P and dS rounded to half precision before their matmuls) is off by ~5e-3 on
    gradients of order 0.1–1: (2e-2, 4e-2), still far below the O(1) errors of the mistakes."""
    return None if _rt.interpreted else (2e-2, 4e-2)


# ----------------------------------------------------------------------------------------------
# Exercise 7.6: a torch.autograd.Function around the forward kernel and the learner's kernels
# ----------------------------------------------------------------------------------------------

NO_SAVED_TENSORS = ("no saved tensors found — save them with ctx.save_for_backward(q, k, v, o, "
                    "lse) in forward, and read them back with ctx.saved_tensors in backward")
TENSORS_AS_ATTRIBUTES = ("forward saved no tensor with ctx.save_for_backward: tensors kept as ctx "
                         "attributes (ctx.q = q) bypass autograd's checks — an in-place change of "
                         "q after forward would go unnoticed and backward would compute wrong "
                         "gradients — and stay alive after backward; save q, k, v, o, lse with "
                         "ctx.save_for_backward(...) and read them with ctx.saved_tensors")
WRONG_GRADIENT_COUNT = ("backward must return one value per input of forward (q, k, v, causal, "
                        "scale): return dq, dk, dv, None, None — None for the two that are not "
                        "tensors")


def function_reference(q, k, v, do, causal: bool, scale: float):
    """float64 autograd of the naive attention, in the inputs' dtype: ``(o, dq, dk, dv)``."""
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    o, _ = naive_attention_torch(q64, k64, v64, causal, scale)
    o.backward(do.double())
    return (o.detach().to(q.dtype),) + tuple(x.grad.to(q.dtype) for x in (q64, k64, v64))


def run_function(fn_cls, q, k, v, do, causal: bool, scale: float):
    """``(o, dq, dk, dv)`` from ``fn_cls.apply(q, k, v, causal, scale)`` and ``.backward(do)``;
    the classic autograd-glue errors become :class:`_Diagnosed` with a named cause."""
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    o = fn_cls.apply(q, k, v, causal, scale)
    if not isinstance(o, torch.Tensor):
        raise _Diagnosed(f"forward must return o alone (one tensor), got {describe_value(o)} — "
                         f"keep lse for backward with ctx.save_for_backward instead of returning it")
    if o.grad_fn is None:
        raise _Diagnosed("forward's output is not connected to autograd (o.grad_fn is None): "
                         "return the o you computed, not a detached copy")
    saved = o.grad_fn.saved_tensors
    try:
        o.backward(do)
    except Exception as exc:  # noqa: BLE001 - the glue's classic errors get their cause named
        if not saved:
            raise _Diagnosed(NO_SAVED_TENSORS) from None
        if "incorrect number of gradients" in str(exc):
            raise _Diagnosed(f"{WRONG_GRADIENT_COUNT} (torch says: {str(exc).strip()})") from None
        raise
    if not saved:  # right numbers, but autograd never saw the tensors backward used
        raise _Diagnosed(TENSORS_AS_ATTRIBUTES)
    return o.detach(), q.grad, k.grad, v.grad


def function_cases(seed: int = 7_6) -> list[Case]:
    """Exercise 7.6's cases: (q, k, v, do) with causal and scale, the exact dtype and then the
    fast one; N_q = N_k first, so gradients returned in the wrong order have the right shapes."""
    gen = torch.Generator().manual_seed(seed)
    exact, fast = _kernel_case_dtypes()
    specs = [(1, 2, 32, 32, 16, False, None, exact, None), (1, 1, 45, 45, 32, True, None, exact, None),
             (2, 2, 50, 29, 16, True, 0.2, exact, "bnhd"), (1, 2, 23, 40, 16, False, None, exact, "hbnd"),
             (1, 1, 37, 37, 16, True, None, fast, None)]
    cases = []
    for batch, heads, n_q, n_k, d, causal, scale, dtype, layout in specs:
        scale = default_scale(d) if scale is None else scale
        q, k, v, _, _, do = _attention_problem(gen, batch, heads, n_q, n_k, d, dtype, causal,
                                               scale, _rt.device)
        if layout:  # q, k, v as strided views (heads interleaved, or a column stride of 2)
            q, k, v = (_place(x, lay, 0.0)[0] for x, lay in zip((q, k, v), (layout, "bhnd2", "nbhd")))
        label = (f"{'causal' if causal else 'non-causal'}, (B, H)=({batch}, {heads}), "
                 f"N_q={n_q}, N_k={n_k}, d={d}, scale={scale:.3g}, "
                 f"{str(dtype).replace('torch.', '')}" + (", non-contiguous q, k, v" if layout else ""))
        cases.append(Case((q, k, v, do), {"causal": causal, "scale": scale}, label=label))
    return cases


def _saved_tensor_gradients(q, k, v, o, lse, do, causal: bool, scale: float):
    """float64 ``(dq, dk, dv)`` as the backward kernels compute them from what forward saved: P
    rebuilt from ``lse``, DELTA = rowsum(dO ∘ ``o``). Given a wrong saved tensor, flag or scale,
    it gives what the kernels give with it.

    Args:
        q: ``(B, H, N_q, d)``; k, v: ``(B, H, N_k, d)``; o, do: like q; lse: ``(B, H, N_q)``.
        causal, scale: as the kernels are launched with them (top-left causal alignment).
    """
    q, k, v, o, lse, do = (x.detach().double() for x in (q, k, v, o, lse, do))
    s = scale * (q @ k.transpose(-1, -2))  # (B, H, N_q, N_k)
    if causal:
        visible = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
        s = s.masked_fill(~visible, float("-inf"))
    p = torch.exp(s - lse[..., None])
    ds = p * (do @ v.transpose(-1, -2) - (do * o).sum(-1, keepdim=True))
    return scale * (ds @ k), scale * (ds.transpose(-1, -2) @ q), p.transpose(-1, -2) @ do


def _function_mistake(name):
    """A FlashAttention Function's ``(o, dq, dk, dv)`` with one classic glue mistake around right
    kernels. On a GPU the answer-key kernels run with the mistake (fast there, and a mistake's
    huge P rounds to fp16/bf16 as only those kernels round it); in the interpreter the same is
    computed in float64 from what the glue hands the kernels (:func:`_saved_tensor_gradients`:
    interpreted launches would cost tenths of a second per model and case)."""
    class Wrong(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, causal, scale):
            o, lse = forward_kernel.attention_forward(q, k, v, causal, scale)
            ctx.save_for_backward(q, k, v, _saved_o(o), lse)
            ctx.causal, ctx.scale = causal, scale
            return o

        @staticmethod
        def backward(ctx, do):
            q, k, v, o, lse = ctx.saved_tensors
            keys, values, causal, scale = _launch_args(q, k, v, ctx.causal, ctx.scale)
            dq, dk, dv = launch_backward(backward.dkdv_kernel, backward.dq_kernel, q, keys, values, o, lse,
                                         do, causal, scale)
            return (dk, dq, dv, None, None) if name == "swapped" else (dq, dk, dv, None, None)

    Wrong.__name__ = f"FlashAttention_{name}"

    def _saved_o(o):  # (B, N, H, d) data reshaped, not transposed, back to (B, H, N, d): a classic slip
        return o.transpose(1, 2).reshape(o.shape) if name == "saved_o_reshaped" else o

    def _launch_args(q, k, v, causal, scale):
        """k, v, causal and scale as the glue hands them to launch_backward, with the mistake."""
        keys, values = (v, k) if name == "kv_swapped" else (k, v)  # the launch's k and v exchanged
        return (keys, values, False if name == "causal_not_passed" else causal,
                default_scale(q.shape[-1]) if name == "default_scale" else scale)

    def wrong(q, k, v, do, causal, scale):
        if q.is_cuda:
            try:
                return run_function(Wrong, q, k, v, do, causal, scale)
            except _Diagnosed:
                return None
        o, lse = naive_attention_torch(q.double(), k.double(), v.double(), causal, scale)
        keys, values, bwd_causal, bwd_scale = _launch_args(q, k, v, causal, scale)
        dq, dk, dv = _saved_tensor_gradients(q, keys, values, _saved_o(o), lse, do, bwd_causal, bwd_scale)
        if name == "swapped":  # return dk, dq, dv, None, None
            if dq.shape != dk.shape:
                raise ValueError("autograd refuses a gradient whose shape is not its input's")
            dq, dk = dk, dq
        return tuple(x.to(q.dtype) for x in (o, dq, dk, dv))
    return wrong


FUNCTION_MISTAKES = {
    "backward returns the gradients in the wrong order: return dq, dk, dv, None, None (the "
    "order of forward's inputs q, k, v, causal, scale)": _function_mistake("swapped"),
    "the o saved for backward is not laid out like the forward's (B, H, N_q, d) output (saved "
    "after a transpose and a reshape): save o exactly as attention_forward returned it — "
    "DELTA = rowsum(dO ∘ O) reads it row by row": _function_mistake("saved_o_reshaped"),
    "k and v are exchanged in the call to launch_backward: its arguments are q, k, v, o, lse, "
    "do in that order (the gradients of attention with k and v swapped are wrong even where "
    "their shapes agree)": _function_mistake("kv_swapped"),
    "backward ignores causal: keep it in forward (ctx.causal = causal) and launch the kernels "
    "with it": _function_mistake("causal_not_passed"),
    "backward uses 1/√d instead of the forward's scale: keep it in forward (ctx.scale = scale) "
    "and pass it on": _function_mistake("default_scale"),
}

# The final step of Exercise 7.6: the tiny LM of section 6, trained with the learner's Function
# and with SDPA from the same seed (one layer and three steps: seconds in the interpreter).
FUNCTION_TRAIN = dict(model=dict(seq_len=32, d_model=32, n_heads=2, n_layers=1), steps=3,
                      batch_size=1, seed=7)


def _train_losses(attention):
    from course_lib.integrations import tinylm

    data = tinylm.CharDataset()
    config = tinylm.TinyLMConfig(vocab_size=data.vocab_size, **FUNCTION_TRAIN["model"])
    model = tinylm.TinyLM(config, attention, seed=FUNCTION_TRAIN["seed"]).to(_rt.device)
    return tinylm.train(model, FUNCTION_TRAIN["steps"], seed=FUNCTION_TRAIN["seed"],
                        batch_size=FUNCTION_TRAIN["batch_size"], dataset=data)


def train_losses_with_function(fn_cls) -> list[float]:
    """The tiny LM's losses (:data:`FUNCTION_TRAIN`) with ``fn_cls.apply`` as its causal attention."""
    def attention(q, k, v):  # (B, H, T, d) -> (B, H, T, d), causal, as tinylm expects
        return fn_cls.apply(q, k, v, True, default_scale(q.shape[-1]))

    return [float(x) for x in _train_losses(attention)]


@learner_check
def check_autograd_function(fn_cls):
    """Exercise 7.6: check the learner's ``torch.autograd.Function`` (``apply(q, k, v, causal,
    scale) -> o`` on ``(B, H, N, d)`` tensors): o and the gradients against float64 autograd,
    then a few training steps of the tiny LM against SDPA. Returns the Function to use (the
    library's :class:`course_lib.kernels.api.FlashAttentionFunction` when not done yet)."""
    from course_lib.integrations import tinylm
    from course_lib.kernels.api import FlashAttentionFunction

    exercise = "Exercise 7.6"

    def run(q, k, v, do, causal, scale):  # in the notebook's process when the grader runs it
        return grade_channel.run_with(fn_cls, run_function, q, k, v, do, causal, scale)

    cases = function_cases()
    chosen = _check_gradients(exercise, run, function_reference, cases,
                              fallback=FlashAttentionFunction, mistakes=FUNCTION_MISTAKES,
                              names=("o", "dq", "dk", "dv"), blocks_of=_kernel_blocks,
                              quiet=True)
    if chosen is FlashAttentionFunction:
        return checks.not_done(exercise, chosen)

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            ours = grade_channel.run_with(fn_cls, train_losses_with_function)
    except Exception as exc:  # noqa: BLE001 - one line, not a traceback wall
        raise ExerciseFailed(f"✗ {exercise}: training the tiny LM with your Function failed: "
                             f"{kernel_checks.summarize_kernel_error(exc)}") from None
    theirs = _train_losses(tinylm.sdpa_attention)
    tolerance = tinylm.loss_tolerance(_rt.on_gpu)
    gaps = [abs(a - b) for a, b in zip(ours, theirs)]
    if not max(gaps) <= tolerance:
        step = next(i for i, g in enumerate(gaps) if not g <= tolerance)
        raise ExerciseFailed(f"✗ {exercise}: the gradient checks pass, but training the tiny LM "
                             f"with your Function drifts from SDPA: at step {step} loss "
                             f"{ours[step]:.6f} vs {theirs[step]:.6f} (|Δ| {gaps[step]:.2e} > "
                             f"tolerance {tolerance:g}, tinylm.loss_tolerance)")
    checks.passed(exercise, f"✓ {exercise}: passed ({len(cases)} gradient cases; the tiny LM "
                            f"trains like SDPA for {FUNCTION_TRAIN['steps']} steps, max loss gap "
                            f"{max(gaps):.1e} ≤ {tolerance:g}).")
    return fn_cls


# ----------------------------------------------------------------------------------------------
# Hints and skeletons of Exercises 7.5 and 7.6 (shown by course_lib.teaching.widgets.hints.HintLadder)
# ----------------------------------------------------------------------------------------------

KERNEL_HINTS = [
    "Each kernel is one loop of Exercise 7.4 cut in two: <code>dkdv_kernel</code> owns one K/V "
    "tile (program_id(0) picks it, program_id(1) = b · n_heads + h picks the head) and loops over "
    "Q tiles; <code>dq_kernel</code> owns one Q tile and loops over K/V tiles. No program adds "
    "into another's memory, so no atomics.",
    "Addresses: row r, column c of head (b, h) of Q is Q + b·stride_qb + h·stride_qh + "
    "r·stride_qn + c·stride_qd; build a (rows, HEAD_DIM) tile with rows[:, None] and "
    "offs_d[None, :]. LSE and DELTA are contiguous (B, H, N_q): LSE + bh · n_q + rows.",
    "Ragged ends: load with mask=rows[:, None] < n_q (or cols < n_k) and other=0.0, store with "
    "the same mask. A padded row or column must get p = 0: build visible = (rows < n_q) & "
    "(cols < n_k), and when CAUSAL also cols <= rows; p = tl.where(visible, p, 0.0).",
    "The tile body: p = exp(tl.dot(q, tl.trans(k)) · scale − lse[:, None]); dp = "
    "tl.dot(do, tl.trans(v)); ds = p · (dp − delta[:, None]). dK/dV: dv += tl.dot(tl.trans(p), do), "
    "dk += tl.dot(tl.trans(ds), q). dQ: dq += tl.dot(ds, k). Multiply dk and dq by scale once, "
    "after the loop. Convert before a dot with half inputs: tl.dot(tl.trans(p).to(do.dtype), do).",
    "Causal skipping: in dkdv_kernel start the Q loop at (start_n // BLOCK_M) · BLOCK_M (earlier "
    "queries see none of these keys); in dq_kernel stop the K/V loop at min(n_k, start_m + "
    "BLOCK_M). The tiles in between still need the mask.",
]

KERNEL_SKELETON = '''\
@triton.jit
def dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV, stride_qb, ..., n_heads, n_q, n_k, scale,
                HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    start_n = tl.program_id(0) * BLOCK_N
    bh = tl.program_id(1)
    b, h = bh // n_heads, bh % n_heads
    cols = start_n + tl.arange(0, BLOCK_N)              # this program's keys
    offs_m, offs_d = tl.arange(0, BLOCK_M), tl.arange(0, HEAD_DIM)
    k = tl.load(..., mask=cols[:, None] < n_k, other=0.0)   # (BLOCK_N, HEAD_DIM)
    v = tl.load(...)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    q_lo = 0
    if CAUSAL:
        q_lo = ...
    for start_m in range(q_lo, n_q, BLOCK_M):
        rows = start_m + offs_m
        q, do = ..., ...                                  # (BLOCK_M, HEAD_DIM), masked
        lse, delta = ..., ...                             # (BLOCK_M,), masked
        p = ...                                           # (BLOCK_M, BLOCK_N), 0 where hidden
        dv += ...
        dp = ...
        ds = ...
        dk += ...
    dk = dk * scale
    tl.store(DK + ..., dk.to(DK.dtype.element_ty), mask=cols[:, None] < n_k)
    tl.store(DV + ..., dv.to(DV.dtype.element_ty), mask=cols[:, None] < n_k)

# dq_kernel: the same with the roles swapped — rows = this program's queries, a loop over
# start_n in range(0, kv_end, BLOCK_N), dq += tl.dot(ds.to(k.dtype), k), dq * scale at the end.
'''

FUNCTION_HINTS = [
    "forward(ctx, q, k, v, causal, scale) runs attention_forward(q, k, v, causal, scale), which "
    "returns (o, lse), and returns o alone.",
    "backward(ctx, do) needs q, k, v, o and lse: save the tensors with "
    "ctx.save_for_backward(q, k, v, o, lse); keep the two plain values on ctx "
    "(ctx.causal = causal, ctx.scale = scale).",
    "In backward: q, k, v, o, lse = ctx.saved_tensors; then ch07.launch_backward(dkdv_kernel, "
    "dq_kernel, q, k, v, o, lse, do, ctx.causal, ctx.scale) gives (dq, dk, dv).",
    "backward returns one value per input of forward, in order: dq, dk, dv, None, None.",
]

FUNCTION_SKELETON = '''\
class FlashAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, scale):
        o, lse = ...
        ctx.save_for_backward(...)
        ctx.causal, ctx.scale = ..., ...
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ...
        dq, dk, dv = ch07.launch_backward(dkdv_kernel, dq_kernel, ...)
        return ...
'''

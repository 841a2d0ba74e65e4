"""Checks for chapter 07 (the backward pass).

* Exercise 7.1 — ``compute_d(o, do)``: the preprocessing step ``D = rowsum(dO ∘ O)``,
  ``(..., N_q, d_v)`` → ``(..., N_q)``.
* Exercise 7.2 — ``ds_tile(p, dp, d)``: the softmax backward on one tile,
  ``dS = P ∘ (dP − D)``, with ``D`` broadcast along each row.
* Exercise 7.3 — ``dk_dv_step(q_i, do_i, lse_i, d_i, k_j, v_j, dk_j, dv_j, scale, mask=None)``:
  the body of the dK/dV loop, returning the updated ``(dk_j, dv_j)``.

The answers are the functions of the same names in :mod:`course_lib.tiled_backward`. Every case
is cut from a real attention problem (random q, k, v, dO; ``o`` and ``lse`` from the float64
reference), so ``P`` tiles hold real probabilities and ``D`` is the true row sum — a tile holds
only part of a row, which is what tells "D from this tile's P ∘ dP" apart from the right ``D``.
Tiles are ragged and unequal (BLOCK_M ≠ BLOCK_N, d ≠ d_v) except the first case of 7.2 and 7.3,
which is square on purpose: there a transposition or broadcasting mistake gives a wrong answer
of the right shape, so the check can name it instead of just reporting a shape error.
"""

from __future__ import annotations


import numpy as np

from course_lib import tiled_backward as tb
from course_lib.checks import Case, check_function
from course_lib.reference import default_scale, naive_attention_numpy

__all__ = ["D_MISTAKES", "DS_MISTAKES", "DK_DV_MISTAKES", "d_cases", "ds_cases", "dk_dv_cases",
           "check_compute_d", "check_ds_tile", "check_dk_dv_step"]

_SEED = 707


def _check(exercise, fn, reference, cases, mistakes, writable=()):
    """check_function with the library's version as fallback; returns the learner's own function
    on a pass. ``check_function`` already gives the learner copies of the inputs and names an
    input changed in place, except those listed in ``writable``."""
    chosen = check_function(exercise, fn, reference, cases, fallback=reference, mistakes=mistakes,
                            writable=writable)
    return reference if chosen is reference else fn


# ----------------------------------------------------------------------------------------------
# one real attention problem, cut into tiles
# ----------------------------------------------------------------------------------------------

def _problem(rng, lead, n_q, n_k, d, d_v, causal, dtype=np.float64):
    """Random q, k, v, dO and the forward's o, lse and D = rowsum(dO ∘ O), all in ``dtype``."""
    q = rng.standard_normal(lead + (n_q, d)).astype(dtype)
    k = rng.standard_normal(lead + (n_k, d)).astype(dtype)
    v = rng.standard_normal(lead + (n_k, d_v)).astype(dtype)
    do = rng.standard_normal(lead + (n_q, d_v)).astype(dtype)
    o, lse = naive_attention_numpy(q, k, v, causal)
    o, lse = o.astype(dtype), lse.astype(dtype)
    return dict(q=q, k=k, v=v, do=do, o=o, lse=lse, d=tb.compute_d(o, do), causal=causal)


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
}


def d_cases(seed: int = _SEED) -> list[Case]:
    """(o, do) pairs: 2-D, batched with heads, d_v ≠ 64, one float32."""
    rng = np.random.default_rng(seed)
    specs = [((), 37, 29, 24, False, np.float64), ((2, 3), 45, 31, 16, True, np.float64),
             ((3,), 19, 19, 8, True, np.float32)]
    cases = []
    for lead, n_q, n_k, d_v, causal, dtype in specs:
        p = _problem(rng, lead, n_q, n_k, 16, d_v, causal, dtype)
        cases.append(Case((p["o"], p["do"]), label=f"o, do of shape {lead + (n_q, d_v)}"))
    return cases


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
}


def _ds_args(prob, q_start, block_m, k_start, block_n):
    t = _tile(prob, q_start, block_m, k_start, block_n)
    p = tb.recompute_p(t["q_i"], t["k_j"], t["lse_i"], default_scale(t["q_i"].shape[-1]), t["mask"])
    return p, t["do_i"] @ t["v_j"].T, t["d_i"]


def ds_cases(seed: int = _SEED + 1) -> list[Case]:
    """(p, dp, d) tiles: square first, then BLOCK_M ≠ BLOCK_N, a causal diagonal tile, float32."""
    rng = np.random.default_rng(seed)
    wide = _problem(rng, (), 40, 50, 16, 12, False)
    causal = _problem(rng, (), 45, 45, 8, 8, True)
    single = _problem(rng, (), 30, 35, 16, 16, False, np.float32)
    return [Case(_ds_args(wide, 16, 16, 32, 16), label="16×16 tile"),
            Case(_ds_args(wide, 32, 8, 0, 20), label="8×20 tile"),
            Case(_ds_args(causal, 16, 16, 16, 16), label="causal 16×16 diagonal tile"),
            Case(_ds_args(causal, 40, 16, 32, 16), label="causal ragged 5×13 tile"),
            Case(_ds_args(single, 0, 12, 10, 9), label="12×9 tile, float32")]


def check_ds_tile(fn):
    """Exercise 7.2: check the learner's ``ds_tile(p, dp, d)``; returns the function to use."""
    return _check("Exercise 7.2", fn, tb.ds_tile, ds_cases(), DS_MISTAKES)


# ----------------------------------------------------------------------------------------------
# Exercise 7.3: the body of the dK/dV loop
# ----------------------------------------------------------------------------------------------

def _dk_dv_variant(q_i, do_i, lse_i, d_i, k_j, v_j, dk_j, dv_j, scale, mask=None, *, mistake):
    """:func:`course_lib.tiled_backward.dk_dv_step` with one classic mistake switched on."""
    s = scale * (q_i @ k_j.T)  # (BLOCK_M, BLOCK_N)
    if mask is not None and mistake != "no_mask":
        s = np.where(mask, s, -np.inf)
    if mistake == "tile_softmax":
        p = np.exp(s - s.max(axis=-1, keepdims=True))
        p = p / p.sum(axis=-1, keepdims=True)
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
    dk_new = dk_scale * (ds @ q_i if mistake == "dk_ds_not_dst" else ds.T @ q_i)
    if mistake == "overwrite":
        return dk_new, dv_new
    return dk_j + dk_new, dv_j + dv_new


def _dk_dv_mistake(name):
    def wrong(q_i, do_i, lse_i, d_i, k_j, v_j, dk_j, dv_j, scale, mask=None):
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
    "the sign is wrong in dS: dS = P ∘ (dP − D), not P ∘ (D − dP)": _dk_dv_mistake("ds_sign"),
    "the D term is missing: dS = P ∘ (dP − D), not P ∘ dP": _dk_dv_mistake("no_d"),
    "D was recomputed from this tile's P ∘ dP, which sums only part of each row — use d_i "
    "(rowsum(dO ∘ O), computed once before the loop)": _dk_dv_mistake("d_from_tile"),
    "P was rebuilt with a softmax over this tile alone: the tile holds only part of each row; "
    "use the saved statistics, P = exp(S − lse)": _dk_dv_mistake("tile_softmax"),
    "P = exp(S) without subtracting the saved lse (P = exp(S − lse_i[:, None]))":
        _dk_dv_mistake("no_lse"),
    "the causal mask is not applied when P is rebuilt: hidden keys (mask False) must get P = 0":
        _dk_dv_mistake("no_mask"),
    "the accumulators are overwritten, not added to: return dk_j + …, dv_j + …":
        _dk_dv_mistake("overwrite"),
}


def _dk_dv_args(prob, q_start, block_m, k_start, block_n, rng):
    """Arguments of one loop step, with accumulators that already hold earlier tiles' sums."""
    t = _tile(prob, q_start, block_m, k_start, block_n)
    dtype = prob["q"].dtype
    dk_j = rng.standard_normal(t["k_j"].shape).astype(dtype)  # (BLOCK_N, d)
    dv_j = rng.standard_normal(t["v_j"].shape).astype(dtype)  # (BLOCK_N, d_v)
    scale = default_scale(prob["q"].shape[-1])
    return (t["q_i"], t["do_i"], t["lse_i"], t["d_i"], t["k_j"], t["v_j"], dk_j, dv_j, scale,
            t["mask"])


def dk_dv_cases(seed: int = _SEED + 2) -> list[Case]:
    """Loop steps: a square unmasked tile first, then causal diagonal tiles (square and ragged,
    d ≠ d_v, BLOCK_M ≠ BLOCK_N) and a float32 one."""
    rng = np.random.default_rng(seed)
    plain = _problem(rng, (), 40, 48, 16, 16, False)
    causal = _problem(rng, (), 45, 38, 12, 8, True)
    single = _problem(rng, (), 33, 33, 16, 16, True, np.float32)
    return [Case(_dk_dv_args(plain, 16, 16, 32, 16, rng), label="16×16 tile, no mask"),
            Case(_dk_dv_args(causal, 16, 16, 16, 16, rng), label="causal 16×16 diagonal tile"),
            Case(_dk_dv_args(causal, 26, 13, 21, 7, rng), label="causal 13×7 tile, d=12, d_v=8"),
            Case(_dk_dv_args(causal, 39, 8, 32, 16, rng), label="causal ragged 6×6 last tile"),
            Case(_dk_dv_args(single, 16, 17, 10, 9, rng), label="causal 17×9 tile, float32")]


def check_dk_dv_step(fn):
    """Exercise 7.3: check the learner's ``dk_dv_step(...)``; returns the function to use."""
    return _check("Exercise 7.3", fn, tb.dk_dv_step, dk_dv_cases(), DK_DV_MISTAKES,
                  writable=("dk_j", "dv_j"))  # an in-place `dk_j += ...` is a fine answer

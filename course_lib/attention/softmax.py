"""Softmax three ways — naive, safe (three passes), online (tile by tile) — and state merging.

Chapter 03 teaches this module; chapters 04 (tiled attention) and 07 (backward) build on it.

A softmax over a row ``x`` can be summarised, after seeing any part of it, by a *state*:

* ``m`` — the largest score seen so far (the running max, ``m_i`` in the kernels);
* ``l`` — the sum of ``exp(x_j - m)`` over the scores seen so far (the running sum, ``l_i``);
* optionally ``o`` — the softmax-weighted average of the value vectors seen so far.

The empty state is ``m = -inf, l = 0`` (and ``o = 0``). Two facts make tiling work: a state can
be updated with a new tile of scores (:func:`online_update`), and two states of disjoint parts of
a row can be merged (:func:`merge_states`, :func:`merge_states_with_output`), in any order.
After the whole row, ``p_j = exp(x_j - m) / l`` and ``lse = m + log(l)``.

Stable names (other chapters import them):

* :func:`naive_softmax`, :func:`safe_softmax` — the textbook formula and the max-subtracted one;
* :func:`correction_factor` — ``exp(m_old - m_new)``, the rescale of an old state to a new max;
* :func:`online_update` — ``(m, l), x_tile -> (m_new, l_new)`` (exercise 3.1);
* :func:`merge_states` — ``(m_a, l_a), (m_b, l_b) -> (m, l)``;
* :func:`merge_states_with_output` — ``(m_a, l_a, o_a), (m_b, l_b, o_b) -> (m, l, o)`` (exercise 3.2);
* :func:`online_softmax` — the public ``course_lib.online_softmax(x, block_size)``;
* :func:`trace_online_softmax` — per-tile record of one row (for the notebook and the widget);
* :func:`overflow_threshold` — the logit above which ``exp`` overflows in a dtype.

Policy for a row whose scores are all ``-inf`` (a fully masked row): the weights are **zeros**,
the state stays ``m = -inf, l = 0`` and ``o = 0``. This is what FlashAttention kernels and
:func:`course_lib.attention.reference.naive_attention_numpy` do for a query that sees no key;
``torch.softmax`` returns NaN instead. Individual ``-inf`` entries (masked scores) get weight 0.
``NaN`` or ``+inf`` scores have no meaningful softmax: :func:`online_softmax` and
:func:`safe_softmax` reject them with a ``ValueError``.
"""

from __future__ import annotations

from dataclasses import dataclass
from numbers import Integral

import numpy as np

# The float dtypes the NumPy implementations compute in. Half precision is a GPU story
# (chapter 06); torch half/bfloat16 tensors given to online_softmax are upcast to float32.
FLOAT_DTYPES = (np.float32, np.float64)


# ----------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------

def overflow_threshold(dtype) -> float:
    """The largest ``x`` for which ``exp(x)`` is finite in ``dtype``: ``log(finfo(dtype).max)``.

    About 88.72 for float32, 11.09 for float16 and 709.78 for float64.
    """
    return float(np.log(np.finfo(dtype).max))


def _shift(m):
    """The max to subtract before exponentiating: ``m``, or 0 where ``m = -inf`` (empty state).

    With this shift an all ``-inf`` tile exponentiates to zeros instead of ``exp(-inf + inf) = NaN``.
    """
    return np.where(np.isfinite(m), m, 0)


def _validate_scores(x, name: str = "x") -> np.ndarray:
    """Return ``x`` as a float32/float64 ndarray; raise TypeError/ValueError naming ``name``."""
    if not isinstance(x, np.ndarray):
        raise TypeError(f"{name} must be a NumPy array (or a torch tensor for online_softmax), "
                        f"got {type(x).__name__}")
    if x.dtype.type not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be a float32 or float64 array, got dtype {x.dtype}")
    if x.ndim < 1:
        raise ValueError(f"{name} must have at least one dimension (softmax is over the last "
                         f"axis), got a 0-d array")
    if np.isnan(x).any() or np.isposinf(x).any():
        raise ValueError(f"{name} contains NaN or +inf; softmax is only defined for finite "
                         f"scores and -inf (masked) entries")
    return x


def _normalise(x, m, l):
    """Second pass: ``exp(x - m) / l`` along the last axis, zeros where ``l = 0`` (all -inf)."""
    p = np.exp(x - _shift(m)[..., None])  # (..., N)
    l = l[..., None]
    return np.where(l > 0, p / np.where(l > 0, l, 1), 0).astype(x.dtype, copy=False)


# ----------------------------------------------------------------------------------------------
# whole-row softmax
# ----------------------------------------------------------------------------------------------

def naive_softmax(x: np.ndarray) -> np.ndarray:
    """The textbook formula ``exp(x) / sum(exp(x))`` over the last axis, *without* the max shift.

    For teaching only: it overflows to ``inf``/``NaN`` once a score passes
    :func:`overflow_threshold` (about 89 in float32, 11 in float16). NumPy's overflow warnings
    are silenced so that the notebook shows the result rather than a warning.

    Args:
        x: scores ``(..., N)``, any float dtype.

    Returns:
        ``(..., N)`` in ``x``'s dtype.
    """
    with np.errstate(over="ignore", invalid="ignore"):
        e = np.exp(x)  # (..., N)
        return e / e.sum(axis=-1, keepdims=True)


def safe_softmax(x: np.ndarray) -> np.ndarray:
    """Softmax over the last axis in three passes: max, sum of ``exp(x - max)``, divide.

    Args:
        x: scores ``(..., N)``, float32 or float64; ``-inf`` entries allowed.

    Returns:
        ``(..., N)`` in ``x``'s dtype; a row that is all ``-inf`` gives zeros (see module doc).
    """
    x = _validate_scores(x)
    m = np.max(x, axis=-1, initial=-np.inf)  # pass 1: (...,)
    l = np.exp(x - _shift(m)[..., None]).sum(axis=-1)  # pass 2: (...,)
    return _normalise(x, m, l)  # pass 3: (..., N)


# ----------------------------------------------------------------------------------------------
# online softmax: update and merge of states
# ----------------------------------------------------------------------------------------------

def correction_factor(m_old, m_new):
    """``exp(m_old - m_new)``: multiply a sum (or output) kept relative to ``m_old`` by this to
    make it relative to ``m_new``. Always in ``[0, 1]`` because ``m_new >= m_old``; 0 for an
    empty old state (``m_old = -inf``), also when ``m_new`` is ``-inf`` too."""
    return np.exp(m_old - _shift(m_new))


def online_update(m, l, x_tile):
    """Fold one tile of scores into a running softmax state (the online-softmax recurrence).

    ``m_new = max(m, max(x_tile))``; ``l_new = l * exp(m - m_new) + sum(exp(x_tile - m_new))``.

    Args:
        m: running max ``(...,)``; ``-inf`` for the empty state.
        l: running sum ``(...,)``, relative to ``m``; 0 for the empty state.
        x_tile: the next scores ``(..., B)`` (``B`` may differ from tile to tile).

    Returns:
        ``(m_new, l_new)``, both ``(...,)``.
    """
    m_new = np.maximum(m, np.max(x_tile, axis=-1, initial=-np.inf))  # (...,)
    l_new = l * correction_factor(m, m_new) + np.exp(x_tile - _shift(m_new)[..., None]).sum(axis=-1)
    return m_new, l_new


def merge_states(m_a, l_a, m_b, l_b):
    """Merge the softmax states of two disjoint parts of a row (order does not matter).

    Args:
        m_a, l_a: state of part a, ``(...,)`` each; m_b, l_b: state of part b, ``(...,)``.

    Returns:
        ``(m, l)`` of the union: ``m = max(m_a, m_b)``,
        ``l = l_a exp(m_a - m) + l_b exp(m_b - m)``.
    """
    m = np.maximum(m_a, m_b)
    return m, l_a * correction_factor(m_a, m) + l_b * correction_factor(m_b, m)


def merge_states_with_output(m_a, l_a, o_a, m_b, l_b, o_b):
    """Merge two partial attention results over disjoint sets of keys (any order).

    Each ``o`` is *normalised*: the softmax-weighted average of the values its part has seen
    (``o = sum_j exp(x_j - m) v_j / l``; 0 for an empty part). The merged output re-weights each
    by its share of the merged sum: ``o = (l_a c_a o_a + l_b c_b o_b) / l`` with
    ``c = exp(m_part - m)``. (FlashAttention-2 keeps the *unnormalised* accumulator ``acc = l·o``
    inside its loop and divides once at the end; chapter 04 shows both.)

    Args:
        m_a, l_a: ``(...,)``; o_a: ``(..., d)``; and the same for part b.

    Returns:
        ``(m, l, o)``: ``(...,)``, ``(...,)``, ``(..., d)``; ``o = 0`` where both parts are empty.
    """
    m = np.maximum(m_a, m_b)
    w_a = l_a * correction_factor(m_a, m)  # (...,) part a's share of the merged sum
    w_b = l_b * correction_factor(m_b, m)
    l = w_a + w_b
    safe_l = np.where(l > 0, l, 1)[..., None]
    o = np.where(l[..., None] > 0, (w_a[..., None] * o_a + w_b[..., None] * o_b) / safe_l, 0)
    return m, l, o.astype(np.result_type(o_a, o_b), copy=False)


# ----------------------------------------------------------------------------------------------
# the public function and a per-tile trace
# ----------------------------------------------------------------------------------------------

def _validate_block_size(block_size) -> int:
    if isinstance(block_size, bool) or not isinstance(block_size, Integral):
        raise TypeError(f"block_size must be a positive int, got {type(block_size).__name__} "
                        f"{block_size!r}")
    if block_size <= 0:
        raise ValueError(f"block_size must be a positive int, got {block_size}")
    return int(block_size)


def online_softmax_stats(x: np.ndarray, block_size: int, *, update=online_update):
    """One pass over the last axis in tiles of ``block_size``: the final state ``(m, l)``.

    Args:
        x: scores ``(..., N)``, float32/float64 (validated like :func:`online_softmax`).
        block_size: tile width ``B`` (positive int; the last tile may be shorter).
        update: the per-tile update, :func:`online_update` (chapter 03's checks swap in
            mistaken ones to model wrong answers).

    Returns:
        ``(m, l)``, each ``(...,)`` in ``x``'s dtype. ``log-sum-exp = m + log(l)``.
    """
    x = _validate_scores(x)
    block_size = _validate_block_size(block_size)
    m = np.full(x.shape[:-1], -np.inf, dtype=x.dtype)  # (...,) the empty state
    l = np.zeros(x.shape[:-1], dtype=x.dtype)  # (...,)
    for start in range(0, x.shape[-1], block_size):
        m, l = update(m, l, x[..., start:start + block_size])
    return m, l


def online_softmax(x, block_size: int, *, update=online_update):
    """Softmax of the last axis computed tile by tile (online softmax), then normalised.

    Pass 1 streams over tiles of ``block_size`` scores, keeping only the running max and sum per
    row; pass 2 writes ``exp(x - m) / l``. (In attention the second pass disappears: the output
    accumulator is rescaled as it goes — chapter 04.)

    Args:
        x: scores ``(..., N)``: a float32/float64 NumPy array, or a floating torch tensor
            (converted to NumPy on the CPU; float16/bfloat16 computed in float32; the result
            comes back as a tensor of the input's dtype and device).
        block_size: tile width, a positive int; need not divide ``N``.
        update: the per-tile update, as in :func:`online_softmax_stats`.

    Returns:
        ``(..., N)`` weights, same type and dtype as ``x``. A row of all ``-inf`` gives zeros.

    Raises:
        TypeError: ``x`` is not a float array/tensor, or ``block_size`` is not an int.
        ValueError: ``block_size <= 0``, ``x`` is 0-d, or ``x`` has NaN/+inf.
    """
    block_size = _validate_block_size(block_size)
    torch_like = _torch_dtype_device(x)
    if torch_like is not None:
        return _online_softmax_torch(x, block_size, *torch_like, update=update)
    x = _validate_scores(x)
    m, l = online_softmax_stats(x, block_size, update=update)
    return _normalise(x, m, l)


def _torch_dtype_device(x):
    """``(dtype, device)`` when ``x`` is a torch tensor, else None (torch is imported lazily)."""
    if type(x).__module__.split(".")[0] != "torch":
        return None
    import torch

    if not isinstance(x, torch.Tensor):
        return None
    if not x.is_floating_point():
        raise TypeError(f"x must be a floating-point tensor, got dtype {x.dtype}")
    return x.dtype, x.device


def _online_softmax_torch(x, block_size, dtype, device, update=online_update):
    import torch

    work = torch.float64 if dtype == torch.float64 else torch.float32
    p = online_softmax(x.detach().to("cpu", work).numpy(), block_size, update=update)
    return torch.from_numpy(p).to(device=device, dtype=dtype)


@dataclass(frozen=True)
class TileStep:
    """What one online-softmax step did to one row (see :func:`trace_online_softmax`)."""

    index: int  # which tile, from 0
    start: int  # the tile covers x[start:stop]
    stop: int
    tile_max: float  # max of this tile alone
    m_old: float  # running max before the tile (-inf before the first)
    m_new: float  # running max after it
    correction: float  # exp(m_old - m_new): how much the old sum shrinks (0 for the first tile)
    tile_sum: float  # sum(exp(x_tile - m_new)): what the tile adds
    l_old: float
    l_new: float  # = l_old * correction + tile_sum

    @property
    def max_changed(self) -> bool:
        return self.m_new > self.m_old


def trace_online_softmax(row, block_size: int) -> list[TileStep]:
    """Run online softmax over one row and record every tile's update, in float64.

    Args:
        row: 1-D scores ``(N,)`` (list or array).
        block_size: tile width (positive int).

    Returns:
        One :class:`TileStep` per tile, ``ceil(N / block_size)`` of them.
    """
    block_size = _validate_block_size(block_size)
    x = np.asarray(row, dtype=np.float64)
    if x.ndim != 1:
        raise ValueError(f"row must be 1-D, got shape {x.shape}")
    _validate_scores(x, "row")
    steps = []
    m, l = -np.inf, 0.0
    for index, start in enumerate(range(0, len(x), block_size)):
        tile = x[start:start + block_size]
        m_new, l_new = online_update(np.float64(m), np.float64(l), tile)
        tile_sum = np.exp(tile - _shift(m_new)).sum()
        steps.append(TileStep(index=index, start=start, stop=start + len(tile),
                              tile_max=float(tile.max()), m_old=float(m), m_new=float(m_new),
                              correction=float(correction_factor(m, m_new)),
                              tile_sum=float(tile_sum), l_old=float(l), l_new=float(l_new)))
        m, l = m_new, l_new
    return steps

"""Chapter 10 (masks as tile rules, in Triton): the checks of exercises 10.1–10.3.

* 10.1 (NumPy) ``tile_lists(mask, block_m, block_n)``: from a boolean element mask, the K/V tiles
  each Q tile visits and which of them are partial — the lists a block-sparse kernel iterates.
* 10.2 (Triton) the offset lines of a varlen (packed, ``cu_seqlens``) attention kernel with GQA:
  where a program's sample starts, how long it is, which K/V head it reads.
* 10.3 (Triton, the large one) the block-sparse forward: iterate the tile list with the online
  softmax, apply the element mask only on partial tiles. ``BLOCK_SPARSE_HINTS`` and
  ``BLOCK_SPARSE_SKELETON`` feed the notebook's hint ladder.

Kernel answers run on guarded tensors, each in its own layout (:mod:`course_lib.teaching.kernel_checks`).
The mistake models of 10.2 and 10.3 replay this module's own kernels with one known mistake
switched on (``MISTAKE``), so that a model computes exactly what that mistake computes; the
correct variant is what a learner who skips an exercise goes on with.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch
import triton
import triton.language as tl

from course_lib.teaching import checks, kernel_checks
from course_lib.attention import masks
from course_lib.platform import runtime
from course_lib.teaching.checks import Case, check_function, learner_check
from course_lib.attention.iomodel import num_blocks
from course_lib.teaching.kernel_checks import Layout, LayoutCase, LayoutRun, Out, check_layout_kernel
from course_lib.attention.reference import default_scale

_rt = runtime.ensure_configured()  # interpreter or GPU: decided before the first @triton.jit

from course_lib.kernels.tiles import LN_2, LOG2_E, MASK_VALUE  # noqa: E402

# 16 is the smallest tile tl.dot accepts: the checks' short sequences span several tiles.
CHECK_BLOCK = 16


def _case_dtypes():
    # fp32 dots are exact only in the interpreter (TF32 on a GPU); bf16 is wrong in the interpreter
    return (torch.float32, torch.float16) if _rt.interpreted else (torch.float16, torch.float16)


# ----------------------------------------------------------------------------------------------
# Exercise 10.1: tile_lists(mask, block_m, block_n) -> (kv_num_blocks, kv_indices, kv_partial)


def tile_lists_reference(mask, block_m: int, block_n: int):
    """The K/V tiles each Q tile visits, as a block-sparse kernel reads them.

    Args:
        mask: ``(N_q, N_k)`` boolean, True = visible.
        block_m, block_n: rows of a Q tile and of a K/V tile.

    Returns:
        ``(kv_num_blocks, kv_indices, kv_partial)``: ``(T_r,)`` int64 — how many K/V tiles Q tile
        ``i`` visits; ``(T_r, T_c)`` int64 — their indices, ascending, in the first
        ``kv_num_blocks[i]`` entries of row ``i`` (the rest 0); ``(T_r, T_c)`` bool — whether the
        tile in the same entry is partial (needs the element mask).
    """
    classes = masks.classify_tiles(mask, block_m, block_n)  # (T_r, T_c) SKIP / PARTIAL / FULL
    return _lists_from(classes != masks.SKIP, classes == masks.PARTIAL)


def _lists_from(visited: np.ndarray, partial: np.ndarray):
    """Compact per-row lists from ``(T_r, T_c)`` grids of visited and partial tiles."""
    t_r, t_c = visited.shape
    num = visited.sum(axis=1).astype(np.int64)
    indices = np.zeros((t_r, t_c), dtype=np.int64)
    flags = np.zeros((t_r, t_c), dtype=bool)
    for i in range(t_r):
        cols = np.flatnonzero(visited[i])
        indices[i, :len(cols)] = cols
        flags[i, :len(cols)] = partial[i, cols]
    return num, indices, flags


def canonical_lists(result):
    """``(kv_num_blocks, kv_indices, kv_partial)`` in the form the check compares: int64 / bool
    arrays, each row's listed tiles sorted by index (any order is a right answer), the entries
    past ``kv_num_blocks[i]`` set to -1 / False (any padding is). Anything else is returned as it
    is, for the check to say what is wrong with it."""
    try:
        num, indices, flags = result
        num, indices, flags = (np.asarray(x.cpu() if hasattr(x, "cpu") else x)
                               for x in (num, indices, flags))
        if (num.ndim != 1 or indices.ndim != 2 or flags.shape != indices.shape
                or len(num) != len(indices) or num.dtype.kind not in "iu"
                or indices.dtype.kind not in "iu" or (num < 0).any()
                or (num > indices.shape[1]).any()):
            return result
        out_i = np.full(indices.shape, -1, dtype=np.int64)
        out_f = np.zeros(indices.shape, dtype=bool)
        for i, n in enumerate(num):
            order = np.argsort(indices[i, :n], kind="stable")
            out_i[i, :n] = indices[i, :n][order]
            out_f[i, :n] = flags[i, :n].astype(bool)[order]
        return num.astype(np.int64), out_i, out_f
    except (TypeError, ValueError, AttributeError):
        return result


def _padded_tiles(mask, block_m, block_n, pad_value, *, t_r=None, t_c=None, step_m=None,
                  step_n=None):
    """``(T_r, T_c, BLOCK_M, BLOCK_N)`` views of the mask's tiles, the padding set to pad_value;
    ``step_*`` (default: the block) is where tile ``i`` starts (``i * step``)."""
    n_q, n_k = mask.shape
    t_r = num_blocks(n_q, block_m) if t_r is None else t_r
    t_c = num_blocks(n_k, block_n) if t_c is None else t_c
    step_m, step_n = step_m or block_m, step_n or block_n
    padded = np.full((t_r * step_m + block_m, t_c * step_n + block_n), pad_value)
    padded[:n_q, :n_k] = mask
    out = np.empty((t_r, t_c, block_m, block_n), dtype=bool)
    for i in range(t_r):
        for j in range(t_c):
            out[i, j] = padded[i * step_m:i * step_m + block_m, j * step_n:j * step_n + block_n]
    return out


def _tile_model(*, pad_any=False, pad_all=True, edge=0, floor=False, swap_blocks=False,
                transpose=False, partial="some", visited="any", compact=True, corners=False):
    """A model of tile_lists done one way wrong (the defaults are right).

    pad_all: the padding of a ragged tile counts as visible in the "all visible" test (right) or
    as masked (False: a ragged full tile becomes partial). edge: tiles one row/column too wide
    (``mask[r0:r1 + 1]``). floor: ``N // block`` tiles (the ragged last tile lost). swap_blocks:
    block_m and block_n exchanged. transpose: lists per K/V tile (the mask transposed).
    partial: "some" (right), "any" (every visited tile partial), "none" (no tile partial),
    "full" (the full tiles marked partial: the flag inverted) or "not full" (every tile that is
    not full, a skipped one included). visited: "any" (right), "all" (only full tiles visited)
    or "every" (every tile, the skipped ones included). compact: the listed tiles packed
    at the start of the row (right) or left at their own column. corners: full/skip decided from
    the tile's two corners only.
    """
    def model(mask, block_m, block_n):
        mask = np.asarray(mask)
        if transpose:
            mask = mask.T
        bm, bn = (block_n, block_m) if swap_blocks else (block_m, block_n)
        n_q, n_k = mask.shape
        t_r = n_q // bm if floor else num_blocks(n_q, bm)
        t_c = n_k // bn if floor else num_blocks(n_k, bn)
        vis_any = _padded_tiles(mask, bm + edge, bn + edge, pad_any, t_r=t_r, t_c=t_c,
                                step_m=bm, step_n=bn).any(axis=(2, 3))
        vis_all = _padded_tiles(mask, bm + edge, bn + edge, pad_all, t_r=t_r, t_c=t_c,
                                step_m=bm, step_n=bn).all(axis=(2, 3))
        if corners:
            padded = np.zeros((t_r * bm, t_c * bn), dtype=bool)
            padded[:n_q, :n_k] = mask[:t_r * bm, :t_c * bn]
            rows, cols = np.arange(t_r) * bm, np.arange(t_c) * bn
            first = padded[rows[:, None], cols[None, :]]
            last = padded[np.minimum(rows + bm, n_q)[:, None] - 1,
                          np.minimum(cols + bn, n_k)[None, :] - 1]
            vis_any, vis_all = first | last, first & last
        seen = {"any": vis_any, "all": vis_all, "every": np.ones_like(vis_any)}[visited]
        flags = {"some": vis_any & ~vis_all, "any": vis_any, "none": np.zeros_like(vis_any),
                 "full": vis_all, "not full": ~vis_all}[partial]
        if compact:
            return _lists_from(seen, flags)
        t_c = seen.shape[1]
        return (seen.sum(axis=1).astype(np.int64),
                np.where(seen, np.arange(t_c)[None, :], 0).astype(np.int64), flags & seen)
    return lambda mask, block_m, block_n: canonical_lists(model(mask, block_m, block_n))


TILE_LIST_MISTAKES = {
    "the padding of a ragged last tile counts as masked, so a ragged tile is never full: only "
    "real entries count — pad with True for the 'all visible' test (or slice the tile to the "
    "mask's edge, mask[r0:min(r0 + block_m, N_q), ...])": _tile_model(pad_all=False),
    "each tile is one row and one column too wide (mask[r0:r1 + 1, c0:c1 + 1] with r1 = r0 + "
    "block_m): tile i covers rows i·block_m … (i+1)·block_m − 1, so slice "
    "mask[i * block_m:(i + 1) * block_m]": _tile_model(edge=1),
    "the tile counts are N // block, so the ragged last tile is lost: use "
    "T_r = ceil(N_q / block_m) (-(-N_q // block_m)), the same for T_c": _tile_model(floor=True),
    "block_m and block_n are swapped: Q tiles have block_m rows (of the mask's rows), K/V tiles "
    "block_n keys (of its columns)": _tile_model(swap_blocks=True),
    "the lists are built per K/V tile (the mask transposed): the kernel's program owns a Q tile, "
    "so row i of the lists is Q tile i and its entries are K/V tiles": _tile_model(transpose=True),
    "every visited tile is marked partial: a tile is partial only when some but not all of its "
    "entries are visible — full tiles skip the element mask, that is the saving":
        _tile_model(partial="any"),
    "no tile is marked partial: a tile with some masked entries needs the element mask, or its "
    "masked scores count": _tile_model(partial="none"),
    "the partial flag is inverted: the full tiles are marked partial and the partial ones full "
    "— a tile is partial when some but not all of its entries are visible (tile.any() and not "
    "tile.all())": _tile_model(partial="full"),
    "every tile is listed, the skipped ones too (the tile.any() test is missing): a tile with no "
    "visible entry is skipped — list only tiles with tile.any()":
        _tile_model(visited="every", partial="not full"),
    "only full tiles are visited: a partial tile has visible entries too — visit every tile with "
    "any visible entry (and mark it partial)": _tile_model(visited="all"),
    "the listed tiles stay at their own column (kv_indices[i, j] = j): the kernel reads the "
    "first kv_num_blocks[i] entries, so pack the visited tiles at the start of the row":
        _tile_model(compact=False),
    "the classes come from the tile's two corners only: a tile whose corners are visible can "
    "still hide entries in between (a causal diagonal tile, a document boundary) — test every "
    "entry (.any() and .all() over the tile)": _tile_model(corners=True),
}


def _document_mask(lengths, causal=False) -> np.ndarray:
    """``(N, N)``: token i sees token j when both are in the same document (and j ≤ i if causal)."""
    doc = np.repeat(np.arange(len(lengths)), lengths)
    mask = doc[:, None] == doc[None, :]
    if causal:
        mask &= np.tril(np.ones_like(mask))
    return mask


def _tile_list_cases() -> list[Case]:
    rng = np.random.default_rng(10_1)
    layout = np.zeros((4, 3), dtype=bool)
    layout[[0, 1, 2, 3, 3], [0, 1, 0, 2, 0]] = True
    random = rng.random((20, 30)) < 0.15
    return [
        Case((np.tril(np.ones((37, 37), dtype=bool)), 16, 8),
             label="causal, N_q = N_k = 37, block_m=16, block_n=8 (ragged last tiles)"),
        Case((masks.sliding_window_mask(40, 40, 10), 8, 8),
             label="sliding window W=10, N = 40, 8×8 tiles (no ragged tile)"),
        Case((_document_mask([12, 18, 15]), 16, 16),
             label="documents of 12, 18 and 15 tokens (N = 45), 16×16 tiles"),
        Case((masks.block_sparse_mask(layout, 50, 35, 16, 16), 16, 16),
             label="a block-sparse layout (4×3 tiles of 16), N_q=50, N_k=35 (ragged)"),
        Case((np.ones((33, 17), dtype=bool), 8, 16),
             label="no mask, N_q=33, N_k=17, block_m=8, block_n=16 (ragged full tiles)"),
        Case((random, 8, 8), label="random, 15% visible, N_q=20, N_k=30, 8×8 tiles"),
        Case((_document_mask([5, 20, 9], causal=True), 8, 16),
             label="causal documents of 5, 20 and 9 tokens (N = 34), block_m=8, block_n=16"),
    ]


@learner_check
def check_tile_lists(fn):
    """Check exercise 10.1, ``tile_lists(mask, block_m, block_n) -> (kv_num_blocks, kv_indices,
    kv_partial)`` (see :func:`tile_lists_reference`; the listed tiles may come in any order and
    the padding past ``kv_num_blocks[i]`` may hold anything); return the function to go on with."""
    def canonical(mask, block_m, block_n):
        return canonical_lists(fn(mask, block_m, block_n))

    def reference(mask, block_m, block_n):
        return canonical_lists(tile_lists_reference(mask, block_m, block_n))

    result = check_function("Exercise 10.1", canonical, reference, _tile_list_cases(),
                            fallback=tile_lists_reference, mistakes=TILE_LIST_MISTAKES,
                            tolerance=(0.0, 0.0),
                            output_names=("kv_num_blocks", "kv_indices", "kv_partial"))
    return fn if result is canonical else result


# ----------------------------------------------------------------------------------------------
# Guarded runs with integer inputs (cu_seqlens, tile lists, masks)

# An integer input's margin holds this: read as a row, a tile index or a length, it sends the
# kernel far outside every tensor, where the memory guard (interpreter) stops it.
INT_MARGIN_FILL = -(2 ** 20)


def _fill_for(x: torch.Tensor, fill: float):
    if x.dtype.is_floating_point:
        return fill
    return 0 if (x.dtype in (torch.int8, torch.uint8, torch.bool)
                 or fill == kernel_checks.INPUT_MARGIN_REFILL) else INT_MARGIN_FILL


class IntLayoutRun(LayoutRun):
    """:class:`~course_lib.teaching.kernel_checks.LayoutRun` whose inputs may be integer tensors: their
    margins hold :data:`INT_MARGIN_FILL` (int8: 0) instead of NaN."""

    def launch_guarded(self, inputs, layouts, fill, params, trace=False):
        import contextlib

        layouts = tuple(layouts or ()) + (None,) * (len(inputs) + len(self.outputs))
        placed = [kernel_checks.place(x, lay, _fill_for(x, fill)) for x, lay in zip(inputs, layouts)]
        pristine = [buffer.clone() for _, buffer in placed]
        outs = []
        for spec, lay in zip(self.outputs, layouts[len(inputs):]):
            shape, dtype = spec.shape_dtype(*inputs, **params)
            view, buffer = kernel_checks.place(torch.empty(shape, dtype=dtype, device=inputs[0].device),
                                               lay, kernel_checks.OUTPUT_SENTINEL)
            view.fill_(kernel_checks.OUTPUT_SENTINEL)
            outs.append((view, buffer))
        errstate = (np.errstate(over="raise", divide="raise", invalid="raise", under="ignore")
                    if trace else contextlib.nullcontext())
        with warnings.catch_warnings(), errstate, kernel_checks.memory_guard() as guard:
            warnings.simplefilter("ignore", RuntimeWarning)
            for name, (view, _) in zip(self.names, placed):
                guard.allow(name, view)
            for spec, (view, _) in zip(self.outputs, outs):
                guard.allow(spec.name, view, write=True)
            try:
                self.launch(*(v for v, _ in placed), *(v for v, _ in outs), **params)
            except Exception as exc:  # noqa: BLE001 - the guard's diagnosis, with a hint
                violation = next((e for e in kernel_checks.exception_chain(exc)
                                  if isinstance(e, kernel_checks.MemoryViolation)), None)
                if violation is None:
                    raise
                hint = self.guard_hint and self.guard_hint(
                    kernel_checks.guard_evidence(str(violation)), {**params, "inputs": inputs})
                raise violation.extended(hint) from None
        if inputs[0].device.type == "cuda":
            torch.cuda.synchronize()
        for name, (_, buffer), before in zip(self.names, placed, pristine):
            if not checks.same_value(before, buffer):
                raise kernel_checks.KernelProblem(
                    f"your kernel wrote into its input `{name}` — inputs are read-only: tl.store "
                    f"only to the output pointer(s) (two pointer arguments swapped?)")
        return outs


def _replay(launch, names, outputs):
    """A mistake model: ``launch`` (this module's kernel with a mistake switched on) on plain
    copies of the inputs (dense, row-major), under the memory guard in the interpreter; raises
    (no evidence) when the mistake reads outside the tensors."""
    def model(*inputs, layouts=None, **params):
        inputs = tuple(x.contiguous() for x in inputs)
        outs = []
        for spec in outputs:
            shape, dtype = spec.shape_dtype(*inputs, **params)
            outs.append(torch.zeros(shape, dtype=dtype, device=inputs[0].device))
        with warnings.catch_warnings(), kernel_checks.memory_guard() as guard:
            warnings.simplefilter("ignore", RuntimeWarning)
            for name, x in zip(names, inputs):
                guard.allow(name, x)
            for spec, x in zip(outputs, outs):
                guard.allow(spec.name, x, write=True)
            kernel_checks._quietly(launch, *inputs, *outs, **params)
        return outs[0] if len(outs) == 1 else tuple(outs)
    return model


class _Switched:
    """``kernel[grid](...)`` of a model kernel with its MISTAKE switch set."""

    def __init__(self, kernel, mistake: int):
        self.kernel, self.mistake = kernel, mistake

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            return self.kernel[grid](*args, **kwargs, MISTAKE=self.mistake)
        return launch


# ----------------------------------------------------------------------------------------------
# Exercise 10.2: the offsets of a varlen (packed) attention kernel with GQA

(V_RIGHT, V_NO_START_KV, V_KV_MODULO, V_KV_DIVIDE, V_NO_HEAD_KV, V_KEYS_OF_BATCH) = range(6)


@triton.jit
def _varlen_model_kernel(Q, K, V, O, CU_SEQLENS,
                         stride_qt, stride_qh, stride_qd, stride_kt, stride_kh, stride_kd,
                         stride_vt, stride_vh, stride_vd, stride_ot, stride_oh, stride_od,
                         n_heads, n_kv_heads, qk_scale_log2,
                         HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         MISTAKE: tl.constexpr):
    """Varlen attention with GQA: program (Q tile, head, sample) of a packed batch (total, H, d);
    the model kernel of exercise 10.2 (MISTAKE = 0 is right)."""
    tile, h, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start = tl.load(CU_SEQLENS + b)
    seq_len = tl.load(CU_SEQLENS + b + 1) - start
    kv_h = h // (n_heads // n_kv_heads)
    if MISTAKE == 2:  # V_KV_MODULO
        kv_h = h % n_kv_heads
    if MISTAKE == 3:  # V_KV_DIVIDE
        kv_h = h // n_kv_heads
    if MISTAKE == 4:  # V_NO_HEAD_KV
        kv_h = 0
    kv_start = start
    if MISTAKE == 1:  # V_NO_START_KV
        kv_start = 0
    kv_len = seq_len
    if MISTAKE == 5:  # V_KEYS_OF_BATCH: keys of every sample
        kv_start = 0
        kv_len = tl.load(CU_SEQLENS + tl.num_programs(2))
    q_base = Q + start * stride_qt + h * stride_qh
    k_base = K + kv_start * stride_kt + kv_h * stride_kh
    v_base = V + kv_start * stride_vt + kv_h * stride_vh
    o_base = O + start * stride_ot + h * stride_oh
    start_m = tile * BLOCK_M
    if start_m < seq_len:  # a program past its sample's end does nothing
        offs_m = start_m + tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, HEAD_DIM)
        q = tl.load(q_base + offs_m[:, None] * stride_qt + offs_d[None, :] * stride_qd,
                    mask=offs_m[:, None] < seq_len, other=0.0)
        m_i = tl.full((BLOCK_M,), MASK_VALUE, tl.float32)
        l_i = tl.zeros((BLOCK_M,), tl.float32)
        acc = tl.zeros((BLOCK_M, HEAD_DIM), tl.float32)
        for start_n in range(0, kv_len, BLOCK_N):
            keys = start_n + offs_n
            k = tl.load(k_base + keys[:, None] * stride_kt + offs_d[None, :] * stride_kd,
                        mask=keys[:, None] < kv_len, other=0.0)
            v = tl.load(v_base + keys[:, None] * stride_vt + offs_d[None, :] * stride_vd,
                        mask=keys[:, None] < kv_len, other=0.0)
            s = tl.dot(q, tl.trans(k)) * qk_scale_log2
            s = tl.where(keys[None, :] < kv_len, s, MASK_VALUE)
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            p = tl.math.exp2(s - m_new[:, None])
            alpha = tl.math.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        o = acc / l_i[:, None]
        tl.store(o_base + offs_m[:, None] * stride_ot + offs_d[None, :] * stride_od,
                 o.to(O.dtype.element_ty), mask=offs_m[:, None] < seq_len)


VARLEN_KERNEL = _Switched(_varlen_model_kernel, V_RIGHT)  # the right kernel, as a fallback


def launch_varlen(kernel, q, k, v, o, cu_seqlens, max_seqlen: int, scale: float | None = None,
                  block_m: int = CHECK_BLOCK, block_n: int = CHECK_BLOCK) -> None:
    """Launch a varlen kernel (the signature of exercise 10.2) on a packed batch.

    Args:
        q, o: ``(total, H, d)``; k, v: ``(total, H_kv, d)``; any strides; ``d`` a power of two.
        cu_seqlens: ``(B + 1,)`` int32, ``cu_seqlens[b]`` the first row of sample ``b``,
            ``cu_seqlens[B] = total``. max_seqlen: the longest sample (sizes the grid).
        scale: the score scale (default ``1/sqrt(d)``). block_m, block_n: tile rows.
    """
    batch, heads, d = len(cu_seqlens) - 1, q.shape[1], q.shape[2]
    scale = default_scale(d) if scale is None else scale
    grid = (triton.cdiv(max_seqlen, block_m), heads, batch)
    kernel[grid](q, k, v, o, cu_seqlens, *q.stride(), *k.stride(), *v.stride(), *o.stride(),
                 heads, k.shape[1], scale * LOG2_E.value, HEAD_DIM=d, BLOCK_M=block_m,
                 BLOCK_N=block_n)


def varlen_reference(q, k, v, cu_seqlens, scale=None, **_):
    """float64 attention within each sample of the packed batch, GQA by index map; o in q's
    dtype, ``(total, H, d)``."""
    heads, n_kv_heads, d = q.shape[1], k.shape[1], q.shape[2]
    scale = default_scale(d) if scale is None else scale
    kv_of = torch.arange(heads) // (heads // n_kv_heads)
    out = torch.zeros(q.shape, dtype=torch.float64)
    cu = [int(c) for c in cu_seqlens.cpu()]
    for start, end in zip(cu[:-1], cu[1:]):
        qs = q[start:end].double().cpu().transpose(0, 1)  # (H, n, d)
        ks = k[start:end].double().cpu()[:, kv_of].transpose(0, 1)
        vs = v[start:end].double().cpu()[:, kv_of].transpose(0, 1)
        p = torch.softmax(scale * qs @ ks.transpose(-1, -2), dim=-1)
        out[start:end] = (p @ vs).transpose(0, 1)
    return out.to(device=q.device, dtype=q.dtype)


def _varlen_params(q, k, v, cu_seqlens, **_):
    return tuple(q.shape), q.dtype


VARLEN_NAMES = ("q", "k", "v", "cu_seqlens")


def _varlen_guard_hint(e: dict | None, params: dict) -> str | None:
    if not e:
        return None
    if e["tensor"] == "cu_seqlens":
        return ("hint: cu_seqlens has B + 1 entries; sample b's rows are cu_seqlens[b] up to "
                "cu_seqlens[b + 1] (excluded): load exactly those two")
    if e["tensor"] in ("q", "k", "v", "o") and e["index"] and e["index"][0] >= e["shape"][0]:
        return _varlen_row_hint(e, params)
    if e["tensor"] in ("k", "v") and len(e["index"]) > 1 and e["index"][1] >= e["shape"][1]:
        return (f"hint: K/V head {e['index'][1]} does not exist (H_kv = {e['shape'][1]}): query "
                f"head h reads K/V head h // (n_heads // n_kv_heads)")
    return None


def _varlen_row_hint(e: dict, params: dict) -> str:
    """What a row past the end of the packed batch says, from the program that read it: which
    of two slips its row fits — the sample's end used as its length (rows start + offs_m with
    offs_m < cu_seqlens[b + 1]), or a base offset that already includes the tile's rows (rows
    start + start_m + offs_m) — or, when neither or both fit, only the rows involved."""
    total, row = e["shape"][0], e["index"][0]
    head = (f"hint: row {row} is past the end of the packed batch ({total} rows)")
    inputs, program = params.get("inputs") or (), e.get("program") or ()
    if len(inputs) < 4 or len(program) < 3:
        return head
    tile, b = program[0], program[2]
    cu = [int(c) for c in inputs[3].cpu()]
    if b + 1 >= len(cu):
        return head
    start, end = cu[b], cu[b + 1]
    seq_len, start_m = end - start, tile * CHECK_BLOCK
    where = (f"; program (tile={tile}, h={program[1]}, b={b}) owns rows {start + start_m}… of "
             f"sample {b}, whose rows are {start}…{end - 1} (cu_seqlens[{b}] = {start}, "
             f"cu_seqlens[{b + 1}] = {end})")
    fits = []
    offset = row - start  # the offs_m (or key) the row was read at, with a right base
    in_tile = start_m <= offset < start_m + CHECK_BLOCK if e["tensor"] in ("q", "o") else True
    if in_tile and seq_len <= offset < end:
        fits.append(f"seq_len is the sample's end, not its length: seq_len = cu_seqlens[b + 1] − "
                    f"cu_seqlens[b] = {seq_len}, while a bound of {end} lets its rows run to "
                    f"{start + end - 1}")
    if e["tensor"] in ("q", "o"):
        doubled = row - start - start_m  # the offs_m, if the base already holds start_m rows
        if start_m and start_m <= doubled < min(start_m + CHECK_BLOCK, seq_len):
            fits.append(f"the base offset already includes the tile's rows (start + start_m) and "
                        f"offs_m = start_m + arange adds them again: add start_m once")
    if len(fits) == 1:
        return head + where + ". It fits one slip: " + fits[0]
    return head + where


def _varlen_row_of(index, cu_seqlens=None, **_) -> str:
    return f"row {index[0]} of the packed batch, head {index[1]}"


def varlen_runner(kernel) -> IntLayoutRun:
    """A guarded run of a 10.2 kernel: ``run(q, k, v, cu_seqlens, max_seqlen=, scale=,
    layouts=)``."""
    return IntLayoutRun(
        launch=lambda q, k, v, cu, o, max_seqlen, scale=None: launch_varlen(
            kernel, q, k, v, o, cu, max_seqlen, scale),
        names=VARLEN_NAMES,
        outputs=(Out("o", _varlen_params, _varlen_row_of),),
        guard_hint=_varlen_guard_hint)


def _varlen_mistake(mistake: int):
    kernel = _Switched(_varlen_model_kernel, mistake)
    return _replay(lambda q, k, v, cu, o, max_seqlen, scale=None: launch_varlen(
        kernel, q, k, v, o, cu, max_seqlen, scale), VARLEN_NAMES, (Out("o", _varlen_params),))


VARLEN_MISTAKES = {
    "K and V are read from the start of the packed batch: their rows need the sample's offset "
    "too, K + start * stride_kt (and V + start * stride_vt)": _varlen_mistake(V_NO_START_KV),
    "the K/V head is h % n_kv_heads, which interleaves the groups: GQA groups consecutive query "
    "heads, so query head h reads K/V head h // (n_heads // n_kv_heads)":
        _varlen_mistake(V_KV_MODULO),
    "the K/V head is h // n_kv_heads: divide by the group size, h // (n_heads // n_kv_heads)":
        _varlen_mistake(V_KV_DIVIDE),
    "K and V have no head offset: every query head reads K/V head 0 — add kv_h * stride_kh "
    "(and kv_h * stride_vh)": _varlen_mistake(V_NO_HEAD_KV),
    "the keys run over the whole packed batch: a query attends only to its own sample, so the "
    "K/V rows start at cu_seqlens[b] and stop at cu_seqlens[b + 1]":
        _varlen_mistake(V_KEYS_OF_BATCH),
}

# Layouts of the packed (total, H, d) tensors: gaps after each row and head, heads outermost,
# columns strided — a different one per tensor, so that no two share a stride.
PACKED_GAPS = Layout((0, 1, 2), (CHECK_BLOCK, 1, 3))
HEADS_OUTER = Layout((1, 0, 2), (1, CHECK_BLOCK, 5))
COLUMNS_STRIDED = Layout((0, 2, 1), (CHECK_BLOCK, 2, 1))
CU_LAYOUT = Layout((0,), (4,))


def _varlen_cases(device) -> list[Case]:
    gen = torch.Generator().manual_seed(10_2)
    # (lengths, H, H_kv, d, dtype index, scale, layouts of q, k, v)
    # 1. groups of 2 (H=6, H_kv=3: h // H_kv and h % H_kv stay in range but read the wrong
    #    head); 2. MHA, a sample longer than two tiles; 3. MQA, float16, d=32
    specs = [((13, 5, 20), 6, 3, 16, 0, None, (PACKED_GAPS, HEADS_OUTER, COLUMNS_STRIDED)),
             ((9, 35, 16), 2, 2, 16, 0, 0.3, (HEADS_OUTER, COLUMNS_STRIDED, PACKED_GAPS)),
             ((20, 5), 2, 1, 32, 1, None, (COLUMNS_STRIDED, PACKED_GAPS, HEADS_OUTER))]
    cases = []
    for lengths, heads, kv_heads, d, i, scale, layouts in specs:
        total = sum(lengths)
        dtype = _case_dtypes()[i]
        q = torch.randn(total, heads, d, generator=gen)
        k, v = (torch.randn(total, kv_heads, d, generator=gen) for _ in range(2))
        cu = torch.tensor([0, *np.cumsum(lengths)], dtype=torch.int32)
        label = (f"samples of {', '.join(map(str, lengths))} rows packed (total={total}), "
                 f"cu_seqlens={cu.tolist()}, H={heads}, H_kv={kv_heads}, d={d}, "
                 f"{str(dtype).replace('torch.', '')}, scale={'1/√d' if scale is None else scale}"
                 f"; output o indexed [row, head, col]")
        cases.append(LayoutCase(tuple(x.to(device=device, dtype=dtype) for x in (q, k, v))
                                + (cu.to(device),),
                                {"max_seqlen": max(lengths), "scale": scale,
                                 "layouts": (*layouts, CU_LAYOUT)}, label=label))
    return cases


@learner_check
def check_varlen_kernel(kernel):
    """Check exercise 10.2 (a kernel with the signature of the notebook's
    ``varlen_attention_kernel``); return the learner's kernel or, not done yet, the library's."""
    return check_layout_kernel("Exercise 10.2", kernel, varlen_runner(kernel), varlen_reference,
                               _varlen_cases(_rt.device), fallback=VARLEN_KERNEL,
                               mistakes=VARLEN_MISTAKES, names=VARLEN_NAMES + ("o",))


# ----------------------------------------------------------------------------------------------
# Exercise 10.3: the block-sparse forward — iterate the tile list, mask only partial tiles

(B_RIGHT, B_PARTIAL_UNMASKED, B_TILE_POSITION, B_INDEX_ROW0, B_NUM_ROW0, B_PARTIAL_BY_TILE,
 B_NO_RESCALE, B_RAGGED_UNMASKED, B_NAN_EMPTY_ROW, B_LSE_LOG2, B_NO_SCALE, B_MASK_ZERO,
 B_NO_DIVISION) = range(13)


@triton.jit
def _block_sparse_model_kernel(Q, K, V, O, LSE, KV_NUM_BLOCKS, KV_INDICES, KV_PARTIAL, MASK,
                               stride_qh, stride_qn, stride_qd, stride_kh, stride_kn, stride_kd,
                               stride_vh, stride_vn, stride_vd, stride_oh, stride_on, stride_od,
                               stride_lh, stride_ln, stride_ir, stride_ic, stride_pr, stride_pc,
                               stride_mq, stride_mk, n_q, n_k, qk_scale_log2,
                               HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                               BLOCK_N: tl.constexpr, MISTAKE: tl.constexpr):
    """Block-sparse attention forward, program (Q tile, head): the model kernel of exercise 10.3
    (MISTAKE = 0 is right)."""
    pid_m, h = tl.program_id(0), tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    rows = offs_m < n_q
    q = tl.load(Q + h * stride_qh + offs_m[:, None] * stride_qn + offs_d[None, :] * stride_qd,
                mask=rows[:, None], other=0.0)
    m_i = tl.full((BLOCK_M,), MASK_VALUE, tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, HEAD_DIM), tl.float32)
    scale = qk_scale_log2
    if MISTAKE == 10:  # B_NO_SCALE
        scale = LOG2_E
    list_row = pid_m
    if MISTAKE == 3:  # B_INDEX_ROW0: every Q tile reads row 0 of the lists
        list_row = 0
    num_row = pid_m
    if MISTAKE == 4:  # B_NUM_ROW0
        num_row = 0
    num = tl.load(KV_NUM_BLOCKS + num_row)
    for t in range(0, num):
        kv_tile = tl.load(KV_INDICES + list_row * stride_ir + t * stride_ic)
        flag_col = t
        if MISTAKE == 5:  # B_PARTIAL_BY_TILE
            flag_col = kv_tile
        partial = tl.load(KV_PARTIAL + list_row * stride_pr + flag_col * stride_pc)
        start_n = kv_tile * BLOCK_N
        if MISTAKE == 2:  # B_TILE_POSITION
            start_n = t * BLOCK_N
        keys = start_n + offs_n
        k = tl.load(K + h * stride_kh + keys[:, None] * stride_kn + offs_d[None, :] * stride_kd,
                    mask=keys[:, None] < n_k, other=0.0)
        v = tl.load(V + h * stride_vh + keys[:, None] * stride_vn + offs_d[None, :] * stride_vd,
                    mask=keys[:, None] < n_k, other=0.0)
        s = tl.dot(q, tl.trans(k)) * scale
        if MISTAKE != 7:  # B_RAGGED_UNMASKED
            s = tl.where(keys[None, :] < n_k, s, MASK_VALUE)
        if MISTAKE != 1:  # B_PARTIAL_UNMASKED
            if partial != 0:
                visible = tl.load(MASK + offs_m[:, None] * stride_mq + keys[None, :] * stride_mk,
                                  mask=rows[:, None] & (keys[None, :] < n_k), other=0)
                if MISTAKE == 11:  # B_MASK_ZERO
                    s = tl.where(visible != 0, s, 0.0)
                else:
                    s = tl.where(visible != 0, s, MASK_VALUE)
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == MASK_VALUE, 0.0, m_new)  # a row with nothing visible yet
        if MISTAKE == 8:  # B_NAN_EMPTY_ROW
            m_safe = m_new
        p = tl.math.exp2(s - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if MISTAKE != 6:  # B_NO_RESCALE
            acc = acc * alpha[:, None]
        acc = acc + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    o = acc / l_i[:, None]
    if MISTAKE == 12:  # B_NO_DIVISION
        o = acc
    lse = (m_i + tl.math.log2(l_i)) * LN_2
    if MISTAKE == 9:  # B_LSE_LOG2
        lse = m_i + tl.math.log2(l_i)
    tl.store(O + h * stride_oh + offs_m[:, None] * stride_on + offs_d[None, :] * stride_od,
             o.to(O.dtype.element_ty), mask=rows[:, None])
    tl.store(LSE + h * stride_lh + offs_m * stride_ln, lse, mask=rows)


BLOCK_SPARSE_KERNEL = _Switched(_block_sparse_model_kernel, B_RIGHT)  # the right kernel


def launch_block_sparse(kernel, q, k, v, o, lse, kv_num_blocks, kv_indices, kv_partial, mask,
                        scale: float | None = None, block_m: int = CHECK_BLOCK,
                        block_n: int = CHECK_BLOCK) -> None:
    """Launch a block-sparse kernel (the signature of exercise 10.3), grid (T_r, H).

    Args:
        q: ``(H, N_q, d)``; k, v: ``(H, N_k, d)``; o: like q; lse: ``(H, N_q)`` float32; any
            strides; ``d`` a power of two.
        kv_num_blocks: ``(T_r,)`` int32, contiguous; kv_indices, kv_partial: ``(T_r, T_c)``
            int32 (exercise 10.1's lists); mask: ``(N_q, N_k)`` int8, 1 = visible (read only on
            partial tiles).
        scale: the score scale (default ``1/sqrt(d)``). block_m, block_n: the lists' tile sizes.
    """
    heads, n_q, d = q.shape
    scale = default_scale(d) if scale is None else scale
    kernel[(triton.cdiv(n_q, block_m), heads)](
        q, k, v, o, lse, kv_num_blocks, kv_indices, kv_partial, mask,
        *q.stride(), *k.stride(), *v.stride(), *o.stride(), *lse.stride(),
        *kv_indices.stride(), *kv_partial.stride(), *mask.stride(), n_q, k.shape[1],
        scale * LOG2_E.value, HEAD_DIM=d, BLOCK_M=block_m, BLOCK_N=block_n)


def block_sparse_inputs(mask, block_m: int, block_n: int, device="cpu"):
    """``(kv_num_blocks, kv_indices, kv_partial, mask)`` as the 10.3 kernel takes them, from a
    boolean ``(N_q, N_k)`` mask (exercise 10.1's lists, int32; the mask as int8)."""
    num, indices, partial = tile_lists_reference(np.asarray(mask), block_m, block_n)
    return (torch.from_numpy(num).to(device=device, dtype=torch.int32),
            torch.from_numpy(indices).to(device=device, dtype=torch.int32),
            torch.from_numpy(partial).to(device=device, dtype=torch.int32),
            torch.from_numpy(np.asarray(mask)).to(device=device, dtype=torch.int8))


def block_sparse_reference(q, k, v, kv_num_blocks, kv_indices, kv_partial, mask, scale=None,
                           **_):
    """float64 attention with the element mask (every row sees at least one key): ``(o in q's
    dtype, lse float32)``."""
    scale = default_scale(q.shape[-1]) if scale is None else scale
    s = scale * q.double().cpu() @ k.double().cpu().transpose(-1, -2)  # (H, N_q, N_k)
    s = s.masked_fill(mask.cpu()[None] == 0, float("-inf"))
    o = torch.softmax(s, dim=-1) @ v.double().cpu()
    lse = torch.logsumexp(s, dim=-1)
    return o.to(device=q.device, dtype=q.dtype), lse.to(device=q.device, dtype=torch.float32)


BLOCK_SPARSE_NAMES = ("q", "k", "v", "kv_num_blocks", "kv_indices", "kv_partial", "mask")


def _o_shape(q, *_, **__):
    return tuple(q.shape), q.dtype


def _lse_shape(q, *_, **__):
    return tuple(q.shape[:2]), torch.float32


def _q_tile_of(index, block_m=CHECK_BLOCK, **_) -> str:
    head, row = index[0], index[1]
    return (f"row {row} of head {head} is in Q tile {row // block_m} (the program "
            f"(pid_m={row // block_m}, h={head}))")


def _block_sparse_guard_hint(e: dict | None, params: dict) -> str | None:
    if not e:
        return None
    if e["tensor"] in ("kv_indices", "kv_partial"):
        return (f"hint: {e['tensor']} is (T_r, T_c): Q tile pid_m's entries are at "
                f"pid_m * stride_{'ir' if e['tensor'] == 'kv_indices' else 'pr'} + t * "
                f"stride_{'ic' if e['tensor'] == 'kv_indices' else 'pc'} for t < "
                f"kv_num_blocks[pid_m]")
    if e["tensor"] == "kv_num_blocks":
        return "hint: kv_num_blocks has one entry per Q tile: load KV_NUM_BLOCKS + pid_m"
    if e["tensor"] in ("k", "v") and len(e["index"]) > 1 and e["index"][1] >= e["shape"][1]:
        return ("hint: the last K/V tile is ragged — load K and V with mask=keys[:, None] < n_k, "
                "other=0.0, on every tile (a full tile can be ragged too)")
    if e["tensor"] == "mask":
        return ("hint: load the element mask masked with rows[:, None] & (keys[None, :] < n_k): "
                "the padded rows and keys of a ragged tile are outside it")
    return None


def block_sparse_runner(kernel) -> IntLayoutRun:
    """A guarded run of a 10.3 kernel: ``run(q, k, v, kv_num_blocks, kv_indices, kv_partial,
    mask, scale=, block_m=, block_n=, layouts=)``."""
    return IntLayoutRun(
        launch=lambda q, k, v, num, idx, part, mask, o, lse, scale=None, block_m=CHECK_BLOCK,
        block_n=CHECK_BLOCK: launch_block_sparse(kernel, q, k, v, o, lse, num, idx, part, mask,
                                                 scale, block_m, block_n),
        names=BLOCK_SPARSE_NAMES,
        outputs=(Out("o", _o_shape, _q_tile_of), Out("lse", _lse_shape, _q_tile_of)),
        guard_hint=_block_sparse_guard_hint)


def _block_sparse_mistake(mistake: int):
    kernel = _Switched(_block_sparse_model_kernel, mistake)
    return _replay(lambda q, k, v, num, idx, part, mask, o, lse, scale=None, block_m=CHECK_BLOCK,
                   block_n=CHECK_BLOCK: launch_block_sparse(kernel, q, k, v, o, lse, num, idx,
                                                            part, mask, scale, block_m, block_n),
                   BLOCK_SPARSE_NAMES, (Out("o", _o_shape), Out("lse", _lse_shape)))


BLOCK_SPARSE_MISTAKES = {
    "the element mask is never applied: a partial tile holds masked entries, so where "
    "kv_partial is set, load the mask for the tile and set the masked scores to -inf":
        _block_sparse_mistake(B_PARTIAL_UNMASKED),
    "the K/V tile is placed by the loop counter (start_n = t * BLOCK_N): t counts the visited "
    "tiles, the tile itself is kv_indices[pid_m, t], so start_n = kv_tile * BLOCK_N":
        _block_sparse_mistake(B_TILE_POSITION),
    "every Q tile reads row 0 of kv_indices / kv_partial: Q tile pid_m's list is row pid_m, at "
    "pid_m * stride_ir (and pid_m * stride_pr)": _block_sparse_mistake(B_INDEX_ROW0),
    "every Q tile loops kv_num_blocks[0] times: load KV_NUM_BLOCKS + pid_m":
        _block_sparse_mistake(B_NUM_ROW0),
    "the partial flag is read at the tile's column (kv_partial[pid_m, kv_tile]): it sits next "
    "to the tile's entry, kv_partial[pid_m, t]": _block_sparse_mistake(B_PARTIAL_BY_TILE),
    "acc is not rescaled when the running max grows: multiply acc (like l_i) by alpha before "
    "adding p @ v": _block_sparse_mistake(B_NO_RESCALE),
    "the padded keys of the ragged last K/V tile are not masked: a full tile can be ragged "
    "(only real entries count when tiles are classified), so mask keys >= n_k on every tile":
        _block_sparse_mistake(B_RAGGED_UNMASKED),
    "a row that sees no key in its first visited tile gets NaN: its max is still -inf, and "
    "exp2(-inf - (-inf)) is NaN — subtract a safe max, tl.where(m_new == -inf, 0.0, m_new)":
        _block_sparse_mistake(B_NAN_EMPTY_ROW),
    "lse is left in log2 units: multiply m_i + log2(l_i) by LN_2 for the natural log":
        _block_sparse_mistake(B_LSE_LOG2),
    "the scores are not scaled: multiply q·kᵀ by qk_scale_log2 (= scale · LOG2_E), not by "
    "LOG2_E alone": _block_sparse_mistake(B_NO_SCALE),
    "masked scores are set to 0, not -inf: a score of 0 still gets weight exp(0 − m) — use "
    "float('-inf') (MASK_VALUE)": _block_sparse_mistake(B_MASK_ZERO),
    "o is not divided by l_i after the loop: o = acc / l_i[:, None]":
        _block_sparse_mistake(B_NO_DIVISION),
}

# Layouts of the (H, N, d) tensors, each its own; the lists with gaps between rows (so that a
# kernel assuming a row stride of T_c is wrong); the mask column-major.
HEADS_INTERLEAVED = Layout((1, 0, 2), (0, 1, 8))
ROWS_WITH_GAPS = Layout((0, 1, 2), (0, CHECK_BLOCK, 3))
SPARE_HEAD = Layout((0, 1, 2), (1, 0, 5))
LIST_GAPS = Layout((0, 1), (1, 3))
LIST_GAPS_2 = Layout((0, 1), (2, 1))
MASK_COLUMN_MAJOR = Layout((1, 0), (2, 0))
NUM_LAYOUT = Layout((0,), (2,))
# The outputs have strides of their own too (the contract's stride_oh, stride_on, stride_lh,
# stride_ln): lse a slice of a wider buffer, or with its heads innermost; o with gaps.
LSE_WIDER = Layout((0, 1), (0, 7))
LSE_HEADS_INNER = Layout((1, 0), (1, 0))
OUTPUT_LAYOUTS = ((ROWS_WITH_GAPS, LSE_WIDER), (HEADS_INTERLEAVED, LSE_HEADS_INNER),
                  (SPARE_HEAD, LSE_WIDER), (ROWS_WITH_GAPS, LSE_HEADS_INNER))


def _block_sparse_cases(device) -> list[Case]:
    gen = torch.Generator().manual_seed(10_3)
    local_global = np.zeros((3, 3), dtype=bool)
    local_global[:, 0] = True
    local_global[[1, 2], [1, 2]] = True
    local_global_4 = np.zeros((3, 4), dtype=bool)
    local_global_4[:, 0] = True
    local_global_4[[1, 2], [1, 2]] = True
    # (what, mask, H, d, dtype index, scale, (block_m, block_n), logit factor, layouts)
    specs = [
        # causal documents of 10, 23, 15: Q tile 2's rows 33-47 see nothing in K/V tile 0
        # (partial), the first tile they visit
        ("causal documents of 10, 23 and 15 tokens", _document_mask([10, 23, 15], causal=True),
         2, 16, 0, None, (16, 16), 1.0,
         (HEADS_INTERLEAVED, ROWS_WITH_GAPS, SPARE_HEAD)),
        # a block-sparse layout, non-causal: every visited tile full, the last K/V tile ragged
        ("block-sparse local + global layout, N_q=48, N_k=40",
         masks.block_sparse_mask(local_global, 48, 40, 16, 16), 1, 16, 0, 0.4, (16, 16), 1.0,
         (ROWS_WITH_GAPS, SPARE_HEAD, HEADS_INTERLEAVED)),
        # a sliding window with scores in the hundreds, BLOCK_N ≠ BLOCK_M
        ("sliding window W=20, N=45", masks.sliding_window_mask(45, 45, 20), 1, 32, 0, None,
         (16, 32), 60.0, (SPARE_HEAD, HEADS_INTERLEAVED, ROWS_WITH_GAPS)),
        # causal local + global: Q tile 2 visits K/V tiles 0 (full) and 2 (partial), so its
        # list and the tile indices differ
        ("causal local + global (the first tile and the diagonal one), N_q=37, N_k=50",
         masks.block_sparse_mask(local_global_4, 37, 50, 16, 16) & np.tri(37, 50, dtype=bool),
         2, 16, 1, None, (16, 16), 1.0, (HEADS_INTERLEAVED, SPARE_HEAD, ROWS_WITH_GAPS)),
    ]
    cases = []
    for (what, mask, heads, d, i, scale, (bm, bn), factor, layouts), outputs in zip(
            specs, OUTPUT_LAYOUTS):
        dtype = _case_dtypes()[i]
        n_q, n_k = mask.shape
        q = torch.randn(heads, n_q, d, generator=gen) * factor
        k, v = (torch.randn(heads, n_k, d, generator=gen) for _ in range(2))
        lists = block_sparse_inputs(mask, bm, bn, device)
        counts = masks.tile_counts(masks.classify_tiles(mask, bm, bn))
        label = (f"{what}: H={heads}, d={d}, {str(dtype).replace('torch.', '')}, "
                 f"scale={'1/√d' if scale is None else scale}, BLOCK_M={bm}, BLOCK_N={bn}, "
                 f"tiles {counts['full']} full, {counts['partial']} partial, "
                 f"{counts['skipped']} skipped" + (f", scores ×{factor:g}" if factor != 1 else "")
                 + "; outputs o [head, row, col], lse [head, row]")
        cases.append(LayoutCase(
            tuple(x.to(device=device, dtype=dtype) for x in (q, k, v)) + lists,
            {"scale": scale, "block_m": bm, "block_n": bn,
             "layouts": (*layouts, NUM_LAYOUT, LIST_GAPS, LIST_GAPS_2, MASK_COLUMN_MAJOR,
                         *outputs)},
            label=label, features=_tile_features(mask, bm, bn)))
    return cases


def _tile_features(mask: np.ndarray, block_m: int, block_n: int) -> dict:
    """What a block-sparse case's tile lists hold, for the differential diagnosis."""
    classes = masks.classify_tiles(mask, block_m, block_n)
    num, indices, _ = tile_lists_reference(mask, block_m, block_n)
    n_q, n_k = mask.shape
    empty_first = False  # a row that sees nothing in the first tile its Q tile visits
    for i, n in enumerate(num):
        if n:
            j = indices[i, 0]
            rows = mask[i * block_m:(i + 1) * block_m, j * block_n:(j + 1) * block_n]
            empty_first |= bool((~rows.any(axis=1)).any())
    last = num_blocks(n_k, block_n) - 1
    return {"partial tiles": bool((classes == masks.PARTIAL).any()),
            "skipped tiles": bool((classes == masks.SKIP).any()),
            "a visited ragged last K/V tile": bool(n_k % block_n and (classes[:, last] != masks.SKIP).any()),
            "rows that see no key in their Q tile's first visited tile": empty_first,
            "Q tiles whose list is not 0, 1, 2, …": any(
                (indices[i, :n] != np.arange(n)).any() for i, n in enumerate(num))}


@learner_check
def check_block_sparse_kernel(kernel):
    """Check exercise 10.3 (a kernel with the signature of the notebook's
    ``block_sparse_kernel``); return the learner's kernel or, not done yet, the library's."""
    return check_layout_kernel("Exercise 10.3", kernel, block_sparse_runner(kernel),
                               block_sparse_reference, _block_sparse_cases(_rt.device),
                               fallback=BLOCK_SPARSE_KERNEL, mistakes=BLOCK_SPARSE_MISTAKES,
                               names=BLOCK_SPARSE_NAMES + ("o", "lse"), locate=_q_tile_of)


BLOCK_SPARSE_HINTS = [
    "Who you are: <code>pid_m, h = tl.program_id(0), tl.program_id(1)</code>; your rows are "
    "<code>offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)</code>. Load the Q tile once, masked "
    "with <code>offs_m[:, None] &lt; n_q</code>.",
    "Your list: <code>num = tl.load(KV_NUM_BLOCKS + pid_m)</code>, then <code>for t in range(0, "
    "num):</code> with <code>kv_tile = tl.load(KV_INDICES + pid_m * stride_ir + t * "
    "stride_ic)</code> and <code>partial = tl.load(KV_PARTIAL + pid_m * stride_pr + t * "
    "stride_pc)</code>. The tile's keys are <code>kv_tile * BLOCK_N + tl.arange(0, "
    "BLOCK_N)</code> — not <code>t * BLOCK_N</code>.",
    "Every tile: load K and V masked with <code>keys[:, None] &lt; n_k</code>, scores "
    "<code>tl.dot(q, tl.trans(k)) * qk_scale_log2</code>, and <code>-inf</code> where <code>keys "
    "&gt;= n_k</code> (a full tile can be ragged).",
    "Only when <code>partial != 0</code>: load the element mask <code>MASK + offs_m[:, None] * "
    "stride_mq + keys[None, :] * stride_mk</code> (masked to the real rows and keys, other=0) "
    "and set <code>s = tl.where(visible != 0, s, float('-inf'))</code>.",
    "The online softmax of chapter 06, with one change: a row may see no key in its first "
    "partial tile, so its max is still -inf — exponentiate against <code>m_safe = "
    "tl.where(m_new == float('-inf'), 0.0, m_new)</code>: <code>p = tl.math.exp2(s - m_safe[:, "
    "None])</code>, <code>alpha = tl.math.exp2(m_i - m_safe)</code>.",
    "After the loop: <code>o = acc / l_i[:, None]</code>, <code>lse = (m_i + tl.math.log2(l_i)) * "
    "LN_2</code>; store both masked with <code>offs_m &lt; n_q</code> (o as "
    "<code>O.dtype.element_ty</code>).",
]

BLOCK_SPARSE_SKELETON = '''\
pid_m, h = tl.program_id(0), tl.program_id(1)
offs_m = ...                                  # (BLOCK_M,) this program's query rows
offs_n, offs_d = tl.arange(0, BLOCK_N), tl.arange(0, HEAD_DIM)
rows = offs_m < n_q
q = ...                                       # (BLOCK_M, HEAD_DIM), masked with rows
m_i, l_i, acc = ...                           # -inf, 0, 0 in float32
num = ...                                     # how many K/V tiles this Q tile visits
for t in range(0, num):
    kv_tile = ...                             # kv_indices[pid_m, t]
    partial = ...                             # kv_partial[pid_m, t]
    keys = ...                                # (BLOCK_N,) the tile's key indices
    k, v = ...                                # masked with keys < n_k
    s = ...                                   # log2-unit scores, -inf where keys >= n_k
    if partial != 0:
        visible = ...                         # the element mask of this tile
        s = ...                               # -inf where not visible
    m_new = ...
    m_safe = ...                              # 0 where m_new is still -inf
    p, alpha = ...                            # exp2 against m_safe
    l_i, acc, m_i = ...
o, lse = ...                                  # acc / l_i, natural-log lse
...                                           # store o and lse for rows < n_q'''

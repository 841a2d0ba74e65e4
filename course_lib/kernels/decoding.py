"""Split-KV decoding ("flash-decoding") as Triton kernels, with GQA/MQA (chapter 08).

Chapter 08's NumPy version (:func:`course_lib.attention.decoding.flash_decode`) cut the KV cache into
``S`` chunks, computed each chunk's softmax state ``(m, l, o)`` independently and merged the
states with chapter 03's merge. Here the same two steps are two kernels:

1. :func:`split_kv_kernel`: one program per (query head ``h``, split ``s``, batch ``b``),
   grid ``(H, S, B)``. It loads its ``n_q`` query rows once (padded to ``BLOCK_M`` rows:
   ``tl.dot`` needs 16), walks the keys of its chunk BLOCK_N at a time with chapter 06's online
   softmax (exp2, scale folded in, the ragged last tile of the chunk masked) and writes the
   chunk's state to a float32 workspace: ``m`` and ``l`` ``(B, H, S, n_q)``, ``o``
   ``(B, H, S, n_q, d)``. ``m`` is stored in natural-log units and ``o`` normalised (``acc/l``),
   exactly the states of :func:`course_lib.attention.decoding.split_kv_partials`; an empty chunk stores
   the empty state ``m = -inf, l = 0, o = 0``.
2. :func:`combine_kernel`: one program per (query row, head, batch) merges the ``S`` states —
   ``m = max_s m_s``, weights ``w_s = l_s · exp(m_s − m)``, ``o = Σ w_s o_s / Σ w_s`` (chapter
   03's :func:`~course_lib.attention.softmax.merge_states_with_output`, all ``S`` at once: the merge is
   associative, so this equals merging pairwise) — and writes ``o`` in the input dtype and the
   natural-log ``lse = m + log(Σ w_s)``.

Chunks: split ``s`` owns keys ``[s · c, min((s + 1) · c, N))`` with ``c = cdiv(N, S)``, so only
the last tile of each chunk is ragged; with ``S > N`` the last chunks are empty.

GQA/MQA: query head ``h`` reads K/V head ``h // (H // H_kv)`` (:func:`course_lib.attention.gqa.kv_head_index`)
by pointer arithmetic; K and V are never repeated. Consecutive query heads are adjacent in the
grid, so the programs of one group read the same K/V chunk at about the same time (from L2).
:func:`split_kv_kernel` (exercise 8.4) gives each query head its own program;
:func:`split_kv_kernel` with ``GROUPED=True``, which :func:`flash_decode_triton` uses when a group's rows fit
one tile, packs the ``group · n_q`` query rows of a K/V head into one tile, so each K/V tile is
read once per group. Both share the loop (:func:`chunk_state`) and the store (:func:`store_state`).

Every query row sees the whole cache (no mask among the ``n_q`` queries): ``n_q > 1`` is for
speculative decoding's few draft tokens, which the caller masks by passing the right cache.
"""

from __future__ import annotations

import numbers

import torch
import triton
import triton.language as tl

from course_lib import constants
from course_lib.platform import runtime
from course_lib.attention.decoding import num_splits_to_fill
from course_lib.kernels import fit, ops, tiles, tuning
from course_lib.kernels.inputs import KERNEL_DTYPES, _dtype_names, validate_offsets, validate_scale
from course_lib.kernels.forward import compute_dtype, kernel_dtypes, padded_head_dim
from course_lib.kernels.tiles import LN_2, LOG2_E, MASK_VALUE
from course_lib.attention.reference import default_scale

_rt = runtime.ensure_configured()  # interpreter or GPU: decided before the first @triton.jit

__all__ = ["flash_decode_triton", "split_kv_kernel", "combine_kernel", "launch_split_kv",
           "launch_combine", "choose_splits", "validate_decode_inputs"]

# At most this many query rows per call: they share one BLOCK_M tile (speculative decoding's few
# draft tokens; a longer prefill belongs to the forward kernel).
MAX_DECODE_QUERIES = 16
# tl.dot needs tiles at least 16 rows tall (and wide): fewer query rows are padded with zeros.
MIN_BLOCK_M = 16
# Key rows per tile. 64 rows × d=128 × fp16 = 16 KiB per K tile: small enough for several
# programs per SM, large enough to stream. Not tuned yet: tools/bench_decoding.py measures it.
DECODE_BLOCK_N = 64
# The grouped split kernel puts group · n_q query rows in one tile; past this many, the
# (rows, d) fp32 accumulator would spill registers, so each query head gets its own program.
MAX_GROUPED_ROWS = 64
# The combine kernel holds all S states of a row in registers: (S, d) fp32 values.
MAX_SPLITS = 256
# Splits when interpreting: enough to exercise the merge, few enough to stay fast.
INTERPRETER_SPLITS = 4


# ----------------------------------------------------------------------------------------------
# Kernel 1: one chunk of keys -> a partial state (m, l, o)


@triton.jit
def chunk_bounds(split, n_k):
    """``(split_start, split_end)``: the keys of chunk ``split`` of ``tl.num_programs(1)``."""
    keys_per_split = tl.cdiv(n_k, tl.num_programs(1))
    split_start = split * keys_per_split
    return split_start, tl.minimum(split_start + keys_per_split, n_k)


@triton.jit
def chunk_state(q, k_ptrs, v_ptrs, split_start, split_end, offs_n, d_mask, stride_kn, stride_vn,
                qk_scale_log2, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                HEAD_DIM: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Chapter 06's loop over the K/V tiles of one chunk: ``(m_i, l_i, acc)`` of the rows of
    ``q`` ``(BLOCK_M, HEAD_DIM)``, m_i in log2 units; ``k_ptrs``/``v_ptrs`` point at key rows
    ``offs_n``. An empty chunk gives ``(-inf, 0, 0)``."""
    m_i = tl.full((BLOCK_M,), MASK_VALUE, tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, HEAD_DIM), tl.float32)
    for start_n in range(split_start, split_end, BLOCK_N):
        # read BLOCK_N·d elements of K and of V; keys past the chunk's end load as 0
        keys, kv_mask, k = tiles.load_tile_at(k_ptrs, start_n, offs_n, split_end, d_mask, stride_kn)
        s = tiles.scores_log2(q, k, qk_scale_log2, ACC_DTYPE=tl.float32, DOT_PRECISION=DOT_PRECISION)
        s = tl.where(keys[None, :] < split_end, s, MASK_VALUE)  # the ragged last tile
        m_i, l_i, acc = tiles.online_softmax_step(s, m_i, l_i, acc, v_ptrs + start_n * stride_vn,
                                                  kv_mask, ACC_DTYPE=tl.float32,
                                                  DOT_PRECISION=DOT_PRECISION)
    return m_i, l_i, acc


@triton.jit
def store_state(M, L, O, m_i, l_i, acc, b, h, split, row, row_ok, offs_d, d_mask,
                stride_mb, stride_mh, stride_ms, stride_mm,
                stride_ob, stride_oh, stride_os, stride_om, stride_od):
    """Store ``m`` (natural-log units), ``l`` and ``o = acc / l`` of the rows ``row_ok`` at
    ``[b, h, split, row]`` (``h`` and ``row``: a scalar or one per tile row)."""
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # an empty chunk keeps o = 0
    ml_off = b * stride_mb + h * stride_mh + split * stride_ms + row * stride_mm  # (BLOCK_M,)
    tl.store(M + ml_off, m_i * LN_2, mask=row_ok)  # natural-log units, like chapter 03's states
    tl.store(L + ml_off, l_i, mask=row_ok)
    o_off = b * stride_ob + h * stride_oh + split * stride_os + row * stride_om  # (BLOCK_M,)
    tl.store(O + o_off[:, None] + offs_d[None, :] * stride_od, o,
             mask=row_ok[:, None] & d_mask[None, :])


@triton.jit
def split_kv_kernel(Q, K, V, M, L, O,
                    stride_qb, stride_qh, stride_qm, stride_qd,
                    stride_kb, stride_kh, stride_kn, stride_kd,
                    stride_vb, stride_vh, stride_vn, stride_vd,
                    stride_mb, stride_mh, stride_ms, stride_mm,
                    stride_ob, stride_oh, stride_os, stride_om, stride_od,
                    n_q, n_k, n_heads, n_kv_heads, qk_scale_log2,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    HEAD_DIM: tl.constexpr, HEAD_DIM_REAL: tl.constexpr,
                    DOT_PRECISION: tl.constexpr, GROUPED: tl.constexpr = False):
    """The state ``(m, l, o)`` of query head h's rows over split s's chunk of keys (exercise 8.4).

    Grid ``(H, S, B)``. Q ``(B, H, n_q, d)``; K, V ``(B, H_kv, N, d)``; M, L ``(B, H, S, n_q)``
    and O ``(B, H, S, n_q, d)`` float32. Stores m in natural-log units, l, and o = acc / l
    (0 for an empty chunk).

    ``GROUPED`` (the library's variant; exercise 8.4 leaves it out): grid ``(H_kv, S, B)``, a
    whole GQA group in one program. Tile row ``r`` is query row ``r % n_q`` of query head
    ``kv_h · group + r // n_q``: the ``group · n_q`` rows that read K/V head ``kv_h`` share every
    K/V tile, read from memory once per group instead of once per query head.
    """
    split = tl.program_id(1)
    b = tl.program_id(2)
    split_start, split_end = chunk_bounds(split, n_k)
    offs_m = tl.arange(0, BLOCK_M)  # query rows (n_q of them real), or (head in group, row) pairs
    offs_n = tl.arange(0, BLOCK_N)  # key rows of a tile
    offs_d = tl.arange(0, HEAD_DIM)
    d_mask = offs_d < HEAD_DIM_REAL
    if GROUPED:
        kv_h = tl.program_id(0)
        group = n_heads // n_kv_heads
        h = kv_h * group + offs_m // n_q  # (BLOCK_M,) the query head of each tile row
        row = offs_m % n_q  # (BLOCK_M,) its query row
        row_ok = offs_m < group * n_q
        q_ptrs = (Q + b * stride_qb + (h * stride_qh + row * stride_qm)[:, None]
                  + offs_d[None, :] * stride_qd)
        q = tl.load(q_ptrs, mask=row_ok[:, None] & d_mask[None, :], other=0.0)  # (BLOCK_M, HEAD_DIM)
    else:
        h = tl.program_id(0)
        kv_h = h // (n_heads // n_kv_heads)  # GQA: consecutive query heads share a K/V head
        row = offs_m
        row_ok = offs_m < n_q
        q = tiles.load_tile(Q, b, h, offs_m, offs_d, tiles.row_mask(offs_m, n_q, d_mask),
                            stride_qb, stride_qh, stride_qm, stride_qd)  # (BLOCK_M, HEAD_DIM)
    k_ptrs = tiles.tile_ptrs(K, b, kv_h, offs_n, offs_d, stride_kb, stride_kh, stride_kn, stride_kd)
    v_ptrs = tiles.tile_ptrs(V, b, kv_h, offs_n, offs_d, stride_vb, stride_vh, stride_vn, stride_vd)
    m_i, l_i, acc = chunk_state(q, k_ptrs, v_ptrs, split_start, split_end, offs_n, d_mask,
                                stride_kn, stride_vn, qk_scale_log2, BLOCK_M=BLOCK_M,
                                BLOCK_N=BLOCK_N, HEAD_DIM=HEAD_DIM, DOT_PRECISION=DOT_PRECISION)
    store_state(M, L, O, m_i, l_i, acc, b, h, split, row, row_ok, offs_d, d_mask,
                stride_mb, stride_mh, stride_ms, stride_mm,
                stride_ob, stride_oh, stride_os, stride_om, stride_od)


def launch_split_kv(kernel, q, k, v, m, l, o, scale: float, block_n: int = DECODE_BLOCK_N,
                    grouped: bool = False, fit_to_gpu: bool = False, shrink_block_n: bool = False) -> None:
    """Launch ``kernel``: :func:`split_kv_kernel` (or a learner's with its signature) on grid
    ``(H, S, B)``, or, with ``grouped``, :func:`split_kv_kernel` with ``GROUPED=True`` on grid
    ``(H_kv, S, B)``.

    Args:
        q: ``(B, H, n_q, d)``; k, v: ``(B, H_kv, N, d)``; any strides.
        m, l: ``(B, H, S, n_q)`` float32 with the same strides; o: ``(B, H, S, n_q, d)`` float32.
        scale: the score scale. block_n: key rows per tile.
        fit_to_gpu: on a GPU, let :func:`course_lib.kernels.fit.choose` lower the pipeline depth
            (and, with ``shrink_block_n``, the key tile) where this GPU's shared memory needs it.
    """
    batch, heads, n_q, d = q.shape
    splits, n_kv_heads = m.shape[2], k.shape[1]
    if l.stride() != m.stride():
        raise ValueError(f"m and l must have the same strides, got {m.stride()} and {l.stride()}")
    _, precision = kernel_dtypes(q.dtype, padded_head_dim(d))
    rows = (heads // n_kv_heads) * n_q if grouped else n_q  # query rows per program
    args = (q, k, v, m, l, o, *q.stride(), *k.stride(), *v.stride(), *m.stride(), *o.stride(),
            n_q, k.shape[2], heads, n_kv_heads, scale * constants.LOG2_E)
    meta = dict(HEAD_DIM=padded_head_dim(d), HEAD_DIM_REAL=d, DOT_PRECISION=precision,
                **({"GROUPED": True} if grouped else {}))
    blocks = tuning.Blocks(max(MIN_BLOCK_M, triton.next_power_of_2(rows)), block_n,
                           tuning.DECODE_WARPS, tuning.DECODE_STAGES)
    if fit_to_gpu and not _rt.interpreted:
        blocks = fit.choose(kernel, tuning.decode_candidates(blocks.block_m, block_n, shrink_block_n),
                            args, meta)
    kernel[(n_kv_heads if grouped else heads, splits, batch)](
        *args, **meta, BLOCK_M=blocks.block_m, BLOCK_N=blocks.block_n, num_warps=blocks.num_warps,
        num_stages=blocks.num_stages)


# ----------------------------------------------------------------------------------------------
# Kernel 2: merge the S partial states of one query row


@triton.jit
def combine_kernel(M, L, O_part, Out, Lse,
                   stride_mb, stride_mh, stride_ms, stride_mm,
                   stride_pb, stride_ph, stride_ps, stride_pm, stride_pd,
                   stride_ob, stride_oh, stride_om, stride_od,
                   stride_lb, stride_lh, stride_lm,
                   n_splits,
                   BLOCK_S: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_REAL: tl.constexpr):
    """Chapter 03's merge of the S states of one (row, head, batch); grid ``(n_q, H, B)``.

    Reads ``S · (d + 2)`` float32 values, writes d values of ``Out`` (its dtype) and one lse.
    """
    row = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, HEAD_DIM)
    s_mask = offs_s < n_splits
    d_mask = offs_d < HEAD_DIM_REAL
    ml_off = b * stride_mb + h * stride_mh + offs_s * stride_ms + row * stride_mm
    m = tl.load(M + ml_off, mask=s_mask, other=MASK_VALUE)  # (BLOCK_S,) natural-log units
    l = tl.load(L + ml_off, mask=s_mask, other=0.0)
    o = tl.load(O_part + b * stride_pb + h * stride_ph + row * stride_pm
                + offs_s[:, None] * stride_ps + offs_d[None, :] * stride_pd,
                mask=s_mask[:, None] & d_mask[None, :], other=0.0)  # (BLOCK_S, HEAD_DIM)
    m_max = tl.max(m, axis=0)  # finite: N >= 1, so some chunk is not empty
    w = l * tl.math.exp2((m - m_max) * LOG2_E)  # (BLOCK_S,) each chunk's share; 0 when empty
    l_sum = tl.sum(w, axis=0)
    out = tl.sum(w[:, None] * o, axis=0) / l_sum  # (HEAD_DIM,)
    tl.store(Out + b * stride_ob + h * stride_oh + row * stride_om + offs_d * stride_od,
             out.to(Out.dtype.element_ty), mask=d_mask)
    tl.store(Lse + b * stride_lb + h * stride_lh + row * stride_lm, m_max + tl.log(l_sum))


def launch_combine(m, l, o_part, out, lse, kernel=None) -> None:
    """Merge the workspace ``(m, l, o_part)`` into ``out`` ``(B, H, n_q, d)`` and ``lse``
    ``(B, H, n_q)`` float32 on grid ``(n_q, H, B)``.

    Args:
        m, l: ``(B, H, S, n_q)`` float32 with the same strides; o_part: ``(B, H, S, n_q, d)``
            float32. out: ``(B, H, n_q, d)`` (its dtype is the output's); lse: ``(B, H, n_q)``.
        kernel: :func:`combine_kernel` (None) or a learner's with its signature (exercise 8.5).
    """
    batch, heads, splits, n_q = m.shape
    d = out.shape[-1]
    if l.stride() != m.stride():
        raise ValueError(f"m and l must have the same strides, got {m.stride()} and {l.stride()}")
    (kernel or combine_kernel)[(n_q, heads, batch)](
        m, l, o_part, out, lse, *m.stride(), *o_part.stride(), *out.stride(), *lse.stride(),
        splits, BLOCK_S=triton.next_power_of_2(splits), HEAD_DIM=padded_head_dim(d),
        HEAD_DIM_REAL=d)


# ----------------------------------------------------------------------------------------------
# The public function


def choose_splits(batch: int, heads: int, seq_len: int, block_n: int = DECODE_BLOCK_N) -> int:
    """Default number of splits: on a GPU, enough programs for every SM
    (:func:`course_lib.attention.decoding.num_splits_to_fill`); in the interpreter, a few. Never more
    splits than key tiles, nor than :data:`MAX_SPLITS`."""
    if _rt.on_gpu:
        sm_count = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
        wanted = num_splits_to_fill(sm_count, batch, heads, seq_len, block_n)
    else:
        wanted = min(INTERPRETER_SPLITS, triton.cdiv(seq_len, block_n))
    return max(1, min(wanted, MAX_SPLITS))


def validate_decode_inputs(q, k, v, splits, scale) -> None:
    """Raise TypeError/ValueError naming the bad argument; return None when the call is valid."""
    rt = runtime.current()
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if q.dim() not in (3, 4):
        raise ValueError(f"q must have shape (B, H, d) or (B, H, n_q, d), got shape {tuple(q.shape)}")
    for name, x in (("k", k), ("v", v)):
        if x.dim() != 4:
            raise ValueError(f"{name} must have shape (B, H_kv, N, d), got shape {tuple(x.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k and v must have the same dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    if q.dtype not in KERNEL_DTYPES:
        raise TypeError(f"q, k and v have dtype {q.dtype}; supported: {_dtype_names(KERNEL_DTYPES)}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k and v must be on the same device, got q on {q.device}, k on "
                         f"{k.device}, v on {v.device}")
    if q.device.type != rt.device:
        raise ValueError(f"q, k and v are on {q.device}, but this session runs kernels on "
                         f"'{rt.device}' tensors")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape (B, H_kv, N, d), got k "
                         f"{tuple(k.shape)} and v {tuple(v.shape)}")
    batch, heads, d = q.shape[0], q.shape[1], q.shape[-1]
    n_q = q.shape[2] if q.dim() == 4 else 1
    if k.shape[0] != batch:
        raise ValueError(f"q and k must have the same batch size, got q {tuple(q.shape)} and k "
                         f"{tuple(k.shape)}")
    if k.shape[-1] != d:
        raise ValueError(f"q and k must have the same head dim d, got q {tuple(q.shape)} and k "
                         f"{tuple(k.shape)}")
    if not constants.MIN_HEAD_DIM <= d <= constants.MAX_HEAD_DIM:
        raise ValueError(f"head dim d = {d} is not supported: the kernels take "
                         f"{constants.MIN_HEAD_DIM} <= d <= {constants.MAX_HEAD_DIM}")
    n_kv_heads = k.shape[1]
    if n_kv_heads == 0 or heads % n_kv_heads:
        raise ValueError(f"the number of query heads H must be a multiple of the number of K/V "
                         f"heads H_kv, got H = {heads} (q {tuple(q.shape)}) and H_kv = "
                         f"{n_kv_heads} (k {tuple(k.shape)})")
    if not 1 <= n_q <= MAX_DECODE_QUERIES:
        raise ValueError(f"q has n_q = {n_q} query rows; decoding takes 1 to {MAX_DECODE_QUERIES} "
                         f"(use flash_attention for a prefill)")
    if batch == 0 or heads == 0 or k.shape[2] == 0:
        raise ValueError(f"empty input: q {tuple(q.shape)}, k {tuple(k.shape)}; batch, heads and "
                         f"the cache length N must be >= 1")
    if splits is not None:
        if isinstance(splits, bool) or not isinstance(splits, numbers.Integral):
            raise TypeError(f"splits must be a positive int or None, got {type(splits).__name__}")
        if not 1 <= splits <= MAX_SPLITS:
            raise ValueError(f"splits must be between 1 and {MAX_SPLITS}, got {splits}")
    validate_scale(scale)
    validate_offsets(q=q, k=k, v=v)


def flash_decode_triton(q, k, v, splits: int | None = None, scale: float | None = None, *,
                        block_n: int | None = None, grouped: bool | None = None):
    """Decoding attention by split-KV in Triton: ``softmax(scale · q kᵀ) v`` over the whole cache.

    Args:
        q: ``(B, H, d)`` (one new token per sequence) or ``(B, H, n_q, d)`` with
            ``n_q <= MAX_DECODE_QUERIES``; every query row sees the whole cache.
        k, v: the cache, ``(B, H_kv, N, d)`` with ``H % H_kv == 0`` (GQA; MQA when ``H_kv = 1``).
        splits: chunks of the cache (programs per query head); None: :func:`choose_splits`.
        scale: score scale; default ``1/sqrt(d)``.
        block_n: key rows per tile (a power of two >= 16); None: :data:`DECODE_BLOCK_N`, or
            fewer where this GPU's shared memory needs it (:mod:`course_lib.kernels.fit`).
        grouped: one program per K/V head and split (:func:`split_kv_kernel` with ``GROUPED=True``: each
            K/V tile read once per group) or per query head and split (:func:`split_kv_kernel`);
            None: grouped when a group's rows fit one tile (``group · n_q <= MAX_GROUPED_ROWS``).

    Returns:
        ``(o, lse)``: ``o`` shaped like q in q's dtype; ``lse`` ``q.shape[:-1]`` float32,
        natural log.
    """
    validate_decode_inputs(q, k, v, splits, scale)
    if block_n is not None and (isinstance(block_n, bool) or not isinstance(block_n, numbers.Integral)
                                or block_n < MIN_BLOCK_M or block_n & (block_n - 1)):
        raise ValueError(f"block_n must be a power of two >= {MIN_BLOCK_M}, got {block_n!r}")
    scale = default_scale(q.shape[-1]) if scale is None else float(scale)
    if torch.compiler.is_compiling():  # one opaque node for the compiler (course_lib.kernels.ops)
        return ops.flash_decode(q, k, v, splits, scale, block_n, grouped)
    return _flash_decode(q, k, v, splits, scale, block_n, grouped)


@ops.implementation("flash_decode")
def _flash_decode(q, k, v, splits, scale: float, block_n, grouped):
    """``(o, lse)`` of a checked :func:`flash_decode_triton` call (also ``course::flash_decode``'s
    implementation); ``block_n`` None: :data:`DECODE_BLOCK_N`, shrunk where this GPU needs it."""
    shrink_block_n = block_n is None
    block_n = DECODE_BLOCK_N if block_n is None else block_n
    q4 = q if q.dim() == 4 else q[:, :, None, :]  # (B, H, n_q, d), a view
    batch, heads, n_q, d = q4.shape
    n_kv_heads = k.shape[1]
    if grouped is None:
        grouped = (heads // n_kv_heads) * n_q <= MAX_GROUPED_ROWS
    # programs per split: one per K/V head (grouped) or per query head
    heads_per_split = n_kv_heads if grouped else heads
    splits = (choose_splits(batch, heads_per_split, k.shape[2], block_n) if splits is None
              else int(splits))
    work = compute_dtype(q.dtype, _rt.interpreted)  # bf16 computes in fp32 in the interpreter
    qw, kw, vw = (x.to(work) for x in (q4, k, v))  # no copy unless bf16 in the interpreter
    dev = q.device
    m = torch.empty((batch, heads, splits, n_q), dtype=torch.float32, device=dev)
    l = torch.empty_like(m)
    o_part = torch.empty((batch, heads, splits, n_q, d), dtype=torch.float32, device=dev)
    launch_split_kv(split_kv_kernel, qw, kw, vw, m, l, o_part, scale, block_n, grouped=grouped,
                    fit_to_gpu=True, shrink_block_n=shrink_block_n)
    o = torch.empty((batch, heads, n_q, d), dtype=work, device=dev)
    lse = torch.empty((batch, heads, n_q), dtype=torch.float32, device=dev)
    launch_combine(m, l, o_part, o, lse)
    return o.to(q.dtype).reshape(q.shape), lse.reshape(q.shape[:-1])

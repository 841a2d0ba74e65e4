"""The FlashAttention forward kernel in Triton (chapter 06).

One program owns one tile of BLOCK_M query rows of one (batch, head). It loads its Q tile once,
then walks over the keys and values BLOCK_N rows at a time, keeping the online-softmax state of
chapter 03 in registers:

    m_i  (BLOCK_M,)            running row maximum of the scores (in log2 units, see below)
    l_i  (BLOCK_M,)            running row sum of exp2(score - m_i)
    acc  (BLOCK_M, HEAD_DIM)   running sum of exp2(score - m_i) · v, not yet divided by l_i

and at the end writes ``o = acc / l_i`` and the log-sum-exp ``lse`` that the backward needs.
The N×N score matrix never leaves the chip.

Performance tricks, each introduced in chapter 06's prose before it appears here:

- **exp2 with the scale folded in.** ``exp(x) = exp2(x · LOG2_E)`` and the GPU has a fast exp2
  instruction, so we multiply the scores once by ``scale · LOG2_E`` and work in log2 units.
- **Masks only where needed.** Key tiles entirely inside the sequence and (when causal) entirely
  left of the diagonal need no mask: a first loop runs over them unmasked; a second loop runs over
  the few tiles that straddle the diagonal or the ragged end of the sequence, with the mask.
- **Causal tile skipping.** Key tiles entirely right of the diagonal are never visited.

Layout: every tensor is seen as ``(B, H, N, d)`` through its four strides, so non-contiguous
inputs (a transposed ``(B, N, H, d)`` view, say) need no copy. ``HEAD_DIM`` is the head dim
rounded up to a power of two (``tl.arange`` needs one); columns ``HEAD_DIM_REAL <= c < HEAD_DIM``
are masked. The tile helpers (pointers, masks, the tile split, the online-softmax step) are in
:mod:`course_lib.kernels.tiles`; chapter 06's teaching kernel (:mod:`course_lib.kernels.teaching`)
is this kernel without the two-stage loop, the padding and the autotuning.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from course_lib import constants
from course_lib.platform import runtime
from course_lib.kernels import fit, tiles, tuning
from course_lib.kernels.launch import CachedLaunch
from course_lib.kernels.tiles import LN_2, MASK_VALUE

_rt = runtime.ensure_configured()  # interpreter or GPU: decided before the first @triton.jit

LOG2_E_FLOAT = constants.LOG2_E  # the host-side scale folds it in: qk_scale_log2 = scale · LOG2_E


@triton.jit
def _forward_kv_tiles(acc, l_i, m_i, q, k_tile_ptrs, v_tile_ptrs, stride_kn, stride_vn,
                      offs_m, offs_n, d_mask, n_k, kv_start, kv_end, qk_scale_log2,
                      MASKED: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr,
                      ACC_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Fold key/value tiles [kv_start, kv_end) into the online-softmax state (m_i, l_i, acc)."""
    for start_n in range(kv_start, kv_end, BLOCK_N):
        # cols (BLOCK_N,) key indices of this tile; k (BLOCK_N, HEAD_DIM)
        cols, load_mask, k = tiles.load_tile_at(k_tile_ptrs, start_n, offs_n, n_k, d_mask, stride_kn)
        s = tiles.scores_log2(q, k, qk_scale_log2, ACC_DTYPE=ACC_DTYPE, DOT_PRECISION=DOT_PRECISION)
        if MASKED:  # (BLOCK_M, BLOCK_N) scores in log2 units; hidden keys -> MASK_VALUE
            s = tl.where(tiles.visible(offs_m, cols, n_k, CAUSAL=CAUSAL), s, MASK_VALUE)
        m_i, l_i, acc = tiles.online_softmax_step(s, m_i, l_i, acc, v_tile_ptrs + start_n * stride_vn, load_mask,
                                                  ACC_DTYPE=ACC_DTYPE, DOT_PRECISION=DOT_PRECISION)
    return acc, l_i, m_i


@triton.jit
def attention_forward_kernel(
        Q, K, V, O, LSE,  # Q, O: (B, H, N_Q, d); K, V: (B, H, N_K, d); LSE: (B, H, N_Q) contiguous
        stride_qb, stride_qh, stride_qn, stride_qd,
        stride_kb, stride_kh, stride_kn, stride_kd,
        stride_vb, stride_vh, stride_vn, stride_vd,
        stride_ob, stride_oh, stride_on, stride_od,
        n_heads, n_q, n_k, qk_scale_log2,
        HEAD_DIM_REAL: tl.constexpr, HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr,
        ACC_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ORDER: tl.constexpr = 0):
    """One program: one BLOCK_M tile of queries of one (batch, head).

    Grid: cdiv(n_q, BLOCK_M) · B · H programs on one axis, in ``ORDER`` (see
    :func:`~course_lib.kernels.tiles.program_tile_ordered`). Reads its Q tile once and each K, V
    tile it can see once; writes BLOCK_M rows of O and LSE.
    """
    pid_bh, b, h, start_m = tiles.program_tile_ordered(n_q, n_heads, BLOCK=BLOCK_M, ORDER=ORDER)
    offs_m = start_m + tl.arange(0, BLOCK_M)  # (BLOCK_M,) query rows of this program
    offs_d = tl.arange(0, HEAD_DIM)  # (HEAD_DIM,) columns, padded to a power of two
    d_mask = offs_d < HEAD_DIM_REAL
    q = tiles.load_tile(Q, b, h, offs_m, offs_d, tiles.row_mask(offs_m, n_q, d_mask),
                        stride_qb, stride_qh, stride_qn, stride_qd)  # (BLOCK_M, HEAD_DIM)

    offs_n = tl.arange(0, BLOCK_N)  # (BLOCK_N,) key rows within a tile
    k_tile_ptrs = tiles.tile_ptrs(K, b, h, offs_n, offs_d, stride_kb, stride_kh, stride_kn, stride_kd)
    v_tile_ptrs = tiles.tile_ptrs(V, b, h, offs_n, offs_d, stride_vb, stride_vh, stride_vn, stride_vd)

    m_i = tl.full([BLOCK_M], MASK_VALUE, dtype=ACC_DTYPE)  # running max
    l_i = tl.zeros([BLOCK_M], dtype=ACC_DTYPE)  # running sum of exponentials
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=ACC_DTYPE)  # running sum of exponentials · v

    # Key tiles [0, full_end) need no mask; [full_end, kv_end) do; tiles past kv_end are skipped.
    full_end, kv_end = tiles.kv_split(start_m, n_k, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, CAUSAL=CAUSAL)
    acc, l_i, m_i = _forward_kv_tiles(acc, l_i, m_i, q, k_tile_ptrs, v_tile_ptrs, stride_kn, stride_vn,
                                      offs_m, offs_n, d_mask, n_k, 0, full_end, qk_scale_log2,
                                      MASKED=False, CAUSAL=CAUSAL, BLOCK_N=BLOCK_N,
                                      ACC_DTYPE=ACC_DTYPE, DOT_PRECISION=DOT_PRECISION)
    acc, l_i, m_i = _forward_kv_tiles(acc, l_i, m_i, q, k_tile_ptrs, v_tile_ptrs, stride_kn, stride_vn,
                                      offs_m, offs_n, d_mask, n_k, full_end, kv_end, qk_scale_log2,
                                      MASKED=True, CAUSAL=CAUSAL, BLOCK_N=BLOCK_N,
                                      ACC_DTYPE=ACC_DTYPE, DOT_PRECISION=DOT_PRECISION)

    o = acc / l_i[:, None]  # (BLOCK_M, HEAD_DIM)
    lse = (m_i + tl.math.log2(l_i)) * LN_2  # (BLOCK_M,) natural-log log-sum-exp of the scores
    row_ok = offs_m < n_q  # the last Q tile may stick out past N_q
    o_ptrs = tiles.tile_ptrs(O, b, h, offs_m, offs_d, stride_ob, stride_oh, stride_on, stride_od)
    tl.store(o_ptrs, o.to(O.dtype.element_ty), mask=row_ok[:, None] & d_mask[None, :])
    tl.store(LSE + pid_bh * n_q + offs_m, lse, mask=row_ok)


attention_forward_kernel_tuned = triton.autotune(
    configs=tuning.forward_configs(),
    key=["n_q", "n_k", "HEAD_DIM", "CAUSAL", "DOT_PRECISION"],
    prune_configs_by={"early_config_prune": tuning.prune_forward},
)(attention_forward_kernel)


# ----------------------------------------------------------------------------------------------
# Host side: dtypes, padding, the launch


def padded_head_dim(d: int) -> int:
    """``tl.arange`` needs a power of two, and ``tl.dot`` at least MIN_HEAD_DIM: round d up."""
    return max(constants.MIN_HEAD_DIM, triton.next_power_of_2(d))


def compute_dtype(dtype: torch.dtype, interpreted: bool) -> torch.dtype:
    """The dtype the kernels see. bf16 is wrong in Triton's interpreter (FACTS.md), so there we
    compute bf16 inputs in fp32 and round the results back to bf16."""
    if interpreted and dtype == torch.bfloat16:
        return torch.float32
    return dtype


# fp32 dot products. "tf32x3" splits each fp32 operand into a tf32 head and a tf32 tail and sums
# three tensor-core products (head·head + head·tail + tail·head), which keeps fp32's accuracy;
# "ieee" is plain fp32 FMAs, no tensor cores: Triton unrolls every tile product into FMAs held in
# registers, so big tiles spill and compile for a long time (the first fp32 backward took 40-145 s
# on an H100 with them). Measured on an H100 (NOTES.md, "fp32 dots"): at head dims up to 128,
# tf32x3 gives the same error against a float64 reference (~3e-7) 4x faster, and compiles in 9 s
# or less per kernel. Above 128 the backward's tf32x3 operands need more shared memory than an
# H100 has at the tiles that do not spill, and the tiles that fit spill 10-16 KB per thread (the
# backward ran 80x slower than the forward): there the backward keeps "ieee" on small tiles
# (tuning.FP32_WIDE). The forward's tf32x3 tiles fit at every head dim (a few hundred bytes of
# spills, 4x faster than ieee), so the forward uses tf32x3 everywhere. COURSE_LIB_FP32_DOTS=ieee
# or =tf32x3 forces one everywhere (for comparisons).
FP32_DOTS_ENV = "COURSE_LIB_FP32_DOTS"
FP32_DOT_PRECISIONS = ("auto", "tf32x3", "ieee")
TF32X3_MAX_HEAD_DIM = 128  # the backward and the other kernels
FORWARD_TF32X3_MAX_HEAD_DIM = 256  # the forward kernel (attention_forward)


def fp32_dot_precision(head_dim: int | None = None, forward_pass: bool = False) -> str:
    """``input_precision`` of fp32 ``tl.dot`` at padded ``head_dim`` (None: a small one), for the
    forward kernel (``forward_pass``) or the others."""
    value = os.environ.get(FP32_DOTS_ENV, "auto")
    if value not in FP32_DOT_PRECISIONS:
        raise ValueError(f"{FP32_DOTS_ENV} must be one of {', '.join(FP32_DOT_PRECISIONS)}, got {value!r}")
    if value != "auto":
        return value
    limit = FORWARD_TF32X3_MAX_HEAD_DIM if forward_pass else TF32X3_MAX_HEAD_DIM
    return "tf32x3" if head_dim is None or head_dim <= limit else "ieee"


def kernel_dtypes(dtype: torch.dtype, head_dim: int | None = None, forward_pass: bool = False):
    """(ACC_DTYPE, DOT_PRECISION) for inputs of ``dtype`` at padded ``head_dim`` (``forward_pass``:
    for the forward kernel, see :func:`fp32_dot_precision`).

    Accumulate in fp32 (fp64 for the interpreter-only float64 used by gradcheck). fp32 inputs
    keep fp32 accuracy (:func:`fp32_dot_precision`): fp32 is the "exact" dtype of the course
    (same answer as the reference to ~1e-6), and the fast dtypes are fp16/bf16. Plain tf32 would
    be faster but only ~1e-3 accurate. The interpreter ignores the setting (its dots are exact).
    """
    acc = tl.float64 if dtype == torch.float64 else tl.float32
    if dtype == torch.float64:
        return acc, "ieee"
    return acc, fp32_dot_precision(head_dim, forward_pass) if dtype == torch.float32 else "tf32"


class ForwardLaunch:
    """The forward kernel's launch for one call signature: dtypes, constexprs, launch config and grid,
    worked out once (the library's launch plans keep one per signature, :mod:`course_lib.kernels.plan`).

    Args:
        q: ``(B, H, N_q, d)``; k, v: ``(B, H, N_k, d)``: their shapes, strides and dtype are the
            signature; every call must match them.
        causal, blocks: as :func:`attention_forward`.
        cache: launch later calls by the compiled kernel's handle (:class:`~course_lib.kernels.launch.CachedLaunch`).
    """

    def __init__(self, q, k, v, causal: bool, blocks: tuning.Blocks | None = None, cache: bool = False):
        interpreted = _rt.interpreted
        self.dtype, self.work, self.device, self.cache = q.dtype, compute_dtype(q.dtype, interpreted), q.device, cache
        batch, heads, n_q, d = q.shape
        n_k = k.shape[2]
        self.o_shape, self.lse_shape = (batch, heads, n_q, d), (batch, heads, n_q)
        self.lse_dtype = torch.float64 if self.work == torch.float64 else torch.float32
        head_dim = padded_head_dim(d)
        acc_dtype, precision = kernel_dtypes(self.work, head_dim, forward_pass=True)
        self.meta = dict(HEAD_DIM_REAL=d, HEAD_DIM=head_dim, CAUSAL=bool(causal), ACC_DTYPE=acc_dtype,
                         DOT_PRECISION=precision, ORDER=tuning.causal_order() if causal else 0)
        self.sizes = (heads, n_q, n_k)
        self.n_programs = lambda block_m: triton.cdiv(n_q, block_m) * batch * heads
        if blocks is None and interpreted:
            blocks = tuning.INTERPRETER_FORWARD
        self.blocks, self.candidates = blocks, None
        if blocks is None and not tuning.autotune_enabled():  # the measured table, fitted to this GPU
            self.candidates = tuning.gpu_candidates("forward", head_dim, self.work.itemsize, seq_len=max(n_q, n_k),
                                                    causal=causal)
        self.launch = None  # made at the first call: fitting the table's config needs real arguments
        self.tail = None  # the strides and sizes the kernel takes, kept at the first call (cache=True)

    def __call__(self, q, k, v, scale: float):
        """``(o, lse)`` of :func:`attention_forward` for inputs of this signature."""
        qw, kw, vw = (q, k, v) if self.work == self.dtype else (x.to(self.work) for x in (q, k, v))
        o = torch.empty(self.o_shape, dtype=self.work, device=self.device)
        lse = torch.empty(self.lse_shape, device=self.device, dtype=self.lse_dtype)
        tail = self.tail
        if tail is None:  # the strides are part of the call signature: kept for later calls (cache=True)
            tail = (*qw.stride(), *kw.stride(), *vw.stride(), *o.stride(), *self.sizes)
            self.tail = tail if self.cache else None
        args = (qw, kw, vw, o, lse, *tail, scale * LOG2_E_FLOAT)
        (self.launch or self._make_launch(args))(*args)
        return (o if self.work == self.dtype else o.to(self.dtype)), lse

    def _make_launch(self, args) -> CachedLaunch:
        blocks = self.blocks
        if blocks is None and self.candidates is not None:
            blocks = fit.choose(attention_forward_kernel, self.candidates, args, self.meta)
        if blocks is not None:
            meta = dict(self.meta, BLOCK_M=blocks.block_m, BLOCK_N=blocks.block_n, num_warps=blocks.num_warps,
                        num_stages=blocks.num_stages)
            self.launch = CachedLaunch(attention_forward_kernel, (self.n_programs(blocks.block_m),), meta, self.cache)
        else:
            self.launch = CachedLaunch(attention_forward_kernel_tuned,
                                       lambda cfg: (self.n_programs(cfg["BLOCK_M"]),), self.meta)
        return self.launch


def attention_forward(q, k, v, causal: bool, scale: float, blocks: tuning.Blocks | None = None):
    """Run the forward kernel on ``(B, H, N, d)`` views.

    Args:
        q: ``(B, H, N_q, d)``; k, v: ``(B, H, N_k, d)``, any strides, same dtype and device.
        causal: top-left aligned causal mask (key j visible to query i when j <= i).
        scale: the score scale (1/sqrt(d) by default, chosen by the caller).
        blocks: force one launch config (tests, tuning); None = interpreter default / the measured GPU table (autotune with COURSE_LIB_AUTOTUNE=1).

    Returns:
        ``(o, lse)``: ``o`` ``(B, H, N_q, d)`` contiguous in q's dtype; ``lse`` ``(B, H, N_q)``
        float32 (float64 for float64 inputs), natural log.
    """
    return ForwardLaunch(q, k, v, causal, blocks)(q, k, v, scale)

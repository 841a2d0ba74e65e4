"""FlashAttention-3 ideas on Hopper, in Triton (chapter 09).

This is chapter 06's forward kernel (:mod:`course_lib.kernels.forward`) with the K/V tiles
brought in by **tensor descriptors** instead of pointer arithmetic:

    desc_k = TensorDescriptor(k, shape=[B, H, N_k, d], strides=k.stride(), block_shape=[1, 1, BLOCK_N, HEAD_DIM])
    k = desc_k.load([b, h, start_n, 0])        # one (BLOCK_N, HEAD_DIM) tile

On Hopper (sm_90) Triton lowers a descriptor load to the **Tensor Memory Accelerator** (TMA): one
thread hands the copy engine a tile's coordinates, the tile lands in shared memory
asynchronously, and the warps that would have computed addresses and issued loads compute
instead. The descriptor knows the tensor's shape, so rows past ``N`` and head-dim columns past
``d`` read as zeros and a store clips them: no masks for the ragged end or the padded head dim.

Knobs the chapter's ablation turns one at a time (all constexpr, all in this one kernel):

- ``TWO_STAGE``: the off-band loop without masks, then the on-band (diagonal / ragged) loop with
  them (chapter 06's split), or one masked loop over every tile;
- ``WARP_SPECIALIZE``: ask Triton to split the K/V loop into a producer warp that issues the
  TMA copies and consumer warps that do the matmuls and softmax (``tl.range(...,
  warp_specialize=True)``), FA3's producer/consumer split;
- the launch's ``num_stages``: how many K/V tiles are in flight (software pipelining depth);
- ``FP8``: q, k, v in e4m3 (``torch.float8_e4m3fn``) with per-(batch, head) scales, V stored
  transposed (Hopper's fp8 tensor-core instruction wants both operands K-major), P cast to e4m3
  for the second matmul, as FA3 does. The host side (:func:`fp8_attention_forward`) quantizes,
  after an optional random Hadamard rotation of q and k (:mod:`course_lib.attention.fp8`).

Exercise 9.3's answer, :func:`scores_kernel` (one tile of ``S = scale · Q Kᵀ`` with Q and K
tiles loaded by ``tl.make_tensor_descriptor``, the device-side descriptor) and its launcher live
here too; :mod:`course_lib.teaching.exercises.ch09` keeps the check's cases and mistakes.

The interpreter runs all of it on CPU (descriptors and fp8 dots included), so the tests check the
same kernel there; the speed only exists on a Hopper GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from course_lib.platform import runtime
from course_lib.kernels import tiles, tuning
from course_lib.kernels.forward import LOG2_E_FLOAT, compute_dtype, kernel_dtypes, padded_head_dim
from course_lib.kernels.launch import CachedLaunch, rebased
from course_lib.kernels.tiles import LN_2, MASK_VALUE
from course_lib.attention.reference import default_scale

_rt = runtime.ensure_configured()  # interpreter or GPU: decided before the first @triton.jit

# TMA's rules for a tensor it copies from (CUDA driver API, cuTensorMapEncodeTiled): the base
# address and every stride but the last are multiples of 16 bytes, and the last stride is 1.
TMA_ALIGN_BYTES = 16


@triton.jit
def _tma_kv_tiles(acc, l_i, m_i, q, desc_k, desc_v, b, h, offs_m, n_k, kv_start, kv_end, qk_scale_log2,
                  MASKED: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                  ACC_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
                  V_TRANSPOSED: tl.constexpr):
    """Fold key/value tiles [kv_start, kv_end) into (m_i, l_i, acc), loading them by descriptor."""
    offs_n = tl.arange(0, BLOCK_N)
    for start_n in tl.range(kv_start, kv_end, BLOCK_N, warp_specialize=WARP_SPECIALIZE):
        k = desc_k.load([b, h, start_n, 0]).reshape(BLOCK_N, HEAD_DIM)  # rows >= n_k read as 0
        s = tiles.scores_log2(q, k, qk_scale_log2, ACC_DTYPE=ACC_DTYPE, DOT_PRECISION=DOT_PRECISION)
        if MASKED:  # (BLOCK_M, BLOCK_N): zero-filled keys past n_k and keys right of the diagonal
            s = tl.where(tiles.visible(offs_m, start_n + offs_n, n_k, CAUSAL=CAUSAL), s, MASK_VALUE)
        m_new, p, alpha, l_i = tiles.softmax_update(s, m_i, l_i)
        if V_TRANSPOSED:  # V stored (B, H, d, N): load (HEAD_DIM, BLOCK_N), use its transpose
            v = tl.trans(desc_v.load([b, h, 0, start_n]).reshape(HEAD_DIM, BLOCK_N))
        else:
            v = desc_v.load([b, h, start_n, 0]).reshape(BLOCK_N, HEAD_DIM)
        acc = tiles.accumulate(acc, alpha, p, v, ACC_DTYPE=ACC_DTYPE, DOT_PRECISION=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def attention_forward_tma_kernel(
        desc_q, desc_k, desc_v, desc_o, LSE,  # descriptors of (B, H, N, d) tensors; LSE (B, H, N_q)
        QK_SCALE, V_SCALE,  # (B·H,) float32 dequantization scales (FP8 only; unused otherwise)
        n_heads, n_q, n_k, qk_scale_log2,
        HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, ACC_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TWO_STAGE: tl.constexpr,
        WARP_SPECIALIZE: tl.constexpr, FP8: tl.constexpr, ORDER: tl.constexpr = 0):
    """One program: one BLOCK_M tile of queries of one (batch, head); grid as chapter 06's kernel."""
    pid_bh, b, h, start_m = tiles.program_tile_ordered(n_q, n_heads, BLOCK=BLOCK_M, ORDER=ORDER)
    offs_m = start_m + tl.arange(0, BLOCK_M)  # (BLOCK_M,) query rows of this program
    q = desc_q.load([b, h, start_m, 0]).reshape(BLOCK_M, HEAD_DIM)  # rows >= n_q, cols >= d: 0
    if FP8:  # scores of e4m3 q and k, times their scales: the dequantization folds into one multiply
        qk_scale_log2 = qk_scale_log2 * tl.load(QK_SCALE + pid_bh)

    m_i = tl.full([BLOCK_M], MASK_VALUE, dtype=ACC_DTYPE)  # running max
    l_i = tl.zeros([BLOCK_M], dtype=ACC_DTYPE)  # running sum of exponentials
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=ACC_DTYPE)  # running sum of exponentials · v

    full_end, kv_end = tiles.kv_split(start_m, n_k, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, CAUSAL=CAUSAL)
    if not TWO_STAGE:  # one loop, every tile masked (the ablation's "before")
        full_end = 0
    acc, l_i, m_i = _tma_kv_tiles(acc, l_i, m_i, q, desc_k, desc_v, b, h, offs_m, n_k, 0, full_end,
                                  qk_scale_log2, MASKED=False, CAUSAL=CAUSAL, BLOCK_N=BLOCK_N,
                                  HEAD_DIM=HEAD_DIM, ACC_DTYPE=ACC_DTYPE, DOT_PRECISION=DOT_PRECISION,
                                  WARP_SPECIALIZE=WARP_SPECIALIZE, V_TRANSPOSED=FP8)
    acc, l_i, m_i = _tma_kv_tiles(acc, l_i, m_i, q, desc_k, desc_v, b, h, offs_m, n_k, full_end, kv_end,
                                  qk_scale_log2, MASKED=True, CAUSAL=CAUSAL, BLOCK_N=BLOCK_N,
                                  HEAD_DIM=HEAD_DIM, ACC_DTYPE=ACC_DTYPE, DOT_PRECISION=DOT_PRECISION,
                                  WARP_SPECIALIZE=WARP_SPECIALIZE, V_TRANSPOSED=FP8)

    o = acc / l_i[:, None]  # (BLOCK_M, HEAD_DIM)
    if FP8:
        o = o * tl.load(V_SCALE + pid_bh)
    lse = (m_i + tl.math.log2(l_i)) * LN_2  # (BLOCK_M,) natural-log log-sum-exp
    desc_o.store([b, h, start_m, 0], o.to(desc_o.dtype).reshape(1, 1, BLOCK_M, HEAD_DIM))  # clipped
    tl.store(LSE + pid_bh * n_q + offs_m, lse, mask=offs_m < n_q)


# ----------------------------------------------------------------------------------------------
# Host side


def tma_unsupported_reason(*tensors: torch.Tensor) -> str | None:
    """Why the descriptor kernel cannot take these ``(B, H, N, d)`` tensors, or None if it can.

    Needs: the interpreter or a GPU of compute capability >= 9 (Hopper); last stride 1; base
    address and other strides multiples of 16 bytes (TMA's rules).
    """
    for x in tensors:
        if x.device.type == "cuda" and torch.cuda.get_device_capability(x.device)[0] < 9:
            return "tensor descriptors (TMA) need a Hopper GPU (compute capability 9.0) or newer"
        if x.device.type != "cuda" and not _rt.interpreted:
            return "a CPU tensor needs the Triton interpreter (runtime.setup() on a CPU machine)"
        if x.stride(-1) != 1:
            return "the head dim must be contiguous (last stride 1)"
        size = x.element_size()
        if x.data_ptr() % TMA_ALIGN_BYTES or any((s * size) % TMA_ALIGN_BYTES for s in x.stride()[:-1]):
            return f"base address and strides must be multiples of {TMA_ALIGN_BYTES} bytes"
    return None


def library_uses_tma(q, k, v) -> bool:
    """Whether :func:`course_lib.flash_attention` takes the descriptor kernel for these inputs:
    on a Hopper GPU (compute capability 9.x; newer chips are untested and keep the pointer kernel),
    fp16/bf16, padded head dim in :data:`~course_lib.kernels.tuning.TMA_HEAD_DIMS`, descriptor
    rules met, no autotuning asked for, and ``COURSE_LIB_TMA`` not set to 0."""
    if _rt.interpreted or q.device.type != "cuda" or not tuning.tma_enabled() or tuning.autotune_enabled():
        return False
    return (torch.cuda.get_device_capability(q.device)[0] == 9 and q.dtype in (torch.float16, torch.bfloat16)
            and padded_head_dim(q.shape[-1]) in tuning.TMA_HEAD_DIMS and tma_unsupported_reason(q, k, v) is None)


def _descriptor(x: torch.Tensor, block_rows: int, head_dim: int, transposed: bool = False):
    """A host-side descriptor of the ``(B, H, N, d)`` tensor ``x`` (``(B, H, d, N)`` when
    ``transposed``) whose block is one tile: ``[1, 1, block_rows, head_dim]`` (or its transpose)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    block = [1, 1, head_dim, block_rows] if transposed else [1, 1, block_rows, head_dim]
    return TensorDescriptor(x, shape=list(x.shape), strides=list(x.stride()), block_shape=block)


def default_blocks(head_dim: int, element_size: int, seq_len: int, causal: bool) -> tuning.Blocks:
    """The launch config: the interpreter's; on the GPU the measured TMA table at HEAD_DIM=128
    (fp16/bf16), chapter 06's table otherwise."""
    if _rt.interpreted:
        return tuning.INTERPRETER_FORWARD
    if head_dim in tuning.TMA_HEAD_DIMS and element_size <= 2:
        return tuning.hopper_forward(seq_len, causal)
    return tuning.gpu_default("forward", head_dim, max(element_size, 2), seq_len=seq_len, causal=causal)


class _KernelLaunch:
    """The descriptor kernel's launch for one call signature (shapes, strides, dtypes, alignment of
    q, k, v, o): grid, constexprs and descriptor blocks worked out once; with ``cache``, later
    calls copy the first call's checked descriptors onto their tensors and launch by the compiled
    kernel's handle (:mod:`course_lib.kernels.launch`)."""

    def __init__(self, q, k, causal, acc_dtype, precision, blocks: tuning.Blocks, two_stage: bool,
                 warp_specialize: bool, fp8: bool, cache: bool = False):
        batch, heads, n_q, _ = q.shape
        n_k = k.shape[2]  # fp8: k8 is not padded; the transposed V may be (its extra keys are masked)
        self.head_dim = padded_head_dim(q.shape[-1])
        self.rows = (blocks.block_m, blocks.block_n, blocks.block_n, blocks.block_m)  # of q, k, v, o tiles
        self.fp8, self.sizes, self.templates = fp8, (heads, n_q, n_k), None
        meta = dict(HEAD_DIM=self.head_dim, CAUSAL=bool(causal), ACC_DTYPE=acc_dtype, DOT_PRECISION=precision,
                    BLOCK_M=blocks.block_m, BLOCK_N=blocks.block_n, TWO_STAGE=two_stage,
                    WARP_SPECIALIZE=warp_specialize, FP8=fp8, ORDER=tuning.causal_order() if causal else 0,
                    num_warps=blocks.num_warps, num_stages=blocks.num_stages)
        self.launch = CachedLaunch(attention_forward_tma_kernel, (triton.cdiv(n_q, blocks.block_m) * batch * heads,),
                                   meta, cache)

    def __call__(self, q, k, v, o, lse, qk_scale, v_scale, qk_scale_log2):
        tensors = (q, k, v, o)
        if self.templates is None:
            descs = [_descriptor(x, rows, self.head_dim, transposed=self.fp8 and i == 2)  # i == 2: v
                     for i, (x, rows) in enumerate(zip(tensors, self.rows))]
            if self.launch.cache:
                self.templates = descs
        else:
            descs = [rebased(t, x) for t, x in zip(self.templates, tensors)]
        self.launch(*descs, lse, qk_scale, v_scale, *self.sizes, qk_scale_log2)


class TmaForwardLaunch:
    """:func:`attention_forward_tma` for one call signature: the descriptor rules checked, dtypes and
    launch config worked out once (the library's launch plans keep one per signature,
    :mod:`course_lib.kernels.plan`).

    Args:
        q, k, v, causal, blocks, two_stage, warp_specialize: as :func:`attention_forward_tma`.
        cache: launch later calls by the compiled kernel's handle, with the first call's descriptors.

    Raises:
        ValueError naming the tensor if it breaks the descriptor rules.
    """

    def __init__(self, q, k, v, causal: bool, blocks: tuning.Blocks | None = None, two_stage: bool = True,
                 warp_specialize: bool = False, cache: bool = False):
        for name, x in (("q", q), ("k", k), ("v", v)):
            why = tma_unsupported_reason(x)
            if why:
                raise ValueError(f"attention_forward_tma: {name} cannot be read by a tensor descriptor: {why}")
        self.dtype, self.work, self.device = q.dtype, compute_dtype(q.dtype, _rt.interpreted), q.device
        batch, heads, n_q, d = q.shape
        self.o_shape, self.lse_shape = (batch, heads, n_q, d), (batch, heads, n_q)
        self.lse_dtype = torch.float64 if self.work == torch.float64 else torch.float32
        acc_dtype, precision = kernel_dtypes(self.work, padded_head_dim(d))
        if blocks is None:
            blocks = default_blocks(padded_head_dim(d), self.work.itemsize, max(n_q, k.shape[2]), causal)
        self.kernel = _KernelLaunch(q, k, causal, acc_dtype, precision, blocks, two_stage, warp_specialize,
                                    fp8=False, cache=cache)

    def __call__(self, q, k, v, scale: float):
        qw, kw, vw = (q, k, v) if self.work == self.dtype else (x.to(self.work) for x in (q, k, v))
        o = torch.empty(self.o_shape, dtype=self.work, device=self.device)
        lse = torch.empty(self.lse_shape, device=self.device, dtype=self.lse_dtype)
        self.kernel(qw, kw, vw, o, lse, lse, lse, scale * LOG2_E_FLOAT)
        return (o if self.work == self.dtype else o.to(self.dtype)), lse


def attention_forward_tma(q, k, v, causal: bool, scale: float, blocks: tuning.Blocks | None = None,
                          two_stage: bool = True, warp_specialize: bool = False):
    """Chapter 06's forward with descriptor (TMA) loads; same contract as
    :func:`course_lib.kernels.forward.attention_forward`.

    Args:
        q: ``(B, H, N_q, d)``; k, v: ``(B, H, N_k, d)``; strides as :func:`tma_unsupported_reason` allows.
        causal, scale: as the library forward. blocks: launch config (None: :func:`default_blocks`).
        two_stage: unmasked off-band loop, then masked on-band loop (False: every tile masked).
        warp_specialize: producer/consumer warps for the K/V loop (GPU support varies by Triton
            version and chip; the interpreter ignores it).

    Returns:
        ``(o, lse)`` as the library forward.

    Raises:
        ValueError naming the tensor if it breaks the descriptor rules.
    """
    return TmaForwardLaunch(q, k, v, causal, blocks, two_stage, warp_specialize)(q, k, v, scale)


# ----------------------------------------------------------------------------------------------
# FP8


def _pad_rows(x: torch.Tensor, multiple: int) -> torch.Tensor:
    """``x`` ``(B, H, N, d)`` with N padded by zero rows to a multiple of ``multiple``."""
    extra = -x.shape[2] % multiple
    return torch.nn.functional.pad(x, (0, 0, 0, extra)) if extra else x


def quantize_fp8(q, k, v, rotate: bool = True, seed: int = 0):
    """q, k, v ``(B, H, N, d)`` -> e4m3 copies the FP8 kernel reads, and their scales.

    q and k are rotated by the same random Hadamard matrix first when ``rotate`` (FA3's
    "incoherent processing": ``(qR)(kR)ᵀ = qkᵀ``, outliers spread over the head dim). Each
    (batch, head) gets one scale ``amax / E4M3_MAX``. V is stored transposed, ``(B, H, d, N_k)``,
    with N_k padded to a multiple of 16 so that its rows meet TMA's 16-byte rule.

    Returns ``(q8, k8, vt8, qk_scale, v_scale)``; the scales are ``(B·H,)`` float32.
    """
    from course_lib.attention import fp8

    if rotate:
        r = fp8.random_rotation(q.shape[-1], seed).to(device=q.device, dtype=torch.float32)  # (d, d)
        q, k = (x.float() @ r for x in (q, k))
    (q8, sq), (k8, sk), (v8, sv) = (fp8.quantize_e4m3(x.float()) for x in (q, k, v))
    vt8 = _pad_rows(v8.float(), TMA_ALIGN_BYTES).to(torch.float8_e4m3fn).transpose(2, 3).contiguous()
    qk_scale = (sq * sk).reshape(-1).float().contiguous()
    return q8.contiguous(), k8.contiguous(), vt8, qk_scale, sv.reshape(-1).float().contiguous()


def fp8_attention_forward(q, k, v, causal: bool = False, scale: float | None = None, rotate: bool = True,
                          seed: int = 0, blocks: tuning.Blocks | None = None, quantized=None):
    """Attention with e4m3 q, k, v and P on the tensor cores; output in q's dtype.

    Args:
        q: ``(B, H, N_q, d)``; k, v: ``(B, H, N_k, d)``, fp16/bf16/fp32, d a multiple of 16.
        causal, scale: as :func:`course_lib.flash_attention`. rotate, seed: see :func:`quantize_fp8`.
        blocks: launch config (None: the fp16 table's). quantized: the output of
            :func:`quantize_fp8` when the caller already has it (timing the kernel alone).

    Returns:
        ``(o, lse)`` as the library forward.
    """
    d = q.shape[-1]
    if d % 16:
        raise ValueError(f"fp8_attention_forward: the head dim d must be a multiple of 16, got q.shape={tuple(q.shape)}")
    scale = d ** -0.5 if scale is None else scale
    q8, k8, vt8, qk_scale, v_scale = quantized if quantized is not None else quantize_fp8(q, k, v, rotate, seed)
    batch, heads, n_q, _ = q.shape
    o = torch.empty((batch, heads, n_q, d), dtype=compute_dtype(q.dtype, _rt.interpreted), device=q.device)
    lse = torch.empty((batch, heads, n_q), dtype=torch.float32, device=q.device)
    if blocks is None:
        blocks = default_blocks(padded_head_dim(d), 2, max(n_q, k.shape[2]), causal)
    _KernelLaunch(q8, k8, causal, tl.float32, "tf32", blocks, True, False, fp8=True)(
        q8, k8, vt8, o, lse, qk_scale, v_scale, scale * LOG2_E_FLOAT)
    return o.to(q.dtype), lse



# ----------------------------------------------------------------------------------------------
# Exercise 9.3's kernel: one tile of scores, its Q and K tiles loaded through tensor descriptors


# Triton allocates a device-side descriptor in global memory (128 bytes, 128-byte aligned: the
# CUDA driver's CUtensorMap); torch's CUDA allocator returns blocks aligned to at least 256 bytes.
def _descriptor_scratch(size: int, alignment: int, stream):
    return torch.empty(size, dtype=torch.int8, device="cuda")


def ensure_descriptor_allocator() -> None:
    """Give Triton the allocator that ``tl.make_tensor_descriptor`` needs on a GPU (the
    interpreter needs none). Call it before each launch, not once: Triton keeps the allocator in
    a ``ContextVar``, and Jupyter kernels have run cells in separate contexts (ipykernel 7.0
    lost ContextVar values between cells; fixed in 7.1, and still lost after an ``await``)."""
    if runtime.current().on_gpu:
        triton.set_allocator(_descriptor_scratch)


# The tile of exercise 9.3's launches: 16 is the smallest tl.dot tile; BLOCK_N ≠ BLOCK_M so that
# a mix-up of the two shows.
SCORES_BLOCK_M = 16
SCORES_BLOCK_N = 32


@triton.jit
def scores_kernel(Q, K, S, n_q, n_k, stride_qm, stride_kn, stride_sm, scale,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  HEAD_DIM: tl.constexpr, HEAD_DIM_REAL: tl.constexpr):
    """One ``(BLOCK_M, BLOCK_N)`` tile of ``S = scale · Q Kᵀ`` (exercise 9.3); grid
    ``(cdiv(n_q, BLOCK_M), cdiv(n_k, BLOCK_N))``. Q ``(n_q, d)``, K ``(n_k, d)`` with unit column
    stride; S float32.

    Reads ``(BLOCK_M + BLOCK_N) · d`` elements, writes ``BLOCK_M · BLOCK_N``.
    """
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    # The descriptor knows the real shape: rows >= n and columns >= d of a tile read as 0.
    q_desc = tl.make_tensor_descriptor(Q, shape=[n_q, HEAD_DIM_REAL], strides=[stride_qm, 1],
                                       block_shape=[BLOCK_M, HEAD_DIM])
    k_desc = tl.make_tensor_descriptor(K, shape=[n_k, HEAD_DIM_REAL], strides=[stride_kn, 1],
                                       block_shape=[BLOCK_N, HEAD_DIM])
    q = q_desc.load([pid_m * BLOCK_M, 0])  # (BLOCK_M, HEAD_DIM): offsets are in rows, not tiles
    k = k_desc.load([pid_n * BLOCK_N, 0])  # (BLOCK_N, HEAD_DIM)
    s = tl.dot(q, tl.trans(k)) * scale  # (BLOCK_M, BLOCK_N) float32
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # S's rows (n_k float32) need not meet TMA's 16-byte rule: a pointer store, masked.
    tl.store(S + rows[:, None] * stride_sm + cols[None, :], s,
             mask=(rows[:, None] < n_q) & (cols[None, :] < n_k))


def launch_scores(kernel, q, k, s, scale=None, block_m: int = SCORES_BLOCK_M,
                  block_n: int = SCORES_BLOCK_N) -> None:
    """Launch ``kernel`` (:func:`scores_kernel` or a learner's with its signature) into ``s``.

    Args:
        q: ``(n_q, d)``; k: ``(n_k, d)``, fp16, last stride 1, row strides multiples of 16 bytes.
        s: ``(n_q, n_k)`` float32 output, last stride 1. scale: default ``1/sqrt(d)``.
        block_m, block_n: the tile.
    """
    n_q, d = q.shape
    n_k = k.shape[0]
    scale = default_scale(d) if scale is None else scale
    ensure_descriptor_allocator()
    grid = (triton.cdiv(n_q, block_m), triton.cdiv(n_k, block_n))
    kernel[grid](q, k, s, n_q, n_k, q.stride(0), k.stride(0), s.stride(0), scale,
                 BLOCK_M=block_m, BLOCK_N=block_n, HEAD_DIM=padded_head_dim(d), HEAD_DIM_REAL=d)


__all__ = ["attention_forward_tma", "fp8_attention_forward", "quantize_fp8", "tma_unsupported_reason",
           "TMA_ALIGN_BYTES", "scores_kernel", "launch_scores", "ensure_descriptor_allocator",
           "SCORES_BLOCK_M", "SCORES_BLOCK_N"]

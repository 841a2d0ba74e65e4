"""A FlashAttention forward for Hopper written in Gluon (chapter 09, last section).

Triton decides for us where each tile lives, how the warps share the work and when to wait for
the tensor cores. Gluon (``triton.experimental.gluon``) is Triton's lower level: the same
Python-like language, but *we* choose every layout (which thread holds which element), allocate
shared memory, issue the TMA copies, arm the barriers that say "this copy has landed", and decide
when to wait for an asynchronous matrix product. That is what FlashAttention-3 does in CUDA, and
what this file does in Python, one decision at a time.

The kernel is the forward of :mod:`course_lib.kernels.hopper` (same inputs, same ``(o, lse)``),
in four variants that build on one another, chosen by :data:`VARIANTS`:

- ``"tma"`` (design a): K/V tiles arrive by TMA into a ring of ``STAGES`` shared-memory slots,
  each slot with an mbarrier; Q is copied once; ``S = Q Kᵀ`` and ``O += P V`` run on the tensor
  cores with ``warpgroup_mma`` (Hopper's ``wgmma``), P straight from registers; softmax in exp2
  with the scale folded in; masks only on the tiles that need them (the diagonal band and the
  ragged end come last, so the other tiles skip the mask).
- ``"overlap"`` (design b, FA3's intra-warpgroup overlap): the product ``S_{j+1} = Q K_{j+1}ᵀ`` is
  issued *before* the softmax of tile j and waited for after it, so the tensor cores work while
  the warps compute exponentials (``wgmma.wait_group 1`` in the PTX: wait until at most one
  product is still running).
- ``"ws"`` (design c): ``gl.warp_specialize`` splits the program into a 1-warp producer that
  only issues TMA copies (with few registers: ``setmaxnreg`` in the PTX) and the two consumer
  warpgroups (8 warps, 64 query rows each) that do the matmuls and the softmax with the overlap
  of design b. The producer waits on "slot empty" barriers, the consumers on "slot full" ones.
  (In every design K and V have rings and barriers of their own, as in FA3: K_t's slot is refilled
  as soon as S_t is computed, V_t's once P_t V_t is.)
- ``"pingpong"`` (design d, FA3's inter-warpgroup overlap): the two consumer warpgroups become two
  partitions of 4 warps, each with its own 64 query rows, taking turns through two more
  mbarriers: warpgroup 0 issues its products, hands the turn to warpgroup 1 and does its softmax
  while warpgroup 1's products run, and so on, so that one's exponentials hide under the other's
  matmuls. Each writes its half of O.

Two tricks of FlashAttention-4 (issue 35) are switches of every variant, off by default until the
H100 measures them (``tools/gluon_ablation.py``): **conditional rescaling** (``rescale_tau``: a row's
running max moves only when a tile's max exceeds it by more than tau, and the accumulator is
rescaled only when some row of the warpgroup moved, behind a branch all its threads take alike)
and **software exp2** (``exp2_emulated``: part of P's exponentials computed on the FMA units by
range reduction and a polynomial, :mod:`course_lib.attention.fp_emulation`, to unload the special-function
unit). :func:`kernel_facts` finds both in the PTX.

Not covered (the launcher raises ValueError): head dims other than 64 and 128, dtypes other than
fp16/bf16, ``N_q != N_k``, tensors TMA cannot read (see :func:`gluon_unsupported_reason`).
Which variant is fastest is for the H100 to say (``tools/gluon_forward.py``).

Gluon is experimental and its names moved between Triton 3.6 and 3.9: the ones that moved come from
:mod:`course_lib.kernels.compat`, and everything below compiles under each
(``tests/test_gluon_hopper.py`` cross-compiles each variant for sm_90 without a GPU).
"""

from __future__ import annotations

import contextlib
import re
import struct
from numbers import Integral, Real

import torch
import triton

from course_lib import constants
from course_lib.attention import fp_emulation
from course_lib.kernels import compat
from course_lib.kernels.launch import CachedLaunch, rebased

try:  # Gluon is experimental: a Triton without it keeps the rest of the library working
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                                  warpgroup_mma, warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    if compat.API_ERROR:  # a name the kernels use moved in a way compat.SPELLINGS does not know
        raise ImportError(compat.API_ERROR)
    from course_lib.kernels.compat import tma_load, tma_store  # their spelling depends on the Triton version
    GLUON_IMPORT_ERROR = None
except ImportError as err:  # pragma: no cover - depends on the installed Triton
    GLUON_IMPORT_ERROR = f"triton {triton.__version__} has no usable gluon: {err}"

# The variants, in the order the chapter builds them (designs a, b, c, d of the section).
VARIANTS = ("tma", "overlap", "ws", "pingpong")
HEAD_DIMS = (64, 128)
DTYPES = (torch.float16, torch.bfloat16)
TMA_ALIGN_BYTES = 16
LOG2_E = constants.LOG2_E  # the host folds it into the score scale: exp(x) = exp2(x · log2 e)

# FlashAttention-4's two tricks (issue 35), each a constexpr of the kernel, off by default until
# the H100 measures them (tools/gluon_ablation.py):
# - conditional rescaling: a row's running max moves only when a tile's max exceeds it by more
#   than RESCALE_TAU (log2 units), so p = exp2(s - m) can reach 2^RESCALE_TAU; the O accumulator
#   and l are rescaled only when some row of the partition moved. MAX_RESCALE_TAU = 8: p <= 256,
#   far below fp16's largest value (65504; bf16's is 3e38), so P converts to the input dtype for
#   the P·V product without overflow. 0 = always rescale (the kernel as it was).
# - software exp2: of every EXP2_PACK exponentials of P (one inline-asm block), EXP2_EMULATED run
#   on the FMA units (course_lib.attention.fp_emulation's recipe and constants, polynomial of degree
#   EXP2_DEGREE) and the rest on the special-function unit (ex2.approx). 0 = gl.exp2 everywhere.
MAX_RESCALE_TAU = 8.0
RESCALE_TAU = 0.0
EXP2_PACK = 4
EXP2_EMULATED = 0
EXP2_DEGREE = fp_emulation.EXP2_POLY_DEGREE


def available() -> bool:
    """Whether ``triton.experimental.gluon`` imported (it is experimental)."""
    return GLUON_IMPORT_ERROR is None


def config(variant: str, head_dim: int) -> dict:
    """The launch config of one variant: tiles, ring depth, warps, register budgets, Q block rows.

    BLOCK_M = 128 query rows = two warpgroups of 64 rows (a wgmma is issued by one warpgroup and
    covers 64 rows); BLOCK_N = 128 keys per tile; ring slots: 2 at d=128 (Q 32 KiB + 2 × (K 32 KiB
    + V 32 KiB) = 160 KiB of the 227 KiB an H100 block may use), 3 at d=64 (112 KiB).
    Ping-pong: 4 warps per partition, Q in two 64-row blocks. The two tricks of issue 35 start
    at their defaults (:data:`RESCALE_TAU`, :data:`EXP2_EMULATED`, :data:`EXP2_DEGREE`: off).
    """
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    pingpong = variant == "pingpong"
    return {"BLOCK_M": 128, "BLOCK_N": 128, "STAGES": 2 if head_dim == 128 else 3, "num_warps": 4 if pingpong else 8,
            "LOADER_REGS": 24, "CONSUMER_REGS": 240, "Q_ROWS": 64 if pingpong else 128,
            "RESCALE_TAU": RESCALE_TAU, "EXP2_EMULATED": EXP2_EMULATED, "EXP2_DEGREE": EXP2_DEGREE}


def _ptx_f32(value: float) -> str:
    """``value`` as a PTX single-precision immediate (``0f`` and its 8 hex digits); it must be a float32."""
    bits = struct.unpack("<I", struct.pack("<f", value))[0]
    if struct.unpack("<f", struct.pack("<I", bits))[0] != value:
        raise ValueError(f"{value!r} is not a float32 value")
    return f"0f{bits:08X}"


# fp_emulation's constants as PTX immediates, made once here: the constexpr function below may
# only read values (Triton hashes them into the kernel's cache key), not call Python functions.
_EXP2_PTX = {"clamp": _ptx_f32(fp_emulation.EXP2_CLAMP), "magic": _ptx_f32(fp_emulation.EXP2_FLOOR_MAGIC),
             "shift": fp_emulation.EXP2_EXPONENT_SHIFT,
             "polys": {deg: tuple(_ptx_f32(c) for c in poly) for deg, poly in fp_emulation.EXP2_POLYS.items()}}


@triton.constexpr_function
def _exp2_asm(emulated: int, pack: int, degree: int) -> str:
    """The PTX of one inline-asm block of ``pack`` exponentials 2^x (outputs ``$0..``, inputs
    ``$pack..``): the first ``emulated`` on the FMA units by :mod:`course_lib.attention.fp_emulation`'s range
    reduction and polynomial of ``degree``, the others by ``ex2.approx.ftz.f32`` (the MUFU)."""
    poly = _EXP2_PTX["polys"][degree]  # c0 ... c_deg
    magic = _EXP2_PTX["magic"]
    lines = ["{", ".reg .b32 e2x, e2n, e2f, e2p;"]
    for i in range(pack):
        out = "$" + str(i)
        x = "$" + str(pack + i)
        if i >= emulated:
            lines.append(f"ex2.approx.ftz.f32 {out}, {x};")
        else:
            lines += [f"max.f32 e2x, {x}, {_EXP2_PTX['clamp']};",  # -inf, NaN, x <= -127: 2^x = +0
                      f"add.rm.f32 e2n, e2x, {magic};",  # floor(x) in the low mantissa bits
                      f"sub.f32 e2f, e2n, {magic};",  # floor(x), exact
                      "sub.f32 e2f, e2x, e2f;",  # f = x - floor(x) in [0, 1), exact
                      f"fma.rn.f32 e2p, e2f, {poly[-1]}, {poly[-2]};"]  # Horner, highest degree first
            lines += [f"fma.rn.f32 e2p, e2p, e2f, {c};" for c in reversed(poly[:-2])]
            lines += [f"shl.b32 e2n, e2n, {_EXP2_PTX['shift']};",  # floor(x) << 23; the magic's bits drop out
                      f"add.s32 {out}, e2p, e2n;"]  # 2^f · 2^floor(x): floor(x) added to the exponent field
    return "\n".join(lines + ["}"])


@triton.constexpr_function
def _asm_constraints(pack: int) -> str:
    """LLVM constraints of an inline-asm block with ``pack`` 32-bit outputs and as many inputs."""
    return ",".join(["=r"] * pack + ["r"] * pack)


def switch_constexprs(rescale_tau=None, exp2_emulated=None, exp2_degree=None) -> dict:
    """The kernel's constexprs for issue 35's switches, checked.

    Args:
        rescale_tau, exp2_emulated, exp2_degree: as :func:`attention_forward_gluon` (None: the
            module's default, :data:`RESCALE_TAU`, :data:`EXP2_EMULATED`, :data:`EXP2_DEGREE`).

    Returns:
        ``{"RESCALE_TAU": float, "EXP2_EMULATED": int, "EXP2_DEGREE": int}``.

    Raises:
        TypeError / ValueError naming the argument that is not a number of the allowed range.
    """
    rescale_tau = RESCALE_TAU if rescale_tau is None else rescale_tau
    exp2_emulated = EXP2_EMULATED if exp2_emulated is None else exp2_emulated
    exp2_degree = EXP2_DEGREE if exp2_degree is None else exp2_degree
    if isinstance(rescale_tau, bool) or not isinstance(rescale_tau, Real):
        raise TypeError(f"rescale_tau must be a number (log2 units), got {type(rescale_tau).__name__}")
    if not 0 <= rescale_tau <= MAX_RESCALE_TAU:
        raise ValueError(f"rescale_tau must be in [0, {MAX_RESCALE_TAU}] (p = exp2(s - m) reaches 2^rescale_tau), "
                         f"got {rescale_tau}")
    for name, value in (("exp2_emulated", exp2_emulated), ("exp2_degree", exp2_degree)):
        if isinstance(value, bool) or not isinstance(value, Integral):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if not 0 <= exp2_emulated <= EXP2_PACK:
        raise ValueError(f"exp2_emulated must be from 0 to {EXP2_PACK} (exponentials of every {EXP2_PACK} "
                         f"computed on the FMA units), got {exp2_emulated}")
    if exp2_degree not in fp_emulation.EXP2_POLYS:
        raise ValueError(f"exp2_degree must be one of {sorted(fp_emulation.EXP2_POLYS)}, got {exp2_degree}")
    return {"RESCALE_TAU": float(rescale_tau), "EXP2_EMULATED": int(exp2_emulated), "EXP2_DEGREE": int(exp2_degree)}


if GLUON_IMPORT_ERROR is None:
    LN_2 = gl.constexpr(constants.LN_2)  # lse in natural log = log2-units value · ln 2
    _EXP2_PACK = gl.constexpr(EXP2_PACK)

    # ------------------------------------------------------------------------------------------
    # Gluon names where every value lives. A *distributed* layout says which thread holds which
    # element of a register tensor; a *shared* layout says how a tile is laid out (and swizzled)
    # in shared memory. The kernel itself is at the end of this block; the helpers come first.

    @gluon.jit
    def _tile_coords(n_heads, n_q, BLOCK_M: gl.constexpr):
        """(b, h, start_m) of this program: axis 0 walks the query tiles, axis 1 the (b, h) pairs."""
        start_m = gl.program_id(0) * BLOCK_M
        pid_bh = gl.program_id(1)
        return pid_bh // n_heads, pid_bh % n_heads, start_m, pid_bh

    # Row max and row sum with our own combine functions: gl.max and gl.sum wrap triton.language's
    # and break when the Triton interpreter was switched on before this module was imported (the
    # course's CPU setup does that), although Gluon kernels are never interpreted.
    @gluon.jit
    def _max_combine(a, b):
        return gl.maximum(a, b)

    @gluon.jit
    def _add_combine(a, b):
        return a + b

    @gluon.jit
    def _tile2d(ring, slot):
        """Slot ``slot`` of a ring ``(STAGES, 1, 1, rows, d)`` as the 2-D ``(rows, d)`` view wgmma reads."""
        tile = ring.index(slot)
        return tile.reshape([tile.shape[2], tile.shape[3]])

    @gluon.jit
    def _kv_tiles(start_m, n_k, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr):
        """(n_tiles, n_full): key tiles this program visits, and how many of the first ones need
        no mask (fully inside the keys and, when causal, fully left of the diagonal). The rest (the
        diagonal band, the ragged last tile) come after them and are masked."""
        if CAUSAL:
            kv_end = gl.minimum(start_m + BLOCK_M, n_k)
            n_full = gl.minimum((start_m + 1) // BLOCK_N, n_k // BLOCK_N)
        else:
            kv_end = n_k
            n_full = n_k // BLOCK_N
        return (kv_end + BLOCK_N - 1) // BLOCK_N, n_full

    @gluon.jit
    def _issue(desc, ring, bars, b, h, t, n_tiles, BAR0: gl.constexpr, BLOCK_N: gl.constexpr,
               STAGES: gl.constexpr):
        """Ask the TMA engine for key tile ``t`` of ``desc`` (K or V) into ring slot ``t % STAGES``.

        K and V have rings and barriers of their own (``bars[0:STAGES]`` for K, ``bars[STAGES:]``
        for V; ``BAR0`` says which half), as in FA3: K_t is needed first (for S_t) and its slot is
        free as soon as S_t is computed, V_t later (for O += P_t V_t), so each is copied as early as
        its slot allows. ``expect`` tells the barrier how many bytes will land; the barrier's phase
        flips once they all have. ``pred``: nothing is issued for a tile past the end."""
        slot = t % STAGES
        pred = t < n_tiles
        bar = bars.index(BAR0 + slot)
        mbarrier.expect(bar, desc.block_type.nbytes, pred)
        tma_load(desc, [b, h, t * BLOCK_N, 0], bar, ring.index(slot), pred=pred)

    @gluon.jit
    def _exp2(x, EXP2_EMULATED: gl.constexpr, EXP2_DEGREE: gl.constexpr):
        """2^x elementwise (fp32): the special-function unit's exp2, or with EXP2_EMULATED > 0
        that many of every _EXP2_PACK elements on the FMA units (FlashAttention-4's software exp2,
        :mod:`course_lib.attention.fp_emulation`) to share the load between the two units."""
        if EXP2_EMULATED == 0:
            y = gl.exp2(x)
        else:
            y = gl.inline_asm_elementwise(_exp2_asm(EXP2_EMULATED, _EXP2_PACK, EXP2_DEGREE),
                                          _asm_constraints(_EXP2_PACK), [x], gl.float32, True, _EXP2_PACK)
        return y

    @gluon.jit
    def _softmax_step(s, m_i, t, n_full, row0, n_k, qk_scale_log2, s_layout: gl.constexpr,
                      BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr,
                      RESCALE_TAU: gl.constexpr, EXP2_EMULATED: gl.constexpr, EXP2_DEGREE: gl.constexpr):
        """One online-softmax step on the raw scores ``s`` of key tile ``t`` (layout ``s_layout``).

        Returns (m_new, p, alpha, p_sum): the new running max (log2 units), the unnormalized
        probabilities, the factor that rescales what was accumulated before (:func:`_rescale`
        applies it to acc and l), the row sums of p.

        With RESCALE_TAU > 0 (conditional rescaling) a row's max moves only when the tile's max
        exceeds it by more than RESCALE_TAU: otherwise m stays, alpha is exactly 1, and p may reach
        2^RESCALE_TAU. Exact after the final division by l, and lse = (m + log2 l)·ln 2 holds for any
        m the row used."""
        s = s * qk_scale_log2  # scale · log2(e) folded into one multiply: exp2 below is exp
        if t >= n_full:  # the diagonal band or the ragged end: hide the keys a row must not see
            rows = row0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
            cols = t * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
            visible = cols[None, :] < n_k  # keys past N were read as zeros by TMA
            if CAUSAL:
                visible = visible & (cols[None, :] <= rows[:, None])
            s = gl.where(visible, s, float("-inf"))
        m_tile = gl.reduce(s, 1, _max_combine)  # every row sees key 0 in tile 0: m never stays -inf
        if RESCALE_TAU > 0:
            moved = m_tile > m_i + RESCALE_TAU  # always on the first tile (m_i = -inf)
            m_new = gl.where(moved, m_tile, m_i)
            alpha = gl.where(moved, gl.exp2(m_i - m_new), 1.0)  # exactly 1 where m stays
        else:
            m_new = gl.maximum(m_i, m_tile)
            alpha = gl.exp2(m_i - m_new)  # 0 on the first tile (m_i = -inf)
        p = _exp2(s - m_new[:, None], EXP2_EMULATED, EXP2_DEGREE)
        return m_new, p, alpha, gl.reduce(p, 1, _add_combine)

    @gluon.jit
    def _rescale(acc, l_i, alpha, row_o: gl.constexpr, RESCALE_TAU: gl.constexpr):
        """``(acc · alpha, l_i · alpha)``, each row by its own factor (``acc``'s rows in layout
        ``row_o``). With RESCALE_TAU > 0 only if the max of some row of this partition moved (alpha
        < 1 there, exactly 1 elsewhere): one flag reduced over all the partition's rows, so every
        thread takes the same branch and the skipped multiplies are not executed at all."""
        rescale = 1
        if RESCALE_TAU > 0:
            rescale = gl.reduce((alpha < 1.0).to(gl.int32), 0, _max_combine)
        if rescale > 0:
            acc = acc * gl.convert_layout(alpha, row_o)[:, None]
            l_i = l_i * alpha
        return acc, l_i

    @gluon.jit
    def _release(desc, ring, ready, empty, b, h, t, n_tiles, BAR0: gl.constexpr, BLOCK_N: gl.constexpr,
                 STAGES: gl.constexpr, LOADS_HERE: gl.constexpr):
        """No product reads tile ``t``'s slot of this ring any more. Designs a and b refill it at
        once with tile ``t + STAGES`` (the compiler puts a barrier of all the program's warps
        before the copy: both warpgroups must be done with the slot); designs c and d tell the
        producer by arriving on the slot's ``empty`` barrier."""
        if LOADS_HERE:
            _issue(desc, ring, ready, b, h, t + STAGES, n_tiles, BAR0, BLOCK_N, STAGES)
        else:
            mbarrier.arrive(empty.index(BAR0 + t % STAGES), count=1)

    @gluon.jit
    def _consumer(q_smem, k_ring, v_ring, ready, empty, q_bar, turn, k_desc, v_desc, b, h, tile_start, row0, n_k,
                  qk_scale_log2, TILE_M: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                  HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr, OVERLAP: gl.constexpr,
                  LOADS_HERE: gl.constexpr, PINGPONG: gl.constexpr, WG: gl.constexpr, RESCALE_TAU: gl.constexpr,
                  EXP2_EMULATED: gl.constexpr, EXP2_DEGREE: gl.constexpr, num_warps: gl.constexpr):
        """The matmuls and the softmax of BLOCK_M query rows (from ``row0``; ``q_smem`` holds them)
        over every key tile of the program's TILE_M-row tile (from ``tile_start``); returns
        (acc, m_i, l_i).

        ``LOADS_HERE``: these warps also issue the TMA copies (designs a and b); otherwise a
        producer partition does, and these warps tell it, by arriving on ``empty``, when a slot
        may be overwritten (designs c, d). ``PINGPONG`` (design d): this is consumer warpgroup
        ``WG`` of two; before issuing its products it waits for its turn on ``turn[WG]``, and once
        they are issued it hands the turn to the other (arrives on ``turn[1 - WG]``).
        ``RESCALE_TAU``, ``EXP2_EMULATED``, ``EXP2_DEGREE``: issue 35's switches
        (:func:`_softmax_step`, :func:`_rescale`)."""
        # The accumulator layouts of the two products. version=[3, 0] is Hopper's wgmma; the warps
        # are stacked along the rows ([num_warps, 1]: each warp owns 16 rows, so warps 0-3, the
        # first warpgroup, own rows 0-63 and warps 4-7 rows 64-127); instr_shape=[16, n, 16]: one
        # instruction makes a 16 × n block of the output with k = 16 (16-bit inputs).
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                           instr_shape=[16, BLOCK_N, 16])  # S: (BLOCK_M, BLOCK_N)
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                           instr_shape=[16, HEAD_DIM, 16])  # O: (BLOCK_M, d)
        # P is the *first* operand of O += P V and comes from registers: wgmma wants it in the
        # "dot operand" layout of O's product (k_width = 2 16-bit values per 32-bit register).
        # From S's accumulator layout this conversion moves no data between threads (FA3's trick).
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        row_s: gl.constexpr = gl.SliceLayout(1, s_layout)  # one value per query row
        row_o: gl.constexpr = gl.SliceLayout(1, o_layout)

        # Both ping-pong consumers visit the tiles of the whole TILE_M tile (the same number of
        # turns each: neither can wait for a turn the other never gives); the mask handles the rest.
        n_tiles, n_full = _kv_tiles(tile_start, n_k, TILE_M, BLOCK_N, CAUSAL)
        if LOADS_HERE:  # prologue: fill both rings (the copies run while we wait for Q)
            for i in gl.static_range(STAGES):
                _issue(k_desc, k_ring, ready, b, h, i, n_tiles, 0, BLOCK_N, STAGES)
                _issue(v_desc, v_ring, ready, b, h, i, n_tiles, STAGES, BLOCK_N, STAGES)
        mbarrier.wait(q_bar, 0)  # Q has landed (its barrier completes phase 0 once)

        m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=row_s)
        l_i = gl.zeros([BLOCK_M], gl.float32, layout=row_s)
        acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, layout=o_layout)
        s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)  # use_acc=False ignores it

        if OVERLAP:
            # Tile 0 alone: its S and softmax; its P V is issued in the loop's first iteration.
            mbarrier.wait(ready.index(0), 0)  # K_0 has landed
            if PINGPONG:  # turn 0: consumer 0 passes at once (phase 1 of a fresh barrier), 1 waits
                mbarrier.wait(turn.index(WG), 1 - WG)
            s_tok = warpgroup_mma(q_smem, _tile2d(k_ring, 0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            if PINGPONG:
                mbarrier.arrive(turn.index(1 - WG), count=1)
            s = warpgroup_mma_wait(0, deps=(s_tok,))
            _release(k_desc, k_ring, ready, empty, b, h, 0, n_tiles, 0, BLOCK_N, STAGES, LOADS_HERE)
            m_i, p, alpha, l_i = _softmax_step(s, m_i, 0, n_full, row0, n_k, qk_scale_log2, s_layout, BLOCK_M,
                                               BLOCK_N, CAUSAL, RESCALE_TAU, EXP2_EMULATED, EXP2_DEGREE)
            p_op = gl.convert_layout(p.to(q_smem.dtype), p_layout)  # l_i above: the first tile's row sums
            for t in range(1, n_tiles):
                slot = t % STAGES
                prev = (t - 1) % STAGES
                mbarrier.wait(ready.index(slot), (t // STAGES) & 1)  # K_t has landed
                mbarrier.wait(ready.index(STAGES + prev), ((t - 1) // STAGES) & 1)  # V_{t-1} has landed
                # Two asynchronous products in flight, in this order: S_t = Q K_tᵀ, then
                # O += P_{t-1} V_{t-1}. wgmma groups finish in order, so "at most 1 pending"
                # means S_t is done while O's product may still run: the softmax of tile t below
                # overlaps it.
                if PINGPONG:  # turn t: the other consumer has issued its products of turn t - 1
                    mbarrier.wait(turn.index(WG), (t & 1) ^ (1 - WG))
                s_tok = warpgroup_mma(q_smem, _tile2d(k_ring, slot).permute((1, 0)), s_zero, use_acc=False,
                                      is_async=True)
                o_tok = warpgroup_mma(p_op, _tile2d(v_ring, prev), acc, is_async=True)
                if PINGPONG:  # our products are queued: the other's may follow while we do softmax
                    mbarrier.arrive(turn.index(1 - WG), count=1)
                s = warpgroup_mma_wait(1, deps=(s_tok,))
                _release(k_desc, k_ring, ready, empty, b, h, t, n_tiles, 0, BLOCK_N, STAGES, LOADS_HERE)  # K_t read
                m_i, p, alpha, p_sum = _softmax_step(s, m_i, t, n_full, row0, n_k, qk_scale_log2, s_layout, BLOCK_M,
                                                     BLOCK_N, CAUSAL, RESCALE_TAU, EXP2_EMULATED, EXP2_DEGREE)
                # Now O's product must be done before we rescale it. p_op is in the deps so that
                # its registers stay untouched until the product that reads them has finished.
                acc, p_old = warpgroup_mma_wait(0, deps=(o_tok, p_op))
                _release(v_desc, v_ring, ready, empty, b, h, t - 1, n_tiles, STAGES, BLOCK_N, STAGES,
                         LOADS_HERE)  # V_{t-1} read
                acc, l_i = _rescale(acc, l_i, alpha, row_o, RESCALE_TAU)
                l_i = l_i + p_sum
                p_op = gl.convert_layout(p.to(q_smem.dtype), p_layout)
            last = n_tiles - 1  # the last tile's P V
            mbarrier.wait(ready.index(STAGES + last % STAGES), (last // STAGES) & 1)
            o_tok = warpgroup_mma(p_op, _tile2d(v_ring, last % STAGES), acc, is_async=True)
            acc, p_old = warpgroup_mma_wait(0, deps=(o_tok, p_op))
            _release(v_desc, v_ring, ready, empty, b, h, last, n_tiles, STAGES, BLOCK_N, STAGES, LOADS_HERE)
        else:
            for t in range(0, n_tiles):
                slot = t % STAGES
                phase = (t // STAGES) & 1
                mbarrier.wait(ready.index(slot), phase)  # K_t has landed
                # K_t is stored (BLOCK_N, HEAD_DIM), K-major; permute gives the (HEAD_DIM, BLOCK_N)
                # view that wgmma reads as Kᵀ without moving any data.
                s_tok = warpgroup_mma(q_smem, _tile2d(k_ring, slot).permute((1, 0)), s_zero, use_acc=False,
                                      is_async=True)
                s = warpgroup_mma_wait(0, deps=(s_tok,))
                _release(k_desc, k_ring, ready, empty, b, h, t, n_tiles, 0, BLOCK_N, STAGES, LOADS_HERE)
                m_i, p, alpha, p_sum = _softmax_step(s, m_i, t, n_full, row0, n_k, qk_scale_log2, s_layout, BLOCK_M,
                                                     BLOCK_N, CAUSAL, RESCALE_TAU, EXP2_EMULATED, EXP2_DEGREE)
                acc, l_i = _rescale(acc, l_i, alpha, row_o, RESCALE_TAU)
                l_i = l_i + p_sum
                p_op = gl.convert_layout(p.to(q_smem.dtype), p_layout)
                mbarrier.wait(ready.index(STAGES + slot), phase)  # V_t has landed
                o_tok = warpgroup_mma(p_op, _tile2d(v_ring, slot), acc, is_async=True)
                acc, p_old = warpgroup_mma_wait(0, deps=(o_tok, p_op))
                _release(v_desc, v_ring, ready, empty, b, h, t, n_tiles, STAGES, BLOCK_N, STAGES, LOADS_HERE)
        return acc, m_i, l_i

    @gluon.jit
    def _producer(k_desc, v_desc, k_ring, v_ring, ready, empty, b, h, start_m, n_k,
                  BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr):
        """The producer partition (designs c, d): one warp that only issues TMA copies, in the order
        the consumers need them: K_0, then K_{t+1} before V_t (iteration t+1 of the consumer loop
        multiplies Q K_{t+1}ᵀ and P_t V_t).

        Before refilling a slot it waits on the slot's ``empty`` barrier, which the consumers
        arrive on once the products reading it have finished. The first pass over a ring waits on
        phase 1 of a fresh barrier, which counts as already complete: the rings start empty."""
        n_tiles, n_full = _kv_tiles(start_m, n_k, BLOCK_M, BLOCK_N, CAUSAL)
        for t in range(0, n_tiles + 1):
            if t < n_tiles:
                mbarrier.wait(empty.index(t % STAGES), ((t // STAGES) & 1) ^ 1)
                _issue(k_desc, k_ring, ready, b, h, t, n_tiles, 0, BLOCK_N, STAGES)
            if t > 0:
                u = t - 1
                mbarrier.wait(empty.index(STAGES + u % STAGES), ((u // STAGES) & 1) ^ 1)
                _issue(v_desc, v_ring, ready, b, h, u, n_tiles, STAGES, BLOCK_N, STAGES)

    @gluon.jit
    def _epilogue(acc, m_i, l_i, o_smem4, o_desc, LSE, b, h, row0, pid_bh, n_q, BLOCK_M: gl.constexpr,
                  HEAD_DIM: gl.constexpr):
        """O = acc / l through shared memory and one TMA store (clipped at N by the descriptor);
        the natural-log LSE, ``(m + log2 l) · ln 2``, by a masked pointer store."""
        o_layout: gl.constexpr = acc.type.layout
        o = acc / gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))[:, None]
        _write_out(o, (m_i + gl.log2(l_i)) * LN_2, o_smem4, o_desc, LSE, b, h, row0, pid_bh, n_q, BLOCK_M, HEAD_DIM)

    @gluon.jit
    def _write_out(o, lse, o_smem4, o_desc, LSE, b, h, row0, pid_bh, n_q, BLOCK_M: gl.constexpr,
                   HEAD_DIM: gl.constexpr):
        """Store ``o`` (rows ``row0...``) through the shared buffer ``o_smem4`` and one TMA copy, and
        ``lse`` (one value per row, natural log) by a masked pointer store."""
        o_smem4.reshape([BLOCK_M, HEAD_DIM]).store(o.to(o_desc.dtype))
        fence_async_shared()  # the stores above, made by threads, are visible to the TMA engine
        tma_store(o_desc, [b, h, row0, 0], o_smem4)
        rows = row0 + gl.arange(0, BLOCK_M, layout=lse.type.layout)
        gl.store(LSE + pid_bh * n_q + rows, lse, mask=rows < n_q)
        tma.store_wait(0)  # the shared-memory buffer must outlive the copy

    @gluon.jit
    def _pingpong_consumer(q_bufs, k_ring, v_ring, ready, empty, q_bar, turn, k_desc, v_desc, o_desc, LSE,
                           b, h, start_m, pid_bh, n_q, n_k, qk_scale_log2, TILE_M: gl.constexpr,
                           BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
                           STAGES: gl.constexpr, CAUSAL: gl.constexpr, WG: gl.constexpr, RESCALE_TAU: gl.constexpr,
                           EXP2_EMULATED: gl.constexpr, EXP2_DEGREE: gl.constexpr, num_warps: gl.constexpr):
        """Design d: one consumer warpgroup's whole job, rows ``[WG·BLOCK_M, (WG+1)·BLOCK_M)`` of
        the tile, epilogue included (a worker partition returns nothing to the kernel). ``q_bufs``
        holds the tile's Q as two 64-row buffers; this warpgroup reads buffer ``WG``."""
        row0 = start_m + WG * BLOCK_M
        acc, m_i, l_i = _consumer(_tile2d(q_bufs, WG), k_ring, v_ring, ready, empty, q_bar, turn,
                                  k_desc, v_desc, b, h, start_m, row0, n_k, qk_scale_log2, TILE_M, BLOCK_M, BLOCK_N,
                                  HEAD_DIM, STAGES, CAUSAL, True, False, True, WG, RESCALE_TAU, EXP2_EMULATED,
                                  EXP2_DEGREE, num_warps)
        # Our half of Q is no longer read by any product: O goes out through its buffer.
        _epilogue(acc, m_i, l_i, q_bufs.index(WG), o_desc, LSE, b, h, row0, pid_bh, n_q, BLOCK_M, HEAD_DIM)

    @gluon.jit
    def _buffers(q_desc, k_desc, v_desc, b, h, start_m, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                 HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, PINGPONG: gl.constexpr):
        """Allocate the program's shared memory and barriers, and start the copy of its Q tile.
        Returns ``(q_bufs, k_ring, v_ring, ready, empty, q_bar, turn)``."""
        dtype: gl.constexpr = q_desc.dtype
        # Shared memory. The descriptors' blocks are 4-D ([1, 1, rows, d]); a buffer of several
        # blocks has one more (leading) dimension, and _tile2d gives the 2-D view of one block
        # that wgmma reads. NVMMASharedLayout is the swizzled layout that both TMA and wgmma
        # understand (128-byte swizzle for 64 or more 16-bit columns).
        # Q: one 128-row block, or (design d) two 64-row blocks, one per consumer warpgroup.
        Q_ROWS: gl.constexpr = q_desc.block_type.shape[2]
        Q_BLOCKS: gl.constexpr = BLOCK_M // Q_ROWS
        q_bufs = gl.allocate_shared_memory(dtype, [Q_BLOCKS, 1, 1, Q_ROWS, HEAD_DIM], q_desc.layout)
        # The K and V rings: STAGES tiles each.
        k_ring = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, BLOCK_N, HEAD_DIM], k_desc.layout)
        v_ring = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, BLOCK_N, HEAD_DIM], v_desc.layout)

        # mbarriers (64-bit words in shared memory). ready[s] / ready[STAGES + s]: the K / V tile
        # of slot s has landed (the TMA engine arrives with the bytes). empty[s] / empty[STAGES + s]:
        # the consumers are done with that K / V slot (designs c and d). q_bar: Q has landed.
        ready = gl.allocate_shared_memory(gl.int64, [2 * STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [2 * STAGES, 1], mbarrier.MBarrierLayout())
        q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        # turn[w]: consumer warpgroup w may issue its products (design d only).
        turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(2 * STAGES):
            mbarrier.init(ready.index(i), count=1)
            # design d: both consumers read each slot, so it is empty once both have arrived
            mbarrier.init(empty.index(i), count=2 if PINGPONG else 1)
        mbarrier.init(q_bar, count=1)
        for i in gl.static_range(2):
            mbarrier.init(turn.index(i), count=1)
        fence_async_shared()  # the barriers' initialization is visible to the TMA engine

        mbarrier.expect(q_bar, Q_BLOCKS * q_desc.block_type.nbytes)
        for i in gl.static_range(Q_BLOCKS):
            tma_load(q_desc, [b, h, start_m + i * Q_ROWS, 0], q_bar, q_bufs.index(i))
        return q_bufs, k_ring, v_ring, ready, empty, q_bar, turn

    @gluon.jit
    def _invalidate(ready, empty, q_bar, turn, STAGES: gl.constexpr):
        """Retire the barriers of :func:`_buffers` (the program is done with them)."""
        for i in gl.static_range(2 * STAGES):
            mbarrier.invalidate(ready.index(i))
            mbarrier.invalidate(empty.index(i))
        mbarrier.invalidate(q_bar)
        for i in gl.static_range(2):
            mbarrier.invalidate(turn.index(i))

    @gluon.jit
    def attention_forward_gluon_kernel(q_desc, k_desc, v_desc, o_desc, LSE, n_heads, n_q, n_k, qk_scale_log2,
                                       HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                                       STAGES: gl.constexpr, CAUSAL: gl.constexpr, OVERLAP: gl.constexpr,
                                       WARP_SPECIALIZE: gl.constexpr, PINGPONG: gl.constexpr,
                                       LOADER_REGS: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                                       num_warps: gl.constexpr, RESCALE_TAU: gl.constexpr = RESCALE_TAU,
                                       EXP2_EMULATED: gl.constexpr = EXP2_EMULATED,
                                       EXP2_DEGREE: gl.constexpr = EXP2_DEGREE):
        """One program: BLOCK_M queries of one (batch, head). Grid ``(cdiv(N, BLOCK_M), B·H)``.

        The descriptors are of the ``(B, H, N, d)`` tensors with blocks ``[1, 1, rows, d]``: TMA
        reads rows past N as zeros and clips the store of O at N."""
        b, h, start_m, pid_bh = _tile_coords(n_heads, n_q, BLOCK_M)

        q_bufs, k_ring, v_ring, ready, empty, q_bar, turn = _buffers(
            q_desc, k_desc, v_desc, b, h, start_m, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, PINGPONG)
        Q_ROWS: gl.constexpr = q_desc.block_type.shape[2]

        if PINGPONG:
            # Design d: three partitions. The kernel's num_warps (4) run consumer warpgroup 0, a
            # 4-warp worker runs consumer warpgroup 1 (CONSUMER_REGS registers), a 1-warp worker
            # the producer (LOADER_REGS). Each consumer owns one Q block (half of the tile's rows)
            # and writes its half of O.
            gl.warp_specialize(
                [(_pingpong_consumer, (q_bufs, k_ring, v_ring, ready, empty, q_bar, turn, k_desc, v_desc,
                                       o_desc, LSE, b, h, start_m, pid_bh, n_q, n_k, qk_scale_log2, BLOCK_M, Q_ROWS,
                                       BLOCK_N, HEAD_DIM, STAGES, CAUSAL, 0, RESCALE_TAU, EXP2_EMULATED,
                                       EXP2_DEGREE, num_warps)),
                 (_pingpong_consumer, (q_bufs, k_ring, v_ring, ready, empty, q_bar, turn, k_desc, v_desc,
                                       o_desc, LSE, b, h, start_m, pid_bh, n_q, n_k, qk_scale_log2, BLOCK_M, Q_ROWS,
                                       BLOCK_N, HEAD_DIM, STAGES, CAUSAL, 1, RESCALE_TAU, EXP2_EMULATED,
                                       EXP2_DEGREE, 4)),
                 (_producer, (k_desc, v_desc, k_ring, v_ring, ready, empty, b, h, start_m, n_k,
                              BLOCK_M, BLOCK_N, STAGES, CAUSAL))],
                [4, 1], [CONSUMER_REGS, LOADER_REGS])
        else:
            q_smem = _tile2d(q_bufs, 0)  # (BLOCK_M, HEAD_DIM)
            if WARP_SPECIALIZE:
                # Design c: the default partition (the kernel's num_warps = 2 consumer warpgroups
                # working on one 128-row product together) and one worker, the 1-warp producer with
                # LOADER_REGS registers per thread; setmaxnreg hands the rest to the consumers.
                acc, m_i, l_i = gl.warp_specialize(
                    [(_consumer, (q_smem, k_ring, v_ring, ready, empty, q_bar, turn, k_desc, v_desc, b, h, start_m,
                                  start_m, n_k, qk_scale_log2, BLOCK_M, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, CAUSAL,
                                  True, False, False, 0, RESCALE_TAU, EXP2_EMULATED, EXP2_DEGREE, num_warps)),
                     (_producer, (k_desc, v_desc, k_ring, v_ring, ready, empty, b, h, start_m, n_k,
                                  BLOCK_M, BLOCK_N, STAGES, CAUSAL))],
                    [1], [LOADER_REGS])
            else:
                acc, m_i, l_i = _consumer(q_smem, k_ring, v_ring, ready, empty, q_bar, turn, k_desc, v_desc, b, h,
                                          start_m, start_m, n_k, qk_scale_log2, BLOCK_M, BLOCK_M, BLOCK_N, HEAD_DIM,
                                          STAGES, CAUSAL, OVERLAP, True, False, 0, RESCALE_TAU, EXP2_EMULATED,
                                          EXP2_DEGREE, num_warps)
            # Epilogue through Q's buffer: no product reads Q any more.
            _epilogue(acc, m_i, l_i, q_bufs.index(0), o_desc, LSE, b, h, start_m, pid_bh, n_q, BLOCK_M, HEAD_DIM)

        _invalidate(ready, empty, q_bar, turn, STAGES)


# ----------------------------------------------------------------------------------------------
# Host side


def gluon_unsupported_reason(q, k, v) -> str | None:
    """Why :func:`attention_forward_gluon` cannot take these inputs, or None if it can."""
    if GLUON_IMPORT_ERROR is not None:
        return GLUON_IMPORT_ERROR
    if compat.gluon_failure() is not None:  # a Gluon kernel did not compile with this Triton: all are off
        return compat.gluon_failure()
    if q.device.type == "cuda" and torch.cuda.get_device_capability(q.device)[0] != 9:
        return "the kernel uses Hopper's wgmma and TMA: it needs a GPU of compute capability 9.x"
    if q.device.type != "cuda" and not _compiling_only():
        return "CPU tensors are only accepted while compiling for sm_90 without a GPU (cross_compile)"
    if q.dtype not in DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        return f"q, k, v must all be float16 or bfloat16, got {q.dtype}, {k.dtype}, {v.dtype}"
    if q.dim() != 4 or k.shape != q.shape or v.shape != q.shape:
        return f"q, k, v must be (B, H, N, d) of one shape (N_q = N_k), got {tuple(q.shape)}, {tuple(k.shape)}"
    if q.shape[-1] not in HEAD_DIMS:
        return f"the head dim must be one of {HEAD_DIMS}, got {q.shape[-1]}"
    for x in (q, k, v):
        if x.stride(-1) != 1:
            return "the head dim must be contiguous (last stride 1)"
        if x.data_ptr() % TMA_ALIGN_BYTES or any((s * x.element_size()) % TMA_ALIGN_BYTES for s in x.stride()[:-1]):
            return f"base address and strides must be multiples of {TMA_ALIGN_BYTES} bytes (TMA)"
    return None


def library_uses_gluon(q, k, v) -> bool:
    """Whether :func:`course_lib.flash_attention` takes this kernel's ping-pong variant: a Hopper
    GPU, head dim in :data:`~course_lib.kernels.tuning.GLUON_HEAD_DIMS` (where it was measured
    faster than the TMA forward), inputs it covers, no autotuning asked for, and
    ``COURSE_LIB_GLUON`` not set to 0. Everything else keeps chapter 06's or 09's Triton kernels."""
    from course_lib.platform import runtime
    from course_lib.kernels import tuning

    if runtime.current().interpreted or q.device.type != "cuda" or not available():
        return False
    if not tuning.gluon_enabled() or tuning.autotune_enabled() or q.shape[-1] not in tuning.GLUON_HEAD_DIMS:
        return False
    return gluon_unsupported_reason(q, k, v) is None


def _compiling_only() -> bool:
    """Whether the active Triton driver is :class:`course_lib.platform.stand_in.StandInDriver` (compile, never run)."""
    from triton.runtime import driver

    from course_lib.platform.stand_in import StandInDriver

    return isinstance(driver._active, StandInDriver)


_SHARED_LAYOUTS: dict = {}  # (tile rows, head dim, dtype) -> the NVMMA shared layout of a [1, 1, rows, d] tile


def _descriptor(x: torch.Tensor, rows: int):
    """A Gluon host-side TMA descriptor of the (B, H, N, d) tensor ``x`` whose block is one tile
    ``[1, 1, rows, d]``, laid out in shared memory the way wgmma reads it."""
    block = [1, 1, rows, x.shape[-1]]
    layout = _SHARED_LAYOUTS.get((rows, x.shape[-1], x.dtype))
    if layout is None:  # a layout object is slow to make (its checks): one per tile shape and dtype
        layout = gl.NVMMASharedLayout.get_default_for(block, getattr(gl, str(x.dtype).split(".")[-1]))
        _SHARED_LAYOUTS[rows, x.shape[-1], x.dtype] = layout
    return TensorDescriptor(x, list(x.shape), list(x.stride()), block, layout)


class Descriptors:
    """The descriptors of one launch site's tensors, tile rows ``rows`` each: checked and made at the
    first call; with ``cache`` (the tensors of every later call have the first call's shapes,
    strides, dtypes and alignment: one call signature), later calls copy them onto their tensors
    (:func:`~course_lib.kernels.launch.rebased`) without checking them again."""

    __slots__ = ("rows", "cache", "templates")

    def __init__(self, rows: tuple, cache: bool = False):
        self.rows, self.cache, self.templates = rows, cache, None

    def __call__(self, *tensors) -> list:
        if self.templates is not None:
            return [rebased(t, x) for t, x in zip(self.templates, tensors)]
        descs = [_descriptor(x, rows) for x, rows in zip(tensors, self.rows)]
        if self.cache:
            self.templates = descs
        return descs


class ForwardLaunch:
    """:func:`attention_forward_gluon` for one call signature: the inputs checked, config, grid and
    constexprs worked out once (the library's launch plans keep one per signature,
    :mod:`course_lib.kernels.plan`).

    Args:
        q, k, v, causal, variant: as :func:`attention_forward_gluon`.
        cache: launch later calls by the compiled kernel's handle, with the first call's descriptors.
        rescale_tau, exp2_emulated, exp2_degree: issue 35's switches, as :func:`attention_forward_gluon`.

    Raises:
        ValueError naming what is not covered (see :func:`gluon_unsupported_reason`); TypeError /
        ValueError naming a switch out of its range.
    """

    def __init__(self, q, k, v, causal: bool, variant: str = "ws", cache: bool = False, rescale_tau=None,
                 exp2_emulated=None, exp2_degree=None):
        why = gluon_unsupported_reason(q, k, v)
        if why:
            raise ValueError(f"attention_forward_gluon: q, k, v: {why}")
        batch, heads, n, d = q.shape
        cfg = {**config(variant, d), **switch_constexprs(rescale_tau, exp2_emulated, exp2_degree)}
        self.o_shape, self.lse_shape = (batch, heads, n, d), (batch, heads, n)
        self.dtype, self.device, self.sizes, self.compiling_only = q.dtype, q.device, (heads, n, n), _compiling_only()
        self.descriptors = Descriptors((cfg["Q_ROWS"], cfg["BLOCK_N"], cfg["BLOCK_N"], cfg["Q_ROWS"]), cache)
        grid = (triton.cdiv(n, cfg["BLOCK_M"]), batch * heads)
        self.launch = CachedLaunch(attention_forward_gluon_kernel, grid, dict(
            HEAD_DIM=d, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], STAGES=cfg["STAGES"], CAUSAL=bool(causal),
            OVERLAP=variant != "tma", WARP_SPECIALIZE=variant == "ws", PINGPONG=variant == "pingpong",
            LOADER_REGS=cfg["LOADER_REGS"], CONSUMER_REGS=cfg["CONSUMER_REGS"], num_warps=cfg["num_warps"],
            RESCALE_TAU=cfg["RESCALE_TAU"], EXP2_EMULATED=cfg["EXP2_EMULATED"], EXP2_DEGREE=cfg["EXP2_DEGREE"]), cache)

    def __call__(self, q, k, v, o, lse, scale: float):
        """Launch into ``o`` and ``lse``; return the compiled kernel."""
        return self.launch(*self.descriptors(q, k, v, o), lse, *self.sizes, scale * LOG2_E)


def attention_forward_gluon(q, k, v, causal: bool, scale: float | None = None, variant: str = "ws",
                            launch: ForwardLaunch | None = None, rescale_tau: float | None = None,
                            exp2_emulated: int | None = None, exp2_degree: int | None = None):
    """Attention forward with the Gluon kernel; ``(o, lse)`` as
    :func:`course_lib.kernels.hopper.attention_forward_tma` returns them (o in q's dtype, lse the
    natural-log log-sum-exp of each query's scaled scores, float32, ``(B, H, N)``).

    Args:
        q, k, v: ``(B, H, N, d)`` fp16/bf16 CUDA tensors (or CPU ones under a stand-in driver that
            only compiles), d in :data:`HEAD_DIMS`, TMA-readable strides.
        causal: query i sees keys j <= i. scale: default ``d ** -0.5``.
        variant: one of :data:`VARIANTS`.
        launch: a :class:`ForwardLaunch` made for these inputs' call signature (the library's launch
            plans keep one); None: made here (then the switches below apply; a given launch has its own).
        rescale_tau: conditional rescaling's threshold in log2 units, 0 to :data:`MAX_RESCALE_TAU`
            (0: rescale on every tile). None: :data:`RESCALE_TAU`.
        exp2_emulated: of every :data:`EXP2_PACK` exponentials of P, how many are computed on the
            FMA units (0 to EXP2_PACK). None: :data:`EXP2_EMULATED`.
        exp2_degree: the degree of that polynomial, a key of
            :data:`course_lib.attention.fp_emulation.EXP2_POLYS`. None: :data:`EXP2_DEGREE`.

    Raises:
        ValueError naming what is not covered (see :func:`gluon_unsupported_reason`); TypeError /
        ValueError naming a switch out of its range.
    """
    launch = launch or ForwardLaunch(q, k, v, causal, variant, rescale_tau=rescale_tau, exp2_emulated=exp2_emulated,
                                     exp2_degree=exp2_degree)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    o = torch.empty(launch.o_shape, dtype=launch.dtype, device=launch.device)
    lse = torch.empty(launch.lse_shape, dtype=torch.float32, device=launch.device)
    with compat.FallBack("the Gluon forward", strict=launch.compiling_only) as attempt:
        return_kernel = launch(q, k, v, o, lse, scale)
    if attempt.failed:  # this Triton cannot compile it (warned once): the library's Triton forward instead
        return _triton_forward(q, k, v, causal, scale)
    attention_forward_gluon.last_kernel = return_kernel  # the compiled kernel: registers, PTX, SASS
    return o, lse


def _triton_forward(q, k, v, causal: bool, scale: float):
    """``(o, lse)`` from the forward :func:`course_lib.flash_attention` takes where the Gluon kernel is
    off: chapter 09's TMA kernel where it applies (:func:`~course_lib.kernels.hopper.library_uses_tma`),
    else chapter 06's."""
    from course_lib.kernels import forward, hopper

    if hopper.library_uses_tma(q, k, v):
        return hopper.attention_forward_tma(q, k, v, causal, scale)
    return forward.attention_forward(q, k, v, causal, scale)


attention_forward_gluon.last_kernel = None

# PTX lines that show a design's claim in the compiled kernel.
PTX_OVERLAP = r"wgmma\.wait_group\.sync\.aligned\s+1;"  # at most 1 product left pending (design b)
PTX_REG_BUDGET = r"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32\s+(\d+);"  # per-partition registers (design c)
PTX_EX2 = "ex2.approx"  # an exponential on the special-function unit (gl.exp2 and the inline asm's)
PTX_POLY_FMA = "fma.rn.f32 e2p,"  # one Horner step of the software exp2 (_exp2_asm's register name)
# A conditional forward branch: "@%p bra L;" (or "@!%p"), its target label, and what ends a block.
_PTX_COND_BRANCH = re.compile(r"@!?%p\d+ bra(?:\.uni)?\s+(\$L__\w+);")
_PTX_LABEL = re.compile(r"^(\$L__\w+):")
_PTX_JUMP = re.compile(r"^bra(?:\.uni)?\s+(\$L__\w+);")


def guarded_blocks(ptx: str) -> list[str]:
    """The bodies of the PTX's if-then blocks: the code a conditional branch jumps over to a label
    that the body itself falls into or jumps to (``@%p bra L; body; [bra.uni L;] L:``), so it runs
    only when the predicate is false. Loops and if-else shapes are not listed."""
    lines = [line.strip() for line in ptx.splitlines()]
    bodies = []
    for i, line in enumerate(lines):
        branch = _PTX_COND_BRANCH.search(line)
        if not branch:
            continue
        target = branch.group(1)
        for j in range(i + 1, len(lines)):
            label, jump = _PTX_LABEL.match(lines[j]), _PTX_JUMP.match(lines[j])
            if label or jump or lines[j] == "ret;":
                if (label and label.group(1) == target) or (jump and jump.group(1) == target):
                    bodies.append("\n".join(lines[i + 1:j]))
                break
    return bodies


def kernel_facts(kernel) -> dict:
    """What one compiled kernel uses: registers per thread (at launch; ``setmaxnreg`` moves them
    between partitions afterwards), spilled bytes, shared memory, and the PTX evidence: how many
    ``wgmma.wait_group 1`` and ``setmaxnreg`` it holds, and the ``setmaxnreg`` values; for issue
    35's switches, the ``ex2.approx`` count, the software exp2's Horner FMAs, and the most
    ``mul.f32`` one if-then block holds (conditional rescaling puts the acc rescale there)."""
    ptx = kernel.asm["ptx"]
    return {"registers": kernel.n_regs, "spill_bytes": 4 * kernel.n_spills, "shared_bytes": kernel.metadata.shared,
            "wait_group_1": len(re.findall(PTX_OVERLAP, ptx)),
            "setmaxnreg": sorted({f"{op} {regs}" for op, regs in re.findall(PTX_REG_BUDGET, ptx)}),
            "wgmma": ptx.count("wgmma.mma_async"), "ex2": ptx.count(PTX_EX2), "poly_fma": ptx.count(PTX_POLY_FMA),
            "guarded_mul_f32": max((body.count("mul.f32") for body in guarded_blocks(ptx)), default=0),
            "triton": triton.__version__}


def cross_compile(variant: str, head_dim: int = 128, dtype=torch.float16, causal: bool = False, n: int = 1000,
                  **switches):
    """Compile one variant for sm_90 on a machine without a GPU and return :func:`kernel_facts`.

    Uses :class:`course_lib.platform.stand_in.StandInDriver` (a driver that compiles and "loads" but never
    launches) on CPU tensors, and puts the real driver back afterwards. ``switches``: issue 35's
    ``rescale_tau``, ``exp2_emulated``, ``exp2_degree`` (:func:`attention_forward_gluon`)."""
    with stand_in_sm90():
        q = torch.zeros(1, 1, n, head_dim, dtype=dtype)
        attention_forward_gluon(q, q, q, causal, variant=variant, **switches)
        return kernel_facts(attention_forward_gluon.last_kernel)


@contextlib.contextmanager
def stand_in_sm90():
    """Within it, kernels launched on CPU tensors are compiled for sm_90 and never run
    (:class:`course_lib.platform.stand_in.StandInDriver`); the real driver is put back afterwards."""
    import os

    from triton.runtime import driver

    from course_lib.platform.stand_in import StandInDriver

    old_interpret = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "0"
    old_driver = driver._active  # None on a machine without a GPU driver; reset_active would fail there
    driver.set_active(StandInDriver(90))
    try:
        yield
    finally:
        driver._active = old_driver
        if old_interpret is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = old_interpret


__all__ = ["attention_forward_gluon", "gluon_unsupported_reason", "available", "config", "VARIANTS", "HEAD_DIMS",
           "GLUON_IMPORT_ERROR", "kernel_facts", "cross_compile", "stand_in_sm90", "MAX_RESCALE_TAU", "RESCALE_TAU",
           "EXP2_PACK", "EXP2_EMULATED", "EXP2_DEGREE", "switch_constexprs", "guarded_blocks"]

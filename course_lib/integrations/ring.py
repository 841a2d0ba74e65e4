"""Ring attention (context parallelism) on ``torch.distributed`` (chapter 11).

When one sequence is too long for one GPU, each of ``W`` ranks keeps a *shard* of it: its own
query rows and the keys and values of the same positions. Attention needs every query to meet
every key, so the K/V shards travel around a ring: at step ``s`` rank ``r`` holds the K/V shard
that rank ``(r - s) mod W`` started with, attends its queries to it with the FlashAttention
kernel (:func:`course_lib.flash_attention_with_lse`), and folds the partial result into its
running ``(o, lse)`` with chapter 03's merge (:func:`merge_partials`). While it computes, the
next shard is already on its way (``batch_isend_irecv`` posted before the compute), so on fast
links the communication hides behind the arithmetic. After ``W`` steps every rank has the exact
output rows of its shard.

The backward sends the K/V shards around the ring again, together with dK/dV accumulators that
travel with them: each rank adds its queries' contribution to the gradient of the block it
holds (:func:`course_lib.kernels.backward.attention_backward` with the *global* log-sum-exp of
the merged output, which is all a block's backward needs), and after ``W`` hops each
accumulator is back home, complete.

Shard layouts (``LAYOUTS``):

* ``"contiguous"`` — rank ``r`` holds chunk ``r`` of a sequence cut into ``W`` chunks. Shards may
  have different lengths (the ranks exchange their lengths first).
* ``"zigzag"`` — the sequence is cut into ``2W`` equal chunks and rank ``r`` holds chunks ``r``
  and ``2W - 1 - r`` (one early, one late), so that with a causal mask every rank has the same
  amount of work. All shards must have the same even length.

Where the ranks run (:func:`launch_plan`): on CPU, gloo processes and the Triton interpreter; on
GPUs, one process per GPU joined by NCCL when there are at least as many GPUs as ranks; with
fewer GPUs than ranks (a notebook on one GPU), the ranks share the GPUs and talk through gloo,
each message copied through host memory (*host staging*), because NCCL refuses two ranks on one
device. Every tensor a rank computes with stays on its device.

Stable names: :func:`rank_chunks`, :func:`shard`, :func:`unshard`, :func:`block_plan`,
:func:`merge_partials`, :func:`ring_attention`, :func:`ring_attention_with_lse`,
:func:`causal_work`, :func:`step_bytes`, :func:`step_flops`, :func:`hide_threshold`,
:func:`launch_plan`, :func:`rank_device`, :func:`run_ranks`, :func:`run_cases`,
:func:`context_parallel_buffers`.
"""

from __future__ import annotations

import contextlib
import datetime
import math
import os
import tempfile
import time
from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np
import torch
import torch.distributed as dist

from course_lib.platform import runtime
from course_lib.attention.reference import default_scale

LAYOUTS = ("contiguous", "zigzag")

# Interconnect figures for the "when does communication hide?" arithmetic. NVLink 4 on an H100
# SXM: 900 GB/s total, i.e. 450 GB/s each way (NVIDIA H100 datasheet, "NVLink: 900GB/s"); a ring
# sends one way. Between nodes, one 400 Gb/s InfiniBand NDR port per GPU: 50 GB/s each way
# (NVIDIA ConnectX-7 / DGX H100 datasheet).
NVLINK_H100_BYTES_PER_S = 450e9
INFINIBAND_NDR_BYTES_PER_S = 50e9

# How long a rank waits for the others before a collective or a point-to-point op fails: long
# enough for the Triton interpreter on a loaded 2-core machine, short enough that a bug in a
# notebook stops with an error instead of hanging the kernel.
DEFAULT_TIMEOUT_S = 120.0
# On a GPU the first ring call compiles the forward and backward kernels in every rank at once;
# from a cold Triton cache a float32 forward+backward took 21 s (d = 64) to 80 s (d = 128) on an
# H100 (FACTS.md, "fp32 compile times"), and ranks sharing one GPU compile side by side.
GPU_TIMEOUT_S = 600.0


# ----------------------------------------------------------------------------------------------
# Who holds what
# ----------------------------------------------------------------------------------------------

def _check_layout(layout) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    return layout


def _check_world(world) -> int:
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"world must be a positive int (the number of ranks), got {world!r}")
    return world


def rank_chunks(world: int, layout: str = "contiguous") -> list[tuple[int, ...]]:
    """The chunk ids each rank holds, in the order its shard stores them.

    Contiguous: ``W`` chunks, rank ``r`` holds ``(r,)``. Zig-zag: ``2W`` chunks, rank ``r`` holds
    ``(r, 2W - 1 - r)``. A lower chunk id comes earlier in the sequence.
    """
    _check_world(world)
    if _check_layout(layout) == "contiguous":
        return [(r,) for r in range(world)]
    return [(r, 2 * world - 1 - r) for r in range(world)]


def chunk_bounds(n: int, world: int, layout: str = "contiguous") -> list[tuple[int, int]]:
    """``[(start, stop)]`` of each chunk of a sequence of ``n`` tokens (chunk ids in order).

    Contiguous: ``W`` chunks as equal as possible (the first ``n mod W`` one token longer).
    Zig-zag: ``2W`` equal chunks; ``n`` must be a multiple of ``2W``.
    """
    n_chunks = _check_world(world) * (2 if _check_layout(layout) == "zigzag" else 1)
    if layout == "zigzag" and n % n_chunks:
        raise ValueError(f"zigzag needs the sequence length to be a multiple of 2·world = "
                         f"{n_chunks}, got n = {n}")
    if n < n_chunks:
        raise ValueError(f"n = {n} tokens cannot give each of the {n_chunks} chunks a token")
    sizes = [n // n_chunks + (1 if c < n % n_chunks else 0) for c in range(n_chunks)]
    starts = np.cumsum([0] + sizes)
    return [(int(starts[c]), int(starts[c + 1])) for c in range(n_chunks)]


def shard(x: torch.Tensor, rank: int, world: int, layout: str = "contiguous", lengths=None):
    """Rank ``rank``'s shard of a whole sequence ``x`` ``(..., N, d)``: its chunks, concatenated.

    Args:
        lengths: contiguous only, the shard length of every rank (ragged shards); None = as
            equal as possible.
    """
    n = x.shape[-2]
    if lengths is not None:
        if layout != "contiguous":
            raise ValueError("lengths (ragged shards) are only supported with layout='contiguous'")
        if len(lengths) != world or sum(lengths) != n:
            raise ValueError(f"lengths must give {world} shard lengths summing to N = {n}, "
                             f"got {list(lengths)}")
        starts = np.cumsum([0, *lengths])
        bounds = [(int(starts[r]), int(starts[r + 1])) for r in range(world)]
    else:
        bounds = chunk_bounds(n, world, layout)
    return torch.cat([x[..., bounds[c][0]:bounds[c][1], :] for c in rank_chunks(world, layout)[rank]],
                     dim=-2)


def unshard(shards, layout: str = "contiguous") -> torch.Tensor:
    """The whole sequence ``(..., N, d)`` from every rank's shard (the inverse of :func:`shard`).

    Works for ``(..., n_r)`` tensors too (a log-sum-exp per row): pass ``dim=-1`` shaped shards
    by giving them a trailing unit dim first, or use :func:`unshard_rows`.
    """
    return unshard_rows(shards, layout, dim=-2)


def unshard_rows(shards, layout: str = "contiguous", dim: int = -2) -> torch.Tensor:
    """Concatenate per-rank shards along ``dim`` in sequence order (zig-zag chunks reordered)."""
    world = len(shards)
    if _check_layout(layout) == "contiguous":
        return torch.cat(list(shards), dim=dim)
    pieces = {}
    for r, x in enumerate(shards):
        half = x.shape[dim] // 2
        first, second = x.narrow(dim, 0, half), x.narrow(dim, half, x.shape[dim] - half)
        a, b = rank_chunks(world, layout)[r]
        pieces[a], pieces[b] = first, second
    return torch.cat([pieces[c] for c in range(2 * world)], dim=dim)


@dataclass(frozen=True)
class BlockPlan:
    """What rank ``q_rank`` computes with the K/V shard of ``kv_rank``: query rows ``rows`` of
    its shard against key rows ``cols`` of the K/V shard, with a causal mask when ``causal``
    (only the diagonal block, where both shards are the same chunks)."""

    rows: slice
    cols: slice
    causal: bool


def _chunk_rows(lengths) -> list[slice]:
    starts = np.cumsum([0, *lengths])
    return [slice(int(starts[i]), int(starts[i + 1])) for i in range(len(lengths))]


def block_plan(q_chunks, kv_chunks, causal: bool, q_lengths=None, kv_lengths=None):
    """The attention one ring step computes, or None when the causal mask hides the whole block.

    A query chunk sees a key chunk fully when the key chunk comes earlier, not at all when it
    comes later, and through the causal mask when it is the same chunk. The visible pairs of a
    step always form one rectangle of the two shards (checked here), so one kernel call does it.

    Args:
        q_chunks, kv_chunks: chunk ids the two ranks hold (:func:`rank_chunks`).
        causal: the global causal mask.
        q_lengths, kv_lengths: the chunks' lengths (default 1 each: only the plan's shape).

    Returns:
        :class:`BlockPlan` or None.
    """
    q_lengths = q_lengths or [1] * len(q_chunks)
    kv_lengths = kv_lengths or [1] * len(kv_chunks)
    q_rows, kv_rows = _chunk_rows(q_lengths), _chunk_rows(kv_lengths)
    all_rows = slice(0, int(sum(q_lengths)))
    all_cols = slice(0, int(sum(kv_lengths)))
    if not causal:
        return BlockPlan(all_rows, all_cols, False)
    if tuple(q_chunks) == tuple(kv_chunks):  # the diagonal block: chunks in order, same lengths
        return BlockPlan(all_rows, all_cols, True)
    rows = [i for i, qc in enumerate(q_chunks) if any(kc < qc for kc in kv_chunks)]
    cols = [j for j, kc in enumerate(kv_chunks) if any(kc < qc for qc in q_chunks)]
    if not rows:
        return None
    if any(kv_chunks[j] >= q_chunks[i] for i in rows for j in cols) \
            or rows != list(range(rows[0], rows[-1] + 1)) or cols != list(range(cols[0], cols[-1] + 1)):
        raise ValueError(f"the visible part of chunks {tuple(q_chunks)} x {tuple(kv_chunks)} is "
                         f"not one rectangle; this layout is not supported")
    return BlockPlan(slice(q_rows[rows[0]].start, q_rows[rows[-1]].stop),
                     slice(kv_rows[cols[0]].start, kv_rows[cols[-1]].stop), False)


def shard_chunk_lengths(lengths, layout: str = "contiguous") -> list[list[int]]:
    """The lengths of the chunks inside each rank's shard, from the shard lengths.

    Contiguous: one chunk per shard. Zig-zag: two equal halves (shard lengths must be even).
    """
    if _check_layout(layout) == "contiguous":
        return [[int(n)] for n in lengths]
    if any(n % 2 for n in lengths):
        raise ValueError(f"zigzag shards hold two equal chunks: every length must be even, "
                         f"got {list(lengths)}")
    return [[int(n) // 2] * 2 for n in lengths]


def ring_source(rank: int, step: int, world: int) -> int:
    """Whose K/V shard rank ``rank`` holds at step ``step``: ``(rank - step) mod world``."""
    return (rank - step) % world


# ----------------------------------------------------------------------------------------------
# The merge (chapter 03) in torch
# ----------------------------------------------------------------------------------------------

def merge_partials(o, lse, o_blk, lse_blk):
    """Merge a block's partial attention ``(o_blk, lse_blk)`` into the running ``(o, lse)``.

    Both are results over disjoint sets of keys, each ``o`` normalised over its own keys. This is
    chapter 03's ``merge_states_with_output`` with ``m = lse`` and ``l = 1``: bring both to the
    common reference ``m = max(lse, lse_blk)``, weigh each by ``exp(lse - m)``, divide by the sum
    of the weights; the merged ``lse = m + log(sum of weights)``. The empty state ``lse = -inf``,
    ``o = 0`` merges to the other part.

    Args:
        o, o_blk: ``(..., n, d)``; lse, lse_blk: ``(..., n)``, natural log.

    Returns:
        ``(o, lse)`` merged, in the dtypes of ``o`` and ``lse``.
    """
    m = torch.maximum(lse, lse_blk)  # (..., n)
    shift = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # -inf only when both are empty
    w, w_blk = torch.exp(lse - shift), torch.exp(lse_blk - shift)  # (..., n)
    total = w + w_blk
    safe = torch.where(total > 0, total, torch.ones_like(total))
    o_new = (w[..., None] * o + w_blk[..., None] * o_blk.to(o.dtype)) / safe[..., None]
    return o_new.to(o.dtype), (shift + torch.log(total)).to(lse.dtype)


# ----------------------------------------------------------------------------------------------
# Costs: work per rank, bytes and FLOPs per step, when communication hides
# ----------------------------------------------------------------------------------------------

def causal_work(world: int, layout: str = "contiguous", n: int | None = None,
                causal: bool = True) -> np.ndarray:
    """Score entries each rank computes at each step: ``work[r, s]`` ``(W, W)``.

    Args:
        n: total sequence length (default ``2W`` tokens per rank, 2 per chunk of zig-zag).
        causal: count only the visible (query, key) pairs.

    A ring step ends when its slowest rank is done (everyone waits for the next shard), so the
    ring takes ``Σ_s max_r work[r, s]`` while the useful work is ``Σ work``.
    """
    world = _check_world(world)
    n = 4 * world if n is None else n
    bounds = chunk_bounds(n, world, layout)
    chunks = rank_chunks(world, layout)
    work = np.zeros((world, world), dtype=np.int64)
    for r in range(world):
        for s in range(world):
            src = ring_source(r, s, world)
            for qc in chunks[r]:
                for kc in chunks[src]:
                    lq = bounds[qc][1] - bounds[qc][0]
                    lk = bounds[kc][1] - bounds[kc][0]
                    if not causal or kc < qc:
                        work[r, s] += lq * lk
                    elif kc == qc:
                        work[r, s] += lq * (lq + 1) // 2
    return work


def ring_efficiency(work: np.ndarray) -> float:
    """Useful work over what the ring's lock-step costs: ``Σ work / (W · Σ_s max_r work[r, s])``."""
    return float(work.sum() / (work.shape[0] * work.max(axis=0).sum()))


def step_bytes(batch: int, heads: int, n_local: int, d: int, element_bytes: int,
               pass_: str = "fwd", grad_bytes: int | None = None) -> dict:
    """Bytes one rank sends per ring step (its neighbour receives as many).

    Forward: the K and V shards, ``2 · B·H·n·d · element_bytes``, for each of the ``W - 1``
    steps that pass them on. Backward: the same K/V, plus the dK and dV accumulators
    (``grad_bytes`` per element: float32 for half inputs), which make ``W`` hops (the last one
    takes them home).

    Returns:
        ``{"kv": bytes of K and V, "dkv": bytes of dK and dV (0 forward)}``.
    """
    if pass_ not in ("fwd", "bwd"):
        raise ValueError(f"pass_ must be 'fwd' or 'bwd', got {pass_!r}")
    elements = batch * heads * n_local * d
    grad_bytes = element_bytes if grad_bytes is None else grad_bytes
    return {"kv": 2 * elements * element_bytes, "dkv": 2 * elements * grad_bytes if pass_ == "bwd" else 0}


def step_flops(batch: int, heads: int, n_local: int, d: int) -> float:
    """FLOPs of one full (unmasked) block: ``4 · B·H·n²·d`` (the two matmuls of attention)."""
    return 4.0 * batch * heads * n_local * n_local * d


def hide_threshold(flops_per_s: float, link_bytes_per_s: float, element_bytes: int = 2) -> float:
    """Tokens per rank above which a forward step's compute outlasts its K/V transfer.

    Per step a rank computes ``4·n²·d`` FLOPs per head and sends ``2·n·d·element_bytes`` bytes;
    the first wins when ``n > element_bytes · flops_per_s / (2 · link_bytes_per_s)``.
    """
    return element_bytes * flops_per_s / (2.0 * link_bytes_per_s)


# ----------------------------------------------------------------------------------------------
# The ring, over a process group
# ----------------------------------------------------------------------------------------------

@dataclass
class _Ring:
    group: object
    rank: int
    world: int
    layout: str
    chunks: list  # chunk ids per rank
    chunk_lengths: list  # [rank][chunk] lengths
    shard_shapes: list  # 4-d shape of every rank's K (and V) shard
    host_staging: bool = False  # messages copied through host memory (gloo with GPU tensors)
    trace: list | None = None

    def peer(self, r: int) -> int:
        return dist.get_global_rank(self.group, r % self.world) if self.group is not None else r % self.world

    @property
    def next(self):
        return self.peer(self.rank + 1)

    @property
    def prev(self):
        return self.peer(self.rank - 1)

    def plan(self, src: int, causal: bool):
        return block_plan(self.chunks[self.rank], self.chunks[src], causal,
                          self.chunk_lengths[self.rank], self.chunk_lengths[src])


def _rank_info(group):
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised: call "
                           "torch.distributed.init_process_group first (or use ring.run_ranks)")
    world = dist.get_world_size(group)
    if world < 2:
        raise ValueError(f"group has world size {world}: ring attention needs at least 2 ranks "
                         f"(on one device call course_lib.flash_attention instead)")
    return dist.get_rank(group), world


def _host_staging(group, device: torch.device, host_staging) -> bool:
    """Whether messages go through host memory: asked for, or gloo (which reads and writes host
    memory only) carrying GPU tensors. NCCL sends device memory and cannot send host copies."""
    backend = dist.get_backend(group)
    if host_staging is None:
        return backend == "gloo" and device.type == "cuda"
    if not isinstance(host_staging, bool):
        raise TypeError(f"host_staging must be True, False or None, got {host_staging!r}")
    if host_staging and backend == "nccl":
        raise ValueError("host_staging=True copies messages to host memory, which NCCL cannot "
                         "send: use a gloo group, or host_staging=None")
    return host_staging


def _setup(q, k, v, causal, scale, group, layout, host_staging=None) -> _Ring:
    """Validate locally, then compare every rank's metadata (one small all_gather) so that a
    mismatch raises the same named error on every rank instead of hanging the ring."""
    from course_lib.kernels.api import validate_inputs

    _check_layout(layout)
    rank, world = _rank_info(group)
    problem = None
    try:
        validate_inputs(q, k, v, causal, scale)
        if q.shape[-2] != k.shape[-2]:
            raise ValueError(f"q and k must hold the same positions (self-attention shards): "
                             f"got q {tuple(q.shape)} and k {tuple(k.shape)}")
        staged = _host_staging(group, q.device, host_staging)
    except (TypeError, ValueError) as err:  # every rank must hear of it, or the others hang
        problem = (type(err).__name__, str(err))
    meta = (str(q.dtype), q.device.type, tuple(q.shape[:-2]), q.shape[-1], q.shape[-2],
            bool(causal), None if scale is None or problem else float(scale), problem)
    metas = [None] * world
    dist.all_gather_object(metas, meta, group=group)
    if problem is not None:
        raise {"TypeError": TypeError, "ValueError": ValueError}[problem[0]](problem[1])
    refused = [(r, m[7]) for r, m in enumerate(metas) if m[7] is not None]
    if refused:
        r, (kind, message) = refused[0]
        raise ValueError(f"rank {r} refused its inputs ({kind}: {message})")
    names = ("dtype", "device type", "leading dims", "head dim d", None, "causal", "scale")
    for i, name in enumerate(names):
        values = [m[i] for m in metas]
        if name is not None and len(set(values)) > 1:
            raise ValueError(f"ranks disagree on {name}: " + ", ".join(
                f"rank {r} has {val}" for r, val in enumerate(values)))
    lengths = [m[4] for m in metas]
    chunks = rank_chunks(world, layout)
    if layout == "zigzag":
        if len(set(lengths)) > 1 or lengths[0] % 2:
            raise ValueError(f"layout 'zigzag' needs shards of one even length on every rank "
                             f"(two equal chunks each), got shard lengths {lengths}; use "
                             f"layout='contiguous' for ragged shards")
    chunk_lengths = shard_chunk_lengths(lengths, layout)
    lead = _as4d_shape(q.shape)
    shapes = [(lead[0], lead[1], n, q.shape[-1]) for n in lengths]
    return _Ring(group, rank, world, layout, chunks, chunk_lengths, shapes, staged)


def _as4d_shape(shape):
    from course_lib.kernels.api import as_4d

    return as_4d(torch.empty(shape, device="meta")).shape


class _Transfer:
    """Messages posted to the next rank and buffers posted for the previous rank's messages.

    With host staging each message is copied to host memory before it is posted (gloo reads
    host memory only; the copy waits for the kernels that wrote the tensor), and what arrives
    is copied back to the device in :meth:`wait`.
    """

    def __init__(self, ring: _Ring, sends, recv_like):
        """Post ``sends`` to ``ring.next`` and receives of ``recv_like`` ``[(shape, dtype,
        device)]`` from ``ring.prev``."""
        self.devices = [torch.device(device) for _, _, device in recv_like]
        if ring.host_staging:
            sends = [t.to("cpu", copy=True) for t in sends]
        where = [torch.device("cpu") if ring.host_staging else device for device in self.devices]
        self._recvs = [torch.empty(shape, dtype=dtype, device=device)
                       for (shape, dtype, _), device in zip(recv_like, where)]
        self._sends = sends  # kept alive until the wait: the sends read them asynchronously
        ops = [dist.P2POp(dist.isend, t, ring.next, ring.group) for t in sends]
        ops += [dist.P2POp(dist.irecv, t, ring.prev, ring.group) for t in self._recvs]
        self._requests = dist.batch_isend_irecv(ops)

    def wait(self) -> list:
        """Wait for every send and receive; return the received tensors on their devices."""
        for request in self._requests:
            request.wait()
        return [t.to(device) for t, device in zip(self._recvs, self.devices)]


class _StepClock:
    """Marks the phases of ring steps for the trace: the host clock on CPU; CUDA events on a GPU,
    whose kernels run asynchronously (a host clock would time their launches), read once the
    pass is over."""

    def __init__(self, device: torch.device):
        self._events = device.type == "cuda"
        self._marks: list = []

    def mark(self) -> int:
        """Mark now (in stream order on a GPU); return the mark's index."""
        if self._events:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._marks.append(event)
        else:
            self._marks.append(time.perf_counter())
        return len(self._marks) - 1

    def seconds(self, start: int, stop: int) -> float:
        """Seconds between two marks (waits for the later one on a GPU)."""
        a, b = self._marks[start], self._marks[stop]
        if self._events:
            b.synchronize()
            return a.elapsed_time(b) / 1e3
        return b - a


def _trace_step(clock: _StepClock | None, pending: list, marks: tuple, **entry):
    """Keep one step's record (its times are read at the end of the pass, :func:`_flush_trace`)."""
    if clock is not None:
        pending.append((marks, entry))


def _flush_trace(ring: _Ring, clock: _StepClock | None, pending: list) -> None:
    if clock is None:
        return
    for (start, computed, waited), entry in pending:
        ring.trace.append({**entry, "compute_s": clock.seconds(start, computed),
                           "wait_s": clock.seconds(computed, waited)})


def _step_clock(ring: _Ring, device: torch.device) -> _StepClock | None:
    return None if ring.trace is None else _StepClock(device)


def _mark(clock: _StepClock | None) -> int | None:
    return None if clock is None else clock.mark()


def _plan_extent(plan):
    if plan is None:
        return {"rows": None, "cols": None}
    return {"rows": (plan.rows.start, plan.rows.stop), "cols": (plan.cols.start, plan.cols.stop)}


def _ring_forward(q4, k4, v4, causal, scale, ring: _Ring):
    """Every step: post the next K/V shard, attend to the current one, merge, wait."""
    from course_lib.kernels.api import flash_attention_with_lse

    acc = torch.float64 if q4.dtype == torch.float64 else torch.float32
    o = torch.zeros(q4.shape, dtype=acc, device=q4.device)  # (B, H, n, d) running output
    lse = torch.full(q4.shape[:-1], -math.inf, dtype=acc, device=q4.device)  # (B, H, n)
    k_cur, v_cur = k4.contiguous(), v4.contiguous()
    clock, pending = _step_clock(ring, q4.device), []
    for step in range(ring.world):
        start = _mark(clock)
        src = ring_source(ring.rank, step, ring.world)
        transfer, sent = None, 0
        if step + 1 < ring.world:  # post the next shard before computing on this one
            nxt = ring.shard_shapes[ring_source(ring.rank, step + 1, ring.world)]
            transfer = _Transfer(ring, [k_cur, v_cur], [(nxt, k_cur.dtype, k_cur.device)] * 2)
            sent = k_cur.nbytes + v_cur.nbytes
        plan = ring.plan(src, causal)
        if plan is not None:
            o_blk, lse_blk = flash_attention_with_lse(q4[:, :, plan.rows], k_cur[:, :, plan.cols],
                                                      v_cur[:, :, plan.cols], plan.causal, scale)
            o[:, :, plan.rows], lse[:, :, plan.rows] = merge_partials(
                o[:, :, plan.rows], lse[:, :, plan.rows], o_blk, lse_blk)
        computed = _mark(clock)
        if transfer is not None:
            k_cur, v_cur = transfer.wait()
        _trace_step(clock, pending, (start, computed, _mark(clock)), pass_="fwd", step=step,
                    src=src, bytes_sent=sent, **_plan_extent(plan))
    _flush_trace(ring, clock, pending)
    return o.to(q4.dtype), lse.to(torch.float64 if q4.dtype == torch.float64 else torch.float32)


def _block_backward(do, q, k, v, o, lse, causal: bool, scale: float):
    """One block's ``(dq, dk, dv)`` by the backward :func:`course_lib.flash_attention` takes for
    it (its autograd function's own dispatch: the Gluon one-pass kernel on Hopper where it
    applies, chapter 07's kernels elsewhere), given the merged ``lse`` of these query rows."""
    from course_lib.kernels.api import FlashAttentionFunction

    ctx = SimpleNamespace(saved_tensors=(q, k, v, o, lse), causal=causal, scale=scale,
                          deterministic=False)
    return FlashAttentionFunction.backward(ctx, do)[:3]


def _ring_backward(do4, q4, k4, v4, o4, lse, causal, scale, ring: _Ring):
    """K/V go round again; dK/dV accumulators travel with them and make one extra hop home."""
    acc = torch.float64 if q4.dtype == torch.float64 else torch.float32
    dq = torch.zeros(q4.shape, dtype=acc, device=q4.device)
    k_cur, v_cur = k4.contiguous(), v4.contiguous()
    dkv = None
    clock, pending = _step_clock(ring, q4.device), []
    for step in range(ring.world):
        start = _mark(clock)
        src = ring_source(ring.rank, step, ring.world)
        kv, sent = None, 0
        if step + 1 < ring.world:
            nxt = ring.shard_shapes[ring_source(ring.rank, step + 1, ring.world)]
            kv = _Transfer(ring, [k_cur, v_cur], [(nxt, k_cur.dtype, k_cur.device)] * 2)
            sent += k_cur.nbytes + v_cur.nbytes
        dk_part = torch.zeros(k_cur.shape, dtype=acc, device=q4.device)
        dv_part = torch.zeros(v_cur.shape, dtype=acc, device=q4.device)
        plan = ring.plan(src, causal)
        if plan is not None:
            rows, cols = plan.rows, plan.cols
            dq_b, dk_b, dv_b = _block_backward(
                do4[:, :, rows], q4[:, :, rows], k_cur[:, :, cols], v_cur[:, :, cols],
                o4[:, :, rows], lse[:, :, rows].contiguous(), plan.causal, scale)
            dq[:, :, rows] += dq_b.to(acc)
            dk_part[:, :, cols] = dk_b.to(acc)
            dv_part[:, :, cols] = dv_b.to(acc)
        computed = _mark(clock)
        if dkv is not None:  # the accumulators of the block we hold, from the previous rank
            dk_in, dv_in = dkv.wait()
            dk_part += dk_in
            dv_part += dv_in
        # pass the accumulators on (after the last step this takes each one home)
        dkv = _Transfer(ring, [dk_part, dv_part],
                        [(ring.shard_shapes[ring_source(ring.rank, step + 1, ring.world)], acc,
                          q4.device)] * 2)
        sent += dk_part.nbytes + dv_part.nbytes
        if kv is not None:
            k_cur, v_cur = kv.wait()
        _trace_step(clock, pending, (start, computed, _mark(clock)), pass_="bwd", step=step,
                    src=src, bytes_sent=sent, **_plan_extent(plan))
    dk_in, dv_in = dkv.wait()
    _flush_trace(ring, clock, pending)
    return dq.to(q4.dtype), dk_in.to(k4.dtype), dv_in.to(v4.dtype)


class RingAttentionFunction(torch.autograd.Function):
    """Autograd glue: the forward ring saves ``q, k, v, o, lse`` of this rank's shard; the
    backward ring uses them."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale, ring):
        from course_lib.kernels.api import as_4d

        o4, lse = _ring_forward(as_4d(q), as_4d(k), as_4d(v), causal, scale, ring)
        o = o4.reshape(q.shape)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.causal, ctx.scale, ctx.ring = causal, scale, ring
        return o, lse.reshape(q.shape[:-1])

    @staticmethod
    def backward(ctx, do, dlse):
        from course_lib.kernels.api import as_4d

        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = _ring_backward(as_4d(do), as_4d(q), as_4d(k), as_4d(v), as_4d(o), lse,
                                    ctx.causal, ctx.scale, ctx.ring)
        return dq.reshape(q.shape), dk.reshape(k.shape), dv.reshape(v.shape), None, None, None


def ring_attention_with_lse(q, k, v, causal: bool = False, scale: float | None = None, *,
                            group=None, layout: str = "contiguous", trace: list | None = None,
                            host_staging: bool | None = None):
    """Ring attention over ``group``: this rank's output rows and their log-sum-exp.

    Every rank of the group calls it at the same time with its own shard.

    Args:
        q, k, v: this rank's shard ``(..., n_r, d)`` (same positions for all three); the same
            dtype, device type, leading dims and ``d`` on every rank.
        causal: the causal mask over the *whole* sequence (shards in the order of ``layout``).
        scale: score scale; default ``1/sqrt(d)``.
        group: a ``torch.distributed`` process group of at least 2 ranks (None: the default).
        layout: ``"contiguous"`` (ragged shards allowed) or ``"zigzag"`` (equal, even shards).
        trace: a list to append one record per ring step to (step, source rank, bytes sent,
            compute and wait seconds: host clock on CPU, CUDA events on a GPU); the backward
            appends its own.
        host_staging: copy every message through host memory (None: exactly when the group is
            gloo and the tensors are on a GPU; True with NCCL is refused).

    Returns:
        ``(o, lse)``: ``(..., n_r, d)`` in q's dtype, differentiable w.r.t. q, k and v (the lse
        is not: its gradient is ignored); ``(..., n_r)`` float32 (float64 for float64).
    """
    ring = _setup(q, k, v, causal, scale, group, layout, host_staging)
    ring.trace = trace
    scale = default_scale(q.shape[-1]) if scale is None else float(scale)
    return RingAttentionFunction.apply(q, k, v, causal, scale, ring)


def ring_attention(q, k, v, causal: bool = False, scale: float | None = None, *, group=None,
                   layout: str = "contiguous", trace: list | None = None,
                   host_staging: bool | None = None) -> torch.Tensor:
    """Ring attention over ``group``: this rank's output rows ``(..., n_r, d)``, with autograd.

    Same arguments as :func:`ring_attention_with_lse`; gathered over the ranks (in the order of
    ``layout``, :func:`unshard`) the outputs equal ``scaled_dot_product_attention`` on the whole
    sequence.
    """
    return ring_attention_with_lse(q, k, v, causal, scale, group=group, layout=layout,
                                   trace=trace, host_staging=host_staging)[0]


# ----------------------------------------------------------------------------------------------
# Launching ranks from a notebook or a test: processes, a process group, a file store
# ----------------------------------------------------------------------------------------------

BACKENDS = ("gloo", "nccl")


@dataclass(frozen=True)
class LaunchPlan:
    """How :func:`run_ranks` starts ``world`` ranks: the process group's backend, each rank's
    device, and whether the ring copies its messages through host memory."""

    backend: str
    devices: tuple  # one torch device string per rank, e.g. ("cuda:0", "cuda:0", "cuda:0")
    host_staging: bool

    @property
    def world(self) -> int:
        return len(self.devices)

    def describe(self) -> str:
        """One line: processes, backend, devices."""
        where = sorted(set(self.devices))
        if self.backend == "nccl":
            return f"{self.world} processes, NCCL, one GPU each ({', '.join(self.devices)})"
        if where == ["cpu"]:
            return f"{self.world} processes on the CPU, gloo (Triton interpreter)"
        return (f"{self.world} processes sharing {', '.join(where)}, gloo: every message copied "
                f"through host memory (NCCL needs one GPU per rank)")


def launch_plan(world: int, device: str | None = None, gpus: int | None = None) -> LaunchPlan:
    """Where :func:`run_ranks` puts ``world`` ranks.

    CPU: gloo. GPUs: one process per GPU with NCCL when there are at least ``world`` GPUs.
    Fewer GPUs than ranks (a notebook on one GPU): rank ``r`` runs on GPU ``r mod gpus`` and
    the group is gloo, because NCCL refuses two ranks on one device; gloo moves host memory
    only, so the ring copies each message to the host and back (slow, but on a shared GPU
    correctness is all there is to see).

    Args:
        world: number of ranks.
        device: ``"cpu"`` or ``"cuda"``; None = the device of :func:`course_lib.platform.runtime.current`.
        gpus: GPUs to spread the ranks over; None = ``torch.cuda.device_count()``.

    Returns:
        :class:`LaunchPlan`.
    """
    _check_world(world)
    device = runtime.current().device if device is None else device
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    if device == "cpu":
        return LaunchPlan("gloo", ("cpu",) * world, False)
    gpus = torch.cuda.device_count() if gpus is None else gpus
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
        raise ValueError(f"device='cuda' needs at least one GPU, got gpus = {gpus!r}")
    if gpus >= world:
        return LaunchPlan("nccl", tuple(f"cuda:{r}" for r in range(world)), False)
    return LaunchPlan("gloo", tuple(f"cuda:{r % gpus}" for r in range(world)), True)


def rank_device() -> torch.device:
    """The device of this rank (inside :func:`run_ranks`): its GPU in GPU mode, else the CPU."""
    if runtime.current().on_gpu:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _rank_main(rank, world, store_dir, fn, args, timeout_s, plan: LaunchPlan, mode: str):
    runtime.setup(force=mode, verbose=False)  # the parent's choice, before any kernel is defined
    if plan.devices[rank] != "cpu":
        torch.cuda.set_device(torch.device(plan.devices[rank]))
    if plan.backend == "gloo":
        torch.set_num_threads(1)  # the ranks share the machine's cores
    dist.init_process_group(plan.backend, init_method=f"file://{os.path.join(store_dir, 'store')}",
                            rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))
    try:
        result = fn(rank, world, *args)
        torch.save(result, os.path.join(store_dir, f"result_{rank}.pt"))
    finally:
        dist.destroy_process_group()


def run_ranks(fn, world: int, *args, timeout_s: float | None = None, start_method: str = "spawn",
              backend: str | None = None, device: str | None = None) -> list:
    """Run ``fn(rank, world, *args)`` in ``world`` new processes joined by a process group.

    Where they run is :func:`launch_plan`'s choice for ``device`` (None: the runtime's): gloo on
    CPU; NCCL, one GPU per rank; or gloo on shared GPUs. ``device="cpu"`` on a GPU machine runs
    the ranks in the Triton interpreter. Inside ``fn``, :func:`rank_device` is the rank's device.

    The group meets through a file in a fresh temporary folder (no port to collide with another
    run). ``fn`` must be importable by name (a module-level function of a module, not a
    notebook cell) because the processes are started with ``spawn``. Returns what each rank
    returned, in rank order (it must be picklable by ``torch.save``). A rank that raises stops
    the run with its traceback.

    Args:
        timeout_s: how long a rank waits for the others (None: :data:`DEFAULT_TIMEOUT_S` on CPU,
            :data:`GPU_TIMEOUT_S` on GPUs, where the first call compiles the kernels).
        backend: None (the plan's) or the plan's own backend; any other is refused.
    """
    import torch.multiprocessing as mp

    plan = launch_plan(world, device)
    if backend is not None and backend != plan.backend:
        raise ValueError(f"backend {backend!r} cannot run {world} ranks here: "
                         f"{plan.describe()} (leave backend=None)")
    if timeout_s is None:
        timeout_s = DEFAULT_TIMEOUT_S if plan.devices[0] == "cpu" else GPU_TIMEOUT_S
    mode = runtime.INTERPRETER if plan.devices[0] == "cpu" else runtime.GPU
    with tempfile.TemporaryDirectory(prefix="ring_") as store_dir:
        mp.start_processes(_rank_main, args=(world, store_dir, fn, args, timeout_s, plan, mode),
                           nprocs=world, join=True, start_method=start_method)
        return [torch.load(os.path.join(store_dir, f"result_{r}.pt"), weights_only=False)
                for r in range(world)]


@dataclass(frozen=True)
class RingCase:
    """One ring-attention problem for :func:`run_cases`: ``lengths[r]`` tokens on rank ``r``
    (its ``len`` is the group size), ``B×H`` heads of dim ``d``."""

    lengths: tuple
    causal: bool = False
    layout: str = "contiguous"
    d: int = 16
    batch: int = 1
    heads: int = 2
    dtype: str = "float64"
    seed: int = 0
    backward: bool = True
    label: str = ""
    skew: str | None = None  # error tests: the last rank's shard gets another "dtype" or "d"
    host_staging: bool | None = None  # the ring's choice (None), or forced (tests of the GPU path)

    @property
    def world(self) -> int:
        return len(self.lengths)

    def inputs(self):
        """The whole-sequence ``q, k, v, do`` ``(B, H, N, d)`` on the CPU (the same on every
        rank: seeded)."""
        gen = torch.Generator().manual_seed(self.seed)
        n = int(sum(self.lengths))
        return tuple(torch.randn(self.batch, self.heads, n, self.d, generator=gen,
                                 dtype=torch.float64).to(getattr(torch, self.dtype))
                     for _ in range(4))


@dataclass
class CaseResult:
    """What a rank returns for one :class:`RingCase`: its output shard, gradients and trace,
    on the CPU whichever device computed them."""

    o: torch.Tensor | None = None
    lse: torch.Tensor | None = None
    grads: tuple | None = None
    trace: list = field(default_factory=list)
    error: str | None = None


def run_case(case: RingCase, group=None, device=None) -> CaseResult:
    """Run ``case`` on this rank of ``group`` (its size must be ``case.world``), on ``device``
    (None: :func:`rank_device`)."""
    rank = dist.get_rank(group)
    device = rank_device() if device is None else torch.device(device)
    equal = len(set(case.lengths)) == 1 and case.lengths[0] % 2 == 0
    if case.layout == "zigzag" and equal:
        q, k, v, do = (shard(x, rank, case.world, "zigzag") for x in case.inputs())
    else:  # contiguous, or shards the zig-zag ring must refuse
        q, k, v, do = (shard(x, rank, case.world, "contiguous", case.lengths) for x in case.inputs())
    if case.skew is not None and rank == case.world - 1:
        q, k, v, do = ((x.float() if case.skew == "dtype" else torch.cat([x, x], dim=-1))
                       for x in (q, k, v, do))
    q, k, v, do = (x.to(device) for x in (q, k, v, do))
    q, k, v = (x.requires_grad_(case.backward) for x in (q, k, v))
    trace: list = []
    o, lse = ring_attention_with_lse(q, k, v, case.causal, group=group, layout=case.layout,
                                     trace=trace, host_staging=case.host_staging)
    grads = None
    if case.backward:
        o.backward(do)
        grads = (q.grad.cpu(), k.grad.cpu(), v.grad.cpu())
    return CaseResult(o.detach().cpu(), lse.detach().cpu(), grads, trace)


def context_parallel_layout(causal: bool) -> str:
    """The order PyTorch's ``context_parallel`` shards a sequence in, as one of :data:`LAYOUTS`:
    its head-tail load balancing (chunks ``r`` and ``2W − 1 − r``, our zig-zag) for causal
    calls, contiguous chunks otherwise (it refuses load balancing without a causal mask)."""
    return "zigzag" if causal else "contiguous"


@contextlib.contextmanager
def context_parallel_buffers(mesh, causal: bool, buffers):
    """PyTorch's context parallelism over ``mesh``: inside, ``buffers`` (whole sequences
    ``(B, H, N, d)``) are this rank's shards (in :func:`context_parallel_layout` order, resized
    in place) and ``scaled_dot_product_attention`` runs PyTorch's ring; on exit they are whole
    again.

    ``torch.distributed.tensor.experimental.context_parallel`` balances a causal mask's work by
    default and raises "Load balancing requires `is_causal=True`" for a non-causal SDPA call;
    its switch (``_cp_options.enable_load_balance``, private in torch 2.11-2.13, read when the
    context starts) is set to ``causal`` here and restored after.
    """
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import _cp_options

    before = _cp_options.enable_load_balance
    _cp_options.enable_load_balance = bool(causal)
    try:
        with context_parallel(mesh, buffers=list(buffers), buffer_seq_dims=[2] * len(buffers)):
            yield buffers
    finally:
        _cp_options.enable_load_balance = before


def torch_context_parallel(q, k, v, causal: bool, device_type: str = "cpu"):
    """PyTorch's own ring: ``scaled_dot_product_attention`` inside
    :func:`context_parallel_buffers` over all ranks of the default group.

    ``q, k, v`` are the *whole* sequence ``(B, H, N, d)`` on every rank. Returns this rank's
    output shard (in :func:`context_parallel_layout` order). On CPU with gloo (torch 2.13) it
    raises: the CPU flash-attention operator has no sharding rule, and the math backend mixes
    DTensors with plain tensors.
    """
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device_type, (dist.get_world_size(),))
    q, k, v = (x.detach().clone() for x in (q, k, v))  # it resizes its buffers in place
    with context_parallel_buffers(mesh, causal, [q, k, v]):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


TOKENS_FOR_STATUS = 8
# PyTorch's ring shards the GPU SDPA backends (flash, memory-efficient, cuDNN), which take half
# precision; on CPU the dtype is the interpreter's float64 (it fails there before any arithmetic).
STATUS_DTYPE = {"cpu": "float64", "cuda": "bfloat16"}


def context_parallel_status(rank: int, world: int, case: RingCase | None = None) -> str:
    """For :func:`run_ranks`: try :func:`torch_context_parallel` on ``case`` and say what
    happened, in one line (``"ran"``, ``"not tried: …"`` or the error's type and first line)."""
    device = rank_device()
    if device.type == "cuda" and dist.get_backend() != "nccl":
        return ("not tried: it needs one GPU per rank with NCCL, and these ranks share a GPU "
                "through gloo (tools/bench_ring.py runs it on several GPUs)")
    case = case or RingCase((TOKENS_FOR_STATUS,) * world, causal=True, backward=False,
                            dtype=STATUS_DTYPE[device.type])
    q, k, v, _ = (x.to(device) for x in case.inputs())
    try:
        torch_context_parallel(q, k, v, case.causal, device_type=device.type)
        return "ran"
    except Exception as err:  # noqa: BLE001 - the report is the point
        return f"{type(err).__name__}: {str(err).splitlines()[0]}"


def cases_worker(rank: int, world: int, cases, try_context_parallel: bool = False) -> list:
    """For :func:`run_ranks`: run every case on a subgroup of its size (ranks ``0 … W-1``).

    Subgroups let one set of processes try several world sizes. A case that raises a
    ``ValueError``, ``RuntimeError`` or ``TypeError`` gives ``CaseResult(error=message)`` on
    each rank that ran it; ranks outside a case's subgroup return None for it.
    """
    groups = {}
    for size in sorted({c.world for c in cases}):
        groups[size] = dist.new_group(list(range(size))) if size < world else dist.group.WORLD
    results = []
    for case in cases:
        if rank >= case.world:
            results.append(None)
            continue
        try:
            results.append(run_case(case, groups[case.world]))
        except (ValueError, RuntimeError, TypeError) as err:
            results.append(CaseResult(error=f"{type(err).__name__}: {err}"))
    if try_context_parallel:
        results.append(context_parallel_status(rank, world))
    return results


def run_cases(cases, world: int | None = None, **kwargs) -> list[list]:
    """Run :class:`RingCase` s in ``world`` processes (default: the largest case's size);
    ``kwargs`` go to :func:`run_ranks` (``device``, ``timeout_s``, …).

    Returns ``results[case][rank]`` (:class:`CaseResult`, None for ranks outside the case).
    """
    cases = list(cases)
    world = world or max(c.world for c in cases)
    per_rank = run_ranks(cases_worker, world, cases, **kwargs)
    return [[per_rank[r][i] for r in range(world)] for i in range(len(cases))]


def run_cases_and_context_parallel(cases, world: int | None = None, **kwargs):
    """:func:`run_cases`, and in the same processes an attempt at PyTorch's context_parallel
    (:func:`context_parallel_status`): ``(results, status of rank 0)``."""
    cases = list(cases)
    world = world or max(c.world for c in cases)
    per_rank = run_ranks(cases_worker, world, cases, True, **kwargs)
    results = [[per_rank[r][i] for r in range(world)] for i in range(len(cases))]
    return results, per_rank[0][-1]


def reference(case: RingCase):
    """Float64 SDPA on the whole sequence: ``(o, dq, dk, dv)`` ``(B, H, N, d)`` for ``case``."""
    import torch.nn.functional as F

    q, k, v, do = (x.double().requires_grad_(True) for x in case.inputs())
    o = F.scaled_dot_product_attention(q, k, v, is_causal=case.causal)
    o.backward(do.detach())
    return o.detach(), q.grad, k.grad, v.grad


GATHERED = ("o", "dq", "dk", "dv")


def gather(results, case: RingCase, what: str = "o") -> torch.Tensor:
    """One field of every rank's :class:`CaseResult`, put back in sequence order.

    ``what``: one of :data:`GATHERED`. A rank that failed raises a RuntimeError with its error.
    """
    if what not in GATHERED:
        raise ValueError(f"what must be one of {GATHERED}, got {what!r}")
    ranks = results[:case.world]
    failed = [(r, res.error) for r, res in enumerate(ranks) if res is None or res.error is not None]
    if failed:
        raise RuntimeError("the case did not run on every rank: " + "; ".join(
            f"rank {r}: {error or 'no result'}" for r, error in failed))
    if what != "o" and ranks[0].grads is None:
        raise ValueError(f"{what!r} needs gradients: this case ran with backward=False")
    pick = {"o": lambda r: r.o, "dq": lambda r: r.grads[0], "dk": lambda r: r.grads[1],
            "dv": lambda r: r.grads[2]}[what]
    return unshard([pick(r) for r in ranks], case.layout)


"""Checks for chapter 11 (ring attention): exercise 11.1, merging a block's partial result into
the running ``(o, lse)``; 11.2, the ring's step loop, simulated in one process.

Both are compared with :mod:`course_lib.integrations.ring` on cases that vary what a mistake can depend on:
log-sum-exps near ±1000 and hundreds apart (a merge without the max shift overflows), an empty
running state (the first step), float32 and float64, leading dims; for the loop, 2 to 4 ranks,
ragged contiguous shards and zig-zag shards, causal and not. A "likely cause" is named only when
exactly one of the known mistakes below (``MERGE_MISTAKES``, ``LOOP_MISTAKES``) reproduces the
learner's output on every case.

Exercise 11.2 is a simulation: all ranks live in one list, and "sending to the next rank" is a
rotation of that list. The real ring (``ring.ring_attention``) does the same steps in separate
processes with ``torch.distributed``; the notebook runs it after this exercise.
"""

from __future__ import annotations

import math

import torch

from course_lib.integrations import ring
from course_lib.teaching.checks import TOLERANCES, Case, check_function, learner_check
from course_lib.attention.reference import naive_attention_torch

# ----------------------------------------------------------------------------------------------
# Exercise 11.1: merge_partials(o, lse, o_blk, lse_blk) -> (o, lse)
# ----------------------------------------------------------------------------------------------


def _merged_lse(lse, lse_blk):
    return torch.logaddexp(lse, lse_blk)


def _merge_sum(o, lse, o_blk, lse_blk):
    return o + o_blk, _merged_lse(lse, lse_blk)


def _merge_average(o, lse, o_blk, lse_blk):
    return (o + o_blk) / 2, _merged_lse(lse, lse_blk)


def _merge_lse_max(o, lse, o_blk, lse_blk):
    return ring.merge_partials(o, lse, o_blk, lse_blk)[0], torch.maximum(lse, lse_blk)


def _merge_lse_sum(o, lse, o_blk, lse_blk):
    return ring.merge_partials(o, lse, o_blk, lse_blk)[0], lse + lse_blk


def _merge_no_shift(o, lse, o_blk, lse_blk):
    w, w_blk = torch.exp(lse), torch.exp(lse_blk)  # overflows past ~709 (float64), ~88 (float32)
    total = w + w_blk
    return (w[..., None] * o + w_blk[..., None] * o_blk) / total[..., None], torch.log(total)


def _merge_not_normalised(o, lse, o_blk, lse_blk):
    m = torch.maximum(lse, lse_blk)
    w, w_blk = torch.exp(lse - m), torch.exp(lse_blk - m)
    return w[..., None] * o + w_blk[..., None] * o_blk, ring.merge_partials(o, lse, o_blk, lse_blk)[1]


def _merge_running_not_rescaled(o, lse, o_blk, lse_blk):
    new = _merged_lse(lse, lse_blk)
    return o + torch.exp(lse_blk - new)[..., None] * o_blk, new


def _merge_block_not_rescaled(o, lse, o_blk, lse_blk):
    new = _merged_lse(lse, lse_blk)
    return torch.exp(lse - new)[..., None] * o + o_blk, new


def _merge_weights_swapped(o, lse, o_blk, lse_blk):
    new = _merged_lse(lse, lse_blk)
    w, w_blk = torch.exp(lse - new), torch.exp(lse_blk - new)
    return w_blk[..., None] * o + w[..., None] * o_blk, new


MERGE_MISTAKES = {
    "the two outputs are added: each o is already normalised over its own keys, so weigh each "
    "by its share of the merged softmax, exp(lse_part − lse_new)": _merge_sum,
    "the two outputs are averaged: a part's weight is its share of the merged softmax, "
    "exp(lse_part − lse_new), not 1/2": _merge_average,
    "the new lse is the larger of the two: the merged log-sum-exp is log(exp(lse) + "
    "exp(lse_blk)) = m + log(exp(lse − m) + exp(lse_blk − m))": _merge_lse_max,
    "the new lse is lse + lse_blk: log-sum-exps combine by log(exp(a) + exp(b)), not by "
    "adding": _merge_lse_sum,
    "exp(lse) is taken without subtracting the max: it overflows (inf, then inf/inf = NaN) once "
    "an lse passes ~88 in float32 or ~709 in float64 — subtract m = max(lse, lse_blk) first, or "
    "use torch.logaddexp": _merge_no_shift,
    "the weighted sum is not divided by the total weight exp(lse − m) + exp(lse_blk − m)":
        _merge_not_normalised,
    "the running output is not rescaled: it too must be multiplied by its share, "
    "exp(lse − lse_new)": _merge_running_not_rescaled,
    "the block's output is not weighted: it too must be multiplied by its share, "
    "exp(lse_blk − lse_new)": _merge_block_not_rescaled,
    "the weights are swapped: the running o gets exp(lse − lse_new) and the block's o gets "
    "exp(lse_blk − lse_new)": _merge_weights_swapped,
}


def _partial(gen, shape, offset, spread, dtype):
    """A real partial result: attention of random rows to a few random keys, lse shifted."""
    *lead, n, d = shape
    q = torch.randn(*lead, n, d, generator=gen, dtype=torch.float64)
    k = torch.randn(*lead, 3, d, generator=gen, dtype=torch.float64) * spread
    v = torch.randn(*lead, 3, d, generator=gen, dtype=torch.float64)
    o, lse = naive_attention_torch(q, k, v, scale=1.0)
    return o.to(dtype), (lse + offset).to(dtype)


def _merge_cases() -> list[Case]:
    gen = torch.Generator().manual_seed(1101)
    f64, f32 = torch.float64, torch.float32
    empty_o, empty_lse = _partial(gen, (2, 3, 5, 4), 0.0, 1.0, f64)
    empty_o[:, :, :2] = 0  # the first two rows have seen no key yet
    empty_lse[:, :, :2] = -math.inf
    return [
        Case((*_partial(gen, (2, 3, 5, 4), 0.0, 1.0, f64), *_partial(gen, (2, 3, 5, 4), 1.5, 1.0, f64)),
             label="(B, H, n, d) = (2, 3, 5, 4), float64"),
        Case((*_partial(gen, (4, 6), 1000.0, 3.0, f64), *_partial(gen, (4, 6), 1003.0, 3.0, f64)),
             label="lse near 1000 (exp(lse) overflows)"),
        Case((*_partial(gen, (3, 7, 8), -300.0, 2.0, f64), *_partial(gen, (3, 7, 8), 200.0, 2.0, f64)),
             label="lse 500 apart: the block outweighs the running state"),
        Case((empty_o, empty_lse, *_partial(gen, (2, 3, 5, 4), 0.5, 1.0, f64)),
             label="an empty running state in rows 0-1 (lse = -inf, o = 0): the first step"),
        Case((*_partial(gen, (2, 9, 16), 60.0, 1.0, f32), *_partial(gen, (2, 9, 16), 95.0, 1.0, f32)),
             label="float32, lse near 60 and 95"),
        Case(_far_apart_rows(gen), label="float32, rows whose lse are far apart in one call "
                                         f"(about {FAR_APART_LSE[0]:g} and {FAR_APART_LSE[1]:g})"),
    ]


# Log-sum-exps of different rows in one call: a max taken over the whole tensor instead of per
# row leaves the low rows weights of exp(0.5 − 120) ≈ 1e-52, which is 0 in float32 (0 / 0).
FAR_APART_LSE = (0.5, 120.0)


def _far_apart_rows(gen) -> tuple:
    """(o, lse, o_blk, lse_blk) float32 whose rows alternate between lse near
    FAR_APART_LSE[0] and near FAR_APART_LSE[1], the block's close to the running state's."""
    low, high = FAR_APART_LSE
    o, lse = _partial(gen, (3, 6, 8), 0.0, 1.0, torch.float64)
    o_blk, lse_blk = _partial(gen, (3, 6, 8), 0.0, 1.0, torch.float64)
    rows = torch.tensor([low, high] * 3, dtype=torch.float64)  # (6,) one offset per row
    return (o.float(), (lse - lse.mean() + rows).float(), o_blk.float(),
            (lse_blk - lse_blk.mean() + rows + 0.7).float())


@learner_check
def check_merge_partials(fn):
    """Check exercise 11.1, ``merge_partials(o, lse, o_blk, lse_blk) -> (o, lse)``; return the
    function to continue with."""
    return check_function("Exercise 11.1", fn, reference=ring.merge_partials,
                          cases=_merge_cases(), mistakes=MERGE_MISTAKES,
                          output_names=("o", "lse"))


# ----------------------------------------------------------------------------------------------
# Exercise 11.2: the ring's step loop, simulated in one process
# ----------------------------------------------------------------------------------------------

def _empty_state(q_shards):
    """Each rank's running ``(o, lse)`` before its first block, on its queries' device (on a GPU
    the blocks come from the GPU kernel, and the merge needs both states on one device)."""
    o = [torch.zeros_like(q) for q in q_shards]
    lse = [torch.full(q.shape[:-1], -math.inf, dtype=q.dtype, device=q.device) for q in q_shards]
    return o, lse


def simulate_ring(q_shards, k_shards, v_shards, causal, layout, attend, *, data_from=None,
                  plan_from=None, diagonal_causal=True, skip_hidden=True, merge=True,
                  use_plan=True):
    """The ring forward of all ranks in one process: ``(o_shards, lse_shards)``.

    Step ``s``: rank ``r`` holds the K/V shard of ``(r - s) mod W``, computes the block
    :func:`ring.block_plan` says, and merges it (:func:`ring.merge_partials`); then every rank
    passes what it holds to rank ``r + 1``. The keyword arguments replay mistakes (the check's
    models); their defaults are the right ring.
    """
    world = len(q_shards)
    chunks = ring.rank_chunks(world, layout)
    lengths = ring.shard_chunk_lengths([q.shape[-2] for q in q_shards], layout)
    data_from = data_from or (lambda r, step: (r - step) % world)
    plan_from = plan_from or (lambda r, step: (r - step) % world)
    o, lse = _empty_state(q_shards)
    for step in range(world):
        for r in range(world):
            src, planned = data_from(r, step), plan_from(r, step)
            plan = ring.block_plan(chunks[r], chunks[planned], causal, lengths[r], lengths[planned])
            if plan is None:
                if skip_hidden:
                    continue
                plan = ring.BlockPlan(slice(None), slice(None), False)
            if not use_plan:
                plan = ring.BlockPlan(slice(None), slice(None), plan.causal)
            k, v = k_shards[src][..., plan.cols, :], v_shards[src][..., plan.cols, :]
            o_blk, lse_blk = attend(q_shards[r][..., plan.rows, :], k, v,
                                    plan.causal if diagonal_causal else causal)
            if merge:
                o[r][..., plan.rows, :], lse[r][..., plan.rows] = ring.merge_partials(
                    o[r][..., plan.rows, :], lse[r][..., plan.rows], o_blk, lse_blk)
            else:
                o[r][..., plan.rows, :], lse[r][..., plan.rows] = o_blk, lse_blk
    return o, lse


def ring_reference(q_shards, k_shards, v_shards, causal, layout, attend):
    """The right answer of exercise 11.2 (and its fallback)."""
    return simulate_ring(q_shards, k_shards, v_shards, causal, layout, attend)


LOOP_MISTAKES = {
    # Holding rank (r + s)'s data with rank (r − s)'s plan, or the reverse, give the same
    # outputs (over all steps the two sets of pairs are the same): one cause for both.
    "the K/V shard a rank holds and the plan it computes disagree: everyone passes to the "
    "right (rank r receives held[(r − 1) % W]), so at step s rank r holds rank (r − s) mod W's "
    "shard, and the plan must be made for that source":
        lambda *a: simulate_ring(*a, data_from=lambda r, s: (r + s) % len(a[0])),
    "the shards are passed on before the block is computed: at step 0 each rank must first "
    "attend to its own shard":
        lambda *a: simulate_ring(*a, data_from=lambda r, s: (r - s - 1) % len(a[0])),
    "every block gets the causal mask: only the diagonal block (plan.causal) needs it; earlier "
    "blocks are fully visible":
        lambda *a: simulate_ring(*a, diagonal_causal=False),
    "blocks hidden by the causal mask (plan is None) are computed anyway: skip them":
        lambda *a: simulate_ring(*a, skip_hidden=False),
    "the block's result replaces the running state: merge it with merge_partials":
        lambda *a: simulate_ring(*a, merge=False),
    "the whole shards are attended, not plan.rows and plan.cols: with zig-zag shards only part "
    "of each block is visible":
        lambda *a: simulate_ring(*a, use_plan=False),
}


def _shards(case_seed, lengths, layout, d=16, lead=(1, 2), dtype=torch.float64):
    gen = torch.Generator().manual_seed(case_seed)
    n = sum(lengths)
    whole = [torch.randn(*lead, n, d, generator=gen, dtype=torch.float64).to(dtype)
             for _ in range(3)]
    world = len(lengths)
    if layout == "zigzag":
        return [[ring.shard(x, r, world, "zigzag") for r in range(world)] for x in whole]
    return [[ring.shard(x, r, world, lengths=lengths) for r in range(world)] for x in whole]


def _attend(q, k, v, causal):
    return naive_attention_torch(q, k, v, causal=causal)


def _loop_cases() -> list[Case]:
    cases = []
    for seed, lengths, causal, layout, lead, dtype, label in [
        (1, (6, 6), False, "contiguous", (1, 2), torch.float64, "2 ranks, 6 tokens each"),
        (2, (5, 9, 3), True, "contiguous", (1, 2), torch.float64, "3 ranks, ragged 5/9/3, causal"),
        (3, (4, 4, 4, 4), True, "zigzag", (2, 1), torch.float64, "4 ranks, zig-zag, causal"),
        (4, (6, 6, 6), False, "zigzag", (1, 1), torch.float64, "3 ranks, zig-zag, not causal"),
        (5, (7, 2, 4, 5), True, "contiguous", (3,), torch.float32, "4 ranks, ragged, causal, float32"),
    ]:
        q, k, v = _shards(seed, lengths, layout, lead=lead, dtype=dtype)
        cases.append(Case((q, k, v, causal, layout, _attend), label=label))
    return cases


@learner_check
def check_ring_loop(fn):
    """Check exercise 11.2, ``ring_forward_sim(q_shards, k_shards, v_shards, causal, layout,
    attend) -> (o_shards, lse_shards)``; return the function to continue with."""
    # the outputs are lists of tensors, one per rank (checks' default tolerance reads one
    # tensor's dtype): float32's tolerance for all, far below the O(1) errors of a wrong loop
    return check_function("Exercise 11.2", fn, reference=ring_reference, cases=_loop_cases(),
                          mistakes=LOOP_MISTAKES, tolerance=TOLERANCES["float32"],
                          output_names=("o_shards", "lse_shards"))


LOOP_HINTS = [
    "Inside the step loop, visit every rank <code>r</code>. Which K/V shard does it hold at this "
    "step? Everyone passes to the right, so after <code>step</code> hops rank <code>r</code> "
    "holds rank <code>(r - step) % world</code>'s shard: call it <code>src</code>.",
    "Ask <code>ring.block_plan(chunks[r], chunks[src], causal, lengths[r], lengths[src])</code> "
    "what to compute. <code>None</code> means the causal mask hides the whole block: "
    "<code>continue</code>.",
    "Attend the rows <code>plan.rows</code> of rank r's queries to the rows "
    "<code>plan.cols</code> of the K/V it holds: <code>attend(q_shards[r][..., plan.rows, :], "
    "held_k[r][..., plan.cols, :], held_v[r][..., plan.cols, :], plan.causal)</code>.",
    "Merge into the same rows of the running state with your <code>merge_partials</code> "
    "(exercise 11.1) and store the result back: <code>o[r][..., plan.rows, :], "
    "lse[r][..., plan.rows] = merge_partials(...)</code>.",
    "After all ranks computed, pass the shards on: rank r now gets what rank r − 1 held, "
    "<code>held_k = [held_k[(r - 1) % world] for r in range(world)]</code>, and the same for "
    "<code>held_v</code>.",
]

LOOP_SKELETON = '''\
for r in range(world):
    src = ...                                  # whose K/V shard rank r holds at this step
    plan = ...                                 # ring.block_plan(...), None: hidden by the mask
    if plan is None:
        continue
    o_blk, lse_blk = ...                       # attend(q rows plan.rows, k/v rows plan.cols, plan.causal)
    o[r][..., plan.rows, :], lse[r][..., plan.rows] = ...   # merge_partials
held_k = ...                                   # rank r receives what rank r - 1 held
held_v = ...'''

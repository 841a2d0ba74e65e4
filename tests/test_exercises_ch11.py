"""Chapter 11 checks: the reference passes, a stub is "not done yet", every known mistake is
rejected with its cause named, and answers written as learners write them are judged right."""

from __future__ import annotations

import math

import pytest
import torch

from corpus_checks import assert_rejected, one
from course_lib.integrations import ring
from course_lib.teaching.checks import ExerciseFailed
from course_lib.teaching.exercises import ch11
from course_lib.teaching.widgets.hints import HintLadder

pytestmark = pytest.mark.ch11

CHECKS = {
    "11.1": (ch11.check_merge_partials, ch11.MERGE_MISTAKES, ring.merge_partials),
    "11.2": (ch11.check_ring_loop, ch11.LOOP_MISTAKES, ch11.ring_reference),
}


def _stub(*args):
    raise NotImplementedError("Exercise 11.x")


@pytest.mark.parametrize("exercise", CHECKS)
def test_reference_passes_and_stub_falls_back(exercise, capsys):
    check, _, reference = CHECKS[exercise]
    assert check(reference) is reference
    assert check(_stub) is not _stub
    out = capsys.readouterr().out
    assert f"Exercise {exercise}: passed" in out and "not done yet" in out


@pytest.mark.parametrize("exercise, cause", [(e, c) for e, (_, ms, _) in CHECKS.items() for c in ms])
def test_each_mistake_is_rejected_with_its_cause(exercise, cause):
    check, mistakes, _ = CHECKS[exercise]
    with pytest.raises(ExerciseFailed) as info:
        check(mistakes[cause])
    message = str(info.value)
    assert f"Exercise {exercise}" in message and f"likely cause: {cause}" in message


# ---------------------------------------------------------------- 11.1, as learners write it

def merge_logaddexp(o, lse, o_blk, lse_blk):  # the notebook's answer
    lse_new = torch.logaddexp(lse, lse_blk)
    w, w_blk = torch.exp(lse - lse_new)[..., None], torch.exp(lse_blk - lse_new)[..., None]
    return w * o + w_blk * o_blk, lse_new


def merge_chapter_03(o, lse, o_blk, lse_blk):  # (m, l, o) with l = 1, via the max
    m = torch.maximum(lse, lse_blk)
    a, b = torch.exp(lse - m), torch.exp(lse_blk - m)
    out = (a[..., None] * o + b[..., None] * o_blk) / (a + b)[..., None]
    return out, m + torch.log(a + b)


def merge_sigmoid(o, lse, o_blk, lse_blk):  # the block's share is a sigmoid of the difference
    share = torch.sigmoid(lse_blk - lse)[..., None]
    return o + share * (o_blk - o), torch.logaddexp(lse, lse_blk)


def merge_naive_exp(o, lse, o_blk, lse_blk):
    total = torch.exp(lse) + torch.exp(lse_blk)
    return ((torch.exp(lse)[..., None] * o + torch.exp(lse_blk)[..., None] * o_blk)
            / total[..., None]), torch.log(total)


def merge_lse_max(o, lse, o_blk, lse_blk):
    lse_new = torch.logaddexp(lse, lse_blk)
    w, w_blk = torch.exp(lse - lse_new)[..., None], torch.exp(lse_blk - lse_new)[..., None]
    return w * o + w_blk * o_blk, torch.max(lse, lse_blk)


def merge_sum_outputs(o, lse, o_blk, lse_blk):
    return o + o_blk, torch.logaddexp(lse, lse_blk)


def merge_forgets_broadcast(o, lse, o_blk, lse_blk):  # weights (..., n) against (..., n, d)
    lse_new = torch.logaddexp(lse, lse_blk)
    return torch.exp(lse - lse_new) * o + torch.exp(lse_blk - lse_new) * o_blk, lse_new


M = ch11.MERGE_MISTAKES


@pytest.mark.parametrize("answer", [merge_logaddexp, merge_chapter_03, merge_sigmoid])
def test_right_merges_in_other_styles_pass(answer):
    assert ch11.check_merge_partials(answer) is answer


@pytest.mark.parametrize("answer, cause", [
    (merge_naive_exp, one(M, "exp(lse) is taken without")),
    (merge_lse_max, one(M, "the new lse is the larger")),
    (merge_sum_outputs, one(M, "the two outputs are added")),
    (merge_forgets_broadcast, None),  # a crash or a shape error: no cause to name
])
def test_wrong_merges_are_rejected(answer, cause):
    assert_rejected(ch11.check_merge_partials, answer, cause)


# ---------------------------------------------------------------- 11.2, as learners write it

def loop(q_shards, k_shards, v_shards, causal, layout, attend, *, body):
    """The notebook's frame around the learner's loop body."""
    world = len(q_shards)
    chunks = ring.rank_chunks(world, layout)
    lengths = ring.shard_chunk_lengths([q.shape[-2] for q in q_shards], layout)
    o = [torch.zeros_like(q) for q in q_shards]
    lse = [torch.full(q.shape[:-1], -math.inf, dtype=q.dtype, device=q.device) for q in q_shards]
    held = [list(k_shards), list(v_shards)]
    for step in range(world):
        body(step, world, chunks, lengths, q_shards, held, o, lse, causal, attend)
    return o, lse


def body_right(step, world, chunks, lengths, q_shards, held, o, lse, causal, attend):
    for r in range(world):
        src = (r - step) % world
        plan = ring.block_plan(chunks[r], chunks[src], causal, lengths[r], lengths[src])
        if plan is None:
            continue
        o_blk, lse_blk = attend(q_shards[r][..., plan.rows, :], held[0][r][..., plan.cols, :],
                                held[1][r][..., plan.cols, :], plan.causal)
        o[r][..., plan.rows, :], lse[r][..., plan.rows] = ring.merge_partials(
            o[r][..., plan.rows, :], lse[r][..., plan.rows], o_blk, lse_blk)
    held[0][:] = [held[0][(r - 1) % world] for r in range(world)]
    held[1][:] = [held[1][(r - 1) % world] for r in range(world)]


def body_rotates_left(step, world, chunks, lengths, q_shards, held, o, lse, causal, attend):
    for r in range(world):
        src = (r - step) % world
        plan = ring.block_plan(chunks[r], chunks[src], causal, lengths[r], lengths[src])
        if plan is None:
            continue
        o_blk, lse_blk = attend(q_shards[r][..., plan.rows, :], held[0][r][..., plan.cols, :],
                                held[1][r][..., plan.cols, :], plan.causal)
        o[r][..., plan.rows, :], lse[r][..., plan.rows] = ring.merge_partials(
            o[r][..., plan.rows, :], lse[r][..., plan.rows], o_blk, lse_blk)
    held[0][:] = [held[0][(r + 1) % world] for r in range(world)]
    held[1][:] = [held[1][(r + 1) % world] for r in range(world)]


def body_causal_everywhere(step, world, chunks, lengths, q_shards, held, o, lse, causal, attend):
    for r in range(world):
        src = (r - step) % world
        plan = ring.block_plan(chunks[r], chunks[src], causal, lengths[r], lengths[src])
        if plan is None:
            continue
        o_blk, lse_blk = attend(q_shards[r][..., plan.rows, :], held[0][r][..., plan.cols, :],
                                held[1][r][..., plan.cols, :], causal)
        o[r][..., plan.rows, :], lse[r][..., plan.rows] = ring.merge_partials(
            o[r][..., plan.rows, :], lse[r][..., plan.rows], o_blk, lse_blk)
    held[0][:] = [held[0][(r - 1) % world] for r in range(world)]
    held[1][:] = [held[1][(r - 1) % world] for r in range(world)]


def body_overwrites(step, world, chunks, lengths, q_shards, held, o, lse, causal, attend):
    for r in range(world):
        src = (r - step) % world
        plan = ring.block_plan(chunks[r], chunks[src], causal, lengths[r], lengths[src])
        if plan is None:
            continue
        o[r][..., plan.rows, :], lse[r][..., plan.rows] = attend(
            q_shards[r][..., plan.rows, :], held[0][r][..., plan.cols, :],
            held[1][r][..., plan.cols, :], plan.causal)
    held[0][:] = [held[0][(r - 1) % world] for r in range(world)]
    held[1][:] = [held[1][(r - 1) % world] for r in range(world)]


def body_forgets_to_pass(step, world, chunks, lengths, q_shards, held, o, lse, causal, attend):
    for r in range(world):
        src = (r - step) % world
        plan = ring.block_plan(chunks[r], chunks[src], causal, lengths[r], lengths[src])
        if plan is None:
            continue
        o_blk, lse_blk = attend(q_shards[r][..., plan.rows, :], held[0][r][..., plan.cols, :],
                                held[1][r][..., plan.cols, :], plan.causal)
        o[r][..., plan.rows, :], lse[r][..., plan.rows] = ring.merge_partials(
            o[r][..., plan.rows, :], lse[r][..., plan.rows], o_blk, lse_blk)


def as_answer(body):
    def answer(q_shards, k_shards, v_shards, causal, layout, attend):
        return loop(q_shards, k_shards, v_shards, causal, layout, attend, body=body)
    return answer


L = ch11.LOOP_MISTAKES


def test_a_learner_style_loop_passes():
    answer = as_answer(body_right)
    assert ch11.check_ring_loop(answer) is answer


@pytest.mark.parametrize("body, cause", [
    (body_rotates_left, one(L, "the K/V shard a rank holds and the plan")),
    (body_causal_everywhere, one(L, "every block gets the causal mask")),
    (body_overwrites, one(L, "the block's result replaces")),
    (body_forgets_to_pass, None),  # the same shard every step: no model does that
])
def test_wrong_loops_are_rejected(body, cause):
    assert_rejected(ch11.check_ring_loop, as_answer(body), cause)


def test_hint_ladder_and_skeleton():
    ladder = HintLadder("Exercise 11.2", ch11.LOOP_HINTS, skeleton=ch11.LOOP_SKELETON)
    assert ladder.next_hint() == ch11.LOOP_HINTS[0] and "(r - step) % world" in ch11.LOOP_HINTS[0]
    assert ladder.show_skeleton() == ch11.LOOP_SKELETON
    assert "ring.block_plan" in ch11.LOOP_SKELETON and "merge_partials" in ch11.LOOP_SKELETON


# ---------------------------------------------------------------- device: the GPU path, emulated on CPU

def _exercise_frame(name: str):
    """The notebook's exercise 11.2 cell (solutions/), run as the notebook runs it."""
    import json
    from pathlib import Path

    nb = json.loads((Path(__file__).resolve().parent.parent / "solutions" / "11_ring_attention.ipynb").read_text())
    source = next(c["source"] for c in nb["cells"] if c["source"].startswith("# Exercise 11.2"))
    namespace = {"math": math, "torch": torch, "ring": ring, "merge_partials": ring.merge_partials}
    exec(compile(source, "exercise 11.2", "exec"), namespace)  # noqa: S102 - the notebook's own cell
    return namespace[name]


def _meta_attend(q, k, v, causal):
    """A block's (o, lse) on the queries' device: as the GPU kernel returns them, on meta tensors."""
    from course_lib.attention.reference import naive_attention_torch

    return naive_attention_torch(q, k, v, causal=causal)


@pytest.mark.parametrize("loop", ["library", "notebook"])
def test_simulated_ring_keeps_its_state_on_the_shards_device(loop):
    """On a GPU the blocks come from the GPU kernel; a running (o, lse) left on the CPU made the
    merge fail ("Expected all tensors to be on the same device"). Meta tensors stand in for CUDA
    ones here: any CPU tensor mixed in raises the same way."""
    fn = ch11.ring_reference if loop == "library" else _exercise_frame("ring_forward_sim")
    q, k, v = ([x.to("meta") for x in shards] for shards in ch11._shards(0, (4, 4, 4), "zigzag"))
    o, lse = fn(q, k, v, True, "zigzag", _meta_attend)
    assert all(x.device.type == "meta" for x in (*o, *lse))
    assert [tuple(x.shape) for x in o] == [tuple(x.shape) for x in q]


def test_a_cpu_state_beside_device_blocks_is_what_failed():
    """The check above can fail: the old frame (lse on the CPU) raises on meta blocks."""
    q = torch.zeros(1, 2, 4, 16, device="meta")
    with pytest.raises(RuntimeError, match="device"):
        ring.merge_partials(torch.zeros_like(q), torch.full(q.shape[:-1], -math.inf), q, q[..., 0])


@pytest.mark.gpu
def test_simulated_ring_with_the_gpu_kernel_gpu():
    """The notebook's cell after exercise 11.2, on the GPU: three simulated ranks with the course's
    kernel as attend, against float64 SDPA."""
    import course_lib
    import torch.nn.functional as F

    gen = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(1, 2, 48, 32, generator=gen).cuda() for _ in range(3))
    shards = [[ring.shard(x, r, 3, "zigzag") for r in range(3)] for x in (q, k, v)]
    for fn in (ch11.ring_reference, _exercise_frame("ring_forward_sim")):
        o_shards, _ = fn(*shards, True, "zigzag", course_lib.flash_attention_with_lse)
        o = ring.unshard(o_shards, "zigzag")
        exact = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True)
        assert o.is_cuda and (o.double() - exact).abs().max().item() < 1e-5

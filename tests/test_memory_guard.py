"""The memory guard: in Triton's interpreter every load, store and atomic of a learner's kernel
is checked against the tensors the check handed it, before the access (issue 19)."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from course_lib.teaching import kernel_checks
from course_lib.platform import runtime
from course_lib.teaching.kernel_checks import MemoryViolation, memory_guard

pytestmark = pytest.mark.skipif(not runtime.current().interpreted,
                                reason="the guard checks accesses in Triton's interpreter only")


@triton.jit
def copy_kernel(x_ptr, y_ptr, n, stride_x, BLOCK: tl.constexpr, MASKED: tl.constexpr,
                SHIFT: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    if MASKED:
        x = tl.load(x_ptr + (offs + SHIFT) * stride_x, mask=mask, other=0.0)
    else:
        x = tl.load(x_ptr + (offs + SHIFT) * stride_x)
    tl.store(y_ptr + offs, x, mask=mask)


@triton.jit
def discarding_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs)  # reads past the end ...
    tl.store(y_ptr + offs, tl.where(offs < n, x, 0.0), mask=offs < n)  # ... then discards it


@triton.jit
def store_into_input_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n)
    tl.store(x_ptr + offs, x * 2, mask=offs < n)  # the wrong pointer


@triton.jit
def rows_kernel(a_ptr, out_ptr, n_cols, stride_row, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    a = tl.load(a_ptr + row * stride_row + cols, mask=cols < n_cols)
    tl.store(out_ptr + row * n_cols + cols, a, mask=cols < n_cols)


def run_copy(x, y, masked=True, shift=0, block=16):
    n = y.numel()
    with memory_guard() as guard:
        guard.allow("x", x)
        guard.allow("y", y, write=True)
        copy_kernel[(triton.cdiv(n, block),)](x, y, n, x.stride(0), BLOCK=block, MASKED=masked,
                                              SHIFT=shift)


def test_a_masked_kernel_runs_untouched():
    x = torch.randn(37)
    y = torch.empty(37)
    run_copy(x, y)
    assert torch.equal(x, y)


def test_a_strided_input_is_checked_element_by_element():
    base = torch.randn(37, 3)
    x = base[:, 1]  # stride 3: the elements between are not x's
    y = torch.empty(37)
    run_copy(x, y)
    assert torch.equal(x, y)


def test_an_unmasked_load_past_the_end_is_stopped_before_it_happens():
    x, y = torch.randn(37), torch.empty(37)
    with pytest.raises(MemoryViolation) as info:
        run_copy(x, y, masked=False)
    msg = str(info.value)
    assert "tl.load" in msg and "program id (2, 0, 0)" in msg and "`x`" in msg, msg
    assert "index 37" in msg or "index (37,)" in msg, msg
    assert "mask" in msg


def test_a_read_whose_value_is_discarded_still_fails():
    x, y = torch.randn(37), torch.empty(37)
    with pytest.raises(MemoryViolation, match="tl.load"):
        with memory_guard() as guard:
            guard.allow("x", x)
            guard.allow("y", y, write=True)
            discarding_kernel[(3,)](x, y, 37, BLOCK=16)


def test_a_store_into_an_input_is_refused_and_the_input_is_unchanged():
    x, y = torch.randn(37), torch.empty(37)
    before = x.clone()
    with pytest.raises(MemoryViolation) as info:
        with memory_guard() as guard:
            guard.allow("x", x)
            guard.allow("y", y, write=True)
            store_into_input_kernel[(3,)](x, y, 37, BLOCK=16)
    assert "`x` is an input" in str(info.value)
    assert torch.equal(x, before)


def test_an_address_far_away_is_stopped_without_harm():
    x, y = torch.randn(37), torch.empty(37)
    with pytest.raises(MemoryViolation) as info:
        run_copy(x, y, shift=10**9)  # would be a segmentation fault without the guard
    assert "outside every tensor" in str(info.value)


def test_another_tensors_stride_is_named():
    a = torch.randn(5, 7)
    b = torch.randn(5, 11)
    out = torch.empty(5, 7)
    with pytest.raises(MemoryViolation) as info:
        with memory_guard() as guard:
            guard.allow("a", a)
            guard.allow("b", b)
            guard.allow("out", out, write=True)
            rows_kernel[(5,)](a, out, 7, b.stride(0), BLOCK=8)  # a's rows with b's row stride
    msg = str(info.value)
    assert "`a`" in msg and "strides" in msg and "(11, 1)" in msg, msg


def test_the_guarded_run_reports_the_guard_diagnosis():
    run = kernel_checks.GuardedRun(
        launch=lambda x, y: copy_kernel[(3,)](x, y, 37, x.stride(0), BLOCK=16, MASKED=False,
                                                 SHIFT=0),
        margins=[(5,)], outputs=[kernel_checks.Output("y", (5,))])
    with pytest.raises(Exception) as info:
        run(torch.randn(37))
    chain = kernel_checks.exception_chain(info.value)
    assert any(isinstance(e, MemoryViolation) for e in chain)


def test_no_guard_outside_the_block():
    x, y = torch.randn(37), torch.empty(37)
    with memory_guard():
        pass
    copy_kernel[(3,)](x, y, 37, 1, BLOCK=16, MASKED=True, SHIFT=0)  # unguarded, fine
    assert torch.equal(x, y)


def test_the_first_program_past_the_other_axis_extent_is_named():
    """Program ids swapped: the first fault comes at the first program whose id on one axis
    reaches the other axis's extent, every other id 0. Only that crisp pattern is reported."""
    from course_lib.teaching.kernel_checks import _swapped_program_ids_note

    note = _swapped_program_ids_note((2, 0), (3, 2))
    assert "program_id(0) = 2 reaches the grid's extent along axis 1 (2)" in note, note
    assert "(the two program ids swapped)" in note
    assert "program_id(1) = 3" in _swapped_program_ids_note((0, 3), (3, 5))
    for program, grid in (((2, 1), (3, 2)), ((1, 0), (3, 2)), ((0, 0), (1, 1)), ((2,), (3,)), ((2, 0), (3,))):
        assert _swapped_program_ids_note(program, grid) == "", (program, grid)


@triton.jit
def heads_kernel(x_ptr, y_ptr, n, stride_h, BLOCK: tl.constexpr, SWAPPED: tl.constexpr):
    """Copies (H, n) row by row in tiles; grid (tiles per row, H). SWAPPED reads each axis's
    index from the other axis's program id."""
    if SWAPPED:
        tile, head = tl.program_id(1), tl.program_id(0)
    else:
        tile, head = tl.program_id(0), tl.program_id(1)
    offs = tile * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + head * stride_h + offs, mask=offs < n)
    tl.store(y_ptr + head * stride_h + offs, x, mask=offs < n)


def test_swapped_program_ids_are_named_and_a_ragged_edge_is_not():
    """Grid (3 tiles, 2 heads): with the ids swapped, program (2, 0) is the first to fault, every
    lane out of bounds (head 2 of 2) — the note says so; a kernel whose tile overruns only partly
    (some lanes in bounds) gets no such note."""
    x, y = torch.randn(2, 48), torch.empty(2, 48)
    with pytest.raises(MemoryViolation) as info:
        with memory_guard() as guard:
            guard.allow("x", x)
            guard.allow("y", y, write=True)
            heads_kernel[(3, 2)](x, y, 48, x.stride(0), BLOCK=16, SWAPPED=True)
    assert "program_id(0) = 2 reaches the grid's extent along axis 1 (2)" in str(info.value), str(info.value)
    with pytest.raises(MemoryViolation) as info:
        run_copy(torch.randn(40), torch.empty(45), masked=False)
    assert "program ids swapped" not in str(info.value)


@triton.jit
def tile_copy_kernel(x_ptr, y_ptr, stride_row, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    rows = tl.arange(0, BLOCK_R)[:, None]
    cols = tl.arange(0, BLOCK_C)[None, :]
    tl.store(y_ptr + rows * stride_row + cols, tl.load(x_ptr + rows * BLOCK_C + cols))


def test_a_tile_stepping_by_a_size_where_a_stride_belongs_is_told_and_lone_strides_fit_nothing():
    """The tile's steps are read from its lanes; a step that is the tensor's width (its shape)
    is named as such. Another tensor's strides that do not nest over this one's shape fit any
    offset, so they are not offered as the explanation."""
    x = torch.randn(16, 8)
    wide = torch.randn(16, 20)[:, :8]  # row stride 20, 8 columns: the kernel steps by 8
    y = torch.empty(16, 20)[:, :8]
    with pytest.raises(MemoryViolation) as info, memory_guard() as guard:
        guard.allow("x", x)
        guard.allow("y", y, write=True)
        guard.allow("wide", wide)
        tile_copy_kernel[(1,)](x, y, 24, BLOCK_R=16, BLOCK_C=8)
    text = str(info.value)
    assert "the offsets of this tile step 24 and 1 elements along its axes; `y`'s strides are (20, 1)" \
        in text, text
    assert kernel_checks._strides_nest((20, 1), (16, 8))
    assert not kernel_checks._strides_nest((8, 1), (16, 20))  # (1, 12) and (2, 4) are one offset


def test_a_layout_run_that_faults_on_another_tensor_names_whose_strides_it_used():
    """Only `q`'s layout changed and the kernel wrote `o` out of bounds: `o`'s offsets use `q`'s
    strides — not "look at how the kernel steps through `q`"."""
    from course_lib.teaching.checks import Case

    class FakeLayout:
        def strides(self, shape):
            return (9, 1)

    def correct(case):
        layouts = case.kwargs["layouts"]
        correct.faulted = "o" if layouts[0] is not None and all(
            lay is None for lay in layouts[1:]) else None
        return correct.faulted is None and all(lay is None for lay in layouts)

    case = kernel_checks.LayoutCase((torch.zeros(3, 4), torch.zeros(3, 4)),
                                    {"layouts": (FakeLayout(), None)})
    line = kernel_checks.layout_experiments(correct, case, ("q", "o"), dense_right=True)
    assert "goes out of bounds on `o`, whose layout did not change: `o`'s offsets use `q`'s strides" \
        in line, line


@triton.jit
def overlapping_blocks_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) + tl.arange(0, BLOCK)  # pid not multiplied by BLOCK
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=offs < n), mask=offs < n)


def _copy_under_guard(kernel, n: int, programs: int, block: int):
    """Run a 1-D copy ``kernel`` of n elements on ``programs`` programs under a guard; returns
    the guard, x and y."""
    x, y = torch.randn(n), torch.empty(n)
    with memory_guard() as guard:
        guard.allow("x", x)
        guard.allow("y", y, write=True)
        kernel[(programs,)](x, y, n, BLOCK=block)
    return guard, x, y


def test_a_guard_tells_which_elements_each_program_stored():
    guard, x, y = _copy_under_guard(overlapping_blocks_kernel, 40, 3, 8)
    text = guard.coverage("y", y)
    assert "program 0: 8 element(s), 0–7; program 1: 8 element(s), 1–8; program 2" in text, text
    assert "consecutive programs' first elements are 1 element(s) apart" in text
    assert guard.coverage("x", x) == "no program stored anything into `x`"


@triton.jit
def same_block_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # axis 1 of a 1-D grid: 0 everywhere
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=offs < n), mask=offs < n)


def test_a_guard_tells_that_every_program_stored_the_same_elements_and_which_id_is_constant():
    guard, _, y = _copy_under_guard(same_block_kernel, 24, 3, 8)
    text = guard.coverage("y", y)
    assert ("all 3 programs stored the same elements: the offsets do not change with the program "
            "id (the programs differ only in tl.program_id(0); tl.program_id(1) and "
            "tl.program_id(2) are the same in every one: 0, 0)") in text, text


@triton.jit
def swapped_ids_kernel(y_ptr, n_rows, n_cols, BLOCK: tl.constexpr):
    rows = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # the row block from axis 1
    cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    tl.store(y_ptr + rows[:, None] * n_cols + cols[None, :], 1.0, mask=mask)


def test_a_guard_tells_that_the_stored_tiles_follow_the_program_ids_the_other_way_round():
    y = torch.empty(12, 8)
    with memory_guard() as guard:
        guard.allow("y", y, write=True)
        swapped_ids_kernel[(3, 2)](y, 12, 8, BLOCK=4)  # the grid (row blocks, column blocks)
    assert ("each program's tile sits at row block tl.program_id(1) and column block "
            "tl.program_id(0)") in guard.coverage("y", y)
    # the tiles where the ids say, or no single pattern: nothing said
    assert kernel_checks._tiles_by_swapped_ids({(0, 0): (0, 0), (1, 0): (4, 0), (0, 1): (0, 4)}) == ""
    assert kernel_checks._tiles_by_swapped_ids({(0, 0): (0, 0), (1, 1): (4, 0)}) == ""


@triton.jit
def head_copy_kernel(q_ptr, k_ptr, o_ptr, D: tl.constexpr):
    h = tl.program_id(0)
    cols = tl.arange(0, D)
    x = tl.load(k_ptr + h * D + cols)  # the query head h used as K/V head
    tl.store(o_ptr + h * D + cols, x + tl.load(q_ptr + h * D + cols))


def test_an_index_of_a_larger_grouped_dim_is_pointed_out():
    q, k, o = torch.randn(4, 8), torch.randn(2, 8), torch.empty(4, 8)
    with pytest.raises(MemoryViolation) as info, memory_guard() as guard:
        guard.allow("q", q)
        guard.allow("k", k)
        guard.allow("o", o, write=True)
        head_copy_kernel[(4,)](q, k, o, D=8)
    text = str(info.value)
    assert "index 2 along dim 0 of `k` (size 2) is a valid index of `q`'s dim 0 (size 4 = 2 × 2)" \
        in text, text
    assert "K/V head = h // 2" in text

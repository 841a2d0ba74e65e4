"""Chapter 06: the teaching kernel with the library's pieces, and each exercise's check against
a corpus of realistic wrong pieces (the mistake models of ch06 plus independent variants here).

Every wrong piece must be rejected with a short diagnosis, naming the cause where the check
knows it; stubs read as "not done yet"; crashes, wrong shapes, NaN and endless loops each get
one clear message.
"""

import pytest

from course_lib.platform import runtime

runtime.ensure_configured()

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from course_lib.teaching.checks import ExerciseFailed  # noqa: E402
from course_lib.teaching import kernel_checks  # noqa: E402
from course_lib.teaching.exercises import ch05, ch06  # noqa: E402
from course_lib.kernels.tiles import LOG2_E  # noqa: E402

pytestmark = pytest.mark.ch06

INTERPRETED = runtime.current().interpreted
ON_GPU = runtime.current().on_gpu


def expect(cpu, gpu):
    """What a diagnosis must contain in this mode. In the interpreter (CPU) the memory guard
    stops an access outside the tensors before it happens and names tensor, index and program
    id, and NumPy traces a NaN to the kernel's line; on a GPU the guard is off and the guarded
    buffers diagnose it after the launch (values written outside an output, NaN that came from
    an input's margin, rows never written)."""
    return gpu if ON_GPU else cpu
DTYPES = [torch.float32, torch.float16] if INTERPRETED else [torch.float16, torch.bfloat16]
ATOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def _qkv(shape_q, n_k, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    device = runtime.current().device
    q = torch.randn(*shape_q, generator=gen).to(device=device, dtype=dtype)
    k, v = (torch.randn(*shape_q[:-2], n_k, shape_q[-1], generator=gen).to(device=device, dtype=dtype)
            for _ in range(2))
    return q, k, v


# ----------------------------------------------------------------------------------------------
# The teaching kernel with the library's pieces


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape_q, n_k, causal", [
    ((77, 16), 77, False), ((2, 3, 45, 32), 93, True), ((1, 100, 16), 31, True),
    ((2, 64, 64), 64, False), ((3, 17, 16), 130, False)])
@pytest.mark.parametrize("pieces", [ch06.LIBRARY_PIECES, ch06.NATURAL_EXP_PIECES],
                         ids=["exp2", "exp"])
def test_teaching_kernel_matches_float64_reference(shape_q, n_k, causal, dtype, pieces):
    q, k, v = _qkv(shape_q, n_k, dtype)
    o, lse = ch06.forward(q, k, v, causal, pieces=pieces, blocks=(16, 32))
    o_ref, lse_ref = ch06.reference(q, k, v, causal)
    assert o.shape == q.shape and o.dtype == dtype and lse.shape == q.shape[:-1]
    torch.testing.assert_close(o, o_ref, atol=ATOL[dtype], rtol=1e-2 if dtype != torch.float32 else 2e-4)
    torch.testing.assert_close(lse, lse_ref, atol=1e-3, rtol=1e-4)


def test_teaching_kernel_takes_strided_views_and_a_custom_scale():
    q, k, v = _qkv((2, 40, 32), 50, DTYPES[0])
    q_t = q.transpose(0, 1).contiguous().transpose(0, 1)  # (2, 40, 32) with non-standard strides
    o, lse = ch06.forward(q_t, k, v, False, 0.3, blocks=(16, 16))
    o_ref, _ = ch06.reference(q, k, v, False, 0.3)
    torch.testing.assert_close(o, o_ref, atol=ATOL[q.dtype], rtol=1e-2)


@pytest.mark.parametrize("call, error, message", [
    (lambda q: ch06.forward(q, q[..., :16], q), ValueError, "share the head dim"),
    (lambda q: ch06.forward(q[..., :24], q[..., :24], q[..., :24]), ValueError, "power-of-two head dim"),
    (lambda q: ch06.forward(q, q, q, scale=-1.0), ValueError, "positive number"),
    (lambda q: ch06.forward(q[0], q, q), ValueError, "shapes do not match"),
    (lambda q: ch06.forward(q.int(), q, q), TypeError, "float32, float16 or bfloat16"),
    (lambda q: ch06.forward(q, q.half() if q.dtype != torch.float16 else q.float(), q), TypeError,
     "share a dtype"),
])
def test_teaching_kernel_rejects_bad_input(call, error, message):
    q, _, _ = _qkv((2, 24, 32), 24, DTYPES[0])
    with pytest.raises(error, match=message):
        call(q)


# ----------------------------------------------------------------------------------------------
# Checks: passes and "not done yet"


@triton.jit
def update_stub(s, v, m_i, l_i, acc, scale):
    raise NotImplementedError("Exercise 6.1: online softmax update")


@triton.jit
def finish_stub(acc, m_i, l_i):
    raise NotImplementedError("Exercise 6.1: online softmax update")


@pytest.mark.parametrize("check, pieces", [
    (ch06.check_online_softmax, (ch06.update_tile, ch06.finish_rows)),
    (ch06.check_ragged, (ch06.load_tile, ch06.mask_ragged)),
    (ch06.check_causal, (ch06.mask_causal, ch06.kv_loop_end)),
    (ch06.check_exp2, (ch06.update_tile_exp2, ch06.finish_rows_exp2)),
], ids=["6.1", "6.2", "6.3", "6.4"])
def test_library_pieces_pass(check, pieces, capsys):
    assert check(*pieces) == pieces
    assert "passed" in capsys.readouterr().out


def test_stub_is_not_done_and_falls_back_to_the_library(capsys):
    assert ch06.check_online_softmax(update_stub, finish_stub) == (ch06.update_tile, ch06.finish_rows)
    assert "not done yet" in capsys.readouterr().out
    # only half done: the finish is still a stub
    assert ch06.check_online_softmax(ch06.update_tile, finish_stub) == (ch06.update_tile, ch06.finish_rows)


# ----------------------------------------------------------------------------------------------
# The corpus of wrong answers


def _rejected(check, pieces, *fragments):
    with pytest.raises(ExerciseFailed) as info:
        check(*pieces)
    message = str(info.value)
    assert message.startswith("✗ Exercise 6."), message
    for fragment in fragments:
        assert fragment in message, message
    assert len(message.splitlines()) <= 10, message
    assert "Traceback" not in message, message
    # the check's own NaN margins are never where a NaN "came from"
    assert "came from torch's full" not in message, message
    return message


def _judged(check, pieces, cause, *fragments):
    """Rejected, with the right cause named (``cause``) or — when ``cause`` is None — none."""
    import re
    message = _rejected(check, pieces, *fragments)
    named = re.findall(r"likely cause: (.*)", message)
    if cause is None:
        assert not named and "two known mistakes" not in message, message
    else:
        assert named and named[0].startswith(cause[:60]), message
    return message


@pytest.mark.parametrize("cause", list(ch06.UPDATE_MISTAKES))
def test_online_softmax_mistakes_are_named(cause):
    _rejected(ch06.check_online_softmax, ch06.UPDATE_MISTAKES[cause], f"likely cause: {cause}")


@pytest.mark.parametrize("cause", list(ch06.RAGGED_MISTAKES))
def test_ragged_mistakes_are_named(cause):
    _rejected(ch06.check_ragged, ch06.RAGGED_MISTAKES[cause], f"likely cause: {cause}")


@pytest.mark.parametrize("cause", list(ch06.CAUSAL_MISTAKES))
def test_causal_mistakes_are_named(cause):
    _rejected(ch06.check_causal, ch06.CAUSAL_MISTAKES[cause], f"likely cause: {cause}")


@pytest.mark.parametrize("cause", list(ch06.EXP2_MISTAKES))
def test_exp2_mistakes_are_named(cause):
    _rejected(ch06.check_exp2, ch06.EXP2_MISTAKES[cause], f"likely cause: {cause}")


# Independent variants: written the way a learner might, not copied from the mistake models.

@triton.jit
def update_no_cast_before_dot(s, v, m_i, l_i, acc, scale):
    s = s * scale
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.exp(s - m_new[:, None])
    alpha = tl.exp(m_i - m_new)
    return m_new, l_i * alpha + tl.sum(p, 1), acc * alpha[:, None] + tl.dot(p, v)  # p is fp32


@triton.jit
def update_forgets_acc_rescale_differently(s, v, m_i, l_i, acc, scale):
    m_new = tl.maximum(m_i, tl.max(s * scale, 1))
    p = tl.exp(s * scale - m_new[:, None])
    l_new = tl.exp(m_i - m_new) * l_i + tl.sum(p, 1)
    acc += tl.dot(p.to(v.dtype), v)  # the old acc keeps its old max
    return m_new, l_new, acc


@triton.jit
def update_wrong_sign(s, v, m_i, l_i, acc, scale):
    s = s * scale
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.exp(s - m_new[:, None])
    alpha = tl.exp(m_new - m_i)  # grows instead of shrinks: inf on the first tile
    return m_new, l_i * alpha + tl.sum(p, 1), acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)


@triton.jit
def update_raises(s, v, m_i, l_i, acc, scale):
    raise ValueError("learner's own bug")


@triton.jit
def update_returns_two(s, v, m_i, l_i, acc, scale):
    return m_i, l_i


@triton.jit
def finish_transposed(acc, m_i, l_i):
    return tl.trans(acc / l_i[:, None]), m_i + tl.log(l_i)


@triton.jit
def update_forever(s, v, m_i, l_i, acc, scale):
    n = 0
    while n < 1:
        n = n * 2
    return m_i, l_i, acc


def test_missing_cast_before_dot_is_diagnosed():
    if not INTERPRETED:
        pytest.skip("fp32 cases run only in the interpreter; the GPU compiler reports it alike")
    message = _rejected(ch06.check_online_softmax, (update_no_cast_before_dot, ch06.finish_rows),
                        "same dtype", "p.to(v.dtype)")
    assert "line" in message


def test_acc_not_rescaled_written_differently_is_still_named():
    _rejected(ch06.check_online_softmax, (update_forgets_acc_rescale_differently, ch06.finish_rows),
              f"likely cause: {ch06.FORGOT_RESCALE_ACC}")


def test_wrong_sign_correction_gives_a_nan_diagnosis():
    # NumPy sees the kernel's operations only in the interpreter; a GPU shows the NaN outputs
    _judged(ch06.check_online_softmax, (update_wrong_sign, ch06.finish_rows), ch06.ALPHA_INVERTED, *expect(
        cpu=("NaN/inf", "the first invalid operation NumPy saw", "at line"),
        gpu=("wrong answer on case 1 of 5", "NaN/inf where the answer is finite")))


@pytest.mark.parametrize("update, finish, fragment", [
    (update_raises, ch06.finish_rows, "learner's own bug"),
    (update_returns_two, ch06.finish_rows, "failed on case 1"),
    (ch06.update_tile, finish_transposed, "case 1"),  # a (d, BLOCK_M) tile: wrong or no fit
], ids=["raises", "returns-two", "wrong-shape"])
def test_broken_learner_code_gets_one_short_message(update, finish, fragment):
    _rejected(ch06.check_online_softmax, (update, finish), fragment)


@pytest.mark.skipif(runtime.current().on_gpu,
                    reason="a kernel that never ends cannot be interrupted on a GPU; the interpreter run checks it")
def test_endless_loop_is_stopped(monkeypatch):
    monkeypatch.setattr(kernel_checks, "KERNEL_TIME_LIMIT_S", 1)
    _rejected(ch06.check_online_softmax, (update_forever, ch06.finish_rows), "stopped after 1 s")


@triton.jit
def load_unmasked(ptr, offs_rows, offs_d, stride_row, n_rows):
    return tl.load(ptr + offs_rows[:, None] * stride_row + offs_d[None, :])


@triton.jit
def load_assumes_contiguous_rows(ptr, offs_rows, offs_d, stride_row, n_rows):
    return tl.load(ptr + offs_rows[:, None] * 16 + offs_d[None, :],  # stride = d only if dense
                   mask=offs_rows[:, None] < n_rows, other=0.0)


@triton.jit
def mask_ragged_uses_queries(s, offs_n, n_k):
    return tl.where(offs_n[:, None] < n_k, s, float("-inf"))  # (BLOCK_N, 1): wrong axis


@pytest.mark.parametrize("pieces, fragments", [
    ((load_unmasked, ch06.mask_ragged), expect(
        cpu=("`k` (2, 37, 16) at index (0, 37, 0)",),
        gpu=("case 1 of 5", "the output depends on memory outside the inputs", "a tl.load without a mask"))),
    ((load_assumes_contiguous_rows, ch06.mask_ragged), expect(
        cpu=("`q` (2, 37, 16)", "has this case's layout"),
        gpu=("the output depends on memory outside the inputs", "wrong when only `q` (strides (24, 72, 1))",
             "has this case's layout"))),
    ((ch06.load_tile, mask_ragged_uses_queries), ("case 1",)),
    ((ch06.load_tile, ch06._mask_ragged_to_zero), ("(not 0)",)),
], ids=["no-load-mask", "stride-is-d", "mask-wrong-axis", "mask-to-zero"])
def test_ragged_variants_are_rejected(pieces, fragments):
    _rejected(ch06.check_ragged, pieces, *fragments)


@triton.jit
def kv_end_without_min(start_m, n_k, BLOCK_M: tl.constexpr, CAUSAL: tl.constexpr):
    if CAUSAL:
        return start_m + BLOCK_M  # past n_k for the late Q tiles: wasted, masked tiles
    return n_k


def test_loop_that_visits_masked_tiles_is_rejected():
    _rejected(ch06.check_causal, (ch06.mask_causal, ch06._kv_loop_end_always_all),
              "visits 3 K/V tiles where 1 suffice")
    _rejected(ch06.check_causal, (ch06.mask_causal, kv_end_without_min), "where", "suffice")


def test_visited_tiles_counts_the_causal_triangle():
    assert ch06.visited_tiles(ch06.kv_loop_end, 50, 50, True) == [1, 2, 3, 4]
    assert ch06.visited_tiles(ch06.kv_loop_end, 50, 40, False) == [3, 3, 3, 3]
    assert ch06.visited_tiles(ch06.kv_loop_end, 64, 20, True) == [1, 2, 2, 2]


@triton.jit
def update_exp2_scale_twice(s, v, m_i, l_i, acc, scale):
    s = s * (scale * LOG2_E * LOG2_E)
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.math.exp2(s - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    return m_new, l_i * alpha + tl.sum(p, 1), acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)


def test_exp2_with_log2e_folded_twice_is_rejected():
    _rejected(ch06.check_exp2, (update_exp2_scale_twice, ch06.finish_rows_exp2), "wrong answer")


# ----------------------------------------------------------------------------------------------
# Exercise 6.5: the whole kernel and its launcher. The corpus is the solution notebook's own
# answer with one realistic change each (a line dropped, an operator or a bound wrong), loaded as
# a module: the kernel under test is exactly what a learner would have typed.

import importlib.util  # noqa: E402
import json  # noqa: E402
from pathlib import Path  # noqa: E402

SOLUTION_NOTEBOOK = Path(__file__).resolve().parent.parent / "solutions" / "06_flash_forward_triton.ipynb"
EXERCISE_6_5 = "# Exercise 6.5"
SOLUTION_HEADER = ("import torch\nimport triton\nimport triton.language as tl\n"
                   "from course_lib.kernels.tiles import LOG2_E\n\n")


def _solution_6_5() -> str:
    cells = json.loads(SOLUTION_NOTEBOOK.read_text())["cells"]
    for cell in cells:
        source = "".join(cell["source"])
        if cell["cell_type"] == "code" and source.startswith(EXERCISE_6_5):
            return source
    raise AssertionError(f"no cell starting with {EXERCISE_6_5!r} in {SOLUTION_NOTEBOOK}")


def _learner_module(tmp_path, changes=(), name="answer"):
    """The notebook's 6.5 cell with ``changes`` ((old, new) text replacements), as a module."""
    source = _solution_6_5()
    for old, new in changes:
        assert old in source, f"the solution no longer contains {old!r}: update the corpus"
        source = source.replace(old, new)
    path = tmp_path / f"{name}.py"
    path.write_text(SOLUTION_HEADER + source)  # @triton.jit reads the source from a file
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# name -> (the changes, a fragment the diagnosis must contain)
FORWARD_CORPUS = {
    "acc-not-rescaled": (
        [("acc = acc * alpha[:, None] + tl.dot", "acc = acc + tl.dot")],
        f"likely cause: {ch06.FORGOT_RESCALE_ACC}"),
    "lse-in-log2-units": (
        [("lse = (m_i + tl.math.log2(l_i)) / LOG2_E", "lse = m_i + tl.math.log2(l_i)")],
        f"likely cause: {ch06.LSE_IN_LOG2}"),
    "causal-loop-one-tile-short": (
        [("tl.minimum(n_k, start_m + BLOCK_M)", "tl.minimum(n_k, start_m)")],
        f"likely cause: {ch06.CAUSAL_LOOP_SHORT}"),
    "causal-mask-off-by-one-row": (
        [("offs_n[None, :] <= offs_m[:, None]", "offs_n[None, :] < offs_m[:, None]")],
        f"likely cause: {ch06.CAUSAL_OFF_BY_ONE}"),
    "ragged-scores-not-masked": (
        [('        s = tl.where(offs_n[None, :] < n_k, s, float("-inf"))', "")],
        f"likely cause: {ch06.RAGGED_SCORES_NOT_MASKED}"),
    "kv-loads-unmasked": (
        [(", mask=kv_ok, other=0.0)", ")")],
        expect(cpu="at index (0, 0, 45, 0) (dim 2 index 45 ≥ its size 45)",
               gpu="the output depends on memory outside the inputs (their margins hold NaN, and NaN "
                   "came out): a load without a mask")),
    # on a GPU nothing stops the reads and writes at batch 0's offsets: it shows as batch 1's
    # rows of o never written
    "head-stride-for-batch": (
        [(f"{x} + b * stride_{x.lower()}b + h * stride_{x.lower()}h",
          f"{x} + pid_bh * stride_{x.lower()}h") for x in "QKVO"],
        expect(cpu="`q` (2, 2, 45, 16) at index (0, 2, 0, 0)",
               gpu="row(s) of o (2, 2, 45, 16) were never written, the first row 1 of (batch 1, head 0)")),
    "divides-inside-the-loop": (
        [("        m_i = m_new\n", "        m_i = m_new\n        acc = acc / l_i[:, None]\n"),
         ("o = acc / l_i[:, None]", "o = acc")],
        f"likely cause: {ch06.DIVIDED_INSIDE_LOOP}"),
    "scale-forgotten": (
        [("* (scale * LOG2_E)", "* LOG2_E")],
        "likely cause: the scores are not multiplied by scale"),
    "grid-only-first-q-tile": (
        [("grid = (triton.cdiv(n_q, block_m) * batch * heads,)", "grid = (batch * heads,)"),
         ("num_tiles = tl.cdiv(n_q, BLOCK_M)", "num_tiles = 1")],
        "only the first Q tile of each head was written"),
    "grid-too-small": (
        [("grid = (triton.cdiv(n_q, block_m) * batch * heads,)", "grid = (batch * heads,)")],
        "the grid has cdiv(N_q, BLOCK_M) · B · H programs"),
    "exp-instead-of-exp2": (
        [("tl.math.exp2(s - m_new[:, None])", "tl.exp(s - m_new[:, None])"),
         ("tl.math.exp2(m_i - m_new)", "tl.exp(m_i - m_new)")],
        "likely cause: the scores were scaled by scale · LOG2_E (log2 units) but exponentiated"),
    "lse-store-unmasked": (
        [("tl.store(LSE + pid_bh * n_q + offs_m, lse, mask=row_ok)",
          "tl.store(LSE + pid_bh * n_q + offs_m, lse)")],
        expect(cpu="tl.store in program id", gpu="your kernel wrote past the end of the tensor lse views")),
    "lse-flat-shape": (
        [("lse = torch.empty((batch, heads, n_q)", "lse = torch.empty((batch * heads, n_q)")],
        "your launcher returned lse Tensor(4, 45) float32"),
    "o-allocated-without-q-strides": (
        [("*o.stride(),", "*q.stride(),")], None),
    "scale-ignored-in-launcher": (
        [("scale = d ** -0.5 if scale is None else scale", "scale = d ** -0.5")],
        "wrong answer on case 2"),
    "k-strides-for-v": (
        [("offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd",
          "offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd")], None),
    "column-stride-ignored": (
        [("offs_d[None, :] * stride_kd", "offs_d[None, :]")], None),
    "loop-step-block-m": (
        [("range(0, kv_end, BLOCK_N)", "range(0, kv_end, BLOCK_M)")], None),
    "causal-bound-block-n": (
        [("tl.minimum(n_k, start_m + BLOCK_M)", "tl.minimum(n_k, start_m + BLOCK_N)")], None),
}


def test_forward_solution_passes_and_stubs_are_not_done(tmp_path, capsys):
    answer = _learner_module(tmp_path)
    assert ch06.check_forward_kernel(answer.flash_forward) is answer.flash_forward
    assert "✓ Exercise 6.5: passed (6 cases)" in capsys.readouterr().out
    # the learner notebook's version: both the kernel and the launcher are stubs
    stub = _learner_module(tmp_path, [(line, 'raise NotImplementedError("Exercise 6.5")')
                                      for line in _solution_blocks()], name="stub")
    assert ch06.check_forward_kernel(stub.flash_forward) is ch06.library_forward
    assert "not done yet" in capsys.readouterr().out


def _solution_blocks():
    """The text of each BEGIN/END SOLUTION block of the 6.5 cell, markers included."""
    source = _solution_6_5()
    blocks, start = [], 0
    while "### BEGIN SOLUTION" in source[start:]:
        begin = source.index("### BEGIN SOLUTION", start)
        end = source.index("### END SOLUTION", begin) + len("### END SOLUTION")
        blocks.append(source[begin:end])
        start = end
    return blocks


def test_forward_with_only_the_kernel_stubbed_is_not_done(tmp_path, capsys):
    kernel_block = _solution_blocks()[0]
    stub = _learner_module(tmp_path, [(kernel_block, 'raise NotImplementedError("Exercise 6.5")')],
                           name="kernel_stub")
    assert ch06.check_forward_kernel(stub.flash_forward) is ch06.library_forward
    assert "not done yet" in capsys.readouterr().out


@pytest.mark.parametrize("name", list(FORWARD_CORPUS))
def test_forward_mistakes_are_named(tmp_path, name):
    changes, fragment = FORWARD_CORPUS[name]
    answer = _learner_module(tmp_path, changes, name=name.replace("-", "_"))
    if fragment and fragment.startswith("likely cause: "):
        _judged(ch06.check_forward_kernel, (answer.flash_forward,), fragment[len("likely cause: "):])
    else:
        _judged(ch06.check_forward_kernel, (answer.flash_forward,), None,
                *((fragment,) if fragment else ()))


# Valid answers in other styles: each must pass.
FORWARD_VALID = {
    "lse-flat-then-view": [
        ("lse = torch.empty((batch, heads, n_q), dtype=torch.float32, device=q.device)",
         "lse = torch.empty((batch * heads, n_q), dtype=torch.float32, device=q.device)"),
        ("    return o, lse\n", "    return o, lse.view(batch, heads, n_q)\n")],
    "outputs-zeros-and-contiguous-inputs": [
        ("    o = torch.empty_like(q)\n",
         "    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()\n"
         "    o = torch.zeros(q.shape, dtype=q.dtype, device=q.device)\n")],
    "natural-exp": [
        ("s = tl.dot(q, tl.trans(k)) * (scale * LOG2_E)", "s = tl.dot(q, tl.trans(k)) * scale"),
        ("p = tl.math.exp2(s - m_new[:, None])", "p = tl.exp(s - m_new[:, None])"),
        ("alpha = tl.math.exp2(m_i - m_new)", "alpha = tl.exp(m_i - m_new)"),
        ("lse = (m_i + tl.math.log2(l_i)) / LOG2_E", "lse = m_i + tl.log(l_i)")],
    "one-mask-with-where": [
        ('        s = tl.where(offs_n[None, :] < n_k, s, float("-inf"))   # keys past the end\n'
         '        if CAUSAL:\n'
         '            s = tl.where(offs_n[None, :] <= offs_m[:, None], s, float("-inf"))\n',
         '        keep = (offs_n[None, :] < n_k) & ((offs_n[None, :] <= offs_m[:, None]) | (not CAUSAL))\n'
         '        s = tl.where(keep, s, float("-inf"))\n')],
}


@pytest.mark.parametrize("name", list(FORWARD_VALID))
def test_forward_valid_alternatives_pass(tmp_path, name, capsys):
    answer = _learner_module(tmp_path, FORWARD_VALID[name], name=name.replace("-", "_"))
    assert ch06.check_forward_kernel(answer.flash_forward) is answer.flash_forward
    assert "✓ Exercise 6.5: passed" in capsys.readouterr().out


def test_forward_diagnosis_names_output_row_and_tiles(tmp_path):
    changes, _ = FORWARD_CORPUS["lse-in-log2-units"]
    answer = _learner_module(tmp_path, changes, name="lse_log2")
    message = _rejected(ch06.check_forward_kernel, (answer.flash_forward,),
                        "wrong answer on case 1 of 6", "`lse`: max abs error", "row 0 of (batch 0, head 0) "
                        "is in Q tile 0 (rows 0–15, BLOCK_M=16)")
    print(message)


def test_forward_library_fallback_matches_reference():
    q, k, v = _qkv((2, 2, 45, 16), 30, DTYPES[0])
    o, lse = ch06.library_forward(q, k, v, True, block_m=16, block_n=16)
    o_ref, lse_ref = ch06.reference(q, k, v, True)
    torch.testing.assert_close(o, o_ref, atol=ATOL[q.dtype], rtol=1e-2)
    torch.testing.assert_close(lse, lse_ref, atol=1e-3, rtol=1e-4)


def test_forward_hints_name_where_constants_come_from_and_allocate_on_the_device():
    text = " ".join(ch06.FORWARD_HINTS)
    assert "device=q.device" in ch06.FORWARD_HINTS[0]
    assert "LN_2" not in text or "import LN_2" in text
    assert "from course_lib.kernels.tiles" in ch06.FORWARD_HINTS[-1]


def test_sentinel_allocations_restore_torch_empty():
    real = torch.empty
    with ch06._sentinel_allocations() as made:
        x = torch.empty(3, 4)
        assert torch.empty is not real and len(made) == 1
    assert torch.empty is real
    assert bool((x == kernel_checks.OUTPUT_SENTINEL).all()) and x.is_contiguous()


def test_forward_mistake_without_a_model_still_gets_row_and_tile(tmp_path):
    # V read through K's pointer (a copy-paste slip): a mistake no model replays
    answer = _learner_module(tmp_path, [("v = tl.load(v_head", "v = tl.load(k_head")],
                             name="v_from_k")
    _judged(ch06.check_forward_kernel, (answer.flash_forward,), None, "on case 1 of 6")


def _pairs_written(shape, written):
    """A (B, H, N_q[, d]) output holding the sentinel except in the (batch, head) pairs listed."""
    x = torch.full(shape, kernel_checks.OUTPUT_SENTINEL)
    for b, h in written:
        x[b, h] = 0.0
    return x


def test_only_the_first_pair_written_is_told_from_what_the_other_output_shows():
    o_all = _pairs_written((2, 2, 5, 4), [(b, h) for b in range(2) for h in range(2)])
    o_first, lse_first = _pairs_written((2, 2, 5, 4), [(0, 0)]), _pairs_written((2, 2, 5), [(0, 0)])
    # o complete, lse only at (0, 0): lse's offset ignores the (batch, head)
    only = {"o": ch06._only_first_pair(o_all), "lse": ch06._only_first_pair(lse_first)}
    text = str(ch06._unwritten("lse", lse_first, 4, ch06._pair_note("lse", "o", only)))
    assert ("o was written for every (batch, head), so a program ran for each: lse's offset does "
            "not move with the (batch, head)") in text, text
    # both only at (0, 0): no program stored another pair's rows — too few programs, a missing
    # program_id axis, or rows counted over every program (past N_q): the evidence names all three
    only = {"o": ch06._only_first_pair(o_first), "lse": ch06._only_first_pair(lse_first)}
    text = str(ch06._unwritten("o", o_first, 4, ch06._pair_note("o", "lse", only)))
    assert "only (batch 0, head 0) was written, in o and lse alike" in text, text
    assert "acted as pair 0" not in text and "pid · BLOCK_M" in text, text
    # another pair written as well: no note
    two = _pairs_written((2, 2, 5), [(0, 0), (1, 0)])
    assert not ch06._only_first_pair(two) and ch06._pair_note("lse", "o", {"lse": False}) == ""

"""Exercises 1.1 and 1.2: right answers pass, a corpus of realistic wrong ones is rejected and,
where the check knows the mistake, diagnosed by name."""

import math

import numpy as np
import pytest
import torch

from course_lib.checks import ExerciseFailed
from course_lib.exercises import ch01

pytestmark = pytest.mark.ch01


# ---------------------------------------------------------------- learner answers, NumPy

def right_numpy(q, k, v):
    s = q @ np.swapaxes(k, -1, -2) / math.sqrt(q.shape[-1])
    s = s - s.max(axis=-1, keepdims=True)
    p = np.exp(s)
    return (p / p.sum(axis=-1, keepdims=True)) @ v


def no_scale(q, k, v):
    s = q @ np.swapaxes(k, -1, -2)
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    return p / p.sum(axis=-1, keepdims=True) @ v


def scale_by_d(q, k, v):
    s = q @ np.swapaxes(k, -1, -2) / q.shape[-1]
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    return p / p.sum(axis=-1, keepdims=True) @ v


def wrong_axis(q, k, v):
    s = q @ np.swapaxes(k, -1, -2) / math.sqrt(q.shape[-1])
    p = np.exp(s - s.max(axis=-2, keepdims=True))
    return p / p.sum(axis=-2, keepdims=True) @ v


def no_max_subtraction(q, k, v):
    s = q @ np.swapaxes(k, -1, -2) / math.sqrt(q.shape[-1])
    with np.errstate(over="ignore", invalid="ignore"):
        p = np.exp(s)
        return p / p.sum(axis=-1, keepdims=True) @ v


def returns_p(q, k, v):
    s = q @ np.swapaxes(k, -1, -2) / math.sqrt(q.shape[-1])
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    return p / p.sum(axis=-1, keepdims=True)


def not_normalised(q, k, v):
    s = q @ np.swapaxes(k, -1, -2) / math.sqrt(q.shape[-1])
    return np.exp(s - s.max(axis=-1, keepdims=True)) @ v


def numpy_scalar_promotes(q, k, v):
    s = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])  # float64 scalar: float32 → float64
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    return p / p.sum(axis=-1, keepdims=True) @ v


def transposed_only_2d(q, k, v):  # k.T reverses *all* axes: wrong for batched input
    s = q @ k.T / math.sqrt(q.shape[-1])
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    return p / p.sum(axis=-1, keepdims=True) @ v


NUMPY_CORPUS = [
    (no_scale, "not scaled"),
    (scale_by_d, "scaled by 1/d"),
    (wrong_axis, "wrong axis"),
    (no_max_subtraction, "subtract the max"),
    (returns_p, "returned the attention weights P"),
    (not_normalised, "not normalised"),
    (numpy_scalar_promotes, "math.sqrt"),
    (transposed_only_2d, None),
]


def test_right_numpy_passes(capsys):
    assert ch01.check_attention_numpy(right_numpy) is right_numpy
    assert "passed" in capsys.readouterr().out


@pytest.mark.parametrize("wrong,cause", NUMPY_CORPUS, ids=[f.__name__ for f, _ in NUMPY_CORPUS])
def test_wrong_numpy_is_rejected_and_diagnosed(wrong, cause):
    with pytest.raises(ExerciseFailed) as info:
        ch01.check_attention_numpy(wrong)
    message = str(info.value)
    assert message.startswith("✗ Exercise 1.1")
    if cause:
        assert cause in message


def test_stub_falls_back_to_the_library(capsys):
    def stub(q, k, v):
        raise NotImplementedError("Exercise 1.1")

    fn = ch01.check_attention_numpy(stub)
    assert "not done yet" in capsys.readouterr().out
    q = np.random.default_rng(0).standard_normal((6, 4))
    np.testing.assert_allclose(fn(q, q, q), right_numpy(q, q, q), atol=1e-12)


def test_cases_are_irregular_and_include_overflow():
    cases = ch01.numpy_cases()
    shapes = [tuple(x.shape for x in c.args) for c in cases]
    assert any(q[-2] != k[-2] for q, k, _ in shapes)  # N_q ≠ N_k
    assert any(v[-1] != q[-1] for q, _, v in shapes)  # d_v ≠ d
    assert any(len(q) == 4 for q, _, _ in shapes)  # batched
    q, k, _ = cases[-1].args
    assert np.abs(q @ k.T).max() / math.sqrt(q.shape[-1]) > np.log(np.finfo(np.float64).max)


def test_reference_is_sdpa():
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((3, 5, 7)).astype(np.float32) for _ in range(3))
    o = ch01.reference_attention_numpy(q, k, v)
    assert o.dtype == np.float32
    want = torch.nn.functional.scaled_dot_product_attention(*(torch.from_numpy(x) for x in (q, k, v)))
    np.testing.assert_allclose(o, want.numpy(), atol=1e-6)


# ---------------------------------------------------------------- learner answers, torch

def right_torch(q, k, v):
    s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    return torch.softmax(s, dim=-1) @ v


def torch_no_scale(q, k, v):
    return torch.softmax(q @ k.transpose(-2, -1), dim=-1) @ v


def torch_scale_by_d(q, k, v):
    return torch.softmax(q @ k.transpose(-2, -1) / q.shape[-1], dim=-1) @ v


def torch_wrong_dim(q, k, v):
    return torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), dim=-2) @ v


def torch_unsafe_exp(q, k, v):
    p = torch.exp(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]))
    return p / p.sum(-1, keepdim=True) @ v


def torch_returns_p(q, k, v):
    return torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), dim=-1)


def torch_returns_numpy(q, k, v):
    return right_torch(q, k, v).numpy()


def torch_loses_dtype(q, k, v):
    return right_torch(q.double(), k.double(), v.double())


TORCH_CORPUS = [
    (torch_no_scale, "not scaled"),
    (torch_scale_by_d, "scaled by 1/d"),
    (torch_wrong_dim, "wrong axis"),
    (torch_unsafe_exp, "subtract the max"),
    (torch_returns_p, "returned the attention weights P"),
    (torch_returns_numpy, "NumPy array where a torch.Tensor is expected"),
    (torch_loses_dtype, "dtype float64 but expected float32"),
]


def test_right_torch_passes(capsys):
    assert ch01.check_attention_torch(right_torch, device="cpu") is right_torch
    assert "Exercise 1.2: passed" in capsys.readouterr().out


@pytest.mark.parametrize("wrong,cause", TORCH_CORPUS, ids=[f.__name__ for f, _ in TORCH_CORPUS])
def test_wrong_torch_is_rejected_and_diagnosed(wrong, cause):
    with pytest.raises(ExerciseFailed) as info:
        ch01.check_attention_torch(wrong, device="cpu")
    assert str(info.value).startswith("✗ Exercise 1.2")
    assert cause in str(info.value)


def test_crashing_answer_gets_one_line():
    def crashes(q, k, v):
        return q @ k  # (N, d) @ (N, d): shapes do not line up

    with pytest.raises(ExerciseFailed, match="your function raised"):
        ch01.check_attention_torch(crashes, device="cpu")


# ---------------------------------------------------------------- Exercise 1.3: the whole oracle

def right_standard(q, k, v, causal=False, scale=None):
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    q64, k64, v64 = (x.astype(np.float64) for x in (q, k, v))
    s = scale * (q64 @ np.swapaxes(k64, -1, -2))
    if causal:
        s = np.where(np.tril(np.ones((q.shape[-2], k.shape[-2]), dtype=bool)), s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    p = np.exp(s - m)
    l = p.sum(axis=-1, keepdims=True)
    return ((p @ v64) / l).astype(q.dtype), m[..., 0] + np.log(l[..., 0])


def _standard(q, k, v, causal=False, scale=None, *, factor=None, visible=None, axis=-1,
              subtract_max=True, lse=None, cast_lse=False):
    """A learner's answer written out, with one thing done its own (wrong) way."""
    d, n_q, n_k = q.shape[-1], q.shape[-2], k.shape[-2]
    scale = (1 / math.sqrt(d) if scale is None else scale) if factor is None else factor(d)
    q64, k64, v64 = (x.astype(np.float64) for x in (q, k, v))
    s = scale * (q64 @ np.swapaxes(k64, -1, -2))
    if causal:
        i, j = np.arange(n_q)[:, None], np.arange(n_k)[None, :]
        s = np.where((visible or (lambda i, j: j <= i))(i, j), s, -np.inf)
    with np.errstate(over="ignore", invalid="ignore"):
        m = s.max(axis=axis, keepdims=True) if subtract_max else 0.0
        p = np.exp(s - m)
        l = p.sum(axis=axis, keepdims=True)
        o = (p / l) @ v64
        out = np.log(np.squeeze(l, axis)) + (np.squeeze(m, axis) if subtract_max else 0.0)
    if lse is not None:
        out = lse(s, m, l)
    return o.astype(q.dtype), (out.astype(q.dtype) if cast_lse else out)


def std_no_max(q, k, v, causal=False, scale=None):
    return _standard(q, k, v, causal, scale, subtract_max=False)


def std_mask_transposed(q, k, v, causal=False, scale=None):
    return _standard(q, k, v, causal, scale, visible=lambda i, j: j >= i)


def std_mask_strict(q, k, v, causal=False, scale=None):
    return _standard(q, k, v, causal, scale, visible=lambda i, j: j < i)


def std_bottom_right(q, k, v, causal=False, scale=None):
    shift = k.shape[-2] - q.shape[-2]
    return _standard(q, k, v, causal, scale, visible=lambda i, j: j <= i + shift)


def std_scale_by_d(q, k, v, causal=False, scale=None):
    return _standard(q, k, v, causal, scale, factor=lambda d: 1 / d)


def std_scale_ignored(q, k, v, causal=False, scale=None):
    return _standard(q, k, v, causal, scale, factor=lambda d: 1 / math.sqrt(d))


def std_wrong_axis(q, k, v, causal=False, scale=None):
    return _standard(q, k, v, causal, scale, axis=-2)


def std_lse_without_max(q, k, v, causal=False, scale=None):
    return _standard(q, k, v, causal, scale, lse=lambda s, m, l: np.log(l[..., 0]))


def std_lse_log2(q, k, v, causal=False, scale=None):
    return _standard(q, k, v, causal, scale,
                     lse=lambda s, m, l: m[..., 0] / np.log(2) + np.log2(l[..., 0]))


def std_lse_in_input_dtype(q, k, v, causal=False, scale=None):
    return _standard(q, k, v, causal, scale, cast_lse=True)


def std_mask_after_softmax(q, k, v, causal=False, scale=None):
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = scale * (q.astype(np.float64) @ np.swapaxes(k, -1, -2))
    m = s.max(axis=-1, keepdims=True)
    p = np.exp(s - m)
    l = p.sum(axis=-1, keepdims=True)
    p = p / l
    if causal:
        p = p * np.tril(np.ones((q.shape[-2], k.shape[-2])))
    return (p @ v).astype(q.dtype), m[..., 0] + np.log(l[..., 0])


def std_o_not_cast(q, k, v, causal=False, scale=None):
    o, lse = right_standard(q, k, v, causal, scale)
    return o.astype(np.float64), lse


def std_returns_o_only(q, k, v, causal=False, scale=None):
    return right_standard(q, k, v, causal, scale)[0]


STANDARD_CORPUS = [
    (std_no_max, "no max subtraction"),
    (std_mask_transposed, "causal mask is transposed"),
    (std_mask_strict, "off by one (j < i)"),
    (std_bottom_right, "bottom-right corner"),
    (std_mask_after_softmax, "after the softmax"),
    (std_scale_by_d, "scaled by 1/d"),
    (std_scale_ignored, "`scale` argument is ignored"),
    (std_wrong_axis, "wrong axis"),
    (std_lse_without_max, "lse without the max"),
    (std_lse_log2, "lse in log2 units"),
    (std_lse_in_input_dtype, "lse is in q's dtype"),
    (std_o_not_cast, "o is float64 for float32 inputs"),
    (std_returns_o_only, None),
]


def test_right_standard_passes(capsys):
    assert ch01.check_standard_attention(right_standard) is right_standard
    assert "Exercise 1.3: passed (6 cases)" in capsys.readouterr().out


@pytest.mark.parametrize("wrong,cause", STANDARD_CORPUS,
                         ids=[f.__name__ for f, _ in STANDARD_CORPUS])
def test_wrong_standard_is_rejected_and_diagnosed(wrong, cause):
    with pytest.raises(ExerciseFailed) as info:
        ch01.check_standard_attention(wrong)
    message = str(info.value)
    assert message.startswith("✗ Exercise 1.3: wrong answer on case")
    if cause:
        assert "likely cause: " in message and cause in message.partition("likely cause: ")[2]
    assert message.count("likely cause") <= 1


def test_standard_stub_falls_back_to_the_oracle(capsys):
    def stub(q, k, v, causal=False, scale=None):
        raise NotImplementedError("Exercise 1.3")

    from course_lib.reference import naive_attention_numpy

    assert ch01.check_standard_attention(stub) is naive_attention_numpy
    assert "Exercise 1.3: not done yet" in capsys.readouterr().out


def test_standard_cases_tell_the_mistakes_apart():
    cases = ch01.standard_cases()
    shapes = [(c.args[0].shape, c.args[1].shape, c.args[2].shape) for c in cases]
    causal = [bool((c.kwargs or {}).get("causal")) for c in cases]
    assert any(c and q[-2] < k[-2] for c, (q, k, _) in zip(causal, shapes))  # bottom-right shows
    assert any(c and q[-2] > k[-2] for c, (q, k, _) in zip(causal, shapes))
    assert any((c.kwargs or {}).get("scale") for c in cases)
    assert {c.args[0].dtype for c in cases} == {np.dtype(np.float32), np.dtype(np.float64)}
    assert len(ch01.MISTAKES_STANDARD) >= 5


def test_standard_hints_and_skeleton_render():
    from course_lib.widgets.hints import HintLadder

    ladder = HintLadder("Exercise 1.3", ch01.STANDARD_HINTS, skeleton=ch01.STANDARD_SKELETON)
    while ladder.next_hint():
        pass
    assert ladder.revealed == len(ch01.STANDARD_HINTS)
    assert "lse = ..." in ladder.show_skeleton()

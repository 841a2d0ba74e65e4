"""Exercises 1.1 and 1.2: right answers pass, a corpus of realistic wrong ones is rejected and,
where the check knows the mistake, diagnosed by name."""

import math

import numpy as np
import pytest
import torch

from course_lib.teaching.checks import ExerciseFailed
from course_lib.teaching.exercises import ch01
from course_lib.attention.reference import naive_attention_numpy

pytestmark = pytest.mark.ch01


# ---------------------------------------------------------------- learner answers, NumPy

def named_cause(message: str) -> str:
    """The text after "likely cause: " in a diagnosis ("" when none is named)."""
    return message.partition("likely cause: ")[2]


def assert_rejected(check, wrong, cause, exercise, **kwargs):
    """``wrong`` is rejected; the named cause contains ``cause``, or none is named (cause None)."""
    with pytest.raises(ExerciseFailed) as info:
        check(wrong, **kwargs)
    message = str(info.value)
    assert message.startswith(f"✗ Exercise {exercise}")
    if cause:
        assert cause in named_cause(message), message
    else:
        assert "likely cause" not in message and "two known mistakes" not in message, message
    return message


def right_numpy(q, k, v):
    s = q @ np.swapaxes(k, -1, -2) / math.sqrt(q.shape[-1])
    s = s - s.max(axis=-1, keepdims=True)
    p = np.exp(s)
    return (p / p.sum(axis=-1, keepdims=True)) @ v


def valid_numpy_einsum(q, k, v):
    s = np.einsum("...id,...jd->...ij", q, k) * q.shape[-1] ** -0.5
    p = np.exp(s - np.max(s, axis=-1, keepdims=True))
    return np.einsum("...ij,...jd->...id", p / np.sum(p, axis=-1, keepdims=True), v)


def valid_numpy_rows(q, k, v):  # one query row at a time, over flattened leading dims
    lead, n_q, n_k = q.shape[:-2], q.shape[-2], k.shape[-2]
    qf, kf, vf = (x.reshape(-1, *x.shape[-2:]) for x in (q, k, v))
    out = np.empty((qf.shape[0], n_q, v.shape[-1]), dtype=q.dtype)
    for b in range(qf.shape[0]):
        for i in range(n_q):
            row = kf[b] @ qf[b, i] / math.sqrt(q.shape[-1])  # (N_k,)
            w = np.exp(row - row.max())
            out[b, i] = (w / w.sum()) @ vf[b]
    return out.reshape(*lead, n_q, v.shape[-1])


def valid_numpy_logsumexp(q, k, v):
    s = np.matmul(q, np.moveaxis(k, -1, -2)) / math.sqrt(q.shape[-1])
    m = s.max(axis=-1, keepdims=True)
    lse = m + np.log(np.exp(s - m).sum(axis=-1, keepdims=True))
    return np.exp(s - lse) @ v


def no_scale(q, k, v):
    s = np.einsum("...id,...jd->...ij", q, k)
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    return p / p.sum(axis=-1, keepdims=True) @ v


def scale_by_d(q, k, v):
    s = q @ np.swapaxes(k, -1, -2) / q.shape[-1]
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    return p / p.sum(axis=-1, keepdims=True) @ v


def scale_times_sqrt(q, k, v):
    s = (q @ np.swapaxes(k, -1, -2)) * math.sqrt(q.shape[-1])
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    return p / p.sum(axis=-1, keepdims=True) @ v


def scale_precedence(q, k, v):
    d = q.shape[-1]
    s = q @ np.swapaxes(k, -1, -2) / d ** 1/2
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    return p / p.sum(axis=-1, keepdims=True) @ v


def scale_from_n(q, k, v):
    n, d = q.shape[-2:]
    s = q @ np.swapaxes(k, -1, -2) / math.sqrt(n)
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    return p / p.sum(axis=-1, keepdims=True) @ v


def wrong_axis(q, k, v):
    s = q @ np.swapaxes(k, -1, -2) / math.sqrt(q.shape[-1])
    p = np.exp(s - s.max(axis=-2, keepdims=True))
    return p / p.sum(axis=-2, keepdims=True) @ v


def axis_one(q, k, v):
    s = q @ np.swapaxes(k, -1, -2) / math.sqrt(q.shape[-1])
    p = np.exp(s - s.max(axis=1, keepdims=True))
    return p / p.sum(axis=1, keepdims=True) @ v


def no_max_subtraction(q, k, v):
    s = q @ np.swapaxes(k, -1, -2) / math.sqrt(q.shape[-1])
    with np.errstate(over="ignore", invalid="ignore"):
        p = np.exp(s)
        return p / p.sum(axis=-1, keepdims=True) @ v


def no_max_plain(q, k, v):
    e = np.exp(q @ np.swapaxes(k, -1, -2) / math.sqrt(q.shape[-1]))
    return (e / e.sum(-1)[..., None]) @ v


def global_max(q, k, v):
    s = q @ np.swapaxes(k, -1, -2) / math.sqrt(q.shape[-1])
    s -= s.max()
    p = np.exp(s)
    return p / p.sum(axis=-1, keepdims=True) @ v


def max_without_keepdims(q, k, v):
    s = q @ np.swapaxes(k, -1, -2) / math.sqrt(q.shape[-1])
    p = np.exp(s - s.max(axis=-1))
    return p / p.sum(axis=-1, keepdims=True) @ v


def sum_without_keepdims(q, k, v):
    s = q @ np.swapaxes(k, -1, -2) / math.sqrt(q.shape[-1])
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    return p / p.sum(axis=-1) @ v


def whole_matrix_sum(q, k, v):
    s = q @ np.swapaxes(k, -1, -2) / math.sqrt(q.shape[-1])
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    return (p / np.sum(p)) @ v


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


def reshape_not_transpose(q, k, v):
    k_t = k.reshape(*k.shape[:-2], k.shape[-1], k.shape[-2])
    s = q @ k_t / math.sqrt(q.shape[-1])
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    return p / p.sum(axis=-1, keepdims=True) @ v


def transposed_only_2d(q, k, v):  # k.T reverses *all* axes: wrong for batched input
    s = q @ k.T / math.sqrt(q.shape[-1])
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    return p / p.sum(axis=-1, keepdims=True) @ v


def scales_q_in_place(q, k, v):
    q /= math.sqrt(q.shape[-1])
    s = q @ np.swapaxes(k, -1, -2)
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    return p / p.sum(axis=-1, keepdims=True) @ v


def last_key_skipped(q, k, v):  # an off-by-one slice
    s = q @ np.swapaxes(k[..., :-1, :], -1, -2) / math.sqrt(q.shape[-1])
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    return p / p.sum(axis=-1, keepdims=True) @ v[..., :-1, :]


def half_precision(q, k, v):
    q, k, v = (x.astype(np.float16) for x in (q, k, v))
    return right_numpy(q, k, v).astype(np.float64)


NUMPY_VALID = [right_numpy, valid_numpy_einsum, valid_numpy_rows, valid_numpy_logsumexp]

NUMPY_CORPUS = [
    (no_scale, "not scaled"),
    (scale_by_d, "scaled by 1/d"),
    (scale_times_sqrt, "multiplied by √d"),
    (scale_precedence, "`s / d ** 1/2` is (s / d) / 2"),
    (scale_from_n, "q.shape[-2], the number of queries"),
    (wrong_axis, "softmax over the wrong axis"),
    (axis_one, "softmax over axis 1"),
    (no_max_subtraction, "no max subtraction"),
    (no_max_plain, "no max subtraction"),
    (global_max, "the whole array's"),
    (max_without_keepdims, "s.max(axis=-1) without keepdims"),
    (sum_without_keepdims, "p.sum(axis=-1) without keepdims"),
    (whole_matrix_sum, "sum of the whole matrix"),
    (returns_p, "returned the attention weights P"),
    (not_normalised, "not normalised"),
    (numpy_scalar_promotes, "math.sqrt"),
    (reshape_not_transpose, "reshaped to (d, N_k) instead of transposed"),
    (transposed_only_2d, None),
    (scales_q_in_place, None),
    (last_key_skipped, None),
    (half_precision, None),
]


@pytest.mark.parametrize("valid", NUMPY_VALID, ids=[f.__name__ for f in NUMPY_VALID])
def test_valid_numpy_answers_pass(valid, capsys):
    assert ch01.check_attention_numpy(valid) is valid
    assert "Exercise 1.1: passed" in capsys.readouterr().out


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("wrong,cause", NUMPY_CORPUS, ids=[f.__name__ for f, _ in NUMPY_CORPUS])
def test_wrong_numpy_is_rejected_and_diagnosed(wrong, cause):
    assert_rejected(ch01.check_attention_numpy, wrong, cause, "1.1")


def test_in_place_change_of_an_input_is_named():
    with pytest.raises(ExerciseFailed, match="changed its input `q` in place"):
        ch01.check_attention_numpy(scales_q_in_place)


def test_stub_falls_back_to_the_library(capsys):
    def stub(q, k, v):
        raise NotImplementedError("Exercise 1.1")

    fn = ch01.check_attention_numpy(stub)
    assert "not done yet" in capsys.readouterr().out
    q = np.random.default_rng(0).standard_normal((6, 4))
    np.testing.assert_allclose(fn(q, q, q), right_numpy(q, q, q), atol=1e-12)


def test_cases_vary_what_the_mistakes_depend_on():
    cases = ch01.numpy_cases()
    shapes = [tuple(x.shape for x in c.args) for c in cases]
    assert any(q[-2] != k[-2] for q, k, _ in shapes)  # N_q ≠ N_k
    assert any(q[-2] == k[-2] for q, k, _ in shapes)  # a square score matrix (keepdims slips)
    assert any(v[-1] != q[-1] for q, _, v in shapes)  # d_v ≠ d
    assert any(len(q) == 4 and q[0] > 1 and q[1] > 1 for q, _, _ in shapes)  # batch and heads
    assert any(math.isqrt(q[-1]) ** 2 != q[-1] for q, _, _ in shapes)  # d not a perfect square
    assert any(not x.flags.c_contiguous for c in cases for x in c.args)  # strided views
    scores = [ch01._variant(*c.args, subtract_max="none", normalise="none", return_p=True)
              for c in cases]
    row_max = [np.log(np.maximum(p, 1e-300)).max(axis=-1) for p in scores]
    assert any((m > np.log(np.finfo(np.float64).max)).any() for m in row_max)  # overflow
    assert any((m < -700).any() for m in row_max)  # a row far below 0: underflow
    float32 = [c for c in cases if c.args[0].dtype == np.float32]
    assert float32 and all(not np.array_equal(c.args[0], np.round(c.args[0])) for c in float32)


def test_torch_cases_keep_the_strides():
    cases = ch01.torch_cases(device="cpu")
    assert any(not x.is_contiguous() for c in cases for x in c.args)
    q, k, v = cases[2].args
    assert q.stride() != k.stride()


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


def valid_torch_sdpa(q, k, v):
    return torch.nn.functional.scaled_dot_product_attention(q, k, v)


def valid_torch_manual(q, k, v):
    s = torch.einsum("...id,...jd->...ij", q, k) / q.shape[-1] ** 0.5
    p = torch.exp(s - s.amax(dim=-1, keepdim=True))
    return (p / p.sum(dim=-1, keepdim=True)) @ v


def valid_torch_mT(q, k, v):
    return (q @ k.mT).div(math.sqrt(q.size(-1))).softmax(dim=-1).matmul(v)


def torch_no_scale(q, k, v):
    return torch.softmax(q @ k.transpose(-2, -1), dim=-1) @ v


def torch_scale_by_d(q, k, v):
    return torch.softmax(q @ k.transpose(-2, -1) / q.shape[-1], dim=-1) @ v


def torch_wrong_dim(q, k, v):
    return torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), dim=-2) @ v


def torch_dim_one(q, k, v):
    return torch.nn.functional.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), dim=1) @ v


def torch_unsafe_exp(q, k, v):
    p = torch.exp(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]))
    return p / p.sum(-1, keepdim=True) @ v


def torch_global_max(q, k, v):
    s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    p = torch.exp(s - s.max())
    return p / p.sum(-1, keepdim=True) @ v


def torch_sum_no_keepdim(q, k, v):
    s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    p = torch.exp(s - s.max(-1, keepdim=True).values)
    return p / p.sum(-1) @ v


def torch_view_not_transpose(q, k, v):
    return torch.softmax(q @ k.view(*k.shape[:-2], k.shape[-1], k.shape[-2])
                         / math.sqrt(q.shape[-1]), dim=-1) @ v


def torch_returns_p(q, k, v):
    return torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), dim=-1)


def torch_returns_numpy(q, k, v):
    return right_torch(q, k, v).numpy()


def torch_loses_dtype(q, k, v):
    return right_torch(q.double(), k.double(), v.double())


def torch_in_place_scale(q, k, v):
    q.div_(math.sqrt(q.shape[-1]))
    return torch.softmax(q @ k.transpose(-2, -1), dim=-1) @ v


def torch_t_of_batched(q, k, v):
    return torch.softmax(q @ k.T / math.sqrt(q.shape[-1]), dim=-1) @ v


TORCH_VALID = [right_torch, valid_torch_sdpa, valid_torch_manual, valid_torch_mT]

TORCH_CORPUS = [
    (torch_no_scale, "not scaled"),
    (torch_scale_by_d, "scaled by 1/d"),
    (torch_wrong_dim, "softmax over the wrong axis"),
    (torch_dim_one, "softmax over axis 1"),
    (torch_unsafe_exp, "no max subtraction"),
    (torch_global_max, "the whole array's"),
    (torch_sum_no_keepdim, "p.sum(axis=-1) without keepdims"),
    (torch_view_not_transpose, "reshaped to (d, N_k) instead of transposed"),
    (torch_returns_p, "returned the attention weights P"),
    (torch_returns_numpy, None),
    (torch_loses_dtype, None),
    (torch_in_place_scale, None),
    (torch_t_of_batched, None),
]


@pytest.mark.parametrize("valid", TORCH_VALID, ids=[f.__name__ for f in TORCH_VALID])
def test_valid_torch_answers_pass(valid, capsys):
    assert ch01.check_attention_torch(valid, device="cpu") is valid
    assert "Exercise 1.2: passed" in capsys.readouterr().out


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("wrong,cause", TORCH_CORPUS, ids=[f.__name__ for f, _ in TORCH_CORPUS])
def test_wrong_torch_is_rejected_and_diagnosed(wrong, cause):
    assert_rejected(ch01.check_attention_torch, wrong, cause, "1.2", device="cpu")


def test_torch_type_and_dtype_slips_are_said_plainly():
    for wrong, text in ((torch_returns_numpy, "NumPy array where a torch.Tensor is expected"),
                        (torch_loses_dtype, "dtype float64 but expected float32")):
        with pytest.raises(ExerciseFailed, match=text):
            ch01.check_attention_torch(wrong, device="cpu")


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


def valid_standard_triu_index(q, k, v, causal=False, scale=None):
    d = q.shape[-1]
    if scale is None:
        scale = d ** -0.5
    s = np.matmul(q.astype(float), np.swapaxes(k.astype(float), -1, -2)) * scale
    if causal:
        hidden = np.triu(np.ones((q.shape[-2], k.shape[-2]), dtype=bool), k=1)
        s[..., hidden] = -np.inf
    m = np.max(s, axis=-1)
    w = np.exp(s - m[..., None])
    total = w.sum(axis=-1)
    o = np.einsum("...ij,...jd->...id", w / total[..., None], v.astype(float))
    return o.astype(q.dtype), m + np.log(total)


def valid_standard_rows(q, k, v, causal=False, scale=None):  # a loop over query rows
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    n_q, n_k = q.shape[-2], k.shape[-2]
    o = np.zeros((*q.shape[:-1], v.shape[-1]))
    lse = np.zeros(q.shape[:-1])
    for i in range(n_q):
        stop = min(i + 1, n_k) if causal else n_k
        row = scale * np.einsum("...d,...jd->...j", q[..., i, :].astype(np.float64),
                                k[..., :stop, :].astype(np.float64))
        top = row.max(axis=-1, keepdims=True)
        e = np.exp(row - top)
        o[..., i, :] = np.einsum("...j,...jd->...d", e, v[..., :stop, :].astype(np.float64)) \
            / e.sum(-1, keepdims=True)
        lse[..., i] = top[..., 0] + np.log(e.sum(-1))
    return o.astype(q.dtype), lse


def valid_standard_logaddexp(q, k, v, causal=False, scale=None):
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = scale * (q.astype(np.float64) @ np.swapaxes(k.astype(np.float64), -1, -2))
    if causal:
        s = np.where(np.arange(k.shape[-2]) <= np.arange(q.shape[-2])[:, None], s,
                     np.finfo(np.float64).min)
    lse = np.logaddexp.reduce(s, axis=-1)
    o = np.exp(s - lse[..., None]) @ v.astype(np.float64)
    return o.astype(q.dtype), lse


def _learner_std(q, k, v, causal, scale, *, visible="tril", factor="given", fill=-np.inf,
                 max_axis=-1, sum_axis=-1, subtract=True, normalise=True, lse="m + log l",
                 work=np.float64, o_cast=True):
    """A learner's answer written out with np.tril masks, one thing done its own (wrong) way."""
    n_q, n_k, d = q.shape[-2], k.shape[-2], q.shape[-1]
    if factor == "given":
        scale = 1 / math.sqrt(d) if scale is None else scale
    elif factor == "ignored":
        scale = 1 / math.sqrt(d)
    elif factor == "d":
        scale = 1 / d if scale is None else scale
    elif factor == "divides":
        scale = 1 / (math.sqrt(d) if scale is None else scale)
    elif factor == "both":
        scale = (1 if scale is None else scale) / math.sqrt(d)
    qw, kw, vw = (x.astype(q.dtype if work is None else work) for x in (q, k, v))
    s = (qw @ np.swapaxes(kw, -1, -2)) * scale
    if causal:
        ones = np.ones((n_q, n_k))
        keep = {"tril": np.tril(ones), "triu": np.triu(ones), "strict": np.tril(ones, k=-1),
                "bottom-right": np.tril(ones, k=n_k - n_q)}[visible].astype(bool)
        s = s * keep if fill == 0 else np.where(keep, s, fill)
    m = s.max(axis=max_axis, keepdims=True) if subtract == "row" or subtract is True else (
        s.max() if subtract == "global" else 0)
    p = np.exp(s - m)
    l = p.sum(axis=sum_axis, keepdims=True)
    o = (p / l if normalise else p) @ vw
    if lse == "m + log l":
        out = np.squeeze(m + np.log(l), -1) if np.ndim(m) else np.log(l)[..., 0] + m
    elif lse == "log l":
        out = np.log(l)[..., 0]
    elif lse == "log2":
        out = np.log2(np.exp(1)) * (m + np.log(l))[..., 0]
    else:  # log of the unshifted sum
        out = np.log(np.sum(np.exp(s), axis=-1))
    return (o.astype(q.dtype) if o_cast else o), out


def _std(name, **knobs):
    def answer(q, k, v, causal=False, scale=None):
        return _learner_std(q, k, v, causal, scale, **knobs)
    answer.__name__ = name
    return answer


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


def std_returns_o_only(q, k, v, causal=False, scale=None):
    return right_standard(q, k, v, causal, scale)[0]


def std_square_mask(q, k, v, causal=False, scale=None):  # (N_q, N_q) mask: N_q ≠ N_k crashes
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = scale * (q.astype(np.float64) @ np.swapaxes(k.astype(np.float64), -1, -2))
    if causal:
        s = np.where(np.tril(np.ones((q.shape[-2], q.shape[-2]))) > 0, s, -np.inf)
    m = s.max(-1, keepdims=True)
    p = np.exp(s - m)
    return (p @ v / p.sum(-1, keepdims=True)).astype(q.dtype), (m + np.log(p.sum(-1, keepdims=True)))[..., 0]


def std_lse_keepdims(q, k, v, causal=False, scale=None):
    o, lse = right_standard(q, k, v, causal, scale)
    return o, lse[..., None]


STANDARD_VALID = [right_standard, valid_standard_triu_index, valid_standard_rows,
                  valid_standard_logaddexp]

STANDARD_CORPUS = [
    (_std("no_max", subtract=False), "no max subtraction"),
    (_std("global_max", subtract="global"), "the whole array's"),
    (_std("mask_triu", visible="triu"), "causal mask is transposed"),
    (_std("mask_strict", visible="strict"), "off by one (j < i)"),
    (_std("mask_bottom_right", visible="bottom-right"), "bottom-right corner"),
    (_std("mask_multiplied", fill=0), "set to 0 (s * mask)"),
    (std_mask_after_softmax, "after the softmax"),
    (_std("scale_ignored", factor="ignored"), "`scale` argument is ignored"),
    (_std("scale_divides", factor="divides"), "the given `scale` divides the scores"),
    (_std("scale_twice", factor="both"), "both the given `scale` and 1/√d"),
    (_std("scale_by_d", factor="d"), "scaled by 1/d"),
    (_std("wrong_axis", max_axis=-2, sum_axis=-2, lse="log l"), None),
    (_std("not_normalised", normalise=False), "not normalised"),
    (_std("lse_without_max", lse="log l"), "lse without the max"),
    (_std("lse_unshifted", lse="unshifted"), "log(Σ exp(s)) without the max"),
    (_std("lse_log2", lse="log2"), "lse in log2 units"),
    (_std("computes_in_input_dtype", work=None), "lse is in q's dtype"),
    (_std("o_not_cast", o_cast=False), "o is float64 for float32 inputs"),
    (std_returns_o_only, None),
    (std_square_mask, None),
    (std_lse_keepdims, None),
]


@pytest.mark.parametrize("valid", STANDARD_VALID, ids=[f.__name__ for f in STANDARD_VALID])
def test_valid_standard_answers_pass(valid, capsys):
    assert ch01.check_standard_attention(valid) is valid
    assert "Exercise 1.3: passed (9 cases)" in capsys.readouterr().out


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("wrong,cause", STANDARD_CORPUS,
                         ids=[f.__name__ for f, _ in STANDARD_CORPUS])
def test_wrong_standard_is_rejected_and_diagnosed(wrong, cause):
    message = assert_rejected(ch01.check_standard_attention, wrong, cause, "1.3")
    assert message.count("likely cause") <= 1


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("check, mistakes", [
    (ch01.check_attention_numpy, ch01.MISTAKES_NUMPY),
    (ch01.check_standard_attention, ch01.MISTAKES_STANDARD),
])
def test_every_mistake_model_is_named_as_itself(check, mistakes):
    for cause, model in mistakes.items():
        with pytest.raises(ExerciseFailed) as failure:
            check(model)
        assert "likely cause: " + cause in str(failure.value)


def test_standard_stub_falls_back_to_the_oracle(capsys):
    def stub(q, k, v, causal=False, scale=None):
        raise NotImplementedError("Exercise 1.3")

    from course_lib.attention.reference import naive_attention_numpy

    assert ch01.check_standard_attention(stub) is naive_attention_numpy
    assert "Exercise 1.3: not done yet" in capsys.readouterr().out


def test_standard_cases_tell_the_mistakes_apart():
    cases = ch01.standard_cases()
    shapes = [(c.args[0].shape, c.args[1].shape, c.args[2].shape) for c in cases]
    causal = [bool((c.kwargs or {}).get("causal")) for c in cases]
    assert any(c and q[-2] < k[-2] for c, (q, k, _) in zip(causal, shapes))  # bottom-right shows
    assert any(c and q[-2] > k[-2] for c, (q, k, _) in zip(causal, shapes))
    assert any((c.kwargs or {}).get("scale") and (c.kwargs or {}).get("causal") for c in cases)
    assert {c.args[0].dtype for c in cases} == {np.dtype(np.float32), np.dtype(np.float64)}
    assert any(math.isqrt(q[-1]) ** 2 != q[-1] for q, _, _ in shapes)
    assert any(not x.flags.c_contiguous for c in cases for x in c.args)
    assert any(len(q) == 4 for q, _, _ in shapes)
    lse = [naive_attention_numpy(*c.args, **(c.kwargs or {}))[1] for c in cases]
    assert any((x > 700).any() and (x < -700).any() for x in lse)  # both signs, thousands
    assert len(ch01.MISTAKES_STANDARD) >= 5


def test_standard_hints_and_skeleton_render():
    from course_lib.teaching.widgets.hints import HintLadder

    ladder = HintLadder("Exercise 1.3", ch01.STANDARD_HINTS, skeleton=ch01.STANDARD_SKELETON)
    while ladder.next_hint():
        pass
    assert ladder.revealed == len(ch01.STANDARD_HINTS)
    assert "lse = ..." in ladder.show_skeleton()

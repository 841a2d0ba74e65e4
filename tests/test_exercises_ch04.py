"""Chapter 04's checks: right answers pass, every wrong answer in the corpus is rejected with its
cause named, not-done stubs fall back to the library."""

from __future__ import annotations

import linecache

import numpy as np
import pytest

from corpus_checks import assert_rejected
from course_lib.attention import iomodel, tiled
from course_lib.teaching.checks import ExerciseFailed
from course_lib.teaching.exercises import ch04

pytestmark = pytest.mark.ch04

CHECKS = [(ch04.check_fa2_forward, ch04.FORWARD_MISTAKES, tiled.flash_attention_numpy),
          (ch04.check_causal_skip_grid, ch04.SKIP_MISTAKES, iomodel.causal_skip_grid),
          (ch04.check_olm_traffic, ch04.TRAFFIC_MISTAKES, ch04.olm_traffic),
          (ch04.check_flash_forward, ch04.WHOLE_FORWARD_MISTAKES, tiled.flash_attention_numpy),
          (ch04.check_flash_forward_fa1, ch04.FA1_MISTAKES, tiled.flash_attention_numpy_fa1)]


@pytest.mark.parametrize("check,mistakes,right", CHECKS)
def test_right_answer_passes(check, mistakes, right, capsys):
    assert check(right) is right
    assert "passed" in capsys.readouterr().out


@pytest.mark.parametrize("check,mistakes,right", CHECKS)
def test_not_done_falls_back(check, mistakes, right, capsys):
    def stub(*args, **kwargs):
        raise NotImplementedError("Exercise 4.x")
    assert check(stub) is not stub
    assert "not done yet" in capsys.readouterr().out


@pytest.mark.parametrize("check,cause,wrong", [
    (check, cause, wrong) for check, mistakes, _ in CHECKS for cause, wrong in mistakes.items()])
def test_each_mistake_is_rejected_and_named(check, cause, wrong):
    with pytest.raises(ExerciseFailed) as info:
        check(wrong)
    assert f"likely cause: {cause}" in str(info.value)


def test_at_least_three_mistakes_per_exercise():
    for _, mistakes, _ in CHECKS:
        assert len(mistakes) >= 3


def test_unmodelled_off_by_one_is_still_rejected():
    def off_by_one(q, k, v, causal=False, scale=None, block_m=32, block_n=16):
        o, lse = tiled.flash_attention_numpy(q, k, v, causal, scale, block_m, block_n)
        if causal:  # query 0 loses its only key
            o = o.copy()
            o[..., 0, :] = np.nan
        return o, lse
    with pytest.raises(ExerciseFailed, match="NaN"):
        ch04.check_fa2_forward(off_by_one)


@pytest.mark.parametrize("bad,match", [
    (lambda *a, **k: None, "None"),
    (lambda q, k, v, **kw: q, "tuple of 2"),
    (lambda *a, **k: 1 / 0, "ZeroDivisionError"),
])
@pytest.mark.parametrize("check", [ch04.check_fa2_forward, ch04.check_flash_forward,
                                   ch04.check_flash_forward_fa1])
def test_broken_learner_code_gets_one_clear_message(check, bad, match):
    with pytest.raises(ExerciseFailed, match=match):
        check(bad)


def test_wrong_dtype_of_skip_grid():
    with pytest.raises(ExerciseFailed, match="dtype"):
        ch04.check_causal_skip_grid(lambda *a: iomodel.causal_skip_grid(*a).astype(int))


# ---- Exercises 4.4 and 4.5: the whole forward, FA2 and FA1 loop orders -----------------------

WHOLE = [(ch04.check_flash_forward, tiled.flash_attention_numpy, ch04.WHOLE_FORWARD_MISTAKES),
         (ch04.check_flash_forward_fa1, tiled.flash_attention_numpy_fa1, ch04.FA1_MISTAKES)]


def visits_every_tile(library):
    """A wrong answer with the right numbers: every tile loaded and computed, the causal mask
    applied to all of them, none skipped."""
    def forward(q, k, v, causal=False, scale=None, block_m=32, block_n=16):
        return library(q, k, v, scale=scale, block_m=block_m, block_n=block_n,
                       rule=ch04._ExerciseMask(causal))
    return forward


def drops_ragged_q_tile(fill):
    """range(N_q // BLOCK_M): the last, ragged Q tile is never computed; its rows keep what
    `o` and `lse` were created with (zeros, or garbage from np.empty)."""
    def forward(q, k, v, causal=False, scale=None, block_m=32, block_n=16):
        o, lse = tiled.flash_attention_numpy(q, k, v, causal, scale, block_m, block_n)
        full = q.shape[-2] // block_m * block_m
        o[..., full:, :], lse[..., full:] = fill, fill
        return o, lse
    return forward


def reads_q_twice(q, k, v, **kwargs):
    """Right numbers, but q is also scanned whole once more (e.g. a max over it)."""
    np.abs(q).max()
    return tiled.flash_attention_numpy(q, k, v, **kwargs)


def fa1_loads_unseen_kv_tiles(q, k, v, **kwargs):
    """FA1 order that also copies the K/V rows past N_q, which no causal query sees."""
    if kwargs.get("causal"):
        np.array(k[..., q.shape[-2]:, :]), np.array(v[..., q.shape[-2]:, :])
    return tiled.flash_attention_numpy_fa1(q, k, v, **kwargs)


@pytest.mark.parametrize("check,cause,wrong", [
    (check, cause, wrong) for check, _, mistakes in WHOLE for cause, wrong in mistakes.items()])
def test_whole_forward_diagnosis_gives_row_tile_and_one_cause(check, cause, wrong):
    with pytest.raises(ExerciseFailed) as info:
        check(wrong)
    message = str(info.value)
    assert "wrong answer on case" in message and "first bad query row" in message
    assert message.count("likely cause:") == 1


def test_at_least_five_mistakes_per_whole_forward():
    for _, _, mistakes in WHOLE:
        assert len(mistakes) >= 5


def test_whole_forward_stub_says_not_done_only(capsys):
    def stub(q, k, v, causal=False, scale=None, block_m=32, block_n=16):
        raise NotImplementedError("Exercise 4.5")
    ch04.check_flash_forward_fa1(stub)
    out = capsys.readouterr().out
    assert "not done yet" in out and "passed" not in out


@pytest.mark.parametrize("check,library,mistakes", WHOLE)
def test_visiting_tiles_right_of_the_diagonal_is_caught(check, library, mistakes):
    with pytest.raises(ExerciseFailed) as info:
        check(visits_every_tile(library))
    message = str(info.value)
    assert "right numbers, wrong loads on case 2" in message
    assert "hidden tile" in message and "does not see" in message


@pytest.mark.parametrize("fill", [0.0, np.nan])
def test_dropped_ragged_q_tile_is_named(fill):
    with pytest.raises(ExerciseFailed) as info:
        ch04.check_flash_forward(drops_ragged_q_tile(fill))
    message = str(info.value)
    assert "first bad query row: 32 (wrong in o and lse), in Q tile 2 = rows 32–36" in message
    assert f"likely cause: {ch04.RAGGED_Q_DROPPED}" in message


@pytest.mark.parametrize("check,wrong,says", [
    (ch04.check_flash_forward, reads_q_twice, "too many loads: the elements of q in Q tile 0"),
    (ch04.check_flash_forward_fa1, fa1_loads_unseen_kv_tiles, "which no query sees")])
def test_extra_loads_are_caught(check, wrong, says):
    with pytest.raises(ExerciseFailed) as info:
        check(wrong)
    assert says in str(info.value)


def test_causal_left_for_later_is_not_done_not_a_pass(capsys):
    def causal_todo(q, k, v, causal=False, scale=None, block_m=32, block_n=16):
        if causal:
            raise NotImplementedError("causal: later")
        return tiled.flash_attention_numpy(q, k, v, False, scale, block_m, block_n)
    assert ch04.check_flash_forward(causal_todo) is tiled.flash_attention_numpy
    out = capsys.readouterr().out
    assert "not done yet" in out and "passed" not in out


def test_whole_forward_crash_gets_one_clear_message():
    def crashes(q, k, v, causal=False, scale=None, block_m=32, block_n=16):
        return q @ k  # (..., N_q, d) @ (..., N_k, d): shapes do not line up
    with pytest.raises(ExerciseFailed, match="your function raised"):
        ch04.check_flash_forward(crashes)


# ---- learner-written answers for exercises 4.4 and 4.5 --------------------------------------
# Each wrong answer is a learner's own forward (a style different from the library's loop: slices
# instead of load_tile, einsum, HBM arrays named O, L, M) with one plausible mistake typed into
# it. They are compiled from source under a file name of their own, so that diagnoses can quote
# the learner's line, as they do in a notebook.

LEARNER_FA2 = '''\
def flash_forward(q, k, v, causal=False, scale=None, block_m=32, block_n=16):
    n_q, d = q.shape[-2:]
    n_k, d_v = k.shape[-2], v.shape[-1]
    if scale is None:
        scale = 1.0 / np.sqrt(d)
    o = np.zeros(q.shape[:-1] + (d_v,), dtype=q.dtype)
    lse = np.zeros(q.shape[:-1], dtype=q.dtype)
    for i in range(0, n_q, block_m):
        qi = q[..., i:i + block_m, :]
        r = qi.shape[-2]
        m = np.full(qi.shape[:-1], -np.inf)
        l = np.zeros(qi.shape[:-1])
        acc = np.zeros(qi.shape[:-1] + (d_v,))
        for j in range(0, n_k, block_n):
            if causal and j > i + r - 1:
                break
            kj = k[..., j:j + block_n, :]
            vj = v[..., j:j + block_n, :]
            s = (qi @ np.swapaxes(kj, -1, -2)) * scale
            if causal:
                qpos = np.arange(i, i + r)[:, None]
                kpos = np.arange(j, j + kj.shape[-2])[None, :]
                s = np.where(kpos <= qpos, s, -np.inf)
            m_new = np.maximum(m, s.max(axis=-1))
            p = np.exp(s - m_new[..., None])
            alpha = np.exp(m - m_new)
            l = alpha * l + p.sum(axis=-1)
            acc = alpha[..., None] * acc + p @ vj
            m = m_new
        o[..., i:i + r, :] = acc / l[..., None]
        lse[..., i:i + r] = m + np.log(l)
    return o, lse
'''

LEARNER_FA1 = '''\
def flash_forward_fa1(q, k, v, causal=False, scale=None, block_m=32, block_n=16):
    *lead, n_q, d = q.shape
    n_k, d_v = v.shape[-2:]
    scale = d ** -0.5 if scale is None else scale
    O = np.zeros((*lead, n_q, d_v))
    L = np.zeros((*lead, n_q))
    M = np.full((*lead, n_q), -np.inf)
    for j in range(0, n_k, block_n):
        if causal and j >= n_q:
            break
        Kj = k[..., j:j + block_n, :]
        Vj = v[..., j:j + block_n, :]
        kpos = np.arange(j, j + Kj.shape[-2])
        for i in range(0, n_q, block_m):
            stop = min(i + block_m, n_q)
            if causal and j > stop - 1:
                continue
            Qi = q[..., i:stop, :]
            S = scale * np.einsum("...id,...jd->...ij", Qi, Kj)
            if causal:
                S = np.where(kpos[None, :] <= np.arange(i, stop)[:, None], S, -np.inf)
            m_old, l_old, o_old = M[..., i:stop], L[..., i:stop], O[..., i:stop, :]
            m_new = np.maximum(m_old, S.max(-1))
            P = np.exp(S - m_new[..., None])
            l_new = np.exp(m_old - m_new) * l_old + P.sum(-1)
            O[..., i:stop, :] = ((np.exp(m_old - m_new) * l_old)[..., None] * o_old + P @ Vj) / l_new[..., None]
            M[..., i:stop], L[..., i:stop] = m_new, l_new
    return O.astype(q.dtype), (M + np.log(L)).astype(q.dtype)
'''


def learner_answer(source: str, edits=(), label: str = "answer"):
    """The function defined by ``source`` with each ``(old, new)`` edit applied (each ``old``
    must occur), compiled under a file name of its own so that messages can quote its lines."""
    for old, new in edits:
        assert old in source, old
        source = source.replace(old, new)
    filename = f"<learner {label}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    namespace = {"np": np, "tiled": tiled, "iomodel": iomodel}
    exec(compile(source, filename, "exec"), namespace)
    return next(value for name, value in namespace.items() if name.startswith("flash_forward"))


def cause(words: str, mistakes=ch04.WHOLE_FORWARD_MISTAKES) -> str:
    """The known cause (of exercise 4.4's mistake models, or of ``mistakes``) with ``words``."""
    return next(c for c in mistakes if words in c)


def cause1(words: str) -> str:
    """The known cause of exercise 4.5's mistake models that contains ``words``."""
    return cause(words, ch04.FA1_MISTAKES)


NO_CAUSE = None  # the diagnosis must name no cause
LOADS = "loads"  # right numbers: the diagnosis is about loads (which tile, which line)

# (label, edits, what the diagnosis must say: a cause (text of WHOLE_FORWARD_MISTAKES or a
# constant), LOADS, or NO_CAUSE)
FA2_WRONG = [
    ("no causal skip", [("            if causal and j > i + r - 1:\n                break\n", "")],
     LOADS),
    ("skip bound of a full last tile", [("j > i + r - 1", "j > i + block_m - 1")], LOADS),
    ("skip test >=", [("j > i + r - 1", "j >= i + r - 1")], ch04._SKIP_GE),
    ("mask hides the diagonal", [("kpos <= qpos", "kpos < qpos")], ch04._DIAGONAL_HIDDEN),
    ("mask sees the next key", [("kpos <= qpos", "kpos <= qpos + 1")], ch04._CAUSAL_OFF_BY_ONE),
    ("acc not rescaled", [("acc = alpha[..., None] * acc + p @ vj", "acc = acc + p @ vj")],
     cause("accumulator (O) is not rescaled")),
    ("l not rescaled", [("l = alpha * l + p.sum(axis=-1)", "l = l + p.sum(axis=-1)")],
     cause("running sum l is not rescaled")),
    ("lse without the max", [("m + np.log(l)", "np.log(l)")], cause("lse is log(l)")),
    ("no final division", [("acc / l[..., None]", "acc")], cause("final division")),
    ("scale argument ignored", [("* scale\n", "/ np.sqrt(d)\n")],
     cause("always scaled by 1/sqrt(d)")),
    ("default scale 1/d", [("1.0 / np.sqrt(d)", "1.0 / d")], ch04._DEFAULT_SCALE_1_OVER_D),
    ("state reset per K/V tile",
     [("        m = np.full(qi.shape[:-1], -np.inf)\n        l = np.zeros(qi.shape[:-1])\n"
       "        acc = np.zeros(qi.shape[:-1] + (d_v,))\n", ""),
      ("            kj = k[", "            m = np.full(qi.shape[:-1], -np.inf)\n"
       "            l = np.zeros(qi.shape[:-1])\n            acc = np.zeros(qi.shape[:-1] + (d_v,))\n"
       "            kj = k[")],
     cause("reset inside the K/V loop")),
    ("ragged last Q tile dropped", [("range(0, n_q, block_m)", "range(0, n_q - block_m + 1, block_m)")],
     ch04.RAGGED_Q_DROPPED),
    ("no max subtracted", [("np.exp(s - m_new[..., None])", "np.exp(s)"),
                           ("alpha = np.exp(m - m_new)", "alpha = np.ones_like(m)"),
                           ("m + np.log(l)", "np.log(l)")], NO_CAUSE),
    ("outputs in float64", [("dtype=q.dtype)", ")")], NO_CAUSE),
    ("q scaled in place", [("    o = np.zeros(q.shape", "    q *= scale\n    scale = 1.0\n    o = np.zeros(q.shape")],
     NO_CAUSE),
    ("k transposed with .T", [("np.swapaxes(kj, -1, -2)", "kj.T")], NO_CAUSE),
    ("upfront cast of k and v", [("    o = np.zeros(q.shape", "    k, v = k.astype(np.float64), v.astype(np.float64)\n"
                                  "    o = np.zeros(q.shape")], LOADS),
    ("Q tile sliced again for every K/V tile", [("(qi @ np.swapaxes", "(q[..., i:i + block_m, :] @ np.swapaxes")],
     LOADS),
]

FA1_WRONG = [
    ("no pair skip", [("            if causal and j > stop - 1:\n                continue\n", "")],
     LOADS),
    ("K/V tiles past N_q loaded", [("        if causal and j >= n_q:\n            break\n", ""),
                                   ("Kj = k[..., j:j + block_n, :]", "Kj = tiled.load_tile(k, j, block_n)[..., :min(block_n, n_k - j), :]")],
     LOADS),
    ("skip test >=", [("j > stop - 1", "j >= stop - 1")], ch04._SKIP_GE),
    ("o not rescaled on reload", [("((np.exp(m_old - m_new) * l_old)[..., None] * o_old", "(l_old[..., None] * o_old")],
     cause1("l_old·o_old is not rescaled")),
    ("o reloaded as if unnormalised", [("((np.exp(m_old - m_new) * l_old)[..., None] * o_old", "(np.exp(m_old - m_new)[..., None] * o_old")],
     cause1("not un-normalised on reload")),
    ("l not rescaled", [("l_new = np.exp(m_old - m_new) * l_old + P.sum(-1)", "l_new = l_old + P.sum(-1)")],
     cause1("running sum l is not rescaled")),
    ("state not read back", [("m_old, l_old, o_old = M[..., i:stop], L[..., i:stop], O[..., i:stop, :]",
                              "m_old, l_old, o_old = np.full(Qi.shape[:-1], -np.inf), np.zeros(Qi.shape[:-1]), 0.0")],
     cause1("state is not read back")),
    ("lse without the max", [("(M + np.log(L))", "np.log(L)")], cause1("lse is log(l)")),
    ("scale argument ignored", [("scale = d ** -0.5 if scale is None else scale", "scale = d ** -0.5")],
     cause1("always scaled by 1/sqrt(d)")),
    ("float64 results", [("return O.astype(q.dtype), (M + np.log(L)).astype(q.dtype)", "return O, M + np.log(L)")],
     NO_CAUSE),
    ("mask hides the diagonal", [("<= np.arange(i, stop)", "< np.arange(i, stop)")],
     ch04._DIAGONAL_HIDDEN),
    ("upfront copy of k", [("    O = np.zeros(", "    k = np.array(k)\n    O = np.zeros(")], LOADS),
]


@pytest.mark.parametrize("label,edits,expect", FA2_WRONG, ids=[w[0] for w in FA2_WRONG])
def test_learner_fa2_mistakes_rejected_with_the_right_cause_or_none(label, edits, expect):
    with pytest.raises(ExerciseFailed) as info:
        ch04.check_flash_forward(learner_answer(LEARNER_FA2, edits, label))
    assert_diagnosis(str(info.value), expect, ch04.WHOLE_FORWARD_MISTAKES)


@pytest.mark.parametrize("label,edits,expect", FA1_WRONG, ids=[w[0] for w in FA1_WRONG])
def test_learner_fa1_mistakes_rejected_with_the_right_cause_or_none(label, edits, expect):
    with pytest.raises(ExerciseFailed) as info:
        ch04.check_flash_forward_fa1(learner_answer(LEARNER_FA1, edits, label))
    assert_diagnosis(str(info.value), expect, ch04.FA1_MISTAKES)


def assert_diagnosis(message: str, expect, mistakes):
    named = [line for line in message.split("\n")
             if line.startswith("  likely cause:") or line.startswith("  - ")]
    if expect is LOADS:
        assert "right numbers, wrong loads" in message
        assert "line " in message  # the learner's line that loaded it
        assert not named
    elif expect is NO_CAUSE:
        assert not named, message
    else:
        assert named == [f"  likely cause: {expect}"], message


VALID_FA2 = {
    "slices, shorter ragged tiles": (LEARNER_FA2, []),
    "exp2, q scaled up front, precomputed tile bounds, load_tile": ('''\
def flash_forward(q, k, v, causal=False, scale=None, block_m=32, block_n=16):
    LOG2E = 1.4426950408889634
    n_q, n_k, d_v = q.shape[-2], k.shape[-2], v.shape[-1]
    scale = 1 / np.sqrt(q.shape[-1]) if scale is None else scale
    q = q * (scale * LOG2E)                   # every Q tile needs its rows: one pass over q
    lead = q.shape[:-2]
    o = np.empty(lead + (n_q, d_v), dtype=q.dtype)
    lse = np.empty(lead + (n_q,), dtype=q.dtype)
    starts = [(i * block_m, min((i + 1) * block_m, n_q)) for i in range(iomodel.num_blocks(n_q, block_m))]
    for q0, q1 in starts:
        last_key = min(q1, n_k) if causal else n_k
        n_tiles = iomodel.num_blocks(last_key, block_n)
        qt = tiled.load_tile(q, q0, block_m)
        m = np.full(lead + (block_m,), -np.inf)
        l = np.zeros(lead + (block_m,))
        acc = np.zeros(lead + (block_m, d_v))
        for t in range(n_tiles):
            k0 = t * block_n
            kt, vt = tiled.load_tile(k, k0, block_n), tiled.load_tile(v, k0, block_n)
            cols = k0 + np.arange(block_n)
            ok = cols[None, :] < n_k
            if causal:
                ok = ok & (cols[None, :] <= (q0 + np.arange(block_m))[:, None])
            s = np.where(ok, np.einsum("...md,...nd->...mn", qt, kt), -np.inf)
            m2 = np.maximum(m, s.max(-1))
            corr = np.exp2(m - m2)
            pt = np.exp2(s - m2[..., None])
            l = corr * l + pt.sum(-1)
            acc = corr[..., None] * acc + np.einsum("...mn,...nd->...md", pt, vt)
            m = m2
        rows = q1 - q0
        o[..., q0:q1, :] = (acc / l[..., None])[..., :rows, :]
        lse[..., q0:q1] = ((m + np.log2(l)) / LOG2E)[..., :rows]
    return o, lse
''', []),
    "flattened heads, while loops, outputs reshaped at the end": ('''\
def flash_forward(q, k, v, causal=False, scale=None, block_m=32, block_n=16):
    q = np.asarray(q)                         # a defensive copy of q: loads it once
    lead, (n_q, d), (n_k, d_v) = q.shape[:-2], q.shape[-2:], v.shape[-2:]
    scale = scale if scale is not None else d ** -0.5
    qf, kf, vf = q.reshape(-1, n_q, d), k.reshape(-1, n_k, d), v.reshape(-1, n_k, d_v)
    o = np.zeros((qf.shape[0], n_q, d_v), dtype=q.dtype)
    lse = np.zeros((qf.shape[0], n_q), dtype=q.dtype)
    q0 = 0
    while q0 < n_q:
        q1 = min(q0 + block_m, n_q)
        qt = qf[:, q0:q1, :] * scale
        m = np.full((qf.shape[0], q1 - q0), -np.inf, dtype=q.dtype)
        l = np.zeros_like(m)
        acc = np.zeros((qf.shape[0], q1 - q0, d_v), dtype=q.dtype)
        k0 = 0
        while k0 < n_k and not (causal and k0 > q1 - 1):
            k1 = min(k0 + block_n, n_k)
            s = qt @ kf[:, k0:k1, :].transpose(0, 2, 1)
            if causal:
                s[:, np.arange(k0, k1)[None, :] > np.arange(q0, q1)[:, None]] = -np.inf
            m_new = np.maximum(m, s.max(axis=2))
            p = np.exp(s - m_new[:, :, None])
            scale_old = np.exp(m - m_new)
            l = scale_old * l + p.sum(axis=2)
            acc = scale_old[:, :, None] * acc + p @ vf[:, k0:k1, :]
            m = m_new
            k0 = k1
        o[:, q0:q1] = acc / l[:, :, None]
        lse[:, q0:q1] = m + np.log(l)
        q0 = q1
    return o.reshape(lead + (n_q, d_v)), lse.reshape(lead + (n_q,))
''', []),
    "reverse K/V order with a guarded max": (LEARNER_FA2, [
        ("        for j in range(0, n_k, block_n):\n            if causal and j > i + r - 1:\n                break\n",
         "        last = min(n_k, i + r) if causal else n_k\n"
         "        for j in reversed(range(0, last, block_n)):\n"),
        ("p = np.exp(s - m_new[..., None])", "p = np.exp(s - np.where(np.isinf(m_new), 0, m_new)[..., None])"),
        ("alpha = np.exp(m - m_new)", "alpha = np.exp(m - np.where(np.isinf(m_new), 0, m_new))"),
    ]),
}

VALID_FA1 = {
    "slices and einsum": (LEARNER_FA1, []),
    "load_tile, exp2, q scaled up front": ('''\
def flash_forward_fa1(q, k, v, causal=False, scale=None, block_m=32, block_n=16):
    LOG2E = 1.4426950408889634
    n_q, n_k, d_v = q.shape[-2], k.shape[-2], v.shape[-1]
    scale = 1 / np.sqrt(q.shape[-1]) if scale is None else scale
    qs = q.astype(np.float64) * (scale * LOG2E)
    lead = q.shape[:-2]
    o = np.zeros(lead + (n_q, d_v))
    l_hbm = np.zeros(lead + (n_q,))
    m_hbm = np.full(lead + (n_q,), -np.inf)
    n_kv = iomodel.num_blocks(min(n_k, n_q) if causal else n_k, block_n)
    for j in range(n_kv):
        k_start = j * block_n
        kt, vt = tiled.load_tile(k, k_start, block_n), tiled.load_tile(v, k_start, block_n)
        for i in range(iomodel.num_blocks(n_q, block_m)):
            q_start = i * block_m
            rows = iomodel.block_rows(i, n_q, block_m)
            if causal and k_start > q_start + rows - 1:
                continue
            sl = slice(q_start, q_start + rows)
            s = tiled.load_tile(qs, q_start, block_m)[..., :rows, :] @ np.swapaxes(kt, -1, -2)
            kk = k_start + np.arange(block_n)[None, :]
            qq = q_start + np.arange(rows)[:, None]
            s = np.where((kk < n_k) & ((kk <= qq) | (not causal)), s, -np.inf)
            m_new = np.maximum(m_hbm[..., sl], s.max(-1))
            a = np.exp2(m_hbm[..., sl] - m_new)
            p = np.exp2(s - m_new[..., None])
            l_new = a * l_hbm[..., sl] + p.sum(-1)
            o[..., sl, :] = ((a * l_hbm[..., sl])[..., None] * o[..., sl, :] + p @ vt) / l_new[..., None]
            l_hbm[..., sl], m_hbm[..., sl] = l_new, m_new
    return o.astype(q.dtype), ((m_hbm + np.log2(l_hbm)) / LOG2E).astype(q.dtype)
''', []),
    "unnormalised o in HBM, divided at the end": (LEARNER_FA1, [
        ("((np.exp(m_old - m_new) * l_old)[..., None] * o_old + P @ Vj) / l_new[..., None]",
         "np.exp(m_old - m_new)[..., None] * o_old + P @ Vj"),
        ("return O.astype(q.dtype)", "return (O / L[..., None]).astype(q.dtype)"),
    ]),
    "list of visible pairs": ('''\
def flash_forward_fa1(q, k, v, causal=False, scale=None, block_m=32, block_n=16):
    n_q, n_k = q.shape[-2], k.shape[-2]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    t_r, t_c = iomodel.num_blocks(n_q, block_m), iomodel.num_blocks(n_k, block_n)
    skip = iomodel.causal_skip_grid(n_q, n_k, block_m, block_n) if causal else np.zeros((t_r, t_c), bool)
    O = np.zeros(q.shape[:-1] + v.shape[-1:])
    L = np.zeros(q.shape[:-1])
    M = np.full(q.shape[:-1], -np.inf)
    for j in range(t_c):
        visible = [i for i in range(t_r) if not skip[i, j]]
        if not visible:
            continue
        K = k[..., j * block_n:(j + 1) * block_n, :]
        V = v[..., j * block_n:(j + 1) * block_n, :]
        for i in visible:
            rs = slice(i * block_m, min((i + 1) * block_m, n_q))
            S = q[..., rs, :] @ np.swapaxes(K, -1, -2) * scale
            qi, kj = np.ogrid[rs.start:rs.stop, j * block_n:j * block_n + K.shape[-2]]
            if causal:
                S[..., kj > qi] = -np.inf
            m_new = np.maximum(M[..., rs], S.max(-1))
            P = np.exp(S - m_new[..., None])
            a = np.exp(M[..., rs] - m_new)
            l_new = a * L[..., rs] + P.sum(-1)
            O[..., rs, :] = ((a * L[..., rs])[..., None] * O[..., rs, :] + P @ V) / l_new[..., None]
            M[..., rs], L[..., rs] = m_new, l_new
    return O.astype(q.dtype), (M + np.log(L)).astype(q.dtype)
''', []),
}


@pytest.mark.parametrize("label", list(VALID_FA2))
def test_valid_fa2_alternatives_pass(label, capsys):
    answer = learner_answer(*VALID_FA2[label], label=label)
    assert ch04.check_flash_forward(answer) is answer
    assert "✓ Exercise 4.4: passed" in capsys.readouterr().out


@pytest.mark.parametrize("label", list(VALID_FA1))
def test_valid_fa1_alternatives_pass(label, capsys):
    answer = learner_answer(*VALID_FA1[label], label=label)
    assert ch04.check_flash_forward_fa1(answer) is answer
    assert "✓ Exercise 4.5: passed" in capsys.readouterr().out


def test_corpus_sizes():
    assert len(FA2_WRONG) >= 10 and len(FA1_WRONG) >= 10
    assert len(VALID_FA2) >= 3 and len(VALID_FA1) >= 3


def test_hidden_tile_diagnosis_names_the_q_tile_the_k_v_tile_and_the_line():
    answer = learner_answer(LEARNER_FA2, FA2_WRONG[0][1], "no skip")
    with pytest.raises(ExerciseFailed) as info:
        ch04.check_flash_forward(answer)
    message = str(info.value)
    assert "while your loop was on Q tile 0 (queries 0–7)" in message
    assert "K/V tile 2 (keys 12–17), which that Q tile does not see" in message
    assert "`s = (qi @ np.swapaxes(kj, -1, -2)) * scale`" in message


def test_whole_array_cast_of_k_is_reported_as_loading_hidden_tiles():
    answer = learner_answer(LEARNER_FA2, FA2_WRONG[-2][1], "cast")
    with pytest.raises(ExerciseFailed) as info:
        ch04.check_flash_forward(answer)
    message = str(info.value)
    assert "which no query sees" in message and "uses the whole of k" in message
    assert "`k, v = k.astype(np.float64), v.astype(np.float64)`" in message


# ---- what counts as a load -------------------------------------------------------------------

def watched(shape=(2, 10, 3)):
    log, (x,) = ch04._watch({"q": np.arange(float(np.prod(shape))).reshape(shape)})
    return log, x


def loads(log):
    return int(log.counts["q"].sum())


@pytest.mark.parametrize("read,elements", [
    (lambda x: tiled.load_tile(x, 8, 4), 2 * 2 * 3),      # two real rows of each of 2 heads
    (lambda x: x.astype(np.float32), 60),
    (lambda x: x.copy(), 60),
    (lambda x: np.copy(x), 60),
    (lambda x: np.array(x), 60),
    (lambda x: np.asarray(x), 60),
    (lambda x: np.ascontiguousarray(x), 60),
    (lambda x: x * 0.5, 60),
    (lambda x: x[..., 0:5, :].copy(), 30),
    (lambda x: np.array(x[..., 0:5, :]), 30),
    (lambda x: x[..., [0, 3], :], 12),
    (lambda x: x[..., 2:4, :] @ np.ones((3, 1)), 12),
    (lambda x: np.swapaxes(x, -1, -2)[..., :, 0:5].sum(), 30),
    (lambda x: x.max(), 60),
    (lambda x: float(x[0, 0, 0]), 1),
])
def test_reads_count_exactly_the_elements_they_copy(read, elements):
    log, x = watched()
    read(x)
    assert loads(log) == elements


@pytest.mark.parametrize("free", [
    lambda x: (x.shape, x.dtype, x.ndim, x.size, len(x)),
    lambda x: x[..., 0].shape,
    lambda x: (np.empty_like(x), np.zeros_like(x), np.ones_like(x), np.full_like(x, 2.0)),
    lambda x: np.zeros_like(x[..., 0:5, :]),
    lambda x: (x.T, np.swapaxes(x, -1, -2), x.reshape(-1, 3), x[None]),
    lambda x: (np.shape(x), np.ndim(x), np.result_type(x, np.float32)),
    lambda x: isinstance(x, np.ndarray) or 1 / 0,
])
def test_metadata_and_views_load_nothing(free):
    log, x = watched()
    free(x)
    assert loads(log) == 0


def test_a_used_slice_holds_its_values_and_a_copy_is_not_reloaded():
    log, x = watched()
    tile = x[..., 0:5, :]
    tile * 2.0
    tile.sum()                       # the same slice again: held, no new load
    assert loads(log) == 30
    x[..., 0:5, :].sum()             # a new slice of the same rows loads them again
    assert loads(log) == 60
    y = x * 3.0                      # a whole pass over x ...
    tiled.load_tile(y, 0, 4)         # ... and tiles of the learner's copy: not loads of x
    assert loads(log) == 120
    assert [t.kind for t in log.touches][-1] == "copy"


# ---- learner-written wrong answers for exercises 4.1 and 4.2 ---------------------------------

# Exercise 4.1: the notebook's loop with a learner's inner part (steps 1-4 and the epilogue)
LEARNER_41 = '''\
def flash_forward(q, k, v, causal=False, scale=None, block_m=32, block_n=16):
    n_q, n_k, d = q.shape[-2], k.shape[-2], q.shape[-1]
    scale = 1.0 / np.sqrt(d) if scale is None else scale
    lead = q.shape[:-2]
    o = np.empty(lead + (n_q, v.shape[-1]), dtype=q.dtype)
    lse = np.empty(lead + (n_q,), dtype=q.dtype)
    for i in range(iomodel.num_blocks(n_q, block_m)):
        q_start, rows = i * block_m, iomodel.block_rows(i, n_q, block_m)
        q_tile = tiled.load_tile(q, q_start, block_m)
        q_idx = q_start + np.arange(block_m)[:, None]
        m_i = np.full(lead + (block_m,), -np.inf)
        l_i = np.zeros(lead + (block_m,))
        acc = np.zeros(lead + (block_m, v.shape[-1]))
        for j in range(iomodel.num_blocks(n_k, block_n)):
            k_start = j * block_n
            k_tile = tiled.load_tile(k, k_start, block_n)
            v_tile = tiled.load_tile(v, k_start, block_n)
            k_idx = k_start + np.arange(block_n)[None, :]
            s = np.einsum("...id,...jd->...ij", q_tile, k_tile) * scale
            keep = k_idx < n_k
            if causal:
                keep = keep & (k_idx <= q_idx)
            s[..., ~np.broadcast_to(keep, s.shape[-2:])] = -np.inf
            m_new = np.maximum(m_i, np.max(s, axis=-1))
            alpha = np.exp(m_i - m_new)
            p = np.exp(s - m_new[..., None])
            l_i = l_i * alpha + np.sum(p, axis=-1)
            acc = acc * alpha[..., None] + p @ v_tile
            m_i = m_new
        o_tile = acc / l_i[..., None]
        lse_tile = m_i + np.log(l_i)
        o[..., q_start:q_start + rows, :] = o_tile[..., :rows, :]
        lse[..., q_start:q_start + rows] = lse_tile[..., :rows]
    return o, lse
'''

FA41_WRONG = [
    ("padding not masked", [("keep = k_idx < n_k", "keep = np.ones_like(k_idx, dtype=bool)")],
     cause("padded key columns")),
    ("mask sees the next key", [("k_idx <= q_idx", "k_idx <= q_idx + 1")], cause("off by one")),
    ("acc not rescaled", [("acc = acc * alpha[..., None] + p @ v_tile", "acc = acc + p @ v_tile")],
     cause("accumulator (O) is not rescaled")),
    ("l not rescaled", [("l_i = l_i * alpha + np.sum(p, axis=-1)", "l_i = l_i + np.sum(p, axis=-1)")],
     cause("running sum l is not rescaled")),
    ("no division", [("o_tile = acc / l_i[..., None]", "o_tile = acc")], cause("final division")),
    ("lse without the max", [("lse_tile = m_i + np.log(l_i)", "lse_tile = np.log(l_i)")],
     cause("lse is log(l)")),
    ("scale ignored", [(") * scale\n", ") / np.sqrt(d)\n")], cause("always scaled by 1/sqrt(d)")),
    ("no max subtracted", [("p = np.exp(s - m_new[..., None])", "p = np.exp(s)"),
                           ("alpha = np.exp(m_i - m_new)", "alpha = np.ones_like(m_i)"),
                           ("lse_tile = m_i + np.log(l_i)", "lse_tile = np.log(l_i)")], NO_CAUSE),
    ("mask hides the diagonal", [("k_idx <= q_idx", "k_idx < q_idx")], ch04._DIAGONAL_HIDDEN),
    ("log2 for lse", [("np.log(l_i)", "np.log2(l_i)")], NO_CAUSE),
]


@pytest.mark.parametrize("label,edits,expect", FA41_WRONG, ids=[w[0] for w in FA41_WRONG])
def test_learner_41_mistakes_rejected_with_the_right_cause_or_none(label, edits, expect):
    with pytest.raises(ExerciseFailed) as info:
        ch04.check_fa2_forward(learner_answer(LEARNER_41, edits, label))
    message = str(info.value)
    named = [line for line in message.split("\n")
             if line.startswith("  likely cause:") or line.startswith("  - ")]
    assert named == ([] if expect is NO_CAUSE else [f"  likely cause: {expect}"]), message


def test_learner_41_right_answer_passes(capsys):
    answer = learner_answer(LEARNER_41, [], "4.1")
    assert ch04.check_fa2_forward(answer) is answer


SKIP_41_WRONG = [  # exercise 4.2, written as a learner would: (answer, cause or NO_CAUSE)
    (lambda n_q, n_k, bm, bn: iomodel.causal_skip_grid(n_q, n_k, bm, bn).T.copy()
     if n_q == n_k and bm == bn else np.zeros((-(-n_q // bm), -(-n_k // bn)), bool), NO_CAUSE),
    (lambda n_q, n_k, bm, bn: np.array([[j * bn > (i + 1) * bm - 1 for j in range(-(-n_k // bn))]
                                        for i in range(-(-n_q // bm))]),
     next(c for c in ch04.SKIP_MISTAKES if "ragged last Q tile" in c)),
    (lambda n_q, n_k, bm, bn: np.array([[j > i for j in range(-(-n_k // bn))]
                                        for i in range(-(-n_q // bm))]),
     next(c for c in ch04.SKIP_MISTAKES if "tile indices" in c)),
    (lambda n_q, n_k, bm, bn: np.array([[(j + 1) * bn - 1 > min((i + 1) * bm, n_q) - 1
                                         for j in range(-(-n_k // bn))]
                                        for i in range(-(-n_q // bm))]), NO_CAUSE),
    (lambda n_q, n_k, bm, bn: np.array([[j * bn >= min((i + 1) * bm, n_q) - 1
                                         for j in range(-(-n_k // bn))]
                                        for i in range(-(-n_q // bm))]),
     next(c for c in ch04.SKIP_MISTAKES if "off by one" in c)),
]


@pytest.mark.parametrize("answer,expect", SKIP_41_WRONG)
def test_learner_42_mistakes_rejected_with_the_right_cause_or_none(answer, expect):
    with pytest.raises(ExerciseFailed) as info:
        ch04.check_causal_skip_grid(answer)
    named = [line for line in str(info.value).split("\n") if line.startswith("  likely cause:")]
    assert named == ([] if expect is NO_CAUSE else [f"  likely cause: {expect}"]), str(info.value)


def _forward_m_from_zero(q, k, v, causal=False, scale=None, block_m=16, block_n=16):
    """FA2 as a learner writes it, right but for the running max, which starts at 0."""
    scale = 1 / np.sqrt(q.shape[-1]) if scale is None else scale
    n_q, n_k = q.shape[-2], k.shape[-2]
    o = np.zeros(q.shape[:-1] + (v.shape[-1],), q.dtype)
    lse = np.zeros(q.shape[:-1], q.dtype)
    for q0 in range(0, n_q, block_m):
        q1 = min(q0 + block_m, n_q)
        q_i = q[..., q0:q1, :]
        m = np.zeros(q_i.shape[:-1])  # should be -inf
        l, acc = np.zeros(q_i.shape[:-1]), np.zeros(q_i.shape[:-1] + (v.shape[-1],))
        for k0 in range(0, n_k, block_n):
            if causal and k0 > q1 - 1:
                break
            k1 = min(k0 + block_n, n_k)
            s = scale * q_i @ np.swapaxes(k[..., k0:k1, :], -1, -2)
            if causal:
                s = np.where(np.arange(k0, k1)[None, :] <= np.arange(q0, q1)[:, None], s, -np.inf)
            m_new = np.maximum(m, s.max(-1))
            p, alpha = np.exp(s - m_new[..., None]), np.exp(m - m_new)
            l, acc, m = l * alpha + p.sum(-1), acc * alpha[..., None] + p @ v[..., k0:k1, :], m_new
        o[..., q0:q1, :], lse[..., q0:q1] = acc / l[..., None], m + np.log(l)
    return o, lse


def test_a_row_whose_visible_scores_are_all_below_minus_750_catches_a_max_started_at_0():
    """Issue 32: no case had such a row, so a running max started at 0 (exp(s - 0) underflows
    to 0 for every key, l = 0, 0/0) passed exercise 4.4."""
    cases = ch04._whole_cases()
    assert sum("visible scores all below -750" in c.label for c in cases) == 1
    message = assert_rejected(ch04.check_flash_forward, _forward_m_from_zero, None)
    assert "visible scores all below -750" in message and "first bad query row: 5" in message
    assert "underflowed to 0" in message and "a fully masked row?" not in message, message

"""Chapter 12 checks: right answers pass (also in other styles), a stub is "not done yet" and hands
back the library's version, every modelled mistake is named on its own output, wrong answers
written as a learner writes them are rejected with the right cause; and the model bench's
recorded-results reader, its training helpers and its tool."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import course_lib
from corpus_checks import assert_cause, assert_rejected, one
from course_lib.teaching import checks
from course_lib.measure import model_bench
from course_lib.integrations import tinylm
from course_lib.teaching.checks import ExerciseFailed
from course_lib.teaching.exercises import ch12
from course_lib.kernels import teaching

pytestmark = pytest.mark.ch12

ROOT = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------------------------
# Exercise 12.1: the adapter


def _stub(*args, **kwargs):
    raise NotImplementedError("Exercise 12.1")


def test_library_adapter_passes_and_stub_falls_back(capsys):
    library = ch12.library_adapter()
    assert ch12.check_adapter(library) is library
    assert ch12.check_adapter(_stub) is library
    out = capsys.readouterr().out
    assert "✓ Exercise 12.1: passed (6 cases; the padded batch was refused by name" in out
    assert "not done yet" in out


def _refusing(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The notebook's answer: the library kernel, GQA by shape, padding refused."""
    if attention_mask is not None:
        raise ValueError("no attention_mask: padded batches are not supported")
    out = course_lib.flash_attention(query, key, value, causal=query.shape[2] > 1, scale=scaling)
    return out.transpose(1, 2), None


def _sdpa_with_mask(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Right in another style: SDPA with enable_gqa, the padding mask honoured, permute."""
    n_q, n_k = query.shape[2], key.shape[2]
    visible = torch.ones(n_q, n_k, dtype=torch.bool, device=query.device).tril(n_k - n_q)
    if attention_mask is not None:
        visible = visible & attention_mask
        visible = visible | ~visible.any(-1, keepdim=True)  # rows of padding: anything finite
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=visible, scale=scaling,
                                         enable_gqa=True)
    return out.permute(0, 2, 1, 3), None


def _repeat_kv_style(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                     **kwargs):
    """Right in transformers' own style: repeat_kv by expand + reshape, NotImplementedError."""
    if attention_mask is not None:
        raise NotImplementedError("padding")
    b, h_kv, n, d = key.shape
    group = module.num_key_value_groups
    key, value = (x[:, :, None].expand(b, h_kv, group, n, d).reshape(b, h_kv * group, n, d)
                  for x in (key, value))
    causal = query.shape[2] == key.shape[2]
    out = course_lib.flash_attention(query, key, value, causal=causal,
                                     scale=scaling if scaling is not None else d ** -0.5)
    return out.transpose(1, 2).contiguous(), None


@pytest.mark.parametrize("answer", [_refusing, _sdpa_with_mask, _repeat_kv_style])
def test_right_adapters_in_other_styles_pass(answer, capsys):
    assert ch12.check_adapter(answer) is answer
    out = capsys.readouterr().out
    assert "✓ Exercise 12.1: passed (6 cases" in out
    if answer is _sdpa_with_mask:
        assert "computed right (the mask was honoured)" in out
    else:
        assert "refused by name" in out


@pytest.mark.parametrize("cause", list(ch12.ADAPTER_MISTAKES))
def test_each_adapter_mistake_is_named_on_its_own_output(cause):
    model = ch12.ADAPTER_MISTAKES[cause]
    with pytest.raises(ExerciseFailed) as info:
        ch12.check_adapter(lambda *args, **kwargs: model(*args, **kwargs))
    assert_cause(str(info.value), ch12.ADAPTER_MISTAKES, cause)


def test_an_ignored_mask_is_named():
    model = ch12._adapter_model(use_mask=False)
    message = assert_rejected(ch12.check_adapter, lambda *a, **k: model(*a, **k), ch12.MASK_IGNORED)
    assert "padded batch" in message


def _library_with(*, causal=None, reshape=False, tile=False, scale=True, pair=True):
    """The library kernel as a learner calls it, with one slip each."""
    def adapter(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        if tile:
            group = query.shape[1] // key.shape[1]
            key, value = (x.repeat(1, group, 1, 1) for x in (key, value))
        is_causal = query.shape[2] > 1 if causal is None else causal
        o = course_lib.flash_attention(query, key, value, causal=is_causal,
                                       scale=scaling if scale else None)  # (B, H, N, d)
        b, h, n, d = o.shape
        out = o.reshape(b, n, h, d) if reshape else o.transpose(1, 2)
        return (out, None) if pair else out
    return adapter


def _adapter_corpus():
    c = ch12.ADAPTER_MISTAKES
    return [
        (_library_with(causal=True), one(c, "the causal mask is aligned to the top-left")),
        (_library_with(causal=False), one(c, "the attention is not causal")),
        (_library_with(reshape=True), one(c, "the output is reshaped")),
        (_library_with(tile=True), one(c, "the K/V heads are repeated in the wrong order")),
        (_library_with(scale=False), one(c, "`scaling` is ignored")),
        (_library_with(pair=False), one(c, "the adapter returns the output alone")),
    ]


@pytest.mark.parametrize("i", range(len(_adapter_corpus())))
def test_wrong_adapters_are_rejected_with_their_cause(i):
    answer, cause = _adapter_corpus()[i]
    message = assert_rejected(ch12.check_adapter, answer, cause)
    assert message.startswith("✗ Exercise 12.1"), message
    assert_cause(message, ch12.ADAPTER_MISTAKES, cause)


def test_an_adapter_that_crashes_on_the_padded_batch_is_not_a_refusal():
    """A TypeError from a bug is not a refusal by name: the check reports the crash."""
    def crashes_on_masks(module, query, key, value, attention_mask, scaling=None, **kwargs):
        if attention_mask is not None:
            attention_mask.reshape(-1, 7)  # a shape bug
        return _refusing(module, query, key, value, None, scaling)
    with pytest.raises(ExerciseFailed, match="raised"):
        ch12.check_adapter(crashes_on_masks)


class PaddingNotSupported(ValueError):
    """A learner's own refusal: a subclass of ValueError."""


def _refusing_with_own_error(module, query, key, value, attention_mask, scaling=None, **kwargs):
    if attention_mask is not None:
        raise PaddingNotSupported("left padding is not supported")
    return _refusing(module, query, key, value, None, scaling)


def test_the_adapter_runs_through_a_library_function_that_returns_data():
    """What the grader sends by name to the notebook's process (``ch12.run_adapter``): the module
    rebuilt from its sizes, the adapter called as transformers calls it, and only data back, which
    the channel carries strictly. A refusal by name comes back as text only where the check allows
    one (the padded batch); elsewhere it is raised, as the learner's adapter raised it."""
    from course_lib.teaching import grade_channel

    seen = {}

    def spy(module, query, key, value, attention_mask, **kwargs):
        seen.update(groups=module.num_key_value_groups, d=module.head_dim, scaling=module.scaling,
                    kwargs=sorted(kwargs))
        return _refusing(module, query, key, value, attention_mask, kwargs.get("scaling"))

    q, k, v = ch12._qkv(torch.Generator().manual_seed(0), 1, 4, 2, 5, 5, 16, torch.float32, True)
    reply = ch12.run_adapter(spy, (4, 2, 16), False, (q, k, v, None), {"scaling": 0.3})
    assert seen == {"groups": 2, "d": 16, "scaling": 16 ** -0.5, "kwargs": ["scaling"]}
    out, weights = reply["result"]
    assert out.shape == (1, 5, 4, 16) and weights is None
    assert grade_channel.decode(grade_channel.encode(reply))["result"][0].equal(out)
    mask = ch12._left_padding_mask([5], 5, "cpu")
    assert ch12.run_adapter(_refusing_with_own_error, (4, 2, 16), True, (q, k, v, mask), {}) == {
        "refused": "PaddingNotSupported: left padding is not supported"}
    with pytest.raises(PaddingNotSupported):
        ch12.run_adapter(_refusing_with_own_error, (4, 2, 16), False, (q, k, v, mask), {})


def test_a_refusal_of_the_learners_own_class_is_a_refusal(capsys):
    """Caught where the adapter runs: in the grader a learner's exception class only crosses by
    name (not as a ValueError), so the check asks there whether it was a refusal."""
    assert ch12.check_adapter(_refusing_with_own_error) is _refusing_with_own_error
    assert "refused by name (PaddingNotSupported: left padding is not supported)" in \
        capsys.readouterr().out


def test_left_padding_mask_hides_the_padding_and_the_future():
    mask = ch12._left_padding_mask([3, 2], 3, "cpu")  # (B, 1, N, N)
    assert mask.shape == (2, 1, 3, 3)
    assert mask[0, 0].tolist() == [[True, False, False], [True, True, False], [True, True, True]]
    assert mask[1, 0].tolist() == [[False, False, False], [False, True, False], [False, True, True]]
    assert ch12._real_rows(mask, 2, 3, "cpu").tolist() == [[True] * 3, [False, True, True]]


# ----------------------------------------------------------------------------------------------
# Exercise 12.2: a kernel as a custom op

OP_NAME = "ch12_tests::attention"


def _fake_right(q, k, v, causal, scale):
    return q.new_empty(q.shape), q.new_empty(q.shape[:-1], dtype=torch.float32)


FAKES = {
    "empty_like": lambda q, k, v, c, s: (torch.empty_like(q),
                                         q.new_empty(q.shape[:-1], dtype=torch.float32)),
    "lse_dtype": lambda q, k, v, c, s: (q.new_empty(q.shape), q.new_empty(q.shape[:-1])),
    "k_shape": lambda q, k, v, c, s: (k.new_empty(k.shape),
                                      q.new_empty(q.shape[:-1], dtype=torch.float32)),
    "lse_shape": lambda q, k, v, c, s: (q.new_empty(q.shape),
                                        q.new_empty(q.shape, dtype=torch.float32)),
    "alias": lambda q, k, v, c, s: (q, q.new_empty(q.shape[:-1], dtype=torch.float32)),
    "runs_kernel": lambda q, k, v, c, s: teaching.forward(q, k, v, c, s),
}


def _factory(fake=_fake_right, mutate=False, plain=False, outputs="pair"):
    """make_attention_op as a learner writes it, with one slip switched on."""
    def make_attention_op():
        def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                      scale: float) -> tuple[torch.Tensor, torch.Tensor]:
            if mutate:  # pre-scaling q in place "to save memory"
                q.mul_(scale)
                scale = 1.0
            o, lse = teaching.forward(q, k, v, causal, scale)
            return (lse, o) if outputs == "swapped" else (o, lse)

        def o_only(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                   scale: float) -> torch.Tensor:
            return teaching.forward(q, k, v, causal, scale)[0]

        body = o_only if outputs == "o" else attention
        if plain:
            return body
        op = torch.library.custom_op(OP_NAME, mutates_args=())(body)
        if fake is not None:
            op.register_fake((lambda q, k, v, c, s: fake(q, k, v, c, s)[0]) if outputs == "o"
                             else (lambda q, k, v, c, s: fake(q, k, v, c, s)[::-1]) if
                             outputs == "swapped" else fake)
        return op
    return make_attention_op


def _schema_style():
    """Right in another style: an explicit schema string, a fake registered by the op's name."""
    def make_attention_op():
        op = torch.library.custom_op(
            OP_NAME, lambda q, k, v, causal, scale: teaching.forward(q, k, v, causal, scale),
            mutates_args=(), schema="(Tensor q, Tensor k, Tensor v, bool causal, float scale) -> "
                                    "(Tensor, Tensor)")
        torch.library.register_fake(OP_NAME, lambda q, k, v, causal, scale: (
            torch.empty(q.shape, dtype=q.dtype, device=q.device),
            torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)))
        return op
    return make_attention_op


def _stub_factory():
    raise NotImplementedError("Exercise 12.2")


def test_stub_factory_falls_back_to_the_library(capsys):
    assert ch12.check_custom_op(_stub_factory) is ch12.library_attention_op
    assert "Exercise 12.2: not done yet" in capsys.readouterr().out


@pytest.mark.parametrize("factory", [_factory(), _schema_style()], ids=["decorators", "schema"])
def test_right_ops_pass_with_one_graph(factory, capsys):
    assert ch12.check_custom_op(factory) is factory
    out = capsys.readouterr().out
    assert "✓ Exercise 12.2: passed (3 cases" in out and "1 graph, 0 graph breaks" in out, out


def test_the_library_op_is_right():
    op = ch12.library_attention_op()
    report = ch12.opcheck_report(op, tuple(ch12._op_cases()[1].args))
    assert set(report.values()) == {"SUCCESS"}, report
    for case in ch12._op_cases():  # each within its dtype's tolerance, as the check compares
        got, want = op(*case.args), ch12.attention_op_reference(*case.args)
        assert checks.compare(got, want, *checks.TOLERANCES[_name(want[0].dtype)]) is None, case


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def test_op_cases_on_a_gpu_are_float16_and_bfloat16(monkeypatch):
    """On a GPU float32 products run in TF32, so the cases there are the fast dtypes (emulated
    here: the runtime seen as a GPU's, the tensors still on this machine)."""
    assert [c.args[0].dtype for c in ch12._op_cases()] == (
        [torch.float32, torch.float32, torch.float16] if ch12._rt.interpreted else
        [torch.float16, torch.float16, torch.bfloat16])
    monkeypatch.setattr(ch12, "_rt", SimpleNamespace(interpreted=False, device=torch.device("cpu")))
    cases = ch12._op_cases()
    assert [c.args[0].dtype for c in cases] == [torch.float16, torch.float16, torch.bfloat16]
    assert [c.label.split(", ")[-1] for c in cases] == ["float16", "float16",
                                                          "bfloat16 (lse stays float32)"]
    assert ch12.fp32_op_tolerance() == checks.TOLERANCES["float16"]


def test_the_check_in_the_gpus_dtypes_passes_right_ops_and_names_mistakes(monkeypatch):
    """The GPU's cases emulated in the interpreter: float16 (bfloat16 is wrong in the
    interpreter) for every case, each compared with float16's tolerance."""
    monkeypatch.setattr(ch12, "_op_dtypes", lambda: (torch.float16, torch.float16))
    factory = _factory()
    assert ch12.check_custom_op(factory) is factory
    cause = one(ch12.OP_OUTPUT_MISTAKES, "the outputs are swapped")
    assert_cause(assert_rejected(ch12.check_custom_op, _factory(outputs="swapped"), cause),
                 ch12.OP_OUTPUT_MISTAKES, cause)
    message = assert_rejected(ch12.check_custom_op, _factory(fake=FAKES["lse_dtype"]), None)
    assert "the fake's lse (output 1) has dtype torch.float16" in message, message


def _tf32(x: torch.Tensor) -> torch.Tensor:
    """float32 ``x`` cut to TF32's 10 mantissa bits (truncated: the larger error of the two
    roundings), as a GPU's tensor cores read float32 operands of ``tl.dot`` by default."""
    return (x.float().view(torch.int32) & ~0x1FFF).view(torch.float32)


def _attention_with_tf32_pv(q, k, v, causal: bool, scale: float) -> torch.Tensor:
    """Chapter 06's forward as a GPU computes it on float32 inputs: exact scores and softmax,
    the product P·V of TF32 operands (summed exactly). q, k, v ``(B, H, N, d)`` -> o like q."""
    s = (q.double() @ k.double().transpose(-1, -2)) * scale  # (B, H, N_q, N_k)
    if causal:
        s = s.masked_fill(~ch12.causal_visible(q.shape[-2], k.shape[-2], 0), float("-inf"))
    p = torch.exp(s - s.amax(-1, keepdim=True)).float()  # unnormalised, as the kernel keeps it
    return ((_tf32(p).double() @ _tf32(v).double()) / p.double().sum(-1, keepdim=True)).float()


def test_tf32_products_need_the_gpus_tolerance_and_mistakes_still_fail_it():
    """What failed on the H100 (o off by ~2e-3 in float32), emulated on the CPU: TF32's error is
    outside float32's tolerance, inside fp32_op_tolerance's GPU choice (float16's), and the
    classic mistakes (not causal, the scale applied twice) stay far outside it."""
    gen = torch.Generator().manual_seed(12)
    q, k, v = (torch.randn(1, 2, 40, 16, generator=gen) for _ in range(3))
    want = ch12.attention_op_reference(q, k, v, True, 0.25)[0]
    got = _attention_with_tf32_pv(q, k, v, True, 0.25)
    assert checks.compare(got, want, *checks.TOLERANCES["float32"]) is not None
    assert checks.compare(got, want, *checks.TOLERANCES["float16"]) is None
    for causal, scale in ((False, 0.25), (True, 0.25 * 0.25)):
        wrong = _attention_with_tf32_pv(q, k, v, causal, scale)
        assert checks.compare(wrong, want, *checks.TOLERANCES["float16"]) is not None


@pytest.mark.gpu
def test_on_a_gpu_the_check_runs_float16_and_bfloat16_and_passes_the_right_op(capsys):
    assert [c.args[0].dtype for c in ch12._op_cases()] == [torch.float16, torch.float16,
                                                            torch.bfloat16]
    factory = _factory()
    assert ch12.check_custom_op(factory) is factory
    assert "✓ Exercise 12.2: passed (3 cases" in capsys.readouterr().out


def test_the_fp32_op_is_within_the_modes_tolerance():
    """What the notebook compares with SDPA on float32 inputs holds in this mode (exact in the
    interpreter, TF32's P·V on a GPU)."""
    gen = torch.Generator().manual_seed(12)
    q, k, v = (torch.randn(1, 2, 40, 16, generator=gen).to(ch12._rt.device) for _ in range(3))
    o, _ = ch12.library_attention_op()(q, k, v, True, 0.25)
    want = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True,
                                          scale=0.25).float()
    assert checks.compare(o, want, *ch12.fp32_op_tolerance()) is None


OPCHECK_EXPECTED = [
    (dict(fake=None), "no fake implementation registered"),
    (dict(fake=FAKES["empty_like"]), "has strides"),
    (dict(fake=FAKES["lse_dtype"]), "the fake's lse (output 1) has dtype torch.float16"),
    (dict(fake=FAKES["k_shape"]), "the fake's o (output 0) has shape torch.Size([2, 2, 33, 32])"),
    (dict(fake=FAKES["lse_shape"]), "the fake's lse (output 1) has shape"),
    (dict(fake=FAKES["alias"]), "the fake returns an input"),
    (dict(fake=FAKES["runs_kernel"]), "the fake runs the kernel"),
    (dict(mutate=True), "the op changed an input in place (`q`)"),
]


@pytest.mark.parametrize("slip, words", OPCHECK_EXPECTED,
                         ids=[w.split(":")[0][:30] for _, w in OPCHECK_EXPECTED])
def test_each_op_mistake_is_named_from_opcheck(slip, words):
    with pytest.raises(ExerciseFailed) as info:
        ch12.check_custom_op(_factory(**slip))
    message = str(info.value)
    assert message.startswith("✗ Exercise 12.2: torch.library.opcheck fails on case"), message
    assert words in message, message
    assert "Traceback" not in message and "scroll up" not in message


def test_a_plain_function_is_not_an_op():
    message = assert_rejected(ch12.check_custom_op, _factory(plain=True), None)
    assert "not a torch.library custom op" in message and "custom_op(" in message


@pytest.mark.parametrize("outputs, start", [("o", "the op returns o only"),
                                            ("swapped", "the outputs are swapped")])
def test_wrong_outputs_are_named(outputs, start):
    cause = one(ch12.OP_OUTPUT_MISTAKES, start)
    message = assert_rejected(ch12.check_custom_op, _factory(outputs=outputs), cause)
    assert_cause(message, ch12.OP_OUTPUT_MISTAKES, cause)


def test_missing_annotations_are_a_crash_with_the_learners_line():
    def make_attention_op():
        @torch.library.custom_op(OP_NAME, mutates_args=())
        def attention(q, k, v, causal, scale):
            return teaching.forward(q, k, v, causal, scale)
        return attention
    with pytest.raises(ExerciseFailed, match="annotation"):
        ch12.check_custom_op(make_attention_op)


def test_the_op_is_probed_through_library_functions_that_return_data():
    """What the grader sends by name to the notebook's process for 12.2, each making the op anew:
    what the factory returns (``op_kind``), what opcheck finds (``opcheck_problem``: None, or the
    message the diagnosis reads), the graph count and outputs of the compiled block
    (``compile_probe``) — all data, which the channel carries strictly."""
    from course_lib.teaching import grade_channel

    right, empty_like = _factory(), _factory(fake=FAKES["empty_like"])
    assert ch12.op_kind(right) == {"custom_op": True, "library": False, "type": "CustomOpDef",
                                   "name": "CustomOpDef"}
    assert ch12.op_kind(_factory(plain=True)) == {"custom_op": False, "library": False,
                                                  "type": "function", "name": "attention"}
    assert ch12.op_kind(ch12.library_attention_op)["library"] is True
    args = ch12._op_cases()[1].args  # q a transposed view
    assert ch12.opcheck_problem(right, *args) is None
    problem = ch12.opcheck_problem(empty_like, *args)
    assert "the fake's o (output 0) has strides" in ch12.opcheck_diagnosis(problem), problem
    q, k, v, _, scale = ch12._op_cases()[0].args
    found = ch12.compile_probe(right, q, k, v, scale)
    assert (found["graphs"], found["breaks"], found["reasons"]) == (1, 0, [])
    atol, rtol = checks._default_tolerance(found["eager"])
    assert torch.allclose(found["compiled"], found["eager"], atol=atol, rtol=rtol)
    for reply in (ch12.op_kind(right), problem, found):
        grade_channel.encode(reply)  # strict: raises on anything that is not data


@pytest.mark.parametrize("forged, words", [
    ("passed", "answered a probe of your op with str data, not the fields graphs, breaks"),
    (lambda found: {**found, "compiled": found["compiled"][..., :1]}, "the compiled block gives a "
                                                                      "Tensor(1, 2, 40, 1)"),
], ids=["not-a-dict", "shape"])
def test_a_probe_reply_that_is_not_what_the_probe_returns_fails(monkeypatch, forged, words):
    """In the grader the probes' replies come from the notebook's process, whose copy of the
    library the learner may patch: a reply without the probe's fields, or with outputs of another
    shape, is a failure with a message, never a pass or a crash of the check."""
    probe = ch12.compile_probe
    monkeypatch.setattr(ch12, "compile_probe", lambda *args: forged(probe(*args))
                        if callable(forged) else forged)
    message = assert_rejected(ch12.check_custom_op, _factory(), None)
    assert message.startswith("✗ Exercise 12.2") and words in message, message


def test_an_unknown_opcheck_failure_is_quoted_not_guessed():
    assert ch12.opcheck_diagnosis("opcheck(op, ...): test_x failed with something new\nmore") == \
        "torch.library.opcheck failed: opcheck(op, ...): test_x failed with something new"


def test_graph_report_counts_a_break():
    def broken(x):
        y = x * 2
        torch._dynamo.graph_break()
        return y + 1
    graphs, breaks, reasons = ch12.graph_report(broken, torch.ones(3))
    assert (graphs, breaks) == (2, 1) and reasons


# ----------------------------------------------------------------------------------------------
# The model bench


def test_training_text_is_the_course_text_and_the_zen(capsys):
    text = model_bench.training_text()
    assert text.startswith(tinylm.TEXT) and "Beautiful is better than ugly." in text
    assert capsys.readouterr().out == ""  # importing `this` prints the Zen: swallowed


def test_llama_config_and_its_errors():
    config = model_bench.llama_config(50, model_bench.CPU_SIZE)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (4, 2, 16)
    assert config.attention_dropout == 0.0
    bad = model_bench.LlamaSize(layers=1, hidden=48, heads=3, kv_heads=2, head_dim=16, context=8,
                                batch=1, steps=1)
    with pytest.raises(ValueError, match="heads .3. must be a multiple of kv_heads .2."):
        model_bench.llama_config(50, bad)


def test_generate_refuses_more_than_the_context():
    data = tinylm.CharDataset(model_bench.training_text())
    size = model_bench.CPU_SIZE
    model = model_bench.build_llama(model_bench.llama_config(data.vocab_size, size), "sdpa")
    with pytest.raises(ValueError, match="exceed the model's context of 32 positions"):
        model_bench.generate_text(model, data, "Attention ", size.context)
    text = model_bench.generate_text(model, data, "Attention ", 4)
    assert text.startswith("Attention ") and len(text) == len("Attention ") + 4


def test_training_with_sdpa_lowers_the_loss():
    data = tinylm.CharDataset(model_bench.training_text())
    size = model_bench.LlamaSize(**{**model_bench.size_dict(model_bench.CPU_SIZE), "steps": 8})
    model = model_bench.build_llama(model_bench.llama_config(data.vocab_size, size), "sdpa")
    losses = model_bench.train(model, data, size, seed=0, compile=False)
    assert len(losses) == 8 and losses[-1] < losses[0]


def test_measure_training_refuses_a_cpu_model():
    data = tinylm.CharDataset(model_bench.training_text())
    model = model_bench.build_llama(model_bench.llama_config(data.vocab_size,
                                                             model_bench.CPU_SIZE), "sdpa",
                                    device="cpu")
    with pytest.raises(ValueError, match="times GPU training steps; the model is on cpu"):
        model_bench.measure_training(model, 8, 1, 1, 0, compile=False)


def _synthetic(**meta_overrides):
    """A made-up file in the recorded format (not a measurement): the reader's test input."""
    meta = {"gpu": "test GPU", "torch": "0", "triton": "0", "transformers": "0",
            "date": "2000-01-01", "model": "test model", "timer": "test timer", **meta_overrides}
    rows = [{"impl": "course_compiled", "context": 1024, "batch": 16, "oom": False,
             "tokens_per_s": 1000.0, "peak_mib": 2048.0},
            {"impl": "eager", "context": 1024, "batch": 16, "oom": False,
             "tokens_per_s": 500.0, "peak_mib": 4096.0},
            {"impl": "eager", "context": 2048, "batch": 8, "oom": True}]
    return {"meta": meta, "rows": rows}


def test_recorded_results_reader(tmp_path):
    assert model_bench.status(tmp_path / "absent.json") == model_bench.NOT_RECORDED
    path = tmp_path / "model.json"
    path.write_text(json.dumps(_synthetic()))
    data = model_bench.recorded(path)
    assert "test GPU" in model_bench.status(path) and "test timer" in model_bench.status(path)
    text = model_bench.table(data)
    assert "out of memory" in text and "1,000" in text and "2.0" in text
    assert "—" in text  # course_compiled was not run at 2048
    fig = model_bench.plot(data)
    assert len(fig.axes) == 2
    import matplotlib.pyplot as plt

    plt.close(fig)


@pytest.mark.parametrize("broken, words", [
    (lambda d: d["meta"].pop("transformers"), "lacks transformers"),
    (lambda d: d["rows"][0].update(impl="flash"), "must be one of"),
    (lambda d: d["rows"][0].pop("tokens_per_s"), "positive tokens_per_s"),
    (lambda d: d.update(rows=[]), "non-empty list"),
])
def test_a_malformed_recorded_file_is_refused(broken, words):
    data = _synthetic()
    broken(data)
    with pytest.raises(ValueError, match=words):
        model_bench.validate(data)


def test_a_recorded_file_if_present_is_valid():
    data = model_bench.recorded()
    if data is None:
        pytest.skip("no recorded chapter 12 results yet (tools/bench_model.py on a GPU writes them)")
    assert {row["impl"] for row in data["rows"]} <= set(model_bench.IMPLS)


def test_bench_tool_refuses_to_run_without_a_gpu():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the tool would run the whole benchmark")
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_model.py")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stdout == ""
    assert "this machine has none" in done.stderr


@pytest.mark.gpu
def test_measure_grid_on_a_gpu(tmp_path):
    """Every implementation trains a step at two short contexts; out of memory is a row."""
    size = model_bench.LlamaSize(layers=1, hidden=256, heads=4, kv_heads=2, head_dim=64,
                                 context=256, batch=1, steps=2)
    rows = model_bench.measure_grid((256, 512), size=size, tokens_per_step=1024, steps=2,
                                    warmup=1, log=lambda line: None)
    assert len(rows) == 2 * len(model_bench.IMPLS)
    assert all(not r["oom"] and r["tokens_per_s"] > 0 and r["peak_mib"] > 0 for r in rows)


def test_the_fake_probe_refuses_kernel_launches():
    """On a GPU a fake that launches the kernel on FakeTensors would hand it null pointers (an
    illegal memory access that ruins the session's CUDA context): while the probe runs, Triton's
    launch-enter hook (called before the launcher reads any pointer) refuses, and afterwards it
    is gone."""
    from triton import knobs

    with ch12._no_kernel_launches():
        with pytest.raises(ch12._LaunchedOnFakes):
            knobs.runtime.launch_enter_hook(None)
    knobs.runtime.launch_enter_hook(None)  # no refusal left behind
    assert "the fake runs the kernel" in ch12.opcheck_diagnosis(str(ch12._LaunchedOnFakes(
        "the fake launched a Triton kernel on FakeTensors (no data pointer)")))

"""Chapter 12 (your kernel in a real model): the checks of exercises 12.1 and 12.2.

* 12.1 the *adapter* Hugging Face transformers calls in every attention layer:
  ``attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs)
  -> (out, None)`` with ``query`` ``(B, H, N_q, d)``, ``key``/``value`` ``(B, H_kv, N_k, d)``
  (GQA: fewer K/V heads, not repeated), ``out`` ``(B, N_q, H, d)``, causal with the queries at the
  end of the keys (a prefill sees a triangle, one decoding step sees the whole cache). A padded
  batch (an ``attention_mask``) is handled or refused by name, never ignored. The check compares
  with ``torch.nn.functional.scaled_dot_product_attention`` on tiny tensors, as transformers hands
  them (views of ``(B, N, H, d)``).
* 12.2 chapter 06's teaching kernel as a ``torch.library`` custom op with a fake implementation:
  the learner writes ``make_attention_op()`` that defines the op and returns it. The check compares
  the op's ``(o, lse)`` with float64 attention (float32 and float16 cases in the interpreter,
  float16 and bfloat16 on a GPU, where float32 products run in TF32), then runs
  ``torch.library.opcheck`` (schema, fake tensors, autograd registration, AOT dispatch) and
  ``torch.compile(fullgraph=True)``, and turns what they find into one diagnosis: no fake, a fake
  of the wrong shape, dtype or strides, a fake that returns an input or runs the kernel, an input
  changed but not declared in ``mutates_args``.

The mistake models of 12.1 are SDPA with one slip switched on (:func:`_adapter_model`); 12.2's
diagnoses come from what ``opcheck`` reports (:data:`OPCHECK_CAUSES`), plus two models of the
op's outputs.

Both answers are code that runs only where it was defined, so the checks use them only through
library functions called with ``grade_channel.run_with`` — :func:`run_adapter`; :func:`op_outputs`,
:func:`op_kind`, :func:`opcheck_problem`, :func:`compile_probe` — which return data: in a check
cell that is a plain call; the grader sends them by name to the notebook's process and judges
what comes back in its own.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import re
import warnings
from typing import Any, Callable

import torch
import torch.nn.functional as F

from course_lib.teaching import checks, grade_channel
from course_lib.platform import runtime
from course_lib.teaching.checks import (Case, ExerciseFailed, _default_tolerance, check_function,
                                        describe_value, learner_check)
from course_lib.attention.reference import default_scale, naive_attention_torch

_rt = runtime.ensure_configured()  # interpreter or GPU: decided before any kernel is defined


# ----------------------------------------------------------------------------------------------
# Exercise 12.1: the transformers adapter


class AttentionModuleStandIn(torch.nn.Module):
    """What transformers passes as ``module``: the attention layer calling the adapter (only the
    attributes an adapter reads: ``num_key_value_groups``, ``head_dim``, ``scaling``,
    ``is_causal``, ``layer_idx``; and ``spec``, its arguments, which cross to the grader's
    notebook process as data)."""

    def __init__(self, heads: int, kv_heads: int, head_dim: int):
        super().__init__()
        # what rebuilds it in the notebook's process when the grader runs an adapter there
        self.spec = (heads, kv_heads, head_dim)
        self.num_key_value_groups = heads // kv_heads
        self.head_dim = head_dim
        self.scaling = default_scale(head_dim)
        self.is_causal = True
        self.layer_idx = 0

    def __repr__(self) -> str:  # short: it appears in a diagnosis' inputs line
        return f"<attention layer, {self.num_key_value_groups} q heads per kv head>"


def causal_visible(n_q: int, n_k: int, offset: int, device=None) -> torch.Tensor:
    """``(N_q, N_k)`` bool, True where query ``i`` sees key ``j``: ``j <= i + offset``. With
    ``offset = N_k − N_q`` the queries are the *last* positions (a KV cache: causal aligned to the
    bottom-right); ``offset = 0`` is SDPA's ``is_causal`` (top-left)."""
    i = torch.arange(n_q, device=device)[:, None]
    j = torch.arange(n_k, device=device)[None, :]
    return j <= i + offset


def _real_rows(attention_mask, batch: int, n_q: int, device) -> torch.Tensor:
    """``(B, N_q)`` bool: the query rows that are real tokens (not padding). A row is padding when
    it does not even see its own position (the diagonal of transformers' 4-D mask)."""
    if attention_mask is None:
        return torch.ones(batch, n_q, dtype=torch.bool, device=device)
    return attention_mask[:, 0, :, -n_q:].diagonal(dim1=-2, dim2=-1)


def _adapter_model(*, transpose="right", kv="interleave", scale_slip=None,
                   causal_offset="bottom_right", use_mask=True, pair=True) -> Callable:
    """The adapter computed by SDPA in float64, with at most one slip switched on (the defaults
    are right): the reference and the mistake models of exercise 12.1.

    transpose: "right" (``.transpose(1, 2)`` to (B, N, H, d)), "none" (left (B, H, N, d)),
    "reshape" (``.reshape(B, N, H, d)``: the memory reinterpreted). kv: "interleave" (query head h
    reads K/V head h // group, right) or "tile" (head h % H_kv: ``repeat`` for
    ``repeat_interleave``). scale_slip: None (right), "ignored" (always 1/√d), "squared" (applied
    twice). causal_offset: "bottom_right" (right: query i sees keys j <= i + N_k - N_q), "off"
    (no mask), "top_left" (j <= i: SDPA's ``is_causal`` even when N_q < N_k). use_mask: honour
    ``attention_mask`` (right) or ignore it. pair: return ``(out, None)`` (right) or ``out``.
    """
    def adapter(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        batch, heads, n_q, d = query.shape
        kv_heads, n_k = key.shape[1], key.shape[2]
        group = heads // kv_heads
        if kv == "interleave":
            k, v = (x.repeat_interleave(group, dim=1) for x in (key, value))  # (B, H, N_k, d)
        else:
            k, v = (x.repeat(1, group, 1, 1) for x in (key, value))
        scale = default_scale(d) if scaling is None else scaling
        scale = {None: scale, "ignored": default_scale(d), "squared": scale * scale}[scale_slip]
        offset = {"bottom_right": n_k - n_q, "top_left": 0, "off": n_k}[causal_offset]
        visible = causal_visible(n_q, n_k, offset, query.device).expand(batch, 1, n_q, n_k)
        if attention_mask is not None and use_mask:
            visible = visible & attention_mask
        # a row that sees nothing (left padding) attends to every key; the check zeroes it
        visible = visible | ~visible.any(dim=-1, keepdim=True)
        o = F.scaled_dot_product_attention(query.double(), k.double(), v.double(),
                                           attn_mask=visible, scale=scale)  # (B, H, N_q, d)
        o = o.to(query.dtype)
        out = {"right": o.transpose(1, 2), "none": o,
               "reshape": o.reshape(batch, n_q, heads, d)}[transpose]
        return (out, None) if pair else out
    return adapter


adapter_reference = _adapter_model()


ADAPTER_MISTAKES = {
    "the output keeps the kernel's layout (B, H, N, d): transformers expects (B, N, H, d) — it "
    "reshapes the output to (B, N, H·d) for o_proj — so return `out.transpose(1, 2)`":
        _adapter_model(transpose="none"),
    "the output is reshaped, not transposed: `.reshape(B, N, H, d)` (or `.view`) reinterprets "
    "the (B, H, N, d) memory and mixes heads with positions; `.transpose(1, 2)` swaps the axes":
        _adapter_model(transpose="reshape"),
    "the K/V heads are repeated in the wrong order (`repeat`/`tile`: query head h reads K/V head "
    "h % H_kv): GQA gives query head h K/V head h // (H // H_kv) — `repeat_interleave`, or let "
    "the kernel read the shared heads in place (k, v with H_kv heads)":
        _adapter_model(kv="tile"),
    "`scaling` is ignored (the kernel's default 1/√d is used): pass `scale=scaling` — a model "
    "may scale scores by something else (here 0.3)": _adapter_model(scale_slip="ignored"),
    "the scores are scaled twice (q multiplied by `scaling` and the kernel scaling again): "
    "pass `scale=scaling` and leave q as it is": _adapter_model(scale_slip="squared"),
    "the attention is not causal: every query sees every key, future tokens included — a "
    "language model's layer is causal": _adapter_model(causal_offset="off"),
    "the causal mask is aligned to the top-left on a decoding step: with a KV cache the one new "
    "query is the *last* position and sees every cached key, but SDPA's and flash_attention's "
    "`causal=True` let query 0 see key 0 only — causal only when N_q == N_k, none when N_q == 1":
        _adapter_model(causal_offset="top_left"),
    "the adapter returns the output alone: transformers unpacks `attn_output, attn_weights = "
    "attention(...)`, so return the pair `(out, None)`": _adapter_model(pair=False),
}

MASK_IGNORED = ("attention_mask is ignored: the real tokens of the left-padded prompt attend to the "
                "padding before them — handle the mask, or refuse it by name (e.g. `raise "
                "ValueError(...)` when it is not None), never compute without it")

# The errors that refuse a padded batch "by name" (raised on purpose), as opposed to crashes.
REFUSALS = (ValueError, NotImplementedError)


def _left_padding_mask(lengths, n: int, device) -> torch.Tensor:
    """transformers' 4-D boolean mask ``(B, 1, N, N)`` (True = attend) for a batch left-padded to
    ``n`` tokens (as ``generate`` pads prompts): causal, and no key in the padding."""
    real = torch.stack([torch.arange(n, device=device) >= n - length for length in lengths])
    return causal_visible(n, n, 0, device)[None, None] & real[:, None, None, :]


def _qkv(gen, batch, heads, kv_heads, n_q, n_k, d, dtype, transformers_layout: bool):
    """q ``(B, H, N_q, d)``, k, v ``(B, H_kv, N_k, d)`` on the runtime's device; with
    ``transformers_layout`` views of ``(B, N, H, d)`` tensors, as the projections make them."""
    def make(h, n):
        if transformers_layout:
            return torch.randn(batch, n, h, d, generator=gen).to(_rt.device, dtype).transpose(1, 2)
        return torch.randn(batch, h, n, d, generator=gen).to(_rt.device, dtype)
    return make(heads, n_q), make(kv_heads, n_k), make(kv_heads, n_k)


# Scores scaled by something other than 1/√d (some models, e.g. Gemma, scale by a config value).
OTHER_SCALING = 0.3


def _adapter_cases() -> list[Case]:
    gen = torch.Generator().manual_seed(12_1)
    f32, f16 = torch.float32, torch.float16
    cases = []
    for label, (b, h, h_kv, n_q, n_k, d, dtype, layout), scaling in (
        ("prefill, GQA 4 heads / 2 K/V heads, views of (B, N, H, d) as transformers makes them",
         (1, 4, 2, 33, 33, 16, f32, True), "module"),
        ("prefill, 6 heads / 2 K/V heads, contiguous, scaling 0.3",
         (2, 6, 2, 17, 17, 32, f32, False), OTHER_SCALING),
        ("prefill, no GQA (4 / 4), scaling=None", (2, 4, 4, 20, 20, 16, f32, True), None),
        ("decoding step: 1 new query after 28 cached tokens, MQA (4 heads / 1 K/V head)",
         (1, 4, 1, 1, 29, 16, f32, False), "module"),
        ("prefill in float16, 8 heads / 2 K/V heads", (2, 8, 2, 40, 40, 16, f16, True), "module"),
    ):
        module = AttentionModuleStandIn(h, h_kv, d)
        q, k, v = _qkv(gen, b, h, h_kv, n_q, n_k, d, dtype, layout)
        kwargs = {"scaling": module.scaling if scaling == "module" else scaling, "dropout": 0.0,
                  "position_ids": torch.arange(n_k - n_q, n_k, device=_rt.device)[None]}
        cases.append(Case((module, q, k, v, None), kwargs, label=label))
    module = AttentionModuleStandIn(4, 2, 16)
    q, k, v = _qkv(gen, 2, 4, 2, 12, 12, 16, f32, True)
    mask = _left_padding_mask([12, 7], 12, _rt.device)
    cases.append(Case((module, q, k, v, mask), {"scaling": module.scaling, "dropout": 0.0},
                      label="a padded batch (prompts of 12 and 7 tokens, left-padded as generate "
                            "pads them): attention_mask (B, 1, N, N), True = attend"))
    return cases


def run_adapter(adapter, spec: tuple, refusal_allowed: bool, args: tuple, kwargs: dict) -> dict:
    """Call ``adapter`` as transformers does, on a module rebuilt from ``spec``: where the
    learner's adapter lives (the check cell's process, or the notebook's when the grader sends
    this function by name, ``grade_channel.run_with``), returning only data.

    Args:
        adapter: the learner's ``attention(module, query, key, value, attention_mask, **kwargs)``.
        spec: ``AttentionModuleStandIn.spec``, ``(heads, kv_heads, head_dim)``.
        refusal_allowed: catch a refusal by name (:data:`REFUSALS`) instead of raising it.
        args: ``(query (B, H, N_q, d), key, value (B, H_kv, N_k, d), attention_mask)``.
        kwargs: ``scaling``, ``dropout``, ...

    Returns:
        ``{"result": what the adapter returned}``, or ``{"refused": "ValueError: ..."}`` (only
        with ``refusal_allowed``; caught here, where the learner's own subclasses of the errors
        are still theirs).
    """
    module = AttentionModuleStandIn(*spec)
    try:
        return {"result": adapter(module, *args, **kwargs)}
    except REFUSALS as exc:
        if not refusal_allowed:
            raise
        return {"refused": f"{type(exc).__name__}: {exc}"}


def _normalised(adapter, refused: dict | None = None) -> Callable:
    """``adapter`` as the check compares it: it returns ``out`` of the pair ``(out, weights)``
    with the padding rows zeroed (transformers never uses them), and ``[result]`` when the
    adapter returned something else than a pair (so that it cannot pass). With ``refused`` (a
    dict), a padded batch refused by name counts as right and the error is kept in
    ``refused["error"]``. The adapter runs through :func:`run_adapter` (in the notebook's
    process, when the grader runs the check)."""
    def call(module, query, key, value, attention_mask, **kwargs):
        allowed = refused is not None and attention_mask is not None
        reply = grade_channel.run_with(adapter, run_adapter, module.spec, allowed,
                                       (query, key, value, attention_mask), kwargs)
        if isinstance(reply, dict) and isinstance(reply.get("refused"), str) and allowed:
            refused["error"] = reply["refused"]
            result = adapter_reference(module, query, key, value, attention_mask, **kwargs)
        else:  # (a reply that is not run_adapter's can only fail: it is not a pair)
            result = reply.get("result", reply) if isinstance(reply, dict) else reply
        if not (isinstance(result, tuple) and len(result) == 2):
            return [result]
        out = result[0]
        if isinstance(out, torch.Tensor) and out.dim() == 4 and tuple(out.shape[:2]) == (
                query.shape[0], query.shape[2]):
            real = _real_rows(attention_mask, query.shape[0], query.shape[2], out.device)
            out = out * real[:, :, None, None].to(out.dtype)  # (B, N_q, H, d)
        return out
    return call


@learner_check
def check_adapter(fn):
    """Check exercise 12.1, ``fn(module, query, key, value, attention_mask, scaling=None,
    dropout=0.0, **kwargs) -> (out, None)`` (see the module docstring); return the adapter to go
    on with (the library's when not done yet).

    First the unpadded cases (layout, GQA, scaling, causal, a decoding step), then a left-padded
    batch, which may be computed right or refused with a ``ValueError`` (or
    ``NotImplementedError``) raised on purpose; the pass line says which."""
    exercise = "Exercise 12.1"
    *cases, padded = _adapter_cases()
    fallback = library_adapter()
    mistakes = {cause: _normalised(model) for cause, model in ADAPTER_MISTAKES.items()}
    result = check_function(exercise, _normalised(fn), _normalised(adapter_reference), cases,
                            fallback=fallback, mistakes=mistakes, quiet=True)
    if result is fallback:
        return checks.not_done(exercise, fallback)
    refused: dict[str, str] = {}
    check_function(exercise, _normalised(fn, refused), _normalised(adapter_reference), [padded],
                   fallback=fallback,
                   mistakes={MASK_IGNORED: _normalised(_adapter_model(use_mask=False))},
                   quiet=True)
    how = (f"refused by name ({refused['error']})" if refused else
           "computed right (the mask was honoured)")
    checks.passed(exercise, f"✓ {exercise}: passed ({len(cases) + 1} cases; the padded batch was "
                            f"{how}).")
    return fn


def library_adapter():
    """The library's adapter, :func:`course_lib.integrations.hf.attention_forward` (what the
    notebook goes on with when exercise 12.1 is not done): padding, windows, decoding, GQA."""
    from course_lib.integrations import hf  # needs transformers: imported on use

    return hf.attention_forward


ADAPTER_HINTS = [
    "Shapes first: <code>query</code> is <code>(B, H, N_q, d)</code>, <code>key</code> and "
    "<code>value</code> <code>(B, H_kv, N_k, d)</code>. <code>course_lib.flash_attention</code> "
    "takes exactly that (GQA when H_kv &lt; H): no <code>repeat_kv</code> needed.",
    "The scale: transformers passes <code>scaling</code> (None means 1/√d): hand it over as "
    "<code>scale=scaling</code>.",
    "Causal: a prefill has N_q == N_k (<code>causal=True</code>); a decoding step with a KV "
    "cache has N_q == 1 and the new token sees the whole cache (<code>causal=False</code>).",
    "The output: transformers wants <code>(B, N_q, H, d)</code> and a pair: <code>return "
    "out.transpose(1, 2), None</code>.",
    "What you do not support, refuse by name: <code>if attention_mask is not None: raise "
    "ValueError(\"...padded batches...\")</code>, and the same for <code>dropout &gt; 0</code>.",
]


# ----------------------------------------------------------------------------------------------
# Exercise 12.2: a kernel as a custom op


def attention_op_reference(q, k, v, causal: bool, scale: float):
    """``(o, lse)`` of attention in float64, returned as the op returns them: ``o`` like ``q``
    ``(..., N_q, d)`` in q's dtype, ``lse`` ``(..., N_q)`` float32 (natural log)."""
    o, lse = naive_attention_torch(q.double(), k.double(), v.double(), causal, scale)
    return o.to(q.dtype), lse.float()


def _op_dtypes() -> tuple[torch.dtype, torch.dtype]:
    """``(exact, fast)``: the dtypes of exercise 12.2's cases in this mode. float32 is exact only
    in the interpreter: on a GPU chapter 06's kernel multiplies P·V in TF32 (``tl.dot``'s default
    for float32), ~1e-3 off, so there the cases are float16 and bfloat16 (bfloat16 is computed
    wrongly by the interpreter), each compared with its own tolerance (``checks.TOLERANCES``)."""
    return (torch.float32, torch.float16) if _rt.interpreted else (torch.float16, torch.bfloat16)


def fp32_op_tolerance() -> tuple[float, float]:
    """``(atol, rtol)`` to compare chapter 06's kernel on float32 inputs with float32 attention
    in this mode: float32's in the interpreter (exact dot products); on a GPU float16's, since
    its P·V product runs in TF32, which keeps 10 mantissa bits, as float16 does."""
    return checks.TOLERANCES["float32" if _rt.interpreted else "float16"]


def _op_cases() -> list[Case]:
    gen = torch.Generator().manual_seed(12_2)
    exact, fast = _op_dtypes()

    def make(shape, dtype, transposed=False):
        if transposed:  # a view of (B, N, H, d), as transformers' projections make q
            b, h, n, d = shape
            return torch.randn(b, n, h, d, generator=gen).to(_rt.device, dtype).transpose(1, 2)
        return torch.randn(*shape, generator=gen).to(_rt.device, dtype)

    def name(dtype):
        return str(dtype).removeprefix("torch.")

    return [
        Case((make((1, 2, 40, 16), exact), make((1, 2, 40, 16), exact),
              make((1, 2, 40, 16), exact), True, 0.25),
             label=f"causal, (B, H, N, d) = (1, 2, 40, 16), {name(exact)}"),
        Case((make((2, 2, 19, 32), exact, transposed=True), make((2, 2, 33, 32), exact),
              make((2, 2, 33, 32), exact), False, default_scale(32)),
             label=f"N_q = 19 ≠ N_k = 33, q a transposed view, {name(exact)}"),
        Case((make((1, 2, 24, 16), fast), make((1, 2, 24, 16), fast),
              make((1, 2, 24, 16), fast), True, 0.25),
             label=f"causal, {name(fast)} (lse stays float32)"),
    ]


def _returns_o_only(q, k, v, causal, scale):
    return attention_op_reference(q, k, v, causal, scale)[0]


def _swapped_outputs(q, k, v, causal, scale):
    o, lse = attention_op_reference(q, k, v, causal, scale)
    return lse, o


OP_OUTPUT_MISTAKES = {
    "the op returns o only: the backward needs the log-sum-exp too (chapter 07), so return "
    "both, `-> tuple[torch.Tensor, torch.Tensor]` and `return o, lse`": _returns_o_only,
    "the outputs are swapped: return `(o, lse)` in that order, as teaching.forward gives them":
        _swapped_outputs,
}

# What torch.library.opcheck reports (a regular expression on its message) -> the diagnosis.
# ``{i}``/``{name}`` become the output's index and name, ``{real}``/``{fake}`` what the kernel
# and the fake returned.
OPCHECK_CAUSES = (
    (r"no fake impl registered",
     "no fake implementation registered: torch.compile cannot know the output's shape without "
     "running the kernel — add one with `@attention.register_fake`, returning empty tensors "
     "shaped like the real outputs"),
    (r"not defined as mutable but was mutated",
     "the op changed an input in place ({detail}) but `mutates_args=()` declares that it changes "
     "none: torch.compile would reuse or reorder that input wrongly — leave the inputs alone "
     "(scale a copy) or list the argument in `mutates_args`"),
    (r"Shapes (torch\.Size\(\[[\d, ]*\]\)) and (torch\.Size\(\[[\d, ]*\]\)) are not equal",
     "the fake's {name} has shape {fake}, the kernel's {real}: the fake must describe the real "
     "outputs exactly — o is shaped like q (N_q rows, not k's N_k), lse like q without its last "
     "dim"),
    (r"Dtypes (torch\.\w+) and (torch\.\w+) are not equal",
     "the fake's {name} has dtype {fake}, the kernel's {real}: lse is float32 whatever q's dtype "
     "(it is computed and kept in float32), o has q's dtype"),
    (r"Stride mismatch! Strides are (\([\d, ]*\)) and (\([\d, ]*\))",
     "the fake's {name} has strides {fake}, the kernel's {real}: the kernel returns contiguous "
     "tensors, but `torch.empty_like(q)` copies q's strides (q is a transposed view here) — use "
     "`q.new_empty(q.shape)`. A compiler trusts the fake's strides when it reads the output"),
    (r"outputs_alias_inputs|alias",
     "the fake returns an input (or a view of one): a custom op's outputs are new tensors, so its "
     "fake must return new (empty) tensors too, e.g. `q.new_empty(q.shape)`"),
    (r"meta|data pointer|FakeTensor|InterpreterError|data_ptr",
     "the fake runs the kernel: it is called with FakeTensors, which have a shape and a dtype but "
     "no data, so it must only build empty outputs of the right shape and dtype "
     "(`q.new_empty(...)`), never launch anything"),
)


def _output_detail(message: str) -> tuple[str, str]:
    """``(index, name)`` of the output an opcheck message is about (o when it names none)."""
    found = re.search(r"output\[(\d)\]", message)
    index = found.group(1) if found else "0"
    return index, {"0": "o (output 0)", "1": "lse (output 1)"}.get(index, f"output {index}")


def opcheck_diagnosis(message: str) -> str:
    """The cause of an ``opcheck`` failure, in the exercise's words (the first line of torch's
    message when no known pattern matches)."""
    for pattern, cause in OPCHECK_CAUSES:
        found = re.search(pattern, message)
        if found is None:
            continue
        real, fake = (found.group(1), found.group(2)) if found.lastindex == 2 else ("", "")
        mutated = re.search(r"Argument (\w+) is not defined as mutable", message)
        detail = f"`{mutated.group(1)}`" if mutated else "an input"
        return cause.format(name=_output_detail(message)[1], real=real, fake=fake, detail=detail)
    first = message.strip().splitlines()[0] if message.strip() else "no message"
    return f"torch.library.opcheck failed: {first}"


@contextlib.contextmanager
def _quiet_torch():
    """Silence what torch logs and warns while it probes a learner's op (a failing fake logs a
    traceback at ERROR level; the diagnosis says what matters)."""
    loggers = [logging.getLogger(name) for name in ("torch._subclasses.fake_tensor",
                                                    "torch._dynamo", "torch._inductor")]
    levels = [logger.level for logger in loggers]
    try:
        for logger in loggers:
            logger.setLevel(logging.CRITICAL)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def is_custom_op(op: Any) -> bool:
    """True for what ``torch.library.custom_op`` (or ``triton_op``) returns, or an op of
    ``torch.ops``."""
    from torch._library.custom_ops import CustomOpDef

    return isinstance(op, (CustomOpDef, torch._ops.OpOverload, torch._ops.OpOverloadPacket))


def _op_function(op) -> Callable:
    """The Python function a custom op was made from (to tell the library's op from a learner's)."""
    return getattr(op, "_init_fn", op)


def opcheck_report(op, args: tuple) -> dict[str, str]:
    """``torch.library.opcheck(op, args)``: ``{test: "SUCCESS"}`` or raises ``OpCheckError``."""
    with _quiet_torch():
        return torch.library.opcheck(op, args)


class _LaunchedOnFakes(RuntimeError):
    """A kernel launch while :func:`probe_fake` ran the op's fake implementation."""


@contextlib.contextmanager
def _no_kernel_launches():
    """Refuse every Triton launch inside (Triton's launch-enter hook runs before the launcher reads
    a pointer, and an exception there stops the launch). On a GPU a fake that launches the kernel
    on FakeTensors hands it pointers to no memory: an illegal memory access, which leaves the
    CUDA context unusable for the rest of the session, so the check must stop it before."""
    from triton import knobs

    hooks = knobs.runtime.launch_enter_hook

    def refuse(*_):
        raise _LaunchedOnFakes("the fake launched a Triton kernel on FakeTensors (no data pointer)")

    if not hasattr(hooks, "add"):  # an older Triton without a chain of hooks: nothing to hang on
        yield
        return
    hooks.add(refuse)
    try:
        yield
    finally:
        hooks.remove(refuse)


def probe_fake(op, args: tuple) -> None:
    """Call ``op`` on FakeTensor copies of ``args`` (what torch.compile and ``opcheck`` do with its
    fake implementation), launching nothing; raise what the fake raised."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with _quiet_torch(), _no_kernel_launches(), FakeTensorMode() as mode:
        fakes = tuple(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args)
        op(*fakes)


def op_outputs(make_op, q, k, v, causal: bool, scale: float):
    """``make_op()(q, k, v, causal, scale)``: the op made anew, as re-running the exercise cell
    would, and run where it lives (the notebook's process when the grader sends this by name)."""
    return make_op()(q, k, v, causal, scale)


def op_kind(make_op) -> dict[str, Any]:
    """What ``make_op()`` returns, as data: ``{"custom_op": bool, "library": bool (the library's
    own op), "type": its type's name, "name": its name}``."""
    op = make_op()
    return {"custom_op": is_custom_op(op),
            "library": op is library_attention_op() or checks.is_library_object(_op_function(op)),
            "type": type(op).__name__, "name": str(getattr(op, "__name__", type(op).__name__))}


def opcheck_problem(make_op, q, k, v, causal: bool, scale: float) -> str | None:
    """What :func:`probe_fake` then :func:`opcheck_report` find wrong with ``make_op()`` on these
    inputs, as text (the exception's message); None when both pass."""
    op = make_op()
    args = (q, k, v, causal, scale)
    try:
        probe_fake(op, args)  # first, launching nothing (a launch on FakeTensors breaks a GPU)
        opcheck_report(op, args)
    except KeyboardInterrupt:
        raise
    except Exception as exc:  # noqa: BLE001 - opcheck's finding is the evidence
        return str(exc)
    return None


def compile_probe(make_op, q, k, v, scale: float) -> dict[str, Any]:
    """:func:`graph_report` and ``torch.compile(fullgraph=True)`` of a block around ``make_op()``
    on ``q, k, v`` ``(B, H, N, d)``, as data: ``{"graphs": int, "breaks": int, "reasons": [str],
    "compiled": tensor, "eager": tensor}``, or ``{"error": "Name: first line"}`` when the
    compiler failed."""
    block = _sample_block(make_op(), scale)
    try:
        graphs, breaks, reasons = graph_report(block, q, k, v)
        with _quiet_torch():
            torch._dynamo.reset()
            compiled = torch.compile(block, fullgraph=True, backend="aot_eager")(q, k, v)
    except KeyboardInterrupt:
        raise
    except Exception as exc:  # noqa: BLE001 - what the compiler said is the evidence
        return {"error": _first_line(exc)}
    return {"graphs": graphs, "breaks": breaks, "reasons": reasons, "compiled": compiled,
            "eager": block(q, k, v)}


def _sample_block(op, scale: float) -> Callable:
    """A small compiled-model stand-in: the op between two torch operations."""
    def block(q, k, v):
        o, _ = op(q * 1.0, k, v, True, scale)  # (B, H, N, d)
        return torch.relu(o) + 1.0
    return block


def graph_report(fn: Callable, *args) -> tuple[int, int, list[str]]:
    """``(graphs, graph_breaks, reasons)`` of ``torch._dynamo.explain(fn)(*args)``."""
    with _quiet_torch():
        torch._dynamo.reset()
        explained = torch._dynamo.explain(fn)(*args)
    reasons = [str(getattr(b, "reason", b)).strip().splitlines()[0] for b in explained.break_reasons]
    return explained.graph_count, explained.graph_break_count, reasons


@functools.cache
def library_attention_op():
    """Exercise 12.2's answer: chapter 06's teaching forward as the custom op
    ``course_ch12::attention`` (defined on first use; what the notebook goes on with when the
    exercise is not done). ``op(q, k, v, causal, scale) -> (o, lse)``."""
    from course_lib.kernels import teaching

    @torch.library.custom_op("course_ch12::attention", mutates_args=())
    def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                  scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        return teaching.forward(q, k, v, causal, scale)

    @attention.register_fake
    def _(q, k, v, causal, scale):
        return q.new_empty(q.shape), q.new_empty(q.shape[:-1], dtype=torch.float32)

    return attention


def _failed(message: str) -> ExerciseFailed:
    return checks.failed_with("Exercise 12.2", message)


def _reply(value: Any, fields: dict[str, type]) -> dict[str, Any]:
    """``value`` as a dict of ``fields`` (name -> type), in that order: what a probe of the op
    returned, checked before it is judged (from the grader's notebook process it is only data,
    and may be anything); raises :class:`ExerciseFailed` when it is not that."""
    ok = isinstance(value, dict) and all(isinstance(value.get(name), kind) for name, kind in
                                         fields.items())
    if not ok:
        raise _failed(f"✗ Exercise 12.2: the notebook's process answered a probe of your op with "
                      f"{type(value).__name__} data, not the fields {', '.join(fields)}")
    return {name: value[name] for name in fields}


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


@learner_check
def check_custom_op(make_op):
    """Check exercise 12.2, ``make_op() -> op`` with ``op(q, k, v, causal, scale) -> (o, lse)`` a
    torch.library custom op over chapter 06's teaching kernel, with a fake; return the factory to
    go on with (:func:`library_attention_op` when not done yet).

    In order: the op's ``(o, lse)`` match float64 attention on every case (the factory runs
    anew for each, as re-running the cell would); what the factory returns is a custom op;
    ``opcheck`` passes on two cases (a transposed q with N_q ≠ N_k; the fast dtype);
    ``torch.compile(fullgraph=True)`` of a block around the op makes one graph, with no graph
    break, and the same numbers as eager."""
    exercise = "Exercise 12.2"
    fallback = library_attention_op

    def run(q, k, v, causal, scale):  # in the notebook's process when the grader runs it
        return grade_channel.run_with(make_op, op_outputs, q, k, v, causal, scale)

    cases = _op_cases()
    # inputs may be changed here: opcheck, next, says whether the op declared it
    result = check_function(exercise, run, attention_op_reference, cases, fallback=fallback,
                            mistakes=OP_OUTPUT_MISTAKES, quiet=True, subject="your op",
                            writable=("q", "k", "v"))
    if result is fallback:
        return checks.not_done(exercise, fallback)
    kind = _reply(grade_channel.run_with(make_op, op_kind), {"custom_op": bool, "library": bool,
                                                             "type": str, "name": str})
    if kind["library"]:
        return checks.not_done(exercise, fallback)
    if not kind["custom_op"]:
        raise _failed(f"✗ {exercise}: make_attention_op() returned a plain Python "
                      f"{kind['type']} (`{kind['name']}`), not a torch.library custom op\n"
                      f"  its numbers are right, but torch.compile would trace into it and reach "
                      f"the Triton launch, which it cannot trace (a graph break, or an error with "
                      f"fullgraph=True): decorate it with "
                      f"`@torch.library.custom_op(\"ch12::attention\", mutates_args=())` and return "
                      f"what the decorator made")
    for n in (2, 3):  # a transposed q with N_q != N_k; the fast dtype (float16 or bfloat16)
        case = cases[n - 1]
        args = tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in case.args)
        problem = grade_channel.run_with(make_op, opcheck_problem, *args)
        if problem is not None:
            raise _failed(f"✗ {exercise}: torch.library.opcheck fails on case {n} "
                          f"{case.describe()}\n  {opcheck_diagnosis(str(problem))}")
    q, k, v, _, scale = cases[0].args
    found = grade_channel.run_with(make_op, compile_probe, q, k, v, scale)
    if isinstance(found, dict) and "error" in found:
        raise _failed(f"✗ {exercise}: torch.compile(fullgraph=True) of a block around your op "
                      f"failed\n  {found['error']}")
    found = _reply(found, {"graphs": int, "breaks": int, "reasons": list,
                           "compiled": torch.Tensor, "eager": torch.Tensor})
    graphs, breaks, reasons, compiled, eager = found.values()
    if graphs != 1 or breaks:
        raise _failed(f"✗ {exercise}: torch.compile splits a block around your op into {graphs} "
                      f"graphs ({breaks} graph breaks: {'; '.join(map(str, reasons[:2]))})")
    if (compiled.shape, compiled.dtype) != (eager.shape, eager.dtype):
        raise _failed(f"✗ {exercise}: the compiled block gives a {describe_value(compiled)}, "
                      f"eager a {describe_value(eager)}")
    atol, rtol = _default_tolerance(eager)  # the first case's dtype: float32, or float16 on a GPU
    if not torch.allclose(compiled, eager, atol=atol, rtol=rtol):
        raise _failed(f"✗ {exercise}: the compiled block differs from eager by "
                      f"{(compiled - eager).abs().max().item():.3g}")
    checks.passed(exercise, f"✓ {exercise}: passed ({len(cases)} cases; torch.library.opcheck "
                            f"passes on 2 of them; torch.compile(fullgraph=True) of a block around "
                            f"your op: {graphs} graph, {breaks} graph breaks, the same output as "
                            f"eager).")
    return make_op


CUSTOM_OP_HINTS = [
    "The decorator: <code>@torch.library.custom_op(\"ch12::attention\", mutates_args=())</code> "
    "above a function with type annotations — custom_op builds the op's schema from them: "
    "<code>(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float) -&gt; "
    "tuple[torch.Tensor, torch.Tensor]</code>.",
    "Its body is the real computation: <code>return teaching.forward(q, k, v, causal, "
    "scale)</code> (chapter 06's kernel; it gives <code>(o, lse)</code>).",
    "The fake: <code>@attention.register_fake</code> above a function with the same parameters "
    "that returns empty tensors shaped like the real outputs — it runs on FakeTensors (a shape "
    "and a dtype, no data).",
    "The shapes and dtypes: <code>o</code> is like <code>q</code> (contiguous: "
    "<code>q.new_empty(q.shape)</code>, not <code>torch.empty_like(q)</code>, which copies q's "
    "strides); <code>lse</code> is <code>q.shape[:-1]</code> in <code>torch.float32</code>.",
    "Return the op (<code>return attention</code>) from <code>make_attention_op</code>.",
]

CUSTOM_OP_SKELETON = '''\
@torch.library.custom_op("ch12::attention", mutates_args=())
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
              scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    return ...                                   # chapter 06's kernel: (o, lse)

@attention.register_fake
def _(q, k, v, causal, scale):
    return ..., ...                              # empty o like q, empty float32 lse (..., N_q)

return attention
'''

"""``course_lib.integrations.hf``: the course's kernels as a transformers attention implementation.

Tiny random models built from their configs (no download): Llama with GQA, Qwen2 (sliding window on
its second layer only) and Mistral (sliding window on every layer), the same weights under
``attn_implementation="sdpa"`` and under the course's. On CPU in float32 through Triton's interpreter:
logits on the real tokens of batches padded left and right, parameter gradients, greedy generation
with the KV cache token for token (and which kernel each call took); every refused feature raises its
named error; a learner's ``attention=`` is called, and a wrong one is caught. The ``gpu`` tests repeat
the comparisons in bfloat16 on CUDA, where the two implementations round differently: there the
course's error against a float32 SDPA run must stay within ``BF16_ERROR_FACTOR`` times SDPA's own.
"""

from __future__ import annotations

import copy
import importlib
import types

import pytest
import torch
import torch.nn.functional as F

import course_lib
from course_lib.platform import runtime
from course_lib.teaching.checks import TOLERANCES
from course_lib.kernels import api
from course_lib.kernels import decoding as kdec

pytestmark = pytest.mark.ch12

# The comparisons run where the session runs kernels: the interpreter on CPU, or natively on CUDA
# (still in float32 there, with the same tolerances).
DEVICE = runtime.current().device

class _Lazy:
    """A module imported on its first use: transformers costs ~3 s of CPU to import, and every
    test worker collects this file, but only the one that runs it needs it."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attr):
        return getattr(importlib.import_module(self._name), attr)


transformers = _Lazy("transformers")
hf = _Lazy("course_lib.integrations.hf")
# Small enough for the interpreter (each kernel call ~0.2 s on one CPU core), large enough for GQA
# (4 query heads, 2 K/V heads), two layers and a head dim the kernels take (>= 16).
TINY = dict(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, pad_token_id=0, eos_token_id=None)  # no early stop
SEQ_LEN = 20  # tokens of the longest prompt
# Real tokens per prompt, and on which side each is padded: one full row, one padded left, one right.
PROMPTS = ((SEQ_LEN, "left"), (13, "left"), (9, "right"))
WINDOW = 6  # the sliding window, well below SEQ_LEN so that it cuts keys off
NEW_TOKENS = 4  # greedy tokens generated
# The course's error against float32 SDPA may be at most this many times SDPA's own error in the same
# low precision: flash-attn's tests hold its kernels to the same factor (tests/test_flash_attn.py).
BF16_ERROR_FACTOR = 2

SLIDING = {  # family: the name of its transformers config class, and the window's settings
    "qwen2": ("Qwen2Config", dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)),
    "mistral": ("MistralConfig", dict(sliding_window=WINDOW)),
}


def _config(family: str, **changes):
    """The tiny config of ``family``: "llama", or one of :data:`SLIDING` with its window
    (``changes``: settings changed from those)."""
    if family == "llama":
        return transformers.LlamaConfig(**TINY, **changes)
    name, extra = SLIDING[family]
    return getattr(transformers, name)(**TINY, **{**extra, **changes})


@pytest.fixture(scope="module", autouse=True)
def course_name():
    return hf.register()


def _models(config, device=DEVICE, dtype=torch.float32, name=None):
    """``(sdpa_model, course_model)``: the same random weights, in eval mode. Each gets its own copy
    of the config (``from_config`` writes the implementation into the config it is given)."""
    torch.manual_seed(0)
    ref = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="sdpa")
    mine = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config),
                                                         attn_implementation=name or hf.DEFAULT_NAME)
    mine.load_state_dict(ref.state_dict())
    return (ref.to(device, dtype).eval(), mine.to(device, dtype).eval())


def _batch(prompts=PROMPTS, device=DEVICE):
    """``(input_ids, attention_mask)`` ``(B, SEQ_LEN)``: random tokens, padding (id 0) on each row's side."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1, TINY["vocab_size"], (len(prompts), SEQ_LEN), generator=gen)
    mask = torch.zeros_like(ids)
    for row, (n, side) in enumerate(prompts):
        if side == "left":
            mask[row, SEQ_LEN - n:] = 1
        else:
            mask[row, :n] = 1
    ids = ids.masked_fill(mask == 0, TINY["pad_token_id"])
    return ids.to(device), mask.to(device)


def _assert_close(actual, expected, what: str):
    atol, rtol = TOLERANCES["float32"]
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol, msg=lambda m: f"{what}: {m}")


def _count_calls(monkeypatch, module, name: str) -> list:
    """Wrap ``module.name`` so that each call is counted; returns the one-element counter."""
    calls, original = [0], getattr(module, name)

    def counted(*args, **kwargs):
        calls[0] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, counted, raising=False)
    return calls


# ----------------------------------------------------------------------------------------------
# Against SDPA on CPU (float32, Triton's interpreter)


def test_logits_match_sdpa_with_padding_on_both_sides(monkeypatch):
    ref, mine = _models(transformers.LlamaConfig(**TINY))
    ids, mask = _batch()
    varlen = _count_calls(monkeypatch, api, "flash_attention_varlen")  # what course_lib.* names
    with torch.no_grad():
        want, got = ref(ids, attention_mask=mask).logits, mine(ids, attention_mask=mask).logits
    real = mask.bool()
    _assert_close(got[real], want[real], "logits on real tokens")
    assert varlen[0] == TINY["num_hidden_layers"], "a padded batch goes through flash_attention_varlen"


def test_logits_match_sdpa_without_padding(monkeypatch):
    ref, mine = _models(transformers.LlamaConfig(**TINY))
    ids, _ = _batch()
    dense = _count_calls(monkeypatch, api, "flash_attention")
    with torch.no_grad():
        _assert_close(mine(ids).logits, ref(ids).logits, "logits")
    assert dense[0] == TINY["num_hidden_layers"]


@pytest.mark.parametrize("padded", [False, True], ids=["flash_attention", "varlen"])
def test_gradients_match_sdpa(padded):
    ref, mine = _models(transformers.LlamaConfig(**TINY))
    ids, mask = _batch(PROMPTS if padded else PROMPTS[:1])
    labels = ids.masked_fill(mask == 0, -100)  # the loss counts real tokens only
    for model in (ref, mine):
        model(ids, attention_mask=mask, labels=labels).loss.backward()
    grads = dict(ref.named_parameters())
    for name, p in mine.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
        _assert_close(p.grad, grads[name].grad, f"gradient of {name}")


@pytest.mark.parametrize("padded, cache", [(False, "dynamic"), (True, "dynamic"), (False, "static")],
                         ids=["one prompt: flash-decoding", "left-padded batch: varlen", "static cache"])
def test_greedy_generation_matches_sdpa(monkeypatch, padded, cache):
    ref, mine = _models(transformers.LlamaConfig(**TINY))
    ids, mask = _batch(PROMPTS[:2]) if padded else _batch(PROMPTS[:1])
    decode = _count_calls(monkeypatch, kdec, "flash_decode_triton")
    kw = dict(attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=TINY["pad_token_id"],
              cache_implementation=cache)  # a static cache hands over its unwritten slots too: they are cut off
    want, got = ref.generate(ids, **kw), mine.generate(ids, **kw)
    assert got.tolist() == want.tolist()
    steps = (NEW_TOKENS - 1) * TINY["num_hidden_layers"]  # every token after the prefill, in each layer
    # a padded cache needs per-sequence lengths, which the decoding kernels do not take
    assert decode[0] == (0 if padded else steps)


@pytest.mark.parametrize("family", sorted(SLIDING))
def test_sliding_window_matches_sdpa(family):
    ref, mine = _models(_config(family))
    ids, mask = _batch(PROMPTS[:2])
    real = mask.bool()
    with torch.no_grad():
        want = ref(ids, attention_mask=mask).logits
        _assert_close(mine(ids, attention_mask=mask).logits[real], want[real], "logits on real tokens")
        _assert_close(mine(ids).logits, ref(ids).logits, "logits without padding")
        full, _ = _models(_config(family, sliding_window=None))
        assert not torch.allclose(full(ids, attention_mask=mask).logits[real], want[real]), \
            "the window must cut keys off at this length, or the comparison proves nothing"
    kw = dict(attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=TINY["pad_token_id"])
    assert mine.generate(ids, **kw).tolist() == ref.generate(ids, **kw).tolist()


def _call(**kwargs):
    """The registered function called directly, as a model would: 8 queries and keys unless given."""
    module = types.SimpleNamespace(is_causal=True, config=types.SimpleNamespace())
    q, k = torch.randn(1, 4, 8, 16, device=DEVICE), torch.randn(1, 2, 8, 16, device=DEVICE)
    args = dict(module=module, query=q, key=k, value=k.clone(), attention_mask=None)
    return hf.attention_forward(**{**args, **kwargs})


@pytest.mark.parametrize("n_q, causal", [(3, True), (1, True), (8, False)],
                         ids=["several new tokens: bottom-right", "one new token", "non-causal"])
def test_queries_at_the_end_of_the_keys_match_sdpa(n_q, causal):
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(shape, generator=gen).to(DEVICE).requires_grad_()
               for shape in ((1, 4, n_q, 16), (1, 2, 8, 16), (1, 2, 8, 16)))
    keep = torch.ones(n_q, 8, dtype=torch.bool, device=DEVICE).tril(8 - n_q) if causal else None  # bottom-right
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, enable_gqa=True).transpose(1, 2)
    got, weights = _call(query=q, key=k, value=v, is_causal=causal)
    assert weights is None and got.is_contiguous()
    _assert_close(got, want, "output (B, N_q, H, d)")
    _assert_close(torch.autograd.grad(got.sum(), q)[0], torch.autograd.grad(want.sum(), q)[0], "dq")


# ----------------------------------------------------------------------------------------------
# What the course refuses, by name


def _tiny_llama(**extra):
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**TINY, **extra),
                                            attn_implementation=hf.DEFAULT_NAME).to(DEVICE)


def test_output_attentions_is_refused():
    ids, _ = _batch()
    with pytest.raises(NotImplementedError, match="output_attentions"):
        _tiny_llama()(ids, output_attentions=True)


def test_dropout_in_training_is_refused():
    ids, _ = _batch()
    model = _tiny_llama(attention_dropout=0.1).train()
    with pytest.raises(NotImplementedError, match=r"dropout \(dropout=0.1"):
        model(ids)
    with torch.no_grad():
        assert model.eval()(ids).logits.shape == (*ids.shape, TINY["vocab_size"])  # eval mode: no dropout


def test_softcapping_is_refused():
    torch.manual_seed(0)
    config = transformers.Gemma2Config(**TINY, sliding_window=WINDOW, attn_logit_softcapping=50.0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=hf.DEFAULT_NAME).to(DEVICE)
    with pytest.raises(NotImplementedError, match="softcapping"):
        model(_batch()[0])


def test_a_custom_4d_mask_is_refused():
    ids, _ = _batch()
    mask = torch.ones(ids.shape[0], 1, SEQ_LEN, SEQ_LEN, dtype=torch.bool, device=DEVICE).tril()
    with pytest.raises(NotImplementedError, match="4-D attention_mask"):
        _tiny_llama()(ids, attention_mask=mask)


def test_packed_sequences_and_bidirectional_masks_are_refused():
    ids, _ = _batch()
    restart = torch.cat([torch.arange(SEQ_LEN // 2), torch.arange(SEQ_LEN - SEQ_LEN // 2)]).to(DEVICE)
    # position_ids that restart without a cache: transformers reads packed sequences
    with pytest.raises(NotImplementedError, match="mask made by"):
        _tiny_llama()(ids, position_ids=restart.expand(ids.shape[0], -1), use_cache=False)
    with pytest.raises(NotImplementedError, match="mask made by"):
        _tiny_llama(is_causal=False)(ids, attention_mask=torch.ones_like(ids))


@pytest.mark.parametrize("kwargs, match", [
    (dict(softcap=30.0), r"softcapping \(softcap=30.0\)"),
    (dict(s_aux=torch.zeros(4)), r"attention sinks \(s_aux"),
    (dict(position_bias=torch.zeros(1, 4, 8, 8)), r"position bias added to the scores \(position_bias"),
    (dict(cu_seq_lens_q=torch.tensor([0, 8])), r"packed batches \(cu_seq_lens_q"),
    (dict(attention_mask=torch.zeros(1, 8)), "float"),
    (dict(attention_mask=torch.ones(1, 8, dtype=torch.bool), is_causal=False), "non-causal"),
    (dict(sliding_window=4, is_causal=False), "non-causal"),
])
def test_refused_arguments_name_themselves(kwargs, match):
    with pytest.raises(NotImplementedError, match=match):
        _call(**kwargs)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="sliding_window must be a positive int"):
        _call(sliding_window=0)
    with pytest.raises(ValueError, match=r"attention_mask must have shape \(B, L\)"):
        _call(attention_mask=torch.ones(2, 8, dtype=torch.bool))


def test_a_window_over_padding_with_holes_is_refused():
    holes = torch.tensor([[1, 1, 0, 1, 1, 1, 1, 1]], dtype=torch.bool, device=DEVICE)
    with pytest.raises(NotImplementedError, match="holes inside a sequence"):
        _call(attention_mask=holes, sliding_window=4)
    without_window = _call(attention_mask=holes)[0]  # without a window, holes are fine
    assert without_window.shape == (1, 8, 4, 16) and not without_window[0, 2].any()


# ----------------------------------------------------------------------------------------------
# A learner's kernel through attention=


def test_a_learners_attention_is_called_and_matches_sdpa():
    calls = []

    def learner(q, k, v, causal, scale):
        calls.append((tuple(q.shape), tuple(k.shape), causal))
        return course_lib.flash_attention(q, k, v, causal=causal, scale=scale)

    name = hf.register("course_learner", attention=learner)
    ref, mine = _models(transformers.LlamaConfig(**TINY), name=name)
    ids, mask = _batch()
    with torch.no_grad():
        want, got = ref(ids, attention_mask=mask).logits, mine(ids, attention_mask=mask).logits
    real = mask.bool()
    _assert_close(got[real], want[real], "logits on real tokens")
    # one call per layer and sequence (a padded batch is unpadded one sequence at a time), GQA kept
    assert len(calls) == TINY["num_hidden_layers"] * len(PROMPTS)
    assert {(c[0][1], c[1][1]) for c in calls} == {(TINY["num_attention_heads"], TINY["num_key_value_heads"])}
    calls.clear()
    kw = dict(max_new_tokens=3, do_sample=False, pad_token_id=TINY["pad_token_id"])
    assert mine.generate(ids[:1], **kw).tolist() == ref.generate(ids[:1], **kw).tolist()
    # the prompt is causal with N_q = N_k; each new token sees the whole cache: causal=False
    assert [c[2] for c in calls] == [True] * 2 + [False] * 4


def test_a_wrong_learners_attention_is_caught():
    def forgets_causal(q, k, v, causal, scale):
        return course_lib.flash_attention(q, k, v, causal=False, scale=scale)

    def wrong_layout(q, k, v, causal, scale):
        return course_lib.flash_attention(q, k, v, causal=causal, scale=scale).transpose(1, 2)

    ids, _ = _batch()
    ref, wrong = _models(transformers.LlamaConfig(**TINY), name=hf.register("course_wrong", attention=forgets_causal))
    with torch.no_grad():
        assert not torch.allclose(wrong(ids).logits, ref(ids).logits, atol=1e-3), "the comparison must catch it"
    _, bad_shape = _models(transformers.LlamaConfig(**TINY), name=hf.register("course_bad_shape", attention=wrong_layout))
    with pytest.raises(ValueError, match=r"attention must return o shaped like q"):
        bad_shape(ids)
    name = hf.register("course_no_window", attention=lambda q, k, v, causal, scale: course_lib.flash_attention(
        q, k, v, causal=causal, scale=scale))
    _, windowed = _models(_config("mistral"), name=name)
    with pytest.raises(NotImplementedError, match="sliding window"):
        windowed(ids)


def test_register_checks_its_arguments():
    assert hf.register() == hf.DEFAULT_NAME
    model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**TINY), attn_implementation="sdpa")
    model.set_attn_implementation(hf.DEFAULT_NAME)
    assert model.config._attn_implementation == hf.DEFAULT_NAME
    with pytest.raises(ValueError, match="transformers' own"):
        hf.register("sdpa")
    with pytest.raises(ValueError, match="letters, digits"):
        hf.register("org/kernel")
    with pytest.raises(TypeError, match="attention must be None or a callable"):
        hf.register("course_x", attention="flash")


# ----------------------------------------------------------------------------------------------
# On the GPU: bfloat16, where the two implementations round differently


def _error(model, ids, mask, want) -> float:
    with torch.no_grad():
        return (model(ids, attention_mask=mask).logits.float() - want)[mask.bool()].abs().max().item()


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["llama", *sorted(SLIDING)])
def test_gpu_bf16_logits_within_sdpas_error(family):
    config = _config(family)
    exact, _ = _models(config, "cuda", torch.float32)
    ref, mine = _models(config, "cuda", torch.bfloat16)
    ids, mask = _batch(device="cuda")
    with torch.no_grad():
        want = exact(ids, attention_mask=mask).logits
    sdpa_error, course_error = _error(ref, ids, mask, want), _error(mine, ids, mask, want)
    assert course_error <= BF16_ERROR_FACTOR * sdpa_error, (course_error, sdpa_error)


@pytest.mark.gpu
def test_gpu_bf16_gradients_within_sdpas_error():
    exact, _ = _models(transformers.LlamaConfig(**TINY), "cuda", torch.float32)
    ref, mine = _models(transformers.LlamaConfig(**TINY), "cuda", torch.bfloat16)
    ids, mask = _batch(device="cuda")
    labels = ids.masked_fill(mask == 0, -100)
    for model in (exact, ref, mine):
        model(ids, attention_mask=mask, labels=labels).loss.backward()
    want, sdpa = dict(exact.named_parameters()), dict(ref.named_parameters())
    for name, p in mine.named_parameters():
        sdpa_error = (sdpa[name].grad.float() - want[name].grad).norm().item()
        course_error = (p.grad.float() - want[name].grad).norm().item()
        assert course_error <= BF16_ERROR_FACTOR * sdpa_error, (name, course_error, sdpa_error)


@pytest.mark.gpu
def test_gpu_bf16_greedy_generation_is_sdpas_up_to_near_ties(monkeypatch):
    """Each token the course picks is SDPA's pick, or one whose SDPA logit is within the two
    implementations' own logit difference of SDPA's best (a near tie that rounding may flip)."""
    ref, mine = _models(transformers.LlamaConfig(**TINY), "cuda", torch.bfloat16)
    ids, mask = _batch(PROMPTS[:2], device="cuda")
    decode = _count_calls(monkeypatch, kdec, "flash_decode_triton")
    got = mine.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False,
                        pad_token_id=TINY["pad_token_id"])
    single = mine.generate(ids[:1], max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=TINY["pad_token_id"])
    assert decode[0] == (NEW_TOKENS - 1) * TINY["num_hidden_layers"]  # only the unpadded run decodes
    for seq, seq_mask in ((got, F.pad(mask, (0, NEW_TOKENS), value=1)), (single, None)):
        with torch.no_grad():  # teacher-forced on the course's tokens: the logits that chose each one
            theirs = ref(seq, attention_mask=seq_mask).logits[:, SEQ_LEN - 1:-1].float()
            ours = mine(seq, attention_mask=seq_mask).logits[:, SEQ_LEN - 1:-1].float()
        picked = theirs.gather(-1, seq[:, SEQ_LEN:, None]).squeeze(-1)
        # the two implementations' own difference, and at least one bf16 step of the best logit
        # (generation reads the cached keys, teacher forcing the whole sequence: one rounding apart)
        step = torch.finfo(torch.bfloat16).eps * theirs.abs().amax(-1)
        margin = torch.maximum((ours - theirs).abs().amax(-1), step) * 2
        assert (picked >= theirs.amax(-1) - margin).all()

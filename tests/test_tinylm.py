"""The tiny language model of chapter 07: determinism, the attention plug, and the end-to-end
agreement of course_lib.flash_attention with SDPA when training."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from course_lib.platform import runtime
from course_lib.integrations import tinylm

pytestmark = pytest.mark.ch07

SMALL = dict(seq_len=16, d_model=32, n_heads=2, n_layers=1)


@pytest.fixture(scope="module")
def dataset():
    return tinylm.CharDataset()


def make(dataset, attention, seed=0, **sizes):
    config = tinylm.TinyLMConfig(vocab_size=dataset.vocab_size, **{**SMALL, **sizes})
    # on the device the kernels run on: CUDA in GPU mode, CPU for the interpreter
    return tinylm.TinyLM(config, attention, seed=seed).to(runtime.current().device)


def test_batches_are_deterministic_and_shifted(dataset):
    x1, y1 = dataset.batch(3, 20, torch.Generator().manual_seed(5))
    x2, y2 = dataset.batch(3, 20, torch.Generator().manual_seed(5))
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert x1.shape == y1.shape == (3, 20)
    assert torch.equal(x1[:, 1:], y1[:, :-1])  # y is the next token of x
    x3, _ = dataset.batch(3, 20, torch.Generator().manual_seed(6))
    assert not torch.equal(x1, x3)


def test_windows_longer_than_the_text_wrap_around(dataset):
    n = len(dataset.tokens)
    x, y = dataset.batch(2, n + 7, torch.Generator().manual_seed(0))
    assert x.shape == (2, n + 7)
    assert torch.equal(x[:, :7], x[:, n:n + 7])  # the text repeats after n tokens
    assert dataset.decode(x[0, :n]) in tinylm.TEXT * 2


def test_same_seed_same_weights_whatever_the_attention(dataset):
    a = make(dataset, tinylm.sdpa_attention, seed=3)
    b = make(dataset, tinylm.flash_attention_causal, seed=3)
    c = make(dataset, tinylm.sdpa_attention, seed=4)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), name
    assert any(not torch.equal(pa, pc) for pa, pc in zip(a.parameters(), c.parameters()))


def test_model_init_leaves_the_global_rng_alone(dataset):
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    make(dataset, tinylm.sdpa_attention, seed=9)
    assert torch.equal(torch.rand(3), expected)


def test_the_attention_function_is_the_one_called(dataset):
    calls = []

    def spy(q, k, v):
        calls.append(q.shape)
        return tinylm.sdpa_attention(q, k, v)

    model = make(dataset, spy, n_layers=2)
    x, y = dataset.batch(2, 16, torch.Generator().manual_seed(0))
    model.loss(x.to(runtime.current().device), y.to(runtime.current().device))
    assert calls == [(2, 2, 16, 16)] * 2  # (B, H, T, d) once per layer


def test_training_lowers_the_loss(dataset):
    losses = tinylm.train(make(dataset, tinylm.sdpa_attention), steps=30, seed=1, batch_size=8)
    assert len(losses) == 30 and all(isinstance(x, float) for x in losses)
    assert sum(losses[-5:]) / 5 < losses[0] - 0.5


def test_same_seed_same_losses(dataset):
    first = tinylm.train(make(dataset, tinylm.sdpa_attention), steps=5, seed=2)
    again = tinylm.train(make(dataset, tinylm.sdpa_attention), steps=5, seed=2)
    assert first == again


def test_flash_attention_trains_like_sdpa(dataset):
    # The end-to-end check of chapter 07 at a tiny size: same seed, same losses within the
    # stated tolerance, through the Triton forward and backward kernels.
    steps = 3
    flash = tinylm.train(make(dataset, tinylm.flash_attention_causal, seed=7), steps, seed=7, batch_size=1)
    sdpa = tinylm.train(make(dataset, tinylm.sdpa_attention, seed=7), steps, seed=7, batch_size=1)
    tolerance = tinylm.loss_tolerance(runtime.current().on_gpu)
    assert max(abs(a - b) for a, b in zip(flash, sdpa)) <= tolerance


def test_the_comparison_can_fail(dataset):
    # A non-causal attention (it sees the future) must not pass as equal to causal SDPA.
    def peeks(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=False)

    wrong = tinylm.train(make(dataset, peeks), 3, seed=7)
    right = tinylm.train(make(dataset, tinylm.sdpa_attention), 3, seed=7)
    assert max(abs(a - b) for a, b in zip(wrong, right)) > tinylm.LOSS_ATOL_GPU


def test_run_sizes_are_valid_configs(dataset):
    for on_gpu in (False, True):
        size = tinylm.run_size(on_gpu)
        config = tinylm.TinyLMConfig(vocab_size=dataset.vocab_size, **size.model)
        assert size.steps >= 1 and size.batch_size >= 1
        assert config.head_dim >= 16  # the kernel's smallest head dim
    assert tinylm.loss_tolerance(True) >= tinylm.loss_tolerance(False)


@pytest.mark.parametrize("kwargs,match", [
    (dict(d_model=30, n_heads=4), "divisible by n_heads"),
    (dict(n_layers=0), "n_layers must be a positive int"),
    (dict(seq_len=2.5), "seq_len must be a positive int"),
])
def test_bad_config_is_named(dataset, kwargs, match):
    with pytest.raises(ValueError, match=match):
        tinylm.TinyLMConfig(vocab_size=dataset.vocab_size, **{**SMALL, **kwargs})


def test_bad_arguments_are_named(dataset):
    config = tinylm.TinyLMConfig(vocab_size=dataset.vocab_size, **SMALL)
    with pytest.raises(TypeError, match="attention must be a function"):
        tinylm.TinyLM(config, "sdpa")
    model = tinylm.TinyLM(config, tinylm.sdpa_attention)
    with pytest.raises(ValueError, match="steps must be a positive int"):
        tinylm.train(model, 0)
    with pytest.raises(ValueError, match="vocab_size"):
        tinylm.train(model, 1, dataset=tinylm.CharDataset("abcabc"))
    with pytest.raises(ValueError, match="context is 16"):
        model(torch.zeros(1, 17, dtype=torch.long))
    with pytest.raises(ValueError, match="at least two distinct characters"):
        tinylm.CharDataset("aaaa")
    with pytest.raises(ValueError, match="batch_size must be a positive int"):
        tinylm.CharDataset().batch(0, 4, torch.Generator())

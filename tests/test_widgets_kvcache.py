"""The KV-cache calculator, driven without a browser: set controls, read the numbers and plot."""

from __future__ import annotations

import numpy as np
import pytest

from course_lib.attention import kvcache
from course_lib.platform.hardware import GPUS
from course_lib.teaching.widgets._display import FIGSIZE
from course_lib.teaching.widgets.kvcache import KVCacheCalculator

pytestmark = pytest.mark.ch08

MHA = "7B, multi-head (Llama-2-7B shape)"
GQA = "7B, GQA with 8 KV heads (Mistral-7B shape)"
BIG = "70B, GQA with 8 KV heads (Llama-2-70B shape)"


@pytest.fixture
def w():
    return KVCacheCalculator(model=MHA, seq_len=4096, batch=8, dtype="float16", gpu="H100 SXM",
                             reserve_weights=False)


def test_initial_numbers_match_the_formula(w):
    assert w.cache_bytes == 2 * 32 * 32 * 128 * 4096 * 8 * 2  # 16 GiB
    assert w.per_token_bytes == 512 * 1024
    assert w.max_tokens == int(GPUS["H100 SXM"].memory_bytes // (512 * 1024))
    assert w.max_batch == w.max_tokens // 4096 and w.max_context == w.max_tokens // 8
    assert "17.18 GB" in w.summary.value and "16.00 GiB" in w.summary.value
    assert "fits" in w.summary.value and "does not" not in w.summary.value
    assert w.image.value[:4] == b"\x89PNG"
    assert tuple(w.fig.get_size_inches()) == FIGSIZE


def test_plotted_lines(w):
    n, chosen = w.lines["chosen"].get_data()
    _, mha = w.lines["mha"].get_data()
    _, mqa = w.lines["mqa"].get_data()
    np.testing.assert_array_equal(chosen, mha)  # 32 of 32 heads cached
    np.testing.assert_allclose(mqa * 32, mha)
    slope = np.polyfit(np.log(n), np.log(chosen), 1)[0]
    assert slope == pytest.approx(1.0)  # linear in the context length
    assert w.lines["gpu"].get_ydata()[0] == GPUS["H100 SXM"].memory_bytes
    x, y = w.lines["point"].get_data()
    assert x[0] == 4096 and y[0] == w.cache_bytes
    assert w.ax.get_xscale() == "log" and w.ax.get_yscale() == "log"


def test_kv_heads_batch_context_and_dtype_scale_the_cache(w):
    base = w.cache_bytes
    w.kv_heads.value = 8
    assert w.cache_bytes == base / 4
    w.batch.value = 16
    assert w.cache_bytes == base / 2
    w.seq_len.value = 8192
    assert w.cache_bytes == base
    w.dtype.value = "float32"
    assert w.cache_bytes == 2 * base
    w.dtype.value = "fp8"
    assert w.cache_bytes == base / 2
    assert "8 K/V heads" in w.ax.get_title()


def test_model_change_resets_the_kv_head_choices(w):
    w.model.value = GQA
    assert w.kv_heads.value == 8 and tuple(w.kv_heads.options) == (1, 2, 4, 8, 16, 32)
    assert w.cache_bytes == kvcache.MODELS[GQA].kv_bytes(4096, 8)
    w.model.value = BIG
    assert 64 in w.kv_heads.options and w.kv_heads.value == 8
    assert "80 layers" in w.ax.get_title()


def test_weights_and_gpu(w):
    free = w.max_tokens
    w.reserve_weights.value = True
    assert w.available_bytes == pytest.approx(GPUS["H100 SXM"].memory_bytes - 6.74e9 * 2)
    assert w.max_tokens < free and "weights" in w.summary.value
    w.gpu.value = "RTX 4090"
    assert w.lines["gpu"].get_ydata()[0] == GPUS["RTX 4090"].memory_bytes
    assert w.max_tokens < free / 4
    w.seq_len.value = 2**17
    assert "does not fit" in w.summary.value
    w.model.value = BIG  # 138 GB of weights on a 24 GB card
    assert w.max_tokens == 0 and "weights alone do not fit" in w.summary.value


def test_controls_are_labelled(w):
    for control in w.controls:
        assert control.description
    assert w.widget() is not None


@pytest.mark.parametrize("kwargs, match", [
    (dict(model="GPT-5"), "model"), (dict(seq_len=1000), "seq_len"), (dict(batch=0), "batch"),
    (dict(dtype="int8"), "dtype"), (dict(kv_heads=3), "kv_heads"), (dict(gpu="TPU"), "gpu"),
])
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        KVCacheCalculator(**kwargs)

"""course_lib.attention.kvcache: the KV-cache size formula, the model presets and how many tokens fit."""

from __future__ import annotations

import pytest

from course_lib.attention import kvcache as kc

pytestmark = pytest.mark.ch08


def test_kv_cache_formula_and_the_readings_numbers():
    # Llama-2-70B shape counted as multi-head (the reading's assumption): 32 KiB per token/layer
    per_token_layer = kc.kv_cache_bytes(1, layers=1, kv_heads=64, head_dim=128)
    assert per_token_layer == 32 * 1024
    seq = kc.kv_cache_bytes(4096, layers=80, kv_heads=64, head_dim=128)
    assert seq == 10_737_418_240  # 10.7 GB = 10.0 GiB (the reading's "10.5 GB" mixes units)
    big = kc.kv_cache_bytes(2048, layers=80, kv_heads=64, head_dim=128, batch=512)
    assert big / 1e12 == pytest.approx(2.75, abs=0.01)  # "~2.7 TB"
    # GQA with 8 K/V heads: 8 times less
    assert kc.MODELS["70B, GQA with 8 KV heads (Llama-2-70B shape)"].kv_bytes(4096) == seq // 8
    assert kc.kv_cache_bytes(10, layers=2, kv_heads=3, head_dim=4, batch=5, dtype="float32") == \
        2 * 2 * 3 * 4 * 10 * 5 * 4
    assert kc.kv_cache_bytes(10, layers=2, kv_heads=3, head_dim=4, dtype="fp8") == 2 * 2 * 3 * 4 * 10


def test_max_cached_tokens():
    per_token = kc.kv_cache_bytes_per_token(layers=32, kv_heads=32, head_dim=128)
    assert per_token == 512 * 1024
    assert kc.max_cached_tokens(10 * per_token + 5, layers=32, kv_heads=32, head_dim=128) == 10
    assert kc.max_cached_tokens(10 * per_token, layers=32, kv_heads=32, head_dim=128,
                                reserved_bytes=11 * per_token) == 0


@pytest.mark.parametrize("call, match", [
    (lambda: kc.kv_cache_bytes(0, layers=1, kv_heads=1, head_dim=1), "seq_len"),
    (lambda: kc.kv_cache_bytes(8, layers=-1, kv_heads=1, head_dim=1), "layers"),
    (lambda: kc.kv_cache_bytes(8, layers=1, kv_heads=0, head_dim=1), "kv_heads"),
    (lambda: kc.kv_cache_bytes(8, layers=1, kv_heads=1, head_dim=1, batch=0), "batch"),
    (lambda: kc.kv_cache_bytes(8, layers=1, kv_heads=1, head_dim=1, dtype="int4"), "dtype"),
    (lambda: kc.max_cached_tokens(0, layers=1, kv_heads=1, head_dim=1), "memory_bytes"),
])
def test_size_errors_name_the_argument(call, match):
    with pytest.raises((ValueError, TypeError), match=match):
        call()


def test_model_presets_are_consistent():
    for shape in kc.MODELS.values():
        assert shape.n_heads % shape.n_kv_heads == 0 and shape.source
        assert shape.group == shape.n_heads // shape.n_kv_heads

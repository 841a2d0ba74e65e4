"""The teaching kernel (course_lib/kernels/teaching.py) computes what the library kernel computes.

Both are built on course_lib/kernels/tiles.py; these tests pin the two together on the shapes
that break kernels: ragged lengths, N_q != N_k, causal, leading dims, strided views.
"""

import pytest

from course_lib.platform import runtime

runtime.ensure_configured()

import torch  # noqa: E402

from course_lib.kernels import teaching, tiles, tuning  # noqa: E402
from course_lib.kernels.forward import attention_forward  # noqa: E402

pytestmark = pytest.mark.ch06

DTYPE = torch.float32 if runtime.current().interpreted else torch.float16
ATOL = {torch.float32: 1e-5, torch.float16: 2e-3}[DTYPE]


def _qkv(batch, heads, n_q, n_k, d, seed=0):
    gen = torch.Generator().manual_seed(seed)
    device = runtime.current().device
    return [torch.randn(batch, heads, n, d, generator=gen).to(device=device, dtype=DTYPE)
            for n in (n_q, n_k, n_k)]


@pytest.mark.parametrize("batch, heads, n_q, n_k, d, causal", [
    (2, 3, 45, 93, 32, True),    # ragged, more keys than queries
    (1, 2, 100, 37, 16, True),   # ragged, late query rows see every key
    (2, 1, 77, 77, 64, True),
    (1, 2, 53, 21, 16, False),
])
def test_teaching_kernel_matches_library_kernel(batch, heads, n_q, n_k, d, causal):
    q, k, v = _qkv(batch, heads, n_q, n_k, d)
    scale = 0.3
    o_teach, lse_teach = teaching.forward(q, k, v, causal, scale, blocks=(16, 32))
    o_lib, lse_lib = attention_forward(q, k, v, causal, scale, tuning.Blocks(32, 16))
    torch.testing.assert_close(o_teach, o_lib, atol=ATOL, rtol=1e-3)
    torch.testing.assert_close(lse_teach, lse_lib.float(), atol=1e-4, rtol=1e-4)


def test_teaching_kernel_reads_strided_4d_views():
    q, k, v = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in _qkv(2, 3, 37, 29, 16))
    assert q.stride(1) < q.stride(2)  # (B, N, H, d) memory seen as (B, H, N, d)
    o_teach, lse_teach = teaching.forward(q, k, v, True, blocks=(16, 16))
    o_lib, lse_lib = attention_forward(q, k, v, True, 16 ** -0.5, tuning.Blocks(16, 16))
    torch.testing.assert_close(o_teach, o_lib, atol=ATOL, rtol=1e-3)
    torch.testing.assert_close(lse_teach, lse_lib.float(), atol=1e-4, rtol=1e-4)


def test_exercise_6_3_piece_is_the_library_loop_end():
    assert teaching.LIBRARY_PIECES.kv_loop_end is tiles.kv_loop_end

"""course_lib.kernels.primer: the vector-add, row-softmax and matmul kernels, their wrappers and validation."""

import pytest

from course_lib.platform import runtime

runtime.ensure_configured()

import torch  # noqa: E402
from hypothesis import given, settings, strategies as st  # noqa: E402

from course_lib.kernels import primer  # noqa: E402

pytestmark = pytest.mark.ch05

# Results are compared with a float64 oracle rounded to the input dtype; fp32 softmax keeps
# ~7 significant digits, fp16 ~3.
ATOL = {torch.float32: 1e-6, torch.float16: 1e-3}


@pytest.mark.parametrize("n", [1, 97, 1823, 1024, 4099])
def test_vector_add_matches_reference_on_ragged_lengths(n, device):
    gen = torch.Generator().manual_seed(n)
    x, y = (torch.randn(n, generator=gen).to(device) for _ in range(2))
    torch.testing.assert_close(primer.vector_add(x, y, block_size=256),
                               primer.vector_add_reference(x, y), atol=0, rtol=0)


@settings(max_examples=15, deadline=None)
@given(rows=st.integers(1, 9), cols=st.integers(1, 300), gap=st.integers(0, 5),
       half=st.booleans(), scale=st.sampled_from([1.0, 50.0]))
def test_row_softmax_matches_reference_on_strided_irregular_rows(rows, cols, gap, half, scale):
    device = runtime.current().device
    dtype = torch.float16 if half else torch.float32
    wide = scale * torch.randn(rows, cols + gap, generator=torch.Generator().manual_seed(cols))
    x = wide.to(dtype).to(device)[:, :cols]  # rows are strided when gap > 0
    got = primer.row_softmax(x)
    assert got.shape == x.shape and got.dtype == dtype and got.is_contiguous()
    torch.testing.assert_close(got, primer.row_softmax_reference(x), atol=ATOL[dtype], rtol=0)


def test_row_softmax_irregular_shape_from_the_triton_tutorial(device):
    x = torch.randn(1823, 781, generator=torch.Generator().manual_seed(0)).to(device)[:64]
    torch.testing.assert_close(primer.row_softmax(x), primer.row_softmax_reference(x),
                               atol=1e-6, rtol=0)


# fp32 dots are exact in the interpreter but TF32 (10 mantissa bits) on a GPU; fp16 results are
# rounded once from an fp32 accumulator. Tolerances relative to |A| |B| sqrt(K) ~ the output scale.
MATMUL_RTOL = {torch.float32: 1e-5, torch.float16: 2e-3}
MATMUL_GPU_FP32_RTOL = 2e-3  # TF32


@pytest.mark.parametrize("m, k, n", [(77, 45, 61), (64, 64, 64), (5, 7, 3), (1, 130, 1),
                                     (100, 16, 33)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_matmul_matches_torch_on_irregular_shapes(m, k, n, dtype, device):
    gen = torch.Generator().manual_seed(m * k * n)
    a = torch.randn(m, k, generator=gen).to(device, dtype)
    b = torch.randn(k, n, generator=gen).to(device, dtype)
    got = primer.matmul(a, b, block_m=32, block_n=16, block_k=16)
    assert got.shape == (m, n) and got.dtype == dtype and got.is_contiguous()
    want = torch.matmul(a.double(), b.double())
    rtol = MATMUL_GPU_FP32_RTOL if runtime.current().on_gpu else MATMUL_RTOL[dtype]
    scale = k ** 0.5  # the typical size of an entry of a @ b for randn inputs
    torch.testing.assert_close(got.double(), want, atol=rtol * scale, rtol=0)


def test_matmul_follows_strides_of_transposed_and_sliced_views(device):
    gen = torch.Generator().manual_seed(3)
    a = torch.randn(45, 77, generator=gen).to(device).t()           # (77, 45), column-major
    b = torch.randn(45, 90, generator=gen).to(device)[:, ::2][:, :33]  # (45, 33), strided columns
    got = primer.matmul(a, b)
    assert not a.is_contiguous() and not b.is_contiguous()
    rtol = MATMUL_GPU_FP32_RTOL if runtime.current().on_gpu else MATMUL_RTOL[torch.float32]
    torch.testing.assert_close(got, torch.matmul(a, b), atol=rtol * 45 ** 0.5, rtol=0)


def test_matmul_grid_has_one_program_per_output_tile():
    assert primer.matmul_grid(77, 61, 32, 16) == (3, 4)
    assert primer.matmul_grid(64, 64, 64, 64) == (1, 1)


@pytest.mark.gpu
def test_matmul_bf16_on_the_gpu():
    gen = torch.Generator().manual_seed(0)
    a, b = (torch.randn(s, generator=gen).cuda().bfloat16() for s in ((77, 45), (45, 61)))
    torch.testing.assert_close(primer.matmul(a, b).float(), (a.float() @ b.float()),
                               atol=3e-2 * 45 ** 0.5, rtol=0)


def test_softmax_block_size_is_the_next_power_of_two():
    assert [primer.softmax_block_size(n) for n in (1, 5, 128, 781)] == [1, 8, 128, 1024]


@pytest.mark.parametrize("call, error, message", [
    (lambda: primer.vector_add([1.0], torch.ones(1)), TypeError, "x must be a torch.Tensor"),
    (lambda: primer.vector_add(torch.ones(3), torch.ones(4)), ValueError, "same length"),
    (lambda: primer.vector_add(torch.ones(3), torch.ones(3).half()), TypeError, "same dtype"),
    (lambda: primer.vector_add(torch.ones(2, 3), torch.ones(2, 3)), ValueError, "must be 1-D"),
    (lambda: primer.vector_add(torch.ones(3, dtype=torch.int32), torch.ones(3)), TypeError,
     "float32, float16 or bfloat16"),
    (lambda: primer.vector_add(torch.ones(8)[::2], torch.ones(4)), ValueError, "contiguous"),
    (lambda: primer.vector_add(torch.ones(3), torch.ones(3), block_size=100), ValueError,
     "power of two"),
    (lambda: primer.row_softmax(torch.ones(3)), ValueError, r"2-D \(n_rows, n_cols\)"),
    (lambda: primer.row_softmax(torch.ones(0, 3)), ValueError, "at least one row"),
    (lambda: primer.row_softmax(torch.ones(2, primer.MAX_ROW_WIDTH + 1)), ValueError,
     "do not fit one program"),
    (lambda: primer.row_softmax(torch.ones(4, 3).t()), ValueError, "contiguous"),
    (lambda: primer.matmul(torch.ones(3, 4), torch.ones(3, 4)), ValueError,
     r"inner dimensions differ: a is \(3, 4\), b is \(3, 4\)"),
    (lambda: primer.matmul(torch.ones(3), torch.ones(3, 4)), ValueError, r"2-D, \(M, K\)"),
    (lambda: primer.matmul(torch.ones(3, 4), torch.ones(4, 2).half()), TypeError, "same dtype"),
    (lambda: primer.matmul(torch.ones(3, 0), torch.ones(0, 2)), ValueError, "must not be empty"),
    (lambda: primer.matmul(torch.ones(3, 4), [[1.0]]), TypeError, "b must be a torch.Tensor"),
    (lambda: primer.matmul(torch.ones(3, 4), torch.ones(4, 2), block_k=8), ValueError,
     r"block_k must be a power of two >= 16"),
    (lambda: primer.matmul(torch.ones(3, 4), torch.ones(4, 2), block_m=48), ValueError,
     "block_m must be a power of two"),
])
def test_bad_inputs_get_a_clear_error(call, error, message):
    if runtime.current().on_gpu:
        pytest.skip("these inputs are CPU tensors; the GPU run checks device errors instead")
    with pytest.raises(error, match=message):
        call()


def test_bf16_is_refused_in_the_interpreter_with_a_reason():
    if runtime.current().on_gpu:
        pytest.skip("bf16 is supported on the GPU")
    with pytest.raises(TypeError, match="interpreter computes wrongly"):
        primer.row_softmax(torch.ones(2, 3, dtype=torch.bfloat16))


@pytest.mark.gpu
def test_cpu_tensors_are_refused_on_the_gpu():
    with pytest.raises(ValueError, match="device=rt.device"):
        primer.vector_add(torch.ones(3), torch.ones(3))

"""course_lib.primer: the vector-add and row-softmax kernels, their wrappers and validation."""

import pytest

from course_lib import runtime

runtime.ensure_configured()

import torch  # noqa: E402
from hypothesis import given, settings, strategies as st  # noqa: E402

from course_lib import primer  # noqa: E402

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

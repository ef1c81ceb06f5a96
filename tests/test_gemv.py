"""The C++ GEMV kernel (csrc/gemv.cpp) computes x @ W^T + b like torch, and Linear routes rows to it or oneDNN."""

from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F

from gpuservd.runner.linear import GEMV_MAX_ROWS, Linear, onednn_available

# Odd sizes (tails of in % 8, rows that leave a partial register block), SmolLM2's shapes,
# and a long row (the prefetch distance in rows drops to the minimum).
SHAPES = [(1, 1), (7, 13), (5, 8), (33, 17), (960, 576), (576, 1536), (130, 4099)]


def _reference(x, w, b):
    """fp64 x @ W^T + b: the exact answer both torch and the kernel round away from."""
    y = x.double() @ w.double().t()
    return y if b is None else y + b.double()


@pytest.mark.parametrize("out_f,in_f", SHAPES)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8])
@pytest.mark.parametrize("bias", [False, True])
def test_fp32_matches_torch(ops, out_f, in_f, rows, bias):
    g = torch.Generator().manual_seed(out_f * 1000 + in_f * 10 + rows)
    x, w = torch.randn(rows, in_f, generator=g), torch.randn(out_f, in_f, generator=g)
    b = torch.randn(out_f, generator=g) if bias else None
    y = ops.gemv(x, w, b)
    assert y.shape == (rows, out_f) and y.dtype == torch.float32
    # As close to torch as torch is to the exact answer: fp32 rounding, summation order only.
    torch.testing.assert_close(y, F.linear(x, w, b), atol=2e-5 * in_f ** 0.5, rtol=1e-5)
    ref = _reference(x, w, b)
    # torch's own error depends on how many threads split the sum (MKL: 5.6e-5 at 1 thread, 1.4e-4 at 2 for
    # 7 x 4099 -> 130), and earlier tests leave the count where they set it: measure torch at the engine's 2.
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        torch_err = (F.linear(x, w, b).double() - ref).abs().max()
    finally:
        torch.set_num_threads(before)
    assert (y.double() - ref).abs().max() <= 2 * torch_err + 1e-5


@pytest.mark.parametrize("rows", [9, 16, 32, 37])
def test_more_rows_than_a_register_block(ops, rows):
    x, w, b = torch.randn(rows, 96), torch.randn(70, 96), torch.randn(70)
    torch.testing.assert_close(ops.gemv(x, w, b), F.linear(x, w, b), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, dict(atol=3e-2, rtol=1e-2)),
                                       (torch.float16, dict(atol=4e-3, rtol=2e-3))])
@pytest.mark.parametrize("rows", [1, 4, 7])
def test_half_dtypes_accumulate_in_fp32(ops, dtype, tol, rows):
    g = torch.Generator().manual_seed(rows)
    x, w, b = (torch.randn(rows, 200, generator=g) / 4).to(dtype), (torch.randn(45, 200, generator=g) / 4).to(dtype), \
        torch.randn(45, generator=g).to(dtype)
    y = ops.gemv(x, w, b)
    assert y.dtype == dtype
    # One rounding of the fp32 result: compare with the fp32 matmul of the same (rounded) inputs.
    torch.testing.assert_close(y.float(), F.linear(x.float(), w.float(), b.float()), **tol)


def test_x_with_a_row_stride(ops):
    """A row slice of a wider tensor (unit column stride, row stride > in) is read in place."""
    big = torch.randn(3, 100)
    x = big[:, 10:74]
    w = torch.randn(20, 64)
    torch.testing.assert_close(ops.gemv(x, w, None), F.linear(x, w), atol=1e-5, rtol=1e-5)


def test_empty_and_bad_input(ops):
    w = torch.randn(8, 16)
    assert ops.gemv(torch.randn(0, 16), w, None).shape == (0, 8)
    with pytest.raises(RuntimeError, match="gemv"):
        ops.gemv(torch.randn(2, 15), w, None)
    with pytest.raises(RuntimeError, match="dtypes differ"):
        ops.gemv(torch.randn(2, 16, dtype=torch.float64), w, None)
    with pytest.raises(RuntimeError, match="bias"):
        ops.gemv(torch.randn(2, 16), w, torch.randn(7))


@pytest.mark.parametrize("use_onednn", [False, True])
def test_linear_routes_rows_and_keeps_one_dense_weight(ops, use_onednn):
    """The dense layout (GPUSERV_PACKED_WEIGHTS=0; fp32 takes column panels by default, test_packed_gemm_f32.py)."""
    if use_onednn and not onednn_available(torch.device("cpu"), torch.float32):
        pytest.skip("torch built without oneDNN")
    w, b = torch.randn(48, 40), torch.randn(48)
    lin = Linear(w, b, use_onednn=use_onednn, use_packed=False)
    assert lin.gemv and lin.weight is w and lin.bias is b and lin.onednn == use_onednn
    assert lin.nbytes == (48 * 40 + 48) * 4
    for rows in (1, 5, GEMV_MAX_ROWS, GEMV_MAX_ROWS + 1, 64, 65, 100):
        x = torch.randn(rows, 40)
        torch.testing.assert_close(lin(x), F.linear(x, w, b), atol=1e-4, rtol=1e-5)


def test_linear_without_the_kernel_uses_torch():
    w = torch.randn(12, 8)
    lin = Linear(w, None, use_gemv=False, use_packed=False)
    assert not lin.gemv
    x = torch.randn(3, 8)
    torch.testing.assert_close(lin(x), F.linear(x, w))

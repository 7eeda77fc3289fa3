"""The dense decode GEMV against a float32 product: shapes, biases, groups of up to three weights."""

import pytest
import torch

from moegraph.kernels import triton_available
from moegraph.kernels.gemv import linear_gemv, linear_gemv_group, linear_gemv_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(not triton_available(torch.empty(0, device=DEVICE)), reason="Triton cannot run here")


def _randn(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE, dtype)


@pytest.mark.parametrize("rows, n, k", [(1, 24, 48), (3, 9, 700), (2, 40, 1024), (8, 12, 300), (5, 7, 2048)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_gemv_matches_float32_product(rows, n, k, with_bias):
    x, w = _randn(rows, k, seed=1), _randn(n, k, seed=2)
    bias = _randn(n, seed=3) if with_bias else None
    torch.testing.assert_close(linear_gemv(x, w, bias), linear_gemv_ref(x, w, bias), atol=1e-4, rtol=1e-4)


def test_gemv_group_equals_one_call_per_weight():
    x = _randn(2, 64, seed=4)
    weights = [_randn(n, 64, seed=5 + n) for n in (32, 8, 8)]
    biases = [_randn(w.shape[0], seed=9) for w in weights]
    for got, w, b in zip(linear_gemv_group(x, weights, biases), weights, biases):
        assert torch.equal(got, linear_gemv(x, w, b))  # same tiles, same sums: bit for bit


def test_gemv_bf16_rounds_once():
    x, w = _randn(1, 256, dtype=torch.bfloat16, seed=6), _randn(48, 256, dtype=torch.bfloat16, seed=7)
    want = linear_gemv_ref(x, w)
    torch.testing.assert_close(linear_gemv(x, w).float(), want.float(), atol=3e-2, rtol=1e-2)


def test_gemv_refuses_a_weight_of_another_shape_or_dtype():
    x = _randn(1, 32)
    with pytest.raises(ValueError, match="does not take x"):
        linear_gemv(x, _randn(8, 16))
    with pytest.raises(ValueError, match="does not take x"):
        linear_gemv(x, _randn(8, 32, dtype=torch.float16))

"""The dense decode GEMV against a float32 product: shapes, biases, groups of up to three weights."""

import pytest
import torch

from moegraph.kernels import triton_available
from moegraph.kernels.gemv import (add_rms_norm_gemv, add_rms_norm_gemv_group, add_rms_norm_gemv_group_ref, linear_gemv, linear_gemv_group,
                                   linear_gemv_ref)
from moegraph.kernels.rms_norm import add_rms_norm, rms_norm

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


@pytest.mark.parametrize("rows, k, dtype", [(1, 64, torch.float32), (3, 96, torch.bfloat16), (4, 1100, torch.float32),
                                            (2, 2048, torch.bfloat16)])
@pytest.mark.parametrize("add", [True, False])
def test_add_rms_norm_in_front_of_the_gemv_group(rows, k, dtype, add):
    """The norm before attention fused into the q/k/v GEMV: the summed residual exactly, the projections as the
    norm kernel followed by the GEMV (bit for bit where the sums run in the same order: the interpreter), and
    close to float32 products of rms_norm's reference."""
    residual, x = _randn(rows, k, dtype=dtype, seed=10), _randn(rows, k, dtype=dtype, seed=11) if add else None
    norm_weight = (1 + 0.1 * _randn(k, seed=12)).to(dtype)
    weights = [0.05 * _randn(n, k, dtype=dtype, seed=13 + n) for n in (16, 8, 8)]
    summed, outs = add_rms_norm_gemv_group(residual, x, norm_weight, 1e-6, weights)
    if add:
        want_summed, hidden = add_rms_norm(residual, x, norm_weight, 1e-6)
        assert torch.equal(summed, want_summed)
    else:
        hidden = rms_norm(residual, norm_weight, 1e-6)
        assert summed is residual or torch.equal(summed, residual)
    unfused = linear_gemv_group(hidden, weights)
    _, ref = add_rms_norm_gemv_group_ref(residual, x, norm_weight, 1e-6, weights)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=0.07, rtol=0.02)
    for got, seq, want in zip(outs, unfused, ref):
        if DEVICE == "cpu":
            assert torch.equal(got, seq)
        else:
            torch.testing.assert_close(got, seq, **tol)
        torch.testing.assert_close(got.float(), want.float(), **tol)


@pytest.mark.parametrize("rows, dtype", [(5, torch.float32), (8, torch.bfloat16), (16, torch.float16)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_tensor_core_form_for_up_to_16_rows(rows, dtype, with_bias):
    """use_dot: [BLOCK_N, BLOCK_K] weight tiles on tensor cores (float32 operands in the interpreter), the rows
    padded to 16: the float32 product up to summation order, groups and the norm prologue included."""
    k = 96  # not a multiple of the 128-column step: a masked tail
    weights = [0.05 * _randn(n, k, dtype=dtype, seed=30 + n) for n in (40, 8, 8)]
    biases = [_randn(w.shape[0], dtype=dtype, seed=40 + i) for i, w in enumerate(weights)] if with_bias else None
    x = _randn(rows, k, dtype=dtype, seed=31)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=0.02, rtol=0.02)
    got = linear_gemv_group(x, weights, biases, use_dot=True)
    for g, w, b in zip(got, weights, biases or [None] * 3):
        torch.testing.assert_close(g.float(), linear_gemv_ref(x, w, b).float(), **tol)
    residual = _randn(rows, k, dtype=dtype, seed=32)
    norm_weight = (1 + 0.1 * _randn(k, seed=33)).to(dtype)
    summed, outs = add_rms_norm_gemv_group(residual, x, norm_weight, 1e-6, weights, biases, use_dot=True)
    want_summed, hidden = add_rms_norm(residual, x, norm_weight, 1e-6)
    assert torch.equal(summed, want_summed)
    for g, want in zip(outs, linear_gemv_group(hidden, weights, biases, use_dot=True)):
        if DEVICE == "cpu":  # the same operands in the same order
            assert torch.equal(g, want)
        torch.testing.assert_close(g.float(), want.float(), **tol)
    with pytest.raises(ValueError, match="at most 16 rows"):
        linear_gemv_group(_randn(17, k, dtype=dtype), weights, use_dot=True)
    with pytest.raises(ValueError, match="at most 8 rows"):
        linear_gemv_group(_randn(9, k, dtype=dtype), weights)


def test_add_rms_norm_gemv_group_refuses_a_norm_weight_of_another_dtype():
    residual = _randn(1, 32, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="norm weight"):
        add_rms_norm_gemv_group(residual, None, _randn(32), 1e-6, [_randn(8, 32, dtype=torch.bfloat16)])


@pytest.mark.parametrize("rows, k, dtype", [(1, 64, torch.bfloat16), (5, 300, torch.float32)])
@pytest.mark.parametrize("add", [True, False])
def test_add_rms_norm_gemv_returns_the_normalized_rows_too(rows, k, dtype, add):
    """The router's fused norm: the normalized rows (what the experts read) are the norm kernel's."""
    residual, x = _randn(rows, k, dtype=dtype, seed=20), _randn(rows, k, dtype=dtype, seed=21) if add else None
    norm_weight = (1 + 0.1 * _randn(k, seed=22)).to(dtype)
    weight = 0.05 * _randn(12, k, dtype=dtype, seed=23)
    summed, normed, out = add_rms_norm_gemv(residual, x, norm_weight, 1e-6, weight)
    want_summed, want_normed = (add_rms_norm(residual, x, norm_weight, 1e-6) if add
                                else (residual, rms_norm(residual, norm_weight, 1e-6)))
    assert torch.equal(summed, want_summed)
    if DEVICE == "cpu":  # the same sums in the same order
        assert torch.equal(normed, want_normed) and torch.equal(out, linear_gemv(want_normed, weight))
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=0.07, rtol=0.02)
    torch.testing.assert_close(normed.float(), want_normed.float(), **tol)
    torch.testing.assert_close(out.float(), linear_gemv_ref(normed, weight).float(), **tol)


@pytest.mark.skipif(DEVICE == "cuda", reason="the interpreter's default tiles")
@pytest.mark.parametrize("rows, k", [(1, 256), (3, 300)])
def test_interpreter_tiles_give_the_gpu_tiles_bits(rows, k):
    """Under the interpreter the multiply-add form takes INTERPRETER_BLOCK_N weight rows a program (fewer Python
    programs); each output's sum runs in the same BLOCK_K steps as on the GPU's tiles, so the bits are the same,
    behind the norm too."""
    from moegraph.kernels import gemv

    x, residual = _randn(rows, k, dtype=torch.bfloat16, seed=40), _randn(rows, k, dtype=torch.bfloat16, seed=41)
    norm_weight = (1 + 0.1 * _randn(k, seed=42)).to(torch.bfloat16)
    weights = [0.05 * _randn(n, k, dtype=torch.bfloat16, seed=43 + n) for n in (72, 12, 12)]
    for group in (weights[:1], weights[1:]):  # wide (4-row GPU tiles) and narrow (2-row) outputs
        gpu_tile = gemv.tile_for(rows, max(w.shape[0] for w in group), k)
        assert gpu_tile[0] < gemv.INTERPRETER_BLOCK_N
        got, want = linear_gemv_group(x, group), linear_gemv_group(x, group, tile=gpu_tile)
        assert all(torch.equal(g, w) for g, w in zip(got, want))
    gpu_tile = gemv.tile_for(rows, 72, k)
    got = add_rms_norm_gemv_group(residual, x, norm_weight, 1e-6, weights)
    want = add_rms_norm_gemv_group(residual, x, norm_weight, 1e-6, weights, tile=gpu_tile)
    assert torch.equal(got[0], want[0]) and all(torch.equal(g, w) for g, w in zip(got[1], want[1]))

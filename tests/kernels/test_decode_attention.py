"""The split-KV decode attention kernel against an fp32 reference: lengths, splits, GQA groups, windows, sinks.

On the CPU the kernel runs in Triton's interpreter (tiny shapes); on the GPU also at Qwen3-30B-A3B's shapes.
"""

import pytest
import torch

from moegraph.kernels import triton_available
from moegraph.kernels.decode_attention import (MIN_CHUNK, choose_max_splits, decode_attention, decode_attention_ref,
                                               visible_positions)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(not triton_available(torch.empty(0, device=DEVICE)),
                                  reason="Triton cannot run here")


def _inputs(rows, q_heads, kv_heads, head_dim, capacity, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(rows, q_heads, head_dim, generator=g)
    k = torch.randn(rows, kv_heads, capacity, head_dim, generator=g)
    v = torch.randn(rows, kv_heads, capacity, head_dim, generator=g)
    return [t.to(DEVICE, dtype) for t in (q, k, v)]


def _fp32_attention(q, k, v, positions, scale, window=None, sinks=None):
    """Straight softmax(q k^T) v per row and head in float64 over the visible positions: the spec."""
    rows, q_heads, _ = q.shape
    group = q_heads // k.shape[1]
    visible = visible_positions(positions, k.shape[2], window)
    out = torch.empty(q.shape, dtype=torch.float64)
    for r in range(rows):
        for h in range(q_heads):
            keys, values = k[r, h // group, visible[r]].double(), v[r, h // group, visible[r]].double()
            logits = keys @ q[r, h].double() * scale
            if sinks is not None:
                logits = torch.cat([logits, sinks[h].double().reshape(1)])
            probs = torch.softmax(logits, 0)[: keys.shape[0]]
            out[r, h] = probs @ values
    return out


@needs_triton
@pytest.mark.parametrize("rows, q_heads, kv_heads, head_dim", [(1, 4, 2, 16), (3, 6, 3, 32), (2, 2, 2, 16)])
@pytest.mark.parametrize("max_splits", [1, 3])
@pytest.mark.parametrize("window, with_sinks", [(None, False), (5, True), (None, True)])
def test_kernel_matches_fp32_reference(rows, q_heads, kv_heads, head_dim, max_splits, window, with_sinks):
    capacity = 2 * MIN_CHUNK + 70  # long enough that 3 splits are used by the longest row
    q, k, v = _inputs(rows, q_heads, kv_heads, head_dim, capacity, torch.float32)
    positions = torch.tensor([capacity - 1, 0, MIN_CHUNK + 3][:rows], device=DEVICE)
    sinks = torch.randn(q_heads, generator=torch.Generator().manual_seed(3)).to(DEVICE) if with_sinks else None
    scale = head_dim ** -0.5
    got = decode_attention(q, k, v, positions, scale, window, sinks, max_splits=max_splits)
    want = _fp32_attention(q.cpu(), k.cpu(), v.cpu(), positions.cpu(), scale, window,
                           None if sinks is None else sinks.cpu())
    torch.testing.assert_close(got.cpu().double(), want, atol=2e-5, rtol=2e-5)
    ref = decode_attention_ref(q, k, v, positions, scale, window, sinks)
    torch.testing.assert_close(ref.cpu().double(), want, atol=2e-5, rtol=2e-5)


@needs_triton
def test_combine_weighs_the_partials_a_step_at_a_time(monkeypatch):
    """More splits than the combine takes at once (COMBINE_SPLITS, 2 here): its steps give what one step gives."""
    from moegraph.kernels import decode_attention as module

    rows, q_heads, kv_heads, head_dim, capacity = 2, 4, 2, 16, 4 * MIN_CHUNK + 30
    q, k, v = _inputs(rows, q_heads, kv_heads, head_dim, capacity, torch.float32, seed=4)
    positions = torch.tensor([capacity - 1, MIN_CHUNK + 5], device=DEVICE)
    sinks = torch.randn(q_heads, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    one_step = decode_attention(q, k, v, positions, 0.25, sinks=sinks, max_splits=5)
    monkeypatch.setattr(module, "COMBINE_SPLITS", 2)
    steps = decode_attention(q, k, v, positions, 0.25, sinks=sinks, max_splits=5)
    torch.testing.assert_close(steps, one_step, atol=1e-6, rtol=1e-6)
    want = _fp32_attention(q.cpu(), k.cpu(), v.cpu(), positions.cpu(), 0.25, None, sinks.cpu())
    torch.testing.assert_close(steps.cpu().double(), want, atol=2e-5, rtol=2e-5)


@needs_triton
def test_kernel_reads_no_position_past_a_row_or_before_its_window():
    """Poison (NaN) everything outside each row's visible span: the output stays finite and unchanged."""
    rows, q_heads, kv_heads, head_dim, capacity = 2, 4, 2, 16, MIN_CHUNK + 40
    q, k, v = _inputs(rows, q_heads, kv_heads, head_dim, capacity, torch.float32, seed=1)
    positions, window = torch.tensor([capacity - 10, 7], device=DEVICE), 6
    want = decode_attention(q, k, v, positions, 0.25, window, max_splits=2)
    hidden = ~visible_positions(positions, capacity, window)[:, None, :, None].expand_as(k)
    got = decode_attention(q, k.masked_fill(hidden, float("nan")), v.masked_fill(hidden, float("nan")), positions,
                           0.25, window, max_splits=2)
    assert torch.isfinite(got).all()
    assert torch.equal(got, want)


@needs_triton
def test_kernel_bf16_matches_sdpa_reference_to_bf16_rounding():
    rows, q_heads, kv_heads, head_dim, capacity = 2, 8, 2, 64, MIN_CHUNK + 16
    q, k, v = _inputs(rows, q_heads, kv_heads, head_dim, capacity, torch.bfloat16, seed=2)
    positions = torch.tensor([capacity - 1, 40], device=DEVICE)
    got = decode_attention(q, k, v, positions, head_dim ** -0.5, max_splits=2)
    want = _fp32_attention(q.cpu(), k.cpu(), v.cpu(), positions.cpu(), head_dim ** -0.5)
    torch.testing.assert_close(got.cpu().double(), want, atol=2e-2, rtol=2e-2)


def test_max_splits_fill_the_gpu_but_never_exceed_what_capacity_can_use():
    cpu = torch.device("cpu")
    assert choose_max_splits(1, 4, MIN_CHUNK, cpu) == 1  # one MIN_CHUNK of capacity: nothing to split
    assert choose_max_splits(64, 4, 1 << 15, cpu) == 1  # the batch alone fills the (8-SM stand-in) device
    assert 1 < choose_max_splits(1, 4, 1 << 15, cpu) <= (1 << 15) // MIN_CHUNK


@pytest.mark.skipif(not torch.cuda.is_available(), reason="full-size shapes on the GPU")
@pytest.mark.parametrize("rows", [1, 8])
@pytest.mark.parametrize("length", [17, 300, 4096, 32768])
def test_kernel_at_qwen3_shapes_on_gpu(rows, length):
    q, k, v = _inputs(rows, 32, 4, 128, 32768, torch.bfloat16, seed=4)
    positions = torch.full((rows,), length - 1, device=DEVICE)
    positions[0] = max(0, length // 3 - 1)  # rows of different lengths in one launch
    got = decode_attention(q, k, v, positions, 128 ** -0.5)
    want = decode_attention_ref(q.float(), k.float(), v.float(), positions, 128 ** -0.5)
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)

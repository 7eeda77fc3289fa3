"""Query rows that are tokens of cache rows (a prefill through the decode ops): `cache_rows` sends row i's K/V to,
and its attention over, cache row cache_rows[i]. Writing every prompt token's K/V in one launch and then attending
in one launch equals decoding the tokens one at a time (each token sees its row's positions up to its own), with
the Triton kernels (interpreter on the CPU) and the plain-torch references."""

import pytest
import torch

from moegraph.kernels import triton_available
from moegraph.kernels.decode_attention import decode_attention, decode_attention_ref
from moegraph.kernels.qk_norm_rope import qk_norm_rope, qk_norm_rope_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
KERNELS = {"ref": (qk_norm_rope_ref, decode_attention_ref), "triton": (qk_norm_rope, decode_attention)}


def _case(dtype, seed=0):
    """Two cache rows: row 1 takes a 5-token prompt, row 0 a 3-token one (tokens interleaved in the query rows)."""
    g = torch.Generator().manual_seed(seed)
    q_heads, kv_heads, head_dim, capacity = 4, 2, 16, 24
    cache_rows = torch.tensor([1, 1, 0, 1, 0, 1, 0, 1])
    positions = torch.tensor([0, 1, 0, 2, 1, 3, 2, 4])
    n = cache_rows.shape[0]
    q = torch.randn(n, q_heads * head_dim, generator=g)
    k = torch.randn(n, kv_heads * head_dim, generator=g)
    v = torch.randn(n, kv_heads * head_dim, generator=g)
    qw, kw = 1 + 0.3 * torch.randn(head_dim, generator=g), 1 + 0.3 * torch.randn(head_dim, generator=g)
    angle = positions[:, None].float() * torch.linspace(0.1, 1.0, head_dim)[None, :]
    cos, sin = angle.cos(), angle.sin()
    tensors = [t.to(DEVICE, dtype) for t in (q, k, v, qw, kw, cos, sin)]
    # a finite stand-in for stale values (row 2 is no token's): the reference's masked SDPA would spread a NaN
    cache = torch.full((3, kv_heads, capacity, head_dim), 7.0, dtype=dtype, device=DEVICE)
    return tensors, positions.to(DEVICE), cache_rows.to(DEVICE), cache


@pytest.mark.parametrize("kernels", ["ref", "triton"])
def test_prompt_tokens_as_rows_equal_one_token_at_a_time(kernels):
    if kernels == "triton" and not triton_available(torch.empty(0, device=DEVICE)):
        pytest.skip("Triton cannot run here")
    rope, attention = KERNELS[kernels]
    (q, k, v, qw, kw, cos, sin), positions, cache_rows, cache = _case(torch.float32)
    keys, values = cache.clone(), cache.clone()
    q_rot = rope(q, k, v, qw, kw, cos, sin, positions, keys, values, 1e-6, cache_rows=cache_rows)
    got = attention(q_rot, keys, values, positions, 0.25, cache_rows=cache_rows)
    assert (keys[2] == 7).all() and (values[2] == 7).all()  # no token wrote into the unused cache row

    one_keys, one_values = cache.clone(), cache.clone()
    for i in range(q.shape[0]):  # the same tokens as single-row decode steps of their cache row, in order
        row, at = int(cache_rows[i]), positions[i:i + 1]
        k_row, v_row = one_keys[row:row + 1], one_values[row:row + 1]
        q_one = rope(q[i:i + 1], k[i:i + 1], v[i:i + 1], qw, kw, cos[i:i + 1], sin[i:i + 1], at, k_row, v_row, 1e-6)
        want = attention(q_one, k_row, v_row, at, 0.25)
        torch.testing.assert_close(got[i:i + 1], want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(keys, one_keys)
    torch.testing.assert_close(values, one_values)


def test_cache_rows_must_be_one_per_query_row():
    (q, k, v, qw, kw, cos, sin), positions, cache_rows, cache = _case(torch.float32)
    q3 = q.reshape(q.shape[0], 4, 16)
    with pytest.raises(ValueError, match="cache_rows"):
        decode_attention(q3, cache, cache, positions, 0.25, cache_rows=cache_rows[:3])

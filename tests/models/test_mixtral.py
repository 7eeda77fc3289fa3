"""The Mixtral family on the CPU, fp32: patched generate() against unpatched transformers, the sliding-window
fallback, and the ops its decode step adds (RoPE-only attention, Mixtral's router) against transformers' own."""

import pytest
import torch
from transformers.models.mixtral import modeling_mixtral

import moegraph
from moegraph.kernels import qk_norm_rope, router_topk, triton_available
from moegraph.testing import build_model

from _cases import (assert_class_patch_greedy_equals_transformers,
                    assert_patch_model_greedy_equals_transformers,
                    assert_sliding_window_falls_back,
                    eos_mid_batch_case)


@pytest.fixture(scope="module")
def model():
    return build_model("tiny-mixtral", seed=0)


@pytest.fixture(scope="module")
def case(model):
    """Rows that stop at different steps and unpatched transformers' tokens (_cases.eos_mid_batch_case)."""
    inputs, kwargs, want = eos_mid_batch_case(model)
    return inputs, kwargs, want


def test_patch_model_greedy_equals_transformers(model, case):
    assert_patch_model_greedy_equals_transformers(model, case)


def test_class_patch_greedy_equals_transformers(model, case):
    assert_class_patch_greedy_equals_transformers(lambda: build_model("tiny-mixtral", seed=0), model, case)


def test_sliding_window_falls_back_beyond_the_window(caplog):
    windowed = build_model("tiny-mixtral", seed=2, sliding_window=10, num_layers=1)
    assert_sliding_window_falls_back(windowed, caplog)

def test_unsupported_model_error_lists_both_families():
    llama = torch.nn.Module()
    llama.config = type("Config", (), {"model_type": "llama"})()
    with pytest.raises(moegraph.UnsupportedModelError, match=r"model_type='llama'.*mixtral.*qwen3_moe"):
        moegraph.patch(llama)


def test_router_matches_mixtral_router():
    config = build_model("tiny-mixtral").config
    router = modeling_mixtral.MixtralTopKRouter(config)
    torch.nn.init.normal_(router.weight)
    hidden = torch.randn(9, config.hidden_size)
    logits, want_w, want_i = router(hidden)
    got_w, got_i = router_topk.router_topk_ref(logits, config.num_experts_per_tok, True, weights_dtype=torch.float32)
    assert torch.equal(got_i, want_i) and torch.equal(got_w, want_w)
    bf16 = logits.bfloat16()  # a bf16 model: transformers leaves the weights in float32
    want_w = torch.softmax(bf16.float(), -1).topk(2).values
    got_w, _ = router_topk.router_topk_ref(bf16, 2, True, weights_dtype=torch.float32)
    assert got_w.dtype == torch.float32 and torch.equal(got_w, want_w / want_w.sum(-1, keepdim=True))
    if triton_available(logits):
        got_w, got_i = router_topk.router_topk(logits, 2, True, weights_dtype=torch.float32)
        assert torch.equal(got_i, want_i) and got_w.dtype == torch.float32
        torch.testing.assert_close(got_w, router(hidden)[1], atol=1e-6, rtol=1e-6)


def _rope_inputs(dtype, rows=3, q_heads=4, kv_heads=2, head_dim=16, positions_count=8):
    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(rows, h * head_dim, generator=gen).to(dtype) for h in (q_heads, kv_heads, kv_heads))
    angle = torch.randn(rows, head_dim, generator=gen)
    cos, sin = angle.cos().to(dtype), angle.sin().to(dtype)
    positions = torch.tensor([5, 0, 7])[:rows]
    caches = [torch.full((rows, kv_heads, positions_count, head_dim), 7.0, dtype=dtype) for _ in range(4)]
    return q, k, v, cos, sin, positions, caches


def test_rope_only_reference_is_mixtral_rope():
    q, k, v, cos, sin, positions, caches = _rope_inputs(torch.float32)
    got = qk_norm_rope.qk_norm_rope_ref(q, k, v, None, None, cos, sin, positions, caches[0], caches[1], None)
    want_q, want_k = modeling_mixtral.apply_rotary_pos_emb(q.reshape(3, 4, 16), k.reshape(3, 2, 16), cos, sin,
                                                           unsqueeze_dim=1)
    assert torch.equal(got, want_q)
    assert torch.equal(caches[0][torch.arange(3), :, positions], want_k)
    assert torch.equal(caches[1][torch.arange(3), :, positions], v.reshape(3, 2, 16))


@pytest.mark.skipif(not triton_available(torch.empty(0)), reason="Triton's interpreter cannot run here")
@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-6), (torch.bfloat16, 2e-2)])
def test_rope_only_kernel_matches_reference(dtype, atol):
    q, k, v, cos, sin, positions, caches = _rope_inputs(dtype)
    got = qk_norm_rope.qk_norm_rope(q, k, v, None, None, cos, sin, positions, caches[0], caches[1], None)
    want = qk_norm_rope.qk_norm_rope_ref(q, k, v, None, None, cos, sin, positions, caches[2], caches[3], None)
    torch.testing.assert_close(got, want, atol=atol, rtol=atol)
    torch.testing.assert_close(caches[0], caches[2], atol=atol, rtol=atol)  # unwritten positions stay 7 in both
    assert torch.equal(caches[1], caches[3])
    with pytest.raises(ValueError, match="both"):
        qk_norm_rope.qk_norm_rope(q, k, v, torch.ones(16, dtype=dtype), None, cos, sin, positions, caches[0],
                                  caches[1], 1e-6)

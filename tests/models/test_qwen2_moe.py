"""The Qwen2-MoE family on the CPU, fp32: patched generate() against unpatched transformers, the sliding-window
fallback, and what its decode step adds (q/k/v biases, the router without renormalisation, the gated shared expert,
dense layers; q/k/v biases in the grouped NF4 GEMV) against transformers' own modules."""

from types import SimpleNamespace

import pytest
import torch
from transformers.models.qwen2_moe import modeling_qwen2_moe

from moegraph.kernels import router_topk, triton_available
from moegraph.models import qwen2_moe
from moegraph.ops import ops_for_model
from moegraph.testing import build_model, make_config

from _cases import (assert_class_patch_greedy_equals_transformers,
                    assert_patch_model_greedy_equals_transformers,
                    assert_sliding_window_falls_back,
                    eos_mid_batch_case)

TRITON = triton_available(torch.empty(0))


@pytest.fixture(scope="module")
def model():
    return build_model("tiny-qwen2-moe", seed=0)


@pytest.fixture(scope="module")
def case(model):
    """Rows that stop at different steps and unpatched transformers' tokens (_cases.eos_mid_batch_case)."""
    inputs, kwargs, want = eos_mid_batch_case(model)
    assert (want[1:, -1] != 0).all()  # the others ran to the end
    return inputs, kwargs, want


def test_preset_has_what_the_family_adds(model):
    layers = model.model.layers
    assert [type(layer.mlp).__name__ for layer in layers] == ["Qwen2MoeSparseMoeBlock", "Qwen2MoeMLP",
                                                              "Qwen2MoeSparseMoeBlock"]
    assert not model.config.norm_topk_prob
    assert all(layer.self_attn.q_proj.bias.abs().sum() > 0 for layer in layers)  # random, not transformers' zeros


def test_patch_model_greedy_equals_transformers(model, case):
    assert_patch_model_greedy_equals_transformers(model, case)


def test_class_patch_greedy_equals_transformers(model, case):
    assert_class_patch_greedy_equals_transformers(lambda: build_model("tiny-qwen2-moe", seed=0), model, case)


def test_sliding_window_falls_back_beyond_the_window(caplog):
    """Layer 0 slides (max_window_layers=1), layer 1 is full attention and dense; MHA (4 / 4 heads)."""
    windowed = build_model("tiny-qwen2-moe", seed=2, num_layers=2, num_key_value_heads=4, use_sliding_window=True,
                           sliding_window=10, max_window_layers=1)
    assert windowed.config.layer_types == ["sliding_attention", "full_attention"]
    assert_sliding_window_falls_back(windowed, caplog)

def test_released_configs_have_no_position_limit():
    """use_sliding_window=False (every released checkpoint): Qwen2MoeConfig sets sliding_window to 0 and no layer
    slides, so no call length falls back."""
    for name in ("tiny-qwen2-moe", "qwen1.5-moe-a2.7b", "qwen2-57b-a14b"):
        config = make_config(name)
        assert config.sliding_window == 0
        assert qwen2_moe.check_positions(SimpleNamespace(config=config), 1 << 20) is None


def test_router_matches_qwen2_moe_router():
    config = make_config("tiny-qwen2-moe")
    router = modeling_qwen2_moe.Qwen2MoeTopKRouter(config)
    torch.nn.init.normal_(router.weight)
    hidden = torch.randn(9, config.hidden_size)
    logits, want_w, want_i = router(hidden)
    got_w, got_i = router_topk.router_topk_ref(logits, config.num_experts_per_tok, config.norm_topk_prob)
    assert torch.equal(got_i, want_i) and torch.equal(got_w, want_w)
    assert not torch.allclose(want_w.sum(-1), torch.ones(9))  # not renormalised
    bf16 = logits.bfloat16()  # a bf16 model: transformers casts the weights back to bf16
    got_bf16, _ = router_topk.router_topk_ref(bf16, 4, False)
    want_bf16 = torch.softmax(bf16.float(), -1).topk(4).values.bfloat16()
    assert got_bf16.dtype == torch.bfloat16 and torch.equal(got_bf16, want_bf16)
    if TRITON:
        got_w, got_i = router_topk.router_topk(logits, 4, False)
        assert torch.equal(got_i, want_i)
        torch.testing.assert_close(got_w, want_w, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_moe_block_and_dense_layer_match_transformers(model, kernels):
    """decode_moe (router, moegraph's experts, sigmoid-gated shared expert) against Qwen2MoeSparseMoeBlock, and the
    dense layer against Qwen2MoeMLP."""
    if kernels == "triton" and not TRITON:
        pytest.skip("Triton's interpreter is not on for CPU tensors here")
    ops = ops_for_model(model, kernels=kernels)
    hidden = torch.randn(5, model.config.hidden_size, generator=torch.Generator().manual_seed(4))
    block, dense = model.model.layers[0].mlp, model.model.layers[1].mlp
    with torch.no_grad():
        torch.nn.init.normal_(block.shared_expert_gate.weight, std=0.5)  # gates away from 0.5
        want = block(hidden[None])[0]
        got = qwen2_moe.decode_moe(block, hidden, ops)
        shared_only = torch.sigmoid(block.shared_expert_gate(hidden)) * block.shared_expert(hidden)
        assert (want - shared_only).abs().max() > 1e-3  # the routed experts count
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
        assert torch.equal(qwen2_moe.dense_mlp(dense, hidden, ops), dense(hidden))


@pytest.mark.skipif(not TRITON, reason="Triton's interpreter is not on for CPU tensors here")
def test_nf4_projections_through_moegraphs_gemv(monkeypatch):
    """Linear4bit q/k/v with biases through one grouped NF4 GEMV launch, and the shared expert and its [1, H] gate
    through the NF4 GEMV: each close to its bitsandbytes forward."""
    pytest.importorskip("bitsandbytes")
    from moegraph.kernels import nf4_gemv

    nf4 = build_model("tiny-qwen2-moe", seed=5, quant="nf4", num_layers=1)
    attn = nf4.model.layers[0].self_attn
    assert type(attn.q_proj).__name__ == "Linear4bit" and attn.q_proj.bias is not None
    launches = []
    group = nf4_gemv.nf4_linear_group
    monkeypatch.setattr(nf4_gemv, "nf4_linear_group",
                        lambda *a, **k: launches.append(k.get("biases")) or group(*a, **k))
    x = torch.randn(2, nf4.config.hidden_size, generator=torch.Generator().manual_seed(7))
    ops = ops_for_model(nf4, kernels="triton")
    got = ops.qkv(attn, x)
    assert len(launches) == 1 and launches[0] is not None
    for g, module in zip(got, (attn.q_proj, attn.k_proj, attn.v_proj)):
        torch.testing.assert_close(g, module(x), atol=1e-4, rtol=1e-4)
    block = nf4.model.layers[0].mlp
    assert type(block.shared_expert_gate).__name__ == "Linear4bit"
    torch.testing.assert_close(ops.linear(block.shared_expert_gate, x), block.shared_expert_gate(x), atol=1e-4,
                               rtol=1e-4)
    torch.testing.assert_close(qwen2_moe.dense_mlp(block.shared_expert, x, ops), block.shared_expert(x), atol=1e-4,
                               rtol=1e-4)

"""The GLM-4-MoE family on the CPU, fp32: patched generate() against unpatched transformers (partial RoPE with
per-head q/k-norm, q/k/v biases, grouped sigmoid routing with a correction bias and routed_scaling_factor, shared
experts, a dense first layer; prefill experts through moegraph's ExpertsInterface name; moegraph's Triton kernels
through the interpreter; whole-head RoPE through the fused op), and what its decode step adds (the router, the
partial rotation, the MoE block) against transformers' own modules."""

from types import SimpleNamespace

import pytest
import torch
from transformers.models.glm4_moe import modeling_glm4_moe

import moegraph
from moegraph.kernels import triton_available
from moegraph.models import FAMILIES, glm4_moe
from moegraph.ops import ops_for_model
from moegraph.testing import build_model, make_config, random_prompts

from _cases import (assert_class_patch_greedy_equals_transformers,
                    assert_patch_model_greedy_equals_transformers,
                    assert_prefill_runs_moegraphs_experts,
                    assert_triton_kernels_equal_transformers,
                    eos_mid_batch_case)

TRITON = triton_available(torch.empty(0))


def _glm(seed=0, **overrides):
    """tiny-glm4-moe with random q_norm / k_norm weights (the initializer leaves them all ones: a norm with the
    wrong weight would give the same tokens)."""
    model = build_model("tiny-glm4-moe", seed=seed, **overrides)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in model.model.layers:
            attn = layer.self_attn
            if attn.use_qk_norm:
                for norm in (attn.q_norm, attn.k_norm):
                    norm.weight.copy_(1 + 0.5 * torch.randn(norm.weight.shape, generator=gen))
    return model


@pytest.fixture(scope="module")
def model():
    return _glm()


@pytest.fixture(scope="module")
def case(model):
    """Rows that stop at different steps and unpatched transformers' tokens (_cases.eos_mid_batch_case)."""
    inputs, kwargs, want = eos_mid_batch_case(model)
    assert (want[1:, -1] != 0).all()  # the other rows ran to the end
    return inputs, kwargs, want


def test_preset_has_what_the_family_adds(model):
    config, layers = model.config, model.model.layers
    assert [type(layer.mlp).__name__ for layer in layers] == ["Glm4MoeMLP", "Glm4MoeMoE", "Glm4MoeMoE"]
    assert (config.n_group, config.topk_group, config.routed_scaling_factor) == (2, 1, 2.5)
    assert glm4_moe.rotary_dim(model) == 8 and layers[0].self_attn.head_dim == 16  # half of each head rotates
    assert all(layer.self_attn.use_qk_norm and layer.self_attn.q_proj.bias.abs().sum() > 0 for layer in layers)
    assert all((layer.mlp.gate.e_score_correction_bias != 0).all() for layer in layers[1:])  # random, not zeros
    # use_experts_implementation wraps the experts' forward (the prefill test checks that it dispatches to moegraph)
    assert hasattr(modeling_glm4_moe.Glm4MoeExperts.forward, "__wrapped__")
    assert glm4_moe.check_positions(model, 1 << 20) is None and glm4_moe.check_positions(_meta("glm4.5-air"),
                                                                                         1 << 20) is None


def _meta(name):
    with torch.device("meta"):
        return FAMILIES["glm4_moe"].causal_lm()(make_config(name, num_layers=1))


def test_glm45_air_preset_shapes():
    config = make_config("glm4.5-air")
    assert (config.hidden_size, config.num_hidden_layers, config.n_routed_experts, config.num_experts_per_tok,
            config.n_shared_experts, config.moe_intermediate_size, config.first_k_dense_replace) == \
        (4096, 46, 128, 8, 1, 1408, 1)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim, config.vocab_size) == \
        (96, 8, 128, 151552)
    assert config.rope_parameters["partial_rotary_factor"] == 0.5 and not config.use_qk_norm


def test_patch_model_greedy_equals_transformers(model, case):
    assert_patch_model_greedy_equals_transformers(model, case)


def test_class_patch_greedy_equals_transformers(model, case):
    assert_class_patch_greedy_equals_transformers(_glm, model, case)


def test_prefill_runs_moegraphs_experts(model, case):
    """The prefill's Glm4MoeMoE dispatches through transformers' ExpertsInterface to moegraph's name: one call per
    sparse layer (not the dense first one) over every prompt token."""
    sparse_layers = model.config.num_hidden_layers - model.config.first_k_dense_replace
    assert_prefill_runs_moegraphs_experts(model, case, sparse_layers)


def test_triton_kernels_equal_transformers(model, case):
    """moegraph's Triton kernels (interpreter): the per-head norm and the fused op's identity-rotation cache write."""
    assert_triton_kernels_equal_transformers(model, case)


def test_whole_head_rope_and_no_qk_norm_equal_transformers():
    """partial_rotary_factor 1 (the fused op rotates, as Qwen3-MoE), and use_qk_norm off (GLM-4.5-Air's case)."""
    inputs = random_prompts(2, vocab_size=512, min_len=3, max_len=8, seed=7)
    for overrides in (dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                            "partial_rotary_factor": 1.0}),
                      dict(use_qk_norm=False, attention_bias=False)):
        variant = _glm(seed=1, num_layers=2, **overrides)
        want = variant.generate(**inputs, max_new_tokens=5, do_sample=False)
        moegraph.patch(variant, max_batch_size=4)
        try:
            assert torch.equal(variant.generate(**inputs, max_new_tokens=5, do_sample=False), want)
            assert moegraph.decode_stats(variant).fallback_reason is None
        finally:
            moegraph.unpatch(variant)
    assert glm4_moe.rotary_dim(variant) == 8


def test_odd_rotary_slice_is_refused():
    fake = SimpleNamespace(model=SimpleNamespace(layers=[SimpleNamespace(self_attn=SimpleNamespace(head_dim=16))],
                                                 rotary_emb=SimpleNamespace(inv_freq=torch.zeros(9))))
    assert "18 dims" in glm4_moe.check_positions(fake, 8)


def test_router_matches_glm4_moe_router():
    """Sigmoid scores, the correction bias picking (not weighing) experts, 2 groups with topk_group 1, renormalised
    and scaled by routed_scaling_factor; with and without norm_topk_prob, 1 and 2 groups kept."""
    config = make_config("tiny-glm4-moe")
    gen = torch.Generator().manual_seed(11)
    hidden = torch.randn(33, config.hidden_size, generator=gen)
    for norm_topk_prob, topk_group, top_k in ((True, 1, 2), (False, 1, 3), (True, 2, 4)):
        config.norm_topk_prob, config.topk_group, config.num_experts_per_tok = norm_topk_prob, topk_group, top_k
        router = modeling_glm4_moe.Glm4MoeTopkRouter(config)
        with torch.no_grad():
            router.weight.normal_(0.0, 0.1, generator=gen)
            router.e_score_correction_bias.normal_(0.0, 0.3, generator=gen)
        _, want_w, want_i = router(hidden)
        got_w, got_i = glm4_moe.route(router, hidden)
        assert got_w.dtype == torch.float32 and torch.equal(got_i, want_i) and torch.equal(got_w, want_w)
        if topk_group == 1:  # every row's picks come from one group of 4
            assert ((got_i // 4) == (got_i[:, :1] // 4)).all()
        with torch.no_grad():
            biased_i = got_i
            router.e_score_correction_bias.zero_()
            _, plain_w, plain_i = router(hidden)
        assert not torch.equal(plain_i.sort(-1)[0], biased_i.sort(-1)[0])  # the bias changes the selection
        if norm_topk_prob:
            torch.testing.assert_close(want_w.sum(-1), torch.full((33,), config.routed_scaling_factor))
    bf16 = modeling_glm4_moe.Glm4MoeTopkRouter(config)  # a bf16 model: hidden in bf16, the router kept in fp32
    with torch.no_grad():
        bf16.weight.normal_(0.0, 0.1, generator=gen)
        bf16.e_score_correction_bias.normal_(0.0, 0.3, generator=gen)
    _, want_w, want_i = bf16(hidden.bfloat16())
    got_w, got_i = glm4_moe.route(bf16, hidden.bfloat16())
    assert torch.equal(got_i, want_i) and torch.equal(got_w, want_w)


def test_partial_rope_matches_apply_rotary_pos_emb(model):
    gen = torch.Generator().manual_seed(5)
    q, k = torch.randn(3, 4, 16, generator=gen), torch.randn(3, 2, 16, generator=gen)
    positions = torch.tensor([[0], [7], [123]])
    cos, sin = model.model.rotary_emb(q, positions)  # [3, 1, 8]
    want_q, want_k = modeling_glm4_moe.apply_rotary_pos_emb(q[:, :, None], k[:, :, None], cos, sin)
    assert torch.equal(glm4_moe.partial_rope(q, cos, sin), want_q[:, :, 0])
    assert torch.equal(glm4_moe.partial_rope(k, cos, sin), want_k[:, :, 0])
    assert torch.equal(want_q[..., 8:], q[:, :, None, 8:])  # the other half passes through


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_moe_block_and_dense_layer_match_transformers(model, kernels):
    """decode_moe (router, moegraph's experts, shared experts) against Glm4MoeMoE, the dense layer against
    Glm4MoeMLP."""
    if kernels == "triton" and not TRITON:
        pytest.skip("Triton's interpreter is not on for CPU tensors here")
    ops = ops_for_model(model, kernels=kernels)
    hidden = torch.randn(5, model.config.hidden_size, generator=torch.Generator().manual_seed(4))
    block, dense = model.model.layers[1].mlp, model.model.layers[0].mlp
    with torch.no_grad():
        want = block(hidden[None])[0]
        got = glm4_moe.decode_moe(block, hidden, ops)
        assert (want - block.shared_experts(hidden)).abs().max() > 1e-3  # the routed experts count
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
        assert torch.equal(glm4_moe.dense_mlp(dense, hidden, ops), dense(hidden))


def test_unsupported_model_error_lists_glm4_moe():
    llama = torch.nn.Module()
    llama.config = type("Config", (), {"model_type": "llama"})()
    with pytest.raises(moegraph.UnsupportedModelError, match=r"'glm4_moe'.*GLM-4.5-Air"):
        moegraph.patch(llama)

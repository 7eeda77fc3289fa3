"""The GPT-OSS family on the CPU, fp32: patched generate() against unpatched transformers (attention sinks, layers
alternating sliding and full attention with prompts longer than the window, q/k/v/o biases, the biased top-k router,
experts with biases and the clamped SwiGLU through moegraph's grouped_mm path; prefill experts through moegraph's
ExpertsInterface name; moegraph's Triton kernels through the interpreter), and what its decode step adds (RoPE on
halves, sinks, the router, the experts, the MoE block) against transformers' own modules."""


import pytest
import torch
from transformers.models.gpt_oss import modeling_gpt_oss

import moegraph
from moegraph.fit import count_parameters
from moegraph.kernels import decode_attention, qk_norm_rope, triton_available
from moegraph.models import gpt_oss
from moegraph.moe.grouped_mm import moe_experts_grouped_mm, own_layout
from moegraph.moe.reference import moe_experts_ref
from moegraph.moe.triton_experts import moe_experts_triton
from moegraph.ops import ops_for_model
from moegraph.testing import build_model, make_config, random_prompts

from _cases import (assert_class_patch_greedy_equals_transformers,
                    assert_patch_model_greedy_equals_transformers,
                    assert_prefill_runs_moegraphs_experts,
                    assert_triton_kernels_equal_transformers,
                    eos_mid_batch_case,
                    patched_generate)

TRITON = triton_available(torch.empty(0))


@pytest.fixture(scope="module")
def model():
    return build_model("tiny-gpt-oss", seed=0)


@pytest.fixture(scope="module")
def case(model):
    """Rows that stop at different steps and unpatched transformers' tokens (_cases.eos_mid_batch_case); the longer
    prompts (up to 8 tokens) are longer than the sliding window (6)."""
    inputs, kwargs, want = eos_mid_batch_case(model)
    assert (want[1:, -1] != 0).all()  # the other rows ran to the end
    assert inputs["attention_mask"].sum(1).max() > model.config.sliding_window
    return inputs, kwargs, want


def test_preset_has_what_the_family_adds(model):
    config, layers = model.config, model.model.layers
    assert config.layer_types == ["sliding_attention", "full_attention", "sliding_attention"]
    assert [layer.self_attn.sliding_window for layer in layers] == [6, None, 6]
    for layer in layers:  # random, not transformers' zeros
        attn, mlp = layer.self_attn, layer.mlp
        assert all(p.bias.abs().sum() > 0 for p in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj))
        assert attn.sinks.abs().mean() > 0.3
        assert mlp.router.bias.abs().sum() > 0
        assert mlp.experts.gate_up_proj_bias.abs().sum() > 0 and mlp.experts.down_proj_bias.abs().sum() > 0
        assert own_layout(mlp.experts) and mlp.experts.gate_up_proj.shape == (8, 64, 64)  # [E, H, 2I]


def test_gpt_oss_20b_preset_shapes():
    config = make_config("gpt-oss-20b")
    assert config.layer_types == ["sliding_attention", "full_attention"] * 12 and config.sliding_window == 128
    assert (config.num_local_experts, config.num_experts_per_tok, config.intermediate_size) == (32, 4, 2880)
    assert count_parameters(config) == 20_914_757_184  # the 20.9B of the model card
    assert make_config("gpt-oss-20b", num_layers=2).layer_types == ["sliding_attention", "full_attention"]


def test_patch_model_greedy_equals_transformers(model, case):
    assert_patch_model_greedy_equals_transformers(model, case)


def test_logits_and_returned_cache_follow_transformers(model):
    """Every step's logits close to transformers' (not only their argmax), and the returned Cache as transformers'
    loop leaves it: sliding layers hold the last sliding_window - 1 positions, full layers all of them."""
    inputs = random_prompts(3, vocab_size=512, min_len=9, max_len=14, seed=11)
    kwargs = dict(max_new_tokens=6, do_sample=False, return_dict_in_generate=True, output_logits=True)
    want = model.generate(**inputs, **kwargs)
    got, stats = patched_generate(model, inputs, kwargs)
    assert stats.fallback_reason is None
    assert torch.equal(got.sequences, want.sequences)
    for a, b in zip(got.logits, want.logits):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    got_cache, want_cache = got.past_key_values, want.past_key_values
    assert got_cache.get_seq_length() == want_cache.get_seq_length()
    for got_layer, want_layer in zip(got_cache.layers, want_cache.layers):
        assert got_layer.keys.shape == want_layer.keys.shape
        torch.testing.assert_close(got_layer.keys, want_layer.keys, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got_layer.values, want_layer.values, atol=1e-5, rtol=1e-5)


def test_batch_in_chunks_returns_transformers_cache(model):
    """6 rows with max_batch_size 4 (two chunks) and a returned Cache: its sliding layers count every token seen,
    as transformers' (a later call continues from get_seq_length())."""
    inputs = random_prompts(6, vocab_size=512, min_len=5, max_len=12, seed=4)
    kwargs = dict(max_new_tokens=5, do_sample=False, return_dict_in_generate=True)
    want = model.generate(**inputs, **kwargs)
    got, stats = patched_generate(model, inputs, kwargs)
    assert stats.fallback_reason is None and stats.chunks == 2
    assert torch.equal(got.sequences, want.sequences)
    assert got.past_key_values.get_seq_length() == want.past_key_values.get_seq_length() == 16
    for got_layer, want_layer in zip(got.past_key_values.layers, want.past_key_values.layers):
        torch.testing.assert_close(got_layer.keys, want_layer.keys, atol=1e-5, rtol=1e-5)


def test_class_patch_greedy_equals_transformers(model, case):
    assert_class_patch_greedy_equals_transformers(lambda: build_model("tiny-gpt-oss", seed=0), model, case)


def test_prefill_runs_moegraphs_experts(model, case):
    """The prefill's GptOssMLP dispatches through transformers' ExpertsInterface to moegraph's name: one call per
    layer over every prompt token."""
    assert_prefill_runs_moegraphs_experts(model, case, sparse_layers=model.config.num_hidden_layers)


def test_sliding_window_shorter_than_the_prompts_decodes_exactly():
    """Window 4, prompts of 6 to 12 tokens and 8 new ones: every sliding layer's window moves on each step; no
    fallback (the static cache keeps all positions and the step passes window=)."""
    windowed = build_model("tiny-gpt-oss", seed=2, sliding_window=4, num_layers=2)
    inputs = random_prompts(4, vocab_size=512, min_len=6, max_len=12, seed=6)
    want = windowed.generate(**inputs, max_new_tokens=8, do_sample=False)
    got, stats = patched_generate(windowed, inputs, dict(max_new_tokens=8, do_sample=False))
    assert stats.fallback_reason is None
    assert torch.equal(got, want)
    # the window matters here: the same step over full attention gives other tokens
    full = build_model("tiny-gpt-oss", seed=2, sliding_window=4, num_layers=2)
    full.model.layers[0].self_attn.sliding_window = None
    moegraph.patch(full, max_batch_size=4)
    try:
        assert not torch.equal(full.generate(**inputs, max_new_tokens=8, do_sample=False), want)
    finally:
        moegraph.unpatch(full)


def test_padding_after_tokens_past_the_window_falls_back(model):
    """A window counts padded columns in transformers, compact positions here: only left padding agrees."""
    left = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    right = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]])
    assert gpt_oss.check_prompt(model, left, 100) is None and gpt_oss.check_prompt(model, None, 100) is None
    assert gpt_oss.check_prompt(model, right, 6) is None  # within the window: nothing slides
    assert "not left padding" in gpt_oss.check_prompt(model, right, 7)


def test_mxfp4_experts_fall_back():
    packed = build_model("tiny-gpt-oss", seed=0, num_layers=1)
    assert gpt_oss.check_positions(packed, 1 << 20) is None
    experts = packed.model.layers[0].mlp.experts
    experts.gate_up_proj = torch.nn.Parameter(torch.zeros(8, 64, 32, dtype=torch.uint8), requires_grad=False)
    assert "Mxfp4Config(dequantize=True)" in gpt_oss.check_positions(packed, 10)


def test_triton_kernels_equal_transformers(model, case):
    """moegraph's Triton kernels (interpreter): RoPE + cache write, decode attention with sinks and a window, the
    experts' grouping and combine around grouped_mm."""
    assert_triton_kernels_equal_transformers(model, case)


def test_router_matches_gpt_oss_router(model):
    router = model.model.layers[0].mlp.router
    hidden = torch.randn(9, model.config.hidden_size, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        _, want_w, want_i = router(hidden)
        got_w, got_i = gpt_oss.route(router, hidden)
    assert torch.equal(got_i, want_i) and torch.equal(got_w, want_w)


@pytest.mark.parametrize("backend", ["grouped_mm", "torch", "triton"])
def test_experts_match_gpt_oss_experts(model, backend):
    """Every moegraph backend against GptOssExperts' own loop (its eager forward): transposed weights, biases,
    interleaved gate/up, the clamp (the inputs are scaled so that it cuts)."""
    if backend == "triton" and not TRITON:
        pytest.skip("Triton's interpreter is not on for CPU tensors here")
    experts = model.model.layers[1].mlp.experts
    gen = torch.Generator().manual_seed(5)
    hidden = 40 * torch.randn(7, model.config.hidden_size, generator=gen)
    index = torch.rand(7, 8, generator=gen).topk(3, dim=-1).indices
    weights = torch.rand(7, 3, generator=gen).softmax(-1)
    with torch.no_grad():
        gate_up = hidden @ experts.gate_up_proj[0] + experts.gate_up_proj_bias[0]
        assert (gate_up.abs() > experts.limit).any()  # the clamp is exercised
        want = type(experts).forward.__wrapped__(experts, hidden, index, weights)  # transformers' eager loop
        function = {"grouped_mm": moe_experts_grouped_mm, "torch": moe_experts_ref, "triton": moe_experts_triton}
        ops = ops_for_model(model, kernels="triton") if backend == "triton" else None
        got = function[backend](hidden, index, weights, experts, ops=ops)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_moe_block_matches_transformers(model, kernels):
    if kernels == "triton" and not TRITON:
        pytest.skip("Triton's interpreter is not on for CPU tensors here")
    ops = ops_for_model(model, kernels=kernels)
    block = model.model.layers[2].mlp
    hidden = torch.randn(5, model.config.hidden_size, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = block(hidden[None])[0][0]
        got = gpt_oss.decode_moe(block, hidden, ops)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


def test_rope_on_halves_is_gpt_oss_rope(model):
    """cos/sin [b, 1, D/2] repeated to D through the fused op's reference: transformers' _apply_rotary_emb exactly."""
    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(3, h * 16, generator=gen) for h in (4, 2, 2))
    cos, sin = model.model.rotary_emb(q, torch.tensor([[5], [0], [7]]))  # [b, 1, 8]
    assert cos.shape == (3, 1, 8)
    caches = [torch.zeros(3, 2, 8, 16) for _ in range(2)]
    positions = torch.tensor([5, 0, 7])
    got = qk_norm_rope.qk_norm_rope_ref(q, k, v, None, None, torch.cat([cos, cos], -1), torch.cat([sin, sin], -1),
                                        positions, caches[0], caches[1], None)
    want_q, want_k = modeling_gpt_oss.apply_rotary_pos_emb(q.reshape(3, 4, 1, 16), k.reshape(3, 2, 1, 16), cos, sin)
    assert torch.equal(got, want_q[:, :, 0])
    assert torch.equal(caches[0][torch.arange(3), :, positions], want_k[:, :, 0])


@pytest.mark.parametrize("window", [None, 3])
def test_decode_attention_with_sinks_is_gpt_oss_attention(model, window):
    """The decode step's attention (sinks, a sliding window) against transformers' eager_attention_forward over the
    visible positions, with the layer's own sinks."""
    attn = model.model.layers[0].self_attn
    gen = torch.Generator().manual_seed(9)
    q = torch.randn(2, 4, 16, generator=gen)
    keys, values = (torch.randn(2, 2, 6, 16, generator=gen) for _ in range(2))
    positions = torch.tensor([5, 2])
    got = decode_attention.decode_attention_ref(q, keys, values, positions, attn.scaling, window, attn.sinks)
    visible = decode_attention.visible_positions(positions, 6, window)  # [b, S]
    mask = torch.zeros(2, 1, 1, 6).masked_fill(~visible[:, None, None], float("-inf"))
    with torch.no_grad():
        want, _ = modeling_gpt_oss.eager_attention_forward(attn, q[:, :, None], keys, values, mask, attn.scaling)
    torch.testing.assert_close(got, want[:, 0], atol=1e-6, rtol=1e-5)


def test_unsupported_model_error_lists_gpt_oss():
    llama = torch.nn.Module()
    llama.config = type("Config", (), {"model_type": "llama"})()
    with pytest.raises(moegraph.UnsupportedModelError, match=r"'gpt_oss'.*gpt-oss-20b"):
        moegraph.patch(llama)

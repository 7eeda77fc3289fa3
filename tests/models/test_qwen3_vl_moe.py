"""The Qwen3-VL-MoE family on the CPU, fp32: text-only generate() on the fast path against unpatched transformers
(3-component mrope position ids, the decoder stack at model.model.language_model, an always-renormalised router,
a dense mlp_only layer, prefill experts through moegraph's ExpertsInterface name), and calls with an image that
fall back to transformers with one log line."""

import logging

import pytest
import torch
from transformers.models.qwen3_vl_moe import modeling_qwen3_vl_moe

import moegraph
from moegraph.kernels import router_topk
from moegraph.models import qwen3_vl_moe
from moegraph.testing import build_model, make_config

from _cases import (assert_class_patch_greedy_equals_transformers,
                    assert_patch_model_greedy_equals_transformers,
                    assert_prefill_runs_moegraphs_experts,
                    eos_mid_batch_case)

VOCAB = 500  # text tokens below the tiny preset's image/video/vision-start/end ids (500-503)


def _model(seed=0, **overrides):
    """tiny-qwen3-vl-moe with random q_norm / k_norm weights (the initializer leaves them all ones), routers that
    route decisively and experts whose output weighs in the residual stream (at the initializer's std 0.02 a
    router that skipped its renormalisation, or a wrong expert, would still give the same tokens)."""
    model = build_model("tiny-qwen3-vl-moe", seed=seed, **overrides)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in model.model.language_model.layers:
            for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
                norm.weight.copy_(1 + 0.5 * torch.randn(norm.weight.shape, generator=gen))
            if hasattr(layer.mlp, "experts"):
                layer.mlp.gate.weight.mul_(10)
                layer.mlp.experts.gate_up_proj.mul_(10)
                layer.mlp.experts.down_proj.mul_(10)
    return model


@pytest.fixture(scope="module")
def model():
    return _model()


@pytest.fixture(scope="module")
def case(model):
    """Rows that stop at different steps and unpatched transformers' tokens (_cases.eos_mid_batch_case)."""
    inputs, kwargs, want = eos_mid_batch_case(model, vocab_size=VOCAB)
    assert (want[1:, -1] != 0).all()  # the other rows ran to the end
    return inputs, kwargs, want


def _image_inputs(model, seed=0):
    """One row: text, a 16 x 16-pixel image as transformers' processor lays it out (a 1 x 4 x 4 grid of 4 x 4
    patches, merged 2 x 2 into 4 image tokens between vision start/end), text."""
    config = model.config
    vision = config.vision_config
    gen = torch.Generator().manual_seed(seed)
    grid = torch.tensor([[1, 4, 4]])
    patches = int(grid.prod())
    tokens = patches // vision.spatial_merge_size ** 2
    pixel_values = torch.randn(patches, vision.in_channels * vision.temporal_patch_size * vision.patch_size ** 2,
                               generator=gen)
    ids = torch.cat([torch.randint(3, VOCAB, (4,), generator=gen), torch.tensor([config.vision_start_token_id]),
                     torch.full((tokens,), config.image_token_id), torch.tensor([config.vision_end_token_id]),
                     torch.randint(3, VOCAB, (3,), generator=gen)])[None]
    mm_token_type_ids = (ids == config.image_token_id).long()
    return dict(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=pixel_values, image_grid_thw=grid,
                mm_token_type_ids=mm_token_type_ids)


def test_layout_matches_qwen3_moe(model):
    """Experts in Qwen3-MoE's layout ([E, 2I, H] / [E, H, I]), dispatched through use_experts_implementation."""
    text = model.config.text_config
    block = model.model.language_model.layers[0].mlp
    assert isinstance(block, modeling_qwen3_vl_moe.Qwen3VLMoeTextSparseMoeBlock)
    assert block.experts.gate_up_proj.shape == (text.num_experts, 2 * text.moe_intermediate_size, text.hidden_size)
    assert block.experts.down_proj.shape == (text.num_experts, text.hidden_size, text.moe_intermediate_size)
    assert block.experts.config is text
    assert isinstance(model.model.language_model.layers[1].mlp, modeling_qwen3_vl_moe.Qwen3VLMoeTextMLP)
    big = make_config("qwen3-vl-30b-a3b").text_config
    assert (big.num_hidden_layers, big.hidden_size, big.num_experts, big.num_experts_per_tok,
            big.moe_intermediate_size, big.num_attention_heads, big.num_key_value_heads, big.head_dim) == \
        (48, 2048, 128, 8, 768, 32, 4, 128)


def test_patch_model_greedy_equals_transformers(model, case):
    assert_patch_model_greedy_equals_transformers(model, case)


def test_chunks_and_text_token_types_equal_transformers(model, case):
    """More rows than max_batch_size (the 3D position ids are sliced per chunk), and all-text mm_token_type_ids as
    a processor returns them with a text-only prompt: still the fast path."""
    inputs, kwargs, want = case
    types = torch.zeros_like(inputs["input_ids"])
    moegraph.patch(model, max_batch_size=2)
    try:
        got = model.generate(**inputs, **kwargs, mm_token_type_ids=types)
        stats = moegraph.decode_stats(model)
    finally:
        moegraph.unpatch(model)
    assert stats.fallback_reason is None and stats.chunks == 2
    assert torch.equal(got, want)


def test_class_patch_greedy_equals_transformers(model, case):
    assert_class_patch_greedy_equals_transformers(_model, model, case)


def test_prefill_runs_moegraphs_experts(model, case):
    """The prefill's sparse blocks dispatch through transformers' ExpertsInterface to moegraph's name: one call per
    sparse layer over every prompt token (layer 1 is dense)."""
    sparse_layers = model.config.text_config.num_hidden_layers - 1  # layer 1 is dense
    assert_prefill_runs_moegraphs_experts(model, case, sparse_layers)


def test_image_call_falls_back_with_one_log_line(model, case, caplog):
    """A call with an image goes to transformers (its tokens), saying so once; a text call after it (rope_deltas
    left on the model by the image call) is back on the fast path with transformers' tokens."""
    image = _image_inputs(model)
    want_image = model.generate(**image, max_new_tokens=5, do_sample=False)
    inputs, kwargs, want = case
    moegraph.patch(model, max_batch_size=4)
    caplog.set_level(logging.WARNING, logger="moegraph")
    try:
        for _ in range(2):  # the reason is logged once per model
            assert torch.equal(model.generate(**image, max_new_tokens=5, do_sample=False), want_image)
            assert "image/video inputs" in moegraph.decode_stats(model).fallback_reason
        assert torch.equal(model.generate(**inputs, **kwargs), want)
        assert moegraph.decode_stats(model).fallback_reason is None
    finally:
        moegraph.unpatch(model)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and r.name == "moegraph"]
    assert len(warnings) == 1 and "falls back to transformers" in warnings[0].getMessage()
    assert "pixel_values" in warnings[0].getMessage()


def test_image_tokens_without_pixels_fall_back(model):
    """Image tokens marked in mm_token_type_ids (features passed another way) leave the fast path too."""
    text_only = {"mm_token_type_ids": torch.zeros(2, 3, dtype=torch.long), "pixel_values": None}
    assert qwen3_vl_moe.check_inputs(model, text_only) is None
    assert "image/video tokens" in qwen3_vl_moe.check_inputs(model, {"mm_token_type_ids": torch.tensor([[0, 1]])})
    assert "pixel_values" in qwen3_vl_moe.check_inputs(model, {"pixel_values": torch.zeros(1)})
    equal = torch.arange(5).expand(4, 2, 5)
    assert torch.equal(qwen3_vl_moe.text_position_ids(equal), equal[0])
    shifted = equal.clone()
    shifted[1:] += 3
    assert "components differ" in qwen3_vl_moe.text_position_ids(shifted)


def test_equal_mrope_components_are_plain_rope(model):
    """With three equal components the interleaved recomposition picks every frequency from one position: the
    model's rotary_emb with [3, b, 1] equal positions (what the decode step passes; transformers < 5.25 takes only
    that form) equals plain RoPE of that position."""
    rotary = model.model.language_model.rotary_emb
    positions = torch.tensor([[0], [5], [17]])
    x = torch.zeros(3, 1, 8)
    cos, sin = rotary(x, positions[None].expand(3, -1, -1))
    freqs = positions[..., None].float() * rotary.inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    torch.testing.assert_close(cos, emb.cos(), rtol=0, atol=0)
    torch.testing.assert_close(sin, emb.sin(), rtol=0, atol=0)


def test_router_matches_qwen3_vl_moe_router():
    """Softmax in float32, top-k, always renormalised, the weights cast to the logits' dtype."""
    config = make_config("tiny-qwen3-vl-moe").text_config
    router = modeling_qwen3_vl_moe.Qwen3VLMoeTextTopKRouter(config)
    torch.nn.init.normal_(router.weight)
    hidden = torch.randn(9, config.hidden_size)
    logits, want_w, want_i = router(hidden)
    got_w, got_i = router_topk.router_topk_ref(logits, router.top_k, True)
    assert torch.equal(got_i, want_i) and torch.equal(got_w, want_w)


def test_unsupported_model_error_lists_qwen3_vl_moe():
    llama = torch.nn.Module()
    llama.config = type("Config", (), {"model_type": "llama"})()
    with pytest.raises(moegraph.UnsupportedModelError, match=r"'qwen3_vl_moe'.*Qwen3-VL-30B-A3B"):
        moegraph.patch(llama)

"""The OLMoE family on the CPU, fp32: patched generate() against unpatched transformers (q/k-norm over the whole
projections, clip_qkv, prefill experts through moegraph's ExpertsInterface name), the sliding-window fallback, and
the ops its decode step uses (rms_norm over [b, H*D] rows, OLMoE's router) against transformers' own modules."""

from unittest import mock

import pytest
import torch
from transformers.models.olmoe import modeling_olmoe

import moegraph
from moegraph.kernels import rms_norm, router_topk, triton_available
from moegraph.models import olmoe
from moegraph.testing import build_model, random_prompts

from _cases import (assert_class_patch_greedy_equals_transformers,
                    assert_patch_model_greedy_equals_transformers,
                    assert_prefill_runs_moegraphs_experts,
                    assert_sliding_window_falls_back,
                    eos_mid_batch_case)


def _olmoe(seed=0, **overrides):
    """tiny-olmoe with random q_norm / k_norm weights: a norm over the wrong axis or with the wrong weight slice
    changes the tokens (the initializer leaves them all ones)."""
    model = build_model("tiny-olmoe", seed=seed, **overrides)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in model.model.layers:
            for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
                norm.weight.copy_(1 + 0.5 * torch.randn(norm.weight.shape, generator=gen))
    return model


@pytest.fixture(scope="module")
def model():
    return _olmoe()


@pytest.fixture(scope="module")
def case(model):
    """Rows that stop at different steps and unpatched transformers' tokens (_cases.eos_mid_batch_case)."""
    inputs, kwargs, want = eos_mid_batch_case(model)
    assert (want[1:, -1] != 0).all()  # the other rows ran to the end
    return inputs, kwargs, want


def test_patch_model_greedy_equals_transformers(model, case):
    assert_patch_model_greedy_equals_transformers(model, case)


def test_class_patch_greedy_equals_transformers(model, case):
    assert_class_patch_greedy_equals_transformers(_olmoe, model, case)


def test_prefill_runs_moegraphs_experts(model, case):
    """The prefill's OlmoeSparseMoeBlock dispatches through transformers' ExpertsInterface to moegraph's name:
    one call per layer over every prompt token (the decode steps call the op table's experts directly)."""
    assert_prefill_runs_moegraphs_experts(model, case, sparse_layers=model.config.num_hidden_layers)


def test_clip_qkv_equals_transformers():
    """clip_qkv clamps q and k after their norms, and v, as transformers does; a bound that clips (the logits
    change) gives transformers' tokens on the fast path, with moegraph's Triton kernels too (the interpreter)."""
    clipped = _olmoe(seed=1, num_layers=1, clip_qkv=0.3)
    inputs = random_prompts(2, vocab_size=512, min_len=3, max_len=8, seed=7)
    with torch.no_grad():
        logits = clipped(**inputs).logits
        clipped.config.clip_qkv = None
        assert not torch.allclose(clipped(**inputs).logits, logits, atol=1e-3)  # the bound does clip
        clipped.config.clip_qkv = 0.3
    want = clipped.generate(**inputs, max_new_tokens=6, do_sample=False)
    moegraph.patch(clipped, max_batch_size=4)
    try:
        assert torch.equal(clipped.generate(**inputs, max_new_tokens=6, do_sample=False), want)
        assert moegraph.decode_stats(clipped).fallback_reason is None
    finally:
        moegraph.unpatch(clipped)
    if triton_available(torch.empty(0)):
        from moegraph import ops
        from moegraph.cuda_graph import decoder

        with mock.patch.object(decoder, "ops_for_model",
                               lambda m, backend="auto": ops.ops_for_model(m, backend, kernels="triton")):
            moegraph.patch(clipped, max_batch_size=4)
            try:
                assert torch.equal(clipped.generate(**inputs, max_new_tokens=3, do_sample=False), want[:, :-3])
                assert moegraph.decode_stats(clipped).fallback_reason is None
            finally:
                moegraph.unpatch(clipped)


def test_sliding_window_falls_back_beyond_the_window(caplog):
    """A hand-set sliding_window (transformers' DynamicCache then keeps the last window - 1 positions): calls
    within the window stay on the fast path, longer ones fall back, saying so once."""
    windowed = _olmoe(seed=2, num_layers=1, sliding_window=10)
    assert_sliding_window_falls_back(windowed, caplog)
    assert olmoe.check_positions(windowed, 10) is None and olmoe.check_positions(build_model("tiny-olmoe"), 10**6) \
        is None


def test_unsupported_model_error_lists_olmoe():
    llama = torch.nn.Module()
    llama.config = type("Config", (), {"model_type": "llama"})()
    with pytest.raises(moegraph.UnsupportedModelError, match=r"model_type='llama'.*'olmoe'.*OLMoE-1B-7B"):
        moegraph.patch(llama)


@pytest.mark.parametrize("width", [64, 32])  # tiny-olmoe's q (4 heads x 16) and k (2 kv heads x 16)
def test_whole_projection_norm_is_olmoes_rms_norm(width):
    """q_norm / k_norm normalise each row over all its heads at once: moegraph's rms_norm over [b, H*D] rows."""
    norm = modeling_olmoe.OlmoeRMSNorm(width, eps=1e-5)
    torch.nn.init.normal_(norm.weight, 1.0, 0.5)
    x = torch.randn(3, width) * 4
    want = norm(x)
    assert torch.equal(rms_norm.rms_norm_ref(x, norm.weight, norm.variance_epsilon), want)
    per_head = rms_norm.rms_norm_ref(x.reshape(3, -1, 16), norm.weight.reshape(-1, 16), 1e-5).reshape(3, width)
    assert not torch.allclose(per_head, want)  # a per-head norm (Qwen3-MoE's) is another function
    if triton_available(x):
        torch.testing.assert_close(rms_norm.rms_norm(x, norm.weight, norm.variance_epsilon), want,
                                   atol=1e-6, rtol=1e-6)


def test_router_matches_olmoe_router():
    """Softmax in float32, top-k, not renormalised (norm_topk_prob=False), the weights cast to the logits' dtype."""
    config = build_model("tiny-olmoe").config
    router = modeling_olmoe.OlmoeTopKRouter(config)
    torch.nn.init.normal_(router.weight)
    hidden = torch.randn(9, config.hidden_size)
    logits, want_w, want_i = router(hidden)
    got_w, got_i = router_topk.router_topk_ref(logits, router.top_k, router.norm_topk_prob)
    assert torch.equal(got_i, want_i) and torch.equal(got_w, want_w)
    assert not torch.allclose(want_w.sum(-1), torch.ones(9))  # not renormalised
    bf16_router = modeling_olmoe.OlmoeTopKRouter(config).bfloat16()
    bf16_router.weight.data.copy_(router.weight)
    logits, want_w, want_i = bf16_router(hidden.bfloat16())
    got_w, got_i = router_topk.router_topk_ref(logits, router.top_k, router.norm_topk_prob)
    assert want_w.dtype == got_w.dtype == torch.bfloat16 and torch.equal(got_w, want_w)
    if triton_available(logits):
        logits, want_w, want_i = router(hidden)
        got_w, got_i = router_topk.router_topk(logits, router.top_k, router.norm_topk_prob)
        assert torch.equal(got_i, want_i)
        torch.testing.assert_close(got_w, want_w, atol=1e-6, rtol=1e-6)

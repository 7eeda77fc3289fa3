"""The OLMoE family on the CPU, fp32: patched generate() against unpatched transformers (q/k-norm over the whole
projections, clip_qkv, prefill experts through moegraph's ExpertsInterface name), the sliding-window fallback, and
the ops its decode step uses (rms_norm over [b, H*D] rows, OLMoE's router) against transformers' own modules."""

import logging
from unittest import mock

import pytest
import torch
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
from transformers.models.olmoe import modeling_olmoe

import moegraph
import moegraph.moe.interface
from moegraph.kernels import rms_norm, router_topk, triton_available
from moegraph.models import olmoe
from moegraph.testing import build_model, random_prompts

from _cases import eos_mid_batch_case, patched_generate


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


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Tensors of a few hundred elements: a second intra-op thread only adds synchronisation, which costs seconds
    on a CPU shared with other work (the file takes ~12 s with one thread, up to ~35 s with two on a loaded
    2-core machine). Both sides of every comparison run with the same setting."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


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
    inputs, kwargs, want = case
    got, stats = patched_generate(model, inputs, kwargs)
    assert stats.fallback_reason is None and stats.steps > 0  # the fast loop ran
    assert torch.equal(got, want)


def test_class_patch_greedy_equals_transformers(model, case):
    inputs, kwargs, want = case
    moegraph.patch(max_batch_size=4)
    built_after = _olmoe()
    assert built_after.config._experts_implementation == "moegraph"
    for m in (model, built_after):  # one built before the class patch, one after
        got = m.generate(**inputs, **kwargs)
        assert moegraph.decode_stats(m).fallback_reason is None
        assert torch.equal(got, want)
    moegraph.unpatch()
    assert not moegraph.is_patched(built_after)


def test_prefill_runs_moegraphs_experts(model, case):
    """The prefill's OlmoeSparseMoeBlock dispatches through transformers' ExpertsInterface to moegraph's name:
    one call per layer over every prompt token (the decode steps call the op table's experts directly)."""
    inputs, kwargs, want = case
    moegraph.moe.interface.register_experts()
    spy = mock.Mock(wraps=ALL_EXPERTS_FUNCTIONS._global_mapping["moegraph"])
    moegraph.patch(model, max_batch_size=4)
    try:
        with mock.patch.dict(ALL_EXPERTS_FUNCTIONS._global_mapping, {"moegraph": spy}):
            got = model.generate(**inputs, **kwargs)
    finally:
        moegraph.unpatch(model)
    assert torch.equal(got, want)
    assert spy.call_count == model.config.num_hidden_layers
    assert all(call.args[1].shape[0] == inputs["input_ids"].numel() for call in spy.call_args_list)


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
    short = random_prompts(2, vocab_size=512, min_len=3, max_len=6, seed=5)  # <= 6 + 4 positions: inside
    long = random_prompts(2, vocab_size=512, min_len=9, max_len=11, seed=6)  # up to 11 + 4: past the window
    want_short = windowed.generate(**short, max_new_tokens=4, do_sample=False)
    want_long = windowed.generate(**long, max_new_tokens=4, do_sample=False)
    moegraph.patch(windowed, max_batch_size=4)
    caplog.set_level(logging.WARNING, logger="moegraph")
    try:
        assert torch.equal(windowed.generate(**short, max_new_tokens=4, do_sample=False), want_short)
        assert moegraph.decode_stats(windowed).fallback_reason is None
        for _ in range(2):  # the reason is logged once per model
            assert torch.equal(windowed.generate(**long, max_new_tokens=4, do_sample=False), want_long)
            assert "sliding_window=10" in moegraph.decode_stats(windowed).fallback_reason
    finally:
        moegraph.unpatch(windowed)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "sliding_window" in r.getMessage()]
    assert len(warnings) == 1 and "falls back to transformers" in warnings[0].getMessage()
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

"""The decode loop behind a patched generate() against unpatched transformers, on the CPU (eager loop)."""

import logging

import pytest
import torch
from transformers import GenerationConfig, LogitsProcessorList, TemperatureLogitsWarper
from transformers.generation.streamers import BaseStreamer

import moegraph
from moegraph.testing import build_model, random_prompts


@pytest.fixture(scope="module")
def model():
    return build_model("tiny", seed=0)


def _both(model, inputs, **kwargs):
    """(unpatched transformers output, patched output) for the same call."""
    want = model.generate(**inputs, **kwargs)
    moegraph.patch(model, max_batch_size=8)
    try:
        got = model.generate(**inputs, **kwargs)
        stats = moegraph.decode_stats(model)
    finally:
        moegraph.unpatch(model)
    return want, got, stats


@pytest.mark.parametrize("batch_size", [1, 3, 8])
def test_greedy_equals_transformers_with_unequal_prompts(model, batch_size):
    inputs = random_prompts(batch_size, vocab_size=model.config.vocab_size, min_len=3, max_len=17, seed=batch_size)
    want, got, stats = _both(model, inputs, max_new_tokens=24, do_sample=False)
    assert stats.fallback_reason is None and stats.steps > 0  # the fast loop ran
    assert torch.equal(got, want)


def test_batch_above_max_batch_size_is_chunked(model, moegraph_logs):
    inputs = random_prompts(11, vocab_size=model.config.vocab_size, seed=11)
    want = model.generate(**inputs, max_new_tokens=12, do_sample=False)
    moegraph.patch(model, max_batch_size=4)
    got = model.generate(**inputs, max_new_tokens=12, do_sample=False)
    moegraph.unpatch(model)
    assert torch.equal(got, want)
    assert "chunks of max_batch_size=4" in moegraph_logs.text


def test_eos_mid_batch_pads_finished_rows(model):
    inputs = random_prompts(4, vocab_size=model.config.vocab_size, seed=5)
    free = model.generate(**inputs, max_new_tokens=16, do_sample=False)
    new = free[:, inputs["input_ids"].shape[1]:]
    eos = int(new[0, 3])  # a token row 0 emits mid-way: rows stop at different steps
    want, got, _ = _both(model, inputs, max_new_tokens=16, do_sample=False, eos_token_id=eos, pad_token_id=0)
    assert torch.equal(got, want)
    assert (got[0, inputs["input_ids"].shape[1] + 4:] == 0).all()


def test_all_rows_finish_early_trims_like_transformers(model):
    inputs = random_prompts(1, vocab_size=model.config.vocab_size, seed=9)
    free = model.generate(**inputs, max_new_tokens=20, do_sample=False)
    eos = [int(free[0, -18]), 999]  # a list of EOS ids; the first one appears early
    want, got, _ = _both(model, inputs, max_new_tokens=20, do_sample=False, eos_token_id=eos, pad_token_id=0)
    assert torch.equal(got, want)
    assert got.shape[1] < free.shape[1]


def test_min_new_tokens_and_max_length(model):
    inputs = random_prompts(3, vocab_size=model.config.vocab_size, seed=6)
    free = model.generate(**inputs, max_new_tokens=10, do_sample=False)
    eos = int(free[1, inputs["input_ids"].shape[1]])  # row 1 would stop at once without min_new_tokens
    want, got, _ = _both(model, inputs, max_new_tokens=10, min_new_tokens=6, do_sample=False, eos_token_id=eos,
                         pad_token_id=0)
    assert torch.equal(got, want)
    want, got, _ = _both(model, inputs, max_length=inputs["input_ids"].shape[1] + 5, do_sample=False)
    assert torch.equal(got, want)


def test_generation_config_object_and_return_dict_with_scores(model):
    inputs = random_prompts(2, vocab_size=model.config.vocab_size, seed=3)
    config = GenerationConfig(max_new_tokens=8, do_sample=False, return_dict_in_generate=True, output_scores=True,
                              output_logits=True, pad_token_id=0, eos_token_id=2)
    want, got, stats = _both(model, inputs, generation_config=config)
    assert stats.fallback_reason is None
    assert torch.equal(got.sequences, want.sequences)
    assert len(got.scores) == len(want.scores) == got.sequences.shape[1] - inputs["input_ids"].shape[1]
    for a, b in zip(got.scores, want.scores):
        assert torch.allclose(a, b, atol=1e-5)
    for a, b in zip(got.logits, want.logits):
        assert torch.allclose(a, b, atol=1e-5)


def test_seeded_sampling_is_reproducible(model):
    inputs = random_prompts(3, vocab_size=model.config.vocab_size, seed=4)
    kwargs = dict(max_new_tokens=12, do_sample=True, temperature=0.8, top_k=50, top_p=0.9)
    moegraph.patch(model)
    torch.manual_seed(123)
    first = model.generate(**inputs, **kwargs)
    torch.manual_seed(123)
    second = model.generate(**inputs, **kwargs)
    torch.manual_seed(124)
    third = model.generate(**inputs, **kwargs)
    assert moegraph.decode_stats(model).fallback_reason is None
    moegraph.unpatch(model)
    assert torch.equal(first, second)
    assert not torch.equal(first, third)
    # sampling consumes the generator exactly as transformers does: same seed, same tokens
    torch.manual_seed(123)
    assert torch.equal(model.generate(**inputs, **kwargs), first)


class _Collect(BaseStreamer):
    def __init__(self):
        self.chunks, self.ended = [], False

    def put(self, value):
        self.chunks.append(value.clone())

    def end(self):
        self.ended = True


def test_streamer_receives_the_same_tokens(model):
    inputs = random_prompts(1, vocab_size=model.config.vocab_size, seed=8)
    want_streamer, got_streamer = _Collect(), _Collect()
    want = model.generate(**inputs, max_new_tokens=9, do_sample=False, streamer=want_streamer)
    moegraph.patch(model)
    got = model.generate(**inputs, max_new_tokens=9, do_sample=False, streamer=got_streamer)
    moegraph.unpatch(model)
    assert torch.equal(got, want)
    assert got_streamer.ended and want_streamer.ended
    assert len(got_streamer.chunks) == len(want_streamer.chunks)
    for a, b in zip(got_streamer.chunks, want_streamer.chunks):
        assert torch.equal(a, b)


@pytest.mark.parametrize("kwargs, reason", [
    (dict(num_beams=2), "beam_search"),
    (dict(logits_processor=LogitsProcessorList([TemperatureLogitsWarper(0.5)])), "custom logits processors"),
    (dict(output_attentions=True, return_dict_in_generate=True), "output_attentions"),
    (dict(repetition_penalty=1.3, no_repeat_ngram_size=2, exponential_decay_length_penalty=(2, 1.1)),
     "ExponentialDecayLengthPenalty"),
])
def test_unsupported_settings_fall_back_with_identical_output(model, moegraph_logs, kwargs, reason):
    inputs = random_prompts(2, vocab_size=model.config.vocab_size, seed=12)
    want, got, stats = _both(model, inputs, max_new_tokens=6, do_sample=False, **kwargs)
    want_ids = want if isinstance(want, torch.Tensor) else want.sequences
    got_ids = got if isinstance(got, torch.Tensor) else got.sequences
    assert torch.equal(got_ids, want_ids)
    assert reason in stats.fallback_reason
    lines = [r for r in moegraph_logs.records if "falls back to transformers" in r.getMessage()]
    assert len(lines) == 1 and lines[0].levelno == logging.WARNING


def test_right_padding_stays_on_the_fast_path(model):
    """transformers warns about right padding; its tokens are still defined, and moegraph gives the same."""
    inputs = random_prompts(2, vocab_size=model.config.vocab_size, seed=13, min_len=3, max_len=9)
    inputs = {k: v.flip(1) for k, v in inputs.items()}  # right padded
    want, got, stats = _both(model, inputs, max_new_tokens=4, do_sample=False)
    assert torch.equal(got, want)
    assert stats.fallback_reason is None


def test_repetition_penalty_stays_on_the_fast_path(model):
    inputs = random_prompts(3, vocab_size=model.config.vocab_size, seed=14)
    want, got, stats = _both(model, inputs, max_new_tokens=10, do_sample=False, repetition_penalty=1.5)
    assert stats.fallback_reason is None
    assert torch.equal(got, want)


def test_static_cache_grows_when_a_call_needs_more(model, moegraph_logs):
    moegraph.patch(model, max_batch_size=8)
    small = random_prompts(1, vocab_size=model.config.vocab_size, seed=15)
    model.generate(**small, max_new_tokens=4, do_sample=False)
    large = random_prompts(6, vocab_size=model.config.vocab_size, seed=16)
    got = model.generate(**large, max_new_tokens=300, do_sample=False, eos_token_id=None)
    moegraph.unpatch(model)
    assert "growing the static KV cache" in moegraph_logs.text
    assert torch.equal(got, model.generate(**large, max_new_tokens=300, do_sample=False, eos_token_id=None))


def test_capture_requires_a_patched_model(model):
    with pytest.raises(moegraph.InvalidArgumentError, match="patch"):
        moegraph.capture(model)


def test_triton_decode_kernels_equal_transformers(monkeypatch):
    """The decode step with moegraph's Triton kernels (what CUDA runs), here through Triton's interpreter.

    On the CPU the op table picks the plain-torch references; this forces the kernels, on a 1-layer model
    so that the interpreter stays quick."""
    from moegraph import ops
    from moegraph.cuda_graph import decoder

    model = build_model("tiny", seed=4, num_layers=1)
    monkeypatch.setattr(decoder, "ops_for_model",
                        lambda m, backend="auto": ops.ops_for_model(m, backend, kernels="triton"))
    inputs = random_prompts(3, vocab_size=model.config.vocab_size, seed=21)
    want, got, stats = _both(model, inputs, max_new_tokens=4, do_sample=False)
    assert stats.fallback_reason is None
    assert torch.equal(got, want)


@pytest.mark.parametrize("fuse_norms", [True, False])
def test_norms_fused_into_the_gemvs_after_them(monkeypatch, fuse_norms):
    """With the Triton kernels (the interpreter here) at decode batch sizes, the norm before attention runs inside
    the q/k/v GEMV and the one before the MoE block inside the router's, one launch each per layer and step;
    fuse_norms=False keeps them apart. transformers' tokens either way."""
    from moegraph import ops
    from moegraph.cuda_graph import decoder
    from moegraph.kernels import gemv

    model = build_model("tiny", seed=4, num_layers=2)
    monkeypatch.setattr(decoder, "ops_for_model", lambda m, backend="auto": ops.ops_for_model(
        m, backend, kernels="triton", fuse_norms=fuse_norms))
    calls = {"qkv": 0, "router": 0}
    for name, key in (("add_rms_norm_gemv_group", "qkv"), ("add_rms_norm_gemv", "router")):
        def counted(*args, _fn=getattr(gemv, name), _key=key, **kwargs):
            calls[_key] += 1
            return _fn(*args, **kwargs)
        monkeypatch.setattr(gemv, name, counted)
    inputs = random_prompts(3, vocab_size=model.config.vocab_size, seed=23)
    want, got, stats = _both(model, inputs, max_new_tokens=3, do_sample=False)
    assert stats.fallback_reason is None and torch.equal(got, want)
    launches = (2 if fuse_norms else 0) * (stats.steps - 1)  # layers x decode steps (the first token: prefill's)
    assert calls == {"qkv": launches, "router": launches}


@pytest.mark.parametrize("fuse_norms, fuse_router_norm", [(False, True), (True, False), (False, None)])
def test_the_routers_norm_is_decided_apart_where_asked(fuse_norms, fuse_router_norm):
    """resolve_ops' fuse_router_norm (ops.FUSE_ROUTER_NORM) fuses or separates the router's norm whatever the one
    before attention does; None follows fuse_norms."""
    from moegraph import ops

    table = ops.resolve_ops(torch.device("cpu"), torch.float32, kernels="triton", fuse_norms=fuse_norms,
                            fuse_router_norm=fuse_router_norm)
    why = dict((op, reason) for op, _, reason in table.reasons)["norms"]
    assert ("inside the q/k/v GEMV" in why) == fuse_norms
    assert ("router inside its GEMV" in why) == (fuse_norms if fuse_router_norm is None else fuse_router_norm)


def test_projections_on_tensor_cores_from_5_rows(monkeypatch):
    """gemv.DOT_MAX_ROWS = 16 (off by default until timed): at 5-16 rows q/k/v (with its norm), o_proj and a small
    lm_head run through the GEMV's tensor-core form instead of torch's linear; transformers' tokens either way."""
    from moegraph import ops
    from moegraph.cuda_graph import decoder
    from moegraph.kernels import gemv

    model = build_model("tiny", seed=4, num_layers=1)
    monkeypatch.setattr(decoder, "ops_for_model", lambda m, backend="auto": ops.ops_for_model(
        m, backend, kernels="triton"))
    monkeypatch.setattr(gemv, "DOT_MAX_ROWS", 16)
    forms = []
    for name in ("linear_gemv_group", "add_rms_norm_gemv_group"):
        def counted(*args, _fn=getattr(gemv, name), **kwargs):
            forms.append(kwargs.get("use_dot", False))
            return _fn(*args, **kwargs)
        monkeypatch.setattr(gemv, name, counted)
    inputs = random_prompts(6, vocab_size=model.config.vocab_size, seed=25)
    want, got, stats = _both(model, inputs, max_new_tokens=3, do_sample=False)
    assert stats.fallback_reason is None and torch.equal(got, want)
    # per decode step (bucket 8), the one layer: the norm + q/k/v launch and o_proj on tensor cores, the router's
    # multiply-add GEMV (up to gemv.ROUTER_MAX_ROWS); then the tiny vocabulary's lm_head on tensor cores
    assert forms == [True, True, False, True] * (stats.steps - 1)


def test_failed_capture_warns_and_decodes_eagerly(model, monkeypatch, caplog):
    """A capture that raises must give one warning and the same tokens from the eager loop."""
    from moegraph.cuda_graph import decoder, graphs

    def broken_capture(self, *args, **kwargs):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(decoder.GraphDecoder, "graphs_enabled",
                        lambda self: self._capture_error is None)  # pretend graphs were possible here
    monkeypatch.setattr(graphs.BucketGraphs, "capture", broken_capture)
    inputs = random_prompts(2, vocab_size=model.config.vocab_size, seed=22)
    want, got, stats = _both(model, inputs, max_new_tokens=6, do_sample=False)
    assert torch.equal(got, want)
    assert not stats.graphs
    warnings = [r for r in caplog.records if "capture failed" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING


def test_triton_moe_backend_equals_transformers(model):
    """The fused decode MoE kernels (Triton interpreter on the CPU) give transformers' greedy tokens."""
    inputs = random_prompts(3, vocab_size=model.config.vocab_size, seed=23)
    want = model.generate(**inputs, max_new_tokens=10, do_sample=False)
    moegraph.patch(model, moe_backend="triton")
    got = model.generate(**inputs, max_new_tokens=10, do_sample=False)
    stats = moegraph.decode_stats(model)
    moegraph.unpatch(model)
    assert stats.fallback_reason is None
    assert torch.equal(got, want)


@pytest.mark.parametrize("case", ["num_return_sequences", "positional_without_mask", "use_cache_false",
                                  "one_new_token"])
def test_more_generate_forms_equal_transformers(model, case):
    inputs = random_prompts(2, vocab_size=model.config.vocab_size, seed=24)
    args, kwargs = (), dict(inputs, max_new_tokens=6, do_sample=False)
    if case == "num_return_sequences":
        kwargs.update(do_sample=True, num_return_sequences=3)
    elif case == "positional_without_mask":
        args, kwargs = (inputs["input_ids"][:1, -5:],), dict(max_new_tokens=6, do_sample=False)
    elif case == "use_cache_false":
        kwargs["use_cache"] = False
    else:
        kwargs["max_new_tokens"] = 1
    torch.manual_seed(0)
    want = model.generate(*args, **kwargs)
    moegraph.patch(model)
    torch.manual_seed(0)
    got = model.generate(*args, **kwargs)
    stats = moegraph.decode_stats(model)
    moegraph.unpatch(model)
    assert stats.fallback_reason is None
    assert torch.equal(got, want)

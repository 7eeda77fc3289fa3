"""What every family's CPU tests share: a batch whose rows stop at different steps, and a patched generate()."""

import torch

import moegraph
from moegraph.testing import random_prompts


def eos_mid_batch_case(model, vocab_size: int | None = None, new_tokens: int = 8):
    """Unequal left-padded prompts, an EOS id that row 0 emits mid-way (rows stop at different steps), and
    unpatched transformers' tokens for them: (inputs, generate kwargs, tokens)."""
    inputs = random_prompts(3, vocab_size=vocab_size or model.config.vocab_size, min_len=3, max_len=11, seed=3)
    free = model.generate(**inputs, max_new_tokens=new_tokens, do_sample=False)
    prompt = inputs["input_ids"].shape[1]
    kwargs = dict(max_new_tokens=new_tokens, do_sample=False, eos_token_id=int(free[0, prompt + 3]), pad_token_id=0)
    want = model.generate(**inputs, **kwargs)
    assert (want[0, prompt + 4:] == 0).all()  # row 0 finished mid-batch
    return inputs, kwargs, want


def patched_generate(model, inputs, kwargs, **options) -> tuple[torch.Tensor, object]:
    """generate() under patch(model, **options) (max_batch_size 4 unless given), and its decode_stats."""
    moegraph.patch(model, **{"max_batch_size": 4, **options})
    try:
        return model.generate(**inputs, **kwargs), moegraph.decode_stats(model)
    finally:
        moegraph.unpatch(model)


def assert_patch_model_greedy_equals_transformers(model, case):
    """patch(model): the fast loop runs and gives unpatched transformers' tokens."""
    inputs, kwargs, want = case
    got, stats = patched_generate(model, inputs, kwargs)
    assert stats.fallback_reason is None and stats.steps > 0  # the fast loop ran
    assert torch.equal(got, want)


def assert_class_patch_greedy_equals_transformers(build, model, case):
    """patch() of the classes covers a model built before it (`model`) and one built after (`build()`), both with
    transformers' tokens; unpatch() gives the second back."""
    from moegraph.moe.interface import model_experts_implementation

    inputs, kwargs, want = case
    moegraph.patch(max_batch_size=4)
    try:
        built_after = build()
        assert model_experts_implementation(built_after) == "moegraph"
        for m in (model, built_after):  # one built before the class patch, one after
            got = m.generate(**inputs, **kwargs)
            assert moegraph.decode_stats(m).fallback_reason is None
            assert torch.equal(got, want)
    finally:
        moegraph.unpatch()
    assert not moegraph.is_patched(built_after)


def assert_prefill_runs_moegraphs_experts(model, case, sparse_layers: int):
    """The prefill's sparse blocks dispatch through transformers' ExpertsInterface to moegraph's name: one call per
    sparse layer over every prompt token (the decode steps call the op table's experts directly)."""
    from unittest import mock

    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    import moegraph.moe.interface

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
    assert spy.call_count == sparse_layers
    assert all(call.args[1].shape[0] == inputs["input_ids"].numel() for call in spy.call_args_list)


def assert_triton_kernels_equal_transformers(model, case, new_tokens: int = 4):
    """The decode step on moegraph's Triton kernels (the interpreter on the CPU): transformers' first tokens."""
    from unittest import mock

    from moegraph import ops
    from moegraph.cuda_graph import decoder

    inputs, kwargs, want = case
    with mock.patch.object(decoder, "ops_for_model",
                           lambda m, backend="auto": ops.ops_for_model(m, backend, kernels="triton")):
        moegraph.patch(model, max_batch_size=4)
        try:
            got = model.generate(**inputs, **dict(kwargs, max_new_tokens=new_tokens))
            assert moegraph.decode_stats(model).fallback_reason is None
        finally:
            moegraph.unpatch(model)
    assert torch.equal(got, want[:, :got.shape[1]])


def assert_sliding_window_falls_back(windowed, caplog, window: int = 10):
    """A model whose sliding window is `window`: a call within it (prompts of 3-6 tokens + 4 new) stays on the fast
    path with transformers' tokens; longer calls (up to 11 + 4) fall back to transformers, saying so once."""
    import logging

    short = random_prompts(2, vocab_size=512, min_len=3, max_len=6, seed=5)  # <= 6 + 4 positions: inside
    long = random_prompts(2, vocab_size=512, min_len=9, max_len=11, seed=6)  # up to 11 + 4: past the window
    assert short["input_ids"].shape[1] == 6  # the longest short call reaches the window's last position
    want_short = windowed.generate(**short, max_new_tokens=4, do_sample=False)
    want_long = windowed.generate(**long, max_new_tokens=4, do_sample=False)
    moegraph.patch(windowed, max_batch_size=4)
    caplog.set_level(logging.WARNING, logger="moegraph")
    try:
        assert torch.equal(windowed.generate(**short, max_new_tokens=4, do_sample=False), want_short)
        assert moegraph.decode_stats(windowed).fallback_reason is None
        for _ in range(2):  # the reason is logged once per model
            assert torch.equal(windowed.generate(**long, max_new_tokens=4, do_sample=False), want_long)
            assert f"sliding_window={window}" in moegraph.decode_stats(windowed).fallback_reason
    finally:
        moegraph.unpatch(windowed)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "sliding_window" in r.getMessage()]
    assert len(warnings) == 1 and "falls back to transformers" in warnings[0].getMessage()

"""The transformers contract of a patched generate(): the returned Cache, continuing from a cache, the inputs
people pass, fallbacks that say so, settings that are honoured, weights that change. CPU, fp32, tiny model,
always against unpatched transformers."""

import copy
import logging

import pytest
import torch
from transformers import DynamicCache, StaticCache

import moegraph
from moegraph.cuda_graph.hf_cache import output_cache_field
from moegraph.testing import build_model, random_prompts

CACHE = output_cache_field()  # "cache" in newer transformers, "past_key_values" in older: generate() takes the same


@pytest.fixture(scope="module")
def model():
    return build_model("tiny", seed=0)


def _patched(model, *args, options=None, **kwargs):
    """(output, decode_stats) of one patched generate()."""
    moegraph.patch(model, **(options or {}))
    try:
        out = model.generate(*args, **kwargs)
        return out, moegraph.decode_stats(model)
    finally:
        moegraph.unpatch(model)


def _both(model, *args, options=None, **kwargs):
    """(unpatched output, patched output, patched stats), each call given its own copy of a cache argument."""
    want = model.generate(*args, **copy.deepcopy(kwargs))
    got, stats = _patched(model, *args, options=options, **kwargs)
    return want, got, stats


def _fallback_lines(logs):
    return [r for r in logs.records if "falls back to transformers" in r.getMessage()]


def _assert_same_cache(got, want):
    assert type(got) is type(want)
    assert int(got.get_seq_length()) == int(want.get_seq_length())
    assert len(got.layers) == len(want.layers)
    for a, b in zip(got.layers, want.layers):
        assert a.keys.shape == b.keys.shape and a.values.shape == b.values.shape
        torch.testing.assert_close(a.keys, b.keys, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(a.values, b.values, rtol=1e-5, atol=1e-5)


def _eos_mid_batch(model, inputs, new_tokens):
    """An EOS id that the first row emits mid-way, so that rows stop at different steps."""
    free = model.generate(**inputs, max_new_tokens=new_tokens, do_sample=False, eos_token_id=None)
    return int(free[0, inputs["input_ids"].shape[1] + new_tokens // 3])


# ----- 1. the returned Cache, and continuing from a cache ----------------------------------------------------
def test_returned_cache_is_what_transformers_returns(model):
    inputs = random_prompts(4, vocab_size=model.config.vocab_size, min_len=3, max_len=11, seed=31)
    eos = _eos_mid_batch(model, inputs, 9)
    want, got, stats = _both(model, **inputs, max_new_tokens=9, do_sample=False, eos_token_id=eos, pad_token_id=0,
                             return_dict_in_generate=True)
    assert stats.fallback_reason is None and stats.steps > 0
    assert torch.equal(got.sequences, want.sequences)
    assert isinstance(getattr(got, CACHE), DynamicCache)
    _assert_same_cache(getattr(got, CACHE), getattr(want, CACHE))  # left padding columns included, as transformers has them


def test_no_cache_is_built_unless_asked(model):
    inputs = random_prompts(2, vocab_size=model.config.vocab_size, seed=32)
    got, stats = _patched(model, **inputs, max_new_tokens=4, do_sample=False)
    assert isinstance(got, torch.Tensor) and stats.fallback_reason is None
    out, _ = _patched(model, **inputs, max_new_tokens=4, do_sample=False, use_cache=False,
                      return_dict_in_generate=True)
    assert getattr(out, CACHE) is None  # as transformers: no cache without use_cache


def _second_turn(inputs, first, new_len=4, seed=0):
    """The next turn of a chat: the first turn's sequences plus new tokens, the mask extended with ones."""
    gen = torch.Generator().manual_seed(seed)
    rows, total = first.sequences.shape
    new = torch.randint(3, 500, (rows, new_len), generator=gen)
    mask = inputs["attention_mask"]
    mask = torch.cat([mask, torch.ones(rows, total - mask.shape[1] + new_len, dtype=mask.dtype)], 1)
    return {"input_ids": torch.cat([first.sequences, new], 1), "attention_mask": mask}


class _PrefillWidths:
    """Records the width of every forward's input into the embedding (the prefill is the first)."""

    def __init__(self, model):
        self.widths = []
        self.handle = model.model.embed_tokens.register_forward_hook(
            lambda module, args, out: self.widths.append(args[0].shape[-1]))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.handle.remove()


@pytest.mark.parametrize("first_turn", ["moegraph", "transformers"])
def test_continue_from_a_cache_prefills_only_the_new_tokens(model, first_turn):
    inputs = random_prompts(3, vocab_size=model.config.vocab_size, min_len=4, max_len=10, seed=33)
    kwargs = dict(max_new_tokens=5, do_sample=False, return_dict_in_generate=True)
    hf_first = model.generate(**inputs, **kwargs)
    first = _patched(model, **inputs, **kwargs)[0] if first_turn == "moegraph" else hf_first
    assert torch.equal(first.sequences, hf_first.sequences)
    turn = _second_turn(inputs, first)
    want = model.generate(**turn, **{CACHE: copy.deepcopy(getattr(hf_first, CACHE))}, **kwargs)
    cache = copy.deepcopy(getattr(first, CACHE))
    with _PrefillWidths(model) as seen:
        got, stats = _patched(model, **turn, **{CACHE: cache}, **kwargs)
    assert stats.fallback_reason is None
    assert seen.widths[0] == turn["input_ids"].shape[1] - getattr(hf_first, CACHE).get_seq_length()  # the uncached suffix
    assert torch.equal(got.sequences, want.sequences)
    assert getattr(got, CACHE) is cache  # transformers continues in the given cache object, and returns it
    _assert_same_cache(getattr(got, CACHE), getattr(want, CACHE))


@pytest.mark.filterwarnings("ignore:.*past_key_values.*:FutureWarning")  # newer transformers deprecate the name
def test_the_older_cache_keyword_stays_on_the_fast_path(model):
    inputs = random_prompts(2, vocab_size=model.config.vocab_size, seed=44)
    kwargs = dict(max_new_tokens=3, do_sample=False, return_dict_in_generate=True)
    first = model.generate(**inputs, **kwargs)
    turn = _second_turn(inputs, first, seed=4)
    want, got, stats = _both(model, **turn, past_key_values=getattr(first, CACHE), **kwargs)
    assert stats.fallback_reason is None
    assert torch.equal(got.sequences, want.sequences)


def test_continue_with_only_the_new_tokens_and_a_full_mask(model):
    """transformers also takes just the uncached tokens when the mask covers the whole sequence."""
    inputs = random_prompts(2, vocab_size=model.config.vocab_size, min_len=4, max_len=8, seed=34)
    first = model.generate(**inputs, max_new_tokens=4, do_sample=False, return_dict_in_generate=True)
    turn = _second_turn(inputs, first, new_len=3, seed=1)
    cached = getattr(first, CACHE).get_seq_length()
    turn["input_ids"] = turn["input_ids"][:, cached:]  # the last generated token (not yet cached) and the new ones
    want, got, stats = _both(model, **turn, max_new_tokens=4, do_sample=False, **{CACHE: getattr(first, CACHE)})
    assert stats.fallback_reason is None
    assert torch.equal(got, want)


def test_continue_from_a_cache_with_inputs_embeds(model):
    """transformers prefills the embeddings past the cached positions; moegraph the same."""
    inputs = random_prompts(2, vocab_size=model.config.vocab_size, min_len=4, max_len=8, seed=43)
    kwargs = dict(max_new_tokens=4, do_sample=False, return_dict_in_generate=True)
    first = model.generate(**inputs, **kwargs)
    turn = _second_turn(inputs, first, seed=3)
    with torch.no_grad():
        embeds = model.model.embed_tokens(turn["input_ids"])
    want, got, stats = _both(model, inputs_embeds=embeds, attention_mask=turn["attention_mask"],
                             **{CACHE: getattr(first, CACHE)}, **kwargs)
    assert stats.fallback_reason is None
    assert torch.equal(got.sequences, want.sequences) and got.sequences.shape[1] == 4
    _assert_same_cache(getattr(got, CACHE), getattr(want, CACHE))


def test_chunked_batch_returns_one_cache_and_continues(model):
    """Rows decoded in chunks of max_batch_size: one Cache as transformers' single loop leaves it, even when
    the chunks stop at different steps (the early chunk's padding tokens are run, as transformers runs them)."""
    inputs = random_prompts(5, vocab_size=model.config.vocab_size, min_len=3, max_len=9, seed=36)
    start = inputs["input_ids"].shape[1]
    free = model.generate(**inputs, max_new_tokens=8, do_sample=False, eos_token_id=None)[:, start:]
    eos = [int(free[0, 2]), int(free[1, 3])]  # the first chunk (rows 0, 1) stops after 4 tokens, the others run on
    assert not any(int(t) in eos for t in free[2:].flatten())
    kwargs = dict(max_new_tokens=8, do_sample=False, eos_token_id=eos, pad_token_id=0, return_dict_in_generate=True)
    options = {"max_batch_size": 2}
    want, got, stats = _both(model, **inputs, options=options, **kwargs)
    assert stats.fallback_reason is None and stats.chunks == 3
    assert torch.equal(got.sequences, want.sequences)
    assert got.sequences.shape[1] == start + 8 and (got.sequences[:2, start + 4:] == 0).all()
    _assert_same_cache(getattr(got, CACHE), getattr(want, CACHE))
    turn = _second_turn(inputs, want, seed=2)
    want2, got2, stats2 = _both(model, **turn, options=options, **{CACHE: getattr(want, CACHE)}, **kwargs)
    assert stats2.fallback_reason is None
    assert torch.equal(got2.sequences, want2.sequences)
    _assert_same_cache(getattr(got2, CACHE), getattr(want2, CACHE))
    want, got, stats = _both(model, **inputs, options=options, cache_implementation="static", **kwargs)
    assert stats.fallback_reason is None and isinstance(getattr(got, CACHE), StaticCache)
    _assert_same_cache(getattr(got, CACHE), getattr(want, CACHE))


def test_static_cache_implementation_returns_a_static_cache(model):
    inputs = random_prompts(3, vocab_size=model.config.vocab_size, seed=36)
    want, got, stats = _both(model, **inputs, max_new_tokens=6, do_sample=False, cache_implementation="static",
                             return_dict_in_generate=True)
    assert stats.fallback_reason is None
    assert torch.equal(got.sequences, want.sequences)
    assert isinstance(getattr(got, CACHE), StaticCache)
    _assert_same_cache(getattr(got, CACHE), getattr(want, CACHE))


@pytest.mark.parametrize("cache_implementation", ["static", None])
def test_an_explicit_compile_config_gets_transformers_compiled_loop(model, cache_implementation, monkeypatch):
    """compile_config asks for transformers' torch.compile'd decode loop: where transformers would compile (a
    static cache; `_compile_all_devices` on the CPU) the call is transformers', else it stays on the fast path."""
    from transformers import CompileConfig

    compiled = []

    def get_compiled_call(compile_config):  # what transformers' loop calls to compile: recorded, not compiled
        compiled.append(compile_config)
        return model.__call__

    monkeypatch.setattr(model, "get_compiled_call", get_compiled_call, raising=False)
    compile_config = CompileConfig()
    compile_config._compile_all_devices = True  # as transformers' own tests force it on the CPU
    inputs = random_prompts(2, vocab_size=model.config.vocab_size, seed=35)
    want, got, stats = _both(model, **inputs, max_new_tokens=4, do_sample=False, compile_config=compile_config,
                             cache_implementation=cache_implementation)
    assert torch.equal(got, want)
    if cache_implementation == "static":
        assert "compile_config" in stats.fallback_reason and len(compiled) == 2  # unpatched and patched
    else:
        assert stats.fallback_reason is None and not compiled


# ----- 2. the inputs people pass ------------------------------------------------------------------------------
@pytest.mark.parametrize("case", ["int32", "right_padding", "padding_in_the_middle", "inputs_embeds",
                                  "inputs_embeds_and_ids", "default_position_ids", "shifted_position_ids",
                                  "logits_to_keep", "static_cache"])
def test_inputs_on_the_fast_path_equal_transformers(model, case):
    inputs = random_prompts(3, vocab_size=model.config.vocab_size, min_len=3, max_len=9, seed=37)
    ids, mask = inputs["input_ids"], inputs["attention_mask"]
    kwargs = dict(input_ids=ids, attention_mask=mask)
    if case == "int32":
        kwargs["input_ids"] = ids.to(torch.int32)
    elif case == "right_padding":  # transformers warns; its tokens are still defined: moegraph gives the same
        kwargs = dict(input_ids=ids.flip(1), attention_mask=mask.flip(1))
    elif case == "padding_in_the_middle":
        mask = mask.clone()
        mask[:, -3] = 0
        kwargs["attention_mask"] = mask
    elif case in ("inputs_embeds", "inputs_embeds_and_ids"):
        with torch.no_grad():
            embeds = model.model.embed_tokens(ids) + 0.01
        kwargs = dict(inputs_embeds=embeds, attention_mask=mask)
        if case == "inputs_embeds_and_ids":
            kwargs["input_ids"] = ids
    elif case == "default_position_ids":
        kwargs["position_ids"] = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
    elif case == "shifted_position_ids":
        kwargs["position_ids"] = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0) + 7
    elif case == "logits_to_keep":
        kwargs["logits_to_keep"] = 0
    else:
        kwargs["cache_implementation"] = "static"
    want, got, stats = _both(model, **kwargs, max_new_tokens=7, do_sample=False)
    assert stats.fallback_reason is None, stats.fallback_reason
    assert torch.equal(got, want)
    if case.startswith("inputs_embeds"):
        assert got.shape[1] == 7 + (ids.shape[1] if case == "inputs_embeds_and_ids" else 0)


@pytest.mark.parametrize("case", ["no_inputs", "output_flags_false"])
def test_calls_that_ask_for_nothing_more_stay_on_the_fast_path(model, case):
    """generate() with no inputs (transformers starts from BOS) and output_attentions / output_hidden_states
    given as False: both come from transformers' own generation tests."""
    if case == "no_inputs":
        kwargs = dict(bos_token_id=1, return_dict_in_generate=True)
    else:
        kwargs = dict(random_prompts(2, vocab_size=model.config.vocab_size, seed=34), output_attentions=False,
                      output_hidden_states=False, return_dict_in_generate=True)
    want, got, stats = _both(model, **kwargs, max_new_tokens=5, do_sample=False)
    assert stats.fallback_reason is None, stats.fallback_reason
    assert torch.equal(got.sequences, want.sequences)


def test_fallback_warns_once_per_model_and_reason(model, moegraph_logs):
    inputs = random_prompts(2, vocab_size=model.config.vocab_size, seed=38)
    moegraph.patch(model)
    try:
        for _ in range(2):
            model.generate(**inputs, max_new_tokens=3, num_beams=2, do_sample=False)
        model.generate(**inputs, max_new_tokens=3, do_sample=False)
        assert moegraph.decode_stats(model).fallback_reason is None  # reset by the next call
        model.generate(**inputs, max_new_tokens=3, do_sample=False, output_hidden_states=True,
                       return_dict_in_generate=True)
    finally:
        moegraph.unpatch(model)
    lines = _fallback_lines(moegraph_logs)
    assert [r.levelno for r in lines] == [logging.WARNING, logging.WARNING]
    assert "beam_search" in lines[0].getMessage() and "output_hidden_states" in lines[1].getMessage()


# ----- 4. settings that are honoured --------------------------------------------------------------------------
def test_max_seq_len_is_honoured_by_a_warned_fallback(model, moegraph_logs):
    inputs = random_prompts(2, vocab_size=model.config.vocab_size, min_len=5, max_len=10, seed=39)
    moegraph.patch(model, max_seq_len=24)
    try:
        model.generate(**inputs, max_new_tokens=8, do_sample=False)
        assert moegraph.decode_stats(model).fallback_reason is None
        from moegraph.patches.api import _decoder_for

        assert _decoder_for(model).cache.positions == 24
        got = [model.generate(**inputs, max_new_tokens=n, do_sample=False) for n in (20, 30)]
        reason = moegraph.decode_stats(model).fallback_reason
    finally:
        moegraph.unpatch(model)
    assert "max_seq_len=24" in reason and "40 positions" in reason and "raise max_seq_len" in reason
    lines = _fallback_lines(moegraph_logs)
    assert len(lines) == 1 and lines[0].levelno == logging.WARNING  # once, though the numbers differ
    for n, out in zip((20, 30), got):
        assert torch.equal(out, model.generate(**inputs, max_new_tokens=n, do_sample=False))


def test_decode_stats_cover_the_whole_call(model):
    inputs = random_prompts(5, vocab_size=model.config.vocab_size, seed=40)
    moegraph.patch(model, max_batch_size=2)
    try:
        model.generate(**inputs, max_new_tokens=6, do_sample=False, eos_token_id=None)
        stats = moegraph.decode_stats(model)
        assert (stats.batch_size, stats.chunks, stats.steps) == (5, 3, 18)
        assert stats.prefill_seconds > 0 and stats.decode_seconds > 0
        model.generate(**inputs, max_new_tokens=3, num_beams=2, do_sample=False)
        assert "beam_search" in moegraph.decode_stats(model).fallback_reason
        with pytest.raises(ValueError):  # transformers refuses it, before any decoding
            model.generate(**inputs, max_length=2, do_sample=False)
        assert moegraph.decode_stats(model).fallback_reason is None and moegraph.decode_stats(model).steps == 0
    finally:
        moegraph.unpatch(model)


def test_capture_on_cpu_says_what_it_did(model, moegraph_logs):
    moegraph.patch(model)
    try:
        moegraph.capture(model, batch_size=2, max_length=64)
        moegraph.capture(model, batch_size=4, max_length=600)
    finally:
        moegraph.unpatch(model)
    text = moegraph_logs.text
    assert "re-capturing" not in text
    assert "capture(): no CUDA graphs on cpu" in text and "growing the static KV cache" in text


def test_unknown_option_names_the_valid_ones(model):
    with pytest.raises(moegraph.InvalidArgumentError, match=r"'max_batch'.*max_batch_size.*max_seq_len"):
        moegraph.patch(model, max_batch=8)
    assert not moegraph.is_patched(model)


# ----- 5. weights that change under the decoder ---------------------------------------------------------------
def test_in_place_weight_update_is_followed():
    model = build_model("tiny", seed=1)
    inputs = random_prompts(2, vocab_size=model.config.vocab_size, seed=41)
    moegraph.patch(model)
    try:
        model.generate(**inputs, max_new_tokens=5, do_sample=False)
        from moegraph.patches.api import _decoder_for

        cache = _decoder_for(model).cache
        with torch.no_grad():  # what an optimizer step does: same storage, new values
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        got = model.generate(**inputs, max_new_tokens=5, do_sample=False)
        assert _decoder_for(model).cache is cache  # nothing was rebuilt
    finally:
        moegraph.unpatch(model)
    assert torch.equal(got, model.generate(**inputs, max_new_tokens=5, do_sample=False))


@pytest.mark.parametrize("how", ["load_state_dict_assign", "new_parameter"])
def test_replaced_weights_are_detected(moegraph_logs, how):
    model, other = build_model("tiny", seed=1), build_model("tiny", seed=2)
    inputs = random_prompts(2, vocab_size=model.config.vocab_size, seed=42)
    moegraph.patch(model)
    try:
        model.generate(**inputs, max_new_tokens=5, do_sample=False)
        if how == "load_state_dict_assign":
            model.load_state_dict(other.state_dict(), assign=True)
        else:
            model.lm_head.weight = torch.nn.Parameter(other.lm_head.weight.detach().clone())
        got = model.generate(**inputs, max_new_tokens=5, do_sample=False)
    finally:
        moegraph.unpatch(model)
    lines = [r for r in moegraph_logs.records if "were replaced" in r.getMessage()]
    assert len(lines) == 1 and lines[0].levelno == logging.INFO
    assert torch.equal(got, model.generate(**inputs, max_new_tokens=5, do_sample=False))

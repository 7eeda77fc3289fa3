"""patch(prefill="graphs") on the CPU (the eager form of what CUDA replays): which calls take it, which keep
transformers' prefill and say why, and that both give transformers' tokens. Every family: tests/models/test_prefill_rows.py."""

import copy

import pytest
import torch
from transformers import DynamicCache

import moegraph
from moegraph.cuda_graph import prefill
from moegraph.options import PatchOptions
from moegraph.cuda_graph.hf_cache import forward_cache_argument, output_cache_field
from moegraph.testing import build_model, random_prompts


@pytest.fixture(scope="module")
def model():
    return build_model("tiny", seed=0)


def _generate(model, inputs, **kwargs):
    moegraph.patch(model, max_batch_size=4, prefill="graphs")
    try:
        return model.generate(**inputs, **kwargs), moegraph.decode_stats(model)
    finally:
        moegraph.unpatch(model)


def test_token_buckets_and_rows():
    assert [prefill.token_bucket(n) for n in (1, 16, 17, 300, 512)] == [16, 16, 32, 512, 512]
    ids = torch.tensor([[0, 0, 5, 6], [7, 8, 9, 10]])
    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    rows = prefill.token_rows(ids, mask, rope_start=torch.tensor([2, 4]))
    assert rows.token_ids.tolist() == [5, 6, 7, 8, 9, 10] and rows.cache_rows.tolist() == [0, 0, 1, 1, 1, 1]
    assert rows.positions.tolist() == [0, 1, 0, 1, 2, 3] and rows.rope_positions.tolist() == [0, 1, 0, 1, 2, 3]
    assert rows.last.tolist() == [1, 5] and rows.lengths.tolist() == [2, 4]
    shifted = prefill.token_rows(ids, mask, torch.tensor([2, 4]), position_ids=torch.arange(4).expand(2, 4) + 10)
    assert shifted.rope_positions.tolist() == [12, 13, 10, 11, 12, 13]  # given position ids win
    assert "differ" in prefill.text_positions(torch.stack([torch.zeros(2, 4), torch.ones(2, 4)]))


def test_default_prefill_is_token_rows_on_cuda_only(model):
    """prefill="auto" (the default): token rows where there are graphs to replay, transformers' forward elsewhere."""
    assert PatchOptions().prefill == "auto"
    assert prefill.resolve_mode("auto", torch.device("cuda", 0)) == "graphs"
    assert prefill.resolve_mode("auto", torch.device("cpu")) == "transformers"
    assert prefill.resolve_mode("graphs", torch.device("cpu")) == "graphs"
    moegraph.patch(model, max_batch_size=4)
    try:
        model.generate(**random_prompts(2, vocab_size=model.config.vocab_size, seed=5), max_new_tokens=2)
        assert moegraph.decode_stats(model).prefill == "transformers: prefill='auto' on cpu"
    finally:
        moegraph.unpatch(model)


def test_prefill_option_is_checked(model):
    with pytest.raises(moegraph.InvalidArgumentError, match="prefill must be one of"):
        moegraph.patch(model, prefill="gpu")


def test_sampled_call_with_token_rows_draws_what_transformers_prefill_draws(model):
    inputs = random_prompts(3, vocab_size=model.config.vocab_size, seed=2)
    sampled = dict(max_new_tokens=6, do_sample=True, temperature=0.8, top_k=20)
    moegraph.patch(model, max_batch_size=4, sampling="device")
    try:
        torch.manual_seed(5)
        want = model.generate(**inputs, **sampled)
    finally:
        moegraph.unpatch(model)
    moegraph.patch(model, max_batch_size=4, sampling="device", prefill="graphs")
    try:
        torch.manual_seed(5)
        got = model.generate(**inputs, **sampled)
        assert moegraph.decode_stats(model).prefill == "graphs"
    finally:
        moegraph.unpatch(model)
    assert torch.equal(got, want)


@pytest.mark.parametrize("case, why", [
    ("continued", "continues from a cache"),
    ("embeds", "inputs_embeds"),
    ("long", "prompt tokens (token rows up to 512)"),
    ("right_padding", "padding after a prompt"),
])
def test_calls_it_does_not_take_keep_transformers_prefill(model, case, why):
    inputs = random_prompts(2, vocab_size=model.config.vocab_size, seed=3)
    kwargs = dict(max_new_tokens=4, do_sample=False)
    if case == "continued":  # a cache holding the first two tokens of each row: the call runs the rest
        prefix = {k: v[:, :2] for k, v in inputs.items()}
        first = model.generate(**prefix, max_new_tokens=1, do_sample=False, return_dict_in_generate=True)
        kwargs[forward_cache_argument(model)] = first
        kwargs["return_dict_in_generate"] = True
    elif case == "embeds":
        inputs = dict(inputs_embeds=model.get_input_embeddings()(inputs["input_ids"]),
                      attention_mask=inputs["attention_mask"])
    elif case == "right_padding":  # what transformers does with it (it warns): the first token from a pad column
        mask = inputs["attention_mask"].flip(1)
        inputs = dict(input_ids=inputs["input_ids"].flip(1), attention_mask=mask)
        assert not mask[:, -1].all()
    else:
        inputs = random_prompts(2, vocab_size=model.config.vocab_size, seed=3, min_len=260, max_len=300)
    def fresh():  # each call its own copy of the cache passed in
        return {k: copy.deepcopy(getattr(v, output_cache_field())) if hasattr(v, "sequences") else v
                for k, v in kwargs.items()}

    want = model.generate(**inputs, **fresh())
    got, stats = _generate(model, inputs, **fresh())
    assert stats.fallback_reason is None and stats.prefill.startswith("transformers: ") and why in stats.prefill
    want_ids = want if isinstance(want, torch.Tensor) else want.sequences
    got_ids = got if isinstance(got, torch.Tensor) else got.sequences
    assert torch.equal(got_ids, want_ids)


def test_masked_columns_inside_a_prompt_are_dropped_as_transformers_masks_them(model):
    """A 0 inside a row's mask (not only left padding): the token rows skip it, as the static cache does, and the
    call gives what transformers' prefill gives on the fast path."""
    g = torch.Generator().manual_seed(3)
    inputs = dict(input_ids=torch.randint(3, model.config.vocab_size, (3, 8), generator=g),
                  attention_mask=torch.tensor([[1] * 8, [1, 1, 0, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 0, 1, 1]]))
    kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    moegraph.patch(model, max_batch_size=4)
    try:
        want = model.generate(**inputs, **kwargs)
    finally:
        moegraph.unpatch(model)
    got, stats = _generate(model, inputs, **kwargs)
    assert stats.prefill == "graphs" and torch.equal(got, want)


@pytest.mark.parametrize("passed_in", [False, True])
def test_returned_cache_holds_the_prompt_and_continues_as_transformers(model, passed_in):
    """return_dict_in_generate (or an empty cache passed in): the returned cache holds the prompts' K/V copied from
    the static cache, transformers' up to rounding in every unmasked column and zeros in the masked ones, then the
    generated tokens'; a second turn from it gives transformers' tokens."""
    inputs = random_prompts(3, vocab_size=model.config.vocab_size, min_len=3, max_len=9, seed=4)
    kwargs = dict(max_new_tokens=5, do_sample=False, return_dict_in_generate=True)
    name = forward_cache_argument(model)
    extra = (lambda: {name: DynamicCache(config=model.config)}) if passed_in else dict
    want = model.generate(**inputs, **kwargs, **extra())
    got, stats = _generate(model, inputs, **kwargs, **extra())
    assert stats.prefill == "graphs" and torch.equal(got.sequences, want.sequences)
    field = output_cache_field()
    mine, theirs = getattr(got, field), getattr(want, field)
    masked = (inputs["attention_mask"] == 0)[:, None, :, None]
    width = inputs["input_ids"].shape[1]
    for a, b in zip(mine.layers, theirs.layers):
        assert a.keys.shape == b.keys.shape
        for x, y in ((a.keys, b.keys), (a.values, b.values)):
            torch.testing.assert_close(x[:, :, :width].masked_fill(masked, 0), y[:, :, :width].masked_fill(masked, 0),
                                       rtol=1e-4, atol=1e-4)
            assert (x[:, :, :width].masked_select(masked.expand_as(x[:, :, :width])) == 0).all()
            torch.testing.assert_close(x[:, :, width:], y[:, :, width:], rtol=1e-4, atol=1e-4)

    rows, total = got.sequences.shape  # the next turn: the sequences plus new tokens, continuing in each cache
    new = torch.randint(3, 500, (rows, 3), generator=torch.Generator().manual_seed(1))
    mask = torch.cat([inputs["attention_mask"], torch.ones(rows, total - width + 3, dtype=torch.long)], 1)
    turn = dict(input_ids=torch.cat([got.sequences, new], 1), attention_mask=mask)
    again = model.generate(**turn, **{name: theirs}, max_new_tokens=4, do_sample=False)
    moegraph.patch(model, max_batch_size=4, prefill="graphs")
    try:
        assert torch.equal(model.generate(**turn, **{name: mine}, max_new_tokens=4, do_sample=False), again)
    finally:
        moegraph.unpatch(model)


def test_chunked_batch_with_a_returned_cache_and_sliding_layers():
    """GPT-OSS (sliding-window layers) in chunks of 2 rows that stop at different steps, returning its cache: the
    chunks' token-row prefills fill their caches, which join into transformers' shapes and tokens."""
    model = build_model("tiny-gpt-oss", seed=0)
    inputs = random_prompts(5, vocab_size=model.config.vocab_size, min_len=3, max_len=9, seed=36)
    start = inputs["input_ids"].shape[1]
    free = model.generate(**inputs, max_new_tokens=8, do_sample=False, eos_token_id=None)[:, start:]
    kwargs = dict(max_new_tokens=8, do_sample=False, eos_token_id=[int(free[0, 2]), int(free[1, 3])], pad_token_id=0,
                  return_dict_in_generate=True)
    want = model.generate(**inputs, **kwargs)
    moegraph.patch(model, max_batch_size=2, prefill="graphs")
    try:
        got = model.generate(**inputs, **kwargs)
        stats = moegraph.decode_stats(model)
    finally:
        moegraph.unpatch(model)
    assert stats.prefill == "graphs" and stats.chunks == 3 and torch.equal(got.sequences, want.sequences)
    field = output_cache_field()
    assert [a.keys.shape for a in getattr(got, field).layers] == [b.keys.shape for b in getattr(want, field).layers]


def test_the_replayed_shapes_give_the_exact_shapes_first_logits(model):
    """CUDA runs the token-row step at its graph's shapes (token rows padded to the bucket, logits for every row of
    the static cache); the CPU at the call's own. The prompts' rows agree up to float32 rounding."""
    from moegraph.patches.api import _patched_decoder

    inputs = random_prompts(3, vocab_size=model.config.vocab_size, seed=1)
    moegraph.patch(model, max_batch_size=4, prefill="graphs")
    try:
        model.generate(**inputs, max_new_tokens=2)
        decoder = _patched_decoder(model, "test")
        rows = prefill.token_rows(inputs["input_ids"], inputs["attention_mask"],
                                  torch.full((3,), inputs["input_ids"].shape[1]))
        tokens = prefill.token_bucket(rows.count)
        assert tokens > rows.count  # spare token rows in play
        decoder.prefill_inputs.load(rows, tokens, spare_position=decoder.cache.positions - 1)
        replayed_shapes = decoder._prefill_forward(tokens)
        decoder.prefill_inputs.load(rows, tokens, spare_position=decoder.cache.positions - 1)
        exact = decoder._prefill_forward(rows.count, 3)
        cache_rows = decoder.cache.rows
    finally:
        moegraph.unpatch(model)
    assert replayed_shapes.shape[0] == cache_rows == 4 and exact.shape[0] == 3
    torch.testing.assert_close(replayed_shapes[:3], exact, rtol=1e-5, atol=1e-5)

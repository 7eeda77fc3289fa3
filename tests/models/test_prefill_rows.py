"""A prompt through a family's decode step with one row per prompt token (cache_rows, logit_rows): what a captured
prefill will run. For every family, fp32 on the CPU: the last tokens' logits equal transformers' forward over the
same prompts, and the static cache holds what decoding the prompts one token at a time writes."""

import pytest
import torch

from moegraph.cuda_graph.static_cache import StaticKVCache
from moegraph.models import decoder_stack, family_of
from moegraph.ops import ops_for_model
from moegraph.testing import build_model

PRESETS = ["tiny", "tiny-mixtral", "tiny-olmoe", "tiny-qwen2-moe", "tiny-glm4-moe", "tiny-qwen3-vl-moe",
           "tiny-gpt-oss"]
LENGTHS = (5, 3)  # two prompts, no padding: row 0 of 5 tokens, row 1 of 3


def _cache(model, rows=3, positions=16):
    config = model.config.get_text_config()
    head_dim = decoder_stack(model).layers[0].self_attn.head_dim
    return StaticKVCache.allocate(num_layers=config.num_hidden_layers, rows=rows, positions=positions,
                                  kv_heads=config.num_key_value_heads, head_dim=head_dim, dtype=model.dtype,
                                  device=model.device)


def _prompts(model):
    vocab = min(model.config.get_text_config().vocab_size, 500)  # below Qwen3-VL's image / video ids
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(3, vocab, (n,), generator=gen) for n in LENGTHS]


@pytest.mark.parametrize("name", PRESETS)
def test_prompt_tokens_as_rows_equal_transformers_and_one_token_at_a_time(name):
    model = build_model(name, seed=1)
    step = family_of(model).steps().decode_step
    ops = ops_for_model(model)
    prompts = _prompts(model)
    token_ids = torch.cat(prompts)
    cache_rows = torch.cat([torch.full((n,), row) for row, n in enumerate(LENGTHS)])
    positions = torch.cat([torch.arange(n) for n in LENGTHS])
    last = torch.tensor([LENGTHS[0] - 1, sum(LENGTHS) - 1])
    cache = _cache(model)
    with torch.no_grad():
        got = step(model, cache, token_ids, positions, ops, cache_rows=cache_rows, logit_rows=last)
        want = torch.stack([model(input_ids=p[None]).logits[0, -1].float() for p in prompts])
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)

        one = _cache(model)
        for row, prompt in enumerate(prompts):  # the same tokens, one decode step each, in cache row `row`
            for at, token in enumerate(prompt):
                rows_cache = StaticKVCache(keys=[k[row:row + 1] for k in one.keys],
                                           values=[v[row:row + 1] for v in one.values])
                step(model, rows_cache, token[None], torch.tensor([at]), ops)
    for mine, theirs in zip(cache.keys + cache.values, one.keys + one.values):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)
    assert all((k[2] == 0).all() for k in cache.keys)  # no token wrote into a row it does not belong to


@pytest.mark.parametrize("name", PRESETS)
def test_prefill_graphs_gives_transformers_tokens(name):
    """patch(prefill="graphs"): the whole call (left-padded prompts of unequal length, an EOS mid-batch) with its
    prefill as token rows gives unpatched transformers' tokens."""
    import moegraph
    from _cases import eos_mid_batch_case, patched_generate

    model = build_model(name, seed=0)
    inputs, kwargs, want = eos_mid_batch_case(model, vocab_size=min(model.config.get_text_config().vocab_size, 500))
    got, stats = patched_generate(model, inputs, kwargs, prefill="graphs")
    assert stats.prefill == "graphs" and stats.fallback_reason is None
    assert torch.equal(got, want)
    moegraph.patch(model, max_batch_size=2, prefill="graphs")  # 3 rows: two chunks, each its own token rows
    try:
        assert torch.equal(model.generate(**inputs, **kwargs), want)
        assert moegraph.decode_stats(model).chunks == 2
    finally:
        moegraph.unpatch(model)

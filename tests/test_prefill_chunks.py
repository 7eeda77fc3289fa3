"""transformers' prefill of a long prompt in chunks (prefill.transformers_chunks): the same tokens and cache as one
forward, with each chunk's attention mask a fraction of the whole one. On the CPU with tiny chunks forced."""

import pytest
import torch
from transformers import DynamicCache

import moegraph
from moegraph.cuda_graph import prefill
from moegraph.cuda_graph.hf_cache import forward_cache_argument, output_cache_field
from moegraph.testing import build_model, random_prompts


@pytest.fixture(scope="module")
def model():
    return build_model("tiny", seed=0)


@pytest.fixture
def tiny_chunks(monkeypatch):
    """Chunks of 3 positions from any prompt on; the prefill forwards' new positions, recorded."""
    monkeypatch.setattr(prefill, "CHUNK_MASK_ELEMENTS", 1)
    monkeypatch.setattr(prefill, "MIN_CHUNK", 3)
    return []


def _patched(model, inputs, forwards, **kwargs):
    def record(module, args, kw):
        ids = kw.get("input_ids")
        forwards.append((ids if ids is not None else kw["inputs_embeds"]).shape[1])

    moegraph.patch(model, max_batch_size=4, prefill="transformers")
    hook = model.register_forward_pre_hook(record, with_kwargs=True)
    try:
        return model.generate(**inputs, **kwargs), moegraph.decode_stats(model)
    finally:
        hook.remove()
        moegraph.unpatch(model)


def test_chunk_ends():
    assert prefill.transformers_chunks(8, 32768, 32768, {}) == list(range(1024, 32768 + 1, 1024))
    assert prefill.transformers_chunks(1, 512, 512, {}) == [512]  # under the mask bound: one forward
    assert prefill.transformers_chunks(8, 32768, 1000, {}) == [32768]  # 1000 new positions after a cache
    big = prefill.transformers_chunks(8, 40000, 40000, {})
    assert big[-1] == 40000 and all(b - a == 838 for a, b in zip([0] + big[:-2], big[:-1]))
    pixels = {"pixel_values": torch.zeros(8, 3, 4, 4)}  # an input transformers' prefill must see whole
    assert prefill.transformers_chunks(8, 32768, 32768, pixels) == [32768]


def test_left_padded_batch_gives_transformers_tokens(model, tiny_chunks):
    inputs = random_prompts(3, vocab_size=model.config.vocab_size, min_len=5, max_len=11, seed=2)
    kwargs = dict(max_new_tokens=6, do_sample=False)
    want = model.generate(**inputs, **kwargs)
    got, stats = _patched(model, inputs, tiny_chunks, **kwargs)
    width = inputs["input_ids"].shape[1]
    assert stats.prefill.startswith("transformers")  # the decode steps are moegraph's: no forward() of their own
    assert tiny_chunks == [3] * (width // 3) + ([width % 3] if width % 3 else [])
    assert torch.equal(got, want)


def test_returned_cache_and_the_next_turn_in_chunks(model, tiny_chunks):
    """The returned cache holds what one forward leaves (up to float32 rounding); a second turn that passes it in
    prefills its new positions in chunks after the cached ones and gives transformers' tokens."""
    inputs = random_prompts(2, vocab_size=model.config.vocab_size, min_len=7, max_len=10, seed=5)
    kwargs = dict(max_new_tokens=4, do_sample=False, return_dict_in_generate=True)
    want = model.generate(**inputs, **kwargs)
    got, _ = _patched(model, inputs, tiny_chunks, **kwargs)
    assert torch.equal(got.sequences, want.sequences)
    field = output_cache_field()
    mine, theirs = getattr(got, field), getattr(want, field)
    for a, b in zip(mine.layers, theirs.layers):
        torch.testing.assert_close(a.keys, b.keys, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(a.values, b.values, rtol=1e-4, atol=1e-4)

    rows, total = got.sequences.shape
    new = torch.randint(3, 500, (rows, 7), generator=torch.Generator().manual_seed(3))
    turn = dict(input_ids=torch.cat([got.sequences, new], 1),
                attention_mask=torch.cat([inputs["attention_mask"], torch.ones(rows, total - inputs["input_ids"]
                                                                               .shape[1] + 7, dtype=torch.long)], 1))
    name = forward_cache_argument(model)
    again = model.generate(**turn, **{name: theirs}, max_new_tokens=3, do_sample=False)
    del tiny_chunks[:]
    continued, _ = _patched(model, turn, tiny_chunks, **{name: mine}, max_new_tokens=3, do_sample=False)
    assert tiny_chunks == [3, 3, 2]  # the last generated token (never run) and the 7 new ones
    assert torch.equal(continued, again)


def test_inputs_embeds_in_chunks(model, tiny_chunks):
    inputs = random_prompts(2, vocab_size=model.config.vocab_size, min_len=8, max_len=8, seed=9)
    embeds = model.get_input_embeddings()(inputs["input_ids"])
    kwargs = dict(inputs_embeds=embeds, attention_mask=inputs["attention_mask"], max_new_tokens=4, do_sample=False)
    want = model.generate(**kwargs)
    got, stats = _patched(model, {}, tiny_chunks, **kwargs)
    assert stats.fallback_reason is None and tiny_chunks == [3, 3, 2]
    assert torch.equal(got, want)


def test_a_cache_passed_in_empty(model, tiny_chunks):
    inputs = random_prompts(2, vocab_size=model.config.vocab_size, min_len=6, max_len=9, seed=11)
    name = forward_cache_argument(model)
    want = model.generate(**inputs, **{name: DynamicCache(config=model.config)}, max_new_tokens=3, do_sample=False)
    got, _ = _patched(model, inputs, tiny_chunks, **{name: DynamicCache(config=model.config)}, max_new_tokens=3,
                      do_sample=False)
    assert len(tiny_chunks) == 3 and torch.equal(got, want)


@pytest.mark.parametrize("preset", ["tiny-mixtral", "tiny-olmoe", "tiny-qwen2-moe", "tiny-glm4-moe",
                                    "tiny-qwen3-vl-moe", "tiny-gpt-oss"])
def test_every_family_in_chunks(preset, tiny_chunks):
    """Each family's prefill in chunks of 3 gives transformers' tokens; GPT-OSS's sliding layers see prompts past
    their window. Qwen3-VL-MoE (3-D RoPE position ids, not cut) runs one forward."""
    model = build_model(preset, seed=0)
    config = model.config.get_text_config()
    window = getattr(config, "sliding_window", None) or 8
    inputs = random_prompts(3, vocab_size=config.vocab_size, min_len=window + 2, max_len=window + 9, seed=21)
    kwargs = dict(max_new_tokens=5, do_sample=False)
    want = model.generate(**inputs, **kwargs)
    got, stats = _patched(model, inputs, tiny_chunks, **kwargs)
    assert stats.fallback_reason is None and torch.equal(got, want)
    assert len(tiny_chunks) == (1 if preset == "tiny-qwen3-vl-moe" else -(-inputs["input_ids"].shape[1] // 3))

"""The static KV cache's policy on the CPU: it grows to what a call needs, never shrinks by itself, is capped by
max_seq_len, and free_cache() / unpatch() drop it (the GPU memory figures are in test_robustness_cuda.py)."""

import gc
import weakref

import pytest
import torch
from transformers.generation.streamers import BaseStreamer

import moegraph
from moegraph.patches.api import _decoder_for
from moegraph.testing import build_model, random_prompts


@pytest.fixture(scope="module")
def model():
    return build_model("tiny", seed=2)


def _generate(model, batch_size, min_len, max_len, seed=0, **kwargs):
    inputs = random_prompts(batch_size, vocab_size=model.config.vocab_size, min_len=min_len, max_len=max_len,
                            seed=seed)
    return model.generate(**inputs, max_new_tokens=4, do_sample=False, **kwargs)


def _shape(model):
    cache = _decoder_for(model).cache
    return cache.rows, cache.positions


def test_cache_grows_to_the_largest_call_and_keeps_that_size(model):
    moegraph.patch(model, max_batch_size=4)
    try:
        _generate(model, 1, 4, 8)
        rows, positions = _shape(model)
        assert (rows, positions) == (1, 256)  # the bucket of the batch; prompt + new tokens rounded up to 256
        _generate(model, 3, 250, 260)
        assert _shape(model) == (4, 512)  # grown: bucket 4, 260 + 4 positions rounded up
        _generate(model, 1, 4, 8)
        assert _shape(model) == (4, 512)  # a smaller call reuses it: no shrinking, no re-allocation
    finally:
        moegraph.unpatch(model)


def test_free_cache_drops_the_cache_and_the_next_call_builds_it_again(model):
    moegraph.patch(model, max_batch_size=4)
    try:
        want = _generate(model, 2, 4, 12)
        keys = weakref.ref(_decoder_for(model).cache.keys[0])
        moegraph.free_cache(model)
        gc.collect()
        assert keys() is None and _decoder_for(model).cache is None
        assert moegraph.is_patched(model)
        assert torch.equal(_generate(model, 2, 4, 12), want)  # allocated again, same tokens
        assert moegraph.decode_stats(model).fallback_reason is None
    finally:
        moegraph.unpatch(model)


def test_unpatch_drops_the_cache(model):
    moegraph.patch(model)
    _generate(model, 1, 4, 8)
    keys = weakref.ref(_decoder_for(model).cache.keys[0])
    moegraph.unpatch(model)
    gc.collect()
    assert keys() is None


class _FreeAtFirstToken(BaseStreamer):
    def __init__(self, model):
        self.model, self.puts = model, 0

    def put(self, value):
        self.puts += 1
        if self.puts == 2:
            moegraph.free_cache(self.model)  # inside generate(): takes effect when the call returns

    def end(self):
        pass


def test_free_cache_from_a_streamer_waits_for_the_call(model):
    moegraph.patch(model)
    try:
        want = _generate(model, 1, 4, 8)
        got = _generate(model, 1, 4, 8, streamer=_FreeAtFirstToken(model))
        assert torch.equal(got, want) and _decoder_for(model).cache is None
    finally:
        moegraph.unpatch(model)


def test_free_cache_needs_a_patched_model():
    with pytest.raises(moegraph.InvalidArgumentError, match="patch"):
        moegraph.free_cache(build_model("tiny", seed=2, num_layers=1))

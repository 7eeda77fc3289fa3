"""Robustness of a patched generate() on the CPU: threads, exceptions mid-decode, running out of memory.

The GPU versions (real OOM, graphs, a 1,000-call soak) are in test_robustness_cuda.py."""

import threading
import time
import weakref

import pytest
import torch
from transformers.generation.streamers import BaseStreamer

import moegraph
from moegraph.patches.api import _decoder_for
from moegraph.testing import build_model, random_prompts

NEW_TOKENS = 6


@pytest.fixture(scope="module")
def model():
    return build_model("tiny", seed=0)


@pytest.fixture(scope="module")
def reference():
    """The same weights, never patched: what transformers generates."""
    return build_model("tiny", seed=0)


@pytest.fixture
def patched(model):
    moegraph.patch(model, max_batch_size=4)
    yield model
    moegraph.unpatch(model)


def _prompts(model, batch_size, seed, **kwargs):
    return random_prompts(batch_size, vocab_size=model.config.vocab_size, seed=seed, **kwargs)


def _generate(model, inputs, **kwargs):
    return model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False, **kwargs)


class _RaiseAt(BaseStreamer):
    """Raises `error` at the `at`-th put(): the first put is the prompt, so at=3 is the second new token."""

    def __init__(self, error: BaseException | None, at: int = 3):
        self.error, self.at, self.puts = error, at, 0

    def put(self, value):
        self.puts += 1
        if self.puts == self.at:
            raise self.error

    def end(self):
        pass


def test_threads_on_one_model_are_serialised_never_mixed(patched, moegraph_logs):
    """Two threads share one static cache: without the lock their rows would overwrite each other."""
    prompts = [_prompts(patched, 2, seed=1), _prompts(patched, 3, seed=2)]
    want = [_generate(patched, p) for p in prompts]
    decoder = _decoder_for(patched)
    inside, most_inside = [0], [0]
    decode_rows = decoder._decode_rows

    def slow_decode_rows(*args, **kwargs):  # sleeps, so that the other thread would get in
        inside[0] += 1
        most_inside[0] = max(most_inside[0], inside[0])
        time.sleep(0.05)
        try:
            return decode_rows(*args, **kwargs)
        finally:
            inside[0] -= 1

    decoder._decode_rows = slow_decode_rows
    got, errors = {}, []

    def run(i):
        try:
            got[i] = [_generate(patched, prompts[i]) for _ in range(2)]
        except BaseException as exc:  # reported by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    threads[0].start()
    while not inside[0] and threads[0].is_alive():  # the second thread starts while the first one decodes
        time.sleep(0.001)
    threads[1].start()
    for t in threads:
        t.join()
    del decoder._decode_rows
    assert errors == []
    assert most_inside[0] == 1
    for i in range(2):
        assert all(torch.equal(out, want[i]) for out in got[i])
    assert "calls on one model are serialised" in moegraph_logs.text


@pytest.mark.parametrize("error", [KeyboardInterrupt(), RuntimeError("raised by the streamer")],
                         ids=["KeyboardInterrupt", "RuntimeError"])
def test_an_exception_mid_decode_leaves_the_next_call_correct(patched, reference, error):
    other = _prompts(patched, 3, seed=4)
    want = _generate(reference, other)
    with pytest.raises(type(error)):
        _generate(patched, _prompts(patched, 4, seed=3), streamer=_RaiseAt(error))
    assert moegraph.decode_stats(patched).steps == 0  # a call that raised leaves no stats
    assert torch.equal(_generate(patched, other), want)
    assert moegraph.decode_stats(patched).steps > 0


def test_unpatch_from_a_streamer_frees_after_the_call(patched):
    inputs = _prompts(patched, 2, seed=5)
    want = _generate(patched, inputs)
    decoder = _decoder_for(patched)

    class Unpatch(_RaiseAt):
        def put(self, value):
            self.puts += 1
            if self.puts == 3:
                moegraph.unpatch(patched)
                assert decoder.cache is not None  # the running call still decodes into it

    assert torch.equal(_generate(patched, inputs, streamer=Unpatch(None)), want)
    assert not moegraph.is_patched(patched) and decoder.cache is None


def test_capture_from_a_streamer_is_refused(patched):
    class Capture(_RaiseAt):
        def put(self, value):
            moegraph.capture(patched)

    with pytest.raises(moegraph.InvalidArgumentError, match="from inside generate"):
        _generate(patched, _prompts(patched, 2, seed=6), streamer=Capture(None))


def test_out_of_memory_growing_the_cache_keeps_the_old_one(patched, reference, monkeypatch):
    """The third of the new cache's per-layer tensors fails as CUDA's allocator would: the two already made
    are freed at once, the old cache stays, the error is moegraph's (and torch's), and generate() still works."""
    short, long = _prompts(patched, 2, seed=7), _prompts(patched, 2, seed=8, min_len=250, max_len=252)
    want_short, want_long = _generate(reference, short), _generate(reference, long)
    assert torch.equal(_generate(patched, short), want_short)
    decoder = _decoder_for(patched)
    old = decoder.cache
    assert old.positions == 256  # the long prompt needs 512
    made, zeros = [], torch.zeros

    def zeros_failing_at_the_third_layer(*args, **kwargs):
        if len(args) == 1 and len(args[0]) == 4 and args[0][2] == 512:
            if len(made) == 2:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (simulated)")
            tensor = zeros(*args, **kwargs)
            made.append(weakref.ref(tensor))
            return tensor
        return zeros(*args, **kwargs)

    monkeypatch.setattr(torch, "zeros", zeros_failing_at_the_third_layer)
    with pytest.raises(moegraph.OutOfMemoryError) as raised:
        _generate(patched, long)
    assert isinstance(raised.value, torch.cuda.OutOfMemoryError)  # `except torch.cuda.OutOfMemoryError` still works
    message = str(raised.value)
    assert "2 rows x 512 positions" in message and "simulated" in message
    assert "2 rows x 256 positions" in message and "kept" in message and "max_seq_len" in message
    assert len(made) == 2 and all(ref() is None for ref in made)
    assert decoder.cache is old
    monkeypatch.undo()
    assert torch.equal(_generate(patched, short), want_short)
    assert decoder.cache is old
    assert torch.equal(_generate(patched, long), want_long)
    assert decoder.cache.positions == 512

"""Robustness on the GPU: out of memory while growing the cache, interrupts, threads, a 1,000-call soak.

A tiny random model (moegraph.testing) in bf16, so the soak takes seconds; the paths are those of any model:
the static cache, the bucket graphs, the per-model lock. Every test starts from moegraph.capture() (the cache
at max_batch_size rows, every bucket captured), so that tokens compared bit for bit come from the same graphs."""

import gc
import random
import threading

import pytest
import torch
from transformers.generation.streamers import BaseStreamer

import moegraph
from moegraph.cuda_graph.decoder import GraphDecoder
from moegraph.cuda_graph.static_cache import StaticKVCache
from moegraph.patches.api import _decoder_for
from moegraph.testing import build_model, random_prompts

pytestmark = pytest.mark.cuda

MAX_BATCH = 8
NEW_TOKENS = 16
HEADROOM = 1 << 30  # what a nearly full GPU leaves free: room for a call that fits, not for a 4 GiB cache
SOAK_CALLS = 1000


@pytest.fixture(scope="module")
def model():
    return build_model("tiny", device="cuda", dtype=torch.bfloat16, seed=0)


@pytest.fixture
def patched(model):
    moegraph.patch(model, max_batch_size=MAX_BATCH)
    moegraph.capture(model)
    yield model
    moegraph.unpatch(model)


def _prompts(model, batch_size, seed, **kwargs):
    return random_prompts(batch_size, vocab_size=model.config.vocab_size, seed=seed, device="cuda", **kwargs)


def _generate(model, inputs, new_tokens=NEW_TOKENS, **kwargs):
    return model.generate(**inputs, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, **kwargs)


def _sampled(model, inputs):
    return model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=True, temperature=0.7)


def _allocated() -> int:
    """Bytes of live tensors, once nothing of a finished call (an exception's frames) can hold any."""
    gc.collect()
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


def _graphs_ready(model) -> bool:
    stats = moegraph.decode_stats(model)
    return stats.graphs and stats.captures == 0


class _RaiseAt(BaseStreamer):
    """Raises `error` at the third put(): the first put is the prompt, so mid-decode."""

    def __init__(self, error: type[BaseException]):
        self.error, self.puts = error, 0

    def put(self, value):
        self.puts += 1
        if self.puts == 3:
            raise self.error("raised by the streamer")

    def end(self):
        pass


@pytest.mark.parametrize("how", ["larger_than_the_gpu", "gpu_nearly_full"])
def test_out_of_memory_growing_the_cache(patched, how):
    """A call whose cache does not fit raises moegraph's OutOfMemoryError (a torch OutOfMemoryError); the
    partial allocation is freed, the old cache and graphs are kept and still generate the same tokens."""
    inputs = _prompts(patched, 4, seed=1)
    want = _generate(patched, inputs)
    assert _graphs_ready(patched)
    decoder = _decoder_for(patched)
    cache, graphs = decoder.cache, decoder.graphs
    before = _allocated()
    per_position = StaticKVCache.bytes_for(**decoder._cache_layout(cache.rows, 1))
    hog = None
    if how == "gpu_nearly_full":
        torch.cuda.empty_cache()
        hog = torch.empty(torch.cuda.mem_get_info()[0] - HEADROOM, dtype=torch.uint8, device="cuda")
        positions = 4 * HEADROOM // per_position
    else:  # twice the GPU: some layers' tensors are allocated before one fails
        positions = 2 * torch.cuda.get_device_properties(0).total_memory // per_position
    message = None
    try:
        _generate(patched, inputs, new_tokens=positions)
    except moegraph.OutOfMemoryError as error:
        assert isinstance(error, torch.cuda.OutOfMemoryError)
        message = str(error)
    assert message is not None and "ran out of GPU memory" in message
    assert f"{cache.rows} rows x {cache.positions} positions and its decode graphs are kept" in message
    assert decoder.cache is cache and decoder.graphs is graphs
    if hog is not None:  # a call that fits still runs while the GPU is full
        assert torch.equal(_generate(patched, inputs), want) and _graphs_ready(patched)
        del hog
    assert _allocated() == before
    again = _generate(patched, inputs)
    assert torch.equal(again, want) and _graphs_ready(patched)
    del again
    assert _allocated() == before


@pytest.mark.parametrize("error", [KeyboardInterrupt, RuntimeError])
def test_an_exception_mid_decode_leaves_the_next_call_correct(patched, error):
    other = _prompts(patched, 3, seed=4)
    want = _generate(patched, other)
    with pytest.raises(error):
        _generate(patched, _prompts(patched, 5, seed=3), streamer=_RaiseAt(error))
    assert torch.equal(_generate(patched, other), want)
    assert _graphs_ready(patched)  # the graphs were kept


def test_keyboard_interrupt_while_capturing(model, monkeypatch):
    """Ctrl-C during the first capture (seconds on a real model): the half-captured graphs are dropped and
    the next call captures every bucket again and generates the tokens of an uninterrupted run."""
    inputs = _prompts(model, 6, seed=5)
    moegraph.patch(model, max_batch_size=MAX_BATCH)
    try:
        want = _generate(model, inputs)
    finally:
        moegraph.unpatch(model)
    forward, captured = GraphDecoder._forward, []

    def forward_interrupted_in_the_second_capture(self, rows):
        if torch.cuda.is_current_stream_capturing():
            captured.append(rows)
            if len(captured) == 2:
                raise KeyboardInterrupt
        return forward(self, rows)

    monkeypatch.setattr(GraphDecoder, "_forward", forward_interrupted_in_the_second_capture)
    moegraph.patch(model, max_batch_size=MAX_BATCH)
    try:
        with pytest.raises(KeyboardInterrupt):
            _generate(model, inputs)
        assert captured == [8, 4] and _decoder_for(model).graphs.graphs == {}
        got = _generate(model, inputs)
        stats = moegraph.decode_stats(model)
        assert stats.graphs and stats.captures == 4 + 1  # batch buckets 8, 4, 2, 1; the prompts' token bucket
        assert torch.equal(got, want)
    finally:
        moegraph.unpatch(model)


def test_two_threads_on_one_model_get_their_own_tokens(patched):
    prompts = [_prompts(patched, batch, seed=10 + batch) for batch in (1, 3, 5, 8)]
    want = [_generate(patched, p) for p in prompts]
    got, errors = [[], []], []

    def run(thread: int):
        try:
            for i in range(12):
                k = (i + 2 * thread) % len(prompts)  # the two threads ask for different batches
                got[thread].append((k, _generate(patched, prompts[k])))
        except BaseException as exc:  # reported by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(t,)) for t in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert [len(g) for g in got] == [12, 12]
    for k, out in got[0] + got[1]:
        assert torch.equal(out, want[k])


def _soak_call(model, seed: int) -> int:
    """One call of random batch, prompt length, new tokens and sampling; returns the graphs it captured."""
    r = random.Random(seed)
    batch, longest, new_tokens, sample = r.randint(1, MAX_BATCH), r.randint(1, 64), r.randint(1, 16), seed % 4 == 0
    inputs = _prompts(model, batch, seed=seed, min_len=1, max_len=longest)
    sampling = dict(do_sample=True, top_k=20) if sample else dict(do_sample=False)
    out = model.generate(**inputs, max_new_tokens=new_tokens, **sampling)
    stats = moegraph.decode_stats(model)
    assert stats.fallback_reason is None and stats.graphs and out.shape[0] == batch
    return stats.captures


def test_a_thousand_calls_keep_memory_flat_and_capture_nothing_new(patched):
    """After warm-up (capture() and a few calls), 1,000 calls of every batch up to max_batch_size and of
    prompt + new tokens within the cache's 256 positions: live GPU memory never moves and no graph is captured."""
    for seed in range(20):
        _soak_call(patched, seed)
    decoder = _decoder_for(patched)
    captured, flat = decoder.graphs_captured, _allocated()
    memory, new_captures = [], 0
    for i in range(SOAK_CALLS):
        new_captures += _soak_call(patched, 1000 + i)
        if i % 100 == 99:
            memory.append(_allocated())
    assert new_captures == 0 and decoder.graphs_captured == captured
    assert memory == [flat] * len(memory), f"live GPU memory after warm-up {flat}, every 100 calls {memory}"


def test_free_cache_and_unpatch_give_the_gpu_memory_back(model):
    """After a call that grew the cache to max_batch_size rows and 1,024 positions: free_cache() returns live GPU
    memory to what it was before the patch, and so does unpatch() after the next call, and patch / capture /
    unpatch cycles leave nothing behind. The baseline comes after one short patched call: what the first capture
    of a process creates for good (cuBLAS's workspace on moegraph's one capture stream) is not the model's."""
    moegraph.patch(model, max_batch_size=MAX_BATCH)
    _sampled(model, _prompts(model, 1, seed=1))
    moegraph.unpatch(model)
    baseline = _allocated()
    moegraph.patch(model, max_batch_size=MAX_BATCH)
    try:
        want = _generate(model, _prompts(model, MAX_BATCH, seed=3, min_len=900, max_len=1000)).cpu()
        assert _allocated() > baseline + StaticKVCache.bytes_for(
            num_layers=model.config.num_hidden_layers, rows=MAX_BATCH, positions=1024,
            kv_heads=model.config.num_key_value_heads, head_dim=model.model.layers[0].self_attn.head_dim,
            dtype=torch.bfloat16, device=torch.device("meta")) // 2
        moegraph.free_cache(model)
        assert _allocated() == baseline
        got = _generate(model, _prompts(model, MAX_BATCH, seed=3, min_len=900, max_len=1000))
        assert torch.equal(got.cpu(), want)  # built and captured again: the same tokens
        del got
    finally:
        moegraph.unpatch(model)
    assert _allocated() == baseline
    for seed in range(3):
        moegraph.patch(model, max_batch_size=MAX_BATCH)
        moegraph.capture(model)
        _sampled(model, _prompts(model, 4, seed=seed))  # the sampler's graphs too
        moegraph.unpatch(model)
        assert _allocated() == baseline

"""Graph replay on the GPU: captured decoding equals eager decoding bit for bit; agreement with transformers."""

import pytest
import torch

import moegraph
from moegraph.testing import build_model, random_prompts

pytestmark = pytest.mark.cuda

NEW_TOKENS = 32


@pytest.fixture(scope="module")
def model():
    # full-size layer shapes, 2 layers: the real kernels and buckets at a size that builds in seconds
    return build_model("qwen3-30b-a3b", num_layers=2, device="cuda", dtype=torch.bfloat16, seed=0)


def _generate(model, inputs, use_cache=None, **options):
    moegraph.patch(model, **options)
    try:
        cache = {} if use_cache is None else {"use_cache": use_cache}  # use_cache=False: no cache returned
        out = model.generate(**inputs, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                             return_dict_in_generate=True, output_logits=True, **cache)
        stats = moegraph.decode_stats(model)
    finally:
        moegraph.unpatch(model)
    return out, stats


@pytest.mark.parametrize("prefill", ["auto", "transformers"])
@pytest.mark.parametrize("batch_size", [1, 5, 8])
def test_captured_equals_eager_bit_exact(model, batch_size, prefill):
    """The default (prefill="auto": token rows on CUDA) and transformers' prefill, each with its decode graphs."""
    for prompt_seed in range(3):
        inputs = random_prompts(batch_size, vocab_size=model.config.vocab_size, min_len=16, max_len=64,
                                seed=prompt_seed, device="cuda")
        graph_out, graph_stats = _generate(model, inputs, max_batch_size=16, prefill=prefill)
        eager_out, eager_stats = _generate(model, inputs, max_batch_size=16, cuda_graphs=False, prefill=prefill)
        assert graph_stats.graphs and not eager_stats.graphs
        assert graph_stats.prefill == eager_stats.prefill
        assert (graph_stats.prefill == "graphs") == (prefill == "auto")
        assert torch.equal(graph_out.sequences, eager_out.sequences)
        for a, b in zip(graph_out.logits, eager_out.logits):
            assert torch.equal(a, b)


@pytest.mark.parametrize("batch_size", [1, 5, 8])
def test_prefill_graphs_captured_equals_eager_and_follows_transformers_prefill(model, batch_size):
    """patch(prefill="graphs"): the prefill's replayed graph equals its eager run bit for bit (first logits and every
    token after), and its first logits are within bf16 rounding of transformers' prefill on the same prompts."""
    for prompt_seed in range(2):
        inputs = random_prompts(batch_size, vocab_size=model.config.vocab_size, min_len=16, max_len=64,
                                seed=prompt_seed, device="cuda")
        kw = dict(max_batch_size=16, prefill="graphs")
        graph_out, graph_stats = _generate(model, inputs, use_cache=False, **kw)
        eager_out, eager_stats = _generate(model, inputs, use_cache=False, cuda_graphs=False, **kw)
        hf_out, hf_stats = _generate(model, inputs, use_cache=False, max_batch_size=16, prefill="transformers")
        assert graph_stats.prefill == eager_stats.prefill == "graphs" and graph_stats.graphs
        assert hf_stats.prefill.startswith("transformers")
        assert torch.equal(graph_out.sequences, eager_out.sequences)
        for a, b in zip(graph_out.logits, eager_out.logits):
            assert torch.equal(a, b)
        first, want = graph_out.logits[0].float(), hf_out.logits[0].float()
        assert ((first - want).norm() / want.norm()) < 0.02  # bf16 rounding of the same prompt


def test_capture_prepares_the_prefill_graphs_too(model):
    """capture(batch_size, max_length) captures the token buckets such calls can take: the first call captures
    nothing, with the token-row prefill (the default on CUDA)."""
    moegraph.patch(model, max_batch_size=4)
    try:
        moegraph.capture(model, batch_size=4, max_length=64)
        inputs = random_prompts(4, vocab_size=model.config.vocab_size, min_len=20, max_len=40, seed=3, device="cuda")
        model.generate(**inputs, max_new_tokens=8, do_sample=False)
        stats = moegraph.decode_stats(model)
        assert stats.prefill == "graphs" and stats.graphs and stats.captures == 0
    finally:
        moegraph.unpatch(model)


def test_agreement_with_pure_transformers(model, capsys):
    """Report (and bound) how often greedy tokens agree with unpatched transformers in bf16."""
    inputs = random_prompts(3, vocab_size=model.config.vocab_size, min_len=16, max_len=64, seed=7, device="cuda")
    want = model.generate(**inputs, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                          return_dict_in_generate=True, output_logits=True)
    got, _ = _generate(model, inputs, max_batch_size=16)
    prompt = inputs["input_ids"].shape[1]
    agree = 0
    for row in range(3):
        a, b = got.sequences[row, prompt:], want.sequences[row, prompt:]
        diff = (a != b).nonzero()
        if diff.numel() == 0:
            agree += 1
            print(f"row {row}: {NEW_TOKENS}/{NEW_TOKENS} tokens equal")
            continue
        pos = int(diff[0, 0])
        top2 = want.logits[pos][row].float().topk(2).values
        margin = float(top2[0] - top2[1])
        print(f"row {row}: first divergence at new token {pos}, transformers' top-2 logit margin there {margin:.4f}")
        # a divergence is only acceptable where transformers itself was near a tie (bf16 rounding)
        assert margin < 0.25, f"divergence at a confident position (margin {margin})"
    print(f"{agree}/3 rows identical to pure transformers")


def test_weights_changed_under_the_graphs(moegraph_logs):
    """In-place updates: the graphs are kept and read the new values. Replaced parameters: noticed before
    decoding, the graphs are re-captured. Either way the tokens are those of moegraph's eager loop (which reads
    the live weights) with the new weights, bit for bit, and differ from the old weights' tokens."""
    from moegraph.patches.api import _decoder_for

    build = dict(num_layers=1, device="cuda", dtype=torch.bfloat16)
    model = build_model("qwen3-30b-a3b", seed=3, **build)
    original = {k: v.clone() for k, v in model.state_dict().items()}
    other = build_model("qwen3-30b-a3b", seed=4, **build)
    inputs = random_prompts(2, vocab_size=model.config.vocab_size, min_len=8, max_len=24, seed=5, device="cuda")

    def generate():
        return model.generate(**inputs, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)

    def eager():
        moegraph.unpatch(model)
        moegraph.patch(model, max_batch_size=2, cuda_graphs=False)
        out = generate()
        moegraph.unpatch(model)
        moegraph.patch(model, max_batch_size=2)
        return out

    moegraph.patch(model, max_batch_size=2)
    try:
        before = generate()
        decoder = _decoder_for(model)
        graphs = decoder.graphs
        assert moegraph.decode_stats(model).graphs
        with torch.no_grad():
            for p, q in zip(model.parameters(), other.parameters()):
                p.copy_(q)
        in_place = generate()
        assert decoder.graphs is graphs and moegraph.decode_stats(model).capture_seconds == 0
        assert not [r for r in moegraph_logs.records if "were replaced" in r.getMessage()]
        assert not torch.equal(in_place, before)
        assert torch.equal(in_place, eager())

        generate()  # capture again with `other`'s values in place
        graphs = _decoder_for(model).graphs
        model.load_state_dict(original, assign=True)  # new storage: the graphs would read freed or stale memory
        replaced = generate()
        stats = moegraph.decode_stats(model)
        assert stats.graphs and stats.capture_seconds > 0 and _decoder_for(model).graphs is not graphs
        lines = [r for r in moegraph_logs.records if "were replaced" in r.getMessage()]
        assert len(lines) == 1 and "re-capturing" in lines[0].getMessage()
        assert torch.equal(replaced, before)
        assert torch.equal(replaced, eager())
    finally:
        moegraph.unpatch(model)


SAMPLED = dict(do_sample=True, temperature=0.7, top_p=0.9, top_k=50)


def _sampled(model, inputs, seed, extra=None, **options):
    moegraph.patch(model, **options)
    try:
        torch.manual_seed(seed)
        out = model.generate(**inputs, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                             **(extra or SAMPLED))
        stats = moegraph.decode_stats(model)
    finally:
        moegraph.unpatch(model)
    return out, stats


@pytest.mark.parametrize("batch_size", [1, 5, 8])
def test_device_sampling_captured_equals_eager(model, batch_size):
    """Sampling inside the captured sampler graph draws what moegraph's eager loop draws for the same seed
    (temperature, top-k, top-p; and with repetition penalty and min-p); another seed draws other tokens."""
    inputs = random_prompts(batch_size, vocab_size=model.config.vocab_size, min_len=16, max_len=64, seed=1,
                            device="cuda")
    for extra in (SAMPLED, dict(SAMPLED, repetition_penalty=1.3, min_p=0.02, top_k=0)):
        graph_out, graph_stats = _sampled(model, inputs, 11, extra, max_batch_size=16)
        eager_out, eager_stats = _sampled(model, inputs, 11, extra, max_batch_size=16, cuda_graphs=False)
        other, _ = _sampled(model, inputs, 12, extra, max_batch_size=16)
        assert graph_stats.graphs and not eager_stats.graphs
        assert graph_stats.sampling == eager_stats.sampling == "device"
        assert torch.equal(graph_out, eager_out)
        assert not torch.equal(graph_out, other)


@pytest.mark.parametrize("batch_size", [1, 8])
def test_device_sampling_host_time_per_step(model, batch_size, capsys):
    """Sampled decode issues a step in about the host time of greedy decode (the sampler is one graph replay)."""
    inputs = random_prompts(batch_size, vocab_size=model.config.vocab_size, min_len=16, max_len=64, seed=2,
                            device="cuda")
    greedy = dict(do_sample=False)
    for extra in (greedy, SAMPLED):  # warm: capture both
        _sampled(model, inputs, 0, extra, max_batch_size=16)
    runs = {name: min(_sampled(model, inputs, 0, extra, max_batch_size=16)[1].host_ms_per_step for _ in range(3))
            for name, extra in (("greedy", greedy), ("sampled", SAMPLED))}
    print(f"batch {batch_size}: host ms/step greedy {runs['greedy']:.3f}, sampled {runs['sampled']:.3f}")
    assert runs["sampled"] <= runs["greedy"] + 0.05

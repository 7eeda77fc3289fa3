"""moegraph's device sampler (cuda_graph/sampling.py) on the CPU: its processed scores against transformers'
processors, its draws (reproducible, distributed as softmax(scores)), and the decode loop that uses it."""

import itertools

import pytest
import torch
from transformers import LogitsProcessorList
from transformers.generation.logits_process import (MinLengthLogitsProcessor, MinNewTokensLengthLogitsProcessor,
                                                    MinPLogitsWarper, RepetitionPenaltyLogitsProcessor,
                                                    TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

import moegraph
from moegraph.cuda_graph.sampling import DeviceSampler, gumbel_race, plan_sampling, uniform_noise
from moegraph.testing import build_model, random_prompts

CPU = torch.device("cpu")


def _sampler(processors, rows, vocab, prompt_ids, first_row=0, seed=123, call_rows=None):
    plan = plan_sampling(processors, vocab)
    assert not isinstance(plan, str), plan
    sampler = DeviceSampler(plan.stages, rows, vocab, CPU)
    sampler.load(plan, prompt_ids, first_row, seed, call_rows=call_rows or prompt_ids.shape[0])
    return sampler


def _repetition_penalty(penalty, prompt_ignore_length):
    """transformers' processor with a per-row prompt_ignore_length (left padding) where the installed version takes
    one (5.2x); 5.17 takes a single int: the longest, the same for every row."""
    try:
        return RepetitionPenaltyLogitsProcessor(penalty, prompt_ignore_length=prompt_ignore_length)
    except ValueError:
        return RepetitionPenaltyLogitsProcessor(penalty, prompt_ignore_length=int(prompt_ignore_length.max()))


@pytest.mark.parametrize("penalty, temperature, top_k, top_p, min_p", list(itertools.product(
    [None, 1.3, 0.8], [None, 0.7], [None, 50, 5, 2000], [None, 0.9, 0.3], [None, 0.05])))
def test_processed_scores_equal_transformers(penalty, temperature, top_k, top_p, min_p):
    vocab, rows = 1500, 6
    gen = torch.Generator().manual_seed(hash((penalty, temperature, top_k, top_p, min_p)) % 1000)
    mask = torch.ones(rows, 12, dtype=torch.long)
    mask[1, :3] = mask[4, :7] = 0  # left padding: transformers' prompt_ignore_length, per row
    processors = LogitsProcessorList()
    if penalty:
        processors.append(_repetition_penalty(penalty, (mask != 0).int().argmax(1)))
    if temperature:
        processors.append(TemperatureLogitsWarper(temperature))
    if top_k:
        processors.append(TopKLogitsWarper(top_k))
    if top_p:
        processors.append(TopPLogitsWarper(top_p))
    if min_p:
        processors.append(MinPLogitsWarper(min_p))
    for _ in range(5):
        ids = torch.randint(0, vocab, (rows, 12), generator=gen)
        logits = torch.randn(rows, vocab, generator=gen) * 3
        sampler = _sampler(processors, 8, vocab, ids)
        assert torch.equal(sampler.process(logits), processors(ids, logits.clone()))


def test_min_length_processors_follow_the_step():
    vocab = 300
    processors = LogitsProcessorList([MinNewTokensLengthLogitsProcessor(5, 3, torch.tensor([7, 9])),
                                      MinLengthLogitsProcessor(9, torch.tensor([7])), TemperatureLogitsWarper(0.5)])
    sampler = _sampler(processors, 2, vocab, torch.zeros(2, 5, dtype=torch.long))
    for length in range(5, 11):  # the sampler's own counter advances one per draw
        ids, logits = torch.zeros(2, length, dtype=torch.long), torch.randn(2, vocab)
        assert torch.equal(sampler.process(logits), processors(ids, logits.clone())), length
        sampler.sample_(logits)


def test_top_p_after_top_k_with_ties_keeps_what_transformers_keeps_and_whole_ties():
    """Rounded logits tie often. The kept set contains transformers' (whose unstable sort drops part of a tie at
    the boundary) and differs only by tokens tied with the smallest kept value."""
    vocab, rows = 1000, 8
    gen = torch.Generator().manual_seed(0)
    for k, p in itertools.product([50, 5], [0.9, 0.5]):
        processors = LogitsProcessorList([TemperatureLogitsWarper(0.7), TopKLogitsWarper(k), TopPLogitsWarper(p)])
        sampler = _sampler(processors, rows, vocab, torch.zeros(rows, 0, dtype=torch.long))
        for _ in range(10):
            logits = (torch.randn(rows, vocab, generator=gen) * 2).round()
            want, got = processors(None, logits.clone()) > -torch.inf, sampler.process(logits) > -torch.inf
            assert (want <= got).all()
            scaled = logits / 0.7
            smallest = scaled.masked_fill(~got, torch.inf).amin(-1, keepdim=True)
            assert ((got & ~want) <= (scaled == smallest)).all()
            assert (got == (scaled >= smallest)).all()  # a threshold: every tie of the boundary is kept


def test_draws_are_reproducible_per_seed_row_and_step():
    vocab = 50
    args = (torch.tensor(7), torch.tensor(3), torch.arange(4))
    u = uniform_noise(*args, vocab)
    assert u.shape == (4, vocab) and bool(((u > 0) & (u < 1)).all())
    assert torch.equal(u, uniform_noise(*args, vocab))
    assert not torch.equal(u, uniform_noise(torch.tensor(8), *args[1:], vocab))
    assert not torch.equal(u, uniform_noise(args[0], torch.tensor(4), args[2], vocab))
    # a row's noise depends on its row id only, not on its place in the batch (chunks draw the same)
    assert torch.equal(u[2:], uniform_noise(args[0], args[1], torch.arange(2, 4), vocab))
    assert torch.equal(u[:, :20], uniform_noise(*args, 20))


def test_draws_follow_softmax_of_the_scores():
    """Chi-square over 40,000 draws (4 rows x 10,000 steps) on a 6-token vocabulary with a -inf token."""
    scores = torch.tensor([[1.0, 0.0, -1.0, 2.0, 0.5, -torch.inf]]).expand(4, 6)
    steps = torch.arange(10_000)
    counts = torch.zeros(6)
    for step in steps[::1000]:
        for s in range(step, step + 1000):
            counts += torch.bincount(gumbel_race(scores, uniform_noise(torch.tensor(11), torch.tensor(int(s)),
                                                                       torch.arange(4), 6)), minlength=6)
    assert counts[5] == 0
    expected = torch.softmax(scores[0], -1) * counts.sum()
    chi2 = float(((counts[:5] - expected[:5]) ** 2 / expected[:5]).sum())
    assert chi2 < 20.5, (counts, expected)  # 4 degrees of freedom: p = 0.0004


def test_plan_covers_transformers_sampling_processors_only():
    from transformers.generation.logits_process import TypicalLogitsWarper

    assert plan_sampling(LogitsProcessorList([TypicalLogitsWarper(0.9)]), 10) == "logits processor TypicalLogitsWarper"
    assert "filter_value" in plan_sampling(LogitsProcessorList([TopKLogitsWarper(3, filter_value=-1.0)]), 10)
    plan = plan_sampling(LogitsProcessorList([TopKLogitsWarper(3000), TopPLogitsWarper(0.9)]), 100)
    assert plan.stages[0].k == 100 and plan.stages[1].candidates  # k capped at the vocabulary
    plan = plan_sampling(LogitsProcessorList([TopPLogitsWarper(0.9), TopKLogitsWarper(3)]), 100)
    assert not plan.stages[0].candidates  # top-p before top-k sorts the whole vocabulary


# ----- the decode loop with the device sampler forced on the CPU -----------------------------------------

@pytest.fixture(scope="module")
def model():
    return build_model("tiny", seed=0)


SAMPLED = dict(do_sample=True, temperature=0.8, top_k=50, top_p=0.9, repetition_penalty=1.2)


def _generate(model, inputs, seed=1, **kwargs):
    moegraph.patch(model, **{"max_batch_size": 8, "sampling": "device", **kwargs.pop("options", {})})
    try:
        torch.manual_seed(seed)
        out = model.generate(**inputs, **kwargs)
        return out, moegraph.decode_stats(model)
    finally:
        moegraph.unpatch(model)


def test_decode_loop_draws_what_the_sampler_draws_step_by_step(model):
    """The loop's tokens equal a reference loop: transformers' forward for the logits, then the sampler's
    process + race with the call's seed, the call's rows and the step counter."""
    inputs = random_prompts(3, vocab_size=model.config.vocab_size, seed=4)
    out, stats = _generate(model, inputs, max_new_tokens=10, return_dict_in_generate=True, output_logits=True,
                           **SAMPLED)
    assert stats.sampling == "device" and stats.fallback_reason is None
    torch.manual_seed(1)
    seed = int(torch.randint(0, 1 << 62, ()))  # what the call took from the default generator
    processors = model._get_logits_processor(model.generation_config.__class__(**SAMPLED), input_ids_seq_length=
                                             inputs["input_ids"].shape[1], model_kwargs=dict(inputs))
    vocab = model.config.vocab_size
    sequences = out.sequences
    prompt = inputs["input_ids"].shape[1]
    for step, logits in enumerate(out.logits):  # the raw logits the loop saw (they equal transformers', fp32)
        ids = sequences[:, :prompt + step]
        scores = processors(ids, logits.clone())
        u = uniform_noise(torch.tensor(seed), torch.tensor(step), torch.arange(3), vocab)
        assert torch.equal(gumbel_race(scores, u), sequences[:, prompt + step]), step


def test_sampled_decode_is_reproducible_and_chunks_draw_the_same(model):
    inputs = random_prompts(5, vocab_size=model.config.vocab_size, seed=5)
    first, _ = _generate(model, inputs, seed=3, max_new_tokens=12, **SAMPLED)
    again, _ = _generate(model, inputs, seed=3, max_new_tokens=12, **SAMPLED)
    other, _ = _generate(model, inputs, seed=4, max_new_tokens=12, **SAMPLED)
    chunked, stats = _generate(model, inputs, seed=3, max_new_tokens=12, options={"max_batch_size": 2}, **SAMPLED)
    assert torch.equal(first, again) and not torch.equal(first, other)
    assert stats.chunks == 3 and torch.equal(chunked, first)


def test_sampled_decode_with_min_new_tokens_and_eos(model):
    inputs = random_prompts(4, vocab_size=model.config.vocab_size, seed=6)
    free, _ = _generate(model, inputs, seed=5, max_new_tokens=12, eos_token_id=None, **SAMPLED)
    eos = int(free[0, inputs["input_ids"].shape[1] + 2])
    out, stats = _generate(model, inputs, seed=5, max_new_tokens=12, min_new_tokens=6, eos_token_id=eos,
                           pad_token_id=0, **SAMPLED)
    assert stats.sampling == "device"
    new = out[:, inputs["input_ids"].shape[1]:]
    assert not (new[:, :6] == eos).any()  # MinNewTokensLength ran on the device
    for row in new:
        hit = (row == eos).nonzero()
        if hit.numel():
            assert (row[int(hit[0, 0]) + 1:] == 0).all()


@pytest.mark.parametrize("kwargs", [dict(min_new_tokens=6), dict(repetition_penalty=1.3),
                                    dict(min_new_tokens=4, repetition_penalty=0.7)])
def test_greedy_processors_on_the_device_give_transformers_tokens(model, kwargs):
    """A greedy call's min_new_tokens and repetition penalty run in the device sampler (an argmax after them,
    captured on CUDA): the tokens of transformers' own greedy generate()."""
    inputs = random_prompts(4, vocab_size=model.config.vocab_size, seed=11)
    free = model.generate(**inputs, max_new_tokens=10, do_sample=False, eos_token_id=None)
    eos = int(free[1, inputs["input_ids"].shape[1] + 1])  # row 1 would end at its second token
    call = dict(max_new_tokens=10, do_sample=False, eos_token_id=eos, pad_token_id=0, **kwargs)
    want = model.generate(**inputs, **call)
    got, stats = _generate(model, inputs, **call)
    assert stats.sampling == "greedy: device processors" and stats.fallback_reason is None
    assert torch.equal(got, want)
    host, stats = _generate(model, inputs, options={"sampling": "transformers"}, **call)
    assert stats.sampling == "greedy: sampling='transformers' on cpu" and torch.equal(host, want)


def test_greedy_without_processors_stays_an_argmax(model):
    inputs = random_prompts(2, vocab_size=model.config.vocab_size, seed=12)
    _, stats = _generate(model, inputs, max_new_tokens=3, do_sample=False)
    assert stats.sampling == "greedy"
    assert plan_sampling(LogitsProcessorList([]), 10, greedy=True).startswith("greedy without processors")
    assert plan_sampling(LogitsProcessorList([RepetitionPenaltyLogitsProcessor(1.1)]), 10, greedy=True).greedy


@pytest.mark.parametrize("kwargs, why", [
    (dict(typical_p=0.9), "transformers: logits processor TypicalLogitsWarper"),
    (dict(return_dict_in_generate=True, output_scores=True), "transformers: output_scores"),
    (dict(options={"sampling": "transformers"}), "transformers: sampling='transformers'"),
])
def test_uncovered_sampling_takes_transformers_path(model, kwargs, why):
    """What the device sampler does not cover runs transformers' processors and multinomial (same draws as
    transformers), still on the fast path."""
    inputs = random_prompts(2, vocab_size=model.config.vocab_size, seed=7)
    call = dict(max_new_tokens=6, **SAMPLED, **{k: v for k, v in kwargs.items() if k != "options"})
    torch.manual_seed(9)
    want = model.generate(**inputs, **call)
    got, stats = _generate(model, inputs, seed=9, options=kwargs.get("options", {}), **call)
    assert stats.fallback_reason is None and stats.sampling.startswith(why)
    want_ids = want if isinstance(want, torch.Tensor) else want.sequences
    got_ids = got if isinstance(got, torch.Tensor) else got.sequences
    assert torch.equal(got_ids, want_ids)


def test_auto_samples_with_transformers_on_the_cpu(model):
    inputs = random_prompts(2, vocab_size=model.config.vocab_size, seed=8)
    moegraph.patch(model)
    try:
        model.generate(**inputs, max_new_tokens=3, **SAMPLED)
        assert moegraph.decode_stats(model).sampling.startswith("transformers: sampling='auto' on cpu")
        model.generate(**inputs, max_new_tokens=3, do_sample=False)
        assert moegraph.decode_stats(model).sampling == "greedy"
    finally:
        moegraph.unpatch(model)


def test_invalid_sampling_option(model):
    with pytest.raises(moegraph.InvalidArgumentError, match="sampling must be one of"):
        moegraph.patch(model, sampling="gpu")

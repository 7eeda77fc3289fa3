"""moegraph.profile_step / profile_prefill / profile_model: the public way to see what one decode step and one
first token run (the bench's --profile and benchmarks/quick_decode.py use them)."""

import pytest
import torch

import moegraph
from moegraph.testing import build_model, random_prompts


@pytest.fixture(scope="module")
def model():
    return build_model("tiny", seed=3)


def test_profile_step_lists_the_ops_of_one_step_and_leaves_generate_as_it_was(model):
    inputs = random_prompts(2, vocab_size=model.config.vocab_size, seed=4)
    moegraph.patch(model)
    try:
        before = model.generate(**inputs, max_new_tokens=5, do_sample=False)
        profile = moegraph.profile_step(model, batch_size=2)
        after = model.generate(**inputs, max_new_tokens=5, do_sample=False)
    finally:
        moegraph.unpatch(model)
    assert profile.device == "cpu" and profile.graph_replay_ms is None and profile.batch_size == 2
    names = [k.name for k in profile.kernels]
    assert len(names) == len(set(names)) and profile.calls >= 4 * model.config.num_hidden_layers
    assert any("linear" in n or "mm" in n for n in names)  # the projections ran
    totals = [k.total_us for k in profile.kernels]
    assert totals == sorted(totals, reverse=True)
    assert "per decoder layer" in profile.format(top=3) and len(profile.format(top=3).splitlines()) == 4
    assert torch.equal(before, after)


def test_profile_step_runs_distinct_rows_at_a_context(model):
    """Rows of one token id would all route to the same experts: the profiled step would read a fraction of the
    expert weights a real batch reads."""
    from moegraph.patches.api import _decoder_for

    moegraph.patch(model)
    try:
        moegraph.profile_step(model, batch_size=4, context=40)
        inputs = _decoder_for(model).inputs
        assert inputs.token_ids[:4].unique().numel() == 4
        assert inputs.positions[:4].tolist() == [40] * 4 and inputs.rope_positions[:4].tolist() == [40] * 4
    finally:
        moegraph.unpatch(model)


def test_profile_step_of_a_graph_replay_needs_captured_graphs(model):
    moegraph.patch(model)
    try:
        with pytest.raises(moegraph.InvalidArgumentError, match="captured CUDA graphs"):
            moegraph.profile_step(model, graph=True)  # the CPU captures none
    finally:
        moegraph.unpatch(model)


def test_profile_step_needs_a_patched_model(model):
    with pytest.raises(moegraph.InvalidArgumentError, match="moegraph.patch"):
        moegraph.profile_step(model)


def test_profile_prefill_breaks_down_one_first_token_patched_or_not(model):
    plain = moegraph.profile_prefill(model, batch_size=2, prompt_len=6)
    assert not plain.patched and plain.prompt_len == 6 and plain.first_token_ms > 0 and plain.calls > 0
    moegraph.patch(model)
    try:
        patched = moegraph.profile_prefill(model, batch_size=2, prompt_len=6)
    finally:
        moegraph.unpatch(model)
    assert patched.patched and patched.batch_size == 2 and patched.total_us > 0
    assert any("mm" in k.name for k in patched.kernels)
    text = patched.format(top=2)
    assert "moegraph, batch 2, 6-token prompts" in text and len(text.splitlines()) == 3


def test_profile_model_patches_for_the_time_it_takes(model):
    profiles = moegraph.profile_model(model, "all", batch_size=1, prompt_len=5)
    assert set(profiles) == {"decode", "prefill"} and not moegraph.is_patched(model)
    assert isinstance(profiles["decode"], moegraph.StepProfile) and profiles["prefill"].patched
    assert set(moegraph.profile_model(model, "prefill", prompt_len=5)) == {"prefill"}
    with pytest.raises(moegraph.InvalidArgumentError, match="unknown profile"):
        moegraph.profile_model(model, "kernels")

"""moegraph.profile_step: the public way to see what one decode step runs (the bench's --profile uses it)."""

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


def test_profile_step_needs_a_patched_model(model):
    with pytest.raises(moegraph.InvalidArgumentError, match="moegraph.patch"):
        moegraph.profile_step(model)

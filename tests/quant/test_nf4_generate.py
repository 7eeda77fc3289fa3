"""A model with NF4 experts (and Linear4bit projections) through moegraph's op table and decode loop, on the CPU."""

import pytest
import torch

import moegraph
from moegraph.ops import ops_for_model
from moegraph.testing import build_model, random_prompts

pytest.importorskip("bitsandbytes")


@pytest.fixture(scope="module")
def model():
    return build_model("tiny", seed=5, quant="nf4")


def test_op_table_keys_on_the_weight_formats(model):
    ops = ops_for_model(model)
    assert (ops.formats.experts, ops.formats.projections) == ("nf4", "linear4bit")
    assert ops.moe_backend == "grouped_mm" and "nf4" in ops.describe()
    dense = ops_for_model(build_model("tiny", seed=5))
    assert dense.formats.experts == "dense" and dense is not ops


@pytest.mark.parametrize("backend", ["auto", "torch", "triton"])
def test_patched_nf4_model_gives_the_unpatched_nf4_tokens(model, backend):
    inputs = random_prompts(3, vocab_size=model.config.vocab_size, seed=6)
    want = model.generate(**inputs, max_new_tokens=8, do_sample=False)  # NF4Experts' own torch forward
    moegraph.patch(model, moe_backend=backend)
    try:
        got = model.generate(**inputs, max_new_tokens=8, do_sample=False)
        stats = moegraph.decode_stats(model)
    finally:
        moegraph.unpatch(model)
    assert stats.fallback_reason is None and stats.steps > 0
    assert torch.equal(got, want)


def test_nf4_probe_runs_the_nf4_experts():
    from moegraph.moe.select import describe_moe_backend

    choice = describe_moe_backend("cpu", torch.float32, "auto", "nf4")
    assert choice.name == "grouped_mm" and "runs eagerly" in choice.reason

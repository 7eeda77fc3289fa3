"""float16 (GPUs without bf16, e.g. a T4) through moegraph's decode loop on the CPU, against transformers in float16."""

import torch

import moegraph
from moegraph.testing import build_model, random_prompts


def test_float16_tokens_and_logits_follow_transformers():
    model = build_model("tiny", seed=11, dtype=torch.float16)
    inputs = random_prompts(4, vocab_size=model.config.vocab_size, seed=12)
    kwargs = dict(max_new_tokens=16, do_sample=False, return_dict_in_generate=True, output_logits=True)
    want = model.generate(**inputs, **kwargs)
    moegraph.patch(model)
    try:
        got = model.generate(**inputs, **kwargs)
        stats = moegraph.decode_stats(model)
    finally:
        moegraph.unpatch(model)
    assert stats.fallback_reason is None and stats.steps == 16  # moegraph's loop ran, in float16
    assert got.logits[0].dtype == want.logits[0].dtype
    assert torch.equal(got.sequences, want.sequences)
    for a, b in zip(got.logits, want.logits):  # float16 roundings in another order: close, not equal
        assert ((a.float() - b.float()).norm() / b.float().norm()).item() < 5e-3

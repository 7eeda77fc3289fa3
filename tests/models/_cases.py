"""What every family's CPU tests share: a batch whose rows stop at different steps, and a patched generate()."""

import torch

import moegraph
from moegraph.testing import random_prompts


def eos_mid_batch_case(model, vocab_size: int | None = None, new_tokens: int = 8):
    """Unequal left-padded prompts, an EOS id that row 0 emits mid-way (rows stop at different steps), and
    unpatched transformers' tokens for them: (inputs, generate kwargs, tokens)."""
    inputs = random_prompts(3, vocab_size=vocab_size or model.config.vocab_size, min_len=3, max_len=11, seed=3)
    free = model.generate(**inputs, max_new_tokens=new_tokens, do_sample=False)
    prompt = inputs["input_ids"].shape[1]
    kwargs = dict(max_new_tokens=new_tokens, do_sample=False, eos_token_id=int(free[0, prompt + 3]), pad_token_id=0)
    want = model.generate(**inputs, **kwargs)
    assert (want[0, prompt + 4:] == 0).all()  # row 0 finished mid-batch
    return inputs, kwargs, want


def patched_generate(model, inputs, kwargs, **options) -> tuple[torch.Tensor, object]:
    """generate() under patch(model, **options) (max_batch_size 4 unless given), and its decode_stats."""
    moegraph.patch(model, **{"max_batch_size": 4, **options})
    try:
        return model.generate(**inputs, **kwargs), moegraph.decode_stats(model)
    finally:
        moegraph.unpatch(model)

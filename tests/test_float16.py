"""float16 (GPUs without bf16, e.g. a T4) through moegraph's decode loop on the CPU, against transformers in float16."""

import pytest
import torch

import moegraph
from moegraph.testing import build_model, random_prompts

# transformers' top-2 logits at a step where the greedy tokens part: within float16 rounding of a tie (the logits of
# the tiny model are ~0.5, where one float16 ulp is 2**-12)
NEAR_TIE = 2e-3


def _aligned_steps(got, want, prompt_len):
    """Per row, the number of new tokens moegraph and transformers share before they first differ; each difference
    must be at a near-tie of transformers' own logits (its argmax decided by rounding)."""
    aligned = []
    for row in range(want.sequences.shape[0]):
        differ = (got.sequences[row, prompt_len:] != want.sequences[row, prompt_len:]).nonzero()
        if differ.numel() == 0:
            aligned.append(len(want.logits))
            continue
        step = int(differ[0, 0])
        top2 = want.logits[step][row].float().topk(2).values
        assert float(top2[0] - top2[1]) <= NEAR_TIE, f"row {row} differs at new token {step}, not at a near-tie"
        aligned.append(step)
    return aligned


def _patched_generate(model, inputs, kwargs):
    """generate() under patch(model), and what moegraph's loop did."""
    moegraph.patch(model)
    try:
        return model.generate(**inputs, **kwargs), moegraph.decode_stats(model)
    finally:
        moegraph.unpatch(model)


def test_float16_tokens_and_logits_follow_transformers():
    model = build_model("tiny", seed=11, dtype=torch.float16)
    inputs = random_prompts(4, vocab_size=model.config.vocab_size, seed=12)
    kwargs = dict(max_new_tokens=16, do_sample=False, return_dict_in_generate=True, output_logits=True)
    want = model.generate(**inputs, **kwargs)
    got, stats = _patched_generate(model, inputs, kwargs)
    assert stats.fallback_reason is None and stats.steps == 16  # moegraph's loop ran, in float16
    assert got.logits[0].dtype == want.logits[0].dtype
    aligned = _aligned_steps(got, want, inputs["input_ids"].shape[1])
    assert sum(aligned) >= 0.75 * 4 * 16, aligned  # near-ties are rare: most tokens agree
    for step, (a, b) in enumerate(zip(got.logits, want.logits)):  # float16 roundings in another order: close
        rows = [row for row, n in enumerate(aligned) if step <= n]  # same prefix so far
        a, b = a[rows].float(), b[rows].float()
        assert ((a - b).norm() / b.norm()).item() < 5e-3


def test_bf16_on_a_gpu_without_bf16_takes_the_torch_ops_and_says_load_float16(monkeypatch):
    """A T4 (sm_75) has no bf16 for Triton: a bf16 model there gets the plain-torch ops, the MoE probe skips triton,
    and both reasons say to load the model in float16; float16 (and sm_80+) keep moegraph's kernels."""
    from moegraph.errors import InvalidArgumentError
    from moegraph.kernels import triton_dtype_problem
    from moegraph.moe.select import _usable
    from moegraph.ops import _choose_kernels

    cuda = torch.device("cuda")
    assert "float16" in triton_dtype_problem(cuda, torch.bfloat16, capability=(7, 5))
    assert triton_dtype_problem(cuda, torch.bfloat16, capability=(8, 0)) is None
    assert triton_dtype_problem(cuda, torch.float16, capability=(7, 5)) is None
    assert triton_dtype_problem(torch.device("cpu"), torch.bfloat16) is None
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    ops, name, why = _choose_kernels(cuda, torch.bfloat16, 128, "auto")
    assert name == "torch" and "sm_75" in why and "torch.float16" in why
    with pytest.raises(InvalidArgumentError, match="sm_75 has no bf16"):
        _choose_kernels(cuda, torch.bfloat16, 128, "triton")
    assert "sm_75 has no bf16" in _usable("triton", cuda, torch.bfloat16, "dense")


@pytest.mark.parametrize("remove_invalid_values", [False, True])
def test_float16_overflow_goes_as_in_transformers(remove_invalid_values):
    """Activations past float16's range: transformers adds no guard for Qwen3-MoE (no clamp), its logits turn NaN
    and greedy picks what argmax picks; with remove_invalid_values=True its InfNanRemoveLogitsProcessor cleans them.
    moegraph's loop (on the fast path, the processor included) gives the same tokens and NaN where it has NaN."""
    model = build_model("tiny", seed=11, dtype=torch.float16)
    with torch.no_grad():
        model.model.layers[1].mlp.experts.down_proj.mul_(1e6)  # expert outputs overflow to inf in float16
    inputs = random_prompts(3, vocab_size=model.config.vocab_size, seed=12)
    kwargs = dict(max_new_tokens=6, do_sample=False, return_dict_in_generate=True, output_logits=True,
                  remove_invalid_values=remove_invalid_values)
    want = model.generate(**inputs, **kwargs)
    assert torch.isnan(want.logits[0]).any()  # the case is real: transformers overflowed
    got, stats = _patched_generate(model, inputs, kwargs)
    assert stats.fallback_reason is None
    assert torch.equal(got.sequences, want.sequences)
    for a, b in zip(got.logits, want.logits):
        assert torch.equal(torch.isnan(a), torch.isnan(b))

"""Fused experts quantized to NF4 while from_pretrained loads a checkpoint in 4-bit (class-level patch)."""

import logging

import pytest
import torch

import moegraph
from moegraph.testing import build_model, random_prompts

pytest.importorskip("bitsandbytes")
from transformers import AutoModelForCausalLM, BitsAndBytesConfig  # noqa: E402

from moegraph.quant import NF4Experts, quantize_experts  # noqa: E402


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-qwen3-moe")
    build_model("tiny", seed=3).save_pretrained(path)
    return path


def _load(path, **config):
    config.setdefault("bnb_4bit_quant_type", "nf4")
    return AutoModelForCausalLM.from_pretrained(
        path, quantization_config=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch.float32, **config),
        device_map="cpu")


def _experts(model):
    return [layer.mlp.experts for layer in model.model.layers]


def test_experts_are_quantized_while_loading(checkpoint):
    moegraph.patch()
    model = _load(checkpoint)
    assert all(isinstance(e, NF4Experts) for e in _experts(model))
    assert type(model.model.layers[0].self_attn.q_proj).__name__ == "Linear4bit"
    # the same bytes as quantizing the dense checkpoint in memory
    dense = quantize_experts(AutoModelForCausalLM.from_pretrained(checkpoint))
    for got, want in zip(_experts(model), _experts(dense)):
        assert torch.equal(got.gate_up.packed, want.gate_up.packed) and torch.equal(got.down.absmax, want.down.absmax)
    inputs = random_prompts(2, vocab_size=model.config.vocab_size, seed=4)
    model.generate(**inputs, max_new_tokens=6, do_sample=False)
    assert moegraph.decode_stats(model).fallback_reason is None


def test_double_quant_and_skip_modules_are_honoured(checkpoint):
    moegraph.patch()
    model = _load(checkpoint, bnb_4bit_use_double_quant=True, llm_int8_skip_modules=["lm_head", "model.layers.1.mlp"])
    experts = _experts(model)
    assert experts[0].gate_up.double_quant and experts[0].gate_up.absmax.dtype == torch.uint8
    assert not isinstance(experts[1], NF4Experts) and experts[1].gate_up_proj.dtype == torch.float32
    assert all(isinstance(e, NF4Experts) for i, e in enumerate(experts) if i != 1)


def test_fp4_default_warns_that_experts_use_nf4(checkpoint, caplog):
    caplog.set_level(logging.WARNING, logger="moegraph")
    moegraph.patch()
    model = _load(checkpoint, bnb_4bit_quant_type="fp4")
    assert all(isinstance(e, NF4Experts) for e in _experts(model))
    assert "bnb_4bit_quant_type='fp4'" in caplog.text


def test_8bit_is_refused_with_what_works(checkpoint):
    moegraph.patch()
    with pytest.raises(moegraph.InvalidArgumentError, match="load_in_4bit=True"):
        AutoModelForCausalLM.from_pretrained(checkpoint, quantization_config=BitsAndBytesConfig(load_in_8bit=True),
                                             device_map="cpu")


def test_unpatched_loading_is_transformers_own(checkpoint):
    from transformers.quantizers.quantizer_bnb_4bit import Bnb4BitHfQuantizer

    original = Bnb4BitHfQuantizer.__dict__["param_needs_quantization"]
    moegraph.patch()
    moegraph.unpatch()
    assert Bnb4BitHfQuantizer.__dict__["param_needs_quantization"] is original
    model = _load(checkpoint)
    assert not any(isinstance(e, NF4Experts) for e in _experts(model))

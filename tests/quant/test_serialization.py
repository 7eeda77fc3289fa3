"""save_pretrained / from_pretrained of NF4 experts (class-level moegraph.patch()): moegraph's fused layout round trips
byte for byte, and loading without moegraph patched fails saying what to do."""

import json
import logging
from contextlib import contextmanager

import pytest
import torch

import moegraph
from moegraph.testing import build_model, random_prompts

bnb_functional = pytest.importorskip("bitsandbytes.functional")
from safetensors.torch import load_file  # noqa: E402
from transformers import AutoModelForCausalLM, BitsAndBytesConfig  # noqa: E402

from moegraph.quant import NF4Experts, quantize_experts  # noqa: E402
from moegraph.quant.serialization import MARKER  # noqa: E402

PROMPTS = random_prompts(2, vocab_size=512, seed=4)


def _experts(model):
    return [layer.mlp.experts for layer in model.model.layers]


def _tokens(model):
    return model.generate(**PROMPTS, max_new_tokens=6, do_sample=False)


def _load(path, **kwargs):
    return AutoModelForCausalLM.from_pretrained(path, device_map="cpu", **kwargs)


def _assert_same_state(got, want):
    """Every tensor of the two state dicts (NF4 buffers, Linear4bit weights and quant states, dense tensors) is
    byte-identical."""
    got, want = got.state_dict(), want.state_dict()
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name


def _checkpoint(path):
    return load_file(path / "model.safetensors"), json.loads((path / "config.json").read_text())


@pytest.fixture(scope="module")
def dense_checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-dense")
    build_model("tiny", seed=3).save_pretrained(path)
    return path


@pytest.mark.parametrize("double_quant", [False, True])
def test_saved_nf4_model_loads_back_identical(tmp_path, double_quant):
    model = build_model("tiny", seed=5, quant="nf4", double_quant=double_quant)  # quantized in memory
    moegraph.patch()
    model.save_pretrained(tmp_path)
    tensors, config = _checkpoint(tmp_path)
    assert tensors["model.layers.0.mlp.experts.gate_up_proj"].shape == (8, 64 * 64 // 2)  # fused, not per expert
    assert not any(".experts.0." in key for key in tensors) and tensors[MARKER].tolist() == [1]
    assert ("model.layers.0.mlp.experts.down_proj_offset" in tensors) == double_quant
    qc = config["quantization_config"]
    assert (qc["load_in_4bit"], qc["bnb_4bit_quant_type"], qc["bnb_4bit_use_double_quant"]) == (True, "nf4",
                                                                                               double_quant)
    assert qc["llm_int8_skip_modules"] == ["lm_head"]  # the only dense nn.Linear

    loaded = _load(tmp_path)
    assert all(isinstance(e, NF4Experts) for e in _experts(loaded))
    assert type(loaded.model.layers[0].self_attn.q_proj).__name__ == "Linear4bit"
    _assert_same_state(loaded, model)
    assert torch.equal(_tokens(loaded), _tokens(model))

    # a model loaded pre-quantized saves again (transformers alone raises NotImplementedError there): same files
    loaded.save_pretrained(tmp_path / "again")
    again, again_config = _checkpoint(tmp_path / "again")
    assert sorted(again) == sorted(tensors) and all(torch.equal(again[k], t) for k, t in tensors.items())
    assert again_config["quantization_config"] == qc


def test_model_quantized_while_loading_round_trips(tmp_path, dense_checkpoint):
    moegraph.patch()
    config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                bnb_4bit_compute_dtype=torch.float32,
                                llm_int8_skip_modules=["lm_head", "model.layers.1.mlp"])
    model = _load(dense_checkpoint, quantization_config=config)
    model.save_pretrained(tmp_path)
    loaded = _load(tmp_path)  # the saved quantization_config only
    assert loaded.config.quantization_config.to_dict() == model.config.quantization_config.to_dict()
    experts = _experts(loaded)
    assert not isinstance(experts[1], NF4Experts) and experts[1].gate_up_proj.dtype == torch.float32
    assert all(isinstance(e, NF4Experts) and e.gate_up.double_quant for i, e in enumerate(experts) if i != 1)
    _assert_same_state(loaded, model)
    moegraph.unpatch()  # the decode op table takes one experts format per model: a mixed one runs unpatched
    assert torch.equal(_tokens(loaded), _tokens(model))


def test_nf4_experts_with_dense_projections_round_trip(tmp_path):
    model = quantize_experts(build_model("tiny", seed=6))
    moegraph.patch()
    model.save_pretrained(tmp_path)
    assert not hasattr(model.config, "quantization_config")  # written to the checkpoint only
    skips = _checkpoint(tmp_path)[1]["quantization_config"]["llm_int8_skip_modules"]
    assert "model.layers.0.self_attn.q_proj" in skips and "lm_head" in skips
    loaded = _load(tmp_path)
    assert type(loaded.model.layers[0].self_attn.q_proj) is torch.nn.Linear
    assert all(isinstance(e, NF4Experts) for e in _experts(loaded))
    _assert_same_state(loaded, model)
    assert torch.equal(_tokens(loaded), _tokens(model))


# ----- what does not load ---------------------------------------------------------------------------------------------
@contextmanager
def _transformers_warnings():
    """The messages transformers logs at WARNING and above (its loggers do not propagate: caplog misses them)."""
    records = []
    handler = logging.Handler(level=logging.WARNING)
    handler.emit = records.append
    logger = logging.getLogger("transformers")
    logger.addHandler(handler)
    try:
        yield records
    finally:
        logger.removeHandler(handler)


def _messages(records):
    return "\n".join(record.getMessage() for record in records)


def test_loading_without_moegraph_patched_fails_and_says_what_to_do(tmp_path):
    moegraph.patch()
    build_model("tiny", seed=5, quant="nf4").save_pretrained(tmp_path)
    moegraph.unpatch()
    with _transformers_warnings() as records, pytest.raises(RuntimeError):
        _tokens(_load(tmp_path))  # 5.24: at load (size mismatch); 5.17: loads the bytes, the forward raises
    assert MARKER in _messages(records)  # transformers' load report lists it among the unexpected keys


def test_nf4_experts_saved_without_moegraph_patched_are_refused(tmp_path, dense_checkpoint):
    moegraph.patch()
    model = _load(dense_checkpoint, quantization_config=BitsAndBytesConfig(load_in_4bit=True,
                                                                           bnb_4bit_quant_type="nf4"))
    moegraph.unpatch()
    model.save_pretrained(tmp_path)  # transformers splits the packed experts per expert
    moegraph.patch()
    # transformers reports a converter's error in its load report, then raises a RuntimeError of its own
    with _transformers_warnings() as records, pytest.raises(RuntimeError, match="conversion"):
        _load(tmp_path)
    assert "re-save the model with moegraph.patch() called first" in _messages(records)

"""save_pretrained / from_pretrained of NF4 experts (class-level moegraph.patch()): moegraph's fused layout round trips
byte for byte, the per-expert bitsandbytes layout of Hub checkpoints loads into NF4Experts, and loading without
moegraph patched fails saying what to do."""

import json
import logging
from contextlib import contextmanager

import pytest
import torch

import moegraph
from moegraph.testing import build_model, random_prompts

bnb_functional = pytest.importorskip("bitsandbytes.functional")
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import AutoModelForCausalLM, BitsAndBytesConfig  # noqa: E402

from moegraph.quant import NF4Experts, dequantize_nf4, quantize_experts, quantize_nf4, quantize_projections  # noqa: E402
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


# ----- the per-expert bitsandbytes layout of 4-bit Qwen3-MoE checkpoints on the Hub ---------------------------------
def _write_hub_checkpoint(model, path, double_quant):
    """`model` (Linear4bit projections, dense fused experts) as transformers v4 + bitsandbytes saved 4-bit Qwen3-MoE:
    each expert's gate_proj / up_proj / down_proj one bnb 4-bit weight, keys as `QuantState.as_dict(packed=True)`
    names them. Returns {(layer, expert, name): (packed, QuantState)}."""
    tensors, quantized = {}, {}
    for name, tensor in model.state_dict().items():
        if ".mlp.experts." not in name:
            tensors[name] = tensor.contiguous()
    for layer, experts in enumerate(_experts(model)):
        inter = experts.gate_up_proj.shape[1] // 2
        for e in range(experts.gate_up_proj.shape[0]):
            dense = {"gate_proj": experts.gate_up_proj[e, :inter], "up_proj": experts.gate_up_proj[e, inter:],
                     "down_proj": experts.down_proj[e]}
            for proj, weight in dense.items():
                packed, state = bnb_functional.quantize_4bit(weight.contiguous(), blocksize=64, quant_type="nf4",
                                                             compress_statistics=double_quant)
                key = f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight"
                tensors[key] = packed
                tensors.update({f"{key}.{k}": v.contiguous() for k, v in state.as_dict(packed=True).items()})
                quantized[layer, e, proj] = packed, state
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    model.config.quantization_config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                          bnb_4bit_use_double_quant=double_quant,
                                                          bnb_4bit_compute_dtype=torch.float32)
    model.config.save_pretrained(path)
    del model.config.quantization_config
    return quantized


def _assert_down_is_bnbs(got, quantized, layer):
    """down_proj of each expert: bitsandbytes' bytes and quant state, as they are (double quantization kept)."""
    for e in range(got.num_experts):
        packed, state = quantized[layer, e, "down_proj"]
        assert torch.equal(got.down.packed[e], packed.view(-1)), (layer, e)
        assert torch.equal(got.down.absmax[e], state.absmax), (layer, e)
        if state.nested:
            assert torch.equal(got.down.offset[e], state.offset) and torch.equal(got.down.nested_absmax[e],
                                                                               state.state2.absmax), (layer, e)
            assert torch.equal(got.down.nested_code, state.state2.code)


def _assert_gate_up_is_bnbs(got, quantized, layer):
    """gate_up_proj of each expert: gate's then up's bytes, and the absmax bitsandbytes dequantizes them with."""
    halves = [[quantized[layer, e, p] for p in ("gate_proj", "up_proj")] for e in range(got.num_experts)]
    for e, (gate, up) in enumerate(halves):
        assert torch.equal(got.gate_up.packed[e], torch.cat([gate[0].view(-1), up[0].view(-1)])), (layer, e)
        want = torch.cat([bnb_functional.dequantize_4bit(*gate), bnb_functional.dequantize_4bit(*up)])
        assert torch.equal(dequantize_nf4(got.gate_up, e)[0], want), (layer, e)


@pytest.mark.parametrize("double_quant", [False, True])
def test_hub_per_expert_checkpoint_loads_into_nf4_experts(tmp_path, double_quant):
    reference = quantize_projections(build_model("tiny", seed=7))
    quantized = _write_hub_checkpoint(reference, tmp_path, double_quant)
    keys = load_file(tmp_path / "model.safetensors")
    suffixes = {k.removeprefix("model.layers.0.mlp.experts.0.gate_proj.") for k in keys
                if k.startswith("model.layers.0.mlp.experts.0.gate_proj.")}
    assert suffixes == {"weight", "weight.absmax", "weight.quant_map", "weight.quant_state.bitsandbytes__nf4"} | (
        {"weight.nested_absmax", "weight.nested_quant_map"} if double_quant else set())
    moegraph.patch()
    loaded = _load(tmp_path)
    for layer, (got, dense) in enumerate(zip(_experts(loaded), _experts(reference))):
        assert isinstance(got, NF4Experts) and got.dtype == torch.float32
        # two nested states per expert do not merge into one: gate_up keeps bnb's float32 absmax
        assert got.gate_up.double_quant is False and got.down.double_quant is double_quant
        _assert_down_is_bnbs(got, quantized, layer)
        _assert_gate_up_is_bnbs(got, quantized, layer)
        if not double_quant:  # the concatenation is the NF4 layout of the stacked [2I, H] matrix
            stacked = quantize_nf4(dense.gate_up_proj.detach())
            assert torch.equal(stacked.packed, got.gate_up.packed) and torch.equal(stacked.absmax, got.gate_up.absmax)
        dense.gate_up_proj.data.copy_(dequantize_nf4(got.gate_up))  # the reference: experts from the same bytes
        dense.down_proj.data.copy_(dequantize_nf4(got.down))
    tokens = _tokens(loaded)
    assert torch.equal(tokens, _tokens(reference))

    loaded.save_pretrained(tmp_path / "moegraph")  # now in moegraph's fused layout: loads back byte for byte
    again = _load(tmp_path / "moegraph")
    _assert_same_state(again, loaded)
    assert torch.equal(_tokens(again), tokens)


def test_hub_per_expert_checkpoint_without_moegraph_patched_fails(tmp_path):
    _write_hub_checkpoint(quantize_projections(build_model("tiny", seed=7)), tmp_path, double_quant=False)
    with pytest.raises(RuntimeError):  # 5.24: size mismatch at load; 5.17: uint8 experts, the forward raises
        _tokens(_load(tmp_path))


def test_plain_transformers_4bit_checkpoint_gets_nf4_experts(tmp_path, dense_checkpoint):
    """A checkpoint saved from transformers' own 4-bit load (Linear4bit projections, dense per-expert experts)."""
    config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4")
    plain = _load(dense_checkpoint, quantization_config=config)
    plain.save_pretrained(tmp_path)
    moegraph.patch()
    loaded = _load(tmp_path)
    for got, dense in zip(_experts(loaded), _experts(plain)):
        assert isinstance(got, NF4Experts)
        want = NF4Experts.from_experts(dense)
        assert all(torch.equal(a, b) for a, b in zip(got.buffers(), want.buffers()))


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

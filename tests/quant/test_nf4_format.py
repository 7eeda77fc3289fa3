"""moegraph's NF4 expert format against bitsandbytes' own CPU outputs, and the NF4 experts module / model swap.

Bytes are compared exactly (packed, absmax, nested stats) and dequantized values bit for bit.
"""

import ast
import copy
import logging
from pathlib import Path

import pytest
import torch

bnb_functional = pytest.importorskip("bitsandbytes.functional")

from moegraph.errors import InvalidArgumentError  # noqa: E402
from moegraph.quant import (  # noqa: E402
    NF4_CODE,
    NF4Experts,
    NF4Weight,
    dequantize_nf4,
    expert_absmax,
    from_bnb,
    quantize_experts,
    quantize_nf4,
    to_bnb,
)
from moegraph.quant import nf4 as nf4_module  # noqa: E402

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# [E, N, K]: one block; 30 blocks (one partial nested block); 1040 blocks (5 nested blocks, the last partial)
SHAPES = [(3, 16, 4), (2, 48, 40), (2, 128, 520)]
_BITS = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


def _bits(t):
    return t.view(_BITS[t.dtype])


def _weights(shape, dtype, seed):
    """Random experts with per-expert scales, plus the blocks that need care: an all-zero block, a block whose
    absmax is a negative value, and (float32) values exactly on NF4 midpoints next to a 1.0 (bnb's ties)."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=gen) * torch.rand(shape[0], 1, 1, generator=gen).add(0.05) * 4
    flat = w.view(shape[0], -1)
    flat[0, :64] = 0
    if flat.shape[1] >= 192:
        flat[-1, 64:128] *= 0.01
        flat[-1, 64] = -3.0
        midpoints = nf4_module._nf4_midpoints(torch.device("cpu"))
        flat[0, 128:192] = torch.cat([torch.ones(1), midpoints, -midpoints, midpoints, -midpoints, midpoints[:3]])
    if dtype == torch.float16 and flat.shape[1] >= 256:
        # the float16 pair that ties: 0.5888671875 * (1 / 0.96435546875) is exactly the midpoint -0.61063...
        flat[1, 192:256] = 0.01
        flat[1, 192:196] = torch.tensor([0.96435546875, -0.5888671875, -0.5888671875 / 2, 0.96435546875 / 2])
    return w.to(dtype)


def _bnb_quantize(w_e, double_quant):
    return bnb_functional.quantize_4bit(w_e, blocksize=64, quant_type="nf4", compress_statistics=double_quant)


def test_codes_match_bnb():
    assert torch.equal(torch.tensor(NF4_CODE, dtype=torch.float32), bnb_functional.get_4bit_type("nf4", "cpu"))
    assert torch.equal(nf4_module.dynamic_code(), bnb_functional.create_dynamic_map())
    assert nf4_module.BLOCKSIZE == 64


@pytest.mark.parametrize("double_quant", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_quantize_bytes_equal_bnb(dtype, double_quant):
    for seed, shape in enumerate(SHAPES):
        w = _weights(shape, dtype, seed)
        ours = quantize_nf4(w, double_quant=double_quant)
        assert ours.shape == shape and ours.dtype == dtype and ours.double_quant == double_quant
        for e in range(shape[0]):
            packed, state = _bnb_quantize(w[e], double_quant)
            assert torch.equal(ours.packed[e], packed.view(-1)), (shape, e)
            assert torch.equal(ours.absmax[e], state.absmax), (shape, e)
            if double_quant:
                assert torch.equal(ours.nested_absmax[e], state.state2.absmax)
                assert torch.equal(ours.offset[e], state.offset)
                assert torch.equal(ours.nested_code, state.state2.code)


def test_ties_go_to_the_lower_code():
    w = torch.zeros(1, 1, 64)
    midpoints = nf4_module._nf4_midpoints(torch.device("cpu"))  # [15]
    w[0, 0, 0], w[0, 0, 1:16], w[0, 0, 16:31] = 1.0, midpoints, midpoints.nextafter(torch.tensor(2.0))
    ours = quantize_nf4(w)
    q = torch.stack((ours.packed[0] >> 4, ours.packed[0] & 0xF), dim=-1).view(-1).long()
    assert q[1:16].tolist() == list(range(15))  # on midpoint i: code i, the lower one
    assert q[16:31].tolist() == list(range(1, 16))  # one ulp above: the upper one
    assert torch.equal(ours.packed[0], _bnb_quantize(w[0], False)[0].view(-1))
    assert q[31:].eq(7).all()  # zeros: the code 0.0


def test_nested_rounding_equals_bnb_next_to_every_table_boundary():
    # bnb's CPU 8-bit quantizer rounds through a 65536-bin table; probe +-2 ulps around each bin edge and each
    # dynamic-code midpoint, in blocks whose absmax is 1 (so the scaled value is the probe itself).
    edges = ((torch.arange(1, 65536, dtype=torch.float64) - 0.5) / 65535 * 2 - 1).float()
    code = nf4_module.dynamic_code()
    probes = [edges, 0.5 * (code[:-1] + code[1:]), code]
    for direction in (2.0, -2.0):
        for base in (edges, probes[1]):
            step = base
            for _ in range(2):
                step = step.nextafter(torch.tensor(direction))
                probes.append(step)
    values = torch.cat(probes).clamp(-1, 1)
    body = torch.zeros(-(-values.numel() // 255) * 255)
    body[: values.numel()] = values
    blocks = torch.cat([torch.ones(body.numel() // 255, 1), body.view(-1, 255)], dim=1)
    blocks = torch.cat([blocks, torch.zeros(1, 256)])  # and an all-zero block
    q, absmax = nf4_module._quantize_dynamic(blocks.view(1, -1))
    want_q, want_state = bnb_functional.quantize_blockwise(blocks.view(-1), blocksize=256)
    assert torch.equal(q.view(-1), want_q)
    assert torch.equal(absmax.view(-1), want_state.absmax)


def test_chunking_does_not_change_bytes(monkeypatch):
    w = _weights((5, 64, 64), torch.bfloat16, seed=3)
    whole = quantize_nf4(w, double_quant=True)
    monkeypatch.setattr(nf4_module, "MAX_CHUNK_ELEMENTS", 64 * 64 * 2)  # two experts per chunk
    chunked = quantize_nf4(w, double_quant=True)
    for name, tensor in whole.tensors().items():
        assert torch.equal(tensor, chunked.tensors()[name]), name
    assert torch.equal(_bits(dequantize_nf4(chunked)), _bits(dequantize_nf4(whole)))


@pytest.mark.parametrize("double_quant", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_dequantize_equals_bnb_bit_for_bit(dtype, double_quant):
    for seed, shape in enumerate(SHAPES):
        w = quantize_nf4(_weights(shape, dtype, seed), double_quant=double_quant)
        ours = dequantize_nf4(w)
        assert ours.shape == shape and ours.dtype == dtype
        for e in range(shape[0]):
            packed, state = to_bnb(w, e)
            assert packed.shape == (shape[1] * shape[2] // 2, 1) and packed.dtype == torch.uint8
            assert torch.equal(_bits(bnb_functional.dequantize_4bit(packed, state)), _bits(ours[e])), (shape, e)
        if double_quant:
            bnb_absmax = torch.stack([bnb_functional.dequantize_blockwise(w.absmax[e], to_bnb(w, e)[1].state2)
                                      + w.offset[e] for e in range(shape[0])])
            assert torch.equal(expert_absmax(w), bnb_absmax)
        picked = [shape[0] - 1, 0]
        assert torch.equal(_bits(dequantize_nf4(w, picked)), _bits(ours[picked]))
        assert torch.equal(_bits(dequantize_nf4(w, torch.tensor(picked))), _bits(ours[picked]))
        assert torch.equal(_bits(dequantize_nf4(w, 1)), _bits(ours[1:2]))


def test_dequantize_is_close_to_the_weights():
    w = torch.randn(2, 64, 128)
    err = (dequantize_nf4(quantize_nf4(w)) - w).norm() / w.norm()
    assert err < 0.12, err  # NF4 on Gaussian weights: ~0.1


@pytest.mark.parametrize("double_quant", [False, True])
def test_from_bnb_round_trips_and_reads_bnb_output(double_quant):
    w = _weights((3, 32, 64), torch.bfloat16, seed=5)
    ours = quantize_nf4(w, double_quant=double_quant)
    for stacked in (from_bnb([to_bnb(ours, e) for e in range(3)]),
                    from_bnb([_bnb_quantize(w[e], double_quant) for e in range(3)])):
        assert stacked.shape == ours.shape and stacked.dtype == ours.dtype
        assert stacked.tensors().keys() == ours.tensors().keys()
        for name, tensor in ours.tensors().items():
            assert torch.equal(stacked.tensors()[name], tensor), name


def test_from_bnb_refuses_what_does_not_fit():
    a, b = torch.randn(32, 64), torch.randn(64, 32)
    with pytest.raises(InvalidArgumentError, match="FP4"):
        from_bnb([bnb_functional.quantize_4bit(a, blocksize=64, quant_type="fp4")])
    with pytest.raises(InvalidArgumentError, match="blocksize 128"):
        from_bnb([bnb_functional.quantize_4bit(a, blocksize=128, quant_type="nf4")])
    with pytest.raises(InvalidArgumentError, match="all experts must match"):
        from_bnb([_bnb_quantize(a, False), _bnb_quantize(b, False)])
    with pytest.raises(InvalidArgumentError, match="all experts must match"):
        from_bnb([_bnb_quantize(a, False), _bnb_quantize(a.half(), False)])
    with pytest.raises(InvalidArgumentError, match="double-quantized"):
        from_bnb([_bnb_quantize(a, False), _bnb_quantize(a, True)])
    with pytest.raises(InvalidArgumentError, match="at least one"):
        from_bnb([])


@pytest.mark.parametrize("shape", [(2, 3, 5), (1, 64, 3), (1, 8, 4)])
def test_bad_shapes_raise(shape):
    with pytest.raises(InvalidArgumentError, match=r"N\*K % 64 == 0.*K even"):
        quantize_nf4(torch.randn(shape))


def test_bad_inputs_raise():
    with pytest.raises(InvalidArgumentError, match="stack"):
        quantize_nf4(torch.randn(64, 64))
    with pytest.raises(InvalidArgumentError, match="float32"):
        quantize_nf4(torch.ones(1, 64, 64, dtype=torch.int32))
    w = quantize_nf4(torch.randn(2, 64, 64))
    with pytest.raises(InvalidArgumentError, match="packed must be torch.uint8"):
        NF4Weight(w.packed.float(), w.absmax, w.shape, w.dtype)
    with pytest.raises(InvalidArgumentError, match="go together"):
        NF4Weight(w.packed, w.absmax, w.shape, w.dtype, offset=torch.zeros(2))


def test_nf4_weight_bytes_and_device():
    w = quantize_nf4(torch.randn(4, 128, 64, dtype=torch.bfloat16), double_quant=True)
    # 0.5 B per weight, 1 B per 64-block absmax, 4 B per 256 absmax, the 1 KB code and 4 B of offset per expert
    assert w.nbytes() == 4 * 128 * 64 // 2 + 4 * 128 + 4 * 4 + 256 * 4 + 4 * 4
    moved = w.to("cpu")
    assert moved.dtype == torch.bfloat16 and all(torch.equal(t, w.tensors()[k]) for k, t in moved.tensors().items())
    assert w.with_dtype(torch.float32).dtype == torch.float32


def test_bitsandbytes_is_imported_lazily():
    for path in Path(nf4_module.__file__).parent.glob("*.py"):
        for node in ast.parse(path.read_text()).body:  # module level only
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not any(n.startswith("bitsandbytes") for n in names), (path.name, names)


# ---- NF4Experts and quantize_experts ----

@pytest.fixture(scope="module")
def tiny_model():
    from moegraph.testing import build_model

    return build_model("tiny")


def _experts_pair(dtype, double_quant):
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    from moegraph.testing import make_config

    torch.manual_seed(1)
    dense = Qwen3MoeExperts(make_config("tiny")).to(dtype)
    with torch.no_grad():
        dense.gate_up_proj.normal_(0, 0.1)
        dense.down_proj.normal_(0, 0.1)
    nf4 = NF4Experts.from_experts(dense, double_quant=double_quant)
    reference = copy.deepcopy(dense)  # transformers' eager experts on the dequantized weights
    with torch.no_grad():
        reference.gate_up_proj.copy_(dequantize_nf4(nf4.gate_up))
        reference.down_proj.copy_(dequantize_nf4(nf4.down))
    return dense, nf4, reference


@pytest.mark.parametrize("dtype, atol, rtol", [(torch.float32, 1e-5, 1e-4), (torch.bfloat16, 2e-2, 2e-2)])
@pytest.mark.parametrize("double_quant", [False, True])
def test_nf4_experts_forward_matches_transformers(dtype, atol, rtol, double_quant):
    dense, nf4, reference = _experts_pair(dtype, double_quant)
    assert (nf4.num_experts, nf4.hidden_dim, nf4.intermediate_dim) == (8, 64, 32)
    assert nf4.dtype == dtype and nf4.act_fn is dense.act_fn and nf4.config is dense.config
    tokens, top_k = 13, 2
    hidden = torch.randn(tokens, 64).to(dtype)
    index = torch.randn(tokens, 8).topk(top_k, dim=-1).indices
    weights = torch.rand(tokens, top_k).to(dtype)
    # Slot [0, 1] routed to index E, transformers' padding slot (expert-parallel sentinels), which its eager experts
    # ignore; older ones (5.17) reject index E, so the reference routes that slot to a real expert at weight 0.
    padded, zeroed = index.clone(), weights.clone()
    padded[0, 1], zeroed[0, 1] = 8, 0
    got = nf4(hidden, padded, weights)
    assert got.dtype == dtype and got.shape == hidden.shape
    torch.testing.assert_close(got, reference(hidden, index, zeroed), atol=atol, rtol=rtol)


def test_nf4_experts_buffers_state_dict_and_casts():
    _, nf4, _ = _experts_pair(torch.float32, double_quant=True)
    names = {f"{p}{s}" for p in ("gate_up_proj", "down_proj")
             for s in ("", "_absmax", "_nested_absmax", "_nested_code", "_offset")}
    assert set(nf4.state_dict()) == names
    assert nf4.gate_up_proj.dtype == torch.uint8 and nf4.gate_up_proj.shape == (8, 64 * 64 // 2)
    assert nf4.gate_up.packed.data_ptr() == nf4.gate_up_proj.data_ptr()  # a view, not a copy
    assert not list(nf4.parameters())
    fresh = copy.deepcopy(nf4)
    for buffer in fresh.buffers():
        buffer.zero_()
    fresh.load_state_dict(nf4.state_dict())
    assert torch.equal(dequantize_nf4(fresh.down), dequantize_nf4(nf4.down))
    stored = {name: t.dtype for name, t in nf4.state_dict().items()}
    nf4.to(torch.bfloat16)  # a cast would break the format: dtypes stay, the compute dtype follows
    assert {name: t.dtype for name, t in nf4.state_dict().items()} == stored
    assert nf4.dtype == torch.bfloat16 and dequantize_nf4(nf4.gate_up).dtype == torch.bfloat16
    assert nf4.float().dtype == torch.float32


def _relative_error(got, want):
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def test_quantize_experts_on_tiny_model(tiny_model, moegraph_logs):
    from moegraph.testing import random_prompts

    model = copy.deepcopy(tiny_model)
    dense_modules = [layer.mlp.experts for layer in model.model.layers]
    assert quantize_experts(model) is model
    experts = [layer.mlp.experts for layer in model.model.layers]
    assert all(isinstance(m, NF4Experts) for m in experts) and len(experts) == 4
    assert not [n for n, p in model.named_parameters() if n.endswith("gate_up_proj") and p.dim() == 3]
    assert not any(hasattr(m, "gate_up_proj") for m in dense_modules)  # dense weights freed
    lines = [r.getMessage() for r in moegraph_logs.records if r.name == "moegraph" and r.levelno == logging.INFO]
    assert len(lines) == 1 and "4 experts modules" in lines[0] and "MB ->" in lines[0]

    quantize_experts(model)  # idempotent
    assert [layer.mlp.experts for layer in model.model.layers] == experts

    inputs = random_prompts(2, vocab_size=model.config.vocab_size, seed=1)
    with torch.no_grad():
        want = tiny_model(**inputs).logits
        got = model(**inputs).logits
    error = _relative_error(got, want)
    # measured 0.010-0.015 over 3 model x 3 prompt seeds (double quant the same); swapped nibbles: 0.075-0.11
    assert error < 0.03, error
    for module in experts:  # the same model with the nibbles of each byte swapped must fail that bound
        for name in ("gate_up_proj", "down_proj"):
            packed = getattr(module, name)
            packed.copy_((packed << 4) | (packed >> 4))
    with torch.no_grad():
        assert _relative_error(model(**inputs).logits, want) > 0.03
    for module in experts:
        for name in ("gate_up_proj", "down_proj"):
            packed = getattr(module, name)
            packed.copy_((packed << 4) | (packed >> 4))

    out = model.generate(**inputs, max_new_tokens=3, do_sample=False)
    assert out.shape == (2, inputs["input_ids"].shape[1] + 3)


def test_quantize_experts_double_quant_and_refusals(tiny_model):
    model = copy.deepcopy(tiny_model)
    model.model.layers[2].mlp.experts.is_transposed = True
    with pytest.raises(InvalidArgumentError, match="layers.2.mlp.experts.*transposed"):
        quantize_experts(model)
    assert not any(isinstance(m, NF4Experts) for m in model.modules())  # refused before changing anything
    model.model.layers[2].mlp.experts.is_transposed = False
    quantize_experts(model, double_quant=True)
    assert all(m.gate_up.double_quant and m.down.double_quant for m in model.modules() if isinstance(m, NF4Experts))
    with pytest.raises(InvalidArgumentError, match="not a fused experts module"):
        NF4Experts.from_experts(model.model.layers[0].mlp.experts)

"""The sparse MoE block with moegraph's experts against transformers' own experts paths, on the same weights."""

import copy

import pytest
import torch

from moegraph.moe import moe_experts_grouped_mm, moe_experts_ref
from moegraph.moe.interface import EXPERTS_FORWARDS, experts_name
from moegraph.testing import build_model


def sparse_moe_forward(block, hidden, backend):
    """transformers' block forward with the experts of moegraph's implementation for `backend`."""
    batch, seq, hidden_dim = hidden.shape
    flat = hidden.reshape(-1, hidden_dim)
    _router_logits, top_k_weights, top_k_index = block.gate(flat)
    out = EXPERTS_FORWARDS[experts_name(backend)](block.experts, flat, top_k_index, top_k_weights)
    return out.view(batch, seq, hidden_dim)


def _block(dtype=torch.float32, seed=0, **overrides):
    model = build_model("tiny", dtype=dtype, seed=seed, experts_implementation="eager", **overrides)
    return model.model.layers[0].mlp


def _relative_error(got, want):
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("shape", [(1, 1), (2, 1), (7, 1), (1, 64), (3, 5), (4, 16)])
def test_block_matches_hf_eager_fp32(seed, shape):
    block = _block(seed=seed)
    hidden = torch.randn(*shape, block.gate.hidden_dim, generator=torch.Generator().manual_seed(seed))
    want = block(hidden)  # unpatched: HF's eager experts loop
    got = sparse_moe_forward(block, hidden, "grouped_mm")
    assert got.shape == want.shape
    assert _relative_error(got, want) <= 1e-5


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_block_matches_hf_grouped_mm_and_norm_topk(norm_topk_prob):
    model = build_model("tiny", norm_topk_prob=norm_topk_prob)
    block = model.model.layers[1].mlp
    hidden = torch.randn(3, 9, model.config.hidden_size)
    assert model.config._experts_implementation == "grouped_mm"
    want = block(hidden)
    got = sparse_moe_forward(block, hidden, "grouped_mm")
    assert _relative_error(got, want) <= 1e-5


def test_block_bf16_within_rounding():
    block32 = _block(dtype=torch.float32, seed=3)
    block16 = copy.deepcopy(block32).to(torch.bfloat16)  # same weights: seeded init differs across dtypes
    hidden = torch.randn(2, 11, block32.gate.hidden_dim)
    want = block32(hidden)
    got = sparse_moe_forward(block16, hidden.bfloat16(), "grouped_mm")
    # bf16 weights and activations: a few bf16 ulps (2^-8 relative) of the fp32 answer
    assert _relative_error(got, want) < 3e-2
    hf16 = block16(hidden.bfloat16())
    assert _relative_error(got, hf16) < 1e-2


def _experts_inputs(block, tokens, index):
    hidden = torch.randn(tokens, block.gate.hidden_dim)
    weights = torch.rand(tokens, index.shape[1])
    return hidden, index, weights


@pytest.mark.parametrize("case", ["all_to_one_expert", "empty_experts", "ties_in_router"])
def test_routing_edge_cases(case):
    block = _block(seed=4)
    experts = block.experts
    if case == "all_to_one_expert":
        # both top-k slots of every token point at expert 5 (the other 7 experts get nothing)
        index = torch.full((6, 2), 5, dtype=torch.long)
        hidden, index, weights = _experts_inputs(block, 6, index)
        got = moe_experts_grouped_mm(hidden, index, weights, experts)
        want = moe_experts_ref(hidden, index, weights, experts)
        assert _relative_error(got, want) <= 1e-5
    elif case == "empty_experts":
        index = torch.tensor([[0, 7], [7, 0], [0, 7]])
        hidden, index, weights = _experts_inputs(block, 3, index)
        got = moe_experts_grouped_mm(hidden, index, weights, experts)
        want = moe_experts_ref(hidden, index, weights, experts)
        assert _relative_error(got, want) <= 1e-5
    else:
        # a zero router gives every expert the same probability: top-k must still agree with HF
        with torch.no_grad():
            block.gate.weight.zero_()
        hidden = torch.randn(1, 5, block.gate.hidden_dim)
        want = block(hidden)
        got = sparse_moe_forward(block, hidden, "grouped_mm")
        assert _relative_error(got, want) <= 1e-5


def test_reference_backend_matches_hf():
    block = _block(seed=5)
    hidden = torch.randn(2, 3, block.gate.hidden_dim)
    assert _relative_error(sparse_moe_forward(block, hidden, "torch"), block(hidden)) <= 1e-5


@pytest.mark.cuda
def test_block_replays_in_cuda_graph_equal_to_eager():
    model = build_model("qwen3-30b-a3b", num_layers=1, device="cuda", dtype=torch.bfloat16, seed=0)
    block = model.model.layers[0].mlp
    hidden = torch.randn(8, 1, model.config.hidden_size, device="cuda", dtype=torch.bfloat16)
    static_in = hidden.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        sparse_moe_forward(block, static_in, "grouped_mm")
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = sparse_moe_forward(block, static_in, "grouped_mm")
    for seed in range(3):  # new inputs copied into the static buffer, then replay
        fresh = torch.randn(hidden.shape, device="cuda", dtype=torch.bfloat16,
                            generator=torch.Generator("cuda").manual_seed(seed))
        static_in.copy_(fresh)
        graph.replay()
        eager = sparse_moe_forward(block, fresh, "grouped_mm")
        assert torch.equal(static_out, eager)
        reference = sparse_moe_forward(block, fresh, "torch")
        assert _relative_error(static_out, reference) < 1e-2

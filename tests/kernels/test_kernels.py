"""Each Triton kernel against its plain-torch reference: shapes x dtypes, fresh random inputs.

On the CPU the kernels run in Triton's interpreter (conftest sets TRITON_INTERPRET=1); its bf16
conversion may truncate, so bf16 is checked within two bf16 ulps there, exactly on the GPU.
"""

import pytest
import torch

from moegraph.kernels import moe_combine, qk_norm_rope, rms_norm, router_topk, triton_available

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(not triton_available(torch.empty(0, device=DEVICE)), reason="Triton cannot run here")
# (dtype, atol, rtol): fp32 is one rounding of the same math; bf16 a couple of ulps at |x| ~ 4
TOLERANCES = [(torch.float32, 1e-5, 1e-5), (torch.bfloat16, 6e-2, 2e-2)]


def _randn(*shape, dtype, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE, dtype)


@pytest.mark.parametrize("dtype, atol, rtol", TOLERANCES)
@pytest.mark.parametrize("rows, hidden", [(1, 64), (5, 48), (8, 2048)])
def test_rms_norm(dtype, atol, rtol, rows, hidden):
    x, res, w = _randn(rows, hidden, dtype=dtype, seed=1), _randn(rows, hidden, dtype=dtype, seed=2), \
        _randn(hidden, dtype=dtype, seed=3)
    torch.testing.assert_close(rms_norm.rms_norm(x, w, 1e-6), rms_norm.rms_norm_ref(x, w, 1e-6), atol=atol, rtol=rtol)
    got_sum, got = rms_norm.add_rms_norm(res, x, w, 1e-6)
    want_sum, want = rms_norm.add_rms_norm_ref(res, x, w, 1e-6)
    torch.testing.assert_close(got_sum, want_sum, atol=atol, rtol=rtol)
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype, atol, rtol", TOLERANCES)
@pytest.mark.parametrize("rows, q_heads, kv_heads, head_dim", [(1, 4, 2, 16), (3, 32, 4, 128)])
def test_qk_norm_rope_writes_cache_at_positions(dtype, atol, rtol, rows, q_heads, kv_heads, head_dim):
    positions_count = 12
    q = _randn(rows, q_heads * head_dim, dtype=dtype, seed=4)
    k = _randn(rows, kv_heads * head_dim, dtype=dtype, seed=5)
    v = _randn(rows, kv_heads * head_dim, dtype=dtype, seed=6)
    qw, kw = _randn(head_dim, dtype=dtype, seed=7), _randn(head_dim, dtype=dtype, seed=8)
    angle = _randn(rows, head_dim, dtype=torch.float32, seed=9)
    cos, sin = angle.cos().to(dtype), angle.sin().to(dtype)
    positions = torch.randint(0, positions_count, (rows,), generator=torch.Generator().manual_seed(10)).to(DEVICE)
    caches = [torch.full((rows + 1, kv_heads, positions_count, head_dim), 7.0, dtype=dtype, device=DEVICE)
              for _ in range(4)]  # poisoned: every element the kernel should not write stays 7
    got = qk_norm_rope.qk_norm_rope(q, k, v, qw, kw, cos, sin, positions, caches[0], caches[1], 1e-6)
    want = qk_norm_rope.qk_norm_rope_ref(q, k, v, qw, kw, cos, sin, positions, caches[2], caches[3], 1e-6)
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol)
    torch.testing.assert_close(caches[0], caches[2], atol=atol, rtol=rtol)
    assert torch.equal(caches[1], caches[3])  # V is copied, not computed
    written = torch.zeros(caches[0].shape[:3], dtype=torch.bool, device=DEVICE)
    written[torch.arange(rows, device=DEVICE), :, positions] = True
    assert (caches[0][~written] == 7).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens, experts, top_k", [(1, 8, 2), (7, 128, 8), (64, 60, 4)])
@pytest.mark.parametrize("normalize", [True, False])
def test_router_topk(dtype, tokens, experts, top_k, normalize):
    logits = _randn(tokens, experts, dtype=dtype, seed=11)
    got_w, got_i = router_topk.router_topk(logits, top_k, normalize)
    want_w, want_i = router_topk.router_topk_ref(logits, top_k, normalize)
    probs = torch.softmax(logits.float(), dim=-1)
    # equal probabilities (frequent among bf16 logits) may be picked in another order: compare what was picked
    assert torch.equal(probs.gather(1, got_i), probs.gather(1, want_i))
    assert (got_i.sort(dim=1).values.diff(dim=1) > 0).all()  # k distinct experts per token
    torch.testing.assert_close(got_w.float(), want_w.float(), atol=1e-2 if dtype == torch.bfloat16 else 1e-6,
                               rtol=1e-2 if dtype == torch.bfloat16 else 1e-5)


def test_router_topk_ties_pick_lower_index():
    logits = torch.zeros(2, 8, device=DEVICE)
    weights, index = router_topk.router_topk(logits, 3, True)
    assert index.tolist() == [[0, 1, 2], [0, 1, 2]]
    torch.testing.assert_close(weights, torch.full((2, 3), 1 / 3, device=DEVICE))


@pytest.mark.parametrize("dtype, atol, rtol", TOLERANCES)
@pytest.mark.parametrize("tokens, top_k, hidden", [(1, 8, 2048), (3, 2, 300), (16, 8, 64)])
def test_moe_combine(dtype, atol, rtol, tokens, top_k, hidden):
    expert_out = _randn(tokens * top_k, hidden, dtype=dtype, seed=12)
    position = torch.randperm(tokens * top_k, generator=torch.Generator().manual_seed(13)).to(DEVICE)
    weights = torch.rand(tokens, top_k, generator=torch.Generator().manual_seed(14)).to(DEVICE, dtype)
    got = moe_combine.moe_combine(expert_out, position, weights, dtype)
    want = moe_combine.moe_combine_ref(expert_out, position, weights, dtype)
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol)


@pytest.mark.parametrize("tokens, top_k, experts", [(1, 8, 128), (5, 2, 8), (64, 8, 128), (33, 4, 60)])
def test_moe_align_is_a_stable_grouping(tokens, top_k, experts):
    from moegraph.kernels import moe_align

    gen = torch.Generator().manual_seed(tokens)
    index = torch.rand(tokens, experts, generator=gen).topk(top_k, dim=-1).indices.to(DEVICE)
    index[0] = index[-1]  # repeated expert sets: several pairs share experts
    got = moe_align.moe_align(index, experts)
    want = moe_align.moe_align_ref(index, experts)
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    token_of_slot, position, offsets = got
    flat = index.reshape(-1)
    assert torch.equal(token_of_slot[position], torch.arange(flat.numel(), device=DEVICE) // top_k)
    assert int(offsets[-1]) == flat.numel()


def test_moe_combine_in_pair_order():
    """position None: row t*K + k of expert_out is pair (t, k), the same as the identity permutation."""
    expert_out = _randn(3 * 4, 40, dtype=torch.float32, seed=15)
    weights = torch.rand(3, 4, generator=torch.Generator().manual_seed(16)).to(DEVICE)
    identity = torch.arange(12, device=DEVICE)
    got = moe_combine.moe_combine(expert_out, None, weights, torch.float32)
    assert torch.equal(got, moe_combine.moe_combine(expert_out, identity, weights, torch.float32))
    want = moe_combine.moe_combine_ref(expert_out, identity, weights, torch.float32)
    assert torch.equal(moe_combine.moe_combine_ref(expert_out, None, weights, torch.float32), want)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("tokens, top_k, experts, method", [
    *[(*case, method) for case in [(1, 8, 128), (2, 8, 128), (5, 2, 8), (40, 8, 128), (9, 4, 60)]
      for method in ("compare", "histogram")],
    (300, 8, 64, "histogram"),  # 2,400 pairs: several BLOCK_J steps, several programs before the last
])
def test_align_blocks_groups_pairs_in_blocks_of_one_expert(tokens, top_k, experts, method):
    """Every pair in its expert's blocks, in pair order within the expert; padding and idle blocks marked -1."""
    from moegraph.kernels.fused_moe import BLOCK_M, align_blocks

    gen = torch.Generator().manual_seed(tokens + experts)
    index = torch.rand(tokens, experts, generator=gen).topk(top_k, dim=-1).indices
    index[0] = index[-1]  # repeated expert sets: several pairs share experts
    position, slot_token, block_expert = (t.cpu() for t in align_blocks(index.to(DEVICE), experts, method))
    flat = index.reshape(-1)
    assert position.unique().numel() == flat.numel()
    assert torch.equal(slot_token[position], torch.arange(flat.numel()) // top_k)
    assert torch.equal(block_expert[position // BLOCK_M], flat.to(block_expert.dtype))
    expected_blocks = sum(-(-int(c) // BLOCK_M) for c in torch.bincount(flat, minlength=experts))
    assert torch.equal(block_expert[:expected_blocks], block_expert[:expected_blocks].sort().values)  # by expert
    assert (block_expert[expected_blocks:] == -1).all() and (block_expert[:expected_blocks] >= 0).all()
    assert int((slot_token >= 0).sum()) == flat.numel()
    for e in flat.unique().tolist():  # stable: pairs of one expert keep their order
        slots = position[flat == e]
        assert torch.equal(slots, slots.sort().values)


def test_align_blocks_methods_agree():
    """The histogram grouping gives the compare grouping's tensors exactly (1,040 pairs: two BLOCK_J steps)."""
    from moegraph.kernels import fused_moe

    index = torch.rand(130, 128, generator=torch.Generator().manual_seed(3)).topk(8, dim=-1).indices.to(DEVICE)
    compare = fused_moe.align_blocks(index, 128, "compare")
    histogram = fused_moe.align_blocks(index, 128, "histogram")
    for a, b in zip(compare, histogram):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="not one of"):
        fused_moe.align_blocks(index, 128, "sort")


@pytest.mark.parametrize("dtype, atol, rtol", TOLERANCES)
@pytest.mark.parametrize("rows, inter", [(1, 768), (7, 32), (64, 300)])
def test_silu_mul(dtype, atol, rtol, rows, inter):
    from moegraph.kernels import silu_mul

    gate_up = _randn(rows, 2 * inter, dtype=dtype, seed=15)
    torch.testing.assert_close(silu_mul.silu_mul(gate_up), silu_mul.silu_mul_ref(gate_up), atol=atol, rtol=rtol)


@pytest.mark.parametrize("tokens, top_k, experts, hidden, inter", [(1, 8, 128, 256, 96), (4, 2, 8, 64, 48), (5, 2, 8, 64, 48),
                                                                   (37, 4, 16, 128, 64)])
def test_fused_moe_experts(tokens, top_k, experts, hidden, inter):
    """fp32 operands: the kernels' math against a float32 loop over the routed experts."""
    from moegraph.kernels import fused_moe, moe_combine

    gen = torch.Generator().manual_seed(tokens)
    gate_up = (torch.randn(experts, 2 * inter, hidden, generator=gen) * 0.05).to(DEVICE)
    down = (torch.randn(experts, hidden, inter, generator=gen) * 0.05).to(DEVICE)
    x = torch.randn(tokens, hidden, generator=gen).to(DEVICE)
    index = torch.rand(tokens, experts, generator=gen).topk(top_k, dim=-1).indices.to(DEVICE)
    weights = torch.rand(tokens, top_k, generator=gen).to(DEVICE)
    got = fused_moe.fused_moe_experts(x, index, weights, gate_up, down, moe_combine.moe_combine)
    want = fused_moe.fused_moe_experts_ref(x, index, weights, gate_up, down)
    # fp32 dots on the CPU; on the GPU Triton's fp32 dot rounds operands to tf32 (exact for bf16 weights)
    tol = 5e-3 if DEVICE == "cuda" else 2e-4
    torch.testing.assert_close(got, want, atol=tol, rtol=10 * tol)


@pytest.mark.parametrize("dtype, tokens, top_k", [(torch.bfloat16, 1, 8), (torch.float32, 3, 2)])
def test_pair_down_and_combine_in_one_launch_give_the_same_bits(dtype, tokens, top_k):
    """The pair path with the combine fused into its down GEMVs equals the two launches (down, then moe_combine)
    bit for bit, through fused_moe_experts (PAIR_COMBINE on and off) and pair_gemv_experts itself."""
    from moegraph.kernels import fused_moe, moe_combine

    gen = torch.Generator().manual_seed(31 + tokens)
    experts, hidden, inter = 16, 64, 96
    gate_up = (torch.randn(experts, 2 * inter, hidden, generator=gen) * 0.05).to(DEVICE, dtype)
    down = (torch.randn(experts, hidden, inter, generator=gen) * 0.05).to(DEVICE, dtype)
    x = torch.randn(tokens, hidden, generator=gen).to(DEVICE, dtype)
    index = torch.rand(tokens, experts, generator=gen).topk(top_k, dim=-1).indices.to(DEVICE)
    weights = torch.rand(tokens, top_k, generator=gen).to(DEVICE, dtype)
    runs = {}
    for fused in (False, True):
        keep = fused_moe.PAIR_COMBINE
        fused_moe.PAIR_COMBINE = fused
        try:
            runs[fused] = fused_moe.fused_moe_experts(x, index, weights, gate_up, down, moe_combine.moe_combine)
        finally:
            fused_moe.PAIR_COMBINE = keep
    assert runs[True].dtype == dtype and torch.equal(runs[True], runs[False])
    direct = fused_moe.pair_gemv_experts(x, index, gate_up, down, top_k_weights=weights, out_dtype=dtype)
    assert torch.equal(direct, runs[False])
    with pytest.raises(ValueError, match="top_k_weights"):
        fused_moe.pair_gemv_experts(x, index, gate_up, down, top_k_weights=weights[:, :1])


@pytest.mark.skipif(DEVICE == "cuda", reason="on a GPU the tile's layout may order a row's sum otherwise")
def test_pair_path_tiles_give_the_same_bits():
    """Under the interpreter the pair GEMVs' row tiles (2 rows, the GPU's; 32 by default there) change how rows are
    split over programs, not any row's sum: thin and wide tiles, with and without the fused combine, agree bit for
    bit, so the wide default tests the thin tiles' sums."""
    from moegraph.kernels import fused_moe

    gen = torch.Generator().manual_seed(40)
    experts, hidden, inter = 6, 64, 48
    gate_up = (torch.randn(experts, 2 * inter, hidden, generator=gen) * 0.05).to(DEVICE)
    down = (torch.randn(experts, hidden, inter, generator=gen) * 0.05).to(DEVICE)
    x = torch.randn(2, hidden, generator=gen).to(DEVICE)
    index = torch.rand(2, experts, generator=gen).topk(2, dim=-1).indices.to(DEVICE)
    weights = torch.rand(2, 2, generator=gen).to(DEVICE)
    for combine in (None, weights):
        thin, wide = (fused_moe.pair_gemv_experts(x, index, gate_up, down, block_n=n, top_k_weights=combine)
                      for n in (2, 32))
        assert torch.equal(thin, wide)


@pytest.mark.cuda
def test_fused_moe_experts_bf16_against_grouped_mm():
    from moegraph.kernels import fused_moe, moe_combine
    from moegraph.testing import build_model

    block = build_model("qwen3-30b-a3b", num_layers=1, device="cuda", dtype=torch.bfloat16).model.layers[0].mlp
    for tokens in (1, 8, 64):
        x = torch.randn(tokens, 2048, device="cuda", dtype=torch.bfloat16)
        weights, index = torch.rand(tokens, 128, device="cuda").softmax(-1).topk(8, dim=-1)
        weights = weights.to(torch.bfloat16)
        got = fused_moe.fused_moe_experts(x, index, weights, block.experts.gate_up_proj, block.experts.down_proj,
                                          moe_combine.moe_combine)
        want = fused_moe.fused_moe_experts_ref(x, index, weights, block.experts.gate_up_proj, block.experts.down_proj)
        rel = ((got.float() - want.float()).norm() / want.float().norm()).item()
        assert rel < 1e-2, rel

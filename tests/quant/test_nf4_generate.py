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


@pytest.fixture(scope="module")
def two_layer_model():
    return build_model("tiny", seed=5, quant="nf4", num_layers=2)  # each interpreted layer costs seconds


@pytest.mark.parametrize("backend", ["auto", "torch", "triton"])
def test_patched_nf4_model_gives_the_unpatched_nf4_tokens(two_layer_model, backend):
    from moegraph.kernels import triton_available

    if backend == "triton" and not triton_available(torch.empty(0)):
        pytest.skip("Triton's interpreter is not on for CPU tensors here (a CUDA machine)")
    model = two_layer_model
    inputs = random_prompts(3, vocab_size=model.config.vocab_size, seed=6)
    want = model.generate(**inputs, max_new_tokens=3, do_sample=False)  # NF4Experts' own torch forward
    moegraph.patch(model, moe_backend=backend)
    try:
        got = model.generate(**inputs, max_new_tokens=3, do_sample=False)  # 2 decode steps: ~2 s each interpreted
        stats = moegraph.decode_stats(model)
    finally:
        moegraph.unpatch(model)
    assert stats.fallback_reason is None and stats.steps > 0
    assert torch.equal(got, want)


def test_nf4_probe_runs_the_nf4_experts():
    from moegraph.moe.select import describe_moe_backend

    choice = describe_moe_backend("cpu", torch.float32, "auto", "nf4")
    assert choice.name == "grouped_mm" and "runs eagerly" in choice.reason


@pytest.mark.parametrize("rows", [1, 3])
def test_nf4_qkv_in_one_launch_equals_the_three_linear4bit_forwards(model, monkeypatch, rows):
    """The op table's qkv runs the three Linear4bit projections through one grouped NF4 GEMV launch."""
    from moegraph.kernels import nf4_gemv, triton_available

    if not triton_available(torch.empty(0)):
        pytest.skip("Triton's interpreter is not on for CPU tensors here (a CUDA machine)")
    ops = ops_for_model(model, kernels="triton")  # Triton's interpreter on the CPU
    launches = []
    group = nf4_gemv.nf4_linear_group
    monkeypatch.setattr(nf4_gemv, "nf4_linear_group", lambda *a, **k: launches.append(1) or group(*a, **k))
    attn = model.model.layers[0].self_attn
    x = torch.randn(rows, model.config.hidden_size, generator=torch.Generator().manual_seed(7))
    got = ops.qkv(attn, x)
    assert launches == [1]
    for g, module in zip(got, (attn.q_proj, attn.k_proj, attn.v_proj)):
        torch.testing.assert_close(g, module(x), atol=1e-4, rtol=1e-4)


def test_linear4bit_repacked_for_the_cpu_goes_through_its_own_forward():
    """bitsandbytes repacks a Linear4bit in place on its first CPU forward on AVX512-BF16 CPUs (another byte order,
    bf16 absmax; the test suite switches that off, see conftest.py). moegraph's NF4 GEMV must not read that layout:
    the op table hands such a module to its own forward, and NF4Tensors.from_bnb refuses it."""
    from bitsandbytes import functional as bnb_functional

    from moegraph import InvalidArgumentError
    from moegraph.kernels import triton_available
    from moegraph.kernels.nf4_gemv import NF4Tensors

    if not hasattr(bnb_functional, "_convert_weight_packed_for_cpu"):
        pytest.skip("this bitsandbytes has no CPU repacking")
    if not triton_available(torch.empty(0)):
        pytest.skip("Triton's interpreter is not on for CPU tensors here (a CUDA machine)")
    model = build_model("tiny", seed=8, quant="nf4", num_layers=1)
    attn = model.model.layers[0].self_attn
    x = torch.randn(2, model.config.hidden_size, generator=torch.Generator().manual_seed(9))
    ops = ops_for_model(model, kernels="triton")
    exact = ops.qkv(attn, x)
    for module in (attn.q_proj, attn.k_proj, attn.v_proj):
        weight = module.weight
        weight.data, weight.quant_state = bnb_functional._convert_weight_packed_for_cpu(weight.data,
                                                                                          weight.quant_state)
    repacked = ops.qkv(attn, x)
    for got, module, before in zip(repacked, (attn.q_proj, attn.k_proj, attn.v_proj), exact):
        assert torch.equal(got, module(x))  # bitsandbytes' own forward, on its own layout
        if bnb_functional.has_avx512bf16():  # where bitsandbytes' CPU kernels read that layout (elsewhere: not)
            torch.testing.assert_close(got, before, atol=0.05, rtol=0.05)  # absmax in bf16: close, not equal
    with pytest.raises(InvalidArgumentError, match="CPU-only packed layout"):
        NF4Tensors.from_bnb(attn.q_proj.weight.data, attn.q_proj.weight.quant_state)


@pytest.mark.parametrize("fuse_norms", [True, False])
def test_nf4_norm_before_attention_runs_inside_the_qkv_gemv(monkeypatch, fuse_norms):
    """With Linear4bit projections, as with dense ones: the add + RMSNorm before attention inside the NF4 q/k/v
    GEMV, one launch per layer and decode step (fuse_norms=False: apart); the unpatched model's tokens either way."""
    from moegraph import ops
    from moegraph.cuda_graph import decoder
    from moegraph.kernels import nf4_gemv, triton_available

    if not triton_available(torch.empty(0)):
        pytest.skip("Triton's interpreter is not on for CPU tensors here (a CUDA machine)")
    model = build_model("tiny", seed=5, quant="nf4", num_layers=2)
    monkeypatch.setattr(decoder, "ops_for_model", lambda m, backend="auto": ops.ops_for_model(
        m, backend, kernels="triton", fuse_norms=fuse_norms))
    launches = []
    fused = nf4_gemv.nf4_add_rms_norm_linear_group
    monkeypatch.setattr(nf4_gemv, "nf4_add_rms_norm_linear_group", lambda *a, **k: launches.append(1) or fused(*a, **k))
    inputs = random_prompts(3, vocab_size=model.config.vocab_size, seed=24)
    want = model.generate(**inputs, max_new_tokens=3, do_sample=False)
    moegraph.patch(model, max_batch_size=8)
    try:
        got = model.generate(**inputs, max_new_tokens=3, do_sample=False)
        stats = moegraph.decode_stats(model)
    finally:
        moegraph.unpatch(model)
    assert stats.fallback_reason is None and torch.equal(got, want)
    assert len(launches) == (2 if fuse_norms else 0) * (stats.steps - 1)  # layers x decode steps (not prefill's)


@pytest.mark.parametrize("rows", [1, 2])
def test_float32_compute_projections_take_the_fused_norm_at_one_row(monkeypatch, rows):
    """Linear4bit projections computing in float32 (BitsAndBytesConfig's default) beside bf16 rows: at one row the
    norm and q/k/v run in one launch, with the bf16-compute projections' bits and what the separate norm and
    float32 GEMV give (up to the fused norm's chunked sum of squares); from two rows (tensor cores, weights rounded
    to the compute dtype) the projections keep their float32 compute, apart."""
    from moegraph import ops
    from moegraph.kernels import nf4_gemv, rms_norm, triton_available

    if not triton_available(torch.empty(0)):
        pytest.skip("Triton's interpreter is not on for CPU tensors here (a CUDA machine)")
    model = build_model("tiny", seed=7, quant="nf4", num_layers=1, dtype=torch.bfloat16)
    layer = model.model.layers[0]
    attn, norm = layer.self_attn, layer.input_layernorm
    gen = torch.Generator().manual_seed(8)
    residual, x = (torch.randn(rows, model.config.hidden_size, generator=gen).bfloat16() for _ in range(2))

    def unfused(norm, residual, x, attn):
        summed, normed = rms_norm.add_rms_norm(residual, x, norm.weight, norm.variance_epsilon)
        return summed, ops._nf4_gemv_qkv(attn, normed)

    launches = []
    fused = nf4_gemv.nf4_add_rms_norm_linear_group
    monkeypatch.setattr(nf4_gemv, "nf4_add_rms_norm_linear_group", lambda *a, **k: launches.append(1) or fused(*a, **k))
    results = {}
    for compute in (torch.bfloat16, torch.float32):
        for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
            proj.compute_dtype = compute
        results[compute] = ops._nf4_gemv_add_norm_qkv(unfused, norm, residual, x, attn)
        results[compute, "apart"] = unfused(norm, residual, x, attn)
    assert len(launches) == (2 if rows == 1 else 1)  # bf16 compute is fused at both row counts
    summed, qkv = results[torch.float32]
    assert all(t.dtype == torch.bfloat16 for t in qkv)
    for got, apart in zip(qkv, results[torch.float32, "apart"][1]):
        torch.testing.assert_close(got, apart, atol=2e-2, rtol=2e-2)
    if rows == 1:
        assert all(torch.equal(a, b) for a, b in zip(qkv, results[torch.bfloat16][1]))
    else:  # float32 compute apart: the same function as the unfused op
        assert all(torch.equal(a, b) for a, b in zip(qkv, results[torch.float32, "apart"][1]))


@pytest.mark.parametrize("rows", [1, 2])
def test_float32_compute_projections_read_16_bit_rows_at_one_row(monkeypatch, rows):
    """At one row a float32-compute Linear4bit (BitsAndBytesConfig's default) runs the NF4 GEMV on the rows as they
    are (bf16: the words lookup reads them), with the bits of bf16 compute: the products are of exact float32
    weights either way, summed in float32 and rounded once. From two rows (tensor cores, weights rounded to the
    compute dtype) the GEMV computes in float32 as the module asks."""
    from moegraph import ops
    from moegraph.kernels import nf4_gemv, triton_available

    if not triton_available(torch.empty(0)):
        pytest.skip("Triton's interpreter is not on for CPU tensors here (a CUDA machine)")
    model = build_model("tiny", seed=9, quant="nf4", num_layers=1, dtype=torch.bfloat16)
    attn = model.model.layers[0].self_attn
    gen = torch.Generator().manual_seed(10)
    x = torch.randn(rows, model.config.hidden_size, generator=gen).bfloat16()
    attn_out = torch.randn(rows, attn.o_proj.in_features, generator=gen).bfloat16()
    seen = []
    for name in ("nf4_linear", "nf4_linear_group"):
        kernel = getattr(nf4_gemv, name)
        monkeypatch.setattr(nf4_gemv, name, lambda x, *a, _k=kernel, **k: seen.append(x.dtype) or _k(x, *a, **k))
    results = {}
    for compute in (torch.bfloat16, torch.float32):
        for proj in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj):
            proj.compute_dtype = compute
        seen.clear()
        results[compute] = (ops._nf4_gemv_linear(attn.o_proj, attn_out), *ops._nf4_gemv_qkv(attn, x))
        assert seen == [torch.bfloat16 if rows == 1 else compute] * 2
    assert all(t.dtype == torch.bfloat16 for t in results[torch.float32])
    if rows == 1:
        assert all(torch.equal(a, b) for a, b in zip(results[torch.float32], results[torch.bfloat16]))

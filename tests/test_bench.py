"""The bench's byte accounting (the roofline's numerator) on tiny models of each family, bf16 and NF4."""

import pytest
import torch

from moegraph.bench import count_distinct_experts, step_bytes
from moegraph.cli import build_parser
from moegraph.models import decoder_stack
from moegraph.testing import build_model, random_prompts


@pytest.mark.parametrize("name", ["tiny", "tiny-mixtral", "tiny-qwen3-vl-moe"])
def test_step_bytes_counts_the_stored_tensors(name):
    """The decoder's tensors (a vision-language model's text decoder: its vision tower is not read by a step)."""
    model = build_model(name, dtype=torch.bfloat16)
    config = model.config.get_text_config()
    inner = decoder_stack(model)
    parts = step_bytes(model, batch_size=2, distinct_experts=3.0, context=10.0)
    experts = next(layer.mlp.experts for layer in inner.layers if hasattr(layer.mlp, "experts"))
    per_expert = sum(p.numel() for p in experts.parameters()) * 2 / experts.num_experts
    moe_layers = sum(hasattr(layer.mlp, "experts") for layer in inner.layers)
    assert parts["experts"] == pytest.approx(moe_layers * 3.0 * per_expert)
    assert parts["lm_head"] == model.lm_head.weight.numel() * 2
    head_dim = inner.layers[0].self_attn.head_dim
    assert parts["kv_cache"] == config.num_hidden_layers * 2 * 10.0 * 2 * config.num_key_value_heads * head_dim * 2
    # every weight is counted once except the experts (3 of them) and the embeddings (2 rows)
    dense = sum(p.numel() * 2 for n, p in model.named_parameters()
                if ".experts." not in n and "embed_tokens" not in n and ".visual." not in n)
    assert parts["attention"] + parts["other_layer_weights"] + parts["lm_head"] == dense
    assert parts["total"] == pytest.approx(sum(v for k, v in parts.items() if k != "total"))


@pytest.mark.parametrize("name", ["tiny", "tiny-glm4-moe", "tiny-gpt-oss", "tiny-qwen3-vl-moe"])
def test_distinct_experts_are_counted_from_every_familys_routing(name):
    """Per MoE layer and decode step, between top_k (one row) and the experts there are (GLM-4-MoE's router
    returns logits, not indices: the count reads the experts' own top_k_index argument)."""
    model = build_model(name)
    config = model.config.get_text_config()
    top_k, experts = config.num_experts_per_tok, getattr(config, "num_local_experts", None) or getattr(
        config, "n_routed_experts", None) or config.num_experts
    one_row = random_prompts(1, vocab_size=config.vocab_size, min_len=5, max_len=5, seed=0)
    assert count_distinct_experts(model, one_row, steps=3) == top_k
    four_rows = random_prompts(4, vocab_size=config.vocab_size, min_len=3, max_len=6, seed=0)
    assert top_k < count_distinct_experts(model, four_rows, steps=3) <= min(experts, 4 * top_k)


@pytest.mark.parametrize("double_quant", [False, True])
def test_step_bytes_of_nf4_weights_count_codes_and_absmax(double_quant):
    dense = step_bytes(build_model("tiny", dtype=torch.bfloat16), 1, 3.0, 10.0)
    nf4 = step_bytes(build_model("tiny", dtype=torch.bfloat16, quant="nf4", double_quant=double_quant), 1, 3.0, 10.0)
    # 0.5 byte per weight plus one absmax per 64 weights (fp32, or one byte when double-quantized), against 2 bytes;
    # double quantization adds a 1 KB code table per weight stack and layer (read once, whatever the experts)
    per_weight = 0.5 + (1 if double_quant else 4) / 64
    tables = 4 * 2 * 1024 if double_quant else 0
    assert nf4["experts"] - tables == pytest.approx(dense["experts"] * per_weight / 2, rel=0.02)
    assert nf4["attention"] < dense["attention"] * 0.5  # Linear4bit projections, their quant state included
    assert nf4["lm_head"] == dense["lm_head"] and nf4["kv_cache"] == dense["kv_cache"]


def test_bench_command_line_takes_a_model_dtype_and_double_quant():
    args = build_parser().parse_args(["bench", "--model", "mixtral-8x7b", "--dtype", "float16", "--quant", "nf4",
                                      "--double-quant"])
    assert (args.model, args.dtype, args.quant, args.double_quant, args.num_layers) == (
        "mixtral-8x7b", "float16", "nf4", True, None)


def _bench(tmp_path, *extra):
    """`python -m moegraph bench` on the CPU with the tiny model; the JSON it wrote."""
    import json

    from moegraph.cli import main

    argv = ["bench", "--model", "tiny", "--new-tokens", "4", "--runs", "1", "--out", str(tmp_path), *extra]
    assert main(argv) == 0
    (path,) = tmp_path.glob("bench_tiny_*.json")
    results = json.loads(path.read_text())
    assert results["gpu"] == "cpu" and results["date"] and results["torch"] and results["transformers"]
    assert results["command"].startswith("bench ") or results["command"].startswith("python -m moegraph bench")
    return results


def _assert_measured(row, new_tokens):
    assert row["status"] == "ok", row
    assert row["new_tokens"] == new_tokens and row["runs"] >= 1
    assert row["tok_s"] > 0 and row["decode_ms_per_step"] > 0 and row["prefill_ms"] > 0 and row["roofline_tok_s"] > 0
    assert row["kv_cache_gb"] > 0


def test_bench_sample_puts_sampled_rows_beside_greedy_ones_with_host_time(tmp_path, capsys):
    results = _bench(tmp_path, "--backends", "hf,moegraph", "--batch-sizes", "1", "--sample")
    assert results["modes"] == ["decode"] and results["sample"]["top_k"] == 50
    rows = {(c["backend"], c["sample"]): c for c in results["cases"]}
    assert set(rows) == {(b, s) for b in ("hf", "moegraph") for s in (False, True)}
    for row in rows.values():
        _assert_measured(row, 4)
    assert rows["moegraph", True]["host_ms_per_step"] > 0 and rows["moegraph", False]["host_ms_per_step"] > 0
    out = capsys.readouterr().out
    assert "| backend | bs |" in out and "| sampled | host ms/step |" in out


def test_bench_prompt_len_rows_read_the_kv_cache_of_their_context(tmp_path):
    results = _bench(tmp_path, "--prompt-len", "8,16", "--batch-sizes", "1,2")
    rows = results["prompt_len_cases"]
    assert results["cases"] == [] and len(rows) == 8
    assert {(r["backend"], r["batch_size"], r["prompt_len"]) for r in rows} == {
        (b, n, p) for b in ("hf", "moegraph") for n in (1, 2) for p in (8, 16)}
    for row in rows:
        _assert_measured(row, 4)
    kv = {(r["backend"], r["batch_size"], r["prompt_len"]): r["kv_cache_gb"] for r in rows}
    assert kv["moegraph", 1, 16] > kv["moegraph", 1, 8] and kv["hf", 2, 8] == pytest.approx(2 * kv["hf", 1, 8])


def test_bench_long_sampled_run_and_time_to_first_token(tmp_path):
    results = _bench(tmp_path, "--long", "2,8,6", "--ttft", "4,8", "--batch-sizes", "1")
    long = results["long_cases"]
    assert {r["backend"] for r in long} == {"hf", "moegraph"} and results["sample"]["top_p"] == 0.9
    for row in long:
        _assert_measured(row, 6)
        assert row["sample"] and row["batch_size"] == 2 and row["prompt_len"] == 8
    ttft = results["ttft_cases"]
    assert {(r["backend"], r["prompt_len"]) for r in ttft} == {(b, p) for b in ("hf", "moegraph") for p in (4, 8)}
    for row in ttft:
        assert row["status"] == "ok" and row["runs"] == 1 and row["ttft_ms"] > 0 and row["min_ms"] <= row["ttft_ms"]
    assert all(r["prefill_ms"] > 0 for r in ttft if r["backend"] == "moegraph")


def test_bench_ttft_of_each_prefill_when_named(tmp_path):
    """moegraph_prefill / moegraph_hf_prefill run only when named: moegraph with patch(prefill="graphs") /
    patch(prefill="transformers"), beside moegraph's default ("auto": transformers' prefill on the CPU)."""
    results = _bench(tmp_path, "--ttft", "6", "--batch-sizes", "2", "--backends",
                     "moegraph,moegraph_prefill,moegraph_hf_prefill")
    ttft = {r["backend"]: r for r in results["ttft_cases"]}
    assert set(ttft) == {"moegraph", "moegraph_prefill", "moegraph_hf_prefill"}
    assert ttft["moegraph_prefill"]["prefill"] == "graphs"
    assert ttft["moegraph"]["prefill"] == "transformers: prefill='auto' on cpu"
    assert ttft["moegraph_hf_prefill"]["prefill"] == "transformers: prefill='transformers'"
    assert all(r["status"] == "ok" and r["ttft_ms"] > 0 for r in ttft.values())
    assert build_parser().parse_args(["bench"]).backends is None  # the default decode table leaves it out


def test_bench_profile_decode_and_prefill(tmp_path, capsys):
    results = _bench(tmp_path, "--profile", "all", "--profile-prompt-len", "6")
    profile = results["profile"]
    assert set(profile) == {"decode_bs1", "prefill_bs1"}
    assert profile["prefill_bs1"]["prompt_len"] == 6 and profile["prefill_bs1"]["first_token_ms"] > 0
    for entry in profile.values():
        assert entry["calls"] > 0 and entry["kernels"] and "per decoder layer" in entry["format"]
    assert "prefill profile (moegraph, batch 1, 6-token prompts)" in capsys.readouterr().out


def test_bench_over_budget_lengths_are_reported_and_longer_ones_skipped(tmp_path):
    results = _bench(tmp_path, "--prompt-len", "8,16", "--batch-sizes", "1", "--backends", "hf", "--budget-s", "0")
    first, second = results["prompt_len_cases"]
    assert first["status"].startswith("over budget: the first call took")
    assert second["status"] == "over budget: skipped (over budget at 8-token prompts)"
    assert second["roofline_tok_s"] > 0  # the row still says what the roofline would be


def test_runner_shortens_a_case_to_its_budget_and_says_so():
    from types import SimpleNamespace

    from moegraph.bench import Case, Runner

    runner = Runner(None, SimpleNamespace(runs=3, budget_s=10.0), deadline=0.0)
    case = Case("hf", 1, new_tokens=64)
    assert runner._fit_tokens(case, prefill=1.0, per_step=0.1, budget=3.0) == 21
    assert case.new_tokens == 21 and case.notes == ["new tokens shortened 64->21 to fit 3 s"]
    case = Case("hf", 1, new_tokens=64)
    assert runner._fit_tokens(case, prefill=1.0, per_step=1.0, budget=3.0) is None
    assert case.status.startswith("over budget: one run ~64 s")


def test_bench_mode_flags_take_their_default_shapes():
    args = build_parser().parse_args(["bench", "--long", "--ttft", "--profile", "prefill"])
    assert (args.long, args.ttft, args.profile, args.prompt_len, args.batch_sizes) == (
        "32,256,1024", "16,512,4096", "prefill", None, None)


def test_bench_of_a_vision_language_model_reads_its_text_decoder(tmp_path):
    """bench --model on Qwen3-VL-MoE's tiny preset: the text decoder's layers, config and roofline."""
    import json

    from moegraph.cli import main

    argv = ["bench", "--model", "tiny-qwen3-vl-moe", "--new-tokens", "4", "--runs", "1", "--batch-sizes", "2",
            "--out", str(tmp_path)]
    assert main(argv) == 0
    (path,) = tmp_path.glob("bench_tiny-qwen3-vl-moe_*.json")
    results = json.loads(path.read_text())
    text = build_model("tiny-qwen3-vl-moe").config.text_config
    assert results["num_layers"] == text.num_hidden_layers
    rows = {row["backend"]: row for row in results["cases"]}
    for row in rows.values():
        _assert_measured(row, 4)


def test_first_token_clock_times_the_prefill_inside_the_same_generate_call():
    """Plain transformers' prefill is read inside the timed call, so its decode time can't come out negative."""
    import time

    from moegraph.bench import FirstTokenClock

    model = build_model("tiny")
    prompts = random_prompts(2, vocab_size=model.config.vocab_size, min_len=6, max_len=6)
    clock = FirstTokenClock()
    start = time.perf_counter()
    out = model.generate(**prompts, max_new_tokens=5, min_new_tokens=5, do_sample=False, logits_processor=[clock])
    end = time.perf_counter()
    assert out.shape[1] == prompts["input_ids"].shape[1] + 5
    assert clock.at is not None and start < clock.at < end
    first = clock.at
    scores = torch.randn(2, 8)
    assert clock(None, scores) is scores and clock.at == first  # later steps leave scores and the time alone


def test_every_ab_decode_switch_changes_what_it_names(monkeypatch):
    """benchmarks/ab_decode.py's switches: each setter moves the module choices it claims (a renamed constant
    would leave an A/B that times the same code twice), and the defaults it restores are the modules' own."""
    import importlib.util
    import pathlib
    import sys

    from moegraph import ops
    from moegraph.kernels import _triton, decode_attention, fused_moe, gemv, nf4_gemv, nf4_moe, qk_norm_rope, router_topk

    benchmarks = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"
    monkeypatch.syspath_prepend(str(benchmarks))  # ab_decode imports _decode from its folder
    spec = importlib.util.spec_from_file_location("ab_decode", benchmarks / "ab_decode.py")
    ab_decode = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ab_decode)
    monkeypatch.delitem(sys.modules, "_decode", raising=False)
    watched = {"fuse_norms": lambda: ops.FUSE_NORMS, "pair_combine": lambda: (fused_moe.PAIR_COMBINE,
                                                                                    nf4_moe.PAIR_COMBINE),
               "gemv_dot": lambda: gemv.DOT_MAX_ROWS,
               "one_warp": lambda: (router_topk.ROUTER_WARPS, qk_norm_rope.NUM_WARPS),
               "align_histogram": lambda: fused_moe.ALIGN_METHOD,
               "nf4_x_pairs": lambda: (nf4_moe.X_PAIRS, nf4_gemv.X_PAIRS),
               "nf4_shuffle": lambda: (nf4_moe.LOOKUP, nf4_moe.FEW_TOKENS_LOOKUP, nf4_gemv.LOOKUP),
               "nf4_moe_words": lambda: nf4_moe.LOOKUP, "nf4_few_words": lambda: nf4_moe.FEW_TOKENS_LOOKUP,
               "nf4_gemv_words": lambda: nf4_gemv.LOOKUP, "pdl_late_trigger": lambda: _triton.PDL_EARLY_TRIGGER,
               "fuse_router_norm": lambda: ops.FUSE_ROUTER_NORM,
               "attn_short_chunks": lambda: decode_attention.MIN_CHUNK,
               "nf4_one_token_w8": lambda: nf4_moe.ONE_TOKEN_NUM_WARPS,
               "early_weights": lambda: (nf4_moe.WEIGHTS_BEFORE_WAIT, nf4_gemv.WEIGHTS_BEFORE_WAIT),
               "nf4_wide_steps": lambda: nf4_gemv.WIDE_TILE,
               "nf4_shared_x": lambda: nf4_moe.SHARED_X, "nf4_one_token_k512": lambda: nf4_moe.ONE_TOKEN_BLOCK_K,
               "nf4_few_16_32": lambda: nf4_moe.FEW_TOKENS_BLOCK_N,
               "nf4_one_token_gu1024": lambda: nf4_moe.ONE_TOKEN_BLOCK_K,
               "nf4_one_token_gu2048": lambda: nf4_moe.ONE_TOKEN_BLOCK_K,
               "nf4_dot_stages2": lambda: nf4_moe.DOT_NUM_STAGES, "nf4_dot_stages1": lambda: nf4_moe.DOT_NUM_STAGES}
    assert set(watched) == set(ab_decode.SWITCHES)
    for name, module_attr in (("pair_combine", (fused_moe, "PAIR_COMBINE")), ("gemv_dot", (gemv, "DOT_MAX_ROWS")),
                              ("one_warp", (router_topk, "ROUTER_WARPS")),
                              ("align_histogram", (fused_moe, "ALIGN_METHOD")), ("nf4_moe_words", (nf4_moe, "LOOKUP")),
                              ("nf4_x_pairs", (nf4_moe, "X_PAIRS")), ("pdl_late_trigger", (_triton, "PDL_EARLY_TRIGGER")),
                              ("fuse_router_norm", (ops, "FUSE_ROUTER_NORM")),
                              ("attn_short_chunks", (decode_attention, "MIN_CHUNK")),
                              ("nf4_one_token_w8", (nf4_moe, "ONE_TOKEN_NUM_WARPS")),
                              ("early_weights", (nf4_moe, "WEIGHTS_BEFORE_WAIT")),
                              ("nf4_wide_steps", (nf4_gemv, "WIDE_TILE")), ("nf4_shared_x", (nf4_moe, "SHARED_X")),
                              ("nf4_one_token_k512", (nf4_moe, "ONE_TOKEN_BLOCK_K")),
                              ("nf4_few_16_32", (nf4_moe, "FEW_TOKENS_BLOCK_N")),
                              ("nf4_dot_stages2", (nf4_moe, "DOT_NUM_STAGES"))):
        monkeypatch.setattr(*module_attr, getattr(*module_attr))  # restored after the test
    monkeypatch.setattr(nf4_moe, "PAIR_COMBINE", nf4_moe.PAIR_COMBINE)
    monkeypatch.setattr(nf4_gemv, "LOOKUP", nf4_gemv.LOOKUP)
    monkeypatch.setattr(nf4_moe, "FEW_TOKENS_LOOKUP", nf4_moe.FEW_TOKENS_LOOKUP)
    monkeypatch.setattr(nf4_gemv, "X_PAIRS", nf4_gemv.X_PAIRS)
    monkeypatch.setattr(nf4_gemv, "WEIGHTS_BEFORE_WAIT", nf4_gemv.WEIGHTS_BEFORE_WAIT)
    monkeypatch.setattr(ops, "FUSE_NORMS", ops.FUSE_NORMS)
    monkeypatch.setattr(qk_norm_rope, "NUM_WARPS", qk_norm_rope.NUM_WARPS)
    for name, (setter, default, _) in ab_decode.SWITCHES.items():
        setter(False)
        off = watched[name]()
        setter(True)
        on = watched[name]()
        assert on != off, name
        setter(default)
        assert watched[name]() == (None if default is None else on if default else off), name


def test_nf4_bounds_replays_the_launches_fused_moe_experts_nf4_makes(monkeypatch):
    """benchmarks/nf4_bounds.py times the gate_up and down launches alone by recording nf4_moe._launch's calls and
    replaying them: a recorded call must replay to the kernels' own output (here through Triton's interpreter)."""
    import importlib.util
    import pathlib

    from moegraph.kernels import nf4_moe, triton_available
    from moegraph.kernels.moe_combine import moe_combine

    if not triton_available(torch.empty(0)):
        pytest.skip("Triton's interpreter is not on for CPU tensors here (a CUDA machine)")
    benchmarks = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"
    monkeypatch.syspath_prepend(str(benchmarks))  # nf4_bounds imports nf4_kernels from its folder
    spec = importlib.util.spec_from_file_location("nf4_bounds", benchmarks / "nf4_bounds.py")
    nf4_bounds = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(nf4_bounds)
    gen = torch.Generator().manual_seed(3)
    nf4 = lambda rows, cols: nf4_moe.NF4Tensors(  # noqa: E731
        torch.randint(0, 256, (4, rows * cols // 2), dtype=torch.uint8, generator=gen),
        torch.rand(4, rows * cols // 64, generator=gen) * 0.03, (4, rows, cols))
    gate_up, down, code = nf4(128, 64), nf4(64, 64), nf4_moe.nf4_code("cpu")
    x = torch.randn(1, 64, generator=gen).bfloat16()
    route = (torch.tensor([[1, 3]]), torch.tensor([[0.75, 0.25]]).bfloat16())
    launches = nf4_bounds._recorded_launches(x, route, gate_up, down, code, nf4_moe.NF4MoEConfig())
    assert len(launches) == 2
    for args, kwargs in launches:
        nf4_moe._launch(*args, **kwargs)
    out = launches[1][0][3]  # the down launch's output: _launch(kernel, grid, inputs, out, ...), rows [pairs, H]
    want = nf4_moe.fused_moe_experts_nf4(x, *route, gate_up, down, code, lambda rows, *a: rows)
    assert torch.equal(out, want)

"""The bench's byte accounting (the roofline's numerator) on tiny models of each family, bf16 and NF4."""

import pytest
import torch

from moegraph.bench import step_bytes
from moegraph.cli import build_parser
from moegraph.testing import build_model


@pytest.mark.parametrize("name", ["tiny", "tiny-mixtral"])
def test_step_bytes_counts_the_stored_tensors(name):
    model = build_model(name, dtype=torch.bfloat16)
    config = model.config
    parts = step_bytes(model, batch_size=2, distinct_experts=3.0, context=10.0)
    experts = model.model.layers[0].mlp.experts
    per_expert = sum(p.numel() for p in experts.parameters()) * 2 / experts.num_experts
    assert parts["experts"] == pytest.approx(config.num_hidden_layers * 3.0 * per_expert)
    assert parts["lm_head"] == model.lm_head.weight.numel() * 2
    head_dim = model.model.layers[0].self_attn.head_dim
    assert parts["kv_cache"] == config.num_hidden_layers * 2 * 10.0 * 2 * config.num_key_value_heads * head_dim * 2
    # every weight is counted once except the experts (3 of them) and the embeddings (2 rows)
    dense = sum(p.numel() * 2 for n, p in model.named_parameters() if ".experts." not in n and "embed_tokens" not in n)
    assert parts["attention"] + parts["other_layer_weights"] + parts["lm_head"] == dense
    assert parts["total"] == pytest.approx(sum(v for k, v in parts.items() if k != "total"))


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

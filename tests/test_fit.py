"""`moegraph.fit_report` / `python -m moegraph info --model`: sizes from the config against the real modules."""

import pytest
import torch
from transformers import Qwen3MoeForCausalLM

import moegraph
from moegraph.cli import main
from moegraph.errors import InvalidArgumentError, UnsupportedModelError
from moegraph.fit import count_parameters, fit_report, kv_cache_bytes, load_config, weight_bytes, weight_groups
from moegraph.quant.experts import quantize_experts
from moegraph.testing import build_model, make_config

NF4_MEASURED_H200_GB = 18.09  # BENCHMARKS.md: 48-layer NF4 model built one layer at a time, 2026-12-03


def _meta_model(config):
    with torch.device("meta"):
        return Qwen3MoeForCausalLM(config)


def _group_of(name: str) -> str:
    """The fit.py group a parameter of the real module belongs to, from its name."""
    if "embed_tokens" in name:
        return "embeddings"
    if name.startswith("lm_head"):
        return "lm_head"
    if "norm" in name:
        return "norms"
    if "self_attn" in name:
        return "attention bias" if name.endswith(".bias") else "attention"
    if ".mlp.experts." in name:
        return "experts"
    if ".mlp.gate." in name:
        return "routers"
    return "dense mlp"


def _module_counts(model) -> dict[str, int]:
    counts: dict[str, int] = {}
    for name, p in model.named_parameters():  # tied weights appear once, as in the formula
        counts[_group_of(name)] = counts.get(_group_of(name), 0) + p.numel()
    return counts


def test_qwen3_30b_a3b_count_equals_module_structure_extrapolated_per_layer():
    one, two = (sum(p.numel() for p in _meta_model(make_config("qwen3-30b-a3b", num_layers=n)).parameters())
                for n in (1, 2))
    layers = make_config("qwen3-30b-a3b").num_hidden_layers
    from_modules = one + (layers - 1) * (two - one)
    assert count_parameters(load_config("qwen3-30b-a3b")) == from_modules == 30_532_122_624


@pytest.mark.parametrize("overrides", [
    dict(),
    # tied lm_head, biases, dense MLP layers (mlp_only_layers and decoder_sparse_step): every branch of the formula
    dict(tie_word_embeddings=True, attention_bias=True, mlp_only_layers=[0], decoder_sparse_step=2),
], ids=["qwen3-30b-a3b", "tied-bias-dense-layers"])
def test_groups_equal_the_real_module_per_group(overrides):
    config = make_config("qwen3-30b-a3b", num_layers=4, **overrides)
    want = _module_counts(_meta_model(config))
    assert {g.name: g.params for g in weight_groups(config)} == want


def test_qwen3_30b_a3b_sizes():
    config = load_config("qwen3-30b-a3b")
    assert weight_bytes(config, "bf16") / 1e9 == pytest.approx(61.06, abs=0.01)
    assert weight_bytes(config, "fp16") == weight_bytes(config, "bf16")
    assert weight_bytes(config, "nf4") / 1e9 == pytest.approx(NF4_MEASURED_H200_GB, rel=0.01)
    saved = (weight_bytes(config, "nf4") - weight_bytes(config, "nf4-dq")) / 1e9
    assert saved == pytest.approx(1.39, abs=0.01)  # 3 of 4 absmax bytes per 64 weights, less the nested absmax
    assert kv_cache_bytes(config, 1, 4096) == 4096 * 96 * 1024  # 96 KB per token (DESIGN.md)
    assert kv_cache_bytes(config, 2, 4000) == kv_cache_bytes(config, 2, 4096)  # positions rounded up to 256


@pytest.mark.parametrize("double_quant", [False, True])
def test_nf4_expert_bytes_equal_moegraphs_format(double_quant):
    model = build_model("tiny", num_layers=2)
    quantize_experts(model, double_quant=double_quant)
    buffers = sum(b.numel() * b.element_size() for name, b in model.named_buffers() if ".experts." in name)
    experts = next(g for g in weight_groups(model.config) if g.name == "experts")
    from moegraph.fit import _nf4_bytes

    assert _nf4_bytes(experts, double_quant) == buffers


def test_fits_on_named_gpus():
    report = fit_report("qwen3-30b-a3b", batch_size=1, seq_len=4096, device="L4")
    assert not report.line("bf16").fits and report.line("nf4").fits
    assert report.dtype == torch.bfloat16 and report.memory.capability == (8, 9)
    t4 = fit_report("qwen3-30b-a3b", device="T4")
    assert t4.dtype == torch.float16 and "no bf16" in t4.dtype_reason
    assert all(line.fits for line in fit_report("qwen3-30b-a3b", batch_size=8, seq_len=32768, device="h200").lines)


def test_report_on_the_cpu_runs_the_probe_and_reads_config_only():
    report = moegraph.fit_report("qwen3-30b-a3b", batch_size=1, seq_len=4096, device="cpu")
    text = str(report)
    assert report.memory.at_hand and report.dtype == torch.float32
    assert "61.06 GB" in text and "18.09 GB" in text and "probed here" in text


def test_local_config_file_and_folder(tmp_path):
    make_config("tiny").save_pretrained(tmp_path)
    renamed = tmp_path / "tiny.json"
    renamed.write_text((tmp_path / "config.json").read_text())
    want = count_parameters(make_config("tiny"))
    for source in (tmp_path, tmp_path / "config.json", renamed):
        assert fit_report(str(source), device="cpu").parameters == want


def test_hub_name_offline_names_hf_hub_offline_and_local_path(monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(InvalidArgumentError, match="HF_HUB_OFFLINE") as info:
        load_config("Qwen/Qwen3-30B-A3B")
    assert "local config.json" in str(info.value)


def test_errors_name_what_was_found():
    with pytest.raises(InvalidArgumentError, match="neither a torch device"):
        fit_report("tiny", device="K80")
    with pytest.raises(UnsupportedModelError, match="qwen3_moe"):
        from transformers import LlamaConfig

        fit_report(LlamaConfig(), device="cpu")


def test_cli_info_model(capsys):
    assert main(["info", "--model", "qwen3-30b-a3b", "--batch-size", "2", "--seq-len", "1000", "--device", "A100-80GB"]) == 0
    out = capsys.readouterr().out
    assert "A100-80GB (sm_80)" in out and "batch 2 x 1000 tokens" in out and "predicted, not probed" in out
    assert main(["info", "--model", "tiny", "--device", "K80"]) == 2


@pytest.mark.parametrize("name", ["tiny", "tiny-mixtral", "tiny-olmoe", "tiny-qwen2-moe"])
@pytest.mark.parametrize("double_quant", [False, True])
def test_nf4_size_of_every_family_equals_the_built_model(name, double_quant):
    """fit's count from the config against the tensors (and bitsandbytes quant states) of the model built in NF4;
    they differ by bitsandbytes' 64-byte code table per Linear4bit, which fit leaves out."""
    from moegraph.bench import _tensor_bytes

    model = build_model(name, dtype=torch.bfloat16, quant="nf4", double_quant=double_quant)
    want = weight_bytes(model.config, "nf4-dq" if double_quant else "nf4")
    assert _tensor_bytes(model) == pytest.approx(want, rel=0.01)
    assert weight_bytes(model.config, "bf16") == 2 * sum(p.numel() for p in build_model(name).parameters())


def test_vision_language_model_counts_its_vision_tower_and_caches_its_text_decoder(capsys):
    """Qwen3-VL-MoE nests its decoder config (text_config): the KV cache follows the text decoder; the vision tower's
    weights are counted as their own group (loaded, never read by a decode step)."""
    config = load_config("qwen3-vl-30b-a3b")
    text = config.get_text_config()
    groups = {g.name: g.params for g in weight_groups(config)}
    assert groups["vision"] > 0 and "dense mlp" not in groups  # every decoder layer of it is an MoE layer
    head_dim = text.head_dim
    assert kv_cache_bytes(config, 1, 4096) == text.num_hidden_layers * 2 * 4096 * text.num_key_value_heads * head_dim * 2
    assert main(["info", "--model", "qwen3-vl-30b-a3b", "--device", "L4"]) == 0
    assert "vision" in capsys.readouterr().out
    tiny = build_model("tiny-qwen3-vl-moe")
    assert count_parameters(tiny.config) == sum(p.numel() for p in tiny.parameters())

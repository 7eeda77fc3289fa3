"""patch / unpatch: identity, idempotence, scopes, errors."""

import contextlib
from unittest import mock

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
from transformers.models.qwen3_moe import modeling_qwen3_moe as qwen3

import moegraph
import moegraph.moe.interface
import moegraph.ops
import moegraph.patches.api
from moegraph.testing import build_model, make_config, random_prompts


def _logits(model, inputs):
    with torch.no_grad():
        return model(**inputs).logits


def _blocks(model):
    return [m for m in model.modules() if isinstance(m, qwen3.Qwen3MoeSparseMoeBlock)]


@contextlib.contextmanager
def _spy(name):
    """A Mock wrapping the function registered under `name` in transformers' ExpertsInterface, in its place
    (as transformers' own test_eager_matches_batched_and_grouped_inference mocks them)."""
    moegraph.moe.interface.register_experts()
    spy = mock.Mock(wraps=ALL_EXPERTS_FUNCTIONS._global_mapping[name])
    with mock.patch.dict(ALL_EXPERTS_FUNCTIONS._global_mapping, {name: spy}):
        yield spy


@pytest.mark.parametrize("overrides", [{}, {"mlp_only_layers": [0, 2]}, {"norm_topk_prob": False},
                                       {"decoder_sparse_step": 2}])
def test_patched_model_logits_equal_unpatched(overrides):
    model = build_model("tiny", experts_implementation="eager", **overrides)
    inputs = random_prompts(3, vocab_size=model.config.vocab_size, seed=2)
    want = _logits(model, inputs)
    moegraph.patch(model)
    got = _logits(model, inputs)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)
    dense = [layer.mlp for layer in model.model.layers if isinstance(layer.mlp, qwen3.Qwen3MoeMLP)]
    assert len(dense) == model.config.num_hidden_layers - len(_blocks(model))
    assert all("forward" not in vars(mlp) for mlp in dense)  # dense MLP layers stay as they are


def test_router_logits_still_returned():
    model = build_model("tiny")
    inputs = random_prompts(2, vocab_size=model.config.vocab_size)
    with torch.no_grad():
        want = model(**inputs, output_router_logits=True)
        moegraph.patch(model)
        got = model(**inputs, output_router_logits=True)
    assert len(got.router_logits) == model.config.num_hidden_layers
    for a, b in zip(got.router_logits, want.router_logits):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-5)
    assert torch.allclose(got.aux_loss, want.aux_loss, rtol=1e-5)


def test_patch_is_idempotent_and_unpatch_restores_identical_objects():
    model = build_model("tiny")
    class_forward = vars(qwen3.Qwen3MoeSparseMoeBlock)["forward"]
    class_generate = qwen3.Qwen3MoeForCausalLM.generate
    before = vars(model.config)["_experts_implementation_internal"]
    assert moegraph.patch(model) is model
    assert model.config._experts_implementation == "moegraph"
    generate = model.generate
    moegraph.patch(model)  # again: nothing more
    assert model.generate is generate and model.config._experts_implementation == "moegraph"
    assert moegraph.is_patched(model)
    assert all("forward" not in vars(b) for b in _blocks(model))  # the blocks stay transformers' own
    moegraph.unpatch(model)
    assert not moegraph.is_patched(model)
    assert vars(model.config)["_experts_implementation_internal"] is before
    assert "generate" not in vars(model)
    assert vars(qwen3.Qwen3MoeSparseMoeBlock)["forward"] is class_forward
    assert qwen3.Qwen3MoeForCausalLM.generate is class_generate
    moegraph.unpatch(model)  # unpatching an unpatched model is a no-op


def test_model_patch_leaves_other_models_untouched():
    patched, other = build_model("tiny", seed=0), build_model("tiny", seed=0)
    moegraph.patch(patched)
    assert not moegraph.is_patched(other)
    assert other.config._experts_implementation == "grouped_mm"
    assert "generate" not in vars(other)
    inputs = random_prompts(2, vocab_size=other.config.vocab_size)
    with _spy("moegraph") as ours, _spy("grouped_mm") as theirs:
        _logits(other, inputs)
    assert ours.call_count == 0 and theirs.call_count == len(_blocks(other))


def test_class_patch_before_from_config_and_unpatch():
    original = vars(qwen3.Qwen3MoeSparseMoeBlock)["forward"]
    reference = build_model("tiny", experts_implementation="eager")
    inputs = random_prompts(2, vocab_size=reference.config.vocab_size)
    want = _logits(reference, inputs)
    moegraph.patch()
    moegraph.patch()  # idempotent
    assert moegraph.is_patched()
    model = build_model("tiny")  # built after the class patch, asking for no experts implementation
    explicit = build_model("tiny", experts_implementation="eager")  # an explicit choice is kept
    assert moegraph.is_patched(model)
    assert model.config._experts_implementation == "moegraph" and explicit.config._experts_implementation == "eager"
    with _spy("moegraph") as ours:
        assert torch.allclose(_logits(model, inputs), want, rtol=1e-5, atol=1e-5)
    assert ours.call_count == len(_blocks(model))
    moegraph.unpatch()
    assert not moegraph.is_patched() and not moegraph.is_patched(model)
    assert model.config._experts_implementation == "grouped_mm"  # what transformers would have chosen
    assert explicit.config._experts_implementation == "eager"
    assert vars(qwen3.Qwen3MoeSparseMoeBlock)["forward"] is original
    assert "get_correct_experts_implementation" not in vars(qwen3.Qwen3MoePreTrainedModel)


def test_class_patch_adopts_a_model_built_before_at_its_first_generate(moegraph_logs):
    model = build_model("tiny", num_layers=1)
    explicit = build_model("tiny", num_layers=1, experts_implementation="batched_mm")
    moegraph.patch()
    assert moegraph.is_patched(model) and model.config._experts_implementation == "grouped_mm"
    inputs = random_prompts(2, vocab_size=model.config.vocab_size)
    model.generate(**inputs, max_new_tokens=2, do_sample=False)
    assert model.config._experts_implementation == "moegraph"
    assert moegraph.decode_stats(model).fallback_reason is None
    explicit.generate(**inputs, max_new_tokens=2, do_sample=False)  # an explicit choice is honoured: transformers
    assert explicit.config._experts_implementation == "batched_mm"
    assert "experts_implementation='batched_mm'" in moegraph.decode_stats(explicit).fallback_reason
    moegraph.unpatch()
    assert model.config._experts_implementation == "grouped_mm"


def test_instance_patch_on_class_patched_model():
    moegraph.patch()
    model = build_model("tiny")
    moegraph.patch(model)
    inputs = random_prompts(2, vocab_size=model.config.vocab_size)
    out = model.generate(**inputs, max_new_tokens=4, do_sample=False)
    assert out.shape[1] == inputs["input_ids"].shape[1] + 4
    moegraph.unpatch(model)
    assert model.config._experts_implementation == "moegraph"  # the class patch's, still active
    moegraph.unpatch()
    assert not moegraph.is_patched(model)
    assert model.config._experts_implementation == "grouped_mm"


def test_class_unpatch_before_model_unpatch_restores_transformers_choice():
    moegraph.patch()
    model = build_model("tiny")
    moegraph.patch(model)
    moegraph.unpatch()
    assert moegraph.is_patched(model) and model.config._experts_implementation == "moegraph"
    moegraph.unpatch(model)
    assert model.config._experts_implementation == "grouped_mm"


def test_unsupported_model_raises_with_type_and_supported_list():
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2)
    llama = LlamaForCausalLM(config)
    with pytest.raises(moegraph.UnsupportedModelError, match=r"model_type='llama'.*qwen3_moe"):
        moegraph.patch(llama)
    with pytest.raises(moegraph.UnsupportedModelError, match="nn.Module"):
        moegraph.patch("Qwen/Qwen3-30B-A3B")


def test_old_transformers_version_is_refused(monkeypatch):
    import transformers

    monkeypatch.setattr(transformers, "__version__", "4.57.1")
    with pytest.raises(moegraph.UnsupportedVersionError, match=r"transformers >= 5.*4\.57\.1"):
        moegraph.patch(build_model("tiny"))


def test_bad_options_raise_clear_errors():
    model = build_model("tiny")
    with pytest.raises(moegraph.InvalidArgumentError, match="moe_backend='fast'"):
        moegraph.patch(model, moe_backend="fast")
    with pytest.raises(moegraph.InvalidArgumentError, match="max_batch_size"):
        moegraph.patch(model, max_batch_size=0)
    with pytest.raises(moegraph.InvalidArgumentError, match=r"unknown option\(s\) 'no_such_option'; valid options"):
        moegraph.patch(model, no_such_option=1)
    assert not moegraph.is_patched(model)


def test_unavailable_explicit_backend_is_refused_at_patch(monkeypatch):
    from moegraph.moe import select
    from moegraph.ops import forget_choices

    model = build_model("tiny")
    monkeypatch.setattr(select, "triton_available", lambda tensor: False)
    forget_choices()
    try:
        with pytest.raises(moegraph.BackendUnavailableError, match="'triton' was requested"):
            moegraph.patch(model, moe_backend="triton")
    finally:
        forget_choices()
    assert not moegraph.is_patched(model)


def test_select_moe_backend_on_cpu_and_env_override(monkeypatch):
    from moegraph.moe.select import describe_moe_backend

    choice = describe_moe_backend("cpu", torch.float32)
    assert choice.name == "grouped_mm" and not choice.capture_safe and "cpu" in choice.reason
    assert moegraph.select_moe_backend("cpu", torch.float32) == "grouped_mm"
    monkeypatch.setenv("MOEGRAPH_MOE_BACKEND", "torch")
    assert moegraph.select_moe_backend("cpu", torch.float32) == "torch"
    assert "MOEGRAPH_MOE_BACKEND" in describe_moe_backend("cpu", torch.float32).reason
    monkeypatch.setenv("MOEGRAPH_MOE_BACKEND", "nope")
    with pytest.raises(moegraph.InvalidArgumentError, match="MOEGRAPH_MOE_BACKEND"):
        moegraph.select_moe_backend("cpu")


def test_patch_has_no_effect_at_import():
    import importlib

    importlib.reload(moegraph)
    assert not moegraph.is_patched()
    assert "forward" in vars(qwen3.Qwen3MoeSparseMoeBlock)
    assert not hasattr(vars(qwen3.Qwen3MoeSparseMoeBlock)["forward"], "__wrapped__")


def test_testing_builders_are_deterministic_and_route_randomly():
    a, b = build_model("tiny", seed=7), build_model("tiny", seed=7)
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(pa, pb), name
    assert a.model.layers[0].mlp.gate.weight.abs().sum() > 0  # random router, not zeros
    config = make_config("qwen3-30b-a3b", num_layers=2)
    assert (config.num_hidden_layers, config.hidden_size, config.num_experts, config.num_experts_per_tok) == (2, 2048, 128, 8)
    assert (config.moe_intermediate_size, config.head_dim, config.vocab_size) == (768, 128, 151936)
    with pytest.raises(moegraph.InvalidArgumentError, match="unknown model config"):
        make_config("gpt5")


def test_works_without_triton_installed():
    """Where Triton is missing (macOS, CPU-only wheels) moegraph imports and decodes with its torch references."""
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['triton'] = None; sys.modules['triton.language'] = None\n"
        "import torch, moegraph\n"
        "from moegraph.kernels import triton_available\n"
        "from moegraph.testing import build_model, random_prompts\n"
        "assert not triton_available(torch.empty(0))\n"
        "m = build_model('tiny'); p = random_prompts(2, vocab_size=512)\n"
        "want = m.generate(**p, max_new_tokens=5, do_sample=False)\n"
        "moegraph.patch(m); got = m.generate(**p, max_new_tokens=5, do_sample=False)\n"
        "assert moegraph.decode_stats(m).fallback_reason is None and torch.equal(got, want)\n"
    )
    env = {k: v for k, v in __import__("os").environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]


# ----- transformers' ExpertsInterface ------------------------------------------------------------------------------
def test_experts_names_join_transformers_registry_without_replacing_its_own():
    builtin = dict(ALL_EXPERTS_FUNCTIONS._global_mapping)
    model = build_model("tiny")
    moegraph.patch(model)
    names = ["moegraph", "moegraph_grouped_mm", "moegraph_triton", "moegraph_torch"]
    assert all(name in ALL_EXPERTS_FUNCTIONS for name in names)
    assert all(ALL_EXPERTS_FUNCTIONS._global_mapping[name] is fn for name, fn in builtin.items())
    assert model.get_correct_experts_implementation("moegraph_torch") == "moegraph_torch"  # valid to transformers
    moegraph.unpatch(model)
    moegraph.patch(model, moe_backend="torch")
    assert model.config._experts_implementation == "moegraph_torch"


def test_set_experts_implementation_after_patch_is_honoured(moegraph_logs):
    """transformers' test_eager_matches_batched_and_grouped_inference, on a patched model: each implementation's
    mock is called when set, and only then; generate() with a name not moegraph's falls back, saying so once."""
    model = build_model("tiny", num_layers=2)
    inputs = random_prompts(2, vocab_size=model.config.vocab_size)
    want_tokens = model.generate(**inputs, max_new_tokens=4, do_sample=False)
    moegraph.patch(model)
    outputs = {}
    with _spy("batched_mm") as batched, _spy("grouped_mm") as grouped, _spy("moegraph") as ours:
        spies = {"batched_mm": batched, "grouped_mm": grouped, "moegraph": ours}
        for name in ("eager", "batched_mm", "grouped_mm", "moegraph"):
            model.set_experts_implementation(name)
            assert model.config._experts_implementation == name
            outputs[name] = _logits(model, inputs)
            assert {n for n, spy in spies.items() if spy.called} == ({name} if name in spies else set())
            for spy in spies.values():
                spy.reset_mock()
    for name in ("batched_mm", "grouped_mm", "moegraph"):
        torch.testing.assert_close(outputs[name], outputs["eager"], rtol=1e-4, atol=1e-4)

    model.set_experts_implementation("eager")
    for _ in range(2):
        assert torch.equal(model.generate(**inputs, max_new_tokens=4, do_sample=False), want_tokens)
        assert "experts_implementation='eager'" in moegraph.decode_stats(model).fallback_reason
    warned = [r for r in moegraph_logs.records if "experts_implementation='eager'" in r.getMessage()]
    assert len(warned) == 1 and warned[0].levelname == "WARNING"
    model.set_experts_implementation("moegraph")
    assert torch.equal(model.generate(**inputs, max_new_tokens=4, do_sample=False), want_tokens)
    assert moegraph.decode_stats(model).fallback_reason is None


def test_moegraph_names_choose_the_decode_backend_too():
    model = build_model("tiny", num_layers=1)
    inputs = random_prompts(2, vocab_size=model.config.vocab_size)
    want = model.generate(**inputs, max_new_tokens=4, do_sample=False)
    moegraph.patch(model)
    decoder = moegraph.patches.api._decoder_for(model)
    for name, backend in (("moegraph", "grouped_mm"), ("moegraph_torch", "torch"), ("moegraph", "grouped_mm")):
        model.set_experts_implementation(name)
        assert torch.equal(model.generate(**inputs, max_new_tokens=4, do_sample=False), want)
        assert decoder.ops.moe_backend == backend and moegraph.decode_stats(model).fallback_reason is None


def test_nf4_experts_run_moegraphs_nf4_path_when_patched():
    from moegraph.quant.experts import NF4Experts

    model = build_model("tiny", quant="nf4", num_layers=1)
    experts = [block.experts for block in _blocks(model)]
    inputs = random_prompts(2, vocab_size=model.config.vocab_size)

    def model_calls(ref):  # the backend probe runs forward_ref on experts of its own
        return sum(any(call.args[0] is e for e in experts) for call in ref.call_args_list)

    with mock.patch.object(NF4Experts, "forward_ref", autospec=True, side_effect=NF4Experts.forward_ref) as ref:
        want = _logits(model, inputs)  # unpatched: NF4Experts' own plain-torch forward
        assert model_calls(ref) == 1
        ref.reset_mock()
        moegraph.patch(model)
        with _spy("moegraph") as ours:
            got = _logits(model, inputs)
        assert model_calls(ref) == 0 and ours.call_count == 1
    assert moegraph.ops.ops_for_experts(experts[0]).experts.__name__ == "moe_experts_nf4_grouped_mm"
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)

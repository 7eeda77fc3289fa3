"""torch.compile over a patched model: dynamo traces transformers' MoE blocks into moegraph's experts (registered in
transformers' ExpertsInterface), whose GEMMs and NF4 dequantization are the custom ops moegraph::grouped_mm and
moegraph::nf4_dense. Each test proves moegraph's experts are in the compiled graph by finding those ops in it.
CPU, fp32, mostly backend "eager" / "aot_eager" (inductor once, on one experts module)."""

import pytest
import torch
from transformers import CompileConfig, StaticCache, StoppingCriteria, StoppingCriteriaList

import moegraph
from moegraph.cuda_graph.hf_cache import forward_cache_argument
from moegraph.testing import build_model, random_prompts

MOEGRAPH_OPS = ("moegraph.grouped_mm", "moegraph.nf4_dense")


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()  # every test compiles transformers' forward anew (no recompile limit carried over)
    yield
    torch._dynamo.reset()


class Recorder:
    """A torch.compile backend that counts moegraph's ops in each graph it is given, then runs `inner`."""

    def __init__(self, inner: str = "eager"):
        self.inner = inner
        self.graphs: list[dict[str, int]] = []

    def __deepcopy__(self, memo):  # transformers' CompileConfig.to_dict() deep-copies the backend it is given
        return self

    def __call__(self, gm, example_inputs):
        targets = [str(node.target) for node in gm.graph.nodes if node.op == "call_function"]
        self.graphs.append({op: sum(t.startswith(op) for t in targets) for op in MOEGRAPH_OPS}
                           | {"transformers": sum("transformers" in t for t in targets)})
        if self.inner == "eager":
            return gm.forward
        return torch._dynamo.lookup_backend(self.inner)(gm, example_inputs)


def _decode_twice(model, forward, inputs):
    """Prefill-shaped then decode-shaped logits through `forward`, with a StaticCache (transformers' compile path)."""
    ids, mask = inputs["input_ids"], inputs["attention_mask"]
    cache = {forward_cache_argument(model): StaticCache(config=model.config, max_cache_len=32)}
    with torch.no_grad():
        prefill = forward(input_ids=ids, attention_mask=mask, use_cache=True, **cache).logits
        token = prefill[:, -1].argmax(-1, keepdim=True)  # [b, 1]
        decode = forward(input_ids=token, attention_mask=torch.cat([mask, torch.ones_like(token)], 1),
                         position_ids=mask.sum(1, keepdim=True), use_cache=True, **cache).logits
    return prefill, decode


def test_compiled_forward_fullgraph_runs_moegraphs_experts():
    model = build_model("tiny", num_layers=1)
    inputs = random_prompts(2, vocab_size=model.config.vocab_size, seed=3)
    want = _decode_twice(model, model.forward, inputs)
    moegraph.patch(model)
    recorder = Recorder()
    got = _decode_twice(model, torch.compile(model.forward, fullgraph=True, backend=recorder), inputs)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert len(recorder.graphs) == 2  # one graph each for the prefill and the decode shape: no graph break
    # two grouped GEMMs per MoE layer; transformers' own grouped_mm fallback op never appears
    assert all(g["moegraph.grouped_mm"] == 2 and g["transformers"] == 0 for g in recorder.graphs)


def test_compile_without_fullgraph_under_the_class_patch():
    moegraph.patch()
    model = build_model("tiny", num_layers=1)  # built after the class patch: moegraph's experts by default
    inputs = random_prompts(2, vocab_size=model.config.vocab_size, seed=4)
    recorder = Recorder()
    with torch.no_grad():
        want = model(**inputs).logits
        got = torch.compile(model, backend=recorder)(**inputs).logits  # graph breaks allowed
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert sum(g["moegraph.grouped_mm"] for g in recorder.graphs) == 2


def test_compiled_backward_through_moegraph_grouped_mm():
    model = build_model("tiny", num_layers=1)
    moegraph.patch(model)
    experts = model.model.layers[0].mlp.experts
    gen = torch.Generator().manual_seed(8)
    hidden = torch.randn(9, model.config.hidden_size, generator=gen)
    index, weights = torch.randint(0, 8, (9, 2), generator=gen), torch.rand(9, 2, generator=gen)
    grads = []
    for forward in (experts, torch.compile(experts, fullgraph=True, backend="aot_eager")):
        x = hidden.clone().requires_grad_()
        experts.gate_up_proj.grad = experts.down_proj.grad = None
        forward(x, index, weights).square().sum().backward()
        grads.append((x.grad, experts.gate_up_proj.grad, experts.down_proj.grad))
    for got, want in zip(grads[1], grads[0]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


class _NeverStop(StoppingCriteria):
    """A custom criterion: moegraph's decoder leaves such a call to transformers' own loop."""

    def __call__(self, input_ids, scores, **kwargs):
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def test_generate_static_cache_through_transformers_compile_runs_moegraphs_experts():
    model = build_model("tiny", num_layers=1)
    inputs = random_prompts(2, vocab_size=model.config.vocab_size, seed=5)
    want = model.generate(**inputs, max_new_tokens=4, do_sample=False)
    moegraph.patch(model)
    recorder = Recorder()
    config = CompileConfig(fullgraph=True, backend=recorder, mode=None)
    config._compile_all_devices = True  # transformers compiles its decode step on the CPU only when told to
    got = model.generate(**inputs, max_new_tokens=4, do_sample=False, cache_implementation="static",
                         compile_config=config, stopping_criteria=StoppingCriteriaList([_NeverStop()]))
    assert moegraph.decode_stats(model).fallback_reason == "custom stopping criteria"
    assert torch.equal(got, want)
    assert recorder.graphs and all(g["moegraph.grouped_mm"] == 2 for g in recorder.graphs)


def test_nf4_model_compiles_fullgraph_with_moegraphs_nf4_path():
    model = build_model("tiny", quant="nf4", num_layers=1)
    inputs = random_prompts(2, vocab_size=model.config.vocab_size, seed=6)
    moegraph.patch(model)
    recorder = Recorder()
    with torch.no_grad():
        want = model(**inputs).logits
        got = torch.compile(model.forward, fullgraph=True, backend=recorder)(**inputs).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert recorder.graphs == [{"moegraph.grouped_mm": 2, "moegraph.nf4_dense": 2, "transformers": 0}]


def test_inductor_compiles_moegraphs_experts():
    model = build_model("tiny", num_layers=1)
    moegraph.patch(model)
    experts = model.model.layers[0].mlp.experts
    gen = torch.Generator().manual_seed(7)
    hidden, index = torch.randn(6, model.config.hidden_size, generator=gen), torch.randint(0, 8, (6, 2), generator=gen)
    weights = torch.rand(6, 2, generator=gen)
    with torch.no_grad():
        want = experts(hidden, index, weights)
        got = torch.compile(experts, fullgraph=True)(hidden, index, weights)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)

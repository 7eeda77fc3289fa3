"""`python -m moegraph bench`: decode speed against transformers, as tok/s and as a fraction of the
memory-bandwidth roofline, on random-weight full-size presets of moegraph.testing (`--model`, default
Qwen3-30B-A3B; no downloads).

Workload: fixed-seed token-id prompts of 16-128 tokens, `--new-tokens` greedy tokens with
min_new_tokens = max_new_tokens, warm-up, then the median of `--runs` timed runs. Prefill is timed
separately (a 1-token generate for transformers' backends; the decoder's own split for moegraph).
Roofline: bytes one decode step must read (distinct experts hit per layer, counted from the
router, x bytes per expert as stored + every other decoder-layer weight + lm_head + the KV cache
read; `step_bytes`) over the device copy bandwidth measured in the same run. A case that fails or does not fit the time
budget is reported as such.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import statistics
import time
from dataclasses import asdict, dataclass, field

import torch

import moegraph
from moegraph.testing import build_model, random_prompts

BACKENDS = ("hf", "hf_batched_mm", "hf_static_compile", "moegraph_eager", "moegraph")
PRIORITY = ("moegraph", "hf", "moegraph_eager", "hf_batched_mm", "hf_static_compile")
# --quant nf4 adds, on the same model quantized in place after the bf16 cases:
# hf_4bit: transformers as load_in_4bit leaves it (Linear4bit projections, experts still bf16);
# moegraph_nf4: moegraph with NF4 experts and Linear4bit projections.
QUANT_BACKENDS = ("hf_4bit", "moegraph_nf4")


@dataclass
class Case:
    backend: str
    batch_size: int
    status: str = "ok"  # ok | failed: ... | over budget: ...
    runs: int = 0
    total_s: float = math.nan
    prefill_ms: float = math.nan
    decode_ms_per_step: float = math.nan
    tok_s: float = math.nan
    decode_tok_s: float = math.nan
    roofline_tok_s: float = math.nan
    peak_gb: float = math.nan
    capture_s: float = math.nan
    first_call_s: float = math.nan
    notes: list = field(default_factory=list)


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def measure_copy_bandwidth(device) -> float:
    """Bytes read + written per second by a large device-to-device copy (median of 20; on the CPU, of 5 of 64 MB)."""
    if torch.device(device).type == "cpu":
        src = torch.ones(1 << 26, dtype=torch.uint8)
        dst = torch.zeros_like(src)
        times = []
        for _ in range(5):
            start = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - start)
        return 2 * src.numel() / statistics.median(times)
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(20):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    return 2 * (1 << 30) / statistics.median(times)


def count_distinct_experts(model, prompts, steps: int = 4) -> float:
    """Mean distinct experts per MoE layer per decode step, read from the routers during generate()."""
    counts = []

    def hook(module, args, output):
        index = output[2]
        if index.shape[0] == prompts["input_ids"].shape[0]:  # decode steps: one token per row
            counts.append(index.unique().numel())

    routers = [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]
    handles = [r.register_forward_hook(hook) for r in routers]
    try:
        model.generate(**prompts, max_new_tokens=steps, min_new_tokens=steps, do_sample=False)
    finally:
        for h in handles:
            h.remove()
    return sum(counts) / max(len(counts), 1)


def _tensor_bytes(module: torch.nn.Module) -> int:
    """Bytes of a module's parameters and buffers, with the quantization state of bitsandbytes 4-bit weights
    (its absmax and nested statistics live on `weight.quant_state`, not in the module)."""
    total = 0
    for t in list(module.parameters()) + list(module.buffers()):
        total += t.numel() * t.element_size()
        state = getattr(t, "quant_state", None)
        for stat in (state, getattr(state, "state2", None)) if state is not None else ():
            for name in ("absmax", "code", "offset"):
                value = getattr(stat, name, None) if stat is not None else None
                if isinstance(value, torch.Tensor):
                    total += value.numel() * value.element_size()
    return total


def _experts_module(layer: torch.nn.Module):
    experts = getattr(getattr(layer, "mlp", None), "experts", None)
    return experts if experts is not None and hasattr(experts, "num_experts") else None


def step_bytes(model, batch_size: int, distinct_experts: float, context: float) -> dict:
    """Bytes one decode step of `model` reads at the least, by part, counted from the model's own tensors as they
    are stored (bf16, or NF4 codes plus their absmax): `distinct_experts` experts per MoE layer, every other
    weight of the decoder layers once, the lm_head, the embedding rows of the batch, and the KV cache of
    `context` positions per row."""
    config = model.config
    inner = model.model
    parts = dict.fromkeys(("experts", "attention", "other_layer_weights", "lm_head", "embeddings", "kv_cache"), 0.0)
    for layer in inner.layers:
        experts = _experts_module(layer)
        expert_bytes = _tensor_bytes(experts) if experts is not None else 0
        if experts is not None:
            # tensors with an expert axis are read for the distinct experts only; tables (NF4's nested code) once
            stacked = sum(t.numel() * t.element_size() for t in list(experts.parameters()) + list(experts.buffers())
                          if t.dim() >= 1 and t.shape[0] == experts.num_experts)
            parts["experts"] += distinct_experts * stacked / experts.num_experts + expert_bytes - stacked
        attention = _tensor_bytes(layer.self_attn)
        parts["attention"] += attention
        parts["other_layer_weights"] += _tensor_bytes(layer) - attention - expert_bytes  # norms, router, dense MLPs
    parts["other_layer_weights"] += _tensor_bytes(inner.norm)
    parts["lm_head"] = _tensor_bytes(model.lm_head)
    embed = inner.embed_tokens.weight
    parts["embeddings"] = batch_size * embed.shape[1] * embed.element_size()
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_dtype_bytes = embed.element_size()
    parts["kv_cache"] = (len(inner.layers) * batch_size * context * 2 * config.num_key_value_heads * head_dim
                         * kv_dtype_bytes)
    parts["total"] = sum(parts.values())
    return parts


def timed_call(fn):
    """(fn(), seconds), with the GPU (if any) synchronized before and after."""
    _sync()
    start = time.perf_counter()
    out = fn()
    _sync()
    return out, time.perf_counter() - start


class Runner:
    """Runs one backend at one batch size within a time budget."""

    def __init__(self, model, args, deadline: float):
        self.model, self.args, self.deadline = model, args, deadline

    def generate_kwargs(self, backend, new_tokens):
        kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
        if backend == "hf_static_compile":
            kw["cache_implementation"] = "static"
        return kw

    def setup(self, backend, batch_size):
        model = self.model
        if backend != "moegraph_nf4":
            model.set_experts_implementation("batched_mm" if backend == "hf_batched_mm" else "grouped_mm")
        if backend.startswith("moegraph"):
            moegraph.patch(model, cuda_graphs=backend != "moegraph_eager", max_batch_size=max(batch_size, 1))

    def teardown(self):
        moegraph.unpatch(self.model)
        torch.cuda.empty_cache()

    def run(self, backend, batch_size, prompts) -> Case:
        case = Case(backend, batch_size)
        remaining = self.deadline - time.perf_counter()
        if remaining < 30 or (backend == "hf_static_compile" and remaining < 240):
            case.status = f"over budget: {remaining:.0f} s of the run's budget left"
            return case
        self.setup(backend, batch_size)
        try:
            self._measure(case, backend, batch_size, prompts)
        except Exception as exc:  # a failing backend is reported, not dropped
            case.status = f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
        finally:
            self.teardown()
        return case

    def _measure(self, case, backend, batch_size, prompts):
        n = self.args.new_tokens
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        # a 2-token first call (graph capture, compilation), then a short warm-up that gives the
        # per-token estimate used to fit the budget
        _, case.first_call_s = timed_call(lambda: self.model.generate(**prompts, **self.generate_kwargs(backend, 2)))
        warm_tokens = 4
        _, warm_s = timed_call(lambda: self.model.generate(**prompts, **self.generate_kwargs(backend, warm_tokens)))
        estimate = warm_s * n / warm_tokens
        budget = min(self.args.budget_s, self.deadline - time.perf_counter())
        runs = min(self.args.runs, int(budget // max(estimate, 1e-3)))
        if runs < 1:
            case.status = f"over budget: one run ~{estimate:.0f} s, {budget:.0f} s allowed"
            return
        if runs < self.args.runs:
            case.notes.append(f"timed runs trimmed {self.args.runs}->{runs} to fit {budget:.0f} s")
        totals, prefills, decodes = [], [], []
        for _ in range(runs):
            _, total = timed_call(lambda: self.model.generate(**prompts, **self.generate_kwargs(backend, n)))
            totals.append(total)
            if backend.startswith("moegraph"):
                stats = moegraph.decode_stats(self.model)
                prefills.append(stats.prefill_seconds)
                decodes.append(stats.decode_seconds / max(stats.steps - 1, 1))
                case.capture_s = stats.capture_seconds
        if not backend.startswith("moegraph"):
            _, prefill = timed_call(lambda: self.model.generate(**prompts, **self.generate_kwargs(backend, 1)))
            prefills = [prefill]
            decodes = [(t - prefill) / (n - 1) for t in totals]
        case.runs = runs
        case.total_s = statistics.median(totals)
        case.prefill_ms = 1e3 * statistics.median(prefills)
        case.decode_ms_per_step = 1e3 * statistics.median(decodes)
        case.tok_s = batch_size * n / case.total_s
        case.decode_tok_s = batch_size / (case.decode_ms_per_step / 1e3)
        if torch.cuda.is_available():
            case.peak_gb = torch.cuda.max_memory_allocated() / 1e9


def profile_one_step(model, batch_size: int) -> str:
    """Kernels per decoder layer in one eager decode step of moegraph, the top kernels by time, and the replay."""
    moegraph.patch(model, max_batch_size=max(batch_size, 1))
    try:
        return moegraph.profile_step(model, batch_size).format()
    finally:
        moegraph.unpatch(model)


def _plot(results, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for backend in BACKENDS + QUANT_BACKENDS + ("roofline",):
        key = "roofline_tok_s" if backend == "roofline" else "tok_s"
        points = sorted((c["batch_size"], c[key]) for c in results["cases"]
                        if (backend == "roofline" and c["backend"] == "moegraph") or c["backend"] == backend)
        points = [(b, v) for b, v in points if not math.isnan(v)]
        if points:
            ax.plot(*zip(*points), marker="o", linestyle="--" if backend == "roofline" else "-", label=backend)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch size")
    ax.set_ylabel("tok/s (batch x new tokens / total time)")
    ax.set_title(f"{results['model']} ({results['num_layers']} layers, {results.get('dtype', 'bfloat16')}) on "
                 f"{results['gpu']}")
    ax.legend()
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


def run_cases(model, batch_sizes, backends=("hf", "moegraph"), *, new_tokens: int = 64, runs: int = 3,
              budget_s: float = 45.0, total_budget_s: float = 540.0, min_len: int = 16, max_len: int = 128,
              progress=None) -> dict:
    """The bench's cases on a model already built, on its device (CUDA or the CPU), for notebooks and scripts.

    Returns {"device", "copy_bandwidth_tb_s", "roofline": {batch: {...}}, "cases": [Case as dict]}, the fields of
    `python -m moegraph bench`'s JSON. `progress` (e.g. tqdm.auto.tqdm) wraps the loop over cases.
    """
    from types import SimpleNamespace

    unknown = set(backends) - set(BACKENDS)
    if unknown:
        raise moegraph.InvalidArgumentError(f"unknown backends {sorted(unknown)}; choose from {BACKENDS}")
    device = next(model.parameters()).device
    bandwidth = measure_copy_bandwidth(device)
    results = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
               "copy_bandwidth_tb_s": bandwidth / 1e12, "new_tokens": new_tokens, "roofline": {}, "cases": []}
    args = SimpleNamespace(new_tokens=new_tokens, runs=runs, budget_s=budget_s)
    runner = Runner(model, args, time.perf_counter() + total_budget_s)
    prompts = {}
    for batch_size in batch_sizes:
        prompts[batch_size] = random_prompts(batch_size, vocab_size=model.config.vocab_size, min_len=min_len,
                                             max_len=max_len, seed=batch_size, device=device)
        distinct = count_distinct_experts(model, prompts[batch_size])
        context = float(prompts[batch_size]["attention_mask"].sum(1).float().mean()) + new_tokens / 2
        parts = step_bytes(model, batch_size, distinct, context)
        results["roofline"][batch_size] = {"distinct_experts_per_layer": distinct, "step_bytes": parts,
                                           "roofline_tok_s": batch_size / (parts["total"] / bandwidth)}
    todo = [(b, n) for b in sorted(backends, key=PRIORITY.index) for n in batch_sizes]
    for backend, batch_size in (progress(todo, desc="bench cases") if progress else todo):
        case = runner.run(backend, batch_size, prompts[batch_size])
        case.roofline_tok_s = results["roofline"][batch_size]["roofline_tok_s"]
        results["cases"].append(asdict(case))
    return results


def run_bench(args) -> int:
    if not torch.cuda.is_available():
        print("bench needs a CUDA GPU (it measures decode speed against the GPU's memory bandwidth)")
        return 2
    unknown = set(args.backends.split(",")) - set(BACKENDS)
    if unknown:
        print(f"unknown backends {sorted(unknown)}; choose from {BACKENDS}")
        return 2
    from moegraph.testing.models import CONFIGS

    if args.model not in CONFIGS:
        print(f"unknown --model {args.model!r}; choose one of {sorted(CONFIGS)}")
        return 2
    if args.double_quant and args.quant != "nf4":
        print("--double-quant needs --quant nf4")
        return 2
    started = time.perf_counter()
    deadline = started + args.total_budget_s
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    backends = [b for b in BACKENDS if b in args.backends.split(",")]
    dtype = getattr(torch, args.dtype)
    model = build_model(args.model, num_layers=args.num_layers, device="cuda", dtype=dtype, seed=0)
    num_layers = model.config.num_hidden_layers
    bandwidth = measure_copy_bandwidth("cuda")
    results = {
        "date": datetime.date.today().isoformat(), "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__, "transformers": __import__("transformers").__version__,
        "moegraph": moegraph.__version__, "model": f"{args.model} (random weights)", "num_layers": num_layers,
        "dtype": args.dtype, "new_tokens": args.new_tokens, "copy_bandwidth_tb_s": bandwidth / 1e12, "cases": [],
        "roofline": {},
    }
    from moegraph.moe.select import describe_moe_backend

    choice = describe_moe_backend("cuda", dtype)
    results["moe_backend"] = f"{choice.name}: {choice.reason}"
    print(f"bench: {results['gpu']}, torch {results['torch']}, transformers {results['transformers']}, "
          f"{args.model} {num_layers} layers {args.dtype}, copy bandwidth {bandwidth / 1e12:.2f} TB/s, moegraph MoE "
          f"backend {results['moe_backend']}", flush=True)
    runner = Runner(model, args, deadline)
    prompts = {}
    for batch_size in batch_sizes:
        prompts[batch_size] = random_prompts(batch_size, vocab_size=model.config.vocab_size, min_len=16,
                                             max_len=128, seed=batch_size, device="cuda")
        distinct = count_distinct_experts(model, prompts[batch_size])
        context = float(prompts[batch_size]["attention_mask"].sum(1).float().mean()) + args.new_tokens / 2
        results["roofline"][batch_size] = {"distinct_experts_per_layer": distinct, "context": context}
        _add_roofline(results, "", model, batch_size, bandwidth)
    cases = []
    # the most telling comparisons first, so that a tight budget trims the others
    for backend in sorted(backends, key=PRIORITY.index):
        for batch_size in batch_sizes:
            cases.append(_run_case(runner, backend, batch_size, prompts, results))
    if args.quant == "nf4":
        cases += _run_nf4_cases(runner, model, batch_sizes, prompts, results, args, bandwidth)
        del runner, model
        results["loading"] = measure_nf4_loading(args.model, num_layers, dtype, args.double_quant)
        print(f"NF4 random-weight build, one layer at a time: {results['loading']}", flush=True)
        model = None
    cases.sort(key=lambda c: (c.batch_size, (BACKENDS + QUANT_BACKENDS).index(c.backend)))
    results["cases"] = [asdict(c) for c in cases]
    profile = profile_one_step(model, 1) if args.profile and model is not None else None
    results["profile"] = profile
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"bench_{args.model}_{num_layers}l_{args.dtype}"
                        + (f"_nf4{'_dq' if args.double_quant else ''}" if args.quant == "nf4" else ""))
    with open(stem + ".json", "w") as f:
        json.dump(results, f, indent=2, default=str)
    plot = _plot(results, stem + ".png")
    if profile:
        print(profile)
    print(_table(cases, results, time.perf_counter() - started))
    print(f"wrote {stem}.json" + (f" and {plot}" if plot else ""))
    return 0


def _add_roofline(results, prefix: str, model, batch_size: int, bandwidth: float):
    """Store (and print) the step bytes and roofline of `model` as it is now, under `prefix` ("" for the model as
    built, "hf_4bit_" with Linear4bit projections, "nf4_" with NF4 experts too)."""
    entry = results["roofline"][batch_size]
    parts = step_bytes(model, batch_size, entry["distinct_experts_per_layer"], entry["context"])
    entry[prefix + "step_bytes"] = parts
    entry[prefix + "roofline_tok_s"] = batch_size / (parts["total"] / bandwidth)
    print(f"batch {batch_size}{' ' + prefix.rstrip('_') if prefix else ''}: "
          f"{entry['distinct_experts_per_layer']:.1f} distinct experts/layer, {parts['total'] / 1e9:.2f} GB/step, "
          f"roofline {entry[prefix + 'roofline_tok_s']:.0f} tok/s", flush=True)


def _run_case(runner, backend, batch_size, prompts, results) -> Case:
    case = runner.run(backend, batch_size, prompts[batch_size])
    prefix = {"hf_4bit": "hf_4bit_", "moegraph_nf4": "nf4_"}.get(backend, "")
    case.roofline_tok_s = results["roofline"][batch_size][prefix + "roofline_tok_s"]
    print(f"  {backend:<18} bs {batch_size:>3} {case.status:<10} {case.tok_s:9.1f} tok/s "
          f"{case.decode_ms_per_step:8.2f} ms/step" + (f"  ({'; '.join(case.notes)})" if case.notes else ""),
          flush=True)
    return case


def _run_nf4_cases(runner, model, batch_sizes, prompts, results, args, bandwidth) -> list:
    """Quantize the model in place, as load_in_4bit would (projections), then as moegraph does (experts)."""
    from moegraph.quant.experts import quantize_experts
    from moegraph.quant.projections import quantize_projections

    cases = []
    quantize_projections(model, double_quant=args.double_quant)
    for batch_size in batch_sizes:
        _add_roofline(results, "hf_4bit_", model, batch_size, bandwidth)
    if "hf" in args.backends.split(","):
        for batch_size in batch_sizes:
            case = runner.run("hf", batch_size, prompts[batch_size])
            case.backend = "hf_4bit"
            case.roofline_tok_s = results["roofline"][batch_size]["hf_4bit_roofline_tok_s"]
            cases.append(case)
            print(f"  hf_4bit            bs {batch_size:>3} {case.status:<10} {case.tok_s:9.1f} tok/s "
                  f"{case.decode_ms_per_step:8.2f} ms/step", flush=True)
    quantize_experts(model, double_quant=args.double_quant)
    torch.cuda.empty_cache()
    results["nf4_memory_gb"] = torch.cuda.memory_allocated() / 1e9
    print(f"NF4 model in memory (with what earlier cases left allocated): {results['nf4_memory_gb']:.2f} GB",
          flush=True)
    for batch_size in batch_sizes:
        _add_roofline(results, "nf4_", model, batch_size, bandwidth)
    for batch_size in batch_sizes:
        cases.append(_run_case(runner, "moegraph_nf4", batch_size, prompts, results))
    return cases


def measure_nf4_loading(name: str, num_layers: int, dtype: torch.dtype, double_quant: bool) -> dict:
    """GPU memory while building the NF4 model one layer at a time (the quantize-as-it-arrives path) and after."""
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    model = build_model(name, num_layers=num_layers, device="cuda", dtype=dtype, seed=0, quant="nf4",
                        double_quant=double_quant)
    after = torch.cuda.memory_allocated() - base
    peak = torch.cuda.max_memory_allocated() - base
    del model
    torch.cuda.empty_cache()
    return {"after_gb": after / 1e9, "peak_gb": peak / 1e9, "double_quant": double_quant}


def _table(cases, results, elapsed) -> str:
    """One row per case; "vs hf" and "roofline" compare decode tok/s (the roofline is that of a decode step)."""
    hf = {c.batch_size: c.decode_tok_s for c in cases if c.backend == "hf" and c.status == "ok"}
    head = (f"\n{results['gpu']} | torch {results['torch']} | transformers {results['transformers']} | "
            f"{results['date']} | {results['model']} {results['num_layers']} layers {results['dtype']} | "
            f"{results['new_tokens']} new tokens | copy {results['copy_bandwidth_tb_s']:.2f} TB/s | moegraph MoE "
            f"{results['moe_backend'].split(':')[0]} | {elapsed:.0f} s\n")
    rows = [f"{'backend':<18} {'bs':>3} {'tok/s':>8} {'decode tok/s':>12} {'ms/step':>8} {'prefill ms':>10} "
            f"{'vs hf':>6} {'roofline':>8} {'peak GB':>7} {'capture s':>9} {'1st call s':>10}  status"]
    for c in cases:
        speedup = c.decode_tok_s / hf[c.batch_size] if c.batch_size in hf else math.nan
        rows.append(f"{c.backend:<18} {c.batch_size:>3} {c.tok_s:8.1f} {c.decode_tok_s:12.1f} "
                    f"{c.decode_ms_per_step:8.2f} {c.prefill_ms:10.1f} {speedup:6.2f} "
                    f"{c.decode_tok_s / c.roofline_tok_s:8.1%} {c.peak_gb:7.1f} {c.capture_s:9.2f} "
                    f"{c.first_call_s:10.1f}  {c.status}{' (' + '; '.join(c.notes) + ')' if c.notes else ''}")
    return head + "\n".join(rows)

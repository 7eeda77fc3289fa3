"""`python -m moegraph bench`: decode speed against transformers, as tok/s and as a fraction of the
memory-bandwidth roofline, on random-weight Qwen3-30B-A3B shapes (no downloads).

Workload: fixed-seed token-id prompts of 16-128 tokens, `--new-tokens` greedy tokens with
min_new_tokens = max_new_tokens, warm-up, then the median of `--runs` timed runs. Prefill is timed
separately (a 1-token generate for transformers' backends; the decoder's own split for moegraph).
Roofline: bytes one decode step must read (distinct experts hit per layer, counted from the
router, x bytes per expert + attention + router + lm_head + norms + the KV cache read) over the
device copy bandwidth measured in the same run. A case that fails or does not fit the time
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
NF4_BYTES_PER_WEIGHT = 0.5 + 4 / 64  # 4-bit code + one fp32 absmax per 64 weights


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


def step_bytes(config, batch_size: int, distinct_experts: float, context: float, dtype_bytes: int = 2,
               weight_bytes: float | None = None) -> dict:
    """Bytes one decode step reads at the least, by part. weight_bytes: bytes per expert and projection
    weight (default dtype_bytes; NF4_BYTES_PER_WEIGHT for 4-bit); router, norms, lm_head, KV stay dtype_bytes."""
    h, d = config.hidden_size, config.head_dim
    q, kv = config.num_attention_heads * d, config.num_key_value_heads * d
    layers = config.num_hidden_layers
    weight_bytes = dtype_bytes if weight_bytes is None else weight_bytes
    parts = {
        "experts": layers * distinct_experts * 3 * h * config.moe_intermediate_size * weight_bytes,
        "attention": layers * (h * q + 2 * h * kv + q * h) * weight_bytes,
        "router": layers * config.num_experts * h * dtype_bytes,
        "norms": layers * (2 * h + 2 * d) * dtype_bytes + h * dtype_bytes,
        "lm_head": config.vocab_size * h * dtype_bytes,
        "kv_cache": layers * batch_size * context * 2 * kv * dtype_bytes,
    }
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
    ax.set_title(f"{results['model']} ({results['num_layers']} layers, bf16) on {results['gpu']}")
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
    dtype_bytes = next(model.parameters()).element_size()
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
        parts = step_bytes(model.config, batch_size, distinct, context, dtype_bytes=dtype_bytes)
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
    started = time.perf_counter()
    deadline = started + args.total_budget_s
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    backends = [b for b in BACKENDS if b in args.backends.split(",")]
    model = build_model("qwen3-30b-a3b", num_layers=args.num_layers, device="cuda", dtype=torch.bfloat16, seed=0)
    bandwidth = measure_copy_bandwidth("cuda")
    results = {
        "date": datetime.date.today().isoformat(), "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__, "transformers": __import__("transformers").__version__,
        "moegraph": moegraph.__version__, "model": "qwen3-30b-a3b (random weights)", "num_layers": args.num_layers,
        "new_tokens": args.new_tokens, "copy_bandwidth_tb_s": bandwidth / 1e12, "cases": [], "roofline": {},
    }
    from moegraph.moe.select import describe_moe_backend

    choice = describe_moe_backend("cuda", torch.bfloat16)
    results["moe_backend"] = f"{choice.name}: {choice.reason}"
    print(f"bench: {results['gpu']}, torch {results['torch']}, transformers {results['transformers']}, "
          f"{args.num_layers} layers, copy bandwidth {bandwidth / 1e12:.2f} TB/s, moegraph MoE backend "
          f"{results['moe_backend']}", flush=True)
    runner = Runner(model, args, deadline)
    prompts = {}
    for batch_size in batch_sizes:
        prompts[batch_size] = random_prompts(batch_size, vocab_size=model.config.vocab_size, min_len=16,
                                             max_len=128, seed=batch_size, device="cuda")
        distinct = count_distinct_experts(model, prompts[batch_size])
        context = float(prompts[batch_size]["attention_mask"].sum(1).float().mean()) + args.new_tokens / 2
        parts = step_bytes(model.config, batch_size, distinct, context)
        roofline = batch_size / (parts["total"] / bandwidth)
        results["roofline"][batch_size] = {"distinct_experts_per_layer": distinct, "step_bytes": parts,
                                           "roofline_tok_s": roofline}
        line = (f"batch {batch_size}: {distinct:.1f} distinct experts/layer, {parts['total'] / 1e9:.2f} GB/step, "
                f"roofline {roofline:.0f} tok/s")
        if args.quant == "nf4":
            parts4 = step_bytes(model.config, batch_size, distinct, context, weight_bytes=NF4_BYTES_PER_WEIGHT)
            results["roofline"][batch_size]["nf4_step_bytes"] = parts4
            results["roofline"][batch_size]["nf4_roofline_tok_s"] = batch_size / (parts4["total"] / bandwidth)
            line += (f"; NF4 {parts4['total'] / 1e9:.2f} GB/step, roofline "
                     f"{results['roofline'][batch_size]['nf4_roofline_tok_s']:.0f} tok/s")
        print(line, flush=True)
    cases = []
    # the most telling comparisons first, so that a tight budget trims the others
    for backend in sorted(backends, key=PRIORITY.index):
        for batch_size in batch_sizes:
            cases.append(_run_case(runner, backend, batch_size, prompts, results))
    if args.quant == "nf4":
        cases += _run_nf4_cases(runner, model, batch_sizes, prompts, results, args)
        del runner, model
        results["loading"] = measure_nf4_loading(args.num_layers)
        print(f"NF4 random-weight build, one layer at a time: {results['loading']}", flush=True)
        model = None
    cases.sort(key=lambda c: (c.batch_size, (BACKENDS + QUANT_BACKENDS).index(c.backend)))
    results["cases"] = [asdict(c) for c in cases]
    profile = profile_one_step(model, 1) if args.profile and model is not None else None
    results["profile"] = profile
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"bench_{args.num_layers}l")
    with open(stem + ".json", "w") as f:
        json.dump(results, f, indent=2, default=str)
    plot = _plot(results, stem + ".png")
    if profile:
        print(profile)
    print(_table(cases, results, time.perf_counter() - started))
    print(f"wrote {stem}.json" + (f" and {plot}" if plot else ""))
    return 0


def _run_case(runner, backend, batch_size, prompts, results) -> Case:
    case = runner.run(backend, batch_size, prompts[batch_size])
    key = "nf4_roofline_tok_s" if backend in QUANT_BACKENDS else "roofline_tok_s"
    case.roofline_tok_s = results["roofline"][batch_size][key]
    print(f"  {backend:<18} bs {batch_size:>3} {case.status:<10} {case.tok_s:9.1f} tok/s "
          f"{case.decode_ms_per_step:8.2f} ms/step" + (f"  ({'; '.join(case.notes)})" if case.notes else ""),
          flush=True)
    return case


def _run_nf4_cases(runner, model, batch_sizes, prompts, results, args) -> list:
    """Quantize the bf16 model in place, as load_in_4bit would (projections), then as moegraph does (experts)."""
    from moegraph.quant.experts import quantize_experts
    from moegraph.quant.projections import quantize_projections

    cases = []
    quantize_projections(model)
    if "hf" in args.backends.split(","):
        for batch_size in batch_sizes:
            case = _run_case(runner, "hf", batch_size, prompts, results)
            case.backend = "hf_4bit"
            case.roofline_tok_s = results["roofline"][batch_size]["nf4_roofline_tok_s"]
            cases.append(case)
    quantize_experts(model)
    torch.cuda.empty_cache()
    results["nf4_memory_gb"] = torch.cuda.memory_allocated() / 1e9
    print(f"NF4 model in memory: {results['nf4_memory_gb']:.2f} GB", flush=True)
    for batch_size in batch_sizes:
        cases.append(_run_case(runner, "moegraph_nf4", batch_size, prompts, results))
    return cases


def measure_nf4_loading(num_layers: int) -> dict:
    """GPU memory while building the NF4 model one layer at a time (the quantize-as-it-arrives path) and after."""
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    model = build_model("qwen3-30b-a3b", num_layers=num_layers, device="cuda", dtype=torch.bfloat16, seed=0,
                        quant="nf4")
    after = torch.cuda.memory_allocated() - base
    peak = torch.cuda.max_memory_allocated() - base
    del model
    torch.cuda.empty_cache()
    return {"after_gb": after / 1e9, "peak_gb": peak / 1e9}


def _table(cases, results, elapsed) -> str:
    hf = {c.batch_size: c.tok_s for c in cases if c.backend == "hf" and c.status == "ok"}
    head = (f"\n{results['gpu']} | torch {results['torch']} | transformers {results['transformers']} | "
            f"{results['date']} | {results['num_layers']} layers bf16 | {results['new_tokens']} new tokens | "
            f"copy {results['copy_bandwidth_tb_s']:.2f} TB/s | moegraph MoE {results['moe_backend'].split(':')[0]} | "
            f"{elapsed:.0f} s\n")
    rows = [f"{'backend':<18} {'bs':>3} {'tok/s':>8} {'decode tok/s':>12} {'ms/step':>8} {'prefill ms':>10} "
            f"{'vs hf':>6} {'roofline':>8} {'peak GB':>7} {'capture s':>9} {'1st call s':>10}  status"]
    for c in cases:
        speedup = c.tok_s / hf[c.batch_size] if c.batch_size in hf else math.nan
        rows.append(f"{c.backend:<18} {c.batch_size:>3} {c.tok_s:8.1f} {c.decode_tok_s:12.1f} "
                    f"{c.decode_ms_per_step:8.2f} {c.prefill_ms:10.1f} {speedup:6.2f} "
                    f"{c.tok_s / c.roofline_tok_s:8.1%} {c.peak_gb:7.1f} {c.capture_s:9.2f} {c.first_call_s:10.1f}  "
                    f"{c.status}{' (' + '; '.join(c.notes) + ')' if c.notes else ''}")
    return head + "\n".join(rows)

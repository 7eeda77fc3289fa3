"""`python -m moegraph bench`: decode speed against transformers, as tok/s and as a fraction of the
memory-bandwidth roofline, on random-weight full-size presets of moegraph.testing (`--model`, default
Qwen3-30B-A3B; no downloads).

Workload: fixed-seed token-id prompts of 16-128 tokens, `--new-tokens` greedy tokens with
min_new_tokens = max_new_tokens, warm-up, then the median of `--runs` timed runs. Prefill is timed
separately (a 1-token generate for transformers' backends; the decoder's own split for moegraph).
Roofline: bytes one decode step must read (distinct experts hit per layer, counted from the
router, x bytes per expert as stored + every other decoder-layer weight + lm_head + the KV cache
read; `step_bytes`) over the device copy bandwidth measured in the same run. A case that fails or does not fit the time
budget is reported as such, or run with fewer new tokens (said in its notes) when that fits.

Sections beyond that table (`--prompt-len`, `--long`, `--ttft`, `--profile`): moegraph/bench_modes.py; `--sample`
adds sampled rows (SAMPLING) beside the greedy ones of the decode table. Every run writes one JSON (GPU, versions, date, command, the rows of
each section) and prints each section as a markdown table.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import shlex
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field

import torch
from transformers import LogitsProcessor

import moegraph
from moegraph.testing import build_model, random_prompts

BACKENDS = ("hf", "hf_batched_mm", "hf_static_compile", "moegraph_eager", "moegraph")
# run only when named, moegraph with its prefill forced (the default, "auto", is "graphs" on CUDA):
# moegraph_prefill: patch(prefill="graphs") (the prompts as token rows of a captured decode step, any device);
# moegraph_hf_prefill: patch(prefill="transformers") (transformers' forward runs the prompt)
PREFILL_BACKENDS = {"moegraph_prefill": "graphs", "moegraph_hf_prefill": "transformers"}
OPT_IN_BACKENDS = tuple(PREFILL_BACKENDS)
PRIORITY = ("moegraph", "hf", "moegraph_prefill", "moegraph_hf_prefill", "moegraph_eager", "hf_batched_mm",
            "hf_static_compile")
# --quant nf4 adds, on the same model quantized in place after the bf16 cases:
# hf_4bit: transformers as load_in_4bit leaves it (Linear4bit projections, experts still bf16);
# moegraph_nf4: moegraph with NF4 experts and Linear4bit projections.
QUANT_BACKENDS = ("hf_4bit", "moegraph_nf4")
SAMPLING = dict(do_sample=True, temperature=0.7, top_p=0.9, top_k=50)  # --sample, --long
MIN_TOKENS = 8  # a case its budget would shorten below this many new tokens is reported, not run: too few steps


@dataclass
class Case:
    backend: str
    batch_size: int
    prompt_len: int | None = None  # every row exactly this long; None: 16-128 tokens per row
    new_tokens: int = 0  # of each timed run (fewer than asked when the budget shortened the case: see notes)
    sample: bool = False  # SAMPLING, else greedy
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
    host_ms_per_step: float = math.nan  # moegraph: decode_stats().host_ms_per_step (CPU time issuing a step)
    kv_cache_gb: float = math.nan  # KV cache read by one decode step at the row's context (in the roofline)
    notes: list = field(default_factory=list)


@dataclass
class TtftCase:
    backend: str
    batch_size: int
    prompt_len: int
    status: str = "ok"
    runs: int = 0
    ttft_ms: float = math.nan  # median wall time of generate(max_new_tokens=1), synchronized before and after
    min_ms: float = math.nan
    prefill_ms: float = math.nan  # moegraph: the decoder's own prefill part of it (decode_stats)
    prefill: str = ""  # moegraph: which prefill ran (decode_stats().prefill: "graphs" or "transformers: <why>")
    first_call_s: float = math.nan
    capture_s: float = math.nan
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
    """Mean distinct experts per MoE layer per decode step, read from the experts' `top_k_index` argument during
    an unpatched generate(): every family calls its experts as `experts(hidden, top_k_index, top_k_weights)`,
    whatever its router returns."""
    counts = []

    def hook(module, args, kwargs):
        index = args[1] if len(args) > 1 else kwargs.get("top_k_index")
        if index is not None and index.shape[0] == prompts["input_ids"].shape[0]:  # decode: one token per row
            counts.append(index.unique().numel())

    experts = [m for m in model.modules() if hasattr(m, "num_experts") and type(m).__name__.endswith("Experts")]
    handles = [m.register_forward_pre_hook(hook, with_kwargs=True) for m in experts]
    try:
        model.generate(**prompts, max_new_tokens=steps, min_new_tokens=steps, do_sample=False)
    finally:
        for h in handles:
            h.remove()
    if not counts:  # a roofline without the experts would be silently wrong
        raise RuntimeError(f"bench: no expert routing seen in {type(model).__name__}'s decode steps "
                           f"({len(experts)} experts modules hooked); is the model patched?")
    return sum(counts) / len(counts)


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
    from .models import decoder_stack

    config = model.config.get_text_config()  # a vision-language model's decoder config is nested
    inner = decoder_stack(model)
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


class FirstTokenClock(LogitsProcessor):
    """A logits processor that notes when the prefill's logits are ready (GPU synchronized): the first call of the
    processors in a transformers generate() follows its prefill forward, outside any compiled region. Timing a
    plain transformers call's prefill inside the same call keeps the decode time a measurement, not a difference of
    two calls (which on a noisy machine can come out negative)."""

    def __init__(self):
        self.at: float | None = None

    def __call__(self, input_ids, scores):
        if self.at is None:
            _sync()
            self.at = time.perf_counter()
        return scores


class Runner:
    """Runs one backend at one batch size (and prompt, new tokens, sampling) within a time budget."""

    def __init__(self, model, args, deadline: float):
        self.model, self.args, self.deadline = model, args, deadline

    def generate_kwargs(self, backend, new_tokens, sample: bool = False):
        kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens)
        kw.update(SAMPLING if sample else {"do_sample": False})
        if backend == "hf_static_compile":
            kw["cache_implementation"] = "static"
        return kw

    def setup(self, backend, batch_size):
        model = self.model
        if backend != "moegraph_nf4":
            model.set_experts_implementation("batched_mm" if backend == "hf_batched_mm" else "grouped_mm")
        if backend.startswith("moegraph"):
            moegraph.patch(model, cuda_graphs=backend != "moegraph_eager", max_batch_size=max(batch_size, 1),
                           prefill=PREFILL_BACKENDS.get(backend, "auto"))

    def teardown(self):
        moegraph.unpatch(self.model)
        torch.cuda.empty_cache()

    def run(self, backend, batch_size, prompts, *, new_tokens: int | None = None, sample: bool = False,
            prompt_len: int | None = None) -> Case:
        """Decode speed: `new_tokens` (default --new-tokens) tokens, greedy or sampled (SAMPLING)."""
        case = Case(backend, batch_size, prompt_len, new_tokens or self.args.new_tokens, sample)
        return self._guarded(case, lambda: self._measure(case, prompts))

    def ttft(self, backend, batch_size, prompts) -> TtftCase:
        """Time to first token: generate(max_new_tokens=1), synchronized, median of --runs."""
        case = TtftCase(backend, batch_size, prompts["input_ids"].shape[1])
        return self._guarded(case, lambda: self._measure_ttft(case, prompts))

    def _guarded(self, case, measure):
        remaining = self.deadline - time.perf_counter()
        if remaining < 30 or (case.backend == "hf_static_compile" and remaining < 240):
            case.status = f"over budget: {remaining:.0f} s of the run's budget left"
            return case
        self.setup(case.backend, case.batch_size)
        try:
            measure()
        except Exception as exc:  # a failing backend is reported, not dropped
            case.status = f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
        finally:
            self.teardown()
        return case

    def _generate(self, case, prompts, tokens: int, **extra):
        kw = self.generate_kwargs(case.backend, tokens, getattr(case, "sample", False))
        return self.model.generate(**prompts, **kw, **extra)

    def _budget(self) -> float:
        return min(self.args.budget_s, self.deadline - time.perf_counter())

    def _first_call(self, case, prompts, tokens: int) -> float | None:
        """The first call (graph capture, compilation); the budget left after it, or None (status set) if spent."""
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        _, case.first_call_s = timed_call(lambda: self._generate(case, prompts, tokens))
        if case.backend.startswith("moegraph"):
            case.capture_s = moegraph.decode_stats(self.model).capture_seconds
        budget = self._budget()
        if case.first_call_s > budget:
            case.status = f"over budget: the first call took {case.first_call_s:.0f} s, {budget:.0f} s allowed"
            return None
        return budget

    def _fit_runs(self, case, estimate: float, budget: float) -> int:
        runs = max(1, min(self.args.runs, int(budget // max(estimate, 1e-3))))
        if runs < self.args.runs:
            case.notes.append(f"timed runs trimmed {self.args.runs}->{runs} to fit {budget:.0f} s")
        return runs

    def _fit_tokens(self, case, prefill: float, per_step: float, budget: float) -> int | None:
        """The new tokens of a timed run: case.new_tokens, or fewer (noted) when one run would not fit the budget."""
        n = case.new_tokens
        if prefill + per_step * (n - 1) <= budget:
            return n
        fit = int((budget - prefill) / per_step) + 1 if per_step > 0 else 0
        if fit < MIN_TOKENS:
            case.status = f"over budget: one run ~{prefill + per_step * (n - 1):.0f} s, {budget:.0f} s allowed"
            return None
        case.notes.append(f"new tokens shortened {n}->{fit} to fit {budget:.0f} s")
        case.new_tokens = fit
        return fit

    def _timed_runs(self, case, prompts, tokens: int, runs: int) -> tuple[list, list]:
        """Seconds of `runs` synchronized generate() calls, and after each moegraph's decode_stats, or for plain
        transformers (which reports no prefill time) the seconds from the call's start to its first token's logits
        (FirstTokenClock; None for a 1-token call: that is the prefill)."""
        seconds, stats = [], []
        for _ in range(runs):
            if case.backend.startswith("moegraph") or tokens == 1:
                seconds.append(timed_call(lambda: self._generate(case, prompts, tokens))[1])
                stats.append(moegraph.decode_stats(self.model) if case.backend.startswith("moegraph") else None)
                continue
            clock = FirstTokenClock()
            _sync()
            start = time.perf_counter()
            self._generate(case, prompts, tokens, logits_processor=[clock])
            _sync()
            seconds.append(time.perf_counter() - start)
            stats.append(clock.at - start)
        return seconds, stats

    def _measure(self, case, prompts):
        # moegraph's first call sizes the static cache for the whole case, so that no timed run grows it (re-capture)
        budget = self._first_call(case, prompts, case.new_tokens if case.backend.startswith("moegraph") else 2)
        if budget is None:
            return
        # a 1-token and a 4-token call: the prefill and the per-step estimate that fit the case to its budget
        _, prefill = timed_call(lambda: self._generate(case, prompts, 1))
        _, warm = timed_call(lambda: self._generate(case, prompts, 4))
        per_step = max(warm - prefill, 0.0) / 3
        budget = self._budget()
        n = self._fit_tokens(case, prefill, per_step, budget)
        if n is None:
            return
        one_run = prefill + per_step * (n - 1)
        totals, stats = self._timed_runs(case, prompts, n, self._fit_runs(case, one_run, budget))
        if case.backend.startswith("moegraph"):
            prefills = [s.prefill_seconds for s in stats]
            decodes = [s.decode_seconds / max(s.steps - 1, 1) for s in stats]
            case.host_ms_per_step = statistics.median(s.host_ms_per_step for s in stats)
            if stats[-1].fallback_reason:
                case.notes.append(f"fell back to transformers: {stats[-1].fallback_reason}")
        else:  # the prefill and the decode steps of the same call
            prefills = stats
            decodes = [(t - p) / (n - 1) for t, p in zip(totals, prefills)]
        case.runs = len(totals)
        case.total_s = statistics.median(totals)
        case.prefill_ms = 1e3 * statistics.median(prefills)
        case.decode_ms_per_step = 1e3 * statistics.median(decodes)
        case.tok_s = case.batch_size * n / case.total_s
        case.decode_tok_s = case.batch_size / (case.decode_ms_per_step / 1e3)
        if torch.cuda.is_available():
            case.peak_gb = torch.cuda.max_memory_allocated() / 1e9

    def _measure_ttft(self, case, prompts):
        budget = self._first_call(case, prompts, 2)
        if budget is None:
            return
        _, estimate = timed_call(lambda: self._generate(case, prompts, 1))
        times, stats = self._timed_runs(case, prompts, 1, self._fit_runs(case, estimate, self._budget()))
        case.runs = len(times)
        case.ttft_ms = 1e3 * statistics.median(times)
        case.min_ms = 1e3 * min(times)
        if case.backend.startswith("moegraph"):
            case.prefill_ms = 1e3 * statistics.median(s.prefill_seconds for s in stats)
            case.prefill = stats[-1].prefill or ""


def _plot(results, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for backend in BACKENDS + OPT_IN_BACKENDS + QUANT_BACKENDS + ("roofline",):
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

    unknown = set(backends) - set(BACKENDS + OPT_IN_BACKENDS)
    if unknown:
        raise moegraph.InvalidArgumentError(f"unknown backends {sorted(unknown)}; choose from "
                                            f"{BACKENDS + OPT_IN_BACKENDS}")
    device = next(model.parameters()).device
    bandwidth = measure_copy_bandwidth(device)
    results = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
               "copy_bandwidth_tb_s": bandwidth / 1e12, "new_tokens": new_tokens, "roofline": {}, "cases": []}
    args = SimpleNamespace(new_tokens=new_tokens, runs=runs, budget_s=budget_s)
    runner = Runner(model, args, time.perf_counter() + total_budget_s)
    prompts = {}
    for batch_size in batch_sizes:
        prompts[batch_size] = random_prompts(batch_size, vocab_size=model.config.get_text_config().vocab_size, min_len=min_len,
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


@dataclass
class Session:
    """One `python -m moegraph bench`: the model, its runner, the results being filled, and the copy bandwidth."""

    args: object
    model: object
    runner: Runner
    results: dict
    bandwidth: float
    device: str
    started: float

    def prompts(self, batch_size: int, prompt_len: int | None = None) -> dict:
        """Random prompts: 16-128 tokens per row (left-padded), or exactly `prompt_len` tokens each."""
        low, high = (16, 128) if prompt_len is None else (prompt_len, prompt_len)
        return random_prompts(batch_size, vocab_size=self.model.config.get_text_config().vocab_size, min_len=low, max_len=high,
                              seed=batch_size, device=self.device)

    def distinct_experts(self, batch_size: int) -> float:
        """Distinct experts per layer per step at `batch_size` rows (random routing: the context does not matter)."""
        entry = self.results["roofline"].setdefault(batch_size, {})
        if "distinct_experts_per_layer" not in entry:
            entry["distinct_experts_per_layer"] = count_distinct_experts(self.model, self.prompts(batch_size))
        return entry["distinct_experts_per_layer"]

    def add_roofline(self, case: Case, context: float) -> None:
        """The case's roofline at `context` positions per row (prompt + half the new tokens), KV cache included."""
        parts = step_bytes(self.model, case.batch_size, self.distinct_experts(case.batch_size), context)
        case.roofline_tok_s = case.batch_size / (parts["total"] / self.bandwidth)
        case.kv_cache_gb = parts["kv_cache"] / 1e9

    def backends(self, default: str) -> list:
        names = (self.args.backends or default).split(",")
        return sorted((b for b in BACKENDS + OPT_IN_BACKENDS if b in names), key=PRIORITY.index)

    def batch_sizes(self, default: str) -> list:
        return [int(b) for b in (self.args.batch_sizes or default).split(",")]

    def elapsed(self) -> float:
        return time.perf_counter() - self.started


def _check_args(args) -> str | None:
    from moegraph.testing.models import CONFIGS

    unknown = set((args.backends or "").split(",")) - set(BACKENDS + OPT_IN_BACKENDS) - {""}
    if unknown:
        return f"unknown backends {sorted(unknown)}; choose from {BACKENDS + OPT_IN_BACKENDS}"
    if args.model not in CONFIGS:
        return f"unknown --model {args.model!r}; choose one of {sorted(CONFIGS)}"
    if args.double_quant and args.quant != "nf4":
        return "--double-quant needs --quant nf4"
    if args.quant == "nf4" and (_modes(args) != ["decode"] or not torch.cuda.is_available()):
        return "--quant nf4 runs with the decode table only (no --prompt-len/--long/--ttft/--profile), on a CUDA GPU"
    if not torch.cuda.is_available() and not args.model.startswith("tiny"):
        return "bench needs a CUDA GPU (it measures decode speed against the GPU's memory bandwidth); on the CPU, " \
               "--model tiny (or another tiny-* preset) runs the bench's own code paths"
    return None


def _modes(args) -> list:
    """What this run measures: the sections asked for, else the regular decode table (--sample: sampled)."""
    modes = [m for m, asked in (("prompt_len", args.prompt_len), ("long", args.long), ("ttft", args.ttft),
                                ("profile", args.profile)) if asked]
    return modes or ["decode"]


def _command(args) -> str:
    """The command line of this run: as typed when it came through `python -m moegraph`, else its arguments."""
    if sys.argv[0].endswith(("__main__.py", "moegraph")) and "bench" in sys.argv:
        return "python -m moegraph " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    return "bench " + " ".join(f"{k}={v}" for k, v in vars(args).items() if k != "func")


def _start(args) -> Session:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = getattr(torch, args.dtype)
    model = build_model(args.model, num_layers=args.num_layers, device=device, dtype=dtype, seed=0)
    bandwidth = measure_copy_bandwidth(device)
    from moegraph.moe.select import describe_moe_backend

    choice = describe_moe_backend(device, dtype)
    results = {
        "date": datetime.date.today().isoformat(), "gpu": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
        "torch": torch.__version__, "transformers": __import__("transformers").__version__,
        "moegraph": moegraph.__version__, "model": f"{args.model} (random weights)",
        "num_layers": model.config.get_text_config().num_hidden_layers, "dtype": args.dtype, "new_tokens": args.new_tokens,
        "copy_bandwidth_tb_s": bandwidth / 1e12, "moe_backend": f"{choice.name}: {choice.reason}",
        "command": _command(args),
        "modes": _modes(args), "sample": SAMPLING if args.sample or args.long else None, "cases": [], "roofline": {},
    }
    print(f"bench: {results['gpu']}, torch {results['torch']}, transformers {results['transformers']}, "
          f"{args.model} {results['num_layers']} layers {args.dtype}, copy bandwidth {bandwidth / 1e12:.2f} TB/s, "
          f"moegraph MoE backend {results['moe_backend']}", flush=True)
    started = time.perf_counter()
    return Session(args, model, Runner(model, args, started + args.total_budget_s), results, bandwidth, device, started)


def run_bench(args) -> int:
    error = _check_args(args)
    if error:
        print(error)
        return 2
    from moegraph import bench_modes

    session = _start(args)
    modes = _modes(args)
    tables = [{"decode": _decode_mode, "prompt_len": bench_modes.prompt_len_mode, "long": bench_modes.long_mode,
               "ttft": bench_modes.ttft_mode, "profile": bench_modes.profile_mode}[m](session) for m in modes]
    results = session.results
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"bench_{args.model}_{results['num_layers']}l_{args.dtype}"
                        + (f"_nf4{'_dq' if args.double_quant else ''}" if args.quant == "nf4" else "")
                        + ("_sample" if args.sample else "") + "".join(f"_{m}" for m in modes if m != "decode"))
    with open(stem + ".json", "w") as f:
        json.dump(results, f, indent=2, default=str)
    plot = _plot(results, stem + ".png") if results["cases"] else None
    print(_head(results, session.elapsed()))
    print("\n\n".join(tables))
    print(f"wrote {stem}.json" + (f" and {plot}" if plot else ""))
    return 0


def _decode_mode(session: Session) -> str:
    """The regular table: every backend at every batch size on 16-128-token prompts (--sample: sampled)."""
    args, model, results = session.args, session.model, session.results
    batch_sizes = session.batch_sizes("1,8,32,64")
    prompts = {}
    for batch_size in batch_sizes:
        prompts[batch_size] = session.prompts(batch_size)
        distinct = session.distinct_experts(batch_size)
        context = float(prompts[batch_size]["attention_mask"].sum(1).float().mean()) + args.new_tokens / 2
        results["roofline"][batch_size].update(distinct_experts_per_layer=distinct, context=context)
        _add_roofline(results, "", model, batch_size, session.bandwidth)
    cases = []
    # the most telling comparisons first, so that a tight budget trims the others
    for backend in session.backends(",".join(BACKENDS)):
        for batch_size in batch_sizes:
            for sample in (False, True) if args.sample else (False,):  # --sample: sampled beside greedy
                cases.append(_run_case(session.runner, backend, batch_size, prompts, results, sample))
    if args.quant == "nf4":
        cases += _run_nf4_cases(session.runner, model, batch_sizes, prompts, results, args, session.bandwidth)
        del model
        session.model = session.runner.model = None
        results["loading"] = measure_nf4_loading(args.model, results["num_layers"], getattr(torch, args.dtype),
                                                 args.double_quant)
        print(f"NF4 random-weight build, one layer at a time: {results['loading']}", flush=True)
    order = BACKENDS + OPT_IN_BACKENDS + QUANT_BACKENDS
    cases.sort(key=lambda c: (c.batch_size, c.sample, order.index(c.backend)))
    results["cases"] = [asdict(c) for c in cases]
    return decode_table(cases, prompt=False, host=args.sample)


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


def _run_case(runner, backend, batch_size, prompts, results, sample: bool = False) -> Case:
    case = runner.run(backend, batch_size, prompts[batch_size], sample=sample)
    prefix = {"hf_4bit": "hf_4bit_", "moegraph_nf4": "nf4_"}.get(backend, "")
    entry = results["roofline"][batch_size]
    case.roofline_tok_s = entry[prefix + "roofline_tok_s"]
    case.kv_cache_gb = entry[prefix + "step_bytes"]["kv_cache"] / 1e9
    print_progress(case)
    return case


def print_progress(case) -> None:
    speed = (f"{case.ttft_ms:9.1f} ms to first token" if isinstance(case, TtftCase)
             else f"{case.tok_s:9.1f} tok/s {case.decode_ms_per_step:8.2f} ms/step")
    prompt = f" prompt {case.prompt_len:>5}" if case.prompt_len else ""
    print(f"  {case.backend:<18} bs {case.batch_size:>3}{prompt} {case.status:<10} {speed}"
          + (f"  ({'; '.join(case.notes)})" if case.notes else ""), flush=True)


def _run_nf4_cases(runner, model, batch_sizes, prompts, results, args, bandwidth) -> list:
    """Quantize the model in place, as load_in_4bit would (projections), then as moegraph does (experts)."""
    from moegraph.quant.experts import quantize_experts
    from moegraph.quant.projections import quantize_projections

    cases = []
    quantize_projections(model, double_quant=args.double_quant)
    for batch_size in batch_sizes:
        _add_roofline(results, "hf_4bit_", model, batch_size, bandwidth)
    if "hf" in (args.backends or "hf").split(","):
        for batch_size in batch_sizes:
            case = runner.run("hf", batch_size, prompts[batch_size])
            case.backend = "hf_4bit"
            case.roofline_tok_s = results["roofline"][batch_size]["hf_4bit_roofline_tok_s"]
            cases.append(case)
            print_progress(case)
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


def _head(results, elapsed) -> str:
    return (f"\n{results['gpu']} | torch {results['torch']} | transformers {results['transformers']} | "
            f"moegraph {results['moegraph']} | {results['date']} | {results['model']} {results['num_layers']} layers "
            f"{results['dtype']} | copy {results['copy_bandwidth_tb_s']:.2f} TB/s | moegraph MoE "
            f"{results['moe_backend'].split(':')[0]} | {elapsed:.0f} s | `{results['command']}`\n")


def markdown(columns, rows) -> str:
    """A markdown table: `columns` is [(header, row -> str)]."""
    lines = ["| " + " | ".join(h for h, _ in columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    return "\n".join(lines + ["| " + " | ".join(f(r) for _, f in columns) + " |" for r in rows])


def num(key: str, spec: str = ".1f"):
    """A column of `row.key` formatted by `spec`; "-" where it is None or nan (not measured)."""
    def cell(row):
        value = getattr(row, key)
        return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)
    return cell


def status(row) -> str:
    return row.status + (f" ({'; '.join(row.notes)})" if row.notes else "")


def decode_table(cases, *, prompt: bool, host: bool) -> str:
    """One row per decode case; "vs hf" and "roofline" compare decode tok/s (the roofline is that of a decode step,
    the KV cache of its context included); `prompt`: the prompt and new-token columns, `host`: moegraph's host ms."""
    hf = {(c.batch_size, c.prompt_len, c.sample): c.decode_tok_s
          for c in cases if c.backend == "hf" and c.status == "ok"}

    def vs_hf(c):  # against transformers decoding the same way (greedy or sampled)
        base = hf.get((c.batch_size, c.prompt_len, c.sample))
        return "-" if base is None or math.isnan(c.decode_tok_s) else f"{c.decode_tok_s / base:.2f}"

    columns = [("backend", lambda c: c.backend), ("bs", num("batch_size", "d"))]
    if prompt:
        columns += [("prompt", num("prompt_len", "d")), ("new tok", num("new_tokens", "d"))]
    def of_roofline(c):
        return "-" if math.isnan(c.decode_tok_s) else f"{c.decode_tok_s / c.roofline_tok_s:.1%}"

    columns += [("tok/s", num("tok_s")), ("decode tok/s", num("decode_tok_s")),
                ("ms/step", num("decode_ms_per_step", ".2f")), ("prefill ms", num("prefill_ms")), ("vs hf", vs_hf),
                ("roofline", of_roofline),
                ("roofline tok/s", num("roofline_tok_s", ".0f")), ("KV GB/step", num("kv_cache_gb", ".3g"))]
    if host:
        columns += [("sampled", lambda c: "yes" if c.sample else "no"),
                    ("host ms/step", num("host_ms_per_step", ".3f"))]
    columns += [("peak GB", num("peak_gb")), ("capture s", num("capture_s", ".2f")),
                ("1st call s", num("first_call_s")), ("status", status)]
    return markdown(columns, cases)

"""`python -m moegraph accuracy`: how far each way of running the model is from an fp32 copy of the same weights.

One random-weight model (moegraph.testing; real weights cannot be downloaded here) is built once in fp32: the
reference. Every variant's weights are derived from those same fp32 weights (cast to bf16; NF4 quantized from
that bf16 cast, as a bf16 checkpoint loaded in 4-bit would be), the variant generates greedily, and one fp32
forward over the variant's own sequence (teacher forcing) gives the reference logits for every step it took.
Per (row, step): relative L2 error ||l - l_fp32|| / ||l_fp32|| of the raw logits over the vocabulary, and whether
argmax(l) == argmax(l_fp32). The `fp32` variant is the reference's own cached greedy decode: its figures are the
floor of the method (a cached decode step and a full forward round fp32 differently), not exactly zero.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import json
import time
from dataclasses import asdict, dataclass, field

import torch

import moegraph
from moegraph.testing import build_model, random_prompts


class VariantUnavailable(Exception):
    """The variant cannot run on this machine (reported as skipped, not failed)."""


@dataclass(frozen=True)
class Variant:
    name: str
    weights: str  # fp32 | bf16 | bf16_linear4bit | nf4
    patched: bool  # generate() through moegraph.patch(model)
    about: str


VARIANTS = (
    Variant("fp32", "fp32", False, "the fp32 reference's own greedy generate (floor of the method)"),
    Variant("moegraph_bf16", "bf16", True, "moegraph, bf16 weights"),
    Variant("hf_bf16", "bf16", False, "plain transformers generate, bf16 weights"),
    Variant("moegraph_nf4", "nf4", True, "moegraph, NF4 experts (quantize_experts) + Linear4bit projections"),
    Variant("hf_nf4", "nf4", False, "transformers generate on the same NF4 weights (experts: NF4Experts' torch "
                                    "forward_ref; projections: bitsandbytes Linear4bit)"),
    Variant("hf_4bit", "bf16_linear4bit", False, "transformers as load_in_4bit leaves Qwen3-MoE: Linear4bit "
                                                  "projections, bf16 experts"),
)
VARIANT_NAMES = tuple(v.name for v in VARIANTS)


@dataclass
class Result:
    variant: str
    about: str
    status: str = "ok"  # ok | skipped: ... | failed: ...
    rel_l2_mean: float = float("nan")
    rel_l2_max: float = float("nan")
    argmax_agreement: float = float("nan")
    tokens: int = 0
    seconds: float = float("nan")
    notes: list = field(default_factory=list)


@dataclass
class Settings:
    model: str
    num_layers: int | None
    device: str
    prompts: int
    batch_size: int
    new_tokens: int
    min_len: int
    max_len: int


def settings_from_args(args) -> Settings:
    """Full-size model on a GPU (12 layers, 8 prompts of 16-128 tokens, 32 new tokens); tiny on the CPU."""
    cuda = torch.cuda.is_available()
    gpu = dict(model="qwen3-30b-a3b", num_layers=12, prompts=8, batch_size=8, new_tokens=32, min_len=16, max_len=128)
    cpu = dict(model="tiny", num_layers=None, prompts=4, batch_size=2, new_tokens=8, min_len=4, max_len=16)
    chosen = dict(gpu if cuda else cpu)
    for key in ("model", "num_layers", "prompts", "batch_size", "new_tokens"):
        if getattr(args, key, None) is not None:
            chosen[key] = getattr(args, key)
    return Settings(device="cuda" if cuda else "cpu", **chosen)


def make_prompts(s: Settings, vocab_size: int) -> list[dict]:
    """Left-padded batches of fixed-seed token-id prompts, `s.prompts` rows in all."""
    sizes = [min(s.batch_size, s.prompts - start) for start in range(0, s.prompts, s.batch_size)]
    return [random_prompts(n, vocab_size=vocab_size, min_len=s.min_len, max_len=s.max_len, seed=1000 + i,
                           device=s.device) for i, n in enumerate(sizes)]


def build_reference(s: Settings):
    """The fp32 model; transformers' eager experts (one plain fp32 matmul per expert) make it easy to trust."""
    return build_model(s.model, device=s.device, dtype=torch.float32, num_layers=s.num_layers, seed=0,
                       experts_implementation="eager")


@torch.no_grad()
def copy_weights(reference, model) -> None:
    """Every parameter and buffer (non-persistent ones too: RoPE's inv_freq) of `reference` into `model`'s
    tensors, each cast to the dtype `model` holds it in."""
    for kind in ("named_parameters", "named_buffers"):
        source = dict(getattr(reference, kind)())
        for name, tensor in getattr(model, kind)():
            tensor.copy_(source[name])


def bf16_copy(reference, s: Settings):
    """A bf16 model of the reference's config with the reference's weights, cast: built on the meta device and
    materialized once, so no random initialization and no second fp32 copy."""
    model = build_model(s.model, device="meta", dtype=torch.bfloat16, num_layers=s.num_layers, seed=0)
    model.to_empty(device=s.device)
    copy_weights(reference, model)
    return model


def bnb_unavailable(device: str) -> str | None:
    """Why bitsandbytes' Linear4bit cannot run on `device` in bf16 (None when it can)."""
    try:
        from moegraph.quant import quantize_projections

        probe = quantize_projections(torch.nn.Sequential(torch.nn.Linear(64, 64, dtype=torch.bfloat16,
                                                                         device=device)))
        probe(torch.ones(1, 64, dtype=torch.bfloat16, device=device))
    except Exception as exc:  # an optional package, or its device library, may be missing or broken: say which
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}"
    return None


def derive(reference, variant: Variant, s: Settings, notes: list):
    """The variant's model, its weights derived from the reference's fp32 weights."""
    if variant.weights == "fp32":
        return reference
    from moegraph.quant import quantize_experts, quantize_projections

    model = bf16_copy(reference, s)
    if variant.weights in ("nf4", "bf16_linear4bit"):
        reason = bnb_unavailable(s.device)
        if reason is None:
            quantize_projections(model)
        elif variant.weights == "bf16_linear4bit":
            raise VariantUnavailable(f"needs bitsandbytes' Linear4bit on {s.device}: {reason}")
        else:
            notes.append(f"projections stay bf16 (bitsandbytes Linear4bit unavailable: {reason})")
    if variant.weights == "nf4":
        quantize_experts(model)
    return model


def generate_greedy(model, prompt: dict, new_tokens: int):
    """(sequences [B, P + N], raw logits [B, N, V] float32) of a greedy generate of exactly N tokens."""
    out = model.generate(**prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                         return_dict_in_generate=True, output_logits=True)
    return out.sequences, torch.stack(out.logits, dim=1).float()


@torch.no_grad()
def teacher_forced_logits(reference, sequences: torch.Tensor, prompt_mask: torch.Tensor, new_tokens: int):
    """The reference's logits [B, N, V] for each of the N steps of `sequences`, from one forward over the
    prefix every step saw (the sequence without its last token)."""
    inputs = sequences[:, :-1]
    mask = torch.cat([prompt_mask, prompt_mask.new_ones(inputs.shape[0], inputs.shape[1] - prompt_mask.shape[1])],
                     dim=1)
    # the positions generate() gives a left-padded row (transformers' _prepare_position_ids_for_generation)
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
    out = reference(input_ids=inputs, attention_mask=mask, position_ids=positions, use_cache=False,
                    logits_to_keep=new_tokens)
    return out.logits.float()


def compare(logits: torch.Tensor, ref: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per (row, step): relative L2 error over the vocabulary [B, N], and argmax agreement [B, N] (bool)."""
    rel = torch.linalg.vector_norm(logits - ref, dim=-1) / torch.linalg.vector_norm(ref, dim=-1)
    return rel, logits.argmax(-1) == ref.argmax(-1)


@contextlib.contextmanager
def patched_if(model, patched: bool, batch_size: int):
    if not patched:
        yield
        return
    moegraph.patch(model, max_batch_size=batch_size)
    try:
        yield
    finally:
        moegraph.unpatch(model)


def _decode_note(model) -> str:
    stats = moegraph.decode_stats(model)
    if stats.fallback_reason is not None:
        return f"fell back to transformers: {stats.fallback_reason}"
    return "CUDA graphs" if stats.graphs else "moegraph eager loop (no CUDA graphs)"


def measure(reference, model, variant: Variant, prompts: list[dict], s: Settings, result: Result) -> None:
    """Generate every batch with the variant, compare each step with the reference; fill `result`."""
    errors, agree = [], []
    with patched_if(model, variant.patched, s.batch_size):
        for prompt in prompts:
            sequences, logits = generate_greedy(model, prompt, s.new_tokens)
            if variant.patched:
                note = _decode_note(model)
                if note not in result.notes:
                    result.notes.append(note)
            ref = teacher_forced_logits(reference, sequences, prompt["attention_mask"], s.new_tokens)
            rel, same = compare(logits, ref)
            errors.append(rel.flatten())
            agree.append(same.flatten())
            del logits, ref
    errors, agree = torch.cat(errors), torch.cat(agree)
    result.rel_l2_mean = float(errors.mean())
    result.rel_l2_max = float(errors.max())
    result.argmax_agreement = float(agree.float().mean())
    result.tokens = int(agree.numel())


def release_memory() -> None:
    """Give a dropped variant's GPU memory back before the next one is derived (a CPU run skips it: a full
    gc pass over transformers' objects costs more than a tiny model)."""
    if torch.cuda.is_available():
        gc.collect()
        torch.cuda.empty_cache()


def run_variant(reference, variant: Variant, prompts: list[dict], s: Settings) -> Result:
    result = Result(variant.name, variant.about)
    start = time.perf_counter()
    model = None
    try:
        model = derive(reference, variant, s, result.notes)
        measure(reference, model, variant, prompts, s, result)
    except VariantUnavailable as exc:
        result.status = f"skipped: {exc}"
    except Exception as exc:  # a variant that cannot run is reported, the others still are
        result.status = f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
    finally:
        model = None  # the reference stays; a derived model goes
        release_memory()
    result.seconds = time.perf_counter() - start
    print(f"  {result.variant:<14} {result.status}: rel L2 mean {result.rel_l2_mean:.4g}, argmax = fp32 "
          f"{result.argmax_agreement:.1%} of {result.tokens} ({result.seconds:.1f} s)", flush=True)
    return result


def parse_variants(text: str | None) -> list[Variant]:
    names = VARIANT_NAMES if not text else tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = sorted(set(names) - set(VARIANT_NAMES))
    if unknown:
        raise moegraph.InvalidArgumentError(f"unknown variants {unknown}; choose from {list(VARIANT_NAMES)}")
    return [v for v in VARIANTS if v.name in names]


def measure_accuracy(s: Settings, variants: list[Variant]) -> dict:
    """The whole measurement: the reference built once, then every variant against it."""
    previous_precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")  # the reference must be fp32, not TF32
    try:
        reference = build_reference(s)
        prompts = make_prompts(s, reference.config.get_text_config().vocab_size)
        results = [run_variant(reference, v, prompts, s) for v in variants]
        num_layers = reference.config.get_text_config().num_hidden_layers
        del reference
        release_memory()
    finally:
        torch.set_float32_matmul_precision(previous_precision)
    return {"date": datetime.date.today().isoformat(), "device": _device_name(s.device), "torch": torch.__version__,
            "transformers": __import__("transformers").__version__, "moegraph": moegraph.__version__,
            "bitsandbytes": _version("bitsandbytes"), "float32_matmul_precision": "highest",
            "model": f"{s.model} (random weights)", "num_layers": num_layers, "settings": asdict(s),
            "results": [asdict(r) for r in results]}


def _version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


def _device_name(device: str) -> str:
    return torch.cuda.get_device_name(0) if device == "cuda" else "cpu"


def format_table(report: dict) -> str:
    s = report["settings"]
    head = (f"{report['device']} | torch {report['torch']} | transformers {report['transformers']} | "
            f"{report['date']} | {report['model']}, {report['num_layers']} layers | {s['prompts']} prompts of "
            f"{s['min_len']}-{s['max_len']} tokens, batch {s['batch_size']}, {s['new_tokens']} greedy tokens")
    rows = [head, f"{'variant':<14} {'rel L2 mean':>11} {'rel L2 max':>10} {'argmax = fp32':>13} {'tokens':>6} "
                  f"{'s':>6}  notes"]
    for r in report["results"]:
        notes = "; ".join(([] if r["status"] == "ok" else [r["status"]]) + r["notes"])
        rows.append(f"{r['variant']:<14} {r['rel_l2_mean']:>11.4g} {r['rel_l2_max']:>10.4g} "
                    f"{r['argmax_agreement']:>13.1%} {r['tokens']:>6} {r['seconds']:>6.1f}  {notes}")
    rows += [f"  {r['variant']}: {r['about']}" for r in report["results"]]
    return "\n".join(rows)


def run_accuracy(args) -> int:
    variants = parse_variants(args.variants)
    s = settings_from_args(args)
    report = measure_accuracy(s, variants)
    print(format_table(report))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
        print(f"wrote {args.out}")
    return 1 if any(r["status"].startswith("failed") for r in report["results"]) else 0

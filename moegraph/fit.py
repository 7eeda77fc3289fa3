"""Will it fit? Weight sizes, static KV cache and the backend moegraph would choose, from a config alone.

`fit_report(model_or_config, batch_size=1, seq_len=4096, device=None)` reads the config of a supported family (a
preset of moegraph.testing, a local config.json or folder, a Hub name through transformers' AutoConfig, a config object or a
model), never its weights, and answers for a device:
- the weights in bf16 / fp16 and in NF4 as moegraph and bitsandbytes quantize them (experts and every nn.Linear but
  the lm_head in 4-bit; embeddings, lm_head, routers and norms stay in the compute dtype), with fp32 absmax per 64
  weights or with double quantization;
- the static KV cache the decoder allocates for the batch and length (cuda_graph/static_cache.py);
- whether each fits in the device's memory with headroom;
- the dtype and MoE backend moegraph would use there, and why: on the device at hand the backend probes of
  moe/select.py run; for a GPU named from KNOWN_GPUS they cannot, and the report says what the probe's rules predict.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .errors import InvalidArgumentError, UnsupportedModelError

GB = 1e9  # decimal GB, as BENCHMARKS.md and the decoder's log lines print memory
# Memory kept free beyond weights + KV cache: prefill activations, the graphs' memory pool, the CUDA context and
# allocator fragmentation. On the H200 the NF4 model peaked 1.3 GB above its 18.09 GB while building (BENCHMARKS.md).
HEADROOM_FRACTION = 0.10
MIN_HEADROOM_BYTES = 1.5 * GB

NF4_BLOCKSIZE = 64  # weights per absmax (moegraph/quant/nf4.py BLOCKSIZE)
NESTED_BLOCKSIZE = 256  # absmax values per nested absmax under double quantization
NESTED_CODE_BYTES = 256 * 4  # one float32 8-bit code table per quantized tensor (bnb) or expert projection (moegraph)

# GPUs a notebook user may ask about: name -> (compute capability, nominal memory in GB as sold).
KNOWN_GPUS: dict[str, tuple[tuple[int, int], float]] = {
    "T4": ((7, 5), 16), "A100-40GB": ((8, 0), 40), "A100-80GB": ((8, 0), 80), "A10": ((8, 6), 24),
    "RTX3090": ((8, 6), 24), "L4": ((8, 9), 24), "RTX4090": ((8, 9), 24), "H100": ((9, 0), 80),
    "H200": ((9, 0), 141), "B200": ((10, 0), 180),
}
# GPUs moegraph's choice was measured on: name -> where
MEASURED_GPUS = {"H200": "BENCHMARKS.md, 2026-12-02/03: triton experts, bf16 and NF4, decoded through CUDA graphs"}


# --- the config -------------------------------------------------------------------------------------------------

def load_config(model_or_config):
    """A transformers config from a model, a config, a moegraph.testing preset, a local path or a Hub name."""
    if hasattr(model_or_config, "config") and not isinstance(model_or_config, (str, os.PathLike)):
        model_or_config = model_or_config.config
    if not isinstance(model_or_config, (str, os.PathLike)):
        return model_or_config
    from .testing import CONFIGS, make_config

    name = str(model_or_config)
    if name in CONFIGS:
        return make_config(name)
    path = Path(name).expanduser()
    if path.exists():
        return _config_from_path(path)
    return _config_from_hub(name)


def _config_from_path(path: Path):
    from transformers import AutoConfig

    folder = path.parent if path.is_file() else path
    if path.is_file() and path.name != "config.json":
        # AutoConfig reads folders; a config saved under another name is read as the JSON it is
        data = json.loads(path.read_text())
        from transformers import CONFIG_MAPPING

        model_type = data.pop("model_type", None)
        if model_type not in CONFIG_MAPPING:
            raise InvalidArgumentError(f"{path} has model_type={model_type!r}, which transformers does not know")
        return CONFIG_MAPPING[model_type](**data)
    return AutoConfig.from_pretrained(folder)


def _config_from_hub(name: str):
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(name)
    except OSError as exc:
        offline = os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0")
        raise InvalidArgumentError(
            f"cannot read the config of {name!r} from the Hugging Face Hub"
            f"{' (HF_HUB_OFFLINE is set)' if offline else ' (offline? set HF_HUB_OFFLINE=1 to fail fast)'}: "
            f"{str(exc).splitlines()[0].rstrip('.')}. Without network pass a local config.json or the folder holding it, "
            f"or a moegraph.testing preset such as 'qwen3-30b-a3b'.") from exc


# --- parameters, from the config ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class WeightGroup:
    """Parameters of one kind, as matrices: `shapes` holds (weights per matrix, how many such matrices). Under NF4
    each quantized matrix carries its own absmax blocks, nested absmax and offset, and `code_tables` double-quant
    code tables come with them (bnb: one per Linear4bit; moegraph's experts: one per projection and layer)."""

    name: str
    shapes: tuple[tuple[int, int], ...]
    quantized: bool = False
    code_tables: int = 0

    @property
    def params(self) -> int:
        return sum(numel * count for numel, count in self.shapes)


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _meta_model(config):
    """The family's causal LM built on the meta device: every parameter's shape, no memory."""
    from .models import FAMILIES

    model_type = getattr(config, "model_type", None)
    if model_type not in FAMILIES:
        raise UnsupportedModelError(f"fit_report counts the families moegraph supports ({sorted(FAMILIES)}), got "
                                    f"model_type={model_type!r}")
    with torch.device("meta"):
        return FAMILIES[model_type].causal_lm()(config)


def _group_of(name: str, param: torch.Tensor, linear: bool) -> str:
    """How moegraph (and bitsandbytes' load_in_4bit) stores a parameter, from where it sits in the model."""
    if name.startswith(("model.visual.", "visual.")):  # a vision-language model's vision tower (load_in_4bit
        return "vision" if linear and not name.endswith(".bias") else "vision other"  # quantizes its Linears)
    if "embed_tokens" in name:
        return "embeddings"
    if name.startswith("lm_head"):
        return "lm_head"
    if ".self_attn." in name:
        return "attention bias" if name.endswith(".bias") else ("attention" if linear else "norms")
    if ".experts." in name:
        return "experts" if param.dim() == 3 else "experts bias"  # GPT-OSS's per-expert biases stay 16-bit
    if linear:
        return "dense mlp bias" if name.endswith(".bias") else "dense mlp"  # dense layers, shared experts
    if ".mlp." in name and name.endswith(".weight") and param.dim() == 2:
        return "routers"
    return "norms"


def weight_groups(config) -> list[WeightGroup]:
    """Every parameter of the family's causal LM for `config` (built on the meta device), grouped by how moegraph
    stores it: nn.Linear weights (attention, dense MLPs, shared experts) and the fused experts quantize under NF4;
    embeddings, lm_head, routers, norms and biases stay in the compute dtype."""
    model = _meta_model(config)
    linear_params = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Linear)}
    linear_params |= {id(m.bias) for m in model.modules() if isinstance(m, torch.nn.Linear) and m.bias is not None}
    shapes: dict[str, dict[int, int]] = {}
    tables: dict[str, int] = {}
    for name, param in model.named_parameters():  # a tied lm_head appears once
        group = _group_of(name, param, id(param) in linear_params)
        matrices, numel = (param.shape[0], param[0].numel()) if group == "experts" else (1, param.numel())
        shapes.setdefault(group, {})
        shapes[group][numel] = shapes[group].get(numel, 0) + matrices
        if group in ("attention", "dense mlp", "experts", "vision"):
            tables[group] = tables.get(group, 0) + 1  # a double-quant code table per quantized weight (stack)
    order = ("embeddings", "attention", "attention bias", "experts", "experts bias", "dense mlp", "dense mlp bias",
             "routers", "norms", "lm_head", "vision", "vision other")
    return [WeightGroup(g, tuple(sorted(shapes[g].items())), g in tables, tables.get(g, 0))
            for g in order if g in shapes]


def count_parameters(config) -> int:
    return sum(g.params for g in weight_groups(config))


def _nf4_matrix_bytes(numel: int, double_quant: bool) -> int:
    blocks = math.ceil(numel / NF4_BLOCKSIZE)
    packed = math.ceil(numel / 2)
    if not double_quant:
        return packed + 4 * blocks  # float32 absmax per 64 weights
    # uint8 absmax, float32 nested absmax per 256 of them, a float32 offset
    return packed + blocks + 4 * math.ceil(blocks / NESTED_BLOCKSIZE) + 4


def _nf4_bytes(group: WeightGroup, double_quant: bool) -> int:
    matrices = sum(count * _nf4_matrix_bytes(numel, double_quant) for numel, count in group.shapes)
    return matrices + (NESTED_CODE_BYTES * group.code_tables if double_quant else 0)


def weight_bytes(config, fmt: str) -> int:
    """Bytes of the weights in `fmt`: "bf16", "fp16", "fp32", "nf4" or "nf4-dq" (double-quantized absmax); NF4 keeps
    what it does not quantize in 2 bytes (bf16 or fp16)."""
    if fmt in ("bf16", "fp16", "fp32"):
        return count_parameters(config) * (4 if fmt == "fp32" else 2)
    if fmt not in ("nf4", "nf4-dq"):
        raise InvalidArgumentError(f"unknown weight format {fmt!r}; choose bf16, fp16, fp32, nf4 or nf4-dq")
    return sum(_nf4_bytes(g, fmt == "nf4-dq") if g.quantized else 2 * g.params for g in weight_groups(config))


def kv_cache_bytes(config, batch_size: int, seq_len: int, dtype: torch.dtype = torch.bfloat16) -> int:
    """The static KV cache the decoder allocates for `batch_size` rows (patched with max_batch_size >= batch_size)
    of `seq_len` positions, rounded up to SEQ_ALIGN as the decoder rounds them."""
    from .cuda_graph.static_cache import SEQ_ALIGN, StaticKVCache, round_up

    text = config.get_text_config()  # a vision-language model's decoder config is nested
    return StaticKVCache.bytes_for(num_layers=text.num_hidden_layers, rows=batch_size,
                                   positions=round_up(seq_len, SEQ_ALIGN), kv_heads=text.num_key_value_heads,
                                   head_dim=_head_dim(text), dtype=dtype, device=torch.device("meta"))


# --- the device ---------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class DeviceMemory:
    name: str
    kind: str  # "cuda" or "cpu"
    capability: tuple[int, int] | None
    total_bytes: float
    free_bytes: float
    at_hand: bool  # memory read from this machine and probes run on it; False: a KNOWN_GPUS entry, nominal memory
    device: torch.device | None = None

    @property
    def sm(self) -> str:
        return f"sm_{self.capability[0]}{self.capability[1]}" if self.capability else "cpu"


def _cpu_memory() -> tuple[float, float]:
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        return total, int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):  # not Linux: no better figure than the total
        return total, total


def describe_device(device=None) -> DeviceMemory:
    """The device at hand (None: the current GPU, else the CPU; or "cpu", "cuda:1", ...) or a KNOWN_GPUS name."""
    if isinstance(device, str):
        known = {name.lower(): name for name in KNOWN_GPUS}
        key = device.lower().replace(" ", "")
        if key in known:
            capability, nominal_gb = KNOWN_GPUS[known[key]]
            return DeviceMemory(known[key], "cuda", capability, nominal_gb * GB, nominal_gb * GB, at_hand=False)
        if not key.startswith(("cpu", "cuda")):
            raise InvalidArgumentError(f"device={device!r} is neither a torch device nor one of {sorted(KNOWN_GPUS)}")
    from .moe.select import normalize_device

    device = normalize_device(device)
    if device.type == "cpu":
        total, free = _cpu_memory()
        return DeviceMemory("cpu", "cpu", None, total, free, at_hand=True, device=device)
    if device.type != "cuda":
        raise InvalidArgumentError(f"fit_report knows CUDA GPUs and the CPU, got {device}")
    free, total = torch.cuda.mem_get_info(device)
    return DeviceMemory(torch.cuda.get_device_name(device), "cuda", torch.cuda.get_device_capability(device),
                        total, free, at_hand=True, device=device)


# --- what moegraph would run ----------------------------------------------------------------------------------------

def choose_dtype(memory: DeviceMemory) -> tuple[torch.dtype, str]:
    """The dtype to load the model in for moegraph on this device, and why."""
    if memory.kind == "cpu":
        return torch.float32, "the CPU: moegraph's CPU path (tests, demo, parity) runs float32"
    if memory.capability >= (8, 0):
        return torch.bfloat16, f"{memory.sm} has bf16 (sm_80+): bfloat16, the dtype Qwen3-MoE checkpoints hold"
    return torch.float16, f"{memory.sm} has no bf16 (it needs sm_80+): float16"


@dataclass(frozen=True)
class BackendPlan:
    weights: str  # "dense" or "nf4"
    name: str
    graphs: bool | None  # None: depends on a probe that could not run here
    reason: str


def _probed_backend(memory: DeviceMemory, dtype: torch.dtype, weight_format: str) -> BackendPlan:
    from .moe.select import describe_moe_backend

    choice = describe_moe_backend(memory.device, dtype, weight_format=weight_format)
    return BackendPlan(weight_format, choice.name, choice.capture_safe, f"probed here: {choice.reason}")


def _predicted_backend(memory: DeviceMemory, dtype: torch.dtype, weight_format: str) -> BackendPlan:
    # moe/select.py's rules without its probes: AUTO_ORDER_CUDA tries triton, then grouped_mm, then the reference.
    # torch's grouped_mm has a CUTLASS path for bf16 on sm_90 / sm_100 only; elsewhere it loops over groups with
    # the offsets copied to the host, a sync that a CUDA graph cannot capture.
    if memory.name in MEASURED_GPUS:
        return BackendPlan(weight_format, "triton", True, f"measured on an {memory.name} ({MEASURED_GPUS[memory.name]}); "
                                                          "the probe still decides on each machine")
    grouped_fast = dtype == torch.bfloat16 and memory.capability[0] in (9, 10)
    dtype_name = str(dtype).removeprefix("torch.")
    fallback = ("grouped_mm, capture-safe" if grouped_fast
                else f"grouped_mm eager only (torch's grouped_mm syncs with the host for {dtype_name} on {memory.sm})")
    return BackendPlan(weight_format, "triton", None,
                       f"predicted, not probed ({memory.name} is not here): triton, the first of the auto order, "
                       f"with CUDA graphs if moegraph's Triton kernels pass the probe on {memory.sm}; else {fallback}")


def plan_backends(memory: DeviceMemory, dtype: torch.dtype) -> list[BackendPlan]:
    plan = _probed_backend if memory.at_hand else _predicted_backend
    return [plan(memory, dtype, fmt) for fmt in ("dense", "nf4")]


# --- the report -----------------------------------------------------------------------------------------------------

FORMATS = ("bf16", "fp16", "nf4", "nf4-dq")
FORMAT_NOTES = {
    "fp32": "every weight in fp32 (the CPU's dtype)",
    "bf16": "every weight in bf16",
    "fp16": "every weight in fp16",
    "nf4": "experts + every nn.Linear 4-bit, fp32 absmax per 64; embeddings, lm_head, routers, norms 16-bit",
    "nf4-dq": "as nf4, absmax double-quantized (8-bit, bnb_4bit_use_double_quant=True)",
}


@dataclass(frozen=True)
class FitLine:
    fmt: str
    weight_bytes: int
    kv_bytes: int
    fits: bool  # weights + KV cache + headroom within the free memory (nominal memory for a named GPU)

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.kv_bytes


@dataclass(frozen=True)
class FitReport:
    model: str
    parameters: int
    groups: tuple[WeightGroup, ...]
    batch_size: int
    seq_len: int
    memory: DeviceMemory
    headroom_bytes: float
    dtype: torch.dtype
    dtype_reason: str
    lines: tuple[FitLine, ...]
    backends: tuple[BackendPlan, ...]
    notes: tuple[str, ...] = field(default=())

    def line(self, fmt: str) -> FitLine:
        return next(line for line in self.lines if line.fmt == fmt)

    def __str__(self) -> str:
        return "\n".join(_report_lines(self))


def _gb(value: float) -> str:
    return f"{value / GB:7.2f} GB"


def _report_lines(report: FitReport) -> list[str]:
    m = report.memory
    where = (f"{m.name} ({m.sm}), {_gb(m.free_bytes).strip()} free of {_gb(m.total_bytes).strip()}" if m.at_hand
             else f"{m.name} ({m.sm}), {_gb(m.total_bytes).strip()} nominal (not this machine)")
    lines = [f"model          {report.model}: {report.parameters / 1e9:.2f} B parameters (from the config)",
             "  " + ", ".join(f"{g.name} {g.params / 1e9:.3f} B" for g in report.groups),
             f"device         {where}",
             f"KV cache       batch {report.batch_size} x {report.seq_len} tokens: "
             f"{_gb(report.line('bf16').kv_bytes).strip()} in 16-bit (static cache, positions rounded up to 256; "
             f"twice that in fp32)",
             f"{'format':<8} {'weights':>10} {'+ KV cache':>11}  fits (headroom {_gb(report.headroom_bytes).strip()})"]
    for line in report.lines:
        lines.append(f"{line.fmt:<8} {_gb(line.weight_bytes)} {_gb(line.total_bytes)}   "
                     f"{'yes' if line.fits else 'no ':<4} {FORMAT_NOTES[line.fmt]}")
    lines.append(f"dtype          {str(report.dtype).removeprefix('torch.')}: {report.dtype_reason}")
    for plan in report.backends:
        graphs = {True: "CUDA graphs", False: "no CUDA graphs", None: "graphs if the probe passes"}[plan.graphs]
        lines.append(f"moe backend    {plan.weights} experts: {plan.name} ({graphs}); {plan.reason}")
    lines += [f"note           {note}" for note in report.notes]
    return lines


def _headroom(memory: DeviceMemory) -> float:
    return max(HEADROOM_FRACTION * memory.total_bytes, MIN_HEADROOM_BYTES)


def _fit_line(config, fmt: str, batch_size: int, seq_len: int, usable_bytes: float) -> FitLine:
    # the decoder's cache takes the embeddings' dtype: fp32 in fp32, 16-bit otherwise (NF4 included)
    kv = kv_cache_bytes(config, batch_size, seq_len, torch.float32 if fmt == "fp32" else torch.bfloat16)
    weights = weight_bytes(config, fmt)
    return FitLine(fmt, weights, kv, weights + kv <= usable_bytes)


def fit_report(model_or_config, batch_size: int = 1, seq_len: int = 4096, device=None) -> FitReport:
    """Will this model fit on `device` (None: the GPU at hand, else the CPU; or a KNOWN_GPUS name)? Config only."""
    if batch_size < 1 or seq_len < 1:
        raise InvalidArgumentError(f"batch_size and seq_len must be >= 1, got {batch_size} and {seq_len}")
    config = load_config(model_or_config)
    groups = tuple(weight_groups(config))
    memory = describe_device(device)
    headroom = _headroom(memory)
    dtype, why = choose_dtype(memory)
    formats = (("fp32",) if dtype == torch.float32 else ()) + FORMATS
    lines = tuple(_fit_line(config, fmt, batch_size, seq_len, memory.free_bytes - headroom) for fmt in formats)
    notes = ("on the CPU moegraph decodes eagerly (no CUDA graphs) from weights in RAM",) if memory.kind == "cpu" else ()
    name = model_or_config if isinstance(model_or_config, (str, os.PathLike)) else getattr(
        config, "_name_or_path", "") or type(config).__name__
    return FitReport(str(name), count_parameters(config), groups, batch_size, seq_len, memory, headroom, dtype, why,
                     lines, tuple(plan_backends(memory, dtype)), notes)

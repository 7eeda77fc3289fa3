"""Which MoE backend runs on a device, and why.

The answer comes from probes that run the backend on the device (and, on CUDA, capture it in a
graph), never from version tables alone. It is cached per (device, dtype, weight format).
`MOEGRAPH_MOE_BACKEND=grouped_mm|triton|torch` overrides the automatic choice; it is read when a
choice is made (moegraph.ops resolves its table once), never per call.
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass

import torch
from torch import nn

from ..errors import BackendUnavailableError, InvalidArgumentError
from ..kernels import triton_available, triton_dtype_problem
from .grouped_mm import grouped_mm_available, moe_experts_grouped_mm
from .nf4 import moe_experts_nf4_grouped_mm, moe_experts_nf4_ref, moe_experts_nf4_triton
from .reference import moe_experts_ref
from .triton_experts import moe_experts_triton

logger = logging.getLogger("moegraph")

BACKENDS = ("grouped_mm", "triton", "torch")
# "auto" on CUDA tries these in order (the first that runs correctly wins). triton first: on an
# H200 at 48 layers it decodes 1.1-1.4x faster than grouped_mm (BENCHMARKS.md, 2026-12-02).
AUTO_ORDER_CUDA = ("triton", "grouped_mm")
ENV_VAR = "MOEGRAPH_MOE_BACKEND"

# (backend, weight format) -> experts function (hidden, top_k_index, top_k_weights, experts, ops=None) -> out
EXPERT_FUNCTIONS = {
    ("grouped_mm", "dense"): moe_experts_grouped_mm,
    ("triton", "dense"): moe_experts_triton,
    ("torch", "dense"): moe_experts_ref,
    ("grouped_mm", "nf4"): moe_experts_nf4_grouped_mm,
    ("triton", "nf4"): moe_experts_nf4_triton,
    ("torch", "nf4"): moe_experts_nf4_ref,
}


# weight format -> the experts function every backend runs under torch.compile: moegraph's grouped_mm path, whose
# GEMMs are the opaque op moegraph::grouped_mm. The Triton launchers, the probes and the reference's host syncs
# (`unique().tolist()`) stay out of traced code, so a compiled forward is one graph (fullgraph=True works).
COMPILED_EXPERT_FUNCTIONS = {
    "dense": moe_experts_grouped_mm,
    "nf4": moe_experts_nf4_grouped_mm,
}
COMPILED_REASON = "under torch.compile: moegraph's grouped_mm path, GEMMs as the custom op moegraph::grouped_mm"


def expert_function(backend: str, weight_format: str = "dense"):
    return EXPERT_FUNCTIONS[(backend, weight_format)]


@dataclass(frozen=True)
class BackendChoice:
    name: str
    capture_safe: bool  # may run inside a captured CUDA graph
    reason: str


class _ProbeExperts(nn.Module):
    """Just enough of an experts module for a probe: 8 experts, hidden 64, intermediate 32."""

    def __init__(self, device: torch.device, dtype: torch.dtype):
        super().__init__()
        gen = torch.Generator(device="cpu").manual_seed(0)
        self.gate_up_proj = nn.Parameter(torch.randn(8, 64, 64, generator=gen).to(device, dtype) * 0.1)
        self.down_proj = nn.Parameter(torch.randn(8, 64, 32, generator=gen).to(device, dtype) * 0.1)
        self.act_fn = nn.functional.silu


def _probe_inputs(device, dtype):
    # 37 tokens x top-2 over experts 0..5: uneven groups and two empty experts, as real routing gives
    gen = torch.Generator(device="cpu").manual_seed(1)
    hidden = torch.randn(37, 64, generator=gen).to(device, dtype)
    index = torch.rand(37, 6, generator=gen).topk(2, dim=-1).indices.to(device)
    weights = torch.rand(37, 2, generator=gen).to(device, dtype)
    return hidden, index, weights


def _probe_experts(device, dtype, weight_format: str) -> nn.Module:
    return PROBE_EXPERTS[weight_format](_ProbeExperts(device, dtype))


def _nf4_probe_experts(experts: nn.Module) -> nn.Module:
    from ..quant.experts import NF4Experts

    return NF4Experts.from_experts(experts)


# weight format -> builds probe experts of that format from dense ones
PROBE_EXPERTS = {"dense": lambda experts: experts, "nf4": _nf4_probe_experts}


def _probe_eager(name: str, device, dtype, weight_format: str = "dense") -> str | None:
    """None when backend `name` computes the right answer eagerly, else what went wrong."""
    experts = _probe_experts(device, dtype, weight_format)
    args = _probe_inputs(device, dtype)
    try:
        got = expert_function(name, weight_format)(*args, experts)
    except Exception as exc:  # the probe exists to turn any failure into a fallback
        return f"{name} failed in {dtype} on {device}: {type(exc).__name__}: {str(exc).splitlines()[0]}"
    want = expert_function("torch", weight_format)(*args, experts)
    if not torch.allclose(got.float(), want.float(), atol=2e-2, rtol=5e-2):
        return f"{name} gave wrong results in {dtype} on {device}"
    return None


def _probe_capture(name: str, device, dtype, weight_format: str = "dense") -> str | None:
    """None when backend `name` captures in a CUDA graph and replays like eager, else what went wrong."""
    experts = _probe_experts(device, dtype, weight_format)
    static_args = _probe_inputs(device, dtype)
    fn = expert_function(name, weight_format)
    try:
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            fn(*static_args, experts)  # warm-up outside capture
        torch.cuda.current_stream(device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fn(*static_args, experts)
        static_args[2].copy_(static_args[2].flip(0))
        graph.replay()
        torch.cuda.synchronize(device)
    except Exception as exc:
        return f"{name} cannot be captured in a CUDA graph: {type(exc).__name__}: {str(exc).splitlines()[0]}"
    if not torch.equal(out, fn(*static_args, experts)):
        return f"{name} replayed from a CUDA graph differs from eager"
    return None


def normalize_device(device) -> torch.device:
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


@functools.lru_cache(maxsize=None)
def _choose(device: torch.device, dtype: torch.dtype, requested: str, weight_format: str) -> BackendChoice:
    if weight_format not in {fmt for _, fmt in EXPERT_FUNCTIONS}:
        raise BackendUnavailableError(f"no MoE backend handles experts in the {weight_format!r} format")
    if requested == "torch":
        return BackendChoice("torch", False, "requested: reference loop over experts (syncs with the host)")
    problems = []
    for name in _candidates(device, requested):
        problem = _usable(name, device, dtype, weight_format)
        if problem is None:
            if device.type != "cuda":
                return BackendChoice(name, False, f"{name} runs eagerly on {device.type}; no CUDA graphs there")
            capture_problem = _probe_capture(name, device, dtype, weight_format)
            if capture_problem is not None:
                return BackendChoice(name, False, f"{capture_problem}; decoding without graphs")
            cc = torch.cuda.get_device_capability(device)
            return BackendChoice(name, True, f"{name} runs and captures with {weight_format} experts in {dtype} "
                                             f"on sm_{cc[0]}{cc[1]}")
        if requested != "auto":
            raise BackendUnavailableError(f"MoE backend {name!r} was requested but {problem}. "
                                          "Use moe_backend='auto' to let moegraph choose.")
        problems.append(problem)
    return BackendChoice("torch", False, f"{'; '.join(problems)}; using the reference loop")


def _candidates(device: torch.device, requested: str) -> tuple[str, ...]:
    if requested != "auto":
        return (requested,)
    return AUTO_ORDER_CUDA if device.type == "cuda" else ("grouped_mm",)


def _usable(name: str, device: torch.device, dtype: torch.dtype, weight_format: str) -> str | None:
    if (name, weight_format) not in EXPERT_FUNCTIONS:
        return f"{name} has no implementation for {weight_format} experts"
    if name == "grouped_mm" and not grouped_mm_available():
        return f"torch {torch.__version__} has neither torch.nn.functional.grouped_mm nor torch._grouped_mm"
    if name == "triton" and (problem := triton_dtype_problem(device, dtype)) is not None:
        return f"triton: {problem}"
    if name == "triton" and not triton_available(torch.empty(0, device=device)):
        return f"moegraph's Triton kernels cannot run on {device.type} here (Triton missing, or no GPU)"
    return _probe_eager(name, device, dtype, weight_format)


def validate_backend_name(name: str) -> str:
    if name not in BACKENDS + ("auto",):
        raise InvalidArgumentError(f"moe_backend={name!r} is not a MoE backend; choose one of {('auto',) + BACKENDS}")
    return name


def describe_moe_backend(device=None, dtype: torch.dtype = torch.bfloat16, requested: str = "auto",
                         weight_format: str = "dense") -> BackendChoice:
    """The backend that `requested` resolves to on `device` for experts of `dtype` and format, with the reason.

    The environment variable MOEGRAPH_MOE_BACKEND, when set, wins over `requested`.
    """
    env = os.environ.get(ENV_VAR)
    if env:
        requested = env.strip().lower()
        if requested not in BACKENDS + ("auto",):
            raise InvalidArgumentError(f"{ENV_VAR}={env!r} is not a MoE backend; set it to one of {BACKENDS} or unset it")
    validate_backend_name(requested)
    choice = _choose(normalize_device(device), dtype, requested, weight_format)
    if env:
        choice = BackendChoice(choice.name, choice.capture_safe, f"{ENV_VAR}={env}: {choice.reason}")
    return choice


def select_moe_backend(device=None, dtype: torch.dtype = torch.bfloat16) -> str:
    """Name of the MoE backend moegraph uses on `device`: "grouped_mm", "triton" or "torch"."""
    return describe_moe_backend(device, dtype).name

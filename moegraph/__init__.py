"""moegraph: one line, `moegraph.patch(model)`, makes `generate()` of transformers' MoE models (Qwen3-MoE, Mixtral,
OLMoE, Qwen2-MoE, GLM-4-MoE, Qwen3-VL-MoE text: `moegraph.models.FAMILIES`) decode through CUDA graphs."""

import logging

from .errors import (
    BackendUnavailableError,
    InvalidArgumentError,
    MoegraphError,
    OutOfMemoryError,
    UnsupportedModelError,
    UnsupportedVersionError,
)
from .moe.select import select_moe_backend
from .patches.api import capture, decode_stats, free_cache, is_patched, patch, unpatch
from .profiling import PrefillProfile, StepProfile, profile_model, profile_prefill, profile_step


def quantize_experts(model, *, double_quant: bool = False):
    """In place: the model's fused experts become NF4 (bitsandbytes' layout), layer by layer; returns the model."""
    from .quant import quantize_experts as _quantize_experts

    return _quantize_experts(model, double_quant=double_quant)

def fit_report(model_or_config, batch_size: int = 1, seq_len: int = 4096, device=None):
    """Will the model fit? Weights in bf16 / fp16 / NF4, the static KV cache, dtype and MoE backend, from its config."""
    from .fit import fit_report as _fit_report

    return _fit_report(model_or_config, batch_size=batch_size, seq_len=seq_len, device=device)

__version__ = "0.1.0"

logging.getLogger("moegraph").addHandler(logging.NullHandler())

__all__ = [
    "BackendUnavailableError",
    "InvalidArgumentError",
    "MoegraphError",
    "OutOfMemoryError",
    "PrefillProfile",
    "StepProfile",
    "UnsupportedModelError",
    "UnsupportedVersionError",
    "__version__",
    "capture",
    "decode_stats",
    "fit_report",
    "free_cache",
    "is_patched",
    "patch",
    "profile_model",
    "profile_prefill",
    "profile_step",
    "quantize_experts",
    "select_moe_backend",
    "unpatch",
]

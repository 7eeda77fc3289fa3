"""MoE backends (triton fused kernels, grouped_mm, torch reference), how one is chosen, and their names in
transformers' ExpertsInterface (interface.py)."""

from .grouped_mm import moe_experts_grouped_mm
from .reference import moe_experts_ref
from .select import BACKENDS, BackendChoice, describe_moe_backend, select_moe_backend

__all__ = [
    "BACKENDS",
    "BackendChoice",
    "describe_moe_backend",
    "moe_experts_grouped_mm",
    "moe_experts_ref",
    "select_moe_backend",
]

"""MoE backends (triton fused kernels, grouped_mm, torch reference) and how one is chosen."""

from .block import sparse_moe_forward
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
    "sparse_moe_forward",
]

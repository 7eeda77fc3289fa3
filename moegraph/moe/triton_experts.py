"""The `triton` MoE backend: moegraph's fused decode kernels (kernels/fused_moe.py).

Decode-sized calls (at most MAX_PAIRS token-expert pairs, SwiGLU experts in Qwen3-MoE's layout) run the fused
kernels; larger calls (prefill), other activations and other layouts (grouped_mm.own_layout: GPT-OSS's biases,
transposed weights and clamped SwiGLU, which the fused kernels do not compute) take the grouped_mm path.
"""

import torch
from torch import nn

from ..kernels import triton_available
from ..kernels.fused_moe import MAX_PAIRS, fused_moe_experts
from ..kernels.moe_combine import moe_combine
from .grouped_mm import grouped_mm_available, moe_experts_grouped_mm, own_layout
from .reference import moe_experts_ref


def moe_experts_triton(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                       experts: nn.Module, ops=None) -> torch.Tensor:
    swiglu = getattr(getattr(experts, "config", None), "hidden_act", "silu") == "silu" and not own_layout(experts)
    if swiglu and top_k_index.numel() <= MAX_PAIRS and triton_available(hidden):
        return fused_moe_experts(hidden, top_k_index, top_k_weights, experts.gate_up_proj, experts.down_proj,
                                 moe_combine)
    if grouped_mm_available():
        return moe_experts_grouped_mm(hidden, top_k_index, top_k_weights, experts, ops)
    return moe_experts_ref(hidden, top_k_index, top_k_weights, experts)

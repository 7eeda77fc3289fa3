"""Capture-safe MoE experts on `torch.nn.functional.grouped_mm` (fallback `torch._grouped_mm`).

Shapes: hidden [T, H], top_k_index [T, K], top_k_weights [T, K], gate_up_proj [E, 2I, H],
down_proj [E, H, I]; returns [T, H] in the dtype of hidden.

Capture-safe: every shape depends on T and K only. Pairs are grouped by expert on the device:
a stable sort plus `scatter_add_` counts (never `bincount`/`nonzero`/`.item()`), or in the decode
step moegraph's counting-sort kernel; the combine is a deterministic gather plus a sum over K in
float32 (no atomics), so a replayed graph is bit-identical to the eager call.
"""

from types import SimpleNamespace

import torch
from torch import nn

from ..kernels.moe_align import moe_align_ref
from ..kernels.moe_combine import moe_combine_ref
from ..kernels.silu_mul import silu_mul_ref

_grouped_mm = getattr(nn.functional, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


_REFERENCE_OPS = SimpleNamespace(moe_align=moe_align_ref, silu_mul=silu_mul_ref, moe_combine=moe_combine_ref)


def grouped_mm_available() -> bool:
    return _grouped_mm is not None


def moe_experts_grouped_mm(
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    experts: nn.Module,
    ops=None,
) -> torch.Tensor:
    """ops: where moe_align / silu_mul / moe_combine come from (moegraph's Triton kernels in the
    decode step); default: their plain-torch references, fine for any token count."""
    ops = ops or _REFERENCE_OPS
    num_experts = experts.gate_up_proj.shape[0]
    token_of_slot, position, offsets = ops.moe_align(top_k_index, num_experts)  # [T*K], [T*K], [E]
    weight_dtype = experts.gate_up_proj.dtype
    pairs = hidden.index_select(0, token_of_slot).to(weight_dtype)  # [T*K, H], grouped by expert
    gate_up = _grouped_mm(pairs, experts.gate_up_proj.transpose(-2, -1), offs=offsets)  # [T*K, 2I]
    if getattr(getattr(experts, "config", None), "hidden_act", None) == "silu":
        act = ops.silu_mul(gate_up)  # [T*K, I]
    else:
        gate, up = gate_up.chunk(2, dim=-1)
        act = experts.act_fn(gate) * up
    down = _grouped_mm(act, experts.down_proj.transpose(-2, -1), offs=offsets)  # [T*K, H]
    return ops.moe_combine(down, position, top_k_weights, hidden.dtype)

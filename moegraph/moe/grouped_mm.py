"""Capture-safe MoE experts on `torch.nn.functional.grouped_mm` (fallback `torch._grouped_mm`).

Shapes: hidden [T, H], top_k_index [T, K], top_k_weights [T, K], gate_up_proj [E, 2I, H],
down_proj [E, H, I]; returns [T, H] in the dtype of hidden.

Capture-safe: every shape depends on T and K only. Tokens per expert are counted with
`scatter_add_` on the device (never `bincount`/`nonzero`/`.item()`), the pair order comes from
a device sort, and the combine is a deterministic inverse permutation plus a sum over K in
float32 (no atomics), so a replayed graph is bit-identical to the eager call.
"""

import torch
from torch import nn

_grouped_mm = getattr(nn.functional, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def grouped_mm_available() -> bool:
    return _grouped_mm is not None


def moe_experts_grouped_mm(
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    experts: nn.Module,
    combine=None,
) -> torch.Tensor:
    """combine(expert_out [T*K, H], position [T*K], weights [T, K], dtype) -> [T, H], where
    position[p] is the row of pair p in expert_out; default: inverse permutation + float32 sum."""
    num_tokens, hidden_dim = hidden.shape
    top_k = top_k_index.shape[1]
    num_experts = experts.gate_up_proj.shape[0]

    expert_of_pair = top_k_index.reshape(-1)  # [T*K]
    sorted_experts, order = torch.sort(expert_of_pair, stable=True)  # [T*K]
    tokens_per_expert = torch.zeros(num_experts, dtype=torch.int32, device=hidden.device)
    tokens_per_expert.scatter_add_(0, sorted_experts, torch.ones_like(sorted_experts, dtype=torch.int32))
    offsets = torch.cumsum(tokens_per_expert, dim=0, dtype=torch.int32)  # [E], end of each group

    weight_dtype = experts.gate_up_proj.dtype
    pairs = hidden.index_select(0, order // top_k).to(weight_dtype)  # [T*K, H], grouped by expert
    gate_up = _grouped_mm(pairs, experts.gate_up_proj.transpose(-2, -1), offs=offsets)  # [T*K, 2I]
    gate, up = gate_up.chunk(2, dim=-1)
    act = experts.act_fn(gate) * up  # [T*K, I]
    down = _grouped_mm(act, experts.down_proj.transpose(-2, -1), offs=offsets)  # [T*K, H]

    if combine is not None:
        position = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
        return combine(down, position, top_k_weights, hidden.dtype)
    per_pair = torch.empty_like(down).index_copy_(0, order, down)  # back to token-major order
    weighted = per_pair.view(num_tokens, top_k, hidden_dim).float() * top_k_weights.float().unsqueeze(-1)
    return weighted.sum(dim=1).to(hidden.dtype)

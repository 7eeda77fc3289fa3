"""Reference MoE experts: a plain loop over experts, in float32.

Shapes: hidden [T, H], top_k_index [T, K] (int64), top_k_weights [T, K],
gate_up_proj [E, 2I, H], down_proj [E, H, I]; returns [T, H] in the dtype of hidden.

Not capture-safe: the loop asks the host which experts received tokens (`nonzero`).
It is the ground truth for tests and `parity`, and the `torch` backend.
"""

import torch
from torch import nn


def moe_experts_ref(
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    experts: nn.Module,
    ops=None,
) -> torch.Tensor:
    """ops: unused (the reference needs no kernels); accepted so every backend has one signature."""
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    for expert in top_k_index.unique().tolist():
        token_idx, slot = (top_k_index == expert).nonzero(as_tuple=True)
        x = hidden[token_idx]
        gate, up = nn.functional.linear(x, experts.gate_up_proj[expert]).chunk(2, dim=-1)
        y = nn.functional.linear(experts.act_fn(gate) * up, experts.down_proj[expert])
        out.index_add_(0, token_idx, y.float() * top_k_weights[token_idx, slot, None].float())
    return out.to(hidden.dtype)

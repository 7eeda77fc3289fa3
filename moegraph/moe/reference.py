"""Reference MoE experts: a plain loop over experts, in float32.

Shapes: hidden [T, H], top_k_index [T, K] (int64), top_k_weights [T, K],
gate_up_proj [E, 2I, H], down_proj [E, H, I]; returns [T, H] in the dtype of hidden.

Experts in another of transformers' layouts (grouped_mm.own_layout: GPT-OSS's transposed weights, biases and
gate) are computed as their own class computes them.

Not capture-safe: the loop asks the host which experts received tokens (`nonzero`).
It is the ground truth for tests and `parity`, and the `torch` backend.
"""

import torch
from torch import nn

from .grouped_mm import own_layout


def moe_experts_ref(
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    experts: nn.Module,
    ops=None,
) -> torch.Tensor:
    """ops: unused (the reference needs no kernels); accepted so every backend has one signature."""
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    layout = own_layout(experts)
    for expert in top_k_index.unique().tolist():
        token_idx, slot = (top_k_index == expert).nonzero(as_tuple=True)
        x = hidden[token_idx]
        if layout:
            y = _own_layout_expert(experts, expert, x)
        else:
            gate, up = nn.functional.linear(x, experts.gate_up_proj[expert]).chunk(2, dim=-1)
            y = nn.functional.linear(experts.act_fn(gate) * up, experts.down_proj[expert])
        out.index_add_(0, token_idx, y.float() * top_k_weights[token_idx, slot, None].float())
    return out.to(hidden.dtype)


def _own_layout_expert(experts: nn.Module, expert: int, x: torch.Tensor) -> torch.Tensor:
    """One expert of an own-layout experts module (GptOssExperts.forward's per-expert lines): x [n, H] -> [n, H]."""
    gate_up_w, down_w = experts.gate_up_proj[expert], experts.down_proj[expert]
    if not getattr(experts, "is_transposed", False):
        gate_up_w, down_w = gate_up_w.T, down_w.T
    has_bias = getattr(experts, "has_bias", False)
    gate_up = x @ gate_up_w + (experts.gate_up_proj_bias[expert] if has_bias else 0)
    return experts._apply_gate(gate_up) @ down_w + (experts.down_proj_bias[expert] if has_bias else 0)

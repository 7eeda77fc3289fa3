"""The capture-safe sparse MoE block forward (router -> top-k -> experts -> weighted combine).

It keeps HF's router module call (so `output_router_logits=True` still records the logits through
the router's forward hook) and swaps only the experts computation for the selected backend.
"""

import torch
from torch import nn

from .select import EXPERT_FUNCTIONS, describe_moe_backend


def sparse_moe_forward(block: nn.Module, hidden_states: torch.Tensor, requested_backend: str = "auto") -> torch.Tensor:
    """Forward of a Qwen3-MoE sparse block: hidden_states [B, S, H] -> [B, S, H]."""
    batch, seq, hidden_dim = hidden_states.shape
    flat = hidden_states.reshape(-1, hidden_dim)  # [T, H]
    _router_logits, top_k_weights, top_k_index = block.gate(flat)  # [T, E], [T, K], [T, K]
    experts = block.experts
    backend = describe_moe_backend(flat.device, experts.gate_up_proj.dtype, requested_backend).name
    out = EXPERT_FUNCTIONS[backend](flat, top_k_index, top_k_weights, experts)
    return out.view(batch, seq, hidden_dim)

"""The capture-safe sparse MoE block forward (router -> top-k -> experts -> weighted combine).

It keeps HF's router module call (so `output_router_logits=True` still records the logits through
the router's forward hook) and swaps only the experts computation for the one in the op table.
"""

import torch
from torch import nn


def sparse_moe_forward(block: nn.Module, hidden_states: torch.Tensor, ops) -> torch.Tensor:
    """Forward of a Qwen3-MoE sparse block: hidden_states [B, S, H] -> [B, S, H]; `ops`: an OpTable."""
    batch, seq, hidden_dim = hidden_states.shape
    flat = hidden_states.reshape(-1, hidden_dim)  # [T, H]
    _router_logits, top_k_weights, top_k_index = block.gate(flat)  # [T, E], [T, K], [T, K]
    out = ops.experts(flat, top_k_index, top_k_weights, block.experts)
    return out.view(batch, seq, hidden_dim)

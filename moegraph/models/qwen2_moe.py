"""Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): one decode step over the static cache, one new token per row ->
logits.

What differs from Qwen3-MoE (models/qwen3_moe.py), per transformers' modeling_qwen2_moe.py:
- attention: q/k/v projections with a bias (`qkv_bias`, applied by ops.qkv like the weights), no q/k-norm: RoPE
  only (the fused q/k-norm + RoPE + cache-write op with its norm weights None, as Mixtral);
- router: Qwen2MoeTopKRouter, softmax in float32 over all experts, top-k, renormalised only when `norm_topk_prob`
  (False in the released checkpoints), the weights cast back to the logits' dtype;
- a shared expert in every sparse block: a dense SwiGLU MLP (`shared_expert`) whose output is scaled by
  sigmoid(shared_expert_gate(x)) and added to the routed experts' output;
- dense Qwen2MoeMLP layers where `mlp_only_layers` or `decoder_sparse_step` say so;
- optional sliding window (`use_sliding_window`: the layers `config.layer_types` marks "sliding_attention", by
  transformers' rule every other layer below `max_window_layers`): the static-cache step attends to every cached
  position, so a call that could hold more than the window falls back to transformers (`check_positions`), never
  wrong tokens.
Same as Qwen3-MoE: pre-norm layers, GQA (MHA in Qwen1.5-MoE), fused 3D experts dispatched through moegraph's
experts (the ExpertsInterface implementation the prefill uses too).

Every shape is fixed by the row count and the cache size and nothing syncs with the host: this function is what
each bucket's graph captures, and also what the eager loop runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from ._shared import gqa_attention, moe_gate_weight, prenorm_decode_forward, rows_of_cache, softmax_topk_experts

if TYPE_CHECKING:
    from ..cuda_graph.static_cache import StaticKVCache


def check_positions(model: nn.Module, positions: int) -> str | None:
    """None when a call holding up to `positions` cache positions (prompt, padding included, + new tokens) decodes
    exactly here, else why not.

    Qwen2MoeConfig sets sliding_window to 0 when use_sliding_window is off and marks no layer sliding; a sliding
    layer lets each query see sliding_window keys, so below that bound the full-attention step is exact."""
    config = model.config
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None:  # a config without per-layer types: the switch alone says whether any layer slides
        sliding = "all layers" if getattr(config, "use_sliding_window", False) else None
    else:
        sliding = [i for i, kind in enumerate(layer_types) if kind == "sliding_attention"] or None
    window = getattr(config, "sliding_window", None)
    if sliding is None or (window and positions <= window):
        return None
    return (f"sliding_window={window} (use_sliding_window, layers {sliding}) with a call that could hold "
            f"{positions} positions (the decode step attends to every cached position; calls within the window "
            "take the fast path)")


def decode_forward(model: nn.Module, cache: StaticKVCache, token_ids: torch.Tensor, positions: torch.Tensor,
                   ops, rope_positions: torch.Tensor | None = None, cache_rows: torch.Tensor | None = None,
                   logit_rows: torch.Tensor | None = None) -> torch.Tensor:
    """One step for every row (moegraph.models._shared.prenorm_decode_forward): RoPE-only attention with q/k/v
    biases, MoE blocks with a gated shared expert (dense MLP layers where the config puts them)."""
    return prenorm_decode_forward(model, cache, token_ids, positions, ops, rope_positions, _attention, _mlp,
                                  cache_rows=cache_rows, logit_rows=logit_rows,
                                  router_weight=moe_gate_weight)


def _attention(attn: nn.Module, qkv: tuple[torch.Tensor, ...], cos, sin, positions, key_cache, value_cache,
               ops, cache_rows=None) -> torch.Tensor:
    q, k, v = qkv  # with q/k/v biases
    rows = q.shape[0]
    key_cache, value_cache = rows_of_cache(key_cache, value_cache, rows, cache_rows)
    # no q/k-norm: RoPE only, K/V written at `positions`
    q = ops.qk_norm_rope(q, k, v, None, None, cos, sin, positions, key_cache, value_cache, None,
                         cache_rows=cache_rows)  # [b, Hq, D]
    return gqa_attention(attn, q, key_cache, value_cache, positions, ops, cache_rows=cache_rows)


def _mlp(mlp: nn.Module, hidden: torch.Tensor, ops,
         router_logits: torch.Tensor | None = None) -> torch.Tensor:
    return decode_moe(mlp, hidden, ops, router_logits) if hasattr(mlp, "experts") else dense_mlp(mlp, hidden, ops)


def dense_mlp(mlp: nn.Module, hidden: torch.Tensor, ops) -> torch.Tensor:
    """Qwen2MoeMLP (a dense layer, or a block's shared expert) with its projections through the op table (NF4
    Linear4bit weights: moegraph's GEMV); rounds where its forward rounds."""
    gate, up = ops.linear(mlp.gate_proj, hidden), ops.linear(mlp.up_proj, hidden)  # [b, I] each
    return ops.linear(mlp.down_proj, mlp.act_fn(gate) * up)


def decode_moe(block: nn.Module, hidden: torch.Tensor, ops,
               router_logits: torch.Tensor | None = None) -> torch.Tensor:
    """Qwen2MoeSparseMoeBlock for [b, H] decode rows: the routed experts plus the sigmoid-gated shared expert."""
    routed = softmax_topk_experts(block, hidden, ops, router_logits)
    shared = dense_mlp(block.shared_expert, hidden, ops)
    return routed + torch.sigmoid(ops.linear(block.shared_expert_gate, hidden)) * shared  # gate [b, 1]

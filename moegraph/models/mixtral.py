"""Mixtral (Mixtral-8x7B, Mixtral-8x22B): one decode step over the static cache, one new token per row -> logits.

What differs from Qwen3-MoE (models/qwen3_moe.py), per transformers' modeling_mixtral.py:
- attention: no q/k-norm, RoPE only (the fused q/k-norm + RoPE + cache-write op with its norm weights None);
- router: MixtralTopKRouter, softmax in float32 over all experts, top-k (2), always renormalised, the weights
  left in float32 (transformers does not cast them back to the logits' dtype);
- every layer is sparse (no dense MLP layers);
- optional sliding window (`config.sliding_window`): the static-cache step attends to every cached position, so a
  call that could hold more than the window falls back to transformers (`check_positions`), never wrong tokens.
Same as Qwen3-MoE: pre-norm layers (input_layernorm, post_attention_layernorm), GQA, fused 3D experts dispatched
through moegraph's experts (the ExpertsInterface implementation the prefill uses too).

Every shape is fixed by the row count and the cache size and nothing syncs with the host: this function is what
each bucket's graph captures, and also what the eager loop runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from ._shared import (gqa_attention, moe_gate_weight, prenorm_decode_forward, rows_of_cache, sliding_window_check,
                      softmax_topk_experts)

if TYPE_CHECKING:
    from ..cuda_graph.static_cache import StaticKVCache


check_positions = sliding_window_check


def decode_forward(model: nn.Module, cache: StaticKVCache, token_ids: torch.Tensor, positions: torch.Tensor,
                   ops, rope_positions: torch.Tensor | None = None, cache_rows: torch.Tensor | None = None,
                   logit_rows: torch.Tensor | None = None) -> torch.Tensor:
    """One step for every row (moegraph.models._shared.prenorm_decode_forward): RoPE-only attention, MoE blocks."""
    return prenorm_decode_forward(model, cache, token_ids, positions, ops, rope_positions, _attention, decode_moe,
                                  cache_rows=cache_rows, logit_rows=logit_rows,
                                  router_weight=moe_gate_weight)


def _attention(attn: nn.Module, qkv: tuple[torch.Tensor, ...], cos, sin, positions, key_cache, value_cache,
               ops, cache_rows=None) -> torch.Tensor:
    q, k, v = qkv
    rows = q.shape[0]
    key_cache, value_cache = rows_of_cache(key_cache, value_cache, rows, cache_rows)
    # no q/k-norm: RoPE only, K/V written at `positions`
    q = ops.qk_norm_rope(q, k, v, None, None, cos, sin, positions, key_cache, value_cache, None,
                         cache_rows=cache_rows)  # [b, Hq, D]
    return gqa_attention(attn, q, key_cache, value_cache, positions, ops, cache_rows=cache_rows)


def decode_moe(block: nn.Module, hidden: torch.Tensor, ops,
               router_logits: torch.Tensor | None = None) -> torch.Tensor:
    """MixtralSparseMoeBlock for [b, H] decode rows (eval: no jitter noise): always renormalised, weights float32."""
    return softmax_topk_experts(block, hidden, ops, router_logits, normalize=True, weights_dtype=torch.float32)

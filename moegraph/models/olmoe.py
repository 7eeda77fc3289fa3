"""OLMoE (OLMoE-1B-7B): one decode step over the static cache, one new token per row -> logits.

What differs from Qwen3-MoE (models/qwen3_moe.py), per transformers' modeling_olmoe.py:
- attention: q_norm and k_norm are RMSNorms over the whole q and k projections ([b, Hq*D] and [b, Hkv*D], one
  variance per row, not per head), applied before the reshape to heads; moegraph's rms_norm op over those rows,
  then RoPE + cache write through the fused q/k-norm + RoPE op with its norm weights None (as Mixtral);
- `config.clip_qkv` (when set): q, k (after their norms) and v clamped to [-clip_qkv, clip_qkv] before RoPE, as
  transformers does (an elementwise clamp in the same dtype: exact);
- router: OlmoeTopKRouter, softmax in float32 over all experts, top-k (8 of 64), renormalised only with
  `norm_topk_prob` (False in OLMoE's configs), the weights cast back to the logits' dtype (as Qwen3-MoE);
- every layer is sparse, no shared experts;
- a `config.sliding_window` set by hand (no OLMoE config has one; transformers' DynamicCache then keeps only the
  last sliding_window - 1 positions): the static-cache step attends to every cached position, so a call that could
  hold more than the window falls back to transformers (`check_positions`), never wrong tokens.
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
    """One step for every row (moegraph.models._shared.prenorm_decode_forward): whole-projection q/k-norm
    attention, MoE blocks."""
    return prenorm_decode_forward(model, cache, token_ids, positions, ops, rope_positions, _attention, decode_moe,
                                  cache_rows=cache_rows, logit_rows=logit_rows,
                                  router_weight=moe_gate_weight)


def _attention(attn: nn.Module, qkv: tuple[torch.Tensor, ...], cos, sin, positions, key_cache, value_cache,
               ops, cache_rows=None) -> torch.Tensor:
    q, k, v = qkv  # [b, Hq*D], [b, Hkv*D], [b, Hkv*D]
    rows = q.shape[0]
    key_cache, value_cache = rows_of_cache(key_cache, value_cache, rows, cache_rows)
    q = ops.rms_norm(q, attn.q_norm.weight, attn.q_norm.variance_epsilon)  # over all Hq*D of a row
    k = ops.rms_norm(k, attn.k_norm.weight, attn.k_norm.variance_epsilon)  # over all Hkv*D of a row
    clip = attn.config.clip_qkv
    if clip is not None:
        q, k, v = q.clamp(-clip, clip), k.clamp(-clip, clip), v.clamp(-clip, clip)
    # the norms are done: RoPE only, K/V written at `positions`
    q = ops.qk_norm_rope(q, k, v, None, None, cos, sin, positions, key_cache, value_cache, None,
                         cache_rows=cache_rows)  # [b, Hq, D]
    return gqa_attention(attn, q, key_cache, value_cache, positions, ops, cache_rows=cache_rows)


def decode_moe(block: nn.Module, hidden: torch.Tensor, ops,
               router_logits: torch.Tensor | None = None) -> torch.Tensor:
    """OlmoeSparseMoeBlock for [b, H] decode rows (renormalised only with norm_topk_prob)."""
    return softmax_topk_experts(block, hidden, ops, router_logits)

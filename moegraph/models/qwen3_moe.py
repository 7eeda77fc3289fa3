"""Qwen3-MoE (and its family: Qwen3-30B-A3B, Qwen3-235B-A22B): one decode step over the static cache, one new
token per row -> logits.

Every shape is fixed by the row count and the cache size and nothing syncs with the host: this
function is what each bucket's graph captures, and also what the eager loop runs. It reuses the
model's own weights (never copied); on CUDA it runs moegraph's fused Triton kernels, elsewhere
their plain-torch references, which compute what transformers' modules compute.

Per layer: add+RMSNorm, q/k/v projections, one fused q/k-norm + RoPE + cache-write kernel,
attention over the row's cached positions, o projection, add+RMSNorm, MoE (or dense MLP).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from ._shared import gqa_attention, moe_gate_weight, prenorm_decode_forward, rows_of_cache, softmax_topk_experts

if TYPE_CHECKING:
    from ..cuda_graph.static_cache import StaticKVCache


def decode_forward(model: nn.Module, cache: StaticKVCache, token_ids: torch.Tensor, positions: torch.Tensor,
                   ops, rope_positions: torch.Tensor | None = None, cache_rows: torch.Tensor | None = None,
                   logit_rows: torch.Tensor | None = None) -> torch.Tensor:
    """One step for every row (moegraph.models._shared.prenorm_decode_forward): q/k-norm attention, MoE blocks
    (dense MLP layers, `mlp_only_layers`, through their own module)."""
    return prenorm_decode_forward(model, cache, token_ids, positions, ops, rope_positions, _attention, _mlp,
                                  cache_rows=cache_rows, logit_rows=logit_rows,
                                  router_weight=moe_gate_weight)


def _attention(attn: nn.Module, qkv: tuple[torch.Tensor, ...], cos, sin, positions, key_cache, value_cache,
               ops, cache_rows=None) -> torch.Tensor:
    q, k, v = qkv
    rows = q.shape[0]
    key_cache, value_cache = rows_of_cache(key_cache, value_cache, rows, cache_rows)
    # [b, Hq, D]; K/V written at `positions` (of each row's cache row)
    q = ops.qk_norm_rope(q, k, v, attn.q_norm.weight, attn.k_norm.weight, cos, sin, positions, key_cache,
                         value_cache, attn.q_norm.variance_epsilon, cache_rows=cache_rows)
    return gqa_attention(attn, q, key_cache, value_cache, positions, ops, cache_rows=cache_rows)


def _mlp(mlp: nn.Module, hidden: torch.Tensor, ops,
         router_logits: torch.Tensor | None = None) -> torch.Tensor:
    return decode_moe(mlp, hidden, ops, router_logits) if hasattr(mlp, "experts") else mlp(hidden)


def decode_moe(block: nn.Module, hidden: torch.Tensor, ops,
               router_logits: torch.Tensor | None = None) -> torch.Tensor:
    """The sparse block for [b, H] decode rows: softmax top-k, renormalised with norm_topk_prob."""
    return softmax_topk_experts(block, hidden, ops, router_logits)

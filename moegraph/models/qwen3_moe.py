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

if TYPE_CHECKING:
    from ..cuda_graph.static_cache import StaticKVCache


def decode_forward(model: nn.Module, cache: StaticKVCache, token_ids: torch.Tensor, positions: torch.Tensor,
                   ops, rope_positions: torch.Tensor | None = None) -> torch.Tensor:
    """token_ids, positions: [b] (position = index in the row's compact cache). Returns logits [b, V] float32.

    rope_positions [b]: the position ids RoPE uses, where they differ from `positions` (transformers
    counts a right-padded or custom-positioned row differently from its compact index); None: the same.
    ops: the OpTable (moegraph.ops) chosen for this model when the decoder was built."""
    inner = model.model
    layers = inner.layers
    residual = inner.embed_tokens(token_ids)  # [b, H]
    rope_positions = positions if rope_positions is None else rope_positions
    cos, sin = inner.rotary_emb(residual[:, None], rope_positions[:, None])  # [b, 1, D]
    # [b, 1, 1, S] additive mask, built once per step (a boolean mask would be converted in every layer):
    # position p is visible to a row once p <= the row's current position
    visible = torch.arange(cache.positions, device=positions.device)[None, :] <= positions[:, None]
    visible = torch.zeros(visible.shape, dtype=residual.dtype, device=residual.device).masked_fill_(
        ~visible, float("-inf"))[:, None, None, :]
    first_norm = layers[0].input_layernorm
    hidden = ops.rms_norm(residual, first_norm.weight, first_norm.variance_epsilon)
    for layer_idx, layer in enumerate(layers):
        attn_out = _attention(layer.self_attn, hidden, cos, sin, positions, visible,
                              cache.keys[layer_idx], cache.values[layer_idx], ops)
        post = layer.post_attention_layernorm
        residual, hidden = ops.add_rms_norm(residual, attn_out, post.weight, post.variance_epsilon)
        if hasattr(layer.mlp, "experts"):
            mlp_out = decode_moe(layer.mlp, hidden, ops)
        else:
            mlp_out = layer.mlp(hidden)
        norm = layers[layer_idx + 1].input_layernorm if layer_idx + 1 < len(layers) else inner.norm
        residual, hidden = ops.add_rms_norm(residual, mlp_out, norm.weight, norm.variance_epsilon)
    return ops.linear(model.lm_head, hidden).float()


def _attention(attn: nn.Module, hidden: torch.Tensor, cos, sin, positions, visible, key_cache, value_cache,
               ops) -> torch.Tensor:
    rows = hidden.shape[0]
    head_dim = attn.head_dim
    key_cache, value_cache = key_cache[:rows], value_cache[:rows]
    q, k, v = ops.qkv(attn, hidden)
    q = ops.qk_norm_rope(q, k, v, attn.q_norm.weight, attn.k_norm.weight, cos, sin, positions, key_cache,
                         value_cache, attn.q_norm.variance_epsilon)  # [b, Hq, D]; K/V written at `positions`
    # One query token per row: fold the query heads of each KV group into the query-length axis,
    # so attention reads each cached K/V once instead of expanding it per query head.
    q = q.reshape(rows, key_cache.shape[1], -1, head_dim)  # [b, Hkv, G, D]
    out = nn.functional.scaled_dot_product_attention(q, key_cache, value_cache, attn_mask=visible,
                                                     scale=attn.scaling)
    return ops.linear(attn.o_proj, out.reshape(rows, -1))  # [b, H]


def decode_moe(block: nn.Module, hidden: torch.Tensor, ops) -> torch.Tensor:
    """The sparse block for [b, H] decode rows. Skips the router module call: no router logits are recorded."""
    gate = block.gate
    router_logits = nn.functional.linear(hidden, gate.weight)  # [b, E]
    top_k_weights, top_k_index = ops.router_topk(router_logits, gate.top_k, gate.norm_topk_prob)
    return ops.experts(hidden, top_k_index, top_k_weights, block.experts, ops=ops)

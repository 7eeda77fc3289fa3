"""One decode step of a Qwen3-MoE causal LM over the static cache: new token per row -> logits.

Every shape is fixed by the row count and the cache size, nothing syncs with the host, and the
cache write is an index_put at per-row positions: the function is what each bucket's graph
captures, and also what the eager loop runs.
Reuses the model's own modules (norms, projections, MoE block, which may be moegraph's patched
block or bitsandbytes layers), so weights are never copied.
"""

from __future__ import annotations

import torch
from torch import nn

from .static_cache import StaticKVCache


def decode_forward(model: nn.Module, apply_rotary, cache: StaticKVCache, token_ids: torch.Tensor,
                   positions: torch.Tensor) -> torch.Tensor:
    """token_ids, positions: [b] (position = index in the row's compact cache). Returns logits [b, V] float32."""
    inner = model.model
    rows = token_ids.shape[0]
    hidden = inner.embed_tokens(token_ids[:, None])  # [b, 1, H]
    cos, sin = inner.rotary_emb(hidden, positions[:, None])  # [b, 1, D]
    # [b, 1, 1, S]: position p is visible to a row once p <= the row's current position
    visible = (torch.arange(cache.positions, device=positions.device)[None, :] <= positions[:, None])[:, None, None, :]
    row_index = torch.arange(rows, device=token_ids.device)
    for layer_idx, layer in enumerate(inner.layers):
        attn_out = _attention(layer.self_attn, layer.input_layernorm(hidden), cos, sin, apply_rotary,
                              cache.keys[layer_idx][:rows], cache.values[layer_idx][:rows],
                              row_index, positions, visible)
        hidden = hidden + attn_out
        hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
    hidden = inner.norm(hidden)
    return model.lm_head(hidden[:, 0]).float()


def _attention(attn: nn.Module, hidden: torch.Tensor, cos, sin, apply_rotary, keys: torch.Tensor,
               values: torch.Tensor, row_index: torch.Tensor, positions: torch.Tensor,
               visible: torch.Tensor) -> torch.Tensor:
    rows = hidden.shape[0]
    head_dim = attn.head_dim
    kv_heads = keys.shape[1]
    q = attn.q_norm(attn.q_proj(hidden).view(rows, 1, -1, head_dim)).transpose(1, 2)  # [b, Hq, 1, D]
    k = attn.k_norm(attn.k_proj(hidden).view(rows, 1, -1, head_dim)).transpose(1, 2)  # [b, Hkv, 1, D]
    v = attn.v_proj(hidden).view(rows, 1, -1, head_dim).transpose(1, 2)
    q, k = apply_rotary(q, k, cos, sin)
    keys[row_index, :, positions] = k[:, :, 0]
    values[row_index, :, positions] = v[:, :, 0]
    # One query token per row: fold the query heads of each KV group into the query-length axis,
    # so attention reads each cached K/V once instead of expanding it per query head.
    q = q.reshape(rows, kv_heads, -1, head_dim)  # [b, Hkv, G, D]
    out = nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=visible, scale=attn.scaling)
    return attn.o_proj(out.reshape(rows, 1, -1))  # [b, 1, H]

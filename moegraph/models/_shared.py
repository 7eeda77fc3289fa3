"""Pieces of a decode step that pre-norm MoE families share: the layer loop, the causal mask, GQA attention.

A family's module supplies what differs (its attention's q/k treatment, its MoE block) and calls
`prenorm_decode_forward`; every shape is fixed by the row count and the cache size, nothing syncs with the host.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch
from torch import nn

if TYPE_CHECKING:
    from ..cuda_graph.static_cache import StaticKVCache

# (attention module, (q, k, v) projected rows, cos, sin, positions, key_cache, value_cache, ops, cache_rows=None)
# -> [b, H]
Attention = Callable[..., torch.Tensor]
# (MLP module, hidden [b, H], ops) -> [b, H]; with a RouterWeight, also router_logits=[b, E] or None (compute them)
Mlp = Callable[..., torch.Tensor]
# MLP module -> the weight [E, H] of its router's logits (hidden @ weight.T, no bias) or None (a dense MLP, or
# a router computed otherwise): where given, the norm before the MLP runs inside the router's GEMV
RouterWeight = Callable[[nn.Module], "torch.Tensor | None"]
# (norm module, residual [b, H], x [b, H] or None, ops) -> (residual + x, norm(residual + x)); x None: no add
AddNorm = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def add_rms_norm(norm: nn.Module, residual: torch.Tensor, x: torch.Tensor | None, ops):
    """The fused add + RMSNorm op (Qwen's rounding: normalized in float32, rounded, times the weight)."""
    if x is None:
        return residual, ops.rms_norm(residual, norm.weight, norm.variance_epsilon)
    return ops.add_rms_norm(residual, x, norm.weight, norm.variance_epsilon)


def _norm_qkv(add_norm: AddNorm, norm: nn.Module, attn: nn.Module, residual: torch.Tensor, x: torch.Tensor | None,
              ops) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """The norm before attention and the q/k/v projections: (residual + x, (q, k, v)). With the standard add +
    RMSNorm, ops.add_norm_qkv (one launch at decode batch sizes on CUDA)."""
    if add_norm is add_rms_norm:
        return ops.add_norm_qkv(norm, residual, x, attn)
    residual, hidden = add_norm(norm, residual, x, ops)
    return residual, ops.qkv(attn, hidden)


def moe_gate_weight(mlp: nn.Module) -> torch.Tensor | None:
    """RouterWeight of the blocks whose `gate` is a plain linear router (Qwen, Mixtral, OLMoE)."""
    return mlp.gate.weight if hasattr(mlp, "experts") else None


def softmax_topk_experts(block: nn.Module, hidden: torch.Tensor, ops, router_logits: torch.Tensor | None = None,
                         normalize: bool | None = None, weights_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The routed experts of a block whose `gate` is a linear softmax top-k router (Qwen3, Qwen2, Qwen3-VL, Mixtral,
    OLMoE) for [b, H] decode rows: logits (unless the norm's fused GEMV gave them: ops.add_norm_router), softmax in
    float32, top-k, renormalised when `normalize` (None: the gate's norm_topk_prob), weights in weights_dtype (None:
    the logits'). Skips the router module call: no router logits are recorded."""
    gate = block.gate
    if router_logits is None:
        router_logits = ops.router_logits(hidden, gate.weight)  # [b, E]
    normalize = gate.norm_topk_prob if normalize is None else normalize
    top_k_weights, top_k_index = ops.router_topk(router_logits, gate.top_k, normalize, weights_dtype=weights_dtype)
    return ops.experts(hidden, top_k_index, top_k_weights, block.experts, ops=ops)


def _norm_mlp(add_norm: AddNorm, router_weight: RouterWeight | None, mlp: Mlp, norm: nn.Module, module: nn.Module,
              residual: torch.Tensor, x: torch.Tensor, ops) -> tuple[torch.Tensor, torch.Tensor]:
    """The norm before the MLP and the MLP: (residual + x, mlp output). With the standard add + RMSNorm and a
    linear router, ops.add_norm_router computes the norm and the router logits together."""
    weight = router_weight(module) if router_weight is not None and add_norm is add_rms_norm else None
    if weight is None:
        residual, hidden = add_norm(norm, residual, x, ops)
        return residual, mlp(module, hidden, ops)
    residual, hidden, router_logits = ops.add_norm_router(norm, residual, x, weight)
    return residual, mlp(module, hidden, ops, router_logits=router_logits)


def prenorm_decode_forward(model: nn.Module, cache: StaticKVCache, token_ids: torch.Tensor, positions: torch.Tensor,
                           ops, rope_positions: torch.Tensor | None, attention: Attention, mlp: Mlp,
                           text_model: nn.Module | None = None, rope_components: int = 1,
                           add_norm: AddNorm = add_rms_norm, cache_rows: torch.Tensor | None = None,
                           logit_rows: torch.Tensor | None = None,
                           router_weight: RouterWeight | None = None) -> torch.Tensor:
    """token_ids, positions: [b] (position = index in the row's compact cache). Returns logits [b, V] float32.

    text_model: the decoder stack (layers, embed_tokens, norm, rotary_emb), where it is not `model.model` (e.g.
    Qwen3-VL-MoE's `model.model.language_model`); `model.lm_head` gives the logits either way.
    rope_components: position ids per token that its rotary embedding takes (3 for multimodal RoPE, given equal
    here: text-only rows; transformers before 5.25 takes only the [3, b, 1] form).

    rope_positions [b]: the position ids RoPE uses, where they differ from `positions` (transformers counts a
    right-padded or custom-positioned row differently from its compact index); None: the same.
    add_norm: the residual add and the norm after it (default: the fused op; GPT-OSS rounds its norm otherwise).
    cache_rows [b]: the cache row of each row's token (None: row i is cache row i); with it the rows can be the
    tokens of prompts, several per cache row, each attending to its row's positions up to its own (a prefill).
    logit_rows: the rows whose logits are returned (None: all), e.g. each prompt's last token.
    router_weight: where a layer's MLP has a linear router, its weight (the MLP then takes router_logits=).
    Per layer: add+RMSNorm with q/k/v, attention, add+RMSNorm, MLP; the residual adds are fused into the next
    norm."""
    inner = model.model if text_model is None else text_model
    layers = inner.layers
    residual = inner.embed_tokens(token_ids)  # [b, H]
    rope_positions = positions if rope_positions is None else rope_positions
    position_ids = rope_positions[:, None] if rope_components == 1 else rope_positions[None, :, None].expand(
        rope_components, -1, -1)
    cos, sin = inner.rotary_emb(residual[:, None], position_ids)  # [b, 1, D]
    mlp_out = None  # the first layer's norm adds nothing
    for layer_idx, layer in enumerate(layers):
        residual, qkv = _norm_qkv(add_norm, layer.input_layernorm, layer.self_attn, residual, mlp_out, ops)
        attn_out = attention(layer.self_attn, qkv, cos, sin, positions, cache.keys[layer_idx],
                             cache.values[layer_idx], ops, cache_rows=cache_rows)
        residual, mlp_out = _norm_mlp(add_norm, router_weight, mlp, layer.post_attention_layernorm, layer.mlp,
                                      residual, attn_out, ops)
    residual, hidden = add_norm(inner.norm, residual, mlp_out, ops)
    if logit_rows is not None:
        hidden = hidden.index_select(0, logit_rows)
    return ops.linear(model.lm_head, hidden).float()


def rows_of_cache(key_cache: torch.Tensor, value_cache: torch.Tensor, rows: int,
                  cache_rows: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The caches the ops see: the first `rows` cache rows when row i is cache row i, else all of them (the ops
    find each row's through cache_rows)."""
    if cache_rows is None:
        return key_cache[:rows], value_cache[:rows]
    return key_cache, value_cache


def gqa_attention(attn: nn.Module, q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                  positions: torch.Tensor, ops, window: int | None = None,
                  sinks: torch.Tensor | None = None, cache_rows: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of one query token per row over its cached positions 0..positions[row], then o_proj:
    [b, Hq, D] -> [b, H]. ops.decode_attention reads each KV head once for its GQA group of query heads (and on
    CUDA only the row's live positions, however large the cache)."""
    rows = q.shape[0]
    key_cache, value_cache = rows_of_cache(key_cache, value_cache, rows, cache_rows)
    out = ops.decode_attention(q, key_cache, value_cache, positions, attn.scaling, window, sinks,
                               cache_rows=cache_rows)
    return ops.linear(attn.o_proj, out.reshape(rows, -1))


def sliding_window_check(model: nn.Module, positions: int) -> str | None:
    """A family's `check_positions` for a `config.sliding_window` that applies to every layer: None when a call
    holding up to `positions` cache positions (prompt, padding included, + new tokens) decodes exactly, else why not.

    transformers' sliding layers keep the last sliding_window - 1 positions and let each query see sliding_window
    keys; below that bound the window changes nothing and the static cache's full-attention step is exact."""
    window = getattr(model.config, "sliding_window", None)
    if window is not None and positions > window:
        return (f"sliding_window={window} with a call that could hold {positions} positions (the decode step "
                "attends to every cached position; calls within the window take the fast path)")
    return None

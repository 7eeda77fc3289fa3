"""GPT-OSS (gpt-oss-20b, gpt-oss-120b): one decode step over the static cache, one new token per row -> logits.

What differs from Qwen3-MoE (models/qwen3_moe.py), per transformers' modeling_gpt_oss.py (5.17 and 5.25 alike):
- attention: q/k/v/o projections with biases (applied by ops.qkv / ops.linear like the weights), no q/k-norm; RoPE
  (YaRN, its attention scaling already in the rotary embedding's cos/sin) on the two halves of each head: cos/sin
  come as [b, 1, D/2] and are repeated to [b, 1, D] for the fused RoPE + cache-write op, whose
  x * cos + rotate_half(x) * sin is transformers' (first * cos - second * sin, second * cos + first * sin) exactly;
- attention sinks: a learned logit per query head (`self_attn.sinks`) joins each softmax's denominator, no value
  follows it (ops.decode_attention's `sinks`);
- alternating layers (`config.layer_types`): "sliding_attention" layers see the last `sliding_window` positions
  (the current one included), "full_attention" layers all of them. The static cache keeps every position in every
  layer and a sliding layer passes `window=` to the attention: exact for any length. transformers counts the window
  in columns of the padded batch, which equal a row's compact positions when the padding is on the left; a call
  whose attention_mask pads elsewhere and that could outgrow the window falls back (`check_prompt`);
- RMSNorm multiplies by its weight in float32 before rounding (and the checkpoints keep the norms in float32,
  `_keep_in_fp32_modules`): the norms run as the model's own modules, not the fused Qwen-rounding kernel;
- router (GptOssTopKRouter): linear with a bias, top-k of the logits, softmax over the k picked, in the logits'
  dtype; no router logits are recorded;
- experts (GptOssExperts): gate_up_proj [E, H, 2I] (transposed), gate/up interleaved in its columns, biases,
  the clamped SwiGLU `(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)` with g = clamp(gate, max=limit). The
  fused Triton experts compute Qwen's SwiGLU without biases, so every moegraph backend runs these experts through
  moegraph's grouped_mm path in the module's own layout (moe/grouped_mm.py layout_grouped_experts: fixed shapes,
  no host sync, the gate the module's own `_apply_gate`), in the decode step and in the prefill alike;
- MXFP4 checkpoints: dequantized to bf16 at load (`Mxfp4Config(dequantize=True)`, what transformers does anyway
  without its MXFP4 kernels); experts of any other class (transformers' Mxfp4GptOssExperts) fall back.
Same as Qwen3-MoE: pre-norm layers (input_layernorm, post_attention_layernorm), GQA, every layer sparse.

Every shape is fixed by the row count and the cache size and nothing syncs with the host: this function is what
each bucket's graph captures, and also what the eager loop runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from ._shared import gqa_attention, prenorm_decode_forward, rows_of_cache

if TYPE_CHECKING:
    from ..cuda_graph.static_cache import StaticKVCache


def check_positions(model: nn.Module, positions: int) -> str | None:
    """None when the decode step computes what transformers computes for this model, else why not: experts with
    dense floating-point 3-D weights (not transformers' Mxfp4GptOssExperts, whose gate_up_proj holds packed uint8
    blocks). Any length decodes exactly."""
    experts = model.model.layers[0].mlp.experts
    weights = experts._parameters.get("gate_up_proj")
    if weights is None or weights.dim() != 3 or not weights.is_floating_point():
        return (f"experts of type {type(experts).__name__} (MXFP4 weights: load with "
                "quantization_config=Mxfp4Config(dequantize=True) for moegraph's bf16 decode step)")
    return None


def check_prompt(model: nn.Module, attention_mask: torch.Tensor | None, positions: int) -> str | None:
    """None when a call of this attention_mask [n, width] (cache + input) holding up to `positions` positions
    decodes exactly, else why not: a sliding window counts padded columns in transformers, compact positions here;
    the two agree for left padding, or while no row could outgrow the window. One host sync per call."""
    window = model.config.sliding_window
    if attention_mask is None or window is None or positions <= window:
        return None
    if bool((attention_mask[:, 1:] < attention_mask[:, :-1]).any()):
        return (f"an attention_mask with padding after a row's first token (not left padding) in a call of "
                f"{positions} positions, past sliding_window={window}")
    return None


def decode_forward(model: nn.Module, cache: StaticKVCache, token_ids: torch.Tensor, positions: torch.Tensor,
                   ops, rope_positions: torch.Tensor | None = None, cache_rows: torch.Tensor | None = None,
                   logit_rows: torch.Tensor | None = None) -> torch.Tensor:
    """One step for every row (moegraph.models._shared.prenorm_decode_forward): biased attention with sinks,
    sliding-window layers where `layer_types` puts them, GPT-OSS's RMSNorm, MoE blocks with a biased router."""
    return prenorm_decode_forward(model, cache, token_ids, positions, ops, rope_positions, _attention, decode_moe,
                                  add_norm=_add_norm, cache_rows=cache_rows, logit_rows=logit_rows)


def _add_norm(norm: nn.Module, residual: torch.Tensor, x: torch.Tensor | None, ops):
    """GptOssRMSNorm after the residual add (x None: the first norm, no add), as the decoder layer does it."""
    residual = residual if x is None else residual + x
    return residual, norm(residual)


def _attention(attn: nn.Module, qkv: tuple[torch.Tensor, ...], cos, sin, positions, key_cache, value_cache,
               ops, cache_rows=None) -> torch.Tensor:
    q, k, v = qkv  # with q/k/v biases
    rows = q.shape[0]
    key_cache, value_cache = rows_of_cache(key_cache, value_cache, rows, cache_rows)
    cos, sin = torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1)  # [b, 1, D/2] -> [b, 1, D]
    q = ops.qk_norm_rope(q, k, v, None, None, cos, sin, positions, key_cache, value_cache, None,
                         cache_rows=cache_rows)  # [b, Hq, D]
    return gqa_attention(attn, q, key_cache, value_cache, positions, ops, window=attn.sliding_window,
                         sinks=attn.sinks, cache_rows=cache_rows)


def route(router: nn.Module, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """GptOssTopKRouter without the module call: hidden [T, H] -> (weights [T, K] in the logits' dtype, index
    [T, K]): top-k of the biased logits, softmax over the k picked."""
    logits = nn.functional.linear(hidden, router.weight, router.bias)  # [T, E]
    top_values, index = torch.topk(logits, router.top_k, dim=-1)
    return torch.softmax(top_values, dim=1, dtype=top_values.dtype), index


def decode_moe(block: nn.Module, hidden: torch.Tensor, ops) -> torch.Tensor:
    """GptOssMLP for [b, H] decode rows (its router scores, the block's second output, are not needed)."""
    weights, index = route(block.router, hidden)
    return ops.experts(hidden, index, weights, block.experts, ops=ops)

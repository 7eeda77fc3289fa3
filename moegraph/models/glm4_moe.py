"""GLM-4.5 / GLM-4.6 MoE (GLM-4.5-Air, GLM-4.5, GLM-4.6): one decode step over the static cache, one new token per
row -> logits.

What differs from Qwen3-MoE (models/qwen3_moe.py), per transformers' modeling_glm4_moe.py:
- attention: q/k/v projections with a bias when `attention_bias` (applied by ops.qkv like the weights); per-head
  q_norm / k_norm RMSNorms only when `use_qk_norm` (GLM-4.5-Air: off);
- partial RoPE (`partial_rotary_factor`, 0.5 in every released config): the rotary embedding's cos/sin cover only
  the first `rotary_dim` dims of each head, and rotate_half pairs dim i with i + rotary_dim/2 inside that slice;
  the rest pass through. The fused q/k-norm + RoPE + cache-write op pairs i with i + head_dim/2, so with a partial
  factor the norm (moegraph's rms_norm op per head) and the rotation of the rotated slice run here in torch, rounding
  where transformers rounds, and the fused op then writes K/V with an identity rotation (cos 1, sin 0: exact).
  A factor of 1 takes the fused op as Qwen3-MoE does;
- router: Glm4MoeTopkRouter, computed here in plain torch ops in float32 (its fp32 weight; the same op sequence as
  transformers, so the same experts and weights): sigmoid scores, `e_score_correction_bias` added for the selection
  only, grouped top-k (each of `n_group` groups scored by the sum of its two best biased scores, the `topk_group`
  best groups kept, top-k over their experts), the unbiased scores of the picks gathered, renormalised when
  `norm_topk_prob` (sum + 1e-20), times `routed_scaling_factor`; the weights stay float32 (as transformers);
  topk / scatter / gather / masked_fill only: fixed shapes, no host sync;
- shared experts: a dense SwiGLU MLP (`shared_experts`, width moe_intermediate_size * n_shared_experts) added,
  ungated, to the routed experts' output;
- dense Glm4MoeMLP layers below `first_k_dense_replace`.
Same as Qwen3-MoE: pre-norm layers, GQA, full attention in every layer (no sliding window), fused 3D experts
(Glm4MoeExperts, decorated with use_experts_implementation) dispatched through moegraph's experts (the
ExpertsInterface implementation the prefill uses too). The MTP layers of the checkpoints are not loaded by
transformers (`_keys_to_ignore_on_load_unexpected`) and play no part in generate().

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
    """None when a call holding up to `positions` cache positions decodes exactly here, else why not.

    GLM-4-MoE attends to every position in every layer; what the step does not cover is a rotary slice it cannot
    rotate as transformers does (odd, or wider than a head: transformers' own rotate_half would not pair it)."""
    attn = model.model.layers[0].self_attn
    rotary = rotary_dim(model)
    if rotary % 2 or not 0 < rotary <= attn.head_dim:
        return f"a rotary slice of {rotary} dims for head_dim {attn.head_dim} (partial_rotary_factor)"
    return None


def rotary_dim(model: nn.Module) -> int:
    """The dims of each head that RoPE rotates: twice the rotary embedding's inverse frequencies."""
    return 2 * model.model.rotary_emb.inv_freq.shape[-1]


def decode_forward(model: nn.Module, cache: StaticKVCache, token_ids: torch.Tensor, positions: torch.Tensor,
                   ops, rope_positions: torch.Tensor | None = None, cache_rows: torch.Tensor | None = None,
                   logit_rows: torch.Tensor | None = None) -> torch.Tensor:
    """One step for every row (moegraph.models._shared.prenorm_decode_forward): partial-RoPE attention with optional
    q/k-norm and q/k/v biases, MoE blocks with grouped sigmoid routing and shared experts (dense MLP layers first)."""
    return prenorm_decode_forward(model, cache, token_ids, positions, ops, rope_positions, _attention, _mlp,
                                  cache_rows=cache_rows, logit_rows=logit_rows)


def _attention(attn: nn.Module, qkv: tuple[torch.Tensor, ...], cos, sin, positions, key_cache, value_cache,
               ops, cache_rows=None) -> torch.Tensor:
    q, k, v = qkv  # with q/k/v biases when attention_bias
    rows, head_dim = q.shape[0], attn.head_dim
    key_cache, value_cache = rows_of_cache(key_cache, value_cache, rows, cache_rows)
    norms = (attn.q_norm, attn.k_norm) if attn.use_qk_norm else None
    if cos.shape[-1] == head_dim:  # whole-head RoPE: the fused op norms, rotates and writes K/V
        q_w, k_w, eps = (norms[0].weight, norms[1].weight, norms[0].variance_epsilon) if norms else (None, None, None)
        q = ops.qk_norm_rope(q, k, v, q_w, k_w, cos, sin, positions, key_cache, value_cache, eps, cache_rows=cache_rows)
        return gqa_attention(attn, q, key_cache, value_cache, positions, ops, cache_rows=cache_rows)
    q, k = q.reshape(rows, -1, head_dim), k.reshape(rows, -1, head_dim)  # [b, Hq, D], [b, Hkv, D]
    if norms:
        q = ops.rms_norm(q, norms[0].weight, norms[0].variance_epsilon).reshape(rows, -1, head_dim)  # per head
        k = ops.rms_norm(k, norms[1].weight, norms[1].variance_epsilon).reshape(rows, -1, head_dim)
    q, k = partial_rope(q, cos, sin), partial_rope(k, cos, sin)
    identity_cos = torch.ones(rows, head_dim, dtype=q.dtype, device=q.device)
    identity_sin = torch.zeros(rows, head_dim, dtype=q.dtype, device=q.device)
    # rotation done: x * 1 + rotate_half(x) * 0 == x exactly; the op writes K/V at `positions` and returns q
    q = ops.qk_norm_rope(q.reshape(rows, -1), k.reshape(rows, -1), v, None, None, identity_cos, identity_sin,
                         positions, key_cache, value_cache, None, cache_rows=cache_rows)  # [b, Hq, D]
    return gqa_attention(attn, q, key_cache, value_cache, positions, ops, cache_rows=cache_rows)


def partial_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' apply_rotary_pos_emb for one of q/k: x [b, H, D], cos/sin [b, 1, R] (R <= D) -> [b, H, D];
    the first R dims rotated (rotate_half within them), the rest passed through, the same ops in the same order."""
    rows, rotary = x.shape[0], cos.shape[-1]
    cos, sin = cos.reshape(rows, 1, rotary), sin.reshape(rows, 1, rotary)
    x_rot, x_pass = x[..., :rotary], x[..., rotary:]
    half = rotary // 2
    rotated = x_rot * cos + torch.cat((-x_rot[..., half:], x_rot[..., :half]), dim=-1) * sin
    return torch.cat([rotated, x_pass], dim=-1)


def _mlp(mlp: nn.Module, hidden: torch.Tensor, ops) -> torch.Tensor:
    return decode_moe(mlp, hidden, ops) if hasattr(mlp, "experts") else dense_mlp(mlp, hidden, ops)


def dense_mlp(mlp: nn.Module, hidden: torch.Tensor, ops) -> torch.Tensor:
    """Glm4MoeMLP (a dense first layer, or a block's shared experts) with its projections through the op table."""
    gate, up = ops.linear(mlp.gate_proj, hidden), ops.linear(mlp.up_proj, hidden)  # [b, I] each
    return ops.linear(mlp.down_proj, mlp.act_fn(gate) * up)


def route(gate: nn.Module, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Glm4MoeTopkRouter without the module call (no router logits recorded): hidden [T, H] -> (weights [T, K]
    float32, index [T, K] int64). Capture-safe: fixed shapes, no host sync."""
    experts, groups = gate.num_experts, gate.num_group
    logits = nn.functional.linear(hidden.float(), gate.weight.float())  # [T, E]
    scores = logits.sigmoid()
    for_choice = scores + gate.e_score_correction_bias  # the bias picks experts, never weighs them
    group_scores = for_choice.view(-1, groups, experts // groups).topk(2, dim=-1)[0].sum(dim=-1)  # [T, G]
    group_idx = torch.topk(group_scores, k=gate.topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
    score_mask = group_mask.unsqueeze(-1).expand(-1, groups, experts // groups).reshape(-1, experts)
    for_choice = for_choice.masked_fill(~score_mask.bool(), float("-inf"))
    index = torch.topk(for_choice, k=gate.top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, index)
    if gate.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * gate.routed_scaling_factor, index


def decode_moe(block: nn.Module, hidden: torch.Tensor, ops) -> torch.Tensor:
    """Glm4MoeMoE for [b, H] decode rows: routed experts plus the shared experts."""
    weights, index = route(block.gate, hidden)
    routed = ops.experts(hidden, index, weights, block.experts, ops=ops)
    return routed + dense_mlp(block.shared_experts, hidden, ops)

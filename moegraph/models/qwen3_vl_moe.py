"""Qwen3-VL-MoE (Qwen3-VL-30B-A3B, Qwen3-VL-235B-A22B): the text decoder's decode step over the static cache, one
new token per row -> logits. Text-only calls only: a call with images or videos goes to transformers
(cuda_graph/support.py: pixel_values, image_grid_thw, ... or image/video tokens in mm_token_type_ids).

What differs from Qwen3-MoE (models/qwen3_moe.py), per transformers' modeling_qwen3_vl_moe.py:
- the decoder stack is `model.model.language_model` (layers, embed_tokens, norm, rotary_emb), the config nested
  (`config.text_config`); `model.lm_head` as usual;
- RoPE is multimodal (mrope: three position components T/H/W, interleaved `mrope_section`): generate() gives a
  text-only prompt position ids [4, b, s] whose components all equal the text position (`rope_deltas` zero), and
  with equal components the interleaving picks every frequency from the same position, so the rotation is plain
  RoPE of that position. The step computes cos/sin through the model's own rotary_emb with [3, b, 1] positions
  (three equal components); the decoder takes the rope start from the first component
  after checking all components agree (else the call falls back);
- router: Qwen3VLMoeTextTopKRouter, softmax in float32, top-k, always renormalised (no `norm_topk_prob`), the
  weights cast back to the logits' dtype;
- no DeepStack in text-only calls (visual features are only added at image/video positions).
Same as Qwen3-MoE: pre-norm layers, per-head q/k-norm + RoPE, GQA, fused 3D experts in Qwen3-MoE's layout
(gate_up_proj [E, 2I, H], down_proj [E, H, I]) dispatched through moegraph's experts (Qwen3VLMoeTextExperts is
decorated with use_experts_implementation, so the prefill uses moegraph's ExpertsInterface name too), dense
Qwen3VLMoeTextMLP layers where `mlp_only_layers` / `decoder_sparse_step` put them.

Every shape is fixed by the row count and the cache size and nothing syncs with the host: this function is what
each bucket's graph captures, and also what the eager loop runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from ._shared import moe_gate_weight, prenorm_decode_forward, softmax_topk_experts
from .qwen3_moe import _attention

if TYPE_CHECKING:
    from ..cuda_graph.static_cache import StaticKVCache


# The model kwargs of image / video inputs (None in a text-only call): any of them set goes to transformers.
MULTIMODAL_INPUTS = ("pixel_values", "pixel_values_videos", "image_grid_thw", "video_grid_thw", "mm_encoder_outputs",
                     "second_per_grid_ts")
# Per-token modality ids the processor returns with text too (0: text): a call whose ids are all 0 is text-only.
TOKEN_TYPES = "mm_token_type_ids"
INPUT_KWARGS = frozenset((*MULTIMODAL_INPUTS, TOKEN_TYPES))


def check_inputs(model: nn.Module, inputs: dict) -> str | None:
    """Text-only calls only: no image / video input, and modality ids (when given) all text. The prefill gets the
    modality ids as they are; the decode step needs none."""
    given = [name for name in MULTIMODAL_INPUTS if inputs.get(name) is not None]
    if given:
        return f"image/video inputs ({', '.join(given)}; the graph decoder runs text-only calls)"
    token_types = inputs.get(TOKEN_TYPES)
    if token_types is None:
        return None
    if not isinstance(token_types, torch.Tensor):
        return f"{TOKEN_TYPES} other than a tensor"
    if bool((token_types != 0).any()):  # one host sync per call
        return f"image/video tokens ({TOKEN_TYPES} marks some; the graph decoder runs text-only calls)"
    return None


def text_position_ids(position_ids: torch.Tensor) -> torch.Tensor | str:
    """The [rows, length] position ids of multimodal RoPE's [components, rows, length] (text, then T/H/W), or why
    the decode step cannot reproduce them: it rotates by one position per token, which is exact when every
    component holds the same position (a text-only call, rope_deltas zero); one host sync per call."""
    if bool((position_ids != position_ids[:1]).any()):
        return "multimodal position ids whose components differ (image/video positions or non-zero rope_deltas)"
    return position_ids[0]


def decode_forward(model: nn.Module, cache: StaticKVCache, token_ids: torch.Tensor, positions: torch.Tensor,
                   ops, rope_positions: torch.Tensor | None = None, cache_rows: torch.Tensor | None = None,
                   logit_rows: torch.Tensor | None = None) -> torch.Tensor:
    """One step for every row (moegraph.models._shared.prenorm_decode_forward over model.model.language_model):
    Qwen3-MoE's q/k-norm attention, MoE blocks with an always-renormalised router (dense MLP layers through their
    own module)."""
    return prenorm_decode_forward(model, cache, token_ids, positions, ops, rope_positions, _attention, _mlp,
                                  text_model=model.model.language_model, rope_components=3,
                                  cache_rows=cache_rows, logit_rows=logit_rows,
                                  router_weight=moe_gate_weight)


def _mlp(mlp: nn.Module, hidden: torch.Tensor, ops,
         router_logits: torch.Tensor | None = None) -> torch.Tensor:
    return decode_moe(mlp, hidden, ops, router_logits) if hasattr(mlp, "experts") else mlp(hidden)


def decode_moe(block: nn.Module, hidden: torch.Tensor, ops,
               router_logits: torch.Tensor | None = None) -> torch.Tensor:
    """Qwen3VLMoeTextSparseMoeBlock for [b, H] decode rows. Skips the router module call: no router logits are
    recorded."""
    return softmax_topk_experts(block, hidden, ops, router_logits, normalize=True)  # weights in the logits' dtype

"""What the graph decoder runs and asks of a model family: the contract between cuda_graph/ and moegraph.models.

The decoder knows no model: the registry entry of the model's family (moegraph.models.FAMILIES) fills one of these,
and the decoder calls only what it holds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class FamilySteps:
    # decode_step(model, cache, token_ids, positions, ops, rope_positions, cache_rows=None, logit_rows=None) ->
    # logits [b, V] float32: the one-token forward over the static cache that each bucket's graph captures; with
    # cache_rows the rows are tokens of those cache rows (a prompt's, each seeing its row up to its own position)
    # and logit_rows picks the rows whose logits come back
    decode_step: Callable
    # check_positions(model, positions) -> reason | None: the longest call the step decodes exactly (a sliding
    # window, say); None: any length
    check_positions: Callable | None = None
    # check_prompt(model, attention_mask, positions) -> reason | None: a limit that reads the call's
    # attention_mask [rows, cache + input] (or None) too; None: no limit
    check_prompt: Callable | None = None
    # model kwargs of the family's forward beyond the text ones (a vision-language model's image / video inputs,
    # its per-token modality ids): the decoder accepts them only as check_inputs allows, and slices the
    # batch-shaped ones per chunk as it slices the attention mask
    input_kwargs: frozenset = frozenset()
    # check_inputs(model, {name: value} of input_kwargs in the call) -> reason | None
    check_inputs: Callable | None = None
    # text_position_ids(position_ids [components, rows, length]) -> [rows, length] | reason: for a family whose
    # RoPE takes several position components (multimodal RoPE); None: 3-D position ids leave the fast path
    text_position_ids: Callable | None = None

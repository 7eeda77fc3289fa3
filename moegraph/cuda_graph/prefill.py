"""The prefill of short prompts through the family's decode step, one row per prompt token (`patch(prefill="graphs")`).

transformers' forward runs a prefill op by op from Python: ~70 launches per layer, each with host work, so a first
token at batch 1 costs ~100 ms of host time on an H200 for ~16 ms of kernels. Here every real prompt token becomes
one row of the decode step (`decode_step(..., cache_rows=, logit_rows=)`): it writes its K/V at its position in its
prompt's row of the static cache and attends to that row up to its own position, which is causal attention over the
prompt; the rows of the last tokens give the first logits. On CUDA the step is captured once per token bucket
and replayed, like the decode graphs (logits for every row of the static cache, so that one graph serves every
batch); elsewhere it runs eagerly.

Token rows are the real tokens of each row in order (padding dropped, as the static cache holds no padding): row r's
i-th real token goes to cache row r, position i, with RoPE position rope_start[r] - length[r] + i (transformers'
count for a prompt whose position ids run without a gap). A bucket's spare token rows read token 0 and write their
K/V at the cache's last position of cache row 0: no live token attends that far, and a decode step writes a position
before any step reads it. A call that returns its cache gets the prompts' K/V copied from the static cache into it
(`prompt_kv`), with zeros in masked columns where transformers' own prefill leaves the K/V of the padding tokens.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch

TOKEN_BUCKETS = (16, 32, 64, 128, 256, 512)
MAX_TOKENS = TOKEN_BUCKETS[-1]  # past it transformers' prefill: attention here reads each row's cache per token


def token_bucket(tokens: int) -> int:
    return TOKEN_BUCKETS[bisect.bisect_left(TOKEN_BUCKETS, tokens)]


def token_buckets_up_to(tokens: int) -> list[int]:
    """The token buckets a prefill of up to `tokens` prompt tokens in all can take (capture() prepares these)."""
    return list(TOKEN_BUCKETS[:bisect.bisect_left(TOKEN_BUCKETS, min(tokens, MAX_TOKENS)) + 1])


@dataclass
class TokenRows:
    """A batch of prompts as decode-step rows, one per real token (see the module docstring)."""

    token_ids: torch.Tensor  # [n] int64
    cache_rows: torch.Tensor  # [n] int64: the prompt's row
    columns: torch.Tensor  # [n] int64: the token's column in input_ids
    positions: torch.Tensor  # [n] int64: index among its row's real tokens
    rope_positions: torch.Tensor  # [n] int64
    last: torch.Tensor  # [rows] int64: the token row of each prompt's last token
    lengths: torch.Tensor  # [rows] int64: real tokens per prompt

    @property
    def count(self) -> int:
        return self.token_ids.shape[0]


def token_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor | None, rope_start: torch.Tensor,
               position_ids: torch.Tensor | None = None) -> TokenRows:
    """The real tokens of input_ids [rows, width] (mask 1) in row-major order, with their RoPE positions from
    position_ids [rows, width] where transformers prepared them, else counted from rope_start. Syncs with the host
    once (their count)."""
    real = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask != 0
    rows, cols = real.nonzero(as_tuple=True)  # row by row, columns in order
    index = real.long().cumsum(1) - 1  # [rows, width]: a real token's index among its row's
    lengths = real.sum(1)
    positions = index[rows, cols]
    if position_ids is not None:
        rope_positions = position_ids.to(positions.device).long()[rows, cols]
    else:
        rope_positions = rope_start.to(positions.device)[rows] - lengths[rows] + positions
    return TokenRows(input_ids[rows, cols].long(), rows, cols, positions, rope_positions, lengths.cumsum(0) - 1,
                     lengths)


def prompt_kv(cache, rows: TokenRows, width: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (keys, values) [prompts, kv_heads, width, head_dim] of the prompts in transformers' layout, read
    from the static cache: each token's K/V at its column of input_ids; masked columns hold zeros (transformers
    holds the K/V it computed for those tokens there; attention never reads them)."""
    prompts = rows.last.shape[0]
    layers = []
    for keys, values in zip(cache.keys, cache.values):
        out_k = keys.new_zeros(prompts, keys.shape[1], width, keys.shape[3])
        out_v = values.new_zeros(out_k.shape)
        out_k[rows.cache_rows, :, rows.columns] = keys[rows.cache_rows, :, rows.positions]
        out_v[rows.cache_rows, :, rows.columns] = values[rows.cache_rows, :, rows.positions]
        layers.append((out_k, out_v))
    return layers


def text_positions(position_ids: torch.Tensor | None) -> torch.Tensor | str | None:
    """position_ids as one [rows, width] tensor: as given, or the one component of a multimodal RoPE's
    [components, rows, width] when the components agree (text); else why not."""
    if position_ids is None or position_ids.dim() == 2:
        return position_ids
    if position_ids.dim() == 3 and bool((position_ids == position_ids[:1]).all()):
        return position_ids[0]
    return f"position_ids of shape {tuple(position_ids.shape)} whose components differ"


def resolve_mode(mode: str, device: torch.device) -> str:
    """patch(prefill=) as it applies on `device`: "auto" takes token rows on CUDA, where they save the host time of
    transformers' op-by-op forward, and keeps transformers' prefill elsewhere (no host time to save there)."""
    if mode == "auto":
        return "graphs" if device.type == "cuda" else "transformers"
    return mode


def why_not_graphs(mode: str, prompt, device: torch.device) -> str | None:
    """None when the call's prefill can run as token rows (the family's own input checks have passed); else why
    transformers' prefill runs it. `prompt`: the decoder's _Prompt."""
    from transformers import DynamicCache

    resolved = resolve_mode(mode, device)
    if resolved != "graphs":
        return f"prefill={mode!r}" + (f" on {device.type}" if mode == "auto" else "")
    if prompt.past:
        return "the call continues from a cache"
    if prompt.keep_cache and not isinstance(prompt.cache, DynamicCache):
        return f"the call keeps a {type(prompt.cache).__name__}"
    if prompt.model_kwargs.get("inputs_embeds") is not None:
        return "inputs_embeds"
    return None


@dataclass
class PrefillInputs:
    """The static inputs every prefill graph reads, allocated once: MAX_TOKENS token rows, a last-token row per
    row of the static cache."""

    token_ids: torch.Tensor
    cache_rows: torch.Tensor
    positions: torch.Tensor
    rope_positions: torch.Tensor
    last: torch.Tensor

    @classmethod
    def allocate(cls, rows: int, device: torch.device) -> "PrefillInputs":
        tokens = [torch.zeros(MAX_TOKENS, dtype=torch.long, device=device) for _ in range(4)]
        return cls(*tokens, torch.zeros(rows, dtype=torch.long, device=device))

    def load(self, rows: TokenRows, tokens: int, spare_position: int) -> None:
        """Token rows [0, n) from `rows`, spare rows up to `tokens` as the module docstring says; the last-token
        rows of prompts [0, live), and token row 0 for the cache's other rows (their logits are not read)."""
        n, live = rows.count, rows.last.shape[0]
        self.token_ids[:n].copy_(rows.token_ids)
        self.cache_rows[:n].copy_(rows.cache_rows)
        self.positions[:n].copy_(rows.positions)
        self.rope_positions[:n].copy_(rows.rope_positions)
        self.token_ids[n:tokens].zero_()
        self.cache_rows[n:tokens].zero_()
        self.positions[n:tokens].fill_(spare_position)
        self.rope_positions[n:tokens].fill_(spare_position)
        self.last[:live].copy_(rows.last)
        self.last[live:].zero_()


# transformers' prefill builds a [rows, 1, new, positions] attention mask (2 bytes an element in bf16): a long prompt
# runs as consecutive chunks of its new positions that keep the mask under this many elements (512 MiB in bf16;
# batch 8 x 32k tokens in one forward asked for 16 GiB), each chunk attending to the cache the chunks before it filled
CHUNK_MASK_ELEMENTS = 1 << 28
MIN_CHUNK = 256  # fewer tokens a forward leave the GPU idle between launches
CHUNKABLE = frozenset({"attention_mask", "position_ids", "inputs_embeds"})  # sliced along their positions


def transformers_chunks(rows: int, width: int, new: int, kwargs: dict) -> list[int]:
    """Where transformers' prefill of the last `new` of `width` positions ends each chunk: [width] for one forward.

    More than one only when the mask would pass CHUNK_MASK_ELEMENTS and every position-shaped input can be sliced
    (attention_mask, 2-D position_ids, inputs_embeds: other inputs, e.g. a vision model's, keep one forward)."""
    if rows * new * width <= CHUNK_MASK_ELEMENTS:
        return [width]
    for name, value in kwargs.items():
        if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[0] == rows and name not in CHUNKABLE:
            return [width]
    position_ids = kwargs.get("position_ids")
    if isinstance(position_ids, torch.Tensor) and position_ids.dim() != 2:
        return [width]
    chunk = max(MIN_CHUNK, CHUNK_MASK_ELEMENTS // (rows * width))
    return [*range(width - new + chunk, width, chunk), width]


def prefix_kwargs(kwargs: dict, end: int) -> dict:
    """kwargs of a prefill that stops after position `end`: the position-shaped inputs cut there."""
    out = dict(kwargs)
    for name in CHUNKABLE:
        value = out.get(name)
        if isinstance(value, torch.Tensor):
            out[name] = value[:, :end]
    return out

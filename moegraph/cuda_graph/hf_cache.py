"""transformers' own Cache objects around the fast path: which ones it takes, and how K/V move in and out.

The prompt is prefilled by transformers' forward into a transformers Cache (the one generate()
prepared for the call, or the user's); its K/V are then copied, compacted per row, into
moegraph's static cache. When that Cache outlives the call (`return_dict_in_generate=True`, or a
cache the user passed in), the K/V of the generated tokens are appended to it at the end, so it
holds what transformers' own loop leaves there: per layer [rows, kv_heads, past + prompt + new - 1,
head_dim], padding columns included, ready to be passed to the next generate().

Names differ across transformers 5.x (`past_key_values` in older releases, `cache` in newer ones,
which deprecate the old name): they are detected from the installed transformers, never assumed.
"""

from __future__ import annotations

import functools
import inspect

import torch

# The cache's keyword in generate(), the model's forward and generate's model_kwargs, newest first.
CACHE_ARGUMENTS = ("cache", "past_key_values")


def cache_argument(model_kwargs: dict) -> str | None:
    """The name under which transformers put the call's cache into model_kwargs (None: no cache)."""
    return next((name for name in CACHE_ARGUMENTS if name in model_kwargs), None)


@functools.lru_cache(maxsize=None)
def _forward_cache_argument(model_class: type) -> str:
    parameters = inspect.signature(model_class.forward).parameters
    return next((name for name in CACHE_ARGUMENTS if name in parameters), CACHE_ARGUMENTS[-1])


def forward_cache_argument(model) -> str:
    """The cache keyword the model's forward takes without a deprecation warning."""
    return _forward_cache_argument(type(model))


@functools.lru_cache(maxsize=None)
def output_cache_field() -> str:
    """The cache field of GenerateDecoderOnlyOutput in the installed transformers."""
    from transformers.generation.utils import GenerateDecoderOnlyOutput

    fields = GenerateDecoderOnlyOutput.__dataclass_fields__
    return next(name for name in CACHE_ARGUMENTS if name in fields)


def unsupported_cache(cache) -> str | None:
    """None when the fast path can prefill into `cache` and continue from it, else why not."""
    from transformers.cache_utils import DynamicCache, DynamicLayer, StaticCache, StaticLayer

    if type(cache) not in (DynamicCache, StaticCache):
        return f"a user-supplied {type(cache).__name__}"
    if getattr(cache, "offloading", False):
        return "an offloaded cache"
    for layer in cache.layers:
        if type(layer) not in (DynamicLayer, StaticLayer):
            return f"a cache with {type(layer).__name__} layers"
    return None


def past_length(cache) -> int:
    return int(cache.get_seq_length())  # a 0-d tensor for static layers: one sync per call


def rows_of(cache) -> int | None:
    layer = next((layer for layer in cache.layers if getattr(layer, "keys", None) is not None), None)
    return None if layer is None or layer.keys.dim() != 4 else layer.keys.shape[0]


def capacity(cache) -> int | None:
    """How many positions a static cache holds (None: grows without bound)."""
    sizes = [layer.max_cache_len for layer in cache.layers if hasattr(layer, "max_cache_len")]
    return min(sizes) if sizes else None


def layers_kv(cache, width: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (keys, values) [rows, kv_heads, width, head_dim]: the first `width` positions.

    A sliding-window layer (DynamicSlidingWindowLayer, e.g. GPT-OSS's) keeps only the last sliding_window - 1
    positions: those come last, zeros in front of them. No query of that layer sees the zeros: they lie past its
    window for every row whose padding is on the left (a family that slides checks the padding, check_prompt)."""
    out = []
    for layer in cache.layers:
        keys, values = layer.keys[:, :, :width], layer.values[:, :, :width]
        missing = width - keys.shape[2]
        if missing > 0 and getattr(layer, "is_sliding", False):
            keys, values = (torch.nn.functional.pad(t, (0, 0, missing, 0)) for t in (keys, values))
        out.append((keys, values))
    return out


def seeded_cache(config, cache, rows: slice, width: int):
    """A DynamicCache holding rows `rows` of the first `width` positions of `cache` (one chunk of a batch)."""
    from transformers import DynamicCache

    chunk = DynamicCache(config=config)
    if cache is not None and width:
        for layer_idx, (keys, values) in enumerate(layers_kv(cache, width)):
            chunk.update(keys[rows], values[rows], layer_idx)
    return chunk


def append_kv(cache, layers: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Append per-layer (keys, values) [rows, kv_heads, n, head_dim] after what `cache` holds."""
    if not layers or layers[0][0].shape[2] == 0:
        return
    for layer_idx, (keys, values) in enumerate(layers):
        cache.update(keys, values, layer_idx)


def match_lengths(cache, like) -> None:
    """Give `cache`'s sliding-window layers the token count of `like`'s (DynamicSlidingWindowLayer counts tokens
    seen, `cumulative_length`, apart from the sliding_window - 1 it holds: appending what another cache holds
    counts only those). Other layers count what they hold."""
    for layer, model_layer in zip(cache.layers, like.layers):
        if hasattr(layer, "cumulative_length") and hasattr(model_layer, "cumulative_length"):
            layer.cumulative_length = model_layer.cumulative_length

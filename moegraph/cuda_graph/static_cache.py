"""The static KV cache the decode graphs read and write.

One [rows, kv_heads, positions, head_dim] tensor per layer for keys and one for values, allocated
once and reused by every generate() call so that captured graphs stay valid. Rows are compact:
row r holds its own tokens at positions 0..len_r-1 with no left padding, so rows with different
prompt lengths cost no decode work for padding; each decode step writes one position per row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Positions are allocated in multiples of this, so that small changes of max_length reuse the graphs.
SEQ_ALIGN = 256


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


@dataclass
class StaticKVCache:
    keys: list[torch.Tensor]  # per layer [rows, kv_heads, positions, head_dim]
    values: list[torch.Tensor]

    @classmethod
    def allocate(cls, *, num_layers: int, rows: int, positions: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> "StaticKVCache":
        shape = (rows, kv_heads, positions, head_dim)
        return cls(
            keys=[torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)],
            values=[torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)],
        )

    @property
    def rows(self) -> int:
        return self.keys[0].shape[0]

    @property
    def positions(self) -> int:
        return self.keys[0].shape[2]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)

    def load_prefill(self, layers_kv, lengths: torch.Tensor, row_offset: int = 0) -> None:
        """Copy a left-padded prefill cache into rows [row_offset, row_offset + n), compacted to start at 0.

        layers_kv: per layer (keys, values), each [n, kv_heads, T, head_dim], row r holding its
        lengths[r] real tokens in the last lengths[r] columns. Positions at or past a row's
        length receive copies of its last token; attention never reads them (they are masked
        until decode overwrites them).
        """
        n, _, width, _ = layers_kv[0][0].shape
        pad = (width - lengths).to(torch.long)  # [n]
        src = (pad[:, None] + torch.arange(width, device=lengths.device)).clamp_(max=width - 1)  # [n, T]
        for layer, (k, v) in enumerate(layers_kv):
            index = src[:, None, :, None].expand_as(k)
            self.keys[layer][row_offset:row_offset + n, :, :width].copy_(k.gather(2, index))
            self.values[layer][row_offset:row_offset + n, :, :width].copy_(v.gather(2, index))

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

    @staticmethod
    def bytes_for(*, num_layers: int, rows: int, positions: int, kv_heads: int, head_dim: int,
                  dtype: torch.dtype, device: torch.device) -> int:
        """What allocate() with these arguments takes, without allocating it."""
        return 2 * num_layers * rows * kv_heads * positions * head_dim * dtype.itemsize

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)

    def load_prefill(self, layers_kv, order: torch.Tensor | None, row_offset: int = 0) -> None:
        """Copy a prefill cache into rows [row_offset, row_offset + n), compacted to start at position 0.

        layers_kv: per layer (keys, values), each [n, kv_heads, T, head_dim], as transformers' cache
        holds them (padding columns anywhere: left, right, or in between). order [n, T]: per row the
        columns of its real tokens first, in order, then its padding columns (None: no padding).
        Positions at or past a row's length receive padding columns; attention never reads them
        (they are masked until decode overwrites them).
        """
        n, _, width, _ = layers_kv[0][0].shape
        index = None if order is None else order[:, None, :, None]
        for layer, (k, v) in enumerate(layers_kv):
            if index is not None:
                k, v = k.gather(2, index.expand_as(k)), v.gather(2, index.expand_as(v))
            self.keys[layer][row_offset:row_offset + n, :, :width].copy_(k)
            self.values[layer][row_offset:row_offset + n, :, :width].copy_(v)

    def read(self, start: torch.Tensor, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer (keys, values) [n, kv_heads, count, head_dim] of positions start[r] .. start[r] + count - 1."""
        rows = start.shape[0]
        index = start[:, None] + torch.arange(count, device=start.device)  # [n, count]
        index = index[:, None, :, None].expand(rows, self.keys[0].shape[1], count, self.keys[0].shape[3])
        return [(k[:rows].gather(2, index), v[:rows].gather(2, index)) for k, v in zip(self.keys, self.values)]


def compaction_order(attention_mask: torch.Tensor | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(order [n, T], lengths [n]) for StaticKVCache.load_prefill from a 2D 0/1 mask; (None, None) without one."""
    if attention_mask is None:
        return None, None
    real = attention_mask != 0
    # a stable sort of "is padding" puts each row's real columns first, in their order
    order = torch.sort((~real).to(torch.uint8), dim=1, stable=True).indices
    return order, real.sum(1)

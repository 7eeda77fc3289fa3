"""Bucketed CUDA graphs of the decode step: capture once per batch-size bucket, replay every step.

Buckets are [1, 2, 4, 8] + range(16, max_batch_size + 1, 16) (plus max_batch_size itself when it
is not a multiple of 16, so that every size up to it falls in a bucket). A live batch of n rows
replays the graph of the smallest bucket >= n; rows past n are padding: they read token 0 at
position 0 of their own cache rows, which no live row ever attends to.
All graphs share one memory pool and are captured largest first, so the smaller ones reuse the
memory of the largest.
"""

from __future__ import annotations

import bisect
import functools
import logging
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..kernels import pdl_launches

logger = logging.getLogger("moegraph")


def capture_stream(device) -> torch.cuda.Stream:
    """The one side stream of a device on which every warm-up and capture runs. cuBLAS keeps a workspace per
    stream that it uses, for the life of the process: a fresh stream per capture would leave one more each time."""
    device = torch.device(device)
    return _capture_stream(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _capture_stream(index: int) -> torch.cuda.Stream:
    return torch.cuda.Stream(index)


def batch_buckets(max_batch_size: int) -> list[int]:
    buckets = [b for b in (1, 2, 4, 8) if b <= max_batch_size]
    buckets += list(range(16, max_batch_size + 1, 16))
    if buckets[-1] != max_batch_size:
        buckets.append(max_batch_size)
    return buckets


def bucket_for(rows: int, buckets: list[int]) -> int:
    i = bisect.bisect_left(buckets, rows)
    if i == len(buckets):
        raise ValueError(f"{rows} rows exceed the largest bucket {buckets[-1]}")
    return buckets[i]


@dataclass
class StaticInputs:
    """Inputs every graph reads, allocated once at the largest bucket; a bucket uses a prefix."""

    token_ids: torch.Tensor  # [rows] int64
    positions: torch.Tensor  # [rows] int64: where the token's K/V go in the row's compact cache
    rope_positions: torch.Tensor  # [rows] int64: the position id RoPE rotates by, as transformers counts it

    @classmethod
    def allocate(cls, rows: int, device: torch.device) -> "StaticInputs":
        return cls(*(torch.zeros(rows, dtype=torch.long, device=device) for _ in range(3)))

    def clear(self) -> None:
        self.token_ids.zero_()
        self.positions.zero_()
        self.rope_positions.zero_()

    def fill_random(self, rows: int, vocab_size: int, context: int, seed: int = 0) -> None:
        """Distinct random tokens at `context` positions in the first `rows` rows, as a call leaves them (for
        profiling: token 0 in every row would route every row to the same experts)."""
        gen = torch.Generator().manual_seed(seed)
        self.token_ids[:rows].copy_(torch.randint(vocab_size, (rows,), generator=gen))
        self.positions[:rows].fill_(context)
        self.rope_positions[:rows].fill_(context)


def weight_slots(model: torch.nn.Module) -> list[tuple[dict, str, bool]]:
    """Where the decode step finds every parameter, buffer and submodule: (dict, key, is_tensor), collected once.

    Reading the live entries through these dicts sees a replaced nn.Parameter (load_state_dict(...,
    assign=True), `module.weight = ...`), new storage behind the same Parameter (`model.to(...)`)
    and a replaced submodule; an in-place update (`param.data.copy_()`, an optimizer step) changes nothing.
    """
    slots = []
    for module in model.modules():
        slots += [(module._parameters, name, True) for name, p in module._parameters.items() if p is not None]
        slots += [(module._buffers, name, True) for name, b in module._buffers.items() if b is not None]
        slots += [(module._modules, name, False) for name, m in module._modules.items() if m is not None]
    return slots


def weights_signature(slots: list[tuple[dict, str, bool]]) -> tuple[int, ...]:
    """Storage pointers of the tensors (and ids of the submodules) that the captured graphs read."""
    return tuple(0 if (value := owner.get(name)) is None else value.data_ptr() if is_tensor else id(value)
                 for owner, name, is_tensor in slots)


@dataclass
class BucketGraphs:
    """The captured graphs, one per bucket, and their outputs (logits [bucket, V] float32)."""

    step: Callable[[int], torch.Tensor]  # bucket -> logits, reading its static inputs and the static cache
    what: str = "decode graph(s) (batch buckets"  # for the log line
    pdl_early_trigger: bool = True  # pdl_launches' choice for the captures (OpTable.pdl_early_trigger)
    graphs: dict[int, torch.cuda.CUDAGraph] = field(default_factory=dict)
    outputs: dict[int, torch.Tensor] = field(default_factory=dict)
    pool: object = None

    def capture(self, buckets: list[int], device: torch.device, show_progress: bool = True) -> tuple[int, float]:
        """Warm up and capture each missing bucket, largest first, into the shared pool: (graphs captured, seconds).

        Anything raised meanwhile (out of memory, KeyboardInterrupt) drops every graph of the pool, the
        half-captured one included, so the next call captures all of them again from a clean pool."""
        missing = sorted((b for b in buckets if b not in self.graphs), reverse=True)
        if not missing:
            return 0, 0.0
        start = time.perf_counter()
        try:
            self._capture(missing, device, show_progress)
        except BaseException as exc:
            self.release()
            traceback.clear_frames(exc.__traceback__)  # its frames hold the half-captured graph (and its pool)
            raise
        elapsed = time.perf_counter() - start
        logger.info("moegraph: captured %d %s %s) in %.2f s", len(missing), self.what, sorted(missing), elapsed)
        return len(missing), elapsed

    def _capture(self, missing: list[int], device: torch.device, show_progress: bool) -> None:
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        stream = capture_stream(device)
        with pdl_launches(self.pdl_early_trigger):  # the warm-up compiles the kernels the capture launches
            self._capture_each(missing, stream, device, show_progress)
        torch.cuda.synchronize(device)

    def _capture_each(self, missing: list[int], stream, device: torch.device, show_progress: bool) -> None:
        for rows in _progress(missing, show_progress):
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                self.step(rows)  # warm-up: lazy init, backend probes and autotuning stay out of the capture
            torch.cuda.current_stream(device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool, stream=stream):
                self.outputs[rows] = self.step(rows)
            self.graphs[rows] = graph

    def replay(self, rows: int) -> torch.Tensor:
        self.graphs[rows].replay()
        return self.outputs[rows]

    def release(self) -> None:
        self.graphs.clear()
        self.outputs.clear()
        self.pool = None


def _progress(items, enabled: bool):
    if not enabled:
        return items
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return items
    return tqdm(items, desc="moegraph: capturing decode graphs", unit="graph", leave=False)

"""Where one decode step goes: the kernels (or CPU ops) of one eager step, and the GPU time of its replayed graph.

`profile_step(model, batch_size)` patches nothing: the model must be patched; it prepares the static cache (and the
graphs, on CUDA) for `batch_size` rows with `moegraph.capture()`, then profiles one step of moegraph's decode loop
over the static inputs (the token ids and positions they hold; the kernels and their shapes do not depend on them).
The bench's `--profile` and the scripts in benchmarks/ print its `format()`.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch
from torch import nn

from .patches.api import _patched_decoder, capture


@dataclass(frozen=True)
class KernelTime:
    name: str
    calls: int
    total_us: float


@dataclass(frozen=True)
class StepProfile:
    batch_size: int
    layers: int
    device: str  # "cuda": GPU kernels; "cpu": CPU ops (what a CPU step runs)
    kernels: tuple[KernelTime, ...]  # by total time, longest first
    graph_replay_ms: float | None  # GPU time of one replay of the bucket's graph (back to back); None off CUDA

    @property
    def calls(self) -> int:
        return sum(k.calls for k in self.kernels)

    @property
    def total_us(self) -> float:
        return sum(k.total_us for k in self.kernels)

    def format(self, top: int = 12) -> str:
        what = "kernels" if self.device == "cuda" else "CPU ops"
        head = (f"profile (batch {self.batch_size}): {self.calls} {what} in one eager decode step, "
                f"{self.calls / self.layers:.1f} per decoder layer, {self.total_us / 1e3:.2f} ms")
        if self.graph_replay_ms is not None:
            head += f"; the captured graph replays in {self.graph_replay_ms:.3f} ms"
        lines = [head]
        for k in self.kernels[:top]:
            lines.append(f"  {100 * k.total_us / max(self.total_us, 1e-9):5.1f}%  {k.calls:5d}x  "
                         f"{k.total_us / k.calls:8.2f} us  {k.name[:90]}")
        return "\n".join(lines)


def profile_step(model: nn.Module, batch_size: int = 1, replays: int = 20) -> StepProfile:
    """Profile one decode step of a patched model at `batch_size` rows (see the module docstring)."""
    from torch.profiler import ProfilerActivity, profile

    decoder = _patched_decoder(model, "profile_step")
    capture(model, batch_size)
    device = decoder.model.device
    on_cuda = device.type == "cuda"
    decoder.eager_step(batch_size)  # warm: lazy initialisation and compilation stay out of the profile
    activity = ProfilerActivity.CUDA if on_cuda else ProfilerActivity.CPU
    with profile(activities=[activity]) as prof:
        decoder.eager_step(batch_size)
        if on_cuda:
            torch.cuda.synchronize(device)
    return StepProfile(batch_size, model.config.num_hidden_layers, device.type, _by_name(prof, on_cuda),
                       _replay_ms(decoder, batch_size, replays) if on_cuda else None)


def _by_name(prof, on_cuda: bool) -> tuple[KernelTime, ...]:
    totals = defaultdict(lambda: [0, 0.0])
    for event in prof.events():
        if on_cuda and event.device_type.name != "CUDA":
            continue
        if not on_cuda and (event.device_type.name != "CPU" or not event.name.startswith("aten::")):
            continue
        totals[event.name][0] += 1
        totals[event.name][1] += event.device_time if on_cuda else event.self_cpu_time_total
    kernels = (KernelTime(name, calls, us) for name, (calls, us) in totals.items())
    return tuple(sorted(kernels, key=lambda k: -k.total_us))


def _replay_ms(decoder, batch_size: int, replays: int) -> float | None:
    if decoder.graphs is None or not decoder.graphs.graphs:
        return None  # graphs off, or capture failed: the eager profile is all there is
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    decoder.replay_step(batch_size)
    start.record()
    for _ in range(replays):
        decoder.replay_step(batch_size)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / replays

"""Where one decode step and one first token go: the kernels (or CPU ops) they run, and their time.

`profile_step(model, batch_size)` patches nothing: the model must be patched; it prepares the static cache (and the
graphs, on CUDA) for `batch_size` rows with `moegraph.capture()`, then profiles one step of moegraph's decode loop
over the static inputs (the token ids and positions they hold; the kernels and their shapes do not depend on them).
`profile_prefill(model, batch_size, prompt_len)` profiles one first token as `generate()` makes it (prefill forward,
the copy into the static cache, the first pick) on random prompts of exactly `prompt_len` tokens, patched or not.
`profile_model(model, what)` runs either or both, patching the model for the time it takes if it is not patched:
the bench's `--profile decode|prefill|all` and the scripts in benchmarks/ call it and print the profiles' `format()`.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass

import torch
from torch import nn

from .errors import InvalidArgumentError
from .patches.api import _patched_decoder, capture, is_patched, patch, unpatch

PROFILES = ("decode", "prefill")


@dataclass(frozen=True)
class KernelTime:
    name: str
    calls: int
    total_us: float


class _KernelTable:
    """What a profile of `kernels` over `layers` decoder layers shares: totals and the top lines of `format()`."""

    kernels: tuple[KernelTime, ...]
    layers: int
    device: str

    @property
    def calls(self) -> int:
        return sum(k.calls for k in self.kernels)

    @property
    def kernels_per_layer(self) -> float:
        return self.calls / self.layers

    @property
    def total_us(self) -> float:
        return sum(k.total_us for k in self.kernels)

    def _what(self) -> str:
        return "kernels" if self.device == "cuda" else "CPU ops"

    def _top_lines(self, top: int) -> list[str]:
        return [f"  {100 * k.total_us / max(self.total_us, 1e-9):5.1f}%  {k.calls:5d}x  "
                f"{k.total_us / k.calls:8.2f} us  {k.name[:90]}" for k in self.kernels[:top]]


@dataclass(frozen=True)
class StepProfile(_KernelTable):
    batch_size: int
    layers: int
    device: str  # "cuda": GPU kernels; "cpu": CPU ops (what a CPU step runs)
    kernels: tuple[KernelTime, ...]  # by total time, longest first
    graph_replay_ms: float | None  # GPU time of one replay of the bucket's graph (back to back); None off CUDA
    # the kernels of one graph replay rather than of one eager step: with programmatic dependent launch a kernel's
    # time there includes its wait on the one before it
    replayed: bool = False

    def format(self, top: int = 12) -> str:
        step = "one replay of the captured graph" if self.replayed else "one eager decode step"
        head = (f"profile (batch {self.batch_size}): {self.calls} {self._what()} in {step}, "
                f"{self.kernels_per_layer:.1f} per decoder layer, {self.total_us / 1e3:.2f} ms")
        if self.graph_replay_ms is not None:
            head += f"; the captured graph replays in {self.graph_replay_ms:.3f} ms"
        return "\n".join([head] + self._top_lines(top))


@dataclass(frozen=True)
class PrefillProfile(_KernelTable):
    batch_size: int
    prompt_len: int
    layers: int
    device: str
    kernels: tuple[KernelTime, ...]  # of one first token (prefill forward, cache copy, first pick), longest first
    first_token_ms: float  # wall time of one such generate() call, synchronized, outside the profiler (median of 3)
    patched: bool  # moegraph's first token, or transformers' own

    def format(self, top: int = 12) -> str:
        head = (f"prefill profile ({'moegraph' if self.patched else 'transformers'}, batch {self.batch_size}, "
                f"{self.prompt_len}-token prompts): {self.calls} {self._what()} in one first token, "
                f"{self.kernels_per_layer:.1f} per decoder layer, {self.total_us / 1e3:.2f} ms of them; "
                f"the first token takes {self.first_token_ms:.2f} ms (wall, synchronized)")
        return "\n".join([head] + self._top_lines(top))


def profile_step(model: nn.Module, batch_size: int = 1, replays: int = 20, context: int = 128,
                 graph: bool = False) -> StepProfile:
    """Profile one decode step of a patched model at `batch_size` rows of distinct random tokens, each at `context`
    positions (see the module docstring). graph: profile one replay of the captured graph instead (CUDA, graphs
    captured), where the kernels run as the decode loop runs them."""
    from torch.profiler import profile

    decoder = _patched_decoder(model, "profile_step")
    capture(model, batch_size)
    device = decoder.model.device
    on_cuda = device.type == "cuda"
    context = min(context, decoder.cache.positions - 1)
    decoder.inputs.fill_random(batch_size, model.config.get_text_config().vocab_size, context)
    replayed = graph and on_cuda and decoder.graphs is not None and bool(decoder.graphs.graphs)
    if graph and not replayed:
        raise InvalidArgumentError("profile_step(graph=True) needs captured CUDA graphs; this decoder has none")
    step = decoder.replay_step if replayed else decoder.eager_step
    step(batch_size)  # warm: lazy initialisation and compilation stay out of the profile
    with profile(activities=[_activity(device)]) as prof:
        step(batch_size)
        _sync(device)
    return StepProfile(batch_size, model.config.get_text_config().num_hidden_layers, device.type, _by_name(prof, on_cuda),
                       _replay_ms(decoder, batch_size, replays) if on_cuda else None, replayed)


def profile_prefill(model: nn.Module, batch_size: int = 1, prompt_len: int = 128, seed: int = 0) -> PrefillProfile:
    """Profile one first token of `generate()` (see the module docstring) on `batch_size` random prompts of exactly
    `prompt_len` tokens: moegraph's when the model is patched, transformers' otherwise."""
    from torch.profiler import profile

    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, model.config.get_text_config().vocab_size, (batch_size, prompt_len), generator=gen).to(device)
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}

    def first_token():
        model.generate(**inputs, max_new_tokens=1, min_new_tokens=1, do_sample=False)
        _sync(device)

    first_token()  # warm: the static cache sized for these prompts, lazy initialisation, autotuning
    times = [_timed(first_token) for _ in range(3)]
    with profile(activities=[_activity(device)]) as prof:
        first_token()
    return PrefillProfile(batch_size, prompt_len, model.config.get_text_config().num_hidden_layers, device.type,
                          _by_name(prof, device.type == "cuda"), 1e3 * sorted(times)[1], is_patched(model))


def profile_model(model: nn.Module, what: str = "all", batch_size: int = 1, prompt_len: int = 128) -> dict:
    """{"decode": StepProfile, "prefill": PrefillProfile} (`what`: decode, prefill or all) of moegraph at `batch_size`
    rows; a model that is not patched is patched for the time it takes (max_batch_size=batch_size), then unpatched."""
    kinds = PROFILES if what == "all" else (what,)
    if set(kinds) - set(PROFILES):
        raise InvalidArgumentError(f"unknown profile {what!r}; choose one of {PROFILES + ('all',)}")
    owned = not is_patched(model)
    if owned:
        patch(model, max_batch_size=max(batch_size, 1))
    try:
        run = {"decode": lambda: profile_step(model, batch_size),
               "prefill": lambda: profile_prefill(model, batch_size, prompt_len)}
        return {kind: run[kind]() for kind in kinds}
    finally:
        if owned:
            unpatch(model)


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _activity(device):
    from torch.profiler import ProfilerActivity

    return ProfilerActivity.CUDA if device.type == "cuda" else ProfilerActivity.CPU


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

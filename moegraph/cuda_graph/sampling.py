"""Sampling on the device: transformers' sampling processors and the draw as plain torch ops, capturable.

A `SamplingPlan` is read once per call from the processors transformers prepared; it covers exactly
RepetitionPenaltyLogitsProcessor, MinLengthLogitsProcessor, MinNewTokensLengthLogitsProcessor,
TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper and MinPLogitsWarper, in the list's order
(anything else: the host path, transformers' processors and `torch.multinomial`). A `DeviceSampler`
runs a plan over logits [bucket, V]: every value a call sets (temperature, top_p, min_p, penalty, the
min-length threshold, the EOS ids, the seed, the tokens seen so far) lives in a static device tensor, so
one captured graph per (plan shape, bucket) serves every call; only `top_k` (a shape) is part of the shape.

The draw is a Gumbel race, argmax(scores - log(-log(u))), which picks token i with probability
softmax(scores)_i, as `torch.multinomial(softmax(scores))` does. u is counter-based: a SplitMix64 hash of
(seed, draw step, row of the call, token id) in int64 torch ops (wrapping multiplies), so eager and replayed
draws are the same by construction, and a batch decoded in chunks draws what it draws in one piece. The
seed is taken once per call from torch's default generator: `torch.manual_seed` makes a call reproducible.
u takes 2^23 values in (0, 1): the race is exact up to that resolution (a token ~19 nats below the top is
never drawn, probability < 6e-9).

Capture-safe: no `.item()`, no host sync, no data-dependent size; the counters advance inside the graph.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .graphs import capture_stream

# top-p after top-k is computed on the k candidates (a [rows, k] sort instead of a [rows, V] one); above this
# k the whole vocabulary is sorted, as transformers does.
MAX_TOP_P_CANDIDATES = 1024
# SplitMix64 (Steele, Lea, Flood 2014) constants as signed int64; torch's int64 multiply wraps.
_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)
_MIX1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_MIX2 = 0x94D049BB133111EB - (1 << 64)
_U_BITS = 23  # (k + 0.5) * 2^-23 is exact in float32 for every k < 2^23: u never rounds to 0 or 1

_COVERED = ("RepetitionPenaltyLogitsProcessor", "MinLengthLogitsProcessor", "MinNewTokensLengthLogitsProcessor",
            "TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper", "MinPLogitsWarper")


@dataclass(frozen=True)
class Stage:
    """One processor of the plan: its kind and what fixes shapes (the rest are device values)."""

    kind: str  # "repetition" | "min_length" | "temperature" | "top_k" | "top_p" | "min_p"
    k: int = 0  # top_k: candidates kept (a topk shape)
    keep: int = 1  # min_tokens_to_keep (top_p, min_p)
    candidates: bool = False  # top_p right after a top_k of k <= MAX_TOP_P_CANDIDATES: on the k candidates


@dataclass(frozen=True)
class SamplingPlan:
    stages: tuple[Stage, ...]
    processors: tuple  # the call's processor objects, one per stage (their values are loaded per call)
    greedy: bool = False  # argmax of the processed scores (a greedy call's min-length or repetition penalty)


def plan_sampling(logits_processor, vocab_size: int, greedy: bool = False) -> SamplingPlan | str:
    """The device plan for the call's processors (greedy: their argmax instead of a draw), or why the host
    path runs them."""
    if greedy and not len(logits_processor):
        return "greedy without processors (an argmax: nothing to move)"
    stages, processors = [], []
    for processor in logits_processor:
        name = type(processor).__name__
        if name not in _COVERED:
            return f"logits processor {name}"
        if getattr(processor, "filter_value", -math.inf) != -math.inf:
            return f"{name} with filter_value={processor.filter_value}"
        if name == "RepetitionPenaltyLogitsProcessor":
            if any(s.kind == "repetition" for s in stages):
                return "two repetition penalties"
            stage = Stage("repetition")
        elif name in ("MinLengthLogitsProcessor", "MinNewTokensLengthLogitsProcessor"):
            stage = Stage("min_length")
        elif name == "TemperatureLogitsWarper":
            stage = Stage("temperature")
        elif name == "TopKLogitsWarper":
            stage = Stage("top_k", k=min(int(processor.top_k), vocab_size))
        elif name == "TopPLogitsWarper":
            after_top_k = bool(stages) and stages[-1].kind == "top_k" and stages[-1].k <= MAX_TOP_P_CANDIDATES
            stage = Stage("top_p", keep=int(processor.min_tokens_to_keep), candidates=after_top_k)
        else:
            stage = Stage("min_p", keep=min(int(processor.min_tokens_to_keep), vocab_size))
        stages.append(stage)
        processors.append(processor)
    return SamplingPlan(tuple(stages), tuple(processors), greedy)


def _lsr(z: torch.Tensor, shift: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (z >> shift) & ((1 << (64 - shift)) - 1)


def _mix(z: torch.Tensor) -> torch.Tensor:
    """SplitMix64's output function."""
    z = (z ^ _lsr(z, 30)) * _MIX1
    z = (z ^ _lsr(z, 27)) * _MIX2
    return z ^ _lsr(z, 31)


def uniform_noise(seed: torch.Tensor, step: torch.Tensor, row_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """u [rows, V] in (0, 1), a function of (seed, step, row id, token id) only. seed, step: 0-dim int64."""
    key = _mix(seed ^ _mix(step * (1 << 32) + row_ids))  # [rows]: one SplitMix64 stream per (seed, step, row)
    tokens = torch.arange(vocab_size, device=row_ids.device, dtype=torch.long) * _GOLDEN  # [V]
    z = key[:, None] + tokens  # [rows, V]: the stream's token-th state
    z = (z ^ _lsr(z, 30)) * _MIX1
    z = (z ^ _lsr(z, 27)) * _MIX2  # the final xor-shift of _mix leaves the top 23 bits as they are
    return (_lsr(z, 64 - _U_BITS).to(torch.float32) + 0.5) * (2.0 ** -_U_BITS)


def gumbel_race(scores: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """argmax(scores + Gumbel noise) [rows]: a draw from softmax(scores); -inf scores are never drawn."""
    return (scores - torch.log(-torch.log(u))).argmax(dim=-1)


class DeviceSampler:
    """A plan's static state for up to `rows` rows of V logits, and the captured sampler graphs per bucket."""

    def __init__(self, stages: tuple[Stage, ...], rows: int, vocab_size: int, device: torch.device,
                 greedy: bool = False):
        self.stages, self.rows, self.vocab_size, self.device = stages, rows, vocab_size, device
        self.greedy = greedy
        f32 = dict(dtype=torch.float32, device=device)
        self.values = [torch.zeros((), **f32) for _ in stages]  # temperature, penalty, 1 - top_p, min_p
        self.thresholds = [torch.zeros((), dtype=torch.long, device=device) for _ in stages]  # min_length
        self.eos_masks = [torch.zeros(vocab_size, dtype=torch.bool, device=device)
                          if s.kind == "min_length" else None for s in stages]
        # [rows, V + 1]: tokens seen by each row (the extra column takes ignored prompt positions and ids >= V)
        self.seen = (torch.zeros(rows, vocab_size + 1, dtype=torch.bool, device=device)
                     if any(s.kind == "repetition" for s in stages) else None)
        self.seed = torch.zeros((), dtype=torch.long, device=device)
        self.step = torch.zeros((), dtype=torch.long, device=device)  # draws made in this chunk
        self.length = torch.zeros((), dtype=torch.long, device=device)  # input_ids.shape[-1] of the next draw
        self.row_ids = torch.zeros(rows, dtype=torch.long, device=device)  # row of the call (not of the chunk)
        self.logits = torch.zeros(rows, vocab_size, **f32)  # input of the eager path
        self.next_tokens = torch.zeros(rows, dtype=torch.long, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.sources: dict[int, torch.Tensor] = {}  # bucket -> the logits tensor its graph reads
        self.pool = None

    # ----- per call / chunk -------------------------------------------------------------------
    def load(self, plan: SamplingPlan, prompt_ids: torch.Tensor, first_row: int, seed: int,
             call_rows: int) -> None:
        """Set the call's values and reset the counters for a chunk: prompt_ids [n, L] are its rows
        first_row.. of the call's call_rows rows (the rows transformers' processors see)."""
        n, length = prompt_ids.shape
        for i, (stage, processor) in enumerate(zip(plan.stages, plan.processors)):
            if stage.kind == "temperature":
                self.values[i].fill_(float(processor.temperature))
            elif stage.kind == "repetition":
                self.values[i].fill_(float(processor.penalty))
                self._load_seen(processor.prompt_ignore_length, prompt_ids, first_row, call_rows)
            elif stage.kind == "top_p":
                self.values[i].fill_(1 - float(processor.top_p))  # compared in float32, as transformers does
            elif stage.kind == "min_p":
                self.values[i].fill_(float(processor.min_p))
            elif stage.kind == "min_length":
                new_only = type(processor).__name__ == "MinNewTokensLengthLogitsProcessor"
                limit = (processor.prompt_length_to_skip + processor.min_new_tokens if new_only
                         else processor.min_length)
                self.thresholds[i].fill_(int(limit))
                eos = processor.eos_token_id.to(self.device).reshape(-1)
                self.eos_masks[i].copy_(torch.isin(torch.arange(self.vocab_size, device=self.device), eos))
        self.seed.fill_(seed)
        self.step.zero_()
        self.length.fill_(length)
        self.row_ids[:n].copy_(torch.arange(first_row, first_row + n, device=self.device))
        self.logits.zero_()

    def _load_seen(self, ignore, prompt_ids: torch.Tensor, first_row: int, call_rows: int) -> None:
        """transformers' RepetitionPenaltyLogitsProcessor: the prompt's tokens past `prompt_ignore_length`."""
        n, length = prompt_ids.shape
        ids = prompt_ids.to(self.device, torch.long)
        if isinstance(ignore, int):
            ids = ids.masked_fill(torch.arange(length, device=self.device)[None, :] < ignore, self.vocab_size)
        elif isinstance(ignore, torch.Tensor):
            if ignore.shape[0] != call_rows:
                raise ValueError("Incompatible `prompt_ignore_length` batch size")
            ignore = ignore.to(self.device)[first_row:first_row + n]
            ids = ids.masked_fill(torch.arange(length, device=self.device)[None, :] < ignore[:, None],
                                  self.vocab_size)
        self.seen.zero_()
        if length:
            self.seen[:n].scatter_(1, ids.clamp(max=self.vocab_size), True)

    # ----- the step -------------------------------------------------------------------------
    def process(self, scores: torch.Tensor) -> torch.Tensor:
        """The plan's processors on scores [b, V] float32 (not modified): what transformers' list returns."""
        b = scores.shape[0]
        candidates = None  # [b, k] the top-k values, descending, while no later stage changed the scores
        for i, stage in enumerate(self.stages):
            value = self.values[i]
            if stage.kind == "repetition":
                penalised = torch.where(scores < 0, scores * value, scores / value)
                scores = torch.where(self.seen[:b, :self.vocab_size], penalised, scores)
            elif stage.kind == "min_length":
                eos = self.eos_masks[i] & (self.length < self.thresholds[i])  # [V]
                scores = torch.where(eos, -math.inf, scores)
            elif stage.kind == "temperature":
                scores = scores / value
            elif stage.kind == "top_k":
                candidates = torch.topk(scores, stage.k).values  # [b, k] descending
                scores = scores.masked_fill(scores < candidates[:, -1:], -math.inf)
                continue
            elif stage.kind == "top_p":
                scores = (_top_p_candidates(scores, candidates, value, stage.keep) if stage.candidates
                          else _top_p(scores, value, stage.keep))
            else:
                scores = _min_p(scores, value, stage.keep)
            candidates = None
        return scores

    def sample_(self, logits: torch.Tensor) -> torch.Tensor:
        """Process and draw for logits [b, V] (b a bucket); writes and returns next_tokens[:b]; advances the
        counters and the seen tokens. The same ops run eagerly and inside the captured graph."""
        b = logits.shape[0]
        scores = self.process(logits)
        tokens = (scores.argmax(dim=-1) if self.greedy
                  else gumbel_race(scores, uniform_noise(self.seed, self.step, self.row_ids[:b], self.vocab_size)))
        self.next_tokens[:b].copy_(tokens)
        if self.seen is not None:
            self.seen[:b].scatter_(1, tokens[:, None], True)
        self.step.add_(1)
        self.length.add_(1)
        return self.next_tokens[:b]

    # ----- graphs ----------------------------------------------------------------------------
    def capture(self, bucket: int, source: torch.Tensor) -> None:
        """Capture the sampler for `bucket` reading `source` [bucket, V] (the decode graph's logits). Warm-up
        and capture advance the counters: load() comes after."""
        if self.sources.get(bucket) is source:
            return
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        stream = capture_stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            self.sample_(source)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=stream):
            self.sample_(source)
        self.graphs[bucket], self.sources[bucket] = graph, source

    def release(self) -> None:
        self.graphs.clear()
        self.sources.clear()
        self.pool = None


class ChunkSampler:
    """The sampler bound to one chunk: rows live rows in a bucket, through its graph or eagerly."""

    def __init__(self, sampler: DeviceSampler, rows: int, bucket: int, use_graph: bool):
        self.sampler, self.rows, self.bucket, self.use_graph = sampler, rows, bucket, use_graph

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """next tokens [rows] for logits [rows, V] (the prefill's, or the decode step's output)."""
        s = self.sampler
        if self.use_graph:
            source = s.sources[self.bucket]
            if logits.data_ptr() != source.data_ptr():  # the prefill's logits: into the graph's input
                source[:self.rows].copy_(logits)
            s.graphs[self.bucket].replay()
            return s.next_tokens[:self.rows]
        s.logits[:self.rows].copy_(logits)  # the same [bucket, V] shapes as the graph: the same kernels
        return s.sample_(s.logits[:self.bucket])[:self.rows]


def _top_p(scores: torch.Tensor, one_minus_p: torch.Tensor, keep: int) -> torch.Tensor:
    """transformers' TopPLogitsWarper over the whole vocabulary."""
    sorted_logits, sorted_indices = torch.sort(scores, descending=False)
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    remove = cumulative <= one_minus_p
    remove[..., -keep:] = False
    remove = remove.scatter(1, sorted_indices, remove)
    return scores.masked_fill(remove, -math.inf)


def _top_p_candidates(scores: torch.Tensor, candidates: torch.Tensor, one_minus_p: torch.Tensor,
                      keep: int) -> torch.Tensor:
    """TopPLogitsWarper right after TopKLogitsWarper, on the k candidates [b, k] (descending) only.

    After top-k, the kept tokens are those >= the k-th value (ties included, so possibly more than k); the
    others are -inf with probability exactly 0. Ascending, as transformers sorts: first the tokens tied at
    the k-th value that topk left out (`extra`, counted over the vocabulary), then the candidates. top-p
    removes an ascending prefix, so it is a threshold: the smallest candidate kept. Tokens tied with it are
    all kept (transformers' unstable sort may drop some of a tie that straddles the boundary); otherwise the
    mask is transformers' up to the rounding of the softmax sum at the boundary."""
    kth = candidates[:, -1:]  # [b, 1]
    extra = (scores == kth).sum(-1, keepdim=True) - (candidates == kth).sum(-1, keepdim=True)  # [b, 1]
    top = candidates[:, :1]
    weights = torch.exp(candidates.flip(-1) - top)  # [b, k] ascending
    kth_weight = weights[:, :1]
    total = weights.sum(-1, keepdim=True) + extra * kth_weight
    cumulative = (weights / total).cumsum(dim=-1) + extra * (kth_weight / total)
    remove = cumulative <= one_minus_p
    remove[..., -keep:] = False
    threshold = candidates.flip(-1).masked_fill(remove, math.inf).amin(-1, keepdim=True)  # [b, 1]
    return scores.masked_fill(scores < threshold, -math.inf)


def _min_p(scores: torch.Tensor, min_p: torch.Tensor, keep: int) -> torch.Tensor:
    """transformers' MinPLogitsWarper."""
    probs = torch.softmax(scores, dim=-1)
    remove = probs < min_p * probs.amax(dim=-1, keepdim=True)
    if keep > 1:  # with keep == 1 the kept token is a most probable one, never removed (min_p <= 1)
        remove = remove.scatter(-1, torch.topk(probs, keep, dim=-1).indices, False)
    return scores.masked_fill(remove, -math.inf)

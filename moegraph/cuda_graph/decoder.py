"""The decoder behind a patched `model.generate()`.

transformers still normalizes the call (generation config, special tokens, attention mask,
position ids, max_length, logits processors, stopping criteria): moegraph hands it a
`custom_generate` callable, so only the decoding loop is ours. That loop prefills once with the
model's own forward, compacts the prompt's K/V into the static cache, then decodes by replaying
the graph of the smallest bucket that holds the live rows. Sampling and EOS bookkeeping stay on
the device; the host checks "all rows finished" every `check_every` steps.
Calls the loop does not support go to transformers unchanged, with one log line saying why.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import traceback
from dataclasses import dataclass, field

import torch
from torch import nn

from ..errors import InvalidArgumentError, OutOfMemoryError
from ..moe.interface import backend_of, model_experts_implementation
from ..ops import ops_for_model
from ..options import PatchOptions
from . import hf_cache, prefill, sampling, support
from .family import FamilySteps
from .graphs import BucketGraphs, StaticInputs, batch_buckets, bucket_for, weight_slots, weights_signature
from .static_cache import SEQ_ALIGN, StaticKVCache, compaction_order, round_up

logger = logging.getLogger("moegraph")


@dataclass
class DecodeStats:
    """What the last generate() did, over the whole call (every chunk of a split batch, summed).

    Reset at the start of every call: a call that fell back has only `fallback_reason`, one that
    raised has nothing. `host_ms_per_step` is CPU time spent issuing a step; `capture_seconds` is the
    time this call spent capturing graphs and `captures` how many it captured (0 when they were ready)."""

    graphs: bool = False
    batch_size: int = 0
    chunks: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    steps: int = 0
    host_seconds: float = 0.0
    capture_seconds: float = 0.0
    captures: int = 0
    fallback_reason: str | None = None
    # "device" (moegraph's sampler), "transformers: <why>" (host path), "greedy" (argmax; with processors on the
    # host: "greedy: <why>") or "greedy: device processors" (a greedy call's processors in moegraph's sampler)
    sampling: str | None = None
    # "graphs" (token rows through the decode step, cuda_graph/prefill.py) or "transformers: <why>"
    prefill: str | None = None

    @property
    def host_ms_per_step(self) -> float:
        return 1e3 * self.host_seconds / max(self.steps, 1)


@dataclass
class _Prompt:
    """The prompt as transformers prepared it for the call, and where its K/V come from and go.

    transformers' own prefill is reproduced: an input cache holding `past` positions means only
    the uncached suffix is run (`next_sequence_length`, sliced as transformers' `_prefill` slices it).
    """

    model_kwargs: dict  # what transformers passes to the prefill (mask, position ids, embeds, logits_to_keep, ...)
    batch_kwargs: tuple  # the names in model_kwargs whose tensors hold a row per batch row
    cache_name: str  # the cache's keyword in model_kwargs and in the model's forward
    cache: object | None  # the call's transformers Cache (fresh, or the user's); None with use_cache=False
    keep_cache: bool  # the Cache outlives the call (returned, or the user's): generated K/V go into it
    past: int  # positions `cache` held before the call
    next_sequence_length: int | None  # the uncached suffix of the input; None: all of it
    kv_width: int  # positions after the prefill: past + the prefilled input
    rope_start: torch.Tensor  # [rows] int64: transformers' position id of the first generated token

    def rows_kwargs(self, rows: slice, batch: int) -> dict:
        """model_kwargs for rows `rows` of a batch of `batch` rows (the batch-shaped tensors sliced)."""
        kwargs = dict(self.model_kwargs)
        for name in self.batch_kwargs:
            value = kwargs.get(name)
            if name == "position_ids" and isinstance(value, torch.Tensor) and value.dim() == 3:
                if value.shape[1] == batch:  # several RoPE components: [components, rows, length]
                    kwargs[name] = value[:, rows]
            elif isinstance(value, torch.Tensor) and value.shape[0] == batch:
                kwargs[name] = value[rows]
        return kwargs


@dataclass
class _Call:
    """Per-call settings of the decode loop, read from what transformers prepared."""

    logits_processor: object
    generation_config: object
    streamer: object
    eos: torch.Tensor | None  # [n_eos] or None: no EOS stopping
    pad: torch.Tensor | None
    do_sample: bool
    max_length: int
    max_new: int  # new tokens at most: max_length - input_ids.shape[1]
    keep_scores: bool
    keep_logits: bool
    prompt: _Prompt
    stats: DecodeStats
    plan: sampling.SamplingPlan | None = None  # sampling on the device; None: transformers' processors
    seed: int = 0  # of the device sampler's draws, taken once per call from torch's default generator
    scores: list = field(default_factory=list)
    raw_logits: list = field(default_factory=list)


@dataclass
class _Rows:
    """What decoding one chunk of rows left: its tokens, and its part of the returned Cache."""

    tokens: torch.Tensor  # [n, input + produced]
    produced: int
    cache: object | None  # the chunk's transformers Cache (prefill + generated K/V) when the call keeps one
    attention_mask: torch.Tensor | None
    rope_start: torch.Tensor


def _first_line(exc: Exception) -> str:
    """'Type: first line of the message', what a warning line and decode_stats() say of a failed capture."""
    message = str(exc)
    return f"{type(exc).__name__}: {message.splitlines()[0] if message else ''}"


class GraphDecoder:
    def __init__(self, model: nn.Module, options: PatchOptions, family: FamilySteps):
        """family: what the model's family gives the decoder (its decode step and its checks; moegraph.models)."""
        self.model = model
        self.options = options
        self.family = family
        self.decode_step = family.decode_step
        self.buckets = batch_buckets(options.max_batch_size)
        self.cache: StaticKVCache | None = None
        self.inputs: StaticInputs | None = None
        self.graphs: BucketGraphs | None = None
        self.prefill_graphs: BucketGraphs | None = None  # keyed by token bucket
        self.prefill_inputs: prefill.PrefillInputs | None = None
        self.stats = DecodeStats()
        self._warned: set[str] = set()
        self._capture_error: str | None = None  # set when a capture failed: decode eagerly from then on
        self._prefill_capture_error: str | None = None  # the same for the prefill graphs
        self.ops = None  # the OpTable of the decode step, resolved with the static cache
        self._weight_slots: list = []  # where the step reads its weights (graphs.weight_slots), with the cache
        self._weights: tuple = ()  # their storage pointers when the cache and graphs were built
        self.graphs_captured = 0  # over the decoder's life: a call that needs no new graph adds nothing
        self.capture_seconds = 0.0
        # The static cache, its inputs and the graphs are shared by every call: one call at a time.
        self._lock = threading.Lock()
        self._owner: int | None = None  # the thread inside generate()/capture()
        self._release_when_done = False
        self._samplers: dict = {}  # (plan stages, vocab) -> DeviceSampler, dropped with the static cache

    # ----- lifecycle -------------------------------------------------------------------------
    def release(self, what: str = "unpatch()") -> None:
        """Free the static cache and graphs: after the running call if there is one (this thread's: unpatch()
        or free_cache() from a streamer frees them when that generate() returns; another thread's: waits for it)."""
        if self._owner == threading.get_ident():
            self._release_when_done = True
            return
        with self._exclusive(what):
            self._free()

    @contextlib.contextmanager
    def _exclusive(self, what: str):
        """Serialise generate(), capture() and release() of this model across threads; a second thread waits
        for the first call to return instead of decoding into the same static rows."""
        if self._owner == threading.get_ident():
            raise InvalidArgumentError(f"moegraph: {what} was called from inside generate() of the same model "
                                       "(from a streamer?); call it after that generate() returns")
        if not self._lock.acquire(blocking=False):
            logger.info("moegraph: %s waits for another thread's call on this model to return (calls on one "
                        "model are serialised)", what)
            self._lock.acquire()
        self._owner = threading.get_ident()
        try:
            yield
        finally:
            if self._release_when_done:
                self._release_when_done = False
                self._free()
            self._owner = None
            self._lock.release()

    def _free(self) -> None:
        for graphs in (self.graphs, self.prefill_graphs):
            if graphs is not None:
                graphs.release()
        self.graphs = self.prefill_graphs = self.cache = self.inputs = self.prefill_inputs = None
        self._samplers = {}  # their graphs read the decode graphs' logits
        self._weight_slots, self._weights = [], ()

    def graphs_enabled(self) -> bool:
        device = self.model.device
        if device.type != "cuda" or not self.options.cuda_graphs or self._capture_error is not None:
            return False
        ops = self._ops()
        if not ops.capture_safe:
            self._warn_once(f"moegraph: the decode step is not capture-safe here; decoding eagerly without CUDA "
                            f"graphs.\n{ops.describe()}")
        return ops.capture_safe

    def _ops(self):
        """The decode step's op table, for the experts implementation the model dispatches on now (a moegraph
        name picks the MoE backend; generate() falls back for any other; capture() then uses the patch's)."""
        backend = backend_of(model_experts_implementation(self.model)) or self.options.moe_backend
        return ops_for_model(self.model, backend)

    def capture(self, batch_size: int | None = None, max_length: int | None = None) -> None:
        """Allocate the static cache and capture the graphs now instead of at the first generate().

        max_length: prompt + new tokens to prepare for (default: max_seq_len, else 256)."""
        with self._exclusive("moegraph.capture()"):
            self._capture_now(batch_size, max_length)

    def _capture_now(self, batch_size: int | None, max_length: int | None) -> None:
        rows = min(batch_size or self.options.max_batch_size, self.options.max_batch_size)
        limit = self.options.max_seq_len
        if max_length is None:
            max_length = limit or SEQ_ALIGN
        if limit is not None and max_length > limit:
            raise InvalidArgumentError(f"capture(max_length={max_length}) exceeds max_seq_len={limit}; pass "
                                       f"max_length <= {limit}, or patch with a larger max_seq_len")
        use_graphs = self.graphs_enabled()
        self._ensure_capacity(rows, max_length, use_graphs)
        if use_graphs and prefill.resolve_mode(self.options.prefill, self.model.device) == "graphs":
            self._capture_prefill(prefill.token_buckets_up_to(rows * max_length))
        if not use_graphs:
            logger.info("moegraph: capture(): %s; the static KV cache (%d rows x %d positions) is ready for the "
                        "eager decode loop", self._why_no_graphs(), self.cache.rows, self.cache.positions)

    def _why_no_graphs(self) -> str:
        if not self.options.cuda_graphs:
            return "no CUDA graphs (cuda_graphs=False)"
        if self.model.device.type != "cuda":
            return f"no CUDA graphs on {self.model.device.type}"
        if self._capture_error is not None:
            return f"no CUDA graphs (a capture failed: {self._capture_error})"
        return "no CUDA graphs (the decode step is not capture-safe here)"

    # ----- generate() entry -------------------------------------------------------------------
    def generate(self, hf_generate, args: tuple, kwargs: dict):
        with self._exclusive("generate()"):
            return self._generate(hf_generate, args, kwargs)

    def _generate(self, hf_generate, args: tuple, kwargs: dict):
        self.stats = DecodeStats()  # whatever this call does (or raises), stats describe this call only
        reason = support.check_call(self.model, args, kwargs, self.family)
        if reason is not None:
            return self._fall_back(reason, hf_generate, args, kwargs)
        streamer = kwargs.get("streamer")

        def decode(model, input_ids, logits_processor, stopping_criteria, generation_config, **model_kwargs):
            return self._decode(input_ids, logits_processor, stopping_criteria, generation_config, streamer,
                                model_kwargs)

        return hf_generate(*args, custom_generate=decode, **kwargs)

    def _fall_back(self, reason: str, hf_generate, args, kwargs):
        self._record_fallback(reason)
        return hf_generate(*args, **kwargs)

    def _record_fallback(self, reason: str, once_key: str | None = None) -> None:
        """Record why this call left the fast path; say it once per model and reason (`once_key`)."""
        self.stats = DecodeStats(fallback_reason=reason)
        key = once_key or reason
        if key not in self._warned:
            self._warned.add(key)
            logger.warning("moegraph: generate() falls back to transformers: %s is not supported by the graph "
                           "decoder (logged once per model and reason)", reason)

    def _decode(self, input_ids, logits_processor, stopping_criteria, generation_config, streamer, model_kwargs):
        rows = input_ids.shape[0]
        reason = (support.check_prepared(logits_processor, stopping_criteria)
                  or support.check_compile(self.model, generation_config, model_kwargs))
        once_key = None
        if reason is None and generation_config.return_dict_in_generate and rows > self.options.max_batch_size \
                and (generation_config.output_scores or generation_config.output_logits):
            reason = f"output_scores/output_logits with more rows ({rows}) than max_batch_size"
        prompt = None
        if reason is None:
            prompt = self._plan_prompt(input_ids, generation_config, model_kwargs)
            if isinstance(prompt, str):
                reason, prompt = prompt, None
        max_new = int(generation_config.max_length) - input_ids.shape[1]
        if reason is None and self.options.max_seq_len is not None \
                and prompt.kv_width + max_new > self.options.max_seq_len:
            reason = (f"a call needing {prompt.kv_width + max_new} positions ({prompt.kv_width} prompt + {max_new} "
                      f"new tokens) with max_seq_len={self.options.max_seq_len} (raise max_seq_len, or leave it "
                      "None to grow the static cache on demand)")
            once_key = "max_seq_len"
        if reason is None and self.family.check_positions is not None:
            reason = self.family.check_positions(self.model, prompt.kv_width + max_new)
            once_key = "positions"
        if reason is None and self.family.check_prompt is not None:
            reason = self.family.check_prompt(self.model, prompt.model_kwargs.get("attention_mask"),
                                              prompt.kv_width + max_new)
            once_key = "prompt"
        if reason is not None:
            from transformers.generation.utils import GenerationMixin

            self._record_fallback(reason, once_key)
            return GenerationMixin._sample(self.model, input_ids, logits_processor=logits_processor,
                                           stopping_criteria=stopping_criteria, generation_config=generation_config,
                                           synced_gpus=False, streamer=streamer, **model_kwargs)
        has_eos = any(type(c).__name__ == "EosTokenCriteria" for c in stopping_criteria)
        call = _Call(
            logits_processor=logits_processor,
            generation_config=generation_config,
            streamer=streamer,
            eos=generation_config._eos_token_tensor.to(input_ids.device).reshape(-1) if has_eos else None,
            pad=generation_config._pad_token_tensor,
            do_sample=bool(generation_config.do_sample),
            max_length=int(generation_config.max_length),
            max_new=max_new,
            keep_scores=bool(generation_config.return_dict_in_generate and generation_config.output_scores),
            keep_logits=bool(generation_config.return_dict_in_generate and generation_config.output_logits),
            prompt=prompt,
            stats=DecodeStats(batch_size=rows),
        )
        if has_eos and call.pad is None:
            raise ValueError("EOS stopping needs a pad_token_id for finished rows; pass pad_token_id=... to generate()")
        self._plan_sampling(call)
        sequences = self._decode_in_chunks(input_ids, call)
        self.stats = call.stats
        if streamer is not None:
            streamer.end()
        if not generation_config.return_dict_in_generate:
            return sequences
        from transformers.generation.utils import GenerateDecoderOnlyOutput

        return GenerateDecoderOnlyOutput(**{
            "sequences": sequences,
            "scores": tuple(call.scores) if call.keep_scores else None,
            "logits": tuple(call.raw_logits) if call.keep_logits else None,
            hf_cache.output_cache_field(): prompt.cache,
        })

    def _plan_prompt(self, input_ids, generation_config, model_kwargs) -> _Prompt | str:
        """Read the call's prompt and cache as transformers prepared them; a str is a reason to fall back."""
        rows = input_ids.shape[0]
        name = hf_cache.cache_argument(model_kwargs) or hf_cache.forward_cache_argument(self.model)
        cache = model_kwargs.get(name)
        past = 0
        if cache is not None:
            past = hf_cache.past_length(cache)
            if past and hf_cache.rows_of(cache) != rows:
                return f"a cache of {hf_cache.rows_of(cache)} rows for {rows} input rows"
        embeds = model_kwargs.get("inputs_embeds")
        mask = model_kwargs.get("attention_mask")
        width = embeds.shape[1] if embeds is not None else input_ids.shape[1]
        next_sequence_length = None
        if past:  # as transformers' _prefill: run only what the cache does not hold yet
            if embeds is not None:
                next_sequence_length = width - past
            else:
                mask_length = mask.shape[1] if mask is not None else getattr(generation_config, "_mask_length", -1)
                if mask_length == input_ids.shape[1]:
                    next_sequence_length = input_ids.shape[1] - past
            if next_sequence_length is not None and next_sequence_length <= 0:
                return f"an input of {width} positions that a cache of {past} already holds (nothing to prefill)"
        kv_width = past + (width if next_sequence_length is None else next_sequence_length)
        max_new = int(generation_config.max_length) - input_ids.shape[1]
        room = hf_cache.capacity(cache) if cache is not None else None
        if room is not None and kv_width + max_new - 1 > room:
            return f"a static cache of {room} positions for {kv_width + max_new - 1}"
        position_ids = model_kwargs.get("position_ids")
        if isinstance(position_ids, torch.Tensor) and position_ids.dim() == 3:  # several RoPE components
            if self.family.text_position_ids is None:
                return f"position_ids of shape {tuple(position_ids.shape)} (3-D)"
            position_ids = self.family.text_position_ids(position_ids)
            if isinstance(position_ids, str):
                return position_ids
        reason = support.check_prompt(mask, position_ids, rows, kv_width)
        if reason is not None:
            return reason
        if position_ids is not None:  # transformers' decode step i runs at position_ids[:, -1] + 1 + i
            rope_start = (position_ids[:, -1].to(torch.long) + 1).expand(rows).contiguous()
        else:
            rope_start = (mask.sum(1) if mask is not None
                          else torch.full((rows,), kv_width, dtype=torch.long, device=input_ids.device))
        user_cache = bool(getattr(cache, "_is_user_defined", False))
        return _Prompt(
            model_kwargs={k: v for k, v in model_kwargs.items() if k not in hf_cache.CACHE_ARGUMENTS},
            batch_kwargs=("attention_mask", "position_ids", "inputs_embeds", *sorted(self.family.input_kwargs)),
            cache_name=name, cache=cache,
            keep_cache=cache is not None and (bool(generation_config.return_dict_in_generate) or user_cache),
            past=past, next_sequence_length=next_sequence_length, kv_width=kv_width,
            rope_start=rope_start.to(input_ids.device, torch.long))

    def _plan_sampling(self, call: _Call) -> None:
        """The device sampler when the call samples, or is greedy with processors (min_new_tokens, a repetition
        penalty): their ops and the draw or argmax run in a captured graph instead of a dozen launches a step;
        when the setting allows it and the plan covers the processors."""
        greedy = not call.do_sample
        mode = self.options.sampling
        if greedy and not len(call.logits_processor):
            call.stats.sampling = "greedy"
            return
        host = "greedy" if greedy else "transformers"  # what runs where the device sampler does not
        if mode == "transformers" or (mode == "auto" and self.model.device.type != "cuda"):
            call.stats.sampling = f"{host}: sampling={mode!r} on {self.model.device.type}"
            return
        if call.keep_scores:
            call.stats.sampling = f"{host}: output_scores (transformers' processors return the scores)"
            return
        vocab = self.model.get_output_embeddings().weight.shape[0]
        plan = sampling.plan_sampling(call.logits_processor, vocab, greedy=greedy)
        if isinstance(plan, str):
            call.stats.sampling = f"{host}: {plan}"
            return
        call.plan = plan
        # the draw's seed, from the default generator (torch.manual_seed reproduces); a greedy call takes none
        call.seed = 0 if greedy else int(torch.randint(0, 1 << 62, ()))
        call.stats.sampling = "greedy: device processors" if greedy else "device"

    def _chunk_sampler(self, call: _Call, input_ids, part: slice, logits, rows: int, use_graphs: bool):
        """The device sampler for this chunk (its graph captured for the chunk's bucket), loaded with the call."""
        bucket = bucket_for(rows, self.buckets)
        key = (call.plan.stages, call.plan.greedy, logits.shape[-1])
        sampler = self._samplers.get(key)
        if sampler is None or sampler.rows < bucket:
            if len(self._samplers) >= 8:  # each holds a few [rows, V] buffers and its graph pool
                self._samplers.clear()
            sampler = self._samplers[key] = sampling.DeviceSampler(key[0], self.cache.rows, key[2], logits.device,
                                                                         greedy=key[1])
        if use_graphs:
            try:
                sampler.capture(bucket, self.graphs.outputs[bucket])  # before load(): capturing runs the sampler
            except torch.OutOfMemoryError as exc:
                raise self._out_of_memory(f"capturing the sampler graph (batch bucket {bucket})", exc) from None
            except Exception as exc:  # the eager sampler draws the same tokens
                sampler.release()
                self._warn_once(f"moegraph: capturing the sampler failed ({type(exc).__name__}: {exc}); sampling "
                                "eagerly after each replayed step")
                use_graphs = False
        sampler.load(call.plan, input_ids, part.start, call.seed, call_rows=call.prompt.rope_start.shape[0])
        return sampling.ChunkSampler(sampler, rows, bucket, use_graphs)

    # ----- the loop ---------------------------------------------------------------------------
    def _decode_in_chunks(self, input_ids, call: _Call) -> torch.Tensor:
        """Batches above max_batch_size are decoded in chunks of max_batch_size rows, then joined."""
        rows = input_ids.shape[0]
        step = self.options.max_batch_size
        parts = [slice(start, min(start + step, rows)) for start in range(0, rows, step)]
        if len(parts) > 1:
            logger.info("moegraph: batch of %d rows is decoded in chunks of max_batch_size=%d", rows, step)
        done = [self._decode_rows(input_ids, part, call, whole_batch=len(parts) == 1) for part in parts]
        width = max(d.tokens.shape[1] for d in done)
        fill = int(call.pad) if call.pad is not None else 0
        # a chunk that stopped early has only finished rows: transformers pads those rows, as here
        sequences = torch.cat([nn.functional.pad(d.tokens, (0, width - d.tokens.shape[1]), value=fill) for d in done])
        if call.prompt.keep_cache and len(parts) > 1:
            self._join_chunk_caches(call, done, parts, sequences, input_ids.shape[1])
        return sequences

    @torch.no_grad()
    def _decode_rows(self, all_input_ids, part: slice, call: _Call, whole_batch: bool) -> _Rows:
        prompt = call.prompt
        input_ids = all_input_ids[part]
        rows, prompt_len = input_ids.shape
        device = input_ids.device
        max_new = call.max_new
        stats = call.stats
        use_graphs = self.graphs_enabled()
        captured_before, seconds_before = self.graphs_captured, self.capture_seconds
        try:
            self._ensure_capacity(rows, prompt.kv_width + max_new, use_graphs)
        except OutOfMemoryError:  # not a capture failure: the next call that fits captures again
            raise
        except Exception as exc:  # a failed capture must not lose the output: decode eagerly instead
            if not use_graphs:
                raise
            self._capture_error = _first_line(exc)
            self._warn_once(f"moegraph: CUDA graph capture failed ({self._capture_error}); decoding eagerly")
            if self.graphs is not None:
                self.graphs.release()
            use_graphs = False
            self._ensure_capacity(rows, prompt.kv_width + max_new, use_graphs)
        stats.graphs = stats.graphs or use_graphs
        stats.chunks += 1
        stats.captures += self.graphs_captured - captured_before
        stats.capture_seconds += self.capture_seconds - seconds_before

        start = time.perf_counter()
        kwargs = prompt.rows_kwargs(part, all_input_ids.shape[0])
        rope_start = prompt.rope_start[part]
        mask = kwargs.get("attention_mask")
        token_rows = self._token_rows(stats, prompt, kwargs, input_ids, rope_start)
        if token_rows is not None:  # the prompts as rows of the decode step, straight into the static cache
            captured_before, seconds_before = self.graphs_captured, self.capture_seconds
            logits, lengths, prefill_cache = self._prefill_rows(token_rows, use_graphs), token_rows.lengths, None
            if prompt.keep_cache:  # the prompt's K/V, from the static cache, into the cache the call returns
                prefill_cache = self._chunk_cache(prompt, part, whole_batch)
                hf_cache.append_kv(prefill_cache, prefill.prompt_kv(self.cache, token_rows, input_ids.shape[1]))
            stats.captures += self.graphs_captured - captured_before
            stats.capture_seconds += self.capture_seconds - seconds_before
        else:
            logits, lengths, prefill_cache = self._prefill_with_transformers(input_ids, kwargs, prompt, part,
                                                                             whole_batch)
        self.inputs.clear()  # padding rows of a bucket read token 0 at position 0 of their own rows
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        stats.prefill_seconds += time.perf_counter() - start

        start = time.perf_counter()
        tokens = torch.full((rows, prompt_len + max_new), int(call.pad) if call.pad is not None else 0,
                            dtype=torch.long, device=device)
        tokens[:, :prompt_len] = input_ids
        unfinished = torch.ones(rows, dtype=torch.bool, device=device)
        alive = torch.ones(max_new, dtype=torch.bool, device=device)  # [step]: some row unfinished after it
        check_every = 1 if call.streamer is not None else self.options.check_every
        sample = (self._chunk_sampler(call, input_ids, part, logits, rows, use_graphs)
                  if call.plan is not None else None)
        pad = int(call.pad) if call.eos is not None else 0
        next_inputs = (self.inputs.token_ids[:rows], self.inputs.positions[:rows], self.inputs.rope_positions[:rows])
        step = 0
        for step in range(max_new):
            issued = time.perf_counter()
            next_tokens = self._select(call, tokens[:, :prompt_len + step], logits, sample)
            last = step + 1 == max_new
            # EOS (finished rows padded), the output column, the next step's inputs: one launch on CUDA
            self.ops.advance(next_tokens, tokens, prompt_len + step, unfinished, call.eos, pad, alive, step,
                             lengths, rope_start, None if last else next_inputs)
            if not last:
                logits = self._step(rows, use_graphs)
            stats.host_seconds += time.perf_counter() - issued
            if call.streamer is not None:
                call.streamer.put(tokens[:, prompt_len + step].cpu())
            if last or (call.eos is not None and (step + 1) % check_every == 0 and not bool(alive[step])):
                break
        produced = step + 1
        if call.eos is not None:
            finished_at = (~alive[:produced]).nonzero()
            if finished_at.numel():
                produced = int(finished_at[0, 0]) + 1
        if prefill_cache is not None:  # the generated tokens' K/V, but the last token's: it was never run
            hf_cache.append_kv(prefill_cache, self.cache.read(lengths, produced - 1))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        stats.decode_seconds += time.perf_counter() - start
        stats.steps += step + 1
        if call.keep_scores:
            del call.scores[len(call.scores) - (step + 1 - produced):]
        if call.keep_logits:
            del call.raw_logits[len(call.raw_logits) - (step + 1 - produced):]
        return _Rows(tokens[:, :prompt_len + produced], produced, prefill_cache, mask, rope_start)

    def _token_rows(self, stats: DecodeStats, prompt: _Prompt, kwargs: dict, input_ids, rope_start):
        """The chunk's prompts as token rows when the prefill mode takes them, else None (stats say why not)."""
        why = prefill.why_not_graphs(self.options.prefill, prompt, self.model.device)
        rows = None
        if why is None:
            positions = prefill.text_positions(kwargs.get("position_ids"))
            mask = kwargs.get("attention_mask")
            if isinstance(positions, str):
                why = positions
            elif mask is not None and not bool(mask[:, -1].all()):  # one host sync per chunk
                why = "padding after a prompt (transformers predicts its first token from the last column, padding)"
            else:
                rows = prefill.token_rows(input_ids, mask, rope_start, positions)
                if rows.count > prefill.MAX_TOKENS:
                    why = f"{rows.count} prompt tokens (token rows up to {prefill.MAX_TOKENS})"
        stats.prefill = "graphs" if why is None else f"transformers: {why}"
        return rows if why is None else None

    def _chunk_cache(self, prompt: _Prompt, part: slice, whole_batch: bool):
        """The transformers cache a chunk's prefill fills: the call's own when it keeps one and this chunk is the
        whole batch (it ends up holding the call), else a DynamicCache seeded with the chunk's cached positions."""
        if prompt.keep_cache and whole_batch:
            return prompt.cache
        return hf_cache.seeded_cache(self.model.config, prompt.cache, part, prompt.past)

    def _prefill_with_transformers(self, input_ids, kwargs: dict, prompt: _Prompt, part: slice, whole_batch: bool):
        """transformers' forward over the prompt, its K/V then copied into the static cache: (first logits, lengths
        [n], the transformers cache the call keeps, else None)."""
        rows = input_ids.shape[0]
        prefill_cache = self._chunk_cache(prompt, part, whole_batch)
        logits = self._prefill(input_ids, kwargs, prefill_cache, prompt)
        order, lengths = compaction_order(kwargs.get("attention_mask"))
        if lengths is None:
            lengths = torch.full((rows,), prompt.kv_width, dtype=torch.long, device=input_ids.device)
        self.cache.load_prefill(hf_cache.layers_kv(prefill_cache, prompt.kv_width), order)
        return logits, lengths, prefill_cache if prompt.keep_cache else None

    def _select(self, call: _Call, input_ids: torch.Tensor, logits: torch.Tensor, sample=None) -> torch.Tensor:
        if call.keep_logits:
            call.raw_logits.append(logits.clone())
        if sample is not None:  # moegraph's sampler: its processors and draw on the device (captured on CUDA)
            return sample(logits)
        scores = call.logits_processor(input_ids, logits)
        if call.keep_scores:
            call.scores.append(scores.clone() if scores is logits else scores)
        if call.do_sample:
            return torch.multinomial(nn.functional.softmax(scores, dim=-1), num_samples=1).squeeze(1)
        return torch.argmax(scores, dim=-1)

    def _prefill(self, input_ids, kwargs: dict, cache, prompt: _Prompt) -> torch.Tensor:
        """transformers' own prefill of the uncached input into `cache`; returns the last logits [n, V] float32.
        A long prompt runs in chunks (prefill.transformers_chunks), each one's K/V in `cache` for the next."""
        kwargs = dict(kwargs, use_cache=True)
        kwargs[prompt.cache_name] = cache
        embeds = kwargs.get("inputs_embeds")
        width = embeds.shape[1] if embeds is not None else input_ids.shape[1]
        new = prompt.kv_width - prompt.past
        start = width - new
        for end in prefill.transformers_chunks(input_ids.shape[0], width, new, kwargs):
            last = end == width
            chunk_kwargs = kwargs if last else dict(prefill.prefix_kwargs(kwargs, end), logits_to_keep=1)
            # one forward: transformers' own call; a chunk: the positions [start, end) after those cached
            uncached = prompt.next_sequence_length if start == width - new and last else end - start
            inputs = self.model.prepare_inputs_for_generation(
                input_ids if last else input_ids[:, :end], next_sequence_length=uncached, is_first_iteration=True,
                **chunk_kwargs)
            out = self.model(**inputs, return_dict=True)
            start = end
        return out.logits[:, -1].to(dtype=torch.float32, copy=True)

    def _join_chunk_caches(self, call: _Call, done: list[_Rows], parts: list[slice], sequences, input_len: int):
        """One Cache for a batch decoded in chunks, holding what transformers' single loop would leave.

        transformers runs every row until the whole batch stops, so rows of a chunk that stopped
        earlier are also run on their padding tokens: their K/V are computed here, by transformers'
        forward, for the steps the chunk did not run."""
        prompt = call.prompt
        produced = max(d.produced for d in done)
        for d, part in zip(done, parts):
            missing = produced - d.produced
            if missing == 0:
                continue
            run = sequences[part, input_len + d.produced - 1:input_len + produced - 1]  # [n, missing]
            first = d.produced - 1
            kwargs = {"use_cache": True, "logits_to_keep": 1, prompt.cache_name: d.cache,
                      "position_ids": d.rope_start[:, None] + first + torch.arange(missing, device=run.device)}
            if d.attention_mask is not None:
                kwargs["attention_mask"] = nn.functional.pad(d.attention_mask, (0, first + missing), value=1)
            self.model(input_ids=run, **kwargs)
        joined = [(torch.cat([d.cache.layers[i].keys[:, :, prompt.past:] for d in done]),
                   torch.cat([d.cache.layers[i].values[:, :, prompt.past:] for d in done]))
                  for i in range(len(done[0].cache.layers))]
        hf_cache.append_kv(prompt.cache, joined)
        hf_cache.match_lengths(prompt.cache, done[0].cache)  # every chunk ran to the same length

    def eager_step(self, rows: int) -> torch.Tensor:
        """One decode step of the first `rows` rows of the static inputs, not captured (for profiling)."""
        with self._exclusive("a profiled decode step"):
            if self.cache is None or rows > self.cache.rows:
                raise InvalidArgumentError(f"no static cache for {rows} rows: call moegraph.capture(model, "
                                           f"batch_size={rows}) first")
            return self._forward(rows)

    def replay_step(self, rows: int) -> torch.Tensor:
        """Replay the captured graph of rows' bucket once (for timing); the graphs must be captured."""
        with self._exclusive("a replayed decode step"):
            if self.graphs is None or bucket_for(rows, self.buckets) not in self.graphs.graphs:
                raise InvalidArgumentError(f"no captured decode graph for {rows} rows: call moegraph.capture(model, "
                                           f"batch_size={rows}) on a CUDA model first")
            return self.graphs.replay(bucket_for(rows, self.buckets))[:rows]

    def _step(self, rows: int, use_graphs: bool) -> torch.Tensor:
        bucket = bucket_for(rows, self.buckets)
        if use_graphs:
            return self.graphs.replay(bucket)[:rows]
        if self.ops.device.type == "cuda":
            # the replay's shapes, padding rows included: a kernel may pick its tiles by the row count (cuBLAS
            # does), so only equal shapes make the eager loop equal the replay bit for bit
            return self._forward(bucket)[:rows]
        return self._forward(rows)

    def _forward(self, rows: int) -> torch.Tensor:
        return self.decode_step(self.model, self.cache, self.inputs.token_ids[:rows], self.inputs.positions[:rows],
                              self.ops, self.inputs.rope_positions[:rows])

    def _prefill_forward(self, tokens: int, prompts: int | None = None) -> torch.Tensor:
        """The decode step over the first `tokens` token rows: logits [prompts, V] of each prompt's last token.
        prompts None (graphs, and eager runs on CUDA): every row of the static cache, so that one graph per token
        bucket serves every batch (the lm_head reads its weights once whatever the rows; spare rows read row 0)."""
        p = self.prefill_inputs
        last = p.last if prompts is None else p.last[:prompts]
        return self.decode_step(self.model, self.cache, p.token_ids[:tokens], p.positions[:tokens], self.ops,
                                p.rope_positions[:tokens], cache_rows=p.cache_rows[:tokens], logit_rows=last)

    def _prefill_rows(self, rows: prefill.TokenRows, use_graphs: bool) -> torch.Tensor:
        """First logits [n, V] float32 of the n prompts in `rows`, their K/V written into the static cache."""
        n = rows.last.shape[0]
        tokens = prefill.token_bucket(rows.count)
        self.prefill_inputs.load(rows, tokens, spare_position=self.cache.positions - 1)
        if use_graphs and self._capture_prefill([tokens]):
            return self.prefill_graphs.replay(tokens)[:n].clone()
        if self.ops.device.type == "cuda":  # the replay's shapes: the eager loop equals it bit for bit
            return self._prefill_forward(tokens)[:n]
        return self._prefill_forward(rows.count, n)

    def _capture_prefill(self, buckets: list[int]) -> bool:
        """Capture the prefill graphs of these token buckets that are missing; False once a capture has failed
        (the token-row prefill then runs eagerly: the same first tokens)."""
        if self._prefill_capture_error is not None:
            return False
        try:
            captured, seconds = self.prefill_graphs.capture(buckets, self.model.device, show_progress=False)
        except torch.OutOfMemoryError as exc:
            raise self._out_of_memory(f"capturing a prefill graph ({max(buckets)} token rows)", exc) from None
        except Exception as exc:
            self._prefill_capture_error = _first_line(exc)
            self._warn_once(f"moegraph: capturing the prefill graph failed ({self._prefill_capture_error}); "
                            "running the token-row prefill eagerly")
            return False
        self.graphs_captured += captured
        self.capture_seconds += seconds
        return True

    # ----- static cache and graphs ------------------------------------------------------------
    def _ensure_capacity(self, rows: int, positions: int, use_graphs: bool | None = None) -> None:
        """Grow the static cache (re-capturing graphs) when a call needs more rows or positions.

        Also where replaced weights are noticed: graphs read the storage they were captured with, so
        a parameter replaced since then (new storage) means rebuilding the cache and graphs."""
        if use_graphs is None:
            use_graphs = self.graphs_enabled()
        if self.cache is not None and weights_signature(self._weight_slots) != self._weights:
            captured = self.graphs is not None and bool(self.graphs.graphs)
            logger.info("moegraph: parameters of the model were replaced since %s (load_state_dict(assign=True), "
                        ".to(), a new nn.Parameter or module); %s",
                        "the decode graphs were captured" if captured else "the static KV cache was allocated",
                        "re-capturing them" if use_graphs else "allocating the static KV cache again")
            rows, positions = max(rows, self.cache.rows), max(positions, self.cache.positions)
            self._free()
        if self.cache is not None and self._ops() is not self.ops:
            logger.info("moegraph: the decode ops changed since %s (another moegraph experts implementation: %s); "
                        "%s", "the decode graphs were captured" if self.graphs is not None and self.graphs.graphs
                        else "the static KV cache was allocated", model_experts_implementation(self.model),
                        "re-capturing them" if use_graphs else "allocating the static KV cache again")
            rows, positions = max(rows, self.cache.rows), max(positions, self.cache.positions)
            self._free()
        need_rows = bucket_for(rows, self.buckets)
        need_positions = self.options.max_seq_len or round_up(positions, SEQ_ALIGN)
        cache = self.cache
        if cache is None or cache.rows < need_rows or cache.positions < need_positions:
            new_rows = max(need_rows, cache.rows if cache else 0)
            new_positions = max(need_positions, cache.positions if cache else 0)
            if cache is not None:
                logger.info("moegraph: growing the static KV cache from %dx%d to %dx%d (rows x positions)%s",
                            cache.rows, cache.positions, new_rows, new_positions,
                            " and re-capturing the decode graphs" if use_graphs else "")
            del cache  # the old cache lives on in self.cache only, which _allocate frees once the new one exists
            self._allocate(new_rows, new_positions)
        if use_graphs:
            self._capture_graphs()

    def _allocate(self, rows: int, positions: int) -> None:
        """A new static cache in place of the old one, allocated before the old one is freed: when it does not
        fit, the partial allocation is freed, the old cache and graphs stay as they were (the model still
        generates what fits in them) and moegraph's OutOfMemoryError says what was asked and how to avoid it."""
        device = self.model.device
        if device.type == "cuda":
            torch.cuda.empty_cache()
        layout = self._cache_layout(rows, positions)
        try:
            cache = StaticKVCache.allocate(**layout)
            inputs = StaticInputs.allocate(rows, device)
            prefill_inputs = prefill.PrefillInputs.allocate(rows, device)
        except torch.OutOfMemoryError as exc:
            gb = StaticKVCache.bytes_for(**layout) / 1e9
            raise self._out_of_memory(f"allocating a static KV cache of {rows} rows x {positions} positions "
                                      f"({gb:.2f} GB)", exc) from None
        ops, slots = self._ops(), weight_slots(self.model)
        graphs = BucketGraphs(step=self._forward, pdl_early_trigger=ops.pdl_early_trigger)
        prefill_graphs = BucketGraphs(step=self._prefill_forward, what="prefill graph(s) (token buckets",
                                      pdl_early_trigger=ops.pdl_early_trigger)
        self._free()
        # one statement: a KeyboardInterrupt cannot leave a cache without its graphs or weight pointers
        (self.cache, self.inputs, self.prefill_inputs, self.ops, self.graphs, self.prefill_graphs, self._weight_slots,
         self._weights) = (cache, inputs, prefill_inputs, ops, graphs, prefill_graphs, slots, weights_signature(slots))
        logger.info("moegraph: static KV cache of %d rows x %d positions (%.2f GB)", rows, positions,
                    self.cache.nbytes() / 1e9)

    def _cache_layout(self, rows: int, positions: int) -> dict:
        config = self.model.config.get_text_config()  # a vision-language model's decoder config is nested
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return dict(num_layers=config.num_hidden_layers, rows=rows, positions=positions,
                    kv_heads=config.num_key_value_heads, head_dim=head_dim,
                    dtype=self.model.get_input_embeddings().weight.dtype, device=self.model.device)

    def _capture_graphs(self) -> None:
        self.inputs.clear()
        try:
            captured, seconds = self.graphs.capture([b for b in self.buckets if b <= self.cache.rows],
                                                    self.model.device)
        except torch.OutOfMemoryError as exc:  # the graphs are dropped (BucketGraphs.capture); the cache is kept
            raise self._out_of_memory(f"capturing the decode graphs (batch buckets up to {self.cache.rows})",
                                      exc) from None
        self.graphs_captured += captured
        self.capture_seconds += seconds

    def _out_of_memory(self, what: str, exc: torch.OutOfMemoryError) -> OutOfMemoryError:
        """moegraph's error for torch's, once the memory of the failed attempt is back with the driver."""
        torch_says = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        traceback.clear_frames(exc.__traceback__)  # frames of the failed attempt may still hold its tensors
        if self.model.device.type == "cuda":
            torch.cuda.empty_cache()
        if self.cache is None:
            kept = "no static cache is held now; the next call allocates what it needs"
        else:
            graphs = self.graphs is not None and bool(self.graphs.graphs)
            kept = (f"the static cache of {self.cache.rows} rows x {self.cache.positions} positions"
                    f"{' and its decode graphs are' if graphs else ' is'} kept: calls that fit still run")
        return OutOfMemoryError(
            f"moegraph: {what} ran out of GPU memory ({torch_says}); {kept}. To avoid it: fewer rows or "
            "max_new_tokens, free GPU memory (del unused tensors, torch.cuda.empty_cache()), or reserve the cache "
            "while memory is free: moegraph.capture(model, batch_size=..., max_length=...) right after loading, "
            "or patch(model, max_seq_len=N)")

    def _warn_once(self, message: str) -> None:
        if message not in self._warned:
            self._warned.add(message)
            logger.warning(message)

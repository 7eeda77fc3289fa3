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

import logging
import time
from dataclasses import dataclass, field

import torch
from torch import nn

from ..ops import ops_for_model
from ..options import PatchOptions
from ..patches.registry import family_of
from . import support
from .decode_step import decode_forward
from .graphs import BucketGraphs, StaticInputs, batch_buckets, bucket_for
from .static_cache import SEQ_ALIGN, StaticKVCache, round_up

logger = logging.getLogger("moegraph")


@dataclass
class DecodeStats:
    """What the last fast-path generate() did; `host_ms_per_step` is CPU time spent issuing a step."""

    graphs: bool = False
    batch_size: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    steps: int = 0
    host_seconds: float = 0.0
    capture_seconds: float = 0.0
    fallback_reason: str | None = None

    @property
    def host_ms_per_step(self) -> float:
        return 1e3 * self.host_seconds / max(self.steps, 1)


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
    keep_scores: bool
    keep_logits: bool
    scores: list = field(default_factory=list)
    raw_logits: list = field(default_factory=list)


class GraphDecoder:
    def __init__(self, model: nn.Module, options: PatchOptions):
        self.model = model
        self.options = options
        family_of(model)  # raises for a model the decode step does not know
        self.buckets = batch_buckets(options.max_batch_size)
        self.cache: StaticKVCache | None = None
        self.inputs: StaticInputs | None = None
        self.graphs: BucketGraphs | None = None
        self.stats = DecodeStats()
        self._warned: set[str] = set()
        self._capture_error: str | None = None  # set when a capture failed: decode eagerly from then on
        self.ops = None  # the OpTable of the decode step, resolved with the static cache

    # ----- lifecycle -------------------------------------------------------------------------
    def release(self) -> None:
        if self.graphs is not None:
            self.graphs.release()
        self.graphs = self.cache = self.inputs = None

    def graphs_enabled(self) -> bool:
        device = self.model.device
        if device.type != "cuda" or not self.options.cuda_graphs or self._capture_error is not None:
            return False
        ops = ops_for_model(self.model, self.options.moe_backend)
        if not ops.capture_safe:
            self._warn_once(f"moegraph: the decode step is not capture-safe here; decoding eagerly without CUDA "
                            f"graphs.\n{ops.describe()}")
        return ops.capture_safe

    def capture(self, batch_size: int | None = None, max_length: int = SEQ_ALIGN) -> None:
        """Allocate the static cache and capture the graphs now instead of at the first generate()."""
        rows = min(batch_size or self.options.max_batch_size, self.options.max_batch_size)
        self._ensure_capacity(rows, max_length)

    # ----- generate() entry -------------------------------------------------------------------
    def generate(self, hf_generate, args: tuple, kwargs: dict):
        reason = support.check_call(self.model, args, kwargs)
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

    def _record_fallback(self, reason: str) -> None:
        logger.info("moegraph: generate() falls back to transformers: %s is not supported by the graph decoder", reason)
        self.stats = DecodeStats(fallback_reason=reason)

    def _decode(self, input_ids, logits_processor, stopping_criteria, generation_config, streamer, model_kwargs):
        attention_mask = model_kwargs.get("attention_mask")
        reason = support.check_prepared(logits_processor, stopping_criteria, attention_mask)
        if reason is None and generation_config.return_dict_in_generate and input_ids.shape[0] > self.options.max_batch_size \
                and (generation_config.output_scores or generation_config.output_logits):
            reason = f"output_scores/output_logits with more rows ({input_ids.shape[0]}) than max_batch_size"
        if reason is not None:
            from transformers.generation.utils import GenerationMixin

            self._record_fallback(reason)
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
            keep_scores=bool(generation_config.return_dict_in_generate and generation_config.output_scores),
            keep_logits=bool(generation_config.return_dict_in_generate and generation_config.output_logits),
        )
        if has_eos and call.pad is None:
            raise ValueError("EOS stopping needs a pad_token_id for finished rows; pass pad_token_id=... to generate()")
        sequences = self._decode_in_chunks(input_ids, attention_mask, model_kwargs.get("position_ids"), call)
        if streamer is not None:
            streamer.end()
        if not generation_config.return_dict_in_generate:
            return sequences
        from transformers.generation.utils import GenerateDecoderOnlyOutput

        return GenerateDecoderOnlyOutput(
            sequences=sequences,
            scores=tuple(call.scores) if call.keep_scores else None,
            logits=tuple(call.raw_logits) if call.keep_logits else None,
            past_key_values=None,  # the static cache stays moegraph's; it is not an HF Cache
        )

    # ----- the loop ---------------------------------------------------------------------------
    def _decode_in_chunks(self, input_ids, attention_mask, position_ids, call: _Call) -> torch.Tensor:
        """Batches above max_batch_size are decoded in chunks of max_batch_size rows, then joined."""
        rows = input_ids.shape[0]
        step = self.options.max_batch_size
        if rows <= step:
            return self._decode_rows(input_ids, attention_mask, position_ids, call)
        logger.info("moegraph: batch of %d rows is decoded in chunks of max_batch_size=%d", rows, step)
        chunks = []
        for start in range(0, rows, step):
            part = slice(start, start + step)
            chunks.append(self._decode_rows(input_ids[part], None if attention_mask is None else attention_mask[part],
                                            None if position_ids is None else position_ids[part], call))
        width = max(c.shape[1] for c in chunks)
        fill = int(call.pad) if call.pad is not None else 0
        # a chunk that stopped early has only finished rows: transformers pads those rows, as here
        return torch.cat([nn.functional.pad(c, (0, width - c.shape[1]), value=fill) for c in chunks])

    @torch.no_grad()
    def _decode_rows(self, input_ids, attention_mask, position_ids, call: _Call) -> torch.Tensor:
        rows, prompt_len = input_ids.shape
        device = input_ids.device
        max_new = call.max_length - prompt_len
        use_graphs = self.graphs_enabled()
        try:
            self._ensure_capacity(rows, call.max_length, use_graphs)
        except Exception as exc:  # a failed capture must not lose the output: decode eagerly instead
            if not use_graphs:
                raise
            self._capture_error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            self._warn_once(f"moegraph: CUDA graph capture failed ({self._capture_error}); decoding eagerly")
            if self.graphs is not None:
                self.graphs.release()
            use_graphs = False
            self._ensure_capacity(rows, call.max_length, use_graphs)
        stats = DecodeStats(graphs=use_graphs, batch_size=rows,
                            capture_seconds=self.graphs.capture_seconds if self.graphs else 0.0)

        start = time.perf_counter()
        lengths = (attention_mask.sum(1) if attention_mask is not None
                   else torch.full((rows,), prompt_len, device=device, dtype=torch.long))
        logits = self._prefill(input_ids, attention_mask, position_ids, lengths)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        stats.prefill_seconds = time.perf_counter() - start

        start = time.perf_counter()
        tokens = torch.full((rows, call.max_length), int(call.pad) if call.pad is not None else 0,
                            dtype=torch.long, device=device)
        tokens[:, :prompt_len] = input_ids
        unfinished = torch.ones(rows, dtype=torch.bool, device=device)
        alive = torch.ones(max_new, dtype=torch.bool, device=device)  # [step]: some row unfinished after it
        check_every = 1 if call.streamer is not None else self.options.check_every
        step = 0
        for step in range(max_new):
            issued = time.perf_counter()
            next_tokens = self._select(call, tokens[:, :prompt_len + step], logits)
            if call.eos is not None:
                next_tokens = torch.where(unfinished, next_tokens, call.pad)
                unfinished &= ~torch.isin(next_tokens, call.eos)
                alive[step] = unfinished.any()
            tokens[:, prompt_len + step] = next_tokens
            last = step + 1 == max_new
            if not last:
                self.inputs.token_ids[:rows].copy_(next_tokens)
                torch.add(lengths, step, out=self.inputs.positions[:rows])
                logits = self._step(rows, use_graphs)
            stats.host_seconds += time.perf_counter() - issued
            if call.streamer is not None:
                call.streamer.put(next_tokens.cpu())
            if last or (call.eos is not None and (step + 1) % check_every == 0 and not bool(alive[step])):
                break
        produced = step + 1
        if call.eos is not None:
            finished_at = (~alive[:produced]).nonzero()
            if finished_at.numel():
                produced = int(finished_at[0, 0]) + 1
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        stats.decode_seconds = time.perf_counter() - start
        stats.steps = step + 1
        self.stats = stats
        if call.keep_scores:
            del call.scores[len(call.scores) - (step + 1 - produced):]
        if call.keep_logits:
            del call.raw_logits[len(call.raw_logits) - (step + 1 - produced):]
        return tokens[:, :prompt_len + produced]

    def _select(self, call: _Call, input_ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        if call.keep_logits:
            call.raw_logits.append(logits.clone())
        scores = call.logits_processor(input_ids, logits)
        if call.keep_scores:
            call.scores.append(scores.clone() if scores is logits else scores)
        if call.do_sample:
            return torch.multinomial(nn.functional.softmax(scores, dim=-1), num_samples=1).squeeze(1)
        return torch.argmax(scores, dim=-1)

    def _prefill(self, input_ids, attention_mask, position_ids, lengths) -> torch.Tensor:
        """The model's own forward over the prompt; its K/V land compacted in the static cache."""
        from transformers import DynamicCache

        prompt_cache = DynamicCache(config=self.model.config)
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         past_key_values=prompt_cache, use_cache=True, logits_to_keep=1)
        self.cache.load_prefill([(layer.keys, layer.values) for layer in prompt_cache.layers], lengths)
        self.inputs.clear()  # padding rows of a bucket read token 0 at position 0 of their own rows
        return out.logits[:, -1].float()

    def _step(self, rows: int, use_graphs: bool) -> torch.Tensor:
        if use_graphs:
            return self.graphs.replay(bucket_for(rows, self.buckets))[:rows]
        return self._forward(rows)

    def _forward(self, rows: int) -> torch.Tensor:
        return decode_forward(self.model, self.cache, self.inputs.token_ids[:rows], self.inputs.positions[:rows],
                              self.ops)

    # ----- static cache and graphs ------------------------------------------------------------
    def _ensure_capacity(self, rows: int, max_length: int, use_graphs: bool | None = None) -> None:
        """Grow the static cache (re-capturing graphs) when a call needs more rows or positions."""
        if use_graphs is None:
            use_graphs = self.graphs_enabled()
        need_rows = bucket_for(rows, self.buckets)
        need_positions = max(round_up(max_length, SEQ_ALIGN), self.options.max_seq_len or 0)
        cache = self.cache
        if cache is None or cache.rows < need_rows or cache.positions < need_positions:
            new_rows = max(need_rows, cache.rows if cache else 0)
            new_positions = max(need_positions, cache.positions if cache else 0)
            if cache is not None:
                logger.info("moegraph: growing the static KV cache from %dx%d to %dx%d (rows x positions) "
                            "and re-capturing the decode graphs", cache.rows, cache.positions, new_rows, new_positions)
            self.release()
            self._allocate(new_rows, new_positions)
        if use_graphs:
            self.inputs.clear()
            self.graphs.capture([b for b in self.buckets if b <= self.cache.rows], self.model.device)

    def _allocate(self, rows: int, positions: int) -> None:
        config = self.model.config
        device = self.model.device
        if device.type == "cuda":
            torch.cuda.empty_cache()
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.cache = StaticKVCache.allocate(
            num_layers=config.num_hidden_layers, rows=rows, positions=positions,
            kv_heads=config.num_key_value_heads, head_dim=head_dim,
            dtype=self.model.model.embed_tokens.weight.dtype, device=device)
        self.inputs = StaticInputs.allocate(rows, device)
        self.ops = ops_for_model(self.model, self.options.moe_backend)
        self.graphs = BucketGraphs(step=self._forward)
        logger.info("moegraph: static KV cache of %d rows x %d positions (%.2f GB)", rows, positions,
                    self.cache.nbytes() / 1e9)

    def _warn_once(self, message: str) -> None:
        if message not in self._warned:
            self._warned.add(message)
            logger.warning(message)


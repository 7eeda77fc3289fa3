"""Which generate() calls the fast decoder takes, and why the others go to transformers unchanged.

Each check returns None (supported) or a short reason; the decoder logs a reason once per model (WARNING).
"""

from __future__ import annotations

import torch

from ..moe.interface import NAME, backend_of, model_experts_implementation
from .family import FamilySteps
from .hf_cache import CACHE_ARGUMENTS, unsupported_cache

# generate() parameters that select machinery the fast path does not implement.
_UNSUPPORTED_ARGUMENTS = {
    "custom_generate": "a custom_generate",
    "assistant_model": "assisted decoding",
    "logits_processor": "custom logits processors",
    "stopping_criteria": "custom stopping criteria",
    "prefix_allowed_tokens_fn": "prefix_allowed_tokens_fn",
    "negative_prompt_ids": "negative prompts",
    "negative_prompt_attention_mask": "negative prompts",
}
_GENERATE_PARAMETERS = {"inputs", "input_ids", "generation_config", "synced_gpus", "streamer", "tokenizer",
                        "trust_remote_code"} | set(_UNSUPPORTED_ARGUMENTS)
_MODEL_KWARGS = {"attention_mask", "input_ids", "use_cache", "inputs_embeds", "position_ids", "logits_to_keep",
                 *CACHE_ARGUMENTS}
_CACHE_IMPLEMENTATIONS = (None, "dynamic", "static")

# Processors that are pure functions of (input_ids, scores) for one step; any other goes to HF.
SUPPORTED_PROCESSORS = {
    "TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper", "MinPLogitsWarper", "TypicalLogitsWarper",
    "EpsilonLogitsWarper", "EtaLogitsWarper", "MinLengthLogitsProcessor", "MinNewTokensLengthLogitsProcessor",
    "RepetitionPenaltyLogitsProcessor", "NoRepeatNGramLogitsProcessor", "SequenceBiasLogitsProcessor",
    "NoBadWordsLogitsProcessor", "ForcedEOSTokenLogitsProcessor", "InfNanRemoveLogitsProcessor",
    "SuppressTokensLogitsProcessor", "SuppressTokensAtBeginLogitsProcessor", "LogitNormalization",
}
SUPPORTED_CRITERIA = {"MaxLengthCriteria", "EosTokenCriteria"}


def check_call(model, args: tuple, kwargs: dict, family: FamilySteps) -> str | None:
    """Checks on the raw generate() arguments, before transformers prepares anything."""
    if len(args) > 2:
        return "positional arguments past `inputs` and `generation_config`"
    for name, what in _UNSUPPORTED_ARGUMENTS.items():
        if kwargs.get(name) is not None and not (name in ("logits_processor", "stopping_criteria")
                                                 and len(kwargs[name]) == 0):
            return what
    if kwargs.get("synced_gpus"):
        return "synced_gpus"
    input_ids = args[0] if args else kwargs.get("inputs", kwargs.get("input_ids"))
    embeds = kwargs.get("inputs_embeds")
    if embeds is not None and (not isinstance(embeds, torch.Tensor) or embeds.dim() != 3):
        return "inputs_embeds other than a [batch, length, hidden] tensor"
    if input_ids is not None and (
            not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2
            or input_ids.dtype not in (torch.long, torch.int32)):
        return "inputs other than a 2D int64 or int32 tensor of token ids"
    position_ids = kwargs.get("position_ids")
    if position_ids is not None and (not isinstance(position_ids, torch.Tensor) or position_ids.dim() != 2):
        return "position_ids other than a 2D tensor"
    cache = next((kwargs[name] for name in CACHE_ARGUMENTS if kwargs.get(name) is not None), None)
    if cache is not None and (reason := unsupported_cache(cache)) is not None:
        return reason
    experts = model_experts_implementation(model)
    if backend_of(experts) is None:
        return (f"experts_implementation={experts!r} set on the model (moegraph's decoder runs moegraph's experts "
                f"only; model.set_experts_implementation({NAME!r}) puts it back on the fast path)")
    devices = {p.device for p in model.parameters()}
    if len(devices) != 1:
        return f"a model spread over several devices ({sorted(map(str, devices))})"
    if next(iter(devices)).type not in ("cuda", "cpu"):
        return f"a model on {next(iter(devices)).type}"
    return _check_generation_config(model, args, kwargs, family)


def _check_generation_config(model, args, kwargs, family: FamilySteps) -> str | None:
    from transformers.generation.configuration_utils import GenerationMode

    generation_config = args[1] if len(args) > 1 else kwargs.get("generation_config")
    config_kwargs = {k: v for k, v in kwargs.items() if k not in _GENERATE_PARAMETERS}
    try:
        config, model_kwargs = model._prepare_generation_config(generation_config, **config_kwargs)
        mode = config.get_generation_mode()
    except Exception:  # transformers will raise the same error, with its own message
        return "arguments transformers rejects"
    if mode not in (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE):
        return f"generation mode {mode.value}"
    flags = ("output_attentions", "output_hidden_states")  # some versions keep them in model_kwargs
    for flag in flags:
        if getattr(config, flag, False) or model_kwargs.get(flag):
            return flag
    extra = sorted(set(model_kwargs) - _MODEL_KWARGS - set(flags))  # a False flag asks for nothing
    family_inputs = {name: model_kwargs[name] for name in extra if name in family.input_kwargs}
    if family_inputs and family.check_inputs is not None:
        if (reason := family.check_inputs(model, family_inputs)) is not None:
            return reason
    extra = [name for name in extra if name not in family.input_kwargs]
    if extra:
        return f"model kwargs {extra}"
    for field in ("stop_strings", "max_time", "prefill_chunk_size"):
        if getattr(config, field, None) is not None:
            return field
    if getattr(config, "cache_implementation", None) not in _CACHE_IMPLEMENTATIONS:
        return f"cache_implementation={config.cache_implementation!r}"
    return None


def check_prepared(logits_processor, stopping_criteria) -> str | None:
    """Checks on what transformers prepared: processors and stopping criteria."""
    for processor in logits_processor:
        if type(processor).__name__ not in SUPPORTED_PROCESSORS:
            return f"logits processor {type(processor).__name__}"
    for criterion in stopping_criteria:
        if type(criterion).__name__ not in SUPPORTED_CRITERIA:
            return f"stopping criterion {type(criterion).__name__}"
    return None


def check_compile(model, generation_config, model_kwargs: dict) -> str | None:
    """An explicit `compile_config` that transformers would honour for this call (its own criteria: a compileable
    cache, a device it compiles for) asks for transformers' compiled decode loop, so the call is transformers'.
    Without one, a static cache stays on the fast path (graphs replace what auto-compilation would do)."""
    if getattr(generation_config, "compile_config", None) is None:
        return None
    would_compile = getattr(model, "_valid_auto_compile_criteria", None)
    if would_compile is None or not would_compile(model_kwargs, generation_config):
        return None
    return "compile_config with a compileable cache (transformers' torch.compile'd decode loop)"


def check_prompt(attention_mask, position_ids, rows: int, kv_width: int) -> str | None:
    """Checks on the prompt the prefill will see: kv_width = cached positions + uncached input."""
    if attention_mask is not None:
        if attention_mask.dim() != 2 or attention_mask.shape != (rows, kv_width):
            return (f"an attention_mask of shape {tuple(attention_mask.shape)} for {rows} rows of {kv_width} "
                    "positions (cache + input)")
        # one host sync per call
        if bool(((attention_mask != 0) & (attention_mask != 1)).any()):
            return "an attention_mask with values other than 0 and 1"
        if bool((attention_mask.sum(1) == 0).any()):
            return "an attention_mask with a row of padding only"
    if position_ids is not None and (position_ids.dim() != 2 or position_ids.shape[0] not in (1, rows)):
        return f"position_ids of shape {tuple(position_ids.shape)} for {rows} rows"
    return None

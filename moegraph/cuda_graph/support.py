"""Which generate() calls the fast decoder takes, and why the others go to transformers unchanged.

Each check returns None (supported) or a short reason, logged once per call on fallback.
"""

from __future__ import annotations

import torch

# generate() parameters that select machinery the fast path does not implement.
_UNSUPPORTED_ARGUMENTS = {
    "custom_generate": "a custom_generate",
    "assistant_model": "assisted decoding",
    "logits_processor": "custom logits processors",
    "stopping_criteria": "custom stopping criteria",
    "prefix_allowed_tokens_fn": "prefix_allowed_tokens_fn",
    "negative_prompt_ids": "negative prompts",
    "negative_prompt_attention_mask": "negative prompts",
    "inputs_embeds": "inputs_embeds",
    "past_key_values": "a user-supplied cache",
}
_GENERATE_PARAMETERS = {"inputs", "input_ids", "generation_config", "synced_gpus", "streamer", "tokenizer",
                        "trust_remote_code"} | set(_UNSUPPORTED_ARGUMENTS)
_MODEL_KWARGS = {"attention_mask", "input_ids", "use_cache"}

# Processors that are pure functions of (input_ids, scores) for one step; any other goes to HF.
SUPPORTED_PROCESSORS = {
    "TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper", "MinPLogitsWarper", "TypicalLogitsWarper",
    "EpsilonLogitsWarper", "EtaLogitsWarper", "MinLengthLogitsProcessor", "MinNewTokensLengthLogitsProcessor",
    "RepetitionPenaltyLogitsProcessor", "NoRepeatNGramLogitsProcessor", "SequenceBiasLogitsProcessor",
    "NoBadWordsLogitsProcessor", "ForcedEOSTokenLogitsProcessor", "InfNanRemoveLogitsProcessor",
    "SuppressTokensLogitsProcessor", "SuppressTokensAtBeginLogitsProcessor", "LogitNormalization",
}
SUPPORTED_CRITERIA = {"MaxLengthCriteria", "EosTokenCriteria"}


def check_call(model, args: tuple, kwargs: dict) -> str | None:
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
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype != torch.long:
        return "inputs other than a 2D int64 tensor of token ids"
    devices = {p.device for p in model.parameters()}
    if len(devices) != 1:
        return f"a model spread over several devices ({sorted(map(str, devices))})"
    if next(iter(devices)).type not in ("cuda", "cpu"):
        return f"a model on {next(iter(devices)).type}"
    return _check_generation_config(model, args, kwargs)


def _check_generation_config(model, args, kwargs) -> str | None:
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
    extra = sorted(set(model_kwargs) - _MODEL_KWARGS)
    if extra:
        return f"model kwargs {extra}"
    for flag in ("output_attentions", "output_hidden_states"):
        if getattr(config, flag, False):
            return flag
    for field in ("stop_strings", "max_time", "prefill_chunk_size"):
        if getattr(config, field, None) is not None:
            return field
    if getattr(config, "cache_implementation", None) not in (None, "dynamic"):
        return f"cache_implementation={config.cache_implementation!r}"
    return None


def check_prepared(logits_processor, stopping_criteria, attention_mask) -> str | None:
    """Checks on what transformers prepared: processors, stopping criteria, padding side."""
    for processor in logits_processor:
        if type(processor).__name__ not in SUPPORTED_PROCESSORS:
            return f"logits processor {type(processor).__name__}"
    for criterion in stopping_criteria:
        if type(criterion).__name__ not in SUPPORTED_CRITERIA:
            return f"stopping criterion {type(criterion).__name__}"
    if attention_mask is not None and attention_mask.shape[1] > 1:
        if bool((attention_mask[:, 1:] < attention_mask[:, :-1]).any()):
            return "an attention_mask that is not left-padded (set tokenizer.padding_side='left')"
    return None

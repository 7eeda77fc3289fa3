"""Fused experts quantized to NF4 while transformers loads a checkpoint in 4-bit.

With `BitsAndBytesConfig(load_in_4bit=True)` transformers swaps `nn.Linear` for bitsandbytes'
`Linear4bit` and quantizes those weights as they arrive, but leaves fused 3-D experts in the load
dtype (~58 GB for Qwen3-30B-A3B). While moegraph's class-level `patch()` is active, four methods of
transformers' 4-bit quantizer are wrapped, for models of the families moegraph supports only:
- before loading: settings moegraph cannot honour for the experts are refused (fp4, 8-bit);
- `param_needs_quantization`: also True for `gate_up_proj` / `down_proj` of a fused experts module
  that `llm_int8_skip_modules` does not name;
- `get_quantize_ops`: an op that quantizes such a tensor to NF4 as soon as it is materialized (the
  dense copy is dropped right away) and hands every other tensor to bitsandbytes' own op;
- after loading: each experts module whose two tensors arrived quantized becomes an NF4Experts.
So peak memory while loading stays near the 4-bit size plus one dense experts tensor.
"""

from __future__ import annotations

import logging
import re

import torch
from torch import nn

from ..errors import InvalidArgumentError
from . import serialization
from .experts import NF4Experts
from .nf4 import NF4Weight, quantize_nf4

logger = logging.getLogger("moegraph")

EXPERT_TENSORS = ("gate_up_proj", "down_proj")
_PENDING = "_moegraph_nf4_pending"  # experts module attribute: {tensor name: NF4Weight} while loading


def _supported(model) -> bool:
    from ..models import FAMILIES

    return getattr(getattr(model, "config", None), "model_type", None) in FAMILIES


def _split_name(name: str) -> tuple[str, str]:
    module_path, _, tensor = name.rpartition(".")
    return module_path, tensor


def _skipped(module_path: str, patterns) -> bool:
    """Whether `llm_int8_skip_modules` (or transformers' own keep list) names this module or a parent."""
    for pattern in patterns or ():
        if module_path.endswith(pattern) or re.match(rf"(?:{pattern})(?:(?<=\.)|(?=\.|$))", module_path):
            return True
    return False


def is_expert_tensor(quantizer, model, name: str) -> bool:
    module_path, tensor = _split_name(name)
    if tensor not in EXPERT_TENSORS or not _supported(model):
        return False
    try:
        module = model.get_submodule(module_path)
    except AttributeError:
        return False
    param = module._parameters.get(tensor)
    return param is not None and param.dim() == 3 and hasattr(module, "act_fn") \
        and not _skipped(module_path, getattr(quantizer, "modules_to_not_convert", None))


def check_config(quantization_config) -> None:
    """Say what of the 4-bit settings applies to the experts; refuse what cannot be honoured."""
    quant_type = getattr(quantization_config, "bnb_4bit_quant_type", "nf4")
    if quant_type != "nf4":  # "fp4" is BitsAndBytesConfig's default: refusing it would refuse load_in_4bit=True
        logger.warning(
            "moegraph: bnb_4bit_quant_type=%r applies to the Linear4bit projections; fused experts are stored in "
            "moegraph's NF4 format (the only one it has). Pass bnb_4bit_quant_type='nf4' to use NF4 everywhere.",
            quant_type)
    if getattr(quantization_config, "bnb_4bit_quant_storage", torch.uint8) not in (None, torch.uint8):
        raise InvalidArgumentError(
            f"bnb_4bit_quant_storage={quantization_config.bnb_4bit_quant_storage} is not supported for fused "
            "experts by moegraph; leave it at its default (torch.uint8).")


class ExpertsNF4Quantize:
    """transformers' per-tensor quantize op, extended to fused experts (moegraph's NF4 format)."""

    def __init__(self, quantizer, bnb_op):
        self.quantizer = quantizer
        self.bnb_op = bnb_op

    def __getattr__(self, name):  # anything transformers asks of the op that is not ours is bitsandbytes'
        return getattr(self.bnb_op, name)

    @torch.no_grad()
    def convert(self, input_dict, full_layer_name=None, model=None, **kwargs):
        name = full_layer_name if full_layer_name is not None else next(iter(input_dict))
        if not is_expert_tensor(self.quantizer, model, name):
            return self.bnb_op.convert(input_dict, full_layer_name=full_layer_name, model=model, **kwargs)
        (key, value), = input_dict.items()
        value = value[0] if isinstance(value, list) else value
        double_quant = bool(getattr(self.quantizer.quantization_config, "bnb_4bit_use_double_quant", False))
        weight = quantize_nf4(value, double_quant=double_quant)
        del value, input_dict  # the dense tensor goes now, not after the layer
        module_path, tensor = _split_name(name)
        keep_pending(model.get_submodule(module_path), tensor, weight)
        return {key: weight.packed}  # set in place of the dense parameter until loading ends


def keep_pending(module: nn.Module, tensor: str, weight: NF4Weight) -> None:
    """Keep an experts tensor's NF4Weight on its module until loading ends (finish_loading swaps the module)."""
    module.__dict__.setdefault(_PENDING, {})[tensor] = weight
    module._is_hf_initialized = True


def finish_loading(model: nn.Module) -> int:
    """Swap every experts module whose tensors were quantized while loading for an NF4Experts; returns the count."""
    swapped = 0
    for parent in list(model.modules()):
        for child_name, child in list(parent.named_children()):
            pending = child.__dict__.get(_PENDING)
            if pending is None:
                continue
            missing = [t for t in EXPERT_TENSORS if t not in pending]
            if missing:
                raise InvalidArgumentError(f"{type(child).__name__} got no {missing} while loading: the checkpoint "
                                           "does not hold both expert tensors")
            replacement = NF4Experts(pending["gate_up_proj"], pending["down_proj"], act_fn=child.act_fn,
                                     config=getattr(child, "config", None))
            del child.__dict__[_PENDING]
            setattr(parent, child_name, replacement)
            swapped += 1
    if swapped:
        logger.info("moegraph: %d fused experts modules quantized to NF4 while loading", swapped)
    return swapped


# ----- the wrappers the class-level patch installs (wrapt signature) ----------------------------------
def before_loading(wrapped, instance, args, kwargs):
    model = args[0] if args else kwargs.get("model")
    if _supported(model):
        check_config(instance.quantization_config)
        serialization.prepare_model(instance, model)  # before transformers asks for the weight conversions
    return wrapped(*args, **kwargs)


def needs_quantization(wrapped, instance, args, kwargs):
    # Pre-quantized too: such a tensor arrives packed (serialization.py), and transformers 5.24 accepts a shape other
    # than the dense parameter's only for a parameter its quantizer quantizes.
    model, name = (list(args) + [kwargs.get("model"), kwargs.get("param_name")])[:2]
    if is_expert_tensor(instance, model, name):
        return True
    return wrapped(*args, **kwargs)


def quantize_ops(wrapped, instance, args, kwargs):
    return ExpertsNF4Quantize(instance, wrapped(*args, **kwargs))


def after_loading(wrapped, instance, args, kwargs):
    model = args[0] if args else kwargs.get("model")
    if _supported(model):
        finish_loading(model)
    return wrapped(*args, **kwargs)


def refuse_8bit(wrapped, instance, args, kwargs):
    model = args[0] if args else kwargs.get("model")
    if _supported(model):
        raise InvalidArgumentError(
            "moegraph quantizes fused experts to 4-bit NF4 only; BitsAndBytesConfig(load_in_8bit=True) would leave "
            "them unquantized. Use BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type='nf4'), or "
            "moegraph.unpatch() before loading in 8-bit.")
    return wrapped(*args, **kwargs)


def install(patches) -> bool:
    """Wrap transformers' bitsandbytes quantizers in `patches` (a PatchSet); False where they cannot be imported."""
    try:
        from transformers.quantizers.quantizer_bnb_4bit import Bnb4BitHfQuantizer
        from transformers.quantizers.quantizer_bnb_8bit import Bnb8BitHfQuantizer
    except ImportError:  # pragma: no cover - a transformers without bitsandbytes support
        return False
    patches.wrap(Bnb4BitHfQuantizer, "_process_model_before_weight_loading", before_loading)
    patches.wrap(Bnb4BitHfQuantizer, "param_needs_quantization", needs_quantization)
    patches.wrap(Bnb4BitHfQuantizer, "get_quantize_ops", quantize_ops)
    patches.wrap(Bnb4BitHfQuantizer, "_process_model_after_weight_loading", after_loading)
    patches.wrap(Bnb8BitHfQuantizer, "_process_model_before_weight_loading", refuse_8bit)
    serialization.install(patches)  # save_pretrained / pre-quantized checkpoints of NF4 experts
    return True


__all__ = ["ExpertsNF4Quantize", "NF4Weight", "check_config", "finish_loading", "install", "is_expert_tensor",
           "keep_pending"]

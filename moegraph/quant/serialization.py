"""Saving and loading NF4 experts with transformers' save_pretrained / from_pretrained (class-level moegraph.patch()).

What moegraph writes (save_pretrained of a model that holds NF4Experts, while moegraph is patched): every NF4Experts at
module path X (model.layers.{l}.mlp.experts) is stored as its own state dict, fused, never split per expert:
    X.P                  uint8   [E, N*K/2]               packed NF4 (nf4.py's layout)
    X.P_absmax           float32 [E, N*K/64]              uint8 when double-quantized
    X.P_nested_absmax    float32 [E, ceil(N*K/64/256)]    } double quantization only
    X.P_nested_code      float32 [256]                    }
    X.P_offset           float32 [E]                      }
for P = gate_up_proj (N, K = 2I, H; rows [gate; up]) and P = down_proj (N, K = H, I). Expert e of each is exactly one
bitsandbytes NF4 tensor (`to_bnb(w, e)`), so loading is a plain copy and a round trip is byte-identical, double
quantization included. The compute dtype is not stored: experts dequantize to the dtype the model is loaded in
(`config.dtype`, the dtype saved, unless from_pretrained is given another). Everything else is written as transformers
writes it: Linear4bit projections as bitsandbytes' keys (`weight`, `weight.absmax`, `weight.quant_map`,
`weight.quant_state.bitsandbytes__nf4`, ...), dense tensors as they are, dense fused experts reverted to per-expert keys.
config.json carries `quantization_config`: the model's own when it was loaded in 4-bit (written back unchanged unless a
module it would quantize is dense); for a model quantized in memory (quantize_experts, quantize_projections) a
`BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4")` whose `llm_int8_skip_modules` names every module
left dense (nn.Linear, fused experts), so that from_pretrained rebuilds the same modules.

What transformers does that this module handles (read in transformers 5.17 and 5.24, checked on both):
- save_pretrained reverts the load-time weight conversion (`revert_weight_conversion`): for Qwen3-MoE it splits
  `experts.gate_up_proj` along dim 1 and every expert tensor along dim 0 into `experts.{e}.gate_proj.weight` etc.
  (5.17 also splits `gate_up_proj_absmax`, whose name it matches as a prefix). Packed NF4 cannot go through that:
  the NF4Experts keys are held out of the revert and written as they are.
- A model loaded from a pre-quantized bitsandbytes checkpoint cannot be saved again by transformers itself (the
  revert asks `Bnb4bitDeserialize` for a reverse op and raises NotImplementedError); deserializing conversions are
  dropped from the revert of a model with NF4Experts: their tensors are already in serialized form.
- Loading a pre-quantized checkpoint (`hf_quantizer.pre_quantized`), transformers routes per-expert
  `experts.{e}.gate_proj.weight` keys into its merge converter and drops their quant-state keys as unexpected, and
  would put moegraph's packed `experts.gate_up_proj` into the dense parameter. One converter per projection, placed
  ahead of transformers' own, collects every form of an experts tensor instead (`NF4ExpertsDeserialize`).

The loader recognises, per experts module and projection:
- moegraph's layout above: the tensors become the NF4Experts buffers as they are;
- the per-expert bitsandbytes layout of 4-bit Qwen3-MoE checkpoints on the Hub (transformers v4 + bitsandbytes, experts
  as Linear4bit): `X.{e}.{gate_proj,up_proj,down_proj}.weight` uint8 [n*k/2, 1] with `.weight.absmax`,
  `.weight.quant_map`, `.weight.quant_state.bitsandbytes__nf4` and, double-quantized, `.weight.nested_absmax`,
  `.weight.nested_quant_map` (bnb's `QuantState.as_dict(packed=True)`). down_proj: the experts' states stacked
  (double quantization kept as it is). gate_up_proj: per expert, gate's then up's packed bytes and absmax
  concatenated: bnb quantizes each flattened [I, H] matrix in blocks of 64 and I*H % 64 == 0, so that is exactly the
  NF4 layout of the stacked [2I, H] matrix. Double-quantized halves each carry their own offset and nested absmax,
  which one NF4Weight (one offset per expert) cannot hold, and re-quantizing the absmax would change values; gate_up
  then keeps the float32 absmax that bitsandbytes dequantizes from the halves (same values, bit for bit; 4 bytes per
  64 gate/up weights instead of ~1);
- dense experts (fused or per expert): quantized to NF4 as they arrive, as with a dense checkpoint, unless
  `llm_int8_skip_modules` names the module (then dense; a quantized one is dequantized exactly).
A checkpoint the loader cannot read raises InvalidArgumentError in the converter: transformers lists it in its load
report and then raises a RuntimeError of its own (5.17 and 5.24). Loading any of these layouts without moegraph patched
fails too (transformers 5.24 raises a size mismatch for every experts tensor; 5.17 loads the packed bytes into the dense
parameters and the first forward raises); never silently.
"""

from __future__ import annotations

import logging
import re
from contextlib import contextmanager

import torch
from torch import nn
from transformers.core_model_loading import ConversionOps

from ..errors import InvalidArgumentError
from .experts import NF4Experts, is_fused_experts
from .nf4 import NF4Weight, dequantize_nf4, expert_absmax, from_bnb, quantize_nf4

logger = logging.getLogger("moegraph")

# Written beside the NF4 experts: a model loaded without moegraph patched lists it among its unexpected keys, which
# says what to do. Its value, the layout version, is not read yet: it lets a later layout tell these files apart.
MARKER = "moegraph: NF4 experts; call moegraph.patch() before from_pretrained"
LAYOUT_VERSION = 1
_SUPPORTED = "_moegraph_supported_model"  # quantizer attribute, set before loading: the model is of a moegraph family
# NF4Weight field -> state-dict suffix of an NF4Experts buffer (experts.py's names)
FUSED_SUFFIXES = {"packed": "", "absmax": "_absmax", "nested_absmax": "_nested_absmax", "nested_code": "_nested_code",
                  "offset": "_offset"}
# What bitsandbytes serializes for one 4-bit weight (`QuantState.as_dict(packed=True)` under `weight.`)
BNB_SUFFIXES = ("weight", "weight.absmax", "weight.quant_map", "weight.nested_absmax", "weight.nested_quant_map",
                "weight.quant_state.bitsandbytes__nf4", "weight.quant_state.bitsandbytes__fp4")
HALVES = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}  # per-expert modules of a projection


# ----- saving -------------------------------------------------------------------------------------------------------
def nf4_experts_modules(model: nn.Module) -> dict[str, NF4Experts]:
    return {name: module for name, module in model.named_modules() if isinstance(module, NF4Experts)}


def _dense_modules(model: nn.Module) -> list[str]:
    """Modules a 4-bit from_pretrained would quantize that are dense here: nn.Linear (what transformers swaps for
    Linear4bit) and fused experts (what moegraph quantizes)."""
    return [name for name, module in model.named_modules()
            if name and (type(module) is nn.Linear or is_fused_experts(module))]


def _compute_dtype(model: nn.Module, experts: dict[str, NF4Experts]) -> torch.dtype:
    for module in model.modules():
        dtype = getattr(module, "compute_dtype", None)  # bitsandbytes Linear4bit
        if isinstance(dtype, torch.dtype):
            return dtype
    return next(iter(experts.values())).dtype


def saved_quantization_config(model: nn.Module):
    """The quantization_config a checkpoint of `model` (with NF4Experts) must carry, or None to keep the model's own."""
    from transformers import BitsAndBytesConfig
    from transformers.quantizers.base import HfQuantizer
    from transformers.quantizers.quantizers_utils import should_convert_module

    experts = nf4_experts_modules(model)
    config = getattr(model.config, "quantization_config", None)
    dense = _dense_modules(model)
    if config is None:
        double_quant = any(e.gate_up.double_quant or e.down.double_quant for e in experts.values())
        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=double_quant,
                                  bnb_4bit_compute_dtype=_compute_dtype(model, experts),
                                  llm_int8_skip_modules=dense or None)
    if isinstance(config, dict):
        config = BitsAndBytesConfig.from_dict(config)
    if not (isinstance(config, BitsAndBytesConfig) and config.load_in_4bit):
        raise InvalidArgumentError(
            f"save_pretrained: the model has NF4 experts but its config.quantization_config is {config!r}; moegraph "
            f"writes bitsandbytes 4-bit checkpoints only: set config.quantization_config = "
            f"BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type='nf4') or remove it")
    skips = HfQuantizer.get_modules_to_not_convert(model, config.llm_int8_skip_modules,
                                                   getattr(model, "_keep_in_fp32_modules", None))
    unnamed = [name for name in dense if should_convert_module(name, skips)]
    if not unnamed:
        return None
    logger.info("moegraph: save_pretrained adds dense modules %s to llm_int8_skip_modules", unnamed)
    saved = BitsAndBytesConfig.from_dict(config.to_dict())
    saved.llm_int8_skip_modules = sorted(set(skips) | set(unnamed))
    return saved


@contextmanager
def _config_for_saving(model: nn.Module):
    config = saved_quantization_config(model)
    if config is None:
        yield
        return
    had = hasattr(model.config, "quantization_config")
    previous = getattr(model.config, "quantization_config", None)
    model.config.quantization_config = config
    try:
        yield
    finally:
        if had:
            model.config.quantization_config = previous
        else:
            del model.config.quantization_config


def _reversible(conversion) -> bool:
    try:
        conversion.reverse_transform()
    except NotImplementedError:  # a deserializing op (Bnb4bitDeserialize, NF4ExpertsDeserialize): no inverse
        return False
    return True


def _arguments(args, kwargs, *names):
    """The leading arguments of a wrapped call by position or keyword."""
    return [args[i] if i < len(args) else kwargs.get(name) for i, name in enumerate(names)]


def revert_conversion(wrapped, instance, args, kwargs):
    """Wraps transformers' `revert_weight_conversion(model, state_dict)` (called by save_pretrained): NF4Experts keys
    stay as they are, and conversions that only deserialize are left out (their tensors are serialized already)."""
    model, state_dict = _arguments(args, kwargs, "model", "state_dict")
    experts = nf4_experts_modules(model) if isinstance(model, nn.Module) else {}
    if not experts:
        return wrapped(*args, **kwargs)
    prefixes = tuple(f"{name}." for name in experts)
    held = {k: v for k, v in state_dict.items() if k.startswith(prefixes)}
    rest = {k: v for k, v in state_dict.items() if not k.startswith(prefixes)}
    conversions = model.__dict__.get("_weight_conversions")
    if conversions is not None:
        model._weight_conversions = [c for c in conversions if _reversible(c)]
    try:
        reverted = wrapped(model, rest)
    finally:
        if conversions is not None:
            model._weight_conversions = conversions
    clash = sorted(set(reverted) & set(held))
    if clash:
        raise InvalidArgumentError(f"save_pretrained: reverting the weight conversion produced {clash[:3]}, which are "
                                   f"NF4 experts keys")
    reverted.update(held)
    reverted[MARKER] = torch.tensor([LAYOUT_VERSION], dtype=torch.uint8)
    return reverted


def save_pretrained(wrapped, instance, args, kwargs):
    """Wraps PreTrainedModel.save_pretrained: a model with NF4Experts gets the quantization_config it needs."""
    if instance is None or not nf4_experts_modules(instance):
        return wrapped(*args, **kwargs)
    with _config_for_saving(instance):
        return wrapped(*args, **kwargs)


# ----- loading ------------------------------------------------------------------------------------------------------
def _patterns(projection: str) -> dict[str, tuple[str, str]]:
    """Source pattern -> (half or "fused", field) for one projection, longest first: transformers 5.17 tries the
    branches in order and matches names as prefixes (`experts.gate_up_proj` would take `experts.gate_up_proj_absmax`)."""
    roles = {f"experts.{projection}{suffix}": ("fused", field) for field, suffix in FUSED_SUFFIXES.items()}
    for half in HALVES[projection]:
        roles.update({f"experts.*.{half}.{suffix}": (half, suffix) for suffix in BNB_SUFFIXES})
    return dict(sorted(roles.items(), key=lambda item: -len(item[0])))


def expert_conversions(hf_quantizer) -> list:
    """transformers WeightConverters (one per projection) that hand every form of an experts tensor to
    NF4ExpertsDeserialize."""
    from transformers.core_model_loading import WeightConverter

    return [WeightConverter(source_patterns=list(_patterns(p)), target_patterns=f"experts.{p}",
                            operations=[NF4ExpertsDeserialize(hf_quantizer, p)]) for p in HALVES]


class NF4ExpertsDeserialize(ConversionOps):
    """Builds one experts tensor (gate_up_proj or down_proj) from what the checkpoint holds for it (see the module
    docstring): an NF4Weight, kept aside until loading ends (loading.finish_loading), or a dense tensor."""

    def __init__(self, hf_quantizer, projection: str):
        self.hf_quantizer = hf_quantizer  # transformers 5.24 reads it: tensors of such an op are loaded uncast
        self.projection = projection
        self.roles = _patterns(projection)

    @torch.no_grad()
    def convert(self, input_dict, source_patterns=None, target_patterns=None, full_layer_name=None, model=None,
                **kwargs):
        from .loading import is_expert_tensor, keep_pending

        module_path = full_layer_name.rpartition(".")[0]
        module = model.get_submodule(module_path)
        param = module._parameters[self.projection]  # the meta parameter: shape [E, N, K] and load dtype
        where = f"{module_path}.{self.projection}"
        parts: dict[str, dict[str, list[torch.Tensor]]] = {}
        for pattern, tensors in input_dict.items():
            half, field = self.roles.get(pattern, ("unknown", pattern))
            parts.setdefault(half, {})[field] = tensors if isinstance(tensors, list) else [tensors]
        if "unknown" in parts:
            raise InvalidArgumentError(f"{where}: unexpected checkpoint tensors {sorted(parts['unknown'])}")
        weight = self._weight(parts, tuple(param.shape), param.dtype, where)
        if not isinstance(weight, NF4Weight):  # dense in the checkpoint
            if not is_expert_tensor(self.hf_quantizer, model, full_layer_name):
                return {full_layer_name: weight}
            double_quant = bool(getattr(self.hf_quantizer.quantization_config, "bnb_4bit_use_double_quant", False))
            weight = quantize_nf4(weight, double_quant=double_quant)
        elif not is_expert_tensor(self.hf_quantizer, model, full_layer_name):
            logger.info("moegraph: %s is quantized in the checkpoint but not to be quantized here "
                        "(llm_int8_skip_modules): dequantized", where)
            return {full_layer_name: dequantize_nf4(weight)}
        keep_pending(module, self.projection, weight)
        return {full_layer_name: weight.packed}  # in place of the dense parameter until loading ends

    def _weight(self, parts, shape, dtype, where):
        fused = parts.pop("fused", {})
        if "packed" in fused and parts:
            raise InvalidArgumentError(f"{where}: the checkpoint holds both the fused tensor(s) {sorted(fused)} and "
                                       f"per-expert ones {sorted(k for p in parts.values() for k in p)}")
        if fused:  # without its packed tensor, _fused says what wrote such a checkpoint
            return self._fused(fused, shape, dtype, where)
        halves = [self._per_expert(half, parts.get(half, {}), shape, dtype, where) for half in HALVES[self.projection]]
        if all(not isinstance(h, NF4Weight) for h in halves):
            return torch.cat(halves, dim=1)  # dense [E, n, k] halves: transformers' own merge
        if not all(isinstance(h, NF4Weight) for h in halves):
            raise InvalidArgumentError(f"{where}: {HALVES[self.projection]} are not all 4-bit in the checkpoint")
        return _concat_rows(halves, shape, where) if len(halves) > 1 else halves[0]

    @staticmethod
    def _fused(fields, shape, dtype, where):
        tensors = {field: values[0] for field, values in fields.items()}
        packed = tensors.get("packed")
        if packed is not None and packed.is_floating_point() and len(tensors) == 1:
            return packed.to(dtype)  # a dense fused tensor
        if packed is None:
            raise InvalidArgumentError(
                f"{where}: the checkpoint has {sorted(tensors)} but no packed {where.rpartition('.')[2]}: the experts "
                f"tensors are incomplete or were split per expert by a save_pretrained without moegraph patched; "
                f"re-save the model with moegraph.patch() called first")
        try:
            return NF4Weight(shape=shape, dtype=dtype, **tensors)
        except InvalidArgumentError as error:
            raise InvalidArgumentError(f"{where}: moegraph NF4 tensors do not fit the model: {error}") from None

    @staticmethod
    def _per_expert(half, fields, shape, dtype, where):
        experts = shape[0]
        weights = fields.get("weight", [])
        if not weights:
            raise InvalidArgumentError(f"{where}: the checkpoint has no {half}.weight for these experts")
        counts = {field: len(values) for field, values in fields.items()}
        if set(counts.values()) != {experts}:
            raise InvalidArgumentError(f"{where}: {half} tensors per field {counts}, the model has {experts} experts")
        states = [k for k in fields if k.startswith("weight.quant_state.")]
        if not states:
            if weights[0].is_floating_point():
                return torch.stack([w.to(dtype) for w in weights])  # dense per-expert weights [E, n, k]
            raise InvalidArgumentError(
                f"{where}: {half}.weight is {weights[0].dtype} {tuple(weights[0].shape)} without bitsandbytes "
                f"quant state (weight.absmax, weight.quant_state.bitsandbytes__nf4): packed 4-bit data split per "
                f"expert, as a save_pretrained without moegraph patched writes NF4 experts; re-save the model with "
                f"moegraph.patch() called first")
        from bitsandbytes.functional import QuantState

        items = []
        for e in range(experts):
            stats = {field.removeprefix("weight."): values[e] for field, values in fields.items() if field != "weight"}
            try:
                state = QuantState.from_dict(stats, device=weights[e].device)
            except (ValueError, KeyError, AssertionError) as error:
                raise InvalidArgumentError(f"{where}: expert {e} {half}: bitsandbytes quant state "
                                           f"{sorted(stats)} does not load: {error}") from None
            items.append((weights[e], state))
        try:
            weight = from_bnb(items)
        except InvalidArgumentError as error:
            raise InvalidArgumentError(f"{where} ({half}): {error}") from None
        return weight.with_dtype(dtype)


def _concat_rows(halves: list[NF4Weight], shape, where) -> NF4Weight:
    """[gate; up] per expert from two NF4Weight [E, I, H] (see the module docstring for why this is exact)."""
    gate, up = halves
    if gate.shape != up.shape or (gate.shape[0], 2 * gate.shape[1], gate.shape[2]) != shape:
        raise InvalidArgumentError(f"{where}: gate {gate.shape} and up {up.shape} do not stack to {shape}")
    packed = torch.cat([gate.packed, up.packed], dim=1)
    if not (gate.double_quant or up.double_quant):
        absmax = torch.cat([gate.absmax, up.absmax], dim=1)
    else:
        logger.info("moegraph: %s: double-quantized gate/up halves keep a float32 absmax (two nested states per "
                    "expert do not merge into one without changing values)", where)
        absmax = torch.cat([expert_absmax(gate), expert_absmax(up)], dim=1)
    return NF4Weight(packed, absmax, shape, gate.dtype)


def update_conversions(wrapped, instance, args, kwargs):
    """Wraps Bnb4BitHfQuantizer.update_weight_conversions (5.24: (conversions, model); 5.17: (conversions)): for a
    pre-quantized checkpoint of a moegraph family, the experts converters go first (the first match wins)."""
    conversions = wrapped(*args, **kwargs)
    if getattr(instance, "pre_quantized", False) and instance.__dict__.get(_SUPPORTED):
        conversions = expert_conversions(instance) + list(conversions)
    return conversions


def prepare_model(quantizer, model) -> None:
    """Before loading a model of a moegraph family: the experts converters apply, the marker is no unexpected key."""
    quantizer.__dict__[_SUPPORTED] = True
    ignored = set(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ())
    model._keys_to_ignore_on_load_unexpected = ignored | {re.escape(MARKER)}


def install(patches) -> bool:
    try:
        from transformers import modeling_utils
        from transformers.quantizers.quantizer_bnb_4bit import Bnb4BitHfQuantizer
    except ImportError:  # pragma: no cover - a transformers without bitsandbytes support
        return False
    missing = [name for owner, name in ((modeling_utils, "revert_weight_conversion"),
                                        (Bnb4BitHfQuantizer, "update_weight_conversions"))
               if not hasattr(owner, name)]
    if missing:  # pragma: no cover - another transformers layout
        logger.warning("moegraph: transformers %s has no %s: saving / loading pre-quantized NF4 experts is off",
                       getattr(__import__("transformers"), "__version__", "?"), missing)
        return False
    patches.wrap(modeling_utils.PreTrainedModel, "save_pretrained", save_pretrained)
    patches.wrap(modeling_utils, "revert_weight_conversion", revert_conversion)
    patches.wrap(Bnb4BitHfQuantizer, "update_weight_conversions", update_conversions)
    return True


__all__ = ["NF4ExpertsDeserialize", "expert_conversions", "install", "nf4_experts_modules", "revert_conversion",
           "save_pretrained", "saved_quantization_config", "update_conversions"]

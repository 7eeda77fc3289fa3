"""The experts implementation a model's MoE layers dispatch on: set by patch(), put back by unpatch().

transformers' `@use_experts_implementation` reads `config._experts_implementation` of each experts module's
config at every call (for Qwen3-MoE the model's own config object). In transformers 5 that attribute is a
property over `_experts_implementation_internal`, whose setter also walks sub-configs; moegraph writes the
storage attribute itself (feature-detected), on exactly the configs the experts read, so that unpatch() can put
back exactly what was there.
"""

from __future__ import annotations

from torch import nn

from .patcher import PatchSet


def _storage(config) -> str:
    if isinstance(getattr(type(config), "_experts_implementation", None), property):
        return "_experts_implementation_internal"
    return "_experts_implementation"


def experts_configs(model: nn.Module) -> list:
    """The model's config and every experts module's config, each object once."""
    configs = [model.config] if getattr(model, "config", None) is not None else []
    for module in model.modules():
        config = getattr(getattr(module, "experts", None), "config", None)
        if config is not None and hasattr(module, "gate") and not any(config is c for c in configs):
            configs.append(config)
    return configs


def set_experts_implementation(model: nn.Module, name: str, patches: PatchSet) -> None:
    """Point the model's experts at `name`, recorded in `patches` (restore() puts back each config's value)."""
    for config in experts_configs(model):
        patches.set(config, _storage(config), name)


def write_experts_implementation(model: nn.Module, name: str, where: str | None = None) -> None:
    """Point the model's experts at `name`, unrecorded (the class-level patch keeps its own record);
    with `where`: only the configs that name `where` now."""
    for config in experts_configs(model):
        if where is None or getattr(config, "_experts_implementation", None) == where:
            setattr(config, _storage(config), name)


def replace_recorded(model: nn.Module, patches: PatchSet, old: str, new: str) -> None:
    """Where `patches` would put back `old` on one of the model's configs, put back `new` instead."""
    for config in experts_configs(model):
        patches.replace_original(config, _storage(config), old, new)


def transformers_default(model: nn.Module) -> str:
    """The experts implementation transformers gives a model that asks for none (its own choice, not moegraph's)."""
    from transformers import PreTrainedModel

    return PreTrainedModel.get_correct_experts_implementation(model, None)

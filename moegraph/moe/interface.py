"""moegraph's experts as named implementations in transformers' `ExpertsInterface`.

transformers dispatches every fused experts module (`@use_experts_implementation`) through one signature,
`ALL_EXPERTS_FUNCTIONS[config._experts_implementation](self, hidden [T, H], top_k_index [T, K],
top_k_weights [T, K]) -> [T, H]`. moegraph joins that registry under names of its own (transformers' names
are never overwritten):
- "moegraph": the op table's choice for the experts' device, dtype and weight format (moegraph.ops);
- "moegraph_grouped_mm", "moegraph_triton", "moegraph_torch": that MoE backend.
`patch()` sets a model's experts implementation to one of them and `unpatch()` restores the previous one,
so `model.set_experts_implementation(...)` and `config._experts_implementation` keep their meaning.

Eagerly, each call reads its table from the op table's per-module memo (`ops_for_experts`): nothing is probed
or read from the environment per call. Under torch.compile every name runs the traceable experts path of its
weight format (`COMPILED_EXPERT_FUNCTIONS`): dynamo never meets a probe, a Triton launcher or the reference's
host sync, and the table is not consulted.
"""

from __future__ import annotations

import torch
from torch import nn

from .select import BACKENDS, COMPILED_EXPERT_FUNCTIONS

NAME = "moegraph"
# experts implementation name -> the moe_backend it requests ("auto": the op table's choice)
NAMES: dict[str, str] = {NAME: "auto", **{f"{NAME}_{backend}": backend for backend in BACKENDS}}


def experts_name(moe_backend: str) -> str:
    """The experts implementation name for patch()'s `moe_backend` option."""
    return NAME if moe_backend == "auto" else f"{NAME}_{moe_backend}"


def backend_of(name: str | None) -> str | None:
    """The moe_backend a name requests, or None when it is not one of moegraph's."""
    return NAMES.get(name) if isinstance(name, str) else None


def _experts_forward(name: str, moe_backend: str):
    def forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():  # a constant for dynamo: the eager branch is never traced
            compiled = COMPILED_EXPERT_FUNCTIONS[getattr(self, "weight_format", "dense")]
            return compiled(hidden_states, top_k_index, top_k_weights, self)
        from ..ops import ops_for_experts

        return ops_for_experts(self, moe_backend).experts(hidden_states, top_k_index, top_k_weights, self)

    forward.__name__ = forward.__qualname__ = f"{name}_experts_forward"
    forward.__doc__ = (f"transformers' experts signature, experts implementation {name!r} "
                       f"(moe_backend={moe_backend!r}); hidden [T, H], top_k_index [T, K], top_k_weights [T, K].")
    return forward


EXPERTS_FORWARDS = {name: _experts_forward(name, backend) for name, backend in NAMES.items()}


def experts_registry():
    """transformers' ALL_EXPERTS_FUNCTIONS (the instance `@use_experts_implementation` dispatches through)."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    return ALL_EXPERTS_FUNCTIONS


def register_experts() -> None:
    """Add moegraph's names to transformers' ExpertsInterface; idempotent.

    A name already there is left alone (moegraph's from an earlier patch, or a function put in its place on
    purpose, such as a test's mock). The names stay registered after unpatch(): they change nothing for a model
    that does not name them, and a config still naming one (a deep copy, an explicit
    `from_pretrained(..., experts_implementation="moegraph")`) keeps working."""
    registry = experts_registry()
    register = getattr(type(registry), "register", None)  # GeneralInterface.register: the class-wide mapping
    for name, forward in EXPERTS_FORWARDS.items():
        if name in registry:
            continue
        if callable(register):
            register(name, forward)
        else:  # a registry without `register`: the instance's own mapping, which its dispatch reads
            registry[name] = forward


def model_experts_implementation(model: nn.Module) -> str | None:
    """The experts implementation the model's MoE layers dispatch on: the first experts module's config, else the
    model's."""
    for module in model.modules():
        experts = getattr(module, "experts", None)
        config = getattr(experts, "config", None)
        if experts is not None and hasattr(module, "gate") and config is not None:
            return getattr(config, "_experts_implementation", None)
    return getattr(getattr(model, "config", None), "_experts_implementation", None)

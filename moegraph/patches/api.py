"""patch() / unpatch() / is_patched(): what moegraph swaps inside transformers, and how it is undone.

Two scopes:
- `patch()` with no model wraps the transformers classes of every supported family: explicit and
  global, it affects every model of those classes, including ones built afterwards.
- `patch(model)` wraps attributes of that model's own objects only (instance attributes that
  shadow the class methods); other models in the process are untouched.
Nothing happens at import time. `unpatch()` restores the very same objects, in reverse order.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import weakref

import torch
from torch import nn

from ..errors import InvalidArgumentError, UnsupportedModelError, UnsupportedVersionError
from ..moe.block import sparse_moe_forward
from ..ops import ops_for_experts
from ..options import PatchOptions
from .patcher import PatchSet
from .registry import FAMILIES, family_of

logger = logging.getLogger("moegraph")

MIN_TRANSFORMERS_MAJOR = 5

_class_patches = PatchSet()
_class_options: PatchOptions | None = None
_models_with_state: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()  # models given a decoder by the class patch
# Set while moegraph itself runs generate: nested calls (fallbacks, HF internals) go straight to transformers.
_inside_moegraph = contextvars.ContextVar("moegraph_inside_generate", default=False)

_STATE_ATTR = "_moegraph_state"


class _ModelState:
    """What patch(model) attached to one model: its options, its patches, its decoder (lazy)."""

    def __init__(self, options: PatchOptions, patches: PatchSet | None):
        self.options = options
        self.patches = patches  # None when the state was created by the class-level patch
        self.decoder = None

    def release(self) -> None:
        if self.decoder is not None:
            self.decoder.release()
            self.decoder = None


def check_transformers_version() -> None:
    import transformers

    major = int(transformers.__version__.split(".")[0])
    if major < MIN_TRANSFORMERS_MAJOR:
        raise UnsupportedVersionError(
            f"moegraph needs transformers >= {MIN_TRANSFORMERS_MAJOR} (experts as fused 3D parameters), found "
            f"{transformers.__version__}. Upgrade with: pip install 'transformers>={MIN_TRANSFORMERS_MAJOR},<6'"
        )


@contextlib.contextmanager
def inside_moegraph():
    token = _inside_moegraph.set(True)
    try:
        yield
    finally:
        _inside_moegraph.reset(token)


def _moe_forward_wrapper(options: PatchOptions):
    def wrapper(wrapped, instance, args, kwargs):
        hidden_states = args[0] if args else kwargs["hidden_states"]
        return sparse_moe_forward(instance, hidden_states, ops_for_experts(instance.experts, options.moe_backend))

    return wrapper


def _state_for(model: nn.Module) -> _ModelState:
    state = vars(model).get(_STATE_ATTR)
    if state is None:  # a model of a class-patched family, first generate
        state = _ModelState(_class_options or PatchOptions(), patches=None)
        setattr(model, _STATE_ATTR, state)
        _models_with_state.add(model)
    return state


def _decoder_for(model: nn.Module):
    state = _state_for(model)
    if state.decoder is None:
        from ..cuda_graph.decoder import GraphDecoder

        state.decoder = GraphDecoder(model, state.options)
    return state.decoder


def _generate_wrapper(wrapped, instance, args, kwargs):
    if _inside_moegraph.get():
        return wrapped(*args, **kwargs)
    decoder = _decoder_for(instance)
    with inside_moegraph():
        return decoder.generate(wrapped, args, kwargs)


def _patch_classes(options: PatchOptions) -> None:
    global _class_options
    if len(_class_patches):
        if options != _class_options:
            logger.warning("moegraph: classes already patched with %s; keeping those options", _class_options)
        return
    for family in FAMILIES.values():
        _class_patches.wrap(family.sparse_block(), "forward", _moe_forward_wrapper(options))
        _class_patches.wrap(family.causal_lm(), "generate", _generate_wrapper)
    from ..quant import loading

    loading.install(_class_patches)  # fused experts quantized to NF4 as a 4-bit from_pretrained loads them
    _class_options = options


def _patch_model(model: nn.Module, options: PatchOptions) -> nn.Module:
    family = family_of(model)
    state = vars(model).get(_STATE_ATTR)
    if state is not None and state.patches is not None:
        if options != state.options:
            logger.warning("moegraph: model already patched with %s; keeping those options", state.options)
        return model
    if options.moe_backend != "auto":  # an explicit backend must run here: say so now, not at the first forward
        experts = next((m.experts for m in model.modules() if isinstance(m, family.sparse_block())), None)
        if experts is not None:
            ops_for_experts(experts, options.moe_backend)
    patches = PatchSet()
    block_class = family.sparse_block()
    moe_wrapper = _moe_forward_wrapper(options)
    for module in model.modules():
        if isinstance(module, block_class):
            patches.wrap(module, "forward", moe_wrapper)
    if len(patches) == 0:
        logger.warning("moegraph: %s has no %s; nothing to patch in its MoE layers",
                       type(model).__name__, family.sparse_block_class)
    if hasattr(model, "generate") and isinstance(model, family.causal_lm()):
        patches.wrap(model, "generate", _generate_wrapper)
    if state is not None:  # created earlier by the class patch: replace it
        state.release()
    setattr(model, _STATE_ATTR, _ModelState(options, patches))
    return model


def patch(model: nn.Module | None = None, **options) -> nn.Module | None:
    """Make Qwen3-MoE decoding capture-safe and graph-replayed.

    patch(model, ...) patches that model (and returns it); patch() with no model patches the
    transformers classes, so that every such model (also ones built later) is patched.
    Options: moe_backend="auto"|"grouped_mm"|"triton"|"torch", cuda_graphs=True,
    max_batch_size=16, max_seq_len=None (grow on demand), check_every=8.
    Patching twice changes nothing more.
    """
    check_transformers_version()
    opts = PatchOptions.from_kwargs(**options)
    if model is None:
        _patch_classes(opts)
        return None
    if not isinstance(model, nn.Module):
        raise UnsupportedModelError(f"moegraph.patch() expects a transformers model (nn.Module), got {type(model).__name__}")
    return _patch_model(model, opts)


def unpatch(model: nn.Module | None = None) -> None:
    """Undo patch(model), or with no model undo the class-level patch(); frees graphs and static caches."""
    global _class_options
    if model is None:
        _class_patches.restore()
        _class_options = None
        for m in list(_models_with_state):
            state = vars(m).pop(_STATE_ATTR, None)
            if state is not None:
                state.release()
        _models_with_state.clear()
        return
    state = vars(model).pop(_STATE_ATTR, None)
    if state is None:
        return
    state.release()
    if state.patches is not None:
        state.patches.restore()
    _models_with_state.discard(model)
    if model.device.type == "cuda":
        torch.cuda.empty_cache()


def _patched_decoder(model: nn.Module, what: str):
    if not is_patched(model) or not hasattr(model, "generate"):
        raise InvalidArgumentError(f"moegraph.{what}() needs a patched causal LM; call moegraph.patch(model) first")
    return _decoder_for(model)


def capture(model: nn.Module, batch_size: int | None = None, max_length: int | None = None) -> None:
    """Allocate the static KV cache and capture the decode graphs now, instead of in the first generate().

    batch_size: the largest batch to prepare for (default: max_batch_size); max_length: prompt +
    new tokens to prepare for (default: max_seq_len, else 256). Later calls that need more grow the
    cache and re-capture. On the CPU (or with cuda_graphs=False) it allocates the cache only, and says so.
    """
    _patched_decoder(model, "capture").capture(batch_size, max_length)


def decode_stats(model: nn.Module):
    """What the last generate() of a patched model did, over the whole call: graphs or eager, rows, chunks,
    steps, prefill/decode/capture seconds, host ms per step, or why it fell back (reset on every call)."""
    return _patched_decoder(model, "decode_stats").stats


def is_patched(model: nn.Module | None = None) -> bool:
    """With a model: whether its MoE blocks / generate are moegraph's. Without: whether the classes are patched."""
    if model is None:
        return len(_class_patches) > 0
    state = vars(model).get(_STATE_ATTR)
    if state is not None and state.patches is not None:
        return True
    if not len(_class_patches):
        return False
    try:
        family = family_of(model)
    except UnsupportedModelError:
        return False
    return isinstance(model, family.causal_lm()) or any(isinstance(m, family.sparse_block()) for m in model.modules())

"""patch() / unpatch() / is_patched(): what moegraph swaps inside transformers, and how it is undone.

What is patched: the experts implementation the MoE layers dispatch on (moegraph's names in transformers'
ExpertsInterface, moe/interface.py: the MoE blocks stay transformers' own, so `set_experts_implementation()`
keeps its meaning and torch.compile traces them), and `generate` (the graph decoder).
Two scopes:
- `patch()` with no model wraps the transformers classes of every supported family: explicit and
  global, it affects every model of those classes. A model built afterwards that asks for no experts
  implementation gets moegraph's; one built before, with transformers' default, takes moegraph's at its
  first generate(); an explicit other choice (e.g. experts_implementation="eager") is kept.
- `patch(model)` sets that model's experts implementation and wraps its own `generate` (an instance
  attribute that shadows the class method); other models in the process are untouched.
Nothing happens at import time. `unpatch()` restores the very same objects and values, in reverse order.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import threading
import weakref

import torch
from torch import nn

from ..errors import InvalidArgumentError, UnsupportedModelError, UnsupportedVersionError
from ..moe.interface import experts_name, model_experts_implementation, register_experts
from ..ops import ops_for_experts
from ..options import PatchOptions
from . import experts as experts_impl
from .patcher import PatchSet
from ..models import FAMILIES, family_of

logger = logging.getLogger("moegraph")

MIN_TRANSFORMERS_MAJOR = 5

_class_patches = PatchSet()
_class_options: PatchOptions | None = None
_models_with_state: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()  # models given a decoder by the class patch
# models whose experts implementation the class patch chose: model -> (moegraph's name, transformers' choice)
_class_experts: "weakref.WeakKeyDictionary[nn.Module, tuple[str, str]]" = weakref.WeakKeyDictionary()
# Set while moegraph itself runs generate: nested calls (fallbacks, HF internals) go straight to transformers.
_inside_moegraph = contextvars.ContextVar("moegraph_inside_generate", default=False)

_STATE_ATTR = "_moegraph_state"
_decoders_lock = threading.Lock()


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


def _default_experts_wrapper(name: str):
    """get_correct_experts_implementation of a class-patched family: a model asking for none gets `name`."""

    def wrapper(wrapped, instance, args, kwargs):
        requested = args[0] if args else kwargs.get("requested_experts")
        if requested is not None:
            return wrapped(*args, **kwargs)
        _class_experts[instance] = (name, wrapped(*args, **kwargs))  # what unpatch() gives back
        return name

    return wrapper


def _adopt(model: nn.Module) -> None:
    """A model built before the class patch, with transformers' default experts, takes moegraph's (once)."""
    if model in _class_experts or not len(_class_patches):
        return
    current = model_experts_implementation(model)
    if current == experts_impl.transformers_default(model):
        name = experts_name(_class_options.moe_backend)
        experts_impl.write_experts_implementation(model, name)
        _class_experts[model] = (name, current)
        logger.info("moegraph: %s was built before moegraph.patch(); its experts implementation %r (transformers' "
                    "default) becomes %r", type(model).__name__, current, name)


def _state_for(model: nn.Module) -> _ModelState:
    state = vars(model).get(_STATE_ATTR)
    if state is None:  # a model of a class-patched family, first generate
        state = _ModelState(_class_options or PatchOptions(), patches=None)
        setattr(model, _STATE_ATTR, state)
        _models_with_state.add(model)
        _adopt(model)
    return state


def _decoder_for(model: nn.Module):
    with _decoders_lock:  # two threads' first generate() on one model must share one decoder (and its lock)
        state = _state_for(model)
        if state.decoder is None:
            from ..cuda_graph.decoder import GraphDecoder

            family = family_of(model)
            state.decoder = GraphDecoder(model, state.options, family.steps())
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
    register_experts()
    default = _default_experts_wrapper(experts_name(options.moe_backend))
    for family in FAMILIES.values():
        _class_patches.wrap(family.pretrained_model(), "get_correct_experts_implementation", default)
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
    register_experts()
    patches = PatchSet()
    experts_impl.set_experts_implementation(model, experts_name(options.moe_backend), patches)
    if not any(isinstance(module, family.sparse_block()) for module in model.modules()):
        logger.warning("moegraph: %s has no %s; nothing to patch in its MoE layers",
                       type(model).__name__, family.sparse_block_class)
    if hasattr(model, "generate") and isinstance(model, family.causal_lm()):
        patches.wrap(model, "generate", _generate_wrapper)
    if state is not None:  # created earlier by the class patch: replace it
        state.release()
    setattr(model, _STATE_ATTR, _ModelState(options, patches))
    return model


def patch(model: nn.Module | None = None, **options) -> nn.Module | None:
    """Make MoE decoding capture-safe and graph-replayed (the families of moegraph.models.FAMILIES).

    patch(model, ...) patches that model (and returns it): its experts implementation becomes moegraph's
    ("moegraph", or "moegraph_<backend>" with moe_backend=) and its generate() decodes through graphs.
    patch() with no model patches the transformers classes, so that every such model (also ones built
    later) is patched; an experts implementation asked for explicitly is kept.
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
        _restore_class_experts()
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


def _restore_class_experts() -> None:
    """Give every model whose experts the class patch chose transformers' choice back, unless the user chose
    since; a model that patch(model) holds gets it back from unpatch(model)."""
    for model, (name, previous) in list(_class_experts.items()):
        state = vars(model).get(_STATE_ATTR)
        if state is not None and state.patches is not None:
            experts_impl.replace_recorded(model, state.patches, name, previous)
        else:
            experts_impl.write_experts_implementation(model, previous, where=name)
    _class_experts.clear()


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


def free_cache(model: nn.Module) -> None:
    """Free a patched model's static KV cache and decode graphs now; the patch stays, and the next generate()
    allocates and captures again for what it needs. The cache only grows while patched (to the largest batch and
    length a call needed, or `max_seq_len`): this gives the memory back after a long call without unpatching."""
    decoder = _patched_decoder(model, "free_cache")
    decoder.release("free_cache()")
    if model.device.type == "cuda":
        torch.cuda.empty_cache()


def decode_stats(model: nn.Module):
    """What the last generate() of a patched model did, over the whole call: graphs or eager, rows, chunks,
    steps, prefill/decode/capture seconds, host ms per step, or why it fell back (reset on every call)."""
    return _patched_decoder(model, "decode_stats").stats


def is_patched(model: nn.Module | None = None) -> bool:
    """With a model: whether patch(model) or the class patch covers it. Without: whether the classes are patched."""
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

"""NF4 experts: a drop-in replacement for transformers' fused experts modules, and the model-wide swap.

`NF4Experts.forward(hidden [T, H], top_k_index [T, K], top_k_weights [T, K]) -> [T, H]` has the signature of
transformers' experts (`Qwen3MoeExperts`) and dispatches like them: a moegraph experts implementation named by the
config runs moegraph's NF4 path; otherwise `forward_ref`, plain torch (each routed expert dequantized once, then
gate/up/act/down as transformers does, the weighted sum accumulated in float32), so a model quantized by moegraph
still runs where moegraph is not patched. It is not capture-safe (it asks the host which experts were routed);
moegraph's decode step uses its own NF4 kernels on the same buffers.

Buffers (persistent: `.to()`, `state_dict()` carry them), for P in {gate_up_proj, down_proj}, layout of nf4.py:
    P                  uint8   [E, N*K//2]  packed NF4, gate_up_proj: N, K = 2I, H; down_proj: N, K = H, I
    P_absmax           float32 [E, N*K//64] (uint8 when double-quantized)
    P_nested_absmax    float32 [E, ceil(N*K/64/256)]  } only when double-quantized
    P_nested_code      float32 [256]                  }
    P_offset           float32 [E]                    }
so a state dict holds one tensor per bnb QuantState field under the original parameter's name.
`.to(dtype)` / `.half()` keep the stored dtypes (a cast would break the format) and change the compute dtype.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from ..errors import InvalidArgumentError
from ..moe.interface import backend_of, experts_registry
from .nf4 import COMPUTE_DTYPES, NF4Weight, check_nf4_shape, dequantize_nf4, quantize_nf4

logger = logging.getLogger("moegraph")

_PROJECTIONS = ("gate_up_proj", "down_proj")
_FIELDS = {"packed": "", "absmax": "_absmax", "nested_absmax": "_nested_absmax", "nested_code": "_nested_code",
           "offset": "_offset"}  # NF4Weight field -> buffer name suffix


def is_fused_experts(module: nn.Module) -> bool:
    """A transformers fused experts module: 3-D `gate_up_proj` and `down_proj` parameters."""
    params = module._parameters
    return all(isinstance(params.get(name), nn.Parameter) and params[name].dim() == 3 for name in _PROJECTIONS)


def check_fused_experts(module: nn.Module, name: str = "experts") -> None:
    """Raise InvalidArgumentError unless `module` is a fused experts module NF4Experts can replace."""
    if not is_fused_experts(module):
        raise InvalidArgumentError(f"{name} ({type(module).__name__}) is not a fused experts module: it needs 3-D "
                                   f"gate_up_proj and down_proj parameters")
    gate_up, down = module.gate_up_proj, module.down_proj
    where = f"{name} ({type(module).__name__}, gate_up_proj {tuple(gate_up.shape)}, down_proj {tuple(down.shape)})"
    for flag, wanted, meaning in (("is_transposed", False, "transposed weights [E, H, 2I]"),
                                  ("has_bias", False, "biases"), ("has_gate", True, "no gate projection"),
                                  ("is_concatenated", True, "interleaved gate/up rows"),
                                  ("has_post_expert_norm", False, "a post-expert norm")):
        if getattr(module, flag, wanted) != wanted:
            raise InvalidArgumentError(f"{where} has {meaning} ({flag}={not wanted}); NF4Experts supports the "
                                       f"Qwen3-MoE layout only: [gate; up] rows, no bias, not transposed")
    extra = sorted(set(module._parameters) - set(_PROJECTIONS))
    if extra:
        raise InvalidArgumentError(f"{where} has parameters {extra} besides gate_up_proj / down_proj; NF4Experts "
                                   f"would drop them")
    experts, two_inter, hidden = gate_up.shape
    if down.shape != (experts, hidden, two_inter // 2) or two_inter % 2:
        raise InvalidArgumentError(f"{where}: expected gate_up_proj [E, 2I, H] and down_proj [E, H, I]")
    if gate_up.dtype not in COMPUTE_DTYPES or down.dtype != gate_up.dtype:
        raise InvalidArgumentError(f"{where}: weights are {gate_up.dtype} / {down.dtype}; NF4 quantizes float32, "
                                   f"float16 or bfloat16 weights of one dtype")
    if gate_up.is_meta or down.is_meta:
        raise InvalidArgumentError(f"{where} has meta (not loaded) weights: load them before quantizing")
    if not callable(getattr(module, "act_fn", None)):
        raise InvalidArgumentError(f"{where} has no act_fn")
    try:
        check_nf4_shape(gate_up.shape)
        check_nf4_shape(down.shape)
    except InvalidArgumentError as error:
        raise InvalidArgumentError(f"{where}: {error}") from None


class NF4Experts(nn.Module):
    """Fused experts with NF4 weights: gate_up [E, 2I, H] and down [E, H, I] as NF4Weight buffers."""

    weight_format = "nf4"  # what moegraph's op table keys the experts implementation on
    # transformers' experts flags (use_experts_implementation) for code that reads them
    has_gate, has_bias, has_post_expert_norm, is_transposed, is_concatenated = True, False, False, False, True

    def __init__(self, gate_up: NF4Weight, down: NF4Weight, *, act_fn, config=None):
        super().__init__()
        experts, two_inter, hidden = gate_up.shape
        if down.shape != (experts, hidden, two_inter // 2) or two_inter % 2:
            raise InvalidArgumentError(f"NF4Experts: gate_up {gate_up.shape} and down {down.shape} are not "
                                       f"[E, 2I, H] and [E, H, I]")
        if gate_up.dtype != down.dtype or gate_up.device != down.device:
            raise InvalidArgumentError(f"NF4Experts: gate_up ({gate_up.dtype}, {gate_up.device}) and down "
                                       f"({down.dtype}, {down.device}) must share compute dtype and device")
        self.num_experts, self.hidden_dim, self.intermediate_dim = experts, hidden, two_inter // 2
        self.act_fn = act_fn
        self.config = config
        self.dtype = gate_up.dtype  # compute dtype: what the weights dequantize to
        self._double_quant = {"gate_up_proj": gate_up.double_quant, "down_proj": down.double_quant}
        for prefix, weight in (("gate_up_proj", gate_up), ("down_proj", down)):
            for field, tensor in weight.tensors().items():
                self.register_buffer(prefix + _FIELDS[field], tensor, persistent=True)

    @classmethod
    @torch.no_grad()
    def from_experts(cls, experts: nn.Module, double_quant: bool = False) -> NF4Experts:
        """Quantize a transformers fused experts module (e.g. Qwen3MoeExperts); the module is left unchanged."""
        check_fused_experts(experts)
        gate_up = quantize_nf4(experts.gate_up_proj.detach(), double_quant=double_quant)
        down = quantize_nf4(experts.down_proj.detach(), double_quant=double_quant)
        return cls(gate_up, down, act_fn=experts.act_fn, config=getattr(experts, "config", None))

    def _weight(self, prefix: str, shape: tuple[int, int, int]) -> NF4Weight:
        fields = ("packed", "absmax") + (("nested_absmax", "nested_code", "offset")
                                        if self._double_quant[prefix] else ())
        return NF4Weight(shape=shape, dtype=self.dtype,
                         **{field: getattr(self, prefix + _FIELDS[field]) for field in fields})

    @property
    def gate_up(self) -> NF4Weight:
        """NF4Weight [E, 2I, H] over this module's buffers (no copy)."""
        return self._weight("gate_up_proj", (self.num_experts, 2 * self.intermediate_dim, self.hidden_dim))

    @property
    def down(self) -> NF4Weight:
        """NF4Weight [E, H, I] over this module's buffers (no copy)."""
        return self._weight("down_proj", (self.num_experts, self.hidden_dim, self.intermediate_dim))

    def nbytes(self) -> int:
        return self.gate_up.nbytes() + self.down.nbytes()

    def _apply(self, fn, recurse=True):
        # Module.to(dtype) / .half() would cast the float32 absmax / code / offset buffers and silently change
        # the format: every buffer keeps its dtype and only moves; a float cast changes the compute dtype.
        probe = fn(torch.empty(0, dtype=self.dtype, device=self.gate_up_proj.device))
        before = dict(self._buffers)
        super()._apply(fn, recurse)
        for name, old in before.items():
            new = self._buffers[name]
            if new is not None and old is not None and new.dtype != old.dtype:
                self._buffers[name] = old.to(device=new.device)
        if isinstance(probe, torch.Tensor) and probe.dtype in COMPUTE_DTYPES:
            self.dtype = probe.dtype
        return self

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        """transformers' experts signature. NF4Experts has no `@use_experts_implementation`: where the config names
        one of moegraph's experts implementations (moegraph.patch() sets it) that one runs, from transformers'
        ExpertsInterface as a transformers experts module would; any other name has no NF4 form: `forward_ref`."""
        name = getattr(self.config, "_experts_implementation", None)
        if backend_of(name) is not None:
            registry = experts_registry()
            if name in registry:
                return registry[name](self, hidden_states, top_k_index, top_k_weights)
        return self.forward_ref(hidden_states, top_k_index, top_k_weights)

    def forward_ref(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
        """Plain torch: each routed expert dequantized once (syncs with the host, not capture-safe)."""
        out = torch.zeros(hidden_states.shape, dtype=torch.float32, device=hidden_states.device)
        gate_up, down = self.gate_up, self.down
        for expert in top_k_index.unique().tolist():  # host sync: this path is the unpatched fallback
            if not 0 <= expert < self.num_experts:  # transformers' padding slot (index E)
                continue
            token_idx, slot = (top_k_index == expert).nonzero(as_tuple=True)
            x = hidden_states[token_idx].to(self.dtype)  # [t, H]
            gate, up = nn.functional.linear(x, dequantize_nf4(gate_up, expert)[0]).chunk(2, dim=-1)  # [t, I] x2
            y = nn.functional.linear(self.act_fn(gate) * up, dequantize_nf4(down, expert)[0])  # [t, H]
            out.index_add_(0, token_idx, y.float() * top_k_weights[token_idx, slot, None].float())
        return out.to(hidden_states.dtype)

    def extra_repr(self) -> str:
        dq = self._double_quant["gate_up_proj"] or self._double_quant["down_proj"]
        return (f"num_experts={self.num_experts}, hidden_dim={self.hidden_dim}, "
                f"intermediate_dim={self.intermediate_dim}, dtype={self.dtype}, double_quant={dq}")


def _dense_bytes(module: nn.Module) -> int:
    return sum(getattr(module, name).numel() * getattr(module, name).element_size() for name in _PROJECTIONS)


@torch.no_grad()
def quantize_experts(model: nn.Module, *, double_quant: bool = False) -> nn.Module:
    """In place: replace every fused experts module of `model` by NF4Experts, layer by layer, freeing each dense
    module's weights as soon as its NF4 copy exists (peak: the final size plus one layer's dense experts).
    Idempotent (NF4Experts are left alone). Every target is checked before anything changes. Returns `model`."""
    from tqdm.auto import tqdm

    parents: dict[int, list[tuple[nn.Module, str]]] = {}  # every place a module is referenced (tied modules)
    targets: dict[int, tuple[str, nn.Module]] = {}
    already = 0
    for parent_name, parent in model.named_modules(remove_duplicate=False):
        for attr, child in parent._modules.items():
            if child is None:
                continue
            if is_fused_experts(child):
                targets.setdefault(id(child), (f"{parent_name}.{attr}".lstrip("."), child))
                parents.setdefault(id(child), []).append((parent, attr))
            elif isinstance(child, NF4Experts):
                already += 1
    if is_fused_experts(model):
        raise InvalidArgumentError("quantize_experts needs a model that contains experts modules; to quantize one "
                                   "module use NF4Experts.from_experts(module)")
    for name, module in targets.values():
        check_fused_experts(module, name)

    before = after = 0
    cuda_used = False
    for key, (name, module) in tqdm(targets.items(), desc="moegraph: NF4 experts", disable=None):
        before += _dense_bytes(module)
        cuda_used |= module.gate_up_proj.is_cuda
        replacement = NF4Experts.from_experts(module, double_quant=double_quant)
        for parent, attr in parents[key]:
            setattr(parent, attr, replacement)
        for projection in _PROJECTIONS:  # free the dense weights now, even if someone still holds the module
            delattr(module, projection)
        after += replacement.nbytes()
    if cuda_used:
        torch.cuda.empty_cache()  # hand the freed dense weights back to the driver
    logger.info("quantize_experts: %d experts modules to NF4 (double_quant=%s, %d already NF4): "
                "%.1f MB -> %.1f MB", len(targets), double_quant, already, before / 1e6, after / 1e6)
    return model

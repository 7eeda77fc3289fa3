"""Capture-safe MoE experts on `torch.nn.functional.grouped_mm` (fallback `torch._grouped_mm`).

Shapes: hidden [T, H], top_k_index [T, K], top_k_weights [T, K], gate_up_proj [E, 2I, H],
down_proj [E, H, I]; returns [T, H] in the dtype of hidden.
Experts in another of transformers' layouts (`own_layout`: GPT-OSS's transposed gate_up_proj [E, H, 2I] and
down_proj [E, I, H], per-expert biases, interleaved gate/up columns and a clamped SwiGLU) run the same grouping
with their biases added per slot and the module's own `_apply_gate` (layout_grouped_experts).

Capture-safe: every shape depends on T and K only. Pairs are grouped by expert on the device:
a stable sort plus `scatter_add_` counts (never `bincount`/`nonzero`/`.item()`), or in the decode
step moegraph's counting-sort kernel; the combine is a deterministic gather plus a sum over K in
float32 (no atomics), so a replayed graph is bit-identical to the eager call.

Under torch.compile the grouped GEMMs go through `moegraph::grouped_mm`, a custom op that runs the same
kernel: dynamo traces the rest of this function, but grouped_mm's fake (meta) kernel rejects anything but
bf16 with 16-byte aligned strides (fp32, fp16, small hidden sizes), so the GEMM itself stays opaque.
"""

from types import SimpleNamespace

import torch
from torch import nn

from ..kernels.moe_align import moe_align_ref
from ..kernels.moe_combine import moe_combine_ref
from ..kernels.silu_mul import silu_mul_ref

_grouped_mm = getattr(nn.functional, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


@torch.library.custom_op("moegraph::grouped_mm", mutates_args=())
def grouped_mm_op(input: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """input [S, K] grouped by expert @ weight [E, K, N] (group e: rows offs[e-1]:offs[e]) -> [S, N]."""
    return _grouped_mm(input, weight, offs=offs).contiguous()


@grouped_mm_op.register_fake
def _grouped_mm_fake(input, weight, offs):
    return input.new_empty(input.shape[0], weight.shape[-1])


@torch.library.custom_op("moegraph::grouped_mm_backward", mutates_args=())
def _grouped_mm_backward_op(input: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor,
                            grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # an op of its own, so that the backward graph does not meet grouped_mm's fake kernel either
    grad_input = _grouped_mm(grad, weight.transpose(-2, -1), offs=offs)  # [S, K]
    grad_weight = _grouped_mm(input.transpose(0, 1), grad, offs=offs)  # [E, K, N]: input_e^T @ grad_e per group
    return grad_input.contiguous(), grad_weight.contiguous()


@_grouped_mm_backward_op.register_fake
def _grouped_mm_backward_fake(input, weight, offs, grad):
    return input.new_empty(input.shape), weight.new_empty(weight.shape)


def _grouped_mm_setup_context(ctx, inputs, output):
    ctx.save_for_backward(inputs[0], inputs[1], inputs[2])


def _grouped_mm_backward(ctx, grad):
    input, weight, offs = ctx.saved_tensors
    grad_input, grad_weight = _grouped_mm_backward_op(input, weight, offs, grad)
    return grad_input, grad_weight, None


grouped_mm_op.register_autograd(_grouped_mm_backward, setup_context=_grouped_mm_setup_context)


_REFERENCE_OPS = SimpleNamespace(moe_align=moe_align_ref, silu_mul=silu_mul_ref, moe_combine=moe_combine_ref)


def grouped_mm_available() -> bool:
    return _grouped_mm is not None


def moe_experts_grouped_mm(
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    experts: nn.Module,
    ops=None,
) -> torch.Tensor:
    """ops: where moe_align / silu_mul / moe_combine come from (moegraph's Triton kernels in the
    decode step); default: their plain-torch references, fine for any token count."""
    if own_layout(experts):
        return layout_grouped_experts(hidden, top_k_index, top_k_weights, experts, ops=ops)
    return grouped_experts(hidden, top_k_index, top_k_weights, experts.gate_up_proj, experts.down_proj,
                           experts.act_fn, swiglu=getattr(getattr(experts, "config", None), "hidden_act", None) == "silu",
                           ops=ops)


def grouped_experts(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                    gate_up_proj: torch.Tensor, down_proj: torch.Tensor, act_fn, swiglu: bool,
                    ops=None) -> torch.Tensor:
    """The grouped_mm experts over dense weights gate_up_proj [E, 2I, H], down_proj [E, H, I]; swiglu: the
    activation is SiLU (one fused silu_mul), else act_fn(gate) * up."""
    ops = ops or _REFERENCE_OPS
    gemm = grouped_mm_op if torch.compiler.is_compiling() else _grouped_mm
    token_of_slot, position, offsets = ops.moe_align(top_k_index, gate_up_proj.shape[0])  # [T*K], [T*K], [E]
    pairs = hidden.index_select(0, token_of_slot).to(gate_up_proj.dtype)  # [T*K, H], grouped by expert
    gate_up = gemm(pairs, gate_up_proj.transpose(-2, -1), offs=offsets)  # [T*K, 2I]
    if swiglu:
        act = ops.silu_mul(gate_up)  # [T*K, I]
    else:
        gate, up = gate_up.chunk(2, dim=-1)
        act = act_fn(gate) * up
    down = gemm(act, down_proj.transpose(-2, -1), offs=offsets)  # [T*K, H]
    return ops.moe_combine(down, position, top_k_weights, hidden.dtype)


def own_layout(experts: nn.Module) -> bool:
    """Whether the experts differ from Qwen3-MoE's `[gate; up]` rows of gate_up_proj [E, 2I, H] without biases and
    act_fn(gate) * up, as transformers' `@use_experts_implementation` flags say (is_transposed, has_bias,
    is_concatenated) or a class with a `_apply_gate` of its own (GPT-OSS: all four)."""
    gate = getattr(type(experts), "_apply_gate", None)
    return bool(getattr(experts, "is_transposed", False) or getattr(experts, "has_bias", False)
                or not getattr(experts, "is_concatenated", True)
                or (gate is not None and getattr(gate, "__name__", "") != "_default_apply_gate"))


def layout_grouped_experts(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                           experts: nn.Module, ops=None) -> torch.Tensor:
    """transformers' grouped_mm_experts_forward for experts in their own layout (own_layout), capture-safe: the
    pairs grouped by moe_align, each slot's expert found by a scatter (no sort of its own, no host sync), the bias of
    that expert added to its rows, the gate the module's `_apply_gate` (GPT-OSS: clamp, sigmoid, (up + 1) * glu on
    interleaved columns: elementwise, fixed shapes)."""
    ops = ops or _REFERENCE_OPS
    gemm = grouped_mm_op if torch.compiler.is_compiling() else _grouped_mm
    gate_up_proj, down_proj = experts.gate_up_proj, experts.down_proj
    if not getattr(experts, "is_transposed", False):  # grouped_mm takes [E, in, out]
        gate_up_proj, down_proj = gate_up_proj.transpose(-2, -1), down_proj.transpose(-2, -1)
    flat = top_k_index.reshape(-1)  # [T*K]
    token_of_slot, position, offsets = ops.moe_align(top_k_index, gate_up_proj.shape[0])  # [T*K], [T*K], [E]
    pairs = hidden.index_select(0, token_of_slot).to(gate_up_proj.dtype)  # [T*K, H], grouped by expert
    gate_up = gemm(pairs, gate_up_proj, offs=offsets)  # [T*K, 2I]
    has_bias = getattr(experts, "has_bias", False)
    expert_of_slot = torch.empty_like(flat).scatter_(0, position, flat) if has_bias else None  # [T*K]
    if has_bias:
        gate_up = gate_up + experts.gate_up_proj_bias.index_select(0, expert_of_slot)
    down = gemm(experts._apply_gate(gate_up), down_proj, offs=offsets)  # [T*K, H]
    if has_bias:
        down = down + experts.down_proj_bias.index_select(0, expert_of_slot)
    return ops.moe_combine(down, position, top_k_weights, hidden.dtype)

"""MoE experts over NF4 weights (moegraph/quant's NF4Experts), one function per backend.

Shapes as in grouped_mm.py: hidden [T, H], top_k_index [T, K], top_k_weights [T, K] -> [T, H].
- triton: decode-sized calls run the fused NF4 kernels (kernels/nf4_moe.py: NF4 dequantized in
  registers inside the gate_up+SwiGLU and down GEMMs, 0.5 byte per weight read); larger calls
  (prefill) take the grouped_mm path below.
- grouped_mm: the layer's experts are dequantized into one dense [E, 2I, H] / [E, H, I] pair
  (one launch each on CUDA), the grouped GEMMs run on that, and the dense copy is dropped after the
  layer: the caching allocator hands the same block to every layer, so it is one reused buffer.
  Under torch.compile the dequantization is the opaque op moegraph::nf4_dense (same kernel), as the GEMMs are.
- torch: NF4Experts' plain-torch `forward_ref` (dequantize each routed expert; syncs with the host).
"""

from __future__ import annotations

import torch
from torch import nn

from ..kernels import triton_available
from ..kernels.moe_align import MAX_PAIRS
from ..kernels.moe_combine import moe_combine
from ..kernels.nf4_dequant import nf4_dequantize
from .grouped_mm import grouped_mm_available, grouped_experts


def _dense_eager(weight) -> torch.Tensor:
    """An NF4Weight [E, N, K] as a dense tensor in its compute dtype."""
    from ..quant.nf4 import dequantize_nf4

    if not triton_available(weight.packed) or not weight.packed.is_cuda:
        return dequantize_nf4(weight)
    return nf4_dequantize(weight.packed, weight.absmax, _code(weight.packed.device), weight.shape, weight.dtype,
                          nested_code=weight.nested_code, nested_absmax=weight.nested_absmax, offset=weight.offset)


@torch.library.custom_op("moegraph::nf4_dense", mutates_args=())
def _nf4_dense_op(packed: torch.Tensor, absmax: torch.Tensor, nested_absmax: torch.Tensor | None,
                  nested_code: torch.Tensor | None, offset: torch.Tensor | None, shape: list[int],
                  dtype: torch.dtype) -> torch.Tensor:
    from ..quant.nf4 import NF4Weight

    return _dense_eager(NF4Weight(packed=packed, absmax=absmax, shape=tuple(shape), dtype=dtype,
                                  nested_absmax=nested_absmax, nested_code=nested_code, offset=offset))


@_nf4_dense_op.register_fake
def _nf4_dense_fake(packed, absmax, nested_absmax, nested_code, offset, shape, dtype):
    return packed.new_empty(shape, dtype=dtype)


def _dense(weight) -> torch.Tensor:
    if torch.compiler.is_compiling():  # opaque to dynamo: the code table, the Triton launch and the chunk loop
        return _nf4_dense_op(weight.packed, weight.absmax, weight.nested_absmax, weight.nested_code, weight.offset,
                             list(weight.shape), weight.dtype)
    return _dense_eager(weight)


_CODES: dict[torch.device, torch.Tensor] = {}  # the NF4 table per device, made once (a copy inside a capture fails)


def _code(device) -> torch.Tensor:
    code = _CODES.get(device)
    if code is None:
        from ..quant.nf4 import nf4_code

        code = _CODES[device] = nf4_code(device)
    return code


def moe_experts_nf4_grouped_mm(hidden, top_k_index, top_k_weights, experts: nn.Module, ops=None) -> torch.Tensor:
    swiglu = getattr(getattr(experts, "config", None), "hidden_act", None) == "silu"
    return grouped_experts(hidden, top_k_index, top_k_weights, _dense(experts.gate_up), _dense(experts.down),
                           experts.act_fn, swiglu, ops)


def moe_experts_nf4_triton(hidden, top_k_index, top_k_weights, experts: nn.Module, ops=None) -> torch.Tensor:
    swiglu = getattr(getattr(experts, "config", None), "hidden_act", "silu") == "silu"
    if swiglu and top_k_index.numel() <= MAX_PAIRS and triton_available(hidden):
        from ..kernels.nf4_moe import fused_moe_experts_nf4

        return fused_moe_experts_nf4(hidden, top_k_index, top_k_weights, _kernel_view(experts.gate_up),
                                     _kernel_view(experts.down), _code(hidden.device), moe_combine)
    if grouped_mm_available():
        return moe_experts_nf4_grouped_mm(hidden, top_k_index, top_k_weights, experts, ops)
    return moe_experts_nf4_ref(hidden, top_k_index, top_k_weights, experts)


def moe_experts_nf4_ref(hidden, top_k_index, top_k_weights, experts: nn.Module, ops=None) -> torch.Tensor:
    return experts.forward_ref(hidden, top_k_index, top_k_weights)


def _kernel_view(weight):
    from ..kernels.nf4_moe import NF4Tensors

    return NF4Tensors(weight.packed, weight.absmax, weight.shape, weight.nested_code, weight.nested_absmax,
                      weight.offset)

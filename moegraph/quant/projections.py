"""The dense projections of a model in memory as bitsandbytes `Linear4bit` (NF4), as `load_in_4bit` loads them.

quantize_projections(model) swaps every `nn.Linear` outside `skip` (by default the lm_head, which
transformers' bitsandbytes integration keeps too) for a `Linear4bit` holding the same weight in NF4,
one module at a time, so a model built in memory ends up as `from_pretrained(..., load_in_4bit=True)`
would load it. Fused experts are not `nn.Linear`: quantize_experts() handles those.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from ..errors import InvalidArgumentError

logger = logging.getLogger("moegraph")


def _linear4bit(linear: nn.Linear, compute_dtype: torch.dtype, double_quant: bool) -> nn.Module:
    import bitsandbytes as bnb

    device = linear.weight.device
    q = bnb.nn.Linear4bit(linear.in_features, linear.out_features, bias=linear.bias is not None,
                          compute_dtype=compute_dtype, compress_statistics=double_quant, quant_type="nf4",
                          device="meta")
    # Params4bit quantizes when it is moved onto a device
    q.weight = bnb.nn.Params4bit(linear.weight.data, requires_grad=False, quant_type="nf4", blocksize=64,
                                 compress_statistics=double_quant).to(device)
    if linear.bias is not None:
        q.bias = nn.Parameter(linear.bias.data, requires_grad=False)
    return q


@torch.no_grad()
def quantize_projections(model: nn.Module, *, skip: tuple[str, ...] = ("lm_head",), double_quant: bool = False,
                         compute_dtype: torch.dtype | None = None) -> nn.Module:
    """In place: every nn.Linear whose name does not end with an entry of `skip` becomes a bnb Linear4bit."""
    try:
        import bitsandbytes  # noqa: F401
    except ImportError as exc:
        raise InvalidArgumentError("quantize_projections needs bitsandbytes: pip install bitsandbytes") from exc
    swapped = 0
    for parent_name, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            full = f"{parent_name}.{name}" if parent_name else name
            if type(child) is not nn.Linear or any(full == s or full.endswith("." + s) for s in skip):
                continue
            setattr(parent, name, _linear4bit(child, compute_dtype or child.weight.dtype, double_quant))
            swapped += 1
    logger.info("moegraph: %d projections quantized to NF4 (bitsandbytes Linear4bit)", swapped)
    return model

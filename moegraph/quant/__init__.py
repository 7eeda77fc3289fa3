"""4-bit expert weights in bitsandbytes' NF4 layout: the format, its (de)quantization and the NF4 experts module.

The format (`nf4.py`) imports nothing of moegraph's but its errors, so that the kernels can take its constants from
here; the experts module and the projections (which use the kernels) load on first use.
"""

import importlib

from .nf4 import (
    BLOCKSIZE,
    NF4_CODE,
    NF4Weight,
    dequantize_nf4,
    expert_absmax,
    from_bnb,
    quantize_nf4,
    to_bnb,
)

_LAZY = {"NF4Experts": ".experts", "quantize_experts": ".experts", "quantize_projections": ".projections"}


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "BLOCKSIZE",
    "NF4Experts",
    "NF4Weight",
    "NF4_CODE",
    "dequantize_nf4",
    "expert_absmax",
    "from_bnb",
    "quantize_experts",
    "quantize_nf4",
    "quantize_projections",
    "to_bnb",
]

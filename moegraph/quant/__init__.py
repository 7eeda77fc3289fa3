"""4-bit expert weights in bitsandbytes' NF4 layout: the format, its (de)quantization and the NF4 experts module."""

from .experts import NF4Experts, quantize_experts
from .projections import quantize_projections
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

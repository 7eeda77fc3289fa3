"""Dequantize a stack of NF4 matrices (bitsandbytes' layout) into a dense tensor, in one launch.

nf4_dequantize(packed [E, N*K/2] uint8, absmax, code [16] fp32, shape (E, N, K), dtype) -> [E, N, K].
Element i of expert e is byte i // 2 of its row (high nibble first), times absmax[e, i // 64]; the
product is formed in float32 and rounded once to `dtype`, as bitsandbytes' dequantize_4bit does.
absmax is fp32 [E, N*K/64], or double-quantized: uint8 codes with `nested_code` [256],
`nested_absmax` [E, ceil(blocks / 256)] and `offset` [E] (absmax = nested_code[q] * nested_absmax + offset).
Used before grouped GEMMs over NF4 experts (prefill), where the dense copy lives one layer at a time.
Capture-safe: grid fixed by the sizes, no host sync.
"""

import torch

from ._nf4 import _nf4_absmax
from ._triton import tl, triton

BLOCK_BYTES = 1024  # bytes (2048 weights) per program: 32 absmax blocks, wide enough for full-width stores
QUANT_BLOCK = 64  # weights per absmax (bitsandbytes' blocksize for NF4 here)
NESTED_BLOCK = 256  # absmax values per nested absmax (bitsandbytes' double-quantization blocksize)


@triton.jit
def _nf4_dequantize_kernel(packed_ptr, absmax_ptr, code_ptr, nested_code_ptr, nested_absmax_ptr, offset_ptr, out_ptr,
                           bytes_per_expert, blocks_per_expert, nested_per_expert, NESTED: tl.constexpr,
                           EXACT_MUL: tl.constexpr, BLOCK_BYTES: tl.constexpr, QUANT_BLOCK: tl.constexpr):
    expert = tl.program_id(0).to(tl.int64)
    byte = tl.program_id(1) * BLOCK_BYTES + tl.arange(0, BLOCK_BYTES)
    mask = byte < bytes_per_expert
    packed = tl.load(packed_ptr + expert * bytes_per_expert + byte, mask=mask, other=0).to(tl.int32)
    absmax = _nf4_absmax(absmax_ptr + expert * blocks_per_expert, nested_code_ptr,
                         nested_absmax_ptr + expert * nested_per_expert, offset_ptr + expert,
                         byte // (QUANT_BLOCK // 2), mask, NESTED, EXACT_MUL)
    high = tl.load(code_ptr + (packed >> 4), mask=mask, other=0.0) * absmax
    low = tl.load(code_ptr + (packed & 15), mask=mask, other=0.0) * absmax
    out = out_ptr + expert * 2 * bytes_per_expert + 2 * byte
    out_dtype = out_ptr.dtype.element_ty
    tl.store(out, high.to(out_dtype), mask=mask)
    tl.store(out + 1, low.to(out_dtype), mask=mask)


def _check(packed, absmax, shape):
    experts, rows, cols = shape
    if (rows * cols) % QUANT_BLOCK or packed.dtype != torch.uint8 or packed.numel() * 2 != experts * rows * cols:
        raise ValueError(f"nf4_dequantize: packed {tuple(packed.shape)} {packed.dtype} does not hold {shape} in NF4 "
                         f"blocks of {QUANT_BLOCK}")
    if absmax.numel() != experts * rows * cols // QUANT_BLOCK:
        raise ValueError(f"nf4_dequantize: absmax has {absmax.numel()} values, {shape} needs "
                         f"{experts * rows * cols // QUANT_BLOCK}")


def nf4_dequantize(packed, absmax, code, shape, dtype, nested_code=None, nested_absmax=None, offset=None,
                   out=None) -> torch.Tensor:
    experts, rows, cols = shape
    _check(packed, absmax, shape)
    nested = nested_code is not None
    if out is None:
        out = torch.empty(shape, dtype=dtype, device=packed.device)
    bytes_per_expert = rows * cols // 2
    blocks = rows * cols // QUANT_BLOCK
    dummy = absmax  # unused pointers when not nested
    _nf4_dequantize_kernel[(experts, triton.cdiv(bytes_per_expert, BLOCK_BYTES))](
        packed.contiguous(), absmax.contiguous(), code, nested_code if nested else dummy,
        nested_absmax.contiguous() if nested else dummy, offset if nested else dummy, out,
        bytes_per_expert, blocks, triton.cdiv(blocks, NESTED_BLOCK) if nested else 1,
        NESTED=nested, EXACT_MUL=packed.is_cuda and nested, BLOCK_BYTES=BLOCK_BYTES, QUANT_BLOCK=QUANT_BLOCK)
    return out


def nf4_dequantize_ref(packed, absmax, code, shape, dtype, nested_code=None, nested_absmax=None, offset=None):
    experts, rows, cols = shape
    _check(packed, absmax, shape)
    packed = packed.reshape(experts, -1)
    if nested_code is not None:
        blocks = absmax.reshape(experts, -1)
        scale = nested_code[blocks.long()]
        scale = scale * nested_absmax.reshape(experts, -1).repeat_interleave(NESTED_BLOCK, dim=1)[:, :blocks.shape[1]]
        absmax = scale + offset.reshape(experts, 1)
    absmax = absmax.reshape(experts, -1, 1).float()
    nibbles = torch.stack([packed >> 4, packed & 15], dim=-1).reshape(experts, -1, QUANT_BLOCK).long()
    return (code[nibbles] * absmax).to(dtype).reshape(shape)

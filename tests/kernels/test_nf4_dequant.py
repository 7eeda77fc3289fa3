"""nf4_dequantize (Triton, and its torch reference) against bitsandbytes' own dequantize_4bit, per expert.

Exact everywhere, except the Triton kernel in bf16 on the CPU: the interpreter truncates to bf16
instead of rounding, so there it is checked within one bf16 ulp.

bitsandbytes quantizes an expert as one flat run of 64-blocks; its CPU dequantize_4bit (0.50) reads 2-D shapes as
if every row started a block, wrong where a row is not a whole number of blocks (48 x 96). Each expert is
therefore quantized and dequantized by bitsandbytes as its flat vector: the same bytes and absmax.
"""

import pytest
import torch

from moegraph.kernels import triton_available
from moegraph.kernels.nf4_dequant import nf4_dequantize, nf4_dequantize_ref

bnb_functional = pytest.importorskip("bitsandbytes.functional")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _quantize_per_expert(weight, nested):
    """bitsandbytes' quantize_4bit of each expert, stacked into moegraph's [E, ...] layout."""
    packed, states = zip(*(bnb_functional.quantize_4bit(w.reshape(-1), blocksize=64, quant_type="nf4",
                                                        compress_statistics=nested) for w in weight))
    stack = dict(packed=torch.stack([p.reshape(-1) for p in packed]), code=states[0].code.float())
    if nested:
        stack.update(absmax=torch.stack([s.absmax for s in states]),
                     nested_code=states[0].state2.code.float(),
                     nested_absmax=torch.stack([s.state2.absmax for s in states]),
                     offset=torch.stack([s.offset.reshape(()) for s in states]).float())
    else:
        stack["absmax"] = torch.stack([s.absmax for s in states])
    return stack, [(p, s) for p, s in zip(packed, states)]


@pytest.mark.parametrize("nested", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(3, 32, 64), (2, 48, 96)])
def test_nf4_dequantize_equals_bitsandbytes(nested, dtype, shape):
    weight = torch.randn(shape, generator=torch.Generator().manual_seed(sum(shape))).to(dtype)
    stack, per_expert = _quantize_per_expert(weight, nested)
    want = torch.stack([bnb_functional.dequantize_4bit(p, s) for p, s in per_expert]).reshape(shape)
    args = {k: v.to(DEVICE) for k, v in stack.items()}
    packed, absmax, code = args.pop("packed"), args.pop("absmax"), args.pop("code")
    assert torch.equal(nf4_dequantize_ref(packed, absmax, code, shape, dtype, **args).cpu(), want)
    if triton_available(packed):
        out = torch.full(shape, 7.0, dtype=dtype, device=DEVICE)  # poisoned: every element must be written
        nf4_dequantize(packed, absmax, code, shape, dtype, **args, out=out)
        if DEVICE == "cpu" and dtype == torch.bfloat16:
            torch.testing.assert_close(out, want, atol=0, rtol=2 ** -7)
        else:
            assert torch.equal(out.cpu(), want)

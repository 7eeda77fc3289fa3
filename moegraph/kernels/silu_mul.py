"""SwiGLU gate of the experts: silu(gate) * up, from the fused gate_up projection, in one launch.

silu_mul(gate_up [N, 2I]) -> [N, I]; rounds where `act_fn(gate) * up` rounds in eager PyTorch
(silu in float32 rounded to the input dtype, then the product rounded). Replaces 2 kernels.
Capture-safe: grid (N, I / BLOCK).
"""

import torch

from ._triton import pdl, pdl_wait, tl, triton

BLOCK = 256  # 768-wide rows (Qwen3-30B-A3B) in 3 programs


@triton.jit
def _silu_mul_kernel(gate_up_ptr, out_ptr, inter, BLOCK: tl.constexpr, USE_PDL: tl.constexpr = False):
    pdl_wait(USE_PDL)  # before reading what an earlier kernel wrote
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(gate_up_ptr + row * 2 * inter + cols, mask=mask, other=0.0)
    up = tl.load(gate_up_ptr + row * 2 * inter + inter + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    act = (g * tl.sigmoid(g)).to(gate.dtype)
    tl.store(out_ptr + row * inter + cols, (act.to(tl.float32) * up.to(tl.float32)).to(gate.dtype), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    rows, width = gate_up.shape
    if width % 2:
        raise ValueError(f"silu_mul: gate_up width {width} is not even")
    gate_up = gate_up.contiguous()
    out = torch.empty(rows, width // 2, dtype=gate_up.dtype, device=gate_up.device)
    _silu_mul_kernel[(rows, triton.cdiv(width // 2, BLOCK))](gate_up, out, width // 2, BLOCK=BLOCK,
                                                            **pdl(gate_up.device))
    return out


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up

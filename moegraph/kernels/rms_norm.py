"""Fused RMSNorm, optionally with the residual add before it.

rms_norm(x [R, H], weight [H]) -> [R, H]; add_rms_norm(residual [R, H], x [R, H], weight) ->
(residual + x, rms_norm(residual + x)). Rounds where transformers' eager Qwen3MoeRMSNorm rounds
(normalize in float32, round to the input dtype, multiply by the weight, round), so one kernel
stands in for the ~8 elementwise kernels of the eager norm (+1 for the add).
Capture-safe: one launch, grid fixed by R, no host sync.
"""

import torch

from ._triton import pdl, pdl_wait, tl, triton


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, sum_ptr, n_cols, eps,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr = False):
    pdl_wait(USE_PDL)  # before reading what an earlier kernel wrote
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        res = tl.load(res_ptr + row * n_cols + cols, mask=mask, other=0.0)
        x = (res.to(tl.float32) + x.to(tl.float32)).to(x.dtype)  # the residual stream keeps its dtype
        tl.store(sum_ptr + row * n_cols + cols, x, mask=mask)
    xf = x.to(tl.float32)
    variance = tl.sum(xf * xf, axis=0) / n_cols
    normed = (xf * tl.rsqrt(variance + eps)).to(x.dtype)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    out = (w.to(tl.float32) * normed.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * n_cols + cols, out, mask=mask)


def _launch(x, residual, weight, eps):
    if x.shape[-1] != weight.shape[0]:
        raise ValueError(f"rms_norm: last dim {x.shape[-1]} != weight size {weight.shape[0]}")
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    out_dtype = torch.promote_types(weight.dtype, x.dtype)
    out = torch.empty(x2.shape, dtype=out_dtype, device=x.device)
    summed = torch.empty_like(x2) if residual is not None else out
    res2 = residual.reshape(x2.shape).contiguous() if residual is not None else x2
    _rms_norm_kernel[(x2.shape[0],)](x2, res2, weight, out, summed, x2.shape[1], eps,
                                     HAS_RESIDUAL=residual is not None,
                                     BLOCK=triton.next_power_of_2(x2.shape[1]), **pdl(x2.device))
    return summed.view(x.shape), out.view(x.shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _launch(x, None, weight, eps)[1]


def add_rms_norm(residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float):
    return _launch(x, residual, weight, eps)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def add_rms_norm_ref(residual, x, weight, eps):
    summed = residual + x
    return summed, rms_norm_ref(summed, weight, eps)

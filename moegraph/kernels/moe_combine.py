"""Weighted combine of per-(token, expert) outputs back into tokens, in one launch.

moe_combine(expert_out [>= T*K, H] grouped by expert (padding rows allowed), position [T*K] (or None: rows in
pair order), weights [T, K]) -> [T, H],
out[t] = sum_k weights[t, k] * expert_out[position[t*K + k]], accumulated in float32 in slot
order (deterministic: no atomics), rounded once to the output dtype. `position[p]` is where
pair p landed after the sort by expert. Replaces the inverse permutation, casts, multiply and
sum of the eager combine (~6 kernels).
Capture-safe: grid (T, H / BLOCK).
"""

from __future__ import annotations

import torch

from ._triton import pdl, pdl_wait, tl, triton

BLOCK_H = 256  # a 2048-wide hidden row in 8 programs: enough programs for small T on 132 SMs


@triton.jit
def _moe_combine_kernel(expert_out_ptr, position_ptr, weights_ptr, out_ptr, hidden, TOP_K: tl.constexpr,
                        IN_PAIR_ORDER: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr = False):
    pdl_wait(USE_PDL)  # before reading what an earlier kernel wrote
    token = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < hidden
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for slot in tl.static_range(TOP_K):
        if IN_PAIR_ORDER:
            pos = token * TOP_K + slot
        else:
            pos = tl.load(position_ptr + token * TOP_K + slot)
        w = tl.load(weights_ptr + token * TOP_K + slot).to(tl.float32)
        y = tl.load(expert_out_ptr + pos * hidden + cols, mask=mask, other=0.0).to(tl.float32)
        acc += w * y
    tl.store(out_ptr + token * hidden + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


def moe_combine(expert_out: torch.Tensor, position: torch.Tensor | None, weights: torch.Tensor,
                out_dtype: torch.dtype) -> torch.Tensor:
    """position None: expert_out is in pair order (row t*K + k holds pair (t, k)), no sort happened."""
    tokens, top_k = weights.shape
    hidden = expert_out.shape[1]
    positions = tokens * top_k if position is None else position.numel()
    if expert_out.shape[0] < tokens * top_k or positions != tokens * top_k:
        raise ValueError(f"moe_combine: expected {tokens * top_k} pairs, got {expert_out.shape[0]} rows / "
                         f"{positions} positions")
    out = torch.empty(tokens, hidden, dtype=out_dtype, device=expert_out.device)
    grid = (tokens, triton.cdiv(hidden, BLOCK_H))
    position_arg = weights if position is None else position.contiguous()  # never read in pair order
    _moe_combine_kernel[grid](expert_out.contiguous(), position_arg, weights.contiguous(), out, hidden,
                              TOP_K=top_k, IN_PAIR_ORDER=position is None, BLOCK=BLOCK_H, **pdl(out.device))
    return out


def moe_combine_ref(expert_out, position, weights, out_dtype):
    tokens, top_k = weights.shape
    rows = expert_out[:tokens * top_k] if position is None else expert_out[position]
    per_pair = rows.view(tokens, top_k, -1).float()
    return (per_pair * weights.float().unsqueeze(-1)).sum(dim=1).to(out_dtype)

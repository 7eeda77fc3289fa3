"""One decode step's bookkeeping between two replays, in one launch: the picked tokens into the output and the
next step's inputs, EOS handling included.

advance(next_tokens [R], tokens [R, L], column, unfinished [R] bool or None, eos [n] or None, pad, alive [S] bool,
step, lengths [R], rope_start [R], token_ids / positions / rope_positions [>= R] or None):
- with EOS: finished rows get `pad`; rows that pick an EOS token finish; alive[step] = whether any row is unfinished;
- tokens[:, column] = the (padded) tokens;
- where the step is not the last: token_ids = tokens, positions = lengths + step, rope_positions = rope_start + step.
The eager loop did this with ~10 small torch launches a step (where, isin, not, and, any, a store, a column copy,
an input copy, two adds); each is a few microseconds of GPU time beside a ~3 ms batch-1 step.
Writes in place, returns nothing; no host sync.
"""

from __future__ import annotations

import torch

from ._triton import pdl_wait, tl, triton


@triton.jit
def _advance_kernel(next_ptr, tokens_ptr, tokens_stride, column, unfinished_ptr, eos_ptr, num_eos, pad, alive_ptr,
                    step, lengths_ptr, rope_start_ptr, token_ids_ptr, positions_ptr, rope_positions_ptr, rows,
                    HAS_EOS: tl.constexpr, NEXT_INPUTS: tl.constexpr, BLOCK_R: tl.constexpr,
                    BLOCK_EOS: tl.constexpr, USE_PDL: tl.constexpr = False):
    pdl_wait(USE_PDL)
    r = tl.arange(0, BLOCK_R)
    mask = r < rows
    token = tl.load(next_ptr + r, mask=mask, other=0)
    if HAS_EOS:
        unfinished = tl.load(unfinished_ptr + r, mask=mask, other=0) != 0
        token = tl.where(unfinished, token, pad)
        e = tl.arange(0, BLOCK_EOS)
        eos = tl.load(eos_ptr + e, mask=e < num_eos, other=-1)
        is_eos = tl.sum((token[:, None] == eos[None, :]).to(tl.int32), axis=1) > 0
        unfinished = unfinished & (is_eos == 0)
        tl.store(unfinished_ptr + r, unfinished.to(tl.int8), mask=mask)
        tl.store(alive_ptr + step, (tl.sum((unfinished & mask).to(tl.int32), axis=0) > 0).to(tl.int8))
    tl.store(tokens_ptr + r.to(tl.int64) * tokens_stride + column, token, mask=mask)
    if NEXT_INPUTS:
        tl.store(token_ids_ptr + r, token, mask=mask)
        tl.store(positions_ptr + r, tl.load(lengths_ptr + r, mask=mask, other=0) + step, mask=mask)
        tl.store(rope_positions_ptr + r, tl.load(rope_start_ptr + r, mask=mask, other=0) + step, mask=mask)


def _check(tokens, unfinished, alive, next_inputs):
    bools = [t for t in (unfinished, alive) if t is not None]
    if tokens.dtype != torch.long or tokens.stride(1) != 1 or any(t.dtype != torch.bool for t in bools):
        raise ValueError("advance: tokens int64 with contiguous columns, unfinished / alive bool")
    if next_inputs is not None and any(t.dtype != torch.long for t in next_inputs):
        raise ValueError("advance: token_ids / positions / rope_positions int64")


def advance(next_tokens, tokens, column: int, unfinished, eos, pad: int, alive, step: int, lengths, rope_start,
            next_inputs) -> None:
    """next_inputs: (token_ids, positions, rope_positions) of the static inputs, or None on the last step."""
    _check(tokens, unfinished, alive, next_inputs)
    rows = next_tokens.shape[0]
    has_eos = eos is not None
    token_ids, positions, rope_positions = next_inputs if next_inputs is not None else (tokens, tokens, tokens)
    # bool tensors as the bytes they are stored in
    unfinished_bytes = unfinished.view(torch.int8) if has_eos else tokens
    alive_bytes = alive.view(torch.int8) if has_eos else tokens
    _advance_kernel[(1,)](next_tokens.contiguous(), tokens, tokens.stride(0), column, unfinished_bytes,
                          eos if has_eos else tokens, eos.numel() if has_eos else 0, pad, alive_bytes, step,
                          lengths, rope_start, token_ids, positions, rope_positions, rows, HAS_EOS=has_eos,
                          NEXT_INPUTS=next_inputs is not None, BLOCK_R=max(triton.next_power_of_2(rows), 2),
                          BLOCK_EOS=max(triton.next_power_of_2(eos.numel() if has_eos else 1), 2))


def advance_ref(next_tokens, tokens, column: int, unfinished, eos, pad, alive, step: int, lengths, rope_start,
                next_inputs) -> None:
    """The same in torch ops (what the loop ran before; the CPU path)."""
    if eos is not None:
        next_tokens = torch.where(unfinished, next_tokens, pad)
        unfinished &= ~torch.isin(next_tokens, eos)
        alive[step] = unfinished.any()
    tokens[:, column] = next_tokens
    if next_inputs is not None:
        token_ids, positions, rope_positions = next_inputs
        token_ids.copy_(next_tokens)
        torch.add(lengths, step, out=positions)
        torch.add(rope_start, step, out=rope_positions)

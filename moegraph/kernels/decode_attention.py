"""Decode attention over the static cache, split along the keys (flash-decoding), reading only live positions.

decode_attention(q [b, Hq, D], key_cache / value_cache [b, Hkv, S, D], positions [b], scale) -> [b, Hq, D]:
one new query per row attends to its cached positions 0..positions[row] (the current token's K/V are already
written there), or to the last `window` of them (sliding-window layers), with optional attention sinks (one
learned logit per query head that joins the softmax's denominator, as GPT-OSS does).

Two launches, both with grids fixed by (b, Hkv or Hq, max_splits), so one captured graph serves every length:
1. `_split_kernel`, grid (b, Hkv, max_splits): the query heads of one KV head (its GQA group) read each K/V block
   once. Each row's live span is cut into `splits` chunks, chosen on the device from the row's own length
   (more splits for longer rows, at least MIN_CHUNK keys each, at most max_splits); a program past its row's
   splits returns at once, so a short call on a large cache reads no more than on a small one.
   It writes an unnormalised partial (running max m, sum l, weighted values acc) per split, in float32.
2. `_combine_kernel`, grid (b, Hq): merges the row's partials (and the sink) into the output, COMBINE_SPLITS
   partials at a time.
max_splits is chosen on the host from (b, Hkv, capacity) only, so it is fixed for a captured graph.
Softmax in base 2 with the scale folded in (exp2 is one instruction); P is rounded to the value dtype before
P @ V, as flash attention does, so bf16 results match SDPA to bf16 rounding.
"""

from __future__ import annotations

import functools
import math

import torch

from . import _INTERPRET
from ._triton import pdl, pdl_wait, tl, triton

LOG2E = 1.4426950408889634
BLOCK_N = 64  # keys per inner step
# keys a split covers at least: below that a split's fixed cost outweighs its reads. 64 against 256: a 128-key row
# in 2 programs per KV head, the H100's 48-layer decode step 3.4% faster at batch 1 in bf16 and in NF4
# (ab_decode.py attn_short_chunks, 2026-12-06: BENCHMARKS.md, "Expert tiles and short attention chunks")
MIN_CHUNK = 64
WAVES = 4  # programs to aim for per SM when choosing max_splits
COMBINE_SPLITS = 32  # partials the combine weighs at a time


@triton.jit
def _split_kernel(q_ptr, k_ptr, v_ptr, pos_ptr, rows_ptr, acc_ptr, ml_ptr, q_heads, k_row_stride, k_head_stride,
                  scale_log2, window, max_splits, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
                  HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, MIN_KEYS: tl.constexpr, WINDOWED: tl.constexpr,
                  UPCAST: tl.constexpr, PRECISION: tl.constexpr, CACHE_ROWS: tl.constexpr = False,
                  USE_PDL: tl.constexpr = False):
    pdl_wait(USE_PDL)  # before reading what an earlier kernel wrote
    row = tl.program_id(0)
    kv = tl.program_id(1)
    split = tl.program_id(2)
    end = tl.load(pos_ptr + row).to(tl.int32) + 1
    start = 0
    if WINDOWED:
        start = tl.maximum(end - window, 0)
    live = end - start
    splits = tl.minimum(tl.cdiv(live, MIN_KEYS), max_splits)
    chunk = tl.cdiv(tl.cdiv(live, splits), BLOCK) * BLOCK
    lo = start + split * chunk
    if lo < end:  # programs past the row's splits write nothing; the combine reads only the used ones
        hi = tl.minimum(lo + chunk, end)
        group = tl.arange(0, GROUP_PAD)
        dims = tl.arange(0, HEAD_DIM)
        heads = kv * GROUP + group
        in_group = group < GROUP
        q = tl.load(q_ptr + (row * q_heads + heads)[:, None] * HEAD_DIM + dims[None, :], mask=in_group[:, None],
                    other=0.0)
        if UPCAST:  # Triton's interpreter multiplies 16-bit floats in tl.dot wrongly; the GPU keeps them
            q = q.to(tl.float32)
        if CACHE_ROWS:  # query rows are tokens of the cache rows given (a prefill's prompt tokens)
            base = tl.load(rows_ptr + row) * k_row_stride + kv * k_head_stride
        else:
            base = row * k_row_stride + kv * k_head_stride
        m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        l = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
        for n0 in range(lo, hi, BLOCK):
            keys = n0 + tl.arange(0, BLOCK)
            live_keys = keys < hi
            offsets = base + keys[:, None] * HEAD_DIM + dims[None, :]
            k = tl.load(k_ptr + offsets, mask=live_keys[:, None], other=0.0)
            if UPCAST:
                k = k.to(tl.float32)
            scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2  # [GROUP_PAD, BLOCK], log2 units
            scores = tl.where(live_keys[None, :], scores, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, 1))
            alpha = tl.exp2(m - m_new)
            p = tl.exp2(scores - m_new[:, None])
            l = l * alpha + tl.sum(p, 1)
            v = tl.load(v_ptr + offsets, mask=live_keys[:, None], other=0.0)
            p = p.to(v.dtype)
            if UPCAST:
                p = p.to(tl.float32)
                v = v.to(tl.float32)
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
            m = m_new
        part = (row * q_heads + heads) * max_splits + split  # [GROUP_PAD] partial index
        tl.store(acc_ptr + part[:, None] * HEAD_DIM + dims[None, :], acc, mask=in_group[:, None])
        tl.store(ml_ptr + part * 2, m, mask=in_group)
        tl.store(ml_ptr + part * 2 + 1, l, mask=in_group)


@triton.jit
def _combine_kernel(acc_ptr, ml_ptr, pos_ptr, sink_ptr, out_ptr, q_heads, window, max_splits,
                    HEAD_DIM: tl.constexpr, SPLITS_PAD: tl.constexpr, SPLITS_STEP: tl.constexpr,
                    BLOCK: tl.constexpr, MIN_KEYS: tl.constexpr, WINDOWED: tl.constexpr, HAS_SINK: tl.constexpr,
                    USE_PDL: tl.constexpr = False):
    pdl_wait(USE_PDL)  # before reading what an earlier kernel wrote
    row = tl.program_id(0)
    head = tl.program_id(1)
    end = tl.load(pos_ptr + row).to(tl.int32) + 1
    start = 0
    if WINDOWED:
        start = tl.maximum(end - window, 0)
    live = end - start
    splits = tl.minimum(tl.cdiv(live, MIN_KEYS), max_splits)
    chunk = tl.cdiv(tl.cdiv(live, splits), BLOCK) * BLOCK
    used = tl.cdiv(live, chunk)  # the splits that had keys (split_kernel's `lo < end`)
    idx = tl.arange(0, SPLITS_PAD)
    valid = idx < used
    part = (row * q_heads + head) * max_splits + idx
    m = tl.load(ml_ptr + part * 2, mask=valid, other=float("-inf"))
    l = tl.load(ml_ptr + part * 2 + 1, mask=valid, other=0.0)
    m_max = tl.max(m, 0)
    weight = tl.where(valid, tl.exp2(m - m_max), 0.0)
    denominator = tl.sum(weight * l, 0)
    if HAS_SINK:
        denominator += tl.exp2(tl.load(sink_ptr + head).to(tl.float32) * 1.4426950408889634 - m_max)
    dims = tl.arange(0, HEAD_DIM)
    # the partials SPLITS_STEP splits at a time: all at once ([SPLITS_PAD, HEAD_DIM] float32) spills registers at
    # 256 (sm_90, Triton 3.9: 86 spill instructions for 132 splits, none stepped), which 64-key chunks reach at batch 1
    total = tl.zeros([HEAD_DIM], tl.float32)
    for first in range(0, used, SPLITS_STEP):
        step = first + tl.arange(0, SPLITS_STEP)
        live_step = step < used
        step_part = (row * q_heads + head) * max_splits + step
        step_weight = tl.exp2(tl.load(ml_ptr + step_part * 2, mask=live_step, other=float("-inf")) - m_max)
        acc = tl.load(acc_ptr + step_part[:, None] * HEAD_DIM + dims[None, :], mask=live_step[:, None], other=0.0)
        total += tl.sum(acc * step_weight[:, None], 0)
    out = total / denominator
    tl.store(out_ptr + (row * q_heads + head) * HEAD_DIM + dims, out.to(out_ptr.dtype.element_ty))


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8


def choose_max_splits(rows: int, kv_heads: int, capacity: int, device: torch.device) -> int:
    """Splits per (row, KV head) to launch: enough programs to fill the GPU for one long row, never more than a
    full-capacity row can use. Depends on the shapes only (fixed for a captured graph), not on the lengths."""
    fill = math.ceil(WAVES * _sm_count(device) / (rows * kv_heads))
    return max(1, min(fill, math.ceil(capacity / MIN_CHUNK)))


def decode_attention(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, positions: torch.Tensor,
                     scale: float, window: int | None = None, sinks: torch.Tensor | None = None,
                     max_splits: int | None = None, cache_rows: torch.Tensor | None = None) -> torch.Tensor:
    """See the module docstring. window: keys visible to a query, itself included (None: all); sinks [Hq];
    max_splits: override the launch's split count (tests); cache_rows [b]: the cache row each query reads
    (default: query row i reads cache row i; a prefill's prompt tokens share their row's)."""
    rows, q_heads, head_dim = q.shape
    _, kv_heads, capacity, _ = key_cache.shape
    _check(q, key_cache, value_cache, positions, sinks, cache_rows)
    group = q_heads // kv_heads
    if max_splits is None:
        max_splits = choose_max_splits(rows, kv_heads, capacity, q.device)
    q = q.contiguous()
    partial_acc = torch.empty((rows, q_heads, max_splits, head_dim), dtype=torch.float32, device=q.device)
    partial_ml = torch.empty((rows, q_heads, max_splits, 2), dtype=torch.float32, device=q.device)
    out = torch.empty_like(q)
    windowed = window is not None
    window = window if windowed else 0
    splits_pad = triton.next_power_of_2(max_splits)
    _split_kernel[(rows, kv_heads, max_splits)](
        q, key_cache, value_cache, positions, positions if cache_rows is None else cache_rows, partial_acc,
        partial_ml, q_heads, key_cache.stride(0), key_cache.stride(1), scale * LOG2E, window, max_splits, GROUP=group,
        GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim, BLOCK=BLOCK_N, MIN_KEYS=MIN_CHUNK,
        WINDOWED=windowed, UPCAST=_INTERPRET, CACHE_ROWS=cache_rows is not None,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", num_warps=4, num_stages=2,
        **pdl(q.device))
    _combine_kernel[(rows, q_heads)](
        partial_acc, partial_ml, positions, sinks if sinks is not None else partial_ml, out, q_heads, window,
        max_splits, HEAD_DIM=head_dim, SPLITS_PAD=splits_pad, SPLITS_STEP=min(splits_pad, COMBINE_SPLITS),
        BLOCK=BLOCK_N, MIN_KEYS=MIN_CHUNK, WINDOWED=windowed, HAS_SINK=sinks is not None, num_warps=4, **pdl(q.device))
    return out


def _check(q, key_cache, value_cache, positions, sinks, cache_rows=None) -> None:
    rows, q_heads, head_dim = q.shape
    if cache_rows is not None and cache_rows.shape != (rows,):
        raise ValueError(f"decode_attention: cache_rows {tuple(cache_rows.shape)}, want ({rows},)")
    if (key_cache.shape != value_cache.shape or (cache_rows is None and key_cache.shape[0] < rows)
            or key_cache.shape[3] != head_dim):
        raise ValueError(f"decode_attention: q {tuple(q.shape)} does not match caches {tuple(key_cache.shape)} / "
                         f"{tuple(value_cache.shape)}")
    if q_heads % key_cache.shape[1] or head_dim & (head_dim - 1) or head_dim < 16:
        raise ValueError(f"decode_attention: {q_heads} query heads over {key_cache.shape[1]} KV heads, head_dim "
                         f"{head_dim} (needs a whole GQA group and a power-of-two head_dim >= 16)")
    if key_cache.stride(3) != 1 or key_cache.stride(2) != head_dim or key_cache.stride() != value_cache.stride():
        raise ValueError("decode_attention: caches must be [rows, kv_heads, positions, head_dim] with contiguous "
                         "positions, as StaticKVCache allocates them")
    if positions.shape != (rows,) or (sinks is not None and sinks.shape != (q_heads,)):
        raise ValueError(f"decode_attention: positions {tuple(positions.shape)} (want ({rows},)) or sinks "
                         f"{None if sinks is None else tuple(sinks.shape)} (want ({q_heads},))")


def decode_attention_ref(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                         positions: torch.Tensor, scale: float, window: int | None = None,
                         sinks: torch.Tensor | None = None, max_splits: int | None = None,
                         cache_rows: torch.Tensor | None = None) -> torch.Tensor:
    """What transformers' attention computes for these rows: SDPA over the visible positions (a sink adds a
    column to the softmax that no value follows). max_splits is ignored (the kernel's tuning only)."""
    rows, q_heads, head_dim = q.shape
    if cache_rows is None:
        key_cache, value_cache = key_cache[:rows], value_cache[:rows]
    else:  # each query row reads its cache row (a gathered copy: a reference, not a fast path)
        key_cache, value_cache = key_cache[cache_rows], value_cache[cache_rows]
    kv_heads, capacity = key_cache.shape[1], key_cache.shape[2]
    visible = visible_positions(positions, capacity, window)  # [b, S]
    q = q.reshape(rows, kv_heads, q_heads // kv_heads, head_dim)  # the GQA group folds into the query axis
    if sinks is None:
        mask = torch.zeros(visible.shape, dtype=q.dtype, device=q.device).masked_fill_(~visible, float("-inf"))
        out = torch.nn.functional.scaled_dot_product_attention(q, key_cache, value_cache,
                                                               attn_mask=mask[:, None, None, :], scale=scale)
        return out.reshape(rows, q_heads, head_dim)
    scores = torch.matmul(q, key_cache.transpose(2, 3)) * scale  # [b, Hkv, G, S]
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    sink = sinks.reshape(1, kv_heads, -1, 1).to(scores.dtype).expand(rows, -1, -1, 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1).float(), dim=-1)[..., :-1].to(value_cache.dtype)
    return torch.matmul(probs, value_cache).reshape(rows, q_heads, head_dim)


def visible_positions(positions: torch.Tensor, capacity: int, window: int | None = None) -> torch.Tensor:
    """[b, S] bool: cache position p is visible to row r's query once p <= positions[r] (and, in a sliding
    window of w keys, p > positions[r] - w)."""
    cache_positions = torch.arange(capacity, device=positions.device)[None, :]
    visible = cache_positions <= positions[:, None]
    if window is not None:
        visible &= cache_positions > positions[:, None] - window
    return visible

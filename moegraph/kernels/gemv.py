"""Dense decode GEMV: y = x @ W^T (+ bias) for a few rows, with bf16 / fp16 / fp32 weights W [N, K].

linear_gemv(x [M, K], weight [N, K], bias [N] or None) -> [M, N] in x.dtype;
linear_gemv_group(x, weights, biases) -> one output per weight: up to three weights of the same K (q, k and v)
in one launch, read from the module's own parameters (no concatenated copy to keep in step with them).
add_rms_norm_gemv_group(residual, x, norm_weight, eps, weights, biases) -> (residual + x, outputs): the decoder
layer's add + RMSNorm fused in front of the group (kernels/rms_norm.py's rounding): every program normalizes the
few rows itself (a few KB from L2, while its first weight step is in flight), so the norm costs no launch of its
own; program 0 writes the summed residual stream. add_rms_norm_gemv(...) -> (residual + x, the normalized rows,
output) does the same for one weight whose input other kernels read too (the router's, before the experts).
cuBLAS runs a handful of rows as a GEMM with a tile far taller than the rows; here each program owns BLOCK_N
output columns for all M rows (M <= MAX_ROWS): it reads its weight tile once, in wide BLOCK_K steps, and
multiplies it with every row in registers (float32 products, one sum per step), so the weights stream at
close to copy bandwidth whatever M is. Rounded once to x's dtype.
Capture-safe: grid fixed by the shapes, no host sync, no atomics (a replay is bit-identical to the eager
call). The summation order depends on BLOCK_K only, so a weight gives the same bits alone or in a group.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ._triton import pdl, pdl_wait, tl, triton

# Where the GEMV beats cuBLAS, measured on the H200 at Qwen3-30B-A3B's shapes in bf16 (CUDA-graph replay,
# benchmarks/gemv_decode.py, 2026-12-04; us GEMV / cuBLAS):
#   q+k+v [5120 x 2048] in one launch: 5.9 / 15.0 at 1 row, 7.7 / 15.2 at 2, 12.4 / 15.2 at 4, 20.7 / 15.3 at 8
#   o_proj [2048 x 4096]:              5.3 / 7.5 at 1 row,  6.9 / 7.4 at 2,  10.7 / 7.1 at 4
#   router [128 x 2048]:               2.2 / 4.8 at 1 row,  3.5 / 5.0 at 8
#   lm_head [151936 x 2048]:           147.5 / 143.6 at 1 row (cuBLAS already streams it at 4.2 TB/s)
MAX_ROWS = 8  # the kernel's limit (the [rows, BLOCK_N, BLOCK_K] products live in registers)
QKV_MAX_ROWS = 4
LINEAR_MAX_ROWS = 2
ROUTER_MAX_ROWS = 8
# rows up to which a norm runs inside the router's GEMV (every program normalizes them: more rows, more work
# per program); the q/k/v GEMV's own limit until the fused prologue is timed at more rows
NORM_MAX_ROWS = QKV_MAX_ROWS
WIDE_N = 32768  # outputs from which cuBLAS is as fast at any row count (the lm_head)
NUM_WARPS = 4
# The tensor-core form (use_dot=True) for up to DOT_ROWS_LIMIT rows, where the multiply-add form loses to cuBLAS
# (q+k+v at 8 rows above: three launches, 21 MB in 15.3 us, 1.4 TB/s). Not used (DOT_MAX_ROWS 0): in the whole step
# it lost to cuBLAS on the H100 (benchmarks/ab_decode.py switch gemv_dot, 48 layers, 2026-12-06: batch 8 11.46
# ms/step against 11.08).
DOT_ROWS_LIMIT = 16
DOT_MAX_ROWS = 0
DOT_TILE = (16, 256)  # 16 weight rows a program (the smallest tensor-core tile): 320 programs for q+k+v, 128 for o
# Under Triton's interpreter (the CPU tests) each program is a Python loop: the multiply-add form takes
# INTERPRETER_BLOCK_N weight rows a program there (each output's sum depends on BLOCK_K only: the same bits as the
# GPU's 2-4 rows; the q/k/v GEMV behind a norm took most of a CPU generate() on 2-row tiles)
INTERPRETER_BLOCK_N = 64


def tile_for(rows: int, n: int, k: int) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_K) for `rows` rows of N outputs and K inputs (H200, the same measurements: 4 x 2048 was
    the fastest of 18 tiles x warps at 1-2 rows; from 4 rows the products need a narrower BLOCK_K)."""
    if n <= 256:
        return (2, 1024)
    return (4, 2048) if rows <= 2 else (4, 1024)


@triton.jit
def _normed_rows(x, res_ptr, nw_ptr, inv_rms, rows, ks, row_mask, k_mask, K, NORM: tl.constexpr,
                 HAS_ADD: tl.constexpr):
    """The GEMV's input rows at columns ks: x itself, or the RMSNorm of (residual + x) rounded as rms_norm rounds."""
    return normed_input(x, res_ptr, nw_ptr, inv_rms[:, None], rows[:, None] * K + ks[None, :],
                        row_mask[:, None] & k_mask[None, :], ks, k_mask, NORM, HAS_ADD)


@triton.jit
def normed_input(x, res_ptr, nw_ptr, inv_rms, offs, mask, ks, k_mask, NORM: tl.constexpr, HAS_ADD: tl.constexpr):
    """x (elements at `offs` of the rows, columns `ks`), or with NORM the RMSNorm of (residual + x) there, rounded
    as rms_norm rounds: the sum to x's dtype (the residual stream keeps it), x * inv_rms, then times the weight.
    inv_rms broadcasts against x (one value per row); the NF4 GEMV (_nf4.py) normalizes its x slices here too."""
    if NORM:
        if HAS_ADD:
            res = tl.load(res_ptr + offs, mask=mask, other=0.0)
            x = (res.to(tl.float32) + x.to(tl.float32)).to(x.dtype)
        normed = (x.to(tl.float32) * inv_rms).to(x.dtype)
        nw = tl.load(nw_ptr + ks, mask=k_mask, other=0.0)
        x = (nw.to(tl.float32) * normed.to(tl.float32)).to(x.dtype)
    return x


@triton.jit
def row_inv_rms(x_ptr, res_ptr, sum_ptr, rows, row_mask, K, eps, WRITE_SUM, HAS_ADD: tl.constexpr,
                 BLOCK_K: tl.constexpr, ROWS: tl.constexpr):
    """1 / RMS of each row of (residual + x) [ROWS]; with WRITE_SUM (program 0) residual + x is stored too."""
    sq = tl.zeros([ROWS], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        mask = row_mask[:, None] & (ks < K)[None, :]
        x = tl.load(x_ptr + rows[:, None] * K + ks[None, :], mask=mask, other=0.0)
        if HAS_ADD:
            res = tl.load(res_ptr + rows[:, None] * K + ks[None, :], mask=mask, other=0.0)
            x = (res.to(tl.float32) + x.to(tl.float32)).to(x.dtype)  # the residual stream keeps its dtype
            if WRITE_SUM:
                tl.store(sum_ptr + rows[:, None] * K + ks[None, :], x, mask=mask)
        xf = x.to(tl.float32)
        sq += tl.sum(xf * xf, axis=1)
    return tl.rsqrt(sq / K + eps)


@triton.jit
def _rows_inv_rms(x_ptr, res_ptr, sum_ptr, rows, row_mask, K, eps, WRITE_SUM, NORM: tl.constexpr,
                  HAS_ADD: tl.constexpr, BLOCK_K: tl.constexpr, ROWS: tl.constexpr):
    """1 / RMS of the rows with NORM (row_inv_rms), else zeros (never read)."""
    inv_rms = tl.zeros([ROWS], dtype=tl.float32)
    if NORM:
        inv_rms = row_inv_rms(x_ptr, res_ptr, sum_ptr, rows, row_mask, K, eps, WRITE_SUM, HAS_ADD, BLOCK_K, ROWS)
    return inv_rms


@triton.jit
def _input_step(x_ptr, res_ptr, nw_ptr, normed_ptr, inv_rms, rows, row_mask, ks, k_mask, K, WRITE_SUM,
                NORM: tl.constexpr, HAS_ADD: tl.constexpr, STORE_NORMED: tl.constexpr):
    """The GEMV's input rows at columns ks ([ROWS, BLOCK_K]), normalized with NORM; with STORE_NORMED program 0
    also writes them out (what the experts read after the router's GEMV)."""
    x = tl.load(x_ptr + rows[:, None] * K + ks[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
    x = _normed_rows(x, res_ptr, nw_ptr, inv_rms, rows, ks, row_mask, k_mask, K, NORM, HAS_ADD)
    if STORE_NORMED:
        if WRITE_SUM:
            tl.store(normed_ptr + rows[:, None] * K + ks[None, :], x, mask=row_mask[:, None] & k_mask[None, :])
    return x


@triton.jit
def _gemv_tile(x_ptr, w_ptr, b_ptr, out_ptr, tile, M, N, K, res_ptr, nw_ptr, sum_ptr, normed_ptr, eps, WRITE_SUM,
               ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr,
               NORM: tl.constexpr, HAS_ADD: tl.constexpr, STORE_NORMED: tl.constexpr, USE_PDL: tl.constexpr,
               USE_DOT: tl.constexpr, DOT_FP32: tl.constexpr):
    if USE_DOT:
        _gemv_tile_dot(x_ptr, w_ptr, b_ptr, out_ptr, tile, M, N, K, res_ptr, nw_ptr, sum_ptr, normed_ptr, eps,
                       WRITE_SUM, ROWS, BLOCK_N, BLOCK_K, HAS_BIAS, NORM, HAS_ADD, STORE_NORMED, USE_PDL, DOT_FP32)
    else:
        _gemv_tile_fma(x_ptr, w_ptr, b_ptr, out_ptr, tile, M, N, K, res_ptr, nw_ptr, sum_ptr, normed_ptr, eps,
                       WRITE_SUM, ROWS, BLOCK_N, BLOCK_K, HAS_BIAS, NORM, HAS_ADD, STORE_NORMED, USE_PDL)


@triton.jit
def _gemv_tile_dot(x_ptr, w_ptr, b_ptr, out_ptr, tile, M, N, K, res_ptr, nw_ptr, sum_ptr, normed_ptr, eps,
                   WRITE_SUM, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   HAS_BIAS: tl.constexpr, NORM: tl.constexpr, HAS_ADD: tl.constexpr, STORE_NORMED: tl.constexpr,
                   USE_PDL: tl.constexpr, DOT_FP32: tl.constexpr):
    """The tensor-core form for 5-16 rows: [BLOCK_N, BLOCK_K] weight tiles times the rows (padded to ROWS >= 16)
    on tensor cores, float32 accumulation (a bf16 product is exact in float32: only the order of the sums differs
    from the multiply-add form). DOT_FP32: float32 operands (float32 weights, or the CPU interpreter)."""
    cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)  # output columns = weight rows
    col_mask = cols < N
    rows = tl.arange(0, ROWS)
    row_mask = rows < M
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * K
    acc = tl.zeros([BLOCK_N, ROWS], dtype=tl.float32)
    pdl_wait(USE_PDL)
    inv_rms = _rows_inv_rms(x_ptr, res_ptr, sum_ptr, rows, row_mask, K, eps, WRITE_SUM, NORM, HAS_ADD, BLOCK_K, ROWS)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        w = tl.load(w_rows + ks[None, :], mask=col_mask[:, None] & k_mask[None, :], other=0.0)
        x = _input_step(x_ptr, res_ptr, nw_ptr, normed_ptr, inv_rms, rows, row_mask, ks, k_mask, K, WRITE_SUM, NORM,
                        HAS_ADD, STORE_NORMED)
        if DOT_FP32:
            acc = tl.dot(w.to(tl.float32), tl.trans(x.to(tl.float32)), acc, input_precision="ieee")
        else:
            acc = tl.dot(w, tl.trans(x), acc)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[:, None]
    tl.store(out_ptr + rows[None, :] * N + cols[:, None], acc.to(out_ptr.dtype.element_ty),
             mask=row_mask[None, :] & col_mask[:, None])


@triton.jit
def _gemv_tile_fma(x_ptr, w_ptr, b_ptr, out_ptr, tile, M, N, K, res_ptr, nw_ptr, sum_ptr, normed_ptr, eps,
                   WRITE_SUM, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   HAS_BIAS: tl.constexpr, NORM: tl.constexpr, HAS_ADD: tl.constexpr, STORE_NORMED: tl.constexpr,
                   USE_PDL: tl.constexpr):
    cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)  # output columns = weight rows
    col_mask = cols < N
    rows = tl.arange(0, ROWS)
    row_mask = rows < M
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * K
    acc = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
    ks = tl.arange(0, BLOCK_K)
    # the first weight step is loaded before waiting for x: the weights are no earlier kernel's output
    w = tl.load(w_rows + ks[None, :], mask=col_mask[:, None] & (ks < K)[None, :], other=0.0)
    pdl_wait(USE_PDL)
    inv_rms = _rows_inv_rms(x_ptr, res_ptr, sum_ptr, rows, row_mask, K, eps, WRITE_SUM, NORM, HAS_ADD, BLOCK_K, ROWS)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        x = _input_step(x_ptr, res_ptr, nw_ptr, normed_ptr, inv_rms, rows, row_mask, ks, k_mask, K, WRITE_SUM, NORM,
                        HAS_ADD, STORE_NORMED)
        next_ks = ks + BLOCK_K  # all masked off after the last step
        next_w = tl.load(w_rows + next_ks[None, :], mask=col_mask[:, None] & (next_ks < K)[None, :], other=0.0)
        acc += tl.sum(w.to(tl.float32)[None, :, :] * x.to(tl.float32)[:, None, :], axis=2)
        w = next_w
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rows[:, None] * N + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_mask[:, None] & col_mask[None, :])


@triton.jit
def _gemv_group_kernel(x_ptr, w0, b0, out0, N0, w1, b1, out1, N1, w2, b2, out2, N2, tiles0, tiles01, M, K,
                       res_ptr, nw_ptr, sum_ptr, normed_ptr, eps, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr, NORM: tl.constexpr = False,
                       HAS_ADD: tl.constexpr = False, STORE_NORMED: tl.constexpr = False,
                       USE_DOT: tl.constexpr = False, DOT_FP32: tl.constexpr = False, USE_PDL: tl.constexpr = False):
    """Program tiles [0, tiles0) are weight 0's output columns, [tiles0, tiles01) weight 1's, the rest weight 2's.
    NORM: x is (residual +) the rows before RMSNorm (weight nw_ptr), normalized here; program 0 writes the sum
    (HAS_ADD) and the normalized rows (STORE_NORMED)."""
    tile = tl.program_id(0)
    first = tile == 0
    if tile < tiles0:
        _gemv_tile(x_ptr, w0, b0, out0, tile, M, N0, K, res_ptr, nw_ptr, sum_ptr, normed_ptr, eps, first, ROWS,
                   BLOCK_N, BLOCK_K, HAS_BIAS, NORM, HAS_ADD, STORE_NORMED, USE_PDL, USE_DOT, DOT_FP32)
    elif tile < tiles01:
        _gemv_tile(x_ptr, w1, b1, out1, tile - tiles0, M, N1, K, res_ptr, nw_ptr, sum_ptr, normed_ptr, eps, first,
                   ROWS, BLOCK_N, BLOCK_K, HAS_BIAS, NORM, HAS_ADD, STORE_NORMED, USE_PDL, USE_DOT, DOT_FP32)
    else:
        _gemv_tile(x_ptr, w2, b2, out2, tile - tiles01, M, N2, K, res_ptr, nw_ptr, sum_ptr, normed_ptr, eps, first,
                   ROWS, BLOCK_N, BLOCK_K, HAS_BIAS, NORM, HAS_ADD, STORE_NORMED, USE_PDL, USE_DOT, DOT_FP32)


def _check_group(x: torch.Tensor, weights: Sequence[torch.Tensor], use_dot: bool) -> None:
    if not 1 <= len(weights) <= 3:
        raise ValueError(f"linear_gemv_group: 1 to 3 weights, got {len(weights)}")
    rows, k = x.shape
    limit = DOT_ROWS_LIMIT if use_dot else MAX_ROWS
    if rows > limit:
        raise ValueError(f"linear_gemv_group: at most {limit} rows{' (tensor cores)' if use_dot else ''}, got {rows} "
                         f"(use torch.nn.functional.linear)")
    for w in weights:
        if w.dim() != 2 or w.shape[1] != k or not w.is_contiguous() or w.dtype != x.dtype:
            raise ValueError(f"linear_gemv_group: weight {tuple(w.shape)} {w.dtype} does not take x "
                             f"{tuple(x.shape)} {x.dtype} (contiguous [N, K] of x's dtype)")


def _launch_group(x, weights, biases, tile, num_warps, norm=None, use_dot=False):
    """norm: None, or (residual or None, norm weight, eps, summed output, normalized output or None): x is
    normalized in the kernel. use_dot: the tensor-core form (rows padded to 16)."""
    _check_group(x, weights, use_dot)
    rows, k = x.shape
    block_n, block_k = tile or (DOT_TILE if use_dot else tile_for(rows, max(w.shape[0] for w in weights), k))
    if tile is None and not use_dot and x.device.type != "cuda":
        block_n = INTERPRETER_BLOCK_N
    block_k = min(block_k, triton.next_power_of_2(k))
    outs = [torch.empty((rows, w.shape[0]), dtype=x.dtype, device=x.device) for w in weights]
    tiles = [triton.cdiv(w.shape[0], block_n) for w in weights]
    padded = list(zip(weights, biases if biases is not None else [None] * len(weights), outs))
    while len(padded) < 3:  # unused slots: never reached (their tile ranges are empty)
        padded.append(padded[0])
        tiles.append(0)
    args = []
    for w, b, out in padded:
        args += [w, b if b is not None else w, out, w.shape[0]]
    residual, norm_weight, eps, summed, normed = norm if norm is not None else (None, x, 0.0, x, None)
    _gemv_group_kernel[(sum(tiles),)](x, *args, tiles[0], tiles[0] + tiles[1], rows, k,
                                      residual if residual is not None else x, norm_weight, summed,
                                      normed if normed is not None else x, eps,
                                      ROWS=max(16 if use_dot else 1, triton.next_power_of_2(rows)),
                                      BLOCK_N=block_n, BLOCK_K=block_k, HAS_BIAS=biases is not None,
                                      NORM=norm is not None, HAS_ADD=residual is not None,
                                      STORE_NORMED=normed is not None, USE_DOT=use_dot,
                                      DOT_FP32=not x.is_cuda or x.dtype == torch.float32, num_warps=num_warps,
                                      **pdl(x.device))
    return tuple(outs)


def linear_gemv_group(x: torch.Tensor, weights: Sequence[torch.Tensor],
                      biases: Sequence[torch.Tensor] | None = None,
                      tile: tuple[int, int] | None = None, num_warps: int = NUM_WARPS,
                      use_dot: bool = False) -> tuple[torch.Tensor, ...]:
    """x [M, K] times each weight [N_i, K] (+ bias_i): one launch. tile, num_warps: overrides (benchmarks);
    use_dot: the tensor-core form (up to DOT_ROWS_LIMIT rows)."""
    return _launch_group(x.contiguous(), weights, biases, tile, num_warps, use_dot=use_dot)


def add_rms_norm_gemv_group(residual: torch.Tensor, x: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                            weights: Sequence[torch.Tensor], biases: Sequence[torch.Tensor] | None = None,
                            tile: tuple[int, int] | None = None, num_warps: int = NUM_WARPS,
                            use_dot: bool = False) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """(residual + x, each weight times RMSNorm(residual + x)) in one launch; x None: no add (residual returned
    as it is). The norm weight is of the rows' dtype (the normalized rows are what the weights multiply)."""
    summed, _, outs = _add_rms_norm_launch(residual, x, norm_weight, eps, weights, biases, tile, num_warps, False,
                                           use_dot)
    return summed, outs


def add_rms_norm_gemv(residual: torch.Tensor, x: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                      weight: torch.Tensor, tile: tuple[int, int] | None = None,
                      num_warps: int = NUM_WARPS) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(residual + x, RMSNorm(residual + x), weight times it) in one launch: a norm whose output other kernels
    read too (the router's, before the experts)."""
    summed, normed, (out,) = _add_rms_norm_launch(residual, x, norm_weight, eps, [weight], None, tile, num_warps,
                                                  True)
    return summed, normed, out


def _add_rms_norm_launch(residual, x, norm_weight, eps, weights, biases, tile, num_warps, store_normed: bool,
                         use_dot: bool = False):
    if norm_weight.shape != (residual.shape[-1],) or norm_weight.dtype != residual.dtype:
        raise ValueError(f"add_rms_norm_gemv: norm weight {tuple(norm_weight.shape)} {norm_weight.dtype} "
                         f"does not take rows {tuple(residual.shape)} {residual.dtype}")
    residual = residual.contiguous()
    normed = torch.empty_like(residual) if store_normed else None
    if x is None:
        outs = _launch_group(residual, weights, biases, tile, num_warps, (None, norm_weight, eps, residual, normed),
                             use_dot)
        return residual, normed, outs
    if x.shape != residual.shape or x.dtype != residual.dtype:
        raise ValueError(f"add_rms_norm_gemv: x {tuple(x.shape)} {x.dtype} != residual "
                         f"{tuple(residual.shape)} {residual.dtype}")
    summed = torch.empty_like(residual)
    outs = _launch_group(x.contiguous(), weights, biases, tile, num_warps, (residual, norm_weight, eps, summed, normed),
                         use_dot)
    return summed, normed, outs


def add_rms_norm_gemv_group_ref(residual, x, norm_weight, eps, weights, biases=None):
    """What add_rms_norm_gemv_group computes, up to summation order: rms_norm's reference, then float32 products."""
    from .rms_norm import add_rms_norm_ref, rms_norm_ref

    if x is None:
        summed, hidden = residual, rms_norm_ref(residual, norm_weight, eps)
    else:
        summed, hidden = add_rms_norm_ref(residual, x, norm_weight, eps)
    biases = biases if biases is not None else [None] * len(weights)
    return summed, tuple(linear_gemv_ref(hidden, w, b) for w, b in zip(weights, biases))


def linear_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                tile: tuple[int, int] | None = None) -> torch.Tensor:
    return linear_gemv_group(x, [weight], None if bias is None else [bias], tile)[0]


def linear_gemv_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Float32 product, rounded once: what the kernel computes up to summation order."""
    out = x.float() @ weight.float().T
    if bias is not None:
        out += bias.float()
    return out.to(x.dtype)

"""NF4 linear layer for decode rows: y = x @ W^T (+ bias) with W [N, K] in bitsandbytes' NF4 layout.

nf4_linear(x [M, K], packed uint8 [N*K/2] (any shape, e.g. Linear4bit's [N*K/2, 1]), absmax float32
[N*K/64] (or uint8 with nested_code / nested_absmax / offset), code float32 [16], N, K, bias [N] or None)
-> [M, N] in x.dtype. Meant for M = 1..16 (attention projections, one decode step).
W is dequantized in registers (0.5 byte per weight plus its absmax, read once per program) and multiplied
in float32 with float32 accumulation; the bias is added in float32 before the one rounding of the output.
The multiply-add path (one x row) computes with the exact float32 NF4 values (code x absmax, the absmax
applied once per 64-block); the tensor-core path rounds them to x.dtype first, as a dequantize-then-matmul
in that dtype does (_nf4.py says why). Layout and helpers: _nf4.py.
Small N gives few programs, so K is split over SPLIT_K programs (SPLIT_K chosen from the shapes only) whose
float32 partials a second launch sums in a fixed order: no atomics, so a replayed CUDA graph is
bit-identical to the eager call.
nf4_linear_group runs up to three weights of one K (q, k, v) in one launch; nf4_add_rms_norm_linear_group puts
the decoder layer's add + RMSNorm in front of it (every program normalizes the row slices it reads, as gemv.py's
add_rms_norm_gemv_group does for dense weights).
Capture-safe: grid and partial buffer sized from the shapes, no host sync.
"""

from dataclasses import dataclass, replace
from typing import Optional, Sequence

import torch

from ..errors import InvalidArgumentError
from ._nf4 import (LOOKUP_WORDS, NF4_CODE, NF4Tensors, _nf4_matmul, check_compute_dtype, check_nf4,
                   dequantize_nf4_ref, check_lookup, nf4_code, pairs_readable, resolve_lookup)
from ._triton import pdl, pdl_wait, tl, triton
from .gemv import normed_input, row_inv_rms

__all__ = ["NF4_CODE", "NF4LinearConfig", "NF4Tensors", "dequantize_nf4_ref", "nf4_add_rms_norm_linear_group",
           "nf4_code", "nf4_linear", "nf4_linear_group", "nf4_linear_ref"]

# Measured on the H200 (benchmarks/results/nf4_kernels_h200_2026-12-03.txt), graph replay, bf16, K=2048 -> N=4096:
DOT_BLOCK_N = 64  # rows per program, tensor cores: 16 rows a warp; 11.9 us at M = 8 (32 rows: 12.8)
BLOCK_K = 256  # columns per step, tensor cores: 128 bytes of a row, 16-byte loads, the next step's already in flight
# Multiply-add path (M = 1): a row's whole K in one or two wide steps (summed per step), so each program has
# 1-2 KB of a row in flight and no split-K sum launch is needed. H200, bf16, graph replay, split_k 1
# (benchmarks/results/nf4_kernels_h200_wide_2026-12-03.txt):
#   2048 -> 4096 (q): 16 rows x 1024 columns 6.26 us (8 x 2048: 7.17; before, 16 x 256 with split-K: 7.92)
#   4096 -> 2048 (o): 8 x 2048 6.71 us (16 x 1024 split-K: 8.39; 16 x 256 split-K: 9.86)
#   2048 -> 512 (k, v): 8 x 2048 3.39 us (16 x 256 split-K: 5.22)
# On the words lookup (H100, benchmarks/results/nf4_linear_tiles_h100_2026-12-07.txt), 2048 -> 4096: 16 x 2048
# 4.90 us against 16 x 1024 5.15 and 8 x 2048 5.17; 4096 -> 2048: 8 x 2048 5.71 (16 x 2048 6.27: half the programs)
WIDE_ROWS = 4096  # from this many output rows WIDE_TILE, below it 8 x 2048
# The 48-layer decode step did not notice (ab_decode.py nf4_wide_steps: 2.178 -> 2.174 ms at batch 1, 6.970 -> 6.996
# at 8, within the run-to-run spread): the q/k/v launch is one of 12 a layer, each near its latency floor
WIDE_TILE = (16, 2048)  # (rows, columns a step); (16, 1024) before 2026-12-07
DOT_MIN_M = 2  # tensor cores from 2 rows: at M = 8 the multiply-add path (one row a program) takes 35 us, dot 12
DOT_BLOCK_M = 16  # the smallest tl.dot side: x rows padded to 16
NUM_WARPS = 4  # multiply-add path: 4 warps beat 8 (11.2 against 14.1 us at 32 rows)
TARGET_PROGRAMS = 4 * 132  # split K until ~4 programs per SM; split 1 is slower at every shape measured
# code table as nf4_moe.LOOKUP: 5 (4 on the tensor-core path and behind a norm). H100, graph replay, bf16, 1 row:
# 4096 -> 2048 5.71 us against 6.52 with 1, 2048 -> 512 3.09 against 3.37; 8 rows (as 4) 2048 -> 4096 10.70 against
# 11.96 (nf4_kernels_h100_2026-12-06c.txt); the decode step: nf4_moe.py
LOOKUP = 5
X_PAIRS = False  # not yet timed: see nf4_moe.py's X_PAIRS
# Under PDL, the words loop loads its first weight step before waiting for the kernel before it (the weights are
# static), so that latency overlaps the previous kernel's tail (_nf4_matmul's WAIT). Timed with nf4_moe's
# WEIGHTS_BEFORE_WAIT (its comment)
WEIGHTS_BEFORE_WAIT = True
# 1 row with the norm in front (nf4_add_rms_norm_linear_group) and LOOKUP 5: each program normalizes the row into
# its own 2K-byte scratch slice and runs the words lookup on it (else the per-nibble lookup 4, which normalizes x
# slices in registers). Untimed: with it off, Linear4bit models keep the norm apart (ops.FUSE_NORMS)
NORMED_WORDS = True
# the words loop decodes rows 2i and 2i + 1 of a tile against one x load (nf4_moe.SHARED_X). Off: slower at one
# row, 2048 -> 4096 5.17 us against 4.91, 2048 -> 512 3.71 against 3.05, 4096 -> 2048 6.52 against 5.68
# (nf4_kernels.py, graph replay, H100, 2026-12-07)
SHARED_X = False
REDUCE_BLOCK = 1024  # outputs per program of the split-K sum


@dataclass(frozen=True)
class NF4LinearConfig:
    """Tile choices of one call; None fields are derived from the shapes (the benchmark sweeps them)."""

    block_n: Optional[int] = None  # None: DOT_BLOCK_N on the tensor-core path, else from N (_tile)
    block_k: Optional[int] = None  # None: BLOCK_K on the tensor-core path, else from N (_tile)
    use_dot: Optional[bool] = None  # None: M >= DOT_MIN_M
    split_k: Optional[int] = None  # None: 1 on the multiply-add path, else enough programs for TARGET_PROGRAMS
    num_warps: Optional[int] = None  # None: NUM_WARPS, or one warp per 16 rows on the tensor-core path
    num_stages: Optional[int] = None  # None: Triton's default
    lookup: Optional[int] = None  # None: the module's LOOKUP at the call
    x_pairs: Optional[bool] = None  # multiply-add path, 16-bit x: x read as pairs in the weight tile's layout
    # (_nf4.py); None: the module's X_PAIRS at the call
    shared_x: Optional[bool] = None  # words loop: rows 2i and 2i + 1 against one x load; None: SHARED_X at the call


@triton.jit
def _nf4_linear_kernel(x_ptr, w_ptr, absmax_ptr, nested_code_ptr, nested_absmax_ptr, offset_ptr, code_ptr, bias_ptr,
                       out_ptr, M, N, row_bytes, bytes_per_split, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, USE_DOT: tl.constexpr, DOT_FP32: tl.constexpr, ALIGNED: tl.constexpr,
                       NESTED: tl.constexpr, EXACT_MUL: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr,
                       LOOKUP: tl.constexpr, X_PAIRS: tl.constexpr = False, USE_PDL: tl.constexpr = False,
                       EARLY_WEIGHTS: tl.constexpr = False, SHARE_X: tl.constexpr = False):
    EARLY: tl.constexpr = EARLY_WEIGHTS  # _nf4_matmul waits, after its first weight loads
    if not EARLY:
        pdl_wait(USE_PDL)  # before reading what an earlier kernel wrote
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # output columns n
    row_mask = rows < N
    kb_start = tl.program_id(2) * bytes_per_split  # K is split in bytes of the weight rows
    kb_end = tl.minimum(kb_start + bytes_per_split, row_bytes)
    if USE_DOT:
        m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        m_mask = m < M
    else:
        m = tl.program_id(1)  # one row of x per program
        m_mask = m < M
    acc, _ = _nf4_matmul(x_ptr, m, m_mask, w_ptr, absmax_ptr, nested_code_ptr, nested_absmax_ptr, offset_ptr,
                         code_ptr, rows, rows, row_mask, kb_start, kb_end, row_bytes, x_ptr.dtype.element_ty, BLOCK_M,
                         BLOCK_N, BLOCK_K, USE_DOT, DOT_FP32, ALIGNED, NESTED, EXACT_MUL, LOOKUP,
                         False, X_PAIRS=X_PAIRS, WAIT=USE_PDL if EARLY else 0, SHARE_X=SHARE_X)  # [BLOCK_N(, BLOCK_M)]
    if SPLIT:
        offs, mask = _out_offsets(m, m_mask, rows, row_mask, N, USE_DOT)
        tl.store(out_ptr + tl.program_id(2) * M * N + offs, acc, mask=mask)  # float32 partials [SPLIT_K, M, N]
    else:
        _store_out(out_ptr, acc, bias_ptr, m, m_mask, rows, row_mask, N, USE_DOT, HAS_BIAS)


@triton.jit
def _out_offsets(m, m_mask, rows, row_mask, N, USE_DOT: tl.constexpr):
    if USE_DOT:  # acc [BLOCK_N, BLOCK_M]
        offs = m[None, :] * N + rows[:, None]
        mask = row_mask[:, None] & m_mask[None, :]
    else:
        offs = m * N + rows
        mask = row_mask
    return offs, mask


@triton.jit
def _store_out(out_ptr, acc, bias_ptr, m, m_mask, rows, row_mask, N, USE_DOT: tl.constexpr, HAS_BIAS: tl.constexpr):
    """out[m, rows] = acc (+ bias, in float32), rounded once."""
    offs, mask = _out_offsets(m, m_mask, rows, row_mask, N, USE_DOT)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)
        if USE_DOT:
            bias = bias[:, None]
        acc += bias
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _nf4_linear_group_kernel(x_ptr, w0, a0, nc0, na0, o0, out0, b0, N0, w1, a1, nc1, na1, o1, out1, b1, N1, w2, a2,
                             nc2, na2, o2, out2, b2, N2, tiles0, tiles01, code_ptr, M, row_bytes, res_ptr, nw_ptr,
                             sum_ptr, eps, scratch_ptr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                             BLOCK_K: tl.constexpr, USE_DOT: tl.constexpr, DOT_FP32: tl.constexpr,
                             ALIGNED: tl.constexpr, NESTED: tl.constexpr, EXACT_MUL: tl.constexpr,
                             HAS_BIAS: tl.constexpr, LOOKUP: tl.constexpr, NORM: tl.constexpr = False,
                             HAS_ADD: tl.constexpr = False, NORMED_SCRATCH: tl.constexpr = False,
                             X_PAIRS: tl.constexpr = False, USE_PDL: tl.constexpr = False,
                             EARLY_WEIGHTS: tl.constexpr = False, SHARE_X: tl.constexpr = False):
    """Up to three weights of the same K (q, k, v) in one launch: program tiles [0, tiles0) are weight 0's rows,
    [tiles0, tiles01) weight 1's, the rest weight 2's. One launch instead of three GEMVs and their split-K sums.
    HAS_BIAS: every weight has a bias (b_i), added in float32 before the one rounding, as nf4_linear adds it.
    NORM: x is (residual at res_ptr +) the rows before the decoder layer's RMSNorm (weight nw_ptr), normalized
    by every program (a few KB from L2); the programs of tile 0 write the sum to sum_ptr (HAS_ADD).
    NORMED_SCRATCH (NORM, one row, LOOKUP 5): each program writes its normalized row to its own slice of scratch_ptr
    first and multiplies that, so the words lookup (which loads x as it is in memory) runs behind the norm too."""
    EARLY: tl.constexpr = EARLY_WEIGHTS and not NORM  # _nf4_matmul waits (a norm reads x first)
    if not EARLY:
        pdl_wait(USE_PDL)  # before reading what an earlier kernel wrote
    first = tl.program_id(0) == 0
    tile = tl.program_id(0)
    if tile < tiles0:
        w_ptr, absmax_ptr, nested_code_ptr, nested_absmax_ptr, offset_ptr, out_ptr, bias_ptr, N = (
            w0, a0, nc0, na0, o0, out0, b0, N0)
    elif tile < tiles01:
        w_ptr, absmax_ptr, nested_code_ptr, nested_absmax_ptr, offset_ptr, out_ptr, bias_ptr, N = (
            w1, a1, nc1, na1, o1, out1, b1, N1)
        tile -= tiles0
    else:
        w_ptr, absmax_ptr, nested_code_ptr, nested_absmax_ptr, offset_ptr, out_ptr, bias_ptr, N = (
            w2, a2, nc2, na2, o2, out2, b2, N2)
        tile -= tiles01
    rows = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    if USE_DOT:
        m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    else:
        m = tl.program_id(1)
    m_mask = m < M
    inv_rms = 0.0
    if NORM:
        x_rows = m if USE_DOT else m + tl.arange(0, 1)
        inv_rms = row_inv_rms(x_ptr, res_ptr, sum_ptr, x_rows, x_rows < M, 2 * row_bytes, eps, first, HAS_ADD,
                              BLOCK_K, BLOCK_M)
        if not USE_DOT:
            inv_rms = tl.sum(inv_rms, axis=0)  # the one row's
    x_src, x_row = x_ptr, m
    if NORMED_SCRATCH:  # one row a program (no tensor cores): its own slice of the scratch rows
        slot = (tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)).to(tl.int64)
        x_src = _store_normed_row(x_ptr, res_ptr, nw_ptr, inv_rms, m, scratch_ptr + slot * (2 * row_bytes),
                                  2 * row_bytes, HAS_ADD, BLOCK_K)
        x_row = m * 0
    NORM_IN_LOOP: tl.constexpr = NORM and not NORMED_SCRATCH
    acc, _ = _nf4_matmul(x_src, x_row, m_mask, w_ptr, absmax_ptr, nested_code_ptr, nested_absmax_ptr, offset_ptr,
                         code_ptr, rows, rows, row_mask, 0, row_bytes, row_bytes, x_ptr.dtype.element_ty, BLOCK_M,
                         BLOCK_N, BLOCK_K, USE_DOT, DOT_FP32, ALIGNED, NESTED, EXACT_MUL, LOOKUP, False,
                         res_ptr, nw_ptr, inv_rms, NORM_IN_LOOP, HAS_ADD, X_PAIRS, WAIT=USE_PDL if EARLY else 0,
                         SHARE_X=SHARE_X)
    _store_out(out_ptr, acc, bias_ptr, m, m_mask, rows, row_mask, N, USE_DOT, HAS_BIAS)


@triton.jit
def _store_normed_row(x_ptr, res_ptr, nw_ptr, inv_rms, m, out_ptr, K, HAS_ADD: tl.constexpr, BLOCK_K: tl.constexpr):
    """Row m of the RMSNorm of (residual +) x, as the fused path normalizes its slices (normed_input), stored to
    out_ptr [K]; returns out_ptr once every thread of the program has stored its part (the loop reads it back)."""
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        x = tl.load(x_ptr + m * K + ks, mask=k_mask, other=0.0)
        x = normed_input(x, res_ptr, nw_ptr, inv_rms, m * K + ks, k_mask, ks, k_mask, True, HAS_ADD)
        tl.store(out_ptr + ks, x, mask=k_mask)
    tl.debug_barrier()  # the program's stores before any of its threads reads the row
    return out_ptr


@triton.jit
def _nf4_linear_reduce_kernel(partial_ptr, bias_ptr, out_ptr, MN, N, SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                              BLOCK: tl.constexpr, USE_PDL: tl.constexpr = False):
    pdl_wait(USE_PDL)  # before reading what an earlier kernel wrote
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = i < MN
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):  # fixed order: deterministic
        acc += tl.load(partial_ptr + s * MN + i, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + i % N, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + i, acc.to(out_ptr.dtype.element_ty), mask=mask)


def _choose_split_k(programs: int, k_steps: int) -> int:
    split = 1
    while programs * split < TARGET_PROGRAMS and k_steps >= 2 * split:
        split *= 2
    return split


def _launch_options(cfg: NF4LinearConfig, use_dot: bool, block_n: int) -> dict:
    launch = {"num_warps": cfg.num_warps or (max(2, block_n // 16) if use_dot else NUM_WARPS)}
    if cfg.num_stages is not None:
        launch["num_stages"] = cfg.num_stages
    return launch


def _resolve(config: Optional[NF4LinearConfig]) -> NF4LinearConfig:
    """The config of one call with its None choices that the module decides (LOOKUP, X_PAIRS, SHARED_X) filled in
    now."""
    cfg = config or NF4LinearConfig()
    return replace(cfg, lookup=check_lookup("nf4_linear", LOOKUP if cfg.lookup is None else cfg.lookup),
                   x_pairs=X_PAIRS if cfg.x_pairs is None else cfg.x_pairs,
                   shared_x=SHARED_X if cfg.shared_x is None else cfg.shared_x)


def _uses_dot(rows_m: int, cfg: NF4LinearConfig) -> bool:
    return cfg.use_dot if cfg.use_dot is not None else rows_m >= DOT_MIN_M


def _tile(cfg: NF4LinearConfig, use_dot: bool, rows: int, op: str) -> tuple[int, int]:
    """(block_n, block_k) of a call: the config's, else the measured defaults for `rows` output rows."""
    if use_dot:
        block_n, block_k = cfg.block_n or DOT_BLOCK_N, cfg.block_k or BLOCK_K
    else:
        wide = WIDE_TILE if rows >= WIDE_ROWS else (8, 2048)
        block_n, block_k = cfg.block_n or wide[0], cfg.block_k or wide[1]
    if block_k % 64 or block_n < (16 if use_dot else 2):
        raise InvalidArgumentError(f"{op}: block_k must be a multiple of 64 and block_n >= 16 (2 without tensor "
                                   f"cores), got {cfg}")
    return block_n, block_k


def _check_bias(op: str, bias: Optional[torch.Tensor], N: int, device: torch.device) -> None:
    if bias is not None and (bias.numel() != N or bias.device != device or not bias.is_floating_point()):
        raise InvalidArgumentError(f"{op}: bias must be a float tensor of {N} elements on {device}, got "
                                   f"{bias.dtype} {tuple(bias.shape)} on {bias.device}")


def nf4_linear(x: torch.Tensor, packed: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor, N: int, K: int,
               bias: Optional[torch.Tensor] = None, *, nested_code: Optional[torch.Tensor] = None,
               nested_absmax: Optional[torch.Tensor] = None, offset: Optional[torch.Tensor] = None,
               config: Optional[NF4LinearConfig] = None) -> torch.Tensor:
    op = "nf4_linear"
    check_compute_dtype(op, x)
    if x.dim() != 2 or x.shape[1] != K:
        raise InvalidArgumentError(f"{op}: x must be [M, K = {K}], got {tuple(x.shape)}")
    w = check_nf4(op, NF4Tensors(packed, absmax, (N, K), nested_code, nested_absmax, offset), code, x.device)
    _check_bias(op, bias, N, x.device)
    cfg = _resolve(config)
    rows_m = x.shape[0]
    use_dot = _uses_dot(rows_m, cfg)
    block_n, block_k = _tile(cfg, use_dot, N, op)
    block_m = DOT_BLOCK_M if use_dot else 1
    grid_n, grid_m = triton.cdiv(N, block_n), triton.cdiv(rows_m, block_m)
    k_steps = triton.cdiv(K, block_k)
    split_k = cfg.split_k or (_choose_split_k(grid_n * grid_m, k_steps) if use_dot else 1)
    steps_per_split = triton.cdiv(k_steps, split_k)
    split_k = triton.cdiv(k_steps, steps_per_split)  # no empty split
    x = x.contiguous()
    out = torch.empty(rows_m, N, dtype=x.dtype, device=x.device)
    partial = torch.empty(split_k, rows_m, N, dtype=torch.float32, device=x.device) if split_k > 1 else out
    bias_arg = bias.contiguous() if bias is not None else out  # never read without HAS_BIAS
    launch = dict(_launch_options(cfg, use_dot, block_n), **pdl(x.device))
    _nf4_linear_kernel[(grid_n, grid_m, split_k)](
        x, w.packed, w.absmax, w.nested_code, w.nested_absmax, w.offset, code, bias_arg, partial, rows_m, N, K // 2,
        steps_per_split * block_k // 2, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, USE_DOT=use_dot,
        DOT_FP32=not x.is_cuda or x.dtype == torch.float32, ALIGNED=w.aligned, NESTED=w.nested,
        EXACT_MUL=x.is_cuda and w.nested, HAS_BIAS=bias is not None, SPLIT=split_k > 1,
        LOOKUP=resolve_lookup(cfg.lookup, x, w.packed), X_PAIRS=pairs_readable(x, cfg.x_pairs),
        EARLY_WEIGHTS=WEIGHTS_BEFORE_WAIT, SHARE_X=cfg.shared_x, **launch)
    if split_k > 1:
        _nf4_linear_reduce_kernel[(triton.cdiv(rows_m * N, REDUCE_BLOCK),)](
            partial, bias_arg, out, rows_m * N, N, SPLIT_K=split_k, HAS_BIAS=bias is not None, BLOCK=REDUCE_BLOCK,
            **pdl(x.device))
    return out


MAX_GROUP = 3  # weights per grouped launch (q, k, v)


def nf4_linear_group(x: torch.Tensor, weights: Sequence[NF4Tensors], code: torch.Tensor,
                     config: Optional[NF4LinearConfig] = None,
                     biases: Optional[Sequence[torch.Tensor]] = None) -> list[torch.Tensor]:
    """[x @ W_i^T (+ b_i) for each W_i] in one launch, for up to MAX_GROUP NF4 weights (N_i, K) of one K, all
    plain or all nested; biases: one [N_i] per weight (q/k/v biases, e.g. Qwen2-MoE), or None. Each equals
    nf4_linear(x, W_i, b_i) computed without a split of K."""
    return _launch_group("nf4_linear_group", x, weights, code, config, biases, None)


def nf4_add_rms_norm_linear_group(residual: torch.Tensor, x: Optional[torch.Tensor], norm_weight: torch.Tensor,
                                  eps: float, weights: Sequence[NF4Tensors], code: torch.Tensor,
                                  config: Optional[NF4LinearConfig] = None,
                                  biases: Optional[Sequence[torch.Tensor]] = None):
    """(residual + x, nf4_linear_group(RMSNorm(residual + x), ...)) in one launch: the decoder layer's add and
    norm before attention run inside the q/k/v GEMV (gemv.add_rms_norm_gemv_group's NF4 twin, the same
    roundings as kernels/rms_norm.py's add_rms_norm; the sum of squares runs in BLOCK_K chunks, so on a GPU 1/RMS
    may differ from the norm kernel's in its last bit and a normalized fp16 value by an ulp, as with the dense
    GEMV's). x None: no add (residual comes back as it is). The norm weight is of the rows' dtype, which is the
    GEMV's compute dtype."""
    op = "nf4_add_rms_norm_linear_group"
    if norm_weight.shape != (residual.shape[-1],) or norm_weight.dtype != residual.dtype:
        raise InvalidArgumentError(f"{op}: norm weight {tuple(norm_weight.shape)} {norm_weight.dtype} does not take "
                                   f"rows {tuple(residual.shape)} {residual.dtype}")
    residual = residual.contiguous()
    if x is None:
        return residual, _launch_group(op, residual, weights, code, config, biases, (None, norm_weight, eps, residual))
    if x.shape != residual.shape or x.dtype != residual.dtype:
        raise InvalidArgumentError(f"{op}: x {tuple(x.shape)} {x.dtype} != residual {tuple(residual.shape)} "
                                   f"{residual.dtype}")
    summed = torch.empty_like(residual)
    return summed, _launch_group(op, x, weights, code, config, biases, (residual, norm_weight, eps, summed))


def _check_group(op: str, x: torch.Tensor, weights: Sequence[NF4Tensors], code: torch.Tensor,
                 biases: Optional[Sequence[torch.Tensor]]):
    check_compute_dtype(op, x)
    if not 1 <= len(weights) <= MAX_GROUP:
        raise InvalidArgumentError(f"{op}: takes 1 to {MAX_GROUP} weights, got {len(weights)}")
    K = x.shape[-1] if x.dim() == 2 else -1
    views = [check_nf4(op, w, code, x.device) for w in weights]
    if x.dim() != 2 or any(v.experts != 1 or v.cols != K for v in views) or len({v.nested for v in views}) != 1:
        raise InvalidArgumentError(f"{op}: x [M, K] and weights (N_i, K) of one K, all nested or none; got x "
                                   f"{tuple(x.shape)}, weights {[tuple(w.shape) for w in weights]}")
    if biases is not None:
        if len(biases) != len(views) or any(b is None for b in biases):
            raise InvalidArgumentError(f"{op}: biases must give one tensor per weight ({len(views)}), or be None")
        for v, b in zip(views, biases):
            _check_bias(op, b, v.rows, x.device)
    return views


def _launch_group(op, x, weights, code, config, biases, norm):
    """norm: None, or (residual or None, norm weight, eps, summed output): x is normalized in the kernel."""
    views = _check_group(op, x, weights, code, biases)
    cfg = _resolve(config)
    rows_m, K = x.shape
    use_dot = _uses_dot(rows_m, cfg)
    block_n, block_k = _tile(cfg, use_dot, sum(v.rows for v in views), op)
    block_m = DOT_BLOCK_M if use_dot else 1
    x = x.contiguous()
    outs = [torch.empty(rows_m, v.rows, dtype=x.dtype, device=x.device) for v in views]
    tiles = [triton.cdiv(v.rows, block_n) for v in views]
    bias_args = [b.contiguous() for b in biases] if biases is not None else outs  # never read without HAS_BIAS
    padded = list(zip(views, outs, bias_args))
    padded += [padded[0]] * (MAX_GROUP - len(views))  # never reached: no tiles
    args = [a for v, out, b in padded for a in (v.packed, v.absmax, v.nested_code, v.nested_absmax, v.offset, out, b,
                                                 v.rows)]
    residual, norm_weight, eps, summed = norm if norm is not None else (None, x, 0.0, x)  # x: never read
    lookup = resolve_lookup(cfg.lookup, x, *(v.packed for v in views))
    # behind a norm the words lookup reads a normalized copy of the row, one per program (NORMED_SCRATCH)
    scratch = x
    normed_scratch = (norm is not None and NORMED_WORDS and lookup == LOOKUP_WORDS and not use_dot
                      and x.element_size() == 2 and views[0].aligned)
    if normed_scratch:
        scratch = torch.empty(sum(tiles) * rows_m, K, dtype=x.dtype, device=x.device)
    launch = dict(_launch_options(cfg, use_dot, block_n), **pdl(x.device))
    _nf4_linear_group_kernel[(sum(tiles), triton.cdiv(rows_m, block_m))](
        x, *args, tiles[0], sum(tiles[:2]), code, rows_m, K // 2, residual if residual is not None else x,
        norm_weight, summed, eps, scratch, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, USE_DOT=use_dot,
        DOT_FP32=not x.is_cuda or x.dtype == torch.float32, ALIGNED=views[0].aligned, NESTED=views[0].nested,
        EXACT_MUL=x.is_cuda and views[0].nested, HAS_BIAS=biases is not None, LOOKUP=lookup, NORM=norm is not None,
        HAS_ADD=residual is not None, NORMED_SCRATCH=normed_scratch, X_PAIRS=pairs_readable(x, cfg.x_pairs),
        EARLY_WEIGHTS=WEIGHTS_BEFORE_WAIT, SHARE_X=cfg.shared_x, **launch)
    return outs


def nf4_linear_ref(x, packed, absmax, code, N, K, bias=None, *, nested_code=None, nested_absmax=None, offset=None,
                   config=None):
    """Dequantize in torch (to x.dtype where the kernel takes the tensor-core path, to float32 on the multiply-add
    path), multiply in float32, add the bias in float32, round once."""
    weight_dtype = x.dtype if _uses_dot(x.shape[0], config or NF4LinearConfig()) else torch.float32
    weight = dequantize_nf4_ref(NF4Tensors(packed, absmax, (N, K), nested_code, nested_absmax, offset), code,
                                weight_dtype)
    out = x.float() @ weight.float().T
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)

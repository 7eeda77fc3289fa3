"""Decode-time MoE experts with NF4 weights: [gate_up GEMM + SwiGLU], [down GEMM], then moe_combine (on the
multiply-add path with PAIR_COMBINE: [down GEMM + combine] in one launch, the same bits).

fused_moe_experts_nf4(hidden [T, H], top_k_index [T, K], top_k_weights [T, K], gate_up NF4Tensors (E, 2I, H),
down NF4Tensors (E, H, I), code float32 [16], combine) -> [T, H] in hidden.dtype (the compute dtype).
The NF4 form of fused_moe.py, with the same roundings (gate and up rounded to the compute dtype, silu
rounded, times up, rounded; the down projection rounded; float32 accumulation everywhere), with each
weight tile dequantized in registers
(0.5 byte per weight plus one absmax per 64, read once per expert tile; layout and helpers in _nf4.py):
exact float32 NF4 values on the multiply-add path, rounded to the compute dtype on the tensor-core path.
Two paths, chosen from T alone (so one per captured graph):
- multiply-add (T < DOT_MIN_TOKENS): one program per (token, expert) pair and column tile, rows kept in
  pair order (no grouping launch; moe_combine reads them in that order), nothing padded to 16 rows; an
  expert routed twice is read twice, the second time mostly from L2;
- dot: pairs grouped by expert (align_blocks), one program per (expert block, column tile), tensor cores
  on [weight tile] @ [x of the block's 16 slots]^T; idle blocks exit at once (grid sized like fused_moe.py).
Capture-safe: grids and buffers sized from T, K, E only, no host sync, no atomics.
"""

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch

from ..errors import InvalidArgumentError
from ._nf4 import (NF4_CODE, NF4Tensors, _nf4_matmul, check_compute_dtype, check_nf4, dequantize_nf4_ref,
                   check_lookup, nf4_code, pairs_readable, resolve_lookup)
from ._triton import pdl, pdl_wait, tl, triton
from .fused_moe import BLOCK_M, align_blocks
from .moe_combine import moe_combine

__all__ = ["NF4_CODE", "NF4MoEConfig", "NF4Tensors", "dequantize_nf4_ref", "fused_moe_experts_nf4",
           "fused_moe_experts_nf4_ref", "nf4_code"]

# Measured on the H200 (benchmarks/results/nf4_kernels_h200_2026-12-03.txt), graph replay, bf16, E 128 H 2048 I 768:
GATE_UP_BLOCK_N = 16  # tensor-core path: 768 gate (+768 up) rows in 48 tiles
DOWN_BLOCK_N = 32  # 2048 output rows in 64 tiles
# The multiply-add path with the words lookup (LOOKUP 5), H100, graph replay (nf4_kernels.py, 2026-12-06; BENCHMARKS.md,
# "Expert tiles and short attention chunks"): one token 8 / 16 rows, 4 warps, 19.9 us against 22.2 at 16 / 32;
# 2 to 15 tokens 8 / 16 rows, 8 warps, batch 8 93.8 us against 96.9 with 4 warps
ONE_TOKEN_BLOCK_N = (8, 16)
# one token in 8 warps a program: kernels 18.5 us against 19.0-20.0 with 4 (nf4_kernels.py), the NF4 decode step
# 2.257 against 2.336 ms at batch 1 (ab_decode.py nf4_one_token_w8, 48 layers; H100, 2026-12-07)
ONE_TOKEN_NUM_WARPS = 8
# 2-15 tokens with SHARED_X: 16 / 32 rows 83.0 us at 8 tokens against 91.6 for 8 / 16 (nf4_kernels.py, H100,
# 2026-12-07; without SHARED_X 16 / 32 was the slower, 98.9 against 94.3)
FEW_TOKENS_BLOCK_N = (16, 32)
FEW_TOKENS_NUM_WARPS = 8
# Under Triton's interpreter (the CPU tests) each program is a Python loop: on the multiply-add path one tile of
# INTERPRETER_BLOCK_N rows per pair, for the same per-row sums as the GPU's thin tiles (fused_moe.py does the same),
# in BLOCK_K-wide steps at every token count; None: the GPU's tiles and steps everywhere, as tools/sass_report.py
# compiles them from CPU launches
INTERPRETER_BLOCK_N = 32
BLOCK_K = 256  # 128 bytes of each weight row per step (the next step's in flight); 128 is 10-15% slower
# one token: gate_up's 2048-long rows in 512-wide steps, down's 768-long ones in 256 (a 512 step would be half
# masked): 17.31 us against 18.06 for 256 / 256 (nf4_kernels.py, graph replay, H100, 2026-12-07)
ONE_TOKEN_BLOCK_K = (512, 256)
DOT_MIN_TOKENS = 16  # multiply-add per (token, expert) pair below: batch 1 40.6 us (dot 77.6), batch 8 183 (dot 179)
NUM_WARPS = 4  # multiply-add path: 4 warps beat 8 (45 against 60 us at batch 1); tensor cores: 16 rows a warp
# Code table: LOOKUP 5 (CUDA, 16-bit x, whole 64-blocks: a 32-bit word of 8 weights at a time, their code values by
# warp shuffles from a table held one value a lane; elsewhere 4, the same per nibble, or 1 off NVIDIA). H100, 48
# layers, NF4 decode step (ab_decode.py, 2026-12-06, with the graphs' late PDL trigger): batch 1 2.63 ms against
# 2.86 with 1 (one token) and 3 (2-15 tokens), batch 8 7.16 against 8.83. Kernels alone (nf4_kernels.py, graph
# replay): 1 token 22.2 us against 24.6, 8 tokens 96.9 against 123.2 (benchmarks/results/
# nf4_kernels_h100_2026-12-06c.txt). Before it: 1 token LOOKUP 1 (shared memory; an L1 gather, 0, is 4-6x slower,
# 256 pairs, 2, 1.3-1.6x), 2-15 tokens LOOKUP 3 with X_PAIRS.
LOOKUP = 5
X_PAIRS = False  # x read as pairs in the weight tile's layout (LOOKUP 1-4 only: the words path loads x itself)
FEW_TOKENS_LOOKUP = 5
FEW_TOKENS_X_PAIRS = True  # where LOOKUP 5 falls back to 4 (batch 8: 123.2 us with pairs and LOOKUP 3, 136.6 without)
# multiply-add path: the down GEMVs and the weighted combine in one launch (same bits). Off: on the H100 the NF4
# batch-1 step took 3.77 ms with it against 2.85 (ab_decode.py, 48 layers, 2026-12-06): 1 token x 2048 / BLOCK_N
# programs, each decoding 8 experts' rows in turn, are too few to keep the loads in flight
PAIR_COMBINE = False
# Under PDL with the late trigger, the multiply-add down kernel reads its routing and first weight step before it
# waits for gate_up (_down_nf4_kernel). With nf4_gemv's: decode step 2.221 -> 2.170 ms at batch 1, 7.003 -> 6.983 at
# batch 8, same tokens (H100, 48 layers, ab_decode.py early_weights, 2026-12-07)
WEIGHTS_BEFORE_WAIT = True
# words loop: each thread decodes two words of the same columns (gate and up; in down rows 2i and 2i + 1) against one
# x load and its unpacking (_nf4_matmul SHARE_X). One token 18.06 us against 18.46, 8 tokens 91.6 against 94.3
# (nf4_kernels.py, graph replay, H100, 2026-12-07)
SHARED_X = True
# tensor-core path (16+ tokens): software-pipelining stages of its loops; None: Triton's default. The stages' shared
# memory bounds the programs an SM holds (sm_90 SASS, tools/sass_report.py, T=32: gate_up 24 / 16 / 8 KB and down
# 32 / 24 / 16 KB a program at the default / 2 / 1 stages, 2 warps each), and the path is latency-bound (23-24% of
# its roofline at 32-64 rows, H100). Untimed: ab_decode.py nf4_dot_stages2 / nf4_dot_stages1
DOT_NUM_STAGES = None


@dataclass(frozen=True)
class NF4MoEConfig:
    """Tile choices of one call; use_dot None means T >= DOT_MIN_TOKENS (the benchmark sweeps these)."""

    # None: ONE_TOKEN_BLOCK_N for one token, FEW_TOKENS_BLOCK_N for 2-15, else GATE_UP_BLOCK_N / DOWN_BLOCK_N
    gate_up_block_n: Optional[int] = None
    down_block_n: Optional[int] = None
    block_k: Optional[int] = None  # None: ONE_TOKEN_BLOCK_K[0] at one token, else BLOCK_K
    use_dot: Optional[bool] = None
    # None: ONE_TOKEN_NUM_WARPS (FEW_TOKENS_NUM_WARPS for 2-15 tokens), or one warp per 16 rows on tensor cores
    num_warps: Optional[int] = None
    num_stages: Optional[int] = None  # None: DOT_NUM_STAGES on tensor cores, else Triton's default
    # None: the module's LOOKUP / X_PAIRS (FEW_TOKENS_* for 2-15 tokens) / PAIR_COMBINE at the call (what a
    # decode-wide A/B switches)
    lookup: Optional[int] = None
    x_pairs: Optional[bool] = None  # multiply-add path, 16-bit x: x read as pairs in the weight tile's layout
    combine: Optional[bool] = None  # multiply-add path: the down GEMVs and moe_combine in one launch
    shared_x: Optional[bool] = None  # words loop: two words of the same columns a thread (None: SHARED_X)
    down_block_k: Optional[int] = None  # None: block_k where given, else ONE_TOKEN_BLOCK_K[1] / BLOCK_K


@triton.jit
def _moe_program(slot_token_ptr, block_expert_ptr, expert_ptr, TOP_K: tl.constexpr,
                 BLOCK_M: tl.constexpr, USE_DOT: tl.constexpr):
    """(expert, slots, tokens, valid) of this program; expert < 0: idle. [BLOCK_M] each with USE_DOT, else scalars."""
    if USE_DOT:
        block = tl.program_id(0)
        expert = tl.load(block_expert_ptr + block)
        slots = block * BLOCK_M + tl.arange(0, BLOCK_M)
        tokens = tl.load(slot_token_ptr + slots)  # -1: padding slot
        valid = tokens >= 0
    else:  # rows in pair order: no grouping by expert
        pair = tl.program_id(0)
        expert = tl.load(expert_ptr + pair)
        slots = pair
        tokens = pair // TOP_K
        valid = tokens >= 0
    return expert, slots, tokens, valid


@triton.jit
def _expert_weights(expert, w_ptr, absmax_ptr, nested_absmax_ptr, offset_ptr, stride_we, blocks_per_expert,
                    nested_per_expert):
    """The pointers of one expert's NF4 bytes, absmax, nested absmax and offset within the stacks."""
    e = expert.to(tl.int64)
    return (w_ptr + e * stride_we, absmax_ptr + e * blocks_per_expert, nested_absmax_ptr + e * nested_per_expert,
            offset_ptr + e)


@triton.jit
def _store_rows(ptr, tile, slots, valid, n, n_mask, stride, USE_DOT: tl.constexpr):
    """out[slots, n] = tile: [BLOCK_N, BLOCK_M] with USE_DOT, else [BLOCK_N] for the one slot."""
    if USE_DOT:
        tl.store(ptr + slots[None, :] * stride + n[:, None], tile, mask=valid[None, :] & n_mask[:, None])
    else:
        tl.store(ptr + slots * stride + n, tile, mask=n_mask)


@triton.jit
def _gate_up_silu_nf4_kernel(x_ptr, slot_token_ptr, block_expert_ptr, expert_ptr, act_ptr, w_ptr,
                             absmax_ptr, nested_code_ptr, nested_absmax_ptr, offset_ptr, code_ptr, hidden, inter,
                             row_bytes, stride_we, blocks_per_expert, nested_per_expert, TOP_K: tl.constexpr,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                             USE_DOT: tl.constexpr, DOT_FP32: tl.constexpr, ALIGNED: tl.constexpr,
                             NESTED: tl.constexpr, EXACT_MUL: tl.constexpr, LOOKUP: tl.constexpr,
                             X_PAIRS: tl.constexpr = False, USE_PDL: tl.constexpr = False,
                             SHARE_X: tl.constexpr = False):
    pdl_wait(USE_PDL)  # before reading what an earlier kernel wrote
    expert, slots, tokens, valid = _moe_program(slot_token_ptr, block_expert_ptr, expert_ptr, TOP_K,
                                                BLOCK_M, USE_DOT)
    if expert < 0:
        return
    w_ptr, absmax_ptr, nested_absmax_ptr, offset_ptr = _expert_weights(
        expert, w_ptr, absmax_ptr, nested_absmax_ptr, offset_ptr, stride_we, blocks_per_expert, nested_per_expert)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < inter
    dtype = act_ptr.dtype.element_ty
    gate, up = _nf4_matmul(x_ptr, tokens, valid, w_ptr, absmax_ptr, nested_code_ptr, nested_absmax_ptr, offset_ptr,
                           code_ptr, n, inter + n, n_mask, 0, row_bytes, row_bytes, dtype, BLOCK_M, BLOCK_N, BLOCK_K,
                           USE_DOT, DOT_FP32, ALIGNED, NESTED, EXACT_MUL, LOOKUP,
                           True, X_PAIRS=X_PAIRS, SHARE_X=SHARE_X)  # [BLOCK_N, BLOCK_M] or [BLOCK_N]: both streams
    gate = gate.to(dtype).to(tl.float32)
    up = up.to(dtype).to(tl.float32)
    act = (gate * tl.sigmoid(gate)).to(dtype).to(tl.float32) * up
    _store_rows(act_ptr, act.to(dtype), slots, valid, n, n_mask, inter, USE_DOT)


@triton.jit
def _down_nf4_kernel(act_ptr, slot_token_ptr, block_expert_ptr, expert_ptr, out_ptr, w_ptr, absmax_ptr,
                     nested_code_ptr, nested_absmax_ptr, offset_ptr, code_ptr, hidden, inter, row_bytes, stride_we,
                     blocks_per_expert, nested_per_expert, TOP_K: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_DOT: tl.constexpr, DOT_FP32: tl.constexpr,
                     ALIGNED: tl.constexpr, NESTED: tl.constexpr, EXACT_MUL: tl.constexpr, LOOKUP: tl.constexpr,
                     X_PAIRS: tl.constexpr = False, USE_PDL: tl.constexpr = False,
                     EARLY_WEIGHTS: tl.constexpr = False, SHARE_X: tl.constexpr = False):
    # EARLY_WEIGHTS with the late trigger (USE_PDL 2): the routing was written two kernels back (the kernel before
    # this one let it launch only once that one had finished), so the expert ids and the first weight step are
    # read before the wait for gate_up's activations
    EARLY: tl.constexpr = EARLY_WEIGHTS and USE_PDL == 2 and not USE_DOT
    if not EARLY:
        pdl_wait(USE_PDL)  # before reading what an earlier kernel wrote
    expert, slots, tokens, valid = _moe_program(slot_token_ptr, block_expert_ptr, expert_ptr, TOP_K,
                                                BLOCK_M, USE_DOT)
    if expert < 0:
        return
    w_ptr, absmax_ptr, nested_absmax_ptr, offset_ptr = _expert_weights(
        expert, w_ptr, absmax_ptr, nested_absmax_ptr, offset_ptr, stride_we, blocks_per_expert, nested_per_expert)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < hidden
    dtype = out_ptr.dtype.element_ty
    y, _ = _nf4_matmul(act_ptr, slots, valid, w_ptr, absmax_ptr, nested_code_ptr, nested_absmax_ptr, offset_ptr,
                       code_ptr, n, n, n_mask, 0, row_bytes, row_bytes, dtype, BLOCK_M, BLOCK_N, BLOCK_K, USE_DOT,
                       DOT_FP32, ALIGNED, NESTED, EXACT_MUL, LOOKUP, False, X_PAIRS=X_PAIRS,
                       WAIT=USE_PDL if EARLY else 0, SHARE_X=SHARE_X)
    _store_rows(out_ptr, y.to(dtype), slots, valid, n, n_mask, hidden, USE_DOT)


@triton.jit
def _down_combine_nf4_kernel(act_ptr, expert_ptr, weights_ptr, out_ptr, w_ptr, absmax_ptr, nested_code_ptr,
                             nested_absmax_ptr, offset_ptr, code_ptr, hidden, row_bytes, stride_we,
                             blocks_per_expert, nested_per_expert, TOP_K: tl.constexpr, BLOCK_N: tl.constexpr,
                             BLOCK_K: tl.constexpr, ALIGNED: tl.constexpr, NESTED: tl.constexpr,
                             EXACT_MUL: tl.constexpr, LOOKUP: tl.constexpr, X_PAIRS: tl.constexpr = False,
                             USE_PDL: tl.constexpr = False):
    """The multiply-add path's down projection and moe_combine in one launch: a program owns BLOCK_N outputs of
    one token and runs the down GEMV of each of its TOP_K pairs (rounded as _down_nf4_kernel stores it), adding
    them weighted in slot order in float32 (moe_combine's sum, term for term), rounded once: the same bits."""
    pdl_wait(USE_PDL)  # before reading what an earlier kernel wrote
    token = tl.program_id(0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < hidden
    dtype = out_ptr.dtype.element_ty
    out = tl.zeros([BLOCK_N], dtype=tl.float32)
    for slot in range(TOP_K):
        pair = token * TOP_K + slot
        w, absmax, nested_absmax, offset = _expert_weights(tl.load(expert_ptr + pair), w_ptr, absmax_ptr,
                                                           nested_absmax_ptr, offset_ptr, stride_we,
                                                           blocks_per_expert, nested_per_expert)
        y, _ = _nf4_matmul(act_ptr, pair, True, w, absmax, nested_code_ptr, nested_absmax, offset, code_ptr, n, n,
                           n_mask, 0, row_bytes, row_bytes, dtype, 1, BLOCK_N, BLOCK_K, False, False, ALIGNED,
                           NESTED, EXACT_MUL, LOOKUP, False, X_PAIRS=X_PAIRS)
        out += tl.load(weights_ptr + pair).to(tl.float32) * y.to(dtype).to(tl.float32)
    tl.store(out_ptr + token * hidden + n, out.to(dtype), mask=n_mask)


def _launch_options(cfg: NF4MoEConfig, use_dot: bool, block_n: int, device) -> dict:
    launch = {"num_warps": cfg.num_warps or (max(2, block_n // 16) if use_dot else NUM_WARPS)}
    stages = cfg.num_stages if cfg.num_stages is not None else DOT_NUM_STAGES if use_dot else None
    if stages is not None:
        launch["num_stages"] = stages
    return dict(launch, **pdl(device))


def _launch_down_combine(act, experts, top_k_weights, dn, code, cfg, hidden_dim: int, top_k: int, dtype):
    tokens = top_k_weights.shape[0]
    out = torch.empty(tokens, hidden_dim, dtype=dtype, device=act.device)
    _down_combine_nf4_kernel[(tokens, triton.cdiv(hidden_dim, cfg.down_block_n))](
        act, experts, top_k_weights.contiguous(), out, dn.packed, dn.absmax, dn.nested_code, dn.nested_absmax,
        dn.offset, code, hidden_dim, dn.cols // 2, dn.packed.stride(0), dn.absmax.stride(0), dn.nested_absmax.stride(0),
        TOP_K=top_k, BLOCK_N=cfg.down_block_n, BLOCK_K=cfg.down_block_k, ALIGNED=dn.aligned, NESTED=dn.nested,
        EXACT_MUL=out.is_cuda and dn.nested, LOOKUP=resolve_lookup(cfg.lookup, act, dn.packed),
        X_PAIRS=pairs_readable(act, cfg.x_pairs),
        **_launch_options(cfg, False, cfg.down_block_n, out.device))
    return out


def _launch(kernel, grid, inputs, out, w, code, block_n, block_k, rows_args, cfg, use_dot, routing, top_k, **extra):
    slot_token, block_expert, experts = routing
    if slot_token is None:  # pair order: the kernels never read the grouping
        slot_token = block_expert = experts
    launch = dict(_launch_options(cfg, use_dot, block_n, out.device), **extra)
    kernel[grid](
        inputs, slot_token, block_expert, experts, out, w.packed, w.absmax, w.nested_code, w.nested_absmax,
        w.offset, code, *rows_args, w.cols // 2, w.packed.stride(0), w.absmax.stride(0), w.nested_absmax.stride(0),
        TOP_K=top_k, BLOCK_M=BLOCK_M if use_dot else 1, BLOCK_N=block_n, BLOCK_K=block_k, USE_DOT=use_dot,
        DOT_FP32=not out.is_cuda or out.dtype == torch.float32, ALIGNED=w.aligned, NESTED=w.nested,
        EXACT_MUL=out.is_cuda and w.nested, LOOKUP=resolve_lookup(cfg.lookup, inputs, w.packed),
        X_PAIRS=pairs_readable(inputs, cfg.x_pairs), SHARE_X=cfg.shared_x,
        **launch)


def _uses_dot(tokens: int, cfg: NF4MoEConfig) -> bool:
    return cfg.use_dot if cfg.use_dot is not None else tokens >= DOT_MIN_TOKENS


def fused_moe_experts_nf4(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                          gate_up: NF4Tensors, down: NF4Tensors, code: torch.Tensor, combine,
                          config: Optional[NF4MoEConfig] = None) -> torch.Tensor:
    op = "fused_moe_experts_nf4"
    check_compute_dtype(op, hidden)
    gu = check_nf4(op + " (gate_up)", gate_up, code, hidden.device)
    dn = check_nf4(op + " (down)", down, code, hidden.device)
    num_experts, inter, hidden_dim = gu.experts, gu.rows // 2, gu.cols
    if (hidden.dim() != 2 or hidden.shape[1] != hidden_dim or gu.rows % 2
            or (dn.experts, dn.rows, dn.cols) != (num_experts, hidden_dim, inter)):
        raise InvalidArgumentError(f"{op}: hidden {tuple(hidden.shape)} does not fit gate_up {tuple(gate_up.shape)} "
                                   f"(E, 2I, H) / down {tuple(down.shape)} (E, H, I)")
    if top_k_index.shape != top_k_weights.shape or top_k_index.shape[0] != hidden.shape[0]:
        raise InvalidArgumentError(f"{op}: top_k_index {tuple(top_k_index.shape)} and top_k_weights "
                                   f"{tuple(top_k_weights.shape)} must both be [T = {hidden.shape[0]}, top_k]")
    cfg = config or NF4MoEConfig()
    tokens, top_k = top_k_index.shape
    use_dot = _uses_dot(tokens, cfg)
    few = not use_dot and tokens > 1
    block_n = _default_block_n(tokens, use_dot)
    block_k = ONE_TOKEN_BLOCK_K if tokens == 1 and not use_dot else (BLOCK_K, BLOCK_K)
    if INTERPRETER_BLOCK_N and not use_dot and hidden.device.type != "cuda":
        block_n = (INTERPRETER_BLOCK_N, INTERPRETER_BLOCK_N)
        block_k = (BLOCK_K, BLOCK_K)  # one width: the tests' tiny rows would mostly mask wide steps
    cfg = dataclasses.replace(cfg, gate_up_block_n=cfg.gate_up_block_n or block_n[0],
                              down_block_n=cfg.down_block_n or block_n[1],
                              num_warps=cfg.num_warps or _default_num_warps(tokens, use_dot),
                              lookup=check_lookup(op, _default(cfg.lookup, FEW_TOKENS_LOOKUP if few else LOOKUP)),
                              x_pairs=_default(cfg.x_pairs, FEW_TOKENS_X_PAIRS if few else X_PAIRS),
                              combine=PAIR_COMBINE if cfg.combine is None else cfg.combine,
                              shared_x=_default(cfg.shared_x, SHARED_X),
                              block_k=cfg.block_k or block_k[0],
                              down_block_k=cfg.down_block_k or cfg.block_k or block_k[1])
    if (cfg.block_k % 64 or cfg.down_block_k % 64
            or min(cfg.gate_up_block_n, cfg.down_block_n) < (16 if use_dot else 2)):
        raise InvalidArgumentError(f"{op}: block_k and down_block_k must be multiples of 64 and block_n >= 16 (2 "
                                   f"without tensor cores), got {cfg}")
    experts = top_k_index.reshape(-1).contiguous()
    if use_dot:
        position, slot_token, block_expert = align_blocks(top_k_index, num_experts)
        programs, slots = block_expert.numel(), slot_token.numel()
    else:  # one program per pair, rows in pair order: nothing to group (the grouping launch took ~11 us)
        position = slot_token = block_expert = None
        programs = slots = experts.numel()
    routing = (slot_token, block_expert, experts)
    x = hidden.contiguous()
    act = torch.empty(slots, inter, dtype=hidden.dtype, device=hidden.device)  # [slots, I]
    _launch(_gate_up_silu_nf4_kernel, (programs, triton.cdiv(inter, cfg.gate_up_block_n)), x, act, gu, code,
            cfg.gate_up_block_n, cfg.block_k, (hidden_dim, inter), cfg, use_dot, routing, top_k)
    if not use_dot and cfg.combine and combine is moe_combine:  # its math, in the down kernel (another combine runs)
        return _launch_down_combine(act, experts, top_k_weights, dn, code, cfg, hidden_dim, top_k, hidden.dtype)
    out = torch.empty(slots, hidden_dim, dtype=hidden.dtype, device=hidden.device)  # [slots, H]
    _launch(_down_nf4_kernel, (programs, triton.cdiv(hidden_dim, cfg.down_block_n)), act, out, dn, code,
            cfg.down_block_n, cfg.down_block_k, (hidden_dim, inter), cfg, use_dot, routing, top_k,
            EARLY_WEIGHTS=WEIGHTS_BEFORE_WAIT)
    return combine(out, position, top_k_weights, hidden.dtype)


def _default_block_n(tokens: int, use_dot: bool) -> tuple[int, int]:
    if use_dot:
        return GATE_UP_BLOCK_N, DOWN_BLOCK_N
    return ONE_TOKEN_BLOCK_N if tokens == 1 else FEW_TOKENS_BLOCK_N


def _default_num_warps(tokens: int, use_dot: bool) -> Optional[int]:
    if use_dot:
        return None  # one warp per 16 rows
    return ONE_TOKEN_NUM_WARPS if tokens == 1 else FEW_TOKENS_NUM_WARPS


def _default(value, default):
    return default if value is None else value


def fused_moe_experts_nf4_ref(hidden, top_k_index, top_k_weights, gate_up: NF4Tensors, down: NF4Tensors, code,
                              combine=None, config=None):
    """Dequantize each routed expert in torch (to hidden.dtype where the kernels take the tensor-core path, to
    float32 on the multiply-add path), then the kernels' math and roundings."""
    dtype = hidden.dtype
    # the multiply-add path computes with the float32 NF4 values, the tensor-core path with them rounded to dtype
    weight_dtype = dtype if _uses_dot(top_k_index.shape[0], config or NF4MoEConfig()) else torch.float32
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    for e in top_k_index.unique().tolist():
        token, slot = (top_k_index == e).nonzero(as_tuple=True)
        w_gate_up = dequantize_nf4_ref(_expert(gate_up, e), code, weight_dtype).float()  # [2I, H]
        w_down = dequantize_nf4_ref(_expert(down, e), code, weight_dtype).float()  # [H, I]
        gate, up = (hidden[token].float() @ w_gate_up.T).to(dtype).float().chunk(2, dim=-1)
        act = (torch.nn.functional.silu(gate).to(dtype).float() * up).to(dtype).float()
        y = (act @ w_down.T).to(dtype).float()
        out.index_add_(0, token, top_k_weights[token, slot].float()[:, None] * y)
    return out.to(dtype)


def _expert(t: NF4Tensors, e: int) -> NF4Tensors:
    experts = t.shape[0]
    pick = lambda a: None if a is None else a.reshape(experts, -1)[e]  # noqa: E731
    return NF4Tensors(pick(t.packed), pick(t.absmax), tuple(t.shape[1:]), t.nested_code, pick(t.nested_absmax),
                      pick(t.offset))

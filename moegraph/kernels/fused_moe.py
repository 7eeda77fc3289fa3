"""Decode-time MoE experts in three launches: group pairs into expert blocks, [gate_up GEMM + SwiGLU],
[down GEMM]; the weighted combine is moe_combine. Up to PAIR_GEMV_MAX_TOKENS tokens, two launches and
no grouping: one GEMV per (token, expert) pair (with PAIR_COMBINE the down GEMVs do moe_combine's sum too).

fused_moe_experts(hidden [T, H], top_k_index [T, K], top_k_weights [T, K], gate_up_proj [E, 2I, H],
down_proj [E, H, I]) -> [T, H].
Pairs are laid out in blocks of BLOCK_M slots, each block holding pairs of one expert (padding
slots point at token -1), so a program reads its expert's weight tile once for up to BLOCK_M
tokens and experts nobody routed to are never read. Operands are upcast from bf16 to float32
before tl.dot (exact: a bf16 value is exact in tf32, so products match bf16 tensor-core
products; Triton's CPU interpreter also mishandles bf16 dots); accumulation is float32 and the
outputs round where the eager path rounds (projection, silu, product).
Capture-safe: grids sized for the worst case (every expert with a partial block), programs of
idle blocks exit at once, no host sync. For T*K above MAX_PAIRS callers use grouped_mm.

The pair GEMVs: at one token the blocks hold one pair each, so 15 of a block's 16 tl.dot rows are padding
and a grid of (129 blocks x columns) mostly exits; the align pass moves no weight at all. A pair program
instead reads its expert id straight from top_k_index and multiplies a thin weight tile (PAIR_BLOCK_N
rows) with its token in registers, so many more programs stream the routed experts' weights. Two pairs of
one expert read its weights twice (mostly from L2), which is why the path stops at a few tokens. Same
roundings as the block kernels (gate and up, silu, product); the combine reads the outputs in pair order.
"""

import torch

from ._triton import pdl, pdl_wait, tl, triton
from .moe_align import MAX_PAIRS  # noqa: F401  (callers check the pair count against it)
from .moe_combine import moe_combine

BLOCK_M = 16  # slots per block: the smallest tl.dot M; decode blocks rarely hold more pairs
GATE_UP_BLOCK_N = 32  # 768 gate (+768 up) columns in 24 programs per block: 192 programs at batch 1
DOWN_BLOCK_N = 64  # 2048 output columns in 32 programs per block
BLOCK_K = 128
PAIR_GEMV_MAX_TOKENS = 4  # a decode bucket size (1, 2, 4, ...): eager and replayed calls take the same path
# Pair GEMV tunables, H200, Qwen3-30B-A3B experts in bf16 (benchmarks/gemv_decode.py, 2026-12-04): 2 x 2048 with
# 2 warps was the fastest of 18 tiles x warps: 21.6 us at 1 token (block kernels: 42.1), 37.5 at 2 (51.9);
# 4 tokens 77.0 against 91.6 (4 x 1024); 8 tokens 142.0 against 121.5, so the blocks take over above 4.
PAIR_BLOCK_N = 2
# Under Triton's interpreter (the CPU tests) each program is a Python loop: 2-row tiles made a 10-token tiny-model
# generate() take 37 s against 3.7 at 32 rows, for the same per-row sums (the GPU's tiles stay as measured)
INTERPRETER_PAIR_BLOCK_N = 32
PAIR_BLOCK_K = 2048
PAIR_NUM_WARPS = 2
# The pair path's down GEMVs and the weighted combine in one launch (the same bits; a launch fewer per layer). Off:
# slower on the H100 (benchmarks/ab_decode.py, 48 layers, 2026-12-06): batch-1 step 3.41 ms against 3.28 (each program
# then streams all TOP_K experts' rows of its outputs, one after the other), batch 8 even
PAIR_COMBINE = False
ALIGN_BLOCK_I = 32  # pairs ranked per grouping program (fewer for fewer pairs)
# Grouping: "compare" ranks every pair against every other, BLOCK_I at a time (num_pairs / 32 dependent steps:
# 31 us a layer at 1,024 pairs, 239 us at 8,192 on the H200, the prefill profile of 2026-12-04); "histogram" counts
# BLOCK_J pairs a step. Decode is even either way (H100, ab_decode.py, 2026-12-06: batch 8 11.07 against 11.09
# ms/step); the default stays "compare" until benchmarks/align_blocks.py has timed both at prefill sizes.
ALIGN_METHODS = ("compare", "histogram")
ALIGN_METHOD = "compare"
HISTOGRAM_BLOCK_I = 64
HISTOGRAM_BLOCK_J = 1024


@triton.jit
def _place_pairs(counts, rank, expert_i, i, i_mask, experts, position_ptr, slot_token_ptr, block_expert_ptr,
                 num_experts, num_blocks, is_first, TOP_K: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_E: tl.constexpr):
    """From the pairs' expert counts and each ranked pair's rank among the earlier pairs of its expert: its slot
    (start of its expert's group + rank); the first program also writes each block's expert (-1 past the last)."""
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    starts = tl.cumsum(padded, axis=0) - padded
    slot = tl.gather(starts, tl.where(i_mask, expert_i, 0), 0) + rank
    tl.store(position_ptr + i, slot.to(tl.int64), mask=i_mask)
    tl.store(slot_token_ptr + slot, (i // TOP_K).to(tl.int64), mask=i_mask)
    if is_first:
        used_blocks = tl.sum(padded, axis=0) // BLOCK_M
        for b0 in range(0, num_blocks, BLOCK_E):
            b = b0 + experts
            tl.store(block_expert_ptr + b, tl.full([BLOCK_E], -1, tl.int32), mask=(b >= used_blocks) & (b < num_blocks))
        first_block = starts // BLOCK_M
        expert_blocks = padded // BLOCK_M
        for j in range(0, tl.max(expert_blocks, axis=0)):  # an expert's blocks are consecutive
            tl.store(block_expert_ptr + first_block + j, experts, mask=(j < expert_blocks) & (experts < num_experts))


@triton.jit
def _align_blocks_kernel(expert_ptr, position_ptr, slot_token_ptr, block_expert_ptr, num_pairs, num_experts,
                         num_blocks, TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_I: tl.constexpr,
                         BLOCK_E: tl.constexpr, USE_PDL: tl.constexpr = False):
    """Rank BLOCK_I pairs (a counting sort: slot = start of its expert's group + earlier pairs of that expert) by
    comparing them with every pair, BLOCK_I at a time. Small [BLOCK_I, BLOCK_E] tiles only: the [64, 128] masks of
    the first version spilled and took ~11 us at batch 1."""
    pdl_wait(USE_PDL)  # before reading what an earlier kernel wrote
    pid = tl.program_id(0)
    experts = tl.arange(0, BLOCK_E)
    i = pid * BLOCK_I + tl.arange(0, BLOCK_I)
    i_mask = i < num_pairs
    expert_i = tl.load(expert_ptr + i, mask=i_mask, other=-1)
    counts = tl.zeros([BLOCK_E], dtype=tl.int32)
    rank = tl.zeros([BLOCK_I], dtype=tl.int32)
    for j0 in range(0, num_pairs, BLOCK_I):
        j = j0 + tl.arange(0, BLOCK_I)
        expert_j = tl.load(expert_ptr + j, mask=j < num_pairs, other=-1)
        counts += tl.sum((expert_j[:, None] == experts[None, :]).to(tl.int32), axis=0)
        rank += tl.sum(((expert_i[:, None] == expert_j[None, :]) & (j[None, :] < i[:, None])).to(tl.int32), axis=1)
    _place_pairs(counts, rank, expert_i, i, i_mask, experts, position_ptr, slot_token_ptr, block_expert_ptr,
                 num_experts, num_blocks, pid == 0, TOP_K, BLOCK_M, BLOCK_E)


@triton.jit
def _expert_histogram(expert, keep, experts, BLOCK_E: tl.constexpr):
    """Pairs per expert among those kept (the dropped ones are counted in bin 0, then taken out again)."""
    dropped = tl.sum((~keep).to(tl.int32), axis=0)
    return tl.histogram(tl.where(keep, expert, 0).to(tl.int32), BLOCK_E) - tl.where(experts == 0, dropped, 0)


@triton.jit
def _align_blocks_histogram_kernel(expert_ptr, position_ptr, slot_token_ptr, block_expert_ptr, num_pairs,
                                   num_experts, num_blocks, TOP_K: tl.constexpr, BLOCK_M: tl.constexpr,
                                   BLOCK_I: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_E: tl.constexpr,
                                   USE_PDL: tl.constexpr = False):
    """The same counting sort, counted with histograms of BLOCK_J pairs a step (a few steps where the compare
    kernel takes num_pairs / BLOCK_I): a pair's rank is the count of its expert among the pairs of earlier
    programs, plus the earlier pairs of its expert within its own program's BLOCK_I."""
    pdl_wait(USE_PDL)  # before reading what an earlier kernel wrote
    pid = tl.program_id(0)
    experts = tl.arange(0, BLOCK_E)
    first = pid * BLOCK_I
    i = first + tl.arange(0, BLOCK_I)
    i_mask = i < num_pairs
    expert_i = tl.load(expert_ptr + i, mask=i_mask, other=0)
    counts = tl.zeros([BLOCK_E], dtype=tl.int32)
    before = tl.zeros([BLOCK_E], dtype=tl.int32)  # pairs per expert in the programs before this one
    for j0 in range(0, num_pairs, BLOCK_J):
        j = j0 + tl.arange(0, BLOCK_J)
        expert_j = tl.load(expert_ptr + j, mask=j < num_pairs, other=0)
        counts += _expert_histogram(expert_j, j < num_pairs, experts, BLOCK_E)
        if j0 < first:
            before += _expert_histogram(expert_j, j < first, experts, BLOCK_E)
    earlier_here = (expert_i[:, None] == expert_i[None, :]) & (i[None, :] < i[:, None])
    rank = tl.gather(before, expert_i, 0) + tl.sum(earlier_here.to(tl.int32), axis=1)
    _place_pairs(counts, rank, expert_i, i, i_mask, experts, position_ptr, slot_token_ptr, block_expert_ptr,
                 num_experts, num_blocks, pid == 0, TOP_K, BLOCK_M, BLOCK_E)


@triton.jit
def _gate_up_silu_kernel(x_ptr, w_ptr, slot_token_ptr, block_expert_ptr, act_ptr, hidden, inter,
                         stride_we, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         USE_PDL: tl.constexpr = False):
    pdl_wait(USE_PDL)  # before reading what an earlier kernel wrote
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block)
    if expert < 0:
        return
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    token = tl.load(slot_token_ptr + rows)
    valid = token >= 0
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < inter
    w_expert = w_ptr + expert.to(tl.int64) * stride_we
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < hidden
        x = tl.load(x_ptr + token[:, None] * hidden + k[None, :], mask=valid[:, None] & k_mask[None, :], other=0.0)
        w_mask = n_mask[:, None] & k_mask[None, :]
        w_gate = tl.load(w_expert + n[:, None] * hidden + k[None, :], mask=w_mask, other=0.0)
        w_up = tl.load(w_expert + (inter + n[:, None]) * hidden + k[None, :], mask=w_mask, other=0.0)
        xf = x.to(tl.float32)
        acc_gate += tl.dot(xf, tl.trans(w_gate.to(tl.float32)))
        acc_up += tl.dot(xf, tl.trans(w_up.to(tl.float32)))
    out_dtype = act_ptr.dtype.element_ty
    gate = acc_gate.to(out_dtype).to(tl.float32)
    up = acc_up.to(out_dtype).to(tl.float32)
    act = (gate * tl.sigmoid(gate)).to(out_dtype).to(tl.float32) * up
    tl.store(act_ptr + rows[:, None] * inter + n[None, :], act.to(out_dtype), mask=valid[:, None] & n_mask[None, :])


@triton.jit
def _down_kernel(act_ptr, w_ptr, slot_token_ptr, block_expert_ptr, out_ptr, hidden, inter, stride_we,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr = False):
    pdl_wait(USE_PDL)  # before reading what an earlier kernel wrote
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block)
    if expert < 0:
        return
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    valid = tl.load(slot_token_ptr + rows) >= 0
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < hidden
    w_expert = w_ptr + expert.to(tl.int64) * stride_we
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < inter
        a = tl.load(act_ptr + rows[:, None] * inter + k[None, :], mask=valid[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_expert + n[:, None] * inter + k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        acc += tl.dot(a.to(tl.float32), tl.trans(w.to(tl.float32)))
    tl.store(out_ptr + rows[:, None] * hidden + n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=valid[:, None] & n_mask[None, :])


@triton.jit
def _pair_gate_up_silu_kernel(x_ptr, w_ptr, index_ptr, act_ptr, hidden, inter, stride_we, TOP_K: tl.constexpr,
                              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr = False):
    pdl_wait(USE_PDL)  # before reading what an earlier kernel wrote
    pair = tl.program_id(1)
    expert = tl.load(index_ptr + pair).to(tl.int64)
    token = pair // TOP_K
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < inter
    gate_rows = w_ptr + expert * stride_we + n[:, None].to(tl.int64) * hidden
    up_rows = gate_rows + inter * hidden
    acc_gate = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < hidden
        x = tl.load(x_ptr + token * hidden + k, mask=k_mask, other=0.0).to(tl.float32)
        w_mask = n_mask[:, None] & k_mask[None, :]
        w_gate = tl.load(gate_rows + k[None, :], mask=w_mask, other=0.0)
        w_up = tl.load(up_rows + k[None, :], mask=w_mask, other=0.0)
        acc_gate += tl.sum(w_gate.to(tl.float32) * x[None, :], axis=1)
        acc_up += tl.sum(w_up.to(tl.float32) * x[None, :], axis=1)
    out_dtype = act_ptr.dtype.element_ty
    gate = acc_gate.to(out_dtype).to(tl.float32)
    up = acc_up.to(out_dtype).to(tl.float32)
    act = (gate * tl.sigmoid(gate)).to(out_dtype).to(tl.float32) * up
    tl.store(act_ptr + pair * inter + n, act.to(out_dtype), mask=n_mask)


@triton.jit
def _pair_down_rows(act_ptr, w_ptr, index_ptr, pair, n, n_mask, inter, stride_we, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr):
    """Outputs n of pair `pair`'s down GEMV (its expert's rows times its activations), float32 [BLOCK_N]."""
    expert = tl.load(index_ptr + pair).to(tl.int64)
    w_rows = w_ptr + expert * stride_we + n[:, None].to(tl.int64) * inter
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < inter
        a = tl.load(act_ptr + pair * inter + k, mask=k_mask, other=0.0).to(tl.float32)
        w = tl.load(w_rows + k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        acc += tl.sum(w.to(tl.float32) * a[None, :], axis=1)
    return acc


@triton.jit
def _pair_down_kernel(act_ptr, w_ptr, index_ptr, out_ptr, hidden, inter, stride_we, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr = False):
    pdl_wait(USE_PDL)  # before reading what an earlier kernel wrote
    pair = tl.program_id(1)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < hidden
    acc = _pair_down_rows(act_ptr, w_ptr, index_ptr, pair, n, n_mask, inter, stride_we, BLOCK_N, BLOCK_K)
    tl.store(out_ptr + pair * hidden + n, acc.to(out_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def _pair_down_combine_kernel(act_ptr, w_ptr, index_ptr, weights_ptr, out_ptr, hidden, inter, stride_we,
                              TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                              USE_PDL: tl.constexpr = False):
    """_pair_down_kernel and moe_combine in one: a program owns BLOCK_N outputs of one token and runs the down
    GEMV of each of its TOP_K experts, rounding each output as the down kernel stores it, then adds them weighted
    in slot order in float32 (moe_combine's sum, term for term), rounded once: the same bits, one launch less."""
    pdl_wait(USE_PDL)  # before reading what an earlier kernel wrote
    token = tl.program_id(1)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < hidden
    down_dtype = act_ptr.dtype.element_ty  # what _pair_down_kernel stores (the experts' dtype)
    out = tl.zeros([BLOCK_N], dtype=tl.float32)
    for slot in tl.static_range(TOP_K):  # unrolled: every expert's loads can be in flight at once
        pair = token * TOP_K + slot
        y = _pair_down_rows(act_ptr, w_ptr, index_ptr, pair, n, n_mask, inter, stride_we, BLOCK_N, BLOCK_K)
        out += tl.load(weights_ptr + pair).to(tl.float32) * y.to(down_dtype).to(tl.float32)
    tl.store(out_ptr + token * hidden + n, out.to(out_ptr.dtype.element_ty), mask=n_mask)


def pair_gemv_experts(x, top_k_index, gate_up_proj, down_proj, block_n: int | None = None,
                      block_k: int | None = None, num_warps: int = PAIR_NUM_WARPS, top_k_weights=None,
                      out_dtype: torch.dtype | None = None):
    """Per-pair expert outputs [T*K, H] in pair order (row t*K + k: token t through its k-th expert); with
    top_k_weights [T, K], the tokens' outputs [T, H] in out_dtype instead: the down GEMVs and the weighted
    combine in one launch (_pair_down_combine_kernel, equal to moe_combine of the per-pair outputs)."""
    num_experts, two_inter, hidden_dim = gate_up_proj.shape
    inter = two_inter // 2
    block_n = block_n or (INTERPRETER_PAIR_BLOCK_N if x.device.type != "cuda" else PAIR_BLOCK_N)
    block_k = block_k or PAIR_BLOCK_K
    index = top_k_index.reshape(-1).contiguous()
    pairs = index.numel()
    act = torch.empty(pairs, inter, dtype=gate_up_proj.dtype, device=x.device)
    _pair_gate_up_silu_kernel[(triton.cdiv(inter, block_n), pairs)](
        x, gate_up_proj, index, act, hidden_dim, inter, gate_up_proj.stride(0), TOP_K=top_k_index.shape[-1],
        BLOCK_N=block_n, BLOCK_K=min(block_k, triton.next_power_of_2(hidden_dim)), num_warps=num_warps,
        **pdl(x.device))
    block_k = min(block_k, triton.next_power_of_2(inter))
    if top_k_weights is not None:
        tokens, top_k = top_k_index.shape
        if top_k_weights.shape != (tokens, top_k):
            raise ValueError(f"pair_gemv_experts: top_k_weights {tuple(top_k_weights.shape)} != top_k_index "
                             f"{tuple(top_k_index.shape)}")
        out = torch.empty(tokens, hidden_dim, dtype=out_dtype or x.dtype, device=x.device)
        _pair_down_combine_kernel[(triton.cdiv(hidden_dim, block_n), tokens)](
            act, down_proj, index, top_k_weights.contiguous(), out, hidden_dim, inter, down_proj.stride(0),
            TOP_K=top_k, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps, **pdl(x.device))
        return out
    down = torch.empty(pairs, hidden_dim, dtype=gate_up_proj.dtype, device=x.device)
    _pair_down_kernel[(triton.cdiv(hidden_dim, block_n), pairs)](
        act, down_proj, index, down, hidden_dim, inter, down_proj.stride(0), BLOCK_N=block_n,
        BLOCK_K=block_k, num_warps=num_warps, **pdl(x.device))
    return down


def align_blocks(top_k_index: torch.Tensor, num_experts: int, method: str | None = None):
    """(position [T*K], slot_token [slots] with -1 padding, block_expert [blocks] with -1 idle).
    method: ALIGN_METHODS' "compare" or "histogram" (None: ALIGN_METHOD); both give the same three tensors."""
    method = method or ALIGN_METHOD
    if method not in ALIGN_METHODS:
        raise ValueError(f"align_blocks: method {method!r} is not one of {ALIGN_METHODS}")
    num_pairs = top_k_index.numel()
    num_blocks = triton.cdiv(num_pairs, BLOCK_M) + num_experts  # each expert adds at most one partial block
    experts = top_k_index.reshape(-1).contiguous()
    position = torch.empty(num_pairs, dtype=torch.long, device=experts.device)
    slot_token = torch.full((num_blocks * BLOCK_M,), -1, dtype=torch.long, device=experts.device)
    block_expert = torch.empty(num_blocks, dtype=torch.int32, device=experts.device)
    common = dict(TOP_K=top_k_index.shape[-1], BLOCK_M=BLOCK_M, BLOCK_E=triton.next_power_of_2(num_experts),
                  **pdl(top_k_index.device))
    args = (experts, position, slot_token, block_expert, num_pairs, num_experts, num_blocks)
    if method == "histogram":
        block_i = min(HISTOGRAM_BLOCK_I, max(16, triton.next_power_of_2(num_pairs)))
        block_j = min(HISTOGRAM_BLOCK_J, max(16, triton.next_power_of_2(num_pairs)))
        _align_blocks_histogram_kernel[(triton.cdiv(num_pairs, block_i),)](*args, BLOCK_I=block_i, BLOCK_J=block_j,
                                                                           **common)
    else:
        block_i = min(ALIGN_BLOCK_I, max(16, triton.next_power_of_2(num_pairs)))
        _align_blocks_kernel[(triton.cdiv(num_pairs, block_i),)](*args, BLOCK_I=block_i, **common)
    return position, slot_token, block_expert


def fused_moe_experts(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj, combine):
    num_experts, two_inter, hidden_dim = gate_up_proj.shape
    inter = two_inter // 2
    if hidden.shape[1] != hidden_dim or down_proj.shape[1:] != (hidden_dim, inter):
        raise ValueError(f"fused_moe_experts: hidden {tuple(hidden.shape)} does not fit gate_up_proj "
                         f"{tuple(gate_up_proj.shape)} / down_proj {tuple(down_proj.shape)}")
    if not (gate_up_proj.is_contiguous() and down_proj.is_contiguous()):
        raise ValueError("fused_moe_experts: expert weights must be contiguous [E, 2I, H] and [E, H, I]")
    x = hidden.to(gate_up_proj.dtype).contiguous()
    if hidden.shape[0] <= PAIR_GEMV_MAX_TOKENS:
        if PAIR_COMBINE and combine is moe_combine:  # its math, in the down kernel (another combine runs as given)
            return pair_gemv_experts(x, top_k_index, gate_up_proj, down_proj, top_k_weights=top_k_weights,
                                     out_dtype=hidden.dtype)
        return combine(pair_gemv_experts(x, top_k_index, gate_up_proj, down_proj), None, top_k_weights,
                       hidden.dtype)
    position, slot_token, block_expert = align_blocks(top_k_index, num_experts)
    num_blocks = block_expert.numel()
    act = torch.empty(slot_token.numel(), inter, dtype=gate_up_proj.dtype, device=hidden.device)
    _gate_up_silu_kernel[(num_blocks, triton.cdiv(inter, GATE_UP_BLOCK_N))](
        x, gate_up_proj, slot_token, block_expert, act, hidden_dim, inter, gate_up_proj.stride(0),
        BLOCK_M=BLOCK_M, BLOCK_N=GATE_UP_BLOCK_N, BLOCK_K=BLOCK_K, **pdl(x.device))
    down = torch.empty(slot_token.numel(), hidden_dim, dtype=gate_up_proj.dtype, device=hidden.device)
    _down_kernel[(num_blocks, triton.cdiv(hidden_dim, DOWN_BLOCK_N))](
        act, down_proj, slot_token, block_expert, down, hidden_dim, inter, down_proj.stride(0),
        BLOCK_M=BLOCK_M, BLOCK_N=DOWN_BLOCK_N, BLOCK_K=BLOCK_K, **pdl(x.device))
    return combine(down, position, top_k_weights, hidden.dtype)


def fused_moe_experts_ref(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj, combine=None):
    """Float32 loop over the routed experts (the math the kernels do, before their roundings)."""
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    for token in range(hidden.shape[0]):
        for slot in range(top_k_index.shape[1]):
            e = int(top_k_index[token, slot])
            gate, up = (gate_up_proj[e].float() @ hidden[token].float()).chunk(2)
            y = down_proj[e].float() @ (torch.nn.functional.silu(gate) * up)
            out[token] += top_k_weights[token, slot].float() * y
    return out.to(hidden.dtype)

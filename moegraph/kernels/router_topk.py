"""Router softmax -> top-k -> optional renormalisation, in one launch.

router_topk(logits [T, E], top_k, normalize, weights_dtype=None) -> (weights [T, K], index [T, K]
int64), the same function as transformers' softmax top-k routers after their linear layer (softmax in
float32 over all experts, top-k of the probabilities, divide by their sum when normalizing):
Qwen3MoeTopKRouter (norm_topk_prob, weights cast to the logits' dtype: weights_dtype None) and
MixtralTopKRouter (always normalized, weights left in float32: weights_dtype=torch.float32). Equal
probabilities go to the lower expert index. Replaces ~7 eager kernels.
Capture-safe: grid (T,), no host sync.
"""

import os

import torch

from ._triton import pdl, pdl_wait, tl, triton
from .gemv import INTERPRETER_BLOCK_N, _gemv_tile_fma, tile_for

# One warp: the 4k + 2 reductions of a row are warp shuffles only. With Triton's default 4 warps each one also
# crosses warps through shared memory, 53 barriers in all for 128 experts and top 8 (sm_90 SASS, Triton 3.6), in a
# kernel of one program per row whose time at batch 1 is that chain of reductions. Not yet timed on a GPU.
ROUTER_WARPS = 1
# Rows up to which ops.route runs the router's GEMV and the top-k in one launch (router_gemv_topk; 0: two launches).
# Untimed: benchmarks/ab_decode.py route_fused.
FUSED_MAX_ROWS = 0
_INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")


@triton.jit
def _softmax_topk_row(logits_ptr, weights_ptr, index_ptr, row, num_experts, TOP_K: tl.constexpr,
                      NORMALIZE: tl.constexpr, BLOCK: tl.constexpr, FROM_L2: tl.constexpr = False):
    """One row's softmax top-k: weights and indices in slot order. FROM_L2: the logits are read past L1 (other
    programs of this launch wrote them)."""
    cols = tl.arange(0, BLOCK)
    mask = cols < num_experts
    if FROM_L2:
        x = tl.load(logits_ptr + row * num_experts + cols, mask=mask, other=-float("inf"), cache_modifier=".cg")
    else:
        x = tl.load(logits_ptr + row * num_experts + cols, mask=mask, other=-float("inf"))
    x = x.to(tl.float32)
    e = tl.exp(x - tl.max(x, axis=0))
    probs = tl.where(mask, e / tl.sum(e, axis=0), -1.0)
    total = 0.0
    for _ in tl.static_range(TOP_K):
        best = tl.max(probs, axis=0)
        best_idx = tl.min(tl.where(probs == best, cols, BLOCK), axis=0)  # lowest index among ties
        probs = tl.where(cols == best_idx, -1.0, probs)
        total += best
    # second pass in slot order: store the k picks from highest to lowest probability
    probs = tl.where(mask, e / tl.sum(e, axis=0), -1.0)
    for slot in tl.static_range(TOP_K):
        best = tl.max(probs, axis=0)
        best_idx = tl.min(tl.where(probs == best, cols, BLOCK), axis=0)
        probs = tl.where(cols == best_idx, -1.0, probs)
        value = best / total if NORMALIZE else best
        tl.store(weights_ptr + row * TOP_K + slot, value.to(weights_ptr.dtype.element_ty))
        tl.store(index_ptr + row * TOP_K + slot, best_idx.to(tl.int64))


@triton.jit
def _router_topk_kernel(logits_ptr, weights_ptr, index_ptr, num_experts, TOP_K: tl.constexpr,
                        NORMALIZE: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr = False):
    pdl_wait(USE_PDL)  # before reading what an earlier kernel wrote
    _softmax_topk_row(logits_ptr, weights_ptr, index_ptr, tl.program_id(0), num_experts, TOP_K, NORMALIZE, BLOCK)


def router_topk(logits: torch.Tensor, top_k: int, normalize: bool, weights_dtype: torch.dtype | None = None):
    tokens, num_experts = logits.shape
    if not 0 < top_k <= num_experts:
        raise ValueError(f"router_topk: top_k={top_k} must be in [1, {num_experts}]")
    logits = logits.contiguous()
    weights = torch.empty(tokens, top_k, dtype=weights_dtype or logits.dtype, device=logits.device)
    index = torch.empty(tokens, top_k, dtype=torch.long, device=logits.device)
    _router_topk_kernel[(tokens,)](logits, weights, index, num_experts, TOP_K=top_k, NORMALIZE=normalize,
                                   BLOCK=triton.next_power_of_2(num_experts), num_warps=ROUTER_WARPS,
                                   **pdl(logits.device))
    return weights, index


@triton.jit
def _release(tile):
    """This thread's earlier writes visible device-wide before what follows (CUDA's __threadfence)."""
    if not _INTERPRETED:  # the interpreter runs one program at a time
        tl.inline_asm_elementwise("fence.acq_rel.gpu;\n    mov.b32 $0, $1;", "=r,r", [tile], dtype=tl.int32,
                                  is_pure=False, pack=1)


@triton.jit
def _router_gemv_topk_kernel(x_ptr, w_ptr, logits_ptr, weights_ptr, index_ptr, ticket_ptr, M, num_experts, K,
                             TOP_K: tl.constexpr, NORMALIZE: tl.constexpr, ROWS: tl.constexpr,
                             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK: tl.constexpr,
                             USE_PDL: tl.constexpr = False):
    """gemv.linear_gemv's programs for the logits (the same tiles and bits), then the last program to finish
    takes the top-k of every row (its ticket: how many programs had stored their logits before it)."""
    tile = tl.program_id(0)
    _gemv_tile_fma(x_ptr, w_ptr, w_ptr, logits_ptr, tile, M, num_experts, K, x_ptr, x_ptr, x_ptr, x_ptr, 0.0, False,
                   ROWS, BLOCK_N, BLOCK_K, False, False, False, False, USE_PDL)
    _release(tile)
    tl.debug_barrier()  # every thread's logits stored before the ticket is drawn
    ticket = tl.atomic_add(ticket_ptr, 1, sem="acq_rel", scope="gpu")
    if ticket == tl.num_programs(0) - 1:
        tl.atomic_xchg(ticket_ptr, 0, sem="relaxed", scope="gpu")  # ready for the next launch
        for row in range(M):
            _softmax_topk_row(logits_ptr, weights_ptr, index_ptr, row, num_experts, TOP_K, NORMALIZE, BLOCK, True)


_TICKETS: dict = {}  # device -> int32 [1], zero between launches (the last program resets it); never freed


def ticket_counter(device: torch.device) -> torch.Tensor:
    """router_gemv_topk's counter on `device`. Made outside a CUDA graph capture (ops.resolve_ops makes it):
    captured graphs keep its address, so it lives as long as the process."""
    device = torch.device(device)
    counter = _TICKETS.get(device)
    if counter is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("router_gemv_topk: its counter must be made before a CUDA graph capture "
                               "(call router_topk.ticket_counter(device) first)")
        counter = _TICKETS[device] = torch.zeros(1, dtype=torch.int32, device=device)
    return counter


def router_gemv_topk(hidden: torch.Tensor, weight: torch.Tensor, top_k: int, normalize: bool,
                     weights_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """router_topk(linear_gemv(hidden, weight), ...) in one launch: hidden [M <= gemv.MAX_ROWS, H], weight [E, H] of
    hidden's dtype. The logits are linear_gemv's bits; the softmax's sums may round otherwise than router_topk's
    (its program has more warps). Launches on one stream at a time share the counter."""
    from .gemv import MAX_ROWS

    rows, k = hidden.shape
    num_experts = weight.shape[0]
    if not 0 < top_k <= num_experts:
        raise ValueError(f"router_gemv_topk: top_k={top_k} must be in [1, {num_experts}]")
    if rows > MAX_ROWS or weight.shape[1] != k or weight.dtype != hidden.dtype or not weight.is_contiguous():
        raise ValueError(f"router_gemv_topk: hidden {tuple(hidden.shape)} {hidden.dtype} and weight "
                         f"{tuple(weight.shape)} {weight.dtype}: at most {MAX_ROWS} rows, a contiguous [E, H] weight "
                         "of hidden's dtype")
    hidden = hidden.contiguous()
    logits = torch.empty(rows, num_experts, dtype=hidden.dtype, device=hidden.device)
    weights = torch.empty(rows, top_k, dtype=weights_dtype or hidden.dtype, device=hidden.device)
    index = torch.empty(rows, top_k, dtype=torch.long, device=hidden.device)
    block_n, block_k = tile_for(rows, num_experts, k)
    if hidden.device.type != "cuda":  # the interpreter: fewer, taller programs (gemv.py: the same sums)
        block_n = INTERPRETER_BLOCK_N
    block_k = min(block_k, triton.next_power_of_2(k))
    _router_gemv_topk_kernel[(triton.cdiv(num_experts, block_n),)](
        hidden, weight, logits, weights, index, ticket_counter(hidden.device), rows, num_experts, k, TOP_K=top_k,
        NORMALIZE=normalize, ROWS=triton.next_power_of_2(rows), BLOCK_N=block_n, BLOCK_K=block_k,
        BLOCK=triton.next_power_of_2(num_experts), num_warps=ROUTER_WARPS, **pdl(hidden.device))
    return weights, index


def router_topk_ref(logits: torch.Tensor, top_k: int, normalize: bool, weights_dtype: torch.dtype | None = None):
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    values, index = torch.topk(probs, top_k, dim=-1)
    if normalize:
        values = values / values.sum(dim=-1, keepdim=True)
    return values.to(weights_dtype or logits.dtype), index

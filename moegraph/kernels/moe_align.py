"""Group (token, expert) pairs by expert for a grouped GEMM, in one launch: a stable counting sort.

moe_align(top_k_index [T, K], num_experts E) -> (token_of_slot [T*K] int64, position [T*K] int64,
offsets [E] int32). Pair p = t*K + k goes to slot position[p] = (pairs routed to lower experts) +
(earlier pairs routed to the same expert); token_of_slot[slot] is its token; offsets[e] is the end
of expert e's group, as grouped_mm takes it. Replaces the sort, count, cumsum, inverse-permutation
and divide kernels of the eager path (~8 launches).
Each program ranks BLOCK_I pairs against all pairs, O(N^2 / BLOCK_I) work per program: meant for
decode, where N = rows x top_k is at most a few thousand (MAX_PAIRS).
Capture-safe: grid fixed by N, no host sync.
"""

import torch

from ._triton import pdl, pdl_wait, tl, triton

BLOCK_I = 64  # pairs ranked per program
BLOCK_J = 64  # pairs compared per step
MAX_PAIRS = 8192  # above this the quadratic ranking costs more than the sort it replaces


@triton.jit
def _moe_align_kernel(expert_ptr, token_of_slot_ptr, position_ptr, offsets_ptr, num_pairs, num_experts,
                      TOP_K: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_E: tl.constexpr,
                      USE_PDL: tl.constexpr = False):
    pdl_wait(USE_PDL)  # before reading what an earlier kernel wrote
    pid = tl.program_id(0)
    experts = tl.arange(0, BLOCK_E)
    i = pid * BLOCK_I + tl.arange(0, BLOCK_I)
    i_mask = i < num_pairs
    expert_i = tl.load(expert_ptr + i, mask=i_mask, other=-1)
    counts = tl.zeros([BLOCK_E], dtype=tl.int32)
    rank = tl.zeros([BLOCK_I], dtype=tl.int32)
    for j0 in range(0, num_pairs, BLOCK_J):
        j = j0 + tl.arange(0, BLOCK_J)
        expert_j = tl.load(expert_ptr + j, mask=j < num_pairs, other=-1)
        counts += tl.sum((expert_j[None, :] == experts[:, None]).to(tl.int32), axis=1)
        earlier_same = (expert_i[:, None] == expert_j[None, :]) & (j[None, :] < i[:, None])
        rank += tl.sum(earlier_same.to(tl.int32), axis=1)
    ends = tl.cumsum(counts, axis=0)
    starts = ends - counts
    # start of each pair's expert group: select starts[expert_i] with a [BLOCK_I, BLOCK_E] mask
    start_i = tl.sum(tl.where(expert_i[:, None] == experts[None, :], starts[None, :], 0), axis=1)
    slot = start_i + rank
    tl.store(position_ptr + i, slot.to(tl.int64), mask=i_mask)
    tl.store(token_of_slot_ptr + slot, (i // TOP_K).to(tl.int64), mask=i_mask)
    if pid == 0:
        tl.store(offsets_ptr + experts, ends, mask=experts < num_experts)


def moe_align(top_k_index: torch.Tensor, num_experts: int):
    num_pairs = top_k_index.numel()
    if num_pairs > MAX_PAIRS:
        return moe_align_ref(top_k_index, num_experts)
    experts = top_k_index.reshape(-1).contiguous()
    token_of_slot = torch.empty(num_pairs, dtype=torch.long, device=experts.device)
    position = torch.empty_like(token_of_slot)
    offsets = torch.empty(num_experts, dtype=torch.int32, device=experts.device)
    _moe_align_kernel[(triton.cdiv(num_pairs, BLOCK_I),)](
        experts, token_of_slot, position, offsets, num_pairs, num_experts, TOP_K=top_k_index.shape[-1],
        BLOCK_I=BLOCK_I, BLOCK_J=BLOCK_J, BLOCK_E=triton.next_power_of_2(num_experts), **pdl(top_k_index.device))
    return token_of_slot, position, offsets


def moe_align_ref(top_k_index: torch.Tensor, num_experts: int):
    top_k = top_k_index.shape[-1]
    flat = top_k_index.reshape(-1)  # [T*K]
    sorted_experts, order = torch.sort(flat, stable=True)  # order[slot] = pair
    counts = torch.zeros(num_experts, dtype=torch.int32, device=flat.device)
    counts.scatter_add_(0, sorted_experts, torch.ones_like(sorted_experts, dtype=torch.int32))
    offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
    position = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
    return order // top_k, position, offsets

"""Router softmax -> top-k -> optional renormalisation, in one launch.

router_topk(logits [T, E], top_k, normalize, weights_dtype=None) -> (weights [T, K], index [T, K]
int64), the same function as transformers' softmax top-k routers after their linear layer (softmax in
float32 over all experts, top-k of the probabilities, divide by their sum when normalizing):
Qwen3MoeTopKRouter (norm_topk_prob, weights cast to the logits' dtype: weights_dtype None) and
MixtralTopKRouter (always normalized, weights left in float32: weights_dtype=torch.float32). Equal
probabilities go to the lower expert index. Replaces ~7 eager kernels.
Capture-safe: grid (T,), no host sync.
"""

import torch

from ._triton import pdl, pdl_wait, tl, triton

# One warp: the 4k + 2 reductions of a row are warp shuffles only. With Triton's default 4 warps each one also
# crosses warps through shared memory, 53 barriers in all for 128 experts and top 8 (sm_90 SASS, Triton 3.6), in a
# kernel of one program per row whose time at batch 1 is that chain of reductions. Not yet timed on a GPU.
ROUTER_WARPS = 1


@triton.jit
def _router_topk_kernel(logits_ptr, weights_ptr, index_ptr, num_experts, TOP_K: tl.constexpr,
                        NORMALIZE: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr = False):
    pdl_wait(USE_PDL)  # before reading what an earlier kernel wrote
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < num_experts
    x = tl.load(logits_ptr + row * num_experts + cols, mask=mask, other=-float("inf")).to(tl.float32)
    e = tl.exp(x - tl.max(x, axis=0))
    probs = tl.where(mask, e / tl.sum(e, axis=0), -1.0)
    picked = tl.zeros([BLOCK], dtype=tl.int1)
    total = 0.0
    for _ in tl.static_range(TOP_K):
        best = tl.max(probs, axis=0)
        best_idx = tl.min(tl.where(probs == best, cols, BLOCK), axis=0)  # lowest index among ties
        picked = picked | (cols == best_idx)
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


def router_topk_ref(logits: torch.Tensor, top_k: int, normalize: bool, weights_dtype: torch.dtype | None = None):
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    values, index = torch.topk(probs, top_k, dim=-1)
    if normalize:
        values = values / values.sum(dim=-1, keepdim=True)
    return values.to(weights_dtype or logits.dtype), index

"""Per-head RMSNorm of q and k (optional), rotary embedding, and the K/V cache write, in one launch.

Inputs for b rows of one decode step: q [b, Hq*D], k [b, Hkv*D], v [b, Hkv*D] (projection
outputs), q_weight/k_weight [D] (the q_norm / k_norm weights; both None: RoPE only, for families
without q/k-norm such as Mixtral), cos/sin [b, D], positions [b].
Returns q_out [b, Hq, D]; writes k (normed, rotated) and v into key_cache/value_cache
[rows, Hkv, S, D] at [row, head, positions[row]], or at [cache_rows[row], head, positions[row]] when given
(a prefill: each row one prompt token, several of them in one cache row).
Rounds where transformers' eager path rounds (norm, then q*cos and rotate_half(q)*sin each
rounded, then their sum), replacing ~30 small kernels of the eager path.
Capture-safe: grid (b, Hq + Hkv), positions read on the device.
"""

import torch

from ._triton import pdl, pdl_wait, tl, triton


# One warp a (row, head) program: a head's halves (64 values at head_dim 128) are normed with warp shuffles alone,
# where Triton's default 4 warps add 10 shared-memory barriers (sm_90 SASS, Triton 3.6). Not yet timed on a GPU.
NUM_WARPS = 1


@triton.jit
def _norm_rope_half(xa, xb, w_ptr, cos_ptr, sin_ptr, eps, HALF: tl.constexpr, NORM: tl.constexpr):
    out_dtype = xa.dtype
    cols = tl.arange(0, HALF)
    xaf = xa.to(tl.float32)
    xbf = xb.to(tl.float32)
    if NORM:
        variance = (tl.sum(xaf * xaf, axis=0) + tl.sum(xbf * xbf, axis=0)) / (2 * HALF)
        inv = tl.rsqrt(variance + eps)
        wa = tl.load(w_ptr + cols).to(tl.float32)
        wb = tl.load(w_ptr + HALF + cols).to(tl.float32)
        na = (wa * (xaf * inv).to(out_dtype).to(tl.float32)).to(out_dtype).to(tl.float32)
        nb = (wb * (xbf * inv).to(out_dtype).to(tl.float32)).to(out_dtype).to(tl.float32)
    else:  # RoPE only: the projection output, already in out_dtype
        na = xaf
        nb = xbf
    ca = tl.load(cos_ptr + cols).to(tl.float32)
    cb = tl.load(cos_ptr + HALF + cols).to(tl.float32)
    sa = tl.load(sin_ptr + cols).to(tl.float32)
    sb = tl.load(sin_ptr + HALF + cols).to(tl.float32)
    # rotate_half(x) = cat(-x_b, x_a)
    oa = ((na * ca).to(out_dtype).to(tl.float32) + (-nb * sa).to(out_dtype).to(tl.float32)).to(out_dtype)
    ob = ((nb * cb).to(out_dtype).to(tl.float32) + (na * sb).to(out_dtype).to(tl.float32)).to(out_dtype)
    return oa, ob


@triton.jit
def _qk_norm_rope_kernel(q_ptr, k_ptr, v_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, pos_ptr, rows_ptr, q_out_ptr,
                         kc_ptr, vc_ptr, q_heads, kv_heads, kc_row_stride, kc_head_stride, eps,
                         HEAD_DIM: tl.constexpr, NORM: tl.constexpr, CACHE_ROWS: tl.constexpr = False,
                         USE_PDL: tl.constexpr = False):
    pdl_wait(USE_PDL)  # before reading what an earlier kernel wrote
    row = tl.program_id(0)
    head = tl.program_id(1)
    half: tl.constexpr = HEAD_DIM // 2
    cols = tl.arange(0, half)
    cos_row = cos_ptr + row * HEAD_DIM
    sin_row = sin_ptr + row * HEAD_DIM
    if head < q_heads:
        src = q_ptr + (row * q_heads + head) * HEAD_DIM
        xa = tl.load(src + cols)
        xb = tl.load(src + half + cols)
        oa, ob = _norm_rope_half(xa, xb, qw_ptr, cos_row, sin_row, eps, half, NORM)
        dst = q_out_ptr + (row * q_heads + head) * HEAD_DIM
        tl.store(dst + cols, oa)
        tl.store(dst + half + cols, ob)
    else:
        kv = head - q_heads
        src = k_ptr + (row * kv_heads + kv) * HEAD_DIM
        xa = tl.load(src + cols)
        xb = tl.load(src + half + cols)
        oa, ob = _norm_rope_half(xa, xb, kw_ptr, cos_row, sin_row, eps, half, NORM)
        pos = tl.load(pos_ptr + row)
        if CACHE_ROWS:  # query rows are tokens of the cache rows given (a prefill's prompt tokens)
            offset = tl.load(rows_ptr + row) * kc_row_stride + kv * kc_head_stride + pos * HEAD_DIM
        else:
            offset = row * kc_row_stride + kv * kc_head_stride + pos * HEAD_DIM
        tl.store(kc_ptr + offset + cols, oa.to(kc_ptr.dtype.element_ty))
        tl.store(kc_ptr + offset + half + cols, ob.to(kc_ptr.dtype.element_ty))
        vsrc = v_ptr + (row * kv_heads + kv) * HEAD_DIM
        tl.store(vc_ptr + offset + cols, tl.load(vsrc + cols))
        tl.store(vc_ptr + offset + half + cols, tl.load(vsrc + half + cols))


def _check_weights(q_weight, k_weight, head_dim: int) -> bool:
    """Whether q/k are normed: both weights [head_dim], or both None (RoPE only)."""
    if (q_weight is None) != (k_weight is None):
        raise ValueError("qk_norm_rope: pass both q_weight and k_weight, or neither (RoPE only)")
    if q_weight is not None and (q_weight.shape[-1] != head_dim or k_weight.shape[-1] != head_dim):
        raise ValueError(f"qk_norm_rope: norm weights of {q_weight.shape[-1]} and {k_weight.shape[-1]} for "
                         f"head_dim {head_dim} (the caches' last dimension)")
    return q_weight is not None


def qk_norm_rope(q, k, v, q_weight, k_weight, cos, sin, positions, key_cache, value_cache, eps, cache_rows=None):
    """cache_rows [b] (optional): the cache row each row's K/V go to (default: row i to cache row i)."""
    rows, head_dim = q.shape[0], key_cache.shape[-1]
    norm = _check_weights(q_weight, k_weight, head_dim)
    q_heads, kv_heads = q.shape[-1] // head_dim, k.shape[-1] // head_dim
    if head_dim % 2 or head_dim & (head_dim - 1):
        raise ValueError(f"qk_norm_rope: head_dim must be a power of two, got {head_dim}")
    if not (key_cache.is_contiguous() and value_cache.is_contiguous()):
        raise ValueError("qk_norm_rope: the caches must be contiguous [rows, kv_heads, positions, head_dim]")
    q, k, v = q.reshape(rows, -1).contiguous(), k.reshape(rows, -1).contiguous(), v.reshape(rows, -1).contiguous()
    cos, sin = cos.reshape(rows, head_dim).contiguous(), sin.reshape(rows, head_dim).contiguous()
    q_out = torch.empty(rows, q_heads, head_dim, dtype=q.dtype, device=q.device)
    if not norm:  # the kernel reads no weight when NORM is off: q stands in for the pointers
        q_weight, k_weight, eps = q, q, 0.0
    _qk_norm_rope_kernel[(rows, q_heads + kv_heads)](
        q, k, v, q_weight, k_weight, cos, sin, positions, positions if cache_rows is None else cache_rows, q_out,
        key_cache, value_cache, q_heads, kv_heads, key_cache.stride(0), key_cache.stride(1), eps, HEAD_DIM=head_dim,
        NORM=norm, CACHE_ROWS=cache_rows is not None, num_warps=NUM_WARPS, **pdl(q.device))
    return q_out


def qk_norm_rope_ref(q, k, v, q_weight, k_weight, cos, sin, positions, key_cache, value_cache, eps, cache_rows=None):
    from .rms_norm import rms_norm_ref

    rows, head_dim = q.shape[0], key_cache.shape[-1]
    q, k = q.reshape(rows, -1, head_dim), k.reshape(rows, -1, head_dim)  # [b, Hq, D], [b, Hkv, D]
    if _check_weights(q_weight, k_weight, head_dim):
        q, k = rms_norm_ref(q, q_weight, eps), rms_norm_ref(k, k_weight, eps)
    cos, sin = cos.reshape(rows, 1, head_dim), sin.reshape(rows, 1, head_dim)

    def rotate(x):
        half = head_dim // 2
        return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin

    q, k = rotate(q), rotate(k)
    row_index = torch.arange(rows, device=q.device) if cache_rows is None else cache_rows
    key_cache[row_index, :, positions] = k.to(key_cache.dtype)
    value_cache[row_index, :, positions] = v.reshape(rows, -1, head_dim).to(value_cache.dtype)
    return q

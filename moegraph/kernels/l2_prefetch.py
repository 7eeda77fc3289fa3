"""Weights pulled into L2 ahead of the kernel that reads them, from a side stream.

At decode batch sizes the 4-bit projections' GEMVs are latency-bound: each reads a few MB once, and most of its
time is the first loads' round trip to HBM and the ramp to full bandwidth. The kernels just before them (q/k norm +
RoPE, attention, the router, the experts) leave HBM partly idle, and the H100 / H200 L2 (50 MB) holds a layer's
4-bit projections (~10 MB for Qwen3-30B-A3B) with room to spare, so their bytes can be in L2 when the GEMV starts.

prefetch_l2(tensors, stream) launches on `stream` (which first waits for the current stream's work so far) one
kernel whose programs issue `prefetch.global.L2` hints over up to MAX_TENSORS tensors' bytes, and returns at once;
the caller joins the stream back (`join`) before its work ends (a CUDA graph capture needs every forked stream
joined). A hint changes no value: a kernel reading the bytes gets the same bits whether or not they were fetched.
CUDA only (off it, and under Triton's interpreter, nothing runs); capture-safe: the addresses are launch arguments,
fixed in a captured graph like every other kernel's weight pointers.
"""

from __future__ import annotations

import functools

import torch

from ._triton import tl, triton

MAX_TENSORS = 8  # tensors one launch covers (a layer's q/k/v codes and absmax are 6)
CHUNK_BYTES = 16384  # bytes one program hints
SECTOR = 32  # bytes a lane hints at a time: a warp covers 1 KB, 8 whole 128-byte lines


@triton.jit
def _prefetch_l2_kernel(a0, n0, a1, n1, a2, n2, a3, n3, a4, n4, a5, n5, a6, n6, a7, n7,
                        CHUNK: tl.constexpr, STEP: tl.constexpr, EVICT_LAST: tl.constexpr):
    which = tl.program_id(1)
    address = tl.where(which == 0, a0, tl.where(which == 1, a1, tl.where(which == 2, a2, tl.where(
        which == 3, a3, tl.where(which == 4, a4, tl.where(which == 5, a5, tl.where(which == 6, a6, a7)))))))
    size = tl.where(which == 0, n0, tl.where(which == 1, n1, tl.where(which == 2, n2, tl.where(
        which == 3, n3, tl.where(which == 4, n4, tl.where(which == 5, n5, tl.where(which == 6, n6, n7)))))))
    offsets = tl.program_id(0).to(tl.int64) * CHUNK + tl.arange(0, CHUNK // STEP).to(tl.int64) * STEP
    if tl.program_id(0).to(tl.int64) * CHUNK < size:
        # past the end: the tensor's first sector again (a repeated hint costs nothing)
        targets = address.to(tl.int64) + tl.where(offsets < size, offsets, 0)
        if EVICT_LAST:
            tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1];\n\tmov.u32 $0, 0;", "=r,l", [targets],
                                      dtype=tl.int32, is_pure=False, pack=1)
        else:
            tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [targets],
                                      dtype=tl.int32, is_pure=False, pack=1)


@functools.lru_cache(maxsize=None)
def side_stream(device: torch.device) -> torch.cuda.Stream:
    """The stream prefetches run on, one per device (its kernels overlap the current stream's)."""
    return torch.cuda.Stream(device=device)


def prefetch_l2(tensors: list[torch.Tensor], stream: torch.cuda.Stream, evict_last: bool = True) -> None:
    """Hint `tensors`' bytes into L2 from `stream`, after the current stream's work so far (see the module doc)."""
    tensors = [t for t in tensors if t is not None and t.is_cuda and t.numel()]
    if not tensors:
        return
    stream.wait_stream(torch.cuda.current_stream(tensors[0].device))
    with torch.cuda.stream(stream):
        for first in range(0, len(tensors), MAX_TENSORS):
            group = tensors[first:first + MAX_TENSORS]
            sizes = [t.numel() * t.element_size() for t in group]
            args = []
            for t, size in zip(group, sizes):
                args += [t.data_ptr(), size]
            args += [group[0].data_ptr(), 0] * (MAX_TENSORS - len(group))
            grid = (triton.cdiv(max(sizes), CHUNK_BYTES), len(group))
            _prefetch_l2_kernel[grid](*args, CHUNK=CHUNK_BYTES, STEP=SECTOR, EVICT_LAST=evict_last, num_warps=4)


def join(stream: torch.cuda.Stream, device: torch.device) -> None:
    """Make the current stream wait for what `stream` was given (before a capture ends, or the step's outputs)."""
    torch.cuda.current_stream(device).wait_stream(stream)

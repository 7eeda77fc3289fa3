"""Triton kernels of the decode step. Each file: the kernel, its launcher and a plain-torch `_ref`.

`triton_available()` says whether the launchers can run here (CUDA and an importable Triton, or
TRITON_INTERPRET=1 for tests on the CPU); callers use the `_ref` functions otherwise.
"""

import functools
import os


@functools.lru_cache(maxsize=None)
def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:
        return False
    return True


def triton_available(tensor) -> bool:
    if not _triton_importable():
        return False
    return tensor.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"

"""Triton kernels of the decode step. Each file: the kernel, its launcher and a plain-torch `_ref`.

`triton_available()` says whether the launchers can run here (CUDA and an importable Triton, or
TRITON_INTERPRET=1 for tests on the CPU); callers use the `_ref` functions otherwise.
"""

import os

from ._triton import HAVE_TRITON

# Read once: Triton itself decides interpreter or compiled when the kernels are decorated (at import), and
# launchers ask per call (moegraph's experts functions in prefill), which must not read the environment.
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def triton_available(tensor) -> bool:
    if not HAVE_TRITON:
        return False
    return tensor.is_cuda or _INTERPRET

"""Triton kernels of the decode step. Each file: the kernel, its launcher and a plain-torch `_ref`.

`triton_available()` says whether the launchers can run here (CUDA and an importable Triton, or
TRITON_INTERPRET=1 for tests on the CPU); callers use the `_ref` functions otherwise.
"""

import os

from ._triton import HAVE_TRITON, pdl_launches  # noqa: F401  (the decode graphs launch inside pdl_launches)

# Read once: Triton itself decides interpreter or compiled when the kernels are decorated (at import), and
# launchers ask per call (moegraph's experts functions in prefill), which must not read the environment.
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def triton_available(tensor) -> bool:
    if not HAVE_TRITON:
        return False
    return tensor.is_cuda or _INTERPRET


# Triton compiles bf16 loads and dots for sm_80+ only (a T4, sm_75, has no bf16 units)
MIN_BF16_CAPABILITY = (8, 0)


def triton_dtype_problem(device, dtype, capability=None) -> str | None:
    """Why moegraph's Triton kernels cannot compute in `dtype` on a CUDA `device` (None when they can).
    `capability`: the GPU's (major, minor), read from the device when not given."""
    import torch

    if getattr(device, "type", device) != "cuda" or dtype != torch.bfloat16:
        return None
    capability = capability or torch.cuda.get_device_capability(device)
    if tuple(capability) >= MIN_BF16_CAPABILITY:
        return None
    return (f"sm_{capability[0]}{capability[1]} has no bf16 for Triton (sm_80+); load the model with "
            "dtype=torch.float16 to use moegraph's kernels there")

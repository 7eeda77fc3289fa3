"""Triton, or a stand-in where it is not installed (macOS, CPU-only torch wheels).

The stand-in lets the kernel modules import (their `_ref` functions serve the CPU path); it never
runs a kernel: `triton_available()` is False without Triton, so no launcher is called.
"""

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - exercised only where Triton is missing
    HAVE_TRITON = False

    class _Absent:
        """Any attribute or call yields another _Absent; `jit` returns the function unchanged."""

        def __getattr__(self, name):
            return _Absent()

        def __call__(self, *args, **kwargs):
            return _Absent()

        @staticmethod
        def jit(fn=None, **kwargs):
            return fn if fn is not None else (lambda f: f)

    triton = _Absent()
    tl = _Absent()

import contextlib
import functools
import os
import threading

import torch

try:  # grid dependency control (Triton >= 3.3): programmatic dependent launch on sm_90+
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    from triton.backends.nvidia.compiler import CUDAOptions

    _HAVE_GDC = "launch_pdl" in CUDAOptions.__dataclass_fields__
except Exception:  # pragma: no cover - older Triton, or none
    _HAVE_GDC = False

    def gdc_launch_dependents():
        pass

    def gdc_wait():
        pass

    if HAVE_TRITON:
        gdc_launch_dependents, gdc_wait = triton.jit(gdc_launch_dependents), triton.jit(gdc_wait)


def pdl_status(device: torch.device) -> str | None:
    """None when the decode graphs on `device` launch with programmatic dependent launch, else why not."""
    if not _HAVE_GDC:
        return "this Triton has no grid dependency control (launch_pdl, gdc_wait)"
    if device.type != "cuda":
        return f"{device.type} is not CUDA"
    if os.environ.get("MOEGRAPH_PDL", "1") == "0":
        return "MOEGRAPH_PDL=0"
    major, minor = torch.cuda.get_device_capability(device)
    return None if major >= 9 else f"sm_{major}{minor} (it needs sm_90+)"


@functools.lru_cache(maxsize=None)
def _pdl_on(device_type: str, index: int | None) -> bool:
    return pdl_status(torch.device(device_type, index) if index is not None else torch.device(device_type)) is None


_scope = threading.local()


@contextlib.contextmanager
def pdl_launches(early_trigger: bool = True):
    """Within it (this thread), the kernels launch with programmatic dependent launch where the device has it: around
    the warm-up and capture of the decode graphs, where one kernel follows another with nothing in between. Eager
    calls (prefill, an eager decode loop) launch plainly: the host, not the launch, is their limit.
    early_trigger: each kernel lets the next one launch at its start (True) or once its own wait is over (False:
    then one kernel at most waits ahead of the running one, not a chain of them); PDL_EARLY_TRIGGER overrides it."""
    saved = getattr(_scope, "depth", 0), getattr(_scope, "early_trigger", True)
    _scope.depth, _scope.early_trigger = saved[0] + 1, early_trigger
    try:
        yield
    finally:
        _scope.depth, _scope.early_trigger = saved


# None: each capture's pdl_launches(early_trigger) decides; True / False forces the trigger at a kernel's start /
# after its wait for every capture (benchmarks/ab_decode.py's pdl_late_trigger). Read at each launch.
PDL_EARLY_TRIGGER = None


def pdl(device: torch.device) -> dict:
    """Launch arguments for programmatic dependent launch on `device` inside `pdl_launches()` (Hopper and newer;
    MOEGRAPH_PDL=0 turns it off, read once): a kernel launched with them may start while the one before it drains,
    and waits for that one's results with `pdl_wait` (its launch and the loads of static weights overlap the previous
    kernel's tail). Every kernel given these must call `pdl_wait` before it reads what an earlier kernel wrote and
    before it writes."""
    if not getattr(_scope, "depth", 0) or not _pdl_on(device.type, device.index):
        return {}
    early = _scope.early_trigger if PDL_EARLY_TRIGGER is None else PDL_EARLY_TRIGGER
    return {"USE_PDL": 1 if early else 2, "launch_pdl": True}


@triton.jit
def pdl_wait(USE_PDL: tl.constexpr):
    """Let the next kernel launch and wait until the previous kernel's writes are visible (no-op without PDL):
    USE_PDL 1 lets it launch first, 2 after the wait (pdl_launches' early_trigger)."""
    if USE_PDL == 1:
        gdc_launch_dependents()
        gdc_wait()
    elif USE_PDL == 2:
        gdc_wait()
        gdc_launch_dependents()


__all__ = ["HAVE_TRITON", "pdl", "pdl_launches", "pdl_status", "pdl_wait", "tl", "triton"]

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

__all__ = ["HAVE_TRITON", "tl", "triton"]

"""moegraph: one line, `moegraph.patch(model)`, makes Qwen3-MoE `generate()` decode through CUDA graphs."""

import logging

from .errors import (
    BackendUnavailableError,
    InvalidArgumentError,
    MoegraphError,
    UnsupportedModelError,
    UnsupportedVersionError,
)
from .moe.select import select_moe_backend
from .patches.api import capture, decode_stats, is_patched, patch, unpatch

__version__ = "0.1.0"

logging.getLogger("moegraph").addHandler(logging.NullHandler())

__all__ = [
    "BackendUnavailableError",
    "InvalidArgumentError",
    "MoegraphError",
    "UnsupportedModelError",
    "UnsupportedVersionError",
    "__version__",
    "capture",
    "decode_stats",
    "is_patched",
    "patch",
    "select_moe_backend",
    "unpatch",
]

"""Errors raised by moegraph. Every message names what was found and how to fix it."""

import torch


class MoegraphError(Exception):
    """Base class of every error moegraph raises on purpose."""


class UnsupportedModelError(MoegraphError, TypeError):
    """`patch()` was given a model (or model type) that moegraph does not know how to accelerate."""


class UnsupportedVersionError(MoegraphError, RuntimeError):
    """An installed dependency (transformers, torch) is outside the supported range."""


class BackendUnavailableError(MoegraphError, RuntimeError):
    """A MoE backend was requested that cannot run on this device / dtype / installation."""


class InvalidArgumentError(MoegraphError, ValueError):
    """An argument to a moegraph function has a value that cannot work."""


class OutOfMemoryError(MoegraphError, torch.OutOfMemoryError):
    """Growing the static KV cache or capturing the decode graphs ran out of GPU memory.

    A subclass of torch's own OutOfMemoryError, so an existing `except torch.cuda.OutOfMemoryError:` (retry
    with a smaller batch) still catches it. The partial allocation is freed and the previous cache and
    graphs are kept: the model still generates every call that fits in them."""

"""Errors raised by moegraph. Every message names what was found and how to fix it."""


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

"""What moegraph swaps inside transformers, and how it is undone."""

from .api import is_patched, patch, unpatch
from ..models import FAMILIES, ModelFamily

__all__ = ["FAMILIES", "ModelFamily", "is_patched", "patch", "unpatch"]

"""Records every attribute moegraph replaces or sets, so that unpatch() puts back the very same objects."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import wrapt

_ABSENT = object()  # the attribute was not in the owner's own __dict__ (an instance inheriting it)


@dataclass
class _Replacement:
    owner: Any
    name: str
    original: Any  # the object found in owner.__dict__, or _ABSENT


@dataclass
class PatchSet:
    """An ordered set of wrapt wrappers and set attributes; `restore()` undoes them in reverse order."""

    replacements: list[_Replacement] = field(default_factory=list)

    def wrap(self, owner: Any, name: str, wrapper: Callable) -> None:
        """Replace owner.name by a wrapt FunctionWrapper whose wrapper is `wrapper(wrapped, instance, args, kwargs)`."""
        original = vars(owner).get(name, _ABSENT)
        target = getattr(owner, name)  # for an instance: the bound method it inherits
        self.replacements.append(_Replacement(owner, name, original))
        setattr(owner, name, wrapt.FunctionWrapper(original if original is not _ABSENT else target, wrapper))

    def set(self, owner: Any, name: str, value: Any) -> None:
        """Set owner.name to a plain value (e.g. a config's experts implementation), recording what was there."""
        self.replacements.append(_Replacement(owner, name, vars(owner).get(name, _ABSENT)))
        setattr(owner, name, value)

    def replace_original(self, owner: Any, name: str, old: Any, new: Any) -> None:
        """Make restore() put back `new` where it would put back `old` for owner.name (the value it found there
        was another patch's, undone since)."""
        for rep in self.replacements:
            if rep.owner is owner and rep.name == name:
                if rep.original == old:
                    rep.original = new
                return

    def restore(self) -> None:
        for rep in reversed(self.replacements):
            if rep.original is _ABSENT:
                delattr(rep.owner, rep.name)
            else:
                setattr(rep.owner, rep.name, rep.original)
        self.replacements.clear()

    def __len__(self) -> int:
        return len(self.replacements)

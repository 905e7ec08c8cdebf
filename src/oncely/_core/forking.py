"""Objects that start afresh in a forked child (a prefork server's worker made after them).

A lock that a thread of the parent held at the moment of ``fork`` stays held for good in the
child, where that thread does not exist; a thread object of the parent looks alive there and
never runs. Objects that hold either register here, and their ``_forget_parent`` runs in every
forked child, before any other code of the child does.
"""

from __future__ import annotations

import os
import weakref
from typing import Protocol

__all__ = ["Forgetful", "forget_parent_in_children"]


class Forgetful(Protocol):
    def _forget_parent(self) -> None:
        """Drop what belongs to the parent (threads, locks, connections)."""


_OBJECTS: weakref.WeakSet[Forgetful] = weakref.WeakSet()


def forget_parent_in_children(obj: Forgetful) -> None:
    """Call ``obj._forget_parent()`` in every forked child, for as long as ``obj`` lives."""
    _OBJECTS.add(obj)


def _after_fork_in_child() -> None:
    for obj in list(_OBJECTS):
        obj._forget_parent()


os.register_at_fork(after_in_child=_after_fork_in_child)

"""Memory stores: :class:`MemoryStore` and :class:`AsyncMemoryStore`, the in-process store: tests
and tools (records live as long as the process).

The classes are imported on first use, so importing this package needs no driver; the
entry point ``oncely.stores`` names :data:`backend`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from oncely.stores._backend import Backend

if TYPE_CHECKING:
    from oncely.stores.memory.async_store import AsyncMemoryStore as AsyncMemoryStore
    from oncely.stores.memory.sync_store import MemoryStore as MemoryStore

__all__ = ["AsyncMemoryStore", "MemoryStore", "backend"]

backend = Backend(
    name="Memory",
    sync="oncely.stores.memory.sync_store:MemoryStore",
    async_="oncely.stores.memory.async_store:AsyncMemoryStore",
    extra="",
    schemes=("memory",),
)
"""The store of this backend's URL schemes, for :func:`oncely.open`."""

__getattr__ = backend.module_getattr(__name__)

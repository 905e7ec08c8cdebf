"""The stores the shared tests run against, one module per backend in this package.

A backend module defines ``BACKEND = Backend(...)``. Adding a store to every contract test,
sync and async, is adding one module here: the package discovers them.

Server-backed backends call ``require()`` first (it skips the test with the reason when the
server does not answer, or fails it under ONCELY_REQUIRE_SERVICES=1), build stores on a table
or key prefix of their own from ``Scope.unique``, and register a finalizer that drops it.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import oncely
from oncely import FakeClock


@dataclass
class Scope:
    """What one test gives a backend: a private directory, a unique name fragment, and
    finalizers run after the test (drop tables, delete keys)."""

    tmp_path: Path
    unique: str
    finalizers: list[Callable[[], None]] = field(default_factory=list)


class SyncLedger(Protocol):
    def write(self, tx: Any, key: str, amount: int) -> None: ...
    def count(self, key: str) -> int: ...


class AsyncLedger(Protocol):
    async def write(self, tx: Any, key: str, amount: int) -> None: ...
    async def count(self, key: str) -> int: ...


@dataclass(frozen=True)
class Backend:
    """How to build one store kind for a test."""

    name: str
    make_sync: Callable[[Scope, FakeClock | None], oncely.Store]
    make_async: Callable[[Scope, FakeClock | None], oncely.AsyncStore]
    # Business tables for the transactional tests; None for stores without that mode.
    sync_ledger: Callable[[Scope, oncely.Store], SyncLedger] | None = None
    async_ledger: Callable[[Scope, oncely.AsyncStore], AsyncLedger] | None = None
    require: Callable[[], None] = lambda: None


def _discover() -> dict[str, Backend]:
    found: dict[str, Backend] = {}
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{__name__}.{info.name}")
        backend = getattr(module, "BACKEND", None)
        if isinstance(backend, Backend):
            found[backend.name] = backend
    return found


BACKENDS = _discover()

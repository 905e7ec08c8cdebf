"""The sqlite3 boundary: connection settings and the translation of sqlite3 errors.

aiosqlite raises sqlite3's own exceptions, so one translation serves both twins.
"""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass
from datetime import timedelta
from typing import Literal

from oncely.errors import SchemaMissing, StoreError, StoreUnavailable

__all__ = ["SQLiteSettings", "translate"]

Synchronous = Literal["off", "normal", "full", "extra"]


@dataclass(frozen=True, slots=True, kw_only=True)
class SQLiteSettings:
    """How each connection is set up.

    ``synchronous="full"`` (the default) fsyncs the WAL on every commit: a committed marker
    survives a power cut, as the acknowledgement that follows it assumes. ``"normal"`` survives
    process crashes but may lose the last commits on power loss: then a message whose
    acknowledgement already went out could lose its effects (and its marker) together.
    """

    busy_timeout: timedelta = timedelta(seconds=30)
    synchronous: Synchronous = "full"

    def pragmas(self) -> tuple[str, ...]:
        return (
            f"PRAGMA busy_timeout = {int(self.busy_timeout.total_seconds() * 1000)}",
            f"PRAGMA synchronous = {self.synchronous.upper()}",
        )


def translate(exc: sqlite3.Error, doing: str) -> StoreError:
    """The oncely error for a sqlite3 error raised while ``doing`` something."""
    text = str(exc)
    lowered = text.lower()
    if "no such table" in lowered:
        return SchemaMissing(
            f"{doing}: {text}; create the tables with `oncely migrate --store URL` "
            "(or open the store with migrate=True)"
        )
    if isinstance(exc, sqlite3.OperationalError) and any(
        word in lowered for word in ("locked", "busy", "unable to open", "disk i/o", "readonly")
    ):
        return StoreUnavailable(f"{doing}: {text}")
    return StoreError(f"{doing}: {text}")

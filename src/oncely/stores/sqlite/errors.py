"""The sqlite3 boundary: connection settings and the translation of sqlite3 errors.

aiosqlite raises sqlite3's own exceptions, so one translation serves both twins.
"""

from __future__ import annotations

import os
import sqlite3
from dataclasses import dataclass
from datetime import timedelta
from typing import Final, Literal, cast, get_args

from oncely._urls import UrlOptions, path_of, redact, split
from oncely.errors import ConfigurationError, SchemaMissing, StoreError, StoreUnavailable

__all__ = [
    "SQLiteOptions",
    "SQLiteSettings",
    "is_busy",
    "missing_directory",
    "parse_url",
    "translate",
]

Synchronous = Literal["off", "normal", "full", "extra"]


@dataclass(frozen=True, slots=True, kw_only=True)
class SQLiteSettings:
    """How each connection is set up.

    ``synchronous="full"`` (the default) fsyncs the WAL on every commit: a committed marker
    survives a power cut, as the acknowledgement that follows it assumes. ``"normal"`` survives
    process crashes but may lose the last commits on power loss: then a message whose
    acknowledgement already went out could lose its effects (and its marker) together.

    ``foreign_keys=True`` turns SQLite's foreign key checks on for the store's connections
    (``PRAGMA foreign_keys = ON``; SQLite leaves them off on every new connection): a handler
    in oncely's own transaction (transactional mode without ``tx=``) then has its writes
    checked as on the connections of an application that turns them on, and a write that
    breaks one is the handler's failure.
    """

    busy_timeout: timedelta = timedelta(seconds=30)
    synchronous: Synchronous = "full"
    foreign_keys: bool = False

    def pragmas(self) -> tuple[str, ...]:
        found = (
            f"PRAGMA busy_timeout = {int(self.busy_timeout.total_seconds() * 1000)}",
            f"PRAGMA synchronous = {self.synchronous.upper()}",
        )
        return (*found, "PRAGMA foreign_keys = ON") if self.foreign_keys else found


_BUSY_CODES: Final = (5, 6)  # SQLITE_BUSY, SQLITE_LOCKED (primary codes)


def is_busy(exc: sqlite3.Error) -> bool:
    """Whether ``exc`` says another connection holds a lock now ("database is locked"): worth
    trying again later, unlike every other error."""
    code = getattr(exc, "sqlite_errorcode", None)
    if isinstance(code, int):
        return code & 0xFF in _BUSY_CODES
    return isinstance(exc, sqlite3.OperationalError) and "locked" in str(exc).lower()


def missing_directory(path: str) -> ConfigurationError | None:
    """The error for a database file ``path`` whose directory does not exist, or None.

    SQLite says only "unable to open database file", which reads as a store to try again
    later; but nothing will make the directory, and a migration cannot help either. A
    ``file:`` URI and ``:memory:`` name no plain file: None."""
    if not path or path == ":memory:" or path.startswith("file:"):
        return None
    folder = os.path.dirname(path)
    if not folder or os.path.isdir(folder):
        return None
    return ConfigurationError(
        f"cannot open the SQLite database {path}: there is no directory {folder} "
        "(oncely creates the database file, not its directory)"
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


@dataclass(frozen=True, slots=True, kw_only=True)
class SQLiteOptions:
    """What a ``sqlite:///`` URL says."""

    path: str
    table: str = "oncely_inbox"
    pool_size: int = 4
    migrate: bool = True
    settings: SQLiteSettings = SQLiteSettings()


_KNOWN = ("table", "synchronous", "busy_timeout", "foreign_keys", "pool_size", "migrate")


def parse_url(url: str) -> SQLiteOptions:
    """``sqlite:///relative.db``, ``sqlite:////absolute.db`` or ``sqlite:///:memory:``, with
    the options ``table``, ``synchronous``, ``busy_timeout`` (seconds), ``foreign_keys``,
    ``pool_size`` and ``migrate`` in the query string."""
    parts = split(url)
    if parts.netloc not in ("", "localhost"):
        raise ConfigurationError(
            f"{redact(url)}: a SQLite URL has no host; write sqlite:///relative.db or "
            "sqlite:////absolute/path.db"
        )
    path = path_of(parts)
    if not path:
        raise ConfigurationError(f"{redact(url)}: the SQLite URL names no file")
    options = UrlOptions(url)
    found = SQLiteOptions(
        path=path,
        table=options.text("table", "oncely_inbox"),
        pool_size=options.integer("pool_size", 4),
        migrate=options.boolean("migrate", True),
        settings=SQLiteSettings(
            synchronous=cast(
                Synchronous, options.choice("synchronous", "full", get_args(Synchronous))
            ),
            busy_timeout=options.seconds("busy_timeout", timedelta(seconds=30)),
            foreign_keys=options.boolean("foreign_keys", False),
        ),
    )
    options.done(_KNOWN)
    return found

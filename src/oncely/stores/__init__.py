"""Open a store from a URL: ``oncely.open("sqlite:///var/lib/app/oncely.db")``.

=======================================  ==============================================
URL                                      store
=======================================  ==============================================
``memory://``                            :class:`~oncely.MemoryStore` (this process only)
``sqlite:///relative/path.db``           :class:`~oncely.SQLiteStore`, path relative to the
                                         working directory
``sqlite:////absolute/path.db``          the same with an absolute path
``sqlite:///:memory:``                   a private in-memory SQLite database (tests)
=======================================  ==============================================

SQLite options go in the query string: ``table``, ``synchronous`` (``full``/``normal``),
``busy_timeout`` (seconds), ``pool_size`` and ``migrate`` (``true``/``false``). Passwords never
appear in errors or logs (:func:`redact`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import timedelta
from typing import cast, get_args
from urllib.parse import parse_qs, urlsplit, urlunsplit

from oncely._async.memory import AsyncMemoryStore
from oncely._async.protocols import AsyncStore
from oncely._async.sqlite import AsyncSQLiteStore
from oncely._core.clock import Clock
from oncely._drivers.sqlite import SQLiteSettings, Synchronous
from oncely._sync.memory import MemoryStore
from oncely._sync.protocols import Store
from oncely._sync.sqlite import SQLiteStore
from oncely.errors import ConfigurationError

__all__ = ["SCHEMES", "open_async_store", "open_store", "redact"]

SCHEMES = ("memory", "sqlite")
_SYNCHRONOUS: tuple[str, ...] = get_args(Synchronous)


def redact(url: str) -> str:
    """``url`` with any password replaced by ``***``. Never raises: a URL too malformed to
    parse keeps only its scheme."""
    try:
        parts = urlsplit(url)
        password = parts.password
    except ValueError:
        scheme = url.split(":", 1)[0] if ":" in url else ""
        return f"{scheme}://***(unparsable URL)"
    if password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)
    userinfo = netloc[0].split(":", 1)[0] + ":***"
    return urlunsplit(parts._replace(netloc=f"{userinfo}@{netloc[1]}"))


def _options(query: str) -> dict[str, str]:
    found: dict[str, str] = {}
    for name, values in parse_qs(query, keep_blank_values=True).items():
        found[name] = values[-1]
    return found


@dataclass(frozen=True, slots=True)
class _SQLiteOptions:
    path: str
    table: str = "oncely_inbox"
    pool_size: int = 4
    migrate: bool = True
    synchronous: Synchronous = "full"
    busy_timeout: timedelta = timedelta(seconds=30)

    @property
    def settings(self) -> SQLiteSettings:
        return SQLiteSettings(busy_timeout=self.busy_timeout, synchronous=self.synchronous)


def _sqlite_options(url: str) -> _SQLiteOptions:
    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise ConfigurationError(
            f"{redact(url)}: a SQLite URL has no host; write sqlite:///relative.db or "
            "sqlite:////absolute/path.db"
        )
    path = parts.path[1:] if parts.path.startswith("/") else parts.path
    if not path:
        raise ConfigurationError(f"{redact(url)}: the SQLite URL names no file")
    options = _SQLiteOptions(path)
    for name, value in _options(parts.query).items():
        if name == "table":
            options = replace(options, table=value)
        elif name == "pool_size":
            options = replace(options, pool_size=_integer(url, name, value))
        elif name == "migrate":
            options = replace(options, migrate=_boolean(url, name, value))
        elif name == "synchronous":
            lowered = value.lower()
            if lowered not in _SYNCHRONOUS:
                raise ConfigurationError(
                    f"{redact(url)}: synchronous must be one of {', '.join(_SYNCHRONOUS)}"
                )
            options = replace(options, synchronous=cast(Synchronous, lowered))
        elif name == "busy_timeout":
            seconds = _number(url, name, value)
            options = replace(options, busy_timeout=timedelta(seconds=seconds))
        else:
            raise ConfigurationError(
                f"{redact(url)}: unknown option {name!r} (known: table, synchronous, "
                "busy_timeout, pool_size, migrate)"
            )
    return options


def _integer(url: str, name: str, value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise ConfigurationError(f"{redact(url)}: {name} must be a whole number") from None


def _number(url: str, name: str, value: str) -> float:
    try:
        return float(value)
    except ValueError:
        raise ConfigurationError(f"{redact(url)}: {name} must be a number") from None


def _boolean(url: str, name: str, value: str) -> bool:
    lowered = value.lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ConfigurationError(f"{redact(url)}: {name} must be true or false")


def _scheme(url: str) -> str:
    try:
        scheme = urlsplit(url).scheme.lower()
        urlsplit(url).port  # noqa: B018 - validates the host and port part
    except ValueError as exc:
        raise ConfigurationError(f"{redact(url)}: not a valid URL ({exc})") from None
    if scheme not in SCHEMES:
        raise ConfigurationError(
            f"{redact(url)}: unsupported store URL scheme {scheme!r}; supported: "
            + ", ".join(f"{s}://" for s in SCHEMES)
        )
    return scheme


def open_store(url: str, *, clock: Clock | None = None) -> Store:
    """A synchronous store for ``url`` (see the module docstring for the schemes)."""
    if _scheme(url) == "memory":
        return MemoryStore(clock=clock)
    o = _sqlite_options(url)
    return SQLiteStore(
        o.path,
        table=o.table,
        settings=o.settings,
        pool_size=o.pool_size,
        clock=clock,
        migrate=o.migrate,
    )


def open_async_store(url: str, *, clock: Clock | None = None) -> AsyncStore:
    """An asyncio store for ``url`` (see the module docstring for the schemes)."""
    if _scheme(url) == "memory":
        return AsyncMemoryStore(clock=clock)
    o = _sqlite_options(url)
    return AsyncSQLiteStore(
        o.path,
        table=o.table,
        settings=o.settings,
        pool_size=o.pool_size,
        clock=clock,
        migrate=o.migrate,
    )

"""oncely's store on a database of ``settings.DATABASES``: the URL it is opened with, the store
itself (one per database, kept for the process) and an :class:`~oncely.Inbox` on it.

The table is ``oncely_inbox`` unless ``settings.ONCELY_INBOX = {"table": ..., "schema": ...}``
says otherwise (``schema``: PostgreSQL only; default ``public``). The store follows the
database's settings as Django holds them at the time, so under Django's test runner it is
the test database.
"""

from __future__ import annotations

import os
import threading
from typing import Any
from urllib.parse import quote, urlencode

from django.conf import settings
from django.db import DEFAULT_DB_ALIAS, connections

import oncely
from oncely.errors import ConfigurationError
from oncely.stores import open_store

__all__ = ["alias_of", "close_stores", "get_inbox", "get_store", "inbox_table", "store_url"]

# Options of Django's PostgreSQL backend that are not libpq connection parameters.
_DJANGO_PG_OPTIONS = frozenset(
    {"pool", "server_side_binding", "isolation_level", "assume_role", "cursor_factory"}
)


def _inbox_settings() -> dict[str, str]:
    given: Any = getattr(settings, "ONCELY_INBOX", {})
    if not isinstance(given, dict):
        raise ConfigurationError(
            f"settings.ONCELY_INBOX must be a dict ({{'table': ..., 'schema': ...}}), "
            f"not {type(given).__name__}"
        )
    unknown = sorted(set(given) - {"table", "schema"})
    if unknown:
        raise ConfigurationError(
            f"settings.ONCELY_INBOX: unknown option(s) {', '.join(map(repr, unknown))}; "
            "known: 'table', 'schema'"
        )
    return {name: str(value) for name, value in given.items()}


def inbox_table() -> str:
    """The inbox's table name (``settings.ONCELY_INBOX["table"]``, default ``oncely_inbox``)."""
    return _inbox_settings().get("table", "oncely_inbox")


def _vendor_of(engine: str) -> str:
    if engine.endswith(".postgresql") or engine.endswith(".postgis"):
        return "postgresql"
    if engine.endswith(".mysql"):
        return "mysql"
    if engine.endswith(".sqlite3") or engine.endswith(".spatialite"):
        return "sqlite"
    raise ConfigurationError(
        f"oncely keeps its inbox on PostgreSQL, MariaDB/MySQL or SQLite; the database's "
        f"ENGINE is {engine!r}"
    )


def store_url(using: str = DEFAULT_DB_ALIAS) -> str:
    """The oncely store URL for the database ``using`` of ``settings.DATABASES`` (password
    included: show it through :func:`oncely.redact`), with the inbox's table and schema."""
    if using not in connections:
        raise ConfigurationError(
            f"no database {using!r} in settings.DATABASES (there are: "
            f"{', '.join(connections) or 'none'})"
        )
    db: dict[str, Any] = connections[using].settings_dict
    vendor = _vendor_of(str(db.get("ENGINE", "")))
    chosen = _inbox_settings()
    query: dict[str, str] = {"table": inbox_table()}
    if vendor == "sqlite":
        if "schema" in chosen:
            raise ConfigurationError("settings.ONCELY_INBOX: 'schema' is for PostgreSQL only")
        name = str(db.get("NAME") or "")
        if name in ("", ":memory:") or "mode=memory" in name:
            raise ConfigurationError(
                f"database {using!r} is an in-memory SQLite database, which oncely's store "
                "cannot share with Django's connection: give it a file (for the test "
                "runner, DATABASES[...]['TEST']['NAME'] = 'a file name')"
            )
        path = os.path.abspath(name.removeprefix("file:").split("?", 1)[0])
        return f"sqlite:///{path}?{urlencode(query)}"
    user = quote(str(db.get("USER") or ""), safe="")
    password = quote(str(db.get("PASSWORD") or ""), safe="")
    host = str(db.get("HOST") or "")
    port = str(db.get("PORT") or "")
    options: dict[str, Any] = dict(db.get("OPTIONS") or {})
    if host.startswith("/"):  # a Unix socket directory (PostgreSQL) or file (MySQL)
        query["host" if vendor == "postgresql" else "unix_socket"] = host
        host = ""
    auth = f"{user}:{password}@" if password else (f"{user}@" if user else "")
    where = f"{host or 'localhost'}{':' + port if port else ''}"
    name = quote(str(db.get("NAME") or ""), safe="")
    if vendor == "postgresql":
        if "schema" in chosen:
            query["schema"] = chosen["schema"]
        # libpq's own parameters (sslmode, ...) are passed on; the store refuses others.
        query.update({k: str(v) for k, v in options.items() if k not in _DJANGO_PG_OPTIONS})
        return f"postgresql://{auth}{where}/{name}?{urlencode(query)}"
    if "schema" in chosen:
        raise ConfigurationError("settings.ONCELY_INBOX: 'schema' is for PostgreSQL only")
    unsupported = sorted(set(options) - {"charset", "isolation_level", "init_command", "ssl"})
    if unsupported:
        raise ConfigurationError(
            f"DATABASES[{using!r}]['OPTIONS']: oncely's MySQL store does not read "
            f"{', '.join(map(repr, unsupported))}; give HOST, PORT, USER and PASSWORD instead"
        )
    return f"mysql://{auth}{where}/{name}?{urlencode(query)}"


_STORES: dict[str, oncely.Store] = {}
_LOCK = threading.Lock()


def get_store(using: str = DEFAULT_DB_ALIAS) -> oncely.Store:
    """The store on the database ``using`` (opened once per URL and kept for the process)."""
    url = store_url(using)
    with _LOCK:
        store = _STORES.get(url)
        if store is None:
            store = _STORES[url] = open_store(url)
            _ALIASES[id(store)] = using
        return store


_ALIASES: dict[int, str] = {}


def close_stores(using: str | None = None) -> None:
    """Close the stores :func:`get_store` opened (on the database ``using``, or all), so that
    their connections do not hold the database open; a later :func:`get_store` opens a new
    one. The app calls it before Django's test runner drops a test database."""
    with _LOCK:
        for url, store in list(_STORES.items()):
            if using is None or _ALIASES.get(id(store)) == using:
                del _STORES[url]
                _ALIASES.pop(id(store), None)
                store.close()


def alias_of(store: object) -> str | None:
    """The database alias :func:`get_store` opened ``store`` for, if it did."""
    return _ALIASES.get(id(store))


def get_inbox(consumer: str, *, using: str = DEFAULT_DB_ALIAS, **options: Any) -> oncely.Inbox:
    """An :class:`~oncely.Inbox` for ``consumer`` on the database ``using`` (``options``: the
    inbox's own, such as ``retention=oncely.Retention(keep=timedelta(days=7))``)."""
    return oncely.Inbox(get_store(using), consumer=consumer, **options)

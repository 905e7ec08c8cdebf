"""The psycopg boundary: URL options, safe descriptions of a connection string, and the
translation of psycopg errors into oncely's. psycopg raises the same exceptions from its sync and
asyncio halves, so one translation serves both twins.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import timedelta
from functools import cache
from urllib.parse import parse_qs, urlencode

import psycopg
import psycopg_pool
from psycopg import pq
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from oncely._urls import UrlOptions, redact, split
from oncely.errors import ConfigurationError, SchemaMissing, StoreError, StoreUnavailable

__all__ = ["PostgresOptions", "describe", "is_disconnect", "parse_url", "translate"]

# SQLSTATE classes and codes that mean "not now": the connection broke (08), the server is
# short of resources (53: too many connections, disk full), shutting down or restarting (57:
# admin/crash shutdown, cannot connect now, statement timeout), a transaction was rolled back
# for a serialization failure or a deadlock (40), a lock timeout (55P03), an I/O error (58),
# or a read-only server (25006: a standby, for instance while a failover completes).
_UNAVAILABLE_CLASSES = ("08", "53", "57", "40", "58")
_UNAVAILABLE_CODES = ("55P03", "25006")
# A connection attempt the server refused for a reason that waiting will not fix.
_NOT_TRANSIENT = (
    "authentication failed",
    "does not exist",
    "no pg_hba.conf entry",
    "permission denied",
    "invalid uri",
    "invalid connection option",
)


def translate(exc: psycopg.Error, doing: str, where: str) -> StoreError:
    """The oncely error for a psycopg error raised while ``doing`` something on the server
    described by ``where`` (already redacted)."""
    text = str(exc).strip() or type(exc).__name__
    if isinstance(exc, psycopg_pool.PoolClosed):
        return StoreError(f"{doing}: the store (or its connection pool) is closed")
    if isinstance(exc, psycopg_pool.PoolTimeout):
        return StoreUnavailable(
            f"{doing}: no connection to {where} ({text}); the server may be down or every "
            "connection of the pool busy; retry later"
        )
    state = exc.sqlstate
    if state in ("42P01", "3F000"):  # undefined table, undefined schema
        return SchemaMissing(
            f"{doing}: {text}; create the tables with `oncely migrate --store URL` "
            "(or open the store with migrate=True)"
        )
    if state is not None:
        if state[:2] in _UNAVAILABLE_CLASSES or state in _UNAVAILABLE_CODES:
            return StoreUnavailable(f"{doing} on {where}: {text}")
        return StoreError(f"{doing} on {where}: {text}")
    if isinstance(exc, psycopg.OperationalError):
        # No SQLSTATE: the connection could not be made or was lost mid-operation.
        lowered = text.lower()
        if any(reason in lowered for reason in _NOT_TRANSIENT):
            return StoreError(f"{doing} on {where}: {text}")
        return StoreUnavailable(f"{doing} on {where}: {text}")
    return StoreError(f"{doing} on {where}: {text}")


def is_disconnect(exc: psycopg.Error) -> bool:
    """True when ``exc`` says the connection itself is gone (not a pool timeout, not a
    statement timeout): the other idle connections of the pool are probably dead too (a
    server restart)."""
    if isinstance(exc, psycopg_pool.PoolTimeout | psycopg_pool.PoolClosed):
        return False
    state = exc.sqlstate
    if state is None:
        return isinstance(exc, psycopg.OperationalError)
    return state[:2] == "08" or state in ("57P01", "57P02", "57P03")


def is_read_only(exc: psycopg.Error) -> bool:
    """True when ``exc`` is a write refused because the session is read-only (25006): a
    standby, or a primary that was read-only when the connection opened. A session keeps
    the default it started with, so its connection stays read-only after the server is
    writable again."""
    return exc.sqlstate == "25006"


def describe(conninfo: str) -> str:
    """``conninfo`` (a URL or ``key=value`` pairs) safe to print: any password is ``***``."""
    if "://" in conninfo:
        shown = redact(conninfo)
        try:
            parts = split(shown)
        except ConfigurationError:
            return shown
        query = parse_qs(parts.query, keep_blank_values=True)
        if "password" not in query:
            return shown
        query["password"] = ["***"]
        return parts._replace(query=urlencode(query, doseq=True, safe="*")).geturl()
    try:
        params = conninfo_to_dict(conninfo)
    except psycopg.Error:
        return "(unparsable connection string)"
    if "password" in params:
        params["password"] = "***"
    return make_conninfo(**{k: str(v) for k, v in params.items()})


@cache
def _libpq_keywords() -> frozenset[str]:
    return frozenset(opt.keyword.decode() for opt in pq.Conninfo.get_defaults())


@dataclass(frozen=True, slots=True, kw_only=True)
class PostgresOptions:
    """What a ``postgresql://`` URL says: the libpq connection string (oncely's options
    removed) and oncely's own options."""

    conninfo: str
    schema: str = "public"
    table: str = "oncely_inbox"
    pool_min: int = 1
    pool_max: int = 10
    connect_timeout: timedelta = timedelta(seconds=10)
    read_timeout: timedelta | None = timedelta(seconds=10)
    migrate: bool = True


_KNOWN = ("schema", "table", "pool_min", "pool_max", "connect_timeout", "read_timeout", "migrate")


def parse_url(url: str) -> PostgresOptions:
    """``postgresql://user:password@host:port/database`` (or ``postgres://``) with oncely's
    options ``schema``, ``table``, ``pool_min``, ``pool_max``, ``connect_timeout`` and
    ``read_timeout`` (seconds; ``read_timeout=0``: no bound) and ``migrate`` in the query
    string. Other query parameters must be libpq's own
    (``sslmode``, ``application_name``, ...): they are passed on; anything else is refused."""
    try:
        return _parse_url(url)
    except ConfigurationError as exc:
        # UrlOptions shows the URL through redact(), which masks only the userinfo password;
        # libpq also takes ``?password=``: show the URL masked here too.
        raise ConfigurationError(str(exc).replace(redact(url), describe(url))) from None


def _parse_url(url: str) -> PostgresOptions:
    parts = split(url)
    options = UrlOptions(url)
    found = PostgresOptions(
        conninfo="",
        schema=options.text("schema", "public"),
        table=options.text("table", "oncely_inbox"),
        pool_min=options.integer("pool_min", 1),
        pool_max=options.integer("pool_max", 10),
        connect_timeout=options.seconds("connect_timeout", timedelta(seconds=10)),
        read_timeout=options.seconds("read_timeout", timedelta(seconds=10)) or None,
        migrate=options.boolean("migrate", True),
    )
    libpq: dict[str, str] = {}
    for name in parse_qs(parts.query, keep_blank_values=True):
        value = options.optional_text(name) if name in _libpq_keywords() else None
        if value is not None:
            libpq[name] = value
    options.done((*_KNOWN, "libpq's parameters (sslmode, application_name, ...)"))
    if found.pool_min < 0 or found.pool_max < 1 or found.pool_min > found.pool_max:
        raise ConfigurationError(
            f"{describe(url)}: need 0 <= pool_min <= pool_max and pool_max >= 1"
        )
    if found.connect_timeout <= timedelta(0):
        raise ConfigurationError(f"{describe(url)}: connect_timeout must be positive")
    if found.read_timeout is not None and found.read_timeout < timedelta(0):
        raise ConfigurationError(f"{describe(url)}: read_timeout must be positive (0: no bound)")
    return replace(found, conninfo=parts._replace(query=urlencode(libpq), fragment="").geturl())

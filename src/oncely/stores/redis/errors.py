"""The redis-py boundary: URL options, the translation of redis-py errors, and the store's own
packing of ``EVALSHA``.

redis-py raises the same exception classes from its sync, asyncio and cluster clients, so one
translation serves both twins.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Final
from urllib.parse import urlunsplit

import redis
from redis.crc import key_slot
from redis.exceptions import (
    AuthenticationError,
    AuthorizationError,
    ClusterError,
    NoPermissionError,
    OutOfMemoryError,
    ReadOnlyError,
    RedisClusterException,
    RedisError,
    ResponseError,
    SlotNotCoveredError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from oncely._urls import UrlOptions, path_of, redact, split
from oncely.errors import ConfigurationError, StoreError, StoreUnavailable
from oncely.stores._sql import check_identifier

__all__ = [
    "DRIVER_ERRORS",
    "POOL_ARGS",
    "RedisOptions",
    "pack_evalsha",
    "parse_url",
    "refused_command",
    "slot_of",
    "translate",
]

DRIVER_ERRORS: Final = (RedisError, RedisClusterException, OSError)
"""Everything redis-py raises for a failed call (``OSError`` covers socket errors and
``TimeoutError`` that escape its own wrappers)."""

# Errors that mean "not now, retry later": the connection (refused, lost, timed out, or the
# server LOADING its data set, which redis-py reports as a connection error), a replica or a
# demoted primary (READONLY), a cluster moving or missing slots (TRYAGAIN, CLUSTERDOWN,
# MASTERDOWN), memory full until retention frees some (OOM). redis-py strips the code from
# those it has a class for; the others keep it in the text (BUSY: a script is running long).
_UNAVAILABLE: Final = (
    RedisConnectionError,
    RedisTimeoutError,
    ReadOnlyError,
    TryAgainError,
    ClusterError,
    OutOfMemoryError,
    SlotNotCoveredError,
    OSError,
)
_TRANSIENT_CODES: Final = ("BUSY", "LOADING", "READONLY", "TRYAGAIN", "CLUSTERDOWN", "MASTERDOWN")


def _version(text: str) -> tuple[int, ...]:
    parts = []
    for part in text.split(".")[:2]:
        digits = "".join(c for c in part if c.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


POOL_ARGS: Final[tuple[str, ...]] = ("EVALSHA",) if _version(redis.__version__) < (5, 3) else ()
"""What ``pool.get_connection`` takes: a command name before redis-py 5.3, nothing since
(which warns when given one)."""


def pack_evalsha(sha: bytes, keys: Sequence[bytes], args: Sequence[bytes]) -> bytes:
    """``EVALSHA sha len(keys) *keys *args`` in the Redis protocol, as one buffer.

    The store's own packer: redis-py's is general (any type, any encoding, chunking) and costs
    about as much per argument as a short reply costs to parse; every argument here is bytes
    already.

    Speed: a call of a shape seen before (script, number of keys and of arguments, at most
    :data:`_SHAPED` values: every single-key script) fills one ``%`` format made for that
    shape, the command's head written in: 0.9 us instead of 1.6 for a claim (one key, seven
    arguments; ``bench/web.py --in-process`` replays take about 50 us). Longer calls
    (batches) are joined part by part."""
    n = len(keys) + len(args)
    if n > _SHAPED:
        return _head(sha, len(keys), n) + b"".join([_part(p) for p in (*keys, *args)])
    shape = (sha, len(keys), len(args))
    template = _TEMPLATES.get(shape)
    if template is None:
        head = _head(sha, len(keys), n).replace(b"%", b"%%")
        template = _TEMPLATES[shape] = head + b"$%d\r\n%s\r\n" * n
    flat: list[int | bytes] = []
    for part in keys:
        flat += (len(part), part)
    for part in args:
        flat += (len(part), part)
    return template % tuple(flat)


_SHAPED: Final = 16
"""The most keys and arguments together of a call packed by a format of its shape."""
_TEMPLATES: dict[tuple[bytes, int, int], bytes] = {}


def _head(sha: bytes, nkeys: int, n: int) -> bytes:
    """``EVALSHA sha nkeys`` of a call with ``n`` keys and arguments together."""
    count = b"%d" % nkeys
    return b"*%d\r\n$7\r\nEVALSHA\r\n$%d\r\n%s\r\n$%d\r\n%s\r\n" % (
        n + 3, len(sha), sha, len(count), count,
    )  # fmt: skip


def _part(part: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(part), part)


def slot_of(name: bytes) -> int:
    """The Redis Cluster hash slot of a key (its hash tag's, when it has one)."""
    return int(key_slot(name))


def _kernel_timed_out(exc: BaseException) -> bool:
    """Whether ``exc`` comes of a socket the kernel timed out (``EAGAIN`` on a blocking
    socket with ``SO_RCVTIMEO``/``SO_SNDTIMEO``), which redis-py reports as a connection error
    raised while handling the ``BlockingIOError``."""
    seen: BaseException | None = exc
    for _ in range(4):
        if seen is None:
            return False
        if isinstance(seen, BlockingIOError):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def refused_command(exc: BaseException) -> bool:
    """Whether ``exc`` is the server's answer refusing a command (an ACL's NOPERM, a renamed
    or unknown command), rather than no answer (the server down, unreachable, timed out,
    loading, or the credentials refused) or another refusal (a database out of range)."""
    if isinstance(exc, NoPermissionError):
        return True
    text = str(exc).lower()
    return isinstance(exc, ResponseError) and (
        "unknown command" in text or "noperm" in text or "no permissions" in text
    )


def translate(exc: BaseException, doing: str, where: str) -> StoreError:
    """The oncely error for a redis-py error raised while ``doing`` something on the server
    ``where`` (a URL, already redacted), named in the message as PostgreSQL's store names its
    own."""
    text = str(exc) or type(exc).__name__
    doing = f"{doing} on {where}"
    if isinstance(exc, AuthenticationError | AuthorizationError | NoPermissionError):
        return StoreError(f"{doing}: {text}; check the user and password of the Redis URL")
    if _kernel_timed_out(exc):
        return StoreUnavailable(f"{doing}: timeout: Redis did not answer in time ({text})")
    if isinstance(exc, _UNAVAILABLE):
        return StoreUnavailable(f"{doing}: {text}")
    if isinstance(exc, ResponseError) and text.startswith(_TRANSIENT_CODES):
        return StoreUnavailable(f"{doing}: {text}")
    if isinstance(exc, RedisClusterException) and "connect" in text.lower():
        return StoreUnavailable(f"{doing}: {text}")
    return StoreError(f"{doing}: {text}")


@dataclass(frozen=True, slots=True, kw_only=True)
class RedisOptions:
    """What a ``redis://`` / ``rediss://`` URL says. ``server`` is the URL redis-py connects
    to (scheme, credentials, host, port, database), without oncely's options."""

    server: str
    prefix: str = "oncely"
    cluster: bool = False
    migrate: bool = True
    allow_eviction: bool = False
    max_connections: int = 16
    timeout: timedelta = timedelta(seconds=5)
    connect_timeout: timedelta = timedelta(seconds=5)
    ssl_ca_certs: str | None = None


_KNOWN = (
    "prefix",
    "cluster",
    "migrate",
    "allow_eviction",
    "max_connections",
    "timeout",
    "connect_timeout",
    "ssl_ca_certs",
)


def parse_url(url: str) -> RedisOptions:
    """``redis://[user:password@]host[:port][/db]`` or ``rediss://`` (TLS), with the options
    ``prefix`` (of every key, default ``oncely``), ``cluster`` (true: a Redis Cluster, the
    host is any node), ``migrate``, ``allow_eviction`` (true: accept a server whose
    ``maxmemory-policy`` evicts keys), ``max_connections`` (per server: the scripts of the
    message path run on at most this many; the operator calls, such as ``stats``, ``scan``
    and ``purge_expired``, borrow from a pool of as many more), ``timeout`` and
    ``connect_timeout`` (seconds) and ``ssl_ca_certs`` (a CA bundle file, ``rediss://``
    only) in the query string."""
    parts = split(url)
    scheme = parts.scheme.lower()
    if scheme not in ("redis", "rediss"):
        raise ConfigurationError(f"{redact(url)}: not a redis:// or rediss:// URL")
    if not parts.hostname:
        raise ConfigurationError(f"{redact(url)}: the Redis URL names no host")
    database = path_of(parts) or "0"
    if not database.isdigit():
        raise ConfigurationError(f"{redact(url)}: the database must be a number, as in /0")
    options = UrlOptions(url)
    prefix = options.text("prefix", "oncely")
    check_identifier(prefix)
    found = RedisOptions(
        server=urlunsplit((scheme, parts.netloc, f"/{int(database)}", "", "")),
        prefix=prefix,
        cluster=options.boolean("cluster", False),
        migrate=options.boolean("migrate", True),
        allow_eviction=options.boolean("allow_eviction", False),
        max_connections=options.integer("max_connections", 16),
        timeout=options.seconds("timeout", timedelta(seconds=5)),
        connect_timeout=options.seconds("connect_timeout", timedelta(seconds=5)),
        ssl_ca_certs=options.optional_text("ssl_ca_certs"),
    )
    options.done(_KNOWN)
    if found.max_connections < 1:
        raise ConfigurationError(f"{redact(url)}: max_connections must be at least 1")
    if found.timeout <= timedelta(0) or found.connect_timeout <= timedelta(0):
        raise ConfigurationError(f"{redact(url)}: timeouts must be positive")
    if found.cluster and int(database) != 0:
        raise ConfigurationError(f"{redact(url)}: a Redis Cluster has only database 0")
    if found.ssl_ca_certs is not None and scheme != "rediss":
        raise ConfigurationError(f"{redact(url)}: ssl_ca_certs needs a rediss:// URL")
    return found

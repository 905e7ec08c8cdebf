"""The PyMySQL boundary, shared by both twins (aiomysql raises PyMySQL's exceptions and keeps
PyMySQL's ``server_status``): URL parsing, connection settings, error translation, and what the
server says about a connection's transaction.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Final
from urllib.parse import unquote

import pymysql  # type: ignore[import-untyped]
from pymysql.constants import CLIENT, SERVER_STATUS  # type: ignore[import-untyped]

from oncely._urls import UrlOptions, path_of, redact, split
from oncely.errors import ConfigurationError, SchemaMissing, StoreError, StoreUnavailable

__all__ = [
    "DRIVER_ERRORS",
    "MySQLOptions",
    "MySQLSettings",
    "autocommits",
    "code_of",
    "describe_error",
    "disconnected",
    "in_transaction",
    "joinable",
    "parse_url",
    "retries_for",
    "translate",
]

DRIVER_ERRORS: Final[tuple[type[BaseException], ...]] = (pymysql.MySQLError, OSError)
"""What a driver call may raise: PyMySQL's errors, and socket errors aiomysql lets through.

The classes are those of the package's top level, never ``pymysql.err.*``: after
``pymysql.install_as_MySQLdb()`` (how Django's MySQL backend runs on PyMySQL) an import of
``MySQLdb.err`` loads a second copy of that module and rebinds ``pymysql.err`` to it, while
PyMySQL itself keeps raising the original classes."""

DEADLOCK: Final = 1213
LOCK_WAIT_TIMEOUT: Final = 1205
NO_SUCH_TABLE: Final = 1146
NO_SUCH_SAVEPOINT: Final = 1305

# The server cannot be reached, is going away, is read-only or is busy: retry later.
_UNAVAILABLE: Final = frozenset(
    {
        1040,  # too many connections
        1053,  # server shutdown in progress
        1077,  # server is shutting down (normal shutdown)
        1129,  # host blocked by too many connection errors
        1158,  # network read error
        1159,  # network read timeout
        1160,  # network write error
        1161,  # network write timeout
        1203,  # user has too many connections
        1205,  # lock wait timeout
        1213,  # deadlock
        1290,  # --read-only (a replica, or a failover in progress)
        1317,  # query interrupted
        1792,  # read-only transaction
        1836,  # read-only mode
        1927,  # connection killed (MariaDB)
        1969,  # max_statement_time exceeded (MariaDB)
        3024,  # max_execution_time exceeded (MySQL)
        4031,  # disconnected for inactivity (MySQL)
        2002,  # cannot connect through the socket
        2003,  # cannot connect to the server
        2005,  # unknown host
        2006,  # server has gone away
        2013,  # lost connection during a query
        2014,  # commands out of sync (a connection left mid-result)
        2055,  # lost connection (system error)
    }
)
# After these the connection itself is unusable: it is discarded, not pooled again.
_BROKEN: Final = frozenset({1053, 1077, 1158, 1159, 1160, 1161, 1927, 4031, 2006, 2013, 2014, 2055})


def code_of(exc: BaseException) -> int | None:
    """The server or client error number of a PyMySQL error."""
    args = getattr(exc, "args", ())
    return args[0] if args and isinstance(args[0], int) else None


def describe_error(exc: BaseException) -> str:
    """A driver error as a sentence: PyMySQL's ``(1049, "Unknown database 'x'")`` (its
    ``args``, a tuple, as ``str`` shows them) reads ``MariaDB/MySQL error 1049: Unknown
    database 'x'``."""
    code = code_of(exc)
    args = exc.args
    if code is not None and len(args) == 2 and isinstance(args[1], str):
        return f"MariaDB/MySQL error {code}: {args[1]}"
    return str(exc) or type(exc).__name__


def retries_for(exc: BaseException) -> int:
    """How many times an autocommit statement that failed with ``exc`` is run again: InnoDB
    rolled it back whole, so repeating it is safe. A deadlock victim retries at once (the
    other transaction goes on); a lock wait already waited ``innodb_lock_wait_timeout``,
    so it gets one more wait."""
    code = code_of(exc)
    if code == DEADLOCK:
        return 4
    if code == LOCK_WAIT_TIMEOUT:
        return 1
    return 0


def disconnected(exc: BaseException) -> bool:
    """True when the connection that raised ``exc`` must be thrown away."""
    if isinstance(exc, (OSError, pymysql.InterfaceError)):
        return True
    return code_of(exc) in _BROKEN


def translate(exc: BaseException, doing: str, *, joined: bool = False) -> StoreError:
    """The oncely error for a driver error raised while ``doing`` something; ``joined`` when it
    happened inside a transaction the caller owns."""
    code = code_of(exc)
    text = describe_error(exc)
    if code == NO_SUCH_TABLE:
        return SchemaMissing(
            f"{doing}: {text}; create the tables with `oncely migrate --store URL` "
            "(or open the store with migrate=True)"
        )
    if joined and code == DEADLOCK:
        return StoreUnavailable(
            f"{doing}: deadlock: InnoDB rolled back the whole transaction, and every write "
            "made in it is gone; roll back (if your code has not yet) and handle the message "
            "again in a new transaction"
        )
    if joined and code == NO_SUCH_SAVEPOINT:
        return StoreUnavailable(
            f"{doing}: {text}: the server had already rolled back the whole transaction (a "
            "deadlock, or a lock wait timeout under innodb_rollback_on_timeout), and every "
            "write made in it is gone; handle the message again in a new transaction"
        )
    if joined and code == LOCK_WAIT_TIMEOUT:
        return StoreUnavailable(
            f"{doing}: lock wait timeout: another transaction holds this key (its first "
            "claimer has not committed yet); this statement was undone but the transaction "
            "is still open: roll it back and retry the message later"
        )
    if (
        code in _UNAVAILABLE
        or isinstance(exc, (OSError, pymysql.InterfaceError))
        or (code is not None and 2000 <= code < 3000)  # client-side: connection trouble
    ):
        return StoreUnavailable(f"{doing}: {text}")
    return StoreError(f"{doing}: {text}")


def _status(conn: Any) -> int | None:
    status = getattr(conn, "server_status", None)
    return status if isinstance(status, int) else None


def in_transaction(conn: Any) -> bool:
    """True when the server's last status for ``conn`` says a transaction is open
    (``SERVER_STATUS_IN_TRANS``). PyMySQL and aiomysql refresh it from every OK packet (not
    from result sets), so after a write it is exact."""
    status = _status(conn)
    return status is not None and bool(status & SERVER_STATUS.SERVER_STATUS_IN_TRANS)


def autocommits(conn: Any) -> bool:
    """True when the server's last status for ``conn`` says autocommit is on."""
    status = _status(conn)
    return status is not None and bool(status & SERVER_STATUS.SERVER_STATUS_AUTOCOMMIT)


def joinable(conn: Any) -> bool:
    """True when a statement run on ``conn`` now belongs to a transaction the caller commits:
    one is open (after ``BEGIN``), or autocommit is off (the next statement opens one)."""
    status = _status(conn)
    if status is None:
        return False
    return bool(status & SERVER_STATUS.SERVER_STATUS_IN_TRANS) or not (
        status & SERVER_STATUS.SERVER_STATUS_AUTOCOMMIT
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class MySQLSettings:
    """Where the server is and how each of the store's connections is set up.

    Connections run in autocommit mode with ``CLIENT_FOUND_ROWS`` (an UPDATE reports the rows
    it matched), utf8mb4, and ``STRICT_ALL_TABLES`` plus ``NO_ENGINE_SUBSTITUTION`` added to
    the server's SQL mode (a value too long for its column is an error, never truncated; a
    table is InnoDB or not created). ``lock_timeout`` sets ``innodb_lock_wait_timeout`` for
    the store's sessions (the server's default, 50 s, when None).
    """

    database: str
    host: str = "localhost"
    port: int = 3306
    user: str | None = None
    password: str | None = field(default=None, repr=False)
    unix_socket: str | None = None
    connect_timeout: timedelta = timedelta(seconds=10)
    lock_timeout: timedelta | None = None

    def __post_init__(self) -> None:
        if "://" in self.database:
            # A URL given as the database name: refused before it reaches an error message
            # (with its password in it) as the name of a database that does not exist.
            raise ConfigurationError(
                "the store's first argument is the database name, and this is a URL: open it "
                "with oncely.open(url) (or MySQLStore.from_url(url))"
            )

    def init_command(self) -> str:
        sets = [
            "sql_mode = CONCAT_WS(',', NULLIF(@@sql_mode, ''), "
            "'STRICT_ALL_TABLES', 'NO_ENGINE_SUBSTITUTION')"
        ]
        if self.lock_timeout is not None:
            seconds = max(1, round(self.lock_timeout.total_seconds()))
            sets.append(f"innodb_lock_wait_timeout = {seconds}")
        return "SET SESSION " + ", ".join(sets)

    def connect_kwargs(self) -> dict[str, Any]:
        """Keyword arguments both ``pymysql.connect`` and ``aiomysql.connect`` take (the
        database goes as ``database=`` / ``db=``)."""
        return {
            "host": self.host,
            "port": self.port,
            "user": self.user,
            "password": self.password or "",
            "unix_socket": self.unix_socket,
            "charset": "utf8mb4",
            "autocommit": True,
            "client_flag": CLIENT.FOUND_ROWS,
            "connect_timeout": max(1, round(self.connect_timeout.total_seconds())),
            "init_command": self.init_command(),
        }

    def url(self, table: str) -> str:
        """The store's URL, password shown as ``***``."""
        user = self.user or ""
        if self.password:
            user += ":***"
        where = f"{user}@" if user else ""
        host = self.host if ":" not in self.host else f"[{self.host}]"
        query = f"?table={table}" if table != "oncely_inbox" else ""
        if self.unix_socket:
            query += ("&" if query else "?") + f"unix_socket={self.unix_socket}"
        return f"mysql://{where}{host}:{self.port}/{self.database}{query}"


@dataclass(frozen=True, slots=True, kw_only=True)
class MySQLOptions:
    """What a ``mysql://`` / ``mariadb://`` URL says."""

    settings: MySQLSettings
    table: str = "oncely_inbox"
    pool_size: int = 4
    read_timeout: timedelta | None = timedelta(seconds=10)
    migrate: bool = True


_KNOWN = (
    "table",
    "pool_size",
    "connect_timeout",
    "lock_timeout",
    "read_timeout",
    "migrate",
    "unix_socket",
)


def parse_url(url: str) -> MySQLOptions:
    """``mysql://user:password@host:3306/database`` (or ``mariadb://``), with the options
    ``table``, ``pool_size``, ``connect_timeout``, ``lock_timeout`` and ``read_timeout``
    (seconds; ``read_timeout=0``: no bound), ``migrate`` and ``unix_socket`` in the query
    string. Unknown options are refused."""
    parts = split(url)
    database = path_of(parts)
    if not database or "/" in database:
        raise ConfigurationError(
            f"{redact(url)}: name the database in the path: mysql://user@host:3306/database"
        )
    options = UrlOptions(url)
    lock = options.seconds("lock_timeout", timedelta(0))
    read = options.seconds("read_timeout", timedelta(seconds=10))
    found = MySQLOptions(
        settings=MySQLSettings(
            database=database,
            host=parts.hostname or "localhost",
            port=parts.port or 3306,
            user=unquote(parts.username) if parts.username else None,
            password=unquote(parts.password) if parts.password is not None else None,
            unix_socket=options.optional_text("unix_socket"),
            connect_timeout=options.seconds("connect_timeout", timedelta(seconds=10)),
            lock_timeout=lock if lock > timedelta(0) else None,
        ),
        table=options.text("table", "oncely_inbox"),
        pool_size=options.integer("pool_size", 4),
        read_timeout=read or None,
        migrate=options.boolean("migrate", True),
    )
    options.done(_KNOWN)
    if found.pool_size < 1:
        raise ConfigurationError(f"{redact(url)}: pool_size must be at least 1")
    if read < timedelta(0):
        raise ConfigurationError(f"{redact(url)}: read_timeout must be positive (0: no bound)")
    return found

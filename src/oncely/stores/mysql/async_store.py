"""The MariaDB / MySQL store: InnoDB tables shared by any number of processes and hosts, both
modes.

A new key is claimed with one statement, one round trip: ``INSERT ... ON DUPLICATE KEY
UPDATE`` on the ``(consumer, key)`` primary key, so InnoDB's unique check and row locks are
the arbiter (R8, R9). A duplicate costs a second round trip (the winner's row and the
server's time); only an expired record or a stale claim to take over costs a third, a
compare-and-set write. Every decision is made by :mod:`oncely._core.state` in Python on a row
version the write then insists on. The SQL is :mod:`oncely.stores.mysql.dialect`; the driver
differences (PyMySQL, aiomysql) are in :mod:`oncely.stores.mysql.async_io`.

:class:`AsyncMySQLStore` is one class, in four sections: construction and connections (the
pool, and running work on an autocommit connection with a bounded retry of deadlock victims,
:meth:`AsyncMySQLStore._run`, which every operation runs through); schema and maintenance
(the schema, ``forget``, the purge); the message path (the claim, the fenced writes); the
transactional mode (transactions opened for the caller, autocommit turned off on a pooled
connection for the block and on again for two-phase work; savepoints in a caller's
transaction, left in place, not released; checks and writes on a caller's connection, the
claim looked for before the commit; and ``claim_in``, which shares the claim's code). The
reads, the schema check and the purge's loop are :class:`~oncely.stores.async_sql.SQLStoreBase`'s;
the transaction block is a class of its own, in :mod:`oncely.stores.mysql.async_tx`.
"""

from __future__ import annotations

import hashlib
import itertools
import random
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from datetime import timedelta
from functools import partial
from typing import Any, Self, TypeVar

from oncely._core.clock import Clock
from oncely._core.records import (
    Claim,
    ClaimRequest,
    ClaimStatus,
    Completion,
    Record,
    Status,
    StoreStats,
)
from oncely._core.state import (
    DELETE,
    UNCHANGED,
    ClaimEvent,
    CompleteEvent,
    FailEvent,
    Lost,
    NewState,
    ReleaseEvent,
    RenewEvent,
    TakeoverEvent,
    apply_claim,
    apply_complete,
    apply_fail,
    apply_forget,
    apply_release,
    apply_renew,
    apply_takeover,
    claim_event,
)
from oncely._core.table import lease_lost
from oncely.errors import (
    ConfigurationError,
    LeaseLost,
    ResultTooLarge,
    StoreUnavailable,
    TransactionEnded,
    TransactionRequired,
)
from oncely.stores._compact import pack_token
from oncely.stores._offsets import OffsetSQL, check_position
from oncely.stores._sql import (
    LOGGER,
    MAX_CONSUMERS,
    Estimate,
    durability_warning,
    marker_missing,
    parse_versions,
)
from oncely.stores.async_protocols import complete_each
from oncely.stores.async_sql import Position, SQLStoreBase, server_time
from oncely.stores.mysql.async_io import (
    AsyncPool,
    Connection,
    close,
    closed,
    connect,
    disown,
    execute,
    fetchall,
    fetchall_unbounded,
    own,
    sleep,
    undoubted,
)
from oncely.stores.mysql.async_tx import _Transaction
from oncely.stores.mysql.dialect import (
    MAX_CONSUMER_BYTES,
    REVISION_NOTE,
    SCHEMA_REVISION,
    SCHEMA_VERSION,
    WIDTH,
    MySQLDialect,
    batch_rows,
    claim_params,
    parse_record,
    utf8,
    who,
    write_params,
)
from oncely.stores.mysql.errors import (
    DRIVER_ERRORS,
    NO_SUCH_TABLE,
    MySQLSettings,
    autocommits,
    code_of,
    disconnected,
    in_transaction,
    joinable,
    parse_url,
    retries_for,
    translate,
)

__all__ = ["AsyncMySQLStore"]

SWEEP_FROM_ROWS = 50_000
"""Below this many rows a purge always takes the purge index (either path is quick)."""
SWEEP_SHARE_COLD = 0.03
SWEEP_SHARE_WARM = 0.10
"""The expired share of the table past which a purge walks the table instead of the index,
when the table is larger than InnoDB's buffer pool and when it fits."""

T = TypeVar("T")
E = TypeVar("E")
R = TypeVar("R")

_BACKOFF_S = 0.005  # doubled per retry of a deadlock victim, jittered
# Numbers the stores of the process: each names its savepoints apart from the others'.
_STORES = itertools.count(1)
_ROUNDS = 8  # reads and compare-and-set writes before a key that keeps changing gives up
_BATCH = 500  # keys per multi-row statement of claim_many
# The operations whose statements are not cut at read_timeout: they may take long by nature
# (counts of the table, a page of a scan).
_UNBOUNDED = frozenset({"stats", "scan"})
# The bytes of a statement that writes a result kept for everything but the result: the SQL,
# the consumer and key (up to 2848 bytes, written in hex), token, fingerprint, times and note.
_STATEMENT_ROOM = 64 * 1024


_AUTOCOMMITTED = (
    "; the connection has autocommit on, so any statement run after the transaction ended "
    "was committed on its own: open it with autocommit off"
)


class AsyncMySQLStore(SQLStoreBase[str]):
    """A dedup store in a MariaDB (10.5+) or MySQL (8.0+) database, InnoDB tables (transactional
    and two-phase modes).

    Times come from the server's clock (``UTC_TIMESTAMP(3)``, read inside each statement), or
    from ``clock`` when one is given. The tables are created on first use unless
    ``migrate=False``, in which case missing tables raise :class:`~oncely.SchemaMissing`; a
    schema written by a newer oncely raises :class:`~oncely.SchemaTooNew`. At most
    ``pool_size`` connections are open at once; a connection the server closed (a restart) is
    dropped, and the next call connects again. Deadlocks and lock wait timeouts of oncely's
    own autocommit statements are retried a few times before
    :class:`~oncely.StoreUnavailable`; inside a transaction they are reported at once (InnoDB
    rolled the transaction, or the statement, back).

    ``connect_timeout`` bounds a connection attempt, its handshake included. ``read_timeout``
    (10 s; None: no bound) bounds the wait for the answer to each statement the store runs on
    its own connections outside a transaction (the message path: claims, completions,
    renewals, releases, reads, the purge's batches; not ``stats()`` and ``scan()``, which may
    take long by nature): past it the connection is closed and the call raises
    :class:`~oncely.StoreUnavailable`, so a server gone silent (a dead route: no reset, no
    refusal) never holds a caller, a thread above all, for longer than ``read_timeout`` per
    statement plus ``connect_timeout`` per connection it opens. Statements inside a
    transaction (the transactional mode, ``tx=``) are not cut: one may wait on another
    transaction's row lock up to ``innodb_lock_wait_timeout`` (``lock_timeout``). The store's
    TCP connections also get keepalives (a dead peer found in about 30 s, not the system's
    two hours; see ``_KEEPALIVES`` in :mod:`oncely.stores.mysql.async_io`).

    Transactional mode: :meth:`transaction` yields one of the store's connections (PyMySQL /
    aiomysql) with autocommit off (``SET autocommit = 0`` where ``BEGIN`` would be, and
    ``SET autocommit = 1``, which commits, where ``COMMIT`` would be: no extra round trip),
    so a statement run after InnoDB rolled the transaction back (a deadlock a handler caught)
    opens a new transaction rather than committing on its own; before the commit the claim
    is looked for (:meth:`held_in`, where an error or a COMMIT may have ended the transaction,
    or the write of the result) and, gone,
    :class:`~oncely.TransactionEnded` rolls the rest back. :meth:`claim_in` joins any
    connection of yours to the same database that is inside a transaction (after ``BEGIN``,
    or with autocommit off), as the driver's last server status says. Joining sets the
    session's ``LAST_INSERT_ID()`` (the claim reads the server's clock through it): read an
    id you inserted before joining from ``cursor.lastrowid``, or before the claim.

    The asyncio variant belongs to the event loop that first uses it: open one store per
    loop. The threaded variant may be shared by any number of threads. After ``fork`` a child
    opens connections of its own; never fork in the middle of a transaction.
    """

    _family = "mysql"

    _SCHEMA_VERSION = SCHEMA_VERSION
    _SCHEMA_REVISION = SCHEMA_REVISION
    _REVISION_NOTE = REVISION_NOTE
    _dialect: MySQLDialect

    # ------------------------------------------------------------ construction and connections

    def __init__(
        self,
        database: str,
        *,
        host: str = "localhost",
        port: int = 3306,
        user: str | None = None,
        password: str | None = None,
        unix_socket: str | None = None,
        table: str = "oncely_inbox",
        pool_size: int = 4,
        connect_timeout: timedelta = timedelta(seconds=10),
        lock_timeout: timedelta | None = None,
        read_timeout: timedelta | None = timedelta(seconds=10),
        clock: Clock | None = None,
        migrate: bool = True,
    ) -> None:
        super().__init__(migrate=migrate)
        if pool_size < 1:
            raise ValueError("pool_size must be at least 1")
        if read_timeout is not None and read_timeout <= timedelta(0):
            raise ConfigurationError("read_timeout must be positive (None: no bound)")
        self._read_seconds = None if read_timeout is None else read_timeout.total_seconds()
        self._settings = MySQLSettings(
            database=database,
            host=host,
            port=port,
            user=user,
            password=password,
            unix_socket=unix_socket,
            connect_timeout=connect_timeout,
            lock_timeout=lock_timeout,
        )
        self._dialect = MySQLDialect(table, server_clock=clock is None)
        self._offset_sql = OffsetSQL.mysql(table, MAX_CONSUMER_BYTES)
        self._now = clock.now_ms if clock is not None else server_time
        self._pool = AsyncPool(self._open, pool_size)
        # The transactional mode's savepoints (savepoint, below): how many of this store's
        # savepoint blocks are open on each caller connection, and the prefix of their names.
        self._depth: weakref.WeakKeyDictionary[Connection, int] = weakref.WeakKeyDictionary()
        self._savepoint_prefix = f"oncely_{next(_STORES)}_"
        # The server's max_allowed_packet: the smallest any of the store's connections was
        # opened with (a session copies the global value when it connects, and cannot change
        # it), and each connection's own, a caller's read on its first stored result.
        self._packet: int | None = None
        self._room: tuple[int, str] | None = None  # result_room's answer, made once per change
        self._packets: weakref.WeakKeyDictionary[Connection, int] = weakref.WeakKeyDictionary()

    @classmethod
    def from_url(cls, url: str, *, clock: Clock | None = None) -> Self:
        """A store for a ``mysql://`` or ``mariadb://`` URL (see :func:`oncely.open`)."""
        options = parse_url(url)
        s = options.settings
        return cls(
            s.database,
            host=s.host,
            port=s.port,
            user=s.user,
            password=s.password,
            unix_socket=s.unix_socket,
            table=options.table,
            pool_size=options.pool_size,
            connect_timeout=s.connect_timeout,
            lock_timeout=s.lock_timeout,
            read_timeout=options.read_timeout,
            clock=clock,
            migrate=options.migrate,
        )

    @property
    def url(self) -> str:
        return self._settings.url(self._dialect.table)

    @property
    def table(self) -> str:
        return self._dialect.table

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"

    @property
    def _place(self) -> str:
        return f"table {self._dialect.table} in {self.url}"

    async def _open(self) -> Connection:
        try:
            conn = await connect(self._settings)
        except DRIVER_ERRORS as exc:
            raise translate(exc, f"connecting to {self.url}") from exc
        try:
            await self._packet_of(conn)
        except BaseException:
            await close(conn)
            raise
        return conn

    async def _packet_of(self, conn: Connection, *, joined: bool = False) -> int:
        """``conn``'s session ``max_allowed_packet``, read once per connection: the largest
        statement the server takes on it. A larger one is refused, and MariaDB and MySQL
        answer it by dropping the connection ("server has gone away")."""
        packet = self._packets.get(conn)
        if packet is None:
            try:
                rows = await fetchall(conn, "SELECT @@SESSION.max_allowed_packet")
            except DRIVER_ERRORS as exc:
                raise translate(exc, "reading max_allowed_packet", joined=joined) from exc
            packet = int(rows[0][0])
            self._packets[conn] = packet
            if self._packet is None or packet < self._packet:
                self._packet = packet
                self._room = (
                    max(0, (packet - _STATEMENT_ROOM) // 2),
                    f"the server's max_allowed_packet is {packet} bytes, and a result goes as "
                    "hex, twice its size",
                )
        return packet

    def result_room(self) -> tuple[int, str] | None:
        """The most bytes an encoded result may have for this store to keep it, and why;
        None before the first connection. A result is sent in hex (two characters a byte)
        within one statement, which the server's ``max_allowed_packet`` bounds: a result over
        this is completed without it (as one over ``Limits.max_result_bytes``), not sent to
        be refused after the handler ran."""
        return self._room

    async def _acquire(self) -> Connection:
        if self._closed:
            raise self._closed_error()
        if not self._ready:
            await self._prepare()
        conn = await self._pool.acquire()
        own(conn, self._read_seconds)
        return conn

    async def _release(self, conn: Connection, *, discard: bool = False) -> None:
        """Return a connection, rolling back anything an interrupted operation left open. One
        a handler turned autocommit off on is dropped: oncely's own writes on it would wait
        for a COMMIT that never comes."""
        disown(conn)
        if closed(conn) or not autocommits(conn):  # closed: a lock's release failed on it
            discard = True
        if not discard and in_transaction(conn):
            try:
                await execute(conn, "ROLLBACK")
            except DRIVER_ERRORS:
                discard = True
        await self._pool.release(conn, discard=discard)

    async def _run(self, op: str, work: Callable[[Connection], Awaitable[T]]) -> T:
        """``work`` on a pooled autocommit connection. A deadlock victim or a lock wait
        timeout was rolled back whole by InnoDB, so the work is run again (a bounded number
        of times); any other driver error is translated at once."""
        conn = await self._acquire()
        discard = False
        try:
            tries = 0
            while True:
                try:
                    return await work(conn)
                except DRIVER_ERRORS as exc:
                    tries += 1
                    if tries <= retries_for(exc):
                        await sleep(_BACKOFF_S * 2**tries * random.random())
                        continue
                    discard = disconnected(exc)
                    raise translate(exc, op) from exc
        finally:
            await self._release(conn, discard=discard)

    async def _rows(self, op: str, sql: str, params: Mapping[str, object]) -> list[Any]:
        """One statement on a pooled connection; for ``stats`` and ``scan``, which may take
        long by nature, as long as it takes (not cut at ``read_timeout``)."""
        run = fetchall_unbounded if op in _UNBOUNDED else fetchall
        return await self._run(op, lambda conn: run(conn, sql, params))

    async def _create_offsets(self) -> None:
        create = self._offset_sql.create
        await self._run("creating the offsets table", lambda conn: execute(conn, create))

    async def aclose(self) -> None:
        self._closed = True
        await self._pool.close()

    # ------------------------------------------------------------ schema and maintenance

    async def _setup(self, *, migrating: bool) -> None:
        conn = await self._pool.acquire()
        try:
            version, revision = await self._read_versions(conn)
            found = (await fetchall(conn, "SELECT @@innodb_flush_log_at_trx_commit"))[0]
            durability_warning(self.url, {"innodb_flush_log_at_trx_commit": found[0]})
            if version is None or migrating or revision < self._SCHEMA_REVISION:
                # A creation or an upgrade: one process at a time (see _creating), which reads
                # the versions again in the lock. Two upgrades at once would both find the
                # purge column missing, and the second ALTER TABLE fail on a duplicate.
                async with self._creating(conn):
                    await self._setup_with(conn, *await self._versions(conn), migrating)
            else:
                await self._setup_with(conn, version, revision, migrating)
        finally:
            await self._release(conn)

    async def _setup_with(
        self, conn: Connection, version: int | None, revision: int, migrating: bool
    ) -> None:
        # migrate runs the CREATE ... IF NOT EXISTS again whatever the version: the
        # version row says nothing of the inbox table itself.
        if (
            self._tables_needed(version, migrating=migrating)
            or migrating
            or self._upgrade_needed(revision, migrating=migrating)
        ):
            await self._create(conn)

    @asynccontextmanager
    async def _creating(self, conn: Connection) -> AsyncIterator[None]:
        """A named lock (GET_LOCK) held while the tables are created or upgraded. Each
        CREATE TABLE commits at once, so another process's creation shows its inbox table
        before the version row: read in this lock, the row of a creation is there (and a
        table without one was left so); an upgrade's ALTER TABLEs, each checked first, run
        one process at a time."""
        table = f"{self._settings.database}.{self._dialect.table}".encode()
        name = {"name": "oncely-schema-" + hashlib.sha256(table).hexdigest()[:40]}
        try:
            (held,) = (await fetchall(conn, "SELECT GET_LOCK(%(name)s, 60)", name))[0]
        except DRIVER_ERRORS as exc:
            raise translate(exc, "creating the tables") from exc
        if held != 1:
            raise StoreUnavailable(
                f"another process has been creating or upgrading the {self._place} for a "
                "minute; retry"
            )
        try:
            yield
        finally:
            await self._unlock(conn, name, "the schema's lock")

    async def _unlock(self, conn: Connection, name: Mapping[str, object], what: str) -> None:
        """Let go of a named lock (GET_LOCK). When RELEASE_LOCK fails the session may still
        hold it, and a pooled connection lent out again would keep it for as long as it lives
        (another process would never lead, nor migrate): the connection is closed instead,
        which ends the session and the lock with it (:meth:`_release` then drops it from the
        pool). As the PostgreSQL store's advisory locks."""
        try:
            await fetchall(conn, "SELECT RELEASE_LOCK(%(name)s)", name)
        except BaseException as exc:
            await close(conn)
            if not isinstance(exc, DRIVER_ERRORS):
                raise
            LOGGER.warning(
                "oncely store %s: releasing %s failed, its connection was closed to let go "
                "of it: %s", self.url, what, exc,
            )  # fmt: skip

    async def _read_versions(self, conn: Connection) -> tuple[int | None, int]:
        """The schema version (None: no tables) and revision (1 where none is written), the
        table's marker missing or not: no error for that yet."""
        try:
            return parse_versions(await fetchall(conn, self._dialect.read_version), self._place)
        except DRIVER_ERRORS as exc:
            if code_of(exc) == NO_SUCH_TABLE:
                return None, 1
            raise translate(exc, "reading the schema version") from exc

    async def _versions(self, conn: Connection) -> tuple[int | None, int]:
        """:meth:`_read_versions`; an inbox table without its version row is a
        :class:`~oncely.SchemaError`. Called in :meth:`_creating` where a creation may be
        under way."""
        versions = await self._read_versions(conn)
        if versions[0] is not None:
            return versions
        try:
            exists = bool(await fetchall(conn, self._dialect.table_exists))
        except DRIVER_ERRORS as exc:
            raise translate(exc, "reading the schema version") from exc
        if exists:
            raise marker_missing(
                self._place, self._dialect.meta_table, self._SCHEMA_VERSION,
                "; a table left empty by a first `oncely migrate` that was interrupted (its "
                "CREATE TABLE commits at once) can simply be dropped",
            )  # fmt: skip
        return versions

    async def _version(self, conn: Connection) -> int | None:
        version = (await self._read_versions(conn))[0]
        if version is not None:
            return version
        async with self._creating(conn):
            return (await self._versions(conn))[0]

    async def _create(self, conn: Connection) -> None:
        # CREATE TABLE IF NOT EXISTS and the upsert of the version row are safe when several
        # processes migrate at once: the data dictionary lock orders them.
        d = self._dialect
        try:
            for statement in d.create:
                await execute(conn, statement)
            # Revisions 2 and 3 on a table an older oncely created (online, see the dialect).
            found = await fetchall(conn, d.columns, {"table": d.table})
            if not found:
                await execute(conn, d.add_purge_column)
            indexed = [str(c).lower() for (c,) in await fetchall(
                conn, d.purge_index_columns, {"table": d.table}
            )]  # fmt: skip
            if not indexed:
                await execute(conn, d.add_purge_index)
            elif indexed != ["purge_ms", "created_ms"]:
                await execute(conn, d.rebuild_purge_index)
            await execute(conn, d.set_version)  # revision 3: rows keep their text forms
            await execute(conn, d.set_revision)
        except DRIVER_ERRORS as exc:
            raise translate(exc, "creating the tables") from exc

    async def schema_version(self) -> int | None:
        """The schema version in the database, or None when there are no tables yet."""
        conn = await self._open()
        try:
            return await self._version(conn)
        finally:
            await close(conn)

    async def schema_revision(self) -> int:
        """The schema revision in the database (1 where none is written, or no tables yet):
        what ``oncely migrate`` reports it upgraded within one schema version."""
        conn = await self._open()
        try:
            return (await self._read_versions(conn))[1]
        finally:
            await close(conn)

    async def forget(self, consumer: str, key: str) -> bool:
        # No DELETE ... RETURNING in MySQL: the affected row count tells.
        params = who(consumer, key)
        found = await self._run("forget", lambda conn: execute(conn, self._dialect.forget, params))
        return found[0] > 0

    @asynccontextmanager
    async def purge_leader(self) -> AsyncIterator[bool]:
        # A named lock (GET_LOCK) on a connection of its own, held for the lead: the server
        # frees it when the connection ends, also when the process dies. Names are at most
        # 64 characters: the table's name is hashed into it.
        table = f"{self._settings.database}.{self._dialect.table}".encode()
        name = {"name": "oncely-purge-" + hashlib.sha256(table).hexdigest()[:40]}
        conn = await self._open()
        try:
            try:
                (held,) = (await fetchall(conn, "SELECT GET_LOCK(%(name)s, 0)", name))[0]
            except DRIVER_ERRORS as exc:
                raise translate(exc, "the purge's lead") from exc
            try:
                yield held == 1
            finally:
                if held == 1:
                    await self._unlock(conn, name, "the purge's lead")
        finally:
            await close(conn)

    async def _purge_batch(
        self, after: Position | None, limit: int, pause: float
    ) -> tuple[int, int, Position | None]:
        return await self._run("purge", partial(self._purge_keys, after=after, limit=limit))

    async def _purge_keys(
        self, conn: Connection, after: Position | None, limit: int
    ) -> tuple[int, int, Position | None]:
        # A run takes one of two paths, chosen at its first batch and carried in the
        # position: the purge index (cost: what expired, one random row read each) or, when
        # a large share of the table expired, a walk of the clustered index in order (cost:
        # the table, read sequentially). The candidates of either are read without locks,
        # then the expired ones deleted by key, still expired, in one short statement.
        if after is None:
            path = await self._purge_path(conn)
            cursor: tuple[object, ...] = ()
        else:
            path, cursor = str(after[0]), after[1:]
        now = self._now()
        d = self._dialect
        params: dict[str, Any] = {"now": now, "limit": limit}
        if path == "sweep":
            if cursor:
                params["c"], params["k"] = cursor
            found = await fetchall(conn, d.purge_sweep(bool(cursor)), params)
            if not found:
                return 0, 0, None
            deleted = await self._purge_found(conn, [(c, k) for c, k in found], now, move=False)
            return len(found), deleted, ("sweep", found[-1][0], found[-1][1])
        # The index: the minutes that ended first (the index alone), then the current
        # minute's expired rows; past where the last batch ended (see purge_candidates). The
        # rows left behind their expiry are moved to its minute, past this run's range.
        if cursor:
            params["p"], params["t"], params["c"], params["k"] = cursor
        rows = await fetchall(conn, d.purge_candidates(ended=True, after=bool(cursor)), params)
        if len(rows) < limit:
            params["limit"] = limit - len(rows)
            rows += await fetchall(
                conn, d.purge_candidates(ended=False, after=bool(cursor)), params
            )
        if not rows:
            return 0, 0, None
        deleted = await self._purge_found(conn, [(c, k) for c, k, _, _ in rows], now, move=True)
        last = rows[-1]
        return len(rows), deleted, ("index", last[2], last[3], last[0], last[1])

    async def _purge_found(
        self, conn: Connection, keys: list[tuple[Any, Any]], now: int | None, *, move: bool
    ) -> int:
        d = self._dialect
        params: dict[str, Any] = {"now": now}
        for i, (consumer, key) in enumerate(keys):
            params[f"c{i}"], params[f"k{i}"] = consumer, key
        deleted = int((await execute(conn, d.purge_delete(len(keys)), params))[0])
        if move and deleted < len(keys):
            await execute(conn, d.purge_move(len(keys)), params)
        return deleted

    async def _purge_path(self, conn: Connection) -> str:
        """``"sweep"`` when the minutes up to now hold more than a share of the table's rows
        that makes one sequential walk cheaper than a random read per expired row: 3% when
        the table is larger than the buffer pool (measured at 10^6 rows, 128 MB pool: a walk
        4.4 us per row, a random read 134 us), 10% when it fits (45 us); else ``"index"``.
        Its counts may take long on a large table: they are not cut at ``read_timeout``."""
        d = self._dialect
        share = partial(fetchall_unbounded, conn, d.purge_share)
        info = await share({"now": self._now(), "table": d.table, "cap": 0})
        if not info or info[0][0] is None or int(info[0][0]) < SWEEP_FROM_ROWS:
            return "index"
        rows, size, pool = int(info[0][0]), int(info[0][1] or 0), int(info[0][2] or 0)
        cap = int(rows * (SWEEP_SHARE_COLD if size > pool else SWEEP_SHARE_WARM)) + 1
        counted = await share({"now": self._now(), "table": d.table, "cap": cap})
        return "sweep" if counted and int(counted[0][3]) >= cap else "index"

    async def _estimate(self) -> StoreStats:
        # InnoDB's row estimate and the expired counted up to SMALL + 1; the consumers one
        # descent each, each counted up to SMALL + 1; the rest split by a sample of minutes.
        d = self._dialect
        now, cur, table_rows, expired = (
            await self._rows("stats", d.estimate_table, {"now": self._now(), "table": d.table})
        )[0]
        found = Estimate(expired=int(expired))
        rows = await self._rows("stats", d.first_consumer, {})
        while rows and rows[0][0] is not None and len(found.seen) < MAX_CONSUMERS:
            raw = bytes(rows[0][0])
            seen, live = (
                await self._rows("stats", d.count_consumer, {"now": now, "consumer": raw})
            )[0]
            found.seen[raw.decode("utf-8")] = (int(seen), int(live))
            rows = await self._rows("stats", d.next_consumer, {"after": raw})
        return await self._split_rest(found, int(table_rows or 0), int(cur), d)

    # ------------------------------------------------------------ the message path

    async def claim(
        self,
        consumer: str,
        key: str,
        *,
        fingerprint: str | None,
        token: str,
        lease_ms: int,
        keep_ms: int,
        takeover: bool,
    ) -> Claim:
        event = claim_event(consumer, key, fingerprint, token, lease_ms, keep_ms, takeover)
        return await self._run("claim", lambda conn: self._claim(conn, event, False))

    async def _claim(self, conn: Connection, ev: ClaimEvent, joined: bool) -> Claim:
        dialect = self._dialect
        params = claim_params(ev)
        read = dialect.read_locked if joined else dialect.read
        for _ in range(_ROUNDS):
            params["now"] = self._now()
            inserted = (await execute(conn, dialect.insert, params))[1]
            if joined and not in_transaction(conn):
                await self._outside_transaction(conn, params, inserted)
            if inserted:  # the OK packet carries now + 1 from the insert branch, else 0
                return apply_claim(None, ev, inserted - 1)[1]
            rows = await fetchall(conn, read, params)
            if not rows:
                continue  # the winner's record vanished (released): claim again
            current = parse_record(ev.consumer, ev.key, rows[0])
            if current.token == ev.token:  # ours after all (a proxy that drops the insert id)
                return Claim(ClaimStatus.NEW, current, current.created_ms)
            new, claim = apply_claim(current, ev, int(rows[0][WIDTH]))
            if new is UNCHANGED or await self._write(conn, params, current, new):
                return claim
            # Another claim changed the record between the read and the write: look again.
        raise StoreUnavailable(f"claim of key {ev.key!r} kept racing with other claims; retry")

    async def _outside_transaction(
        self, conn: Connection, params: dict[str, Any], inserted: int
    ) -> None:
        # The driver said a transaction was open, the server's answer to the INSERT says the
        # statement autocommitted: the caller's transaction had ended (a deadlock rolls it
        # back with an error the caller may have swallowed). A marker committed without the
        # business writes would turn their redelivery into a duplicate: take it back.
        if inserted:
            await execute(conn, self._dialect.forget_token, params)
        raise TransactionRequired(
            "the connection's transaction had ended before the claim (rolled back by the "
            "server, or committed): begin a new transaction and handle the message again"
        )

    async def _write(
        self, conn: Connection, names: dict[str, Any], seen: Record, new: NewState
    ) -> bool:
        """Replace (or delete) the row only while it is still the version ``seen``."""
        if new is DELETE:
            values = write_params(names, seen, None)
            return (await execute(conn, self._dialect.delete, values))[0] > 0
        assert isinstance(new, Record)
        values = write_params(names, seen, new)
        return (await execute(conn, self._dialect.write, values))[0] > 0

    async def claim_many(
        self,
        consumer: str,
        requests: Sequence[ClaimRequest],
        *,
        lease_ms: int,
        keep_ms: int,
        takeover: bool,
    ) -> list[Claim]:
        if not requests:
            return []
        events = [
            claim_event(consumer, r.key, r.fingerprint, r.token, lease_ms, keep_ms, takeover)
            for r in requests
        ]
        return await self._run("claim_many", lambda conn: self._claim_many(conn, events))

    async def _claim_many(self, conn: Connection, events: list[ClaimEvent]) -> list[Claim]:
        claims: list[Claim] = []
        for start in range(0, len(events), _BATCH):
            claims.extend(await self._claim_batch(conn, events[start : start + _BATCH]))
        return claims

    async def _claim_batch(self, conn: Connection, events: list[ClaimEvent]) -> list[Claim]:
        # One multi-row insert-if-absent; when its OK packet says every key went in, the
        # records are built here from what was sent (one round trip). Otherwise one read of
        # every row follows: a row carrying the request's token is the one it inserted
        # (tokens are unique), so the answers do not depend on affected-row counts.
        first, rows = batch_rows(events)
        ev0 = events[0]
        consumer = utf8(ev0.consumer, "consumer", MAX_CONSUMER_BYTES)
        lease, span = ev0.lease_ms, max(ev0.keep_ms, ev0.lease_ms)
        now = self._now()
        sql = self._dialect.claim_many_insert(consumer, rows, lease, span, now)
        inserted = (await execute(conn, sql))[1]
        if inserted:  # now + 1: every key was absent and holds the row sent for it
            return self._all_new(events, first, inserted - 1, lease, span)
        found = await fetchall(conn, self._dialect.claim_many_read(consumer, rows, now))
        held: dict[str, Record | None] = dict.fromkeys(first)
        read_at = 0
        for row in found:
            key = bytes(row[0]).decode("utf-8")
            held[key] = parse_record(ev0.consumer, key, row[1:])
            read_at = int(row[1 + WIDTH])
        claims: list[Claim] = []
        for i, ev in enumerate(events):
            current = held[ev.key]
            if current is not None and first[ev.key] == i and current.token == ev.token:
                claim = Claim(ClaimStatus.NEW, current, current.created_ms)
            elif current is None:  # released or forgotten between the two statements
                claim = await self._claim(conn, ev, False)
            else:
                new, claim = apply_claim(current, ev, read_at)
                names = {"consumer": consumer, "key": ev.key.encode("utf-8")}
                if new is not UNCHANGED and not await self._write(conn, names, current, new):
                    claim = await self._claim(conn, ev, False)
            held[ev.key] = claim.record
            claims.append(claim)
        return claims

    @staticmethod
    def _all_new(
        events: list[ClaimEvent], first: dict[str, int], now: int, lease: int, span: int
    ) -> list[Claim]:
        """The answers when every key of the batch was inserted by its first request: NEW
        with the row as sent, and EXISTING (that row) for a key the batch repeats."""
        claims: list[Claim] = []
        won: dict[str, Record] = {}
        for i, ev in enumerate(events):
            if first[ev.key] != i:
                claims.append(Claim(ClaimStatus.EXISTING, won[ev.key], now))
                continue
            record = Record(
                ev.consumer, ev.key, Status.IN_PROGRESS, ev.fingerprint, ev.token, 1,
                now, now, now + lease, now + span,
            )  # fmt: skip
            won[ev.key] = record
            claims.append(Claim(ClaimStatus.NEW, record, now))
        return claims

    async def takeover(
        self,
        consumer: str,
        key: str,
        *,
        expected_token: str,
        fingerprint: str | None,
        token: str,
        lease_ms: int,
        keep_ms: int,
    ) -> Claim:
        ev = claim_event(consumer, key, fingerprint, token, lease_ms, keep_ms, False)
        event = TakeoverEvent(ev, expected_token)
        return await self._run("takeover", lambda conn: self._takeover(conn, event))

    async def _takeover(self, conn: Connection, event: TakeoverEvent) -> Claim:
        ev = event.claim
        params = claim_params(ev)
        for _ in range(_ROUNDS):
            params["now"] = self._now()
            rows = await fetchall(conn, self._dialect.read, params)
            if not rows:
                break
            current = parse_record(ev.consumer, ev.key, rows[0])
            now = int(rows[0][WIDTH])
            if current.is_expired(now):
                break
            new, claim = apply_takeover(current, event, now)
            if new is UNCHANGED or await self._write(conn, params, current, new):
                return claim
        else:
            raise StoreUnavailable(f"takeover of key {ev.key!r} kept racing; retry later")
        # Absent (or expired): the reconciler's decision is moot, claim afresh.
        return await self._claim(conn, ev, False)

    async def _fenced(
        self,
        conn: Connection,
        op: str,
        consumer: str,
        key: str,
        apply: Callable[[Record | None, E, int], tuple[NewState, R | Lost]],
        event: E,
    ) -> R:
        """Read the row, let the state table decide, write with a compare-and-set; raise
        :class:`~oncely.LeaseLost` (changing nothing) when the table says Lost."""
        names = who(consumer, key)
        for _ in range(_ROUNDS):
            names["now"] = self._now()
            rows = await fetchall(conn, self._dialect.read, names)
            current = parse_record(consumer, key, rows[0]) if rows else None
            # An absent record's answer does not depend on the time.
            now = int(rows[0][WIDTH]) if rows else 0
            new, answer = apply(current, event, now)
            if isinstance(answer, Lost):
                raise lease_lost(op, consumer, key, answer)
            if new is UNCHANGED or (
                current is not None and await self._write(conn, names, current, new)
            ):
                return answer
        raise StoreUnavailable(f"{op} of key {key!r} kept racing with other writers; retry")

    async def complete(
        self,
        consumer: str,
        key: str,
        *,
        token: str,
        result: bytes | None,
        keep_ms: int,
        note: str | None = None,
    ) -> Record:
        event = CompleteEvent(token, result, keep_ms, note)
        return await self._run(
            "complete",
            lambda conn: self._fenced(conn, "complete", consumer, key, apply_complete, event),
        )

    async def complete_many(
        self, consumer: str, completions: Sequence[Completion], *, keep_ms: int
    ) -> list[Record | LeaseLost]:
        """One completion after the other (one round trip each)."""
        return await complete_each(self, consumer, completions, keep_ms=keep_ms)

    async def fail(
        self, consumer: str, key: str, *, token: str, error: str, keep_ms: int
    ) -> Record:
        event = FailEvent(token, error, keep_ms)
        return await self._run(
            "fail", lambda conn: self._fenced(conn, "fail", consumer, key, apply_fail, event)
        )

    async def renew(
        self, consumer: str, key: str, *, token: str, lease_ms: int, keep_ms: int
    ) -> Record:
        event = RenewEvent(token, lease_ms, keep_ms)
        return await self._run(
            "renew", lambda conn: self._fenced(conn, "renew", consumer, key, apply_renew, event)
        )

    async def release(self, consumer: str, key: str, *, token: str) -> bool:
        event = ReleaseEvent(token)
        return await self._run(
            "release",
            lambda conn: self._fenced(conn, "release", consumer, key, apply_release, event),
        )

    async def forget_by_token(self, consumer: str, key: str, *, token: str) -> bool:
        event = ReleaseEvent(token)
        return await self._run(
            "forget",
            lambda conn: self._fenced(conn, "forget", consumer, key, apply_forget, event),
        )

    # ------------------------------------------------------------ transactional mode (R7)

    def transaction(self, *, claim_first: bool = False) -> _Transaction:
        # PyMySQL cannot send BEGIN with the claim in one round trip: claim_first changes
        # nothing here.
        return _Transaction(self)

    @asynccontextmanager
    async def savepoint(self, tx: Connection) -> AsyncIterator[None]:
        """A savepoint around the block: rolled back to when it raises; left in place when it
        succeeds (no RELEASE round trip).

        MariaDB and MySQL replace a savepoint by a new one of the same name, and a left one
        costs nothing but its entry in the transaction's list, so the name is the store's
        and the number of its blocks open on ``tx`` around this one: the next message's
        savepoint replaces it (the list stays as long as the deepest nesting), while a block
        open around this one keeps its own name, which a rollback to it still finds (and the
        rollback drops every savepoint set after it). The transaction's end drops them all.
        """
        depth = self._depth.get(tx, 0)
        name = f"{self._savepoint_prefix}{depth}"
        await self._joined(tx, f"SAVEPOINT {name}", "savepoint")
        self._depth[tx] = depth + 1
        try:
            yield
        except BaseException as exc:
            try:
                await self._joined(
                    tx, f"ROLLBACK TO SAVEPOINT {name}", "rolling back to a savepoint"
                )
            except StoreUnavailable:
                if isinstance(exc, TransactionEnded):
                    raise exc from None  # the savepoint went with the transaction, as it says
                raise
            raise
        finally:
            self._depth[tx] = depth

    async def _joined(
        self, tx: Connection, sql: str, op: str, params: dict[str, Any] | None = None
    ) -> None:
        try:
            await execute(tx, sql, params)
        except DRIVER_ERRORS as exc:
            raise translate(exc, op, joined=True) from exc

    def in_transaction(self, tx: Connection) -> bool:
        """Whether ``tx`` is inside a transaction now (not merely able to start one)."""
        return in_transaction(tx)

    async def _fetch_on(self, conn: Connection, sql: str) -> list[Any]:
        try:
            return await fetchall(conn, sql)
        except DRIVER_ERRORS as exc:
            raise translate(exc, "reading which database the connection is on") from exc

    def check_transaction(self, tx: Connection) -> None:
        if not joinable(tx):
            raise TransactionRequired(
                "the connection has no open transaction: run BEGIN (conn.begin()) first or "
                "turn autocommit off, or call without tx= to let oncely open and commit one"
            )

    async def set_result_in(
        self, tx: Connection, consumer: str, key: str, *, token: str, result: bytes | None
    ) -> None:
        if result is not None:
            # A caller's connection may be older than the store's, opened with another value.
            packet = await self._packet_of(tx, joined=True)
            if 2 * len(result) + _STATEMENT_ROOM > packet:
                raise ResultTooLarge(
                    f"result not stored: {len(result)} bytes is over what this connection's "
                    f"max_allowed_packet of {packet} bytes takes (a result goes as hex, twice "
                    "its size)"
                )
        params = who(consumer, key)
        params.update(token=pack_token(token), result=result)
        try:
            matched = (await execute(tx, self._dialect.set_result, params))[0]
        except DRIVER_ERRORS as exc:
            raise translate(exc, "storing the result", joined=True) from exc
        if not matched:  # no row, or (a caller's connection without CLIENT_FOUND_ROWS) same bytes
            await self.held_in(tx, consumer, key, token=token)

    async def held_in(self, tx: Connection, consumer: str, key: str, *, token: str) -> None:
        """Raise :class:`~oncely.TransactionEnded` unless the marker :meth:`claim_in` wrote on
        ``tx`` is still there, seen from ``tx``.

        InnoDB rolls a deadlock victim's whole transaction back, the claim with it, and goes
        on: a handler that caught the error (or retried its statement, as the error's text
        invites) returns normally, and the next statements open a new transaction. Committed
        as it stands, that would be the handler's later writes without the marker, or no
        marker at all while the outcome said processed: a message acked whose effects were
        rolled back. PostgreSQL refuses every statement after such an error instead, and
        SQLite has no deadlock, so only this store needs the look. On the store's own
        connection (its own transaction) it is made only when something that may have ended
        the transaction happened on it since it began (an error the server answered, a
        COMMIT, ROLLBACK, BEGIN or SET: see ``_Watched`` in
        :mod:`oncely.stores.mysql.async_io`), so the usual message costs no round trip for
        it; on a caller's connection it is one SELECT.
        """
        if undoubted(tx):
            return  # the store's own, and nothing since BEGIN can have ended its transaction
        params = who(consumer, key)
        params["token"] = pack_token(token)
        try:
            rows = await fetchall(tx, self._dialect.held, params)
        except DRIVER_ERRORS as exc:
            raise translate(exc, "checking the claim", joined=True) from exc
        if not rows:
            raise TransactionEnded(
                "the transaction that held the key's claim ended inside the handler (the "
                "server rolled it back, a deadlock the handler caught, or the handler ended "
                "it): nothing of this message is committed with the marker; handle it again "
                "in a new transaction (a handler lets a deadlock error propagate)"
                + self.ended_note(tx)
            )

    def ended_note(self, tx: Connection) -> str:
        """What to add to a :class:`~oncely.TransactionEnded` about ``tx``: on a connection
        with autocommit on (a caller's, after ``BEGIN``), a statement run after the
        transaction ended committed on its own, which nothing can take back."""
        return _AUTOCOMMITTED if autocommits(tx) else ""

    async def save_offset_in(
        self, tx: Connection, consumer: str, stream: str, part: int, next_offset: int
    ) -> None:
        """Keep ``next_offset`` as the offset to read next of ``stream``'s partition ``part``,
        in ``tx`` (it never moves back). :meth:`offsets` reads it."""
        check_position(stream, part, next_offset, consumer=consumer)
        utf8(consumer, "consumer", MAX_CONSUMER_BYTES)
        o = self._offset_sql
        params = o.params(consumer, stream, part=part, next=next_offset)
        await self._joined(tx, o.save, "storing the offset", params)

    async def claim_in(
        self,
        tx: Connection,
        consumer: str,
        key: str,
        *,
        fingerprint: str | None,
        token: str,
        keep_ms: int,
        takeover: bool,
        initial: Status = Status.COMPLETED,
        error: str | None = None,
    ) -> Claim:
        if not self._ready:
            await self._prepare()
        event = claim_event(consumer, key, fingerprint, token, 0, keep_ms, takeover, initial, error)
        try:
            return await self._claim(tx, event, True)
        except DRIVER_ERRORS as exc:
            raise translate(exc, "claim", joined=True) from exc

"""What the three SQL stores (SQLite, PostgreSQL, MariaDB / MySQL) share, written once.

:class:`SQLStoreBase` holds the parts of the store contract whose logic is the same in each,
whatever the driver: the schema check on first use and :meth:`~SQLStoreBase.migrate` (when to
create the tables, when to refuse), the reads (``get``, ``scan``, ``stats``), ``forget`` and
the batch loop of ``purge_expired``. A store gives it:

* ``_dialect``, whose statements and row parsers it runs (:class:`Statements`);
* ``_rows(op, sql, params)``: one statement on one of its connections, driver errors
  translated (MariaDB's also retries a deadlock victim);
* ``_setup(migrating=...)``: read the schema version and create the tables where
  :meth:`~SQLStoreBase._tables_needed` says so, on a connection of its choosing;
* ``_purge_batch(after, limit, pause)``: one batch of the purge;
* ``_estimate()``: ``stats(exact=False)``, from the database's statistics;
* ``_place``: "table T in WHERE", for messages.

What really differs stays in each store: connections and pools, the claim and the fenced
writes (the hot path, tuned call by call per driver) and the transactional mode. Each store
is one class, the public ``Async<Db>Store(SQLStoreBase)`` in its folder's ``async_store``, in
sections by responsibility:

* construction and connections (the pool, closing);
* schema and maintenance (``_setup`` and ``_purge_batch``, which this class runs);
* the message path (the claim, the fenced writes);
* the transactional mode (transaction blocks, savepoints, checks and writes on a caller's
  connection, and ``claim_in``, which shares the claim's code).

What is a concept of its own (a transaction block, a savepoint's bookkeeping) is a class of
its own beside the store, never a layer of it.
"""

from __future__ import annotations

from oncely._twin import ASYNC

if ASYNC:
    from asyncio import sleep
else:
    from time import sleep

import asyncio
import random
import weakref
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from time import monotonic
from typing import Any, ClassVar, Generic, Protocol, TypeVar

from oncely._core.forking import forget_parent_in_children
from oncely._core.records import Record, Status, StoreStats
from oncely._urls import redact
from oncely.errors import SchemaMissing, SchemaOutdated, SchemaTooNew, StoreError
from oncely.stores._identity import (
    SQL,
    Identity,
    identity_of,
    mismatch,
    same_database,
    store_path,
)
from oncely.stores._offsets import OffsetSQL, check_position
from oncely.stores._purging import PURGE_BATCH, PURGE_PAUSE, check_pause
from oncely.stores._sql import PURGE_BUCKET_MS, Estimate, apportion, parse_stats

__all__ = ["Minutes", "Position", "SQLStoreBase", "Statements", "server_time"]

Q = TypeVar("Q", str, bytes)

_KEPT_CONNECTIONS = 64
"""How many checked caller connections that cannot be weakly referenced (sqlite3's) a store
holds, so that Django's or SQLAlchemy's SQLite connection is not read again per message."""

Position = tuple[object, ...]
"""Where a purge stopped: the last (consumer, key) it looked at, as the driver returned them."""


def server_time() -> None:
    """The clock of a store whose statements read the server's (no fixed time)."""
    return None


class Statements(Protocol[Q]):
    """What :class:`SQLStoreBase` runs of a dialect: statements (``str``, or ``bytes`` for
    psycopg), parameter builders and row parsers."""

    get: Q
    stats: Q
    forget: Q

    def who(self, consumer: str, key: str) -> dict[str, object]:
        """The parameters naming one record."""
        ...

    def scan_query(
        self,
        now: int | None,
        consumer: str | None,
        status: Status | None,
        after: tuple[str, str] | None,
        limit: int,
    ) -> tuple[Q, dict[str, object]]:
        """The ``scan`` statement for these filters, and its parameters."""
        ...

    def parse_record(self, consumer: str, key: str, row: Sequence[Any]) -> Record:
        """A record from a row of the record's columns."""
        ...

    def parse_scanned(self, row: Sequence[Any]) -> Record:
        """A record from a row of the ``scan`` statement."""
        ...


class Minutes(Protocol[Q]):
    """The statements of :meth:`SQLStoreBase._sample_minutes`: the purge index's lowest
    (non-zero) and highest ``purge_ms``, and the rows per consumer of some minutes."""

    purge_low: Q
    purge_high: Q

    def minutes_consumers(self, count: int) -> Q:
        """Rows per consumer whose ``purge_ms`` is one of ``count`` parameters ``m<i>``."""
        ...


_MINUTES = 256
"""Minutes sampled per stratum (those that ended, those to come) by an estimate."""
_FIRST_READ = 8
_MINUTES_PER_READ = 64
"""Minutes read per statement: 8 first, twice as many each time after, up to 64."""
_MINUTE_ROWS = 50_000
"""An estimate's sample of a stratum stops once it read this many index entries (at least
the first :data:`_FIRST_READ` minutes)."""


class SQLStoreBase(Generic[Q]):
    """The shared part of the SQL stores (see the module's docstring)."""

    supports_transactions = True

    _SCHEMA_VERSION: ClassVar[int]
    """The schema version this oncely writes (the store's dialect's): tables of a higher one
    are refused (:class:`~oncely.SchemaTooNew`)."""

    _SCHEMA_REVISION: ClassVar[int] = 1
    """Additive changes within a version (a column with a default, an index): an older oncely
    reads and writes a table of a higher revision unchanged, so it does not look at the
    revision; this oncely needs at least its own (:meth:`_upgrade_needed`). A revision that
    comes with a new version is the version's migration (an older oncely refuses the table)."""

    _REVISION_NOTE: ClassVar[str] = (
        "the purge index; the migration is online, and workers of the older oncely keep "
        "working on it"
    )
    """What the migration to ``_SCHEMA_REVISION`` brings, for :class:`~oncely.SchemaOutdated`."""

    _dialect: Statements[Q]
    _offset_sql: OffsetSQL[Q]
    """The statements of the offsets table (:mod:`oncely.stores._offsets`)."""
    _now: Callable[[], int | None]
    """The store's clock in epoch milliseconds, or None where the statement reads the server's."""

    _family: ClassVar[str]
    """The database family, as :mod:`oncely.stores._identity` names it."""

    def __init__(self, *, migrate: bool) -> None:
        self._identity: Identity | None = None
        self._joined_checked: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()
        self._joined_kept: dict[int, Any] = {}
        """Checked connections that cannot be weakly referenced, oldest first."""
        self._auto_migrate = migrate
        self._ready_lock = asyncio.Lock()
        self._ready = False
        self._closed = False
        self._offsets_ready = False
        forget_parent_in_children(self)

    def _forget_parent(self) -> None:
        """In a forked child: locks a thread of the parent may have held at the fork (a
        heartbeat renewing a lease) start afresh; what else is the parent's is dropped where
        the store next looks (its connections: on the next use)."""
        self._ready_lock = asyncio.Lock()

    # ------------------------------------------------------- a caller's connection

    async def check_database(self, tx: Any) -> None:
        """Raise :class:`~oncely.ConfigurationError` unless ``tx``, a caller's connection, is
        on the store's database: a marker written in another one (a tenant's, a staging
        copy's with the inbox table too) would commit where the store never reads it, and
        every redelivery would run again. The server's identity and the database's name are
        compared (:mod:`oncely.stores._identity`): read once per connection (one that cannot
        be weakly referenced, sqlite3's, is held while it is among the last
        ``_KEPT_CONNECTIONS`` checked, and read again after), and the store's own once, again
        after a mismatch (a server restart changes PostgreSQL's)."""
        # (A connection that cannot be weakly referenced, sqlite3's, is never "in" the weak
        # dictionary: it is kept itself, by its id.)
        if tx in self._joined_checked or self._joined_kept.get(id(tx)) is tx:
            return
        if self._family == "sqlite" and store_path(getattr(self, "url", "")) is None:
            return  # an in-memory database: only the store's own connections reach it
        theirs = identity_of(self._family, await self._fetch_on(tx, SQL[self._family]))
        mine = self._identity
        if mine is None or not same_database(mine, theirs):
            mine = self._identity = await self._own_identity()
        if not same_database(mine, theirs):
            raise mismatch(
                redact(getattr(self, "url", "")),
                mine,
                theirs,
                side="the connection given as tx",
                fix="Pass a connection to the store's database, or open the store on the "
                "connection's",
            )
        try:
            self._joined_checked[tx] = True
        except TypeError:
            kept = self._joined_kept
            kept[id(tx)] = tx  # held: no other connection can take its id meanwhile
            if len(kept) > _KEPT_CONNECTIONS:
                kept.pop(next(iter(kept)))

    async def _own_identity(self) -> Identity:
        """The identity of the store's database, read on one of its own connections."""
        if self._family == "sqlite":
            return ("sqlite", store_path(getattr(self, "url", "")) or "")
        own: Any = self  # each store's transaction(): a block on one of its connections
        async with own.transaction() as conn:
            return identity_of(self._family, await self._fetch_on(conn, SQL[self._family]))

    async def _fetch_on(self, conn: Any, sql: str) -> list[Any]:
        """One read on ``conn`` (a caller's connection or the store's own), its rows as
        tuples whatever the connection's row factory, driver errors translated."""
        raise NotImplementedError

    # ------------------------------------------------------------ what each store gives

    @property
    def _place(self) -> str:
        """The inbox table and where it is ("table T in WHERE"), for messages."""
        raise NotImplementedError

    async def _setup(self, *, migrating: bool) -> None:
        """Check the schema, creating the tables where :meth:`_tables_needed` says so."""
        raise NotImplementedError

    async def _rows(self, op: str, sql: Q, params: Mapping[str, object]) -> list[Any]:
        """One statement on one of the store's connections; its rows."""
        raise NotImplementedError

    async def _create_offsets(self) -> None:
        """Create the offsets table where it is missing (``_offset_sql.create``)."""
        raise NotImplementedError

    async def _purge_batch(
        self, after: Position | None, limit: int, pause: float
    ) -> tuple[int, int, Position | None]:
        """Delete up to ``limit`` expired records after ``after`` (from the start when None)
        in key order: how many it looked at, how many it deleted, and where it stopped. A
        batch of several writes rests ``pause`` times each write's time between them (the
        loop rests after the batch)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ schema

    def _closed_error(self) -> StoreError:
        return StoreError(f"{self!r} is closed")

    def _tables_needed(self, version: int | None, *, migrating: bool) -> bool:
        """Whether to create the tables, given the schema ``version`` found (None: no tables):
        when they are missing, or older than this oncely's and ``migrating``.

        Raises :class:`~oncely.SchemaTooNew` for a newer schema, and
        :class:`~oncely.SchemaMissing` for missing tables unless ``migrating`` or the store
        was opened with ``migrate=True``."""
        supported = self._SCHEMA_VERSION
        if version is not None and version > supported:
            raise SchemaTooNew(
                f"the {self._place} holds oncely schema version {version}; this oncely "
                f"understands up to {supported}: upgrade oncely"
            )
        if version is None:
            if not (migrating or self._auto_migrate):
                raise SchemaMissing(
                    f"no oncely {self._place}; run `oncely migrate --store URL` or open the "
                    "store with migrate=True"
                )
            return True
        return migrating and version < supported

    def _upgrade_needed(self, revision: int, *, migrating: bool) -> bool:
        """Whether to bring a table at ``revision`` up to this oncely's: when it is older and
        ``migrating`` (or the store was opened with ``migrate=True``); an older one otherwise
        raises :class:`~oncely.SchemaOutdated`."""
        if revision >= self._SCHEMA_REVISION:
            return False
        if migrating or self._auto_migrate:
            return True
        raise SchemaOutdated(
            f"the {self._place} is at schema revision {revision}; this oncely needs "
            f"{self._SCHEMA_REVISION}: run `oncely migrate --store URL` ({self._REVISION_NOTE})"
        )

    async def _prepare(self) -> None:
        async with self._ready_lock:
            if not self._ready:
                await self._setup(migrating=False)
                self._ready = True

    async def prepare(self) -> None:
        """Connect and check the schema now (creating it when opened with ``migrate=True``),
        as the first operation would: a consumer calls it at start."""
        if self._closed:
            raise self._closed_error()
        await self._prepare()

    async def migrate(self) -> int:
        if self._closed:
            raise self._closed_error()
        await self._setup(migrating=True)
        self._ready = True
        return self._SCHEMA_VERSION

    # ------------------------------------------------------------ reads and maintenance

    async def get(self, consumer: str, key: str) -> Record | None:
        d = self._dialect
        params = d.who(consumer, key)
        params["now"] = self._now()
        rows = await self._rows("get", d.get, params)
        return d.parse_record(consumer, key, rows[0]) if rows else None

    async def prepare_offsets(self) -> None:
        """Create the offsets table where it is missing (once per store object)."""
        if self._closed:
            raise self._closed_error()
        if not self._offsets_ready:
            await self._create_offsets()
            self._offsets_ready = True

    async def offsets(self, consumer: str, stream: str) -> dict[int, int]:
        """The next offset to read of each partition of ``stream`` that ``consumer`` kept in
        its transactions (:meth:`save_offset_in`); the table is created on first use."""
        if self._closed:
            raise self._closed_error()
        check_position(stream, 0, 0, consumer=consumer)
        await self.prepare_offsets()
        o = self._offset_sql
        rows = await self._rows("reading stored offsets", o.read, o.params(consumer, stream))
        return {int(part): int(next_offset) for part, next_offset in rows}

    async def stats(self, *, exact: bool = True) -> StoreStats:
        if not exact:
            return await self._estimate()
        return parse_stats(await self._rows("stats", self._dialect.stats, {"now": self._now()}))

    async def _estimate(self) -> StoreStats:
        """``stats(exact=False)``: the counts from the database's statistics and bounded
        index reads, never a read of the whole table (each store's, in its section on
        schema and maintenance)."""
        raise NotImplementedError

    async def _split_rest(
        self, found: Estimate, total_rows: int, cur: int, d: Minutes[Q]
    ) -> StoreStats:
        """The stats of SQLite and MariaDB, whose consumers were counted up to SMALL + 1
        (``found.seen``) and whose table holds about ``total_rows`` rows: what the small
        consumers and the expired records leave is the larger consumers' live records. One
        larger consumer takes it all; several share it as a sample of minutes shares its
        rows (:meth:`_sample_minutes`), which also estimates the expired past those counted."""
        big = [c for c in found.seen if not found.small(c)]
        shares = dict.fromkeys(big, 1.0)
        counting = found.expired > found.counted
        if len(big) > 1 or counting:
            live, ended = await self._sample_minutes(d, cur, ended=counting, to_come=len(big) > 1)
            if counting:
                found.expired = max(found.expired, round(ended))
            among = sum(live.get(c, 0.0) for c in big)
            shares = {c: live.get(c, 0.0) / among if among else 1 / len(big) for c in big}
        small_rows = sum(seen for c, (seen, _) in found.seen.items() if found.small(c))
        small_dead = sum(s - live for c, (s, live) in found.seen.items() if found.small(c))
        rest = max(total_rows - small_rows - max(found.expired - small_dead, 0), 0)
        found.big = apportion(rest, shares)
        return found.stats()

    async def _sample_minutes(
        self, d: Minutes[Q], cur: int, *, ended: bool, to_come: bool
    ) -> tuple[dict[str, float], float]:
        """A sample of the table by minute of expiry: the purge index is read for whole
        minutes (``purge_ms`` values) picked at random between its ends, up to
        :data:`_MINUTES` of those that ended (before ``cur``, the current minute) and as many
        of those to come. Every row is in exactly one minute, and every minute of a stratum is
        as likely to be picked, so each picked minute's rows stand for ``minutes in the
        stratum / minutes read`` rows. Returns the estimated rows of each consumer in the
        minutes to come (its live records, but for the current minute's expired ones) and of
        the minutes that ended (the expired records). Only index entries are read: at most
        about :data:`_MINUTE_ROWS` of them. ``ended`` and ``to_come`` say which strata to
        read (the other one's answer is then empty)."""
        low = (await self._rows("stats", d.purge_low, {}))[0][0]
        high = (await self._rows("stats", d.purge_high, {}))[0][0]
        live: dict[str, float] = {}
        dead = 0.0
        if low is None or high is None:
            return live, dead
        step = PURGE_BUCKET_MS
        strata = (
            (int(low), min(int(high), cur - step), False, ended),
            (max(int(low), cur), int(high), True, to_come),
        )
        for first, last, coming, wanted in strata:
            if last < first or not wanted:
                continue
            minutes = (last - first) // step + 1
            # In random order: a sample cut short by _MINUTE_ROWS is still a random one.
            picked = random.sample(range(minutes), min(minutes, _MINUTES))
            read = taken = 0
            chunk = _FIRST_READ
            rows_of: dict[str, int] = {}
            while taken < len(picked) and read < _MINUTE_ROWS:
                some = sorted(picked[taken : taken + chunk])
                params = {f"m{i}": first + m * step for i, m in enumerate(some)}
                sql = d.minutes_consumers(len(some))
                for consumer, n in await self._rows("stats", sql, params):
                    name = consumer if isinstance(consumer, str) else bytes(consumer).decode()
                    rows_of[name] = rows_of.get(name, 0) + int(n)
                    read += int(n)
                taken += len(some)
                chunk = min(2 * chunk, _MINUTES_PER_READ)
            weight = minutes / taken
            if coming:
                live = {name: n * weight for name, n in rows_of.items()}
            else:
                dead = sum(rows_of.values()) * weight
        return live, dead

    async def scan(
        self,
        *,
        consumer: str | None = None,
        status: Status | None = None,
        after: tuple[str, str] | None = None,
        limit: int = 100,
    ) -> list[Record]:
        d = self._dialect
        sql, params = d.scan_query(self._now(), consumer, status, after, limit)
        return [d.parse_scanned(row) for row in await self._rows("scan", sql, params)]

    async def forget(self, consumer: str, key: str) -> bool:
        # A DELETE ... RETURNING 1 (MariaDB / MySQL count affected rows instead: overridden).
        d = self._dialect
        return bool(await self._rows("forget", d.forget, d.who(consumer, key)))

    async def purge_expired(
        self,
        *,
        batch_size: int = PURGE_BATCH,
        max_batches: int | None = None,
        on_batch: Callable[[int, int], None] | None = None,
        pause: float = PURGE_PAUSE,
    ) -> int:
        """Delete expired records in batches of ``batch_size`` (at most ``max_batches``) and
        return how many went. ``on_batch(taken, deleted)`` is called after each batch (a
        progress display, a purge service's report).

        Between batches the purge rests ``pause`` times as long as the batch took (1.0: as
        long as it worked, so the purge has at most half of the database's time and a
        concurrent claim finds it idle half the time; 0: no rest, the fastest purge)."""
        if not 1 <= batch_size <= 10_000:
            raise ValueError("batch_size must be between 1 and 10000")
        check_pause(pause)
        deleted = 0
        batches = 0
        after: Position | None = None
        while max_batches is None or batches < max_batches:
            began = monotonic()
            seen, gone, after = await self._purge_batch(after, batch_size, pause)
            took = monotonic() - began  # the batch's own time: a slow on_batch adds no rest
            if on_batch is not None:
                on_batch(seen, gone)
            if not seen:
                break
            deleted += gone
            batches += 1
            if seen < batch_size:
                break
            if pause:
                await sleep(pause * took)
        return deleted

    @asynccontextmanager
    async def purge_leader(self) -> AsyncIterator[bool]:
        """Whether this process leads the purge of this table while the block runs: at most
        one does at a time, across processes and machines (a purge service asks before each
        run). The lead ends with the block, or with the process. Each store overrides this
        with its server's lock; this default leads always (one process)."""
        yield True

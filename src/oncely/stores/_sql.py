"""What the SQL stores share that is pure text and rows: identifier checks, statement
parameters and the row parsers.

SQLite and PostgreSQL hand back the record's columns (``status, fingerprint, token, attempt,
created_ms, updated_ms, lease_until_ms, expires_ms, result, error``) as Python values of the
right type and bind named parameters from plain values, so one parser and one set of
parameter builders (:class:`PlainRows`) serve both. MariaDB / MySQL keep text in
``VARBINARY`` columns and have their own in :mod:`oncely.stores.mysql.dialect`; the stats rows
of all three are parsed here. Names spliced into statements (tables, schemas) are checked by
:func:`check_identifier`.
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Generic, TypeVar

from oncely._core.records import Record, Status, StoreStats
from oncely.errors import InvalidIdentifier, SchemaError
from oncely.stores._compact import unpack_fingerprint, unpack_token

__all__ = [
    "MAX_CONSUMERS",
    "PURGE_BUCKET_MS",
    "SMALL",
    "STATUS",
    "Estimate",
    "PlainRows",
    "apportion",
    "bucket_sql",
    "check_identifier",
    "durability_warning",
    "marker_missing",
    "parse_record",
    "parse_scanned",
    "parse_stats",
    "parse_versions",
    "plan_rows",
    "purge_bucket",
    "read_version",
    "scan_params",
    "status_shares",
]


PURGE_BUCKET_MS: Final = 60_000
"""The purge's time bucket. Each row carries ``purge_ms``: its expiry rounded *up* to a whole
minute, indexed. A purge walks that index (what expired, not the whole table): every row of a
bucket that ended is expired, and the bucket that holds "now" is checked row by row.

Why a bucket and not an index on ``expires_ms`` itself: a completion moves ``expires_ms`` by the
handler's duration, and an update that changes an indexed column writes every index again
(PostgreSQL can no longer update the row in place, "HOT"; InnoDB rewrites the secondary entry).
A completion leaves its minute unchanged (the claim already set the same expiry, give or take
the handler's duration), so it writes no index at all; and equal keys compress (PostgreSQL's
B-tree deduplication keeps one key per posting list).

The invariant every write keeps: ``purge_ms <= bucket(expires_ms)``, so no expired row is ever
missed. A write that extends the expiry may leave ``purge_ms`` behind (a completion that
crossed a minute, a row written by an older oncely with the column's default 0); the purge
finds such a row early, sees it is not expired, and moves its ``purge_ms`` forward."""


def parse_versions(rows: Iterable[Sequence[Any]], place: str) -> tuple[int | None, int]:
    """The schema version (None: no tables) and revision (1 where none is written) from the
    meta table's ``(name, value)`` rows of the inbox at ``place``; a value that is no version
    (the meta table edited by hand, or by something else) is a :class:`~oncely.SchemaError`."""
    found = {str(name): value for name, value in rows}
    if "schema_version" not in found:
        return None, 1
    return (
        read_version(found["schema_version"], "schema version", place),
        read_version(found.get("revision", 1), "schema revision", place),
    )


def marker_missing(place: str, meta: str, version: int, note: str = "") -> SchemaError:
    """The :class:`~oncely.SchemaError` for an inbox table at ``place`` whose schema marker
    (the ``schema_version`` row of ``meta``) is missing: deleted by hand, or by something
    other than oncely. Not "no table": creating it would write this oncely's version over a
    table whose own nobody knows."""
    return SchemaError(
        f"the {place} exists, but its schema marker is missing: {meta} has no "
        "'schema_version' row (deleted by hand, or by something other than oncely), and "
        "oncely does not guess the schema of an existing table. Restore the row with the "
        "version the table was created at (this oncely creates version "
        f"{version}: INSERT INTO {meta} (name, value) VALUES ('schema_version', '{version}')), "
        "or move the table aside and run `oncely migrate` to create a new one" + note
    )


LOGGER = logging.getLogger("oncely.store")

_DURABLE: Final = {
    "synchronous_commit": ("on", "remote_apply", "remote_write", "local"),
    "fsync": ("on",),
    "innodb_flush_log_at_trx_commit": ("1",),
}
"""The server settings under which a commit the server confirmed survives its crash."""


def durability_warning(where: str, settings: Mapping[str, object]) -> None:
    """Log once, at WARNING, the settings of ``settings`` (name: value read from the server)
    under which a commit the server confirmed can be lost when it crashes: a record lost so
    is a message processed again, and an effect outside the transaction repeated."""
    lax = {
        name: str(value).lower()
        for name, value in settings.items()
        if str(value).lower() not in _DURABLE[name]
    }
    if lax:
        LOGGER.warning(
            "oncely store=%s %s: a crash of the server can lose the last commits it "
            "confirmed. A record lost so is its message processed again when redelivered: "
            "a transactional handler's writes are lost with it (one effect still), but an "
            "effect outside the transaction (a charge, an e-mail) is repeated. Make them "
            "durable (%s) for effects that must never repeat",
            where,
            ", ".join(f"{name}={value}" for name, value in lax.items()),
            ", ".join(f"{name}={_DURABLE[name][0]}" for name in lax),
        )


def read_version(value: object, what: str, place: str) -> int:
    """``value``, a version number read from a store, as an int; anything else (a meta row
    edited by hand, or written by something other than oncely) is a
    :class:`~oncely.SchemaError` that says what was found, where, and the way out."""
    text = value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
    if text.strip().isdigit():
        return int(text)
    raise SchemaError(
        f"the {what} of the {place} reads {text[:40]!r}, which is no oncely version: the "
        "marker was edited by hand or written by something other than oncely; restore it, "
        "or give oncely a table (on Redis, a database or key prefix) of its own"
    )


def purge_bucket(ms: int) -> int:
    """``ms`` rounded up to a whole :data:`PURGE_BUCKET_MS`."""
    return -(-ms // PURGE_BUCKET_MS) * PURGE_BUCKET_MS


def bucket_sql(expr: str, div: str = "/") -> str:
    """:func:`purge_bucket` of the SQL integer expression ``expr``; ``div`` is the dialect's
    integer division (MariaDB's is ``DIV``)."""
    b = PURGE_BUCKET_MS
    return f"((({expr}) + {b - 1}) {div} {b} * {b})"


_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,62}")


def check_identifier(name: str) -> str:
    """``name`` if it is a plain SQL identifier (letters, digits, underscores; at most 63
    characters, PostgreSQL's limit), else :class:`~oncely.InvalidIdentifier`. Names are
    spliced into statements, so nothing else is accepted, quoted or not."""
    if not isinstance(name, str) or not _IDENTIFIER.fullmatch(name):
        raise InvalidIdentifier(
            f"{name!r} is not a plain identifier: use letters, digits and underscores, "
            "starting with a letter or underscore, at most 63 characters"
        )
    return name


def scan_params(
    now: int | None,
    consumer: str | None,
    status: Status | None,
    after: tuple[str, str] | None,
    limit: int,
) -> dict[str, object]:
    """The parameters of a ``scan`` statement: unexpired records in ``(consumer, key)`` order
    after ``after`` (from the start when ``None``), optionally of one consumer and status.
    ``now`` is ``None`` where the statement reads the server's clock."""
    after_consumer, after_key = after if after is not None else ("", "")
    return {
        "now": now,
        "consumer": consumer,
        "status": status.value if status is not None else None,
        "after_consumer": after_consumer,
        "after_key": after_key,
        "limit": limit,
    }


Q = TypeVar("Q", str, bytes)

STATUS: dict[str, Status] = {s.value: s for s in Status}
"""A status column's text to its :class:`Status` (faster than calling the enum)."""


def parse_record(consumer: str, key: str, row: Sequence[Any]) -> Record:
    """A record from a row of the record's columns (in that order); the token and fingerprint
    as text (PostgreSQL, and SQLite rows written before its schema version 2) or in the compact
    form of :mod:`oncely.stores._compact` (SQLite since)."""
    result = row[8]
    return Record(
        consumer=consumer,
        key=key,
        status=STATUS[row[0]],
        fingerprint=unpack_fingerprint(row[1]),
        token=unpack_token(row[2]),
        attempt=row[3],
        created_ms=row[4],
        updated_ms=row[5],
        lease_until_ms=row[6],
        expires_ms=row[7],
        result=bytes(result) if result is not None else None,
        error=row[9],
    )


def parse_scanned(row: Sequence[Any]) -> Record:
    """A record from a row of ``scan``: consumer, key, then the record's columns."""
    return parse_record(row[0], row[1], row[2:])


def parse_stats(rows: Iterable[Sequence[Any]]) -> StoreStats:
    """Store stats from rows of ``(consumer, status, live count, expired count)``, one per
    consumer and status. A consumer may come as UTF-8 bytes and a count as a ``Decimal`` or
    NULL (MariaDB's ``SUM``)."""
    counts: dict[str, dict[Status, int]] = {}
    expired = 0
    for consumer, status, live, dead in rows:
        expired += int(dead or 0)
        if live:
            name = consumer if isinstance(consumer, str) else bytes(consumer).decode("utf-8")
            counts.setdefault(name, {})[STATUS[status]] = int(live)
    return StoreStats(counts=counts, expired=expired)


class PlainRows(Generic[Q]):
    """The read side of a dialect whose driver binds and returns plain Python values (SQLite,
    PostgreSQL): the parameters naming a record and those of ``scan``, and the row parsers.
    :class:`~oncely.stores.async_sql.SQLStoreBase` runs ``get``, ``scan`` and ``stats`` with
    them."""

    __slots__ = ()

    scan: Q

    parse_record = staticmethod(parse_record)
    parse_scanned = staticmethod(parse_scanned)

    @staticmethod
    def who(consumer: str, key: str) -> dict[str, object]:
        """The parameters naming one record."""
        return {"consumer": consumer, "key": key}

    def scan_query(
        self,
        now: int | None,
        consumer: str | None,
        status: Status | None,
        after: tuple[str, str] | None,
        limit: int,
    ) -> tuple[Q, dict[str, object]]:
        """The ``scan`` statement and its parameters."""
        return self.scan, scan_params(now, consumer, status, after, limit)


# ----------------------------------------------------------------- stats(exact=False)

SMALL: Final = 1000
"""Estimates count a consumer (and the expired records) outright while they are this few: a
bounded read of an index range, at most ``SMALL + 1`` entries (about a millisecond), that
makes a small or new consumer exact where the statistics know it badly or not at all."""

MAX_CONSUMERS: Final = 10_000
"""Estimates list at most this many consumers (a skip scan, one index descent each)."""


def plan_rows(plan: Any) -> int:
    """The row estimate of the top node of a PostgreSQL ``EXPLAIN (FORMAT JSON)`` (a list
    holding ``{"Plan": {"Plan Rows": n}}``, or its JSON text); 0 when there is none."""
    if isinstance(plan, str | bytes | bytearray):
        plan = json.loads(plan)
    if isinstance(plan, list) and plan and isinstance(plan[0], Mapping):
        top = plan[0].get("Plan")
        if isinstance(top, Mapping):
            rows = top.get("Plan Rows")
            if isinstance(rows, int | float):
                return round(rows)
    return 0


def status_shares(
    values: Sequence[str] | None, freqs: Sequence[float] | None
) -> dict[Status, float]:
    """Each status's share of the records, from a column statistic's most common values and
    their frequencies (PostgreSQL's ``pg_stats``); empty when there is none."""
    if not values or not freqs:
        return {}
    found = {STATUS[v]: float(f) for v, f in zip(values, freqs, strict=False) if v in STATUS}
    whole = sum(found.values())
    return {s: f / whole for s, f in found.items()} if whole > 0 else {}


@dataclass
class Estimate:
    """What a SQL store's ``stats(exact=False)`` gathers, and how it becomes
    :class:`~oncely.StoreStats`.

    ``seen`` holds, per consumer, the rows read by the bounded count (at most
    :data:`SMALL` + 1) and how many of them were live: a consumer with at most ``SMALL`` rows
    is exact. ``big`` holds the live estimate of every other consumer (the store's planner
    or a sample). ``expired`` is the estimate of expired records."""

    seen: dict[str, tuple[int, int]] = field(default_factory=dict)
    big: dict[str, int] = field(default_factory=dict)
    expired: int = 0
    counted: int = SMALL
    """Up to how many expired records ``expired`` was counted outright (more: estimated)."""
    cut: bool = False
    """A bounded count behind ``expired`` stopped at its bound (SQLite's two counts, whose
    bounds ``counted`` adds up): ``expired`` is not exact whatever its value."""
    rows: int | None = None
    """The table's rows where the store counted them (SQLite's ``count(*)``): the live total
    is then exact when the expired were counted and the split adds up to the rest."""
    shares: dict[Status, float] = field(default_factory=dict)
    note: str = ""

    def small(self, consumer: str) -> bool:
        return self.seen[consumer][0] <= SMALL

    def stats(self) -> StoreStats:
        consumers: dict[str, int] = {}
        for consumer, (rows, live) in self.seen.items():
            if rows <= SMALL:
                if live:
                    consumers[consumer] = live
            else:  # more rows than read: at least the live ones read, whatever the estimate
                # (PostgreSQL's planner never estimates under one row: that one, with none
                # live among the rows read, is no record)
                big = self.big.get(consumer, 0)
                if max(big if big > 1 else 0, live):
                    consumers[consumer] = max(big, live)
        total = sum(consumers.values())
        statuses = None
        if self.shares:
            statuses = {s: round(total * self.shares.get(s, 0.0)) for s in Status}
        # What was counted outright is exact: a small consumer (its rows read to the end),
        # the expired while under their bound, and the live total when every consumer was
        # listed and small, or when it is the counted rows less the counted expired.
        counted_expired = not self.cut and 0 <= self.expired <= self.counted
        listed = len(self.seen) < MAX_CONSUMERS
        counted_total = (listed and all(self.small(c) for c in self.seen)) or (
            self.rows is not None and counted_expired and total == self.rows - self.expired
        )
        return StoreStats(
            counts={consumer: {} for consumer in consumers},
            expired=max(self.expired, 0),
            exact=False,
            consumers=consumers,
            statuses=statuses,
            note=self.note,
            counted=frozenset(c for c in consumers if self.small(c)),
            counted_total=counted_total,
            counted_expired=counted_expired,
        )


def apportion(whole: int, shares: Mapping[str, float]) -> dict[str, int]:
    """``whole`` split in proportion to ``shares`` (which add up to 1), in whole numbers that
    add up to ``whole`` (the largest remainders get the units rounding down left over)."""
    if not shares:
        return {}
    exact = {name: whole * share for name, share in shares.items()}
    parts = {name: math.floor(x) for name, x in exact.items()}
    order = sorted(exact, key=lambda name: parts[name] - exact[name])
    for name in order[: max(whole - sum(parts.values()), 0)]:
        parts[name] += 1
    return parts

"""SQLite: the schema and every statement of the store contract, as text.

A claim is one ``INSERT ... ON CONFLICT DO NOTHING`` for a new key (the unique primary key makes
the database the arbiter, R8, R9); only when the key exists does it read the winner, and only
when that record is expired or a stale claim it may take over does it write again, with a
compare-and-set on the token it read. The rules are those of :mod:`oncely._core.state`,
written in SQL.

Times are integer epoch milliseconds passed in as ``:now`` from the store's clock, so one
statement never reads the clock twice and tests can drive time. Rows are parsed as
PostgreSQL's are (:mod:`oncely.stores._sql`).
"""

from __future__ import annotations

from typing import Final

from oncely.stores._compact import REVISION_NOTE, SCHEMA_REVISION, SCHEMA_VERSION
from oncely.stores._sql import (
    SMALL,
    PlainRows,
    bucket_sql,
    check_identifier,
    parse_record,
    parse_scanned,
)

__all__ = [
    "ENDED_COUNTED",
    "REVISION_NOTE",
    "SCHEMA_REVISION",
    "SCHEMA_VERSION",
    "SQLiteDialect",
    "parse_record",
    "parse_scanned",
]

STATUS_CHECK: Final = "CHECK (status = 'in_progress' OR status = 'completed' OR status = 'failed')"
"""The inbox table's status constraint. Written as comparisons: SQLite compiles the
equivalent ``status IN (...)`` into a temporary b-tree that every INSERT fills again (three
inserts into it, about 2 µs of the claim warm and 5 µs right after a commit)."""

OLD_STATUS_CHECK: Final = "CHECK (status IN ('in_progress', 'completed', 'failed'))"
"""The same constraint as tables created before it was rewritten spell it; ``migrate``
rewrites it in place (:meth:`SQLiteDialect.upgrade_check`)."""

ENDED_COUNTED: Final = 1_000_000
"""``stats(exact=False)`` counts the rows of minutes of expiry that ended (expired) outright up
to this many; more are estimated from a sample of minutes."""

_COLUMNS: Final = (
    "status, fingerprint, token, attempt, created_ms, updated_ms, lease_until_ms, expires_ms, "
    "result, error"
)


def _pairs(count: int) -> str:
    return "SELECT column1, column2 FROM (VALUES " + ", ".join(["(?, ?)"] * count) + ")"


class SQLiteDialect(PlainRows[str]):
    """Every statement for one inbox table, built once.

    Tokens and fingerprints bind in their stored form (:mod:`oncely.stores._compact`); where a
    statement compares with a value read from a row (``:seen``, a takeover's ``:token``, the
    fingerprint) it also takes the value's text (``:seen_text``, ...), the form of a row
    written before schema version 2."""

    __slots__ = (
        "add_purge_column",
        "columns",
        "complete",
        "count_consumer",
        "count_ended",
        "count_expiring",
        "count_rows",
        "create",
        "create_purge_index",
        "current",
        "fail",
        "first_consumer",
        "fix_purge",
        "forget",
        "forget_by_token",
        "get",
        "insert",
        "meta_table",
        "next_consumer",
        "purge_candidates",
        "purge_high",
        "purge_low",
        "read_version",
        "release",
        "renew",
        "replace",
        "scan",
        "set_result",
        "set_revision",
        "set_version",
        "stats",
        "table",
        "table_sql",
        "takeover",
    )

    def __init__(self, table: str = "oncely_inbox") -> None:
        t = check_identifier(table)
        self.table = t
        self.meta_table = check_identifier(f"{t}_meta")
        m = self.meta_table
        self.create = (
            f"""CREATE TABLE IF NOT EXISTS {t} (
                consumer TEXT NOT NULL,
                key TEXT NOT NULL,
                status TEXT NOT NULL {STATUS_CHECK},
                fingerprint TEXT,
                token TEXT NOT NULL,
                attempt INTEGER NOT NULL,
                created_ms INTEGER NOT NULL,
                updated_ms INTEGER NOT NULL,
                lease_until_ms INTEGER NOT NULL,
                expires_ms INTEGER NOT NULL,
                result BLOB,
                error TEXT,
                purge_ms INTEGER NOT NULL DEFAULT 0,
                PRIMARY KEY (consumer, key)
            ) WITHOUT ROWID""",
            f"CREATE TABLE IF NOT EXISTS {m} (name TEXT PRIMARY KEY, value TEXT NOT NULL)",
            f"INSERT INTO {m} (name, value) VALUES ('schema_version', '{SCHEMA_VERSION}') "
            "ON CONFLICT (name) DO NOTHING",
        )
        self.read_version = (
            f"SELECT name, value FROM {m} WHERE name IN ('schema_version', 'revision')"
        )
        # Revision 2: the purge_ms column (ADD COLUMN with a constant default only edits the
        # schema) and its index, then the revision row. See oncely.stores._sql.PURGE_BUCKET_MS.
        self.columns = f"SELECT name FROM pragma_table_info('{t}')"
        self.add_purge_column = f"ALTER TABLE {t} ADD COLUMN purge_ms INTEGER NOT NULL DEFAULT 0"
        self.create_purge_index = f'CREATE INDEX IF NOT EXISTS "{t}_purge" ON {t} (purge_ms)'
        self.set_revision = (
            f"INSERT INTO {m} (name, value) VALUES ('revision', '{SCHEMA_REVISION}') "
            "ON CONFLICT (name) DO UPDATE SET value = excluded.value"
        )
        # Revision 3: the version row of a table created at version 1 (its rows keep their
        # text tokens and fingerprints, which every statement still matches).
        self.set_version = (
            f"UPDATE {m} SET value = '{SCHEMA_VERSION}' WHERE name = 'schema_version'"
        )
        self.table_sql = f"SELECT sql FROM sqlite_master WHERE type = 'table' AND name = '{t}'"
        # Plain "?" parameters, bound from a tuple (consumer, key, status, fingerprint,
        # token, now, now, lease_until, expires, error, expires): sqlite3 binds a named
        # parameter by building a str per name and looking it up in the dict, which costs
        # ~2 us per claim. Not numbered ones ("?1"), which would spare the repeated values:
        # Python 3.12.0 to 3.12.3 warn of those as of named ones (a DeprecationWarning on
        # every claim; an error where a user turns warnings into errors).
        self.insert = f"""INSERT INTO {t} (consumer, key, status, fingerprint, token, attempt,
                created_ms, updated_ms, lease_until_ms, expires_ms, result, error, purge_ms)
            VALUES (?, ?, ?, ?, ?, 1, ?, ?, ?, ?, NULL, ?, {bucket_sql("?")})
            ON CONFLICT (consumer, key) DO NOTHING"""
        self.current = f"SELECT {_COLUMNS} FROM {t} WHERE consumer = :consumer AND key = :key"
        expired = "expires_ms <= :now"
        bucket = bucket_sql(":expires")
        # Replace an expired record, or take over a stale claim, but only if the record still
        # carries the token the caller saw (compare-and-set: tokens are never reused).
        self.replace = f"""UPDATE {t} SET
                status = :status,
                fingerprint = CASE WHEN {expired} THEN :fingerprint
                    ELSE COALESCE(:fingerprint, fingerprint) END,
                token = :token,
                attempt = CASE WHEN {expired} THEN 1 ELSE attempt + 1 END,
                created_ms = CASE WHEN {expired} THEN :now ELSE created_ms END,
                updated_ms = :now,
                lease_until_ms = :lease_until,
                expires_ms = :expires,
                purge_ms = {bucket},
                result = NULL,
                error = :error
            WHERE consumer = :consumer AND key = :key AND token IN (:seen, :seen_text)
                AND ({expired}
                    OR (:takeover AND status = 'in_progress' AND lease_until_ms <= :now
                        AND (:fingerprint IS NULL OR fingerprint IS NULL
                            OR fingerprint IN (:fingerprint, :fingerprint_text))))
            RETURNING {_COLUMNS}"""
        mine = "consumer = :consumer AND key = :key AND token = :token"
        live = "expires_ms > :now"
        self.takeover = f"""UPDATE {t} SET
                status = 'in_progress',
                fingerprint = COALESCE(:fingerprint, fingerprint),
                token = :new_token,
                attempt = attempt + 1,
                updated_ms = :now,
                lease_until_ms = :lease_until,
                expires_ms = :expires,
                purge_ms = {bucket},
                result = NULL,
                error = NULL
            WHERE consumer = :consumer AND key = :key AND token IN (:token, :token_text)
                AND status = 'in_progress' AND lease_until_ms <= :now AND {live}
                AND (:fingerprint IS NULL OR fingerprint IS NULL
                    OR fingerprint IN (:fingerprint, :fingerprint_text))
            RETURNING {_COLUMNS}"""
        # A completion (and a renewal) leaves purge_ms alone: SQLite writes an index again
        # whenever its column is in the SET list, even to the same value (a second WAL page
        # per completion). They return purge_ms instead, and the store lowers it in the rare
        # case the expiry moved to an earlier minute (fix_purge). A failure is rare: it sets it.
        self.complete = f"""UPDATE {t} SET status = 'completed', updated_ms = :now,
                expires_ms = :expires, result = :result, error = :note
            WHERE {mine} AND status = 'in_progress' AND {live}
            RETURNING {_COLUMNS}, purge_ms"""
        self.fail = f"""UPDATE {t} SET status = 'failed', updated_ms = :now,
                expires_ms = :expires, purge_ms = {bucket}, result = NULL, error = :error
            WHERE {mine} AND status = 'in_progress' AND {live}
            RETURNING {_COLUMNS}"""
        self.fix_purge = f"""UPDATE {t} SET purge_ms = {bucket}
            WHERE consumer = :consumer AND key = :key AND purge_ms > {bucket}"""
        self.renew = f"""UPDATE {t} SET updated_ms = :now, lease_until_ms = :lease_until,
                expires_ms = :expires
            WHERE {mine} AND status = 'in_progress' AND {live}
            RETURNING {_COLUMNS}, purge_ms"""
        self.release = f"""DELETE FROM {t}
            WHERE {mine} AND status = 'in_progress' AND {live}
            RETURNING 1"""
        self.set_result = f"UPDATE {t} SET result = :result WHERE {mine}"
        self.get = (
            f"SELECT {_COLUMNS} FROM {t} WHERE consumer = :consumer AND key = :key AND {live}"
        )
        self.forget = f"DELETE FROM {t} WHERE consumer = :consumer AND key = :key RETURNING 1"
        self.forget_by_token = f"""DELETE FROM {t}
            WHERE {mine} AND {live}
                AND NOT (status = 'in_progress' AND lease_until_ms > :now)
            RETURNING 1"""
        # Purging walks the purge_ms index from its start: the rows of minutes that ended
        # (expired, or behind their expiry: moved forward), then the current minute's expired
        # ones. Candidates are read without the write lock (WAL readers never block writers),
        # then deleted or moved by key in short writes; every one leaves the range, so the
        # next batch starts from the index's start again.
        current = bucket_sql(":now")
        self.purge_candidates = f"""SELECT consumer, key, {expired} FROM {t}
            WHERE purge_ms <= {current} AND (purge_ms < {current} OR {expired})
            ORDER BY purge_ms
            LIMIT :limit"""
        # One pass over the table: live and expired counts per (consumer, status).
        self.stats = f"""SELECT consumer, status, SUM({live}), SUM(NOT ({live}))
            FROM {t} GROUP BY consumer, status"""
        # stats(exact=False). SQLite keeps no statistics unless ANALYZE ran, and then never
        # updates them; what is fast instead (measured at 10^7 records, 4.3 GB, warm cache):
        # count(*), which SQLite answers by counting the entries of its smallest index, the
        # purge index, page by page without reading them (0.37-0.42 s); a descent of an
        # index (0.1 ms); a range of the purge index (55 ns an entry). Counting a consumer's
        # range of the primary key reads its rows (3.7 s for 7x10^6), so the consumers are
        # listed by descents and counted up to SMALL + 1; what is left is split by a sample
        # of minutes of the purge index (oncely.stores.async_sql.SQLStoreBase._sample_minutes).
        self.count_rows = f"SELECT count(*) FROM {t}"
        # The expired: the rows of the minutes that ended, counted off the purge index up to
        # ENDED_COUNTED + 1 of them (index entries only: 73-85 ms for 10^6), and the current
        # minute's expired ones up to SMALL + 1 (those need their rows read: 4 s for 10^6).
        self.count_ended = f"""SELECT count(*) FROM (SELECT 1 FROM {t}
            WHERE purge_ms > 0 AND purge_ms < :cur LIMIT {ENDED_COUNTED + 1})"""
        self.count_expiring = f"""SELECT count(*) FROM (SELECT 1 FROM {t}
            WHERE purge_ms = :cur AND expires_ms <= :now LIMIT {SMALL + 1})"""
        self.first_consumer = f"SELECT min(consumer) FROM {t}"
        self.next_consumer = f"SELECT min(consumer) FROM {t} WHERE consumer > :after"
        self.count_consumer = f"""SELECT count(*), coalesce(sum(e > :now), 0)
            FROM (SELECT expires_ms AS e FROM {t} WHERE consumer = :consumer
                LIMIT {SMALL + 1})"""
        self.purge_low = f"SELECT min(purge_ms) FROM {t} WHERE purge_ms > 0"
        self.purge_high = f"SELECT max(purge_ms) FROM {t}"
        self.scan = f"""SELECT consumer, key, {_COLUMNS} FROM {t}
            WHERE {live}
                AND (:consumer IS NULL OR consumer = :consumer)
                AND (:status IS NULL OR status = :status)
                AND (consumer, key) > (:after_consumer, :after_key)
            ORDER BY consumer, key
            LIMIT :limit"""

    def minutes_consumers(self, count: int) -> str:
        """The rows per consumer of ``count`` minutes of expiry (``:m<i>``), read off the
        purge index (which holds the primary key's columns: no row is read)."""
        minutes = ", ".join(f":m{i}" for i in range(count))
        return (
            f"SELECT consumer, count(*) FROM {self.table} WHERE purge_ms IN ({minutes}) "
            "GROUP BY consumer"
        )

    def purge_delete(self, count: int) -> str:
        """Delete ``count`` (consumer, key) pairs given as ``?`` parameters, still expired at
        the last parameter (``now``). The pairs are a subquery: ``(consumer, key) IN (VALUES
        ...)`` written directly makes SQLite scan the whole table for every batch."""
        return (
            f"DELETE FROM {self.table} WHERE (consumer, key) IN ({_pairs(count)}) "
            "AND expires_ms <= ? RETURNING 1"
        )

    def purge_move(self, count: int) -> str:
        """Move ``count`` pairs (``?`` parameters), unexpired at the last (``now``), whose
        purge_ms is behind their expiry, to their expiry's minute."""
        bucket = bucket_sql("expires_ms")
        return (
            f"UPDATE {self.table} SET purge_ms = {bucket} "
            f"WHERE (consumer, key) IN ({_pairs(count)}) "
            f"AND expires_ms > ? AND purge_ms < {bucket}"
        )

    def upgrade_check(self, version: int) -> tuple[tuple[str, tuple[object, ...]], ...]:
        """The statements (with their parameters) that rewrite an older table's status
        constraint (:data:`OLD_STATUS_CHECK`) as :data:`STATUS_CHECK`, inside a write
        transaction whose ``PRAGMA schema_version`` read ``version``, with
        ``PRAGMA writable_schema`` on.

        This is the schema edit SQLite's ALTER TABLE documentation gives for removing a CHECK
        constraint without copying the table: edit the table's text in ``sqlite_master`` and
        bump the schema version, so every connection reads the schema again. Replacing the
        constraint is safe the same way, because the new one accepts exactly the rows the old
        one did: no row in the table can break it."""
        return (
            (
                "UPDATE sqlite_master SET sql = replace(sql, ?, ?) "
                "WHERE type = 'table' AND name = ?",
                (OLD_STATUS_CHECK, STATUS_CHECK, self.table),
            ),
            (f"PRAGMA schema_version = {int(version) + 1}", ()),
        )

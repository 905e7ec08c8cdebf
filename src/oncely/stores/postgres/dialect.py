"""PostgreSQL: the schema and every statement of the store contract, as text.

How a claim works
=================

A claim is one statement: a CTE that tries ``INSERT ... ON CONFLICT (consumer, key) DO NOTHING``
and, in the same statement, reads the existing row when the insert did not happen. The unique
primary key makes the database the arbiter (R8, R9); ``DO NOTHING`` never raises, so a conflict
never aborts the caller's transaction (a unique violation would poison it).

Why not ``ON CONFLICT DO UPDATE ... WHERE <claimable>``: that locks the existing row even when
the ``WHERE`` is false, and a row lock is a write (WAL, a transaction id, a flush at commit).
A duplicate would then cost a disk flush; with ``DO NOTHING`` plus a read it costs none.

The READ COMMITTED snapshot trap: when the key was inserted by a transaction still open, the
insert waits for it. If that transaction commits, the insert does nothing, but the read in the
same statement uses the snapshot taken *before* the wait and does not see the new row: the
statement returns no row at all. The store then simply runs the statement again; the new
statement takes a new snapshot and returns the winner (EXISTING). If that transaction rolls
back, the insert goes ahead after the wait and returns our row (NEW). So: a new key and a
duplicate cost one round trip; only a claim that raced an uncommitted insert costs two.

An expired record, or a stale claim this claim may take over, is replaced by a second statement,
a compare-and-set on the token that was read (tokens are never reused), exactly like the SQLite
dialect. The rules are those of :mod:`oncely._core.state`, written in SQL.

Time
====

``%(now)s`` is the fixed time of a test clock, or NULL: then the statement reads the server's
``clock_timestamp()`` once (in a one-row subquery) and uses that value everywhere, and returns
it, so ``Claim.now_ms`` is the time the decision was made with. ``now()`` would be the start of
the caller's transaction, possibly long ago: leases would be short by that much.

Statements are ``bytes``: psycopg takes them as already encoded SQL (the text is built once from
checked identifiers, never from values), and its type hints reject non-literal ``str``. Rows are
parsed as SQLite's are (:mod:`oncely.stores._sql`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Final

from oncely.stores._sql import (
    MAX_CONSUMERS,
    SMALL,
    PlainRows,
    bucket_sql,
    check_identifier,
    parse_record,
)

__all__ = ["SCHEMA_REVISION", "SCHEMA_VERSION", "PostgresDialect", "parse_record", "text_array"]

SCHEMA_VERSION: Final = 1
SCHEMA_REVISION: Final = 2
"""2: the purge_ms column and its index (see :data:`oncely.stores._sql.PURGE_BUCKET_MS`)."""

# Vacuum the inbox after 2% of its rows changed (PostgreSQL's default: 20%, which at 10^8 rows
# lets 2x10^7 dead rows pile up first); set on the table by migrate.
_AUTOVACUUM: Final = (
    "autovacuum_vacuum_scale_factor = 0.02, autovacuum_vacuum_insert_scale_factor = 0.02, "
    "autovacuum_analyze_scale_factor = 0.02"
)

_FIELDS: Final = (
    "status",
    "fingerprint",
    "token",
    "attempt",
    "created_ms",
    "updated_ms",
    "lease_until_ms",
    "expires_ms",
    "result",
    "error",
)
_COLUMNS: Final = ", ".join(_FIELDS)
_T_COLUMNS: Final = ", ".join(f"t.{name}" for name in _FIELDS)

# The server's clock in epoch milliseconds, unless the store was given a clock.
_NOW: Final = (
    "(SELECT COALESCE(%(now)s::bigint, "
    "floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint) AS now) AS n"
)

# purge_ms (see oncely.stores._sql.PURGE_BUCKET_MS) for a claim's expiry, and a completion's.
_SPAN_BUCKET: Final = bucket_sql("n.now + %(span)s::bigint")
_KEEP_BUCKET: Final = bucket_sql("n.now + %(keep)s::bigint")

# When the current transaction started, in microseconds: the same for every statement of one
# transaction, different for the next one on the same connection (read without writing).
_TX_STARTED: Final = "(extract(epoch FROM transaction_timestamp()) * 1000000)::bigint"


def text_array(values: Sequence[str | None]) -> str:
    """``values`` as a PostgreSQL array literal (``None`` is NULL), for a ``%s::text[]``
    parameter. psycopg's list dumper quotes element by element in Python; this is a join and
    three scans in the common case (no NULL, no quote, no backslash), and exact otherwise."""
    if not values:
        return "{}"
    if None not in values:
        joined = '","'.join(values)  # type: ignore[arg-type]
        # No quote but the separators' and no backslash: nothing to escape.
        if joined.count('"') == 2 * len(values) - 2 and "\\" not in joined:
            return '{"' + joined + '"}'
    return (
        "{"
        + ",".join(
            "NULL" if v is None else '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
            for v in values
        )
        + "}"
    )


def _b(text: str) -> bytes:
    return text.encode()


def _claim(t: str, extra: str) -> str:
    """The one-key claim on table ``t``; ``extra`` adds columns (after ``now``) to its row."""
    return f"""WITH n AS MATERIALIZED (SELECT COALESCE(%(now)s::bigint,
                    floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint) AS now),
            ins AS (
                INSERT INTO {t} AS t (consumer, key, status, fingerprint, token, attempt,
                    created_ms, updated_ms, lease_until_ms, expires_ms, result, error, purge_ms)
                SELECT %(consumer)s::text, %(key)s::text, %(status)s::text,
                    %(fingerprint)s::text, %(token)s::text, 1, n.now, n.now,
                    n.now + %(lease)s::bigint, n.now + %(span)s::bigint, NULL, %(error)s::text,
                    {_SPAN_BUCKET}
                FROM n
                ON CONFLICT (consumer, key) DO NOTHING
                RETURNING {_T_COLUMNS})
            SELECT true, ins.*, n.now{extra} FROM ins, n
            UNION ALL
            SELECT false, {_T_COLUMNS}, n.now{extra} FROM {t} AS t, n
            WHERE t.consumer = %(consumer)s::text AND t.key = %(key)s::text
                AND NOT EXISTS (SELECT FROM ins)"""


class PostgresDialect(PlainRows[bytes]):
    """Every statement for one inbox table in one schema, built once."""

    __slots__ = (
        "_set_revision",
        "add_purge_column",
        "claim",
        "claim_joined",
        "claim_many",
        "complete",
        "complete_many",
        "create",
        "create_purge_index",
        "drop_purge_index",
        "estimate_consumers",
        "estimate_table",
        "fail",
        "forget",
        "forget_by_token",
        "get",
        "lock_key",
        "meta_table",
        "names",
        "plan_consumer",
        "plan_expired",
        "purge",
        "purge_index",
        "purge_index_valid",
        "purge_lock_key",
        "read_version",
        "regclass",
        "release",
        "renew",
        "replace",
        "sample",
        "scan",
        "schema",
        "set_autovacuum",
        "set_result",
        "set_revision",
        "stats",
        "table",
        "takeover",
    )

    def __init__(self, schema: str = "public", table: str = "oncely_inbox") -> None:
        self.schema = check_identifier(schema)
        self.table = check_identifier(table)
        self.meta_table = check_identifier(f"{table}_meta")
        # Names are quoted, so they are used exactly as given (case included) and a name that
        # happens to be a keyword still works; check_identifier allows nothing to escape.
        t = f'"{self.schema}"."{self.table}"'
        m = f'"{self.schema}"."{self.meta_table}"'
        digest = hashlib.sha256(f"oncely:{self.schema}.{self.table}".encode()).digest()
        # Serialises concurrent migrations of this table: CREATE TABLE IF NOT EXISTS run at
        # the same moment by two sessions can still fail on the catalog's unique index.
        self.lock_key = int.from_bytes(digest[:8], "big", signed=True)
        # One purge leader per table (the purge service's session-level advisory lock).
        purge = hashlib.sha256(f"oncely-purge:{self.schema}.{self.table}".encode()).digest()
        self.purge_lock_key = int.from_bytes(purge[:8], "big", signed=True)
        # Which of the table, its meta table and the schema exist (parameters: ``names``).
        self.regclass = _b(
            "SELECT to_regclass(%(table)s) IS NOT NULL, to_regclass(%(meta)s) IS NOT NULL, "
            "to_regnamespace(%(schema)s) IS NOT NULL"
        )
        self.names = {"table": t, "meta": m, "schema": f'"{self.schema}"'}
        self.read_version = _b(
            f"SELECT name, value FROM {m} WHERE name IN ('schema_version', 'revision')"
        )
        self.purge_index = check_identifier(f"{table}_purge"[:63])
        self._set_revision = (
            f"INSERT INTO {m} (name, value) VALUES ('revision', '{SCHEMA_REVISION}') "
            "ON CONFLICT (name) DO UPDATE SET value = EXCLUDED.value"
        )
        # Revision 1 -> 2, online: ADD COLUMN with a constant default only writes the catalog
        # (PostgreSQL 11 and later), under a lock the caller bounds with lock_timeout; the
        # index is built CONCURRENTLY (outside any transaction, claims go on meanwhile); an
        # index a failed build left invalid is dropped and built again. Rows written before
        # (purge_ms 0) are found by the first purge and moved to their minute.
        self.add_purge_column = _b(
            f"ALTER TABLE {t} ADD COLUMN IF NOT EXISTS purge_ms BIGINT NOT NULL DEFAULT 0"
        )
        self.set_autovacuum = _b(f"ALTER TABLE {t} SET ({_AUTOVACUUM})")
        self.purge_index_valid = _b(
            "SELECT i.indisvalid FROM pg_index AS i JOIN pg_class AS c ON c.oid = i.indexrelid "
            "JOIN pg_namespace AS s ON s.oid = c.relnamespace "
            "WHERE s.nspname = %(schema)s AND c.relname = %(index)s"
        )
        self.drop_purge_index = _b(
            f'DROP INDEX CONCURRENTLY IF EXISTS "{self.schema}"."{self.purge_index}"'
        )
        self.create_purge_index = _b(
            f'CREATE INDEX CONCURRENTLY IF NOT EXISTS "{self.purge_index}" ON {t} (purge_ms)'
        )
        self.set_revision = _b(self._set_revision)
        # consumer and key compare byte-wise (COLLATE "C"): the order of scan() is Python's
        # string order, and comparisons skip the locale's rules (faster). The purge walks the
        # index on purge_ms, the expiry's minute (oncely.stores._sql.PURGE_BUCKET_MS): a
        # completion or renewal keeps its minute, so it stays a HOT update (heap-only: no
        # index write at all), which an index on expires_ms itself would forbid. fillfactor 90
        # leaves room on each page for those HOT updates of freshly inserted rows.
        self.create = (
            _b(f'CREATE SCHEMA IF NOT EXISTS "{self.schema}"'),
            _b(
                f"""CREATE TABLE IF NOT EXISTS {t} (
                consumer TEXT COLLATE "C" NOT NULL,
                key TEXT COLLATE "C" NOT NULL,
                status TEXT NOT NULL CHECK (status IN ('in_progress', 'completed', 'failed')),
                fingerprint TEXT,
                token TEXT NOT NULL,
                attempt INTEGER NOT NULL,
                created_ms BIGINT NOT NULL,
                updated_ms BIGINT NOT NULL,
                lease_until_ms BIGINT NOT NULL,
                expires_ms BIGINT NOT NULL,
                result BYTEA,
                error TEXT,
                purge_ms BIGINT NOT NULL DEFAULT 0,
                PRIMARY KEY (consumer, key)
            ) WITH (fillfactor = 90, {_AUTOVACUUM})"""
            ),
            # A table left without its meta rows is created "again": give it the column first.
            self.add_purge_column,
            _b(f'CREATE INDEX IF NOT EXISTS "{self.purge_index}" ON {t} (purge_ms)'),
            _b(f"CREATE TABLE IF NOT EXISTS {m} (name TEXT PRIMARY KEY, value TEXT NOT NULL)"),
            _b(
                f"INSERT INTO {m} (name, value) VALUES ('schema_version', '{SCHEMA_VERSION}') "
                "ON CONFLICT (name) DO NOTHING"
            ),
            _b(self._set_revision),
        )
        self.claim = _b(_claim(t, ""))
        # The same claim for a caller's transaction under a savepoint: also returns when that
        # transaction started, which tells two transactions of one connection apart (the
        # store bounds how many of its savepoints stay open in one transaction).
        self.claim_joined = _b(_claim(t, f", {_TX_STARTED}"))
        expired = "t.expires_ms <= n.now"
        agrees = (
            "(%(fingerprint)s::text IS NULL OR t.fingerprint IS NULL "
            "OR t.fingerprint = %(fingerprint)s::text)"
        )
        # Replace an expired record, or take over a stale claim, but only if the record still
        # carries the token the caller saw (compare-and-set: tokens are never reused). A
        # concurrent writer makes this match nothing, and the caller looks again.
        self.replace = _b(
            f"""UPDATE {t} AS t SET
                status = %(status)s::text,
                fingerprint = CASE WHEN {expired} THEN %(fingerprint)s::text
                    ELSE COALESCE(%(fingerprint)s::text, t.fingerprint) END,
                token = %(token)s::text,
                attempt = CASE WHEN {expired} THEN 1 ELSE t.attempt + 1 END,
                created_ms = CASE WHEN {expired} THEN n.now ELSE t.created_ms END,
                updated_ms = n.now,
                lease_until_ms = n.now + %(lease)s::bigint,
                expires_ms = n.now + %(span)s::bigint,
                purge_ms = {_SPAN_BUCKET},
                result = NULL,
                error = %(error)s::text
            FROM {_NOW}
            WHERE t.consumer = %(consumer)s::text AND t.key = %(key)s::text
                AND t.token = %(seen)s::text
                AND ({expired}
                    OR (%(takeover)s::boolean AND t.status = 'in_progress'
                        AND t.lease_until_ms <= n.now AND {agrees}))
            RETURNING {_T_COLUMNS}, n.now"""
        )
        mine = (
            "t.consumer = %(consumer)s::text AND t.key = %(key)s::text "
            "AND t.token = %(token)s::text"
        )
        live = "t.expires_ms > n.now"
        self.takeover = _b(
            f"""UPDATE {t} AS t SET
                status = 'in_progress',
                fingerprint = COALESCE(%(fingerprint)s::text, t.fingerprint),
                token = %(new_token)s::text,
                attempt = t.attempt + 1,
                updated_ms = n.now,
                lease_until_ms = n.now + %(lease)s::bigint,
                expires_ms = n.now + %(span)s::bigint,
                purge_ms = {_SPAN_BUCKET},
                result = NULL,
                error = NULL
            FROM {_NOW}
            WHERE {mine} AND t.status = 'in_progress' AND t.lease_until_ms <= n.now AND {live}
                AND {agrees}
            RETURNING {_T_COLUMNS}, n.now"""
        )
        self.complete = _b(
            f"""UPDATE {t} AS t SET status = 'completed', updated_ms = n.now,
                expires_ms = n.now + %(keep)s::bigint, purge_ms = {_KEEP_BUCKET},
                result = %(result)s::bytea, error = %(note)s::text
            FROM {_NOW}
            WHERE {mine} AND t.status = 'in_progress' AND {live}
            RETURNING {_T_COLUMNS}"""
        )
        # One UPDATE for a batch of completions; a key repeated in the batch is completed by
        # its first entry (an UPDATE changes a row once). Rows not returned (a lost lease, or
        # a repeat of a completion that already landed) are decided by the one-key path.
        self.complete_many = _b(
            f"""UPDATE {t} AS t SET status = 'completed', updated_ms = n.now,
                expires_ms = n.now + %(keep)s::bigint, purge_ms = {_KEEP_BUCKET},
                result = c.result, error = c.note
            FROM {_NOW}, unnest(%(keys)s::text[], %(tokens)s::text[], %(results)s::bytea[],
                %(notes)s::text[]) AS c(key, token, result, note)
            WHERE t.consumer = %(consumer)s::text AND t.key = c.key COLLATE "C"
                AND t.token = c.token AND t.status = 'in_progress' AND {live}
            RETURNING t.key, {_T_COLUMNS}"""
        )
        self.fail = _b(
            f"""UPDATE {t} AS t SET status = 'failed', updated_ms = n.now,
                expires_ms = n.now + %(keep)s::bigint, purge_ms = {_KEEP_BUCKET},
                result = NULL, error = %(error)s::text
            FROM {_NOW}
            WHERE {mine} AND t.status = 'in_progress' AND {live}
            RETURNING {_T_COLUMNS}"""
        )
        self.renew = _b(
            f"""UPDATE {t} AS t SET updated_ms = n.now,
                lease_until_ms = n.now + %(lease)s::bigint, expires_ms = n.now + %(span)s::bigint,
                purge_ms = LEAST(t.purge_ms, {_SPAN_BUCKET})
            FROM {_NOW}
            WHERE {mine} AND t.status = 'in_progress' AND {live}
            RETURNING {_T_COLUMNS}"""
        )
        self.release = _b(
            f"""DELETE FROM {t} AS t USING {_NOW}
            WHERE {mine} AND t.status = 'in_progress' AND {live}
            RETURNING 1"""
        )
        self.set_result = _b(f"UPDATE {t} AS t SET result = %(result)s::bytea WHERE {mine}")
        self.get = _b(
            f"""SELECT {_T_COLUMNS} FROM {t} AS t, {_NOW}
            WHERE t.consumer = %(consumer)s::text AND t.key = %(key)s::text AND {live}"""
        )
        self.forget = _b(
            f"DELETE FROM {t} WHERE consumer = %(consumer)s::text AND key = %(key)s::text "
            "RETURNING 1"
        )
        self.forget_by_token = _b(
            f"""DELETE FROM {t} AS t USING {_NOW}
            WHERE {mine} AND {live}
                AND NOT (t.status = 'in_progress' AND t.lease_until_ms > n.now)
            RETURNING 1"""
        )
        # Purging walks the purge_ms index from its start: the rows of minutes that ended
        # (all expired, or behind their expiry and moved forward), then those of the current
        # minute that are expired. Each batch is one short statement; every row it takes is
        # deleted or moved out of the range, so the next batch starts from the index's start
        # again. SKIP LOCKED: a row a claim is re-using right now is not worth waiting for
        # (it is no longer expired), and the DELETE re-checks expiry on the row's latest
        # version anyway. The DELETE and UPDATE find the rows by tuple id (ctid): a row this
        # statement locked cannot move before they run, and a lookup by ctid skips one
        # primary-key descent per row (at 10^7 rows the purge went from 28,287 to 292,502
        # rows/s, bench/scale.py). The answer: rows taken, deleted, moved. The bounds are scalar
        # subqueries: the planner then makes them the index scan's condition (a join with n
        # read the whole index and filtered it: 0.84 s at 3x10^5 rows with nothing expired).
        current = bucket_sql("c.now")
        self.purge = _b(
            f"""WITH n AS MATERIALIZED (SELECT c.now, {current} AS cur
                FROM (SELECT COALESCE(%(now)s::bigint,
                    floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint) AS now) AS c),
            doomed AS MATERIALIZED (
                SELECT t.ctid AS tid FROM {t} AS t
                WHERE t.purge_ms <= (SELECT cur FROM n)
                    AND (t.purge_ms < (SELECT cur FROM n)
                        OR t.expires_ms <= (SELECT now FROM n))
                ORDER BY t.purge_ms
                LIMIT %(limit)s
                FOR UPDATE OF t SKIP LOCKED),
            gone AS (
                DELETE FROM {t} AS t USING n
                WHERE t.ctid = ANY (ARRAY(SELECT tid FROM doomed)) AND {expired}
                RETURNING 1),
            moved AS (
                UPDATE {t} AS t SET purge_ms = {bucket_sql("t.expires_ms")}
                FROM n
                WHERE t.ctid = ANY (ARRAY(SELECT tid FROM doomed))
                    AND NOT ({expired}) AND t.purge_ms < {bucket_sql("t.expires_ms")}
                RETURNING 1)
            SELECT (SELECT count(*) FROM doomed), (SELECT count(*) FROM gone),
                (SELECT count(*) FROM moved)"""
        )
        # One pass over the table: live counts per (consumer, status) and the expired total.
        self.stats = _b(
            f"""SELECT t.consumer, t.status, count(*) FILTER (WHERE {live}),
                count(*) FILTER (WHERE NOT ({live}))
            FROM {t} AS t, {_NOW}
            GROUP BY t.consumer, t.status"""
        )
        # stats(exact=False): the database's statistics and bounded index reads only.
        # The table: its clock reading, whether ANALYZE has run (column statistics exist:
        # reltuples is -1 before on PostgreSQL 14+, and the planner's guesses are then
        # rough), the status column's most common values, the heap's current size in pages
        # (for the sample below), and the expired records counted off the purge index's
        # start, at most SMALL + 1 of them (a purge that keeps up leaves fewer: exact).
        stat = (
            "FROM pg_stats AS s WHERE s.schemaname = %(schema)s AND s.tablename = %(table)s "
            "AND NOT s.inherited AND s.attname = "
        )
        self.estimate_table = _b(
            f"""WITH n AS MATERIALIZED (SELECT c.now, {bucket_sql("c.now")} AS cur
                FROM (SELECT COALESCE(%(now)s::bigint,
                    floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint) AS now) AS c)
            SELECT n.now, n.cur,
                EXISTS (SELECT {stat}'consumer'),
                (SELECT s.most_common_vals::text::text[] {stat}'status'),
                (SELECT s.most_common_freqs {stat}'status'),
                pg_relation_size(%(regclass)s::regclass)
                    / current_setting('block_size')::bigint,
                (SELECT count(*) FROM (SELECT FROM {t} AS t
                    WHERE t.purge_ms <= n.cur AND (t.purge_ms < n.cur OR t.expires_ms <= n.now)
                    LIMIT {SMALL + 1}) AS x)
            FROM n"""
        )
        # The consumers, by a skip scan of the primary key (one descent per consumer, the
        # recursive CTE PostgreSQL's wiki gives for a "loose index scan"), each with its
        # first SMALL + 1 rows counted (live ones apart). ORDER BY keeps the bounded read on
        # the primary key whatever the planner believes of the consumer.
        self.estimate_consumers = _b(
            f"""WITH RECURSIVE c AS (
                (SELECT t.consumer FROM {t} AS t ORDER BY t.consumer LIMIT 1)
                UNION ALL
                SELECT (SELECT t.consumer FROM {t} AS t WHERE t.consumer > c.consumer
                    ORDER BY t.consumer LIMIT 1)
                FROM c WHERE c.consumer IS NOT NULL)
            SELECT c.consumer, x.seen, x.live
            FROM (SELECT consumer FROM c WHERE consumer IS NOT NULL
                LIMIT {MAX_CONSUMERS}) AS c,
            LATERAL (SELECT count(*) AS seen,
                    count(*) FILTER (WHERE r.expires_ms > %(now)s::bigint) AS live
                FROM (SELECT t.expires_ms FROM {t} AS t WHERE t.consumer = c.consumer
                    ORDER BY t.consumer, t.key LIMIT {SMALL + 1}) AS r) AS x"""
        )
        # The planner's row estimates (what it would plan a query with: its statistics,
        # reltuples scaled by the heap's current size), for a larger consumer's live
        # records.
        self.plan_consumer = _b(
            f"""EXPLAIN (FORMAT JSON) SELECT FROM {t} AS t
            WHERE t.consumer = %(consumer)s::text AND t.expires_ms > %(now)s::bigint"""
        )
        # The expired: the rows of the minutes that ended (the current minute's expired
        # ones are left out: the planner would multiply the two conditions' selectivities as
        # if they were independent, and they are not).
        self.plan_expired = _b(
            f"EXPLAIN (FORMAT JSON) SELECT FROM {t} AS t WHERE t.purge_ms < %(cur)s::bigint"
        )
        # A table never analyzed: a sample of its pages (TABLESAMPLE SYSTEM reads only the
        # pages it picks), counted per consumer, status and expiry.
        self.sample = _b(
            f"""SELECT t.consumer, t.status, t.expires_ms > %(now)s::bigint, count(*)
            FROM {t} AS t TABLESAMPLE SYSTEM (%(percent)s::float8)
            GROUP BY 1, 2, 3"""
        )
        self.scan = _b(
            f"""SELECT t.consumer, t.key, {_T_COLUMNS} FROM {t} AS t, {_NOW}
            WHERE {live}
                AND (%(consumer)s::text IS NULL OR t.consumer = %(consumer)s::text)
                AND (%(status)s::text IS NULL OR t.status = %(status)s::text)
                AND (t.consumer, t.key) > (%(after_consumer)s::text, %(after_key)s::text)
            ORDER BY t.consumer, t.key
            LIMIT %(limit)s"""
        )
        # A batch of claims in one statement. The rows are inserted in key order (then request
        # order): two batches sharing keys take their row locks in the same order, so they
        # cannot deadlock, and of a key repeated in the batch the first request inserts it
        # (DO NOTHING skips rows that conflict with rows of the same command). The answer is
        # one row per request, in request order: now, whether the request's own row went in
        # (true), another request of the batch inserted the key (false) or nobody did (NULL),
        # and only in that last case the row visible before the statement. An inserted row is
        # not sent back: the caller knows every value it holds. The existing row is read by
        # a lateral lookup on the primary key, skipped for inserted keys; its LIMIT keeps the
        # planner from turning it into a join, which it may plan as a scan of every row of
        # the consumer when the table's statistics are stale (a fresh, fast-growing table).
        self.claim_many = _b(
            f"""WITH n AS MATERIALIZED (SELECT COALESCE(%(now)s::bigint,
                    floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint) AS now),
            req AS MATERIALIZED (
                SELECT r.key COLLATE "C" AS key, r.fingerprint, r.token, r.ord
                FROM unnest(%(keys)s::text[], %(fingerprints)s::text[], %(tokens)s::text[])
                    WITH ORDINALITY AS r(key, fingerprint, token, ord)),
            ins AS (
                INSERT INTO {t} AS t (consumer, key, status, fingerprint, token, attempt,
                    created_ms, updated_ms, lease_until_ms, expires_ms, result, error, purge_ms)
                SELECT %(consumer)s::text, req.key, 'in_progress', req.fingerprint, req.token,
                    1, n.now, n.now, n.now + %(lease)s::bigint, n.now + %(span)s::bigint,
                    NULL, NULL, {_SPAN_BUCKET}
                FROM req, n
                ORDER BY req.key, req.ord
                ON CONFLICT (consumer, key) DO NOTHING
                RETURNING t.key, t.token)
            SELECT n.now, ins.token = req.token, e.*
            FROM req CROSS JOIN n
                LEFT JOIN ins ON ins.key = req.key
                LEFT JOIN LATERAL (
                    SELECT {_T_COLUMNS} FROM {t} AS t
                    WHERE ins.key IS NULL
                        AND t.consumer = %(consumer)s::text AND t.key = req.key
                    LIMIT 1) AS e ON true
            ORDER BY req.ord"""
        )

"""MariaDB / MySQL (InnoDB): the schema and every statement of the store contract, as text.

Layout. ``consumer``, ``key``, ``token`` and ``fingerprint`` are ``VARBINARY`` holding UTF-8:
comparisons are byte for byte, so keys are case-sensitive and ``"k"`` and ``"k "`` are two
keys (every ``utf8mb4_*`` collation but the ``nopad`` ones, whose names differ between MariaDB
and MySQL, ignores trailing spaces; the default ones also ignore case and accents); every
valid Unicode character round-trips, 4-byte ones included; and ``ORDER BY consumer, key`` is
code point order, as Python sorts strings. An InnoDB index key holds at most 3072 bytes
(DYNAMIC rows, 16 KiB pages), and a utf8mb4 column counts 4 bytes per character there: the
primary key ``(consumer VARBINARY(800), key VARBINARY(2048))`` needs 2848, so it covers a
200-character consumer of 4-byte characters (oncely's limit) and keys up to 2048 bytes, four
times ``Limits.max_key_bytes``' default of 512 (``Limits`` allows up to 4096: a longer key is
refused with :class:`~oncely.KeyTooLong` before any statement; ``hash_long_keys`` fits it).
Times are BIGINT epoch milliseconds; the result is a LONGBLOB (its real bound is the server's
``max_allowed_packet``, which bounds the statement that writes it in hex: the store reads it
per connection and keeps a larger result out, see ``result_room``).

Claims. A new key is one ``INSERT ... ON DUPLICATE KEY UPDATE``: the unique primary key makes
InnoDB the arbiter (R8, R9), and a claimer of a key whose first claimer has not committed yet
waits on that row's lock, then inserts (the first rolled back) or finds it (it committed).
``LAST_INSERT_ID(expr)`` reports which branch ran in the OK packet, whatever
``CLIENT_FOUND_ROWS`` the connection was opened with: ``now + 1`` from the insert, ``0`` from
the duplicate branch, which changes nothing. Only a duplicate reads the row (with ``now``);
the store decides in Python with :mod:`oncely._core.state` and writes any change with a
compare-and-set on the row version it read. A batch is one multi-row insert of the same kind,
its values written as hex literals (no per-value escaping by the driver); its OK packet says
whether every key went in (then nothing is read back: the rows are what was sent), and only
otherwise are the batch's rows read.

Time. ``now`` is the server's clock, ``UTC_TIMESTAMP(3)`` counted from the epoch: constant
within a statement, and independent of the session time zone (``UNIX_TIMESTAMP(NOW(3))``
converts through the session zone and is ambiguous in the hour a DST change repeats). A store
given a clock binds ``%(now)s`` instead.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Final

from oncely._core.records import Record, Status
from oncely._core.state import ClaimEvent
from oncely.errors import InvalidIdentifier, InvalidKey, KeyTooLong, StoreError
from oncely.stores._compact import (
    REVISION_NOTE,
    SCHEMA_REVISION,
    SCHEMA_VERSION,
    pack_fingerprint,
    pack_token,
    unpack_fingerprint,
    unpack_token,
)
from oncely.stores._sql import SMALL, STATUS, bucket_sql, check_identifier

__all__ = [
    "MAX_CONSUMER_BYTES",
    "MAX_KEY_BYTES",
    "MAX_TOKEN_BYTES",
    "REVISION_NOTE",
    "SCHEMA_REVISION",
    "SCHEMA_VERSION",
    "SERVER_NOW",
    "WIDTH",
    "BatchRow",
    "MySQLDialect",
    "batch_rows",
    "claim_params",
    "parse_record",
    "utf8",
    "who",
    "write_params",
]

MAX_CONSUMER_BYTES: Final = 800
MAX_KEY_BYTES: Final = 2048
MAX_TOKEN_BYTES: Final = 255  # tokens and fingerprints

SERVER_NOW: Final = (
    "(TIMESTAMPDIFF(MICROSECOND, TIMESTAMP'1970-01-01 00:00:00', UTC_TIMESTAMP(3)) DIV 1000)"
)

# A record's columns as a row. The status and the five numbers travel as one text column:
# PyMySQL parses every column's metadata packet in Python for each result, about 3 µs of CPU
# per column, so a record read is 6 columns cheaper this way (about 17 µs less per read).
# None of those values can hold a space, and none is NULL.
_COLUMNS: Final = (
    "CONCAT_WS(' ', status, attempt, created_ms, updated_ms, lease_until_ms, expires_ms), "
    "fingerprint, token, result, error"
)
WIDTH: Final = 5
"""How many columns :data:`_COLUMNS` returns: a column after them is at this index."""
_WHO = "consumer = %(consumer)s AND `key` = %(key)s"


def utf8(text: str, what: str, limit: int | None = None) -> bytes:
    """``text`` as the UTF-8 bytes a VARBINARY column holds; refused (before any statement,
    so a session that is not strict never truncates it) when over ``limit``."""
    try:
        data = text.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidKey(
            f"a {what} must be valid Unicode text; this one holds a lone surrogate"
        ) from None
    if limit is not None and len(data) > limit:
        message = f"the {what} is {len(data)} bytes, over this store's column of {limit}"
        if what == "key":
            raise KeyTooLong(f"{message}: lower Limits.max_key_bytes or set hash_long_keys=True")
        if what == "consumer":
            raise InvalidIdentifier(message)
        raise StoreError(message)
    return data


def _packed(text: str, what: str, pack: Callable[[str], bytes | None]) -> bytes:
    """A token or fingerprint in its stored form (:mod:`oncely.stores._compact`), refused
    as :func:`utf8` refuses text."""
    try:
        data = pack(text)
    except UnicodeEncodeError:
        raise InvalidKey(
            f"a {what} must be valid Unicode text; this one holds a lone surrogate"
        ) from None
    assert data is not None
    if len(data) > MAX_TOKEN_BYTES:
        raise StoreError(
            f"the {what} is {len(data)} bytes, over this store's column of {MAX_TOKEN_BYTES}"
        )
    return data


def _fingerprint(text: str | None) -> bytes | None:
    return None if text is None else _packed(text, "fingerprint", pack_fingerprint)


def _token(text: str) -> bytes:
    return _packed(text, "token", pack_token)


def who(consumer: str, key: str) -> dict[str, Any]:
    """The parameters naming one record (and ``now``, bound when a clock is given)."""
    return {"consumer": utf8(consumer, "consumer"), "key": utf8(key, "key"), "now": None}


def claim_params(ev: ClaimEvent) -> dict[str, Any]:
    """The parameters of :attr:`MySQLDialect.insert` for one claim."""
    return {
        "consumer": utf8(ev.consumer, "consumer", MAX_CONSUMER_BYTES),
        "key": utf8(ev.key, "key", MAX_KEY_BYTES),
        "status": ev.initial.value,
        "fingerprint": _fingerprint(ev.fingerprint),
        "token": _token(ev.token),
        "lease": ev.lease_ms if ev.initial is Status.IN_PROGRESS else 0,
        "span": max(ev.keep_ms, ev.lease_ms),
        "error": ev.error,
        "now": None,
    }


def write_params(names: dict[str, Any], seen: Record, new: Record | None) -> dict[str, Any]:
    """The parameters of :attr:`MySQLDialect.write` (or, without ``new``, of
    :attr:`MySQLDialect.delete`): the row ``names`` names, only while it is ``seen`` (its
    token in either stored form: a row written before schema version 2 holds its text)."""
    values: dict[str, Any] = {
        "consumer": names["consumer"],
        "key": names["key"],
        "token": _token(seen.token),
        "token_text": seen.token.encode("utf-8"),
        "status": seen.status.value,
        "updated": seen.updated_ms,
        "lease_until": seen.lease_until_ms,
        "expires": seen.expires_ms,
    }
    if new is not None:
        values.update(
            n_status=new.status.value,
            n_fingerprint=_fingerprint(new.fingerprint),
            n_token=_token(new.token),
            n_attempt=new.attempt,
            n_created=new.created_ms,
            n_updated=new.updated_ms,
            n_lease_until=new.lease_until_ms,
            n_expires=new.expires_ms,
            n_result=new.result,
            n_error=new.error,
        )
    return values


BatchRow = tuple[str, bytes, bytes | None, bytes]
"""One key of a batch claim: the key, and its UTF-8 bytes, fingerprint and token."""


def batch_rows(events: Sequence[ClaimEvent]) -> tuple[dict[str, int], list[BatchRow]]:
    """For a batch of one consumer's claims: the index of each key's first request, and each
    distinct key's row (its first request's fingerprint and token) in byte order, the order
    every batch locks rows in (so overlapping batches queue instead of deadlocking). Every
    value is checked against its column, as :func:`claim_params` does."""
    first: dict[str, int] = {}
    for i, ev in enumerate(events):
        first.setdefault(ev.key, i)
    rows: list[BatchRow] = []
    for key, i in first.items():
        ev = events[i]
        rows.append(
            (
                key,
                utf8(key, "key", MAX_KEY_BYTES),
                _fingerprint(ev.fingerprint),
                _token(ev.token),
            )
        )
    rows.sort(key=_by_bytes)
    return first, rows


def _by_bytes(row: BatchRow) -> bytes:
    return row[1]


def _hex(value: bytes | None) -> str:
    # A hex literal holds nothing but hex digits: values go into the statement text safely,
    # without the driver's per-value escaping.
    return "NULL" if value is None else f"X'{value.hex()}'"


def parse_record(consumer: str, key: str, row: Sequence[Any]) -> Record:
    """A record from a row that starts with ``_COLUMNS`` (the packed status and numbers, then
    the fingerprint and token in their stored form, the result, the error)."""
    packed = row[0]
    if not isinstance(packed, str):
        packed = bytes(packed).decode("ascii")
    status, attempt, created, updated, lease_until, expires = packed.split(" ")
    result = row[3]
    return Record(
        consumer=consumer,
        key=key,
        status=STATUS[status],
        fingerprint=unpack_fingerprint(row[1]),
        token=unpack_token(row[2]),
        attempt=int(attempt),
        created_ms=int(created),
        updated_ms=int(updated),
        lease_until_ms=int(lease_until),
        expires_ms=int(expires),
        result=bytes(result) if result is not None else None,
        error=row[4],
    )


def _named_pairs(count: int) -> str:
    return ", ".join(f"(%(c{i})s, %(k{i})s)" for i in range(count))


class MySQLDialect:
    """Every statement for one inbox table, built once. Parameters are PyMySQL's
    ``%(name)s``; ``consumer``, ``key``, ``token`` and ``fingerprint`` bind as UTF-8 bytes."""

    __slots__ = (
        "add_purge_column",
        "add_purge_index",
        "columns",
        "count_consumer",
        "create",
        "delete",
        "estimate_table",
        "first_consumer",
        "forget",
        "forget_token",
        "get",
        "held",
        "insert",
        "meta_table",
        "next_consumer",
        "now",
        "purge_high",
        "purge_index_columns",
        "purge_low",
        "purge_share",
        "read",
        "read_locked",
        "read_version",
        "rebuild_purge_index",
        "set_result",
        "set_revision",
        "set_version",
        "stats",
        "table",
        "table_exists",
        "write",
    )

    def __init__(self, table: str = "oncely_inbox", *, server_clock: bool = True) -> None:
        t = check_identifier(table)
        self.table = t
        self.meta_table = m = check_identifier(f"{t}_meta")
        self.now = now = SERVER_NOW if server_clock else "%(now)s"
        self.create = (
            f"""CREATE TABLE IF NOT EXISTS `{t}` (
                consumer VARBINARY({MAX_CONSUMER_BYTES}) NOT NULL,
                `key` VARBINARY({MAX_KEY_BYTES}) NOT NULL,
                status ENUM('in_progress', 'completed', 'failed') NOT NULL,
                fingerprint VARBINARY({MAX_TOKEN_BYTES}) NULL,
                token VARBINARY({MAX_TOKEN_BYTES}) NOT NULL,
                attempt INT NOT NULL,
                created_ms BIGINT NOT NULL,
                updated_ms BIGINT NOT NULL,
                lease_until_ms BIGINT NOT NULL,
                expires_ms BIGINT NOT NULL,
                result LONGBLOB NULL,
                error MEDIUMTEXT NULL,
                purge_ms BIGINT NOT NULL DEFAULT 0,
                PRIMARY KEY (consumer, `key`),
                KEY `{t}_purge` (purge_ms, created_ms)
            ) ENGINE=InnoDB ROW_FORMAT=DYNAMIC DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin""",
            f"""CREATE TABLE IF NOT EXISTS `{m}` (
                name VARCHAR(64) NOT NULL PRIMARY KEY,
                value VARCHAR(64) NOT NULL
            ) ENGINE=InnoDB DEFAULT CHARSET=ascii COLLATE=ascii_bin""",
            f"INSERT INTO `{m}` (name, value) VALUES ('schema_version', '{SCHEMA_VERSION}') "
            "ON DUPLICATE KEY UPDATE name = name",
        )
        # A value may name a column set earlier in its row: purge_ms reads the expiry just set.
        bucket = bucket_sql("expires_ms", "DIV")
        self.read_version = (
            f"SELECT name, value FROM `{m}` WHERE name IN ('schema_version', 'revision')"
        )
        self.table_exists = (
            "SELECT 1 FROM information_schema.tables "
            f"WHERE table_schema = DATABASE() AND table_name = '{t}'"
        )
        # Revision 2, online: ADD COLUMN ... INSTANT only edits the data dictionary (MariaDB
        # 10.3+, MySQL 8.0.12+), and the index is built INPLACE with LOCK=NONE (claims go on
        # meanwhile). See oncely.stores._sql.PURGE_BUCKET_MS.
        self.columns = (
            "SELECT column_name, index_name FROM information_schema.columns AS c "
            "LEFT JOIN information_schema.statistics AS s USING (table_schema, table_name, "
            "column_name) WHERE c.table_schema = DATABASE() AND c.table_name = %(table)s "
            "AND c.column_name = 'purge_ms'"
        )
        self.add_purge_column = (
            f"ALTER TABLE `{t}` ADD COLUMN purge_ms BIGINT NOT NULL DEFAULT 0, ALGORITHM=INSTANT"
        )
        self.add_purge_index = (
            f"ALTER TABLE `{t}` ADD INDEX `{t}_purge` (purge_ms, created_ms), "
            "ALGORITHM=INPLACE, LOCK=NONE"
        )
        # Revision 3 also orders each minute of the purge index by the claim's time: a live
        # inbox then writes the index at its end, and InnoDB fills those pages (split at the
        # insert point) instead of leaving them half empty (split in the middle, as entries of
        # one minute ordered by key arrive in random order): 66 bytes an entry instead of
        # 116, measured at 10^6 records loaded in time order. created_ms changes with
        # purge_ms or not at all, so no write touches the index more often than before.
        self.purge_index_columns = (
            "SELECT column_name FROM information_schema.statistics "
            "WHERE table_schema = DATABASE() AND table_name = %(table)s "
            f"AND index_name = '{t}_purge' ORDER BY seq_in_index"
        )
        self.rebuild_purge_index = (
            f"ALTER TABLE `{t}` DROP INDEX `{t}_purge`, "
            f"ADD INDEX `{t}_purge` (purge_ms, created_ms), ALGORITHM=INPLACE, LOCK=NONE"
        )
        self.set_revision = (
            f"INSERT INTO `{m}` (name, value) VALUES ('revision', '{SCHEMA_REVISION}') "
            "ON DUPLICATE KEY UPDATE value = VALUES(value)"
        )
        # Revision 3: the version row of a table created at version 1 (its rows keep their
        # text tokens and fingerprints, which every statement still matches).
        self.set_version = (
            f"UPDATE `{m}` SET value = '{SCHEMA_VERSION}' WHERE name = 'schema_version'"
        )
        # Not INSERT IGNORE: IGNORE also turns a too-long value or a bad status into a warning
        # and stores a truncated key. The duplicate branch adds 0 and changes nothing.
        self.insert = f"""INSERT INTO `{t}` (consumer, `key`, status, fingerprint, token,
                attempt, created_ms, updated_ms, lease_until_ms, expires_ms, result, error,
                purge_ms)
            VALUES (%(consumer)s, %(key)s, %(status)s, %(fingerprint)s, %(token)s, 1,
                LAST_INSERT_ID({now} + 1) - 1, {now}, {now} + %(lease)s, {now} + %(span)s,
                NULL, %(error)s, {bucket})
            ON DUPLICATE KEY UPDATE created_ms = created_ms + LAST_INSERT_ID(0)"""
        self.read = f"SELECT {_COLUMNS}, {now} FROM `{t}` WHERE {_WHO}"
        # Inside a caller's transaction (REPEATABLE READ) a plain SELECT reads the snapshot of
        # the transaction's first read: a row another transaction committed since then (the
        # winner the INSERT just waited for) is invisible to it. A locking read returns the
        # latest committed version, and the INSERT's duplicate branch already holds that
        # row's exclusive lock, so it never waits.
        self.read_locked = f"{self.read} FOR UPDATE"
        seen = (
            "token IN (%(token)s, %(token_text)s) AND status = %(status)s "
            "AND updated_ms = %(updated)s "
            "AND lease_until_ms = %(lease_until)s AND expires_ms = %(expires)s"
        )
        # Compare-and-set on the version read: every write changes the token, the status or
        # the times, so a row still equal to them is the row the decision was made on. It sets
        # purge_ms to the expiry's minute: InnoDB writes the purge index only when that value
        # changes (a completion keeps the claim's minute).
        self.write = f"""UPDATE `{t}` SET status = %(n_status)s,
                fingerprint = %(n_fingerprint)s, token = %(n_token)s, attempt = %(n_attempt)s,
                created_ms = %(n_created)s, updated_ms = %(n_updated)s,
                lease_until_ms = %(n_lease_until)s, expires_ms = %(n_expires)s,
                purge_ms = {bucket_sql("%(n_expires)s", "DIV")},
                result = %(n_result)s, error = %(n_error)s
            WHERE {_WHO} AND {seen}"""
        self.delete = f"DELETE FROM `{t}` WHERE {_WHO} AND {seen}"
        self.set_result = f"UPDATE `{t}` SET result = %(result)s WHERE {_WHO} AND token = %(token)s"
        self.held = f"SELECT 1 FROM `{t}` WHERE {_WHO} AND token = %(token)s"
        self.get = f"SELECT {_COLUMNS} FROM `{t}` WHERE {_WHO} AND expires_ms > {now}"
        self.forget = f"DELETE FROM `{t}` WHERE {_WHO}"
        self.forget_token = f"DELETE FROM `{t}` WHERE {_WHO} AND token = %(token)s"
        self.stats = f"""SELECT consumer, status, SUM(expires_ms > {now}), SUM(expires_ms <= {now})
            FROM `{t}` GROUP BY consumer, status"""
        # stats(exact=False): InnoDB's statistics and bounded index reads, never the whole
        # table.
        # The clock reading (the statements after it bind it), the current minute, InnoDB's
        # row estimate, and the expired counted off the purge index's start, at most
        # SMALL + 1 of them (exact while a purge keeps up).
        cur = bucket_sql(now, "DIV")
        self.estimate_table = f"""SELECT {now}, {cur},
                (SELECT TABLE_ROWS FROM information_schema.TABLES
                    WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = %(table)s),
                (SELECT count(*) FROM (SELECT 1 FROM `{t}`
                    WHERE purge_ms <= {cur} AND (purge_ms < {cur} OR expires_ms <= {now})
                    LIMIT {SMALL + 1}) AS x)"""
        # The consumers one by one, each one descent of the primary key (MariaDB plans
        # neither DISTINCT nor a recursive CTE of these as a skip scan: both read the index).
        self.first_consumer = f"SELECT MIN(consumer) FROM `{t}`"
        self.next_consumer = f"SELECT MIN(consumer) FROM `{t}` WHERE consumer > %(after)s"
        # A consumer's first SMALL + 1 rows counted, live ones apart.
        self.count_consumer = f"""SELECT count(*), COALESCE(SUM(e > %(now)s), 0)
            FROM (SELECT expires_ms AS e FROM `{t}` WHERE consumer = %(consumer)s
                ORDER BY consumer, `key` LIMIT {SMALL + 1}) AS x"""
        # The sample of minutes (SQLStoreBase._sample_minutes): the purge index's ends, and
        # the rows per consumer of some minutes (minutes_consumers). InnoDB's own index dives
        # are no help here: a dive that is not exact is capped at half the table, and one
        # into a large range is a guess (measured at 10^6 rows: a 30% consumer read as 49%,
        # the expired 10% as 18%).
        # The purge's choice of path (MySQLStore._purge_path): the table's row estimate and
        # size against the buffer pool, and the purge index's entries up to the current
        # minute (expired, or the minute's few that soon will be), counted up to %(cap)s
        # (index only).
        self.purge_share = f"""SELECT TABLE_ROWS, DATA_LENGTH, @@innodb_buffer_pool_size,
                (SELECT count(*) FROM (SELECT 1 FROM `{t}` WHERE purge_ms <= {cur}
                    LIMIT %(cap)s) AS x)
            FROM information_schema.TABLES
            WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = %(table)s"""
        self.purge_low = f"SELECT MIN(purge_ms) FROM `{t}` WHERE purge_ms > 0"
        self.purge_high = f"SELECT MAX(purge_ms) FROM `{t}`"

    def claim_many_insert(
        self, consumer: bytes, rows: Sequence[BatchRow], lease: int, span: int, now: int | None
    ) -> str:
        """Insert ``rows`` of ``consumer`` where absent (existing rows are left as they are),
        as one statement whose values are literals. Its OK packet's insert id is ``now + 1``
        when every row went in, 0 when any key existed: the first row sets
        ``LAST_INSERT_ID(now + 1)``, each existing row ``LAST_INSERT_ID(0)``, later inserts
        leave it alone. ``now`` is the store's clock, or None for the server's."""
        n = SERVER_NOW if now is None else str(int(now))
        c = _hex(consumer)
        # A value may name a column set earlier in its row: the clock is read once per row
        # (each reading of the server's clock costs the server about a microsecond).
        bucket = bucket_sql("expires_ms", "DIV")
        times = (
            f"created_ms, created_ms + {int(lease)}, created_ms + {int(span)}, NULL, NULL, "
            f"{bucket})"
        )
        tails = (f", 1, LAST_INSERT_ID({n} + 1) - 1, {times}", f", 1, {n}, {times}")
        values = [
            f"({c}, {_hex(key)}, 'in_progress', {_hex(fingerprint)}, {_hex(token)}" + tails[i > 0]
            for i, (_, key, fingerprint, token) in enumerate(rows)
        ]
        return (
            f"INSERT INTO `{self.table}` (consumer, `key`, status, fingerprint, token, "
            "attempt, created_ms, updated_ms, lease_until_ms, expires_ms, result, error, "
            f"purge_ms) VALUES {', '.join(values)} "
            "ON DUPLICATE KEY UPDATE created_ms = created_ms + LAST_INSERT_ID(0)"
        )

    def claim_many_read(self, consumer: bytes, rows: Sequence[BatchRow], now: int | None) -> str:
        """The rows of ``rows``' keys of ``consumer``, each led by its key, and ``now``."""
        n = SERVER_NOW if now is None else str(int(now))
        keys = ", ".join(_hex(row[1]) for row in rows)
        return (
            f"SELECT `key`, {_COLUMNS}, {n} FROM `{self.table}` "
            f"WHERE consumer = {_hex(consumer)} AND `key` IN ({keys})"
        )

    def minutes_consumers(self, count: int) -> str:
        """The rows per consumer of ``count`` minutes of expiry (``%(m<i>)s``), read off the
        purge index (which holds the primary key's columns: no row is read)."""
        minutes = ", ".join(f"%(m{i})s" for i in range(count))
        return (
            f"SELECT consumer, count(*) FROM `{self.table}` WHERE purge_ms IN ({minutes}) "
            "GROUP BY consumer"
        )

    def purge_candidates(self, *, ended: bool, after: bool) -> str:
        """Up to ``%(limit)s`` rows of the purge index in its order (the minute, the claim's
        time, then the primary key, which InnoDB keeps in every secondary index), each with
        its minute and time.

        ``ended``: the rows of minutes that ended (expired, or behind an expiry that moved
        later), read off the index alone: no row is read, so the cost is the index entries
        (asking each row whether it expired, as one query once did, read 10^5 random rows of
        a 10^6-row table for 10^5 candidates: 5,000-7,000 rows/s). Otherwise the current
        minute's rows that expired, which are read (a minute of traffic at most).

        With ``after``, only rows past ``(%(p)s, %(t)s, %(c)s, %(k)s)``, where the previous
        batch ended: the entries before it are rows that batch deleted, which InnoDB keeps
        delete-marked in the index until its purge thread removes them, and a batch that
        started from the index's start would step over all of them again."""
        now, current = self.now, bucket_sql(self.now, "DIV")
        where = (
            f"purge_ms < {current}" if ended else (f"purge_ms = {current} AND expires_ms <= {now}")
        )
        cursor = (
            " AND (purge_ms > %(p)s OR (purge_ms = %(p)s AND (created_ms > %(t)s OR "
            "(created_ms = %(t)s AND (consumer > %(c)s OR "
            "(consumer = %(c)s AND `key` > %(k)s))))))"
            if after
            else ""
        )
        return (
            f"SELECT consumer, `key`, purge_ms, created_ms FROM `{self.table}` "
            f"WHERE {where}{cursor} "
            "ORDER BY purge_ms, created_ms, consumer, `key` LIMIT %(limit)s"
        )

    def purge_sweep(self, after: bool) -> str:
        """Up to ``%(limit)s`` expired keys in primary-key order, after ``(%(c)s, %(k)s)`` when
        ``after``: the purge's other path, a walk of the clustered index, read in order
        (written as OR/AND, which the range optimizer turns into an index range; a row
        comparison it may not)."""
        cursor = "(consumer > %(c)s OR (consumer = %(c)s AND `key` > %(k)s)) AND " if after else ""
        return (
            f"SELECT consumer, `key` FROM `{self.table}` WHERE {cursor}"
            f"expires_ms <= {self.now} ORDER BY consumer, `key` LIMIT %(limit)s"
        )

    def purge_delete(self, count: int) -> str:
        """Delete ``count`` (``%(c<i>)s``, ``%(k<i>)s``) rows that are still expired."""
        return (
            f"DELETE FROM `{self.table}` WHERE (consumer, `key`) IN ({_named_pairs(count)}) "
            f"AND expires_ms <= {self.now}"
        )

    def purge_move(self, count: int) -> str:
        """Move ``count`` (``%(c<i>)s``, ``%(k<i>)s``) unexpired rows whose purge_ms is behind
        their expiry to their expiry's minute."""
        bucket = bucket_sql("expires_ms", "DIV")
        return (
            f"UPDATE `{self.table}` SET purge_ms = {bucket} "
            f"WHERE (consumer, `key`) IN ({_named_pairs(count)}) "
            f"AND expires_ms > {self.now} AND purge_ms < {bucket}"
        )

    parse_record = staticmethod(parse_record)
    who = staticmethod(who)

    @staticmethod
    def parse_scanned(row: Sequence[Any]) -> Record:
        """A record from a row of :meth:`scan_query`'s statement: consumer, key, record."""
        return parse_record(bytes(row[0]).decode("utf-8"), bytes(row[1]).decode("utf-8"), row[2:])

    def scan_query(
        self,
        now: int | None,
        consumer: str | None,
        status: Status | None,
        after: tuple[str, str] | None,
        limit: int,
    ) -> tuple[str, dict[str, object]]:
        """Unexpired rows in primary-key order, led by consumer and key, filtered only by
        what is given (so the primary key serves the consumer filter); and the parameters."""
        params: dict[str, object] = {"now": now, "limit": int(limit)}
        where = [f"expires_ms > {self.now}"]
        if consumer is not None:
            params["consumer"] = utf8(consumer, "consumer")
            where.append("consumer = %(consumer)s")
        if status is not None:
            params["status"] = status.value
            where.append("status = %(status)s")
        if after is not None:
            params["after_consumer"] = utf8(after[0], "consumer")
            params["after_key"] = utf8(after[1], "key")
            where.append(
                "(consumer > %(after_consumer)s OR "
                "(consumer = %(after_consumer)s AND `key` > %(after_key)s))"
            )
        sql = (
            f"SELECT consumer, `key`, {_COLUMNS} FROM `{self.table}` WHERE "
            + " AND ".join(where)
            + " ORDER BY consumer, `key` LIMIT %(limit)s"
        )
        return sql, params

"""The MariaDB case of the servers section (``bench/servers.py``): oncely's store (PyMySQL)
against its statements run by hand, both modes, and batch claims."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from cases import ACCOUNTS, BenchError, Resources, expect, trivial
from server_common import (
    BALANCE_SQL,
    FP,
    KEEP_MS,
    LEASE_MS,
    LEDGER_SQL,
    MYSQL_URL,
    SPAN_MS,
    TX_NAMES,
    TX_VARIANTS,
    Database,
    Group,
    Tokens,
    Variant,
    batch_group,
    check_books,
    driver,
    marker_params,
    oncely_variants,
)
from server_trips import Trips

import oncely
from oncely.stores.mysql.dialect import WIDTH, MySQLDialect


class MariaDB(Database):
    name = "MariaDB"
    port = 3306
    driver = "pymysql"
    module = "oncely.stores.mysql.sync_store"

    def __init__(self) -> None:
        super().__init__(MYSQL_URL)

    def connect(self) -> Any:
        """A PyMySQL connection set up exactly as the store's (autocommit, FOUND_ROWS, the
        same session settings)."""
        s = driver("oncely.stores.mysql.errors").parse_url(self.url).settings
        return driver("pymysql").connect(database=s.database, **s.connect_kwargs())

    def _tables(self) -> None:
        if self.created:
            return
        setup = oncely.open(self.store_url)
        setup.migrate()
        setup.close()
        conn = self.connect()
        try:
            with conn.cursor() as cur:
                for v in TX_VARIANTS:
                    ledger, account = f"{self.table}_ledger_{v}", f"{self.table}_account_{v}"
                    cur.execute(
                        f"CREATE TABLE {ledger} (id BIGINT AUTO_INCREMENT PRIMARY KEY, "
                        "account_id INT NOT NULL, amount_cents BIGINT NOT NULL, "
                        "ref VARCHAR(64) NOT NULL) ENGINE=InnoDB"
                    )
                    cur.execute(
                        f"CREATE TABLE {account} (id INT PRIMARY KEY, "
                        "balance_cents BIGINT NOT NULL) ENGINE=InnoDB"
                    )
                    cur.executemany(
                        f"INSERT INTO {account} (id, balance_cents) VALUES (%s, 0)",
                        [(i,) for i in range(1, ACCOUNTS + 1)],
                    )
        finally:
            conn.close()
        self.created = True

    def groups(self, res: Resources, trips: Trips | None) -> list[Group]:
        self._tables()
        d = MySQLDialect(self.table)
        tokens = Tokens()
        store = oncely.open(self.store_url)
        res.add(store.close)
        fp = FP.encode()

        raw = self.connect()
        res.add(raw.close)

        def claim_params(key: str) -> dict[str, Any]:
            return {
                "consumer": b"raw",
                "key": key.encode(),
                "status": "in_progress",
                "fingerprint": fp,
                "token": tokens().encode(),
                "lease": LEASE_MS,
                "span": SPAN_MS,
                "error": None,
                "now": None,
            }

        def raw_new(msgs: list[tuple[str, Any]]) -> None:
            for k, p in msgs:
                params = claim_params(k)
                with raw.cursor() as cur:
                    cur.execute(d.insert, params)
                    inserted = cur.lastrowid
                if not inserted:
                    raise BenchError(f"raw claim of new key {k!r} did not insert")
                trivial(p)
                # complete, as the store does it: read the row, then compare-and-set
                with raw.cursor() as cur:
                    cur.execute(d.read, params)
                    row = cur.fetchone()
                # the store's read: status and numbers packed in its first column
                status, attempt, created, updated, lease_until, expires = row[0].split(" ")
                now = int(row[WIDTH])
                values = {
                    "consumer": b"raw",
                    "key": params["key"],
                    "token": row[2],
                    "token_text": row[2],  # the write matches either stored form
                    "status": status,
                    "updated": int(updated),
                    "lease_until": int(lease_until),
                    "expires": int(expires),
                    "n_status": "completed",
                    "n_fingerprint": row[1],
                    "n_token": row[2],
                    "n_attempt": int(attempt),
                    "n_created": int(created),
                    "n_updated": now,
                    "n_lease_until": int(lease_until),
                    "n_expires": now + KEEP_MS,
                    "n_result": None,
                    "n_error": None,
                }
                with raw.cursor() as cur:
                    if cur.execute(d.write, values) != 1:
                        raise BenchError(f"raw complete of {k!r} matched nothing")

        def raw_dup(msgs: list[tuple[str, Any]]) -> None:
            for k, _p in msgs:
                params = claim_params(k)
                with raw.cursor() as cur:
                    cur.execute(d.insert, params)
                    if cur.lastrowid:
                        raise BenchError(f"raw claim of completed key {k!r} inserted")
                    cur.execute(d.read, params)
                    row = cur.fetchone()
                if row is None or row[0].split(" ", 1)[0] != "completed":
                    raise BenchError(f"raw read of completed key {k!r}: {row}")

        inbox = oncely.Inbox(store, consumer="twophase")
        res.add(inbox.close)
        twophase = Group(self.name, "twophase", [Variant("raw", raw_new, raw_dup)])
        twophase.variants.append(oncely_variants(inbox))

        def book_for(v: str) -> Callable[[Any, dict[str, Any]], None]:
            ledger = LEDGER_SQL.format(ledger=f"{self.table}_ledger_{v}")
            balance = BALANCE_SQL.format(account=f"{self.table}_account_{v}")

            def book(conn: Any, payload: dict[str, Any]) -> None:
                with conn.cursor() as cur:
                    cur.execute(
                        ledger, (payload["account"], payload["amount_cents"], payload["order_id"])
                    )
                    cur.execute(balance, (payload["amount_cents"], payload["account"]))

            return book

        counted = trips is None
        tx_raw = self.connect()
        res.add(tx_raw.close)
        book_raw = book_for("raw")

        def tx_raw_new(msgs: list[tuple[str, Any]]) -> None:
            for _k, p in msgs:
                tx_raw.begin()
                try:
                    book_raw(tx_raw, p)
                except BaseException:
                    tx_raw.rollback()
                    raise
                tx_raw.commit()
            self.sent["raw"] += len(msgs) if counted else 0

        tx_marker = self.connect()
        res.add(tx_marker.close)
        book_marker = book_for("marker")

        def tx_marker_new(msgs: list[tuple[str, Any]]) -> None:
            for k, p in msgs:
                params = marker_params(k, tokens())
                params.update(consumer=b"tx-marker", key=k.encode(), token=params["token"].encode())
                params["fingerprint"] = fp
                tx_marker.begin()
                try:
                    with tx_marker.cursor() as cur:
                        cur.execute(d.insert, params)
                        if not cur.lastrowid:
                            raise BenchError(f"raw marker of new key {k!r} did not insert")
                    book_marker(tx_marker, p)
                except BaseException:
                    tx_marker.rollback()
                    raise
                tx_marker.commit()
            self.sent["marker"] += len(msgs) if counted else 0

        tx_own = self.own_tx(store, res, book_for("own"), counted)

        def joined(v: str, savepoint: bool) -> Variant:
            user = self.connect()
            res.add(user.close)
            jinbox = oncely.Inbox(store, consumer=f"tx-{v}")
            res.add(jinbox.close)
            book = book_for(v)

            def run(msgs: list[tuple[str, Any]]) -> None:
                for k, p in msgs:
                    user.begin()
                    try:
                        handled = jinbox.handle_in_transaction(
                            k, p, book, tx=user, savepoint=savepoint
                        )
                    except BaseException:
                        user.rollback()
                        raise
                    user.commit()
                    expect(handled, oncely.Outcome.PROCESSED)
                self.sent[v] += len(msgs) if counted else 0

            return Variant(TX_NAMES[v], run)

        tx = Group(
            self.name,
            "tx",
            [
                Variant("raw", tx_raw_new),
                Variant(TX_NAMES["marker"], tx_marker_new),
                tx_own,
                joined("joined", False),
                joined("joined_sp", True),
            ],
        )
        batch = batch_group(self.name, store)
        return [twophase, tx, batch]

    def check(self) -> None:
        conn = self.connect()
        try:
            with conn.cursor() as cur:
                for v in TX_VARIANTS:
                    cur.execute(
                        f"SELECT count(*), coalesce(sum(amount_cents), 0) "
                        f"FROM {self.table}_ledger_{v}"
                    )
                    rows, total = cur.fetchone()
                    cur.execute(f"SELECT sum(balance_cents) FROM {self.table}_account_{v}")
                    balance = cur.fetchone()[0]
                    markers = rows
                    if v != "raw":
                        cur.execute(
                            f"SELECT count(*) FROM {self.table} WHERE consumer = %s",
                            (f"tx-{v}".encode(),),
                        )
                        markers = cur.fetchone()[0]
                    check_books(self.name, v, self.sent[v], rows, total, balance, markers)
        finally:
            conn.close()

    def version(self) -> str:
        conn = self.connect()
        try:
            with conn.cursor() as cur:
                cur.execute("SELECT VERSION()")
                return str(cur.fetchone()[0]).split("-")[0]
        finally:
            conn.close()

    def cleanup(self) -> None:
        conn = self.connect()
        try:
            names = self.table_names()
            with conn.cursor() as cur:
                cur.execute("DROP TABLE IF EXISTS " + ", ".join(names))
        finally:
            conn.close()

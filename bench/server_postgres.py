"""The PostgreSQL case of the servers section (``bench/servers.py``): oncely's store (psycopg 3)
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
    POSTGRES_URL,
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
from server_trips import Trips, trace_libpq

import oncely
from oncely.stores.postgres.dialect import PostgresDialect


class Postgres(Database):
    name = "PostgreSQL"
    port = 5432
    driver = "psycopg"
    module = "oncely.stores.postgres.sync_store"

    def __init__(self) -> None:
        super().__init__(POSTGRES_URL)

    def _conninfo(self) -> str:
        return str(driver("oncely.stores.postgres.errors").parse_url(self.url).conninfo)

    def connect(self, trips: Trips | None) -> Any:
        conn = driver("psycopg").connect(self._conninfo(), autocommit=True)
        if trips is not None:
            trace_libpq(trips, conn, trips.workdir)
        return conn

    def store(self, res: Resources, trips: Trips | None) -> Any:
        """The store as a user opens it (``oncely.open(url)``, its own pool), or, to count round
        trips, on a one-connection pool of ours whose connection libpq traces (the same store
        code: only who owns the pool differs)."""
        if trips is None:
            store = oncely.open(self.store_url)
        else:
            pool: Any = driver("psycopg_pool").ConnectionPool(
                self._conninfo(), min_size=1, max_size=1, kwargs={"autocommit": True}, open=True
            )
            res.add(pool.close)
            pool.wait()
            conn = pool.getconn()
            pool.putconn(conn)
            trace_libpq(trips, conn, trips.workdir)
            store = oncely.PostgresStore(pool, table=self.table)
        res.add(store.close)
        return store

    def _tables(self) -> None:
        if self.created:
            return
        conn = self.connect(None)
        try:
            setup = oncely.PostgresStore(self._conninfo(), table=self.table)
            setup.migrate()
            setup.close()
            for v in TX_VARIANTS:
                ledger, account = f"{self.table}_ledger_{v}", f"{self.table}_account_{v}"
                conn.execute(
                    f"CREATE TABLE {ledger} (id BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY, "
                    "account_id INTEGER NOT NULL, amount_cents BIGINT NOT NULL, ref TEXT NOT NULL)"
                )
                conn.execute(
                    f"CREATE TABLE {account} "
                    "(id INTEGER PRIMARY KEY, balance_cents BIGINT NOT NULL)"
                )
                conn.execute(
                    f"INSERT INTO {account} SELECT g, 0 FROM generate_series(1, {ACCOUNTS}) g"
                )
        finally:
            conn.close()
        self.created = True

    def groups(self, res: Resources, trips: Trips | None) -> list[Group]:
        self._tables()
        d = PostgresDialect("public", self.table)
        tokens = Tokens()
        store = self.store(res, trips)

        # ---- two-phase: the store's claim and complete statements by hand
        raw = self.connect(trips)
        res.add(raw.close)

        def claim_params(key: str) -> dict[str, Any]:
            return {
                "consumer": "raw",
                "key": key,
                "status": "in_progress",
                "fingerprint": FP,
                "token": tokens(),
                "lease": LEASE_MS,
                "span": SPAN_MS,
                "error": None,
                "now": None,
            }

        def raw_new(msgs: list[tuple[str, Any]]) -> None:
            for k, p in msgs:
                params = claim_params(k)
                rows = raw.execute(d.claim, params).fetchall()
                if not rows or rows[0][0] is not True:
                    raise BenchError(f"raw claim of new key {k!r} did not insert")
                trivial(p)
                done = {
                    "now": None,
                    "consumer": "raw",
                    "key": k,
                    "token": params["token"],
                    "keep": KEEP_MS,
                    "result": None,
                    "note": None,
                }
                if not raw.execute(d.complete, done).fetchall():
                    raise BenchError(f"raw complete of {k!r} matched nothing")

        def raw_dup(msgs: list[tuple[str, Any]]) -> None:
            for k, _p in msgs:
                rows = raw.execute(d.claim, claim_params(k)).fetchall()
                if not rows or rows[0][0] is not False or rows[0][1] != "completed":
                    raise BenchError(f"raw claim of completed key {k!r}: {rows[:1]}")

        inbox = oncely.Inbox(store, consumer="twophase")
        res.add(inbox.close)
        twophase = Group(self.name, "twophase", [Variant("raw", raw_new, raw_dup)])
        twophase.variants.append(oncely_variants(inbox))

        # ---- transactional: the business transaction, by hand and through oncely
        def book_for(v: str) -> Callable[[Any, dict[str, Any]], None]:
            ledger = LEDGER_SQL.format(ledger=f"{self.table}_ledger_{v}")
            balance = BALANCE_SQL.format(account=f"{self.table}_account_{v}")

            def book(conn: Any, payload: dict[str, Any]) -> None:
                conn.execute(
                    ledger, (payload["account"], payload["amount_cents"], payload["order_id"])
                )
                conn.execute(balance, (payload["amount_cents"], payload["account"]))

            return book

        counted = trips is None  # the trace pass books too, but is not checked against `sent`
        tx_raw = self.connect(trips)
        res.add(tx_raw.close)
        book_raw = book_for("raw")

        def tx_raw_new(msgs: list[tuple[str, Any]]) -> None:
            for _k, p in msgs:
                with tx_raw.transaction():
                    book_raw(tx_raw, p)
            self.sent["raw"] += len(msgs) if counted else 0

        tx_marker = self.connect(trips)
        res.add(tx_marker.close)
        book_marker = book_for("marker")

        def tx_marker_new(msgs: list[tuple[str, Any]]) -> None:
            for k, p in msgs:
                with tx_marker.transaction():
                    rows = tx_marker.execute(d.claim, marker_params(k, tokens())).fetchall()
                    if not rows or rows[0][0] is not True:
                        raise BenchError(f"raw marker of new key {k!r} did not insert")
                    book_marker(tx_marker, p)
            self.sent["marker"] += len(msgs) if counted else 0

        tx_own = self.own_tx(store, res, book_for("own"), counted)

        def joined(v: str, savepoint: bool) -> Variant:
            user = self.connect(trips)
            res.add(user.close)
            jinbox = oncely.Inbox(store, consumer=f"tx-{v}")
            res.add(jinbox.close)
            book = book_for(v)

            def run(msgs: list[tuple[str, Any]]) -> None:
                for k, p in msgs:
                    with user.transaction():
                        expect(
                            jinbox.handle_in_transaction(k, p, book, tx=user, savepoint=savepoint),
                            oncely.Outcome.PROCESSED,
                        )
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
        conn = self.connect(None)
        try:
            for v in TX_VARIANTS:
                rows, total = conn.execute(
                    f"SELECT count(*), coalesce(sum(amount_cents), 0) FROM {self.table}_ledger_{v}"
                ).fetchone()
                balance = conn.execute(
                    f"SELECT sum(balance_cents) FROM {self.table}_account_{v}"
                ).fetchone()[0]
                markers = rows
                if v != "raw":
                    markers = conn.execute(
                        f"SELECT count(*) FROM {self.table} WHERE consumer = %s", (f"tx-{v}",)
                    ).fetchone()[0]
                check_books(self.name, v, self.sent[v], rows, total, balance, markers)
        finally:
            conn.close()

    def version(self) -> str:
        conn = self.connect(None)
        try:
            return str(conn.execute("SHOW server_version").fetchone()[0]).split()[0]
        finally:
            conn.close()

    def cleanup(self) -> None:
        conn = self.connect(None)
        try:
            names = self.table_names()
            conn.execute("DROP TABLE IF EXISTS " + ", ".join(names))
        finally:
            conn.close()

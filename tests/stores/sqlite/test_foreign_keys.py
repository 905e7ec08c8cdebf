"""SQLite's foreign keys in oncely's own transaction (R7).

SQLite checks foreign keys only on connections that turn them on (``PRAGMA foreign_keys =
ON``, off on every new connection), and the store's connections never did: a handler in
oncely's own transaction wrote an orphan row that the application's own connections (which
turn them on) would have refused, and it committed with the marker. ``?foreign_keys=true``
(``SQLiteSettings(foreign_keys=True)``) turns them on: the write is refused, the outcome is
``failed``, nothing is committed, and a redelivery retries. Off by default, as SQLite is.
"""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path

import pytest

import oncely


def _schema(path: Path, deferred: bool) -> None:
    later = " DEFERRABLE INITIALLY DEFERRED" if deferred else ""
    with sqlite3.connect(path) as db:
        db.execute("CREATE TABLE orders (id TEXT PRIMARY KEY)")
        db.execute(
            f"CREATE TABLE refunds (id TEXT PRIMARY KEY, order_id TEXT NOT NULL "
            f"REFERENCES orders (id){later})"
        )


def _refund(tx: sqlite3.Connection, payload: dict[str, str]) -> str:
    tx.execute("INSERT INTO refunds VALUES (?, ?)", (payload["id"], payload["order"]))
    return "refunded"


def _refunds(path: Path) -> int:
    with sqlite3.connect(path) as db:
        return int(db.execute("SELECT count(*) FROM refunds").fetchone()[0])


@pytest.mark.parametrize("deferred", [False, True], ids=["immediate", "deferred"])
def test_r7_with_foreign_keys_on_an_orphan_write_is_the_handlers_failure(
    tmp_path: Path, deferred: bool
) -> None:
    path = tmp_path / "shop.db"
    _schema(path, deferred)
    store = oncely.open(f"sqlite:///{path}?foreign_keys=true")
    try:
        inbox = oncely.Inbox(store, consumer="refunds")
        orphan = {"id": "r-1", "order": "no-such-order"}
        handled = inbox.handle_in_transaction("r-1", orphan, _refund)
        assert handled.outcome is oncely.Outcome.FAILED, handled
        assert "FOREIGN KEY" in str(handled.reason), handled.reason
        assert _refunds(path) == 0 and inbox.get("r-1") is None  # nothing committed
        with sqlite3.connect(path) as db:
            db.execute("INSERT INTO orders VALUES ('o-1')")
        fine = inbox.handle_in_transaction("r-2", {"id": "r-2", "order": "o-1"}, _refund)
        assert fine.outcome is oncely.Outcome.PROCESSED and _refunds(path) == 1
    finally:
        store.close()


def test_foreign_keys_stay_off_by_default_as_in_sqlite(tmp_path: Path) -> None:
    path = tmp_path / "shop.db"
    _schema(path, deferred=False)
    store = oncely.open(f"sqlite:///{path}")
    try:
        inbox = oncely.Inbox(store, consumer="refunds")
        handled = inbox.handle_in_transaction("r-1", {"id": "r-1", "order": "x"}, _refund)
        assert handled.outcome is oncely.Outcome.PROCESSED and _refunds(path) == 1
    finally:
        store.close()


def test_a_foreign_keys_option_that_is_not_a_boolean_is_refused(tmp_path: Path) -> None:
    with pytest.raises(oncely.ConfigurationError, match="foreign_keys"):
        oncely.open(f"sqlite:///{tmp_path / 'x.db'}?foreign_keys=maybe")


def test_r7_asyncio_with_foreign_keys_a_deferred_orphan_is_the_handlers_failure(
    tmp_path: Path,
) -> None:
    path = tmp_path / "shop.db"
    _schema(path, deferred=True)

    async def main() -> None:
        store = oncely.open_async(f"sqlite:///{path}?foreign_keys=true")
        try:
            inbox = oncely.AsyncInbox(store, consumer="refunds")

            async def refund(tx: object, payload: dict[str, str]) -> str:
                await tx.execute(  # type: ignore[attr-defined]
                    "INSERT INTO refunds VALUES (?, ?)", (payload["id"], payload["order"])
                )
                return "refunded"

            handled = await inbox.handle_in_transaction("r-1", {"id": "r", "order": "x"}, refund)
            assert handled.outcome is oncely.Outcome.FAILED, handled
            assert await inbox.get("r-1") is None
        finally:
            await store.aclose()

    asyncio.run(main())
    assert _refunds(path) == 0

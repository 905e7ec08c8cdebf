"""The five-minute tour of the README, runnable: python examples/quickstart.py [DIR]

Books payments in both modes over one SQLite file, delivering every message twice as an
at-least-once broker may, and shows that each payment takes effect once.
"""

from __future__ import annotations

import sqlite3
import sys
import tempfile
from pathlib import Path

import oncely


def main(workdir: Path) -> None:
    path = workdir / "quickstart.db"
    store = oncely.open(f"sqlite:///{path}")
    inbox = oncely.Inbox(store, consumer="billing")
    with store.transaction() as tx:
        tx.execute("CREATE TABLE IF NOT EXISTS ledger (payment_id TEXT, amount INTEGER)")

    # Transactional mode (R7): the marker commits with the ledger row, or neither does.
    def book(tx: sqlite3.Connection, payment: dict[str, object]) -> dict[str, object]:
        tx.execute(
            "INSERT INTO ledger (payment_id, amount) VALUES (?, ?)",
            (payment["id"], payment["amount"]),
        )
        return {"booked": payment["amount"]}

    payment = {"id": "pay-1", "amount": 42}
    for delivery in (1, 2):
        handled = inbox.handle_in_transaction("pay-1", payment, book)
        print(f"transactional, delivery {delivery}: {handled.outcome} {handled.value}")

    # Two-phase mode (R10): an effect outside the database, recorded under a fenced claim.
    sent: list[str] = []

    def send_receipt(payment: dict[str, object]) -> str:
        sent.append(str(payment["id"]))
        return f"receipt for {payment['id']}"

    for delivery in (1, 2):
        handled = inbox.handle("receipt:pay-1", payment, send_receipt)
        print(f"two-phase, delivery {delivery}: {handled.outcome} {handled.value!r}")

    # The same key with different content is a conflict: dead-letter it, never ack it (R20).
    changed = inbox.handle("receipt:pay-1", {"id": "pay-1", "amount": 99}, send_receipt)
    print(f"reused key, changed amount: {changed.outcome} -> {changed.action}")

    rows = sqlite3.connect(path).execute("SELECT count(*) FROM ledger").fetchone()[0]
    print(f"ledger rows: {rows}, receipts sent: {len(sent)}")
    inbox.close()
    store.close()


if __name__ == "__main__":
    if len(sys.argv) > 1:
        main(Path(sys.argv[1]))
    else:
        with tempfile.TemporaryDirectory() as tmp:
            main(Path(tmp))

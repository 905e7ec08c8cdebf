"""The three consumers the demo compares, over the same payments ledger.

A payment's *effect* is one ledger row plus the matching change of an account balance. Every
consumer maps what happened to a broker action and nothing else; the oncely consumers take it
from :attr:`oncely.Handled.action` (ack, requeue later, retry, dead-letter, park).

``naive``
    Applies the payment and acknowledges. No dedup: every duplicate delivery is another effect.
``oncely-transactional``
    :meth:`oncely.Inbox.handle_in_transaction`: the ledger lives in the oncely store's SQLite
    file, so the dedup marker, the ledger row and the balance change commit in one transaction
    (R7); concurrent copies meet at the store's single writer, which lets one win (R8).
``oncely-two-phase``
    :meth:`oncely.Inbox.handle`: the payment goes to an "external payment provider", a separate
    SQLite file the store cannot share a transaction with (R10). The provider records the
    idempotency key it is given (R17) but does *not* enforce it (no unique constraint), so only
    oncely stands between a duplicate and a double charge. A claim left behind by a killed worker
    is resolved by a reconciler that asks the provider for a payment with that key.

Ledger tables carry no unique constraint on the message id either: the demo would prove nothing
if the database refused the second row.

Where the worker-side faults strike (:class:`Chaos`): the slow part runs before the effect
(naive; transactional: before its transaction, since sleeping inside it would hold SQLite's
single write lock and stall every worker; two-phase: inside the handler, under the claim's
renewed lease). The crash point is right after the effect is durable and before the
acknowledgement: after the commit (naive, transactional), after the provider's commit and
before oncely records the completion (two-phase, the hardest case for R10).
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Literal, Protocol
from urllib.parse import urlsplit

import oncely
from oncely.errors import ConfigurationError
from oncely.testing.file_broker import Leased, immediate

__all__ = [
    "CONSUMERS",
    "Chaos",
    "Consumer",
    "ConsumerName",
    "Ledger",
    "Settlement",
    "Setup",
    "check_store_url",
    "open_consumer",
]

ConsumerName = Literal["naive", "oncely-transactional", "oncely-two-phase"]
CONSUMERS: tuple[ConsumerName, ...] = ("naive", "oncely-transactional", "oncely-two-phase")


class Chaos(Protocol):
    """The worker-side faults the harness applies to a delivery (no-ops for most)."""

    def slow_down(self) -> None:
        """Sleep past the visibility timeout if this delivery is marked ``slow``."""

    def crash_point(self) -> None:
        """SIGKILL this process here if this delivery is marked ``kill`` (never returns)."""


@dataclass(frozen=True, slots=True)
class Settlement:
    """What a consumer asks of the broker for one delivery: the action, and the outcome that
    led to it (recorded by the broker for the report)."""

    action: oncely.Action
    outcome: str
    reason: str | None = None


class Consumer(Protocol):
    """One consumer instance in one worker process."""

    def process(self, delivery: Leased, chaos: Chaos) -> Settlement: ...

    def close(self) -> None: ...


@dataclass(frozen=True, slots=True, kw_only=True)
class Setup:
    """Where one consumer run keeps its data. Picklable: it is sent to every worker process.

    ``ledger_path``: the naive consumer's ledger file, or the two-phase consumer's provider
    file. ``store_url``: the oncely store (the transactional consumer's ledger lives in it).
    ``prefix`` names the ledger tables and ``consumer`` the oncely consumer, both unique per run
    so a shared store file never mixes two runs (R5).
    """

    kind: ConsumerName
    prefix: str
    consumer: str
    ledger_path: str | None = None
    store_url: str | None = None
    lease_s: float = 2.0
    renew_s: float = 0.2


def check_store_url(url: str) -> None:
    """Refuse a store URL the demo's worker processes cannot share.

    Raises :class:`~oncely.ConfigurationError` for ``memory://`` (it lives inside one process),
    for an in-memory SQLite database, and for any scheme but ``sqlite`` (the transactional
    consumer's ledger is SQLite and must live in the store's own file).
    """
    scheme = urlsplit(url).scheme.lower()
    if scheme == "memory":
        raise ConfigurationError(
            "memory:// lives inside one process and the demo's workers are separate processes; "
            "use --store sqlite:///path/to/demo.db, or leave --store out for a temporary file"
        )
    if scheme != "sqlite":
        raise ConfigurationError(
            f"the demo runs on a SQLite store (its transactional ledger shares the store's "
            f"file); got a {scheme or 'schemeless'} URL: use sqlite:///path/to/demo.db"
        )
    path = urlsplit(url).path
    if path in ("/:memory:", "/", "") or "mode=memory" in url:
        raise ConfigurationError(
            "an in-memory SQLite database cannot be shared by the demo's worker processes; "
            "name a file: sqlite:///path/to/demo.db"
        )


# ---------------------------------------------------------------------------- the ledger


class Ledger:
    """SQL for the payments ledger in the tables ``{prefix}_ledger`` / ``{prefix}_accounts``.

    ``apply`` is one effect: insert a ledger row and add the amount to the account's balance.
    ``key`` is the idempotency key a caller passed along (the provider records it, R17);
    ``message_id`` is what the report groups effects by.
    """

    def __init__(self, prefix: str) -> None:
        if not prefix.replace("_", "").isalnum():
            raise ValueError(f"bad table prefix {prefix!r}")
        self.ledger = f"{prefix}_ledger"
        self.accounts = f"{prefix}_accounts"

    def create(self, conn: sqlite3.Connection) -> None:
        conn.execute(
            f"""CREATE TABLE IF NOT EXISTS {self.ledger} (
                id INTEGER PRIMARY KEY,
                message_id TEXT NOT NULL,
                idempotency_key TEXT,
                account TEXT NOT NULL,
                amount INTEGER NOT NULL
            )"""
        )
        # Deliberately NOT unique: a lookup index like a provider's, no arbiter.
        conn.execute(
            f"CREATE INDEX IF NOT EXISTS {self.ledger}_key ON {self.ledger} (idempotency_key)"
        )
        conn.execute(
            f"""CREATE TABLE IF NOT EXISTS {self.accounts} (
                account TEXT PRIMARY KEY,
                balance INTEGER NOT NULL
            )"""
        )

    def apply(
        self, conn: sqlite3.Connection, message_id: str, body: dict[str, object], key: str | None
    ) -> int:
        account, amount = str(body["account"]), int(str(body["amount"]))
        cursor = conn.execute(
            f"INSERT INTO {self.ledger} (message_id, idempotency_key, account, amount) "
            "VALUES (?, ?, ?, ?)",
            (message_id, key, account, amount),
        )
        conn.execute(
            f"INSERT INTO {self.accounts} (account, balance) VALUES (?, ?) "
            "ON CONFLICT (account) DO UPDATE SET balance = balance + excluded.balance",
            (account, amount),
        )
        assert cursor.lastrowid is not None
        return cursor.lastrowid

    def find(self, conn: sqlite3.Connection, key: str) -> int | None:
        row = conn.execute(
            f"SELECT id FROM {self.ledger} WHERE idempotency_key = ? ORDER BY id LIMIT 1", (key,)
        ).fetchone()
        return None if row is None else int(row[0])

    def effects(self, conn: sqlite3.Connection) -> dict[str, int]:
        """Ledger rows per message id: the ground truth of how often each payment happened."""
        rows = conn.execute(
            f"SELECT message_id, count(*) FROM {self.ledger} GROUP BY message_id"
        ).fetchall()
        return {str(message_id): int(count) for message_id, count in rows}

    def consistent(self, conn: sqlite3.Connection) -> bool:
        """Every balance equals the sum of its account's ledger rows (no half-applied effect)."""
        totals = conn.execute(
            f"SELECT account, sum(amount) FROM {self.ledger} GROUP BY account"
        ).fetchall()
        balances = conn.execute(f"SELECT account, balance FROM {self.accounts}").fetchall()
        return dict(totals) == dict(balances)


def connect(path: str) -> sqlite3.Connection:
    """A connection to one of the demo's own SQLite files (WAL, autocommit)."""
    conn = sqlite3.connect(path, isolation_level=None, timeout=30.0)
    conn.execute("PRAGMA journal_mode = WAL")
    return conn


# ---------------------------------------------------------------------------- consumers


def payment(delivery: Leased) -> dict[str, object]:
    """The payment a copy carries (the producer published it as JSON)."""
    body: dict[str, object] = json.loads(delivery.body)
    return body


class Naive:
    """Applies every delivery and acknowledges it."""

    def __init__(self, setup: Setup) -> None:
        assert setup.ledger_path is not None
        self._ledger = Ledger(setup.prefix)
        self._conn = connect(setup.ledger_path)

    def process(self, delivery: Leased, chaos: Chaos) -> Settlement:
        chaos.slow_down()
        with immediate(self._conn) as conn:
            self._ledger.apply(conn, delivery.message_id, payment(delivery), None)
        return Settlement(oncely.Action.ACK, "applied")

    def close(self) -> None:
        self._conn.close()


class Transactional:
    """Marker, ledger row and balance change in one transaction (R7)."""

    def __init__(self, setup: Setup) -> None:
        assert setup.store_url is not None
        self._ledger = Ledger(setup.prefix)
        self._store = oncely.open(setup.store_url)
        self._inbox = oncely.Inbox(self._store, consumer=setup.consumer)

    def process(self, delivery: Leased, chaos: Chaos) -> Settlement:
        # The slow part of a handler (a call to a slow service) runs before its transaction:
        # sleeping inside it would hold SQLite's single write lock and stall every worker.
        chaos.slow_down()
        message_id = delivery.message_id

        def book(conn: sqlite3.Connection, body: dict[str, object]) -> dict[str, int]:
            return {"ledger_id": self._ledger.apply(conn, message_id, body, message_id)}

        handled = self._inbox.handle_in_transaction(message_id, payment(delivery), book)
        return Settlement(handled.action, handled.outcome.value, handled.reason)

    def close(self) -> None:
        self._inbox.close()
        self._store.close()


class TwoPhase:
    """The payment goes to the external provider; oncely claims, then completes (R10)."""

    def __init__(self, setup: Setup) -> None:
        assert setup.store_url is not None
        assert setup.ledger_path is not None
        self._provider = Ledger(setup.prefix)
        self._conn = connect(setup.ledger_path)
        self._store = oncely.open(setup.store_url)
        self._inbox = oncely.Inbox(
            self._store,
            consumer=setup.consumer,
            lease=oncely.Lease(
                duration=timedelta(seconds=setup.lease_s),
                renew_every=timedelta(seconds=setup.renew_s),
            ),
            on_stale=self._reconcile,
        )

    def _reconcile(self, stale: oncely.StaleClaim) -> oncely.Resolution:
        """The provider's "get payment by idempotency key": done if it is there, else retry."""
        found = self._provider.find(self._conn, stale.record.key)
        if found is None:
            return oncely.Resolution.retry()
        return oncely.Resolution.completed({"payment_id": found})

    def process(self, delivery: Leased, chaos: Chaos) -> Settlement:
        message_id = delivery.message_id

        def charge(body: dict[str, object]) -> dict[str, int]:
            chaos.slow_down()
            with immediate(self._conn) as conn:
                payment_id = self._provider.apply(conn, message_id, body, message_id)
            chaos.crash_point()  # the provider charged; oncely has not recorded it yet
            return {"payment_id": payment_id}

        handled = self._inbox.handle(message_id, payment(delivery), charge)
        return Settlement(handled.action, handled.outcome.value, handled.reason)

    def close(self) -> None:
        self._inbox.close()
        self._store.close()
        self._conn.close()


_FACTORIES: dict[ConsumerName, Callable[[Setup], Consumer]] = {
    "naive": Naive,
    "oncely-transactional": Transactional,
    "oncely-two-phase": TwoPhase,
}


def open_consumer(setup: Setup) -> Consumer:
    """The consumer for ``setup`` (in a worker process)."""
    return _FACTORIES[setup.kind](setup)


# ---------------------------------------------------------------------------- the parent's side


@contextmanager
def effect_connection(setup: Setup) -> Iterator[sqlite3.Connection]:
    """A connection to the database that holds ``setup``'s effects."""
    if setup.kind == "oncely-transactional":
        assert setup.store_url is not None
        store = oncely.open(setup.store_url)
        if not isinstance(store, oncely.SQLiteStore):
            raise ConfigurationError("the transactional demo consumer needs a SQLite store")
        try:
            with store.transaction() as conn:
                yield conn
        finally:
            store.close()
        return
    assert setup.ledger_path is not None
    conn = connect(setup.ledger_path)
    try:
        yield conn
    finally:
        conn.close()


def prepare(setup: Setup) -> None:
    """Create the ledger tables (and the oncely schema) before any worker starts."""
    if setup.store_url is not None:
        store = oncely.open(setup.store_url)
        try:
            store.migrate()
        finally:
            store.close()
    with effect_connection(setup) as conn:
        if setup.kind == "oncely-transactional":
            Ledger(setup.prefix).create(conn)
        else:
            with immediate(conn):
                Ledger(setup.prefix).create(conn)


def reconciled(setup: Setup) -> int:
    """Records the two-phase reconciler completed from the provider's records (R10)."""
    if setup.kind != "oncely-two-phase" or setup.store_url is None:
        return 0
    store = oncely.open(setup.store_url)
    try:
        count = 0
        after: tuple[str, str] | None = None
        while True:
            page = store.scan(consumer=setup.consumer, after=after, limit=500)
            if not page:
                return count
            count += sum(1 for r in page if (r.error or "").startswith("reconciled"))
            after = (page[-1].consumer, page[-1].key)
    finally:
        store.close()

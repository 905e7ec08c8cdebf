"""An at-least-once peek-lock broker in one SQLite file, shared by processes that may be killed.

:class:`~oncely.testing.MemoryBroker` is the broker for one process's tests. When the
consumers are *processes* (a fleet of workers, some of them SIGKILLed on cue and restarted),
the queue must outlive any of them: :class:`FileBroker` keeps it in a SQLite file (WAL), and
every process opens its own instance. It is what oncely's demo and its crash tests run on.

It behaves like a peek-lock queue (R20): :meth:`FileBroker.receive` leases a copy to a worker
for a visibility timeout; :meth:`FileBroker.settle` acknowledges it, requeues it after a delay,
dead-letters or parks it. A copy whose lease runs out is delivered again. Settling is *fenced*:
it only counts while the delivery's lease is live and the copy is still open, as a lock token
does (a late acknowledgement is refused as ``lock_lost`` and the copy is redelivered). A copy
delivered ``max_deliveries`` times without settling is dead-lettered, as real brokers do.

Two faults are the broker's own; it injects them on the first delivery of a copy published
with that ``fault``:

* ``lose_ack``: the first acknowledgement is reported to the worker as done and dropped, so the
  copy comes back after its visibility timeout.
* ``twin``: the copy is handed to two workers at the same moment: the first receiver waits
  (inside :meth:`~FileBroker.receive`, up to ``twin_wait``) until another worker asks for a
  message and gets the same copy; both then hold the same lease. If nobody comes (one worker,
  or every other one busy) the copy is delivered once and the delivery noted ``twin_unpaired``.

Any other fault (the demo uses ``kill`` and ``slow``) is the worker's business: it is handed
to the worker as :attr:`Leased.chaos` on the first delivery, and the broker does nothing else
with it.

Every delivery and settlement is a row (tables below), so a test or a report reads what
happened from the file (ground truth), never from counters a consumer keeps:

``copies``      one row per published copy: ``message_id`` (the producer's id, the dedup key),
                ``seq`` (a transport id: never a dedup key, R4), state ``ready`` / ``leased`` /
                ``acked`` / ``dead`` / ``parked``, the number of deliveries, the dead-letter reason
``deliveries``  one row per hand-out: cause ``first`` / ``lease_expired`` / ``requeued`` /
                ``twin``, the worker, then what the worker asked (``action``) and what the broker
                did (``result``: ``done`` / ``ack_lost`` / ``lock_lost`` / ``already_settled``)
``kills``       every SIGKILL a worker asked its supervisor for, with the process's exit code
``control``     flags between the supervisor and the workers (``stop``)

::

    broker = FileBroker(tmp_path / "queue.db", visibility_timeout=timedelta(seconds=1))
    broker.create()
    broker.publish([Published("pay-1", b'{"amount": 5}')] * 2)  # a producer retry
    # in each worker process:
    while (leased := broker.next("w1")) is not None:
        ...  # inbox.handle(leased.message_id, ...)
        broker.settle(leased, "ack", outcome="processed")
"""

from __future__ import annotations

import os
import sqlite3
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal

__all__ = [
    "FileBroker",
    "Leased",
    "Published",
    "SettleAction",
    "SettleResult",
    "immediate",
    "now_ms",
]

SettleAction = Literal["ack", "requeue", "dead_letter", "park"]
SettleResult = Literal["done", "ack_lost", "lock_lost", "already_settled"]

_OPEN = ("ready", "leased")
_BROKER_FAULTS = ("lose_ack", "twin")

SCHEMA = (
    """CREATE TABLE IF NOT EXISTS copies (
        seq INTEGER PRIMARY KEY,
        message_id TEXT NOT NULL,
        body BLOB NOT NULL,
        origin TEXT NOT NULL,
        fault TEXT,
        state TEXT NOT NULL DEFAULT 'ready'
            CHECK (state IN ('ready', 'leased', 'acked', 'dead', 'parked')),
        visible_at_ms INTEGER NOT NULL DEFAULT 0,
        lease_until_ms INTEGER NOT NULL DEFAULT 0,
        deliveries INTEGER NOT NULL DEFAULT 0,
        ack_dropped INTEGER NOT NULL DEFAULT 0,
        twin_waiting INTEGER,
        twin_worker TEXT,
        twin_partner INTEGER,
        reason TEXT,
        settled_ms INTEGER
    )""",
    "CREATE INDEX IF NOT EXISTS copies_open ON copies (state, seq)",
    """CREATE TABLE IF NOT EXISTS deliveries (
        id INTEGER PRIMARY KEY,
        seq INTEGER NOT NULL,
        message_id TEXT NOT NULL,
        worker TEXT NOT NULL,
        pid INTEGER NOT NULL,
        cause TEXT NOT NULL,
        chaos TEXT,
        delivered_ms INTEGER NOT NULL,
        lease_until_ms INTEGER NOT NULL,
        action TEXT,
        outcome TEXT,
        reason TEXT,
        result TEXT,
        settled_ms INTEGER,
        note TEXT
    )""",
    "CREATE INDEX IF NOT EXISTS deliveries_seq ON deliveries (seq, id)",
    """CREATE TABLE IF NOT EXISTS kills (
        id INTEGER PRIMARY KEY,
        delivery_id INTEGER NOT NULL,
        seq INTEGER NOT NULL,
        worker TEXT NOT NULL,
        pid INTEGER NOT NULL,
        requested_ms INTEGER NOT NULL,
        killed_ms INTEGER,
        exitcode INTEGER
    )""",
    "CREATE TABLE IF NOT EXISTS control (name TEXT PRIMARY KEY, value TEXT NOT NULL)",
)


@contextmanager
def immediate(conn: sqlite3.Connection) -> Iterator[sqlite3.Connection]:
    """A write transaction on an autocommit connection: ``BEGIN IMMEDIATE`` (the write lock at
    once), committed at the end of the block, rolled back on any exception."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield conn
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")


def now_ms() -> int:
    """Wall-clock epoch milliseconds: every process sharing the file reads the same clock."""
    return time.time_ns() // 1_000_000


@dataclass(frozen=True, slots=True)
class Published:
    """One copy as a producer publishes it. ``message_id`` is the producer's id (the dedup
    key); several copies may share it. ``origin`` is a free label kept for reports; ``fault``
    is ``lose_ack`` or ``twin`` (the broker's own) or any worker-side mark."""

    message_id: str
    body: bytes
    origin: str = "original"
    fault: str | None = None


@dataclass(frozen=True, slots=True)
class Leased:
    """One hand-out of a copy to a worker.

    ``message_id`` is the producer's id (the dedup key); ``delivery_id`` and ``seq`` are
    transport ids that change per delivery or per copy (never a dedup key, R4). ``attempt``
    counts the copy's deliveries, this one included. ``chaos`` is the worker-side fault of the
    copy on its first delivery (None otherwise).
    """

    delivery_id: int
    seq: int
    message_id: str
    body: bytes
    cause: str
    attempt: int
    chaos: str | None


class FileBroker:
    """The queue in ``path``; each process opens its own instance (connections never cross
    a fork). ``visibility_timeout`` is the lease of every delivery; ``order`` is ``"fifo"``
    (publication order) or ``"random"`` (any visible copy, which mixes a fleet's work)."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        visibility_timeout: timedelta = timedelta(seconds=1),
        max_deliveries: int = 100,
        twin_wait: timedelta | None = None,
        order: Literal["fifo", "random"] = "fifo",
    ) -> None:
        if order not in ("fifo", "random"):
            raise ValueError(f"order must be 'fifo' or 'random', not {order!r}")
        self.path = os.fspath(path)
        self.visibility_ms = int(visibility_timeout.total_seconds() * 1000)
        self.max_deliveries = max_deliveries
        self.twin_wait_s = (
            twin_wait.total_seconds() if twin_wait is not None else 2 * self.visibility_ms / 1000
        )
        self._order = "seq" if order == "fifo" else "random()"
        self._conn: sqlite3.Connection | None = None
        self._pid = os.getpid()

    # ------------------------------------------------------------------ plumbing

    def _connection(self) -> sqlite3.Connection:
        if self._conn is None or self._pid != os.getpid():
            conn = sqlite3.connect(self.path, isolation_level=None, timeout=30.0)
            conn.execute("PRAGMA journal_mode = WAL")
            # The queue survives process crashes (WAL); power loss is not simulated.
            conn.execute("PRAGMA synchronous = NORMAL")
            self._conn, self._pid = conn, os.getpid()
        return self._conn

    def _tx(self) -> AbstractContextManager[sqlite3.Connection]:
        return immediate(self._connection())

    def read(self, sql: str, params: tuple[object, ...] = ()) -> list[tuple[Any, ...]]:
        """Rows of a read-only query on the tables above (ground truth for a report)."""
        return self._connection().execute(sql, params).fetchall()

    def close(self) -> None:
        if self._conn is not None and self._pid == os.getpid():
            self._conn.close()
        self._conn = None

    # ------------------------------------------------------------------ producer side

    def create(self) -> None:
        """Create the tables (idempotent)."""
        with self._tx() as conn:
            for statement in SCHEMA:
                conn.execute(statement)

    def publish(self, copies: Iterable[Published]) -> None:
        """Append copies to the queue in this order (one transaction)."""
        with self._tx() as conn:
            conn.executemany(
                "INSERT INTO copies (message_id, body, origin, fault) VALUES (?, ?, ?, ?)",
                [(c.message_id, c.body, c.origin, c.fault) for c in copies],
            )

    # ------------------------------------------------------------------ consumer side

    def receive(self, worker: str) -> Leased | None:
        """Lease the next visible copy to ``worker`` for the visibility timeout, or None.

        A copy is visible when it is ready (and its requeue delay has passed) or when its lease
        ran out (redelivery). A twin copy waiting for a second receiver goes first.
        """
        now = now_ms()
        with self._tx() as conn:
            partner = self._twin_partner(conn, worker, now)
            if partner is not None:
                return partner
            while True:
                row = conn.execute(
                    f"""SELECT seq, message_id, body, fault, state, deliveries FROM copies
                    WHERE (state = 'ready' AND visible_at_ms <= ?)
                       OR (state = 'leased' AND lease_until_ms <= ? AND twin_waiting IS NULL)
                    ORDER BY {self._order} LIMIT 1""",
                    (now, now),
                ).fetchone()
                if row is None:
                    return None
                seq, message_id, body, fault, state, count = row
                if count >= self.max_deliveries:
                    conn.execute(
                        "UPDATE copies SET state = 'dead', reason = ?, settled_ms = ? "
                        "WHERE seq = ?",
                        (f"max_deliveries: delivered {count} times without settling", now, seq),
                    )
                    continue
                if count == 0:
                    cause = "first"
                elif state == "leased":
                    cause = "lease_expired"
                else:
                    cause = "requeued"
                chaos = fault if cause == "first" and fault not in (None, *_BROKER_FAULTS) else None
                lease = now + self.visibility_ms
                delivery_id = self._record(conn, seq, message_id, worker, cause, chaos, now, lease)
                twin = cause == "first" and fault == "twin"
                conn.execute(
                    """UPDATE copies SET state = 'leased', lease_until_ms = ?,
                        deliveries = deliveries + 1, twin_waiting = ?, twin_worker = ?
                    WHERE seq = ?""",
                    (lease, delivery_id if twin else None, worker if twin else None, seq),
                )
                break
        leased = Leased(delivery_id, seq, message_id, bytes(body), cause, count + 1, chaos)
        if twin:
            self._await_twin(leased)
        return leased

    def next(
        self,
        worker: str,
        *,
        poll: timedelta = timedelta(milliseconds=20),
        check: Callable[[], None] | None = None,
    ) -> Leased | None:
        """The next copy for ``worker``, waiting while others hold every open one; None once
        no copy is open (the queue is drained). ``check`` runs before each try (a worker's
        "is my supervisor still there" test, which may exit the process)."""
        while True:
            if check is not None:
                check()
            leased = self.receive(worker)
            if leased is not None or self.open_copies() == 0:
                return leased
            time.sleep(poll.total_seconds())

    def _record(
        self,
        conn: sqlite3.Connection,
        seq: int,
        message_id: str,
        worker: str,
        cause: str,
        chaos: str | None,
        now: int,
        lease: int,
    ) -> int:
        cursor = conn.execute(
            """INSERT INTO deliveries (seq, message_id, worker, pid, cause, chaos, delivered_ms,
                lease_until_ms) VALUES (?, ?, ?, ?, ?, ?, ?, ?)""",
            (seq, message_id, worker, os.getpid(), cause, chaos, now, lease),
        )
        assert cursor.lastrowid is not None
        return cursor.lastrowid

    def _twin_partner(self, conn: sqlite3.Connection, worker: str, now: int) -> Leased | None:
        row = conn.execute(
            """SELECT seq, message_id, body, twin_waiting, deliveries FROM copies
            WHERE twin_waiting IS NOT NULL AND state = 'leased' AND twin_worker != ?
            ORDER BY seq LIMIT 1""",
            (worker,),
        ).fetchone()
        if row is None:
            return None
        seq, message_id, body, first, count = row
        lease = now + self.visibility_ms
        delivery_id = self._record(conn, seq, message_id, worker, "twin", None, now, lease)
        # Both halves hold the same lease from the moment they are paired.
        conn.execute("UPDATE deliveries SET lease_until_ms = ? WHERE id = ?", (lease, first))
        conn.execute(
            """UPDATE copies SET lease_until_ms = ?, deliveries = deliveries + 1,
                twin_waiting = NULL, twin_partner = ? WHERE seq = ?""",
            (lease, delivery_id, seq),
        )
        return Leased(delivery_id, seq, message_id, bytes(body), "twin", count + 1, None)

    def _await_twin(self, leased: Leased) -> None:
        deadline = time.monotonic() + self.twin_wait_s
        conn = self._connection()
        while time.monotonic() < deadline:
            row = conn.execute(
                "SELECT twin_partner FROM copies WHERE seq = ?", (leased.seq,)
            ).fetchone()
            if row is not None and row[0] is not None:
                return
            time.sleep(0.002)
        now = now_ms()
        with self._tx() as tx:
            left = tx.execute(
                "UPDATE copies SET twin_waiting = NULL, lease_until_ms = ? "
                "WHERE seq = ? AND twin_waiting = ? RETURNING 1",
                (now + self.visibility_ms, leased.seq, leased.delivery_id),
            ).fetchall()
            if left:  # nobody came (a single worker, or all busy): deliver it once
                tx.execute(
                    "UPDATE deliveries SET lease_until_ms = ?, note = 'twin_unpaired' WHERE id = ?",
                    (now + self.visibility_ms, leased.delivery_id),
                )

    def redelivered(self, leased: Leased) -> bool:
        """True once the copy of ``leased`` has been handed out again."""
        rows = self.read(
            "SELECT 1 FROM deliveries WHERE seq = ? AND id > ? LIMIT 1",
            (leased.seq, leased.delivery_id),
        )
        return bool(rows)

    def settle(
        self,
        leased: Leased,
        action: SettleAction,
        *,
        outcome: str = "",
        reason: str | None = None,
        delay: timedelta = timedelta(0),
    ) -> SettleResult:
        """Ack, requeue (visible again after ``delay``), dead-letter or park the copy.

        ``outcome`` (what the consumer saw) is stored for reports. The result says what the
        broker did; a worker cannot tell ``ack_lost`` from ``done``, as on a real network.
        A delivery settled twice raises :class:`RuntimeError`.
        """
        now = now_ms()
        with self._tx() as conn:
            lease, settled = conn.execute(
                "SELECT lease_until_ms, settled_ms FROM deliveries WHERE id = ?",
                (leased.delivery_id,),
            ).fetchone()
            if settled is not None:
                raise RuntimeError(f"delivery {leased.delivery_id} settled twice")
            state, fault, dropped = conn.execute(
                "SELECT state, fault, ack_dropped FROM copies WHERE seq = ?", (leased.seq,)
            ).fetchone()
            result: SettleResult
            if state not in _OPEN:
                result = "already_settled"
            elif now >= lease:
                result = "lock_lost"
            elif action == "ack" and fault == "lose_ack" and not dropped:
                result = "ack_lost"
                conn.execute("UPDATE copies SET ack_dropped = 1 WHERE seq = ?", (leased.seq,))
            else:
                result = "done"
                self._apply(conn, leased.seq, action, reason, now, delay)
            conn.execute(
                """UPDATE deliveries SET action = ?, outcome = ?, reason = ?, result = ?,
                    settled_ms = ? WHERE id = ?""",
                (action, outcome, reason, result, now, leased.delivery_id),
            )
        return result

    def _apply(
        self,
        conn: sqlite3.Connection,
        seq: int,
        action: SettleAction,
        reason: str | None,
        now: int,
        delay: timedelta,
    ) -> None:
        if action == "requeue":
            conn.execute(
                "UPDATE copies SET state = 'ready', visible_at_ms = ?, lease_until_ms = 0 "
                "WHERE seq = ?",
                (now + int(delay.total_seconds() * 1000), seq),
            )
            return
        state = {"ack": "acked", "dead_letter": "dead", "park": "parked"}[action]
        conn.execute(
            "UPDATE copies SET state = ?, reason = ?, settled_ms = ? WHERE seq = ?",
            (state, reason, now, seq),
        )

    # ------------------------------------------------------------------ the supervisor's side

    def open_copies(self) -> int:
        """Copies still ``ready`` or ``leased``: zero once everything is settled."""
        rows = self.read("SELECT count(*) FROM copies WHERE state IN ('ready', 'leased')")
        return int(rows[0][0])

    def deliveries(self) -> int:
        """Hand-outs so far, every copy and worker together."""
        return int(self.read("SELECT count(*) FROM deliveries")[0][0])

    def request_kill(self, leased: Leased, worker: str) -> None:
        """Ask the supervisor to SIGKILL this process (a worker at its crash point)."""
        with self._tx() as conn:
            conn.execute(
                """INSERT INTO kills (delivery_id, seq, worker, pid, requested_ms)
                VALUES (?, ?, ?, ?, ?)""",
                (leased.delivery_id, leased.seq, worker, os.getpid(), now_ms()),
            )

    def pending_kills(self) -> list[tuple[int, int]]:
        """``(kill id, pid)`` of every kill requested and not yet carried out."""
        rows = self.read("SELECT id, pid FROM kills WHERE killed_ms IS NULL ORDER BY id")
        return [(int(r[0]), int(r[1])) for r in rows]

    def record_kill(self, kill_id: int, exitcode: int | None) -> None:
        with self._tx() as conn:
            conn.execute(
                "UPDATE kills SET killed_ms = ?, exitcode = ? WHERE id = ?",
                (now_ms(), exitcode, kill_id),
            )

    def stop(self) -> None:
        """Raise the ``stop`` flag that :meth:`stopping` reads in every worker."""
        with self._tx() as conn:
            conn.execute(
                "INSERT INTO control (name, value) VALUES ('stop', '1') "
                "ON CONFLICT (name) DO UPDATE SET value = '1'"
            )

    def stopping(self) -> bool:
        return bool(self.read("SELECT 1 FROM control WHERE name = 'stop' AND value = '1'"))

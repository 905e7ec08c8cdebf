"""An in-process at-least-once broker over one SQLite file, with the faults of R1 built in.

It behaves like a peek-lock queue (R20): :meth:`Broker.receive` leases a copy to a worker for a
visibility timeout; :meth:`Broker.settle` acknowledges it, requeues it after a delay, dead-letters
or parks it. A copy whose lease runs out is delivered again. Settling is *fenced*: it only counts
while the delivery's lease is live and the copy is still open, as a lock token does (a late
acknowledgement is refused as ``lock_lost`` and the copy is redelivered).

Two faults are the broker's own and it injects them on the first delivery of a marked copy:

* ``lose_ack``: the first acknowledgement is reported to the worker as done and dropped, so the
  copy comes back after its visibility timeout.
* ``twin``: the copy is handed to two workers at the same moment: the first receiver waits
  (inside :meth:`~Broker.receive`, up to ``twin_wait_s``) until another worker asks for a
  message and gets the same copy; both then hold the same lease. If nobody comes (one worker,
  or every other one busy) the copy is delivered once and the delivery noted ``twin_unpaired``.

Every delivery and settlement is a row in the tables of :mod:`oncely.demo.broker_tables`, so
the report reads what happened from there (ground truth), never from counters a consumer keeps.
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

from oncely.demo.broker_tables import SCHEMA
from oncely.demo.workload import Copy

__all__ = ["Broker", "Delivery", "SettleAction", "SettleResult", "now_ms"]

SettleAction = Literal["ack", "requeue", "dead_letter", "park"]
SettleResult = Literal["done", "ack_lost", "lock_lost", "already_settled"]

_OPEN = ("ready", "leased")


def now_ms() -> int:
    """Wall-clock epoch milliseconds: every process of the demo reads the same clock."""
    return time.time_ns() // 1_000_000


@dataclass(frozen=True, slots=True)
class Delivery:
    """One hand-out of a copy to a worker.

    ``message_id`` is the producer's id (the dedup key); ``delivery_id`` and ``seq`` are
    transport ids that change per delivery or per copy (never a dedup key, R4). ``chaos`` is the
    worker-side fault the demo's harness applies to this delivery (``kill`` or ``slow``); a
    consumer's own logic never reads it.
    """

    delivery_id: int
    seq: int
    message_id: str
    body: dict[str, object]
    cause: str
    attempt: int
    chaos: str | None


class Broker:
    """The queue in ``path``; each process opens its own instance (connections never cross
    a fork). ``visibility_timeout_s`` is the lease of every delivery; a copy delivered
    ``max_deliveries`` times without settling is dead-lettered, as real brokers do."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        visibility_timeout_s: float = 1.0,
        max_deliveries: int = 100,
        twin_wait_s: float | None = None,
    ) -> None:
        self.path = os.fspath(path)
        self.visibility_ms = int(visibility_timeout_s * 1000)
        self.max_deliveries = max_deliveries
        self.twin_wait_s = twin_wait_s if twin_wait_s is not None else 2 * visibility_timeout_s
        self._conn: sqlite3.Connection | None = None
        self._pid = os.getpid()

    # ------------------------------------------------------------------ plumbing

    def _connection(self) -> sqlite3.Connection:
        if self._conn is None or self._pid != os.getpid():
            conn = sqlite3.connect(self.path, isolation_level=None, timeout=30.0)
            conn.execute("PRAGMA journal_mode = WAL")
            # The demo's broker survives process crashes (WAL); power loss is not simulated.
            conn.execute("PRAGMA synchronous = NORMAL")
            self._conn, self._pid = conn, os.getpid()
        return self._conn

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        conn = self._connection()
        conn.execute("BEGIN IMMEDIATE")
        try:
            yield conn
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        conn.execute("COMMIT")

    def read(self, sql: str, params: tuple[object, ...] = ()) -> list[tuple[Any, ...]]:
        """Rows of a read-only query (the report's ground truth)."""
        return self._connection().execute(sql, params).fetchall()

    def close(self) -> None:
        if self._conn is not None and self._pid == os.getpid():
            self._conn.close()
        self._conn = None

    # ------------------------------------------------------------------ producer side

    def create(self) -> None:
        with self._tx() as conn:
            for statement in SCHEMA:
                conn.execute(statement)

    def publish(self, copies: tuple[Copy, ...] | list[Copy]) -> None:
        """Append copies to the queue in this order (one transaction)."""
        with self._tx() as conn:
            conn.executemany(
                "INSERT INTO copies (message_id, body, origin, fault) VALUES (?, ?, ?, ?)",
                [
                    (c.message_id, json.dumps(c.payment.to_json()), c.origin, c.fault)
                    for c in copies
                ],
            )

    # ------------------------------------------------------------------ consumer side

    def receive(self, worker: str) -> Delivery | None:
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
                    """SELECT seq, message_id, body, fault, state, deliveries FROM copies
                    WHERE (state = 'ready' AND visible_at_ms <= ?)
                       OR (state = 'leased' AND lease_until_ms <= ? AND twin_waiting IS NULL)
                    ORDER BY seq LIMIT 1""",
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
                chaos = fault if cause == "first" and fault in ("kill", "slow") else None
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
        delivery = Delivery(delivery_id, seq, message_id, json.loads(body), cause, count + 1, chaos)
        if twin:
            self._await_twin(delivery)
        return delivery

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

    def _twin_partner(self, conn: sqlite3.Connection, worker: str, now: int) -> Delivery | None:
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
        return Delivery(delivery_id, seq, message_id, json.loads(body), "twin", count + 1, None)

    def _await_twin(self, delivery: Delivery) -> None:
        deadline = time.monotonic() + self.twin_wait_s
        conn = self._connection()
        while time.monotonic() < deadline:
            row = conn.execute(
                "SELECT twin_partner FROM copies WHERE seq = ?", (delivery.seq,)
            ).fetchone()
            if row is not None and row[0] is not None:
                return
            time.sleep(0.002)
        now = now_ms()
        with self._tx() as tx:
            left = tx.execute(
                "UPDATE copies SET twin_waiting = NULL, lease_until_ms = ? "
                "WHERE seq = ? AND twin_waiting = ? RETURNING 1",
                (now + self.visibility_ms, delivery.seq, delivery.delivery_id),
            ).fetchall()
            if left:  # nobody came (a single worker, or all busy): deliver it once
                tx.execute(
                    "UPDATE deliveries SET lease_until_ms = ?, note = 'twin_unpaired' WHERE id = ?",
                    (now + self.visibility_ms, delivery.delivery_id),
                )

    def redelivered(self, delivery: Delivery) -> bool:
        """True once the copy of ``delivery`` has been handed out again."""
        rows = self.read(
            "SELECT 1 FROM deliveries WHERE seq = ? AND id > ? LIMIT 1",
            (delivery.seq, delivery.delivery_id),
        )
        return bool(rows)

    def settle(
        self,
        delivery: Delivery,
        action: SettleAction,
        *,
        outcome: str,
        reason: str | None = None,
        delay_s: float = 0.0,
    ) -> SettleResult:
        """Ack, requeue (visible again after ``delay_s``), dead-letter or park the copy.

        ``outcome`` (what the consumer saw) is stored for the report. The result says what
        the broker did; a worker cannot tell ``ack_lost`` from ``done``, as on a real network.
        """
        now = now_ms()
        with self._tx() as conn:
            lease, settled = conn.execute(
                "SELECT lease_until_ms, settled_ms FROM deliveries WHERE id = ?",
                (delivery.delivery_id,),
            ).fetchone()
            if settled is not None:
                raise RuntimeError(f"delivery {delivery.delivery_id} settled twice")
            state, fault, dropped = conn.execute(
                "SELECT state, fault, ack_dropped FROM copies WHERE seq = ?", (delivery.seq,)
            ).fetchone()
            result: SettleResult
            if state not in _OPEN:
                result = "already_settled"
            elif now >= lease:
                result = "lock_lost"
            elif action == "ack" and fault == "lose_ack" and not dropped:
                result = "ack_lost"
                conn.execute("UPDATE copies SET ack_dropped = 1 WHERE seq = ?", (delivery.seq,))
            else:
                result = "done"
                self._apply(conn, delivery.seq, action, reason, now, delay_s)
            conn.execute(
                """UPDATE deliveries SET action = ?, outcome = ?, reason = ?, result = ?,
                    settled_ms = ? WHERE id = ?""",
                (action, outcome, reason, result, now, delivery.delivery_id),
            )
        return result

    def _apply(
        self,
        conn: sqlite3.Connection,
        seq: int,
        action: SettleAction,
        reason: str | None,
        now: int,
        delay_s: float,
    ) -> None:
        if action == "requeue":
            conn.execute(
                "UPDATE copies SET state = 'ready', visible_at_ms = ?, lease_until_ms = 0 "
                "WHERE seq = ?",
                (now + int(delay_s * 1000), seq),
            )
            return
        state = {"ack": "acked", "dead_letter": "dead", "park": "parked"}[action]
        conn.execute(
            "UPDATE copies SET state = ?, reason = ?, settled_ms = ? WHERE seq = ?",
            (state, reason, now, seq),
        )

    # ------------------------------------------------------------------ the runner's side

    def request_kill(self, delivery: Delivery, worker: str) -> None:
        """Ask the runner to SIGKILL this process (called by a worker at its crash point)."""
        with self._tx() as conn:
            conn.execute(
                """INSERT INTO kills (delivery_id, seq, worker, pid, requested_ms)
                VALUES (?, ?, ?, ?, ?)""",
                (delivery.delivery_id, delivery.seq, worker, os.getpid(), now_ms()),
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

    def open_copies(self) -> int:
        """Copies still ``ready`` or ``leased``: zero once everything is settled."""
        rows = self.read("SELECT count(*) FROM copies WHERE state IN ('ready', 'leased')")
        return int(rows[0][0])

    def stop(self) -> None:
        with self._tx() as conn:
            conn.execute(
                "INSERT INTO control (name, value) VALUES ('stop', '1') "
                "ON CONFLICT (name) DO UPDATE SET value = '1'"
            )

    def stopping(self) -> bool:
        return bool(self.read("SELECT 1 FROM control WHERE name = 'stop' AND value = '1'"))

"""The demo broker's tables in its SQLite file: the ground truth the report reads.

Every delivery and settlement is a row, so the report reads what happened from here, never
from counters a consumer keeps. :class:`oncely.demo.broker.Broker` creates them and is the
only writer. Tables:

``copies``      one row per published copy: ``message_id`` (the producer's id, the dedup key),
                ``seq`` (a transport id: never a dedup key, R4), state ``ready`` / ``leased`` /
                ``acked`` / ``dead`` / ``parked``, the number of deliveries, the dead-letter reason
``deliveries``  one row per hand-out: cause ``first`` / ``lease_expired`` / ``requeued`` /
                ``twin``, the worker, then what the worker asked (``action``) and what the broker
                did (``result``: ``done`` / ``ack_lost`` / ``lock_lost`` / ``already_settled``)
``kills``       every SIGKILL the runner sent, with the process's exit code
``control``     flags between the runner and the workers (``stop``)
"""

from __future__ import annotations

__all__ = ["SCHEMA"]

SCHEMA = (
    """CREATE TABLE IF NOT EXISTS copies (
        seq INTEGER PRIMARY KEY,
        message_id TEXT NOT NULL,
        body TEXT NOT NULL,
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

"""Constants and helpers shared by the MariaDB / MySQL store test modules."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable
from typing import Any

import oncely
from tests.backends.mysql import admin, sql

LEASE_MS = 30_000
KEEP_MS = 7 * 86_400_000


def _claim(store: Any, key: str, token: str, *, consumer: str = "billing") -> oncely.stores.Claim:
    claim: oncely.stores.Claim = store.claim(
        consumer, key, fingerprint="f", token=token, lease_ms=LEASE_MS, keep_ms=KEEP_MS,
        takeover=False,
    )  # fmt: skip
    return claim


def _claim_in(store: Any, tx: Any, key: str, token: str) -> oncely.stores.Claim:
    claim: oncely.stores.Claim = store.claim_in(
        tx, "billing", key, fingerprint="f", token=token, keep_ms=KEEP_MS, takeover=False
    )
    return claim


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _deadlocks() -> int:
    return int(sql("SHOW GLOBAL STATUS LIKE 'Innodb_deadlocks'")[0][1])


def _in_thread(work: Callable[[], object]) -> tuple[threading.Thread, dict[str, Any]]:
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = work()
        except BaseException as exc:
            out["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def _server_ms() -> int:
    # Another function than the store's expression, in a UTC session: a check, not a copy.
    conn = admin()
    try:
        with conn.cursor() as cursor:
            cursor.execute("SET time_zone = '+00:00'")
            cursor.execute("SELECT CAST(UNIX_TIMESTAMP(NOW(3)) * 1000 AS SIGNED)")
            return int(cursor.fetchone()[0])
    finally:
        conn.close()


def _questions(conn: Any) -> int:
    with conn.cursor() as cursor:
        cursor.execute("SHOW SESSION STATUS LIKE 'Questions'")
        return int(cursor.fetchone()[1])

"""Constants and helpers shared by the MariaDB / MySQL store test modules."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pymysql

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


class PrivateServer:
    """A MariaDB server of this test's own (data directory, port, socket under ``base``), so
    it can be SIGKILLed and restarted without disturbing the shared one."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.port = _free_port()
        self.process: subprocess.Popen[bytes] | None = None
        self.user = "root" if os.geteuid() == 0 else os.environ.get("USER", "")
        subprocess.run(
            [
                str(shutil.which("mariadb-install-db")), "--no-defaults",
                f"--datadir={base / 'data'}", f"--user={self.user}",
                "--auth-root-authentication-method=normal", "--skip-test-db",
            ],
            check=True, capture_output=True, timeout=60,
        )  # fmt: skip

    def start(self) -> None:
        log = open(self.base / "server.log", "ab")  # noqa: SIM115 - the server owns it
        self.process = subprocess.Popen(
            [
                str(shutil.which("mariadbd")), "--no-defaults", f"--datadir={self.base / 'data'}",
                f"--port={self.port}", "--bind-address=127.0.0.1",
                f"--socket={self.base / 'sock'}", f"--pid-file={self.base / 'pid'}",
                f"--user={self.user}", "--skip-log-bin", "--innodb-buffer-pool-size=16M",
            ],
            stdout=log, stderr=log,
        )  # fmt: skip
        log.close()
        deadline = time.monotonic() + 30
        while True:
            try:
                conn = pymysql.connect(host="127.0.0.1", port=self.port, user="root")
                break
            except pymysql.err.OperationalError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        with conn.cursor() as cursor:
            cursor.execute("CREATE DATABASE IF NOT EXISTS oncely")
        conn.close()

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)  # a crash, not a clean shutdown
            self.process.wait(timeout=30)
        self.process = None

    @property
    def url(self) -> str:
        return f"mysql://root@127.0.0.1:{self.port}/oncely?connect_timeout=2&pool_size=2"

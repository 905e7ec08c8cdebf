"""A server of the test's own, SIGKILLed and restarted: the store recovers."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pymysql
import pytest

from oncely.errors import (
    StoreUnavailable,
)
from oncely.stores import ClaimStatus
from oncely.stores.mysql.async_store import AsyncMySQLStore
from oncely.stores.mysql.sync_store import MySQLStore
from tests.stores.mysql.helpers import _claim, _claim_in, _free_port


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


@pytest.fixture
def private_server(tmp_path: Path, server: None) -> Iterator[PrivateServer]:
    if not (shutil.which("mariadbd") and shutil.which("mariadb-install-db")):
        pytest.skip("mariadbd is not installed here")
    made = PrivateServer(tmp_path)
    made.start()
    try:
        yield made
    finally:
        made.kill()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_store_recovers_after_its_server_crashes_and_restarts(
    private_server: PrivateServer,
) -> None:
    store = MySQLStore.from_url(private_server.url)
    try:
        _claim(store, "committed", "t1")
        pending = store.transaction()
        tx = pending.__enter__()
        _claim_in(store, tx, "in-flight", "t2")
        private_server.kill()
        with pytest.raises(StoreUnavailable):
            pending.__exit__(None, None, None)  # the COMMIT never reached a server
        with pytest.raises(StoreUnavailable):
            store.get("billing", "committed")  # nobody listens: refused at once
        private_server.start()
        record = store.get("billing", "committed")  # dead connections dropped, new ones made
        assert record is not None and record.token == "t1"  # InnoDB recovered the commit
        assert store.get("billing", "in-flight") is None  # and rolled back the open one
        assert _claim(store, "after", "t3").status is ClaimStatus.NEW
    finally:
        store.close()

    async def async_side() -> None:
        made = AsyncMySQLStore.from_url(private_server.url)
        try:
            assert await made.get("billing", "after") is not None
            private_server.kill()
            private_server.start()
            await asyncio.sleep(0.05)  # let the event loop read the end of file
            record = await made.get("billing", "committed")
            assert record is not None and record.token == "t1"
        finally:
            await made.aclose()

    asyncio.run(async_side())

"""ETL units and checkpoints (R19): files re-fed and a log resumed from its checkpoint after a
``SIGKILL``, every unit applied once, on SQLite, in a process of its own."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

import oncely
from oncely.etl import Checkpoint, file_unit, range_unit

ROOT = Path(__file__).resolve().parent.parent
LINES = 200


def test_r19_a_unit_is_keyed_by_what_it_holds(tmp_path: Path) -> None:
    a, b = tmp_path / "a.csv", tmp_path / "b.csv"
    a.write_text("1\n2\n")
    b.write_text("1\n2\n")
    assert file_unit(a).startswith("file:a.csv:sha256:")
    assert file_unit(a).split(":")[-1] == file_unit(b).split(":")[-1]  # same content
    assert file_unit(a) != file_unit(b)  # another name
    assert file_unit(a, name="b.csv") == file_unit(b)
    assert range_unit("log", 10, 20) == "range:log:10-20"
    with pytest.raises(oncely.ConfigurationError):
        range_unit("log", 5, 5)
    with pytest.raises(oncely.ConfigurationError, match="keeps no checkpoints"):
        Checkpoint(oncely.Inbox(oncely.MemoryStore(), consumer="x"), "log")


def _run(db: Path, incoming: Path, log: Path, pause: float) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.etl_runner", str(db), str(incoming), str(log), str(pause)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _count(db: Path, sql: str) -> int:
    with sqlite3.connect(db) as conn:
        return int(conn.execute(sql).fetchone()[0])


def test_r19_refed_files_and_a_resumed_log_apply_every_unit_once_across_a_sigkill(
    tmp_path: Path,
) -> None:
    db, incoming, log = tmp_path / "etl.db", tmp_path / "incoming", tmp_path / "clicks.log"
    incoming.mkdir()
    for n in range(5):
        (incoming / f"orders-{n}.csv").write_text("".join(f"{n},{i}\n" for i in range(20)))
    log.write_text("".join(f"click {n}\n" for n in range(LINES)))
    with sqlite3.connect(db) as conn:
        conn.execute("CREATE TABLE orders (file TEXT, line TEXT)")
        conn.execute("CREATE TABLE clicks (n INTEGER, text TEXT)")

    doomed = _run(db, incoming, log, 0.05)
    deadline = time.monotonic() + 60
    while _count(db, "SELECT count(*) FROM clicks") < 50:  # mid-log: 5 units in
        assert time.monotonic() < deadline and doomed.poll() is None, doomed.communicate()
        time.sleep(0.02)
    os.kill(doomed.pid, signal.SIGKILL)
    doomed.wait(10)
    killed_at = _count(db, "SELECT count(*) FROM clicks")
    assert killed_at < LINES

    resumed = _run(db, incoming, log, 0)
    out, err = resumed.communicate(timeout=120)
    assert resumed.returncode == 0, err
    fields = dict(part.split("=") for part in out.split())
    assert int(fields["start"]) == killed_at  # resumed exactly past the last committed unit
    assert int(fields["duplicate"]) == 5  # the files were all loaded before the kill

    refed = _run(db, incoming, log, 0)  # everything again: nothing new
    out, err = refed.communicate(timeout=120)
    assert refed.returncode == 0, err
    assert "processed=0" in out and f"start={LINES}" in out

    assert _count(db, "SELECT count(*) FROM orders") == 5 * 20
    assert _count(db, "SELECT count(DISTINCT file || line) FROM orders") == 5 * 20
    assert _count(db, "SELECT count(*) FROM clicks") == LINES
    assert _count(db, "SELECT count(DISTINCT n) FROM clicks") == LINES
    store = oncely.SQLiteStore(db)
    assert Checkpoint(oncely.Inbox(store, consumer="loader"), "clicks.log").position() == LINES
    store.close()

"""ETL units and checkpoints (R19): files re-fed and a log resumed from its checkpoint after a
``SIGKILL``, every unit applied once, on SQLite, in a process of its own; a checkpoint that
compares each range with its mark (a range already passed is a duplicate, a gap or an overlap
is refused), in-process and with two runner processes at once, on SQLite, PostgreSQL and
MariaDB."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest

import oncely
from oncely.etl import (
    Checkpoint,
    CheckpointMismatch,
    FileChanged,
    file_contents,
    file_unit,
    range_unit,
)
from tests.etl_runner import open_store, row_writer
from tests.services import MYSQL_URL, POSTGRES_DSN, require

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


def test_r2_r19_the_same_file_fed_from_another_folder_is_a_duplicate(tmp_path: Path) -> None:
    """The payload names the unit as its key does (the file's name, as the README and the
    module show): the path, which differs from folder to folder, would be a key conflict."""
    store = oncely.SQLiteStore(tmp_path / "etl.db")
    inbox = oncely.Inbox(store, consumer="loader")
    loaded: list[Path] = []
    for folder in ("incoming", "retried"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "orders-1.csv").write_text("o-1,42\n")
    for folder in ("incoming", "retried", "retried"):
        path = tmp_path / folder / "orders-1.csv"
        handled = inbox.handle_in_transaction(
            file_unit(path),
            {"file": path.name},
            lambda _tx, _unit: loaded.append(path),  # noqa: B023
        )
        assert handled.outcome is (
            oncely.Outcome.PROCESSED if folder == "incoming" else oncely.Outcome.DUPLICATE
        )
    assert loaded == [tmp_path / "incoming" / "orders-1.csv"]
    by_path = inbox.handle_in_transaction(file_unit(path), str(path), lambda _tx, _p: None)
    assert by_path.outcome is oncely.Outcome.KEY_CONFLICT
    inbox.close()
    store.close()


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


@pytest.fixture(params=["sqlite", "postgres", "mysql"])
def where(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, str]]:
    """A store (as :func:`tests.etl_runner.open_store` names it) and an inbox table of this
    test's own, with a ``<table>_rows`` table beside it; the tables are dropped afterwards."""
    table = f"oncely_etl_{uuid.uuid4().hex[:12]}"
    if request.param == "sqlite":
        db = tmp_path / "etl.db"
        with sqlite3.connect(db) as conn:
            conn.execute(f"CREATE TABLE {table}_rows (n INTEGER)")
        yield f"sqlite:{db}", table
        return
    if request.param == "postgres":
        require("PostgreSQL", POSTGRES_DSN, 5432)
        import psycopg

        from tests.backends.postgres import drop_tables

        with psycopg.connect(POSTGRES_DSN, autocommit=True) as pg:
            pg.execute(f"CREATE TABLE {table}_rows (n INTEGER)")
    else:
        require("MariaDB", MYSQL_URL, 3306)
        from tests.backends.mysql import drop_tables, sql

        sql(f"CREATE TABLE {table}_rows (n INTEGER) ENGINE=InnoDB")
    try:
        yield request.param, table
    finally:
        drop_tables(table, f"{table}_rows")


def _rows(where: tuple[str, str]) -> list[int]:
    """The offsets written to the rows table, in order."""
    name, table = where
    query = f"SELECT n FROM {table}_rows ORDER BY n"
    if name.startswith("sqlite:"):
        with sqlite3.connect(name.removeprefix("sqlite:")) as conn:
            return [int(n) for (n,) in conn.execute(query)]
    if name == "postgres":
        import psycopg

        with psycopg.connect(POSTGRES_DSN, autocommit=True) as pg:
            return [int(n) for (n,) in pg.execute(query)]
    from tests.backends.mysql import sql

    return [int(n) for (n,) in sql(query)]


def test_r19_a_range_at_or_before_the_mark_is_a_duplicate_a_gap_or_an_overlap_is_refused(
    where: tuple[str, str],
) -> None:
    """Re-fed with other bounds than the first time, a source loads no row twice: the mark,
    not the range's key, says what was applied."""
    name, table = where
    store = open_store(name, table)
    mark = Checkpoint(oncely.Inbox(store, consumer="loader"), "log")
    written = row_writer(name, table)
    calls: list[tuple[int, int]] = []

    def write(tx: object, offsets: list[int]) -> int:
        calls.append((offsets[0], offsets[-1] + 1))
        return written(tx, offsets)

    for first in range(0, 1000, 50):  # rows 0-1000, in chunks of 50
        assert mark.apply(first, first + 50, list(range(first, first + 50)), write).ok
    assert mark.position() == 1000 and len(calls) == 20

    again = mark.apply(0, 100, list(range(100)), write)  # other bounds, all before the mark
    assert again.outcome is oncely.Outcome.DUPLICATE and again.value is None
    assert again.reason is not None and "mark 1000" in again.reason
    assert mark.apply(0, 1000, list(range(1000)), write).outcome is oncely.Outcome.DUPLICATE
    same = mark.apply(950, 1000, list(range(950, 1000)), write)  # the very unit: its result
    assert same.outcome is oncely.Outcome.DUPLICATE and same.value == 50
    with pytest.raises(CheckpointMismatch, match=r"\[5000, 5002\).*past the mark 1000") as gap:
        mark.apply(5000, 5002, [5000, 5001], write)
    assert (gap.value.mark, gap.value.first, gap.value.last) == (1000, 5000, 5002)
    assert isinstance(gap.value, oncely.ConfigurationError)
    with pytest.raises(CheckpointMismatch, match=r"\[990, 1010\).*mark 1000"):
        mark.apply(990, 1010, list(range(990, 1010)), write)
    assert mark.position() == 1000 and len(calls) == 20  # nothing ran, nothing moved

    applied = mark.apply(1000, 1010, list(range(1000, 1010)), write)  # at the mark: applied
    assert applied.outcome is oncely.Outcome.PROCESSED and mark.position() == 1010
    assert _rows(where) == list(range(1010))  # every row once
    mark.inbox.close()
    store.close()


def test_r19_a_failed_or_rejected_range_leaves_the_mark_and_is_fed_again(
    where: tuple[str, str],
) -> None:
    name, table = where
    store = open_store(name, table)
    mark = Checkpoint(oncely.Inbox(store, consumer="loader"), "log")
    written = row_writer(name, table)

    def flaky(tx: object, offsets: list[int]) -> int:
        written(tx, offsets)
        raise RuntimeError("the source hiccuped")

    def poison(tx: object, offsets: list[int]) -> int:
        raise oncely.Reject("row 12 is garbage")

    assert mark.apply(0, 10, list(range(10)), flaky).outcome is oncely.Outcome.FAILED
    assert mark.position() == 0 and _rows(where) == []
    assert mark.apply(0, 10, list(range(10)), written).outcome is oncely.Outcome.PROCESSED
    assert mark.apply(10, 20, list(range(10, 20)), poison).outcome is oncely.Outcome.REJECTED
    assert mark.apply(10, 20, list(range(10, 20)), written).outcome is oncely.Outcome.REJECTED
    assert mark.position() == 10 and _rows(where) == list(range(10))
    # The two ways on the README gives: rows set aside in a range of other bounds (here
    # 10 alone, written to the rejects: not loaded)...
    aside: list[int] = []
    set_aside = mark.apply(10, 11, [10], lambda _tx, rows: aside.extend(rows))
    assert set_aside.outcome is oncely.Outcome.PROCESSED and mark.position() == 11
    # ... or the rejected unit forgotten, once what the handler refused is fixed: its range
    # runs again.
    assert mark.apply(11, 20, list(range(11, 20)), poison).outcome is oncely.Outcome.REJECTED
    assert store.forget("loader", range_unit("log", 11, 20))
    assert mark.apply(11, 20, list(range(11, 20)), written).outcome is oncely.Outcome.PROCESSED
    assert mark.position() == 20 and aside == [10]
    assert _rows(where) == [*range(10), *range(11, 20)]
    mark.inbox.close()
    store.close()


def test_r19_a_rejected_range_the_mark_passed_by_rows_set_aside_is_a_duplicate(
    where: tuple[str, str],
) -> None:
    """The README's way on after a rejected range: its rows set aside in ranges of other
    bounds, the mark passes it. Fed again with its first bounds (the source re-read from the
    start in the same chunks), that range is at or before the mark: a ``duplicate``, as every
    such range is. Before, its rejected marker answered ``rejected`` again, as if those rows
    were still refused and the mark stood before them."""
    name, table = where
    store = open_store(name, table)
    mark = Checkpoint(oncely.Inbox(store, consumer="loader"), "log")
    written = row_writer(name, table)

    def poison(_tx: object, _offsets: list[int]) -> int:
        raise oncely.Reject("row 12 is garbage")

    assert mark.apply(0, 10, list(range(10)), written).ok
    assert mark.apply(10, 20, list(range(10, 20)), poison).outcome is oncely.Outcome.REJECTED
    aside: list[int] = []
    for n in range(10, 20):  # one row at a time: row 12 to the rejects, the others loaded
        handler = (lambda _tx, rows: aside.extend(rows)) if n == 12 else written
        assert mark.apply(n, n + 1, [n], handler).outcome is oncely.Outcome.PROCESSED
    assert mark.position() == 20

    for first in range(0, 20, 10):  # the source again, in its first chunks
        again = mark.apply(first, first + 10, list(range(first, first + 10)), poison)
        assert again.outcome is oncely.Outcome.DUPLICATE, again
    assert again.reason is not None and "mark 20" in again.reason
    assert mark.position() == 20 and aside == [12]
    assert _rows(where) == [n for n in range(20) if n != 12]
    mark.inbox.close()
    store.close()


@pytest.mark.parametrize(
    ("stream", "why"),
    [
        ("", "1 to 255 characters"),
        ("s" * 256, "1 to 255 characters"),
        ("\u00e9" * 255, "over the limit of 512"),  # 255 characters, but 510 bytes
        ("clicks\x00.log", "NUL"),
        ("clicks-\udcff.log", "not UTF-8"),  # a file name that was not UTF-8
    ],
)
def test_r2_r19_a_stream_a_checkpoint_cannot_keep_is_refused_when_it_is_made(
    where: tuple[str, str], stream: str, why: str
) -> None:
    """Before, such a checkpoint was made, then each store told of it in its own way at the
    first apply: a driver's UnicodeEncodeError, a StoreError on PostgreSQL but a ``rejected``
    unit on SQLite for a NUL, and every unit ``rejected`` (the mark never moving) for a key
    the inbox refuses."""
    name, table = where
    store = open_store(name, table)
    inbox = oncely.Inbox(store, consumer="loader")
    with pytest.raises(oncely.ConfigurationError, match=why):
        Checkpoint(inbox, stream)
    assert _rows(where) == []
    inbox.close()
    store.close()


def test_r19_a_range_past_the_largest_offset_kept_is_refused_before_anything_runs(
    where: tuple[str, str],
) -> None:
    """Before, the handler ran and the mark's write then failed: ``failed``, with a reason
    blaming the handler (an OverflowError on SQLite, a StoreError elsewhere)."""
    name, table = where
    store = open_store(name, table)
    mark = Checkpoint(oncely.Inbox(store, consumer="loader"), "log")
    written = row_writer(name, table)
    with pytest.raises(oncely.ConfigurationError, match="largest offset"):
        mark.apply(0, 2**63, [0], written)
    assert mark.position() == 0 and _rows(where) == []
    assert mark.apply(0, 2**63 - 1, [0], written).outcome is oncely.Outcome.PROCESSED
    assert mark.position() == 2**63 - 1
    mark.inbox.close()
    store.close()


def _apply(
    where: tuple[str, str], first: int, last: int, start_at: float, hold: float, stream: str = "log"
) -> subprocess.Popen[str]:
    name, table = where
    return subprocess.Popen(
        [sys.executable, "-m", "tests.etl_runner", "apply", name, table, str(first), str(last),
         str(start_at), str(hold), stream],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def _race(where: tuple[str, str], *ranges: tuple[int, int]) -> list[str]:
    """Run one runner per range, each starting 0.3 s after the one before, each holding its
    transaction 1.5 s: their outputs in the order of ``ranges``."""
    start = time.time() + 3.0
    runners = [_apply(where, a, b, start + 0.3 * n, 1.5) for n, (a, b) in enumerate(ranges)]
    outputs = [r.communicate(timeout=120) for r in runners]
    assert all(r.returncode == 0 for r in runners), outputs
    return [out.strip() for out, _err in outputs]


def test_r8_r19_two_runners_feeding_one_range_at_once_apply_it_once(
    where: tuple[str, str],
) -> None:
    assert sorted(o.split()[0] for o in _race(where, (0, 20), (0, 20))) == [
        "duplicate",
        "processed",
    ]
    assert _rows(where) == list(range(20))


def test_r8_r19_two_runners_feeding_other_bounds_at_once_load_each_row_once(
    where: tuple[str, str],
) -> None:
    """The second runner waits for the first's transaction, then compares its range with the
    mark the first one committed: already passed, it is a duplicate; overlapping, refused."""
    wider_first = _race(where, (0, 20), (0, 10))
    assert [o.split()[0] for o in wider_first] == ["processed", "duplicate"], wider_first
    assert _rows(where) == list(range(20))
    narrower_first = _race(where, (20, 30), (20, 40))
    assert narrower_first[0].split()[0] == "processed", narrower_first
    assert narrower_first[1].startswith("refused") and "mark 30" in narrower_first[1]
    assert _rows(where) == list(range(30))


def _waiting_on_the_mark(where: tuple[str, str]) -> int | None:
    """How many transactions wait for a lock in a statement on the offsets table of
    ``where`` (None on SQLite, which does not tell)."""
    name, table = where
    if name == "postgres":
        import psycopg

        with psycopg.connect(POSTGRES_DSN, autocommit=True) as pg:
            row = pg.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                "AND query LIKE %s",
                (f"%{table}_offsets%",),
            ).fetchone()
        return int(row[0]) if row else 0
    if name == "mysql":
        from tests.backends.mysql import sql

        found = sql(
            "SELECT count(*) FROM information_schema.innodb_trx "
            f"WHERE trx_state = 'LOCK WAIT' AND trx_query LIKE '%{table}_offsets%'"
        )
        return int(found[0][0])
    return None


def test_r8_r19_runners_waiting_on_a_killed_first_apply_go_on_without_an_error(
    where: tuple[str, str],
) -> None:
    """A stream's first apply, its runner SIGKILLed while it holds the mark, with runners
    waiting for it: each then applies its range or is told why not, and every row is written
    once. Before, on MariaDB, the waiters had waited for the killed runner's uncommitted
    insert of the mark's row, and when it rolled back InnoDB answered some of them with a
    deadlock: a StoreUnavailable out of apply, from a crash that was not theirs."""
    ranges = [(0, 10), (0, 20), (0, 10), (0, 5)]
    holder = _apply(where, 0, 10, 0, 600)
    assert holder.stderr is not None
    assert holder.stderr.readline().strip() == "holding", holder.communicate()
    waiters = [_apply(where, a, b, 0, 0) for a, b in ranges]
    deadline = time.monotonic() + 60
    while (waiting := _waiting_on_the_mark(where)) != len(waiters):  # all wait for the holder
        assert time.monotonic() < deadline, waiting
        if waiting is None:  # SQLite does not tell: time enough for them to start and wait
            time.sleep(3)
            break
        time.sleep(0.05)
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait(10)
    outputs = [w.communicate(timeout=120) for w in waiters]
    assert all(w.returncode == 0 for w in waiters), [err for _out, err in outputs]
    outcomes = [out.split()[0] for out, _err in outputs]
    assert outcomes.count("processed") == 1, outcomes
    assert set(outcomes) <= {"processed", "duplicate", "refused"}, outcomes
    assert _rows(where) == list(range(ranges[outcomes.index("processed")][1]))


def test_r19_file_contents_keys_the_bytes_it_returns(tmp_path: Path) -> None:
    path = tmp_path / "orders.csv"
    path.write_bytes(b"o-1,42\n")
    key, data = file_contents(path)
    assert key == file_unit(path) and data == b"o-1,42\n"
    path.write_bytes(b"o-1,42\no-2,7\n")  # the file changed after it was keyed
    assert data == b"o-1,42\n" and file_unit(path) != key  # what was keyed is what is loaded


def test_r19_a_file_still_being_written_is_refused_rather_than_keyed(tmp_path: Path) -> None:
    """Before, a file keyed while its writer still appended was keyed by a part of it, and
    came back whole under another key: its first rows loaded twice."""
    path = tmp_path / "growing.csv"
    path.write_bytes(b"x" * (64 << 20))  # long enough to read that the writer gets a turn
    reading = threading.Event()
    done = threading.Event()

    def writer() -> None:
        with path.open("ab") as out:
            while not done.is_set():
                out.write(b"row\n")
                out.flush()
                reading.set()
                time.sleep(0.0005)

    thread = threading.Thread(target=writer, daemon=True)
    thread.start()
    reading.wait(5)
    try:
        with pytest.raises(FileChanged, match="still being written"):
            file_unit(path)
        with pytest.raises(FileChanged):
            file_contents(path)
    finally:
        done.set()
        thread.join(5)
    assert file_unit(path).startswith("file:growing.csv:sha256:")  # complete: keyed


@pytest.mark.parametrize("bounds", [(0.0, 1), (0, 1.5), (False, True), ("0", "1")])
def test_r2_a_range_of_bounds_that_are_not_whole_offsets_is_refused(
    bounds: tuple[object, object],
) -> None:
    """``1.5`` and ``True`` compare as offsets, but they key the range otherwise
    (``range:s:0-1.5``, ``range:s:False-True``): the same rows would be two units."""
    with pytest.raises(oncely.ConfigurationError, match="whole offsets"):
        range_unit("s", *bounds)  # type: ignore[arg-type]


def test_r2_r19_a_file_whose_name_is_not_utf8_is_refused_when_it_is_keyed(tmp_path: Path) -> None:
    """A file name is bytes on POSIX: one written by another system (``caf\\xe9.csv``, Latin-1)
    comes back from ``os.listdir`` with an escape. Before, ``file_unit`` keyed it anyway, and
    the inbox answered that key ``rejected``, unrecorded, on every scan: the file was never
    loaded, and a loop that reads no outcome never heard of it. Keys are lossless (R2): the
    name is refused where it is keyed, and ``name=`` keys the file once a name is chosen."""
    incoming = tmp_path / "incoming"
    incoming.mkdir()
    path = Path(os.fsdecode(os.fsencode(incoming) + b"/caf\xe9.csv"))
    path.write_bytes(b"o-1,42\n")
    assert [p.name for p in incoming.iterdir()] == [path.name]
    with pytest.raises(oncely.InvalidKey, match=r"file name .* is not UTF-8"):
        file_unit(path)
    with pytest.raises(oncely.InvalidKey, match="name="):
        file_contents(path)
    with pytest.raises(oncely.InvalidKey, match="file name"):
        file_unit(incoming / "orders.csv", name="orders\x00.csv")  # a NUL in a name= given

    store = oncely.SQLiteStore(tmp_path / "etl.db")
    inbox = oncely.Inbox(store, consumer="loader")
    chosen = os.fsencode(path.name).decode("latin-1")  # the name as its writer meant it
    key, data = file_contents(path, name=chosen)
    assert key.startswith("file:café.csv:sha256:") and data == b"o-1,42\n"
    loaded = inbox.handle_in_transaction(key, {"file": chosen}, lambda _tx, _unit: len(data))
    assert loaded.outcome is oncely.Outcome.PROCESSED and loaded.value == 7
    inbox.close()
    store.close()


def test_r13_r19_a_file_unit_is_skipped_only_while_the_inbox_keeps_its_record(
    tmp_path: Path,
) -> None:
    """What the README's ETL section says of file units and retention: a folder scanned again
    once the records expired loads its files again; an inbox that keeps them longer than the
    files can come back skips them (the store's own clock, moved on, not the wall's)."""
    incoming = tmp_path / "incoming"
    incoming.mkdir()
    for n in range(3):
        (incoming / f"orders-{n}.csv").write_text(f"{n},42\n")
    clock = oncely.FakeClock()

    def scan(inbox: oncely.Inbox) -> list[str]:
        outcomes = []
        for path in sorted(incoming.glob("*.csv")):
            key, data = file_contents(path)
            handled = inbox.handle_in_transaction(
                key,
                {"file": path.name},
                lambda _tx, _unit: len(data),  # noqa: B023
            )
            outcomes.append(handled.outcome.value)
        return outcomes

    for keep, again in [(timedelta(days=7), "processed"), (timedelta(days=30), "duplicate")]:
        store = oncely.SQLiteStore(tmp_path / f"etl-{keep.days}.db", clock=clock)
        inbox = oncely.Inbox(store, consumer="loader", retention=oncely.Retention(keep=keep))
        assert scan(inbox) == ["processed"] * 3
        assert scan(inbox) == ["duplicate"] * 3
        clock.advance(timedelta(days=8))  # the folder scanned again a week and a day later
        assert scan(inbox) == [again] * 3
        inbox.close()
        store.close()

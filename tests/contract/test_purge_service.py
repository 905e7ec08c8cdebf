"""One purge leads per table (R13): the purge service's lock, on every store that has one.

Two stores on one table (as two processes of a fleet would open it): while one holds the
purge lead the other is refused it, and gets it once the first lets go; a process that dies
holding the lead (a real SIGKILL) loses it with its session or file lock. The service itself
purges only while it leads, reports each run, and ``oncely inbox purge --every`` run twice at
once purges with one of them only.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from datetime import timedelta
from pathlib import Path

import pytest

import oncely
from tests.backends import BACKENDS, Backend, Scope

LOCKING = sorted(n for n in ("mysql", "postgres", "sqlite") if n in BACKENDS)


def _pair(backend: Backend, scope: Scope) -> tuple[oncely.Store, oncely.Store]:
    first = backend.make_sync(scope, None)
    first.migrate()
    return first, backend.make_sync(scope, None)  # the same table, another "process"


@pytest.mark.parametrize("name", LOCKING)
def test_r13_one_purge_leads_a_table_at_a_time(name: str, scope: Scope) -> None:
    backend = BACKENDS[name]
    backend.require()
    one, two = _pair(backend, scope)
    with (
        one.purge_leader() as first,  # type: ignore[attr-defined]
        two.purge_leader() as second,  # type: ignore[attr-defined]
    ):
        assert (first, second) == (True, False)
    with two.purge_leader() as second:  # type: ignore[attr-defined]
        assert second
    one.close()
    two.close()


@pytest.mark.parametrize("name", LOCKING)
def test_r13_the_purge_service_purges_only_while_it_leads(name: str, scope: Scope) -> None:
    backend = BACKENDS[name]
    backend.require()
    one, two = _pair(backend, scope)
    for i in range(30):
        one.claim("c", f"k{i}", fingerprint=None, token=f"t{i}", lease_ms=60_000,
                  keep_ms=60_000, takeover=False)  # fmt: skip
        one.complete("c", f"k{i}", token=f"t{i}", result=None, keep_ms=1)
    time.sleep(0.01)
    runs: list[oncely.PurgeRun] = []
    batches: list[tuple[int, int]] = []
    follower = oncely.PurgeService(two, every=timedelta(seconds=1), on_run=runs.append)
    with one.purge_leader() as leads:  # type: ignore[attr-defined]
        assert leads
        assert follower.run_once() == runs[-1]
        assert (runs[-1].leader, runs[-1].deleted) == (False, 0)
    follower.on_batch = lambda taken, deleted: batches.append((taken, deleted))
    follower.batch_size = 7
    run = follower.run_once()
    assert (run.leader, run.deleted) == (True, 30)
    assert sum(deleted for _, deleted in batches) == 30 and run.batches == len(batches) == 5
    assert run.rows_per_s > 0
    one.close()
    two.close()


@pytest.mark.parametrize("name", LOCKING)
def test_r13_a_purge_stopped_between_batches_reports_what_it_deleted(
    name: str, scope: Scope
) -> None:
    """A service stopped mid-run (SIGTERM to `oncely inbox purge --every`, a consumer's
    shutdown) reports, logs and hands ``on_run`` the records its batches deleted, not 0."""
    backend = BACKENDS[name]
    backend.require()
    store = backend.make_sync(scope, None)
    store.migrate()
    for i in range(30):
        store.claim("c", f"k{i}", fingerprint=None, token=f"t{i}", lease_ms=60_000,
                    keep_ms=60_000, takeover=False)  # fmt: skip
        store.complete("c", f"k{i}", token=f"t{i}", result=None, keep_ms=1)
    time.sleep(0.01)
    service = oncely.PurgeService(store, every=timedelta(seconds=1), batch_size=5)
    seen: list[int] = []

    def batch(taken: int, deleted: int) -> None:
        seen.append(deleted)
        if len(seen) == 2:
            service.stop()

    service.on_batch = batch
    run = service.run_once()
    left = store.stats().expired
    assert 0 < left < 30  # stopped before the end
    assert (run.leader, run.deleted, run.batches) == (True, 30 - left, 2)
    store.close()


def test_r13_a_purge_lock_file_that_cannot_be_opened_is_a_store_error(tmp_path: Path) -> None:
    """The lock file beside a SQLite database that cannot be opened (here a directory in
    its place; in production a file another user created) is a store error that names it:
    `oncely inbox purge` exits 3 saying so, and a purge service (the one inside a consumer
    too) logs it and tries again at its next run, instead of ending without a word."""
    db = tmp_path / "inbox.db"
    store = oncely.SQLiteStore(db)
    store.migrate()
    (tmp_path / "inbox.db-oncely-purge.lock").mkdir()
    service = oncely.PurgeService(store, every=timedelta(milliseconds=1))
    with pytest.raises(oncely.StoreUnavailable, match=r"inbox\.db-oncely-purge\.lock"):
        service.run_once()
    done = subprocess.run(
        [sys.executable, "-m", "oncely", "inbox", "purge", "--store", f"sqlite:///{db}"],
        check=False, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 3, done.stderr
    assert "oncely-purge.lock" in done.stderr and "unexpected" not in done.stderr
    store.close()


def test_r13_a_purge_service_outlives_an_on_run_that_raises(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A report hook (``on_run``) that raises is logged, and the service runs on: a metrics
    bug must not end the purge of a consumer that runs it beside itself."""
    store = oncely.SQLiteStore(tmp_path / "inbox.db")
    store.migrate()
    calls: list[oncely.PurgeRun] = []
    service = oncely.PurgeService(store, every=timedelta(milliseconds=1))

    def report(run: oncely.PurgeRun) -> None:
        calls.append(run)
        if len(calls) == 3:
            service.stop()
        raise RuntimeError("metrics backend down")

    service.on_run = report
    with caplog.at_level("ERROR", logger="oncely.purge"):
        service.run()
    assert len(calls) == 3
    raised = [r.exc_info[1] for r in caplog.records if r.exc_info and r.exc_info[1]]
    assert [str(exc) for exc in raised] == ["metrics backend down"] * 3
    store.close()


HOLD = """
import sys, time, oncely
store = oncely.open(sys.argv[1])
with store.purge_leader() as leads:
    print("leads" if leads else "follows", flush=True)
    time.sleep(120)
"""


def _url(name: str, scope: Scope) -> str:
    if name == "sqlite":
        return f"sqlite:///{scope.tmp_path / 'oncely.db'}"
    from tests.backends.postgres import table_name
    from tests.services import POSTGRES_DSN

    return f"{POSTGRES_DSN}{'&' if '?' in POSTGRES_DSN else '?'}table={table_name(scope)}"


@pytest.mark.parametrize("name", [n for n in LOCKING if n in ("postgres", "sqlite")])
def test_r13_a_leader_killed_with_sigkill_hands_the_lead_on(name: str, scope: Scope) -> None:
    backend = BACKENDS[name]
    backend.require()
    store = backend.make_sync(scope, None)
    store.migrate()
    child = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(HOLD), _url(name, scope)],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "leads"
        with store.purge_leader() as leads:  # type: ignore[attr-defined]
            assert not leads
        os.kill(child.pid, signal.SIGKILL)
        child.wait(10)
        deadline = time.monotonic() + 10
        while True:  # the server notices the dead session within moments
            with store.purge_leader() as leads:  # type: ignore[attr-defined]
                if leads or time.monotonic() > deadline:
                    break
            time.sleep(0.1)
        assert leads
    finally:
        child.kill()
        child.wait(10)
        store.close()


def test_r13_two_purge_services_at_once_one_purges(tmp_path: Path) -> None:
    db = tmp_path / "inbox.db"
    store = oncely.SQLiteStore(db)
    store.migrate()
    for i in range(20):
        store.claim("c", f"k{i}", fingerprint=None, token=f"t{i}", lease_ms=60_000,
                    keep_ms=60_000, takeover=False)  # fmt: skip
        store.complete("c", f"k{i}", token=f"t{i}", result=None, keep_ms=1)
    oncely_command = str(Path(sys.executable).with_name("oncely"))  # the installed script
    command = [oncely_command, "inbox", "purge", "--store", f"sqlite:///{db}"]
    # The test holds the lead first (a third purge), so both services wait their turn; then
    # they take turns, and every expired record is deleted once by one or the other.
    with store.purge_leader() as leads:  # type: ignore[attr-defined]
        assert leads
        services = [
            subprocess.Popen([*command, "--every", "200ms"], stdout=subprocess.PIPE, text=True)
            for _ in range(2)
        ]
        firsts = [service.stdout.readline() for service in services]  # type: ignore[union-attr]
    time.sleep(2)
    store.close()
    for service in services:
        service.send_signal(signal.SIGTERM)
    outputs = [
        first + service.communicate(timeout=20)[0]
        for first, service in zip(firsts, services, strict=True)
    ]
    assert [s.returncode for s in services] == [0, 0], outputs
    purged = [
        int(line.split()[1]) for out in outputs for line in out.splitlines()
        if line.startswith("purged ")
    ]  # fmt: skip
    assert sum(purged) == 20, outputs  # every expired record, deleted once
    assert all(out.rstrip().endswith("purge service stopped") for out in outputs)
    assert all(out.startswith("another purge leads") for out in outputs), outputs

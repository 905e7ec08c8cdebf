"""Scheduled jobs run once per slot (R19): slot keys in a time zone, two runner processes
firing for the same slot at once, and a runner SIGKILLed mid-job whose slot the next run
takes over once the lease lapses."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

import oncely
from oncely.jobs import run_once, slot

ROOT = Path(__file__).resolve().parent.parent


def test_r19_a_slot_is_the_period_the_moment_falls_in_in_the_time_zone() -> None:
    late = datetime(2026, 11, 30, 23, 30, tzinfo=UTC)  # already 1 December in Rome
    assert slot("report", "day", at=late) == "report:2026-11-30"
    assert slot("report", "day", at=late, tz="Europe/Rome") == "report:2026-12-01"
    assert slot("report", "hour", at=late, tz="Europe/Rome") == "report:2026-12-01T00"
    assert slot("report", "minute", at=late) == "report:2026-11-30T23:30"
    assert slot("report", "week", at=late, tz="Europe/Rome") == "report:2026-W49"
    assert slot("report", "month", at=late) == "report:2026-11"
    assert slot("sync", timedelta(minutes=15), at=late) == "sync:2026-11-30T23:30:00Z"
    with pytest.raises(oncely.ConfigurationError, match="time zone"):
        slot("report", "day", tz="Mars/Olympus")
    with pytest.raises(oncely.ConfigurationError, match="timezone-aware"):
        slot("report", "day", at=datetime(2026, 12, 1))
    with pytest.raises(oncely.ConfigurationError, match="holds no"):
        slot("a:b", "day")


def test_r19_in_process_a_finished_slot_is_a_duplicate_and_a_failed_one_runs_again(
    tmp_path: Path,
) -> None:
    inbox = oncely.Inbox(oncely.SQLiteStore(tmp_path / "jobs.db"), consumer="jobs")
    at = datetime(2026, 12, 1, 9, tzinfo=UTC)
    runs: list[int] = []

    def flaky() -> int:
        runs.append(1)
        if len(runs) == 1:
            raise RuntimeError("the mail server is down")
        return len(runs)

    first = run_once(inbox, "mail", flaky, every="day", at=at)
    assert first.outcome is oncely.Outcome.FAILED
    second = run_once(inbox, "mail", flaky, every="day", at=at)
    assert second.outcome is oncely.Outcome.PROCESSED and second.value == 2
    third = run_once(inbox, "mail", flaky, every="day", at=at)
    assert third.outcome is oncely.Outcome.DUPLICATE and third.value == 2
    tomorrow = run_once(inbox, "mail", flaky, every="day", at=at + timedelta(days=1))
    assert tomorrow.outcome is oncely.Outcome.PROCESSED
    assert len(runs) == 3
    inbox.close()


def _runner(db: Path, effects: Path, sleep: float, lease: float, start_at: float, who: str):  # type: ignore[no-untyped-def]
    return subprocess.Popen(
        [sys.executable, "-m", "tests.jobs_runner", str(db), str(effects), str(sleep),
         str(lease), str(start_at), who],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def test_r19_two_runners_firing_for_one_slot_at_once_run_the_job_once(tmp_path: Path) -> None:
    db, effects = tmp_path / "jobs.db", tmp_path / "effects.txt"
    effects.touch()
    oncely.SQLiteStore(db).close()  # the tables exist before the race
    start = time.time() + 2.0
    runners = [_runner(db, effects, 1.5, 10, start, who) for who in ("a", "b")]
    outputs = [r.communicate(timeout=60) for r in runners]
    assert all(r.returncode == 0 for r in runners), outputs
    outcomes = sorted(out.split()[0] for out, _err in outputs)
    assert outcomes == ["in_flight", "processed"]
    lines = effects.read_text().splitlines()
    assert len(lines) == 2 and lines[0].endswith("started") and lines[1].endswith("done")


def test_r10_r19_a_runner_killed_mid_job_is_taken_over_after_its_lease(tmp_path: Path) -> None:
    db, effects = tmp_path / "jobs.db", tmp_path / "effects.txt"
    effects.touch()
    doomed = _runner(db, effects, 60, 3.0, 0, "doomed")
    deadline = time.monotonic() + 30
    while "doomed started" not in effects.read_text():
        assert time.monotonic() < deadline and doomed.poll() is None, doomed.stderr
        time.sleep(0.05)
    os.kill(doomed.pid, signal.SIGKILL)
    doomed.wait(10)
    early = _runner(db, effects, 0, 3.0, 0, "early")  # the lease has not lapsed yet
    assert early.communicate(timeout=60)[0].split()[0] == "in_flight"
    time.sleep(3.5)
    late = _runner(db, effects, 0, 3.0, 0, "late")
    out, err = late.communicate(timeout=60)
    assert out.split()[0] == "stale_reclaimed", err
    again = _runner(db, effects, 0, 3.0, 0, "again")
    assert again.communicate(timeout=60)[0].split()[:2] == ["duplicate", "report"]
    assert effects.read_text().splitlines() == ["doomed started", "late started", "late done"]


@dataclass(frozen=True)
class Report:
    rows: int
    at: datetime


def test_r1_r19_a_later_run_of_a_slot_gets_the_first_runs_result_as_its_type(
    tmp_path: Path,
) -> None:
    inbox = oncely.Inbox(oncely.SQLiteStore(tmp_path / "jobs.db"), consumer="jobs")
    at = datetime(2026, 12, 1, 9, tzinfo=UTC)

    def build() -> Report:
        return Report(12, at)

    first = run_once(inbox, "report", build, every="day", at=at)
    again = run_once(inbox, "report", build, every="day", at=at)
    assert again.outcome is oncely.Outcome.DUPLICATE and again.value == first.value
    assert isinstance(again.value, Report)
    kept = run_once(inbox, "report", build, every="day", at=at, returns=None)
    assert kept.value == {"rows": 12, "at": "2026-12-01T09:00:00+00:00"}
    inbox.close()

"""Scheduled jobs run once per slot (R19): slot keys in a time zone, two runner processes
firing for the same slot at once, and a runner SIGKILLed mid-job whose slot the next run
takes over once the lease lapses."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta, timezone, tzinfo
from functools import partial
from pathlib import Path
from zoneinfo import ZoneInfo

import psycopg
import pytest

import oncely
from oncely.jobs import Every, run_once, run_once_async, slot
from tests.brokers.common import Proxy
from tests.services import POSTGRES_DSN, require

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


@pytest.mark.parametrize("store", ["sqlite", "postgres"])
def test_r2_r19_a_job_name_whose_slot_key_the_inbox_refuses_is_refused_before_it_runs(
    tmp_path: Path, store: str
) -> None:
    """A job name is configuration, refused as an empty one or one holding ``:`` is. Before,
    a name too long for the inbox's key limit (or not UTF-8, or with a NUL) came back as a
    ``rejected`` outcome that nothing recorded, on every run: the job never ran, and a
    runner that does not read the outcome never heard of it."""
    if store == "postgres":
        require("PostgreSQL", POSTGRES_DSN, 5432)
        table = f"jobs_name_{uuid.uuid4().hex[:10]}"
        opened = oncely.open(f"{POSTGRES_DSN}?table={table}")
    else:
        opened = oncely.SQLiteStore(tmp_path / "jobs.db")
    inbox = oncely.Inbox(opened, consumer="jobs")
    ran: list[str] = []
    try:
        for name, why in [("r" * 600, "over the limit of 512"), ("report\x00", "NUL")]:
            with pytest.raises(oncely.ConfigurationError, match=why):
                run_once(inbox, name, lambda: ran.append("report"), every="day")
        hashed = oncely.Inbox(opened, consumer="jobs", limits=oncely.Limits(hash_long_keys=True))
        assert run_once(hashed, "r" * 600, lambda: ran.append("hashed"), every="day").ok
        assert ran == ["hashed"]
        hashed.close()

        async def job() -> None:
            ran.append("async")

        async def run_async() -> None:
            async_store = oncely.open_async(
                f"{POSTGRES_DSN}?table={table}"
                if store == "postgres"
                else f"sqlite:///{tmp_path / 'jobs.db'}"
            )
            async_inbox = oncely.AsyncInbox(async_store, consumer="jobs")
            try:
                with pytest.raises(oncely.ConfigurationError, match="over the limit of 512"):
                    await run_once_async(async_inbox, "r" * 600, job, every="day")
            finally:
                await async_inbox.aclose()
                await async_store.aclose()

        asyncio.run(run_async())
        assert ran == ["hashed"]
    finally:
        inbox.close()
        opened.close()
        if store == "postgres":
            from tests.backends.postgres import drop_tables

            drop_tables(table)


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


def test_r19_the_repeated_local_hour_of_a_dst_fall_back_is_a_slot_of_its_own(
    tmp_path: Path,
) -> None:
    # Europe/Rome on 25 October 2026: 03:00 CEST becomes 02:00 CET, so 02:00-03:00 is lived
    # twice (00:00-01:00 UTC, then 01:00-02:00 UTC).
    first, second = (
        datetime(2026, 10, 25, 0, 30, tzinfo=UTC),
        datetime(2026, 10, 25, 1, 30, tzinfo=UTC),
    )
    assert slot("hourly", "hour", at=first, tz="Europe/Rome") == "hourly:2026-10-25T02"
    assert slot("hourly", "hour", at=second, tz="Europe/Rome") == "hourly:2026-10-25T02+01:00"
    assert slot("tick", "minute", at=first, tz="Europe/Rome") == "tick:2026-10-25T02:30"
    assert slot("tick", "minute", at=second, tz="Europe/Rome") == "tick:2026-10-25T02:30+01:00"
    assert slot("daily", "day", at=second, tz="Europe/Rome") == "daily:2026-10-25"  # one day
    west = datetime(2026, 11, 1, 6, 30, tzinfo=UTC)  # New York: 01:00-02:00 twice, at 05 and 06Z
    assert slot("hourly", "hour", at=west, tz="America/New_York") == "hourly:2026-11-01T01-05:00"
    assert slot("hourly", "hour", at=west - timedelta(hours=1), tz="America/New_York") == (
        "hourly:2026-11-01T01"
    )

    inbox = oncely.Inbox(oncely.SQLiteStore(tmp_path / "jobs.db"), consumer="jobs")
    runs: list[datetime] = []
    for at in (first, second, second):
        handled = run_once(
            inbox, "hourly", partial(runs.append, at), every="hour", tz="Europe/Rome", at=at
        )
    assert runs == [first, second]  # the second 02:00-03:00 hour runs; its repeat does not
    assert handled.outcome is oncely.Outcome.DUPLICATE
    inbox.close()


def test_r19_every_real_hour_and_minute_has_one_slot_and_only_ambiguous_keys_change() -> None:
    """A year of hours in three zones (Lord Howe Island moves its clocks by half an hour), and
    the minutes of Rome's two DST days: moments of different real hours (minutes) never share
    a slot, so no run is skipped; and a slot that is not the second pass of a repeated local
    time keeps the key it always had."""
    for tz in ("Europe/Rome", "America/New_York", "Australia/Lord_Howe"):
        zone = ZoneInfo(tz)
        start = datetime(2026, 1, 1, tzinfo=UTC)
        hours = [start + timedelta(hours=n) for n in range(365 * 24)]
        keys = [slot("h", "hour", at=at, tz=tz) for at in hours]
        assert len(set(keys)) == len(keys), tz
        for at, key in zip(hours, keys, strict=True):
            local = at.astimezone(zone)
            if local.fold == 0:
                assert key == f"h:{local:%Y-%m-%dT%H}"  # the key of every earlier release
    for day in (datetime(2026, 3, 29, tzinfo=UTC), datetime(2026, 10, 25, tzinfo=UTC)):
        minutes = [day + timedelta(minutes=n) for n in range(24 * 60)]
        keys = [slot("m", "minute", at=at, tz="Europe/Rome") for at in minutes]
        assert len(set(keys)) == len(keys)


def test_r19_a_local_hour_the_clocks_skip_has_no_slot_and_no_real_hour_goes_without_one() -> None:
    # Europe/Rome on 29 March 2026: 02:00 CET becomes 03:00 CEST; local 02:xx never happens.
    at = datetime(2026, 3, 29, 0, 30, tzinfo=UTC)
    keys = [slot("hourly", "hour", at=at + timedelta(hours=n), tz="Europe/Rome") for n in range(3)]
    assert keys == ["hourly:2026-03-29T01", "hourly:2026-03-29T03", "hourly:2026-03-29T04"]


def test_r19_a_moment_is_one_slot_however_it_is_spelled_even_in_a_skipped_hour(
    tmp_path: Path,
) -> None:
    """``at=`` names a moment: its slot is the same whatever time zone it is written in.
    Before, a wall time the clocks skip (02:30 in Rome on 29 March, a cron's scheduled time
    built from the local clock) written in the job's own zone kept its wall time, and was
    keyed ``T02`` (a slot the module says does not exist); the same moment written in UTC, or
    with another ZoneInfo object of that zone, was ``T03``: two keys, and the job ran twice in
    one hour."""
    rome = ZoneInfo("Europe/Rome")
    skipped = datetime(2026, 3, 29, 2, 30, tzinfo=rome)  # the moment 01:30 UTC, 03:30 CEST
    spellings = [
        skipped,
        skipped.astimezone(UTC),
        skipped.replace(tzinfo=ZoneInfo.no_cache("Europe/Rome")),
        datetime(2026, 3, 29, 3, 30, tzinfo=rome),
    ]
    assert {at.astimezone(UTC) for at in spellings} == {datetime(2026, 3, 29, 1, 30, tzinfo=UTC)}
    for every, key in [("hour", "hourly:2026-03-29T03"), ("minute", "hourly:2026-03-29T03:30")]:
        assert {slot("hourly", every, at=at, tz="Europe/Rome") for at in spellings} == {key}
    repeated = datetime(2026, 10, 25, 2, 30, fold=1, tzinfo=rome)  # the second pass, as is
    assert slot("hourly", "hour", at=repeated, tz=rome) == "hourly:2026-10-25T02+01:00"
    assert slot("hourly", "hour", at=repeated.replace(fold=0), tz=rome) == "hourly:2026-10-25T02"

    inbox = oncely.Inbox(oncely.SQLiteStore(tmp_path / "jobs.db"), consumer="jobs")
    runs: list[datetime] = []
    outcomes = [
        run_once(
            inbox, "hourly", partial(runs.append, at), every="hour", tz="Europe/Rome", at=at
        ).outcome
        for at in spellings
    ]
    assert runs == [skipped]  # one moment, one run
    assert outcomes == [oncely.Outcome.PROCESSED] + [oncely.Outcome.DUPLICATE] * 3
    inbox.close()


def test_r19_a_timedelta_period_is_counted_in_utc_and_refuses_another_time_zone(
    tmp_path: Path,
) -> None:
    at = datetime(2026, 11, 30, 23, 40, tzinfo=UTC)
    every = timedelta(minutes=15)
    assert slot("sync", every, at=at) == "sync:2026-11-30T23:30:00Z"
    assert slot("sync", every, at=at, tz="UTC") == "sync:2026-11-30T23:30:00Z"
    assert slot("sync", every, at=at, tz=UTC) == "sync:2026-11-30T23:30:00Z"
    for tz in ("Europe/Rome", ZoneInfo("Asia/Kolkata")):
        with pytest.raises(oncely.ConfigurationError, match=r"timedelta period .* UTC"):
            slot("sync", every, at=at, tz=tz)
    inbox = oncely.Inbox(oncely.SQLiteStore(tmp_path / "jobs.db"), consumer="jobs")
    with pytest.raises(oncely.ConfigurationError, match="tz="):
        run_once(inbox, "sync", lambda: None, every=every, tz="Europe/Rome", at=at)
    inbox.close()


@pytest.mark.parametrize(
    ("every", "longest"),
    [("week", "7d2h"), ("month", "31d2h"), (timedelta(days=8), "8d")],
)
def test_r13_r19_an_inbox_that_forgets_a_slot_before_it_ends_is_refused(
    tmp_path: Path, every: Every, longest: str
) -> None:
    """Before, the default retention (7 days) let a monthly job run on the 1st, 8th, 15th,
    22nd and 29th: each record expired mid-slot, and the next run found none."""
    inbox = oncely.Inbox(oncely.SQLiteStore(tmp_path / "jobs.db"), consumer="jobs")
    ran: list[int] = []
    with pytest.raises(oncely.ConfigurationError, match=f"a slot of up to {longest}"):
        run_once(inbox, "statement", lambda: ran.append(1), every=every)
    assert ran == []  # refused before the job ran
    inbox.close()


def test_r19_a_monthly_job_fired_daily_runs_once_a_month_with_a_month_of_retention(
    tmp_path: Path,
) -> None:
    """The trial's schedule, on a clock that moves: fired every day of December 2026, a
    monthly job on an inbox that keeps 32 days runs once, and once more in January."""
    clock = oncely.FakeClock(datetime(2026, 12, 1, 0, 30, tzinfo=UTC))
    store = oncely.SQLiteStore(tmp_path / "jobs.db", clock=clock)
    inbox = oncely.Inbox(
        store, consumer="jobs", retention=oncely.Retention(keep=timedelta(days=32))
    )
    ran: list[str] = []
    for day in range(32):
        at = datetime(2026, 12, 1, 0, 30, tzinfo=UTC) + timedelta(days=day)
        clock.set(at)
        run_once(inbox, "statement", lambda at=at: ran.append(f"{at:%m-%d}"), every="month",
                 at=at)  # fmt: skip
    assert ran == ["12-01", "01-01"]
    with pytest.raises(oncely.ConfigurationError):  # a shorter keep_failed is refused too
        short = oncely.Retention(keep=timedelta(days=32), keep_failed=timedelta(days=1))
        run_once(oncely.Inbox(store, consumer="jobs", retention=short), "x", list, every="month")
    inbox.close()


@pytest.mark.slow
async def test_r10_r19_a_job_whose_store_goes_silent_as_it_ends_is_told_within_a_timeout() -> None:
    """The store (PostgreSQL, reached through a relay) stops answering as the job returns: its
    open connections are cut and new ones are held without an answer, so each try to complete
    the slot waits the store's ``connect_timeout`` (2 s here). The completion is retried for
    about a second, not four tries: ``run_once`` says ``StoreUnavailable`` while the store is
    still away (before, it tried four times, about 9 s, and came back only once the store
    had). The slot stays claimed, so no other run repeats the job before its lease lapses."""
    require("PostgreSQL", POSTGRES_DSN, 5432)
    table = f"jobs_silent_{uuid.uuid4().hex[:10]}"
    away_for = 6.0  # seconds: more than one try's timeout (2 s) and a second, less than four
    try:
        async with Proxy(f"{POSTGRES_DSN}?table={table}&connect_timeout=2") as proxy:
            store = oncely.open(proxy.url)
            inbox = oncely.Inbox(store, consumer="jobs")
            loop = asyncio.get_running_loop()
            ran: list[str] = []

            async def go_silent() -> None:
                proxy.cut()
                proxy.silent = True
                await asyncio.sleep(away_for)
                proxy.silent = False

            def job() -> str:
                ran.append("report")
                # On the relay's own loop: its transports are not for another thread to abort.
                loop.call_soon_threadsafe(lambda: outage.append(loop.create_task(go_silent())))
                while not proxy.silent:
                    time.sleep(0.01)
                return "sent"

            outage: list[asyncio.Task[None]] = []
            at = datetime(2026, 12, 1, 9, tzinfo=UTC)
            try:
                with pytest.raises(oncely.StoreUnavailable):
                    await asyncio.to_thread(run_once, inbox, "report", job, every="day", at=at)
                assert proxy.silent, "the completion waited for the store to come back"
                await outage[0]
                again = await asyncio.to_thread(run_once, inbox, "report", job, every="day", at=at)
                assert again.outcome is oncely.Outcome.IN_FLIGHT  # held until its lease lapses
                assert ran == ["report"]
            finally:
                for task in outage:
                    task.cancel()
                inbox.close()
                store.close()
    finally:
        with psycopg.connect(POSTGRES_DSN, autocommit=True) as conn:
            conn.execute(f'DROP TABLE IF EXISTS "{table}", "{table}_meta"'.encode())


@pytest.mark.slow
async def test_r19_a_job_whose_store_has_gone_silent_fails_clearly_and_does_not_run() -> None:
    """The store (PostgreSQL, through a relay) has gone silent when the slot comes: its open
    connections held, nothing relayed either way, no reset (a dead route). ``run_once`` raises
    ``StoreUnavailable`` while the store is still silent, the claim's statement cut at the
    store's ``read_timeout`` (2 s here; before, it waited on the connection until the store
    came back: for ever behind a real dead route), and the job does not run; once the store is
    back, the slot runs once."""
    require("PostgreSQL", POSTGRES_DSN, 5432)
    table = f"jobs_hush_{uuid.uuid4().hex[:10]}"
    silent_for = 20.0  # seconds: far more than read_timeout
    try:
        async with Proxy(f"{POSTGRES_DSN}?table={table}&read_timeout=2") as proxy:
            store = oncely.open(proxy.url)
            inbox = oncely.Inbox(store, consumer="jobs")
            ran: list[str] = []

            def job() -> str:
                ran.append("report")
                return "sent"

            async def silent_a_while() -> None:
                proxy.silent = True
                await asyncio.sleep(silent_for)
                proxy.silent = False
                proxy.cut()  # what was swallowed is lost: the held connections go

            at = datetime(2026, 12, 1, 9, tzinfo=UTC)
            try:
                # A first slot opens the store's connections: the next one meets them silent.
                await asyncio.to_thread(run_once, inbox, "warm", job, every="day", at=at)
                outage = asyncio.create_task(silent_a_while())
                await asyncio.sleep(0)  # silent from here on
                with pytest.raises(oncely.StoreUnavailable, match="no answer"):
                    await asyncio.to_thread(run_once, inbox, "report", job, every="day", at=at)
                assert proxy.silent, "run_once waited for the store to come back"
                await outage
                for _ in range(50):  # the store's pool comes back on its own
                    try:
                        done = await asyncio.to_thread(
                            run_once, inbox, "report", job, every="day", at=at
                        )
                        break
                    except oncely.StoreUnavailable:
                        await asyncio.sleep(0.2)
                assert done.outcome is oncely.Outcome.PROCESSED
                assert ran == ["report", "report"]  # the warm slot's, then this one's once
            finally:
                inbox.close()
                store.close()
    finally:
        with psycopg.connect(POSTGRES_DSN, autocommit=True) as conn:
            conn.execute(f'DROP TABLE IF EXISTS "{table}", "{table}_meta"'.encode())


class _PytzLike(tzinfo):
    """A zone that behaves as pytz's do, without pytz: the zone object itself carries its
    first offset (local mean time, +00:50 for Rome), ``fromutc`` hands back a datetime whose
    tzinfo is *another* instance holding the offset of that moment, ``localize`` picks one by
    ``is_dst``, and no instance knows ``fold``. ``name=None``: a zone that says no name."""

    def __init__(self, name: str | None = "Europe/Rome", offset: timedelta | None = None) -> None:
        self._real = ZoneInfo("Europe/Rome")
        self._utcoffset = offset if offset is not None else timedelta(minutes=50)
        if name is not None:
            self.zone = name

    def _at(self, offset: timedelta) -> _PytzLike:
        twin = _PytzLike(getattr(self, "zone", None), offset)
        return twin

    def utcoffset(self, dt: datetime | None) -> timedelta | None:
        if dt is None:
            return None
        if dt.tzinfo is not self:
            return self.localize(dt.replace(tzinfo=None)).utcoffset()
        return self._utcoffset

    def dst(self, dt: datetime | None) -> timedelta | None:
        return None if dt is None else timedelta(0)

    def tzname(self, dt: datetime | None) -> str:
        return "LMT"

    def fromutc(self, dt: datetime) -> datetime:
        offset = dt.replace(tzinfo=UTC).astimezone(self._real).utcoffset()
        assert offset is not None
        return (dt + offset).replace(tzinfo=self._at(offset))  # fold stays 0

    def localize(self, naive: datetime, is_dst: bool = False) -> datetime:
        offset = naive.replace(tzinfo=self._real, fold=0 if is_dst else 1).utcoffset()
        assert offset is not None
        return naive.replace(tzinfo=self._at(offset))

    def normalize(self, dt: datetime) -> datetime:
        offset = dt.utcoffset()
        assert offset is not None
        return self.fromutc(dt.replace(tzinfo=None) - offset)


def test_r19_a_pytz_zone_keys_a_repeated_hour_as_its_name_does_or_is_refused() -> None:
    """pytz's zones have no ``fold``: the second pass of Rome's repeated 02:00-03:00 hour came
    back from them as ``fold=0``, keyed ``T02`` like the first, so an hourly job given
    ``tz=pytz.timezone("Europe/Rome")`` ran once in two real hours (the second was a
    ``duplicate``), where the zone's name runs it in both. A pytz zone is now read by its name
    through zoneinfo (the same keys as the name gives); one with no name it can be read by is
    refused, as is an ``at=`` built with ``tzinfo=`` a pytz zone (its local mean time, not
    the moment meant), naming the fix."""
    first, second = (
        datetime(2026, 10, 25, 0, 30, tzinfo=UTC),
        datetime(2026, 10, 25, 1, 30, tzinfo=UTC),
    )
    rome = _PytzLike()
    for every in ("minute", "hour", "day", "week", "month"):
        for at in (first, second, first - timedelta(days=40), second + timedelta(days=40)):
            assert slot("j", every, at=at, tz=rome) == slot("j", every, at=at, tz="Europe/Rome")
    assert slot("j", "hour", at=second, tz=rome) == "j:2026-10-25T02+01:00"
    localized = rome.localize(datetime(2026, 10, 25, 2, 30), is_dst=False)  # the second pass
    assert localized.astimezone(UTC) == second
    assert slot("j", "hour", at=localized, tz=rome) == "j:2026-10-25T02+01:00"
    assert slot("j", "hour", at=rome.normalize(localized), tz="Europe/Rome") == (
        "j:2026-10-25T02+01:00"
    )
    with pytest.raises(oncely.ConfigurationError, match=r"localize\(\).*zoneinfo"):
        slot("j", "hour", at=datetime(2026, 10, 25, 2, 30, tzinfo=rome), tz="Europe/Rome")
    for every in ("minute", "hour", "day"):
        with pytest.raises(oncely.ConfigurationError, match=r"fold.*zoneinfo\.ZoneInfo"):
            slot("j", every, at=second, tz=_PytzLike(name=None))
    with pytest.raises(oncely.ConfigurationError, match="zoneinfo"):
        slot("j", "hour", at=second, tz=_PytzLike(name="Mars/Olympus"))


def test_r19_a_pytz_zone_runs_an_hourly_job_in_both_passes_of_a_repeated_hour() -> None:
    require("PostgreSQL", POSTGRES_DSN, 5432)
    table = f"jobsfix_pytz_{uuid.uuid4().hex[:10]}"
    store = oncely.open(f"{POSTGRES_DSN}?table={table}")
    inbox = oncely.Inbox(store, consumer="jobs")
    first, second = (
        datetime(2026, 10, 25, 0, 30, tzinfo=UTC),
        datetime(2026, 10, 25, 1, 30, tzinfo=UTC),
    )
    runs: list[datetime] = []
    try:
        for at in (first, second, second):
            run_once(inbox, "hourly", partial(runs.append, at), every="hour", tz=_PytzLike(), at=at)
        assert runs == [first, second]  # both real hours ran, the repeat of the second did not
    finally:
        inbox.close()
        store.close()
        from tests.backends.postgres import drop_tables

        drop_tables(table)


class _DublinAsDateutil(tzinfo):
    """Europe/Dublin as dateutil 2.9 reads it (its negative DST): on 25 October 2026 the
    second 01:xx comes back as +01:00 (the first pass's offset), and 02:xx GMT as ``fold=1``
    although 02:xx is lived once. Each answer is dateutil's, pinned here."""

    def __init__(self) -> None:
        self._real = ZoneInfo("Europe/Dublin")

    def utcoffset(self, dt: datetime | None) -> timedelta | None:
        if dt is None:
            return None
        wall = dt.replace(tzinfo=None)
        if datetime(2026, 10, 25, 1) <= wall < datetime(2026, 10, 25, 3):
            late = wall.hour == 2
            return timedelta(0) if dt.fold and late else timedelta(hours=1)
        return dt.replace(tzinfo=self._real).utcoffset()

    def dst(self, dt: datetime | None) -> timedelta | None:
        return None

    def tzname(self, dt: datetime | None) -> str:
        return "Dublin"

    def fromutc(self, dt: datetime) -> datetime:
        real = dt.replace(tzinfo=UTC).astimezone(self._real)
        wall = real.replace(tzinfo=self)
        if datetime(2026, 10, 25, 1) <= real.replace(tzinfo=None) < datetime(2026, 10, 25, 3):
            return wall.replace(fold=1 if real.utcoffset() == timedelta(0) else 0)
        return wall


def test_r19_a_tzinfo_that_gives_a_moment_another_local_time_is_refused_not_trusted() -> None:
    """A tzinfo other than zoneinfo's is used as it answers; one whose answer does not map
    back to the moment (dateutil's Europe/Dublin in its repeated hour: the second 01:30 as
    +01:00, which is the first) keyed the second pass as the first (its run skipped as a
    ``duplicate``) and 02:30 GMT as a repeat that never was. It is refused, naming the fix."""
    dublin = _DublinAsDateutil()
    for hour in (0, 1, 2):
        at = datetime(2026, 10, 25, hour, 30, tzinfo=UTC)
        assert slot("j", "day", at=at, tz="Europe/Dublin") == "j:2026-10-25"
        if hour == 0:
            assert slot("j", "hour", at=at, tz=dublin) == "j:2026-10-25T01"
            continue
        with pytest.raises(oncely.ConfigurationError, match=r"Europe/Dublin.*zoneinfo\.ZoneInfo"):
            slot("j", "hour", at=at, tz=dublin)
    assert slot("j", "hour", at=datetime(2026, 10, 25, 1, 30, tzinfo=UTC), tz="Europe/Dublin") == (
        "j:2026-10-25T01+00:00"
    )
    dateutil = pytest.importorskip("dateutil.tz")
    real = dateutil.gettz("Europe/Dublin")
    for hour in range(-3, 6):
        at = datetime(2026, 10, 25, 1, 30, tzinfo=UTC) + timedelta(hours=hour)
        try:
            assert slot("j", "hour", at=at, tz=real) == slot("j", "hour", at=at, tz="Europe/Dublin")
        except oncely.ConfigurationError:
            assert hour in (0, 1)  # dateutil's wrong answers: refused, never a wrong key


_UTC_SPELLINGS = ["UTC", "Etc/UTC", "Etc/UCT", "UCT", "Etc/Universal", "Universal", "Etc/Zulu",
                  "Zulu", "Etc/GMT", "GMT", "Etc/GMT+0", "Etc/GMT-0", "Etc/GMT0", "GMT+0", "GMT-0",
                  "GMT0", "Etc/Greenwich", "Greenwich"]  # fmt: skip


def test_r19_every_spelling_of_utc_keys_a_slot_as_utc_does() -> None:
    """Before, a ``timedelta`` job refused ``tz="GMT"``, ``ZoneInfo("Etc/GMT")``, "Zulu",
    dateutil's ``tzutc()`` or pytz's ``utc`` as "a zone other than UTC", while ``"UTC"`` and
    ``datetime.UTC`` were taken: two spellings of one zone, one refused. None is now, and each
    keys every period as UTC does."""
    spellings: list[str | tzinfo] = [*_UTC_SPELLINGS, *(ZoneInfo(name) for name in _UTC_SPELLINGS)]
    spellings += [UTC, timezone(timedelta(0)), timezone(timedelta(0), "Z")]
    spellings += [_PytzLike(name="UTC", offset=timedelta(0)), _PytzLike(name="Etc/GMT")]
    try:
        from dateutil import tz as dateutil
    except ImportError:  # pragma: no cover - dateutil is not a dependency
        pass
    else:
        spellings += [
            dateutil.UTC,
            dateutil.tzutc(),
            dateutil.gettz("UTC"),
            dateutil.tzoffset(None, 0),
        ]
    at = datetime(2026, 10, 25, 1, 40, tzinfo=UTC)
    periods: list[Every] = ["minute", "hour", "day", "week", "month", timedelta(minutes=15)]
    for tz in spellings:
        for every in periods:
            assert slot("s", every, at=at, tz=tz) == slot("s", every, at=at), (tz, every)
    for tz in ("Europe/London", "Africa/Casablanca", ZoneInfo("Europe/Dublin"), _PytzLike()):
        with pytest.raises(oncely.ConfigurationError, match=r"timedelta period .* UTC"):
            slot("s", timedelta(minutes=15), at=at, tz=tz)


def test_r19_each_slot_kind_across_two_hour_and_half_hour_clock_changes() -> None:
    """Antarctica/Troll moves its clocks by two hours (+00 to +02 in March, back in October:
    days of 22 and 26 hours), Australia/Lord_Howe by half an hour, Europe/Dublin's daylight
    saving time is negative (its winter is the "saving" one), Asia/Magadan went back two
    hours in 2014. Every real minute and hour is one slot (never two moments of different
    hours in one, so no run is skipped), and a day is one slot however long it is."""
    cases = [
        ("Antarctica/Troll", datetime(2026, 3, 29), datetime(2026, 10, 25), 22, 26),
        ("Australia/Lord_Howe", datetime(2026, 10, 4), datetime(2026, 4, 5), 23.5, 24.5),
        ("Europe/Dublin", datetime(2026, 3, 29), datetime(2026, 10, 25), 23, 25),
        ("Asia/Magadan", None, datetime(2014, 10, 26), None, 26),
    ]
    for tz, short, long, short_hours, long_hours in cases:
        for day, hours in ((short, short_hours), (long, long_hours)):
            if day is None:
                continue
            start = day.replace(tzinfo=UTC) - timedelta(hours=14)
            moments = [start + timedelta(minutes=n) for n in range(52 * 60)]
            minutes = [slot("m", "minute", at=at, tz=tz) for at in moments]
            assert len(set(minutes)) == len(minutes), tz
            hourly = [slot("h", "hour", at=at, tz=tz) for at in moments]
            for a, b, ka, kb in zip(moments, moments[1:], hourly, hourly[1:], strict=False):
                la, lb = a.astimezone(ZoneInfo(tz)), b.astimezone(ZoneInfo(tz))
                same_hour = (f"{la:%Y%m%d%H}", la.utcoffset()) == (f"{lb:%Y%m%d%H}", lb.utcoffset())
                assert (ka == kb) == same_hour, (tz, a, ka, kb)
            daily = [slot("d", "day", at=at, tz=tz) for at in moments]
            assert daily.count(f"d:{day:%Y-%m-%d}") == hours * 60, tz  # one slot, all its hours
            for every in ("week", "month"):
                keys = [slot("w", every, at=at, tz=tz) for at in moments]
                assert len(set(keys)) <= 2, (tz, every)


@pytest.mark.parametrize("store", ["sqlite", "postgres"])
def test_r13_r19_a_26_hour_day_keeps_its_run_to_the_end_and_a_25_hour_retention_is_refused(
    tmp_path: Path, store: str
) -> None:
    """The longest day is 26 hours, not 25: Antarctica/Troll's clocks go back two hours on
    25 October 2026 (00:00 +02 is 22:00 UTC the day before; 24:00 +00 is midnight UTC). Before,
    an inbox keeping 25 hours was taken for a daily job, and its first run's record expired an
    hour before the day ended: a run in that last hour ran the job again. It is refused now (a
    day, week or month lasts up to 2 hours more than its days), and a 26-hour one runs once."""
    clock = oncely.FakeClock(datetime(2026, 10, 24, 22, 0, tzinfo=UTC))
    if store == "postgres":
        require("PostgreSQL", POSTGRES_DSN, 5432)
        table = f"jobsfix_troll_{uuid.uuid4().hex[:10]}"
        opened = oncely.open(f"{POSTGRES_DSN}?table={table}", clock=clock)
    else:
        opened = oncely.SQLiteStore(tmp_path / "jobs.db", clock=clock)
    try:
        short = oncely.Inbox(
            opened, consumer="short", retention=oncely.Retention(keep=timedelta(hours=25))
        )
        ran: list[datetime] = []
        with pytest.raises(oncely.ConfigurationError, match="a slot of up to 1d2h"):
            run_once(
                short,
                "report",
                partial(ran.append, datetime(2026, 10, 24, 22, 0, tzinfo=UTC)),
                every="day",
                tz="Antarctica/Troll",
            )
        assert ran == []
        for every, longest in (("week", "7d2h"), ("month", "31d2h")):
            week = oncely.Inbox(
                opened, consumer="w", retention=oncely.Retention(keep=timedelta(days=7, hours=1))
            )
            with pytest.raises(oncely.ConfigurationError, match=f"a slot of up to {longest}"):
                run_once(week, "report", list, every=every, tz="Antarctica/Troll")  # type: ignore[arg-type]
        inbox = oncely.Inbox(
            opened, consumer="jobs", retention=oncely.Retention(keep=timedelta(hours=26))
        )
        for minutes in range(0, 26 * 60, 30):
            at = datetime(2026, 10, 24, 22, 0, tzinfo=UTC) + timedelta(minutes=minutes)
            clock.set(at)
            key = run_once(
                inbox, "report", partial(ran.append, at), every="day", tz="Antarctica/Troll", at=at
            ).key
            assert key == "report:2026-10-25"
        assert ran == [datetime(2026, 10, 24, 22, 0, tzinfo=UTC)]  # once in 26 hours
    finally:
        opened.close()
        if store == "postgres":
            from tests.backends.postgres import drop_tables

            drop_tables(table)


def test_r19_a_working_dateutil_zone_keys_a_moment_given_in_its_repeated_hour() -> None:
    """dateutil's Europe/Rome handles ``fold``: ``at=`` given in that zone within the hour the
    clocks repeat was refused, as the check compared the moment with its UTC form (two aware
    datetimes in different zones never compare equal in a repeated hour, PEP 495)."""
    dateutil = pytest.importorskip("dateutil.tz")
    rome = dateutil.gettz("Europe/Rome")
    first = datetime(2026, 10, 25, 2, 30, tzinfo=rome, fold=0)
    second = datetime(2026, 10, 25, 2, 30, tzinfo=rome, fold=1)
    assert slot("j", "day", at=first, tz=rome) == slot("j", "day", at=second, tz=rome)
    assert slot("j", "day", at=first, tz=rome) == "j:2026-10-25"
    zoned = ZoneInfo("Europe/Rome")
    for fold in (0, 1):
        at = datetime(2026, 10, 25, 2, 30, tzinfo=rome, fold=fold)
        same = datetime(2026, 10, 25, 2, 30, tzinfo=zoned, fold=fold)
        assert slot("j", "hour", at=at, tz=rome) == slot("j", "hour", at=same, tz=zoned)
    assert slot("j", "hour", at=first, tz=rome) != slot("j", "hour", at=second, tz=rome)

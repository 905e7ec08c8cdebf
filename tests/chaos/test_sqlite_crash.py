"""SIGKILL at any point, restart, and every effect still lands exactly once (R7, R10).

A fleet of consumer processes drains a broker (oncely.testing.FileBroker, a peek-lock queue in
its own SQLite file, every message published twice as a retrying producer would). Workers are
SIGKILLed by the test at random moments and by themselves at chosen points: right after the
claim, right after the effect is written but before the marker completes (or commits), and right
after completion but before the acknowledgement. Killed workers are restarted until the broker
is drained.

Run with ``pytest tests/chaos -s`` to see the counts; set ONCELY_CHAOS_SEED to replay a run's
schedule (the processes' interleaving is the OS's, so a replay is close, not identical).
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

import oncely
from tests.chaos.crash_workers import CLAIMED, COMPLETED, EFFECT_WRITTEN, CrashJob, fill_broker
from tests.chaos.harness import FleetReport, Processes, records, run_fleet, stored_worker
from tests.chaos.workers import create_effects, effect_counts

pytestmark = pytest.mark.slow

KEYS = 200  # logical messages; each is published twice
LEASE_MS = 400  # short, so a dead worker's claim is stale quickly
RENEW_MS = 100  # the heartbeat renews four times per lease: a live worker never looks dead
VISIBILITY_S = 0.5  # the broker's lock: a dead worker's message is redelivered after this

# Three self-kills at each point (the n-th time the worker reaches it): the first incarnations
# take the first plans, restarts take the rest.
PLANS = [
    (CLAIMED, 2),
    (EFFECT_WRITTEN, 3),
    (COMPLETED, 2),
    (EFFECT_WRITTEN, 1),
    (CLAIMED, 5),
    (COMPLETED, 4),
    (COMPLETED, 1),
    (CLAIMED, 1),
    (EFFECT_WRITTEN, 6),
]
PARENT_KILLS = 10


def _setup(tmp_path: Path, *, mode: str, keys: list[str], copies: int) -> tuple[str, str, str]:
    db = str(tmp_path / "oncely.db")
    broker = str(tmp_path / "broker.db")
    effects = db if mode == "transactional" else str(tmp_path / "external.db")
    store = oncely.SQLiteStore(db)
    store.migrate()
    store.close()
    create_effects(effects)
    fill_broker(broker, keys, copies=copies)
    (tmp_path / "logs").mkdir()
    return db, broker, effects


def _job(
    db: str, broker: str, effects: str, parent_pid: int, *, mode: str, on_stale: str
) -> CrashJob:
    return CrashJob(
        db=db,
        broker=broker,
        effects_db=effects,
        mode=mode,
        on_stale=on_stale,
        lease_ms=LEASE_MS,
        renew_ms=RENEW_MS,
        visibility_s=VISIBILITY_S,
        worker="",
        log="",
        parent_pid=parent_pid,
    )


def _effect_workers(path: str) -> dict[str, list[str]]:
    conn = sqlite3.connect(path)
    try:
        found: dict[str, list[str]] = {}
        for key, worker in conn.execute("SELECT key, worker FROM effects ORDER BY rowid"):
            found.setdefault(key, []).append(worker)
        return found
    finally:
        conn.close()


def _integrity(path: str) -> str:
    conn = sqlite3.connect(path)
    try:
        return str(conn.execute("PRAGMA integrity_check").fetchone()[0])
    finally:
        conn.close()


def _assert_exactly_once(keys: list[str], effects: str, db: str, report: FleetReport) -> None:
    summary = report.summary()
    for path in {db, effects}:
        # Dozens of SIGKILLs mid-transaction, mid-commit and mid-checkpoint: still a sound file.
        assert _integrity(path) == "ok", f"{path} is damaged; {summary}"
    counts = effect_counts(effects)
    lost = [k for k in keys if counts[k] == 0]
    doubled = {k: n for k, n in counts.items() if n > 1}
    assert not lost, f"effects lost for {lost}; {summary}"
    assert not doubled, f"effects applied more than once: {doubled}; {summary}"
    assert set(counts) == set(keys), summary
    held = records(db)
    not_done = {
        k: str(r.status) for k, r in held.items() if r.status is not oncely.Status.COMPLETED
    }
    assert set(held) == set(keys), f"records missing for {set(keys) - set(held)}; {summary}"
    assert not not_done, f"records not completed: {not_done}; {summary}"
    for point in (CLAIMED, EFFECT_WRITTEN, COMPLETED):
        assert report.kills_at(point), f"no worker was killed at {point}; {summary}"
    assert report.outcomes["duplicate"] > 0, summary


@pytest.mark.timeout(150)
def test_r7_sigkill_transactional_mode_applies_every_effect_exactly_once(
    tmp_path: Path, procs: Processes, parent_pid: int, chaos_seed: int
) -> None:
    """Transactional mode (R7): a kill before the commit loses marker and effect together (the
    redelivery processes the message afresh); a kill after the commit leaves both (the
    redelivery is a duplicate). No lease is involved, so nothing is ever stale."""
    keys = [f"order-{i:04d}" for i in range(KEYS)]
    db, broker, effects = _setup(tmp_path, mode="transactional", keys=keys, copies=2)
    report = run_fleet(
        procs,
        _job(db, broker, effects, parent_pid, mode="transactional", on_stale="retry"),
        tmp_path / "logs",
        slots=3,
        plans=PLANS,
        parent_kills=PARENT_KILLS,
        seed=chaos_seed,
    )
    print(f"\n[R7 transactional SIGKILL] {report.summary()}")
    _assert_exactly_once(keys, effects, db, report)
    summary = report.summary()
    held = records(db)
    applied_by = _effect_workers(effects)
    for kill in report.kills_at(CLAIMED) + report.kills_at(EFFECT_WRITTEN):
        # The killed transaction's writes vanished with it: someone else applied the effect.
        assert kill.worker not in applied_by[kill.key], f"{kill}: an uncommitted write survived"
    for kill in report.kills_at(COMPLETED):
        # Committed, then killed before the ack: the redelivery found the marker.
        assert applied_by[kill.key] == [kill.worker], f"{kill}: {applied_by[kill.key]}; {summary}"
        assert stored_worker(held[kill.key]) == kill.worker, summary
    attempts = {k: r.attempt for k, r in held.items() if r.attempt != 1}
    assert not attempts, f"a transactional record was taken over: {attempts}; {summary}"
    assert report.outcomes["stale_reclaimed"] == 0, summary


@pytest.mark.timeout(150)
def test_r10_sigkill_two_phase_mode_with_reconciler_applies_every_effect_exactly_once(
    tmp_path: Path, procs: Processes, parent_pid: int, chaos_seed: int
) -> None:
    """Two-phase mode (R10) with an external effect and a reconciler that looks it up: a claim
    left by a dead worker lapses after the short lease; the reconciler completes it when the
    effect is there (no second call) and retries it when it is not."""
    keys = [f"order-{i:04d}" for i in range(KEYS)]
    db, broker, effects = _setup(tmp_path, mode="two_phase", keys=keys, copies=2)
    report = run_fleet(
        procs,
        _job(db, broker, effects, parent_pid, mode="two_phase", on_stale="reconcile"),
        tmp_path / "logs",
        slots=3,
        plans=PLANS,
        parent_kills=PARENT_KILLS,
        seed=chaos_seed,
    )
    held = records(db)
    reconciled = sorted(k for k, r in held.items() if (r.error or "").startswith("reconciled"))
    retaken = sorted(k for k, r in held.items() if r.attempt > 1)
    print(
        f"\n[R10 two-phase SIGKILL + reconciler] {report.summary()} "
        f"records: reconciled={len(reconciled)} taken_over={len(retaken)}"
    )
    _assert_exactly_once(keys, effects, db, report)
    summary = f"{report.summary()} reconciled={reconciled} taken_over={retaken}"
    applied_by = _effect_workers(effects)
    for kill in report.kills_at(EFFECT_WRITTEN):
        # The effect happened, the completion did not: the reconciler must have found it.
        assert kill.key in reconciled, f"{kill} was not reconciled; {summary}"
        assert applied_by[kill.key] == [kill.worker], f"{kill}: {applied_by[kill.key]}; {summary}"
        assert stored_worker(held[kill.key]) == kill.worker, summary
    for kill in report.kills_at(CLAIMED):
        # Claimed, no effect: the reconciler said retry and another attempt did the work.
        assert held[kill.key].attempt >= 2, f"{kill}: {held[kill.key]}; {summary}"
        assert kill.worker not in applied_by[kill.key], summary
    for kill in report.kills_at(COMPLETED):
        assert applied_by[kill.key] == [kill.worker], f"{kill}: {applied_by[kill.key]}; {summary}"
        assert stored_worker(held[kill.key]) == kill.worker, summary


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    ("on_stale", "applied"),
    [("retry", 2), ("reconcile", 1)],
    ids=["retry-doubles-the-effect", "reconciler-keeps-it-once"],
)
def test_r10_limit_kill_after_external_effect_needs_a_reconciler(
    tmp_path: Path,
    procs: Processes,
    parent_pid: int,
    chaos_seed: int,
    on_stale: str,
    applied: int,
) -> None:
    """The documented R10 limit, shown with a real SIGKILL: a worker that dies after the
    external effect but before completing leaves only an in-progress claim. on_stale="retry"
    cannot know the effect happened and runs the handler again, so the effect is applied twice;
    a reconciler that asks the external system completes the claim instead. This proves the
    docs' claim: "retry" is right only for handlers safe to repeat (R11); it is not a bug."""
    keys = ["payment-1", "payment-2", "payment-3"]
    db, broker, effects = _setup(tmp_path, mode="two_phase", keys=keys, copies=1)
    report = run_fleet(
        procs,
        _job(db, broker, effects, parent_pid, mode="two_phase", on_stale=on_stale),
        tmp_path / "logs",
        slots=1,
        plans=[(EFFECT_WRITTEN, 1)],
        parent_kills=0,
        seed=chaos_seed,
    )
    print(f"\n[R10 limit, on_stale={on_stale}] {report.summary()}")
    summary = report.summary()
    [kill] = report.self_kills
    assert kill.point == EFFECT_WRITTEN, summary
    counts = effect_counts(effects)
    assert counts[kill.key] == applied, f"{kill.key} applied {counts[kill.key]} times; {summary}"
    others = {k: counts[k] for k in keys if k != kill.key}
    assert others == dict.fromkeys(others, 1), f"{others}; {summary}"
    record = records(db)[kill.key]
    assert record.status is oncely.Status.COMPLETED, summary
    if on_stale == "retry":
        assert record.attempt == 2, f"{record}; {summary}"
        assert report.outcomes["stale_reclaimed"] == 1, summary
        assert stored_worker(record) != kill.worker, summary
    else:
        assert record.attempt == 1, f"{record}; {summary}"
        assert (record.error or "").startswith("reconciled"), f"{record}; {summary}"
        assert stored_worker(record) == kill.worker, summary
        assert report.reconciler == {"completed": 1}, summary

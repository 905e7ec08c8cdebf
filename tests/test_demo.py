"""The demo engine: a SQLite at-least-once broker, real worker processes, real SIGKILLs.

One small run (module fixture) feeds the same seeded workload to the three consumers; the tests
read its report and, where the report is not enough, the databases it kept.
"""

from __future__ import annotations

import json
import multiprocessing
import signal
import sqlite3
import tempfile
from dataclasses import replace
from pathlib import Path

import pytest
from rich.console import Console

from oncely import ConfigurationError
from oncely.demo import CONSUMERS, DemoOptions, DemoReport, run_demo
from oncely.demo.__main__ import main
from oncely.demo.workload import FaultCounts, Workload

pytestmark = pytest.mark.slow

MESSAGES = 100
SEED = 11
ONCELY = ("oncely-transactional", "oncely-two-phase")
DOCUMENTED = {
    "logical_messages",
    "deliveries",
    "duplicates_delivered",
    "effects",
    "extra_effects",
    "key_conflicts_dead_lettered",
    "lost",
}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("demo")


@pytest.fixture(scope="module")
def report(workdir: Path) -> DemoReport:
    return run_demo(DemoOptions(messages=MESSAGES, workers=3, seed=SEED, workdir=workdir))


@pytest.fixture(scope="module")
def faults() -> FaultCounts:
    return FaultCounts.for_messages(MESSAGES)


def broker_db(report: DemoReport, consumer: str) -> sqlite3.Connection:
    assert report.workdir is not None
    return sqlite3.connect(Path(report.workdir) / f"{consumer}-{report.run_id}" / "broker.db")


def test_r1_naive_consumer_applies_every_duplicate(report: DemoReport) -> None:
    naive = report.consumers["naive"]
    assert naive.extra_effects > 0
    # No dedup at all: every delivery wrote one payment (the killed ones before dying).
    assert naive.effects == naive.deliveries
    assert naive.lost == 0
    assert naive.key_conflicts_dead_lettered == 0


@pytest.mark.parametrize("consumer", ONCELY)
def test_r1_r7_r10_oncely_consumers_apply_each_payment_once(
    report: DemoReport, consumer: str
) -> None:
    r = report.consumers[consumer]
    assert r.extra_effects == 0
    assert r.lost == 0
    assert r.unsettled == 0
    assert r.effects == r.logical_messages
    assert r.duplicates_delivered > 0
    assert r.balances_consistent
    assert r.worker_crashes == 0


@pytest.mark.parametrize("consumer", ONCELY)
def test_r20_reused_keys_are_dead_lettered_never_acked(
    report: DemoReport, consumer: str, faults: FaultCounts
) -> None:
    r = report.consumers[consumer]
    assert r.key_conflicts_dead_lettered == faults.reused_keys
    with broker_db(report, consumer) as db:
        acked_conflicts = db.execute(
            "SELECT count(*) FROM deliveries WHERE outcome = 'key_conflict' AND action != "
            "'dead_letter'"
        ).fetchone()[0]
        reasons = [row[0] for row in db.execute("SELECT reason FROM copies WHERE state = 'dead'")]
    assert acked_conflicts == 0
    assert len(reasons) == faults.reused_keys
    assert all("key reused for different content" in reason for reason in reasons)


def test_r10_two_phase_reconciler_resolves_the_killed_workers_claims(
    report: DemoReport, faults: FaultCounts
) -> None:
    two_phase = report.consumers["oncely-two-phase"]
    # Each kill left an in-progress claim after the provider charged; the reconciler found the
    # payment by its idempotency key and completed the record instead of charging again.
    assert two_phase.reconciled == faults.kills
    assert two_phase.injected.workers_killed == faults.kills


@pytest.mark.parametrize("consumer", CONSUMERS)
def test_r1_every_duplicate_source_happened(
    report: DemoReport, consumer: str, faults: FaultCounts
) -> None:
    injected = report.consumers[consumer].injected
    assert injected.producer_retries_delivered == faults.producer_retries
    assert injected.acks_lost == faults.lost_acks
    assert injected.workers_killed == faults.kills
    assert injected.reused_keys_delivered == faults.reused_keys
    assert injected.expired_locks >= 1
    assert injected.twin_deliveries >= 1


@pytest.mark.parametrize("consumer", CONSUMERS)
def test_r1_kills_are_real_sigkills_and_redelivered(report: DemoReport, consumer: str) -> None:
    with broker_db(report, consumer) as db:
        kills = db.execute("SELECT seq, delivery_id, exitcode FROM kills").fetchall()
        assert kills
        for seq, delivery_id, exitcode in kills:
            assert exitcode == -signal.SIGKILL
            settled = db.execute(
                "SELECT settled_ms FROM deliveries WHERE id = ?", (delivery_id,)
            ).fetchone()[0]
            later = db.execute(
                "SELECT count(*) FROM deliveries WHERE seq = ? AND id > ?", (seq, delivery_id)
            ).fetchone()[0]
            assert settled is None  # killed before its ack
            assert later >= 1  # and the broker delivered the copy again


@pytest.mark.parametrize("consumer", CONSUMERS)
def test_r8_twin_deliveries_overlap(report: DemoReport, consumer: str) -> None:
    with broker_db(report, consumer) as db:
        pairs = db.execute(
            """SELECT first.settled_ms, twin.delivered_ms, first.worker, twin.worker
            FROM deliveries AS twin JOIN deliveries AS first
              ON first.seq = twin.seq AND first.cause = 'first'
            WHERE twin.cause = 'twin'"""
        ).fetchall()
    assert pairs
    for first_settled, twin_delivered, first_worker, twin_worker in pairs:
        assert first_worker != twin_worker
        assert first_settled is None or first_settled >= twin_delivered


def test_r10_provider_ledger_has_no_unique_key(report: DemoReport) -> None:
    # Only oncely may stand between a duplicate and a double charge: no database arbiter.
    assert report.workdir is not None
    path = Path(report.workdir) / f"oncely-two-phase-{report.run_id}" / "provider.db"
    with sqlite3.connect(path) as db:
        table = f"demo_{report.run_id}_ledger"
        indexes = db.execute(f"PRAGMA index_list({table})").fetchall()
    assert indexes
    assert all(unique == 0 for _, _, unique, *_ in indexes)


def test_report_dict_has_the_documented_keys(report: DemoReport) -> None:
    data = report.to_dict()
    assert set(data) == set(CONSUMERS)
    for consumer, values in data.items():
        assert set(values) >= DOCUMENTED, consumer
        assert values["logical_messages"] == MESSAGES
    json.dumps(data)  # plain data all the way down


def test_report_renders_a_table(report: DemoReport) -> None:
    console = Console(record=True, width=160)
    report.render(console)
    text = console.export_text()
    for consumer in CONSUMERS:
        assert consumer in text
    assert "extra effects" in text
    assert "each payment applied once" in text


def test_workload_faults_are_seeded() -> None:
    first = Workload.build(messages=200, seed=3)
    assert first == Workload.build(messages=200, seed=3)
    assert first != Workload.build(messages=200, seed=4)
    origins = [c.origin for c in first.copies]
    assert origins.count("producer_retry") == first.faults.producer_retries
    assert origins.count("reused_key") == first.faults.reused_keys
    assert sum(c.fault == "kill" for c in first.copies) == first.faults.kills


def test_memory_store_is_refused() -> None:
    with pytest.raises(ConfigurationError, match="separate processes"):
        DemoOptions(store_url="memory://")
    with pytest.raises(ConfigurationError, match="in-memory SQLite"):
        DemoOptions(store_url="sqlite:///:memory:")


def test_r5_sqlite_store_url_reruns_do_not_collide(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # The temporary work directory goes under tmp_path so the test can see it removed.
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    url = f"sqlite:///{tmp_path / 'store.db'}"
    for _ in range(2):
        assert main(["--messages", "12", "--workers", "3", "--store", url, "--json"]) == 0
        data = json.loads(capsys.readouterr().out)
        assert set(data) == set(CONSUMERS)
        for consumer in ONCELY:
            assert data[consumer]["extra_effects"] == 0
            assert data[consumer]["lost"] == 0
            assert data[consumer]["effects"] == 12
    with sqlite3.connect(tmp_path / "store.db") as db:
        consumers = db.execute("SELECT DISTINCT consumer FROM oncely_inbox").fetchall()
    assert len(consumers) == 4  # two runs x two oncely consumers, each under its own name
    assert not list(tmp_path.glob("oncely-demo-*"))  # the temporary directory is gone
    assert not multiprocessing.active_children()


def test_no_child_process_outlives_the_demo(report: DemoReport) -> None:
    assert not multiprocessing.active_children()


@pytest.mark.parametrize("consumer", CONSUMERS)
def test_r1_the_command_fails_when_an_oncely_consumer_applies_a_payment_twice(
    report: DemoReport,
    consumer: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``python -m oncely.demo`` fails as ``oncely demo`` does when an oncely consumer shows an
    extra effect; it used to look only at lost and unsettled messages. The naive consumer's
    extra effects are what the demo shows, never a failure."""
    monkeypatch.setattr("oncely.demo.__main__.run_demo", lambda options: report)
    assert main(["--json"]) == 0
    consumers = dict(report.consumers)
    consumers[consumer] = replace(consumers[consumer], extra_effects=1)
    doubled = DemoReport(report.options, report.run_id, consumers)
    monkeypatch.setattr("oncely.demo.__main__.run_demo", lambda options: doubled)
    assert main(["--json"]) == (0 if consumer == "naive" else 1)
    capsys.readouterr()

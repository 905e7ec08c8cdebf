"""Concurrent duplicates across real processes: the store is the single arbiter (R8, R9).

Four processes, two on the sync API and two on the async API, race over the same 2,000 keys,
each in its own random order, released together from a barrier so their work really
overlaps. The effect is a row in an ``effects`` table with no unique constraint, so an effect
applied twice would show up as two rows instead of being absorbed by the database.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

import oncely
from tests.chaos.harness import Processes
from tests.chaos.race_workers import RaceJob, race_key, race_worker
from tests.chaos.workers import create_effects, effect_counts

pytestmark = pytest.mark.slow

KEYS = 2000
APIS = ("sync", "async", "sync", "async")


def _race(
    tmp_path: Path, procs: Processes, parent_pid: int, seed: int, *, two_phase: bool
) -> list[Any]:
    db = str(tmp_path / "oncely.db")
    effects = str(tmp_path / "external.db") if two_phase else db
    store = oncely.SQLiteStore(db)
    store.migrate()
    store.close()
    create_effects(effects)
    start_line = procs.ctx.Barrier(len(APIS))
    jobs = [
        RaceJob(
            db=db,
            effects_db=effects if two_phase else None,
            keys=KEYS,
            seed=seed + n,
            worker=f"racer{n}-{api}",
            api=api,
            out=str(tmp_path / f"racer{n}.json"),
            parent_pid=parent_pid,
        )
        for n, api in enumerate(APIS)
    ]
    started = [procs.start(race_worker, job, start_line, name=job.worker) for job in jobs]
    deadline = time.monotonic() + 120
    for process in started:
        process.join(timeout=max(0.0, deadline - time.monotonic()))
    codes = {job.worker: p.exitcode for job, p in zip(jobs, started, strict=True)}
    left = procs.reap()
    assert not left, f"racers still running after 120s: {left}"
    assert all(code == 0 for code in codes.values()), f"exit codes {codes}"
    tallies = [json.loads(Path(job.out).read_text()) for job in jobs]
    for tally in tallies:
        tally["seed"] = seed
    return tallies


def _check(tallies: list[Any], effects: str) -> tuple[Counter[str], str]:
    """The R8 properties shared by both modes; returns the summed outcome counts."""
    deliveries: Counter[str] = Counter()
    for tally in tallies:
        deliveries.update(tally["deliveries"])
    winners: dict[str, str] = {}
    doubled_claims = []
    for tally in tallies:
        for key in tally["processed"]:
            if key in winners:
                doubled_claims.append((key, winners[key], tally["worker"]))
            winners[key] = tally["worker"]
    summary = f"seed={tallies[0]['seed']} deliveries={dict(deliveries)} " + " ".join(
        f"{t['worker']}:{dict(t['deliveries'])}/rounds={t['redelivery_rounds']}" for t in tallies
    )
    print(f"\n[R8 race] {summary}")
    errors = [e for t in tallies for e in t["errors"]]
    unexpected = [u for t in tallies for u in t["unexpected"]]
    assert not errors, f"{errors[:5]}; {summary}"
    assert not unexpected, f"{unexpected[:5]}; {summary}"
    assert not doubled_claims, f"keys processed twice: {doubled_claims[:5]}; {summary}"

    counts = effect_counts(effects)
    keys = {race_key(i) for i in range(KEYS)}
    assert set(counts) == keys, f"lost effects: {sorted(keys - set(counts))[:5]}; {summary}"
    doubled = {k: n for k, n in counts.items() if n != 1}
    assert not doubled, f"effects applied more than once: {dict(list(doubled.items())[:5])}"

    # Every racer settled every key, and exactly one of the four processed it (R8).
    for tally in tallies:
        settled = set(tally["processed"]) | set(tally["duplicate_of"])
        assert settled == keys, f"{tally['worker']} left {len(keys - settled)} keys; {summary}"
        assert not set(tally["processed"]) & set(tally["duplicate_of"]), summary
    assert deliveries["processed"] == KEYS, summary
    assert sum(len(t["duplicate_of"]) for t in tallies) == KEYS * (len(tallies) - 1), summary
    # A duplicate returns the result stored by the delivery that processed the key (R1).
    wrong = [
        (key, said, winners[key])
        for t in tallies
        for key, said in t["duplicate_of"].items()
        if said != winners[key]
    ]
    assert not wrong, f"duplicates returned another result than the winner's: {wrong[:5]}"
    # The racers really overlapped: each one started before every other one finished, and
    # each one won some keys (a racer starved until the others were done wins none).
    assert max(t["started"] for t in tallies) < min(t["ended"] for t in tallies), summary
    assert all(t["processed"] for t in tallies), f"a racer won no key; {summary}"
    return deliveries, summary


@pytest.mark.timeout(180)
def test_r8_transactional_mode_four_processes_race_one_effect_per_key(
    tmp_path: Path, procs: Processes, parent_pid: int, chaos_seed: int
) -> None:
    """Transactional mode (R7, R8): marker and effect commit together under SQLite's single
    writer, so a copy that loses the race always finds a completed marker: every outcome is
    processed or duplicate, never in_flight (the marker is never in progress in this mode)."""
    tallies = _race(tmp_path, procs, parent_pid, chaos_seed, two_phase=False)
    deliveries, summary = _check(tallies, str(tmp_path / "oncely.db"))
    assert set(deliveries) == {"processed", "duplicate"}, summary
    assert deliveries["duplicate"] == KEYS * 3, summary


@pytest.mark.timeout(180)
def test_r8_two_phase_mode_four_processes_race_one_effect_per_key(
    tmp_path: Path, procs: Processes, parent_pid: int, chaos_seed: int
) -> None:
    """Two-phase mode (R8, R10): the effect goes to a separate SQLite file the marker cannot
    share a transaction with. A copy arriving while another process holds the claim is
    in_flight (requeue later, never ack); the racer redelivers it later until it is
    processed or duplicate. Nothing lost, nothing doubled, and no claim ever went stale."""
    tallies = _race(tmp_path, procs, parent_pid, chaos_seed, two_phase=True)
    deliveries, summary = _check(tallies, str(tmp_path / "external.db"))
    assert set(deliveries) <= {"processed", "duplicate", "in_flight"}, summary

"""A job runner process for ``tests/test_jobs.py``: ``python -m tests.jobs_runner DB EFFECTS
SLEEP LEASE START_AT WHO`` runs the job ``report`` for the day of 2026-12-01 (Europe/Rome)
through :func:`oncely.jobs.run_once` on the SQLite file DB, starting at the epoch time
START_AT; the job notes ``WHO started`` in EFFECTS, sleeps SLEEP seconds, notes ``WHO done``.
It prints the outcome."""

from __future__ import annotations

import sys
import time
from datetime import UTC, datetime, timedelta

import oncely
from oncely.jobs import run_once


def main() -> None:
    db, effects, sleep, lease, start_at, who = sys.argv[1:]
    inbox = oncely.Inbox(
        oncely.SQLiteStore(db),
        consumer="jobs",
        lease=oncely.Lease(duration=timedelta(seconds=float(lease))),
    )

    def report() -> str:
        with open(effects, "a") as out:
            out.write(f"{who} started\n")
        time.sleep(float(sleep))
        with open(effects, "a") as out:
            out.write(f"{who} done\n")
        return f"report by {who}"

    time.sleep(max(0.0, float(start_at) - time.time()))
    at = datetime(2026, 12, 1, 9, 0, tzinfo=UTC)
    handled = run_once(inbox, "report", report, every="day", tz="Europe/Rome", at=at)
    print(handled.outcome.value, handled.value, flush=True)


if __name__ == "__main__":
    main()

"""A zombie worker with real processes: fencing keeps a frozen worker's late result out (R10).

Process A claims a key in two-phase mode with a short lease and no heartbeat, then is frozen
with SIGSTOP (a stop-the-world pause, a suspended VM) while its handler runs. Its lease lapses;
process B, on a redelivery, takes the key over and completes it. A is resumed and tries to
complete: the completion is fenced by A's token, so A's outcome is ``in_flight`` ("lease
lost"), the store keeps B's result, and every later delivery is a duplicate with B's result.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

import oncely
from tests.chaos.harness import Processes
from tests.chaos.workers import CONSUMER
from tests.chaos.zombie_workers import takeover_worker, zombie_worker

pytestmark = pytest.mark.slow

LEASE_MS = 300


def _state(pid: int) -> str:
    """The process state letter from /proc: ``T`` is stopped."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat.rsplit(")", 1)[1].split()[0]


@pytest.mark.timeout(60)
def test_r10_zombie_worker_frozen_past_its_lease_cannot_overwrite_the_takeover(
    tmp_path: Path, procs: Processes, parent_pid: int
) -> None:
    db = str(tmp_path / "oncely.db")
    store = oncely.SQLiteStore(db)
    store.migrate()
    key = "invoice-7"
    claimed = procs.ctx.Event()
    resume = procs.ctx.Event()
    a_out, b_out = str(tmp_path / "a.json"), str(tmp_path / "b.json")

    a = procs.start(
        zombie_worker, db, key, LEASE_MS, claimed, resume, a_out, parent_pid, name="zombie-A"
    )
    assert claimed.wait(timeout=30), "A never claimed the key"
    assert a.pid is not None
    a_claim = store.get(CONSUMER, key)
    assert a_claim is not None
    assert a_claim.status is oncely.Status.IN_PROGRESS
    assert a_claim.attempt == 1

    os.kill(a.pid, signal.SIGSTOP)  # frozen mid-handler, holding the claim
    deadline = time.monotonic() + 10
    while _state(a.pid) != "T":
        assert time.monotonic() < deadline, "A did not stop"
        time.sleep(0.01)

    b = procs.start(takeover_worker, db, key, LEASE_MS, b_out, parent_pid, name="takeover-B")
    b.join(timeout=30)
    assert b.exitcode == 0, f"B exited with {b.exitcode}"
    assert _state(a.pid) == "T", "A ran while it should have been frozen"
    b_handled = json.loads(Path(b_out).read_text())

    os.kill(a.pid, signal.SIGCONT)
    resume.set()
    a.join(timeout=30)
    assert a.exitcode == 0, f"A exited with {a.exitcode}"
    a_handled = json.loads(Path(a_out).read_text())
    print(f"\n[R10 zombie] A={a_handled}\nB={b_handled}")

    # B found A's claim lapsed and took it over (R10), running the handler as attempt 2.
    assert b_handled["outcome"] == "stale_reclaimed", b_handled
    assert b_handled["value"] == {"worker": "B"}, b_handled
    assert b_handled["record"]["attempt"] == 2, b_handled
    b_token = b_handled["record"]["token"]
    assert b_token != a_claim.token

    # A's completion was fenced off: in_flight with "lease lost", pointing at B's record.
    assert a_handled["outcome"] == "in_flight", a_handled
    assert a_handled["reason"].startswith("lease lost"), a_handled
    assert a_handled["attempt"] == 1, a_handled  # its own attempt, not the new owner's
    assert a_handled["value"] is None, a_handled
    assert a_handled["record"]["token"] == b_token, a_handled
    assert a_handled["record"]["result"] == {"worker": "B"}, a_handled

    # The store holds B's result, under B's token.
    held = store.get(CONSUMER, key)
    assert held is not None
    assert held.status is oncely.Status.COMPLETED
    assert held.token == b_token
    assert held.result is not None
    assert json.loads(held.result) == {"worker": "B"}

    # A's message is requeued by its broker; the redelivery is a duplicate with B's result.
    def must_not_run(payload: object) -> object:
        raise AssertionError("a completed key ran its handler again")

    inbox = oncely.Inbox(store, consumer=CONSUMER)
    later = inbox.handle(key, {"key": key}, must_not_run)
    assert later.outcome is oncely.Outcome.DUPLICATE, later
    assert later.value == {"worker": "B"}, later
    inbox.close()
    store.close()

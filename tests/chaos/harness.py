"""The parent side of the chaos tests: child processes that never outlive their test, and for
the crash tests a supervisor that runs a fleet of consumers, kills them and restarts them until
the broker is drained, and the facts read back afterwards."""

from __future__ import annotations

import json
import multiprocessing
import random
import signal
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from multiprocessing.context import SpawnContext, SpawnProcess
from pathlib import Path
from typing import Any

import oncely
from tests.chaos.crash_workers import CrashJob, crash_worker, open_broker
from tests.chaos.workers import CONSUMER


class Processes:
    """Starts worker processes with the "spawn" context (a fresh interpreter each, as a
    deployed consumer is) and, at teardown, SIGKILLs and reaps every one still running."""

    def __init__(self) -> None:
        self.ctx: SpawnContext = multiprocessing.get_context("spawn")
        self.started: list[SpawnProcess] = []

    def start(self, target: Callable[..., None], *args: Any, name: str) -> SpawnProcess:
        process = self.ctx.Process(target=target, args=args, name=name, daemon=True)
        process.start()
        self.started.append(process)
        return process

    def reap(self) -> list[str]:
        """Kill and join everything left; the names of the processes that were still alive."""
        left = []
        for process in self.started:
            if process.exitcode is None and process.is_alive():
                left.append(process.name)
                process.kill()  # SIGKILL also ends a SIGSTOPped process
            process.join(timeout=10)
            if process.exitcode is not None:
                process.close()
        self.started.clear()
        return left


@dataclass(frozen=True)
class Kill:
    """A worker that SIGKILLed itself on cue: where, on which key, and who it was."""

    point: str
    key: str
    worker: str


@dataclass
class FleetReport:
    """What happened during one run. Counts from worker logs are lower bounds: a worker killed
    between a step and its log line leaves no line (the store and effects are the truth)."""

    seed: int
    messages: int
    incarnations: int = 0
    restarts: int = 0
    parent_kills: int = 0
    self_kills: list[Kill] = field(default_factory=list)
    outcomes: Counter[str] = field(default_factory=Counter)
    reconciler: Counter[str] = field(default_factory=Counter)
    deliveries: int = 0
    elapsed_s: float = 0.0

    def kills_at(self, point: str) -> list[Kill]:
        return [k for k in self.self_kills if k.point == point]

    def summary(self) -> str:
        points = Counter(k.point for k in self.self_kills)
        return (
            f"seed={self.seed} messages={self.messages} deliveries={self.deliveries} "
            f"kills={self.parent_kills + len(self.self_kills)} "
            f"(parent={self.parent_kills}, self={dict(points)}) restarts={self.restarts} "
            f"stale_reclaimed={self.outcomes['stale_reclaimed']} "
            f"reconciler={dict(self.reconciler)} duplicates={self.outcomes['duplicate']} "
            f"in_flight={self.outcomes['in_flight']} processed={self.outcomes['processed']} "
            f"elapsed={self.elapsed_s:.1f}s"
        )


def run_fleet(
    procs: Processes,
    template: CrashJob,
    logs: Path,
    *,
    slots: int,
    plans: list[tuple[str, int]],
    parent_kills: int,
    seed: int,
    deadline_s: float = 60.0,
) -> FleetReport:
    """Run ``slots`` consumers until the broker in ``template.broker`` is drained.

    Each new incarnation takes the next self-kill plan ``(point, nth)``; a plan whose
    incarnation died before it fired (the parent killed it first) goes back to the front.
    Meanwhile the parent SIGKILLs a random live worker at random moments, ``parent_kills``
    times. A killed worker is restarted while messages are left. A worker that exits any
    other way than 0 or SIGKILL fails the run with its log.
    """
    rng = random.Random(seed)
    broker = open_broker(template.broker, visibility_s=template.visibility_s)
    report = FleetReport(seed=seed, messages=broker.open_copies())
    pending = deque(plans)
    live: dict[int, tuple[SpawnProcess, CrashJob]] = {}
    sent: set[SpawnProcess] = set()  # the workers this supervisor killed
    started = time.monotonic()

    def launch(slot: int) -> None:
        point, nth = pending.popleft() if pending else (None, 1)
        name = f"w{slot}.{report.incarnations}"
        job = replace(
            template, worker=name, log=str(logs / f"{name}.log"), kill_point=point, kill_after=nth
        )
        live[slot] = (procs.start(crash_worker, job, name=name), job)
        report.incarnations += 1

    try:
        for slot in range(slots):
            launch(slot)
        kills_left = parent_kills
        next_kill = time.monotonic() + rng.uniform(0.1, 0.3)
        while live:
            now = time.monotonic()
            if now - started > deadline_s:
                raise AssertionError(
                    f"the fleet did not drain the broker in {deadline_s}s "
                    f"({broker.open_copies()} messages left): {report.summary()}"
                )
            for slot, (process, job) in list(live.items()):
                code = process.exitcode
                if code is None:
                    continue
                del live[slot]
                if code == 0:
                    continue
                if code != -signal.SIGKILL:
                    raise AssertionError(
                        f"worker {job.worker} exited with {code}:\n" + "\n".join(_lines(job.log))
                    )
                fired = _self_kill(job)
                if fired is not None:
                    report.self_kills.append(fired)
                else:
                    report.parent_kills += process in sent
                    if job.kill_point is not None:
                        pending.appendleft((job.kill_point, job.kill_after))
                if broker.open_copies() > 0:
                    launch(slot)
                    report.restarts += 1
            if kills_left and now >= next_kill:
                # Only workers that reached their loop: a kill during interpreter start-up
                # proves nothing about oncely.
                alive = [
                    p for p, job in live.values() if p.exitcode is None and Path(job.log).exists()
                ]
                if alive:
                    victim = rng.choice(alive)
                    sent.add(victim)
                    victim.kill()
                    kills_left -= 1
                next_kill = now + rng.uniform(0.05, 0.3)
            time.sleep(0.01)
        report.deliveries = broker.deliveries()
        assert broker.open_copies() == 0
    finally:
        broker.close()
        procs.reap()
    report.elapsed_s = time.monotonic() - started
    for log in sorted(logs.glob("*.log")):
        for line in log.read_text().splitlines():
            event, _key, detail = [*line.split(" ", 2), "", ""][:3]
            if event == "OUT":
                report.outcomes[detail.split(" ", 1)[0]] += 1
            elif event == "RECONCILE":
                report.reconciler[detail] += 1
    return report


def _lines(path: str) -> list[str]:
    # A worker killed while the interpreter was still starting never opened its log.
    log = Path(path)
    return log.read_text().splitlines() if log.exists() else []


def _self_kill(job: CrashJob) -> Kill | None:
    for line in _lines(job.log):
        if line.startswith("KILL "):
            _, key, point = line.split(" ", 2)
            return Kill(point, key, job.worker)
    return None


def records(db: str) -> dict[str, oncely.Record]:
    """Every live record of the chaos consumer in ``db``, by key."""
    store = oncely.SQLiteStore(db)
    found: dict[str, oncely.Record] = {}
    after: tuple[str, str] | None = None
    try:
        while True:
            page = store.scan(consumer=CONSUMER, after=after, limit=500)
            for record in page:
                found[record.key] = record
            if len(page) < 500:
                return found
            after = (CONSUMER, page[-1].key)
    finally:
        store.close()


def stored_worker(record: oncely.Record) -> str | None:
    """The worker named in a record's stored result."""
    if record.result is None:
        return None
    value = json.loads(record.result)
    return value.get("worker") if isinstance(value, dict) else None

"""The runner: one workload, three consumers, real worker processes, a report.

For each consumer the runner creates a broker file, publishes the seeded workload into it,
starts ``workers`` processes and watches them: it carries out the SIGKILLs the workload asks
for (a worker stops at its crash point and the runner kills it with a real ``SIGKILL``), starts
a replacement for every dead worker, and stops the workers once every copy is settled. Then it
reads the report from the databases. By default the three consumers run side by side, each with
its own broker and databases; every child process is killed and joined before returning.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import shutil
import signal
import tempfile
import time
from dataclasses import dataclass, replace
from datetime import timedelta
from multiprocessing.context import ForkContext, ForkServerContext, SpawnContext
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Literal

from oncely.demo.consumers import (
    CONSUMERS,
    ConsumerName,
    Ledger,
    Setup,
    check_store_url,
    effect_connection,
    prepare,
    reconciled,
)
from oncely.demo.report import ConsumerReport, DemoReport, measure
from oncely.demo.worker import WorkerSpec, worker_main
from oncely.demo.workload import Workload
from oncely.errors import ConfigurationError
from oncely.testing.file_broker import FileBroker

__all__ = ["DemoError", "DemoOptions", "run_demo"]

StartMethod = Literal["spawn", "fork", "forkserver"]
_Context = SpawnContext | ForkContext | ForkServerContext

_POLL_S = 0.01
_MAX_CRASHES = 5


class DemoError(RuntimeError):
    """The demo could not run to the end (a worker kept crashing)."""


MIN_MESSAGES = 12
"""The fewest messages that leave room for every injected fault."""


@dataclass(frozen=True, slots=True, kw_only=True)
class DemoOptions:
    """How to run the demo.

    ``messages`` logical payments (at least 12) consumed by ``workers`` processes per consumer,
    the faults placed by ``seed`` (:class:`~oncely.demo.workload.Workload`). ``store_url``: the
    oncely store (``sqlite:///path.db``; both oncely consumers and the transactional ledger go
    in that file, under names unique to the run); ``None``: files in the work directory.
    ``workdir``: where the databases go (kept); ``None``: a temporary directory, removed at the
    end unless ``keep``. ``consumers``: which consumers to run. ``visibility_timeout``: the
    broker's lease per delivery. ``deadline``: the longest one consumer may run before the
    runner gives up (the unsettled copies show in the report). ``sequential``: run the consumers
    one after another instead of side by side.
    """

    messages: int = 1000
    workers: int = 3
    seed: int = 7
    store_url: str | None = None
    workdir: str | os.PathLike[str] | None = None
    keep: bool = False
    consumers: tuple[ConsumerName, ...] = CONSUMERS
    visibility_timeout: timedelta = timedelta(seconds=1)
    deadline: timedelta = timedelta(minutes=3)
    start_method: StartMethod = "spawn"
    sequential: bool = False

    def __post_init__(self) -> None:
        if self.messages < MIN_MESSAGES:
            raise ConfigurationError(
                f"the demo needs at least {MIN_MESSAGES} messages to place its faults"
            )
        if not 1 <= self.workers <= 32:
            raise ConfigurationError("workers must be between 1 and 32")
        if self.visibility_timeout < timedelta(milliseconds=200):
            raise ConfigurationError("the visibility timeout must be at least 200ms")
        unknown = [c for c in self.consumers if c not in CONSUMERS]
        if unknown or not self.consumers:
            raise ConfigurationError(
                f"unknown consumers {unknown}; choose from {', '.join(CONSUMERS)}"
            )
        if self.store_url is not None:
            check_store_url(self.store_url)


class _ConsumerRun:
    """One consumer's broker, workers and clock."""

    def __init__(
        self,
        kind: ConsumerName,
        setup: Setup,
        directory: Path,
        options: DemoOptions,
        context: _Context,
    ) -> None:
        self.kind = kind
        self.setup = setup
        self.options = options
        self._context = context
        vt = options.visibility_timeout.total_seconds()
        self.broker = FileBroker(
            directory / "broker.db", visibility_timeout=options.visibility_timeout
        )
        self._spec = WorkerSpec(
            name="",
            broker_path=self.broker.path,
            setup=setup,
            visibility_timeout_s=vt,
            slow_s=vt * 1.2,
            # A lone worker has nobody to overlap with or to pair a twin with: do not wait.
            overlap_s=4 * vt if options.workers > 1 else 0.0,
            twin_wait_s=2 * vt if options.workers > 1 else 0.0,
            requeue_delay_s=min(0.25, vt / 4),
            retry_delay_s=0.05,
        )
        self.processes: dict[str, BaseProcess] = {}
        self._generation = 0
        self.crashes = 0
        self.started = 0.0
        self.seconds = 0.0
        self._stopping = False
        self._drain_until = 0.0
        self.done = False

    def prepare(self, workload: Workload) -> None:
        self.broker.create()
        self.broker.publish(c.published() for c in workload.copies)
        prepare(self.setup)

    def start(self) -> None:
        self.started = time.monotonic()
        for _ in range(self.options.workers):
            self._spawn()

    def _spawn(self) -> None:
        self._generation += 1
        name = f"{self.kind}/w{self._generation}"
        spec = replace(self._spec, name=name)
        process = self._context.Process(target=worker_main, args=(spec,), name=name, daemon=True)
        process.start()
        self.processes[name] = process

    def poll(self) -> None:
        """One step of watching the workers; sets ``done`` at the end."""
        if self.done:
            return
        self._carry_out_kills()
        for name, process in list(self.processes.items()):
            if process.exitcode is None:
                continue
            process.join()
            del self.processes[name]
            if process.exitcode != 0 or not self._stopping:
                self.crashes += 1
                if self.crashes > _MAX_CRASHES:
                    raise DemoError(
                        f"{self.kind}: workers crashed {self.crashes} times (last exit code "
                        f"{process.exitcode}); see their output above"
                    )
                if not self._stopping:
                    self._spawn()
        now = time.monotonic()
        if not self._stopping:
            deadline = self.started + self.options.deadline.total_seconds()
            if self.broker.open_copies() == 0 or now > deadline:
                self.broker.stop()
                self._stopping = True
                # A worker still inside a slow handler finishes its writes before it stops.
                self._drain_until = now + 3 * self.options.visibility_timeout.total_seconds() + 10
        elif not self.processes or now > self._drain_until:
            self.shutdown()
            self.seconds = time.monotonic() - self.started
            self.done = True

    def _carry_out_kills(self) -> None:
        for kill_id, pid in self.broker.pending_kills():
            victim = next((p for p in self.processes.values() if p.pid == pid), None)
            if victim is None:
                self.broker.record_kill(kill_id, None)
                continue
            os.kill(pid, signal.SIGKILL)
            victim.join(10)
            self.broker.record_kill(kill_id, victim.exitcode)
            del self.processes[victim.name]
            if not self._stopping:
                self._spawn()

    def shutdown(self) -> None:
        """SIGKILL and join every worker still alive (idempotent)."""
        for process in self.processes.values():
            if process.exitcode is None and process.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process.pid, signal.SIGKILL)
        for process in self.processes.values():
            process.join(10)
        self.processes.clear()

    def report(self) -> ConsumerReport:
        ledger = Ledger(self.setup.prefix)
        with effect_connection(self.setup) as conn:
            effects = ledger.effects(conn)
            consistent = ledger.consistent(conn)
        return measure(
            self.kind,
            self.broker,
            effects,
            balances_consistent=consistent,
            reconciled=reconciled(self.setup),
            worker_crashes=self.crashes,
            seconds=self.seconds,
        )


def _context(method: StartMethod) -> _Context:
    if method == "fork":
        return multiprocessing.get_context("fork")
    if method == "forkserver":
        return multiprocessing.get_context("forkserver")
    return multiprocessing.get_context("spawn")


def _setup(kind: ConsumerName, directory: Path, run_id: str, store_url: str | None) -> Setup:
    prefix = f"demo_{run_id}"
    consumer = f"demo-{run_id}-{kind}"
    own_store = f"sqlite:///{directory / 'oncely.db'}"
    if kind == "naive":
        return Setup(
            kind=kind, prefix=prefix, consumer=consumer, ledger_path=str(directory / "ledger.db")
        )
    if kind == "oncely-transactional":
        return Setup(kind=kind, prefix=prefix, consumer=consumer, store_url=store_url or own_store)
    return Setup(
        kind=kind,
        prefix=prefix,
        consumer=consumer,
        store_url=store_url or own_store,
        ledger_path=str(directory / "provider.db"),
    )


def run_demo(options: DemoOptions | None = None) -> DemoReport:
    """Run every consumer of ``options`` over the same seeded workload and report.

    Raises :class:`~oncely.ConfigurationError` for options that cannot work and
    :class:`DemoError` if workers keep crashing. Never leaves a child process behind.
    """
    options = options if options is not None else DemoOptions()
    begun = time.monotonic()
    run_id = f"{options.seed}_{os.urandom(3).hex()}"
    workload = Workload.build(messages=options.messages, seed=options.seed)
    owned = options.workdir is None
    root = Path(
        tempfile.mkdtemp(prefix="oncely-demo-") if owned else os.fspath(options.workdir or ".")
    )
    context = _context(options.start_method)
    runs: list[_ConsumerRun] = []
    try:
        for kind in options.consumers:
            directory = root / f"{kind}-{run_id}" if not owned else root / kind
            directory.mkdir(parents=True, exist_ok=True)
            setup = _setup(kind, directory, run_id, options.store_url)
            run = _ConsumerRun(kind, setup, directory, options, context)
            runs.append(run)
            run.prepare(workload)
        batches = [[run] for run in runs] if options.sequential else [runs]
        for batch in batches:
            for run in batch:
                run.start()
            while not all(run.done for run in batch):
                for run in batch:
                    run.poll()
                time.sleep(_POLL_S)
        reports: dict[str, ConsumerReport] = {run.kind: run.report() for run in runs}
    finally:
        for run in runs:
            run.shutdown()
            run.broker.close()
        if owned and not options.keep:
            shutil.rmtree(root, ignore_errors=True)
    kept = None if owned and not options.keep else str(root)
    return DemoReport(options, run_id, reports, kept, round(time.monotonic() - begun, 2))

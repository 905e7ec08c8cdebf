"""What the end-to-end tests of the worker integrations (Celery, Dramatiq, FastStream) share:
one scenario's queue, worker processes and effects (:class:`WorkerRun`), waiting for the
workers' effects in Redis, and the inbox's store as a fixture (SQLite and Redis)."""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from types import ModuleType
from typing import Any, ClassVar

import pika
import pytest
import redis

import oncely
from tests.services import RABBITMQ_URL, REDIS_URL, require


def until(
    check: Callable[[], bool], seconds: float = 60, client: redis.Redis | None = None, ns: str = ""
) -> None:
    """Wait for ``check``; on a timeout, fail with the effects under ``ns`` in Redis."""
    deadline = time.monotonic() + seconds
    while not check():
        if time.monotonic() > deadline:
            seen = {} if client is None else {
                k.decode(): client.get(k) for k in client.scan_iter(match=f"{ns}:*")
            }  # fmt: skip
            pytest.fail(f"the workers did not get there in time: {seen}")
        time.sleep(0.2)


def assert_resends_back_off(log: Path, key: str, resends: int | None = None) -> None:
    """The copy of ``key`` that met its first copy running was sent again less and less
    often: the waits the worker's log gives (``sent again in 2.0 s``, ``in 2000 ms``, ``after
    2.0 s``) double from one second and never shrink, a handful of them while a 12 s run
    lasts; ``resends``, where the test counted them otherwise, is their number."""
    delays = []
    for line in log.read_text(errors="replace").splitlines():
        said = re.search(r"sent again (?:in|after) ([\d.]+) (ms|s)\b", line)
        if f"{key} is being processed elsewhere" in line and said:
            delays.append(float(said[1]) / (1000 if said[2] == "ms" else 1))
    assert 1 <= len(delays) <= 5, delays
    assert delays[:3] == [1.0, 2.0, 4.0], delays
    assert delays == sorted(delays), delays
    assert resends is None or len(delays) == resends, (resends, delays)


def store_url(request: pytest.FixtureRequest, tmp_path: Path, prefix: str) -> Iterator[str]:
    """The inbox's store for a worker test (``request.param``: sqlite or redis), its keys
    removed afterwards; RabbitMQ and Redis required."""
    require("RabbitMQ", RABBITMQ_URL, 5672)
    require("Redis", REDIS_URL, 6379)
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'inbox.db'}"
        return
    unique = f"{prefix}_{uuid.uuid4().hex[:8]}"
    yield f"{REDIS_URL}?prefix={unique}"
    client = redis.Redis.from_url(REDIS_URL)
    for name in client.scan_iter(match=f"{unique}*"):
        client.delete(name)
    client.close()


@contextlib.contextmanager
def holding(store: str, key: str, body: bytes) -> Iterator[Callable[[], oncely.Handled[Any]]]:
    """A live claim of ``key`` (consumer ``billing``, the test apps' inbox) on ``store``, held
    from this process as another worker's running handler holds it: its lease short (1 s)
    and renewed by its heartbeat, so a copy of the message meets it and is given back
    (``in_flight``) for as long as it is held. Gives ``fail()``: that handler raises (the
    claim is released, failed, as a failed run's is); returns the holder's outcome."""
    started = threading.Event()
    release = threading.Event()
    outcome: list[oncely.Handled[Any]] = []

    async def hold() -> None:
        store_ = oncely.open_async(store)
        inbox = oncely.AsyncInbox(
            store_, consumer="billing", lease=oncely.Lease(duration=timedelta(seconds=1))
        )

        async def holder(_body: object) -> None:
            started.set()
            await asyncio.to_thread(release.wait)
            raise RuntimeError("the holder failed")

        try:
            outcome.append(await inbox.handle(key, body, holder))
        finally:
            started.set()
            await inbox.aclose()
            await store_.aclose()

    thread = threading.Thread(target=asyncio.run, args=(hold(),), daemon=True)
    thread.start()

    def fail() -> oncely.Handled[Any]:
        release.set()
        thread.join(30)
        assert outcome, "the holder did not end"
        return outcome[0]

    try:
        assert started.wait(30), "the holder did not claim the key"
        assert thread.is_alive(), "the holder did not claim the key"
        yield fail
    finally:
        release.set()
        thread.join(30)


ROOT = Path(__file__).resolve().parents[2]
DOWN_STORE_PASSWORD = "s3cret-d0wn"


def down_store() -> tuple[str, str]:
    """A PostgreSQL store URL (with a password) where no server answers, and its address."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"postgresql://postgres:{DOWN_STORE_PASSWORD}@127.0.0.1:{port}/test", f"127.0.0.1:{port}"


def stopped_at_start(
    make_run: Callable[[str], WorkerRun],
    send: Callable[[Any], object],
    start: Callable[[Any, Path], subprocess.Popen[bytes]],
    log: Path,
    *,
    code: int | None = 3,
    oncely_line: bool = True,
) -> str:
    """A worker started (``start(run, log)``) on a store where nothing answers, after
    ``send(run)`` sent it one message: it exits (with ``code``; any code but 0 when None)
    having named the store, and the message waits untouched. Returns what the worker said."""
    require("RabbitMQ", RABBITMQ_URL, 5672)
    store, where = down_store()
    run = make_run(store)
    try:
        send(run)
        returned = start(run, log).wait(60)
        assert returned == code if code is not None else returned != 0, returned
        return run.assert_stopped_at_start(log, where, oncely_line=oncely_line)
    finally:
        run.close()


class WorkerRun:
    """One scenario of a worker test: its own queue and Redis namespace, the test app module
    configured for them by the environment (``ONCELY_TEST_<FRAMEWORK>_QUEUE``, ``_NS``,
    ``_STORE``, ``_LEASE``), the worker processes it started (each in its own session, so a
    ``SIGKILL`` takes the whole pool) and the effects the app counted in Redis."""

    framework: ClassVar[str]
    app_module: ClassVar[str]
    queue_suffixes: ClassVar[tuple[str, ...]] = ("",)
    """The queues of a run, as suffixes of :attr:`queue`: deleted by :meth:`close`."""

    def __init__(self, store: str, lease: float = 30.0) -> None:
        tag = f"oncely_{self.framework.lower()[:2]}_"
        self.queue = tag + uuid.uuid4().hex[:8]
        self.ns = tag + uuid.uuid4().hex[:8]
        name = f"ONCELY_TEST_{self.framework.upper()}"
        self.env = {
            f"{name}_QUEUE": self.queue,
            f"{name}_NS": self.ns,
            f"{name}_STORE": store,
            f"{name}_LEASE": str(lease),
            "ONCELY_TEST_REDIS_URL": REDIS_URL,
            "ONCELY_TEST_RABBITMQ_URL": RABBITMQ_URL,
        }
        self.redis = redis.Redis.from_url(REDIS_URL)
        self.workers: list[subprocess.Popen[bytes]] = []

    def load_app(self) -> ModuleType:
        """The test app module, (re)loaded with this run's environment."""
        os.environ.update(self.env)
        return importlib.reload(importlib.import_module(self.app_module))

    def spawn(self, *argv: str, log: Path | None = None) -> subprocess.Popen[bytes]:
        """``python -m <argv>`` from the repository's root with this run's environment; its
        stdout and stderr written to ``log`` when one is given."""
        out = None if log is None else log.open("wb")
        try:
            process = subprocess.Popen(
                [sys.executable, "-m", *argv],
                cwd=ROOT, env={**os.environ, **self.env}, start_new_session=True,
                stdout=out, stderr=None if out is None else subprocess.STDOUT,
            )  # fmt: skip
        finally:
            if out is not None:
                out.close()
        self.workers.append(process)
        return process

    def waiting(self) -> int:
        """How many messages wait, ready, in this run's queue."""
        with self.channel() as channel:
            return int(channel.queue_declare(self.queue, passive=True).method.message_count)

    def assert_stopped_at_start(self, log: Path, where: str, *, oncely_line: bool = True) -> str:
        """The worker whose output is ``log`` stopped before taking a message: it named the
        store at ``where`` (its password hidden), in oncely's one line with the exit code
        unless ``oncely_line`` is false, and the message sent before it started still waits
        in the queue, never run. Returns what the worker said."""
        said = log.read_text(errors="replace")
        assert where in said and DOWN_STORE_PASSWORD not in said, said
        if oncely_line:
            lines = [line for line in said.splitlines() if "the worker stops before" in line]
            assert lines and where in lines[0] and "[exit 3]" in lines[0], said
            assert "Traceback" not in said, said
        assert self.started("u1") == 0
        assert self.waiting() == 1
        return said

    @contextlib.contextmanager
    def channel(self) -> Iterator[Any]:
        with contextlib.closing(pika.BlockingConnection(pika.URLParameters(RABBITMQ_URL))) as c:
            yield c.channel()

    def effects(self, name: str) -> int:
        return int(self.redis.get(f"{self.ns}:effects:{name}") or 0)

    def started(self, name: str) -> int:
        return int(self.redis.get(f"{self.ns}:started:{name}") or 0)

    def outcomes(self, key: str, outcome: str) -> int:
        """How many times the inbox's handling of ``key`` ended as ``outcome`` (``duplicate``,
        ``in_flight``...): the test apps' ``counted`` hook keeps the count."""
        return int(self.redis.get(f"{self.ns}:outcomes:{key}:{outcome}") or 0)

    def taken(self, suffix: str) -> list[tuple[Any, bytes]]:
        """The messages of ``<queue><suffix>`` on RabbitMQ (taken off it): (properties, body)."""
        found: list[tuple[Any, bytes]] = []
        with self.channel() as channel, contextlib.suppress(pika.exceptions.ChannelClosedByBroker):
            while True:
                method, properties, body = channel.basic_get(self.queue + suffix, True)
                if method is None:
                    break
                found.append((properties, body))
        return found

    def until(self, check: Callable[[], bool], seconds: float = 60) -> None:
        until(check, seconds, self.redis, self.ns)

    def worker(self) -> subprocess.Popen[bytes]:
        """Start one worker process of the test app."""
        raise NotImplementedError

    def supervised(self, check: Callable[[], bool], seconds: float = 60) -> None:
        """Wait for ``check`` while a worker runs, started again each time the last one
        dies, as a process supervisor (systemd, Kubernetes) would."""

        def step() -> bool:
            if not self.workers or self.workers[-1].poll() is not None:
                self.worker()
            return check()

        self.until(step, seconds)

    def close(self) -> None:
        for process in self.workers:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait(10)
        with self.channel() as channel:
            for suffix in self.queue_suffixes:
                channel.queue_delete(self.queue + suffix)
        for name in self.redis.scan_iter(match=f"{self.ns}:*"):
            self.redis.delete(name)
        self.redis.close()


class Supervisor:
    """A worker started by ``start()`` and started again whenever it exits, as a process
    supervisor (systemd, Kubernetes) would, until the ``with`` block ends: ``starts`` counts
    the starts, ``current`` is the worker running now. Left before the run's ``close()``, so
    nothing starts a worker after the run killed them."""

    def __init__(self, start: Callable[[], subprocess.Popen[bytes]]) -> None:
        self._start = start
        self.starts = 0
        self.current: subprocess.Popen[bytes] | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> Supervisor:
        self.current = self._start()
        self.starts = 1
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def _loop(self) -> None:
        while not self._stop.wait(0.2):
            if self.current is not None and self.current.poll() is not None:
                self.current = self._start()
                self.starts += 1

"""Celery tasks behind ``oncely.integrations.celery.IdempotentTask``, end to end: the real
``celery worker`` (prefork) on the machine's RabbitMQ, the inbox on SQLite and Redis, effects
counted in Redis (R1, R2, R10, R13, R16)."""

from __future__ import annotations

import contextlib
import importlib
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

pytest.importorskip("celery")
import pika
import redis

from tests.integrations.workers import store_url, until
from tests.services import RABBITMQ_URL, REDIS_URL

ROOT = Path(__file__).resolve().parents[2]


class Run:
    def __init__(self, store: str, lease: float = 30.0) -> None:
        self.queue = f"oncely_cq_{uuid.uuid4().hex[:8]}"
        self.ns = f"oncely_cq_{uuid.uuid4().hex[:8]}"
        self.env = {
            "ONCELY_TEST_CELERY_QUEUE": self.queue,
            "ONCELY_TEST_CELERY_NS": self.ns,
            "ONCELY_TEST_CELERY_STORE": store,
            "ONCELY_TEST_CELERY_LEASE": str(lease),
            "ONCELY_TEST_REDIS_URL": REDIS_URL,
        }
        self.redis = redis.Redis.from_url(REDIS_URL)
        self.workers: list[subprocess.Popen[bytes]] = []
        os.environ.update(self.env)
        import tests.integrations.celery_app as app

        self.app: ModuleType = importlib.reload(app)

    def worker(self, concurrency: int = 2) -> subprocess.Popen[bytes]:
        process = subprocess.Popen(
            [
                sys.executable, "-m", "celery", "-A", "tests.integrations.celery_app", "worker",
                "-P", "prefork", "-c", str(concurrency), "-Q", self.queue,
                "--loglevel", "warning", "--without-mingle", "--without-gossip",
            ],
            cwd=ROOT, env={**os.environ, **self.env}, start_new_session=True,
        )  # fmt: skip
        self.workers.append(process)
        return process

    def effects(self, name: str) -> int:
        return int(self.redis.get(f"{self.ns}:effects:{name}") or 0)

    def started(self, name: str) -> int:
        return int(self.redis.get(f"{self.ns}:started:{name}") or 0)

    def dead_letters(self) -> int:
        with contextlib.closing(pika.BlockingConnection(pika.URLParameters(RABBITMQ_URL))) as c:
            declared = c.channel().queue_declare(f"{self.queue}.dead", passive=True)
            return int(declared.method.message_count)

    def close(self) -> None:
        for process in self.workers:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait(10)
        with contextlib.closing(pika.BlockingConnection(pika.URLParameters(RABBITMQ_URL))) as c:
            channel = c.channel()
            for name in (self.queue, f"{self.queue}.dead"):
                channel.queue_delete(name)
        for name in self.redis.scan_iter(match=f"{self.ns}:*"):
            self.redis.delete(name)
        self.redis.close()


@pytest.fixture(params=["sqlite", "redis"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    yield from store_url(request, tmp_path, "oncely_cqi")


@pytest.mark.timeout(180)
def test_r1_r2_r16_each_effect_once_and_every_refusal_dead_lettered(store: str) -> None:
    from oncely.integrations.celery import DeadLettered, send_with_key

    run = Run(store)
    try:
        app = run.app
        run.worker()
        first = [app.charge.delay("o1", 10) for _ in range(3)]  # a producer's retries
        assert [r.get(timeout=60) for r in first] == [{"order": "o1", "amount": 10}] * 3
        for _ in range(2):
            send_with_key(app.notify, "mail:o1", args=("o1",))
        recovered = app.charge.delay("o3", 10, fail_times=2)
        assert recovered.get(timeout=60) == {"order": "o3", "amount": 10}
        refused = [
            app.charge.delay("o1", 99),  # the key again, other arguments
            app.notify.delay("o9"),  # no key
            app.charge.delay("o4", 10, fail_times=99),  # never succeeds
            app.charge.delay("o5", 10, reject=True),  # the task refuses it
        ]
        reasons = []
        for result in refused:
            with pytest.raises(DeadLettered) as caught:
                result.get(timeout=60)
            reasons.append(str(caught.value))
        assert "key_conflict" in reasons[0] and "no idempotency key" in reasons[1]
        assert "failed on all 3 deliveries" in reasons[2] and "not billable" in reasons[3]
        until(lambda: run.effects("mail:o1") == 1, client=run.redis, ns=run.ns)
        time.sleep(1.0)
        assert run.effects("o1") == 1 and run.effects("o3") == 1 and run.effects("mail:o1") == 1
        assert run.started("o3") == 3 and run.started("o4") == 3
        assert run.dead_letters() == 4
    finally:
        run.close()


@pytest.mark.timeout(180)
def test_r10_a_worker_killed_mid_task_is_redelivered_and_applied_once(store: str) -> None:
    run = Run(store, lease=2.0)
    try:
        result = run.app.charge.delay("k1", 10, sleep=4.0)
        first = run.worker(concurrency=1)
        until(lambda: run.started("k1") == 1, client=run.redis, ns=run.ns)
        os.killpg(first.pid, signal.SIGKILL)
        first.wait(10)
        run.worker(concurrency=1)
        assert result.get(timeout=90) == {"order": "k1", "amount": 10}
        time.sleep(2.0)
        assert run.effects("k1") == 1 and run.started("k1") == 2
    finally:
        run.close()

"""Celery tasks behind ``oncely.integrations.celery.IdempotentTask``, end to end: the real
``celery worker`` (prefork) on the machine's RabbitMQ, the inbox on SQLite and Redis, effects
counted in Redis (R1, R2, R10, R13, R16)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("celery")

from tests.integrations.workers import WorkerRun, store_url, until


class Run(WorkerRun):
    framework = "celery"
    app_module = "tests.integrations.celery_app"
    queue_suffixes = ("", ".dead")

    def __init__(self, store: str, lease: float = 30.0) -> None:
        super().__init__(store, lease)
        self.app = self.load_app()

    def worker(self, concurrency: int = 2) -> subprocess.Popen[bytes]:
        return self.spawn(
            "celery", "-A", self.app_module, "worker", "-P", "prefork", "-c", str(concurrency),
            "-Q", self.queue, "--loglevel", "warning", "--without-mingle", "--without-gossip",
        )  # fmt: skip

    def dead_letters(self) -> int:
        with self.channel() as channel:
            declared = channel.queue_declare(f"{self.queue}.dead", passive=True)
            return int(declared.method.message_count)


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

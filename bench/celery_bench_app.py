"""The Celery app ``bench/celery_bench.py`` runs with ``celery worker -P prefork``: one
task per variant, each with one Redis ``INCR`` as its effect (``space`` names the counter)."""

from __future__ import annotations

import os
from typing import Any

import redis
from celery import Celery, Task

import oncely
from oncely.integrations.celery import IdempotentTask

AMQP = os.environ.get("ONCELY_TEST_RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672/")
REDIS_URL = os.environ.get("ONCELY_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
PREFIX = os.environ.get("ONCELY_BENCH_CELERY_PREFIX", "bench_cq")
REDIS = redis.Redis.from_url(REDIS_URL)

app = Celery("oncely_bench_celery", broker=AMQP)
app.conf.update(task_ignore_result=True, task_acks_late=True, worker_hijack_root_logger=False)
inbox = oncely.Inbox(oncely.open(f"{REDIS_URL}?prefix={PREFIX}_inbox"), consumer="bench")


class ByHand(Task):  # type: ignore[misc]
    """A claim and a completion written by hand on the same Redis, as a team would: a
    ``SET key NX PX`` before the task, a ``SET key done`` after it, a duplicate acked unrun,
    the key deleted when the task raises (two round trips, as oncely's two-phase mode)."""

    def __call__(self, space: str, n: int) -> Any:
        key = f"{PREFIX}:hand:{space}:{n}"
        if not REDIS.set(key, "running", nx=True, px=60_000):
            return None
        try:
            result = self.run(space, n)
        except Exception:
            REDIS.delete(key)
            raise
        REDIS.set(key, "done", px=86_400_000)
        return result


@app.task(name="bench.bare")
def bare(space: str, n: int) -> None:
    REDIS.incr(f"{PREFIX}:effects:{space}")


@app.task(name="bench.by_hand", base=ByHand)
def by_hand(space: str, n: int) -> None:
    REDIS.incr(f"{PREFIX}:effects:{space}")


@app.task(
    name="bench.oncely",
    base=IdempotentTask,
    inbox=inbox,
    idempotency_key=lambda space, n: f"{space}:{n}",
)
def with_oncely(space: str, n: int) -> None:
    REDIS.incr(f"{PREFIX}:effects:{space}")

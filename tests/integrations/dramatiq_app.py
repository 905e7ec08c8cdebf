"""The Dramatiq app ``tests/integrations/test_dramatiq.py`` runs with the ``dramatiq`` worker
command on RabbitMQ: actors behind ``oncely.integrations.dramatiq.Idempotency``, their effects
counted in Redis (``INCR``), so every worker process counts in one place. Configured by the
environment: ``ONCELY_TEST_DRAMATIQ_QUEUE`` (the queue), ``ONCELY_TEST_DRAMATIQ_STORE`` (the
inbox's store URL), ``ONCELY_TEST_DRAMATIQ_NS`` (the Redis key prefix of the effects),
``ONCELY_TEST_DRAMATIQ_LEASE`` (the lease, seconds), ``ONCELY_TEST_DRAMATIQ_ON_STALE`` (the
inbox's ``on_stale``), ``ONCELY_TEST_DRAMATIQ_BROKER`` (``rabbitmq``, or ``redis`` for a broker
that dead-letters with Dramatiq's own ``fail()``), ``ONCELY_TEST_DRAMATIQ_LOG_KEYS`` (``hash``
for the inbox's ``log_keys="hash"``)."""

from __future__ import annotations

import os
import sqlite3
import threading
import time
from datetime import timedelta

import dramatiq
import redis
from dramatiq.brokers.rabbitmq import RabbitmqBroker
from dramatiq.brokers.redis import RedisBroker
from dramatiq.results import Results
from dramatiq.results.backends import RedisBackend

import oncely
from oncely.integrations.dramatiq import Idempotency

QUEUE = os.environ["ONCELY_TEST_DRAMATIQ_QUEUE"]
NS = os.environ["ONCELY_TEST_DRAMATIQ_NS"]
RABBITMQ = os.environ.get("ONCELY_TEST_RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672/")
REDIS_URL = os.environ.get("ONCELY_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
REDIS = redis.Redis.from_url(REDIS_URL)

broker: dramatiq.Broker
if os.environ.get("ONCELY_TEST_DRAMATIQ_BROKER", "rabbitmq") == "redis":
    broker = RedisBroker(url=REDIS_URL, namespace=f"{NS}:broker")  # removed with the effects
else:
    broker = RabbitmqBroker(url=RABBITMQ)


def counted(handled: oncely.Handled[object]) -> None:
    """Every outcome, counted by key: what a test waits on when nothing else shows it."""
    REDIS.incr(f"{NS}:outcomes:{handled.key}:{handled.outcome.value}")


inbox = oncely.Inbox(
    oncely.open(os.environ["ONCELY_TEST_DRAMATIQ_STORE"]),
    consumer="billing",
    lease=oncely.Lease(
        duration=timedelta(seconds=float(os.environ.get("ONCELY_TEST_DRAMATIQ_LEASE", "30")))
    ),
    log_keys="hash" if os.environ.get("ONCELY_TEST_DRAMATIQ_LOG_KEYS") == "hash" else "plain",
    on_stale=oncely.OnStale(os.environ.get("ONCELY_TEST_DRAMATIQ_ON_STALE", "retry")),
    hooks=[counted],
)
broker.add_middleware(Idempotency(inbox, retry_in_flight_ms=1_000))
broker.add_middleware(Results(backend=RedisBackend(url=REDIS_URL, namespace=f"{NS}-results")))
dramatiq.set_broker(broker)


@dramatiq.actor(
    queue_name=QUEUE,
    max_retries=8,
    min_backoff=100,
    max_backoff=300,
    idempotency_key=lambda order, amount, **options: f"charge:{order}",
)
def charge(
    order: str, amount: int, sleep: float = 0, fail_times: int = 0, reject: bool = False
) -> None:
    REDIS.incr(f"{NS}:started:{order}")
    time.sleep(sleep)
    if reject:
        raise oncely.Reject(f"order {order} is not billable")
    if REDIS.incr(f"{NS}:attempts:{order}") <= fail_times:
        raise RuntimeError(f"the ledger is down (attempt for {order})")
    REDIS.incr(f"{NS}:effects:{order}")


@dramatiq.actor(queue_name=QUEUE, max_retries=0, idempotency_key="sent")
def notify(order: str) -> None:
    REDIS.incr(f"{NS}:effects:mail:{order}")


@dramatiq.actor(queue_name=QUEUE, max_retries=0)
def plain(order: str) -> None:  # no idempotency_key: untouched by the middleware
    REDIS.incr(f"{NS}:effects:plain:{order}")


@dramatiq.actor(
    queue_name=QUEUE,
    store_results=True,
    max_retries=0,
    idempotency_key=lambda order, sleep=0: f"price:{order}",
)
def price(order: str, sleep: float = 0) -> dict[str, object]:
    """A result a caller reads (the Results middleware, in Redis)."""
    REDIS.incr(f"{NS}:started:price:{order}")
    time.sleep(sleep)
    REDIS.incr(f"{NS}:effects:price:{order}")
    return {"order": order, "total": 42}


@dramatiq.actor(queue_name=QUEUE, max_retries=0)
def record(priced: dict[str, object]) -> None:
    """A pipeline's next stage, given the price."""
    REDIS.incr(f"{NS}:effects:record:{priced['order']}")


@dramatiq.actor(
    queue_name=QUEUE,
    store_results=True,
    max_retries=0,
    idempotency_key=lambda order: f"bulky:{order}",
)
def bulky(order: str) -> str:
    """A result over the inbox's ``max_result_bytes`` (256 KiB): not kept for duplicates."""
    REDIS.incr(f"{NS}:effects:bulky:{order}")
    return "x" * (300 * 1024)


def _hold_the_inbox(seconds: float) -> None:
    """Another writer holds the SQLite inbox's write lock for ``seconds`` (from now)."""
    path = os.environ["ONCELY_TEST_DRAMATIQ_STORE"].removeprefix("sqlite:///").split("?")[0]
    held = threading.Event()

    def hold() -> None:
        conn = sqlite3.connect(path, isolation_level=None)
        conn.execute("BEGIN IMMEDIATE")
        held.set()
        time.sleep(seconds)
        conn.execute("COMMIT")
        conn.close()

    threading.Thread(target=hold, daemon=True).start()
    held.wait()


@dramatiq.actor(
    queue_name=QUEUE,
    time_limit=1_000,
    max_retries=2,
    min_backoff=100,
    max_backoff=200,
    idempotency_key=lambda order: f"overtime:{order}",
)
def overtime(order: str) -> None:
    """Returns within its time limit (1 s), its effect done, while another writer holds the
    inbox's lock for 2.5 s: the claim completes after the limit has passed."""
    REDIS.incr(f"{NS}:started:overtime:{order}")
    REDIS.incr(f"{NS}:effects:overtime:{order}")
    if int(REDIS.get(f"{NS}:started:overtime:{order}") or 0) == 1:
        _hold_the_inbox(2.5)


@dramatiq.actor(
    queue_name=QUEUE,
    max_retries=2,
    min_backoff=100,
    max_backoff=200,
    idempotency_key=lambda order, **options: f"fatal:{order}",
)
def fatal(order: str, deaths: int = 0) -> None:
    """Its first ``deaths`` runs end the worker process at once (``os._exit``, as the OOM
    killer would): the ``dramatiq`` command then stops."""
    if REDIS.incr(f"{NS}:started:fatal:{order}") <= deaths:
        os._exit(1)
    REDIS.incr(f"{NS}:effects:fatal:{order}")

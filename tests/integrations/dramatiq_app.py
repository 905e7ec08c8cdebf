"""The Dramatiq app ``tests/integrations/test_dramatiq.py`` runs with the ``dramatiq`` worker
command on RabbitMQ: actors behind ``oncely.integrations.dramatiq.Idempotency``, their effects
counted in Redis (``INCR``), so every worker process counts in one place. Configured by the
environment: ``ONCELY_TEST_DRAMATIQ_QUEUE`` (the queue), ``ONCELY_TEST_DRAMATIQ_STORE`` (the
inbox's store URL), ``ONCELY_TEST_DRAMATIQ_NS`` (the Redis key prefix of the effects),
``ONCELY_TEST_DRAMATIQ_LEASE`` (the lease, seconds)."""

from __future__ import annotations

import os
import time
from datetime import timedelta

import dramatiq
import redis
from dramatiq.brokers.rabbitmq import RabbitmqBroker

import oncely
from oncely.integrations.dramatiq import Idempotency

QUEUE = os.environ["ONCELY_TEST_DRAMATIQ_QUEUE"]
NS = os.environ["ONCELY_TEST_DRAMATIQ_NS"]
RABBITMQ = os.environ.get("ONCELY_TEST_RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672/")
REDIS = redis.Redis.from_url(os.environ.get("ONCELY_TEST_REDIS_URL", "redis://127.0.0.1:6379/0"))

broker = RabbitmqBroker(url=RABBITMQ)
inbox = oncely.Inbox(
    oncely.open(os.environ["ONCELY_TEST_DRAMATIQ_STORE"]),
    consumer="billing",
    lease=oncely.Lease(
        duration=timedelta(seconds=float(os.environ.get("ONCELY_TEST_DRAMATIQ_LEASE", "30")))
    ),
)
broker.add_middleware(Idempotency(inbox, retry_in_flight_ms=1_000))
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

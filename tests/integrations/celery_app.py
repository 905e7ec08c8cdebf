"""The Celery app ``tests/integrations/test_celery.py`` runs with the real ``celery worker``
(prefork): tasks behind ``oncely.integrations.celery.IdempotentTask``, their effects counted in
Redis (``INCR``) so every pool process counts in one place. Configured by the environment:
``ONCELY_TEST_CELERY_QUEUE``, ``ONCELY_TEST_CELERY_STORE`` (the inbox's store URL),
``ONCELY_TEST_CELERY_NS`` (the Redis key prefix of the effects), ``ONCELY_TEST_CELERY_LEASE``
(seconds), ``ONCELY_TEST_CELERY_BROKER`` (the broker URL: RabbitMQ unless it says otherwise),
``ONCELY_TEST_CELERY_LOG_KEYS`` (``hash`` for the inbox's ``log_keys="hash"``)."""

from __future__ import annotations

import os
import signal
import time
from datetime import UTC, datetime, timedelta

import redis
from celery import Celery

import oncely
from oncely.integrations.celery import IdempotentTask

QUEUE = os.environ["ONCELY_TEST_CELERY_QUEUE"]
NS = os.environ["ONCELY_TEST_CELERY_NS"]
REDIS_URL = os.environ.get("ONCELY_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
REDIS = redis.Redis.from_url(REDIS_URL)

app = Celery(
    "oncely_test_celery",
    broker=os.environ.get("ONCELY_TEST_CELERY_BROKER", "amqp://guest:guest@127.0.0.1:5672//"),
    backend=REDIS_URL,
)
app.conf.task_default_queue = QUEUE
app.conf.broker_transport_options = {  # the Redis broker only: a 3 s visibility timeout,
    "visibility_timeout": 3,  # checked every second, its keys under the run's namespace
    "unacked_restore_interval": 1,
    "unacked_restore_throttle": 1,
    "global_keyprefix": f"{NS}:kombu:",
}


def counted(handled: oncely.Handled[object]) -> None:
    """Every outcome, counted by key: what a test waits on when nothing else shows it."""
    REDIS.incr(f"{NS}:outcomes:{handled.key}:{handled.outcome.value}")


inbox = oncely.Inbox(
    oncely.open(os.environ["ONCELY_TEST_CELERY_STORE"]),
    consumer="billing",
    lease=oncely.Lease(
        duration=timedelta(seconds=float(os.environ.get("ONCELY_TEST_CELERY_LEASE", "30")))
    ),
    log_keys="hash" if os.environ.get("ONCELY_TEST_CELERY_LOG_KEYS") == "hash" else "plain",
    hooks=[counted],
)


@app.task(
    base=IdempotentTask,
    inbox=inbox,
    retry_in_flight=1.0,
    max_retries=2,
    default_retry_delay=0.2,
    idempotency_key=lambda order, amount, **options: f"charge:{order}",
)
def charge(
    order: str, amount: int, sleep: float = 0, fail_times: int = 0, reject: bool = False
) -> dict[str, object]:
    REDIS.set(f"{NS}:pid:{order}", os.getpid())
    REDIS.incr(f"{NS}:started:{order}")
    time.sleep(sleep)
    if reject:
        raise oncely.Reject(f"order {order} is not billable")
    if REDIS.incr(f"{NS}:attempts:{order}") <= fail_times:
        raise RuntimeError(f"the ledger is down (attempt for {order})")
    REDIS.incr(f"{NS}:effects:{order}")
    return {"order": order, "amount": amount}


@app.task(base=IdempotentTask, inbox=inbox, idempotency_key="sent")
def notify(order: str) -> None:
    REDIS.incr(f"{NS}:effects:mail:{order}")


@app.task(base=IdempotentTask, inbox=inbox, idempotency_key=lambda order: f"quote:{order}")
def quote(order: str) -> dict[str, datetime]:
    """A result Celery's JSON keeps as a datetime (oncely stores its ISO form)."""
    REDIS.incr(f"{NS}:effects:quote:{order}")
    return {"at": datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)}


@app.task(base=IdempotentTask, inbox=inbox, idempotency_key=lambda order: f"big:{order}")
def big(order: str) -> str:
    """A result over the inbox's 256 KiB: not kept for a duplicate."""
    REDIS.incr(f"{NS}:effects:big:{order}")
    return "x" * 300_000


@app.task(
    base=IdempotentTask,
    inbox=inbox,
    autoretry_for=(RuntimeError,),
    retry_kwargs={"max_retries": 1, "countdown": 0.2},
    idempotency_key=lambda order: f"flaky:{order}",
)
def flaky(order: str) -> None:
    """Celery's autoretry with its own limit: one retry, then dead-lettered."""
    REDIS.incr(f"{NS}:started:flaky:{order}")
    raise RuntimeError(f"the ledger is down (order {order})")


if os.environ.get("ONCELY_TEST_CELERY_EARLY_ACK"):

    @app.task(base=IdempotentTask, inbox=inbox, acks_late=False, idempotency_key="sent")
    def early(order: str) -> None:
        REDIS.incr(f"{NS}:effects:early:{order}")


@app.task
def total(order: str, sleep: float = 0) -> dict[str, object]:
    """What ``reorder`` replaces itself with: a plain Celery task, with no key of its own."""
    time.sleep(sleep)
    REDIS.incr(f"{NS}:effects:total:{order}")
    return {"order": order, "total": 42}


@app.task(
    bind=True,
    base=IdempotentTask,
    inbox=inbox,
    idempotency_key=lambda order, **options: f"reorder:{order}",
)
def reorder(self: IdempotentTask, order: str, sleep: float = 0) -> dict[str, object]:
    """Ends with ``Task.replace``: its caller's result is ``total``'s."""
    REDIS.incr(f"{NS}:started:reorder:{order}")
    return self.replace(total.s(order, sleep))


@app.task(
    bind=True,
    base=IdempotentTask,
    inbox=inbox,
    default_retry_delay=5.0,
    retry_in_flight=0.5,
    idempotency_key=lambda order, **options: f"audit:{order}",
)
def audit(self: IdempotentTask, order: str, sleep: float = 0, fail_times: int = 0) -> str:
    """Notes the ``tenant`` header its producer sent, on every run: a copy oncely sends again
    (a retry, a copy that met a running one) must carry it too. Retried 5 s later, so a copy
    sent again after meeting the running one gets there first."""
    REDIS.rpush(f"{NS}:tenants:{order}", str((self.request.headers or {}).get("tenant")))
    time.sleep(sleep)
    if REDIS.incr(f"{NS}:attempts:audit:{order}") <= fail_times:
        raise RuntimeError(f"the audit log is down (order {order})")
    return order


@app.task(
    base=IdempotentTask,
    inbox=inbox,
    time_limit=2,
    max_retries=1,
    default_retry_delay=0.2,
    retry_in_flight=0.5,
    idempotency_key=lambda order, **options: f"limited:{order}",
)
def limited(order: str, slow_runs: int = 0) -> str:
    """Its first ``slow_runs`` runs outlive the hard time limit (2 s): Celery kills the pool
    process running it."""
    if REDIS.incr(f"{NS}:started:limited:{order}") <= slow_runs:
        time.sleep(30)
    REDIS.incr(f"{NS}:effects:limited:{order}")
    return order


@app.task(
    bind=True,
    base=IdempotentTask,
    inbox=inbox,
    max_retries=3,
    idempotency_key=lambda order: f"capped:{order}",
)
def capped(self: IdempotentTask, order: str) -> None:
    """Retries itself with a limit of its own for this call (1), lower than the task's (3)."""
    REDIS.incr(f"{NS}:started:capped:{order}")
    try:
        raise RuntimeError(f"the ledger is down (order {order})")
    except RuntimeError as exc:
        raise self.retry(exc=exc, max_retries=1, countdown=0.2) from exc


@app.task(
    bind=True,
    base=IdempotentTask,
    inbox=inbox,
    max_retries=3,
    idempotency_key=lambda order: f"hiccup:{order}",
)
def hiccup(self: IdempotentTask, order: str) -> str:
    """Retries itself after its first run; that retry cannot be sent (its ``priority`` is
    not one a message can carry, as a broker that refuses a publish fails it)."""
    if REDIS.incr(f"{NS}:started:hiccup:{order}") == 1:
        raise self.retry(countdown=0.2, priority="urgent")
    REDIS.incr(f"{NS}:effects:hiccup:{order}")
    return order


@app.task(
    base=IdempotentTask,
    inbox=inbox,
    max_retries=1,
    default_retry_delay=0.2,
    retry_in_flight=0.5,
    idempotency_key=lambda order: f"doomed:{order}",
)
def doomed(order: str) -> None:
    """Kills the pool process that runs it, every time (as the kernel's OOM killer would)."""
    REDIS.incr(f"{NS}:started:doomed:{order}")
    os.kill(os.getpid(), signal.SIGKILL)


@app.task(
    base=IdempotentTask,
    inbox=inbox,
    max_retries=2,
    default_retry_delay=0.2,
    retry_in_flight=0.5,
    idempotency_key=lambda order, **options: f"fatal:{order}",
)
def fatal(order: str, deaths: int = 0) -> str:
    """Its first ``deaths`` runs end the whole process at once (``os._exit``): with the solo
    pool, the worker itself, as the OOM killer taking it would."""
    if REDIS.incr(f"{NS}:started:fatal:{order}") <= deaths:
        os._exit(1)
    REDIS.incr(f"{NS}:effects:fatal:{order}")
    return order

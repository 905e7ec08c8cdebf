"""Celery tasks behind ``oncely.integrations.celery.IdempotentTask``, end to end: the real
``celery worker`` (prefork) on the machine's RabbitMQ, the inbox on SQLite and Redis, effects
counted in Redis (R1, R2, R10, R13, R16)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import sqlite3
import subprocess
import time
import uuid
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("celery")
import pika

import oncely
from tests.integrations.workers import (
    Supervisor,
    WorkerRun,
    assert_resends_back_off,
    stopped_at_start,
    store_url,
    until,
)
from tests.services import RABBITMQ_URL, REDIS_URL, require


class Run(WorkerRun):
    framework = "celery"
    app_module = "tests.integrations.celery_app"
    queue_suffixes = ("", ".dead")

    def __init__(
        self, store: str, lease: float = 30.0, broker: str = "", log_keys: str = "plain"
    ) -> None:
        super().__init__(store, lease)
        self.env["ONCELY_TEST_CELERY_LOG_KEYS"] = log_keys
        if broker:
            self.env["ONCELY_TEST_CELERY_BROKER"] = broker
        else:
            os.environ.pop("ONCELY_TEST_CELERY_BROKER", None)
        self.app = self.load_app()
        self.consumers: list[object] = []
        """The ``x-oncely-consumer`` of each dead letter :meth:`dead_letters` took."""

    def worker(
        self,
        concurrency: int = 2,
        log: Path | None = None,
        pool: str = "prefork",
        loglevel: str = "warning",
    ) -> subprocess.Popen[bytes]:
        return self.spawn(
            "celery", "-A", self.app_module, "worker", "-P", pool, "-c", str(concurrency),
            "-Q", self.queue, "--loglevel", loglevel, "--without-mingle", "--without-gossip",
            "-n", f"{self.queue}@%h",  # its own node name: never another run's pidbox queue
            log=log,
        )  # fmt: skip

    def dead_letters(self) -> list[tuple[str, str]]:
        """The dead-letter queue's messages (taken off it): the task's name (or, for a
        message that names none, its body) and the reason of its ``x-oncely-reason``."""
        found = []
        for properties, body in self.taken(".dead"):
            headers = properties.headers or {}
            name = headers.get("task") or body.decode(errors="replace")
            self.consumers.append(headers.get("x-oncely-consumer"))
            found.append((str(name).rsplit(".", 1)[-1], str(headers.get("x-oncely-reason"))))
        return sorted(found)

    def publish_raw(self, body: bytes, headers: dict[str, object] | None = None) -> None:
        """What no Celery client would send: straight onto the queue with pika."""
        properties = pika.BasicProperties(content_type="application/json", headers=headers)
        with self.channel() as channel:
            channel.basic_publish("", self.queue, body, properties)


@pytest.fixture(params=["sqlite", "redis"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    yield from store_url(request, tmp_path, "oncely_cqi")


@pytest.mark.timeout(120)
def test_a_worker_whose_store_is_down_stops_before_taking_a_message(tmp_path: Path) -> None:
    # Before, it started, looked healthy, and sent every task again every second until the
    # store answered, each one closer to its max_retries for nothing.
    stopped_at_start(
        Run,
        lambda run: run.app.charge.delay("u1", 10),
        lambda run, log: run.worker(log=log),
        tmp_path / "worker.log",
    )


@pytest.mark.timeout(120)
def test_a_worker_whose_tables_cannot_be_used_stops_with_exit_code_4(tmp_path: Path) -> None:
    require("RabbitMQ", RABBITMQ_URL, 5672)
    db = tmp_path / "inbox.db"
    oncely.open(f"sqlite:///{db}").migrate()  # then written by a newer oncely
    with contextlib.closing(sqlite3.connect(db)) as conn, conn:
        conn.execute("UPDATE oncely_inbox_meta SET value = '99' WHERE name = 'schema_version'")
    run = Run(f"sqlite:///{db}")
    try:
        run.app.charge.delay("u1", 10)
        worker = run.worker(log=tmp_path / "worker.log")
        assert worker.wait(60) == 4
        said = (tmp_path / "worker.log").read_text()
        assert "its tables cannot be used" in said and "schema version 99" in said, said
        assert run.started("u1") == 0 and run.waiting() == 1
    finally:
        run.close()


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
        # After its retries a message is dead-lettered as rejected, as every consumer says it.
        assert reasons[2].startswith("rejected: failed on all"), reasons[2]
        run.publish_raw(b"\xff{ not JSON")  # Celery alone acks it: gone without a trace
        lost = str(uuid.uuid4())
        run.publish_raw(b"[[], {}, {}]", headers={"task": "billing.gone", "id": lost})
        with pytest.raises(DeadLettered, match=r"no task 'billing\.gone'"):
            app.app.AsyncResult(lost).get(timeout=60)
        after = app.charge.delay("o6", 10)  # the worker still works after all that
        assert after.get(timeout=60) == {"order": "o6", "amount": 10}
        until(lambda: run.effects("mail:o1") == 1, client=run.redis, ns=run.ns)
        time.sleep(1.0)
        assert run.effects("o1") == 1 and run.effects("o3") == 1 and run.effects("mail:o1") == 1
        assert run.started("o3") == 3 and run.started("o4") == 3
        letters = run.dead_letters()
        names = [name for name, _ in letters]
        assert names == ["charge", "charge", "charge", "gone", "notify", "\ufffd{ not JSON"]
        reasons = dict(letters)
        assert "could not decode" in reasons["\ufffd{ not JSON"]
        assert "no task 'billing.gone'" in reasons["gone"]
        # Every dead letter names the inbox's consumer, the two Celery could not read
        # included (they named none: an empty x-oncely-consumer).
        assert run.consumers == ["billing"] * 6
    finally:
        run.close()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("killed", ["the worker", "its pool process"])
def test_r10_a_worker_killed_mid_task_is_redelivered_and_applied_once(
    store: str, killed: str
) -> None:
    """``SIGKILL`` mid-task, with a 2 s lease. The whole worker (every process): RabbitMQ
    gives the message to the next worker. Only the pool process running the task: the
    worker's main process sees it lost and gives the message back (``reject_on_worker_lost``).
    Either way the next copy meets the dead run's live lease, is sent again, and takes over
    once it lapses: one effect, two runs."""
    run = Run(store, lease=2.0)
    try:
        result = run.app.charge.delay("k1", 10, sleep=4.0)
        first = run.worker(concurrency=1 if killed == "the worker" else 2)
        until(lambda: run.started("k1") == 1, client=run.redis, ns=run.ns)
        if killed == "the worker":
            os.killpg(first.pid, signal.SIGKILL)
            first.wait(10)
            run.worker(concurrency=1)
        else:
            os.kill(int(run.redis.get(f"{run.ns}:pid:k1") or 0), signal.SIGKILL)
        assert result.get(timeout=90) == {"order": "k1", "amount": 10}
        time.sleep(2.0)
        assert run.effects("k1") == 1 and run.started("k1") == 2
    finally:
        run.close()


@pytest.mark.timeout(180)
def test_r10_a_task_its_hard_time_limit_stopped_is_retried_then_dead_lettered(store: str) -> None:
    """``time_limit=2``: Celery kills the pool process and records ``TimeLimitExceeded``.
    Before, it also acknowledged the message: the task was never run again nor dead-lettered,
    its key left in progress, and the caller got ``TimeLimitExceeded`` for work that a retry
    would have done. Now the stopped run is one of its deliveries: sent again as a retry
    (which takes the killed run's claim over once its 2 s lease lapses), and dead-lettered
    with the reason once ``max_retries`` (1) is spent."""
    from oncely.integrations.celery import DeadLettered

    run = Run(store, lease=2.0)
    try:
        app = run.app
        run.worker()
        once = app.limited.delay("t1", slow_runs=1)
        never = app.limited.delay("t2", slow_runs=99)
        assert once.get(timeout=90) == "t1"
        with pytest.raises(DeadLettered, match=r"failed on all 2 deliveries; last: the hard"):
            never.get(timeout=90)
        assert run.effects("limited:t1") == 1 and run.started("limited:t1") == 2
        assert run.effects("limited:t2") == 0 and run.started("limited:t2") == 2
        [(name, reason)] = run.dead_letters()
        assert name == "limited" and "time limit (2" in reason
    finally:
        run.close()


@pytest.mark.timeout(180)
def test_a_retry_limit_given_to_self_retry_is_the_one_kept(store: str) -> None:
    """``self.retry(exc=exc, max_retries=1)`` in a task whose own ``max_retries`` is 3:
    Celery gives up after one retry and raises ``exc``. Before, oncely took that for a
    failure of its own and retried it up to the task's limit: four runs where the task
    asked for two. Now the delivery Celery gave up on is dead-lettered."""
    from oncely.integrations.celery import DeadLettered

    run = Run(store)
    try:
        run.worker()
        with pytest.raises(DeadLettered, match="failed on all 2 deliveries"):
            run.app.capped.delay("c1").get(timeout=60)
        time.sleep(1.0)  # a retry sent after the dead letter would have started by now
        assert run.started("capped:c1") == 2
        assert [name for name, _ in run.dead_letters()] == ["capped"]
    finally:
        run.close()


@pytest.mark.timeout(180)
def test_r10_a_retry_that_cannot_be_sent_keeps_the_message_and_never_poisons_its_key(
    store: str,
) -> None:
    """A task's own ``self.retry()`` whose copy cannot be sent: Celery turns that into
    ``Reject(requeue=False)``. Before, oncely took it for the task rejecting its message:
    the key was marked rejected for good and the message dead-lettered, so the retry and
    every later copy of the order were refused. Now the message is given back to the broker
    and the key released: the redelivery runs it."""
    run = Run(store)
    try:
        run.worker()
        assert run.app.hiccup.delay("h1").get(timeout=60) == "h1"
        assert run.effects("hiccup:h1") == 1 and run.started("hiccup:h1") == 2
        assert run.dead_letters() == []
    finally:
        run.close()


@pytest.mark.timeout(180)
def test_r10_a_task_that_kills_its_pool_process_every_time_is_dead_lettered(store: str) -> None:
    """``doomed`` kills the pool process running it on every run. Before, the worker gave
    the message back to RabbitMQ each time (``reject_on_worker_lost``), the copy took the
    dead run's claim over once its lease lapsed and killed the next process: a loop that
    never ended, never reached ``max_retries`` nor ``<queue>.dead``. Now a lost run is one
    of the task's deliveries: sent again as a retry, then dead-lettered once ``max_retries``
    (1) is spent, with the reason."""
    from oncely.integrations.celery import DeadLettered

    run = Run(store, lease=2.0)
    try:
        run.worker()
        with pytest.raises(DeadLettered, match="failed on all 2 deliveries; last: the pool"):
            run.app.doomed.delay("d1").get(timeout=60)
        time.sleep(3.0)  # past the last run's lease: a copy given back would run by now
        assert run.started("doomed:d1") == 2
        [(name, reason)] = run.dead_letters()
        assert name == "doomed" and "was lost" in reason
    finally:
        run.close()


@pytest.mark.timeout(180)
def test_r8_r10_the_redis_brokers_visibility_timeout_redelivery_is_not_run_twice(
    store: str,
) -> None:
    """Celery's Redis broker hands a task not acknowledged within its visibility timeout
    (3 s here) to a worker again while the first run still goes on (10 s): each such copy
    meets the live claim (in flight), is sent again later instead of running, and ends as a
    duplicate once the first run completes: one effect, one run."""
    run = Run(store, broker=REDIS_URL)
    try:
        result = run.app.charge.delay("v1", 10, sleep=10.0)
        run.worker(concurrency=2)
        assert result.get(timeout=90) == {"order": "v1", "amount": 10}
        time.sleep(5.0)  # copies restored meanwhile arrive, and find it done
        assert run.effects("v1") == 1 and run.started("v1") == 1
    finally:
        run.close()


@pytest.mark.timeout(240)
def test_r8_on_the_redis_broker_copies_sent_again_never_multiply(tmp_path: Path) -> None:
    """Celery's Redis broker, a 3 s visibility timeout, a task running 20 s: the copy Redis
    hands out again while it runs meets the live claim and is sent again later. A worker
    takes a message with a countdown at once and holds it unacknowledged until it is due,
    and Redis hands out again one held longer than the visibility timeout. Before, the copy
    was sent again after 1, 2, 4, 8, 16 s: each wait past 3 s came back as several copies,
    each sent again in turn, so they multiplied (33 copies here), each ending as a
    duplicate. Now every wait oncely chooses stays under half the visibility
    timeout: one copy, one duplicate. A worker whose tasks retry after a wait longer than
    the visibility timeout says so at start, naming both."""
    require("Redis", REDIS_URL, 6379)
    run = Run(f"sqlite:///{tmp_path / 'inbox.db'}", broker=REDIS_URL)
    log = tmp_path / "worker.log"
    held = f"{run.ns}:kombu:unacked"  # the broker's held messages (global_keyprefix)
    try:
        run.worker(concurrency=2, log=log, loglevel="info")
        result = run.app.charge.delay("m1", 10, sleep=20.0)
        assert result.get(timeout=120) == {"order": "m1", "amount": 10}

        def settled() -> bool:  # no copy held, none waiting, twice a restore sweep apart
            for _ in range(2):
                if run.redis.hlen(held) or run.redis.llen(f"{run.ns}:kombu:{run.queue}"):
                    return False
                time.sleep(1.5)
            return run.outcomes("charge:m1", "duplicate") >= 1

        run.until(settled, seconds=120)
        # Each copy ends as one duplicate once the run completed: how many copies there were.
        assert run.outcomes("charge:m1", "duplicate") == 1
        assert run.effects("m1") == 1 and run.started("m1") == 1
        said = log.read_text(errors="replace")
        again = r"processed elsewhere; sent again in ([\d.]+) s"
        waits = [float(wait) for wait in re.findall(again, said)]
        assert waits and max(waits) <= 1.5, waits
        assert (
            "notify waits up to 180 s before a retry (default_retry_delay), but the Redis "
            "broker's visibility_timeout is 3 s" in said
        ), said
        assert "charge waits" not in said, said
    finally:
        run.close()


@pytest.mark.timeout(180)
def test_r1_a_duplicate_gets_the_first_result_as_the_task_returned_it_or_fails_loudly(
    store: str,
) -> None:
    """Before, a duplicate's AsyncResult.get() gave the stored form (a datetime as its ISO
    string) where the first gave a datetime, and None for a result over the inbox's limit;
    now the value is rebuilt as the task's return annotation, and a result that was not kept
    fails the duplicate with ResultUnavailable. Celery's autoretry_for limit
    (retry_kwargs max_retries=1) is the one kept: two runs, then dead-lettered (before,
    four: the task's own max_retries was applied after Celery gave up)."""
    from oncely.integrations.celery import DeadLettered

    run = Run(store)
    try:
        app = run.app
        run.worker()
        first = app.quote.delay("q1").get(timeout=60)
        again = app.quote.delay("q1").get(timeout=60)
        assert first == again and isinstance(again["at"], datetime)
        assert app.big.delay("b1").get(timeout=60) == "x" * 300_000
        with pytest.raises(Exception, match="not there to return") as lost:
            app.big.delay("b1").get(timeout=60)
        assert "ResultUnavailable" in type(lost.value).__name__ + repr(lost.value)
        assert run.effects("quote:q1") == 1 and run.effects("big:b1") == 1
        with pytest.raises(DeadLettered, match="failed on all 2 deliveries"):
            app.flaky.delay("f1").get(timeout=60)
        assert run.started("flaky:f1") == 2
    finally:
        run.close()


@pytest.mark.timeout(120)
def test_a_task_that_acknowledges_early_stops_the_worker_at_start(tmp_path: Path) -> None:
    """``acks_late=False`` on an IdempotentTask: a message acknowledged before its task ends
    is lost in a crash, its key left in progress. Before, it was accepted without a word."""
    require("RabbitMQ", RABBITMQ_URL, 5672)
    run = Run(f"sqlite:///{tmp_path / 'inbox.db'}")
    run.env["ONCELY_TEST_CELERY_EARLY_ACK"] = "1"
    try:
        worker = run.worker(log=tmp_path / "worker.log")
        assert worker.wait(60) == 2
        said = (tmp_path / "worker.log").read_text()
        assert "acks_late=False" in said and "early" in said, said
    finally:
        run.close()


@pytest.mark.timeout(180)
def test_r1_a_duplicate_of_a_task_that_replaced_itself_never_answers_none(store: str) -> None:
    """``reorder`` ends with ``self.replace(total.s(order))``: Celery sends ``total`` under
    ``reorder``'s task id and ignores ``reorder``, so its caller gets ``total``'s result.
    Before, the inbox recorded ``None`` as ``reorder``'s result: a duplicate answered
    ``None``, and one sent under the same task id (``send_with_key``) while ``total`` still
    ran stored that ``None`` first, so the first caller got ``None`` too. Now a duplicate
    under another task id fails with ``ResultUnavailable`` naming the id that answers, and
    one under the same id leaves that id to ``total``."""
    from oncely.integrations.celery import send_with_key

    run = Run(store)
    try:
        app = run.app
        run.worker()
        first = app.reorder.delay("r1")
        assert first.get(timeout=60) == {"order": "r1", "total": 42}
        with pytest.raises(Exception, match="replaced itself") as lost:
            app.reorder.delay("r1").get(timeout=60)
        assert "ResultUnavailable" in type(lost.value).__name__ + repr(lost.value)
        assert f"AsyncResult('{first.id}')" in str(lost.value)

        # send_with_key's task id is the key's: one of its own, so no result of another run
        # of this test answers for it.
        order = f"r2-{run.ns}"

        def seen(outcome: str) -> int:
            return run.outcomes(f"reorder:{order}", outcome)

        def send() -> Any:
            key = f"reorder:{order}"
            return send_with_key(app.reorder, key, args=(order,), kwargs={"sleep": 3.0})

        keyed = send()
        run.until(lambda: seen("processed") == 1)  # replaced: total sleeps 3 s
        again = send()
        run.until(lambda: seen("duplicate") == 1)
        assert again.id == keyed.id and run.effects(f"total:{order}") == 0
        assert keyed.get(timeout=60) == again.get(timeout=60) == {"order": order, "total": 42}
        assert run.started("reorder:r1") == 1 and run.effects("total:r1") == 1
        assert run.started(f"reorder:{order}") == 1 and run.effects(f"total:{order}") == 1
    finally:
        run.close()


@pytest.mark.timeout(180)
def test_a_copy_oncely_sends_again_keeps_the_producers_custom_headers(store: str) -> None:
    """A task sent with ``apply_async(headers={"tenant": ...})`` that fails once (oncely's
    retry), or whose copy meets the first still running (sent again ``retry_in_flight``
    later), and a task sent with ``send_with_key`` and a header of its own: every run sees
    the header. Before, the copies oncely sent again had only oncely's key header."""
    from oncely.integrations.celery import send_with_key

    run = Run(store)
    tenant = {"tenant": "acme"}
    try:
        app = run.app
        run.worker()
        retried = app.audit.apply_async(("h1",), {"fail_times": 1}, headers=tenant)
        keyed = send_with_key(  # a key of this run's own: its task id is the key's
            app.audit, f"audit:{run.ns}", args=(run.ns,), kwargs={"fail_times": 1}, headers=tenant
        )
        busy = [
            app.audit.apply_async(("h2",), {"sleep": 2.0, "fail_times": 1}, headers=tenant)
            for _ in range(2)
        ]
        assert retried.get(timeout=60) == "h1" and keyed.get(timeout=60) == run.ns
        assert [result.get(timeout=60) for result in busy] == ["h2", "h2"]
        orders = ("h1", "h2", run.ns)
        seen = {
            order: [t.decode() for t in run.redis.lrange(f"{run.ns}:tenants:{order}", 0, -1)]
            for order in orders
        }
        assert seen == {order: ["acme", "acme"] for order in orders}
    finally:
        run.close()


@pytest.mark.timeout(300)
def test_r10_a_task_that_kills_the_whole_worker_every_time_is_dead_lettered(store: str) -> None:
    """``fatal`` ends the whole worker (the solo pool: ``os._exit``, as the OOM killer taking
    the worker would) on every run, a supervisor starting the worker again each time. Celery
    sees no failure: RabbitMQ gives the message to the next worker, which died again, for
    ever. Now the runs are counted by the inbox (each copy takes the dead run's claim over
    once its 2 s lease lapsed, one attempt higher): after ``max_retries`` + 1 (3) runs that
    never finished, the message is dead-lettered with that reason instead of run again, and
    the worker stays up. A task that dies once runs again and succeeds."""
    from oncely.integrations.celery import DeadLettered

    run = Run(store, lease=2.0)
    try:
        app = run.app
        with Supervisor(lambda: run.worker(concurrency=1, pool="solo")) as supervisor:
            doomed = app.fatal.delay("w1", deaths=99)
            with pytest.raises(DeadLettered, match="failed on all 3 deliveries; last: none of"):
                doomed.get(timeout=120)
            assert run.started("fatal:w1") == 3 and run.effects("fatal:w1") == 0
            survivor, starts = supervisor.current, supervisor.starts
            assert app.charge.delay("w0", 10).get(timeout=60) == {"order": "w0", "amount": 10}
            assert supervisor.current is survivor and supervisor.starts == starts
            assert survivor is not None and survivor.poll() is None
            [(name, reason)] = run.dead_letters()
            assert name == "fatal" and "none of its 3 runs finished (the worker" in reason

            assert app.fatal.delay("w2", deaths=1).get(timeout=120) == "w2"
            assert run.started("fatal:w2") == 2 and run.effects("fatal:w2") == 1
            assert supervisor.starts == starts + 1
        assert run.dead_letters() == []
    finally:
        run.close()


@pytest.mark.timeout(180)
def test_r8_a_copy_that_meets_its_key_running_is_sent_again_less_and_less_often(
    store: str, tmp_path: Path
) -> None:
    """A copy of ``charge`` (``retry_in_flight=1``) meets the first still running (12 s).
    Before, it was sent again every second: a dozen resends here, 1,800 for an hour-long
    task. Now each wait is twice the last (1, 2, 4, 8 s: four resends while the first ran),
    up to what is left of the running claim's lease; the copy still ends as the duplicate
    of the one run, with its result."""
    run = Run(store)
    log = tmp_path / "worker.log"
    try:
        app = run.app
        run.worker(concurrency=2, log=log, loglevel="info")
        first = app.charge.delay("s1", 10, sleep=12.0)
        run.until(lambda: run.started("s1") == 1)
        copy = app.charge.delay("s1", 10, sleep=12.0)
        done = {"order": "s1", "amount": 10}
        assert first.get(timeout=90) == done and copy.get(timeout=90) == done
        run.until(lambda: run.outcomes("charge:s1", "duplicate") == 1)
        assert_resends_back_off(log, "charge:s1", run.outcomes("charge:s1", "in_flight"))
        assert run.effects("s1") == 1 and run.started("s1") == 1
    finally:
        run.close()


@pytest.mark.timeout(120)
def test_r16_with_log_keys_hash_no_line_of_the_worker_says_a_key(tmp_path: Path) -> None:
    """An inbox made with ``log_keys="hash"`` (keys that are personal data): the worker's
    lines and the errors it records show each key as the inbox shows it, its digest, on every
    path that names one (a copy met running and sent again, a duplicate, a failure retried, a
    rejection dead-lettered, a duplicate whose first result was not kept). Before, the
    task's own lines and errors said the key itself."""
    from oncely._core.observe import key_for_logs

    require("RabbitMQ", RABBITMQ_URL, 5672)
    require("Redis", REDIS_URL, 6379)
    run = Run(f"sqlite:///{tmp_path / 'inbox.db'}", log_keys="hash")
    log = tmp_path / "worker.log"
    try:
        app = run.app
        run.worker(concurrency=2, log=log, loglevel="info")
        first = app.charge.delay("h1", 10, sleep=3.0)
        run.until(lambda: run.started("h1") == 1)
        copy = app.charge.delay("h1", 10, sleep=3.0)  # met running, sent again: a duplicate
        assert app.charge.delay("h2", 10, fail_times=1).get(timeout=60)  # fails, retried
        with pytest.raises(Exception, match="not billable"):
            app.charge.delay("h3", 10, reject=True).get(timeout=60)  # dead-lettered
        assert first.get(timeout=60) == copy.get(timeout=60)
        assert app.big.delay("b1").get(timeout=60) == "x" * 300_000
        with pytest.raises(Exception, match="not there to return") as lost:
            app.big.delay("b1").get(timeout=60)
        run.until(lambda: run.outcomes("charge:h1", "duplicate") == 1)
        time.sleep(0.5)  # the worker's last lines reach its log
        said = log.read_text(errors="replace") + str(lost.value)
        for key in ("charge:h1", "charge:h2", "charge:h3", "big:b1"):
            assert key not in said, said
            assert key_for_logs(key, "hash") in said, (key, said)
        assert f"key {key_for_logs('charge:h1', 'hash')} is being processed elsewhere" in said
    finally:
        run.close()

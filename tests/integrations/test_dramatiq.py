"""Dramatiq actors behind ``oncely.integrations.dramatiq.Idempotency``, end to end: the real
``dramatiq`` worker command (worker processes with threads) on the machine's RabbitMQ, the
inbox on SQLite and Redis, effects counted in Redis. Duplicates, a reused key, keyless and
undecodable messages, failures that recover and failures that do not, a rejection, and a
worker ``SIGKILL``ed mid-task (R1, R2, R10, R13, R16)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("dramatiq")

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
    """One scenario's queue, inbox and effects, and the app module configured for them."""

    framework = "dramatiq"
    app_module = "tests.integrations.dramatiq_app"
    queue_suffixes = ("", ".DQ", ".XQ")

    def __init__(
        self,
        store: str,
        lease: float = 30.0,
        *,
        on_stale: str = "retry",
        broker: str = "rabbitmq",
        log_keys: str = "plain",
    ) -> None:
        super().__init__(store, lease)
        self.env["ONCELY_TEST_DRAMATIQ_ON_STALE"] = on_stale
        self.env["ONCELY_TEST_DRAMATIQ_BROKER"] = broker
        self.env["ONCELY_TEST_DRAMATIQ_LOG_KEYS"] = log_keys
        self.app = self.load_app()

    def worker(
        self, processes: int = 2, threads: int = 2, log: Path | None = None
    ) -> subprocess.Popen[bytes]:
        return self.spawn(
            "dramatiq", self.app_module, "--processes", str(processes),
            "--threads", str(threads), "--queues", self.queue, log=log,
        )  # fmt: skip

    def dead_letters(self) -> list[dict[str, Any]]:
        """The dead-letter queue's messages (taken off it), decoded where they decode."""
        found: list[dict[str, Any]] = []
        for properties, body in self.taken(".XQ"):
            try:
                found.append(json.loads(body))
            except ValueError:
                found.append({"undecodable": body})
            found[-1]["amqp_headers"] = dict(properties.headers or {})
        return found

    def dead_lettered(self, count: int) -> list[dict[str, Any]]:
        """The dead-letter queue's messages once ``count`` arrived (taken off it), and any that
        arrive a moment later (a second letter of one message would)."""
        found: list[dict[str, Any]] = []

        def arrived() -> bool:
            found.extend(self.dead_letters())
            return len(found) >= count

        self.until(arrived)
        time.sleep(0.5)
        return found + self.dead_letters()

    def send_rejected(self, order: str) -> Any:
        """Send ``charge`` for ``order``, refused by the actor (``oncely.Reject``), its result
        stored for the caller."""
        return self.app.charge.send_with_options(
            args=(order, 10), kwargs={"reject": True}, store_results=True
        )

    def redis_dead_letters(self) -> int:
        """How many messages the Redis broker holds dead-lettered for this run's queue."""
        return int(self.redis.zcard(f"{self.ns}:broker:{self.queue}.XQ"))

    def publish_raw(self, body: bytes) -> None:
        with self.channel() as channel:
            channel.basic_publish(exchange="", routing_key=self.queue, body=body)

    def close(self) -> None:
        super().close()
        self.app.broker.close()


def _result(message: Any, seconds: float = 60) -> Any:
    """What the caller of ``message`` reads from the Results middleware, waited for a second
    at a time (redis-py's default socket timeout, 5 s, cuts a longer blocking read)."""
    from dramatiq.results import ResultTimeout

    deadline = time.monotonic() + seconds
    while True:
        try:
            return message.get_result(block=True, timeout=1_000)
        except ResultTimeout:
            if time.monotonic() > deadline:
                raise


def _failure(message: Any) -> Any:
    """The ``ResultFailure`` the caller of ``message`` reads (the test fails if it reads a
    value instead)."""
    from dramatiq.results import ResultFailure

    with pytest.raises(ResultFailure) as failed:
        _result(message)
    return failed.value


def _until(check: Callable[[], bool], seconds: float = 60, run: Run | None = None) -> None:
    until(check, seconds, None if run is None else run.redis, "" if run is None else run.ns)


@pytest.fixture(params=["sqlite", "redis"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    yield from store_url(request, tmp_path, "oncely_dqi")


@pytest.mark.timeout(120)
def test_a_worker_whose_store_is_down_stops_before_taking_a_message(tmp_path: Path) -> None:
    # Before, each worker process started and sent every message again every second until
    # the store answered.
    stopped_at_start(
        Run,
        lambda run: run.app.charge.send("u1", 10),
        lambda run, log: run.worker(processes=2, log=log),
        tmp_path / "worker.log",
    )


@pytest.mark.timeout(180)
def test_r1_r2_r16_each_effect_once_and_every_refusal_dead_lettered_with_its_reason(
    store: str,
) -> None:
    from oncely.integrations.dramatiq import send_with_key

    run = Run(store)
    try:
        app = run.app
        for _ in range(3):
            app.charge.send("o1", 10)  # a producer's retries: one logical message
        app.charge.send("o2", 10)
        for _ in range(2):
            send_with_key(app.notify, "mail:o1", "o1")  # the producer names the key
        app.charge.send("o3", 10, fail_times=2)  # fails twice, then succeeds
        app.plain.send("p1")
        run.worker()
        _until(
            lambda: run.effects("o1") == 1 and run.effects("o2") == 1 and run.effects("o3") == 1,
            run=run,
        )
        app.charge.send("o2", 99)  # the key again, with other arguments
        app.notify.send("o9")  # no key: the producer gave none
        app.charge.send("o4", 10, fail_times=99)  # never succeeds
        app.charge.send("o5", 10, reject=True)  # the actor refuses it
        run.publish_raw(b"\xff this is not a Dramatiq message")
        app.plain.send("p2")  # the worker still works after all that
        found: list[dict[str, Any]] = []

        def drained() -> bool:
            found.extend(run.dead_letters())
            return len(found) >= 5 and run.effects("plain:p2") == 1

        _until(drained)
        time.sleep(1.0)  # anything that would still arrive (a second dead letter of one)
        found.extend(run.dead_letters())
        assert run.effects("o1") == 1 and run.effects("o2") == 1 and run.effects("o3") == 1
        assert run.effects("mail:o1") == 1 and run.effects("mail:o9") == 0
        assert run.effects("o4") == 0 and run.effects("o5") == 0
        assert run.effects("plain:p1") == 1
        reasons = {
            (m.get("actor_name"), tuple(m.get("args", ()))): m.get("options", {}).get(
                "oncely_reason"
            )
            for m in found
            if "undecodable" not in m
        }
        conflict = str(reasons[("charge", ("o2", 99))]).lower()
        assert "fingerprint" in conflict or "conflict" in conflict or "payload" in conflict
        assert "no idempotency key" in str(reasons[("notify", ("o9",))])
        assert "not billable" in str(reasons[("charge", ("o5", 10))])
        assert ("charge", ("o4", 10)) in reasons  # retries exhausted: Dramatiq's own dead letter
        # oncely's own copies carry the x-oncely-* headers of every oncely dead letter, the
        # inbox's consumer named (they carried none).
        ours = [m for m in found if m.get("options", {}).get("oncely_reason")]
        assert len(ours) == 3
        for letter in ours:
            headers = letter["amqp_headers"]
            assert headers["x-oncely-consumer"] == "billing", headers
            assert headers["x-oncely-reason"] == letter["options"]["oncely_reason"]
            assert headers["x-oncely-outcome"] in ("key_conflict", "rejected")
        assert sum("undecodable" in m for m in found) == 1
        assert len(found) == 5, found
        assert run.started("o3") == 3  # two failures and the success, no more
    finally:
        run.close()


@pytest.mark.timeout(180)
def test_r10_a_worker_killed_mid_task_is_redelivered_and_applied_once(store: str) -> None:
    """The worker is ``SIGKILL``ed while the actor sleeps before its effect: RabbitMQ gives
    the message to the next worker, whose copy meets the dead worker's live lease (retried
    later, not dropped) and takes the claim over once the lease lapses: one effect."""
    run = Run(store, lease=2.0)
    try:
        run.app.charge.send("k1", 10, sleep=4.0)
        first = run.worker(processes=1, threads=1)
        _until(lambda: run.started("k1") == 1)
        os.killpg(first.pid, signal.SIGKILL)
        first.wait(10)
        run.worker(processes=1, threads=1)
        _until(lambda: run.effects("k1") == 1, seconds=90)
        time.sleep(2.0)
        assert run.effects("k1") == 1
        assert run.started("k1") == 2  # the killed run and the one that took over
        assert run.dead_letters() == []
    finally:
        run.close()


@pytest.mark.timeout(120)
def test_r10_an_actor_that_returned_in_time_is_never_stopped_while_its_claim_completes(
    tmp_path: Path,
) -> None:
    """``overtime`` (``time_limit=1000``) does its effect and returns in time, but another
    writer holds the SQLite inbox for 2.5 s, so the claim completes after the limit passed.
    Before, Dramatiq's TimeLimit (still armed while the middlewares after the actor run)
    raised ``TimeLimitExceeded`` into the completion: the claim was left in progress, the
    Retries middleware sent the message again, and that copy took the lapsed claim over and
    ran the actor a second time. Now the time limit ends with the actor: one run, one
    effect."""
    require("RabbitMQ", RABBITMQ_URL, 5672)
    require("Redis", REDIS_URL, 6379)
    run = Run(f"sqlite:///{tmp_path / 'inbox.db'}", lease=2.0)
    try:
        run.app.overtime.send("t1")
        run.worker(processes=1, threads=1)
        _until(lambda: run.started("overtime:t1") == 1, run=run)
        time.sleep(9.0)  # lock, time limit, lapsed lease, retries: all would be over by now
        assert run.effects("overtime:t1") == 1 and run.started("overtime:t1") == 1
    finally:
        run.close()


@pytest.mark.timeout(120)
def test_r10_two_copies_of_one_message_at_once_never_end_each_others_claim(store: str) -> None:
    """One message enqueued twice with the same ``message_id`` (a redelivery beside a run
    still going) reaches two threads of one worker: the second copy meets the first's claim
    and is sent again later, and must not release the first's claim as it goes (it would then
    run again): one effect, and the first run's completion stands."""
    run = Run(store)
    try:
        message = run.app.charge.message("twin", 10, sleep=2.0)
        run.app.broker.enqueue(message)
        run.app.broker.enqueue(message)
        run.worker(processes=1, threads=2)
        _until(lambda: run.effects("twin") == 1, run=run)
        time.sleep(4.0)  # the second copy, sent again, arrives and is a duplicate
        assert run.effects("twin") == 1
        assert run.started("twin") == 1
    finally:
        run.close()


@pytest.mark.timeout(120)
def test_r1_a_duplicate_answers_with_the_first_result_and_a_pipeline_goes_on(store: str) -> None:
    """A second send of one key (a new message id) is not run, and its caller reads the
    first result; a pipeline whose first stage is a duplicate goes on to the next stage
    with that result. Before, a duplicate was skipped: the Results middleware stored None
    for it, and the pipeline's next stage was never sent."""
    import dramatiq

    run = Run(store)
    try:
        run.worker(processes=1, threads=2)
        first = run.app.price.send("p1")
        assert _result(first) == {"order": "p1", "total": 42}
        again = run.app.price.send("p1")
        assert _result(again) == {"order": "p1", "total": 42}
        dramatiq.pipeline([run.app.price.message("p1"), run.app.record.message()]).run()
        _until(lambda: run.effects("record:p1") == 1, run=run)
        assert run.effects("price:p1") == 1
    finally:
        run.close()


@pytest.mark.timeout(120)
def test_r10_a_copy_sent_again_stores_no_result_for_its_caller(store: str) -> None:
    """Two copies of one message at once: the second meets the first's claim and is sent
    again. Before, the Results middleware stored None under the message's id for that
    skipped copy, and the caller read None while the work had not run; now the caller reads
    the result once the one run is done."""
    run = Run(store)
    try:
        message = run.app.price.message("p2", sleep=3.0)
        run.app.broker.enqueue(message)
        run.app.broker.enqueue(message)
        run.worker(processes=1, threads=2)
        got = _result(message)
        assert run.effects("price:p2") == 1  # read when the work was done, not before
        assert got == {"order": "p2", "total": 42}
    finally:
        run.close()


@pytest.mark.timeout(120)
def test_a_duplicate_whose_first_result_was_not_kept_tells_its_caller_so(store: str) -> None:
    """The first result was over the inbox's ``max_result_bytes``: a duplicate cannot answer
    with it, and is not run again. Before, its caller read None from the Results middleware
    (a skipped message's result), a success it would take for the result; now it reads a
    ``ResultFailure`` of ``ResultUnavailable`` saying why."""
    run = Run(store)
    try:
        run.worker(processes=1, threads=2)
        assert len(_result(run.app.bulky.send("b1"))) == 300 * 1024
        failure = _failure(run.app.bulky.send("b1"))
        assert failure.orig_exc_type == "ResultUnavailable", failure
        assert "ran for 'bulky:b1' before" in failure.orig_exc_msg, failure
        assert "not there to return" in failure.orig_exc_msg, failure
        assert run.effects("bulky:b1") == 1
        assert run.dead_letters() == []  # a duplicate: acknowledged, never a dead letter
    finally:
        run.close()


@pytest.mark.timeout(120)
def test_a_message_refused_before_it_ran_answers_its_caller_with_the_reason(store: str) -> None:
    """A message oncely dead-letters before the actor runs (its key reused for other
    arguments, no key, a key the arguments cannot give) answers a caller who waits for its
    result with a ``ResultFailure`` naming oncely's reason, as an actor that failed for good
    does. Before, the dead letter was a skipped message to the Results middleware, which
    stored None for it: the caller read a success for work that never ran."""
    run = Run(store)
    try:
        app = run.app
        run.worker(processes=1, threads=2)
        assert _result(app.price.send("c1")) == {"order": "c1", "total": 42}
        reused = app.price.send("c1", 0.01)  # the key again, with other arguments
        keyless = app.notify.send_with_options(args=("n1",), store_results=True)
        unreadable = app.charge.send_with_options(args=("u1",), store_results=True)  # no amount
        for message, why in (
            (reused, "key_conflict: key reused for different content"),
            (keyless, "rejected: no idempotency key"),
            (unreadable, "rejected: the key could not be read"),
        ):
            failure = _failure(message)
            assert failure.orig_exc_type == "DeadLettered", failure
            assert failure.orig_exc_msg.startswith(why), failure
            assert f"the message is in {run.queue}.XQ" in failure.orig_exc_msg, failure
        assert run.effects("price:c1") == 1 and run.started("price:c1") == 1
        assert run.effects("mail:n1") == 0 and run.started("u1") == 0
        assert len(run.dead_lettered(3)) == 3  # still dead-lettered, each once
    finally:
        run.close()


@pytest.mark.timeout(120)
def test_a_rejected_message_and_its_duplicates_answer_their_callers_with_the_rejection(
    store: str,
) -> None:
    """The actor raises ``oncely.Reject``: the retry Dramatiq sends meets the mark and is
    dead-lettered, and its caller reads a ``ResultFailure`` with the rejection's reason; a
    later send of the same key (a duplicate of a rejected message) is dead-lettered without
    running and answers its caller with the same failure. Before, both callers read None. An
    actor whose retries run out keeps Dramatiq's own answer: its last exception."""
    run = Run(store)
    try:
        app = run.app
        run.worker(processes=1, threads=2)
        first = _failure(run.send_rejected("r1"))
        assert first.orig_exc_type == "DeadLettered", first
        assert first.orig_exc_msg.startswith("rejected: "), first
        assert "order r1 is not billable" in first.orig_exc_msg, first
        again = _failure(run.send_rejected("r1"))
        assert str(again) == str(first)
        assert run.started("r1") == 1  # the first attempt only: no retry or duplicate ran it
        down = app.charge.send_with_options(
            args=("f1", 10), kwargs={"fail_times": 99}, store_results=True
        )
        failure = _failure(down)
        assert failure.orig_exc_type == "RuntimeError", failure
        assert "the ledger is down" in failure.orig_exc_msg, failure
        assert run.effects("r1") == 0 and run.effects("f1") == 0
    finally:
        run.close()


@pytest.mark.timeout(180)
def test_an_escalated_stale_claim_answers_its_caller_with_the_reason(store: str) -> None:
    """With ``on_stale="escalate"``, the worker is ``SIGKILL``ed mid-task and the redelivery
    meets the dead worker's claim once its lease lapsed: the message is dead-lettered for a
    person, and its caller reads a ``ResultFailure`` saying so, not None."""
    run = Run(store, lease=2.0, on_stale="escalate")
    try:
        message = run.app.charge.send_with_options(
            args=("s1", 10), kwargs={"sleep": 4.0}, store_results=True
        )
        first = run.worker(processes=1, threads=1)
        _until(lambda: run.started("s1") == 1)
        os.killpg(first.pid, signal.SIGKILL)
        first.wait(10)
        run.worker(processes=1, threads=1)
        failure = _failure(message)
        assert failure.orig_exc_type == "DeadLettered", failure
        assert failure.orig_exc_msg.startswith("escalated: "), failure
        assert run.effects("s1") == 0 and run.started("s1") == 1
        letters = run.dead_lettered(1)
        assert len(letters) == 1, letters
        assert letters[0]["options"]["oncely_reason"] in failure.orig_exc_msg, letters
    finally:
        run.close()


@pytest.mark.timeout(120)
def test_a_dead_letter_on_a_broker_without_reason_options_answers_its_caller(store: str) -> None:
    """On a broker other than RabbitMQ (here Dramatiq's Redis broker) oncely dead-letters with
    Dramatiq's own ``fail()``. Before, the message went on as if the actor had returned None
    (the Results middleware stored None, and a caller already waiting read it) before the
    failure was stored; now its caller reads oncely's reason, and the message is in the
    broker's dead letters."""
    run = Run(store, broker="redis")
    try:
        app = run.app
        run.worker(processes=1, threads=2)
        assert _result(app.price.send("c2")) == {"order": "c2", "total": 42}
        reused = _failure(app.price.send("c2", 0.01))
        assert reused.orig_exc_type == "DeadLettered", reused
        assert reused.orig_exc_msg.startswith("key_conflict: "), reused
        first = _failure(run.send_rejected("r2"))
        assert "order r2 is not billable" in first.orig_exc_msg, first
        assert str(_failure(run.send_rejected("r2"))) == str(first)
        assert run.effects("price:c2") == 1 and run.started("r2") == 1
        run.until(lambda: run.redis_dead_letters() == 3)
    finally:
        run.close()


@pytest.mark.timeout(300)
def test_r10_an_actor_that_kills_its_worker_every_time_is_dead_lettered(store: str) -> None:
    """``fatal`` ends its worker process on every run (``os._exit``, as the OOM killer
    would), and with it the ``dramatiq`` command; a supervisor starts it again each time.
    Dramatiq sees no failure (its Retries middleware counts exceptions): RabbitMQ gives the
    message to the next worker, which died again, for ever. Now the runs are counted by the
    inbox (each copy takes the dead run's claim over once its 2 s lease lapsed, one attempt
    higher): after ``max_retries`` + 1 (3) runs that never finished, the message is
    dead-lettered with that reason instead of run again, and the worker stays up. An actor
    that dies once runs again and succeeds."""
    run = Run(store, lease=2.0)
    try:
        app = run.app
        with Supervisor(lambda: run.worker(processes=1, threads=1)) as supervisor:
            app.fatal.send("w1", deaths=99)
            [letter] = run.dead_lettered(1)
            reason = letter["amqp_headers"]["x-oncely-reason"]
            assert reason.startswith("failed on all 3 deliveries; last: none of its 3 runs "
                                     "finished (the worker"), reason  # fmt: skip
            assert letter["amqp_headers"]["x-oncely-deliveries"] == "3", letter
            assert run.started("fatal:w1") == 3 and run.effects("fatal:w1") == 0
            survivor, starts = supervisor.current, supervisor.starts
            app.charge.send("w0", 10)
            run.until(lambda: run.effects("w0") == 1)
            assert supervisor.current is survivor and supervisor.starts == starts
            assert survivor is not None and survivor.poll() is None

            app.fatal.send("w2", deaths=1)
            run.until(lambda: run.effects("fatal:w2") == 1, seconds=120)
            assert run.started("fatal:w2") == 2 and supervisor.starts == starts + 1
        time.sleep(1.0)
        assert run.dead_letters() == []
    finally:
        run.close()


@pytest.mark.timeout(180)
def test_r8_a_copy_that_meets_its_key_running_is_sent_again_less_and_less_often(
    store: str, tmp_path: Path
) -> None:
    """A copy of ``charge`` (``retry_in_flight_ms=1000``) meets the first still running
    (12 s). Before, it was sent again every second: a dozen resends here, 1,800 for an
    hour-long actor. Now each wait is twice the last (1, 2, 4, 8 s: four resends while the
    first ran), up to what is left of the running claim's lease; the copy still ends as the
    duplicate of the one run."""
    run = Run(store)
    log = tmp_path / "worker.log"
    try:
        app = run.app
        run.worker(processes=1, threads=2, log=log)
        app.charge.send("s1", 10, sleep=12.0)
        run.until(lambda: run.started("s1") == 1)
        app.charge.send("s1", 10, sleep=12.0)
        run.until(lambda: run.outcomes("charge:s1", "duplicate") == 1, seconds=90)
        assert_resends_back_off(log, "charge:s1", run.outcomes("charge:s1", "in_flight"))
        assert run.effects("s1") == 1 and run.started("s1") == 1
    finally:
        run.close()


@pytest.mark.timeout(120)
def test_r16_with_log_keys_hash_no_line_of_the_worker_says_a_key(tmp_path: Path) -> None:
    """An inbox made with ``log_keys="hash"`` (keys that are personal data): the worker's
    lines and the reasons it gives show each key as the inbox shows it, its digest, on every
    path that names one (a copy met running and sent again, a duplicate, a failure retried, a
    rejection dead-lettered, a duplicate whose first result was not kept). Before, the
    middleware's own lines and reasons said the key itself."""
    from oncely._core.observe import key_for_logs

    require("RabbitMQ", RABBITMQ_URL, 5672)
    require("Redis", REDIS_URL, 6379)
    run = Run(f"sqlite:///{tmp_path / 'inbox.db'}", log_keys="hash")
    log = tmp_path / "worker.log"
    try:
        app = run.app
        run.worker(processes=1, threads=2, log=log)
        app.charge.send("h1", 10, sleep=3.0)
        run.until(lambda: run.started("h1") == 1)
        app.charge.send("h1", 10, sleep=3.0)  # met running, sent again, then a duplicate
        app.charge.send("h2", 10, fail_times=1)  # fails, then retried
        app.charge.send("h3", 10, reject=True)  # dead-lettered
        assert len(_result(app.bulky.send("b1"))) == 300 * 1024
        lost = _failure(app.bulky.send("b1"))  # its first result not kept
        run.until(lambda: run.outcomes("charge:h1", "duplicate") == 1)
        run.until(lambda: run.effects("h2") == 1)
        assert len(run.dead_lettered(1)) == 1
        said = log.read_text(errors="replace") + lost.orig_exc_msg
        for key in ("charge:h1", "charge:h2", "charge:h3", "bulky:b1"):
            assert key not in said, said
            assert key_for_logs(key, "hash") in said, (key, said)
        assert f"key {key_for_logs('charge:h1', 'hash')} is being processed elsewhere" in said
    finally:
        run.close()

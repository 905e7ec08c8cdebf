"""Celery tasks that apply each logical message once: a Task base class on a sync
:class:`~oncely.Inbox` (the two-phase mode).

Tested with the real ``celery worker`` (prefork, and solo under a supervisor) on RabbitMQ, a
worker and a pool process ``SIGKILL``ed mid-task included, a task that ends the whole worker on
every run, and on the Redis broker with a visibility timeout shorter than the task, the copies
it sends again counted (``tests/integrations/test_celery.py``).

::

    from oncely.integrations.celery import IdempotentTask, send_with_key

    @app.task(base=IdempotentTask, inbox=inbox,
              idempotency_key=lambda order_id, amount: f"charge:{order_id}")
    def charge(order_id: str, amount: int) -> dict: ...

    charge.delay("o-1", 42)                          # the key comes from the arguments
    send_with_key(notify, "mail:o-1", args=("o-1",)) # or the producer names it, on purpose

Celery's task id is never the key unless :func:`send_with_key` set it: ``delay()`` mints a
new one each call, so a producer's retry would look new.

=====================================  ================================================
the first message with a key           the task runs; the claim completes when it
                                       returns, is released when it raises, and
                                       Celery's own ``retry`` sends it again with the
                                       task's ``default_retry_delay`` / ``retry_backoff``
                                       until ``max_retries`` (or the limit a
                                       ``self.retry(max_retries=n)`` call gave), then it
                                       is dead-lettered
a duplicate (the key completed)        the first result is returned, the task not run
a task that ends with                  the claim completes without a result: Celery
``self.replace(sig)``                  sent ``sig`` under the task's id, which answers
                                       with its result. A duplicate under another id
                                       raises :class:`~oncely.ResultUnavailable` naming
                                       that id; one under the same id (``send_with_key``,
                                       a redelivery) is ignored, the id left to ``sig``
a run its hard ``time_limit`` stopped, sent again as one of its retries (Celery would
or whose pool process died (killed,    acknowledge the first, and give the second back
out of memory)                         to the broker as often as it happens); the copy
                                       takes the lost run's claim over once its lease
                                       lapses; dead-lettered once ``max_retries`` is
                                       spent
a run that took the whole worker with  Celery sees no failure: the broker gives the
it (the solo or threads pool and       message to the next worker start, for ever. The
``os._exit``, the OOM killer, the      next copy takes the dead run's claim over once its
machine down)                          lease lapses, one attempt higher; when the runs in
                                       a row that never finished are more than
                                       ``max_retries``, it is dead-lettered ("none of its
                                       N runs finished") instead of run again
a copy while the first still runs      sent again ``retry_in_flight`` seconds later (not
(Redis visibility timeout, a worker    one of its retries) and this copy acknowledged;
killed mid-task)                       each time twice as long as the last, up to what is
                                       left of the running claim's lease (on the Redis
                                       broker, never more than half its visibility
                                       timeout: see below); taken over once a dead
                                       worker's lease lapses
the store cannot answer                sent again later the same way (up to 30 s apart,
                                       on Redis at most half its visibility timeout),
                                       never run unprotected
the store is down when the worker      the worker stops before taking a message (exit
starts, or its tables cannot be used   code 3, or 4 for the tables), the store named in
                                       the log
the key with other arguments, no key,  dead-lettered to ``<queue>.dead`` (a Celery task
``oncely.Reject``, Celery's            message with ``x-oncely-*`` headers) and the task
``Reject(requeue=False)``              recorded as failed with :class:`DeadLettered`
a message Celery cannot read (an       copied as it came to ``<queue>.dead`` with the
undecodable body, not a task, a task   reason, then acknowledged (:class:`KeepUnreadable`:
the worker does not know)              Celery alone would ack or reject it away); its
                                       ``x-oncely-consumer`` is the inbox's consumer
                                       name, as on every dead letter (empty only when
                                       the worker's tasks use several and the message
                                       names none of their tasks)
=====================================  ================================================

Defaults: ``acks_late = True`` and ``reject_on_worker_lost = True`` (a message is never
acknowledged before its task ended; a run whose pool process died is one of its retries, as
above, and a worker whose main process died leaves its messages to the broker). A copy
oncely sends again (a retry, a later try) keeps the message's headers, the producer's own
included. A resend or retry the broker refuses (oncely's, or the task's own ``self.retry()``)
becomes ``Reject(requeue=True)``: the claim is released and the broker keeps the message
(Celery's own ``retry`` would drop it).

On Celery's Redis broker a worker takes a message with a countdown at once and holds it
unacknowledged until it is due, and Redis hands out again, as another copy, a message held
longer than its ``visibility_timeout`` (``broker_transport_options``; an hour unless set):
both copies then run when due. So every wait oncely chooses itself (a copy sent again after
meeting its key running, or after the store did not answer) is at most half that timeout,
the other half left for a busy pool to reach the copy: with longer waits the copies that met
a long task running came back as several, each sent again in turn, and multiplied (33
copies of one message while a 20 s task ran, with a 3 s timeout). The waits of retries the
task configured (``default_retry_delay``, ``retry_backoff_max``, ``autoretry_for``'s
``countdown``) are kept as set: a worker whose tasks retry after a wait as long as the
timeout or longer logs a warning at start naming the task, the wait and the timeout, since
each such retry arrives as about one copy per timeout waited (one runs; the others meet it
running, or find it done, and end as duplicates). A task's own ``self.retry(countdown=...)``
waits the same way, unseen at start; a run longer than the timeout is handed out again too,
and that copy meets the running claim (above). Tested on Redis with a 3 s timeout.

Calling the task as a plain function runs it without a claim; ``apply()`` and eager mode
claim, and raise oncely's typed errors instead of dead-lettering (:class:`DeadLettered` for
what a worker would dead-letter with no typed error of its own, a keyless call say: its
text says that no message went to the dead-letter queue).
"""

from __future__ import annotations

import contextlib
import logging
import uuid
from collections.abc import Mapping
from typing import Any

try:
    from celery import Task, bootsteps, signals
    from celery.exceptions import Ignore, Retry, TimeLimitExceeded, WorkerLostError
    from celery.exceptions import Reject as CeleryReject
    from celery.utils.time import get_exponential_backoff_interval
    from celery.worker import state as worker_state
    from celery.worker.request import Request
except ImportError as exc:  # pragma: no cover - the extra is missing
    raise ImportError(
        "oncely.integrations.celery needs Celery: pip install 'oncely[celery]'"
    ) from exc

from oncely._core.inbox_rules import not_kept_note
from oncely._core.outcomes import Outcome
from oncely._core.said import said
from oncely.brokers._shape import DeadLetter
from oncely.errors import ConfigurationError, OncelyError, Reject, StoreError
from oncely.inbox.sync_inbox import Claimed, Inbox
from oncely.integrations._startup import EXIT_USAGE, check_stores
from oncely.integrations._task_keys import Keyer, first_result, shown_key, shown_text, task_key
from oncely.integrations._task_runs import (
    IN_FLIGHT_RESENDS,
    give_up,
    in_flight_delay,
    resends_of,
    unfinished,
)

__all__ = [
    "KEY_HEADER",
    "CheckStores",
    "DeadLettered",
    "IdempotentTask",
    "KeepUnreadable",
    "LostRunRequest",
    "send_with_key",
]

LOGGER = logging.getLogger("oncely.celery")
KEY_HEADER = "oncely_key"
_REPLACED = "oncely_replaced"  # on a request whose task called self.replace()
_GAVE_UP = "oncely_gave_up"  # on a request: the error Celery's retry raised as it gave up
_NAMESPACE = uuid.UUID("6f1c2a3e-9b7d-4c1e-8a55-0e7f1d2c3b4a")


class DeadLettered(OncelyError):
    """The task's message was dead-lettered (the message says why and where): what
    ``AsyncResult.get()`` raises for it. One ``str`` argument, so Celery's JSON result
    backend rebuilds it."""


def stable_task_id(task_name: str, key: str) -> str:
    """The task id :func:`send_with_key` gives ``key``: the same for every send."""
    return str(uuid.uuid5(_NAMESPACE, f"{task_name}\n{key}"))


def send_with_key(
    task: Any,
    key: str,
    args: tuple[Any, ...] | list[Any] | None = None,
    kwargs: Mapping[str, Any] | None = None,
    **options: Any,
) -> Any:
    """``task.apply_async(args, kwargs, **options)`` with ``key`` as its idempotency key
    (and a task id derived from it): every send with one key is one logical message."""
    if not isinstance(key, str) or not key:
        raise ValueError("send_with_key needs a non-empty str key")
    headers = {**(options.pop("headers", None) or {}), KEY_HEADER: key}
    options.setdefault("task_id", stable_task_id(task.name, key))
    return task.apply_async(args, kwargs, headers=headers, **options)


class IdempotentTask(Task):  # type: ignore[misc]
    """The base class (see the module docstring)."""

    abstract = True
    acks_late = True
    reject_on_worker_lost = True
    Request = "oncely.integrations.celery:LostRunRequest"
    inbox: Inbox | None = None
    idempotency_key: Keyer | str | None = None
    retry_in_flight: float = 2.0
    """Seconds before a copy that met its key running is sent again the first time; twice as
    long each time after, up to what is left of the running claim's lease (and, on the Redis
    broker, never more than half its visibility timeout)."""
    dead_letter_queue: str | None = None

    @classmethod
    def on_bound(cls, app: Any) -> None:
        """Bound to an app: its workers check their inboxes' stores at start
        (:class:`CheckStores`), and dead-letter the messages Celery cannot read
        (:class:`KeepUnreadable`) instead of dropping them."""
        super().on_bound(app)
        app.steps["worker"].add(CheckStores)
        app.steps["consumer"].add(KeepUnreadable)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        request = self.request
        if request.called_directly:
            return super().__call__(*args, **kwargs)
        inbox = self.inbox
        if not isinstance(inbox, Inbox):
            raise ConfigurationError(
                f"task {self.name}: IdempotentTask needs inbox=oncely.Inbox(...) (a sync inbox)"
            )
        try:
            key = self._key(args, kwargs)
        except Exception as exc:
            return self._dead_letter(Outcome.REJECTED, f"the key could not be read: {exc!r}")
        if not key:
            return self._dead_letter(Outcome.REJECTED, "no idempotency key: the producer gave none")
        payload = {"args": list(args), "kwargs": dict(kwargs)}
        try:
            claimed: Claimed[Any] = inbox.claim(key, payload)
        except StoreError as exc:
            said = shown_text(repr(exc), key, inbox.log_keys)
            return self._later(key, f"oncely could not claim it: {said}", None)
        if claimed.won:
            runs = unfinished(claimed.attempt, self._limit(None))
            if runs is not None:  # the worker died with each run: never run it again
                return self._give_up(claimed, runs)
            return self._run(claimed, key, args, kwargs)
        handled = claimed.handled
        assert handled is not None
        shown = shown_key(key, inbox.log_keys)  # never the key itself with log_keys="hash"
        if request.is_eager:  # apply(), task_always_eager: the caller gets it in hand
            if handled.outcome is Outcome.DUPLICATE:
                return first_result(handled, self.run, self.name, inbox.log_keys)
            return handled.unwrap()
        if handled.outcome is Outcome.DUPLICATE:
            if handled.reason == not_kept_note(self._replaced(request)):
                # This very message again (a redelivery, or sent again with send_with_key):
                # its task id is the replacement's now, and any result stored for this copy
                # would overwrite the answer the first caller waits for.
                LOGGER.info("oncely celery %s[%s]: replaced before; ignored", self.name, request.id)
                raise Ignore(f"key {shown} was replaced by another task under this task id")
            return first_result(handled, self.run, self.name, inbox.log_keys)
        if handled.outcome is Outcome.IN_FLIGHT:
            return self._later(key, f"key {shown} is being processed elsewhere", handled)
        return self._dead_letter(handled.outcome, handled.reason or handled.outcome.value, key=key)

    def _give_up(self, claimed: Claimed[Any], runs: int) -> Any:
        """Dead-letter a message whose last ``runs`` runs never finished (their worker died),
        instead of running it again (:func:`~oncely.integrations._task_runs.give_up`)."""
        return give_up(
            claimed,
            runs,
            lambda reason: self._dead_letter(
                Outcome.REJECTED, reason, deliveries=runs, key=claimed.key
            ),
            DeadLettered,
        )

    def _key(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
        keyer = type(self).idempotency_key  # the plain function, not bound to the task
        return task_key(keyer, _given_key(self.request), args, kwargs)

    def _run(
        self, claimed: Claimed[Any], key: str, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        try:
            result = self.run(*args, **kwargs)
        except Retry:
            claimed.release("the task asked Celery to retry it")
            raise
        except Ignore:
            if self.request.get(_REPLACED):
                claimed.complete(not_kept=self._replaced(self.request))
            else:
                claimed.complete(None)
            raise
        except CeleryReject as exc:
            if exc.requeue:
                claimed.release(f"given back to the broker: {exc.reason!r}")
                raise
            claimed.reject(f"the task rejected it: {exc.reason!r}")
            return self._dead_letter(
                Outcome.REJECTED, f"the task rejected it: {exc.reason!r}", key=key
            )
        except Reject as exc:
            claimed.reject(exc.reason)
            if self.request.is_eager:
                raise
            return self._dead_letter(Outcome.REJECTED, exc.reason, key=key)
        except Exception as exc:
            claimed.release(f"the task raised {said(exc)}")
            if self.request.is_eager:
                raise
            return self._retry(key, exc)
        claimed.complete(result)
        return result

    def on_replace(self, sig: Any) -> Any:
        """Celery's step of ``self.replace(sig)``: it sends ``sig`` under this task's id, and
        then raises ``Ignore``. Noted on the request, so :meth:`_run` completes the claim
        without a result: this task returned none, and its id answers with the replacement's
        (a ``None`` recorded here was what every duplicate answered)."""
        self.request.update({_REPLACED: True})
        return super().on_replace(sig)

    def _replaced(self, request: Any) -> str:
        """Why the record of this task, replaced under ``request``, keeps no result. Its
        words name the task id and Celery's replacement nesting, so a copy that is this very
        message again (same id, same nesting) can be told from another task sent under that
        id in its place (one nesting deeper) whose key happens to be the same."""
        task_id = request.id
        return (
            f"{self.name} replaced itself (Task.replace, nesting "
            f"{request.replaced_task_nesting or 0}); the task sent in its place answers under "
            f"task id {task_id}: AsyncResult({task_id!r})"
        )

    def _headers(self, key: str | None, request: Any = None) -> dict[str, Any]:
        """The headers of a copy this task sends again (a retry, a later try): the message's
        own, as Celery itself would pass them on (the producer's custom headers kept,
        RabbitMQ's ``x-death`` left out), with the key the producer named. Giving Celery
        ``headers=`` replaces the message's headers, so handing it the key alone dropped every
        other header from the copy."""
        request = self.request if request is None else request
        headers = dict(request.as_execution_options().get("headers") or {})
        headers.pop(IN_FLIGHT_RESENDS, None)  # a retry's first wait for a running copy is short
        given = _given_key(request)
        if given is not None:
            headers[KEY_HEADER] = given if key is None else key
        return headers

    def _limit(self, exc: BaseException | None) -> int | None:
        """The number of retries Celery allows after ``exc``."""
        limit: int | None = self.max_retries
        # Celery's autoretry_for with retry_kwargs={"max_retries": n}: once Celery gives up
        # it raises the error here, after n retries; the task's own limit is not the one.
        given = getattr(self, "retry_kwargs", None) or {}
        automatic = tuple(getattr(self, "autoretry_for", ()) or ())
        if "max_retries" in given and automatic and isinstance(exc, automatic):
            limit = given["max_retries"]
        return limit

    def _countdown(self, retries: int) -> float:
        """How long Celery's own ``retry`` would wait before the retry ``retries + 1``."""
        backoff = getattr(self, "retry_backoff", False)  # set only with autoretry options
        if backoff:
            return float(
                get_exponential_backoff_interval(
                    factor=int(backoff),
                    retries=retries,
                    maximum=getattr(self, "retry_backoff_max", 600),
                    full_jitter=getattr(self, "retry_jitter", True),
                )
            )
        return float(self.default_retry_delay)

    def retry(self, *args: Any, **kwargs: Any) -> Any:
        """Celery's ``retry``. When it gives up (its ``max_retries`` spent, the task's or the
        one this call gave) the error it raises is noted, so that this delivery is the last
        one: it is dead-lettered instead of retried up to the task's own ``max_retries``.
        When the copy it sends cannot be sent, Celery raises ``Reject(requeue=False)``, which
        would drop the message (and which oncely would take for the task rejecting it: its
        key marked rejected for good); it becomes ``Reject(requeue=True)``, the claim
        released and the message given back to the broker."""
        try:
            return super().retry(*args, **kwargs)
        except Retry:
            raise
        except CeleryReject as refused:
            if refused.requeue:
                raise
            raise CeleryReject(refused.reason, requeue=True) from refused
        except Exception as exc:
            self.request.update({_GAVE_UP: exc})
            raise

    def _retry(self, key: str, exc: Exception) -> Any:
        retries = self.request.retries
        limit = self._limit(exc)
        if self.request.get(_GAVE_UP) is exc or (limit is not None and retries >= limit):
            return self._dead_letter(
                Outcome.REJECTED,
                f"failed on all {retries + 1} deliveries; last: {said(exc)}",
                key=key,
            )
        try:
            raise self.retry(
                exc=exc, countdown=self._countdown(retries), headers=self._headers(key)
            )
        except CeleryReject as refused:  # the broker refused the retry: keep the message
            raise CeleryReject(refused.reason, requeue=True) from exc

    def _later(self, key: str, why: str, handled: Any) -> Any:
        """Send the message again later, not as one of its retries, and acknowledge this copy:
        ``retry_in_flight`` seconds the first time, twice as long each time after, up to what
        is left of the lease the key is held under (``handled``: the in-flight outcome, or
        None when the store did not answer)."""
        request = self.request
        if request.is_eager:
            raise StoreError(why)
        resends = resends_of(_header(request, IN_FLIGHT_RESENDS))
        delay = in_flight_delay(
            self.retry_in_flight, resends, handled, at_most=_held_at_most(self.app)
        )
        headers = {**self._headers(key), IN_FLIGHT_RESENDS: resends + 1}
        signature = self.signature_from_request(request, countdown=delay, headers=headers)
        try:
            signature.apply_async()
        except Exception as exc:
            raise CeleryReject(f"{why}; the resend failed: {exc!r}", requeue=True) from exc
        LOGGER.info(
            "oncely celery %s[%s]: %s; sent again in %.1f s (resend %d)",
            self.name, request.id, why, delay, resends + 1,
        )  # fmt: skip
        raise Ignore(why)

    def _after_lost_run(self, request: Any, why: str) -> str | None:
        """In the worker's main process, for a run the worker lost (its hard time limit
        stopped it, its pool process died): send the message again as one of its retries,
        or, once they are spent, to the dead-letter queue (the text returned says so).
        Raises when the copy could not be sent."""
        retries = int(request.retries or 0)
        limit = self._limit(None)
        headers = self._headers(None, request)
        if limit is not None and retries >= limit:
            reason = f"failed on all {retries + 1} deliveries; last: {why}"
            queue = self.dead_letter_queue or f"{_queue_of(request)}.dead"
            consumer = self.inbox.consumer if isinstance(self.inbox, Inbox) else ""
            letter = DeadLetter(
                outcome=Outcome.REJECTED.value, reason=reason, consumer=consumer,
                deliveries=retries + 1,
            )  # fmt: skip
            self.signature_from_request(
                request, queue=queue, headers={**headers, **letter.headers()}
            ).apply_async()
            return f"{Outcome.REJECTED.value}: {reason}; the message is in {queue}"
        self.signature_from_request(
            request, countdown=self._countdown(retries), retries=retries + 1, headers=headers
        ).apply_async()
        return None

    def _dead_letter(
        self,
        outcome: Outcome,
        reason: str,
        deliveries: int | None = None,
        key: str | None = None,
    ) -> Any:
        request = self.request
        consumer = self.inbox.consumer if isinstance(self.inbox, Inbox) else ""
        queue = self.dead_letter_queue or f"{_queue_of(request)}.dead"
        if request.is_eager:  # nothing is sent: the caller gets the refusal in hand
            raise DeadLettered(
                f"{outcome.value}: {reason}; the task was called eagerly (apply() or "
                f"task_always_eager): no message went to {queue}"
            )
        text = f"{outcome.value}: {reason}; the message is in {queue}"
        if deliveries is None:
            deliveries = request.retries + 1
        letter = DeadLetter(
            outcome=outcome.value, reason=reason, consumer=consumer, deliveries=deliveries
        )
        signature = self.signature_from_request(
            request, queue=queue, headers={**(request.headers or {}), **letter.headers()}
        )
        try:
            signature.apply_async()
        except Exception as exc:
            raise CeleryReject(
                f"{text}; the copy could not be sent: {exc!r}", requeue=True
            ) from exc
        log_keys = self.inbox.log_keys if isinstance(self.inbox, Inbox) else "plain"
        LOGGER.warning(
            "oncely celery %s[%s]: dead-lettered: %s",
            self.name, request.id, shown_text(text, key, log_keys),
        )  # fmt: skip
        raise DeadLettered(text)


class LostRunRequest(Request):  # type: ignore[misc]
    """The worker's request of every :class:`IdempotentTask`: what becomes of a message
    whose run the worker lost, because its hard ``time_limit`` stopped it or its pool
    process died (killed, out of memory). Celery alone acknowledges the first (recording
    ``TimeLimitExceeded``: never run again nor dead-lettered, the key left in progress) and
    gives the second back to the broker (``reject_on_worker_lost``) as often as it happens:
    a task that kills its process loops for ever. Here, in the worker's main process, the
    message is sent again as one of its retries (after the task's ``default_retry_delay`` or
    ``retry_backoff``; that copy takes the lost run's claim over once its lease lapses), or
    to ``<queue>.dead`` once ``max_retries`` is spent, and only then acknowledged. If neither
    copy can be sent, the message is given back to the broker."""

    def on_failure(
        self, exc_info: Any, send_failed_event: bool = True, return_ok: bool = False
    ) -> Any:
        exc = getattr(exc_info.exception, "exc", exc_info.exception)  # ExceptionWithTraceback
        if isinstance(self.task, IdempotentTask) and not worker_state.should_terminate:
            if isinstance(exc, TimeLimitExceeded):
                return None  # billiard calls on_timeout next: it acknowledges, once sent on
            if isinstance(exc, WorkerLostError):
                worker_state.task_ready(self)
                self._send_on(f"the pool process running it was lost ({exc})")
                return None
        return super().on_failure(exc_info, send_failed_event, return_ok)

    def on_timeout(self, soft: bool, timeout: float) -> None:
        if soft or worker_state.should_terminate or not isinstance(self.task, IdempotentTask):
            super().on_timeout(soft, timeout)
            return
        worker_state.task_ready(self)
        self._send_on(f"the hard time limit ({timeout} s) stopped it")

    def _send_on(self, why: str) -> None:
        task = self.task
        request = self._context
        try:
            text = task._after_lost_run(request, why)
        except Exception as exc:
            LOGGER.error(
                "oncely celery %s[%s]: %s, and it could not be sent again (%r): requeued",
                task.name, self.id, why, exc,
            )  # fmt: skip
            self.reject(requeue=True)
            return
        if text is None:
            if self.store_errors:
                with contextlib.suppress(Exception):  # the copy is sent; this is a courtesy
                    task.backend.mark_as_retry(self.id, RuntimeError(why), request=request)
            LOGGER.warning("oncely celery %s[%s]: %s; retried", task.name, self.id, why)
        else:
            failure = DeadLettered(text)
            with contextlib.suppress(Exception):  # the letter is kept; this is a courtesy
                task.backend.mark_as_failure(
                    self.id, failure, request=request, store_result=self.store_errors
                )
                signals.task_failure.send(
                    sender=task, task_id=self.id, exception=failure, args=self.args,
                    kwargs=self.kwargs, traceback=None, einfo=None,
                )  # fmt: skip
            LOGGER.warning("oncely celery %s[%s]: dead-lettered: %s", task.name, self.id, text)
        self.acknowledge()


class KeepUnreadable(bootsteps.StartStopStep):  # type: ignore[misc]
    """A worker consumer step that every app with an :class:`IdempotentTask` gets: a
    message Celery cannot read (a body it cannot decode, a message that is not a task, a task
    the worker does not know, a malformed task message) is copied as it came, body and
    headers, to ``<queue>.dead`` with the ``x-oncely-*`` headers saying why, and only then
    acknowledged; its result, when it names a task id, is recorded as failed with
    :class:`DeadLettered`. Celery alone acknowledges an undecodable message and rejects the
    others without requeue: both lose it. If the copy cannot be sent the message is given
    back to the broker (requeued), never acknowledged."""

    label = "oncely: keep unreadable messages"

    def __init__(self, parent: Any, **kwargs: Any) -> None:
        super().__init__(parent, **kwargs)
        consumer = parent

        def on_decode_error(message: Any, exc: BaseException) -> None:
            _keep(consumer, message, f"Celery could not decode it: {exc!r}")

        def on_unknown_message(body: Any, message: Any) -> None:
            _keep(consumer, message, "it is not a Celery task message")

        def on_unknown_task(body: Any, message: Any, exc: BaseException) -> None:
            name = (message.headers or {}).get("task")
            _keep(consumer, message, f"no task {name!r} is registered on this worker")

        def on_invalid_task(body: Any, message: Any, exc: BaseException) -> None:
            _keep(consumer, message, f"an invalid task message: {exc!r}")

        consumer.on_decode_error = on_decode_error
        consumer.on_unknown_message = on_unknown_message
        consumer.on_unknown_task = on_unknown_task
        consumer.on_invalid_task = on_invalid_task


class CheckStores(bootsteps.StartStopStep):  # type: ignore[misc]
    """A worker bootstep, added by :class:`IdempotentTask`: before the worker takes a
    message, the store of every ``IdempotentTask``'s inbox is connected and its schema
    checked. A store that cannot be reached stops the worker with exit code 3, a schema this
    oncely cannot use with 4 (``oncely consume``'s codes), after one log line naming the
    store: a worker that started anyway would give every message back to the broker, each
    time a delivery closer to its dead-letter queue."""

    label = "oncely: check the inboxes' stores"

    def start(self, worker: Any) -> None:
        tasks = [task for task in worker.app.tasks.values() if isinstance(task, IdempotentTask)]
        early = sorted(task.name for task in tasks if not task.acks_late)
        if early:
            LOGGER.error(
                "oncely celery: the worker stops before taking a message: %s set acks_late="
                "False: a message acknowledged before its task ended is lost in a crash, its "
                "key left in progress (IdempotentTask acknowledges late; drop the option) "
                "[exit %d]",
                ", ".join(early),
                EXIT_USAGE,
            )
            raise SystemExit(EXIT_USAGE)
        check_stores([task.inbox for task in tasks if isinstance(task.inbox, Inbox)], "celery")
        _warn_long_retries(worker.app, tasks)


def _redis_visibility_timeout(app: Any) -> float | None:
    """The visibility timeout of ``app``'s broker when it is Redis, in seconds: its
    ``broker_transport_options["visibility_timeout"]``, else kombu's default (one hour).
    None for another broker, or when the broker's settings cannot be read."""
    try:
        connection = app.connection_for_read()
    except Exception:
        return None
    try:
        transport = connection.get_transport_cls()
        if getattr(transport, "driver_type", None) != "redis":
            return None
        given = (connection.transport_options or {}).get("visibility_timeout")
        return float(given if given is not None else transport.Channel.visibility_timeout)
    except Exception:
        return None
    finally:
        connection.release()  # never connected: only its settings were read


def _held_at_most(app: Any) -> float | None:
    """The longest wait oncely gives a copy it sends again on ``app``'s broker (None: no
    bound of the broker's own). On Redis, half the visibility timeout: a worker takes a
    message with a countdown at once and holds it unacknowledged until it is due, and Redis
    hands a message held longer than the visibility timeout to a worker again, as a second
    copy, while the first still waits; a copy sent again after a longer wait came back as
    several, each of which met the running claim and was sent again in turn, their number
    multiplying with every wait while a long task ran. The other half leaves room for a
    busy pool to reach the copy once it is due."""
    timeout = _redis_visibility_timeout(app)
    return None if timeout is None else timeout / 2


def _retry_waits(task: IdempotentTask) -> list[tuple[str, float]]:
    """The longest wait before a retry of ``task`` that its options set (the option's name,
    seconds): oncely's retries after a failure or a lost run, and Celery's ``autoretry_for``.
    Empty when the task is never retried."""
    limit = task._limit(None)
    if limit == 0:
        return []
    given = getattr(task, "retry_kwargs", None) or {}
    automatic = tuple(getattr(task, "autoretry_for", ()) or ())
    backoff = getattr(task, "retry_backoff", False)
    if backoff:
        longest = float(getattr(task, "retry_backoff_max", 600))
        if limit is not None:
            longest = min(longest, float(int(backoff) * 2 ** (limit - 1)))
        return [("retry_backoff_max", longest)]
    waits = [("default_retry_delay", float(task.default_retry_delay or 0))]
    if automatic and given.get("countdown") is not None:
        waits.append(("retry_kwargs countdown", float(given["countdown"])))
    return waits


def _warn_long_retries(app: Any, tasks: list[IdempotentTask]) -> None:
    """One warning per task whose retries wait as long as the Redis broker's visibility
    timeout or longer: the worker holds a retry unacknowledged while it waits, and Redis
    hands it out again every visibility timeout meanwhile, so each retry arrives as several
    copies (one runs, the others end as in-flight resends and duplicates). oncely keeps the
    delays the task chose; its own waits it keeps below the timeout (:func:`_held_at_most`)."""
    timeout = _redis_visibility_timeout(app)
    if timeout is None:
        return
    for task in sorted(tasks, key=lambda each: str(each.name)):
        for option, wait in _retry_waits(task):
            if wait >= timeout:
                LOGGER.warning(
                    "oncely celery: %s waits up to %g s before a retry (%s), but the Redis "
                    "broker's visibility_timeout is %g s: Redis hands a message held that "
                    "long to a worker again, so each retry arrives as about %d copies (one "
                    "runs, the others end as duplicates); set "
                    "broker_transport_options['visibility_timeout'] above the longest retry "
                    "wait plus the task's run time, or shorten %s",
                    task.name, wait, option, timeout, max(2, round(wait / timeout)), option,
                )  # fmt: skip


def _keep(consumer: Any, message: Any, reason: str) -> None:
    """Copy ``message`` to its queue's dead-letter queue with ``reason``, then ack it."""
    app = consumer.app
    info = message.delivery_info or {}
    queue = f"{info.get('routing_key') or app.conf.task_default_queue}.dead"
    letter = DeadLetter(
        outcome=Outcome.REJECTED.value,
        reason=reason,
        consumer=_inbox_consumer(app, message),
        deliveries=1,
    )
    headers = {**(message.headers or {}), **letter.headers()}
    text = f"{Outcome.REJECTED.value}: {reason}; the message is in {queue}"
    try:
        with app.producer_or_acquire() as producer:
            producer.publish(
                message.body,
                exchange=queue,  # where Celery itself routes a task sent to queue=<queue>
                routing_key=queue,
                headers=headers,
                content_type=message.content_type or "application/octet-stream",
                content_encoding=message.content_encoding or "binary",
                declare=[app.amqp.queues.new_missing(queue)],
                retry=True,
                retry_policy={"max_retries": 3},
            )
    except Exception as exc:
        LOGGER.error("oncely celery: %s, and the copy could not be sent (%r): requeued", text, exc)
        message.reject(requeue=True)
        return
    LOGGER.warning("oncely celery: dead-lettered a message: %s", text)
    message.ack()
    task_id = (message.headers or {}).get("id")
    if isinstance(task_id, str):
        with contextlib.suppress(Exception):  # the letter is kept; the result is a courtesy
            app.backend.mark_as_failure(task_id, DeadLettered(text))


def _inbox_consumer(app: Any, message: Any) -> str:
    """The inbox consumer name a message Celery cannot read came to, for its dead letter:
    its task's, where it names an :class:`IdempotentTask`; else the one consumer name the
    inboxes of the worker's idempotent tasks share. Empty only when they have several
    and the message names none of their tasks."""
    named = (message.headers or {}).get("task")
    task = app.tasks.get(named) if isinstance(named, str) else None
    if isinstance(task, IdempotentTask) and isinstance(task.inbox, Inbox):
        return task.inbox.consumer
    names = {
        each.inbox.consumer
        for each in app.tasks.values()
        if isinstance(each, IdempotentTask) and isinstance(each.inbox, Inbox)
    }
    return names.pop() if len(names) == 1 else ""


def _given_key(request: Any) -> Any:
    """The key :func:`send_with_key` put on the message, wherever Celery left it."""
    return _header(request, KEY_HEADER)


def _header(request: Any, name: str) -> Any:
    """A header the message carries, wherever Celery left it (in the request's headers, or
    as an attribute of the request)."""
    return (request.headers or {}).get(name) or getattr(request, name, None)


def _queue_of(request: Any) -> str:
    info = request.delivery_info or {}
    return str(info.get("routing_key") or "celery")

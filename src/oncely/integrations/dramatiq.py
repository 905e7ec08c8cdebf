"""Dramatiq actors that apply each logical message once: a middleware on a sync
:class:`~oncely.Inbox` (the two-phase mode: Dramatiq runs actors in worker threads).

::

    import dramatiq
    from oncely.integrations.dramatiq import Idempotency, send_with_key

    broker.add_middleware(Idempotency(oncely.Inbox(store, consumer="billing")))

    @dramatiq.actor(idempotency_key=lambda order_id, amount: f"charge:{order_id}")
    def charge(order_id: str, amount: int) -> None: ...

    charge.send("o-1", 42)                      # the key comes from the arguments
    send_with_key(notify, "mail:o-1", "o-1")    # or the producer names it, on purpose

An actor takes part when it declares ``idempotency_key``: a function of the actor's
arguments that returns the key, or ``"sent"`` for a key the producer always gives with
:func:`send_with_key`. Dramatiq's own ``message_id`` is never the key: ``send`` mints a new
one each call, so a producer's retry would look new.

What each message gets, before the actor runs:

=====================================  ================================================
the first message with a key           the actor runs; the claim completes when it
                                       returns, is released when it raises (Dramatiq's
                                       Retries middleware then retries, then dead-letters)
a duplicate (the key completed)        the actor not run: the first result stands in
                                       for its value (rebuilt as the function's return
                                       annotation), so the Results middleware stores it
                                       and a pipeline goes on to its next stage; skipped
                                       when the first result was not kept
a copy while the first still runs      sent again ``retry_in_flight_ms`` later (not one
                                       of its retries), each time twice as long as the
                                       last, up to what is left of the running claim's
                                       lease, so a redelivery after a worker died is
                                       taken over once the dead worker's lease lapses,
                                       never dropped; the Results middleware stores
                                       nothing for the copy sent again
a run that took its worker process     the Retries middleware sees no failure: the
with it (``os._exit``, the OOM         message goes to the next worker start, for ever.
killer)                                The next copy takes the dead run's claim over once
                                       its lease lapses, one attempt higher; when the
                                       runs in a row that never finished are more than
                                       ``max_retries`` (the message's, the actor's, the
                                       Retries middleware's), it is dead-lettered ("none
                                       of its N runs finished") instead of run again
the store cannot answer                sent again later the same way (up to 30 s apart),
                                       never run unprotected
the store is down when the worker      the worker process stops before taking a message
starts, or its tables cannot be used   (exit code 3, or 4 for the tables), the store
                                       named in the log
the key with other arguments           dead-lettered with the reason
no key                                 dead-lettered with the reason
the actor raises :class:`oncely.Reject`  the key is marked rejected; the retry Dramatiq
                                       sends meets the mark and is dead-lettered
=====================================  ================================================

Once the actor has returned or raised, the thread's ``TimeLimit`` (and its
``ShutdownNotifications``) are ended before the claim is: an actor that returned just in time
is never stopped while its claim completes (which left the claim in progress, and the retry
that followed ran the actor again).

Dramatiq runs the actor when a middleware raises anything but its own ``MiddlewareError``
before it (the error is logged): every failure here is turned into a resend, or into
:class:`TryLater` (a ``MiddlewareError`` and a ``Retry``) when the resend itself fails.

Dead letters go to the queue's own dead-letter queue (``<queue>.XQ``). On RabbitMQ the
dead-lettered copy carries the reason in its options (``oncely_reason``) and the
``x-oncely-outcome``, ``x-oncely-reason``, ``x-oncely-consumer`` (the inbox's consumer name)
and ``x-oncely-deliveries`` headers of every oncely dead letter; other brokers
get Dramatiq's own ``fail()`` and the reason is logged (``oncely.dramatiq``). When the
Results middleware stores the actor's results, a dead letter's result is the failure
:class:`DeadLettered` (its text: the outcome, the reason, the queue), so the caller's
``get_result`` raises ``ResultFailure`` as for an actor that failed for good, never returns
a None as if it had run. A message Dramatiq cannot decode never reaches a middleware:
Dramatiq dead-letters it itself.

Tested with the ``dramatiq`` worker command (processes and threads) on RabbitMQ, a worker
``SIGKILL``ed mid-task and an actor that ends its worker process on every run included
(``tests/integrations/test_dramatiq.py``).
"""

from __future__ import annotations

import functools
import logging
import threading
from typing import Any, NoReturn, cast

try:
    import dramatiq
    from dramatiq import Middleware
    from dramatiq.common import xq_name
    from dramatiq.errors import Retry
    from dramatiq.middleware import (
        MiddlewareError,
        Retries,
        ShutdownNotifications,
        SkipMessage,
        TimeLimit,
    )
    from dramatiq.results import Results
except ImportError as exc:  # pragma: no cover - the extra is missing
    raise ImportError(
        "oncely.integrations.dramatiq needs Dramatiq: pip install 'oncely[dramatiq]'"
    ) from exc

from oncely._core.inbox_rules import result_lost
from oncely._core.outcomes import Handled, Outcome
from oncely._core.typed import ANNOTATED, result_type, reviver
from oncely.brokers._shape import DeadLetter
from oncely.errors import OncelyError, Reject, ResultUnavailable
from oncely.inbox.sync_inbox import Claimed, Inbox
from oncely.integrations._startup import check_stores
from oncely.integrations._task_keys import shown_key, shown_text, task_key
from oncely.integrations._task_runs import (
    IN_FLIGHT_RESENDS,
    give_up,
    in_flight_delay,
    resends_of,
    unfinished,
)

__all__ = [
    "KEY_OPTION",
    "REASON_OPTION",
    "DeadLettered",
    "Idempotency",
    "TryLater",
    "send_with_key",
]

LOGGER = logging.getLogger("oncely.dramatiq")
_REPLAY = threading.local()
"""A duplicate's first result, for the actor's stand-in to return (the worker thread that
took the message calls the actor right after the middleware)."""
_NOTHING = object()
_REPLAYS = "__oncely_replays__"
"""Set on an actor's stand-in, so it is never wrapped twice."""
KEY_OPTION = "oncely_key"
"""The message option :func:`send_with_key` sets: the producer's key."""
REASON_OPTION = "oncely_reason"
"""The option a dead-lettered copy carries (RabbitMQ): why it was dead-lettered."""


class DeadLettered(OncelyError):
    """The message was dead-lettered by oncely (the text says why and where): the failure the
    Results middleware's backend holds for it, so ``message.get_result()`` raises
    ``ResultFailure`` with this type's name and text, as for an actor that failed for good."""


class TryLater(MiddlewareError, Retry):
    """The message is tried again later by the Retries middleware: it could not be sent
    again itself. A ``MiddlewareError``, because Dramatiq swallows any other exception a
    middleware raises before the actor (logged, and the actor then runs), which would run it
    unprotected."""


def send_with_key(
    actor: dramatiq.Actor[..., Any], key: str, *args: Any, **kwargs: Any
) -> dramatiq.Message[Any]:
    """Send ``actor(*args, **kwargs)`` with ``key`` as its idempotency key: every send with
    the same key (a producer's retry, a resend) is one logical message."""
    if not isinstance(key, str) or not key:
        raise ValueError("send_with_key needs a non-empty str key")
    options: dict[str, Any] = {KEY_OPTION: key}
    return actor.send_with_options(args=args, kwargs=kwargs, **options)


class Idempotency(Middleware):
    """The middleware (see the module docstring). ``retry_in_flight_ms``: how long a copy that
    met a running first one (or a store that did not answer) waits before it is tried again
    the first time (default 2 s; twice as long each time after)."""

    @property
    def actor_options(self) -> set[str]:
        return {"idempotency_key"}

    def __init__(self, inbox: Inbox, *, retry_in_flight_ms: int = 2_000) -> None:
        if not isinstance(inbox, Inbox):
            raise TypeError("Idempotency takes a sync oncely.Inbox (Dramatiq actors are sync)")
        self.inbox = inbox
        self._retry_ms = retry_in_flight_ms
        # By the message proxy's identity, not its message_id: two copies of one message
        # (a redelivery beside a run still going) must never end each other's claim.
        self._claims: dict[int, Claimed[Any]] = {}
        self._lock = threading.Lock()
        self._worker_process = False

    # ------------------------------------------------------------------ at start

    def after_declare_actor(self, broker: Any, actor: Any) -> None:
        """An actor that declares ``idempotency_key`` runs behind a stand-in: on a duplicate
        it returns the first result (its stored form brought back to the function's return
        annotation) instead of calling the function, so the middlewares after the actor
        (Results, Pipelines, Callbacks) see a message that ran, with the first result."""
        if actor.options.get("idempotency_key") is None or hasattr(actor.fn, _REPLAYS):
            return
        fn = actor.fn
        convert = reviver(result_type(fn, ANNOTATED))

        @functools.wraps(fn)
        def replaying(*args: Any, **kwargs: Any) -> Any:
            found = getattr(_REPLAY, "value", _NOTHING)
            if found is _NOTHING:
                return fn(*args, **kwargs)
            _REPLAY.value = _NOTHING
            try:
                return convert(found)
            except Exception:  # its stored form, as a duplicate of any other actor gets
                return found

        setattr(replaying, _REPLAYS, True)
        actor.fn = replaying

    def after_process_boot(self, broker: Any) -> None:
        self._worker_process = True  # the dramatiq command's worker process, no one else's

    def before_worker_boot(self, broker: Any, worker: Any) -> None:
        """In a ``dramatiq`` worker process, before it takes a message, the inbox's store
        is connected and its schema checked: a store that cannot be reached stops the process
        (and with it the command) with exit code 3, a schema this oncely cannot use with 4,
        after one log line naming the store. A ``Worker`` a program or a test starts itself
        meets the store at its first message."""
        if self._worker_process:
            check_stores([self.inbox], "dramatiq")

    # ------------------------------------------------------------------ before the actor

    def before_process_message(self, broker: Any, message: Any) -> None:
        _REPLAY.value = _NOTHING
        try:
            self._before(broker, message)
        except MiddlewareError:
            raise
        except Exception as exc:
            # A store's error may name the key: shown as the inbox's lines show keys.
            said = shown_text(repr(exc), self._key_quietly(broker, message), self.inbox.log_keys)
            LOGGER.error(
                "oncely dramatiq message %s (%s): not run now, tried again later: %s",
                message.message_id,
                message.actor_name,
                said,
            )
            self._later(broker, message, f"oncely could not claim it: {said}", None)

    def _key_quietly(self, broker: Any, message: Any) -> str | None:
        """The key of ``message`` (None when it has none or it cannot be read), for a line."""
        try:
            keyer = broker.get_actor(message.actor_name).options.get("idempotency_key")
            if keyer is None:
                return None
            return task_key(keyer, message.options.get(KEY_OPTION), message.args, message.kwargs)
        except Exception:
            return None

    def _later(self, broker: Any, message: Any, why: str, handled: Handled[Any] | None) -> None:
        """Send ``message`` again later (not one of its retries) and acknowledge this copy:
        ``retry_in_flight_ms`` the first time, twice as long each time after, up to what is
        left of the lease the key is held under (``handled``: the in-flight outcome, or None
        when the store did not answer). If the broker refuses the resend, the Retries
        middleware retries it (:class:`TryLater`). Never runs the actor."""
        resends = resends_of(message.options.get(IN_FLIGHT_RESENDS))
        delay = round(in_flight_delay(self._retry_ms / 1000, resends, handled) * 1000)
        try:
            broker.enqueue(message.copy(options={IN_FLIGHT_RESENDS: resends + 1}), delay=delay)
        except Exception as exc:
            raise TryLater(f"{why}; the resend failed: {exc!r}", delay=delay) from exc
        # The copy sent again carries the message's id: the Results middleware must not
        # store a None under it for this skipped delivery (a caller would read it as done).
        message.options["store_results"] = False
        LOGGER.info(
            "oncely dramatiq message %s (%s): %s; sent again in %d ms (resend %d)",
            message.message_id, message.actor_name, why, delay, resends + 1,
        )  # fmt: skip
        raise SkipMessage(f"{why}: sent again in {delay} ms")

    def _before(self, broker: Any, message: Any) -> None:
        keyer = broker.get_actor(message.actor_name).options.get("idempotency_key")
        if keyer is None:
            return
        try:
            key = task_key(keyer, message.options.get(KEY_OPTION), message.args, message.kwargs)
        except Exception as exc:
            self._dead_letter(
                broker, message, Outcome.REJECTED, f"the key could not be read: {exc!r}"
            )
        if not key:
            self._dead_letter(
                broker, message, Outcome.REJECTED, "no idempotency key: the producer gave none"
            )
        payload = {"args": list(message.args), "kwargs": dict(message.kwargs)}
        claimed: Claimed[Any] = self.inbox.claim(key, payload)
        if claimed.won:
            runs = unfinished(claimed.attempt, self._limit(broker, message))
            if runs is not None:  # the worker died with each run: never run it again
                self._give_up(broker, message, claimed, runs)
            with self._lock:
                self._claims[id(message)] = claimed
            return
        handled = claimed.handled
        assert handled is not None
        outcome = handled.outcome
        shown = shown_key(key, self.inbox.log_keys)  # never the key itself with log_keys="hash"
        if outcome is Outcome.DUPLICATE:
            if handled.value is None and result_lost(handled.reason):
                LOGGER.warning("oncely dramatiq key=%s: a duplicate, skipped (%s)", shown,
                               handled.reason)  # fmt: skip
                # Its caller is told so: a skipped message's result would be None, which a
                # caller takes for the result.
                lost = ResultUnavailable(
                    f"actor {message.actor_name} ran for {shown!r} before, but its result is "
                    f"not there to return ({handled.reason}); it is not run again",
                    cast("Handled[object]", handled),
                )
                self._store_failure(broker, message, lost)
                raise SkipMessage(f"duplicate of {shown}")
            LOGGER.info(
                "oncely dramatiq key=%s: a duplicate, answered with the first result", shown
            )
            _REPLAY.value = handled.value  # the actor's stand-in returns it (this thread)
            return
        if outcome is Outcome.IN_FLIGHT:
            self._later(broker, message, f"key {shown} is being processed elsewhere", handled)
        self._dead_letter(broker, message, outcome, handled.reason or outcome.value, key=key)

    def _give_up(self, broker: Any, message: Any, claimed: Claimed[Any], runs: int) -> NoReturn:
        """Dead-letter a message whose last ``runs`` runs never finished (their worker
        process died), instead of running it again
        (:func:`~oncely.integrations._task_runs.give_up`)."""

        def send(reason: str) -> NoReturn:
            self._dead_letter(
                broker, message, Outcome.REJECTED, reason, deliveries=runs, key=claimed.key
            )

        give_up(claimed, runs, send, SkipMessage)
        raise AssertionError("unreachable: the letter raises SkipMessage")  # pragma: no cover

    def _limit(self, broker: Any, message: Any) -> int | None:
        """The retries the Retries middleware allows ``message``: its ``max_retries`` option,
        the actor's, the middleware's (0 without the middleware: a failure is not retried)."""
        retries = next((m for m in broker.middleware if isinstance(m, Retries)), None)
        actor = broker.get_actor(message.actor_name)
        default = retries.max_retries if retries is not None else 0
        limit = message.options.get("max_retries", actor.options.get("max_retries", default))
        return limit if isinstance(limit, int) else None

    def _dead_letter(
        self,
        broker: Any,
        message: Any,
        outcome: Outcome,
        reason: str,
        deliveries: int | None = None,
        key: str | None = None,
    ) -> NoReturn:
        """Send ``message`` to its dead-letter queue with ``reason``, record the failure for
        a caller waiting on its result, and stop here (the actor never runs)."""
        LOGGER.warning(
            "oncely dramatiq message %s (%s): dead-lettered: %s",
            message.message_id,
            message.actor_name,
            shown_text(reason, key, self.inbox.log_keys),
        )
        queue = xq_name(message.queue_name)
        channel = getattr(broker, "channel", None) if _is_rabbitmq(broker) else None
        if channel is None:
            # Dramatiq's own dead letter: the worker nacks a failed message after the skip.
            message.fail()
        else:
            import pika  # noqa: PLC0415 - with the RabbitMQ broker only

            copy = message.copy(options={REASON_OPTION: reason})
            letter = DeadLetter(
                outcome=outcome.value,
                reason=reason,
                consumer=self.inbox.consumer,
                deliveries=(
                    int(message.options.get("retries") or 0) + 1
                    if deliveries is None
                    else deliveries
                ),
            )
            channel.basic_publish(
                exchange="",
                routing_key=queue,
                body=copy.encode(),
                properties=pika.BasicProperties(delivery_mode=2, headers=letter.headers()),
            )  # and the original is acknowledged after the skip
        failure = DeadLettered(f"{outcome.value}: {reason}; the message is in {queue}")
        self._store_failure(broker, message, failure)
        # A skip, never a return: the worker would then go on as if the actor had returned
        # None (the Results middleware storing it, an on_success callback sent).
        raise SkipMessage(f"dead-lettered: {reason}")

    def _store_failure(self, broker: Any, message: Any, failure: OncelyError) -> None:
        """Keep ``failure`` as the result of ``message`` when the Results middleware stores
        the actor's results, so the caller's ``get_result`` raises ``ResultFailure`` with
        oncely's reason. Stored here, not left to the Results middleware: for a skipped
        message it stores None unless the message is failed, and the RabbitMQ dead letter
        cannot be failed (the broker would dead-letter it a second time, without the reason);
        for a failed one it stores only the ``SkipMessage``. So the Results middleware is told
        to store nothing for this delivery (``store_results`` off, as for a copy sent again
        later): a None would read as a success for work that never ran."""
        results = next((m for m in broker.middleware if isinstance(m, Results)), None)
        if results is None:
            return
        actor = broker.get_actor(message.actor_name)

        def option(name: str, default: Any) -> Any:  # the message's, the actor's, the default
            return message.options.get(name, actor.options.get(name, default))

        if not option("store_results", results.store_results):
            return
        ttl = option("result_ttl", results.result_ttl)
        message.options["store_results"] = False  # after the RabbitMQ copy: it keeps its own
        try:
            results.backend.store_exception(message, failure, ttl)
        except Exception as exc:  # the letter is kept; the caller's answer is a courtesy
            LOGGER.error(
                "oncely dramatiq message %s (%s): the failure could not be stored for its "
                "caller: %r",
                message.message_id,
                message.actor_name,
                exc,
            )

    # ------------------------------------------------------------------ after the actor

    def after_process_message(
        self,
        broker: Any,
        message: Any,
        *,
        result: Any = None,
        exception: BaseException | None = None,
    ) -> None:
        _REPLAY.value = _NOTHING  # not taken if the actor did not run (a later middleware)
        with self._lock:
            claimed = self._claims.pop(id(message), None)
        if claimed is None:
            return
        # It ran: a retry the Retries middleware sends waits for a running copy from the
        # first, short step again.
        message.options.pop(IN_FLIGHT_RESENDS, None)
        self._disarm(broker, message)
        if exception is None:
            claimed.complete(result)
        elif isinstance(exception, Reject):
            # Marked rejected: the Retries middleware sends the message again, and that
            # delivery meets the mark and is dead-lettered with the reason.
            claimed.reject(exception.reason)
        else:
            claimed.release(f"the actor raised {type(exception).__name__}: {exception}")

    def after_skip_message(self, broker: Any, message: Any) -> None:
        _REPLAY.value = _NOTHING  # a later middleware skipped it: never the next message's
        with self._lock:
            claimed = self._claims.pop(id(message), None)
        if claimed is not None:  # another middleware skipped it after the claim
            self._disarm(broker, message)
            claimed.release("the message was skipped")

    def _disarm(self, broker: Any, message: Any) -> None:
        """End, before the claim is ended, what Dramatiq would otherwise end only after it:
        the ``TimeLimit`` and ``ShutdownNotifications`` of this thread, which raise into it
        whatever code it runs. Their own ``after_*`` hooks come after this middleware's (the
        hooks after a message run in reverse order), so an actor that returned just before
        its time limit had ``TimeLimitExceeded`` raised into the completion of its claim: the
        claim was left in progress, the Retries middleware sent the message again, and the
        copy took the lapsed claim over and ran the actor a second time."""
        for middleware in broker.middleware:
            if middleware is self:
                return
            if isinstance(middleware, TimeLimit | ShutdownNotifications):
                ended: Any = middleware.after_process_message  # Dramatiq's: untyped
                ended(broker, message)


def _is_rabbitmq(broker: Any) -> bool:
    return type(broker).__name__ == "RabbitmqBroker"

"""taskiq tasks that apply each logical message once: a broker middleware and a worker
receiver on an :class:`~oncely.AsyncInbox` (the two-phase mode).

Tested with the real ``taskiq worker`` (worker processes) on RabbitMQ through
``taskiq-aio-pika``, a worker ``SIGKILL``ed mid-task and a task that ends its worker process on
every run included (``tests/integrations/test_taskiq.py``).

::

    from oncely.integrations.taskiq import Idempotency, send_with_key

    broker = AioPikaBroker(url).with_middlewares(Idempotency(inbox))

    @broker.task(idempotency_key=lambda order_id, amount: f"charge:{order_id}")
    async def charge(order_id: str, amount: int) -> dict: ...

    await charge.kiq("o-1", 42)                      # the key comes from the arguments
    await send_with_key(notify, "mail:o-1", "o-1")   # or the producer names it, on purpose

and the worker runs with oncely's receiver::

    taskiq worker app:broker --receiver oncely.integrations.taskiq:Receiver

taskiq gives a middleware no way to skip a task or to leave a message unacknowledged, so the
claim lives in the receiver, which the middleware requires: a worker started without it
stops at start-up with a :class:`~oncely.ConfigurationError` instead of running keyed tasks
unprotected. A task takes part when it declares ``idempotency_key``: a function of its
arguments, or ``"sent"`` for a key the producer gives with :func:`send_with_key`. taskiq's
task id is never the key otherwise: ``kiq()`` mints a new one each call.

=====================================  ================================================
the first message with a key           the task runs; the claim completes when it
                                       returns and is released when it raises, and the
                                       message is sent again after ``retry_delay`` s up
                                       to ``max_retries`` times (a task label overrides
                                       it), then dead-lettered
``Context.requeue()`` in the task      the claim is released, so the copy taskiq sent
                                       runs the task (never answered as a duplicate)
a duplicate (the key completed)        the first result is the task's result, the task
                                       not run
a copy while the first still runs      sent again ``retry_in_flight`` s later (not one of
(a worker killed mid-task)             its retries) and this copy acknowledged; each time
                                       twice as long as the last, up to what is left of
                                       the running claim's lease; taken over once a dead
                                       worker's lease lapses. A copy sent again (this way
                                       or as a retry) that comes back to the process that
                                       sent it runs once the copy it came from is
                                       acknowledged: else a run that ended the process
                                       left two copies of the message
a run that took its worker process     taskiq sees no failure: the message goes to the
with it (``os._exit``, the OOM         process taskiq starts again, for ever. The next
killer)                                copy takes the dead run's claim over once its lease
                                       lapses, one attempt higher; when the runs in a row
                                       that never finished are more than ``max_retries``
                                       (the task's label, else the middleware's), it is
                                       dead-lettered ("none of its N runs finished")
                                       instead of run again, its result that error
the store cannot answer                sent again later the same way (up to 30 s apart),
                                       never run unprotected
the store is down when the worker      the worker process stops before taking a message
starts, or its tables cannot be used   (exit code 3, or 4 for the tables), the store
                                       named in the log; taskiq starts it again, so pass
                                       ``--max-fails`` to let the command stop
the key with other arguments, no key,  dead-lettered with the reason, and the task's
``oncely.Reject``, taskiq's            result is the error :class:`DeadLettered`
``Context.reject()``                   (a rejection is never retried)
a message taskiq cannot parse, or a    dead-lettered as it came, with the reason
task this worker does not know         (taskiq alone acknowledges and drops it)
=====================================  ================================================

Waits before a resend are spent in the worker, holding the message unacknowledged (taskiq's
brokers differ in whether they can delay a message, and a delay the broker ignores would spin);
keep ``retry_delay`` and ``retry_in_flight`` to seconds (a copy's growing wait for a running
one is held to the running claim's lease, and to 5 minutes). A keyed task's ``timeout`` label
works on an async task (the timeout cancels it; the claim is given back and the task retried)
but not on a sync one: taskiq cannot stop its thread or process, which would go on running
while a retry ran the task again beside it. So a keyed sync task declared with ``timeout`` is
refused at start-up, and one sent with a ``timeout`` label runs to its end, the label
ignored with a warning. Do not also add taskiq's
``SimpleRetryMiddleware``/``SmartRetryMiddleware`` for keyed tasks: failures are already
retried here, and theirs would send a second copy.

Dead letters: on ``taskiq-aio-pika``'s ``AioPikaBroker`` they go to the broker's own
dead-letter queue (``taskiq.dead_letter`` unless the broker's ``dead_letter_queue`` says
otherwise), or to ``Idempotency(dead_letter_queue=...)``, declared durable before the first
dead letter when it does not exist (RabbitMQ would drop what is sent to it), as the
task message with the ``x-oncely-outcome/reason/consumer/deliveries`` headers of
:mod:`oncely.brokers` (``x-oncely-consumer``: the middleware's inbox's consumer name, on a
message no inbox saw too; the task's labels as headers, their names whole up to AMQP's 255
bytes); any other broker needs ``dead_letter=``, an async function given the
message's bytes and those headers (tested only on RabbitMQ).

taskiq's ``InMemoryBroker``, for users' unit tests, gets oncely's receiver from the middleware
at its start-up (it runs tasks itself, with no worker); give it ``dead_letter=``.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import uuid
from collections.abc import Awaitable, Callable, Mapping
from contextvars import ContextVar
from typing import Any

try:
    from taskiq import AckableMessage, BrokerMessage, TaskiqMessage, TaskiqMiddleware, TaskiqResult
    from taskiq.acks import AcknowledgeType
    from taskiq.brokers.inmemory_broker import InMemoryBroker
    from taskiq.exceptions import NoResultError, TaskRejectedError
    from taskiq.labels import prepare_label
    from taskiq.middlewares import SimpleRetryMiddleware, SmartRetryMiddleware
    from taskiq.receiver import Receiver as _TaskiqReceiver
except ImportError as exc:  # pragma: no cover - the extra is missing
    raise ImportError(
        "oncely.integrations.taskiq needs taskiq: pip install 'oncely[taskiq]'"
    ) from exc

from oncely._core.outcomes import Handled, Outcome
from oncely.brokers._shape import DeadLetter
from oncely.errors import ConfigurationError, OncelyError, Reject, ResultUnavailable, StoreError
from oncely.inbox.async_inbox import AsyncClaimed, AsyncInbox
from oncely.integrations._startup import check_stores_async
from oncely.integrations._task_keys import (
    SENT,
    Keyer,
    first_result,
    shown_key,
    shown_text,
    task_key,
)
from oncely.integrations._task_runs import (
    IN_FLIGHT_RESENDS,
    in_flight_delay,
    resends_of,
    unfinished,
    unfinished_reason,
)

__all__ = [
    "KEY_LABEL",
    "DeadLettered",
    "Idempotency",
    "Receiver",
    "send_with_key",
]

_RETRYING = (SimpleRetryMiddleware, SmartRetryMiddleware)
"""taskiq's retry middlewares: they turn a failure into ``NoResultError`` (refused)."""

LOGGER = logging.getLogger("oncely.taskiq")

_IN_HAND: ContextVar[asyncio.Event | None] = ContextVar("oncely_taskiq_in_hand", default=None)
"""Set by :meth:`Receiver.callback` for the copy it handles: the event set once its callback
ended (the copy acknowledged); None for a copy no acknowledgement is awaited of."""

KEY_LABEL = "oncely_key"
"""The label :func:`send_with_key` sets: the producer's key."""
REQUEUE_LABEL = "X-Taskiq-requeue"
"""The label taskiq's ``Context.requeue()`` counts a task's requeues in."""
RETRIES_LABEL = "oncely_retries"
"""The label a resent failure carries: how many times it failed before."""
KEY_OPTION = "idempotency_key"
_NAMESPACE = uuid.UUID("0b5e8d1c-4f2a-4c67-9a3e-7d21c4e5f908")

DeadLetterSink = Callable[[bytes, Mapping[str, Any]], Awaitable[None]]


class DeadLettered(OncelyError):
    """The task's message was dead-lettered (the message says why and where): the error of
    its result. One ``str`` argument, so a result backend rebuilds it."""


def stable_task_id(task_name: str, key: str) -> str:
    """The task id :func:`send_with_key` gives ``key``: the same for every send."""
    return str(uuid.uuid5(_NAMESPACE, f"{task_name}\n{key}"))


async def send_with_key(task: Any, key: str, *args: Any, **kwargs: Any) -> Any:
    """``task.kiq(*args, **kwargs)`` with ``key`` as its idempotency key (and a task id
    derived from it): every send with one key is one logical message."""
    if not isinstance(key, str) or not key:
        raise ValueError("send_with_key needs a non-empty str key")
    kicker = task.kicker().with_labels(**{KEY_LABEL: key})
    return await kicker.with_task_id(stable_task_id(task.task_name, key)).kiq(*args, **kwargs)


class Idempotency(TaskiqMiddleware):
    """The broker middleware (see the module docstring): holds the inbox and the settings,
    strips a key function from the labels a message is sent with, and refuses to start a
    worker that does not run :class:`Receiver`. ``retry_in_flight``: seconds before a copy
    that met its key running (or a store that did not answer) is sent again the first time
    (default 2; twice as long each time after)."""

    def __init__(
        self,
        inbox: AsyncInbox,
        *,
        max_retries: int = 3,
        retry_delay: float = 1.0,
        retry_in_flight: float = 2.0,
        dead_letter_queue: str | None = None,
        dead_letter: DeadLetterSink | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(inbox, AsyncInbox):
            raise ConfigurationError("Idempotency needs an oncely.AsyncInbox")
        if max_retries < 0 or retry_delay < 0 or retry_in_flight < 0:
            raise ConfigurationError("max_retries, retry_delay and retry_in_flight are >= 0")
        self.inbox = inbox
        self.max_retries = max_retries
        self.retry_delay = retry_delay
        self.retry_in_flight = retry_in_flight
        self._dead_letter_queue = dead_letter_queue
        self._dead_letter_queue_declared = False
        self.dead_letter = dead_letter
        self.receiver: Receiver | None = None

    async def startup(self) -> None:
        """Checks the worker's set-up, then (in a ``taskiq worker`` process, before it takes a
        message) connects the inbox's store and checks its schema: a store that cannot be
        reached stops the process with exit code 3, a schema this oncely cannot use with 4,
        after one log line naming the store. On ``InMemoryBroker`` the typed error is raised
        instead."""
        self._check_setup()
        if isinstance(self.broker, InMemoryBroker):
            await self.inbox.prepare()
        elif self.broker.is_worker_process:
            await check_stores_async([self.inbox], "taskiq")

    def _check_setup(self) -> None:
        broker: Any = self.broker
        if isinstance(broker, InMemoryBroker):  # users' unit tests: it runs tasks itself
            if not isinstance(broker.receiver, Receiver):
                old = broker.receiver
                broker.receiver = Receiver(
                    broker,
                    executor=old.executor,
                    validate_params=old.validate_params,
                    propagate_exceptions=old.propagate_exceptions,
                    max_async_tasks=30,
                )
        elif not broker.is_worker_process:
            return
        if self.receiver is None:
            raise ConfigurationError(
                "oncely's taskiq middleware needs its receiver in the worker: run "
                "taskiq worker ... --receiver oncely.integrations.taskiq:Receiver"
            )
        retrying = [type(m).__name__ for m in broker.middlewares if isinstance(m, _RETRYING)]
        if retrying:
            raise ConfigurationError(
                f"{', '.join(retrying)} cannot run beside oncely's Idempotency: on a failure "
                "it sends the task again and turns the error into NoResultError, which reads "
                "as a task that ended without a result, so the key would be recorded as done "
                "and the retries answered as duplicates (the task never runs again). "
                "Idempotency retries a failed task itself (Idempotency(max_retries=..., "
                "retry_delay=...), or the task's max_retries label) and dead-letters it after: "
                "remove the retry middleware"
            )
        if self.dead_letter is None and not _is_aio_pika(self.broker):
            raise ConfigurationError(
                f"{type(self.broker).__name__}: give Idempotency(dead_letter=...) an async "
                "function that keeps a refused message (only AioPikaBroker has one built in)"
            )

        for task in self.broker.get_all_tasks().values():
            _check_task(task)

    def pre_send(self, message: TaskiqMessage) -> TaskiqMessage:
        if message.labels.get(KEY_OPTION) not in (None, SENT):
            message.labels.pop(KEY_OPTION, None)  # a function: read where the task is
            if message.labels_types:
                message.labels_types.pop(KEY_OPTION, None)
        return message

    @property
    def dead_letter_queue(self) -> str:
        """Where dead letters go on RabbitMQ: the one given, else the broker's own
        dead-letter queue (``taskiq.dead_letter`` unless the broker was given another)."""
        if self._dead_letter_queue:
            return self._dead_letter_queue
        own = getattr(getattr(self.broker, "_dead_letter_queue", None), "name", None)
        return own if isinstance(own, str) and own else "taskiq.dead_letter"

    async def _declare_dead_letter_queue(self) -> None:
        """Make sure a ``dead_letter_queue`` given here exists before the first dead letter
        is sent to it: RabbitMQ drops a message sent to a queue that does not exist, so the
        dead letters vanished while the log said where they were. (The broker's own
        dead-letter queue is declared by the broker.)"""
        import aiormq  # noqa: PLC0415 - aio-pika's protocol library, present with it

        own = getattr(getattr(self.broker, "_dead_letter_queue", None), "name", None)
        name = self.dead_letter_queue
        if self._dead_letter_queue and name != own:
            connection: Any = getattr(self.broker, "write_conn", None)
            channel = await connection.channel()
            try:
                await channel.declare_queue(name, durable=True)
            except aiormq.exceptions.ChannelPreconditionFailed:
                pass  # it exists, declared with other arguments: it takes the letters
            finally:
                if not channel.is_closed:
                    await channel.close()
        self._dead_letter_queue_declared = True

    def keyer(self, task_name: str) -> Keyer | str | None:
        task = self.broker.find_task(task_name)
        return None if task is None else task.labels.get(KEY_OPTION)

    async def send_dead_letter(self, body: bytes, headers: Mapping[str, Any]) -> None:
        if self.dead_letter is not None:
            await self.dead_letter(body, headers)
            return
        import aio_pika  # noqa: PLC0415 - AioPikaBroker's own client, present with it

        from oncely.brokers.rabbitmq._frames import WholeHeaderNames  # noqa: PLC0415 - same

        if not self._dead_letter_queue_declared:
            await self._declare_dead_letter_queue()
        channel: Any = getattr(self.broker, "write_channel", None)
        await channel.default_exchange.publish(
            # Header names (the task's labels) whole, up to AMQP's 255 bytes: aio-pika's
            # encoder cuts them at 128, merging two labels that share their start.
            WholeHeaderNames(
                body, headers=dict(headers), delivery_mode=aio_pika.DeliveryMode.PERSISTENT
            ),
            routing_key=self.dead_letter_queue,
            mandatory=True,
        )

    async def kick_again(self, message: TaskiqMessage, **labels: Any) -> None:
        """Send ``message`` again as it is, with ``labels`` added."""
        again = message.model_copy(deep=True)
        types = dict(again.labels_types or {})
        for name, value in labels.items():
            again.labels[name], types[name] = prepare_label(value)
        again.labels_types = types
        await self.broker.kick(self.broker.formatter.dumps(again))


class Receiver(_TaskiqReceiver):
    """The worker receiver that claims each keyed task before it runs (see the module
    docstring); ``taskiq worker ... --receiver oncely.integrations.taskiq:Receiver``."""

    def __init__(self, broker: Any, *args: Any, **kwargs: Any) -> None:
        found = [m for m in broker.middlewares if isinstance(m, Idempotency)]
        if not found:
            raise ConfigurationError(
                "oncely's taskiq receiver needs the broker's middleware: "
                "broker.with_middlewares(Idempotency(inbox))"
            )
        self.idempotency: Idempotency = found[0]
        super().__init__(broker, *args, **kwargs)
        if self.ack_time in (AcknowledgeType.WHEN_RECEIVED, AcknowledgeType.MANUAL):
            raise ConfigurationError(
                f"oncely's taskiq receiver cannot run with --ack-type {self.ack_time.value}: "
                "a message acknowledged before its task ended is lost in a crash (use "
                "when_saved, the default, or when_executed)"
            )
        self.idempotency.receiver = self
        self._sent_again: dict[str, asyncio.Event] = {}
        """The task ids this process sent again (a retry, a copy that met its key running)
        while the copy it came from is not acknowledged yet: each one's event is set once that
        copy's callback ended, its acknowledgement sent."""

    async def callback(self, message: bytes | AckableMessage, raise_err: bool = False) -> None:
        data = message.data if isinstance(message, AckableMessage) else message
        try:
            parsed = self.broker.formatter.loads(message=data)
        except Exception as exc:
            return await self._unreadable(message, data, f"taskiq could not parse it: {exc!r}")
        if self.broker.find_task(parsed.task_name) is None:
            why = f"no task {parsed.task_name!r} is registered on this worker"
            named = {"task_id": parsed.task_id, "task_name": parsed.task_name}
            return await self._unreadable(message, data, why, named)
        earlier = self._sent_again.get(parsed.task_id)
        if earlier is not None:
            # This process sent the copy again and has not yet acknowledged the one it came
            # from, which the broker hands out again if the process ends first: a run that
            # ends it (os._exit, the OOM killer) made two copies of one message, the second
            # run again once the first was dead-lettered. The copy runs after that
            # acknowledgement.
            await earlier.wait()
        ended = asyncio.Event()
        # Only a copy the broker awaits an acknowledgement of (InMemoryBroker's copy sent
        # again runs inside the send, while the one it came from is still in hand).
        token = _IN_HAND.set(ended if isinstance(message, AckableMessage) else None)
        try:
            await super().callback(message, raise_err)
        except Exception:  # a resend or a dead letter the broker refused
            LOGGER.exception(
                "oncely taskiq %s[%s]: left unacknowledged (the broker redelivers it when this "
                "worker's connection closes)",
                parsed.task_name,
                parsed.task_id,
            )
        finally:
            _IN_HAND.reset(token)
            if self._sent_again.get(parsed.task_id) is ended:
                del self._sent_again[parsed.task_id]
            ended.set()

    async def _send_again(self, message: TaskiqMessage, **labels: Any) -> None:
        """Send ``message`` again with ``labels`` (:meth:`Idempotency.kick_again`); a copy
        that comes back to this process waits until the one in hand is acknowledged."""
        ended = _IN_HAND.get()
        if ended is not None:
            self._sent_again[message.task_id] = ended
        await self.idempotency.kick_again(message, **labels)

    async def _unreadable(
        self,
        message: bytes | AckableMessage,
        data: bytes,
        why: str,
        named: Mapping[str, str] | None = None,
    ) -> None:
        # No inbox saw it, but the one this worker's keyed tasks run through is the consumer
        # it came to, named on the letter as on every other one.
        letter = DeadLetter(
            outcome=Outcome.REJECTED.value,
            reason=why,
            consumer=self.idempotency.inbox.consumer,
            deliveries=1,
        )
        try:
            await self.idempotency.send_dead_letter(data, {**(named or {}), **letter.headers()})
        except Exception:
            LOGGER.exception(
                "oncely taskiq: %s, and its dead letter failed: left unacknowledged", why
            )
            return
        LOGGER.warning("oncely taskiq: dead-lettered a message: %s", why)
        if isinstance(message, AckableMessage):
            await _ack(message)

    async def run_task(
        self, target: Callable[..., Any], message: TaskiqMessage, *args: Any, **kwargs: Any
    ) -> TaskiqResult[Any]:
        mw = self.idempotency
        keyer = mw.keyer(message.task_name)
        if keyer is None:
            result: TaskiqResult[Any] = await super().run_task(target, message, *args, **kwargs)
            return result
        message = _untimed(message, target)
        try:
            key = task_key(
                keyer, message.labels.get(KEY_LABEL), tuple(message.args), message.kwargs
            )
        except Exception as exc:
            return await self._dead_letter(
                message, Outcome.REJECTED, f"the key could not be read: {exc!r}"
            )
        if not key:
            return await self._dead_letter(
                message, Outcome.REJECTED, "no idempotency key: the producer gave none"
            )
        payload = {"args": list(message.args), "kwargs": dict(message.kwargs)}
        try:
            claimed: AsyncClaimed[Any] = await mw.inbox.claim(key, payload)
        except StoreError as exc:
            said = shown_text(repr(exc), key, mw.inbox.log_keys)
            return await self._later(message, f"oncely could not claim it: {said}", None)
        if claimed.won:
            # It runs: a retry or a requeue of it waits for a running copy from the first,
            # short step again.
            message = _without(message, IN_FLIGHT_RESENDS)
            runs = unfinished(claimed.attempt, self._limit(message))
            if runs is not None:  # its worker died with each run: never run it again
                return await self._give_up(claimed, message, runs)
            return await self._run(claimed, target, message, *args, **kwargs)
        handled = claimed.handled
        assert handled is not None
        if handled.outcome is Outcome.DUPLICATE:
            try:
                return _result(
                    message, first_result(handled, target, message.task_name, mw.inbox.log_keys)
                )
            except ResultUnavailable as lost:  # the caller reads the error, not a None
                return _result(message, None, lost)
        if handled.outcome is Outcome.IN_FLIGHT:
            return await self._later(
                message,
                f"key {shown_key(key, mw.inbox.log_keys)} is being processed elsewhere",
                handled,
            )
        refused = await self._dead_letter(
            message, handled.outcome, handled.reason or "refused", key=key
        )
        if message.task_id == stable_task_id(message.task_name, key) and await self._answered(
            message, handled
        ):
            # send_with_key's task id comes from the key: this refused copy shares its result
            # with the first message, whose result stands (the refusal is in the dead letter).
            return _result(message, None, NoResultError())
        return refused

    async def _answered(self, message: TaskiqMessage, handled: Handled[Any]) -> bool:
        """Whether the task id of ``message``, refused with ``handled``, already has its
        answer (a first message's result) that this copy must not write over. Not a key
        refused on its own (too long: no message had it before), nor an escalated stale
        claim (its worker died before answering)."""
        try:
            return bool(await self.broker.result_backend.is_result_ready(message.task_id))
        except Exception:  # the backend cannot say: what the outcome says
            return handled.outcome is Outcome.KEY_CONFLICT or (
                handled.outcome is Outcome.REJECTED and handled.record is not None
            )

    async def _run(
        self,
        claimed: AsyncClaimed[Any],
        target: Callable[..., Any],
        message: TaskiqMessage,
        *args: Any,
        **kwargs: Any,
    ) -> TaskiqResult[Any]:
        requeues = message.labels.get(REQUEUE_LABEL)
        result: TaskiqResult[Any] = await super().run_task(target, message, *args, **kwargs)
        error = result.error
        if error is None:
            await claimed.complete(result.return_value)
            return result
        if isinstance(error, NoResultError):
            if message.labels.get(REQUEUE_LABEL) != requeues:
                # Context.requeue() sent the task again: not done, so its copy runs it.
                await claimed.release("the task requeued itself (Context.requeue)")
            else:
                await claimed.complete(None)
            return result
        if isinstance(error, Reject | TaskRejectedError):
            why = error.reason if isinstance(error, Reject) else "the task rejected itself"
            await claimed.reject(why)
            return await self._dead_letter(message, Outcome.REJECTED, why, key=claimed.key)
        await claimed.release(f"the task raised {type(error).__name__}: {error}")
        return await self._retry(message, error, claimed.key)

    async def _give_up(
        self, claimed: AsyncClaimed[Any], message: TaskiqMessage, runs: int
    ) -> TaskiqResult[Any]:
        """Dead-letter a message whose last ``runs`` runs never finished (their worker process
        died), instead of running it again. The claim is released once the letter is sent (a
        copy sent on purpose later runs afresh); if the letter cannot be sent, the key is
        marked rejected, so the copy the broker gives again is dead-lettered, never run."""
        reason = unfinished_reason(runs)
        try:
            refused = await self._dead_letter(
                message, Outcome.REJECTED, reason, deliveries=runs, key=claimed.key
            )
        except Exception:
            with contextlib.suppress(Exception):  # else its lease lapses: the next copy's
                await claimed.reject(reason)  # claim is one attempt higher, and gives up too
            raise
        await claimed.release(reason)
        return refused

    def _limit(self, message: TaskiqMessage) -> int:
        """The retries ``message`` is allowed: its ``max_retries`` label (the task's), else
        the middleware's; a label that is no count reads as the middleware's."""
        given = message.labels.get("max_retries")
        try:
            return max(int(given), 0) if given is not None else self.idempotency.max_retries
        except (TypeError, ValueError):
            LOGGER.warning(
                "oncely taskiq %s[%s]: its max_retries label %r is no count: the middleware's "
                "%d is used",
                message.task_name, message.task_id, given, self.idempotency.max_retries,
            )  # fmt: skip
            return self.idempotency.max_retries

    async def _retry(
        self, message: TaskiqMessage, error: BaseException, key: str | None = None
    ) -> TaskiqResult[Any]:
        mw = self.idempotency
        retries = int(message.labels.get(RETRIES_LABEL) or 0)
        if retries >= self._limit(message):
            return await self._dead_letter(
                message,
                Outcome.REJECTED,
                f"failed on all {retries + 1} deliveries; last: {type(error).__name__}: {error}",
                key=key,
            )
        await asyncio.sleep(mw.retry_delay)
        await self._send_again(message, **{RETRIES_LABEL: retries + 1})
        return _result(message, None, NoResultError())

    async def _later(
        self, message: TaskiqMessage, why: str, handled: Handled[Any] | None
    ) -> TaskiqResult[Any]:
        """Send ``message`` again later (not one of its retries) and acknowledge this copy:
        ``retry_in_flight`` seconds the first time, twice as long each time after, up to what
        is left of the lease the key is held under (``handled``: the in-flight outcome, or
        None when the store did not answer). The wait is spent here, the copy held
        unacknowledged. Never runs the task."""
        mw = self.idempotency
        resends = resends_of(message.labels.get(IN_FLIGHT_RESENDS))
        delay = in_flight_delay(mw.retry_in_flight, resends, handled)
        await asyncio.sleep(delay)
        await self._send_again(message, **{IN_FLIGHT_RESENDS: resends + 1})
        LOGGER.info(
            "oncely taskiq %s[%s]: %s; sent again after %.1f s (resend %d)",
            message.task_name, message.task_id, why, delay, resends + 1,
        )  # fmt: skip
        return _result(message, None, NoResultError())

    async def _dead_letter(
        self,
        message: TaskiqMessage,
        outcome: Outcome,
        reason: str,
        deliveries: int | None = None,
        key: str | None = None,
    ) -> TaskiqResult[Any]:
        mw = self.idempotency
        where = mw.dead_letter_queue if mw.dead_letter is None else "the dead-letter sink"
        text = f"{outcome.value}: {reason}; the message is in {where}"
        if deliveries is None:
            deliveries = int(message.labels.get(RETRIES_LABEL) or 0) + 1
        letter = DeadLetter(
            outcome=outcome.value, reason=reason, consumer=mw.inbox.consumer, deliveries=deliveries
        )
        sent = self.broker.formatter.dumps(message)
        headers = {
            "task_id": message.task_id,
            "task_name": message.task_name,
            **_wire_labels(sent),
            **letter.headers(),
        }
        await mw.send_dead_letter(sent.message, headers)
        LOGGER.warning(
            "oncely taskiq %s[%s]: dead-lettered: %s",
            message.task_name, message.task_id, shown_text(text, key, mw.inbox.log_keys),
        )  # fmt: skip
        return _result(message, None, DeadLettered(text))


def _check_task(task: Any) -> None:
    """Refuse a keyed task's labels that would run it unprotected."""
    if task.labels.get(KEY_OPTION) is None:
        return
    ack = str(task.labels.get("ack_type", "")).lower()
    if ack in ("when_received", "manual"):
        raise ConfigurationError(
            f"task {task.task_name}: ack_type={ack} cannot go with idempotency_key "
            "(a message acknowledged before its task ended is lost in a crash)"
        )
    if task.labels.get("timeout") is not None and not _is_async(task.original_func):
        raise ConfigurationError(
            f"task {task.task_name}: timeout cannot go with idempotency_key on a sync task: "
            "taskiq cannot stop its thread (or process), so a task past its timeout goes on "
            "running while its claim is given back and a retry runs it a second time; make "
            "the task async (its timeout then cancels it) or remove the timeout"
        )


def _is_async(target: Callable[..., Any]) -> bool:
    return inspect.iscoroutinefunction(target)


def _untimed(message: TaskiqMessage, target: Callable[..., Any]) -> TaskiqMessage:
    """``message`` without a ``timeout`` label when ``target`` is sync: taskiq's timeout
    cannot stop a sync task (its thread or process runs on), and its claim given back meanwhile
    would let a retry run the task a second time beside it."""
    if message.labels.get("timeout") is None or _is_async(target):
        return message
    LOGGER.warning(
        "oncely taskiq %s[%s]: its timeout label is ignored: taskiq cannot stop a sync task, "
        "so it runs to its end under its claim (a retry beside it would run it twice)",
        message.task_name,
        message.task_id,
    )
    return _without(message, "timeout")


def _without(message: TaskiqMessage, label: str) -> TaskiqMessage:
    """``message`` without ``label`` (itself when it has none)."""
    if label not in message.labels:
        return message
    copy = message.model_copy(update={"labels": dict(message.labels)})
    copy.labels.pop(label, None)
    if message.labels_types:
        copy.labels_types = {k: v for k, v in message.labels_types.items() if k != label}
    return copy


def _wire_labels(sent: BrokerMessage) -> dict[str, Any]:
    return {k: v for k, v in sent.labels.items() if isinstance(v, str | int | float | bool)}


def _result(
    message: TaskiqMessage, value: Any, error: BaseException | None = None
) -> TaskiqResult[Any]:
    return TaskiqResult(
        is_err=error is not None and not isinstance(error, NoResultError),
        return_value=value,
        execution_time=0.0,
        labels=message.labels,
        error=error,
    )


async def _ack(message: AckableMessage) -> None:
    done = message.ack()
    if asyncio.iscoroutine(done) or isinstance(done, asyncio.Future):
        await done


def _is_aio_pika(broker: Any) -> bool:
    return type(broker).__module__.startswith("taskiq_aio_pika")

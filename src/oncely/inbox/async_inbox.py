"""The inbox: runs a handler for each logical message effectively once (R1).

Two modes, one decision table (:mod:`oncely._core.flows`):

* **Transactional** (:meth:`AsyncInbox.handle_in_transaction`, R7, R8): the dedup marker is
  inserted inside the transaction the handler writes in, so marker, business writes and result
  commit together or not at all. A crash anywhere leaves either everything or nothing.
* **Two-phase** (:meth:`AsyncInbox.handle`, R10): for effects outside any transaction (an HTTP
  call, an e-mail). The key is claimed ``in_progress`` under a lease that a heartbeat renews; the
  result is recorded under the claim's fencing token; a failure releases the claim so a
  redelivery retries; a lapsed lease goes through the ``on_stale`` policy.

:class:`AsyncInbox` is one class assembled from its parts: the configuration and the outcome
of every message (:mod:`oncely.inbox.async_base`), the two-phase mode
(:mod:`oncely.inbox.async_two_phase`) and the transactional mode
(:mod:`oncely.inbox.async_transactional`). This module adds what is built on them: batches,
broker messages, the decorator, and the records of one consumer.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from datetime import timedelta
from time import perf_counter
from typing import ParamSpec, TypeVar, cast

from oncely._core.flows import Step, decide
from oncely._core.keys import Envelope, KeySource, validate_key
from oncely._core.outcomes import Handled
from oncely._core.records import ClaimRequest, Record
from oncely.inbox.async_base import new_token
from oncely.inbox.async_transactional import TransactionalMode
from oncely.inbox.async_two_phase import TwoPhaseMode
from oncely.inbox.async_types import AsyncFunction, AsyncHandler

__all__ = ["AsyncInbox"]

P = TypeVar("P")
R = TypeVar("R")
PS = ParamSpec("PS")


class AsyncInbox(TwoPhaseMode, TransactionalMode):
    """Processes each logical message once for one consumer, on top of a store.

    ``consumer`` scopes every record (R5): give each independent subscriber of a channel its
    own name and they never stop one another. The store may be shared by many inboxes.

    Raises :class:`~oncely.ConfigurationError` for a policy that cannot work (a lease longer
    than retention, a blank consumer). Message-level problems never raise: they come back as
    outcomes (:class:`~oncely.Handled`). A store failure raises :class:`~oncely.StoreError`,
    after which nothing was acknowledged and retrying the message later is safe.
    """

    __slots__ = ()

    async def handle_batch(
        self,
        items: Sequence[tuple[str, P]],
        handler: AsyncHandler[P, R],
        *,
        correlation_id: str | None = None,
    ) -> list[Handled[R]]:
        """:meth:`handle` for a batch of ``(key, payload)`` pairs, as a batch consumer receives
        them (a Redis Streams read with ``COUNT``, a Kafka-style poll).

        All keys are claimed in one round trip (:meth:`~oncely.AsyncStore.claim_many`); then the
        handler runs for each key this call won, one after the other, each completed (or
        released) on its own. Returns one outcome per item, in the order given. A key repeated
        within the batch is processed once; its later copies are ``in_flight`` or
        ``duplicate`` like any concurrent copy.
        """
        started = perf_counter()
        admitted: list[tuple[str, str | None] | Handled[R]] = [
            self._admit(key, payload, started, correlation_id) for key, payload in items
        ]
        requests = [
            ClaimRequest(entry[0], entry[1], new_token())
            for entry in admitted
            if not isinstance(entry, Handled)
        ]
        claims = iter(
            await self._store.claim_many(
                self._consumer,
                requests,
                lease_ms=self._lease_ms,
                keep_ms=self._keep_ms,
                takeover=self._takeover,
            )
            if requests
            else []
        )
        results: list[Handled[R]] = []
        for entry, (_key, payload) in zip(admitted, items, strict=True):
            if isinstance(entry, Handled):
                results.append(entry)
                continue
            claim = next(claims)
            step = decide(claim, entry[1])
            if step is Step.PROCEED:
                results.append(await self._run(claim, payload, handler, correlation_id, started))
            elif step is Step.STALE:
                # Rare: a reconciler decides; the single-message path has that logic.
                results.append(
                    await self.handle(entry[0], payload, handler, correlation_id=correlation_id)
                )
            else:
                results.append(self._settle(step, claim, correlation_id, started))
        return results

    async def handle_message(
        self,
        envelope: Envelope,
        handler: AsyncHandler[object, R],
        *,
        key: KeySource | None = None,
        wait: timedelta | None = None,
    ) -> Handled[R]:
        """:meth:`handle` for a broker message: the key comes from ``key`` (default: the
        producer's message id). A message without a usable key is ``rejected`` with the reason
        (dead-lettered by adapters), never processed unprotected (R2-R4)."""
        found: str | Handled[R] = self._message_key(envelope, key, perf_counter())
        if isinstance(found, Handled):
            return found
        return await self.handle(
            found, envelope.body, handler, correlation_id=envelope.correlation_id, wait=wait
        )

    def idempotent(
        self, *, key: Callable[..., str], wait: timedelta | None = timedelta(seconds=10)
    ) -> Callable[[AsyncFunction[PS, R]], AsyncFunction[PS, R]]:
        """Decorate a function so each key runs once; repeats return the first result.

        ``key`` receives the function's arguments and returns the idempotency key; the bound
        arguments are the payload that is fingerprinted, so the same key with other arguments
        raises :class:`~oncely.KeyConflict`. A call that finds the key in flight waits up to
        ``wait`` for it, then raises :class:`~oncely.InFlight`. A raising function releases
        the key and its exception propagates unchanged.
        """

        def decorate(fn: AsyncFunction[PS, R]) -> AsyncFunction[PS, R]:
            signature = inspect.signature(fn)

            @functools.wraps(fn)
            async def once(*args: PS.args, **kwargs: PS.kwargs) -> R:
                bound = signature.bind(*args, **kwargs)
                bound.apply_defaults()

                async def run(_payload: object) -> R:
                    return await fn(*args, **kwargs)

                handled = await self.handle(
                    key(*args, **kwargs), dict(bound.arguments), run, wait=wait
                )
                return cast(R, handled.unwrap())

            return once

        return decorate

    # ------------------------------------------------------------------------ records

    async def get(self, key: str) -> Record | None:
        """This consumer's unexpired record for ``key``."""
        return await self._store.get(self._consumer, validate_key(key, self._limits))

    async def forget(self, key: str) -> bool:
        """Delete this consumer's record for ``key`` (an operator's decision: the next delivery
        is processed again). True if there was one."""
        return await self._store.forget(self._consumer, validate_key(key, self._limits))

    async def aclose(self) -> None:
        """Stop background heartbeats. The store stays open (it is yours)."""
        self._heartbeats.close()

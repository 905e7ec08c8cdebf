"""The inbox's two-phase mode (R10): :meth:`~oncely.AsyncInbox.handle` and what it needs.

For effects outside any transaction (an HTTP call, an e-mail). The key is claimed
``in_progress`` under a lease that a heartbeat renews while the handler runs; the result is
recorded under the claim's fencing token (a short store outage is ridden out, since the effects
are done); a failure releases the claim so a redelivery retries; a poison message is failed for
good; a lapsed lease goes through the ``on_stale`` policy or its reconciler.
"""

from __future__ import annotations

from oncely._twin import ASYNC

if ASYNC:
    from asyncio import sleep
else:
    from time import sleep

import functools
from datetime import timedelta
from time import perf_counter
from typing import TypeVar, cast

from oncely._core.context import _CURRENT
from oncely._core.flows import Step, decide
from oncely._core.keys import validate_key
from oncely._core.outcomes import Handled, Outcome
from oncely._core.policy import StaleClaim
from oncely._core.records import Claim, ClaimStatus, Record
from oncely.errors import LeaseLost, Reject, StoreError, StoreUnavailable
from oncely.inbox.async_base import InboxBase, lost_reason, new_token, reclaim_reason
from oncely.inbox.async_types import AsyncHandler

__all__ = ["TwoPhaseMode"]

P = TypeVar("P")
R = TypeVar("R")

_COMPLETE_PAUSES = (0.05, 0.2, 0.8, None)  # pauses between tries; None: the last try
_MAX_ROUNDS = 8


class TwoPhaseMode(InboxBase):
    """Claim, run, then complete / release / fail under the claim's token (R10)."""

    __slots__ = ()

    async def handle(
        self,
        key: str,
        payload: P,
        handler: AsyncHandler[P, R],
        *,
        correlation_id: str | None = None,
        wait: timedelta | None = None,
    ) -> Handled[R]:
        """Run ``handler(payload)`` unless ``key`` was processed before (two-phase mode).

        Returns ``processed`` (or ``stale_reclaimed``) with the handler's result, ``duplicate``
        with the result stored the first time, ``in_flight`` while another worker holds a live
        claim, ``key_conflict`` when the key was used for other content, ``escalated`` when a
        lapsed claim needs a person, ``failed`` when the handler raised (the claim is released
        so a redelivery retries) and ``rejected`` for a bad key or a poison message (the handler
        raised :class:`~oncely.Reject`, or did so for this key before).

        With ``wait``, a caller that is not a broker waits up to that long for an in-flight
        claim to finish and receives its result (or takes over its work if it is released).
        """
        started = perf_counter()
        try:  # _admit, inline: this runs for every message
            checked = validate_key(key, self._limits)
            fp = self._fingerprint(payload)
        except Exception as exc:
            return self._refused(key, exc, started, correlation_id)
        deadline = None if wait is None else started + wait.total_seconds()
        pause = 0.005
        store = self._store
        rounds = 0
        while rounds < _MAX_ROUNDS:
            claim = await store.claim(
                self._consumer,
                checked,
                fingerprint=fp,
                token=new_token(),
                lease_ms=self._lease_ms,
                keep_ms=self._keep_ms,
                takeover=self._takeover,
            )
            step = decide(claim, fp)
            if step is Step.PROCEED:
                return await self._run(claim, payload, handler, correlation_id, started)
            if step is Step.STALE:
                handled = await self._stale(claim, fp, payload, handler, correlation_id, started)
                if handled is not None:
                    return handled
                rounds += 1
                continue
            if step is Step.IN_FLIGHT and deadline is not None:
                remaining = deadline - perf_counter()
                if remaining > 0:
                    await sleep(min(pause, remaining))
                    pause = min(pause * 2, 0.25)
                    continue
            return self._settle(step, claim, correlation_id, started)
        raise StoreUnavailable(f"claim for key {checked!r} kept changing hands; try again later")

    async def _run(
        self,
        claim: Claim,
        payload: P,
        handler: AsyncHandler[P, R],
        correlation_id: str | None,
        started: float,
    ) -> Handled[R]:
        record = claim.record
        key = record.key
        token = record.token
        beat = None
        if self._lease.heartbeat:
            beat = self._heartbeats.start(
                functools.partial(self._renew, key, token), self._renew_every
            )
        context = _CURRENT.set((self._consumer, key, record.attempt, correlation_id, "two_phase"))
        error: BaseException | None = None
        result: R | None = None
        try:
            result = await handler(payload)
        except BaseException as exc:
            error = exc
        finally:
            _CURRENT.reset(context)
            if beat is not None:
                await beat.stop()
        if error is not None:
            if isinstance(error, Reject):
                return await self._reject(record, error.reason, correlation_id, started)
            await self._release_quietly(key, token)
            if not isinstance(error, Exception):
                raise error
            # The record itself was released: the outcome reports the attempt, not the record.
            return self._failed(key, error, started, correlation_id, record.attempt)
        data, note = (None, None) if result is None else self._encode(result, strict=False)
        try:
            done = await self._complete(key, token, data, note)
        except LeaseLost as lost:
            return self._lost(lost, key, record.attempt, correlation_id, started)
        outcome = Outcome.PROCESSED
        reason = note
        if claim.status is ClaimStatus.TAKEN_OVER:
            outcome = Outcome.STALE_RECLAIMED
            reason = note or reclaim_reason(claim)
        # Positional: the hot path (value, reason, error, record, attempt, correlation_id).
        return self._done(outcome, key, started, result, reason, None, done, None, correlation_id)

    async def _complete(self, key: str, token: str, data: bytes | None, note: str | None) -> Record:
        # The effects are done: losing the completion would let a redelivery repeat them, so
        # a short outage is ridden out (complete is idempotent for the same token).
        for pause in _COMPLETE_PAUSES:
            try:
                return await self._store.complete(
                    self._consumer, key, token=token, result=data, keep_ms=self._keep_ms, note=note
                )
            except StoreUnavailable:
                if pause is None:
                    raise
                await sleep(pause)
        raise AssertionError("unreachable")  # pragma: no cover

    async def _renew(self, key: str, token: str) -> None:
        try:
            await self._store.renew(
                self._consumer, key, token=token, lease_ms=self._lease_ms, keep_ms=self._keep_ms
            )
        except LeaseLost as lost:
            self._observer.logger.warning(
                "oncely lease lost consumer=%s key=%s: %s", self._consumer, key, lost_reason(lost)
            )
        except Exception as exc:
            self._observer.logger.warning(
                "oncely could not renew the lease consumer=%s key=%s: %s", self._consumer, key, exc
            )

    async def _release_quietly(self, key: str, token: str) -> None:
        try:
            await self._store.release(self._consumer, key, token=token)
        except LeaseLost:
            pass  # another worker owns the key now; nothing of ours to release
        except StoreError as exc:
            self._observer.logger.warning(
                "oncely could not release the claim consumer=%s key=%s (%s); a redelivery "
                "retries once the lease lapses",
                self._consumer,
                key,
                exc,
            )

    async def _reject(
        self, record: Record, reason: str, correlation_id: str | None, started: float
    ) -> Handled[R]:
        key = record.key
        try:
            done = await self._store.fail(
                self._consumer,
                key,
                token=record.token,
                error=reason[: self._limits.max_error_chars],
                keep_ms=self._keep_failed_ms,
            )
        except LeaseLost as lost:
            return self._lost(lost, key, record.attempt, correlation_id, started)
        return self._rejected(key, reason, started, correlation_id, done)

    async def _stale(
        self,
        claim: Claim,
        fp: str | None,
        payload: P,
        handler: AsyncHandler[P, R],
        correlation_id: str | None,
        started: float,
    ) -> Handled[R] | None:
        """Apply ``on_stale`` to a lapsed claim. None: the record moved on; decide again."""
        record = claim.record
        key = record.key
        if self._reconciler is None:
            return self._settle(Step.STALE, claim, correlation_id, started)
        try:
            resolution = await self._reconciler(StaleClaim(record, payload))
        except Exception as exc:
            return self._done(
                Outcome.FAILED,
                key,
                started,
                reason=f"reconciler raised {type(exc).__name__}: {exc}",
                error=exc,
                record=record,
                correlation_id=correlation_id,
            )
        if resolution.action == "retry":
            taken = await self._store.takeover(
                self._consumer,
                key,
                expected_token=record.token,
                fingerprint=fp,
                token=new_token(),
                lease_ms=self._lease_ms,
                keep_ms=self._keep_ms,
            )
            if taken.won:
                return await self._run(taken, payload, handler, correlation_id, started)
            return None
        if resolution.action == "completed":
            data, note = self._encode(resolution.result, strict=False)
            try:
                done = await self._store.complete(
                    self._consumer,
                    key,
                    token=record.token,
                    result=data,
                    keep_ms=self._keep_ms,
                    note=note or "reconciled: the external system showed the effect done",
                )
            except LeaseLost:
                return None
            return self._done(
                Outcome.DUPLICATE,
                key,
                started,
                value=cast(R, resolution.result),
                record=done,
                reason="stale claim reconciled as completed",
                correlation_id=correlation_id,
            )
        return self._done(
            Outcome.ESCALATED,
            key,
            started,
            reason=resolution.reason or "the reconciler escalated the stale claim",
            record=record,
            correlation_id=correlation_id,
        )

"""What every part of :class:`~oncely.inbox.async_inbox.AsyncInbox` shares: its configuration, the
fencing tokens of its claims, and the outcome of every message (how it is built, logged and
handed to hooks, R16).

:class:`InboxBase` holds the inbox's state (its ``__slots__``) and validates the policies once;
the two modes (:mod:`oncely.inbox.async_two_phase`, :mod:`oncely.inbox.async_transactional`)
derive from it, and :class:`~oncely.inbox.async_inbox.AsyncInbox` combines them.
"""

from __future__ import annotations

import itertools
import logging
import os
from time import perf_counter
from typing import Any, Literal, TypeVar, cast

from oncely._core.codec import Codec, JSONCodec
from oncely._core.fingerprint import Fingerprinter
from oncely._core.fingerprint import fingerprint as payload_fingerprint
from oncely._core.flows import Step
from oncely._core.keys import Envelope, KeySource, MessageIdKey, validate_consumer, validate_key
from oncely._core.observe import Hook, Observer
from oncely._core.outcomes import Handled, Outcome, new_handled
from oncely._core.policy import AsyncReconciler, Lease, Limits, OnStale, Retention
from oncely._core.records import Claim, Record
from oncely.errors import ConfigurationError, LeaseLost, PayloadError, ResultTooLarge
from oncely.inbox.heartbeats import AsyncHeartbeats
from oncely.stores.async_protocols import AsyncStore, AsyncTransactionalStore

__all__ = ["InboxBase", "new_token"]

R = TypeVar("R")


class _Tokens:
    """Fencing tokens: a random per-process prefix and a counter. Unique across processes
    (64 random bits, drawn again in a forked child) and within one (the counter), and cheaper
    than reading the OS's randomness for every claim."""

    __slots__ = ("_count", "_prefix")

    def __init__(self) -> None:
        self._reseed()
        os.register_at_fork(after_in_child=self._reseed)

    def _reseed(self) -> None:
        self._prefix = os.urandom(8).hex()
        # Counting from 2**64: hex() then always spells "0x1" and 16 digits, and dropping
        # the first three characters is the counter zero-padded to 16 digits, without the
        # cost of a format specification.
        self._count = itertools.count(1 << 64)

    def new(self) -> str:
        return self._prefix + hex(next(self._count))[3:]


new_token = _Tokens().new  # a bound method: calling it skips the instance's __call__ slot
"""A new fencing token (32 hex digits), unique across processes and within one."""

_MESSAGE_ID = MessageIdKey()


class InboxBase:
    """The inbox's configuration and outcome plumbing (see :class:`~oncely.AsyncInbox`)."""

    __slots__ = (
        "_codec",
        "_consumer",
        "_fingerprint",
        "_heartbeats",
        "_keep_failed_ms",
        "_keep_ms",
        "_lease",
        "_lease_ms",
        "_limits",
        "_observer",
        "_reconciler",
        "_renew_every",
        "_retention",
        "_store",
        "_takeover",
        "_tx_store",
    )

    def __init__(
        self,
        store: AsyncStore,
        *,
        consumer: str,
        retention: Retention | None = None,
        lease: Lease | None = None,
        on_stale: OnStale | Literal["retry", "escalate"] | AsyncReconciler = OnStale.RETRY,
        fingerprint: Fingerprinter = payload_fingerprint,
        limits: Limits | None = None,
        codec: Codec | None = None,
        hooks: tuple[Hook, ...] | list[Hook] = (),
        logger: logging.Logger | None = None,
        log_keys: Literal["plain", "hash"] = "plain",
    ) -> None:
        self._store = store
        # Checked once: a runtime Protocol check costs tens of microseconds per call.
        self._tx_store: AsyncTransactionalStore[Any] | None = (
            store if isinstance(store, AsyncTransactionalStore) else None
        )
        self._consumer = validate_consumer(consumer)
        self._retention = retention if retention is not None else Retention()
        self._lease = lease if lease is not None else Lease()
        if self._lease.duration >= self._retention.keep:
            raise ConfigurationError(
                "the lease must be shorter than retention: a record must outlive its claim"
            )
        self._lease_ms = self._lease.duration_ms
        self._keep_ms = self._retention.keep_ms
        self._keep_failed_ms = self._retention.keep_failed_ms
        self._renew_every = self._lease.renew_every_s
        if callable(on_stale) and not isinstance(on_stale, str):
            self._reconciler: AsyncReconciler | None = on_stale
            self._takeover = False
        else:
            self._reconciler = None
            self._takeover = OnStale(on_stale) is OnStale.RETRY
        self._fingerprint = fingerprint
        self._limits = limits if limits is not None else Limits()
        self._codec: Codec = codec if codec is not None else JSONCodec()
        self._observer = Observer(hooks=hooks, logger=logger, log_keys=log_keys)
        self._heartbeats = AsyncHeartbeats()

    @property
    def consumer(self) -> str:
        return self._consumer

    @property
    def store(self) -> AsyncStore:
        return self._store

    def refuse(
        self, reason: str, *, key: str | None = None, correlation_id: str | None = None
    ) -> Handled[Any]:
        """The ``rejected`` outcome for a message that cannot be processed at all (a body that
        does not decode, a message too large): logged and passed to hooks like every outcome,
        so an adapter dead-letters it with ``reason`` instead of dropping it. No record is
        written: nothing was claimed."""
        return self._done(
            Outcome.REJECTED, key, perf_counter(), reason=reason, correlation_id=correlation_id
        )

    # ------------------------------------------------------------------ admission

    def _admit(
        self, key: object, payload: object, started: float, correlation_id: str | None
    ) -> tuple[str, str | None] | Handled[R]:
        """The checked key and the payload's fingerprint, or the ``rejected`` outcome for a
        message that cannot be processed safely (R2-R4): it is never run unprotected."""
        try:
            return validate_key(key, self._limits), self._fingerprint(payload)
        except Exception as exc:
            return self._refused(key, exc, started, correlation_id)

    def _refused(
        self, key: object, exc: Exception, started: float, correlation_id: str | None
    ) -> Handled[R]:
        return self._done(
            Outcome.REJECTED, _shown(key), started, reason=str(exc), correlation_id=correlation_id
        )

    def _message_key(
        self, envelope: Envelope, key: KeySource | None, started: float
    ) -> str | Handled[R]:
        """The key of a broker message (default: the producer's message id), or the
        ``rejected`` outcome for a message without a usable one (R2-R4)."""
        source = key if key is not None else _MESSAGE_ID
        try:
            return source(envelope)
        except Exception as exc:
            return self._refused(None, exc, started, envelope.correlation_id)

    # ------------------------------------------------------------------ outcomes

    def _settle(
        self, step: Step, claim: Claim, correlation_id: str | None, started: float
    ) -> Handled[R]:
        record = claim.record
        key = record.key
        if step is Step.DUPLICATE:
            value, reason = self._decode(record)
            # Positional: the hot path (value, reason, error, record, attempt, correlation_id).
            return self._done(
                Outcome.DUPLICATE, key, started, value, reason, None, record, None, correlation_id
            )
        if step is Step.CONFLICT:
            reason = (
                f"key reused for different content: the {record.status} record has fingerprint "
                f"{record.fingerprint}, this message another; dead-letter it and check the "
                "producer (R20 step 6)"
            )
            outcome = Outcome.KEY_CONFLICT
        elif step is Step.FAILED_BEFORE:
            reason = f"rejected before: {record.error}"
            outcome = Outcome.REJECTED
        elif step is Step.IN_FLIGHT:
            left = max(0, record.lease_until_ms - claim.now_ms)
            reason = f"attempt {record.attempt} holds the claim for another {left}ms"
            outcome = Outcome.IN_FLIGHT
        else:
            reason = (
                f"the claim of attempt {record.attempt} lapsed at "
                f"{record.lease_until.isoformat()} without completing and on_stale does not "
                "retry it: check whether its effects happened, then complete or forget the key"
            )
            outcome = Outcome.ESCALATED
        return self._done(
            outcome, key, started, reason=reason, record=record, correlation_id=correlation_id
        )

    def _failed(
        self,
        key: str,
        error: BaseException,
        started: float,
        correlation_id: str | None,
        attempt: int | None = None,
    ) -> Handled[R]:
        """``failed``: the handler raised, and nothing of its attempt was recorded."""
        return self._done(
            Outcome.FAILED,
            key,
            started,
            reason=f"handler raised {type(error).__name__}: {error}",
            error=error,
            attempt=attempt,
            correlation_id=correlation_id,
        )

    def _rejected(
        self,
        key: str,
        reason: str,
        started: float,
        correlation_id: str | None,
        record: Record | None = None,
    ) -> Handled[R]:
        """``rejected``: the handler raised :class:`~oncely.Reject`; the key is failed for good."""
        return self._done(
            Outcome.REJECTED,
            key,
            started,
            reason=f"handler rejected the message: {reason}",
            record=record,
            correlation_id=correlation_id,
        )

    def _lost(
        self, lost: LeaseLost, key: str, attempt: int, correlation_id: str | None, started: float
    ) -> Handled[R]:
        """``in_flight``: this claim lost its lease to another worker, whose result wins."""
        return self._done(
            Outcome.IN_FLIGHT,
            key,
            started,
            reason=lost_reason(lost),
            record=lost.current,
            attempt=attempt,
            correlation_id=correlation_id,
        )

    def _encode(self, result: object, *, strict: bool) -> tuple[bytes | None, str | None]:
        if result is None:
            return None, None
        try:
            data = self._codec.encode(result)
        except Exception as exc:
            if strict:
                raise PayloadError(f"the result cannot be encoded: {exc}") from exc
            note = f"result not stored: {type(result).__name__} cannot be encoded ({exc})"
            self._observer.logger.error("oncely %s consumer=%s", note, self._consumer)
            return None, note
        limit = self._limits.max_result_bytes
        if len(data) > limit:
            note = f"result not stored: {len(data)} bytes is over the limit of {limit}"
            if strict:
                raise ResultTooLarge(note)
            self._observer.logger.error("oncely %s consumer=%s", note, self._consumer)
            return None, note
        return data, None

    def _decode(self, record: Record) -> tuple[R | None, str | None]:
        if record.result is None:
            return None, record.error
        try:
            return cast(R, self._codec.decode(record.result)), None
        except Exception as exc:
            return None, f"the stored result cannot be decoded: {exc}"

    def _done(
        self,
        outcome: Outcome,
        key: str | None,
        started: float,
        value: R | None = None,
        reason: str | None = None,
        error: BaseException | None = None,
        record: Record | None = None,
        attempt: int | None = None,
        correlation_id: str | None = None,
    ) -> Handled[R]:
        """Build, log and hand out the outcome. ``attempt`` defaults to the record's; a claim
        that lost its lease reports its own attempt, not the new owner's."""
        if attempt is None:
            attempt = record.attempt if record is not None else 0
        handled: Handled[R] = new_handled(
            outcome,
            self._consumer,
            key,
            value,
            reason,
            error,
            record,
            attempt,
            perf_counter() - started,
            correlation_id,
        )
        self._observer.emit(handled)
        return handled


def _shown(key: object) -> str | None:
    if not isinstance(key, str) or not key:
        return None
    return key if len(key) <= 80 else key[:77] + "..."


def lost_reason(lost: LeaseLost) -> str:
    """Why a claim's write found the record in other hands (or gone)."""
    current = lost.current
    if current is None:
        return "lease lost: the record is gone (expired, purged or forgotten)"
    return (
        f"lease lost: attempt {current.attempt} took the key over after this claim's lease "
        f"lapsed and now holds it ({current.status}); its result wins"
    )


def reclaim_reason(claim: Claim) -> str:
    """The reason of a ``stale_reclaimed`` outcome."""
    return f"took over a lapsed claim (attempt {claim.record.attempt - 1} did not complete)"

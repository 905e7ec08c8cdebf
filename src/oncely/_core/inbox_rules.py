"""The inbox's decisions that need no I/O: admission, encoding, and the outcome of each step.

Both inboxes (:class:`~oncely.AsyncInbox` and its generated twin :class:`~oncely.Inbox`) hold one
:class:`InboxRules` and ask it, so these rules exist once, not generated twice: whether a key
and payload may be processed (R2-R4), how a result is encoded for the store (and when it is not
stored), and which :class:`~oncely.Handled` each step of the decision table
(:mod:`oncely._core.flows`) ends in, logged and handed to hooks (R16). Fencing tokens are made
here too.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable
from time import perf_counter
from typing import Any

from oncely._core.codec import Codec
from oncely._core.fingerprint import Fingerprinter
from oncely._core.flows import Step
from oncely._core.keys import Envelope, KeySource, MessageIdKey, validate_key
from oncely._core.observe import Observer, key_for_logs
from oncely._core.outcomes import Handled, Outcome, Released, new_handled
from oncely._core.policy import Limits
from oncely._core.records import Claim, Record, new_record
from oncely._core.said import said
from oncely.errors import LeaseLost, PayloadError, ResultTooLarge
from oncely.wire import printable

__all__ = [
    "InboxRules",
    "lost_reason",
    "new_token",
    "not_kept_note",
    "reclaim_reason",
    "result_lost",
    "with_result",
]


RESULT_NOT_STORED = "result not stored"
"""How the note of a completed record whose result was not kept begins (too large, or not
encodable): a repeat gets ``None`` with this reason."""
RESULT_UNDECODABLE = "the stored result cannot be decoded"
"""How a duplicate's reason begins when the stored result cannot be decoded."""


def result_lost(reason: str | None) -> bool:
    """Whether a duplicate's ``reason`` says that the first result is not there to return."""
    return reason is not None and reason.startswith((RESULT_NOT_STORED, RESULT_UNDECODABLE))


def not_kept_note(why: str) -> str:
    """The note of a record completed without its result, for ``why`` (the caller's words):
    what :func:`result_lost` recognises, so a repeat is not answered with a ``None`` that
    stands for nothing."""
    return f"{RESULT_NOT_STORED}: {why}"


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


class InboxRules:
    """What an inbox decides without I/O, for one consumer (see the module docstring)."""

    __slots__ = ("codec", "consumer", "fingerprint", "limits", "observer", "room")

    def __init__(
        self,
        consumer: str,
        *,
        fingerprint: Fingerprinter,
        limits: Limits,
        codec: Codec,
        observer: Observer,
        room: Callable[[], tuple[int, str] | None] | None = None,
    ) -> None:
        self.consumer = consumer
        self.fingerprint = fingerprint
        self.limits = limits
        self.codec = codec
        self.observer = observer
        self.room = room
        """The store's ``result_room`` (:class:`~oncely.stores.async_protocols.AsyncBoundsResults`):
        the most bytes of an encoded result its server takes, asked for each result, since
        a store learns it when it connects."""

    def shown(self, key: str) -> str:
        """``key`` as a reason that is logged may say it: as the log lines show keys (a
        digest with ``log_keys="hash"``), escaped."""
        return printable(key_for_logs(key, self.observer.log_keys) or "")

    def refuse(
        self, reason: str, *, key: str | None = None, correlation_id: str | None = None
    ) -> Handled[Any]:
        """The ``rejected`` outcome for a message that cannot be processed at all (a body that
        does not decode, a message too large): logged and passed to hooks like every outcome,
        so an adapter dead-letters it with ``reason`` instead of dropping it. No record is
        written: nothing was claimed."""
        return self.done(
            Outcome.REJECTED, key, perf_counter(), reason=reason, correlation_id=correlation_id
        )

    # ------------------------------------------------------------------ admission

    def admit(
        self, key: object, payload: object, started: float, correlation_id: str | None
    ) -> tuple[str, str | None] | Handled[Any]:
        """The checked key and the payload's fingerprint, or the ``rejected`` outcome for a
        message that cannot be processed safely (R2-R4): it is never run unprotected."""
        try:
            return validate_key(key, self.limits), self.fingerprint(payload)
        except Exception as exc:
            return self.refused(key, exc, started, correlation_id)

    def refused(
        self, key: object, exc: Exception, started: float, correlation_id: str | None
    ) -> Handled[Any]:
        return self.done(
            Outcome.REJECTED, _shown(key), started, reason=str(exc), correlation_id=correlation_id
        )

    def message_key(
        self, envelope: Envelope, key: KeySource | None, started: float
    ) -> str | Handled[Any]:
        """The key of a broker message (default: the producer's message id), or the
        ``rejected`` outcome for a message without a usable one (R2-R4)."""
        source = key if key is not None else _MESSAGE_ID
        try:
            return source(envelope)
        except Exception as exc:
            return self.refused(None, exc, started, envelope.correlation_id)

    # ------------------------------------------------------------------ outcomes

    def settle(
        self, step: Step, claim: Claim, correlation_id: str | None, started: float
    ) -> Handled[Any]:
        record = claim.record
        key = record.key
        if step is Step.DUPLICATE:
            value, reason = self.decode(record)
            # Positional: the hot path (value, reason, error, record, attempt, correlation_id).
            return self.done(
                Outcome.DUPLICATE, key, started, value, reason, None, record, None, correlation_id
            )
        if step is Step.CONFLICT:
            reason = (
                f"key reused for different content: the {record.status} record has fingerprint "
                f"{record.fingerprint}, this one another: its sender reused the key for other "
                "content (R20 step 6)"
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
        return self.done(
            outcome, key, started, reason=reason, record=record, correlation_id=correlation_id
        )

    def failed(
        self,
        key: str,
        error: BaseException,
        started: float,
        correlation_id: str | None,
        attempt: int | None = None,
    ) -> Handled[Any]:
        """``failed``: the handler raised, and nothing of its attempt was recorded."""
        return self.done(
            Outcome.FAILED,
            key,
            started,
            reason=(
                f"released: {error}"
                if isinstance(error, Released)
                else f"handler raised {said(error)}"
            ),
            error=error,
            attempt=attempt,
            correlation_id=correlation_id,
        )

    def rejected(
        self,
        key: str,
        reason: str,
        started: float,
        correlation_id: str | None,
        record: Record | None = None,
    ) -> Handled[Any]:
        """``rejected``: the handler raised :class:`~oncely.Reject`; the key is failed for good."""
        return self.done(
            Outcome.REJECTED,
            key,
            started,
            reason=f"handler rejected the message: {reason}",
            record=record,
            correlation_id=correlation_id,
        )

    def lost(
        self, lost: LeaseLost, key: str, attempt: int, correlation_id: str | None, started: float
    ) -> Handled[Any]:
        """``in_flight``: this claim lost its lease to another worker, whose result wins."""
        return self.done(
            Outcome.IN_FLIGHT,
            key,
            started,
            reason=lost_reason(lost),
            record=lost.current,
            attempt=attempt,
            correlation_id=correlation_id,
        )

    def encode(self, result: object, *, strict: bool) -> tuple[bytes | None, str | None]:
        if result is None:
            return None, None
        try:
            data = self.codec.encode(result)
        except Exception as exc:
            if strict:
                raise PayloadError(f"the result cannot be encoded: {exc}") from exc
            note = f"{RESULT_NOT_STORED}: {type(result).__name__} cannot be encoded ({exc})"
            self.observer.logger.error("oncely %s consumer=%s", note, self.consumer)
            return None, note
        limit = self.limits.max_result_bytes
        if len(data) > limit:
            note = f"{RESULT_NOT_STORED}: {len(data)} bytes is over the limit of {limit}"
            if strict:
                raise ResultTooLarge(note)
            self.observer.logger.error("oncely %s consumer=%s", note, self.consumer)
            return None, note
        if self.room is not None and (room := self.room()) is not None and len(data) > room[0]:
            # Sent anyway, the server would refuse the statement (MariaDB/MySQL even drop the
            # connection): the completion would fail after the handler ran, and a redelivery
            # would run it again. Kept without it instead, as over max_result_bytes.
            note = (
                f"{RESULT_NOT_STORED}: {len(data)} bytes is over the {room[0]} the store can "
                f"take ({room[1]})"
            )
            if strict:
                raise ResultTooLarge(note)
            self.observer.logger.error("oncely %s consumer=%s", note, self.consumer)
            return None, note
        return data, None

    def decode(self, record: Record) -> tuple[Any, str | None]:
        if record.result is None:
            return None, record.error
        try:
            return self.codec.decode(record.result), None
        except Exception as exc:
            return None, f"{RESULT_UNDECODABLE}: {exc}"

    def processed(
        self,
        key: str,
        started: float,
        value: Any,
        record: Record,
        correlation_id: str | None,
    ) -> Handled[Any]:
        """:meth:`done` for a plain ``processed``, the outcome of almost every message. Speed:
        positional, and the observer is skipped when no hook and no log line would come of it
        (see :mod:`oncely._core.fast`)."""
        handled: Handled[Any] = new_handled(
            Outcome.PROCESSED,
            self.consumer,
            key,
            value,
            None,
            None,
            record,
            record.attempt,
            perf_counter() - started,
            correlation_id,
        )
        observer = self.observer
        if observer.hooks or observer.logger.isEnabledFor(_PROCESSED_LEVEL):
            observer.emit(handled)
        return handled

    def done(
        self,
        outcome: Outcome,
        key: str | None,
        started: float,
        value: Any = None,
        reason: str | None = None,
        error: BaseException | None = None,
        record: Record | None = None,
        attempt: int | None = None,
        correlation_id: str | None = None,
    ) -> Handled[Any]:
        """Build, log and hand out the outcome. ``attempt`` defaults to the record's; a claim
        that lost its lease reports its own attempt, not the new owner's."""
        if attempt is None:
            attempt = record.attempt if record is not None else 0
        handled: Handled[Any] = new_handled(
            outcome,
            self.consumer,
            key,
            value,
            reason,
            error,
            record,
            attempt,
            perf_counter() - started,
            correlation_id,
        )
        self.observer.emit(handled)
        return handled


_PROCESSED_LEVEL = Outcome.PROCESSED.log_level


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


def with_result(record: Record, result: bytes) -> Record:
    """``record`` with ``result`` stored (``dataclasses.replace`` without its field
    introspection: it is on the hot path)."""
    return new_record(
        record.consumer,
        record.key,
        record.status,
        record.fingerprint,
        record.token,
        record.attempt,
        record.created_ms,
        record.updated_ms,
        record.lease_until_ms,
        record.expires_ms,
        result,
        record.error,
    )

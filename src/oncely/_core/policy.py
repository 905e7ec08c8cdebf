"""Policies: keyword-only frozen dataclasses with ``timedelta`` durations, checked when built."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import timedelta
from enum import StrEnum

from oncely._core.clock import to_ms
from oncely._core.context import downstream_key
from oncely._core.records import Record
from oncely.errors import ConfigurationError, RetentionTooShort

__all__ = [
    "AsyncReconciler",
    "Lease",
    "Limits",
    "OnStale",
    "Reconciler",
    "RedeliveryHorizon",
    "Resolution",
    "Resolved",
    "Retention",
    "StaleClaim",
    "format_duration",
]


def format_duration(delta: timedelta) -> str:
    """A compact, exact rendering: ``3d2h``, ``5m``, ``1m30s``, ``250ms``, ``0s``."""
    ms = to_ms(delta)
    if ms == 0:
        return "0s"
    sign = "-" if ms < 0 else ""
    ms = abs(ms)
    parts: list[str] = []
    for unit, size in (("d", 86_400_000), ("h", 3_600_000), ("m", 60_000), ("s", 1000)):
        if ms >= size:
            parts.append(f"{ms // size}{unit}")
            ms %= size
    if ms:
        parts.append(f"{ms}ms")
    return sign + "".join(parts)


@dataclass(frozen=True, slots=True, kw_only=True)
class RedeliveryHorizon:
    """How long after the first delivery a broker may still hand out the same message (R13).

    ``total = message_ttl + max_deliveries x (lock + redelivery_delay) + resubmit_window``: the
    message can wait in the queue for its time-to-live, every delivery can hold it for a lock
    (visibility timeout, ack wait) plus the broker's redelivery delay, and an operator may resubmit
    it from the dead-letter queue for ``resubmit_window`` after that. Conservative by design:
    a record kept this long outlives every copy the broker can still deliver.
    """

    max_deliveries: int
    lock: timedelta
    message_ttl: timedelta
    redelivery_delay: timedelta = timedelta(0)
    resubmit_window: timedelta = timedelta(0)

    def __post_init__(self) -> None:
        if self.max_deliveries < 1:
            raise ConfigurationError("max_deliveries must be at least 1")
        for name in ("lock", "message_ttl", "redelivery_delay", "resubmit_window"):
            if getattr(self, name) < timedelta(0):
                raise ConfigurationError(f"{name} must not be negative")

    @property
    def total(self) -> timedelta:
        per_delivery = self.lock + self.redelivery_delay
        return self.message_ttl + per_delivery * self.max_deliveries + self.resubmit_window

    def explain(self) -> str:
        """The formula with this horizon's numbers, e.g.
        ``max_deliveries=10 x lock=5m + message_ttl=3d``."""
        per = f"lock={format_duration(self.lock)}"
        if self.redelivery_delay:
            per = f"(lock={format_duration(self.lock)} + delay="
            per += f"{format_duration(self.redelivery_delay)})"
        text = f"max_deliveries={self.max_deliveries} x {per}"
        text += f" + message_ttl={format_duration(self.message_ttl)}"
        if self.resubmit_window:
            text += f" + resubmit_window={format_duration(self.resubmit_window)}"
        return text


LONGEST_KEEP = timedelta(days=365_000)
"""The longest retention: a thousand years, so that every record expires at a date a
``datetime`` can hold (the year 9999 at the latest)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Retention:
    """How long records are kept after their last write (R13).

    Every record expires: ``keep`` for completed (and in-progress) records, ``keep_failed`` for
    records of poison messages (default: ``keep``). Declare the broker's ``horizon`` and oncely
    refuses a ``keep`` shorter than it, because deleting a record while the broker can still
    redeliver the message lets the duplicate through.
    """

    keep: timedelta = timedelta(days=7)
    keep_failed: timedelta | None = None
    horizon: RedeliveryHorizon | None = None

    def __post_init__(self) -> None:
        if self.keep <= timedelta(0):
            raise ConfigurationError("retention keep must be positive: every record must expire")
        if self.keep_failed is not None and self.keep_failed <= timedelta(0):
            raise ConfigurationError("retention keep_failed must be positive")
        for name, value in (("keep", self.keep), ("keep_failed", self.keep_failed)):
            if value is not None and value > LONGEST_KEEP:
                # A record's expiry must be a date: one past the year 9999 could be written
                # to the store (milliseconds) but not read back as a datetime.
                raise ConfigurationError(
                    f"retention {name} of {format_duration(value)} is longer than any record "
                    f"can be kept: at most {format_duration(LONGEST_KEEP)} (1000 years)"
                )
        if self.horizon is not None:
            self.check(self.horizon)

    def check(self, horizon: RedeliveryHorizon, *, of: str = "", advice: str = "") -> None:
        """Raise :class:`~oncely.RetentionTooShort`, with the numbers, when ``keep`` or
        ``keep_failed`` is shorter than ``horizon`` (R13). ``of`` says whose horizon it is
        (``" of this consumer"``); ``advice`` replaces the closing hint."""
        total = horizon.total
        for name, value in (("retention", self.keep), ("keep_failed", self.keep_failed)):
            if value is not None and value < total:
                raise RetentionTooShort(
                    f"{name} {format_duration(value)} is below the redelivery horizon{of} "
                    f"{format_duration(total)} ({horizon.explain()}); "
                    + (advice or f"raise {name} or lower the broker's limits")
                )

    @property
    def keep_ms(self) -> int:
        return to_ms(self.keep)

    @property
    def keep_failed_ms(self) -> int:
        return to_ms(self.keep_failed if self.keep_failed is not None else self.keep)


@dataclass(frozen=True, slots=True, kw_only=True)
class Lease:
    """How long a two-phase claim is held before another worker may treat it as stale (R10).

    While the handler runs, oncely renews the lease every ``renew_every`` (default: a third of
    ``duration``) from a heartbeat, so a long handler keeps its claim and a dead worker's claim
    lapses after ``duration``. Set ``heartbeat=False`` to renew by hand.
    """

    duration: timedelta = timedelta(seconds=30)
    renew_every: timedelta | None = None
    heartbeat: bool = True

    def __post_init__(self) -> None:
        if self.duration < timedelta(milliseconds=10):
            raise ConfigurationError("lease duration must be at least 10ms")
        if self.renew_every is not None and not (timedelta(0) < self.renew_every < self.duration):
            raise ConfigurationError("renew_every must be positive and shorter than the lease")

    @property
    def duration_ms(self) -> int:
        return to_ms(self.duration)

    @property
    def renew_every_s(self) -> float:
        every = self.renew_every if self.renew_every is not None else self.duration / 3
        return every.total_seconds()


@dataclass(frozen=True, slots=True, kw_only=True)
class Limits:
    """Size limits. A key over ``max_key_bytes`` (UTF-8) is refused, or hashed with
    ``hash_long_keys=True``; a result over ``max_result_bytes`` (encoded) is not stored."""

    max_key_bytes: int = 512
    max_result_bytes: int = 256 * 1024
    hash_long_keys: bool = False
    max_error_chars: int = 2000

    def __post_init__(self) -> None:
        if not 16 <= self.max_key_bytes <= 4096:
            raise ConfigurationError("max_key_bytes must be between 16 and 4096")
        if self.max_result_bytes < 0:
            raise ConfigurationError("max_result_bytes must not be negative")


class OnStale(StrEnum):
    """What to do with a stale in-progress record (its worker's lease lapsed) (R10).

    ``retry``: take it over and run the handler again. Right when the handler is safe to repeat
    after a partial run (its effects are transactional or naturally idempotent, R11).
    ``escalate``: do not run; park the message and alert a person (outcome ``escalated``).
    For anything in between, pass a reconciler callable instead (see :class:`Resolution`).
    """

    RETRY = "retry"
    ESCALATE = "escalate"


@dataclass(frozen=True, slots=True)
class Resolution:
    """A decision about a record: a reconciler's answer about a stale one, or an operator's
    (:meth:`~oncely.AsyncInbox.resolve`). ``retry()`` runs the handler again (on the next
    delivery), ``completed(result)`` records the effect as done (the external system shows it
    happened), ``failed(reason)`` records a poison message (its deliveries are rejected), and
    ``escalate(reason)`` leaves the record for a person."""

    action: str
    result: object = None
    reason: str | None = None

    @classmethod
    def retry(cls) -> Resolution:
        return cls("retry")

    @classmethod
    def completed(cls, result: object = None) -> Resolution:
        return cls("completed", result=result)

    @classmethod
    def failed(cls, reason: str) -> Resolution:
        return cls("failed", reason=reason)

    @classmethod
    def escalate(cls, reason: str) -> Resolution:
        return cls("escalate", reason=reason)


@dataclass(frozen=True, slots=True)
class Resolved:
    """What :meth:`~oncely.AsyncInbox.resolve` or :meth:`~oncely.AsyncInbox.reconcile` did to
    one record: ``action`` is the resolution applied (``completed``, ``failed``, ``retry``:
    the record was deleted so the next delivery runs the handler, ``escalate``: left as it
    was), or ``skipped`` when the record moved on meanwhile (settled, or its owner came back)
    and ``error`` when the reconciler raised; ``before`` and ``after`` are the record then and
    now (``None``: absent), ``detail`` says why."""

    key: str
    action: str
    before: Record | None
    after: Record | None
    detail: str = ""


@dataclass(frozen=True, slots=True)
class StaleClaim:
    """What a reconciler is asked about: the lapsed record and the payload of the redelivery.

    ``record.key`` (and ``record.consumer``) identify the work in the external system; look it
    up there (a payment provider's "get by idempotency key") and answer with a
    :class:`Resolution`.
    """

    record: Record
    payload: object

    def downstream_key(self, step: str = "") -> str:
        """The idempotency key the lapsed attempt passed downstream for ``step`` (R17): look
        the work up in the external system by exactly the key it was sent with."""
        return downstream_key(self.record.consumer, self.record.key, step)


Reconciler = Callable[[StaleClaim], Resolution]
"""``reconciler(stale) -> Resolution``: inspect the external system and answer (R10)."""

AsyncReconciler = Callable[[StaleClaim], Awaitable[Resolution]]

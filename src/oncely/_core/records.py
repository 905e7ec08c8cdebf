"""The dedup record and the result of a claim.

A record is keyed by ``(consumer, key)`` (R5): independent consumers of one channel each keep
their own completion, so the first one never stops the others.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum

from oncely._core.clock import ms_to_datetime

__all__ = [
    "Claim",
    "ClaimRequest",
    "ClaimStatus",
    "Record",
    "Status",
    "StoreStats",
    "new_claim",
    "new_record",
]


class Status(StrEnum):
    """Where a record stands.

    ``in_progress``: a worker claimed the key and holds a lease until ``lease_until``.
    ``completed``: the effects are done; ``result`` holds the encoded result, if any.
    ``failed``: a handler refused the message for good (poison); ``error`` says why.
    """

    IN_PROGRESS = "in_progress"
    COMPLETED = "completed"
    FAILED = "failed"


@dataclass(frozen=True, slots=True)
class Record:
    """One processed (or being processed) logical message, as the store holds it.

    Times are epoch milliseconds read from the store's clock; the ``*_at`` properties give
    aware ``datetime`` values. ``token`` is the fencing token of the claim that owns (or last
    owned) the record; ``attempt`` counts claims, takeovers included.
    """

    consumer: str
    key: str
    status: Status
    fingerprint: str | None
    token: str
    attempt: int
    created_ms: int
    updated_ms: int
    lease_until_ms: int
    expires_ms: int
    result: bytes | None = None
    error: str | None = None

    def is_live(self, now_ms: int) -> bool:
        """In progress under a lease that has not lapsed."""
        return self.status is Status.IN_PROGRESS and self.lease_until_ms > now_ms

    def is_stale(self, now_ms: int) -> bool:
        """In progress under a lease that has lapsed: its worker may have died."""
        return self.status is Status.IN_PROGRESS and self.lease_until_ms <= now_ms

    def is_expired(self, now_ms: int) -> bool:
        """Past retention. An expired record counts as absent everywhere and may be purged."""
        return self.expires_ms <= now_ms

    @property
    def created_at(self) -> datetime:
        return ms_to_datetime(self.created_ms)

    @property
    def updated_at(self) -> datetime:
        return ms_to_datetime(self.updated_ms)

    @property
    def lease_until(self) -> datetime:
        return ms_to_datetime(self.lease_until_ms)

    @property
    def expires_at(self) -> datetime:
        return ms_to_datetime(self.expires_ms)


class _RecordSlots:
    # Record's slot layout without its frozen ``__setattr__``: see new_record.
    __slots__ = Record.__slots__  # the same names in the same order: the same layout
    consumer: str
    key: str
    status: Status
    fingerprint: str | None
    token: str
    attempt: int
    created_ms: int
    updated_ms: int
    lease_until_ms: int
    expires_ms: int
    result: bytes | None
    error: str | None


def new_record(
    consumer: str,
    key: str,
    status: Status,
    fingerprint: str | None,
    token: str,
    attempt: int,
    created_ms: int,
    updated_ms: int,
    lease_until_ms: int,
    expires_ms: int,
    result: bytes | None,
    error: str | None,
) -> Record:
    """``Record(...)`` with every field given, for the stores' hot paths: the same object
    (type, equality, hash, repr, immutability) in a fraction of the time (on CPython 3.11,
    0.25 us instead of 1.6 positionally, 2.2 with keywords).

    A frozen dataclass's ``__init__`` sets each field through ``object.__setattr__``; here a
    twin with the same slot layout is filled by plain assignment and then becomes a Record
    (CPython allows ``__class__`` assignment between classes of identical layout; a layout
    that drifted from Record's would raise ``TypeError`` on the first call).
    """
    r = _RecordSlots()
    r.consumer = consumer
    r.key = key
    r.status = status
    r.fingerprint = fingerprint
    r.token = token
    r.attempt = attempt
    r.created_ms = created_ms
    r.updated_ms = updated_ms
    r.lease_until_ms = lease_until_ms
    r.expires_ms = expires_ms
    r.result = result
    r.error = error
    r.__class__ = Record  # type: ignore[assignment]
    return r  # type: ignore[return-value]


class ClaimStatus(StrEnum):
    """What a claim did: ``new`` inserted the record, ``taken_over`` replaced the token of a
    stale in-progress record, ``existing`` changed nothing and returns the record that won."""

    NEW = "new"
    TAKEN_OVER = "taken_over"
    EXISTING = "existing"


@dataclass(frozen=True, slots=True)
class ClaimRequest:
    """One key of a batch claim: the key, the payload's fingerprint and the claim's token."""

    key: str
    fingerprint: str | None
    token: str


@dataclass(frozen=True, slots=True)
class Claim:
    """The answer of one atomic claim: the winner's record, whether it is ours, and the store's
    clock reading used to decide (so the caller judges lease liveness on the same clock)."""

    status: ClaimStatus
    record: Record
    now_ms: int

    @property
    def won(self) -> bool:
        """True when this claim owns the record (new or taken over)."""
        return self.status is not ClaimStatus.EXISTING


class _ClaimSlots:
    # Claim's slot layout without its frozen ``__setattr__``: see new_claim.
    __slots__ = Claim.__slots__  # the same names in the same order: the same layout
    status: ClaimStatus
    record: Record
    now_ms: int


def new_claim(status: ClaimStatus, record: Record, now_ms: int) -> Claim:
    """``Claim(status, record, now_ms)``, built the way :func:`new_record` builds a Record
    (speed: 0.36 us instead of 0.53 on CPython 3.11; every claim makes one)."""
    c = _ClaimSlots()
    c.status = status
    c.record = record
    c.now_ms = now_ms
    c.__class__ = Claim  # type: ignore[assignment]
    return c  # type: ignore[return-value]


@dataclass(frozen=True, slots=True)
class StoreStats:
    """Counts of live (unexpired) records per consumer and status, and of expired records
    waiting for a purge."""

    counts: dict[str, dict[Status, int]]
    expired: int

    @property
    def total(self) -> int:
        return sum(sum(by_status.values()) for by_status in self.counts.values())

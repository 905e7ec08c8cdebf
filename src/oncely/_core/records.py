"""The dedup record and the result of a claim.

A record is keyed by ``(consumer, key)`` (R5): independent consumers of one channel each keep
their own completion, so the first one never stops the others.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from typing import TYPE_CHECKING

from oncely._core.clock import ms_to_datetime
from oncely._core.fast import frozen_builder

__all__ = [
    "Claim",
    "ClaimRequest",
    "ClaimStatus",
    "Completion",
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
class Completion:
    """One key of a batch completion: the key, the claim's token, the encoded result and the
    note stored with it (as :meth:`~oncely.AsyncStore.complete` takes them)."""

    key: str
    token: str
    result: bytes | None = None
    note: str | None = None


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


if TYPE_CHECKING:

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
        """``Record(...)`` with every field given, for the stores' hot paths (speed: see
        :mod:`oncely._core.fast`)."""

    def new_claim(status: ClaimStatus, record: Record, now_ms: int) -> Claim:
        """``Claim(status, record, now_ms)``, for every claim (speed: see
        :mod:`oncely._core.fast`)."""

else:
    new_record = frozen_builder(Record)
    new_claim = frozen_builder(Claim)


@dataclass(frozen=True, slots=True)
class StoreStats:
    """Counts of live (unexpired) records per consumer and status, and of expired records
    waiting for a purge.

    ``exact`` (the default of ``Store.stats()``): every record was counted, and ``counts``
    holds each consumer's count per status.

    ``stats(exact=False)`` answers from the database's own statistics instead (catalogue
    row counts, the planner's or the index's estimates, a bounded sample), without reading
    the table; every number is then an estimate:

    * ``consumers``: the live records of each consumer (:attr:`per_consumer` reads it);
    * ``statuses``: the live records per status over all consumers, where the store has a
      statistic of its own for it (PostgreSQL's column statistics, a sample); ``None`` when
      it has none (MariaDB, SQLite);
    * ``counts``: each consumer's split by status only where the store measured the pair
      (a sample of records); empty dicts otherwise. A database keeps statistics per column,
      not per pair, and oncely does not make a split up from them;
    * ``note``: how the numbers were made, when that deserves a word (a table never
      analyzed: a rough estimate from a sample of its pages);
    * ``counted``, ``counted_total``, ``counted_expired``: which of those numbers an
      estimate counted outright all the same, and so are exact: the consumers with few
      records (at most 1,000 on the SQL stores), the live total (every consumer counted, or
      SQLite's row count less the expired counted), the expired records (few of them, while
      a purge keeps up). Nothing, unless the store says so.
    """

    counts: dict[str, dict[Status, int]]
    expired: int
    exact: bool = True
    consumers: dict[str, int] | None = None
    statuses: dict[Status, int] | None = None
    note: str = ""
    counted: frozenset[str] = frozenset()
    counted_total: bool = False
    counted_expired: bool = False

    @property
    def per_consumer(self) -> dict[str, int]:
        """Live records per consumer (estimated unless :attr:`exact`)."""
        if self.consumers is not None:
            return dict(self.consumers)
        return {consumer: sum(by.values()) for consumer, by in self.counts.items()}

    @property
    def per_status(self) -> dict[Status, int] | None:
        """Live records per status over all consumers (estimated unless :attr:`exact`), or
        None when an estimate has nothing to say about statuses."""
        if self.statuses is not None:
            return dict(self.statuses)
        if not self.exact and not any(self.counts.values()):
            return None
        found = dict.fromkeys(Status, 0)
        for by_status in self.counts.values():
            for status, n in by_status.items():
                found[status] += n
        return found

    @property
    def total(self) -> int:
        """Live records in all (estimated unless :attr:`exact`)."""
        return sum(self.per_consumer.values())

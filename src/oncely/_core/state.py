"""The record state machine: every store operation as a pure function of (record, event, now).

This module is the specification. The memory store executes it directly; every other store
(SQL, Lua) implements the same table in its own language, and the contract suite plus a
hypothesis state-machine test check each of them against this code.

Rules
=====

A record is *absent* when there is none or it is expired (``expires <= now``): an expired record
behaves exactly like a missing one for every operation, and ``purge`` may delete it at any time.
A record is *live* when in progress with ``lease_until > now``, *stale* when in progress with
``lease_until <= now``.

::

    event          absent          in_progress live   in_progress stale     completed/failed
    -------------  --------------  -----------------  --------------------  ----------------
    claim          insert: NEW     EXISTING           if takeover and the   EXISTING
                                                      fingerprints agree:
                                                      new token, attempt+1
                                                      TAKEN_OVER; else
                                                      EXISTING
    takeover(t0)   as claim        EXISTING           as claim, only if     EXISTING
                                                      token == t0
    complete(t)    Lost            token == t: completed (result),      same token and
                                   else Lost                            completed: reply
                                                                        as is; else Lost
    fail(t)        Lost            token == t: failed (error),          same token and
                                   else Lost                            failed: reply as
                                                                        is; else Lost
    renew(t)       Lost            token == t: lease_until = now+lease  Lost
                                   else Lost
    release(t)     False           token == t: delete, True; else Lost  Lost
    forget(t)      False           Lost               token == t: delete,  token == t:
                                                      True; else Lost      delete, True;
                                                                           else Lost

Fencing is by token, not by time: the owner of a lapsed lease that nobody has taken over can still
complete, fail, renew or release it. Only a takeover (which changes the token) ends its rights.
"Lost" changes nothing and carries the current record so the caller can see who owns it.

Fingerprints "agree" when either side is ``None`` or both are equal. A claim never takes over a
record whose fingerprint differs: that is a key conflict, decided by the caller.

Every write sets ``updated = now``. Claim, takeover and renew set
``expires = now + max(keep, lease)``, so a record always outlives its lease; complete and fail
(which end the lease) set ``expires = now + keep``. A claim may insert the
record directly as ``completed`` (transactional mode: the marker commits with the business writes,
so there is nothing to lease).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from oncely._core.fast import frozen_builder
from oncely._core.records import Claim, ClaimStatus, Record, Status, new_claim, new_record

__all__ = [
    "DELETE",
    "UNCHANGED",
    "ClaimEvent",
    "CompleteEvent",
    "FailEvent",
    "Lost",
    "NewState",
    "ReleaseEvent",
    "RenewEvent",
    "TakeoverEvent",
    "apply_claim",
    "apply_complete",
    "apply_fail",
    "apply_forget",
    "apply_release",
    "apply_renew",
    "apply_takeover",
    "claim_event",
    "claimable",
    "fingerprints_agree",
    "takes_over",
]


class _Marker:
    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


UNCHANGED: Final = _Marker("UNCHANGED")
"""The store keeps the record as it is."""

DELETE: Final = _Marker("DELETE")
"""The store deletes the record."""

NewState = Record | _Marker


@dataclass(frozen=True, slots=True)
class Lost:
    """A fenced operation that did not apply; ``current`` is the record now (None if absent)."""

    current: Record | None


@dataclass(frozen=True, slots=True)
class ClaimEvent:
    consumer: str
    key: str
    fingerprint: str | None
    token: str
    lease_ms: int
    keep_ms: int
    takeover: bool
    initial: Status = Status.IN_PROGRESS
    error: str | None = None


if TYPE_CHECKING:

    def claim_event(
        consumer: str,
        key: str,
        fingerprint: str | None,
        token: str,
        lease_ms: int,
        keep_ms: int,
        takeover: bool,
        initial: Status = Status.IN_PROGRESS,
        error: str | None = None,
    ) -> ClaimEvent:
        """``ClaimEvent(...)``: the stores that decide in Python make one per claim (speed: see
        :mod:`oncely._core.fast`)."""

else:
    claim_event = frozen_builder(ClaimEvent)


@dataclass(frozen=True, slots=True)
class TakeoverEvent:
    claim: ClaimEvent
    expected_token: str


@dataclass(frozen=True, slots=True)
class CompleteEvent:
    token: str
    result: bytes | None
    keep_ms: int
    note: str | None = None


@dataclass(frozen=True, slots=True)
class FailEvent:
    token: str
    error: str
    keep_ms: int


@dataclass(frozen=True, slots=True)
class RenewEvent:
    token: str
    lease_ms: int
    keep_ms: int


@dataclass(frozen=True, slots=True)
class ReleaseEvent:
    token: str


def fingerprints_agree(a: str | None, b: str | None) -> bool:
    """Two fingerprints agree when either is unknown or both are equal."""
    return a is None or b is None or a == b


def takes_over(rec: Record, now: int, fingerprint: str | None, takeover: bool) -> bool:
    """Whether a claim takes the live record ``rec`` over: the inbox retries stale claims
    (``takeover``), ``rec``'s lease has lapsed, and the payloads agree (R10, R20)."""
    return takeover and rec.is_stale(now) and fingerprints_agree(rec.fingerprint, fingerprint)


def claimable(current: Record, now: int, fingerprint: str | None, takeover: bool) -> bool:
    """Whether a claim replaces ``current``: it expired, or the claim takes it over. The one
    rule every store asks, whether it runs :func:`apply_claim` or its own statement."""
    return current.expires_ms <= now or takes_over(current, now, fingerprint, takeover)


def _live(current: Record | None, now: int) -> Record | None:
    """The record, or None when it is absent (missing or expired)."""
    if current is None or current.expires_ms <= now:
        return None
    return current


def _expires(now: int, keep_ms: int, lease_ms: int) -> int:
    return now + max(keep_ms, lease_ms)


def _insert(ev: ClaimEvent, now: int) -> Record:
    in_progress = ev.initial is Status.IN_PROGRESS
    return new_record(
        consumer=ev.consumer,
        key=ev.key,
        status=ev.initial,
        fingerprint=ev.fingerprint,
        token=ev.token,
        attempt=1,
        created_ms=now,
        updated_ms=now,
        lease_until_ms=now + ev.lease_ms if in_progress else now,
        expires_ms=_expires(now, ev.keep_ms, ev.lease_ms),
        result=None,
        error=ev.error,
    )


def _take(current: Record, ev: ClaimEvent, now: int) -> Record:
    in_progress = ev.initial is Status.IN_PROGRESS
    return new_record(
        consumer=current.consumer,
        key=current.key,
        status=ev.initial,
        fingerprint=ev.fingerprint if ev.fingerprint is not None else current.fingerprint,
        token=ev.token,
        attempt=current.attempt + 1,
        created_ms=current.created_ms,
        updated_ms=now,
        lease_until_ms=now + ev.lease_ms if in_progress else now,
        expires_ms=_expires(now, ev.keep_ms, ev.lease_ms),
        result=None,
        error=ev.error,
    )


def _settled(
    rec: Record, status: Status, now: int, expires: int, result: bytes | None, error: str | None
) -> Record:
    """``rec`` moved to ``status`` (completed or failed), its lease ended."""
    return new_record(
        consumer=rec.consumer,
        key=rec.key,
        status=status,
        fingerprint=rec.fingerprint,
        token=rec.token,
        attempt=rec.attempt,
        created_ms=rec.created_ms,
        updated_ms=now,
        lease_until_ms=rec.lease_until_ms,
        expires_ms=expires,
        result=result,
        error=error,
    )


def apply_claim(current: Record | None, ev: ClaimEvent, now: int) -> tuple[NewState, Claim]:
    """Insert if absent; take over a stale claim when allowed; otherwise report the winner."""
    rec = _live(current, now)
    if rec is None:
        new = _insert(ev, now)
        return new, new_claim(ClaimStatus.NEW, new, now)
    if takes_over(rec, now, ev.fingerprint, ev.takeover):
        new = _take(rec, ev, now)
        return new, new_claim(ClaimStatus.TAKEN_OVER, new, now)
    return UNCHANGED, new_claim(ClaimStatus.EXISTING, rec, now)


def apply_takeover(current: Record | None, ev: TakeoverEvent, now: int) -> tuple[NewState, Claim]:
    """Take over a stale claim only if it still carries ``expected_token`` (a reconciler looked at
    exactly that attempt). An absent record is claimed afresh."""
    rec = _live(current, now)
    if rec is None:
        return apply_claim(None, ev.claim, now)
    if (
        rec.token == ev.expected_token
        and rec.is_stale(now)
        and fingerprints_agree(rec.fingerprint, ev.claim.fingerprint)
    ):
        new = _take(rec, ev.claim, now)
        return new, new_claim(ClaimStatus.TAKEN_OVER, new, now)
    return UNCHANGED, new_claim(ClaimStatus.EXISTING, rec, now)


def apply_complete(
    current: Record | None, ev: CompleteEvent, now: int
) -> tuple[NewState, Record | Lost]:
    rec = _live(current, now)
    if rec is None or rec.token != ev.token:
        return UNCHANGED, Lost(rec)
    if rec.status is Status.COMPLETED:
        return UNCHANGED, rec
    if rec.status is not Status.IN_PROGRESS:
        return UNCHANGED, Lost(rec)
    new = _settled(rec, Status.COMPLETED, now, now + ev.keep_ms, ev.result, ev.note)
    return new, new


def apply_fail(current: Record | None, ev: FailEvent, now: int) -> tuple[NewState, Record | Lost]:
    rec = _live(current, now)
    if rec is None or rec.token != ev.token:
        return UNCHANGED, Lost(rec)
    if rec.status is Status.FAILED:
        return UNCHANGED, rec
    if rec.status is not Status.IN_PROGRESS:
        return UNCHANGED, Lost(rec)
    new = _settled(rec, Status.FAILED, now, now + ev.keep_ms, None, ev.error)
    return new, new


def apply_renew(current: Record | None, ev: RenewEvent, now: int) -> tuple[NewState, Record | Lost]:
    rec = _live(current, now)
    if rec is None or rec.token != ev.token or rec.status is not Status.IN_PROGRESS:
        return UNCHANGED, Lost(rec)
    new = new_record(
        consumer=rec.consumer,
        key=rec.key,
        status=rec.status,
        fingerprint=rec.fingerprint,
        token=rec.token,
        attempt=rec.attempt,
        created_ms=rec.created_ms,
        updated_ms=now,
        lease_until_ms=now + ev.lease_ms,
        expires_ms=_expires(now, ev.keep_ms, ev.lease_ms),
        result=rec.result,
        error=rec.error,
    )
    return new, new


def apply_release(
    current: Record | None, ev: ReleaseEvent, now: int
) -> tuple[NewState, bool | Lost]:
    rec = _live(current, now)
    if rec is None:
        return UNCHANGED, False
    if rec.token != ev.token or rec.status is not Status.IN_PROGRESS:
        return UNCHANGED, Lost(rec)
    return DELETE, True


def apply_forget(
    current: Record | None, ev: ReleaseEvent, now: int
) -> tuple[NewState, bool | Lost]:
    """An operator's fenced delete: the record goes only while it carries ``ev.token`` (the
    one the operator read) and is no live claim; a record that changed hands, or a claim that
    is live again, is Lost."""
    rec = _live(current, now)
    if rec is None:
        return UNCHANGED, False
    if rec.token != ev.token or (rec.status is Status.IN_PROGRESS and not rec.is_stale(now)):
        return UNCHANGED, Lost(rec)
    return DELETE, True

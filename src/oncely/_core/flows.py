"""The decision step of every flow, pure: given the store's answer to a claim, what next.

The I/O shells (the inboxes) call :func:`decide` after each claim and act on the step; they hold
no rule of their own. Conflict comes first: a record whose fingerprint differs is a key conflict
whatever its state, so a reused id is never acknowledged as a duplicate nor taken over.
"""

from __future__ import annotations

from enum import Enum

from oncely._core.records import Claim, ClaimStatus, Status

__all__ = ["Step", "decide"]


class Step(Enum):
    PROCEED = "proceed"  # we own the claim: run the handler
    DUPLICATE = "duplicate"  # completed before: return the stored result
    CONFLICT = "conflict"  # same key, other content
    FAILED_BEFORE = "failed_before"  # a handler rejected this key for good
    IN_FLIGHT = "in_flight"  # another worker holds a live lease
    STALE = "stale"  # a lapsed lease the claim did not take over: apply on_stale


def decide(claim: Claim, fingerprint: str | None) -> Step:
    """The next step after ``claim`` for a message whose fingerprint is ``fingerprint``."""
    if claim.status is not ClaimStatus.EXISTING:
        return Step.PROCEED
    record = claim.record
    stored = record.fingerprint
    if fingerprint is not None and stored is not None and stored != fingerprint:
        return Step.CONFLICT
    status = record.status
    if status is Status.COMPLETED:
        return Step.DUPLICATE
    if status is Status.FAILED:
        return Step.FAILED_BEFORE
    if record.lease_until_ms > claim.now_ms:
        return Step.IN_FLIGHT
    return Step.STALE

"""The record state machine's field-level rules: expiry, takeover, fencing, idempotent
repeats, fingerprint agreement, the transactional insert. The table itself, cell by cell, is in
``test_state_table.py``.

Pure code, with time passed in as a value (R7, R10, R13, R20).
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from oncely._core.records import Claim, ClaimStatus, Record, Status
from oncely._core.state import (
    DELETE,
    UNCHANGED,
    ClaimEvent,
    CompleteEvent,
    FailEvent,
    Lost,
    ReleaseEvent,
    RenewEvent,
    TakeoverEvent,
    apply_claim,
    apply_complete,
    apply_fail,
    apply_release,
    apply_renew,
    apply_takeover,
    fingerprints_agree,
)
from tests.core.state_helpers import (
    ABSENT,
    FP,
    KEEP,
    LEASE,
    NEW,
    NOW,
    OLD,
    OTHER_FP,
    STALE,
    STATES,
    WRONG,
    _claim_ev,
    record,
)


@pytest.mark.parametrize("state", ABSENT)
@pytest.mark.parametrize("takeover", [False, True])
def test_r13_expired_counts_as_absent_and_claim_inserts_fresh(state: str, takeover: bool) -> None:
    new, reply = apply_claim(STATES[state], _claim_ev(takeover=takeover), NOW)
    assert isinstance(reply, Claim)
    assert reply.status is ClaimStatus.NEW
    assert new == Record(
        consumer="billing",
        key="order-1",
        status=Status.IN_PROGRESS,
        fingerprint=FP,
        token=NEW,
        attempt=1,  # a fresh record: the expired one's attempts are forgotten
        created_ms=NOW,
        updated_ms=NOW,
        lease_until_ms=NOW + LEASE,
        expires_ms=NOW + KEEP,
        result=None,
        error=None,
    )


def test_r13_expired_record_with_other_fingerprint_is_no_conflict() -> None:
    # Once expired, a record's fingerprint no longer matters: the key is free again.
    expired = record(Status.COMPLETED, expires=NOW, fingerprint=OTHER_FP)
    new, reply = apply_claim(expired, _claim_ev(takeover=False), NOW)
    assert isinstance(reply, Claim)
    assert reply.status is ClaimStatus.NEW
    assert isinstance(new, Record)
    assert new.fingerprint == FP


def test_r13_one_millisecond_before_expiry_the_record_still_counts() -> None:
    done = record(Status.COMPLETED, expires=NOW + 1)
    new, reply = apply_claim(done, _claim_ev(takeover=True), NOW)
    assert new is UNCHANGED
    assert isinstance(reply, Claim)
    assert reply.status is ClaimStatus.EXISTING
    assert reply.record is done


@pytest.mark.parametrize(("keep", "lease"), [(KEEP, LEASE), (1_000, LEASE), (LEASE, LEASE)])
def test_r13_claim_expires_after_max_of_keep_and_lease(keep: int, lease: int) -> None:
    ev = ClaimEvent("c", "k", None, NEW, lease, keep, False)
    new, _ = apply_claim(None, ev, NOW)
    assert isinstance(new, Record)
    assert new.expires_ms == NOW + max(keep, lease)
    assert new.expires_ms >= new.lease_until_ms, "a record always outlives its lease"


@pytest.mark.parametrize("state", STALE)
def test_r10_takeover_gives_new_token_next_attempt_and_keeps_created(state: str) -> None:
    current = STATES[state]
    assert current is not None
    ev = ClaimEvent("billing", "order-1", None, NEW, LEASE, 1_000, True)
    new, reply = apply_claim(current, ev, NOW)
    assert isinstance(reply, Claim)
    assert reply.status is ClaimStatus.TAKEN_OVER
    assert new == replace(
        current,
        token=NEW,
        attempt=current.attempt + 1,
        updated_ms=NOW,
        lease_until_ms=NOW + LEASE,
        expires_ms=NOW + max(1_000, LEASE),
        fingerprint=FP,  # an unknown incoming fingerprint keeps the stored one
        result=None,
        error=None,
    )


def test_r10_takeover_with_a_fingerprint_fills_in_an_unknown_one() -> None:
    current = record(lease_until=NOW - 1, fingerprint=None)
    new, _ = apply_claim(current, _claim_ev(takeover=True, fingerprint=OTHER_FP), NOW)
    assert isinstance(new, Record)
    assert new.fingerprint == OTHER_FP


def test_r10_takeover_event_follows_the_same_rules_as_claim_with_takeover() -> None:
    current = STATES["stale"]
    by_claim = apply_claim(current, _claim_ev(takeover=True), NOW)
    by_takeover = apply_takeover(current, TakeoverEvent(_claim_ev(takeover=True), OLD), NOW)
    assert by_claim == by_takeover


def test_r10_takeover_event_ignores_the_claims_takeover_flag() -> None:
    # The reconciler looked at exactly this attempt: the expected token is the permission.
    ev = TakeoverEvent(_claim_ev(takeover=False), OLD)
    _, reply = apply_takeover(STATES["stale"], ev, NOW)
    assert isinstance(reply, Claim)
    assert reply.status is ClaimStatus.TAKEN_OVER


@pytest.mark.parametrize("state", ABSENT)
def test_r10_takeover_of_an_absent_record_claims_afresh(state: str) -> None:
    ev = TakeoverEvent(_claim_ev(takeover=False), WRONG)
    assert apply_takeover(STATES[state], ev, NOW) == apply_claim(None, ev.claim, NOW)


@pytest.mark.parametrize(
    ("op", "expected_status"),
    [("complete", Status.COMPLETED), ("fail", Status.FAILED)],
)
def test_r10_fencing_is_by_token_not_time(op: str, expected_status: Status) -> None:
    """A lapsed lease that nobody took over still belongs to its worker."""
    lapsed = record(lease_until=NOW - 60_000)
    if op == "complete":
        new, reply = apply_complete(lapsed, CompleteEvent(OLD, b"42", KEEP, note="n"), NOW)
    else:
        new, reply = apply_fail(lapsed, FailEvent(OLD, "poison", KEEP), NOW)
    assert isinstance(reply, Record)
    assert new is reply
    assert reply.status is expected_status
    assert reply.token == OLD
    assert reply.attempt == lapsed.attempt


def test_r10_renew_and_release_of_a_lapsed_lease_by_its_owner() -> None:
    lapsed = record(lease_until=NOW - 60_000)
    new, reply = apply_renew(lapsed, RenewEvent(OLD, LEASE, 1_000), NOW)
    assert new == replace(
        lapsed, updated_ms=NOW, lease_until_ms=NOW + LEASE, expires_ms=NOW + max(1_000, LEASE)
    )
    assert reply is new
    assert apply_release(lapsed, ReleaseEvent(OLD), NOW) == (DELETE, True)


def test_r10_after_a_takeover_the_old_token_has_lost_every_right() -> None:
    stale = STATES["stale"]
    taken, _ = apply_claim(stale, _claim_ev(takeover=True), NOW)
    assert isinstance(taken, Record)
    for new, reply in (
        apply_complete(taken, CompleteEvent(OLD, b"x", KEEP), NOW),
        apply_fail(taken, FailEvent(OLD, "x", KEEP), NOW),
        apply_renew(taken, RenewEvent(OLD, LEASE, KEEP), NOW),
        apply_release(taken, ReleaseEvent(OLD), NOW),
    ):
        assert new is UNCHANGED
        assert reply == Lost(taken)


def test_complete_sets_result_note_and_expiry_from_keep() -> None:
    live = STATES["live"]
    assert live is not None
    new, reply = apply_complete(
        live, CompleteEvent(OLD, b"result", 5_000, note="by reconciler"), NOW
    )
    assert new == replace(
        live,
        status=Status.COMPLETED,
        updated_ms=NOW,
        expires_ms=NOW + 5_000,  # the lease is over: only retention counts
        result=b"result",
        error="by reconciler",
    )
    assert reply is new


def test_fail_sets_error_clears_result_and_expiry_from_keep() -> None:
    live = replace(record(), result=b"partial")
    new, reply = apply_fail(live, FailEvent(OLD, "poison message", 7_000), NOW)
    assert new == replace(
        live,
        status=Status.FAILED,
        updated_ms=NOW,
        expires_ms=NOW + 7_000,
        result=None,
        error="poison message",
    )
    assert reply is new


def test_complete_repeated_with_the_same_token_is_idempotent() -> None:
    live = STATES["live"]
    first, reply = apply_complete(live, CompleteEvent(OLD, b"1", KEEP), NOW)
    assert isinstance(first, Record)
    later = NOW + 10
    # A retry after a lost reply: even with another result, the stored one stands.
    again, reply = apply_complete(first, CompleteEvent(OLD, b"2", KEEP), later)
    assert again is UNCHANGED
    assert reply is first
    assert first.result == b"1"


def test_fail_repeated_with_the_same_token_is_idempotent() -> None:
    first, _ = apply_fail(STATES["live"], FailEvent(OLD, "poison", KEEP), NOW)
    assert isinstance(first, Record)
    again, reply = apply_fail(first, FailEvent(OLD, "other reason", KEEP), NOW + 10)
    assert again is UNCHANGED
    assert reply is first
    assert first.error == "poison"


def test_complete_after_fail_and_fail_after_complete_are_lost() -> None:
    failed, _ = apply_fail(STATES["live"], FailEvent(OLD, "poison", KEEP), NOW)
    assert isinstance(failed, Record)
    assert apply_complete(failed, CompleteEvent(OLD, b"x", KEEP), NOW) == (UNCHANGED, Lost(failed))
    completed, _ = apply_complete(STATES["live"], CompleteEvent(OLD, b"x", KEEP), NOW)
    assert isinstance(completed, Record)
    assert apply_fail(completed, FailEvent(OLD, "x", KEEP), NOW) == (UNCHANGED, Lost(completed))


@pytest.mark.parametrize(
    ("a", "b", "agree"),
    [
        (None, None, True),
        (None, FP, True),
        (FP, None, True),
        (FP, FP, True),
        (FP, OTHER_FP, False),
        ("", FP, False),  # an empty fingerprint is a value, not "unknown"
    ],
)
def test_r20_fingerprints_agree(a: str | None, b: str | None, agree: bool) -> None:
    assert fingerprints_agree(a, b) is agree
    assert fingerprints_agree(b, a) is agree


@pytest.mark.parametrize(("stored", "incoming"), [(None, FP), (FP, None), (None, None), (FP, FP)])
def test_r20_stale_takeover_when_fingerprints_agree(
    stored: str | None, incoming: str | None
) -> None:
    stale = record(lease_until=NOW - 1, fingerprint=stored)
    _, reply = apply_claim(stale, _claim_ev(takeover=True, fingerprint=incoming), NOW)
    assert isinstance(reply, Claim)
    assert reply.status is ClaimStatus.TAKEN_OVER


@pytest.mark.parametrize("initial", [Status.COMPLETED, Status.FAILED])
def test_r7_transactional_insert_has_no_lease(initial: Status) -> None:
    """Transactional mode inserts the marker already settled: nothing to lease."""
    ev = ClaimEvent("c", "k", FP, NEW, 0, KEEP, False, initial=initial, error="e")
    new, reply = apply_claim(None, ev, NOW)
    assert isinstance(new, Record)
    assert new.status is initial
    assert new.lease_until_ms == NOW
    assert new.expires_ms == NOW + KEEP
    assert new.error == "e"
    assert new.attempt == 1
    assert isinstance(reply, Claim)
    assert reply.status is ClaimStatus.NEW
    assert not new.is_live(NOW)
    assert not new.is_stale(NOW), "a settled record is never stale"


def test_r7_transactional_takeover_of_a_stale_claim_settles_it() -> None:
    stale = STATES["stale"]
    ev = ClaimEvent("billing", "order-1", FP, NEW, 0, KEEP, True, initial=Status.COMPLETED)
    new, reply = apply_claim(stale, ev, NOW)
    assert isinstance(reply, Claim)
    assert reply.status is ClaimStatus.TAKEN_OVER
    assert isinstance(new, Record)
    assert new.status is Status.COMPLETED
    assert new.lease_until_ms == NOW


def test_record_liveness_predicates_at_the_boundaries() -> None:
    rec = record(lease_until=NOW, expires=NOW + 10)
    assert rec.is_live(NOW - 1)
    assert not rec.is_live(NOW)
    assert rec.is_stale(NOW)
    assert not rec.is_stale(NOW - 1)
    assert not rec.is_expired(NOW + 9)
    assert rec.is_expired(NOW + 10)
    done = record(Status.COMPLETED, lease_until=NOW - 100)
    assert not done.is_live(NOW)
    assert not done.is_stale(NOW)


def test_claim_won_property() -> None:
    rec = record()
    assert Claim(ClaimStatus.NEW, rec, NOW).won
    assert Claim(ClaimStatus.TAKEN_OVER, rec, NOW).won
    assert not Claim(ClaimStatus.EXISTING, rec, NOW).won

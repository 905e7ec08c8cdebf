"""The record state machine, cell by cell: every (record state x event) of the table in
:mod:`oncely._core.state`, then the field-level rules (expiry, fencing, idempotent repeats,
fingerprint agreement, the transactional insert).

The table is the specification every store is checked against (R8-R10, R13), so it is tested
exhaustively here, in pure code, with time passed in as a value.
"""

from __future__ import annotations

from collections.abc import Callable
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
    NewState,
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

NOW = 10_000_000
LEASE = 30_000
KEEP = 3_600_000
OLD = "t-old"  # the token of the record in place
NEW = "t-new"  # the token of the incoming claim
WRONG = "t-wrong"
FP = "v1:aaaa"
OTHER_FP = "v1:bbbb"


def record(
    status: Status = Status.IN_PROGRESS,
    *,
    lease_until: int = NOW + 1,
    expires: int = NOW + KEEP,
    fingerprint: str | None = FP,
    token: str = OLD,
) -> Record:
    return Record(
        consumer="billing",
        key="order-1",
        status=status,
        fingerprint=fingerprint,
        token=token,
        attempt=2,
        created_ms=NOW - 50_000,
        updated_ms=NOW - 40_000,
        lease_until_ms=lease_until,
        expires_ms=expires,
        result=b'"stored"' if status is Status.COMPLETED else None,
        error="poison" if status is Status.FAILED else None,
    )


# Every record state of the table. "Expired" comes in every status and at the exact boundary
# (expires == now): an expired record is absent whatever it held.
STATES: dict[str, Record | None] = {
    "absent": None,
    "expired_in_progress": record(lease_until=NOW - 5, expires=NOW),
    "expired_in_progress_earlier": record(lease_until=NOW - 5, expires=NOW - 1),
    "expired_completed": record(Status.COMPLETED, lease_until=NOW - 5, expires=NOW),
    "expired_completed_lease_ahead": record(Status.COMPLETED, lease_until=NOW + 5, expires=NOW),
    "expired_failed": record(Status.FAILED, lease_until=NOW - 5, expires=NOW - 100),
    "live": record(lease_until=NOW + 1),
    "stale": record(lease_until=NOW - 1),
    "stale_at_boundary": record(lease_until=NOW),  # lease_until == now has lapsed
    "completed": record(Status.COMPLETED, lease_until=NOW - 1),
    "completed_lease_ahead": record(Status.COMPLETED, lease_until=NOW + 1_000),
    "failed": record(Status.FAILED, lease_until=NOW - 1),
}

ABSENT = [s for s in STATES if s == "absent" or s.startswith("expired")]
STALE = ["stale", "stale_at_boundary"]
COMPLETED = ["completed", "completed_lease_ahead"]


def _claim_ev(*, takeover: bool, fingerprint: str | None = FP) -> ClaimEvent:
    return ClaimEvent("billing", "order-1", fingerprint, NEW, LEASE, KEEP, takeover)


Apply = Callable[[Record | None], tuple[NewState, object]]

EVENTS: dict[str, Apply] = {
    "claim": lambda cur: apply_claim(cur, _claim_ev(takeover=False), NOW),
    "claim_takeover": lambda cur: apply_claim(cur, _claim_ev(takeover=True), NOW),
    "claim_takeover_other_fp": lambda cur: apply_claim(
        cur, _claim_ev(takeover=True, fingerprint=OTHER_FP), NOW
    ),
    "takeover_right": lambda cur: apply_takeover(
        cur, TakeoverEvent(_claim_ev(takeover=True), OLD), NOW
    ),
    "takeover_wrong": lambda cur: apply_takeover(
        cur, TakeoverEvent(_claim_ev(takeover=True), WRONG), NOW
    ),
    "takeover_right_other_fp": lambda cur: apply_takeover(
        cur, TakeoverEvent(_claim_ev(takeover=True, fingerprint=OTHER_FP), OLD), NOW
    ),
    "complete_right": lambda cur: apply_complete(cur, CompleteEvent(OLD, b"r", KEEP), NOW),
    "complete_wrong": lambda cur: apply_complete(cur, CompleteEvent(WRONG, b"r", KEEP), NOW),
    "fail_right": lambda cur: apply_fail(cur, FailEvent(OLD, "boom", KEEP), NOW),
    "fail_wrong": lambda cur: apply_fail(cur, FailEvent(WRONG, "boom", KEEP), NOW),
    "renew_right": lambda cur: apply_renew(cur, RenewEvent(OLD, LEASE, KEEP), NOW),
    "renew_wrong": lambda cur: apply_renew(cur, RenewEvent(WRONG, LEASE, KEEP), NOW),
    "release_right": lambda cur: apply_release(cur, ReleaseEvent(OLD), NOW),
    "release_wrong": lambda cur: apply_release(cur, ReleaseEvent(WRONG), NOW),
}

# What each cell does. NEW / TAKEN_OVER / EXISTING: the claim's status. APPLIED: the write
# happened and returns the new record. AS_IS: an idempotent repeat, the record unchanged.
# LOST: fenced, nothing changed. DELETED: release removed the record. FALSE: nothing to release.
_ABSENT_ROW = {
    "claim": "NEW",
    "claim_takeover": "NEW",
    "claim_takeover_other_fp": "NEW",
    "takeover_right": "NEW",
    "takeover_wrong": "NEW",
    "takeover_right_other_fp": "NEW",
    "complete_right": "LOST",
    "complete_wrong": "LOST",
    "fail_right": "LOST",
    "fail_wrong": "LOST",
    "renew_right": "LOST",
    "renew_wrong": "LOST",
    "release_right": "FALSE",
    "release_wrong": "FALSE",
}
_OWNED_ROW = {  # in progress, live or stale: the token decides
    "complete_right": "APPLIED",
    "complete_wrong": "LOST",
    "fail_right": "APPLIED",
    "fail_wrong": "LOST",
    "renew_right": "APPLIED",
    "renew_wrong": "LOST",
    "release_right": "DELETED",
    "release_wrong": "LOST",
}
_LIVE_ROW = {
    "claim": "EXISTING",
    "claim_takeover": "EXISTING",
    "claim_takeover_other_fp": "EXISTING",
    "takeover_right": "EXISTING",
    "takeover_wrong": "EXISTING",
    "takeover_right_other_fp": "EXISTING",
    **_OWNED_ROW,
}
_STALE_ROW = {
    "claim": "EXISTING",
    "claim_takeover": "TAKEN_OVER",
    "claim_takeover_other_fp": "EXISTING",  # a key conflict is never taken over
    "takeover_right": "TAKEN_OVER",
    "takeover_wrong": "EXISTING",
    "takeover_right_other_fp": "EXISTING",
    **_OWNED_ROW,
}
_DONE_ROW = {
    "claim": "EXISTING",
    "claim_takeover": "EXISTING",
    "claim_takeover_other_fp": "EXISTING",
    "takeover_right": "EXISTING",
    "takeover_wrong": "EXISTING",
    "takeover_right_other_fp": "EXISTING",
    "complete_wrong": "LOST",
    "fail_wrong": "LOST",
    "renew_right": "LOST",
    "renew_wrong": "LOST",
    "release_right": "LOST",
    "release_wrong": "LOST",
}
_COMPLETED_ROW = {**_DONE_ROW, "complete_right": "AS_IS", "fail_right": "LOST"}
_FAILED_ROW = {**_DONE_ROW, "complete_right": "LOST", "fail_right": "AS_IS"}


def _row(state: str) -> dict[str, str]:
    if state in ABSENT:
        return _ABSENT_ROW
    if state == "live":
        return _LIVE_ROW
    if state in STALE:
        return _STALE_ROW
    if state in COMPLETED:
        return _COMPLETED_ROW
    assert state == "failed"
    return _FAILED_ROW


CELLS = [(state, event, _row(state)[event]) for state in STATES for event in EVENTS]


def test_table_covers_every_cell() -> None:
    assert len(CELLS) == len(STATES) * len(EVENTS)
    for state in STATES:
        assert set(_row(state)) == set(EVENTS)


def _classify(current: Record | None, now: int, new: NewState, reply: object) -> str:
    """Name what happened, checking the invariants every cell shares on the way."""
    visible = None if current is None or current.expires_ms <= now else current
    if isinstance(reply, Claim):
        assert reply.now_ms == now
        if reply.status is ClaimStatus.EXISTING:
            assert new is UNCHANGED
            assert reply.record is visible
        else:
            assert new is reply.record
        return reply.status.name
    if isinstance(reply, Lost):
        assert new is UNCHANGED, "a fenced write that did not apply changes nothing"
        assert reply.current is visible, "Lost carries the record now (None when absent)"
        return "LOST"
    if reply is True:
        assert new is DELETE
        return "DELETED"
    if reply is False:
        assert new is UNCHANGED
        return "FALSE"
    assert isinstance(reply, Record)
    if new is UNCHANGED:
        assert reply is visible
        return "AS_IS"
    assert new is reply
    return "APPLIED"


@pytest.mark.parametrize(("state", "event", "expected"), CELLS)
def test_r10_state_table_cell(state: str, event: str, expected: str) -> None:
    current = STATES[state]
    new, reply = EVENTS[event](current)
    assert _classify(current, NOW, new, reply) == expected


# ------------------------------------------------------------------ field-level rules


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

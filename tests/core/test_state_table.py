"""The record state machine, cell by cell: every (record state x event) of the table in
:mod:`oncely._core.state`. The field-level rules (expiry, fencing, idempotent repeats,
fingerprint agreement, the transactional insert) are in ``test_state_rules.py``.

The table is the specification every store is checked against (R8-R10, R13), so it is tested
exhaustively here, in pure code, with time passed in as a value.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from oncely._core.records import Claim, ClaimStatus, Record
from oncely._core.state import (
    DELETE,
    UNCHANGED,
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
)
from tests.core.state_helpers import (
    ABSENT,
    COMPLETED,
    KEEP,
    LEASE,
    NOW,
    OLD,
    OTHER_FP,
    STALE,
    STATES,
    WRONG,
    _claim_ev,
)

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

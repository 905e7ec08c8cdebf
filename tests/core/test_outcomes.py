"""Outcomes and broker actions: the closed set and its table (module docstring of
:mod:`oncely._core.outcomes`), and :class:`Handled` as a value and as a call result."""

from __future__ import annotations

import logging

import pytest

from oncely._core.outcomes import Action, Handled, Outcome
from oncely.errors import Escalated, InFlight, KeyConflict, OutcomeError, Rejected

# The table in the module docstring, written out again on purpose: a change to either is seen.
DOCUMENTED = {
    "processed": "ack",
    "duplicate": "ack",
    "in_flight": "requeue_later",
    "key_conflict": "dead_letter",
    "stale_reclaimed": "ack",
    "escalated": "park",
    "failed": "retry",
    "rejected": "dead_letter",
}

OK = {Outcome.PROCESSED, Outcome.DUPLICATE, Outcome.STALE_RECLAIMED}


def test_the_outcome_set_is_closed() -> None:
    assert {o.value for o in Outcome} == set(DOCUMENTED)
    assert {a.value for a in Action} == set(DOCUMENTED.values())


@pytest.mark.parametrize("outcome", list(Outcome))
def test_every_outcome_maps_to_the_documented_action(outcome: Outcome) -> None:
    assert outcome.action is Action(DOCUMENTED[outcome.value])
    assert Handled(outcome, "c", "k").action is outcome.action


def test_r8_in_flight_is_never_acknowledged() -> None:
    assert Outcome.IN_FLIGHT.action is not Action.ACK


def test_r20_key_conflict_is_never_acknowledged() -> None:
    assert Outcome.KEY_CONFLICT.action is Action.DEAD_LETTER


@pytest.mark.parametrize("outcome", [Outcome.KEY_CONFLICT, Outcome.REJECTED, Outcome.ESCALATED])
def test_r16_outcomes_a_person_must_see_log_at_error(outcome: Outcome) -> None:
    assert outcome.log_level == logging.ERROR


@pytest.mark.parametrize("outcome", list(Outcome))
def test_every_outcome_has_a_log_level(outcome: Outcome) -> None:
    assert outcome.log_level in {logging.INFO, logging.WARNING, logging.ERROR}


@pytest.mark.parametrize("outcome", list(Outcome))
def test_ok(outcome: Outcome) -> None:
    assert Handled(outcome, "c", "k").ok is (outcome in OK)


@pytest.mark.parametrize("outcome", sorted(OK))
def test_unwrap_returns_the_value_on_success(outcome: Outcome) -> None:
    assert Handled(outcome, "c", "k", value={"id": 1}).unwrap() == {"id": 1}
    assert Handled(outcome, "c", "k").unwrap() is None


@pytest.mark.parametrize(
    ("outcome", "error"),
    [
        (Outcome.IN_FLIGHT, InFlight),
        (Outcome.KEY_CONFLICT, KeyConflict),
        (Outcome.ESCALATED, Escalated),
        (Outcome.REJECTED, Rejected),
    ],
)
def test_unwrap_raises_the_matching_error(outcome: Outcome, error: type[OutcomeError]) -> None:
    handled: Handled[object] = Handled(outcome, "billing", "order-1", reason="why not")
    with pytest.raises(error) as info:
        handled.unwrap()
    assert type(info.value) is error
    assert info.value.handled is handled
    text = str(info.value)
    assert outcome.value in text
    assert "'order-1'" in text
    assert "'billing'" in text
    assert "why not" in text


def test_unwrap_reraises_the_handlers_own_exception_for_failed() -> None:
    boom = ConnectionResetError("provider hung up")
    handled: Handled[object] = Handled(Outcome.FAILED, "c", "k", error=boom, reason="transient")
    with pytest.raises(ConnectionResetError) as info:
        handled.unwrap()
    assert info.value is boom


def test_unwrap_of_a_rejected_message_without_a_key() -> None:
    handled: Handled[object] = Handled(Outcome.REJECTED, "c", None, reason="no key")
    with pytest.raises(Rejected, match="None"):
        handled.unwrap()

"""The pure part of the entity-as-marker flow (R6, R20): outcomes and their broker actions, the
calls that cannot work and are refused, and the flow's steps, with no database.
"""

from __future__ import annotations

from decimal import Decimal

import pytest
import sqlalchemy as sa
from sqlalchemy.dialects import mysql, oracle, sqlite
from sqlalchemy.exc import IntegrityError

import oncely
from oncely.integrations.entity import EntityOutcome, EntityResult
from oncely.integrations.entity import _flow as _entity_flow
from tests.integrations.entity_helpers import BODY, CREATED, DUPLICATE, KEY_CONFLICT, ORDER, _tables

# --- the pure part: outcomes, configuration, the flow --------------------------------


def test_r20_outcomes_map_to_oncely_outcomes_and_broker_actions() -> None:
    assert {o: (o.as_outcome, o.action) for o in EntityOutcome} == {
        CREATED: (oncely.Outcome.PROCESSED, oncely.Action.ACK),
        DUPLICATE: (oncely.Outcome.DUPLICATE, oncely.Action.ACK),
        KEY_CONFLICT: (oncely.Outcome.KEY_CONFLICT, oncely.Action.DEAD_LETTER),
    }
    conflict = EntityResult(KEY_CONFLICT, {"order_id": "o-1"}, {"order_id": "o-1"}, ("a",), "r")
    handled = conflict.handled("orders")
    assert (handled.outcome, handled.key, handled.value, handled.reason) == (
        oncely.Outcome.KEY_CONFLICT,
        "o-1",
        None,
        "r",
    )
    with pytest.raises(oncely.KeyConflict):
        handled.unwrap()
    composite = EntityResult(DUPLICATE, {"t": 1, "id": "x"}, {"t": 1, "id": "x"})
    assert composite.handled("c").key == '{"id":"x","t":1}'
    assert composite.handled("c").value == {"t": 1, "id": "x"}


def _plan(table: sa.Table, **overrides: object) -> _entity_flow.Plan:
    arguments: dict[str, object] = {
        "dialect": sqlite.dialect(),
        "key": {"order_id": "o-1"},
        "values": ORDER,
        "compare": ("amount",),
        "fingerprint_column": None,
        "payload": _entity_flow.MISSING,
        "fingerprinter": oncely.fingerprint,
    }
    arguments.update(overrides)
    return _entity_flow.make_plan(table, **arguments)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"key": {"customer_id": "c-1"}}, "not the primary key nor a unique"),
        ({"compare": ()}, "say how to tell a duplicate"),
        ({"compare": "amount"}, "not the string"),
        ({"compare": ("email",)}, "which values do not give"),
        ({"values": {**ORDER, "colour": "red"}}, "has no column 'colour'"),
        ({"fingerprint_column": "request_fingerprint"}, "needs the payload"),
        ({"payload": BODY}, "only used with fingerprint_column"),
        ({"dialect": oracle.dialect()}, "not oracle"),
        ({"values": {"order_id": "o-2"}}, "other than the key"),
    ],
)
def test_r6_a_call_that_cannot_work_is_refused(overrides: dict[str, object], message: str) -> None:
    _customers, orders, _lines, _outbox = _tables(sa.MetaData())
    with pytest.raises(oncely.ConfigurationError, match=message):
        _plan(orders, **overrides)
    with pytest.raises(oncely.InvalidKey):
        _plan(orders, key={"order_id": None})


def test_r20_a_key_that_vanishes_after_its_conflict_is_retried_then_reported() -> None:
    _customers, orders, _lines, _outbox = _tables(sa.MetaData())
    steps = _entity_flow.flow(_plan(orders))
    step = next(steps)
    for attempt in range(3):
        assert isinstance(step.statement, sa.Insert)
        step = steps.send(_entity_flow.Answer([]))  # the insert did nothing: a conflict
        assert isinstance(step.statement, sa.Select)
        if attempt < 2:
            step = steps.send(_entity_flow.Answer([]))  # ...and the read found nothing
    with pytest.raises(oncely.StoreUnavailable, match="gone when read"):
        steps.send(_entity_flow.Answer([]))


def test_r20_mysql_duplicate_on_another_unique_key_is_re_raised() -> None:
    _customers, orders, _lines, _outbox = _tables(sa.MetaData())
    steps = _entity_flow.flow(_plan(orders, dialect=mysql.dialect()))
    step = next(steps)
    assert step.duplicate_ok
    duplicate = IntegrityError("INSERT ...", {}, Exception(1062, "Duplicate entry for 'email'"))
    assert _entity_flow.is_duplicate_key(duplicate)
    assert not _entity_flow.is_duplicate_key(IntegrityError("INSERT", {}, Exception(1048, "null")))
    step = steps.send(duplicate)
    assert isinstance(step.statement, sa.Select)
    with pytest.raises(IntegrityError) as raised:
        steps.send(_entity_flow.Answer([]))  # no row has the key: the duplicate was elsewhere
    assert raised.value is duplicate


def test_r20_numbers_compare_by_value_and_nothing_else_is_coerced() -> None:
    same = _entity_flow.same_value
    assert same(Decimal("5.00"), 5)
    assert same(0.1, Decimal("0.10"))
    assert not same(Decimal("5.01"), 5)
    assert not same("5", 5)
    assert not same(None, 0)

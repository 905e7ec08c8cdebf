"""Typed results read back from their stored JSON form (``oncely._core.typed``): dataclasses
nested in containers, optional fields, pydantic models, dates, decimals, UUIDs, enums."""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import UTC, date, datetime
from decimal import Decimal
from enum import Enum
from typing import Any
from uuid import UUID, uuid4

import pydantic
import pytest

from oncely import PayloadError
from oncely._core.fingerprint import canonical_json
from oncely._core.typed import revive


class Colour(Enum):
    RED = "red"


@dataclass
class Item:
    name: str
    colour: Colour
    made: date


@dataclass
class Order:
    id: UUID
    items: list[Item]
    by_sku: dict[str, Item]
    total: Decimal | None
    pair: tuple[int, str]


class Receipt(pydantic.BaseModel):
    order: str
    at: datetime


def stored(value: object) -> Any:
    """What a duplicate gets before its type is brought back: the result's JSON form."""
    return json.loads(canonical_json(value))


def test_r1_a_dataclass_tree_comes_back_as_it_was_returned() -> None:
    item = Item("pen", Colour.RED, date(2026, 12, 1))
    order = Order(uuid4(), [item], {"p": item}, Decimal("9.90"), (1, "a"))
    assert revive(Order, stored(order)) == order
    assert revive(Order, stored(Order(order.id, [], {}, None, (2, "b")))).total is None


def test_r1_a_pydantic_model_and_plain_values() -> None:
    receipt = Receipt(order="o-1", at=datetime(2026, 12, 1, tzinfo=UTC))
    assert revive(Receipt, stored(receipt)) == receipt
    assert revive(list[datetime], stored([receipt.at])) == [receipt.at]
    assert revive(dict, {"a": 1}) == {"a": 1}
    assert revive(Any, [1, 2]) == [1, 2]


def test_r1_a_result_that_cannot_be_read_back_raises_payload_error() -> None:
    with pytest.raises(PayloadError, match="cannot be read back"):
        revive(Item, {"name": "pen"})


def test_r1_a_set_comes_back_with_its_members_as_they_were() -> None:
    # Before, the stored form of a set was its members' canonical JSON text: {1, 2, 10} came
    # back as {"1", "10", "2"} (and as ["1", "10", "2"] without a declared type).
    import oncely

    inbox = oncely.Inbox(oncely.open("memory://"), consumer="c")

    @inbox.idempotent(key=lambda order: order)
    def lines(order: str) -> set[int]:
        return {1, 2, 10}

    @inbox.idempotent(key=lambda order: f"tags:{order}")
    def tags(order: str) -> dict[str, Any]:
        return {"tags": frozenset({"b", "a"}), "ids": {UUID(int=1)}}

    assert lines("o-1") == lines("o-1") == {1, 2, 10}
    tags("o-1")
    assert tags("o-1") == {"tags": ["a", "b"], "ids": [str(UUID(int=1))]}
    # A payload's fingerprint takes a set's members as their canonical text, as before.
    assert canonical_json({"s": {1, 2, 10}}) == '{"s":["1","10","2"]}'

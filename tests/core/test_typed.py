"""Typed results read back from their stored JSON form (``oncely._core.typed``): dataclasses
nested in containers, optional fields, pydantic models, dates, decimals, UUIDs, enums."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from datetime import UTC, date, datetime
from decimal import Decimal
from enum import Enum
from typing import Any, NamedTuple, TypedDict
from uuid import UUID, uuid4

import pydantic
import pytest

import oncely
from oncely import PayloadError
from oncely._core.fingerprint import canonical_json, result_json
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


class Point(NamedTuple):
    x: int
    at: datetime


class Stamped(TypedDict):
    when: datetime
    note: str


@pytest.mark.parametrize(
    ("annotation", "value"),
    [
        (bytes, b"\x00\xff"),
        (dict[int, str], {1: "a", 20: "b"}),
        (Point, Point(1, datetime(2026, 1, 1, tzinfo=UTC))),
        (Stamped, {"when": datetime(2026, 1, 1, tzinfo=UTC), "note": "n"}),
        (datetime | str, "2026-01-01"),  # a string that looks like a date stays a string
        (datetime | str, datetime(2026, 1, 1, tzinfo=UTC)),
        (Decimal | str, "not a number"),  # Decimal raises InvalidOperation: the next member
        (Decimal | str, Decimal("1.10")),
        (int | None, None),
        (float, 2.0),
    ],
)
def test_r1_more_shapes_come_back_as_they_were_returned(annotation: Any, value: object) -> None:
    """Before: bytes came back as their base64 text, int keys as strings, a NamedTuple as a
    list, a TypedDict's datetime as a string, a string in ``datetime | str`` as a datetime,
    and ``Decimal | str`` raised on every repeat."""
    back = revive(annotation, stored(value))
    assert back == value and type(back) is type(value)


def test_r1_a_union_takes_the_first_member_the_stored_form_reads_back_as() -> None:
    # The JSON form cannot say which member a string was: one that is exactly a member's
    # stored form becomes that member; one that only parses as it stays a string.
    assert revive(date | str, "2026-01-01") == date(2026, 1, 1)
    assert revive(datetime | str, "2026-01-01") == "2026-01-01"
    assert revive(str | date, "2026-01-01") == "2026-01-01"
    assert revive(int | bool, True) is True


def test_r1_a_repeat_whose_first_result_was_not_kept_raises_instead_of_returning_none() -> None:
    """Before, a repeat of a call whose result was over ``max_result_bytes`` returned
    ``None`` from a function annotated ``-> str``; now it raises ResultUnavailable, and the
    call is not run again. A function that returned ``None`` still repeats as ``None``."""
    inbox = oncely.Inbox(
        oncely.open("memory://"), consumer="c", limits=oncely.Limits(max_result_bytes=100)
    )
    runs: list[str] = []

    @inbox.idempotent(key=lambda order: order)
    def big(order: str) -> str:
        runs.append(order)
        return "x" * 1000

    @inbox.idempotent(key=lambda order: f"none-{order}")
    def nothing(order: str) -> None:
        runs.append(order)

    assert big("o-1") == "x" * 1000
    with pytest.raises(oncely.ResultUnavailable, match="over the limit") as raised:
        big("o-1")
    assert raised.value.handled.outcome is oncely.Outcome.DUPLICATE
    assert nothing("o-2") is None and nothing("o-2") is None
    assert runs == ["o-1", "o-2"]


def test_r1_a_claim_completed_without_its_result_says_so_to_every_repeat() -> None:
    """``complete(not_kept=why)``: the work is done but its result is another's (a Celery task
    replaced by another one, say). Its repeats raise ResultUnavailable with ``why`` rather
    than return a ``None`` the work never returned; a result and ``not_kept`` together are
    refused, the claim still held."""
    # No fingerprints: the key is the claim's, not a function's, so an @idempotent function
    # reaching it would otherwise be a key conflict (a key belongs to one function).
    inbox = oncely.Inbox(
        oncely.open("memory://"), consumer="c", fingerprint=oncely.Fingerprint.none()
    )
    claimed = inbox.claim("o-1", {"order": "o-1"})
    with pytest.raises(ValueError, match="not both"):
        claimed.complete("done", not_kept="elsewhere")
    assert claimed.won
    assert claimed.complete(not_kept="task t-1 answers for it").outcome is oncely.Outcome.PROCESSED
    repeat = inbox.claim("o-1", {"order": "o-1"}).handled
    assert repeat is not None and repeat.outcome is oncely.Outcome.DUPLICATE
    assert repeat.value is None and repeat.reason == "result not stored: task t-1 answers for it"
    with pytest.raises(oncely.ResultUnavailable, match="task t-1 answers for it"):
        inbox.idempotent(key=lambda order: order)(lambda order: "ran again")("o-1")

    async def run_async() -> oncely.Handled[object] | None:
        ainbox = oncely.AsyncInbox(oncely.open_async("memory://"), consumer="c")
        aclaimed = await ainbox.claim("o-1", {"order": "o-1"})
        await aclaimed.complete(not_kept="task t-1 answers for it")
        return (await ainbox.claim("o-1", {"order": "o-1"})).handled

    again = asyncio.run(run_async())
    assert again is not None and again.reason == "result not stored: task t-1 answers for it"


def test_r1_a_method_is_keyed_and_fingerprinted_without_its_instance() -> None:
    """Before, ``self`` was part of the fingerprinted payload: every call was rejected (an
    object has no canonical form)."""
    inbox = oncely.Inbox(oncely.open("memory://"), consumer="c")

    class Billing:
        def __init__(self) -> None:
            self.charged: list[int] = []

        @inbox.idempotent(key=lambda self, order, amount: order)
        def charge(self, order: str, amount: int) -> int:
            self.charged.append(amount)
            return amount

    first, second = Billing(), Billing()
    assert first.charge("o-1", 5) == 5
    assert second.charge("o-1", 5) == 5  # another instance, the same call: a duplicate
    assert first.charged == [5] and second.charged == []
    with pytest.raises(oncely.KeyConflict):
        first.charge("o-1", 6)


def test_r1_handle_brings_a_repeat_back_as_the_annotation_read_once_or_later() -> None:
    """``Inbox.handle`` reads a handler's return annotation at its first duplicate and keeps
    the converter; an annotation naming a class not defined yet is read again at the next
    duplicate (not cached as "no type"), and a stored form the type refuses is a
    PayloadError, as ``revive`` says."""
    inbox = oncely.Inbox(oncely.open("memory://"), consumer="c")

    def charge(payload: dict[str, str]) -> Later:  # type: ignore[name-defined]  # noqa: F821
        return {"id": payload["id"], "amount": "1.50"}  # Later's stored form; Later comes later

    assert inbox.handle("k", {"id": "a"}, charge).outcome is oncely.Outcome.PROCESSED
    namespace = globals()
    assert "Later" not in namespace
    early = inbox.handle("k", {"id": "a"}, charge)
    assert early.outcome is oncely.Outcome.DUPLICATE and early.value == {
        "id": "a",
        "amount": "1.50",
    }

    @dataclass
    class Defined:
        id: str
        amount: Decimal

    namespace["Later"] = Defined
    try:
        for _ in range(2):  # the second repeat takes the converter kept by the first
            again = inbox.handle("k", {"id": "a"}, charge)
            assert again.value == Defined("a", Decimal("1.50"))
        wrong = oncely.Inbox(oncely.open("memory://"), consumer="c")
        wrong.handle("w", {}, lambda _payload: {"id": "a"})  # no amount: not a Later

        def reads_later(_payload: object) -> Later:  # type: ignore[name-defined]  # noqa: F821
            raise AssertionError("a duplicate never runs the handler")

        with pytest.raises(PayloadError, match="cannot be read back"):
            wrong.handle("w", {}, reads_later)
    finally:
        del namespace["Later"]


def test_r1_a_bare_tuple_set_or_frozenset_comes_back_as_itself() -> None:
    # Before, ``-> tuple`` (``set``, ``frozenset``) without item types came back as the list
    # it is stored as; ``tuple[int, int]`` already came back as a tuple.
    import typing

    from oncely._core.fingerprint import result_json

    for annotation, value, kind in (
        (tuple, (1, "a"), tuple),
        (typing.Tuple, (1, "a"), tuple),  # noqa: UP006 - the typing spelling, on purpose
        (tuple[()], (), tuple),
        (set, {1, 2}, set),
        (typing.Set, {1, 2}, set),  # noqa: UP006
        (frozenset, frozenset({"x"}), frozenset),
    ):
        back = revive(annotation, json.loads(result_json(value)))  # the stored form
        assert type(back) is kind and back == value, annotation


def test_r1_a_bare_set_of_tuples_comes_back_and_one_of_dicts_stays_as_stored() -> None:
    """A bare ``set`` annotation over tuples: stored as a list of lists, which a set cannot
    hold. Its repeat raised ``unhashable type: 'list'`` on every call; now the members come
    back as tuples, and members with no hashable form (dicts) leave the stored list."""
    kept = json.loads(result_json({(1, 2), (3, 4)}))  # what a record keeps: [[1,2],[3,4]]
    assert revive(set, kept) == {(1, 2), (3, 4)}
    nested = json.loads(result_json(frozenset({(1, (2, 3))})))
    assert revive(frozenset, nested) == frozenset({(1, (2, 3))})
    assert revive(set, [{"a": 1}]) == [{"a": 1}]
    assert revive(tuple, [1, [2]]) == (1, [2])

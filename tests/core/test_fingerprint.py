"""Canonical fingerprints (R20 steps 4-6): property tests with hypothesis.

A fingerprint must not change when a payload is re-serialised (dict order, JSON white space, a
tuple that came back as a list), and must change when the content does; otherwise a duplicate is
taken for a key conflict, or a conflict slips through as a duplicate.
"""

from __future__ import annotations

import dataclasses
import json
import random
import types
from datetime import UTC, date, datetime, time, timedelta, timezone
from decimal import Decimal
from enum import Enum
from typing import Any
from uuid import UUID

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from oncely._core.fingerprint import Fingerprint, canonical_json, fingerprint
from oncely.errors import ConfigurationError, UnfingerprintablePayload

# JSON values as json.loads gives them back (finite floats: NaN is not equal to itself).
scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**63)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8)
)
json_values = st.recursive(
    scalars,
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=4)
    ),
    max_leaves=20,
)
json_documents = st.one_of(
    st.lists(json_values, max_size=4), st.dictionaries(st.text(max_size=6), json_values, max_size=5)
)


def shuffled(value: Any, rnd: random.Random) -> Any:
    """The same value with every dict built in another key order."""
    if isinstance(value, dict):
        items = list(value.items())
        rnd.shuffle(items)
        return {k: shuffled(v, rnd) for k, v in items}
    if isinstance(value, list):
        return [shuffled(v, rnd) for v in value]
    return value


def as_tuples(value: Any) -> Any:
    """The same value with every list turned into a tuple."""
    if isinstance(value, dict):
        return {k: as_tuples(v) for k, v in value.items()}
    if isinstance(value, list):
        return tuple(as_tuples(v) for v in value)
    return value


def test_format_is_versioned_blake2b_128() -> None:
    fp = fingerprint({"a": 1})
    assert fp.startswith("v1:")
    assert len(fp) == 3 + 32
    int(fp[3:], 16)  # hex


@given(json_values, st.randoms(use_true_random=False))
def test_r20_invariant_under_dict_key_order(value: Any, rnd: random.Random) -> None:
    assert fingerprint(shuffled(value, rnd)) == fingerprint(value)


@given(
    json_documents,
    st.sampled_from([None, 0, 2, "\t"]),
    st.sampled_from([(",", ":"), (", ", ": "), (" , ", " : ")]),
    st.booleans(),
    st.booleans(),
)
def test_r20_invariant_under_json_reserialisation(
    value: Any, indent: int | str | None, separators: tuple[str, str], ascii_only: bool, sort: bool
) -> None:
    text = json.dumps(
        value, indent=indent, separators=separators, ensure_ascii=ascii_only, sort_keys=sort
    )
    expected = fingerprint(value)
    assert fingerprint(text) == expected
    assert fingerprint(text.encode("utf-8")) == expected
    assert fingerprint(bytearray(text.encode("utf-8"))) == expected
    assert fingerprint(memoryview(text.encode("utf-8"))) == expected


@given(json_values)
def test_r20_invariant_under_tuples_for_lists(value: Any) -> None:
    assert fingerprint(as_tuples(value)) == fingerprint(value)


@given(json_values, json_values)
def test_r20_different_content_gives_different_fingerprints(a: Any, b: Any) -> None:
    assume(canonical_json(a) != canonical_json(b))
    assert fingerprint(a) != fingerprint(b)


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ({"amount": 5}, {"amount": 6}),
        ({"amount": 5}, {"amount": "5"}),
        ([1, 2], [2, 1]),  # list order is content
        ({"a": None}, {}),
        ({"a": True}, {"a": 1}),
        ("abc", "abd"),
        (b"\x00\x01", b"\x00\x02"),
    ],
)
def test_r20_examples_of_different_content(a: object, b: object) -> None:
    assert fingerprint(a) != fingerprint(b)


def test_non_json_text_and_bytes_are_hashed_as_they_are() -> None:
    assert fingerprint("hello") == fingerprint(b"hello")
    assert fingerprint("hello") != fingerprint("hello ")
    assert fingerprint(b"\xff\xfe") != fingerprint(b"\xff\xff")
    # Text that starts like JSON but is not: hashed raw, no error.
    assert fingerprint("{not json") == fingerprint(b"{not json")


# ------------------------------------------------------------------ Fingerprint.fields


def test_r20_fields_picks_only_the_named_fields() -> None:
    by = Fingerprint.fields("order_id", "amount")
    base = {"order_id": "A-1", "amount": 10, "sent_at": "2026-01-01T00:00:00Z", "trace": "x"}
    assert by(base) == by({**base, "sent_at": "2026-01-02T00:00:00Z", "trace": "y"})
    assert by(base) == by({"amount": 10, "order_id": "A-1"})
    assert by(base) != by({**base, "amount": 11})
    assert by(base) != by({**base, "order_id": "A-2"})


def test_r20_fields_dotted_paths_reach_into_nested_mappings() -> None:
    by = Fingerprint.fields("customer.id", "total")
    base = {"customer": {"id": 7, "name": "x"}, "total": 3, "note": "n"}
    assert by(base) == by({**base, "customer": {"id": 7, "name": "y"}, "note": "m"})
    assert by(base) != by({**base, "customer": {"id": 8, "name": "x"}})


def test_r20_fields_read_attributes_of_objects() -> None:
    @dataclasses.dataclass
    class Customer:
        id: int
        name: str

    @dataclasses.dataclass
    class Order:
        customer: Customer
        total: int
        sent_at: str

    by = Fingerprint.fields("customer.id", "total")
    assert by(Order(Customer(1, "a"), 5, "t1")) == by(Order(Customer(1, "b"), 5, "t2"))
    assert by(Order(Customer(1, "a"), 5, "t1")) != by(Order(Customer(2, "a"), 5, "t1"))
    # An object and a mapping with the same fields agree.
    assert by(Order(Customer(1, "a"), 5, "t1")) == by({"customer": {"id": 1}, "total": 5})


def test_fields_missing_is_the_same_as_null() -> None:
    by = Fingerprint.fields("a", "b.c")
    assert by({"a": 1}) == by({"a": 1, "b": None}) == by({"a": 1, "b": {"c": None}})
    assert by({"a": 1}) != by({"a": 1, "b": {"c": 0}})


@given(
    st.dictionaries(st.sampled_from(["id", "amount", "ts", "trace"]), json_values, min_size=1),
    json_values,
    json_values,
)
def test_r20_fields_property(payload: dict[str, Any], other: Any, named: Any) -> None:
    by = Fingerprint.fields("id", "amount")
    assert by({**payload, "ts": other}) == by({**payload, "ts": named}), "unnamed field ignored"
    before = by({**payload, "amount": named})
    after = by({**payload, "amount": other})
    assert (before == after) == (canonical_json(named) == canonical_json(other))


def test_fingerprints_are_pinned_values() -> None:
    """Fingerprints are stored with records and compared across releases and processes: a
    change of any of these values would turn redeliveries of old messages into conflicts."""
    payload = {
        "order_id": "ord-1",
        "amount_cents": 1250,
        "customer": {"id": "cus-7", "tier": "gold"},
        "items": [{"sku": "A", "qty": 2}],
        "note": None,
        "é": "ü",
    }
    assert fingerprint(payload) == "v1:8989338b6fbaaf6b35a0c3fe69fc7c64"
    by = Fingerprint.fields("order_id", "customer.id", "customer.missing.deeper", "amount_cents")
    assert by(payload) == "v1:8f4c03b37859091dadc0197f879cb39b"
    # Mappings that are not dicts, and objects, lead to the same value.
    proxy = types.MappingProxyType
    inner = proxy({"id": "cus-7"})
    assert by(proxy({"order_id": "ord-1", "customer": inner, "amount_cents": 1250})) == by(payload)
    order = types.SimpleNamespace(
        order_id="ord-1", customer=types.SimpleNamespace(id="cus-7"), amount_cents=1250
    )
    assert by(order) == by(payload)


def test_a_field_with_no_canonical_form_is_a_typed_error() -> None:
    with pytest.raises(UnfingerprintablePayload, match=r"Fingerprint\.fields"):
        Fingerprint.fields("order_id")({"order_id": object()})


def test_fields_needs_a_field() -> None:
    with pytest.raises(ConfigurationError):
        Fingerprint.fields()


def test_payload_and_none_fingerprinters() -> None:
    assert Fingerprint.payload()({"a": 1}) == fingerprint({"a": 1})
    assert Fingerprint.none()({"a": 1}) is None


# ------------------------------------------------------------------ values JSON has no type for


class Color(Enum):
    RED = "red"


@dataclasses.dataclass(frozen=True)
class Line:
    sku: str
    qty: int


def test_datetimes_are_their_iso_form() -> None:
    at = datetime(2026, 1, 2, 3, 4, 5, 678000, tzinfo=UTC)
    assert fingerprint({"at": at}) == fingerprint({"at": at.isoformat()})
    assert fingerprint({"at": at}) == fingerprint(json.dumps({"at": at.isoformat()}))
    assert fingerprint({"d": date(2026, 1, 2)}) == fingerprint({"d": "2026-01-02"})
    assert fingerprint({"t": time(3, 4)}) == fingerprint({"t": "03:04:00"})
    # The same instant in another zone is other text: fingerprints are of content, not meaning.
    other_zone = at.astimezone(timezone(timedelta(hours=2)))
    assert fingerprint({"at": at}) != fingerprint({"at": other_zone})


def test_decimal_uuid_enum_bytes() -> None:
    assert fingerprint({"x": Decimal("1.50")}) == fingerprint({"x": "1.50"})
    assert fingerprint({"x": Decimal("1.50")}) != fingerprint({"x": Decimal("1.5")})
    u = UUID("12345678-1234-5678-1234-567812345678")
    assert fingerprint({"id": u}) == fingerprint({"id": str(u)})
    assert fingerprint({"c": Color.RED}) == fingerprint({"c": "red"})
    assert fingerprint({"b": b"\x00\xff"}) == fingerprint({"b": "AP8="})


def test_sets_are_order_free() -> None:
    assert fingerprint({"tags": {"b", "a", "c"}}) == fingerprint({"tags": {"c", "a", "b"}})
    assert fingerprint({"tags": frozenset({1, 2})}) == fingerprint({"tags": {2, 1}})
    assert fingerprint({"tags": {1, 2}}) != fingerprint({"tags": {1, 3}})
    assert fingerprint({"tags": {1, "1"}}) != fingerprint({"tags": {1}})  # mixed types are fine


@given(st.sets(st.integers() | st.text(max_size=4), max_size=6), st.randoms(use_true_random=False))
def test_sets_property(values: set[object], rnd: random.Random) -> None:
    items = list(values)
    rnd.shuffle(items)
    assert fingerprint(set(items)) == fingerprint(frozenset(values))


def test_dataclasses_are_their_fields() -> None:
    assert fingerprint(Line("A", 2)) == fingerprint({"sku": "A", "qty": 2})
    assert fingerprint([Line("A", 2)]) == fingerprint([{"qty": 2, "sku": "A"}])
    assert fingerprint(Line("A", 2)) != fingerprint(Line("A", 3))


def test_pydantic_like_models_use_model_dump() -> None:
    class Model:
        def model_dump(self, *, mode: str) -> dict[str, object]:
            assert mode == "json"
            return {"id": 1}

    assert fingerprint(Model()) == fingerprint({"id": 1})


def test_dataclass_class_itself_is_not_fingerprintable() -> None:
    with pytest.raises(UnfingerprintablePayload):
        fingerprint(Line)


def _circular() -> list[object]:
    loop: list[object] = []
    loop.append(loop)
    return loop


@pytest.mark.parametrize(
    "value",
    [
        object(),
        {"a": object()},
        {(1, 2): "tuple keys"},
        _circular(),
        {"f": lambda: None},
        {"c": 1 + 2j},
    ],
)
def test_unfingerprintable_values_raise_with_the_fix(value: object) -> None:
    with pytest.raises(UnfingerprintablePayload, match=r"Fingerprint\.fields"):
        fingerprint(value)


@given(json_values)
def test_canonical_json_round_trips(value: Any) -> None:
    text = canonical_json(value)
    assert canonical_json(json.loads(text)) == text
    assert text == json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


# ------------------------------------------------------------------ known gaps (see the report)


def test_lone_surrogates_have_one_stable_fingerprint() -> None:
    # b'{"a": "\\ud800"}' is valid JSON: json.loads gives back a str with a lone surrogate.
    # Such a payload keeps one fingerprint however it arrives, so it is not refused.
    as_bytes = fingerprint(b'{"a": "\\ud800"}')
    assert as_bytes == fingerprint({"a": "\ud800"}) == fingerprint('{"a":"\\ud800"}')
    assert as_bytes != fingerprint({"a": "\ud801"})


@pytest.mark.parametrize("text", ['\n{"a": 1}', ' {"a": 1}', "\r\n[1, 2]", '\ufeff{"a": 1}'])
def test_json_text_with_leading_white_space_is_canonical(text: str) -> None:
    assert fingerprint(text) == fingerprint(json.loads(text.lstrip("\ufeff")))
    raw = text.encode("utf-8")
    assert fingerprint(raw) == fingerprint(json.loads(text.lstrip("\ufeff")))

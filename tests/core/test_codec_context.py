"""Result codecs (R1: a duplicate gets the first result back) and the downstream idempotency
key a handler passes on (R17)."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

import oncely
from oncely._core.codec import JSONCodec, RawCodec
from oncely._core.context import Current, current

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=4)
    ),
    max_leaves=20,
)


@given(json_values)
def test_r1_json_codec_round_trips(value: Any) -> None:
    codec = JSONCodec()
    data = codec.encode(value)
    assert isinstance(data, bytes)
    assert codec.decode(data) == value
    assert codec.encode(codec.decode(data)) == data


def _loaded(load: Any, data: Any) -> tuple[str, object]:
    try:
        return "value", load(data)
    except Exception as exc:  # the error is part of what must match
        return type(exc).__name__, str(exc)


@given(
    st.one_of(
        st.binary(max_size=12).map(lambda tail: b"{" + tail),
        st.binary(max_size=12),
        json_values.map(lambda v: json.dumps(v, ensure_ascii=False).encode("utf-8")),
        st.text(max_size=8).map(lambda t: b'{"k": "' + t.encode("utf-8", "surrogatepass") + b'"}'),
    )
)
def test_json_codec_decodes_as_json_loads(data: bytes) -> None:
    """The codec's shortcut for objects (no encoding guess) gives what ``json.loads`` gives:
    the same value, or the same error."""
    assert _loaded(JSONCodec().decode, data) == _loaded(json.loads, data)
    for other in (bytearray(data), data.decode("latin-1")):
        assert _loaded(JSONCodec().decode, other) == _loaded(json.loads, other)


def test_r1_json_codec_stores_json_forms() -> None:
    codec = JSONCodec()
    at = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
    got = codec.decode(codec.encode({"at": at, "amount": Decimal("9.99"), "t": (1, 2)}))
    assert got == {"at": at.isoformat(), "amount": "9.99", "t": [1, 2]}


def test_json_codec_is_canonical_utf8() -> None:
    data = JSONCodec().encode({"b": 1, "a": "è"})
    assert data == '{"a":"è","b":1}'.encode()
    assert json.loads(data) == {"a": "è", "b": 1}


@pytest.mark.parametrize("value", [b"", b"\x00\xff", bytearray(b"ab"), memoryview(b"cd")])
def test_raw_codec_round_trips_bytes(value: bytes | bytearray | memoryview) -> None:
    codec = RawCodec()
    data = codec.encode(value)
    assert type(data) is bytes
    assert data == bytes(value)
    assert codec.decode(data) == bytes(value)


@pytest.mark.parametrize("value", ["text", 1, None, [b"a"], {"a": b"b"}])
def test_raw_codec_refuses_non_bytes(value: object) -> None:
    with pytest.raises(TypeError, match="RawCodec stores bytes"):
        RawCodec().encode(value)


# ------------------------------------------------------------------ Current.downstream_key


def _current(**kw: Any) -> Current:
    base: dict[str, Any] = {
        "consumer": "billing",
        "key": "order-1",
        "attempt": 1,
        "correlation_id": "corr-1",
        "mode": "two_phase",
    }
    return Current(**{**base, **kw})


def test_r17_downstream_key_is_stable_across_attempts_and_redeliveries() -> None:
    first = _current().downstream_key("charge")
    again = _current(attempt=3, correlation_id="corr-9", mode="transactional")
    assert again.downstream_key("charge") == first
    assert _current().downstream_key("charge") == first


def test_r17_downstream_key_is_distinct_per_step_key_and_consumer() -> None:
    keys = {
        _current().downstream_key(),
        _current().downstream_key("charge"),
        _current().downstream_key("email"),
        _current(key="order-2").downstream_key("charge"),
        _current(consumer="shipping").downstream_key("charge"),
    }
    assert len(keys) == 5


def test_r17_downstream_key_fields_do_not_run_together() -> None:
    # ("a", "bc") and ("ab", "c") must not give the same key.
    assert (
        _current(consumer="a", key="bc").downstream_key()
        != _current(consumer="ab", key="c").downstream_key()
    )
    assert _current(key="k").downstream_key("s1") != _current(key="ks").downstream_key("1")


@given(st.text(min_size=1), st.text(min_size=1), st.text(), st.text())
def test_r17_downstream_key_property(key: str, other_key: str, step: str, other_step: str) -> None:
    a = _current(key=key).downstream_key(step)
    assert a == _current(key=key, attempt=7).downstream_key(step)
    assert len(a) == 32
    int(a, 16)
    if (key, step) != (other_key, other_step):
        assert a != _current(key=other_key).downstream_key(other_step)


def test_r17_a_separator_inside_a_field_cannot_make_two_messages_share_a_key() -> None:
    """A producer's key may hold any character but NUL, the separator ``\\x1f`` too: the key
    ``k\\x1fx`` with step ``y`` and the key ``k`` with step ``x\\x1fy`` (or consumers and keys
    split the same way) are different calls, so the downstream service must not take one for
    the other and drop it."""
    pairs = [
        (("c", "k\x1fx", "y"), ("c", "k", "x\x1fy")),
        (("c", "k\x1fx", ""), ("c", "k", "x\x1f")),
        (("a\x1fb", "c", ""), ("a", "b\x1fc", "")),
        (("c", "k\x1e", "\x1fy"), ("c", "k", "\x1e\x1fy")),
    ]
    for (c1, k1, s1), (c2, k2, s2) in pairs:
        assert _current(consumer=c1, key=k1).downstream_key(s1) != _current(
            consumer=c2, key=k2
        ).downstream_key(s2)


def test_r17_downstream_keys_of_plain_fields_are_those_earlier_oncelys_sent() -> None:
    """A message redelivered across an upgrade sends the key its first attempt sent."""
    assert _current().downstream_key("charge") == "6988df74379570a4a4224977e3690350"
    assert _current().downstream_key() == "157e4d7824de31cc8f24aef1684ed310"


def test_current_is_none_outside_a_handler() -> None:
    assert current() is None


def test_r17_a_reconciler_sees_the_key_the_lapsed_attempt_sent_downstream() -> None:
    from oncely import Record, StaleClaim, Status
    from oncely._core.context import Current

    record = Record("billing", "order-1", Status.IN_PROGRESS, None, "t", 1, 0, 0, 0, 1)
    sent = Current("billing", "order-1", 1, None, "two_phase").downstream_key("charge")
    assert StaleClaim(record, {"a": 1}).downstream_key("charge") == sent
    assert StaleClaim(record, None).downstream_key("email") != sent


def test_r17_handling_is_the_running_handlers_message_and_refuses_outside_one() -> None:
    """``oncely.handling()`` types as ``Current`` (the README's tour type-checks with
    ``mypy --strict``), and outside a handler raises instead of answering ``None``."""
    inbox = oncely.Inbox(oncely.open("memory://"), consumer="billing")
    seen: list[str] = []

    def handler(payload: object) -> str:
        key = oncely.handling().downstream_key("charge")
        current = oncely.current()
        assert current is not None and current.downstream_key("charge") == key
        seen.append(key)
        return key

    assert inbox.handle("order-1", {}, handler).value == seen[0]
    assert seen[0] == _current(key="order-1").downstream_key("charge")
    with pytest.raises(LookupError, match="outside a handler"):
        oncely.handling()
    assert oncely.current() is None

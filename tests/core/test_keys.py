"""Dedup keys: validation and the key sources (R2-R5)."""

from __future__ import annotations

import hashlib

import pytest

from oncely._core.keys import (
    TRANSPORT_FIELDS,
    BusinessKey,
    CloudEventsKey,
    Envelope,
    FirstOf,
    HeaderKey,
    MessageIdKey,
    validate_consumer,
    validate_key,
)
from oncely._core.policy import Limits
from oncely.errors import (
    ConfigurationError,
    InvalidIdentifier,
    InvalidKey,
    KeyTooLong,
    MissingKey,
)

# ------------------------------------------------------------------ validate_key


def test_validate_key_returns_a_good_key_unchanged() -> None:
    assert validate_key("order-1", Limits()) == "order-1"
    assert validate_key("ordine-è-1", Limits()) == "ordine-è-1"


@pytest.mark.parametrize("key", [None, ""])
def test_r2_missing_key(key: object) -> None:
    with pytest.raises(MissingKey):
        validate_key(key, Limits())


@pytest.mark.parametrize("key", [42, 4.2, b"order-1", ["order-1"], True])
def test_r2_non_string_key_is_invalid_and_says_how_to_convert(key: object) -> None:
    with pytest.raises(InvalidKey, match=r"str\(order_id\)") as info:
        validate_key(key, Limits())
    assert not isinstance(info.value, MissingKey)


def test_str_subclass_is_not_a_key() -> None:
    class Sneaky(str):
        pass

    with pytest.raises(InvalidKey):
        validate_key(Sneaky("order-1"), Limits())


def test_nul_in_key_is_invalid() -> None:
    with pytest.raises(InvalidKey, match="NUL"):
        validate_key("order\x001", Limits())


def test_key_length_is_counted_in_utf8_bytes() -> None:
    limits = Limits(max_key_bytes=16)
    assert validate_key("a" * 16, limits) == "a" * 16
    with pytest.raises(KeyTooLong, match="17 bytes, over the limit of 16"):
        validate_key("a" * 17, limits)
    # 8 characters, 16 bytes: at the limit.
    assert validate_key("é" * 8, limits) == "é" * 8
    # 9 characters, 18 bytes: over, although far fewer than 16 characters.
    with pytest.raises(KeyTooLong, match="18 bytes"):
        validate_key("é" * 9, limits)
    # 4-byte characters.
    with pytest.raises(KeyTooLong, match="20 bytes"):
        validate_key("🙂" * 5, limits)


def test_key_too_long_message_names_the_fix() -> None:
    with pytest.raises(KeyTooLong, match="hash_long_keys=True"):
        validate_key("x" * 600, Limits())


def test_hash_long_keys_gives_a_stable_sha256_key() -> None:
    limits = Limits(max_key_bytes=16, hash_long_keys=True)
    long_key = "ordine-" + "è" * 20
    hashed = validate_key(long_key, limits)
    assert hashed == "sha256:" + hashlib.sha256(long_key.encode("utf-8")).hexdigest()
    assert validate_key(long_key, limits) == hashed  # stable across calls
    assert validate_key(long_key + "x", limits) != hashed
    # Short keys are left alone.
    assert validate_key("short", limits) == "short"


# ------------------------------------------------------------------ validate_consumer


def test_r5_consumer_names() -> None:
    assert validate_consumer("billing") == "billing"
    assert validate_consumer("x" * 200) == "x" * 200


@pytest.mark.parametrize(
    "consumer", [None, 42, b"billing", "", " billing", "billing ", "\tbilling", "x" * 201, "a\x00b"]
)
def test_r5_bad_consumer_names(consumer: object) -> None:
    with pytest.raises(InvalidIdentifier):
        validate_consumer(consumer)


def test_r5_empty_consumer_message_explains_the_scope() -> None:
    with pytest.raises(InvalidIdentifier, match="R5"):
        validate_consumer("")


# ------------------------------------------------------------------ MessageIdKey


def test_r2_message_id_key() -> None:
    assert MessageIdKey()(Envelope(body=b"", message_id="order-7")) == "order-7"


@pytest.mark.parametrize("message_id", [None, ""])
def test_r2_message_id_key_missing(message_id: str | None) -> None:
    with pytest.raises(MissingKey, match="producer-assigned"):
        MessageIdKey()(Envelope(body=b"", message_id=message_id))


def test_r4_message_id_key_never_reads_transport_data() -> None:
    env = Envelope(
        body=b"",
        headers={"delivery_tag": "7"},
        transport={"delivery_tag": 7, "message_id": "tag-7", "redelivered": True},
        delivery_count=3,
    )
    with pytest.raises(MissingKey):
        MessageIdKey()(env)


# ------------------------------------------------------------------ CloudEventsKey


@pytest.mark.parametrize(
    ("source_name", "id_name"),
    [
        ("ce-source", "ce-id"),
        ("ce_source", "ce_id"),
        ("cloudEvents:source", "cloudEvents:id"),
        ("CE-Source", "CE-Id"),  # header names are case-insensitive
        ("cloudevents:source", "CLOUDEVENTS:ID"),
        ("ce_source", "ce-id"),  # spellings may mix
    ],
)
def test_r3_cloudevents_binary_mode(source_name: str, id_name: str) -> None:
    env = Envelope(body=b"{}", headers={source_name: "/orders/eu", id_name: "A-1"})
    assert CloudEventsKey()(env) == "/orders/eu A-1"


def test_r3_cloudevents_structured_mode() -> None:
    body = {"specversion": "1.0", "source": "https://shop.example/orders", "id": "42", "type": "t"}
    assert CloudEventsKey()(Envelope(body=body)) == "https://shop.example/orders 42"


def test_r3_structured_body_needs_specversion() -> None:
    with pytest.raises(MissingKey):
        CloudEventsKey()(Envelope(body={"source": "/s", "id": "1"}))


def test_r3_binary_headers_win_over_the_body() -> None:
    body = {"specversion": "1.0", "source": "/body", "id": "b"}
    env = Envelope(body=body, headers={"ce-source": "/hdr", "ce-id": "h"})
    assert CloudEventsKey()(env) == "/hdr h"


def test_r3_same_event_same_key_in_both_modes() -> None:
    binary = Envelope(body=b"data", headers={"ce_source": "/s", "ce_id": "1"})
    structured = Envelope(body={"specversion": "1.0", "source": "/s", "id": "1"})
    assert CloudEventsKey()(binary) == CloudEventsKey()(structured)


@pytest.mark.parametrize(("source", "event_id"), [("/a", "b c"), ("/a", "1"), ("urn:x", " 1 ")])
def test_r3_the_pair_is_recovered_from_the_key(source: str, event_id: str) -> None:
    key = CloudEventsKey()(Envelope(body=None, headers={"ce-source": source, "ce-id": event_id}))
    assert key == f"{source} {event_id}"
    # A source has no white space, so splitting at the first space gives the pair back: two
    # different pairs can never share a key.
    assert key.split(" ", 1) == [source, event_id]


@pytest.mark.parametrize("source", ["/orders eu", "/orders\teu", "/orders\neu", " /orders"])
def test_r3_white_space_in_source_is_rejected(source: str) -> None:
    with pytest.raises(InvalidKey, match="URI reference"):
        CloudEventsKey()(Envelope(body=None, headers={"ce-source": source, "ce-id": "1"}))


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"ce-source": "/s"},
        {"ce-id": "1"},
        {"ce-source": "", "ce-id": "1"},
        {"ce-source": "/s", "ce-id": ""},
        {"ce-source": "/s", "ce-id": 1},  # not a string
    ],
)
def test_r3_missing_source_or_id(headers: dict[str, object]) -> None:
    with pytest.raises(MissingKey):
        CloudEventsKey()(Envelope(body=b"", headers=headers))


# ------------------------------------------------------------------ HeaderKey


def test_header_key_reads_a_producer_header() -> None:
    source = HeaderKey("Idempotency-Key")
    assert source(Envelope(body=None, headers={"Idempotency-Key": "pay-1"})) == "pay-1"
    assert source(Envelope(body=None, headers={"idempotency-key": "pay-2"})) == "pay-2"
    assert source(Envelope(body=None, headers={"Idempotency-Key": b"pay-3"})) == "pay-3"
    assert source(Envelope(body=None, headers={"Idempotency-Key": 77})) == "77"


@pytest.mark.parametrize("headers", [{}, {"Idempotency-Key": ""}, {"Idempotency-Key": None}])
def test_header_key_missing(headers: dict[str, object]) -> None:
    with pytest.raises(MissingKey, match="Idempotency-Key"):
        HeaderKey("Idempotency-Key")(Envelope(body=None, headers=headers))


@pytest.mark.parametrize("name", sorted(TRANSPORT_FIELDS))
def test_r4_header_key_refuses_transport_fields(name: str) -> None:
    with pytest.raises(ConfigurationError) as info:
        HeaderKey(name)
    text = str(info.value)
    assert "R4" in text
    assert "redelivery" in text
    assert repr(name) in text


@pytest.mark.parametrize("name", ["Delivery-Tag", "X-Delivery-Count", "LockToken", "Timestamp"])
def test_r4_transport_field_names_are_refused_in_any_case(name: str) -> None:
    with pytest.raises(ConfigurationError, match="R4"):
        HeaderKey(name)


def test_r4_transport_fields_cover_the_usual_brokers() -> None:
    # AMQP delivery tag, Service Bus lock token and sequence number, Redis stream entry id,
    # NATS sequence, SQS receipt handle, and the receive time.
    for name in (
        "delivery_tag",
        "lock_token",
        "sequence_number",
        "entry_id",
        "nats-sequence",
        "receipt_handle",
        "received_at",
        "x-delivery-count",
    ):
        assert name in TRANSPORT_FIELDS


# ------------------------------------------------------------------ BusinessKey


@pytest.mark.parametrize(("value", "key"), [("A-1", "A-1"), (42, "42"), (0, "0"), (-3, "-3")])
def test_r2_business_key_accepts_strings_and_integers(value: object, key: str) -> None:
    source = BusinessKey(lambda body: body["order_id"])  # type: ignore[index]
    assert source(Envelope(body={"order_id": value})) == key


@pytest.mark.parametrize("value", [True, False, 4.0, 4.5, b"A-1", ["A"], {"a": 1}])
def test_r2_business_key_rejects_other_types(value: object) -> None:
    source = BusinessKey(lambda body: body["order_id"])  # type: ignore[index]
    with pytest.raises(InvalidKey, match="string or an integer") as info:
        source(Envelope(body={"order_id": value}))
    assert not isinstance(info.value, MissingKey)


@pytest.mark.parametrize("body", [{"order_id": None}, {"order_id": ""}, {}, [], None, "text"])
def test_r2_business_key_missing(body: object) -> None:
    source = BusinessKey(lambda body: body["order_id"])  # type: ignore[index]
    with pytest.raises(MissingKey):
        source(Envelope(body=body))


def test_business_key_does_not_hide_bugs_in_the_reader() -> None:
    def broken(_body: object) -> object:
        raise ZeroDivisionError

    with pytest.raises(ZeroDivisionError):
        BusinessKey(broken)(Envelope(body={}))


# ------------------------------------------------------------------ FirstOf


def test_first_of_takes_the_first_source_that_finds_a_key() -> None:
    source = FirstOf(CloudEventsKey(), MessageIdKey())
    ce = Envelope(body=None, message_id="m-1", headers={"ce-source": "/s", "ce-id": "1"})
    assert source(ce) == "/s 1"
    assert source(Envelope(body=None, message_id="m-1")) == "m-1"


def test_first_of_reports_every_reason_when_none_finds_a_key() -> None:
    source = FirstOf(CloudEventsKey(), MessageIdKey(), HeaderKey("Idempotency-Key"))
    with pytest.raises(MissingKey, match="no key source found a key") as info:
        source(Envelope(body=None))
    text = str(info.value)
    assert "CloudEvents" in text
    assert "message id" in text
    assert "Idempotency-Key" in text


def test_first_of_does_not_fall_through_an_invalid_key() -> None:
    # A key that is present but malformed is an error to fix, not a reason to try the next
    # source (which could silently dedup on something else).
    source = FirstOf(CloudEventsKey(), MessageIdKey())
    env = Envelope(body=None, message_id="m-1", headers={"ce-source": "/a b", "ce-id": "1"})
    with pytest.raises(InvalidKey, match="URI reference"):
        source(env)


def test_first_of_needs_a_source() -> None:
    with pytest.raises(ConfigurationError):
        FirstOf()


def test_lone_surrogate_in_key_is_invalid() -> None:
    # A key read from a JSON body (BusinessKey) can hold one: json.loads('"\\ud800"').
    with pytest.raises(InvalidKey):
        validate_key("order-\ud800", Limits())


def test_cloudevents_headers_may_arrive_as_bytes() -> None:
    env = Envelope(body=b"", headers={"ce_source": b"/s", "ce_id": b"1"})
    assert CloudEventsKey()(env) == "/s 1"

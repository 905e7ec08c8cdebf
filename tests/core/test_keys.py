"""Dedup keys: validation and the key sources (R2-R5)."""

from __future__ import annotations

import hashlib
import warnings

import pytest
from hypothesis import given
from hypothesis import strategies as st

from oncely._core import keys
from oncely._core.keys import (
    TRANSPORT_FIELDS,
    BusinessKey,
    CloudEventsKey,
    Envelope,
    FirstOf,
    HeaderKey,
    KeySource,
    MessageIdKey,
    key_source,
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
from oncely.wire import wire_text

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


def test_r2_an_id_the_client_made_up_is_missing_with_the_transports_reason() -> None:
    """A transport that found only an id its client library made up (aio-pika's
    ``uuid4().hex``) gives no ``message_id`` and says why: the key source refuses with that
    reason, and a ``FirstOf`` passes on to its next source (a header the message carries)."""
    env = Envelope(body=b"", headers={"x-order": "o-1"}, message_id_refusal="made up by the client")
    with pytest.raises(MissingKey, match="made up by the client"):
        MessageIdKey()(env)
    assert FirstOf(MessageIdKey(), HeaderKey("x-order"))(env) == "o-1"
    with pytest.raises(MissingKey, match=r"'x-other' header.*made up by the client"):
        FirstOf(HeaderKey("x-other"), MessageIdKey())(env)


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
    assert "as a dedup key it would" in text  # says why (offsets: per send, not per delivery)
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


_EVENT_HEADERS = {"ce-id": "e1", "ce-source": "/shop", "ce-specversion": "1.0", "ce-type": "t"}


@pytest.mark.parametrize(
    "source",
    [
        FirstOf(CloudEventsKey(), MessageIdKey()),
        key_source("cloudevents,message-id"),
        FirstOf(FirstOf(CloudEventsKey(), HeaderKey("Idempotency-Key")), MessageIdKey()),
        FirstOf(CloudEventsKey(), FirstOf(HeaderKey("Idempotency-Key"), MessageIdKey())),
    ],
    ids=["first-of", "spec", "nested-event-side", "nested-other-side"],
)
def test_r2_r3_first_of_never_merges_an_event_and_a_spaced_message_id(source: KeySource) -> None:
    """R2/R3: an event (source "/shop", id "e1") is keyed "/shop e1"; a plain message whose id
    is "/shop e1" must not get that key too, or one of the two is skipped as a duplicate."""
    event = Envelope(body=b"{}", message_id="m-1", headers=_EVENT_HEADERS)
    plain = Envelope(body=b"{}", message_id="/shop e1")
    assert source(event) == "/shop e1"
    with pytest.raises(InvalidKey, match="CloudEvents key") as info:
        source(plain)
    assert not isinstance(info.value, MissingKey)
    assert "two messages would share it" in str(info.value)
    # Keys without a space are unchanged, so stored keys of existing users stay valid.
    assert source(Envelope(body=b"{}", message_id="/shop:e1")) == "/shop:e1"


def test_r2_first_of_without_cloudevents_keeps_spaced_keys() -> None:
    # Only a CloudEvents key has the "<source> <id>" shape; without one nothing can collide.
    source = FirstOf(HeaderKey("Idempotency-Key"), MessageIdKey())
    assert source(Envelope(body=None, message_id="order 7")) == "order 7"


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


# ------------------------------------------------------------------ lossless keys (R2, R4)

# Ids that are not UTF-8: two that differ in one byte, and two Latin-1 names. Adapters decode
# wire bytes with wire_text (surrogateescape), so each reaches the key sources as text holding
# escape code points; errors="replace" would have made each pair one key.
UNDECODABLE = [b"inv-\xff", b"inv-\xfe", "Müller-7".encode("latin-1"), "Möller-7".encode("latin-1")]
UNDECODABLE_PAIRS = [
    (b"inv-\xff", b"inv-\xfe"),
    ("Müller-7".encode("latin-1"), "Möller-7".encode("latin-1")),
]


def _order_id(body: object) -> object:
    return body["order_id"]  # type: ignore[index]


def _carriers(raw: bytes) -> list[tuple[str, str, KeySource, Envelope]]:
    """``raw`` as the key of every key source: (case, field named in the reason, source,
    envelope). Headers come both as wire text and as raw bytes (Kafka-style)."""
    text = wire_text(raw)
    idem = "'Idempotency-Key' header"

    def headers(**values: object) -> Envelope:
        return Envelope(body=None, headers={k.replace("__", "-"): v for k, v in values.items()})

    def idem_header(value: object) -> Envelope:
        return Envelope(body=None, headers={"Idempotency-Key": value})

    event = {"specversion": "1.0", "source": "/s", "id": text}
    ce_id, ce_source = "CloudEvents id", "CloudEvents source"
    return [
        ("message-id", "message id", MessageIdKey(), Envelope(body=None, message_id=text)),
        ("header-text", idem, HeaderKey("Idempotency-Key"), idem_header(text)),
        ("header-bytes", idem, HeaderKey("Idempotency-Key"), idem_header(raw)),
        ("header-spec", idem, key_source("header:Idempotency-Key"), idem_header(raw)),
        ("ce-id-text", ce_id, CloudEventsKey(), headers(ce__source="/s", ce__id=text)),
        ("ce-id-bytes", ce_id, CloudEventsKey(), headers(ce_source=b"/s", ce_id=raw)),
        ("ce-source", ce_source, CloudEventsKey(), headers(ce_source=raw, ce_id=b"1")),
        ("ce-structured", ce_id, CloudEventsKey(), Envelope(body=event)),
        ("business", "business key", BusinessKey(_order_id), Envelope(body={"order_id": text})),
        (
            "body-spec",
            "business key",
            key_source("body:order_id"),
            Envelope(body={"order_id": text}),
        ),
    ]


CASES = [case for case, *_ in _carriers(b"x")]


@pytest.mark.parametrize("raw", UNDECODABLE)
@pytest.mark.parametrize("case", CASES)
def test_r2_r4_every_key_source_refuses_an_id_that_is_not_utf8(case: str, raw: bytes) -> None:
    """R2/R4: a key that is not UTF-8 is refused (InvalidKey, not MissingKey: FirstOf must
    not fall through to another source), and the reason names the field and its bytes."""
    _, field, source, envelope = next(c for c in _carriers(raw) if c[0] == case)
    with pytest.raises(InvalidKey) as info:
        source(envelope)
    assert not isinstance(info.value, MissingKey)
    text = str(info.value)
    assert text.startswith(f"the {field}")
    assert f"is not UTF-8 text ({raw!r})" in text
    assert "have the producer send UTF-8" in text


@pytest.mark.parametrize(("first", "second"), UNDECODABLE_PAIRS)
@pytest.mark.parametrize("case", CASES)
def test_r2_two_undecodable_ids_never_become_one_key(
    case: str, first: bytes, second: bytes
) -> None:
    """R2: b"inv-\\xff" and b"inv-\\xfe" were both "inv-\\ufffd" with errors="replace"; now
    each is refused with its own reason."""
    reasons = []
    for raw in (first, second):
        _, _, source, envelope = next(c for c in _carriers(raw) if c[0] == case)
        with pytest.raises(InvalidKey) as info:
            source(envelope)
        reasons.append(str(info.value))
    assert reasons[0] != reasons[1]


@pytest.mark.parametrize("case", CASES)
def test_r2_valid_non_ascii_utf8_ids_still_work(case: str) -> None:
    raw = "Müller-7".encode()
    _, _, source, envelope = next(c for c in _carriers(raw) if c[0] == case)
    expected = {"ce-id-text": "/s Müller-7", "ce-id-bytes": "/s Müller-7"}
    expected |= {"ce-structured": "/s Müller-7", "ce-source": "Müller-7 1"}
    assert source(envelope) == expected.get(case, "Müller-7")


def test_r2_header_bytes_are_not_replaced() -> None:
    # The bug report: a Kafka-style bytes header went through errors="replace".
    source = HeaderKey("Idempotency-Key")
    for raw in (b"inv-\xff", b"inv-\xfe"):
        with pytest.raises(InvalidKey, match=r"not UTF-8 text \(b'inv-\\x"):
            source(Envelope(body=None, headers={"Idempotency-Key": raw}))


def test_r2_first_of_stops_at_an_undecodable_key() -> None:
    source = FirstOf(HeaderKey("Idempotency-Key"), MessageIdKey())
    env = Envelope(body=None, message_id="m-1", headers={"Idempotency-Key": b"inv-\xff"})
    with pytest.raises(InvalidKey, match="'Idempotency-Key' header is not UTF-8"):
        source(env)


def test_r2_validate_key_names_the_undecodable_bytes() -> None:
    with pytest.raises(InvalidKey, match=r"dedup key is not UTF-8 text \(b'inv-\\xff'\)"):
        validate_key(wire_text(b"inv-\xff"), Limits())
    # A lone surrogate read from a JSON body is refused the same way.
    with pytest.raises(InvalidKey, match="dedup key is not UTF-8 text"):
        validate_key("order-\ud800", Limits())
    # Even when the key is long enough to be hashed.
    limits = Limits(max_key_bytes=16, hash_long_keys=True)
    with pytest.raises(InvalidKey, match="not UTF-8 text"):
        validate_key(wire_text(b"x" * 40 + b"\xff"), limits)


@given(st.binary(max_size=12), st.binary(max_size=12))
def test_r2_distinct_wire_ids_never_share_a_key(first: bytes, second: bytes) -> None:
    """R2 (property): two different byte strings, decoded the adapters' way, give two
    different keys or are refused; never one key."""
    results = []
    for raw in (first, second):
        try:
            results.append(MessageIdKey()(Envelope(body=None, message_id=wire_text(raw))))
        except InvalidKey:  # MissingKey for b"", InvalidKey for bytes that are not UTF-8
            results.append(None)
    if first != second and results[0] is not None and results[1] is not None:
        assert results[0] != results[1]
    for raw, result in zip((first, second), results, strict=True):
        if result is not None:
            assert result.encode("utf-8") == raw


# ------------------------------------------------------------------ KeyTooLong advice


def test_key_too_long_message_names_the_command_line_flag() -> None:
    with pytest.raises(KeyTooLong) as info:
        validate_key("x" * 600, Limits())
    text = str(info.value)
    assert "Limits(hash_long_keys=True) (oncely consume --hash-long-keys)" in text
    assert "use a shorter key" in text


# ------------------------------------------------------------------ R4: transport fields

# Per-delivery (or per-send) fields real brokers and their client libraries set.
BROKER_TRANSPORT_FIELDS = [
    # RabbitMQ
    "x-death",
    "x-first-death-queue",
    "x-first-death-reason",
    "x-first-death-exchange",
    "x-delivery-count",
    # Azure Service Bus
    "x-opt-sequence-number",
    "x-opt-locked-until",
    "x-opt-enqueued-time",
    "x-opt-lock-token",
    "DeliveryCount",
    "SequenceNumber",
    "LockToken",
    "EnqueuedTimeUtc",
    "LockedUntilUtc",
    # JMS
    "JMSXDeliveryCount",
    "JMSRedelivered",
    "JMSTimestamp",
    # Kafka
    "partition",
    "offset",
    "kafka_offset",
    "kafka_partition",
    "timestamp",
    # SQS
    "ApproximateReceiveCount",
    "ApproximateFirstReceiveTimestamp",
    "SentTimestamp",
    "ReceiptHandle",
    # NATS
    "Nats-Sequence",
    "Nats-Time-Stamp",
    "Nats-Num-Delivered",
    # Redis stream entry ids
    "entry_id",
    "stream_id",
]


def _spellings(name: str) -> set[str]:
    return {
        name,
        name.lower(),
        name.upper(),
        name.replace("-", "_"),
        name.replace("_", "-"),
        name.title(),
    }


@pytest.mark.parametrize("name", BROKER_TRANSPORT_FIELDS)
def test_r4_header_key_refuses_the_per_delivery_fields_of_real_brokers(name: str) -> None:
    for spelling in _spellings(name):
        with pytest.raises(ConfigurationError) as info:
            HeaderKey(spelling)
        text = str(info.value)
        assert "(R4)" in text
        assert repr(spelling) in text
        assert "as a dedup key it would" in text


@pytest.mark.parametrize("name", BROKER_TRANSPORT_FIELDS)
def test_r4_key_source_refuses_them_bare_and_as_headers(name: str) -> None:
    for spec in (name, f"header:{name}", f"message-id,header:{name}"):
        with pytest.raises(ConfigurationError, match="R4"):
            key_source(spec)


@pytest.mark.parametrize(
    "name",
    [
        "X-Opt-Sequence-Number",
        "x_opt_sequence_number",
        "X_OPT_SEQUENCE_NUMBER",
        "x-opt_sequence-number",  # mixed separators
        "x-first-death_queue",
        "nats_sequence",
        "Nats_Time_Stamp",
        "KAFKA-OFFSET",
        "approximate_receive_count",
        "receipt-handle",
        "jmsx_delivery_count",
    ],
)
def test_r4_dash_and_underscore_are_alike(name: str) -> None:
    with pytest.raises(ConfigurationError, match="R4"):
        HeaderKey(name)
    assert keys.is_transport_field(name)


@pytest.mark.parametrize(
    "name", ["x-opt-sequence-number", "x_opt_sequence_number", "nats-time-stamp", "x_death"]
)
def test_r4_transport_fields_hold_every_plain_spelling(name: str) -> None:
    # Callers that only lower-case (the Redis stream layout) find both separators.
    assert name in TRANSPORT_FIELDS
    assert name.upper().lower() in TRANSPORT_FIELDS


def test_r4_redis_stream_fields_refuse_the_new_transport_names() -> None:
    from oncely.brokers.redis_streams._layout import EntryLayout

    for name in ("x_opt_sequence_number", "Nats-Time-Stamp", "kafka_offset", "x-death"):
        with pytest.raises(ConfigurationError, match="R4"):
            EntryLayout("body", name)
        with pytest.raises(ConfigurationError, match="R4"):
            EntryLayout(name, "message_id")


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("x-death", "dead-letter"),
        ("x-opt-enqueued-time", "time"),
        ("kafka_offset", "retry"),
        ("JMSRedelivered", "each delivery"),
        ("partition", "where the broker put the message"),
    ],
)
def test_r4_each_refusal_says_why(name: str, why: str) -> None:
    with pytest.raises(ConfigurationError) as info:
        HeaderKey(name)
    text = str(info.value)
    assert why in text
    assert "use the producer's message id" in text


@pytest.mark.parametrize(
    "name",
    [
        "Nats-Msg-Id",
        "message-id",
        "Idempotency-Key",
        "sequence",  # a producer's version counter (R15)
        "x-request-id",
        "ce-id",
        "MessageDeduplicationId",
        "order-id",
        "tenant",
    ],
)
def test_r4_producer_set_headers_are_not_refused(name: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        source = HeaderKey(name)
    assert source(Envelope(body=None, headers={name: "v-1"})) == "v-1"
    assert not keys.is_transport_field(name)


# ------------------------------------------------------------------ R2: correlation ids warn

CORRELATION_HEADERS = [
    "correlation-id",
    "correlation_id",
    "x-correlation-id",
    "X-Correlation-ID",
    "correlationId",
    "JMSCorrelationID",
    "traceparent",
]


def test_r2_key_warning_is_a_user_warning() -> None:
    assert issubclass(keys.KeyWarning, UserWarning)
    assert "KeyWarning" in keys.__all__


@pytest.mark.parametrize("name", CORRELATION_HEADERS)
def test_r2_correlation_id_header_warns_but_works(name: str) -> None:
    with pytest.warns(keys.KeyWarning) as record:
        source = HeaderKey(name)
    [warning] = record
    text = str(warning.message)
    assert "R2" in text
    assert repr(name) in text
    assert "several messages" in text
    assert warning.filename == __file__  # points at the code that chose the key
    # Not refused: a user may know their correlation ids are unique per message.
    assert source(Envelope(body=None, headers={name: "c-1"})) == "c-1"


@pytest.mark.parametrize(
    "spec", ["correlation-id", "header:correlation_id", "header:x-correlation-id,message-id"]
)
def test_r2_correlation_key_source_specs_warn(spec: str) -> None:
    with pytest.warns(keys.KeyWarning, match=r"correlation id.*\(R2\)") as record:
        source = key_source(spec)
    assert record[0].filename == __file__
    env = Envelope(
        body=None, message_id="m-1", correlation_id="c-1", headers={"correlation_id": "c-1"}
    )
    if spec == "header:x-correlation-id,message-id":
        assert source(env) == "m-1"
    else:
        assert source(env) == "c-1"


def test_r2_correlation_id_key_reads_the_envelope() -> None:
    with pytest.warns(keys.KeyWarning):
        source = key_source("correlation-id")
    with pytest.raises(MissingKey, match="correlation id"):
        source(Envelope(body=None, message_id="m-1"))
    with pytest.raises(InvalidKey, match="correlation id is not UTF-8"):
        source(Envelope(body=None, correlation_id=wire_text(b"c-\xff")))


@pytest.mark.parametrize(
    "spec", ["message-id", "cloudevents", "header:Idempotency-Key", "header:x-request-id"]
)
def test_r2_other_key_sources_do_not_warn(spec: str) -> None:
    # Request ids are set per request, like an idempotency key: no warning.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        key_source(spec)


# ------------------------------------------------------------------ key specs a user mistypes


@pytest.mark.parametrize(
    ("body", "said"),
    [
        ({"order_id": "A1", "amount": 5}, "no field 'orderId'; it has 'order_id', 'amount'"),
        ([{"orderId": "A1"}], "the body is a list, not a JSON object with the field 'orderId'"),
    ],
)
def test_a_body_field_not_found_names_the_fields_the_body_has(body: object, said: str) -> None:
    """``body:orderId`` on bodies whose field is ``order_id``: every message is dead-lettered.
    Before, the reason was ``KeyError('orderId')``, which left the reader to guess whether the
    body, the spec or the decoding was wrong; it now names the fields that are there."""
    with pytest.raises(MissingKey) as info:
        key_source("body:orderId")(Envelope(body=body))
    assert said in str(info.value)


def test_a_nested_body_field_not_found_names_where_the_path_stopped() -> None:
    with pytest.raises(MissingKey) as info:
        key_source("body:order.ID")(Envelope(body={"order": {"id": 7}}))
    assert "the body has no field 'order.ID': 'order' has 'id'" in str(info.value)


def test_a_body_field_not_found_lists_a_few_fields_only() -> None:
    body = {f"f{n:02}": n for n in range(30)}
    with pytest.raises(MissingKey) as info:
        key_source("body:id")(Envelope(body=body))
    assert "'f09' and 20 more" in str(info.value)
    assert "f10" not in str(info.value)


def test_a_business_key_function_that_finds_no_field_names_the_fields_the_body_has() -> None:
    """``BusinessKey(lambda o: o["orderId"])`` on bodies whose field is ``order_id``: the
    dead letter's reason names the fields there, as ``body:FIELD`` does."""
    with pytest.raises(MissingKey) as info:
        BusinessKey(lambda o: o["orderId"])(Envelope(body={"order_id": "A1", "amount": 5}))  # type: ignore[index]
    said = str(info.value)
    assert "KeyError('orderId')" in said and "the body has 'order_id', 'amount'" in said, said


@pytest.mark.parametrize("spec", ["messageId", "MessageId", "message_id"])
def test_a_message_id_spelled_otherwise_says_which_id_is_meant(spec: str) -> None:
    """A user coming from AWS Lambda Powertools (``event_key_jmespath="messageId"``) types
    ``--key messageId``. Before: "unknown key source", with no word on why SQS's own
    ``MessageId`` is not the producer's id. Now the refusal says so and names ``message-id``."""
    with pytest.raises(ConfigurationError) as info:
        key_source(spec)
    said = str(info.value)
    assert "use message-id" in said, said
    assert "SQS's own MessageId" in said and "R4" in said, said

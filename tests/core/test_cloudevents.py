"""CloudEvents: the key (source, id) in every content mode and binding (R3), and the data.

The binding specs (cloudevents/spec, cloudevents/bindings/*): HTTP and NATS put attributes in
``ce-`` headers (names case-insensitive), Kafka in ``ce_`` headers, AMQP in ``cloudEvents_`` or
``cloudEvents:`` application properties, MQTT 5 in user properties named as the attributes.
Structured mode carries the whole event in the body (``application/cloudevents+json``).
"""

from __future__ import annotations

import base64
import json
from dataclasses import replace

import pytest

from oncely._core.keys import CloudEventsKey, Envelope, FirstOf, MessageIdKey
from oncely.brokers import cloudevent_headers
from oncely.brokers._consumer import decode_body
from oncely.errors import ConfigurationError, InvalidKey, MissingKey
from oncely.wire import wire_text

STRUCTURED = "application/cloudevents+json; charset=utf-8"
EVENT = {
    "specversion": "1.0",
    "type": "com.example.order.created",
    "source": "https://shop.example/orders",
    "id": "A-42",
    "data": {"order": 42},
}
EVENT_KEY = "https://shop.example/orders A-42"


def key(envelope: Envelope) -> str:
    return CloudEventsKey()(envelope)


def binary(prefix: str, **extra: object) -> Envelope:
    headers = {
        f"{prefix}specversion": "1.0",
        f"{prefix}type": "t",
        f"{prefix}source": "/orders/eu",
        f"{prefix}id": "A-1",
    }
    return Envelope(body={"order": 1}, headers=headers | extra)


# ------------------------------------------------------------------ binary mode


@pytest.mark.parametrize(
    "prefix",
    [
        "ce-",  # HTTP, NATS
        "ce_",  # Kafka
        "cloudEvents_",  # AMQP (preferred: JMS-safe)
        "cloudEvents:",  # AMQP (the older separator)
        "CE-",
        "Ce-",
        "CE_",
        "CloudEvents_",
        "CLOUDEVENTS:",
        "cloudevents_",
    ],
)
def test_r3_every_binding_prefix(prefix: str) -> None:
    assert key(binary(prefix)) == "/orders/eu A-1"


@pytest.mark.parametrize(
    ("source_header", "id_header"),
    [("CE-Source", "Ce-Id"), ("cloudEvents_source", "CLOUDEVENTS_ID"), ("ce_SOURCE", "ce-ID")],
)
def test_r3_attribute_names_are_case_insensitive(source_header: str, id_header: str) -> None:
    env = Envelope(body=None, headers={source_header: "/s", id_header: "1"})
    assert key(env) == "/s 1"


def test_r3_kafka_headers_as_bytes() -> None:
    env = Envelope(body=b"\x00avro", headers={"ce_source": b"/orders", "ce_id": b"7"})
    assert key(env) == "/orders 7"


def test_r3_prefixes_may_mix_when_they_agree() -> None:
    env = Envelope(body=None, headers={"ce-source": "/s", "cloudEvents_id": "1"})
    assert key(env) == "/s 1"
    # A bridge that adds its own spelling of the same attributes.
    env = Envelope(
        body=None,
        headers={
            "ce_source": b"/s",
            "ce_id": b"1",
            "cloudEvents:source": "/s",
            "cloudEvents:id": "1",
        },
    )
    assert key(env) == "/s 1"


def test_r3_two_spellings_with_different_values_are_refused() -> None:
    env = Envelope(body=None, headers={"ce-source": "/s", "ce-id": "1", "ce_id": "2"})
    with pytest.raises(InvalidKey) as info:
        key(env)
    assert not isinstance(info.value, MissingKey)
    assert "'ce-id'" in str(info.value)
    assert "'ce_id'" in str(info.value)


@pytest.mark.parametrize(
    "headers",
    [
        {"ce-id": "1", "ce-source": "/s", "CE-ID": "2"},
        {"ce-id": "1", "ce-source": "/s", "Ce-Source": "/t"},
        {"ce_id": b"1", "ce_source": b"/s", "CE_ID": b"2"},
        {"cloudEvents_id": "1", "cloudEvents_source": "/s", "cloudevents_id": "2"},
        {"cloudEvents:id": "1", "cloudEvents:source": "/s", "CLOUDEVENTS:SOURCE": "/t"},
    ],
)
def test_r3_two_cases_of_a_name_with_different_values_are_refused(
    headers: dict[str, object],
) -> None:
    """R3: the names are case-insensitive, so "CE-ID" beside "ce-id" is a second spelling of
    the id; when they disagree nothing says which is the event's, even when the usual
    spellings alone would give a key."""
    with pytest.raises(InvalidKey, match="two different CloudEvents") as info:
        key(Envelope(body=None, headers=headers))
    assert not isinstance(info.value, MissingKey)


def test_r3_two_cases_of_a_name_that_agree_are_accepted() -> None:
    headers = {"ce-id": "1", "ce-source": "/s", "CE-ID": "1", "Ce-Source": b"/s", "X-Id": "9"}
    assert key(Envelope(body=None, headers=headers)) == "/s 1"


def test_r3_mqtt_user_properties_without_prefix() -> None:
    headers = {"specversion": "1.0", "type": "t", "source": "/sensors/7", "id": "r-1"}
    assert key(Envelope(body=b"21.5", headers=headers)) == "/sensors/7 r-1"


@pytest.mark.parametrize(
    "headers",
    [
        {"id": "1", "source": "web"},  # common headers of messages that are no events
        {"id": "1", "source": "web", "type": "t"},
        {"id": "1", "source": "web", "specversion": "1.0"},
        {
            "ID": "1",
            "Source": "web",
            "Type": "t",
            "SpecVersion": "1.0",
        },  # attributes are lower case
        # A prefixed attribute makes it a prefixed event: plain names do not fill gaps.
        {"ce-source": "/s", "id": "1", "source": "/s", "type": "t", "specversion": "1.0"},
    ],
)
def test_r3_plain_headers_are_an_event_only_when_unmistakable(headers: dict[str, object]) -> None:
    with pytest.raises(MissingKey):
        key(Envelope(body=None, headers=headers))


# ------------------------------------------------------------------ structured mode


def test_r3_structured_mode_decoded_body() -> None:
    assert key(Envelope(body=EVENT)) == EVENT_KEY


@pytest.mark.parametrize(
    "where",
    [
        {"transport": {"content_type": STRUCTURED}},  # AMQP / NATS content type
        {"headers": {"content-type": STRUCTURED}},  # Kafka header
        {"headers": {"Content-Type": "Application/CloudEvents+JSON"}},
        {},  # no content type: JSON, as decode_body reads it
    ],
)
@pytest.mark.parametrize("as_text", [False, True])
def test_r3_structured_mode_undecoded_body(where: dict[str, dict[str, str]], as_text: bool) -> None:
    raw = json.dumps(EVENT)
    env = Envelope(body=raw if as_text else raw.encode(), **where)  # type: ignore[arg-type]
    assert key(env) == EVENT_KEY


def test_r3_the_key_does_not_depend_on_decoding_first() -> None:
    env = Envelope(body=json.dumps(EVENT).encode(), transport={"content_type": STRUCTURED})
    assert key(env) == key(replace(env, body=decode_body(env))) == EVENT_KEY


def test_r3_a_binary_body_is_not_read_as_an_event() -> None:
    # Binary mode with a non-JSON content type: the body is the data, whatever it holds.
    env = Envelope(
        body=json.dumps(EVENT).encode(), transport={"content_type": "application/octet-stream"}
    )
    with pytest.raises(MissingKey, match="no CloudEvents"):
        key(env)


def test_r3_a_json_body_without_specversion_is_not_an_event() -> None:
    with pytest.raises(MissingKey, match="no CloudEvents"):
        key(Envelope(body=b'{"order": 1}'))
    with pytest.raises(MissingKey, match="no CloudEvents"):
        key(Envelope(body=b"\x00\x01 not json"))


def test_r3_structured_content_type_makes_the_body_the_event() -> None:
    env = Envelope(
        body=EVENT,
        headers={"ce-source": "/hdr", "ce-id": "h"},
        transport={"content_type": STRUCTURED},
    )
    assert key(env) == EVENT_KEY


def test_r3_structured_body_that_is_not_json() -> None:
    env = Envelope(body=b"{not json", transport={"content_type": STRUCTURED})
    with pytest.raises(InvalidKey, match="not JSON") as info:
        key(env)
    assert not isinstance(info.value, MissingKey)


def test_r3_structured_content_type_without_an_event() -> None:
    env = Envelope(body={"source": "/s", "id": "1"}, transport={"content_type": STRUCTURED})
    with pytest.raises(MissingKey, match="specversion"):
        key(env)


def test_r3_a_batch_has_no_single_key() -> None:
    env = Envelope(
        body=[EVENT, EVENT | {"id": "A-43"}],
        transport={"content_type": "application/cloudevents-batch+json"},
    )
    with pytest.raises(MissingKey, match="batch"):
        key(env)
    # FirstOf may key the batch message as a whole by its message id.
    batch = replace(env, message_id="m-1")
    assert FirstOf(CloudEventsKey(), MessageIdKey())(batch) == "m-1"


@pytest.mark.parametrize("specversion", [None, "", 1])
def test_r3_structured_specversion_must_be_a_string(specversion: object) -> None:
    with pytest.raises(InvalidKey, match="specversion") as info:
        key(Envelope(body=EVENT | {"specversion": specversion}))
    assert not isinstance(info.value, MissingKey)


# ------------------------------------------------------------------ what is missing, what is wrong

NO_ID = r"no CloudEvents id, only its source \(header 'ce-source'\)"
NO_SOURCE = r"no CloudEvents source, only its id \(header 'ce_id'\)"


@pytest.mark.parametrize(
    ("envelope", "reason"),
    [
        (Envelope(body=None), "no CloudEvents source and id"),
        (Envelope(body=None, headers={"ce-source": "/s"}), NO_ID),
        (Envelope(body=None, headers={"ce_id": "1"}), NO_SOURCE),
        (
            Envelope(body={"specversion": "1.0", "source": "/s"}),
            r"structured-mode event has no id, only its source \(structured body\)",
        ),
        (
            Envelope(body={"specversion": "1.0", "id": "1"}),
            r"structured-mode event has no source, only its id \(structured body\)",
        ),
        (Envelope(body=EVENT | {"id": ""}), r"CloudEvents id \(structured body\) is empty"),
        (
            Envelope(body=None, headers={"ce-source": "", "ce-id": "1"}),
            "CloudEvents source .* is empty",
        ),
        (Envelope(body=None, headers={"ce-source": "/s", "ce-id": 1}), "id .* is not a string"),
        (Envelope(body=EVENT | {"source": ["/s"]}), "source .* is not a string"),
    ],
)
def test_r3_missing_source_or_id_says_which(envelope: Envelope, reason: str) -> None:
    with pytest.raises(MissingKey, match=reason):
        key(envelope)


@pytest.mark.parametrize(
    "source", ["/orders eu", " /orders", "/orders\teu", "/a\x01b", "/a\u00a0b", "/a\u2028b"]
)
@pytest.mark.parametrize("mode", ["binary", "structured"])
def test_r3_a_source_is_a_uri_reference(source: str, mode: str) -> None:
    if mode == "binary":
        env = Envelope(body=None, headers={"ce-source": source, "ce-id": "1"})
    else:
        env = Envelope(body=EVENT | {"source": source})
    with pytest.raises(InvalidKey, match="URI reference") as info:
        key(env)
    assert not isinstance(info.value, MissingKey)


def test_r3_an_id_may_hold_spaces() -> None:
    # Only the source is a URI reference; "<source> <id>" splits back at the first space.
    assert key(Envelope(body=EVENT | {"id": "order 7"})) == "https://shop.example/orders order 7"


@pytest.mark.parametrize(
    ("headers", "field"),
    [
        ({"ce_source": b"/s", "ce_id": b"inv-\xff"}, "CloudEvents id (header 'ce_id')"),
        (
            {"ce-source": wire_text(b"/\xfe"), "ce-id": "1"},
            "CloudEvents source (header 'ce-source')",
        ),
    ],
)
def test_r2_r3_undecodable_attributes_are_refused(headers: dict[str, object], field: str) -> None:
    with pytest.raises(InvalidKey, match="not UTF-8 text") as info:
        key(Envelope(body=None, headers=headers))
    assert not isinstance(info.value, MissingKey)
    assert field in str(info.value)


# ------------------------------------------------------------------ event_data


def test_r3_event_data_binary_mode_is_the_body() -> None:
    from oncely.cloudevents import event_data

    env = Envelope(body={"order": 1}, headers={"ce_source": "/s", "ce_id": "1"})
    assert event_data(env) == {"order": 1}
    assert event_data(replace(env, body=b"\x00raw")) == b"\x00raw"
    assert event_data(replace(env, body=None)) is None
    # A message that is no CloudEvent is binary mode by the bindings' rule.
    assert event_data(Envelope(body={"x": 1})) == {"x": 1}


def test_r3_event_data_structured_mode() -> None:
    from oncely.cloudevents import event_data

    assert event_data(Envelope(body=EVENT)) == {"order": 42}
    assert event_data(Envelope(body=EVENT | {"data": "plain text"})) == "plain text"
    raw = Envelope(body=json.dumps(EVENT).encode(), transport={"content_type": STRUCTURED})
    assert event_data(raw) == {"order": 42}


def test_r3_event_data_base64() -> None:
    from oncely.cloudevents import event_data

    payload = b"\x00\xffbinary"
    event = {k: v for k, v in EVENT.items() if k != "data"}
    event["data_base64"] = base64.b64encode(payload).decode()
    assert event_data(Envelope(body=event)) == payload


def test_r3_event_data_absent() -> None:
    from oncely.cloudevents import event_data

    event = {k: v for k, v in EVENT.items() if k != "data"}
    assert event_data(Envelope(body=event)) is None


def test_r3_event_data_follows_the_mode_of_the_key() -> None:
    from oncely.cloudevents import event_data

    # Structured content type: the body is the event, even with ce- headers beside it.
    env = Envelope(
        body=EVENT,
        headers={"ce-source": "/h", "ce-id": "h"},
        transport={"content_type": STRUCTURED},
    )
    assert event_data(env) == {"order": 42}
    # No content type and complete binary headers: binary mode, the body is the data.
    env = Envelope(body=EVENT, headers={"ce-source": "/h", "ce-id": "h"})
    assert key(env) == "/h h"
    assert event_data(env) == EVENT


@pytest.mark.parametrize(
    "event",
    [
        EVENT | {"data_base64": "AAAA"},  # both: the JSON format forbids it
        {k: v for k, v in EVENT.items() if k != "data"} | {"data_base64": "not base64!"},
        {k: v for k, v in EVENT.items() if k != "data"} | {"data_base64": 7},
    ],
)
def test_r3_event_data_refuses_a_malformed_event(event: dict[str, object]) -> None:
    from oncely.cloudevents import event_data

    with pytest.raises(ValueError, match="data"):
        event_data(Envelope(body=event))


# ------------------------------------------------------------------ the producer's headers


@pytest.mark.parametrize(
    ("binding", "prefix"),
    [("http", "ce-"), ("nats", "ce-"), ("kafka", "ce_"), ("amqp", "cloudEvents_")],
)
def test_r3_producer_headers_follow_the_binding(binding: str, prefix: str) -> None:
    """R3: each binding names the attributes its own way (a Kafka consumer outside oncely
    reads only ``ce_``, an AMQP one only ``cloudEvents_``); CloudEventsKey reads them all."""
    headers = cloudevent_headers(
        source="/shop",
        event_type="order.paid",
        event_id="e1",
        subject="o-7",
        binding=binding,  # type: ignore[arg-type]
    )
    assert headers == {
        f"{prefix}specversion": "1.0",
        f"{prefix}source": "/shop",
        f"{prefix}type": "order.paid",
        f"{prefix}id": "e1",
        f"{prefix}subject": "o-7",
    }
    assert key(Envelope(body=b"{}", headers=headers)) == "/shop e1"
    as_bytes = {name: value.encode() for name, value in headers.items()}  # as Kafka gives them
    assert key(Envelope(body=b"{}", headers=as_bytes)) == "/shop e1"


def test_r3_producer_headers_default_to_the_http_binding() -> None:
    headers = cloudevent_headers(source="/shop", event_type="t", event_id="e1")
    assert headers["ce-id"] == "e1"


@pytest.mark.parametrize("binding", ["mqtt", "HTTP", "", "ce_"])
def test_r3_producer_headers_refuse_an_unknown_binding(binding: str) -> None:
    with pytest.raises(ConfigurationError, match="binding"):
        cloudevent_headers(source="/s", event_type="t", binding=binding)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "source", ["", "/a b", "/a\tb", "/a\x00b", "/a\x1bb", "/a\u200bb", "/a\x7f"]
)
def test_r3_producer_headers_refuse_a_source_the_consumer_refuses(source: str) -> None:
    """A source the consumer would refuse (white space, control or format characters) is
    refused when the event is made, not dead-lettered at every consumer."""
    with pytest.raises(ConfigurationError, match="source"):
        cloudevent_headers(source=source, event_type="t", event_id="e1")
    if source:
        sent = {"ce-source": source, "ce-id": "e1"}
        with pytest.raises(InvalidKey, match="source"):
            key(Envelope(body=None, headers=sent))


def test_r3_binding_prefixes_are_exported() -> None:
    from oncely import cloudevents

    assert {p.lower() for p in cloudevents.BINARY_PREFIXES} == {
        "ce-",
        "ce_",
        "cloudevents_",
        "cloudevents:",
    }
    assert cloudevents.attribute({"CloudEvents_Type": "t"}, "type") == "t"
    assert cloudevents.attribute({"ce_type": b"t"}, "type") == "t"
    assert cloudevents.attribute({"ce_type": b"t"}, "id") is None

"""NATS names and settings: headers, defaults, subjects and stream names, URL options, and the
client's failures that mean "unavailable"."""

from __future__ import annotations

import logging
import re
from datetime import timedelta

import nats.errors

from oncely._core.said import said
from oncely._urls import redact
from oncely.errors import BrokerUnavailable, ConfigurationError

LOGGER = logging.getLogger("oncely.broker.nats")

MSG_ID_HEADER = "Nats-Msg-Id"
ONCELY_ID_HEADER = "Oncely-Message-Id"
"""The producer's message id as oncely's producer sends it; ``Nats-Msg-Id`` then carries the
id and a hash of the body, so the stream's duplicate window drops a retry but never a reused
id with other content (that reaches the consumer, as a ``key_conflict``)."""
CONTENT_TYPE_HEADER = "Content-Type"
CORRELATION_HEADER = "Correlation-Id"
MESSAGE_ID_COPY_HEADER = "x-oncely-message-id"
ORIGINAL_HEADER_PREFIX = "x-oncely-original-"
"""On a dead-letter copy: the original's JetStream publish headers (``Nats-Expected-Stream``,
``Nats-Expected-Last-Sequence``, ``Nats-Rollup``, ``Nats-TTL``...) under this prefix, so the
dead-letter stream neither refuses nor acts on them."""
RAW_HEADERS_HEADER = "x-oncely-raw-headers"
"""On a dead-letter copy: the original's header lines that are not UTF-8, base64-encoded."""

DEFAULT_ACK_WAIT = timedelta(seconds=30)
DEFAULT_MAX_DELIVER = 20
DEFAULT_TIMEOUT = timedelta(seconds=5)
DEFAULT_CONNECT_TIMEOUT = timedelta(seconds=5)
DEFAULT_RECONNECT_WAIT = timedelta(milliseconds=500)
# The server's smallest duplicate window: the dead-letter stream created here keeps every copy.
DEAD_LETTER_WINDOW = timedelta(milliseconds=100)

SCHEMES = ("nats", "tls")
TRANSPORT_OPTIONS = (
    "ack_wait",
    "connect_timeout",
    "dead_letter_stream",
    "duplicate_window",
    "max_ack_pending",
    "max_deliver",
    "reconnect_wait",
    "stream",
    "timeout",
)
PRODUCER_OPTIONS = ("connect_timeout", "duplicate_window", "reconnect_wait", "stream", "timeout")
CONSUMER_ONLY_OPTIONS = tuple(o for o in TRANSPORT_OPTIONS if o not in PRODUCER_OPTIONS)
"""What a consumer's URL may say that the producer refuses, naming them as the consumer's."""

# Connection-level failures of the client: the broker is (for now) out of reach.
UNAVAILABLE: tuple[type[Exception], ...] = (nats.errors.Error, OSError, TimeoutError)


def unavailable(what: str, exc: BaseException) -> BrokerUnavailable:
    return BrokerUnavailable(f"NATS {what} failed: {said(exc)}")


def stream_name_for(subject: str) -> str:
    """The name of the stream created for ``subject`` when none captures it: every character
    a stream name cannot hold (``.``, ``*``, ``>``, white space) becomes ``_``."""
    return re.sub(r"[^A-Za-z0-9_-]", "_", subject)


def check_subject(subject: str, what: str) -> str:
    if not subject or any(ch.isspace() for ch in subject) or "" in subject.split("."):
        raise ConfigurationError(f"{what} {subject!r} is not a NATS subject")
    return subject


def has_wildcard(subject: str) -> bool:
    return any(token in ("*", ">") for token in subject.split("."))


def subject_matches(pattern: str, subject: str) -> bool:
    """Whether the subject ``pattern`` (with ``*`` and ``>`` wildcards) captures ``subject``."""
    want, have = pattern.split("."), subject.split(".")
    for i, token in enumerate(want):
        if token == ">":
            return len(have) > i
        if i >= len(have) or (token != "*" and token != have[i]):
            return False
    return len(want) == len(have)


def seconds(value: timedelta | None) -> float | None:
    return None if value is None else value.total_seconds()


def int_option(url: str, name: str, value: str | None) -> int | None:
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise ConfigurationError(f"{redact(url)}: {name} must be a whole number") from None


def seconds_option(url: str, name: str, value: str | None) -> timedelta | None:
    if value is None:
        return None
    try:
        return timedelta(seconds=float(value))
    except ValueError:
        raise ConfigurationError(f"{redact(url)}: {name} must be a number of seconds") from None

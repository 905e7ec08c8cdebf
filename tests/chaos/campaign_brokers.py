"""The bad-input campaign's three broker drivers (:mod:`tests.chaos.campaign`): each prepares
the destination, publishes the plan's copies with a foreign producer from
:mod:`tests.brokers.foreign` (pika, a raw ``XADD``, the raw NATS client), says when the consumer
is ready and how many copies were dead-lettered, and reads back the dead-letter copies and
what is left in the queue.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pika
import redis

from tests.brokers.foreign import (
    RawNats,
    amqp_connection,
    header_lines,
    nats_headers,
    publish_confirmed,
    stream_fields,
    stream_messages,
    xadd_entries,
)
from tests.chaos.campaign_plan import ACK_WAIT_S, BACKOFF_MOST_S, CONSUMER, NATS_WINDOW_S, Copy
from tests.services import NATS_URL, RABBITMQ_URL, REDIS_URL


@dataclass
class Sent:
    """What the broker said about one publish."""

    ident: str | None = None  # the stream entry id (Redis) or stream sequence (NATS)
    dropped: bool = False  # within the NATS duplicate window: dropped before oncely
    refused: str | None = None


@dataclass
class DeadCopy:
    tag: str | None
    outcome: str | None
    reason: str | None


def _text(value: object) -> str | None:
    if value is None:
        return None
    if isinstance(value, bytes | bytearray):
        return bytes(value).decode("utf-8", "replace")
    return str(value)


def _dead_copy(headers: dict[str, Any]) -> DeadCopy:
    return DeadCopy(
        tag=_text(headers.get("x-campaign")),
        outcome=_text(headers.get("x-oncely-outcome")),
        reason=_text(headers.get("x-oncely-reason")),
    )


def _tag(copy: Copy) -> tuple[bytes, bytes]:
    """The ``x-campaign`` header every copy carries (dead-letter copies keep it)."""
    return b"x-campaign", copy.tag.encode()


def _header_pairs(copy: Copy) -> list[tuple[bytes, bytes]]:
    return [(name.encode(), value) for name, value in copy.headers.items()]


def with_query(url: str, query: str) -> str:
    return url + ("&" if "?" in url else "?") + query


class RawStr(str):
    """A ``str`` that pika sends as exactly ``raw``: an AMQP long string that is not UTF-8."""

    raw: bytes

    def __new__(cls, raw: bytes) -> RawStr:
        made = super().__new__(cls, raw.decode("utf-8", "replace"))
        made.raw = raw
        return made

    def encode(self, encoding: str = "utf-8", errors: str = "strict") -> bytes:
        return self.raw


class RabbitMQDriver:
    name = "rabbitmq"
    identifies_copies = False  # the consumer's log names no copy: lines are traced by key

    def __init__(self, base: str) -> None:
        self.queue = base
        self.dead = f"{base}.dead"
        self.url = RABBITMQ_URL
        self.source = base
        self._conn: Any = None

    def _connection(self) -> Any:
        if self._conn is None or self._conn.is_closed:
            self._conn = amqp_connection()
        return self._conn

    def _declared(self, queue: str) -> tuple[int, int] | None:
        channel = self._connection().channel()
        try:
            ok = channel.queue_declare(queue, passive=True)
        except pika.exceptions.ChannelClosedByBroker:
            return None
        channel.close()
        return ok.method.message_count, ok.method.consumer_count

    def prepare(self) -> None:
        self._connection()

    def ready(self) -> bool:
        found = self._declared(self.queue)
        return found is not None and found[1] >= 1 and self._declared(self.dead) is not None

    def _properties(self, copy: Copy) -> Any:
        headers: dict[str, object] = {"x-campaign": copy.tag}
        for name, value in copy.headers.items():
            if name in copy.byte_arrays:
                headers[name] = value
            else:
                try:
                    headers[name] = value.decode("utf-8")
                except UnicodeDecodeError:
                    headers[name] = RawStr(value)
        return pika.BasicProperties(
            content_type=copy.content_type,
            message_id=copy.message_id,
            correlation_id=copy.correlation_id,
            headers=headers,
            delivery_mode=2,
            **copy.properties,
        )

    def publish(self, copies: list[Copy]) -> dict[str, Sent]:
        made = ((copy.body or b"", self._properties(copy)) for copy in copies)
        refused = publish_confirmed(self._connection(), self.queue, made)
        return {copy.tag: Sent(refused=why) for copy, why in zip(copies, refused, strict=True)}

    def dead_count(self) -> int:
        found = self._declared(self.dead)
        return found[0] if found else 0

    def ready_count(self) -> int:
        found = self._declared(self.queue)
        return found[0] if found else 0

    def _drain(self, queue: str) -> list[dict[str, Any]]:
        channel = self._connection().channel()
        found = []
        try:
            while True:
                method, properties, _body = channel.basic_get(queue, auto_ack=True)
                if method is None:
                    break
                found.append(dict(properties.headers or {}))
        except pika.exceptions.ChannelClosedByBroker:
            return found
        channel.close()
        return found

    def read_dead(self) -> list[DeadCopy]:
        return [_dead_copy(headers) for headers in self._drain(self.dead)]

    def leftovers(self) -> set[str]:
        return {_text(h.get("x-campaign")) or "?" for h in self._drain(self.queue)}

    def cleanup(self) -> None:
        conn = self._connection()
        for queue in (self.queue, self.dead):
            channel = conn.channel()
            try:
                channel.queue_delete(queue)
                channel.close()
            except pika.exceptions.AMQPError:
                pass
        channel = conn.channel()
        try:
            channel.exchange_delete(self.dead)
            channel.close()
        except pika.exceptions.AMQPError:
            pass
        conn.close()


class RedisDriver:
    name = "redis"
    identifies_copies = True  # log lines carry the stream entry id

    def __init__(self, base: str) -> None:
        self.client = redis.Redis.from_url(REDIS_URL)
        self.stream = base
        self.dead = f"{base}.dead"
        self.source = base
        self.url = with_query(REDIS_URL, "claim_every=0.25")

    def prepare(self) -> None:
        self.client.ping()

    def _group(self) -> dict[str, Any] | None:
        try:
            groups = self.client.xinfo_groups(self.stream)
        except redis.ResponseError:
            return None
        return next((g for g in groups if g["name"] == CONSUMER.encode()), None)

    def ready(self) -> bool:
        group = self._group()
        return group is not None and int(group["consumers"]) >= 1

    def publish(self, copies: list[Copy]) -> dict[str, Sent]:
        entries = [
            stream_fields(
                copy.body,
                message_id=copy.message_id,
                content_type=copy.content_type,
                correlation_id=copy.correlation_id,
                headers=[_tag(copy), *_header_pairs(copy)],
            )
            for copy in copies
        ]
        results = xadd_entries(self.client, self.stream, entries)
        return {
            copy.tag: Sent(refused=repr(r)) if isinstance(r, Exception) else Sent(ident=r)
            for copy, r in zip(copies, results, strict=True)
        }

    def dead_count(self) -> int:
        return int(self.client.xlen(self.dead))

    def read_dead(self) -> list[DeadCopy]:
        return [
            _dead_copy({k.decode("utf-8", "replace"): v for k, v in fields.items()})
            for _id, fields in self.client.xrange(self.dead)
        ]

    def leftovers(self) -> set[str]:
        """The entry ids the group has not acknowledged: pending, or never delivered."""
        group = self._group()
        if group is None:
            return set()
        pending = self.client.xpending_range(self.stream, CONSUMER, "-", "+", 1_000_000)
        unread = self.client.xrange(self.stream, b"(" + group["last-delivered-id"], "+")
        return {p["message_id"].decode() for p in pending} | {i.decode() for i, _ in unread}

    def cleanup(self) -> None:
        self.client.delete(self.stream, self.dead)
        self.client.close()


def parse_nats_headers(block: bytes) -> dict[str, bytes]:
    """A header block by name (the first of a repeated name wins)."""
    found: dict[str, bytes] = {}
    for name, value in header_lines(block):
        found.setdefault(name.decode("latin-1"), value)
    return found


class NatsDriver:
    name = "nats"
    identifies_copies = True  # log lines carry the stream sequence

    def __init__(self, base: str) -> None:
        self.source = f"{base}.in"
        self.stream = f"{base}_in"  # as the adapter names a stream for a subject
        self.dead = f"{base}_in_dead"
        self.url = NATS_URL
        self.nc = RawNats(NATS_URL, name="oncely-campaign")

    def prepare(self) -> None:
        config = {
            "name": self.stream,
            "subjects": [self.source],
            "retention": "limits",
            "storage": "file",
            "num_replicas": 1,
            "duplicate_window": int(NATS_WINDOW_S * 1e9),
        }
        answer = self.nc.api(f"STREAM.CREATE.{self.stream}", config)
        if "error" in answer:
            raise RuntimeError(f"cannot create the stream {self.stream}: {answer['error']}")

    def ready(self) -> bool:
        return "error" not in self.nc.api(f"CONSUMER.INFO.{self.stream}.{CONSUMER}") and (
            "error" not in self.nc.api(f"STREAM.INFO.{self.dead}")
        )

    def _headers(self, copy: Copy) -> list[tuple[bytes, bytes]]:
        fields = nats_headers(
            message_id=copy.message_id,
            content_type=copy.content_type,
            correlation_id=copy.correlation_id,
            headers=_header_pairs(copy),
        )
        return [_tag(copy), *fields]

    def publish(self, copies: list[Copy]) -> dict[str, Sent]:
        sent: dict[str, Sent] = {}
        for start in range(0, len(copies), 256):
            replies: dict[str, Copy] = {}
            for copy in copies[start : start + 256]:
                reply = self.nc.reply_subject()
                replies[reply] = copy
                self.nc.hpub(self.source, self._headers(copy), copy.body or b"", reply)
            self.nc.wait_for(replies, 30.0)
            for reply, copy in replies.items():
                _r, head, data = self.nc.arrivals.pop(reply)[0]
                try:
                    ack = json.loads(data) if not head.startswith(b"NATS/1.0 5") else {}
                except ValueError:
                    ack = {}
                if "seq" not in ack:
                    refused = ack.get("error") or head.decode("utf-8", "replace") or data.decode()
                    sent[copy.tag] = Sent(refused=str(refused))
                elif ack.get("duplicate"):
                    sent[copy.tag] = Sent(dropped=True)
                else:
                    sent[copy.tag] = Sent(ident=str(ack["seq"]))
        return sent

    def dead_count(self) -> int:
        info = self.nc.api(f"STREAM.INFO.{self.dead}")
        return int(info["state"]["messages"]) if "state" in info else 0

    def read_dead(self) -> list[DeadCopy]:
        return [
            _dead_copy(parse_nats_headers(block))
            for block, _body in stream_messages(self.nc, self.dead)
        ]

    def leftovers(self) -> set[str]:
        """The stream sequences the durable consumer has not acknowledged. Above its ack floor
        some may be pending, held back after a ``-NAK`` with a delay, or not delivered yet:
        they are pulled (nothing acknowledged) until the ack wait and the longest backoff
        have passed."""
        info = self.nc.api(f"CONSUMER.INFO.{self.stream}.{CONSUMER}")
        stream = self.nc.api(f"STREAM.INFO.{self.stream}")
        if "error" in info or "error" in stream:
            return set()
        floor, last = int(info["ack_floor"]["stream_seq"]), int(stream["state"]["last_seq"])
        if floor >= last:
            return set()
        wait = ACK_WAIT_S + BACKOFF_MOST_S + 1
        reply = self.nc.reply_subject()
        request = {"batch": last - floor + 16, "expires": int(wait * 1e9)}
        subject = f"$JS.API.CONSUMER.MSG.NEXT.{self.stream}.{CONSUMER}"
        self.nc.pub(subject, json.dumps(request).encode(), reply)
        found: set[str] = set()
        deadline = time.monotonic() + wait + 1
        while time.monotonic() < deadline:
            try:
                arrived = self.nc.step(deadline)
            except TimeoutError:
                break
            # A pulled message arrives under its own subject (the inbox is only its route).
            for ack, head, _data in self.nc.arrivals.pop(arrived or "", []):
                if ack and ack.startswith("$JS.ACK."):
                    tokens = ack.split(".")[2:]
                    found.add(tokens[3] if len(tokens) == 7 else tokens[5])
                elif arrived == reply and head.startswith(b"NATS/1.0 4"):  # 408: expired
                    deadline = 0.0
        return found

    def cleanup(self) -> None:
        for stream in (self.stream, self.dead):
            self.nc.api(f"STREAM.DELETE.{stream}")
        self.nc.close()


DRIVERS: dict[str, Callable[[str], Any]] = {
    "rabbitmq": RabbitMQDriver,
    "redis": RedisDriver,
    "nats": NatsDriver,
}

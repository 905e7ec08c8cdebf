"""Producers oncely did not write, sending what real foreign producers can send: ids, properties
and headers that are arbitrary bytes. oncely's own producers (and aio-pika, and nats-py) only
send UTF-8, so each broker gets a plain client here:

- RabbitMQ: pika, which takes ``bytes`` for ``message_id``, ``correlation_id`` and the other
  short-string properties and sends them as they are;
- Redis Streams: a raw ``XADD`` of byte fields, in the adapter's field layout;
- NATS JetStream: the client protocol written on a socket (:class:`RawNats`: ``HPUB`` with
  header bytes as given, JetStream API requests), and the stream read back the same way.

The foreign-producer tests (``tests/brokers/test_foreign_producers.py``,
``tests/cli/test_consume_bad_input.py``) and the bad-input campaign (``tests/chaos/campaign*``)
all publish through these.
"""

from __future__ import annotations

import asyncio
import base64
import json
import socket
import time
import uuid
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any
from urllib.parse import unquote, urlsplit

import pika
import redis

from tests.services import NATS_URL, RABBITMQ_URL, REDIS_URL

# ---------------------------------------------------------------------- RabbitMQ (pika)


def amqp_connection() -> pika.BlockingConnection:
    """A blocking pika connection to the test RabbitMQ."""
    return pika.BlockingConnection(pika.URLParameters(RABBITMQ_URL))


def wait_for_queue(queue: str, timeout: float = 60) -> None:
    """Wait until ``queue`` exists (a consumer starting in another process declares it), so a
    message published to it is routed; a fixed pause was too short on a busy machine."""
    deadline = time.monotonic() + timeout
    while True:
        connection = amqp_connection()
        try:
            connection.channel().queue_declare(queue, passive=True)
            return
        except pika.exceptions.ChannelClosedByBroker:
            if time.monotonic() > deadline:
                raise TimeoutError(f"no consumer declared {queue!r} in {timeout} s") from None
        finally:
            if connection.is_open:
                connection.close()
        time.sleep(0.1)


def publish_confirmed(
    connection: pika.BlockingConnection,
    queue: str,
    messages: Iterable[tuple[bytes, pika.BasicProperties]],
) -> list[str | None]:
    """Publish each ``(body, properties)`` to ``queue`` on the default exchange, mandatory and
    confirmed; for each, ``None`` or why the broker refused it. A refusal that closed the
    channel opens another, so the rest are still sent."""
    refused: list[str | None] = []
    channel = connection.channel()
    channel.confirm_delivery()
    for body, properties in messages:
        try:
            channel.basic_publish("", queue, body, properties, mandatory=True)
            refused.append(None)
        except (pika.exceptions.UnroutableError, pika.exceptions.NackError) as exc:
            refused.append(repr(exc))
        except pika.exceptions.AMQPChannelError as exc:
            refused.append(repr(exc))
            channel = connection.channel()
            channel.confirm_delivery()
    channel.close()
    return refused


def _publish_pika(queue: str, messages: Sequence[tuple[bytes, Mapping[str, Any]]]) -> None:
    connection = amqp_connection()
    try:
        made = ((body, pika.BasicProperties(**properties)) for body, properties in messages)
        refused = [why for why in publish_confirmed(connection, queue, made) if why is not None]
    finally:
        connection.close()
    if refused:
        raise AssertionError(f"RabbitMQ refused {len(refused)} publishes: {refused}")


async def publish_amqp(queue: str, messages: Sequence[tuple[bytes, Mapping[str, Any]]]) -> None:
    """Publish ``(body, basic properties)`` pairs to ``queue`` with pika, confirmed."""
    await asyncio.to_thread(_publish_pika, queue, messages)


# ---------------------------------------------------------------------- Redis Streams


def stream_fields(
    body: bytes | None,
    *,
    message_id: bytes | None = None,
    content_type: bytes | None = None,
    correlation_id: bytes | None = None,
    headers: Iterable[tuple[bytes, bytes]] = (),
) -> dict[bytes, bytes]:
    """An entry in the Redis Streams adapter's field layout: ``body``, ``message_id``,
    ``content_type``, ``correlation_id`` (each left out when ``None``: a foreign producer
    may send no ``body`` field at all), then every header as a field of its own."""
    fields: dict[bytes, bytes] = {}
    for name, value in (
        (b"body", body),
        (b"message_id", message_id),
        (b"content_type", content_type),
        (b"correlation_id", correlation_id),
    ):
        if value is not None:
            fields[name] = value
    fields.update(headers)
    return fields


def xadd_entries(
    client: redis.Redis, stream: str, entries: Sequence[Mapping[bytes, bytes]]
) -> list[str | Exception]:
    """``XADD`` each entry's fields to ``stream`` exactly as given, pipelined 200 at a time;
    for each, the entry id, or the error Redis answered with."""
    results: list[str | Exception] = []
    for start in range(0, len(entries), 200):
        pipe = client.pipeline(transaction=False)
        for fields in entries[start : start + 200]:
            pipe.xadd(stream, dict(fields))  # type: ignore[arg-type]
        for result in pipe.execute(raise_on_error=False):
            results.append(result if isinstance(result, Exception) else result.decode())
    return results


def xadd_raw(stream: str, entries: Sequence[Mapping[bytes, bytes]]) -> None:
    """``XADD`` each entry's fields to ``stream`` exactly as given."""
    client = redis.Redis.from_url(REDIS_URL)
    try:
        errors = [r for r in xadd_entries(client, stream, entries) if isinstance(r, Exception)]
    finally:
        client.close()
    if errors:
        raise errors[0]


# ---------------------------------------------------------------------- NATS JetStream


def nats_headers(
    *,
    message_id: bytes | None = None,
    content_type: bytes | None = None,
    correlation_id: bytes | None = None,
    headers: Iterable[tuple[bytes, bytes]] = (),
) -> list[tuple[bytes, bytes]]:
    """The header lines the NATS adapter reads its fields from (``Nats-Msg-Id``,
    ``Content-Type``, ``Correlation-Id``; each left out when ``None``), then ``headers``."""
    lines = [
        (name, value)
        for name, value in (
            (b"Nats-Msg-Id", message_id),
            (b"Content-Type", content_type),
            (b"Correlation-Id", correlation_id),
        )
        if value is not None
    ]
    return lines + list(headers)


def header_block(headers: Iterable[tuple[bytes, bytes]]) -> bytes:
    """A NATS header block: the ``NATS/1.0`` line, one ``name: value`` line each, a blank line."""
    return b"NATS/1.0\r\n" + b"".join(n + b": " + v + b"\r\n" for n, v in headers) + b"\r\n"


def header_lines(block: bytes) -> list[tuple[bytes, bytes]]:
    """The ``(name, value)`` pairs of a NATS header block (or of bare header lines, as in
    ``x-oncely-raw-headers``), in order, the status line skipped."""
    pairs = []
    for line in block.split(b"\r\n"):
        name, colon, value = line.partition(b":")
        if colon and not line.startswith(b"NATS/"):
            pairs.append((name.strip(), value.strip()))
    return pairs


class RawNats:
    """Just enough of the NATS client protocol to publish headers that are any octets, make
    JetStream API requests and pull messages, on one socket."""

    def __init__(self, url: str = NATS_URL, timeout: float = 10.0, name: str = "oncely-tests"):
        parts = urlsplit(url)
        self._sock = socket.create_connection(
            (parts.hostname or "127.0.0.1", parts.port or 4222), timeout
        )
        self._buf = b""
        self._pongs = 0
        self._seq = 0
        self.arrivals: defaultdict[str, list[tuple[str | None, bytes, bytes]]] = defaultdict(list)
        deadline = time.monotonic() + timeout
        if not self._line(deadline).startswith(b"INFO "):
            raise ConnectionError("the NATS server did not greet with INFO")
        options: dict[str, object] = {
            "verbose": False,
            "pedantic": False,
            "headers": True,
            "no_responders": True,
            "protocol": 1,
            "lang": "python-raw",
            "version": "0",
            "name": name,
        }
        if parts.username:
            options["user"] = unquote(parts.username)
            options["pass"] = unquote(parts.password or "")
        self.inbox = f"_INBOX.{name.replace('-', '_')}_{uuid.uuid4().hex}"
        self._send(b"CONNECT " + json.dumps(options).encode() + b"\r\n")
        self._send(f"SUB {self.inbox}.> 1\r\n".encode())
        self.flush()

    def __enter__(self) -> RawNats:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _send(self, data: bytes) -> None:
        self._sock.sendall(data)

    def _recv(self, deadline: float) -> None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("no answer from NATS in time")
        self._sock.settimeout(left)
        chunk = self._sock.recv(1 << 20)
        if not chunk:
            raise ConnectionError("NATS closed the connection")
        self._buf += chunk

    def _line(self, deadline: float) -> bytes:
        while (end := self._buf.find(b"\r\n")) < 0:
            self._recv(deadline)
        line, self._buf = self._buf[:end], self._buf[end + 2 :]
        return line

    def _exact(self, size: int, deadline: float) -> bytes:
        while len(self._buf) < size + 2:
            self._recv(deadline)
        data, self._buf = self._buf[:size], self._buf[size + 2 :]
        return data

    def step(self, deadline: float) -> str | None:
        """Read one protocol message; the subject of a message that arrived, if it was one."""
        line = self._line(deadline)
        op = line.split(b" ", 1)[0].upper()
        if op in (b"MSG", b"HMSG"):
            parts = line.decode().split()
            subject = parts[1]
            if op == b"MSG":
                reply = parts[3] if len(parts) == 5 else None
                data, head = self._exact(int(parts[-1]), deadline), b""
            else:
                reply = parts[3] if len(parts) == 6 else None
                raw = self._exact(int(parts[-1]), deadline)
                head, data = raw[: int(parts[-2])], raw[int(parts[-2]) :]
            self.arrivals[subject].append((reply, head, data))
            return subject
        if op == b"PING":
            self._send(b"PONG\r\n")
        elif op == b"PONG":
            self._pongs += 1
        elif op == b"-ERR":
            raise ConnectionError(f"NATS: {line.decode('utf-8', 'replace')}")
        return None

    def flush(self, timeout: float = 10.0) -> None:
        """``PING`` and wait for the ``PONG``: the server has read everything sent before."""
        want = self._pongs + 1
        self._send(b"PING\r\n")
        deadline = time.monotonic() + timeout
        while self._pongs < want:
            self.step(deadline)

    def reply_subject(self) -> str:
        self._seq += 1
        return f"{self.inbox}.{self._seq}"

    def pub(self, subject: str, payload: bytes, reply: str) -> None:
        self._send(f"PUB {subject} {reply} {len(payload)}\r\n".encode() + payload + b"\r\n")

    def hpub(
        self,
        subject: str,
        headers: Iterable[tuple[bytes, bytes]],
        payload: bytes,
        reply: str | None = None,
    ) -> None:
        """Publish ``payload`` with ``headers`` exactly as given (``reply``: where the
        JetStream ``PubAck`` goes; none, no ``PubAck`` is asked for)."""
        block = header_block(headers)
        route = f"{subject} {reply}" if reply is not None else subject
        head = f"HPUB {route} {len(block)} {len(block) + len(payload)}\r\n".encode()
        self._send(head + block + payload + b"\r\n")

    def wait_for(self, subjects: Iterable[str], timeout: float) -> None:
        waiting = {s for s in subjects if not self.arrivals.get(s)}
        deadline = time.monotonic() + timeout
        while waiting:
            waiting.discard(self.step(deadline) or "")

    def api(self, what: str, request: dict[str, object] | None = None) -> dict[str, Any]:
        """A JetStream API request (``$JS.API.<what>``) and its JSON answer."""
        reply = self.reply_subject()
        self.pub(f"$JS.API.{what}", json.dumps(request or {}).encode(), reply)
        self.wait_for([reply], 10.0)
        _reply, head, data = self.arrivals.pop(reply)[0]
        if head.startswith(b"NATS/1.0 503"):
            raise ConnectionError(f"JetStream is not enabled (no responders for {what})")
        answer: dict[str, Any] = json.loads(data)
        return answer

    def close(self) -> None:
        self._sock.close()


def stream_messages(nc: RawNats, stream: str) -> list[tuple[bytes, bytes]]:
    """The raw header block and body of every message ``stream`` holds (none: no stream)."""
    info = nc.api(f"STREAM.INFO.{stream}")
    if "state" not in info:
        return []
    found: list[tuple[bytes, bytes]] = []
    for seq in range(info["state"]["first_seq"], info["state"]["last_seq"] + 1):
        answer = nc.api(f"STREAM.MSG.GET.{stream}", {"seq": seq})
        if "message" in answer:  # else deleted, or gone since
            message = answer["message"]
            found.append(
                (
                    base64.b64decode(message.get("hdrs") or ""),
                    base64.b64decode(message.get("data") or ""),
                )
            )
    return found


def _hpub(subject: str, messages: Sequence[tuple[Sequence[tuple[bytes, bytes]], bytes]]) -> None:
    with RawNats() as nc:
        for headers, body in messages:
            nc.hpub(subject, headers, body)
        nc.flush()  # the server has read it all


async def publish_nats(
    subject: str, messages: Sequence[tuple[Sequence[tuple[bytes, bytes]], bytes]]
) -> None:
    """Publish ``(header lines, body)`` pairs on ``subject`` over the raw client protocol."""
    await asyncio.to_thread(_hpub, subject, messages)
    await asyncio.sleep(0.1)  # let the stream store them before anyone counts


def _read_stream(subject: str) -> list[tuple[bytes, bytes]]:
    with RawNats() as nc:
        names = nc.api("STREAM.NAMES", {"subject": subject}).get("streams") or []
        if not names:
            raise LookupError(f"no stream captures {subject!r}")
        return stream_messages(nc, names[0])


async def read_nats_stream(subject: str) -> list[tuple[bytes, bytes]]:
    """The raw header block and body of every message the stream capturing ``subject`` holds."""
    return await asyncio.to_thread(_read_stream, subject)

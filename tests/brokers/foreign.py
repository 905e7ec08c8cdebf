"""Producers oncely did not write, sending what real foreign producers can send: ids, properties
and headers that are arbitrary bytes. oncely's own producers (and aio-pika, and nats-py) only
send UTF-8, so each broker gets a plain client here:

- RabbitMQ: pika, which takes ``bytes`` for ``message_id``, ``correlation_id`` and the other
  short-string properties and sends them as they are;
- Redis Streams: a raw ``XADD`` of byte fields;
- NATS JetStream: the client protocol written on a socket (``HPUB``), header bytes as given.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import socket
from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import urlsplit

import pika
import redis

from tests.services import NATS_URL, RABBITMQ_URL, REDIS_URL


def _publish_pika(queue: str, messages: Sequence[tuple[bytes, Mapping[str, Any]]]) -> None:
    connection = pika.BlockingConnection(pika.URLParameters(RABBITMQ_URL))
    try:
        channel = connection.channel()
        channel.confirm_delivery()
        for body, properties in messages:
            channel.basic_publish(
                "", queue, body, pika.BasicProperties(**properties), mandatory=True
            )
    finally:
        connection.close()


async def publish_amqp(queue: str, messages: Sequence[tuple[bytes, Mapping[str, Any]]]) -> None:
    """Publish ``(body, basic properties)`` pairs to ``queue`` with pika, confirmed."""
    await asyncio.to_thread(_publish_pika, queue, messages)


def xadd_raw(stream: str, entries: Sequence[Mapping[bytes, bytes]]) -> None:
    """``XADD`` each entry's fields to ``stream`` exactly as given."""
    client = redis.Redis.from_url(REDIS_URL)
    try:
        for fields in entries:
            client.xadd(stream, dict(fields))  # type: ignore[arg-type]
    finally:
        client.close()


def _hpub(subject: str, messages: Sequence[tuple[Sequence[tuple[bytes, bytes]], bytes]]) -> None:
    parts = urlsplit(NATS_URL)
    with socket.create_connection((parts.hostname or "127.0.0.1", parts.port or 4222), 5) as s:
        reader = s.makefile("rb")
        info = reader.readline()
        if not info.startswith(b"INFO "):
            raise AssertionError(f"not a NATS server: {info!r}")
        options = {"verbose": False, "pedantic": False, "headers": True, "protocol": 1}
        out = bytearray(b"CONNECT " + json.dumps(options).encode() + b"\r\n")
        for headers, body in messages:
            block = b"NATS/1.0\r\n" + b"".join(n + b": " + v + b"\r\n" for n, v in headers)
            block += b"\r\n"
            out += b"HPUB %s %d %d\r\n" % (subject.encode(), len(block), len(block) + len(body))
            out += block + body + b"\r\n"
        out += b"PING\r\n"
        s.sendall(out)
        while (line := reader.readline()) != b"PONG\r\n":  # the server has read it all
            if not line or line.startswith(b"-ERR"):
                raise AssertionError(f"NATS refused the publish: {line!r}")


async def publish_nats(
    subject: str, messages: Sequence[tuple[Sequence[tuple[bytes, bytes]], bytes]]
) -> None:
    """Publish ``(header lines, body)`` pairs on ``subject`` over the raw client protocol."""
    await asyncio.to_thread(_hpub, subject, messages)
    await asyncio.sleep(0.1)  # let the stream store them before anyone counts


async def read_nats_stream(subject: str) -> list[tuple[bytes, bytes]]:
    """The raw header block and body of every message the stream capturing ``subject`` holds."""
    import nats

    connection = await nats.connect(NATS_URL)
    try:
        js = connection.jetstream()
        stream = await js.find_stream_name_by_subject(subject)
        info = await js.stream_info(stream)
        found: list[tuple[bytes, bytes]] = []
        for seq in range(info.state.first_seq, info.state.last_seq + 1):
            with contextlib.suppress(Exception):
                reply = await connection.request(
                    f"$JS.API.STREAM.MSG.GET.{stream}", json.dumps({"seq": seq}).encode()
                )
                message = json.loads(reply.data)["message"]
                raw = base64.b64decode(message.get("hdrs", "")) if message.get("hdrs") else b""
                found.append((raw, base64.b64decode(message.get("data", ""))))
        return found
    finally:
        await connection.close()

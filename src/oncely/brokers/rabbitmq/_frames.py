"""AMQP frames whose strings are not UTF-8, read losslessly on oncely's own connections.

AMQP 0-9-1 short strings (``message_id``, ``correlation_id`` and the other basic properties,
a routing key, the names in a header table) are plain octets, and RabbitMQ passes on whatever a
producer sent. pamqp decodes them as strict UTF-8 and fails the whole frame otherwise; aiormq
then closes the connection, RabbitMQ redelivers the message to the next connection, and the
queue never moves past it (the broker's delivery limit finally dead-letters it with every
message prefetched behind it).

oncely wraps ``pamqp.frame.unmarshal``: a frame that decodes is untouched (no cost), and one
that fails on a ``UnicodeDecodeError`` is decoded again here with every short string and table
key read by :func:`oncely.wire.wire_text` (UTF-8 with ``surrogateescape``, lossless). This
happens only on connections oncely opened (:func:`lossless_frames` marks them through a context
variable that aiormq's reader task inherits); on any other connection in the process the frame
fails exactly as before. The delivery then reaches oncely, which dead-letters it as ``rejected``
with a reason naming the field (see :mod:`._delivery`).

Writing, pamqp cuts a header name (a field-table key, an AMQP short string of up to 255 bytes)
at 128 bytes, with only a log line: two names that share their first 128 bytes became one
header, and a name was sent cut. :class:`WholeHeaderNames` is a message whose header table
is encoded here instead, every name whole (and nested tables' too), the values by pamqp.
"""

from __future__ import annotations

import contextlib
import contextvars
import struct
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import aio_pika
import aiormq
import pamqp.frame
from aio_pika.abc import AbstractChannel
from pamqp import commands, constants, decode, encode, header
from pamqp.exceptions import UnmarshalingException

from oncely.errors import BrokerError
from oncely.wire import wire_text

__all__ = [
    "WholeHeaderNames",
    "cut_reason",
    "frame_max",
    "header_frame",
    "install",
    "lossless_frames",
    "negotiated",
]

_ON_OWN_CONNECTION: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "oncely_amqp_lossless_frames", default=False
)
_Unmarshal = Callable[[bytes], tuple[int, int, Any]]


@contextlib.contextmanager
def lossless_frames() -> Iterator[None]:
    """Connections opened inside this block read non-UTF-8 strings losslessly."""
    install()
    token = _ON_OWN_CONNECTION.set(True)
    try:
        yield
    finally:
        _ON_OWN_CONNECTION.reset(token)


def install() -> None:
    """Wrap ``pamqp.frame.unmarshal`` once (aiormq looks it up on every frame)."""
    current = pamqp.frame.unmarshal
    if getattr(current, "_oncely_wrapped", None) is not None:
        return
    strict: _Unmarshal = current

    def unmarshal(data_in: bytes) -> tuple[int, int, Any]:
        try:
            return strict(data_in)
        except UnmarshalingException as exc:
            if not _ON_OWN_CONNECTION.get() or not isinstance(exc.__cause__, UnicodeDecodeError):
                raise
            try:
                return _lossless(data_in)
            except (struct.error, ValueError, KeyError, IndexError, TypeError):
                raise exc from None

    unmarshal._oncely_wrapped = strict  # type: ignore[attr-defined]
    pamqp.frame.unmarshal = unmarshal


def _lossless(data_in: bytes) -> tuple[int, int, Any]:
    frame_type, channel_id, frame_size = pamqp.frame.frame_parts(data_in)
    if frame_size is None:
        raise ValueError("no frame size")
    byte_count = constants.FRAME_HEADER_SIZE + frame_size + 1
    data = data_in[constants.FRAME_HEADER_SIZE : byte_count - 1]
    if frame_type == constants.FRAME_HEADER:
        content = header.ContentHeader()
        content.class_id, content.weight, content.body_size = struct.unpack(">HHQ", data[0:12])
        offset, flags = content._get_flags(data[12:])
        properties = content.properties
        rest = data[12 + offset :]
        for name in properties.__slots__:
            if flags & properties.flags[name]:
                consumed, value = _by_type(rest, getattr(type(properties), "_" + name))
                setattr(properties, name, value)
                rest = rest[consumed:]
        return byte_count, channel_id, content
    if frame_type == constants.FRAME_METHOD:
        _, index = decode.long_int(data[0:4])
        method = commands.INDEX_MAPPING[index]()
        _unmarshal_method(method, data[4:])
        return byte_count, channel_id, method
    raise ValueError(f"frame type {frame_type} holds no strings")


def _unmarshal_method(method: Any, data: bytes) -> None:
    # pamqp.base.Frame.unmarshal, with the lossless string decoders.
    offset, in_bits = 0, False
    for argument in method.__slots__:
        data_type = method.amqp_type(argument)
        if in_bits and (data_type != "bit" or offset == 8):
            data, offset, in_bits = data[1:], 0, False
        if data_type == "bit":
            _, value = decode.bit(data, offset)
            offset, in_bits, consumed = offset + 1, True, 0
        else:
            consumed, value = _by_type(data, data_type)
        setattr(method, argument, value)
        data = data[consumed:]


def _by_type(data: bytes, data_type: str) -> tuple[int, Any]:
    if data_type == "shortstr":
        length = data[0]
        return length + 1, wire_text(data[1 : length + 1])
    if data_type == "table":
        return _table(data)
    return decode.by_type(data, data_type)


def _table(data: bytes) -> tuple[int, dict[str, Any]]:
    (length,) = struct.unpack(">I", data[0:4])
    end = 4 + length
    if end > len(data):
        raise ValueError("field table length exceeds the frame")
    offset, table = 4, {}
    while offset < end:
        key_length = data[offset]
        offset += 1
        key = wire_text(data[offset : offset + key_length])
        offset += key_length
        consumed, value = _value(data[offset:])
        offset += consumed
        table[key] = value
    return end, table


def _value(data: bytes) -> tuple[int, Any]:
    kind = data[0:1]
    if kind == b"F":
        consumed, table = _table(data[1:])
        return consumed + 1, table
    if kind == b"A":
        (length,) = struct.unpack(">I", data[1:5])
        offset, end, items = 5, 5 + length, []
        while offset < end:
            consumed, item = _value(data[offset:])
            offset += consumed
            items.append(item)
        return offset, items
    return decode.embedded_value(data)


class _WholeNamesProperties(aiormq.spec.Basic.Properties):
    """Basic properties whose header table keeps every name whole (see the module docs)."""

    def encode_property(self, name: str, value: Any) -> bytes:
        if name == "headers" and isinstance(value, dict):
            return _encode_table(value)
        return super().encode_property(name, value)


class WholeHeaderNames(aio_pika.Message):
    """An ``aio_pika.Message`` whose header names are sent whole, up to AMQP's 255 bytes
    (pamqp's own encoder cuts them at 128). A longer name is refused with ``TypeError``."""

    @property
    def properties(self) -> aiormq.spec.Basic.Properties:
        made = _WholeNamesProperties()
        plain = super().properties
        for name in plain.__slots__:
            setattr(made, name, getattr(plain, name))
        return made


def _encode_table(table: Mapping[str, Any]) -> bytes:
    parts: list[bytes] = []
    for name, value in table.items():
        parts.append(encode.short_string(name))  # TypeError past 255 bytes, as pamqp's
        parts.append(_encode_value(value))
    data = b"".join(parts)
    return struct.pack(">I", len(data)) + data


def _encode_value(value: Any) -> bytes:
    if isinstance(value, dict):
        return b"F" + _encode_table(value)
    if isinstance(value, list):
        items = b"".join(_encode_value(item) for item in value)
        return b"A" + struct.pack(">I", len(items)) + items
    return encode.encode_table_value(value)


FRAME_MIN = 4096
"""AMQP's smallest ``frame_max``: every broker takes a frame this large."""


def header_frame(message: aio_pika.Message) -> int:
    """The size of ``message``'s content header frame: the frame's own 7 bytes and end
    octet, the class, weight and body size (12 bytes) and the encoded properties. RabbitMQ
    closes the whole connection on one larger than ``frame_max``."""
    return 8 + 12 + len(message.properties.marshal())


async def frame_max(channel: AbstractChannel) -> int:
    """The ``frame_max`` negotiated on ``channel``'s connection (see :func:`negotiated`)."""
    try:
        underlay = await channel.get_underlay_channel()
    except (RuntimeError, aiormq.exceptions.AMQPError):
        return FRAME_MIN
    return negotiated(underlay)


def negotiated(underlay: object) -> int:
    """The ``frame_max`` negotiated on the connection of ``underlay``, an aiormq channel
    (:data:`FRAME_MIN` when it cannot be read; for 0, no limit, the largest size a frame can
    say)."""
    tune = getattr(getattr(underlay, "connection", None), "connection_tune", None)
    found = getattr(tune, "frame_max", None)
    if not isinstance(found, int) or found < 0:
        return FRAME_MIN
    return found or 2**32 - 1


CUT = " ... [cut to fit the server's frame_max]"


def cut_reason(reason: str, over: int) -> str:
    """``reason`` shortened by at least ``over`` bytes (UTF-8), marked as cut; raise
    :class:`~oncely.BrokerError` when even no reason at all would not make a dead-letter
    copy fit."""
    data = reason.encode("utf-8", "surrogatepass")
    room = len(data) - over
    if room < 0:
        raise BrokerError(
            f"the dead-letter copy's headers would be {-room} bytes over the connection's "
            "frame_max even without its reason; not published"
        )
    cut = CUT.encode()
    kept = data[: room - len(cut)] + cut if room > 2 * len(cut) else data[:room]
    return kept.decode("utf-8", "ignore")

"""Result codecs: how a handler's result is stored and given back to duplicates (R1)."""

from __future__ import annotations

import json
from typing import Protocol

from oncely._core.fingerprint import result_json
from oncely.errors import PayloadError, UnfingerprintablePayload

__all__ = ["Codec", "JSONCodec", "RawCodec"]

_decode_json = json.JSONDecoder().decode
"""``json.loads`` of text, with no argument given (a decoder like ``json``'s own default)."""


class Codec(Protocol):
    """Turns results into bytes for the store and back. ``decode(encode(x))`` must equal
    ``x`` for every result a handler returns, or duplicates get a different value."""

    def encode(self, value: object) -> bytes: ...

    def decode(self, data: bytes) -> object: ...


class JSONCodec:
    """JSON (the default). Dates, decimals, UUIDs and dataclasses are stored in their JSON form,
    so a duplicate receives that form (an ISO string for a ``datetime``)."""

    __slots__ = ()

    def encode(self, value: object) -> bytes:
        try:
            return result_json(value).encode("utf-8", "surrogatepass")
        except UnfingerprintablePayload as exc:
            raise PayloadError(
                f"the result is not JSON: {exc.__cause__}; return JSON-compatible values "
                "or give the inbox another codec (codec=...)"
            ) from exc

    def decode(self, data: bytes) -> object:
        # Speed: ``json.loads`` of an object (a duplicate's stored result, as the HTTP
        # middleware's responses are) without its guess at the encoding. A first byte ``{``
        # and a second that is not NUL is what ``json.detect_encoding`` reads as UTF-8, which
        # ``json.loads`` then decodes as here: the same value or error, about 0.4 us sooner
        # (of a 50 us HTTP replay on Redis, ``bench/web.py --in-process``).
        if type(data) is bytes and data[:1] == b"{" and data[1:2] != b"\x00":
            return _decode_json(data.decode("utf-8", "surrogatepass"))
        return json.loads(data)

    def __repr__(self) -> str:
        return "JSONCodec()"


class RawCodec:
    """Results are ``bytes`` already and are stored as they are."""

    __slots__ = ()

    def encode(self, value: object) -> bytes:
        if not isinstance(value, bytes | bytearray | memoryview):
            raise TypeError(f"RawCodec stores bytes, got {type(value).__name__}")
        return bytes(value)

    def decode(self, data: bytes) -> object:
        return data

    def __repr__(self) -> str:
        return "RawCodec()"

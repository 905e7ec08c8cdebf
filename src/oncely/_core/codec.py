"""Result codecs: how a handler's result is stored and given back to duplicates (R1)."""

from __future__ import annotations

import json
from typing import Protocol

from oncely._core.fingerprint import canonical_json
from oncely.errors import PayloadError, UnfingerprintablePayload

__all__ = ["Codec", "JSONCodec", "RawCodec"]


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
            return canonical_json(value).encode("utf-8", "surrogatepass")
        except UnfingerprintablePayload as exc:
            raise PayloadError(
                f"the result is not JSON: {exc.__cause__}; return JSON-compatible values "
                "or give the inbox another codec (codec=...)"
            ) from exc

    def decode(self, data: bytes) -> object:
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

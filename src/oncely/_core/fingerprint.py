"""Canonical fingerprints of payloads (R20 steps 4-6).

A fingerprint tells a duplicate (same key, same content) from a key conflict (same key, other
content: the producer reused an id, or the details changed after the first processing). It must
not change when a payload is re-serialised: dict order, JSON whitespace, a tuple that came back
as a list, or a ``datetime`` that came back as its ISO string give the same fingerprint.

Format: ``"v1:" + blake2b-128 hex`` of a canonical JSON text (sorted keys, no white space,
UTF-8). The version prefix names the algorithm, so a later one can be introduced deliberately.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
from collections.abc import Callable, Mapping
from datetime import date, datetime, time
from decimal import Decimal
from enum import Enum
from typing import Final
from uuid import UUID

from oncely.errors import ConfigurationError, UnfingerprintablePayload

__all__ = [
    "Fingerprint",
    "Fingerprinter",
    "canonical_json",
    "fingerprint",
    "result_json",
    "scoped",
]

VERSION: Final = "v1:"

Fingerprinter = Callable[[object], str | None]
"""Maps a payload to its fingerprint, or ``None`` to skip the conflict check."""


def _default(value: object) -> object:
    # Values JSON has no type for, mapped to what they re-serialise as.
    if isinstance(value, datetime | date | time):
        return value.isoformat()
    if isinstance(value, Decimal | UUID):
        return str(value)
    if isinstance(value, bytes | bytearray | memoryview):
        return base64.b64encode(bytes(value)).decode("ascii")
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, set | frozenset):
        return sorted(canonical_json(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    dump = getattr(value, "model_dump", None)  # pydantic v2 models
    if callable(dump):
        return dump(mode="json")
    raise TypeError(f"no canonical form for {type(value).__name__}")


def _result_default(value: object) -> object:
    # A result's set keeps its members as they are (a set of ints comes back as a list of
    # ints, which a declared ``set[int]`` rebuilds), ordered by their canonical text. The
    # fingerprint's form (members as their canonical text) stays as it is: fingerprints
    # already stored must not change.
    if isinstance(value, set | frozenset):
        return [member for _, member in sorted(((canonical_json(m), m) for m in value), key=_first)]
    return _default(value)


def _first(pair: tuple[str, object]) -> str:
    return pair[0]


def _make_canonical(default: Callable[[object], object] = _default) -> Callable[[object], str]:
    # One C encoder built once: json.dumps (and JSONEncoder.encode) build a new one per call,
    # a fifth of the cost of fingerprinting a small payload. Circular structures are caught
    # as RecursionError instead of by the encoder's marker dict.
    make = getattr(json.encoder, "c_make_encoder", None)
    if make is None:  # pragma: no cover - interpreters without the C accelerator
        return json.JSONEncoder(
            sort_keys=True,
            separators=(",", ":"),
            ensure_ascii=False,
            allow_nan=True,
            default=default,
        ).encode
    encode = make(None, default, json.encoder.encode_basestring, None, ":", ",", True, False, True)

    def canonical(value: object) -> str:
        if isinstance(value, str):
            return json.encoder.encode_basestring(value)
        return "".join(encode(value, 0))

    return canonical


_canonical = _make_canonical()
_result_canonical = _make_canonical(_result_default)


def result_json(value: object) -> str:
    """The JSON text a result is stored as: :func:`canonical_json`, except that a set's
    members stay values (not their canonical text)."""
    try:
        return _result_canonical(value)
    except (TypeError, ValueError, RecursionError) as exc:
        raise _unfingerprintable(exc) from exc


def canonical_json(value: object) -> str:
    """The canonical JSON text of ``value`` (sorted keys, no white space)."""
    try:
        return _canonical(value)
    except (TypeError, ValueError, RecursionError) as exc:
        raise _unfingerprintable(exc) from exc


def _unfingerprintable(exc: Exception) -> UnfingerprintablePayload:
    return UnfingerprintablePayload(
        f"cannot fingerprint the payload: {exc}; fingerprint selected fields "
        "(Fingerprint.fields(...)) or pass a fingerprint function"
    )


def _digest(data: bytes) -> str:
    return VERSION + hashlib.blake2b(data, digest_size=16).hexdigest()


def _utf8(text: str) -> bytes:
    # "surrogatepass": JSON may carry a lone surrogate ("\\ud800"); it still has one stable
    # encoding, so such a payload is fingerprinted rather than refused.
    return text.encode("utf-8", "surrogatepass")


def _of_dict(value: dict[str, object]) -> str:
    """The fingerprint of a dict: canonical_json, _utf8 and _digest written inline (the same
    steps, three calls fewer), for the paths every message takes."""
    try:
        text = _canonical(value)
    except (TypeError, ValueError, RecursionError) as exc:
        raise _unfingerprintable(exc) from exc
    data = text.encode("utf-8", "surrogatepass")
    return VERSION + hashlib.blake2b(data, digest_size=16).hexdigest()


def fingerprint(payload: object) -> str:
    """The fingerprint of a whole payload.

    Raw ``bytes`` are hashed as they are; text that is JSON is hashed in canonical form, so a
    body re-serialised with other spacing or key order keeps its fingerprint; anything else is
    hashed in canonical JSON form.
    """
    if type(payload) is dict:
        return _of_dict(payload)  # the common case first: it runs for every message
    if isinstance(payload, bytes | bytearray | memoryview):
        raw = bytes(payload)
        parsed = _try_json(raw)
        return _digest(raw if parsed is _NOT_JSON else _utf8(canonical_json(parsed)))
    if isinstance(payload, str):
        parsed = _try_json(payload)
        text = payload if parsed is _NOT_JSON else canonical_json(parsed)
        return _digest(_utf8(text))
    return _digest(_utf8(canonical_json(payload)))


def scoped(scope: str, fingerprint: str | None) -> str:
    """A fingerprint that is ``fingerprint`` (whatever the inbox's strategy made of the
    payload; ``None`` for :meth:`Fingerprint.none`) within ``scope``: an ``@idempotent``
    function's name. The same key reached by another function, even with the same arguments,
    then differs from the record and is a key conflict, never that function's duplicate."""
    return _digest(_utf8(canonical_json([scope, fingerprint])))


_NOT_JSON: Final = object()


_BOM = b"\xef\xbb\xbf"


def _try_json(data: bytes | str) -> object:
    # JSON text may start with white space or a byte-order mark; both are re-serialisation
    # noise, so they are skipped before deciding whether the text is a JSON object or array.
    if isinstance(data, str):
        stripped: bytes | str = data.lstrip(" \t\r\n\ufeff")
        head: bytes | str = stripped[:1]
        if head not in ("{", "["):
            return _NOT_JSON
    else:
        stripped = data.removeprefix(_BOM).lstrip(b" \t\r\n")
        head = stripped[:1]
        if head not in (b"{", b"["):
            return _NOT_JSON
    try:
        return json.loads(stripped)
    except ValueError:
        return _NOT_JSON


class Fingerprint:
    """Ready-made fingerprinters. Pass one as ``Inbox(fingerprint=...)``."""

    @staticmethod
    def payload() -> Fingerprinter:
        """The whole payload, canonically (the default)."""
        return fingerprint

    @staticmethod
    def fields(*paths: str) -> Fingerprinter:
        """Only the named immutable fields; dotted paths reach into nested mappings
        (``"customer.id"``). Fields that may legitimately change between copies (a send
        timestamp, a trace id) are left out, so they never cause a key conflict."""
        if not paths:
            raise ConfigurationError("Fingerprint.fields needs at least one field")
        split = [(p, p.split(".")) for p in paths]

        def by_fields(payload: object) -> str:
            # Each path is followed through mappings (a plain dict tested before the Mapping
            # ABC, whose isinstance costs more than the lookup) and attributes, and stops at
            # the first missing part.
            picked: dict[str, object] = {}
            for name, parts in split:
                value: object = payload
                for part in parts:
                    if type(value) is dict or isinstance(value, Mapping):
                        value = value.get(part)
                    else:
                        value = getattr(value, part, None)
                    if value is None:
                        break
                picked[name] = value
            return _of_dict(picked)

        return by_fields

    @staticmethod
    def none() -> Fingerprinter:
        """No fingerprint: a reused key is always a duplicate (no conflict detection)."""
        return _no_fingerprint


def _no_fingerprint(_payload: object) -> None:
    return None

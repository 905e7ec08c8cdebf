"""Dedup keys for adapter and tool authors: the key sources, their text form and the checks.

The same names as on :mod:`oncely` for the key sources, plus what a broker adapter or a command
line needs: :func:`key_source` (``"message-id"``, ``"cloudevents"``, ``"header:NAME"``,
``"body:FIELD"``, comma-separated for the first found), :func:`is_transport_field` and
:data:`TRANSPORT_FIELDS` (per-delivery fields never accepted as keys, R4) and
:func:`validate_key`, and :func:`hashed_key`, the form a key over the limit is stored in with
``Limits(hash_long_keys=True)``. Bytes read off the wire are kept lossless by :mod:`oncely.wire`.
"""

from oncely._core.keys import (
    TRANSPORT_FIELDS,
    BusinessKey,
    CloudEventsKey,
    CorrelationIdKey,
    Envelope,
    FirstOf,
    HeaderKey,
    KeySource,
    KeyWarning,
    MessageIdKey,
    hashed_key,
    is_transport_field,
    key_source,
    validate_key,
)

__all__ = [
    "TRANSPORT_FIELDS",
    "BusinessKey",
    "CloudEventsKey",
    "CorrelationIdKey",
    "Envelope",
    "FirstOf",
    "HeaderKey",
    "KeySource",
    "KeyWarning",
    "MessageIdKey",
    "hashed_key",
    "is_transport_field",
    "key_source",
    "validate_key",
]

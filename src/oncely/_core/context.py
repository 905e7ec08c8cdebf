"""What a running handler can learn about its own message, and the key to pass downstream (R17)."""

from __future__ import annotations

import hashlib
from contextvars import ContextVar
from dataclasses import dataclass

__all__ = ["Current", "current", "downstream_key", "handling", "outer_correlation_id"]


@dataclass(frozen=True, slots=True)
class Current:
    """The message a handler is processing right now."""

    consumer: str
    key: str
    attempt: int
    correlation_id: str | None
    mode: str

    def downstream_key(self, step: str = "") -> str:
        """A stable idempotency key for a call this handler makes to another service (R17).

        The same message gives the same key on every redelivery and every attempt, so the
        downstream service can deduplicate the call; ``step`` tells apart several calls made by
        one handler (``downstream_key("charge")``, ``downstream_key("email")``).
        """
        return downstream_key(self.consumer, self.key, step)


def downstream_key(consumer: str, key: str, step: str = "") -> str:
    """The downstream idempotency key of ``(consumer, key)`` for ``step`` (R17).

    The three fields are joined by ``\\x1f``; a field that holds ``\\x1e`` or ``\\x1f`` has each
    of them escaped with ``\\x1e`` first, so no two different triples give one key (a key
    ``"k\\x1fx"`` with step ``"y"`` is not the key ``"k"`` with step ``"x\\x1fy"``), while a field
    without them (every key seen in practice) is joined as it is and keeps its key."""
    raw = "\x1f".join(_escaped(field) for field in (consumer, key, step))
    return hashlib.blake2b(raw.encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()


def _escaped(field: str) -> str:
    if "\x1e" not in field and "\x1f" not in field:
        return field
    return field.replace("\x1e", "\x1e\x1e").replace("\x1f", "\x1e\x1f")


# The inboxes set a plain tuple (consumer, key, attempt, correlation_id, mode): building the
# Current object only when a handler asks for it keeps it off the hot path.
_CURRENT: ContextVar[tuple[str, str, int, str | None, str] | None] = ContextVar(
    "oncely_current", default=None
)


def current() -> Current | None:
    """The message being processed by the calling handler, or ``None`` outside a handler."""
    fields = _CURRENT.get()
    return None if fields is None else Current(*fields)


def handling() -> Current:
    """The message being processed by the calling handler; :class:`LookupError` outside a
    handler. For code that only runs inside one (``oncely.handling().downstream_key(...)``
    type-checks where :func:`current`'s optional result needs a check first)."""
    fields = _CURRENT.get()
    if fields is None:
        raise LookupError(
            "oncely.handling() is called outside a handler: only a function an inbox is "
            "running has a message (oncely.current() returns None there instead)"
        )
    return Current(*fields)


def outer_correlation_id() -> str | None:
    """The correlation id of the message whose handler is running, or ``None``: what a call
    made inside it without a correlation id of its own is logged with (R16)."""
    fields = _CURRENT.get()
    return None if fields is None else fields[3]

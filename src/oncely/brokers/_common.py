"""Checks every broker adapter makes the same way: its URL, its durations, a producer's
message id."""

from __future__ import annotations

import reprlib
from collections.abc import Iterable
from datetime import timedelta
from urllib.parse import urlunsplit

from oncely._urls import redact, split
from oncely.errors import ConfigurationError
from oncely.wire import escaped, undecodable_reason

__all__ = [
    "flag",
    "missing_driver",
    "not_utf8",
    "positive",
    "require_message_id",
    "server_url",
]


def server_url(url: str, schemes: tuple[str, ...], broker: str) -> str:
    """``url`` without its query and fragment (oncely's options, not the client's), after
    checking that its scheme is one of ``schemes``. Raises
    :class:`~oncely.ConfigurationError` naming the schemes ``broker`` accepts."""
    parts = split(url)
    if parts.scheme.lower() not in schemes:
        raise ConfigurationError(
            f"{redact(url)}: a {broker} URL starts with "
            + " or ".join(f"{scheme}://" for scheme in schemes)
        )
    return urlunsplit(parts._replace(query="", fragment=""))


def positive(value: timedelta, name: str) -> timedelta:
    """``value``, or :class:`~oncely.ConfigurationError` when it is not above zero."""
    if value <= timedelta(0):
        raise ConfigurationError(f"{name} must be positive")
    return value


def flag(value: object, name: str) -> bool:
    """``value`` when it is a bool, else :class:`~oncely.ConfigurationError` naming what was
    given: a truthy ``"no"``, ``0.0`` or list must not switch an option on (or off)."""
    if not isinstance(value, bool):
        raise ConfigurationError(
            f"{name} must be True or False, not {reprlib.repr(value)} ({type(value).__name__})"
        )
    return value


def require_message_id(message_id: str) -> str:
    """A producer's message id, refused when empty: it is the consumers' dedup key (R2)."""
    if not message_id:
        raise ConfigurationError(
            "publish needs the producer's message id (R2): create it once per logical "
            "message (new_message_id()) and reuse it on every retry"
        )
    return message_id


def missing_driver(exc: ModuleNotFoundError, adapter: str, extra: str) -> ModuleNotFoundError:
    """The import guard's error for an adapter package whose broker client is not installed:
    the same exception type (and missing module name), with the extra that installs it."""
    return ModuleNotFoundError(
        f"oncely.brokers.{adapter} needs the {exc.name!r} package: pip install 'oncely[{extra}]'",
        name=exc.name,
    )


def not_utf8(fields: Iterable[tuple[str, str | None]]) -> str | None:
    """The refusal of a delivery whose id, correlation id or property (``(name, text)``
    pairs, text as :func:`oncely.wire.wire_text` decoded it) is not UTF-8, naming the
    first such field; ``None`` when every one is text."""
    for name, text in fields:
        if text is not None and escaped(text):
            return undecodable_reason(name, text)
    return None

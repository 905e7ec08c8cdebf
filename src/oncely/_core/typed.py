"""Typed results: a stored result (its JSON form) brought back to the type the first call
returned, so a duplicate answers with the same type (a dataclass, a pydantic model, a
``datetime``, a ``Decimal``...) as the call that ran.

:func:`reviver` reads a return annotation once and gives the function that converts a decoded
result; it follows dataclass fields, ``list``/``tuple``/``set``/``dict`` items and ``X | None``,
and calls ``model_validate`` on a pydantic model. What it does not know (``Any``, a plain
``dict``) is left as decoded.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable
from datetime import date, datetime, time
from decimal import Decimal
from enum import Enum
from typing import Any
from uuid import UUID

from oncely.errors import PayloadError

__all__ = ["ANNOTATED", "result_type", "revive", "reviver"]

ANNOTATED: Any = object()
"""``returns=`` left out: the function's return annotation."""

_PARSE: dict[type, Callable[[Any], Any]] = {
    datetime: datetime.fromisoformat,
    date: date.fromisoformat,
    time: time.fromisoformat,
    Decimal: Decimal,
    UUID: UUID,
}


def _identity(value: Any) -> Any:
    return value


def reviver(annotation: Any) -> Callable[[Any], Any]:
    """The converter of decoded results to ``annotation`` (identity where there is nothing
    to convert)."""
    if (
        annotation in (None, type(None), Any, object, typing.Any)
        or annotation is dataclasses.MISSING
    ):
        return _identity
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        members = [reviver(a) for a in args if a is not type(None)]
        optional = type(None) in args

        def union(value: Any) -> Any:
            if value is None and optional:
                return None
            for revive_member in members:
                try:
                    return revive_member(value)
                except (TypeError, ValueError, KeyError, PayloadError):
                    continue
            return value

        return union
    if origin in (list, set, frozenset) and args:
        item = reviver(args[0])
        kind = origin
        return lambda value: kind(item(v) for v in value)
    if origin is tuple and args:
        if len(args) == 2 and args[1] is Ellipsis:
            item = reviver(args[0])
            return lambda value: tuple(item(v) for v in value)
        items = [reviver(a) for a in args]
        return lambda value: tuple(f(v) for f, v in zip(items, value, strict=True))
    if origin is dict and len(args) == 2:
        keys, values = reviver(args[0]), reviver(args[1])
        return lambda value: {keys(k): values(v) for k, v in value.items()}
    if not isinstance(annotation, type):
        return _identity
    if dataclasses.is_dataclass(annotation):
        return _dataclass(annotation)
    validate = getattr(annotation, "model_validate", None)  # pydantic v2
    if callable(validate):
        return validate  # type: ignore[no-any-return]
    if issubclass(annotation, Enum):
        return annotation
    parse = _PARSE.get(annotation)
    if parse is not None:
        return lambda value: value if isinstance(value, annotation) else parse(value)
    return _identity


def _dataclass(cls: type) -> Callable[[Any], Any]:
    hints = typing.get_type_hints(cls)
    fields = [(f.name, f.init) for f in dataclasses.fields(cls)]
    revivers: dict[str, Callable[[Any], Any]] = {}

    def build(value: Any) -> Any:
        if isinstance(value, cls):
            return value
        if not revivers:
            revivers.update({name: reviver(hints.get(name, Any)) for name, _ in fields})
        made = cls(
            **{name: revivers[name](value[name]) for name, init in fields if init and name in value}
        )
        return made

    return build


def revive(annotation: Any, value: Any) -> Any:
    """``value`` (a decoded result) as ``annotation``; :class:`~oncely.PayloadError` when it
    cannot be."""
    try:
        return reviver(annotation)(value)
    except PayloadError:
        raise
    except Exception as exc:
        raise PayloadError(
            f"the stored result cannot be read back as {annotation!r}: {type(exc).__name__}: {exc}"
        ) from exc


def result_type(fn: Callable[..., Any], returns: Any) -> Any:
    """The type a repeat of ``fn`` returns: ``returns``, or (for :data:`ANNOTATED`) ``fn``'s
    return annotation; ``Any`` (the stored form) where there is none to read."""
    if returns is not ANNOTATED:
        return Any if returns is None else returns
    try:
        return typing.get_type_hints(fn).get("return", Any)
    except Exception:  # a forward reference it cannot resolve: left as stored
        return Any

"""Typed results: a stored result (its JSON form) brought back to the type the first call
returned, so a duplicate answers with the same type (a dataclass, a pydantic model, a
``datetime``, a ``Decimal``...) as the call that ran.

:func:`reviver` reads a return annotation once and gives the function that converts a decoded
result; it follows dataclass fields, ``list``/``tuple``/``set``/``dict`` items and ``X | None``,
and calls ``model_validate`` on a pydantic model. What it does not know (``Any``, a plain
``dict``) is left as decoded.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import functools
import inspect
import json
import logging
import types
import typing
import weakref
from collections.abc import Callable
from datetime import date, datetime, time
from decimal import Decimal
from enum import Enum
from typing import Any, TypeVar
from uuid import UUID

from oncely._core.fingerprint import result_json
from oncely._core.outcomes import Handled, Outcome
from oncely._core.said import said
from oncely.errors import PayloadError

__all__ = [
    "ANNOTATED",
    "ResultWatch",
    "annotated",
    "changed_type",
    "result_type",
    "revive",
    "reviver",
    "typed_repeat",
]

R = TypeVar("R")

ANNOTATED: Any = object()
"""``returns=`` left out: the function's return annotation."""

_PARSE: dict[type, Callable[[Any], Any]] = {
    datetime: datetime.fromisoformat,
    date: date.fromisoformat,
    time: time.fromisoformat,
    Decimal: Decimal,
    UUID: UUID,
    bytes: lambda text: base64.b64decode(text, validate=True),  # the stored form (base64)
    int: int,  # a dict key: JSON keeps keys as strings
    float: float,
}
_BARE = (tuple, set, frozenset)
"""Containers a bare annotation names (no item type) that JSON stores as a list."""
_JSON_NATIVE = (str, int, float, bool, list, dict)
"""Classes a decoded result can be an instance of as it is (in a union, such a member takes
a value of its class as it is)."""


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
        return _union(args)
    if annotation in _BARE or (origin in _BARE and not args):
        # A bare ``tuple``/``set``/``frozenset`` (or ``tuple[()]``): stored as a JSON list,
        # given back as the container it names, its items as stored.
        return _bare(origin or annotation)
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
    if issubclass(annotation, tuple) and hasattr(annotation, "_fields"):  # a NamedTuple
        return _named_tuple(annotation)
    if typing.is_typeddict(annotation):
        return _typed_dict(annotation)
    validate = getattr(annotation, "model_validate", None)  # pydantic v2
    if callable(validate):
        return validate  # type: ignore[no-any-return]
    if issubclass(annotation, Enum):
        return annotation
    parse = _PARSE.get(annotation)
    if parse is not None:
        return lambda value: value if isinstance(value, annotation) else parse(value)
    return _identity


def _frozen(value: Any) -> Any:
    """``value`` with its lists as tuples, all the way down: the hashable form a tuple took."""
    return tuple(_frozen(v) for v in value) if isinstance(value, list) else value


def _bare(kind: Any) -> Callable[[Any], Any]:
    """The converter for a bare ``tuple``, ``set`` or ``frozenset``. A set's members that
    were tuples are stored as lists, which a set cannot hold: they come back as tuples; one
    whose members have no hashable form (dataclasses, stored as dicts) stays as stored."""

    def build(value: Any) -> Any:
        if isinstance(value, kind) or not isinstance(value, list):
            return value
        if kind is tuple:
            return tuple(value)
        try:
            return kind(_frozen(v) for v in value)
        except TypeError:  # unhashable members: the stored list, as without an annotation
            return value

    return build


def _union(args: tuple[Any, ...]) -> Callable[[Any], Any]:
    """A union's converter: the first member the stored value is (a JSON type: a string, a
    number), or that it converts to and back unchanged, so a string in ``datetime | str``
    that only looks like a date stays a string while a stored ``datetime`` comes back as one.
    The JSON form cannot say more: a string that is exactly a member's stored form (a
    ``date | str`` given ``"2026-01-01"``) becomes that member. A value no member takes is
    left as decoded."""
    optional = type(None) in args
    members: list[tuple[type | None, Callable[[Any], Any]]] = [
        (a if isinstance(a, type) and a in _JSON_NATIVE else None, reviver(a))
        for a in args
        if a is not type(None)
    ]

    def union(value: Any) -> Any:
        if value is None and optional:
            return None
        for native, revive_member in members:
            if native is not None:
                if isinstance(value, native) and (native is bool) == isinstance(value, bool):
                    return value
                continue
            try:
                made = revive_member(value)
                if json.loads(result_json(made)) == value:
                    return made
            except Exception:  # not this member (a Decimal raises its own error)
                continue
        return value

    return union


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


def _named_tuple(cls: type) -> Callable[[Any], Any]:
    hints = typing.get_type_hints(cls)
    items = [reviver(hints.get(name, Any)) for name in cls._fields]  # type: ignore[attr-defined]

    def build(value: Any) -> Any:
        if isinstance(value, cls):
            return value
        return cls(*(f(v) for f, v in zip(items, value, strict=True)))

    return build


def _typed_dict(cls: type) -> Callable[[Any], Any]:
    revivers = {name: reviver(hint) for name, hint in typing.get_type_hints(cls).items()}

    def build(value: Any) -> Any:
        return {
            name: revivers[name](item) if name in revivers else item for name, item in value.items()
        }

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
            f"the stored result cannot be read back as {annotation!r}: {said(exc)}"
        ) from exc


def result_type(fn: Callable[..., Any], returns: Any) -> Any:
    """The type a repeat of ``fn`` returns: ``returns``, or (for :data:`ANNOTATED`) ``fn``'s
    return annotation; ``Any`` (the stored form) where there is none to read."""
    if returns is not ANNOTATED:
        return Any if returns is None else returns
    try:
        return typing.get_type_hints(annotated(fn)).get("return", Any)
    except Exception:  # a forward reference it cannot resolve: left as stored
        return Any


def annotated(fn: object) -> object:
    """What holds ``fn``'s annotations: the function a ``functools.partial`` wraps, the
    ``__call__`` of a callable object's class, or ``fn`` itself."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    if inspect.isroutine(fn) or isinstance(fn, type) or not callable(fn):
        return fn
    return type(fn).__call__


_REPEATS: weakref.WeakKeyDictionary[Any, Callable[[Any], Any] | None] = weakref.WeakKeyDictionary()
"""Per function (a method's function), the converter of its repeats read from its return
annotation (None: the stored form as it is), read once rather than at every duplicate."""


def _repeat_reviver(fn: Callable[..., Any], returns: Any) -> Callable[[Any], Any] | None:
    """The converter ``typed_repeat`` applies for ``fn`` and ``returns`` (None: none)."""
    if returns is not ANNOTATED:  # the caller's own type: cheap to look up, not cached
        convert = reviver(Any if returns is None else returns)
        return None if convert is _identity else convert
    target = getattr(fn, "__func__", fn)
    try:
        return _REPEATS[target]
    except (KeyError, TypeError):  # TypeError: not weakly referable, read each time
        pass
    try:
        wanted = typing.get_type_hints(annotated(fn)).get("return", Any)
        cache = True
    except Exception:  # a forward reference not resolvable yet: as stored, asked again later
        wanted, cache = Any, False
    convert = reviver(wanted)
    found = None if convert is _identity else convert
    if cache:
        with contextlib.suppress(TypeError):
            _REPEATS[target] = found
    return found


def typed_repeat(handled: Handled[R], fn: Callable[..., Any], returns: Any) -> Handled[R]:
    """``handled`` with a duplicate's stored result brought back to ``fn``'s return type (its
    annotation, or ``returns``; ``None``: as stored), so a repeat answers with the type the
    first call did; :class:`~oncely.PayloadError` when the stored form cannot be."""
    if handled.outcome is not Outcome.DUPLICATE or handled.value is None or returns is None:
        return handled
    convert = _repeat_reviver(fn, returns)
    if convert is None:
        return handled
    try:
        value = convert(handled.value)
    except PayloadError:
        raise
    except Exception as exc:
        raise PayloadError(
            f"the stored result cannot be read back as {result_type(fn, returns)!r}: {said(exc)}"
        ) from exc
    return dataclasses.replace(handled, value=value)


_AS_TEXT = (datetime, date, time, Decimal, UUID)


def changed_type(value: Any) -> str | None:
    """What of ``value`` (a result) a repeat with no return type to rebuild it gets back as
    another type from its JSON form, and how to annotate it (the words of a warning);
    ``None`` when all of it comes back as it is, or when it is not JSON at all (the codec
    refuses it and says so)."""
    try:
        found = _changed(value)
    except RecursionError:
        return None
    if found is None:
        return None
    name, back, key = found
    if key:
        return (
            f"the {name} keys of a dict in its result as {back}: annotate its return type "
            f"(a dict[{name}, ...] where the result holds it)"
        )
    if type(value) is list or type(value) is dict:
        return (
            f"the {name} in its result as {back}: annotate its return type (one that names "
            f"{name} where the result holds it, such as list[{name}])"
        )
    return f"its {name} result as {back}: annotate its return type (-> {name})"


def _changed(value: Any) -> tuple[str, str, bool] | None:
    kind = type(value)
    if value is None or kind is str or kind is int or kind is float or kind is bool:
        return None
    if kind is list:
        for item in value:
            found = _changed(item)
            if found is not None:
                return found
        return None
    if kind is dict:
        for name, item in value.items():
            if type(name) is not str:
                return type(name).__name__, "str", True
            found = _changed(item)
            if found is not None:
                return found
        return None
    return _as(value, kind.__name__)


def _as(value: Any, name: str) -> tuple[str, str, bool] | None:
    if isinstance(value, Enum):
        return name, type(value.value).__name__, False
    if isinstance(value, bytes | bytearray | memoryview):
        return name, "str (base64)", False
    if isinstance(value, _AS_TEXT):
        return name, "str", False
    if isinstance(value, tuple | set | frozenset | list):
        return name, "list", False
    if isinstance(value, dict) or (dataclasses.is_dataclass(value) and not isinstance(value, type)):
        return name, "dict", False
    if callable(getattr(value, "model_dump", None)):  # a pydantic model
        return name, "dict", False
    for native in (bool, int, float, str):  # a subclass of one comes back as the class
        if isinstance(value, native):
            return name, native.__name__, False
    return None


_WATCHED_RESULTS = 16
"""How many results of an unannotated function :class:`ResultWatch` looks at: a function
that returned only JSON's own types that many times is taken to return nothing else."""


class ResultWatch:
    """For an ``@idempotent`` function with no return type to rebuild its repeats from:
    logs one warning, at the first result that a repeat would get back as another type (a
    ``bytes`` as its base64 text, a dataclass as a dict, a tuple as a list), naming the
    function, the type and the fix. Once per function, not per call."""

    __slots__ = ("_function", "_left", "_logger", "warned")

    def __init__(self, function: str, logger: logging.Logger) -> None:
        self._function = function
        self._logger = logger
        self._left = _WATCHED_RESULTS
        self.warned = False

    def see(self, value: Any) -> None:
        if self.warned or value is None or self._left <= 0:
            return
        self._left -= 1  # a function whose results keep their type is not walked for ever
        found = changed_type(value)
        if found is None:
            return
        self.warned = True
        self._logger.warning(
            "oncely: a repeat of %s (it has no return type) gets back %s, or pass returns= "
            "to idempotent, so a repeat returns what the first call did",
            self._function,
            found,
        )

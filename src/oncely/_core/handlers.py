"""The kind of a handler an inbox is given: one whose call runs nothing is refused.

A sync :class:`~oncely.Inbox` that calls an ``async def`` gets a coroutine back, not a result:
the body never runs, and without a check the key would be recorded as done (the coroutine
stored as its result, or nothing) while the message was acknowledged. A generator function
is the same trap for either inbox: its call returns a generator and runs none of the body.
An asyncio inbox given a plain function gets its value at once: the function ran, and its
value is the result.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

from oncely.errors import AsyncHandlerRefused, ConfigurationError, HandlerRefused

__all__ = [
    "called_misfit",
    "misfit",
    "refuse_async",
    "refuse_generator",
    "refuse_result",
    "refuse_store_kind",
    "refuse_unrun",
    "sync_result",
]


_ASYNC_CODE = inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR
_GENERATOR_CODE = inspect.CO_GENERATOR | inspect.CO_ASYNC_GENERATOR
_PLAIN = frozenset({dict, list, tuple, str, bytes, int, float, bool})
"""Result types that are never awaitable: taken without a question (the common case)."""


def misfit(handler: object, arguments: int) -> str | None:
    """Why ``handler`` cannot be called with ``arguments`` positional arguments (its
    signature, as ``(payload)``), or None when it can, or when that cannot be told for sure
    (no signature readable; a wrapper taking ``*args``, whatever it wraps): only a call that
    would certainly raise ``TypeError`` is refused.

    The signature is the callable's own (a ``functools.partial``'s what is left of it, a bound
    method's without ``self``, an object's ``__call__``'s), not the one a decorator's
    ``functools.wraps`` copied from the function it wraps, which may take other arguments."""
    try:
        signature = inspect.signature(handler, follow_wrapped=False)  # type: ignore[arg-type]
    except (TypeError, ValueError):  # a builtin without a signature, not a callable
        return None
    try:
        signature.bind(*(None,) * arguments)
    except TypeError:
        # Without annotations: under ``from __future__ import annotations`` they are strings.
        bare = [p.replace(annotation=p.empty) for p in signature.parameters.values()]
        return str(signature.replace(parameters=bare, return_annotation=signature.empty))
    return None


def called_misfit(
    handler: object, called: str, caller: str, *, define: str = "async def"
) -> str | None:
    """Why ``handler`` cannot be called as ``handler{called}`` (``"(payload)"``, ``"(tx,
    payload)"``) by ``caller`` (``"the two-phase mode"``), as the end of a sentence naming
    it, with the way to write it (``define``: ``"async def"`` or ``"def"``); None when it
    can, or when that cannot be told for sure (:func:`misfit`)."""
    takes = misfit(handler, called.count(",") + 1)
    if takes is None:
        return None
    name = getattr(handler, "__name__", None) or "handler"
    return (
        f"takes {takes}, but {caller} calls it as handler{called}: "
        f"write it as {define} {name}{called}"
    )


def refuse_generator(handler: object) -> None:
    """Raise :class:`~oncely.HandlerRefused` for a generator function (sync or async), before
    anything is claimed."""
    code = getattr(handler, "__code__", None)
    if code is not None:
        if code.co_flags & _GENERATOR_CODE:
            raise HandlerRefused(_generator(handler))
        return
    if inspect.isgeneratorfunction(handler) or inspect.isasyncgenfunction(handler):
        raise HandlerRefused(_generator(handler))


def refuse_async(handler: object) -> None:
    """Raise :class:`~oncely.AsyncHandlerRefused` for a handler the sync inbox would call and
    get a coroutine from (an ``async def``, a partial of one, an object whose ``__call__``
    is one), and :class:`~oncely.HandlerRefused` for a generator function, before anything
    is claimed."""
    # Speed: a function or a method answers from its code's flags (about 0.1 us; the
    # inspect calls below cost a microsecond or two on every message).
    code = getattr(handler, "__code__", None)
    if code is not None:
        if code.co_flags & _ASYNC_CODE:
            raise AsyncHandlerRefused(_said(handler))
        if code.co_flags & inspect.CO_GENERATOR:
            raise HandlerRefused(_generator(handler))
        return
    call = getattr(handler, "__call__", None)  # noqa: B004 - an object's own async __call__
    if inspect.iscoroutinefunction(handler) or (
        not inspect.isroutine(handler) and inspect.iscoroutinefunction(call)
    ):
        raise AsyncHandlerRefused(_said(handler))
    if inspect.isasyncgenfunction(handler):
        raise AsyncHandlerRefused(_said(handler))
    refuse_generator(handler)


def refuse_store_kind(store: object, *, asynchronous: bool) -> None:
    """Raise :class:`~oncely.ConfigurationError` for a store of the other kind than its
    inbox, when the inbox is made: a sync inbox would get coroutines back from an asyncio
    store's calls (never run, read as records), and an asyncio inbox would await a sync
    store's records. A store is asyncio when its ``claim`` is an ``async def``."""
    claim = getattr(store, "claim", None)
    if claim is None or inspect.iscoroutinefunction(claim) == asynchronous:
        return
    name = type(store).__name__
    if asynchronous:
        other = f"Async{name}" if not name.startswith("Async") else "its asyncio twin"
        raise ConfigurationError(
            f"AsyncInbox needs an asyncio store, and {name} is a sync one (its claim is not "
            f"an async def): use {other} (oncely.open_async(url) opens one from a "
            "URL), or the sync oncely.Inbox"
        )
    other = name.removeprefix("Async") if name.startswith("Async") else "its sync twin"
    raise ConfigurationError(
        f"Inbox needs a sync store, and {name} is an asyncio one (its claim is an async "
        f"def): use {other} (oncely.open(url) opens one from a URL), or "
        "oncely.AsyncInbox"
    )


def refuse_unrun(returned: Any, handler: object) -> None:
    """Refuse a generator (sync or async) that came back from a call, closed unrun: the
    handler's body never ran (a generator function behind a wrapper, or a result built
    lazily)."""
    if inspect.isgenerator(returned) or inspect.isasyncgen(returned):
        close = getattr(returned, "close", None)
        if inspect.isgenerator(returned) and close is not None:
            close()
        raise HandlerRefused(_generator(handler, returned=True))


def refuse_result(value: Any) -> None:
    """Refuse, as the result a claim completes with, what stands for work that never ran: a
    coroutine (not awaited), an awaitable or a generator."""
    if value is None or type(value) in _PLAIN:
        return
    if inspect.isawaitable(value) or inspect.isgenerator(value) or inspect.isasyncgen(value):
        kind = "a coroutine" if inspect.iscoroutine(value) else type(value).__name__
        raise HandlerRefused(
            f"complete() was given {kind} as the result: the work it stands for has not run "
            "(await it, or list(...) a generator, and complete with the value); the claim "
            "is still held"
        )


def sync_result(returned: Any, handler: object) -> Any:
    """What a sync inbox's handler returned, unless it is an awaitable (an async function
    behind a lambda or a wrapper) or a generator: that is closed unrun and refused."""
    if returned is None or type(returned) in _PLAIN:
        return returned
    if inspect.iscoroutine(returned):
        returned.close()  # never run: no "coroutine was never awaited" warning either
        raise AsyncHandlerRefused(_said(handler, returned=True))
    if inspect.isawaitable(returned) or inspect.isasyncgen(returned):
        raise AsyncHandlerRefused(_said(handler, returned=True))
    refuse_unrun(returned, handler)
    return returned


def _name(handler: object) -> str:
    return getattr(handler, "__qualname__", None) or type(handler).__name__


def _said(handler: object, *, returned: bool = False) -> str:
    what = "returned an awaitable (an async function behind it)" if returned else "is async"
    return (
        f"the handler {_name(handler)} {what}: a sync oncely.Inbox cannot run it (it would be "
        "recorded as done without running); use oncely.AsyncInbox, or a plain function"
    )


def _generator(handler: object, *, returned: bool = False) -> str:
    what = "returned a generator" if returned else "is a generator function"
    return (
        f"the handler {_name(handler)} {what}: calling it runs none of its body, so it would "
        "be recorded as done without running; return the value instead (list(...) of what "
        "it yields)"
    )


def function_name(fn: object, *, qualified: bool = False) -> str:
    """``fn``'s qualified name (with ``qualified``, its module's before it): that of the
    function a ``functools.partial`` wraps, of the class of a callable object."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    named = fn if hasattr(fn, "__qualname__") else type(fn)
    name = str(getattr(named, "__qualname__", type(fn).__name__))
    module = getattr(named, "__module__", None)
    return f"{module}.{name}" if qualified and module else name

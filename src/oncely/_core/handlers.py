"""The kind of a handler an inbox is given: a sync inbox cannot run an async one.

A sync :class:`~oncely.Inbox` that calls an ``async def`` gets a coroutine back, not a result:
the body never runs, and without a check the key would be recorded as done (the coroutine
stored as its result, or nothing) while the message was acknowledged. An asyncio inbox given
a plain function gets its value at once: the function ran, and its value is the result.
"""

from __future__ import annotations

import inspect
from typing import Any

from oncely.errors import AsyncHandlerRefused

__all__ = ["refuse_async", "sync_result"]


_ASYNC_CODE = inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR
_PLAIN = frozenset({dict, list, tuple, str, bytes, int, float, bool})
"""Result types that are never awaitable: taken without a question (the common case)."""


def refuse_async(handler: object) -> None:
    """Raise :class:`~oncely.AsyncHandlerRefused` for a handler the sync inbox would call and
    get a coroutine from (an ``async def``, a partial of one, an object whose ``__call__``
    is one), before anything is claimed."""
    # Speed: a function or a method answers from its code's flags (about 0.1 us; the
    # inspect calls below cost a microsecond or two on every message).
    code = getattr(handler, "__code__", None)
    if code is not None:
        if code.co_flags & _ASYNC_CODE:
            raise AsyncHandlerRefused(_said(handler))
        return
    call = getattr(handler, "__call__", None)  # noqa: B004 - an object's own async __call__
    if inspect.iscoroutinefunction(handler) or (
        not inspect.isroutine(handler) and inspect.iscoroutinefunction(call)
    ):
        raise AsyncHandlerRefused(_said(handler))
    if inspect.isasyncgenfunction(handler):
        raise AsyncHandlerRefused(_said(handler))


def sync_result(returned: Any, handler: object) -> Any:
    """What a sync inbox's handler returned, unless it is an awaitable (an async function
    behind a lambda or a wrapper): that is closed unrun and refused."""
    if returned is None or type(returned) in _PLAIN:
        return returned
    if inspect.iscoroutine(returned):
        returned.close()  # never run: no "coroutine was never awaited" warning either
        raise AsyncHandlerRefused(_said(handler, returned=True))
    if inspect.isawaitable(returned) or inspect.isasyncgen(returned):
        raise AsyncHandlerRefused(_said(handler, returned=True))
    return returned


def _said(handler: object, *, returned: bool = False) -> str:
    name = getattr(handler, "__qualname__", None) or type(handler).__name__
    what = "returned an awaitable (an async function behind it)" if returned else "is async"
    return (
        f"the handler {name} {what}: a sync oncely.Inbox cannot run it (it would be recorded "
        "as done without running); use oncely.AsyncInbox, or a plain function"
    )

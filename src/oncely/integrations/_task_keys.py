"""How a task integration (Celery, Dramatiq, taskiq) finds a message's key: the one the
producer named on purpose, else the task's key function of its arguments. One rule for all
of them, so no integration reads a framework's own minted message id as the key. What a
duplicate answers: the first result as the task returned it. And how a key shows in a line
the integration logs: as the inbox shows it."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any, Literal, cast

from oncely._core.inbox_rules import result_lost
from oncely._core.observe import key_for_logs, redact_keys
from oncely._core.outcomes import Handled
from oncely._core.typed import ANNOTATED, result_type, reviver
from oncely.errors import ResultUnavailable
from oncely.wire import printable

__all__ = ["SENT", "Keyer", "first_result", "shown_key", "shown_text", "task_key"]

SENT = "sent"
"""``idempotency_key="sent"``: the key is the one the producer gave (``send_with_key``)."""

Keyer = Callable[..., str | None]


def task_key(
    keyer: Keyer | str | None, given: object, args: tuple[Any, ...], kwargs: Mapping[str, Any]
) -> str | None:
    """The key of one task message: ``given`` (what the producer's ``send_with_key`` put on
    it, or ``None``) wins; with ``keyer == "sent"`` nothing else counts; otherwise
    ``keyer(*args, **kwargs)``. Raises ``TypeError`` for a keyer that is neither."""
    if keyer == SENT:
        return given if isinstance(given, str) else None
    if given is not None:
        return str(given)
    if not callable(keyer):
        raise TypeError(f"idempotency_key is a function of the arguments or {SENT!r}")
    return keyer(*args, **kwargs)


def shown_key(key: str, log_keys: Literal["plain", "hash"]) -> str:
    """``key`` as a line an integration logs (or a reason it gives) may say it: as the
    inbox's own lines show it (its digest with ``log_keys="hash"``: a key that is personal
    data stays out of every line), escaped."""
    return printable(key_for_logs(key, log_keys) or "")


def shown_text(text: str, key: str | None, log_keys: Literal["plain", "hash"]) -> str:
    """``text`` (a reason, an error's words) for a line an integration logs: ``key`` in it
    shown as the inbox's own lines show it (a store's error, a task's refusal may name it).
    The dead letter's own reason keeps the text as it is: it travels with the message, whose
    key is in it anyway."""
    return redact_keys(text, (key,), log_keys)


def first_result(
    handled: Handled[Any],
    fn: Callable[..., Any],
    task: str,
    log_keys: Literal["plain", "hash"] = "plain",
) -> Any:
    """A duplicate's value: the first result, rebuilt as ``fn``'s return annotation (a
    ``datetime``, a ``Decimal``, a dataclass...; the stored form where there is none, or
    where it does not fit). :class:`~oncely.ResultUnavailable` when the first result was not
    kept (over ``max_result_bytes``, or not encodable): never a ``None`` a caller would take
    for the result; its words show the key as ``log_keys`` does (the inbox's)."""
    value = handled.value
    if value is None:
        if result_lost(handled.reason):
            shown = shown_key(handled.key or "", log_keys)
            raise ResultUnavailable(
                f"task {task} ran for {shown!r} before, but its result is not there to "
                f"return ({handled.reason}); it is not run again",
                cast("Handled[object]", handled),
            )
        return None
    try:
        return _converter(fn)(value)
    except Exception:  # the stored form, as a task with no annotation gets it
        return value


@functools.lru_cache(maxsize=1024)
def _converter(fn: Callable[..., Any]) -> Callable[[Any], Any]:
    return reviver(result_type(fn, ANNOTATED))

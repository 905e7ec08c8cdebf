"""How a task integration (Celery, Dramatiq, taskiq) finds a message's key: the one the
producer named on purpose, else the task's key function of its arguments. One rule for all
of them, so no integration reads a framework's own minted message id as the key."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["SENT", "Keyer", "task_key"]

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

"""How an error is put in words, in reasons, logs and the command line's messages."""

from __future__ import annotations

__all__ = ["said"]


def said(exc: BaseException) -> str:
    """``Name: text`` of ``exc``; its name alone when it has no text (a ``TimeoutError()``
    would otherwise read ``TimeoutError: ``), and its text alone when that names it already
    (aiokafka's errors do)."""
    name, text = type(exc).__name__, str(exc)
    if not text:
        return name
    return text if text.startswith(name) else f"{name}: {text}"

"""Hand-written: callable types of the sync API (twin: ``_async/_types.py``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import ParamSpec, TypeVar

__all__ = ["Function", "Handler", "TxHandler"]

P = TypeVar("P")
R = TypeVar("R")
Tx = TypeVar("Tx")
PS = ParamSpec("PS")

Handler = Callable[[P], R]
"""A two-phase handler: ``def handler(payload) -> result``."""

TxHandler = Callable[[Tx, P], R]
"""A transactional handler: ``def handler(transaction, payload) -> result``."""

Function = Callable[PS, R]
"""A function made idempotent by ``Inbox.idempotent``."""

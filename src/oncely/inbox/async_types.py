"""The callable types of the inbox's API (the sync twin drops ``Awaitable``)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import ParamSpec, TypeVar

__all__ = ["AsyncFunction", "AsyncHandler", "AsyncTxHandler"]

P = TypeVar("P")
R = TypeVar("R")
Tx = TypeVar("Tx")
PS = ParamSpec("PS")

AsyncHandler = Callable[[P], Awaitable[R]]
"""A two-phase handler: ``async def handler(payload) -> result``."""

AsyncTxHandler = Callable[[Tx, P], Awaitable[R]]
"""A transactional handler: ``async def handler(transaction, payload) -> result``."""

AsyncFunction = Callable[PS, Awaitable[R]]
"""A function made idempotent by ``Inbox.idempotent``."""

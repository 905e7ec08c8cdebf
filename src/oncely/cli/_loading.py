"""Import the user's code named on the command line as ``module:attribute``."""

from __future__ import annotations

import asyncio
import importlib
import inspect
import os
import sys
from collections.abc import Awaitable, Callable
from typing import Any

from oncely import Resolution, StaleClaim
from oncely.cli._errors import USAGE, CliError

__all__ = ["Reconciler", "load_attribute", "load_hooks", "load_reconciler"]


def load_attribute(spec: str, option: str) -> Any:
    """The object named by ``module:name`` (``package.module:object.method``), imported as
    ``python -m`` would (the working directory on the path). ``option`` names the flag in
    the errors (``--handler``)."""
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise CliError(f"{option} {spec!r}: write it as module:function", USAGE)
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # as `python -m` would: the project's own modules
    try:
        target: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise CliError(f"{option} {spec!r}: cannot import {module_name!r} ({exc})", USAGE) from None
    except Exception as exc:  # the module's own code failed (a setting it reads, say)
        raise CliError(
            f"{option} {spec!r}: importing {module_name!r} raised {type(exc).__name__}: {exc}",
            USAGE,
        ) from None
    for name in attribute.split("."):
        try:
            target = getattr(target, name)
        except AttributeError:
            raise CliError(
                f"{option} {spec!r}: {module_name} has no {attribute!r}", USAGE
            ) from None
    return target


class Reconciler:
    """A reconciler named by ``--reconciler MODULE:FUNCTION`` (``def`` or ``async def``), for
    a synchronous or an asynchronous inbox."""

    def __init__(self, spec: str) -> None:
        target = load_attribute(spec, "--reconciler")
        if not callable(target):
            raise CliError(f"--reconciler {spec!r} is not callable", USAGE)
        self.spec = spec
        self._target: Callable[[StaleClaim], Any] = target
        self._coroutine = inspect.iscoroutinefunction(target)

    def sync(self) -> Callable[[StaleClaim], Resolution]:
        """For an :class:`~oncely.Inbox`: an ``async def`` runs to its end in a loop of its
        own (the inbox calls it from a thread with none running)."""
        target = self._target
        if not self._coroutine:
            return target

        def run(stale: StaleClaim) -> Resolution:
            return asyncio.run(target(stale))  # type: ignore[no-any-return]

        return run

    def asynchronous(self) -> Callable[[StaleClaim], Awaitable[Resolution]]:
        """For an :class:`~oncely.AsyncInbox`: a plain ``def`` runs in a worker thread, so a
        reconciler that asks an external system over a blocking client does not stall the
        consumer's event loop."""
        target = self._target
        if self._coroutine:
            return target

        async def run(stale: StaleClaim) -> Resolution:
            return await asyncio.to_thread(target, stale)

        return run


def load_reconciler(spec: str | None) -> Reconciler | None:
    """The reconciler ``--reconciler`` names, or None when it is not given."""
    return None if spec is None else Reconciler(spec)


def load_hooks(specs: tuple[str, ...]) -> tuple[Callable[[Any], None], ...]:
    """The hooks ``--hook MODULE:FUNCTION`` names: plain functions, called with every
    outcome (an ``async def`` would never run, so it is refused)."""
    hooks = []
    for spec in specs:
        target = load_attribute(spec, "--hook")
        if not callable(target):
            raise CliError(f"--hook {spec!r} is not callable", USAGE)
        if inspect.iscoroutinefunction(target):
            raise CliError(
                f"--hook {spec!r} must be a plain def: it is called with every outcome and "
                "must return at once (an async def would never run)",
                USAGE,
            )
        hooks.append(target)
    return tuple(hooks)

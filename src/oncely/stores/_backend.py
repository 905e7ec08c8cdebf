"""How a store is found from its URL: a backend per scheme, registered by entry point.

A backend is any object with ``open(url, *, clock=None)`` (a :class:`~oncely.Store`) and
``open_async(url, *, clock=None)`` (an :class:`~oncely.AsyncStore`). Packages register theirs
under the entry-point group ``oncely.stores``, the scheme as the name::

    [project.entry-points."oncely.stores"]
    shelf = "my_package.shelf:backend"

oncely registers its own stores the same way (see ``pyproject.toml``), so a store published as
a separate package works with :func:`oncely.open` and the command line with no change to
oncely. :class:`Backend` is the usual way to write one: two ``"module:Class"`` names whose
classes have a ``from_url(url, *, clock=None)``, imported only when the scheme is used.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Protocol, cast

from oncely._urls import redact, split
from oncely.errors import ConfigurationError

if TYPE_CHECKING:
    from oncely._core.clock import Clock
    from oncely.stores.async_protocols import AsyncStore
    from oncely.stores.sync_protocols import Store

__all__ = ["ENTRY_POINT_GROUP", "Backend", "StoreBackend", "backend_for", "schemes"]

ENTRY_POINT_GROUP = "oncely.stores"


class StoreBackend(Protocol):
    """What an ``oncely.stores`` entry point names: the stores of one URL scheme."""

    def open(self, url: str, *, clock: Clock | None = None) -> Store:
        """A synchronous store for ``url``."""
        ...

    def open_async(self, url: str, *, clock: Clock | None = None) -> AsyncStore:
        """An asyncio store for ``url``."""
        ...


class _FromUrl(Protocol):
    def from_url(self, url: str, *, clock: Clock | None = None) -> object: ...


@dataclass(frozen=True, slots=True)
class Backend:
    """A backend whose two store classes are imported on first use: ``sync`` and ``async_``
    are ``"module:Class"``; a driver that is not installed is reported with the extra that
    installs it (``pip install 'oncely[<extra>]'``)."""

    name: str
    sync: str
    async_: str
    extra: str = ""
    schemes: tuple[str, ...] = ()
    """The URL schemes it serves; read for oncely's own stores (a package's entry point
    names its scheme instead)."""

    def open(self, url: str, *, clock: Clock | None = None) -> Store:
        return cast("Store", self._load(self.sync, url).from_url(url, clock=clock))

    def open_async(self, url: str, *, clock: Clock | None = None) -> AsyncStore:
        return cast("AsyncStore", self._load(self.async_, url).from_url(url, clock=clock))

    def load(self, target: str) -> object:
        """The class ``target`` names (``"module:Class"``), or :class:`ImportError` naming the
        extra to install when its driver is missing."""
        module_name, _, class_name = target.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name is None or exc.name.startswith("oncely"):
                raise
            hint = f": pip install 'oncely[{self.extra}]'" if self.extra else ""
            raise ImportError(
                f"the {self.name} store needs the {exc.name!r} package{hint}", name=exc.name
            ) from exc
        return getattr(module, class_name)

    def module_getattr(self, module: str) -> Callable[[str], object]:
        """A module ``__getattr__`` for a store package: its two classes, imported on first
        use (so importing the package needs no driver)."""
        targets = {target.partition(":")[2]: target for target in (self.sync, self.async_)}

        def attribute(name: str) -> object:
            target = targets.get(name)
            if target is None:
                raise AttributeError(f"module {module!r} has no attribute {name!r}")
            return self.load(target)

        return attribute

    def _load(self, target: str, url: str) -> _FromUrl:
        try:
            return cast(_FromUrl, self.load(target))
        except ImportError as exc:
            raise ConfigurationError(f"{redact(url)}: {exc}") from None


@functools.cache
def built_in() -> Mapping[str, str]:
    """oncely's own stores by scheme, read from the store folders themselves (each package
    of ``oncely.stores`` names its ``backend`` and that backend's schemes): what
    ``pyproject.toml`` registers as entry points, and what is used without installed metadata.
    They come first: a package cannot take one of their schemes over."""
    import oncely.stores  # noqa: PLC0415 - this module is imported by it

    found: dict[str, str] = {}
    for info in pkgutil.iter_modules(oncely.stores.__path__, "oncely.stores."):
        if not info.ispkg:
            continue
        backend = getattr(importlib.import_module(info.name), "backend", None)
        if isinstance(backend, Backend):
            found.update(dict.fromkeys(backend.schemes, f"{info.name}:backend"))
    return found


def _registered() -> dict[str, str]:
    own = built_in()
    found = dict(own)
    for entry in entry_points(group=ENTRY_POINT_GROUP):
        scheme = entry.name.lower()
        if scheme not in own:  # oncely's own (its metadata), or a package taking one over
            found.setdefault(scheme, entry.value)
    return found


def schemes() -> tuple[str, ...]:
    """Every URL scheme a store is registered for, oncely's and other packages'."""
    return tuple(sorted(_registered()))


def backend_for(url: str) -> StoreBackend:
    """The backend registered for ``url``'s scheme, or :class:`~oncely.ConfigurationError`
    naming the schemes there are."""
    scheme = split(url).scheme.lower()
    registered = _registered()
    target = registered.get(scheme)
    if target is None:
        raise ConfigurationError(
            f"{redact(url)}: unsupported store URL scheme {scheme!r}; supported: "
            + ", ".join(f"{s}://" for s in sorted(registered))
            + " (a package adds one with an 'oncely.stores' entry point)"
        )
    module_name, _, attribute = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise ConfigurationError(
            f"{redact(url)}: the store registered for {scheme}:// ({target}) cannot be "
            f"imported: {exc}"
        ) from None
    return cast(StoreBackend, getattr(module, attribute))

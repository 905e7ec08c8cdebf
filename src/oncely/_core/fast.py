"""What the core does only for speed, in one place.

**Building frozen dataclasses.** Every message makes a few frozen value objects (a
:class:`~oncely.stores.Record` per claim in the stores that read rows, a
:class:`~oncely.stores.Claim`, a :class:`~oncely._core.state.ClaimEvent` in the stores that
decide in Python, a :class:`~oncely.Handled` per outcome). A frozen dataclass's ``__init__``
sets each field through ``object.__setattr__``, which costs several times a plain attribute
store. :func:`frozen_builder` makes, once per class, a function that fills a twin class of the
same slot layout by plain assignment and then swaps the object's ``__class__`` (CPython allows
that between classes of identical layout; a layout that drifted would raise ``TypeError`` on the
first call). The result is the same object: type, equality, hash, repr and immutability.

Measured on CPython 3.11 (``python bench/core_case.py`` prints the core path's total):

=============  ==================  ================
object         the dataclass call  frozen_builder
=============  ==================  ================
``Record``     1.6 us (12 fields)  0.25 us
``Claim``      0.53 us             0.36 us
``Handled``    1.41 us             0.30 us
=============  ==================  ================

``tests/core/test_hot_path.py`` checks each builder gives an object equal to the dataclass's
own, with the same signature.

**The other tricks, by layer**, each with its measurement where it lives:

* the observer's level table is keyed by the outcome's text (``_core/outcomes.py``): a ``str``
  hashes faster than an enum member;
* the inbox (``inbox/async_inbox.py``) reads its configuration from its own slots, and builds
  the ``processed`` outcome through :meth:`~oncely._core.inbox_rules.InboxRules.processed`,
  which logs only when a hook or the log level asks for it;
* each store's claim and fenced writes are tuned per driver in its ``async_store.py``; the rule
  they apply is :func:`oncely._core.state.claimable`;
* the JSON codec decodes a stored object without ``json.loads``'s encoding guess
  (``_core/codec.py``);
* the Redis store packs ``EVALSHA`` by a format per call shape
  (``stores/redis/errors.py``), runs an exchange's first attempt outside redis-py's retry
  wrapper (``stores/redis/async_io.py``), and reads
  an existing record in a claim reply and escapes record names without the general case's
  calls (``stores/redis/dialect.py``);
* the HTTP middleware answers a replay and reads a one-message body without helper
  coroutines (``http.py``).

The HTTP replay path on Redis in process (``python bench/web.py --variant oncely-redis
--in-process 5000 --in-flight 16``) runs about 7.7% fewer instructions with the last four of
these (322k per replay instead of 349k, counted under ``valgrind --tool=callgrind`` one
request at a time).
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["frozen_builder"]

T = TypeVar("T")


def frozen_builder(cls: type[T]) -> Callable[..., T]:
    """A function with ``cls``'s fields as parameters (in order, with their defaults) that
    returns ``cls(...)`` built by assignment into a same-layout twin (see the module doc)."""
    slots: tuple[str, ...] | None = getattr(cls, "__slots__", None)
    if not dataclasses.is_dataclass(cls) or slots is None:
        raise TypeError(f"{cls.__name__} is not a slotted dataclass")
    fields = dataclasses.fields(cls)
    names = [f.name for f in fields]
    if tuple(names) != tuple(slots):
        raise TypeError(f"{cls.__name__}'s slots are not its fields in order")
    # The same bases (a generic class's as written, Generic[R]) and the same slots.
    twin = types.new_class(
        f"_{cls.__name__}Twin",
        getattr(cls, "__orig_bases__", cls.__bases__),
        exec_body=lambda ns: ns.update(__slots__=slots),
    )
    defaults: dict[str, Any] = {}
    params = []
    for f in fields:
        if f.default is not dataclasses.MISSING:
            defaults[f"_d_{f.name}"] = f.default
            params.append(f"{f.name}=_d_{f.name}")
        elif f.default_factory is not dataclasses.MISSING:
            raise TypeError(f"{cls.__name__}.{f.name} has a default factory")
        else:
            params.append(f.name)
    body = "".join(f"    o.{name} = {name}\n" for name in names)
    source = (
        f"def new_{cls.__name__.lower()}({', '.join(params)}):\n"
        "    o = _twin()\n"
        f"{body}"
        "    o.__class__ = _cls\n"
        "    return o\n"
    )
    namespace: dict[str, Any] = {"_twin": twin, "_cls": cls, **defaults}
    exec(compile(source, f"<frozen_builder {cls.__name__}>", "exec"), namespace)
    built: Callable[..., T] = namespace[f"new_{cls.__name__.lower()}"]
    built.__doc__ = f"``{cls.__name__}(...)``, built by :func:`oncely._core.fast.frozen_builder`."
    built.__module__ = cls.__module__
    built.__qualname__ = built.__name__
    return built

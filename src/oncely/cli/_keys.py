"""KEY as the operator commands take it: the key as a message carries it, found as stored.

A consumer with ``--hash-long-keys`` (``Limits(hash_long_keys=True)``) stores a key over its
``--max-key-bytes`` as ``sha256:<hex>`` (:func:`oncely.keys.hashed_key`). The commands that
name one record (``inbox show``, ``forget``, ``resolve``) look KEY up as given, then in that
hashed form, so an operator holding the key from a message or a log finds its record whatever
the consumer's limit was; ``--hashed`` or ``--as-given`` says which form to use instead (also
for ``resolve --create``, which writes a record that has none). The stored form (as
``inbox list`` prints it) is found as given.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Final, TypeVar

import click

from oncely import Record, Store
from oncely.keys import hashed_key

__all__ = [
    "DEFAULT_LIMIT",
    "LONGEST_KEY",
    "Located",
    "absent_why",
    "ambiguous",
    "key_argument",
    "key_form_option",
    "locate",
    "shown_key",
]

LONGEST_KEY: Final = 4096
"""The largest ``max_key_bytes`` a consumer can have: no key longer is stored as given."""

SMALLEST_LIMIT: Final = 16
"""The smallest ``max_key_bytes``: no key this short is ever stored hashed."""

F = TypeVar("F", bound=Callable[..., object])


def _non_empty(_ctx: click.Context, _param: click.Parameter, key: str) -> str:
    if not key:
        # A shell variable that was not set: no message carries an empty key (R2).
        raise click.BadParameter("is empty; give the key as the message carries it")
    return key


def key_argument(fn: F) -> F:
    """The KEY argument of the commands that name one record: never empty."""
    return click.argument("key", callback=_non_empty)(fn)


DEFAULT_LIMIT: Final = 512
"""A consumer's ``max_key_bytes`` unless it set one (``oncely consume --max-key-bytes``)."""


def key_form_option(fn: F) -> F:
    """``--hashed/--as-given``: which stored form KEY names (default: the one that exists)."""
    return click.option(
        "--hashed/--as-given",
        "hashed",
        default=None,
        help="KEY is stored as its SHA-256 (`sha256:...`: a consumer with --hash-long-keys "
        "took it over its --max-key-bytes), or as given. Default: look KEY up as given, then "
        "hashed.",
    )(fn)


@dataclass(frozen=True, slots=True)
class Located:
    """Where KEY's record is: ``stored`` is the key as stored (``key`` itself, or its
    hashed form), ``record`` the record (``None``: neither form has one)."""

    key: str
    stored: str
    record: Record | None

    @property
    def hashed(self) -> bool:
        return self.stored != self.key


def _size(key: str) -> int | None:
    try:
        return len(key.encode("utf-8"))
    except UnicodeEncodeError:  # not UTF-8 (bytes the shell passed): never stored hashed
        return None


def forms(key: str, hashed: bool | None) -> list[str]:
    """The stored forms KEY may have, in the order they are looked up."""
    size = _size(key)
    if hashed is False or size is None:
        return [key]
    if hashed:
        return [hashed_key(key)]
    found = [key] if size <= LONGEST_KEY else []
    if size > SMALLEST_LIMIT:
        found.append(hashed_key(key))
    return found


def locate(store: Store, consumer: str, key: str, hashed: bool | None) -> Located:
    """KEY's record in the first stored form that has one; else (``record`` None) the form
    a record for KEY would be written in: the only one possible, or as given."""
    candidates = forms(key, hashed)
    for stored in candidates:
        record = store.get(consumer, stored)
        if record is not None:
            return Located(key, stored, record)
    return Located(key, candidates[0] if len(candidates) == 1 else key, None)


def ambiguous(key: str, hashed: bool | None) -> bool:
    """Whether a record for KEY could be stored either way by a consumer of the default limit
    or above: over that limit, up to the largest, and no form was chosen."""
    size = _size(key)
    return hashed is None and size is not None and DEFAULT_LIMIT < size <= LONGEST_KEY


def shown_key(found: Located) -> str:
    """KEY for a message: as stored, saying when that is the hash of the key given."""
    if found.hashed:
        return f"{found.stored!r} (the SHA-256 of the {_size(found.key)}-byte key given)"
    return repr(found.key)


def absent_why(store: Store, consumer: str) -> str:
    """Why a record may be absent, for the message that says so: a consumer with no live
    record at all is more likely a misspelt name (or the wrong --store) than a key never
    processed."""
    if store.scan(consumer=consumer, limit=1):
        return "never processed, forgotten, or expired"
    return (
        f"consumer {consumer!r} has no live record at all in this store: check its name with "
        "`oncely inbox stats`, and the --store"
    )

"""Identifier checks for names that are spliced into SQL (tables, schemas)."""

from __future__ import annotations

import re

from oncely.errors import InvalidIdentifier

__all__ = ["check_identifier"]

_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,62}")


def check_identifier(name: str) -> str:
    """``name`` if it is a plain SQL identifier (letters, digits, underscores; at most 63
    characters, PostgreSQL's limit), else :class:`~oncely.InvalidIdentifier`. Names are
    spliced into statements, so nothing else is accepted, quoted or not."""
    if not isinstance(name, str) or not _IDENTIFIER.fullmatch(name):
        raise InvalidIdentifier(
            f"{name!r} is not a plain identifier: use letters, digits and underscores, "
            "starting with a letter or underscore, at most 63 characters"
        )
    return name

"""Durations on the command line: ``30s``, ``5m``, ``2h``, ``3d``, ``1d12h``, ``250ms``.

The grammar is strict on purpose, because a retention typed wrong deletes records early (R13):
one or more ``<whole number><unit>`` parts with units from ``d``, ``h``, ``m``, ``s``, ``ms``,
each unit at most once and from largest to smallest, lower case, no spaces, no sign, no
fractions and no bare numbers (is ``30`` seconds or minutes?). It is the inverse of
:func:`oncely.format_duration`.
"""

from __future__ import annotations

import re
from datetime import timedelta
from typing import TYPE_CHECKING, Final

import click

if TYPE_CHECKING:
    _ParamType = click.ParamType[timedelta, object]
else:  # click before 8.3 has no type parameters on ParamType
    _ParamType = click.ParamType

__all__ = ["EXAMPLES", "Duration", "parse_duration"]

EXAMPLES: Final = "30s, 5m, 2h, 3d, 1d12h or 250ms"

_UNITS: Final = {"d": 86_400_000, "h": 3_600_000, "m": 60_000, "s": 1000, "ms": 1}
_ORDER: Final = tuple(_UNITS)
# "ms" before "m" so that "250ms" is one part, not "250m" followed by garbage.
_PART: Final = re.compile(r"([0-9]+)(ms|d|h|m|s)")
_MAX_DIGITS: Final = 12


def parse_duration(text: str) -> timedelta:
    """``text`` as a ``timedelta``; raises ``ValueError`` saying what is wrong with it."""
    if not text:
        raise ValueError(f"an empty duration; write e.g. {EXAMPLES}")
    total_ms = 0
    position = 0
    last_unit = -1
    while position < len(text):
        match = _PART.match(text, position)
        if match is None:
            raise ValueError(f"{text!r} is not a duration; write e.g. {EXAMPLES}")
        digits, unit = match.groups()
        rank = _ORDER.index(unit)
        if rank <= last_unit:
            raise ValueError(
                f"{text!r}: give each unit once, from largest to smallest (d, h, m, s, ms)"
            )
        if len(digits) > _MAX_DIGITS:
            raise ValueError(f"{text!r} is too long a duration")
        last_unit = rank
        total_ms += int(digits) * _UNITS[unit]
        position = match.end()
    try:
        return timedelta(milliseconds=total_ms)
    except OverflowError:
        raise ValueError(f"{text!r} is too long a duration") from None


class Duration(_ParamType):
    """A click parameter type for :func:`parse_duration` (a bad value is a usage error)."""

    name = "duration"

    def convert(
        self, value: object, param: click.Parameter | None, ctx: click.Context | None
    ) -> timedelta:
        if isinstance(value, timedelta):
            return value
        try:
            return parse_duration(str(value))
        except ValueError as exc:
            self.fail(str(exc), param, ctx)

    def get_metavar(self, param: click.Parameter, ctx: click.Context | None = None) -> str:
        return "DURATION"

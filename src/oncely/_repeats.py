"""One logging filter for client libraries that say the same thing at every retry: a broker
that is down, a host name that does not resolve."""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable

__all__ = ["Repeats"]


def _by_template(record: logging.LogRecord) -> Hashable:
    return (record.name, record.msg)


class Repeats(logging.Filter):
    """Lets one record of a kind through per ``window`` seconds; the next one through says how
    many were held back. A kind is the logger and the message template by default, or what
    ``kind`` makes of a record (for a library that formats its lines itself)."""

    def __init__(
        self, window: float = 30.0, kind: Callable[[logging.LogRecord], Hashable] = _by_template
    ) -> None:
        super().__init__()
        self.window = window
        self._kind = kind
        self._seen: dict[Hashable, tuple[float, int]] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        kind = self._kind(record)
        last, held = self._seen.get(kind, (float("-inf"), 0))
        if record.created - last < self.window:
            self._seen[kind] = (last, held + 1)
            return False
        if len(self._seen) > 1000:
            self._seen.clear()
        self._seen[kind] = (record.created, 0)
        if held:
            record.msg = f"{record.msg} ({held} more like it in the last {self.window:.0f}s)"
        return True

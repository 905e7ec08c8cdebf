"""ETL and stream checkpoints: units of work keyed by their source identity, and a high-water
mark kept in the same transaction as a unit's writes.

::

    from oncely.etl import Checkpoint, file_unit

    inbox = oncely.Inbox(oncely.open("postgresql://..."), consumer="loader")
    for path in sorted(incoming.glob("*.csv")):              # re-fed files are skipped
        inbox.handle_in_transaction(file_unit(path), {"file": path.name}, load)

    mark = Checkpoint(inbox, "clicks.log")                   # a source read by offsets
    start = mark.position()                                  # where the last run got to
    for first, last, rows in chunks_of(source, start):
        mark.apply(first, last, rows, write_rows)            # rows and mark commit together

A unit's key is what the source says it is (:func:`file_unit`: the file's name and the SHA-256
of its content; :func:`range_unit`: a stream and an offset range), never when or how often it
was fed, so a file delivered twice, or a run restarted after a crash, applies each unit once
(R19). :class:`Checkpoint` adds the resume point: in the transactional mode its
:meth:`~Checkpoint.apply` writes the unit's rows, its marker and the new high-water mark in one
transaction, so after a ``SIGKILL`` the next run starts exactly past the last committed unit.
The mark is kept in the store's offsets table (``<inbox table>_offsets``, the one Kafka's
``store_offsets`` uses), on the SQL stores.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from oncely._core.outcomes import Handled
from oncely.errors import ConfigurationError
from oncely.inbox.sync_inbox import Inbox
from oncely.stores.sync_protocols import KeepsOffsets, TransactionalStore

__all__ = ["Checkpoint", "file_unit", "range_unit"]

R = TypeVar("R")
_CHUNK = 1 << 20


def file_unit(path: str | os.PathLike[str], *, name: str | None = None) -> str:
    """The key of a file as a unit of work: ``file:<name>:sha256:<digest of its content>``
    (``name`` defaults to the file's name). The same file fed again is the same unit; a file
    of the same name with other content is another."""
    digest = hashlib.sha256()
    with open(path, "rb") as source:
        while chunk := source.read(_CHUNK):
            digest.update(chunk)
    shown = name if name is not None else Path(path).name
    return f"file:{shown}:sha256:{digest.hexdigest()}"


def range_unit(stream: str, first: int, last: int) -> str:
    """The key of the offsets ``first`` (included) to ``last`` (excluded) of ``stream``."""
    if first < 0 or last <= first:
        raise ConfigurationError("a range unit is first < last, both not negative")
    return f"range:{stream}:{first}-{last}"


class Checkpoint:
    """The high-water mark of ``stream`` for ``inbox``'s consumer, kept with each unit's
    writes (a SQL store: the offsets table beside the inbox)."""

    def __init__(self, inbox: Inbox, stream: str) -> None:
        store = inbox.store
        if not isinstance(store, TransactionalStore) or not isinstance(store, KeepsOffsets):
            raise ConfigurationError(
                f"{type(store).__name__} keeps no checkpoints: use a SQL store (PostgreSQL, "
                "MariaDB/MySQL, SQLite)"
            )
        self.inbox = inbox
        self.stream = stream
        self._store: Any = store
        self._store.prepare_offsets()

    def position(self) -> int:
        """Where the next run starts: one past the last unit applied (0 at first)."""
        return int(self._store.offsets(self.inbox.consumer, self.stream).get(0, 0))

    def apply(
        self,
        first: int,
        last: int,
        payload: object,
        handler: Callable[[Any, Any], R],
    ) -> Handled[R]:
        """Apply the unit ``[first, last)`` of the stream: ``handler(tx, payload)``, its
        marker (:func:`range_unit`) and the mark moved to ``last``, in one transaction. A
        unit applied before is a ``duplicate`` (its handler does not run). A unit whose
        handler raises leaves the mark where it was: a failed one runs again on the next run,
        a rejected one (:class:`~oncely.Reject`) is answered ``rejected`` at once each time,
        so the mark never passes a unit that was not applied."""
        inbox = self.inbox
        store = self._store
        consumer, stream = inbox.consumer, self.stream

        def run(tx: Any, data: Any) -> R:
            store.save_offset_in(tx, consumer, stream, 0, last)
            return handler(tx, data)

        return inbox.handle_in_transaction(range_unit(stream, first, last), payload, run)

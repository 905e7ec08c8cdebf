"""ETL and stream checkpoints: units of work keyed by their source identity, and a high-water
mark kept in the same transaction as a unit's writes.

::

    from oncely.etl import Checkpoint, file_unit

    inbox = oncely.Inbox(oncely.open("postgresql://..."), consumer="loader")
    for path in sorted(incoming.glob("*.csv")):     # re-fed files are skipped (while kept)
        inbox.handle_in_transaction(
            file_unit(path), {"file": path.name}, lambda tx, _unit: load(tx, path)
        )

    mark = Checkpoint(inbox, "clicks.log")                   # a source read by offsets
    start = mark.position()                                  # where the last run got to
    for first, last, rows in chunks_of(source, start):
        mark.apply(first, last, rows, write_rows)            # rows and mark commit together

A unit's key is what the source says it is (:func:`file_unit`: the file's name and the SHA-256
of its content; :func:`range_unit`: a stream and an offset range), never when or how often it
was fed, so a file delivered twice, or a run restarted after a crash, applies each unit once
(R19). The payload is fingerprinted with the key, so it names the unit as the key does (the
file's name, not the folder it was found in: the same file fed from another folder is then a
``duplicate``, not a ``key_conflict``); the handler gets what it loads from its caller: the
bytes :func:`file_contents` read and keyed, or the path of a file that is complete.

A file unit is skipped only while the inbox keeps its record (its ``Retention.keep``, 7 days
by default, R13): a file fed again after that is loaded again. Move a loaded file out of the
folder once its unit committed, or keep records longer than a file can come back. A
:class:`Checkpoint`'s mark never expires.

:class:`Checkpoint` adds the resume point: its :meth:`~Checkpoint.apply` writes the unit's
rows, its marker and the new high-water mark in one transaction, so after a ``SIGKILL`` the
next run starts exactly past the last committed unit. The mark, not the range's key, says
what was applied, so a source re-fed in other chunks loads no row twice: a range entirely at
or before the mark is a ``duplicate`` (nothing runs), a range that starts at the mark is
applied, and one that leaves a gap after the mark or straddles it is refused
(:class:`CheckpointMismatch`). Two runners applying at once take turns on the mark: the
second waits for the first's transaction, then compares its range with the mark the first
committed. The mark is kept in the store's offsets table (``<inbox table>_offsets``, the one
Kafka's ``store_offsets`` uses), on the SQL stores.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from pathlib import Path
from time import perf_counter
from typing import Any, TypeVar

from oncely._core.keys import validate_key
from oncely._core.outcomes import Handled, Outcome
from oncely._core.records import Status
from oncely.errors import ConfigurationError, InvalidKey, OncelyError, StoreError
from oncely.inbox.sync_inbox import Inbox
from oncely.stores._offsets import check_position
from oncely.stores.sync_protocols import KeepsOffsets, TransactionalStore
from oncely.stores.sync_sql import SQLStoreBase
from oncely.wire import describe_bytes

__all__ = [
    "Checkpoint",
    "CheckpointMismatch",
    "FileChanged",
    "file_contents",
    "file_unit",
    "range_unit",
]

R = TypeVar("R")
_CHUNK = 1 << 20
_LARGEST_OFFSET = 2**63 - 1
"""The largest mark the offsets table keeps (a signed 64-bit integer, as Kafka's offsets)."""


class FileChanged(OncelyError):
    """The file changed while it was read to be keyed (its size or modification time moved):
    it is still being written. Key it once it is complete (the writer renames it into the
    folder when done); nothing was run."""


def file_unit(path: str | os.PathLike[str], *, name: str | None = None) -> str:
    """The key of a file as a unit of work: ``file:<name>:sha256:<digest of its content>``
    (``name`` defaults to the file's name). The same file fed again is the same unit; a file
    of the same name with other content is another. Raises :class:`FileChanged` for a file
    that changed while it was read, and :class:`~oncely.InvalidKey` for a name that is not
    UTF-8 text (a file named on another system: ``caf\\xe9.csv`` in Latin-1) or holds a NUL,
    before reading: the inbox would refuse its key on every feed, so the file would never
    load; pass ``name=`` (the name as its writer meant it).

    The key is of the content read here: a handler that reads the file again must find the
    same content, so key only complete files (a writer renames them into the folder when
    done), or load what :func:`file_contents` read."""
    return _read(path, name, keep=False)[0]


def file_contents(path: str | os.PathLike[str], *, name: str | None = None) -> tuple[str, bytes]:
    """:func:`file_unit`'s key and the very bytes it is the digest of: load these, and the
    unit's key names exactly what was loaded, even if the file changes afterwards (a file
    still being written, keyed by its first part and loaded whole, would come back under a
    new key and load again)."""
    key, data = _read(path, name, keep=True)
    assert data is not None
    return key, data


def _read(
    path: str | os.PathLike[str], name: str | None, *, keep: bool
) -> tuple[str, bytes | None]:
    shown = _unit_name(path, name)
    digest = hashlib.sha256()
    kept: list[bytes] = []
    with open(path, "rb") as source:
        before = os.fstat(source.fileno())
        while chunk := source.read(_CHUNK):
            digest.update(chunk)
            if keep:
                kept.append(chunk)
        after = os.fstat(source.fileno())
    if (before.st_size, before.st_mtime_ns) != (after.st_size, after.st_mtime_ns):
        raise FileChanged(
            f"{os.fspath(path)!r} changed while it was read ({before.st_size} bytes, then "
            f"{after.st_size}): it is still being written; key it once it is complete"
        )
    return f"file:{shown}:sha256:{digest.hexdigest()}", b"".join(kept) if keep else None


def _unit_name(path: str | os.PathLike[str], name: str | None) -> str:
    """The name a file unit is keyed by, refused when no key can hold it: keys are lossless
    (R2), so a name whose bytes are not UTF-8 is never decoded by a guess (two files would
    become one unit) nor keyed as it is (the inbox refuses that key: ``rejected`` on every
    feed, and the file never loads)."""
    shown = name if name is not None else Path(path).name
    try:
        shown.encode("utf-8")
    except UnicodeEncodeError:
        problem = "is not UTF-8 text"
    else:
        if "\x00" not in shown:
            return shown
        problem = "holds a NUL"
    raise InvalidKey(
        f"the file name {describe_bytes(shown)} {problem}, so no key can name it: pass "
        "name= (the name as its writer meant it, e.g. its bytes decoded from their encoding)"
    )


def range_unit(stream: str, first: int, last: int) -> str:
    """The key of the offsets ``first`` (included) to ``last`` (excluded) of ``stream``."""
    for bound in (first, last):
        if not isinstance(bound, int) or isinstance(bound, bool):
            raise ConfigurationError(
                f"a range unit's bounds are whole offsets (int), not {bound!r}: "
                f"{type(bound).__name__} bounds would key one range two ways"
            )
    if first < 0 or last <= first:
        raise ConfigurationError("a range unit is first < last, both not negative")
    return f"range:{stream}:{first}-{last}"


class CheckpointMismatch(ConfigurationError):
    """A range given to :meth:`Checkpoint.apply` that does not start at the mark: it starts
    past it (the offsets between were never applied) or straddles it (its start was applied
    already). Nothing was written and the mark did not move: feed the source from
    :meth:`Checkpoint.position`. ``mark``, ``first`` and ``last`` say which."""

    def __init__(self, stream: str, mark: int, first: int, last: int) -> None:
        if first > mark:
            why = (
                f"starts past the mark {mark}: the offsets {mark} to {first - 1} were never applied"
            )
        else:
            why = f"straddles the mark {mark}: [{first}, {mark}) was applied already"
        super().__init__(
            f"the range [{first}, {last}) of {stream!r} {why}; nothing was written: feed the "
            "source from the mark (Checkpoint.position())"
        )
        self.stream = stream
        self.mark = mark
        self.first = first
        self.last = last

    def __reduce__(self) -> tuple[Any, ...]:
        # Made again from its fields: its message is not its constructor's argument (a
        # worker process's error reaches its parent, or a task result store, by pickle).
        return (type(self), (self.stream, self.mark, self.first, self.last))


def _check_stream(inbox: Inbox, stream: str) -> None:
    """Refuse a stream whose mark the offsets table cannot keep, or whose units' keys the
    inbox would reject (too long for its limits, a NUL, text that is not UTF-8): each
    :meth:`Checkpoint.apply` would otherwise fail, or be ``rejected`` with the mark never
    moving."""
    check_position(stream, 0, 0)
    try:
        validate_key(range_unit(stream, _LARGEST_OFFSET - 1, _LARGEST_OFFSET), inbox.limits)
    except InvalidKey as exc:
        raise ConfigurationError(
            f"the stream {stream!r} cannot be a checkpoint's: the key of its units ({exc})"
        ) from None


class Checkpoint:
    """The high-water mark of ``stream`` for ``inbox``'s consumer, kept with each unit's
    writes (a SQL store: the offsets table beside the inbox).

    A stream it cannot keep is refused here (:class:`~oncely.ConfigurationError`): a name
    empty or over 255 characters, or one that makes its units' keys unusable to the inbox
    (over its ``Limits.max_key_bytes``, a NUL, text that is not UTF-8). A unit ending past
    the largest offset kept (``2**63 - 1``) is refused by :meth:`apply` before anything
    runs."""

    def __init__(self, inbox: Inbox, stream: str) -> None:
        store = inbox.store
        if (
            not isinstance(store, TransactionalStore)
            or not isinstance(store, KeepsOffsets)
            or not isinstance(store, SQLStoreBase)
        ):
            raise ConfigurationError(
                f"{type(store).__name__} keeps no checkpoints: use a SQL store (PostgreSQL, "
                "MariaDB/MySQL, SQLite)"
            )
        _check_stream(inbox, stream)
        self.inbox = inbox
        self.stream = stream
        self._store: Any = store
        self._store.prepare_offsets()
        # The mark's row, committed before any apply locks it: on MariaDB, runners waiting
        # for a first apply's uncommitted insert of that row deadlock when it rolls back (its
        # runner killed), where a committed row is only ever updated, one runner at a time.
        # Written only where missing, so that making a checkpoint never waits for an apply.
        if 0 not in self._store.offsets(inbox.consumer, stream):
            with store.transaction() as tx:
                self._store.save_offset_in(tx, inbox.consumer, stream, 0, 0)

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
        marker (:func:`range_unit`) and the mark moved to ``last``, in one transaction.

        The range is compared with the mark inside that transaction, the mark's row locked
        (a concurrent :meth:`apply` of the stream waits until this one commits):

        * ``first`` at the mark: the unit is applied (``processed``);
        * ``last`` at or before the mark: a ``duplicate``, and the handler does not run.
          Re-fed with the bounds it was applied with, the unit gets the first result as
          ``value`` (or ``key_conflict`` for other content); with other bounds (the source
          re-read in other chunks) it was applied in other units, so ``value`` is ``None``
          and ``reason`` says so;
        * otherwise (a gap after the mark, or a range across it): :class:`CheckpointMismatch`
          is raised, and nothing is written.

        A unit whose handler raises leaves the mark where it was: a failed one runs again on
        the next run, a rejected one (:class:`~oncely.Reject`) is answered ``rejected`` at
        once each time, so the mark never passes a unit that was not applied."""
        started = perf_counter()
        inbox = self.inbox
        store = self._store
        consumer, stream = inbox.consumer, self.stream
        key = range_unit(stream, first, last)
        if last > _LARGEST_OFFSET:
            raise ConfigurationError(
                f"the range [{first}, {last}) of {stream!r} ends past the largest offset a "
                f"checkpoint keeps ({_LARGEST_OFFSET}, a signed 64-bit integer); nothing was "
                "written"
            )

        def run(tx: Any, data: Any) -> R:
            store.save_offset_in(tx, consumer, stream, 0, last)
            return handler(tx, data)

        with store.transaction() as tx:
            mark = self._mark_in(tx)
            if first == mark:
                return inbox.handle_in_transaction(key, payload, run, tx=tx)
            if last > mark:
                raise CheckpointMismatch(stream, mark, first, last)
        # Wholly at or before the mark, which never moves back: applied, as this very unit
        # (its marker answers, with its result) or in units of other bounds. A marker of
        # this range that is not a completed one (a rejected unit whose rows were then set
        # aside in other bounds) is no answer: the mark passed those rows all the same.
        found = inbox.get(key)
        if found is not None and found.status is Status.COMPLETED:

            def gone(_tx: Any, _data: Any) -> R:
                # The marker lapsed (retention) or was forgotten since it was read: the mark
                # is past the range all the same, so it is not applied again. ``failed``
                # here; the next feed of it is a duplicate.
                raise RuntimeError(
                    f"the marker of {key} ended as it was read, and the mark {mark} is past "
                    "it: not applied again"
                )

            return inbox.handle_in_transaction(key, payload, gone)
        reason = (
            f"the range [{first}, {last}) of {stream!r} is at or before the mark {mark}: "
            "applied before, in units of other bounds; not applied again"
        )
        # The inbox's own outcome builder: logged and counted as every duplicate is (R16).
        return inbox._rules.done(Outcome.DUPLICATE, key, started, None, reason)

    def _mark_in(self, tx: Any) -> int:
        """The mark as ``tx`` sees it, its row locked first by a write that leaves it as it
        is (inserted as 0 where missing): another transaction moving it commits before this
        read, or waits until ``tx`` ends."""
        store = self._store
        consumer, stream = self.inbox.consumer, self.stream
        store.save_offset_in(tx, consumer, stream, 0, 0)
        # The offsets table's own read (the store's dialect), on ``tx``: every SQL store's
        # transaction is a DB-API connection (sqlite3, psycopg, PyMySQL).
        statements = store._offset_sql
        try:
            cursor = tx.cursor()
            try:
                cursor.execute(statements.read, statements.params(consumer, stream))
                rows = cursor.fetchall()
            finally:
                cursor.close()
        except OncelyError:
            raise
        except Exception as exc:  # the driver's: translated, as every store does
            raise StoreError(f"reading the checkpoint of {stream!r}: {exc}") from exc
        return next((int(offset) for part, offset in rows if int(part) == 0), 0)

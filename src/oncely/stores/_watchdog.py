"""The process's one watchdog over the SQL stores' statements: a statement on a connection a
store holds alone, outside a transaction, gets its answer within the store's ``read_timeout``
or its connection is cut.

Neither psycopg nor aiomysql has a client-side timeout on a statement (PyMySQL's own
``read_timeout`` would cut a transaction's lock waits too, see the MariaDB/MySQL store), and a
server gone silent behind a dead route (no reset, no refusal: the kernel's TCP timeouts take
many minutes, or never come when something on the way still acknowledges) would hold the
caller, a sync one above all, for as long. Shared by the PostgreSQL and MariaDB/MySQL stores,
sync and asyncio alike: a driver's connection class says once (:func:`cuts`) how to find its
socket's file descriptor, and each statement is then watched with :meth:`Watchdog.start` and
:meth:`Watchdog.stop`.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from collections.abc import Callable, Hashable
from time import monotonic
from typing import Any

__all__ = ["WATCHDOG", "Watchdog", "cuts"]

_FILENOS: dict[type, Callable[[Any], int]] = {}
"""For each connection class a driver module named (:func:`cuts`), how to find the file
descriptor of a connection's socket. Read only when a statement is cut."""


def cuts(cls: type, fileno: Callable[[Any], int]) -> None:
    """Say how the watchdog finds the socket of a connection of ``cls`` (or a subclass):
    ``fileno(conn)``, its file descriptor (raising when the connection is closed)."""
    _FILENOS[cls] = fileno


class Watchdog:
    """Cuts the connection of a statement that outlived its deadline: one daemon thread per
    process, shared by every store, that ``shutdown()``s the connection's socket. The wait in
    the driver then ends at once as on any lost connection (psycopg: an ``OperationalError``,
    the server "closed the connection"; PyMySQL and aiomysql: error 2013, "Lost connection to
    MySQL server during query"), the connection is broken, and the store's pool drops it.

    A statement's watch is a clock read, a dict entry set and popped, and a comparison:
    about 0.3 µs, nothing against a round trip; no thread starts, nothing is scheduled, no
    lock is taken per statement. The thread sleeps until the soonest deadline it knows of,
    and without statements until one comes: a statement wakes it only when its deadline is
    sooner than that (the first after a quiet spell; with one ``read_timeout`` in the
    process, no other). The entries are read and written without a lock (a dict's single
    operations are atomic): the thread publishes the deadline it sleeps to only after it
    has marked itself busy (``-inf``: no statement wakes it) and looked at the entries, then
    looks again, so an entry set meanwhile is never missed."""

    def __init__(self) -> None:
        self._reset()
        os.register_at_fork(after_in_child=self._reset)

    def _reset(self) -> None:
        # Also in a forked child: the parent's thread and its entries are not the child's.
        self._lock = threading.Lock()  # starting the thread; the cuts
        self._wake = threading.Event()
        self._running: dict[Hashable, float] = {}  # connection: its statement's deadline
        self._cut: set[Hashable] = set()  # cut, and not yet told to their statement
        self._next = float("inf")  # when the thread wakes next on its own (-inf: it is awake)
        self._thread: threading.Thread | None = None

    def start(self, conn: Hashable, seconds: float) -> None:
        """Watch the statement ``conn`` is about to run: cut it ``seconds`` from now."""
        deadline = monotonic() + seconds
        self._running[conn] = deadline
        if deadline < self._next:
            self._sooner()

    def _sooner(self) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="oncely-watchdog", daemon=True
                )
                self._thread.start()
        self._wake.set()

    def stop(self, conn: Hashable) -> bool:
        """Stop watching ``conn``'s statement; whether it was cut."""
        self._running.pop(conn, None)
        if not self._cut:
            return False
        with self._lock:
            try:
                self._cut.remove(conn)
            except KeyError:
                return False
            return True

    def _run(self) -> None:
        while True:
            self._wake.clear()
            self._next = float("-inf")  # awake: a new entry is seen below, no need to wake
            soonest = self._cut_due()
            self._next = soonest
            while (again := self._cut_due()) < soonest:  # set before _next was: look again
                soonest = self._next = again
            self._wake.wait(None if soonest == float("inf") else soonest - monotonic())

    def _cut_due(self) -> float:
        """Cut the statements past their deadline; the soonest deadline of the others."""
        now = monotonic()
        soonest = float("inf")
        for conn, deadline in self._running.copy().items():  # a copy: taken at once
            if deadline > now:
                soonest = min(soonest, deadline)
                continue
            with self._lock:
                if self._running.get(conn) != deadline:
                    continue  # it ended just now (and its connection may run another)
                self._running.pop(conn, None)
                self._cut.add(conn)
                _shutdown(conn)
        return soonest


def _fileno(conn: object) -> int:
    for cls in type(conn).__mro__:
        found = _FILENOS.get(cls)
        if found is not None:
            return found(conn)
    raise TypeError(f"no way to find the socket of a {type(conn).__name__} (see cuts())")


def _shutdown(conn: object) -> None:
    """Shut ``conn``'s socket down both ways (the connection's own file descriptor stays
    open: the driver closes it, as for any lost connection)."""
    with contextlib.suppress(Exception):  # closed meanwhile: nothing left to cut
        sock = socket.socket(fileno=_fileno(conn))
        try:
            sock.shutdown(socket.SHUT_RDWR)
        finally:
            sock.detach()


WATCHDOG = Watchdog()
"""The process's watchdog, which every store's statements share."""

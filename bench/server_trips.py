"""Round trips on the wire for the servers section (``bench/servers.py``), counted in a pass
of their own: a counting redis-py connection class, libpq's protocol trace (one round trip per
``Sync`` or simple ``Query`` message) and a counting wrapper of PyMySQL's
``Connection._execute_command``, each round trip with a short label."""

from __future__ import annotations

import contextlib
import re
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from server_common import RUN, driver

from oncely.stores.redis import dialect as redis_dialect


class Trips:
    """Round trips seen while :meth:`measure` is active, with a short label each.

    Drivers report through :meth:`hit` as they send (redis-py, PyMySQL); libpq's trace is
    read when the measurement ends, through the ``hooks``."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.active = False
        self.seq: list[str] = []
        self.hooks: list[tuple[Callable[[], None], Callable[[], None]]] = []

    def hit(self, what: str) -> None:
        if self.active:
            self.seq.append(what)

    @contextlib.contextmanager
    def measure(self) -> Iterator[None]:
        self.seq = []
        self.active = True
        for start, _ in self.hooks:
            start()
        try:
            yield
        finally:
            for _, stop in self.hooks:
                stop()
            self.active = False


def per_message(seq: list[str], n: int) -> tuple[float, list[str]]:
    """(round trips per message, the labels of one message's round trips)."""
    one = seq[: len(seq) // n] if n and len(seq) % n == 0 else []
    return len(seq) / n, one


_VERB = re.compile(
    r"\b(INSERT INTO|UPDATE|DELETE FROM|SELECT\b.*?\bFROM)\s+([\w.\"`]+)", re.IGNORECASE | re.DOTALL
)


def sql_label(sql: str) -> str:
    """``INSERT inbox``, ``claim (INSERT ON CONFLICT)``, ``BEGIN`` ... for a statement."""
    text = " ".join(sql.split())
    upper = text.upper()
    if "UNNEST(" in upper:
        return "claim_many (INSERT ... unnest)"
    if upper.startswith("WITH") and "INSERT INTO" in upper and "ON CONFLICT" in upper:
        return "claim (INSERT ON CONFLICT + read)"
    m = _VERB.search(text)
    if m:
        table = m.group(2).replace('"', "").replace("`", "").split(".")[-1]
        table = table.replace(f"bench_{RUN}_", "").replace(f"bench_{RUN}", "inbox")
        name = f"{m.group(1).split()[0].upper()} {table}"
        if "ON DUPLICATE KEY" in upper:
            name += " ON DUPLICATE KEY"
        elif "ON CONFLICT" in upper:
            name += " ON CONFLICT"
        if upper.endswith("FOR UPDATE"):
            name += " FOR UPDATE"
        return name
    return " ".join(text.split()[:2]).rstrip(";")


# libpq trace lines (REGRESS_MODE, no timestamps): "F\t<len>\t<Message>\t<fields>"; a statement
# with newlines continues on the following lines.
_PQ_LINE = re.compile(r"^([FB])\t\d+\t(\w+)(.*)$")
_PQ_PARSE = re.compile(r'^\s*"([^"]*)" "(.*)" \d+', re.DOTALL)
_PQ_BIND = re.compile(r'^\s*"[^"]*" "([^"]*)"')
_PQ_QUERY = re.compile(r'^\s*"(.*)"\s*$', re.DOTALL)


def pq_round_trips(text: str, named: dict[str, str], *, count: bool = True) -> list[str]:
    """One label per round trip in a libpq protocol trace: a ``Sync`` ends an extended-protocol
    exchange (Parse/Bind/Execute), a ``Query`` is a simple-protocol one (BEGIN, COMMIT,
    SAVEPOINT). A Parse followed by a Sync without a Bind is psycopg preparing a statement.
    ``named`` maps prepared statements to their text, across calls (a statement is prepared
    once per connection, usually before the part of the trace that is counted)."""
    messages: list[list[str]] = []
    for line in text.split("\n"):
        m = _PQ_LINE.match(line)
        if m:
            messages.append([m.group(1), m.group(2), m.group(3)])
        elif messages:
            messages[-1][2] += "\n" + line
    current = ""
    bound: list[str] = []  # the statements executed since the last Sync (a pipeline: several)
    out: list[str] = []
    for side, kind, rest in messages:
        if side != "F":
            continue
        if kind == "Parse":
            pm = _PQ_PARSE.match(rest)
            if pm:
                named[pm.group(1)] = current = pm.group(2)
        elif kind == "Bind":
            bm = _PQ_BIND.match(rest)
            if bm and bm.group(1):
                current = named.get(bm.group(1), "?")
            bound.append(sql_label(current))
        elif kind == "Sync":
            out.append(" + ".join(bound) if bound else f"PREPARE {sql_label(current)}")
            bound = []
        elif kind == "Query":
            qm = _PQ_QUERY.match(rest)
            out.append(sql_label(qm.group(1) if qm else rest))
    return out if count else []


def trace_libpq(trips: Trips, conn: Any, workdir: Path) -> None:
    """Count ``conn``'s round trips (a psycopg connection) with libpq's protocol trace, which
    runs from now on for the connection's life, into a file under ``workdir``; each
    measurement reads what was appended since it started."""
    pq = driver("psycopg.pq")

    fd, name = tempfile.mkstemp(prefix="pq-", suffix=".txt", dir=workdir)
    path = Path(name)
    named: dict[str, str] = {}
    state = {"read": 0, "start": 0}

    def trace() -> None:
        conn.pgconn.trace(fd)
        conn.pgconn.set_trace_flags(pq.Trace.SUPPRESS_TIMESTAMPS | pq.Trace.REGRESS_MODE)

    def flushed() -> bytes:
        conn.pgconn.untrace()  # flushes libpq's stream; tracing resumes at once
        data = path.read_bytes()
        trace()
        return data

    def start() -> None:
        state["start"] = len(flushed())

    def stop() -> None:
        data = flushed()
        # What ran between two measurements (warm-up) only teaches the prepared names.
        between = data[state["read"] : state["start"]]
        pq_round_trips(between.decode(errors="replace"), named, count=False)
        for label in pq_round_trips(data[state["start"] :].decode(errors="replace"), named):
            trips.hit(label)
        state["read"] = len(data)

    trace()
    trips.hooks.append((start, stop))


@contextlib.contextmanager
def counting_pymysql(trips: Trips) -> Iterator[None]:
    """Count every command PyMySQL sends (each one waits for its reply: one round trip), for
    as long as the block runs. PyMySQL has no hook: the method is wrapped on the class."""
    pc = driver("pymysql.connections")

    original = pc.Connection._execute_command

    def counted(self: Any, command: int, sql: Any) -> Any:
        text = sql.decode("utf-8", "replace") if isinstance(sql, bytes | bytearray) else str(sql)
        trips.hit(sql_label(text) if text else f"command {command}")
        return original(self, command, sql)

    pc.Connection._execute_command = counted
    try:
        yield
    finally:
        pc.Connection._execute_command = original


_RESP = re.compile(rb"^\*\d+\r\n\$\d+\r\n([A-Za-z]+)\r\n(?:\$\d+\r\n([^\r\n]*)\r\n)?")


def counting_redis_client(url: str, trips: Trips, *, decode_responses: bool = False) -> Any:
    """A redis-py client whose connections report each send (one round trip: a command, or
    a whole pipeline) to ``trips``, labelled ``EVALSHA claim``, ``SET NX``, ``GET`` ..."""
    redis = driver("redis")
    scripts = {
        s.sha.encode(): s.name
        for s in (
            redis_dialect.CLAIM,
            redis_dialect.CLAIM_MANY,
            redis_dialect.COMPLETE,
            redis_dialect.RELEASE,
        )
    }

    class Counting(redis.Connection):
        def send_packed_command(self, command: Any, check_health: bool = True) -> None:
            if trips.active:
                data = command if isinstance(command, bytes) else b"".join(command)
                m = _RESP.match(data)
                name = m.group(1).decode().upper() if m else "?"
                if name == "EVALSHA" and m is not None and m.group(2) is not None:
                    name = f"EVALSHA {scripts.get(m.group(2), '?')}"
                elif name == "SET" and b"\r\nNX\r\n" in data.upper():
                    name = "SET NX"
                trips.hit(name)
            super().send_packed_command(command, check_health)

    pool = redis.ConnectionPool.from_url(
        url, connection_class=Counting, decode_responses=decode_responses
    )
    return redis.Redis(connection_pool=pool)

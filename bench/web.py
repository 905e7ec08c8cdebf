"""HTTP endpoints with and without an idempotency middleware, side by side:
``python bench/web.py``.

A trivial ``POST /orders`` (``bench/web_app.py``) served by uvicorn (one worker, its own
process; ``--server standard``, the default, is ``uvicorn[standard]`` as deployed: httptools and
uvloop; ``--server pure`` is h11 and asyncio's loop) four ways: bare; behind
``oncely.http.IdempotencyMiddleware`` on the Redis store and
on the PostgreSQL store; behind idemkit's ASGI middleware on the same Redis; and the floor,
``by-hand-redis``: a hand-written middleware doing exactly the store work of oncely's on Redis
(the same ``EVALSHA`` of the same scripts, one round trip for a replay and two for a new key,
on redis-py's asyncio connections set up as the store sets them up) and nothing else, with
``by-hand-redis-api`` the same through redis-py's public ``evalsha``.

A client (a minimal keep-alive HTTP/1.1 client over ``--connections`` connections) sends
``--requests`` requests with a new ``Idempotency-Key`` each (``new key``), then the same
requests again (``replay``: each key's stored response). Every answer is checked (status 201
and the body), or the run fails. Variants run in rounds with a rotating order; the table
reports medians of requests per second, and each against the bare endpoint, with the
server process's CPU per request (read from ``/proc``: uvicorn and the middleware together).

``--in-process`` then measures each middleware without a server or a network client: the
ASGI app called directly, one request at a time (``--in-flight K``: K at a time, as the
server's 16 connections have them), the process's CPU per request (the middleware, its store
client and the trivial endpoint), the lowest-noise view of what a middleware costs.

Writes ``bench/results/http.md`` and ``http.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg
import redis

HERE = Path(__file__).resolve().parent
VARIANTS = (
    "bare", "by-hand-redis", "by-hand-redis-api", "oncely-redis", "oncely-postgres",
    "idemkit-redis", "oncely-memory",
)  # fmt: skip
DEFAULT = (
    "bare", "by-hand-redis", "by-hand-redis-api", "oncely-redis", "oncely-postgres",
    "idemkit-redis",
)  # fmt: skip
"""Run unless ``--variant`` says otherwise (``oncely-memory``, the in-process store: what the
middleware and the inbox cost without a store round trip)."""
FLOOR = "by-hand-redis"
"""The floor Redis-backed middlewares are measured against: oncely's Redis statements written
by hand on the same driver and connection setup (``bench/web_app.py``'s ``ByHand``)."""
REDIS = os.environ.get("ONCELY_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
POSTGRES = os.environ.get("ONCELY_TEST_POSTGRES_DSN", "postgresql://postgres@127.0.0.1:5432/test")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


SERVERS = {
    # uvicorn[standard], as deployed: the httptools parser and the uvloop event loop
    "standard": ["--http", "httptools", "--loop", "uvloop"],
    # uvicorn alone: the pure-Python h11 parser and asyncio's own loop
    "pure": ["--http", "h11", "--loop", "asyncio"],
}


@contextlib.contextmanager
def serving(variant: str, space: str, server: str = "standard") -> Iterator[str]:
    port = free_port()
    env = {**os.environ, "ONCELY_BENCH_HTTP": variant, "ONCELY_BENCH_SPACE": space}
    # The server runs in bench/: a relative PYTHONPATH (PYTHONPATH=src, a worktree's sources)
    # made absolute, or the server would import whatever oncely is installed instead.
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if paths:
        env["PYTHONPATH"] = os.pathsep.join(str(Path(p).resolve()) for p in paths)
    process = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "web_app:app", "--port", str(port),
         "--log-level", "warning", "--no-access-log", *SERVERS[server]],
        cwd=HERE, env=env,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 20
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
                break
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"uvicorn ({variant}) did not start")
            time.sleep(0.05)
        yield f"http://127.0.0.1:{port}", process.pid
    finally:
        process.terminate()
        process.wait(10)


async def _post(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, host: str, key: str
) -> tuple[int, bytes]:
    """One keep-alive ``POST /orders`` on a raw connection: (status, body). A client of a few
    lines, so that the client is not the floor (httpx spends more CPU per request than this
    endpoint's server does)."""
    body = b'{"sku": 7}'
    writer.write(
        b"POST /orders HTTP/1.1\r\nHost: " + host.encode() + b"\r\nContent-Type: "
        b"application/json\r\nContent-Length: " + str(len(body)).encode() + b"\r\n"
        b'Idempotency-Key: "' + key.encode() + b'"\r\n\r\n' + body
    )
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    length, chunked = 0, False
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        name = name.strip().lower()
        if name == b"content-length":
            length = int(value)
        elif name == b"transfer-encoding" and b"chunked" in value.lower():
            chunked = True
    if not chunked:
        return status, await reader.readexactly(length)
    parts = []
    while size := int((await reader.readuntil(b"\r\n")).split(b";")[0], 16):
        parts.append(await reader.readexactly(size))
        await reader.readexactly(2)
    await reader.readuntil(b"\r\n")
    return status, b"".join(parts)


async def drive(base: str, keys: list[str], connections: int) -> float:
    """Seconds to send one POST per key, ``connections`` at a time; checks each answer."""
    host, port = base.removeprefix("http://").split(":")
    queue = list(reversed(keys))

    async def worker() -> None:
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            while queue:
                k = queue.pop()
                status, got = await _post(reader, writer, host, k)
                if status != 201 or got != b'{"order": "created", "amount": 42}':
                    raise RuntimeError(f"unexpected answer {status} {got!r}")
        finally:
            writer.close()

    reader, writer = await asyncio.open_connection(host, int(port))
    await _post(reader, writer, host, "warm-up")
    writer.close()
    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(connections)))
    return time.perf_counter() - started


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time of process ``pid`` so far (Linux ``/proc``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def in_process(variant: str, requests: int, in_flight: int = 1) -> dict[str, float]:
    """Microseconds of this process's CPU per request, new keys then replays, calling the
    variant's ASGI app directly (``bench/web_app.py``'s ``build``), ``in_flight`` requests at
    a time (each of that many tasks takes the next key when its request is answered)."""
    sys.path.insert(0, str(HERE))
    import web_app  # noqa: PLC0415 - the served module, imported only here

    app = web_app.build(variant)
    body = b'{"sku": 7}'

    async def one(key: str) -> None:
        scope = {
            "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
            "method": "POST", "scheme": "http", "path": "/orders", "raw_path": b"/orders",
            "query_string": b"", "root_path": "", "client": ("127.0.0.1", 1),
            "server": ("127.0.0.1", 80),
            "headers": [
                (b"host", b"bench"), (b"content-type", b"application/json"),
                (b"content-length", b"10"), (b"idempotency-key", f'"{key}"'.encode()),
            ],
        }  # fmt: skip
        given = False

        async def receive() -> dict[str, Any]:
            nonlocal given
            if given:  # (the middleware never asks twice for a complete body)
                raise RuntimeError("asked for more body")
            given = True
            return {"type": "http.request", "body": body, "more_body": False}

        sent: list[dict[str, Any]] = []

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        await app(scope, receive, send)
        if sent[0]["status"] != 201:
            raise RuntimeError(f"unexpected answer {sent}")

    async def worker(queue: list[str]) -> None:
        while queue:
            await one(queue.pop())

    await one("warm-up")
    keys = [str(uuid.uuid4()) for _ in range(requests)]
    out = {}
    for phase in ("new key", "replay"):
        queue = list(reversed(keys))
        began = time.process_time()
        await asyncio.gather(*(worker(queue) for _ in range(in_flight)))
        out[phase] = (time.process_time() - began) / requests * 1e6
    return out


def clean(space: str) -> None:
    client = redis.Redis.from_url(REDIS)
    for name in client.scan_iter(match=f"{space}*"):
        client.delete(name)
    client.close()
    with psycopg.connect(POSTGRES, autocommit=True) as conn:
        conn.execute(f'DROP TABLE IF EXISTS "{space}", "{space}_meta"')


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python bench/web.py", description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=3000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--connections", type=int, default=16)
    p.add_argument("--variant", action="append", choices=VARIANTS)
    p.add_argument("--out", type=Path, default=HERE / "results")
    p.add_argument("--no-save", action="store_true")
    p.add_argument(
        "--server", choices=sorted(SERVERS), default="standard",
        help="uvicorn with httptools and uvloop (standard, as deployed) or h11 and asyncio (pure)",
    )  # fmt: skip
    p.add_argument(
        "--in-process", type=int, default=0, metavar="N",
        help="also time N requests per variant with the ASGI app called directly",
    )  # fmt: skip
    p.add_argument(
        "--in-flight", type=int, default=1, metavar="K",
        help="with --in-process: K requests at a time (1: one after the other)",
    )  # fmt: skip
    args = p.parse_args(argv)
    chosen = tuple(v for v in VARIANTS if (v in args.variant if args.variant else v in DEFAULT))
    rates: dict[str, dict[str, list[float]]] = {v: {"new key": [], "replay": []} for v in chosen}
    cpus: dict[str, dict[str, list[float]]] = {v: {"new key": [], "replay": []} for v in chosen}
    for r in range(args.rounds):
        order = chosen[r % len(chosen) :] + chosen[: r % len(chosen)]
        for variant in order:
            space = f"bench_http_{uuid.uuid4().hex[:8]}"
            keys = [str(uuid.uuid4()) for _ in range(args.requests)]
            try:
                with serving(variant, space, args.server) as (base, pid):
                    for phase in ("new key", "replay"):
                        before = cpu_seconds(pid)
                        seconds = asyncio.run(drive(base, keys, args.connections))
                        rate = args.requests / seconds
                        server = (cpu_seconds(pid) - before) / args.requests * 1e6
                        rates[variant][phase].append(rate)
                        cpus[variant][phase].append(server)
                        print(
                            f"  {variant:<16} {phase:<8} {rate:8,.0f} req/s, server "
                            f"{server:4.0f} us CPU per request",
                            flush=True,
                        )
            finally:
                clean(space)
    command = "python bench/web.py" + (" " + " ".join(sys.argv[1:]) if sys.argv[1:] else "")
    med = {v: {ph: statistics.median(x) for ph, x in d.items()} for v, d in rates.items()}
    cpu = {v: {ph: statistics.median(x) for ph, x in d.items()} for v, d in cpus.items()}
    bare = med.get("bare", {}).get("new key")
    lines = [
        "| endpoint | new key (req/s) | replay (req/s) | new key / bare | replay / bare "
        "| server CPU per request, new / replay (us) | rounds' range, new / replay (req/s) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for v, m in med.items():
        ratio = (f"{m['new key'] / bare:.2f}x", f"{m['replay'] / bare:.2f}x") if bare else ("", "")
        spread = " / ".join(
            f"{min(rates[v][ph]):,.0f}-{max(rates[v][ph]):,.0f}" for ph in ("new key", "replay")
        )
        lines.append(
            f"| {v} | {m['new key']:,.0f} | {m['replay']:,.0f} | {ratio[0]} | {ratio[1]} "
            f"| {cpu[v]['new key']:.0f} / {cpu[v]['replay']:.0f} | {spread} |"
        )
    pairs = [
        ("oncely-redis", "idemkit-redis"), (FLOOR, "idemkit-redis"), ("oncely-redis", FLOOR),
        ("by-hand-redis-api", FLOOR), ("idemkit-redis", FLOOR),
    ]  # fmt: skip
    pairs = [(a, b) for a, b in pairs if a in med and b in med]
    if pairs:
        lines += [
            "",
            "Ratios of the medians (and, in brackets, the lowest and highest of the per-round "
            "ratios: the variants of one round run seconds apart, so each such ratio is read "
            "under the same load). The last column divides the second variant's server CPU per "
            "request by the first's: the same comparison where the server's CPU is what limits "
            "the rate, and steadier than the rates when other work shares the machine:",
            "",
            "| ratio | new key | replay | by server CPU per request, new / replay |",
            "|---|---:|---:|---:|",
        ]
        for a, b in pairs:
            cells = []
            for ph in ("new key", "replay"):
                each = [x / y for x, y in zip(rates[a][ph], rates[b][ph], strict=True)]
                cells.append(f"{med[a][ph] / med[b][ph]:.2f}x ({min(each):.2f}-{max(each):.2f})")
            by_cpu = " / ".join(
                f"{cpu[b][ph] / cpu[a][ph]:.2f}x" if cpu[a][ph] else "-"
                for ph in ("new key", "replay")
            )
            lines.append(f"| {a} / {b} | {cells[0]} | {cells[1]} | {by_cpu} |")
    if args.in_process:
        lines += [
            "",
            f"In process ({args.in_process} requests, {args.in_flight} at a time, the ASGI "
            "app called directly, medians of the rounds):",
            "",
            "| middleware | CPU per request, new key (us) | replay (us) |",
            "|---|---:|---:|",
        ]
        for v in chosen:
            runs = []
            for _ in range(args.rounds):
                space = f"bench_http_{uuid.uuid4().hex[:8]}"
                os.environ["ONCELY_BENCH_SPACE"] = space
                try:
                    runs.append(asyncio.run(in_process(v, args.in_process, args.in_flight)))
                finally:
                    clean(space)
            new = statistics.median(r["new key"] for r in runs)
            again = statistics.median(r["replay"] for r in runs)
            print(f"  {v:<16} in process: {new:.0f} / {again:.0f} us CPU per request")
            lines.append(f"| {v} | {new:.0f} | {again:.0f} |")
    text = "\n".join(lines)
    print()
    print(text)
    if not args.no_save:
        header = (
            f"# HTTP endpoints with and without an idempotency middleware\n\n`{command}` on "
            f"{datetime.now(UTC):%Y-%m-%d %H:%M UTC}, {os.cpu_count()} CPUs, uvicorn "
            f"{args.server} ({' '.join(SERVERS[args.server])}), {args.requests} "
            f"requests per phase, {args.connections} connections, {args.rounds} rounds; "
            "medians of requests per second (the bare endpoint ignores the header, so its two "
            "phases are the same work).\n\n"
        )
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "http.md").write_text(header + text + "\n")
        (args.out / "http.json").write_text(
            json.dumps({"command": command, "rates": rates, "server_cpu_us": cpus}, indent=1) + "\n"
        )
        print(f"wrote {args.out / 'http.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

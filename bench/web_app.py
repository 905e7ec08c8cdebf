"""The endpoint ``bench/web.py`` serves with uvicorn: a trivial ``POST /orders`` answering
201 with a small JSON body, bare or behind an idempotency middleware chosen by
``ONCELY_BENCH_HTTP`` (``bare``, ``oncely-redis``, ``oncely-postgres``, ``oncely-memory``,
``idemkit-redis``, and the floor: ``by-hand-redis``, the same Redis statements written by hand
on the same driver and connection setup, ``by-hand-redis-api`` the same through redis-py's
public ``evalsha``);
``ONCELY_BENCH_SPACE`` names the Redis prefix or PostgreSQL table of the run."""

from __future__ import annotations

import asyncio
import hashlib
import os
from typing import Any

from redis.exceptions import NoScriptError

ORDER = b'{"order": "created", "amount": 42}'
HEADERS = [(b"content-type", b"application/json"), (b"content-length", str(len(ORDER)).encode())]


async def orders(scope: Any, receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    await send({"type": "http.response.start", "status": 201, "headers": HEADERS})
    await send({"type": "http.response.body", "body": ORDER})


class Lazy:
    """Builds the chosen middleware on the server's event loop, on first request."""

    def __init__(self) -> None:
        self.app: Any = None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await receive()
            await send({"type": "lifespan.startup.complete"})
            await receive()
            await send({"type": "lifespan.shutdown.complete"})
            return
        if self.app is None:
            self.app = build(os.environ.get("ONCELY_BENCH_HTTP", "bare"))
        await self.app(scope, receive, send)


def build(variant: str) -> Any:
    space = os.environ.get("ONCELY_BENCH_SPACE", "bench_http")
    redis_url = os.environ.get("ONCELY_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
    postgres = os.environ.get(
        "ONCELY_TEST_POSTGRES_DSN", "postgresql://postgres@127.0.0.1:5432/test"
    )
    if variant == "bare":
        return orders
    if variant.startswith("oncely"):
        import oncely  # noqa: PLC0415 - only the chosen variant's
        from oncely.http import IdempotencyMiddleware  # noqa: PLC0415

        url = {
            "oncely-redis": f"{redis_url}?prefix={space}",
            "oncely-postgres": f"{postgres}?table={space}&pool_max=16",
            "oncely-memory": "memory://",  # the middleware's and the inbox's Python alone
        }[variant]
        inbox = oncely.AsyncInbox(oncely.open_async(url), consumer="bench")
        return IdempotencyMiddleware(orders, inbox=inbox)
    if variant == "idemkit-redis":
        import redis.asyncio as aioredis  # noqa: PLC0415 - only the chosen variant's
        from idemkit import HttpConfig  # noqa: PLC0415
        from idemkit import IdempotencyMiddleware as Idemkit  # noqa: PLC0415
        from idemkit.backends.redis import RedisBackend  # noqa: PLC0415

        backend = RedisBackend(aioredis.Redis.from_url(redis_url), namespace=space)
        return Idemkit(orders, backend=backend, config=HttpConfig(scope_mode="single_tenant"))
    if variant in ("by-hand-redis", "by-hand-redis-api"):
        return ByHand(orders, redis_url, space, api=variant == "by-hand-redis-api")
    raise SystemExit(f"unknown variant {variant!r}")


class ByHand:
    """The floor: the store work of oncely's Redis middleware written by hand, and nothing
    else. The same driver and connection setup as the store (redis-py's asyncio connections
    made from a ``BlockingConnectionPool`` with the store's options: 16 connections, 5 s
    timeouts, one retry; connections of its own reused last-in first-out, their socket timeout
    off and each exchange timed by one ``asyncio.timeout``), the same statements (the store's
    own ``CLAIM`` and ``COMPLETE`` Lua scripts, sent by ``EVALSHA`` packed by hand, with the
    arguments the store sends): a replay is one round trip (the claim answers the stored
    response), a new key two (the claim, then the completion with the response).

    What it leaves out: key parsing (the header's raw value is the key), principal scoping,
    the inbox's rules and outcomes, lease renewal, response headers filtering; the response
    is stored as status, header lines and body (no JSON, no base64). The fingerprint is the
    body's SHA-256 (the claim script takes one as an argument). With ``api=True`` every
    script goes through redis-py's public ``evalsha`` on a client of the same pool instead
    (what an application writing this by hand would call first).
    """

    def __init__(self, app: Any, redis_url: str, space: str, *, api: bool = False) -> None:
        import redis.asyncio as aioredis  # noqa: PLC0415 - only the chosen variant's
        from redis.asyncio.retry import Retry  # noqa: PLC0415
        from redis.backoff import NoBackoff  # noqa: PLC0415

        from oncely.stores.redis.lua import CLAIM, COMPLETE, RELEASE  # noqa: PLC0415

        self.app = app
        self.scripts = {s.sha_bytes: s.text for s in (CLAIM, COMPLETE, RELEASE)}
        self.claim = CLAIM.sha_bytes
        self.complete = COMPLETE.sha_bytes
        self.release = RELEASE.sha_bytes
        # The store's pool, as oncely.stores.redis.async_io.connect builds it.
        self.pool = aioredis.BlockingConnectionPool.from_url(
            redis_url, max_connections=16, timeout=5.0, socket_timeout=5.0,
            socket_connect_timeout=5.0, retry=Retry(NoBackoff(), 1),
        )  # fmt: skip
        self.client = aioredis.Redis.from_pool(self.pool)
        self.idle: list[Any] = []
        self.made = 0
        self.waiting = 0
        self.freed = asyncio.Condition()
        self.ask = self._ask_api if api else self._ask
        # The store's key layout, its consumer and oncely's scoping of the path: same length.
        self.head = f"{space}:{{bench:http%3Aanonymous%3APOST%3A/orders%3A".encode()
        # The inbox's defaults: a 30 s lease, 7 days kept, a lapsed claim taken over.
        self.lease, self.keep = b"30000", b"604800000"

    async def _ask(self, sha: bytes, name: bytes, args: tuple[bytes, ...]) -> Any:
        """One EVALSHA on a connection of its own: send, read, give the connection back."""
        conn = self.idle.pop() if self.idle else await self._take()
        try:
            async with asyncio.timeout(5.0):
                packed = _pack(sha, name, args)
                await conn.send_packed_command(packed)
                try:
                    return await conn.read_response()
                except NoScriptError:
                    await conn.send_command("SCRIPT", "LOAD", self.scripts[sha])
                    await conn.read_response()
                    await conn.send_packed_command(packed)
                    return await conn.read_response()
        except TimeoutError:
            await conn.disconnect(nowait=True)
            raise
        finally:
            self.idle.append(conn)
            if self.waiting:
                async with self.freed:
                    self.freed.notify()

    async def _take(self) -> Any:
        async with self.freed:
            self.waiting += 1
            try:
                while not self.idle:
                    if self.made < 16:
                        self.made += 1
                        conn = self.pool.make_connection()
                        conn.socket_timeout = None  # the exchange is timed as a whole
                        return conn
                    await self.freed.wait()
                return self.idle.pop()
            finally:
                self.waiting -= 1

    async def _ask_api(self, sha: bytes, name: bytes, args: tuple[bytes, ...]) -> Any:
        try:
            return await self.client.evalsha(sha, 1, name, *args)
        except NoScriptError:
            await self.client.script_load(self.scripts[sha])
            return await self.client.evalsha(sha, 1, name, *args)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        raw = None
        for k, v in scope["headers"]:
            if k == b"idempotency-key":
                raw = v
                break
        if raw is None:
            await self.app(scope, receive, send)
            return
        parts = []
        while True:
            message = await receive()
            parts.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        body = b"".join(parts)
        name = self.head + raw + b"}"
        fp = hashlib.sha256(body).hexdigest().encode()
        token = os.urandom(16).hex().encode()
        args = (b"", self.lease, self.keep, b"1", b"", b"+" + fp, token)
        code, _now, *extra = (await self.ask(self.claim, name, args))[0]
        if code == b"new" or code == b"taken":
            await self._run(scope, body, send, name, token)
            return
        # An existing record: its status and the rest of the stored string (see the store's
        # dialect): 'attempt created updated lease expires #f #t #r #x', a newline, f t r x.
        head, _, rest = extra[1].partition(b"\n")
        sizes = head.split(b" ")
        nf, nt, nr = max(int(sizes[5]), 0), int(sizes[6]), int(sizes[7])
        if extra[0] != b"completed" or nr < 0:
            await _reply(send, 409, b'{"title": "in progress"}')
        elif rest[:nf] != fp:
            await _reply(send, 422, b'{"title": "key reused"}')
        else:
            stored = rest[nf + nt : nf + nt + nr]
            lines, _, content = stored.partition(b"\n\n")
            status, *fields = lines.split(b"\n")
            headers = [tuple(f.split(b":", 1)) for f in fields]
            headers.append((b"idempotent-replayed", b"true"))
            await send({"type": "http.response.start", "status": int(status), "headers": headers})
            await send({"type": "http.response.body", "body": content})

    async def _run(self, scope: Any, body: bytes, send: Any, name: bytes, token: bytes) -> None:
        given = False

        async def replay_body() -> dict[str, Any]:
            nonlocal given
            if given:
                return {"type": "http.disconnect"}
            given = True
            return {"type": "http.request", "body": body, "more_body": False}

        start: dict[str, Any] = {}
        chunks: list[bytes] = []
        ended = False

        async def capture(message: Any) -> None:
            nonlocal ended
            if message["type"] == "http.response.start":
                start.update(message)
            elif message["type"] == "http.response.body":
                chunks.append(message.get("body", b""))
                if not message.get("more_body") and not ended:
                    ended = True
                    await self._end(name, token, start, chunks)
            await send(message)

        try:
            await self.app(scope, replay_body, capture)
        except BaseException:
            if not ended:
                await self.ask(self.release, name, (b"", token))
            raise

    async def _end(self, name: bytes, token: bytes, start: Any, chunks: list[bytes]) -> None:
        """Keep the response (a status below 500) or give the claim back."""
        status = int(start.get("status", 500))
        if status >= 500:
            await self.ask(self.release, name, (b"", token))
            return
        lines = [b"%d" % status] + [bytes(k) + b":" + bytes(v) for k, v in start["headers"]]
        stored = b"\n".join(lines) + b"\n\n" + b"".join(chunks)
        await self.ask(self.complete, name, (b"", token, self.keep, b"+" + stored, b""))


def _pack(sha: bytes, name: bytes, args: tuple[bytes, ...]) -> bytes:
    """``EVALSHA sha 1 name *args`` in the Redis protocol (every argument is bytes)."""
    head = b"*%d\r\n$7\r\nEVALSHA\r\n$40\r\n%s\r\n$1\r\n1\r\n$%d\r\n%s\r\n" % (
        len(args) + 4, sha, len(name), name,
    )  # fmt: skip
    return head + b"".join([b"$%d\r\n%s\r\n" % (len(a), a) for a in args])


async def _reply(send: Any, status: int, body: bytes) -> None:
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


app = Lazy()

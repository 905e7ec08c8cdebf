"""The HTTP middlewares when the store goes away while a request runs: the app's work is done,
so its response must still reach the client, and the record be completed once the store is
back, so a retry is replayed rather than run again (R19). The store (Redis, PostgreSQL, and
MariaDB for a claim on a store gone silent) is reached through a relay the test cuts during
the handler and restores a few seconds later; the apps are served by uvicorn (ASGI) and a
threaded wsgiref server (WSGI, Flask) in processes of their own."""

from __future__ import annotations

import asyncio
import contextlib
import io
import logging
import sys
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from datetime import timedelta
from typing import Any

import httpx
import psycopg
import pytest
import redis

import oncely
from oncely.http import IdempotencyMiddleware, Receive, Scope, Send, WSGIIdempotencyMiddleware
from tests.backends.mysql import drop_tables
from tests.backends.mysql import url as mysql_url
from tests.brokers.common import Proxy
from tests.services import MYSQL_URL, POSTGRES_DSN, REDIS_URL, require
from tests.web.test_asgi import key, serving, serving_command

OUTAGE = {"redis": 3.0, "postgres": 3.0}
"""Seconds the store is unreachable (from 0.3 s into a handler that runs one second): longer
than the inbox's own retries of a completion (about one second, plus one try: on PostgreSQL,
with ``connect_timeout=1``, a try waits a second for the pool), well inside the middleware's
five seconds from the end of the handler, with room for PostgreSQL's pool, which backs off
between its attempts to reconnect (1 s, 2 s, ...), to connect again."""


@contextlib.contextmanager
def _store(kind: str) -> Iterator[str]:
    """A store URL of ``kind`` (Redis, PostgreSQL or MariaDB) under a name of the test's own;
    dropped after."""
    name = f"http_out_{uuid.uuid4().hex[:10]}"
    if kind == "mysql":
        require("MariaDB", MYSQL_URL, 3306)
        try:
            yield mysql_url(name, connect_timeout=1)
        finally:
            drop_tables(name)
        return
    if kind == "postgres":
        require("PostgreSQL", POSTGRES_DSN, 5432)
        try:
            yield f"{POSTGRES_DSN}?table={name}&connect_timeout=1"
        finally:
            with psycopg.connect(POSTGRES_DSN, autocommit=True) as conn:
                conn.execute(f'DROP TABLE IF EXISTS "{name}", "{name}_meta"'.encode())
        return
    require("Redis", REDIS_URL, 6379)
    try:
        yield f"{REDIS_URL}?prefix={name}"
    finally:
        client = redis.Redis.from_url(REDIS_URL)
        for found in client.scan_iter(match=f"{name}*"):
            client.delete(found)
        client.close()


@contextlib.asynccontextmanager
async def _relayed(kind: str) -> AsyncIterator[Proxy]:
    with _store(kind) as url:
        async with Proxy(url) as proxy:
            yield proxy


async def _outage(proxy: Proxy, after: float, lasting: float) -> None:
    """The store unreachable from ``after`` seconds on, for ``lasting`` seconds: open
    connections cut, new ones refused."""
    await asyncio.sleep(after)
    proxy.refusing = True
    proxy.cut()
    await asyncio.sleep(lasting)
    proxy.refusing = False


async def _request_through_an_outage(base: str, proxy: Proxy, kind: str) -> None:
    """A request whose handler runs (one second) across the start of an outage: its response
    arrives whole, and a retry with the key is its replay (one effect)."""
    async with httpx.AsyncClient(base_url=base, timeout=30) as client:
        # A first request opens the store's connections: the cut then breaks live ones.
        warm = {"id": f"warm-{uuid.uuid4().hex[:8]}"}
        assert (
            await client.post("/orders", json=warm, headers={"Idempotency-Key": key()})
        ).status_code == 201
        k, order = key(), f"out-{uuid.uuid4().hex[:8]}"
        body = {"id": order, "sleep": 1.0}
        outage = asyncio.create_task(_outage(proxy, 0.3, OUTAGE[kind]))
        first = await client.post("/orders", json=body, headers={"Idempotency-Key": k})
        await outage
        assert first.status_code == 201 and first.json()["run"] == 1
        again = await client.post("/orders", json=body, headers={"Idempotency-Key": k})
        assert again.status_code == 201 and again.headers["idempotent-replayed"] == "true"
        assert again.content == first.content
        assert (await client.get("/effects")).json()[order] == 1


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["redis", "postgres"])
async def test_r19_asgi_a_store_outage_at_completion_keeps_the_response_and_the_record(
    kind: str,
) -> None:
    # Before, the completion's StoreUnavailable escaped into the app's send: the client got
    # the headers and then a closed connection, repeats got 409 for the lease (30 s), and
    # then the request ran a second time (stale_reclaimed).
    async with _relayed(kind) as proxy:
        with serving(proxy.url, "starlette") as base:
            await _request_through_an_outage(base, proxy, kind)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["redis", "postgres"])
async def test_r19_wsgi_a_store_outage_at_completion_keeps_the_response_and_the_record(
    kind: str,
) -> None:
    # Before, the WSGI server answered 500 for a request whose work was done, and its retry
    # got 409 until the lease lapsed, then ran it again.
    async with _relayed(kind) as proxy:
        command = [sys.executable, "-m", "tests.web.wsgi_app", "{port}"]
        with serving_command(command, ONCELY_TEST_HTTP_STORE=proxy.url) as base:
            await _request_through_an_outage(base, proxy, kind)


async def test_r19_asgi_a_store_away_for_longer_still_answers_and_says_what_was_not_kept(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # The store stays away past the middleware's tries (a third of a 3 s lease here): the
    # client still gets the app's response, and an ERROR says the record was not completed.
    ran: list[str] = []
    async with _relayed("redis") as proxy:
        store = oncely.open_async(proxy.url)
        lease = oncely.Lease(duration=timedelta(seconds=3))
        inbox = oncely.AsyncInbox(store, consumer="api", lease=lease)

        async def app(scope: Scope, receive: Receive, send: Send) -> None:
            ran.append(scope["path"])
            proxy.refusing = True
            proxy.cut()
            await send({"type": "http.response.start", "status": 201, "headers": []})
            await send({"type": "http.response.body", "body": b"booked"})

        api = IdempotencyMiddleware(app, inbox=inbox)
        caplog.set_level(logging.INFO, logger="oncely")
        try:
            async with httpx.AsyncClient(
                transport=httpx.ASGITransport(app=api), base_url="http://shop"
            ) as client:
                headers = {"Idempotency-Key": key()}
                got = await client.post("/orders", headers=headers)
                assert got.status_code == 201 and got.content == b"booked"
                proxy.refusing = False
                again = await client.post("/orders", headers=headers)
                assert again.status_code == 409  # the claim is still held: not run again
        finally:
            await store.aclose()
    assert ran == ["/orders"]
    _says_not_completed(caplog)


async def test_r19_wsgi_a_store_away_for_longer_still_answers_and_says_what_was_not_kept(
    caplog: pytest.LogCaptureFixture,
) -> None:
    ran: list[str] = []
    async with _relayed("redis") as proxy:
        store = oncely.open(proxy.url)
        lease = oncely.Lease(duration=timedelta(seconds=3))
        inbox = oncely.Inbox(store, consumer="api", lease=lease)

        loop = asyncio.get_running_loop()

        async def away() -> None:
            proxy.refusing = True
            proxy.cut()

        def app(environ: dict[str, Any], start_response: Any) -> list[bytes]:
            ran.append(environ["PATH_INFO"])
            # On the relay's own loop: its transports are not for another thread to abort.
            asyncio.run_coroutine_threadsafe(away(), loop).result()
            start_response("201 Created", [("Content-Type", "text/plain")])
            return [b"booked"]

        api = WSGIIdempotencyMiddleware(app, inbox=inbox)
        caplog.set_level(logging.INFO, logger="oncely")
        answered: list[str] = []

        def start_response(status: str, headers: Any, exc_info: Any = None) -> None:
            answered.append(status)

        def post() -> bytes:
            environ = {
                "REQUEST_METHOD": "POST",
                "PATH_INFO": "/orders",
                "HTTP_IDEMPOTENCY_KEY": '"wsgi-away-1"',
                "wsgi.input": io.BytesIO(b""),
            }
            return b"".join(api(environ, start_response))

        try:
            # In a thread: the relay runs on this event loop.
            assert await asyncio.to_thread(post) == b"booked"
            assert answered == ["201 Created"]
            proxy.refusing = False
            await asyncio.to_thread(post)
            assert answered[-1].startswith("409")  # the claim is still held: not run again
        finally:
            store.close()
    assert ran == ["/orders"]
    _says_not_completed(caplog)


def _says_not_completed(caplog: pytest.LogCaptureFixture) -> None:
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1, [r.getMessage() for r in errors]
    said = errors[0].getMessage()
    assert "response is sent" in said and "could not be completed" in said
    assert "may then run the request again" in said and errors[0].exc_info is None


SILENT_FOR = {"cut": 9.0, "silent": 25.0}
"""Seconds the store stays silent: longer than the middleware holds a response (5 s; on
PostgreSQL up to 10 s more when psycopg first cancels a statement the server stopped answering,
the ``silent`` case; on the WSGI middleware, the store's ``read_timeout``, 10 s, after which the
statement's connection is cut), shorter than what it held before: past the bound, the try under
way (a pool waiting ``connect_timeout``, 10 s, for a new connection: about 11 s in all), or, on
a connection gone silent, until TCP itself gave up (the WSGI middleware: until the store came
back)."""


def _asgi(store_url: str) -> contextlib.AbstractContextManager[str]:
    return serving(store_url, "starlette")


def _wsgi(store_url: str) -> contextlib.AbstractContextManager[str]:
    """The Flask app behind the WSGI middleware (``tests/web/wsgi_app.py``) on ``store_url``."""
    command = [sys.executable, "-m", "tests.web.wsgi_app", "{port}"]
    return serving_command(command, ONCELY_TEST_HTTP_STORE=store_url)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["cut", "silent"])
async def test_r19_asgi_a_store_gone_silent_at_completion_holds_the_response_a_bounded_time(
    how: str,
) -> None:
    """PostgreSQL with its default ``connect_timeout`` (10 s), reached through a relay that
    goes silent while the request runs: its connections held, nothing relayed (``cut``: the
    open ones reset first, so each try waits for a new connection). The response reaches the
    client while the store is still silent, and a repeat gets ``409`` (the record is held,
    not run again)."""
    await _silent_at_completion(_asgi, how)


@pytest.mark.slow
async def test_r19_wsgi_a_store_gone_silent_at_completion_holds_the_response_a_bounded_time() -> (
    None
):
    """The same on the WSGI middleware (Flask, a threaded server), which cannot cut a call
    short itself: the store's ``read_timeout`` (10 s by default) cuts the statement sent on the
    connection gone silent, the completion fails, and the response goes out while the store is
    still silent (before, it waited for as long as the store stayed silent). A repeat then gets
    ``409``."""
    await _silent_at_completion(_wsgi, "silent")


async def _silent_at_completion(
    serve: Callable[[str], contextlib.AbstractContextManager[str]], how: str
) -> None:
    with _store("postgres") as quick:
        url = quick.replace("&connect_timeout=1", "")  # the default: 10 s
        async with Proxy(url) as proxy, httpx.AsyncClient(timeout=60) as client:
            with serve(proxy.url) as base:
                warm = {"id": f"warm-{uuid.uuid4().hex[:8]}"}
                headers = {"Idempotency-Key": key()}
                assert (
                    await client.post(f"{base}/orders", json=warm, headers=headers)
                ).status_code == 201

                async def go_silent() -> None:
                    await asyncio.sleep(0.3)  # the handler runs (one second)
                    if how == "cut":
                        proxy.cut()
                    proxy.silent = True
                    await asyncio.sleep(SILENT_FOR[how])
                    proxy.silent = False
                    proxy.cut()  # what was swallowed is lost: the held connections go

                order = f"silent-{uuid.uuid4().hex[:8]}"
                body = {"id": order, "sleep": 1.0}
                headers = {"Idempotency-Key": key()}
                outage = asyncio.create_task(go_silent())
                try:
                    first = await client.post(f"{base}/orders", json=body, headers=headers)
                    assert proxy.silent, "the response waited for the store to come back"
                    assert first.status_code == 201 and first.json()["run"] == 1
                finally:
                    await outage
                # The store is back; a request that meets one of its reset connections gets
                # 503 (nothing run): the client retries, as its Retry-After says.
                for _ in range(50):
                    again = await client.post(f"{base}/orders", json=body, headers=headers)
                    if again.status_code != 503:
                        break
                    await asyncio.sleep(0.2)
                assert again.status_code == 409  # held until its lease lapses: not run again
                assert (await client.get(f"{base}/effects")).json()[order] == 1


@pytest.mark.slow
async def test_r19_asgi_a_store_gone_silent_before_the_claim_answers_503_and_runs_nothing() -> None:
    """PostgreSQL reached through a relay that has gone silent (its connections held, nothing
    relayed) when a request with a key arrives: the client gets ``503`` with ``Retry-After``
    while the store is still silent (before, the claim waited on the silent connection for as
    long as TCP takes to give up: the request hung), nothing runs, and once the store is back
    the retry runs the request once."""
    await _silent_before_the_claim(_asgi)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["postgres", "mysql"])
async def test_r19_wsgi_a_store_gone_silent_before_the_claim_answers_503_and_runs_nothing(
    kind: str,
) -> None:
    """The same on the WSGI middleware, on PostgreSQL and on MariaDB: the claim's statement is
    cut at the store's ``read_timeout`` (10 s by default) and the client gets ``503`` while
    the store is still silent (before, the request hung until the store came back)."""
    await _silent_before_the_claim(_wsgi, kind)


async def _silent_before_the_claim(
    serve: Callable[[str], contextlib.AbstractContextManager[str]], kind: str = "postgres"
) -> None:
    with _store(kind) as quick:
        url = quick.replace("&connect_timeout=1", "")  # the default: 10 s
        async with Proxy(url) as proxy, httpx.AsyncClient(timeout=60) as client:
            with serve(proxy.url) as base:
                warm = {"id": f"warm-{uuid.uuid4().hex[:8]}"}
                headers = {"Idempotency-Key": key()}
                assert (
                    await client.post(f"{base}/orders", json=warm, headers=headers)
                ).status_code == 201
                proxy.silent = True

                async def back_later() -> None:
                    await asyncio.sleep(SILENT_FOR["silent"])
                    proxy.silent = False
                    proxy.cut()  # what was swallowed is lost: the held connections go

                order = f"claim-{uuid.uuid4().hex[:8]}"
                body = {"id": order}
                headers = {"Idempotency-Key": key()}
                outage = asyncio.create_task(back_later())
                try:
                    first = await client.post(f"{base}/orders", json=body, headers=headers)
                    assert proxy.silent, "the request waited for the store to come back"
                    assert first.status_code == 503, first.text
                    assert first.headers["content-type"] == "application/problem+json"
                    assert "retry-after" in first.headers
                finally:
                    await outage
                for _ in range(50):  # the store's pool comes back on its own
                    again = await client.post(f"{base}/orders", json=body, headers=headers)
                    if again.status_code != 503:
                        break
                    await asyncio.sleep(0.2)
                assert again.status_code == 201, again.text
                assert (await client.get(f"{base}/effects")).json()[order] == 1


async def test_r19_asgi_a_client_gone_while_the_record_waits_for_the_store_is_still_recorded(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Starlette's ``StreamingResponse`` cancels its stream when the client goes away, which
    a client that gives up on a response held back by a store outage does. Before, that
    cancelled the middleware's tries to record the finished request: the record stayed held
    by nobody (a retry got ``409`` until the lease lapsed, then ran the request again), and
    nothing was logged. Now the tries go on, and once the store is back a retry is a replay."""
    from starlette.responses import StreamingResponse

    runs: list[int] = []
    gone = asyncio.Event()
    async with _relayed("redis") as proxy:
        store = oncely.open_async(proxy.url)
        inbox = oncely.AsyncInbox(store, consumer="api")

        async def chunks() -> AsyncIterator[bytes]:
            yield b"part one, "
            proxy.refusing = True  # the store goes away as the stream ends
            proxy.cut()
            yield b"part two"

        async def app(scope: Scope, receive: Receive, send: Send) -> None:
            runs.append(1)
            await StreamingResponse(chunks(), status_code=201)(scope, receive, send)

        api = IdempotencyMiddleware(app, inbox=inbox)
        headers = [(b"idempotency-key", key().encode())]
        scope = {"type": "http", "method": "POST", "path": "/report", "headers": headers}

        async def leaving() -> dict[str, Any]:
            if not gone.is_set():
                gone.set()
                return {"type": "http.request", "body": b"", "more_body": False}
            await asyncio.sleep(0.5)  # the client gives up while the response is held back
            return {"type": "http.disconnect"}

        sent: list[dict[str, Any]] = []

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        caplog.set_level(logging.INFO, logger="oncely")
        try:
            await api(scope, leaving, send)  # type: ignore[arg-type]
            assert not any(m.get("more_body") is False for m in sent)  # the end never went
            await asyncio.sleep(0.5)
            proxy.refusing = False  # back well within the middleware's 5 s of tries
            replies: list[dict[str, Any]] = []
            for _ in range(80):
                replies.clear()

                async def once() -> dict[str, Any]:
                    return {"type": "http.request", "body": b"", "more_body": False}

                async def keep(message: dict[str, Any]) -> None:
                    replies.append(message)

                await api(scope, once, keep)  # type: ignore[arg-type]
                if replies[0]["status"] != 409:
                    break
                await asyncio.sleep(0.1)
            assert (
                replies[0]["status"] == 201
                and (b"idempotent-replayed", b"true") in (replies[0]["headers"])
            )
            assert replies[1]["body"] == b"part one, part two"
        finally:
            await inbox.aclose()
            await store.aclose()
    assert runs == [1]

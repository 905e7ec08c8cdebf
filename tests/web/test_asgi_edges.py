"""The ASGI middleware where a request or a response is not one plain message: a streamed
response, a client that goes away mid-upload, a retried multipart upload, a store that is
down, a response larger than the inbox keeps, a webhook id function of the user's own; served
by uvicorn where the server's own behaviour matters (R19)."""

from __future__ import annotations

import asyncio
import io
import logging
import socket
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest

import oncely
from oncely.http import IdempotencyMiddleware, Receive, Scope, Send, WSGIIdempotencyMiddleware
from tests.brokers.common import free_port
from tests.web.test_asgi import _store, effects, key, serving


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    url, drop = _store("sqlite", tmp_path_factory.mktemp("edges"))
    try:
        with serving(url, "starlette") as base:
            yield base
    finally:
        drop()


async def test_r19_a_streamed_response_reaches_the_client_whole_and_is_replayed_whole(
    server: str,
) -> None:
    # Before, the app was told the client had gone as soon as it had read the body: the
    # stream stopped after its first chunk, and that first chunk was what a repeat got.
    async with httpx.AsyncClient(base_url=server, timeout=30) as client:
        k, n = key(), 5 + uuid.uuid4().int % 50
        whole = "".join(f"chunk {i}\n" for i in range(n)).encode()
        first = await client.post(f"/stream?n={n}", headers={"Idempotency-Key": k})
        assert first.status_code == 201 and first.content == whole
        again = await client.post(f"/stream?n={n}", headers={"Idempotency-Key": k})
        assert again.headers["idempotent-replayed"] == "true" and again.content == whole
        assert (await effects(client))[f"stream:{n}"] == 1


def test_r19_a_client_gone_mid_upload_claims_nothing_and_its_retry_runs(server: str) -> None:
    # Before, the part that had arrived was taken for the whole body: the app ran on it, its
    # response was kept, and the client's retry with the whole body was refused (422).
    parts = urlsplit(server)
    k = key()
    size = 1000 + uuid.uuid4().int % 1000
    body = b"x" * size
    with socket.create_connection((parts.hostname, parts.port)) as sock:
        sock.sendall(
            b"POST /notes HTTP/1.1\r\nHost: shop\r\nIdempotency-Key: "
            + k.encode()
            + b"\r\nContent-Length: %d\r\n\r\n" % size
            + body[:100]
        )
        sock.settimeout(1.0)
        with pytest.raises(TimeoutError):
            sock.recv(1)  # no answer: the server waits for the rest of the body
    with httpx.Client(base_url=server) as client:
        retried = client.post("/notes", content=body, headers={"Idempotency-Key": k})
        assert retried.status_code == 201 and retried.json() == {"size": size, "run": 1}
        done = client.get("/effects").json()
    assert done[f"note:{size}"] == 1 and "note:100" not in done


async def test_r19_a_retried_multipart_upload_is_the_same_request(server: str) -> None:
    # Each request draws a new multipart boundary: before, the retry of an upload was taken
    # for another body under the same key (422).
    async with httpx.AsyncClient(base_url=server) as client:
        k = key()
        content = uuid.uuid4().bytes * 40
        sent = [
            await client.post(
                "/notes",
                files={"scan": ("scan.bin", content)},
                data={"note": "receipt"},
                headers={"Idempotency-Key": k},
            )
            for _ in range(2)
        ]
        assert [a.status_code for a in sent] == [201, 201]
        assert sent[1].headers["idempotent-replayed"] == "true"
        other = await client.post(
            "/notes", files={"scan": ("scan.bin", content + b"!")}, headers={"Idempotency-Key": k}
        )
        assert other.status_code == 422  # another file under the same key is still refused
        assert (await effects(client))[f"note:{sent[0].json()['size']}"] == 1


async def test_r19_a_store_that_is_down_answers_503_and_runs_nothing(tmp_path: Path) -> None:
    # Before, a plain-text 500 (and a traceback in the log): nothing said a retry was safe.
    store = f"postgresql://postgres@127.0.0.1:{free_port()}/test"
    with serving(store, "starlette") as base:
        async with httpx.AsyncClient(base_url=base) as client:
            got = await client.post(
                "/orders", json={"id": "down-1"}, headers={"Idempotency-Key": key()}
            )
            assert got.status_code == 503
            assert got.headers["content-type"] == "application/problem+json"
            assert int(got.headers["retry-after"]) > 0
            assert "not run" in got.json()["detail"]
            assert "down-1" not in await effects(client)


async def _app_of(size: int, answered: list[int]) -> Any:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        answered.append(size)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"r" * size})

    return app


async def test_r19_a_response_larger_than_the_inbox_keeps_says_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Before, max_stored_bytes (1 MiB) let it through, the inbox's own limit (256 KiB after
    # encoding) dropped it with an ERROR line, and the repeat's 409 blamed max_stored_bytes.
    answered: list[int] = []
    limits = oncely.Limits(max_result_bytes=10_000)
    inbox = oncely.AsyncInbox(oncely.open_async("memory://"), consumer="api", limits=limits)
    api = IdempotencyMiddleware(await _app_of(9_000, answered), inbox=inbox)
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=api), base_url="http://shop"
    ) as client:
        caplog.set_level(logging.WARNING, logger="oncely")
        headers = {"Idempotency-Key": key()}
        first = await client.post("/report", headers=headers)
        assert first.status_code == 200 and len(first.content) == 9_000
        again = await client.post("/report", headers=headers)
        assert again.status_code == 409 and "too large to keep" in again.json()["detail"]
    assert answered == [9_000]
    said = [r.getMessage() for r in caplog.records]
    assert any("max_result_bytes=10000" in line for line in said), said
    assert not any(r.levelno >= logging.ERROR for r in caplog.records), said


async def test_r19_a_response_larger_than_mariadb_takes_is_not_kept_and_says_why(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Limits raised far above the server's max_allowed_packet: a response over what the
    store takes is answered, kept as too large (a repeat gets the 409 that says so, never a
    second run), and the log line names the server's bound, not the inbox's limit."""
    from oncely.stores.mysql.async_store import AsyncMySQLStore
    from tests.backends.mysql import drop_tables, url
    from tests.services import MYSQL_URL, require

    require("MariaDB", MYSQL_URL, 3306)
    table = f"oncely_m_{uuid.uuid4().hex[:12]}"
    store = AsyncMySQLStore.from_url(url(table))
    answered: list[int] = []
    big = 64 * 1024 * 1024
    try:
        inbox = oncely.AsyncInbox(store, consumer="api", limits=oncely.Limits(max_result_bytes=big))
        api = IdempotencyMiddleware(
            await _app_of(9_000_000, answered), inbox=inbox, max_stored_bytes=big
        )
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=api), base_url="http://shop"
        ) as client:
            caplog.set_level(logging.WARNING, logger="oncely")
            headers = {"Idempotency-Key": key()}
            first = await client.post("/report", headers=headers)
            assert first.status_code == 200 and len(first.content) == 9_000_000
            again = await client.post("/report", headers=headers)
            assert again.status_code == 409 and "too large to keep" in again.json()["detail"]
    finally:
        await store.aclose()
        drop_tables(table)
    assert answered == [9_000_000]
    said = [r.getMessage() for r in caplog.records]
    assert any("max_allowed_packet" in line for line in said), said
    # Kept by the middleware as too large (a WARNING), not dropped by the inbox (an ERROR).
    assert not any(r.levelno >= logging.ERROR for r in caplog.records), said


async def test_r19_a_key_function_gets_the_scope_and_a_value_error_is_a_400() -> None:
    seen: list[str] = []

    def tenant_event(scope: Scope, body: bytes) -> str | None:
        seen.append(scope["path"])
        if not body:
            return None
        if not body.isdigit():
            raise ValueError("the event id is not a number")
        return f"{scope['path']}:{body.decode()}"

    answered: list[int] = []
    inbox = oncely.AsyncInbox(oncely.open_async("memory://"), consumer="hooks")
    api = IdempotencyMiddleware(await _app_of(2, answered), inbox=inbox, key=tenant_event)
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=api), base_url="http://shop"
    ) as client:
        assert (await client.post("/hooks/a", content=b"17")).status_code == 200
        replay = await client.post("/hooks/a", content=b"17")
        assert replay.headers["idempotent-replayed"] == "true"
        bad = await client.post("/hooks/a", content=b"x17")
        assert bad.status_code == 400 and bad.json()["detail"] == "the event id is not a number"
        none = await client.post("/hooks/a", content=b"")
        assert none.status_code == 400 and "no id this endpoint needs" in none.json()["detail"]
    assert seen == ["/hooks/a"] * 4 and answered == [2]


def test_r19_a_chunked_wsgi_request_is_read_to_its_end() -> None:
    # Without a Content-Length (a chunked request), servers that mark their input
    # terminated give the whole body: before, the middleware read none of it.
    got: list[bytes] = []

    def app(environ: dict[str, Any], start_response: Any) -> list[bytes]:
        got.append(environ["wsgi.input"].read())
        start_response("201 Created", [("Content-Type", "text/plain")])
        return [b"ok"]

    inbox = oncely.Inbox(oncely.open("memory://"), consumer="api")
    api = WSGIIdempotencyMiddleware(app, inbox=inbox)
    body = uuid.uuid4().bytes * 1000
    answered: list[str] = []

    def start_response(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> None:
        answered.append(status)

    for _ in range(2):
        environ = {
            "REQUEST_METHOD": "POST",
            "PATH_INFO": "/upload",
            "HTTP_IDEMPOTENCY_KEY": '"chunked-1"',
            "wsgi.input": io.BytesIO(body),
            "wsgi.input_terminated": True,
        }
        out = api(environ, start_response)
        assert answered.pop() == "201 Created" and b"".join(out) == b"ok"
    assert got == [body]  # the repeat was the same request: replayed, not run


async def test_r19_a_response_not_kept_is_logged_as_released_without_a_traceback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Before: "failed ... handler raised _Released: the app answered 500", with a traceback
    # naming a private class, as if the middleware had crashed.
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 503, "headers": []})
        await send({"type": "http.response.body", "body": b"later"})

    inbox = oncely.AsyncInbox(oncely.open_async("memory://"), consumer="api")
    api = IdempotencyMiddleware(app, inbox=inbox)
    caplog.set_level(logging.INFO, logger="oncely")
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=api), base_url="http://shop"
    ) as client:
        assert (await client.post("/o", headers={"Idempotency-Key": key()})).status_code == 503
    failed = [r for r in caplog.records if r.getMessage().startswith("failed ")]
    assert failed and "reason=released: the app answered 503" in failed[0].getMessage()
    assert failed[0].exc_info is None and "_Released" not in caplog.text


async def test_r19_a_misspelt_option_and_an_overlong_key_say_what_is_wrong() -> None:
    inbox = oncely.AsyncInbox(oncely.open_async("memory://"), consumer="api")
    with pytest.raises(oncely.ConfigurationError, match="did you mean 'methods'"):
        IdempotencyMiddleware(await _app_of(2, []), inbox=inbox, methodz=["POST"])
    api = IdempotencyMiddleware(await _app_of(2, []), inbox=inbox, max_key_chars=40)
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=api), base_url="http://shop"
    ) as client:
        long = await client.post("/o", headers={"Idempotency-Key": '"' + "k" * 41 + '"'})
        assert long.status_code == 400
        assert long.json()["detail"] == (
            "the Idempotency-Key has 41 characters; this endpoint takes at most 40"
        )
        fits = await client.post("/o", headers={"Idempotency-Key": '"' + "k" * 40 + '"'})
        assert fits.status_code == 200


async def test_r19_cookies_with_the_default_principal_are_warned_about_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from oncely import http

    http._COOKIES_SEEN.clear()
    inbox = oncely.AsyncInbox(oncely.open_async("memory://"), consumer="api")
    api = IdempotencyMiddleware(await _app_of(2, []), inbox=inbox)
    caplog.set_level(logging.WARNING, logger="oncely.http")
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=api), base_url="http://shop"
    ) as client:
        for n in range(3):
            headers = {"Idempotency-Key": key(), "Cookie": f"session=s{n}"}
            assert (await client.post("/o", headers=headers)).status_code == 200
    said = [r.getMessage() for r in caplog.records if "cookie" in r.getMessage()]
    assert len(said) == 1 and "principal=" in said[0]


async def test_r19_an_api_key_header_with_the_default_principal_is_warned_about(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Before, clients that name themselves with X-API-Key all shared the 'anonymous' scope
    without a word: one could be answered with another's response."""
    from oncely import http

    http._COOKIES_SEEN.clear()
    inbox = oncely.AsyncInbox(oncely.open_async("memory://"), consumer="api")
    api = IdempotencyMiddleware(await _app_of(2, []), inbox=inbox)
    caplog.set_level(logging.WARNING, logger="oncely.http")
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=api), base_url="http://shop"
    ) as client:
        for n in range(2):
            headers = {"Idempotency-Key": key(), "X-API-Key": f"client-{n}"}
            assert (await client.post("/o", headers=headers)).status_code == 200
    said = [r.getMessage() for r in caplog.records if "x-api-key" in r.getMessage()]
    assert len(said) == 1 and "principal=" in said[0], said


async def test_r19_a_valid_key_on_a_long_path_is_taken_and_long_paths_stay_apart(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Before, the scoped key (principal, method, path, key) went over the inbox's 512 bytes:
    # "400 Invalid Idempotency-Key" for a valid key, advising a CLI option, logged at ERROR.
    answered: list[str] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        answered.append(scope["path"])
        body = scope["path"][-1:].encode()
        await send({"type": "http.response.start", "status": 201, "headers": []})
        await send({"type": "http.response.body", "body": body})

    inbox = oncely.AsyncInbox(oncely.open_async("memory://"), consumer="api")
    api = IdempotencyMiddleware(app, inbox=inbox, principal=lambda scope: "tenant-" + "t" * 300)
    caplog.set_level(logging.INFO, logger="oncely")
    a, b = "/" + "p" * 398 + "a", "/" + "p" * 398 + "b"
    headers = {"Idempotency-Key": '"' + "k" * 200 + '"'}
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=api), base_url="http://shop"
    ) as client:
        for path in (a, b, a, b):
            got = await client.post(path, headers=headers)
            assert got.status_code == 201, got.text
            assert got.content == path[-1:].encode()
        assert (await client.post(b, headers=headers)).headers["idempotent-replayed"] == "true"
    assert answered == [a, b]  # each long path its own scope, each run once
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


def test_r19_wsgi_a_valid_key_on_a_long_path_is_taken_and_long_paths_stay_apart() -> None:
    answered: list[str] = []

    def app(environ: dict[str, Any], start_response: Any) -> list[bytes]:
        answered.append(environ["PATH_INFO"])
        start_response("201 Created", [("Content-Type", "text/plain")])
        return [environ["PATH_INFO"][-1:].encode()]

    inbox = oncely.Inbox(oncely.open("memory://"), consumer="api")
    api = WSGIIdempotencyMiddleware(app, inbox=inbox)
    a, b = "/" + "p" * 398 + "a", "/" + "p" * 398 + "b"
    statuses: list[str] = []

    def start_response(status: str, headers: Any, exc_info: Any = None) -> None:
        statuses.append(status)

    for path in (a, b, a, b):
        environ = {
            "REQUEST_METHOD": "POST",
            "PATH_INFO": path,
            "HTTP_IDEMPOTENCY_KEY": '"' + "k" * 200 + '"',
            "wsgi.input": io.BytesIO(b""),
        }
        assert b"".join(api(environ, start_response)) == path[-1:].encode()
    assert statuses == ["201 Created"] * 4 and answered == [a, b]


@pytest.mark.parametrize("transactional", [False, True], ids=["two-phase", "transactional"])
async def test_r19_a_file_response_on_a_server_that_sends_files_itself_is_kept(
    transactional: bool, tmp_path: Path
) -> None:
    # A server that offers the http.response.pathsend extension (Granian, for one) gets
    # Starlette's FileResponse as a path to send, not as body messages. Before, the middleware
    # saw a response that never ended: it was not kept, and a repeat ran the request again.
    from starlette.responses import FileResponse

    report = tmp_path / "report.csv"
    report.write_bytes(b"order,amount\n" + uuid.uuid4().hex.encode())
    runs: list[int] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        runs.append(1)
        await FileResponse(report, status_code=201)(scope, receive, send)

    inbox = oncely.AsyncInbox(
        oncely.open_async(f"sqlite:///{tmp_path / 'inbox.db'}"), consumer="reports"
    )
    api = IdempotencyMiddleware(app, inbox=inbox, transactional=transactional)
    headers = [(b"idempotency-key", key().encode())]

    async def request() -> tuple[int, dict[bytes, bytes], bytes]:
        scope = {
            "type": "http",
            "method": "POST",
            "path": "/reports",
            "headers": headers,
            "extensions": {"http.response.pathsend": {}},
        }
        started: dict[str, Any] = {}
        body: list[bytes] = []
        asked: list[int] = []

        async def receive() -> dict[str, Any]:
            asked.append(1)
            if len(asked) > 1:  # the client stays: nothing more until the response is sent
                await asyncio.Event().wait()
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                started.update(message)
            elif message["type"] == "http.response.pathsend":  # the server sends the file
                body.append(Path(message["path"]).read_bytes())
            else:
                body.append(message.get("body", b""))

        await api(scope, receive, send)  # type: ignore[arg-type]
        return started["status"], dict(started["headers"]), b"".join(body)

    try:
        first = await request()
        again = await request()
    finally:
        await inbox.aclose()
        await inbox.store.aclose()
    assert first[0] == again[0] == 201 and first[2] == again[2] == report.read_bytes()
    assert again[1][b"idempotent-replayed"] == b"true"
    assert runs == [1]


async def test_r17_the_requests_context_ends_with_it_and_never_reaches_the_next() -> None:
    """The endpoint sees its request as ``oncely.current()``; once the middleware is done
    (the response sent, or the app raised), the task that ran it has none again, so a next
    request on the task (or code after the middleware) never takes another's key."""
    seen: list[str | None] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await receive()
        now = oncely.current()
        seen.append(None if now is None else now.downstream_key("charge"))
        if scope["path"] == "/broken":
            raise RuntimeError("the endpoint broke")
        await send({"type": "http.response.start", "status": 201, "headers": []})
        await send({"type": "http.response.body", "body": b"booked"})

    inbox = oncely.AsyncInbox(oncely.open_async("memory://"), consumer="orders-api")
    api = IdempotencyMiddleware(app, inbox=inbox)
    transport = httpx.ASGITransport(app=api)  # the app runs in this very task
    async with httpx.AsyncClient(transport=transport, base_url="http://shop") as client:
        k = key()
        assert (await client.post("/orders", headers={"Idempotency-Key": k})).status_code == 201
        assert oncely.current() is None
        with pytest.raises(RuntimeError, match="the endpoint broke"):
            await client.post("/broken", headers={"Idempotency-Key": key()})
        assert oncely.current() is None
        assert (await client.post("/orders")).status_code == 201  # no key: not oncely's
    assert seen[0] is not None and seen[1] not in (None, seen[0]) and seen[2] is None

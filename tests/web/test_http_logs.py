"""What the HTTP middlewares log, by level: a client's mistake (a key reused for another
request) is a WARNING, not the ERROR a message consumer logs for a producer's bug; a response
that is not kept in transactional mode is logged as such, without an internal traceback
(R16, R19)."""

from __future__ import annotations

import io
import logging
import socket
from pathlib import Path
from typing import Any

import httpx
import pytest

import oncely
from oncely.http import IdempotencyMiddleware, Receive, Scope, Send, WSGIIdempotencyMiddleware
from tests.web.test_asgi import key


def _levels(caplog: pytest.LogCaptureFixture, outcome: str) -> list[int]:
    return [r.levelno for r in caplog.records if r.getMessage().startswith(outcome + " ")]


async def _echo(scope: Scope, receive: Receive, send: Send) -> None:
    message = await receive()
    await send({"type": "http.response.start", "status": 201, "headers": []})
    await send({"type": "http.response.body", "body": message.get("body", b"")})


@pytest.mark.parametrize("transactional", [False, True], ids=["two-phase", "transactional"])
async def test_r16_a_key_reused_by_an_http_client_is_a_warning(
    caplog: pytest.LogCaptureFixture, tmp_path: Path, transactional: bool
) -> None:
    # Before, every 422 was an ERROR line: any client could write ERROR logs at will.
    store = oncely.open_async(f"sqlite:///{tmp_path / 'inbox.db'}")
    inbox = oncely.AsyncInbox(store, consumer="api")
    api = IdempotencyMiddleware(_echo, inbox=inbox, transactional=transactional)
    caplog.set_level(logging.INFO, logger="oncely")
    try:
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=api), base_url="http://shop"
        ) as client:
            headers = {"Idempotency-Key": key()}
            assert (await client.post("/o", content=b"1", headers=headers)).status_code == 201
            assert (await client.post("/o", content=b"2", headers=headers)).status_code == 422
    finally:
        await store.aclose()
    assert _levels(caplog, "key_conflict") == [logging.WARNING]
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


def test_r16_wsgi_a_key_reused_by_an_http_client_is_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def app(environ: dict[str, Any], start_response: Any) -> list[bytes]:
        start_response("201 Created", [])
        return [environ["wsgi.input"].read()]

    api = WSGIIdempotencyMiddleware(app, inbox=oncely.Inbox(oncely.open("memory://"), consumer="a"))
    caplog.set_level(logging.INFO, logger="oncely")
    statuses: list[str] = []
    for body in (b"1", b"2"):
        environ = {
            "REQUEST_METHOD": "POST",
            "PATH_INFO": "/o",
            "HTTP_IDEMPOTENCY_KEY": '"reused-1"',
            "CONTENT_LENGTH": "1",
            "wsgi.input": io.BytesIO(body),
        }
        api(environ, lambda status, headers, exc_info=None: statuses.append(status))
    assert [s[:3] for s in statuses] == ["201", "422"]
    assert _levels(caplog, "key_conflict") == [logging.WARNING]


async def test_r16_a_consumer_s_reused_key_is_still_an_error_inside_a_request_too(
    caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    # The lower level is for the HTTP layer's own keys: an inbox the app uses while it
    # handles a request (here inside the request's transaction) logs as it always did.
    jobs = oncely.AsyncInbox(oncely.open_async("memory://"), consumer="jobs")

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await receive()
        await jobs.handle("job-1", {"n": 1}, lambda payload: None)
        await jobs.handle("job-1", {"n": 2}, lambda payload: None)
        await send({"type": "http.response.start", "status": 201, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    store = oncely.open_async(f"sqlite:///{tmp_path / 'inbox.db'}")
    api = IdempotencyMiddleware(
        app, inbox=oncely.AsyncInbox(store, consumer="api"), transactional=True
    )
    caplog.set_level(logging.INFO, logger="oncely")
    try:
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=api), base_url="http://shop"
        ) as client:
            assert (await client.post("/o", headers={"Idempotency-Key": key()})).status_code == 201
    finally:
        await store.aclose()
    assert _levels(caplog, "key_conflict") == [logging.ERROR]
    plain = oncely.AsyncInbox(oncely.open_async("memory://"), consumer="jobs")
    caplog.clear()
    await plain.handle("job-2", {"n": 1}, lambda payload: None)
    await plain.handle("job-2", {"n": 2}, lambda payload: None)
    assert _levels(caplog, "key_conflict") == [logging.ERROR]


async def test_r16_a_transactional_5xx_is_logged_as_not_kept_without_a_traceback(
    caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    # Before: "failed ... reason=handler raised _NotKept: ...", with a traceback naming an
    # internal class, as if the middleware had crashed.
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await receive()
        await send({"type": "http.response.start", "status": 503, "headers": []})
        await send({"type": "http.response.body", "body": b"later"})

    store = oncely.open_async(f"sqlite:///{tmp_path / 'inbox.db'}")
    api = IdempotencyMiddleware(
        app, inbox=oncely.AsyncInbox(store, consumer="api"), transactional=True
    )
    caplog.set_level(logging.INFO, logger="oncely")
    try:
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=api), base_url="http://shop"
        ) as client:
            got = await client.post("/o", headers={"Idempotency-Key": key()})
            assert got.status_code == 503 and got.content == b"later"
    finally:
        await store.aclose()
    failed = [r for r in caplog.records if r.getMessage().startswith("failed ")]
    assert len(failed) == 1 and failed[0].levelno == logging.WARNING
    said = failed[0].getMessage()
    assert "the app answered 503: not kept" in said and "rolled back" in said
    assert failed[0].exc_info is None and "_NotKept" not in caplog.text
    assert "Traceback" not in caplog.text


def test_r16_wsgi_a_transactional_5xx_is_logged_as_not_kept_without_a_traceback(
    caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    def app(environ: dict[str, Any], start_response: Any) -> list[bytes]:
        start_response("500 Internal Server Error", [])
        return [b"broke"]

    inbox = oncely.Inbox(oncely.open(f"sqlite:///{tmp_path / 'inbox.db'}"), consumer="api")
    api = WSGIIdempotencyMiddleware(app, inbox=inbox, transactional=True)
    caplog.set_level(logging.INFO, logger="oncely")
    environ = {
        "REQUEST_METHOD": "POST",
        "PATH_INFO": "/o",
        "HTTP_IDEMPOTENCY_KEY": '"tx-500"',
        "wsgi.input": io.BytesIO(b""),
    }
    statuses: list[str] = []
    out = api(environ, lambda status, headers, exc_info=None: statuses.append(status))
    assert statuses == ["500 Internal Server Error"] and b"".join(out) == b"broke"
    failed = [r for r in caplog.records if r.getMessage().startswith("failed ")]
    assert len(failed) == 1 and "the app answered 500: not kept" in failed[0].getMessage()
    assert failed[0].exc_info is None and "_NotKept" not in caplog.text
    inbox.store.close()


def _shown_hashed(caplog: pytest.LogCaptureFixture, client_key: str, says: str) -> None:
    """Every oncely record (its message, fields and traceback) leaves the client's key out,
    and the line that ``says`` what happened names it hashed (``key=h:...``)."""
    ours = [r for r in caplog.records if r.name.startswith("oncely")]
    for record in ours:
        fields = {k: v for k, v in vars(record).items() if k.startswith("oncely_")}
        text = logging.Formatter("%(message)s").format(record)
        assert client_key not in f"{text} {fields}", text
    said = [r.getMessage() for r in ours if says in r.getMessage()]
    assert said and all("key=h:" in line for line in said), [r.getMessage() for r in ours]


async def test_r16_an_http_line_shows_the_key_as_the_inbox_does_a_response_not_kept(
    caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    """The inbox's ``log_keys="hash"`` reaches the middleware's own lines: a response over
    ``max_stored_bytes`` is logged with the request's key hashed, never as the client sent
    it (a key may be personal data: an order number, an e-mail)."""
    client_key = "order-for-alice@example.com"
    store = oncely.open_async(f"sqlite:///{tmp_path / 'inbox.db'}")
    inbox = oncely.AsyncInbox(store, consumer="api", log_keys="hash")
    api = IdempotencyMiddleware(_echo, inbox=inbox, max_stored_bytes=1)
    caplog.set_level(logging.INFO, logger="oncely")
    try:
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=api), base_url="http://shop"
        ) as client:
            headers = {"Idempotency-Key": f'"{client_key}"'}
            assert (await client.post("/o", content=b"12", headers=headers)).status_code == 201
    finally:
        await store.aclose()
    _shown_hashed(caplog, client_key, "was sent but not kept")


async def test_r16_an_http_line_shows_the_key_as_the_inbox_does_a_store_down(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A store that refuses the connection (a real Redis port with nothing behind it): the
    503's line shows the key hashed under ``log_keys="hash"``."""
    client_key = "order-for-bob@example.com"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = oncely.open_async(f"redis://127.0.0.1:{port}/0")
    inbox = oncely.AsyncInbox(store, consumer="api", log_keys="hash")
    api = IdempotencyMiddleware(_echo, inbox=inbox)
    caplog.set_level(logging.INFO, logger="oncely")
    try:
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=api), base_url="http://shop"
        ) as client:
            headers = {"Idempotency-Key": f'"{client_key}"'}
            assert (await client.post("/o", content=b"1", headers=headers)).status_code == 503
    finally:
        await store.aclose()
    _shown_hashed(caplog, client_key, "the store cannot be reached")

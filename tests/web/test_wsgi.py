"""The WSGI middleware on a real server: a Flask app behind ``WSGIIdempotencyMiddleware`` on
a sync Inbox, served by a threaded ``wsgiref`` server in a process of its own, driven by
httpx, on SQLite, PostgreSQL and Redis stores (R19)."""

from __future__ import annotations

import asyncio
import contextlib
import io
import socket
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest

import oncely
from oncely.http import WSGIIdempotencyMiddleware
from tests.web.test_asgi import _same_response, _store, key, serving_command


def serving(store_url: str) -> contextlib.AbstractContextManager[str]:
    """The Flask app of ``tests/web/wsgi_app.py`` on ``store_url``."""
    return serving_command(
        [sys.executable, "-m", "tests.web.wsgi_app", "{port}"], ONCELY_TEST_HTTP_STORE=store_url
    )


@pytest.fixture(scope="module", params=["sqlite", "postgres", "redis"])
def server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    url, drop = _store(request.param, tmp_path_factory.mktemp(request.param))
    try:
        with serving(url) as base:
            yield base
    finally:
        drop()


def effects(client: httpx.Client) -> dict[str, int]:
    return dict(client.get("/effects").json())


def test_r19_wsgi_a_repeat_gets_the_first_response_byte_for_byte(server: str) -> None:
    with httpx.Client(base_url=server) as client:
        k, order = key(), f"o-{uuid.uuid4().hex[:8]}"
        first = client.post("/orders", json={"id": order}, headers={"Idempotency-Key": k})
        assert first.status_code == 201 and first.headers["x-app"] == "flask"
        again = client.post("/orders", json={"id": order}, headers={"Idempotency-Key": k})
        assert again.headers["idempotent-replayed"] == "true"
        _same_response(first, again)
        other = client.post("/orders", json={"id": order, "n": 2}, headers={"Idempotency-Key": k})
        assert other.status_code == 422
        missing = client.post("/orders", json={"id": "none"})
        assert missing.status_code == 400
        assert missing.headers["content-type"] == "application/problem+json"
        assert effects(client).get(order) == 1 and "none" not in effects(client)


def test_r19_wsgi_a_repeat_while_the_first_runs_is_409(server: str) -> None:
    async def race() -> list[int]:
        async with httpx.AsyncClient(base_url=server, timeout=30) as client:
            k, body = key(), {"id": f"slow-{uuid.uuid4().hex[:8]}", "sleep": 1.0}
            first = asyncio.create_task(
                client.post("/orders", json=body, headers={"Idempotency-Key": k})
            )
            await asyncio.sleep(0.3)
            repeats = await asyncio.gather(
                *(
                    client.post("/orders", json=body, headers={"Idempotency-Key": k})
                    for _ in range(3)
                )
            )
            return [(await first).status_code, *(r.status_code for r in repeats)]

    assert asyncio.run(race()) == [201, 409, 409, 409]


def test_r19_wsgi_a_5xx_is_not_kept_clients_are_apart_and_big_responses_not_replayed(
    server: str,
) -> None:
    with httpx.Client(base_url=server) as client:
        k, order = key(), f"f-{uuid.uuid4().hex[:8]}"
        body = {"id": order, "fail_once": True}
        assert client.post("/orders", json=body, headers={"Idempotency-Key": k}).status_code == 500
        retry = client.post("/orders", json=body, headers={"Idempotency-Key": k})
        assert retry.status_code == 201 and "idempotent-replayed" not in retry.headers
        assert effects(client)[order] == 2
        shared, a, b = key(), f"a-{uuid.uuid4().hex[:8]}", f"b-{uuid.uuid4().hex[:8]}"
        got_a = client.post(
            "/orders", json={"id": a}, headers={"Idempotency-Key": shared, "X-Client": "A"}
        )
        got_b = client.post(
            "/orders", json={"id": b}, headers={"Idempotency-Key": shared, "X-Client": "B"}
        )
        assert got_a.json()["order"] == a and got_b.json()["order"] == b
        big = {"id": f"big-{uuid.uuid4().hex[:8]}", "pad": 10_000}
        k = key()
        assert client.post("/orders", json=big, headers={"Idempotency-Key": k}).status_code == 201
        again = client.post("/orders", json=big, headers={"Idempotency-Key": k})
        assert again.status_code == 409
        assert effects(client)[big["id"]] == 1


def test_r19_wsgi_middleware_refuses_an_async_inbox(tmp_path: Path) -> None:
    import oncely
    from oncely.http import IdempotencyMiddleware, WSGIIdempotencyMiddleware

    with pytest.raises(oncely.ConfigurationError, match="sync Inbox"):
        WSGIIdempotencyMiddleware(
            lambda e, s: [], inbox=oncely.AsyncInbox(oncely.AsyncMemoryStore(), consumer="x")
        )  # type: ignore[arg-type]
    with pytest.raises(oncely.ConfigurationError, match="AsyncInbox"):
        IdempotencyMiddleware(
            lambda s, r, d: None, inbox=oncely.Inbox(oncely.MemoryStore(), consumer="x")
        )  # type: ignore[arg-type]


def upload_part_and_leave(server: str, path: str, k: str, body: bytes) -> None:
    """Announce ``body`` (its ``Content-Length``), send its first 100 bytes, and go away."""
    parts = urlsplit(server)
    with socket.create_connection((parts.hostname, parts.port)) as sock:
        sock.sendall(
            f"POST {path} HTTP/1.1\r\nHost: shop\r\nIdempotency-Key: {k}\r\n".encode()
            + b"Content-Length: %d\r\n\r\n" % len(body)
            + body[:100]
        )
        sock.shutdown(socket.SHUT_WR)
        sock.settimeout(5.0)
        with contextlib.suppress(OSError):
            while sock.recv(4096):  # whatever the server says, until it closes
                pass


def assert_a_retry_after_a_cut_upload_runs(server: str) -> None:
    """A client sends part of a ``/notes`` body and leaves; its retry with the whole body
    runs once, and nothing ran on the part."""
    k, size = key(), 1000 + uuid.uuid4().int % 1000
    body = b"x" * size
    upload_part_and_leave(server, "/notes", k, body)
    with httpx.Client(base_url=server) as client:
        retried = client.post("/notes", content=body, headers={"Idempotency-Key": k})
        assert retried.status_code == 201 and retried.json() == {"size": size, "run": 1}
        done = effects(client)
    assert done[f"note:{size}"] == 1 and "note:100" not in done


def test_r19_wsgi_a_client_gone_mid_upload_claims_nothing_and_its_retry_runs(server: str) -> None:
    # Before, the part that had arrived was taken for the whole body (a WSGI server's input
    # ends early, without an error): the app ran on it, its response was kept, and the
    # client's retry with the whole body was refused (422).
    assert_a_retry_after_a_cut_upload_runs(server)


class _Parts(io.RawIOBase):
    """A WSGI input that hands its body over a few bytes per read, as PEP 3333 allows."""

    def __init__(self, data: bytes) -> None:
        self.data = data

    def read(self, size: int = -1) -> bytes:
        part, self.data = self.data[:7], self.data[7:]
        return part


def test_r19_wsgi_a_body_handed_over_in_parts_is_read_whole() -> None:
    # Before, one read() of Content-Length bytes was taken for the body: the app ran on its
    # first part, and that part's fingerprint was kept for the key.
    seen: list[bytes] = []

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
        seen.append(environ["wsgi.input"].read())
        start_response("201 Created", [])
        return [b"booked"]

    api = WSGIIdempotencyMiddleware(app, inbox=oncely.Inbox(oncely.open("memory://"), consumer="a"))
    body = uuid.uuid4().bytes * 10
    environ = {
        "REQUEST_METHOD": "POST",
        "PATH_INFO": "/orders",
        "CONTENT_LENGTH": str(len(body)),
        "HTTP_IDEMPOTENCY_KEY": key(),
        "wsgi.input": _Parts(body),
    }
    started: list[str] = []
    answer = b"".join(api(environ, lambda status, headers: started.append(status)))
    assert started == ["201 Created"] and answer == b"booked" and seen == [body]


def test_r17_wsgi_an_endpoint_gets_one_downstream_key_per_idempotency_key(server: str) -> None:
    """Inside the Flask view, ``oncely.current()`` is the request, as a message handler's is
    its message: ``downstream_key("charge")`` is the same on the client's retry of one
    Idempotency-Key and another for another key. Before, there was no context there."""
    with httpx.Client(base_url=server) as client:
        k, order = key(), f"d-{uuid.uuid4().hex[:8]}"
        body = {"id": order, "fail_once": True, "downstream": True}
        failed = client.post("/orders", json=body, headers={"Idempotency-Key": k})
        retry = client.post("/orders", json=body, headers={"Idempotency-Key": k})
        other = client.post(
            "/orders", json={**body, "id": f"{order}-2"}, headers={"Idempotency-Key": key()}
        )
    assert failed.status_code == 500 and retry.status_code == 201
    assert failed.json()["downstream"] is not None
    assert retry.json()["downstream"] == failed.json()["downstream"]
    assert other.json()["downstream"] not in (None, failed.json()["downstream"])


def test_r17_wsgi_the_requests_context_ends_with_it_and_never_reaches_the_next() -> None:
    """The app sees its request as ``oncely.current()``; once the middleware is done (the
    response made, or the app raised), the thread has none again: a server that runs the
    next request on this thread never gives it another request's key."""
    seen: list[str | None] = []

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
        now = oncely.current()
        seen.append(None if now is None else now.downstream_key("charge"))
        if environ["PATH_INFO"] == "/broken":
            raise RuntimeError("the endpoint broke")
        start_response("201 Created", [])
        return [b"booked"]

    api = WSGIIdempotencyMiddleware(app, inbox=oncely.Inbox(oncely.open("memory://"), consumer="a"))

    def call(path: str, k: str | None) -> list[bytes]:
        environ = {
            "REQUEST_METHOD": "POST",
            "PATH_INFO": path,
            "CONTENT_LENGTH": "0",
            "wsgi.input": io.BytesIO(b""),
            **({"HTTP_IDEMPOTENCY_KEY": k} if k else {}),
        }
        return list(api(environ, lambda status, headers: None))

    assert call("/orders", key()) == [b"booked"]
    assert oncely.current() is None
    with pytest.raises(RuntimeError, match="the endpoint broke"):
        call("/broken", key())
    assert oncely.current() is None
    assert call("/orders", None) == [b"booked"]  # no key: not oncely's
    assert seen[0] is not None and seen[1] not in (None, seen[0]) and seen[2] is None

"""The ASGI middleware on a real server: uvicorn serving ``tests/web/app.py`` (a plain ASGI
app, a Starlette one and a FastAPI one) in a process of its own, driven by httpx, on SQLite,
PostgreSQL and Redis stores. Each answer of draft-ietf-httpapi-idempotency-key-header has a
test (R19)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
import redis

from tests.brokers.common import free_port
from tests.services import POSTGRES_DSN, REDIS_URL, require

ROOT = Path(__file__).resolve().parents[2]


def _store(kind: str, tmp: Path) -> tuple[str, Any]:
    """A store URL of the kind, and what drops it afterwards."""
    name = f"http_{uuid.uuid4().hex[:10]}"
    if kind == "sqlite":
        return f"sqlite:///{tmp / 'inbox.db'}", lambda: None
    if kind == "postgres":
        require("PostgreSQL", POSTGRES_DSN, 5432)

        def drop() -> None:
            with psycopg.connect(POSTGRES_DSN, autocommit=True) as conn:
                conn.execute(f'DROP TABLE IF EXISTS "{name}", "{name}_meta"')

        return f"{POSTGRES_DSN}?table={name}", drop
    require("Redis", REDIS_URL, 6379)

    def unlink() -> None:
        client = redis.Redis.from_url(REDIS_URL)
        for found in client.scan_iter(match=f"{name}*"):
            client.delete(found)
        client.close()

    return f"{REDIS_URL}?prefix={name}", unlink


@contextlib.contextmanager
def serving_command(
    command: list[str], started: list[subprocess.Popen[str]] | None = None, **env: str
) -> Iterator[str]:
    """Run ``command`` (a server; ``{port}`` in it is a free port) with ``env`` added, until it
    accepts connections; its base URL for the block (the process appended to ``started``);
    stopped after."""
    port = free_port()
    process = subprocess.Popen(
        [part.replace("{port}", str(port)) for part in command],
        cwd=ROOT,
        env={**os.environ, **env},
        stderr=subprocess.PIPE,
        text=True,
    )
    if started is not None:
        started.append(process)
    try:
        deadline = time.monotonic() + 20
        while True:
            if process.poll() is not None:
                pytest.fail(f"the server exited: {process.stderr.read() if process.stderr else ''}")
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
                break
            if time.monotonic() > deadline:
                pytest.fail("the server did not start")
            time.sleep(0.05)
        yield f"http://127.0.0.1:{port}"
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()


def serving(
    store_url: str, app: str, started: list[subprocess.Popen[str]] | None = None, **env: str
) -> contextlib.AbstractContextManager[str]:
    """uvicorn serving ``tests/web/app.py`` as ``app`` on ``store_url``."""
    return serving_command(
        [
            sys.executable,
            "-m",
            "uvicorn",
            "tests.web.app:app",
            "--host",
            "127.0.0.1",
            "--port",
            "{port}",
            "--log-level",
            "warning",
        ],
        started,
        ONCELY_TEST_HTTP_STORE=store_url,
        ONCELY_TEST_HTTP_APP=app,
        **env,
    )


@pytest.fixture(
    scope="module",
    params=[
        ("sqlite", "plain"),
        ("postgres", "starlette"),
        ("redis", "plain"),
        ("redis", "fastapi"),
        ("postgres", "fastapi"),
        ("sqlite", "starlette"),
    ],
    ids=[
        "sqlite-plain",
        "postgres-starlette",
        "redis-plain",
        "redis-fastapi",
        "postgres-fastapi",
        "sqlite-starlette",
    ],
)
def server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    kind, app = request.param
    url, drop = _store(kind, tmp_path_factory.mktemp(kind))
    try:
        with serving(url, app) as base:
            yield base
    finally:
        drop()


def key() -> str:
    return f'"{uuid.uuid4()}"'


async def effects(client: httpx.AsyncClient) -> dict[str, int]:
    got = await client.get("/effects")
    return dict(got.json())


def _same_response(a: httpx.Response, b: httpx.Response) -> None:
    """Status, the app's headers and the body bytes are identical."""
    skip = {"date", "server", "idempotent-replayed"}
    assert a.status_code == b.status_code
    assert [(k, v) for k, v in a.headers.raw if k.decode().lower() not in skip] == [
        (k, v) for k, v in b.headers.raw if k.decode().lower() not in skip
    ]
    assert a.content == b.content


async def test_r19_a_repeat_gets_the_first_response_byte_for_byte(server: str) -> None:
    async with httpx.AsyncClient(base_url=server) as client:
        k = key()
        order = f"o-{uuid.uuid4().hex[:8]}"
        first = await client.post("/orders", json={"id": order}, headers={"Idempotency-Key": k})
        assert first.status_code == 201 and "idempotent-replayed" not in first.headers
        again = await client.post("/orders", json={"id": order}, headers={"Idempotency-Key": k})
        assert again.headers["idempotent-replayed"] == "true"
        _same_response(first, again)
        assert again.headers["content-length"] == first.headers["content-length"]
        assert (await effects(client))[order] == 1


async def test_r19_a_missing_key_is_400_and_a_bare_one_refused_by_default(server: str) -> None:
    async with httpx.AsyncClient(base_url=server) as client:
        missing = await client.post("/orders", json={"id": "none"})
        assert missing.status_code == 400
        assert missing.headers["content-type"] == "application/problem+json"
        assert missing.json()["title"] == "Idempotency-Key required"
        bare = await client.post("/orders", json={"id": "bare"}, headers={"Idempotency-Key": "K1"})
        assert bare.status_code == 400 and "quoted string" in bare.json()["detail"]
        twice = await client.post(
            "/orders",
            json={"id": "twice"},
            headers=[("Idempotency-Key", '"a"'), ("Idempotency-Key", '"b"')],
        )
        assert twice.status_code == 400
        assert "none" not in await effects(client)


async def test_r19_a_repeat_while_the_first_runs_is_409(server: str) -> None:
    async with httpx.AsyncClient(base_url=server, timeout=30) as client:
        k = key()
        order = f"slow-{uuid.uuid4().hex[:8]}"
        body = {"id": order, "sleep": 1.0}
        first = asyncio.create_task(
            client.post("/orders", json=body, headers={"Idempotency-Key": k})
        )
        await asyncio.sleep(0.3)
        repeats = await asyncio.gather(
            *(client.post("/orders", json=body, headers={"Idempotency-Key": k}) for _ in range(4))
        )
        assert [r.status_code for r in repeats] == [409] * 4
        assert repeats[0].headers["retry-after"] == "1"
        assert (await first).status_code == 201
        assert (await effects(client))[order] == 1


async def test_r19_the_same_key_with_another_body_is_422(server: str) -> None:
    async with httpx.AsyncClient(base_url=server) as client:
        k = key()
        order = f"o-{uuid.uuid4().hex[:8]}"
        await client.post("/orders", json={"id": order}, headers={"Idempotency-Key": k})
        other = await client.post(
            "/orders", json={"id": order, "n": 2}, headers={"Idempotency-Key": k}
        )
        assert other.status_code == 422 and other.json()["status"] == 422
        assert (await effects(client))[order] == 1


async def test_r19_one_client_never_reads_anothers_response(server: str) -> None:
    async with httpx.AsyncClient(base_url=server) as client:
        k = key()
        a_order, b_order = f"a-{uuid.uuid4().hex[:8]}", f"b-{uuid.uuid4().hex[:8]}"
        a = await client.post(
            "/orders", json={"id": a_order}, headers={"Idempotency-Key": k, "x-client": "A"}
        )
        b = await client.post(
            "/orders", json={"id": b_order}, headers={"Idempotency-Key": k, "x-client": "B"}
        )
        assert a.status_code == b.status_code == 201
        assert a.json()["order"] == a_order and b.json()["order"] == b_order
        done = await effects(client)
        assert done[a_order] == 1 and done[b_order] == 1


async def test_r19_a_5xx_is_not_kept_and_the_retry_runs(server: str) -> None:
    async with httpx.AsyncClient(base_url=server) as client:
        k = key()
        order = f"f-{uuid.uuid4().hex[:8]}"
        body = {"id": order, "fail_once": True}
        first = await client.post("/orders", json=body, headers={"Idempotency-Key": k})
        assert first.status_code == 500
        retry = await client.post("/orders", json=body, headers={"Idempotency-Key": k})
        assert retry.status_code == 201 and "idempotent-replayed" not in retry.headers
        again = await client.post("/orders", json=body, headers={"Idempotency-Key": k})
        assert again.headers["idempotent-replayed"] == "true" and again.content == retry.content
        assert (await effects(client))[order] == 2  # the failed run and the retry, not a third


async def test_r19_a_response_too_large_to_keep_is_answered_and_never_run_again(
    server: str,
) -> None:
    async with httpx.AsyncClient(base_url=server) as client:
        k = key()
        order = f"big-{uuid.uuid4().hex[:8]}"
        body = {"id": order, "pad": 10_000}
        first = await client.post("/orders", json=body, headers={"Idempotency-Key": k})
        assert first.status_code == 201 and len(first.content) > 10_000
        again = await client.post("/orders", json=body, headers={"Idempotency-Key": k})
        assert again.status_code == 409 and "too large to keep" in again.json()["detail"]
        assert (await effects(client))[order] == 1


async def test_r19_gets_and_requests_without_a_key_pass_through(server: str) -> None:
    async with httpx.AsyncClient(base_url=server) as client:
        got = await client.get("/effects")
        assert got.status_code == 200 and "idempotent-replayed" not in got.headers


def test_r19_quoted_and_bare_forms_are_one_key_when_bare_keys_are_accepted(
    tmp_path: Path,
) -> None:
    url, drop = _store("sqlite", tmp_path)
    try:
        with (
            serving(url, "plain", ONCELY_TEST_HTTP_BARE="1") as base,
            httpx.Client(base_url=base) as client,
        ):
            first = client.post("/orders", json={"id": "q"}, headers={"Idempotency-Key": "K-7"})
            again = client.post("/orders", json={"id": "q"}, headers={"Idempotency-Key": '"K-7"'})
            assert first.status_code == 201 and again.headers["idempotent-replayed"] == "true"
            assert json.loads(client.get("/effects").content) == {"q": 1}
    finally:
        drop()


@pytest.mark.parametrize(
    ("provider", "header"),
    [
        ("github", "X-GitHub-Delivery"),
        ("standard", "webhook-id"),
        ("shopify", "X-Shopify-Webhook-Id"),
        ("stripe", None),
    ],
)
def test_r19_a_webhook_redelivery_is_answered_2xx_at_once_and_runs_once(
    tmp_path: Path, provider: str, header: str | None
) -> None:
    """The provider's delivery id is the key (no Idempotency-Key): its redelivery gets the
    first 2xx again, so the provider stops retrying; a request without one is 400."""
    url, drop = _store("sqlite", tmp_path)
    delivery = f"evt_{uuid.uuid4().hex[:12]}"
    event = {"id": delivery if header is None else "ignored", "type": "charge.succeeded"}
    headers = {} if header is None else {header: delivery}
    try:
        with (
            serving(url, "plain", ONCELY_TEST_HTTP_WEBHOOK=provider) as base,
            httpx.Client(base_url=base) as client,
        ):
            first = client.post("/orders", json=event, headers=headers)
            again = client.post("/orders", json=event, headers=headers)
            assert first.status_code == again.status_code == 201
            assert again.headers["idempotent-replayed"] == "true"
            assert again.content == first.content
            anonymous = client.post("/orders", json={"type": "ping"})
            assert anonymous.status_code == 400
            assert json.loads(client.get("/effects").content) == {event["id"]: 1}
    finally:
        drop()


async def test_r19_with_wait_a_repeat_while_the_first_runs_gets_its_response(
    tmp_path: Path,
) -> None:
    url, drop = _store("sqlite", tmp_path)
    try:
        with serving(url, "plain", ONCELY_TEST_HTTP_WAIT="10") as base:
            async with httpx.AsyncClient(base_url=base, timeout=30) as client:
                k, body = key(), {"id": "waited", "sleep": 1.0}
                first = asyncio.create_task(
                    client.post("/orders", json=body, headers={"Idempotency-Key": k})
                )
                await asyncio.sleep(0.3)
                repeat = await client.post("/orders", json=body, headers={"Idempotency-Key": k})
                done = await first
                assert done.status_code == repeat.status_code == 201
                assert repeat.headers["idempotent-replayed"] == "true"
                assert repeat.content == done.content
                assert (await effects(client))["waited"] == 1
    finally:
        drop()


async def test_r19_a_body_over_the_limit_is_413_and_never_runs_unprotected(server: str) -> None:
    """A body larger than the middleware reads to recognise a repeat is refused, not run
    without idempotency (a published middleware skips it silently and runs it twice)."""
    async with httpx.AsyncClient(base_url=server, timeout=30) as client:
        k, order = key(), f"huge-{uuid.uuid4().hex[:8]}"
        body = json.dumps({"id": order, "note": "x" * (1 << 20)})
        for _ in range(2):
            got = await client.post(
                "/orders",
                content=body,
                headers={"Idempotency-Key": k, "content-type": "application/json"},
            )
            assert got.status_code == 413
            assert got.headers["content-type"] == "application/problem+json"
        assert order not in await effects(client)


@pytest.mark.parametrize("kind", ["sqlite", "redis"])
def test_r19_a_key_past_its_retention_runs_again_instead_of_answering_409_forever(
    tmp_path: Path, kind: str
) -> None:
    url, drop = _store(kind, tmp_path)
    try:
        with (
            serving(
                url, "plain", ONCELY_TEST_HTTP_KEEP="1.5", ONCELY_TEST_HTTP_LEASE="0.5"
            ) as base,
            httpx.Client(base_url=base) as client,
        ):
            k, order = key(), f"e-{uuid.uuid4().hex[:8]}"
            first = client.post("/orders", json={"id": order}, headers={"Idempotency-Key": k})
            replay = client.post("/orders", json={"id": order}, headers={"Idempotency-Key": k})
            assert first.status_code == 201 and replay.headers["idempotent-replayed"] == "true"
            time.sleep(2.0)  # past the retention: the record expired
            later = client.post("/orders", json={"id": order}, headers={"Idempotency-Key": k})
            assert later.status_code == 201 and "idempotent-replayed" not in later.headers
            assert json.loads(client.get("/effects").content)[order] == 2
    finally:
        drop()


@pytest.mark.parametrize("kind", ["sqlite", "postgres", "redis"])
def test_r10_r19_a_request_whose_server_was_killed_mid_run_is_retried_once_its_lease_lapses(
    tmp_path: Path, kind: str
) -> None:
    """The server is ``SIGKILL``ed while the first request runs: its claim's lease is not
    renewed any more, a repeat gets 409 while it is live, and once it lapses the repeat runs
    (a stale claim taken over), on a new server, once; never a key stuck at 409."""
    url, drop = _store(kind, tmp_path)
    # A lease that outlives a server's start on a loaded host (with 1.5 s, the new server
    # sometimes came up after the lease had lapsed, and the early repeat ran: 201, not 409).
    env = {"ONCELY_TEST_HTTP_KEEP": "60", "ONCELY_TEST_HTTP_LEASE": "6"}
    k, order = key(), f"k-{uuid.uuid4().hex[:8]}"
    started: list[subprocess.Popen[str]] = []
    try:
        with serving(url, "plain", started, **env) as base:
            slow = {"id": order, "sleep": 30}

            def post_slow() -> None:
                with contextlib.suppress(httpx.HTTPError):
                    httpx.post(
                        f"{base}/orders", json=slow, headers={"Idempotency-Key": k}, timeout=30
                    )

            import threading

            sender = threading.Thread(target=post_slow, daemon=True)
            sender.start()
            time.sleep(1.0)  # the request is running: claimed, lease renewed
            started[0].kill()  # SIGKILL
            started[0].wait(10)
            sender.join(10)
        # The same request again, on a new server that does not sleep (ONCELY_TEST_HTTP_FAST).
        with (
            serving(url, "plain", ONCELY_TEST_HTTP_FAST="1", **env) as base,
            httpx.Client(base_url=base) as client,
        ):
            early = client.post("/orders", json=slow, headers={"Idempotency-Key": k})
            assert early.status_code == 409  # the dead server's lease is still live
            for _ in range(100):  # until the lease lapses: 409, never a run
                taken = client.post("/orders", json=slow, headers={"Idempotency-Key": k})
                if taken.status_code != 409:
                    break
                time.sleep(0.2)
            assert taken.status_code == 201 and "idempotent-replayed" not in taken.headers
            again = client.post("/orders", json=slow, headers={"Idempotency-Key": k})
            assert again.headers["idempotent-replayed"] == "true"
            assert json.loads(client.get("/effects").content) == {order: 1}
    finally:
        drop()


async def test_r17_an_endpoint_gets_one_downstream_key_per_idempotency_key(server: str) -> None:
    """Inside the endpoint, ``oncely.current()`` is the request, as a message handler's is
    its message: ``downstream_key("charge")`` (what it gives a payment provider) is the same
    on the client's retry of one Idempotency-Key and another for another key. Before, there
    was no context there (``oncely.handling()`` raised ``LookupError``)."""
    async with httpx.AsyncClient(base_url=server) as client:
        k, order = key(), f"d-{uuid.uuid4().hex[:8]}"
        body = {"id": order, "fail_once": True, "downstream": True}
        failed = await client.post("/orders", json=body, headers={"Idempotency-Key": k})
        retry = await client.post("/orders", json=body, headers={"Idempotency-Key": k})
        other = await client.post(
            "/orders", json={**body, "id": f"{order}-2"}, headers={"Idempotency-Key": key()}
        )
    assert failed.status_code == 500 and retry.status_code == 201
    assert failed.json()["downstream"] is not None
    assert retry.json()["downstream"] == failed.json()["downstream"]
    assert other.json()["downstream"] not in (None, failed.json()["downstream"])

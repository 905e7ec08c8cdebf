"""The HTTP middleware's transactional mode on a real server (R7, R19): uvicorn serving
``tests/web/app.py`` with ``transactional=True``, each run writing its order to a ledger table
through ``oncely.http.transaction()``, on SQLite, PostgreSQL and DynamoDB (moto's server: a
ledger table of the test's own, each run's write an item of its own). The ledger is read from
the test process (on DynamoDB by a strongly consistent ``Scan``), so what counts is what the
database committed."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import sqlite3
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import psycopg
import pytest

import oncely
from oncely.errors import ConfigurationError, TransactionRequired
from oncely.http import IdempotencyMiddleware, WSGIIdempotencyMiddleware, scoped_key, transaction
from tests.services import POSTGRES_DSN, require
from tests.web.test_asgi import _same_response, effects, key, serving

Rows = Callable[[str], list[tuple[str, int]]]


def _dynamodb_ledger(name: str, ledger: str) -> tuple[str, str, Rows, Callable[[], None]]:
    """:func:`_ledger` on moto's server: the inbox's table ``name`` (the store makes it) and
    the ledger table, keyed by order and a random sort key (two writes are two items)."""
    from tests.backends.dynamodb import client, create_ledger, drop_table, endpoint

    create_ledger(ledger, "order_id")

    def rows_dynamodb(order: str) -> list[tuple[str, int]]:
        c = client()
        try:
            found: list[tuple[str, int]] = []
            for page in c.get_paginator("scan").paginate(
                TableName=ledger,
                ConsistentRead=True,
                FilterExpression="order_id = :o",
                ExpressionAttributeValues={":o": {"S": order}},
            ):
                found += [(i["order_id"]["S"], int(i["run"]["N"])) for i in page["Items"]]
        finally:
            c.close()
        return sorted(found, key=lambda row: row[1])

    def drop() -> None:
        drop_table(ledger)
        drop_table(name)

    return f"dynamodb://{endpoint()}/{name}", ledger, rows_dynamodb, drop


def _ledger(kind: str, tmp: Path) -> tuple[str, str, Rows, Callable[[], None]]:
    """A store URL, the ledger table beside it, a reader of the ledger's rows for an order,
    and what drops both."""
    name = f"http_tx_{uuid.uuid4().hex[:10]}"
    ledger = f"{name}_ledger"
    if kind == "dynamodb":
        return _dynamodb_ledger(name, ledger)
    create = f'CREATE TABLE "{ledger}" (order_id TEXT NOT NULL, run INTEGER NOT NULL)'
    select = f'SELECT order_id, run FROM "{ledger}" WHERE order_id = {{}} ORDER BY run'
    if kind == "sqlite":
        path = tmp / "inbox.db"
        with sqlite3.connect(path) as conn:
            conn.execute(create)

        def rows_sqlite(order: str) -> list[tuple[str, int]]:
            with sqlite3.connect(path) as conn:
                return list(conn.execute(select.format("?"), (order,)))

        return f"sqlite:///{path}", ledger, rows_sqlite, lambda: None
    require("PostgreSQL", POSTGRES_DSN, 5432)
    with psycopg.connect(POSTGRES_DSN, autocommit=True) as conn:
        conn.execute(create.encode())

    def rows_pg(order: str) -> list[tuple[str, int]]:
        with psycopg.connect(POSTGRES_DSN, autocommit=True) as conn:
            return list(conn.execute(select.format("%s").encode(), (order,)))

    def drop() -> None:
        with psycopg.connect(POSTGRES_DSN, autocommit=True) as conn:
            conn.execute(f'DROP TABLE IF EXISTS "{name}", "{name}_meta", "{ledger}"'.encode())

    return f"{POSTGRES_DSN}?table={name}", ledger, rows_pg, drop


@pytest.fixture(
    scope="module",
    params=[
        ("sqlite", "plain"),
        ("postgres", "fastapi"),
        ("postgres", "starlette"),
        ("dynamodb", "plain"),
        ("dynamodb", "fastapi"),
    ],
    ids=[
        "sqlite-plain",
        "postgres-fastapi",
        "postgres-starlette",
        "dynamodb-plain",
        "dynamodb-fastapi",
    ],
)
def tx_server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, Rows]]:
    kind, app = request.param
    url, ledger, rows, drop = _ledger(kind, tmp_path_factory.mktemp(kind))
    try:
        with serving(url, app, ONCELY_TEST_HTTP_TX=ledger) as base:
            yield base, rows
    finally:
        drop()


async def test_r7_r19_the_response_and_the_business_row_commit_together(
    tx_server: tuple[str, Rows],
) -> None:
    base, rows = tx_server
    async with httpx.AsyncClient(base_url=base) as client:
        k, order = key(), f"o-{uuid.uuid4().hex[:8]}"
        first = await client.post("/orders", json={"id": order}, headers={"Idempotency-Key": k})
        assert first.status_code == 201 and "idempotent-replayed" not in first.headers
        assert rows(order) == [(order, 1)]  # committed before the client had its answer
        again = await client.post("/orders", json={"id": order}, headers={"Idempotency-Key": k})
        assert again.headers["idempotent-replayed"] == "true"
        _same_response(first, again)
        assert rows(order) == [(order, 1)]
        assert (await effects(client))[order] == 1


async def test_r7_r19_a_5xx_rolls_the_row_back_and_the_retry_runs(
    tx_server: tuple[str, Rows],
) -> None:
    base, rows = tx_server
    async with httpx.AsyncClient(base_url=base) as client:
        k, order = key(), f"f-{uuid.uuid4().hex[:8]}"
        body = {"id": order, "fail_once": True}
        first = await client.post("/orders", json=body, headers={"Idempotency-Key": k})
        assert first.status_code == 500 and first.json() == {"error": "the ledger is down"}
        assert rows(order) == []  # the failed run wrote its row, and it was rolled back
        retry = await client.post("/orders", json=body, headers={"Idempotency-Key": k})
        assert retry.status_code == 201 and "idempotent-replayed" not in retry.headers
        again = await client.post("/orders", json=body, headers={"Idempotency-Key": k})
        assert again.headers["idempotent-replayed"] == "true" and again.content == retry.content
        assert rows(order) == [(order, 2)]  # only the retry's row: the second run
        assert (await effects(client))[order] == 2


async def test_r7_r19_an_app_that_raises_leaves_no_row_and_no_marker(
    tx_server: tuple[str, Rows],
) -> None:
    base, rows = tx_server
    async with httpx.AsyncClient(base_url=base) as client:
        k, order = key(), f"r-{uuid.uuid4().hex[:8]}"
        body = {"id": order, "raise_once": True}
        first = await client.post("/orders", json=body, headers={"Idempotency-Key": k})
        assert first.status_code == 500  # the server's own answer to an app that raised
        assert rows(order) == []
        retry = await client.post("/orders", json=body, headers={"Idempotency-Key": k})
        assert retry.status_code == 201
        assert rows(order) == [(order, 2)]


async def test_r7_r19_repeats_during_the_first_wait_for_its_commit_and_replay_it(
    tx_server: tuple[str, Rows], request: pytest.FixtureRequest
) -> None:
    if request.node.callspec.params["tx_server"][0] == "dynamodb":
        pytest.skip("no row lock on DynamoDB: a repeat runs too (the DynamoDB tests below)")
    base, rows = tx_server
    async with httpx.AsyncClient(base_url=base, timeout=30) as client:
        k, order = key(), f"slow-{uuid.uuid4().hex[:8]}"
        body = {"id": order, "sleep": 1.0}
        first = asyncio.create_task(
            client.post("/orders", json=body, headers={"Idempotency-Key": k})
        )
        await asyncio.sleep(0.3)
        repeats = await asyncio.gather(
            *(client.post("/orders", json=body, headers={"Idempotency-Key": k}) for _ in range(3))
        )
        done = await first
        assert done.status_code == 201
        for repeat in repeats:
            assert repeat.headers["idempotent-replayed"] == "true"
            _same_response(done, repeat)
        assert rows(order) == [(order, 1)]
        assert (await effects(client))[order] == 1


async def test_r7_r19_another_body_under_the_key_is_422_and_writes_nothing(
    tx_server: tuple[str, Rows],
) -> None:
    base, rows = tx_server
    async with httpx.AsyncClient(base_url=base) as client:
        k, order = key(), f"c-{uuid.uuid4().hex[:8]}"
        await client.post("/orders", json={"id": order}, headers={"Idempotency-Key": k})
        other = await client.post(
            "/orders", json={"id": order, "n": 2}, headers={"Idempotency-Key": k}
        )
        assert other.status_code == 422
        assert rows(order) == [(order, 1)]


@pytest.mark.parametrize("kind", ["sqlite", "postgres", "dynamodb"])
def test_r7_r19_wsgi_transactional_commits_the_row_with_the_response_and_rolls_back_a_5xx(
    tmp_path: Path, kind: str
) -> None:
    """The same on the WSGI middleware: a Flask app on a threaded ``wsgiref`` server."""
    from tests.web.test_asgi import serving_command

    url, ledger, rows, drop = _ledger(kind, tmp_path)
    command = [sys.executable, "-m", "tests.web.wsgi_app", "{port}"]
    try:
        with (
            serving_command(
                command, ONCELY_TEST_HTTP_STORE=url, ONCELY_TEST_HTTP_TX=ledger
            ) as base,
            httpx.Client(base_url=base) as client,
        ):
            k, order = key(), f"w-{uuid.uuid4().hex[:8]}"
            first = client.post("/orders", json={"id": order}, headers={"Idempotency-Key": k})
            again = client.post("/orders", json={"id": order}, headers={"Idempotency-Key": k})
            assert first.status_code == 201 and again.headers["idempotent-replayed"] == "true"
            _same_response(first, again)
            assert rows(order) == [(order, 1)]
            k, failing = key(), f"wf-{uuid.uuid4().hex[:8]}"
            body = {"id": failing, "fail_once": True}
            assert (
                client.post("/orders", json=body, headers={"Idempotency-Key": k}).status_code == 500
            )
            assert rows(failing) == []
            retry = client.post("/orders", json=body, headers={"Idempotency-Key": k})
            assert retry.status_code == 201 and rows(failing) == [(failing, 2)]
    finally:
        drop()


def test_r7_transactional_needs_a_store_with_transactions_and_refuses_wait() -> None:
    from datetime import timedelta

    async def app(scope: object, receive: object, send: object) -> None:
        raise AssertionError("never called")

    memory = oncely.AsyncInbox(oncely.open_async("memory://"), consumer="api")
    with pytest.raises(ConfigurationError, match=r"transactional mode .*SQLite, DynamoDB"):
        IdempotencyMiddleware(app, inbox=memory, transactional=True)
    with pytest.raises(ConfigurationError, match="transactional mode"):
        WSGIIdempotencyMiddleware(
            lambda e, s: [],
            inbox=oncely.Inbox(oncely.open("memory://"), consumer="api"),
            transactional=True,
        )
    sqlite = oncely.AsyncInbox(oncely.open_async("sqlite:///:memory:"), consumer="api")
    with pytest.raises(ConfigurationError, match="row lock"):
        IdempotencyMiddleware(app, inbox=sqlite, transactional=True, wait=timedelta(seconds=1))
    # DynamoDB has a transactional mode (nothing is sent to the endpoint until a request).
    dynamodb = oncely.Inbox(oncely.open("dynamodb://127.0.0.1:9/api_inbox"), consumer="api")
    WSGIIdempotencyMiddleware(lambda e, s: [], inbox=dynamodb, transactional=True)
    with pytest.raises(ConfigurationError, match="on DynamoDB it runs too"):
        WSGIIdempotencyMiddleware(
            lambda e, s: [], inbox=dynamodb, transactional=True, wait=timedelta(seconds=1)
        )


def test_r7_transaction_outside_a_request_says_where_it_works() -> None:
    with pytest.raises(TransactionRequired, match="transactional=True"):
        transaction()


@pytest.mark.parametrize("kind", ["sqlite", "postgres", "dynamodb"])
def test_r7_r19_a_stream_cut_short_by_its_client_is_rolled_back_not_kept(
    kind: str, tmp_path: Path
) -> None:
    # Starlette stops a StreamingResponse when its client goes away. Before, the part held
    # until then was committed as the key's response: the client's retry was answered the
    # stream cut short (a 201 replayed, Idempotent-Replayed: true), as if it were whole.
    url, ledger, _, drop = _ledger(kind, tmp_path)
    n = 40  # 40 chunks 50 ms apart: the client leaves well before the end
    whole = "".join(f"chunk {i}\n" for i in range(n)).encode()
    try:
        with serving(url, "starlette", ONCELY_TEST_HTTP_TX=ledger) as base:
            parts = urlsplit(base)
            k = key()
            with socket.create_connection((parts.hostname, parts.port)) as sock:
                sock.sendall(
                    f"POST /stream?n={n} HTTP/1.1\r\nHost: shop\r\nIdempotency-Key: {k}\r\n"
                    "Content-Length: 0\r\n\r\n".encode()
                )
                time.sleep(0.5)
            with httpx.Client(base_url=base, timeout=30) as client:
                retried = client.post(f"/stream?n={n}", headers={"Idempotency-Key": k})
                assert retried.status_code == 201 and retried.content == whole
                assert "idempotent-replayed" not in retried.headers
                again = client.post(f"/stream?n={n}", headers={"Idempotency-Key": k})
                assert again.headers["idempotent-replayed"] == "true" and again.content == whole
                assert client.get("/effects").json()[f"stream:{n}"] == 2
    finally:
        drop()


# DynamoDB has no row lock: a repeat that arrives while the first request runs reads the key
# absent and runs the app too, its writes buffered in a transaction of its own. Whichever
# commits first wins; the other's commit is cancelled on the marker's condition (KeyTaken:
# nothing of it written), and the inbox claims again and answers from the winner's record.
# The runs are held at gates (``tests/web/app.py``) so that their commits come one after the
# other, as moto's server needs (it does not apply concurrent transactions atomically; AWS
# runs them serializably: see MOTO_SERIAL in tests/stores/test_dynamodb.py).


def _serve(
    server: str, url: str, ledger: str, **env: str
) -> contextlib.AbstractContextManager[str]:
    """The transactional app on ``url``: uvicorn serving ``tests/web/app.py`` as ``server``
    (``plain``, ``starlette``), or ``wsgi``, the Flask app on a threaded ``wsgiref`` server."""
    if server == "wsgi":
        from tests.web.test_asgi import serving_command

        command = [sys.executable, "-m", "tests.web.wsgi_app", "{port}"]
        return serving_command(
            command, ONCELY_TEST_HTTP_STORE=url, ONCELY_TEST_HTTP_TX=ledger, **env
        )
    return serving(url, server, ONCELY_TEST_HTTP_TX=ledger, **env)


def _at_gates(client: httpx.Client, *names: str) -> None:
    """Wait until runs stand at the gates ``names``: each read the key absent and ran the app
    up to its ledger write, buffered in its transaction."""
    deadline = time.monotonic() + 30
    while not set(names) <= set(client.get("/gates").json()):
        if time.monotonic() > deadline:
            pytest.fail(f"no run reached the gates {names}")
        time.sleep(0.02)


def _post(base: str, k: str, body: dict[str, object], gate: str) -> httpx.Response:
    with httpx.Client(base_url=base, timeout=60) as client:
        return client.post("/orders", json=body, headers={"Idempotency-Key": k, "X-Gate": gate})


@pytest.mark.parametrize("server", ["plain", "starlette", "wsgi"])
def test_r7_r19_dynamodb_a_concurrent_repeat_runs_too_and_gets_the_first_committed_response(
    server: str, tmp_path: Path
) -> None:
    url, ledger, rows, drop = _ledger("dynamodb", tmp_path)
    k, order = key(), f"race-{uuid.uuid4().hex[:8]}"
    body = {"id": order, "gate": True}
    try:
        with (
            _serve(server, url, ledger) as base,
            httpx.Client(base_url=base, timeout=60) as client,
            ThreadPoolExecutor(2) as pool,
        ):
            first = pool.submit(_post, base, k, body, "first")
            repeat = pool.submit(_post, base, k, body, "repeat")
            _at_gates(client, "first", "repeat")  # both run the app: no row lock to wait on
            client.get("/open", params={"gate": "first"})
            done = first.result(60)
            assert done.status_code == 201 and "idempotent-replayed" not in done.headers
            assert rows(order) == [(order, 1)]
            client.get("/open", params={"gate": "repeat"})
            second = repeat.result(60)
            # Its commit was cancelled by the first one's marker: its item was never written,
            # and it is answered the first response, as a repeat after the first would be.
            assert second.headers["idempotent-replayed"] == "true"
            _same_response(done, second)
            assert rows(order) == [(order, 1)]
            assert client.get("/effects").json()[order] == 2  # the app ran twice
            again = client.post("/orders", json=body, headers={"Idempotency-Key": k})
            assert again.headers["idempotent-replayed"] == "true"
            _same_response(done, again)
            assert rows(order) == [(order, 1)]
    finally:
        drop()


@pytest.mark.parametrize("server", ["plain", "starlette", "wsgi"])
def test_r7_r19_dynamodb_a_repeat_that_runs_again_after_losing_sends_and_keeps_its_last_run(
    server: str, tmp_path: Path
) -> None:
    """A repeat whose commit lost to the first request's, and whose second claim finds that
    record gone (it expired meanwhile, its retention shorter than the repeat's run), runs the
    app again in the same request. What it sends and keeps is that last run's response, the
    one whose writes committed. Before, the ASGI middleware sent both runs' messages (the
    second response start refused by the server) and kept both bodies joined as one, and the
    WSGI one sent and kept the first run's response with the second run's writes."""
    url, ledger, rows, drop = _ledger("dynamodb", tmp_path)
    k, order = key(), f"again-{uuid.uuid4().hex[:8]}"
    body = {"id": order, "gate": True}
    scoped = scoped_key("anon", "POST", "/orders", k.strip('"'))
    store = oncely.open(url)
    try:
        # Two instances of the app on one inbox table: the first keeps its records a second.
        with (
            _serve(
                server, url, ledger, ONCELY_TEST_HTTP_KEEP="1", ONCELY_TEST_HTTP_LEASE="0.5"
            ) as short,
            _serve(server, url, ledger) as base,
            httpx.Client(base_url=short, timeout=60) as first_app,
            httpx.Client(base_url=base, timeout=60) as client,
            ThreadPoolExecutor(2) as pool,
        ):
            first = pool.submit(_post, short, k, body, "first")
            repeat = pool.submit(_post, base, k, body, "repeat")
            _at_gates(first_app, "first")
            _at_gates(client, "repeat")
            first_app.get("/open", params={"gate": "first"})
            assert first.result(60).json()["run"] == 1
            deadline = time.monotonic() + 30
            while store.get("orders-api", scoped) is not None:  # until the record expired
                assert time.monotonic() < deadline
                time.sleep(0.05)
            client.get("/open", params={"gate": "repeat"})
            second = repeat.result(60)
            assert second.status_code == 201 and "idempotent-replayed" not in second.headers
            assert second.json()["run"] == 2  # its second run: the one that committed
            assert rows(order) == [(order, 1), (order, 2)]
            again = client.post("/orders", json=body, headers={"Idempotency-Key": k})
            assert again.headers["idempotent-replayed"] == "true"
            _same_response(second, again)
    finally:
        store.close()
        drop()

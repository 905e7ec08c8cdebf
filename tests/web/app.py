"""The app ``tests/web`` serves with uvicorn, in a process of its own: ``POST /orders`` books
an order (one effect per run, counted), ``GET /effects`` says how many ran. The store and the
app's shape come from the environment (``ONCELY_TEST_HTTP_STORE``, ``ONCELY_TEST_HTTP_APP``:
``plain`` ASGI, ``starlette`` or ``fastapi``; ``ONCELY_TEST_HTTP_BARE=1`` accepts unquoted keys;
``ONCELY_TEST_HTTP_WEBHOOK`` names a provider whose delivery id is the key;
``ONCELY_TEST_HTTP_WAIT`` is how long a repeat waits for a running first request;
``ONCELY_TEST_HTTP_KEEP`` and ``ONCELY_TEST_HTTP_LEASE`` are the inbox's retention and lease
in seconds; ``ONCELY_TEST_HTTP_FAST=1`` skips the requests' sleeps; ``ONCELY_TEST_HTTP_TX``
names a ledger table: the middleware is then transactional and each run writes its order there
through ``oncely.http.transaction()``). A run whose body says ``"gate": true`` stops, once its
ledger write is made, at the gate its ``X-Gate`` header names until ``GET /open?gate=NAME``
opens it; ``GET /gates`` lists the gates runs wait at: a test orders concurrent runs with them
(two requests with one key and body, each run stopped until the test lets it go on)."""

from __future__ import annotations

import asyncio
import contextvars
import json
import os
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from datetime import timedelta
from typing import Any

from starlette.requests import Request  # (module level: FastAPI resolves annotations here)

import oncely
from oncely.http import (
    IdempotencyMiddleware,
    KeyFrom,
    Receive,
    Scope,
    Send,
    github,
    shopify,
    standard_webhooks,
    stripe,
    transaction,
)

WEBHOOKS: dict[str, KeyFrom] = {
    "github": github,
    "stripe": stripe,
    "standard": standard_webhooks,
    "shopify": shopify,
}
WAIT = (
    timedelta(seconds=float(os.environ["ONCELY_TEST_HTTP_WAIT"]))
    if os.environ.get("ONCELY_TEST_HTTP_WAIT")
    else None
)
EFFECTS: Counter[str] = Counter()
FAILED_ONCE: set[str] = set()
LEDGER = os.environ.get("ONCELY_TEST_HTTP_TX", "")
GATE: contextvars.ContextVar[str | None] = contextvars.ContextVar("gate", default=None)
"""The ``X-Gate`` header of the request being handled."""
GATES: dict[str, asyncio.Event] = {}
WAITING: set[str] = set()


def gate(name: str) -> asyncio.Event:
    return GATES.setdefault(name, asyncio.Event())


async def write_ledger(order: str, run: int) -> None:
    """The run's business row, in the request's transaction (transactional mode): on DynamoDB
    an item of its own (a random sort key), so that two writes show as two items."""
    tx = transaction()
    if type(tx).__name__ == "DynamoTransaction":
        item = {"order_id": {"S": order}, "sk": {"S": uuid.uuid4().hex}, "run": {"N": str(run)}}
        tx.put(LEDGER, item)
    elif type(tx).__module__.startswith("aiosqlite"):
        await tx.execute(f'INSERT INTO "{LEDGER}" VALUES (?, ?)', (order, run))
    else:
        await tx.execute(f'INSERT INTO "{LEDGER}" VALUES (%s, %s)', (order, run))


def downstream(body: dict[str, Any]) -> dict[str, Any]:
    """With ``"downstream": true`` in the body: the key this run would give a payment
    provider (``oncely.current().downstream_key("charge")``, R17; None outside a request the
    middleware runs)."""
    if not body.get("downstream"):
        return {}
    now = oncely.current()
    return {"downstream": None if now is None else now.downstream_key("charge")}


async def book(body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """One effect; the status and JSON answer."""
    order = str(body.get("id"))
    said = downstream(body)
    if LEDGER:
        await write_ledger(order, EFFECTS[order] + 1)
    name = GATE.get()
    if body.get("gate") and name is not None:
        WAITING.add(name)
        await gate(name).wait()
        WAITING.discard(name)
    if not os.environ.get("ONCELY_TEST_HTTP_FAST"):
        await asyncio.sleep(float(body.get("sleep", 0)))
    if body.get("fail_once") and order not in FAILED_ONCE:
        FAILED_ONCE.add(order)
        EFFECTS[order] += 1
        return 500, {"error": "the ledger is down", **said}
    if body.get("raise_once") and order not in FAILED_ONCE:
        FAILED_ONCE.add(order)
        EFFECTS[order] += 1
        raise RuntimeError("the handler broke after writing")
    EFFECTS[order] += 1
    answer = {"order": order, "run": EFFECTS[order], "size": "x" * int(body.get("pad", 0))}
    return 201, {**answer, **said}


async def plain(scope: Scope, receive: Receive, send: Send) -> None:
    if scope["type"] != "http":
        return
    if scope["method"] == "GET":
        payload = json.dumps(EFFECTS).encode()
        status = 200
    else:
        raw = b""
        while True:
            message = await receive()
            raw += message.get("body", b"")
            if not message.get("more_body"):
                break
        status, answer = await book(json.loads(raw or b"{}"))
        payload = json.dumps(answer).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(payload)).encode()),
                (b"x-app", b"plain"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": payload})


def starlette_app() -> Any:
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    async def orders(request: Request) -> JSONResponse:
        status, answer = await book(await request.json())
        return JSONResponse(answer, status_code=status, headers={"x-app": "starlette"})

    async def effects(request: Request) -> JSONResponse:
        return JSONResponse(dict(EFFECTS))

    async def notes(request: Request) -> JSONResponse:
        """Any body (an upload, a partial one): one effect per run, by its size."""
        size = len(await request.body())
        EFFECTS[f"note:{size}"] += 1
        return JSONResponse({"size": size, "run": EFFECTS[f"note:{size}"]}, status_code=201)

    async def stream(request: Request) -> StreamingResponse:
        """``n`` chunks, a little apart, as a report that is streamed would be."""
        n = int(request.query_params.get("n", "5"))
        EFFECTS[f"stream:{n}"] += 1

        async def chunks() -> AsyncIterator[bytes]:
            for i in range(n):
                await asyncio.sleep(0.05)
                yield f"chunk {i}\n".encode()

        return StreamingResponse(chunks(), status_code=201, media_type="text/plain")

    return Starlette(
        routes=[
            Route("/orders", orders, methods=["POST"]),
            Route("/effects", effects),
            Route("/notes", notes, methods=["POST"]),
            Route("/stream", stream, methods=["POST"]),
        ]
    )


def fastapi_app() -> Any:
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse

    made = FastAPI()

    @made.post("/orders")
    async def orders(request: Request) -> JSONResponse:
        status, answer = await book(await request.json())
        return JSONResponse(answer, status_code=status, headers={"x-app": "fastapi"})

    @made.get("/effects")
    async def effects() -> dict[str, int]:
        return dict(EFFECTS)

    return made


SHAPES = {"plain": lambda: plain, "starlette": starlette_app, "fastapi": fastapi_app}


class Lazy:
    """Builds the middleware (and opens the store) on the server's event loop."""

    def __init__(self) -> None:
        self.app: Any = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            message = await receive()
            await send({"type": "lifespan.startup.complete"})
            message = await receive()
            assert message["type"] == "lifespan.shutdown"
            await send({"type": "lifespan.shutdown.complete"})
            return
        if scope.get("method") == "GET" and scope["path"] in ("/gates", "/open"):
            if scope["path"] == "/open":
                gate(scope["query_string"].decode().partition("gate=")[2]).set()
            payload = json.dumps(sorted(WAITING)).encode()
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": payload})
            return
        named = dict(scope["headers"]).get(b"x-gate")
        GATE.set(None if named is None else named.decode())
        if self.app is None:
            inner = SHAPES[os.environ.get("ONCELY_TEST_HTTP_APP", "plain")]()
            keep = os.environ.get("ONCELY_TEST_HTTP_KEEP")
            lease = os.environ.get("ONCELY_TEST_HTTP_LEASE")
            inbox = oncely.AsyncInbox(
                oncely.open_async(os.environ["ONCELY_TEST_HTTP_STORE"]),
                consumer="orders-api",
                retention=oncely.Retention(keep=timedelta(seconds=float(keep))) if keep else None,
                lease=oncely.Lease(duration=timedelta(seconds=float(lease))) if lease else None,
            )
            self.app = IdempotencyMiddleware(
                inner,
                inbox=inbox,
                required=lambda s: s["path"] == "/orders",
                bare_keys=os.environ.get("ONCELY_TEST_HTTP_BARE") == "1",
                principal=lambda s: dict(s["headers"]).get(b"x-client", b"anon").decode(),
                max_stored_bytes=4096,
                key=WEBHOOKS.get(os.environ.get("ONCELY_TEST_HTTP_WEBHOOK", "")),
                wait=WAIT,
                transactional=bool(LEDGER),
            )
        await self.app(scope, receive, send)


app = Lazy()

"""The endpoint ``bench/web.py`` serves with uvicorn: a trivial ``POST /orders`` answering
201 with a small JSON body, bare or behind an idempotency middleware chosen by
``ONCELY_BENCH_HTTP`` (``bare``, ``oncely-redis``, ``oncely-postgres``, ``oncely-memory``,
``idemkit-redis``);
``ONCELY_BENCH_SPACE`` names the Redis prefix or PostgreSQL table of the run."""

from __future__ import annotations

import os
from typing import Any

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
    raise SystemExit(f"unknown variant {variant!r}")


app = Lazy()

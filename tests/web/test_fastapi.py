"""FastAPI routes made idempotent one by one (``oncely.integrations.fastapi``), on a real
server: uvicorn serving ``tests/web/fastapi_app.py`` in a process of its own, driven by httpx,
on SQLite, PostgreSQL and Redis stores (R19)."""

from __future__ import annotations

import asyncio
import sys
import uuid
from collections.abc import Iterator

import httpx
import pytest

from tests.web.test_asgi import _same_response, _store, key, serving_command


@pytest.fixture(scope="module", params=["sqlite", "postgres", "redis"])
def server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    url, drop = _store(request.param, tmp_path_factory.mktemp(request.param))
    command = [
        sys.executable, "-m", "uvicorn", "tests.web.fastapi_app:app", "--host", "127.0.0.1",
        "--port", "{port}", "--log-level", "warning",
    ]  # fmt: skip
    try:
        with serving_command(command, ONCELY_TEST_HTTP_STORE=url) as base:
            yield base
    finally:
        drop()


async def test_r19_a_route_with_the_dependency_replays_and_hands_over_its_key(
    server: str,
) -> None:
    async with httpx.AsyncClient(base_url=server) as client:
        k, order = key(), f"o-{uuid.uuid4().hex[:8]}"
        first = await client.post("/orders", json={"id": order}, headers={"Idempotency-Key": k})
        assert first.status_code == 201
        assert first.json() == {"order": order, "key": k.strip('"'), "run": 1}
        again = await client.post("/orders", json={"id": order}, headers={"Idempotency-Key": k})
        assert again.headers["idempotent-replayed"] == "true"
        _same_response(first, again)
        other = await client.post(
            "/orders", json={"id": order, "amount": 2}, headers={"Idempotency-Key": k}
        )
        assert other.status_code == 422 and other.headers["content-type"] == (
            "application/problem+json"
        )
        missing = await client.post("/orders", json={"id": "no-key"})
        assert missing.status_code == 400 and missing.json()["title"] == "Idempotency-Key required"
        done = (await client.get("/effects")).json()
        assert done[order] == 1 and "no-key" not in done


async def test_r19_a_route_without_it_is_untouched(server: str) -> None:
    async with httpx.AsyncClient(base_url=server) as client:
        k, note = key(), f"n-{uuid.uuid4().hex[:8]}"
        for _ in range(2):
            got = await client.post("/notes", json={"id": note}, headers={"Idempotency-Key": k})
            assert got.status_code == 201 and "idempotent-replayed" not in got.headers
        assert (await client.get("/effects")).json()[note] == 2


async def test_r19_concurrent_repeats_on_a_route_run_it_once(server: str) -> None:
    async with httpx.AsyncClient(base_url=server, timeout=30) as client:
        k, order = key(), f"c-{uuid.uuid4().hex[:8]}"
        answers = await asyncio.gather(
            *(
                client.post("/orders", json={"id": order}, headers={"Idempotency-Key": k})
                for _ in range(8)
            )
        )
        codes = sorted(a.status_code for a in answers)
        assert set(codes) <= {201, 409} and 201 in codes
        assert (await client.get("/effects")).json()[order] == 1


async def test_r19_a_route_added_after_install_refuses_rather_than_runs_unprotected(
    server: str,
) -> None:
    async with httpx.AsyncClient(base_url=server) as client:
        late = f"l-{uuid.uuid4().hex[:8]}"
        got = await client.post("/late", json={"id": late}, headers={"Idempotency-Key": key()})
        assert got.status_code == 500 and "install" in got.json()["detail"]
        assert late not in (await client.get("/effects")).json()
        installed = (await client.get("/installed")).json()
        assert sorted(installed) == ["/api/shop/v1/refunds", "/billing/invoices", "/orders"]


@pytest.mark.parametrize("path", ["/api/shop/v1/refunds", "/billing/invoices"])
async def test_r19_routes_of_included_routers_are_idempotent_too(server: str, path: str) -> None:
    # FastAPI 0.160 and later keep an included router whole instead of copying its routes
    # into the app: before, install() found none of them, and each answered 500.
    async with httpx.AsyncClient(base_url=server) as client:
        k, order = key(), f"r-{uuid.uuid4().hex[:8]}"
        first = await client.post(path, json={"id": order}, headers={"Idempotency-Key": k})
        assert first.status_code == 201, first.text
        again = await client.post(path, json={"id": order}, headers={"Idempotency-Key": k})
        assert again.headers["idempotent-replayed"] == "true"
        _same_response(first, again)
        missing = await client.post(path, json={"id": f"{order}-no-key"})
        assert missing.status_code == 400
        assert (await client.get("/effects")).json()[order] == 1


async def test_r19_the_header_is_in_the_routes_openapi_schema(server: str) -> None:
    async with httpx.AsyncClient(base_url=server) as client:
        schema = (await client.get("/openapi.json")).json()
    params = schema["paths"]["/orders"]["post"]["parameters"]
    assert [(p["name"], p["in"], p["required"]) for p in params] == [
        ("Idempotency-Key", "header", True)  # as the middleware has it (before: not required)
    ]
    assert "parameters" not in schema["paths"]["/notes"]["post"]

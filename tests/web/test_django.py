"""oncely's Django layer on a real server: Django's WSGI handler behind
``oncely.integrations.django.http.IdempotencyMiddleware`` (and a view behind the
``idempotent`` decorator), served by a threaded ``wsgiref`` server in a process of its own,
driven by httpx, on SQLite, PostgreSQL and Redis stores (R19)."""

from __future__ import annotations

import asyncio
import sys
import uuid
from collections.abc import Iterator

import httpx
import pytest

from tests.web.test_asgi import _same_response, _store, key, serving_command

pytest.importorskip("django")


@pytest.fixture(scope="module", params=["sqlite", "postgres", "redis"])
def server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    url, drop = _store(request.param, tmp_path_factory.mktemp(request.param))
    command = [sys.executable, "-m", "tests.web.django_site", "{port}"]
    try:
        with serving_command(command, ONCELY_TEST_HTTP_STORE=url) as base:
            yield base
    finally:
        drop()


def effects(client: httpx.Client) -> dict[str, int]:
    return dict(client.get("/effects").json())


@pytest.mark.parametrize("route", ["/orders", "/decorated"])
def test_r19_django_a_repeat_gets_the_first_response_byte_for_byte(server: str, route: str) -> None:
    with httpx.Client(base_url=server) as client:
        k, order = key(), f"o-{uuid.uuid4().hex[:8]}"
        first = client.post(route, json={"id": order}, headers={"Idempotency-Key": k})
        assert first.status_code == 201 and first.headers["x-app"] == "django"
        again = client.post(route, json={"id": order}, headers={"Idempotency-Key": k})
        assert again.headers["idempotent-replayed"] == "true"
        _same_response(first, again)
        other = client.post(route, json={"id": order, "n": 2}, headers={"Idempotency-Key": k})
        assert other.status_code == 422
        assert other.headers["content-type"] == "application/problem+json"
        missing = client.post(route, json={"id": "none"})
        assert missing.status_code == 400 and missing.json()["title"] == "Idempotency-Key required"
        done = effects(client)
        assert done[order] == 1 and "none" not in done


def test_r19_django_a_repeat_while_the_first_runs_is_409(server: str) -> None:
    async def race() -> tuple[int, list[int]]:
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
            return (await first).status_code, [r.status_code for r in repeats]

    first, repeats = asyncio.run(race())
    assert first == 201 and repeats == [409, 409, 409]


def test_r19_django_one_client_never_reads_anothers_response(server: str) -> None:
    with httpx.Client(base_url=server) as client:
        k = key()
        a_order, b_order = f"a-{uuid.uuid4().hex[:8]}", f"b-{uuid.uuid4().hex[:8]}"
        a = client.post(
            "/orders", json={"id": a_order}, headers={"Idempotency-Key": k, "x-client": "A"}
        )
        b = client.post(
            "/orders", json={"id": b_order}, headers={"Idempotency-Key": k, "x-client": "B"}
        )
        assert a.json()["order"] == a_order and b.json()["order"] == b_order


def test_r19_django_a_5xx_is_not_kept_and_the_retry_runs(server: str) -> None:
    with httpx.Client(base_url=server) as client:
        k, order = key(), f"f-{uuid.uuid4().hex[:8]}"
        body = {"id": order, "fail_once": True}
        assert client.post("/orders", json=body, headers={"Idempotency-Key": k}).status_code == 500
        retry = client.post("/orders", json=body, headers={"Idempotency-Key": k})
        assert retry.status_code == 201 and "idempotent-replayed" not in retry.headers
        again = client.post("/orders", json=body, headers={"Idempotency-Key": k})
        assert again.headers["idempotent-replayed"] == "true" and again.content == retry.content
        assert effects(client)[order] == 2


def test_r19_django_a_streaming_response_is_sent_and_not_kept(server: str) -> None:
    with httpx.Client(base_url=server) as client:
        k, order = key(), f"s-{uuid.uuid4().hex[:8]}"
        for _ in range(2):
            got = client.post("/stream", json={"id": order}, headers={"Idempotency-Key": k})
            assert got.status_code == 201 and got.content == b"part one, part two"
            assert "idempotent-replayed" not in got.headers
        assert effects(client)[order] == 2  # released, so the repeat ran: never a stuck key


@pytest.mark.parametrize("route", ["/page", "/decorated-page"])
def test_django_a_template_response_is_rendered_kept_and_replayed(server: str, route: str) -> None:
    """A view's ``TemplateResponse`` (any ``SimpleTemplateResponse``: DRF's ``Response`` is
    one) is kept as rendered: under the decorator, which sees it before Django renders it,
    reading its content unrendered raised and left the claim held."""
    with httpx.Client(base_url=server) as client:
        k, order = key(), f"p-{uuid.uuid4().hex[:8]}"
        first = client.post(route, json={"id": order}, headers={"Idempotency-Key": k})
        assert first.status_code == 201, first.text
        assert first.text == f"<p>order {order}, run 1</p>" and first.headers["x-app"] == "django"
        again = client.post(route, json={"id": order}, headers={"Idempotency-Key": k})
        assert again.headers["idempotent-replayed"] == "true"
        _same_response(first, again)
        assert effects(client)[order] == 1


@pytest.mark.parametrize("route", ["/page", "/decorated-page"])
def test_django_a_template_that_fails_to_render_gives_the_claim_back(
    server: str, route: str
) -> None:
    """A template that raises while it renders is a 500, as a view that raises: the claim is
    given back, so the retry runs (not a 409 until the lease lapses)."""
    with httpx.Client(base_url=server) as client:
        k, order = key(), f"r-{uuid.uuid4().hex[:8]}"
        body = {"id": order, "fail_once": True}
        assert client.post(route, json=body, headers={"Idempotency-Key": k}).status_code == 500
        retry = client.post(route, json=body, headers={"Idempotency-Key": k})
        assert retry.status_code == 201, retry.text
        assert retry.text == f"<p>order {order}, run 2</p>"
        assert "idempotent-replayed" not in retry.headers
        again = client.post(route, json=body, headers={"Idempotency-Key": k})
        assert again.headers["idempotent-replayed"] == "true" and again.content == retry.content
        assert effects(client)[order] == 2

"""oncely's Django layer on a real server: Django's WSGI handler behind
``oncely.integrations.django.http.IdempotencyMiddleware`` (and a view behind the
``idempotent`` decorator), served by a threaded ``wsgiref`` server in a process of its own,
driven by httpx, on SQLite, PostgreSQL and Redis stores (R19)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import sys
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import httpx
import pytest

from tests.brokers.common import Proxy
from tests.web.test_asgi import _same_response, _store, key, serving_command
from tests.web.test_wsgi import assert_a_retry_after_a_cut_upload_runs

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


@contextlib.contextmanager
def relayed(url: str) -> Iterator[tuple[str, Callable[[bool], None], Callable[[bool], None]]]:
    """``url`` through a TCP relay (``tests.brokers.common.Proxy``, on a loop of its own
    thread), what turns the store away (``True``: every connection cut, new ones refused)
    or back (``False``), and what makes it silent (``True``: connections, open and new, held
    but nothing relayed, as behind a dead route) or not (``False``: what was swallowed is
    lost, the held connections are cut)."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    proxy = Proxy(url)

    def on_loop(work: Callable[[], Awaitable[object]]) -> None:
        asyncio.run_coroutine_threadsafe(work(), loop).result(10)

    async def switch(down: bool) -> None:
        proxy.refusing = down
        if down:
            proxy.cut()

    async def hush(silent: bool) -> None:
        proxy.silent = silent
        if not silent:
            proxy.cut()

    on_loop(proxy.__aenter__)
    try:
        yield (
            proxy.url,
            lambda down: on_loop(lambda: switch(down)),
            lambda silent: on_loop(lambda: hush(silent)),
        )
    finally:
        on_loop(lambda: proxy.__aexit__(None, None, None))
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


@contextlib.contextmanager
def _relayed_site(
    kind: str, tmp_path: Path, query: str = ""
) -> Iterator[tuple[str, Callable[[bool], None], Callable[[bool], None], Path]]:
    """The site on a store of ``kind`` (``query`` added to its URL) reached through
    :func:`relayed`: the site's base URL, what turns the store away, what makes it silent,
    and the file oncely's log goes to."""
    url, drop = _store(kind, tmp_path)
    log = tmp_path / "oncely.log"
    command = [sys.executable, "-m", "tests.web.django_site", "{port}"]
    try:
        with (
            relayed(url + query) as (through, down, silent),
            serving_command(
                command, ONCELY_TEST_HTTP_STORE=through, ONCELY_TEST_LOG=str(log)
            ) as base,
        ):
            yield base, down, silent, log
    finally:
        drop()


@pytest.fixture(params=["postgres", "redis"])
def relayed_server(
    request: pytest.FixtureRequest, tmp_path: Path
) -> Iterator[tuple[str, Callable[[bool], None], Path]]:
    """The site on a PostgreSQL or Redis store reached through a relay the test turns off
    and on; the file oncely's log goes to."""
    # On PostgreSQL a connection is waited for 0.5 s, not 10: quick tries.
    query = "&connect_timeout=0.5" if request.param == "postgres" else ""
    with _relayed_site(request.param, tmp_path, query) as (base, store_down, _silent, log):
        yield base, store_down, log


def _post_held_at_the_gate(
    client: httpx.Client, route: str, k: str, body: dict[str, object]
) -> concurrent.futures.Future[httpx.Response]:
    """Post ``body`` (whose ``gate`` holds the view) in a thread; return once the view runs,
    so the claim is taken."""
    pool = concurrent.futures.ThreadPoolExecutor(1)
    sent = pool.submit(client.post, route, json=body, headers={"Idempotency-Key": k}, timeout=60)
    pool.shutdown(wait=False)
    deadline = time.monotonic() + 20
    while effects(client).get(str(body["id"])) != 1:
        assert time.monotonic() < deadline and not sent.done(), "the view did not start"
        time.sleep(0.02)
    return sent


def _once_back(client: httpx.Client, body: dict[str, object], k: str) -> httpx.Response:
    """The answer to ``body`` once the store answers again (503 meanwhile: its pool
    reconnects after a backoff of its own)."""
    deadline = time.monotonic() + 20
    while True:
        got = client.post("/orders", json=body, headers={"Idempotency-Key": k})
        if got.status_code != 503 or time.monotonic() > deadline:
            return got
        time.sleep(0.2)


@pytest.mark.parametrize("relayed_server", ["redis"], indirect=True)
def test_django_a_store_blip_at_completion_keeps_the_response(
    relayed_server: tuple[str, Callable[[bool], None], Path], tmp_path: Path
) -> None:
    """The store is unreachable from the moment the view has run until 3 s later: the
    completion is retried until it goes through, the client gets the view's 201, and the
    retry is the replay (the view ran once). On Redis, whose client fails at once and
    reconnects at once; PostgreSQL's pool waits for a connection (``connect_timeout``, 10 s by
    default) and reconnects after a backoff of its own (1 s, 2 s, 4 s...), so its recovery
    from a blip is the pool's more than this layer's."""
    base, store_down, log = relayed_server
    gate = tmp_path / "gate"
    with httpx.Client(base_url=base) as client:
        k, order = key(), f"b-{uuid.uuid4().hex[:8]}"
        body = {"id": order, "gate": str(gate)}
        sent = _post_held_at_the_gate(client, "/orders", k, body)
        store_down(True)
        gate.touch()  # the view returns while the store is away
        time.sleep(3.0)  # longer than the inbox's own retries of a completion
        store_down(False)
        first = sent.result(30)
        assert first.status_code == 201, first.text
        assert first.json() == {"order": order, "run": 1}
        again = client.post("/orders", json=body, headers={"Idempotency-Key": k})
        assert again.headers["idempotent-replayed"] == "true", again.text
        _same_response(first, again)
        assert effects(client)[order] == 1
    assert "could not be completed" not in log.read_text()


def test_django_a_store_down_past_the_retries_still_sends_the_response(
    relayed_server: tuple[str, Callable[[bool], None], Path], tmp_path: Path
) -> None:
    """The store stays away longer than the completion is retried: the client still gets
    the view's 201 (the work was done), and an ERROR says the record was not completed."""
    base, store_down, log = relayed_server
    gate = tmp_path / "gate"
    with httpx.Client(base_url=base) as client:
        k, order = key(), f"d-{uuid.uuid4().hex[:8]}"
        body = {"id": order, "gate": str(gate)}
        sent = _post_held_at_the_gate(client, "/orders", k, body)
        store_down(True)
        gate.touch()
        first = sent.result(30)
        store_down(False)
        assert first.status_code == 201, first.text
        assert first.json() == {"order": order, "run": 1}
        # Not released: within the lease a retry is told the request is in progress (once the
        # store answers again: PostgreSQL's pool reconnects after a backoff, 503 until then).
        retry = _once_back(client, body, k)
        assert retry.status_code == 409, retry.text
        assert effects(client)[order] == 1
    logged = log.read_text()
    assert "ERROR oncely.http" in logged and "could not be completed" in logged, logged


SILENT_FOR = 25.0
"""Seconds a test keeps the store silent at most, waiting for the answer: longer than the
middleware holds a request on a store gone silent (the store's ``read_timeout``, 10 s, per
statement), where before the request waited until the store came back."""


@pytest.fixture
def silent_server(tmp_path: Path) -> Iterator[tuple[str, Callable[[bool], None], Path]]:
    """The site on PostgreSQL with its defaults (``connect_timeout`` and ``read_timeout``,
    10 s each) reached through a relay the test makes silent; the file oncely's log goes to."""
    with _relayed_site("postgres", tmp_path) as (base, _down, silent, log):
        yield base, silent, log


@pytest.mark.slow
def test_r19_django_a_store_gone_silent_before_the_claim_answers_503_and_runs_nothing(
    silent_server: tuple[str, Callable[[bool], None], Path],
) -> None:
    """The store (PostgreSQL) goes silent, its connections held without an answer, before a
    request arrives: the client gets ``503`` with ``Retry-After`` while the store is still
    silent (before, the request hung until the store came back), nothing runs, and once the
    store is back the retry runs the request once."""
    base, silent, _log = silent_server
    with httpx.Client(base_url=base, timeout=60) as client:
        warm = {"id": f"warm-{uuid.uuid4().hex[:8]}"}  # opens the store's connections
        assert client.post("/orders", json=warm, headers={"Idempotency-Key": key()}).is_success
        k, order = key(), f"sc-{uuid.uuid4().hex[:8]}"
        body = {"id": order}
        silent(True)
        try:
            pool = concurrent.futures.ThreadPoolExecutor(1)
            sent = pool.submit(client.post, "/orders", json=body, headers={"Idempotency-Key": k})
            pool.shutdown(wait=False)
            first = sent.result(SILENT_FOR)  # the store stays silent until then
        finally:
            silent(False)
        assert first.status_code == 503, first.text
        assert first.headers["content-type"] == "application/problem+json"
        assert "retry-after" in first.headers
        assert order not in effects(client)
        again = _once_back(client, body, k)
        assert again.status_code == 201, again.text
        assert effects(client)[order] == 1


@pytest.mark.slow
def test_r19_django_a_store_gone_silent_at_completion_still_sends_the_response(
    silent_server: tuple[str, Callable[[bool], None], Path], tmp_path: Path
) -> None:
    """The store goes silent while the view runs: the completion's statement is cut at the
    store's ``read_timeout``, the client gets the view's ``201`` while the store is still
    silent (before, the response waited until the store came back), an ERROR says the record
    was not completed, and a repeat once the store is back gets ``409`` (not run again)."""
    base, silent, log = silent_server
    gate = tmp_path / "gate"
    with httpx.Client(base_url=base, timeout=60) as client:
        k, order = key(), f"sd-{uuid.uuid4().hex[:8]}"
        body = {"id": order, "gate": str(gate)}
        sent = _post_held_at_the_gate(client, "/orders", k, body)
        silent(True)
        try:
            gate.touch()  # the view returns while the store is silent
            first = sent.result(SILENT_FOR)  # the store stays silent until then
        finally:
            silent(False)
        assert first.status_code == 201, first.text
        assert first.json() == {"order": order, "run": 1}
        again = _once_back(client, body, k)
        assert again.status_code == 409, again.text  # held until its lease lapses
        assert effects(client)[order] == 1
    logged = log.read_text()
    assert "ERROR oncely.http" in logged and "could not be completed" in logged, logged


@pytest.fixture
def logged_server(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """The site on SQLite, and the file oncely's log goes to."""
    url, drop = _store("sqlite", tmp_path)
    log = tmp_path / "oncely.log"
    command = [sys.executable, "-m", "tests.web.django_site", "{port}"]
    try:
        with serving_command(command, ONCELY_TEST_HTTP_STORE=url, ONCELY_TEST_LOG=str(log)) as base:
            yield base, log
    finally:
        drop()


def test_r16_r19_django_a_long_path_and_a_reused_key_are_the_clients_own(
    logged_server: tuple[str, Path],
) -> None:
    """A 200-character key on a 400-character path is taken (it was refused as an invalid
    key: the scoped key was over the inbox's limit), two such paths differing only at their
    end stay apart, and a key reused for another body is logged as the client's mistake
    (WARNING), not as an ERROR any client could write at will."""
    base, log = logged_server
    k = '"' + "k" * 198 + '"'  # a structured-field string, 200 characters in all
    long_a, long_b = "/orders/" + "a" * 399 + "1", "/orders/" + "a" * 399 + "2"
    with httpx.Client(base_url=base) as client:
        first = client.post(long_a, json={"id": "long-1"}, headers={"Idempotency-Key": k})
        assert first.status_code == 201, first.text
        other = client.post(long_b, json={"id": "long-2"}, headers={"Idempotency-Key": k})
        assert other.status_code == 201 and other.json()["order"] == "long-2"
        again = client.post(long_a, json={"id": "long-1"}, headers={"Idempotency-Key": k})
        assert again.content == first.content and again.headers["idempotent-replayed"] == "true"
        reused = client.post(long_a, json={"id": "long-3"}, headers={"Idempotency-Key": k})
        assert reused.status_code == 422
        assert effects(client) == {"long-1": 1, "long-2": 1}
    logged = log.read_text().splitlines()
    conflicts = [line for line in logged if "key_conflict" in line]
    assert conflicts and all(line.startswith("WARNING ") for line in conflicts), logged
    assert not [line for line in logged if line.startswith("ERROR ")], logged


def test_r19_django_a_client_gone_mid_upload_claims_nothing_and_its_retry_runs(
    server: str,
) -> None:
    # Before, Django's request.body was the part that had arrived: the view ran on it, its
    # response was kept, and the client's retry with the whole body was refused (422).
    assert_a_retry_after_a_cut_upload_runs(server)


@pytest.mark.parametrize("route", ["/orders", "/decorated"])
def test_r17_django_a_view_gets_one_downstream_key_per_idempotency_key(
    server: str, route: str
) -> None:
    """Inside the view (behind the middleware, or ``@idempotent``), ``oncely.current()`` is
    the request, as a message handler's is its message: ``downstream_key("charge")`` is the
    same on the client's retry of one Idempotency-Key and another for another key. Before,
    there was no context there (``oncely.handling()`` raised ``LookupError``)."""
    with httpx.Client(base_url=server) as client:
        k, order = key(), f"d-{uuid.uuid4().hex[:8]}"
        body = {"id": order, "fail_once": True, "downstream": True}
        failed = client.post(route, json=body, headers={"Idempotency-Key": k})
        retry = client.post(route, json=body, headers={"Idempotency-Key": k})
        other = client.post(
            route, json={**body, "id": f"{order}-2"}, headers={"Idempotency-Key": key()}
        )
    assert failed.status_code == 500 and retry.status_code == 201
    assert failed.json()["downstream"] is not None
    assert retry.json()["downstream"] == failed.json()["downstream"]
    assert other.json()["downstream"] not in (None, failed.json()["downstream"])

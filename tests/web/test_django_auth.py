"""oncely's Django layer and Django's users, on a real server (``tests/web/django_auth_site.py``):
keys are scoped per signed-in user by default, which needs ``request.user``, so oncely's
middleware must come after ``AuthenticationMiddleware``. In the wrong order every user would
share the ``anonymous`` scope and one could be replayed another's response: the request is
refused with ``ImproperlyConfigured`` instead, naming the order to use."""

from __future__ import annotations

import contextlib
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.web.test_asgi import key, serving_command

pytest.importorskip("django")


@contextlib.contextmanager
def site(mode: str, tmp_path: Path) -> Iterator[str]:
    command = [sys.executable, "-m", "tests.web.django_auth_site", "{port}"]
    with serving_command(
        command,
        ONCELY_TEST_DJANGO_AUTH=mode,
        ONCELY_TEST_DJANGO_DB=str(tmp_path / f"{mode}.db"),
    ) as base:
        yield base


@contextlib.contextmanager
def signed_in(base: str, user: str) -> Iterator[httpx.Client]:
    # Accept: text/plain, so DEBUG's 500 page is the exception's text, not HTML.
    with httpx.Client(base_url=base, headers={"accept": "text/plain"}) as client:
        assert client.post("/login", json={"user": user}).status_code == 200
        yield client


def _refused(response: httpx.Response) -> None:
    assert response.status_code == 500
    assert "ImproperlyConfigured" in response.text, response.text[:2000]
    assert (
        "list 'django.contrib.auth.middleware.AuthenticationMiddleware' in MIDDLEWARE before "
        "'oncely.integrations.django.http.IdempotencyMiddleware'"
    ) in response.text


def test_django_oncely_before_the_auth_middleware_is_refused_not_shared(tmp_path: Path) -> None:
    """Alice and Bob send the same key: before, Bob got Alice's replayed 201 (both were
    ``anonymous``); now each request is refused, loudly, and no view runs."""
    with (
        site("before", tmp_path) as base,
        signed_in(base, "alice") as alice,
        signed_in(base, "bob") as bob,
    ):
        k = key()
        a_order, b_order = f"a-{uuid.uuid4().hex[:8]}", f"b-{uuid.uuid4().hex[:8]}"
        _refused(alice.post("/orders", json={"id": a_order}, headers={"Idempotency-Key": k}))
        _refused(bob.post("/orders", json={"id": b_order}, headers={"Idempotency-Key": k}))
        assert alice.get("/effects").json() == {}
        # Without a key the middleware has nothing to scope: the view runs.
        assert alice.post("/orders", json={"id": a_order}).status_code == 201


def test_django_an_idempotent_view_without_the_auth_middleware_is_refused(
    tmp_path: Path,
) -> None:
    with site("missing", tmp_path) as base, signed_in(base, "alice") as alice:
        k, order = key(), f"a-{uuid.uuid4().hex[:8]}"
        _refused(alice.post("/decorated", json={"id": order}, headers={"Idempotency-Key": k}))
        assert alice.get("/effects").json() == {}


@pytest.mark.parametrize("route", ["/orders", "/decorated"])
def test_django_oncely_after_the_auth_middleware_scopes_each_user(
    tmp_path: Path, route: str
) -> None:
    with (
        site("after", tmp_path) as base,
        signed_in(base, "alice") as alice,
        signed_in(base, "bob") as bob,
    ):
        k = key()
        a_order, b_order = f"a-{uuid.uuid4().hex[:8]}", f"b-{uuid.uuid4().hex[:8]}"
        a = alice.post(route, json={"id": a_order}, headers={"Idempotency-Key": k})
        b = bob.post(route, json={"id": b_order}, headers={"Idempotency-Key": k})
        assert a.status_code == b.status_code == 201
        assert a.json()["order"] == a_order and b.json()["order"] == b_order
        assert "idempotent-replayed" not in b.headers
        again = alice.post(route, json={"id": a_order}, headers={"Idempotency-Key": k})
        assert again.headers["idempotent-replayed"] == "true" and again.content == a.content
        assert alice.get("/effects").json() == {a_order: 1, b_order: 1}


def test_django_a_principal_of_the_projects_own_needs_no_user(tmp_path: Path) -> None:
    """``principal=`` says how requests are told apart: the order of the middleware is the
    project's business then."""
    with site("principal", tmp_path) as base, httpx.Client(base_url=base) as client:
        k = key()
        a_order, b_order = f"a-{uuid.uuid4().hex[:8]}", f"b-{uuid.uuid4().hex[:8]}"
        a = client.post(
            "/orders", json={"id": a_order}, headers={"Idempotency-Key": k, "x-client": "A"}
        )
        b = client.post(
            "/orders", json={"id": b_order}, headers={"Idempotency-Key": k, "x-client": "B"}
        )
        assert a.status_code == b.status_code == 201
        assert a.json()["order"] == a_order and b.json()["order"] == b_order


@pytest.mark.parametrize("route", ["/orders", "/decorated"])
def test_django_without_django_contrib_auth_requests_share_the_anonymous_scope(
    tmp_path: Path, route: str
) -> None:
    """No users to tell apart: the ``anonymous`` scope, as before."""
    with site("none", tmp_path) as base, httpx.Client(base_url=base) as client:
        k, order = key(), f"n-{uuid.uuid4().hex[:8]}"
        first = client.post(route, json={"id": order}, headers={"Idempotency-Key": k})
        assert first.status_code == 201, first.text
        again = client.post(route, json={"id": order}, headers={"Idempotency-Key": k})
        assert again.headers["idempotent-replayed"] == "true" and again.content == first.content
        assert client.get("/effects").json() == {order: 1}


def test_django_a_request_refused_before_its_view_is_not_kept(tmp_path: Path) -> None:
    """Django's CSRF check answers 403 before the view (in ``process_view``, inside every
    middleware's ``__call__``). Before, that 403 was kept as the key's response: the client
    that fetched a token and retried with the same key was answered the stale 403 again, and
    its order was never taken."""
    with site("after", tmp_path) as base, signed_in(base, "alice") as alice:
        k, order = key(), f"g-{uuid.uuid4().hex[:8]}"
        refused = alice.post("/guarded", json={"id": order}, headers={"Idempotency-Key": k})
        assert refused.status_code == 403
        token = alice.get("/token").json()["token"]
        headers = {"Idempotency-Key": k, "X-CSRFToken": token}
        taken = alice.post("/guarded", json={"id": order}, headers=headers)
        assert taken.status_code == 201 and taken.json() == {"order": order, "run": 1}
        again = alice.post("/guarded", json={"id": order}, headers=headers)
        assert again.headers["idempotent-replayed"] == "true" and again.json()["run"] == 1
        assert alice.get("/effects").json()[order] == 1

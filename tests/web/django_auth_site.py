"""A Django site with users, for ``tests/web/test_django_auth.py``: Django's WSGI handler on a
threaded ``wsgiref`` server in a process of its own (``python -m tests.web.django_auth_site
PORT``), its users and sessions in the SQLite database ``ONCELY_TEST_DJANGO_DB`` (migrated on
start), oncely's inbox in memory. ``ONCELY_TEST_DJANGO_AUTH`` sets it up:

- ``after``: oncely's middleware after Django's ``CsrfViewMiddleware`` and
  ``AuthenticationMiddleware`` (the order to use);
- ``before``: oncely's middleware before it (the mistake: no ``request.user`` yet);
- ``principal``: before it, with a ``principal`` function of the project's own;
- ``missing``: ``django.contrib.auth`` installed, its middleware not in ``MIDDLEWARE``;
- ``none``: no ``django.contrib.auth`` at all (no users: one anonymous scope).

``POST /login`` signs the client in as the body's ``user``; ``POST /orders`` runs behind the
middleware (not in ``missing``), ``POST /decorated`` behind the view decorator alone,
``POST /guarded`` behind the middleware and Django's CSRF check (``GET /token`` hands out
the token); ``GET /effects`` counts the runs."""

from __future__ import annotations

import json
import os
import sys
import threading
from collections import Counter

import django
from django.conf import settings

import oncely

MODE = os.environ["ONCELY_TEST_DJANGO_AUTH"]
SESSIONS = "django.contrib.sessions.middleware.SessionMiddleware"
AUTH = "django.contrib.auth.middleware.AuthenticationMiddleware"
CSRF = "django.middleware.csrf.CsrfViewMiddleware"
ONCELY = "oncely.integrations.django.http.IdempotencyMiddleware"
MIDDLEWARE = {
    "after": [SESSIONS, CSRF, AUTH, ONCELY],
    "before": [SESSIONS, ONCELY, AUTH],
    "principal": [SESSIONS, ONCELY, AUTH],
    "missing": [SESSIONS],
    "none": [ONCELY],
}[MODE]
APPS = [] if MODE == "none" else ["django.contrib.contenttypes", "django.contrib.auth"]
ONCELY_HTTP: dict[str, object] = {
    "store": "memory://",
    "consumer": "django-auth-api",
    "applies": lambda request: request.path in ("/orders", "/guarded"),
}
if MODE == "principal":
    ONCELY_HTTP["principal"] = lambda request: request.META.get("HTTP_X_CLIENT", "anon")

settings.configure(
    DEBUG=True,  # a 500 answers the exception's text, for the tests to read
    SECRET_KEY="tests-only",
    ALLOWED_HOSTS=["*"],
    ROOT_URLCONF=__name__,
    MIDDLEWARE=MIDDLEWARE,
    INSTALLED_APPS=[*APPS, "django.contrib.sessions"] if APPS else [],
    DATABASES={
        "default": {
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": os.environ["ONCELY_TEST_DJANGO_DB"],
        }
    },
    SESSION_ENGINE="django.contrib.sessions.backends.signed_cookies",
    DEFAULT_AUTO_FIELD="django.db.models.AutoField",
    USE_TZ=True,
    ONCELY_HTTP=ONCELY_HTTP,
)
django.setup()

from django.http import HttpRequest, HttpResponse, HttpResponseBase, JsonResponse  # noqa: E402
from django.urls import path  # noqa: E402
from django.views.decorators.csrf import csrf_exempt  # noqa: E402

from oncely.integrations.django.http import idempotent  # noqa: E402

EFFECTS: Counter[str] = Counter()
LOCK = threading.Lock()


@csrf_exempt
def login(request: HttpRequest) -> HttpResponse:
    from django.contrib.auth import login as sign_in
    from django.contrib.auth.models import User

    name = str(json.loads(request.body)["user"])
    user, _ = User.objects.get_or_create(username=name)
    sign_in(request, user, backend="django.contrib.auth.backends.ModelBackend")
    return JsonResponse({"user": name, "pk": user.pk})


def _run(request: HttpRequest) -> HttpResponse:
    order = str(json.loads(request.body or b"{}").get("id"))
    with LOCK:
        EFFECTS[order] += 1
        run = EFFECTS[order]
    return JsonResponse({"order": order, "run": run}, status=201)


@csrf_exempt
def orders(request: HttpRequest) -> HttpResponse:
    return _run(request)


@csrf_exempt
@idempotent(inbox=oncely.Inbox(oncely.open("memory://"), consumer="django-auth-decorated"))
def decorated(request: HttpRequest) -> HttpResponseBase:
    return _run(request)


def guarded(request: HttpRequest) -> HttpResponse:
    """As ``/orders``, but not exempt from Django's CSRF check."""
    return _run(request)


def token(request: HttpRequest) -> JsonResponse:
    from django.middleware.csrf import get_token

    return JsonResponse({"token": get_token(request)})


def effects(request: HttpRequest) -> JsonResponse:
    with LOCK:
        return JsonResponse(dict(EFFECTS))


urlpatterns = [
    path("login", login),
    path("orders", orders),
    path("decorated", decorated),
    path("guarded", guarded),
    path("token", token),
    path("effects", effects),
]


def main() -> None:
    from django.core.management import call_command
    from django.core.wsgi import get_wsgi_application

    from tests.web.wsgi_serve import serve

    if APPS:
        call_command("migrate", verbosity=0, interactive=False)
    serve(get_wsgi_application(), int(sys.argv[1]))


if __name__ == "__main__":
    main()

"""The Django site ``tests/web/test_django.py`` serves: Django's WSGI handler on a threaded
``wsgiref`` server in a process of its own (``python -m tests.web.django_site PORT``; the store
from ``ONCELY_TEST_HTTP_STORE``). ``POST /orders`` runs behind oncely's middleware (from
``MIDDLEWARE``), ``POST /decorated`` behind the view decorator alone (the middleware skips
it), ``POST /stream`` answers a streaming response, ``POST /page`` (middleware) and
``POST /decorated-page`` (decorator) answer a ``TemplateResponse`` Django has not rendered yet,
``POST /notes`` counts any body by its size, ``GET /effects`` counts the runs. A body's
``gate`` (a file path) holds ``/orders`` after its run is counted until that file exists: a
test does something to the store meanwhile."""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import django
from django.conf import settings

import oncely

STORE = os.environ["ONCELY_TEST_HTTP_STORE"]
settings.configure(
    DEBUG=False,
    SECRET_KEY="tests-only",
    ALLOWED_HOSTS=["*"],
    ROOT_URLCONF=__name__,
    MIDDLEWARE=["oncely.integrations.django.http.IdempotencyMiddleware"],
    INSTALLED_APPS=[],
    DATABASES={},
    TEMPLATES=[
        {
            "BACKEND": "django.template.backends.django.DjangoTemplates",
            "OPTIONS": {
                "loaders": [
                    (
                        "django.template.loaders.locmem.Loader",
                        {"order.html": "<p>order {{ order }}, run {{ run }}</p>"},
                    )
                ]
            },
        }
    ],
    ONCELY_HTTP={
        "store": STORE,
        "consumer": "django-api",
        "required": lambda request: request.path == "/orders",
        "applies": lambda request: not request.path.startswith("/decorated"),
        "principal": lambda request: request.META.get("HTTP_X_CLIENT", "anon"),
    },
)
django.setup()

from django.http import (  # noqa: E402
    HttpRequest,
    HttpResponse,
    HttpResponseBase,
    JsonResponse,
    StreamingHttpResponse,
)
from django.template.response import TemplateResponse  # noqa: E402
from django.urls import path  # noqa: E402
from django.views.decorators.csrf import csrf_exempt  # noqa: E402

from oncely.integrations.django.http import idempotent  # noqa: E402

EFFECTS: Counter[str] = Counter()
FAILED_ONCE: set[str] = set()
LOCK = threading.Lock()
if os.environ.get("ONCELY_TEST_LOG"):  # what oncely logs, for a test to read
    _log = logging.FileHandler(os.environ["ONCELY_TEST_LOG"])
    _log.setFormatter(logging.Formatter("%(levelname)s %(name)s %(message)s"))
    logging.getLogger("oncely").addHandler(_log)
    logging.getLogger("oncely").setLevel(logging.INFO)


def _run(request: HttpRequest) -> HttpResponse:
    body = json.loads(request.body or b"{}")
    order = str(body.get("id"))
    now = oncely.current()  # R17: the request the middleware runs, as a message handler's
    said = (
        {"downstream": now.downstream_key("charge") if now else None}
        if body.get("downstream")
        else {}
    )
    time.sleep(float(body.get("sleep", 0)))
    with LOCK:
        EFFECTS[order] += 1
        if body.get("fail_once") and order not in FAILED_ONCE:
            FAILED_ONCE.add(order)
            return JsonResponse({"error": "the ledger is down", **said}, status=500)
        run = EFFECTS[order]
    gate = body.get("gate")
    deadline = time.monotonic() + 20
    while gate and not Path(gate).exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    response = JsonResponse({"order": order, "run": run, **said}, status=201)
    response["X-App"] = "django"
    return response


@csrf_exempt
def orders(request: HttpRequest) -> HttpResponse:
    return _run(request)


@csrf_exempt
@idempotent(
    inbox=oncely.Inbox(oncely.open(STORE), consumer="django-decorated"),
    required=True,
)
def decorated(request: HttpRequest) -> HttpResponse:
    return _run(request)


@csrf_exempt
def stream(request: HttpRequest) -> StreamingHttpResponse:
    order = str(json.loads(request.body or b"{}").get("id"))
    with LOCK:
        EFFECTS[order] += 1
    return StreamingHttpResponse(iter([b"part one, ", b"part two"]), status=201)


def _page(request: HttpRequest) -> TemplateResponse:
    """An order as a page: a ``TemplateResponse`` whose template Django renders after the view
    (``missing.html`` on a body's ``fail_once``, the first time: rendering it raises)."""
    body = json.loads(request.body or b"{}")
    order = str(body.get("id"))
    with LOCK:
        EFFECTS[order] += 1
        run = EFFECTS[order]
        broken = bool(body.get("fail_once")) and order not in FAILED_ONCE
        FAILED_ONCE.add(order)
    template = "missing.html" if broken else "order.html"
    response = TemplateResponse(request, template, {"order": order, "run": run}, status=201)
    response["X-App"] = "django"
    return response


@csrf_exempt
def page(request: HttpRequest) -> TemplateResponse:
    return _page(request)


@csrf_exempt
@idempotent(
    inbox=oncely.Inbox(oncely.open(STORE), consumer="django-decorated-page"),
    required=True,
)
def decorated_page(request: HttpRequest) -> HttpResponseBase:
    return _page(request)


@csrf_exempt
def long_orders(request: HttpRequest, rest: str) -> HttpResponse:
    """``orders`` under any sub-path: a path as long as a client makes it."""
    return _run(request)


@csrf_exempt
def notes(request: HttpRequest) -> JsonResponse:
    """Any body (an upload, a partial one): one effect per run, by its size."""
    size = len(request.body)
    with LOCK:
        EFFECTS[f"note:{size}"] += 1
        return JsonResponse({"size": size, "run": EFFECTS[f"note:{size}"]}, status=201)


def effects(request: HttpRequest) -> JsonResponse:
    with LOCK:
        return JsonResponse(dict(EFFECTS))


urlpatterns = [
    path("orders", orders),
    path("orders/<path:rest>", long_orders),
    path("decorated", decorated),
    path("stream", stream),
    path("page", page),
    path("decorated-page", decorated_page),
    path("notes", notes),
    path("effects", effects),
]


def main() -> None:
    from django.core.wsgi import get_wsgi_application

    from tests.web.wsgi_serve import serve

    serve(get_wsgi_application(), int(sys.argv[1]))


if __name__ == "__main__":
    main()

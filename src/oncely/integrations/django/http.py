"""The ``Idempotency-Key`` HTTP layer of :mod:`oncely.http` in Django's own terms: a middleware
for ``settings.MIDDLEWARE`` and a decorator for one view, on a sync :class:`~oncely.Inbox`,
with the same answers (the stored response replayed byte for byte with
``Idempotent-Replayed: true``, 409 while the first runs, 422 for another body, 400 for a
missing or malformed key, RFC 9457 problem details) and the same options as
:class:`~oncely.http.WSGIIdempotencyMiddleware` (``principal`` and ``applies`` get the
``HttpRequest``).

The middleware, configured in the settings, comes after Django's CSRF and authentication
middleware::

    MIDDLEWARE = [
        ...,
        "django.contrib.sessions.middleware.SessionMiddleware",
        "django.middleware.csrf.CsrfViewMiddleware",
        "django.contrib.auth.middleware.AuthenticationMiddleware",
        "oncely.integrations.django.http.IdempotencyMiddleware",  # after the line above
    ]
    ONCELY_HTTP = {"store": "postgresql://app@db/shop", "consumer": "shop-api",
                   "required": True}                  # or "inbox": an oncely.Inbox

Per view, without the middleware (``AuthenticationMiddleware`` still in ``MIDDLEWARE``)::

    from oncely.integrations.django.http import idempotent

    @idempotent(inbox=inbox, required=True)
    def create_order(request): ...

Keys are scoped per principal: by default the signed-in user (``request.user``), else a hash
of the ``Authorization`` header, else ``anonymous``. With ``django.contrib.auth`` installed,
a request that reaches this layer without ``request.user`` (oncely's middleware listed before
``AuthenticationMiddleware``, or that one missing) raises ``ImproperlyConfigured`` naming the
order to use, rather than scope every user as ``anonymous`` (where one would be replayed
another's response); a project without ``django.contrib.auth`` has the ``anonymous`` scope,
and a ``principal`` of the project's own is used as it is, whatever the order.

The middleware keeps only what the view answered: a response made before the view is reached
(``CsrfViewMiddleware``'s ``403``, another ``process_view`` hook's refusal, a path with no
view) is sent but not kept, so the client's corrected retry runs (list this middleware after
``CsrfViewMiddleware``: its hook then comes first).

A ``TemplateResponse`` (any ``SimpleTemplateResponse``, DRF's ``Response`` too) is kept as
rendered: Django renders it before the middleware sees it; the decorator renders it itself,
so a ``process_template_response`` hook that changes it afterwards does not change it. A
streaming response is sent but not kept (the claim is released, so a repeat runs again);
cookies are never kept. When the response cannot be rendered or kept, the claim is released.
When the store cannot be reached to complete the claim after the view ran, the completion is
retried as the WSGI middleware retries it (up to 5 s, at most a third of the lease, the
claim renewed meanwhile); if it still fails the view's response is sent all the same and an
ERROR is logged (the record is not completed: a repeat gets 409 until the claim's lease
lapses, then runs the view again). A call to a store gone silent (a dead route: no reset, no
answer) lasts as long as the store's own bound (on PostgreSQL and MariaDB/MySQL
``read_timeout``, 10 s by default): the claim then answers 503, a completion sends the response.

Tested with Django's WSGI handler served by a threaded ``wsgiref`` server, on SQLite,
PostgreSQL and Redis stores (``tests/web/test_django.py``, ``tests/web/test_django_auth.py``).
"""

from __future__ import annotations

import functools
import hashlib
import logging
from collections.abc import Callable
from typing import Any

try:
    from django.apps import apps
    from django.conf import settings
    from django.core.exceptions import ImproperlyConfigured
    from django.http import HttpRequest, HttpResponse, HttpResponseBase
except ImportError as exc:  # pragma: no cover - the extra is missing
    raise ImportError(
        "oncely.integrations.django needs Django: pip install 'oncely[django]'"
    ) from exc

import oncely
from oncely._core.observe import CLIENT_KEYS, key_for_logs, log_error, redact_keys
from oncely._core.said import said
from oncely.errors import ConfigurationError, StoreUnavailable
from oncely.http import (
    _GONE,
    Reply,
    _cut_short,
    _handling,
    _Policy,
    _store_down,
    _wsgi_headers,
    answer,
    request_fingerprint,
    scoped_key,
)
from oncely.inbox.sync_inbox import Claimed, Inbox

__all__ = ["IdempotencyMiddleware", "default_principal", "idempotent"]

LOGGER = logging.getLogger("oncely.http")

View = Callable[..., HttpResponseBase]

_AUTH_MIDDLEWARE = "django.contrib.auth.middleware.AuthenticationMiddleware"
_REACHED = "_oncely_view_reached"
"""The request attribute the middleware's ``process_view`` sets: the view was reached."""


def default_principal(request: HttpRequest) -> str:
    """The signed-in user (``user:<pk>``), else a hash of the ``Authorization`` header, else
    ``anonymous``."""
    user = getattr(request, "user", None)
    if user is not None and getattr(user, "is_authenticated", False):
        return f"user:{user.pk}"
    authorization = request.META.get("HTTP_AUTHORIZATION")
    if authorization:
        digest = hashlib.sha256(str(authorization).encode("latin-1")).hexdigest()[:32]
        return f"auth:{digest}"
    return "anonymous"


class _Guard(_Policy):
    """The policy on Django's request and response objects."""

    def __init__(self, inbox: Inbox, **options: Any) -> None:
        if not isinstance(inbox, Inbox):
            raise ConfigurationError(
                "oncely's Django layer takes a sync Inbox (inbox=...); Django runs a sync "
                "middleware in a thread under ASGI too"
            )
        if options.get("transactional"):
            raise ConfigurationError(
                "transactional=True is not offered in Django's layer: the transaction would "
                "be the store's connection, not Django's; use the two-phase mode (the default)"
            )
        # Scoped per signed-in user only when the principal is the default one: a principal
        # the project gives says on its own how requests are told apart.
        self._per_user = "principal" not in options
        options.setdefault("principal", default_principal)
        super().__init__(**options)
        self._check_inbox(inbox)
        self.inbox = inbox

    def run(
        self,
        request: HttpRequest,
        call: Callable[[], HttpResponseBase],
        reached: Callable[[], bool] | None = None,
    ) -> HttpResponseBase:
        """``call`` (the view, or the rest of the middleware chain) under the key's claim.
        ``reached``, after it: whether the view was reached; a response made before it (a
        ``process_view`` hook's refusal, Django's CSRF check's ``403``) is not the view's
        answer to the request, and is not kept."""
        method = str(request.method or "GET").upper()
        if method not in self.methods or (self._applies is not None and not self._applies(request)):
            return call()
        headers = _wsgi_headers(request.META)
        first = self._header_step(headers, request)
        if first is None:
            return call()
        if isinstance(first, tuple):
            return _response(first)
        body = self._read(request)
        if body is _GONE:
            return _response(_cut_short())  # the client went away mid-upload: nothing run
        scope = {
            "headers": headers,
            "method": method,
            "path": request.path,
            "query_string": str(request.META.get("QUERY_STRING", "")).encode("latin-1"),
            "request": request,
        }
        key = self._body_step(scope, body, first if isinstance(first, str) else None)
        if not isinstance(key, str):
            return _response(key)
        assert body is not None
        if self._per_user and not hasattr(request, "user"):
            _refuse_without_user()
        who = self._principal(request)
        if not isinstance(who, str):
            raise ConfigurationError("a Django principal returns a str")
        scoped = scoped_key(who, method, request.path, key, max_bytes=self._max_scoped)
        fingerprint = request_fingerprint(
            str(request.META.get("QUERY_STRING", "")).encode("latin-1"),
            body,
            request.META.get("CONTENT_TYPE") or None,
        )
        client = CLIENT_KEYS.set(True)  # a key reused for another request: the client's error
        try:
            claimed: Claimed[Any] = self.inbox.claim(scoped, fingerprint, wait=self._wait)
        except StoreUnavailable as exc:
            return _response(_store_down(scoped, exc, self._log_keys))
        finally:
            CLIENT_KEYS.reset(client)
        if not claimed.won:
            assert claimed.handled is not None
            return _response(answer(claimed.handled))
        try:
            with _handling(self.inbox.consumer, claimed):
                response = call()
        except BaseException as exc:
            claimed.release(f"the view raised {said(exc)}")
            raise
        if reached is not None and not reached():
            # Nothing ran: the retry (with the CSRF token it lacked, say) must run, not be
            # answered this refusal again.
            claimed.release(
                f"answered {response.status_code} before the view was reached: not kept"
            )
            return response
        return self._end(claimed, response)

    def _read(self, request: HttpRequest) -> bytes | None:
        """The request body; None when it is over ``max_request_bytes``; ``_GONE`` when it
        ended before its ``Content-Length`` (Django's ``request.body`` is then the part that
        arrived, with no error: the client went away mid-upload)."""
        try:
            length = int(request.META.get("CONTENT_LENGTH") or 0)
        except ValueError:
            length = 0
        if length > self._max_request:
            return None
        body = bytes(request.body)
        return _GONE if len(body) < length else body

    def _end(self, claimed: Claimed[Any], response: HttpResponseBase) -> HttpResponseBase:
        """End the claim on the view's response (kept, or given back), and return the response
        to send. Whatever goes wrong here ends the claim too: a claim left held would answer
        every retry 409 until its lease lapsed, and then run the view again."""
        try:
            response = _rendered(response)
        except BaseException as exc:
            # As a view that raises: nothing to send or keep, so the claim is given back and
            # Django answers 500 (the view's effects, if it had any, may run again on a retry).
            claimed.release(f"the response could not be rendered: {said(exc)}")
            LOGGER.warning(
                "oncely http key=%s: the view's response could not be rendered (%s); the "
                "claim was released, so a retry runs the view again",
                key_for_logs(claimed.key, self._log_keys),
                redact_keys(said(exc), (claimed.key,), self._log_keys),
            )
            raise
        if response.streaming:
            claimed.release("a streaming response is not kept")
            return response
        try:
            if not isinstance(response, HttpResponse):
                raise TypeError(f"{type(response).__name__} is not an HttpResponse")
            headers = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in response.items()]
            chunks = [bytes(response.content)]
            decided = self._decide(
                int(response.status_code), headers, chunks, len(chunks[0]), claimed.key
            )
        except Exception as exc:
            claimed.release(f"the response could not be kept: {said(exc)}")
            log_error(
                LOGGER, logging.ERROR,
                "oncely http key=%s: the view's response is sent but could not be kept (%s); "
                "the claim was released, so a repeat runs the view again",
                key_for_logs(claimed.key, self._log_keys),
                redact_keys(said(exc), (claimed.key,), self._log_keys),
                error=exc, keys=(claimed.key,), mode=self._log_keys,
            )  # fmt: skip
            return response
        if isinstance(decided, str):
            claimed.release(decided)
            return response
        try:
            # A store away is ridden out for a third of the lease at most, the claim renewed
            # meanwhile (as the WSGI and ASGI layers do): past the lease a repeat would run.
            self._complete_kept(claimed, decided)
        except Exception as exc:
            if claimed.won:
                claimed.release(f"the record could not be completed: {said(exc)}")
            log_error(
                LOGGER, logging.ERROR,
                "oncely http key=%s: the view ran and its response is sent, but oncely could "
                "not complete its record (%s); the claim was released, so a repeat runs the "
                "view again",
                key_for_logs(claimed.key, self._log_keys),
                redact_keys(said(exc), (claimed.key,), self._log_keys),
                error=exc, keys=(claimed.key,), mode=self._log_keys,
            )  # fmt: skip
        return response


def _rendered(response: HttpResponseBase) -> HttpResponseBase:
    """``response`` with its content: a ``SimpleTemplateResponse`` (a ``TemplateResponse``,
    DRF's ``Response``) not rendered yet is rendered now, and what ``render()`` returns (a
    post-render callback may return another response) is the one sent and kept.

    Django renders such a response after the view and the ``process_template_response``
    hooks, inside every middleware's ``__call__``: the middleware gets it rendered. A view
    decorator gets it straight from the view, before that. Rendering it here (an explicit
    ``render()`` is one of the ways Django's docs give) makes what is kept what the client
    gets; a ``process_template_response`` hook that changes its template or context later no
    longer changes it (use the middleware where one must). Keeping it from a post-render
    callback instead would leave the claim held by nobody when rendering fails or a hook hands
    back another response."""
    render = getattr(response, "render", None)
    if callable(render) and not getattr(response, "is_rendered", True):
        rendered = render()
        if isinstance(rendered, HttpResponseBase):
            return rendered
    return response


def _refuse_without_user() -> None:
    """Keys are scoped per signed-in user, but the request has no ``user``: with
    ``django.contrib.auth`` installed that is the authentication middleware running after
    this layer (or not at all), and every signed-in user would share the ``anonymous`` scope,
    one of them replayed another's response. Without ``django.contrib.auth`` there are no
    users to tell apart."""
    if apps.is_installed("django.contrib.auth"):
        raise ImproperlyConfigured(
            "oncely scopes Idempotency-Keys per signed-in user, but this request has no "
            f"request.user: list {_AUTH_MIDDLEWARE!r} in MIDDLEWARE before "
            "'oncely.integrations.django.http.IdempotencyMiddleware' (an @idempotent view "
            "needs it in MIDDLEWARE too), or give principal= to say how requests are told "
            "apart. Without it every user would share one scope, and one could be replayed "
            "another's response"
        )


def _response(reply: Reply) -> HttpResponse:
    status, headers, body = reply
    response = HttpResponse(body, status=status)
    del response["Content-Type"]  # Django's default: only the reply's own headers are sent
    for name, value in headers:
        response[name.decode("latin-1")] = value.decode("latin-1")
    return response


class IdempotencyMiddleware:
    """Django middleware: every view's requests with a key (POST and PATCH by default) go
    through the layer. Configured by ``settings.ONCELY_HTTP``: ``"inbox"`` (an
    :class:`~oncely.Inbox`) or ``"store"`` (a store URL) with ``"consumer"`` (default
    ``"http"``); every other entry is an option of
    :class:`~oncely.http.WSGIIdempotencyMiddleware`."""

    sync_capable = True
    async_capable = False

    def __init__(self, get_response: View) -> None:
        config = dict(getattr(settings, "ONCELY_HTTP", None) or {})
        if not config:
            raise ConfigurationError(
                "oncely's IdempotencyMiddleware needs settings.ONCELY_HTTP, e.g. "
                '{"store": "postgresql://...", "consumer": "api"}'
            )
        inbox = config.pop("inbox", None)
        store = config.pop("store", None)
        consumer = config.pop("consumer", "http")
        if inbox is None:
            if not isinstance(store, str):
                raise ConfigurationError('settings.ONCELY_HTTP needs "inbox" or "store" (a URL)')
            inbox = oncely.Inbox(oncely.open(store), consumer=consumer)
        self.get_response = get_response
        self.guard = _Guard(inbox, **config)

    def __call__(self, request: HttpRequest) -> HttpResponseBase:
        return self.guard.run(
            request,
            lambda: self.get_response(request),
            lambda: getattr(request, _REACHED, False),
        )

    def process_view(
        self, request: HttpRequest, view: View, args: Any, kwargs: Any
    ) -> HttpResponseBase | None:
        """Django calls it once the ``process_view`` hooks listed before this middleware
        (``CsrfViewMiddleware``'s among them) have let the request through to its view."""
        setattr(request, _REACHED, True)
        return None


def idempotent(*, inbox: Inbox, **options: Any) -> Callable[[View], View]:
    """A view decorator: this view's requests with a key go through the layer (the options
    of :class:`~oncely.http.WSGIIdempotencyMiddleware`; ``methods`` defaults to POST and
    PATCH). It wraps the view Django calls, above DRF's ``@api_view`` say: it renders the
    view's ``TemplateResponse`` (or DRF ``Response``) to keep it, which needs the response as
    the view hands it to Django."""
    guard = _Guard(inbox, **options)

    def decorate(view: View) -> View:
        @functools.wraps(view)
        def wrapped(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponseBase:
            return guard.run(request, lambda: view(request, *args, **kwargs))

        return wrapped

    return decorate

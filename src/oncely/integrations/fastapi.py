"""Idempotent FastAPI routes, chosen per route with a dependency.

``oncely.http.IdempotencyMiddleware`` wraps a whole app; here each route that declares the
dependency gets that same middleware in front of it alone (the same answers: the stored
response replayed byte for byte, 409, 422, 400, problem details; the same options), and the
``Idempotency-Key`` header appears in the route's OpenAPI schema::

    from fastapi import Depends, FastAPI
    from oncely.integrations.fastapi import Idempotency

    idempotency = Idempotency(inbox)                  # an AsyncInbox; middleware options
    app = FastAPI()

    @app.post("/orders", status_code=201)
    async def create(order: Order, key: str | None = Depends(idempotency)) -> dict:
        ...

    idempotency.install(app)                          # after the routes are added

:meth:`Idempotency.install` puts the middleware in front of every route of the app (those of
routers included with ``include_router`` too, at any depth) whose dependencies, or its
routers' dependencies, include this object, for the route's own methods, with the key
required unless ``required=False`` was given. A route the dependency finds without that
middleware in front of it (added after ``install``, or ``install`` never called) answers 500
and logs why, rather than run unprotected. The dependency's value is the request's
``Idempotency-Key`` (the string inside the quotes), or None on a route that does not require
one.

Tested with uvicorn serving a FastAPI app on SQLite, PostgreSQL and Redis
(``tests/web/test_fastapi.py``).
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Iterator
from typing import Annotated, Any

try:
    from fastapi import FastAPI, Header, HTTPException, Request
    from fastapi.routing import APIRoute
except ImportError as exc:  # pragma: no cover - the extra is missing
    raise ImportError(
        "oncely.integrations.fastapi needs FastAPI: pip install 'oncely[fastapi]'"
    ) from exc

from oncely.http import (
    ASGIApp,
    IdempotencyMiddleware,
    Receive,
    Scope,
    Send,
    _BadKey,
    parse_key,
)
from oncely.inbox.async_inbox import AsyncInbox

__all__ = ["Idempotency"]

_MARK = "oncely.idempotency"
HEADER_NAME = "Idempotency-Key"
_SAID = (
    "A unique key for this operation, as a quoted string (RFC 8941): a repeat with the same "
    "key gets the first response again"
)
_KEYWORD = inspect.Parameter.POSITIONAL_OR_KEYWORD
"""The scope key the per-route middleware sets: the route is protected."""


class _Marked:
    """The middleware in front of one route, marking the scope for the dependency."""

    __slots__ = ("_inner", "owner")

    def __init__(self, inner: ASGIApp, owner: Idempotency) -> None:
        self._inner = inner
        self.owner = owner

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        scope[_MARK] = self.owner
        await self._inner(scope, receive, send)


class Idempotency:
    """A FastAPI dependency that makes the routes declaring it idempotent (see the module
    docstring); ``options`` are :class:`~oncely.http.IdempotencyMiddleware`'s."""

    def __init__(self, inbox: AsyncInbox, **options: Any) -> None:
        if not isinstance(inbox, AsyncInbox):
            raise TypeError("Idempotency takes an AsyncInbox (FastAPI runs on asyncio)")
        self.inbox = inbox
        self._options = options
        self._bare = bool(options.get("bare_keys", False))
        IdempotencyMiddleware(_never, inbox=inbox, **options)  # the options, checked now
        if options.get("required", True) is True:
            # The schema says what the middleware enforces: the header is required.
            self.__signature__ = inspect.Signature(
                [
                    inspect.Parameter("request", _KEYWORD, annotation=Request),
                    inspect.Parameter(
                        "idempotency_key",
                        _KEYWORD,
                        annotation=Annotated[str, Header(alias=HEADER_NAME, description=_SAID)],
                    ),
                ],
                return_annotation=str | None,
            )

    async def __call__(
        self,
        request: Request,
        idempotency_key: Annotated[
            str | None, Header(alias="Idempotency-Key", description=_SAID)
        ] = None,
    ) -> str | None:
        if request.scope.get(_MARK) is not self:
            raise _unprotected(request)
        if idempotency_key is None:
            return None
        try:
            return parse_key([idempotency_key.encode("latin-1")], bare=self._bare)
        except _BadKey:  # (the middleware refused it already: never reached)
            return None

    def install(self, app: FastAPI) -> list[str]:
        """Put the middleware in front of each route of ``app`` that depends on this object
        (its own dependency, or one of a router it was included with); the routes' full
        paths. Call it once the routes are added and routers included (again after adding
        more)."""
        done = []
        for route in _served(app.router.routes):
            if not _depends_on(route, self) or isinstance(route.app, _Marked):
                continue  # not ours, or installed already
            options = {"methods": route.methods or ("POST",), "required": True, **self._options}
            inner = IdempotencyMiddleware(route.app, inbox=self.inbox, **options)
            route.app = _Marked(inner, self)
            done.append(str(getattr(route, "path_format", "") or route.path))
        return done


def _served(routes: Iterable[Any]) -> Iterator[Any]:
    """What serves each FastAPI route of ``routes``: the ``APIRoute`` itself where the app
    holds it (FastAPI copied an included router's routes into the app before 0.160), else,
    for a router included whole, the route as that inclusion serves it (its full path, the
    router's dependencies added, its own ASGI ``app``)."""
    for route in routes:
        if isinstance(route, APIRoute):
            yield route
            continue
        contexts = getattr(route, "effective_route_contexts", None)
        if contexts is None:
            continue
        for context in contexts():
            if isinstance(context.original_route, APIRoute) and context.app is not None:
                yield context


def _depends_on(route: Any, owner: Idempotency) -> bool:
    def walk(dependants: Iterable[Any]) -> bool:
        return any(d.call is owner or walk(d.dependencies) for d in dependants)

    dependant = route.dependant
    return dependant is not None and walk(dependant.dependencies)


def _unprotected(request: Request) -> HTTPException:
    import logging  # noqa: PLC0415 - only on this misconfiguration

    path = request.scope.get("path", "?")
    logging.getLogger("oncely.http").error(
        "oncely: the route %s depends on Idempotency but its middleware is not in front of "
        "it; call idempotency.install(app) after adding the route. The request was not run.",
        path,
    )
    return HTTPException(
        500, "this route needs idempotency.install(app): the request was not run, not retried"
    )


async def _never(scope: Scope, receive: Receive, send: Send) -> None:
    raise AssertionError("only built to check the options")

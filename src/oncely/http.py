"""HTTP endpoints made idempotent with the ``Idempotency-Key`` request header
(draft-ietf-httpapi-idempotency-key-header): an ASGI middleware on an
:class:`~oncely.AsyncInbox`, for Starlette, FastAPI, Litestar or any ASGI app (and
:class:`WSGIIdempotencyMiddleware` on a sync :class:`~oncely.Inbox`, for Flask, Django or any
WSGI app)::

    from oncely.http import IdempotencyMiddleware

    inbox = oncely.AsyncInbox(oncely.open_async("postgresql://..."), consumer="api")
    app = IdempotencyMiddleware(app, inbox=inbox, principal=lambda scope: user_of(scope))

What a request with the header gets:

======================================  ====================================================
the first request with a key            runs; its response is stored (status, headers, body)
a repeat, same method, path and body    the stored response, byte for byte, with
                                        ``Idempotent-Replayed: true``
a repeat while the first still runs     ``409 Conflict`` with ``Retry-After`` (or, with
                                        ``wait=``, the first one's response once it is done)
a repeat with another body or query     ``422 Unprocessable Content``
no key where ``required``               ``400 Bad Request``
a key that is not a Structured Field    ``400`` (``"K"``; a bare ``K`` only with
string                                  ``bare_keys=True``, and then the same key as ``"K"``)
a body over ``max_request_bytes``       ``413 Content Too Large``, never run unprotected
======================================  ====================================================

Errors are RFC 9457 problem details (``application/problem+json``). Keys are scoped per
principal (``principal(scope)``: the API key, auth subject or tenant; by default a hash of
the ``Authorization`` header, so two clients with credentials there never share a key) and per
method and path, so one client can never read another's response. An app whose clients sign
in with a cookie, or name themselves in another header (``X-API-Key``), must give
``principal=`` (the session's user, the API key's id): by default they all share the
``anonymous`` scope, and the middleware logs a warning the first time it sees such a header.
Responses are stored when ``store_status(status)`` says so: by default 2xx, 3xx and 4xx
except 408, 409, 425 and 429, never 5xx (the claim is released: a retry runs again). A
response over ``max_stored_bytes`` is sent to the client but not kept: a repeat then gets
``409`` saying it cannot be replayed (the work is never run twice).

The middleware runs the app under :meth:`AsyncInbox.claim <oncely.AsyncInbox.claim>` (the
two-phase mode: the lease is renewed while the request runs); an app that raises releases the
claim. The claim is completed before the end of the response is sent; a store that cannot be
reached then is retried for up to 5 s (a third of the lease at most), and the response goes
out either way (a record left uncompleted is logged at ERROR: a repeat may run again once the
lease lapses). The ASGI middleware cuts a try that waits on the store's own timeouts short at
that bound (psycopg first cancels a PostgreSQL statement under way: up to 10 s more); the
WSGI one cannot cut a blocking call short and waits for the try under way, for as long as the
store's own bounds let it: on PostgreSQL and MariaDB/MySQL ``read_timeout`` for a
statement's answer and ``connect_timeout`` for a connection (10 s each by default: a server
gone silent answers the claim ``503`` and sends the response after about that long), on
Redis ``timeout`` (5 s).

With ``transactional=True`` (a store with a transactional mode: PostgreSQL, MariaDB/MySQL,
SQLite, DynamoDB) the app runs inside one transaction on the store instead, which
:func:`transaction` hands to the app: the key's marker, the app's own writes through it and
the stored response commit together, and the response reaches the client only after the
commit. An app that raises, or answers with a response that is not kept (a 5xx by default),
rolls the whole transaction back: the request leaves no trace and its retry runs. On a SQL
store a repeat that arrives while the first runs waits on the database's row lock and then
gets the first response (``wait=`` and the 409 of the two-phase mode do not apply). The
response is buffered whole before the commit.

DynamoDB has no transaction to hold open, nor a row lock: :func:`transaction` is a
:class:`~oncely.stores.dynamodb.DynamoTransaction`, a buffer the app adds its writes to
(``tx.put(table, item)``, DynamoDB's typed values; nothing can be read back from it), sent
with the marker as one ``TransactWriteItems`` once the app has answered. A repeat that arrives
while the first runs finds the key unclaimed and runs the app too. The first to commit wins;
the other's commit is cancelled on the marker's condition, nothing of its writes applied, and
its client gets the first response, replayed (``Idempotent-Replayed: true``), as a repeat
that came after it would. What such a run does outside the transaction (a call to a payment
provider, an email) is done twice: pass such calls ``oncely.handling().downstream_key(...)``,
one key for every run of one Idempotency-Key, so the provider sees one. A repeat whose own
run fails (raises, or answers a response that is not kept) gets its own failure, nothing of
it committed. (A run whose second claim finds the first request's record gone, its retention
shorter than the run, runs the app once more; that last run is what commits and is sent.)

Tested with uvicorn (a plain ASGI app, a Starlette one, a FastAPI one) and a threaded
``wsgiref`` server (a Flask app) on SQLite, PostgreSQL and Redis, the transactional mode on
SQLite, PostgreSQL and DynamoDB (moto's server, not AWS; two requests with one key whose
commits come one after the other, as moto needs) (``tests/web``).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import contextvars
import difflib
import functools
import hashlib
import inspect
import io
import json
import logging
import re
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Iterator, MutableMapping
from datetime import timedelta
from http import HTTPStatus
from typing import Any, Literal

from oncely._core.context import _CURRENT
from oncely._core.observe import CLIENT_KEYS, key_for_logs, log_error, redact_keys
from oncely._core.outcomes import Handled, Outcome, Released
from oncely._core.policy import Limits
from oncely._core.said import said
from oncely.errors import (
    ConfigurationError,
    LeaseLost,
    StoreError,
    StoreUnavailable,
    TransactionRequired,
)
from oncely.inbox.async_inbox import AsyncClaimed, AsyncInbox
from oncely.inbox.sync_inbox import Claimed, Inbox
from oncely.stores.async_protocols import AsyncTransactionalStore
from oncely.stores.sync_protocols import TransactionalStore

__all__ = [
    "IdempotencyMiddleware",
    "KeyFrom",
    "WSGIIdempotencyMiddleware",
    "default_principal",
    "default_store_status",
    "github",
    "parse_key",
    "shopify",
    "standard_webhooks",
    "stripe",
    "transaction",
]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

LOGGER = logging.getLogger("oncely.http")
HEADER = b"idempotency-key"
REPLAYED = (b"idempotent-replayed", b"true")
_FORMAT = 1
"""The stored response's layout version."""
_TX: contextvars.ContextVar[Any] = contextvars.ContextVar("oncely_http_tx")


@contextlib.contextmanager
def _handling(consumer: str, claimed: AsyncClaimed[Any] | Claimed[Any]) -> Iterator[None]:
    """While the endpoint runs on a won claim: what ``oncely.current()`` and
    ``oncely.handling()`` give it, as a message handler gets them (R17): its stored key,
    consumer and attempt, so ``oncely.handling().downstream_key("charge")`` is one key on
    every retry of one Idempotency-Key and another for another key. Reset after, so no next
    request on the thread or task sees it."""
    entered = _CURRENT.set(
        (
            consumer,
            claimed.key or "",
            claimed.attempt,
            claimed._correlation_id,  # the claim's, as a handler gets its message's
            "two_phase",
        )
    )
    try:
        yield
    finally:
        _CURRENT.reset(entered)


_NOT_KEPT = frozenset({b"date", b"server", b"set-cookie"})
"""Response headers never stored: the server's own (a replay gets fresh ones) and cookies
(a session is not replayed to whoever holds the key)."""


class _BadKey(ValueError):
    pass


_SF_STRING = re.compile(r'"((?:[\x20\x21\x23-\x5b\x5d-\x7e]|\\["\\])*)"[ \t]*(?:;.*)?')
_ESCAPE = re.compile(r"\\(.)")
"""An RFC 8941 String (printable ASCII, ``\\"`` and ``\\\\`` escapes), then parameters."""
_PLAIN_STRING = re.compile(r'"([\x20\x21\x23-\x5b\x5d-\x7e]+)"')
"""The common case of :data:`_SF_STRING`: a non-empty String without escapes or parameters,
whose key is its inner text as it is. One character class instead of an alternation per
character: a fifth of the time (about 0.7 us less per request)."""


def _part(text: str) -> str:
    """``text`` as one part of a scoped key: ``%`` and ``:`` escaped, so parts never merge."""
    return text.replace("%", "%25").replace(":", "%3A") if ("%" in text or ":" in text) else text


KeyFrom = Callable[[Scope, bytes], str | None]
"""Reads a request's key from its ASGI scope and body; None when it has none. A
``ValueError`` it raises (the id cannot be read) answers ``400`` with its message. Behind the
WSGI middleware the scope is a mapping with ``headers`` (as ASGI names them), ``method``,
``path``, ``query_string`` and ``environ``."""


def _from_header(name: bytes, what: str) -> KeyFrom:
    def read(scope: Scope, body: bytes) -> str | None:
        values = [bytes(v) for k, v in scope.get("headers", ()) if k == name]
        if len(values) > 1:
            raise _BadKey(f"the {what} header is given more than once")
        if not values or not values[0].strip():
            return None
        try:
            return values[0].decode("ascii").strip()
        except UnicodeDecodeError:
            raise _BadKey(f"the {what} header is not ASCII") from None

    read.__name__ = what
    return read


github = _from_header(b"x-github-delivery", "X-GitHub-Delivery")
"""GitHub webhooks: the delivery's GUID (the same on a redelivery)."""
standard_webhooks = _from_header(b"webhook-id", "webhook-id")
"""Standard Webhooks (Svix and the providers using it): the message id."""
shopify = _from_header(b"x-shopify-webhook-id", "X-Shopify-Webhook-Id")
"""Shopify webhooks: the webhook's id (the same on a retry)."""
_NAMED = {
    "X-GitHub-Delivery": "X-GitHub-Delivery header",
    "webhook-id": "webhook-id header",
    "X-Shopify-Webhook-Id": "X-Shopify-Webhook-Id header",
    "stripe": 'Stripe event id (the body\'s "id")',
}
"""What a request lacks, by the name of the built-in key function that found nothing."""


def stripe(scope: Scope, body: bytes) -> str | None:
    """Stripe webhooks: the event's ``id`` in the JSON body (the same on a retry)."""
    try:
        event = json.loads(body)
    except ValueError:
        raise _BadKey("the body is not JSON: no Stripe event id") from None
    found = event.get("id") if isinstance(event, dict) else None
    return found if isinstance(found, str) and found else None


def parse_key(values: list[bytes], *, bare: bool = False) -> str | None:
    """The key of the ``Idempotency-Key`` header lines ``values`` (None: no header). The value
    is an RFC 8941 String (``"..."``, with ``\\"`` and ``\\\\`` escapes; parameters after it are
    ignored); with ``bare=True`` an unquoted token is taken too, and names the same key as its
    quoted form. Raises ``ValueError`` with the reason for anything else."""
    if not values:
        return None
    if len(values) > 1:
        raise _BadKey("the Idempotency-Key header is given more than once")
    try:
        text = values[0].decode("ascii").strip(" \t")
    except UnicodeDecodeError:
        raise _BadKey("the Idempotency-Key header is not ASCII") from None
    if not text.startswith('"'):
        if bare and text and all(0x21 <= ord(c) <= 0x7E for c in text) and '"' not in text:
            return text
        raise _BadKey(
            'the Idempotency-Key header must be a quoted string (Idempotency-Key: "8e03978e-'
            '40d5-43e8-bc93-6894a57f9324")'
        )
    plain = _PLAIN_STRING.fullmatch(text)
    if plain is not None:
        return plain.group(1)
    found = _SF_STRING.fullmatch(text)
    if found is None:
        _explain(text)
    assert found is not None
    if not found.group(1):
        raise _BadKey("the Idempotency-Key is empty")
    inner = found.group(1)
    return _ESCAPE.sub(r"\1", inner) if "\\" in inner else inner


def _explain(text: str) -> None:
    """Raise the reason ``text`` (starting with a quote) is not an RFC 8941 String."""
    i = 1
    while i < len(text):
        c = text[i]
        if c == "\\":
            if i + 1 >= len(text) or text[i + 1] not in '"\\':
                raise _BadKey("the Idempotency-Key string has an invalid escape")
            i += 2
            continue
        if c == '"':
            raise _BadKey("the Idempotency-Key header has text after its string")
        if not 0x20 <= ord(c) <= 0x7E:
            raise _BadKey("the Idempotency-Key string holds a character outside printable ASCII")
        i += 1
    raise _BadKey("the Idempotency-Key string is not closed")


def default_principal(scope: Scope) -> str:
    """Who is asking, from the ``Authorization`` header (a hash of it; ``anonymous`` without
    one). Give your own (the auth subject, the API key's id) where a client's credentials
    change between its retries: a refreshed token would otherwise be a new scope. Cookies are
    not read (they change between retries for reasons of their own): an app whose clients sign
    in with one needs its own ``principal``."""
    values = [v for k, v in scope.get("headers", ()) if k == b"authorization"]
    if not values:
        if not _COOKIES_SEEN:
            _warn_unread_credentials(scope)
        return "anonymous"
    return "auth:" + hashlib.sha256(b"\n".join(values)).hexdigest()[:32]


_COOKIES_SEEN: list[bool] = []
"""Whether the warning about credentials the default principal does not read was logged (once
a process)."""

_CREDENTIALS = frozenset(
    {b"cookie", b"x-api-key", b"api-key", b"x-auth-token", b"x-access-token", b"x-token"}
)
"""Request headers that usually say who the client is, which :func:`default_principal` does
not read."""


def _warn_unread_credentials(scope: Scope) -> None:
    """Log once a process that a keyed request names its client in a header the default
    principal does not read: every such client shares the ``anonymous`` scope."""
    found = next((k for k, _ in scope.get("headers", ()) if k in _CREDENTIALS), None)
    if found is None:
        return
    _COOKIES_SEEN.append(True)
    header = found.decode("latin-1")
    LOGGER.warning(
        "oncely http: a request with a key carries a %s header but no Authorization header: "
        "with the default principal, every such client shares one scope of keys "
        "('anonymous'), and one could be answered with another's response; give the "
        "middleware principal= (the signed-in user, the API key's id) that reads it",
        header,
    )


def default_store_status(status: int) -> bool:
    """2xx, 3xx and 4xx responses are kept, except the transient 408, 409, 425 and 429; 5xx
    never (the client may retry, and the retry runs)."""
    return 200 <= status < 500 and status not in (408, 409, 425, 429)


def transaction() -> Any:
    """The open transaction of the request being handled by a middleware with
    ``transactional=True``, which commits with the key's marker and the stored response: on a
    SQL store a connection of the store's driver (psycopg's ``AsyncConnection`` or
    ``Connection``, aiosqlite's or sqlite3's, aiomysql's or PyMySQL's), on DynamoDB a
    :class:`~oncely.stores.dynamodb.DynamoTransaction` (its writes buffered, ``tx.put(...)``
    without ``await``, and sent with the marker in one ``TransactWriteItems``). Write through
    it; never commit or roll it back yourself. Raises :class:`~oncely.TransactionRequired`
    outside such a request."""
    try:
        return _TX.get()
    except LookupError:
        raise TransactionRequired(
            "no idempotent request's transaction here: oncely.http.transaction() works inside "
            "an app behind IdempotencyMiddleware(..., transactional=True) (or the WSGI one), "
            "while it handles a request with a key"
        ) from None


def _unknown_options(unknown: dict[str, Any]) -> ConfigurationError:
    known = [
        name
        for name, p in inspect.signature(_Policy.__init__).parameters.items()
        if p.kind is inspect.Parameter.KEYWORD_ONLY
    ]
    said = []
    for name in sorted(unknown):
        close = difflib.get_close_matches(name, known, n=1)
        said.append(f"{name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    return ConfigurationError(
        f"unknown option {', '.join(said)}; the options are {', '.join(known)}"
    )


_COMPLETE_WITHIN = 5.0
"""Seconds the middlewares keep starting new tries to complete the claim of a request whose
response is ready while the store cannot be reached (at most a third of the lease: the last
renewal left two thirds of it at least), before they send the response anyway. A try itself
lasts as long as the store's own timeouts and the inbox's own quick retries let it: the
ASGI middleware cuts it short at the bound; the WSGI (and Django) one cannot cut a blocking
call, so a try under way at the bound lasts until the store's own bound ends it (the
PostgreSQL and MariaDB/MySQL stores' ``read_timeout`` for a statement sent to a server gone
silent and ``connect_timeout`` for a connection, 10 s each by default; Redis' ``timeout``,
5 s), then
the response goes out."""
_CLAIM_WITHIN = 5.0
"""Seconds the ASGI middleware waits for the store to answer a claim (beyond ``wait=``) before
it answers ``503``: a store gone silent (a dead route: no reset, no refusal) would otherwise
hold the request for as long as TCP takes to give up. A claim the store took after all holds
the key for its lease (a retry gets ``409``, then runs). The WSGI (and Django) middleware
answers ``503`` when the store's own bound ends the claim with
:class:`~oncely.StoreUnavailable` (PostgreSQL, MariaDB/MySQL: ``read_timeout``, 10 s by
default)."""
_FIRST_PAUSE = 0.1
_LAST_PAUSE = 1.0
"""The pauses between those tries: doubling from the first to the last."""


class _NotKept(Released):
    """The app's response is not kept: the transaction rolls back, the response is sent. A
    :class:`~oncely._core.outcomes.Released`: the inbox logs it as the reason it is (``failed
    ... reason=released: the app answered 503: not kept; ...``), without a traceback."""


class _Policy:
    """What both middlewares share: the options (documented on
    :class:`IdempotencyMiddleware`) and the steps that decide, from the headers and the body,
    the key or the reply that refuses."""

    def __init__(
        self,
        *,
        methods: Iterable[str] = ("POST", "PATCH"),
        applies: Callable[[Any], bool] | None = None,
        required: bool | Callable[[Any], bool] = False,
        bare_keys: bool = False,
        principal: Callable[[Any], str | Awaitable[str]] = default_principal,
        store_status: Callable[[int], bool] = default_store_status,
        wait: timedelta | None = None,
        max_request_bytes: int = 1 << 20,
        max_stored_bytes: int = 1 << 20,
        max_key_chars: int = 255,
        key: KeyFrom | None = None,
        transactional: bool = False,
        **unknown: Any,
    ) -> None:
        if unknown:
            raise _unknown_options(unknown)
        if max_request_bytes < 0 or max_stored_bytes < 0 or max_key_chars < 1:
            raise ConfigurationError(
                "max_request_bytes and max_stored_bytes are not negative, max_key_chars positive"
            )
        self._max_key = max_key_chars
        self.methods = frozenset(m.upper() for m in methods)
        self._applies = applies
        self._required = required
        self._bare = bare_keys
        self._principal = principal
        self._store_status = store_status
        self._wait = wait
        self._max_request = max_request_bytes
        self._max_stored = max_stored_bytes
        self._key_from = key
        self._transactional = transactional
        self._inbox_limit = Limits().max_result_bytes  # the inbox's, once it is known
        self._room: Callable[[], tuple[int, str] | None] | None = None  # its store's bound
        self._log_keys: Literal["plain", "hash"] = "plain"  # the inbox's, once it is known
        if transactional and wait is not None:
            raise ConfigurationError(
                "wait= is for the two-phase mode: with transactional=True a repeat gets the "
                "first request's response once it commits (on a SQL store it waits on the "
                "row lock; on DynamoDB it runs too, and its commit loses to the first one's)"
            )

    def _check_inbox(self, inbox: AsyncInbox | Inbox) -> None:
        self._inbox_limit = inbox.limits.max_result_bytes
        self._room = getattr(inbox.store, "result_room", None)
        self._log_keys = inbox.log_keys
        # The longest scoped key the inbox takes as it is (with hash_long_keys it hashes a
        # longer one whole itself, as it did before scoped keys had a limit of their own).
        limits = inbox.limits
        self._max_scoped = None if limits.hash_long_keys else limits.max_key_bytes
        lease = inbox._lease
        self._lease_s = lease.duration.total_seconds()
        self._renews = lease.heartbeat
        self._complete_within = min(_COMPLETE_WITHIN, self._lease_s / 3)
        waits = self._wait.total_seconds() if self._wait is not None else 0.0
        self._claim_within = _CLAIM_WITHIN + waits
        protocol = AsyncTransactionalStore if isinstance(inbox, AsyncInbox) else TransactionalStore
        if self._transactional and not isinstance(inbox.store, protocol):
            raise ConfigurationError(
                f"transactional=True needs a store with a transactional mode (PostgreSQL, "
                f"MariaDB/MySQL, SQLite, DynamoDB); {type(inbox.store).__name__} has none: use "
                "the two-phase mode (the default)"
            )

    def _decide(
        self,
        status: int,
        headers: list[tuple[bytes, bytes]],
        chunks: list[bytes],
        size: int,
        key: str | None,
    ) -> dict[str, Any] | str:
        """:func:`kept` with this middleware's limits (a response over ``max_stored_bytes``
        logged): the response to store, or why it is not kept."""
        limit = self._max_stored
        stored = _stored_size(size, headers)
        room = (self._room() if self._room is not None else None) or (stored, "")
        if stored > self._inbox_limit or stored > room[0]:
            limit = min(limit, size - 1)  # kept, it would be over the inbox's or store's limit
        decided = kept(status, headers, chunks, size, limit, self._store_status)
        if not isinstance(decided, str) and "too_large" in decided:
            if size > self._max_stored:
                why = f"over max_stored_bytes={self._max_stored}"
            elif stored > self._inbox_limit:
                why = (
                    f"stored, it would be over the inbox's Limits(max_result_bytes="
                    f"{self._inbox_limit}); raise that to keep it"
                )
            else:
                why = f"stored, it would be over the {room[0]} bytes its store takes: {room[1]}"
            LOGGER.warning(
                "oncely http key=%s: the %d-byte response was sent but not kept (%s), so a "
                "repeat cannot be replayed",
                key_for_logs(key, self._log_keys),
                size,
                why,
            )
        return decided

    def _keep(
        self, status: int, headers: list[tuple[bytes, bytes]], chunks: list[bytes], key: str
    ) -> dict[str, Any]:
        """Transactional mode: the response to store with the commit, or :class:`_NotKept`
        (the transaction rolls back)."""
        decided = self._decide(status, headers, chunks, sum(len(c) for c in chunks), key)
        if isinstance(decided, str):
            raise _NotKept(f"{decided}; its transaction was rolled back")
        return decided

    def _settle(
        self,
        claimed: Claimed[Any],
        status: int,
        headers: list[tuple[bytes, bytes]],
        chunks: list[bytes],
    ) -> None:
        """Two-phase mode, sync: keep the response (complete the claim) or give it back. A
        store that cannot be reached is retried for a few seconds; then the caller sends the
        response all the same, and the record left uncompleted is logged at ERROR."""
        decided = self._decide(status, headers, chunks, sum(len(c) for c in chunks), claimed.key)
        if isinstance(decided, str):
            claimed.release(decided)
            return
        self._complete_kept(claimed, decided)

    def _complete_kept(self, claimed: Claimed[Any], decided: dict[str, Any]) -> None:
        """Complete the claim with the response ``decided`` to keep, riding out a store that
        cannot be reached for ``_complete_within`` (a third of the lease at most, the claim
        renewed meanwhile); then the record left uncompleted is logged at ERROR. A store error
        other than an outage is logged at once; anything else is raised."""
        # The work is done: a short outage of the store is ridden out here (complete with the
        # same token is safe to repeat) rather than lose the response and, once the lease
        # lapses, run the request again.
        deadline = time.monotonic() + self._complete_within
        pause = _FIRST_PAUSE
        while True:
            try:
                claimed.complete(decided)
                return
            except StoreUnavailable as exc:
                error: StoreError = exc
                if time.monotonic() + pause > deadline:
                    break
            except StoreError as exc:  # not a passing outage: retrying will not help
                error = exc
                break
            time.sleep(pause)
            pause = min(2 * pause, _LAST_PAUSE)
            if self._renews:
                # complete() stopped the claim's heartbeat: renew in its place meanwhile.
                # (It fails while the store is away, or once the key is another's: the
                # next complete() says which.)
                with contextlib.suppress(StoreError, LeaseLost):
                    claimed.renew()
        self._not_completed(claimed.key, error)

    def _not_completed(self, key: str | None, error: StoreError) -> None:
        """Log that a response goes out whose record could not be completed."""
        LOGGER.error(
            "oncely http key=%s: the request ran and its response is sent, but its record "
            "could not be completed (%s); a repeat gets 409 until the claim's lease lapses "
            "(%gs after its last renewal) and may then run the request again",
            key_for_logs(key, self._log_keys),
            redact_keys(said(error), (key,), self._log_keys),
            self._lease_s,
        )

    def _header_step(
        self, headers: Iterable[tuple[bytes, bytes]], scope: Any
    ) -> str | Reply | _FromBody | None:
        """From the headers alone: the key, a reply (a bad or missing key), ``_FROM_BODY``
        (the key is in the body, ``key=``), or None (no key, not required: pass through)."""
        if self._key_from is not None:
            return _FROM_BODY
        try:
            key = parse_key([bytes(v) for k, v in headers if k == HEADER], bare=self._bare)
        except _BadKey as exc:
            return problem(400, "Invalid Idempotency-Key", str(exc))
        if key is not None:
            if len(key) > self._max_key:
                return problem(
                    400,
                    "Invalid Idempotency-Key",
                    f"the Idempotency-Key has {len(key)} characters; this endpoint takes at "
                    f"most {self._max_key}",
                )
            return key
        required = self._required
        if required is True or (callable(required) and required(scope)):
            return problem(
                400, "Idempotency-Key required", "this endpoint needs an Idempotency-Key"
            )
        return None

    def _body_step(self, scope: Scope, body: bytes | None, key: str | None) -> str | Reply:
        """With the body read: the key, or the reply that refuses the request."""
        if body is None:
            return problem(
                413,
                "Request too large for idempotency",
                f"the body is over {self._max_request} bytes, the most this endpoint reads to "
                "recognise a repeat; the request was not run",
            )
        if key is not None:
            return key
        assert self._key_from is not None
        try:
            found = self._key_from(scope, body)
        except ValueError as exc:  # _BadKey, or the user's own function's refusal
            return problem(400, "Invalid delivery id", str(exc))
        if found is None:
            what = _NAMED.get(getattr(self._key_from, "__name__", ""), "id this endpoint needs")
            return problem(400, "Delivery id missing", f"the request has no {what}")
        if not isinstance(found, str) or not found:
            raise ConfigurationError(
                f"the key= function returned {found!r}: a non-empty str, or None for none"
            )
        return found


class IdempotencyMiddleware(_Policy):
    """The ASGI middleware on an :class:`~oncely.AsyncInbox` (see the module docstring;
    the options are :class:`WSGIIdempotencyMiddleware`'s too).

    ``methods``: the methods it applies to (POST and PATCH); ``applies(scope)``: a further
    filter (routes); ``required``: whether a request it applies to must carry the header (or a
    predicate of the scope); ``bare_keys``: accept an unquoted key; ``principal``: who asks
    (may be async); ``store_status``: which responses are kept; ``wait``: how long a repeat
    waits for a running first request instead of getting 409; ``max_request_bytes`` and
    ``max_stored_bytes``: the request body read for the fingerprint, the response body kept;
    ``max_key_chars``: the longest ``Idempotency-Key`` taken (255; a longer one is a 400);
    ``transactional``: run the app in a transaction of the store's (a SQL database's, or
    DynamoDB's ``TransactWriteItems``; see the module docstring and :func:`transaction`).

    ``key``: for webhooks, where the provider's delivery id is (:func:`github`,
    :func:`stripe`, :func:`standard_webhooks`, :func:`shopify`, or your own :data:`KeyFrom`)
    instead of the ``Idempotency-Key`` header: every request it applies to needs one (400
    without), and a redelivery is answered at once with the first response (a 2xx: the
    provider stops retrying). Verify the provider's signature before this middleware (an
    outer middleware), so an unsigned request never claims a key.
    """

    def __init__(self, app: ASGIApp, *, inbox: AsyncInbox, **options: Any) -> None:
        if not isinstance(inbox, AsyncInbox):
            raise ConfigurationError(
                "IdempotencyMiddleware takes an AsyncInbox (inbox=...); for a sync Inbox, "
                "WSGIIdempotencyMiddleware"
            )
        super().__init__(**options)
        self._check_inbox(inbox)
        self.app = app
        self.inbox = inbox

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] != "http"
            or scope["method"] not in self.methods
            or (self._applies is not None and not self._applies(scope))
        ):
            await self.app(scope, receive, send)
            return
        headers = scope.get("headers", ())
        first = self._header_step(headers, scope)
        if first is None:
            await self.app(scope, receive, send)
            return
        if isinstance(first, tuple):
            await _send(send, first)
            return
        body = await _read_body(receive, self._max_request)
        if body is _GONE:
            return  # the client went away before its body ended: nothing claimed, nothing run
        key = self._body_step(scope, body, first if isinstance(first, str) else None)
        if not isinstance(key, str):
            await _send(send, key)
            return
        assert body is not None
        who = self._principal(scope)
        if not isinstance(who, str):
            who = await who
        scoped = scoped_key(
            who, scope["method"], scope.get("path", ""), key, max_bytes=self._max_scoped
        )
        fingerprint = request_fingerprint(
            scope.get("query_string", b""), body, _header(headers, b"content-type")
        )
        if self._transactional:
            await self._run_in_transaction(scope, body, receive, send, scoped, fingerprint)
            return
        client = CLIENT_KEYS.set(True)  # a key reused for another request: the client's error
        try:
            async with asyncio.timeout(self._claim_within) as bound:
                claimed: AsyncClaimed[Any] = await self.inbox.claim(
                    scoped, fingerprint, wait=self._wait
                )
        except StoreUnavailable as exc:
            await _send(send, _store_down(scoped, exc, self._log_keys))
            return
        except TimeoutError:
            if not bound.expired():
                raise
            silent = StoreUnavailable(f"the store did not answer within {self._claim_within:g}s")
            await _send(send, _store_down(scoped, silent, self._log_keys))
            return
        finally:
            CLIENT_KEYS.reset(client)
        if not claimed.won:
            assert claimed.handled is not None
            # Speed: _answer and _send written in: two coroutines fewer on a replay, 0.1 us of
            # the middleware's own 4.6 (a replay on Redis is about 50 us in process).
            status, reply_headers, reply_body = answer(claimed.handled)
            await send({"type": "http.response.start", "status": status, "headers": reply_headers})
            await send({"type": "http.response.body", "body": reply_body})
            return
        await self._run(scope, body, receive, send, claimed)

    async def _run_in_transaction(
        self,
        scope: Scope,
        body: bytes,
        receive: Receive,
        send: Send,
        scoped: str,
        fingerprint: dict[str, Any],
    ) -> None:
        """The app inside :meth:`AsyncInbox.handle_in_transaction
        <oncely.AsyncInbox.handle_in_transaction>`, its response held until the commit.

        The handler may run more than once in one request: on DynamoDB a commit that another
        request's won meanwhile is cancelled and the key claimed again, and a second claim
        that finds that record gone (expired) runs the app again. Each run gets the body
        anew, and only the last run's response, the one committed, is held."""
        held: list[Message] = []
        raised: list[BaseException] = []

        async def hold(message: Message) -> None:
            held.append(message)

        async def handler(tx: Any, _request: object) -> dict[str, Any]:
            entered = _TX.set(tx)
            inside = CLIENT_KEYS.set(False)  # the app's own inboxes log as they always do
            held.clear()  # a run before this one: its transaction was cancelled
            try:
                await self.app(_in_messages(scope), _body_once(body, receive), hold)
            except Exception as exc:
                raised.append(exc)
                raise
            finally:
                CLIENT_KEYS.reset(inside)
                _TX.reset(entered)
            if held and not _ended(held):
                # A stream cut short (its client went away, and the app stopped it): what a
                # repeat would get is not the response, so nothing is committed and it runs.
                raise _NotKept(
                    "the app returned before its response ended: not kept; its transaction was "
                    "rolled back"
                )
            return self._keep(*_response_of(held), scoped)

        client = CLIENT_KEYS.set(True)  # a key reused for another request: the client's error
        try:
            handled = await self.inbox.handle_in_transaction(
                scoped, fingerprint, handler, returns=None
            )
        except StoreUnavailable as exc:
            if raised:
                raise raised[0] from exc
            # Nothing committed: the retry runs.
            await _send(send, _store_down(scoped, exc, self._log_keys))
            return
        finally:
            CLIENT_KEYS.reset(client)
        if _ran(handled, raised):
            for message in held:
                await send(message)
            return
        await self._answer(send, handled)

    async def _run(
        self,
        scope: Scope,
        body: bytes,
        receive: Receive,
        send: Send,
        claimed: AsyncClaimed[Any],
    ) -> None:
        replay_body = _body_once(body, receive)
        status = 0
        headers: list[tuple[bytes, bytes]] = []
        chunks: list[bytes] = []
        size = 0
        ended = False

        async def capture(message: Message) -> None:
            nonlocal status, size, ended
            if message["type"] == "http.response.start":
                status = int(message["status"])
                headers.extend((bytes(k), bytes(v)) for k, v in message.get("headers", ()))
            elif message["type"] == "http.response.body":
                chunk = bytes(message.get("body", b""))
                size += len(chunk)
                if size <= self._max_stored:
                    chunks.append(chunk)
                if not message.get("more_body", False) and not ended:
                    # The claim ends before the client sees the end of the response (complete,
                    # then send): a client that repeats the request at once meets the stored
                    # response (or, for a response not kept, runs again), never a claim still
                    # held; and a crash between the two leaves a completed record whose repeat
                    # is a replay. Sending first would leave, after such a crash, a client that
                    # has its answer and a claim that lapses into running the request again.
                    # A store that cannot be reached holds the last chunk back while _end
                    # retries (a bounded time): the response goes out either way.
                    ended = True
                    await _to_its_end(
                        self._end(claimed, status, headers, chunks, size),
                        claimed.key,
                        self._log_keys,
                    )
            await send(message)

        try:
            with _handling(self.inbox.consumer, claimed):
                await self.app(_in_messages(scope), replay_body, capture)
        except BaseException as exc:
            if not ended:
                await _to_its_end(
                    claimed.release(f"the app raised {said(exc)}"), claimed.key, self._log_keys
                )
            raise
        if not ended:
            # No last body message: no response at all, or one cut short (a stream whose
            # client went away). Neither is what the client would get on a repeat.
            await claimed.release(
                "the app returned before its response ended"
                if status
                else "the app returned without a response"
            )

    async def _end(
        self,
        claimed: AsyncClaimed[Any],
        status: int,
        headers: list[tuple[bytes, bytes]],
        chunks: list[bytes],
        size: int,
    ) -> None:
        """Keep the response (complete the claim), or give the claim back. A store that
        cannot be reached is retried for a few seconds (see :meth:`_Policy._settle`); after
        that the response goes out all the same (the work was done) and the failure is
        logged: the client gets what the app answered, never a connection cut short."""
        decided = self._decide(status, headers, chunks, size, claimed.key)
        if isinstance(decided, str):
            await claimed.release(decided)
            return
        # The whole of it, tries, pauses and renewals, within _complete_within: a try that
        # waits on the store's own timeouts (a PostgreSQL pool waits connect_timeout, 10 s,
        # for a server that does not answer; a statement sent to one that went silent waits
        # on TCP) is cut short rather than hold the response for as long as they last.
        within = self._complete_within
        deadline = time.monotonic() + within
        pause = _FIRST_PAUSE
        error: StoreError | None = None
        try:
            async with asyncio.timeout(within) as bound:
                while True:
                    try:
                        await claimed.complete(decided)
                        return
                    except StoreUnavailable as exc:
                        error = exc
                        if time.monotonic() + pause > deadline:
                            break
                    except StoreError as exc:  # not a passing outage: retrying will not help
                        error = exc
                        break
                    await asyncio.sleep(pause)
                    pause = min(2 * pause, _LAST_PAUSE)
                    if self._renews:
                        # complete() stopped the claim's heartbeat: renew in its place
                        # meanwhile. (It fails while the store is away, or once the key is
                        # another's: the next complete() says which.)
                        with contextlib.suppress(StoreError, LeaseLost):
                            await claimed.renew()
        except TimeoutError:
            if not bound.expired():
                raise
            error = StoreUnavailable(
                f"the store did not answer within {within:g}s"
                + (f" (before that: {said(error)})" if error is not None else "")
            )
        assert error is not None
        self._not_completed(claimed.key, error)

    async def _answer(self, send: Send, handled: Handled[Any]) -> None:
        await _send(send, answer(handled))


Reply = tuple[int, list[tuple[bytes, bytes]], bytes]
"""A response: status, headers, body."""

_UNDER_WAY: set[asyncio.Future[object]] = set()
"""The claims' endings that go on after their request was cancelled (see :func:`_to_its_end`)."""


async def _to_its_end(
    ending: Coroutine[Any, Any, object],
    key: str | None = None,
    log_keys: Literal["plain", "hash"] = "plain",
) -> None:
    """Await ``ending`` (a claim completed with its response, or released), which goes on to
    its end even if the request is cancelled meanwhile: Starlette cancels a streaming
    response's task when its client goes away, a client that gives up on a response held back
    while the store is away among them. Cut short, the finished request's record would be
    left held by nobody (a retry answered ``409`` until the lease lapsed, then run again). The
    cancellation still reaches the request at once."""
    task = asyncio.ensure_future(ending)
    try:
        await asyncio.shield(task)
    except asyncio.CancelledError:
        _UNDER_WAY.add(task)
        task.add_done_callback(functools.partial(_ended_alone, key, log_keys))
        raise


def _ended_alone(
    key: str | None, log_keys: Literal["plain", "hash"], task: asyncio.Future[object]
) -> None:
    """A claim's ending that went on after its request was cancelled is over: what it raised
    has no caller left to reach, so it is logged (the key in its text as the inbox shows
    keys: a ``LeaseLost`` names it)."""
    _UNDER_WAY.discard(task)
    if not task.cancelled() and task.exception() is not None:
        log_error(
            LOGGER,
            logging.ERROR,
            "oncely http: ending the claim of a request whose client went away failed",
            error=task.exception(),
            keys=(key,),
            mode=log_keys,
        )


_SENT_BY_THE_SERVER = ("http.response.pathsend", "http.response.zerocopysend")
"""ASGI extensions with which an app hands its response's body to the server (a file to send)
instead of sending it in body messages."""


def _in_messages(scope: Scope) -> Scope:
    """``scope`` for the app, without the extensions that would let it hand its body to the
    server (Starlette's ``FileResponse`` on a server that offers ``http.response.pathsend``,
    Granian for one): the middleware keeps what passes through body messages, and a response
    sent otherwise would never end for it (not kept: a repeat would run again)."""
    extensions = scope.get("extensions")
    if not extensions or not any(name in extensions for name in _SENT_BY_THE_SERVER):
        return scope
    kept = {k: v for k, v in extensions.items() if k not in _SENT_BY_THE_SERVER}
    return {**scope, "extensions": kept}


def _body_once(body: bytes, receive: Receive) -> Receive:
    """An ASGI ``receive`` that gives ``body`` (read already) whole once, then passes on to
    the server's ``receive``: an app that listens for the client's disconnect while it streams
    (Starlette's ``StreamingResponse``, ``request.is_disconnected()``) hears the real one, not
    one made up the moment the body was handed over."""
    given = False

    async def replay() -> Message:
        nonlocal given
        if not given:
            given = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def _ran(handled: Handled[Any], raised: list[BaseException]) -> bool:
    """Transactional mode, after the transaction: whether the app's own response goes out
    (it ran: committed, or rolled back for a response not kept). Raises what the app raised,
    or the error that kept the response from being stored (nothing was committed); False:
    the key was not won, and :func:`answer` says why."""
    if raised:
        raise raised[0]
    if handled.outcome in (Outcome.PROCESSED, Outcome.STALE_RECLAIMED):
        return True
    if isinstance(handled.error, _NotKept):
        return True
    if handled.outcome is Outcome.FAILED and handled.error is not None:
        raise handled.error
    return False


def _ended(messages: list[Message]) -> bool:
    """Whether an ASGI response's messages reach its end (a last body message)."""
    last = messages[-1]
    return last["type"] == "http.response.body" and not last.get("more_body", False)


def _response_of(messages: list[Message]) -> tuple[int, list[tuple[bytes, bytes]], list[bytes]]:
    """The status, headers and body chunks of an ASGI response's messages."""
    status = 0
    headers: list[tuple[bytes, bytes]] = []
    chunks: list[bytes] = []
    for message in messages:
        if message["type"] == "http.response.start":
            status = int(message["status"])
            headers = [(bytes(k), bytes(v)) for k, v in message.get("headers", ())]
        elif message["type"] == "http.response.body":
            chunks.append(bytes(message.get("body", b"")))
    return status, headers, chunks


def answer(handled: Handled[Any]) -> Reply:
    """The response to a request whose key was not won: the stored response replayed, or the
    problem that says why it is not run."""
    outcome = handled.outcome
    if outcome is Outcome.DUPLICATE:
        stored = handled.value
        if isinstance(stored, dict) and stored.get("v") == _FORMAT and "body" in stored:
            headers = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in stored["headers"]]
            headers.append(REPLAYED)
            return int(stored["status"]), headers, base64.b64decode(stored["body"])
        return problem(
            409,
            "Response not replayable",
            "the first request with this key ran, but its response was too large to keep; "
            "it is not run again",
        )
    if outcome is Outcome.IN_FLIGHT:
        return problem(
            409,
            "Request in progress",
            "a request with this Idempotency-Key is still running; retry later",
            retry_after=1,
        )
    if outcome is Outcome.KEY_CONFLICT:
        return problem(
            422,
            "Idempotency-Key reused",
            "this Idempotency-Key was used for a request with another body or query",
        )
    if outcome is Outcome.REJECTED:
        return problem(400, "Invalid Idempotency-Key", handled.reason or "refused")
    return problem(409, "Request needs attention", handled.reason or outcome.value, retry_after=60)


_STORE_DOWN_RETRY = 5
"""Seconds a client is asked to wait before it retries a request the store could not take."""


def _cut_short() -> Reply:
    """``400`` for a request whose body ended before its ``Content-Length`` (its client went
    away mid-upload): nothing was claimed or run, so the client's retry runs. Behind a WSGI
    server (the ASGI middleware hears the disconnect and answers nothing)."""
    return problem(
        400,
        "Request body incomplete",
        "the body ended before its Content-Length; the request was not run: retry it whole "
        "with the same Idempotency-Key",
    )


def _store_down(key: str, exc: StoreUnavailable, log_keys: Literal["plain", "hash"]) -> Reply:
    """``503`` for a request whose key the store could not claim (or whose transaction it
    could not commit): nothing ran, or nothing of it was kept, so a retry is safe. The line
    shows the key as the inbox's lines do (``log_keys``)."""
    LOGGER.error(
        "oncely http key=%s: the store cannot be reached, the request was not run: %s",
        key_for_logs(key, log_keys),
        redact_keys(str(exc), (key,), log_keys),
    )
    return problem(
        503,
        "Idempotency store unavailable",
        "the request was not run (the store that recognises repeats cannot be reached); "
        "retry with the same Idempotency-Key",
        retry_after=_STORE_DOWN_RETRY,
    )


def problem(status: int, title: str, detail: str, *, retry_after: int | None = None) -> Reply:
    """An RFC 9457 problem details response."""
    body = json.dumps(
        {"type": "about:blank", "title": title, "status": status, "detail": detail}
    ).encode()
    headers = [
        (b"content-type", b"application/problem+json"),
        (b"content-length", str(len(body)).encode()),
    ]
    if retry_after is not None:
        headers.append((b"retry-after", str(retry_after).encode()))
    return status, headers, body


_MAX_KEY_BYTES = Limits().max_key_bytes
_DIGEST = "%sha256-"
"""How a part of a scoped key replaced by its SHA-256 starts (see :func:`scoped_key`)."""
_LONG_PART = 64
"""Characters over which a part of a scoped key too long to keep whole is a digest instead."""


def scoped_key(
    who: str, method: str, path: str, key: str, *, max_bytes: int | None = _MAX_KEY_BYTES
) -> str:
    """The inbox key of a request: its principal, method, path and Idempotency-Key, each
    escaped (``%`` and ``:``), so two requests never share one.

    When that is over ``max_bytes`` (UTF-8; the inbox's ``Limits.max_key_bytes``, None for no
    limit), or holds what no key may (a NUL, text that is not UTF-8), parts are replaced by
    their SHA-256 (``%sha256-<hex>``) until it fits: first any that holds such text, then a
    principal or path over 64 characters, then a key or method that long (a client's key stays
    readable in the logs while it can); failing all that, the whole key is a digest. No
    escaped part holds ``%s`` (its ``%`` are ``%25`` and ``%3A``), so a digest never reads as a
    plain part: requests that differ anywhere (two long paths alike but for their end) keep
    keys of their own. A key that fits is the plain form, as it always was."""
    plain = f"http:{_part(who)}:{_part(method)}:{_part(path)}:{_part(key)}"
    if plain.isascii():
        if (max_bytes is None or len(plain) <= max_bytes) and "\x00" not in plain:
            return plain  # almost every request
    elif _keepable(plain) and (max_bytes is None or len(plain.encode()) <= max_bytes):
        return plain
    return _digested([who, method, path, key], max_bytes)


def _keepable(text: str) -> bool:
    """Whether ``text`` can be (part of) an inbox key as it is: UTF-8, no NUL."""
    if "\x00" in text:
        return False
    try:
        text.encode()
    except UnicodeEncodeError:  # a lone surrogate
        return False
    return True


def _digest(part: str) -> str:
    return _DIGEST + hashlib.sha256(part.encode("utf-8", "surrogatepass")).hexdigest()


def _digested(parts: list[str], max_bytes: int | None) -> str:
    """:func:`scoped_key` when its plain form cannot be the key: principal, method, path and
    key, some of them digests."""
    fields = [_part(p) if _keepable(p) else _digest(p) for p in parts]
    for order in ((0, 2), (3, 1)):  # principal and path first; the key and method last
        for i in order:
            if len(fields[i]) > _LONG_PART and not fields[i].startswith(_DIGEST):
                fields[i] = _digest(parts[i])
        text = "http:" + ":".join(fields)
        if max_bytes is None or len(text.encode()) <= max_bytes:
            return text
    whole = f"{_part(parts[0])}:{_part(parts[1])}:{_part(parts[2])}:{_part(parts[3])}"
    return "http:" + _digest(whole)


_BOUNDARY = re.compile(r';[ \t]*boundary[ \t]*=[ \t]*(?:"([^"]+)"|([^;, \t]+))', re.IGNORECASE)


def request_fingerprint(query: bytes, body: bytes, content_type: str | None) -> dict[str, Any]:
    """What must match for a repeat to be the same request (beside its method and path). A
    multipart body's boundary, which a client draws afresh for every request, is left out
    (of the body and of the content type): a retried upload is the same request."""
    if content_type is not None and content_type[:10].lower() == "multipart/":
        found = _BOUNDARY.search(content_type)
        if found is not None:
            boundary = (found.group(1) or found.group(2)).encode("latin-1")
            body = body.replace(b"--" + boundary, b"--\x00boundary")
            content_type = content_type[: found.start()] + content_type[found.end() :]
    return {
        "query": query.decode("latin-1"),
        "body": hashlib.sha256(body).hexdigest(),
        "type": content_type,
    }


def _stored_size(size: int, headers: list[tuple[bytes, bytes]]) -> int:
    """At least the encoded size of a stored response of ``size`` body bytes and ``headers``
    (the body in base64; each header byte counted as an escaped character)."""
    return 4 * ((size + 2) // 3) + sum(6 * (len(k) + len(v)) + 8 for k, v in headers) + 96


def kept(
    status: int,
    headers: list[tuple[bytes, bytes]],
    chunks: list[bytes],
    size: int,
    max_stored: int,
    store_status: Callable[[int], bool],
) -> dict[str, Any] | str:
    """What to complete the claim with (the stored response), or why to release it."""
    if not status or not store_status(status):
        return f"the app answered {status or 'nothing'}: not kept"
    if size > max_stored:
        return {"v": _FORMAT, "status": status, "too_large": size}
    return {
        "v": _FORMAT,
        "status": status,
        "headers": [
            [k.decode("latin-1"), v.decode("latin-1")]
            for k, v in headers
            if k.lower() not in _NOT_KEPT
        ],
        "body": base64.b64encode(b"".join(chunks)).decode("ascii"),
    }


async def _send(send: Send, reply: Reply) -> None:
    status, headers, body = reply
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class _FromBody:
    """The key is read from the body (``key=``)."""


_FROM_BODY = _FromBody()


def _header(headers: Iterable[tuple[bytes, bytes]], name: bytes) -> str | None:
    for k, v in headers:
        if k == name:
            return bytes(v).decode("latin-1")
    return None


class _Gone(bytes):
    """What :func:`_read_body` returns when the client disconnected before its body ended."""


_GONE = _Gone()


async def _read_body(receive: Receive, limit: int) -> bytes | None:
    """The whole request body; None when it is over ``limit`` bytes; :data:`_GONE` when the
    client went away before its last part (a body cut short is never taken for the whole)."""
    message = await receive()
    if message["type"] != "http.disconnect" and not message.get("more_body", False):
        # Speed: a body in one message (every small request) is that message's, unjoined
        # (0.24 us instead of 0.28 to read it).
        chunk = bytes(message.get("body", b""))
        return None if len(chunk) > limit else chunk
    parts: list[bytes] = []
    size = 0
    while True:
        if message["type"] == "http.disconnect":
            return _GONE
        chunk = bytes(message.get("body", b""))
        size += len(chunk)
        if size > limit:
            return None
        parts.append(chunk)
        if not message.get("more_body", False):
            break
        message = await receive()
    return b"".join(parts)


WSGIApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]


def _wsgi_headers(environ: dict[str, Any]) -> list[tuple[bytes, bytes]]:
    """The request headers of a WSGI environ, as ASGI names them (lower case, dashes)."""
    found = [
        (name[5:].replace("_", "-").lower().encode("latin-1"), str(value).encode("latin-1"))
        for name, value in environ.items()
        if name.startswith("HTTP_")
    ]
    if environ.get("CONTENT_TYPE"):
        found.append((b"content-type", str(environ["CONTENT_TYPE"]).encode("latin-1")))
    return found


class WSGIIdempotencyMiddleware(_Policy):
    """The same middleware for a WSGI app (Flask, Django, any WSGI app) on a sync
    :class:`~oncely.Inbox`, with the same options (``principal`` and the predicates get the
    WSGI environ). The app's response is buffered until it ends (the claim ends before the
    client sees it), so a streamed WSGI response reaches the client at its end.

    A WSGI server merges a repeated ``Idempotency-Key`` header into one value: such a
    request is refused (400) as a header with text after its string."""

    def __init__(self, app: WSGIApp, *, inbox: Inbox, **options: Any) -> None:
        if not isinstance(inbox, Inbox):
            raise ConfigurationError(
                "WSGIIdempotencyMiddleware takes a sync Inbox (inbox=...); for an AsyncInbox, "
                "IdempotencyMiddleware (ASGI)"
            )
        super().__init__(**options)
        self._check_inbox(inbox)
        self.app = app
        self.inbox = inbox

    def __call__(
        self, environ: dict[str, Any], start_response: Callable[..., Any]
    ) -> Iterable[bytes]:
        method = str(environ.get("REQUEST_METHOD", "GET")).upper()
        if method not in self.methods or (self._applies is not None and not self._applies(environ)):
            return self.app(environ, start_response)
        headers = _wsgi_headers(environ)
        first = self._header_step(headers, environ)
        if first is None:
            return self.app(environ, start_response)
        if isinstance(first, tuple):
            return _respond(start_response, first)
        body = self._read(environ)
        if body is _GONE:
            return _respond(start_response, _cut_short())  # nothing claimed, nothing run
        wsgi_scope = {
            "headers": headers,
            "method": method,
            "path": str(environ.get("PATH_INFO", "")),
            "query_string": str(environ.get("QUERY_STRING", "")).encode("latin-1"),
            "environ": environ,
        }
        key = self._body_step(wsgi_scope, body, first if isinstance(first, str) else None)
        if not isinstance(key, str):
            return _respond(start_response, key)
        assert body is not None
        if self._principal is default_principal:
            who = default_principal({"headers": headers})
        else:
            found = self._principal(environ)
            if not isinstance(found, str):
                raise ConfigurationError("a WSGI middleware's principal returns a str")
            who = found
        path = str(environ.get("PATH_INFO", ""))
        scoped = scoped_key(who, method, path, key, max_bytes=self._max_scoped)
        fingerprint = request_fingerprint(
            str(environ.get("QUERY_STRING", "")).encode("latin-1"),
            body,
            _header(headers, b"content-type"),
        )
        if self._transactional:
            return self._run_in_transaction(environ, body, start_response, scoped, fingerprint)
        client = CLIENT_KEYS.set(True)  # a key reused for another request: the client's error
        try:
            claimed: Claimed[Any] = self.inbox.claim(scoped, fingerprint, wait=self._wait)
        except StoreUnavailable as exc:
            return _respond(start_response, _store_down(scoped, exc, self._log_keys))
        finally:
            CLIENT_KEYS.reset(client)
        if not claimed.won:
            assert claimed.handled is not None
            return _respond(start_response, answer(claimed.handled))
        return self._run(environ, body, start_response, claimed)

    def _run_in_transaction(
        self,
        environ: dict[str, Any],
        body: bytes,
        start_response: Callable[..., Any],
        scoped: str,
        fingerprint: dict[str, Any],
    ) -> Iterable[bytes]:
        raised: list[BaseException] = []
        held: list[tuple[str, list[tuple[str, str]], list[bytes]]] = []

        def handler(tx: Any, _request: object) -> dict[str, Any]:
            # Run more than once on DynamoDB (see IdempotencyMiddleware._run_in_transaction):
            # only the last run's response, the one committed, is held.
            entered = _TX.set(tx)
            inside = CLIENT_KEYS.set(False)  # the app's own inboxes log as they always do
            held.clear()
            try:
                held.append(self._call_app(environ, body))
            except Exception as exc:
                raised.append(exc)
                raise
            finally:
                CLIENT_KEYS.reset(inside)
                _TX.reset(entered)
            status_line, raw_headers, chunks = held[0]
            return self._keep(*_wsgi_response(status_line, raw_headers), chunks, scoped)

        client = CLIENT_KEYS.set(True)  # a key reused for another request: the client's error
        try:
            handled = self.inbox.handle_in_transaction(scoped, fingerprint, handler, returns=None)
        except StoreUnavailable as exc:
            if raised:
                raise raised[0] from exc
            return _respond(start_response, _store_down(scoped, exc, self._log_keys))
        finally:
            CLIENT_KEYS.reset(client)
        if _ran(handled, raised):
            status_line, raw_headers, chunks = held[0]
            start_response(status_line, raw_headers)
            return chunks
        return _respond(start_response, answer(handled))

    def _call_app(
        self, environ: dict[str, Any], body: bytes
    ) -> tuple[str, list[tuple[str, str]], list[bytes]]:
        """Run the WSGI app on ``body``, its response buffered: status line, headers, chunks."""
        environ["wsgi.input"] = io.BytesIO(body)
        environ["CONTENT_LENGTH"] = str(len(body))
        started: list[Any] = []
        chunks: list[bytes] = []

        def capture(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> Any:
            started[:] = [status, headers]
            return lambda data: chunks.append(bytes(data))  # the legacy write()

        result = self.app(environ, capture)
        try:
            for chunk in result:
                chunks.append(bytes(chunk))
        finally:
            close = getattr(result, "close", None)
            if close is not None:
                close()
        status_line, raw_headers = started if started else ("500 Internal Server Error", [])
        return str(status_line), list(raw_headers), chunks

    def _read(self, environ: dict[str, Any]) -> bytes | None:
        """The request body; None when it is over ``max_request_bytes``; :data:`_GONE` when it
        ended before its ``Content-Length`` (the client went away mid-upload: a WSGI server's
        input then just ends early, and the part that arrived is never taken for the whole).
        Without a ``Content-Length``, a server that marks its input terminated
        (``wsgi.input_terminated``: gunicorn and others for a chunked request) is read to its
        end."""
        stream = environ.get("wsgi.input")
        given = environ.get("CONTENT_LENGTH")
        if not given and environ.get("wsgi.input_terminated") and stream is not None:
            parts: list[bytes] = []
            size = 0
            while chunk := stream.read(65536):
                size += len(chunk)
                if size > self._max_request:
                    return None
                parts.append(bytes(chunk))
            return b"".join(parts)
        try:
            length = int(given or 0)
        except ValueError:
            length = 0
        if length > self._max_request:
            return None
        if stream is None or not length:
            return b""
        body = bytes(stream.read(length))
        while len(body) < length:  # a server may hand a body over in parts (PEP 3333)
            more = stream.read(length - len(body))
            if not more:
                return _GONE
            body += more
        return body

    def _run(
        self,
        environ: dict[str, Any],
        body: bytes,
        start_response: Callable[..., Any],
        claimed: Claimed[Any],
    ) -> Iterable[bytes]:
        try:
            with _handling(self.inbox.consumer, claimed):
                status_line, raw_headers, chunks = self._call_app(environ, body)
        except BaseException as exc:
            claimed.release(f"the app raised {said(exc)}")
            raise
        # Complete, then answer (as the ASGI middleware does): a crash between the two leaves
        # a completed record, whose repeat is a replay; a store that cannot be reached delays
        # the answer while _settle retries (a bounded time), and never turns it into an error.
        self._settle(claimed, *_wsgi_response(status_line, raw_headers), chunks)
        start_response(status_line, raw_headers)
        return chunks


def _wsgi_response(
    status_line: str, raw_headers: list[tuple[str, str]]
) -> tuple[int, list[tuple[bytes, bytes]]]:
    """A WSGI status line and headers as the status and ASGI-style headers."""
    status = int(status_line.split(" ", 1)[0])
    return status, [(k.encode("latin-1"), v.encode("latin-1")) for k, v in raw_headers]


def _respond(start_response: Callable[..., Any], reply: Reply) -> list[bytes]:
    status, headers, body = reply
    try:
        phrase = HTTPStatus(status).phrase
    except ValueError:
        phrase = "Status"
    start_response(
        f"{status} {phrase}",
        [(k.decode("latin-1"), v.decode("latin-1")) for k, v in headers],
    )
    return [body]

"""The Flask app ``tests/web/test_wsgi.py`` serves, with the WSGI middleware on a sync Inbox,
from a threaded ``wsgiref`` server in a process of its own: ``python -m tests.web.wsgi_app
PORT`` (the store from ``ONCELY_TEST_HTTP_STORE``, the inbox's retention and lease in seconds
from ``ONCELY_TEST_HTTP_KEEP`` and ``ONCELY_TEST_HTTP_LEASE``). Routes as in
``tests/web/app.py``; with ``ONCELY_TEST_HTTP_TX`` (a ledger table) the middleware is
transactional and each run writes its order there through ``oncely.http.transaction()`` (on
DynamoDB an item of its own). A run whose body says ``"gate": true`` stops, once its ledger
write is made, at the gate its ``X-Gate`` header names until ``GET /open?gate=NAME`` opens it
(``GET /gates`` lists the gates runs wait at), as in ``tests/web/app.py``."""

from __future__ import annotations

import os
import sys
import threading
import time
import uuid
from collections import Counter
from datetime import timedelta
from typing import Any

from flask import Flask, jsonify, request

import oncely
from oncely.http import WSGIIdempotencyMiddleware, transaction
from tests.web.wsgi_serve import serve

EFFECTS: Counter[str] = Counter()
FAILED_ONCE: set[str] = set()
LOCK = threading.Lock()
LEDGER = os.environ.get("ONCELY_TEST_HTTP_TX", "")
GATES: dict[str, threading.Event] = {}
WAITING: set[str] = set()
flask_app = Flask(__name__)


def gate(name: str) -> threading.Event:
    with LOCK:
        return GATES.setdefault(name, threading.Event())


@flask_app.post("/orders")
def orders() -> Any:
    body = request.get_json()
    order = str(body.get("id"))
    now = oncely.current()  # R17: the request the middleware runs, as a message handler's
    said = (
        {"downstream": now.downstream_key("charge") if now else None}
        if body.get("downstream")
        else {}
    )
    time.sleep(float(body.get("sleep", 0)))
    if LEDGER:
        tx = transaction()
        if type(tx).__name__ == "DynamoTransaction":
            run = {"N": str(EFFECTS[order] + 1)}
            tx.put(LEDGER, {"order_id": {"S": order}, "sk": {"S": uuid.uuid4().hex}, "run": run})
        else:
            mark = "?" if type(tx).__module__.startswith("sqlite3") else "%s"
            ledger = f'INSERT INTO "{LEDGER}" VALUES ({mark}, {mark})'
            tx.execute(ledger, (order, EFFECTS[order] + 1))
    name = request.headers.get("X-Gate")
    if body.get("gate") and name is not None:
        with LOCK:
            WAITING.add(name)
        gate(name).wait(60)
        with LOCK:
            WAITING.discard(name)
    with LOCK:
        EFFECTS[order] += 1
        if body.get("fail_once") and order not in FAILED_ONCE:
            FAILED_ONCE.add(order)
            return jsonify({"error": "the ledger is down", **said}), 500
        run = EFFECTS[order]
    answer = {"order": order, "run": run, "size": "x" * int(body.get("pad", 0)), **said}
    return jsonify(answer), 201, {"X-App": "flask"}


@flask_app.post("/notes")
def notes() -> Any:
    """Any body (an upload, a partial one): one effect per run, by its size."""
    size = len(request.get_data())
    with LOCK:
        EFFECTS[f"note:{size}"] += 1
        return jsonify({"size": size, "run": EFFECTS[f"note:{size}"]}), 201


@flask_app.get("/gates")
def gates() -> Any:
    with LOCK:
        return jsonify(sorted(WAITING))


@flask_app.get("/open")
def open_gate() -> Any:
    gate(request.args["gate"]).set()
    return gates()


@flask_app.get("/effects")
def effects() -> Any:
    with LOCK:
        return jsonify(dict(EFFECTS))


def main() -> None:
    keep = os.environ.get("ONCELY_TEST_HTTP_KEEP")
    lease = os.environ.get("ONCELY_TEST_HTTP_LEASE")
    inbox = oncely.Inbox(
        oncely.open(os.environ["ONCELY_TEST_HTTP_STORE"]),
        consumer="orders-api",
        retention=oncely.Retention(keep=timedelta(seconds=float(keep))) if keep else None,
        lease=oncely.Lease(duration=timedelta(seconds=float(lease))) if lease else None,
    )
    app = WSGIIdempotencyMiddleware(
        flask_app.wsgi_app,
        inbox=inbox,
        required=lambda environ: environ["PATH_INFO"] == "/orders",
        principal=lambda environ: environ.get("HTTP_X_CLIENT", "anon"),
        max_stored_bytes=4096,
        transactional=bool(LEDGER),
    )
    serve(app, int(sys.argv[1]))


if __name__ == "__main__":
    main()

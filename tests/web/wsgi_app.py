"""The Flask app ``tests/web/test_wsgi.py`` serves, with the WSGI middleware on a sync Inbox,
from a threaded ``wsgiref`` server in a process of its own: ``python -m tests.web.wsgi_app
PORT`` (the store from ``ONCELY_TEST_HTTP_STORE``). Routes as in ``tests/web/app.py``; with
``ONCELY_TEST_HTTP_TX`` (a ledger table) the middleware is transactional and each run writes
its order there through ``oncely.http.transaction()``."""

from __future__ import annotations

import os
import sys
import threading
import time
from collections import Counter
from typing import Any

from flask import Flask, jsonify, request

import oncely
from oncely.http import WSGIIdempotencyMiddleware, transaction
from tests.web.wsgi_serve import serve

EFFECTS: Counter[str] = Counter()
FAILED_ONCE: set[str] = set()
LOCK = threading.Lock()
LEDGER = os.environ.get("ONCELY_TEST_HTTP_TX", "")
flask_app = Flask(__name__)


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
        mark = "?" if type(tx).__module__.startswith("sqlite3") else "%s"
        tx.execute(f'INSERT INTO "{LEDGER}" VALUES ({mark}, {mark})', (order, EFFECTS[order] + 1))
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


@flask_app.get("/effects")
def effects() -> Any:
    with LOCK:
        return jsonify(dict(EFFECTS))


def main() -> None:
    inbox = oncely.Inbox(oncely.open(os.environ["ONCELY_TEST_HTTP_STORE"]), consumer="orders-api")
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

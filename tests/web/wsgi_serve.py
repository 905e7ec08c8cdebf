"""A threaded ``wsgiref`` server, quiet, for the WSGI apps the tests serve."""

from __future__ import annotations

from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server


class Threaded(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base's name
        pass


def serve(app: Any, port: int) -> None:
    """Serve the WSGI ``app`` on ``port`` from a threaded ``wsgiref`` server, forever."""
    make_server("127.0.0.1", port, app, server_class=Threaded, handler_class=Quiet).serve_forever()

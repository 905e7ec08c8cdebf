"""What both FastStream test apps (RabbitMQ; NATS, Redis and Kafka) do with the middleware's
log: count, per key, its give-backs of a copy that met a running claim of its key, in the
scenario's Redis, so a test sees them."""

from __future__ import annotations

import logging

import redis


class _GivenBack(logging.Handler):
    """Counts each log line of outcome ``in_flight`` and action ``requeue`` under
    ``<ns>:given_back:<key>``."""

    def __init__(self, client: redis.Redis, ns: str) -> None:
        super().__init__(logging.INFO)
        self._client = client
        self._ns = ns

    def emit(self, record: logging.LogRecord) -> None:
        args = record.args
        if isinstance(args, tuple) and len(args) > 3 and args[1:3] == ("in_flight", "requeue"):
            self._client.incr(f"{self._ns}:given_back:{args[3]}")


def count_give_backs(client: redis.Redis, ns: str) -> None:
    """Count the middleware's give-backs from now on (its logger at INFO)."""
    log = logging.getLogger("oncely.faststream")
    log.addHandler(_GivenBack(client, ns))
    log.setLevel(logging.INFO)

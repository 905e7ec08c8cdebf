"""AWS Lambda Powertools' idempotency utility on Redis, as a comparison case for the servers
section (``bench/servers.py``).

The same trivial handler and the same order payload as oncely's case, behind Powertools'
``idempotent_function`` with its Redis persistence layer (``CachePersistenceLayer``; the same
class as the older ``RedisCachePersistenceLayer``) and its default configuration: the
idempotency key is the MD5 of the whole payload (``data_keyword_argument="order"``, no
``event_key_jmespath``), no payload validation, no local cache, records kept 1 hour. That is
the cheapest configuration Powertools offers for this payload: a key taken from ``order_id``
plus payload validation (what oncely's key + fingerprint give) would cost it two JMESPath
searches and a second hash per message on top.

Whether a call ran the handler is counted, so a new key that did not run it, or a duplicate
that did, fails the run like a wrong oncely outcome does.
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable
from typing import Any

from cases import BenchError

POWERTOOLS_REQUIREMENT = "aws-lambda-powertools[redis,aws-sdk]>=3.37,<4"
"""``aws-sdk`` (boto3) too: the idempotency package imports its DynamoDB layer on import."""


def powertools_version() -> str | None:
    """The installed version, or None when Powertools (or its Redis layer) is missing."""
    try:
        importlib.import_module("aws_lambda_powertools.utilities.idempotency.persistence.cache")
        return str(importlib.import_module("aws_lambda_powertools.shared.version").VERSION)
    except ImportError:
        return None


class PowertoolsCase:
    """``new(msgs)`` / ``dup(msgs)`` through ``idempotent_function`` on ``client`` (a redis-py
    client with ``decode_responses=True``, as Powertools' documentation builds it)."""

    def __init__(self, client: Any, key_prefix: str) -> None:
        idempotency = importlib.import_module("aws_lambda_powertools.utilities.idempotency")
        cache = importlib.import_module(
            "aws_lambda_powertools.utilities.idempotency.persistence.cache"
        )
        with warnings.catch_warnings():
            # The Redis class names are deprecated aliases in 3.x (to be removed in 4.0).
            warnings.simplefilter("ignore", DeprecationWarning)
            layer = cache.CachePersistenceLayer(client=client)
        # Outside a Lambda there is no context to read the remaining time from; Powertools
        # warns on every call (printed once). Silenced as a user would: it changes nothing else.
        warnings.filterwarnings(
            "ignore", message="Couldn't determine the remaining time", category=UserWarning
        )
        self.key_prefix = key_prefix
        self.runs = 0

        def process(order: dict[str, Any]) -> None:
            self.runs += 1

        self.handler: Callable[..., Any] = idempotency.idempotent_function(
            process,
            data_keyword_argument="order",
            persistence_store=layer,
            config=idempotency.IdempotencyConfig(),
            key_prefix=key_prefix,
        )

    def new(self, msgs: list[tuple[str, Any]]) -> None:
        before = self.runs
        handler = self.handler
        for _key, payload in msgs:
            handler(order=payload)
        if self.runs - before != len(msgs):
            raise BenchError(
                f"Powertools ran the handler {self.runs - before} times for {len(msgs)} new keys"
            )

    def dup(self, msgs: list[tuple[str, Any]]) -> None:
        before = self.runs
        handler = self.handler
        for _key, payload in msgs:
            handler(order=payload)
        if self.runs != before:
            raise BenchError(f"Powertools ran the handler again for {self.runs - before} keys")

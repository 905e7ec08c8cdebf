"""Where the SQS API is and how oncely talks to it: the ``sqs://`` URL, the client, errors."""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from aiobotocore.config import AioConfig
from aiobotocore.session import get_session
from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    EndpointConnectionError,
    NoCredentialsError,
    PartialCredentialsError,
    ProfileNotFound,
)

from oncely._aws import REGION, emulator_credentials, error_code, region_hint, region_or_default
from oncely._core.said import said
from oncely._urls import UrlOptions, redact, split
from oncely.errors import BrokerError, BrokerUnavailable, ConfigurationError

LOGGER = logging.getLogger("oncely.broker.sqs")

MESSAGE_ID_ATTRIBUTE = "message-id"
CONTENT_TYPE_ATTRIBUTE = "content-type"
CORRELATION_ATTRIBUTE = "correlation-id"
BODY_ENCODING_ATTRIBUTE = "x-oncely-body-encoding"
"""``base64`` on a message whose body is not UTF-8 text (SQS bodies are text)."""
MAX_ATTRIBUTES = 10
"""SQS carries at most ten message attributes per message."""
SHARED_URL_OPTIONS = ("region", "secure", "timeout", "connect_timeout")
CONSUMER_URL_OPTIONS = ("visibility_timeout", "create")
"""The URL options only the transport reads: the producer refuses them as the consumer's (it
never creates a queue, nor sets its visibility timeout)."""
_QUEUE_NAME = re.compile(r"^[A-Za-z0-9_-]{1,75}(\.fifo)?$")
_NO_CREDENTIALS = (NoCredentialsError, PartialCredentialsError, ProfileNotFound)
"""Credentials that cannot be found: a set-up to fix, not an outage that waiting rides out."""
_UNAVAILABLE_CODES = frozenset(
    {"ServiceUnavailable", "InternalError", "InternalFailure", "RequestThrottled", "Throttling"}
)


def check_queue(what: str, name: str) -> str:
    """A queue name SQS accepts: 1 to 80 of ``[A-Za-z0-9_-]``, ``.fifo`` at the end of a
    FIFO queue's."""
    if not _QUEUE_NAME.match(name) or len(name) > 80:
        last = name.rstrip("/").rsplit("/", 1)[-1]
        if "://" in name and _QUEUE_NAME.match(last):
            raise ConfigurationError(
                f"the {what} {name!r} is a queue URL: give the queue's name, {last!r} (the "
                "endpoint, region and account come from the sqs:// URL and the AWS environment)"
            )
        raise ConfigurationError(
            f"the {what} {name!r} is not an SQS queue name (up to 80 letters, digits, '-' or "
            "'_', ending in '.fifo' for a FIFO queue)"
        )
    return name


@dataclass(frozen=True, slots=True)
class Endpoint:
    """``sqs://HOST:PORT`` (a plain-HTTP endpoint such as an emulator's; ``?secure=true``
    for HTTPS), ``sqs://REGION`` or ``sqs://`` (AWS itself, the region from the URL or the
    usual AWS environment). Credentials come from the AWS environment and configuration; an
    emulator's endpoint (not AWS's own, ``sqs.us-east-1.amazonaws.com:443``) with none in the
    environment gets placeholder ones (an emulator accepts any)."""

    region: str
    endpoint_url: str | None
    timeout: timedelta
    connect_timeout: timedelta
    shown: str

    @classmethod
    def from_url(cls, url: str) -> tuple[Endpoint, UrlOptions]:
        parts = split(url)
        if parts.scheme.lower() != "sqs":
            raise ConfigurationError(f"{redact(url)}: an SQS URL starts with sqs://")
        if parts.username or parts.password:
            raise ConfigurationError(
                f"{redact(url)}: put AWS credentials in the AWS environment "
                "(AWS_ACCESS_KEY_ID, AWS_PROFILE ...), not in the URL"
            )
        options = UrlOptions(url)
        region = options.optional_text("region")
        secure = options.boolean("secure", False)
        timeout = options.seconds("timeout", timedelta(seconds=30))
        connect = options.seconds("connect_timeout", timedelta(seconds=10))
        if min(timeout, connect) <= timedelta(0):
            raise ConfigurationError(f"{redact(url)}: timeout and connect_timeout must be positive")
        host = parts.hostname or ""
        endpoint_url = None
        if parts.port is not None:
            scheme = "https" if secure else "http"
            endpoint_url = f"{scheme}://{parts.netloc}"
        elif host:
            if not REGION.match(host):
                raise ConfigurationError(
                    f"{redact(url)}: {host!r} is neither an AWS region (sqs://eu-west-1) nor "
                    "host:port (sqs://localhost:9324)"
                )
            region = region or host
        region = region_or_default(region, endpoint_url)
        if region is None:
            raise ConfigurationError(
                f"{redact(url)}: no AWS region: sqs://REGION, ?region=, or AWS_REGION"
            )
        shown = endpoint_url or f"aws {region}"
        return cls(region, endpoint_url, timeout, connect, shown), options

    @contextlib.asynccontextmanager
    async def client(self) -> AsyncIterator[Any]:
        """An aiobotocore SQS client, closed after the block."""
        config = AioConfig(
            connect_timeout=self.connect_timeout.total_seconds(),
            read_timeout=self.timeout.total_seconds() + 20,  # a long poll waits up to 20 s
            retries={"max_attempts": 2, "mode": "standard"},
        )
        kwargs: dict[str, Any] = {"region_name": self.region, "config": config}
        if self.endpoint_url is not None:
            kwargs["endpoint_url"] = self.endpoint_url
            kwargs.update(emulator_credentials(self.endpoint_url))
        async with get_session().create_client("sqs", **kwargs) as client:
            yield client

    @contextlib.contextmanager
    def errors(self, what: str) -> Iterator[None]:
        """Connection faults and throttling as :class:`~oncely.BrokerUnavailable`, an API
        error as :class:`~oncely.BrokerError`, each naming ``what`` failed."""
        try:
            yield
        except BrokerError:
            raise
        except ClientError as exc:
            code = exc.response.get("Error", {}).get("Code", "")
            error = BrokerUnavailable if code in _UNAVAILABLE_CODES else BrokerError
            raise error(f"sqs {self.shown}: could not {what}: {code}: {exc}") from None
        except _NO_CREDENTIALS as exc:
            raise BrokerError(
                f"sqs {self.shown}: could not {what}: no usable AWS credentials ({said(exc)}); "
                "set them in the AWS environment (AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, "
                "AWS_PROFILE, a role)"
            ) from None
        except (BotoCoreError, OSError, TimeoutError) as exc:
            hint = ""
            if self.endpoint_url is None and isinstance(exc, EndpointConnectionError):
                hint = region_hint("sqs", self.region)  # a mistyped region reads as an outage
            raise BrokerUnavailable(
                f"sqs {self.shown}: could not {what}: {said(exc)}{hint}"
            ) from None


def queue_missing(exc: BaseException) -> bool:
    """Whether ``exc`` is SQS saying the queue does not exist (``QueueDoesNotExist``, or
    ``AWS.SimpleQueueService.NonExistentQueue`` in the query protocol)."""
    code = error_code(exc)
    return "NonExistentQueue" in code or "QueueDoesNotExist" in code

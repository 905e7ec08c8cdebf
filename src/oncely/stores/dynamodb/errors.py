"""The botocore boundary: the ``dynamodb://`` URL and its options, and botocore's errors as
oncely's.

aiobotocore raises botocore's exception classes, so one translation serves both twins.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import timedelta
from typing import Final

from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    EndpointConnectionError,
    NoCredentialsError,
    NoRegionError,
    PartialCredentialsError,
    ProfileNotFound,
)

from oncely._aws import REGION, error_code, region_hint, region_or_default
from oncely._core.said import said
from oncely._urls import UrlOptions, path_of, redact, split
from oncely.errors import ConfigurationError, SchemaMissing, StoreError, StoreUnavailable

__all__ = [
    "DRIVER_ERRORS",
    "DynamoDBOptions",
    "build_options",
    "error_code",
    "parse_url",
    "translate",
]

DRIVER_ERRORS: Final = (BotoCoreError, ClientError, OSError, TimeoutError)
"""Everything botocore raises for a failed call (``OSError`` covers socket errors that escape
its own wrappers)."""

_TABLE = re.compile(r"^[A-Za-z0-9_.-]{3,255}$")
_NO_CREDENTIALS: Final = (NoCredentialsError, PartialCredentialsError, ProfileNotFound)
# "Not now, retry later": throttling (the table's or the account's), the service's own faults.
_UNAVAILABLE_CODES: Final = frozenset(
    {
        "ProvisionedThroughputExceededException",
        "ThrottlingException",
        "Throttling",
        "RequestLimitExceeded",
        "LimitExceededException",
        "InternalServerError",
        "InternalFailure",
        "ServiceUnavailable",
        "ServiceUnavailableException",
        "TransactionInProgressException",
        # A single write on an item that a TransactWriteItems is writing at that moment.
        "TransactionConflictException",
    }
)
# The credentials or the permissions refused: a set-up to fix (also any answer of HTTP 401 or
# 403: an emulator may word it otherwise, as moto's server checking credentials does).
_REFUSED_CODES: Final = frozenset(
    {
        "UnrecognizedClientException",
        "InvalidSignatureException",
        "AccessDeniedException",
        "ExpiredTokenException",
        "InvalidClientTokenId",
        "MissingAuthenticationTokenException",
        "IncompleteSignature",
    }
)


def _status(exc: ClientError) -> int:
    return int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)


def translate(
    exc: BaseException, doing: str, where: str, table: str, *, region: str | None = None
) -> StoreError:
    """The oncely error for a botocore error raised while ``doing`` something on the table
    ``table`` at ``where`` (an endpoint or ``aws REGION``). ``region`` is AWS's region when
    AWS itself is meant (no endpoint named): a connection error there names a region that
    botocore does not know, as a mistyped one (``eu-wset-1``) reads as an outage."""
    doing = f"{doing} on dynamodb {where} table {table!r}"
    if isinstance(exc, ClientError):
        code = error_code(exc)
        text = f"{doing}: {code}: {exc.response.get('Error', {}).get('Message', '') or exc}"
        if code == "ResourceNotFoundException":
            return SchemaMissing(
                f"{text}; create the table with `oncely migrate --store URL` or open the "
                "store with ?migrate=true (migrate=True)"
            )
        if code in _REFUSED_CODES or _status(exc) in (401, 403):
            return StoreError(
                f"{text}; check the AWS credentials (AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY, AWS_PROFILE, a role) and their DynamoDB permissions"
            )
        if code in _UNAVAILABLE_CODES or _status(exc) >= 500:
            return StoreUnavailable(text)
        return StoreError(text)
    if isinstance(exc, _NO_CREDENTIALS):
        return StoreError(
            f"{doing}: no usable AWS credentials ({said(exc)}); set them in the AWS "
            "environment (AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, AWS_PROFILE, a role)"
        )
    if isinstance(exc, NoRegionError):
        return StoreError(f"{doing}: no AWS region: add ?region= to the URL, or set AWS_REGION")
    hint = ""
    if region is not None and isinstance(exc, EndpointConnectionError):
        hint = region_hint("dynamodb", region)
    return StoreUnavailable(f"{doing}: {said(exc)}{hint}")


@dataclass(frozen=True, slots=True, kw_only=True)
class DynamoDBOptions:
    """What a ``dynamodb://`` URL says. ``endpoint_url`` is None for AWS itself."""

    table: str
    region: str
    endpoint_url: str | None = None
    migrate: bool = True
    max_connections: int = 32
    timeout: timedelta = timedelta(seconds=10)
    connect_timeout: timedelta = timedelta(seconds=5)

    @property
    def where(self) -> str:
        """The endpoint for messages: its URL, or ``aws REGION``."""
        return self.endpoint_url or f"aws {self.region}"


_KNOWN = ("region", "secure", "migrate", "max_connections", "timeout", "connect_timeout")


def check_table(name: str, shown: str) -> str:
    if not _TABLE.match(name):
        raise ConfigurationError(
            f"{shown}: {name!r} is not a DynamoDB table name (3 to 255 letters, digits, "
            "'_', '-' or '.')"
        )
    return name


def parse_url(url: str) -> DynamoDBOptions:
    """``dynamodb://HOST:PORT/TABLE`` (a plain-HTTP endpoint: moto's server, DynamoDB Local;
    ``?secure=true`` for HTTPS) or ``dynamodb:///TABLE`` (AWS over HTTPS, the region from
    ``?region=`` or the AWS environment), with the options ``region``, ``secure``,
    ``migrate``, ``max_connections`` (HTTP connections, and claims of one batch sent at
    once), ``timeout`` and ``connect_timeout`` (seconds). Credentials come from the AWS
    environment and configuration, never from the URL."""
    parts = split(url)
    shown = redact(url)
    if parts.scheme.lower() != "dynamodb":
        raise ConfigurationError(f"{shown}: a DynamoDB URL starts with dynamodb://")
    if parts.username or parts.password:
        raise ConfigurationError(
            f"{shown}: put AWS credentials in the AWS environment (AWS_ACCESS_KEY_ID, "
            "AWS_PROFILE ...), not in the URL"
        )
    table = path_of(parts)
    if not table:
        raise ConfigurationError(
            f"{shown}: the URL names no table: dynamodb://HOST:PORT/TABLE or dynamodb:///TABLE"
        )
    options = UrlOptions(url)
    region = options.optional_text("region")
    secure = options.boolean("secure", False)
    migrate = options.boolean("migrate", True)
    max_connections = options.integer("max_connections", 32)
    timeout = options.seconds("timeout", timedelta(seconds=10))
    connect = options.seconds("connect_timeout", timedelta(seconds=5))
    options.done(_KNOWN)
    endpoint_url = None
    if parts.hostname:
        if parts.port is None:
            raise ConfigurationError(
                f"{shown}: an endpoint is HOST:PORT (dynamodb://localhost:8000/TABLE); for "
                "AWS itself leave the host out (dynamodb:///TABLE?region=eu-west-1)"
            )
        endpoint_url = f"{'https' if secure else 'http'}://{parts.netloc}"
    elif secure:
        raise ConfigurationError(f"{shown}: secure= is for an endpoint's URL; AWS is HTTPS")
    return build_options(
        shown,
        table=table,
        endpoint_url=endpoint_url,
        region=region,
        migrate=migrate,
        max_connections=max_connections,
        timeout=timeout,
        connect_timeout=connect,
    )


def build_options(
    shown: str,
    *,
    table: str,
    endpoint_url: str | None,
    region: str | None,
    migrate: bool,
    max_connections: int,
    timeout: timedelta,
    connect_timeout: timedelta,
) -> DynamoDBOptions:
    """The options checked, the region from the AWS environment when not given (``shown``
    names the store in errors: its URL, or its class)."""
    check_table(table, shown)
    if min(timeout, connect_timeout) <= timedelta(0):
        raise ConfigurationError(f"{shown}: timeout and connect_timeout must be positive")
    if max_connections < 1:
        raise ConfigurationError(f"{shown}: max_connections must be at least 1")
    if endpoint_url is not None and not endpoint_url.startswith(("http://", "https://")):
        raise ConfigurationError(
            f"{shown}: endpoint_url must be http://HOST:PORT or https://HOST:PORT"
        )
    region = region_or_default(region, endpoint_url)
    if region is None:
        raise ConfigurationError(
            f"{shown}: no AWS region: dynamodb:///TABLE?region=eu-west-1, or AWS_REGION"
        )
    if not REGION.match(region):
        raise ConfigurationError(f"{shown}: {region!r} is not an AWS region (eu-west-1)")
    return DynamoDBOptions(
        table=table,
        region=region,
        endpoint_url=endpoint_url.rstrip("/") if endpoint_url is not None else None,
        migrate=migrate,
        max_connections=max_connections,
        timeout=timeout,
        connect_timeout=connect_timeout,
    )

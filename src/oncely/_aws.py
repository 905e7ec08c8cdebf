"""The credentials an AWS client gets for an endpoint named in a URL (the DynamoDB store's
``dynamodb://HOST:PORT/TABLE``, the SQS broker's ``sqs://HOST:PORT``).

An emulator (moto's server, DynamoDB Local, ElasticMQ) accepts any credentials, and a user
running one has often set none: its endpoint gets placeholders. AWS's own endpoints named
there (a FIPS, dual-stack or VPC endpoint) are no emulator: their credentials are the AWS
chain's (an instance role, a web identity, a container role, a credentials file), never
placeholders, and neither are an emulator's when the environment names credentials.
"""

from __future__ import annotations

import functools
import os
import re
from typing import Final
from urllib.parse import urlsplit

__all__ = ["REGION", "emulator_credentials", "error_code", "region_hint", "region_or_default"]

REGION: Final = re.compile(r"^[a-z]{2}(-[a-z]+)+-\d+$")
"""The shape of an AWS region's name (``eu-west-1``, ``us-gov-west-1``)."""

_AWS_DOMAINS: Final = (".amazonaws.com", ".amazonaws.com.cn", ".api.aws")
# Where credentials come from besides keys and profiles: a web identity (EKS), a container
# role (ECS): set, the AWS configuration is the user's, not an emulator's stand-in.
_CREDENTIAL_VARIABLES: Final = (
    "AWS_ACCESS_KEY_ID",
    "AWS_PROFILE",
    "AWS_WEB_IDENTITY_TOKEN_FILE",
    "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
    "AWS_CONTAINER_CREDENTIALS_FULL_URI",
)
_PLACEHOLDERS: Final = {"aws_access_key_id": "oncely", "aws_secret_access_key": "oncely"}


def emulator_credentials(endpoint_url: str | None) -> dict[str, str]:
    """The client's keyword arguments for the credentials of ``endpoint_url``: placeholders
    for an emulator's endpoint when the environment names no credentials; none (the AWS
    chain's, looked up by botocore) for AWS itself (``None``) or one of its endpoints."""
    if endpoint_url is None or aws_endpoint(endpoint_url) or _credentials_in_environment():
        return {}
    return dict(_PLACEHOLDERS)


def aws_endpoint(endpoint_url: str) -> bool:
    """Whether ``endpoint_url`` is one of AWS's own (a FIPS, dual-stack or VPC endpoint)."""
    host = (urlsplit(endpoint_url).hostname or "").lower().rstrip(".")
    return host.endswith(_AWS_DOMAINS)


def _credentials_in_environment() -> bool:
    return any(os.environ.get(name) for name in _CREDENTIAL_VARIABLES)


def region_or_default(region: str | None, endpoint_url: str | None) -> str | None:
    """``region``, else the AWS environment's (``AWS_REGION``, ``AWS_DEFAULT_REGION``), else
    ``us-east-1`` for an endpoint named in the URL (an emulator takes any); ``None`` when AWS
    itself is meant and no region is known (the caller says how to give one)."""
    region = region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    if region is None and endpoint_url is not None:
        return "us-east-1"
    return region


def error_code(exc: BaseException) -> str:
    """The AWS API's error code of a botocore ``ClientError`` (``ConditionalCheckFailedException``,
    ``QueueDoesNotExist`` ...), or ``''`` for any other exception."""
    response = getattr(exc, "response", None)
    if not isinstance(response, dict):
        return ""
    return str(response.get("Error", {}).get("Code", ""))


@functools.lru_cache(maxsize=32)
def region_hint(service: str, region: str) -> str:
    """A clause to add to a connection error on AWS's ``service`` in ``region`` when botocore's
    endpoint data lists no such region in any partition, ``''`` otherwise.

    A mistyped region (``eu-wset-1``) has a region's shape, so the URL's check passes it, and
    its endpoint's host does not resolve: that reads as an outage to wait out. The clause
    names the likelier cause. It is a hint, not a refusal: a region newer than the installed
    botocore is not listed either, and works."""
    try:
        import botocore  # noqa: PLC0415 - the core needs no botocore
        import botocore.session  # noqa: PLC0415
    except ModuleNotFoundError:
        return ""
    session = botocore.session.get_session()
    try:
        for partition in session.get_available_partitions():
            if region in session.get_available_regions(service, partition_name=partition):
                return ""
    except Exception:  # endpoint data it cannot read: no hint, rather than another error
        return ""
    return (
        f"; botocore {botocore.__version__} knows no AWS region {region!r} for "
        f"{_SERVICE_NAMES.get(service, service)}: check the region's spelling (a region newer "
        "than this botocore is not listed, and works)"
    )


_SERVICE_NAMES: Final = {"sqs": "SQS", "dynamodb": "DynamoDB"}

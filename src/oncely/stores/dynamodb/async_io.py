"""The DynamoDB client calls: aiobotocore for the asyncio store, botocore for the threaded one.

The differences (the client's class and its closing, running a batch's calls at once) are
marked ``if ASYNC:`` in ``async_io.py``, from which ``sync_io.py`` is generated like the rest.
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Final, TypeVar
from urllib.parse import urlsplit

from oncely._twin import ASYNC
from oncely.stores.dynamodb.dialect import Item
from oncely.stores.dynamodb.errors import DynamoDBOptions, error_code

if ASYNC:
    import asyncio

    from aiobotocore.config import AioConfig as Config
    from aiobotocore.session import get_session
else:
    from concurrent.futures import ThreadPoolExecutor

    from botocore.config import Config
    from botocore.session import get_session

__all__ = ["Client", "call", "close", "connect", "each", "write"]

T = TypeVar("T")
Client = Any
"""A botocore (threaded store) or aiobotocore (asyncio store) DynamoDB client."""


async def connect(options: DynamoDBOptions) -> Client:
    """A DynamoDB client for ``options``' endpoint and region. Credentials come from the AWS
    environment and configuration; an emulator's endpoint (not AWS's own) with none in the
    environment gets placeholder ones (an emulator accepts any)."""
    config = Config(
        connect_timeout=options.connect_timeout.total_seconds(),
        read_timeout=options.timeout.total_seconds(),
        retries={"max_attempts": 3, "mode": "standard"},
        max_pool_connections=options.max_connections,
    )
    kwargs: dict[str, Any] = {"region_name": options.region, "config": config}
    if options.endpoint_url is not None:
        kwargs["endpoint_url"] = options.endpoint_url
        if not (_aws_endpoint(options.endpoint_url) or _credentials_in_environment()):
            kwargs.update(aws_access_key_id="oncely", aws_secret_access_key="oncely")
    if ASYNC:
        return await get_session().create_client("dynamodb", **kwargs).__aenter__()
    else:
        return get_session().create_client("dynamodb", **kwargs)


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


def _aws_endpoint(endpoint_url: str) -> bool:
    """Whether ``endpoint_url`` is one of AWS's own (a FIPS, dual-stack or VPC endpoint):
    its credentials are the AWS chain's (a role, a profile file), never placeholders."""
    host = (urlsplit(endpoint_url).hostname or "").lower().rstrip(".")
    return host.endswith(_AWS_DOMAINS)


def _credentials_in_environment() -> bool:
    return any(os.environ.get(name) for name in _CREDENTIAL_VARIABLES)


async def close(client: Client) -> None:
    await client.close()


async def call(client: Client, name: str, **kwargs: Any) -> Any:
    """The API call ``name`` (``describe_table`` ...) and its answer."""
    return await getattr(client, name)(**kwargs)


async def write(client: Client, name: str, **kwargs: Any) -> tuple[bool, Item | None]:
    """A conditional write (``put_item``, ``update_item``, ``delete_item``) asking for the
    item as it was when its condition failed: ``(True, the answer's Attributes)`` when it
    applied, ``(False, the item then)`` when its condition failed (None: there was none)."""
    try:
        done = await getattr(client, name)(ReturnValuesOnConditionCheckFailure="ALL_OLD", **kwargs)
    except Exception as exc:
        if error_code(exc) != "ConditionalCheckFailedException":
            raise
        item: Item | None = getattr(exc, "response", {}).get("Item")
        return False, item
    return True, done.get("Attributes")


async def each(calls: Sequence[Callable[[], Awaitable[T]]], limit: int) -> list[T]:
    """Run ``calls`` at once, at most ``limit`` at a time, and return their answers in order;
    the first error raises when they all ended."""
    if len(calls) == 1:
        return [await calls[0]()]
    if ASYNC:
        gate = asyncio.Semaphore(limit)
        errors: list[BaseException] = []

        async def bounded(run: Callable[[], Awaitable[T]]) -> T | None:
            async with gate:
                try:
                    return await run()
                except Exception as exc:  # raised once they all ended, as the threads do
                    errors.append(exc)
                    return None

        done = await asyncio.gather(*(bounded(run) for run in calls))
        if errors:
            raise errors[0]
        return done  # type: ignore[return-value]
    else:
        with ThreadPoolExecutor(min(limit, len(calls))) as pool:
            futures = [pool.submit(run) for run in calls]
            return [f.result() for f in futures]

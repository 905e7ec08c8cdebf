"""The DynamoDB client calls: aiobotocore for the asyncio store, botocore for the threaded one.

The differences (the client's class and its closing, running a batch's calls at once) are
marked ``if ASYNC:`` in ``async_io.py``, from which ``sync_io.py`` is generated like the rest.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from oncely._aws import emulator_credentials
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
        kwargs.update(emulator_credentials(options.endpoint_url))
    if ASYNC:
        return await get_session().create_client("dynamodb", **kwargs).__aenter__()
    else:
        return get_session().create_client("dynamodb", **kwargs)


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

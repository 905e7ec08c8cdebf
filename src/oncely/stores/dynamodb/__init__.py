"""DynamoDB stores: :class:`DynamoDBStore` and :class:`AsyncDynamoDBStore`, a table of the
DynamoDB API, on botocore and aiobotocore (``oncely[dynamodb]``). DynamoDB API, tested on
moto's server (not on AWS): two-phase mode, and the transactional mode in one
``TransactWriteItems`` (:class:`~oncely.stores.dynamodb.transaction.DynamoTransaction`).

The store classes are imported on first use, so importing this package needs no driver (nor
does :class:`DynamoTransaction`, the transaction a handler of the transactional mode writes
in); the entry point ``oncely.stores`` names :data:`backend`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from oncely.stores._backend import Backend
from oncely.stores.dynamodb.transaction import DynamoTransaction

if TYPE_CHECKING:
    from oncely.stores.dynamodb.async_store import AsyncDynamoDBStore as AsyncDynamoDBStore
    from oncely.stores.dynamodb.sync_store import DynamoDBStore as DynamoDBStore

__all__ = ["AsyncDynamoDBStore", "DynamoDBStore", "DynamoTransaction", "backend"]

backend = Backend(
    name="DynamoDB",
    sync="oncely.stores.dynamodb.sync_store:DynamoDBStore",
    async_="oncely.stores.dynamodb.async_store:AsyncDynamoDBStore",
    extra="dynamodb",
    schemes=("dynamodb",),
)
"""The store of this backend's URL schemes, for :func:`oncely.open`."""

__getattr__ = backend.module_getattr(__name__)

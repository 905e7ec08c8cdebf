"""The transactional mode on DynamoDB, runnable:

    python examples/dynamodb_ledger.py http://127.0.0.1:5000 [TABLE]

on a DynamoDB endpoint (moto's server, DynamoDB Local; credentials and region from the AWS
environment). The example creates the inbox table TABLE (``ledger_inbox``) and two tables of its
own beside it (``<TABLE>_ledger``, ``<TABLE>_accounts``), books one payment delivered twice, and
deletes the tables it made.

The payment's ledger item, the account's balance and the inbox's marker are one
``TransactWriteItems``: all of them are written, or none.
"""

from __future__ import annotations

import sys
from typing import Any

import botocore.session

import oncely
from oncely.stores.dynamodb import DynamoTransaction


def main(endpoint: str, table: str) -> None:
    store = oncely.open(f"dynamodb://{endpoint.split('://', 1)[1]}/{table}")
    store.migrate()
    ledger, accounts = f"{table}_ledger", f"{table}_accounts"
    client: Any = botocore.session.get_session().create_client("dynamodb", endpoint_url=endpoint)
    for name in (ledger, accounts):
        client.create_table(
            TableName=name,
            AttributeDefinitions=[{"AttributeName": "id", "AttributeType": "S"}],
            KeySchema=[{"AttributeName": "id", "KeyType": "HASH"}],
            BillingMode="PAY_PER_REQUEST",
        )
        client.get_waiter("table_exists").wait(TableName=name)
    try:
        with store.transaction() as tx:
            tx.put(accounts, {"id": {"S": "acme"}, "balance": {"N": "0"}})
        inbox = oncely.Inbox(store, consumer="billing")

        def book(tx: DynamoTransaction, payment: dict[str, Any]) -> dict[str, Any]:
            amount = {":a": {"N": str(payment["amount"])}}
            tx.put(ledger, {"id": {"S": payment["id"]}, "amount": amount[":a"]})
            tx.update(accounts, {"id": {"S": "acme"}}, "ADD balance :a",
                      condition="attribute_exists(id)", values=amount)
            return {"booked": payment["amount"]}

        payment = {"id": "pay-1", "amount": 42}
        for delivery in (1, 2):
            handled = inbox.handle_in_transaction("pay-1", payment, book)
            print(f"delivery {delivery}: {handled.outcome} {handled.value}")
        balance = client.get_item(TableName=accounts, Key={"id": {"S": "acme"}},
                                  ConsistentRead=True)["Item"]["balance"]["N"]  # fmt: skip
        print(f"balance: {balance}")
    finally:
        for name in (ledger, accounts, table):
            client.delete_table(TableName=name)
        store.close()
        client.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "ledger_inbox")

"""oncely in Django: the inbox on the project's own database, the claim inside
``transaction.atomic()``, a consumer whose handler is a Django function, and the
``Idempotency-Key`` HTTP layer (:mod:`oncely.integrations.django.http`).

Set up (``pip install 'oncely[django]'``)::

    INSTALLED_APPS = [..., "oncely.integrations.django"]   # app label "oncely"
    # optional: ONCELY_INBOX = {"table": "oncely_inbox", "schema": "public"}

``python manage.py migrate`` then creates oncely's tables on each database Django migrates
(through oncely's store, so the schema is exactly the store's). In code::

    from django.db import transaction
    from oncely.integrations.django import get_inbox, handle_in_atomic

    def charge(order: dict) -> int:
        Charge.objects.create(order_id=order["id"], amount=order["amount"])
        return order["amount"]

    billing = get_inbox("billing")   # an oncely.Inbox on DATABASES["default"] (cheap: the
    with transaction.atomic():       # store is opened once per database; made at import, it
        handled = handle_in_atomic(billing, message_id, order, charge)  # misses test DBs)
    handled.outcome   # processed | duplicate | key_conflict | failed | rejected

The marker and the handler's rows commit together or not at all (R7): until the outer block
commits, ``processed`` is tentative, and a rollback leaves neither. Outside an ``atomic``
block the call opens one and commits it. ``duplicate`` returns the first result without
calling the handler; ``failed`` means the handler raised, its writes and the claim were rolled
back to a savepoint (Django's own, so the block stays usable) and a redelivery retries; a
handler raising :class:`oncely.Reject` is ``rejected`` and its key recorded as poison.

**What is joined.** oncely writes on the DB-API connection behind Django's connection
(``connections[using].connection``): PostgreSQL through psycopg 3 (Django's backend uses it
when it is installed), MariaDB/MySQL through PyMySQL (``pymysql.install_as_MySQLdb()`` in the
settings; mysqlclient connections cannot be joined yet), SQLite through sqlite3. Another
driver raises :class:`oncely.TransactionsUnsupported` saying what to install; a store on
another database than the connection raises :class:`oncely.ConfigurationError`. An
in-memory SQLite database cannot be shared with the store: under the test runner give
``DATABASES[...]["TEST"]["NAME"]`` a file name. SQLite: ``"OPTIONS": {"transaction_mode":
"IMMEDIATE"}`` lets concurrent writers queue on the busy timeout instead of failing.

**A broker worker.** ``manage.py oncely consume --broker URL --source QUEUE --handler
app.module:function --consumer NAME`` (every option of ``oncely consume`` but ``--store``,
which is the database) runs ``def function(payload)`` once per logical message, each in its
own ``transaction.atomic()`` with its record (:func:`handle_message_in_atomic`), on
``--concurrency`` threads, each with its own connection (closed and reopened as Django does
around a request). A worker killed mid-handler leaves neither the rows nor the claim: the
broker redelivers and the message runs again from the start. Failures are retried, then
dead-lettered; what cannot be run (no key, an undecodable body, a reused key, a rejection)
is dead-lettered with its reason. :class:`~oncely.integrations.django.consumer.AtomicProcessor`
is the same thing for a :class:`oncely.brokers.BrokerConsumer` of your own.

**Operating the inbox.** ``manage.py oncely inbox stats`` (``list``, ``show``, ``purge``,
``forget``) and ``manage.py oncely migrate`` are the ``oncely`` command on the project's
database (``--database ALIAS`` before the command for another one). Purge expired records
with ``manage.py oncely inbox purge --every 1m`` as a process of its own.

Tested with Django 5.2 on PostgreSQL 15, MariaDB 10.11 and SQLite, with Django's own test
runner on each (``tests/integrations/test_django.py``); the worker with RabbitMQ on
PostgreSQL, as its own process, ``SIGKILL`` included
(``tests/integrations/test_django_consume.py``).
"""

from __future__ import annotations

try:
    import django as _django  # noqa: F401 - the guard: say which extra is missing
except ImportError as exc:  # pragma: no cover - depends on the installed extras
    raise ImportError(
        "oncely.integrations.django needs Django: pip install 'oncely[django]'"
    ) from exc

from oncely.integrations.django.atomic import handle_in_atomic, handle_message_in_atomic
from oncely.integrations.django.databases import get_inbox, get_store, store_url

__all__ = [
    "get_inbox",
    "get_store",
    "handle_in_atomic",
    "handle_message_in_atomic",
    "store_url",
]

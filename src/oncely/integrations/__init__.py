"""Integrations of oncely with the libraries around it.

- :mod:`oncely.integrations.celery`: a Celery Task base class: each task runs once per
  business key (or a key the producer names); duplicates return the first result, refusals
  and unreadable messages dead-lettered with a reason.
- :mod:`oncely.integrations.taskiq`: a taskiq broker middleware and worker receiver: each
  task that declares an ``idempotency_key`` runs once per key; refusals and unparseable
  messages dead-lettered with a reason.
- :mod:`oncely.integrations.dramatiq`: a Dramatiq middleware: each actor that declares an
  ``idempotency_key`` runs once per key; duplicates skipped, refusals dead-lettered with a
  reason.
- :mod:`oncely.integrations.faststream`: a FastStream broker middleware (RabbitMQ): each
  message claimed by the producer's id before FastStream decodes it; duplicates acknowledged,
  refusals dead-lettered with a reason.
- :mod:`oncely.integrations.entity`: the business entity as the dedup marker on SQLAlchemy 2
  (R6, R20-R22): no inbox table, the entity's unique key is the dedup key.
- :mod:`oncely.integrations.django`: the ``Idempotency-Key`` layer as a Django middleware and
  a view decorator.
- :mod:`oncely.integrations.fastapi`: idempotent FastAPI routes, chosen per route with a
  dependency (the ``Idempotency-Key`` middleware of :mod:`oncely.http` in front of each).
- :mod:`oncely.integrations.sqlalchemy`: the transactional mode inside a caller's SQLAlchemy
  ``Session`` / ``AsyncSession`` (or Core ``Connection``), so ORM writes and the marker commit
  together (R7), on PostgreSQL, MariaDB/MySQL and SQLite.

Each module imports its library on import; install the matching extra
(``oncely[sqlalchemy]``, ``oncely[fastapi]``, ``oncely[django]``,
``oncely[celery]``, ``oncely[taskiq]``, ``oncely[dramatiq]``, ``oncely[faststream]``).
"""

"""The Redis store beyond the shared contract: URLs, the key layout, clients, error translation,
round trips, expiry on Redis's clock and on a given one, the reference model, and real
processes racing and dying, and a real restart of the server, on the machine's Redis and on a
three-node Redis Cluster that the session starts itself (:mod:`tests.redis_cluster`).

The whole contract suite runs on both through ``tests/backends/redis.py`` and
``tests/backends/redis_cluster.py`` (``pytest tests/contract -k redis``).
"""

"""Client CPU of a Redis claim and completion, kernel against Python socket timeouts:
python bench/redis_socket_timeouts.py

Two threaded ``RedisStore`` objects on the Redis at ``ONCELY_BENCH_REDIS_URL`` (or
``ONCELY_TEST_REDIS_URL``, default ``redis://127.0.0.1:6379/0``), the same URL and timeout:

- ``kernel``: the store as shipped on Linux, blocking sockets that the kernel times out
  (``SO_RCVTIMEO`` / ``SO_SNDTIMEO``): one system call per send and per receive;
- ``python``: the same store built while that is switched off, so redis-py sets a Python socket
  timeout and CPython polls the socket before every send and receive.

Each round runs ``MESSAGES`` claims and completions of fresh keys on each store, in alternating
order, and the medians of the per-message wall time and process CPU (``time.process_time``)
are printed. Every key is deleted at the end.
"""

from __future__ import annotations

import itertools
import os
import statistics
import sys
import time
import uuid

import redis

import oncely
from oncely.stores.redis import sync_io as _redis_io

URL = os.environ.get(
    "ONCELY_BENCH_REDIS_URL",
    os.environ.get("ONCELY_TEST_REDIS_URL", "redis://127.0.0.1:6379/0"),
)
MESSAGES = 300
ROUNDS = 21
FP = "v1:" + "f" * 32


def open_store(prefix: str, kernel: bool) -> oncely.RedisStore:
    saved = _redis_io._KERNEL_TIMEOUTS
    _redis_io._KERNEL_TIMEOUTS = kernel  # read when the store builds its client (first use)
    try:
        store = oncely.open(f"{URL}?prefix={prefix}")
        assert isinstance(store, oncely.RedisStore)
        store.migrate()
    finally:
        _redis_io._KERNEL_TIMEOUTS = saved
    return store


def work(store: oncely.RedisStore, numbers: itertools.count[int]) -> None:
    for _ in range(MESSAGES):
        n = next(numbers)
        key, token = f"k{n}", f"t{n:016x}"
        store.claim(
            "c", key, fingerprint=FP, token=token, lease_ms=30_000, keep_ms=600_000, takeover=True
        )
        store.complete("c", key, token=token, result=b"ok", keep_ms=600_000)


def main() -> None:
    if sys.platform != "linux":
        sys.exit("the store uses kernel socket timeouts on Linux only")
    run = uuid.uuid4().hex[:8]
    prefixes = {"kernel": f"oncelysock{run}k", "python": f"oncelysock{run}p"}
    stores = {name: open_store(prefix, name == "kernel") for name, prefix in prefixes.items()}
    numbers = itertools.count()
    samples: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in stores}
    try:
        for store in stores.values():
            work(store, numbers)  # warm-up: connections, scripts
        for r in range(ROUNDS):
            order = list(stores) if r % 2 else list(reversed(stores))
            for name in order:
                wall, cpu = time.perf_counter(), time.process_time()
                work(stores[name], numbers)
                samples[name][0].append((time.perf_counter() - wall) / MESSAGES * 1e6)
                samples[name][1].append((time.process_time() - cpu) / MESSAGES * 1e6)
    finally:
        admin = redis.Redis.from_url(URL)
        for prefix in prefixes.values():
            for name in admin.scan_iter(match=f"{prefix}*", count=1000):
                admin.unlink(name)
        for store in stores.values():
            store.close()
    print(f"claim + complete, medians of {ROUNDS} alternating rounds of {MESSAGES} messages")
    for name, (wall, cpu) in samples.items():
        print(
            f"{name:7s} socket timeouts: {statistics.median(wall):7.1f} us wall, "
            f"{statistics.median(cpu):6.1f} us client CPU per message"
        )


if __name__ == "__main__":
    main()

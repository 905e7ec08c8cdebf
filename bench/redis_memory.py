"""What one dedup record costs in Redis memory: python bench/redis_memory.py [--records N]

Writes N completed records in oncely's shape (36-character uuid keys, a real fingerprint, a
100-byte result, a week of retention) through the real ``RedisStore`` (a batch claim, then a
completion per key) under a prefix of its own on the Redis at ``ONCELY_BENCH_REDIS_URL`` (or
``ONCELY_TEST_REDIS_URL``, default ``redis://127.0.0.1:6379/0``), and reports:

- the growth of the server's ``used_memory`` per record (what a sizing needs: the key, the
  value, the dictionary entry and the expiry entry, allocator rounding included);
- ``MEMORY USAGE`` of a sample of the keys (the key and value alone), for comparison.

Every key is deleted at the end. Other clients writing to the same server meanwhile blur the
first figure; the second is per key and is not affected.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import uuid

import redis

import oncely
from oncely.stores import ClaimRequest

URL = os.environ.get(
    "ONCELY_BENCH_REDIS_URL",
    os.environ.get("ONCELY_TEST_REDIS_URL", "redis://127.0.0.1:6379/0"),
)
KEEP_MS = 7 * 86_400_000
RESULT = b'{"charged": 1999, "currency": "EUR", "receipt": "' + b"r" * 49 + b'"}'
BATCH = 500


def used_memory(client: redis.Redis) -> int:
    return int(client.info("memory")["used_memory"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--records", type=int, default=200_000)
    args = parser.parse_args()
    prefix = f"oncely_mem_{os.urandom(3).hex()}"
    client = redis.Redis.from_url(URL)
    store = oncely.RedisStore.from_url(f"{URL}?prefix={prefix}")
    fp = oncely.fingerprint({"order": 1, "amount": 1999})
    assert len(RESULT) == 100
    names: list[bytes] = []
    try:
        before = used_memory(client)
        started = time.perf_counter()
        keys: list[str] = []
        for _ in range(0, args.records, BATCH):
            batch = [ClaimRequest(str(uuid.uuid4()), fp, uuid.uuid4().hex) for _ in range(BATCH)]
            store.claim_many("billing", batch, lease_ms=30_000, keep_ms=KEEP_MS, takeover=False)
            for request in batch:
                store.complete(
                    "billing", request.key, token=request.token, result=RESULT, keep_ms=KEEP_MS
                )
            keys.extend(r.key for r in batch)
        written = time.perf_counter() - started
        grown = used_memory(client) - before
        names = list(client.scan_iter(match=f"{prefix}*", count=1000))
        sample = names[:: max(1, len(names) // 2000)]
        usage = [int(client.memory_usage(name) or 0) for name in sample]
        info = client.info("server")
        print(f"Redis {info['redis_version']}, {len(keys):,} records written in {written:.0f} s")
        print(f"used_memory growth per record: {grown / len(keys):.0f} bytes")
        print(
            f"MEMORY USAGE per key (sample of {len(sample)}): median "
            f"{statistics.median(usage):.0f}, max {max(usage)} bytes; key length "
            f"{len(names[0])} bytes"
        )
        print(f"records per GiB of used_memory: {2**30 / (grown / len(keys)):,.0f}")
    finally:
        names = names or list(client.scan_iter(match=f"{prefix}*", count=1000))
        for start in range(0, len(names), 1000):
            client.delete(*names[start : start + 1000])
        store.close()


if __name__ == "__main__":
    main()

"""What one key of a batch claim costs the Redis server: python bench/redis_server_cost.py

Claims fresh keys on the Redis at ``ONCELY_BENCH_REDIS_URL`` (or ``ONCELY_TEST_REDIS_URL``,
default ``redis://127.0.0.1:6379/0``) in batches of 100, three ways, and reads the server's
own time per call from ``INFO commandstats`` (the time Redis spent executing, no network and
no client):

- ``claim_many``: oncely's batch claim script (``RedisStore.claim_many``), one ``EVALSHA``;
- ``SET NX GET PXAT``, Lua: a script that does only that command per key, nothing else;
- ``SET NX GET PXAT``, pipelined: the same command sent 100 times in one pipeline, no Lua.

The last is the least any batch claim of one Redis key per record can ask of the server. Next
to it the script's per-key cost shows what oncely's Lua adds, and against the time of a whole
single claim (a round trip) it bounds how far a batch of 100 can outrun single claims on this
machine. Every key is deleted at the end.
"""

from __future__ import annotations

import itertools
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
BATCH = 100
CALLS = 200
ROUNDS = 5
KEEP_MS = 3_600_000
FP = "v1:" + "f" * 32

SET_ONLY = """
local t = redis.call('TIME')
local expires = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) + tonumber(ARGV[1])
for n, k in ipairs(KEYS) do
  redis.call('SET', k, ARGV[1 + n], 'NX', 'GET', 'PXAT', expires)
end
return #KEYS
"""


def server_us_per_call(client: redis.Redis, command: str) -> float:
    stats = client.info("commandstats").get(f"cmdstat_{command}")
    return float(stats["usec_per_call"]) if stats else 0.0


def main() -> None:
    run = uuid.uuid4().hex[:8]
    prefix = f"oncelysrvcost{run}"
    client = redis.Redis.from_url(URL)
    store = oncely.open(f"{URL}?prefix={prefix}")
    set_only = client.script_load(SET_ONLY)
    # A record's value, about the size of a new record of the store's: the plain commands
    # write what the script would.
    value = b"in_progress 1 0 0 0 0 35 32 -1 -1\n" + FP.encode() + uuid.uuid4().hex.encode()
    count = itertools.count()

    def names(tag: str) -> list[bytes]:
        return [f"{prefix}:{tag}:{{{next(count)}}}".encode() for _ in range(BATCH)]

    def by_store() -> None:
        requests = [ClaimRequest(f"k{next(count)}", FP, uuid.uuid4().hex) for _ in range(BATCH)]
        store.claim_many("cost", requests, lease_ms=30_000, keep_ms=KEEP_MS, takeover=True)

    def by_lua() -> None:
        client.evalsha(set_only, BATCH, *names("lua"), KEEP_MS, *([value] * BATCH))

    def by_pipeline() -> None:
        expires = int(time.time() * 1000) + KEEP_MS
        pipe = client.pipeline(transaction=False)
        for name in names("pipe"):
            pipe.set(name, value, nx=True, get=True, pxat=expires)
        pipe.execute()

    def single() -> float:
        started = time.perf_counter()
        for _ in range(BATCH):
            store.claim(
                "cost", f"s{next(count)}", fingerprint=FP, token=uuid.uuid4().hex,
                lease_ms=30_000, keep_ms=KEEP_MS, takeover=True,
            )  # fmt: skip
        return (time.perf_counter() - started) / BATCH * 1e6

    cases = (
        ("claim_many (oncely's script)", by_store, "evalsha"),
        ("SET NX GET PXAT, Lua", by_lua, "evalsha"),
        ("SET NX GET PXAT, pipelined", by_pipeline, "set"),
    )
    results: dict[str, list[float]] = {name: [] for name, _, _ in cases}
    singles: list[float] = []
    try:
        for f in (by_store, by_lua, by_pipeline):
            f()  # load the scripts, open the connections
        for _ in range(ROUNDS):
            for name, f, command in cases:
                client.config_resetstat()
                for _ in range(CALLS):
                    f()
                per_call = server_us_per_call(client, command)
                results[name].append(per_call if command == "set" else per_call / BATCH)
            singles.append(single())
    finally:
        store.close()
        for name in client.scan_iter(match=f"{prefix}*", count=1000):
            client.unlink(name)
        client.close()
    print(f"Redis server time per key, batches of {BATCH}, median of {ROUNDS} rounds")
    print(f"(INFO commandstats; {URL})\n")
    for name, values in results.items():
        print(f"  {name:32s} {statistics.median(values):6.2f} us per key")
    whole = statistics.median(singles)
    print(f"\n  one single claim, wall time (round trip included): {whole:6.1f} us")
    floor = statistics.median(results["SET NX GET PXAT, pipelined"])
    print(f"  single claim / pipelined SET server time: {whole / floor:5.1f}x (an upper bound")
    print("  for a batch's speed-up over single claims, before any client work)")


if __name__ == "__main__":
    main()

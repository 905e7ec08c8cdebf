"""The Redis case of the servers section (``bench/servers.py``): oncely's store (redis-py)
against its Lua scripts run by hand (``EVALSHA``), AWS Lambda Powertools' idempotency on the
same server (:mod:`powertools_case`), and batch claims."""

from __future__ import annotations

from typing import Any

from cases import BenchError, Resources, trivial
from powertools_case import PowertoolsCase, powertools_version
from server_common import (
    FP,
    KEEP_MS,
    LEASE_MS,
    REDIS_URL,
    RUN,
    Group,
    Server,
    Tokens,
    Variant,
    batch_group,
    driver,
    oncely_variants,
    with_option,
)
from server_trips import Trips, counting_redis_client

import oncely
from oncely.stores.redis import dialect as redis_dialect


class Redis(Server):
    name = "Redis"
    port = 6379
    driver = "redis"
    module = "oncely.stores.redis.sync_store"

    def __init__(self, tag: str = "") -> None:
        # Powertools' key is a hash of the payload alone, and every Keys() starts its payloads
        # at order(0): a second instance (the profile) needs prefixes of its own.
        self.url = REDIS_URL
        self.prefix = f"oncelybench{tag}{RUN}"
        self.raw_prefix = f"oncelybenchraw{tag}{RUN}"
        self.pt_prefix = f"ptbench{tag}{RUN}"
        self.powertools = powertools_version()

    def client(self, trips: Trips | None, *, decode_responses: bool = False) -> Any:
        if trips is not None:
            return counting_redis_client(self.url, trips, decode_responses=decode_responses)
        return driver("redis").Redis.from_url(self.url, decode_responses=decode_responses)

    def groups(self, res: Resources, trips: Trips | None) -> list[Group]:
        claim_script, complete_script = redis_dialect.CLAIM, redis_dialect.COMPLETE
        if trips is None:
            store = oncely.open(with_option(self.url, "prefix", self.prefix))
        else:
            counted_client = self.client(trips)
            res.add(counted_client.close)
            store = oncely.RedisStore(counted_client, prefix=self.prefix)
        res.add(store.close)
        inbox = oncely.Inbox(store, consumer="twophase")
        res.add(inbox.close)

        raw = self.client(trips)
        res.add(raw.close)
        raw.script_load(claim_script.text)
        raw.script_load(complete_script.text)
        keys = redis_dialect.RedisKeys(self.raw_prefix)
        tokens = Tokens()
        fp = redis_dialect.opt(FP)
        claim_sha, complete_sha = claim_script.sha, complete_script.sha

        def raw_new(msgs: list[tuple[str, Any]]) -> None:
            for k, p in msgs:
                name = keys.record("raw", k)
                token = tokens()
                reply = raw.evalsha(
                    claim_sha, 1, name, b"", LEASE_MS, KEEP_MS, b"1", b"", fp, token
                )
                if reply[0][0] != b"new":
                    raise BenchError(f"raw claim of new key {k!r}: {reply[0][0]!r}")
                trivial(p)
                done = raw.evalsha(complete_sha, 1, name, b"", token, KEEP_MS, b"", b"")
                if done[0] != b"ok":
                    raise BenchError(f"raw complete of {k!r}: {done[0]!r}")

        def raw_dup(msgs: list[tuple[str, Any]]) -> None:
            for k, _p in msgs:
                reply = raw.evalsha(
                    claim_sha,
                    1,
                    keys.record("raw", k),
                    b"",
                    LEASE_MS,
                    KEEP_MS,
                    b"1",
                    b"",
                    fp,
                    tokens(),
                )
                if reply[0][0] != b"existing" or reply[0][2] != b"completed":
                    raise BenchError(f"raw claim of completed key {k!r}: {reply[0][:3]!r}")

        variants = [Variant("raw", raw_new, raw_dup), oncely_variants(inbox)]
        if self.powertools is not None:
            pt_client = self.client(trips, decode_responses=True)
            res.add(pt_client.close)
            case = PowertoolsCase(pt_client, self.pt_prefix)
            variants.append(Variant("Powertools", case.new, case.dup))
        twophase = Group(self.name, "twophase", variants)
        batch = batch_group(self.name, store)
        return [twophase, batch]

    def version(self) -> str:
        client = self.client(None)
        try:
            return str(client.info("server")["redis_version"])
        finally:
            client.close()

    def cleanup(self) -> None:
        client = self.client(None)
        try:
            for pattern in (f"{self.prefix}:*", f"{self.raw_prefix}:*", f"{self.pt_prefix}#*"):
                batch: list[bytes] = []
                for name in client.scan_iter(match=pattern, count=1000):
                    batch.append(name)
                    if len(batch) >= 1000:
                        client.unlink(*batch)
                        batch.clear()
                if batch:
                    client.unlink(*batch)
        finally:
            client.close()

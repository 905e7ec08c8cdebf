"""The Redis key layout, and the compact script replies and the store's own command packing:
records rebuilt from them equal the ones Redis holds."""

from __future__ import annotations

import uuid
from datetime import timedelta

import pytest
import redis
import redis.asyncio
import redis.connection
from hypothesis import given, settings
from hypothesis import strategies as st

import oncely
from oncely import FakeClock
from oncely._core.records import ClaimRequest
from oncely.stores import ClaimStatus
from oncely.stores.redis.async_store import AsyncRedisStore
from oncely.stores.redis.dialect import RedisKeys, _quote, parse_claim
from oncely.stores.redis.errors import pack_evalsha, slot_of
from oncely.stores.redis.sync_store import RedisStore
from tests.backends.redis import with_options
from tests.stores.redis.helpers import KEEP_MS, LEASE_MS, _url_for

# ------------------------------------------------------------------------- key layout

NAMES = st.text(alphabet=st.characters(exclude_categories=("Cs",)), min_size=1, max_size=40)


@settings(max_examples=300, deadline=None)
@given(consumer=NAMES, key=NAMES)
def test_record_names_are_reversible_and_hold_exactly_one_hash_tag(consumer: str, key: str) -> None:
    keys = RedisKeys("oncely")
    name = keys.record(consumer, key)
    assert keys.ident(name) == (consumer, key)
    text = name.decode()
    # One "{" and one "}": the whole escaped (consumer, key) is the tag, whatever they hold.
    assert text.count("{") == 1 and text.count("}") == 1 and text.endswith("}")


@given(st.text(alphabet="%{}:ab", max_size=12) | NAMES)
def test_record_names_escape_as_they_always_have(text: str) -> None:
    """The escaping of consumer and key (each character tested before it is replaced) names
    every record as the four replaces in a row did: stored keys keep their names."""
    escaped = text.replace("%", "%25").replace("{", "%7B").replace("}", "%7D").replace(":", "%3A")
    assert _quote(text) == escaped


def test_a_key_cannot_pick_its_own_slot() -> None:
    keys = RedisKeys("p")
    # Were the key's braces left as they are, "{same}" would be the hash tag of all of them.
    slots = {slot_of(keys.record("billing", f"{{same}}-{i}")) for i in range(64)}
    assert len(slots) > 48
    assert slot_of(keys.record("{x}", "a")) != slot_of(keys.record("{x}", "b"))


@pytest.mark.services
@pytest.mark.parametrize("where", ["redis", "redis-cluster"])
def test_keys_with_braces_colons_globs_and_spaces_stay_apart(
    where: str, prefix: str, request: pytest.FixtureRequest
) -> None:
    url = _url_for(where, request)
    store = oncely.open(with_options(url, prefix=prefix))
    pairs = [
        ("a", "k"),
        ("a*", "k"),
        ("a:b", "c"),
        ("a", "b:c"),
        ("{a}", "}{"),
        ("a b", "% 7B"),
        ("a?", "[x]"),
        ("a\\", "*"),
    ]
    try:
        for i, (consumer, key) in enumerate(pairs):
            claim = store.claim(
                consumer, key, fingerprint=None, token=f"t{i}", lease_ms=LEASE_MS,
                keep_ms=KEEP_MS, takeover=False,
            )  # fmt: skip
            assert claim.status is ClaimStatus.NEW, (consumer, key)
        for i, (consumer, key) in enumerate(pairs):
            record = store.get(consumer, key)
            assert record is not None and record.token == f"t{i}"
        assert [(r.consumer, r.key) for r in store.scan(limit=100)] == sorted(pairs)
        for consumer in ("a", "a*", "a?", "a\\", "{a}"):
            found = [(r.consumer, r.key) for r in store.scan(consumer=consumer)]
            assert found == sorted(p for p in pairs if p[0] == consumer), consumer
        assert store.forget("a*", "k") and store.get("a", "k") is not None
    finally:
        store.close()


# --------------------------------------------------------------- compact replies, own packing

# Values that could confuse a reply format: spaces, newlines, separators, any script, empty.
_AWKWARD = st.text(
    alphabet=st.sampled_from([*" \n\r\t-1e+%:{}ab", "\u00e9", "\u4e2d", "\U0001f600"]),
    max_size=10,
)
_BYTES = st.binary(max_size=12) | st.sampled_from([b"", b" ", b"\n", b"1 2 3\n", b"\r\n"])


def _rebuilt_scenario(
    store: RedisStore,
    clock: FakeClock | None,
    key: str,
    values: tuple[str | None, str, bytes | None, str | None, str | None, bool],
) -> None:
    """Every reply shape against the record Redis holds (read back whole by ``get``)."""
    fingerprint, token, result, note, other, fail = values
    c = "replies"

    def held() -> oncely.Record | None:
        return store.get(c, key)

    # lease 0: stale at once on any clock, so the takeover needs no waiting
    first = store.claim(
        c, key, fingerprint=fingerprint, token=f"{token}#1", lease_ms=0, keep_ms=KEEP_MS,
        takeover=True,
    )  # fmt: skip
    assert first.status is ClaimStatus.NEW and first.record == held()
    again = store.claim(
        c, key, fingerprint=other, token=f"{token}#2", lease_ms=LEASE_MS, keep_ms=KEEP_MS,
        takeover=False,
    )  # fmt: skip
    assert again.status is ClaimStatus.EXISTING and again.record == held() == first.record
    if clock is not None:
        clock.advance(timedelta(milliseconds=5))
    taken = store.claim(
        c, key, fingerprint=None, token=f"{token}#3", lease_ms=LEASE_MS, keep_ms=KEEP_MS,
        takeover=True,
    )  # fmt: skip
    assert taken.status is ClaimStatus.TAKEN_OVER and taken.record == held()
    assert taken.record.fingerprint == fingerprint and taken.record.attempt == 2
    with pytest.raises(oncely.LeaseLost) as lost:
        store.renew(c, key, token=f"{token}#1", lease_ms=LEASE_MS, keep_ms=KEEP_MS)
    assert lost.value.current == held()
    renewed = store.renew(c, key, token=f"{token}#3", lease_ms=2 * LEASE_MS, keep_ms=KEEP_MS)
    assert renewed == held() and renewed.lease_until_ms == renewed.updated_ms + 2 * LEASE_MS
    if fail:
        done = store.fail(c, key, token=f"{token}#3", error=note or "", keep_ms=KEEP_MS)
        repeat = store.fail(c, key, token=f"{token}#3", error="other", keep_ms=1)
    else:
        done = store.complete(c, key, token=f"{token}#3", result=result, keep_ms=KEEP_MS, note=note)
        repeat = store.complete(c, key, token=f"{token}#3", result=b"x", keep_ms=1)
    assert done == held() == repeat
    store.claim(
        c, f"{key}-c", fingerprint=other, token=f"{token}#7", lease_ms=0, keep_ms=KEEP_MS,
        takeover=False,
    )  # fmt: skip
    batch = store.claim_many(
        c,
        [
            ClaimRequest(key, fingerprint, f"{token}#4"),
            ClaimRequest(f"{key}-c", None, f"{token}#8"),
            ClaimRequest(f"{key}-b", other, f"{token}#5"),
            ClaimRequest(f"{key}-b", other, f"{token}#6"),
        ],
        lease_ms=LEASE_MS,
        keep_ms=1,  # shorter than the lease: the record lives as long as its lease
        takeover=True,
    )
    assert [claim.status for claim in batch] == [
        ClaimStatus.EXISTING, ClaimStatus.TAKEN_OVER, ClaimStatus.NEW, ClaimStatus.EXISTING,
    ]  # fmt: skip
    assert batch[0].record == done
    assert batch[1].record == store.get(c, f"{key}-c") and batch[1].record.fingerprint == other
    assert batch[2].record == batch[3].record == store.get(c, f"{key}-b")
    assert batch[2].record.fingerprint == other and batch[3].record.token == f"{token}#5"


@pytest.mark.services
@pytest.mark.timeout(60)
@pytest.mark.parametrize("clocked", [False, True], ids=["server-clock", "given-clock"])
def test_replies_rebuild_exactly_the_record_redis_holds(
    redis_url: str, prefix: str, clocked: bool
) -> None:
    """Scripts answer a new claim with a code and a write with a few fields (the store builds
    the rest from what it sent), and a record the caller cannot know as two values. Whatever the
    fingerprints, tokens, results and notes hold, every record a call returns equals the one
    Redis then holds, field for field."""
    client = redis.Redis.from_url(redis_url)
    clock = FakeClock() if clocked else None
    store = RedisStore(client, prefix=prefix, clock=clock)
    optional = st.none() | _AWKWARD

    @settings(max_examples=40, deadline=None)
    @given(st.tuples(optional, _AWKWARD, st.none() | _BYTES, optional, optional, st.booleans()))
    def check(values: tuple[str | None, str, bytes | None, str | None, str | None, bool]) -> None:
        _rebuilt_scenario(store, clock, uuid.uuid4().hex, values)

    try:
        check()
    finally:
        store.close()
        client.close()


@pytest.mark.services
async def test_the_asyncio_store_rebuilds_the_same_records(redis_url: str, prefix: str) -> None:
    client = redis.asyncio.Redis.from_url(redis_url)
    store = AsyncRedisStore(client, prefix=prefix)
    c, key, fp = "replies", "k", "f 1\n\u00e9"
    claim = await store.claim(
        c, key, fingerprint=fp, token="t 1", lease_ms=LEASE_MS, keep_ms=KEEP_MS, takeover=False
    )
    assert claim.status is ClaimStatus.NEW and claim.record == await store.get(c, key)
    renewed = await store.renew(c, key, token="t 1", lease_ms=LEASE_MS, keep_ms=KEEP_MS)
    assert renewed == await store.get(c, key)
    done = await store.complete(c, key, token="t 1", result=b"\n1 2\n", keep_ms=1_000, note="a\nb")
    assert done == await store.get(c, key) and done.result == b"\n1 2\n"
    batch = await store.claim_many(
        c, [ClaimRequest(key, fp, "t 2"), ClaimRequest("k2", None, "t 3")],
        lease_ms=LEASE_MS, keep_ms=KEEP_MS, takeover=True,
    )  # fmt: skip
    assert [b.status for b in batch] == [ClaimStatus.EXISTING, ClaimStatus.NEW]
    assert batch[0].record == done and batch[1].record == await store.get(c, "k2")
    await store.aclose()
    await client.aclose()


@given(
    st.lists(st.binary(max_size=40), min_size=1, max_size=4),
    st.lists(st.binary(max_size=40), max_size=20),
)
def test_the_stores_own_packing_is_the_redis_protocol(keys: list[bytes], args: list[bytes]) -> None:
    """The store packs EVALSHA itself; byte for byte what redis-py would send (calls of up to
    16 values by a format of their shape, longer ones part by part)."""
    sha = b"0123456789abcdef0123456789abcdef01234567"
    sent = redis.connection.Connection().pack_command("EVALSHA", sha, len(keys), *keys, *args)
    assert pack_evalsha(sha, keys, args) == b"".join(sent)


@pytest.mark.parametrize(
    ("status", "attempt", "stored_token", "claimed"),
    [
        (b"completed", 1, "t1", ClaimStatus.EXISTING),  # a replay
        (b"in_progress", 1, "xx", ClaimStatus.EXISTING),  # someone else's claim
        (b"in_progress", 1, "t1", ClaimStatus.NEW),  # this very claim, sent twice
        (b"in_progress", 2, "t1", ClaimStatus.TAKEN_OVER),
        (b"failed", 1, "t1", ClaimStatus.EXISTING),
    ],
)
def test_an_existing_record_in_a_claim_reply_is_read_whole(
    status: bytes, attempt: int, stored_token: str, claimed: ClaimStatus
) -> None:
    """A claim (token ``t1``) answered ``existing``: the record as stored; the claim's own
    in-progress record (an earlier send of it landed) is the claim won."""
    packed = b"%d 10 11 12 13 2 2 2 -1\nfp%sok" % (attempt, stored_token.encode())
    claim = parse_claim("c", "k", "fp", "t1", 5, 9, [[b"existing", 11, status, packed]])
    assert claim.status is claimed and claim.now_ms == 11
    record = claim.record
    assert (record.status.value.encode(), record.attempt, record.token) == (
        status, attempt, stored_token,
    )  # fmt: skip
    assert (record.fingerprint, record.result, record.error) == ("fp", b"ok", None)
    assert (record.created_ms, record.updated_ms, record.lease_until_ms) == (10, 11, 12)

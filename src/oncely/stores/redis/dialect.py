"""Redis: the key layout of the store's records, and the parser of the scripts' replies.

The scripts themselves (one per operation of the store contract, each atomic) are in
:mod:`oncely.stores.redis.lua`, re-exported here.

Layout. One string per record, ``<prefix>:{<consumer>:<key>}``: ``"s a c u l e #f #t #r
#x"`` (status, attempt, created, updated, lease until, expires, then the byte lengths of
fingerprint, token, result and error, -1 for a missing one), a newline, then fingerprint, token,
result and error back to back. A free key is claimed with one command (``SET NX GET PXAT``:
the new record, or the one already there), which is most of what a batch claim costs the
server. The braces are a Redis Cluster hash tag over the whole record name:
records spread over every slot, so one busy consumer uses the whole cluster instead of one node
(a per-consumer tag would pin a consumer's records, its memory and all of its traffic to one
slot, which a cluster can never split). A script touches one key, except a batch claim on a
single Redis (no slots) and a cluster batch's per-slot groups. Consumer and key are escaped
(``%`` ``{`` ``}`` ``:`` as ``%XX``), so the name is unambiguous and reversible and no key can
open or close a hash tag of its own. The schema version lives in ``<prefix>:meta``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final
from urllib.parse import unquote

from oncely._core.records import (
    Claim,
    ClaimRequest,
    ClaimStatus,
    Record,
    Status,
    new_claim,
    new_record,
)
from oncely.stores._sql import check_identifier
from oncely.stores.redis.lua import (
    CLAIM,
    CLAIM_MANY,
    COMPLETE,
    FAIL,
    FORGET,
    GET,
    PURGE,
    READ,
    RELEASE,
    RENEW,
    Script,
)

__all__ = [
    "CLAIM",
    "CLAIM_MANY",
    "COMPLETE",
    "FAIL",
    "FORGET",
    "GET",
    "PURGE",
    "READ",
    "RELEASE",
    "RENEW",
    "SCHEMA_VERSION",
    "RedisKeys",
    "Script",
    "opt",
    "parse_batch",
    "parse_claim",
    "parse_record",
    "parse_reply",
    "parse_stored",
    "parse_written",
    "stored_status",
]

SCHEMA_VERSION: Final = 1

_STATUS = {s.value.encode(): s for s in Status}


def _quote(text: str) -> str:
    # Speed: most keys hold none of the four, and an HTTP key (``http:<who>:<method>:...``)
    # colons alone: a membership test costs less than a replace that finds nothing (0.12 us
    # instead of 0.22 for an HTTP key). ``%`` goes first, as the escapes hold it.
    if "%" in text:
        text = text.replace("%", "%25")
    if "{" in text:
        text = text.replace("{", "%7B")
    if "}" in text:
        text = text.replace("}", "%7D")
    if ":" in text:
        text = text.replace(":", "%3A")
    return text


def _glob(text: str) -> str:
    """``text`` with Redis glob metacharacters escaped, for ``SCAN MATCH``."""
    for char in "\\*?[]":
        text = text.replace(char, "\\" + char)
    return text


class RedisKeys:
    """The key names of one store: ``<prefix>:{<consumer>:<key>}`` and ``<prefix>:meta``."""

    __slots__ = ("_head", "_heads", "meta", "pattern", "prefix")

    def __init__(self, prefix: str = "oncely") -> None:
        # A plain identifier: no braces (a hash tag of its own), no glob characters.
        self.prefix = check_identifier(prefix)
        self._head = f"{prefix}:{{"
        self._heads: dict[str, str] = {}  # consumer -> "<prefix>:{<consumer>:" (few consumers)
        self.meta = f"{prefix}:meta".encode()
        self.pattern = f"{prefix}:{{*".encode()
        """``SCAN MATCH`` pattern of every record of the store."""

    def record(self, consumer: str, key: str) -> bytes:
        return f"{self._consumer_head(consumer)}{_quote(key)}}}".encode()

    def _consumer_head(self, consumer: str) -> str:
        head = self._heads.get(consumer)
        if head is None:
            head = f"{self._head}{_quote(consumer)}:"
            if len(self._heads) < 1024:
                self._heads[consumer] = head
        return head

    def claim_batch(
        self, consumer: str, requests: Sequence[ClaimRequest]
    ) -> tuple[list[bytes], list[bytes]]:
        """The record names of ``requests`` and their ``CLAIM_MANY`` arguments, in request
        order, in one pass without a call per key. A key's argument is the tail of the new
        record it asks for (``"#f #t -1 -1"``, a newline, fingerprint and token), which the
        script stores as it is."""
        head = self._consumer_head(consumer)
        names: list[bytes] = []
        tails: list[bytes] = []
        name, tail = names.append, tails.append
        for r in requests:
            key, fp, token = r.key, r.fingerprint, r.token.encode()
            if "%" in key or "{" in key or "}" in key or ":" in key:
                key = _quote(key)
            name(f"{head}{key}}}".encode())
            if fp is None:
                tail(b"-1 %d -1 -1\n%s" % (len(token), token))
            else:
                f = fp.encode()
                tail(b"%d %d -1 -1\n%s%s" % (len(f), len(token), f, token))
        return names, tails

    def consumer_pattern(self, consumer: str) -> bytes:
        """``SCAN MATCH`` pattern of one consumer's records."""
        return f"{_glob(self._head)}{_glob(_quote(consumer))}:*".encode()

    def ident(self, name: bytes) -> tuple[str, str] | None:
        """``(consumer, key)`` of a record name, or None for a name that is not one."""
        text = name.decode("utf-8", "surrogateescape")
        if not (text.startswith(self._head) and text.endswith("}")):
            return None
        consumer, sep, key = text[len(self._head) : -1].partition(":")
        if not sep:
            return None
        return unquote(consumer), unquote(key)


def opt(value: str | bytes | None) -> bytes:
    """An optional script argument: ``b""`` for None, else one marker byte and the value."""
    if value is None:
        return b""
    return b"+" + (value.encode() if isinstance(value, str) else value)


def parse_stored(consumer: str, key: str, stored: bytes) -> Record:
    """The record of its stored string (the ``READ`` script's answer)."""
    status, _, packed = bytes(stored).partition(b" ")
    return parse_record(consumer, key, status, packed)


def stored_status(stored: bytes) -> tuple[Status, int]:
    """``(status, expires)`` of a stored string, without the rest of the record."""
    status, _a, _c, _u, _l, expires, _ = bytes(stored).split(b" ", 6)
    return _STATUS[status], int(expires)


def parse_record(consumer: str, key: str, status: bytes, packed: bytes) -> Record:
    """The record of a script's ``status`` and ``packed`` values."""
    head, _, body = packed.partition(b"\n")
    attempt, created, updated, lease, expires, nf, nt, nr, nx = map(int, head.split(b" "))
    fingerprint = None
    if nf >= 0:
        fingerprint = body[:nf].decode()
    i = max(nf, 0)
    token = body[i : i + nt].decode()
    i += nt
    result = None
    if nr >= 0:
        result = body[i : i + nr]
        i += nr
    error = None if nx < 0 else body[i : i + nx].decode()
    return new_record(
        consumer, key, _STATUS[status], fingerprint, token, attempt, created, updated, lease,
        expires, result, error,
    )  # fmt: skip


def parse_reply(consumer: str, key: str, reply: Sequence[Any]) -> tuple[bytes, int, Record | None]:
    """``(code, now, record)`` of a ``{code, now[, status, packed]}`` reply."""
    record = parse_record(consumer, key, reply[2], reply[3]) if len(reply) > 3 else None
    return reply[0], int(reply[1]), record


def _brief(brief: bytes) -> tuple[int, int, int, str | None]:
    """``(attempt, created, lease_until, fingerprint)`` of a brief."""
    parts = brief.split(b" ", 3)
    fingerprint = parts[3].decode() if len(parts) > 3 else None
    return int(parts[0]), int(parts[1]), int(parts[2]), fingerprint


def parse_written(
    consumer: str,
    key: str,
    brief: bytes,
    *,
    status: Status,
    token: str,
    now: int,
    expires: int,
    lease_until: int | None = None,
    result: bytes | None = None,
    error: str | None = None,
) -> Record:
    """The record a fenced write (complete, fail, renew) just wrote: what the call sent, plus
    the fields of ``brief``. ``lease_until`` None keeps the record's."""
    attempt, created, lease, fingerprint = _brief(brief)
    return new_record(
        consumer, key, status, fingerprint, token, attempt, created, now,
        lease if lease_until is None else lease_until, expires, result, error,
    )  # fmt: skip


def _claimed(
    consumer: str,
    key: str,
    fingerprint: str | None,
    token: str,
    lease_ms: int,
    keep_ms: int,
    now: int,
    code: int,
    extra: Sequence[Any],
) -> Claim:
    """The claim of one key: ``code`` is the reply code's first letter, ``extra`` its values.

    Tokens are unique per claim, so an ``existing`` in-progress record that carries the claim's
    own token means an earlier send of this very claim landed (the driver resent it after a
    lost reply): the claim won, and says so.
    """
    if code == _NEW:
        attempt, created, status = 1, now, ClaimStatus.NEW
    elif code == _TAKEN:
        attempt, created, _lease, fingerprint = _brief(extra[0])
        status = ClaimStatus.TAKEN_OVER
    else:
        record = parse_record(consumer, key, extra[0], extra[1])
        if record.token == token and record.status is Status.IN_PROGRESS:
            won = ClaimStatus.NEW if record.attempt == 1 else ClaimStatus.TAKEN_OVER
            return new_claim(won, record, now)
        return new_claim(ClaimStatus.EXISTING, record, now)
    record = new_record(
        consumer, key, Status.IN_PROGRESS, fingerprint, token, attempt, created, now,
        now + lease_ms, now + max(keep_ms, lease_ms), None, None,
    )  # fmt: skip
    return new_claim(status, record, now)


_NEW, _TAKEN = ord("n"), ord("t")


def parse_claim(
    consumer: str,
    key: str,
    fingerprint: str | None,
    token: str,
    lease_ms: int,
    keep_ms: int,
    reply: Sequence[Any],
) -> Claim:
    """The claim of a one-key ``CLAIM`` reply (``{{code, now, ...}}``)."""
    found = reply[0]
    code = found[0][0]
    if code not in (_NEW, _TAKEN):
        # Speed: an existing record that is not this claim's own (every replay) is read here,
        # without the list and the call of the general case below: 1.65 us instead of 1.80.
        record = parse_record(consumer, key, found[2], found[3])
        if record.token != token or record.status is not Status.IN_PROGRESS:
            return new_claim(ClaimStatus.EXISTING, record, found[1])
    _code, now, *extra = found
    return _claimed(consumer, key, fingerprint, token, lease_ms, keep_ms, now, code, extra)


def parse_batch(
    consumer: str,
    requests: Sequence[ClaimRequest],
    lease_ms: int,
    keep_ms: int,
    reply: Sequence[Any],
) -> list[Claim]:
    """The claims of a ``CLAIM_MANY`` reply (``{now, codes, extras...}``), in request order."""
    now = int(reply[0])
    codes = reply[1]
    if len(codes) != len(requests):
        raise ValueError(f"claim_many: {len(codes)} codes for {len(requests)} keys")
    lease_until, expires = now + lease_ms, now + max(keep_ms, lease_ms)
    new, in_progress = ClaimStatus.NEW, Status.IN_PROGRESS
    if len(reply) == 2:  # every key new (the common batch): the records are the ones asked for
        return [
            new_claim(
                new,
                new_record(
                    consumer, r.key, in_progress, r.fingerprint, r.token, 1, now, now,
                    lease_until, expires, None, None,
                ),
                now,
            )
            for r in requests
        ]  # fmt: skip
    claims: list[Claim] = []
    j = 2
    for r, code in zip(requests, codes, strict=True):
        if code == _NEW:
            record = new_record(
                consumer, r.key, in_progress, r.fingerprint, r.token, 1, now, now, lease_until,
                expires, None, None,
            )  # fmt: skip
            claims.append(new_claim(new, record, now))
            continue
        taken = 1 if code == _TAKEN else 2
        extra = reply[j : j + taken]
        j += taken
        claims.append(
            _claimed(consumer, r.key, r.fingerprint, r.token, lease_ms, keep_ms, now, code, extra)
        )
    return claims

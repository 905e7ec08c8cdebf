"""Redis: the key layout, every operation of the store contract as a Lua script, and the reply
parser.

Each operation is one script, so Redis runs it atomically: a claim reads the record and inserts,
takes over or reports it in one step (Redis is the arbiter, R8, R9), and every fenced write
checks the token inside the script. The rules are those of :mod:`oncely._core.state`, written
in Lua.

Time. ``ARGV[1]`` is the store's clock reading in epoch milliseconds, or empty: then the script
reads ``TIME`` itself, so the decision and the ``now`` it answers with are the server's. With
the server's clock every write also sets ``PEXPIREAT`` to the record's ``expires`` and Redis
deletes the record as soon as that time has passed (retention without a sweeper). A given clock (a
:class:`~oncely.FakeClock` in tests) is unrelated to Redis's own, so its records carry no
Redis expiry at all (one would fire early or late): ``expires`` is a field, every script treats
``expires <= now`` as absent, and :meth:`purge_expired` deletes them.

Layout. One hash per record, ``<prefix>:{<consumer>:<key>}``, fields ``s f t a c u l e r x``
(status, fingerprint, token, attempt, created, updated, lease until, expires, result, error); a
missing field is ``None``. The braces are a Redis Cluster hash tag over the whole record name:
records spread over every slot, so one busy consumer uses the whole cluster instead of one node
(a per-consumer tag would pin a consumer's records, its memory and all of its traffic to one
slot, which a cluster can never split). A script touches one key, except a batch claim on a
single Redis (no slots) and a cluster batch's per-slot groups. Consumer and key are escaped
(``%`` ``{`` ``}`` ``:`` as ``%XX``), so the name is unambiguous and reversible and no key can
open or close a hash tag of its own. The schema version lives in ``<prefix>:meta``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Final
from urllib.parse import unquote

from oncely._core.records import Claim, ClaimStatus, Record, Status
from oncely._dialects.identifiers import check_identifier

__all__ = [
    "CLAIM",
    "COMPLETE",
    "FAIL",
    "GET",
    "PURGE",
    "RECORD_FIELDS",
    "RELEASE",
    "RENEW",
    "SCHEMA_VERSION",
    "RedisKeys",
    "Script",
    "opt",
    "parse_claims",
    "parse_fields",
    "parse_reply",
]

SCHEMA_VERSION: Final = 1

RECORD_FIELDS: Final = (b"s", b"f", b"t", b"a", b"c", b"u", b"l", b"e", b"r", b"x")
"""The hash fields of a record, in the order every reply carries them."""

_STATUS = {s.value.encode(): s for s in Status}


@dataclass(frozen=True, slots=True)
class Script:
    """A Lua script and its SHA-1 (what ``EVALSHA`` names it by)."""

    name: str
    text: str
    sha: str = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "sha", hashlib.sha1(self.text.encode()).hexdigest())


# Shared by every script: the clock, the record as a 10-slot table (false for a missing field),
# writing it back, and the reply {code, now, fields...}. Lua numbers are doubles: epoch
# milliseconds stay exact, and Redis turns them into integers in the reply.
_PRELUDE = """
local F = {'s', 'f', 't', 'a', 'c', 'u', 'l', 'e', 'r', 'x'}
local server = ARGV[1] == ''
local now
if server then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
else
  now = tonumber(ARGV[1])
end

-- The record's fields (v[1] is false when there is none); live when unexpired (expires > now).
local function load(k)
  return redis.call('HMGET', k, unpack(F))
end

local function alive(v)
  return v[1] and tonumber(v[8]) > now
end

-- The record, or nil when it is absent: missing, or expired.
local function live(k)
  local v = load(k)
  if alive(v) then
    return v
  end
  return nil
end

-- Write every field of v (false ones deleted, unless the key held nothing before).
local function save(k, v, existed)
  local set, del = {}, {}
  for i = 1, 10 do
    if v[i] then
      set[#set + 1] = F[i]
      set[#set + 1] = v[i]
    else
      del[#del + 1] = F[i]
    end
  end
  redis.call('HSET', k, unpack(set))
  if existed and #del > 0 then
    redis.call('HDEL', k, unpack(del))
  end
  if server then
    redis.call('PEXPIREAT', k, v[8])
  end
end

local function reply(code, v)
  local out = {code, now}
  if v then
    for i = 1, 10 do
      out[i + 2] = v[i]
    end
  end
  return out
end

-- An optional argument: '' is None, anything else carries one leading marker byte.
local function opt(a)
  if a == '' then
    return false
  end
  return string.sub(a, 2)
end
"""

_CLAIM = """
-- KEYS: one record per request. ARGV: now, lease, keep, takeover ('1'/'0'), expected token
-- ('' for any), then (fingerprint, token) per request. Requests run in order, as claims made
-- one after the other; the reply holds one {code, now, fields...} per request.
local lease, keep = tonumber(ARGV[2]), tonumber(ARGV[3])
local takeover, expected = ARGV[4] == '1', opt(ARGV[5])
local out = {}
for n, k in ipairs(KEYS) do
  local fp, token = opt(ARGV[4 + 2 * n]), ARGV[5 + 2 * n]
  local v = load(k)
  local code = 'existing'
  if not alive(v) then
    local existed = v[1]
    v = {'in_progress', fp, token, 1, now, now, now + lease, now + math.max(keep, lease),
         false, false}
    save(k, v, existed)
    code = 'new'
  elseif takeover and v[1] == 'in_progress' and tonumber(v[7]) <= now
      and (not fp or not v[2] or v[2] == fp) and (not expected or v[3] == expected) then
    v = {'in_progress', fp or v[2], token, tonumber(v[4]) + 1, v[5], now, now + lease,
         now + math.max(keep, lease), false, false}
    save(k, v, true)
    code = 'taken'
  end
  out[n] = reply(code, v)
end
return out
"""

_COMPLETE = """
-- ARGV: now, token, keep, result (optional), note (optional).
local v = live(KEYS[1])
if not v or v[3] ~= ARGV[2] then
  return reply('lost', v)
end
if v[1] == 'completed' then
  return reply('ok', v)
end
if v[1] ~= 'in_progress' then
  return reply('lost', v)
end
v[1], v[6], v[8] = 'completed', now, now + tonumber(ARGV[3])
v[9], v[10] = opt(ARGV[4]), opt(ARGV[5])
save(KEYS[1], v, true)
return reply('ok', v)
"""

_FAIL = """
-- ARGV: now, token, keep, error.
local v = live(KEYS[1])
if not v or v[3] ~= ARGV[2] then
  return reply('lost', v)
end
if v[1] == 'failed' then
  return reply('ok', v)
end
if v[1] ~= 'in_progress' then
  return reply('lost', v)
end
v[1], v[6], v[8], v[9], v[10] = 'failed', now, now + tonumber(ARGV[3]), false, ARGV[4]
save(KEYS[1], v, true)
return reply('ok', v)
"""

_RENEW = """
-- ARGV: now, token, lease, keep.
local v = live(KEYS[1])
if not v or v[3] ~= ARGV[2] or v[1] ~= 'in_progress' then
  return reply('lost', v)
end
local lease = tonumber(ARGV[3])
v[6], v[7], v[8] = now, now + lease, now + math.max(tonumber(ARGV[4]), lease)
save(KEYS[1], v, true)
return reply('ok', v)
"""

_RELEASE = """
-- ARGV: now, token. 'true' deleted the claim, 'false' found nothing live, 'lost' is another's.
local v = live(KEYS[1])
if not v then
  return reply('false', nil)
end
if v[3] ~= ARGV[2] or v[1] ~= 'in_progress' then
  return reply('lost', v)
end
redis.call('DEL', KEYS[1])
return reply('true', nil)
"""

_GET = """
-- ARGV: now. The live record ('ok') or nothing ('none').
local v = live(KEYS[1])
return reply(v and 'ok' or 'none', v)
"""

_PURGE = """
-- ARGV: now. Deletes those of KEYS that are expired; returns how many.
local n = 0
for _, k in ipairs(KEYS) do
  local e = redis.call('HGET', k, 'e')
  if e and tonumber(e) <= now then
    redis.call('DEL', k)
    n = n + 1
  end
end
return n
"""

CLAIM: Final = Script("claim", _PRELUDE + _CLAIM)
COMPLETE: Final = Script("complete", _PRELUDE + _COMPLETE)
FAIL: Final = Script("fail", _PRELUDE + _FAIL)
RENEW: Final = Script("renew", _PRELUDE + _RENEW)
RELEASE: Final = Script("release", _PRELUDE + _RELEASE)
GET: Final = Script("get", _PRELUDE + _GET)
PURGE: Final = Script("purge", _PRELUDE + _PURGE)


def _quote(text: str) -> str:
    return text.replace("%", "%25").replace("{", "%7B").replace("}", "%7D").replace(":", "%3A")


def _glob(text: str) -> str:
    """``text`` with Redis glob metacharacters escaped, for ``SCAN MATCH``."""
    for char in "\\*?[]":
        text = text.replace(char, "\\" + char)
    return text


class RedisKeys:
    """The key names of one store: ``<prefix>:{<consumer>:<key>}`` and ``<prefix>:meta``."""

    __slots__ = ("_head", "meta", "pattern", "prefix")

    def __init__(self, prefix: str = "oncely") -> None:
        # A plain identifier: no braces (a hash tag of its own), no glob characters.
        self.prefix = check_identifier(prefix)
        self._head = f"{prefix}:{{"
        self.meta = f"{prefix}:meta".encode()
        self.pattern = f"{prefix}:{{*".encode()
        """``SCAN MATCH`` pattern of every record of the store."""

    def record(self, consumer: str, key: str) -> bytes:
        return f"{self._head}{_quote(consumer)}:{_quote(key)}}}".encode()

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


def _text(value: Any) -> str | None:
    return None if value is None else bytes(value).decode()


def parse_fields(consumer: str, key: str, v: Sequence[Any]) -> Record | None:
    """A record from the 10 fields of ``RECORD_FIELDS`` (``HMGET`` order), None if absent."""
    if v[0] is None:
        return None
    result = v[8]
    return Record(
        consumer=consumer,
        key=key,
        status=_STATUS[bytes(v[0])],
        fingerprint=_text(v[1]),
        token=bytes(v[2]).decode(),
        attempt=int(v[3]),
        created_ms=int(v[4]),
        updated_ms=int(v[5]),
        lease_until_ms=int(v[6]),
        expires_ms=int(v[7]),
        result=None if result is None else bytes(result),
        error=_text(v[9]),
    )


def parse_reply(consumer: str, key: str, reply: Sequence[Any]) -> tuple[bytes, int, Record | None]:
    """``(code, now, record)`` of a script's ``{code, now, fields...}`` reply."""
    record = parse_fields(consumer, key, reply[2:]) if len(reply) > 2 else None
    return bytes(reply[0]), int(reply[1]), record


_CLAIM_STATUS = {b"new": ClaimStatus.NEW, b"taken": ClaimStatus.TAKEN_OVER}


def parse_claims(
    consumer: str, keys: Sequence[str], tokens: Sequence[str], replies: Sequence[Any]
) -> list[Claim]:
    """The claims of a ``CLAIM`` reply, one per requested key.

    Tokens are unique per claim, so an ``existing`` in-progress record that carries the claim's
    own token means an earlier send of this very claim landed (the driver resent it after a
    lost reply): the claim won, and says so.
    """
    claims: list[Claim] = []
    for key, token, reply in zip(keys, tokens, replies, strict=True):
        code, now, record = parse_reply(consumer, key, reply)
        assert record is not None
        status = _CLAIM_STATUS.get(code, ClaimStatus.EXISTING)
        if (
            status is ClaimStatus.EXISTING
            and record.token == token
            and record.status is Status.IN_PROGRESS
        ):
            status = ClaimStatus.NEW if record.attempt == 1 else ClaimStatus.TAKEN_OVER
        claims.append(Claim(status, record, now))
    return claims

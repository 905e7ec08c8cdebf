"""Redis: every operation of the store contract as a Lua script.

Each operation is one script, so Redis runs it atomically: a claim reads the record and inserts,
takes over or reports it in one step (Redis is the arbiter, R8, R9), and every fenced write
checks the token inside the script. The rules are those of :mod:`oncely._core.state`, written
in Lua; the record layout they read and write is described in :mod:`oncely.stores.redis.dialect`.

Time. ``ARGV[1]`` is the store's clock reading in epoch milliseconds, or empty: then the script
reads ``TIME`` itself, so the decision and the ``now`` it answers with are the server's. With
the server's clock every write also sets a Redis expiry (``PXAT``) at the record's ``expires``
and Redis deletes the record as soon as that time has passed (retention without a sweeper). A
given clock (a :class:`~oncely.FakeClock` in tests) is unrelated to Redis's own, so its records
carry no Redis expiry at all (one would fire early or late): ``expires`` is a field, every
script treats ``expires <= now`` as absent, and the store's ``purge_expired`` deletes them.

Replies are short, because the client's parser costs far more per reply element than the
server does (redis-py parses RESP in Python unless hiredis is installed). A script answers
``{code, now}`` and at most two more values: nothing for a new claim (the client knows the
record it asked for), a *brief* (``"attempt created lease_until[ fingerprint]"``, the fields a
write leaves the client not knowing) after a write, and the whole record as two values,
``status`` and the rest of the stored string (*packed*), where the client cannot know it (an
existing record, a lost lease, ``get``). A batch claim answers ``{now, codes, extras...}``: one
letter per key.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Final

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
    "Script",
]


@dataclass(frozen=True, slots=True)
class Script:
    """A Lua script and its SHA-1 (what ``EVALSHA`` names it by; ``sha_bytes`` as sent)."""

    name: str
    text: str
    sha: str = field(init=False)
    sha_bytes: bytes = field(init=False)

    def __post_init__(self) -> None:
        sha = hashlib.sha1(self.text.encode()).hexdigest()
        object.__setattr__(self, "sha", sha)
        object.__setattr__(self, "sha_bytes", sha.encode())


# Shared by every script: the clock, reading and writing a record, and the replies. Lua numbers
# are doubles: epoch milliseconds stay exact; int() writes them as plain digits (Lua's own
# tostring switches to 1e+15 notation past 14 digits).
_PRELUDE = """
local server = ARGV[1] == ''
local now
if server then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
else
  now = tonumber(ARGV[1])
end

local function int(n)
  return string.format('%d', n)
end
local NOW = int(now)

-- A stored record: 's a c u l e #f #t #r #x', a newline, then f, t, r and x back to back (#:
-- the byte length, -1 for a missing value). Read as a 10-slot table in the order
-- s f t a c u l e r x (false for a missing value), with the stored string as v.raw.
local HEAD = '^(%S+)' .. string.rep(' (%-?%d+)', 6) .. ' (%d+) (%-?%d+) (%-?%d+)\\n()'

local function parse(raw)
  local s, a, c, u, l, e, nf, nt, nr, nx, i = string.match(raw, HEAD)
  if not s then
    error('not an oncely record')
  end
  nf, nt, nr, nx = tonumber(nf), tonumber(nt), tonumber(nr), tonumber(nx)
  local f, r, x = false, false, false
  if nf >= 0 then
    f = string.sub(raw, i, i + nf - 1)
    i = i + nf
  end
  local t = string.sub(raw, i, i + nt - 1)
  i = i + nt
  if nr >= 0 then
    r = string.sub(raw, i, i + nr - 1)
    i = i + nr
  end
  if nx >= 0 then
    x = string.sub(raw, i, i + nx - 1)
  end
  return {s, f, t, a, c, u, l, e, r, x, raw = raw}
end

-- The record (nil when there is none); live when unexpired (expires > now).
local function load(k)
  local raw = redis.call('GET', k)
  if raw then
    return parse(raw)
  end
  return nil
end

local function alive(v)
  return v and tonumber(v[8]) > now
end

-- The record, or nil when it is absent: missing, or expired.
local function live(k)
  local v = load(k)
  if alive(v) then
    return v
  end
  return nil
end

-- The tail of a record that has no result and no error: '#f #t -1 -1', a newline, f and t.
local function tail(f, t)
  if f then
    return #f .. ' ' .. #t .. ' -1 -1\\n' .. f .. t
  end
  return '-1 ' .. #t .. ' -1 -1\\n' .. t
end

-- Write v whole. With the server's clock Redis deletes it at its expiry, on the clock the
-- scripts judge expiry by; a plain SET drops any expiry (a given clock: none at all).
local function save(k, v)
  local f, r, x = v[2] or '', v[9] or '', v[10] or ''
  local raw = table.concat({v[1], v[4], v[5], v[6], v[7], v[8], v[2] and #f or -1, #v[3],
                            v[9] and #r or -1, v[10] and #x or -1}, ' ')
              .. '\\n' .. f .. v[3] .. r .. x
  if server then
    redis.call('SET', k, raw, 'PXAT', v[8])
  else
    redis.call('SET', k, raw)
  end
end

-- The whole record as two values: the status, and the rest of the stored string.
local function packed(v)
  return v[1], string.sub(v.raw, #v[1] + 2)
end

-- What a write leaves the client not knowing: 'attempt created lease_until[ fingerprint]'.
local function brief(v)
  local b = v[4] .. ' ' .. v[5] .. ' ' .. v[7]
  if v[2] then
    b = b .. ' ' .. v[2]
  end
  return b
end

-- {code, now} and, with a record, {code, now, status, packed}.
local function reply(code, v)
  if v then
    local s, p = packed(v)
    return {code, now, s, p}
  end
  return {code, now}
end

-- An optional argument: '' is None, anything else carries one leading marker byte.
local function opt(a)
  if a == '' then
    return false
  end
  return string.sub(a, 2)
end
"""

# ARGV: now, lease, keep, takeover ('1'/'0'), expected token ('' for any), then the key's
# arguments; keys are claimed in order, as claims made one after the other.
_CLAIM_ONE = """
local lease = tonumber(ARGV[2])
local LEASE, EXPIRES = int(now + lease), int(now + math.max(tonumber(ARGV[3]), lease))
local takeover, expected = ARGV[4] == '1', opt(ARGV[5])
-- A new record is this head and the tail of its fingerprint and token.
local NEW = 'in_progress 1 ' .. NOW .. ' ' .. NOW .. ' ' .. LEASE .. ' ' .. EXPIRES .. ' '

-- The fingerprint (false for None) and token of a tail.
local function untail(t)
  local nf, nt, i = string.match(t, '^(%-?%d+) (%d+) %-1 %-1\\n()')
  nf, nt = tonumber(nf), tonumber(nt)
  if nf < 0 then
    return false, string.sub(t, i, i + nt - 1)
  end
  return string.sub(t, i, i + nf - 1), string.sub(t, i + nf, i + nf + nt - 1)
end

-- Claim k for the record NEW .. t (t: the tail of the claim's fingerprint and token; a caller
-- that has those at hand passes them too). 'new' (the record is the one asked for), 'taken' or
-- 'existing', and the record. A free key costs one command: SET NX writes the new record, or
-- answers the one there (GET) and writes nothing.
local function claim(k, t, fp, token)
  local raw
  if server then
    raw = redis.call('SET', k, NEW .. t, 'NX', 'GET', 'PXAT', EXPIRES)
  else
    raw = redis.call('SET', k, NEW .. t, 'NX', 'GET')
  end
  if not raw then
    return 'new', nil
  end
  if not token then
    fp, token = untail(t)
  end
  local v = parse(raw)
  if alive(v) then
    if not (takeover and v[1] == 'in_progress' and tonumber(v[7]) <= now
            and (not fp or not v[2] or v[2] == fp) and (not expected or v[3] == expected)) then
      return 'existing', v
    end
    -- In progress, so no result or error to clear; created and status stay.
    v[2], v[3], v[4], v[6], v[7], v[8] = fp or v[2], token, int(tonumber(v[4]) + 1), NOW,
                                         LEASE, EXPIRES
    save(k, v)
    return 'taken', v
  end
  -- Expired, so absent (a given clock: Redis keeps it): the new record replaces it.
  if server then
    redis.call('SET', k, NEW .. t, 'PXAT', EXPIRES)
  else
    redis.call('SET', k, NEW .. t)
  end
  return 'new', nil
end
"""

_CLAIM = """
-- Per key: fingerprint (optional), token. One {code, now, ...} per key: nothing more when new,
-- the brief when taken, the record when existing.
local out = {}
for n, k in ipairs(KEYS) do
  local fp, token = opt(ARGV[4 + 2 * n]), ARGV[5 + 2 * n]
  local code, v = claim(k, tail(fp, token), fp, token)
  if code == 'taken' then
    out[n] = {code, now, brief(v)}
  else
    out[n] = reply(code, v)
  end
end
return out
"""

_CLAIM_MANY = """
-- Per key: the new record's tail ('#f #t -1 -1', a newline, fingerprint and token: see
-- RedisKeys.claim_batch): a free key gets NEW .. tail as it is, one SET and no parsing.
-- {now, codes, extras...}: codes holds a letter per key, n (new), t (taken: one extra, the
-- brief) or e (existing: two extras, status and packed record).
local codes, out = {}, {now, ''}
for n, k in ipairs(KEYS) do
  local code, v = claim(k, ARGV[5 + n])
  codes[n] = string.sub(code, 1, 1)
  if code == 'taken' then
    out[#out + 1] = brief(v)
  elseif code == 'existing' then
    local s, p = packed(v)
    out[#out + 1] = s
    out[#out + 1] = p
  end
end
out[2] = table.concat(codes)
return out
"""

# Shared by complete and fail. ARGV: now, token, keep, then the script's own.
_SETTLE = """
-- Move the record to status under its claim's token, kept ARGV[3] ms from now (not saved
-- yet): the record and its brief from before; or nil and the reply to return at once,
-- 'done' if this token already moved it there, 'lost' if it is another's or none.
local function settle(status)
  local v = live(KEYS[1])
  if not v or v[3] ~= ARGV[2] then
    return nil, reply('lost', v)
  end
  if v[1] == status then
    return nil, reply('done', v)
  end
  if v[1] ~= 'in_progress' then
    return nil, reply('lost', v)
  end
  local b = brief(v)
  v[1], v[6], v[8] = status, NOW, int(now + tonumber(ARGV[3]))
  return v, b
end
"""

_COMPLETE = """
-- ARGV: now, token, keep, result (optional), note (optional). 'ok' wrote it, 'done' found it
-- done already by this token, 'lost' found another's or none.
local v, b = settle('completed')
if not v then
  return b
end
local result, note = opt(ARGV[4]), opt(ARGV[5])
if result then
  v[9] = result
end
if note then
  v[10] = note
end
save(KEYS[1], v)
return {'ok', now, b}
"""

_FAIL = """
-- ARGV: now, token, keep, error. Codes as for complete.
local v, b = settle('failed')
if not v then
  return b
end
v[10] = ARGV[4]
save(KEYS[1], v)
return {'ok', now, b}
"""

_RENEW = """
-- ARGV: now, token, lease, keep.
local v = live(KEYS[1])
if not v or v[3] ~= ARGV[2] or v[1] ~= 'in_progress' then
  return reply('lost', v)
end
local b = brief(v)
local lease = tonumber(ARGV[3])
v[6], v[7], v[8] = NOW, int(now + lease), int(now + math.max(tonumber(ARGV[4]), lease))
save(KEYS[1], v)
return {'ok', now, b}
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

_FORGET = """
-- ARGV: now, token. An operator's fenced delete: 'true' deleted the record, 'false' found
-- nothing live, 'lost' it is another's or a live claim.
local v = live(KEYS[1])
if not v then
  return reply('false', nil)
end
if v[3] ~= ARGV[2] or (v[1] == 'in_progress' and tonumber(v[7]) > now) then
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
  local v = load(k)
  if v and tonumber(v[8]) <= now then
    redis.call('DEL', k)
    n = n + 1
  end
end
return n
"""

_READ = """
-- The stored string of each of KEYS, false (nil) where there is none; expired ones included.
local out = {}
for n, k in ipairs(KEYS) do
  out[n] = redis.call('GET', k)
end
return out
"""

CLAIM: Final = Script("claim", _PRELUDE + _CLAIM_ONE + _CLAIM)
CLAIM_MANY: Final = Script("claim_many", _PRELUDE + _CLAIM_ONE + _CLAIM_MANY)
COMPLETE: Final = Script("complete", _PRELUDE + _SETTLE + _COMPLETE)
FAIL: Final = Script("fail", _PRELUDE + _SETTLE + _FAIL)
RENEW: Final = Script("renew", _PRELUDE + _RENEW)
RELEASE: Final = Script("release", _PRELUDE + _RELEASE)
FORGET: Final = Script("forget", _PRELUDE + _FORGET)
GET: Final = Script("get", _PRELUDE + _GET)
PURGE: Final = Script("purge", _PRELUDE + _PURGE)
READ: Final = Script("read", _READ)

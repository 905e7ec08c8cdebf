"""What the bad-input campaign sends (:mod:`tests.chaos.campaign`, whose docstring lists every
class and the invariants): the run's settings the expectations are built from, the classes
(:class:`Spec`), one logical message and its physical copies (:class:`Logical`,
:class:`Copy`), the builders of each class, and :func:`generate`, the seeded plan of a run.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# The run's settings: the consumer is started with them, and the expectations follow from them.
BROKERS = ("rabbitmq", "redis", "nats")
CONSUMER = "campaign"
HANDLER = "tests.chaos.campaign_handlers:handle"
KEY_SPEC = "cloudevents,message-id"
CONCURRENCY = 16
MAX_DELIVERIES = 3
ACK_WAIT_S = 3
BACKOFF_MOST_S = 2  # ConsumerSettings' backoff before the 3rd delivery: 1 s, then 2 s
SLOW_S = 3.5
BODY_CAP = 16 * 1024
KEY_LIMIT_FLAG = 200  # passed as --max-key-bytes when the command has it (fits an AMQP id)
KEY_LIMIT_DEFAULT = 512  # oncely.Limits().max_key_bytes
NATS_WINDOW_S = 1.0
PHASE_GAP_S = 1.6  # past the NATS duplicate window
MIN_PER_CLASS = 3
DEAD = "dead:"  # the prefix of a dead-lettered end state: "dead:rejected", "dead:key_conflict"
# Patterns dead-letter reasons must match.
SIZE = r"bytes|limit|large|size|cap"
NOT_UTF8 = r"utf-?8"
MESSAGE_ID = r"message[ _-]?id|nats-msg-id"
NO_BODY = r"missing|absent|\bno\b[^.;]*\bbody\b|without[^.;]*\bbody\b"
CE_PREFIXES = {
    "rabbitmq": ("cloudEvents_", "cloudEvents:"),
    "redis": ("ce_", "ce-"),
    "nats": ("ce-", "ce_"),
}


# ---------------------------------------------------------------------- what is sent


@dataclass
class Copy:
    """One physical message. ``body=None``: no body field at all (Redis)."""

    tag: str
    body: bytes | None
    message_id: bytes | None = None
    correlation_id: bytes | None = None
    content_type: bytes | None = b"application/json"
    headers: dict[str, bytes] = field(default_factory=dict)
    byte_arrays: frozenset[str] = frozenset()  # AMQP: sent as byte arrays, not long strings
    properties: dict[str, bytes] = field(default_factory=dict)  # other AMQP basic properties
    phase: int = 1
    spread: bool = False  # sent at a random place of phase 1, away from its twins
    reasons: tuple[str, ...] = ()  # patterns its dead-letter reason matches (with the class's)


@dataclass(frozen=True)
class Spec:
    """A class of input: how to build one logical message, and what must become of it."""

    name: str
    summary: str
    build: Callable[[Spec, Ctx, int], Logical]
    brokers: tuple[str, ...] = BROKERS
    weight: float = 1.0
    reasons: tuple[str, ...] = ()  # every dead-letter reason of the class matches each
    forbid: tuple[str, ...] = ()  # and none of these
    warns: bool = False  # its processed lines are WARNING+ with "result not stored"


@dataclass
class Logical:
    """One logical message: its copies and what must become of them."""

    spec: Spec
    n: int
    copies: list[Copy]
    states: list[str]  # the end state of each copy, in any order
    key: str | None = None  # the key it must be processed under
    runs: int = 0  # handler calls
    effects: int = 0
    spellings: set[str] = field(default_factory=set)  # keys a log line may show for it


@dataclass(frozen=True)
class Ctx:
    broker: str
    key_limit: int
    body_cap: int
    hash_long_keys: bool
    rng: random.Random


def _body(cls: str, n: int, **extra: object) -> bytes:
    return json.dumps({"cls": cls, "n": n, **extra}, separators=(",", ":")).encode()


def _copy(s: Spec, n: int, i: int = 0, **fields: Any) -> Copy:
    fields.setdefault("body", _body(s.name, n))
    return Copy(tag=f"{s.name}:{n}:{i}", **fields)


def _ok(s: Spec, n: int, copy: Copy, key: str, *, runs: int = 1) -> Logical:
    return Logical(s, n, [copy], ["processed"], key=key, runs=runs, effects=1)


def _ok_id(s: Spec, n: int, **fields: Any) -> Logical:
    fields.setdefault("message_id", f"{s.name}-{n}".encode())
    return _ok(s, n, _copy(s, n, **fields), fields["message_id"].decode())


def _bad(s: Spec, n: int, *copies: Copy, runs: int = 0) -> Logical:
    return Logical(s, n, list(copies), [DEAD + "rejected"] * len(copies), runs=runs)


def _bad_id(s: Spec, n: int, **fields: Any) -> Logical:
    fields.setdefault("message_id", f"{s.name}-{n}".encode())
    return _bad(s, n, _copy(s, n, **fields))


def _fill(prefix: str, size: int) -> str:
    """``prefix`` then two-byte characters (and one ``x``) up to exactly ``size`` UTF-8 bytes."""
    left = size - len(prefix.encode())
    return prefix + "é" * (left // 2) + "x" * (left % 2)


def _ce(prefix: str, source: bytes, ident: bytes) -> dict[str, bytes]:
    return {
        f"{prefix}specversion": b"1.0",
        f"{prefix}type": b"campaign.test",
        f"{prefix}source": source,
        f"{prefix}id": ident,
    }


def _padded(cls: str, n: int, size: int) -> bytes:
    base = _body(cls, n, pad="")
    return _body(cls, n, pad="x" * (size - len(base)))


def _nested(cls: str, n: int, depth: int) -> bytes:
    return _body(cls, n)[:-1] + b',"deep":' + b"[" * depth + b"]" * depth + b"}"


def b_retry(copies: int, *, spread: bool = False, late: bool = False) -> Callable[..., Logical]:
    def build(s: Spec, ctx: Ctx, n: int) -> Logical:
        k = copies or ctx.rng.choice((2, 3))
        key = f"{s.name}-{n}"
        made = [
            _copy(
                s,
                n,
                i,
                message_id=key.encode(),
                spread=spread and i > 0,
                phase=2 if late and i else 1,
            )
            for i in range(k)
        ]
        return Logical(s, n, made, ["processed"] + ["duplicate"] * (k - 1), key, 1, 1)

    return build


def b_id_reuse(s: Spec, ctx: Ctx, n: int) -> Logical:
    key = f"{s.name}-{n}".encode()
    first = _copy(s, n, 0, message_id=key, body=_body(s.name, n, version=1))
    second = _copy(s, n, 1, message_id=key, body=_body(s.name, n, version=2), phase=2)
    return Logical(s, n, [first, second], ["processed", DEAD + "key_conflict"], key.decode(), 1, 1)


def b_reject_repeat(s: Spec, ctx: Ctx, n: int) -> Logical:
    key = f"{s.name}-{n}".encode()
    return _bad(
        s, n, _copy(s, n, 0, message_id=key), _copy(s, n, 1, message_id=key, phase=2), runs=1
    )


def b_latin1(s: Spec, ctx: Ctx, n: int) -> Logical:
    return _bad(
        s,
        n,
        *(
            _copy(
                s, n, i, message_id=f"{who}-{n}".encode("latin-1"), body=_body(s.name, n, who=who)
            )
            for i, who in enumerate(("Müller", "Möller"))
        ),
    )


def b_id_control(s: Spec, ctx: Ctx, n: int) -> Logical:
    if ctx.broker == "nats":  # a NATS header value cannot hold CR or LF
        key = f"ctl-{n}-\x1b[31m-\x07-\t-\x7f-\x01-end"
    else:
        # No space: under the campaign's --key cloudevents,message-id a spaced id is refused,
        # as it could be taken for an event's "<source> <id>".
        forged = json.dumps(
            {"level": "error", "message": "FORGED", "outcome": "processed", "key": f"forged-{n}"},
            separators=(",", ":"),
        )
        key = f"ctl-{n}\n{forged}\r\n\x1b[2K\x07\x7f-end"
    return _ok(s, n, _copy(s, n, message_id=key.encode()), key)


def _long_key(s: Spec, ctx: Ctx, n: int, size: int) -> tuple[Copy, str]:
    if ctx.broker == "rabbitmq" and size > 255:  # an AMQP message id holds at most 255 bytes
        source = "urn:k"
        ident = _fill(f"{n}-", size - len(source) - 1)
        headers = _ce("cloudEvents:", source.encode(), ident.encode())
        return _copy(s, n, headers=headers), f"{source} {ident}"
    key = _fill(f"{s.name}-{n}-", size)
    return _copy(s, n, message_id=key.encode()), key


def b_key_at_max(s: Spec, ctx: Ctx, n: int) -> Logical:
    copy, key = _long_key(s, ctx, n, ctx.key_limit)
    return _ok(s, n, copy, key)


def b_key_over_max(s: Spec, ctx: Ctx, n: int) -> Logical:
    copy, key = _long_key(s, ctx, n, ctx.key_limit + 1)
    if ctx.hash_long_keys:
        logical = _ok(s, n, copy, "sha256:" + hashlib.sha256(key.encode()).hexdigest())
    else:
        logical = _bad(s, n, copy)
    logical.spellings.add(key)
    return logical


def b_ce(
    alt: bool = False, ident: bytes | None = None, source: bytes | None = None
) -> Callable[..., Logical]:
    def build(s: Spec, ctx: Ctx, n: int) -> Logical:
        prefix = CE_PREFIXES[ctx.broker][1 if alt else 0]
        src = source if source is not None else f"urn:campaign:{s.name}".encode()
        the_id = ident + str(n).encode() if ident is not None else f"{s.name}-{n}".encode()
        copy = _copy(s, n, headers=_ce(prefix, src, the_id))
        if ident is not None or source is not None:
            return _bad(s, n, copy)
        return _ok(s, n, copy, f"{src.decode()} {the_id.decode()}")

    return build


def b_ce_structured(s: Spec, ctx: Ctx, n: int) -> Logical:
    source, ident = f"urn:campaign:{s.name}", f"{s.name}-{n}"
    event = {
        "specversion": "1.0",
        "type": "campaign.test",
        "source": source,
        "id": ident,
        "datacontenttype": "application/json",
        "data": {"cls": s.name, "n": n},
    }
    body = json.dumps(event).encode()
    copy = _copy(s, n, body=body, content_type=b"application/cloudevents+json")
    return _ok(s, n, copy, f"{source} {ident}")


AMQP_PROPERTIES = ("app_id", "type", "reply_to", "content_encoding", "content_type")


def b_amqp_property(s: Spec, ctx: Ctx, n: int) -> Logical:
    """Each AMQP basic property other than the ids, not UTF-8, one copy each (``user_id`` and
    ``expiration`` are not sent: RabbitMQ itself checks those)."""
    copies = []
    for i, name in enumerate(AMQP_PROPERTIES):
        fields: dict[str, Any] = {"message_id": f"{s.name}-{n}-{name}".encode()}
        if name == "content_type":
            fields["content_type"] = b"application/\xffjson"
        else:
            fields["properties"] = {name: b"campaign-\xff" + str(n).encode()}
        copies.append(_copy(s, n, i, reasons=(name.replace("_", "[ _-]?"),), **fields))
    return _bad(s, n, *copies)


def _simple(**fields: Any) -> Callable[..., Logical]:
    """One copy with the message id ``<class>-<n>`` and ``fields`` (a callable value is
    called with ``(spec, ctx, n)``); processed unless the spec has reason patterns."""

    def build(s: Spec, ctx: Ctx, n: int) -> Logical:
        made = {k: v(s, ctx, n) if callable(v) else v for k, v in fields.items()}
        if s.reasons:
            return _bad_id(s, n, **made)
        return _ok_id(s, n, **made)

    return build


def _runs(count: int, builder: Callable[..., Logical]) -> Callable[..., Logical]:
    """``builder``, with the handler expected to be called ``count`` times."""

    def build(s: Spec, ctx: Ctx, n: int) -> Logical:
        logical = builder(s, ctx, n)
        logical.runs = count
        return logical

    return build


SPECS: tuple[Spec, ...] = (
    Spec("good", "processed", _simple()),
    Spec("retry_burst", "1 processed + duplicates", b_retry(0)),
    Spec("retry_spread", "1 processed + 2 duplicate", b_retry(3, spread=True)),
    Spec("retry_late", "processed + duplicate", b_retry(2, late=True)),
    Spec(
        "id_reuse",
        "processed + key_conflict",
        b_id_reuse,
        reasons=(r"reused|different content|fingerprint",),
    ),
    Spec("reject_repeat", "2 x rejected", b_reject_repeat, reasons=(r"reject|poison",)),
    Spec("no_id", "rejected", _simple(message_id=None), reasons=(MESSAGE_ID + r"|no key",)),
    Spec("empty_id", "rejected", _simple(message_id=b""), reasons=(MESSAGE_ID + r"|empty|no key",)),
    Spec(
        "id_not_utf8",
        "rejected (names the id)",
        _simple(message_id=lambda s, c, n: b"inv-\xff" + str(n).encode()),
        reasons=(MESSAGE_ID, NOT_UTF8),
    ),
    Spec("latin1_pair", "2 x rejected", b_latin1, reasons=(MESSAGE_ID, NOT_UTF8)),
    Spec(
        "id_unicode",
        "processed",
        _simple(message_id=lambda s, c, n: f"Zoë-Ünïcødé-日本-🎉-{n}".encode()),
    ),
    Spec("id_control", "processed, no forged line", b_id_control),
    Spec(
        "id_nul",
        "rejected",
        _simple(message_id=lambda s, c, n: f"nul-{n}-\x00-end".encode()),
        reasons=(r"NUL",),
    ),
    Spec("key_at_max", "processed", b_key_at_max),
    Spec("key_over_max", "rejected (or hashed)", b_key_over_max, reasons=(r"bytes|limit|long",)),
    Spec(
        "body_not_json",
        "rejected",
        _simple(body=lambda s, c, n: b"campaign body_not_json %d: {not json" % n),
        reasons=(r"json|body",),
    ),
    Spec("body_empty", "rejected", _simple(body=b""), reasons=(r"json|body|empty",)),
    Spec(
        "text_not_utf8",
        "rejected",
        _simple(
            content_type=b"text/plain",
            body=lambda s, c, n: _body(s.name, n)[:-1] + b',"x":"caf\xe9"}',
        ),
        reasons=(NOT_UTF8,),
    ),
    Spec(
        "text_plain_ok",
        "processed",
        _simple(
            content_type=b"text/plain; charset=utf-8",
            body=lambda s, c, n: f"campaign text_plain_ok {n}: plain text, ünïcode ✓".encode(),
        ),
    ),
    Spec(
        "binary_ok",
        "processed",
        _simple(
            content_type=b"application/octet-stream",
            body=lambda s, c, n: b"\x00\xff\xfecampaign binary_ok %d \x80\x81" % n,
        ),
    ),
    Spec("body_at_cap", "processed", _simple(body=lambda s, c, n: _padded(s.name, n, c.body_cap))),
    Spec(
        "body_over_cap",
        "rejected (size)",
        _simple(body=lambda s, c, n: _padded(s.name, n, c.body_cap + 1)),
        reasons=(SIZE,),
    ),
    Spec(
        "body_far_over_cap",
        "rejected before decoding",
        _simple(
            body=lambda s, c, n: (
                b"campaign body_far_over_cap %d " % n + b"\xff{not json " * c.body_cap
            )[: 4 * c.body_cap]
        ),
        weight=0.5,
        reasons=(SIZE,),
        forbid=(r"not JSON", r"Expecting value", r"not UTF-8"),
    ),
    Spec("json_nested_ok", "processed", _simple(body=lambda s, c, n: _nested(s.name, n, 100))),
    Spec(
        "json_too_deep",
        "rejected",
        _simple(body=lambda s, c, n: _nested(s.name, n, 5000)),
        reasons=(r"body|json|depth|recursion|nest",),
    ),
    Spec(
        "json_non_finite",
        "processed",
        _simple(body=lambda s, c, n: _body(s.name, n)[:-1] + b',"x":1e999}'),
    ),
    Spec("raise_once", "processed after a retry", _runs(2, _simple())),
    Spec(
        "raise_always",
        f"rejected after {MAX_DELIVERIES}",
        _runs(MAX_DELIVERIES, _simple()),
        weight=0.5,
        reasons=(rf"failed on all {MAX_DELIVERIES} deliveries",),
    ),
    Spec("reject", "rejected", _runs(1, _simple()), reasons=(r"reject|poison",)),
    Spec("result_unserialisable", "processed, warning", _simple(), warns=True),
    Spec("result_oversized", "processed, warning", _simple(), weight=0.3, warns=True),
    Spec(
        "correlation_not_utf8",
        "rejected (names it)",
        _simple(correlation_id=lambda s, c, n: b"corr-\xff" + str(n).encode()),
        reasons=(r"correlation", NOT_UTF8),
    ),
    Spec(
        "header_not_utf8",
        "processed",
        _simple(
            headers={"x-note": b"caf\xe9 \xff", "x-blob": b"\xfe\xff"},
            byte_arrays=frozenset({"x-blob"}),
        ),
    ),
    Spec("ce_binary", "processed (CE key)", b_ce()),
    Spec("ce_binary_alt", "processed (CE key)", b_ce(alt=True)),
    Spec("ce_structured", "processed (CE key)", b_ce_structured),
    Spec("ce_id_not_utf8", "rejected", b_ce(ident=b"ce-\xff"), reasons=(NOT_UTF8,)),
    Spec(
        "ce_source_space", "rejected", b_ce(source=b"urn:campaign bad source"), reasons=(r"source",)
    ),
    Spec("slow", "processed once", _simple(), weight=0.3),
    Spec(
        "amqp_property_not_utf8",
        "rejected (names it)",
        b_amqp_property,
        brokers=("rabbitmq",),
        reasons=(NOT_UTF8,),
    ),
    Spec(
        "redis_no_body_field",
        "rejected (body missing)",
        _simple(body=None),
        brokers=("redis",),
        reasons=(NO_BODY,),
    ),
)


def _variants(raw: bytes) -> set[str]:
    return {raw.decode("utf-8", "replace"), raw.decode("utf-8", "surrogateescape")}


def _ce_attribute(headers: dict[str, bytes], name: str) -> bytes | None:
    for header, value in headers.items():
        for prefix in ("ce-", "ce_", "cloudevents_", "cloudevents:"):
            if header.lower() == prefix + name:
                return value
    return None


def _spell(logical: Logical) -> None:
    """Every key a log line could show for ``logical``, right or wrong (RabbitMQ's lines are
    traced back by key: its transport fields name no copy)."""
    found = set(logical.spellings)
    if logical.key is not None:
        found.add(logical.key)
    for copy in logical.copies:
        if copy.message_id:
            found |= _variants(copy.message_id)
        source = _ce_attribute(copy.headers, "source")
        ident = _ce_attribute(copy.headers, "id")
        if source is not None and ident is not None:
            found |= {f"{a} {b}" for a in _variants(source) for b in _variants(ident)}
    hashed = {
        "sha256:" + hashlib.sha256(k.encode("utf-8", "surrogateescape")).hexdigest() for k in found
    }
    logical.spellings = found | hashed


@dataclass
class Plan:
    logicals: list[Logical]
    phase1: list[Copy]
    phase2: list[Copy]

    @property
    def copies(self) -> int:
        return len(self.phase1) + len(self.phase2)


def generate(ctx: Ctx, messages: int) -> Plan:
    """At least ``messages`` copies: every class of the broker ``MIN_PER_CLASS`` times, then
    classes drawn by weight. Phase 1 is shuffled (twins of a burst stay adjacent, so they
    race; spread twins go anywhere); phase 2 follows after the duplicate window."""
    rng = ctx.rng
    specs = [s for s in SPECS if ctx.broker in s.brokers]
    counters: Counter[str] = Counter()
    logicals: list[Logical] = []

    def add(spec: Spec) -> int:
        counters[spec.name] += 1
        logical = spec.build(spec, ctx, counters[spec.name])
        _spell(logical)
        logicals.append(logical)
        return len(logical.copies)

    total = sum(add(spec) for _ in range(MIN_PER_CLASS) for spec in specs)
    weights = [s.weight for s in specs]
    while total < messages:
        total += add(rng.choices(specs, weights)[0])
    units, spread, phase2 = [], [], []
    for logical in logicals:
        unit = [c for c in logical.copies if c.phase == 1 and not c.spread]
        if unit:
            units.append(unit)
        spread += [c for c in logical.copies if c.spread]
        phase2 += [c for c in logical.copies if c.phase == 2]
    rng.shuffle(units)
    phase1 = [c for unit in units for c in unit]
    for copy in spread:
        phase1.insert(rng.randrange(len(phase1) + 1), copy)
    rng.shuffle(phase2)
    return Plan(logicals, phase1, phase2)

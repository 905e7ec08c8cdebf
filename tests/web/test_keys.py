"""``Idempotency-Key`` parsing: RFC 8941 Strings, the bare form when allowed, and the reasons
for everything else; and the request body the key's fingerprint is taken of."""

from __future__ import annotations

import pytest

from oncely import Limits
from oncely._core.keys import validate_key
from oncely.http import _GONE, _read_body, parse_key, scoped_key


@pytest.mark.parametrize(
    ("raw", "key"),
    [
        (b'"8e03978e-40d5-43e8-bc93-6894a57f9324"', "8e03978e-40d5-43e8-bc93-6894a57f9324"),
        (b'  "k"  ', "k"),
        (b'"a\\"b"', 'a"b'),
        (b'"a\\\\b"', "a\\b"),
        (b'"a\\\\\\"b"', 'a\\"b'),
        (b'"k";v=1', "k"),  # parameters are allowed by the grammar, and ignored
        (b'"with space"', "with space"),
    ],
)
def test_r19_a_structured_field_string_is_the_key(raw: bytes, key: str) -> None:
    assert parse_key([raw]) == key


@pytest.mark.parametrize(
    ("raw", "why"),
    [
        (b"bare", "quoted string"),
        (b'"open', "not closed"),
        (b'"a"b', "text after"),
        (b'"a\\x"', "invalid escape"),
        (b'""', "empty"),
        ('"\u00e9"'.encode(), "not ASCII"),
        (b'"tab\there"', "outside printable"),
    ],
)
def test_r19_anything_else_is_refused_with_its_reason(raw: bytes, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        parse_key([raw])


def test_r19_the_bare_form_when_allowed_names_the_same_key_and_two_headers_are_refused() -> None:
    assert parse_key([b"K-7"], bare=True) == parse_key([b'"K-7"']) == "K-7"
    assert parse_key([]) is None
    with pytest.raises(ValueError, match="more than once"):
        parse_key([b'"a"', b'"b"'])


@pytest.mark.parametrize(
    ("messages", "limit", "body"),
    [
        ([(b"one", False)], 10, b"one"),  # one message: the common case
        ([(b"one", False)], 2, None),  # over the limit
        ([(b"", False)], 0, b""),
        ([(b"ab", True), (b"cd", True), (b"", False)], 10, b"abcd"),  # in parts
        ([(b"ab", True), (b"cd", False)], 3, None),  # parts over the limit
        ([(b"ab", True), None], 10, _GONE),  # the client went away mid-body: never the body
        ([None], 10, _GONE),
    ],
)
async def test_the_request_body_is_read_whole_up_to_the_limit(
    messages: list[tuple[bytes, bool] | None], limit: int, body: bytes | None
) -> None:
    """What the middleware fingerprints: the body whole, in one message or many (None: over
    ``max_request_bytes``; ``_GONE``: the client disconnected before its body ended)."""
    given = [
        {"type": "http.disconnect"}
        if m is None
        else {"type": "http.request", "body": m[0], "more_body": m[1]}
        for m in messages
    ]

    async def receive() -> dict[str, object]:
        return given.pop(0)

    read = await _read_body(receive, limit)
    assert read is body if body is _GONE else (read == body and read is not _GONE)


def test_r19_a_short_scoped_key_is_as_it_always_was() -> None:
    # Records written before long keys were shortened stay readable: same text.
    made = scoped_key("auth:ab12", "POST", "/orders/7", "k-1")
    assert made == "http:auth%3Aab12:POST:/orders/7:k-1"
    assert scoped_key("a:b", "POST", "/x%y", "k:1") == "http:a%3Ab:POST:/x%25y:k%3A1"
    assert scoped_key("anonymous", "POST", "/caf\u00e9", "k") == "http:anonymous:POST:/caf\u00e9:k"


def test_r19_a_long_scoped_key_fits_and_never_merges_two_requests() -> None:
    limits = Limits()
    path, key = "/" + "p" * 399, "k" * 200
    long = scoped_key("anonymous", "POST", path, key)
    assert len(long.encode()) <= limits.max_key_bytes and validate_key(long, limits) == long
    assert long.endswith(":" + key)  # the client's key stays readable
    # Two long paths alike but for their end, two long principals: distinct scopes.
    assert scoped_key("anonymous", "POST", path[:-1] + "q", key) != long
    assert scoped_key("u" * 300 + "1", "POST", path, key) != scoped_key(
        "u" * 300 + "2", "POST", path, key
    )
    # A digest never reads as a plain part, even one that spells it out.
    digest = long.split(":")[3]
    assert digest.startswith("%sha256-") and len(digest) == 8 + 64
    assert scoped_key("anonymous", "POST", digest, key) != long
    # What no key may hold (a NUL, a lone surrogate) is a digest too, distinct from its
    # neighbours.
    seen = {
        scoped_key(who, "POST", p, "k")
        for who, p in [("a", "/x\x00"), ("a", "/x\x00\x00"), ("a\ud800", "/x"), ("a\ud801", "/x")]
    }
    assert len(seen) == 4
    for made in seen:
        assert validate_key(made, limits) == made
    # Under a small limit the whole key becomes one digest; without a limit nothing is.
    assert scoped_key("anonymous", "POST", path, key, max_bytes=100).count(":") == 1
    assert scoped_key("anonymous", "POST", path, key, max_bytes=None) == (
        f"http:anonymous:POST:{path}:{key}"
    )

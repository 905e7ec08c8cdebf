"""``Idempotency-Key`` parsing: RFC 8941 Strings, the bare form when allowed, and the reasons
for everything else; and the request body the key's fingerprint is taken of."""

from __future__ import annotations

import pytest

from oncely.http import _GONE, _read_body, parse_key


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

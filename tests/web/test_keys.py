"""``Idempotency-Key`` parsing: RFC 8941 Strings, the bare form when allowed, and the reasons
for everything else."""

from __future__ import annotations

import pytest

from oncely.http import parse_key


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

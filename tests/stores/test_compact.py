"""The compact form of tokens and fingerprints (SQLite and MariaDB, schema version 2): every
value reads back as exactly the text written, oncely's own shapes take 16 and 17 bytes, and a
row written in text form reads back unchanged."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

import oncely
from oncely._core.inbox_rules import new_token
from oncely.stores._compact import (
    pack_fingerprint,
    pack_token,
    unpack_fingerprint,
    unpack_token,
)

TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=80)


def test_oncelys_own_tokens_and_fingerprints_take_16_and_17_bytes() -> None:
    token = new_token()
    fingerprint = oncely.fingerprint({"order": 1})
    assert len(pack_token(token)) == 16 and unpack_token(pack_token(token)) == token
    packed = pack_fingerprint(fingerprint)
    assert packed is not None and len(packed) == 17
    assert unpack_fingerprint(packed) == fingerprint


@given(TEXT)
def test_any_token_reads_back_as_written(token: str) -> None:
    assert unpack_token(pack_token(token)) == token


@given(TEXT)
def test_any_fingerprint_reads_back_as_written(fingerprint: str) -> None:
    assert unpack_fingerprint(pack_fingerprint(fingerprint)) == fingerprint


def test_values_that_could_pass_for_packed_ones_are_escaped() -> None:
    for token in ("0123456789abcdef", "\x00", "\x00abc", "ABCDEF0123456789ABCDEF0123456789"):
        assert unpack_token(pack_token(token)) == token
    for fingerprint in ("\x01" + "a" * 16, "\x00", "v1:" + "A" * 32, "v2:" + "a" * 32):
        assert unpack_fingerprint(pack_fingerprint(fingerprint)) == fingerprint
    assert pack_fingerprint(None) is None and unpack_fingerprint(None) is None


def test_a_row_in_text_form_reads_back_unchanged() -> None:
    token, fingerprint = new_token(), oncely.fingerprint("x")
    assert unpack_token(token) == token  # SQLite hands back a TEXT value as str
    assert unpack_token(token.encode()) == token  # MariaDB as the text's bytes
    assert unpack_fingerprint(fingerprint) == fingerprint
    assert unpack_fingerprint(fingerprint.encode()) == fingerprint

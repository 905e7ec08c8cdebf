"""Text read off the wire, kept lossless.

Brokers carry ids and headers as bytes; most are UTF-8 text, but nothing forces a producer to
send UTF-8 (AMQP short strings, Redis stream fields and NATS header values are all plain
octets). Decoding with ``errors="replace"`` would turn ``b"inv-\\xff"`` and ``b"inv-\\xfe"`` into
the same text, and so two different messages into one dedup key. Instead, every adapter decodes
with ``surrogateescape`` (PEP 383): each byte that is not part of valid UTF-8 becomes one code
point in U+DC80..U+DCFF, and :func:`raw_bytes` gives the exact bytes back. Such text is never
accepted as a dedup key (the key sources refuse it and name the field), so it cannot collide
with anything; it is still shown, escaped, in logs and dead-letter reasons.
"""

from __future__ import annotations

__all__ = [
    "Repeated",
    "describe_bytes",
    "escaped",
    "printable",
    "raw_bytes",
    "undecodable_reason",
    "wire_text",
]


class Repeated(str):
    """A header a message carries more than once under one name with different values (a
    Kafka record may repeat a name): it reads as its first value, as it always did, and holds
    every value in ``values``. No key source takes it as a key: which of its values is the
    message's cannot be told, and two messages that share the first would become one key."""

    values: tuple[str, ...]

    def __new__(cls, values: tuple[str, ...]) -> Repeated:
        made = super().__new__(cls, values[0])
        made.values = values
        return made

    def refusal(self, header: str) -> str:
        """Why it is no key, naming ``header`` and its values."""
        shown = ", ".join(repr(printable(v)) for v in self.values)
        return (
            f"the message has {len(self.values)} {header!r} headers with different values "
            f"({shown}) and nothing says which is its key; have the producer send one"
        )


def wire_text(raw: bytes | bytearray | memoryview) -> str:
    """``raw`` as text: UTF-8, with any byte that is not valid UTF-8 kept as an escape code
    point (lossless: :func:`raw_bytes` inverts it)."""
    return bytes(raw).decode("utf-8", "surrogateescape")


def escaped(text: str) -> bool:
    """True when ``text`` holds bytes that were not valid UTF-8 (or any lone surrogate)."""
    if text.isascii():
        return False
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def raw_bytes(text: str) -> bytes:
    """The bytes :func:`wire_text` decoded ``text`` from."""
    return text.encode("utf-8", "surrogateescape")


def describe_bytes(text: str, *, limit: int = 48) -> str:
    """``text``'s bytes for a person: ``b'inv-\\xff'``, cut after ``limit`` bytes."""
    try:
        data = raw_bytes(text)
    except UnicodeEncodeError:  # a lone surrogate that no byte decodes to
        return ascii(text)
    if len(data) > limit:
        return f"{data[:limit]!r}... ({len(data)} bytes)"
    return repr(data)


def undecodable_reason(field: str, text: str) -> str:
    """Why a delivery whose ``field`` holds ``text`` (with escaped bytes) is refused."""
    return (
        f"the {field} is not UTF-8 text ({describe_bytes(text)}); oncely never guesses "
        "another encoding, so two different ids cannot become one: have the producer send "
        "UTF-8"
    )


_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def printable(text: str) -> str:
    """``text`` safe for one line of a text log: every character that is not printable (a
    newline, a control character, an escaped byte) written as an escape, so a key or reason
    holding ``"\\nERROR outcome=processed"`` cannot forge a log line. ``text`` itself when it
    is printable already (the common case, one C-level check)."""
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() else _escape(ch) for ch in text)


def _escape(ch: str) -> str:
    named = _NAMED.get(ch)
    if named is not None:
        return named
    code = ord(ch)
    if 0xDC80 <= code <= 0xDCFF:  # a byte that was not UTF-8 (see wire_text)
        return f"\\x{code - 0xDC00:02x}"
    if code <= 0xFF:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}"

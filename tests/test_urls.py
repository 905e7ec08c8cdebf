"""Opening stores from URLs (the only way the CLI and config files name a store)."""

from __future__ import annotations

from pathlib import Path

import pytest

import oncely


def test_sqlite_urls_open_sqlite_stores(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    relative = oncely.open("sqlite:///rel.db?table=t1&synchronous=normal&busy_timeout=2.5")
    assert isinstance(relative, oncely.SQLiteStore) and relative.table == "t1"
    relative.migrate()
    assert (tmp_path / "rel.db").exists()
    absolute = oncely.open(f"sqlite:///{tmp_path}/abs.db?pool_size=2&migrate=false")
    assert isinstance(absolute, oncely.SQLiteStore)
    with pytest.raises(oncely.SchemaMissing):
        absolute.get("c", "k")
    assert isinstance(oncely.open_async("sqlite:///:memory:"), oncely.AsyncSQLiteStore)
    assert isinstance(oncely.open("memory://"), oncely.MemoryStore)
    assert isinstance(oncely.open_async("memory://"), oncely.AsyncMemoryStore)


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("kafka://broker:9092", "unsupported store URL scheme 'kafka'"),
        ("sqlite://host/x.db", "has no host"),
        ("sqlite:///", "names no file"),
        ("sqlite:///x.db?colour=blue", "unknown option 'colour'"),
        ("sqlite:///x.db?synchronous=sometimes", "synchronous must be one of"),
        ("sqlite:///x.db?pool_size=many", "pool_size must be a whole number"),
        ("sqlite:///x.db?migrate=perhaps", "migrate must be true or false"),
        ("sqlite:///x.db?table=bad-name", "not a plain identifier"),
        ("dynamodb://h:8000/t_1?colour=blue", "unknown option 'colour'"),
        ("dynamodb://h:8000", "names no table"),
    ],
)
def test_bad_urls_say_what_is_wrong(url: str, message: str) -> None:
    with pytest.raises(oncely.ConfigurationError, match=message):
        oncely.open(url)


def test_passwords_are_redacted() -> None:
    url = "postgresql://app:s3cret@db.internal:5432/orders"
    assert oncely.redact(url) == "postgresql://app:***@db.internal:5432/orders"
    assert oncely.redact("sqlite:///x.db") == "sqlite:///x.db"
    with pytest.raises(oncely.ConfigurationError) as raised:
        oncely.open("weird://user:hunter2@host/db")
    assert "hunter2" not in str(raised.value)


def test_malformed_urls_are_configuration_errors_and_never_leak() -> None:
    with pytest.raises(oncely.ConfigurationError, match="not a valid URL") as raised:
        oncely.open("postgresql://u:pw@[bad/x")
    assert "pw" not in str(raised.value)
    assert oncely.redact("sqlite://u:pw@[bad/x") == "sqlite://***(unparsable URL)"


def test_passwords_in_query_options_are_redacted_too() -> None:
    url = "postgresql://u@h/db?sslmode=require&password=s3cret&Password=two"
    assert oncely.redact(url) == "postgresql://u@h/db?sslmode=require&password=***&Password=***"
    assert oncely.redact("redis://h/0?password=s3cret") == "redis://h/0?password=***"
    assert oncely.redact("redis://h/0?db=1") == "redis://h/0?db=1"
    # Nothing to mask: the URL as written (urlunsplit would drop sqlite:///'s empty host).
    assert oncely.redact("sqlite:///x.db?table=t") == "sqlite:///x.db?table=t"

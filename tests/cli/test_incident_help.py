"""What an operator reads during an incident: the inbox commands do not send them the wrong
way when they forget --store, misspell a consumer, or look for the stuck claims among the
running ones."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.cli.helpers import run, url_of


def test_a_forgotten_store_says_so_and_does_not_suggest_creating_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: "no SQLite database at oncely.db; create it with `oncely migrate`", which
    made an empty database the operator then found no records in."""
    monkeypatch.chdir(tmp_path)
    for command in (["stats"], ["list"], ["show", "--consumer", "c", "k"]):
        result = run("inbox", *command)
        assert result.exit_code == 4, result.stderr
        assert "no --store given and $ONCELY_STORE is not set" in result.stderr
        assert "sqlite:///oncely.db" in result.stderr and "migrate" not in result.stderr
    assert not (tmp_path / "oncely.db").exists()
    typed = run("inbox", "stats", "--store", "sqlite:///oncely.db")  # asked for: as before
    assert typed.exit_code == 4 and "oncely migrate --store" in typed.stderr


def test_list_tells_stale_claims_from_live_ones(db: Path) -> None:
    """Before, both were `in_progress`: the stuck claim could not be told from the running."""
    table = run("inbox", "list", "--store", url_of(db), "--consumer", "email")
    assert table.exit_code == 0, table.stderr
    lines = {line.split("│")[2].strip(): line for line in table.stdout.splitlines()
             if line.startswith("│")}  # fmt: skip
    assert "│ live " in lines["msg-live"] and "│ stale " in lines["msg-stale"]
    page = json.loads(run("inbox", "list", "--store", url_of(db), "--json").stdout)
    lease = {r["key"]: (r["live"], r["stale"]) for r in page["records"] if r["consumer"] == "email"}
    assert lease == {"msg-live": (True, False), "msg-stale": (False, True)}


def test_a_misspelt_consumer_is_named_as_the_likely_cause(db: Path) -> None:
    """Before: "never processed, forgotten, or expired", read as "the message never came"."""
    for command in (["show"], ["forget", "--yes"], ["resolve", "--completed", "1"]):
        result = run("inbox", *command, "--store", url_of(db), "--consumer", "biling", "order-1")
        assert result.exit_code == 1, result.stderr
        assert "consumer 'biling' has no live record at all in this store" in result.stderr
    known = run("inbox", "show", "--store", url_of(db), "--consumer", "billing", "order-99")
    assert known.exit_code == 1 and "never processed, forgotten, or expired" in known.stderr

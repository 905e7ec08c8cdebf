"""The ``oncely`` command line: the help of every command, and ``oncely migrate`` against
real SQLite files (and the memory store).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.cli.helpers import rows, run, url_of

# ----------------------------------------------------------------------------- help


def test_help_documents_every_command_and_the_exit_codes() -> None:
    result = run("--help")
    assert result.exit_code == 0
    for command in ("demo", "migrate", "inbox", "retention"):
        assert command in result.stdout
    assert "Exit codes" in result.stdout
    for line in ("0  success", "3  store unavailable", "4  schema problem"):
        assert line in result.stdout
    assert "ONCELY_STORE" in result.stdout


@pytest.mark.parametrize(
    "command",
    [
        ["demo"],
        ["migrate"],
        ["retention"],
        ["inbox"],
        ["inbox", "stats"],
        ["inbox", "list"],
        ["inbox", "show"],
        ["inbox", "purge"],
        ["inbox", "forget"],
    ],
)
def test_every_command_has_help(command: list[str]) -> None:
    result = run(*command, "--help")
    assert result.exit_code == 0, result.stderr
    assert "Usage: oncely " + " ".join(command) in result.stdout
    # A real description, not just the option list.
    description = result.stdout.split("Options:")[0].splitlines()[2:]
    assert any(line.strip() for line in description)


@pytest.mark.parametrize("command", [["migrate"], ["consume"], ["inbox", "stats"]])
def test_the_store_option_names_every_built_in_store(command: list[str]) -> None:
    """``--store``'s help is where a user looks for a URL's form: DynamoDB's was missing,
    though ``dynamodb://`` works there like the others."""
    result = run(*command, "--help")
    assert result.exit_code == 0, result.stderr
    said = " ".join(result.stdout.split())
    for form in ("sqlite:///", "postgresql://", "mysql://", "redis://", "memory://"):
        assert form in said, (form, said)
    assert "dynamodb://host:port/table" in said and "dynamodb:///table?region=" in said, said


# -------------------------------------------------------------------------- migrate


def test_migrate_creates_the_schema_and_is_repeatable(tmp_path: Path) -> None:
    path = tmp_path / "fresh.db"
    first = run("migrate", "--store", url_of(path))
    assert first.exit_code == 0, first.stderr
    assert "schema version 2 ready" in first.stdout
    assert rows(path, "SELECT value FROM oncely_inbox_meta WHERE name = 'schema_version'") == [
        ("2",)
    ]
    second = run("migrate", "--store", url_of(path))
    assert second.exit_code == 0
    assert "already in place" in second.stdout


def test_migrate_uses_oncely_store_from_the_environment(tmp_path: Path) -> None:
    path = tmp_path / "env.db"
    result = run("migrate", env={"ONCELY_STORE": url_of(path)})
    assert result.exit_code == 0, result.stderr
    assert path.exists()
    assert str(path) in result.stdout


def test_migrate_defaults_to_oncely_db_in_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    result = run("migrate")
    assert result.exit_code == 0, result.stderr
    assert "sqlite:///oncely.db" in result.stdout
    assert (tmp_path / "oncely.db").exists()


def test_migrate_memory_store() -> None:
    result = run("migrate", "--store", "memory://")
    assert result.exit_code == 0
    assert "schema version 1" in result.stdout

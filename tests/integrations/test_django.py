"""oncely's Django app on the real databases: Django's own test runner (``manage.py test``)
runs ``tests/integrations/django_project/shop/tests.py`` in a process of its own on SQLite,
PostgreSQL and MariaDB, creating the test database and applying oncely's migration to it
(R7: marker and ORM rows commit together; R3, R9, R11)."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests.services import MYSQL_URL, POSTGRES_DSN, require

pytest.importorskip("django")

PROJECT = Path(__file__).parent / "django_project"
SRC = Path(__file__).resolve().parents[2] / "src"


def _database(kind: str, tmp_path: Path) -> str:
    name = f"oncely_dj_{uuid.uuid4().hex[:8]}"
    if kind == "sqlite":
        return f"sqlite:{tmp_path / 'shop.db'}"
    if kind == "postgresql":
        require("PostgreSQL", POSTGRES_DSN, 5432)
        return f"postgresql:{POSTGRES_DSN.rsplit('/', 1)[0]}/{name}"
    require("MariaDB", MYSQL_URL, 3306)
    return f"mysql:{MYSQL_URL.rsplit('/', 1)[0]}/{name}"


def _env(database: str, **extra: str) -> dict[str, str]:
    """The environment of a ``manage.py`` process of the test project on ``database``."""
    return {
        **os.environ,
        "ONCELY_TEST_DJANGO_DB": database,
        "PYTHONPATH": os.pathsep.join([str(SRC), str(PROJECT)]),
        "DJANGO_SETTINGS_MODULE": "site_config.settings",
        **extra,
    }


def _manage(env: dict[str, str], *argv: str) -> str:
    """``manage.py argv`` run in the test project; its output, once it has exited 0."""
    done = subprocess.run(
        [sys.executable, "manage.py", *argv],
        cwd=PROJECT, env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


@pytest.mark.parametrize("kind", ["sqlite", "postgresql", "mysql"])
def test_r7_djangos_test_runner_passes_the_atomic_tests(kind: str, tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "manage.py", "test", "shop", "--noinput", "-v", "2"],
        cwd=PROJECT, env=_env(_database(kind, tmp_path)), capture_output=True, text=True,
        timeout=300, check=False,
    )  # fmt: skip
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert "Ran 11 tests" in out and "\nOK" in out, out
    assert "Applying oncely.0001_initial... OK" in out, out


def test_manage_py_oncely_is_the_oncely_command_on_the_projects_database(tmp_path: Path) -> None:
    env = _env(_database("sqlite", tmp_path))
    assert "Applying oncely.0001_initial... OK" in _manage(env, "migrate", "--noinput")
    stats = _manage(env, "oncely", "inbox", "stats", "--json")
    assert str(tmp_path / "shop.db") in stats and '"total": 0' in stats.replace(": ", ": ")


def test_manage_py_oncely_reads_the_database_the_routers_give_oncely(tmp_path: Path) -> None:
    """A project whose database router keeps oncely's records in a database of their own
    (``ledger``): ``migrate --database ledger`` makes the table there, and
    ``manage.py oncely inbox stats`` reads it there. Before, the command read ``default``,
    where there is no oncely table, and told the operator to run ``oncely migrate``."""
    ledger = tmp_path / "ledger.db"
    env = _env(_database("sqlite", tmp_path), ONCELY_TEST_DJANGO_LEDGER=str(ledger))
    _manage(env, "migrate", "--noinput")
    assert "Applying oncely.0001_initial... OK" in _manage(env, "migrate", "--database", "ledger")
    stats = _manage(env, "oncely", "inbox", "stats", "--json")
    assert str(ledger) in stats and '"total": 0' in stats

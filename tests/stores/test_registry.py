"""Stores are found by URL scheme through the ``oncely.stores`` entry points, oncely's own
included; a package adds a scheme without any change to oncely."""

from __future__ import annotations

from importlib.metadata import entry_points

import pytest

import oncely
from oncely.stores import ENTRY_POINT_GROUP, backend_for, schemes
from oncely.stores._backend import built_in
from tests.backends import shelf


def test_oncelys_own_stores_are_registered_as_entry_points() -> None:
    """The installed metadata (pyproject.toml) names exactly the store folders' backends and
    schemes: adding a store is its folder plus its entry-point line."""
    found = {
        e.name: e.value
        for e in entry_points(group=ENTRY_POINT_GROUP)
        if e.value.startswith("oncely.")
    }
    assert found == dict(built_in())
    assert set(found) == {
        "memory",
        "sqlite",
        "postgresql",
        "postgres",
        "mysql",
        "mariadb",
        "redis",
        "rediss",
        "dynamodb",
    }


def test_a_store_of_another_package_is_found_by_its_entry_point() -> None:
    assert shelf.PLUGINS.is_dir()
    assert "shelf" in schemes()
    backend = backend_for("shelf:///tmp/x")
    assert type(backend).__name__ == "Backend" and backend.sync == "oncely_shelf:ShelfStore"


def test_an_unknown_scheme_lists_the_known_ones_and_how_to_add_one() -> None:
    with pytest.raises(oncely.ConfigurationError) as raised:
        oncely.open("cassandra://db/keyspace")
    text = str(raised.value)
    assert "unsupported store URL scheme 'cassandra'" in text
    assert "sqlite://" in text and "shelf://" in text and "'oncely.stores' entry point" in text


def test_a_package_cannot_take_over_oncelys_schemes(monkeypatch: pytest.MonkeyPatch) -> None:
    from importlib.metadata import EntryPoint

    from oncely.stores import _backend

    rogue = EntryPoint("sqlite", "rogue:backend", ENTRY_POINT_GROUP)
    monkeypatch.setattr(_backend, "entry_points", lambda group: [rogue])
    assert backend_for("sqlite:///x.db") is oncely.stores.sqlite.backend

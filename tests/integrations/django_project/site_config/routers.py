"""A database router that keeps oncely's records in the ``ledger`` database and everything
else in ``default``, as a project with a database of its own for them would."""

from __future__ import annotations

from typing import Any


class OncelyToLedger:
    def db_for_read(self, model: Any, **hints: Any) -> str:
        return "ledger" if model._meta.app_label == "oncely" else "default"

    def db_for_write(self, model: Any, **hints: Any) -> str:
        return self.db_for_read(model)

    def allow_migrate(self, db: str, app_label: str, **hints: Any) -> bool:
        return (db == "ledger") == (app_label == "oncely")

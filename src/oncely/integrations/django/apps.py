"""The Django app of oncely's inbox: ``INSTALLED_APPS += ["oncely.integrations.django"]``."""

from __future__ import annotations

from typing import Any

from django.apps import AppConfig


class OncelyConfig(AppConfig):  # type: ignore[misc] # Django ships no type information
    """App label ``oncely``: its migration creates the inbox's tables (oncely's own schema,
    written by the store) on each database Django migrates, and ``manage.py oncely`` runs the
    consumer and oncely's inbox commands on them."""

    name = "oncely.integrations.django"
    label = "oncely"
    verbose_name = "oncely inbox"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        _close_before_dropping_test_databases()


def _close_before_dropping_test_databases() -> None:
    """Wrap Django's ``destroy_test_db`` (used by its test runner and by pytest-django) so
    that oncely's store connections to a test database are closed before it is dropped:
    PostgreSQL refuses to drop a database others are connected to."""
    from django.db.backends.base.creation import BaseDatabaseCreation  # noqa: PLC0415

    from oncely.integrations.django.databases import close_stores  # noqa: PLC0415

    original = BaseDatabaseCreation.destroy_test_db
    if getattr(original, "_oncely", False):
        return

    def destroy_test_db(creation: Any, *args: Any, **kwargs: Any) -> Any:
        close_stores(creation.connection.alias)
        return original(creation, *args, **kwargs)

    destroy_test_db._oncely = True  # type: ignore[attr-defined]
    BaseDatabaseCreation.destroy_test_db = destroy_test_db

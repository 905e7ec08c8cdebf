"""``python manage.py oncely``: oncely's command line on a database of ``settings.DATABASES``:
``oncely``'s own command with ``--store`` set to the database (``--database``; by default
the one the project's database routers write oncely's records to, ``default`` without
routers): ``manage.py oncely inbox stats``, ``inbox list --consumer billing``,
``inbox purge``, ``migrate``, ...; and ``manage.py oncely consume --handler app.module:function``,
a broker consumer whose handler's ORM writes commit with its record.
"""

from __future__ import annotations

import os
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import router

from oncely.errors import ConfigurationError
from oncely.integrations.django.databases import store_url


class Command(BaseCommand):  # type: ignore[misc] # Django ships no type information
    help = (
        "the oncely command (consume, inbox stats, inbox list, inbox purge, migrate, ...) on "
        "the project's database --database"
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--database",
            default=None,
            help="database alias (default: where the database routers put oncely's records)",
        )
        parser.add_argument("what", help="an oncely command (inbox, migrate, ...)")
        parser.add_argument("rest", nargs="...")

    def handle(self, *args: Any, **options: Any) -> None:
        database: str = options["database"] or _routed()
        what: str = options["what"]
        rest: list[str] = list(options["rest"])
        try:
            url = store_url(database)
        except ConfigurationError as exc:
            raise CommandError(str(exc)) from None
        os.environ["ONCELY_STORE"] = url
        # click is needed only here
        from oncely.integrations.django._command import django_cli  # noqa: PLC0415

        django_cli(database).main(args=[what, *rest], prog_name="manage.py oncely")


def _routed() -> str:
    """The alias the project's database routers write oncely's records to (``default``
    without routers): where ``migrate`` made its table."""
    from oncely.integrations.django.models import InboxRecord  # noqa: PLC0415 - apps ready

    return str(router.db_for_write(InboxRecord))

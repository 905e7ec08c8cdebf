"""The example's settings: oncely's app next to the project's own, one SQLite database in
``$SHOP_DIR`` (the inbox table lives in it, next to ``orders_charge``)."""

import os
from pathlib import Path

SECRET_KEY = "example-only"
USE_TZ = True
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
INSTALLED_APPS = ["oncely.integrations.django", "orders"]
ONCELY_INBOX = {"table": "oncely_inbox"}  # the default; a schema on PostgreSQL: "schema"

DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": Path(os.environ.get("SHOP_DIR", ".")) / "shop.db",
        # Writers take the lock when the transaction starts, and wait for it: worker threads
        # then queue up instead of failing with "database is locked".
        "OPTIONS": {"transaction_mode": "IMMEDIATE", "timeout": 20},
    }
}

"""Settings of the Django project the tests run (``tests/integrations/test_django.py``): the
database from ``ONCELY_TEST_DJANGO_DB`` (``sqlite:PATH``, ``postgresql:URL`` or ``mysql:URL``),
Redis for the handler's start counts from ``ONCELY_TEST_REDIS_URL``."""

from __future__ import annotations

import os
from urllib.parse import unquote, urlsplit

import pymysql

pymysql.install_as_MySQLdb()  # Django's MySQL backend on PyMySQL, which oncely joins

SECRET_KEY = "tests-only"
DEBUG = False
USE_TZ = True
INSTALLED_APPS = ["oncely.integrations.django", "shop"]
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
CONN_MAX_AGE = None

kind, _, where = os.environ["ONCELY_TEST_DJANGO_DB"].partition(":")
if kind == "sqlite":
    DATABASES = {
        "default": {
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": where,
            "OPTIONS": {"transaction_mode": "IMMEDIATE", "timeout": 20},
            "TEST": {"NAME": where + ".test"},
            "CONN_MAX_AGE": None,
        }
    }
else:
    url = urlsplit(where)
    DATABASES = {
        "default": {
            "ENGINE": f"django.db.backends.{kind}",
            "NAME": url.path.lstrip("/"),
            "USER": unquote(url.username or ""),
            "PASSWORD": unquote(url.password or ""),
            "HOST": url.hostname or "",
            "PORT": str(url.port or ""),
            "CONN_MAX_AGE": None,
        }
    }
if os.environ.get("ONCELY_TEST_DJANGO_LEDGER"):  # oncely's records in a database of their own
    DATABASES["ledger"] = {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": os.environ["ONCELY_TEST_DJANGO_LEDGER"],
    }
    DATABASE_ROUTERS = ["site_config.routers.OncelyToLedger"]
LOGGING = {
    "version": 1,
    "handlers": {"console": {"class": "logging.StreamHandler"}},
    "root": {"handlers": ["console"], "level": "WARNING"},
    "loggers": {"oncely.broker": {"level": "INFO"}, "oncely.django": {"level": "INFO"}},
}

"""Exit codes, and the translation of oncely's errors into one line on stderr.

Every command runs inside :class:`OncelyGroup`, which turns an :class:`~oncely.OncelyError`
into a :class:`CliError` carrying the exit code for its kind, so no command repeats the
mapping and no traceback reaches a user (``oncely --debug`` shows it instead).
"""

from __future__ import annotations

import re
from typing import Any, Final
from urllib.parse import unquote, urlsplit

import click

from oncely._core.said import said
from oncely.errors import (
    BrokerError,
    BrokerUnavailable,
    ConfigurationError,
    OncelyError,
    RetentionTooShort,
    SchemaError,
    StoreUnavailable,
)

__all__ = [
    "BROKER_ERROR",
    "CHECK_FAILED",
    "OK",
    "SCHEMA",
    "STORE_ERROR",
    "STORE_UNAVAILABLE",
    "USAGE",
    "CliError",
    "OncelyGroup",
    "remember_secrets",
]

OK: Final = 0
CHECK_FAILED: Final = 1
USAGE: Final = 2
STORE_UNAVAILABLE: Final = 3
SCHEMA: Final = 4
STORE_ERROR: Final = 5
BROKER_ERROR: Final = 6

_SECRETS_KEY: Final = "oncely.secrets"
_DEBUG_KEY: Final = "oncely.debug"


class CliError(click.ClickException):
    """An error shown as ``Error: <message>`` on stderr; the process exits with ``code``.

    click reads ``exit_code`` from the class, so each code gets a small subclass.
    """

    def __new__(cls, message: str, code: int) -> CliError:
        return super().__new__(_ERROR_CLASSES.get(code, cls))

    def __init__(self, message: str, code: int) -> None:
        super().__init__(_one_line(message))


def _error_class(code: int) -> type[CliError]:
    return type(f"CliError{code}", (CliError,), {"exit_code": code, "__module__": __name__})


_ERROR_CLASSES: Final[dict[int, type[CliError]]] = {
    code: _error_class(code)
    for code in (CHECK_FAILED, USAGE, STORE_UNAVAILABLE, SCHEMA, STORE_ERROR, BROKER_ERROR)
}


def _one_line(message: str) -> str:
    return re.sub(r"\s*\n\s*", " ", message).strip()


def remember_secrets(url: str) -> None:
    """Note the password in ``url`` so that no error message can show it.

    oncely's own messages already redact URLs (:func:`oncely.redact`); this is the second
    lock on the door, for messages built from driver text.
    """
    try:
        password = urlsplit(url).password
    except ValueError:
        return
    if not password:
        return
    ctx = click.get_current_context(silent=True)
    if ctx is None:
        return
    secrets: set[str] = ctx.meta.setdefault(_SECRETS_KEY, set())
    secrets.update({password, unquote(password)})


def scrub(message: str, ctx: click.Context) -> str:
    """``message`` with every remembered password replaced by ``***``."""
    secrets: set[str] = ctx.meta.get(_SECRETS_KEY, set())
    for secret in sorted(secrets, key=len, reverse=True):
        if secret:
            message = message.replace(secret, "***")
    return message


def exit_code_for(exc: OncelyError) -> int:
    """The documented exit code for an oncely error."""
    if isinstance(exc, StoreUnavailable):
        return STORE_UNAVAILABLE
    if isinstance(exc, SchemaError):
        return SCHEMA
    if isinstance(exc, RetentionTooShort):
        return CHECK_FAILED
    if isinstance(exc, ConfigurationError):
        return USAGE
    if isinstance(exc, BrokerError) and not isinstance(exc, BrokerUnavailable):
        return BROKER_ERROR  # a refusal (credentials, permissions): an outage is ridden out
    return STORE_ERROR


def debug_enabled(ctx: click.Context) -> bool:
    return bool(ctx.meta.get(_DEBUG_KEY, False))


def enable_debug(ctx: click.Context, enabled: bool) -> None:
    ctx.meta[_DEBUG_KEY] = enabled


class OncelyGroup(click.Group):
    """A group whose commands' oncely errors become one line on stderr and an exit code."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except click.ClickException as exc:
            if debug_enabled(ctx) or scrub(exc.message, ctx) == exc.message:
                raise
            raise CliError(scrub(exc.format_message(), ctx), exc.exit_code) from None
        except (click.exceptions.Exit, click.Abort, BrokenPipeError):
            raise  # click exits quietly for these (a closed pipe: `oncely inbox list | head`)
        except OncelyError as exc:
            if debug_enabled(ctx):
                raise
            text = scrub(str(exc) or type(exc).__name__, ctx)
            raise CliError(f"{text}", exit_code_for(exc)) from None
        except Exception as exc:
            # A bug (in oncely or here): still one line, with the way to the traceback.
            if debug_enabled(ctx):
                raise
            text = scrub(f"{said(exc)}", ctx)
            raise CliError(
                f"unexpected error: {text} (run with --debug for the traceback)", STORE_ERROR
            ) from None

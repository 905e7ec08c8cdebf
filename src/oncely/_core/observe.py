"""Observability (R16): one structured log record per outcome, and hooks for metric exporters.

Log records go to the ``oncely`` logger with flat ``extra`` fields (``oncely_consumer``,
``oncely_key``, ``oncely_outcome``, ``oncely_attempt``, ``oncely_duration_ms``,
``oncely_correlation_id``, ``oncely_reason``), so a JSON formatter picks them up as they are.
A rising rate of ``duplicate`` signals producer retries or too short an ack/lock window; every
``key_conflict``, ``rejected`` and ``escalated`` is logged at ERROR because a person must look,
and an outcome that acknowledges the message but carries a reason (processed, yet the result
could not be stored) at WARNING. The HTTP layer's ``key_conflict`` is a WARNING: there the key
is a client's, and any client can reuse one (:data:`CLIENT_KEYS`). The message text escapes
control characters in every field.
"""

from __future__ import annotations

import hashlib
import logging
import traceback
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextvars import ContextVar
from typing import Any, Literal

from oncely._core.outcomes import Handled, Outcome, Released
from oncely.wire import printable

__all__ = ["Hook", "Observer", "key_for_logs", "log_error", "redact_keys"]

Hook = Callable[[Handled[object]], None]
"""Called with every outcome. Exceptions from a hook are logged and never reach the consumer."""

LOGGER = logging.getLogger("oncely")

CLIENT_KEYS: ContextVar[bool] = ContextVar("oncely_client_keys", default=False)
"""True while the HTTP layer claims the key of a client's request: a ``key_conflict`` then is
that client's mistake (a key reused for another request, answered 422), logged at WARNING,
not a producer's bug that a person must look at (ERROR, for message consumers)."""


def key_for_logs(key: str | None, mode: Literal["plain", "hash"]) -> str | None:
    if key is None or mode == "plain":
        return key
    return "h:" + hashlib.blake2b(key.encode("utf-8"), digest_size=8).hexdigest()


def redact_keys(text: str, keys: Iterable[str | None], mode: Literal["plain", "hash"]) -> str:
    """``text`` (an error's, a reason) with each of ``keys`` shown as the log lines show it:
    under ``"hash"`` every occurrence of a key, quoted (``'key'``, as oncely's errors quote
    it) or bare, is replaced by its hash, so a key that is personal data stays out of the
    line however the text came to carry it. A bare key of fewer than 4 characters is left
    (it would replace digits of counts and times; such a key is no personal data)."""
    if mode == "plain" or not text:
        return text
    for key in keys:
        if not key:
            continue
        shown = key_for_logs(key, mode)
        assert shown is not None
        text = text.replace(repr(key), repr(shown))
        if len(key) >= 4:
            text = text.replace(key, shown)
    return text


def log_error(
    logger: logging.Logger | logging.LoggerAdapter[Any],
    level: int,
    msg: str,
    *args: object,
    error: BaseException | None,
    keys: Iterable[str | None],
    mode: Literal["plain", "hash"],
    extra: Mapping[str, object] | None = None,
) -> None:
    """``logger.log(level, msg, *args, exc_info=error, extra=extra)``, with ``keys`` in the
    error shown as the log lines show keys. Under ``"hash"`` an error's text (a store's
    error, a ``KeyConflict``, a ``LeaseLost``, a handler's exception naming the key) would
    carry the key into the record's traceback: the record then holds no exception object
    (which a formatter or an error tracker reads whole) but its traceback as text, chained
    exceptions and notes included, each key replaced by its hash (``exc_text``, which
    :class:`logging.Formatter` prints as it prints a traceback)."""
    if error is None or mode == "plain":
        logger.log(level, msg, *args, exc_info=error, extra=extra, stacklevel=2)
        return
    if not logger.isEnabledFor(level):
        return
    text = "".join(traceback.format_exception(error)).rstrip("\n")
    if not isinstance(logger, logging.Logger):  # a LoggerAdapter: no records of our own made
        logger.log(level, f"{msg}\n%s", *args, redact_keys(text, keys, mode), extra=extra)
        return
    fn, lno, func, _ = logger.findCaller(stacklevel=2)
    record = logger.makeRecord(logger.name, level, fn, lno, msg, args, None, func, extra)
    record.exc_text = redact_keys(text, keys, mode)
    logger.handle(record)


class Observer:
    """Logs and fans out outcomes. One per inbox."""

    __slots__ = ("hooks", "log_keys", "logger")

    def __init__(
        self,
        *,
        hooks: Sequence[Hook] = (),
        logger: logging.Logger | None = None,
        log_keys: Literal["plain", "hash"] = "plain",
    ) -> None:
        self.hooks = tuple(hooks)
        self.logger = logger if logger is not None else LOGGER
        self.log_keys: Literal["plain", "hash"] = log_keys

    def emit(self, handled: Handled[Any]) -> None:
        """Log ``handled`` (if the logger is enabled for its level) and call every hook."""
        level = handled.log_level
        if level == logging.ERROR and handled.outcome is Outcome.KEY_CONFLICT and CLIENT_KEYS.get():
            level = logging.WARNING
        if self.logger.isEnabledFor(level):
            key = key_for_logs(handled.key, self.log_keys)
            reason = handled.reason and redact_keys(handled.reason, (handled.key,), self.log_keys)
            duration_ms = round(handled.duration_s * 1000, 3)
            extra = {
                "oncely_consumer": handled.consumer,
                "oncely_key": key,
                "oncely_outcome": handled.outcome.value,
                "oncely_action": handled.action.value,
                "oncely_attempt": handled.attempt,
                "oncely_duration_ms": duration_ms,
                "oncely_correlation_id": handled.correlation_id,
                "oncely_reason": reason,
            }
            text = "%s consumer=%s key=%s attempt=%d duration_ms=%s correlation_id=%s"
            # The text escapes what could break the line (a key holding a newline would
            # forge one); the extra fields stay exact for structured formatters.
            args: list[object] = [
                handled.outcome.value,
                handled.consumer,
                None if key is None else printable(key),
                handled.attempt,
                duration_ms,
                None if handled.correlation_id is None else printable(handled.correlation_id),
            ]
            if reason:
                text += " reason=%s"
                args.append(printable(reason))
            error = handled.error
            quiet = error is None or isinstance(error, Released)  # a reason, not a crash
            log_error(
                self.logger, level, text, *args, error=None if quiet else error,
                keys=(handled.key,), mode=self.log_keys, extra=extra,
            )  # fmt: skip
        self.notify(handled)

    def notify(self, handled: Handled[Any]) -> None:
        """Call every hook with ``handled`` (nothing logged: the caller logs it); a hook that
        raises is logged and changes nothing."""
        for hook in self.hooks:
            try:
                hook(handled)
            except Exception as exc:
                self._hook_failed(hook, handled, exc)

    def _hook_failed(self, hook: Hook, handled: Handled[Any], exc: Exception) -> None:
        """Log a hook that raised, with the message it was told about (not its outcome
        field: this line is about the hook, the outcome has its own)."""
        key = key_for_logs(handled.key, self.log_keys)
        correlation_id = handled.correlation_id
        log_error(
            self.logger,
            logging.ERROR,
            "oncely hook %r failed on %s consumer=%s key=%s correlation_id=%s; the message is "
            "unaffected",
            hook,
            handled.outcome.value,
            handled.consumer,
            None if key is None else printable(key),
            None if correlation_id is None else printable(correlation_id),
            error=exc,
            keys=(handled.key,),
            mode=self.log_keys,
            extra={
                "oncely_consumer": handled.consumer,
                "oncely_key": key,
                "oncely_correlation_id": correlation_id,
                "oncely_hook": repr(hook),
            },
        )

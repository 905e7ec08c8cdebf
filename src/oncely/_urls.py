"""Store URLs: parsing helpers shared by every store's ``from_url``, and password redaction.

Every message that shows a URL goes through :func:`redact`; option errors name the option and
the expected form, never the password.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable, Mapping
from datetime import timedelta
from urllib.parse import SplitResult, parse_qs, unquote, urlsplit, urlunsplit

from oncely.errors import ConfigurationError

__all__ = ["UrlOptions", "load_by_scheme", "redact", "split"]


_SECRET_OPTIONS = frozenset({"password", "passwd", "pass", "pwd", "secret", "token", "sslpassword"})


def redact(url: str) -> str:
    """``url`` with any password replaced by ``***``: in the user-info part and in query
    options that carry one (``?password=...``, as libpq and Redis accept). Never raises: a URL
    too malformed to parse keeps only its scheme."""
    try:
        parts = urlsplit(url)
        password = parts.password
    except ValueError:
        scheme = url.split(":", 1)[0] if ":" in url else ""
        return f"{scheme}://***(unparsable URL)"
    if password is not None:
        netloc = parts.netloc.rsplit("@", 1)
        userinfo = netloc[0].split(":", 1)[0] + ":***"
        parts = parts._replace(netloc=f"{userinfo}@{netloc[1]}")
    masked = password is not None
    if parts.query:
        pairs = []
        for pair in parts.query.split("&"):
            name, sep, _value = pair.partition("=")
            secret = unquote(name).lower() in _SECRET_OPTIONS and bool(sep)
            masked = masked or secret
            pairs.append(f"{name}{sep}***" if secret else pair)
        parts = parts._replace(query="&".join(pairs))
    if not masked:
        return url  # as written: urlunsplit would turn sqlite:///x.db?y=1 into sqlite:/x.db?y=1
    return urlunsplit(parts)


def split(url: str) -> SplitResult:
    """``urlsplit`` that raises :class:`~oncely.ConfigurationError` (without the password)
    for a URL it cannot parse, including a bad port."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - validates the host and port part
    except ValueError as exc:
        raise ConfigurationError(f"{redact(url)}: not a valid URL ({exc})") from None
    return parts


class UrlOptions:
    """The query-string options of a store URL, read one by one with their type; whatever is
    left unread at :meth:`done` is an unknown option and an error."""

    __slots__ = ("_url", "_values")

    def __init__(self, url: str, *, shown: str | None = None) -> None:
        """``shown``: the URL errors name, when ``url`` is a stand-in parsed for its query
        (a list of hosts that ``urlsplit`` cannot take)."""
        self._url = url if shown is None else shown
        query = split(url).query
        self._values = {k: v[-1] for k, v in parse_qs(query, keep_blank_values=True).items()}

    def _error(self, text: str) -> ConfigurationError:
        return ConfigurationError(f"{redact(self._url)}: {text}")

    def text(self, name: str, default: str) -> str:
        return self._values.pop(name, default)

    def optional_text(self, name: str) -> str | None:
        return self._values.pop(name, None)

    def choice(self, name: str, default: str, choices: Iterable[str]) -> str:
        allowed = tuple(choices)
        value = self._values.pop(name, default).lower()
        if value not in allowed:
            raise self._error(f"{name} must be one of {', '.join(allowed)}")
        return value

    def integer(self, name: str, default: int) -> int:
        if name not in self._values:
            return default
        try:
            return int(self._values.pop(name))
        except ValueError:
            raise self._error(f"{name} must be a whole number") from None

    def seconds(self, name: str, default: timedelta) -> timedelta:
        if name not in self._values:
            return default
        try:
            return timedelta(seconds=float(self._values.pop(name)))
        except ValueError:
            raise self._error(f"{name} must be a number of seconds") from None

    def boolean(self, name: str, default: bool) -> bool:
        if name not in self._values:
            return default
        lowered = self._values.pop(name).lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off"):
            return False
        raise self._error(f"{name} must be true or false")

    def done(
        self,
        known: Iterable[str],
        *,
        read_by: str | None = None,
        theirs: Iterable[str] = (),
        side: tuple[str, str] = ("consumer", "producer"),
    ) -> None:
        """Refuse any option nobody read. ``read_by`` names where the ``known`` options that
        were not read here are read (a constructor that takes them as keyword arguments).
        ``theirs`` are the options only the other side of the broker reads, ``side`` says
        (theirs, ours): a URL copied from a consumer to a producer (or back) is told which of
        its options belong to the other side, rather than that they are unknown."""
        if not self._values:
            return
        known = tuple(known)
        other = sorted(k for k in self._values if k in tuple(theirs))
        if other:
            them, us = side
            one = len(other) == 1
            which = f"a {them} option" if one else f"{them} options"
            raise self._error(
                f"{', '.join(repr(k) for k in other)}: {which}, which the {us} does not use; "
                f"remove {'it' if one else 'them'} from the {us}'s URL (the {us}'s options: "
                f"{', '.join(known)})"
            )
        if read_by is not None:
            elsewhere = sorted(k for k in self._values if k in known)
            if elsewhere:
                raise self._error(
                    f"{', '.join(repr(k) for k in elsewhere)} in the URL is read by {read_by}; "
                    "the constructor takes it as a keyword argument"
                )
        unknown = ", ".join(repr(k) for k in sorted(self._values))
        raise self._error(f"unknown option {unknown} (known: {', '.join(known)})")


def path_of(parts: SplitResult) -> str:
    """The unquoted path after the leading slash (a database name, a file path)."""
    path = parts.path[1:] if parts.path.startswith("/") else parts.path
    return unquote(path)


def load_by_scheme(
    url: str,
    registry: Mapping[str, tuple[str, ...]],
    aliases: Mapping[str, str],
    which: int,
    kind: str,
) -> object:
    """The class a URL's scheme names in ``registry`` (scheme -> ("module:Class", ...,
    extra), ``which`` picks the class), imported on first use so a missing optional driver is
    reported with the extra that installs it. ``kind`` ("store", "adapter") words the errors."""
    scheme = split(url).scheme.lower()
    scheme = aliases.get(scheme, scheme)
    if scheme not in registry:
        supported = sorted({*registry, *aliases})
        raise ConfigurationError(
            f"{redact(url)}: unsupported {kind} URL scheme {scheme!r}; supported: "
            + ", ".join(f"{s}://" for s in supported)
        )
    target, extra = registry[scheme][which], registry[scheme][-1]
    module_name, _, class_name = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and exc.name.startswith("oncely."):
            raise ConfigurationError(
                f"{redact(url)}: this version of oncely has no {scheme} {kind} yet"
            ) from None
        raise ConfigurationError(
            f"{redact(url)}: the {scheme} {kind} needs the {exc.name!r} package; "
            f"install it with: pip install 'oncely[{extra}]'"
        ) from None
    return getattr(module, class_name)

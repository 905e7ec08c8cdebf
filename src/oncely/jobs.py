"""Scheduled jobs run once per schedule slot: a guard for cron-like runners that overlap,
restart or fire twice.

::

    from oncely.jobs import run_once

    inbox = oncely.Inbox(oncely.open("postgresql://..."), consumer="jobs")
    handled = run_once(inbox, "daily-report", send_report, every="day", tz="Europe/Rome")

Each run is keyed by its job name and the slot it belongs to (``daily-report:2026-12-01``,
from ``every`` and the time zone ``tz``), so two runners firing for the same slot run the job
once. A run that overlaps one still running gets ``in_flight`` (it skips; with ``wait=``, it
waits for the first and gets its result); a run after the slot's job finished gets
``duplicate`` with the first run's result; a run whose job raised released the slot, so the
next run of that slot tries again (``failed``). The job holds a lease renewed while it runs:
a runner killed mid-job stops renewing, and once the lease lapses the next run of the slot
takes it over (``stale_reclaimed``), or does what the inbox's ``on_stale`` says.

Slots follow the local clock of ``tz``, daylight saving time included. When the clocks go
back, the local times they repeat are lived twice: an hourly or per-minute job runs in both
passes, the second one's key carrying its UTC offset (``hourly:2026-10-25T02`` and then
``hourly:2026-10-25T02+01:00`` in Europe/Rome); a day, week or month is one slot however long.
When the clocks go forward, the local hour they skip has no slot (the run after ``T01`` is
``T03``): no run for a time that never happens, and no real hour without one. A
``timedelta`` period is counted in UTC and takes no ``tz`` but UTC (any of its names:
``"UTC"``, ``"GMT"``, ``"Etc/Zulu"``, ``datetime.UTC``...).

``tz`` is a zone's name, a ``zoneinfo.ZoneInfo`` or a ``datetime.timezone``. A pytz zone is
read by its name through zoneinfo (pytz's zones have no ``fold``: trusted, they key both
passes of a repeated hour alike), and an ``at=`` built with ``tzinfo=`` a pytz zone (its
local mean time) is refused: use ``localize()``. Another tzinfo (dateutil's) is used as long
as the local time it gives maps back to the moment; one that does not (dateutil's
Europe/Dublin in its repeated hour) is refused with :class:`~oncely.ConfigurationError`
rather than keying two hours as one.

A slot's record must outlive the slot: a run late in the slot finds the first run's record
only if the inbox still keeps it. So the inbox's retention (and ``keep_failed``, which keeps
a rejected run) must be at least the longest the slot can last (a day 26 hours, a week 7 days
and 2 hours, a month 31 days and 2 hours: Antarctica/Troll's clocks go back two hours); a
shorter one is refused with
:class:`~oncely.ConfigurationError` before the job runs. A weekly or monthly job wants an
inbox of its own, ``Retention(keep=timedelta(days=32))`` for a monthly one.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta, timezone, tzinfo
from typing import Any, Literal, TypeVar
from zoneinfo import ZoneInfo

from oncely._core.keys import validate_key
from oncely._core.outcomes import Handled
from oncely._core.policy import Limits, Retention, format_duration
from oncely._core.typed import ANNOTATED, typed_repeat
from oncely.errors import ConfigurationError, InvalidKey
from oncely.inbox.async_inbox import AsyncInbox
from oncely.inbox.sync_inbox import Inbox

__all__ = ["Every", "run_once", "run_once_async", "slot"]

R = TypeVar("R")
Every = Literal["minute", "hour", "day", "week", "month"] | timedelta
"""A schedule's period: a calendar unit in the time zone, or a fixed span (slots counted from
the epoch, in UTC, whatever the time zone: a ``timedelta`` with a ``tz`` other than UTC is
refused)."""

_UTC_NAMES = frozenset(
    {
        *("UTC", "UCT", "Universal", "Zulu", "GMT", "GMT+0", "GMT-0", "GMT0", "Greenwich"),
        *("Etc/UTC", "Etc/UCT", "Etc/Universal", "Etc/Zulu", "Etc/GMT", "Etc/GMT+0"),
        *("Etc/GMT-0", "Etc/GMT0", "Etc/Greenwich"),
    }
)
"""The names the tz database gives UTC itself (links to ``Etc/UTC`` and ``Etc/GMT``, offset 0
for all time), as opposed to a place whose clock happens to be at +00:00 (Europe/London)."""


def _pytz_name(zone: tzinfo) -> str | None:
    """The name a pytz zone carries (``pytz.timezone("Europe/Rome").zone``), ``None`` for
    any other tzinfo. pytz's zones have no ``fold``: the two passes of a repeated hour are
    told apart only by which of its per-offset instances a datetime holds, so a zone of
    theirs is read by its name, through zoneinfo."""
    name = getattr(zone, "zone", None)
    if isinstance(name, str) and callable(getattr(zone, "localize", None)):
        return name
    return None


def _zone(tz: str | tzinfo) -> tzinfo:
    if isinstance(tz, tzinfo):
        name = _pytz_name(tz)
        if name is None or isinstance(tz, ZoneInfo | timezone):
            return tz
        try:
            return ZoneInfo(name)
        except Exception as exc:
            raise ConfigurationError(
                f"tz={tz!r} is a pytz zone, read by its name {name!r} through zoneinfo (pytz's "
                f"zones have no fold), which cannot load it: {exc}. Pass a zoneinfo.ZoneInfo "
                "or a name zoneinfo knows (install tzdata where the system has none)"
            ) from None
    try:
        return ZoneInfo(tz)
    except Exception as exc:
        raise ConfigurationError(f"unknown time zone {tz!r}: {exc}") from None


def _is_utc(zone: str | tzinfo) -> bool:
    """Whether ``zone`` is UTC itself, however spelled: a name of it (``"UTC"``, ``"GMT"``,
    ``"Etc/Zulu"``...) as a string, a ``ZoneInfo`` or a pytz zone; a ``timezone`` at +00:00
    (``datetime.UTC``); another tzinfo at +00:00 with no moment to ask about (dateutil's
    ``tzutc()``), or at +00:00 on each first of the month of a year (dateutil's
    ``gettz("UTC")``). A place at +00:00 in winter only (Europe/London) is not."""
    if isinstance(zone, str):
        return zone in _UTC_NAMES
    if isinstance(zone, ZoneInfo):
        return zone.key in _UTC_NAMES
    name = _pytz_name(zone)
    if name is not None:
        return name in _UTC_NAMES
    if zone.utcoffset(None) == timedelta(0):
        return True
    firsts = (datetime(2026, month, 1, tzinfo=zone) for month in range(1, 13))
    return all(first.utcoffset() == timedelta(0) for first in firsts)


def _repeat(local: datetime) -> str:
    """What tells the second pass of a local time the clocks repeat from the first: its UTC
    offset (``+01:00``) when ``local`` is that second pass (``fold=1``, and another offset
    than the first pass's); nothing for every other time, so those keep their key."""
    offset = local.utcoffset()
    if not local.fold or offset is None or local.replace(fold=0).utcoffset() == offset:
        return ""
    sign = "-" if offset < timedelta(0) else "+"
    minutes, seconds = divmod(int(abs(offset).total_seconds()), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{sign}{hours:02d}:{minutes:02d}" + (f":{seconds:02d}" if seconds else "")


def _check_at(moment: datetime) -> None:
    """Refuse an ``at=`` written with ``tzinfo=`` a pytz zone: pytz attaches that way the
    zone's first offset (its local mean time, +00:50 in Rome), not the offset of that date,
    so the datetime is another moment than the one its wall time says."""
    zone = moment.tzinfo
    normalize = getattr(zone, "normalize", None)
    if zone is None or _pytz_name(zone) is None or not callable(normalize):
        return
    if normalize(moment).replace(tzinfo=None) != moment.replace(tzinfo=None):
        raise ConfigurationError(
            f"at={moment!r} holds a pytz zone attached with tzinfo=, which gives it the zone's "
            f"first offset ({moment:%z}), not the one of that date: build it with the zone's "
            "localize() (zone.localize(datetime(...), is_dst=...)), or use zoneinfo "
            "(datetime(..., tzinfo=ZoneInfo(name), fold=...))"
        )


def _local(moment: datetime, zone: tzinfo, tz: str | tzinfo) -> datetime:
    """``moment`` on the local clock of ``zone``. zoneinfo's zones and ``timezone`` are taken
    at their word; another tzinfo's answer is checked (PEP 495): the local time it gives must
    map back to ``moment``, and one it says is the second pass of a repeated time must have a
    first pass. One that fails (pytz's with no name, dateutil's Europe/Dublin in its repeated
    hour) is refused: trusted, it would key two hours as one (a run skipped as a duplicate)."""
    local = moment.astimezone(UTC).astimezone(zone)
    if isinstance(zone, ZoneInfo | timezone):
        return local
    local = local.replace(tzinfo=zone)  # pytz hands back another instance than ``zone``
    back = local.astimezone(UTC)
    first = local.replace(fold=0).astimezone(UTC).astimezone(zone)
    # Compared in UTC: two aware datetimes in different zones never compare equal when one
    # of them is in a repeated hour (PEP 495), even for the same moment.
    if back == moment.astimezone(UTC) and (
        not _repeat(local)
        or (first.replace(tzinfo=None), first.fold) == (local.replace(tzinfo=None), 0)
    ):
        return local
    raise ConfigurationError(
        f"tz={tz!r} gives the moment {moment.astimezone(UTC):%Y-%m-%d %H:%M:%S}Z the local time "
        f"{local:%Y-%m-%d %H:%M:%S} (fold={local.fold}), which is not that moment on its own "
        "clock: a tzinfo without working fold (pytz's, dateutil's for a zone with negative "
        "daylight saving time such as Europe/Dublin) cannot tell the two passes of a repeated "
        'hour apart. Pass the zone\'s name (tz="Europe/Dublin") or a zoneinfo.ZoneInfo'
    )


def slot(name: str, every: Every, *, at: datetime | None = None, tz: str | tzinfo = "UTC") -> str:
    """The key of the run of job ``name`` that ``at`` (default: now) falls in: ``name:`` then
    the slot's start in ``tz`` (``2026-12-01`` for a day, ``2026-12-01T13`` for an hour,
    ``2026-12-01T13:05`` for a minute, ``2026-W49`` for an ISO week, ``2026-12`` for a month;
    for a ``timedelta``, the slot's start in UTC to the second).

    An hour or a minute that the clocks repeat when they go back (daylight saving time ends)
    is two slots: the second pass (``fold=1``) gets its UTC offset appended
    (``2026-10-25T02+01:00`` in Europe/Rome), so that its run happens too; every other slot's
    key is as it always was. A local hour the clocks skip when they go forward has no slot.
    A ``timedelta`` counts from the epoch in UTC: any ``tz`` but UTC is refused
    (:class:`~oncely.ConfigurationError`) rather than ignored.

    ``at`` is a moment: the same moment written in any zone is the same slot. A wall time the
    clocks skip (02:30 on the day they go forward, written in ``tz``) is the moment Python
    gives it (the offset before the change, ``fold=0``): its slot is the hour after the gap."""
    if not name or ":" in name:
        raise ConfigurationError("a job name is not empty and holds no ':'")
    moment = at if at is not None else datetime.now(UTC)
    if moment.tzinfo is None:
        raise ConfigurationError("at= must be timezone-aware")
    _check_at(moment)
    if isinstance(every, timedelta):
        span = int(every.total_seconds())
        if span < 1 or every != timedelta(seconds=span):
            raise ConfigurationError("a timedelta period is a whole number of seconds, >= 1s")
        if not _is_utc(tz):
            raise ConfigurationError(
                f"a timedelta period counts its slots from the epoch in UTC, so tz={tz!r} "
                "cannot apply to it: leave tz= out (the slots and their keys stay the same), "
                "or use a calendar unit (minute, hour, day, week, month) to follow the local "
                "clock"
            )
        start = int(moment.timestamp()) // span * span
        return f"{name}:{datetime.fromtimestamp(start, UTC):%Y-%m-%dT%H:%M:%SZ}"
    # Through UTC: ``at`` is a moment, whatever zone it is written in. Converted straight to
    # the zone it is already in, a wall time the clocks skip would stay as written (``02:30``
    # on the day they go forward), a slot of its own that the same moment written in UTC or
    # another zone never gets.
    local = _local(moment, _zone(tz), tz)
    if every == "minute":
        return f"{name}:{local:%Y-%m-%dT%H:%M}{_repeat(local)}"
    if every == "hour":
        return f"{name}:{local:%Y-%m-%dT%H}{_repeat(local)}"
    if every == "day":
        return f"{name}:{local:%Y-%m-%d}"
    if every == "week":
        year, week, _ = local.isocalendar()
        return f"{name}:{year}-W{week:02d}"
    if every == "month":
        return f"{name}:{local:%Y-%m}"
    raise ConfigurationError(
        f"every must be minute, hour, day, week, month or a timedelta: {every!r}"
    )


_LONGEST = {
    "minute": timedelta(minutes=1),
    "hour": timedelta(hours=1),  # a repeated hour is a slot of its own
    "day": timedelta(hours=26),  # the day the clocks go back two hours (Antarctica/Troll)
    "week": timedelta(days=7, hours=2),
    "month": timedelta(days=31, hours=2),
}
"""The longest a calendar slot lasts, clock changes included: clocks go back by two hours in
Antarctica/Troll every October (and did in Asia/Magadan and others in 2014), so a day can last
26 hours, not just 25."""


def _check_retention(retention: Retention, name: str, every: Every) -> None:
    """Refuse an inbox that would forget a slot's run before the slot ends: a later run of
    the slot would then find no record and run the job again."""
    longest = every if isinstance(every, timedelta) else _LONGEST.get(every)
    if longest is None:
        return  # an unknown period: slot() says so
    for what, keep in (("retention", retention.keep), ("keep_failed", retention.keep_failed)):
        if keep is not None and keep < longest:
            period = every if isinstance(every, str) else f"every {format_duration(every)}"
            raise ConfigurationError(
                f"job {name!r} runs once per {period}, a slot of up to "
                f"{format_duration(longest)}, but the inbox's {what} is "
                f"{format_duration(keep)}: the first run's record would expire before the "
                "slot ends, and a later run in the same slot would run the job again. Give "
                f"the jobs' inbox Retention(keep=...) of at least {format_duration(longest)}"
            )


def _check_key(key: str, limits: Limits) -> None:
    """Refuse a job whose slot key the inbox would reject (too long for ``limits``, a NUL,
    text that is not UTF-8): a job name is configuration, so it is told at once rather than
    answered ``rejected``, unrecorded, on every run while the job never runs."""
    try:
        validate_key(key, limits)
    except InvalidKey as exc:
        raise ConfigurationError(f"the job's slot key cannot be used: {exc}") from None


def run_once(
    inbox: Inbox,
    name: str,
    job: Callable[[], R],
    *,
    every: Every,
    tz: str | tzinfo = "UTC",
    at: datetime | None = None,
    wait: timedelta | None = None,
    returns: Any = ANNOTATED,
) -> Handled[R]:
    """Run ``job()`` unless this slot's run of ``name`` ran, or runs now (see the module). A
    later run's ``value`` is the first run's result as the job's return type (its annotation,
    or ``returns=``; ``None``: as stored). Refuses an inbox whose retention is shorter
    than the slot, and a name whose slot key the inbox would reject (over its
    ``Limits.max_key_bytes``, a NUL, text that is not UTF-8), with
    :class:`~oncely.ConfigurationError` before the job runs."""
    key = slot(name, every, at=at, tz=tz)
    _check_retention(inbox.retention, name, every)
    _check_key(key, inbox.limits)
    handled = inbox.handle(key, {"job": name}, lambda _payload: job(), wait=wait, returns=None)
    return typed_repeat(handled, job, returns)


async def run_once_async(
    inbox: AsyncInbox,
    name: str,
    job: Callable[[], Awaitable[R]],
    *,
    every: Every,
    tz: str | tzinfo = "UTC",
    at: datetime | None = None,
    wait: timedelta | None = None,
    returns: Any = ANNOTATED,
) -> Handled[R]:
    """:func:`run_once` for an ``async def`` job on an :class:`~oncely.AsyncInbox`."""
    key = slot(name, every, at=at, tz=tz)
    _check_retention(inbox.retention, name, every)
    _check_key(key, inbox.limits)

    async def run(_payload: object) -> R:
        return await job()

    handled = await inbox.handle(key, {"job": name}, run, wait=wait, returns=None)
    return typed_repeat(handled, job, returns)

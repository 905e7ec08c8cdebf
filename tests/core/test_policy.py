"""Policies: retention against the redelivery horizon (R13), leases (R10), limits, durations."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

from oncely._core.policy import (
    Lease,
    Limits,
    OnStale,
    RedeliveryHorizon,
    Resolution,
    Retention,
    format_duration,
)
from oncely.errors import ConfigurationError, RetentionTooShort

# ------------------------------------------------------------------ format_duration


@pytest.mark.parametrize(
    ("delta", "text"),
    [
        (timedelta(0), "0s"),
        (timedelta(days=3, hours=2), "3d2h"),
        (timedelta(minutes=5), "5m"),
        (timedelta(minutes=1, seconds=30), "1m30s"),
        (timedelta(milliseconds=250), "250ms"),
        (timedelta(seconds=1, milliseconds=250), "1s250ms"),
        (timedelta(hours=1), "1h"),
        (timedelta(days=1, seconds=1), "1d1s"),
        (timedelta(days=400), "400d"),
        (timedelta(hours=25), "1d1h"),
        (timedelta(minutes=-5), "-5m"),
        (timedelta(microseconds=999), "0s"),  # below a millisecond: nothing to show
        (timedelta(seconds=1, microseconds=1500), "1s1ms"),
    ],
)
def test_format_duration(delta: timedelta, text: str) -> None:
    assert format_duration(delta) == text


# ------------------------------------------------------------------ RedeliveryHorizon


def test_r13_horizon_total() -> None:
    h = RedeliveryHorizon(
        max_deliveries=10, lock=timedelta(minutes=5), message_ttl=timedelta(days=3)
    )
    assert h.total == timedelta(days=3, minutes=50)
    full = RedeliveryHorizon(
        max_deliveries=3,
        lock=timedelta(minutes=1),
        message_ttl=timedelta(hours=1),
        redelivery_delay=timedelta(seconds=30),
        resubmit_window=timedelta(days=2),
    )
    # ttl + deliveries x (lock + delay) + resubmit window
    assert full.total == timedelta(hours=1) + 3 * timedelta(minutes=1, seconds=30) + timedelta(
        days=2
    )


def test_r13_horizon_explain() -> None:
    h = RedeliveryHorizon(
        max_deliveries=10, lock=timedelta(minutes=5), message_ttl=timedelta(days=3)
    )
    assert h.explain() == "max_deliveries=10 x lock=5m + message_ttl=3d"
    full = RedeliveryHorizon(
        max_deliveries=3,
        lock=timedelta(minutes=1),
        message_ttl=timedelta(hours=1),
        redelivery_delay=timedelta(seconds=30),
        resubmit_window=timedelta(days=2),
    )
    assert full.explain() == (
        "max_deliveries=3 x (lock=1m + delay=30s) + message_ttl=1h + resubmit_window=2d"
    )


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_deliveries": 0},
        {"max_deliveries": -1},
        {"lock": timedelta(seconds=-1)},
        {"message_ttl": timedelta(seconds=-1)},
        {"redelivery_delay": timedelta(seconds=-1)},
        {"resubmit_window": timedelta(seconds=-1)},
    ],
)
def test_r13_horizon_validation(kwargs: dict[str, object]) -> None:
    base: dict[str, object] = {
        "max_deliveries": 1,
        "lock": timedelta(seconds=1),
        "message_ttl": timedelta(seconds=1),
    }
    with pytest.raises(ConfigurationError):
        RedeliveryHorizon(**{**base, **kwargs})  # type: ignore[arg-type]


def test_policies_are_keyword_only_and_frozen() -> None:
    with pytest.raises(TypeError):
        Retention(timedelta(days=1))  # type: ignore[call-arg]
    r = Retention()
    with pytest.raises(AttributeError):
        r.keep = timedelta(days=1)  # type: ignore[misc]


# ------------------------------------------------------------------ Retention


HORIZON = RedeliveryHorizon(
    max_deliveries=10, lock=timedelta(minutes=5), message_ttl=timedelta(days=3)
)


def test_r13_retention_below_the_horizon_names_the_numbers() -> None:
    with pytest.raises(RetentionTooShort) as info:
        Retention(keep=timedelta(hours=1), horizon=HORIZON)
    assert str(info.value) == (
        "retention 1h is below the redelivery horizon 3d50m "
        "(max_deliveries=10 x lock=5m + message_ttl=3d); "
        "raise retention or lower the broker's limits"
    )
    assert isinstance(info.value, ConfigurationError)


def test_r13_keep_failed_below_the_horizon_is_named() -> None:
    with pytest.raises(RetentionTooShort, match=r"^keep_failed 1d is below the redelivery horizon"):
        Retention(keep=timedelta(days=7), keep_failed=timedelta(days=1), horizon=HORIZON)


def test_r13_retention_at_or_above_the_horizon_is_accepted() -> None:
    at = Retention(keep=HORIZON.total, horizon=HORIZON)
    assert at.keep_ms == int(HORIZON.total.total_seconds() * 1000)
    Retention(keep=timedelta(days=14), keep_failed=timedelta(days=30), horizon=HORIZON)
    with pytest.raises(RetentionTooShort):
        Retention(keep=HORIZON.total - timedelta(milliseconds=1), horizon=HORIZON)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"keep": timedelta(0)},
        {"keep": timedelta(seconds=-1)},
        {"keep_failed": timedelta(0)},
        {"keep_failed": timedelta(hours=-1)},
    ],
)
def test_r13_every_record_must_expire(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ConfigurationError):
        Retention(**kwargs)


def test_retention_in_milliseconds() -> None:
    r = Retention(keep=timedelta(days=1))
    assert r.keep_ms == 86_400_000
    assert r.keep_failed_ms == 86_400_000  # defaults to keep
    r2 = Retention(keep=timedelta(days=1), keep_failed=timedelta(minutes=1, milliseconds=5))
    assert r2.keep_failed_ms == 60_005
    assert Retention().keep == timedelta(days=7)


# ------------------------------------------------------------------ Lease


def test_r10_lease_defaults_and_derived_values() -> None:
    lease = Lease()
    assert lease.duration == timedelta(seconds=30)
    assert lease.duration_ms == 30_000
    assert lease.renew_every_s == pytest.approx(10.0)
    assert lease.heartbeat is True
    assert Lease(duration=timedelta(seconds=9), renew_every=timedelta(seconds=2)).renew_every_s == 2


@pytest.mark.parametrize(
    "kwargs",
    [
        {"duration": timedelta(milliseconds=9)},
        {"duration": timedelta(0)},
        {"duration": timedelta(seconds=-1)},
        {"duration": timedelta(seconds=10), "renew_every": timedelta(seconds=10)},
        {"duration": timedelta(seconds=10), "renew_every": timedelta(seconds=11)},
        {"duration": timedelta(seconds=10), "renew_every": timedelta(0)},
        {"duration": timedelta(seconds=10), "renew_every": timedelta(seconds=-1)},
    ],
)
def test_r10_lease_validation(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ConfigurationError):
        Lease(**kwargs)


def test_r10_shortest_lease() -> None:
    assert Lease(duration=timedelta(milliseconds=10)).duration_ms == 10


# ------------------------------------------------------------------ Limits


@pytest.mark.parametrize("size", [16, 512, 4096])
def test_limits_key_bytes_in_range(size: int) -> None:
    assert Limits(max_key_bytes=size).max_key_bytes == size


@pytest.mark.parametrize(
    "kwargs", [{"max_key_bytes": 15}, {"max_key_bytes": 4097}, {"max_result_bytes": -1}]
)
def test_limits_validation(kwargs: dict[str, int]) -> None:
    with pytest.raises(ConfigurationError):
        Limits(**kwargs)  # type: ignore[arg-type]


def test_limits_zero_result_bytes_is_allowed() -> None:
    assert Limits(max_result_bytes=0).max_result_bytes == 0


# ------------------------------------------------------------------ OnStale, Resolution


def test_r10_on_stale_values() -> None:
    assert OnStale("retry") is OnStale.RETRY
    assert OnStale("escalate") is OnStale.ESCALATE
    assert {s.value for s in OnStale} == {"retry", "escalate"}


def test_r10_resolutions() -> None:
    assert Resolution.retry() == Resolution("retry")
    done = Resolution.completed({"charged": True})
    assert (done.action, done.result, done.reason) == ("completed", {"charged": True}, None)
    assert Resolution.completed().result is None
    parked = Resolution.escalate("payment provider unsure")
    assert (parked.action, parked.result, parked.reason) == (
        "escalate",
        None,
        "payment provider unsure",
    )

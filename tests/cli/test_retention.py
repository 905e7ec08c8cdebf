"""``oncely retention``: the redelivery horizon, the recommended retention, and the durations
the command line reads.
"""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
from hypothesis import given
from hypothesis import strategies as st

import oncely
from oncely.cli._durations import parse_duration
from oncely.cli._retention import recommend
from tests.cli.helpers import run

# ------------------------------------------------------------------------- retention


def test_r13_retention_horizon_and_recommendation() -> None:
    result = run("retention", "--max-deliveries", "10", "--lock", "5m", "--message-ttl", "3d",
                 "--redelivery-delay", "1m", "--resubmit-window", "1d", "--json")  # fmt: skip
    assert result.exit_code == 0, result.stderr
    figures = json.loads(result.stdout)
    # 3d + 10 x (5m + 1m) + 1d = 4d1h
    assert figures["horizon"] == "4d1h"
    assert figures["horizon_ms"] == (4 * 24 + 1) * 3_600_000
    assert figures["formula"] == (
        "max_deliveries=10 x (lock=5m + delay=1m) + message_ttl=3d + resubmit_window=1d"
    )
    # 4d1h x 1.25 = 5d1h15m, rounded up to whole days
    assert figures["recommended"] == "6d"
    assert figures["keep"] is None


def test_r13_retention_defaults_are_oncely_consumes() -> None:
    # oncely consume's own: its retry delays (1s doubling up to 1m, the longest before the
    # 10th delivery) and its --resubmit-window of 1d. Before, both were 0s here: this
    # recommended 4d, which oncely consume with the same numbers refused (its horizon 4d1h).
    result = run("retention", "--max-deliveries", "10", "--lock", "5m", "--message-ttl", "3d")
    assert result.exit_code == 0, result.stderr
    assert "redelivery horizon     4d1h" in result.stdout
    assert (
        "max_deliveries=10 x (lock=5m + delay=1m) + message_ttl=3d + resubmit_window=1d"
    ) in result.stdout
    assert "recommended retention  6d" in result.stdout
    assert "timedelta(days=6)" in result.stdout
    # Few deliveries wait less between them: 1s, 2s, then 4s before the 4th.
    few = run("retention", "--max-deliveries", "4", "--lock", "1m", "--message-ttl", "1h",
              "--resubmit-window", "0s", "--json")  # fmt: skip
    assert json.loads(few.stdout)["formula"] == (
        "max_deliveries=4 x (lock=1m + delay=4s) + message_ttl=1h"
    )


def test_r13_retention_text_output() -> None:
    result = run("retention", "--max-deliveries", "10", "--lock", "5m", "--message-ttl", "3d",
                 "--redelivery-delay", "0s", "--resubmit-window", "0s")  # fmt: skip
    assert result.exit_code == 0, result.stderr
    assert "redelivery horizon     3d50m" in result.stdout
    assert "max_deliveries=10 x lock=5m + message_ttl=3d" in result.stdout
    assert "recommended retention  4d" in result.stdout
    assert "timedelta(days=4)" in result.stdout


_BROKER_ONLY = ("--redelivery-delay", "0s", "--resubmit-window", "0s")


def test_r13_retention_keep_long_enough() -> None:
    result = run("retention", "--max-deliveries", "10", "--lock", "5m", "--message-ttl", "3d",
                 *_BROKER_ONLY, "--keep", "7d")  # fmt: skip
    assert result.exit_code == 0, result.stderr
    assert "retention 7d covers the horizon (3d23h10m to spare)" in result.stdout
    exact = run("retention", "--max-deliveries", "10", "--lock", "5m", "--message-ttl", "3d",
                *_BROKER_ONLY, "--keep", "3d50m")  # fmt: skip
    assert exact.exit_code == 0
    assert "below the recommended" in exact.stdout


def test_r13_retention_too_short_exits_1_with_the_reason() -> None:
    result = run("retention", "--max-deliveries", "10", "--lock", "5m", "--message-ttl", "3d",
                 *_BROKER_ONLY, "--keep", "1h")  # fmt: skip
    assert result.exit_code == 1
    assert result.stderr.strip() == (
        "Error: retention 1h is below the redelivery horizon 3d50m "
        "(max_deliveries=10 x lock=5m + message_ttl=3d); raise retention or lower the "
        "broker's limits"
    )
    as_json = run("retention", "--max-deliveries", "10", "--lock", "5m", "--message-ttl", "3d",
                  *_BROKER_ONLY, "--keep", "3d49m", "--json")  # fmt: skip
    assert as_json.exit_code == 1
    assert json.loads(as_json.stdout)["keep_ok"] is False


@pytest.mark.parametrize(
    ("horizon", "expected"),
    [
        (timedelta(0), timedelta(hours=1)),
        (timedelta(minutes=1), timedelta(hours=1)),
        (timedelta(hours=1), timedelta(hours=2)),
        (timedelta(hours=19, minutes=12), timedelta(days=1)),
        (timedelta(days=3, minutes=50), timedelta(days=4)),
        (timedelta(days=14), timedelta(days=18)),
    ],
)
def test_recommendation_rounds_up_a_quarter_more(horizon: timedelta, expected: timedelta) -> None:
    assert recommend(horizon) == expected
    assert recommend(horizon) >= horizon * 1.25


# ------------------------------------------------------------------------- durations


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("30s", timedelta(seconds=30)),
        ("5m", timedelta(minutes=5)),
        ("2h", timedelta(hours=2)),
        ("3d", timedelta(days=3)),
        ("1d12h", timedelta(days=1, hours=12)),
        ("250ms", timedelta(milliseconds=250)),
        ("1m30s", timedelta(seconds=90)),
        ("1d2h3m4s5ms", timedelta(days=1, hours=2, minutes=3, seconds=4, milliseconds=5)),
        ("0s", timedelta(0)),
        ("90m", timedelta(minutes=90)),
    ],
)
def test_durations_parse(text: str, expected: timedelta) -> None:
    assert parse_duration(text) == expected


@pytest.mark.parametrize(
    "text",
    ["", "5", "5x", "1.5h", "-5m", "+5m", "5 m", " 5m", "5m ", "5M", "1h1d", "1h1h", "ms", "m5",
     "5mss", "1d 2h", "9999999999999d", "99999999999d"],
)  # fmt: skip
def test_bad_durations_are_refused(text: str) -> None:
    with pytest.raises(ValueError, match=r"duration|unit"):
        parse_duration(text)


@pytest.mark.parametrize("text", ["5x", "1.5h", "5", "1h1d"])
def test_bad_duration_is_a_usage_error(text: str) -> None:
    result = run("retention", "--max-deliveries", "3", "--lock", text, "--message-ttl", "1d")
    assert result.exit_code == 2
    assert "Invalid value for '--lock'" in result.stderr
    assert result.stdout == ""


@given(st.integers(min_value=0, max_value=10**12))
def test_durations_read_back_what_format_duration_writes(ms: int) -> None:
    delta = timedelta(milliseconds=ms)
    assert parse_duration(oncely.format_duration(delta)) == delta


def test_zero_max_deliveries_is_a_usage_error() -> None:
    result = run("retention", "--max-deliveries", "0", "--lock", "1m", "--message-ttl", "1d")
    assert result.exit_code == 2


@pytest.mark.parametrize("lock", ["99999999d", "999999990d"])
def test_an_absurd_horizon_is_a_usage_error(lock: str) -> None:
    result = run("retention", "--max-deliveries", "1000", "--lock", lock, "--message-ttl", "1d")
    assert result.exit_code == 2
    assert "longer than any retention" in result.stderr

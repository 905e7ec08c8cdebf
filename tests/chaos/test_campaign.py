"""The bad-input campaign (:mod:`tests.chaos.campaign`) on every broker: good and bad messages
from foreign producers through a real ``oncely consume``, every one accounted for.

The size is ``ONCELY_CAMPAIGN_MESSAGES`` (150 by default, every class at least 3 times; the full
campaign is 2,000); the seed is ``ONCELY_CHAOS_SEED`` (random by default, printed). The per-class
table is printed to the terminal (also without ``-s``).
"""

from __future__ import annotations

import os

import pytest

from tests.brokers.common import require_postgres
from tests.chaos.campaign import BROKERS, run_campaign
from tests.services import NATS_URL, RABBITMQ_URL, REDIS_URL, require

MESSAGES = int(os.environ.get("ONCELY_CAMPAIGN_MESSAGES", "150"))

SERVICES = {
    "rabbitmq": ("RabbitMQ", RABBITMQ_URL, 5672),
    "redis": ("Redis", REDIS_URL, 6379),
    "nats": ("NATS", NATS_URL, 4222),
}


@pytest.mark.slow
@pytest.mark.services
@pytest.mark.timeout(900)
@pytest.mark.parametrize("broker", BROKERS)
def test_bad_input_campaign(
    broker: str, chaos_seed: int, capsys: pytest.CaptureFixture[str]
) -> None:
    """0 lost, 0 stalled, 0 dead-lettered without a reason, the consumer alive until SIGTERM
    (then exit 0), and every class ending as the campaign's docstring says."""
    require_postgres()
    require(*SERVICES[broker])
    report = run_campaign(broker, MESSAGES, chaos_seed)
    with capsys.disabled():
        print(f"\n{report.render()}")
    assert report.ok, "\n".join([report.verdict(), *report.violations, *report.mismatches])

"""Each adapter package, imported without its broker client installed, says which extra installs
it (ARCHITECTURE: adapters are optional extras behind an import guard). Run in a fresh
interpreter where the client is hidden (``sys.modules[name] = None`` makes its import fail as
a missing module would)."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize(
    ("adapter", "client", "extra"),
    [
        ("rabbitmq", "aio_pika", "rabbitmq"),
        ("nats", "nats", "nats"),
        ("redis_streams", "redis", "redis"),
        ("kafka", "aiokafka", "kafka"),
        ("kafka", "confluent_kafka", "kafka"),
        ("sqs", "aiobotocore", "sqs"),
    ],
)
def test_an_adapter_without_its_client_names_the_extra(
    adapter: str, client: str, extra: str
) -> None:
    script = (
        "import sys\n"
        f"sys.modules[{client!r}] = None\n"
        "try:\n"
        f"    import oncely.brokers.{adapter}\n"
        "except ModuleNotFoundError as exc:\n"
        "    print(exc.name)\n"
        "    print(exc)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True
    )
    name, message = done.stdout.splitlines()
    assert name == client
    assert message == (
        f"oncely.brokers.{adapter} needs the {client!r} package: pip install 'oncely[{extra}]'"
    )

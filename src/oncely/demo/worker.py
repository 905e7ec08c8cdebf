"""A worker process: receive, process, settle, until the runner says stop.

The worker is where the worker-side faults happen (:class:`Harness`): a ``slow`` delivery's
handler sleeps past the visibility timeout and goes on until the broker has handed the copy to
another worker (so the two really overlap); a ``kill`` delivery stops at its crash point (after
the effect is written, before the acknowledgement), asks the runner for a SIGKILL through the
broker, and waits for it. The runner sends a real ``SIGKILL`` and starts a replacement.

The broker action comes from the consumer's :class:`~oncely.demo.consumers.Settlement` alone:
ack, requeue after a delay (``requeue_later`` and ``retry``), dead-letter or park, the reason
prefixed with the outcome (``key_conflict: ...``).
"""

from __future__ import annotations

import logging
import os
import signal
import time
from dataclasses import dataclass
from datetime import timedelta

import oncely
from oncely.demo.consumers import Setup, open_consumer
from oncely.testing.file_broker import FileBroker, Leased, SettleAction

__all__ = ["Harness", "WorkerSpec", "worker_main"]

_ACTIONS: dict[oncely.Action, SettleAction] = {
    oncely.Action.ACK: "ack",
    oncely.Action.REQUEUE_LATER: "requeue",
    oncely.Action.RETRY: "requeue",
    oncely.Action.DEAD_LETTER: "dead_letter",
    oncely.Action.PARK: "park",
}


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerSpec:
    """Everything a worker process needs (picklable for the spawn start method)."""

    name: str
    broker_path: str
    setup: Setup
    visibility_timeout_s: float
    slow_s: float
    overlap_s: float
    twin_wait_s: float
    requeue_delay_s: float
    retry_delay_s: float
    poll_s: float = 0.005


class Harness:
    """Applies the worker-side fault of one delivery (see :class:`oncely.demo.consumers.Chaos`)."""

    def __init__(
        self, broker: FileBroker, delivery: Leased, worker: str, slow_s: float, overlap_s: float
    ) -> None:
        self._broker = broker
        self._delivery = delivery
        self._worker = worker
        self._slow_s = slow_s
        self._overlap_s = overlap_s

    def slow_down(self) -> None:
        # Outlive the lease, then keep running until the broker has handed the copy to another
        # worker (bounded), so the two holders really overlap however busy the others are.
        if self._delivery.chaos != "slow":
            return
        parent = os.getppid()
        time.sleep(self._slow_s)
        give_up = time.monotonic() + self._overlap_s
        while time.monotonic() < give_up and not self._broker.redelivered(self._delivery):
            if os.getppid() != parent:
                os._exit(3)  # the runner died: nobody will redeliver; do not linger
            time.sleep(0.01)

    def crash_point(self) -> None:
        if self._delivery.chaos != "kill":
            return
        parent = os.getppid()
        self._broker.request_kill(self._delivery, self._worker)
        give_up = time.monotonic() + 60
        while time.monotonic() < give_up and os.getppid() == parent:
            time.sleep(0.02)  # the runner's SIGKILL arrives within milliseconds
        os._exit(3)  # reached only if the runner is gone: do not linger


def worker_main(spec: WorkerSpec) -> None:
    """The body of a worker process."""
    # Ctrl-C reaches the whole process group: the runner handles it and kills the workers.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Outcome logs (a key conflict is logged at ERROR) would clutter the demo's output; the
    # report reads everything from the databases instead.
    quiet = logging.getLogger("oncely")
    quiet.addHandler(logging.NullHandler())
    quiet.propagate = False
    parent = os.getppid()  # the runner, or the fork server that started this process
    broker = FileBroker(
        spec.broker_path,
        visibility_timeout=timedelta(seconds=spec.visibility_timeout_s),
        twin_wait=timedelta(seconds=spec.twin_wait_s),
    )
    consumer = open_consumer(spec.setup)
    try:
        while True:
            if os.getppid() != parent:
                return  # the runner died (even by SIGKILL): never linger as an orphan
            delivery = broker.receive(spec.name)
            if delivery is None:
                if broker.stopping():
                    return
                time.sleep(spec.poll_s)
                continue
            harness = Harness(broker, delivery, spec.name, spec.slow_s, spec.overlap_s)
            settlement = consumer.process(delivery, harness)
            harness.crash_point()  # after the writes, before the ack
            action = _ACTIONS[settlement.action]
            if settlement.action is oncely.Action.REQUEUE_LATER:
                delay = spec.requeue_delay_s
            elif settlement.action is oncely.Action.RETRY:
                delay = spec.retry_delay_s
            else:
                delay = 0.0
            reason = settlement.reason
            if action in ("dead_letter", "park"):
                reason = f"{settlement.outcome}: {reason}"
            broker.settle(
                delivery,
                action,
                outcome=settlement.outcome,
                reason=reason,
                delay=timedelta(seconds=delay),
            )
    finally:
        consumer.close()
        broker.close()

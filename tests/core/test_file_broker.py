"""oncely's cross-process test broker keeps the promises of a peek-lock queue (R1, R20).

The demo and the crash tests lean on :class:`oncely.testing.FileBroker`; if it lost a message,
delivered a settled one or let a late acknowledgement count, their findings would be wrong.
These tests pin its behaviour down: leases and their expiry, fenced settlement, the faults it
injects (a lost ack, a twin delivery), the delivery limit, and a real SIGKILL of a worker
holding a lease.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest

from oncely.testing import FileBroker, Leased, Published

SHORT = timedelta(milliseconds=150)


def _broker(tmp_path: Path, **options: object) -> FileBroker:
    broker = FileBroker(tmp_path / "queue.db", **options)  # type: ignore[arg-type]
    broker.create()
    return broker


def _wait_for(broker: FileBroker, worker: str, seconds: float = 5.0) -> Leased:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        leased = broker.receive(worker)
        if leased is not None:
            return leased
        time.sleep(0.01)
    raise AssertionError(f"nothing was delivered within {seconds}s")


def test_copies_go_out_in_order_and_an_ack_settles_them(tmp_path: Path) -> None:
    broker = _broker(tmp_path)
    broker.publish([Published("a", b"1"), Published("b", b"2"), Published("a", b"1")])
    got = [broker.receive("w") for _ in range(3)]
    assert [(g.message_id, g.body, g.cause, g.attempt) for g in got if g] == [
        ("a", b"1", "first", 1),
        ("b", b"2", "first", 1),
        ("a", b"1", "first", 1),
    ]
    # The copies of one id are distinct transport deliveries (R4: never the dedup key).
    assert len({g.seq for g in got if g}) == 3
    assert broker.receive("w") is None
    assert [broker.settle(g, "ack", outcome="processed") for g in got if g] == ["done"] * 3
    assert broker.open_copies() == 0 and broker.next("w") is None


def test_r1_an_expired_lease_is_delivered_again_and_the_late_ack_is_refused(
    tmp_path: Path,
) -> None:
    broker = _broker(tmp_path, visibility_timeout=SHORT)
    broker.publish([Published("a", b"x")])
    first = broker.receive("slow")
    assert first is not None and broker.receive("other") is None  # leased: invisible
    again = _wait_for(broker, "other")
    assert (again.cause, again.attempt) == ("lease_expired", 2)
    assert broker.redelivered(first)
    time.sleep(SHORT.total_seconds())  # both leases have now run out
    assert broker.settle(first, "ack") == "lock_lost"
    third = _wait_for(broker, "third")
    assert broker.settle(third, "ack") == "done"
    assert broker.settle(again, "ack") == "already_settled"
    with pytest.raises(RuntimeError, match="settled twice"):
        broker.settle(third, "ack")


def test_requeue_waits_for_its_delay_and_dead_letter_keeps_the_reason(tmp_path: Path) -> None:
    broker = _broker(tmp_path)
    broker.publish([Published("a", b"x"), Published("b", b"y")])
    a = broker.receive("w")
    assert a is not None
    broker.settle(a, "requeue", outcome="in_flight", delay=SHORT)
    b = broker.receive("w")
    assert b is not None and b.message_id == "b"
    assert broker.receive("w") is None  # a is not visible before its delay
    a2 = _wait_for(broker, "w")
    assert (a2.message_id, a2.cause, a2.attempt) == ("a", "requeued", 2)
    broker.settle(a2, "dead_letter", outcome="key_conflict", reason="key_conflict: changed")
    broker.settle(b, "park", reason="escalated")
    assert broker.read("SELECT message_id, state, reason FROM copies ORDER BY seq") == [
        ("a", "dead", "key_conflict: changed"),
        ("b", "parked", "escalated"),
    ]


def test_r1_a_lost_ack_looks_done_and_the_copy_comes_back(tmp_path: Path) -> None:
    broker = _broker(tmp_path, visibility_timeout=SHORT)
    broker.publish([Published("a", b"x", fault="lose_ack")])
    first = broker.receive("w")
    assert first is not None and first.chaos is None  # a broker fault, not the worker's
    assert broker.settle(first, "ack") == "ack_lost"
    again = _wait_for(broker, "w")
    assert again.cause == "lease_expired"
    assert broker.settle(again, "ack") == "done"  # only the first ack is dropped
    assert broker.open_copies() == 0


def test_worker_faults_reach_the_worker_on_the_first_delivery_only(tmp_path: Path) -> None:
    broker = _broker(tmp_path)
    broker.publish([Published("a", b"x", fault="kill")])
    first = broker.receive("w")
    assert first is not None and first.chaos == "kill"
    broker.settle(first, "requeue")
    again = broker.receive("w")
    assert again is not None and again.chaos is None


def test_r8_a_twin_is_handed_to_two_workers_at_once(tmp_path: Path) -> None:
    broker = _broker(tmp_path, twin_wait=timedelta(seconds=5))
    broker.publish([Published("a", b"x", fault="twin")])
    got: dict[str, Leased | None] = {}

    def take(worker: str) -> None:
        own = FileBroker(broker.path, twin_wait=timedelta(seconds=5))
        got[worker] = own.receive(worker)
        own.close()

    first = threading.Thread(target=take, args=("w1",))
    first.start()
    time.sleep(0.1)  # w1 is waiting inside receive() for a partner
    take("w2")
    first.join(10)
    one, two = got["w1"], got["w2"]
    assert one is not None and two is not None
    assert one.seq == two.seq and one.delivery_id != two.delivery_id
    assert {one.cause, two.cause} == {"first", "twin"}
    assert broker.settle(one, "ack") == "done"
    assert broker.settle(two, "ack") == "already_settled"


def test_an_unpaired_twin_is_delivered_once_and_noted(tmp_path: Path) -> None:
    broker = _broker(tmp_path, twin_wait=timedelta(milliseconds=50))
    broker.publish([Published("a", b"x", fault="twin")])
    only = broker.receive("w")
    assert only is not None
    assert broker.read("SELECT note FROM deliveries") == [("twin_unpaired",)]
    assert broker.settle(only, "ack") == "done"


def test_a_copy_never_settled_is_dead_lettered_at_the_delivery_limit(tmp_path: Path) -> None:
    broker = _broker(tmp_path, visibility_timeout=timedelta(milliseconds=20), max_deliveries=3)
    broker.publish([Published("poison", b"x")])
    for attempt in (1, 2, 3):
        leased = _wait_for(broker, "w")
        assert leased.attempt == attempt  # and the worker "crashes": never settles
    deadline = time.monotonic() + 5
    while broker.open_copies() and time.monotonic() < deadline:
        assert broker.receive("w") is None
        time.sleep(0.02)
    assert broker.read("SELECT state, reason FROM copies") == [
        ("dead", "max_deliveries: delivered 3 times without settling")
    ]


def test_random_order_hands_out_every_copy_once(tmp_path: Path) -> None:
    broker = _broker(tmp_path, order="random")
    broker.publish(Published(f"k{i}", b"") for i in range(50))
    seen = []
    while (leased := broker.next("w")) is not None:
        seen.append(leased.message_id)
        broker.settle(leased, "ack")
    assert sorted(seen) == sorted(f"k{i}" for i in range(50))
    assert seen != sorted(seen, key=lambda k: int(k[1:]))  # 1 in 50! of failing by chance
    with pytest.raises(ValueError, match="order"):
        FileBroker(broker.path, order="lifo")  # type: ignore[arg-type]


def _hold_and_wait(path: str, ready: str) -> None:
    broker = FileBroker(path, visibility_timeout=SHORT)
    leased = broker.receive("doomed")
    Path(ready).write_text("" if leased is None else leased.message_id)
    time.sleep(60)  # SIGKILLed here


def test_r1_a_sigkilled_holder_s_copy_is_redelivered_to_another_process(tmp_path: Path) -> None:
    broker = _broker(tmp_path, visibility_timeout=SHORT)
    broker.publish([Published("a", b"x")])
    ready = tmp_path / "ready"
    process = multiprocessing.get_context("spawn").Process(
        target=_hold_and_wait, args=(broker.path, str(ready)), daemon=True
    )
    process.start()
    try:
        deadline = time.monotonic() + 30
        while not ready.exists() or not ready.read_text():
            assert time.monotonic() < deadline, "the child never received its copy"
            time.sleep(0.02)
        assert process.pid is not None
        os.kill(process.pid, signal.SIGKILL)
        process.join(10)
        assert process.exitcode == -signal.SIGKILL
        again = _wait_for(broker, "survivor")
        assert (again.message_id, again.cause, again.attempt) == ("a", "lease_expired", 2)
        assert broker.settle(again, "ack") == "done"
    finally:
        if process.is_alive():
            process.kill()
        process.join(10)


def test_stop_flag_and_kill_requests_travel_through_the_file(tmp_path: Path) -> None:
    broker = _broker(tmp_path)
    broker.publish([Published("a", b"x")])
    leased = broker.receive("w")
    assert leased is not None
    other = FileBroker(broker.path)
    assert not other.stopping()
    broker.stop()
    assert other.stopping()
    broker.request_kill(leased, "w")
    [(kill_id, pid)] = other.pending_kills()
    assert pid == os.getpid()
    other.record_kill(kill_id, -9)
    assert other.pending_kills() == [] and other.deliveries() == 1
    other.close()

"""``apply()`` and ``task_always_eager``: an ``IdempotentTask`` run in the caller's process
(Celery's own eager path, no worker), on a real SQLite inbox. A duplicate's value is what a
worker's duplicate returns: the first result rebuilt as the task's return annotation, or
:class:`~oncely.ResultUnavailable` when it was not kept (R1)."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import pytest

pytest.importorskip("celery")

from celery import Celery

import oncely
from oncely.integrations.celery import IdempotentTask


def _app(tmp_path: Path) -> tuple[Celery, list[str]]:
    """An eager app of its own, its tasks named after it (Celery registers a task's name
    for the whole process)."""
    app = Celery(f"eager_{tmp_path.name}", broker="memory://", backend="cache+memory://")
    app.conf.task_always_eager = True
    inbox = oncely.Inbox(oncely.SQLiteStore(tmp_path / "inbox.db"), consumer="eager")
    ran: list[str] = []

    @app.task(base=IdempotentTask, inbox=inbox, name=f"{app.main}.stamp",
              idempotency_key=lambda order: f"stamp:{order}")  # fmt: skip
    def stamp(order: str) -> datetime:
        ran.append(f"stamp:{order}")
        return datetime(2026, 12, 6, 12, 0, tzinfo=UTC)

    @app.task(base=IdempotentTask, inbox=inbox, name=f"{app.main}.bulky",
              idempotency_key=lambda order: f"bulky:{order}")  # fmt: skip
    def bulky(order: str) -> str:  # over the inbox's max_result_bytes (256 KiB): not kept
        ran.append(f"bulky:{order}")
        return "x" * (300 * 1024)

    @app.task(base=IdempotentTask, inbox=inbox, name=f"{app.main}.receipt",
              idempotency_key="sent")  # fmt: skip
    def receipt(order: str) -> str:
        ran.append(f"receipt:{order}")
        return order

    return app, ran


def test_r1_an_eager_duplicate_returns_the_first_result_as_the_task_returned_it(
    tmp_path: Path,
) -> None:
    """Before, an eager duplicate returned the stored form (a string for a datetime)."""
    app, ran = _app(tmp_path)
    stamp = app.tasks[f"{app.main}.stamp"]
    first = stamp.apply(args=("o1",)).get()
    again = stamp.apply(args=("o1",)).get()
    assert first == again == datetime(2026, 12, 6, 12, 0, tzinfo=UTC)
    assert ran == ["stamp:o1"]


def test_r1_an_eager_duplicate_whose_first_result_was_not_kept_raises(tmp_path: Path) -> None:
    """Before, it returned None: a value the caller took for the result."""
    app, ran = _app(tmp_path)
    bulky = app.tasks[f"{app.main}.bulky"]
    assert len(bulky.delay("b1").get()) == 300 * 1024
    with pytest.raises(oncely.ResultUnavailable, match="not there to return"):
        bulky.delay("b1").get()
    assert ran == ["bulky:b1"]


def test_r2_an_eager_call_a_worker_would_dead_letter_says_no_message_was_kept(
    tmp_path: Path,
) -> None:
    """A keyless eager call (no send_with_key for a task keyed "sent"): nothing is sent
    anywhere, the caller gets the refusal. Before, its text said "the message is in
    celery.dead", where a user testing the task would look for it in vain."""
    from oncely.integrations.celery import DeadLettered

    app, ran = _app(tmp_path)
    receipt = app.tasks[f"{app.main}.receipt"]
    with pytest.raises(DeadLettered) as caught:
        receipt.delay("r1").get()
    said = str(caught.value)
    assert said.startswith("rejected: no idempotency key"), said
    assert "the message is in" not in said and "no message went to celery.dead" in said, said
    assert ran == []

# ruff: noqa: PT009, PT027 - Django's test runner runs unittest-style test cases
"""oncely's claim inside ``transaction.atomic()``, run by Django's own test runner
(``manage.py test shop``) on the database of ``ONCELY_TEST_DJANGO_DB``: the runner creates
the test database and applies oncely's migration to it (R7, R3, R9, R11)."""

from __future__ import annotations

import gc
import tempfile
import threading
import uuid
from typing import Any

from django.db import connection, connections, transaction
from django.test import TransactionTestCase
from shop.handlers import charge_in
from shop.models import Charge, Refund

import oncely
from oncely.integrations.django import get_inbox, get_store, handle_in_atomic, store_url
from oncely.integrations.django.consumer import AtomicProcessor
from oncely.integrations.django.models import InboxRecord

ROUNDS = 40


def key() -> str:
    return f"k-{uuid.uuid4()}"


def book(order: dict[str, Any]) -> int:
    Charge.objects.create(order=order["id"], amount=order["amount"])
    return int(order["amount"])


class AtomicTests(TransactionTestCase):
    def setUp(self) -> None:
        self.inbox = get_inbox("billing")
        self.order = {"id": f"o-{uuid.uuid4().hex[:8]}", "amount": 7}

    def rows(self) -> int:
        return Charge.objects.filter(order=self.order["id"]).count()

    def test_the_store_is_on_the_test_database(self) -> None:
        name = str(connection.settings_dict["NAME"])
        self.assertIn(name.rsplit("/", 1)[-1], store_url())
        self.assertIs(get_store(), self.inbox.store)

    def test_r3_a_copy_is_a_duplicate_with_the_first_result_and_no_second_row(self) -> None:
        k = key()
        first = handle_in_atomic(self.inbox, k, self.order, book)
        with transaction.atomic():
            again = handle_in_atomic(self.inbox, k, self.order, book)
        self.assertEqual((first.outcome, first.value), (oncely.Outcome.PROCESSED, 7))
        self.assertEqual((again.outcome, again.value), (oncely.Outcome.DUPLICATE, 7))
        self.assertEqual(self.rows(), 1)
        record = InboxRecord.objects.get(consumer="billing", key=k)
        self.assertEqual(record.status, "completed")
        kept = self.inbox.store.get("billing", k)  # the model reads the store's compact form
        assert kept is not None
        self.assertEqual((record.token, record.fingerprint), (kept.token, kept.fingerprint))
        self.assertRegex(record.fingerprint, r"\Av1:[0-9a-f]{32}\Z")

    def test_r7_a_rolled_back_block_leaves_neither_the_marker_nor_the_row(self) -> None:
        k = key()
        with transaction.atomic():
            handled = handle_in_atomic(self.inbox, k, self.order, book)
            self.assertEqual(handled.outcome, oncely.Outcome.PROCESSED)
            transaction.set_rollback(True)
        self.assertEqual(self.rows(), 0)
        self.assertIsNone(self.inbox.store.get("billing", k))
        redelivered = handle_in_atomic(self.inbox, k, self.order, book)
        self.assertEqual(redelivered.outcome, oncely.Outcome.PROCESSED)
        self.assertEqual(self.rows(), 1)

    def test_r9_a_failing_handler_is_rolled_back_alone_and_the_block_goes_on(self) -> None:
        k = key()

        def fails(order: dict[str, Any]) -> int:
            book(order)
            raise RuntimeError("the ledger is down")

        with transaction.atomic():
            Charge.objects.create(order="before", amount=1)
            handled = handle_in_atomic(self.inbox, k, self.order, fails)
            Charge.objects.create(order="after", amount=1)  # the block is still usable
        self.assertEqual(handled.outcome, oncely.Outcome.FAILED)
        self.assertIn("the ledger is down", handled.reason or "")
        self.assertEqual(self.rows(), 0)
        self.assertEqual(Charge.objects.filter(order__in=["before", "after"]).count(), 2)
        retried = handle_in_atomic(self.inbox, k, self.order, book)
        self.assertEqual(retried.outcome, oncely.Outcome.PROCESSED)
        self.assertEqual(self.rows(), 1)

    def test_r11_a_rejection_is_poison_and_its_rows_are_gone(self) -> None:
        k = key()

        def refuses(order: dict[str, Any]) -> int:
            book(order)
            raise oncely.Reject("not an order of ours")

        first = handle_in_atomic(self.inbox, k, self.order, refuses)
        again = handle_in_atomic(self.inbox, k, self.order, book)
        self.assertEqual(first.outcome, oncely.Outcome.REJECTED)
        self.assertEqual(again.outcome, oncely.Outcome.REJECTED)
        self.assertEqual(self.rows(), 0)

    def test_r3_a_reused_key_with_another_payload_is_a_conflict(self) -> None:
        k = key()
        handle_in_atomic(self.inbox, k, self.order, book)
        other = handle_in_atomic(self.inbox, k, {**self.order, "amount": 8}, book)
        self.assertEqual(other.outcome, oncely.Outcome.KEY_CONFLICT)
        self.assertEqual(self.rows(), 1)

    def test_r3_two_threads_with_one_key_make_one_row(self) -> None:
        k = key()
        outcomes: list[oncely.Outcome] = []
        gate = threading.Barrier(2)

        def deliver() -> None:
            try:
                gate.wait()
                outcomes.append(handle_in_atomic(self.inbox, k, self.order, book).outcome)
            finally:
                connections.close_all()

        threads = [threading.Thread(target=deliver) for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        self.assertEqual(self.rows(), 1)
        self.assertEqual(sorted(o.value for o in outcomes), sorted(["processed", "duplicate"]))

    def test_an_atomic_processor_refuses_a_handler_it_would_call_wrongly(self) -> None:
        """A handler taking a ``tx`` (as ``oncely consume --mode transactional`` calls it)
        would fail on every message and have each dead-lettered: refused up front."""
        with self.assertRaises(oncely.ConfigurationError) as refused:
            AtomicProcessor(self.inbox, charge_in)
        self.assertIn(
            "takes (tx, order), but AtomicProcessor calls it as handler(payload): write it "
            "as def charge_in(payload)",
            str(refused.exception),
        )
        AtomicProcessor(self.inbox, book).close()  # one that fits is taken

    def test_a_store_on_another_database_is_refused(self) -> None:
        import tempfile

        other = oncely.Inbox(
            oncely.open(f"sqlite:///{tempfile.mkdtemp()}/other.db"), consumer="billing"
        )
        with self.assertRaises(
            (oncely.ConfigurationError, oncely.TransactionsUnsupported)
        ) as refused:
            handle_in_atomic(other, key(), self.order, book)
        self.assertEqual(self.rows(), 0)
        if isinstance(refused.exception, oncely.ConfigurationError):  # both SQLite: the fix
            said = str(refused.exception)
            self.assertIn("Django's connection 'default'", said)
            self.assertIn("get_inbox(consumer, using='default')", said)

    def test_r7_a_write_refused_at_commit_is_a_failure_of_the_handler(self) -> None:
        """Django checks a foreign key at COMMIT on PostgreSQL and SQLite (at the statement
        on MariaDB). A handler whose row points nowhere is ``failed`` in every case, as a
        handler that raises is: nothing committed, and the consumer retries it, then
        dead-letters it. Before, the IntegrityError of oncely's own block's COMMIT escaped,
        which ``manage.py oncely consume`` gives back without end as a store failure."""
        k = key()

        def refund(order: dict[str, Any]) -> int:
            return Refund.objects.create(charge_id=order["charge"]).pk

        refused = handle_in_atomic(self.inbox, k, {"charge": 10**9}, refund)
        self.assertEqual(refused.outcome, oncely.Outcome.FAILED)
        self.assertEqual(refused.action, oncely.Action.RETRY)
        self.assertIsNone(self.inbox.store.get("billing", k))
        self.assertEqual(Refund.objects.count(), 0)
        charge = Charge.objects.create(order=self.order["id"], amount=1)
        done = handle_in_atomic(self.inbox, k, {"charge": charge.pk}, refund)
        self.assertEqual(done.outcome, oncely.Outcome.PROCESSED)  # nothing kept of the first
        self.assertEqual(Refund.objects.count(), 1)

    def test_a_connection_reopened_on_another_database_is_refused(self) -> None:
        """Which database Django's connection is on is read once per DB-API connection. A
        connection closed and opened again on another database is read anew, even when the
        new DB-API connection is at the freed one's address (CPython reuses it): before, its
        ``id()`` matched, the first database's answer was taken for it, and the marker went
        into a database the store does not read. Each round gives the address a chance to
        be reused (it was, in a few rounds, on SQLite and PostgreSQL)."""
        settings = connection.settings_dict
        name = settings["NAME"]
        elsewhere = {
            "sqlite": f"{tempfile.mkdtemp()}/elsewhere.db",
            "postgresql": "postgres",
            "mysql": "mysql",
        }[connection.vendor]
        try:
            for _ in range(ROUNDS):
                handle_in_atomic(self.inbox, key(), self.order, book)  # read on this one
                connection.close()
                gc.collect()  # the DB-API connection is freed: its address may be reused
                settings["NAME"] = elsewhere
                with self.assertRaises(oncely.ConfigurationError):
                    handle_in_atomic(self.inbox, key(), self.order, book)
                connection.close()
                settings["NAME"] = name
        finally:
            connection.close()
            settings["NAME"] = name

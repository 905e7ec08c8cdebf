"""SQS end to end, on moto's server (the SQS API, started by the tests: see ``sqs_broker.py``),
not on AWS: a standard queue and its ``-dead`` queue beside it. The behaviours every broker
shares are :class:`~tests.brokers.suite.BrokerSuite`'s; here is how the suite reaches SQS, and
what only SQS has: the visibility timeout and its heartbeat, FIFO deduplication, the
attribute limit.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import os
import re
from collections import Counter
from datetime import timedelta
from typing import Any

import pytest

import oncely
from oncely._aws import region_hint
from oncely.brokers import (
    Backoff,
    BrokerLimits,
    DeadLetter,
    Delivery,
    Transport,
    open_producer,
    open_transport,
)
from oncely.brokers._consumer import InboxProcessor, decode_body
from oncely.brokers.sqs import SQS, SQSDelivery, SQSProducer
from oncely.brokers.sqs._endpoint import Endpoint
from oncely.brokers.sqs._transport import PACKED_ATTRIBUTE
from oncely.errors import BrokerError
from tests.brokers.common import Proxy, remove_destinations, running, unique, wait_until
from tests.brokers.sqs_broker import create_queue, delete_queues, queue_depth, sqs_url
from tests.brokers.suite import MS, SECOND, BrokerSuite, DeadCopy, Watched, body, fetch_one, total

pytestmark = pytest.mark.services


class TestSQS(BrokerSuite):
    producer_class = SQSProducer
    shared_url_options = "timeout=20&connect_timeout=5"
    consumer_url_options = "visibility_timeout=7&create=false"
    consumer_makes_its_source_again = False  # a queue it made would lack the operator's attributes

    @property  # type: ignore[override]
    def url(self) -> str:  # started on first use
        return sqs_url()

    # ------------------------------------------------------------------ the suite's interface

    def require(self) -> None:
        sqs_url()

    def new_source(self) -> str:
        name = unique("sq")
        create_queue(name)
        return name

    def transport(self, *, url: str | None = None, **options: Any) -> SQS:
        options.setdefault("ack_wait", timedelta(seconds=5))
        made = SQS(url or self.url, self.source, group=self.group, **options)
        return self.closed_after(made)

    def producer(self, *, url: str | None = None, **options: Any) -> SQSProducer:
        if options:
            endpoint_url = url or self.url
            connect = options.pop("connect_timeout", None)
            if connect is not None:
                endpoint_url += f"?connect_timeout={connect.total_seconds()}"
            assert not options
            made = SQSProducer(endpoint_url, self.source)
        else:
            made = SQSProducer(url or self.url, self.source)
        self.after(made.close)
        return made

    def expected_limits(self, transport: Transport) -> BrokerLimits:
        return BrokerLimits(
            ack_wait=timedelta(seconds=5), message_ttl=timedelta(days=4), max_deliveries=None
        )

    async def _admin(self) -> Any:
        endpoint, _ = Endpoint.from_url(self.url)
        return endpoint.client()

    async def _queue_url(self, client: Any, name: str) -> str | None:
        try:
            return str((await client.get_queue_url(QueueName=name))["QueueUrl"])
        except Exception:
            return None

    async def publish_raw_without_id(self, payload: bytes) -> None:
        producer = self.producer()
        await producer.send(
            payload.decode(),
            {"content-type": {"DataType": "String", "StringValue": "application/json"}},
            message_id=None,
        )

    async def dead_letters(self, dead: str | None = None) -> list[DeadCopy]:
        """The copies in the dead-letter queue ``dead`` (default: the source's)."""
        copies = []
        async with await self._admin() as client:
            queue = await self._queue_url(client, dead or f"{self.source}-dead")
            if queue is None:
                return []
            while True:
                got = await client.receive_message(
                    QueueUrl=queue,
                    MaxNumberOfMessages=10,
                    WaitTimeSeconds=0,
                    VisibilityTimeout=600,
                    MessageAttributeNames=["All"],
                )
                messages = got.get("Messages", [])
                if not messages:
                    break
                for message in messages:
                    headers = {
                        n: v.get("StringValue") for n, v in message["MessageAttributes"].items()
                    }
                    headers.update(json.loads(headers.pop(PACKED_ATTRIBUTE, "{}")))
                    copies.append(
                        DeadCopy(
                            message_id=headers.pop("message-id", None),
                            body=message["Body"].encode(),
                            content_type=headers.pop("content-type", None),
                            headers=headers,
                        )
                    )
        return copies

    async def unsettled(self) -> int | None:
        return await queue_depth(self.url, self.source)

    async def consumers_reading(self) -> int:
        return 2  # SQS has no consumer registry: any receiver reads at once

    def check_transport_fields(self, first: Delivery, again: Delivery) -> None:
        # SQS's own MessageId is the same for a copy received again (it is per send).
        assert again.describe()["sqs_message_id"] == first.describe()["sqs_message_id"]
        assert again.describe()["queue"] == self.source

    async def delete_source(self) -> None:
        await delete_queues(self.url, self.source)

    async def make_source_again(self) -> None:
        await asyncio.to_thread(create_queue, self.source)

    async def reading_again(self) -> bool:
        async with await self._admin() as client:  # no consumer registry: the queue is there
            return await self._queue_url(client, self.source) is not None

    async def remove(self) -> None:
        async with await self._admin() as client:
            for name in (self.source, f"{self.source}-dead"):
                queue = await self._queue_url(client, name)
                if queue is not None:
                    await client.delete_queue(QueueUrl=queue)

    async def test_r8_r10_connection_cut_under_a_slow_handler_applies_once(self) -> None:
        """SQS is request by request over HTTP: no connection stays open to cut. Instead the
        endpoint refuses every connection for 3 s while a handler runs longer than its 1 s
        visibility timeout's heartbeat period: receives and extensions fail as
        BrokerUnavailable, the consumer rides it out, and the effect is applied once."""
        started, release = asyncio.Event(), asyncio.Event()
        calls = Counter[str]()

        async def slow(payload: dict[str, Any]) -> None:
            calls[payload["k"]] += 1
            started.set()
            await release.wait()
            await self.apply(payload)

        async with Proxy(self.url) as proxy:
            worker = self.consumer(
                slow, transport=self.transport(url=proxy.url, ack_wait=3 * SECOND)
            )
            try:
                async with running(worker) as task:
                    await self.publish("slow")
                    await asyncio.wait_for(started.wait(), 30)
                    proxy.refusing = True
                    proxy.cut()
                    await asyncio.sleep(2)
                    proxy.refusing = False
                    release.set()
                    await wait_until(lambda: worker.counts["processed"] == 1, what="the effect")
                    assert not task.done()
            finally:
                release.set()
        assert self.ledger.counts() == {"slow": 1}
        assert calls == {"slow": 1}
        assert await self.dead_letters() == []
        await wait_until(self.settled, what="the queue empty")

    # ------------------------------------------------------------------ SQS's own

    @pytest.mark.parametrize("heartbeat", [False, True])
    async def test_r10_a_lapsed_visibility_timeout_gives_the_copy_to_a_second_worker(
        self, heartbeat: bool
    ) -> None:
        """A 1 s visibility timeout and a 3 s handler. Without the heartbeat the message
        becomes visible again while the first worker runs, and the second worker's copy
        meets the live claim: ``in_flight`` and given back. The first worker's delete then
        removes the message (SQS accepts an earlier receipt handle; a copy still received
        after it is a ``duplicate``). With the heartbeat no second copy is ever received. The
        effect is applied once either way."""

        class NoHeartbeat(SQS):
            @property
            def extend_every(self) -> timedelta | None:  # type: ignore[override]
                return None

        async def slow(payload: dict[str, Any]) -> None:
            await asyncio.sleep(3)
            await self.apply(payload)

        await self.publish("slow")
        (inbox,) = self.inboxes("two_phase", 1)
        kind = SQS if heartbeat else NoHeartbeat
        watched = []
        for _ in range(2):
            made = kind(self.url, self.source, group=self.group, ack_wait=SECOND)
            self.closed_after(made)
            watched.append(Watched(made))
        workers = [self.consumer(slow, inbox=inbox, transport=each) for each in watched]
        async with running(workers[0]), running(workers[1]):
            await wait_until(lambda: self.ledger.counts() == {"slow": 1}, what="the effect")
            await wait_until(self.settled, what="the queue empty")
        counts = total(*workers)
        assert self.ledger.counts() == {"slow": 1}
        assert counts["processed"] == 1
        seen = watched[0].seen + watched[1].seen
        if heartbeat:
            assert counts == Counter({"processed": 1})
            assert seen == [("slow", 1)]
        else:
            assert counts["in_flight"] >= 1
            assert set(counts) <= {"processed", "in_flight", "duplicate"}
            assert len(seen) >= 2  # the first, then a copy while it ran
            assert max(count or 0 for _, count in seen) >= 2
        await self.assert_settled()

    async def _fifo(self, *, ack_wait: timedelta) -> tuple[SQSProducer, SQS]:
        """A FIFO queue of this test's own (deleted after it, with its dead-letter queue): a
        producer and an open transport."""
        name = unique("fq") + ".fifo"

        async def delete() -> None:
            async with await self._admin() as client:
                for queue in (name, name.removesuffix(".fifo") + "-dead.fifo"):
                    url = await self._queue_url(client, queue)
                    if url:
                        await client.delete_queue(QueueUrl=url)

        self.after(delete)  # last, once the producer and the transport are closed
        producer = SQSProducer(self.url, name)
        self.after(producer.close)
        made = SQS(self.url, name, group=self.group, ack_wait=ack_wait)
        self.closed_after(made)
        await made.open(10)
        return producer, made

    async def test_r14_a_fifo_queue_drops_a_resend_and_keeps_a_groups_order(self) -> None:
        """On a FIFO queue the producer's message id is the deduplication id: three sends of
        one id are one message; a group's messages come in the order sent."""
        producer, made = await self._fifo(ack_wait=timedelta(seconds=5))
        for _ in range(3):
            await producer.publish(body("same"), message_id="same", group="g1")
        for n in range(3):
            await producer.publish(body(f"o{n}"), message_id=f"o{n}", group="g1")
        got: list[str] = []
        while len(got) < 4:
            delivery = await fetch_one(made)
            got.append(str(delivery.envelope.message_id))
            await delivery.ack()
        assert got == ["same", "o0", "o1", "o2"]
        assert await made.fetch(10, 0 * SECOND) == []

    async def test_r20_a_reused_id_with_other_content_reaches_the_inbox_and_its_dead_letter(
        self,
    ) -> None:
        """Three messages sharing one id with different content, on a FIFO queue. Before,
        the deduplication id was the message id: SQS dropped the second and third silently,
        so no key_conflict was ever seen (R20); and a dead-letter copy's deduplication id was
        the message id too, so of two such conflicts only one reached the dead-letter queue.
        Now each reaches the consumer, the first runs, the two others are dead-lettered."""
        producer, transport = await self._fifo(ack_wait=timedelta(seconds=10))
        for amount in (1, 2, 3):
            await producer.publish(
                json.dumps({"k": "x1", "amount": amount}).encode(), message_id="x1", group="g1"
            )
        worker = self.consumer(self.apply, transport=transport)
        async with running(worker):
            await wait_until(
                lambda: worker.counts["processed"] == 1 and worker.counts["key_conflict"] == 2,
                what="one run and two key_conflicts",
            )
        assert self.ledger.counts() == {"x1": 1}
        dead = await self.dead_letters(transport.dead_letter)
        assert sorted(json.loads(c.body)["amount"] for c in dead) == [2, 3]
        assert {c.headers.get("x-oncely-outcome") for c in dead} == {"key_conflict"}

    async def test_r10_a_fifo_group_behind_a_failure_waits_for_it_and_keeps_its_order(
        self,
    ) -> None:
        """Three messages of one FIFO group come in one batch; the first fails once. The two
        behind it are held back and given back at once, but SQS returns no message of a group
        while an earlier one is invisible (the failure, for its backoff): they come after it,
        and the effects follow the order sent. Holding them for the failure's backoff as well
        was tried: then all three turn visible together and moto hands out the last first."""
        producer, transport = await self._fifo(ack_wait=timedelta(seconds=10))
        for n in range(3):
            await producer.publish(body(f"f{n}"), message_id=f"f{n}", group="g1")
        applied: list[str] = []
        failed: list[str] = []

        async def handler(payload: dict[str, Any]) -> None:
            if payload["k"] == "f0" and not failed:
                failed.append("f0")
                raise RuntimeError("the ledger is down once")
            applied.append(payload["k"])

        worker = self.consumer(
            handler,
            transport=transport,
            backoff=Backoff(first=3 * SECOND, most=3 * SECOND),
            requeue_delay=200 * MS,
        )
        async with running(worker):
            await wait_until(lambda: len(applied) == 3, what="the group's three messages")
        assert failed == ["f0"]
        assert applied == ["f0", "f1", "f2"]

    async def test_r15_the_dead_letters_of_a_fifo_group_keep_its_order(self) -> None:
        """Ten messages of one FIFO group, each refused (a body that is not JSON), in one
        batch. Before, their outcomes were carried out all at once, and the copies reached
        the dead-letter queue in whatever order their sends ended; now a group's outcomes are
        carried out in its order: a user re-sending the dead letters gets the group's order
        back (R15)."""
        producer, transport = await self._fifo(ack_wait=timedelta(seconds=10))
        sent = [f"d{n}" for n in range(10)]
        for key in sent:
            await producer.publish(b"not json " + key.encode(), message_id=key, group="g1")
        worker = self.consumer(self.apply, transport=transport)
        async with running(worker):
            await wait_until(lambda: worker.counts["rejected"] == len(sent), what="all ten")
        dead = await self.dead_letters(transport.dead_letter)
        assert [c.message_id for c in dead] == sent

    @pytest.mark.parametrize("payload", [False, True])
    async def test_r10_a_fifo_group_behind_a_message_whose_key_is_held_waits_for_it(
        self, payload: bool
    ) -> None:
        """The first message of a group meets a claim of its key held elsewhere (a copy still
        running, a dead worker's lease not run out): it is given back ``in_flight``. Before,
        in a batch only a failure held back the group's later messages, so the two behind it
        ran first and the effects came as f1, f2, f0. Now they are held back behind it too
        (one claim for the batch; and, with a ``payload`` reader, a claim per message)."""
        producer, transport = await self._fifo(ack_wait=timedelta(seconds=10))
        # A lease of 3 s: f0 is given back for what is left of it, visible again after the
        # two behind it (SQS counts whole seconds; moto hands out a group's last message
        # first when all of them turn visible in the same second).
        inbox = oncely.AsyncInbox(
            oncely.open_async("memory://"),
            consumer=self.group,
            lease=oncely.Lease(duration=3 * SECOND),
        )
        self.after(inbox.aclose)
        held = await inbox.claim("f0", {"k": "f0"})
        assert held.won
        for n in range(3):
            await producer.publish(body(f"f{n}"), message_id=f"f{n}", group="g1")
        applied: list[str] = []

        async def handler(payload: dict[str, Any]) -> None:
            applied.append(payload["k"])

        worker = self.consumer(handler, transport=transport, inbox=inbox, requeue_delay=200 * MS)
        if payload:
            worker.processor = InboxProcessor(inbox, handler, payload=decode_body)
        async with running(worker):
            await wait_until(lambda: worker.counts["in_flight"] >= 1, what="f0 held")
            await held.release()
            await wait_until(lambda: len(applied) == 3, what="the group's three messages")
        assert applied == ["f0", "f1", "f2"]

    async def test_r10_r15_a_fifo_group_waits_behind_a_message_given_back_while_it_runs(
        self,
    ) -> None:
        """f0's claim lapsed (its worker died); the inbox's reconciler (``on_stale``) looks the
        work up, and meanwhile another worker takes f0 over: f0 is given back ``in_flight``
        after the batch's claim, while its group runs. Before, only a failure held back the
        rest of a group there, so f1 and f2 ran ahead of f0 (R15: the group is an order)."""
        producer, transport = await self._fifo(ack_wait=timedelta(seconds=10))
        store = oncely.open_async("memory://")
        taken: list[oncely.StaleClaim] = []

        async def reconcile(stale: oncely.StaleClaim) -> oncely.Resolution:
            if not taken:  # another worker, with a copy of f0, took it over meanwhile
                other = await store.takeover(
                    self.group,
                    stale.record.key,
                    expected_token=stale.record.token,
                    fingerprint=None,
                    token="other",
                    lease_ms=3000,  # given back for what is left of it, as above
                    keep_ms=86_400_000,
                )
                assert other.won
                taken.append(stale)
            return oncely.Resolution.retry()

        inbox = oncely.AsyncInbox(store, consumer=self.group, on_stale=reconcile)
        self.after(inbox.aclose)
        dead = await store.claim(
            self.group,
            "f0",
            fingerprint=None,
            token="dead",
            lease_ms=100,
            keep_ms=86_400_000,
            takeover=False,
        )
        assert dead.won
        await asyncio.sleep(0.3)  # the dead worker's lease lapses
        for n in range(3):
            await producer.publish(body(f"f{n}"), message_id=f"f{n}", group="g1")
        applied: list[str] = []

        async def handler(payload: dict[str, Any]) -> None:
            applied.append(payload["k"])

        worker = self.consumer(handler, transport=transport, inbox=inbox, requeue_delay=200 * MS)
        async with running(worker):
            await wait_until(lambda: worker.counts["in_flight"] >= 1, what="f0 given back")
            await store.release(self.group, "f0", token="other")
            await wait_until(lambda: len(applied) == 3, what="the group's three messages")
        assert len(taken) == 1
        assert applied == ["f0", "f1", "f2"]

    async def test_r10_one_message_at_a_time_keeps_a_fifo_groups_order_and_its_failures(
        self,
    ) -> None:
        """The same with ``batch=1`` (each message on its own, as the README advises where an
        effect must never repeat). Before, the messages of one receive each got a task of
        their own: the group's four ran side by side, the slow first one finished last, and
        those behind a failure ran before it. Now a group's messages run one after another,
        and those behind one given back are given back unrun behind it."""
        producer, transport = await self._fifo(ack_wait=timedelta(seconds=10))
        for n in range(4):
            await producer.publish(body(f"f{n}"), message_id=f"f{n}", group="g1")
        running_now: list[str] = []
        overlapped: list[tuple[str, ...]] = []
        applied: list[str] = []
        failed: list[str] = []

        async def handler(payload: dict[str, Any]) -> None:
            running_now.append(payload["k"])
            if len(running_now) > 1:
                overlapped.append(tuple(running_now))
            try:
                await asyncio.sleep(0.3 if payload["k"] == "f0" else 0)
                if payload["k"] == "f1" and not failed:
                    failed.append("f1")
                    raise RuntimeError("the ledger is down once")
                applied.append(payload["k"])
            finally:
                running_now.remove(payload["k"])

        worker = self.consumer(
            handler,
            transport=transport,
            batch=1,
            backoff=Backoff(first=3 * SECOND, most=3 * SECOND),
            requeue_delay=200 * MS,
        )
        async with running(worker):
            await wait_until(lambda: len(applied) == 4, what="the group's four messages")
        assert overlapped == []
        assert failed == ["f1"]
        assert applied == ["f0", "f1", "f2", "f3"]

    async def test_r10_a_fifo_message_waiting_behind_a_slow_one_is_kept_alive(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """One message at a time, a FIFO group whose first handler outlasts the visibility
        timeout: the one waiting behind it is held by this consumer and must be kept
        invisible too (its visibility extended), or it lapses while it waits and the give-back
        or delete of it meets a message no longer in flight (AWS answers MessageNotInflight)."""
        producer, transport = await self._fifo(ack_wait=timedelta(seconds=2))
        for n in range(2):
            await producer.publish(body(f"f{n}"), message_id=f"f{n}", group="g1")
        extended: list[str | None] = []
        started: list[str] = []
        extend = SQSDelivery.extend

        async def spied(delivery: SQSDelivery) -> None:
            extended.append(delivery.envelope.message_id)
            await extend(delivery)

        monkeypatch.setattr(SQSDelivery, "extend", spied)

        kept_while_waiting: list[bool] = []

        async def handler(payload: dict[str, Any]) -> None:
            started.append(payload["k"])
            if payload["k"] == "f0":
                await wait_until(lambda: extended.count("f0") >= 2, what="f0 extended twice")
            else:
                kept_while_waiting.append("f1" in extended)

        worker = self.consumer(handler, transport=transport, batch=1)
        async with running(worker):
            await wait_until(lambda: started == ["f0", "f1"], what="both messages")
        assert kept_while_waiting == [True]

    async def _redrive_to(self, redrive: str, max_receives: int) -> None:
        """Give the source queue a redrive policy moving a message to ``redrive`` after
        ``max_receives`` receives."""
        async with await self._admin() as client:
            target = await self._queue_url(client, redrive)
            arn = (await client.get_queue_attributes(QueueUrl=target, AttributeNames=["QueueArn"]))[
                "Attributes"
            ]["QueueArn"]
            policy = {"deadLetterTargetArn": arn, "maxReceiveCount": max_receives}
            await client.set_queue_attributes(
                QueueUrl=await self._queue_url(client, self.source),
                Attributes={"RedrivePolicy": json.dumps(policy)},
            )

    async def test_r13_a_redrive_limit_below_max_deliveries_is_warned_and_never_strands(
        self, caplog: pytest.LogCaptureFixture
    ) -> None:
        """A queue whose redrive policy moves a message after 2 receives, a consumer allowing
        5 deliveries, a handler that always fails. Before, the consumer said nothing at start,
        gave the message back on its second receive, and SQS moved it to the redrive queue
        with no reason. Now the start warns with both numbers, and the second receive is
        dead-lettered with the reason, to the redrive queue itself (no dead-letter queue was
        given: every dead letter is in one queue), and no ``<queue>-dead`` is made."""
        redrive = unique("sqrd")
        create_queue(redrive)
        self.after(lambda: delete_queues(self.url, redrive))
        await self._redrive_to(redrive, 2)
        await self.publish("poison")

        async def failing(payload: dict[str, Any]) -> None:
            raise RuntimeError("the ledger refuses it")

        worker = self.consumer(
            failing,
            inbox=self.inbox_named("ledger-writer"),
            max_deliveries=5,
            backoff=Backoff(first=100 * MS, most=100 * MS),
        )
        with caplog.at_level(logging.WARNING, logger="oncely"):
            async with running(worker):
                await wait_until(lambda: worker.counts["failed"] == 2, what="two failures")
                await wait_until(self.settled, what="the message gone from the queue")
        warned = [r.getMessage() for r in caplog.records if "delivery limit 2" in r.getMessage()]
        assert warned and "max_deliveries=5" in warned[0]
        (copy,) = await self.dead_letters(redrive)
        assert copy.message_id == "poison" and copy.outcome == "rejected"
        assert "maxReceiveCount" in (copy.reason or "") and copy.deliveries == "2"
        # The inbox's consumer, as on every other dead letter (it was the transport's group).
        assert copy.consumer == "ledger-writer"
        async with await self._admin() as client:
            assert await self._queue_url(client, f"{self.source}-dead") is None

    async def test_r15_a_fifo_message_held_back_spends_its_receives_and_says_so(self) -> None:
        """A FIFO queue whose redrive policy allows 3 receives, above ``max_deliveries=2`` (so
        no warning at start); in one group, f0 always fails and f1 fails once. f1 is received
        with each of f0's two runs and given back unrun, and SQS counts those receives: its
        first run is its last receive, and its first failure dead-letters it (the documented
        limit of a FIFO group's order under a redrive policy, R15). Before, the reason told
        to raise maxReceiveCount above max_deliveries, which it already was; now it names the
        receives spent held back."""
        name = unique("fq") + ".fifo"
        dead = name.removesuffix(".fifo") + "-dead.fifo"
        create_queue(dead, FifoQueue="true")
        create_queue(name, FifoQueue="true")
        self.after(lambda: delete_queues(self.url, name, dead))
        async with await self._admin() as client:
            target = await self._queue_url(client, dead)
            arn = (await client.get_queue_attributes(QueueUrl=target, AttributeNames=["QueueArn"]))[
                "Attributes"
            ]["QueueArn"]
            policy = {"deadLetterTargetArn": arn, "maxReceiveCount": 3}
            await client.set_queue_attributes(
                QueueUrl=await self._queue_url(client, name),
                Attributes={"RedrivePolicy": json.dumps(policy)},
            )
        producer = SQSProducer(self.url, name)
        self.after(producer.close)
        for n in range(2):
            await producer.publish(body(f"f{n}"), message_id=f"f{n}", group="g1")
        transport = self.closed_after(
            SQS(self.url, name, group=self.group, ack_wait=timedelta(seconds=10))
        )
        runs: list[str] = []

        async def handler(payload: dict[str, Any]) -> None:
            runs.append(payload["k"])
            if payload["k"] == "f0" or runs.count("f1") == 1:
                raise RuntimeError("the ledger refuses it")

        # f0's backoff outlasts f1's give-back: moto hands out a group's later message first
        # when the earlier one turns visible before it (SQS itself keeps the group's order).
        worker = self.consumer(
            handler,
            transport=transport,
            max_deliveries=2,
            backoff=Backoff(first=3 * SECOND, most=3 * SECOND),
        )
        async with running(worker):
            await wait_until(lambda: worker.counts["failed"] == 3, what="three failures")

            async def drained() -> bool:
                return await queue_depth(self.url, name) == 0

            await wait_until(drained, what="the group gone from the queue")
        assert runs == ["f0", "f0", "f1"]
        copies = {c.message_id: c for c in await self.dead_letters(dead)}
        assert sorted(copies) == ["f0", "f1"]
        assert copies["f1"].deliveries == "3"
        assert "held back behind earlier ones of its group" in (copies["f1"].reason or "")

    async def test_a_dead_letter_queue_given_wins_over_the_redrive_target(self) -> None:
        """The redrive policy's target is the default only: a dead-letter queue given is
        used as given."""
        redrive, given = unique("sqrd"), unique("sqdl")
        create_queue(redrive)
        self.after(lambda: delete_queues(self.url, redrive, given))
        await self._redrive_to(redrive, 9)
        defaulted, chosen = self.transport(), self.transport(dead_letter=given)
        for made in (defaulted, chosen):
            await made.open(1)
        assert (defaulted.dead_letter, chosen.dead_letter) == (redrive, given)

    async def test_a_packed_dead_letter_keeps_binary_and_number_attributes(self) -> None:
        """A message with nine application attributes, one Binary and one Number, is
        dead-lettered: its attributes are packed into one JSON attribute. Before, a Binary
        attribute was packed as an empty string and a Number one as text; now each keeps its
        type and value."""
        attributes: dict[str, Any] = {
            "message-id": {"DataType": "String", "StringValue": "packed"},
            "content-type": {"DataType": "String", "StringValue": "application/json"},
            "signature": {"DataType": "Binary", "BinaryValue": b"\x00\xffsig"},
            "amount": {"DataType": "Number", "StringValue": "12.50"},
            **{f"h{n}": {"DataType": "String", "StringValue": f"v{n}"} for n in range(6)},
        }
        await self.producer().send('{"k": "packed"}', attributes, message_id="packed")
        made = self.transport()
        await made.open(1)
        got = await fetch_one(made)
        await got.dead_letter(
            DeadLetter(outcome="rejected", reason="test", consumer="c", deliveries=1)
        )
        async with await self._admin() as client:
            dead = await self._queue_url(client, f"{self.source}-dead")
            found = await client.receive_message(
                QueueUrl=dead, MessageAttributeNames=["All"], WaitTimeSeconds=1
            )
        (message,) = found["Messages"]
        packed = json.loads(message["MessageAttributes"][PACKED_ATTRIBUTE]["StringValue"])
        assert packed["h0"] == "v0"
        assert packed["amount"] == {"DataType": "Number", "StringValue": "12.50"}
        signature = packed["signature"]
        assert signature["DataType"] == "Binary"
        assert base64.b64decode(signature["BinaryValue"]) == b"\x00\xffsig"

    async def test_a_dead_letter_copy_has_its_reason_cut_to_the_queues_message_size(
        self,
    ) -> None:
        """SQS counts a message's attributes (names, types, values) in its size, up to the
        queue's ``MaximumMessageSize``. A handler whose error is long (a driver's message
        with its SQL, a traceback) made an ``x-oncely-reason`` of any length: on AWS the copy
        is refused, the message given back, and it loops until the redrive policy moves it
        without a reason (moto checks the body alone, so it took the copy). Now the reason is
        cut so that the copy fits the dead-letter queue, and says it was cut."""
        await self.producer().publish(b'{"k": "long"}', message_id="long")
        most = 2048
        await self._set_dead_size(most)

        async def handler(payload: dict[str, Any]) -> None:
            raise RuntimeError("a long error " + "x" * 5000)

        worker = self.consumer(handler, max_deliveries=1)
        async with running(worker):
            await wait_until(lambda: worker.counts["dead_lettered_after_retries"] == 1)
        async with await self._admin() as client:
            queue = await self._queue_url(client, f"{self.source}-dead")
            got = await client.receive_message(
                QueueUrl=queue, MessageAttributeNames=["All"], WaitTimeSeconds=1
            )
        (message,) = got["Messages"]
        size = len(message["Body"].encode()) + sum(
            len(name.encode())
            + len(value["DataType"].encode())
            + len(value.get("StringValue", "").encode())
            + len(value.get("BinaryValue", b""))
            for name, value in message["MessageAttributes"].items()
        )
        reason = message["MessageAttributes"]["x-oncely-reason"]["StringValue"]
        assert size <= most
        assert reason.startswith("failed on all 1 deliveries; last: handler raised RuntimeError")
        assert reason.endswith("[cut to fit the queue's MaximumMessageSize]")

    async def _set_dead_size(self, most: int) -> None:
        """The dead-letter queue made now, with a ``MaximumMessageSize`` of ``most``."""
        create_queue(f"{self.source}-dead", MaximumMessageSize=str(most))

    async def test_a_producer_to_a_missing_queue_says_it_never_creates_one(self) -> None:
        producer = SQSProducer(self.url, unique("sqs_nowhere"))
        self.after(producer.close)
        with pytest.raises(BrokerError, match="a producer never creates one"):
            await producer.publish(b"{}", message_id="m")

    async def test_a_slow_handler_in_a_batch_holds_up_no_other_message(self) -> None:
        """Batch mode (the default, ten per receive): one message's handler blocks. Before,
        the next receive waited until every handler of the batch had ended, so messages sent
        meanwhile waited for the slow one. Now they are received and processed while it
        runs, and the handlers of all batches together stay within ``concurrency``."""
        started, release = asyncio.Event(), asyncio.Event()
        running_now: list[str] = []
        most = 0

        async def handler(payload: dict[str, Any]) -> None:
            nonlocal most
            running_now.append(payload["k"])
            most = max(most, len(running_now))
            try:
                if payload["k"] == "slow":
                    started.set()
                    await release.wait()
                else:
                    await asyncio.sleep(0.05)
                await self.apply(payload)
            finally:
                running_now.remove(payload["k"])

        await self.publish("slow")
        worker = self.consumer(handler, concurrency=3)
        async with running(worker):
            await asyncio.wait_for(started.wait(), 60)
            later = [f"l{n}" for n in range(15)]
            for key in later:
                await self.publish(key)
            await wait_until(
                lambda: set(later) <= set(self.ledger.counts()),
                what="the later messages, while the slow one runs",
            )
            release.set()
            await wait_until(lambda: "slow" in self.ledger.counts(), what="the slow one")
        assert set(self.ledger.counts().values()) == {1}
        assert most <= 3
        await self.assert_settled()

    async def test_a_body_that_is_not_utf8_travels_as_base64_and_comes_back_as_it_was(
        self,
    ) -> None:
        raw = b"\xff\x00binary"
        producer = self.producer()
        await producer.publish(raw, message_id="bin", content_type="application/octet-stream")
        made = self.transport()
        await made.open(1)
        got = await fetch_one(made)
        assert got.envelope.body == raw and got.refusal is None
        await got.ack()

    async def test_too_many_attributes_are_refused_before_sending(self) -> None:
        producer = self.producer()
        headers = {f"h{n}": "v" for n in range(9)}
        with pytest.raises(oncely.ConfigurationError, match="at most 10 message attributes"):
            await producer.publish(b"{}", message_id="m", headers=headers)

    @pytest.mark.parametrize(
        ("environment", "said"),
        [
            ({"AWS_PROFILE": "oncely-no-such-profile"}, "ProfileNotFound"),
            ({"AWS_ACCESS_KEY_ID": "AKIDONLY"}, "PartialCredentialsError"),
            ({}, "NoCredentialsError"),
        ],
    )
    async def test_credentials_that_cannot_be_found_stop_the_start_not_retried_as_an_outage(
        self, monkeypatch: pytest.MonkeyPatch, tmp_path: Any, environment: dict[str, str], said: str
    ) -> None:
        # A user without credentials saw a WARNING "unavailable ... trying again" every few
        # seconds, for ever: no credentials are not an outage that waiting rides out. Nothing
        # is sent anywhere: botocore looks for credentials before it connects (port 1 here).
        for name in [n for n in os.environ if n.startswith("AWS_")]:
            monkeypatch.delenv(name)
        monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "config"))
        monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "credentials"))
        monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
        for name, value in environment.items():
            monkeypatch.setenv(name, value)
        # With no credentials at all, AWS itself: the signer refuses before any request.
        made = SQS("sqs://eu-west-1" if not environment else "sqs://127.0.0.1:1", "q", group="g")
        with pytest.raises(BrokerError, match="credentials") as raised:
            await made.open(1)
        await made.close()
        assert not isinstance(raised.value, oncely.BrokerUnavailable)
        assert said in str(raised.value)

    async def test_a_mistyped_region_is_named_in_the_outage_it_causes(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """``sqs://eu-wset-1`` has the shape of a region, so it passes the URL's check, and its
        endpoint's name does not resolve: the consumer said "Could not connect to the endpoint
        URL" and tried again for ever, never that the region was no region. The outage is
        still waited out (botocore's list lags AWS's new regions), but its line now says that
        botocore knows no such region. The name is looked up for real (and never found)."""
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDEXAMPLE")
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret")
        made = SQS("sqs://eu-wset-1", "q", group="g")
        with pytest.raises(oncely.BrokerUnavailable) as raised:
            await made.open(1)
        await made.close()
        said = str(raised.value)
        assert "knows no AWS region 'eu-wset-1' for SQS" in said, said
        assert "check the region's spelling" in said, said
        assert region_hint("sqs", "eu-west-1") == ""

    @pytest.mark.parametrize(
        "host", ["sqs-fips.us-east-1.amazonaws.com", "vpce-0a1b.sqs.us-east-1.vpce.amazonaws.com"]
    )
    async def test_an_aws_endpoint_url_takes_the_aws_configurations_credentials(
        self, monkeypatch: pytest.MonkeyPatch, tmp_path: Any, host: str
    ) -> None:
        """An endpoint of AWS's own (FIPS, a VPC endpoint) named in the URL is no emulator: a
        user with an instance role or a credentials file and no AWS_ACCESS_KEY_ID was signed
        with the placeholders an emulator gets, and refused. The client is only built,
        nothing is sent to AWS."""
        for name in [n for n in os.environ if n.startswith("AWS_")]:
            monkeypatch.delenv(name)
        credentials = tmp_path / "credentials"
        credentials.write_text(
            "[default]\naws_access_key_id = AKIAFROMTHEFILE\naws_secret_access_key = s\n"
        )
        monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(credentials))
        monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
        aws, _ = Endpoint.from_url(f"sqs://{host}:443?secure=true&region=us-east-1")
        async with aws.client() as client:
            signed = await client._request_signer._credentials.get_frozen_credentials()
            assert signed.access_key == "AKIAFROMTHEFILE"
        # An emulator's endpoint (moto's, here) still gets the placeholders: it accepts any.
        emulator, _ = Endpoint.from_url(self.url)
        async with emulator.client() as client:
            signed = await client._request_signer._credentials.get_frozen_credentials()
            assert signed.access_key == "oncely"
            await client.list_queues()  # and they do for it

    async def test_a_missing_queue_to_read_is_created_with_a_warning_or_refused(
        self, caplog: pytest.LogCaptureFixture
    ) -> None:
        # A mistyped --source used to make an empty queue with only an INFO line to say so.
        name = unique("sqs_missing")
        refused = SQS(f"{self.url}?create=false", name, group="g")
        with pytest.raises(BrokerError, match="create=false"):
            await refused.open(1)
        await refused.close()
        made = SQS(self.url, name, group="g")
        with caplog.at_level(logging.INFO, logger="oncely"):
            await made.open(1)
        await made.close()
        created = {r.getMessage(): r.levelno for r in caplog.records if "created" in r.getMessage()}
        source = [level for text, level in created.items() if f"queue {name} " in text]
        dead = [level for text, level in created.items() if f"{name}-dead" in text]
        assert source == [logging.WARNING] and "create=false" in " ".join(created)
        assert dead == [logging.INFO]
        await remove_destinations(self.url, name)

    async def test_a_queue_deleted_mid_run_is_waited_for_with_backoff_never_made_again(
        self, caplog: pytest.LogCaptureFixture
    ) -> None:
        """The queue is deleted under a running consumer. Before, the next receive raised
        BrokerError (NonExistentQueue) and the consumer stopped. Now it logs one ERROR naming
        the queue and what to do, then each receive that finds it still missing is an outage
        the consumer waits out with its reconnect backoff (a WARNING each, longer and longer:
        no busy loop); it never creates the queue itself, even with create=true, which would
        drop the operator's attributes (redrive policy, retention, encryption). Once the
        queue is created again it says so and reads what is sent there."""
        await self.publish("before")
        watched = Watched(self.transport())
        worker = self.consumer(self.apply, transport=watched)
        with caplog.at_level(logging.INFO, logger="oncely"):
            async with running(worker) as task:
                await wait_until(lambda: worker.counts["processed"] == 1, what="the first")
                await self.delete_source()
                await wait_until(
                    lambda: task.done() or len(watched.failures) >= 5, what="five failed tries"
                )
                assert not task.done(), f"the consumer stopped: {task.exception()!r}"
                async with await self._admin() as client:
                    assert await self._queue_url(client, self.source) is None  # not made
                await asyncio.to_thread(create_queue, self.source)
                await self.producer().publish(body("after"), message_id="after")
                await wait_until(lambda: worker.counts["processed"] == 2, what="the one after")
        assert self.ledger.counts() == {"before": 1, "after": 1}
        said = [(r.levelno, r.getMessage()) for r in caplog.records]
        errors = [text for level, text in said if level >= logging.ERROR]
        assert len(errors) == 1, errors
        assert f"queue {self.source} does not exist any more" in errors[0]
        assert "create it as it was" in errors[0]
        pauses = [
            float(found.group(1))
            for _, text in said
            if self.source in text and (found := re.search(r"trying again in ([\d.]+)s", text))
        ]
        assert len(pauses) == len(watched.failures)  # each failed try waited before the next
        assert pauses == sorted(pauses) and pauses[-1] > pauses[0]  # backing off
        assert any(f"queue {self.source} exists again" in text for _, text in said)
        await self.assert_settled()

    async def test_open_transport_reads_sqs_urls(self) -> None:
        made = open_transport(f"{self.url}?visibility_timeout=7", self.source, group="g")
        assert isinstance(made, SQS)
        assert made.visibility == 7 and made.dead_letter == f"{self.source}-dead"
        assert isinstance(open_producer(self.url, self.source), SQSProducer)
        with pytest.raises(oncely.ConfigurationError, match="unknown option"):
            open_transport(f"{self.url}?nope=1", self.source, group="g")
        with pytest.raises(oncely.ConfigurationError, match="not an SQS queue name"):
            SQS(self.url, "bad.name", group="g")
        # A user with a queue URL at hand (AWS consoles and Lambda settings give those) is
        # told the name to give, not only that the URL is no name.
        with pytest.raises(oncely.ConfigurationError, match="give the queue's name, 'orders'"):
            SQS(self.url, "https://sqs.eu-west-1.amazonaws.com/123456789012/orders", group="g")
        with pytest.raises(oncely.ConfigurationError, match="credentials"):
            SQS("sqs://key:secret@127.0.0.1:1", "q", group="g")
        region = SQS("sqs://eu-west-1", "q", group="g")
        assert region.endpoint.region == "eu-west-1" and region.endpoint.endpoint_url is None

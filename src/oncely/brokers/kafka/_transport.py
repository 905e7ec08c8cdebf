"""The Kafka transport: a consumer-group member that hands out, per partition, one run of
consecutive records at a time (one record, or a batch's worth) and commits, per partition, the
end of the run of finished records."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from time import monotonic
from typing import Any, Literal, Self, cast

from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import (
    CommitFailedError,
    IllegalGenerationError,
    IllegalStateError,
    KafkaError,
    RebalanceInProgressError,
    TopicAlreadyExistsError,
    UnknownMemberIdError,
)
from aiokafka.structs import OffsetAndMetadata

from oncely._core.said import said
from oncely.brokers._shape import BrokerLimits, DeadLetter, Delivery
from oncely.brokers.kafka._producer import TOPIC_MISSING, KafkaProducer, TopicIds
from oncely.brokers.kafka._records import (
    CONSUMER_URL_OPTIONS,
    LOGGER,
    PRODUCER_URL_OPTIONS,
    SHARED_URL_OPTIONS,
    TOMBSTONE_CHOICES,
    Cluster,
    check_topic,
    envelope_of,
    ms,
)
from oncely.errors import BrokerError, BrokerUnavailable, ConfigurationError
from oncely.keys import Envelope
from oncely.stores._offsets import MAX_STREAM_CHARS

_TRANSPORT_OPTIONS = (*CONSUMER_URL_OPTIONS, "timeout", "connect_timeout", *SHARED_URL_OPTIONS)
_POLL_SLACK = 0.1
"""Seconds a poll may take past its own wait before it is cut (see ``Kafka._poll``)."""
_UNASSIGNED_AFTER = 60.0
"""Seconds a member may go without a partition before it says so (once per such stretch)."""
RETIRED_OFFSET = 2**63 - 1
"""Written over a row an earlier oncely kept under the topic's name once its offsets are
taken over under the topic's id: never used again (an earlier oncely finds it past the
partition's end and leaves it)."""
_CLOSE_CANCELS = 4
"""How many times a close step past its timeout is cancelled before it is left behind."""
_CLOSE_CANCEL_WAIT = 0.5
"""Seconds a close step is given to end after each cancel."""
_LEFT_BEHIND: set[asyncio.Task[None]] = set()
"""Close steps that outlived their cancels: kept referenced so they are not collected
mid-run."""

_REMEMBERED = 10_000
"""How many records' run counts a member keeps for partitions it gave up (the oldest are
forgotten first): enough for every partition's blocked head, bounded whatever happens."""

Tombstones = Literal["dead_letter", "handle"]

_FENCED = (CommitFailedError, IllegalStateError, IllegalGenerationError, UnknownMemberIdError)


_RUNNING, _DONE, _BACK = 0, 1, 2


@dataclass(slots=True, eq=False)
class _Held:
    """A record fetched and not yet finished: waiting in its partition, or handed out."""

    record: Any
    attempt: int = 1
    not_before: float = 0.0
    state: int = _RUNNING
    """While handed out: running, done (finished), or back (to be handed out again)."""
    delay: float = 0.0
    counted: bool = True
    """Whether its give-back counts as a delivery: a failure does, a requeue of a record that
    did not run (held back behind a failure, or meeting a running copy) does not."""


@dataclass(slots=True, eq=False)
class _Partition:
    """What this member knows of one partition it owns."""

    tp: TopicPartition
    waiting: deque[_Held] = field(default_factory=deque)
    out: list[_Held] = field(default_factory=list)
    """The run handed out, in offset order; the partition hands out nothing else until
    every record of it is settled."""
    running: int = 0
    """How many records of the run are not settled yet."""
    finished: int | None = None
    """The offset to commit: one past the last record finished in order."""
    committed: int | None = None
    owned: bool = True
    old_log: bool = False
    """Its topic was deleted (and created again): nothing of it is remembered."""
    revoking: bool = False
    """The group is taking it away: what is running finishes, nothing more starts."""
    paused: bool = False
    starting: bool = False
    """Its start is being looked up (the offsets stored in the database): paused, and
    nothing read of it is taken yet."""
    set_aside: int | None = None
    """The first offset read while it was starting (and not taken): read again from there
    unless the start moves elsewhere."""
    unstored: int | None = None
    """With stored offsets: the offset past records finished in an earlier run, after one
    given back (their positions were not written then: the record before them had its
    broker action still to come), to be stored before the group's commit passes them."""
    idle: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self.idle.set()


class Kafka:
    """Reads the topic ``source`` as a member of the consumer group ``group`` (see the
    module docstring for ordering, commits, rebalances, retries and dead letters).

    ``session_timeout`` is how long the group waits for a silent member before giving its
    partitions to another (the redelivery wait of a crashed consumer); ``revoke_grace`` how
    long a rebalance waits for this member's running handlers before it gives their
    partitions up; ``partitions`` the partition count of a topic this transport creates (the
    source or the dead-letter topic, when missing); ``max_buffered`` the records fetched
    ahead per partition before its fetching pauses; ``timeout`` bounds each commit and
    dead-letter write, ``connect_timeout`` reaching the cluster and joining the group.

    ``tombstones`` is what becomes of a record whose value is null (a tombstone: on a
    compacted topic, the deletion of its record key): ``"dead_letter"`` (the default) copies
    it to the dead-letter topic with a reason that says so, and no handler sees it;
    ``"handle"`` hands it to the handler, whose payload is then an
    :class:`~oncely.brokers.kafka.Tombstone` holding the record key.
    """

    name = "kafka"
    batch_default = 500
    """Batches by default: one claim and one completion per polled batch (records of one
    partition in order, partitions side by side)."""
    local_delivery_counts = True
    """Delivery counts are this member's own; the consumer also counts the inbox's attempts."""
    topic_check_every: timedelta = timedelta(seconds=10)
    """How often a running member reads its topic's id: a topic deleted under it is said at
    ERROR, and one deleted and created again under its name (a new id) is read from the new
    log's start. Without the look, the member kept the old log's positions and silently
    skipped the new log's records below them."""
    extend_every: timedelta | None = None
    """Kafka never gives a record a live member holds to another member; a rebalance moves
    whole partitions, and this member gives up what it holds first (``revoke_grace``)."""

    def __init__(
        self,
        url: str,
        source: str,
        *,
        group: str,
        dead_letter: str | None = None,
        session_timeout: timedelta = timedelta(seconds=10),
        revoke_grace: timedelta = timedelta(seconds=10),
        partitions: int = 1,
        max_buffered: int = 1000,
        timeout: timedelta = timedelta(seconds=30),
        connect_timeout: timedelta = timedelta(seconds=10),
        tombstones: Tombstones = "dead_letter",
    ) -> None:
        cluster, options = Cluster.from_url(url)
        options.done(
            _TRANSPORT_OPTIONS,
            read_by="open_transport() and Kafka.from_url()",
            theirs=PRODUCER_URL_OPTIONS,
            side=("producer", "consumer"),
        )
        self._setup(
            cluster,
            source,
            group,
            dead_letter,
            session_timeout,
            revoke_grace,
            partitions,
            max_buffered,
            timeout,
            connect_timeout,
            tombstones,
        )

    def _setup(
        self,
        cluster: Cluster,
        source: str,
        group: str,
        dead_letter: str | None,
        session_timeout: timedelta,
        revoke_grace: timedelta,
        partitions: int,
        max_buffered: int,
        timeout: timedelta,
        connect_timeout: timedelta,
        tombstones: Tombstones = "dead_letter",
    ) -> None:
        self.cluster = cluster
        self.source = check_topic("topic", source)
        if not group:
            raise ConfigurationError("a Kafka consumer needs its consumer group (group=...)")
        self.group = group
        self.dead_letter = check_topic(
            "dead-letter topic", dead_letter if dead_letter is not None else f"{source}.dead"
        )
        if self.dead_letter == self.source:
            raise ConfigurationError("the dead-letter topic must not be the topic it serves")
        if session_timeout < timedelta(seconds=1):
            raise ConfigurationError("session_timeout must be at least 1 second")
        if revoke_grace < timedelta(0) or min(timeout, connect_timeout) <= timedelta(0):
            raise ConfigurationError(
                "revoke_grace must not be negative, timeout and connect_timeout positive"
            )
        self.connect_timeout = connect_timeout
        if partitions < 1 or max_buffered < 1:
            raise ConfigurationError("partitions and max_buffered must be at least 1")
        self.session_timeout = session_timeout
        self.revoke_grace = revoke_grace
        self.partitions = partitions
        self.max_buffered = max_buffered
        self.timeout = timeout
        if not isinstance(tombstones, str) or tombstones not in TOMBSTONE_CHOICES:
            raise ConfigurationError(
                f"tombstones must be 'dead_letter' or 'handle', not {tombstones!r}"
            )
        self.tombstones: Tombstones = tombstones
        self._consumer: AIOKafkaConsumer | None = None
        self._producer: KafkaProducer | None = None
        self._owned: dict[TopicPartition, _Partition] = {}
        self._turn = 0
        self._wake = asyncio.Event()
        """Set when a run is settled: a fetch waiting behind it hands out what follows."""
        self._stopped = False
        self._prefetch = 1
        self._start_from: Callable[[str], Awaitable[Mapping[int, int]]] | None = None
        self._save: Callable[[tuple[str, int, int]], Awaitable[None]] | None = None
        self._stream = self.source
        self._topic_id: str | None = None
        self._topic_ids = TopicIds(self.cluster)
        """The topic's id as this member last found it (``None``: not known yet)."""
        self._topic_gone = False
        self._looking: asyncio.Future[str | None] | None = None
        self._look_at = 0.0
        self._unassigned_after = max(_UNASSIGNED_AFTER, 3 * session_timeout.total_seconds())
        self._unassigned_since: float | None = None
        """Since when this member has owned no partition (``None``: it owns some, or it
        said so already)."""
        self._runs: dict[tuple[TopicPartition, int], tuple[int, float]] = {}
        """The attempt and the earliest next run of the records left unfinished in
        partitions this member gave up, by partition and offset: a partition the group
        gives back to it resumes their counts (and backoffs) instead of starting again."""

    @classmethod
    def from_url(
        cls,
        url: str,
        source: str,
        *,
        group: str,
        dead_letter: str | None = None,
        ack_wait: timedelta | None = None,
    ) -> Self:
        """The transport for ``kafka://host:port[,host:port]?options``. Options:
        ``session_timeout``, ``revoke_grace``, ``timeout`` and ``connect_timeout`` (seconds),
        ``partitions``, ``max_buffered``, ``tombstones`` (``dead_letter`` or ``handle``),
        ``security_protocol``, ``sasl_mechanism``, ``client_id``.
        ``ack_wait``, where given, is the session timeout (Kafka has no per-record ack
        wait: a member's partitions move once its session lapses)."""
        cluster, options = Cluster.from_url(url)
        session = options.seconds("session_timeout", timedelta(seconds=10))
        grace = options.seconds("revoke_grace", timedelta(seconds=10))
        partitions = options.integer("partitions", 1)
        buffered = options.integer("max_buffered", 1000)
        timeout = options.seconds("timeout", timedelta(seconds=30))
        connect = options.seconds("connect_timeout", timedelta(seconds=10))
        tombstones = options.choice("tombstones", "dead_letter", TOMBSTONE_CHOICES)
        options.done(_TRANSPORT_OPTIONS, theirs=PRODUCER_URL_OPTIONS, side=("producer", "consumer"))
        made = cls.__new__(cls)
        made._setup(
            cluster,
            source,
            group,
            dead_letter,
            ack_wait if ack_wait is not None else session,
            grace,
            partitions,
            buffered,
            timeout,
            connect,
            cast(Tombstones, tombstones),
        )
        return made

    @property
    def limits(self) -> BrokerLimits:
        """For the redelivery horizon (R13): a crashed member's records go to another once
        its session lapses; Kafka counts no deliveries (the inbox's attempts do)."""
        return BrokerLimits(
            ack_wait=self.session_timeout + self.revoke_grace,
            source="the group's session timeout and the revoke grace",
        )

    def start_from(
        self,
        read: Callable[[str], Awaitable[Mapping[int, int]]],
        save: Callable[[tuple[str, int, int]], Awaitable[None]] | None = None,
    ) -> None:
        """Start each assigned partition from the offset ``read(stream)`` gives for it (the
        offsets a transactional consumer keeps in its database), where that is ahead of the
        group's committed offset; the commit then catches up with it.

        The stream is :attr:`offsets_stream`: the topic's name and the id the cluster gave
        the topic when it was created, so the offsets of a topic deleted and created again
        under its name are never taken for the new one's. With ``save`` (a position's
        writer), offsets an earlier oncely kept under the topic's name alone are taken over
        once, under the id, and their rows retired."""
        self._start_from = read
        self._save = save

    @property
    def offsets_stream(self) -> str:
        """The stream name this member's stored offsets are kept under once open:
        ``TOPIC@TOPIC_ID`` (the topic's name cut short where both would pass 255
        characters), or the topic's name on a cluster that gives topics no id (before
        Kafka 2.8)."""
        return self._stream

    async def _read_topic_id(self) -> None:
        """Read the topic's id, for :attr:`offsets_stream` when offsets are stored (a
        cluster that does not answer then raises), and for the look at the topic (which
        reads it later when it cannot be read now)."""
        try:
            found = await asyncio.to_thread(self._topic_ids.read, self.source, self.connect_timeout)
        except BrokerUnavailable:
            if self._start_from is not None:
                raise
            return
        self._topic_id = found
        self._stream_of(found)

    def _stream_of(self, found: str | None) -> None:
        if self._start_from is None:
            return
        if found is None:
            self._stream = self.source
            return
        room = MAX_STREAM_CHARS - len(found) - 1
        self._stream = f"{self.source[:room]}@{found}"

    async def _look_at_topic(self, consumer: AIOKafkaConsumer) -> None:
        """Every ``topic_check_every``, the topic's id read in a thread (the answer taken at
        a later fetch): a topic gone, or a new one under its name, is acted on."""
        self._looked(consumer)
        if monotonic() >= self._look_at:
            self._look()

    def _look(self) -> asyncio.Future[str | None] | None:
        """A look at the topic's id started (unless one is under way, or looks are over)."""
        if self._looking is None and not self._stopped and self._look_at != float("inf"):
            every = self.topic_check_every.total_seconds()
            self._look_at = monotonic() + (min(every, 1.0) if self._topic_gone else every)
            self._looking = asyncio.ensure_future(
                asyncio.to_thread(
                    self._topic_ids.read, self.source, self.connect_timeout, missing_ok=True
                )
            )
        return self._looking

    def _looked(self, consumer: AIOKafkaConsumer) -> bool:
        """The answer of a look that has ended acted on: whether the log this member read is
        gone (the topic deleted, or created again under its name)."""
        looking = self._looking
        if looking is None or not looking.done():
            return False
        self._looking = None
        try:
            return self._topic_is(consumer, looking.result())
        except BrokerError:  # the cluster did not answer: looked at again next time
            return False

    def _topic_is(self, consumer: AIOKafkaConsumer, found: str | None) -> bool:
        if found is None:  # the cluster gives topics no id (before Kafka 2.8): no look
            self._look_at = float("inf")
            return False
        owned = [p for p in self._owned.values() if p.owned]
        if found == TOPIC_MISSING:
            if not self._topic_gone:
                self._topic_gone = True
                LOGGER.error(
                    "oncely broker=kafka topic=%s group=%s the topic does not exist any more "
                    "(deleted while read): nothing is read until it is created again, then "
                    "from its start. The consumer does not create it again while it runs "
                    "(its partitions, replication and settings are yours to give)",
                    self.source,
                    self.group,
                )
                # Nothing of a new log is read from the old one's positions meanwhile, and
                # the old log's finished offsets are committed nowhere: a commit to a topic
                # that is gone is retried by the client until it times out.
                with contextlib.suppress(KafkaError, AssertionError):
                    consumer.pause(*(p.tp for p in owned))
                for part in owned:
                    part.committed = part.finished
            return True
        known, self._topic_id = self._topic_id, found
        if known is not None and known != found:
            self._topic_gone = False
            self._new_log(consumer, known, found)
            return True
        if self._topic_gone:  # only looked missing (a cluster's metadata lagging): read on
            for part in owned:
                if not part.paused and not part.starting:
                    with contextlib.suppress(KafkaError, AssertionError):
                        consumer.resume(part.tp)
        self._topic_gone = False
        return False

    def _new_log(self, consumer: AIOKafkaConsumer, known: str, found: str) -> None:
        """The topic was deleted and created again under its name: the positions and the
        finished offsets this member holds are the old log's. Each owned partition starts
        afresh from the new log's start (offset 0; past a trimmed start the client's reset
        to the earliest takes over); the old log's records still out are settled nowhere."""
        self._stream_of(found)
        owned = [p for p in self._owned.values() if p.owned]
        LOGGER.warning(
            "oncely broker=kafka topic=%s group=%s the topic was deleted and created again "
            "(its id %s is now %s): partitions %s are read from the new log's start; records "
            "of the old log still running are not committed",
            self.source,
            self.group,
            known,
            found,
            sorted(p.tp.partition for p in owned),
        )
        self._runs.clear()  # the counts of the old log's records, none of the new one's
        for old in owned:
            old.owned = False  # nothing of it is committed or handed out again
            old.old_log = True
            old.waiting.clear()
            self._owned[old.tp] = _Partition(old.tp)
            with contextlib.suppress(KafkaError, AssertionError):  # not assigned any more
                consumer.seek(old.tp, 0)
                consumer.resume(old.tp)
        # Its partition count may differ: new metadata lets the group rebalance if so.
        with contextlib.suppress(Exception):
            consumer._client.force_metadata_update()

    @property
    def assignment(self) -> frozenset[int]:
        """The partitions of the topic this member owns now."""
        return frozenset(tp.partition for tp, p in self._owned.items() if p.owned)

    # ------------------------------------------------------------------ the connection

    @contextlib.contextmanager
    def _errors(self, what: str) -> Iterator[None]:
        try:
            yield
        except BrokerError:
            raise
        except (KafkaError, OSError) as exc:
            raise BrokerUnavailable(
                f"kafka {self.cluster.shown} topic {self.source!r}: could not {what}: {said(exc)}"
            ) from None

    async def open(self, prefetch: int) -> None:
        self._prefetch = max(1, prefetch)
        self._stopped = False
        if self._consumer is not None:
            return
        await self._create_topics()
        await self._read_topic_id()
        consumer = AIOKafkaConsumer(
            **self.cluster.aiokafka(),
            group_id=self.group,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            session_timeout_ms=ms(self.session_timeout),
            heartbeat_interval_ms=max(100, ms(self.session_timeout) // 3),
            rebalance_timeout_ms=ms(self.session_timeout + self.revoke_grace) * 2,
            max_poll_records=500,
            isolation_level="read_committed",
        )
        consumer.subscribe([self.source], listener=_Listener(self, consumer))
        # No time limit of ours on the start: the cluster answered the topic check, and a
        # member that gave up on a slow group join and joined again would start one more
        # rebalance each time (the group would never settle). The client's own timeouts hold.
        with self._errors("join the group"):
            try:
                await consumer.start()
            except BaseException:
                await consumer.stop()
                raise
        self._consumer = consumer
        self._unassigned_since = monotonic()

    async def _create_topics(self) -> None:
        admin = AIOKafkaAdminClient(
            **self.cluster.aiokafka(), request_timeout_ms=ms(self.connect_timeout)
        )
        with self._errors("reach the cluster"):
            try:
                await asyncio.wait_for(admin.start(), self.connect_timeout.total_seconds())
            except TimeoutError:
                raise BrokerUnavailable(
                    f"kafka {self.cluster.shown}: no answer within "
                    f"{self.connect_timeout.total_seconds():g}s"
                ) from None
            try:
                existing = set(await admin.list_topics())
                missing = [t for t in (self.source, self.dead_letter) if t not in existing]
                if missing:
                    with contextlib.suppress(TopicAlreadyExistsError):  # another member's
                        await admin.create_topics(
                            [NewTopic(t, self.partitions, 1) for t in missing]
                        )
                    # The topic to read made here is news: a mistyped name reads nothing, and
                    # one replica suits a test broker, not a cluster.
                    level = logging.WARNING if self.source in missing else logging.INFO
                    LOGGER.log(
                        level,
                        "oncely broker=kafka created topics %s with %d partitions and one "
                        "replica each; create a cluster's topics yourself",
                        missing,
                        self.partitions,
                    )
            finally:
                await admin.close()

    def _producing(self) -> KafkaProducer:
        if self._producer is None:
            made = KafkaProducer.__new__(KafkaProducer)
            made._setup(
                self.cluster, self.dead_letter, True, self.timeout, self.timeout, timedelta(0), None
            )
            self._producer = made
        return self._producer

    async def stop(self) -> None:
        self._stopped = True

    async def close(self) -> None:
        """Commit what is finished and leave the group. Neither step raises: a broker that is
        away (or a client that fails while it stops) is logged at WARNING, and what was not
        committed is read again by the group's next member. Each step is bounded by the
        timeout, a client that swallows its cancellation included. Only a cancellation of
        the task that closes propagates."""
        self._stopped = True
        consumer, self._consumer = self._consumer, None
        looking, self._looking = self._looking, None
        if looking is not None:  # its thread ends by itself; its answer is not wanted
            looking.add_done_callback(lambda done: done.cancelled() or done.exception())
            looking.cancel()
        try:
            if consumer is not None:
                await self._quietly(
                    "commit the finished records",
                    self._commit(consumer, list(self._owned.values())),
                )
                # leaves the group: its partitions move at once
                stopped = await self._quietly("stop the client", consumer.stop())
                if not stopped:
                    # A stop() that failed part way left aiokafka's connections (and their
                    # metadata task, which reconnects forever) open: close them ourselves.
                    await self._quietly("close the connections", consumer._client.close())
        finally:
            self._owned.clear()
            producer, self._producer = self._producer, None
            if producer is not None:
                await producer.close()

    async def _quietly(self, what: str, step: Coroutine[Any, Any, None]) -> bool:
        """Run ``step`` of the close for at most the timeout; whether it succeeded, its
        failure logged instead of raised. ``asyncio.wait_for`` cannot bound it: aiokafka's
        ``stop()`` awaits tasks it has just cancelled with the ``CancelledError`` suppressed,
        so a cancellation landing there is swallowed and ``wait_for`` then waits for the rest
        of the stop (a group join the broker holds, a commit retried). Here a step past its
        time is cancelled again until it ends, and left behind after a few tries. A
        ``CancelledError`` of the client's own (its fetcher's) is its failure; one of the task
        that closes propagates."""
        task = asyncio.ensure_future(step)
        try:
            done, _ = await asyncio.wait({task}, timeout=self.timeout.total_seconds())
            for _try in range(_CLOSE_CANCELS):
                if done:
                    break
                task.cancel()
                done, _ = await asyncio.wait({task}, timeout=_CLOSE_CANCEL_WAIT)
        except asyncio.CancelledError:
            task.cancel()  # the task that closes is cancelled: so is its step
            raise
        if not done:
            _LEFT_BEHIND.add(task)  # referenced until it ends, however late
            task.add_done_callback(_LEFT_BEHIND.discard)
            self._close_failed(
                what,
                TimeoutError(
                    f"it did not end within {self.timeout.total_seconds():g}s, "
                    f"nor after {_CLOSE_CANCELS} cancels"
                ),
            )
            return False
        try:
            task.result()
        except (asyncio.CancelledError, Exception) as exc:
            self._close_failed(what, exc)
            return False
        return True

    def _close_failed(self, what: str, exc: BaseException) -> None:
        cause = exc.__context__
        LOGGER.warning(
            "oncely broker=kafka topic=%s group=%s could not %s on close (%s%s); what was "
            "not committed is read again by the group",
            self.source,
            self.group,
            what,
            said(exc),
            f", after {said(cause)}" if cause is not None else "",
        )

    # ------------------------------------------------------------------ reading

    async def fetch(self, limit: int, timeout: timedelta) -> list[Delivery]:
        """Up to ``limit`` records, at most one per partition."""
        return await self._fetch(limit, timeout, 1)

    async def fetch_batch(self, limit: int, timeout: timedelta) -> list[Delivery]:
        """Up to ``limit`` records, each partition's as one run of consecutive records (a
        delivery's ``group`` is its partition: the consumer keeps their order)."""
        return await self._fetch(limit, timeout, limit)

    async def _fetch(self, limit: int, timeout: timedelta, run: int) -> list[Delivery]:
        if self._stopped:
            return []
        consumer = self._consumer
        if consumer is None:
            await self.open(self._prefetch)
            consumer = self._consumer
            assert consumer is not None
        await self._look_at_topic(consumer)
        await self._commit(consumer, list(self._owned.values()))
        deadline = monotonic() + timeout.total_seconds()
        while True:
            await self._top_up(consumer)
            ready = self._ready(limit, run)
            if ready or self._stopped:
                return ready
            left = deadline - monotonic()
            if left <= 0:
                return []
            wait = min(left, self._next_retry() - monotonic())
            if any(p.out and p.waiting for p in self._owned.values() if p.owned):
                # Records wait behind a run still out: hand them out as soon as it is
                # settled, or take new records of another partition, whichever comes first.
                self._wake.clear()
                batches = await self._poll(consumer, 0)
                if not batches:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._wake.wait(), max(0.0, min(wait, 0.05)))
                    continue
            else:
                batches = await self._poll(consumer, max(1, int(wait * 1000)))
            for tp, records in batches.items():
                self._take(consumer, tp, records)
            self._watch_assignment(consumer)

    def _watch_assignment(self, consumer: AIOKafkaConsumer) -> None:
        """Say once when this member has gone without a partition for a while: it reads
        nothing then, and nothing else would tell."""
        now = monotonic()
        if any(p.owned for p in self._owned.values()):
            self._unassigned_since = now
            return
        if self._unassigned_since is None or now - self._unassigned_since < self._unassigned_after:
            return
        known = consumer.partitions_for_topic(self.source)
        LOGGER.warning(
            "oncely broker=kafka topic=%s group=%s this member has had no partition for %.0fs "
            "and reads nothing: the group has more members than the topic's %s partitions, or "
            "its rebalance has not settled (members stopping, a broker holding the join)",
            self.source,
            self.group,
            now - self._unassigned_since,
            len(known) if known else "unknown number of",
        )
        self._unassigned_since = None

    async def _top_up(self, consumer: AIOKafkaConsumer) -> None:
        """Take what the client has fetched of each partition with room in its buffer, one
        partition at a time, without waiting. Else a partition with a backlog starved the
        others: its buffered records were handed out at every fetch with nothing else taken
        from the client, and the client gives out its records partition by partition (up to
        ``max_records`` in all), the backlog's whole fetch first."""
        assigned = consumer.assignment()
        for part in list(self._owned.values()):
            if (
                not part.owned
                or part.starting
                or part.paused
                or part.tp not in assigned
                or len(part.waiting) >= self.max_buffered
            ):
                continue
            for tp, records in (await self._poll(consumer, 0, part.tp)).items():
                self._take(consumer, tp, records)

    async def _poll(
        self, consumer: AIOKafkaConsumer, timeout_ms: int, *partitions: TopicPartition
    ) -> dict[TopicPartition, list[Any]]:
        """The records aiokafka has fetched, waiting up to ``timeout_ms`` for some. Bounded
        here: while the group rebalances, ``getmany`` waits for the next assignment whatever
        its timeout, and a member whose group never settled (its peers stopping, a broker
        holding the join) did not return to see a stop, and never left the group. Nothing
        is lost by the cut: aiokafka hands out records without awaiting after it takes them."""
        with self._errors("fetch records"):
            try:
                return await asyncio.wait_for(
                    consumer.getmany(*partitions, timeout_ms=timeout_ms, max_records=500),
                    timeout_ms / 1000 + _POLL_SLACK,
                )
            except TimeoutError:
                return {}

    def _take(self, consumer: AIOKafkaConsumer, tp: TopicPartition, records: list[Any]) -> None:
        part = self._owned.get(tp)
        if part is None or not part.owned:
            return  # fetched before a revocation: the next owner reads them again
        if part.starting:  # fetched before its pause: read again once its start is known
            first = int(records[0].offset) if records else None
            if first is not None and (part.set_aside is None or first < part.set_aside):
                part.set_aside = first
            return
        runs = self._runs
        if runs:
            part.waiting.extend(_Held(r, *runs.pop((tp, r.offset), (1, 0.0))) for r in records)
        else:
            part.waiting.extend(_Held(r) for r in records)
        if len(part.waiting) >= self.max_buffered and not part.paused:
            consumer.pause(tp)
            part.paused = True

    def _next_retry(self) -> float:
        waits = [
            p.waiting[0].not_before
            for p in self._owned.values()
            if p.owned and not p.out and p.waiting
        ]
        return min(waits, default=float("inf"))

    def _ready(self, limit: int, run: int) -> list[Delivery]:
        """Up to ``run`` consecutive records per partition, none of a partition whose last
        run is still out (a partition's records run in order). ``limit`` is shared among the
        partitions with records ready, in turn: each takes up to an equal share, and what
        one leaves is shared among those with more, so a partition's backlog never takes
        the whole of it while another has records waiting."""
        parts = [p for p in self._owned.values() if p.owned and not p.out and p.waiting]
        if not parts:
            return []
        now = monotonic()
        taken: dict[_Partition, list[Delivery]] = {}
        self._turn = (self._turn + 1) % len(parts)
        active = parts[self._turn :] + parts[: self._turn]
        room = limit
        while active and room > 0:
            share, extra = divmod(room, len(active))
            more = []
            for i, part in enumerate(active):
                quota = min(share + (i < extra), room)
                if quota < 1:
                    more.append(part)
                    continue
                mine = taken.setdefault(part, [])
                before = len(mine)
                self._hand_out(part, mine, min(quota, run - len(part.out)), now)
                room -= len(mine) - before
                if len(mine) - before == quota and len(part.out) < run and part.waiting:
                    more.append(part)  # stopped by its share only: may take what others leave
            active = more
        out: list[Delivery] = []
        for part, mine in taken.items():
            out.extend(mine)
            if part.out:
                part.running = len(part.out)
                part.idle.clear()
                self._resume(part)
        return out

    def _hand_out(self, part: _Partition, into: list[Delivery], most: int, now: float) -> None:
        """Hand out up to ``most`` records from the front of ``part``, in order, into
        ``into``: up to a record to wait for (its retry is not due) or one finished in an
        earlier run behind records handed out now (the commit waits for them)."""
        waiting = part.waiting
        handed = 0
        while waiting and handed < most:
            held = waiting[0]
            if held.state == _DONE:  # finished in an earlier run, after one given back
                if part.out:
                    break  # the commit waits for the records handed out before it
                waiting.popleft()
                part.finished = held.record.offset + 1
                if self._save is not None:
                    part.unstored = part.finished
                continue
            if held.not_before > now:
                break
            waiting.popleft()
            held.state = _RUNNING
            part.out.append(held)
            into.append(KafkaDelivery(self, part, held))
            handed += 1

    def _resume(self, part: _Partition) -> None:
        consumer = self._consumer
        if part.starting:
            return
        if part.paused and consumer is not None and len(part.waiting) < self.max_buffered // 2:
            consumer.resume(part.tp)
            part.paused = False

    # ------------------------------------------------------------------ settling

    def _settled(
        self, part: _Partition, held: _Held, state: int, delay: float = 0.0, counted: bool = True
    ) -> None:
        """``held`` is done, or to be handed out again after ``delay`` seconds. Once its whole
        run is settled, the partition commits (at the next commit) past the run's finished
        prefix, and the records from the first one given back on go back to the front of the
        partition in order: the ones given back to be handed out again, the finished ones only
        to be committed past once everything before them is (never handed out twice, and the
        commit never passes an unfinished record)."""
        if held.state != _RUNNING or not part.out:
            return  # settled twice
        held.state, held.delay, held.counted = state, delay, counted
        part.running -= 1
        if part.running > 0:
            return
        run, part.out = part.out, []
        part.idle.set()
        self._wake.set()
        if not part.owned:
            self._remember(part, [h for h in run if h.state == _BACK], ran=True)
            if any(h.state == _DONE for h in run):
                LOGGER.info(
                    "oncely broker=kafka records of %s/%d finished after the partition moved "
                    "to another member; not committed here",
                    self.source,
                    part.tp.partition,
                )
            return
        first_back = next((i for i, h in enumerate(run) if h.state == _BACK), len(run))
        if first_back:
            part.finished = run[first_back - 1].record.offset + 1
        now = monotonic()
        for h in reversed(run[first_back:]):
            if h.state == _BACK:
                h.attempt += h.counted
                h.not_before = now + h.delay
            part.waiting.appendleft(h)

    async def _copy_to_dead_letter(self, held: _Held, why: DeadLetter) -> None:
        record = held.record
        reasons = why.headers()
        # A null header and a null value (a tombstone) stay null in the copy: b"" is another
        # value, which a consumer of the dead-letter topic would read differently.
        headers: list[tuple[str, str | bytes | None]] = [
            (name, value) for name, value in (record.headers or ()) if name not in reasons
        ]
        headers += [(name, text.encode()) for name, text in reasons.items()]
        headers += [
            ("x-oncely-topic", record.topic.encode()),
            ("x-oncely-partition", str(record.partition).encode()),
            ("x-oncely-offset", str(record.offset).encode()),
        ]
        await self._producing().send(self.dead_letter, record.value, headers, key=record.key)

    async def _commit(self, consumer: AIOKafkaConsumer, parts: list[_Partition]) -> None:
        """Commit, for each owned partition in ``parts``, the end of its finished run. A
        commit the group refuses (this member was fenced by a rebalance) counts as the loss
        of every partition: none is handed out again until the group assigns it anew."""
        await self._store_passed(parts)
        due = {
            p.tp: OffsetAndMetadata(p.finished, "")
            for p in parts
            if p.owned and p.finished is not None and p.finished != p.committed
        }
        if not due or self._topic_gone:
            return
        try:
            if not await self._committed_unless_gone(consumer, due):
                return
        except RebalanceInProgressError:
            return  # the revocation commits what is finished; or the next fetch does
        except _FENCED as exc:
            self._lose(list(self._owned.values()), f"the group refused the commit: {exc}")
            return
        except TimeoutError:
            self._look_at = 0.0  # the topic may be gone: looked at on the next fetch
            raise BrokerUnavailable(
                f"kafka {self.cluster.shown}: a commit got no answer within "
                f"{self.timeout.total_seconds():g}s"
            ) from None
        except (KafkaError, OSError) as exc:
            raise BrokerUnavailable(
                f"kafka {self.cluster.shown} topic {self.source!r}: could not commit "
                f"offsets: {said(exc)}"
            ) from None
        for p in parts:
            if p.tp in due:
                p.committed = due[p.tp].offset

    async def _store_passed(self, parts: list[_Partition]) -> None:
        """Store the offset past the records of ``parts`` finished after one given back
        (:attr:`_Partition.unstored`), before the group's commit passes them: else the stored
        offset stayed before them, and a group that lost its commits ran them again once the
        inbox had forgotten them. A failure is logged; the commit goes on (it is the group's
        offset that a group keeping its commits reads)."""
        save = self._save
        if save is None:
            return
        for part in parts:
            at = part.unstored
            if at is None or not part.owned or part.old_log:
                continue
            part.unstored = None
            try:
                await save((self._stream, part.tp.partition, at))
            except Exception as exc:
                LOGGER.warning(
                    "oncely broker=kafka topic=%s partition=%d could not store the offset %d "
                    "past records finished after one given back (%s)",
                    self.source,
                    part.tp.partition,
                    at,
                    said(exc),
                )

    async def _committed_unless_gone(
        self, consumer: AIOKafkaConsumer, due: Mapping[TopicPartition, OffsetAndMetadata]
    ) -> bool:
        """Commit ``due`` within the timeout (else :class:`TimeoutError`); ``False`` when the
        log it belongs to is found gone meanwhile (the client retries a commit to a deleted
        topic until the timeout): the commit is abandoned. A commit without an answer for a
        second has the topic looked at."""
        commit = asyncio.ensure_future(consumer.commit(due))
        started = monotonic()
        deadline = started + self.timeout.total_seconds()
        try:
            while not commit.done():
                left = deadline - monotonic()
                if left <= 0:
                    raise TimeoutError
                looking = self._look() if monotonic() - started >= 1.0 else self._looking
                waits: set[asyncio.Future[Any]] = {commit}
                if looking is not None:
                    waits.add(looking)
                await asyncio.wait(waits, timeout=min(left, 1.0), return_when="FIRST_COMPLETED")
                if not commit.done() and self._looked(consumer):
                    return False
            commit.result()
            return True
        finally:
            if not commit.done():
                commit.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await commit

    def _lose(self, parts: list[_Partition], why: str) -> None:
        for part in parts:
            if part.owned:
                LOGGER.warning(
                    "oncely broker=kafka topic=%s partition=%d lost (%s); its records not yet "
                    "finished go to its next owner",
                    self.source,
                    part.tp.partition,
                    why,
                )
            part.owned = False
            self._remember(part, part.waiting)
            part.waiting.clear()

    def _remember(self, part: _Partition, left: Iterable[_Held], *, ran: bool = False) -> None:
        """Keep the counts of ``part``'s records that ran and are not finished, as it is
        given up: the group may give the partition back to this member, which then goes on
        counting (a record failing between rebalances is still dead-lettered after
        ``max_deliveries`` runs). ``ran``: ``left`` were given back just now, their run not
        counted yet."""
        if part.old_log:
            return
        runs = self._runs
        now = monotonic()
        for held in left:
            if held.state == _DONE:
                continue
            attempt, not_before = held.attempt, held.not_before
            if ran:
                attempt, not_before = attempt + held.counted, now + held.delay
            if attempt > 1:
                runs[(part.tp, held.record.offset)] = (attempt, not_before)
        while len(runs) > _REMEMBERED:
            del runs[next(iter(runs))]

    # ------------------------------------------------------------------ rebalances

    async def _revoked(self, revoked: set[TopicPartition]) -> None:
        parts = [p for tp, p in self._owned.items() if tp in revoked]
        for part in parts:  # hand out nothing more of them, start nothing more of a batch
            self._remember(part, part.waiting)
            part.waiting.clear()
            part.revoking = True
        busy = [p.idle.wait() for p in parts if not p.idle.is_set()]
        if busy:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.gather(*busy), self.revoke_grace.total_seconds())
        consumer = self._consumer
        if consumer is not None:
            try:
                await self._commit(consumer, parts)
            except BrokerError as exc:
                LOGGER.warning("oncely broker=kafka could not commit on revocation: %s", exc)
        for part in parts:
            if part.out:
                LOGGER.warning(
                    "oncely broker=kafka topic=%s partition=%d revoked while a handler still "
                    "runs (past revoke_grace %.1fs); its offset is not committed here, and "
                    "the next owner's copy meets the inbox's claim",
                    self.source,
                    part.tp.partition,
                    self.revoke_grace.total_seconds(),
                )
            part.owned = False
            del self._owned[part.tp]

    async def _assigned(self, consumer: AIOKafkaConsumer, assigned: set[TopicPartition]) -> None:
        fresh = []
        for tp in assigned:
            old = self._owned.get(tp)
            if old is None or not old.owned:
                self._owned[tp] = _Partition(tp)
                fresh.append(tp)
        LOGGER.info(
            "oncely broker=kafka topic=%s group=%s assigned partitions %s",
            self.source,
            self.group,
            sorted(tp.partition for tp in assigned),
        )
        if self._start_from is not None and fresh:
            # Nothing of them is taken before their start is known: a record read from the
            # group's commit meanwhile would run although the stored offset is past it.
            for tp in fresh:
                self._owned[tp].starting = True
            consumer.pause(*fresh)
            seeked: set[TopicPartition] = set()
            try:
                seeked = await self._seek_to_stored(consumer, fresh)
            finally:
                for tp in fresh:
                    self._started(consumer, tp, moved=tp in seeked)

    async def _stored_offsets(
        self, read: Callable[[str], Awaitable[Mapping[int, int]]], fresh: list[TopicPartition]
    ) -> tuple[dict[int, int], dict[int, int]]:
        """The offsets stored under :attr:`offsets_stream`, and of those, the ones of
        ``fresh`` partitions that an earlier oncely kept under the topic's name alone (none
        under the id yet): to be taken over once they pass the check against the end."""
        stored = dict(await read(self._stream))
        if self._stream == self.source or self._save is None:
            return stored, {}
        mine = {tp.partition for tp in fresh} - set(stored)
        legacy = (
            {
                p: at
                for p, at in (await read(self.source)).items()
                if p in mine and at != RETIRED_OFFSET
            }
            if mine
            else {}
        )
        return {**stored, **legacy}, legacy

    async def _take_over(self, legacy: Mapping[int, int], refused: set[int]) -> None:
        """Keep ``legacy`` offsets (those not ``refused``) under :attr:`offsets_stream` and
        retire their rows under the topic's name: a row kept under the name alone cannot be
        told from a deleted topic's once the topic is created again."""
        if not legacy or self._save is None:
            return
        try:
            for part, at in legacy.items():
                if part not in refused:
                    await self._save((self._stream, part, at))
            for part in legacy:
                await self._save((self.source, part, RETIRED_OFFSET))
        except Exception as exc:
            LOGGER.warning(
                "oncely broker=kafka topic=%s could not move the offsets kept under the "
                "topic's name to %s (%s); it is tried again at the next assignment",
                self.source,
                self._stream,
                said(exc),
            )
            return
        LOGGER.info(
            "oncely broker=kafka topic=%s partitions %s: the offsets an earlier oncely kept "
            "under the topic's name are now kept under %s",
            self.source,
            sorted(legacy),
            self._stream,
        )

    def _started(self, consumer: AIOKafkaConsumer, tp: TopicPartition, *, moved: bool) -> None:
        """``tp``'s start is known: what was read of it meanwhile is read again (unless it
        was moved to its stored offset), and it is read on."""
        part = self._owned.get(tp)
        if part is None or not part.starting:
            return
        part.starting = False
        aside, part.set_aside = part.set_aside, None
        if not part.owned:
            return
        if aside is not None and not moved:
            consumer.seek(tp, aside)
        if not part.paused:
            consumer.resume(tp)

    async def _seek_to_stored(
        self, consumer: AIOKafkaConsumer, fresh: list[TopicPartition]
    ) -> set[TopicPartition]:
        """Start each of ``fresh`` from its stored offset where that is ahead of the group's
        commit. Without the stored offsets (the database is down) the committed offsets hold:
        a record finished since is read again and met by the inbox's marker. A stored offset
        past the partition's end cannot be of this log (the topic was deleted and created
        again): it is not used, with a warning, rather than skip the new log's records.
        Returns the partitions moved to their stored offset."""
        assert self._start_from is not None
        try:
            await self._read_topic_id()  # the topic may have been created again meanwhile
            stored, legacy = await self._stored_offsets(self._start_from, fresh)
            committed = {tp: await consumer.committed(tp) for tp in fresh if tp.partition in stored}
            ahead = [tp for tp, at in committed.items() if at is None or at < stored[tp.partition]]
            ends: Mapping[TopicPartition, int] = await consumer.end_offsets(ahead) if ahead else {}
        except Exception as exc:
            LOGGER.warning(
                "oncely broker=kafka topic=%s could not read the stored offsets or the "
                "partitions' ends (%s: %s); the partitions start from the group's committed "
                "offsets, and what was finished since is answered by the inbox as duplicates",
                self.source,
                type(exc).__name__,
                exc,
            )
            return set()
        moved = set()
        refused = set()
        for tp in ahead:
            kept, at, end = stored[tp.partition], committed[tp], ends.get(tp)
            if end is not None and kept > end:
                refused.add(tp.partition)
                LOGGER.warning(
                    "oncely broker=kafka topic=%s partition=%d: the stored offset %d is past "
                    "the partition's end %d, so it belongs to another log (the topic was "
                    "deleted and created again, or the stored offsets are of another "
                    "cluster); it is not used: the partition starts from the group's commit "
                    "(%s), else from the topic's start, and the inbox answers what it has "
                    "seen as duplicates",
                    self.source,
                    tp.partition,
                    kept,
                    end,
                    at,
                )
                continue
            consumer.seek(tp, kept)
            moved.add(tp)
            self._owned[tp].finished = kept  # the next commit brings the group's up to it
            LOGGER.info(
                "oncely broker=kafka topic=%s partition=%d starts from the stored offset %d "
                "(the group's commit was %s)",
                self.source,
                tp.partition,
                kept,
                at,
            )
        await self._take_over(legacy, refused)
        return moved


class _Listener(ConsumerRebalanceListener):  # type: ignore[misc]
    def __init__(self, transport: Kafka, consumer: AIOKafkaConsumer) -> None:
        self._transport = transport
        self._consumer = consumer

    async def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None:
        await self._transport._revoked(set(revoked))

    async def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None:
        await self._transport._assigned(self._consumer, set(assigned))


class KafkaDelivery:
    """One record handed out; its partition hands out nothing else until it is settled."""

    __slots__ = ("_envelope", "_held", "_part", "_refusal", "_stream", "_transport")

    def __init__(self, transport: Kafka, part: _Partition, held: _Held) -> None:
        self._transport = transport
        self._part = part
        self._held = held
        self._stream = transport._stream
        """The stream of the log the record was read from: a position stored after the
        topic was created again under its name (a dead letter copied late) must not go
        under the new log's stream, whose records it would skip."""
        self._envelope, self._refusal = envelope_of(
            held.record, transport.group, held.attempt, tombstones=transport.tombstones == "handle"
        )

    @property
    def envelope(self) -> Envelope:
        return self._envelope

    @property
    def delivery_count(self) -> int:
        """How many times this member has handed the record out since its partition was
        assigned (Kafka itself counts no deliveries; for ``max_deliveries`` the consumer
        takes the inbox's attempt count when that is higher: ``local_delivery_counts``)."""
        return self._held.attempt

    @property
    def refusal(self) -> str | None:
        return self._refusal

    @property
    def partition(self) -> int:
        return int(self._held.record.partition)

    @property
    def offset(self) -> int:
        return int(self._held.record.offset)

    @property
    def position(self) -> tuple[str, int, int]:
        """Where the record sits: its stream (:attr:`Kafka.offsets_stream` when it was handed
        out: the name and id of the topic it was read from), its partition, and the offset
        after it (the next to read once it is finished)."""
        record = self._held.record
        return (self._stream, int(record.partition), int(record.offset) + 1)

    def describe(self) -> Mapping[str, object]:
        t = self._envelope.transport
        return {k: t[k] for k in ("topic", "partition", "offset", "delivery_count")}

    @property
    def group(self) -> int:
        """The record's ordering group: its partition."""
        return int(self._held.record.partition)

    @property
    def revoked(self) -> bool:
        """The record's partition was taken from this member: a batch starts nothing more of
        it (what is not started is given back, and read again by the next owner)."""
        return self._part.revoking or not self._part.owned

    async def ack(self) -> None:
        """Finished: the partition's commit moves past this record (once every earlier record
        of it is finished too) at the next fetch."""
        self._transport._settled(self._part, self._held, _DONE)

    async def retry(self, delay: timedelta) -> None:
        """Hand the record out again after ``delay``; later records of its partition wait."""
        self._transport._settled(self._part, self._held, _BACK, delay.total_seconds())

    async def requeue(self, delay: timedelta) -> None:
        """:meth:`retry` for a record whose handler did not run (held back behind a failure
        in its batch, or meeting a copy that runs): not counted as a delivery, so it is not
        dead-lettered for an earlier record's failures."""
        self._transport._settled(
            self._part, self._held, _BACK, delay.total_seconds(), counted=False
        )

    async def dead_letter(self, why: DeadLetter) -> None:
        """Copy the record to the dead-letter topic with ``why`` in ``x-oncely-*`` headers
        (and where it came from), confirmed, then finish it."""
        try:
            await self._transport._copy_to_dead_letter(self._held, why)
        except BaseException:
            # Not copied: the record must not be skipped, so it is handed out again (its
            # outcome is decided anew, and dead-lettered then if it still must be).
            self._transport._settled(self._part, self._held, _BACK, 1.0)
            raise
        await self.ack()

    async def extend(self) -> None:
        """Nothing to do: Kafka has no per-record ack wait."""

"""The Kafka producer: librdkafka (confluent-kafka) with idempotence on, awaited per record.

librdkafka's idempotent producer is used rather than aiokafka's: on the broker oncely is tested
on (Tansu), aiokafka's fails at producer-id set-up while librdkafka's works, and librdkafka's
retries within one producer session never write a record twice (R14, R23). A retry after an
error, or from a restarted producer, is a second record; the ``message-id`` header makes it a
duplicate to consumers (R2).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import confluent_kafka
from confluent_kafka import TopicCollection
from confluent_kafka.admin import AdminClient

from oncely._core.said import said
from oncely.brokers._common import flag, require_message_id
from oncely.brokers.kafka._records import (
    CONSUMER_URL_OPTIONS,
    LIBRDKAFKA_LOGGER,
    PRODUCER_URL_OPTIONS,
    SHARED_URL_OPTIONS,
    Cluster,
    check_topic,
    ms,
    record_headers,
)
from oncely.errors import BrokerError, BrokerUnavailable, ConfigurationError

_PRODUCER_URL_OPTIONS = (*PRODUCER_URL_OPTIONS, "timeout", "connect_timeout", *SHARED_URL_OPTIONS)


_NO_TOPIC_ID = "AAAAAAAAAAAAAAAAAAAAAA"
"""The id a cluster without topic ids (before Kafka 2.8) gives every topic."""
TOPIC_MISSING = ""
"""What :func:`topic_id` answers, with ``missing_ok``, for a topic the cluster does not have."""


def topic_id(
    cluster: Cluster, topic: str, timeout: timedelta, *, missing_ok: bool = False
) -> str | None:
    """The id the cluster gave ``topic`` when it was created (a new one each time a topic of
    that name is created), or ``None`` when the cluster gives topics none; with
    ``missing_ok``, :data:`TOPIC_MISSING` when there is no such topic. Blocking: run it in a
    thread. Raises :class:`~oncely.BrokerUnavailable` when the cluster does not answer."""
    return TopicIds(cluster).read(topic, timeout, missing_ok=missing_ok)


class TopicIds:
    """Reads topics' ids (see :func:`topic_id`) through one admin client, made on first use
    and kept: a consumer looking at its topic every few seconds holds one client, with its
    threads and its connection, rather than making and dropping one at each look. Thread-safe
    (librdkafka's admin client is)."""

    def __init__(self, cluster: Cluster) -> None:
        self._cluster = cluster
        self._admin: AdminClient | None = None
        self._lock = threading.Lock()
        self.made = 0
        """How many admin clients were made (one, unless the first could not be)."""

    def _client(self) -> AdminClient:
        with self._lock:
            if self._admin is None:
                settings: dict[str, Any] = {**self._cluster.librdkafka()}
                settings["logger"] = LIBRDKAFKA_LOGGER
                self._admin = AdminClient(settings)
                self.made += 1
            return self._admin

    def read(self, topic: str, timeout: timedelta, *, missing_ok: bool = False) -> str | None:
        cluster = self._cluster
        seconds = timeout.total_seconds()
        try:
            asked = self._client().describe_topics(
                TopicCollection([topic]), request_timeout=seconds
            )
            found = asked[topic].result(timeout=seconds + 1)
        except (confluent_kafka.KafkaException, concurrent.futures.TimeoutError) as exc:
            error = exc.args[0] if isinstance(exc, confluent_kafka.KafkaException) else None
            unknown = confluent_kafka.KafkaError.UNKNOWN_TOPIC_OR_PART
            if (
                missing_ok
                and isinstance(error, confluent_kafka.KafkaError)
                and error.code() == unknown
            ):
                return TOPIC_MISSING
            raise BrokerUnavailable(
                f"kafka {cluster.shown}: could not read the id of the topic {topic!r}: {said(exc)}"
            ) from None
        given = str(found.topic_id) if getattr(found, "topic_id", None) is not None else ""
        return given if given and given != _NO_TOPIC_ID else None


class KafkaProducer:
    """Writes records to ``topic``, each with the producer's ``message-id`` header, and returns
    once the broker has them (``acks=all``). The record key is the message id unless the
    publish names another (``key=``, a business key keeping one entity's records in one
    partition), so a resend lands in the partition of its first copy and is answered there
    as a duplicate rather than run beside it.

    ``idempotence`` (on by default) is librdkafka's ``enable.idempotence``; ``timeout`` bounds
    each publish (``message.timeout.ms``); ``connect_timeout`` the first publish's check that
    the cluster answers and knows the topic (a broker that creates topics on first use, as
    Tansu and Kafka's ``auto.create.topics.enable`` do, creates it then; one that does not
    makes it an error naming the topic);
    ``config`` adds librdkafka settings of your own.
    """

    def __init__(
        self,
        url: str,
        topic: str,
        *,
        idempotence: bool = True,
        timeout: timedelta = timedelta(seconds=30),
        connect_timeout: timedelta = timedelta(seconds=10),
        linger: timedelta = timedelta(milliseconds=1),
        config: Mapping[str, Any] | None = None,
    ) -> None:
        cluster, options = Cluster.from_url(url)
        options.done(
            _PRODUCER_URL_OPTIONS,
            read_by="open_producer() and KafkaProducer.from_url()",
            theirs=CONSUMER_URL_OPTIONS,
        )
        self._setup(cluster, topic, idempotence, timeout, connect_timeout, linger, config)

    def _setup(
        self,
        cluster: Cluster,
        topic: str,
        idempotence: bool,
        timeout: timedelta,
        connect_timeout: timedelta,
        linger: timedelta,
        config: Mapping[str, Any] | None,
    ) -> None:
        self.topic = check_topic("topic", topic)
        self.cluster = cluster
        flag(idempotence, "idempotence")
        if timeout <= timedelta(0) or connect_timeout <= timedelta(0):
            raise ConfigurationError("the producer's timeout and connect_timeout must be positive")
        self._connect_timeout = connect_timeout
        self._checked: set[str] = set()
        settings = cluster.librdkafka()
        settings.update(
            {
                "enable.idempotence": idempotence,
                "acks": "all",
                "message.timeout.ms": ms(timeout),
                "linger.ms": ms(linger),
                # librdkafka's own lines, on Python's logging (not stderr), repeats held back
                "logger": LIBRDKAFKA_LOGGER,
            }
        )
        settings.update(config or {})
        self._timeout = timeout
        try:
            self._producer = confluent_kafka.Producer(settings)
        except confluent_kafka.KafkaException as exc:
            raise ConfigurationError(f"kafka {cluster.shown}: {exc}") from None
        self._closed = False
        self._poller: threading.Thread | None = None
        self._lock = threading.Lock()

    @classmethod
    def from_url(cls, url: str, destination: str) -> KafkaProducer:
        """The producer for ``kafka://host:port[,host:port]?options`` writing to the topic
        ``destination``. Options: ``idempotence`` (true), ``timeout``, ``connect_timeout`` and
        ``linger`` (seconds), ``security_protocol``, ``sasl_mechanism``, ``client_id``."""
        cluster, options = Cluster.from_url(url)
        idempotence = options.boolean("idempotence", True)
        timeout = options.seconds("timeout", timedelta(seconds=30))
        connect = options.seconds("connect_timeout", timedelta(seconds=10))
        linger = options.seconds("linger", timedelta(milliseconds=1))
        options.done(_PRODUCER_URL_OPTIONS, theirs=CONSUMER_URL_OPTIONS)
        made = cls.__new__(cls)
        made._setup(cluster, destination, idempotence, timeout, connect, linger, None)
        return made

    async def publish(
        self,
        body: bytes | None,
        *,
        message_id: str,
        headers: Mapping[str, str] | None = None,
        content_type: str = "application/json",
        correlation_id: str | None = None,
        key: str | bytes | None = None,
    ) -> None:
        """Write one record and return once the broker has it. Raises
        :class:`~oncely.BrokerUnavailable` when it could not be written in time; retrying with
        the same ``message_id`` is then safe (a second copy is a duplicate downstream).

        ``body=None`` writes a tombstone (a null value: on a compacted topic, the deletion of
        the record key), with its message id like any record and no content type; it needs
        the ``key`` it deletes (the message id is no key to delete)."""
        require_message_id(message_id)
        if body is None and key is None:
            raise ConfigurationError(
                "a tombstone (body=None) deletes its record key: give the key it deletes (key=...)"
            )
        await self.send(
            self.topic,
            body,
            record_headers(
                message_id, headers, content_type if body is not None else None, correlation_id
            ),
            key=key if key is not None else message_id,
        )

    async def send(
        self,
        topic: str,
        value: bytes | None,
        headers: list[tuple[str, str | bytes | None]],
        *,
        key: str | bytes | None,
    ) -> None:
        """Write one record as it is (the dead-letter copy's path) and wait for the broker."""
        if self._closed:
            raise BrokerError(f"kafka {self.cluster.shown}: the producer is closed")
        if topic not in self._checked:
            await self._check(topic)
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()

        def delivered(error: Any, _record: Any) -> None:
            loop.call_soon_threadsafe(_settle, done, error)

        while True:
            try:
                self._producer.produce(
                    topic, value=value, key=key, headers=headers, on_delivery=delivered
                )
                break
            except BufferError:  # librdkafka's local queue is full: let it drain
                await asyncio.sleep(0.01)
            except confluent_kafka.KafkaException as exc:
                raise BrokerUnavailable(f"kafka {self.cluster.shown}: {exc}") from None
        self._poll()
        try:
            await asyncio.wait_for(done, self._timeout.total_seconds() + 5)
        except TimeoutError:
            raise BrokerUnavailable(
                f"kafka {self.cluster.shown}: topic {topic!r} did not confirm a record in "
                f"{self._timeout.total_seconds():g}s"
            ) from None

    async def _check(self, topic: str) -> None:
        """The cluster answers and knows ``topic``: asked once per topic, so an unreachable
        cluster fails within ``connect_timeout``, and a topic the broker will not have is
        named."""
        wait = self._connect_timeout.total_seconds()
        try:
            found = await asyncio.to_thread(self._producer.list_topics, topic, wait)
        except confluent_kafka.KafkaException as exc:
            raise BrokerUnavailable(
                f"kafka {self.cluster.shown}: no answer within {wait:g}s ({exc})"
            ) from None
        meta = found.topics.get(topic)
        if meta is None or meta.error is not None:
            raise BrokerError(
                f"kafka {self.cluster.shown}: the topic {topic!r} does not exist "
                f"({meta.error if meta is not None else 'not in the metadata'}); create it "
                "first (a consumer's transport creates its topic when it opens)"
            )
        self._checked.add(topic)

    def _poll(self) -> None:
        """Run librdkafka's delivery reports on a thread of their own while the producer is
        open (they resolve each publish's future on its event loop)."""
        with self._lock:
            if self._poller is None:
                self._poller = threading.Thread(
                    target=self._serve, name="oncely-kafka-producer", daemon=True
                )
                self._poller.start()

    def _serve(self) -> None:
        while not self._closed:
            self._producer.poll(0.1)

    async def close(self) -> None:
        if self._closed:
            return
        await asyncio.to_thread(self._producer.flush, self._timeout.total_seconds())
        self._closed = True
        poller = self._poller
        if poller is not None:
            await asyncio.to_thread(poller.join, 5)


def _settle(done: asyncio.Future[None], error: Any) -> None:
    if done.done():
        return
    if error is None:
        done.set_result(None)
    else:
        done.set_exception(BrokerUnavailable(f"kafka: the record was not written ({error})"))

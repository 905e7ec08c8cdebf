"""Kafka: a topic read by a consumer group, with the key in the record's ``message-id`` header.

::

    import oncely
    from oncely.brokers import BrokerConsumer, open_producer, open_transport

    producer = open_producer("kafka://localhost:9092", "payments")
    await producer.publish(b'{"order": 7}', message_id=order_id)  # reuse order_id on retries

    inbox = oncely.AsyncInbox(oncely.open_async("postgresql://..."), consumer="billing")
    transport = open_transport("kafka://localhost:9092", "payments", group="billing")
    await BrokerConsumer(transport, inbox, charge).run(handle_signals=True)

Needs ``pip install 'oncely[kafka]'``: the consumer is aiokafka (asyncio throughout, and its
rebalance listener is awaited, so a member can finish its records before it gives up their
partitions); the producer is librdkafka (confluent-kafka), whose idempotent producer works on
the broker oncely is tested on where aiokafka's does not. Tested on Tansu 0.6 (a
Kafka-protocol broker), not on Apache Kafka itself.

Record layout
-------------
:class:`KafkaProducer` writes each message as one record with the headers

==================  ===========================================================================
``message-id``      the producer-assigned message id (R2): the dedup key by default
``content-type``    e.g. ``application/json`` (read by the default decoder); optional
``correlation-id``  optional
anything else       an application header (CloudEvents' Kafka binding ``ce_id``/``ce_source``,
                    R3; a business key for :class:`~oncely.HeaderKey`)
==================  ===========================================================================

The record key is the message id unless the publish gives another (``key=``). The partition
and offset are the broker's: a producer retry is a new record at a new offset, so they are
never a key (R4) and go to ``Envelope.transport`` only, with the record key (``record_key``),
which is a business key only when you say so (a key source of your own reading it from the
body or a header). A record whose ``message-id`` header is given twice with two values, or
whose id is not UTF-8, is refused; so is one keyed on another header (``HeaderKey``, the
CloudEvents id and source) that it gives twice with two values.

Tombstones
----------
A record whose value is null is a tombstone: on a compacted topic, "delete what is kept for
this record key". By default (``tombstones="dead_letter"``) it is dead-lettered, never handed
to a handler that expects a body: the copy keeps the null value and the record key, and
``x-oncely-reason`` says it is a tombstone and how to take them. ``Kafka(...,
tombstones="handle")`` (the URL option ``tombstones=handle``) hands each tombstone to the
handler, in its partition's order, as a :class:`Tombstone` holding the record key; a record
with an empty value is no tombstone (its body is ``b""``), so ``isinstance(payload,
Tombstone)`` tells the two apart. A tombstone is keyed like any record (its ``message-id``
header by default, R2): ``KafkaProducer.publish(None, message_id=..., key=...)`` writes one,
and one without a key (most foreign producers write tombstones without headers) is
dead-lettered as ``rejected``. Never key tombstones on the record key alone: a key deleted,
written again and deleted again would be a duplicate the second time, and its row kept. A
tombstone without a record key either (librdkafka writes one) is taken the same way: its copy
has a null value and a null key, and ``tombstones="handle"`` hands it out as
``Tombstone(None)`` only where it has a message id.

How it reads and commits
------------------------
Offsets are committed by the transport only, never automatically, and only for partitions
this member owns. By default the consumer reads in batches (``ConsumerSettings.batch``, 500
here): a poll's records go through the inbox together, one ``claim_many`` and one
``complete_many`` for all of them; the records of one partition run one after the other in
offset order, partitions side by side up to the consumer's ``concurrency``, and once a record
fails, or is given back because its key is held elsewhere (a copy still running, a dead
worker's lease), the later ones of its partition wait for it (``in_flight``). A record whose
key is held under a lease is kept while the consumer watches the key's record, up to what is
left of that lease: it is finished (a ``duplicate``) or run as soon as the holder ends, and
its partition goes on at once, not after the whole lease; a revocation gives it back at
once. A batch is shared
among the partitions with records ready (each its share, what one leaves going to the others):
a backlog on one partition never holds back the records of another. With ``batch=1`` each
partition hands out one record at a time. A partition hands out nothing new until its last
run is settled; then its commit moves past the run's finished records up to the first one
given back (which is handed out again with everything after it), and the commit is sent once
per fetch, so the committed offset is always the end of the run of finished records: a record
after an unfinished one is never committed. A commit the group refuses (this member was fenced by a
rebalance) counts as the loss of the member's partitions: nothing more of them is handed out
until the group assigns them again.

===================  ==========================================================================
outcome              on Kafka
===================  ==========================================================================
processed,           finished: committed past at the next fetch
duplicate,
stale_reclaimed
in_flight, failed    retry: the record is handed out again after the delay, and its partition
                     waits for it (order is kept). Kafka counts no deliveries, so the
                     consumer counts them itself for ``max_deliveries``: a record that keeps
                     failing is dead-lettered after that many and its partition moves on. The
                     count is the process's own: it goes on through a rebalance that gives
                     the partition back to the same member, but a record that fails in one
                     process and then in another (a restart, a partition moved to another
                     member) starts counting again there.
key_conflict,        dead-letter: the record is copied to ``<topic>.dead`` (or ``dead_letter``)
rejected,            with its headers plus ``x-oncely-outcome``, ``x-oncely-reason``,
escalated            ``x-oncely-consumer``, ``x-oncely-deliveries``, ``x-oncely-topic``,
                     ``x-oncely-partition`` and ``x-oncely-offset``, the broker confirms the
                     copy, then the record is finished. A copy that fails leaves the record
                     to be handed out again.
===================  ==========================================================================

Stopping while the broker is away: the commit and the group leave are tried within
``timeout``; a failure of either (aiokafka's ``stop()`` can end in a ``CancelledError`` of its
own then) is logged at WARNING and the consumer stops all the same; what was not committed is
read again by the group's next member.

Rebalances: when partitions are revoked, the member hands out nothing more of them, waits up
to ``revoke_grace`` (10 s) for the handlers running on them, commits what is finished and lets
them go. A handler still running after that finishes, and its record is done in the inbox, but
its offset is not committed by this member: the next owner's copy meets the inbox's claim
(``in_flight`` while it runs, ``duplicate`` after). Assigned partitions start at the group's
committed offset (the topic's start when there is none).

Offsets in the transaction
--------------------------
``BrokerConsumer(transport, inbox, handler, mode="transactional", store_offsets=True)`` (on a
SQL store; ``oncely consume --mode transactional --store-offsets``) writes each record's next
offset in the handler's transaction, beside the marker and the business writes, in the table
``<inbox table>_offsets`` (created on first use, outside any transaction), and starts each
assigned partition from that offset where it is ahead of the group's commit (the commit then
catches up with it). A consumer from Kafka to its database is then effectively once even when
its commits to Kafka were lost (a group reset or renamed, offsets expired), whatever the
inbox's retention. A duplicate stores its offset in a transaction of its own; within a batch no
stored offset passes a record whose broker action is still to come (a dead letter to copy, a
retry, a copy in flight elsewhere), so such a record is read again, never skipped. A dead
letter (key_conflict, rejected, failed on every delivery) stores its offset, in a transaction
of its own, once the broker has confirmed its copy, never before: the partition's offset then
moves past it and past the records finished after it in its batch (where its first copy failed,
it is handed out alone again, and the records finished after it store their offset as the
partition passes them, before the group's commit does), so a group that lost its commits
dead-letters nothing twice and runs nothing twice. When the stored offsets cannot be read at
assignment (the database is down) the committed ones are used, with a warning, and what was
finished since meets the inbox's markers. The offsets are kept under the topic's name and the
id the cluster gave the topic at its creation (``Kafka.offsets_stream``, ``TOPIC@ID``, read
with confluent-kafka's admin client at each assignment), so a topic deleted and created again
under its name (as Tansu's topics are on a restart) starts afresh: it never takes the old log's
offsets, however far the new log has grown. Offsets an earlier oncely kept under the name alone
are taken over once and their rows retired. A stored offset past the partition's end (its high
watermark) is never used either, with a warning naming the partition, the offset and the end:
the partition starts from the group's commit (the topic's start when there is none). A cluster
without topic ids (before Kafka 2.8) keeps the offsets under the topic's name.

The source topic and the dead-letter topic are created when missing (``partitions``, 1 by
default), at start only. A running member reads its topic's id every ``topic_check_every`` (10
s, with confluent-kafka's admin client in a thread; not on a cluster without topic ids): a
topic deleted under it is said at ERROR, its partitions are paused and the old log's finished
offsets are committed nowhere (a commit to a deleted topic, which the client retries until the
timeout, is abandoned once the look finds it gone); it is not created again. Once a topic of
its name exists again (a new id), each owned partition is read from the new log's start, with
a WARNING: before, the member kept the old log's positions and skipped the new log's records
below them without a word. Where the topic was created again between two looks, records of the
new log read from the old positions meanwhile are read again, and answered as duplicates. A
topic's retention is its own (``retention.ms``): a consumer group reset to an
offset older than the inbox's retention would run those records again, so keep the inbox's
retention above the topic's where a reset is possible (R13).

Azure Event Hubs' Kafka endpoint (untested: no Event Hubs runs where oncely is tested): the URL
``kafka://$ConnectionString:<connection string>@<namespace>.servicebus.windows.net:9093``,
with the connection string URL-quoted (SASL PLAIN over TLS, which a user and password in the
URL select). Event Hubs has no topic creation through Kafka: create the event hub and its
``.dead`` hub first.
"""

from __future__ import annotations

from oncely.brokers._common import missing_driver

try:  # the import guard: a missing client names the extra that installs it
    import aiokafka  # noqa: F401
    import confluent_kafka  # noqa: F401
except ModuleNotFoundError as exc:
    raise missing_driver(exc, "kafka", "kafka") from exc

from oncely.brokers.kafka._producer import KafkaProducer
from oncely.brokers.kafka._records import LOGGER as LOGGER
from oncely.brokers.kafka._records import MESSAGE_ID_HEADER as MESSAGE_ID_HEADER
from oncely.brokers.kafka._records import Tombstone
from oncely.brokers.kafka._transport import Kafka, KafkaDelivery

__all__ = ["Kafka", "KafkaDelivery", "KafkaProducer", "Tombstone"]

"""FastStream subscribers that apply each logical message once: a broker middleware on an
:class:`~oncely.AsyncInbox`, for FastStream's RabbitMQ, NATS (JetStream), Redis (streams) and
Kafka (aiokafka) brokers.

::

    from faststream.rabbit import RabbitBroker
    from oncely.integrations.faststream import Idempotency

    inbox = oncely.AsyncInbox(store, consumer="billing")
    idempotency = Idempotency(inbox)
    broker = RabbitBroker(url, middlewares=[idempotency])
    app = FastStream(broker, on_startup=[idempotency.prepare])  # the store checked at start

    @broker.subscriber("orders")
    async def charge(order: Order) -> None: ...

    await broker.publish(order, "orders", message_id=new_message_id())  # once per message

The key is the producer's id, read from the raw broker message (or ``key=``: any
:mod:`oncely` key source), never an id FastStream or the client made up. The claim is taken
*before* FastStream decodes the body; what each delivery gets:

=====================================  ================================================
the first delivery of a key            the handler runs; its result is stored and
                                       published (reply, ``@publisher``) as usual
a duplicate (the key completed)        acknowledged, the handler not run; the stored
                                       result is published again (rebuilt as the
                                       handler's return annotation), so a reply lost to
                                       a crash after the claim completed is not lost; a
                                       first result that was not kept is published as
                                       nothing (a warning says why)
a copy while the first still runs      given back ``requeue_delay`` later
the handler raised                     retried after ``backoff``; once it has failed
                                       ``max_deliveries`` times (a give-back is no
                                       failure), dead-lettered with the last error and
                                       the number of failures
the worker died running it             delivered again once the broker notices (a crash,
                                       ``os._exit``, the OOM killer) and, the dead run's
                                       lease lapsed, run again; after ``max_deliveries``
                                       runs of which the last never finished,
                                       dead-lettered unrun (``rejected``), the reason
                                       saying the earlier runs never finished, so a
                                       message that kills its worker every time does
                                       not run for ever
the key with another body              dead-lettered (``key_conflict``)
no key, or an id the client invented   dead-lettered (``rejected``) with the reason
a body FastStream cannot decode        dead-lettered (``rejected``), never left
                                       unacknowledged
the handler raised :class:`oncely.Reject`  dead-lettered with its reason
or FastStream's ``RejectMessage``
the handler raised ``AckMessage``      the key completes (nothing is published)
the handler raised ``NackMessage``     a failure: retried as above
the result cannot be published         given back (FastStream's default would reject
(a reply or ``@publisher``)            it, the result never sent); its redelivery, a
                                       duplicate, publishes the stored result
the store cannot answer                given back, never run unprotected
the store is down at start             the app does not start, with
                                       ``on_startup=[idempotency.prepare]``: one line,
                                       exit status 3 under ``faststream run`` (see
                                       :meth:`Idempotency.prepare`)
the dead-letter copy cannot be sent    given back, never acknowledged without its copy
=====================================  ================================================

Dead letters go to the subscriber's queue, subject or stream plus ``.dead``, with the same
``x-oncely-outcome``, ``x-oncely-reason``, ``x-oncely-consumer`` and ``x-oncely-deliveries``
headers as :mod:`oncely.brokers`; every byte of the body and every header kept. The result
is stored in its JSON form (``bytes`` as base64, a ``datetime`` as ISO text): a duplicate
rebuilds it as the handler's return annotation (``-> bytes``, ``-> datetime``, a model...)
before FastStream publishes it, so it is published as the first one was; annotate a handler
whose result is not JSON already, or its duplicates publish the stored form. Results the
handler publishes get a message id derived from the consumer, the key and the destination,
unless the handler set one: a republished result (a duplicate's) has the same id as the
first, so a downstream oncely consumer drops it.

A subscriber the middleware cannot protect is refused: the app does not start (one line,
exit status 2, under ``faststream run``; :class:`~oncely.ConfigurationError` elsewhere), when
``idempotency.prepare`` is its start-up hook;
without the hook its messages raise that error and the handler never runs, but FastStream
has taken each one off the broker by then, so it is lost. That is any subscriber whose
``ack_policy`` is ``ACK_FIRST`` or ``MANUAL`` (FastStream would acknowledge whatever
happens, or never), and per broker the kinds listed below. With a mapping ``{queue, subject
or stream name: inbox}``, only the listed subscribers take part; a subscriber of a ``*.dead``
destination is left alone.

RabbitMQ (``RabbitBroker``)
    The key is the AMQP ``message_id`` property. aio-pika's client (aiormq) gives every
    message it publishes without one a random ``uuid4().hex``: a 32-character lowercase
    uuid4 hex id is refused as made up unless ``trust_hex_message_ids=True`` says the
    producers mint that shape; :func:`oncely.brokers.new_message_id` ids (dashed uuid4)
    always pass. As in :mod:`oncely.brokers.rabbitmq`, only a key that falls through to such
    an id is refused (a ``key=`` source reading a header or the body first still finds its
    key), with the same reason, and the dead letter of a message whose id was made up, or
    that had none, carries ``x-oncely-no-message-id`` (the client gives the copy an id too).
    The delivery count is a quorum queue's ``x-delivery-count``, or the
    ``x-oncely-delivered`` header of a retry's copy; a message given back keeps the count it
    had (see below), so it counts failed runs. RabbitMQ has no delayed requeue: a
    message given back is held unacknowledged for the delay, then requeued; a retry is a
    copy at the queue's tail with its count, then the original is acknowledged. On a quorum
    queue a message given back is such a copy too, carrying the count it had: a requeue
    would count against the queue's ``x-delivery-limit`` (RabbitMQ 4 sets one by default),
    past which RabbitMQ drops the message, so waiting out a dead worker's lease would spend
    it. Dead letters
    go to ``<queue>.dead`` (declared durable). A copy (a retry's, a dead letter) keeps the
    original's timestamp, its correlation id or none, and its header names whole, up to
    AMQP's 255 bytes (FastStream's client alone cuts them at 128 bytes, merging two that
    share their start, and makes up a correlation id). A dead letter whose reason would
    make its headers larger than the connection's ``frame_max`` has the reason cut to fit,
    as :mod:`oncely.brokers.rabbitmq` does (RabbitMQ would close the connection).

NATS (``NatsBroker``, JetStream subscribers)
    The key is the ``Oncely-Message-Id`` header (oncely's producer), else ``Nats-Msg-Id``,
    else ``message_id`` (FastStream's header name). The delivery count is JetStream's
    ``num_delivered``. A copy meeting a running first one, and a failure, are given back with
    ``-NAK`` and a delay; ``num_delivered`` counts both, so the middleware takes the
    give-backs it made of a message (by its stream sequence) off it: ``max_deliveries``
    counts failed runs, and the dead letter says how many failures among how many
    deliveries. A give-back made by another worker, or before a restart, cannot be told
    apart and counts as a failure (dead-lettered sooner, never later). Dead letters are
    published to ``<subject>.dead`` and confirmed by the stream that captures it (created
    when none does, with the server's smallest duplicate window, so it keeps every copy; a
    copy the window would drop is published again with its id in ``x-oncely-message-id``;
    one its reason would make larger than the server's ``max_payload`` has the reason cut to
    fit, as :mod:`oncely.brokers.nats` does),
    then the original is terminated
    (``+TERM``). Refused: core NATS subscriptions (never redelivered), JetStream consumers
    that are not durable (give ``durable=`` to a pull subscriber, or ``queue=`` to a push
    one), batch subscribers, key-value and object-store watches. Give a push consumer read by
    a queue group a fixed ``deliver_subject`` in its ``ConsumerConfig``: members started at
    the same moment each create the consumer, and with a random inbox each only the last
    one's receives. A subscriber whose own
    stream captures ``<subject>.dead`` cannot dead-letter (the copies would come back): its
    refused messages are given back with the error logged until the stream's subjects are
    narrowed. While a handler runs, its message is kept with ``+WPI`` every third of the
    consumer's ``ack_wait``, so it is not delivered again meanwhile. Keep the consumer's
    ``max_deliver``, if set, above ``max_deliveries`` with room for the give-backs of a copy
    meeting a running one: it counts failures and give-backs together (the safety net), and
    a message on its last delivery is dead-lettered, with that reason, rather than given
    back into nothing. Results get the derived id as
    ``Nats-Msg-Id``, so a stream's duplicate window drops a replay too.

Redis (``RedisBroker``, stream subscribers of a consumer group)
    The key is the ``message_id`` header of FastStream's message format
    (``broker.publish(..., headers={"message_id": ...})``), or the ``message_id`` field of an
    entry in :mod:`oncely.brokers.redis_streams`' layout; FastStream invents a
    ``correlation_id`` for every message, never read as a key. The delivery count is Redis's
    own (``XPENDING``) plus the ``x-oncely-delivered`` field of a copy. Redis has no
    negative acknowledgement: a message given back or retried stays pending for the delay,
    then a copy of the entry (every field in order, a repeated name each time, read from
    Redis by the entry's id) is added at the stream's tail and the original acknowledged, in
    one script. A retry's copy carries the count of its delivery; a give-back's the
    deliveries before it (this one ran nothing), read from ``XPENDING`` when the copy is
    written, so it keeps the takeovers Redis counted: an entry claimed by a
    ``min_idle_time`` subscriber after its worker died (mid-run, most often) and given back
    because the dead run's lease is still live keeps that run in its count. The dead runs
    and the failures count together towards ``max_deliveries``; a takeover of an entry that
    was only waiting out a give-back's delay counts too (dead-lettered sooner, never later:
    keep ``min_idle_time`` above ``requeue_delay``). Dead letters are copied
    to ``<stream>.dead``
    the same way, with the ``x-oncely-*`` reasons both as fields of the entry and in the
    headers of FastStream's message format (``message.headers`` of a FastStream subscriber
    of the dead-letter stream). Both happen only while the subscriber's consumer still owns
    the entry. A worker killed mid-handler leaves its entry pending: add a second subscriber
    of the same group with ``min_idle_time`` (FastStream's ``XAUTOCLAIM``), which delivers it
    again once it has been idle that long; while a handler runs, its entry's idle time is
    reset every third of that, so it is not taken over meanwhile. Refused: pub/sub channels
    and lists (neither can deliver a message again), streams read without a consumer group,
    ``no_ack`` and batch subscribers.

Kafka (``KafkaBroker``, aiokafka; subscribers of a consumer group with manual commits)
    The key is the ``message-id`` header (oncely's producer), else ``message_id``, else the
    CloudEvents pair ``ce_source``/``ce_id`` of the Kafka binding (R3), as ``"<source> <id>"``
    (so a header id with a space, which could be an event's, is refused); never the partition
    and offset, which FastStream turns into its message id. A record given back (a copy
    meeting a running first one, a store that cannot answer, a dead letter that could not be
    sent) waits its delay in the subscriber, then the consumer is rewound to it (a seek,
    nothing committed past it): it is read again in its place, nothing written. Kafka counts
    no deliveries, so a failed record is retried as a copy instead: after its backoff a copy
    (value, key, every header, and ``x-oncely-delivered`` with its count) is written to the
    topic's tail and confirmed before FastStream commits past the original (rewound instead
    should the copy fail); the count survives a restart with the record. Dead letters go
    to ``<topic>.dead`` (created through FastStream's admin client when missing) with the
    ``x-oncely-*`` headers plus ``x-oncely-topic``, ``x-oncely-partition`` and
    ``x-oncely-offset``. A tombstone (a record whose value is null: on a compacted topic,
    the deletion of its record key) never reaches the handler, as an empty body or
    otherwise: it is dead-lettered (``rejected``) with a reason saying it is a tombstone, and
    its copy is a tombstone still, with its record key. FastStream's parser fails on a
    header value that is not UTF-8 or is null, so such a record reaches no handler: it is
    dead-lettered all the same, its reason saying so (naming a null header, which the copy
    has empty; and saying whether it is a tombstone) and header lines that are not UTF-8
    kept byte for byte (base64) in ``x-oncely-raw-headers``, rather than passed over by the
    next commit.
    FastStream's Kafka subscribers commit automatically by default
    (``AckPolicy.ACK_FIRST``): give them ``ack_policy=AckPolicy.ACK``, or they are refused,
    as are subscribers without ``group_id`` and batch subscribers. A retried record goes
    behind the records after it: ordering within a partition is not kept for it (R15).
    FastStream's Confluent broker (``faststream.confluent``) is not adapted: its messages
    are refused, never run unprotected.

Works with FastStream's ``TestRabbitBroker``, ``TestNatsBroker``, ``TestRedisBroker`` and
``TestKafkaBroker`` for users' unit tests (dead letters then reach a test subscriber of the
``.dead`` destination). Tested with the ``faststream run`` worker on RabbitMQ 3.10, on NATS
2.9 with JetStream (a durable pull consumer), on Redis 7.0 streams (a consumer group with a
``min_idle_time`` takeover subscriber) and on the Kafka protocol served by Tansu 0.6 (not
Apache Kafka), each with a worker ``SIGKILL``ed mid-handler
(``tests/integrations/test_faststream.py`` and ``test_faststream_streams.py``). Two-phase
mode only.
"""

from __future__ import annotations

from oncely.integrations.faststream._middleware import DEAD_LETTER_SUFFIX, Idempotency

__all__ = ["DEAD_LETTER_SUFFIX", "Idempotency"]

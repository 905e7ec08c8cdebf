"""RabbitMQ: a quorum queue read with manual acknowledgement, and a confirming producer.

::

    import oncely
    from oncely.brokers import BrokerConsumer, ConsumerSettings, open_producer, open_transport

    producer = open_producer("amqp://guest:guest@localhost/", "payments")
    await producer.publish(b'{"order": 7}', message_id="order-7")  # confirmed when it returns

    inbox = oncely.AsyncInbox(oncely.open_async("postgresql://..."), consumer="billing")
    transport = open_transport("amqp://guest:guest@localhost/", "payments", group="billing")
    await BrokerConsumer(transport, inbox, charge, settings=ConsumerSettings()).run()

Topology. The transport (and the producer, when the queue does not exist yet) declares:

- the queue ``source`` as a durable quorum queue (``x-queue-type: quorum``) with
  ``x-dead-letter-exchange`` set to the dead-letter exchange and ``x-delivery-limit`` set to
  ``delivery_limit``;
- the dead-letter exchange, a durable fanout exchange named like the dead-letter queue
  (default ``<source>.dead``), and the dead-letter queue itself (a quorum queue) bound to it.

Declaring is idempotent. A queue that already exists with other arguments is refused with
:class:`~oncely.ConfigurationError` (RabbitMQ cannot change a queue's arguments; give the
producer the same URL options as the consumer, or use a policy and ``declare=false``).

What each outcome does here:

===================  ==========================================================================
processed/duplicate  ``basic.ack``
stale_reclaimed      ``basic.ack``
in_flight            held unacknowledged for what is left of the lease the key is held under
                     (at least ``requeue_delay``, at most 5 minutes), the key's record
                     watched: acked as a ``duplicate``, or run, as soon as the holder ends;
                     else ``basic.nack`` with requeue at the end of the wait
failed               held for the backoff delay, then ``basic.nack`` with requeue; once it
                     has failed ``ConsumerSettings.max_deliveries`` times (the delivery count
                     less the ``in_flight`` requeues this process made of it) it is
                     dead-lettered instead, with the last error as the reason
key_conflict,        published to the dead-letter exchange with ``x-oncely-outcome``,
rejected, escalated  ``x-oncely-reason``, ``x-oncely-consumer`` and ``x-oncely-deliveries``
                     headers (same body, message id, correlation id and original headers,
                     each header name whole up to AMQP's 255 bytes, where aio-pika's encoder
                     alone would cut it at 128), confirmed by the broker (publisher
                     confirms), *then* the original is acked
===================  ==========================================================================

RabbitMQ has no delayed negative acknowledgement, so a retry keeps the message unacknowledged
for the delay (a scheduled task, the consumer goes on with other messages) and then requeues
it. A held message counts against the prefetch window, and is held at most half the
server's ``consumer_timeout`` as stated to the transport (``ack_wait``; 30 minutes unless
given), past which RabbitMQ would close the channel and give back every message on it. If
the channel closes meanwhile the broker requeues the message by itself, which is the same
result.

Delivery counts and the delivery limit. Quorum queues count deliveries and put the count of
earlier deliveries in the ``x-delivery-count`` header of a redelivered message; the transport
reports ``delivery_count = x-delivery-count + 1`` (1 for a first delivery). A queue that marks
a message redelivered without the header (a classic queue, read with ``declare=false``) has
its redeliveries counted by the transport itself, per consumer process (by message id and
body): a message that fails everywhere is dead-lettered after at most ``max_deliveries``
deliveries to each process, rather than given back for good. Every requeue counts:
a failed attempt, an ``in_flight`` requeue, a consumer crash or a lost connection; the
consumer takes the ``in_flight`` requeues it made itself off that count before it compares
it with ``max_deliveries``, which counts failures (those made by another process, or before
a restart, it cannot know: they count as failures, so the message is dead-lettered sooner,
never later). When a
message has been delivered more than ``x-delivery-limit`` times the broker dead-letters it by
itself, which is at-most-once by default and carries no ``x-oncely-*`` reason. That is only a
safety net: keep ``delivery_limit`` above ``ConsumerSettings.max_deliveries`` plus the
requeues an ``in_flight`` duplicate can take (how long a handler runs divided by
``requeue_delay``), so oncely's own dead-lettering, with the reason, always comes first. The
default, :data:`DEFAULT_DELIVERY_LIMIT` (20), suits the default ``max_deliveries`` of 5;
``delivery_limit=0`` in the URL (``None`` in the constructor) declares no limit. Keep dedup
records (R13) longer than a message can keep being redelivered.

Keys. ``Envelope.message_id`` is the AMQP ``message_id`` property, which only the producer
sets (R2); CloudEvents attributes arrive as ``ce-*``, ``cloudEvents_*`` or ``cloudEvents:*``
headers and :class:`~oncely.CloudEventsKey` reads them (R3); publish events with
``cloudevent_headers(..., binding="amqp")`` so other AMQP consumers find them too. The
delivery tag, the ``redelivered`` flag and ``x-delivery-count`` are per delivery and appear
only in ``Envelope.transport`` and :meth:`describe <oncely.brokers.Delivery.describe>` (R4).
Producers built on aiormq (aio-pika, FastStream) get a random ``message_id``, ``uuid4().hex``,
on every message published without one, so a retried publish would look like a new message:
where the key is read from the message id (:class:`~oncely.MessageIdKey`, the default, or a
:class:`~oncely.FirstOf` whose earlier sources find nothing), an id of that exact shape is
refused as made up (the message is dead-lettered as ``rejected``, the reason naming the fixes);
a key read from a header or a body field the message carries is used whatever its id. Always
set the id (:class:`RabbitMQProducer` requires it, and refuses that shape too), or, if your
producers mint ``uuid4().hex`` ids themselves, say so with ``trust_hex_message_ids``. For the
same reason the dead-letter copy of a message that arrived without an id carries a random one,
and that of a message refused for a made-up id keeps it: ``x-oncely-no-message-id`` says the
original had none of its producer's, so give it the producer's id before resubmitting it.

Ack wait. RabbitMQ does not redeliver a message that a live consumer holds, so
``extend_every`` is ``None`` and ``ack_wait`` is accepted (for a URL shared with other brokers)
and unused. The exception is the server's ``consumer_timeout`` (30 minutes by default), after
which the broker closes the channel: keep handlers well below it. A message is redelivered
when its channel or connection closes; the inbox answers that copy ``in_flight`` while the
first handler still runs and ``duplicate`` after it finished (R8).

Connection loss. The transport reconnects on the next :meth:`RabbitMQ.fetch` after a lost
connection (the consumer loop backs off between attempts). Deliveries from the lost channel
can no longer be settled (their delivery tags belong to the old channel): settling them raises
:class:`~oncely.BrokerUnavailable` and the broker redelivers them. A consumer RabbitMQ
cancels (its queue was deleted) is over too, though its channel stays open: the transport
connects and consumes again, declaring the queue where it declares. An idle transport also
checks (a passive declare, every few seconds) that the queue still exists and counts a
consumer. A queue deleted and declared again by a producer within moments can still leave a
consumer that RabbitMQ neither cancels nor serves (seen on 3.10): restart the consumers after
deleting a queue they read.

URL options: ``delivery_limit`` (whole number, 0 for none), ``declare`` (true/false),
``heartbeat``, ``connect_timeout`` and ``confirm_timeout`` (seconds), and
``trust_hex_message_ids`` (true/false: take a ``uuid4().hex`` message id as the producer's).

Tested (``tests/brokers/test_rabbitmq_*.py``, against a real RabbitMQ): producer retries with one
message id, a connection killed under a slow handler (in_flight, then duplicate), two competing
consumers with copies of one message, key conflicts and poison messages read back from the
dead-letter queue with their reasons, retries up to ``max_deliveries``, a broker restart
mid-run, and an empty queue with nothing unacknowledged at the end of each test.
"""

from __future__ import annotations

from oncely.brokers._common import missing_driver

try:  # the import guard: a missing client names the extra that installs it
    import aio_pika  # noqa: F401
except ModuleNotFoundError as exc:
    raise missing_driver(exc, "rabbitmq", "rabbitmq") from exc

from oncely.brokers.rabbitmq._delivery import RabbitMQDelivery
from oncely.brokers.rabbitmq._producer import RabbitMQProducer
from oncely.brokers.rabbitmq._topology import DEFAULT_DELIVERY_LIMIT
from oncely.brokers.rabbitmq._topology import DELIVERY_COUNT_HEADER as DELIVERY_COUNT_HEADER
from oncely.brokers.rabbitmq._topology import LOGGER as LOGGER
from oncely.brokers.rabbitmq._transport import RabbitMQ

__all__ = ["DEFAULT_DELIVERY_LIMIT", "RabbitMQ", "RabbitMQDelivery", "RabbitMQProducer"]

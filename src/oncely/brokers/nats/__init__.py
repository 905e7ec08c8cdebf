"""NATS JetStream: a durable pull consumer per group, a dead-letter stream, and a producer
whose ``Nats-Msg-Id`` makes producer retries recognisable.

::

    import oncely
    from oncely.brokers import BrokerConsumer, ConsumerSettings, open_producer, open_transport

    producer = open_producer("nats://127.0.0.1:4222", "orders.created")
    message_id = oncely.brokers.new_message_id()  # once per logical message, reused on retries
    await producer.publish(b'{"order": 42}', message_id=message_id)

    inbox = oncely.AsyncInbox(oncely.open_async("postgresql://..."), consumer="billing")
    transport = open_transport("nats://127.0.0.1:4222", "orders.created", group="billing")
    await BrokerConsumer(transport, inbox, charge).run(handle_signals=True)

What is declared
    ``source`` is a subject. The stream that captures it is used; when none does, a file
    stream named after the subject (``orders.created`` -> ``orders_created``, or ``stream=``)
    is created with the subject as its only subject. ``group`` is the durable name of an
    explicit-ack pull consumer on that stream filtered to ``source``; every process of the
    group shares it and JetStream hands each message to one of them. The dead-letter
    destination is a subject (default ``<source>.dead``) captured by a stream of its own
    (created if missing, named after that subject or ``dead_letter_stream=``, with the server's
    smallest duplicate window, 100 ms, so it keeps every copy). The main stream
    must not capture the dead-letter subject, or dead-lettered copies would be delivered again:
    the stream created here lists exactly ``source`` (no wildcard), so ``<source>.dead`` stays
    outside it; a source with a wildcard needs an explicit ``dead_letter`` outside its pattern,
    and an existing stream that captures the dead-letter subject is refused at :meth:`open`.

What each outcome does
    ``processed``, ``duplicate`` and ``stale_reclaimed`` are acknowledged (``+ACK``).
    ``in_flight`` is held (``+WPI``) while the key's record is watched, up to what is left of
    the lease it met (at least ``requeue_delay``): acknowledged as a ``duplicate``, or run,
    as soon as the holder ends; else given back with ``-NAK``; ``failed`` with
    ``-NAK`` and the backoff delay. ``key_conflict``, ``rejected`` and ``escalated`` are
    published to the dead-letter subject (same body, the original headers including
    ``Nats-Msg-Id``, plus ``x-oncely-outcome``, ``x-oncely-reason``, ``x-oncely-consumer``,
    ``x-oncely-deliveries``; JetStream's own publish headers, such as
    ``Nats-Expected-Stream`` or ``Nats-Rollup``, renamed ``x-oncely-original-<name>``, as
    the dead-letter stream would refuse the copy or act on them; every line of a header name
    the message repeats, which nats-py can send only once, exact and in order in
    ``x-oncely-raw-headers``, base64-encoded); once the dead-letter
    stream acknowledged the copy, the original
    is terminated (``+TERM``, never redelivered). A crash in between dead-letters it twice,
    never zero times. When the dead-letter stream's duplicate window already holds a copy with
    that id (a stream created elsewhere with a long window), the copy is published again
    without ``Nats-Msg-Id``, carrying the id in ``x-oncely-message-id``, so it is never
    dropped. (A dead letter resubmitted to its stream with its ``Nats-Msg-Id`` within the
    stream's duplicate window is dropped as a retry: wait out the window, or drop the header
    where the id is also in ``Oncely-Message-Id``.) Every settlement is a request the server
    answers, so a settlement that returns
    has reached the server; on a connection that is down it raises
    :class:`~oncely.BrokerUnavailable` at once and the message comes back after ``ack_wait``.
    A running handler's message is kept with ``+WPI`` (in progress) every ``ack_wait / 3``.

Delivery limit
    ``delivery_count`` is JetStream's ``num_delivered``, which counts every delivery: the
    failed runs, and the ``in_flight`` requeues of a copy that met a running one (or a dead
    worker's live lease). The consumer loop dead-letters a message once it has failed
    ``ConsumerSettings.max_deliveries`` times: ``num_delivered`` less the requeues this
    process made of it (a requeue made by another process, or before a restart, is counted
    as a failure: dead-lettered sooner, never later). The stream consumer's own
    ``max_deliver`` (default 20) is a safety net above that (R13), for failures and requeues
    together: keep it above ``max_deliveries`` with room for the requeues a copy can take
    while another runs. JetStream silently stops delivering a message at its ``max_deliver``
    and leaves it unacknowledged, so a give-back (a retry or a requeue) asked for on that
    last delivery dead-letters the message instead (reason: the consumer's ``max_deliver``
    was reached) rather than strand it. Should that copy not be written (the dead-letter
    stream missing, full, or without a leader), the message is kept with ``+WPI`` and the
    copy tried again every ``ack_wait / 3`` until written.

Keys
    The producer's id is the ``Nats-Msg-Id`` header (``Envelope.message_id``); CloudEvents
    ``ce-*`` headers are passed as headers for :class:`~oncely.CloudEventsKey`. The stream
    and consumer sequences, the delivery count and the subject go to ``Envelope.transport``
    only, where no key source reads them (R4).

Duplicate window
    :class:`JetStreamProducer` sets ``Nats-Msg-Id``, so the stream drops a producer retry
    that arrives within its duplicate window (``duplicate_window``, server default two
    minutes; R14, R23). That is a complement only: the window is time-bounded, and it never
    sees redeliveries of a stored message. The inbox is what guarantees one effect.

Connections
    nats-py reconnects by itself (forever, every ``reconnect_wait``); while it is away,
    :meth:`JetStream.fetch` raises :class:`~oncely.BrokerUnavailable` (a fetch that merely
    found no message returns ``[]``), and after a reconnect the stream and consumer are
    declared again before the next fetch, in case the server came back without them.
    A durable consumer deleted under a running transport (an idle fetch finds it missing)
    is declared again starting after the stream sequence it had acknowledged everything up
    to when last seen (``JetStream.ack_floor``), not from the stream's start: that would
    run again the messages the inbox has forgotten. A stream deleted too is read from its
    start.

Stopping
    :meth:`JetStream.stop` drops the pull subscription (the server then drops any pull
    request still waiting on it) and gives back at once, with ``-NAK`` and no delay, every
    message fetched from the server but never handed to a handler: the surplus of a fetch,
    and what nats-py buffered for a pull request that outlived its fetch. Another consumer
    gets those now rather than after ``ack_wait``. Messages whose handlers are running are
    settled as the handlers finish; only a consumer that dies (SIGKILL) or loses its
    connection leaves its messages to come back after ``ack_wait``.

URL options (``nats://user:password@host:4222?ack_wait=30``): ``stream``,
``dead_letter_stream``, ``ack_wait``, ``max_deliver``, ``max_ack_pending``,
``duplicate_window``, ``connect_timeout``, ``timeout`` (each settlement and publish),
``reconnect_wait`` (durations in seconds). The producer reads ``stream``,
``duplicate_window``, ``connect_timeout``, ``timeout`` and ``reconnect_wait``, and refuses
the consumer's own (``ack_wait``, ``max_deliver``, ``max_ack_pending``,
``dead_letter_stream``) as options it does not use.

Tested (``tests/brokers/test_nats_*.py``, against a real nats-server): producer retries dropped
by the window and, outside it, answered ``duplicate`` by the inbox; an ack wait shorter than
the handler; two consumers receiving copies of one message at once; key conflicts, poison,
undecodable and id-less messages read back from the dead-letter stream; retries up to the
delivery limit; a server killed with SIGKILL and restarted mid-run; ``in_flight`` given back
with a delay and not acknowledged; fetch and ack on a dropped connection; buffered messages
given back at a graceful stop while a running handler's is not. Each ends with every effect
applied exactly once and nothing pending or unacknowledged on the consumer.
"""

from __future__ import annotations

from oncely.brokers._common import missing_driver

try:  # the import guard: a missing client names the extra that installs it
    import nats  # noqa: F401
except ModuleNotFoundError as exc:
    raise missing_driver(exc, "nats", "nats") from exc

from oncely.brokers.nats._producer import JetStreamProducer
from oncely.brokers.nats._settings import CONTENT_TYPE_HEADER as CONTENT_TYPE_HEADER
from oncely.brokers.nats._settings import CORRELATION_HEADER as CORRELATION_HEADER
from oncely.brokers.nats._settings import DEFAULT_ACK_WAIT as DEFAULT_ACK_WAIT
from oncely.brokers.nats._settings import DEFAULT_CONNECT_TIMEOUT as DEFAULT_CONNECT_TIMEOUT
from oncely.brokers.nats._settings import DEFAULT_MAX_DELIVER as DEFAULT_MAX_DELIVER
from oncely.brokers.nats._settings import DEFAULT_RECONNECT_WAIT as DEFAULT_RECONNECT_WAIT
from oncely.brokers.nats._settings import DEFAULT_TIMEOUT as DEFAULT_TIMEOUT
from oncely.brokers.nats._settings import LOGGER as LOGGER
from oncely.brokers.nats._settings import MESSAGE_ID_COPY_HEADER as MESSAGE_ID_COPY_HEADER
from oncely.brokers.nats._settings import MSG_ID_HEADER as MSG_ID_HEADER
from oncely.brokers.nats._settings import stream_name_for as stream_name_for
from oncely.brokers.nats._settings import subject_matches as subject_matches
from oncely.brokers.nats._transport import JetStream

__all__ = ["JetStream", "JetStreamProducer"]

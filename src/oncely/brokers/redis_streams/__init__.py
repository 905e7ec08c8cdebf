"""Redis Streams: a stream read by a consumer group, with the key in a field of each entry.

::

    import oncely
    from oncely.brokers import BrokerConsumer, open_producer, open_transport

    producer = open_producer("redis://localhost:6379/0", "payments")
    await producer.publish(b'{"order": 7}', message_id=order_id)  # reuse order_id on retries

    inbox = oncely.AsyncInbox(oncely.open_async("postgresql://..."), consumer="billing")
    transport = open_transport("redis://localhost:6379/0", "payments", group="billing")
    await BrokerConsumer(transport, inbox, charge).run(handle_signals=True)

or with typed options: ``RedisStreams("redis://...", "payments", group="billing",
ack_wait=timedelta(minutes=1), consumer="billing-7")``. Needs Redis 6.2 or later (7 is
tested) and ``pip install 'oncely[redis]'``. A single Redis only: the transport opens a plain
client (a Redis Cluster would need the stream and its dead-letter stream in one hash slot).

Entry layout
------------
:class:`RedisStreamsProducer` writes one entry per publish (``XADD``), with the fields

==================  ===========================================================================
``body``            the message body, raw bytes
``message_id``      the producer-assigned message id (R2): the dedup key by default
``content_type``    e.g. ``application/json`` (read by the default decoder); optional
``correlation_id``  optional
anything else       an application header (``ce-source``/``ce-id`` for CloudEvents, R3; a
                    business key for :class:`~oncely.HeaderKey`)
==================  ===========================================================================

``body_field`` and ``message_id_field`` rename the first two for entries written by other
producers. The entry id (``1718000000000-0``) is the broker's: a producer retry writes a new
entry with a new id, so it is never a key (R4) and goes to ``Envelope.transport`` only.

How it reads
------------
:meth:`RedisStreams.open` creates the group if it is missing (``XGROUP CREATE ... MKSTREAM``;
by default from the start of the stream, so entries written before the first consumer are
read). :meth:`RedisStreams.fetch` reads new entries with ``XREADGROUP COUNT <free slots> BLOCK
<timeout>``. Each transport is one consumer of the group (created when it opens), named
``<host>-<pid>-<random>`` unless ``consumer`` says otherwise.

An entry read but never acknowledged stays in the group's pending list. Every ``claim_every``
(1 s), before reading new entries, the transport runs ``XAUTOCLAIM`` with a minimum idle time
of ``ack_wait``: whatever a crashed or stopped consumer held longer than that is taken over and
delivered again. The delivery count is Redis's own counter of the entry (read with
``XPENDING`` in the same script as the claim), so a new entry is delivery 1 and each takeover
adds one. While a handler runs, the consumer loop calls :meth:`Delivery.extend` every
``ack_wait / 3``, which resets the entry's idle time (``XCLAIM ... JUSTID``, which leaves the
count alone) so no other consumer takes it over meanwhile.

===================  ==========================================================================
outcome              on Redis Streams
===================  ==========================================================================
processed,           ``XACK``
duplicate,
stale_reclaimed
in_flight, failed    retry: Redis has no negative acknowledgement, so the entry stays pending
                     and its idle time is set to ``ack_wait - delay`` (``XCLAIM ... IDLE``): it
                     becomes claimable once ``delay`` has passed, and the next ``XAUTOCLAIM`` (of
                     this or any consumer) delivers it again with the count one higher. A delay
                     longer than ``ack_wait`` waits ``ack_wait``.
key_conflict,        dead-letter: one Lua script (atomic, like ``MULTI``/``EXEC``) copies the
rejected,            entry to ``<stream>.dead`` (or ``dead_letter``) with every original field
escalated            in order (a field name the entry repeats, every time), plus
                     ``x-oncely-outcome``, ``x-oncely-reason``, ``x-oncely-consumer`` and
                     ``x-oncely-deliveries``, and acknowledges the original. Both happen or
                     neither does.
===================  ==========================================================================

Retry, extend and dead-letter act only while this consumer still owns the entry (checked in
the same script): once another consumer has taken it over, the settlement is theirs, so a
message is never dead-lettered twice. Acknowledging is unconditional (the work is done).

Delivery limit: ``ConsumerSettings.max_deliveries`` dead-letters a message that keeps failing.
The entry's delivery counter counts every delivery, the ``in_flight`` give-backs of a copy that
met a running one too; the consumer takes the give-backs it made itself off it, so that
``max_deliveries`` counts failed runs (a give-back made by another process, or before a
restart, counts as a failure: dead-lettered sooner, never later). Redis has no limit of its
own; ``delivery_limit`` adds one for messages whose consumer never
settles them (a handler that crashes the process each time): an entry claimed with a higher
count is dead-lettered as ``rejected`` instead of delivered. Keep it above ``max_deliveries``
(R13).

:meth:`RedisStreams.close` makes the entries it still holds claimable at once and removes its
consumer from the group when it holds nothing. A consumer that never closed (killed with
SIGKILL) would stay registered for good, so each transport deletes, when it opens and then every
``prune_idle_consumers`` (1 hour), the group's consumers that hold no pending entries and have
been idle longer than that (``XINFO CONSUMERS``, ``XGROUP DELCONSUMER``); one that still holds
entries is kept until ``XAUTOCLAIM`` has taken them over.

Acknowledged entries stay in the stream until it is trimmed (``maxlen`` on the producer, or
``XTRIM``); trimming entries not yet read by every group loses them, so trim by age well past
``ack_wait`` and the longest retry backoff.

Durability is the server's: a Redis without ``appendonly`` loses the stream, the group and
its pending list when it restarts.

Tested (``tests/brokers/test_redis_streams_*.py``, against a real Redis): producer retries, a
handler slower than ``ack_wait``, two consumers receiving copies of one message at once,
key conflicts and poison messages dead-lettered with their reasons, retries up to
``max_deliveries``, the delivery limit, ``in_flight`` left pending while another consumer
works, a Redis server killed and restarted mid-run, and idle consumers deleted while one
holding entries is kept; each ends with every effect applied once and nothing pending.
"""

from __future__ import annotations

from oncely.brokers._common import missing_driver

try:  # the import guard: a missing client names the extra that installs it
    import redis  # noqa: F401
except ModuleNotFoundError as exc:
    raise missing_driver(exc, "redis_streams", "redis") from exc

from oncely.brokers.redis_streams._delivery import RedisStreamsDelivery
from oncely.brokers.redis_streams._layout import CONTENT_TYPE_FIELD as CONTENT_TYPE_FIELD
from oncely.brokers.redis_streams._layout import CORRELATION_ID_FIELD as CORRELATION_ID_FIELD
from oncely.brokers.redis_streams._layout import LOGGER as LOGGER
from oncely.brokers.redis_streams._producer import RedisStreamsProducer
from oncely.brokers.redis_streams._transport import RedisStreams

__all__ = ["RedisStreams", "RedisStreamsDelivery", "RedisStreamsProducer"]

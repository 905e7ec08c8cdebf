"""FastStream subscribers that apply each logical message once: a broker middleware on an
:class:`~oncely.AsyncInbox` (RabbitMQ).

::

    from faststream.rabbit import RabbitBroker
    from oncely.integrations.faststream import Idempotency

    inbox = oncely.AsyncInbox(store, consumer="billing")
    broker = RabbitBroker(url, middlewares=[Idempotency(inbox)])

    @broker.subscriber("orders")
    async def charge(order: Order) -> None: ...

    await broker.publish(order, "orders", message_id=new_message_id())  # once per message

The key is the producer's ``message_id`` (or ``key=``: any :mod:`oncely` key source, read
from the raw message). The claim is taken *before* FastStream decodes the body; what each
delivery gets:

=====================================  ================================================
the first delivery of a key            the handler runs; its result is stored and
                                       published (reply, ``@publisher``) as usual
a duplicate (the key completed)        acknowledged, the handler not run; the stored
                                       result is published again, so a reply lost to a
                                       crash after the claim completed is not lost
a copy while the first still runs      given back ``requeue_delay`` later
the handler raised                     retried after ``backoff``, dead-lettered with the
                                       last error after ``max_deliveries``
the key with another body              dead-lettered (``key_conflict``)
no key, or an id the client invented   dead-lettered (``rejected``) with the reason
a body FastStream cannot decode        dead-lettered (``rejected``), never left
                                       unacknowledged
the handler raised :class:`oncely.Reject`  dead-lettered with its reason
or FastStream's ``RejectMessage``
the handler raised ``AckMessage``      the key completes (nothing is published)
the handler raised ``NackMessage``     a failure: retried as above
the store cannot answer                given back, never run unprotected
the dead-letter copy cannot be sent    given back, never acknowledged without its copy
=====================================  ================================================

Keep the subscriber's ``ack_policy`` at its default: with ``AckPolicy.ACK_FIRST`` FastStream
acknowledges before the handler runs, so nothing can be retried or dead-lettered.

Invented ids: FastStream hands a handler a random ``message_id`` when the producer set none,
and aio-pika's client (aiormq) gives every message it publishes without one a random
``uuid4().hex``. Neither is a producer's id: a retry of such a message would look new. The
middleware reads the raw AMQP property, and refuses a 32-character lowercase uuid4 hex id
(the client's shape) unless ``trust_hex_message_ids=True`` says the producers mint that
shape themselves. :func:`oncely.brokers.new_message_id` ids (dashed uuid4) always pass.

Results the handler publishes get a message id derived from the consumer, the key and the
destination, unless the handler set one: a republished result (a duplicate's) has the same
id as the first, so a downstream oncely consumer drops it.

Dead letters go to ``<queue>.dead`` (declared durable), with the same ``x-oncely-outcome``,
``x-oncely-reason``, ``x-oncely-consumer`` and ``x-oncely-deliveries`` headers as
:mod:`oncely.brokers`; every byte of the body and every header kept.

With a mapping ``{queue name: inbox}``, only the listed subscribers take part. Works with
FastStream's ``TestRabbitBroker`` (the dead-letter queue is then a test subscriber's). A
subscriber of a ``*.dead`` queue is left alone. FastStream's Kafka, NATS and Redis brokers
are not adapted yet: their messages are refused (:class:`~oncely.ConfigurationError`), never
run unprotected.
Tested with the ``faststream run`` worker on RabbitMQ, a worker ``SIGKILL``ed mid-handler
included (``tests/integrations/test_faststream.py``). Two-phase mode only.
"""

from __future__ import annotations

from oncely.integrations.faststream._middleware import DEAD_LETTER_SUFFIX, Idempotency

__all__ = ["DEAD_LETTER_SUFFIX", "Idempotency"]

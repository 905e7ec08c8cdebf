"""Amazon SQS: a queue read with long polling, the key in the ``message-id`` message attribute.

::

    import oncely
    from oncely.brokers import BrokerConsumer, open_producer, open_transport

    # the consumer: creates the queue "payments" and "payments-dead" if they are missing
    inbox = oncely.AsyncInbox(oncely.open_async("postgresql://..."), consumer="billing")
    transport = open_transport("sqs://eu-west-1", "payments", group="billing")
    await BrokerConsumer(transport, inbox, charge).run(handle_signals=True)

    # a producer, elsewhere: the queue must exist
    producer = open_producer("sqs://eu-west-1", "payments")
    await producer.publish(b'{"order": 7}', message_id=order_id)  # reuse order_id on retries

Needs ``pip install 'oncely[sqs]'`` (aiobotocore). ``sqs://HOST:PORT`` is a plain-HTTP
endpoint such as an emulator's (``?secure=true`` for HTTPS); ``sqs://REGION`` and ``sqs://``
are AWS itself, with the region from the URL, ``?region=`` or ``AWS_REGION``, and credentials
from the usual AWS environment (never the URL): credentials it cannot find are a
:class:`~oncely.BrokerError` naming them, not an outage to wait out. Tested on moto's server (the
SQS API), not on AWS.

Message layout
--------------
:class:`SQSProducer` sends the body as the message body (UTF-8 text; other bytes base64 with
``x-oncely-body-encoding: base64``) and String message attributes:

==================  ===========================================================================
``message-id``      the producer-assigned message id (R2): the dedup key by default; on a FIFO
                    queue, with the body, the ``MessageDeduplicationId`` (R14, R20)
``content-type``    e.g. ``application/json`` (read by the default decoder)
``correlation-id``  optional
anything else       an application header (CloudEvents ``ce-*``, R3; a business key)
==================  ===========================================================================

SQS carries at most ten attributes per message. SQS's own ``MessageId`` is new on every send,
so a producer retry gets a new one: it is never a key (R4) and goes to ``Envelope.transport``
only (``sqs_message_id``), with the receive count. A message without a ``message-id`` is
dead-lettered as ``rejected`` unless the key source reads another key (a business key in the
body or an attribute).

How outcomes are carried out
----------------------------
===================  ==========================================================================
outcome              on SQS
===================  ==========================================================================
processed,           ``DeleteMessage``
duplicate,
stale_reclaimed
in_flight, failed    ``ChangeMessageVisibility`` to the delay (whole seconds): SQS hands it out
                     again then, its ``ApproximateReceiveCount`` (the delivery count) one higher
key_conflict,        a copy with the original's attributes plus ``x-oncely-outcome``,
rejected,            ``x-oncely-reason``, ``x-oncely-consumer``, ``x-oncely-deliveries`` and
escalated            ``x-oncely-queue`` is sent to the dead-letter queue, then
                     the original deleted. Where that would pass ten attributes the original's
                     application attributes travel as one JSON attribute, ``x-oncely-attributes``
                     (a ``String`` one as its text; a ``Binary`` or ``Number`` one as an object
                     with its ``DataType`` and base64 ``BinaryValue`` or ``StringValue``).
                     SQS counts attributes in a message's size: a reason that would make the
                     copy larger than the dead-letter queue's ``MaximumMessageSize`` is cut
                     to fit (and says so); the body and the other attributes are kept whole.
===================  ==========================================================================

Each received message gets the transport's visibility timeout (``ack_wait``, 30 s by default)
and a running handler's is extended every third of it, so another consumer never receives a
message a live handler holds (R10); a crashed consumer's messages come back once it lapses. A
queue with a redrive policy moves a message to its own dead-letter queue after
``maxReceiveCount`` receives, without a reason: keep that count above the consumer's
``max_deliveries`` (R13), with room for the give-backs of ``in_flight`` copies, which SQS
counts as receives too (``max_deliveries`` itself counts failures: the consumer takes the
give-backs it made of a message off its ``ApproximateReceiveCount``; one made by another
process, or before a restart, counts as a failure, so the message is dead-lettered sooner,
never later). On a FIFO queue, room for the messages of a group held back behind a failing
one as well: each retry of the failing message brings the ones behind it in its receive (up
to nine) with it, given back unrun, and each such receive counts. A message that reaches its
last receive so has had fewer runs than ``max_deliveries`` (none, when it was held back on
every receive): it is dead-lettered then, with the reason, and its group goes on without it,
out of the order sent. Give ``maxReceiveCount`` room for the retries of the messages ahead
of one in its group, not only for its own. The consumer reads it from the queue for its
horizon, with the queue's ``MessageRetentionPeriod``, and warns at start when it is not above
``max_deliveries``; a message it would give back on its last receive is dead-lettered
instead, with the reason. The dead-letter queue is the one given (``dead_letter=``,
``oncely consume --dead-letter``), else the redrive policy's target where the queue has one
(so that every dead letter, oncely's with its reason and SQS's without, is in one queue),
else ``<queue>-dead`` (``<name>-dead.fifo``). Missing queues are created by the consumer when it
starts (``create=false`` refuses instead), never by a producer, which needs its queue to
exist. A queue deleted while the consumer runs is not created again (it would lack the
attributes it was given: redrive policy, retention, encryption, access policy): the consumer
logs one ERROR naming it, takes each receive that finds it missing as an outage waited out
with ``ConsumerSettings.reconnect`` (a WARNING each), and reads it again, saying so, once it
exists again (its URL looked up anew, its attributes read again); a
FIFO queue's order is its ``MessageGroupId`` (the producer's ``group=``): the messages of one
group that come in one receive run one after another, in batches and with ``batch=1`` alike,
and a message given back holds up its group until it is settled (those behind it in the
receive are given back unrun).
"""

from __future__ import annotations

from oncely.brokers._common import missing_driver

try:  # the import guard: a missing client names the extra that installs it
    import aiobotocore  # noqa: F401
except ModuleNotFoundError as exc:
    raise missing_driver(exc, "sqs", "sqs") from exc

from oncely.brokers.sqs._endpoint import LOGGER as LOGGER
from oncely.brokers.sqs._endpoint import MESSAGE_ID_ATTRIBUTE as MESSAGE_ID_ATTRIBUTE
from oncely.brokers.sqs._producer import SQSProducer
from oncely.brokers.sqs._transport import SQS, SQSDelivery

__all__ = ["SQS", "SQSDelivery", "SQSProducer"]
